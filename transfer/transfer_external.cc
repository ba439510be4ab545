// External writes of TransferManagerImpl (transfer_manager.h, "External
// writes"): begin_external_write declares device blocks that something
// outside the manager writes (a P/D peer), waits until earlier accesses to
// them completed and notes the write in the device hazard records under an
// event that stays unrecorded until the blocks are released;
// complete_external_layer and end_external_write make layers final through
// the progress thread like a load's; release_external_write records the
// hazard records' event after every layer and undeclares the blocks. Loads,
// evictions and wait_device_blocks_free refuse declared blocks
// (check_not_external_locked).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>

#include "kvtier/core/deadline.h"
#include "transfer/transfer_manager_impl.h"

namespace kvtier::transfer_detail {

Status TransferManagerImpl::check_not_external_locked(std::span<const BlockId> blocks, std::string_view what) const {
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const TaskId owner = external_of_[static_cast<std::size_t>(blocks[i])];
    if (owner != 0)
      return FailedPrecondition(fmt::format(
          "{}: device block {} (index {}) is declared by external write task {} (a peer may still write it): "
          "end and release that write first",
          what, blocks[i], i, owner));
  }
  return Status::Ok();
}

Status TransferManagerImpl::wait_device_blocks_free(std::span<const BlockId> blocks, Stream& stream) {
  // Checked here, not only by the device when there is something to wait for: whether a wrong stream was refused
  // depended on the blocks' state at the moment.
  if (&stream.device() != &device_)
    return InvalidArgument("wait_device_blocks_free: the stream belongs to another Device");
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(blocks, "wait_device_blocks_free"));
  {
    std::lock_guard<std::mutex> submit(submit_mu_);
    KVTIER_RETURN_IF_ERROR(check_not_external_locked(blocks, "wait_device_blocks_free"));
  }
  return dev_hazards_->wait_free(blocks, stream);
}

Result<TaskId> TransferManagerImpl::begin_external_write(std::span<const std::uint32_t> layers,
                                                         std::span<const BlockId> device_blocks,
                                                         ExternalWriteOptions options) {
  const KvLayout& layout = device_space_.layout();
  if (device_blocks.empty()) return InvalidArgument("begin_external_write: empty block list");
  if (options.free_timeout.count() < 0)
    return InvalidArgument(
        fmt::format("begin_external_write: free_timeout {} ns is negative", options.free_timeout.count()));
  KVTIER_RETURN_IF_ERROR(dev_hazards_->check_ids(device_blocks, "device_blocks"));
  KVTIER_RETURN_IF_ERROR(check_no_duplicates(device_blocks, "begin_external_write device_blocks"));
  KVTIER_ASSIGN_OR_RETURN(const std::uint64_t generation,
                          completion_queue_generation(options.completion_queue, "begin_external_write"));
  KVTIER_ASSIGN_OR_RETURN(std::vector<std::uint32_t> order, layer_order(layout, layers, "begin_external_write"));
  const std::size_t n = order.size();
  std::uint64_t bytes = 0;
  for (std::uint32_t l : order)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) bytes += layout.block_bytes(l, r) * device_blocks.size();

  TaskId id = 0;
  EventSet waits;
  {
    std::lock_guard<std::mutex> submit(submit_mu_);
    if (shut_) return FailedPrecondition("begin_external_write after shutdown");
    KVTIER_RETURN_IF_ERROR(admit_locked());
    KVTIER_RETURN_IF_ERROR(check_not_external_locked(device_blocks, "begin_external_write"));
    std::vector<EventLease> events(n);
    for (auto& e : events) {
      KVTIER_ASSIGN_OR_RETURN(e, pool_->acquire());
    }
    KVTIER_ASSIGN_OR_RETURN(EventLease done, pool_->acquire());
    const std::uint64_t ext_id = ext_->id();
    auto task = std::make_shared<TaskRec>();
    // Every pending reader and writer of the blocks, those of the external stream too (an earlier external
    // write's `done` may still wait for a staging copy): waited for below, before the peer may write.
    dev_hazards_->hazards_for_write(device_blocks, HazardTracker::kNoStream, waits);

    task->device_blocks.assign(device_blocks.begin(), device_blocks.end());
    task->start(next_id_++, TaskKind::kExternalWrite, events, bytes, std::move(options.on_layer),
                std::move(options.on_done));
    task->completion_queue = options.completion_queue;
    task->completion_generation = generation;
    task->layers = std::move(order);

    for (const auto& e : events) gate_.expect(e.get());
    gate_.expect(done.get());
    // `done` is recorded only at release: until then the blocks are never free. The pending accesses stay
    // beside it (not ordered_after_pending): if the wait below times out they are still what orders later work.
    dev_hazards_->note_write(device_blocks, done, ext_id, task->origin, /*full=*/n == layout.num_layers(),
                             /*ordered_after_pending=*/false);
    for (BlockId b : device_blocks) external_of_[static_cast<std::size_t>(b)] = task->id;
    register_task(task);
    ExternalRec x;
    x.task = task;
    x.layer_events = std::move(events);
    x.done = std::move(done);
    x.reported.assign(n, false);
    x.sorted_blocks = task->device_blocks;
    std::sort(x.sorted_blocks.begin(), x.sorted_blocks.end());
    id = task->id;
    externals_.emplace(id, std::move(x));
  }

  // The peer cannot wait on a device event: its writes may start only once every earlier access (an eviction
  // still reading a block the cache just handed to the receive) completed.
  const auto deadline = deadline_after(options.free_timeout);
  Status busy;
  for (const auto& e : waits.events()) {
    if (!gate_.wait_until(e.get(), deadline)) {
      busy = TimedOut("not yet submitted");
      break;
    }
    const auto left =
        std::max(std::chrono::nanoseconds(0),
                 std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()));
    Status s = device_.synchronize(*e, left);
    if (s.code() == StatusCode::kTimedOut) {  // a failed access is over: only a timeout means "busy"
      busy = s;
      break;
    }
  }
  if (busy.ok()) return id;
  BlockId first_busy = device_blocks.front();
  for (BlockId b : device_blocks) {
    auto free = dev_hazards_->is_free(b);
    // The write's own `done` is never free: look for an older access still recorded beside it.
    if (free.ok() && dev_hazards_->tracked_events(b) > 1) {
      first_busy = b;
      break;
    }
  }
  Status timed_out = TimedOut(fmt::format(
      "begin_external_write: device block {} (of {}) still accessed by earlier work after {} us (an eviction "
      "reading it?): nothing declared",
      first_busy, device_blocks.size(), options.free_timeout.count() / 1000));
  std::lock_guard<std::mutex> submit(submit_mu_);
  auto it = externals_.find(id);
  if (it != externals_.end()) {  // (shutdown may have ended and released it meanwhile)
    end_external_locked(it->second, timed_out, /*quiescent=*/true);
    release_external_locked(id);
  }
  return timed_out;
}

void TransferManagerImpl::report_external_layer_locked(ExternalRec& x, std::size_t k, Status st,
                                                       std::span<const BlockId> failed, bool all_failed,
                                                       Stream& landed_on) {
  TaskRec& t = *x.task;
  x.reported[k] = true;
  const EventLease& ev = x.layer_events[k];
  PendingEntry entry{x.task, k, nullptr, st};
  Status rec = device_.record(*ev, landed_on);
  if (rec.ok()) {
    entry.event = ev;  // final once the bytes landed, even when failed (the block is busy until then)
  } else {
    // Never recorded: waits on it are no-ops. Its bytes cannot be trusted.
    if (st.ok()) st = rec.with_context(fmt::format("recording layer {}'s arrival", t.layers[k]));
    entry.preset = st;
    all_failed = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) t.slot_status[k] = st;  // seen by wait_for_layer once the event is released
    if (all_failed) {
      t.ext_all_failed = true;
    } else if (!failed.empty()) {
      t.ext_failed.insert(t.ext_failed.end(), failed.begin(), failed.end());
      std::sort(t.ext_failed.begin(), t.ext_failed.end());
      t.ext_failed.erase(std::unique(t.ext_failed.begin(), t.ext_failed.end()), t.ext_failed.end());
    }
    ext_queue_.push_back(std::move(entry));
  }
  gate_.recorded(ev.get());
  work_cv_.notify_one();
}

Status TransferManagerImpl::complete_external_layer(TaskId id, std::uint32_t layer,
                                                    std::span<const BlockId> failed_blocks, Stream* after) {
  if (after && &after->device() != &device_)
    return InvalidArgument(fmt::format(
        "complete_external_layer: task {} layer {}: the stream `after` belongs to another Device", id, layer));
  std::lock_guard<std::mutex> submit(submit_mu_);
  auto it = externals_.find(id);
  if (it == externals_.end())
    return NotFound(fmt::format("complete_external_layer: external write task {} is unknown or released", id));
  ExternalRec& x = it->second;
  if (x.ended)
    return FailedPrecondition(
        fmt::format("complete_external_layer: external write task {} was ended (layer {} came too late)", id, layer));
  const auto& layers = x.task->layers;
  auto pos = std::find(layers.begin(), layers.end(), layer);
  if (pos == layers.end())
    return InvalidArgument(
        fmt::format("complete_external_layer: external write task {} does not write layer {}", id, layer));
  const auto k = static_cast<std::size_t>(pos - layers.begin());
  if (x.reported[k])
    return FailedPrecondition(
        fmt::format("complete_external_layer: layer {} of external write task {} was already reported", layer, id));
  for (std::size_t i = 0; i < failed_blocks.size(); ++i)
    if (!std::binary_search(x.sorted_blocks.begin(), x.sorted_blocks.end(), failed_blocks[i]))
      return InvalidArgument(
          fmt::format("complete_external_layer: failed block {} (index {}) is not a block of external write task {}",
                      failed_blocks[i], i, id));
  Status st;
  if (!failed_blocks.empty()) {
    std::vector<BlockId> sorted(failed_blocks.begin(), failed_blocks.end());
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    st = DataLoss(fmt::format("device blocks [{}] failed ({} of {}: the peer's write failed or did not verify)",
                              fmt::join(sorted, ", "), sorted.size(), x.sorted_blocks.size()));
  }
  report_external_layer_locked(x, k, std::move(st), failed_blocks, /*all_failed=*/false, after ? *after : *ext_);
  return Status::Ok();
}

void TransferManagerImpl::end_external_locked(ExternalRec& x, const Status& status, bool quiescent) {
  const bool all_reported = std::all_of(x.reported.begin(), x.reported.end(), [](bool r) { return r; });
  for (std::size_t k = 0; k < x.reported.size(); ++k) {
    if (x.reported[k]) continue;
    Status st = status.with_context(fmt::format("layer {} ended unreported", x.task->layers[k]));
    report_external_layer_locked(x, k, std::move(st), {}, /*all_failed=*/true, *ext_);
  }
  x.ended = true;
  if (quiescent || !all_reported) return;
  // Not quiescent, but every layer was reported: a block no report named failed holds verified bytes and no
  // write targets it any more (each (block, layer) is written once); only the failed ones stay declared.
  std::vector<BlockId> good;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (x.task->ext_all_failed) return;
    std::set_difference(x.sorted_blocks.begin(), x.sorted_blocks.end(), x.task->ext_failed.begin(),
                        x.task->ext_failed.end(), std::back_inserter(good));
  }
  if (good.empty()) return;
  auto early = pool_->acquire();
  if (!early.ok()) return;  // fail closed: they stay declared until the release
  bool ordered = true;
  for (const auto& e : x.layer_events) ordered = device_.wait(*ext_, *e).ok() && ordered;
  if (!ordered || !device_.record(**early, *ext_).ok()) return;
  // Replaces the write's `done` (same stream) in their records: later work orders after the layers' landing.
  dev_hazards_->note_write(good, *early, ext_->id(), nullptr, /*full=*/false, /*ordered_after_pending=*/false);
  for (BlockId b : good) external_of_[static_cast<std::size_t>(b)] = 0;
}

void TransferManagerImpl::release_external_locked(TaskId id) {
  auto it = externals_.find(id);
  if (it == externals_.end()) return;
  ExternalRec& x = it->second;
  // `done` implies every layer's landing: later loads, evictions and reuse order after it.
  bool recorded = true;
  for (const auto& e : x.layer_events) recorded = device_.wait(*ext_, *e).ok() && recorded;
  // Without the waits `done` would not imply the layers: leave it unrecorded (a wait on it is a no-op), the
  // layers' own completion having been reported already.
  if (recorded) device_.record(*x.done, *ext_).ignore_error();
  gate_.recorded(x.done.get());
  for (BlockId b : x.task->device_blocks)  // (a block released early may be declared by another write now)
    if (external_of_[static_cast<std::size_t>(b)] == id) external_of_[static_cast<std::size_t>(b)] = 0;
  externals_.erase(it);
}

Status TransferManagerImpl::end_external_write(TaskId id, const Status& status, bool quiescent) {
  status.ignore_error();  // handed over: recorded below, or the call is refused and says why
  std::lock_guard<std::mutex> submit(submit_mu_);
  auto it = externals_.find(id);
  if (it == externals_.end())
    return NotFound(fmt::format("end_external_write: external write task {} is unknown or released", id));
  ExternalRec& x = it->second;
  if (x.ended) return FailedPrecondition(fmt::format("end_external_write: external write task {} already ended", id));
  if (status.ok()) {
    for (std::size_t k = 0; k < x.reported.size(); ++k)
      if (!x.reported[k])
        return InvalidArgument(fmt::format(
            "end_external_write: layer {} of external write task {} was never reported, and the status is OK: pass "
            "the error that ended the write",
            x.task->layers[k], id));
  }
  end_external_locked(x, status, quiescent);
  if (quiescent) release_external_locked(id);
  return Status::Ok();
}

Status TransferManagerImpl::release_external_write(TaskId id) {
  std::lock_guard<std::mutex> submit(submit_mu_);
  auto it = externals_.find(id);
  if (it == externals_.end())
    return NotFound(fmt::format("release_external_write: external write task {} is unknown or released", id));
  if (!it->second.ended)
    return FailedPrecondition(
        fmt::format("release_external_write: external write task {} has not ended: end_external_write first", id));
  release_external_locked(id);
  return Status::Ok();
}

}  // namespace kvtier::transfer_detail
