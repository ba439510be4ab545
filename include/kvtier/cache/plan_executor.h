// PlanExecutor: the seam between the CacheManager (decides block moves) and
// whatever moves the bytes (the TransferManager on a GPU or the host backend;
// a fake in tests and in trace replay).
//
// execute() submits a StepPlan without blocking; poll() returns the moves
// finished since the last poll, each with its status; apply_completions()
// feeds them back to the CacheManager as acknowledgements.
//
// Thread-safety: an executor is driven by the scheduler thread that owns the
// CacheManager.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <vector>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/status.h"

namespace kvtier::cache {

enum class MoveKind : std::uint8_t { kEviction, kBackup, kLoad, kStorageWrite, kStoragePrefetch };

struct Completion {
  MoveKind kind = MoveKind::kLoad;
  std::vector<BlockId> dst;  // destination block ids (the ack key of each move)
  Status status;
};

class PlanExecutor {
 public:
  virtual ~PlanExecutor() = default;
  virtual Status execute(const StepPlan& plan) = 0;
  virtual std::vector<Completion> poll() = 0;
};

// Acks each completion on `cache`; stops at the first ack error.
Status apply_completions(CacheManager& cache, const std::vector<Completion>& completions);

// In-process executor that moves no bytes. Completions succeed at once by
// default; `failure_rate` fails moves at random (seeded), `fail` fails the
// moves it returns true for, and `delay_polls` holds completions back for that
// many poll() calls (exposes code that assumes instant transfers).
class FakePlanExecutor final : public PlanExecutor {
 public:
  struct Options {
    double failure_rate = 0.0;
    std::uint64_t seed = 1;
    std::uint32_t delay_polls = 0;
    StatusCode failure_code = StatusCode::kUnavailable;
    std::function<bool(MoveKind, const BlockMove&)> fail;
    std::uint64_t block_bytes = 0;  // for byte counters
  };
  FakePlanExecutor() : FakePlanExecutor(Options{}) {}
  explicit FakePlanExecutor(Options options);

  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

  std::uint64_t bytes_d2h() const noexcept { return bytes_d2h_; }
  std::uint64_t bytes_h2d() const noexcept { return bytes_h2d_; }
  std::uint64_t bytes_to_storage() const noexcept { return bytes_to_storage_; }
  std::uint64_t bytes_from_storage() const noexcept { return bytes_from_storage_; }
  std::uint64_t failed_moves() const noexcept { return failed_moves_; }
  std::size_t in_flight() const noexcept { return pending_.size(); }

 private:
  struct Pending {
    Completion completion;
    std::uint32_t polls_left;
  };
  void submit(MoveKind kind, const std::vector<BlockMove>& moves);

  Options opt_;
  std::mt19937_64 rng_;
  std::deque<Pending> pending_;
  std::uint64_t bytes_d2h_ = 0, bytes_h2d_ = 0, bytes_to_storage_ = 0, bytes_from_storage_ = 0, failed_moves_ = 0;
};

}  // namespace kvtier::cache
