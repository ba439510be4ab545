// Offline bounds of a replay that need no cache manager: MIN with bypass.
//
// MIN with bypass keeps, after every request, the `capacity` cacheable blocks
// (of those cached before and those the request used or computed) whose next
// use is nearest; a block never used again is dropped at once. Ties are broken
// deeper block first, so a block goes only after its descendants: every use of
// a block also uses its parent, hence a parent's next use is never later than
// a child's, and the kept set is always prefix-closed. Because it is
// prefix-closed, every kept block of a request is a prefix hit, so this is
// the optimum of the per-block hit count (Belady's MIN with bypass, optimal for
// unit-size blocks) and therefore an upper bound of any policy, online or not.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <queue>
#include <unordered_map>
#include <vector>

#include "kvtier/cache/replay.h"

namespace kvtier::cache {

Result<ReplayResult> replay_min_bypass(const std::vector<TraceRequest>& trace, std::uint32_t capacity_blocks,
                                       const ReplayOptions& o) {
  if (o.block_tokens == 0) return InvalidArgument("replay_min_bypass: block_tokens is 0");
  const auto t0 = std::chrono::steady_clock::now();
  KeyNamespace ns;
  ns.model_id = "mooncake-trace";
  ns.block_tokens = o.block_tokens;
  KVTIER_ASSIGN_OR_RETURN(KeyHasher hasher, KeyHasher::create(ns));

  // Dense ids per chained key, and per request the ids of its cacheable blocks.
  std::unordered_map<BlockKey, std::uint32_t, BlockKeyHash> id_of;
  std::vector<std::vector<std::uint32_t>> ids(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::size_t n = r.hash_ids.size();
    const std::size_t cacheable =
        o.cache_partial_blocks ? n
                               : static_cast<std::size_t>(std::min<std::uint64_t>(n, r.input_length / o.block_tokens));
    std::vector<BlockKey> keys = hasher.keys_for_ids(std::span<const std::uint64_t>(r.hash_ids.data(), cacheable));
    ids[i].reserve(keys.size());
    for (const BlockKey& k : keys) {
      auto [it, inserted] = id_of.emplace(k, static_cast<std::uint32_t>(id_of.size()));
      ids[i].push_back(it->second);
    }
  }
  // next[i][d]: the next request after i that holds block ids[i][d] (kNever: none).
  constexpr std::uint64_t kNever = UINT64_MAX;
  std::vector<std::vector<std::uint64_t>> next(trace.size());
  {
    std::vector<std::uint64_t> seen_at(id_of.size(), kNever);
    for (std::size_t i = trace.size(); i-- > 0;) {
      next[i].resize(ids[i].size());
      for (std::size_t d = 0; d < ids[i].size(); ++d) {
        next[i][d] = seen_at[ids[i][d]];
        seen_at[ids[i][d]] = i;
      }
    }
  }

  // Resident blocks: their next use; a max-heap on (next use, depth) with lazy deletion.
  struct Entry {
    std::uint64_t next_use;
    std::uint32_t depth;
    std::uint32_t id;
    bool operator<(const Entry& e) const { return next_use != e.next_use ? next_use < e.next_use : depth < e.depth; }
  };
  std::vector<std::uint64_t> resident(id_of.size(), kNever);  // kNever: not resident
  std::priority_queue<Entry> heap;
  std::size_t resident_count = 0;

  ReplayResult res;
  res.policy = "min-bypass";
  res.device_blocks = capacity_blocks;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    ++res.requests;
    res.total_blocks += r.hash_ids.size();
    res.cacheable_blocks += ids[i].size();
    res.total_tokens += r.input_length;
    std::uint32_t hits = 0;
    while (hits < ids[i].size() && resident[ids[i][hits]] != kNever) ++hits;
    res.device_hit_blocks += hits;
    res.device_hit_tokens += std::min<std::uint64_t>(std::uint64_t{hits} * o.block_tokens, r.input_length);
    for (std::size_t d = 0; d < ids[i].size(); ++d) {
      const std::uint32_t id = ids[i][d];
      const std::uint64_t nu = next[i][d];
      if (resident[id] == kNever && nu != kNever) ++resident_count;
      if (resident[id] != kNever && nu == kNever) --resident_count;  // bypass: never used again
      resident[id] = nu;
      if (nu != kNever) heap.push({nu, static_cast<std::uint32_t>(d), id});
    }
    while (resident_count > capacity_blocks) {
      Entry e = heap.top();
      heap.pop();
      if (resident[e.id] != e.next_use) continue;  // stale: reused since
      resident[e.id] = kNever;
      --resident_count;
    }
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace kvtier::cache
