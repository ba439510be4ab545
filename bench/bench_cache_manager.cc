// CPU cost of the cache manager per block: match + admit (pin, allocate, evict) + plan + acks +
// commit + release, with >= 100k blocks indexed (device + host tiers full, write-back). The look-ahead
// case adds what an engine feeding its queue does per request: announce it `depth` requests ahead,
// withdraw it before admit, and every take_plan() prefetches for the queued ones.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kvtier/cache/cache_manager.h"

namespace kvtier::cache {
namespace {

constexpr std::uint32_t kDeviceBlocks = 32768;
constexpr std::uint32_t kHostBlocks = 98304;
constexpr std::uint32_t kBlocksPerRequest = 32;
constexpr std::size_t kRequests = 16384;

// Conversation-like requests: each shares a random prefix with a recent one, then fresh blocks.
std::vector<std::vector<BlockKey>> make_requests(std::uint64_t seed) {
  KeyNamespace ns;
  ns.model_id = "bench";
  ns.block_tokens = 64;
  KeyHasher h = *KeyHasher::create(ns);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::uint64_t>> ids;
  std::vector<std::vector<BlockKey>> out;
  std::uint64_t next_id = 1;
  for (std::size_t i = 0; i < kRequests; ++i) {
    std::vector<std::uint64_t> p;
    if (!ids.empty() && rng() % 4 != 0) {
      const auto& base = ids[ids.size() - 1 - rng() % std::min<std::size_t>(ids.size(), 256)];
      p.assign(base.begin(), base.begin() + rng() % kBlocksPerRequest);
    }
    while (p.size() < kBlocksPerRequest) p.push_back(next_id++);
    out.push_back(h.keys_for_ids(p));
    ids.push_back(std::move(p));
  }
  return out;
}

std::unique_ptr<CacheManager> make_filled(const std::string& policy, const std::vector<std::vector<BlockKey>>& warm) {
  CacheConfig cfg;
  cfg.device_blocks = kDeviceBlocks;
  cfg.host_blocks = kHostBlocks;
  cfg.device_policy = policy;
  cfg.host_policy = "lru";  // the host tier as the replay default; the device policy varies
  auto c = std::move(CacheManager::create(cfg)).value();
  for (const auto& keys : warm) {
    auto a = c->admit(keys);
    if (!a.ok()) continue;
    (void)c->ack_plan(c->take_plan(), Status::Ok());
    (void)c->commit_all(a->id);
    (void)c->release(a->id);
  }
  return c;
}

void BM_AdmitPlanCommit(benchmark::State& state, const std::string& policy) {
  static const auto warm = make_requests(1);
  static const auto reqs = make_requests(2);
  auto c = make_filled(policy, warm);
  std::size_t i = 0;
  std::uint64_t blocks = 0, hits = 0;
  for (auto _ : state) {
    const auto& keys = reqs[i++ % reqs.size()];
    auto a = c->admit(keys);
    if (!a.ok()) state.SkipWithError("admission failed");
    StepPlan plan = c->take_plan();
    benchmark::DoNotOptimize(plan);
    (void)c->ack_plan(plan, Status::Ok());
    (void)c->commit_all(a->id);
    (void)c->release(a->id);
    blocks += keys.size();
    hits += a->device_hit_blocks + a->host_hit_blocks;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(blocks));
  state.counters["ns_per_block"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["indexed_blocks"] = static_cast<double>(c->stats().nodes);
  state.counters["hit_fraction"] = blocks ? static_cast<double>(hits) / static_cast<double>(blocks) : 0;
}

void BM_AdmitPlanCommitLookahead(benchmark::State& state, const std::string& policy) {
  static const auto warm = make_requests(1);
  static const auto reqs = make_requests(2);
  const auto depth = static_cast<std::size_t>(state.range(0));
  auto c = make_filled(policy, warm);
  std::vector<QueuedId> queue(reqs.size(), 0);
  auto announce = [&](std::size_t j) {
    auto q = c->announce(reqs[j % reqs.size()]);
    if (!q.ok()) state.SkipWithError("announce failed");
    queue[j % reqs.size()] = *q;
  };
  for (std::size_t j = 0; j < depth; ++j) announce(j);
  std::size_t i = 0;
  std::uint64_t blocks = 0, hits = 0, device_hits = 0;
  for (auto _ : state) {
    const auto& keys = reqs[i % reqs.size()];
    announce(i + depth);
    if (!c->withdraw(queue[i % reqs.size()]).ok()) state.SkipWithError("withdraw failed");
    auto a = c->admit(keys);
    if (!a.ok()) state.SkipWithError("admission failed");
    StepPlan plan = c->take_plan();
    benchmark::DoNotOptimize(plan);
    (void)c->ack_plan(plan, Status::Ok());
    (void)c->commit_all(a->id);
    (void)c->release(a->id);
    blocks += keys.size();
    hits += a->device_hit_blocks + a->host_hit_blocks;
    device_hits += a->device_hit_blocks;
    ++i;
  }
  const CacheStats st = c->stats();
  state.SetItemsProcessed(static_cast<std::int64_t>(blocks));
  state.counters["ns_per_block"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["indexed_blocks"] = static_cast<double>(st.nodes);
  state.counters["hit_fraction"] = blocks ? static_cast<double>(hits) / static_cast<double>(blocks) : 0;
  state.counters["device_hit_fraction"] = blocks ? static_cast<double>(device_hits) / static_cast<double>(blocks) : 0;
  state.counters["protected_device"] = static_cast<double>(st.protected_blocks[0]);
}

// The look-ahead API alone on a full cache: announce one request's chain and withdraw the one announced
// `depth` requests earlier (every cached block of a chain is parked on announce, unparked on withdraw), plus
// one take_plan() with no budget (protection only) or the default budget, whose prefetches are acked.
void BM_AnnounceWithdraw(benchmark::State& state) {
  static const auto warm = make_requests(1);
  const auto depth = static_cast<std::size_t>(state.range(0));
  const bool prefetch = state.range(1) != 0;
  CacheConfig cfg;
  cfg.device_blocks = kDeviceBlocks;
  cfg.host_blocks = kHostBlocks;
  cfg.lookahead_prefetch_blocks = prefetch ? CacheConfig{}.lookahead_prefetch_blocks : 0;
  auto c = std::move(CacheManager::create(cfg)).value();
  for (const auto& keys : warm) {
    auto a = c->admit(keys);
    if (!a.ok()) continue;
    (void)c->ack_plan(c->take_plan(), Status::Ok());
    (void)c->commit_all(a->id);
    (void)c->release(a->id);
  }
  std::vector<QueuedId> queue(warm.size(), 0);
  std::size_t i = 0;
  std::uint64_t blocks = 0;
  for (auto _ : state) {
    // The warm requests, newest first: their blocks are the ones most likely cached.
    auto q = c->announce(warm[warm.size() - 1 - i % warm.size()]);
    if (!q.ok()) state.SkipWithError("announce failed");
    queue[i % warm.size()] = *q;
    if (i >= depth && !c->withdraw(queue[(i - depth) % warm.size()]).ok()) state.SkipWithError("withdraw failed");
    StepPlan plan = c->take_plan();
    (void)c->ack_plan(plan, Status::Ok());
    blocks += kBlocksPerRequest;
    ++i;
  }
  const CacheStats st = c->stats();
  state.SetItemsProcessed(static_cast<std::int64_t>(blocks));
  state.counters["ns_per_block"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["protected"] =
      static_cast<double>(st.protected_blocks[0] + st.protected_blocks[1] + st.protected_blocks[2]);
  state.counters["lookahead_loads"] = static_cast<double>(st.lookahead_loads);
}

void BM_MatchOnly(benchmark::State& state) {
  static const auto warm = make_requests(1);
  auto c = make_filled("lru", warm);
  std::size_t i = 0;
  std::uint64_t blocks = 0;
  for (auto _ : state) {
    const auto& keys = warm[(warm.size() - 1 - i++ % 4096)];
    MatchResult m = c->match(keys);
    benchmark::DoNotOptimize(m);
    blocks += keys.size();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(blocks));
  state.counters["ns_per_block"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["indexed_blocks"] = static_cast<double>(c->stats().nodes);
}

BENCHMARK_CAPTURE(BM_AdmitPlanCommit, lru, std::string("lru"));
BENCHMARK_CAPTURE(BM_AdmitPlanCommit, s3fifo, std::string("s3fifo"));
BENCHMARK_CAPTURE(BM_AdmitPlanCommit, arc, std::string("arc"));
BENCHMARK_CAPTURE(BM_AdmitPlanCommit, lrfu, std::string("lrfu"));
BENCHMARK_CAPTURE(BM_AdmitPlanCommit, adaptive, std::string("adaptive"));
BENCHMARK_CAPTURE(BM_AdmitPlanCommitLookahead, lru, std::string("lru"))->Arg(0)->Arg(64)->Arg(256);
BENCHMARK_CAPTURE(BM_AdmitPlanCommitLookahead, lrfu, std::string("lrfu"))->Arg(64)->Arg(256);
BENCHMARK_CAPTURE(BM_AdmitPlanCommitLookahead, adaptive, std::string("adaptive"))->Arg(64)->Arg(256);
BENCHMARK(BM_AnnounceWithdraw)->Args({64, 0})->Args({256, 0})->Args({256, 1});
BENCHMARK(BM_MatchOnly);

}  // namespace
}  // namespace kvtier::cache

BENCHMARK_MAIN();
