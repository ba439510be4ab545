// TransferManager on the host backend: ordering (hazards) under injected
// delays, failure injection at every step, registration, validation,
// shutdown, stats. Every data check goes through the CPU model of
// transfer_model.h.
#include "kvtier/transfer/transfer_manager.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "kvtier/device/host_device.h"
#include "transfer/hazard_tracker.h"
#include "transfer/transfer_model.h"
#include "transfer/transfer_test_util.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using transfer_test::Gate;
using transfer_test::make_host;
using transfer_test::RandomOptions;
using transfer_test::RigOptions;
using transfer_test::small_gqa;
using transfer_test::TransferRig;

// Odd sizes (tails), fp8 scales, an indexer and a draft layer.
KvLayout mixed_layout() {
  std::vector<LayerLayout> layers;
  for (int l = 0; l < 3; ++l) {
    LayerLayout ll;
    ll.roles = {{Role::kKey, DType::kFp8E4M3, 200, ""},
                {Role::kValue, DType::kFp8E4M3, 200, ""},
                {Role::kKeyScale, DType::kBf16, 10, ""},
                {Role::kValueScale, DType::kBf16, 10, ""}};
    layers.push_back(ll);
  }
  LayerLayout draft;
  draft.draft = true;
  draft.roles = {{Role::kKey, DType::kFp8E4M3, 200, ""},
                 {Role::kValue, DType::kFp8E4M3, 200, ""},
                 {Role::kKeyScale, DType::kBf16, 10, ""},
                 {Role::kValueScale, DType::kBf16, 10, ""}};
  layers.push_back(draft);
  auto l = KvLayout::create(std::move(layers), 4);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return *l;
}

KvLayout mla_layout() {
  MlaShape s;
  s.num_layers = 3;
  s.block_tokens = 2;
  s.latent_dim = 36;  // 144 B
  s.indexer_dim = 12;
  auto l = KvLayout::mla(s);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return *l;
}

RigOptions rig_options(KvLayout layout, CopyStrategy strategy = CopyStrategy::kAuto) {
  return transfer_test::small_rig_options(std::move(layout), strategy);
}

std::vector<BlockId> ids(std::initializer_list<BlockId> l) { return l; }

// ---------------------------------------------------------------- ordering

TEST(TransferManager, EvictThenReuseDeviceBlock) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    auto dev = make_host(seed);
    TransferRig rig(*dev, rig_options(small_gqa()));
    ASSERT_TRUE(rig.init().ok());
    auto d0 = ids({0, 1});
    ASSERT_TRUE(rig.compute_write(d0).ok());
    auto ev = rig.evict(d0, ids({3, 4}));
    ASSERT_TRUE(ev.ok()) << ev.status().to_string();
    // The engine reuses the blocks at once: fenced by wait_device_blocks_free.
    ASSERT_TRUE(rig.compute_write(d0).ok());
    rig.quiesce_and_verify();
    EXPECT_EQ(rig.host_content(3, 0).tag, 1u);
    EXPECT_EQ(rig.host_content(4, 0).tag, 2u);
    EXPECT_EQ(rig.device_content(0, 0).tag, 3u);
  }
}

// Two consumers of one manager (an engine, and the cache's plan executor of a PdReceiver) took each other's
// completions from the one queue: a cache move never acked, an engine's load never seen.
TEST(TransferManager, CompletionQueuesKeepEachConsumersCompletions) {
  auto dev = make_host(11, 0);
  TransferRig rig(*dev, rig_options(small_gqa()));
  ASSERT_TRUE(rig.init().ok());
  TransferManager& mgr = rig.mgr();
  auto queue = mgr.open_completion_queue();
  ASSERT_TRUE(queue.ok()) << queue.status().to_string();
  EXPECT_GT(*queue, 0u);
  ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
  EvictOptions mine;
  mine.completion_queue = *queue;
  auto a = mgr.evict_to_host_async(ids({0}), ids({2}), mine);
  auto b = mgr.evict_to_host_async(ids({1}), ids({3}));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(mgr.wait_all(std::chrono::seconds(10)).ok());
  const auto engine = mgr.poll_completions();
  ASSERT_EQ(engine.size(), 1u);
  EXPECT_EQ(engine[0].id, *b);
  const auto own = mgr.poll_completions(*queue);
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].id, *a);
  EXPECT_TRUE(mgr.poll_completions(*queue).empty());
  EXPECT_TRUE(mgr.poll_completions(*queue + 7).empty());
  // A queue never opened is refused at submit, naming it.
  EvictOptions bad;
  bad.completion_queue = *queue + 1;
  auto c = mgr.evict_to_host_async(ids({0}), ids({4}), bad);
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(fmt::format("completion_queue {}", *queue + 1)), std::string::npos)
      << c.status().to_string();
  // Closed, the id is given out again, and a completion of the old owner's task still in flight is dropped.
  ASSERT_TRUE(rig.compute_write(ids({0})).ok());
  auto late = mgr.evict_to_host_async(ids({0}), ids({5}), mine);
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE(mgr.close_completion_queue(*queue).ok());
  EXPECT_EQ(mgr.close_completion_queue(*queue).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mgr.close_completion_queue(0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mgr.evict_to_host_async(ids({0}), ids({6}), mine).status().code(), StatusCode::kInvalidArgument);
  auto again = mgr.open_completion_queue();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *queue);
  ASSERT_TRUE(mgr.wait_all(std::chrono::seconds(10)).ok());
  EXPECT_TRUE(mgr.poll_completions(*again).empty()) << "the closed owner's completion reached the new one";
  // At most 1,024 open at once; closing makes room.
  std::vector<std::uint32_t> opened;
  Result<std::uint32_t> more = mgr.open_completion_queue();
  for (; more.ok(); more = mgr.open_completion_queue()) opened.push_back(*more);
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(opened.size(), 1024u - 2u);  // queue 0 and `again` are open
  ASSERT_TRUE(mgr.close_completion_queue(opened.back()).ok());
  EXPECT_TRUE(mgr.open_completion_queue().ok());
}

TEST(TransferManager, DeviceBlockNotFreeUntilEvictionCompleted) {
  auto dev = make_host(7, 0);
  TransferRig rig(*dev, rig_options(small_gqa()));
  ASSERT_TRUE(rig.init().ok());
  ASSERT_TRUE(rig.compute_write(ids({2})).ok());
  Gate gate;
  ASSERT_TRUE(gate.block(*dev, rig.compute()).ok());  // the "forward" still runs
  auto ev = rig.evict(ids({2}), ids({5}));
  ASSERT_TRUE(ev.ok());
  auto free = rig.mgr().is_device_block_free(2);
  ASSERT_TRUE(free.ok());
  EXPECT_FALSE(*free);
  auto hfree = rig.mgr().is_host_block_free(5);
  ASSERT_TRUE(hfree.ok());
  EXPECT_FALSE(*hfree);
  EXPECT_EQ(rig.mgr().task_info(*ev)->state, TaskState::kPending);
  EXPECT_EQ(rig.mgr().wait(*ev, 20ms).code(), StatusCode::kTimedOut);
  EXPECT_EQ(rig.mgr().wait_host_blocks_free(ids({5}), 5ms).code(), StatusCode::kTimedOut);
  gate.release();
  ASSERT_TRUE(rig.mgr().wait(*ev, 10s).ok());
  EXPECT_TRUE(*rig.mgr().is_device_block_free(2));
  EXPECT_TRUE(*rig.mgr().is_host_block_free(5));
  rig.quiesce_and_verify();
}

TEST(TransferManager, LoadThenEvictSameHostBlock) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    auto dev = make_host(seed);
    TransferRig rig(*dev, rig_options(small_gqa()));
    ASSERT_TRUE(rig.init().ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
    ASSERT_TRUE(rig.evict(ids({0}), ids({7})).ok());
    // The load reads host 7 while an eviction of another block overwrites it.
    auto ld = rig.load({}, ids({7}), ids({4}), /*compute_reads=*/true);
    ASSERT_TRUE(ld.ok());
    ASSERT_TRUE(rig.evict(ids({1}), ids({7})).ok());
    auto ld2 = rig.load({}, ids({7}), ids({5}), true);
    ASSERT_TRUE(ld2.ok());
    rig.quiesce_and_verify();
    EXPECT_EQ(rig.device_content(4, 0).tag, 1u);
    EXPECT_EQ(rig.device_content(5, 0).tag, 2u);
    EXPECT_GT(rig.compute_reads_checked(), 0u);
  }
}

TEST(TransferManager, LoadIntoBlockOrderedAfterEvictionReadingIt) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    auto dev = make_host(seed);
    TransferRig rig(*dev, rig_options(small_gqa()));
    ASSERT_TRUE(rig.init().ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
    ASSERT_TRUE(rig.evict(ids({0, 1}), ids({0, 1})).ok());
    rig.quiesce_and_verify();
    ASSERT_TRUE(rig.compute_write(ids({2})).ok());
    ASSERT_TRUE(rig.evict(ids({2}), ids({2})).ok());           // reads device 2 ...
    ASSERT_TRUE(rig.load({}, ids({0}), ids({2}), true).ok());  // ... which this load overwrites
    ASSERT_TRUE(rig.evict(ids({2}), ids({3})).ok());           // reads what the load wrote
    rig.quiesce_and_verify();
    EXPECT_EQ(rig.host_content(2, 0).tag, 3u);
    EXPECT_EQ(rig.host_content(3, 0).tag, 1u);
  }
}

TEST(TransferManager, InterleavedRequestsAllLayouts) {
  for (auto layout : {small_gqa(), mixed_layout(), mla_layout()}) {
    auto dev = make_host(3);
    TransferRig rig(*dev, rig_options(layout));
    ASSERT_TRUE(rig.init().ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1, 2, 3})).ok());
    ASSERT_TRUE(rig.evict(ids({0, 1}), ids({0, 1})).ok());
    ASSERT_TRUE(rig.evict(ids({2, 3}), ids({2, 3})).ok());
    ASSERT_TRUE(rig.load({}, ids({1, 0}), ids({4, 5}), true).ok());
    std::vector<std::uint32_t> some = {2, 0};
    ASSERT_TRUE(rig.load(some, ids({3}), ids({6}), true).ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
    ASSERT_TRUE(rig.evict(ids({4, 5, 6}), ids({8, 9, 10})).ok());
    ASSERT_TRUE(rig.load({}, ids({8, 9}), ids({0, 1}), true).ok());
    rig.quiesce_and_verify();
    EXPECT_EQ(rig.failed_tasks(), 0u);
  }
}

TEST(TransferManager, ConcurrentSubmittersAndCallbacks) {
  auto dev = make_host(11, 50);
  KvLayout layout = small_gqa(6);
  TransferRig rig(*dev, rig_options(layout));
  ASSERT_TRUE(rig.init().ok());
  // Device blocks 0..3 hold tags 1..4, written once.
  ASSERT_TRUE(rig.compute_write(ids({0, 1, 2, 3})).ok());
  rig.quiesce_and_verify();
  TransferManager& mgr = rig.mgr();
  std::atomic<int> layer_ok{0}, layer_bad{0}, done{0};
  auto worker = [&](int t) {
    const BlockId src = t, scratch = 8 + t;
    for (int it = 0; it < 40; ++it) {
      const BlockId h = t * 4 + (it % 4);
      auto ev = mgr.evict_to_host_async(ids({src}), ids({h}));
      ASSERT_TRUE(ev.ok()) << ev.status().to_string();
      LoadOptions lo;
      std::vector<int> seen;
      auto seen_mu = std::make_shared<std::mutex>();
      lo.on_layer = [&, seen_mu](std::uint32_t, const Status& s) { (s.ok() ? layer_ok : layer_bad)++; };
      lo.on_done = [&](TaskId, const Status& s) {
        if (s.ok()) done++;
      };
      auto ld = mgr.load_layers_to_device_async({}, ids({h}), ids({scratch}), lo);
      ASSERT_TRUE(ld.ok()) << ld.status().to_string();
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l) ASSERT_TRUE(mgr.wait_layer_host(*ld, l, 10s).ok());
      ASSERT_TRUE(mgr.wait(*ld, 10s).ok());
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
          std::vector<std::byte> buf(layout.block_bytes(l, r));
          ASSERT_TRUE(dev->memcpy_sync(buf.data(), mgr.device_space().block_ptr(l, r, scratch), buf.size()).ok());
          ASSERT_EQ(transfer_test::check_pattern(buf.data(), buf.size(), static_cast<std::uint64_t>(src + 1), l, r), -1)
              << "thread " << t << " iteration " << it;
        }
      (void)mgr.stats();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  ASSERT_TRUE(mgr.wait_all(10s).ok());
  // Callbacks run on the progress thread just after the state they report
  // became visible to waiters: give the last ones a moment.
  // Bounded by a deadline, not a sleep count: sleeps stretch on a loaded CI machine.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (done.load() < 3 * 40 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(done.load(), 3 * 40);
  EXPECT_EQ(layer_bad.load(), 0);
  EXPECT_EQ(layer_ok.load(), 3 * 40 * static_cast<int>(layout.num_layers()));
}

// ---------------------------------------------------------------- failures

// One fixed scenario; the k-th copy operation (copies only: compute writes are
// tasks the predicate skips) fails, for every k until none is left.
void run_failure_scenario(CopyStrategy strategy, KvLayout layout) {
  int runs_with_failure = 0;
  for (std::uint64_t k = 1; k < 400; ++k) {
    auto dev = make_host(k, 100);
    auto opts = rig_options(layout, strategy);
    TransferRig rig(*dev, opts);
    ASSERT_TRUE(rig.init().ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1, 2})).ok());
    rig.quiesce_and_verify();
    const std::uint64_t lo = rig.arena_begin(), hi = rig.arena_end();
    auto counter = std::make_shared<std::atomic<std::uint64_t>>(0);
    auto fired = std::make_shared<std::atomic<bool>>(false);
    dev->set_failure_predicate([=](std::uint64_t, const void* dst, std::uint64_t) {
      auto a = reinterpret_cast<std::uintptr_t>(dst);
      if (dst == nullptr || (a >= lo && a < hi)) return false;
      if (counter->fetch_add(1) + 1 == k) {
        fired->store(true);
        return true;
      }
      return false;
    });
    std::vector<std::pair<std::uint32_t, bool>> callbacks;
    std::mutex cb_mu;
    LoadOptions lo_opts;
    lo_opts.on_layer = [&](std::uint32_t l, const Status& s) {
      std::lock_guard<std::mutex> lock(cb_mu);
      callbacks.push_back({l, s.ok()});
    };
    auto e1 = rig.evict(ids({0, 1}), ids({0, 1}));
    ASSERT_TRUE(e1.ok());
    auto l1 = rig.load({}, ids({0, 1}), ids({4, 5}), true, lo_opts);
    ASSERT_TRUE(l1.ok());
    auto e2 = rig.evict(ids({4, 2}), ids({2, 3}));
    ASSERT_TRUE(e2.ok());
    std::vector<std::uint32_t> some = {1, 0};
    auto l2 = rig.load(some, ids({2, 3}), ids({6, 7}), true);
    ASSERT_TRUE(l2.ok());
    auto e3 = rig.evict(ids({6}), ids({9}));
    ASSERT_TRUE(e3.ok());
    rig.quiesce_and_verify(/*clear_errors=*/true);
    dev->set_failure_predicate(nullptr);
    if (::testing::Test::HasFatalFailure()) return;
    // A failed layer is never reported done, and its callback says so.
    auto info = rig.mgr().task_info(*l1);
    ASSERT_TRUE(info.ok());
    {
      std::lock_guard<std::mutex> lock(cb_mu);
      ASSERT_EQ(callbacks.size(), layout.num_layers());
      for (std::size_t i = 0; i < callbacks.size(); ++i) {
        EXPECT_EQ(callbacks[i].first, info->layers[i]) << "callbacks in layer order";
        EXPECT_EQ(callbacks[i].second, info->layer_states[i] == TaskState::kDone);
      }
    }
    for (std::size_t i = 0; i < info->layers.size(); ++i) {
      Status w = rig.mgr().wait_layer_host(*l1, info->layers[i], 1s);
      EXPECT_EQ(w.ok(), info->layer_states[i] == TaskState::kDone);
    }
    if (!fired->load()) {
      EXPECT_EQ(rig.failed_tasks(), 0u);
      break;  // k is past the last copy operation
    }
    ++runs_with_failure;
    EXPECT_GT(rig.failed_tasks(), 0u) << "failure injected at copy op " << k << " was swallowed";
    std::size_t listed = 0;
    for (TaskId t : {*e1, *l1, *e2, *l2, *e3}) {
      auto fb = rig.mgr().failed_blocks(t);
      ASSERT_TRUE(fb.ok());
      listed += fb->device.size() + fb->host.size();
      auto ti = rig.mgr().task_info(t);
      if (ti->state == TaskState::kFailed) {
        EXPECT_GT(fb->device.size() + fb->host.size(), 0u);
      }
    }
    EXPECT_GT(listed, 0u);
  }
  EXPECT_GT(runs_with_failure, 3);
}

TEST(TransferManagerFailure, EveryStepDmaPerRun) { run_failure_scenario(CopyStrategy::kDmaPerRun, small_gqa()); }
TEST(TransferManagerFailure, EveryStepMixedLayout) { run_failure_scenario(CopyStrategy::kDmaPerRun, mixed_layout()); }
TEST(TransferManagerFailure, EveryStepSmKernel) { run_failure_scenario(CopyStrategy::kSmKernel, small_gqa()); }

TEST(TransferManagerFailure, LoadOfFailedEvictionIsFailedEvenWhenSubmittedBefore) {
  auto dev = make_host(5, 0);
  TransferRig rig(*dev, rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  ASSERT_TRUE(rig.init().ok());
  ASSERT_TRUE(rig.compute_write(ids({0})).ok());
  rig.quiesce_and_verify();
  Gate gate;
  ASSERT_TRUE(gate.block(*dev, rig.compute()).ok());
  // Counted from the operations started so far: under load the gate's own task could otherwise be the first.
  ASSERT_TRUE(gate.wait_entered());
  dev->fail_nth_operation(1);  // the eviction's first copy
  auto ev = rig.evict(ids({0}), ids({3}));
  ASSERT_TRUE(ev.ok());
  auto ld = rig.load({}, ids({3}), ids({1}), false);  // submitted while the eviction is pending
  ASSERT_TRUE(ld.ok());
  gate.release();
  Status s = rig.mgr().wait(*ld, 10s);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(rig.mgr().wait(*ev, 10s).ok(), false);
  auto fb = rig.mgr().failed_blocks(*ld);
  ASSERT_TRUE(fb.ok());
  EXPECT_EQ(fb->device, ids({1}));
  EXPECT_FALSE(rig.mgr().wait_for_layer(*ld, 0, rig.compute()).ok());
  rig.quiesce_and_verify(true);
  // Submitted after the failure is known: failed with DataLoss, from the origin record.
  auto ld2 = rig.mgr().load_layers_to_device_async({}, ids({3}), ids({2}));
  ASSERT_TRUE(ld2.ok());
  Status s2 = rig.mgr().wait(*ld2, 10s);
  EXPECT_EQ(s2.code(), StatusCode::kDataLoss) << s2.to_string();
  // Rewriting the host block makes it valid again.
  ASSERT_TRUE(rig.evict(ids({0}), ids({3})).ok());
  auto ld3 = rig.load({}, ids({3}), ids({2}), true);
  ASSERT_TRUE(ld3.ok());
  EXPECT_TRUE(rig.mgr().wait(*ld3, 10s).ok());
  rig.quiesce_and_verify(true);
}

TEST(TransferManagerFailure, PartialLoadKeepsEarlierFailureOfOtherLayers) {
  auto dev = make_host(9, 0);
  TransferRig rig(*dev, rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  ASSERT_TRUE(rig.init().ok());
  ASSERT_TRUE(rig.compute_write(ids({0})).ok());
  ASSERT_TRUE(rig.evict(ids({0}), ids({0})).ok());
  rig.quiesce_and_verify();
  std::vector<std::uint32_t> l0 = {0}, l1 = {1};
  dev->fail_nth_operation(1);
  auto bad = rig.load(l0, ids({0}), ids({5}), false);  // layer 0 of device 5 fails
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(rig.mgr().wait(*bad, 10s).ok());
  rig.quiesce_and_verify(true);
  auto good = rig.load(l1, ids({0}), ids({5}), false);  // layer 1 succeeds, layer 0 still bad
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(rig.mgr().wait(*good, 10s).ok());
  auto ev = rig.evict(ids({5}), ids({6}));
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(rig.mgr().wait(*ev, 10s).code(), StatusCode::kDataLoss);
  rig.quiesce_and_verify(true);
}

// ---------------------------------------------------------------- randomized

TEST(TransferManagerRandom, InterleavedModelGqa) {
  auto dev = make_host(21);
  RandomOptions ro;
  ro.ops = 2000;
  ro.seed = 21;
  transfer_test::run_random_interleaving(*dev, rig_options(small_gqa()), ro);
}

TEST(TransferManagerRandom, InterleavedModelMixedAndMla) {
  for (auto layout : {mixed_layout(), mla_layout()}) {
    auto dev = make_host(22);
    RandomOptions ro;
    ro.ops = 800;
    ro.seed = 22;
    transfer_test::run_random_interleaving(*dev, rig_options(layout), ro);
  }
}

TEST(TransferManagerRandom, InterleavedModelEveryStrategy) {
  for (CopyStrategy s : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kSmKernel}) {
    auto dev = make_host(23);
    RandomOptions ro;
    ro.ops = 500;
    ro.seed = 23 + static_cast<int>(s);
    transfer_test::run_random_interleaving(*dev, rig_options(small_gqa(), s), ro);
  }
}

TEST(TransferManagerRandom, InterleavedModelWithFailures) {
  auto dev = make_host(24);
  RandomOptions ro;
  ro.ops = 1500;
  ro.seed = 24;
  ro.inject_failures = true;
  // A copy failure is sticky on its stream until the next quiescent point
  // (clear_stream_error), so keep most phases free of failures.
  ro.failure_permille = 2;
  ro.phase_ops = 30;
  transfer_test::run_random_interleaving(*dev, rig_options(small_gqa(), CopyStrategy::kDmaPerRun), ro);
}

// Synchronous submission (async_submit = false) keeps the same guarantees.
TEST(TransferManagerRandom, InterleavedModelSynchronousSubmit) {
  for (CopyStrategy s : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch}) {
    auto dev = make_host(25);
    RandomOptions ro;
    ro.ops = 600;
    ro.seed = 25 + static_cast<int>(s);
    RigOptions o = rig_options(small_gqa(), s);
    o.config.async_submit = false;
    transfer_test::run_random_interleaving(*dev, o, ro);
  }
}

// ---------------------------------------------------------------- record gate

// An event noted in a hazard record before it is recorded (asynchronous
// submission) must count as pending: a never-recorded event queries as
// complete and a stream wait on it is a no-op, so without the gate a block
// would be reported free, and a reuse not ordered, before its copy exists.
TEST(HazardTrackerGate, EventNotedBeforeItsRecordIsPending) {
  auto dev = make_host(31, 0);
  auto copy_stream = dev->create_stream({});
  auto reuse_stream = dev->create_stream({});
  ASSERT_TRUE(copy_stream.ok() && reuse_stream.ok());
  RecordGate gate;
  HazardTracker tracker(*dev, 4, "device", &gate);
  auto ev = dev->create_event();
  ASSERT_TRUE(ev.ok());
  EventLease event = std::move(ev).value();
  gate.expect(event.get());
  const std::vector<BlockId> blocks = {2};
  tracker.note_read(blocks, event, (*copy_stream)->id());

  auto free = tracker.is_free(2);
  ASSERT_TRUE(free.ok());
  EXPECT_FALSE(*free) << "a block whose copy is not even enqueued was reported free";
  EXPECT_EQ(tracker.wait_free_host(blocks, 20ms).code(), StatusCode::kTimedOut);
  EXPECT_TRUE(*tracker.is_free(3)) << "an untouched block is free";

  // The "copy": a long task on copy_stream, then the record. A reuse fenced
  // with wait_free while the record is still pending must end up after it.
  Gate hold;
  std::atomic<bool> copy_done{false};
  std::thread submitter([&] {
    std::this_thread::sleep_for(30ms);
    ASSERT_TRUE(hold.block(*dev, **copy_stream).ok());
    ASSERT_TRUE(dev->enqueue_task(**copy_stream,
                                  [&]() -> Status {
                                    copy_done = true;
                                    return Status::Ok();
                                  })
                    .ok());
    ASSERT_TRUE(dev->record(*event, **copy_stream).ok());
    gate.recorded(event.get());
  });
  ASSERT_TRUE(tracker.wait_free(blocks, **reuse_stream).ok());  // blocks until recorded
  std::atomic<bool> reuse_saw_copy{false};
  ASSERT_TRUE(dev->enqueue_task(**reuse_stream,
                                [&]() -> Status {
                                  reuse_saw_copy = copy_done.load();
                                  return Status::Ok();
                                })
                  .ok());
  submitter.join();
  EXPECT_FALSE(*tracker.is_free(2)) << "recorded but the copy is held";
  hold.release();
  ASSERT_TRUE(dev->synchronize(**reuse_stream, 10s).ok());
  EXPECT_TRUE(reuse_saw_copy) << "the reuse ran before the copy it was fenced after";
  EXPECT_TRUE(tracker.wait_free_host(blocks, 10s).ok());
  EXPECT_TRUE(*tracker.is_free(2));
}

// ---------------------------------------------------------------- API edges

TEST(TransferManager, ValidationRejectsBeforeEnqueue) {
  auto dev = make_host(1, 0);
  TransferRig rig(*dev, rig_options(small_gqa()));
  ASSERT_TRUE(rig.init().ok());
  TransferManager& m = rig.mgr();
  const std::uint64_t ops = dev->operations_executed();
  EXPECT_EQ(m.evict_to_host_async(ids({0, 1}), ids({0})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.evict_to_host_async(ids({}), ids({})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.evict_to_host_async(ids({12}), ids({0})).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(m.evict_to_host_async(ids({0}), ids({static_cast<BlockId>(kMaxBlockId)})).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(m.evict_to_host_async(ids({0, 1}), ids({3, 3})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.load_layers_to_device_async({}, ids({0, 0}), ids({1, 1})).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::uint32_t> bad_layer = {4}, dup_layer = {1, 1};
  auto r = m.load_layers_to_device_async(bad_layer, ids({0}), ids({1}));
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("layer 4"), std::string::npos) << r.status().message();
  EXPECT_EQ(m.load_layers_to_device_async(dup_layer, ids({0}), ids({1})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->operations_executed(), ops);
  EXPECT_EQ(m.stats().evict.tasks_submitted + m.stats().load.tasks_submitted, 0u);
  EXPECT_EQ(m.wait_for_layer(12345, 0, rig.compute()).code(), StatusCode::kNotFound);
  auto ev = m.evict_to_host_async(ids({0}), ids({0}));
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(m.wait_for_layer(*ev, 0, rig.compute()).code(), StatusCode::kInvalidArgument);
  std::vector<std::uint32_t> one = {1};
  auto ld = m.load_layers_to_device_async(one, ids({0}), ids({1}));
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(m.wait_for_layer(*ld, 2, rig.compute()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.wait_for_layer(*ld, 1, rig.compute()).ok());
  ASSERT_TRUE(m.wait_all(10s).ok());
}

TEST(TransferManager, WaitLayerHostTimesOutWhileBlocked) {
  auto dev = make_host(2, 0);
  TransferRig rig(*dev, rig_options(small_gqa()));
  ASSERT_TRUE(rig.init().ok());
  Gate gate;
  ASSERT_TRUE(gate.block(*dev, rig.compute()).ok());
  ASSERT_TRUE(rig.evict(ids({0}), ids({1})).ok());    // waits for compute
  auto ld = rig.load({}, ids({1}), ids({2}), false);  // waits for the eviction
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ(rig.mgr().wait_layer_host(*ld, 0, 10ms).code(), StatusCode::kTimedOut);
  EXPECT_EQ(rig.mgr().task_info(*ld)->layer_states[0], TaskState::kPending);
  gate.release();
  EXPECT_TRUE(rig.mgr().wait_layer_host(*ld, 3, 10s).ok());
  rig.quiesce_and_verify();
}

TEST(TransferManager, ShutdownDrainsAndFinishesEveryTask) {
  auto dev = make_host(4, 300);
  std::atomic<int> finals{0};
  std::vector<TaskId> tasks;
  {
    TransferRig rig(*dev, rig_options(small_gqa()));
    ASSERT_TRUE(rig.init().ok());
    ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
    for (BlockId i = 0; i < 10; ++i) {
      EvictOptions eo;
      eo.on_done = [&](TaskId, const Status&) { finals++; };
      ASSERT_TRUE(rig.mgr().evict_to_host_async(ids({i % 2}), ids({i}), eo).ok());
      LoadOptions lo;
      lo.on_done = [&](TaskId, const Status&) { finals++; };
      auto ld = rig.mgr().load_layers_to_device_async({}, ids({i}), ids({2 + i}), lo);
      ASSERT_TRUE(ld.ok());
      tasks.push_back(*ld);
    }
    EXPECT_TRUE(rig.mgr().shutdown().ok());
    EXPECT_EQ(finals.load(), 20);
    EXPECT_EQ(rig.mgr().evict_to_host_async(ids({0}), ids({0})).status().code(), StatusCode::kFailedPrecondition);
    // Shut down, it forgot its tasks: it says so, rather than "unknown or no longer retained".
    for (TaskId t : tasks) {
      const Status st = rig.mgr().task_info(t).status();
      EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
      EXPECT_NE(st.message().find("was shut down"), std::string::npos) << st.to_string();
      EXPECT_EQ(rig.mgr().wait(t, 1s).code(), StatusCode::kFailedPrecondition);
    }
    EXPECT_EQ(rig.mgr().task_info(9999).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(rig.mgr().shutdown().ok());  // idempotent
    EXPECT_TRUE(dev->synchronize(rig.compute(), 10s).ok());
  }
}

TEST(TransferManager, StatsReportDirectionsLatencyAndFailures) {
  auto dev = make_host(6, 20);
  TransferRig rig(*dev, rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  ASSERT_TRUE(rig.init().ok());
  ASSERT_TRUE(rig.compute_write(ids({0, 1})).ok());
  ASSERT_TRUE(rig.evict(ids({0, 1}), ids({0, 1})).ok());
  ASSERT_TRUE(rig.load({}, ids({0, 1}), ids({2, 3}), false).ok());
  rig.quiesce_and_verify();
  dev->fail_nth_operation(1);
  ASSERT_TRUE(rig.load({}, ids({0}), ids({4}), false).ok());
  rig.quiesce_and_verify(true);
  TransferStats s = rig.mgr().stats();
  EXPECT_EQ(s.num_layers, 4u);
  EXPECT_EQ(s.num_device_blocks, 12u);
  EXPECT_EQ(s.num_host_blocks, 16u);
  EXPECT_EQ(s.block_bytes, 4u * 2u * 128u);
  EXPECT_EQ(s.evict.tasks_done, 1u);
  EXPECT_EQ(s.evict.bytes_done, 2u * 1024u);
  EXPECT_EQ(s.load.tasks_done, 1u);
  EXPECT_EQ(s.load.tasks_failed, 1u);
  EXPECT_GT(s.load.gbps, 0.0);
  EXPECT_GE(s.layers_failed, 1u);
  EXPECT_EQ(s.layers_done + s.layers_failed, 8u);
  EXPECT_GT(s.layer_latency_p99_us, 0.0);
  EXPECT_GE(s.layer_latency_p99_us, s.layer_latency_p50_us);
  EXPECT_GE(s.load.max_in_flight, 1u);
  EXPECT_NE(s.to_json().find("\"layer_latency_p99_us\""), std::string::npos);
}

TEST(TransferManager, CreateRejectsMismatchedRegistration) {
  auto dev = make_host(1, 0);
  auto compute = dev->create_stream();
  ASSERT_TRUE(compute.ok());
  KvLayout layout = small_gqa();
  auto mem = dev->allocate_device(4 * 2 * 128 * 8);
  ASSERT_TRUE(mem.ok());
  std::vector<std::vector<void*>> bases(4);
  std::byte* p = mem->bytes_ptr();
  for (auto& b : bases)
    for (int r = 0; r < 2; ++r, p += 128 * 8) b.push_back(p);
  // Wrong ordinal.
  {
    auto space = BlockSpace::layer_first(MemoryKind::kDevice, 3, layout, 8, bases);
    ASSERT_TRUE(space.ok());
    KvCacheRegistration reg{*space, {}};
    reg.host.num_blocks = 4;
    auto m = TransferManager::create(*dev, **compute, reg);
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("ordinal 3"), std::string::npos) << m.status().message();
  }
  // No host blocks.
  {
    auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, 8, bases);
    KvCacheRegistration reg{*space, {}};
    EXPECT_EQ(TransferManager::create(*dev, **compute, reg).status().code(), StatusCode::kInvalidArgument);
  }
  // Host space of another layout.
  {
    auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, 8, bases);
    KvLayout other = small_gqa(2);
    std::vector<std::byte> host(2 * 2 * 128 * 4);
    auto hs = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, other, 4,
                                      {{host.data(), host.data() + 512}, {host.data() + 1024, host.data() + 1536}});
    ASSERT_TRUE(hs.ok()) << hs.status().to_string();
    KvCacheRegistration reg{*space, {}};
    reg.host.space = *hs;
    EXPECT_EQ(TransferManager::create(*dev, **compute, reg).status().code(), StatusCode::kInvalidArgument);
  }
  // Page-first host memory allocated by kvtier works.
  {
    auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, 8, bases);
    KvCacheRegistration reg{*space, {}};
    reg.host.num_blocks = 4;
    reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
    auto m = TransferManager::create(*dev, **compute, reg);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ((*m)->host_space().page_bytes(), 4096u);
  }
  // A host cache whose size does not fit in 64 bits is refused by name; it was allocated at its wrapped size (a
  // page alignment near 2^64 rounded the page to 0 bytes; large blocks times 2^32 blocks wrapped the sum).
  {
    auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, 8, bases);
    KvCacheRegistration reg{*space, {}};
    reg.host.num_blocks = 4;
    reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
    reg.host.page_alignment = (std::uint64_t{1} << 63) + 1;
    auto m = TransferManager::create(*dev, **compute, reg);
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("exceeds the address space"), std::string::npos) << m.status().to_string();
  }
  {
    auto huge = KvLayout::uniform(1, 1, std::uint64_t{1} << 39);
    ASSERT_TRUE(huge.ok()) << huge.status().to_string();
    std::vector<std::byte> one(16);
    // Never touched: create() refuses before it copies anything.
    auto space =
        BlockSpace::from_planes(MemoryKind::kDevice, 0, *huge, 1, {{Plane{one.data(), std::uint64_t{1} << 39}}});
    ASSERT_TRUE(space.ok()) << space.status().to_string();
    KvCacheRegistration reg{*space, {}};
    reg.host.num_blocks = std::uint64_t{1} << 32;
    auto m = TransferManager::create(*dev, **compute, reg);
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("exceeds the address space"), std::string::npos) << m.status().to_string();
  }
}

}  // namespace
}  // namespace kvtier
