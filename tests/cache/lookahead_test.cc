// CacheManager look-ahead (label cpu): announced requests' blocks are protected from eviction (and stop being
// protected when withdrawn), prefetched storage -> host and host -> device by take_plan() within the budget and
// the tier cap, never at the cost of pinned blocks or of an earlier announcement's blocks; failed or overtaken
// prefetches become misses or lower-tier copies, never served data; hints that turn out wrong do no harm; bad
// input is a Status naming the value; and a seeded random mix keeps check_invariants() OK after every call.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kvtier/cache/cache_manager.h"
#include "tests/cache/cache_test_util.h"

namespace kvtier::cache {
namespace {

using testing::dsts;
using testing::make_cache;
using testing::path;

constexpr int kDevice = 0, kHost = 1, kStorage = 2;

// Admits, acks the plan, commits and releases a request.
Admission run_request(CacheManager& c, const std::vector<BlockKey>& keys) {
  auto a = c.admit(keys);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  if (!a.ok()) return {};
  EXPECT_TRUE(c.ack_plan(c.take_plan(), Status::Ok()).ok());
  EXPECT_TRUE(c.commit_all(a->id).ok());
  EXPECT_TRUE(c.release(a->id).ok());
  return *a;
}

// Takes and acks plans until one is empty.
void settle(CacheManager& c) {
  for (int i = 0; i < 16; ++i) {
    StepPlan p = c.take_plan();
    if (p.empty()) return;
    ASSERT_TRUE(c.ack_plan(p, Status::Ok()).ok());
  }
  FAIL() << "plans did not settle";
}

std::vector<BlockKey> keys_of(const std::vector<BlockMove>& moves) {
  std::vector<BlockKey> out;
  for (const BlockMove& m : moves) out.push_back(m.key);
  return out;
}

bool contains_key(const std::vector<BlockMove>& moves, const BlockKey& k) {
  return std::any_of(moves.begin(), moves.end(), [&](const BlockMove& m) { return m.key == k; });
}

CacheConfig lookahead_config(std::uint32_t device, std::uint32_t host, std::uint32_t storage, double fraction = 1.0,
                             std::uint32_t budget = 64) {
  CacheConfig c = testing::config(device, host, storage);
  c.lookahead_max_fraction = fraction;
  c.lookahead_prefetch_blocks = budget;
  return c;
}

// ---- protection ------------------------------------------------------------------

// Device only, 8 blocks: a is cached, then b and c arrive. Without an announcement LRU evicts a for c; with a
// announced, b goes instead.
TEST(LookaheadProtection, AnnouncedBlocksSurvivePressureThatEvictsThemOtherwise) {
  const auto a = path({1, 2, 3, 4}), b = path({10, 11, 12, 13}), c = path({20, 21, 22, 23});
  for (bool announced : {false, true}) {
    SCOPED_TRACE(announced ? "announced" : "not announced");
    auto m = make_cache(testing::config(8));
    run_request(*m, a);
    QueuedId q = 0;
    if (announced) {
      auto r = m->announce(a);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      q = *r;
      EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
      EXPECT_EQ(m->stats().queued_requests, 1u);
    }
    run_request(*m, b);
    run_request(*m, c);
    EXPECT_INVARIANTS(*m);
    EXPECT_EQ(m->match(c).device_blocks, 4u);
    if (announced) {
      EXPECT_EQ(m->match(a).device_blocks, 4u) << "protected";
      EXPECT_EQ(m->match(b).device_blocks, 0u) << "the unprotected victim";
      EXPECT_EQ(m->stats().protected_evictions, 0u);
      // The engine schedules it: withdraw, then admit; every block is a device hit.
      ASSERT_TRUE(m->withdraw(q).ok());
      EXPECT_EQ(run_request(*m, a).device_hit_blocks, 4u);
    } else {
      EXPECT_EQ(m->match(a).total(), 0u) << "LRU evicts the oldest";
      EXPECT_EQ(m->match(b).device_blocks, 4u);
    }
    EXPECT_EQ(m->stats().tiers[kDevice].resident, 8u);
    EXPECT_INVARIANTS(*m);
  }
}

TEST(LookaheadProtection, WithdrawEndsProtection) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(testing::config(8));
  run_request(*m, a);
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  run_request(*m, path({10, 11, 12, 13}));
  run_request(*m, path({20, 21, 22, 23}));
  ASSERT_EQ(m->match(a).device_blocks, 4u);
  ASSERT_TRUE(m->withdraw(*q).ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  EXPECT_EQ(m->stats().queued_requests, 0u);
  EXPECT_INVARIANTS(*m);
  // Back in the policy as just used: the next request evicts the older c, the one after it a.
  run_request(*m, path({30, 31, 32, 33}));
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  EXPECT_EQ(m->match(path({20, 21, 22, 23})).device_blocks, 0u);
  run_request(*m, path({40, 41, 42, 43}));
  EXPECT_EQ(m->match(a).total(), 0u) << "evicted as any block once withdrawn";
  EXPECT_INVARIANTS(*m);
}

// Protection is a preference: an admission that needs the protected blocks' room still gets it, exactly as
// without announcements, and the least important protected blocks go first (lower priority, then later).
TEST(LookaheadProtection, ProtectedBlocksAreEvictedOnlyAsALastResortLowestRankFirst) {
  const auto a = path({1, 2, 3, 4}), b = path({10, 11, 12, 13}), c = path({20, 21, 22, 23});
  auto m = make_cache(testing::config(8));
  run_request(*m, a);
  run_request(*m, b);
  RequestHints high;
  high.priority = 5;
  ASSERT_TRUE(m->announce(a, high).ok());  // earlier, and more important
  ASSERT_TRUE(m->announce(b).ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 8u);
  // c needs 4 blocks and every cached block is protected: b's go (priority 0 < 5).
  EXPECT_EQ(run_request(*m, c).new_blocks, 4u);
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  EXPECT_EQ(m->match(b).total(), 0u);
  EXPECT_EQ(m->stats().protected_evictions, 4u);
  EXPECT_INVARIANTS(*m);

  // Same priority: the later announced goes first.
  auto n = make_cache(testing::config(8));
  run_request(*n, a);
  run_request(*n, b);
  ASSERT_TRUE(n->announce(b).ok());
  ASSERT_TRUE(n->announce(a).ok());
  run_request(*n, c);
  EXPECT_EQ(n->match(b).device_blocks, 4u);
  EXPECT_EQ(n->match(a).total(), 0u);
  // The whole device for one request: succeeds, as it would without announcements.
  auto big = n->admit(path({50, 51, 52, 53, 54, 55, 56, 57}));
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  ASSERT_TRUE(n->ack_plan(n->take_plan(), Status::Ok()).ok());
  ASSERT_TRUE(n->release(big->id).ok());
  EXPECT_INVARIANTS(*n);
}

// admit() does not need the withdraw: a request admitted while announced is served the same, and its blocks
// stay protected until the withdraw.
TEST(LookaheadProtection, AdmitDoesNotDependOnWithdraw) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(testing::config(8, 16));
  run_request(*m, a);
  run_request(*m, path({10, 11, 12, 13}));
  run_request(*m, path({20, 21, 22, 23}));  // a -> host
  ASSERT_EQ(m->match(a).host_blocks, 4u);
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(m->stats().protected_blocks[kHost], 4u);
  auto adm = m->admit(a);
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  EXPECT_EQ(adm->host_hit_blocks, 4u);
  StepPlan p = m->take_plan();
  EXPECT_EQ(p.loads.size(), 4u) << "the admission's loads; nothing left to prefetch";
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  ASSERT_TRUE(m->release(adm->id).ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
  EXPECT_INVARIANTS(*m);
  ASSERT_TRUE(m->withdraw(*q).ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  EXPECT_EQ(m->stats().protected_blocks[kHost], 0u);
  EXPECT_INVARIANTS(*m);
}

// Blocks that join the index after the announce are protected from then on; blocks invalidated while
// announced stop being protected, and are protected again once computed anew.
TEST(LookaheadProtection, BlocksIndexedOrInvalidatedWhileAnnouncedFollowTheCounts) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(testing::config(8, 16));
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  run_request(*m, path({1, 2, 9}));  // shares a[0], a[1]
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 2u);
  run_request(*m, a);  // admitted without a withdraw: a[2], a[3] join the index protected
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
  EXPECT_INVARIANTS(*m);
  // Push a to host (protected copies go only as a last resort: make it one).
  run_request(*m, path({20, 21, 22, 23, 24, 25, 26, 27}));
  ASSERT_EQ(m->match(a).host_blocks, 4u);
  EXPECT_EQ(m->stats().protected_blocks[kHost], 4u);
  // An admission loads a; the load fails: the device side is invalidated, the host copies stay, still protected.
  // A second failure invalidates a and its subtree: unprotected, never served.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto adm = m->admit(a);
    ASSERT_TRUE(adm.ok());
    StepPlan p = m->take_plan();
    ASSERT_EQ(p.loads.size(), 4u);
    ASSERT_TRUE(m->ack_loads(dsts(p.loads), Internal("injected")).ok());
    ASSERT_TRUE(m->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
    ASSERT_TRUE(m->release(adm->id).ok());
    EXPECT_EQ(m->match(a).host_blocks, attempt == 0 ? 4u : 0u);
    EXPECT_EQ(m->stats().protected_blocks[kHost], attempt == 0 ? 4u : 0u);
    EXPECT_INVARIANTS(*m);
  }
  run_request(*m, a);  // computed again while still announced
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
  ASSERT_TRUE(m->withdraw(*q).ok());
  EXPECT_INVARIANTS(*m);
}

// ---- prefetch --------------------------------------------------------------------

// Device 4, host 8, storage 32, host watermarks that demote every settled host block: a ends in storage.
std::unique_ptr<CacheManager> cache_with_a_in_storage(const std::vector<BlockKey>& a, CacheConfig cfg) {
  cfg.host_watermarks = Watermarks{1.0, 1.0};
  auto m = make_cache(cfg);
  run_request(*m, a);
  run_request(*m, path({10, 11, 12, 13}));  // a -> host
  settle(*m);                               // a -> storage
  EXPECT_EQ(m->match(a).storage_blocks, 4u);
  return m;
}

TEST(LookaheadPrefetch, StorageToHostThenHostToDeviceAheadOfScheduling) {
  const auto a = path({1, 2, 3, 4});
  {
    // Without an announcement nothing moves.
    auto m = cache_with_a_in_storage(a, lookahead_config(4, 8, 32));
    EXPECT_TRUE(m->take_plan().empty());
    EXPECT_EQ(m->match(a).storage_blocks, 4u);
  }
  auto m = cache_with_a_in_storage(a, lookahead_config(4, 8, 32));
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  StepPlan p = m->take_plan();
  EXPECT_EQ(keys_of(p.storage_prefetches), a);
  EXPECT_TRUE(p.loads.empty()) << "the blocks are on their way to host";
  EXPECT_TRUE(m->match(a).stopped_at_in_flight);
  EXPECT_EQ(m->stats().lookahead_fetches, 4u);
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(m->match(a).host_blocks, 4u);
  EXPECT_EQ(m->stats().protected_blocks[kHost], 4u);
  EXPECT_INVARIANTS(*m);
  // Next plan: the host watermarks leave the protected host copies alone, and a is loaded to the device
  // (the unprotected b makes room).
  p = m->take_plan();
  EXPECT_TRUE(p.storage_writes.empty());
  EXPECT_EQ(keys_of(p.loads), a);
  EXPECT_EQ(p.evictions.size(), 4u);
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  EXPECT_EQ(m->stats().lookahead_loads, 4u);
  EXPECT_INVARIANTS(*m);
  ASSERT_TRUE(m->withdraw(*q).ok());
  Admission adm = run_request(*m, a);
  EXPECT_EQ(adm.device_hit_blocks, 4u);
  EXPECT_EQ(adm.new_blocks, 0u);
  EXPECT_INVARIANTS(*m);
}

TEST(LookaheadPrefetch, BudgetPerPlanIsRespected) {
  const auto a = path({1, 2, 3, 4});
  auto m = cache_with_a_in_storage(a, lookahead_config(4, 8, 32, 1.0, /*budget=*/2));
  ASSERT_TRUE(m->announce(a).ok());
  std::uint32_t fetches = 0, loads = 0;
  for (int i = 0; i < 8; ++i) {
    StepPlan p = m->take_plan();
    EXPECT_LE(p.storage_prefetches.size() + p.loads.size(), 2u) << "plan " << i;
    fetches += static_cast<std::uint32_t>(p.storage_prefetches.size());
    loads += static_cast<std::uint32_t>(p.loads.size());
    ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
    EXPECT_INVARIANTS(*m);
  }
  EXPECT_EQ(fetches, 4u);
  EXPECT_EQ(loads, 4u);
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  // Budget 0: protection only.
  auto z = cache_with_a_in_storage(a, lookahead_config(4, 8, 32, 1.0, 0));
  ASSERT_TRUE(z->announce(a).ok());
  EXPECT_TRUE(z->take_plan().empty());
  EXPECT_EQ(z->match(a).storage_blocks, 4u);
}

TEST(LookaheadPrefetch, TierCapBoundsWhatPrefetchMayFill) {
  const auto a = path({1, 2, 3, 4});
  // Host 8 blocks, cap 0.25: at most 2 protected or in-flight look-ahead host blocks.
  auto m = cache_with_a_in_storage(a, lookahead_config(4, 8, 32, 0.25));
  ASSERT_TRUE(m->announce(a).ok());
  StepPlan p = m->take_plan();
  EXPECT_EQ(p.storage_prefetches.size(), 2u);
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  // Device 4, cap 0.25: one block; host is at its cap already.
  p = m->take_plan();
  EXPECT_EQ(p.loads.size(), 1u);
  EXPECT_TRUE(p.storage_prefetches.empty());
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(m->match(a).device_blocks, 1u);
  EXPECT_EQ(m->match(a).host_blocks, 1u);
  EXPECT_EQ(m->match(a).storage_blocks, 2u);
  EXPECT_INVARIANTS(*m);
  // Cap 0: no prefetch at all.
  auto z = cache_with_a_in_storage(a, lookahead_config(4, 8, 32, 0.0));
  ASSERT_TRUE(z->announce(a).ok());
  EXPECT_TRUE(z->take_plan().empty());
}

// Device 8 pinned by two running requests: the announced host chain is not loaded (nothing to evict but pinned
// blocks), and the running requests keep every block.
TEST(LookaheadPrefetch, NeverEvictsPinnedBlocks) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(lookahead_config(8, 16, 0));
  run_request(*m, a);
  run_request(*m, path({10, 11, 12, 13}));
  run_request(*m, path({20, 21, 22, 23}));  // a -> host
  auto r1 = m->admit(path({30, 31, 32, 33}));
  ASSERT_TRUE(r1.ok());
  auto r2 = m->admit(path({40, 41, 42, 43}));
  ASSERT_TRUE(r2.ok());
  ASSERT_TRUE(m->ack_plan(m->take_plan(), Status::Ok()).ok());
  ASSERT_TRUE(m->commit_all(r1->id).ok());
  ASSERT_TRUE(m->commit_all(r2->id).ok());
  ASSERT_TRUE(m->announce(a).ok());
  StepPlan p = m->take_plan();
  EXPECT_TRUE(p.loads.empty());
  EXPECT_TRUE(p.evictions.empty());
  EXPECT_EQ(m->match(path({30, 31, 32, 33})).device_ids, r1->device_blocks);
  EXPECT_EQ(m->match(path({40, 41, 42, 43})).device_ids, r2->device_blocks);
  EXPECT_INVARIANTS(*m);
  // Once r1 ends its blocks are ordinary: the prefetch takes them.
  ASSERT_TRUE(m->release(r1->id).ok());
  p = m->take_plan();
  EXPECT_EQ(keys_of(p.loads), a);
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(m->match(path({40, 41, 42, 43})).device_ids, r2->device_blocks);
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  ASSERT_TRUE(m->release(r2->id).ok());
  EXPECT_INVARIANTS(*m);
}

// A later announcement never displaces an earlier one's blocks: x (announced first) fills the device's free
// room; y's host blocks wait.
TEST(LookaheadPrefetch, LaterAnnouncementNeverEvictsAnEarlierOnesBlocks) {
  const auto x = path({1, 2, 3, 4}), y = path({5, 6, 7, 8});
  auto m = make_cache(lookahead_config(8, 16, 0));
  run_request(*m, y);
  run_request(*m, path({10, 11, 12, 13}));
  run_request(*m, path({20, 21, 22, 23}));  // y -> host
  run_request(*m, x);                       // x on device, 10.. -> host
  auto running = m->admit(path({30, 31, 32, 33}));
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE(m->ack_plan(m->take_plan(), Status::Ok()).ok());
  ASSERT_EQ(m->match(x).device_blocks, 4u);
  ASSERT_EQ(m->match(y).host_blocks, 4u);
  ASSERT_TRUE(m->announce(x).ok());
  ASSERT_TRUE(m->announce(y).ok());
  StepPlan p = m->take_plan();
  EXPECT_TRUE(p.loads.empty()) << "the device holds x (protected) and a running request (pinned)";
  EXPECT_EQ(m->match(x).device_blocks, 4u);
  EXPECT_EQ(m->match(y).host_blocks, 4u);
  // A higher-priority announcement is prefetched first, but still never at the cost of protected blocks.
  RequestHints urgent;
  urgent.priority = 10;
  auto z = path({10, 11, 12, 13});
  ASSERT_EQ(m->match(z).host_blocks, 4u);
  ASSERT_TRUE(m->announce(z, urgent).ok());
  ASSERT_TRUE(m->release(running->id).ok());  // 4 unprotected device blocks now
  p = m->take_plan();
  EXPECT_EQ(keys_of(p.loads), z) << "z first (priority 10), y waits for room";
  EXPECT_FALSE(contains_key(p.loads, y[0]));
  ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(m->match(x).device_blocks, 4u);
  EXPECT_EQ(m->match(z).device_blocks, 4u);
  EXPECT_INVARIANTS(*m);
}

// A cache of 8 device / 16 host blocks where `a` (4 blocks) went to host behind two other requests, then `a` is
// announced: the plan loads a's blocks back (and evicts the others' to make room), acked here for the evictions.
struct AnnouncedOnHost {
  std::unique_ptr<CacheManager> m;
  Result<QueuedId> queued = Internal("not announced");
  StepPlan plan;
};
AnnouncedOnHost announce_host_chain(const std::vector<BlockKey>& a) {
  AnnouncedOnHost r;
  r.m = make_cache(lookahead_config(8, 16, 0));
  run_request(*r.m, a);
  run_request(*r.m, path({10, 11, 12, 13}));
  run_request(*r.m, path({20, 21, 22, 23}));  // a -> host
  r.queued = r.m->announce(a);
  r.plan = r.m->take_plan();
  return r;
}

// A failed look-ahead load leaves the block on host, never served as loaded; a failed look-ahead fetch makes
// the chain a miss.
TEST(LookaheadPrefetch, FailedPrefetchBecomesAMissOrALowerTierNeverData) {
  const auto a = path({1, 2, 3, 4});
  auto [m, q, p] = announce_host_chain(a);
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(keys_of(p.loads), a);
  const std::uint64_t failed_before = m->stats().failed_transfers;
  ASSERT_TRUE(m->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  ASSERT_TRUE(m->ack_loads(dsts(p.loads), Internal("injected load failure")).ok());
  EXPECT_EQ(m->stats().failed_transfers, failed_before + 4);
  MatchResult r = m->match(a);
  EXPECT_EQ(r.device_blocks, 0u);
  EXPECT_EQ(r.host_blocks, 4u) << "the host copies were only read";
  EXPECT_EQ(m->stats().tiers[kDevice].used, 4u) << "the failed loads' device blocks are free again";
  EXPECT_INVARIANTS(*m);
  // Withdrawn and admitted: loaded again by the admission, not served from the failed device blocks.
  ASSERT_TRUE(m->withdraw(*q).ok());
  auto adm = m->admit(a);
  ASSERT_TRUE(adm.ok());
  EXPECT_EQ(adm->device_hit_blocks, 0u);
  EXPECT_EQ(adm->host_hit_blocks, 4u);
  ASSERT_TRUE(m->ack_plan(m->take_plan(), Status::Ok()).ok());
  ASSERT_TRUE(m->release(adm->id).ok());
  EXPECT_INVARIANTS(*m);

  // Storage -> host fails: a and its subtree become misses.
  auto s = cache_with_a_in_storage(a, lookahead_config(4, 8, 32));
  ASSERT_TRUE(s->announce(a).ok());
  p = s->take_plan();
  ASSERT_EQ(p.storage_prefetches.size(), 4u);
  ASSERT_TRUE(s->ack_plan(p, Internal("injected fetch failure")).ok());
  EXPECT_EQ(s->match(a).total(), 0u);
  EXPECT_EQ(s->stats().protected_blocks[kHost], 0u);
  const StepPlan after = s->take_plan();
  EXPECT_EQ(after.size(), 0u) << "nothing left to prefetch";
  EXPECT_EQ(after.storage_drops.size(), 4u) << "the slots of the failed prefetches, for their objects to go";
  EXPECT_EQ(run_request(*s, a).new_blocks, 4u);
  EXPECT_INVARIANTS(*s);
}

// A failed look-ahead load whose children are still loading, or have landed, on the device: the host copies of
// the whole chain stay (they were only read); the device copies below the failed block are given up (a device
// block under a host-only parent would break the tier order), those still in flight when they ack.
TEST(LookaheadPrefetch, AFailedLoadAboveOthersKeepsEveryHostCopy) {
  const auto a = path({1, 2, 3, 4});
  for (const bool children_first : {false, true}) {
    SCOPED_TRACE(children_first ? "the children's loads ack first" : "the parent's load fails first");
    auto [m, q, p] = announce_host_chain(a);
    ASSERT_TRUE(q.ok());
    ASSERT_EQ(keys_of(p.loads), a);
    ASSERT_TRUE(m->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
    const std::vector<BlockId> loads = dsts(p.loads);
    const std::vector<BlockId> parent(loads.begin() + 1, loads.begin() + 2);  // a[1]: a[2], a[3] below it
    std::vector<BlockId> others = {loads[0], loads[2], loads[3]};
    if (children_first) {
      ASSERT_TRUE(m->ack_loads(others, Status::Ok()).ok());
    }
    ASSERT_TRUE(m->ack_loads(parent, Internal("injected load failure")).ok());
    EXPECT_INVARIANTS(*m);
    if (!children_first) {
      ASSERT_TRUE(m->ack_loads(others, Status::Ok()).ok());
    }
    EXPECT_INVARIANTS(*m);
    MatchResult r = m->match(a);
    EXPECT_EQ(r.device_blocks, 1u) << "a[0] loaded; a[1] failed, so nothing below it stays on the device";
    EXPECT_EQ(r.host_blocks, 3u) << "the host copies were only read";
    EXPECT_EQ(m->stats().tiers[kDevice].used, 5u) << "the other request's 4 and a[0]";
    // Withdrawn and admitted: a[1..3] loaded again by the admission.
    ASSERT_TRUE(m->withdraw(*q).ok());
    auto adm = m->admit(a);
    ASSERT_TRUE(adm.ok());
    EXPECT_EQ(adm->device_hit_blocks, 1u);
    EXPECT_EQ(adm->host_hit_blocks, 3u);
    ASSERT_TRUE(m->ack_plan(m->take_plan(), Status::Ok()).ok());
    ASSERT_TRUE(m->release(adm->id).ok());
    EXPECT_INVARIANTS(*m);
  }
}

// A prefetched block that is not admitted and then evicted is a lower-tier copy or a miss, as any block. (The host has
// room for the device blocks the prefetch moves aside: a prefetch never drops a last copy to make room.)
TEST(LookaheadPrefetch, PrefetchedBlockEvictedBeforeUseIsAMiss) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(lookahead_config(4, 8, 0));
  run_request(*m, a);
  run_request(*m, path({10, 11, 12, 13}));  // a -> host
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  settle(*m);
  ASSERT_EQ(m->match(a).device_blocks, 4u);
  EXPECT_EQ(m->match(path({10, 11, 12, 13})).host_blocks, 4u) << "moved aside to the host, not dropped";
  ASSERT_TRUE(m->withdraw(*q).ok());        // cancelled: an ordinary cached device block now
  run_request(*m, path({20, 21, 22, 23}));  // a -> host
  EXPECT_EQ(m->match(a).host_blocks, 4u);
  for (std::uint64_t i = 3; i < 6 && m->match(a).total() != 0; ++i)
    run_request(*m, path({10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3}));  // host full: a's host copies dropped
  EXPECT_EQ(m->match(a).total(), 0u);
  EXPECT_EQ(run_request(*m, a).new_blocks, 4u);
  EXPECT_INVARIANTS(*m);
}

// With no room anywhere but what dropping a last copy would give, a prefetch waits: the device-only blocks stay.
TEST(LookaheadPrefetch, APrefetchDropsNoLastCopyForRoom) {
  const auto a = path({1, 2, 3, 4}), b = path({10, 11, 12, 13});
  auto m = make_cache(lookahead_config(4, 4, 0));
  run_request(*m, a);
  run_request(*m, b);  // a -> host (full), b on the device only
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  settle(*m);
  EXPECT_EQ(m->match(b).device_blocks, 4u) << "the prefetch dropped b's only copies";
  EXPECT_EQ(m->match(a).host_blocks, 4u);
  EXPECT_INVARIANTS(*m);
}

// ---- hints -------------------------------------------------------------------------

TEST(LookaheadHints, ContinuesRetainsForTheTtlThenDropsOnlyProtection) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(testing::config(8));
  run_request(*m, a);
  RequestHints h;
  h.conversation_id = 7;
  h.continuation = Continuation::kContinues;
  h.ttl_steps = 2;
  auto q = m->announce(a, h);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(m->withdraw(*q).ok());
  auto info = m->announcement(*q);
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->queued);
  EXPECT_EQ(info->retained_steps, 2u);
  EXPECT_EQ(m->stats().retained_requests, 1u);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
  // A retained chain is protected: other requests evict each other.
  run_request(*m, path({10, 11, 12, 13}));  // takes a plan: 1 step left
  run_request(*m, path({20, 21, 22, 23}));  // the second plan ends the retention
  EXPECT_EQ(m->match(a).device_blocks, 4u);
  EXPECT_EQ(m->stats().retained_requests, 0u);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  EXPECT_EQ(m->announcement(*q).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(*m);
  // The conversation never came back: a is an ordinary block, evicted in turn.
  run_request(*m, path({30, 31, 32, 33}));
  run_request(*m, path({40, 41, 42, 43}));
  EXPECT_EQ(m->match(a).total(), 0u);
}

TEST(LookaheadHints, ContinuesWithoutTtlUsesTheConfiguredRetentionAndANewTurnTakesOver) {
  const auto turn1 = path({1, 2, 3}), turn2 = path({1, 2, 3, 4, 5});
  auto m = make_cache(testing::with(testing::config(16), [](CacheConfig& c) { c.lookahead_retain_steps = 3; }));
  RequestHints h;
  h.conversation_id = 42;
  h.continuation = Continuation::kContinues;
  auto q1 = m->announce(turn1, h);
  ASSERT_TRUE(q1.ok());
  ASSERT_TRUE(m->withdraw(*q1).ok());
  run_request(*m, turn1);
  EXPECT_EQ(m->announcement(*q1)->retained_steps, 2u) << "3 steps, one taken by the request's plan";
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 3u);
  // The next turn is announced: the retention ends, the new announcement protects the shared prefix.
  h.continuation = Continuation::kLastTurn;
  auto q2 = m->announce(turn2, h);
  ASSERT_TRUE(q2.ok());
  EXPECT_EQ(m->stats().retained_requests, 0u);
  EXPECT_EQ(m->stats().queued_requests, 1u);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 3u);
  EXPECT_EQ(m->announcement(*q1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(*m);
  // Its last turn: nothing is retained after the withdraw, whatever the ttl says.
  ASSERT_TRUE(m->withdraw(*q2).ok());
  EXPECT_EQ(m->stats().retained_requests, 0u);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  EXPECT_INVARIANTS(*m);
}

// Hints that turn out wrong do no harm: a "last turn" whose conversation returns is an ordinary hit, and an
// expired ttl leaves the data cached.
TEST(LookaheadHints, ContradictedHintsDoNoHarm) {
  const auto turn1 = path({1, 2, 3, 4}), turn2 = path({1, 2, 3, 4, 5, 6});
  std::vector<std::uint32_t> hits;
  for (bool hinted : {false, true}) {
    auto m = make_cache(testing::config(8, 8));
    if (hinted) {
      RequestHints last;
      last.conversation_id = 9;
      last.continuation = Continuation::kLastTurn;
      last.ttl_steps = 1000;  // contradicts kLastTurn: ignored
      auto q = m->announce(turn1, last);
      ASSERT_TRUE(q.ok());
      ASSERT_TRUE(m->withdraw(*q).ok());
      EXPECT_EQ(m->stats().retained_requests, 0u);
    }
    run_request(*m, turn1);
    run_request(*m, path({10, 11}));
    if (hinted) {
      // The conversation returns after all, announced again.
      RequestHints again;
      again.conversation_id = 9;
      auto q = m->announce(turn2, again);
      ASSERT_TRUE(q.ok());
      ASSERT_TRUE(m->withdraw(*q).ok());
    }
    Admission a = run_request(*m, turn2);
    hits.push_back(a.device_hit_blocks + a.host_hit_blocks);
    EXPECT_INVARIANTS(*m);
  }
  EXPECT_EQ(hits[0], 4u);
  EXPECT_EQ(hits[1], hits[0]);
}

// ---- bad input -----------------------------------------------------------------------

TEST(LookaheadErrors, BadInputIsAStatusNamingTheValue) {
  auto m = make_cache(testing::config(8, 8));
  const auto x = path({1, 2, 3});
  run_request(*m, x);
  auto has = [](const Status& s, const std::string& what) { return s.message().find(what) != std::string::npos; };
  Status s = m->withdraw(12345);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(has(s, "12345")) << s.to_string();
  EXPECT_EQ(m->extend_announced(0, x).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->announcement(99).status().code(), StatusCode::kNotFound);

  auto q = m->announce(x);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(m->withdraw(*q).ok());
  s = m->withdraw(*q);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(has(s, std::to_string(*q))) << s.to_string();
  s = m->extend_announced(*q, path({1, 2, 3, 4}));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(has(s, std::to_string(*q))) << s.to_string();

  // Retained: a second withdraw says so.
  RequestHints keep;
  keep.ttl_steps = 5;
  auto r = m->announce(x, keep);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(m->withdraw(*r).ok());
  s = m->withdraw(*r);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(has(s, "retained")) << s.to_string();
  EXPECT_EQ(m->extend_announced(*r, {}).code(), StatusCode::kFailedPrecondition);

  // Not a hash chain: a repeated key, a key indexed below another block, a broken extension.
  const CacheStats before = m->stats();
  auto bad = m->announce(std::vector<BlockKey>{x[0], x[1], x[0]});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(bad.status(), x[0].hex())) << bad.status().to_string();
  bad = m->announce(std::vector<BlockKey>{x[1], x[2]});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(bad.status(), x[1].hex())) << bad.status().to_string();
  auto e = m->announce(std::vector<BlockKey>{x[0]});
  ASSERT_TRUE(e.ok());
  s = m->extend_announced(*e, std::vector<BlockKey>{x[2]});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(s, x[2].hex())) << s.to_string();
  EXPECT_TRUE(has(s, "position 1")) << s.to_string();
  EXPECT_EQ(m->announcement(*e)->keys, 1u) << "a refused extension changes nothing";
  ASSERT_TRUE(m->extend_announced(*e, std::vector<BlockKey>{x[1], x[2]}).ok());
  EXPECT_EQ(m->announcement(*e)->keys, 3u);
  EXPECT_EQ(m->stats().queued_requests, before.queued_requests + 1);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 3u);

  RequestHints odd;
  odd.continuation = static_cast<Continuation>(7);
  auto o = m->announce(x, odd);
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(o.status(), "7")) << o.status().to_string();
  EXPECT_INVARIANTS(*m);

  // Out-of-range config.
  auto cfg = testing::config(8);
  cfg.lookahead_max_fraction = 1.5;
  auto bad_cfg = CacheManager::create(cfg);
  EXPECT_EQ(bad_cfg.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(bad_cfg.status(), "1.5")) << bad_cfg.status().to_string();
}

// reset() forgets the cached blocks, not the engine's queue: blocks cached again are protected again.
TEST(LookaheadProtection, ResetKeepsTheQueue) {
  const auto a = path({1, 2, 3, 4});
  auto m = make_cache(testing::config(8));
  run_request(*m, a);
  auto q = m->announce(a);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(m->reset().ok());
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 0u);
  EXPECT_EQ(m->stats().queued_requests, 1u);
  run_request(*m, a);
  EXPECT_EQ(m->stats().protected_blocks[kDevice], 4u);
  ASSERT_TRUE(m->withdraw(*q).ok());
  EXPECT_INVARIANTS(*m);
}

// ---- randomized ------------------------------------------------------------------------

struct RandomCase {
  const char* policy;
  WritePolicy write;
  std::uint32_t storage;
};

class LookaheadRandom : public ::testing::TestWithParam<RandomCase> {};

// Announces, extensions, withdraws (with and without hints), admissions, partial commits, releases, prefetch(),
// plans acked late, in pieces or with failures: check_invariants() after every call, and at the end, with the
// queue empty and every retention expired, nothing is protected and nothing is in flight.
TEST_P(LookaheadRandom, InvariantsHoldAfterEveryCall) {
  const RandomCase rc = GetParam();
  CacheConfig cfg = testing::config(16, 12, rc.storage);
  cfg.device_policy = cfg.host_policy = cfg.storage_policy = rc.policy;
  cfg.write_policy = rc.write;
  cfg.lookahead_prefetch_blocks = 6;
  cfg.lookahead_max_fraction = 0.5;
  cfg.lookahead_retain_steps = 4;
  auto m = make_cache(cfg);
  std::mt19937_64 rng(20240611);
  auto pick = [&](std::uint64_t n) { return static_cast<std::uint64_t>(rng() % n); };
  // Conversations: each turn extends the previous one's ids.
  std::vector<std::vector<std::uint64_t>> convs(12);
  std::uint64_t next_id = 1;
  for (auto& c : convs)
    for (int i = 0; i < 2; ++i) c.push_back(next_id++);
  struct Queued {
    QueuedId id;
    std::size_t conv, len;
  };
  std::vector<Queued> queued;
  std::vector<std::pair<AdmissionId, std::uint32_t>> open;  // (id, keys)
  std::vector<StepPlan> pending;
  std::uint64_t admitted = 0, extended = 0;
  for (int step = 0; step < 3000; ++step) {
    const std::uint64_t op = pick(100);
    if (op < 18) {
      const std::size_t ci = pick(convs.size());
      auto& c = convs[ci];
      if (pick(2)) c.push_back(next_id++);
      RequestHints h;
      h.conversation_id = pick(3) ? 1 + ci : 0;
      h.continuation = static_cast<Continuation>(pick(3));
      h.ttl_steps = pick(4) == 0 ? static_cast<std::uint32_t>(pick(6)) : 0;
      h.priority = static_cast<std::int32_t>(pick(3));
      const std::size_t len = 1 + pick(c.size());
      auto q = m->announce(path(std::vector<std::uint64_t>(c.begin(), c.begin() + len)), h);
      ASSERT_TRUE(q.ok()) << q.status().to_string();
      queued.push_back(Queued{*q, ci, len});
    } else if (op < 24 && !queued.empty()) {
      // Tokens arrived: the announced chain grows by the conversation's next keys (new ones, sometimes).
      Queued& q = queued[pick(queued.size())];
      auto& c = convs[q.conv];
      if (pick(2)) c.push_back(next_id++);
      if (c.size() > q.len) {
        const std::size_t more = 1 + pick(c.size() - q.len);
        const auto all = path(std::vector<std::uint64_t>(c.begin(), c.begin() + q.len + more));
        Status s = m->extend_announced(q.id, std::span<const BlockKey>(all).subspan(q.len));
        ASSERT_TRUE(s.ok()) << s.to_string();
        q.len += more;
        ++extended;
      }
    } else if (op < 40 && !queued.empty()) {
      const std::size_t i = pick(queued.size());
      Status s = m->withdraw(queued[i].id);
      ASSERT_TRUE(s.ok()) << s.to_string();
      queued.erase(queued.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 60) {
      const auto& c = convs[pick(convs.size())];
      const std::size_t len = 1 + pick(c.size());
      auto a = m->admit(path(std::vector<std::uint64_t>(c.begin(), c.begin() + len)), pick(2));
      if (a.ok()) {
        open.emplace_back(a->id, static_cast<std::uint32_t>(len));
        ++admitted;
      } else {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().to_string();
      }
    } else if (op < 70 && !open.empty()) {
      const auto& [id, n] = open[pick(open.size())];
      Status s = m->commit(id, static_cast<std::uint32_t>(pick(n + 1)));
      ASSERT_TRUE(testing::committed_or_loading(*m, id, s)) << s.to_string();
    } else if (op < 80 && !open.empty()) {
      const std::size_t i = pick(open.size());
      ASSERT_TRUE(m->release(open[i].first).ok());
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 83) {
      const auto& c = convs[pick(convs.size())];
      ASSERT_TRUE(m->prefetch(path(c)).ok());
    } else if (op < 93) {
      pending.push_back(m->take_plan());
    } else if (!pending.empty()) {
      // Ack the oldest plan: every group with one status, one in ten failed.
      StepPlan p = std::move(pending.front());
      pending.erase(pending.begin());
      auto st = [&] { return pick(10) == 0 ? Internal("injected") : Status::Ok(); };
      ASSERT_TRUE(m->ack_evictions(dsts(p.evictions), st()).ok());
      ASSERT_TRUE(m->ack_backups(dsts(p.backups), st()).ok());
      ASSERT_TRUE(m->ack_loads(dsts(p.loads), st()).ok());
      ASSERT_TRUE(m->ack_storage_writes(dsts(p.storage_writes), st()).ok());
      ASSERT_TRUE(m->ack_storage_prefetches(dsts(p.storage_prefetches), st()).ok());
    }
    Status inv = m->check_invariants();
    ASSERT_TRUE(inv.ok()) << "after step " << step << " (op " << op << "): " << inv.to_string();
  }
  EXPECT_GT(admitted, 100u);
  EXPECT_GT(extended, 10u);
  EXPECT_GT(m->stats().lookahead_loads, 0u);
  // Selective write-through stores only blocks hit twice: too few storage-only blocks here to require it.
  if (rc.storage && rc.write != WritePolicy::kWriteThroughSelective) {
    EXPECT_GT(m->stats().lookahead_fetches, 0u)
        << "storage writes " << m->stats().storage_writes << ", storage resident " << m->stats().tiers[2].resident
        << ", storage prefetches " << m->stats().storage_prefetches << ", drops host " << m->stats().drops_host;
  }
  EXPECT_GT(m->stats().protected_evictions + m->stats().lookahead_loads, 0u);
  // Drain: withdraw everything, release everything, ack everything, let retentions expire.
  for (const Queued& q : queued) {
    Status s = m->withdraw(q.id);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  for (const auto& [id, n] : open) ASSERT_TRUE(m->release(id).ok());
  for (const StepPlan& p : pending) ASSERT_TRUE(m->ack_plan(p, Status::Ok()).ok());
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(m->ack_plan(m->take_plan(), Status::Ok()).ok());
  const CacheStats s = m->stats();
  EXPECT_EQ(s.queued_requests, 0u);
  EXPECT_EQ(s.retained_requests, 0u);
  for (int t = 0; t < kNumTiers; ++t) EXPECT_EQ(s.protected_blocks[t], 0u) << t;
  EXPECT_TRUE(m->take_plan().empty());
  EXPECT_INVARIANTS(*m);
}

INSTANTIATE_TEST_SUITE_P(Policies, LookaheadRandom,
                         ::testing::Values(RandomCase{"lru", WritePolicy::kWriteBack, 64},
                                           RandomCase{"lrfu", WritePolicy::kWriteBack, 0},
                                           RandomCase{"s3fifo", WritePolicy::kWriteThrough, 64},
                                           RandomCase{"arc", WritePolicy::kWriteThroughSelective, 64}));

}  // namespace
}  // namespace kvtier::cache
