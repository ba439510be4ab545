// Executors for the storage moves of a StepPlan, and the composite that
// splits a plan between the device<->host executor and the storage one.
//
// StoragePlanExecutor moves bytes between the host tier (the StorageTier's
// host BlockSpace, indexed by the cache's host block ids) and a StorageBackend:
//   storage_writes     -> StorageTier::write(keys, src host blocks), acked by
//                         storage slot (BlockMove::dst) with MoveKind::kStorageWrite;
//   storage_prefetches -> StorageTier::read(keys, dst host blocks), acked by
//                         host block with MoveKind::kStoragePrefetch.
// Objects are named by the move's BlockKey (StorageKey::from_u64(hi, lo),
// rank set by the tier), not by the cache's storage slot: slots only count
// capacity. A block whose read fails (NotFound, DataLoss after a checksum
// mismatch, Unavailable, ...) completes with that status, so the cache turns
// it into a miss; its host block holds undefined bytes and is never served.
// A batch that cannot be posted completes (at the next poll) with the post error.
//
// CompositePlanExecutor routes evictions, backups and loads to one executor
// and storage writes/prefetches to another, and merges their completions. No
// ordering is needed between the two halves of one plan: the cache only
// writes settled host blocks to storage and only prefetches into fresh host
// blocks that no device move touches.
//
// Thread-safety: none; driven by the scheduler thread that owns the CacheManager.
#pragma once

#include <cstdint>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/storage/storage_tier.h"

namespace kvtier::cache {

storage::StorageKey storage_key(const BlockKey& key);

class StoragePlanExecutor final : public PlanExecutor {
 public:
  // `tier` must outlive the executor; its host space is the cache's host tier.
  explicit StoragePlanExecutor(storage::StorageTier& tier) : tier_(tier) {}
  ~StoragePlanExecutor() override = default;

  // FailedPrecondition (nothing submitted) when the plan holds device moves.
  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

  std::size_t in_flight() const noexcept { return pending_.size(); }
  std::uint64_t bytes_written() const noexcept { return bytes_written_; }
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }
  std::uint64_t failed_writes() const noexcept { return failed_writes_; }
  std::uint64_t failed_reads() const noexcept { return failed_reads_; }

 private:
  struct Pending {
    MoveKind kind;
    std::vector<BlockId> dst;
    storage::StorageTierOp op;
    KeptStatus post_error;  // set when the batch never reached the backend
  };
  void submit(MoveKind kind, const std::vector<BlockMove>& moves);

  storage::StorageTier& tier_;
  std::vector<Pending> pending_;
  std::uint64_t bytes_written_ = 0, bytes_read_ = 0, failed_writes_ = 0, failed_reads_ = 0;
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
