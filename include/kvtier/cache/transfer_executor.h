// TransferPlanExecutor: runs the device<->host moves of StepPlans (evictions,
// backups, loads) through a TransferManager, so that a CacheManager's plans
// move real bytes (host backend in CI and replay, CUDA on a GPU).
//
// Completions: one TransferManager task per move list of a plan; each task's
// final status acknowledges all of its moves (a task with any failed block is
// reported failed as a whole, so the cache turns those blocks into misses).
// Acknowledgement keys: host blocks for evictions/backups, device blocks for
// loads (as CacheManager's acks expect).
//
// Byte checks (Options::model_prefill): the executor models the forward pass
// writing a block's KV: before a device block is evicted or backed up, unless
// it already holds that key's bytes (it was loaded and checked), the key's
// pattern is written into it on the compute stream, which the manager's
// eviction waits for on the device. After a load completes, the device block
// is compared with its key's pattern: `verified()` and
// `verification_failures()` count the checks. A replay that served a wrong
// block would show up there.
//
// Storage moves are not handled here (InvalidArgument): route them with
// CompositePlanExecutor.
//
// Its tasks' completions go to a completion queue of its own
// (TransferManager::open_completion_queue), so an engine polling the same
// manager neither takes them nor loses its own. A plan execute() could not
// submit whole (an error, a storage move) is still acknowledged: its moves not
// submitted come back failed from the next poll().
//
// Thread-safety: driven by the one scheduler thread that owns the CacheManager.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <unordered_map>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/transfer/transfer_manager.h"

namespace kvtier::cache {

class TransferPlanExecutor final : public PlanExecutor {
 public:
  struct Options {
    bool model_prefill = true;
    // Tensor-parallel rank whose shard this executor moves: the pattern of a
    // key depends on it, so a shard of another rank is caught as a mismatch.
    std::uint32_t rank = 0;
    // How long a step's prefill waits for the compute stream to pass its copies. On a timeout or an error the step
    // fails (its moves are reported failed), the blocks hold no known key, and the staging buffer the queued copies
    // read is retired, never reused.
    std::chrono::nanoseconds prefill_timeout = std::chrono::seconds(60);
  };
  // `device_space` is the device cache registered with `manager`; `compute`
  // the stream the manager was created with. All must outlive the executor.
  TransferPlanExecutor(TransferManager& manager, Device& device, Stream& compute, const BlockSpace& device_space,
                       Options options);
  // Gives its completion queue back to the manager.
  ~TransferPlanExecutor() override;
  TransferPlanExecutor(const TransferPlanExecutor&) = delete;
  TransferPlanExecutor& operator=(const TransferPlanExecutor&) = delete;

  Status execute(const StepPlan& plan) override;
  std::vector<Completion> poll() override;

  std::size_t in_flight() const noexcept { return pending_.size(); }
  std::uint64_t verified() const noexcept { return verified_; }
  std::uint64_t verification_failures() const noexcept { return verification_failures_; }
  std::uint64_t bytes_d2h() const noexcept { return bytes_d2h_; }
  std::uint64_t bytes_h2d() const noexcept { return bytes_h2d_; }
  std::uint64_t failed_tasks() const noexcept { return failed_tasks_; }

  // Pattern of a key's block (all planes, in layout order), `bytes` long, of
  // `rank`'s shard (rank 0: the single-GPU pattern).
  static void fill_key_pattern(const BlockKey& key, std::byte* out, std::uint64_t bytes, std::uint32_t rank = 0);

 private:
  struct Pending {
    MoveKind kind = MoveKind::kLoad;
    std::vector<BlockId> ack;     // acknowledgement keys
    std::vector<BlockId> device;  // device blocks of the moves
    std::vector<BlockKey> keys;   // keys of the moves
  };
  Status submit_plan(const StepPlan& plan);
  void fail_unsubmitted(MoveKind kind, const std::vector<BlockMove>& moves, const Status& why);
  Status submit_d2h(MoveKind kind, const std::vector<BlockMove>& moves);
  Status prefill(const std::vector<BlockMove>& moves);
  void check_loaded(const Pending& p);

  TransferManager& manager_;
  Device& device_;
  Stream& compute_;
  const BlockSpace& space_;
  Options options_;
  std::uint32_t queue_ = 0;  // its completion queue of the manager (opened at the first plan)
  std::unordered_map<TaskId, Pending> pending_;
  std::set<MoveKind> submitted_;                 // kinds of the current plan submitted so far
  std::vector<Completion> unsubmitted_;          // moves of a failed execute(), failed at the next poll()
  std::unordered_map<BlockId, BlockKey> holds_;  // device block -> key whose bytes it holds
  std::vector<std::byte> staging_;
  std::vector<std::vector<std::byte>> retired_staging_;  // of failed steps: queued copies may read them still
  std::uint64_t verified_ = 0, verification_failures_ = 0, bytes_d2h_ = 0, bytes_h2d_ = 0, failed_tasks_ = 0;
};

}  // namespace kvtier::cache
