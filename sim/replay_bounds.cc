// Offline bounds of a replay that need no cache manager: MIN with bypass, and
// the class-TTL bound, in hindsight and cross-validated.
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
//
// The class-TTL bound (replay.h, replay_class_ttl) is bench/trace_bounds.py's
// class_ttl in C++, plus its cross-validated form. Per use of a block, its
// class is what an online policy can know then (uses so far, capped at 6, and
// the bit width of the distance since its last use, in requests), and its
// outcome is the distance to its next use. A policy gives each class a
// time-to-live: a use of class c kept for t requests costs min(t, distance)
// block-requests of residency and hits when distance <= t. Per class the
// (cost, hits) points over a geometric grid of TTLs form a curve; the upper
// concave hull of each curve, cut into segments ordered by hits per unit of
// cost, is the best order in which to lengthen the classes' TTLs, and spending
// a residency budget of capacity * requests along that order (the last segment
// in part: a mix of two TTLs) gives the most hits under that budget. The
// budget bounds the average occupancy, not the occupancy after every request,
// and hits are counted per block (prefix order ignored): both make the bound
// optimistic for such policies.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache/splitmix.h"
#include "sim/replay.h"

namespace kvtier::cache {
namespace {

// Dense ids per chained key, and per request the ids of its cacheable blocks.
struct ChainIds {
  std::vector<std::vector<std::uint32_t>> ids;
  std::size_t num_ids = 0;
};

Result<ChainIds> chain_ids(const std::vector<TraceRequest>& trace, const ReplayOptions& o, const char* who) {
  if (o.block_tokens == 0) return InvalidArgument(fmt::format("{}: block_tokens is 0", who));
  KeyNamespace ns;
  ns.model_id = "mooncake-trace";
  ns.block_tokens = o.block_tokens;
  KVTIER_ASSIGN_OR_RETURN(KeyHasher hasher, KeyHasher::create(ns));
  std::unordered_map<BlockKey, std::uint32_t, BlockKeyHash> id_of;
  ChainIds c;
  c.ids.resize(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::size_t n = r.hash_ids.size();
    const std::size_t cacheable =
        o.cache_partial_blocks ? n
                               : static_cast<std::size_t>(std::min<std::uint64_t>(n, r.input_length / o.block_tokens));
    std::vector<BlockKey> keys = hasher.keys_for_ids(std::span<const std::uint64_t>(r.hash_ids.data(), cacheable));
    c.ids[i].reserve(keys.size());
    for (const BlockKey& k : keys) {
      auto [it, inserted] = id_of.emplace(k, static_cast<std::uint32_t>(id_of.size()));
      c.ids[i].push_back(it->second);
    }
  }
  c.num_ids = id_of.size();
  return c;
}

constexpr std::uint64_t kNever = UINT64_MAX;

// next[i][d]: the next request after i that holds block ids[i][d] (kNever: none).
std::vector<std::vector<std::uint64_t>> next_uses(const ChainIds& c) {
  std::vector<std::vector<std::uint64_t>> next(c.ids.size());
  std::vector<std::uint64_t> seen_at(c.num_ids, kNever);
  for (std::size_t i = c.ids.size(); i-- > 0;) {
    next[i].resize(c.ids[i].size());
    for (std::size_t d = 0; d < c.ids[i].size(); ++d) {
      next[i][d] = seen_at[c.ids[i][d]];
      seen_at[c.ids[i][d]] = i;
    }
  }
  return next;
}

}  // namespace

Result<ReplayResult> replay_min_bypass(const std::vector<TraceRequest>& trace, std::uint32_t capacity_blocks,
                                       const ReplayOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(ChainIds chains, chain_ids(trace, o, "replay_min_bypass"));
  const std::vector<std::vector<std::uint32_t>>& ids = chains.ids;
  const std::vector<std::vector<std::uint64_t>> next = next_uses(chains);

  // Resident blocks: their next use; a max-heap on (next use, depth) with lazy deletion.
  struct Entry {
    std::uint64_t next_use;
    std::uint32_t depth;
    std::uint32_t id;
    bool operator<(const Entry& e) const { return next_use != e.next_use ? next_use < e.next_use : depth < e.depth; }
  };
  std::vector<std::uint64_t> resident(chains.num_ids, kNever);  // kNever: not resident
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

namespace {

// Classes of a use: uses so far (0..6, 6 meaning six or more) x bit width of the distance since the
// last use (0 for a first use), as bench/trace_bounds.py.
constexpr std::uint32_t kUseClasses = 7;
constexpr std::uint32_t kDistanceClasses = 65;
constexpr std::size_t kTtlClasses = std::size_t{kUseClasses} * kDistanceClasses;

// TTLs tried, in requests: 0 (not kept), floor(2^(k/8)) for k < 8 * bit_width(requests), and `requests`.
std::vector<std::uint64_t> ttl_grid(std::uint64_t requests) {
  std::vector<std::uint64_t> g;
  const int bits = std::bit_width(requests);
  for (int k = 0; k < 8 * bits; ++k) g.push_back(static_cast<std::uint64_t>(std::exp2(k / 8.0)));
  g.push_back(requests);
  g.push_back(0);
  std::sort(g.begin(), g.end());
  g.erase(std::unique(g.begin(), g.end()), g.end());
  return g;
}

// One class's residency (block-requests) and hits at each TTL of the grid; empty: the class has no use.
struct TtlCurve {
  std::vector<std::uint64_t> cost, hits;
};
using TtlCurves = std::vector<TtlCurve>;  // per class

// `dist[c]`: the distances to the next use of class c's uses (kNever: none); sorted in place.
TtlCurves make_ttl_curves(std::vector<std::vector<std::uint64_t>>& dist, const std::vector<std::uint64_t>& grid) {
  TtlCurves out(dist.size());
  for (std::size_t c = 0; c < dist.size(); ++c) {
    std::vector<std::uint64_t>& d = dist[c];
    if (d.empty()) continue;
    std::sort(d.begin(), d.end());
    out[c].cost.reserve(grid.size());
    out[c].hits.reserve(grid.size());
    std::size_t j = 0;
    std::uint64_t reached = 0;  // sum of the distances <= t: those uses hit, and cost their distance
    for (std::uint64_t t : grid) {
      while (j < d.size() && d[j] <= t) reached += d[j++];
      out[c].cost.push_back(reached + (d.size() - j) * t);
      out[c].hits.push_back(j);
    }
  }
  return out;
}

// One step of a class's TTL, from grid index `from` to `to`, worth `slope` hits per block-request.
struct TtlSegment {
  double slope;
  std::uint32_t cls;
  std::uint32_t from, to;
};

// The fitted policy: each class's upper concave hull of (cost, hits), cut into segments and ordered by
// slope (ties: class, then TTL), the order in which a budget is best spent on these curves.
std::vector<TtlSegment> fit_ttl_order(const TtlCurves& curves) {
  std::vector<TtlSegment> out;
  std::vector<std::uint32_t> hull;
  for (std::uint32_t c = 0; c < curves.size(); ++c) {
    const TtlCurve& k = curves[c];
    if (k.cost.empty()) continue;
    hull.assign(1, 0);
    for (std::uint32_t g = 1; g < k.cost.size(); ++g) {
      // Equal cost means no use outlives the shorter TTL: keep the shorter one.
      if (k.cost[g] <= k.cost[hull.back()]) continue;
      while (hull.size() >= 2) {
        const std::uint32_t a = hull[hull.size() - 2], b = hull.back();
        // Drop b when it lies on or under the chord from a to g (long double: exact for 64-bit products).
        const long double lhs = (static_cast<long double>(k.hits[b]) - static_cast<long double>(k.hits[a])) *
                                (static_cast<long double>(k.cost[g]) - static_cast<long double>(k.cost[a]));
        const long double rhs = (static_cast<long double>(k.hits[g]) - static_cast<long double>(k.hits[a])) *
                                (static_cast<long double>(k.cost[b]) - static_cast<long double>(k.cost[a]));
        if (lhs > rhs) break;
        hull.pop_back();
      }
      hull.push_back(g);
    }
    for (std::size_t i = 1; i < hull.size(); ++i) {
      const std::uint32_t a = hull[i - 1], b = hull[i];
      if (k.hits[b] > k.hits[a])
        out.push_back(
            {static_cast<double>(k.hits[b] - k.hits[a]) / static_cast<double>(k.cost[b] - k.cost[a]), c, a, b});
    }
  }
  std::sort(out.begin(), out.end(), [](const TtlSegment& x, const TtlSegment& y) {
    return std::tie(y.slope, x.cls, x.from) < std::tie(x.slope, y.cls, y.from);
  });
  return out;
}

// Hits on `on` of the policy `order`: its TTL steps taken in its order, each paid at `on`'s cost, until
// `budget` block-requests are spent (the last step in part).
double score_ttl_order(const std::vector<TtlSegment>& order, const TtlCurves& on, double budget) {
  double hits = 0;
  for (const TtlSegment& s : order) {
    if (budget <= 0) break;
    const TtlCurve& k = on[s.cls];
    if (k.cost.empty()) continue;
    const double dc = static_cast<double>(k.cost[s.to] - k.cost[s.from]);
    if (dc <= 0) continue;  // no use here outlives the shorter TTL: nothing to pay, nothing to gain
    const double take = std::min(1.0, budget / dc);
    hits += take * static_cast<double>(k.hits[s.to] - k.hits[s.from]);
    budget -= take * dc;
  }
  return hits;
}

std::vector<std::uint8_t> halves_of(const ChainIds& c) {
  constexpr std::uint64_t kNone = UINT64_MAX;
  const std::size_t n = c.ids.size();
  std::vector<std::uint64_t> introducer(c.num_ids, kNone), conversation(n);
  std::vector<std::uint8_t> continued(n, 0), half(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::vector<std::uint32_t>& ids = c.ids[i];
    std::size_t m = 0;
    while (m < ids.size() && introducer[ids[m]] != kNone) ++m;
    conversation[i] = i;
    if (m > 0) {
      const std::uint64_t j = introducer[ids[m - 1]];
      if (c.ids[j].size() == m && !continued[j]) {
        continued[j] = 1;
        conversation[i] = conversation[j];
      }
    }
    for (std::size_t d = m; d < ids.size(); ++d)
      if (introducer[ids[d]] == kNone) introducer[ids[d]] = i;
    std::uint64_t state = conversation[i];
    half[i] = static_cast<std::uint8_t>(splitmix64_next(state) & 1u);
  }
  return half;
}

}  // namespace

Result<std::vector<std::uint8_t>> conversation_halves(const std::vector<TraceRequest>& trace, const ReplayOptions& o) {
  KVTIER_ASSIGN_OR_RETURN(ChainIds chains, chain_ids(trace, o, "conversation_halves"));
  return halves_of(chains);
}

Result<std::vector<ClassTtlBound>> replay_class_ttl(const std::vector<TraceRequest>& trace,
                                                    std::span<const std::uint32_t> capacities, const ReplayOptions& o,
                                                    std::span<const std::uint8_t> halves) {
  for (std::size_t i = 0; i < capacities.size(); ++i)
    if (capacities[i] == 0)
      return InvalidArgument(fmt::format("replay_class_ttl: capacity 0 (entry {}) is not a block count >= 1", i));
  if (!halves.empty() && halves.size() != trace.size())
    return InvalidArgument(
        fmt::format("replay_class_ttl: {} halves given for {} requests", halves.size(), trace.size()));
  for (std::size_t i = 0; i < halves.size(); ++i)
    if (halves[i] > 1)
      return InvalidArgument(fmt::format("replay_class_ttl: half {} of request {} is not 0 or 1", halves[i], i));
  KVTIER_ASSIGN_OR_RETURN(ChainIds chains, chain_ids(trace, o, "replay_class_ttl"));
  std::vector<std::uint8_t> own;
  if (halves.empty()) {
    own = halves_of(chains);
    halves = own;
  }
  const std::vector<std::vector<std::uint64_t>> next = next_uses(chains);

  // Distances to the next use per class: of all uses ([2]) and of each half's ([0], [1]).
  std::vector<std::vector<std::uint64_t>> dist[3];
  for (auto& d : dist) d.resize(kTtlClasses);
  std::uint64_t uses[2] = {0, 0}, blocks[2] = {0, 0};
  std::vector<std::uint32_t> count(chains.num_ids, 0);
  std::vector<std::uint64_t> last(chains.num_ids, kNever);
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const int h = halves[i];
    blocks[h] += trace[i].hash_ids.size();
    uses[h] += chains.ids[i].size();
    for (std::size_t d = 0; d < chains.ids[i].size(); ++d) {
      const std::uint32_t id = chains.ids[i][d];
      const std::uint32_t u = std::min(count[id], kUseClasses - 1);
      const std::uint32_t w = last[id] == kNever ? 0 : static_cast<std::uint32_t>(std::bit_width(i - last[id]));
      const std::size_t cls = std::size_t{u} * kDistanceClasses + w;
      const std::uint64_t to_next = next[i][d] == kNever ? kNever : next[i][d] - i;
      dist[2][cls].push_back(to_next);
      dist[h][cls].push_back(to_next);
      count[id] = std::min<std::uint32_t>(count[id] + 1, kUseClasses);
      last[id] = i;
    }
  }
  const std::vector<std::uint64_t> grid = ttl_grid(trace.size());
  const TtlCurves all = make_ttl_curves(dist[2], grid);
  const TtlCurves part[2] = {make_ttl_curves(dist[0], grid), make_ttl_curves(dist[1], grid)};
  const std::vector<TtlSegment> fit_all = fit_ttl_order(all);
  const std::vector<TtlSegment> fit_part[2] = {fit_ttl_order(part[0]), fit_ttl_order(part[1])};
  const double total_blocks = static_cast<double>(blocks[0] + blocks[1]);
  const double total_uses = static_cast<double>(uses[0] + uses[1]);

  std::vector<ClassTtlBound> out;
  for (std::uint32_t cap : capacities) {
    ClassTtlBound b;
    b.capacity_blocks = cap;
    const double budget = static_cast<double>(cap) * static_cast<double>(trace.size());
    if (total_blocks > 0) b.hindsight = score_ttl_order(fit_all, all, budget) / total_blocks;
    double hits = 0;
    for (int h = 0; h < 2; ++h) {
      if (uses[h] == 0) continue;
      const double fold_hits =
          score_ttl_order(fit_part[1 - h], part[h], budget * static_cast<double>(uses[h]) / total_uses);
      hits += fold_hits;
      if (blocks[h] > 0) b.fold[h] = fold_hits / static_cast<double>(blocks[h]);
    }
    if (total_blocks > 0) b.cross_validated = hits / total_blocks;
    out.push_back(b);
  }
  return out;
}

}  // namespace kvtier::cache
