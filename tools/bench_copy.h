// Private to `kvtier bench copy` (tools/cmd_bench_copy.cc, where the bench is
// described): what its parts share. The arguments, the source pattern
// (bench_copy_pattern.cc), the stream markers that time a run and the p50
// (bench_copy_timing.cc), and BenchCopy, which sets up the pools, verifies
// and times every (block size, direction, strategy) and prints a row each
// (bench_copy_runner.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/copy/copy_engine.h"

namespace kvtier::cli::bench_copy_detail {

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

// ---------------------------------------------------------------- pattern (bench_copy_pattern.cc)

void fill_pattern(std::byte* dst, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes);
std::int64_t check_pattern(const std::byte* p, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes);

inline constexpr std::uint64_t kDeviceSeed = 0xD0;
inline constexpr std::uint64_t kHostSeed = 0x40;

// ---------------------------------------------------------------- timing (bench_copy_timing.cc)

// A point on a stream whose time can be read after the stream passed it.
class Marker {
 public:
  virtual ~Marker() = default;
  virtual Status record(Stream& s) = 0;
  // Milliseconds from `start` to this marker; both must have completed.
  virtual Result<double> since(Marker& start) = 0;
};

Result<std::unique_ptr<Marker>> make_marker(Device& d);
double p50(std::vector<double> v);

// ---------------------------------------------------------------- the bench (bench_copy_runner.cc)

enum class Dir { kH2D, kD2H, kBoth };

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
  std::vector<BlockId> h2d_src, h2d_dst, d2h_src, d2h_dst;
};

struct Row {
  std::string strategy;
  std::string ran;
  Dir dir;
  std::uint64_t block_bytes = 0, blocks = 0, bytes = 0;
  double p50_ms = 0, gbps = 0, ceiling_gbps = 0, host_api_ms = 0;
  // CPU time of the whole process from submission until the copy completed,
  // without the benchmark thread's own wait (p50 over reps).
  double cpu_ms = 0;
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

  int run();

 private:
  int fail(const Status& st);

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
  // With the runs16 pattern each half holds at least 16 blocks: it picks runs of 16 (a smaller half had none).
  std::uint64_t min_half() const { return a_.pattern == "runs16" ? 16 : 1; }
  std::uint64_t dev_half_for(std::uint64_t bb) const {
    const std::uint64_t unit = bb * planes();
    return std::max<std::uint64_t>({min_half(), 4 * blocks_for(bb), (pool_min_bytes() / 2 + unit - 1) / unit});
  }
  std::uint64_t host_half_for(std::uint64_t bb) const {
    return std::max<std::uint64_t>(min_half(), 4 * blocks_for(bb));
  }

  Status setup();

  std::byte* dev_b_base() const { return pools_.device.bytes_ptr() + pools_.device_bytes / 2; }
  std::byte* host_b_base() const { return pools_.host->data() + pools_.host_bytes / 2; }

  Status build(SizeSetup& z, std::uint64_t bb);
  CopyRequest request(const SizeSetup& z, bool h2d, CopyStrategy s) const;
  Status poison(const SizeSetup& z, bool h2d);
  Status verify(const SizeSetup& z, bool h2d);
  template <typename FA, typename FB>
  Result<double> timed(FA&& fn_a, FB* fn_b, bool prequeue = false);
  double last_host_api_ms_ = 0;
  double last_cpu_ms_ = 0;

  Result<double> ceiling(const SizeSetup& z, Dir dir);
  Status run_size(std::uint64_t bb);

  void print_header() const;
  void emit(const Row& r) const;

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

}  // namespace kvtier::cli::bench_copy_detail
