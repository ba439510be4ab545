// Write-back with a storage tier under host pressure: a host block that is a
// block's last copy ("dirty") is written to storage before its host block is
// given up, also when the host tier is full and a block is wanted now (no
// watermarks here: only the pressure path can demote). Unit tests on the plan
// and acks, then the same with real bytes through a disk tier (and a failing
// one), then a trace replay without host watermarks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/cache/storage_executor.h"
#include "kvtier/testing/fault_injection.h"
#include "kvtier/testing/plan_executors.h"
#include "sim/replay.h"
#include "tests/cache/cache_test_util.h"
#include "tests/storage/storage_test_util.h"

namespace kvtier::cache {
namespace {

using testing::dsts;
using testing::make_cache;
using testing::path;

CacheConfig write_back(std::uint32_t device, std::uint32_t host, std::uint32_t storage) {
  CacheConfig c = testing::config(device, host, storage);
  c.write_policy = WritePolicy::kWriteBack;
  c.host_watermarks = Watermarks{};  // pressure only
  return c;
}

// Admits `keys`, acks the plan, commits and releases; returns the plan of the admission step.
StepPlan run_acked(CacheManager& c, const std::vector<BlockKey>& keys, const Status& ack = Status::Ok()) {
  auto a = c.admit(keys);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  StepPlan p = c.take_plan();
  EXPECT_TRUE(c.ack_plan(p, ack).ok());
  if (a.ok()) {
    EXPECT_TRUE(c.commit_all(a->id).ok());
    EXPECT_TRUE(c.release(a->id).ok());
  }
  return p;
}

// An acknowledgement that fails (a completion naming no move in flight) no longer stops the others: the executor
// has forgotten them all, so apply_completions() and ack_plan() that returned at the first error left the rest in
// flight in the cache forever (reset() refused, blocks never freed).
TEST(Acknowledgements, AFailedAckLeavesTheOthersApplied) {
  auto c = make_cache(testing::config(2, 4));
  ASSERT_TRUE(c);
  run_acked(*c, path({1, 2}));
  const std::vector<BlockKey> second = path({10, 11});
  auto a = c->admit(second);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  StepPlan plan = c->take_plan();
  ASSERT_FALSE(plan.evictions.empty());
  const std::vector<BlockId> evicted = dsts(plan.evictions);
  const std::vector<Completion> done = {Completion{MoveKind::kLoad, {77}, Status::Ok()},
                                        Completion{MoveKind::kEviction, evicted, Status::Ok()}};
  EXPECT_FALSE(apply_completions(*c, done).ok()) << "no load into block 77 is in flight";
  EXPECT_FALSE(c->ack_evictions(evicted, Status::Ok()).ok()) << "the evictions were acknowledged by the call above";
  EXPECT_TRUE(c->check_invariants().ok());
  ASSERT_TRUE(c->commit_all(a->id).ok());
  ASSERT_TRUE(c->release(a->id).ok());

  // ack_plan: a kind whose ack fails (here: evictions acknowledged twice) no longer keeps the later kinds in flight.
  const std::vector<BlockKey> third = path({1, 2});  // on host now: loads, and evictions of the second path
  auto b = c->admit(third);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  StepPlan p2 = c->take_plan();
  ASSERT_FALSE(p2.evictions.empty());
  ASSERT_TRUE(c->ack_evictions(dsts(p2.evictions), Status::Ok()).ok());
  EXPECT_FALSE(c->ack_plan(p2, Status::Ok()).ok());
  ASSERT_FALSE(p2.loads.empty());
  EXPECT_FALSE(c->ack_loads(dsts(p2.loads), Status::Ok()).ok()) << "the loads were acknowledged by ack_plan";
  EXPECT_TRUE(c->check_invariants().ok());
}

TEST(WriteBackPressure, DirtyHostBlockIsWrittenToStorageBeforeItsBlockIsFreed) {
  auto c = make_cache(write_back(2, 4, 16));
  auto a = path({1, 2}), b = path({3, 4}), cc = path({5, 6}), d = path({7, 8});
  run_acked(*c, a);
  run_acked(*c, b);   // a -> host
  run_acked(*c, cc);  // b -> host: the host tier is full of dirty blocks
  ASSERT_EQ(c->stats().tiers[1].used, 4u);
  const std::vector<BlockId> a_host = c->match(a).host_ids;
  ASSERT_EQ(a_host.size(), 2u);

  auto adm = c->admit(d);  // cc must leave the device; the host has no block free
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.storage_writes.size(), 2u) << "the host's LRU dirty blocks (a) are written to storage";
  for (const BlockMove& w : p.storage_writes) {
    EXPECT_TRUE(w.key == a[0] || w.key == a[1]);
    EXPECT_TRUE(w.src == a_host[0] || w.src == a_host[1]) << "the write reads a's host block";
  }
  // Held (and unservable) until the writes land; nothing was lost from the host tier.
  EXPECT_EQ(c->stats().tiers[1].used, 4u);
  EXPECT_TRUE(c->match(a).stopped_at_in_flight);
  EXPECT_EQ(c->match(a).total(), 0u);
  EXPECT_EQ(c->stats().lost_host_drops, 0u);
  EXPECT_EQ(c->stats().pressure_demotions, 2u);
  for (const BlockMove& e : p.evictions)
    EXPECT_TRUE(e.dst != a_host[0] && e.dst != a_host[1]) << "host block " << e.dst << " reused under the write";
  EXPECT_INVARIANTS(*c);

  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  EXPECT_EQ(c->stats().tiers[1].used, 2u) << "a's host blocks are freed at the writes' ack";
  MatchResult m = c->match(a);
  EXPECT_EQ(m.storage_blocks, 2u) << "the evicted prefix is found in storage";
  EXPECT_EQ(c->match(b).host_blocks, 2u);
  ASSERT_TRUE(c->commit_all(adm->id).ok());
  ASSERT_TRUE(c->release(adm->id).ok());

  // Requested again: prefetched to host, then loaded.
  auto q = c->prefetch(a);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 2u);
  StepPlan f = c->take_plan();
  ASSERT_EQ(f.storage_prefetches.size(), 2u);
  ASSERT_TRUE(c->ack_plan(f, Status::Ok()).ok());
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  auto again = c->admit(a);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->host_hit_blocks, 2u);
  StepPlan l = c->take_plan();
  EXPECT_EQ(l.loads.size(), 2u);
  ASSERT_TRUE(c->ack_plan(l, Status::Ok()).ok());
  EXPECT_EQ(c->admission_status(again->id)->ready_blocks, 2u);
  ASSERT_TRUE(c->release(again->id).ok());
  EXPECT_INVARIANTS(*c);
}

// Every storage slot the cache gives up is in a plan's storage_drops with its key, once: room for newer blocks
// and failed writes alike (an executor deletes their objects; before, nothing told it and the backend grew).
TEST(WriteBackPressure, EveryStorageSlotGivenUpIsInAPlansDrops) {
  auto c = make_cache(write_back(2, 2, 4));
  std::vector<BlockKey> dropped;
  std::uint64_t writes = 0;
  for (std::uint64_t i = 0; i < 40; ++i) {
    // Every fifth request's storage writes fail: their slots are given up at the ack.
    const Status ack = i % 5 == 4 ? Unavailable("disk gone") : Status::Ok();
    StepPlan p = run_acked(*c, path({100 + 2 * i, 101 + 2 * i}), ack);
    writes += p.storage_writes.size();
    for (const BlockMove& d : p.storage_drops) {
      EXPECT_EQ(d.dst, kNoBlock);
      EXPECT_LT(d.src, 4u) << "a storage slot";
      dropped.push_back(d.key);
    }
    StepPlan after = c->take_plan();  // drops made by the acks
    for (const BlockMove& d : after.storage_drops) dropped.push_back(d.key);
    EXPECT_EQ(after.size(), 0u);
  }
  ASSERT_GT(writes, 20u);
  const CacheStats st = c->stats();
  EXPECT_GE(dropped.size(), st.drops_storage);
  EXPECT_EQ(dropped.size() + st.tiers[2].used, writes) << "every slot written is held or was dropped";
  for (const BlockKey& k : dropped) EXPECT_EQ(c->match(std::vector<BlockKey>{k}).storage_blocks, 0u);
  std::sort(dropped.begin(), dropped.end(),
            [](const BlockKey& a, const BlockKey& b) { return std::tie(a.hi, a.lo) < std::tie(b.hi, b.lo); });
  EXPECT_EQ(std::adjacent_find(dropped.begin(), dropped.end()), dropped.end()) << "a slot dropped twice";
  EXPECT_INVARIANTS(*c);
}

TEST(WriteBackPressure, FailedWriteKeepsTheHostCopyAndNeverReportsStorage) {
  auto c = make_cache(write_back(2, 4, 16));
  auto a = path({1, 2});
  run_acked(*c, a);
  run_acked(*c, path({3, 4}));
  run_acked(*c, path({5, 6}));
  auto adm = c->admit(path({7, 8}));
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.storage_writes.size(), 2u);
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  ASSERT_TRUE(c->ack_storage_writes(dsts(p.storage_writes), Unavailable("disk gone")).ok());
  // Acked in plan order, child first: a[1] failed while its parent's write was still in flight (the
  // parent counts as storage by then), so a[1] is dropped (a miss); a[0] failed below the root, so its
  // intact host copy stays. Neither is ever reported in storage.
  MatchResult m = c->match(a);
  EXPECT_EQ(m.storage_blocks, 0u) << "a failed write is never a storage copy";
  EXPECT_EQ(m.host_blocks, 1u) << "the host copy was intact: it stays";
  EXPECT_FALSE(m.stopped_at_in_flight);
  EXPECT_EQ(c->stats().tiers[2].used, 0u) << "the storage slots went back";
  EXPECT_EQ(c->stats().failed_transfers, 2u);
  EXPECT_EQ(c->stats().lost_host_drops, 0u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(WriteBackPressure, CleanHostCopiesGoBeforeDirtyOnes) {
  auto c = make_cache(write_back(2, 4, 16));
  auto a = path({1, 2}), b = path({3, 4});
  run_acked(*c, a);
  run_acked(*c, b);
  run_acked(*c, path({5, 6}));
  run_acked(*c, path({7, 8}));  // a -> storage (pressure)
  ASSERT_EQ(c->match(a).storage_blocks, 2u);
  auto q = c->prefetch(a);  // a back on host: clean (also in storage), more recent than b
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(*q, 2u);
  StepPlan f = c->take_plan();
  ASSERT_TRUE(c->ack_plan(f, Status::Ok()).ok());
  ASSERT_EQ(c->stats().tiers[1].used, 4u);
  const std::uint64_t demotions = c->stats().pressure_demotions;
  const std::uint64_t device_drops = c->stats().drops_device;

  StepPlan p = run_acked(*c, path({9, 10}));  // the device's blocks need host room
  EXPECT_EQ(p.evictions.size(), 2u) << "clean host copies make room at once";
  EXPECT_TRUE(p.storage_writes.empty()) << "b (dirty, older) is not demoted while a clean copy can go";
  EXPECT_EQ(c->stats().pressure_demotions, demotions);
  EXPECT_EQ(c->stats().drops_device, device_drops);
  EXPECT_EQ(c->match(b).host_blocks, 2u);
  EXPECT_EQ(c->match(a).storage_blocks, 2u) << "the dropped clean copies are still served from storage";
  EXPECT_EQ(c->stats().lost_host_drops, 0u);
  EXPECT_INVARIANTS(*c);
}

// a0 keeps children on host (a1, b1): it cannot be dropped from the device, only moved to host.
// Returns the cache with the device holding a0 alone and the host full of a1, b1 (dirty).
std::unique_ptr<CacheManager> device_parent_of_host_children() {
  auto c = make_cache(write_back(2, 2, 16));
  run_acked(*c, path({1, 2}));
  run_acked(*c, path({1, 3}));  // a1 -> host
  return c;
}

TEST(WriteBackPressure, AdmissionWaitsForHostRoomInsteadOfDroppingADirtyBlock) {
  auto c = device_parent_of_host_children();
  auto other = path({4, 5});
  auto adm = c->admit(other);  // b1 -> host fills it; a0 must go to host too, and none is free
  ASSERT_EQ(adm.status().code(), StatusCode::kResourceExhausted) << adm.status().to_string();
  EXPECT_EQ(c->stats().pressure_demotions, 1u);
  EXPECT_EQ(c->stats().lost_host_drops, 0u);
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.storage_writes.size(), 1u);
  EXPECT_TRUE(p.storage_writes[0].key == path({1, 2})[1]) << "the LRU dirty host block (a1) is written back";
  ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
  EXPECT_INVARIANTS(*c);

  adm = c->admit(other);  // after the write's ack a0 finds a host block
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  ASSERT_TRUE(c->ack_plan(c->take_plan(), Status::Ok()).ok());
  MatchResult m = c->match(path({1, 2}));
  EXPECT_EQ(m.host_blocks, 1u);
  EXPECT_EQ(m.storage_blocks, 1u);
  EXPECT_EQ(c->match(path({1, 3})).host_blocks, 2u);
  EXPECT_EQ(c->stats().lost_host_drops, 0u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(WriteBackPressure, WhileWritesFailABlockWhoseWriteFailedIsDroppedNotWaitedFor) {
  auto c = device_parent_of_host_children();
  auto other = path({4, 5});
  ASSERT_FALSE(c->admit(other).ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.storage_writes.size(), 1u);
  ASSERT_TRUE(c->ack_evictions(dsts(p.evictions), Status::Ok()).ok());
  ASSERT_TRUE(c->ack_storage_writes(dsts(p.storage_writes), Unavailable("disk gone")).ok());
  EXPECT_EQ(c->match(path({1, 2})).host_blocks, 1u) << "a1's write failed: its host copy is back";
  EXPECT_EQ(c->match(path({1, 2})).storage_blocks, 0u);

  // Storage is failing: waiting would not free anything, so the admission goes through by dropping
  // a host copy, the one whose write failed (b1 is tried next).
  auto adm = c->admit(other);
  ASSERT_TRUE(adm.ok()) << adm.status().to_string();
  EXPECT_EQ(c->stats().lost_host_drops, 1u);
  StepPlan q = c->take_plan();
  ASSERT_EQ(q.storage_writes.size(), 1u);
  EXPECT_TRUE(q.storage_writes[0].key == path({1, 3})[1]);
  ASSERT_TRUE(c->ack_plan(q, Status::Ok()).ok());
  MatchResult m = c->match(path({1, 2}));
  EXPECT_EQ(m.total(), 1u) << "a0 on host; a1 dropped after its failed write";
  EXPECT_EQ(m.storage_blocks, 0u);
  EXPECT_EQ(c->match(path({1, 3})).storage_blocks, 1u);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_INVARIANTS(*c);
}

TEST(WriteBackPressure, WithoutStorageTheHostDropsAsBefore) {
  auto c = make_cache(write_back(2, 4, 0));
  auto a = path({1, 2});
  run_acked(*c, a);
  run_acked(*c, path({3, 4}));
  run_acked(*c, path({5, 6}));
  StepPlan p = run_acked(*c, path({7, 8}));
  EXPECT_EQ(p.evictions.size(), 2u);
  EXPECT_TRUE(p.storage_writes.empty());
  EXPECT_EQ(c->match(a).total(), 0u);
  EXPECT_EQ(c->stats().lost_host_drops, 2u);
  EXPECT_EQ(c->stats().pressure_demotions, 0u);
  EXPECT_INVARIANTS(*c);
}

// ---- real bytes through a disk tier ------------------------------------------

using storage::testing::TempDir;

constexpr std::uint64_t kBlockBytes = 4096;

// A CacheManager whose host tier is a ReplayStorage's host pool and whose storage moves go to its
// disk tier (optionally behind a FaultInjectingBackend). Device moves have no bytes: an eviction
// lands its key's pattern in the host block; a load checks the host block it reads.
struct DiskRig {
  TempDir dir;
  std::unique_ptr<ReplayStorage> rs;
  storage::FaultInjectingBackend* faults = nullptr;
  std::unique_ptr<StoragePlanExecutor> sto;
  FakePlanExecutor dev;
  std::unique_ptr<CompositePlanExecutor> exec;
  std::unique_ptr<CacheManager> cache;
  std::uint64_t loads_checked = 0, load_mismatches = 0, admission_retries = 0;

  void init(CacheConfig cfg, const storage::FaultConfig* fault_config) {
    ASSERT_FALSE(dir.path().empty());
    std::string d = dir.path();
    auto make = [d, fault_config,
                 this](storage::StorageOptions so) -> Result<std::unique_ptr<storage::StorageBackend>> {
      KVTIER_ASSIGN_OR_RETURN(auto b, storage::make_storage_backend("disk:" + d, std::move(so)));
      if (!fault_config) return b;
      auto f = std::make_unique<storage::FaultInjectingBackend>(std::move(b), *fault_config);
      faults = f.get();
      return std::unique_ptr<storage::StorageBackend>(std::move(f));
    };
    auto r = ReplayStorage::create(make, cfg.host_blocks, kBlockBytes);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    rs = std::move(*r);
    sto = std::make_unique<StoragePlanExecutor>(rs->tier());
    exec = std::make_unique<CompositePlanExecutor>(dev, *sto);
    cache = make_cache(std::move(cfg));
  }

  // One step: take the plan, move its bytes, wait for the storage moves, apply every ack.
  void step() {
    StepPlan plan = cache->take_plan();
    for (const BlockMove& m : plan.loads) {
      ++loads_checked;
      if (!ReplayStorage::check_pattern(m.key, rs->host_block(m.src))) ++load_mismatches;
    }
    for (const auto* l : {&plan.evictions, &plan.backups})
      for (const BlockMove& m : *l) ReplayStorage::fill_pattern(m.key, rs->host_block(m.dst));
    for (const BlockMove& m : plan.storage_prefetches) std::memset(rs->host_block(m.dst).data(), 0x5A, kBlockBytes);
    ASSERT_TRUE(exec->execute(plan).ok());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (sto->in_flight() && std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(apply_completions(*cache, exec->poll()).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ASSERT_TRUE(apply_completions(*cache, exec->poll()).ok());
    ASSERT_EQ(sto->in_flight(), 0u);
  }

  // Like a scheduler: an admission that waits for host room (ResourceExhausted while dirty host
  // blocks are written to storage) is retried once after the writes' acks.
  void request(const std::vector<BlockKey>& keys) {
    const std::uint64_t demotions = cache->stats().pressure_demotions;
    auto a = cache->admit(keys);
    if (!a.ok() && a.status().code() == StatusCode::kResourceExhausted &&
        cache->stats().pressure_demotions > demotions) {
      ++admission_retries;
      step();
      if (::testing::Test::HasFatalFailure()) return;
      a = cache->admit(keys);
    }
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    step();
    ASSERT_TRUE(cache->commit_all(a->id).ok());
    ASSERT_TRUE(cache->release(a->id).ok());
  }
};

std::vector<BlockKey> chain(std::uint64_t first) { return path({first, first + 1, first + 2}); }

TEST(WriteBackPressureDisk, EvictedPrefixIsServedFromStorageWithItsBytes) {
  DiskRig rig;
  rig.init(write_back(4, 8, 256), nullptr);
  if (::testing::Test::HasFatalFailure()) return;
  auto first = chain(1);
  // 12 chains of 3 blocks through a 4-block device and an 8-block host: far beyond the host.
  for (std::uint64_t i = 0; i < 12; ++i) {
    rig.request(chain(1 + 10 * i));
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(rig.cache->check_invariants().ok());
  }
  CacheStats s = rig.cache->stats();
  EXPECT_GT(s.pressure_demotions, 0u);
  EXPECT_EQ(s.lost_host_drops, 0u) << "no dirty host block was dropped";
  EXPECT_GE(rig.sto->bytes_written(), s.pressure_demotions * kBlockBytes);

  MatchResult m = rig.cache->match(first);
  ASSERT_EQ(m.device_blocks + m.host_blocks, 0u) << "test setup: the first chain must have left device and host";
  ASSERT_EQ(m.storage_blocks, 3u) << "the first chain was written to storage, not dropped";

  // The host is full of dirty blocks: the first prefetch makes room (demotions) and queues what
  // fits; after the writes' acks the rest fits.
  std::uint32_t queued = 0;
  for (int round = 0; round < 4 && queued < 3; ++round) {
    auto q = rig.cache->prefetch(first);
    ASSERT_TRUE(q.ok());
    queued += *q;
    rig.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_EQ(queued, 3u);
  EXPECT_EQ(rig.sto->failed_reads(), 0u);
  m = rig.cache->match(first);
  ASSERT_EQ(m.host_blocks, 3u);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(ReplayStorage::check_pattern(first[i], rig.rs->host_block(m.host_ids[i])))
        << "block " << i << " read back from disk differs";

  auto a = rig.cache->admit(first);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host_hit_blocks, 3u);
  rig.step();
  EXPECT_EQ(rig.cache->admission_status(a->id)->ready_blocks, 3u);
  EXPECT_GE(rig.loads_checked, 3u);
  EXPECT_EQ(rig.load_mismatches, 0u);
  ASSERT_TRUE(rig.cache->release(a->id).ok());
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

TEST(WriteBackPressureDisk, FailedStorageWritesNeverBecomeStorageHits) {
  DiskRig rig;
  storage::FaultConfig faults;
  faults.fail_every_nth = 1;  // every put (and get) fails before it reaches the disk
  rig.init(write_back(4, 8, 256), &faults);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_NE(rig.faults, nullptr);
  auto first = chain(1);
  for (std::uint64_t i = 0; i < 12; ++i) {
    rig.request(chain(1 + 10 * i));
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(rig.cache->check_invariants().ok());
  }
  CacheStats s = rig.cache->stats();
  EXPECT_GT(s.pressure_demotions, 0u);
  EXPECT_GT(rig.sto->failed_writes(), 0u);
  EXPECT_EQ(rig.sto->bytes_written(), 0u);
  EXPECT_EQ(s.tiers[2].used, 0u) << "no storage slot is held for a failed write";
  for (std::uint64_t i = 0; i < 12; ++i) {
    auto keys = chain(1 + 10 * i);
    MatchResult m = rig.cache->match(keys);
    EXPECT_EQ(m.storage_blocks, 0u) << "chain " << i << " reported in storage after failed writes";
    // Whatever survived is on device or host (its copy was kept when the write failed).
    for (std::size_t j = 0; j < m.host_ids.size(); ++j)
      EXPECT_TRUE(ReplayStorage::check_pattern(keys[m.device_blocks + j], rig.rs->host_block(m.host_ids[j])));
  }
  auto q = rig.cache->prefetch(first);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 0u) << "nothing to fetch";
  EXPECT_EQ(rig.sto->bytes_read(), 0u);
  EXPECT_EQ(rig.load_mismatches, 0u);
}

// ---- trace replay without host watermarks ------------------------------------

std::vector<TraceRequest> sample(std::size_t n) {
  auto t = load_mooncake_trace(std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl", n);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

ReplayOptions pressure_only(ReplayStorage* rs) {
  ReplayOptions o;
  o.device_blocks = 96;
  o.host_blocks = 160;
  o.storage_blocks = 20000;
  o.policy = "lru";
  o.write_policy = WritePolicy::kWriteBack;
  o.block_bytes = kBlockBytes;
  o.storage = rs;
  o.check_invariants_every = 25;
  o.host_low_watermark = 0;  // no background demotion: storage only gets what pressure writes back
  o.host_high_watermark = 0;
  return o;
}

TEST(WriteBackPressureReplay, HostEvictionsReachStorageWithoutWatermarks) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto trace = sample(400);
  ReplayOptions o = pressure_only(nullptr);
  auto rs = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->storage_writes, 0u);
  EXPECT_GT(r->storage_hit_blocks, 0u) << "blocks evicted from a full host tier are served from storage";
  EXPECT_EQ(r->verification_failures, 0u);
  EXPECT_GT(r->verified_blocks, 0u);
  EXPECT_EQ(r->failed_transfers, 0u);

  ReplayOptions none = o;
  none.storage_blocks = 0;
  none.storage = nullptr;
  auto base = replay_trace(trace, none);
  ASSERT_TRUE(base.ok()) << base.status().to_string();
  EXPECT_GT(r->hit_ratio(), base->hit_ratio());
}

TEST(WriteBackPressureReplay, FailingStorageWritesServeNoStorageHits) {
  TempDir dir;
  auto trace = sample(300);
  ReplayOptions o = pressure_only(nullptr);
  storage::FaultConfig faults;
  faults.fail_every_nth = 1;
  storage::FaultInjectingBackend* fi = nullptr;
  auto rs = ReplayStorage::create(
      [&](storage::StorageOptions so) -> Result<std::unique_ptr<storage::StorageBackend>> {
        KVTIER_ASSIGN_OR_RETURN(auto b, storage::make_storage_backend("disk:" + dir.path(), std::move(so)));
        auto f = std::make_unique<storage::FaultInjectingBackend>(std::move(b), faults);
        fi = f.get();
        return std::unique_ptr<storage::StorageBackend>(std::move(f));
      },
      o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_NE(fi, nullptr);
  EXPECT_GT(r->failed_storage_writes, 0u);
  EXPECT_EQ(r->bytes_to_storage, 0u);
  EXPECT_EQ(r->storage_hit_blocks, 0u);
  EXPECT_EQ(r->storage_prefetches, 0u) << "a block whose write failed is never fetched";
  EXPECT_EQ(r->verification_failures, 0u);
  EXPECT_GT(r->hit_blocks(), 0u) << "device and host still serve";
}

}  // namespace
}  // namespace kvtier::cache
