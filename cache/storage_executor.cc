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
  std::vector<WaitingWrite> still = std::move(waiting_writes_);
  waiting_writes_.clear();
  // Those whose delete is still pending wait again, up to their deadline: then they fail (the slot is a miss) and
  // are never posted, since the delete may still end after them and remove the new object.
  std::unordered_set<BlockKey, BlockKeyHash> removing;
  for (const Removal& r : removals_) removing.insert(r.keys.begin(), r.keys.end());
  const auto t = std::chrono::steady_clock::now();
  std::vector<SeqMove> waiting;
  for (WaitingWrite& w : still) {
    if (removing.count(w.move.move.key) == 0) {
      waiting.push_back(w.move);
    } else if (t >= w.deadline) {
      fail(MoveKind::kStorageWrite, {w.move},
           TimedOut(fmt::format("storage write of slot {}: the delete of its key's previous object has not ended "
                                "after {} ms (a write posted before it ends could be removed by it)",
                                w.move.move.dst, max_delete_wait_.count() / 1000000)));
    } else {
      waiting_writes_.push_back(w);
    }
  }
  // Two writes of one key (an invalidated block's and the key's new one) go in separate batches, a batch naming a
  // key twice being refused whole.
  while (!waiting.empty()) {
    std::unordered_set<BlockKey, BlockKeyHash> seen;
    std::vector<SeqMove> batch, later;
    for (const SeqMove& m : waiting) (seen.insert(m.move.key).second ? batch : later).push_back(m);
    submit(MoveKind::kStorageWrite, batch);
    waiting = std::move(later);
  }
}

// Posts the waiting prefetches whose host block is free now; fails those past their deadline.
void StoragePlanExecutor::settle_prefetches() {
  if (waiting_prefetches_.empty()) return;
  std::vector<WaitingPrefetch> waiting = std::move(waiting_prefetches_);
  waiting_prefetches_.clear();
  std::vector<SeqMove> now;
  const auto t = std::chrono::steady_clock::now();
  for (WaitingPrefetch& w : waiting) {
    const BlockId h = w.move.move.dst;
    Result<bool> free = host_block_free_ ? host_block_free_(h) : Result<bool>(true);
    if (free.ok() && *free) {
      now.push_back(w.move);
    } else if (!free.ok() || t >= w.deadline) {
      Status why =
          free.ok()
              ? Unavailable(fmt::format("storage prefetch into host block {}: an earlier move still "
                                        "writes the block after {} ms",
                                        h, guard_max_wait_.count() / 1000000))
              : free.status().with_context(fmt::format("storage prefetch into host block {}: is the block free", h));
      fail(MoveKind::kStoragePrefetch, {w.move}, why);
    } else {
      waiting_prefetches_.push_back(w);
    }
  }
  post(MoveKind::kStoragePrefetch, now);
}

std::vector<StoragePlanExecutor::SeqMove> StoragePlanExecutor::number(MoveKind kind,
                                                                      const std::vector<BlockMove>& moves) {
  std::vector<SeqMove> out;
  out.reserve(moves.size());
  for (const BlockMove& m : moves) {
    out.push_back(SeqMove{m, next_seq_});
    order_[{kind, m.dst}].push_back(next_seq_++);
  }
  return out;
}

void StoragePlanExecutor::submit(MoveKind kind, const std::vector<SeqMove>& moves) {
  if (moves.empty()) return;
  const bool write = kind == MoveKind::kStorageWrite;
  if (!write && host_block_free_) {
    // A prefetch into a host block that an earlier (timed-out) move may still write waits for it (poll()).
    std::vector<SeqMove> now;
    const auto deadline = deadline_after(guard_max_wait_);
    for (const SeqMove& m : moves) {
      Result<bool> free = host_block_free_(m.move.dst);
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
    std::vector<SeqMove> now;
    const auto deadline = deadline_after(max_delete_wait_);
    for (const SeqMove& m : moves) {
      if (removing.count(m.move.key) != 0)
        waiting_writes_.push_back(WaitingWrite{m, deadline});
      else
        now.push_back(m);
    }
    post(kind, now);
    return;
  }
  post(kind, moves);
}

void StoragePlanExecutor::post(MoveKind kind, const std::vector<SeqMove>& moves) {
  if (moves.empty()) return;
  const bool write = kind == MoveKind::kStorageWrite;
  std::vector<storage::StorageKey> keys;
  std::vector<std::uint64_t> host;
  Pending p{kind, {}, {}, {}, Status::Ok()};
  keys.reserve(moves.size());
  host.reserve(moves.size());
  p.dst.reserve(moves.size());
  p.seq.reserve(moves.size());
  for (const SeqMove& m : moves) {
    keys.push_back(storage_key(m.move.key));
    host.push_back(write ? m.move.src : m.move.dst);  // the host block: source of a write, destination of a read
    p.dst.push_back(m.move.dst);
    p.seq.push_back(m.seq);
  }
  auto op = write ? tier_.write(keys, host) : tier_.read(keys, host);
  if (op.ok())
    p.op = std::move(*op);
  else
    p.post_error =
        op.status().with_context(fmt::format("storage {} of {} blocks", write ? "write" : "prefetch", moves.size()));
  pending_.push_back(std::move(p));
}

// Reported failed at the next poll(), in order with the other moves of their destinations.
void StoragePlanExecutor::fail(MoveKind kind, const std::vector<SeqMove>& moves, const Status& why) {
  if (moves.empty()) return;
  Pending p{kind, {}, {}, {}, why};
  for (const SeqMove& m : moves) {
    p.dst.push_back(m.move.dst);
    p.seq.push_back(m.seq);
  }
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
    for (const auto& [kind, moves] : kinds) fail(kind, number(kind, *moves), refused);
    return refused;
  }
  submit(MoveKind::kStorageWrite, number(MoveKind::kStorageWrite, plan.storage_writes));
  submit(MoveKind::kStoragePrefetch, number(MoveKind::kStoragePrefetch, plan.storage_prefetches));
  return Status::Ok();
}

void StoragePlanExecutor::finish(MoveKind kind, BlockId dst, std::uint64_t seq, Status status) {
  const bool write = kind == MoveKind::kStorageWrite;
  if (status.ok())
    (write ? bytes_written_ : bytes_read_) += tier_.object_bytes();
  else if (write)
    ++failed_writes_;
  else if (kind == MoveKind::kStoragePrefetch)
    ++failed_reads_;  // (not a refused plan's device moves)
  finished_.emplace(seq, Finished{kind, dst, std::move(status)});
}

// Reports every finished move that no earlier move of its destination is still ahead of: batches complete in any
// order (a write that waited for a delete, a slower read), so a later move to a destination may finish first.
std::vector<Completion> StoragePlanExecutor::release_in_order() {
  std::vector<Completion> out;
  // One pass in submission order: a move released here can only let later ones of its destination go, which come
  // after it in this pass.
  for (auto it = finished_.begin(); it != finished_.end();) {
    auto o = order_.find({it->second.kind, it->second.dst});
    if (o == order_.end() || o->second.empty() || o->second.front() != it->first) {
      ++it;
      continue;
    }
    o->second.pop_front();
    if (o->second.empty()) order_.erase(o);
    Finished& f = it->second;
    // In order in the returned list too; neighbouring successes of one kind share a completion.
    if (f.status.ok() && !out.empty() && out.back().kind == f.kind && out.back().status.ok())
      out.back().dst.push_back(f.dst);
    else
      out.push_back(Completion{f.kind, {f.dst}, std::move(f.status)});
    it = finished_.erase(it);
  }
  return out;
}

std::vector<Completion> StoragePlanExecutor::poll() {
  settle_removals();
  settle_prefetches();
  std::vector<Pending> keep;
  for (Pending& p : pending_) {
    if (!p.post_error.ok()) {
      for (std::size_t i = 0; i < p.dst.size(); ++i) finish(p.kind, p.dst[i], p.seq[i], p.post_error);
      continue;
    }
    if (!p.op.poll()) {
      keep.push_back(std::move(p));
      continue;
    }
    for (std::size_t i = 0; i < p.dst.size(); ++i) finish(p.kind, p.dst[i], p.seq[i], p.op.status(i));
  }
  pending_ = std::move(keep);
  return release_in_order();
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
