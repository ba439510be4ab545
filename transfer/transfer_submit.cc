// The submit path of TransferManagerImpl: evict_to_host_async and
// load_layers_to_device_async check a request, find its hazards, note its
// accesses and register the task under the submit lock, then hand it to the
// submission thread of its stream (or run it inline when async_submit is
// off), which waits on the hazards, enqueues the copies, records the
// completion events and queues them for the progress thread;
// record_device_access notes the caller's own accesses to device blocks.
#include <fmt/format.h>

#include <algorithm>

#include "transfer/transfer_manager_impl.h"

namespace kvtier::transfer_detail {

Status check_no_duplicates(std::span<const BlockId> ids, std::string_view what) {
  std::vector<std::pair<BlockId, std::size_t>> sorted;
  sorted.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) sorted.push_back({ids[i], i});
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].first == sorted[i - 1].first)
      return InvalidArgument(fmt::format("{} lists block {} twice (indices {} and {})", what, sorted[i].first,
                                         sorted[i - 1].second, sorted[i].second));
  return Status::Ok();
}

Result<std::vector<std::uint32_t>> layer_order(const KvLayout& layout, std::span<const std::uint32_t> layers,
                                               std::string_view what) {
  std::vector<std::uint32_t> order;
  if (layers.empty()) {
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) order.push_back(l);
    return order;
  }
  std::vector<bool> seen(layout.num_layers(), false);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] >= layout.num_layers())
      return OutOfRange(
          fmt::format("{}: layer {} at index {} >= num_layers {}", what, layers[i], i, layout.num_layers()));
    if (seen[layers[i]]) return InvalidArgument(fmt::format("{}: layer {} listed twice", what, layers[i]));
    seen[layers[i]] = true;
    order.push_back(layers[i]);
  }
  return order;
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

Result<TaskId> TransferManagerImpl::evict_to_host_async(std::span<const BlockId> device_blocks,
                                                        std::span<const BlockId> host_blocks,
                                                        const EvictOptions& options) {
  if (device_blocks.size() != host_blocks.size())
    return InvalidArgument(fmt::format("evict_to_host_async: {} device blocks but {} host blocks", device_blocks.size(),
                                       host_blocks.size()));
  if (device_blocks.empty()) return InvalidArgument("evict_to_host_async: empty block lists");
  KVTIER_ASSIGN_OR_RETURN(const std::uint64_t generation,
                          completion_queue_generation(options.completion_queue, "evict_to_host_async"));
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "device_blocks"));
  KVTIER_RETURN_IF_ERROR(host_hazards_->check_ids(host_blocks, "host_blocks"));
  KVTIER_RETURN_IF_ERROR(check_no_duplicates(host_blocks, "evict_to_host_async host_blocks"));
  // The task's own lists, checked once here; the worker posts the copy prepared over them.
  auto task = std::make_shared<TaskRec>();
  task->device_blocks.assign(device_blocks.begin(), device_blocks.end());
  task->host_blocks.assign(host_blocks.begin(), host_blocks.end());
  {
    CopyRequest req;
    req.src = &device_space_;
    req.dst = &host_space_;
    req.src_blocks = task->device_blocks;
    req.dst_blocks = task->host_blocks;
    req.strategy = config_.evict_strategy;
    auto prepared = engine_->prepare(req);
    if (!prepared.ok()) return prepared.status().with_context("evict_to_host_async");
    task->copy = *prepared;
  }

  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("evict_to_host_async after shutdown");
  KVTIER_RETURN_IF_ERROR(admit_locked());
  // A block a peer is writing holds no bytes to read yet (or a failed receive's, still being written).
  KVTIER_RETURN_IF_ERROR(check_not_external_locked(device_blocks, "evict_to_host_async"));
  Stream& after = options.after ? *options.after : compute_;
  const std::uint64_t out_id = out_->id();

  // 1. The compute work that wrote the blocks, as a point on its stream
  //    (recorded now, in the caller's stream order).
  KVTIER_ASSIGN_OR_RETURN(EventLease e_c, pool_->acquire());
  KVTIER_ASSIGN_OR_RETURN(EventLease e_o, pool_->acquire());
  KVTIER_RETURN_IF_ERROR(device_.record(*e_c, after));
  SubmitJob job;
  job.waits.add(e_c);
  dev_hazards_->hazards_for_read(device_blocks, out_id, job.waits, &task->sources);
  host_hazards_->hazards_for_write(host_blocks, out_id, job.waits);

  task->start(next_id_++, TaskKind::kEvict, {e_o}, device_space_.layout().total_block_bytes() * device_blocks.size(),
              nullptr, options.on_done);
  task->completion_queue = options.completion_queue;
  task->completion_generation = generation;

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
                                                                std::span<const BlockId> host_blocks,
                                                                std::span<const BlockId> device_blocks,
                                                                LoadOptions options) {
  const KvLayout& layout = device_space_.layout();
  if (device_blocks.size() != host_blocks.size())
    return InvalidArgument(fmt::format("load_layers_to_device_async: {} host blocks but {} device blocks",
                                       host_blocks.size(), device_blocks.size()));
  if (device_blocks.empty()) return InvalidArgument("load_layers_to_device_async: empty block lists");
  KVTIER_ASSIGN_OR_RETURN(const std::uint64_t generation,
                          completion_queue_generation(options.completion_queue, "load_layers_to_device_async"));
  KVTIER_RETURN_IF_ERROR(host_hazards_->check_ids(host_blocks, "host_blocks"));
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "device_blocks"));
  KVTIER_RETURN_IF_ERROR(check_no_duplicates(device_blocks, "load_layers_to_device_async device_blocks"));
  KVTIER_ASSIGN_OR_RETURN(std::vector<std::uint32_t> ordered,
                          layer_order(layout, layers, "load_layers_to_device_async"));
  // The task's own lists, checked once here; the worker posts each layer from the copy prepared over them.
  auto task = std::make_shared<TaskRec>();
  task->device_blocks.assign(device_blocks.begin(), device_blocks.end());
  task->host_blocks.assign(host_blocks.begin(), host_blocks.end());
  task->layers = std::move(ordered);
  {
    CopyRequest req;
    req.src = &host_space_;
    req.dst = &device_space_;
    req.src_blocks = task->host_blocks;
    req.dst_blocks = task->device_blocks;
    req.layers = task->layers;
    req.strategy = config_.load_strategy;
    auto prepared = engine_->prepare(req);
    if (!prepared.ok()) return prepared.status().with_context("load_layers_to_device_async");
    task->copy = *prepared;
  }
  const std::vector<std::uint32_t>& order = task->layers;
  const std::size_t n = order.size();
  std::uint64_t bytes = 0;
  for (std::uint32_t l : order)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) bytes += layout.block_bytes(l, r) * device_blocks.size();

  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("load_layers_to_device_async after shutdown");
  KVTIER_RETURN_IF_ERROR(admit_locked());
  // The peer's writes cannot be ordered with a load's: the two would interleave in the block.
  KVTIER_RETURN_IF_ERROR(check_not_external_locked(device_blocks, "load_layers_to_device_async"));
  std::vector<EventLease> events(n);
  for (auto& e : events) {
    KVTIER_ASSIGN_OR_RETURN(e, pool_->acquire());
  }
  const std::uint64_t in_id = in_->id();
  SubmitJob job;
  host_hazards_->hazards_for_read(host_blocks, in_id, job.waits, &task->sources);
  dev_hazards_->hazards_for_write(device_blocks, in_id, job.waits);

  task->start(next_id_++, TaskKind::kLoad, events, bytes, std::move(options.on_layer), std::move(options.on_done));
  task->completion_queue = options.completion_queue;
  task->completion_generation = generation;

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
  bool broken = false;  // a record failed and the stream was drained: enqueue nothing more
  const std::size_t n = events.size();
  for (std::size_t k = 0; k < n; ++k) {
    PendingEntry entry{task, k, nullptr, Status::Ok()};
    Status st = failed;
    if (st.ok() && broken)
      st = Aborted(fmt::format("layer {} not enqueued: the device failed earlier in this load", t.layers[k]));
    if (st.ok()) {
      // A load posts its layers one at a time; an eviction copies every layer at once.
      const auto layers = load ? std::span<const std::uint32_t>(&t.layers[k], 1) : std::span<const std::uint32_t>();
      auto report = engine_->copy(t.copy, layers, stream);
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

Status TransferManagerImpl::record_device_access(std::span<const BlockId> device_blocks, Stream& stream,
                                                 DeviceAccess access) {
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "record_device_access"));
  std::lock_guard<std::mutex> submit(submit_mu_);
  if (shut_) return FailedPrecondition("record_device_access after shutdown");
  // An overwrite clears the blocks' failure history, which a peer's late write would make a lie: not while one may
  // still write them. (Reads and appending writes are the decode's own use of what it received.)
  if (access == DeviceAccess::kOverwrite)
    KVTIER_RETURN_IF_ERROR(check_not_external_locked(device_blocks, "record_device_access(overwrite)"));
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

}  // namespace kvtier::transfer_detail
