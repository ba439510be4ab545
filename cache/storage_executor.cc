#include "kvtier/cache/storage_executor.h"

#include <fmt/format.h>

namespace kvtier::cache {

storage::StorageKey storage_key(const BlockKey& key) { return storage::StorageKey::from_u64(key.hi, key.lo, 0); }

void StoragePlanExecutor::submit(MoveKind kind, const std::vector<BlockMove>& moves) {
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
  if (!plan.evictions.empty() || !plan.backups.empty() || !plan.loads.empty())
    return FailedPrecondition(fmt::format(
        "StoragePlanExecutor: plan holds {} evictions, {} backups, {} loads (device moves: use CompositePlanExecutor)",
        plan.evictions.size(), plan.backups.size(), plan.loads.size()));
  submit(MoveKind::kStorageWrite, plan.storage_writes);
  submit(MoveKind::kStoragePrefetch, plan.storage_prefetches);
  return Status::Ok();
}

std::vector<Completion> StoragePlanExecutor::poll() {
  std::vector<Completion> out;
  std::vector<Pending> keep;
  for (Pending& p : pending_) {
    const bool write = p.kind == MoveKind::kStorageWrite;
    std::uint64_t& failed = write ? failed_writes_ : failed_reads_;
    if (!p.post_error.ok()) {
      failed += p.dst.size();
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
  if (!dev.empty()) KVTIER_RETURN_IF_ERROR(transfers_.execute(dev));
  if (!sto.empty()) KVTIER_RETURN_IF_ERROR(storage_.execute(sto));
  return Status::Ok();
}

std::vector<Completion> CompositePlanExecutor::poll() {
  std::vector<Completion> out = transfers_.poll();
  std::vector<Completion> s = storage_.poll();
  out.insert(out.end(), std::make_move_iterator(s.begin()), std::make_move_iterator(s.end()));
  return out;
}

}  // namespace kvtier::cache
