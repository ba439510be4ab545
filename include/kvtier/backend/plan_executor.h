// PlanExecutor: the seam between the CacheManager (decides block moves) and
// whatever moves the bytes (the TransferManager on a GPU or the host backend,
// storage; the doubles of tests and trace replay are in
// kvtier/testing/plan_executors.h).
//
// execute() submits a StepPlan without blocking; poll() returns the moves
// finished since the last poll, each with its status; apply_completions()
// feeds them back to the CacheManager as acknowledgements.
//
// Thread-safety: an executor is driven by the scheduler thread that owns the
// CacheManager.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/status.h"

namespace kvtier::cache {

enum class MoveKind : std::uint8_t { kEviction, kBackup, kLoad, kStorageWrite, kStoragePrefetch };
// "eviction", "backup", "load", "storage write", "storage prefetch" (for messages).
std::string_view move_kind_name(MoveKind kind) noexcept;

struct Completion {
  MoveKind kind = MoveKind::kLoad;
  std::vector<BlockId> dst;  // destination block ids (the ack key of each move)
  KeptStatus status;
};

class PlanExecutor {
 public:
  virtual ~PlanExecutor() = default;
  virtual Status execute(const StepPlan& plan) = 0;
  virtual std::vector<Completion> poll() = 0;
};

// Acks each completion on `cache`, every one even after an ack error; returns the first error.
Status apply_completions(CacheManager& cache, const std::vector<Completion>& completions);

}  // namespace kvtier::cache
