// Executors for the storage moves of a StepPlan, and the composite that
// splits a plan between the device<->host executor and the storage one.
//
// StoragePlanExecutor moves bytes between the host tier (the StorageTier's
// host BlockSpace, indexed by the cache's host block ids) and a StorageBackend:
//   storage_writes     -> StorageTier::write(keys, src host blocks), acked by
//                         storage slot (BlockMove::dst) with MoveKind::kStorageWrite;
//   storage_prefetches -> StorageTier::read(keys, dst host blocks), acked by
//                         host block with MoveKind::kStoragePrefetch;
//   storage_drops      -> StorageTier::remove(keys), posted before the plan's
//                         writes, not acked (with remove_dropped, the default):
//                         the backend then holds no more of this cache's
//                         objects than its storage tier has slots. A write of a
//                         key whose delete is still in flight is posted by the
//                         poll() that sees the delete done (execute() does not
//                         block), so the delete never removes the new object;
//                         a write still waiting after max_delete_wait fails
//                         (TimedOut: the slot is a miss) and is never posted.
// Objects are named by the move's BlockKey (StorageKey::from_u64(hi, lo),
// rank set by the tier), not by the cache's storage slot: slots only count
// capacity. A block whose read fails (NotFound, DataLoss after a checksum
// mismatch, Unavailable, ...) completes with that status, so the cache turns
// it into a miss; its host block holds undefined bytes and is never served.
// A batch that cannot be posted completes (at the next poll) with the post error.
// poll() reports the moves of one destination (kind and block) in the order
// execute() was handed them, also when a later one finishes first (a write
// that waited for a delete): MultiRankPlanExecutor relies on it to tell the
// late report of a timed-out move from a newer move's.
//
// CompositePlanExecutor routes evictions, backups and loads to one executor
// and storage writes/prefetches to another, and merges their completions. No
// ordering is needed between the two halves of one plan: the cache only
// writes settled host blocks to storage and only prefetches into fresh host
// blocks that no device move touches. Both halves are handed their part even
// when the other's execute() fails (the first error is returned), so every
// move of the plan is reported once by poll() and the drops are posted.
//
// Thread-safety: none; driven by the scheduler thread that owns the CacheManager.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/storage/storage_tier.h"

namespace kvtier::cache {

storage::StorageKey storage_key(const BlockKey& key);

class StoragePlanExecutor final : public PlanExecutor {
 public:
  // `tier` must outlive the executor; its host space is the cache's host tier. remove_dropped = false keeps the
  // objects of dropped slots (a backend shared with other caches that evicts by itself: a capacity, a TTL).
  explicit StoragePlanExecutor(storage::StorageTier& tier, bool remove_dropped = true)
      : tier_(tier), remove_dropped_(remove_dropped) {}
  ~StoragePlanExecutor() override = default;

  // FailedPrecondition when the plan holds device moves: nothing is submitted but its drops, and every move of it
  // is reported failed (with that error) at the next poll().
  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

  // Prefetches write host blocks; the cache hands one a block only once the block's earlier moves were
  // acknowledged, but a MultiRankPlanExecutor acknowledges a move that timed out on a silent rank while that rank's
  // copy may still land in the block (a device->host copy of an eviction). Given a guard (each rank: its
  // TransferManager's is_host_block_free), a prefetch into a block the guard says is not free waits (poll() looks
  // again) and fails with Unavailable after `max_wait`, so the late copy can never overwrite what it read. Under a
  // MultiRankPlanExecutor keep max_wait plus the backend's operation deadline below its move_deadline: a prefetch
  // still waiting when its move times out would otherwise be posted later, into a block the cache gave to another
  // move. A null guard posts waiting prefetches as they are.
  void guard_host_blocks(std::function<Result<bool>(BlockId)> is_free,
                         std::chrono::nanoseconds max_wait = std::chrono::seconds(5)) {
    host_block_free_ = std::move(is_free);
    guard_max_wait_ = max_wait;
  }

  // How long a write of a key waits for the delete of that key's previous object (a dropped slot's) before it
  // fails with TimedOut; > 0. Deletes themselves have no deadline here (the backend's own, where it has one): one
  // that never ends keeps failing its key's writes, never lets them race it. Under a MultiRankPlanExecutor keep it
  // plus the backend's operation deadline below its move_deadline.
  void set_max_delete_wait(std::chrono::nanoseconds max_wait) {
    max_delete_wait_ = max_wait > std::chrono::nanoseconds::zero() ? max_wait : std::chrono::nanoseconds(1);
  }

  // Work not completed yet: batches of moves, deletes of dropped objects, writes waiting for a delete, prefetches
  // waiting for their host block, finished moves held behind an earlier one of their destination.
  std::size_t in_flight() const noexcept {
    return pending_.size() + removals_.size() + waiting_writes_.size() + waiting_prefetches_.size() + finished_.size();
  }
  std::uint64_t bytes_written() const noexcept { return bytes_written_; }
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }
  std::uint64_t failed_writes() const noexcept { return failed_writes_; }
  std::uint64_t failed_reads() const noexcept { return failed_reads_; }
  // Objects of dropped slots deleted; deletes that failed (the object missing included: a failed write's).
  std::uint64_t removed_objects() const noexcept { return removed_objects_; }
  std::uint64_t failed_removals() const noexcept { return failed_removals_; }

 private:
  // A move and its place in submission order (execute() numbers every move it is handed).
  struct SeqMove {
    BlockMove move;
    std::uint64_t seq = 0;
  };
  struct Pending {
    MoveKind kind;
    std::vector<BlockId> dst;
    std::vector<std::uint64_t> seq;  // per dst
    storage::StorageTierOp op;
    KeptStatus post_error;  // set when the batch never reached the backend
  };
  struct Finished {
    MoveKind kind;
    BlockId dst;
    KeptStatus status;
  };
  struct Removal {
    std::vector<BlockKey> keys;
    storage::StorageTierOp op;
    bool posted = false;
  };
  struct WaitingWrite {
    SeqMove move;
    std::chrono::steady_clock::time_point deadline;
  };
  struct WaitingPrefetch {
    SeqMove move;
    std::chrono::steady_clock::time_point deadline;
  };
  std::vector<SeqMove> number(MoveKind kind, const std::vector<BlockMove>& moves);
  void submit(MoveKind kind, const std::vector<SeqMove>& moves);  // waits where it must, then post()
  void post(MoveKind kind, const std::vector<SeqMove>& moves);    // to the backend now
  void fail(MoveKind kind, const std::vector<SeqMove>& moves, const Status& why);
  void remove(const std::vector<BlockMove>& drops);
  void settle_removals();
  void settle_prefetches();
  void finish(MoveKind kind, BlockId dst, std::uint64_t seq, Status status);
  std::vector<Completion> release_in_order();

  storage::StorageTier& tier_;
  bool remove_dropped_ = true;
  std::vector<Pending> pending_;
  std::vector<Removal> removals_;
  std::vector<WaitingWrite> waiting_writes_;  // writes of keys whose delete is in flight
  std::chrono::nanoseconds max_delete_wait_ = std::chrono::seconds(10);
  std::function<Result<bool>(BlockId)> host_block_free_;
  std::chrono::nanoseconds guard_max_wait_{0};
  std::vector<WaitingPrefetch> waiting_prefetches_;  // into host blocks an earlier move may still write
  // Reports go out per destination in submission order (what MultiRankPlanExecutor relies on to drop the late
  // report of a timed-out move rather than a newer move's): the moves still unreported per (kind, destination), in
  // order, and those finished but held behind an earlier one of their destination.
  std::uint64_t next_seq_ = 0;
  std::map<std::pair<MoveKind, BlockId>, std::deque<std::uint64_t>> order_;
  std::map<std::uint64_t, Finished> finished_;
  std::uint64_t bytes_written_ = 0, bytes_read_ = 0, failed_writes_ = 0, failed_reads_ = 0;
  std::uint64_t removed_objects_ = 0, failed_removals_ = 0;
};

class CompositePlanExecutor final : public PlanExecutor {
 public:
  // Both must outlive the composite.
  CompositePlanExecutor(PlanExecutor& transfers, PlanExecutor& storage) : transfers_(transfers), storage_(storage) {}

  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

 private:
  PlanExecutor& transfers_;
  PlanExecutor& storage_;
};

}  // namespace kvtier::cache
