// `kvtier bench copy`: block-copy throughput of every CopyEngine strategy
// against the contiguous-DMA ceiling measured in the same run.
//
// Per block size: n = total / (block_bytes x planes) block ids are moved per
// direction. Memory (allocated once for the largest need):
//   device pool: halves A (D2H sources, never written) and B (H2D destinations),
//                each >= 4n blocks and together >= --pool-min-mib (default
//                2 GiB on CUDA) so that scattered ids do not sit in L2;
//   host pool:   halves A (H2D sources, never written) and B (D2H destinations),
//                each 4n blocks.
// Sources hold a counter-based pseudo-random pattern (recomputable, so no
// reference copy is kept); before timing each (size, direction, strategy) is
// run once on a poisoned destination and every moved byte is compared with
// the pattern (nonzero exit on a mismatch).
//
// Timing: CUDA events with timing on the copy stream (host backend: stream-
// ordered host callbacks), from a start marker recorded before the first
// enqueue to an end marker after the copy, so CPU submission time is included
// when the stream is idle. "both": a start marker on stream A that stream B
// waits on, both directions submitted from two host threads (released after
// the start marker), time to the later of the two end markers; GB/s counts
// both directions' bytes. The ceiling is one contiguous memcpy_async of the
// same bytes in the same direction (both: two at once on the two streams);
// p50 over --reps.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

#include "kvtier/copy/copy_config.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/config.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "tools/cli.h"

#if defined(KVTIER_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvtier::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchCopyArgs {
  std::string backend = "auto";
  std::vector<std::uint64_t> block_kib{4, 16, 24, 28, 32, 64, 256, 1024};
  std::uint64_t total_mib = 0;     // 0: 256 on CUDA, 32 on the host backend
  std::uint64_t pool_min_mib = 0;  // 0: 2048 on CUDA, 0 on the host backend
  int reps = 7;
  int warmup = 5;  // untimed reps before the timed ones
  std::vector<std::string> strategies{"dma_per_run", "dma_batch", "sm_kernel", "staged_dma", "auto"};
  std::vector<std::string> directions{"h2d", "d2h", "both"};
  std::string pattern = "random";
  std::uint32_t layers = 1;
  std::uint32_t roles = 1;
  bool json = false;
  bool verify = true;
  // Hold the stream behind a host callback while the copy is enqueued, then
  // release it: GB/s then measures the device-side copy with the CPU planning
  // and submission overlapped, as in a pipeline where the CPU runs ahead.
  // host_api_ms reports the enqueue cost separately. A watchdog releases the
  // hold after 200 ms (e.g. when per-block DMA fills the driver's queue), in
  // which case the time includes the rest of the submission.
  bool prequeue = true;
  // Each measurement as this many copies enqueued back to back (a stream of
  // smaller requests; with --no-prequeue the CPU's enqueue cost shows).
  std::uint32_t pieces = 1;
  CopyEngineOptions engine;
  std::uint64_t gate_max_kib = 28;
  std::uint32_t sm_item_kib = 64;
  std::uint64_t staged_slot_mib = 32;
  Status env_status;  // KVTIER_COPY_* variables applied to `engine` before the flags
};

// ---------------------------------------------------------------- pattern

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Byte `offset` of the pattern of region `seed` (words of 8 bytes).
inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset) {
  return static_cast<std::uint8_t>(mix64(seed * 0x100000001B3ull + offset / 8) >> (8 * (offset % 8)));
}
void fill_pattern(std::byte* dst, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes) {
  std::uint64_t i = 0;
  for (; i < bytes && (offset + i) % 8 != 0; ++i) dst[i] = static_cast<std::byte>(pattern_byte(seed, offset + i));
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t w = mix64(seed * 0x100000001B3ull + (offset + i) / 8);
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < bytes; ++i) dst[i] = static_cast<std::byte>(pattern_byte(seed, offset + i));
}
// Index of the first byte differing from the pattern, or -1.
std::int64_t check_pattern(const std::byte* p, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes) {
  thread_local std::vector<std::byte> expect;
  expect.resize(bytes);
  fill_pattern(expect.data(), seed, offset, bytes);
  if (std::memcmp(p, expect.data(), bytes) == 0) return -1;
  for (std::uint64_t i = 0; i < bytes; ++i)
    if (p[i] != expect[i]) return static_cast<std::int64_t>(i);
  return -1;
}

constexpr std::uint64_t kDeviceSeed = 0xD0;
constexpr std::uint64_t kHostSeed = 0x40;

// ---------------------------------------------------------------- timing

// A point on a stream whose time can be read after the stream passed it.
class Marker {
 public:
  virtual ~Marker() = default;
  virtual Status record(Stream& s) = 0;
  // Milliseconds from `start` to this marker; both must have completed.
  virtual Result<double> since(Marker& start) = 0;
};

class HostMarker final : public Marker {
 public:
  explicit HostMarker(Device& d) : device_(d) {}
  Status record(Stream& s) override {
    done_.store(false);
    return device_.launch_host_callback(s, [this](const Status&) {
      t_ = Clock::now();
      done_.store(true, std::memory_order_release);
    });
  }
  Result<double> since(Marker& start) override {
    auto& st = static_cast<HostMarker&>(start);
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (!(done_.load(std::memory_order_acquire) && st.done_.load(std::memory_order_acquire))) {
      if (Clock::now() > deadline) return TimedOut("host marker callback never ran");
      std::this_thread::yield();
    }
    return std::chrono::duration<double, std::milli>(t_ - st.t_).count();
  }

 private:
  Device& device_;
  std::atomic<bool> done_{false};
  Clock::time_point t_{};
};

#if defined(KVTIER_WITH_CUDA)
class CudaMarker final : public Marker {
 public:
  ~CudaMarker() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  static Result<std::unique_ptr<Marker>> create() {
    auto m = std::make_unique<CudaMarker>();
    const cudaError_t e = cudaEventCreate(&m->event_);  // timing enabled
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventCreate: {}", cudaGetErrorString(e)));
    return std::unique_ptr<Marker>(std::move(m));
  }
  Status record(Stream& s) override {
    const cudaError_t e = cudaEventRecord(event_, static_cast<cudaStream_t>(s.native_handle()));
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventRecord: {}", cudaGetErrorString(e)));
    return Status::Ok();
  }
  Result<double> since(Marker& start) override {
    auto& st = static_cast<CudaMarker&>(start);
    cudaEventSynchronize(event_);
    cudaEventSynchronize(st.event_);
    float ms = 0;
    const cudaError_t e = cudaEventElapsedTime(&ms, st.event_, event_);
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventElapsedTime: {}", cudaGetErrorString(e)));
    return static_cast<double>(ms);
  }

 private:
  cudaEvent_t event_ = nullptr;
};
#endif

Result<std::unique_ptr<Marker>> make_marker(Device& d) {
#if defined(KVTIER_WITH_CUDA)
  if (d.backend() == BackendKind::kCuda) return CudaMarker::create();
#endif
  return std::unique_ptr<Marker>(new HostMarker(d));
}

double p50(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---------------------------------------------------------------- the bench

enum class Dir { kH2D, kD2H, kBoth };
std::string_view dir_name(Dir d) {
  switch (d) {
    case Dir::kH2D: return "h2d";
    case Dir::kD2H: return "d2h";
    case Dir::kBoth: return "both";
  }
  return "?";
}

struct Pools {
  Buffer device;  // device_blocks_max * unit_max... laid out per block size
  std::unique_ptr<PinnedMemory> host;
  std::uint64_t device_bytes = 0, host_bytes = 0;
};

// One block size's view of the pools: BlockSpaces over halves A and B.
struct SizeSetup {
  std::uint64_t block_bytes = 0;
  std::uint64_t unit = 0;                     // bytes per block id (all planes)
  std::uint64_t n = 0;                        // moved blocks per direction
  std::uint64_t dev_half = 0, host_half = 0;  // blocks per half
  KvLayout layout;
  BlockSpace dev_a, dev_b, host_a, host_b;
  std::vector<std::int32_t> h2d_src, h2d_dst, d2h_src, d2h_dst;
};

// Layer-first spaces: plane p of a half covers [off + p*half*bb, ...).
Result<BlockSpace> make_half(MemoryKind kind, int ordinal, const KvLayout& layout, std::byte* base,
                             std::uint64_t half_blocks) {
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::uint64_t off = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      bases[l].push_back(base + off);
      off += layout.block_bytes(l, r) * half_blocks;
    }
  return BlockSpace::layer_first(kind, ordinal, layout, half_blocks, std::move(bases));
}

// `count` ids out of [0, pool) following `pattern`; `runs_of` consecutive ids per run.
std::vector<std::int32_t> pick_ids(std::uint64_t pool, std::uint64_t count, std::mt19937_64& rng, std::uint32_t run) {
  const std::uint64_t slots = pool / run;
  std::vector<std::int32_t> slot_ids(slots);
  std::iota(slot_ids.begin(), slot_ids.end(), 0);
  std::shuffle(slot_ids.begin(), slot_ids.end(), rng);
  std::vector<std::int32_t> ids;
  ids.reserve(count);
  for (std::uint64_t s = 0; ids.size() < count; ++s)
    for (std::uint32_t k = 0; k < run && ids.size() < count; ++k) ids.push_back(slot_ids[s] * run + k);
  return ids;
}

void make_ids(SizeSetup& z, const std::string& pattern, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (pattern == "runs16") {
    z.h2d_src = pick_ids(z.host_half, z.n, rng, 16);
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 16);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 16);
    z.d2h_dst = pick_ids(z.host_half, z.n, rng, 16);
  } else if (pattern == "contiguous") {
    // The >= 98% case: host pages contiguous, device ids scattered.
    z.h2d_src.resize(z.n);
    std::iota(z.h2d_src.begin(), z.h2d_src.end(), 0);
    z.d2h_dst = z.h2d_src;
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 1);
  } else {
    z.h2d_src = pick_ids(z.host_half, z.n, rng, 1);
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_dst = pick_ids(z.host_half, z.n, rng, 1);
  }
}

struct Row {
  std::string strategy;
  std::string ran;
  Dir dir;
  std::uint64_t block_bytes = 0, blocks = 0, bytes = 0;
  double p50_ms = 0, gbps = 0, ceiling_gbps = 0, host_api_ms = 0;
  std::uint32_t ctas = 0;
  bool gated = false;
  std::uint64_t segments = 0;
  std::uint32_t calls = 0;
  double kernel_share = 0;         // split: share of the last rep
  std::uint32_t lanes = 0;         // split: lanes of the last rep
  std::vector<double> rep_shares;  // split: share per timed rep (adaptive kAuto moves it)
};

class BenchCopy {
 public:
  BenchCopy(Device& device, const BenchCopyArgs& a) : device_(device), a_(a) {}

  int run() {
    Status st = setup();
    if (!st.ok()) return fail(st);
    if (!a_.json) print_header();
    for (std::uint64_t kib : a_.block_kib) {
      st = run_size(kib * 1024);
      if (!st.ok()) return fail(st);
    }
    return exit_code_;
  }

 private:
  int fail(const Status& st) {
    std::fprintf(stderr, "kvtier bench copy: %s\n", st.to_string().c_str());
    return 1;
  }

  std::uint64_t planes() const { return std::uint64_t{a_.layers} * a_.roles; }
  std::uint64_t total_bytes() const {
    const bool cuda = device_.backend() == BackendKind::kCuda;
    return (a_.total_mib ? a_.total_mib : (cuda ? 256 : 32)) << 20;
  }
  std::uint64_t pool_min_bytes() const {
    const bool cuda = device_.backend() == BackendKind::kCuda;
    return (a_.pool_min_mib ? a_.pool_min_mib : (cuda ? 2048 : 0)) << 20;
  }
  std::uint64_t blocks_for(std::uint64_t bb) const {
    return std::max<std::uint64_t>(1, total_bytes() / (bb * planes()));
  }
  std::uint64_t dev_half_for(std::uint64_t bb) const {
    const std::uint64_t unit = bb * planes();
    return std::max<std::uint64_t>(4 * blocks_for(bb), (pool_min_bytes() / 2 + unit - 1) / unit);
  }
  std::uint64_t host_half_for(std::uint64_t bb) const { return 4 * blocks_for(bb); }

  Status setup() {
    KVTIER_ASSIGN_OR_RETURN(engine_, CopyEngine::create(device_, a_.engine));
    for (auto* s : {&stream_a_, &stream_b_}) {
      StreamOptions so;
      so.priority = StreamPriority::kHigh;
      KVTIER_ASSIGN_OR_RETURN(*s, device_.create_stream(so));
    }
    KVTIER_ASSIGN_OR_RETURN(start_event_, device_.create_event());
    for (auto* m : {&m_start_, &m_end_a_, &m_end_b_}) {
      KVTIER_ASSIGN_OR_RETURN(*m, make_marker(device_));
    }
    std::uint64_t dev_bytes = 0, host_bytes = 0;
    for (std::uint64_t kib : a_.block_kib) {
      const std::uint64_t bb = kib * 1024, unit = bb * planes();
      dev_bytes = std::max(dev_bytes, 2 * dev_half_for(bb) * unit);
      host_bytes = std::max(host_bytes, 2 * host_half_for(bb) * unit);
    }
    dev_bytes = (dev_bytes + 255) / 256 * 256;  // halves stay 128-byte aligned
    host_bytes = (host_bytes + 255) / 256 * 256;
    {}
    if (!a_.json)
      std::printf("# backend %s (%s), pools: device %.2f GiB, pinned host %.2f GiB, %.0f MiB moved per direction\n",
                  std::string(backend_name(device_.backend())).c_str(), device_.name().c_str(),
                  dev_bytes / double(1 << 30), host_bytes / double(1 << 30), total_bytes() / double(1 << 20));
    KVTIER_ASSIGN_OR_RETURN(pools_.device, device_.allocate_device(dev_bytes));
    KVTIER_ASSIGN_OR_RETURN(pools_.host, device_.allocate_pinned(host_bytes));
    pools_.device_bytes = dev_bytes;
    pools_.host_bytes = host_bytes;
    // Sources: the whole pools get the pattern (halves A are never written).
    fill_pattern(pools_.host->data(), kHostSeed, 0, host_bytes);
    std::vector<std::byte> chunk(std::min<std::uint64_t>(dev_bytes, 64ull << 20));
    for (std::uint64_t off = 0; off < dev_bytes; off += chunk.size()) {
      const std::uint64_t len = std::min<std::uint64_t>(chunk.size(), dev_bytes - off);
      fill_pattern(chunk.data(), kDeviceSeed, off, len);
      KVTIER_RETURN_IF_ERROR(device_.memcpy_sync(pools_.device.bytes_ptr() + off, chunk.data(), len));
    }
    return Status::Ok();
  }

  std::byte* dev_b_base() const { return pools_.device.bytes_ptr() + pools_.device_bytes / 2; }
  std::byte* host_b_base() const { return pools_.host->data() + pools_.host_bytes / 2; }

  Status build(SizeSetup& z, std::uint64_t bb) {
    z.block_bytes = bb;
    z.unit = bb * planes();
    z.n = blocks_for(bb);
    z.dev_half = dev_half_for(bb);
    z.host_half = host_half_for(bb);
    KVTIER_ASSIGN_OR_RETURN(z.layout, KvLayout::uniform(a_.layers, a_.roles, bb));
    std::byte* dev = pools_.device.bytes_ptr();
    std::byte* host = pools_.host->data();
    const int ord = device_.ordinal();
    KVTIER_ASSIGN_OR_RETURN(z.dev_a, make_half(MemoryKind::kDevice, ord, z.layout, dev, z.dev_half));
    // Halves B start at the middle of the pools for every block size, so a
    // destination of one size never overlaps a source (half A) of another.
    KVTIER_ASSIGN_OR_RETURN(z.dev_b, make_half(MemoryKind::kDevice, ord, z.layout, dev_b_base(), z.dev_half));
    KVTIER_ASSIGN_OR_RETURN(z.host_a, make_half(MemoryKind::kPinnedHost, ord, z.layout, host, z.host_half));
    KVTIER_ASSIGN_OR_RETURN(z.host_b, make_half(MemoryKind::kPinnedHost, ord, z.layout, host_b_base(), z.host_half));
    make_ids(z, a_.pattern, 1234 + bb);
    return Status::Ok();
  }

  CopyRequest request(const SizeSetup& z, bool h2d, CopyStrategy s) const {
    CopyRequest r;
    r.strategy = s;
    if (h2d) {
      r.src = &z.host_a;
      r.dst = &z.dev_b;
      r.src_blocks = z.h2d_src;
      r.dst_blocks = z.h2d_dst;
    } else {
      r.src = &z.dev_a;
      r.dst = &z.host_b;
      r.src_blocks = z.d2h_src;
      r.dst_blocks = z.d2h_dst;
    }
    return r;
  }

  // Poisons the destination blocks of `r`.
  Status poison(const SizeSetup& z, bool h2d) {
    if (h2d) return device_.memset_async(dev_b_base(), 0xA5, z.dev_half * z.unit, *stream_a_);
    const auto* dst = &z.host_b;
    for (std::uint32_t l = 0; l < z.layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < z.layout.num_roles(l); ++r)
        for (std::int32_t id : z.d2h_dst) std::memset(dst->block_ptr(l, r, id), 0xA5, z.block_bytes);
    return Status::Ok();
  }

  // Every moved byte equals the source pattern.
  Status verify(const SizeSetup& z, bool h2d) {
    const std::byte* pool_base = h2d ? pools_.host->data() : pools_.device.bytes_ptr();
    const std::uint64_t seed = h2d ? kHostSeed : kDeviceSeed;
    const BlockSpace& src = h2d ? z.host_a : z.dev_a;
    const BlockSpace& dst = h2d ? z.dev_b : z.host_b;
    const auto& sids = h2d ? z.h2d_src : z.d2h_src;
    const auto& dids = h2d ? z.h2d_dst : z.d2h_dst;
    for (std::uint32_t l = 0; l < z.layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < z.layout.num_roles(l); ++r) {
        // Bring the destination plane to the host when it is device memory.
        const std::byte* plane = dst.plane(l, r).base;
        if (h2d) {
          readback_.resize(z.dev_half * z.block_bytes);
          KVTIER_RETURN_IF_ERROR(device_.memcpy_sync(readback_.data(), plane, readback_.size()));
          plane = readback_.data();
        }
        for (std::size_t i = 0; i < dids.size(); ++i) {
          const std::byte* got = plane + static_cast<std::uint64_t>(dids[i]) * z.block_bytes;
          const std::uint64_t src_off = static_cast<std::uint64_t>(src.block_ptr(l, r, sids[i]) - pool_base);
          const std::int64_t bad = check_pattern(got, seed, src_off, z.block_bytes);
          if (bad >= 0)
            return DataLoss(
                fmt::format("verification failed: layer {} role {} pair {} (src {} -> dst {}), byte {} of {}", l, r, i,
                            sids[i], dids[i], bad, z.block_bytes));
        }
      }
    return Status::Ok();
  }

  // One timed run of `fn_a` on stream A (and `fn_b` on stream B, from a
  // second thread, when set). Returns milliseconds.
  template <typename FA, typename FB>
  Result<double> timed(FA&& fn_a, FB* fn_b, bool prequeue = false) {
    // Shared with the hold callback, which may outlive this frame only until the watchdog fires.
    auto release = std::make_shared<std::atomic<bool>>(false);
    if (prequeue) {
      KVTIER_RETURN_IF_ERROR(device_.launch_host_callback(*stream_a_, [release](const Status&) {
        const auto t0 = std::chrono::steady_clock::now();
        while (!release->load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200))
          std::this_thread::yield();
      }));
    }
    KVTIER_RETURN_IF_ERROR(m_start_->record(*stream_a_));
    Status sb;
    std::atomic<bool> go{false};
    std::thread other;
    if (fn_b != nullptr) {
      KVTIER_RETURN_IF_ERROR(device_.record(*start_event_, *stream_a_));
      KVTIER_RETURN_IF_ERROR(device_.wait(*stream_b_, *start_event_));
      other = std::thread([&] {
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        sb = (*fn_b)();
        if (sb.ok()) sb = m_end_b_->record(*stream_b_);
      });
    }
    const auto api0 = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    Status sa = fn_a();
    if (sa.ok()) sa = m_end_a_->record(*stream_a_);
    if (other.joinable()) other.join();
    last_host_api_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - api0).count();
    release->store(true, std::memory_order_release);
    KVTIER_RETURN_IF_ERROR(sa);
    KVTIER_RETURN_IF_ERROR(sb);
    KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_a_, std::chrono::seconds(120)));
    KVTIER_ASSIGN_OR_RETURN(double ms, m_end_a_->since(*m_start_));
    if (fn_b != nullptr) {
      KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_b_, std::chrono::seconds(120)));
      KVTIER_ASSIGN_OR_RETURN(double mb, m_end_b_->since(*m_start_));
      ms = std::max(ms, mb);
    }
    return ms;
  }
  double last_host_api_ms_ = 0;

  Result<double> ceiling(const SizeSetup& z, Dir dir) {
    const std::uint64_t bytes = z.n * z.unit;
    std::byte* dev_b = dev_b_base();
    std::byte* dev_a = pools_.device.bytes_ptr();
    std::byte* host_a = pools_.host->data();
    std::byte* host_b = host_b_base();
    auto h2d = [&] { return device_.memcpy_async(dev_b, host_a, bytes, *stream_a_); };
    auto d2h_b = [&]() -> Status { return device_.memcpy_async(host_b, dev_a, bytes, *stream_b_); };
    auto d2h_a = [&] { return device_.memcpy_async(host_b, dev_a, bytes, *stream_a_); };
    std::vector<double> ms;
    for (int rep = 0; rep < a_.reps + 1; ++rep) {
      Result<double> t = dir == Dir::kH2D   ? timed(h2d, static_cast<decltype(d2h_b)*>(nullptr), a_.prequeue)
                         : dir == Dir::kD2H ? timed(d2h_a, static_cast<decltype(d2h_b)*>(nullptr), a_.prequeue)
                                            : timed(h2d, &d2h_b, a_.prequeue);
      KVTIER_RETURN_IF_ERROR(t.status());
      if (rep > 0) ms.push_back(*t);  // the first run warms up
    }
    const double total = dir == Dir::kBoth ? 2.0 * bytes : double(bytes);
    return total / (p50(ms) * 1e6);
  }

  Status run_size(std::uint64_t bb) {
    SizeSetup z;
    KVTIER_RETURN_IF_ERROR(build(z, bb));
    for (const std::string& dname : a_.directions) {
      const Dir dir = dname == "h2d" ? Dir::kH2D : dname == "d2h" ? Dir::kD2H : Dir::kBoth;
      KVTIER_ASSIGN_OR_RETURN(const double ceil_gbps, ceiling(z, dir));
      for (const std::string& sname : a_.strategies) {
        KVTIER_ASSIGN_OR_RETURN(const CopyStrategy strategy, parse_copy_strategy(sname));
        Row row;
        row.strategy = sname;
        row.dir = dir;
        row.block_bytes = bb;
        row.blocks = z.n;
        row.ceiling_gbps = ceil_gbps;
        CopyRequest rh = request(z, true, strategy);
        CopyRequest rd = request(z, false, strategy);
        // "both": tell kAuto that the other direction runs at the same time.
        rh.full_duplex = rd.full_duplex = dir == Dir::kBoth;
        CopyReport rep_h, rep_d;
        // --pieces: the request as that many copies back to back (the report
        // is the last piece's).
        auto copy_pieces = [&](const CopyRequest& whole, Stream& s, CopyReport& out) -> Status {
          const std::size_t n = whole.src_blocks.size(), k = std::max<std::uint32_t>(1, a_.pieces);
          for (std::size_t i = 0; i < k; ++i) {
            const std::size_t b = n * i / k, e = n * (i + 1) / k;
            if (b == e) continue;
            CopyRequest part = whole;
            part.src_blocks = whole.src_blocks.subspan(b, e - b);
            part.dst_blocks = whole.dst_blocks.subspan(b, e - b);
            auto r = engine_->copy(part, s);
            if (!r.ok()) return r.status();
            out = *r;
          }
          return Status::Ok();
        };
        auto copy_h = [&]() -> Status { return copy_pieces(rh, *stream_a_, rep_h); };
        auto copy_d_on = [&](Stream& s) -> Status { return copy_pieces(rd, s, rep_d); };
        auto copy_d_a = [&]() -> Status { return copy_d_on(*stream_a_); };
        auto copy_d_b = [&]() -> Status { return copy_d_on(*stream_b_); };
        using FB = decltype(copy_d_b);
        // Verification run (not timed).
        if (a_.verify) {
          const bool do_h = dir != Dir::kD2H, do_d = dir != Dir::kH2D;
          if (do_h) KVTIER_RETURN_IF_ERROR(poison(z, true));
          if (do_d) KVTIER_RETURN_IF_ERROR(poison(z, false));
          KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_a_, std::chrono::seconds(120)));
          Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr))
                             : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr))
                                                : timed(copy_h, &copy_d_b);
          KVTIER_RETURN_IF_ERROR(t.status());
          if (do_h) {
            Status v = verify(z, true);
            if (!v.ok()) return v.with_context(fmt::format("{} h2d {} B", sname, bb));
          }
          if (do_d) {
            Status v = verify(z, false);
            if (!v.ok()) return v.with_context(fmt::format("{} d2h {} B", sname, bb));
          }
        }
        std::vector<double> ms, api_ms;
        // Untimed warm-up: adaptive kAuto (split share, CPU budget) settles
        // within a few copies; the timed reps measure the steady state.
        for (int rep = 0; rep < a_.warmup; ++rep) {
          Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr), a_.prequeue)
                             : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr), a_.prequeue)
                                                : timed(copy_h, &copy_d_b, a_.prequeue);
          KVTIER_RETURN_IF_ERROR(t.status().with_context(fmt::format("warm-up {} {} {} B", sname, dir_name(dir), bb)));
        }
        for (int rep = 0; rep < a_.reps; ++rep) {
          Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr), a_.prequeue)
                             : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr), a_.prequeue)
                                                : timed(copy_h, &copy_d_b, a_.prequeue);
          KVTIER_RETURN_IF_ERROR(t.status().with_context(fmt::format("{} {} {} B", sname, dir_name(dir), bb)));
          ms.push_back(*t);
          api_ms.push_back(last_host_api_ms_);
          row.rep_shares.push_back(dir == Dir::kD2H ? rep_d.kernel_share : rep_h.kernel_share);
        }
        row.host_api_ms = p50(api_ms);
        row.bytes = (dir == Dir::kBoth ? 2 : 1) * z.n * z.unit;
        row.p50_ms = p50(ms);
        row.gbps = row.bytes / (row.p50_ms * 1e6);
        const CopyReport& main = dir == Dir::kD2H ? rep_d : rep_h;
        row.ctas = main.ctas;
        row.gated = main.gated;
        row.segments = main.segments;
        row.calls = main.calls;
        row.ran = std::string(copy_strategy_name(main.strategy));
        row.kernel_share = main.kernel_share;
        row.lanes = main.lanes;
        if (dir == Dir::kBoth) {
          row.ctas = std::max(rep_h.ctas, rep_d.ctas);
          row.segments += rep_d.segments;
          row.calls += rep_d.calls;
          row.ran =
              fmt::format("h2d:{},d2h:{}", copy_strategy_name(rep_h.strategy), copy_strategy_name(rep_d.strategy));
        }
        emit(row);
      }
    }
    return Status::Ok();
  }

  void print_header() const {
    std::printf("%-9s %-5s %-12s %-32s %8s %9s %8s %8s %6s %5s %5s %8s\n", "block", "dir", "strategy", "ran", "blocks",
                "p50_ms", "GB/s", "ceiling", "ratio", "ctas", "gated", "segments");
  }

  void emit(const Row& r) const {
    const double ratio = r.ceiling_gbps > 0 ? r.gbps / r.ceiling_gbps : 0;
    if (a_.json) {
      nlohmann::json j;
      j["strategy"] = r.strategy;
      j["ran"] = r.ran;
      j["direction"] = std::string(dir_name(r.dir));
      j["block_bytes"] = r.block_bytes;
      j["blocks"] = r.blocks;
      j["layers"] = a_.layers;
      j["roles"] = a_.roles;
      j["bytes"] = r.bytes;
      j["gbps"] = r.gbps;
      j["ceiling_gbps"] = r.ceiling_gbps;
      j["ratio"] = ratio;
      j["ctas"] = r.ctas;
      j["split_kernel_share"] = a_.engine.split_kernel_share;
      j["split_dma_lanes"] = a_.engine.split_dma_lanes;
      j["kernel_share"] = r.kernel_share;
      j["lanes"] = r.lanes;
      j["rep_kernel_shares"] = r.rep_shares;
      j["p50_ms"] = r.p50_ms;
      j["host_api_ms"] = r.host_api_ms;
      j["prequeued"] = a_.prequeue;
      j["pieces"] = a_.pieces;
      j["reps"] = a_.reps;
      j["warmup"] = a_.warmup;
      j["pattern"] = a_.pattern;
      j["backend"] = std::string(backend_name(device_.backend()));
      j["gated"] = r.gated;
      j["segments"] = r.segments;
      j["calls"] = r.calls;
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%-9s %-5s %-12s %-32s %8llu %9.3f %8.2f %8.2f %6.3f %5u %5s %8llu\n",
                  fmt::format("{}KiB", r.block_bytes / 1024).c_str(), std::string(dir_name(r.dir)).c_str(),
                  r.strategy.c_str(), r.ran.c_str(), static_cast<unsigned long long>(r.blocks), r.p50_ms, r.gbps,
                  r.ceiling_gbps, ratio, r.ctas, r.gated ? "yes" : "no", static_cast<unsigned long long>(r.segments));
    }
    std::fflush(stdout);
  }

  Device& device_;
  BenchCopyArgs a_;
  std::unique_ptr<CopyEngine> engine_;
  std::unique_ptr<Stream> stream_a_, stream_b_;
  std::unique_ptr<Event> start_event_;
  std::unique_ptr<Marker> m_start_, m_end_a_, m_end_b_;
  Pools pools_;
  std::vector<std::byte> readback_;
  int exit_code_ = 0;
};

Result<std::unique_ptr<Device>> open_device(const std::string& backend) {
  const bool want_cuda = backend == "cuda" || (backend == "auto" && cuda_device_count() > 0);
  if (want_cuda) return create_cuda_device(0);
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
  return std::unique_ptr<Device>(std::move(host));
}

Status check_args(const BenchCopyArgs& a) {
  for (const auto& s : a.strategies) {
    Result<CopyStrategy> parsed = parse_copy_strategy(s);
    if (!parsed.ok()) return parsed.status();
  }
  for (const auto& d : a.directions)
    if (d != "h2d" && d != "d2h" && d != "both")
      return InvalidArgument(fmt::format("unknown direction '{}' (expected h2d, d2h, both)", d));
  if (a.pattern != "random" && a.pattern != "runs16" && a.pattern != "contiguous")
    return InvalidArgument(fmt::format("unknown pattern '{}' (expected random, runs16, contiguous)", a.pattern));
  if (a.backend != "auto" && a.backend != "cuda" && a.backend != "host")
    return InvalidArgument(fmt::format("unknown backend '{}' (expected auto, cuda, host)", a.backend));
  if (a.reps < 1) return InvalidArgument(fmt::format("--reps must be >= 1, got {}", a.reps));
  if (a.warmup < 0) return InvalidArgument(fmt::format("--warmup must be >= 0, got {}", a.warmup));
  if (a.layers < 1 || a.roles < 1 || a.roles > 6)
    return InvalidArgument(fmt::format("--layers must be >= 1 and --roles in [1, 6] (got {}, {})", a.layers, a.roles));
  for (auto k : a.block_kib)
    if (k == 0) return InvalidArgument("--block-sizes entries must be >= 1 KiB");
  return Status::Ok();
}

}  // namespace

Action register_bench_copy(CLI::App& bench) {
  auto args = std::make_shared<BenchCopyArgs>();
  auto* cmd = bench.add_subcommand("copy", "Block-copy throughput per strategy vs the contiguous DMA ceiling");
  cmd->add_option("--backend", args->backend, "auto | cuda | host (auto: cuda when a GPU is visible)");
  cmd->add_option("--block-sizes", args->block_kib, "block sizes in KiB (per layer and role)")->delimiter(',');
  cmd->add_option("--total-mib", args->total_mib,
                  "bytes moved per measurement and direction, MiB (default 256 on CUDA, 32 on the host backend)");
  cmd->add_option("--pool-min-mib", args->pool_min_mib,
                  "minimum device pool, MiB (default 2048 on CUDA so scattered blocks miss L2)");
  cmd->add_option("--reps", args->reps, "timed repetitions (p50 reported)");
  cmd->add_option("--warmup", args->warmup, "untimed repetitions before the timed ones (adaptive kAuto settles)");
  cmd->add_option("--strategies", args->strategies, "dma_per_run,dma_batch,sm_kernel,staged_dma,auto")->delimiter(',');
  cmd->add_option("--directions", args->directions, "h2d,d2h,both")->delimiter(',');
  cmd->add_option("--pattern", args->pattern,
                  "random | runs16 | contiguous (contiguous: host ids contiguous, device ids random)");
  cmd->add_option("--layers", args->layers, "layers per block (each a plane)");
  cmd->add_option("--roles", args->roles, "roles per layer (1..6)");
  cmd->add_flag("--json", args->json, "one JSON object per line");
  cmd->add_flag("!--no-verify", args->verify, "skip the byte-exact verification run");
  cmd->add_flag("!--no-prequeue", args->prequeue,
                "time from an idle stream (CPU planning + submission inside the timed region) instead of holding the "
                "stream while the copy is enqueued");
  cmd->add_option(
      "--pieces", args->pieces,
      "enqueue each measurement as this many copies back to back (with --no-prequeue: CPU-bound streaming)");
  auto& e = args->engine;
  {
    // Engine knobs from the environment (docs/configuration.md, copy.*);
    // the flags below, parsed later, override them.
    ConfigTable table;
    bind_copy_engine_options(table, e);
    args->env_status = table.apply_env(environ);
  }
  cmd->add_option("--sm-ctas-h2d", e.sm_ctas_h2d, "SM kernel CTAs for host->device");
  cmd->add_option("--sm-ctas-d2h", e.sm_ctas_d2h, "SM kernel CTAs for device->host");
  cmd->add_option("--sm-threads", e.sm_threads_per_cta, "SM kernel threads per CTA");
  cmd->add_option("--sm-item-kib", args->sm_item_kib, "SM kernel work item size, KiB");
  cmd->add_option("--staged-slot-mib", args->staged_slot_mib, "staged_dma: device staging slot size, MiB");
  cmd->add_option("--staged-slots", e.staged_slots, "staged_dma: staging slots per stream");
  cmd->add_option("--sm-ctas-d2d", e.sm_ctas_d2d, "SM kernel CTAs for device->device (staged_dma's kernels)");
  cmd->add_flag("!--sm-descriptors-uva", e.sm_descriptors_in_device_memory,
                "kernel reads descriptors from mapped pinned memory instead of uploading them");
  cmd->add_option("--batch-max-descriptors", e.batch_max_descriptors, "segments per cudaMemcpyBatchAsync call");
  cmd->add_option("--gate-max-kib", args->gate_max_kib, "gate H2D batches with a segment <= this, KiB");
  cmd->add_flag("--gate-always", e.batch_gate_always, "gate every H2D batch");
  cmd->add_option("--auto-kernel-max-bytes-h2d", e.auto_kernel_max_segment_bytes_h2d,
                  "kAuto: H2D segments below this many BYTES use the SM kernel");
  cmd->add_option("--auto-kernel-max-bytes-d2h", e.auto_kernel_max_segment_bytes_d2h,
                  "kAuto: D2H segments below this many BYTES use the SM kernel");
  cmd->add_option("--split-kernel-share", e.split_kernel_share, "split: share of the pairs copied by the SM kernel");
  cmd->add_option("--split-dma-lanes", e.split_dma_lanes, "split: lane streams sharing the batched-DMA part");
  return [cmd, args]() -> int {
    if (!cmd->parsed()) return -1;
    if (!args->env_status.ok()) {
      std::fprintf(stderr, "kvtier bench copy: %s\n", args->env_status.to_string().c_str());
      return 2;
    }
    BenchCopyArgs a = *args;
    a.engine.batch_gate_max_segment_bytes = a.gate_max_kib * 1024;
    a.engine.sm_item_bytes = a.sm_item_kib * 1024;
    a.engine.staged_slot_bytes = a.staged_slot_mib << 20;
    // staged_dma needs dense host runs; on random host ids it degenerates to a
    // chunk per pair, so the default list leaves it out for that pattern.
    if (cmd->count("--strategies") == 0 && a.pattern == "random") std::erase(a.strategies, std::string("staged_dma"));
    if (Status st = check_args(a); !st.ok()) {
      std::fprintf(stderr, "kvtier bench copy: %s\n", st.to_string().c_str());
      return 2;
    }
    auto device = open_device(a.backend);
    if (!device.ok()) {
      std::fprintf(stderr, "kvtier bench copy: cannot open the %s device: %s\n", a.backend.c_str(),
                   device.status().to_string().c_str());
      return 1;
    }
    BenchCopy bench_copy(**device, a);
    return bench_copy.run();
  };
}

}  // namespace kvtier::cli
