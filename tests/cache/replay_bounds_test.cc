// MIN with bypass (replay_min_bypass) against an exhaustive optimum on small
// random prefix trees, against the Belady policy run through the cache
// manager (which keeps a request's blocks resident), and on the committed sample.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "kvtier/cache/replay.h"

namespace kvtier::cache {
namespace {

constexpr std::uint32_t kBlockTokens = 16;

// Requests are root-to-node paths of a random tree of `nodes` blocks (node 0 the root).
std::vector<TraceRequest> random_tree_trace(std::mt19937_64& rng, int nodes, int requests) {
  std::vector<int> parent(nodes, -1);
  for (int n = 1; n < nodes; ++n) parent[n] = static_cast<int>(rng() % n);
  std::vector<TraceRequest> trace;
  for (int i = 0; i < requests; ++i) {
    std::vector<std::uint64_t> path;
    for (int n = static_cast<int>(rng() % nodes); n >= 0; n = parent[n]) path.push_back(static_cast<std::uint64_t>(n));
    TraceRequest r;
    r.hash_ids.assign(path.rbegin(), path.rend());
    r.input_length = r.hash_ids.size() * kBlockTokens;
    r.timestamp_ms = static_cast<std::uint64_t>(i);
    trace.push_back(std::move(r));
  }
  return trace;
}

// The best total of prefix-hit blocks over every choice of the kept set (any subset, of at most
// `capacity` blocks, of the blocks cached before or used by the request) after every request.
std::uint64_t exhaustive_optimum(const std::vector<TraceRequest>& trace, std::uint32_t capacity) {
  std::map<std::pair<std::size_t, std::uint32_t>, std::uint64_t> memo;
  auto best = [&](auto&& self, std::size_t i, std::uint32_t cached) -> std::uint64_t {
    if (i == trace.size()) return 0;
    auto key = std::make_pair(i, cached);
    if (auto it = memo.find(key); it != memo.end()) return it->second;
    const auto& ids = trace[i].hash_ids;
    std::uint64_t hits = 0;
    while (hits < ids.size() && (cached >> ids[hits] & 1u)) ++hits;
    std::uint32_t pool = cached;
    for (std::uint64_t id : ids) pool |= 1u << id;
    std::uint64_t after = 0;
    for (std::uint32_t keep = pool;; keep = (keep - 1) & pool) {  // every subset of pool
      if (static_cast<std::uint32_t>(__builtin_popcount(keep)) <= capacity)
        after = std::max(after, self(self, i + 1, keep));
      if (keep == 0) break;
    }
    return memo[key] = hits + after;
  };
  return best(best, 0, 0);
}

TEST(MinBypass, EqualsTheExhaustiveOptimumOnRandomPrefixTrees) {
  std::mt19937_64 rng(7);
  ReplayOptions o;
  o.block_tokens = kBlockTokens;
  int bypass_beats_resident = 0;
  for (int round = 0; round < 60; ++round) {
    const int nodes = 3 + static_cast<int>(rng() % 6);
    const auto trace = random_tree_trace(rng, nodes, 4 + static_cast<int>(rng() % 5));
    for (std::uint32_t cap = 1; cap <= 4; ++cap) {
      auto r = replay_min_bypass(trace, cap, o);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ(r->hit_blocks(), exhaustive_optimum(trace, cap)) << "round " << round << " capacity " << cap;
      o.device_blocks = std::max<std::uint32_t>(cap, 8);  // the cache manager needs room for one request
      auto resident = replay_belady(trace, std::max<std::uint32_t>(cap, 8), o);
      ASSERT_TRUE(resident.ok()) << resident.status().to_string();
      auto big = replay_min_bypass(trace, std::max<std::uint32_t>(cap, 8), o);
      ASSERT_TRUE(big.ok());
      EXPECT_LE(resident->hit_blocks(), big->hit_blocks()) << "round " << round;
      bypass_beats_resident += big->hit_blocks() > resident->hit_blocks();
    }
  }
  SUCCEED() << bypass_beats_resident << " cases where bypass beats keeping the request resident";
}

// A block computed once and never used again must not displace one that returns: keeping the
// request's blocks resident until the next request (as the cache manager does) loses that hit.
TEST(MinBypass, BypassesABlockThatNeverReturns) {
  std::vector<TraceRequest> trace(3);
  trace[0].hash_ids = {1};
  trace[1].hash_ids = {2};  // never again
  trace[2].hash_ids = {1};
  for (auto& r : trace) r.input_length = r.hash_ids.size() * kBlockTokens;
  ReplayOptions o;
  o.block_tokens = kBlockTokens;
  auto r = replay_min_bypass(trace, 1, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->hit_blocks(), 1u);
  EXPECT_EQ(r->device_hit_tokens, kBlockTokens);
  EXPECT_EQ(r->total_blocks, 3u);
  o.device_blocks = 1;
  auto resident = replay_belady(trace, 1, o);
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  EXPECT_EQ(resident->hit_blocks(), 0u);
}

TEST(MinBypass, BoundsEveryPolicyOnTheSample) {
  auto trace = load_mooncake_trace(std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl", 1000);
  ASSERT_TRUE(trace.ok()) << trace.status().to_string();
  ReplayOptions o;
  o.device_blocks = 500;
  o.host_blocks = 0;
  auto bound = replay_min_bypass(*trace, 500, o);
  ASSERT_TRUE(bound.ok());
  auto resident = replay_belady(*trace, 500, o);
  ASSERT_TRUE(resident.ok());
  EXPECT_GE(bound->hit_ratio(), resident->hit_ratio());
  EXPECT_LE(bound->hit_ratio(), replay_unbounded(*trace, o).hit_ratio() + 1e-12);
  for (const char* p : {"lru", "s3fifo", "arc", "lrfu"}) {
    o.policy = p;
    auto r = replay_trace(*trace, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_LE(r->hit_ratio(), bound->hit_ratio() + 1e-12) << p;
  }
  ReplayOptions zero;
  zero.block_tokens = 0;
  EXPECT_EQ(replay_min_bypass(*trace, 500, zero).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::cache
