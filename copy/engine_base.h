// Backend-independent part of the CopyEngine: validation, planning, kAuto,
// per-stream state (scratch, descriptor slot ring, in-flight tracking) and the
// kernel descriptor protocol. Backends implement the three executors.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "copy/kernel_plan.h"
#include "copy/plan.h"
#include "kvtier/copy/copy_engine.h"

namespace kvtier::copy_detail {

// Largest batch submitted behind a gate (below the driver's per-stream limit
// of pending copies, 512-1023 on the H200).
inline constexpr std::size_t kMaxGatedBatchDescriptors = 448;

// Backend-specific per-stream state (e.g. the CUDA gate flag).
struct BackendStreamState {
  virtual ~BackendStreamState() = default;
};

// One kernel descriptor slot: pinned staging (CPU writes the plane table and
// pairs) + device buffer (uploaded copy), reusable once `done` completed.
struct DescriptorSlot {
  std::unique_ptr<PinnedMemory> staging;
  Buffer device;
  std::unique_ptr<Event> done;
  bool pending = false;  // `done` was recorded after the last use
  std::uint64_t capacity = 0;
};

// kStagedDma resources of one caller stream (copy_engine.h, "Staged DMA").
struct StagedSlot {
  Buffer staging;                    // device memory, staged_slot_bytes
  std::unique_ptr<Event> dma_done;   // on the caller stream, after the last DMA using the slot
  std::unique_ptr<Event> kern_done;  // on the aux stream, after the last kernel using the slot
  bool dma_used = false;             // dma_done was recorded
  bool kern_used = false;            // kern_done was recorded
};
struct StagedStreamState {
  std::vector<StagedSlot> slots;
  std::uint32_t next = 0;        // next slot (the ring continues across calls)
  std::unique_ptr<Event> entry;  // D2H: the caller stream's work before copy()
  // Declared last: destroyed first, draining its kernels while the slots
  // (and the descriptor ring, in StreamState) still exist.
  std::unique_ptr<Stream> aux;
};

// kSplit resources of one caller stream.
struct SplitLane {
  std::unique_ptr<Event> done;  // on the lane, after its last DMA
  std::unique_ptr<Stream> stream;
};
// One timed kAuto split (copy_engine.h, auto_split_adaptive): timing events
// at the fork, after the kernel part and after each lane.
struct SplitTiming {
  std::unique_ptr<Event> fork;
  std::unique_ptr<Event> kernel_end;
  std::vector<std::unique_ptr<Event>> lane_end;
  bool pending = false;  // recorded, not harvested yet
  std::uint32_t size_class = 0;
  double share = 0;
  double kernel_bytes = 0;
  double dma_bytes = 0;
  std::size_t lanes = 0;
};
inline constexpr std::size_t kSplitTimingSlots = 4;
struct SplitStreamState {
  std::unique_ptr<Event> fork;  // on the caller stream, before the lanes' DMAs
  std::vector<SplitLane> lanes;
  std::array<SplitTiming, kSplitTimingSlots> timing;
};

// The share kAuto's split moves toward after one timed copy: the share at
// which both parts, at the rates they just showed, would finish together.
// Returns `share` unchanged when a byte count is not positive; times below
// 1 us count as 1 us.
double balanced_split_share(double share, double kernel_bytes, double kernel_ms, double dma_bytes, double dma_ms);
// Size class of a split for the tuner: direction and half-octave of the
// average segment size.
std::uint32_t split_size_class(CopyDirection dir, std::uint64_t average_segment_bytes);

// What kAuto's split learned per size class (engine-wide). Thread-safe.
class SplitTuner {
 public:
  // The tuned share of `size_class`, or `initial` before the first sample.
  double share(std::uint32_t size_class, double initial) const;
  // Moves the class's share by `gain` toward the balanced share of one
  // timed copy that ran at `share`, clamped to [lo, hi].
  void observe(std::uint32_t size_class, double share, double kernel_bytes, double kernel_ms, double dma_bytes,
               double dma_ms, double gain, double lo, double hi);
  // CPU budget (payload bytes per DMA descriptor) of `size_class`, or
  // `initial` before the first report.
  double budget(std::uint32_t size_class, double initial) const;
  // After a split: `cpu_late` when the GPU reached the fork before the last
  // lane was enqueued. Late: budget x 1.25, else / 1.25, clamped to [lo, hi].
  // A late report also pauses the class's split for its next kAuto copies
  // (the kernel alone, one launch, keeps a stream of back-to-back copies
  // GPU-bound: measured on an H200 with 32 back-to-back pieces of 4 KiB
  // blocks, split 0.68 vs kernel 0.84, docs/performance.md), after which one
  // split probes again with the larger budget: the pause is
  // kSplitPauseCopies after a split in time, and doubles (up to
  // kSplitMaxPauseCopies) with each late probe in a row.
  void report_submission(std::uint32_t size_class, double budget, bool cpu_late, double lo, double hi);
  bool paused(std::uint32_t size_class) const;
  // Counts one kAuto copy of a paused class.
  void note_copy_while_paused(std::uint32_t size_class);
  static constexpr int kSplitPauseCopies = 8;
  static constexpr int kSplitMaxPauseCopies = 256;

 private:
  struct ClassState {
    std::optional<double> share;
    std::optional<double> budget;
    int pause = 0;    // kAuto copies left before the next split
    int backoff = 0;  // the last pause, while late probes follow each other (0: none)
  };
  mutable std::mutex mu_;
  std::map<std::uint32_t, ClassState> classes_;
};

struct StreamState {
  std::mutex mu;  // serialises copy() calls on this stream
  std::uint64_t stream_id = 0;
  PlanScratch scratch;
  std::vector<DescriptorSlot> slots;
  std::uint32_t next_slot = 0;
  std::unique_ptr<BackendStreamState> backend;

  // In-flight tracking per direction: an event recorded after the last copy
  // of that direction. Guarded by track_mu (choose() on other threads queries).
  std::mutex track_mu;
  std::array<std::unique_ptr<Event>, kNumCopyDirections> last{};
  std::array<bool, kNumCopyDirections> maybe_pending{};

  // Created on the first staged copy; declared last so that its aux stream
  // drains before the descriptor slots its kernels read are freed.
  std::unique_ptr<StagedStreamState> staged;
  std::unique_ptr<SplitStreamState> split;
};

class EngineBase : public CopyEngine {
 public:
  EngineBase(Device& device, const CopyEngineOptions& options);
  ~EngineBase() override;

  Status validate(const CopyRequest& request) const override;
  Result<CopyReport> copy(const CopyRequest& request, Stream& stream) override;
  Result<PreparedCopy> prepare(const CopyRequest& request) const override;
  Result<CopyReport> copy(const PreparedCopy& prepared, std::span<const std::uint32_t> layers, Stream& stream,
                          std::uint64_t* checksums, std::uint64_t* landed_checksums) override;
  CopyStrategy choose(const CopyRequest& request) const override;
  static Status check_checksum_request(const CopyRequest& r);
  Result<CopyReport> checksum(const BlockSpace& space, std::span<const BlockId> blocks,
                              std::span<const std::uint32_t> layers, RoleMask roles, std::uint64_t* out,
                              Stream& stream) override;
  Status forget_stream(Stream& stream) override;
  const CopyEngineOptions& options() const noexcept override { return options_; }
  Device& device() const noexcept override { return device_; }

  // Options sanity (called by create()).
  static Status check_options(const CopyEngineOptions& o);

 protected:
  // One memcpy_async per segment (default: Device::memcpy_async).
  virtual Status run_per_run(StreamState& st, Stream& stream, std::span<const Segment> segments, CopyDirection dir);
  // All segments as batches of <= batch_max_descriptors; `gated`: hold the
  // stream busy until every chunk is queued.
  virtual Status run_batch(StreamState& st, Stream& stream, std::span<const Segment> segments, CopyDirection dir,
                           bool gated) = 0;
  // Launches the kernel over `args` (pointers are device-readable) with `ctas`
  // CTAs of options().sm_threads_per_cta threads. `staging`/`descriptor_bytes`:
  // the host copy of the descriptors args points to (unchanged until the
  // kernel completed), for backends that can check them.
  virtual Status launch_kernel(StreamState& st, Stream& stream, const KernelArgs& args, std::uint32_t ctas,
                               const std::byte* staging, std::uint64_t descriptor_bytes) = 0;
  // Launches the kernel with its descriptors (args.num_planes <= kInlineMaxPlanes
  // planes, args.num_pairs <= kInlineMaxPairs pairs, in host memory, valid only
  // during the call) carried by value in the launch; args.planes / args.pairs
  // are ignored.
  virtual Status launch_kernel_inline(StreamState& st, Stream& stream, const KernelArgs& args,
                                      const KernelPlane* planes, const KernelPair* pairs, std::uint32_t ctas) = 0;
  // Creates backend per-stream state on first use (may return null).
  virtual Result<std::unique_ptr<BackendStreamState>> make_backend_state(Stream& stream) { return {nullptr}; }
  // Whether a gate exists on this backend (host backend: no idle-stream cliff).
  virtual bool supports_gate() const noexcept { return false; }

  Device& device_;
  CopyEngineOptions options_;

 private:
  Result<std::shared_ptr<StreamState>> state_for(Stream& stream);
  // `caller_busy`: the caller's stream had work queued when copy() was called.
  CopyStrategy choose_impl(const PlanSummary& s, const StreamState* self, bool caller_busy = true) const;
  bool idle_prefers_kernel(std::uint64_t avg, bool caller_busy, bool duplex, std::uint64_t kernel_max) const;
  bool in_flight(CopyDirection dir, const StreamState* exclude) const;
  // `after_upload` (optional) runs once, after the first launch's descriptors
  // are enqueued for upload and before that launch (kSplit forks there).
  // With r.checksums the launches fold every word into its pair's checksum;
  // `store` false: they read and fold only (checksum()).
  Status run_kernel(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir, CopyReport& report,
                    const std::function<Status()>& after_upload = {}, bool store = true);
  // Precondition: the chunk plan of `r` is in st.scratch.staged.
  Status run_staged(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir, CopyReport& report);
  Result<StagedStreamState*> staged_state(StreamState& st);
  Status run_split(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir, double kernel_share,
                   bool automatic, const PlanSummary& summary, CopyReport& report);
  // The SM kernel's share of a kSplit copy: split_kernel_share when asked
  // for explicitly, the kAuto profile (tuned, when adaptive) otherwise.
  double split_share(const PlanSummary& s, bool automatic) const;
  // The CPU budget (payload bytes per DMA descriptor; 0: none) of a size class.
  double split_budget(std::uint32_t size_class) const;
  // Feeds the tuner with the stream's timed splits that have completed.
  void harvest_split_timing(StreamState& st);
  bool adaptive_split(bool automatic) const noexcept { return automatic && options_.auto_split_adaptive; }
  Result<SplitStreamState*> split_state(StreamState& st);
  // kAuto rule 4s: whether the staged rule applies to this request; when it
  // does, the chunk plan is left in `sc.staged`.
  bool staged_preferred(const CopyRequest& r, const PlanSummary& s, PlanScratch& sc) const;
  Result<DescriptorSlot*> acquire_slot(StreamState& st, std::uint64_t bytes);
  Status note_enqueued(StreamState& st, Stream& stream, CopyDirection dir);
  std::uint32_t ctas_for(CopyDirection dir) const noexcept;
  // copy() of a request that passed validation (copy(request) and copy(prepared, ...)).
  Result<CopyReport> copy_valid(const CopyRequest& r, Stream& stream);

  SplitTuner tuner_;
  mutable std::mutex map_mu_;
  std::map<std::uint64_t, std::shared_ptr<StreamState>> streams_;
};

}  // namespace kvtier::copy_detail
