// HazardTracker: per-block ordering records for one tier (device or host
// blocks of one registration).
//
// Each block has one small record: its pending writes and its pending reads,
// each {event, stream}, at most one per stream (a stream is in order, so its
// latest access implies its earlier ones), plus the origins of its bytes. A
// write that kvtier ordered after every pending access (its own copies)
// replaces them all; a write that it did not order (compute declared through
// TransferManager::record_device_access) is kept beside them, so a load still
// writing later layers stays a writer of the block while the forward pass
// appends tokens to it. Settled accesses are pruned whenever a record is
// touched. A task that will access blocks asks the tracker what it must wait
// on:
//   - reading a block waits for its last writer (read-after-write);
//   - writing a block waits for its last writer and every reader
//     (write-after-write, write-after-read).
// Events recorded on the task's own stream are skipped (the stream orders
// them); events already complete are dropped from the record (non-blocking
// query; a failed event counts as complete: the work it captured is over).
//
// Data validity travels with writes: each write carries a WriteOrigin that
// its task settles to ok or failed. A task reading a block collects the
// origin of the bytes it reads, so that a load of a host block whose eviction
// failed is itself reported failed, even if it was submitted before the
// failure was known. (GPU waits cannot carry errors; origins can.)
//
// Events noted before they are recorded. With asynchronous submission the
// TransferManager notes a task's completion event when the task is accepted,
// and a submission thread enqueues the copy and records the event later. A
// RecordGate knows which events are still waiting for their record: the
// tracker treats them as pending (never settled, never free) and waits for
// the record before it hands one to a stream wait or a host wait (a wait on
// an event that was never recorded would be a no-op).
//
// Thread-safety: every method of HazardTracker and RecordGate is safe to call
// concurrently. The sequence hazards_for_*() -> note_*() must be atomic with
// respect to other submitters of the same tier (the TransferManager
// serialises it under its submit lock), and the work behind a noted event
// must be ordered after the waits hazards_for_*() returned. Never blocks on
// device work except wait_free_host(); wait_free() and wait_free_host() may
// block until pending records happen (submission, not device work).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"
#include "transfer/event_pool.h"

namespace kvtier {

// Who produced a block's current bytes, and whether that succeeded. The task
// that owns it fills `failed_blocks` / `all_failed` before it publishes
// kFailed (release); readers check block_failed() after seeing a final state.
struct WriteOrigin {
  enum State : std::uint8_t { kPending = 0, kOk = 1, kFailed = 2 };
  explicit WriteOrigin(std::uint64_t task) : task_id(task) {}
  std::uint64_t task_id;
  std::atomic<std::uint8_t> state{kPending};
  bool all_failed = true;
  std::vector<BlockId> failed_blocks;  // sorted; used when !all_failed

  bool settled() const noexcept { return state.load(std::memory_order_acquire) != kPending; }
  // True when the bytes this origin wrote into `block` are invalid.
  bool block_failed(BlockId block) const noexcept;
};
using WriteOriginRef = std::shared_ptr<WriteOrigin>;
// (index into the block list, origin of that block's bytes).
using SourceOrigins = std::vector<std::pair<std::uint32_t, WriteOriginRef>>;

class RecordGate {
 public:
  // `event` will be recorded later (by a submission thread).
  void expect(const Event* event);
  // `event` was recorded, or will never be (its submission failed and the
  // stream was drained): wakes its waiters. Idempotent.
  void recorded(const Event* event);
  bool pending(const Event* event) const;
  // Blocks until `event` is not pending.
  void wait(const Event* event) const;
  // Same, until `deadline`; false when still pending then.
  bool wait_until(const Event* event, std::chrono::steady_clock::time_point deadline) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<const Event*> pending_;
};

// A small set of events, deduplicated by identity.
class EventSet {
 public:
  void add(const EventLease& event);
  const std::vector<EventLease>& events() const noexcept { return events_; }
  bool empty() const noexcept { return events_.empty(); }
  void clear() noexcept { events_.clear(); }

 private:
  std::vector<EventLease> events_;
};

class HazardTracker {
 public:
  // A stream id no Stream has: hazards_for_*(..., kNoStream, ...) skips nothing.
  static constexpr std::uint64_t kNoStream = ~std::uint64_t{0};

  // `tier_name` names the tier in error messages ("device", "host"). `gate`
  // (may be null; must outlive the tracker): events noted before their record.
  HazardTracker(Device& device, std::uint64_t num_blocks, std::string tier_name, const RecordGate* gate = nullptr);

  std::uint64_t num_blocks() const noexcept { return num_blocks_; }
  // OutOfRange naming the first bad id and its index in `what`.
  Status check_ids(std::span<const BlockId> blocks, std::string_view what) const;

  // Events a task on `stream_id` reading `blocks` must wait for. When
  // `sources` is non-null it receives the origins of the bytes read that are
  // not yet known good: (index in `blocks`, origin) pairs.
  void hazards_for_read(std::span<const BlockId> blocks, std::uint64_t stream_id, EventSet& waits,
                        SourceOrigins* sources);
  // Events a task on `stream_id` writing `blocks` must wait for.
  void hazards_for_write(std::span<const BlockId> blocks, std::uint64_t stream_id, EventSet& waits);

  // After enqueuing: `event` (recorded on stream `stream_id`) completes the access.
  void note_read(std::span<const BlockId> blocks, const EventLease& event, std::uint64_t stream_id);
  // `origin` may be null for writes that cannot fail as far as kvtier knows
  // (compute kernels declared through TransferManager::record_device_access).
  // `full`: the write replaces every byte of the blocks (all layers and
  // roles), so earlier origins no longer matter; otherwise (a load of some
  // layers, a compute write of some tokens) `origin` is added to them.
  // `ordered_after_pending`: the writer was ordered after every pending
  // writer and reader (it waited on hazards_for_write), so they are implied
  // by its event and are dropped. Pass false for writes that were not
  // (declared compute writes): the pending accesses are then kept.
  void note_write(std::span<const BlockId> blocks, const EventLease& event, std::uint64_t stream_id,
                  WriteOriginRef origin, bool full, bool ordered_after_pending = true);

  // True when no access to `block` is pending. Non-blocking.
  Result<bool> is_free(BlockId block);
  // Makes `stream` wait (on the device) for every pending access to `blocks`.
  Status wait_free(std::span<const BlockId> blocks, Stream& stream);
  // Blocks the calling thread until every access to `blocks` completed, or
  // TimedOut.
  Status wait_free_host(std::span<const BlockId> blocks, std::chrono::nanoseconds timeout);
  // True when the last write to `block` is known to have failed (its bytes
  // are garbage until rewritten); false when it succeeded, is pending, or
  // never happened.
  bool last_write_failed(BlockId block) const;
  // Pending accesses still recorded for `block` (tests, stats).
  std::size_t tracked_events(BlockId block) const;

 private:
  struct Access {
    EventLease event;
    std::uint64_t stream_id = 0;
  };
  struct Record {
    std::vector<Access> writers;          // pending; at most one per stream
    std::vector<WriteOriginRef> origins;  // of the bytes now in the block, not yet known good
    std::vector<Access> readers;          // pending; at most one per stream
  };
  // Blocks of one task share events: remember each event's answer for the
  // duration of one call (one driver query per distinct event).
  using QueryCache = std::vector<std::pair<const Event*, bool>>;
  // Drops `a` when its event completed. Caller holds mu_.
  bool settled_locked(Access& a, QueryCache& cache);
  // Adds the pending accesses not on `stream_id` to `waits`; drops settled ones.
  void add_pending_locked(std::vector<Access>& accesses, std::uint64_t stream_id, EventSet& waits, QueryCache& cache);
  // Sets `stream_id`'s access to `event` (replacing its older one); drops settled ones.
  void upsert_locked(std::vector<Access>& accesses, const EventLease& event, std::uint64_t stream_id,
                     QueryCache& cache);

  Device& device_;
  const RecordGate* gate_ = nullptr;
  std::uint64_t num_blocks_;
  std::string tier_name_;
  mutable std::mutex mu_;
  std::vector<Record> records_;
};

}  // namespace kvtier
