#include "transfer/hazard_tracker.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvtier/core/deadline.h"

namespace kvtier {

bool WriteOrigin::block_failed(BlockId block) const noexcept {
  if (state.load(std::memory_order_acquire) != kFailed) return false;
  return all_failed || std::binary_search(failed_blocks.begin(), failed_blocks.end(), block);
}

void RecordGate::expect(const Event* event) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(event);
}

void RecordGate::recorded(const Event* event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(pending_.begin(), pending_.end(), event);
    if (it == pending_.end()) return;
    *it = pending_.back();
    pending_.pop_back();
  }
  cv_.notify_all();
}

bool RecordGate::pending(const Event* event) const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::find(pending_.begin(), pending_.end(), event) != pending_.end();
}

void RecordGate::wait(const Event* event) const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return std::find(pending_.begin(), pending_.end(), event) == pending_.end(); });
}

bool RecordGate::wait_until(const Event* event, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline,
                        [&] { return std::find(pending_.begin(), pending_.end(), event) == pending_.end(); });
}

void EventSet::add(const EventLease& event) {
  if (!event) return;
  for (const auto& e : events_)
    if (e.get() == event.get()) return;
  events_.push_back(event);
}

HazardTracker::HazardTracker(Device& device, std::uint64_t num_blocks, std::string tier_name, const RecordGate* gate)
    : device_(device), gate_(gate), num_blocks_(num_blocks), tier_name_(std::move(tier_name)), records_(num_blocks) {}

Status HazardTracker::check_ids(std::span<const BlockId> blocks, std::string_view what) const {
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (static_cast<std::uint64_t>(blocks[i]) >= num_blocks_)
      return OutOfRange(fmt::format("{} block id {} at index {} of {} is outside [0, {})", tier_name_, blocks[i], i,
                                    what, num_blocks_));
  }
  return Status::Ok();
}

bool HazardTracker::settled_locked(Access& a, QueryCache& cache) {
  if (!a.event) return true;
  bool settled = false;
  bool cached = false;
  for (const auto& [e, v] : cache)
    if (e == a.event.get()) {
      settled = v;
      cached = true;
      break;
    }
  if (!cached) {
    // Not recorded yet: its work is not even enqueued (query would say done).
    if (gate_ && gate_->pending(a.event.get())) return false;
    auto done = device_.query(*a.event);
    // An error means the captured work is over (it failed): nothing to order after.
    settled = !done.ok() || done.value();
    if (cache.size() < 64) cache.push_back({a.event.get(), settled});
  }
  if (settled) a.event.reset();
  return settled;
}

namespace {
void prune_good(std::vector<WriteOriginRef>& origins) {
  std::erase_if(origins, [](const WriteOriginRef& o) {
    return !o || o->state.load(std::memory_order_acquire) == WriteOrigin::kOk;
  });
}
}  // namespace

void HazardTracker::hazards_for_read(std::span<const BlockId> blocks, std::uint64_t stream_id, EventSet& waits,
                                     SourceOrigins* sources) {
  std::lock_guard<std::mutex> lock(mu_);
  QueryCache cache;
  if (sources) sources->clear();
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    Record& r = records_[static_cast<std::size_t>(blocks[i])];
    add_pending_locked(r.writers, stream_id, waits, cache);
    prune_good(r.origins);
    if (sources)
      for (const auto& o : r.origins) sources->push_back({static_cast<std::uint32_t>(i), o});
  }
}

void HazardTracker::hazards_for_write(std::span<const BlockId> blocks, std::uint64_t stream_id, EventSet& waits) {
  std::lock_guard<std::mutex> lock(mu_);
  QueryCache cache;
  for (BlockId b : blocks) {
    Record& r = records_[static_cast<std::size_t>(b)];
    add_pending_locked(r.writers, stream_id, waits, cache);
    add_pending_locked(r.readers, stream_id, waits, cache);
  }
}

void HazardTracker::add_pending_locked(std::vector<Access>& accesses, std::uint64_t stream_id, EventSet& waits,
                                       QueryCache& cache) {
  for (auto& a : accesses)
    if (a.event && a.stream_id != stream_id && !settled_locked(a, cache)) waits.add(a.event);
  std::erase_if(accesses, [](const Access& a) { return !a.event; });
}

void HazardTracker::upsert_locked(std::vector<Access>& accesses, const EventLease& event, std::uint64_t stream_id,
                                  QueryCache& cache) {
  // Settled accesses are dropped here, so a record holds only pending ones:
  // its size is bounded by the streams with work in flight on the block, not
  // by every stream that ever touched it.
  bool replaced = false;
  for (auto& a : accesses) {
    if (a.stream_id == stream_id) {
      // A stream is in order: its newest access implies its earlier ones.
      a.event = event;
      replaced = true;
    } else {
      settled_locked(a, cache);
    }
  }
  std::erase_if(accesses, [](const Access& a) { return !a.event; });
  if (!replaced) accesses.push_back(Access{event, stream_id});
}

void HazardTracker::note_read(std::span<const BlockId> blocks, const EventLease& event, std::uint64_t stream_id) {
  std::lock_guard<std::mutex> lock(mu_);
  QueryCache cache;
  for (BlockId b : blocks) upsert_locked(records_[static_cast<std::size_t>(b)].readers, event, stream_id, cache);
}

void HazardTracker::note_write(std::span<const BlockId> blocks, const EventLease& event, std::uint64_t stream_id,
                               WriteOriginRef origin, bool full, bool ordered_after_pending) {
  std::lock_guard<std::mutex> lock(mu_);
  QueryCache cache;
  for (BlockId b : blocks) {
    Record& r = records_[static_cast<std::size_t>(b)];
    if (ordered_after_pending) {
      // The writer waited on every pending writer and reader: its event implies them.
      r.writers.clear();
      r.writers.push_back(Access{event, stream_id});
      r.readers.clear();
    } else {
      // A declared write (compute) that kvtier did not order: the pending
      // writers and readers stay, beside it, until they complete.
      upsert_locked(r.writers, event, stream_id, cache);
    }
    if (full)
      r.origins.clear();
    else
      prune_good(r.origins);
    if (origin) r.origins.push_back(origin);
  }
}

Result<bool> HazardTracker::is_free(BlockId block) {
  KVTIER_RETURN_IF_ERROR(check_ids(std::span<const BlockId>(&block, 1), "is_free"));
  std::lock_guard<std::mutex> lock(mu_);
  QueryCache cache;
  Record& r = records_[static_cast<std::size_t>(block)];
  bool free = true;
  for (auto* list : {&r.writers, &r.readers}) {
    for (auto& a : *list) free = settled_locked(a, cache) && free;
    std::erase_if(*list, [](const Access& a) { return !a.event; });
  }
  return free;
}

Status HazardTracker::wait_free(std::span<const BlockId> blocks, Stream& stream) {
  KVTIER_RETURN_IF_ERROR(check_ids(blocks, "wait_free"));
  EventSet waits;
  hazards_for_write(blocks, kNoStream, waits);
  for (const auto& e : waits.events()) {
    if (gate_) gate_->wait(e.get());
    KVTIER_RETURN_IF_ERROR(device_.wait(stream, *e));
  }
  return Status::Ok();
}

Status HazardTracker::wait_free_host(std::span<const BlockId> blocks, std::chrono::nanoseconds timeout) {
  KVTIER_RETURN_IF_ERROR(check_ids(blocks, "wait_free_host"));
  const auto deadline = deadline_after(timeout);
  EventSet waits;
  hazards_for_write(blocks, kNoStream, waits);
  for (const auto& e : waits.events()) {
    if (gate_ && !gate_->wait_until(e.get(), deadline))
      return TimedOut(
          fmt::format("{} blocks not free after {} ns (copy not yet submitted)", tier_name_, timeout.count()));
    auto left =
        std::max(std::chrono::nanoseconds(0),
                 std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()));
    Status s = device_.synchronize(*e, left);
    // A failed access is over; only a timeout means "not free yet".
    if (s.code() == StatusCode::kTimedOut)
      return TimedOut(fmt::format("{} blocks not free after {} ns", tier_name_, timeout.count()));
  }
  return Status::Ok();
}

bool HazardTracker::last_write_failed(BlockId block) const {
  if (static_cast<std::uint64_t>(block) >= num_blocks_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  const Record& r = records_[static_cast<std::size_t>(block)];
  for (const auto& o : r.origins)
    if (o && o->block_failed(block)) return true;
  return false;
}

std::size_t HazardTracker::tracked_events(BlockId block) const {
  if (static_cast<std::uint64_t>(block) >= num_blocks_) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  const Record& r = records_[static_cast<std::size_t>(block)];
  return r.writers.size() + r.readers.size();
}

}  // namespace kvtier
