// Prefill and decode in two processes over UCX on 127.0.0.1 (TCP), or, built with KVTIER_PD_IPC, over the
// same-host ipc backend (pd_ipc_two_process_test). The test is the decode side; it re-executes
// its own binary as the prefill helper (KVTIER_PD_HELPER in the environment selects the helper before gtest
// starts). Blobs travel over pipes. Every wait is bounded and the helper kills itself after 30 s (alarm).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transport/ipc.h"
#include "kvtier/transport/pd.h"
#include "transport/pd_test_util.h"

extern char** environ;

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;
using testing::as_device;
using testing::HostBlocks;
using testing::layer_matches;
using testing::pd_layout;

constexpr int kLayers = 4;
const std::vector<BlockId> kSrc = {3, 1, 7, 5};
constexpr TransferId kXid = 77;

Result<std::unique_ptr<Transport>> make_transport(std::string name, const KvLayout& layout) {
#ifdef KVTIER_PD_IPC
  return create_ipc_transport({std::move(name), layout.fingerprint(), 1, 0});
#else
  // KVTIER_PD_TEST_TLS=shm (set by the shared-memory cases, inherited by the helper) picks UCX's shm lane.
  const char* tls = std::getenv("KVTIER_PD_TEST_TLS");
  // KVTIER_PD_TEST_TLS=tcp-rma: TCP with UCX's emulated RMA instead of TCP's default active-message data path.
  if (tls != nullptr && std::string_view(tls) == "shm")
    return create_ucx_transport({std::move(name), layout.fingerprint(), 1, 0}, UcxOptions{"shm", "", {}});
  UcxOptions o{"tcp", "lo", {}};
  if (tls != nullptr && std::string_view(tls) == "tcp-rma") o.data_path = UcxDataPath::kRma;
  return create_ucx_transport({std::move(name), layout.fingerprint(), 1, 0}, std::move(o));
#endif
}

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
  if (!read_all(fd, &n, 4, 10s) || n > (1u << 24)) return Unavailable("no blob from the other process");
  std::vector<std::byte> b(n);
  if (!read_all(fd, b.data(), n, 10s)) return Unavailable("truncated blob from the other process");
  return b;
}

struct HelperArgs {
  PdMode mode = PdMode::kPush;
  int layer_ms = 0;                // layer l is ready at start + (l + 1) * layer_ms
  std::uint64_t wrong_layout = 0;  // nonzero: the prefill's blocks are of another size (another fingerprint)
  std::int64_t corrupt_op = -1;
  int in_fd = -1, out_fd = -1;
  int stop_before_write = -1;  // >= 0: the helper stops itself (SIGSTOP) as it posts that layer's write
  int ring_slots = 0;          // > 0: the ring lane (host backend: "device" blocks in RAM, the ring a shared memfd)
  int host_direct = 0;         // 1: the host direct lane, both pools in the transport's memory (allocate_host)
};

// Layer-first host blocks in memory the transport allocated (allocate_host: on UCX's shared-memory lane the peer maps
// it, which the host direct lane needs), holding the pattern or the poison.
Result<BlockSpace> transport_blocks(Transport& t, const KvLayout& layout, std::uint64_t num_blocks, bool fill) {
  std::uint64_t total = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) total += layout.block_bytes(l, r) * num_blocks;
  KVTIER_ASSIGN_OR_RETURN(std::span<std::byte> mem, t.allocate_host(total));
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::uint64_t at = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      std::byte* p = mem.data() + at;
      for (std::uint64_t b = 0; b < num_blocks; ++b) {
        std::byte* block = p + b * layout.block_bytes(l, r);
        if (fill)
          testing::fill_pattern(block, l, r, b, layout.block_bytes(l, r));
        else
          std::memset(block, 0xee, layout.block_bytes(l, r));
      }
      bases[l].push_back(p);
      at += layout.block_bytes(l, r) * num_blocks;
    }
  return BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, num_blocks, std::move(bases));
}

PdOptions host_direct_options() {
  PdOptions o{50ms, 500ms};
  o.host_direct = true;
  return o;
}

// The ring lane's options: slots of two blocks of a layer, so a 4-block transfer goes in 2 pieces per layer.
PdOptions ring_options(CopyEngine* engine, int slots) {
  PdOptions o{50ms, 500ms};
  o.engine = engine;
  o.ring_slots = static_cast<std::uint32_t>(slots);
  o.ring_slot_bytes = 2 * 2 * 8192;
  return o;
}

// The prefill's transport with a pause in the middle of a post: the helper stops itself (SIGSTOP) when it posts
// the WRITE of layer `layer`, after its lease checks passed, and forwards the post once continued. To the decode
// side this is a prefill paused with its write posted: the bytes land after the pause, whenever that ends.
class StopBeforeWrite final : public testing::ForwardingTransport {
 public:
  StopBeforeWrite(std::unique_ptr<Transport> inner, int layer) : ForwardingTransport(std::move(inner)), layer_(layer) {}
  Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local, std::span<const RemoteDesc> remote,
                      std::string notification) override {
    std::uint32_t layer = 0;
    if (op == XferOp::kWrite && notification.size() >= 13 && notification[0] == 'W') {
      std::memcpy(&layer, notification.data() + 9, 4);
      if (static_cast<int>(layer) == layer_ && !stopped_) {
        stopped_ = true;
        raise(SIGSTOP);
      }
    }
    return inner().post(op, peer, local, remote, std::move(notification));
  }

 private:
  const int layer_;
  bool stopped_ = false;
};

// The prefill process. Exit codes: 0 done, 3 refused peer, 4 transfer failed, 5 setup.
int run_helper(const HelperArgs& a) {
  alarm(30);
  const KvLayout layout = a.wrong_layout != 0 ? pd_layout(kLayers, 4096) : pd_layout(kLayers);
  HostBlocks mem = HostBlocks::make(layout, 8, true);
  auto t = make_transport("prefill", layout);
  if (!t.ok()) return 5;
  std::unique_ptr<Transport> transport = wrap_with_wire_faults(std::move(t).value(), WireFaults{a.corrupt_op, 17});
  if (a.stop_before_write >= 0)
    transport = std::make_unique<StopBeforeWrite>(std::move(transport), a.stop_before_write);
  std::unique_ptr<HostDevice> device;
  std::unique_ptr<CopyEngine> engine;
  if (a.ring_slots > 0) {
    device = HostDevice::create().value();
    engine = CopyEngine::create(*device).value();
  }
  Result<BlockSpace> direct_space = BlockSpace{};
  if (a.host_direct != 0) direct_space = transport_blocks(*transport, layout, 8, true);
  if (!direct_space.ok()) return 5;
  auto pre = a.ring_slots > 0
                 ? PdPrefill::create(*transport, as_device(mem.space), ring_options(engine.get(), a.ring_slots))
             : a.host_direct != 0 ? PdPrefill::create(*transport, *direct_space, host_direct_options())
                                  : PdPrefill::create(*transport, mem.space, PdOptions{50ms, 500ms});
  if (!pre.ok()) {
    std::fprintf(stderr, "prefill helper: %s\n", pre.status().to_string().c_str());
    return 5;
  }
  auto blob = transport->export_metadata();
  if (!blob.ok() || !send_blob(a.out_fd, *blob)) return 5;
  auto peer_blob = recv_blob(a.in_fd);
  if (!peer_blob.ok()) return 5;
  auto peer = transport->load_peer(*peer_blob);
  if (!peer.ok()) {
    std::fprintf(stderr, "prefill helper: %s\n", peer.status().to_string().c_str());
    return 3;
  }
  if (!(*pre)->begin(*peer, kXid, kSrc).ok()) return 5;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    const auto at = start + (l + 1) * std::chrono::milliseconds(a.layer_ms);
    // The "forward pass" finishes layer l at `at`; the progress thread polls this, never blocking.
    if (!(*pre)->layer_ready(kXid, l, [at] { return Result<bool>(std::chrono::steady_clock::now() >= at); }).ok())
      return 5;
  }
  auto st = (*pre)->wait(kXid, 20s);
  // Give the decode side's last messages time to be acknowledged before the endpoint closes.
  std::this_thread::sleep_for(50ms);
  return st.ok() && st->done ? 0 : 4;
}

// The spawned helper runs this test only (--gtest_filter); in the test run itself it skips.
TEST(PdHelper, PrefillProcess) {
  const char* spec = std::getenv("KVTIER_PD_HELPER");
  if (spec == nullptr) GTEST_SKIP() << "runs only as the spawned prefill process";
  HelperArgs a;
  int mode = 0;
  long long wrong = 0, op = -1;
  if (std::sscanf(spec, "%d %d %lld %lld %d %d %d %d %d", &mode, &a.layer_ms, &wrong, &op, &a.in_fd, &a.out_fd,
                  &a.stop_before_write, &a.ring_slots, &a.host_direct) != 9)
    _exit(5);
  a.mode = static_cast<PdMode>(mode);
  a.wrong_layout = static_cast<std::uint64_t>(wrong);
  a.corrupt_op = op;
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
    const std::string spec = fmt::format("{} {} {} {} {} {} {} {} {}", static_cast<int>(a.mode), a.layer_ms,
                                         static_cast<long long>(a.wrong_layout), static_cast<long long>(a.corrupt_op),
                                         down[0], up[1], a.stop_before_write, a.ring_slots, a.host_direct);
    c.pid = fork();
    if (c.pid < 0) return Internal("fork");
    if (c.pid == 0) {
      close(down[1]);
      close(up[0]);
      setenv("KVTIER_PD_HELPER", spec.c_str(), 1);
      char self[] = "/proc/self/exe";
      char filter[] = "--gtest_filter=PdHelper.PrefillProcess";
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
  int reap(std::chrono::milliseconds timeout = 15s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {
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

// The decode side, connected to a freshly spawned prefill.
struct DecodeRig {
  KvLayout layout = pd_layout(kLayers);
  HostBlocks mem = HostBlocks::make(layout, 8, false);
  std::unique_ptr<HostDevice> device = HostDevice::create().value();
  std::unique_ptr<CopyEngine> engine = CopyEngine::create(*device).value();
  std::unique_ptr<Transport> t;
  std::unique_ptr<PdDecode> dec;
  Child child;
  PeerId peer = 0;
  Status load_status;
  BlockSpace direct_space;  // the host direct lane's blocks, in the transport's memory

  ~DecodeRig() { dec.reset(); }

  void start(const HelperArgs& a, WireFaults faults = {}) {
    auto tr = make_transport("decode", layout);
    ASSERT_TRUE(tr.ok()) << tr.status().to_string();
    t = wrap_with_wire_faults(std::move(tr).value(), faults);
    if (a.host_direct != 0) {
      auto space = transport_blocks(*t, layout, 8, false);
      ASSERT_TRUE(space.ok()) << space.status().to_string();
      direct_space = std::move(space).value();
    }
    auto d = a.ring_slots > 0     ? PdDecode::create(*t, as_device(mem.space), ring_options(engine.get(), a.ring_slots))
             : a.host_direct != 0 ? PdDecode::create(*t, direct_space, host_direct_options())
                                  : PdDecode::create(*t, mem.space, PdOptions{50ms, 500ms});
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    dec = std::move(d).value();
    spawn_prefill(a);
  }

  // A (further) prefill process, connected to this decode.
  void spawn_prefill(const HelperArgs& a) {
    auto c = Child::spawn(a);
    ASSERT_TRUE(c.ok());
    child = *c;
    ASSERT_TRUE(send_blob(child.to_child, t->export_metadata().value()));
    auto blob = recv_blob(child.from_child);
    ASSERT_TRUE(blob.ok()) << blob.status().to_string();
    auto p = t->load_peer(*blob);
    load_status = p.status();
    if (p.ok()) peer = *p;
  }
};

class TwoProcess : public ::testing::TestWithParam<PdMode> {};

TEST_P(TwoProcess, LayerWiseTransferIsByteExactAndDecodeWaitsPerLayer) {
  DecodeRig rig;
  rig.start(HelperArgs{GetParam(), 150});
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  const std::vector<BlockId> dst = {6, 0, 2, 4};
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst).ok());
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    auto ls = rig.dec->wait_layer(kXid, l, 10s);
    ASSERT_TRUE(ls.ok()) << ls.status().to_string();
    ASSERT_EQ(*ls, LayerState::kLoaded) << "layer " << l;
    // This layer's attention could run now: its bytes are in place, while later layers are still coming.
    for (std::size_t i = 0; i < dst.size(); ++i) EXPECT_TRUE(layer_matches(rig.mem.space, dst[i], l, kSrc[i]));
    if (l == 0) {
      auto s = rig.dec->status(kXid);
      ASSERT_TRUE(s.ok());
      EXPECT_EQ(s->layers[kLayers - 1], LayerState::kPending);
    }
  }
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u);
  EXPECT_EQ(rig.child.reap(), 0);
}

TEST_P(TwoProcess, PrefillKilledMidTransferFailsTheUnfinishedLayersAndTheBlocksReturnAfterTheLease) {
  cache::CacheConfig cfg;
  cfg.device_blocks = 8;
  auto cm = cache::CacheManager::create(cfg).value();
  std::vector<cache::BlockKey> keys = {{1, 1}, {2, 2}, {3, 3}, {4, 4}};
  auto adm = cm->admit(keys);
  ASSERT_TRUE(adm.ok());
  ASSERT_EQ(cm->stats().tiers[0].used, 4u);
  DecodeRig rig;
  rig.start(HelperArgs{GetParam(), 300});
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  std::vector<BlockId> dst(adm->device_blocks.begin(), adm->device_blocks.end());
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst).ok());
  ASSERT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  kill(rig.child.pid, SIGKILL);
  EXPECT_EQ(rig.child.reap(), -SIGKILL);
  auto fin = rig.dec->wait(kXid, 10s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[0], LayerState::kLoaded);
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
  EXPECT_EQ(fin->block_loaded, std::vector<bool>(4, false));
  EXPECT_EQ(fin->leading_loaded_blocks(), 0u);
  EXPECT_FALSE(fin->error.ok());
  auto rec = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string();
  EXPECT_TRUE(rec->reclaimable);
  // Nothing is committed; releasing the admission returns every block to the pool.
  ASSERT_TRUE(cm->commit(adm->id, rec->leading_loaded_blocks()).ok());
  ASSERT_TRUE(cm->release(adm->id).ok());
  EXPECT_EQ(cm->stats().tiers[0].used, 0u);
  EXPECT_EQ(cm->match(keys).device_blocks, 0u);
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
}

TEST_P(TwoProcess, ACorruptedByteOnTheWireIsCaughtByTheChecksum) {
  DecodeRig rig;
  // Op 2 * 4 + 1: layer 1, role 0, position 1; on the prefill's writes (push) or the decode's reads (pull).
  const std::int64_t op = 2 * 4 + 1;
  rig.start(HelperArgs{GetParam(), 0, 0, GetParam() == PdMode::kPush ? op : -1},
            GetParam() == PdMode::kPull ? WireFaults{op, 17} : WireFaults{});
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), {0, 1, 2, 3}).ok());
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[1], LayerState::kPartial);
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss) << fin->error.to_string();
  EXPECT_FALSE(layer_matches(rig.mem.space, 1, 1, kSrc[1]));
  EXPECT_EQ(rig.child.reap(), 4);  // the prefill hears the transfer failed
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoProcess, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });

#ifdef KVTIER_PD_IPC
// The ring lane between two processes: the decode's ring is a sealed memfd both map (ipc allocate_shared); each
// process's copy engine moves its side (the host backend's kernels: "device" blocks in RAM).
class TwoProcessRing : public ::testing::TestWithParam<PdMode> {};

TEST_P(TwoProcessRing, LayersMoveByteExactThroughTheSharedRing) {
  DecodeRig rig;
  HelperArgs a{GetParam(), 20};
  a.ring_slots = 2;
  rig.start(a);
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  const std::vector<BlockId> dst = {6, 0, 2, 4};
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst).ok());
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    auto ls = rig.dec->wait_layer(kXid, l, 10s);
    ASSERT_TRUE(ls.ok()) << ls.status().to_string();
    ASSERT_EQ(*ls, LayerState::kLoaded) << "layer " << l;
    for (std::size_t i = 0; i < dst.size(); ++i) EXPECT_TRUE(layer_matches(rig.mem.space, dst[i], l, kSrc[i]));
  }
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u) << fin->error.to_string();
  for (std::uint64_t untouched : {1u, 3u, 5u, 7u})
    EXPECT_EQ(rig.mem.space.block_ptr(2, 1, untouched)[5], std::byte{0xee});
  EXPECT_EQ(rig.child.reap(), 0);
}

// A prefill killed with ring slots granted: the decode fails the rest at the lease, its blocks are reclaimable at
// once, and the slots come back once the prefill's process is gone (it had the ring mapped), so a second prefill's
// transfer goes through the same ring.
TEST_P(TwoProcessRing, APrefillKilledMidTransferGivesItsSlotsBackAndTheNextTransferGoesThrough) {
  DecodeRig rig;
  HelperArgs a{GetParam(), 300};
  a.ring_slots = 2;
  rig.start(a);
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  const std::vector<BlockId> dst = {6, 0, 2, 4};
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst).ok());
  ASSERT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  kill(rig.child.pid, SIGKILL);
  EXPECT_EQ(rig.child.reap(), -SIGKILL);
  auto fin = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[0], LayerState::kLoaded);
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
  EXPECT_TRUE(fin->reclaimable);
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
  a.layer_ms = 0;
  rig.spawn_prefill(a);
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  const std::vector<BlockId> dst2 = {1, 3, 5, 7};
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst2).ok());
  auto again = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(again.ok()) << again.status().to_string() << " (ring slots lost to the killed prefill?)";
  EXPECT_EQ(again->leading_loaded_blocks(), 4u) << again->error.to_string();
  for (std::uint32_t l = 0; l < kLayers; ++l)
    for (std::size_t i = 0; i < dst2.size(); ++i) EXPECT_TRUE(layer_matches(rig.mem.space, dst2[i], l, kSrc[i]));
  EXPECT_EQ(rig.child.reap(), 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoProcessRing, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });
#endif

// A prefill paused past the lease (SIGSTOP) with a write posted, resumed after the decode side failed the
// transfer. The decode side may report its blocks reclaimable only when nothing of the prefill can land there any
// more: ipc tears the path down (the decode side no longer serves the prefill's requests), and so does UCX over
// TCP's active-message path (the decode side lands the prefill's writes itself and no longer does), so they may,
// and the blocks' new contents must survive the resumed prefill; UCX's RMA of a live peer cannot be revoked
// (KVTIER_PD_TEST_TLS=tcp-rma), so there the blocks stay quarantined until the resumed prefill proves its writes
// are done.
class TwoProcessLateWrites : public ::testing::TestWithParam<const char*> {};

TEST_P(TwoProcessLateWrites, APrefillStoppedPastTheLeaseNeverWritesIntoBlocksReportedReclaimable) {
  const bool rma = std::string_view(GetParam()) == "tcp-rma";
  if (rma) setenv("KVTIER_PD_TEST_TLS", "tcp-rma", 1);
  DecodeRig rig;
  HelperArgs a{PdMode::kPush, 200};  // layer 0 lands and is confirmed well before layer 1 is posted
  a.stop_before_write = 1;
  rig.start(a);
  unsetenv("KVTIER_PD_TEST_TLS");
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  const std::vector<BlockId> dst = {0, 1, 2, 3};
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, PdMode::kPush, dst).ok());
  ASSERT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  // The helper stops itself as it posts layer 1.
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(rig.child.pid, &status, WUNTRACED | WNOHANG) == rig.child.pid) break;
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_TRUE(WIFSTOPPED(status)) << "the helper did not stop";
  auto fin = rig.dec->wait(kXid, 10s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
  // Well past the lease, the helper still stopped with its write posted.
  auto rec = rig.dec->wait(kXid, 1500ms, true);
  const bool reclaimed = rec.ok() && rec->reclaimable;
  constexpr std::byte kReused{0xab};
  if (reclaimed) {
    // The blocks go back to the pool and the next request fills them.
    for (std::uint32_t l = 0; l < kLayers; ++l)
      for (std::uint32_t r = 0; r < rig.layout.num_roles(l); ++r)
        for (std::uint64_t b : dst) std::memset(rig.mem.space.block_ptr(l, r, b), 0xab, rig.layout.block_bytes(l, r));
  }
  kill(rig.child.pid, SIGCONT);
  const int code = rig.child.reap();
  EXPECT_NE(code, -1000) << "the resumed helper hung";
  if (reclaimed) {
    for (std::uint32_t l = 0; l < kLayers; ++l)
      for (std::uint32_t r = 0; r < rig.layout.num_roles(l); ++r)
        for (std::uint64_t b : dst) {
          const std::byte* p = rig.mem.space.block_ptr(l, r, b);
          for (std::uint64_t i = 0; i < rig.layout.block_bytes(l, r); ++i)
            ASSERT_EQ(p[i], kReused) << "the resumed prefill wrote into reclaimed block " << b << " layer " << l
                                     << " role " << r << " byte " << i;
        }
  } else {
    // Quarantined until the resumed prefill proved that its writes are done: then the blocks return.
    auto later = rig.dec->wait(kXid, 10s, true);
    ASSERT_TRUE(later.ok()) << later.status().to_string();
    EXPECT_TRUE(later->reclaimable);
  }
  if (rma) {
    EXPECT_FALSE(reclaimed) << "UCX cannot revoke a live peer's RMA: the blocks must stay quarantined";
  } else {
    EXPECT_TRUE(reclaimed) << "the decode side lands nothing more of the stopped prefill: its blocks need not wait";
  }
}

#ifdef KVTIER_PD_IPC
INSTANTIATE_TEST_SUITE_P(Lanes, TwoProcessLateWrites, ::testing::Values("ipc"));
#else
INSTANTIATE_TEST_SUITE_P(Lanes, TwoProcessLateWrites, ::testing::Values("tcp", "tcp-rma"),
                         [](const auto& info) { return std::string(info.param) == "tcp" ? "tcp" : "tcp_rma"; });
#endif

#ifndef KVTIER_PD_IPC
// UCX's shared-memory lane reports no dead peer (no endpoint error handling): only the lease finds a killed
// prefill, and the decode side's blocks must still come back, in both modes (push: its process is seen gone).
class TwoProcessShm : public ::testing::TestWithParam<PdMode> {};

TEST_P(TwoProcessShm, PrefillKilledMidTransferFailsTheRestAndTheBlocksReturn) {
  setenv("KVTIER_PD_TEST_TLS", "shm", 1);
  DecodeRig rig;
  rig.start(HelperArgs{GetParam(), 300});
  unsetenv("KVTIER_PD_TEST_TLS");
  ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
  ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), {0, 1, 2, 3}).ok());
  ASSERT_EQ(rig.dec->wait_layer(kXid, 0, 10s).value(), LayerState::kLoaded);
  EXPECT_TRUE(layer_matches(rig.mem.space, 0, 0, kSrc[0]));
  kill(rig.child.pid, SIGKILL);
  EXPECT_EQ(rig.child.reap(), -SIGKILL);
  auto fin = rig.dec->wait(kXid, 10s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
  auto rec = rig.dec->wait(kXid, 10s, true);
  ASSERT_TRUE(rec.ok()) << "blocks pinned by a dead peer on the shm lane: " << rec.status().to_string();
  EXPECT_TRUE(rec->reclaimable);
  EXPECT_TRUE(rig.dec->forget(kXid).ok());
}

// The host direct lane across two processes on UCX's shared-memory lane: each side's pool is the transport's memory,
// which UCX maps into the other process (ucp_rkey_ptr); the moving side copies with its own loads and stores, layer
// by layer as the prefill's layers become ready. Byte-exact, nothing else touched, reclaimable; then a prefill
// killed mid-transfer fails the rest and the decode's blocks still come back.
TEST_P(TwoProcessShm, HostDirectLaneMovesByteExactThroughUcxsMappingAndSurvivesAKilledPrefill) {
  setenv("KVTIER_PD_TEST_TLS", "shm", 1);
  for (bool kill_it : {false, true}) {
    DecodeRig rig;
    HelperArgs a{GetParam(), kill_it ? 300 : 20};
    a.host_direct = 1;
    rig.start(a);
    ASSERT_TRUE(rig.load_status.ok()) << rig.load_status.to_string();
    const std::vector<BlockId> dst = {6, 0, 2, 4};
    ASSERT_TRUE(rig.dec->start(rig.peer, kXid, GetParam(), dst).ok());
    auto first = rig.dec->wait_layer(kXid, 0, 10s);
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    ASSERT_EQ(*first, LayerState::kLoaded);
    if (kill_it) {
      kill(rig.child.pid, SIGKILL);
      EXPECT_EQ(rig.child.reap(), -SIGKILL);
    }
    auto fin = rig.dec->wait(kXid, 10s, true);
    ASSERT_TRUE(fin.ok()) << fin.status().to_string();
    EXPECT_TRUE(fin->reclaimable);
    if (kill_it) {
      for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
    } else {
      EXPECT_EQ(fin->leading_loaded_blocks(), dst.size()) << fin->error.to_string();
      EXPECT_EQ(rig.child.reap(), 0);
    }
    for (std::uint32_t l = 0; l < (kill_it ? 1u : kLayers); ++l)
      for (std::size_t i = 0; i < dst.size(); ++i) EXPECT_TRUE(layer_matches(rig.direct_space, dst[i], l, kSrc[i]));
    for (BlockId b : {1u, 3u, 5u, 7u}) EXPECT_EQ(rig.direct_space.block_ptr(0, 0, b)[0], std::byte{0xee});
    EXPECT_TRUE(rig.dec->forget(kXid).ok());
  }
  unsetenv("KVTIER_PD_TEST_TLS");
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoProcessShm, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });
#endif

TEST(TwoProcessBlob, APeerOfAnotherLayoutIsRefusedOnBothSides) {
  DecodeRig rig;
  rig.start(HelperArgs{PdMode::kPush, 0, 1});
  ASSERT_FALSE(rig.load_status.ok());
  EXPECT_EQ(rig.load_status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(rig.load_status.message().find(fmt::format("{:#018x}", pd_layout(kLayers, 4096).fingerprint())),
            std::string::npos)
      << rig.load_status.to_string();
  EXPECT_NE(rig.load_status.message().find(fmt::format("{:#018x}", rig.layout.fingerprint())), std::string::npos);
  EXPECT_EQ(rig.child.reap(), 3);
}

}  // namespace
}  // namespace kvtier::transport
