// The progress side of TransferManagerImpl: the progress thread
// (progress_loop) polls the completion events of the two streams' queues in
// order (progress_once), settles each slot and then its task once the
// sources it read are settled (finalize_slot_locked, finalize_task_locked:
// states, failed blocks, the validity of the bytes written, stats, retained
// tasks and completions), runs the callbacks and publishes the settled slots
// and tasks to host waiters (fire_and_publish); at shutdown it fails what
// will not complete.
#include <fmt/format.h>

#include <algorithm>

#include "transfer/transfer_manager_impl.h"

namespace kvtier::transfer_detail {

bool TransferManagerImpl::sources_settled(const TaskRec& t) const {
  for (const auto& [i, origin] : t.sources)
    if (!origin->settled()) return false;
  return true;
}

void TransferManagerImpl::finalize_slot_locked(const std::shared_ptr<TaskRec>& tp, std::size_t slot, Status copy_status,
                                               Callbacks& fire) {
  TaskRec& t = *tp;
  const auto now = Clock::now();
  Status st = std::move(copy_status);
  const bool layered = t.kind != TaskKind::kEvict;
  if (!st.ok()) {
    // An external write's failures name their blocks (finalize_task_locked), not the whole task.
    if (t.kind != TaskKind::kExternalWrite) t.copy_failed = true;
    st = st.with_context(layered ? fmt::format("{} task {} layer {}", task_kind_name(t.kind), t.id, t.layers[slot])
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
  if (layered) {
    if (st.ok())
      layers_done_++;
    else
      layers_failed_++;
    const double us = std::chrono::duration<double, std::micro>(now - t.submitted).count();
    latency_us_[latency_next_] = us;
    latency_next_ = (latency_next_ + 1) % latency_us_.size();
    latency_count_++;
    if (metrics_) metrics_->layer_latency->observe(us * 1e-6);
    if (t.on_layer) {
      auto cb = t.on_layer;
      std::uint32_t layer = t.layers[slot];
      // A notification: the outcome stays in the task's record, so a callback that ignores it loses nothing.
      fire.push_back({[cb, layer, kept = KeptStatus(st)] { cb(layer, kept); }, tp});
    }
  }
  if (t.slots_final == t.num_slots()) finalize_task_locked(tp, fire);
}

void TransferManagerImpl::finalize_task_locked(const std::shared_ptr<TaskRec>& tp, Callbacks& fire) {
  TaskRec& t = *tp;
  Status first;
  for (const auto& s : t.slot_status)
    if (!s.ok()) {
      first = s;
      break;
    }
  const bool is_load = t.kind != TaskKind::kEvict;  // loads and external writes write device blocks
  const auto& src_ids = is_load ? t.host_blocks : t.device_blocks;
  const auto& dst_ids = is_load ? t.device_blocks : t.host_blocks;
  std::vector<bool> pair_bad(dst_ids.size(), false);
  for (const auto& [i, origin] : t.sources)
    if (origin->settled() && origin->block_failed(src_ids[i])) pair_bad[i] = true;
  std::vector<BlockId> bad_src, bad_dst;
  for (std::size_t i = 0; i < dst_ids.size(); ++i) {
    if (pair_bad[i]) bad_src.push_back(src_ids[i]);
    if (pair_bad[i] || t.copy_failed) bad_dst.push_back(dst_ids[i]);
  }
  if (t.kind == TaskKind::kExternalWrite) {
    // No source: the blocks that failed are the ones its reports named.
    bad_src.clear();
    bad_dst = t.ext_all_failed ? t.device_blocks : t.ext_failed;
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
    d.s.blocks_done += dst_ids.size();
  } else {
    d.s.tasks_failed++;
    d.s.blocks_failed += bad_dst.size();
  }
  if (metrics_)
    metrics_->task_latency[dir_index(t.kind)]->observe(
        std::chrono::duration<double>(Clock::now() - t.submitted).count());
  if (--d.s.in_flight == 0)
    d.busy_ns += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - d.busy_since).count());
  settled_tasks_.push_back(tp);
  finished_order_.push_back(t.id);
  while (finished_order_.size() > config_.retained_finished_tasks) {
    tasks_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
  if (CompletionQueue& queue = completions_[t.completion_queue];
      queue.open && queue.generation == t.completion_generation) {
    queue.items.push_back(TaskCompletion{t.id, t.kind, first, t.failed, t.bytes});
    while (queue.items.size() > config_.max_unpolled_completions) queue.items.pop_front();
  }
  if (t.on_done) {
    auto cb = t.on_done;
    TaskId id = t.id;
    // A notification, as the layer's: the outcome stays in its completion queue and the task's record.
    fire.push_back({[cb, id, kept = KeptStatus(first)] { cb(id, kept); }, tp});
  }
}

bool TransferManagerImpl::progress_once(Callbacks& fire) {
  bool any = false;
  bool progressed = true;
  while (progressed) {
    progressed = false;
    // Output first: evictions settle before the loads that read their bytes.
    for (std::deque<PendingEntry>* q : {&out_queue_, &in_queue_, &ext_queue_}) {
      for (;;) {
        PendingEntry head;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (q->empty()) break;
          head = q->front();
        }
        // The entry's outcome is taken only once it is final: a failure preset at enqueue stays in the queue's
        // record (a KeptStatus) while the entry's event is pending, not in a copy dropped at the break.
        Status copy_status;
        if (head.event) {
          auto done = device_.query(*head.event);
          if (done.ok() && !done.value()) break;  // in order: nothing behind it is done either
          copy_status = done.ok() ? Status(head.preset) : done.status();
        } else {
          copy_status = head.preset;
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
  Callbacks fire;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto idle = [&] { return in_queue_.empty() && out_queue_.empty() && ext_queue_.empty(); };
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
      for (std::deque<PendingEntry>* q : {&out_queue_, &in_queue_, &ext_queue_}) {
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

namespace {

void run_callback(Callback& c) {
  try {
    c.run();
  } catch (...) {
    // A callback must not take the progress thread down.
  }
}

}  // namespace

void TransferManagerImpl::fire_and_publish(Callbacks& fire) {
  auto held = [&](const TaskRec* t) { return firing_.count(t) != 0; };
  auto release = [&](const TaskRec* t) {
    if (auto it = firing_.find(t); it != firing_.end() && --it->second == 0) firing_.erase(it);
  };
  // Callbacks of tasks held by an enclosing batch (this batch runs inside one of its callbacks) wait for it.
  Callbacks now;
  now.reserve(fire.size());
  for (Callback& c : fire) (held(c.task.get()) ? deferred_callbacks_ : now).push_back(std::move(c));
  fire.clear();
  std::vector<std::pair<std::shared_ptr<TaskRec>, std::size_t>> slots;
  std::vector<std::shared_ptr<TaskRec>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : settled_slots_) (held(e.first.get()) ? deferred_slots_ : slots).push_back(std::move(e));
    for (auto& t : settled_tasks_) (held(t.get()) ? deferred_tasks_ : tasks).push_back(std::move(t));
    settled_slots_.clear();
    settled_tasks_.clear();
  }
  // Each callback holds its task until it returned (counted before any runs: one may wait, and the batch it nests
  // must see the task's later callbacks here as pending).
  for (const Callback& c : now) ++firing_[c.task.get()];
  for (Callback& c : now) {
    run_callback(c);
    release(c.task.get());
  }
  run_released_callbacks();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto publish_task = [&](const std::shared_ptr<TaskRec>& t) {
      t->visible = true;
      pending_ids_.erase(t->id);
    };
    for (auto& [t, slot] : slots) t->slot_visible[slot] = true;
    for (auto& t : tasks) publish_task(t);
    // What waited for a task that is no longer held and has no callback left to run.
    auto waits = [&](const TaskRec* t) {
      return held(t) || std::any_of(deferred_callbacks_.begin(), deferred_callbacks_.end(),
                                    [t](const Callback& c) { return c.task.get() == t; });
    };
    std::erase_if(deferred_slots_, [&](const auto& e) {
      if (waits(e.first.get())) return false;
      e.first->slot_visible[e.second] = true;
      return true;
    });
    std::erase_if(deferred_tasks_, [&](const std::shared_ptr<TaskRec>& t) {
      if (waits(t.get())) return false;
      publish_task(t);
      return true;
    });
  }
  state_cv_.notify_all();
}

void TransferManagerImpl::run_released_callbacks() {
  for (std::size_t i = 0; i < deferred_callbacks_.size();) {
    const TaskRec* t = deferred_callbacks_[i].task.get();
    // In order per task: an earlier one of the same task still deferred (held) keeps this one waiting too.
    const bool earlier =
        std::any_of(deferred_callbacks_.begin(), deferred_callbacks_.begin() + static_cast<std::ptrdiff_t>(i),
                    [t](const Callback& c) { return c.task.get() == t; });
    if (firing_.count(t) != 0 || earlier) {
      ++i;
      continue;
    }
    Callback c = std::move(deferred_callbacks_[i]);
    deferred_callbacks_.erase(deferred_callbacks_.begin() + static_cast<std::ptrdiff_t>(i));
    ++firing_[t];  // a wait inside it must see the task held
    run_callback(c);
    if (auto it = firing_.find(t); it != firing_.end() && --it->second == 0) firing_.erase(it);
    i = 0;  // the callback may have nested batches that deferred (or released) others
  }
}

}  // namespace kvtier::transfer_detail
