// Random operation sequences against the CacheManager's invariants:
// tier-ordered paths, no orphaned subtrees, balanced references, no in-flight block served.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/testing/plan_executors.h"
#include "tests/cache/cache_test_util.h"

namespace kvtier::cache {
namespace {

struct Scenario {
  CacheConfig cfg;
  double failure_rate;
  std::uint32_t delay_polls;
  std::uint64_t seed;
};

// Pending destination blocks per move kind, mirrored from the plans handed to the executor.
struct InFlight {
  std::multiset<BlockId> device;  // load targets
  std::multiset<BlockId> host;    // eviction/backup/prefetch targets
  void add(const StepPlan& p) {
    for (auto& m : p.loads) device.insert(m.dst);
    for (auto& m : p.evictions) host.insert(m.dst);
    for (auto& m : p.backups) host.insert(m.dst);
    for (auto& m : p.storage_prefetches) host.insert(m.dst);
  }
  void done(const Completion& c) {
    for (BlockId b : c.dst) {
      auto& set = c.kind == MoveKind::kLoad ? device : host;
      if (c.kind == MoveKind::kStorageWrite) continue;
      auto it = set.find(b);
      if (it != set.end()) set.erase(it);
    }
  }
};

void run_scenario(const Scenario& sc, int steps) {
  auto c = testing::make_cache(sc.cfg);
  FakePlanExecutor::Options eo;
  eo.failure_rate = sc.failure_rate;
  eo.delay_polls = sc.delay_polls;
  eo.seed = sc.seed;
  FakePlanExecutor ex(eo);
  InFlight inflight;
  std::mt19937_64 rng(sc.seed);
  // Requests are paths in a random tree of ids: shared prefixes, branching.
  std::vector<std::vector<std::uint64_t>> paths;
  for (int i = 0; i < 40; ++i) {
    std::vector<std::uint64_t> p;
    if (!paths.empty() && rng() % 3) {
      const auto& base = paths[rng() % paths.size()];
      p.assign(base.begin(), base.begin() + rng() % (base.size() + 1));
    }
    std::size_t len = p.size() + 1 + rng() % 5;
    while (p.size() < len) p.push_back(1000 + rng() % 100000);
    paths.push_back(p);
  }
  auto hasher = testing::test_hasher();
  std::vector<std::vector<BlockKey>> keys;
  for (auto& p : paths) keys.push_back(hasher.keys_for_ids(p));
  std::map<AdmissionId, std::size_t> live;
  std::string last_plan;  // admission -> path index
  std::uint64_t admitted = 0, failed_admissions = 0;

  auto pump = [&] {
    StepPlan p = c->take_plan();
    last_plan = fmt::format("plan: {} ev {} bu {} ld {} sw {} sp", p.evictions.size(), p.backups.size(), p.loads.size(),
                            p.storage_writes.size(), p.storage_prefetches.size());
    inflight.add(p);
    ASSERT_TRUE(ex.execute(p).ok());
    auto done = ex.poll();
    for (auto& d : done) inflight.done(d);
    ASSERT_TRUE(apply_completions(*c, done).ok());
  };

  for (int step = 0; step < steps; ++step) {
    int op = static_cast<int>(rng() % 10);
    std::string what = fmt::format("op {}", op);
    if (op < 4) {  // admit
      std::size_t pi = rng() % keys.size();
      const auto extra = static_cast<std::uint32_t>(rng() % 2);
      const MatchResult before_match = c->match(keys[pi]);
      const CacheStats before = c->stats();
      std::vector<MatchResult> before_all;
      for (const auto& k : keys) before_all.push_back(c->match(k));
      auto a = c->admit(keys[pi], extra);
      if (a.ok()) {
        live[a->id] = pi;
        ++admitted;
        ASSERT_EQ(a->device_blocks.size(), keys[pi].size() + a->extra_blocks);
      } else {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().to_string();
        ++failed_admissions;
        // Only when nothing more is evictable by the policy-independent definition (settled,
        // unpinned, nothing pinned or in flight below), counting the request's own device hits,
        // which the admission pins. The documented exception: evictable blocks that must move to
        // a host tier with no block now (all pinned or in flight, or, write-back with a storage
        // tier, being written to storage).
        const CacheStats after = c->stats();
        const std::uint64_t need = keys[pi].size() - before_match.device_blocks + extra;
        const std::uint64_t free_now = before.tiers[0].capacity - before.tiers[0].used;
        const bool write_back_down =
            sc.cfg.write_policy == WritePolicy::kWriteBack && sc.cfg.storage_blocks > 0 && sc.cfg.host_blocks > 0;
        const bool host_short =
            write_back_down || (before.tiers[1].capacity > 0 && before.tiers[1].used == before.tiers[1].capacity);
        if (!host_short) {
          const std::uint64_t reclaimable = c->reclaimable_device_blocks();
          ASSERT_LT(free_now + reclaimable, need + before_match.device_blocks)
              << "step " << step << ": " << a.status().to_string() << " while " << reclaimable
              << " device blocks are evictable (policy " << sc.cfg.device_policy << ")";
          // And then it changed nothing.
          ASSERT_EQ(after.tiers[0].used, before.tiers[0].used) << "step " << step;
          ASSERT_EQ(after.tiers[1].used, before.tiers[1].used) << "step " << step;
          ASSERT_EQ(after.evictions_d2h + after.drops_device + after.drops_host + after.storage_writes,
                    before.evictions_d2h + before.drops_device + before.drops_host + before.storage_writes)
              << "step " << step;
          for (std::size_t k = 0; k < keys.size(); ++k) {
            const MatchResult m = c->match(keys[k]);
            ASSERT_EQ(m.device_ids, before_all[k].device_ids) << "step " << step << " path " << k;
            ASSERT_EQ(m.host_ids, before_all[k].host_ids) << "step " << step << " path " << k;
            ASSERT_EQ(m.storage_ids, before_all[k].storage_ids) << "step " << step << " path " << k;
          }
        }
      }
    } else if (op < 6 && !live.empty()) {  // commit some or all
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      auto n = static_cast<std::uint32_t>(rng() % (keys[it->second].size() + 1));
      ASSERT_TRUE(c->commit(it->first, n).ok());
    } else if (op < 8 && !live.empty()) {  // release
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(c->release(it->first).ok());
      live.erase(it);
    } else if (op == 8) {
      auto r = c->prefetch(keys[rng() % keys.size()]);
      ASSERT_TRUE(r.ok());
    } else {
      pump();
      what += " " + last_plan;
    }
    if (::testing::Test::HasFatalFailure()) return;
    Status inv = c->check_invariants();
    ASSERT_TRUE(inv.ok()) << "step " << step << " (" << what << "): " << inv.to_string();
    // No match may serve a block whose transfer is still in flight.
    for (const auto& k : keys) {
      MatchResult m = c->match(k);
      ASSERT_EQ(m.device_ids.size() + m.host_ids.size() + m.storage_ids.size(), m.total());
      for (BlockId b : m.device_ids) ASSERT_EQ(inflight.device.count(b), 0u) << "device block " << b << " in flight";
      for (BlockId b : m.host_ids) ASSERT_EQ(inflight.host.count(b), 0u) << "host block " << b << " in flight";
    }
  }
  // Drain: release everything, finish every transfer: every reference and block comes back.
  for (auto& [id, pi] : live) ASSERT_TRUE(c->release(id).ok());
  for (int i = 0; i < 8 + static_cast<int>(sc.delay_polls); ++i) pump();
  ASSERT_TRUE(c->check_invariants().ok());
  EXPECT_EQ(ex.in_flight(), 0u);
  EXPECT_GT(admitted, 0u);
  CacheStats s = c->stats();
  // With nothing pinned, the whole device tier can be reclaimed (with a storage tier, host space may
  // wait on demotions, so only without one).
  if (sc.cfg.storage_blocks == 0) {
    auto big = c->admit({}, sc.cfg.device_blocks);
    ASSERT_TRUE(big.ok()) << big.status().to_string() << " (references leaked?)";
    ASSERT_TRUE(c->release(big->id).ok());
    pump();
  }
  EXPECT_TRUE(c->check_invariants().ok());
  (void)s;
}

class CacheProperty : public ::testing::TestWithParam<int> {};

TEST_P(CacheProperty, RandomOperationSequencesKeepInvariants) {
  const int variant = GetParam();
  Scenario sc;
  sc.seed = 1000 + variant;
  sc.cfg.device_blocks = 12 + variant % 3 * 8;
  sc.cfg.host_blocks = variant % 4 == 3 ? 0 : 16 + variant % 5 * 8;
  sc.cfg.storage_blocks = variant % 2 ? 64 : 0;
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu"};
  sc.cfg.device_policy = policies[variant % 4];
  sc.cfg.host_policy = policies[(variant + 1) % 4];
  sc.cfg.write_policy = static_cast<WritePolicy>(variant % 3);
  sc.cfg.write_through_threshold = 1 + variant % 2;
  if (variant % 2) sc.cfg.host_watermarks = {0.25, 0.5};
  if (variant % 5 == 1) sc.cfg.device_watermarks = {0.1, 0.3};
  sc.failure_rate = variant % 3 == 0 ? 0.0 : 0.1;
  sc.delay_polls = variant % 4;
  run_scenario(sc, 2000);
}

INSTANTIATE_TEST_SUITE_P(Variants, CacheProperty, ::testing::Range(0, 48));

// Write-back with a storage tier and no host watermarks: every host block given up under pressure
// goes through a demotion (or a failed one), with delayed and failing moves; small storage tiers
// run out of slots too.
class CachePropertyWriteBackPressure : public ::testing::TestWithParam<int> {};

TEST_P(CachePropertyWriteBackPressure, RandomOperationSequencesKeepInvariants) {
  const int variant = GetParam();
  Scenario sc;
  sc.seed = 5000 + variant;
  sc.cfg.device_blocks = 12 + variant % 3 * 8;
  sc.cfg.host_blocks = 8 + variant % 4 * 8;
  sc.cfg.storage_blocks = variant % 5 == 4 ? 12 : 64;
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu"};
  sc.cfg.device_policy = policies[variant % 4];
  sc.cfg.host_policy = policies[(variant / 4) % 4];
  sc.cfg.write_policy = WritePolicy::kWriteBack;
  if (variant % 5 == 1) sc.cfg.device_watermarks = {0.1, 0.3};
  sc.failure_rate = variant % 3 == 0 ? 0.0 : 0.1;
  sc.delay_polls = variant % 4;
  run_scenario(sc, 2000);
}

INSTANTIATE_TEST_SUITE_P(Variants, CachePropertyWriteBackPressure, ::testing::Range(0, 16));

// SIEVE in every tier under the same random sequences: its hand passes over what the manager may not take
// (pinned, parents in the tier, in flight) and keeps its place across calls; an admission still fails only
// when nothing is evictable.
class CachePropertySieve : public ::testing::TestWithParam<int> {};

TEST_P(CachePropertySieve, RandomOperationSequencesKeepInvariants) {
  const int variant = GetParam();
  Scenario sc;
  sc.seed = 7000 + variant;
  sc.cfg.device_blocks = 12 + variant % 3 * 8;
  sc.cfg.host_blocks = variant % 4 == 3 ? 0 : 16 + variant % 5 * 8;
  sc.cfg.storage_blocks = variant % 2 ? 64 : 0;
  sc.cfg.device_policy = "sieve";
  sc.cfg.host_policy = variant % 3 == 0 ? "lru" : "sieve";
  sc.cfg.storage_policy = variant % 2 ? "sieve" : "lru";
  sc.cfg.write_policy = static_cast<WritePolicy>(variant % 3);
  sc.cfg.write_through_threshold = 1 + variant % 2;
  if (variant % 2) sc.cfg.host_watermarks = {0.25, 0.5};
  if (variant % 5 == 1) sc.cfg.device_watermarks = {0.1, 0.3};
  sc.failure_rate = variant % 3 == 0 ? 0.0 : 0.1;
  sc.delay_polls = variant % 4;
  run_scenario(sc, 2000);
}

INSTANTIATE_TEST_SUITE_P(Variants, CachePropertySieve, ::testing::Range(0, 12));

}  // namespace
}  // namespace kvtier::cache
