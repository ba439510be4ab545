// Test doubles of the cache's PlanExecutor seam (kvtier/backend/plan_executor.h), for tests and for the trace
// replay (sim/): an executor that moves no bytes, and a wrapper that fails a random share of another
// executor's moves. Not part of the library (target kvtier_testing).
//
// Thread-safety: as every executor, driven by the thread that owns the CacheManager.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/core/status.h"

namespace kvtier::cache {

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

// Wraps a rank's executor and fails a random fraction of its moves (seeded):
// the wrapped executor runs them, but their completions are reported with
// `code`, as if the rank's copy had failed. Injects failures on one rank of a
// MultiRankPlanExecutor (the real TransferManager's stream errors are sticky,
// which would end a replay). `on_fail` sees every move it failed.
class FaultInjectingPlanExecutor final : public PlanExecutor {
 public:
  struct Options {
    double failure_rate = 0.0;  // 0..1
    std::uint64_t seed = 1;
    StatusCode code = StatusCode::kDataLoss;
    std::function<void(MoveKind, BlockId)> on_fail;
  };
  // `inner` must outlive the wrapper.
  FaultInjectingPlanExecutor(PlanExecutor& inner, Options options);

  Status execute(const StepPlan& plan) override { return inner_.execute(plan); }
  std::vector<Completion> poll() override;

  std::uint64_t injected() const noexcept { return injected_; }

 private:
  PlanExecutor& inner_;
  Options options_;
  std::mt19937_64 rng_;
  std::uint64_t injected_ = 0;
};

}  // namespace kvtier::cache
