#include "kvtier/cache/storage_executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "kvtier/core/deadline.h"

namespace kvtier::cache {

storage::StorageKey storage_key(const BlockKey& key) { return storage::StorageKey::from_u64(key.hi, key.lo, 0); }

void StoragePlanExecutor::remove(const std::vector<BlockMove>& drops) {
  if (drops.empty() || !remove_dropped_) return;
  Removal r;
  std::vector<storage::StorageKey> keys;
  keys.reserve(drops.size());
  for (const BlockMove& m : drops) {
    r.keys.push_back(m.key);
    keys.push_back(storage_key(m.key));
  }
  auto op = tier_.remove(keys);
  if (!op.ok()) {  // nothing posted: the objects stay (a later delete or the backend's own capacity takes them)
    failed_removals_ += drops.size();
    return;
  }
  r.op = std::move(*op);
  r.posted = true;
  removals_.push_back(std::move(r));
}

// Harvests finished deletes, then posts the writes that waited for them.
void StoragePlanExecutor::settle_removals() {
  std::vector<Removal> keep;
  for (Removal& r : removals_) {
    if (!r.op.poll()) {
      keep.push_back(std::move(r));
      continue;
    }
    for (std::size_t i = 0; i < r.keys.size(); ++i) {
      if (r.op.status(i).ok())
        ++removed_objects_;
      else
        ++failed_removals_;
    }
  }
  removals_ = std::move(keep);
  if (waiting_writes_.empty()) return;
  std::vector<BlockMove> waiting = std::move(waiting_writes_);
  waiting_writes_.clear();
  // Those whose delete is still pending wait again; two writes of one key (an invalidated block's and the key's
  // new one) go in separate batches, a batch naming a key twice being refused whole.
  while (!waiting.empty()) {
    std::unordered_set<BlockKey, BlockKeyHash> seen;
    std::vector<BlockMove> batch, later;
    for (const BlockMove& m : waiting) (seen.insert(m.key).second ? batch : later).push_back(m);
    submit(MoveKind::kStorageWrite, batch);
    waiting = std::move(later);
  }
}

// Posts the waiting prefetches whose host block is free now; fails those past their deadline.
void StoragePlanExecutor::settle_prefetches() {
  if (waiting_prefetches_.empty()) return;
  std::vector<WaitingPrefetch> waiting = std::move(waiting_prefetches_);
  waiting_prefetches_.clear();
  std::vector<BlockMove> now;
  const auto t = std::chrono::steady_clock::now();
  for (WaitingPrefetch& w : waiting) {
    Result<bool> free = host_block_free_(w.move.dst);
    if (free.ok() && *free) {
      now.push_back(w.move);
    } else if (!free.ok() || t >= w.deadline) {
      Status why = free.ok() ? Unavailable(fmt::format("storage prefetch into host block {}: an earlier move still "
                                                       "writes the block after {} ms",
                                                       w.move.dst, guard_max_wait_.count() / 1000000))
                             : free.status().with_context(
                                   fmt::format("storage prefetch into host block {}: is the block free", w.move.dst));
      pending_.push_back(Pending{MoveKind::kStoragePrefetch, {w.move.dst}, {}, std::move(why)});
    } else {
      waiting_prefetches_.push_back(std::move(w));
    }
  }
  post(MoveKind::kStoragePrefetch, now);
}

void StoragePlanExecutor::submit(MoveKind kind, const std::vector<BlockMove>& moves) {
  if (moves.empty()) return;
  const bool write = kind == MoveKind::kStorageWrite;
  if (!write && host_block_free_) {
    // A prefetch into a host block that an earlier (timed-out) move may still write waits for it (poll()).
    std::vector<BlockMove> now;
    const auto deadline = deadline_after(guard_max_wait_);
    for (const BlockMove& m : moves) {
      Result<bool> free = host_block_free_(m.dst);
      if (free.ok() && *free)
        now.push_back(m);
      else
        waiting_prefetches_.push_back(WaitingPrefetch{m, deadline});
    }
    post(kind, now);
    return;
  }
  if (write && !removals_.empty()) {
    // A key dropped and written again: its write is posted once its delete is over (by poll()), so the delete never
    // removes the new object; execute() does not wait for it.
    std::unordered_set<BlockKey, BlockKeyHash> removing;
    for (const Removal& r : removals_) removing.insert(r.keys.begin(), r.keys.end());
    if (std::any_of(moves.begin(), moves.end(), [&](const BlockMove& m) { return removing.count(m.key) != 0; })) {
      std::vector<BlockMove> now;
      for (const BlockMove& m : moves) (removing.count(m.key) != 0 ? waiting_writes_ : now).push_back(m);
      post(kind, now);
      return;
    }
  }
  post(kind, moves);
}

void StoragePlanExecutor::post(MoveKind kind, const std::vector<BlockMove>& moves) {
  if (moves.empty()) return;
  const bool write = kind == MoveKind::kStorageWrite;
  std::vector<storage::StorageKey> keys;
  std::vector<std::uint64_t> host;
  Pending p{kind, {}, {}, Status::Ok()};
  keys.reserve(moves.size());
  host.reserve(moves.size());
  p.dst.reserve(moves.size());
  for (const BlockMove& m : moves) {
    keys.push_back(storage_key(m.key));
    host.push_back(write ? m.src : m.dst);  // the host block: source of a write, destination of a read
    p.dst.push_back(m.dst);
  }
  auto op = write ? tier_.write(keys, host) : tier_.read(keys, host);
  if (op.ok())
    p.op = std::move(*op);
  else
    p.post_error =
        op.status().with_context(fmt::format("storage {} of {} blocks", write ? "write" : "prefetch", moves.size()));
  pending_.push_back(std::move(p));
}

Status StoragePlanExecutor::execute(const StepPlan& plan) {
  remove(plan.storage_drops);  // the cache gave those slots up whatever becomes of the plan
  if (!plan.evictions.empty() || !plan.backups.empty() || !plan.loads.empty()) {
    // Refused whole; every move of it is reported failed at the next poll(), as a failed submission is (the cache
    // acknowledges them as misses instead of waiting for them forever).
    Status refused = FailedPrecondition(fmt::format(
        "StoragePlanExecutor: plan holds {} evictions, {} backups, {} loads (device moves: use CompositePlanExecutor)",
        plan.evictions.size(), plan.backups.size(), plan.loads.size()));
    const std::pair<MoveKind, const std::vector<BlockMove>*> kinds[] = {
        {MoveKind::kEviction, &plan.evictions},
        {MoveKind::kBackup, &plan.backups},
        {MoveKind::kLoad, &plan.loads},
        {MoveKind::kStorageWrite, &plan.storage_writes},
        {MoveKind::kStoragePrefetch, &plan.storage_prefetches}};
    for (const auto& [kind, moves] : kinds) {
      if (moves->empty()) continue;
      Pending p{kind, {}, {}, refused};
      for (const BlockMove& m : *moves) p.dst.push_back(m.dst);
      pending_.push_back(std::move(p));
    }
    return refused;
  }
  submit(MoveKind::kStorageWrite, plan.storage_writes);
  submit(MoveKind::kStoragePrefetch, plan.storage_prefetches);
  return Status::Ok();
}

std::vector<Completion> StoragePlanExecutor::poll() {
  settle_removals();
  settle_prefetches();
  std::vector<Completion> out;
  std::vector<Pending> keep;
  for (Pending& p : pending_) {
    const bool write = p.kind == MoveKind::kStorageWrite;
    std::uint64_t& failed = write ? failed_writes_ : failed_reads_;
    if (!p.post_error.ok()) {
      if (write || p.kind == MoveKind::kStoragePrefetch) failed += p.dst.size();  // not a refused plan's device moves
      out.push_back(Completion{p.kind, std::move(p.dst), p.post_error});
      continue;
    }
    if (!p.op.poll()) {
      keep.push_back(std::move(p));
      continue;
    }
    Completion ok{p.kind, {}, Status::Ok()};
    for (std::size_t i = 0; i < p.dst.size(); ++i) {
      Status st = p.op.status(i);
      if (st.ok()) {
        ok.dst.push_back(p.dst[i]);
        (write ? bytes_written_ : bytes_read_) += tier_.object_bytes();
      } else {
        ++failed;
        out.push_back(Completion{p.kind, {p.dst[i]}, std::move(st)});
      }
    }
    if (!ok.dst.empty()) out.push_back(std::move(ok));
  }
  pending_ = std::move(keep);
  return out;
}

Status CompositePlanExecutor::execute(const StepPlan& plan) {
  StepPlan dev, sto;
  dev.evictions = plan.evictions;
  dev.backups = plan.backups;
  dev.loads = plan.loads;
  sto.storage_writes = plan.storage_writes;
  sto.storage_prefetches = plan.storage_prefetches;
  sto.storage_drops = plan.storage_drops;
  // Both halves run whatever the other's outcome: each reports every move of its half at a later poll() (a refused
  // or failed submission as failed moves), so every move of the plan is reported once. Returning after a failed
  // transfer half left the storage writes and prefetches unreported (host blocks fetching and slots storing
  // forever) and the drops never posted. The first error is returned.
  Status first = Status::Ok();
  if (!dev.empty()) first = transfers_.execute(dev);
  if (!sto.empty()) {
    Status st = storage_.execute(sto);
    if (first.ok()) first = std::move(st);
  }
  return first;
}

std::vector<Completion> CompositePlanExecutor::poll() {
  std::vector<Completion> out = transfers_.poll();
  std::vector<Completion> s = storage_.poll();
  out.insert(out.end(), std::make_move_iterator(s.begin()), std::make_move_iterator(s.end()));
  return out;
}

}  // namespace kvtier::cache
