#include "kvtier/transfer/transfer_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "kvtier/core/deadline.h"
#include "kvtier/transfer/event_pool.h"
#include "kvtier/transfer/hazard_tracker.h"

namespace kvtier {

std::string_view task_kind_name(TaskKind kind) noexcept {
  switch (kind) {
    case TaskKind::kEvict: return "evict";
    case TaskKind::kLoad: return "load";
  }
  return "?";
}

std::string_view task_state_name(TaskState state) noexcept {
  switch (state) {
    case TaskState::kPending: return "pending";
    case TaskState::kDone: return "done";
    case TaskState::kFailed: return "failed";
  }
  return "?";
}

namespace {

std::string dir_json(const DirectionStats& d) {
  return fmt::format(
      "{{\"tasks_submitted\":{},\"tasks_done\":{},\"tasks_failed\":{},\"bytes_submitted\":{},\"bytes_done\":{},"
      "\"busy_seconds\":{:.6f},\"gbps\":{:.3f},\"in_flight\":{},\"max_in_flight\":{}}}",
      d.tasks_submitted, d.tasks_done, d.tasks_failed, d.bytes_submitted, d.bytes_done, d.busy_seconds, d.gbps,
      d.in_flight, d.max_in_flight);
}

}  // namespace

std::string TransferStats::to_json() const {
  return fmt::format(
      "{{\"num_layers\":{},\"num_draft_layers\":{},\"device_ordinal\":{},\"device_name\":\"{}\","
      "\"num_device_blocks\":{},\"num_host_blocks\":{},\"block_bytes\":{},\"has_scales\":{},\"has_indexer\":{},"
      "\"is_mla\":{},\"evict\":{},\"load\":{},\"layers_done\":{},\"layers_failed\":{},"
      "\"layer_latency_p50_us\":{:.2f},\"layer_latency_p99_us\":{:.2f},\"latency_samples\":{},\"events_created\":{}}}",
      num_layers, num_draft_layers, device_ordinal, device_name, num_device_blocks, num_host_blocks, block_bytes,
      has_scales, has_indexer, is_mla, dir_json(evict), dir_json(load), layers_done, layers_failed,
      layer_latency_p50_us, layer_latency_p99_us, latency_samples, events_created);
}

namespace {

using Clock = std::chrono::steady_clock;

Status check_no_duplicates(std::span<const std::int32_t> ids, std::string_view what) {
  std::vector<std::pair<std::int32_t, std::size_t>> sorted;
  sorted.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) sorted.push_back({ids[i], i});
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].first == sorted[i - 1].first)
      return InvalidArgument(fmt::format("{} lists block {} twice (indices {} and {})", what, sorted[i].first,
                                         sorted[i - 1].second, sorted[i].second));
  return Status::Ok();
}

struct TaskRec {
  TaskId id = 0;
  TaskKind kind = TaskKind::kEvict;
  std::vector<std::int32_t> device_blocks;
  std::vector<std::int32_t> host_blocks;
  // Loads: the layers in order; evicts: empty (one slot covers all layers).
  std::vector<std::uint32_t> layers;
  std::vector<LayerState> slot_state;
  std::vector<Status> slot_status;
  std::vector<EventLease> slot_event;
  std::vector<Clock::time_point> slot_done_at;
  // Origins (not yet known good) of the bytes the pairs read: (pair, origin).
  SourceOrigins sources;
  WriteOriginRef origin;  // of the bytes this task writes
  bool copy_failed = false;
  std::size_t slots_final = 0;
  // Set once the callbacks of a final slot / task ran: host waiters wake on
  // these, so that wait() returning implies the callbacks are done.
  std::vector<bool> slot_visible;
  bool visible = false;
  TaskState state = TaskState::kPending;
  Status status;
  FailedBlocks failed;
  std::uint64_t bytes = 0;
  Clock::time_point submitted;
  LayerCallback on_layer;
  TaskCallback on_done;

  std::size_t num_slots() const { return slot_state.size(); }
};

struct PendingEntry {
  std::shared_ptr<TaskRec> task;
  std::size_t slot = 0;
  EventLease event;  // null: the slot failed at enqueue; `preset` holds why
  Status preset;
};

struct DirCounters {
  DirectionStats s;
  std::uint64_t busy_ns = 0;
  Clock::time_point busy_since;
};

class TransferManagerImpl final : public TransferManager {
 public:
  TransferManagerImpl(Device& device, Stream& compute, const TransferManagerConfig& config)
      : device_(device), compute_(compute), config_(config) {}

  ~TransferManagerImpl() override { shutdown().ignore_error(); }

  Status init(KvCacheRegistration reg, CopyEngine* engine);

  Result<TaskId> evict_to_host_async(std::span<const std::int32_t> device_blocks,
                                     std::span<const std::int32_t> host_blocks, const EvictOptions& options) override;
  Result<TaskId> load_layers_to_device_async(std::span<const std::uint32_t> layers,
                                             std::span<const std::int32_t> host_blocks,
                                             std::span<const std::int32_t> device_blocks, LoadOptions options) override;
  Status record_device_access(std::span<const std::int32_t> device_blocks, Stream& stream,
                              DeviceAccess access) override;
  Status wait_for_layer(TaskId task, std::uint32_t layer, Stream& stream) override;
  Status wait_layer_host(TaskId task, std::uint32_t layer, std::chrono::nanoseconds timeout) override;
  Status wait(TaskId task, std::chrono::nanoseconds timeout) override;
  Status wait_all(std::chrono::nanoseconds timeout) override;
  Result<TaskInfo> task_info(TaskId task) const override;
  Result<FailedBlocks> failed_blocks(TaskId task) const override;
  std::vector<TaskCompletion> poll_completions() override;
  Result<bool> is_device_block_free(std::int32_t block) override { return dev_hazards_->is_free(block); }
  Result<bool> is_host_block_free(std::int32_t block) override { return host_hazards_->is_free(block); }
  Status wait_device_blocks_free(std::span<const std::int32_t> blocks, Stream& stream) override {
    return dev_hazards_->wait_free(blocks, stream);
  }
  Status wait_host_blocks_free(std::span<const std::int32_t> blocks, std::chrono::nanoseconds timeout) override {
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
  bool progress_once(std::vector<std::function<void()>>& fire);
  // Runs the callbacks collected while settling, then makes the settled slots
  // and tasks visible to host waiters.
  void fire_and_publish(std::vector<std::function<void()>>& fire);
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
  void finalize_slot_locked(const std::shared_ptr<TaskRec>& t, std::size_t slot, Status copy_status,
                            std::vector<std::function<void()>>& fire);
  void finalize_task_locked(const std::shared_ptr<TaskRec>& t, std::vector<std::function<void()>>& fire);
  DirCounters& dir(TaskKind k) { return k == TaskKind::kEvict ? evict_ : load_; }
  const std::shared_ptr<TaskRec>* find_locked(TaskId id) const {
    auto it = tasks_.find(id);
    return it == tasks_.end() ? nullptr : &it->second;
  }
  Status task_not_found(TaskId id) const {
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

  // Task state, queues, stats.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // progress thread: new work or stop
  std::condition_variable state_cv_;  // waiters: something became final
  bool stop_ = false;
  std::deque<PendingEntry> in_queue_;
  std::deque<PendingEntry> out_queue_;
  std::unordered_map<TaskId, std::shared_ptr<TaskRec>> tasks_;
  std::set<TaskId> pending_ids_;
  std::deque<TaskId> finished_order_;
  std::deque<TaskCompletion> completions_;
  DirCounters evict_;
  DirCounters load_;
  std::uint64_t layers_done_ = 0;
  std::uint64_t layers_failed_ = 0;
  std::vector<double> latency_us_;
  std::size_t latency_next_ = 0;
  // Settled since the last fire_and_publish (guarded by mu_).
  std::vector<std::pair<std::shared_ptr<TaskRec>, std::size_t>> settled_slots_;
  std::vector<std::shared_ptr<TaskRec>> settled_tasks_;
  std::uint64_t latency_count_ = 0;

  std::thread progress_;
  std::atomic<std::thread::id> progress_id_{};
  // Set (under submit_mu_) when the first shutdown() finished; later calls wait for it.
  bool shutdown_done_ = false;
  std::condition_variable shutdown_cv_;
  std::unique_ptr<SubmitWorker> in_worker_;
  std::unique_ptr<SubmitWorker> out_worker_;
};

Status TransferManagerImpl::init(KvCacheRegistration reg, CopyEngine* engine) {
  if (reg.device.kind() != MemoryKind::kDevice)
    return InvalidArgument("TransferManager: registration.device must be a kDevice BlockSpace");
  if (reg.device.device_ordinal() != device_.ordinal())
    return InvalidArgument(
        fmt::format("TransferManager: device cache is on ordinal {} but the Device is ordinal {} "
                    "(process-visible ordinals, after CUDA_VISIBLE_DEVICES)",
                    reg.device.device_ordinal(), device_.ordinal()));
  if (reg.device.num_blocks() == 0) return InvalidArgument("TransferManager: device cache has 0 blocks");
  device_space_ = std::move(reg.device);
  const KvLayout& layout = device_space_.layout();

  if (reg.host.space) {
    if (reg.host.space->kind() != MemoryKind::kPinnedHost)
      return InvalidArgument("TransferManager: registration.host.space must be a kPinnedHost BlockSpace");
    if (!(reg.host.space->layout() == layout))
      return InvalidArgument(fmt::format("TransferManager: host layout ({}) differs from device layout ({})",
                                         reg.host.space->layout().describe(), layout.describe()));
    host_space_ = *reg.host.space;
  } else {
    const HostCacheSpec& h = reg.host;
    if (h.num_blocks == 0)
      return InvalidArgument("TransferManager: host cache needs either a space or num_blocks >= 1");
    std::uint64_t bytes = 0;
    if (h.arrangement == HostCacheSpec::Arrangement::kLayerFirst) {
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
          bytes += (BlockSpace::layer_first_region_bytes(layout, l, r, h.num_blocks) + 255) / 256 * 256;
    } else {
      bytes = BlockSpace::page_first_page_bytes(layout, h.page_alignment) * h.num_blocks;
    }
    auto mem = device_.allocate_pinned(bytes, h.pinned);
    if (!mem.ok())
      return mem.status().with_context(fmt::format("TransferManager: pinned host cache of {} bytes", bytes));
    host_memory_ = std::move(mem).value();
    KVTIER_RETURN_IF_ERROR(host_memory_->wait_ready(config_.host_ready_timeout));
    if (h.fill_byte >= 0) std::memset(host_memory_->data(), h.fill_byte, host_memory_->size());
    if (h.arrangement == HostCacheSpec::Arrangement::kLayerFirst) {
      std::vector<std::vector<void*>> bases(layout.num_layers());
      std::byte* p = host_memory_->data();
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
          bases[l].push_back(p);
          p += (BlockSpace::layer_first_region_bytes(layout, l, r, h.num_blocks) + 255) / 256 * 256;
        }
      KVTIER_ASSIGN_OR_RETURN(host_space_, BlockSpace::layer_first(MemoryKind::kPinnedHost, device_.ordinal(), layout,
                                                                   h.num_blocks, std::move(bases)));
    } else {
      KVTIER_ASSIGN_OR_RETURN(host_space_,
                              BlockSpace::page_first(MemoryKind::kPinnedHost, device_.ordinal(), layout, h.num_blocks,
                                                     host_memory_->data(), host_memory_->size(), h.page_alignment));
    }
  }

  StreamOptions in_opts{config_.input_priority, "kvtier-transfer-input"};
  StreamOptions out_opts{config_.output_priority, "kvtier-transfer-output"};
  KVTIER_ASSIGN_OR_RETURN(in_, device_.create_stream(in_opts));
  KVTIER_ASSIGN_OR_RETURN(out_, device_.create_stream(out_opts));
  if (engine) {
    if (&engine->device() != &device_)
      return InvalidArgument("TransferManager: the CopyEngine given belongs to another Device");
    engine_ = engine;
  } else {
    KVTIER_ASSIGN_OR_RETURN(owned_engine_, CopyEngine::create(device_, config_.copy_engine));
    engine_ = owned_engine_.get();
  }
  KVTIER_ASSIGN_OR_RETURN(pool_, EventPool::create(device_, 2 * layout.num_layers() + 8, config_.event_pool_max_free));
  dev_hazards_ = std::make_unique<HazardTracker>(device_, device_space_.num_blocks(), "device", &gate_);
  host_hazards_ = std::make_unique<HazardTracker>(device_, host_space_.num_blocks(), "host", &gate_);
  latency_us_.assign(std::max<std::size_t>(config_.latency_samples, 1), 0.0);
  in_worker_ = std::make_unique<SubmitWorker>();
  in_worker_->stream = in_.get();
  in_worker_->queue = &in_queue_;
  out_worker_ = std::make_unique<SubmitWorker>();
  out_worker_->stream = out_.get();
  out_worker_->queue = &out_queue_;
  progress_ = std::thread([this] {
    progress_id_.store(std::this_thread::get_id(), std::memory_order_release);
    progress_loop();
  });
  if (config_.async_submit) {
    in_worker_->thread = std::thread([this] { worker_loop(*in_worker_); });
    out_worker_->thread = std::thread([this] { worker_loop(*out_worker_); });
  }
  return Status::Ok();
}

void TransferManagerImpl::register_task(const std::shared_ptr<TaskRec>& task) {
  std::lock_guard<std::mutex> lock(mu_);
  DirCounters& d = dir(task->kind);
  d.s.tasks_submitted++;
  d.s.bytes_submitted += task->bytes;
  if (d.s.in_flight++ == 0) d.busy_since = Clock::now();
  d.s.max_in_flight = std::max(d.s.max_in_flight, d.s.in_flight);
  pending_ids_.insert(task->id);
  tasks_[task->id] = task;
}
Status TransferManagerImpl::admit_locked() const {
  if (shut_) return FailedPrecondition("transfer submit after shutdown");
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_ids_.size() >= config_.max_in_flight_tasks)
    return ResourceExhausted(fmt::format("{} transfer tasks in flight (max_in_flight_tasks)", pending_ids_.size()));
  return Status::Ok();
}

Result<TaskId> TransferManagerImpl::evict_to_host_async(std::span<const std::int32_t> device_blocks,
                                                        std::span<const std::int32_t> host_blocks,
                                                        const EvictOptions& options) {
  if (device_blocks.size() != host_blocks.size())
    return InvalidArgument(fmt::format("evict_to_host_async: {} device blocks but {} host blocks", device_blocks.size(),
                                       host_blocks.size()));
  if (device_blocks.empty()) return InvalidArgument("evict_to_host_async: empty block lists");
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "device_blocks"));
  KVTIER_RETURN_IF_ERROR(host_hazards_->check_ids(host_blocks, "host_blocks"));
  KVTIER_RETURN_IF_ERROR(check_no_duplicates(host_blocks, "evict_to_host_async host_blocks"));
  {
    CopyRequest req;
    req.src = &device_space_;
    req.dst = &host_space_;
    req.src_blocks = device_blocks;
    req.dst_blocks = host_blocks;
    req.strategy = config_.evict_strategy;
    KVTIER_RETURN_IF_ERROR(engine_->validate(req).with_context("evict_to_host_async"));
  }

  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("evict_to_host_async after shutdown");
  KVTIER_RETURN_IF_ERROR(admit_locked());
  Stream& after = options.after ? *options.after : compute_;
  const std::uint64_t out_id = out_->id();

  // 1. The compute work that wrote the blocks, as a point on its stream
  //    (recorded now, in the caller's stream order).
  KVTIER_ASSIGN_OR_RETURN(EventLease e_c, pool_->acquire());
  KVTIER_ASSIGN_OR_RETURN(EventLease e_o, pool_->acquire());
  KVTIER_RETURN_IF_ERROR(device_.record(*e_c, after));
  SubmitJob job;
  job.waits.add(e_c);
  auto task = std::make_shared<TaskRec>();
  dev_hazards_->hazards_for_read(device_blocks, out_id, job.waits, &task->sources);
  host_hazards_->hazards_for_write(host_blocks, out_id, job.waits);

  task->id = next_id_++;
  task->kind = TaskKind::kEvict;
  task->device_blocks.assign(device_blocks.begin(), device_blocks.end());
  task->host_blocks.assign(host_blocks.begin(), host_blocks.end());
  task->slot_state.assign(1, TaskState::kPending);
  task->slot_visible.assign(1, false);
  task->slot_status.assign(1, Status::Ok());
  task->slot_done_at.assign(1, Clock::time_point{});
  task->slot_event.assign(1, e_o);
  task->bytes = device_space_.layout().total_block_bytes() * device_blocks.size();
  task->submitted = Clock::now();
  task->on_done = options.on_done;
  task->origin = std::make_shared<WriteOrigin>(task->id);

  // 2. e_o, recorded by the submission after the copy: the device blocks are
  //    busy until it, the host blocks written at it.
  gate_.expect(e_o.get());
  dev_hazards_->note_read(device_blocks, e_o, out_id);
  host_hazards_->note_write(host_blocks, e_o, out_id, task->origin, /*full=*/true);
  register_task(task);
  job.task = std::move(task);
  const TaskId id = job.task->id;
  dispatch(*out_worker_, std::move(job));
  return id;
}

Result<TaskId> TransferManagerImpl::load_layers_to_device_async(std::span<const std::uint32_t> layers,
                                                                std::span<const std::int32_t> host_blocks,
                                                                std::span<const std::int32_t> device_blocks,
                                                                LoadOptions options) {
  const KvLayout& layout = device_space_.layout();
  if (device_blocks.size() != host_blocks.size())
    return InvalidArgument(fmt::format("load_layers_to_device_async: {} host blocks but {} device blocks",
                                       host_blocks.size(), device_blocks.size()));
  if (device_blocks.empty()) return InvalidArgument("load_layers_to_device_async: empty block lists");
  KVTIER_RETURN_IF_ERROR(host_hazards_->check_ids(host_blocks, "host_blocks"));
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "device_blocks"));
  KVTIER_RETURN_IF_ERROR(check_no_duplicates(device_blocks, "load_layers_to_device_async device_blocks"));
  std::vector<std::uint32_t> order;
  if (layers.empty()) {
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) order.push_back(l);
  } else {
    std::vector<bool> seen(layout.num_layers(), false);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (layers[i] >= layout.num_layers())
        return OutOfRange(fmt::format("load_layers_to_device_async: layer {} at index {} >= num_layers {}", layers[i],
                                      i, layout.num_layers()));
      if (seen[layers[i]])
        return InvalidArgument(fmt::format("load_layers_to_device_async: layer {} listed twice", layers[i]));
      seen[layers[i]] = true;
      order.push_back(layers[i]);
    }
  }
  {
    CopyRequest req;
    req.src = &host_space_;
    req.dst = &device_space_;
    req.src_blocks = host_blocks;
    req.dst_blocks = device_blocks;
    req.layers = order;
    req.strategy = config_.load_strategy;
    KVTIER_RETURN_IF_ERROR(engine_->validate(req).with_context("load_layers_to_device_async"));
  }
  const std::size_t n = order.size();
  std::uint64_t bytes = 0;
  for (std::uint32_t l : order)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) bytes += layout.block_bytes(l, r) * device_blocks.size();

  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("load_layers_to_device_async after shutdown");
  KVTIER_RETURN_IF_ERROR(admit_locked());
  std::vector<EventLease> events(n);
  for (auto& e : events) {
    KVTIER_ASSIGN_OR_RETURN(e, pool_->acquire());
  }
  const std::uint64_t in_id = in_->id();
  auto task = std::make_shared<TaskRec>();
  SubmitJob job;
  host_hazards_->hazards_for_read(host_blocks, in_id, job.waits, &task->sources);
  dev_hazards_->hazards_for_write(device_blocks, in_id, job.waits);

  task->id = next_id_++;
  task->kind = TaskKind::kLoad;
  task->device_blocks.assign(device_blocks.begin(), device_blocks.end());
  task->host_blocks.assign(host_blocks.begin(), host_blocks.end());
  task->layers = std::move(order);
  task->slot_state.assign(n, TaskState::kPending);
  task->slot_visible.assign(n, false);
  task->slot_status.assign(n, Status::Ok());
  task->slot_event = events;
  task->slot_done_at.assign(n, Clock::time_point{});
  task->bytes = bytes;
  task->submitted = Clock::now();
  task->on_layer = std::move(options.on_layer);
  task->on_done = std::move(options.on_done);
  task->origin = std::make_shared<WriteOrigin>(task->id);

  for (const auto& e : events) gate_.expect(e.get());
  // The last layer's event completes every layer (one stream, in order).
  host_hazards_->note_read(host_blocks, events.back(), in_id);
  dev_hazards_->note_write(device_blocks, events.back(), in_id, task->origin, /*full=*/n == layout.num_layers());
  register_task(task);
  job.task = std::move(task);
  const TaskId id = job.task->id;
  dispatch(*in_worker_, std::move(job));
  return id;
}

void TransferManagerImpl::dispatch(SubmitWorker& w, SubmitJob job) {
  if (!config_.async_submit) {
    run_job(w, job);  // inline, under the submit lock (synchronous submission)
    return;
  }
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.jobs.push_back(std::move(job));
  }
  w.cv.notify_one();
}

void TransferManagerImpl::worker_loop(SubmitWorker& w) {
  for (;;) {
    SubmitJob job;
    {
      std::unique_lock<std::mutex> lock(w.mu);
      w.cv.wait(lock, [&] { return w.stop || !w.jobs.empty(); });
      if (w.jobs.empty()) return;  // stopping, and every accepted task was submitted
      job = std::move(w.jobs.front());
      w.jobs.pop_front();
    }
    run_job(w, job);
  }
}

namespace {
// Releases a job's expected events on every path out of run_job: a waiter on
// an event that is never recorded must not hang.
struct ReleaseRecords {
  RecordGate& gate;
  const std::vector<EventLease>& events;
  std::size_t next = 0;
  void upto(std::size_t k) {
    for (; next < std::min(k, events.size()); ++next) gate.recorded(events[next].get());
  }
  ~ReleaseRecords() { upto(events.size()); }
};
}  // namespace

void TransferManagerImpl::run_job(SubmitWorker& w, SubmitJob& job) {
  const std::shared_ptr<TaskRec> task = job.task;
  TaskRec& t = *task;
  Stream& stream = *w.stream;
  const std::vector<EventLease> events = t.slot_event;  // finalize may reset the task's copies
  ReleaseRecords release{gate_, events};

  // 1. Hazards, on the device. An event of the other submission thread
  //    belongs to an earlier task: wait until it is recorded, then on it.
  Status failed;
  for (const auto& e : job.waits.events()) {
    gate_.wait(e.get());
    Status st = device_.wait(stream, *e);
    if (!st.ok()) {
      failed = st.with_context(fmt::format("{} task {}: ordering after earlier work", task_kind_name(t.kind), t.id));
      break;
    }
  }
  const bool load = t.kind == TaskKind::kLoad;
  CopyRequest req;
  req.src = load ? &host_space_ : &device_space_;
  req.dst = load ? &device_space_ : &host_space_;
  req.src_blocks = load ? t.host_blocks : t.device_blocks;
  req.dst_blocks = load ? t.device_blocks : t.host_blocks;
  req.strategy = load ? config_.load_strategy : config_.evict_strategy;
  bool broken = false;  // a record failed and the stream was drained: enqueue nothing more
  const std::size_t n = events.size();
  for (std::size_t k = 0; k < n; ++k) {
    PendingEntry entry{task, k, nullptr, Status::Ok()};
    Status st = failed;
    if (st.ok() && broken)
      st = Aborted(fmt::format("layer {} not enqueued: the device failed earlier in this load", t.layers[k]));
    if (st.ok()) {
      if (load) req.layers = std::span<const std::uint32_t>(&t.layers[k], 1);
      auto report = engine_->copy(req, stream);
      if (!report.ok())
        st = report.status().with_context(load ? fmt::format("load layer {}", t.layers[k])
                                               : std::string("evict_to_host_async"));
    }
    if (!broken) {
      // Recorded even after a failed copy or wait: part of it may be queued,
      // and later work is ordered after this event.
      Status rec = device_.record(*events[k], stream);
      if (!rec.ok()) {
        // Without an event nothing can order after this copy: drain the
        // stream here (only on a broken device).
        device_.synchronize(stream, config_.shutdown_timeout).ignore_error();
        if (st.ok()) st = rec.with_context("recording the completion event");
        broken = true;
      }
    }
    if (st.ok()) {
      entry.event = events[k];
    } else {
      entry.preset = st;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!st.ok()) t.slot_status[k] = st;  // seen by wait_for_layer once the event is released
      w.queue->push_back(std::move(entry));
    }
    release.upto(k + 1);
    work_cv_.notify_one();
  }
}

Status TransferManagerImpl::record_device_access(std::span<const std::int32_t> device_blocks, Stream& stream,
                                                 DeviceAccess access) {
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "record_device_access"));
  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("record_device_access after shutdown");
  KVTIER_ASSIGN_OR_RETURN(EventLease e, pool_->acquire());
  KVTIER_RETURN_IF_ERROR(device_.record(*e, stream));
  switch (access) {
    case DeviceAccess::kRead: dev_hazards_->note_read(device_blocks, e, stream.id()); break;
    case DeviceAccess::kWrite:
    case DeviceAccess::kOverwrite:
      // Pending writers (a load still writing later layers) and readers are
      // kept: kvtier did not order this write after them.
      dev_hazards_->note_write(device_blocks, e, stream.id(), nullptr, access == DeviceAccess::kOverwrite,
                               /*ordered_after_pending=*/false);
      break;
  }
  return Status::Ok();
}

Status TransferManagerImpl::wait_for_layer(TaskId id, std::uint32_t layer, Stream& stream) {
  EventLease event;
  std::shared_ptr<TaskRec> task;
  std::size_t k = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto* t = find_locked(id);
    if (!t) return task_not_found(id);
    task = *t;
    if (task->kind != TaskKind::kLoad)
      return InvalidArgument(fmt::format("wait_for_layer: task {} is an eviction, not a load", id));
    auto it = std::find(task->layers.begin(), task->layers.end(), layer);
    if (it == task->layers.end())
      return InvalidArgument(fmt::format("wait_for_layer: load task {} does not load layer {}", id, layer));
    k = static_cast<std::size_t>(it - task->layers.begin());
    if (task->slot_state[k] == TaskState::kDone) return Status::Ok();
    if (task->slot_state[k] == TaskState::kFailed) return task->slot_status[k];
    event = task->slot_event[k];
    if (!event) return Internal(fmt::format("wait_for_layer: pending layer {} of task {} has no event", layer, id));
  }
  // The layer may still wait for its submission thread: block (on the CPU,
  // for submission only, never for device work) until its event is recorded.
  gate_.wait(event.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!task->slot_status[k].ok()) return task->slot_status[k];  // failed at enqueue
  }
  return device_.wait(stream, *event);
}

Status TransferManagerImpl::wait_layer_host(TaskId id, std::uint32_t layer, std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  auto* t = find_locked(id);
  if (!t) return task_not_found(id);
  std::shared_ptr<TaskRec> task = *t;
  if (task->kind != TaskKind::kLoad)
    return InvalidArgument(fmt::format("wait_layer_host: task {} is an eviction, not a load", id));
  auto it = std::find(task->layers.begin(), task->layers.end(), layer);
  if (it == task->layers.end())
    return InvalidArgument(fmt::format("wait_layer_host: load task {} does not load layer {}", id, layer));
  std::size_t k = static_cast<std::size_t>(it - task->layers.begin());
  if (!wait_state(lock, deadline, [&] { return final_for_waiter(*task, k); }))
    return TimedOut(fmt::format("layer {} of load task {} not ready after {} us", layer, id, timeout.count() / 1000));
  return task->slot_state[k] == TaskState::kDone ? Status::Ok() : task->slot_status[k];
}

Status TransferManagerImpl::wait(TaskId id, std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  auto* t = find_locked(id);
  if (!t) return task_not_found(id);
  std::shared_ptr<TaskRec> task = *t;
  if (!wait_state(lock, deadline, [&] { return final_for_waiter(*task); }))
    return TimedOut(fmt::format("transfer task {} not final after {} us", id, timeout.count() / 1000));
  return task->status;
}

Status TransferManagerImpl::wait_all(std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  TaskId target;
  {
    std::lock_guard<std::mutex> submit(submit_mu_);
    target = next_id_ - 1;
  }
  std::unique_lock<std::mutex> lock(mu_);
  auto all_final = [&] {
    if (!on_progress_thread()) return pending_ids_.empty() || *pending_ids_.begin() > target;
    // In a callback: tasks of the batch being fired are final but not yet
    // published (their ids are still pending).
    for (TaskId p : pending_ids_) {
      if (p > target) break;
      auto* t = find_locked(p);
      if (t && (*t)->state == TaskState::kPending) return false;
    }
    return true;
  };
  if (!wait_state(lock, deadline, all_final))
    return TimedOut(
        fmt::format("{} transfer tasks still in flight after {} us", pending_ids_.size(), timeout.count() / 1000));
  return Status::Ok();
}

template <typename Pred>
bool TransferManagerImpl::wait_state(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, Pred pred) {
  if (!on_progress_thread()) return state_cv_.wait_until(lock, deadline, pred);
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    // The batch whose callbacks are running (this one among them) is
    // published by the outer fire_and_publish once they all ran: keep it
    // out of the nested one.
    auto outer_slots = std::move(settled_slots_);
    auto outer_tasks = std::move(settled_tasks_);
    settled_slots_.clear();
    settled_tasks_.clear();
    lock.unlock();
    std::vector<std::function<void()>> fire;
    const bool any = progress_once(fire);
    if (any) fire_and_publish(fire);
    lock.lock();
    settled_slots_.insert(settled_slots_.begin(), outer_slots.begin(), outer_slots.end());
    settled_tasks_.insert(settled_tasks_.begin(), outer_tasks.begin(), outer_tasks.end());
    if (!any && !pred()) {
      lock.unlock();
      std::this_thread::sleep_for(std::min<Clock::duration>(config_.poll_interval, deadline - Clock::now()));
      lock.lock();
    }
  }
  return true;
}

Result<TaskInfo> TransferManagerImpl::task_info(TaskId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto* t = find_locked(id);
  if (!t) return task_not_found(id);
  const TaskRec& task = **t;
  TaskInfo info;
  info.kind = task.kind;
  info.state = task.state;
  info.status = task.status;
  info.layers = task.layers;
  if (task.kind == TaskKind::kLoad) info.layer_states = task.slot_state;
  info.bytes = task.bytes;
  return info;
}

Result<FailedBlocks> TransferManagerImpl::failed_blocks(TaskId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto* t = find_locked(id);
  if (!t) return task_not_found(id);
  return (*t)->failed;
}

std::vector<TaskCompletion> TransferManagerImpl::poll_completions() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TaskCompletion> out(std::make_move_iterator(completions_.begin()),
                                  std::make_move_iterator(completions_.end()));
  completions_.clear();
  return out;
}

bool TransferManagerImpl::sources_settled(const TaskRec& t) const {
  for (const auto& [i, origin] : t.sources)
    if (!origin->settled()) return false;
  return true;
}

void TransferManagerImpl::finalize_slot_locked(const std::shared_ptr<TaskRec>& tp, std::size_t slot, Status copy_status,
                                               std::vector<std::function<void()>>& fire) {
  TaskRec& t = *tp;
  const auto now = Clock::now();
  Status st = std::move(copy_status);
  if (!st.ok()) {
    t.copy_failed = true;
    st = st.with_context(t.kind == TaskKind::kLoad ? fmt::format("load task {} layer {}", t.id, t.layers[slot])
                                                   : fmt::format("evict task {}", t.id));
  } else {
    // The bytes read must themselves be valid.
    const auto& src_ids = t.kind == TaskKind::kLoad ? t.host_blocks : t.device_blocks;
    for (const auto& [i, origin] : t.sources) {
      if (origin->block_failed(src_ids[i])) {
        st = DataLoss(fmt::format("{} task {}: {} block {} holds bytes of failed task {}", task_kind_name(t.kind), t.id,
                                  t.kind == TaskKind::kLoad ? "host" : "device", src_ids[i], origin->task_id));
        break;
      }
    }
  }
  t.slot_state[slot] = st.ok() ? TaskState::kDone : TaskState::kFailed;
  t.slot_status[slot] = st;
  t.slot_done_at[slot] = now;
  t.slot_event[slot].reset();
  t.slots_final++;
  settled_slots_.push_back({tp, slot});
  if (t.kind == TaskKind::kLoad) {
    if (st.ok())
      layers_done_++;
    else
      layers_failed_++;
    latency_us_[latency_next_] = std::chrono::duration<double, std::micro>(now - t.submitted).count();
    latency_next_ = (latency_next_ + 1) % latency_us_.size();
    latency_count_++;
    if (t.on_layer) {
      auto cb = t.on_layer;
      std::uint32_t layer = t.layers[slot];
      fire.push_back([cb, layer, st] { cb(layer, st); });
    }
  }
  if (t.slots_final == t.num_slots()) finalize_task_locked(tp, fire);
}

void TransferManagerImpl::finalize_task_locked(const std::shared_ptr<TaskRec>& tp,
                                               std::vector<std::function<void()>>& fire) {
  TaskRec& t = *tp;
  Status first;
  for (const auto& s : t.slot_status)
    if (!s.ok()) {
      first = s;
      break;
    }
  const bool is_load = t.kind == TaskKind::kLoad;
  const auto& src_ids = is_load ? t.host_blocks : t.device_blocks;
  const auto& dst_ids = is_load ? t.device_blocks : t.host_blocks;
  std::vector<bool> pair_bad(dst_ids.size(), false);
  for (const auto& [i, origin] : t.sources)
    if (origin->settled() && origin->block_failed(src_ids[i])) pair_bad[i] = true;
  std::vector<std::int32_t> bad_src, bad_dst;
  for (std::size_t i = 0; i < dst_ids.size(); ++i) {
    if (pair_bad[i]) bad_src.push_back(src_ids[i]);
    if (pair_bad[i] || t.copy_failed) bad_dst.push_back(dst_ids[i]);
  }
  std::sort(bad_src.begin(), bad_src.end());
  bad_src.erase(std::unique(bad_src.begin(), bad_src.end()), bad_src.end());
  // A load whose layers partly failed for a bad source leaves every
  // destination of that pair invalid; a copy failure invalidates them all.
  if (!first.ok() && bad_dst.empty()) bad_dst = dst_ids;
  t.state = first.ok() ? TaskState::kDone : TaskState::kFailed;
  t.status = first;
  t.failed.device = is_load ? bad_dst : bad_src;
  t.failed.host = is_load ? bad_src : bad_dst;
  // Publish the validity of the bytes written.
  if (!first.ok()) {
    t.origin->all_failed = t.copy_failed || bad_dst.size() == dst_ids.size();
    t.origin->failed_blocks = bad_dst;
    std::sort(t.origin->failed_blocks.begin(), t.origin->failed_blocks.end());
    t.origin->state.store(WriteOrigin::kFailed, std::memory_order_release);
  } else {
    t.origin->state.store(WriteOrigin::kOk, std::memory_order_release);
  }
  t.sources.clear();
  t.sources.shrink_to_fit();

  DirCounters& d = dir(t.kind);
  if (first.ok()) {
    d.s.tasks_done++;
    d.s.bytes_done += t.bytes;
  } else {
    d.s.tasks_failed++;
  }
  if (--d.s.in_flight == 0)
    d.busy_ns += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - d.busy_since).count());
  settled_tasks_.push_back(tp);
  finished_order_.push_back(t.id);
  while (finished_order_.size() > config_.retained_finished_tasks) {
    tasks_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
  completions_.push_back(TaskCompletion{t.id, t.kind, first, t.failed, t.bytes});
  while (completions_.size() > config_.max_unpolled_completions) completions_.pop_front();
  if (t.on_done) {
    auto cb = t.on_done;
    TaskId id = t.id;
    fire.push_back([cb, id, first] { cb(id, first); });
  }
}

bool TransferManagerImpl::progress_once(std::vector<std::function<void()>>& fire) {
  bool any = false;
  bool progressed = true;
  while (progressed) {
    progressed = false;
    // Output first: evictions settle before the loads that read their bytes.
    for (std::deque<PendingEntry>* q : {&out_queue_, &in_queue_}) {
      for (;;) {
        PendingEntry head;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (q->empty()) break;
          head = q->front();
        }
        Status copy_status = head.preset;
        if (head.event) {
          auto done = device_.query(*head.event);
          if (done.ok() && !done.value()) break;  // in order: nothing behind it is done either
          if (!done.ok()) copy_status = done.status();
        }
        std::lock_guard<std::mutex> lock(mu_);
        // The bytes it read came from a task not settled yet (it completed on
        // the device, or this would not be done): settle that one first.
        if (copy_status.ok() && !sources_settled(*head.task)) break;
        q->pop_front();
        finalize_slot_locked(head.task, head.slot, std::move(copy_status), fire);
        progressed = true;
        any = true;
      }
    }
  }
  return any;
}

void TransferManagerImpl::progress_loop() {
  std::vector<std::function<void()>> fire;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto idle = [&] { return in_queue_.empty() && out_queue_.empty(); };
      if (idle()) {
        if (stop_) return;
        work_cv_.wait(lock, [&] { return stop_ || !idle(); });
        if (stop_ && idle()) return;
      } else {
        work_cv_.wait_for(lock, config_.poll_interval);
      }
    }
    bool any = progress_once(fire);
    if (any) fire_and_publish(fire);
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stop_;
    }
    if (stopping && !any) {
      // Shutdown drained the streams; anything still pending will not
      // complete: fail it so no waiter hangs.
      std::unique_lock<std::mutex> lock(mu_);
      for (std::deque<PendingEntry>* q : {&out_queue_, &in_queue_}) {
        while (!q->empty()) {
          PendingEntry head = q->front();
          q->pop_front();
          if (head.event) {
            auto done = device_.query(*head.event);
            if (done.ok() && !done.value()) {
              finalize_slot_locked(head.task, head.slot,
                                   Cancelled("transfer manager shut down before the copy completed"), fire);
              continue;
            }
            if (!done.ok()) {
              finalize_slot_locked(head.task, head.slot, done.status(), fire);
              continue;
            }
          }
          finalize_slot_locked(head.task, head.slot, head.preset, fire);
        }
      }
      lock.unlock();
      fire_and_publish(fire);
      return;
    }
  }
}

void TransferManagerImpl::fire_and_publish(std::vector<std::function<void()>>& fire) {
  for (auto& f : fire) {
    try {
      f();
    } catch (...) {
      // A callback must not take the progress thread down.
    }
  }
  fire.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [t, slot] : settled_slots_) t->slot_visible[slot] = true;
    for (auto& t : settled_tasks_) {
      t->visible = true;
      pending_ids_.erase(t->id);
    }
    settled_slots_.clear();
    settled_tasks_.clear();
  }
  state_cv_.notify_all();
}

TransferStats TransferManagerImpl::stats() const {
  TransferStats s;
  const KvLayout& layout = device_space_.layout();
  s.num_layers = layout.num_layers();
  for (const auto& l : layout.layers()) {
    if (l.draft) s.num_draft_layers++;
    for (const auto& r : l.roles) {
      if (r.role == Role::kKeyScale || r.role == Role::kValueScale) s.has_scales = true;
      if (r.role == Role::kIndexer) s.has_indexer = true;
      if (r.role == Role::kLatent) s.is_mla = true;
    }
  }
  s.device_ordinal = device_.ordinal();
  s.device_name = device_.name();
  s.num_device_blocks = device_space_.num_blocks();
  s.num_host_blocks = host_space_.num_blocks();
  s.block_bytes = layout.total_block_bytes();
  s.events_created = pool_ ? pool_->created() : 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto fill = [](const DirCounters& d) {
    DirectionStats out = d.s;
    std::uint64_t ns = d.busy_ns;
    if (d.s.in_flight > 0)
      ns += static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - d.busy_since).count());
    out.busy_seconds = static_cast<double>(ns) * 1e-9;
    out.gbps = out.busy_seconds > 0 ? static_cast<double>(out.bytes_done) / out.busy_seconds * 1e-9 : 0.0;
    return out;
  };
  s.evict = fill(evict_);
  s.load = fill(load_);
  s.layers_done = layers_done_;
  s.layers_failed = layers_failed_;
  std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(latency_count_, latency_us_.size()));
  s.latency_samples = n;
  if (n > 0) {
    std::vector<double> v(latency_us_.begin(), latency_us_.begin() + static_cast<std::ptrdiff_t>(n));
    auto pct = [&](double p) {
      std::size_t k = std::min(n - 1, static_cast<std::size_t>(p * static_cast<double>(n - 1) + 0.5));
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
      return v[k];
    };
    s.layer_latency_p50_us = pct(0.50);
    s.layer_latency_p99_us = pct(0.99);
  }
  return s;
}

void TransferManagerImpl::stop_workers() {
  for (SubmitWorker* w : {in_worker_.get(), out_worker_.get()}) {
    if (w == nullptr) continue;
    {
      std::lock_guard<std::mutex> lock(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
    if (w->thread.joinable()) w->thread.join();
  }
}

Status TransferManagerImpl::shutdown() {
  if (on_progress_thread())
    return FailedPrecondition(
        "TransferManager::shutdown called from a transfer callback: shutdown joins the thread that runs callbacks");
  {
    std::unique_lock<std::mutex> submit(submit_mu_);
    if (shut_) {
      // Idempotent: a later call returns once the first one completed, with its status.
      const auto limit = deadline_after(2 * config_.shutdown_timeout + std::chrono::seconds(10));
      if (!shutdown_cv_.wait_until(submit, limit, [&] { return shutdown_done_; }))
        return TimedOut("TransferManager::shutdown: the shutdown already under way did not complete");
      return shutdown_status_;
    }
    shut_ = true;
  }
  // Every accepted task is enqueued (or failed) before the streams drain.
  stop_workers();
  Status result;
  if (in_ && out_) {
    for (Stream* s : {in_.get(), out_.get()}) {
      Status st = device_.synchronize(*s, config_.shutdown_timeout);
      if (st.code() == StatusCode::kTimedOut && result.ok())
        result = st.with_context("TransferManager::shutdown draining a transfer stream");
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  if (!owned_engine_ && engine_ && in_ && out_) {
    // An external engine lives on: release its per-stream state before our streams go.
    engine_->forget_stream(*in_).ignore_error();
    engine_->forget_stream(*out_).ignore_error();
  }
  if (!result.ok() && host_memory_) {
    // Copies may still be writing the host cache: never free it under them.
    (void)host_memory_.release();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.clear();
    in_queue_.clear();
    out_queue_.clear();
  }
  {
    std::lock_guard<std::mutex> submit(submit_mu_);
    shutdown_status_ = result;
    shutdown_done_ = true;
  }
  shutdown_cv_.notify_all();
  return result;
}

}  // namespace

Status validate_transfer_config(const TransferManagerConfig& c) {
  auto bad = [](std::string_view field, auto value, std::string_view rule) {
    return InvalidArgument(fmt::format("TransferManagerConfig.{} = {} ({})", field, value, rule));
  };
  if (c.max_in_flight_tasks == 0) return bad("max_in_flight_tasks", 0, "must be >= 1: every submit would fail");
  if (c.retained_finished_tasks == 0) return bad("retained_finished_tasks", 0, "must be >= 1");
  if (c.latency_samples == 0) return bad("latency_samples", 0, "must be >= 1");
  if (c.poll_interval.count() <= 0)
    return bad("poll_interval", fmt::format("{}us", c.poll_interval.count()), "must be > 0");
  if (c.shutdown_timeout.count() <= 0)
    return bad("shutdown_timeout", fmt::format("{}ms", c.shutdown_timeout.count()), "must be > 0");
  if (c.host_ready_timeout.count() <= 0)
    return bad("host_ready_timeout", fmt::format("{}ms", c.host_ready_timeout.count()), "must be > 0");
  for (auto [field, st] : {std::pair{"evict_strategy", c.evict_strategy}, std::pair{"load_strategy", c.load_strategy}})
    if (static_cast<unsigned>(st) >= static_cast<unsigned>(kNumCopyStrategies))
      return bad(field, static_cast<int>(st), "not a CopyStrategy");
  for (auto [field, p] :
       {std::pair{"input_priority", c.input_priority}, std::pair{"output_priority", c.output_priority}})
    if (p != StreamPriority::kNormal && p != StreamPriority::kHigh)
      return bad(field, static_cast<int>(p), "not a StreamPriority");
  return Status::Ok();
}

Result<std::unique_ptr<TransferManager>> TransferManager::create(Device& device, Stream& compute,
                                                                 KvCacheRegistration registration,
                                                                 const TransferManagerConfig& config,
                                                                 CopyEngine* engine) {
  if (&compute.device() != &device)
    return InvalidArgument("TransferManager::create: the compute stream belongs to another Device");
  KVTIER_RETURN_IF_ERROR(validate_transfer_config(config).with_context("TransferManager::create"));
  auto mgr = std::make_unique<TransferManagerImpl>(device, compute, config);
  KVTIER_RETURN_IF_ERROR(mgr->init(std::move(registration), engine));
  return std::unique_ptr<TransferManager>(std::move(mgr));
}

}  // namespace kvtier
