#include "kvtier/testing/plan_executors.h"

#include <fmt/format.h>

#include <utility>

namespace kvtier::cache {

FakePlanExecutor::FakePlanExecutor(Options options) : opt_(std::move(options)), rng_(opt_.seed) {}

void FakePlanExecutor::submit(MoveKind kind, const std::vector<BlockMove>& moves) {
  if (moves.empty()) return;
  Completion ok{kind, {}, Status::Ok()};
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (const BlockMove& m : moves) {
    bool failed = (opt_.failure_rate > 0 && u(rng_) < opt_.failure_rate) || (opt_.fail && opt_.fail(kind, m));
    if (failed) {
      ++failed_moves_;
      pending_.push_back(Pending{
          Completion{kind, {m.dst}, Status(opt_.failure_code, fmt::format("injected failure, dst block {}", m.dst))},
          opt_.delay_polls});
      continue;
    }
    ok.dst.push_back(m.dst);
    std::uint64_t bytes = opt_.block_bytes;
    switch (kind) {
      case MoveKind::kEviction:
      case MoveKind::kBackup: bytes_d2h_ += bytes; break;
      case MoveKind::kLoad: bytes_h2d_ += bytes; break;
      case MoveKind::kStorageWrite: bytes_to_storage_ += bytes; break;
      case MoveKind::kStoragePrefetch: bytes_from_storage_ += bytes; break;
    }
  }
  if (!ok.dst.empty()) pending_.push_back(Pending{std::move(ok), opt_.delay_polls});
}

Status FakePlanExecutor::execute(const StepPlan& plan) {
  submit(MoveKind::kEviction, plan.evictions);
  submit(MoveKind::kBackup, plan.backups);
  submit(MoveKind::kLoad, plan.loads);
  submit(MoveKind::kStorageWrite, plan.storage_writes);
  submit(MoveKind::kStoragePrefetch, plan.storage_prefetches);
  return Status::Ok();
}

std::vector<Completion> FakePlanExecutor::poll() {
  std::vector<Completion> out;
  std::deque<Pending> keep;
  for (Pending& p : pending_) {
    if (p.polls_left == 0)
      out.push_back(std::move(p.completion));
    else {
      --p.polls_left;
      keep.push_back(std::move(p));
    }
  }
  pending_ = std::move(keep);
  return out;
}

FaultInjectingPlanExecutor::FaultInjectingPlanExecutor(PlanExecutor& inner, Options options)
    : inner_(inner), options_(std::move(options)), rng_(options_.seed) {}

std::vector<Completion> FaultInjectingPlanExecutor::poll() {
  std::vector<Completion> out;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (Completion& c : inner_.poll()) {
    if (!c.status.ok() || options_.failure_rate <= 0) {
      out.push_back(std::move(c));
      continue;
    }
    Completion ok{c.kind, {}, Status::Ok()};
    Completion bad{c.kind, {}, Status(options_.code, fmt::format("injected {} failure", move_kind_name(c.kind)))};
    for (BlockId b : c.dst) {
      if (u(rng_) < options_.failure_rate) {
        bad.dst.push_back(b);
        ++injected_;
        if (options_.on_fail) options_.on_fail(c.kind, b);
      } else {
        ok.dst.push_back(b);
      }
    }
    if (!ok.dst.empty()) out.push_back(std::move(ok));
    if (!bad.dst.empty()) out.push_back(std::move(bad));
  }
  return out;
}

}  // namespace kvtier::cache
