#include "kvtier/cache/multi_rank_executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "kvtier/core/deadline.h"

namespace kvtier::cache {
namespace {

std::array<std::pair<MoveKind, const std::vector<BlockMove>*>, 5> move_lists(const StepPlan& plan) {
  return {{{MoveKind::kEviction, &plan.evictions},
           {MoveKind::kBackup, &plan.backups},
           {MoveKind::kLoad, &plan.loads},
           {MoveKind::kStorageWrite, &plan.storage_writes},
           {MoveKind::kStoragePrefetch, &plan.storage_prefetches}}};
}

}  // namespace

Result<std::unique_ptr<MultiRankPlanExecutor>> MultiRankPlanExecutor::create(std::vector<PlanExecutor*> ranks,
                                                                             Options options) {
  if (ranks.empty()) return InvalidArgument("MultiRankPlanExecutor: 0 ranks (needs at least one rank executor)");
  for (std::size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r] == nullptr)
      return InvalidArgument(
          fmt::format("MultiRankPlanExecutor: the executor of rank {} of {} is null", r, ranks.size()));
  if (options.move_deadline <= std::chrono::nanoseconds::zero())
    return InvalidArgument(
        fmt::format("MultiRankPlanExecutor: move_deadline must be > 0, got {} ns", options.move_deadline.count()));
  return std::unique_ptr<MultiRankPlanExecutor>(new MultiRankPlanExecutor(std::move(ranks), std::move(options)));
}

MultiRankPlanExecutor::MultiRankPlanExecutor(std::vector<PlanExecutor*> ranks, Options options)
    : ranks_(std::move(ranks)), options_(std::move(options)), dropped_(ranks_.size()), stats_(ranks_.size()) {}

Status MultiRankPlanExecutor::execute(const StepPlan& plan) {
  const auto lists = move_lists(plan);
  std::set<MoveRef> refs;
  std::optional<MoveRef> collision;
  for (const auto& [kind, moves] : lists)
    for (const BlockMove& m : *moves) {
      const MoveRef ref{kind, m.dst};
      const bool repeated = !refs.insert(ref).second;
      if ((repeated || pending_.count(ref) != 0) && !collision) collision = ref;
    }
  if (collision) return refuse(refs, *collision);
  if (refs.empty()) {
    // Only dropped storage slots (nothing to acknowledge): every rank deletes its own objects of them, also after
    // another rank failed to (each rank's objects are its own; the first error is returned).
    Status first = Status::Ok();
    if (!plan.storage_drops.empty())
      for (std::uint32_t r = 0; r < ranks(); ++r) {
        Status st = ranks_[r]->execute(plan);
        if (!st.ok() && first.ok()) first = st.with_context(fmt::format("rank {} of {}: execute", r, ranks()));
      }
    return first;
  }
  const Clock::time_point deadline = deadline_after(options_.move_deadline, now());  // saturated: no overflow
  const std::uint32_t n = ranks();
  for (const auto& [kind, moves] : lists)
    for (const BlockMove& m : *moves) {
      Entry& e = pending_[MoveRef{kind, m.dst}];
      e.reported.assign(n, false);
      e.deadline = deadline;
      e.seq = seq_++;
    }
  for (std::uint32_t r = 0; r < n; ++r) {
    Status st = ranks_[r]->execute(plan);
    if (st.ok()) continue;
    Status err = st.with_context(fmt::format("rank {} of {}: execute", r, n));
    // Every move fails with rank r's error, but not before ranks 0..r reported it (or its deadline passed): they
    // got the plan (rank r perhaps in part, and an executor reports what it was handed, failed or not), so their
    // copies and storage reads may still write its blocks, and a failure acknowledged at once let the cache hand
    // those blocks to other moves under them. The ranks after r never got it: counted as reported.
    for (const MoveRef& ref : refs) {
      Entry& e = pending_[ref];
      e.status = err;
      for (std::uint32_t q = r + 1; q < n; ++q) e.reported[q] = true;
      e.count = n - (r + 1);
    }
    // The cache has given up the plan's storage slots whatever happens to its moves: the ranks after r delete
    // their objects of them all the same, or those objects would stay in their backends with no key pointing at
    // them. (Rank r's own share is left: its execute() failed, and what it posted is unknown.)
    if (!plan.storage_drops.empty()) {
      StepPlan drops_only;
      drops_only.storage_drops = plan.storage_drops;
      for (std::uint32_t q = r + 1; q < n; ++q)
        if (!ranks_[q]->execute(drops_only).ok()) ++stats_[q].failed_drop_plans;
    }
    return err;
  }
  return Status::Ok();
}

// No rank saw the plan. Its moves are still acknowledged (a plan taken from the cache and never reported would
// keep its blocks in flight for good): those to a destination nothing else is moving fail at the next poll(); one
// to a destination that is in flight cannot be told apart from the move already there (both have its ack key), so
// that move is reported failed when the ranks report it: the block becomes a miss instead of being trusted by
// two records of the cache.
Status MultiRankPlanExecutor::refuse(const std::set<MoveRef>& refs, const MoveRef& collision) {
  Status err = InvalidArgument(fmt::format(
      "MultiRankPlanExecutor: {} move to block {} is already in flight (a destination is reused before its move "
      "was acknowledged); the plan was handed to no rank and its moves are reported failed",
      move_kind_name(collision.kind), collision.dst));
  for (const MoveRef& ref : refs) {
    auto it = pending_.find(ref);
    if (it != pending_.end()) {
      if (it->second.status.ok()) it->second.status = err;
    } else {
      refused_.emplace_back(ref, err);
    }
  }
  return err;
}

void MultiRankPlanExecutor::finish(const MoveRef& ref, Status status, std::vector<Completion>& out) {
  if (status.ok()) {
    ++completed_moves_;
    if (!out.empty() && out.back().kind == ref.kind && out.back().status.ok()) {
      out.back().dst.push_back(ref.dst);
      return;
    }
  } else {
    ++failed_moves_;
  }
  out.push_back(Completion{ref.kind, {ref.dst}, std::move(status)});
}

std::vector<Completion> MultiRankPlanExecutor::poll() {
  std::vector<Completion> out;
  for (auto& [ref, status] : refused_) finish(ref, std::move(status), out);
  refused_.clear();
  const std::uint32_t n = ranks();
  for (std::uint32_t r = 0; r < n; ++r) {
    for (const Completion& c : ranks_[r]->poll()) {
      for (BlockId b : c.dst) {
        const MoveRef ref{c.kind, b};
        auto d = dropped_[r].find(ref);
        if (d != dropped_[r].end()) {
          ++stats_[r].late_reports;
          if (--d->second == 0) dropped_[r].erase(d);
          continue;
        }
        auto it = pending_.find(ref);
        if (it == pending_.end() || it->second.reported[r]) {
          ++stats_[r].unknown_reports;
          continue;
        }
        Entry& e = it->second;
        e.reported[r] = true;
        ++e.count;
        if (!c.status.ok()) {
          ++stats_[r].failed_moves;
          if (e.status.ok()) e.status = c.status.with_context(fmt::format("rank {} of {}", r, n));
        }
        if (e.count == n) {
          Status st = std::move(e.status);
          pending_.erase(it);
          finish(ref, std::move(st), out);
        }
      }
    }
  }
  // Deadlines: never wait for a rank; a move it has not reported fails now.
  const Clock::time_point t = now();
  std::vector<std::pair<std::uint64_t, MoveRef>> expired;
  for (const auto& [ref, e] : pending_)
    if (e.deadline <= t) expired.emplace_back(e.seq, ref);
  std::sort(expired.begin(), expired.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(options_.move_deadline).count();
  for (const auto& [seq, ref] : expired) {
    auto it = pending_.find(ref);
    std::string missing;
    for (std::uint32_t q = 0; q < n; ++q)
      if (!it->second.reported[q]) {
        missing += missing.empty() ? fmt::format("{}", q) : fmt::format(",{}", q);
        ++dropped_[q][ref];
        ++stats_[q].missing_reports;
      }
    pending_.erase(it);
    ++timed_out_moves_;
    finish(ref,
           TimedOut(fmt::format("{} move to block {}: rank(s) {} of {} did not report within {} ms (its bytes there "
                                "are unknown: the block is a miss)",
                                move_kind_name(ref.kind), ref.dst, missing, n, ms)),
           out);
  }
  return out;
}

}  // namespace kvtier::cache
