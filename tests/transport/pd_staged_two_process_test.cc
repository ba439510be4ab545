// The staged prefill/decode path (pd_staged.h) in two processes over UCX on 127.0.0.1 (TCP), with the KV in
// device memory on both sides: the host backend's device memory (CI), or, built with KVTIER_PD_STAGED_CUDA,
// CUDA memory of GPU 0 (both processes on the one GPU; skipped where none is visible). The test is the decode
// side; it re-executes its own binary as the prefill helper (KVTIER_PD_STAGED_HELPER selects it), blobs travel
// over pipes, every wait is bounded and the helper kills itself after 30 s.
//
// The prefill's "forward" writes layer l of its device blocks on a compute stream at start + (l + 1) *
// layer_ms and records an event; the layer is declared with layer_ready_after(event), so a staging copy that
// ran before the forward would carry the poison, not the pattern. Destinations are poisoned; every byte is
// compared with the CPU reference (pattern()).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "kvtier/copy/copy_engine.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transport/pd_staged.h"
#include "transport/pd_test_util.h"
#ifdef KVTIER_PD_STAGED_CUDA
#include "kvtier/device/cuda_device.h"
#endif

extern char** environ;

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;
using testing::fill_pattern;
using testing::matches_pattern;
using testing::pattern;
using testing::pd_layout;

constexpr std::uint32_t kLayers = 4;
constexpr std::uint64_t kBlocks = 8;
const std::vector<BlockId> kSrc = {3, 1, 7, 5};
const std::vector<BlockId> kDst = {6, 0, 2, 4};
constexpr TransferId kXid = 91;
constexpr std::byte kPoison{0xee};

#ifdef KVTIER_PD_STAGED_CUDA
Result<std::unique_ptr<Device>> open_device() {
  if (cuda_device_count() == 0) return Unavailable("no CUDA device");
  return create_cuda_device(0);
}
constexpr bool kCuda = true;
#else
Result<std::unique_ptr<Device>> open_device() {
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
  return std::unique_ptr<Device>(std::move(host));
}
constexpr bool kCuda = false;
#endif

// Device blocks (layer-first, one allocation per plane) and a pinned host mirror of the same shape, used to
// fill them (the prefill's forward) or read them back (the decode's checks).
struct DeviceBlocks {
  std::vector<Buffer> planes;
  BlockSpace space;
  StagingSpace host;  // the mirror

  static Result<DeviceBlocks> make(Device& dev, const KvLayout& layout, bool pattern_in_mirror) {
    DeviceBlocks d;
    std::vector<std::vector<void*>> bases(layout.num_layers());
    KVTIER_ASSIGN_OR_RETURN(d.host, StagingSpace::allocate(dev, layout, kBlocks));
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint64_t bytes = BlockSpace::layer_first_region_bytes(layout, l, r, kBlocks);
        KVTIER_ASSIGN_OR_RETURN(Buffer b, dev.allocate_device(bytes));
        std::byte* m = d.host.space.block_ptr(l, r, 0);
        std::memset(m, static_cast<int>(kPoison), bytes);
        KVTIER_RETURN_IF_ERROR(dev.memcpy_sync(b.data(), m, bytes));  // poisoned device memory
        if (pattern_in_mirror)
          for (std::uint64_t blk = 0; blk < kBlocks; ++blk)
            fill_pattern(m + blk * layout.block_bytes(l, r), l, r, blk, layout.block_bytes(l, r));
        bases[l].push_back(b.data());
        d.planes.push_back(std::move(b));
      }
    KVTIER_ASSIGN_OR_RETURN(
        d.space, BlockSpace::layer_first(MemoryKind::kDevice, dev.ordinal(), layout, kBlocks, std::move(bases)));
    return d;
  }

  // Bytes [first, last) of layer l's planes (one allocation per plane: the union of their ranges is checked
  // per plane by the failure predicates below).
  bool in_layer(const BlockSpace& s, std::uint32_t l, const void* p) const {
    for (std::uint32_t r = 0; r < s.layout().num_roles(l); ++r) {
      const auto* b = s.block_ptr(l, r, 0);
      const auto* e = b + BlockSpace::layer_first_region_bytes(s.layout(), l, r, kBlocks);
      if (p >= b && p < e) return true;
    }
    return false;
  }
};

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n, std::chrono::milliseconds timeout) {
  auto* b = static_cast<char*>(p);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool send_blob(int fd, const std::vector<std::byte>& blob) {
  const std::uint32_t n = static_cast<std::uint32_t>(blob.size());
  return write_all(fd, &n, 4) && write_all(fd, blob.data(), blob.size());
}

Result<std::vector<std::byte>> recv_blob(int fd) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, 4, 20s) || n > (1u << 24)) return Unavailable("no blob from the other process");
  std::vector<std::byte> b(n);
  if (!read_all(fd, b.data(), n, 10s)) return Unavailable("truncated blob from the other process");
  return b;
}

StagedOptions staged_options() {
  StagedOptions o;
  o.pd = PdOptions{50ms, 500ms};
  // Per-run DMAs pass their destination to the host backend's failure injection.
  if (!kCuda) o.strategy = CopyStrategy::kDmaPerRun;
  return o;
}

struct HelperArgs {
  PdMode mode = PdMode::kPush;
  int layer_ms = 0;
  int fail_layer = -1;  // the staging copy (device -> staging) of this layer fails (host backend)
  int in_fd = -1, out_fd = -1;
};

// The prefill process. Exit codes: 0 done, 4 transfer failed, 5 setup.
int run_helper(const HelperArgs& a) {
  alarm(30);
  const KvLayout layout = pd_layout(kLayers);
  auto dev = open_device();
  if (!dev.ok()) return 5;
  auto engine = CopyEngine::create(**dev);
  if (!engine.ok()) return 5;
  auto blocks = DeviceBlocks::make(**dev, layout, true);
  auto staging = StagingSpace::allocate(**dev, layout, kBlocks);
  auto compute = (*dev)->create_stream({StreamPriority::kNormal, "compute"});
  if (!blocks.ok() || !staging.ok() || !compute.ok()) return 5;
  if (a.fail_layer >= 0) {
    auto* host = dynamic_cast<HostDevice*>(dev->get());
    if (host == nullptr) return 5;
    const BlockSpace st = staging->space;
    const auto l = static_cast<std::uint32_t>(a.fail_layer);
    host->set_failure_predicate(
        [st, l, &b = *blocks](std::uint64_t, const void* dst, std::uint64_t) { return b.in_layer(st, l, dst); });
  }
  auto t = create_ucx_transport({"prefill", layout.fingerprint(), 1, 0}, UcxOptions{"tcp", "lo", {}});
  if (!t.ok()) return 5;
  auto pre = PdStagedPrefill::create(**t, **dev, **engine, blocks->space, staging->space, staged_options());
  if (!pre.ok()) {
    std::fprintf(stderr, "prefill helper: %s\n", pre.status().to_string().c_str());
    return 5;
  }
  auto blob = (*t)->export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = (*t)->load_peer(*peer_blob);
  if (!peer.ok() || !(*pre)->begin(*peer, kXid, kSrc).ok()) return 5;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Event>> events;
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    std::this_thread::sleep_until(start + (l + 1) * std::chrono::milliseconds(a.layer_ms));
    // The forward writes layer l; the staging copy must wait for it on the device, not on the host.
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
      if (!(*dev)
               ->memcpy_async(blocks->space.block_ptr(l, r, 0), blocks->host.space.block_ptr(l, r, 0),
                              BlockSpace::layer_first_region_bytes(layout, l, r, kBlocks), **compute)
               .ok())
        return 5;
    auto ev = (*dev)->create_event();
    if (!ev.ok() || !(*dev)->record(**ev, **compute).ok()) return 5;
    if (!(*pre)->layer_ready_after(kXid, l, **ev).ok()) return 5;
    events.push_back(std::move(ev).value());
  }
  auto st = (*pre)->wait(kXid, 20s);
  const bool ok = st.ok() && st->done;
  if (st.ok() && !(*pre)->forget(kXid).ok()) return 5;
  std::this_thread::sleep_for(50ms);
  (*dev)->synchronize(**compute, 10s).ignore_error();
  return ok ? 0 : 4;
}

TEST(PdStagedHelper, PrefillProcess) {
  const char* spec = std::getenv("KVTIER_PD_STAGED_HELPER");
  if (spec == nullptr) GTEST_SKIP() << "runs only as the spawned prefill process";
  HelperArgs a;
  int mode = 0;
  if (std::sscanf(spec, "%d %d %d %d %d", &mode, &a.layer_ms, &a.fail_layer, &a.in_fd, &a.out_fd) != 5) _exit(5);
  a.mode = static_cast<PdMode>(mode);
  std::fflush(stdout);
  _exit(run_helper(a));
}

struct Child {
  pid_t pid = -1;
  int to_child = -1, from_child = -1;

  static Result<Child> spawn(const HelperArgs& a) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) return Internal("pipe");
    Child c;
    const std::string spec =
        fmt::format("{} {} {} {} {}", static_cast<int>(a.mode), a.layer_ms, a.fail_layer, down[0], up[1]);
    c.pid = fork();
    if (c.pid < 0) return Internal("fork");
    if (c.pid == 0) {
      close(down[1]);
      close(up[0]);
      setenv("KVTIER_PD_STAGED_HELPER", spec.c_str(), 1);
      char self[] = "/proc/self/exe";
      char filter[] = "--gtest_filter=PdStagedHelper.PrefillProcess";
      char* argv[] = {self, filter, nullptr};
      execve(self, argv, environ);
      _exit(127);
    }
    close(down[0]);
    close(up[1]);
    c.to_child = down[1];
    c.from_child = up[0];
    return c;
  }

  // Exit status, or -signal; -1000 on timeout (then the child is killed).
  int reap(std::chrono::milliseconds timeout = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        close(to_child);
        close(from_child);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      std::this_thread::sleep_for(5ms);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1000;
  }
};

// The decode side, connected to a freshly spawned prefill. Members in destruction order: the endpoint, the
// transport, then the memory.
struct DecodeRig {
  KvLayout layout = pd_layout(kLayers);
  std::unique_ptr<Device> dev;
  std::unique_ptr<CopyEngine> engine;
  DeviceBlocks blocks;
  StagingSpace staging;
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Transport> t;
  std::unique_ptr<PdStagedDecode> dec;
  Child child;
  PeerId peer = 0;
  bool skipped = false;

  ~DecodeRig() {
    dec.reset();
    t.reset();
    if (compute) dev->synchronize(*compute, 10s).ignore_error();
  }

  void start(const HelperArgs& a, int fail_copy_layer = -1) {
    auto d = open_device();
    if (!d.ok()) {
      skipped = true;
      GTEST_SKIP() << d.status().to_string();
    }
    dev = std::move(d).value();
    engine = CopyEngine::create(*dev).value();
    auto b = DeviceBlocks::make(*dev, layout, false);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    blocks = std::move(b).value();
    staging = StagingSpace::allocate(*dev, layout, kBlocks).value();
    compute = dev->create_stream({StreamPriority::kNormal, "decode-compute"}).value();
    if (fail_copy_layer >= 0) {
      auto* host = dynamic_cast<HostDevice*>(dev.get());
      ASSERT_NE(host, nullptr);
      const BlockSpace s = blocks.space;
      const auto l = static_cast<std::uint32_t>(fail_copy_layer);
      host->set_failure_predicate(
          [s, l, this](std::uint64_t, const void* dst, std::uint64_t) { return blocks.in_layer(s, l, dst); });
    }
    auto tr = create_ucx_transport({"decode", layout.fingerprint(), 1, 0}, UcxOptions{"tcp", "lo", {}});
    ASSERT_TRUE(tr.ok()) << tr.status().to_string();
    t = std::move(tr).value();
    auto e = PdStagedDecode::create(*t, *dev, *engine, blocks.space, staging.space, staged_options());
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    dec = std::move(e).value();
    auto c = Child::spawn(a);
    ASSERT_TRUE(c.ok());
    child = *c;
    ASSERT_TRUE(send_blob(child.to_child, t->export_metadata().value()));
    auto blob = recv_blob(child.from_child);
    ASSERT_TRUE(blob.ok()) << blob.status().to_string();
    auto p = t->load_peer(*blob);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    peer = *p;
  }

  // Device block `dst` holds, in layer l, the CPU reference of prefill block `src` (read back on `compute`,
  // after `after` when given: what a forward waiting on the layer's event would read).
  bool layer_matches(std::uint64_t dst, std::uint32_t l, std::uint64_t src, Event* after = nullptr) {
    if (after != nullptr && !dev->wait(*compute, *after).ok()) return false;
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const std::uint64_t n = layout.block_bytes(l, r);
      std::byte* m = blocks.host.space.block_ptr(l, r, dst);
      std::memset(m, 0, n);
      if (!dev->memcpy_async(m, blocks.space.block_ptr(l, r, dst), n, *compute).ok()) return false;
    }
    if (!dev->synchronize(*compute, 10s).ok()) return false;
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      if (!matches_pattern(blocks.host.space.block_ptr(l, r, dst), l, r, src, layout.block_bytes(l, r))) return false;
    }
    return true;
  }
};

class StagedTwoProcess : public ::testing::TestWithParam<PdMode> {};

TEST_P(StagedTwoProcess, DeviceToDeviceLayerWiseIsByteExactAndTheForwardWaitsPerLayer) {
  DecodeRig rig;
  rig.start(HelperArgs{GetParam(), 150});
  if (rig.skipped || HasFatalFailure()) return;
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), kDst).ok());
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    auto ev = rig.dec->layer_event(kXid, l, 10s);
    ASSERT_TRUE(ev.ok()) << ev.status().to_string();
    // The forward's stream waits on the event, not the host: its reads see the layer.
    for (std::size_t i = 0; i < kDst.size(); ++i)
      EXPECT_TRUE(rig.layer_matches(kDst[i], l, kSrc[i], *ev)) << "layer " << l << " position " << i;
    auto ls = rig.dec->wait_layer(kXid, l, 10s);
    ASSERT_TRUE(ls.ok()) << ls.status().to_string();
    ASSERT_EQ(*ls, LayerState::kLoaded) << "layer " << l;
    if (l == 0) {
      auto s = rig.dec->status(kXid);
      ASSERT_TRUE(s.ok());
      EXPECT_EQ(s->layers[kLayers - 1], LayerState::kPending);
      EXPECT_EQ(s->block_loaded, std::vector<bool>(4, false));  // no block is loaded before all its layers are
    }
  }
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u);
  EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
  // Blocks outside the transfer are untouched (still poison).
  EXPECT_FALSE(rig.layer_matches(1, 0, 1));
  EXPECT_EQ(rig.dec->staging_blocks_free(), kBlocks - 4);
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
  EXPECT_EQ(rig.dec->staging_blocks_free(), kBlocks);
  EXPECT_EQ(rig.child.reap(), 0);
}

TEST_P(StagedTwoProcess, PrefillKilledMidTransferFailsTheUnfinishedLayersAndNoBlockIsLoaded) {
  DecodeRig rig;
  rig.start(HelperArgs{GetParam(), 300});
  if (rig.skipped || HasFatalFailure()) return;
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), kDst).ok());
  ASSERT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  kill(rig.child.pid, SIGKILL);
  EXPECT_EQ(rig.child.reap(), -SIGKILL);
  auto fin = rig.dec->wait(kXid, 10s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[0], LayerState::kLoaded);
  for (std::uint32_t l = 1; l < kLayers; ++l) {
    EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
    EXPECT_FALSE(rig.dec->layer_event(kXid, l, 1s).ok()) << l;  // no event to run a forward on
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_FALSE(rig.layer_matches(kDst[i], l, kSrc[i])) << l;
  }
  EXPECT_EQ(fin->block_loaded, std::vector<bool>(4, false));
  EXPECT_FALSE(fin->error.ok());
  auto rec = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string();
  EXPECT_TRUE(rec->reclaimable);
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
  EXPECT_EQ(rig.dec->staging_blocks_free(), kBlocks);
}

INSTANTIATE_TEST_SUITE_P(Modes, StagedTwoProcess, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });

// The prefill's device -> staging copy of layer 2 fails: layers 0 and 1 arrive, layer 2 and the rest are
// failed on the decode side at once (not after the lease), no block is loaded.
TEST(StagedTwoProcessFaults, PrefillStagingCopyFailureFailsThatLayerAndNoBlockIsLoaded) {
  if (kCuda) GTEST_SKIP() << "fault injection needs the host backend";
  DecodeRig rig;
  rig.start(HelperArgs{PdMode::kPush, 50, 2});
  if (HasFatalFailure()) return;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, PdMode::kPush, kDst).ok());
  auto fin = rig.dec->wait(kXid, 10s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 450ms);  // the lease is 500 ms
  EXPECT_EQ(fin->layers[0], LayerState::kLoaded);
  EXPECT_EQ(fin->layers[1], LayerState::kLoaded);
  EXPECT_EQ(fin->layers[2], LayerState::kFailed);
  EXPECT_EQ(fin->layers[3], LayerState::kFailed);
  EXPECT_EQ(fin->block_loaded, std::vector<bool>(4, false));
  EXPECT_EQ(fin->leading_loaded_blocks(), 0u);
  for (std::size_t i = 0; i < kDst.size(); ++i) {
    EXPECT_TRUE(rig.layer_matches(kDst[i], 1, kSrc[i]));
    EXPECT_FALSE(rig.layer_matches(kDst[i], 2, kSrc[i]));
  }
  EXPECT_TRUE(rig.dec->wait(kXid, 10s, true).ok());
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
  EXPECT_EQ(rig.child.reap(), 4);
}

// The decode's staging -> device copy of layer 1 fails: the wire verified it, yet the layer is failed (never
// loaded), and so is every block.
TEST(StagedTwoProcessFaults, DecodeStagingCopyFailureFailsThatLayerEvenThoughTheWireVerifiedIt) {
  if (kCuda) GTEST_SKIP() << "fault injection needs the host backend";
  DecodeRig rig;
  rig.start(HelperArgs{PdMode::kPull, 20}, 1);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, PdMode::kPull, kDst).ok());
  EXPECT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  EXPECT_EQ(rig.dec->wait_layer(kXid, 1, 10s).value(), LayerState::kFailed);
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[1], LayerState::kFailed);
  EXPECT_EQ(fin->block_loaded, std::vector<bool>(4, false));
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss) << fin->error.to_string();
  EXPECT_NE(fin->error.message().find("layer 1 staging copy"), std::string::npos) << fin->error.to_string();
  for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_FALSE(rig.layer_matches(kDst[i], 1, kSrc[i]));
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
  rig.child.reap();
}

}  // namespace
}  // namespace kvtier::transport
