// Tensor-parallel ranks: one CacheManager plan applied by N rank executors
// (MultiRankPlanExecutor). Scripted rank executors check the merge of
// completions arriving in different orders and groupings, the failure
// agreement (a failure on one rank is a miss on all, checked on the cache),
// the per-move deadline of a silent rank and an execute() failure on rank k.
// Real TransferManagers on the host backend (2 and 3 ranks) replay the
// committed trace sample with every rank's loaded shards checked, with and
// without failures injected on one rank.
#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <string>

#include "cache_test_util.h"
#include "kvtier/cache/multi_rank_executor.h"
#include "kvtier/cache/transfer_executor.h"
#include "kvtier/device/host_device.h"
#include "kvtier/testing/plan_executors.h"
#include "kvtier/transfer/transfer_manager.h"
#include "sim/replay.h"

namespace kvtier::cache {
namespace {

using testing::path;
using Clock = MultiRankPlanExecutor::Clock;

// A rank whose completions the test releases by hand, in any order and grouping.
class ScriptedRank final : public PlanExecutor {
 public:
  Status execute(const StepPlan& plan) override {
    ++executed;
    if (!execute_error.ok()) return execute_error;
    plans.push_back(plan);
    return Status::Ok();
  }
  std::vector<Completion> poll() override {
    std::vector<Completion> out(queued.begin(), queued.end());
    queued.clear();
    return out;
  }
  void report(MoveKind kind, std::vector<BlockId> dst, Status st = Status::Ok()) {
    queued.push_back(Completion{kind, std::move(dst), std::move(st)});
  }
  int executed = 0;
  Status execute_error;
  std::vector<StepPlan> plans;
  std::deque<Completion> queued;
};

struct FakeClock {
  Clock::time_point t = Clock::time_point{} + std::chrono::hours(1);
  std::function<Clock::time_point()> fn() {
    return [this] { return t; };
  }
};

std::unique_ptr<MultiRankPlanExecutor> make_multi(std::vector<PlanExecutor*> ranks, FakeClock* clock = nullptr,
                                                  std::chrono::milliseconds deadline = std::chrono::seconds(5)) {
  MultiRankPlanExecutor::Options o;
  o.move_deadline = deadline;
  if (clock) o.now = clock->fn();
  auto m = MultiRankPlanExecutor::create(std::move(ranks), o);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? std::move(*m) : nullptr;
}

using Reported = std::multiset<std::tuple<MoveKind, BlockId, bool>>;
void collect(const std::vector<Completion>& cs, Reported& into) {
  for (const Completion& c : cs)
    for (BlockId b : c.dst) into.insert({c.kind, b, c.status.ok()});
}

StepPlan plan_of(std::vector<BlockId> loads, std::vector<BlockId> evictions) {
  StepPlan p;
  for (BlockId b : loads) p.loads.push_back(BlockMove{100 + b, b, BlockKey{b, 1}});
  for (BlockId b : evictions) p.evictions.push_back(BlockMove{200 + b, b, BlockKey{b, 2}});
  return p;
}

TEST(MultiRank, CreateRefusesBadInputNamingTheValue) {
  auto none = MultiRankPlanExecutor::create({}, {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("0 ranks"), std::string::npos) << none.status().to_string();
  ScriptedRank a;
  auto null = MultiRankPlanExecutor::create({&a, nullptr}, {});
  ASSERT_FALSE(null.ok());
  EXPECT_NE(null.status().message().find("rank 1 of 2 is null"), std::string::npos) << null.status().to_string();
  MultiRankPlanExecutor::Options o;
  o.move_deadline = std::chrono::nanoseconds(0);
  auto zero = MultiRankPlanExecutor::create({&a}, o);
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("move_deadline"), std::string::npos) << zero.status().to_string();
}

TEST(MultiRank, MergesCompletionsArrivingInDifferentOrdersAndGroupings) {
  ScriptedRank r0, r1, r2;
  auto m = make_multi({&r0, &r1, &r2});
  ASSERT_TRUE(m->execute(plan_of({5, 6, 7}, {1, 2})).ok());
  for (ScriptedRank* r : {&r0, &r1, &r2}) ASSERT_EQ(r->plans.size(), 1u) << "every rank gets the plan";
  EXPECT_EQ(m->in_flight(), 5u);
  Reported got;
  r0.report(MoveKind::kLoad, {5, 6, 7});  // one task
  r0.report(MoveKind::kEviction, {1, 2});
  r1.report(MoveKind::kLoad, {7});  // split, other order
  r2.report(MoveKind::kEviction, {2});
  EXPECT_TRUE(m->poll().empty()) << "no move is reported before every rank did";
  r2.report(MoveKind::kLoad, {7, 6});
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 7, true}}));
  r1.report(MoveKind::kEviction, {2, 1});
  r1.report(MoveKind::kLoad, {6, 5});
  r2.report(MoveKind::kLoad, {5});
  r2.report(MoveKind::kEviction, {1});
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 5, true},
                           {MoveKind::kLoad, 6, true},
                           {MoveKind::kLoad, 7, true},
                           {MoveKind::kEviction, 1, true},
                           {MoveKind::kEviction, 2, true}}));
  EXPECT_EQ(m->in_flight(), 0u);
  EXPECT_EQ(m->completed_moves(), 5u);
  EXPECT_TRUE(m->poll().empty());
}

TEST(MultiRank, RefusesADestinationStillInFlightBeforeAnyRankSeesIt) {
  ScriptedRank r0, r1;
  auto m = make_multi({&r0, &r1});
  ASSERT_TRUE(m->execute(plan_of({5}, {})).ok());
  Status st = m->execute(plan_of({5}, {}));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("load move to block 5"), std::string::npos) << st.to_string();
  EXPECT_EQ(r0.plans.size(), 1u);
  EXPECT_EQ(r1.plans.size(), 1u);
}

// A refused plan is still acknowledged: a move that collides with nothing fails at the next poll (it was taken
// from the cache: unreported, its block stayed in flight for good), and the move already in flight to the
// colliding destination is reported failed when its ranks report it (the two cannot be told apart).
TEST(MultiRank, ARefusedPlansMovesAreReportedFailed) {
  ScriptedRank r0, r1;
  auto m = make_multi({&r0, &r1});
  ASSERT_TRUE(m->execute(plan_of({5}, {})).ok());
  Status st = m->execute(plan_of({5, 6}, {9}));
  ASSERT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("reported failed"), std::string::npos) << st.to_string();
  Reported got;
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 6, false}, {MoveKind::kEviction, 9, false}}));
  EXPECT_EQ(m->in_flight(), 1u);
  r0.report(MoveKind::kLoad, {5});
  r1.report(MoveKind::kLoad, {5});
  got.clear();
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 5, false}})) << "the colliding destination is a miss";
  EXPECT_EQ(m->in_flight(), 0u);
  // A plan naming one destination twice is refused the same way and reported once.
  Status twice = m->execute(plan_of({7, 7}, {}));
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  got.clear();
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 7, false}}));
  EXPECT_EQ(r0.plans.size(), 1u) << "no rank saw a refused plan";
  // Afterwards the destinations are free again.
  ASSERT_TRUE(m->execute(plan_of({5, 6, 7}, {})).ok());
  EXPECT_EQ(m->in_flight(), 3u);
}

// A failure on one rank is a failure for all: the cache turns the block into a miss.
TEST(MultiRank, FailureOnOneRankMakesTheBlockAMissOnAll) {
  FakePlanExecutor ok_rank;
  FakePlanExecutor::Options fo;
  fo.fail = [](MoveKind k, const BlockMove&) { return k == MoveKind::kLoad; };
  FakePlanExecutor failing_rank(fo);
  auto m = make_multi({&ok_rank, &failing_rank});
  auto c = testing::make_cache(testing::config(2, 8));
  auto step = [&] {
    StepPlan p = c->take_plan();
    if (!p.empty()) {
      ASSERT_TRUE(m->execute(p).ok());
    }
    ASSERT_TRUE(apply_completions(*c, m->poll()).ok());
  };
  auto serve = [&](const std::vector<BlockKey>& keys) {
    auto a = c->admit(keys);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    step();
    ASSERT_TRUE(c->commit_all(a->id).ok());
    ASSERT_TRUE(c->release(a->id).ok());
  };
  const auto a = path({1, 2});
  serve(a);
  serve(path({3, 4}));  // a's blocks evicted to host (on both ranks)
  step();
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  auto adm = c->admit(a);
  ASSERT_TRUE(adm.ok());
  EXPECT_EQ(adm->host_hit_blocks, 2u);
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.loads.size(), 2u);
  ASSERT_TRUE(m->execute(p).ok());
  std::vector<Completion> done = m->poll();
  ASSERT_FALSE(done.empty());
  for (const Completion& cm : done) {
    if (cm.kind != MoveKind::kLoad) continue;
    EXPECT_FALSE(cm.status.ok()) << "rank 0 loaded the block, rank 1 did not: failed for both";
    EXPECT_NE(cm.status.message().find("rank 1 of 2"), std::string::npos) << cm.status.to_string();
  }
  ASSERT_TRUE(apply_completions(*c, done).ok());
  EXPECT_TRUE(c->admission_status(adm->id)->failed);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_EQ(c->match(a).device_blocks, 0u) << "the next match loads the block that one rank failed to load";
  EXPECT_EQ(c->match(a).host_blocks, 2u) << "again, from the host copies (the failed moves only read them)";
  EXPECT_EQ(m->rank_stats(0).failed_moves, 0u);
  EXPECT_EQ(m->rank_stats(1).failed_moves, 2u);
  EXPECT_INVARIANTS(*c);
}

// A rank that never reports: poll() never waits; the move times out, the cache misses the block,
// and the silent rank's late report is dropped instead of being taken for a newer move.
TEST(MultiRank, SilentRankTimesOutTheMoveWithoutBlocking) {
  ScriptedRank r0, r1;
  FakeClock clock;
  auto m = make_multi({&r0, &r1}, &clock, std::chrono::milliseconds(500));
  auto c = testing::make_cache(testing::config(2, 8));
  const auto a = path({1, 2});
  auto serve = [&](const std::vector<BlockKey>& keys) {
    auto adm = c->admit(keys);
    ASSERT_TRUE(adm.ok());
    StepPlan p = c->take_plan();
    ASSERT_TRUE(c->ack_plan(p, Status::Ok()).ok());
    ASSERT_TRUE(c->commit_all(adm->id).ok());
    ASSERT_TRUE(c->release(adm->id).ok());
  };
  serve(a);
  serve(path({3, 4}));
  ASSERT_EQ(c->match(a).host_blocks, 2u);
  auto adm = c->admit(a);
  ASSERT_TRUE(adm.ok());
  StepPlan p = c->take_plan();
  ASSERT_EQ(p.loads.size(), 2u);
  ASSERT_TRUE(m->execute(p).ok());
  const std::vector<BlockId> loads = testing::dsts(p.loads);
  r0.report(MoveKind::kLoad, loads);
  for (ScriptedRank* r : {&r0, &r1}) r->report(MoveKind::kEviction, testing::dsts(p.evictions));
  const auto t0 = std::chrono::steady_clock::now();
  for (const Completion& cm : m->poll()) {
    EXPECT_EQ(cm.kind, MoveKind::kEviction) << "only the evictions were reported by both ranks";
    EXPECT_TRUE(cm.status.ok());
  }
  clock.t += std::chrono::milliseconds(499);
  EXPECT_TRUE(m->poll().empty());
  clock.t += std::chrono::milliseconds(1);
  std::vector<Completion> done = m->poll();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1)) << "poll() must not wait";
  Reported got;
  collect(done, got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, loads[0], false}, {MoveKind::kLoad, loads[1], false}}));
  for (const Completion& cm : done) {
    EXPECT_EQ(cm.status.code(), StatusCode::kTimedOut);
    EXPECT_NE(cm.status.message().find("rank(s) 1 of 2 did not report within 500 ms"), std::string::npos)
        << cm.status.to_string();
  }
  EXPECT_EQ(m->timed_out_moves(), 2u);
  EXPECT_EQ(m->rank_stats(1).missing_reports, 2u);
  ASSERT_TRUE(apply_completions(*c, done).ok());
  EXPECT_TRUE(c->admission_status(adm->id)->failed);
  ASSERT_TRUE(c->release(adm->id).ok());
  EXPECT_EQ(c->match(a).device_blocks, 0u);
  EXPECT_EQ(c->match(a).host_blocks, 2u);
  EXPECT_INVARIANTS(*c);

  // A new move to the same block: rank 1's late report of the old one must not complete it.
  ASSERT_TRUE(m->execute(plan_of({loads[0]}, {})).ok());
  r1.report(MoveKind::kLoad, {loads[0]});  // the late one
  r0.report(MoveKind::kLoad, {loads[0]});
  EXPECT_TRUE(m->poll().empty());
  EXPECT_EQ(m->rank_stats(1).late_reports, 1u);
  r1.report(MoveKind::kLoad, {loads[0]});
  got.clear();
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, loads[0], true}}));
}

TEST(MultiRank, ExecuteFailureOnRankKFailsTheMovesForAll) {
  ScriptedRank r0, r1, r2;
  r1.execute_error = Unavailable("copy engine gone");
  FakeClock clock;
  auto m = make_multi({&r0, &r1, &r2}, &clock);
  Status st = m->execute(plan_of({5, 6}, {1}));
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("rank 1 of 3"), std::string::npos) << st.to_string();
  EXPECT_EQ(r0.plans.size(), 1u);
  EXPECT_EQ(r2.executed, 0) << "ranks after the failing one are not handed the plan";
  // Rank 0 ran the plan and rank 1 may have run part of it: until both reported, their copies may still write the
  // blocks, so no move is acknowledged (it was at once, and the cache reused the blocks under those copies).
  r0.report(MoveKind::kLoad, {5, 6});
  r0.report(MoveKind::kEviction, {1});
  EXPECT_TRUE(m->poll().empty());
  r1.report(MoveKind::kLoad, {5, 6}, Unavailable("not submitted"));  // as an executor reports a failed submission
  r1.report(MoveKind::kEviction, {1}, Unavailable("not submitted"));
  Reported got;
  std::vector<Completion> done = m->poll();
  collect(done, got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 5, false}, {MoveKind::kLoad, 6, false}, {MoveKind::kEviction, 1, false}}));
  for (const Completion& c : done) EXPECT_NE(c.status.message().find("copy engine gone"), std::string::npos);
  EXPECT_EQ(m->rank_stats(0).late_reports, 0u);
  EXPECT_EQ(m->in_flight(), 0u);
  EXPECT_TRUE(m->poll().empty());

  // A failing rank that reports nothing: its moves fail at their deadline (naming it), not before.
  ScriptedRank q0, q1;
  q1.execute_error = Unavailable("copy engine gone");
  FakeClock c2;
  auto s = make_multi({&q0, &q1}, &c2, std::chrono::seconds(5));
  EXPECT_FALSE(s->execute(plan_of({3}, {})).ok());
  q0.report(MoveKind::kLoad, {3});
  EXPECT_TRUE(s->poll().empty());
  c2.t += std::chrono::seconds(6);
  Reported late;
  collect(s->poll(), late);
  EXPECT_EQ(late, (Reported{{MoveKind::kLoad, 3, false}}));
  EXPECT_EQ(s->in_flight(), 0u);
}

// The cache gives up a plan's storage slots whatever becomes of its moves: when rank k's execute() fails, the ranks
// after it still delete their objects of those slots (each rank's objects are its own), or they would stay in their
// backends with no key pointing at them.
TEST(MultiRank, RanksAfterAFailedExecuteStillDeleteTheDroppedStorageObjects) {
  ScriptedRank r0, r1, r2, r3;
  r1.execute_error = Unavailable("copy engine gone");
  r3.execute_error = Unavailable("backend closed");
  auto m = make_multi({&r0, &r1, &r2, &r3});
  StepPlan p = plan_of({5}, {1});
  p.storage_drops.push_back(BlockMove{40, kNoBlock, BlockKey{40, 3}});
  p.storage_drops.push_back(BlockMove{41, kNoBlock, BlockKey{41, 3}});
  Status st = m->execute(p);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("rank 1 of 4"), std::string::npos) << st.to_string();
  ASSERT_EQ(r0.plans.size(), 1u);
  EXPECT_EQ(r0.plans[0].loads.size(), 1u);
  ASSERT_EQ(r2.plans.size(), 1u) << "rank 2 gets the plan's storage drops";
  EXPECT_EQ(r2.plans[0].size(), 0u) << "and none of its moves";
  ASSERT_EQ(r2.plans[0].storage_drops.size(), 2u);
  EXPECT_EQ(r2.plans[0].storage_drops[1].src, 41u);
  EXPECT_EQ(r3.executed, 1);
  EXPECT_EQ(m->rank_stats(3).failed_drop_plans, 1u);
  EXPECT_EQ(m->rank_stats(2).failed_drop_plans, 0u);
  r0.report(MoveKind::kLoad, {5});
  r0.report(MoveKind::kEviction, {1});
  r1.report(MoveKind::kLoad, {5}, Unavailable("not submitted"));
  r1.report(MoveKind::kEviction, {1}, Unavailable("not submitted"));
  Reported got;
  collect(m->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 5, false}, {MoveKind::kEviction, 1, false}}));

  // A plan of drops alone goes to every rank even when one refuses it; the first refusal is returned.
  ScriptedRank q0, q1, q2;
  q0.execute_error = Unavailable("disk gone");
  auto d = make_multi({&q0, &q1, &q2});
  StepPlan drops;
  drops.storage_drops.push_back(BlockMove{7, kNoBlock, BlockKey{7, 3}});
  Status ds = d->execute(drops);
  EXPECT_EQ(ds.code(), StatusCode::kUnavailable);
  EXPECT_NE(ds.message().find("rank 0 of 3"), std::string::npos) << ds.to_string();
  EXPECT_EQ(q1.plans.size(), 1u);
  EXPECT_EQ(q2.plans.size(), 1u);
  EXPECT_EQ(d->in_flight(), 0u);
}

// A move deadline of nanoseconds::max() ("no deadline") overflowed now + deadline: every move timed out at once.
// A rank outside 0..ranks()-1 has no stats (it threw std::out_of_range across the C++ API).
TEST(MultiRank, AnUnboundedDeadlineNeverTimesOutAndABadRankHasNoStats) {
  ScriptedRank r0, r1;
  FakeClock clock;
  MultiRankPlanExecutor::Options o;
  o.move_deadline = std::chrono::nanoseconds::max();
  o.now = clock.fn();
  auto m = MultiRankPlanExecutor::create({&r0, &r1}, o);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ASSERT_TRUE((*m)->execute(plan_of({5}, {})).ok());
  clock.t += std::chrono::hours(24 * 365);
  EXPECT_TRUE((*m)->poll().empty());
  EXPECT_EQ((*m)->timed_out_moves(), 0u);
  r0.report(MoveKind::kLoad, {5});
  r1.report(MoveKind::kLoad, {5});
  Reported got;
  collect((*m)->poll(), got);
  EXPECT_EQ(got, (Reported{{MoveKind::kLoad, 5, true}}));
  EXPECT_EQ((*m)->rank_stats(7).failed_moves, 0u);
  EXPECT_EQ((*m)->rank_stats(7).late_reports, 0u);
}

TEST(MultiRank, ShardPatternsDependOnTheRank) {
  std::vector<std::byte> r0(64), r0_default(64), r1(64);
  TransferPlanExecutor::fill_key_pattern(BlockKey{7, 9}, r0.data(), 64, 0);
  TransferPlanExecutor::fill_key_pattern(BlockKey{7, 9}, r0_default.data(), 64);
  TransferPlanExecutor::fill_key_pattern(BlockKey{7, 9}, r1.data(), 64, 1);
  EXPECT_EQ(r0, r0_default);
  EXPECT_NE(r0, r1);
}

// Real TransferManagers on the host backend, one per rank, each with its own device and shard.
constexpr std::uint64_t kShardBytes = 512 + 8;

struct RankRig {
  std::unique_ptr<HostDevice> device;
  std::unique_ptr<Stream> compute;
  Buffer memory;
  BlockSpace space;
  std::unique_ptr<TransferManager> manager;
  std::unique_ptr<TransferPlanExecutor> executor;
  std::unique_ptr<FaultInjectingPlanExecutor> faults;
  PlanExecutor* exec() { return faults ? static_cast<PlanExecutor*>(faults.get()) : executor.get(); }
};

void make_rank(RankRig& rig, std::uint32_t rank, std::uint32_t device_blocks, std::uint32_t host_blocks) {
  auto d = HostDevice::create();
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  rig.device = std::move(*d);
  auto s = rig.device->create_stream();
  ASSERT_TRUE(s.ok());
  rig.compute = std::move(*s);
  auto layout = KvLayout::uniform(2, 2, kShardBytes / 4);
  ASSERT_TRUE(layout.ok());
  auto mem = rig.device->allocate_device(std::uint64_t{device_blocks} * layout->total_block_bytes());
  ASSERT_TRUE(mem.ok());
  rig.memory = std::move(*mem);
  std::vector<std::vector<void*>> bases(2, std::vector<void*>(2));
  const std::uint64_t plane = std::uint64_t{device_blocks} * (kShardBytes / 4);
  for (int l = 0; l < 2; ++l)
    for (int r = 0; r < 2; ++r) bases[l][r] = rig.memory.bytes_ptr() + (l * 2 + r) * plane;
  auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, *layout, device_blocks, bases);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  rig.space = *space;
  KvCacheRegistration reg{rig.space, {}};
  reg.host.num_blocks = host_blocks;
  reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
  auto tm = TransferManager::create(*rig.device, *rig.compute, std::move(reg));
  ASSERT_TRUE(tm.ok()) << tm.status().to_string();
  rig.manager = std::move(*tm);
  TransferPlanExecutor::Options eo;
  eo.rank = rank;
  rig.executor = std::make_unique<TransferPlanExecutor>(*rig.manager, *rig.device, *rig.compute, rig.space, eo);
}

std::vector<TraceRequest> sample(std::size_t n) {
  auto t = load_mooncake_trace(std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl", n);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

// Checks the merged completions: a move that the faulty rank failed is never acknowledged OK.
class Observer final : public PlanExecutor {
 public:
  explicit Observer(PlanExecutor& inner) : inner_(inner) {}
  Status execute(const StepPlan& plan) override { return inner_.execute(plan); }
  std::vector<Completion> poll() override {
    std::vector<Completion> out = inner_.poll();
    for (const Completion& c : out)
      for (BlockId b : c.dst) {
        auto it = injected.find({c.kind, b});
        if (it == injected.end()) continue;
        if (c.status.ok()) ++served_after_failure;
        injected.erase(it);
      }
    return out;
  }
  std::multiset<std::pair<MoveKind, BlockId>> injected;
  std::uint64_t served_after_failure = 0;

 private:
  PlanExecutor& inner_;
};

class RealRanks : public ::testing::TestWithParam<std::tuple<std::uint32_t, bool>> {};

TEST_P(RealRanks, EveryRankHoldsItsShardAndOneRanksFailuresAreMissesOnAll) {
  const auto [tp, inject] = GetParam();
  const auto trace = sample(600);
  ASSERT_FALSE(trace.empty());
  ReplayOptions o;
  o.device_blocks = 128;
  o.host_blocks = 2048;
  o.block_bytes = kShardBytes * tp;
  o.check_invariants_every = 50;
  auto fake = replay_trace(trace, o);
  ASSERT_TRUE(fake.ok()) << fake.status().to_string();
  ASSERT_GT(fake->host_hit_blocks, 50u) << "the trace must load blocks back from host";

  std::vector<RankRig> rigs(tp);
  std::vector<PlanExecutor*> ranks;
  const std::uint32_t faulty = tp - 1;
  Observer* observer_ptr = nullptr;
  for (std::uint32_t r = 0; r < tp; ++r) {
    make_rank(rigs[r], r, o.device_blocks, o.host_blocks);
    ASSERT_NE(rigs[r].executor, nullptr);
    if (inject && r == faulty) {
      FaultInjectingPlanExecutor::Options fo;
      fo.failure_rate = 0.05;
      fo.seed = 7;
      fo.on_fail = [&observer_ptr](MoveKind k, BlockId b) { observer_ptr->injected.insert({k, b}); };
      rigs[r].faults = std::make_unique<FaultInjectingPlanExecutor>(*rigs[r].executor, fo);
    }
    ranks.push_back(rigs[r].exec());
  }
  auto multi = make_multi(ranks, nullptr, std::chrono::seconds(30));
  ASSERT_NE(multi, nullptr);
  Observer observer(*multi);
  observer_ptr = &observer;
  o.executor = &observer;
  auto real = replay_trace(trace, o);
  ASSERT_TRUE(real.ok()) << real.status().to_string();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (multi->in_flight() > 0 && std::chrono::steady_clock::now() < deadline) observer.poll();
  EXPECT_EQ(multi->in_flight(), 0u);
  EXPECT_EQ(multi->timed_out_moves(), 0u);
  for (std::uint32_t r = 0; r < tp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_GT(rigs[r].executor->verified(), 50u) << "the replay must load blocks back on every rank";
    EXPECT_EQ(rigs[r].executor->verification_failures(), 0u);
    EXPECT_EQ(rigs[r].executor->failed_tasks(), 0u);
    EXPECT_EQ(multi->rank_stats(r).unknown_reports, 0u);
  }
  if (inject) {
    EXPECT_GT(rigs[faulty].faults->injected(), 0u);
    EXPECT_GT(real->failed_transfers, 0u);
    EXPECT_GE(multi->failed_moves(), rigs[faulty].faults->injected());
    EXPECT_EQ(observer.served_after_failure, 0u) << "a block one rank failed was acknowledged OK";
    EXPECT_TRUE(observer.injected.empty());
    for (std::uint32_t r = 0; r < faulty; ++r) EXPECT_EQ(multi->rank_stats(r).failed_moves, 0u);
  } else {
    EXPECT_EQ(real->failed_transfers, 0u);
    EXPECT_EQ(real->device_hit_blocks, fake->device_hit_blocks);
    EXPECT_EQ(real->host_hit_blocks, fake->host_hit_blocks);
  }
  for (auto& rig : rigs) ASSERT_TRUE(rig.manager->shutdown().ok());
}

INSTANTIATE_TEST_SUITE_P(Ranks, RealRanks,
                         ::testing::Values(std::tuple{2u, false}, std::tuple{2u, true}, std::tuple{3u, true}),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_InjectedFailures" : "_NoFailures");
                         });

}  // namespace
}  // namespace kvtier::cache
