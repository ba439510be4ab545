// The waits and queries of TransferManagerImpl: wait_for_layer orders a
// stream after one loaded layer; wait_layer_host, wait and wait_all block
// the caller until a layer, a task or every task submitted so far is final
// and its callbacks ran (wait_state, which on the progress thread drives
// progress itself); task_info, failed_blocks and poll_completions read the
// task table and the completion queue.
#include <fmt/format.h>

#include <algorithm>

#include "kvtier/core/deadline.h"
#include "transfer/transfer_manager_impl.h"

namespace kvtier::transfer_detail {

Status TransferManagerImpl::wait_for_layer(TaskId id, std::uint32_t layer, Stream& stream) {
  // Checked first: a layer already final returns before the device would have seen the stream.
  if (&stream.device() != &device_) return InvalidArgument("wait_for_layer: the stream belongs to another Device");
  EventLease event;
  std::shared_ptr<TaskRec> task;
  std::size_t k = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto* t = find_locked(id);
    if (!t) return task_not_found(id);
    task = *t;
    if (task->kind == TaskKind::kEvict)
      return InvalidArgument(fmt::format("wait_for_layer: task {} is an eviction, not a load", id));
    auto it = std::find(task->layers.begin(), task->layers.end(), layer);
    if (it == task->layers.end())
      return InvalidArgument(
          fmt::format("wait_for_layer: {} task {} has no layer {}", task_kind_name(task->kind), id, layer));
    k = static_cast<std::size_t>(it - task->layers.begin());
    if (task->slot_state[k] == TaskState::kDone) return Status::Ok();
    if (task->slot_state[k] == TaskState::kFailed) return task->slot_status[k];
    event = task->slot_event[k];
    if (!event) return Internal(fmt::format("wait_for_layer: pending layer {} of task {} has no event", layer, id));
  }
  // The layer may still wait for its submission thread: block (on the CPU,
  // for submission only, never for device work) until its event is recorded.
  // An external write's layer is recorded when it is reported (or ended).
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
  if (task->kind == TaskKind::kEvict)
    return InvalidArgument(fmt::format("wait_layer_host: task {} is an eviction, not a load", id));
  auto it = std::find(task->layers.begin(), task->layers.end(), layer);
  if (it == task->layers.end())
    return InvalidArgument(
        fmt::format("wait_layer_host: {} task {} has no layer {}", task_kind_name(task->kind), id, layer));
  std::size_t k = static_cast<std::size_t>(it - task->layers.begin());
  if (!wait_state(lock, deadline, [&] { return final_for_waiter(*task, k); }))
    return TimedOut(fmt::format("layer {} of {} task {} not ready after {} us", layer, task_kind_name(task->kind), id,
                                timeout.count() / 1000));
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
    Callbacks fire;
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
  if (task.kind != TaskKind::kEvict) info.layer_states = task.slot_state;
  info.bytes = task.bytes;
  return info;
}

Result<FailedBlocks> TransferManagerImpl::failed_blocks(TaskId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto* t = find_locked(id);
  if (!t) return task_not_found(id);
  return (*t)->failed;
}

std::vector<TaskCompletion> TransferManagerImpl::poll_completions(std::uint32_t queue) {
  std::lock_guard<std::mutex> lock(mu_);
  if (queue >= completions_.size() || !completions_[queue].open) return {};
  std::deque<TaskCompletion>& q = completions_[queue].items;
  std::vector<TaskCompletion> out(std::make_move_iterator(q.begin()), std::make_move_iterator(q.end()));
  q.clear();
  return out;
}

Result<std::uint32_t> TransferManagerImpl::open_completion_queue() {
  constexpr std::size_t kMaxOpen = 1024;
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t open = 0;
  for (const CompletionQueue& q : completions_) open += q.open ? 1 : 0;
  if (open >= kMaxOpen)
    return ResourceExhausted(fmt::format("open_completion_queue: {} queues open (at most {})", open, kMaxOpen));
  for (std::uint32_t q = 1; q < completions_.size(); ++q)
    if (!completions_[q].open) {
      completions_[q].open = true;
      return q;
    }
  completions_.emplace_back();
  return static_cast<std::uint32_t>(completions_.size() - 1);
}

Status TransferManagerImpl::close_completion_queue(std::uint32_t queue) {
  std::lock_guard<std::mutex> lock(mu_);
  if (queue == 0 || queue >= completions_.size() || !completions_[queue].open)
    return InvalidArgument(fmt::format("close_completion_queue: completion queue {} is not open (or is 0)", queue));
  CompletionQueue& q = completions_[queue];
  q.open = false;
  ++q.generation;  // completions of its tasks still in flight are dropped
  q.items.clear();
  q.items.shrink_to_fit();
  return Status::Ok();
}

}  // namespace kvtier::transfer_detail
