// P/D receives in the CacheManager (cache_manager.h, "P/D receives"): the
// blocks a prefill peer writes are never matched, committed, evicted or
// returned to the pool while a byte may still land in them; a completed
// receive indexes what landed; a failed one quarantines the rest until the
// peer is proven quiescent, and only then are those blocks reused.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/testing/plan_executors.h"
#include "tests/cache/cache_test_util.h"

namespace kvtier::cache {
namespace {

using testing::make_cache;
using testing::path;

std::vector<BlockId> receive_blocks(const Admission& a) {
  return {a.device_blocks.begin() + a.receive_begin, a.device_blocks.begin() + a.receive_begin + a.receive_blocks};
}

bool disjoint(const std::vector<BlockId>& a, const std::vector<BlockId>& b) {
  std::set<BlockId> s(a.begin(), a.end());
  return std::none_of(b.begin(), b.end(), [&](BlockId x) { return s.count(x) > 0; });
}

// A request computed and cached on device (admit, commit, release).
Admission cached_request(CacheManager& c, const std::vector<BlockKey>& keys) {
  auto a = c.admit(keys);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_TRUE(c.ack_plan(c.take_plan(), Status::Ok()).ok());
  EXPECT_TRUE(c.commit_all(a->id).ok());
  EXPECT_TRUE(c.release(a->id).ok());
  return *a;
}

TEST(CacheReceive, BlocksBeingReceivedAreNeverMatchedNorReportedLoaded) {
  auto c = make_cache(testing::config(8));
  const auto keys = path({1, 2, 3, 4});
  auto r = c->admit_receive(keys);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->receive_begin, 0u);
  EXPECT_EQ(r->receive_blocks, 4u);
  EXPECT_EQ(r->new_blocks, 4u);
  ASSERT_EQ(r->device_blocks.size(), 4u);
  EXPECT_INVARIANTS(*c);

  // Nothing of it is servable: no match, and another request for the same keys gets its own blocks.
  EXPECT_EQ(c->match(keys).total(), 0u);
  EXPECT_FALSE(c->match(keys).stopped_at_in_flight);
  // The engine must not report it loaded: commit of a receiving position is refused, naming it.
  Status st = c->commit(r->id, 1);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("being received"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("device block " + std::to_string(r->device_blocks[0])), std::string::npos)
      << st.to_string();
  EXPECT_EQ(c->commit_all(r->id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->match(keys).total(), 0u) << "a refused commit indexed a block being received";
  auto other = c->admit(keys);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->device_hit_blocks, 0u);
  EXPECT_TRUE(disjoint(receive_blocks(*r), other->device_blocks));
  ASSERT_TRUE(c->release(other->id).ok());

  auto status = c->admission_status(r->id);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->receiving_blocks, 4u);
  EXPECT_EQ(c->stats().receiving_device_blocks, 4u);

  // The peer's data verified: the receive joins the index and is served from the same blocks.
  ASSERT_TRUE(c->complete_receive(r->id, 4, /*reclaimable=*/true).ok());
  MatchResult m = c->match(keys);
  EXPECT_EQ(m.device_blocks, 4u);
  EXPECT_EQ(m.device_ids, r->device_blocks);
  EXPECT_EQ(c->complete_receive(r->id, 4, true).code(), StatusCode::kFailedPrecondition) << "completed twice";
  ASSERT_TRUE(c->release(r->id).ok());
  EXPECT_EQ(c->match(keys).device_blocks, 4u) << "a received block stays cached after release";
  const CacheStats s = c->stats();
  EXPECT_EQ(s.received_blocks, 4u);
  EXPECT_EQ(s.received_loaded_blocks, 4u);
  EXPECT_EQ(s.received_committed_blocks, 4u);
  EXPECT_EQ(s.quarantined_blocks, 0u);
  EXPECT_EQ(s.receiving_device_blocks, 0u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, BlocksBeingReceivedAreNeverEvictedUnderPressure) {
  auto c = make_cache(testing::config(8, 16));
  const auto cached_keys = path({1, 2, 3, 4});
  const Admission cached = cached_request(*c, cached_keys);
  auto r = c->admit_receive(path({10, 11, 12, 13}));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const std::vector<BlockId> receiving = receive_blocks(*r);
  EXPECT_EQ(c->stats().tiers[0].used, 8u);
  // Only the cached request is evictable: the receive's blocks are not counted...
  EXPECT_EQ(c->reclaimable_device_blocks(), 4u);

  // ... and pressure evicts the cached blocks, never the ones being received.
  auto b = c->admit(path({20, 21, 22, 23}));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  StepPlan plan = c->take_plan();
  ASSERT_EQ(plan.evictions.size(), 4u);
  for (const BlockMove& e : plan.evictions)
    EXPECT_EQ(std::count(receiving.begin(), receiving.end(), e.src), 0)
        << "eviction plan holds receiving block " << e.src;
  EXPECT_TRUE(disjoint(receiving, b->device_blocks));
  ASSERT_TRUE(c->ack_plan(plan, Status::Ok()).ok());
  EXPECT_EQ(c->match(cached_keys).host_blocks, 4u);

  // Nothing else can be taken: the receive's blocks are neither free nor evictable.
  auto more = c->admit(path({30}));
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted) << more.status().to_string();
  EXPECT_TRUE(c->take_plan().empty());
  // A request for the cached keys loads them from host only when device blocks can be had: not the receive's.
  auto reload = c->admit(cached_keys);
  EXPECT_EQ(reload.status().code(), StatusCode::kResourceExhausted);
  EXPECT_INVARIANTS(*c);

  ASSERT_TRUE(c->commit_all(b->id).ok());
  ASSERT_TRUE(c->release(b->id).ok());
  ASSERT_TRUE(c->complete_receive(r->id, 4, true).ok());
  ASSERT_TRUE(c->release(r->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, FailedReceiveIsQuarantinedUntilReclaimableThenReused) {
  auto c = make_cache(testing::config(8));
  const auto keys = path({1, 2, 3, 4, 5, 6});
  auto r = c->admit_receive(keys);
  ASSERT_TRUE(r.ok());
  const std::vector<BlockId> blocks = receive_blocks(*r);
  // The peer's leading two blocks verified; the transfer failed and its writes may still land (push mode,
  // the prefill not heard from): not reclaimable.
  ASSERT_TRUE(c->complete_receive(r->id, 2, /*reclaimable=*/false).ok());
  EXPECT_EQ(c->match(keys).device_blocks, 2u);
  auto status = c->admission_status(r->id);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->quarantined_blocks, 4u);
  EXPECT_EQ(status->receiving_blocks, 0u);
  // Recomputing into a quarantined block would race the late writes: refused.
  Status st = c->commit(r->id, 3);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("quarantined"), std::string::npos) << st.to_string();
  EXPECT_EQ(c->match(keys).device_blocks, 2u);
  ASSERT_TRUE(c->release(r->id).ok());
  EXPECT_INVARIANTS(*c);

  // Released, the four failed blocks stay out of the pool: 2 cached + 4 quarantined used.
  CacheStats s = c->stats();
  EXPECT_EQ(s.tiers[0].used, 6u);
  EXPECT_EQ(s.quarantined_device_blocks, 4u);
  EXPECT_EQ(s.quarantined_blocks, 4u);
  const std::vector<BlockId> quarantined(blocks.begin() + 2, blocks.end());
  // Memory pressure takes the free and the evictable blocks (4), never the quarantined ones...
  auto a = c->admit(path({40, 41, 42, 43}));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_TRUE(disjoint(quarantined, a->device_blocks));
  ASSERT_TRUE(c->ack_plan(c->take_plan(), Status::Ok()).ok());
  // ... and one more block cannot be had.
  EXPECT_EQ(c->admit(path({50})).status().code(), StatusCode::kResourceExhausted);
  // reset() would hand them to the next request: refused.
  ASSERT_TRUE(c->release(a->id).ok());
  Status reset = c->reset();
  EXPECT_EQ(reset.code(), StatusCode::kFailedPrecondition) << reset.to_string();
  EXPECT_NE(reset.message().find("quarantined"), std::string::npos);
  EXPECT_EQ(c->complete_receive(r->id, 6, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(*c);

  // The prefill is proven quiescent: the blocks return to the pool and are reused.
  ASSERT_TRUE(c->ack_receive_reclaimable(r->id).ok());
  EXPECT_EQ(c->ack_receive_reclaimable(r->id).code(), StatusCode::kNotFound);
  s = c->stats();
  EXPECT_EQ(s.quarantined_device_blocks, 0u);
  EXPECT_EQ(s.tiers[0].used, 0u) << "the cached blocks were dropped for the admission above";
  auto reuse = c->admit(path({60, 61, 62, 63, 64, 65}));
  ASSERT_TRUE(reuse.ok()) << reuse.status().to_string();
  EXPECT_FALSE(disjoint(quarantined, reuse->device_blocks)) << "the reclaimed blocks were not reused";
  ASSERT_TRUE(c->release(reuse->id).ok());
  EXPECT_TRUE(c->reset().ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, ReleaseWhileReceivingQuarantinesEveryReceiveBlock) {
  auto c = make_cache(testing::config(4));
  auto r = c->admit_receive(path({1, 2}), ReceiveOptions{.extra_blocks = 2, .received_extra_blocks = 1});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->receive_blocks, 3u) << "two keys and the received tail block";
  const std::vector<BlockId> blocks = receive_blocks(*r);
  const BlockId decode_space = r->device_blocks[3];
  // The request is aborted while the peer writes: its blocks cannot go back to the pool.
  ASSERT_TRUE(c->release(r->id).ok());
  CacheStats s = c->stats();
  EXPECT_EQ(s.tiers[0].used, 3u) << "only the decode-space block (never received into) returned";
  EXPECT_EQ(s.quarantined_device_blocks, 3u);
  EXPECT_EQ(s.receiving_device_blocks, 0u);
  EXPECT_INVARIANTS(*c);
  auto a = c->admit(path({7}));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->device_blocks[0], decode_space);
  EXPECT_EQ(c->admit(path({8})).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(c->release(a->id).ok());
  Status late = c->complete_receive(r->id, 3, true);
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.to_string();
  ASSERT_TRUE(c->ack_receive_reclaimable(r->id).ok());
  EXPECT_EQ(c->stats().tiers[0].used, 0u);
  auto all = c->admit(path({20, 21, 22, 23}));
  ASSERT_TRUE(all.ok());
  EXPECT_FALSE(disjoint(blocks, all->device_blocks));
  ASSERT_TRUE(c->release(all->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, ReclaimableFailureLeavesBlocksToRecompute) {
  auto c = make_cache(testing::config(8));
  const auto keys = path({1, 2, 3});
  auto r = c->admit_receive(keys);
  ASSERT_TRUE(r.ok());
  // One block landed; the connection is gone, so nothing else can land (reclaimable).
  ASSERT_TRUE(c->complete_receive(r->id, 1, /*reclaimable=*/true).ok());
  EXPECT_EQ(c->match(keys).device_blocks, 1u);
  auto status = c->admission_status(r->id);
  EXPECT_EQ(status->quarantined_blocks, 0u);
  EXPECT_EQ(c->ack_receive_reclaimable(r->id).code(), StatusCode::kFailedPrecondition);
  // The engine recomputes the rest into the same blocks and commits them.
  ASSERT_TRUE(c->commit_all(r->id).ok());
  MatchResult m = c->match(keys);
  EXPECT_EQ(m.device_blocks, 3u);
  EXPECT_EQ(m.device_ids, r->device_blocks);
  ASSERT_TRUE(c->release(r->id).ok());
  const CacheStats s = c->stats();
  EXPECT_EQ(s.received_loaded_blocks, 1u);
  EXPECT_EQ(s.received_committed_blocks, 1u);
  EXPECT_EQ(s.quarantined_blocks, 0u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, MatchPrefixReceivesOnlyTheRest) {
  auto c = make_cache(testing::config(8));
  cached_request(*c, path({1, 2}));
  const auto keys = path({1, 2, 3, 4});
  auto r = c->admit_receive(keys, ReceiveOptions{.match_prefix = true});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->device_hit_blocks, 2u);
  EXPECT_EQ(r->receive_begin, 2u);
  EXPECT_EQ(r->receive_blocks, 2u);
  EXPECT_EQ(c->match(keys).device_blocks, 2u);
  // The served prefix may be committed (it is), the received rest not.
  EXPECT_TRUE(c->commit(r->id, 2).ok());
  EXPECT_EQ(c->commit(r->id, 3).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->complete_receive(r->id, 2, true).ok());
  EXPECT_EQ(c->match(keys).device_blocks, 4u);
  ASSERT_TRUE(c->release(r->id).ok());
  // Without match_prefix every key is received, and a key another request indexed meanwhile keeps its copy.
  auto whole = c->admit_receive(keys);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->device_hit_blocks, 0u);
  EXPECT_EQ(whole->receive_blocks, 4u);
  ASSERT_TRUE(c->complete_receive(whole->id, 4, true).ok());
  ASSERT_TRUE(c->release(whole->id).ok());
  EXPECT_EQ(c->match(keys).device_blocks, 4u);
  EXPECT_EQ(c->stats().tiers[0].used, 4u) << "the duplicate received copies were freed";
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, BadArgumentsNameTheValue) {
  auto c = make_cache(testing::config(8));
  auto bad = c->admit_receive(path({1}), ReceiveOptions{.extra_blocks = 1, .received_extra_blocks = 2});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("received_extra_blocks 2"), std::string::npos) << bad.status().to_string();
  auto r = c->admit_receive(path({1, 2}));
  ASSERT_TRUE(r.ok());
  Status over = c->complete_receive(r->id, 3, true);
  EXPECT_EQ(over.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("loaded_blocks 3"), std::string::npos) << over.to_string();
  EXPECT_EQ(c->complete_receive(r->id + 100, 1, true).code(), StatusCode::kNotFound);
  EXPECT_EQ(c->ack_receive_reclaimable(r->id).code(), StatusCode::kFailedPrecondition) << "still receiving";
  auto plain = c->admit(path({5}));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->receive_blocks, 0u);
  EXPECT_EQ(c->complete_receive(plain->id, 0, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->ack_receive_reclaimable(plain->id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->reset().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->release(plain->id).ok());
  ASSERT_TRUE(c->release(r->id).ok());
  EXPECT_EQ(c->stats().quarantined_device_blocks, 2u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheReceive, CountersAndMetrics) {
  metrics::Registry reg;
  auto c = make_cache(testing::config(8));
  ASSERT_TRUE(c->attach_metrics(reg, {{"engine", "d0"}}).ok());
  auto ok = c->admit_receive(path({1, 2}));
  auto failed = c->admit_receive(path({5, 6, 7}));
  ASSERT_TRUE(ok.ok() && failed.ok());
  ASSERT_TRUE(c->complete_receive(ok->id, 2, true).ok());
  ASSERT_TRUE(c->complete_receive(failed->id, 1, false).ok());
  std::string text = reg.expose();
  auto has = [&](const std::string& line) { return text.find(line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("kvtier_cache_receive_blocks_total{engine=\"d0\",outcome=\"admitted\"} 5")) << text;
  EXPECT_TRUE(has("kvtier_cache_receive_blocks_total{engine=\"d0\",outcome=\"loaded\"} 3")) << text;
  EXPECT_TRUE(has("kvtier_cache_receive_blocks_total{engine=\"d0\",outcome=\"committed\"} 3")) << text;
  EXPECT_TRUE(has("kvtier_cache_receive_blocks_total{engine=\"d0\",outcome=\"quarantined\"} 2")) << text;
  EXPECT_TRUE(has("kvtier_cache_quarantined_blocks{engine=\"d0\"} 2")) << text;
  EXPECT_TRUE(has("kvtier_cache_receiving_blocks{engine=\"d0\"} 0")) << text;
  ASSERT_TRUE(c->release(ok->id).ok());
  ASSERT_TRUE(c->release(failed->id).ok());
  ASSERT_TRUE(c->ack_receive_reclaimable(failed->id).ok());
  text = reg.expose();
  EXPECT_TRUE(has("kvtier_cache_quarantined_blocks{engine=\"d0\"} 0")) << text;
  EXPECT_INVARIANTS(*c);
}

// Random sequences of admissions, receives, commits, completions, releases, acknowledgements and plans (with
// delayed and failing moves): after every step the invariants hold, no match serves a block a peer is writing
// or may still write, no admission is given one and no plan moves one; at the end every block comes back.
class CacheReceiveProperty : public ::testing::TestWithParam<int> {};

TEST_P(CacheReceiveProperty, GuardedBlocksAreNeverServedMovedOrReused) {
  const int variant = GetParam();
  const bool host = variant % 4 != 3;
  CacheConfig cfg = testing::config(16 + variant % 3 * 8, host ? 24 : 0, host && variant % 2 ? 48 : 0);
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu", "adaptive"};
  cfg.device_policy = policies[variant % 4];
  cfg.write_policy = static_cast<WritePolicy>(variant % 3);
  if (variant % 5 == 1) cfg.device_watermarks = {0.1, 0.3};
  auto c = make_cache(cfg);
  FakePlanExecutor::Options eo;
  eo.failure_rate = variant % 3 == 0 ? 0.0 : 0.1;
  eo.delay_polls = static_cast<std::uint32_t>(variant % 3);
  eo.seed = 77 + static_cast<std::uint64_t>(variant);
  FakePlanExecutor ex(eo);
  std::mt19937_64 rng(9000 + static_cast<std::uint64_t>(variant));
  auto hasher = testing::test_hasher();
  std::vector<std::vector<BlockKey>> keys;
  std::vector<std::vector<std::uint64_t>> paths;
  for (int i = 0; i < 30; ++i) {
    std::vector<std::uint64_t> p;
    if (!paths.empty() && rng() % 2) {
      const auto& base = paths[rng() % paths.size()];
      p.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(rng() % (base.size() + 1)));
    }
    const std::size_t len = p.size() + 1 + rng() % 4;
    while (p.size() < len) p.push_back(1000 + rng() % 100000);
    paths.push_back(p);
    keys.push_back(hasher.keys_for_ids(p));
  }
  struct Live {
    std::size_t path = 0;
    std::uint32_t receive_begin = 0;
    std::uint32_t committed = 0;       // key positions committed (hits count)
    std::uint32_t guard = 0;           // first guarded position while receiving or quarantined
    bool receive_open = false;         // admit_receive, not completed yet
    std::vector<BlockId> receiving;    // before complete_receive
    std::vector<BlockId> quarantined;  // failed, not reclaimable
  };
  std::map<AdmissionId, Live> live;
  std::map<AdmissionId, std::vector<BlockId>> released_quarantine;
  auto guarded = [&] {
    std::set<BlockId> g;
    for (const auto& [id, l] : live) {
      g.insert(l.receiving.begin(), l.receiving.end());
      g.insert(l.quarantined.begin(), l.quarantined.end());
    }
    for (const auto& [id, q] : released_quarantine) g.insert(q.begin(), q.end());
    return g;
  };
  // Plans are taken after every operation and checked against the blocks guarded before and after it (an
  // admission may be given a block that an eviction it queued gives up: the executor orders that eviction
  // first, and the TransferManager's begin_external_write waits for it); they run at the next pump.
  StepPlan pending;
  auto take = [&](const std::set<BlockId>& before) {
    StepPlan p = c->take_plan();
    for (const BlockMove& m : p.evictions) ASSERT_EQ(before.count(m.src), 0u) << "eviction of guarded block " << m.src;
    for (const BlockMove& m : p.backups) ASSERT_EQ(before.count(m.src), 0u) << "backup of guarded block " << m.src;
    for (const BlockMove& m : p.loads) ASSERT_EQ(before.count(m.dst), 0u) << "load into guarded block " << m.dst;
    auto append = [](std::vector<BlockMove>& to, const std::vector<BlockMove>& from) {
      to.insert(to.end(), from.begin(), from.end());
    };
    append(pending.evictions, p.evictions);
    append(pending.backups, p.backups);
    append(pending.loads, p.loads);
    append(pending.storage_writes, p.storage_writes);
    append(pending.storage_prefetches, p.storage_prefetches);
  };
  auto pump = [&] {
    take(guarded());
    ASSERT_TRUE(ex.execute(pending).ok());
    pending = StepPlan{};
    ASSERT_TRUE(apply_completions(*c, ex.poll()).ok());
  };
  std::uint64_t receives = 0, quarantines = 0;
  for (int step = 0; step < 1500; ++step) {
    const int op = static_cast<int>(rng() % 12);
    const std::set<BlockId> g = guarded();
    if (op < 4) {  // admit or admit_receive
      const std::size_t pi = rng() % keys.size();
      const bool receive = op < 2;
      ReceiveOptions o;
      o.extra_blocks = static_cast<std::uint32_t>(rng() % 2);
      o.received_extra_blocks = o.extra_blocks > 0 ? static_cast<std::uint32_t>(rng() % 2) : 0;
      o.match_prefix = rng() % 2;
      auto a = receive ? c->admit_receive(keys[pi], o) : c->admit(keys[pi], o.extra_blocks);
      if (!a.ok()) {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().to_string();
      } else {
        for (std::size_t i = a->device_hit_blocks; i < a->device_blocks.size(); ++i)
          ASSERT_EQ(g.count(a->device_blocks[i]), 0u)
              << "step " << step << ": admission got guarded block " << a->device_blocks[i];
        Live l;
        l.path = pi;
        l.receive_begin = a->receive_begin;
        l.committed = a->device_hit_blocks + a->host_hit_blocks;
        l.guard = a->receive_begin;
        l.receiving = receive_blocks(*a);
        l.receive_open = receive;
        ASSERT_EQ(l.receiving.size(), receive ? keys[pi].size() - a->receive_begin + o.received_extra_blocks : 0u);
        receives += receive;
        live[a->id] = l;
      }
    } else if (op < 6 && !live.empty()) {  // commit: refused while a guarded position is below n
      auto it = live.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
      const auto n = static_cast<std::uint32_t>(rng() % (keys[it->second.path].size() + 1));
      Status st = c->commit(it->first, n);
      const Live& l = it->second;
      const bool has_guard = !l.receiving.empty() || !l.quarantined.empty();
      const bool guarded_below = has_guard && n > std::max(l.committed, l.guard);
      if (guarded_below) {
        ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << "step " << step << ": " << st.to_string();
      } else if (st.ok()) {
        it->second.committed = std::max(it->second.committed, n);
      } else {
        ASSERT_TRUE(testing::committed_or_loading(*c, it->first, st)) << "step " << step << ": " << st.to_string();
      }
    } else if (op < 8 && !live.empty()) {  // complete a receive
      auto it = live.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
      Live& l = it->second;
      const auto loaded = static_cast<std::uint32_t>(rng() % (l.receiving.size() + 1));
      const bool reclaimable = rng() % 3 != 0;
      Status st = c->complete_receive(it->first, loaded, reclaimable);
      if (!l.receive_open) {
        ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
      } else {
        l.receive_open = false;
        ASSERT_TRUE(st.ok()) << st.to_string();
        l.committed = std::max(l.committed, std::min<std::uint32_t>(l.receive_begin + loaded,
                                                                    static_cast<std::uint32_t>(keys[l.path].size())));
        if (!reclaimable && loaded < l.receiving.size()) {
          l.quarantined.assign(l.receiving.begin() + loaded, l.receiving.end());
          l.guard = l.receive_begin + loaded;
          ++quarantines;
        }
        l.receiving.clear();
      }
    } else if (op < 10 && !live.empty()) {  // release (an aborted receive is quarantined)
      auto it = live.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
      ASSERT_TRUE(c->release(it->first).ok());
      std::vector<BlockId> held = it->second.receiving;
      held.insert(held.end(), it->second.quarantined.begin(), it->second.quarantined.end());
      if (!held.empty()) released_quarantine[it->first] = held;
      live.erase(it);
    } else if (op == 10) {  // the peer is proven quiescent
      if (!released_quarantine.empty() && rng() % 2) {
        auto it = released_quarantine.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % released_quarantine.size()));
        ASSERT_TRUE(c->ack_receive_reclaimable(it->first).ok());
        released_quarantine.erase(it);
      } else {
        for (auto& [id, l] : live)
          if (!l.quarantined.empty()) {
            ASSERT_TRUE(c->ack_receive_reclaimable(id).ok());
            l.quarantined.clear();
            break;
          }
      }
    } else {
      pump();
    }
    {
      // Blocks guarded before and after the operation: an operation may move a block it released from the
      // guard (received blocks it committed, backed up at once under write-through).
      std::set<BlockId> both;
      const std::set<BlockId> after = guarded();
      std::set_intersection(g.begin(), g.end(), after.begin(), after.end(), std::inserter(both, both.begin()));
      take(both);
    }
    if (::testing::Test::HasFatalFailure()) return;
    Status inv = c->check_invariants();
    ASSERT_TRUE(inv.ok()) << "step " << step << " op " << op << ": " << inv.to_string();
    const std::set<BlockId> now = guarded();
    for (const auto& k : keys)
      for (BlockId b : c->match(k).device_ids) ASSERT_EQ(now.count(b), 0u) << "step " << step << ": match serves " << b;
    std::uint32_t q = 0;
    for (const auto& [id, l] : live) q += static_cast<std::uint32_t>(l.quarantined.size());
    for (const auto& [id, held] : released_quarantine) q += static_cast<std::uint32_t>(held.size());
    ASSERT_EQ(c->stats().quarantined_device_blocks, q) << "step " << step;
  }
  EXPECT_GT(receives, 10u);
  EXPECT_GT(quarantines, 0u);
  // Drain: every admission released, every quarantine acknowledged, every move done: all blocks come back.
  for (auto& [id, l] : live) {
    ASSERT_TRUE(c->release(id).ok());
    std::vector<BlockId> held = l.receiving;
    held.insert(held.end(), l.quarantined.begin(), l.quarantined.end());
    if (!held.empty()) released_quarantine[id] = held;
  }
  live.clear();
  for (int i = 0; i < 8; ++i) pump();
  EXPECT_EQ(c->reset().code(), released_quarantine.empty() ? StatusCode::kOk : StatusCode::kFailedPrecondition);
  for (auto& [id, held] : released_quarantine) ASSERT_TRUE(c->ack_receive_reclaimable(id).ok());
  released_quarantine.clear();
  for (int i = 0; i < 8; ++i) pump();
  ASSERT_TRUE(c->check_invariants().ok());
  if (cfg.storage_blocks == 0) {
    auto all = c->admit({}, cfg.device_blocks);
    ASSERT_TRUE(all.ok()) << all.status().to_string() << " (quarantined blocks leaked?)";
    ASSERT_TRUE(c->release(all->id).ok());
  }
  EXPECT_EQ(c->stats().quarantined_device_blocks, 0u);
}

INSTANTIATE_TEST_SUITE_P(Variants, CacheReceiveProperty, ::testing::Range(0, 16));

}  // namespace
}  // namespace kvtier::cache
