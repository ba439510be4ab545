// Storage wiring: StoragePlanExecutor / CompositePlanExecutor against a real
// disk backend, and trace replay with a disk (or Redis) tier moving real,
// verified bytes, with and without injected storage faults.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <tuple>

#include "kvtier/cache/storage_executor.h"
#include "kvtier/testing/fault_injection.h"
#include "kvtier/testing/plan_executors.h"
#include "sim/replay.h"
#include "tests/storage/storage_test_util.h"

namespace kvtier::cache {
namespace {

using storage::testing::TempDir;

std::vector<TraceRequest> sample(std::size_t n) {
  auto t = load_mooncake_trace(std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl", n);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

// Small device and host tiers so that reused prefixes fall through to storage.
ReplayOptions small_tiers(ReplayStorage* rs) {
  ReplayOptions o;
  o.device_blocks = 96;
  o.host_blocks = 160;
  o.storage_blocks = 20000;
  o.policy = "lru";
  o.block_bytes = 4096;
  o.storage = rs;
  o.check_invariants_every = 25;
  return o;
}

ReplayStorage::BackendFactory disk_factory(const std::string& dir, const storage::FaultConfig* faults,
                                           storage::FaultInjectingBackend** out = nullptr) {
  return [dir, faults, out](storage::StorageOptions so) -> Result<std::unique_ptr<storage::StorageBackend>> {
    KVTIER_ASSIGN_OR_RETURN(auto b, storage::make_storage_backend("disk:" + dir, std::move(so)));
    if (!faults) return b;
    auto f = std::make_unique<storage::FaultInjectingBackend>(std::move(b), *faults);
    if (out) *out = f.get();
    return std::unique_ptr<storage::StorageBackend>(std::move(f));
  };
}

void expect_clean(const ReplayResult& r) {
  EXPECT_EQ(r.verification_failures, 0u);
  EXPECT_GT(r.verified_blocks, 0u);
  EXPECT_EQ(r.device_hit_blocks + r.host_hit_blocks + r.storage_hit_blocks, r.hit_blocks());
  EXPECT_LE(r.hit_blocks(), r.cacheable_blocks);
}

TEST(StorageReplay, DiskTierWriteBackServesVerifiedHits) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto trace = sample(500);
  ReplayOptions o = small_tiers(nullptr);
  auto rs = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_clean(*r);
  EXPECT_GT(r->storage_hit_blocks, 0u);
  EXPECT_GT(r->storage_writes, 0u);
  EXPECT_GT(r->bytes_to_storage, 0u);
  EXPECT_GE(r->bytes_from_storage, r->storage_hit_blocks * o.block_bytes);
  EXPECT_EQ(r->failed_transfers, 0u);
  EXPECT_EQ(r->failed_prefetches, 0u);

  // Storage adds hits over the same device + host without it.
  ReplayOptions none = o;
  none.storage_blocks = 0;
  none.storage = nullptr;
  auto base = replay_trace(trace, none);
  ASSERT_TRUE(base.ok()) << base.status().to_string();
  EXPECT_GT(r->hit_ratio(), base->hit_ratio());
}

// The storage knobs' variables apply to a replay's storage tier, as to StorageBackend.open: a bad one is refused
// naming it (it was ignored, so a capacity set by KVTIER_STORAGE_DISK_CAPACITY_BYTES was not applied either).
TEST(StorageReplay, TheStorageKnobsVariablesApply) {
  TempDir dir;
  ReplayOptions o = small_tiers(nullptr);
  ASSERT_EQ(::setenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH", "banana", 1), 0);
  auto bad = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ::unsetenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("KVTIER_STORAGE_DISK_QUEUE_DEPTH"), std::string::npos)
      << bad.status().to_string();
  ASSERT_EQ(::setenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH", "5000", 1), 0);  // over the ring's limit
  auto over = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ::unsetenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH");
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("KVTIER_STORAGE_DISK_QUEUE_DEPTH"), std::string::npos)
      << over.status().to_string();
  auto good = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  EXPECT_TRUE(good.ok()) << good.status().to_string();
}

// The backend holds no more of the replay's objects than its storage tier has slots: the objects of slots the
// cache gives up are deleted (before, every block ever written stayed: 15,120 files under a tier of 2,000).
TEST(StorageReplay, DroppedStorageSlotsLeaveNoObjectsBehind) {
  TempDir dir;
  auto trace = sample(500);
  ReplayOptions o = small_tiers(nullptr);
  o.storage_blocks = 400;  // far below what the 500 requests write
  auto rs = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_clean(*r);
  ASSERT_GT(r->storage_writes, 3u * o.storage_blocks);  // the tier turned over several times
  EXPECT_GT(r->storage_hit_blocks, 0u);
  const storage::StorageStats st = (*rs)->tier().backend().stats();
  EXPECT_LE(st.objects, o.storage_blocks) << r->storage_writes << " writes";
  EXPECT_GT(st.objects, 0u);
}

TEST(StorageReplay, DiskTierWriteThrough) {
  TempDir dir;
  auto trace = sample(300);
  ReplayOptions o = small_tiers(nullptr);
  o.write_policy = WritePolicy::kWriteThrough;
  auto rs = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_clean(*r);
  EXPECT_GT(r->storage_hit_blocks, 0u);
  EXPECT_GT(r->storage_writes, 0u);
}

TEST(StorageReplay, FailedAndCorruptedPrefetchesBecomeMisses) {
  TempDir dir;
  auto trace = sample(500);
  ReplayOptions o = small_tiers(nullptr);
  storage::FaultConfig faults;
  faults.fail_every_nth = 11;        // Unavailable puts and gets
  faults.corrupt_every_nth_put = 5;  // bit rot after an acknowledged put: the get fails verification
  storage::FaultInjectingBackend* fi = nullptr;
  auto rs = ReplayStorage::create(disk_factory(dir.path(), &faults, &fi), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  ASSERT_NE(fi, nullptr);
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Never served: every prefetched block that reached the cache as OK holds its key's bytes,
  // and every host block a load read did too.
  expect_clean(*r);
  EXPECT_GT(fi->counters().corrupted, 0u);
  EXPECT_GT(fi->counters().failed, 0u);
  EXPECT_GT(r->failed_prefetches, 0u) << "corrupted or failed gets must reach the cache as failed prefetches";
  EXPECT_GE(r->failed_transfers, r->failed_prefetches);
  EXPECT_GT(r->storage_hit_blocks, 0u) << "intact blocks are still served from storage";
}

TEST(StorageReplay, DeviceTransferFailuresNeverServeGarbage) {
  TempDir dir;
  auto trace = sample(300);
  ReplayOptions o = small_tiers(nullptr);
  o.failure_rate = 0.05;  // failed evictions leave garbage in their host block
  auto rs = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_clean(*r);
  EXPECT_GT(r->failed_transfers, 0u);
}

TEST(StorageReplay, RedisTier) {
  const char* ep = std::getenv("KVTIER_TEST_REDIS");
  if (!ep || !*ep) GTEST_SKIP() << "KVTIER_TEST_REDIS not set";
  const char* pw = std::getenv("KVTIER_TEST_REDIS_PASSWORD");
  std::string spec = std::string("redis://") + (pw && *pw ? std::string(":") + pw + "@" : "") + ep +
                     "?prefix=kvtier-wire-test-" + std::to_string(::getpid());
  auto trace = sample(300);
  ReplayOptions o = small_tiers(nullptr);
  auto rs = ReplayStorage::create(spec, o.host_blocks, o.block_bytes);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  o.storage = rs->get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_clean(*r);
  EXPECT_GT(r->storage_hit_blocks, 0u);
}

// The executor on its own: a stored block round-trips; a corrupted object is a failed completion
// that the cache turns into a miss.
// A plan that drops a key's slot and writes the key again (into another slot): the delete lands first, so the new
// object is there afterwards; a dropped key alone is deleted; remove_dropped = false keeps it.
TEST(StoragePlanExecutor, DropsDeleteTheirObjectsButNeverOneWrittenAgain) {
  TempDir dir;
  constexpr std::uint32_t kHost = 8;
  auto rs = ReplayStorage::create("disk:" + dir.path(), kHost, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  StoragePlanExecutor sto((*rs)->tier());
  const BlockKey kept{0x1111, 0x2222}, gone{0x3333, 0x4444};
  auto run = [&](StoragePlanExecutor& ex, const StepPlan& plan) {
    ASSERT_TRUE(ex.execute(plan).ok());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::vector<Completion> done;
    while (ex.in_flight() && std::chrono::steady_clock::now() < deadline) {
      for (Completion& c : ex.poll()) {
        EXPECT_TRUE(c.status.ok()) << c.status.to_string();
        done.push_back(std::move(c));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ASSERT_EQ(ex.in_flight(), 0u);
  };
  auto stored = [&](const BlockKey& k) {
    const storage::StorageKey sk[1] = {storage_key(k)};
    auto op = (*rs)->tier().exists(sk);
    EXPECT_TRUE(op.ok());
    EXPECT_TRUE(op->wait().ok());
    return op->status(0).ok();
  };
  ReplayStorage::fill_pattern(kept, (*rs)->host_block(0));
  ReplayStorage::fill_pattern(gone, (*rs)->host_block(1));
  StepPlan first;
  first.storage_writes = {BlockMove{0, 5, kept}, BlockMove{1, 6, gone}};
  run(sto, first);
  ASSERT_TRUE(stored(kept) && stored(gone));
  // Both slots given up; `kept` is written again in the same plan (as after an invalidation and a recompute).
  StepPlan second;
  second.storage_drops = {BlockMove{5, kNoBlock, kept}, BlockMove{6, kNoBlock, gone}};
  second.storage_writes = {BlockMove{0, 7, kept}};
  run(sto, second);
  EXPECT_TRUE(stored(kept));
  EXPECT_FALSE(stored(gone));
  EXPECT_EQ(sto.removed_objects(), 2u);
  EXPECT_EQ(sto.failed_removals(), 0u);
  // An executor that keeps dropped objects (a backend shared with other caches).
  StoragePlanExecutor keeping((*rs)->tier(), /*remove_dropped=*/false);
  StepPlan third;
  third.storage_drops = {BlockMove{7, kNoBlock, kept}};
  run(keeping, third);
  EXPECT_TRUE(stored(kept));
  EXPECT_EQ(keeping.removed_objects(), 0u);
}

// A device executor whose execute() fails: it reports the moves it was handed failed at its next poll(), as
// TransferPlanExecutor does after a failed submission.
class RefusingDeviceExecutor final : public PlanExecutor {
 public:
  Status execute(const StepPlan& plan) override {
    for (const auto* l : {&plan.evictions, &plan.backups, &plan.loads})
      for (const BlockMove& m : *l)
        failed.push_back(Completion{l == &plan.loads ? MoveKind::kLoad : MoveKind::kEviction, {m.dst}, error});
    return error;
  }
  std::vector<Completion> poll() override { return std::move(failed); }
  Status error = ResourceExhausted("too many tasks in flight");
  std::vector<Completion> failed;
};

// Both halves of a plan run whatever the other's outcome: a failed transfer half returned before the storage half
// was handed its writes, prefetches and drops, which were then never reported (slots storing and host blocks
// fetching forever) nor deleted. And a StoragePlanExecutor handed device moves reports every move failed.
TEST(StoragePlanExecutor, AFailedTransferHalfLeavesTheStorageHalfRunning) {
  TempDir dir;
  auto rs = ReplayStorage::create("disk:" + dir.path(), 8, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  StoragePlanExecutor sto((*rs)->tier());
  RefusingDeviceExecutor dev;
  CompositePlanExecutor exec(dev, sto);
  const BlockKey kept{0x1111, 0x2222}, gone{0x3333, 0x4444};
  ReplayStorage::fill_pattern(kept, (*rs)->host_block(0));
  ReplayStorage::fill_pattern(gone, (*rs)->host_block(1));
  auto drain = [&](PlanExecutor& ex, StoragePlanExecutor& s) {
    std::multiset<std::tuple<MoveKind, BlockId, bool>> got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    do {
      for (const Completion& c : ex.poll())
        for (BlockId b : c.dst) got.insert({c.kind, b, c.status.ok()});
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } while (s.in_flight() && std::chrono::steady_clock::now() < deadline);
    for (const Completion& c : ex.poll())
      for (BlockId b : c.dst) got.insert({c.kind, b, c.status.ok()});
    return got;
  };
  auto stored = [&](const BlockKey& k) {
    const storage::StorageKey sk[1] = {storage_key(k)};
    auto op = (*rs)->tier().exists(sk);
    EXPECT_TRUE(op.ok());
    EXPECT_TRUE(op->wait().ok());
    return op->status(0).ok();
  };
  StepPlan first;
  first.storage_writes = {BlockMove{1, 6, gone}};
  ASSERT_TRUE(exec.execute(first).ok());
  drain(exec, sto);
  ASSERT_TRUE(stored(gone));

  StepPlan plan;
  plan.loads = {BlockMove{3, 2, BlockKey{9, 9}}};
  plan.storage_writes = {BlockMove{0, 5, kept}};
  plan.storage_drops = {BlockMove{6, kNoBlock, gone}};
  Status st = exec.execute(plan);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.to_string();
  const auto got = drain(exec, sto);
  EXPECT_EQ(got, (std::multiset<std::tuple<MoveKind, BlockId, bool>>{{MoveKind::kLoad, 2, false},
                                                                     {MoveKind::kStorageWrite, 5, true}}));
  EXPECT_TRUE(stored(kept)) << "the storage write of the plan ran";
  EXPECT_FALSE(stored(gone)) << "the plan's drop was deleted";

  // Handed device moves, the storage executor refuses the plan and reports each of its moves failed once.
  StoragePlanExecutor alone((*rs)->tier());
  StepPlan mixed;
  mixed.loads = {BlockMove{3, 2, BlockKey{9, 9}}};
  mixed.storage_prefetches = {BlockMove{5, 4, kept}};
  EXPECT_EQ(alone.execute(mixed).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(drain(alone, alone), (std::multiset<std::tuple<MoveKind, BlockId, bool>>{
                                     {MoveKind::kLoad, 2, false}, {MoveKind::kStoragePrefetch, 4, false}}));
  EXPECT_EQ(alone.failed_reads(), 1u);
}

// A MultiRankPlanExecutor acknowledges a move that timed out on a silent rank, and the cache may then prefetch into
// that host block while the rank's late device->host copy can still land there (overwriting what the prefetch
// read: another key's bytes served as this one's). With the guard, the prefetch waits until the block is free, and
// fails (a miss) if it never becomes free.
TEST(StoragePlanExecutor, APrefetchWaitsForTheLateCopyIntoItsHostBlock) {
  TempDir dir;
  auto rs = ReplayStorage::create("disk:" + dir.path(), 8, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  StoragePlanExecutor sto((*rs)->tier());
  std::set<BlockId> busy = {4, 6};
  sto.guard_host_blocks(
      [&](BlockId b) -> Result<bool> {
        if (b == 7) return Unavailable("manager closed");
        return busy.count(b) == 0;
      },
      std::chrono::milliseconds(200));
  const BlockKey a{0x10, 0x20}, b{0x30, 0x40}, c{0x50, 0x60}, d{0x70, 0x80};
  ReplayStorage::fill_pattern(a, (*rs)->host_block(0));
  StepPlan writes;
  writes.storage_writes = {BlockMove{0, 1, a}};
  ASSERT_TRUE(sto.execute(writes).ok());
  while (sto.in_flight()) sto.poll();
  for (const BlockKey& k : {b, c, d}) {
    ReplayStorage::fill_pattern(k, (*rs)->host_block(0));
    StepPlan w;
    w.storage_writes = {BlockMove{0, 2, k}};
    ASSERT_TRUE(sto.execute(w).ok());
    while (sto.in_flight()) sto.poll();
  }
  for (BlockId h : {3, 4, 6, 7}) std::memset((*rs)->host_block(h).data(), 0x5A, 4096);
  StepPlan plan;
  plan.storage_prefetches = {BlockMove{1, 3, a}, BlockMove{2, 4, b}, BlockMove{2, 6, c}, BlockMove{2, 7, d}};
  ASSERT_TRUE(sto.execute(plan).ok());
  std::map<BlockId, bool> done;
  auto collect = [&] {
    for (const Completion& comp : sto.poll())
      for (BlockId h : comp.dst) done[h] = comp.status.ok();
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done.count(3) && std::chrono::steady_clock::now() < until) collect();
  ASSERT_TRUE(done.count(3) && done[3]) << "a free block's prefetch went at once";
  EXPECT_EQ(done.count(4), 0u) << "the prefetch into a busy block was posted";
  EXPECT_TRUE((*rs)->check_pattern(a, (*rs)->host_block(3)));
  EXPECT_EQ(std::to_integer<int>((*rs)->host_block(4)[0]), 0x5A) << "a busy block was written";
  busy.erase(4);  // the late copy into 4 landed; 6 stays busy
  while (sto.in_flight() && std::chrono::steady_clock::now() < until) collect();
  collect();
  EXPECT_TRUE(done.count(4) && done[4]);
  EXPECT_TRUE((*rs)->check_pattern(b, (*rs)->host_block(4)));
  EXPECT_TRUE(done.count(6) && !done[6]) << "a block that never became free fails its prefetch (a miss)";
  EXPECT_TRUE(done.count(7) && !done[7]) << "a guard that cannot tell fails the prefetch";
  EXPECT_EQ(std::to_integer<int>((*rs)->host_block(6)[0]), 0x5A);
  EXPECT_EQ(sto.in_flight(), 0u);
}

// Reports leave per destination in submission order: a MultiRankPlanExecutor drops the late report of a timed-out
// move by count, so a newer move to the same slot that finished first had its status taken for the old one's (a
// write that failed on this rank acknowledged as stored on all).
TEST(StoragePlanExecutor, ReportsOfOneDestinationLeaveInSubmissionOrder) {
  TempDir dir;
  auto rs = ReplayStorage::create("disk:" + dir.path(), 8, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  StoragePlanExecutor sto((*rs)->tier());
  const BlockKey k1{0xA1, 0xB1}, k2{0xA2, 0xB2};
  ReplayStorage::fill_pattern(k1, (*rs)->host_block(0));
  StepPlan first;
  first.storage_writes = {BlockMove{0, 9, k1}};
  ASSERT_TRUE(sto.execute(first).ok());
  while (sto.in_flight()) sto.poll();
  // k1's slot given up and k1 written again into slot 5: that write waits for the delete (poll() posts it).
  StepPlan again;
  again.storage_drops = {BlockMove{9, kNoBlock, k1}};
  again.storage_writes = {BlockMove{0, 5, k1}};
  ASSERT_TRUE(sto.execute(again).ok());
  // Slot 5 reused at once (as after a timeout): a write that fails at once (host block 99 does not exist).
  StepPlan reuse;
  reuse.storage_writes = {BlockMove{99, 5, k2}};
  ASSERT_TRUE(sto.execute(reuse).ok());
  std::vector<bool> slot5;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (sto.in_flight() && std::chrono::steady_clock::now() < until) {
    for (const Completion& c : sto.poll())
      for (BlockId b : c.dst)
        if (b == 5) slot5.push_back(c.status.ok());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  EXPECT_EQ(slot5, (std::vector<bool>{true, false})) << "k1's write first (OK), then k2's (failed)";
  EXPECT_EQ(sto.in_flight(), 0u);
}

// A backend whose deletes never end until the test lets them (a stuck server, a hung disk): each delete batch
// gets a ticket of its own that the test completes later.
class StuckDeletes final : public storage::StorageBackendWrapper {
 public:
  using StorageBackendWrapper::StorageBackendWrapper;
  Result<storage::StorageTicket> post(storage::StorageBatch batch) override {
    if (batch.op != storage::StorageOp::kDelete) return inner_->post(std::move(batch));
    storage::StorageTicket t = storage::StorageTicket::create(batch.op, batch.items.size());
    held.push_back({std::move(batch), t.completion()});
    return t;
  }
  // Runs the held deletes on the inner backend and completes their tickets with its results.
  void release() {
    for (auto& [batch, completion] : held) {
      auto r = storage::run_batch(*inner_, batch);
      for (std::size_t i = 0; i < batch.items.size(); ++i)
        completion->complete(i, r.ok() ? Status((*r)[i].status) : r.status());
    }
    held.clear();
  }
  std::vector<std::pair<storage::StorageBatch, std::shared_ptr<storage::detail::Completion>>> held;
};

// A write of a key whose previous object's delete never ends used to wait for it forever (its slot storing for
// good, the executor never idle). It now fails after max_delete_wait and is never posted, so the stuck delete
// cannot remove it either; once the delete ends, writes of the key are posted again.
TEST(StoragePlanExecutor, AWriteBehindAStuckDeleteFailsAfterItsDeadline) {
  TempDir dir;
  StuckDeletes* stuck = nullptr;
  auto rs = ReplayStorage::create(
      [&](storage::StorageOptions so) -> Result<std::unique_ptr<storage::StorageBackend>> {
        KVTIER_ASSIGN_OR_RETURN(auto b, storage::make_storage_backend("disk:" + dir.path(), std::move(so)));
        auto w = std::make_unique<StuckDeletes>(std::move(b));
        stuck = w.get();
        return std::unique_ptr<storage::StorageBackend>(std::move(w));
      },
      8, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  ASSERT_NE(stuck, nullptr);
  StoragePlanExecutor sto((*rs)->tier());
  sto.set_max_delete_wait(std::chrono::milliseconds(50));
  const BlockKey k{0xC1, 0xD1};
  ReplayStorage::fill_pattern(k, (*rs)->host_block(0));
  auto drain = [&](std::chrono::seconds limit) {
    std::vector<std::pair<BlockId, bool>> got;
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      for (const Completion& c : sto.poll())
        for (BlockId b : c.dst) got.emplace_back(b, c.status.ok());
      if (sto.in_flight() == 0 || sto.in_flight() == 1 /* the stuck delete */) {
        if (!got.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return got;
  };
  StepPlan first;
  first.storage_writes = {BlockMove{0, 3, k}};
  ASSERT_TRUE(sto.execute(first).ok());
  EXPECT_EQ(drain(std::chrono::seconds(30)), (std::vector<std::pair<BlockId, bool>>{{3, true}}));
  // The slot given up and the key written again: the delete hangs.
  StepPlan again;
  again.storage_drops = {BlockMove{3, kNoBlock, k}};
  again.storage_writes = {BlockMove{0, 4, k}};
  ASSERT_TRUE(sto.execute(again).ok());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(drain(std::chrono::seconds(10)), (std::vector<std::pair<BlockId, bool>>{{4, false}}))
      << "the write behind the stuck delete is reported failed";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(sto.in_flight(), 1u) << "only the delete itself is still out";
  // The delete ends; the key's next write is posted and lands (the delete did not remove it).
  stuck->release();
  StepPlan third;
  third.storage_writes = {BlockMove{0, 5, k}};
  ASSERT_TRUE(sto.execute(third).ok());
  EXPECT_EQ(drain(std::chrono::seconds(30)), (std::vector<std::pair<BlockId, bool>>{{5, true}}));
  EXPECT_EQ(sto.in_flight(), 0u);
  const storage::StorageKey sk[1] = {storage_key(k)};
  auto op = (*rs)->tier().exists(sk);
  ASSERT_TRUE(op.ok());
  ASSERT_TRUE(op->wait().ok());
  EXPECT_TRUE(op->status(0).ok()) << "the object written after the delete is there";
}

TEST(StoragePlanExecutor, PrefetchOfCorruptedObjectIsAMiss) {
  TempDir dir;
  constexpr std::uint32_t kHost = 8;
  auto rs = ReplayStorage::create("disk:" + dir.path(), kHost, 4096);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  StoragePlanExecutor sto((*rs)->tier());
  FakePlanExecutor dev;
  CompositePlanExecutor exec(dev, sto);

  CacheConfig cfg;
  cfg.device_blocks = 4;
  cfg.host_blocks = kHost;
  cfg.storage_blocks = 64;
  cfg.write_policy = WritePolicy::kWriteThrough;
  auto cache = CacheManager::create(cfg);
  ASSERT_TRUE(cache.ok());
  CacheManager& cm = **cache;
  KeyNamespace ns;
  ns.model_id = "m";
  ns.block_tokens = 16;
  auto hasher = KeyHasher::create(ns);
  ASSERT_TRUE(hasher.ok());
  std::vector<std::uint64_t> ids{1, 2, 3};
  auto keys = hasher->keys_for_ids(ids);

  auto step = [&]() {
    StepPlan plan = cm.take_plan();
    // A D2H move lands the key's pattern in its host block (no device memory here).
    for (const auto* l : {&plan.evictions, &plan.backups})
      for (const BlockMove& m : *l) ReplayStorage::fill_pattern(m.key, (*rs)->host_block(m.dst));
    for (const BlockMove& m : plan.storage_prefetches) std::memset((*rs)->host_block(m.dst).data(), 0x5A, 4096);
    ASSERT_TRUE(exec.execute(plan).ok());
    // Bounded by time, not by a poll count: durable disk writes (fdatasync)
    // take much longer on a loaded CI machine.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (sto.in_flight() && std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(apply_completions(cm, exec.poll()).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ASSERT_TRUE(apply_completions(cm, exec.poll()).ok());
    ASSERT_EQ(sto.in_flight(), 0u);
  };

  auto a = cm.admit(keys);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cm.commit_all(a->id).ok());
  ASSERT_TRUE(cm.release(a->id).ok());
  step();  // backups D2H (write-through)
  step();  // storage writes of the blocks that settled on host
  EXPECT_EQ(sto.bytes_written(), 3u * 4096);
  ASSERT_TRUE(cm.check_invariants().ok());

  // Push the chain out of device and host: a different chain fills both.
  for (std::uint64_t base = 100; base < 130; base += 3) {
    std::vector<std::uint64_t> other{base, base + 1, base + 2};
    auto ok = hasher->keys_for_ids(other);
    auto b = cm.admit(ok);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    ASSERT_TRUE(cm.commit_all(b->id).ok());
    ASSERT_TRUE(cm.release(b->id).ok());
    step();
    step();
  }
  MatchResult m = cm.match(keys);
  ASSERT_EQ(m.device_blocks + m.host_blocks, 0u) << "test setup: the chain must sit in storage only";
  ASSERT_EQ(m.storage_blocks, 3u);

  // Corrupt the second block's object: its prefetch fails verification.
  auto& backend = (*rs)->tier().backend();
  storage::StorageKey k1 = storage_key(keys[1]);
  auto size = backend.stored_object_bytes(k1);
  ASSERT_TRUE(size.ok()) << size.status().to_string();
  ASSERT_TRUE(backend.corrupt_stored_object(k1, *size - 1, 0x40).ok());

  auto q = cm.prefetch(keys);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 3u);
  step();
  EXPECT_EQ(sto.failed_reads(), 1u);
  m = cm.match(keys);
  EXPECT_EQ(m.host_blocks, 1u) << "blocks at and below the corrupted one are misses";
  EXPECT_EQ(m.storage_blocks, 0u);
  ASSERT_EQ(m.host_ids.size(), 1u);
  EXPECT_TRUE(ReplayStorage::check_pattern(keys[0], (*rs)->host_block(m.host_ids[0])));
  ASSERT_TRUE(cm.check_invariants().ok());

  StepPlan device_move;
  device_move.loads.push_back(BlockMove{0, 0, keys[0]});
  EXPECT_EQ(sto.execute(device_move).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvtier::cache
