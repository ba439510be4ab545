// MultiRankPlanExecutor: one CacheManager planning for N tensor-parallel
// ranks. Each rank holds its shard of every block (its own TransferManager and
// GPU, its own host pool, its own storage objects: StorageKey::rank), so a
// block is usable only when every rank has its shard.
//
// execute(plan) hands the same StepPlan to every rank's executor, rank 0 first.
// poll() polls every rank and reports a move (identified by its kind and
// destination block, the cache's acknowledgement key) only once every rank
// reported it; its status is OK only if every rank's was. The first failing
// rank's status is kept (its code, the message prefixed with the rank), so a
// failure on any rank acknowledges the move as failed and the CacheManager
// turns the block into a miss on all ranks: no rank uses a block that another
// rank failed to load. Completions may arrive per rank in any order and any
// grouping (a rank may split or merge the moves of a plan differently).
//
// Deadline. Every move has a deadline (Options::move_deadline from its
// execute()). A move that some rank has not reported by then is reported
// failed with TimedOut naming the ranks, without waiting: poll() never blocks.
// The bytes of a timed-out move are unknown on the ranks that did not report
// (the copy may still land later): the block is a miss, and reuse is safe only
// through what orders a rank's work on a block:
//  - transfer moves: the rank's TransferManager orders every later copy into
//    or out of that block after the pending one (its hazards, see
//    transfer_manager.h), so a later load, eviction or backup of the block on
//    that rank sees or overwrites the late bytes, never races them. Compute
//    writing a device block must fence it first (wait_device_blocks_free), as
//    for any reused block;
//  - storage moves (StorageTier reads into a host block) are not ordered by the
//    TransferManager: keep move_deadline above the storage backend's own
//    operation deadline, so a storage op has ended (success or error) before
//    its move times out; and give each rank's StoragePlanExecutor its
//    TransferManager's is_host_block_free as guard_host_blocks(), so that a
//    prefetch into a host block whose timed-out device->host copy may still
//    land waits for that copy instead of racing it (with the guard's max_wait
//    plus the backend's deadline below move_deadline).
// The late report of a timed-out move is dropped (each rank's reports of one
// destination block arrive in submission order, which the hazards above and
// the executors here guarantee), so it is never taken for a newer move to the
// same block.
//
// execute() failure. When rank k's execute() fails, ranks k+1.. are not handed
// the plan's moves, only its storage_drops (the cache has given those slots up
// whatever becomes of the moves, so each rank still deletes its objects of
// them); execute() returns rank k's error (naming the rank) and every move
// of the plan is reported failed, with that error, once ranks 0..k reported
// it (an executor reports every move it was handed, failed or not) or its
// deadline passed: their copies may still write its blocks until then. The
// cache acknowledges them as misses on all ranks. A plan whose destination collides with a
// move still in flight (kind and block), or names one destination twice, is
// refused (InvalidArgument) before any rank sees it, and still acknowledged:
// its other moves are reported failed by the next poll(), and the move already
// in flight to the colliding destination (indistinguishable by its ack key) is
// reported failed when its ranks report it, so the block is a miss.
//
// Thread-safety: none; driven by the scheduler thread that owns the
// CacheManager. The rank executors must outlive this executor.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/core/status.h"

namespace kvtier::cache {

class MultiRankPlanExecutor final : public PlanExecutor {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    // > 0. From execute() to the last rank's report of a move.
    std::chrono::nanoseconds move_deadline = std::chrono::seconds(30);
    // Time source of the deadlines (tests); null: Clock::now.
    std::function<Clock::time_point()> now;
  };
  struct RankStats {
    std::uint64_t failed_moves = 0;     // moves this rank reported failed
    std::uint64_t missing_reports = 0;  // moves that timed out without this rank's report
    std::uint64_t late_reports = 0;     // reports of moves already timed out or failed at execute(), dropped
    std::uint64_t unknown_reports = 0;  // reports of no move in flight (ignored)
    // Storage drops handed to this rank after an earlier rank's execute() failed, which this rank refused too
    // (execute() returns the first rank's error only).
    std::uint64_t failed_drop_plans = 0;
  };

  // InvalidArgument when `ranks` is empty, holds a null executor (naming its
  // index) or move_deadline <= 0.
  static Result<std::unique_ptr<MultiRankPlanExecutor>> create(std::vector<PlanExecutor*> ranks, Options options);

  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

  std::uint32_t ranks() const noexcept { return static_cast<std::uint32_t>(ranks_.size()); }
  std::size_t in_flight() const noexcept { return pending_.size(); }
  // A rank outside 0..ranks()-1 has none (all zero).
  RankStats rank_stats(std::uint32_t rank) const noexcept { return rank < stats_.size() ? stats_[rank] : RankStats{}; }
  std::uint64_t completed_moves() const noexcept { return completed_moves_; }  // reported OK by every rank
  std::uint64_t failed_moves() const noexcept { return failed_moves_; }        // failed, timed out included
  std::uint64_t timed_out_moves() const noexcept { return timed_out_moves_; }

 private:
  struct MoveRef {
    MoveKind kind;
    BlockId dst;
    bool operator<(const MoveRef& o) const noexcept { return kind != o.kind ? kind < o.kind : dst < o.dst; }
  };
  struct Entry {
    std::vector<bool> reported;  // per rank
    std::uint32_t count = 0;
    KeptStatus status;  // first failure
    Clock::time_point deadline;
    std::uint64_t seq = 0;  // submission order, for deterministic timeout reports
  };
  MultiRankPlanExecutor(std::vector<PlanExecutor*> ranks, Options options);
  Clock::time_point now() const { return options_.now ? options_.now() : Clock::now(); }
  void finish(const MoveRef& ref, Status status, std::vector<Completion>& out);
  Status refuse(const std::set<MoveRef>& refs, const MoveRef& collision);

  std::vector<PlanExecutor*> ranks_;
  Options options_;
  std::map<MoveRef, Entry> pending_;
  std::vector<std::map<MoveRef, std::uint32_t>> dropped_;  // per rank: reports still to drop
  std::vector<RankStats> stats_;
  std::vector<std::pair<MoveRef, KeptStatus>> refused_;  // moves of refused plans, failed at the next poll()
  std::uint64_t seq_ = 0, completed_moves_ = 0, failed_moves_ = 0, timed_out_moves_ = 0;
};

}  // namespace kvtier::cache
