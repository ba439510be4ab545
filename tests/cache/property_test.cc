// Random operation sequences against the CacheManager's invariants:
// tier-ordered paths, no orphaned subtrees, balanced references, no in-flight block served, and the
// incremental count of reclaimable device blocks equal to a full recount.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

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
      const Status st = c->commit(it->first, n);
      ASSERT_TRUE(testing::committed_or_loading(*c, it->first, st)) << st.to_string();
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
  sc.cfg.storage_blocks = variant % 2 && sc.cfg.host_blocks > 0 ? 64 : 0;  // storage needs a host tier
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu", "adaptive"};
  sc.cfg.device_policy = policies[variant % 5];  // every one of them (% 4 never chose the default, adaptive)
  sc.cfg.host_policy = policies[(variant + 1) % 5];
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
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu", "adaptive"};
  sc.cfg.device_policy = policies[variant % 5];
  sc.cfg.host_policy = policies[(variant / 5) % 4];
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
  sc.cfg.storage_blocks = variant % 2 && sc.cfg.host_blocks > 0 ? 64 : 0;  // storage needs a host tier
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

// The incremental count of reclaimable device blocks (what admit() checks before it evicts) against a full
// recount (check_invariants()) after every call, over random sequences of every kind of call: admissions with
// extra blocks and hit limits, P/D receives (completed, quarantined, released mid-receive), partial commits,
// look-ahead announcements (extended, withdrawn with retention), storage prefetches, plans acked by kind with
// failures, delays and blocks listed twice, acks of moves not in flight, and reset(). Every tier layout and
// write policy; the device tier is small, so admissions fail often and evictions run on most of them.
class CachePropertyReclaimable : public ::testing::TestWithParam<int> {};

TEST_P(CachePropertyReclaimable, IncrementalCountEqualsFullRecountAfterEveryCall) {
  const int variant = GetParam();
  CacheConfig cfg;
  cfg.device_blocks = 10 + variant % 3 * 7;
  cfg.host_blocks = variant % 4 == 3 ? 0 : 12 + variant % 5 * 6;
  cfg.storage_blocks = variant % 2 && cfg.host_blocks > 0 ? 10 + variant % 3 * 30 : 0;  // storage needs a host tier
  const char* policies[] = {"lru", "s3fifo", "arc", "lrfu", "sieve"};
  cfg.device_policy = policies[variant % 5];
  cfg.host_policy = policies[(variant + 2) % 5];
  cfg.write_policy = static_cast<WritePolicy>(variant % 3);
  cfg.write_through_threshold = 1 + variant % 2;
  if (variant % 3 == 1) cfg.host_watermarks = {0.25, 0.5};
  if (variant % 5 == 2) cfg.device_watermarks = {0.1, 0.3};
  cfg.lookahead_prefetch_blocks = variant % 4 == 0 ? 0 : 4 + variant % 3 * 4;
  cfg.lookahead_max_fraction = variant % 2 ? 1.0 : 0.5;
  cfg.lookahead_retain_steps = variant % 3;
  auto c = testing::make_cache(cfg);
  FakePlanExecutor::Options eo;
  eo.failure_rate = variant % 4 == 1 ? 0.0 : 0.08;
  eo.delay_polls = variant % 3;
  eo.seed = 9000 + variant;
  FakePlanExecutor ex(eo);
  std::mt19937_64 rng(9000 + variant);
  std::vector<std::vector<std::uint64_t>> paths;
  for (int i = 0; i < 30; ++i) {
    std::vector<std::uint64_t> p;
    if (!paths.empty() && rng() % 3) {
      const auto& base = paths[rng() % paths.size()];
      p.assign(base.begin(), base.begin() + rng() % (base.size() + 1));
    }
    std::size_t len = p.size() + 1 + rng() % 4;
    while (p.size() < len) p.push_back(1000 + rng() % 100000);
    paths.push_back(p);
  }
  auto hasher = testing::test_hasher();
  std::vector<std::vector<BlockKey>> keys;
  for (auto& p : paths) keys.push_back(hasher.keys_for_ids(p));
  struct Open {
    std::size_t path;
    bool receiving;
  };
  std::map<AdmissionId, Open> open;
  std::vector<AdmissionId> quarantined;  // released while receiving, or completed without `reclaimable`
  std::vector<QueuedId> queued;
  std::uint64_t refused = 0, admitted = 0, receives = 0, announced = 0, resets = 0;

  auto pump = [&] {
    ASSERT_TRUE(ex.execute(c->take_plan()).ok());
    std::vector<Completion> done = ex.poll();
    for (Completion& d : done) {
      if (!d.dst.empty() && rng() % 8 == 0) d.dst.push_back(d.dst.front());  // listed twice: acked once
      const Status acked = apply_completions(*c, {d});
      ASSERT_TRUE(acked.ok()) << acked.to_string();
      const Status inv = c->check_invariants();
      ASSERT_TRUE(inv.ok()) << "after an ack: " << inv.to_string();
    }
  };

  for (int step = 0; step < 700; ++step) {
    const int op = static_cast<int>(rng() % 16);
    std::string what = fmt::format("op {}", op);
    if (op < 4) {  // admit, sometimes with extra blocks or a hit limit
      const std::size_t pi = rng() % keys.size();
      const std::uint32_t extra = rng() % 3 == 0 ? static_cast<std::uint32_t>(rng() % 3) : 0;
      const std::uint32_t limit = rng() % 5 == 0 ? static_cast<std::uint32_t>(rng() % 3) : kNoHitLimit;
      auto a = c->admit(keys[pi], extra, limit);
      if (a.ok()) {
        open[a->id] = Open{pi, false};
        ++admitted;
      } else {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().to_string();
        ++refused;
      }
    } else if (op == 4) {  // a P/D receive
      const std::size_t pi = rng() % keys.size();
      ReceiveOptions ro;
      ro.extra_blocks = static_cast<std::uint32_t>(rng() % 2);
      ro.received_extra_blocks = ro.extra_blocks ? static_cast<std::uint32_t>(rng() % 2) : 0;
      ro.match_prefix = rng() % 2;
      auto a = c->admit_receive(keys[pi], ro);
      if (a.ok()) {
        open[a->id] = Open{pi, true};
        ++receives;
      } else {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().to_string();
        ++refused;
      }
    } else if (op == 5 && !open.empty()) {  // complete a receive (or commit part of an admission)
      auto it = open.begin();
      std::advance(it, rng() % open.size());
      if (it->second.receiving) {
        auto st = c->admission_status(it->first);
        ASSERT_TRUE(st.ok());
        const std::uint32_t n = st->receiving_blocks;
        const bool reclaimable = rng() % 2;
        ASSERT_TRUE(
            c->complete_receive(it->first, n ? static_cast<std::uint32_t>(rng() % (n + 1)) : 0, reclaimable).ok());
        it->second.receiving = false;
        auto after = c->admission_status(it->first);
        ASSERT_TRUE(after.ok());
        if (after->quarantined_blocks && rng() % 2) {
          ASSERT_TRUE(c->ack_receive_reclaimable(it->first).ok());
        }
      } else {
        c->commit(it->first, static_cast<std::uint32_t>(rng() % (keys[it->second.path].size() + 1)))
            .ignore_error();  // refused while quarantined: the model checks the state, not this call
      }
    } else if (op < 8 && !open.empty()) {  // commit all (when allowed) and release
      auto it = open.begin();
      std::advance(it, rng() % open.size());
      if (!it->second.receiving && rng() % 2) c->commit_all(it->first).ignore_error();  // refused while quarantined
      auto st = c->admission_status(it->first);
      ASSERT_TRUE(st.ok());
      const bool guarded = st->receiving_blocks > 0 || st->quarantined_blocks > 0;
      ASSERT_TRUE(c->release(it->first).ok());
      if (guarded) quarantined.push_back(it->first);
      open.erase(it);
    } else if (op == 8 && !quarantined.empty()) {  // the peer is proven quiescent
      const std::size_t i = rng() % quarantined.size();
      ASSERT_TRUE(c->ack_receive_reclaimable(quarantined[i]).ok());
      quarantined.erase(quarantined.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op == 9) {  // announce a queued request, with hints
      RequestHints h;
      h.priority = static_cast<std::int32_t>(rng() % 3);
      h.ttl_steps = static_cast<std::uint32_t>(rng() % 3);
      h.conversation_id = rng() % 3;
      h.continuation = static_cast<Continuation>(rng() % 3);
      const auto& k = keys[rng() % keys.size()];
      const std::size_t first = 1 + rng() % k.size();
      auto q = c->announce(std::span<const BlockKey>(k.data(), first), h);
      ASSERT_TRUE(q.ok()) << q.status().to_string();
      if (first < k.size() && rng() % 2) {
        ASSERT_TRUE(c->extend_announced(*q, std::span<const BlockKey>(k.data() + first, k.size() - first)).ok());
      }
      queued.push_back(*q);
      ++announced;
    } else if (op == 10 && !queued.empty()) {  // withdraw (the request was scheduled or cancelled)
      const std::size_t i = rng() % queued.size();
      ASSERT_TRUE(c->withdraw(queued[i]).ok());
      queued.erase(queued.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op == 11) {
      ASSERT_TRUE(c->prefetch(keys[rng() % keys.size()]).ok());
    } else if (op == 12) {  // an ack of a block no move can be in flight to: refused, nothing changes
      const auto past = static_cast<BlockId>(rng() % 3);
      const Status s = rng() % 2 ? c->ack_loads(std::vector<BlockId>{cfg.device_blocks + past}, Status::Ok())
                                 : c->ack_evictions(std::vector<BlockId>{cfg.host_blocks + past}, Unavailable("x"));
      ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
    } else if (op == 13 && open.empty() && quarantined.empty() && ex.in_flight() == 0 && rng() % 4 == 0) {
      StepPlan p = c->take_plan();
      if (p.empty()) {
        ASSERT_TRUE(c->reset().ok());
        ++resets;
      } else {
        ASSERT_TRUE(ex.execute(p).ok());
      }
    } else {
      pump();
    }
    if (::testing::Test::HasFatalFailure()) return;
    const Status inv = c->check_invariants();
    ASSERT_TRUE(inv.ok()) << "step " << step << " (" << what << "): " << inv.to_string();
  }
  for (auto& [id, o] : open) ASSERT_TRUE(c->release(id).ok());
  for (QueuedId q : queued) ASSERT_TRUE(c->withdraw(q).ok());
  for (int i = 0; i < 8 + static_cast<int>(eo.delay_polls); ++i) pump();
  ASSERT_TRUE(c->check_invariants().ok());
  EXPECT_GT(admitted, 0u);
  EXPECT_GT(refused, 0u);  // the small device tier is exhausted now and then: the check decides
  EXPECT_GT(receives + announced, 0u);
  (void)resets;
}

INSTANTIATE_TEST_SUITE_P(Variants, CachePropertyReclaimable, ::testing::Range(0, 40));

}  // namespace
}  // namespace kvtier::cache
