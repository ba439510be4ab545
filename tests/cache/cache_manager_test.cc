#include "kvtier/cache/cache_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/testing/plan_executors.h"
#include "tests/cache/cache_test_util.h"

namespace kvtier::cache {
namespace {

using testing::dsts;
using testing::make_cache;
using testing::path;

// Admits, commits and releases a request; returns the admission.
Admission run_request(CacheManager& c, const std::vector<BlockKey>& keys, bool ack = true) {
  auto a = c.admit(keys);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  if (ack) {
    StepPlan p = c.take_plan();
    EXPECT_TRUE(c.ack_plan(p, Status::Ok()).ok());
  }
  EXPECT_TRUE(c.commit_all(a->id).ok());
  EXPECT_TRUE(c.release(a->id).ok());
  return *a;
}

TEST(CacheManager, MissThenHitAfterCommit) {
  auto c = make_cache(testing::config(8));
  auto keys = path({1, 2, 3, 4});
  Admission a = run_request(*c, keys);
  EXPECT_EQ(a.new_blocks, 4u);
  EXPECT_EQ(a.device_hit_blocks, 0u);
  EXPECT_EQ(a.device_blocks.size(), 4u);
  MatchResult m = c->match(keys);
  EXPECT_EQ(m.device_blocks, 4u);
  EXPECT_EQ(m.device_ids, a.device_blocks);
  // A diverging request shares the first two blocks.
  Admission b = run_request(*c, path({1, 2, 9}));
  EXPECT_EQ(b.device_hit_blocks, 2u);
  EXPECT_EQ(b.new_blocks, 1u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, EvictionIsLeafOnlyAndWriteBackMovesToHost) {
  auto c = make_cache(testing::config(4, 16));
  auto a = path({1, 2, 3, 4});
  run_request(*c, a);
  // A new 2-block request needs 2 device blocks: the two deepest blocks of `a` go to host.
  auto adm = c->admit(path({7, 8}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.evictions.size(), 2u);
  std::set<BlockKey, bool (*)(const BlockKey&, const BlockKey&)> evicted(
      [](const BlockKey& x, const BlockKey& y) { return x.lo < y.lo || (x.lo == y.lo && x.hi < y.hi); });
  for (auto& e : p.evictions) evicted.insert(e.key);
  EXPECT_TRUE(evicted.count(a[3]) && evicted.count(a[2])) << "leaves first";
  // In flight: no match may serve them, from any tier.
  MatchResult m = c->match(a);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.host_blocks, 0u);
  EXPECT_TRUE(m.stopped_at_in_flight);
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  m = c->match(a);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.host_blocks, 2u);
  EXPECT_FALSE(m.stopped_at_in_flight);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

// max_hit_blocks: keys past the limit get fresh blocks (never a cached block another request reads), and
// commit() keeps the cached copies indexed.
TEST(CacheManager, MaxHitBlocksComputesPastTheLimit) {
  auto c = make_cache(testing::config(16));
  auto keys = path({1, 2, 3, 4});
  Admission a = run_request(*c, keys);
  auto b = c->admit(keys, 1, 2);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->device_hit_blocks, 2u);
  EXPECT_EQ(b->new_blocks, 2u);
  EXPECT_EQ(b->extra_blocks, 1u);
  ASSERT_EQ(b->device_blocks.size(), 5u);
  EXPECT_EQ(b->device_blocks[0], a.device_blocks[0]);
  EXPECT_EQ(b->device_blocks[1], a.device_blocks[1]);
  for (std::size_t i = 2; i < 5; ++i)
    EXPECT_EQ(std::count(a.device_blocks.begin(), a.device_blocks.end(), b->device_blocks[i]), 0) << i;
  EXPECT_EQ(c->stats().tiers[0].used, 7u);
  ASSERT_TRUE(c->commit_all(b->id).ok());
  ASSERT_TRUE(c->release(b->id).ok());
  EXPECT_EQ(c->match(keys).device_ids, a.device_blocks);
  EXPECT_EQ(c->stats().tiers[0].used, 4u);
  EXPECT_INVARIANTS(*c);

  // Host hits past the limit are not loaded.
  auto h = make_cache(testing::config(4, 16));
  run_request(*h, keys);
  run_request(*h, path({7, 8, 9, 10}));  // pushes all of `keys` to host
  ASSERT_EQ(h->match(keys).host_blocks, 4u);
  auto d = h->admit(keys, 0, 1);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->host_hit_blocks, 1u);
  EXPECT_EQ(d->new_blocks, 3u);
  EXPECT_EQ(h->take_plan().loads.size(), 1u);
  ASSERT_TRUE(h->release(d->id).ok());
  EXPECT_INVARIANTS(*h);
}

TEST(CacheManager, HostHitsLoadAndOnlyServeAfterTheAck) {
  auto c = make_cache(testing::config(4, 16));
  auto a = path({1, 2, 3, 4});
  run_request(*c, a);
  run_request(*c, path({7, 8, 9, 10}));  // pushes all of `a` to host
  MatchResult m = c->match(a);
  ASSERT_EQ(m.host_blocks, 4u);
  auto adm = c->admit(a);
  ASSERT_TRUE(adm.ok());
  EXPECT_EQ(adm->host_hit_blocks, 4u);
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.loads.size(), 4u);
  EXPECT_EQ(p.evictions.size(), 4u);  // the other request's blocks make room
  // Loads read the host copies the match saw.
  std::vector<BlockId> srcs;
  for (auto& l : p.loads) srcs.push_back(l.src);
  EXPECT_EQ(srcs, m.host_ids);
  auto st = c->admission_status(adm->id);
  EXPECT_EQ(st->loading_blocks, 4u);
  EXPECT_EQ(st->ready_blocks, 0u);
  EXPECT_TRUE(c->match(a).stopped_at_in_flight);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  st = c->admission_status(adm->id);
  EXPECT_EQ(st->ready_blocks, 4u);
  EXPECT_FALSE(st->failed);
  m = c->match(a);
  EXPECT_EQ(m.device_blocks, 4u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, FailedLoadTurnsIntoAMissNeverGarbage) {
  auto c = make_cache(testing::config(4, 16));
  auto a = path({1, 2, 3, 4});
  run_request(*c, a);
  run_request(*c, path({7, 8, 9, 10}));
  auto adm = c->admit(a);
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  // Block 2 of the loads fails.
  std::vector<BlockId> ok{p.loads[0].dst, p.loads[1].dst, p.loads[3].dst}, bad{p.loads[2].dst};
  ASSERT_TRUE(c->ack_loads(ok, Status::Ok()).ok());
  ASSERT_TRUE(c->ack_loads(bad, DataLoss("bad copy")).ok());
  auto st = c->admission_status(adm->id);
  EXPECT_TRUE(st->failed);
  EXPECT_EQ(st->ready_blocks, 2u);
  // The failed block's device copy and everything below it on the device are out of the index at once; their
  // host copies, intact, stay (the failed one's was only read).
  MatchResult m = c->match(a);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.host_blocks, 2u);
  EXPECT_INVARIANTS(*c);
  // Committing after a failure does not index the garbage chain.
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  m = c->match(a);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.host_blocks, 2u);
  EXPECT_INVARIANTS(*c);
  // The failed and detached device blocks went back to their pool.
  CacheStats s = c->stats();
  EXPECT_EQ(s.tiers[0].used, 2u) << "a[0..1]";
  EXPECT_EQ(s.tiers[1].used, 4u /*a's host copies*/ + 4 /*7..10*/);
}

// A failed load of an admitted block kept its host copy (and those below it): the next admission loads them again
// and is served; a host copy that fails a second load goes, so bytes that are themselves bad cost one more failed
// load, not one per request. The bytes of every load are the host copy's (the moves read the same host blocks).
TEST(CacheManager, AFailedLoadKeepsItsHostCopyOnceASecondFailureDropsIt) {
  auto c = make_cache(testing::config(4, 16));
  auto a = path({1, 2, 3, 4});
  run_request(*c, a);
  run_request(*c, path({7, 8, 9, 10}));  // a -> host
  const std::vector<BlockId> host_of_a = c->match(a).host_ids;
  ASSERT_EQ(host_of_a.size(), 4u);
  auto fail_block_1 = [&](bool second) {
    auto adm = c->admit(a);
    ASSERT_TRUE(adm.ok()) << adm.status().to_string();
    StepPlan p = c->take_plan();
    ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
    ASSERT_EQ(p.loads.size(), second ? 3u : 4u);
    std::vector<BlockId> ok, bad;
    for (const BlockMove& l : p.loads) (l.key == a[1] ? bad : ok).push_back(l.dst);
    ASSERT_EQ(bad.size(), 1u);
    ASSERT_TRUE(c->ack_loads(bad, DataLoss("bad copy")).ok());
    ASSERT_TRUE(c->ack_loads(ok, Status::Ok()).ok());
    EXPECT_TRUE(c->admission_status(adm->id)->failed);
    ASSERT_TRUE(c->commit_all(adm->id).ok());
    ASSERT_TRUE(c->release(adm->id).ok());
    EXPECT_INVARIANTS(*c);
  };
  fail_block_1(false);
  MatchResult m = c->match(a);
  EXPECT_EQ(m.device_blocks, 1u);
  EXPECT_EQ(m.host_blocks, 3u);
  EXPECT_EQ(std::vector<BlockId>(host_of_a.begin() + 1, host_of_a.end()), m.host_ids) << "the same host copies";
  // Loaded again: a[1] reads the host block it failed to read before.
  {
    auto adm = c->admit(a);
    ASSERT_TRUE(adm.ok());
    StepPlan p = c->take_plan();
    ASSERT_EQ(p.loads.size(), 3u);
    for (const BlockMove& l : p.loads) {
      if (l.key == a[1]) {
        EXPECT_EQ(l.src, host_of_a[1]);
      }
    }
    ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
    auto st = c->admission_status(adm->id);
    EXPECT_FALSE(st->failed);
    EXPECT_EQ(st->ready_blocks, 4u);
    ASSERT_TRUE(c->release(adm->id).ok());
  }
  EXPECT_EQ(c->match(a).device_blocks, 4u);
  EXPECT_INVARIANTS(*c);
  // A read that succeeded cleared the mark: one more failure keeps the copy again.
  run_request(*c, path({7, 8, 9, 10}));
  ASSERT_EQ(c->match(a).host_blocks, 4u);
  fail_block_1(false);
  EXPECT_EQ(c->match(a).host_blocks, 3u);
  // A second failure in a row drops a[1]'s host copy and, below it, the ones that can only follow it.
  fail_block_1(true);
  m = c->match(a);
  EXPECT_EQ(m.device_blocks, 1u);
  EXPECT_EQ(m.host_blocks, 0u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, FailedEvictionDropsTheSubtree) {
  auto c = make_cache(testing::config(4, 16));
  auto a = path({1, 2, 3, 4});
  run_request(*c, a);
  auto adm = c->admit(path({7, 8, 9, 10}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.evictions.size(), 4u);
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Unavailable("link down")).ok());
  EXPECT_EQ(c->match(a).total(), 0u);
  EXPECT_EQ(c->stats().tiers[1].used, 0u);
  EXPECT_EQ(c->stats().failed_transfers, 4u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, StaleOrUnknownAcksAreRejected) {
  auto c = make_cache(testing::config(4, 4));
  std::vector<BlockId> ids{0};
  EXPECT_EQ(c->ack_loads(ids, Status::Ok()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->ack_evictions(ids, Status::Ok()).code(), StatusCode::kFailedPrecondition);
  std::vector<BlockId> big{1000};
  EXPECT_EQ(c->ack_backups(big, Status::Ok()).code(), StatusCode::kFailedPrecondition);
}

// Each kind of ack names the block it could not find and changes nothing when one block of the list has no such
// move in flight (the acks are all-or-nothing).
TEST(CacheManager, StaleAcksNameTheBlockAndChangeNothing) {
  auto c = make_cache(testing::config(4, 8, 8));
  const std::vector<BlockId> zero{0};
  EXPECT_EQ(c->ack_evictions(zero, Status::Ok()).message(), "eviction: host block 0 has no eviction in flight");
  EXPECT_EQ(c->ack_backups(zero, Status::Ok()).message(), "backup: host block 0 has no backup in flight");
  EXPECT_EQ(c->ack_loads(zero, Status::Ok()).message(), "load: device block 0 has no load in flight");
  EXPECT_EQ(c->ack_storage_writes(zero, Status::Ok()).message(),
            "storage write: storage slot 0 has no write in flight");
  EXPECT_EQ(c->ack_storage_prefetches(zero, Status::Ok()).message(),
            "prefetch: host block 0 has no prefetch in flight");
  // A valid eviction listed with a stale block: refused as a whole, the eviction stays in flight.
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4}));
  auto adm = c->admit(path({5, 6}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.evictions.size(), 2u);
  BlockId stale = 0;
  while (stale == p.evictions[0].dst || stale == p.evictions[1].dst) ++stale;
  std::vector<BlockId> mixed{p.evictions[0].dst, stale};
  EXPECT_EQ(c->ack_evictions(mixed, Status::Ok()).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(c->match(a).stopped_at_in_flight || c->match(path({3, 4})).stopped_at_in_flight);
  // An ack of the right kind in the wrong list (an eviction's host block acked as a backup) is refused too.
  EXPECT_EQ(c->ack_backups(dsts(p.evictions), Status::Ok()).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(c->stats().failed_transfers, 0u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

// A block listed twice in one ack is settled once: counted once, tracked once, and its failure counted once.
TEST(CacheManager, AckListingABlockTwiceSettlesItOnce) {
  auto c = make_cache(testing::config(2, 8));
  auto a = path({1, 2});
  run_request(*c, a);
  auto adm = c->admit(path({3, 4}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.evictions.size(), 2u);
  std::vector<BlockId> twice{p.evictions[0].dst, p.evictions[1].dst, p.evictions[0].dst};
  ASSERT_TRUE(c->ack_evictions(twice, Status::Ok()).ok());
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  EXPECT_EQ(c->stats().tiers[1].resident, 2u);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
  // Loads of a, one of them listed twice and failed: one failure, the subtree a miss.
  auto again = c->admit(a);
  ASSERT_TRUE(again.ok());
  StepPlan q = c->take_plan();
  ASSERT_EQ(q.loads.size(), 2u);
  ASSERT_TRUE(c->ack_evictions(dsts(q.evictions), Status::Ok()).ok());
  std::vector<BlockId> bad{q.loads[1].dst, q.loads[1].dst};
  ASSERT_TRUE(c->ack_loads(bad, DataLoss("bad copy")).ok());
  EXPECT_EQ(c->stats().failed_transfers, 1u);
  ASSERT_TRUE(c->ack_loads(std::vector<BlockId>{q.loads[0].dst}, Status::Ok()).ok());
  EXPECT_EQ(c->match(a).device_blocks, 1u);
  EXPECT_EQ(c->match(a).host_blocks, 1u) << "the failed load's host copy stays";
  ASSERT_TRUE(c->release(again->id).ok());
  EXPECT_INVARIANTS(*c);
}

// A move whose block was invalidated while it ran (its parent's load failed) only settles: its outcome is not
// counted, it never joins a tier, and its blocks go back to the pools once nothing holds the node.
TEST(CacheManager, AckOfABlockInvalidatedInFlightOnlyReclaimsIt) {
  auto c = make_cache(testing::config(2, 8));
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4}));  // a -> host
  auto adm = c->admit(a);
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.loads.size(), 2u);
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  const BlockId parent = p.loads[0].key == a[0] ? p.loads[0].dst : p.loads[1].dst;
  const BlockId child = p.loads[0].key == a[0] ? p.loads[1].dst : p.loads[0].dst;
  ASSERT_TRUE(c->ack_loads(std::vector<BlockId>{parent}, DataLoss("bad copy")).ok());
  EXPECT_EQ(c->stats().failed_transfers, 1u);
  ASSERT_TRUE(c->ack_loads(std::vector<BlockId>{child}, Status::Ok()).ok());
  EXPECT_EQ(c->stats().failed_transfers, 1u) << "the invalidated block's outcome is not counted";
  EXPECT_EQ(c->match(a).device_blocks, 0u);
  EXPECT_EQ(c->match(a).host_blocks, 2u) << "both host copies stay indexed";
  EXPECT_INVARIANTS(*c);
  ASSERT_TRUE(c->release(adm->id).ok());
  const CacheStats s = c->stats();
  EXPECT_EQ(s.tiers[0].used, 0u) << "a's device blocks went back (3, 4 made room for them)";
  EXPECT_EQ(s.tiers[1].used, 4u) << "3, 4 and a's host copies";
  EXPECT_INVARIANTS(*c);
}

// Write-through to storage (kStoring): a copy written lands in storage beside the host copy; a failed write frees
// the storage slot and leaves the host copy as it was.
TEST(CacheManager, StoreThroughAcks) {
  auto c = make_cache(
      testing::with(testing::config(2, 8, 8), [](CacheConfig& cf) { cf.write_policy = WritePolicy::kWriteThrough; }));
  auto a = path({1, 2});
  auto b = path({3, 4});
  std::uint32_t slots = 0;
  for (const auto& keys : {a, b}) {
    auto adm = c->admit(keys);
    ASSERT_TRUE(adm.ok());
    ASSERT_TRUE(c->commit_all(adm->id).ok());
    StepPlan p = c->take_plan();
    ASSERT_EQ(p.backups.size(), 2u);
    ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());  // backups land on host: store-through queued
    ASSERT_TRUE(c->release(adm->id).ok());
    StepPlan w = c->take_plan();
    ASSERT_EQ(w.storage_writes.size(), 2u);
    slots += 2;
    EXPECT_EQ(c->stats().tiers[2].used, slots);
    EXPECT_EQ(c->match(keys).device_blocks, 2u) << "the device copies stay servable during the write";
    const Status outcome = keys == a ? Status::Ok() : Unavailable("disk gone");
    ASSERT_TRUE(c->ack_storage_writes(dsts(w.storage_writes), outcome).ok());
    EXPECT_INVARIANTS(*c);
  }
  const CacheStats s = c->stats();
  EXPECT_EQ(s.failed_transfers, 2u);
  EXPECT_EQ(s.tiers[2].used, 2u) << "b's slots went back";
  EXPECT_EQ(s.tiers[2].resident, 2u);
  EXPECT_EQ(s.tiers[1].used, 4u) << "both host copies stay";
  EXPECT_EQ(c->match(a).host_blocks, 2u) << "a's device copies made room for b";
  EXPECT_EQ(c->match(b).device_blocks, 2u);
  EXPECT_INVARIANTS(*c);
}

// A failed storage prefetch turns the block and its subtree into a miss; its host block goes back.
TEST(CacheManager, FailedStoragePrefetchIsAMiss) {
  auto c = make_cache(testing::with(testing::config(2, 4, 16), [](CacheConfig& cf) {
    cf.host_watermarks = Watermarks{0.5, 1.0};
  }));
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4}));
  auto adm = c->admit(path({5, 6}));
  ASSERT_TRUE(adm.ok());
  ASSERT_TRUE(c->ack_plan(c->take_plan(), Status::Ok()).ok());
  ASSERT_EQ(c->match(a).storage_blocks, 2u);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  const std::uint32_t host_used = c->stats().tiers[1].used, storage_used = c->stats().tiers[2].used;
  auto n = c->prefetch(a);
  ASSERT_TRUE(n.ok());
  ASSERT_EQ(*n, 2u);
  StepPlan f = c->take_plan();
  ASSERT_EQ(f.storage_prefetches.size(), 2u);
  EXPECT_EQ(c->stats().tiers[1].used, host_used + 2);
  ASSERT_TRUE(c->ack_storage_prefetches(dsts(f.storage_prefetches), Unavailable("disk gone")).ok());
  EXPECT_EQ(c->match(a).total(), 0u);
  EXPECT_FALSE(c->match(a).stopped_at_in_flight);
  // Both prefetches failed: each ack counts, the child's too (its parent's failure had invalidated it already).
  EXPECT_EQ(c->stats().failed_transfers, 2u);
  EXPECT_EQ(c->stats().tiers[1].used, host_used);
  // a's storage copies went with the subtree; the plan's watermark demotions (if any) hold new slots.
  EXPECT_EQ(c->stats().tiers[2].used, storage_used - 2 + f.storage_writes.size());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, HostBlockNotReusedWhileALoadReadsIt) {
  // Host tier of 4: a load reads host blocks while a new request's evictions need host space.
  auto c = make_cache(testing::config(4, 4));
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4, 5, 6}));  // a -> host (2 blocks)
  auto adm = c->admit(a);               // loads a; evicts 2 of {3..6} to host
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.loads.size(), 2u);
  // Now more pressure while the loads are still in flight.
  auto adm2 = c->admit(path({20, 21}));
  StepPlan p2 = c->take_plan();
  std::set<BlockId> reading{p.loads[0].src, p.loads[1].src};
  for (const auto& e : p.evictions) EXPECT_FALSE(reading.count(e.dst));
  for (const auto& e : p2.evictions) EXPECT_FALSE(reading.count(e.dst)) << "host block " << e.dst << " reused";
  for (const auto& e : p2.backups) EXPECT_FALSE(reading.count(e.dst));
  EXPECT_INVARIANTS(*c);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  ASSERT_TRUE(c->ack_plan(p2, Status::Ok()).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  if (adm2.ok()) {
    ASSERT_TRUE(c->release(adm2->id).ok());
  }
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, PinnedBlocksAreNeverEvicted) {
  auto c = make_cache(testing::config(4, 8));
  auto a = c->admit(path({1, 2, 3}));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c->commit_all(a->id).ok());
  auto b = c->admit(path({5, 6}));
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(c->match(path({1, 2, 3})).device_blocks, 3u);
  auto b2 = c->admit(path({5}));
  ASSERT_TRUE(b2.ok());
  ASSERT_TRUE(c->release(a->id).ok());
  ASSERT_TRUE(c->release(b2->id).ok());
  EXPECT_INVARIANTS(*c);
  // Too large for the device at all.
  EXPECT_EQ(c->admit(path({1, 2, 3, 4, 5})).status().code(), StatusCode::kResourceExhausted);
}

TEST(CacheManager, ContiguousHostRunsForEvictionBatches) {
  auto c = make_cache(testing::config(8, 64));
  run_request(*c, path({1, 2, 3, 4, 5, 6, 7, 8}));
  auto adm = c->admit(path({11, 12, 13, 14, 15, 16, 17, 18}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.evictions.size(), 8u);
  std::vector<BlockId> d = dsts(p.evictions);
  std::sort(d.begin(), d.end());
  for (std::size_t i = 1; i < d.size(); ++i) EXPECT_EQ(d[i], d[0] + i);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
}

TEST(CacheManager, WriteThroughBacksUpAtCommitAndEvictsWithoutCopies) {
  auto c = make_cache(
      testing::with(testing::config(4, 16), [](CacheConfig& cf) { cf.write_policy = WritePolicy::kWriteThrough; }));
  auto a = path({1, 2, 3, 4});
  auto adm = c->admit(a);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  StepPlan p = c->take_plan();
  EXPECT_EQ(p.backups.size(), 4u);
  // Backed-up blocks stay servable from device while the copy runs.
  EXPECT_EQ(c->match(a).device_blocks, 4u);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  auto adm2 = c->admit(path({9, 10}));
  StepPlan p2 = c->take_plan();
  EXPECT_EQ(p2.evictions.size(), 0u) << "the host already has the copies";
  EXPECT_EQ(c->stats().drops_device, 2u);
  MatchResult m = c->match(a);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.host_blocks, 2u);
  ASSERT_TRUE(c->commit_all(adm2->id).ok());
  ASSERT_TRUE(c->release(adm2->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, WriteThroughSelectiveWaitsForTheHitThreshold) {
  auto c = make_cache(testing::with(testing::config(8, 16), [](CacheConfig& cf) {
    cf.write_policy = WritePolicy::kWriteThroughSelective;
    cf.write_through_threshold = 2;
  }));
  auto a = path({1, 2});
  run_request(*c, a);
  EXPECT_TRUE(c->take_plan().backups.empty());
  run_request(*c, a, /*ack=*/true);  // hit 1
  EXPECT_TRUE(c->take_plan().backups.empty());
  auto adm = c->admit(a);  // hit 2 reaches the threshold
  StepPlan p = c->take_plan();
  EXPECT_EQ(p.backups.size(), 2u);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  // A selective policy drops un-backed-up leaves instead of copying them.
  run_request(*c, path({5, 6, 7, 8, 9, 10, 11, 12}));
  MatchResult m = c->match(a);
  EXPECT_EQ(m.host_blocks, 2u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, FailedBackupKeepsTheDeviceCopy) {
  auto c = make_cache(
      testing::with(testing::config(4, 16), [](CacheConfig& cf) { cf.write_policy = WritePolicy::kWriteThrough; }));
  auto a = path({1, 2});
  auto adm = c->admit(a);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  StepPlan p = c->take_plan();
  ASSERT_TRUE(c->ack_backups(dsts(p.backups), Unavailable("x")).ok());
  EXPECT_EQ(c->match(a).device_blocks, 2u);
  EXPECT_EQ(c->stats().tiers[1].used, 0u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, DeviceWatermarksEvictAhead) {
  auto c = make_cache(testing::with(testing::config(10, 32), [](CacheConfig& cf) {
    cf.device_watermarks = Watermarks{0.2, 0.5};
  }));
  run_request(*c, path({1, 2, 3, 4, 5, 6, 7}));
  EXPECT_TRUE(c->take_plan().evictions.empty()) << "3 free of 10 is above the low mark";
  run_request(*c, path({1, 2, 3, 4, 5, 6, 7, 8, 9}));
  StepPlan p = c->take_plan();
  EXPECT_EQ(p.evictions.size(), 4u) << "1 free < 2: evict until 5 are free";
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(c->stats().tiers[0].used, 5u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, HostWatermarksDemoteToStorageAndPrefetchBack) {
  auto c = make_cache(testing::with(testing::config(2, 4, 16), [](CacheConfig& cf) {
    cf.host_watermarks = Watermarks{0.5, 1.0};
  }));
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4}));      // a -> host; 2 of 4 host blocks free: not below the low mark
  auto adm = c->admit(path({5, 6}));  // 3, 4 -> host: host full
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  EXPECT_EQ(p.evictions.size(), 2u);
  ASSERT_EQ(p.storage_writes.size(), 2u) << "settled host blocks (a) are demoted, in-flight ones wait";
  EXPECT_EQ(c->stats().tiers[1].used, 4u) << "host blocks are held until the writes land";
  EXPECT_TRUE(c->match(a).stopped_at_in_flight);
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(c->stats().tiers[1].used, 2u);
  MatchResult m = c->match(a);
  EXPECT_EQ(m.storage_blocks, 2u);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());
  auto n = c->prefetch(a);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  StepPlan f = c->take_plan();
  ASSERT_EQ(f.storage_prefetches.size(), 2u);
  EXPECT_TRUE(c->match(a).stopped_at_in_flight);
  ASSERT_TRUE(c->ack_plan(f, Status::Ok()).ok());
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, FakeExecutorDelaysAndFailures) {
  FakePlanExecutor::Options o;
  o.delay_polls = 2;
  o.fail = [](MoveKind k, const BlockMove&) { return k == MoveKind::kLoad; };
  FakePlanExecutor ex(o);
  auto c = make_cache(testing::config(2, 8));
  auto a = path({1, 2});
  run_request(*c, a);
  run_request(*c, path({3, 4}));
  auto adm = c->admit(a);
  ASSERT_TRUE(ex.execute(c->take_plan()).ok());
  EXPECT_TRUE(ex.poll().empty());
  EXPECT_TRUE(ex.poll().empty());
  EXPECT_TRUE(c->admission_status(adm->id)->loading_blocks == 2);
  ASSERT_TRUE(apply_completions(*c, ex.poll()).ok());
  EXPECT_TRUE(c->admission_status(adm->id)->failed);
  EXPECT_EQ(c->match(a).device_blocks, 0u);
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(CacheManager, ConfigValidation) {
  EXPECT_FALSE(CacheManager::create(testing::config(0)).ok());
  EXPECT_FALSE(
      CacheManager::create(testing::with(testing::config(4), [](CacheConfig& cf) { cf.device_policy = "nope"; })).ok());
  EXPECT_FALSE(CacheManager::create(testing::with(testing::config(4), [](CacheConfig& cf) {
                 cf.device_watermarks = Watermarks{0.6, 0.5};
               })).ok());
  // A storage tier without a host tier took no block (storage is written from host blocks): refused, named.
  auto no_host = CacheManager::create(testing::with(testing::config(4), [](CacheConfig& cf) {
    cf.host_blocks = 0;
    cf.storage_blocks = 64;
  }));
  EXPECT_EQ(no_host.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_host.status().message().find("storage_blocks 64 with host_blocks 0"), std::string::npos)
      << no_host.status().to_string();
  // Set in the struct, not through the config table: a write policy outside the enum planned neither evictions nor
  // backups (blocks dropped), and NaN watermarks passed every comparison.
  auto bad_policy = CacheManager::create(
      testing::with(testing::config(4), [](CacheConfig& cf) { cf.write_policy = static_cast<WritePolicy>(42); }));
  EXPECT_EQ(bad_policy.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_policy.status().message().find("write_policy 42"), std::string::npos)
      << bad_policy.status().to_string();
  for (const Watermarks w : {Watermarks{std::nan(""), 0.5}, Watermarks{0.1, std::nan("")}})
    EXPECT_EQ(CacheManager::create(testing::with(testing::config(4), [&](CacheConfig& cf) { cf.host_watermarks = w; }))
                  .status()
                  .code(),
              StatusCode::kInvalidArgument);
}

// A failed admission changes nothing: the case of a 10-block device holding 8 cached blocks,
// 2 of them pinned, asked for 9 new blocks. A twin cache that never saw the failed admission must
// then behave identically (same matches, same plans: the policy state is the same too).
class FailedAdmission : public ::testing::TestWithParam<const char*> {};

TEST_P(FailedAdmission, LeavesIndexPoolsAndPolicyAsTheyWere) {
  auto cfg = testing::with(testing::config(10), [](CacheConfig& c) { c.device_policy = GetParam(); });
  auto c = make_cache(cfg), twin = make_cache(cfg);
  const auto cached = path({1, 2, 3, 4, 5, 6, 7, 8});
  for (CacheManager* m : {c.get(), twin.get()}) {
    run_request(*m, cached);
    run_request(*m, path({1, 2, 3}));  // touches: the policies' order is not insertion order
  }
  const auto pinned_keys = std::vector<BlockKey>(cached.begin(), cached.begin() + 2);
  auto pin = c->admit(pinned_keys);
  auto twin_pin = twin->admit(pinned_keys);
  ASSERT_TRUE(pin.ok() && twin_pin.ok());
  const CacheStats before = c->stats();
  EXPECT_EQ(c->reclaimable_device_blocks(), 6u);
  auto big = c->admit(path({100, 101, 102, 103, 104, 105, 106, 107, 108}));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted) << big.status().to_string();
  EXPECT_NE(big.status().message().find("6 more evictable"), std::string::npos) << big.status().to_string();
  EXPECT_EQ(c->match(cached).device_blocks, 8u) << "the cached prefix must survive a failed admission";
  EXPECT_EQ(c->stats().tiers[0].used, before.tiers[0].used);
  EXPECT_EQ(c->stats().tiers[0].resident, before.tiers[0].resident);
  EXPECT_EQ(c->stats().drops_device, before.drops_device);
  EXPECT_TRUE(c->take_plan().empty());
  EXPECT_INVARIANTS(*c);
  // From here on both caches see the same requests and must make the same choices.
  ASSERT_TRUE(c->release(pin->id).ok());
  ASSERT_TRUE(twin->release(twin_pin->id).ok());
  for (std::uint64_t r = 0; r < 12; ++r) {
    auto keys = path({1, 2, 200 + r, 300 + r});
    Admission a = run_request(*c, keys), b = run_request(*twin, keys);
    EXPECT_EQ(a.device_hit_blocks, b.device_hit_blocks) << "request " << r;
    EXPECT_EQ(a.device_blocks, b.device_blocks) << "request " << r;
    EXPECT_EQ(c->match(cached).device_blocks, twin->match(cached).device_blocks) << "request " << r;
  }
  EXPECT_INVARIANTS(*c);
}

INSTANTIATE_TEST_SUITE_P(Policies, FailedAdmission,
                         ::testing::Values("lru", "s3fifo", "sieve", "arc", "lrfu", "adaptive"));

// Keys that are not a hash chain are rejected before anything is pinned, loaded or allocated. A
// repeated key on the host once queued two loads of one block and leaked a device block.
TEST(CacheManager, AdmitRejectsKeysThatAreNotAHashChain) {
  auto c = make_cache(testing::config(4, 8));
  const auto a = path({1});
  const auto chain = path({1, 2, 3});
  run_request(*c, a);
  run_request(*c, path({5, 6, 7, 8}));  // pushes `a` to host
  ASSERT_EQ(c->match(a).host_blocks, 1u);
  const CacheStats before = c->stats();
  struct Case {
    std::vector<BlockKey> keys;
    const char* says;
  };
  const std::vector<Case> cases = {
      {{a[0], a[0]}, "repeats (positions 0 and 1)"},
      {{chain[0], chain[1], chain[0]}, "repeats (positions 0 and 2)"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    auto r = c->admit(cases[i].keys);
    ASSERT_FALSE(r.ok()) << "case " << i;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(cases[i].says), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().message().find("hash chain"), std::string::npos) << r.status().to_string();
    EXPECT_TRUE(c->take_plan().empty()) << "case " << i;
    EXPECT_EQ(c->stats().tiers[0].used, before.tiers[0].used) << "case " << i;
    EXPECT_EQ(c->stats().tiers[1].used, before.tiers[1].used) << "case " << i;
    EXPECT_INVARIANTS(*c);
  }
  run_request(*c, chain);
  // chain[1] is indexed below chain[0]: as a first key, or after another key, it is not a chain.
  for (const std::vector<BlockKey>& keys : {std::vector<BlockKey>{chain[1]}, std::vector<BlockKey>{a[0], chain[2]},
                                            std::vector<BlockKey>{chain[0], chain[2]}}) {
    auto r = c->admit(keys);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(keys[keys.size() - 1].hex()), std::string::npos) << r.status().to_string();
    EXPECT_INVARIANTS(*c);
  }
  // match() never follows an indexed key that is not below the previous one.
  EXPECT_EQ(c->match(std::vector<BlockKey>{chain[0], chain[2]}).total(), 1u);
  EXPECT_EQ(c->match(std::vector<BlockKey>{chain[1]}).total(), 0u);
  auto ok = c->admit(chain);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  ASSERT_TRUE(c->release(ok->id).ok());
  EXPECT_INVARIANTS(*c);
}

}  // namespace
}  // namespace kvtier::cache
