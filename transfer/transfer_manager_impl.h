// TransferManagerImpl, the one implementation of TransferManager, and the
// records it keeps, shared by the files that define it: TaskRec (one task:
// its blocks, per-slot state, events and callbacks, the origins of the bytes
// it reads and the one of the bytes it writes), PendingEntry (a slot waiting
// on its completion event in a stream's queue) and DirCounters (the stats of
// one direction), ExternalRec (an external write whose blocks are declared).
// transfer_manager.cc creates, initialises, reports and shuts the manager
// down; transfer_submit.cc accepts tasks and enqueues them on the transfer
// streams; transfer_external.cc declares, reports, ends and releases external
// writes; transfer_progress.cc settles completed slots on the progress thread
// and runs the callbacks; transfer_waits.cc answers waits and queries.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvtier/transfer/transfer_manager.h"
#include "transfer/event_pool.h"
#include "transfer/hazard_tracker.h"

namespace kvtier::transfer_detail {

using Clock = std::chrono::steady_clock;

struct TaskRec {
  TaskId id = 0;
  TaskKind kind = TaskKind::kEvict;
  std::vector<BlockId> device_blocks;
  std::vector<BlockId> host_blocks;
  // Loads: the layers in order; evicts: empty (one slot covers all layers).
  std::vector<std::uint32_t> layers;
  // Evicts and loads: the copy over the lists above, checked once at submission; each layer is posted from it.
  PreparedCopy copy;
  std::vector<LayerState> slot_state;
  std::vector<KeptStatus> slot_status;
  std::vector<EventLease> slot_event;
  std::vector<Clock::time_point> slot_done_at;
  // Origins (not yet known good) of the bytes the pairs read: (pair, origin).
  SourceOrigins sources;
  WriteOriginRef origin;  // of the bytes this task writes
  bool copy_failed = false;
  // External writes: the blocks named failed by reported layers (sorted, unique), and whether a layer ended
  // without a report (then every block failed).
  std::vector<BlockId> ext_failed;
  bool ext_all_failed = false;
  std::size_t slots_final = 0;
  // Set once the callbacks of a final slot / task ran: host waiters wake on
  // these, so that wait() returning implies the callbacks are done.
  std::vector<bool> slot_visible;
  bool visible = false;
  TaskState state = TaskState::kPending;
  KeptStatus status;
  FailedBlocks failed;
  std::uint64_t bytes = 0;
  Clock::time_point submitted;
  LayerCallback on_layer;
  TaskCallback on_done;
  std::uint32_t completion_queue = 0;
  std::uint64_t completion_generation = 0;

  std::size_t num_slots() const { return slot_state.size(); }

  // The fields every kind starts with: `events.size()` pending slots (one per layer, or one for an eviction),
  // the payload and callbacks, and a fresh origin of the bytes it writes (device_blocks is set before).
  void start(TaskId task_id, TaskKind task_kind, std::vector<EventLease> events, std::uint64_t payload,
             LayerCallback layer_cb, TaskCallback done_cb) {
    const std::size_t n = events.size();
    id = task_id;
    kind = task_kind;
    slot_state.assign(n, TaskState::kPending);
    slot_visible.assign(n, false);
    slot_status.assign(n, KeptStatus());
    slot_event = std::move(events);
    slot_done_at.assign(n, Clock::time_point{});
    bytes = payload;
    submitted = Clock::now();
    on_layer = std::move(layer_cb);
    on_done = std::move(done_cb);
    origin = std::make_shared<WriteOrigin>(id);
  }
};

// A callback to run with the lock released: a layer's on_layer or a task's on_done, with its task.
struct Callback {
  std::function<void()> run;
  std::shared_ptr<TaskRec> task;
};
using Callbacks = std::vector<Callback>;

struct PendingEntry {
  std::shared_ptr<TaskRec> task;
  std::size_t slot = 0;
  EventLease event;  // null: the slot failed at enqueue; `preset` holds why
  KeptStatus preset;
};

// The registry series of an attached manager (transfer_metrics.cc). Counters
// are advanced from stats() deltas at scrape time; `seen` is the last export.
// An external write while its blocks are declared (begin_external_write until released).
struct ExternalRec {
  std::shared_ptr<TaskRec> task;
  std::vector<EventLease> layer_events;  // slot events (the task's copies are reset as slots settle)
  EventLease done;                       // recorded at release, after every layer event: the hazard records' writer
  std::vector<bool> reported;
  std::vector<BlockId> sorted_blocks;
  bool ended = false;
};

// Directions of the stats and metrics: evict, load, external.
inline constexpr int kNumDirs = 3;
inline int dir_index(TaskKind k) { return k == TaskKind::kEvict ? 0 : k == TaskKind::kLoad ? 1 : 2; }

struct TransferMetricSeries {
  using Delta = metrics::CounterDelta;
  Delta tasks_ok[kNumDirs], tasks_failed[kNumDirs], bytes[kNumDirs], blocks[kNumDirs], failed_blocks[kNumDirs];
  Delta layers_ok, layers_failed;
  metrics::Gauge* in_flight[kNumDirs] = {};
  double in_flight_seen[kNumDirs] = {0, 0, 0};
  metrics::Histogram* task_latency[kNumDirs] = {};  // evict, load, external
  metrics::Histogram* layer_latency = nullptr;
};

struct DirCounters {
  DirectionStats s;
  std::uint64_t busy_ns = 0;
  Clock::time_point busy_since;
};

// InvalidArgument naming a block listed twice in `ids` (transfer_submit.cc).
Status check_no_duplicates(std::span<const BlockId> ids, std::string_view what);
// `layers` checked against the layout (empty: every layer in order).
Result<std::vector<std::uint32_t>> layer_order(const KvLayout& layout, std::span<const std::uint32_t> layers,
                                               std::string_view what);

class TransferManagerImpl final : public TransferManager {
 public:
  TransferManagerImpl(Device& device, Stream& compute, const TransferManagerConfig& config)
      : device_(device), compute_(compute), config_(config) {}

  ~TransferManagerImpl() override {
    shutdown().ignore_error();
    // Scrapes export the counters; one last export keeps what the manager did since the last scrape. The hook
    // reads this manager: gone before anything of it is.
    if (metrics_registry_) {
      export_metrics();
      metrics_registry_->remove_collect_hook(metrics_hook_);
      for (int d = 0; d < kNumDirs; ++d) metrics_->in_flight[d]->add(-metrics_->in_flight_seen[d]);
    }
  }

  Status init(KvCacheRegistration reg, CopyEngine* engine);

  Result<TaskId> evict_to_host_async(std::span<const BlockId> device_blocks, std::span<const BlockId> host_blocks,
                                     const EvictOptions& options) override;
  Result<TaskId> load_layers_to_device_async(std::span<const std::uint32_t> layers,
                                             std::span<const BlockId> host_blocks,
                                             std::span<const BlockId> device_blocks, LoadOptions options) override;
  Status record_device_access(std::span<const BlockId> device_blocks, Stream& stream, DeviceAccess access) override;
  Result<TaskId> begin_external_write(std::span<const std::uint32_t> layers, std::span<const BlockId> device_blocks,
                                      ExternalWriteOptions options) override;
  Status complete_external_layer(TaskId task, std::uint32_t layer, std::span<const BlockId> failed_blocks,
                                 Stream* after) override;
  Status end_external_write(TaskId task, const Status& status, bool quiescent) override;
  Status release_external_write(TaskId task) override;
  Status wait_for_layer(TaskId task, std::uint32_t layer, Stream& stream) override;
  Status wait_layer_host(TaskId task, std::uint32_t layer, std::chrono::nanoseconds timeout) override;
  Status wait(TaskId task, std::chrono::nanoseconds timeout) override;
  Status wait_all(std::chrono::nanoseconds timeout) override;
  Result<TaskInfo> task_info(TaskId task) const override;
  Result<FailedBlocks> failed_blocks(TaskId task) const override;
  std::vector<TaskCompletion> poll_completions() override { return poll_completions(0); }
  Result<std::uint32_t> open_completion_queue() override;
  Status close_completion_queue(std::uint32_t queue) override;
  // The queue's generation for a task submitted to it now (its completion is dropped if the queue is closed, or
  // closed and opened again, before it settles).
  Result<std::uint64_t> completion_queue_generation(std::uint32_t queue, std::string_view what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue >= completions_.size() || !completions_[queue].open)
      return InvalidArgument(fmt::format("{}: completion_queue {} is not open", what, queue));
    return completions_[queue].generation;
  }
  std::vector<TaskCompletion> poll_completions(std::uint32_t queue) override;
  Result<bool> is_device_block_free(BlockId block) override { return dev_hazards_->is_free(block); }
  Result<bool> is_host_block_free(BlockId block) override { return host_hazards_->is_free(block); }
  Status wait_device_blocks_free(std::span<const BlockId> blocks, Stream& stream) override;
  Status wait_host_blocks_free(std::span<const BlockId> blocks, std::chrono::nanoseconds timeout) override {
    return host_hazards_->wait_free_host(blocks, timeout);
  }
  TransferStats stats() const override;
  const BlockSpace& device_space() const noexcept override { return device_space_; }
  const BlockSpace& host_space() const noexcept override { return host_space_; }
  Stream& input_stream() noexcept override { return *in_; }
  Stream& output_stream() noexcept override { return *out_; }
  Stream& compute_stream() noexcept override { return compute_; }
  Device& device() const noexcept override { return device_; }
  const TransferManagerConfig& config() const noexcept override { return config_; }
  Status shutdown() override;
  Status attach_metrics(metrics::Registry& registry, const metrics::Labels& labels) override;
  // Pushes stats() into the attached series (the registry's collect hook).
  void export_metrics();

 private:
  // A submission thread: enqueues accepted tasks on its stream, in order.
  struct SubmitJob {
    std::shared_ptr<TaskRec> task;
    EventSet waits;  // hazards, found when the task was accepted
  };
  struct SubmitWorker {
    Stream* stream = nullptr;
    std::deque<PendingEntry>* queue = nullptr;  // completion queue of that stream
    std::mutex mu;
    std::condition_variable cv;
    std::deque<SubmitJob> jobs;
    bool stop = false;
    std::thread thread;
  };
  // Caller holds submit_mu_: ResourceExhausted when too many tasks are in flight.
  Status admit_locked() const;
  // Caller holds submit_mu_: FailedPrecondition naming the first block an external write declared.
  Status check_not_external_locked(std::span<const BlockId> blocks, std::string_view what) const;
  // Caller holds submit_mu_. Layer slot k of x is final with `st` (failed blocks `failed`, or every block when
  // `all_failed`) once the work enqueued so far on `landed_on` completed.
  void report_external_layer_locked(ExternalRec& x, std::size_t k, Status st, std::span<const BlockId> failed,
                                    bool all_failed, Stream& landed_on);
  // Caller holds submit_mu_. Every layer not reported fails with `status`; then the write is ended. Not
  // `quiescent` and every layer reported: the blocks no report named failed are undeclared now.
  void end_external_locked(ExternalRec& x, const Status& status, bool quiescent);
  // Caller holds submit_mu_. Orders the hazard records' writer after every layer and undeclares the blocks.
  void release_external_locked(TaskId id);
  // Registers a new task in the state tables (queryable and waitable by id).
  void register_task(const std::shared_ptr<TaskRec>& task);
  // Hands the job to w's thread, or runs it now (async_submit = false).
  void dispatch(SubmitWorker& w, SubmitJob job);
  void worker_loop(SubmitWorker& w);
  // Waits, copies, records and queues the completion entries of one task.
  void run_job(SubmitWorker& w, SubmitJob& job);
  void stop_workers();
  void progress_loop();
  // Settles whatever completed; returns true if anything changed.
  bool progress_once(Callbacks& fire);
  // Runs the callbacks collected while settling, then makes the settled slots
  // and tasks visible to host waiters. A callback may host-wait (a later layer
  // of its own task, another task): the progress thread then settles and fires
  // a nested batch inside it. A task with a callback not yet returned in an
  // enclosing batch is "held" (firing_): its callbacks of the nested batch, and
  // the publication of its slots and of itself, wait (deferred_*) until it is
  // not, so a task's callbacks run in order, one at a time, on_done last, and a
  // host wait on another thread returns after them.
  void fire_and_publish(Callbacks& fire);
  // Runs the deferred callbacks of tasks no longer held (each holds its task while it runs), in order.
  void run_released_callbacks();
  bool on_progress_thread() const noexcept {
    return progress_id_.load(std::memory_order_acquire) == std::this_thread::get_id();
  }
  // Caller holds mu_. Whether a host waiter may return for the task (or its
  // slot k): its callbacks ran. On the progress thread (inside a callback)
  // it is enough that it is final: its callbacks may be queued behind the
  // running one, in the same batch.
  bool final_for_waiter(const TaskRec& t) const {
    return on_progress_thread() ? t.state != TaskState::kPending : t.visible;
  }
  bool final_for_waiter(const TaskRec& t, std::size_t k) const {
    return on_progress_thread() ? t.slot_state[k] != TaskState::kPending : t.slot_visible[k];
  }
  // Caller holds `lock` (on mu_). Waits until pred() or the deadline. On the
  // progress thread (a callback waiting for another task) no other thread
  // would settle anything, so this thread drives progress itself.
  template <typename Pred>
  bool wait_state(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, Pred pred);
  // Caller holds mu_. Returns false if a source is still unsettled.
  bool sources_settled(const TaskRec& t) const;
  void finalize_slot_locked(const std::shared_ptr<TaskRec>& t, std::size_t slot, Status copy_status, Callbacks& fire);
  void finalize_task_locked(const std::shared_ptr<TaskRec>& t, Callbacks& fire);
  DirCounters& dir(TaskKind k) { return k == TaskKind::kEvict ? evict_ : k == TaskKind::kLoad ? load_ : external_; }
  const std::shared_ptr<TaskRec>* find_locked(TaskId id) const {
    auto it = tasks_.find(id);
    return it == tasks_.end() ? nullptr : &it->second;
  }
  Status task_not_found(TaskId id) const {  // under mu_
    if (stop_)                              // shutdown() forgets every task, finished or not
      return FailedPrecondition(fmt::format("transfer task {}: the TransferManager was shut down", id));
    return NotFound(fmt::format("transfer task {} is unknown or no longer retained (retained_finished_tasks = {})", id,
                                config_.retained_finished_tasks));
  }

  Device& device_;
  Stream& compute_;
  TransferManagerConfig config_;

  // Declared first: destroyed last, after the streams drained and every
  // event that refers to its memory is gone.
  std::unique_ptr<PinnedMemory> host_memory_;
  BlockSpace device_space_;
  BlockSpace host_space_;
  std::unique_ptr<Stream> in_;
  std::unique_ptr<Stream> out_;
  // External writes' layer events are recorded here when their bytes landed already; their `done` event too.
  std::unique_ptr<Stream> ext_;
  std::unique_ptr<CopyEngine> owned_engine_;
  CopyEngine* engine_ = nullptr;
  std::unique_ptr<EventPool> pool_;
  RecordGate gate_;
  std::unique_ptr<HazardTracker> dev_hazards_;
  std::unique_ptr<HazardTracker> host_hazards_;

  // Submit path: hazard lookup + enqueue + record + note is one step.
  std::mutex submit_mu_;
  bool shut_ = false;  // guarded by submit_mu_
  Status shutdown_status_;
  std::uint64_t next_id_ = 1;  // guarded by submit_mu_
  // Guarded by submit_mu_: per device block, the external write that declared it (0: none), and those writes.
  std::vector<TaskId> external_of_;
  std::unordered_map<TaskId, ExternalRec> externals_;

  // Task state, queues, stats.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // progress thread: new work or stop
  std::condition_variable state_cv_;  // waiters: something became final
  bool stop_ = false;
  std::deque<PendingEntry> in_queue_;
  std::deque<PendingEntry> out_queue_;
  std::deque<PendingEntry> ext_queue_;  // reported external layers, in report order
  std::unordered_map<TaskId, std::shared_ptr<TaskRec>> tasks_;
  std::set<TaskId> pending_ids_;
  std::deque<TaskId> finished_order_;
  // Per completion queue (open_completion_queue; 0: poll_completions()'s), under mu_. A task settles into its
  // queue only while the queue is in the generation it was submitted in.
  struct CompletionQueue {
    std::deque<TaskCompletion> items;
    std::uint64_t generation = 0;
    bool open = true;
  };
  std::vector<CompletionQueue> completions_{1};
  DirCounters evict_;
  DirCounters load_;
  DirCounters external_;
  std::uint64_t layers_done_ = 0;
  std::uint64_t layers_failed_ = 0;
  std::vector<double> latency_us_;
  std::size_t latency_next_ = 0;
  // Settled since the last fire_and_publish (guarded by mu_).
  std::vector<std::pair<std::shared_ptr<TaskRec>, std::size_t>> settled_slots_;
  std::vector<std::shared_ptr<TaskRec>> settled_tasks_;
  // The progress thread's own (fire_and_publish): per task, its callbacks of the batches being fired (nested ones
  // included) that have not returned yet; the callbacks, slots and tasks of held tasks, waiting (deferred_slots_ and
  // deferred_tasks_ are read under mu_ where they are published).
  std::unordered_map<const TaskRec*, std::uint32_t> firing_;
  Callbacks deferred_callbacks_;
  std::vector<std::pair<std::shared_ptr<TaskRec>, std::size_t>> deferred_slots_;
  std::vector<std::shared_ptr<TaskRec>> deferred_tasks_;
  std::uint64_t latency_count_ = 0;
  // Set once by attach_metrics (under mu_); read by the progress thread under mu_.
  std::unique_ptr<TransferMetricSeries> metrics_;
  std::uint64_t metrics_hook_ = 0;
  metrics::Registry* metrics_registry_ = nullptr;

  std::thread progress_;
  std::atomic<std::thread::id> progress_id_{};
  // Set (under submit_mu_) when the first shutdown() finished; later calls wait for it.
  bool shutdown_done_ = false;
  std::condition_variable shutdown_cv_;
  std::unique_ptr<SubmitWorker> in_worker_;
  std::unique_ptr<SubmitWorker> out_worker_;
};

}  // namespace kvtier::transfer_detail
