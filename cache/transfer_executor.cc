#include "kvtier/cache/transfer_executor.h"

#include <fmt/format.h>

#include <cstring>

#include "cache/splitmix.h"

namespace kvtier::cache {

void TransferPlanExecutor::fill_key_pattern(const BlockKey& key, std::byte* out, std::uint64_t bytes,
                                            std::uint32_t rank) {
  std::uint64_t x = key.hi ^ (key.lo * 0xD6E8FEB86659FD93ull) ^ 0x6B76746965720001ull;
  if (rank != 0) x ^= (std::uint64_t{rank} * 0xA24BAED4963EE407ull) | 1;
  std::uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t v = splitmix64_next(x);
    std::memcpy(out + i, &v, 8);
  }
  if (i < bytes) {
    const std::uint64_t v = splitmix64_next(x);
    std::memcpy(out + i, &v, bytes - i);
  }
}

TransferPlanExecutor::TransferPlanExecutor(TransferManager& manager, Device& device, Stream& compute,
                                           const BlockSpace& device_space, Options options)
    : manager_(manager), device_(device), compute_(compute), space_(device_space), options_(options) {}

TransferPlanExecutor::~TransferPlanExecutor() {
  if (queue_ != 0) manager_.close_completion_queue(queue_).ignore_error();
  if (!retired_staging_.empty() && !device_.synchronize(compute_, options_.prefill_timeout).ok()) {
    // Copies that never ran may read them still: better a leak than a read of freed memory.
    for (std::vector<std::byte>& buffer : retired_staging_) (void)new std::vector<std::byte>(std::move(buffer));
  }
}

Status TransferPlanExecutor::prefill(const std::vector<BlockMove>& moves) {
  const KvLayout& layout = space_.layout();
  const std::uint64_t block_bytes = layout.total_block_bytes();
  std::vector<const BlockMove*> todo;
  for (const BlockMove& m : moves) {
    auto it = holds_.find(m.src);
    if (it == holds_.end() || !(it->second == m.key)) todo.push_back(&m);
  }
  if (todo.empty()) return Status::Ok();
  // The blocks may still be read by an earlier eviction of their previous
  // contents: the compute stream waits (on the device) until they are free.
  std::vector<BlockId> blocks;
  for (const BlockMove* m : todo) blocks.push_back(m->src);
  KVTIER_RETURN_IF_ERROR(manager_.wait_device_blocks_free(blocks, compute_));
  // The blocks' bytes are unknown until the step's copies are known to have run.
  for (const BlockMove* m : todo) holds_.erase(m->src);
  // One staging image per block; kept until the compute stream passed the copies.
  staging_.resize(todo.size() * block_bytes);
  Status st = Status::Ok();
  for (std::size_t i = 0; i < todo.size() && st.ok(); ++i) {
    std::byte* image = staging_.data() + i * block_bytes;
    fill_key_pattern(todo[i]->key, image, block_bytes, options_.rank);
    std::uint64_t offset = 0;
    for (std::uint32_t l = 0; l < layout.num_layers() && st.ok(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l) && st.ok(); ++r) {
        const std::uint64_t n = layout.block_bytes(l, r);
        st = device_.memcpy_async(space_.block_ptr(l, r, todo[i]->src), image + offset, n, compute_)
                 .with_context(fmt::format("prefill of device block {}", todo[i]->src));
        offset += n;
      }
  }
  // The staging buffer is reused by the next step: wait for the compute stream.
  if (st.ok()) st = device_.synchronize(compute_, options_.prefill_timeout);
  if (!st.ok()) {
    // Copies queued on the compute stream may still read the buffer: it is retired, never written again, and freed
    // once a later wait shows the stream past them (or when the executor goes).
    retired_staging_.push_back(std::move(staging_));
    staging_ = {};
    return st;
  }
  retired_staging_.clear();  // the stream passed every earlier copy too
  for (const BlockMove* m : todo) holds_[m->src] = m->key;
  return Status::Ok();
}

Status TransferPlanExecutor::submit_d2h(MoveKind kind, const std::vector<BlockMove>& moves) {
  if (moves.empty()) return Status::Ok();
  if (options_.model_prefill) KVTIER_RETURN_IF_ERROR(prefill(moves));
  std::vector<BlockId> dev, host;
  Pending p;
  p.kind = kind;
  for (const BlockMove& m : moves) {
    dev.push_back(m.src);
    host.push_back(m.dst);
    p.ack.push_back(m.dst);
    p.device.push_back(m.src);
    p.keys.push_back(m.key);
  }
  EvictOptions options;
  options.completion_queue = queue_;
  KVTIER_ASSIGN_OR_RETURN(TaskId id, manager_.evict_to_host_async(dev, host, options));
  bytes_d2h_ += moves.size() * space_.layout().total_block_bytes();
  pending_.emplace(id, std::move(p));
  return Status::Ok();
}

// Moves of a plan that were not submitted fail at the next poll(): a plan taken from the cache is always acked
// (unacked, its blocks stayed in flight for good: never matched, never evicted, reset() refused).
void TransferPlanExecutor::fail_unsubmitted(MoveKind kind, const std::vector<BlockMove>& moves, const Status& why) {
  if (moves.empty()) return;
  Completion c{kind, {}, why};
  for (const BlockMove& m : moves) c.dst.push_back(m.dst);
  unsubmitted_.push_back(std::move(c));
}

Status TransferPlanExecutor::execute(const StepPlan& plan) {
  Status st = submit_plan(plan);
  if (st.ok()) return st;
  // What was not submitted fails (the kinds are submitted in this order, each all or nothing).
  const std::pair<MoveKind, const std::vector<BlockMove>*> kinds[] = {
      {MoveKind::kEviction, &plan.evictions}, {MoveKind::kBackup, &plan.backups}, {MoveKind::kLoad, &plan.loads}};
  for (const auto& [kind, moves] : kinds)
    if (!submitted_.count(kind)) fail_unsubmitted(kind, *moves, st);
  fail_unsubmitted(MoveKind::kStorageWrite, plan.storage_writes, st);
  fail_unsubmitted(MoveKind::kStoragePrefetch, plan.storage_prefetches, st);
  return st;
}

Status TransferPlanExecutor::submit_plan(const StepPlan& plan) {
  submitted_.clear();
  if (!plan.storage_writes.empty() || !plan.storage_prefetches.empty())
    return InvalidArgument(fmt::format(
        "TransferPlanExecutor moves device<->host blocks only; plan has {} storage writes and {} prefetches "
        "(route them with CompositePlanExecutor)",
        plan.storage_writes.size(), plan.storage_prefetches.size()));
  if (!queue_) {
    // Completions of its own: the engine's poll_completions() on the same manager neither takes nor gets them.
    KVTIER_ASSIGN_OR_RETURN(queue_, manager_.open_completion_queue());
  }
  KVTIER_RETURN_IF_ERROR(submit_d2h(MoveKind::kEviction, plan.evictions));
  submitted_.insert(MoveKind::kEviction);
  KVTIER_RETURN_IF_ERROR(submit_d2h(MoveKind::kBackup, plan.backups));
  submitted_.insert(MoveKind::kBackup);
  if (!plan.loads.empty()) {
    std::vector<BlockId> dev, host;
    Pending p;
    p.kind = MoveKind::kLoad;
    for (const BlockMove& m : plan.loads) {
      host.push_back(m.src);
      dev.push_back(m.dst);
      p.ack.push_back(m.dst);
      p.device.push_back(m.dst);
      p.keys.push_back(m.key);
      holds_.erase(m.dst);  // overwritten by the load; known again once checked
    }
    LoadOptions options;
    options.completion_queue = queue_;
    KVTIER_ASSIGN_OR_RETURN(TaskId id, manager_.load_layers_to_device_async({}, host, dev, std::move(options)));
    bytes_h2d_ += plan.loads.size() * space_.layout().total_block_bytes();
    pending_.emplace(id, std::move(p));
  }
  submitted_.insert(MoveKind::kLoad);
  return Status::Ok();
}

void TransferPlanExecutor::check_loaded(const Pending& p) {
  const KvLayout& layout = space_.layout();
  const std::uint64_t block_bytes = layout.total_block_bytes();
  std::vector<std::byte> want(block_bytes), got(block_bytes);
  for (std::size_t i = 0; i < p.device.size(); ++i) {
    fill_key_pattern(p.keys[i], want.data(), block_bytes, options_.rank);
    std::uint64_t offset = 0;
    bool read_ok = true;
    for (std::uint32_t l = 0; l < layout.num_layers() && read_ok; ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint64_t n = layout.block_bytes(l, r);
        read_ok = device_.memcpy_sync(got.data() + offset, space_.block_ptr(l, r, p.device[i]), n).ok();
        if (!read_ok) break;
        offset += n;
      }
    ++verified_;
    if (read_ok && std::memcmp(want.data(), got.data(), block_bytes) == 0) {
      holds_[p.device[i]] = p.keys[i];
    } else {
      ++verification_failures_;
    }
  }
}

std::vector<Completion> TransferPlanExecutor::poll() {
  std::vector<Completion> out = std::move(unsubmitted_);
  unsubmitted_.clear();
  // No queue of its own yet (nothing submitted, or opening it failed): queue 0 is the manager's default one, the
  // engine's, whose completions this executor would have taken and dropped.
  if (queue_ == 0) return out;
  for (TaskCompletion& c : manager_.poll_completions(queue_)) {
    auto it = pending_.find(c.id);
    if (it == pending_.end()) continue;  // not submitted by this executor
    Pending& p = it->second;
    Status status = c.status;
    if (status.ok() && (!c.failed.device.empty() || !c.failed.host.empty()))
      status = DataLoss(fmt::format("transfer task {}: {} device and {} host blocks failed", c.id,
                                    c.failed.device.size(), c.failed.host.size()));
    if (!status.ok()) {
      ++failed_tasks_;
      if (p.kind == MoveKind::kLoad)
        for (BlockId b : p.device) holds_.erase(b);
    } else if (p.kind == MoveKind::kLoad && options_.model_prefill) {
      check_loaded(p);
    }
    out.push_back(Completion{p.kind, std::move(p.ack), std::move(status)});
    pending_.erase(it);
  }
  return out;
}

}  // namespace kvtier::cache
