// Hazard records and the lifecycle of the TransferManager on the host
// backend: one test per defect found by a randomized harness against the
// public headers (each failed before its fix), and the fixes' edges.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "kvtier/device/host_device.h"
#include "kvtier/transfer/transfer_manager.h"
#include "transfer/hazard_tracker.h"
#include "transfer/transfer_model.h"
#include "transfer/transfer_test_util.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using transfer_test::check_pattern;
using transfer_test::Gate;
using transfer_test::make_host;
using transfer_test::RigOptions;
using transfer_test::small_gqa;
using transfer_test::TransferRig;

RigOptions options(std::uint32_t layers = 4) {
  RigOptions o;
  o.layout = small_gqa(layers);
  o.device_blocks = 8;
  o.host_blocks = 8;
  o.config.poll_interval = std::chrono::microseconds(20);
  o.arena_bytes = 1u << 20;
  o.timeout = std::chrono::seconds(60);
  return o;
}

std::vector<BlockId> ids(std::initializer_list<BlockId> l) { return l; }

// Host block `h` gets fresh bytes through a device block (compute write, evict).
void seed_host_block(TransferRig& rig, BlockId via_device, BlockId h) {
  ASSERT_TRUE(rig.compute_write(ids({via_device})).ok());
  auto ev = rig.evict(ids({via_device}), ids({h}));
  ASSERT_TRUE(ev.ok()) << ev.status().to_string();
  ASSERT_TRUE(rig.mgr().wait(*ev, 10s).ok());
}

// ------------------------------------------------------------ defect 1
// The decode pattern: a layer-wise load into device block d is still writing
// later layers when the forward pass declares its token append on d (kWrite).
// The load must stay a writer of d.
TEST(TransferHazards, DeclaredWriteDuringLoadKeepsTheLoadAsWriter) {
  auto dev = make_host(101, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 5);
  const std::uint64_t loaded_tag = rig.host_content(5, 0).tag;

  Gate hold;  // the input stream is busy: the load's copies wait behind it
  ASSERT_TRUE(hold.block(*dev, rig.mgr().input_stream()).ok());
  auto load = rig.load({}, ids({5}), ids({2}), /*compute_reads=*/false);
  ASSERT_TRUE(load.ok()) << load.status().to_string();

  // The forward declares a write of d on its own stream (already complete).
  ASSERT_TRUE(rig.mgr().record_device_access(ids({2}), rig.compute(), TransferManager::DeviceAccess::kWrite).ok());
  ASSERT_TRUE(dev->synchronize(rig.compute(), 10s).ok());

  auto free = rig.mgr().is_device_block_free(2);
  ASSERT_TRUE(free.ok());
  EXPECT_FALSE(*free) << "the load still writes block 2, yet it was reported free";

  // A reuse fenced on the compute stream must wait for the load.
  ASSERT_TRUE(rig.mgr().wait_device_blocks_free(ids({2}), rig.compute()).ok());
  const KvLayout& layout = rig.layout();
  const std::uint32_t last = layout.num_layers() - 1;
  const std::uint64_t n = layout.block_bytes(last, 0);
  std::vector<std::byte> snapshot(n, std::byte{0x11});
  std::byte* src = rig.mgr().device_space().block_ptr(last, 0, 2);
  ASSERT_TRUE(dev->enqueue_task(rig.compute(),
                                [&]() -> Status {
                                  std::memcpy(snapshot.data(), src, n);
                                  return Status::Ok();
                                })
                  .ok());

  // An eviction of d must be ordered after the load too.
  auto ev = rig.evict(ids({2}), ids({7}));
  ASSERT_TRUE(ev.ok());
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(rig.mgr().task_info(*ev)->state, TaskState::kPending)
      << "the eviction of block 2 ran before the load that writes it";

  hold.release();
  rig.quiesce_and_verify();  // host block 7 must hold the loaded bytes
  EXPECT_EQ(check_pattern(snapshot.data(), n, loaded_tag, last, 0), -1)
      << "wait_device_blocks_free(2, compute) did not wait for the load's last layer";
  EXPECT_TRUE(*rig.mgr().is_device_block_free(2));
}

// Per-layer declared writes (the forward appends a token to every layer)
// while the load runs: the block stays busy until the load is final.
TEST(TransferHazards, PerLayerWritesDuringLoadAreOrderedAfterEachLayer) {
  auto dev = make_host(102, 50);
  TransferRig rig(*dev, options(6));
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 3);
  for (int round = 0; round < 20; ++round) {
    // Half the rounds hold the input stream, so the load is certainly still
    // pending while the forward declares its writes.
    Gate hold;
    const bool held = round % 2 == 0;
    if (held) {
      ASSERT_TRUE(hold.block(*dev, rig.mgr().input_stream()).ok());
    }
    auto load = rig.mgr().load_layers_to_device_async({}, ids({3}), ids({4}));
    ASSERT_TRUE(load.ok());
    for (std::uint32_t l = 0; l < rig.layout().num_layers(); ++l) {
      ASSERT_TRUE(rig.mgr().wait_for_layer(*load, l, rig.compute()).ok());
      ASSERT_TRUE(rig.mgr().record_device_access(ids({4}), rig.compute(), TransferManager::DeviceAccess::kWrite).ok());
    }
    if (held) {
      EXPECT_FALSE(*rig.mgr().is_device_block_free(4)) << "round " << round;
      hold.release();
    }
    ASSERT_TRUE(rig.mgr().wait(*load, 10s).ok());
    ASSERT_TRUE(dev->synchronize(rig.compute(), 10s).ok());
    EXPECT_TRUE(*rig.mgr().is_device_block_free(4));
  }
}

// ------------------------------------------------------------ defect 4
// A block that is only read (a shared prefix) by many streams must not keep
// one record (and one pooled event) per stream forever.
TEST(TransferHazards, SettledReadersArePruned) {
  auto dev = make_host(103, 0);
  HazardTracker tracker(*dev, 4, "device");
  std::vector<std::unique_ptr<Stream>> streams;
  const std::vector<BlockId> block = {1};
  for (int i = 0; i < 100; ++i) {
    auto s = dev->create_stream({});
    ASSERT_TRUE(s.ok());
    auto e = dev->create_event();
    ASSERT_TRUE(e.ok());
    EventLease ev = std::move(e).value();
    ASSERT_TRUE(dev->record(*ev, **s).ok());
    ASSERT_TRUE(dev->synchronize(**s, 10s).ok());
    tracker.note_read(block, ev, (*s)->id());
    streams.push_back(std::move(s).value());
  }
  EXPECT_LE(tracker.tracked_events(1), 1u) << "settled readers of other streams are kept";
}

TEST(TransferHazards, SharedPrefixReadersDoNotGrowTheEventPool) {
  auto dev = make_host(104, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  const std::uint64_t before = rig.mgr().stats().events_created;
  for (int i = 0; i < 200; ++i) {
    auto s = dev->create_stream({});
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(rig.mgr().record_device_access(ids({0, 1}), **s, TransferManager::DeviceAccess::kRead).ok());
    ASSERT_TRUE(dev->synchronize(**s, 10s).ok());
  }
  EXPECT_LT(rig.mgr().stats().events_created - before, 20u)
      << "every stream that ever read the shared blocks holds an event";
}

// ------------------------------------------------------------ defect 2
// A second shutdown() while the first is draining returns only when the
// first is complete (accepted tasks finished, callbacks ran), with its status.
TEST(TransferLifecycle, SecondShutdownWaitsForTheFirst) {
  auto dev = make_host(105, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 1);
  Gate hold;
  ASSERT_TRUE(hold.block(*dev, rig.mgr().input_stream()).ok());
  std::atomic<bool> callback_ran{false};
  LoadOptions lo;
  lo.on_done = [&](TaskId, const Status&) {
    std::this_thread::sleep_for(20ms);
    callback_ran = true;
  };
  auto load = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({3}), lo);
  ASSERT_TRUE(load.ok());
  Status first;
  std::thread a([&] { first = rig.mgr().shutdown(); });
  std::thread releaser([&] {
    std::this_thread::sleep_for(150ms);
    hold.release();
  });
  std::this_thread::sleep_for(40ms);  // the first call is draining
  Status second = rig.mgr().shutdown();
  EXPECT_TRUE(callback_ran) << "the second shutdown() returned before the first finished draining";
  a.join();
  releaser.join();
  EXPECT_EQ(second.code(), first.code());
  EXPECT_TRUE(first.ok()) << first.to_string();
  EXPECT_EQ(rig.mgr().shutdown().code(), first.code());
}

// After shutdown the progress thread is gone and its thread id may be given
// to a new thread: that thread is not the progress thread (found by CI: two
// concurrent shutdown() calls, one returned FailedPrecondition).
TEST(TransferLifecycle, ShutdownFromAThreadReusingTheProgressThreadIdIsNotRefused) {
  auto dev = make_host(110, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  ASSERT_TRUE(rig.mgr().shutdown().ok());
  for (int i = 0; i < 50; ++i) {
    Status again, waited;
    std::thread([&] {
      again = rig.mgr().shutdown();
      waited = rig.mgr().wait_all(1s);
    }).join();
    ASSERT_TRUE(again.ok()) << "thread " << i << ": " << again.to_string();
    ASSERT_TRUE(waited.ok()) << "thread " << i << ": " << waited.to_string();
  }
}

TEST(TransferLifecycle, ShutdownFromACallbackIsRefused) {
  auto dev = make_host(106, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 1);
  Status from_callback;
  LoadOptions lo;
  lo.on_done = [&](TaskId, const Status&) { from_callback = rig.mgr().shutdown(); };
  auto load = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({3}), lo);
  ASSERT_TRUE(load.ok());
  ASSERT_TRUE(rig.mgr().wait(*load, 10s).ok());
  EXPECT_EQ(from_callback.code(), StatusCode::kFailedPrecondition) << from_callback.to_string();
  EXPECT_NE(from_callback.message().find("callback"), std::string::npos);
  // The manager still works.
  auto again = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({4}));
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_TRUE(rig.mgr().wait(*again, 10s).ok());
}

// ------------------------------------------------------------ defect 3
// A callback that host-waits for another task (submitted after it) must not
// block the only progress thread until the wait times out.
TEST(TransferLifecycle, CallbackMayWaitForAnotherTask) {
  auto dev = make_host(107, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 1);
  seed_host_block(rig, 1, 2);
  Gate hold;
  ASSERT_TRUE(hold.block(*dev, rig.mgr().input_stream()).ok());
  std::atomic<TaskId> second_id{0};
  std::atomic<bool> second_layer_cb{false};
  Status waited = Internal("callback never ran"), waited_layer = Internal("not run"), waited_all = Internal("not run");
  std::chrono::steady_clock::duration took{};
  LoadOptions first_opts;
  first_opts.on_done = [&](TaskId, const Status&) {
    const auto t0 = std::chrono::steady_clock::now();
    waited_layer = rig.mgr().wait_layer_host(second_id.load(), 0, 5s);
    waited = rig.mgr().wait(second_id.load(), 5s);
    waited_all = rig.mgr().wait_all(5s);
    took = std::chrono::steady_clock::now() - t0;
  };
  auto first = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({3}), first_opts);
  ASSERT_TRUE(first.ok());
  LoadOptions second_opts;
  second_opts.on_layer = [&](std::uint32_t, const Status&) { second_layer_cb = true; };
  auto second = rig.mgr().load_layers_to_device_async({}, ids({2}), ids({4}), second_opts);
  ASSERT_TRUE(second.ok());
  second_id = *second;
  hold.release();
  ASSERT_TRUE(rig.mgr().wait(*first, 20s).ok());
  EXPECT_TRUE(waited_layer.ok()) << waited_layer.to_string();
  EXPECT_TRUE(waited.ok()) << waited.to_string();
  EXPECT_TRUE(waited_all.ok()) << waited_all.to_string();
  EXPECT_LT(took, 4s) << "the callback's wait lasted until its timeout";
  EXPECT_TRUE(second_layer_cb) << "the awaited task's callbacks ran after the wait returned";
  ASSERT_TRUE(rig.mgr().wait(*second, 10s).ok());
}

// A layer's callback that host-waits for a later layer of its own task: the progress thread settles the rest of the
// task inside that callback. The task was then published (and its later callbacks and on_done run) while the first
// callback still ran, so wait() and wait_all() returned before the callbacks of what they waited for had run, and
// on_done ran before on_layer(0) returned. The task's later callbacks now wait for it: in order, on_done last.
TEST(TransferLifecycle, WaitReturnsAfterACallbackThatWaitedForItsOwnTask) {
  for (bool use_wait_all : {false, true}) {
    SCOPED_TRACE(use_wait_all ? "wait_all" : "wait");
    auto dev = make_host(109, 0);
    dev->set_delays(std::chrono::milliseconds(2), std::chrono::milliseconds(2));  // layers settle one by one
    TransferRig rig(*dev, options());
    ASSERT_TRUE(rig.init().ok());
    seed_host_block(rig, 0, 1);
    std::atomic<TaskId> id{0};
    std::atomic<bool> first_layer_returned{false}, done_ran{false}, done_after_layers{false};
    std::mutex order_mu;
    std::vector<int> order;  // layers' callbacks in the order they ran; -1: on_done
    const std::uint32_t last_layer = options().layout.num_layers() - 1;
    LoadOptions o;
    o.on_layer = [&](std::uint32_t layer, const Status&) {
      {
        std::lock_guard lock(order_mu);
        order.push_back(static_cast<int>(layer));
      }
      if (layer != 0) return;
      while (id.load() == 0) std::this_thread::yield();
      EXPECT_TRUE(rig.mgr().wait_layer_host(id.load(), last_layer, 10s).ok());
      const TaskInfo info = *rig.mgr().task_info(id.load());
      EXPECT_EQ(info.state, TaskState::kDone) << "the wait settled the task's later layers here";
      std::this_thread::sleep_for(100ms);
      first_layer_returned = true;
    };
    o.on_done = [&](TaskId, const Status&) {
      std::lock_guard lock(order_mu);
      done_after_layers = first_layer_returned.load() && order.size() == last_layer + 1;
      order.push_back(-1);
      done_ran = true;
    };
    auto t = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({3}), o);
    ASSERT_TRUE(t.ok());
    id = *t;
    ASSERT_TRUE((use_wait_all ? rig.mgr().wait_all(20s) : rig.mgr().wait(*t, 20s)).ok());
    EXPECT_TRUE(first_layer_returned) << "returned while layer 0's callback still ran";
    EXPECT_TRUE(done_ran) << "returned before on_done ran";
    EXPECT_TRUE(done_after_layers) << "on_done ran before every on_layer had returned";
    std::vector<int> want;
    for (std::uint32_t l = 0; l <= last_layer; ++l) want.push_back(static_cast<int>(l));
    want.push_back(-1);
    std::lock_guard lock(order_mu);
    EXPECT_EQ(order, want) << "the callbacks ran out of layer order";
  }
}

// A stream of another Device was refused only when there was something to wait for (the device's own check): with
// the blocks free the call succeeded, so a caller's bug showed only under load.
TEST(TransferLifecycle, WaitDeviceBlocksFreeRefusesAnotherDevicesStreamAlways) {
  auto dev = make_host(110, 0);
  auto other = make_host(111, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  auto foreign = other->create_stream();
  ASSERT_TRUE(foreign.ok());
  const Status st = rig.mgr().wait_device_blocks_free(ids({0}), **foreign);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("another Device"), std::string::npos) << st.to_string();
  EXPECT_TRUE(rig.mgr().wait_device_blocks_free(ids({0}), rig.compute()).ok());
}

// ------------------------------------------------------------ defect 7
// "Wait forever" (nanoseconds::max()) must wait, not time out at once.
TEST(TransferLifecycle, UnboundedTimeoutsWait) {
  auto dev = make_host(108, 0);
  TransferRig rig(*dev, options());
  ASSERT_TRUE(rig.init().ok());
  seed_host_block(rig, 0, 1);
  Gate hold;
  ASSERT_TRUE(hold.block(*dev, rig.mgr().input_stream()).ok());
  auto load = rig.mgr().load_layers_to_device_async({}, ids({1}), ids({3}));
  ASSERT_TRUE(load.ok());
  constexpr auto forever = std::chrono::nanoseconds::max();
  std::atomic<int> returned{0};
  Status s_wait, s_layer, s_all, s_host;
  std::vector<std::thread> waiters;
  waiters.emplace_back([&] { s_wait = rig.mgr().wait(*load, forever), returned++; });
  waiters.emplace_back([&] { s_layer = rig.mgr().wait_layer_host(*load, 1, forever), returned++; });
  waiters.emplace_back([&] { s_all = rig.mgr().wait_all(forever), returned++; });
  waiters.emplace_back([&] { s_host = rig.mgr().wait_host_blocks_free(ids({1}), forever), returned++; });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(returned.load(), 0) << "a wait with an unbounded timeout returned while the copy was held";
  hold.release();
  for (auto& t : waiters) t.join();
  EXPECT_TRUE(s_wait.ok()) << s_wait.to_string();
  EXPECT_TRUE(s_layer.ok()) << s_layer.to_string();
  EXPECT_TRUE(s_all.ok()) << s_all.to_string();
  EXPECT_TRUE(s_host.ok()) << s_host.to_string();
  // Negative timeouts do not wait.
  EXPECT_TRUE(rig.mgr().wait(*load, -1s).ok());
}

// ------------------------------------------------------------ config
TEST(TransferLifecycle, ConfigValuesAreValidated) {
  auto dev = make_host(109, 0);
  auto compute = dev->create_stream({});
  ASSERT_TRUE(compute.ok());
  auto expect_rejected = [&](auto mutate, std::string_view field) {
    TransferManagerConfig c;
    mutate(c);
    Status s = validate_transfer_config(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s.to_string();
  };
  expect_rejected([](TransferManagerConfig& c) { c.max_in_flight_tasks = 0; }, "max_in_flight_tasks");
  expect_rejected([](TransferManagerConfig& c) { c.retained_finished_tasks = 0; }, "retained_finished_tasks");
  expect_rejected([](TransferManagerConfig& c) { c.latency_samples = 0; }, "latency_samples");
  // A ring allocated whole at create: 1G samples aborted the process (bad_alloc).
  expect_rejected([](TransferManagerConfig& c) { c.latency_samples = std::size_t{1} << 30; }, "latency_samples");
  // Every completion dropped unseen: the cache's plan executor waited for its tasks forever.
  expect_rejected([](TransferManagerConfig& c) { c.max_unpolled_completions = 0; }, "max_unpolled_completions");
  expect_rejected([](TransferManagerConfig& c) { c.poll_interval = 0us; }, "poll_interval");
  // Every completion seen that late: a typo of "50s" for "50us" made each transfer take 50 s.
  expect_rejected([](TransferManagerConfig& c) { c.poll_interval = std::chrono::seconds(50); }, "poll_interval");
  expect_rejected([](TransferManagerConfig& c) { c.shutdown_timeout = 0ms; }, "shutdown_timeout");
  // "Never" overflowed shutdown()'s nanosecond wait (twice the timeout): a shutdown timed out at once.
  expect_rejected([](TransferManagerConfig& c) { c.shutdown_timeout = std::chrono::milliseconds::max(); },
                  "shutdown_timeout");
  expect_rejected([](TransferManagerConfig& c) { c.host_ready_timeout = std::chrono::milliseconds::max(); },
                  "host_ready_timeout");
  expect_rejected([](TransferManagerConfig& c) { c.host_ready_timeout = -1ms; }, "host_ready_timeout");
  expect_rejected([](TransferManagerConfig& c) { c.load_strategy = static_cast<CopyStrategy>(99); }, "load_strategy");
  EXPECT_TRUE(validate_transfer_config(TransferManagerConfig{}).ok());

  // create() refuses it before allocating anything.
  RigOptions o = options();
  o.config.max_in_flight_tasks = 0;
  TransferRig rig(*dev, o);
  Status s = rig.init();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("max_in_flight_tasks"), std::string::npos) << s.to_string();

  // The knob and its variable are named (the message named only the struct's field), and so are the copy engine's
  // knobs when its options are what create() refuses (the message named neither).
  TransferManagerConfig c;
  c.latency_samples = 0;
  const Status named = validate_transfer_config(c);
  EXPECT_NE(named.message().find("knob transfer.latency_samples, KVTIER_TRANSFER_LATENCY_SAMPLES"), std::string::npos)
      << named.to_string();
  RigOptions e = options();
  e.config.copy_engine.auto_split_adaptive_gain = 0;
  TransferRig engine_rig(*dev, e);
  const Status refused = engine_rig.init();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
  EXPECT_NE(refused.message().find("transfer.copy_engine"), std::string::npos) << refused.to_string();
  EXPECT_NE(refused.message().find("auto_split_adaptive_gain"), std::string::npos) << refused.to_string();
}

// ------------------------------------------------------------ randomized
// The engine's patterns under random interleavings and injected delays,
// against the byte model: decode steps (per-layer declared writes during
// loads), reuse right after submission, callbacks that wait for other tasks,
// and (last) shutdown from two threads with work in flight; with and without
// injected copy failures. Bounded: a few thousand operations per case.
transfer_test::RigOptions random_options(KvLayout layout, CopyStrategy strategy) {
  return transfer_test::small_rig_options(std::move(layout), strategy);
}

TEST(TransferInterleaving, EnginePatternsAgainstTheModel) {
  for (std::uint64_t seed : {301, 302, 303}) {
    auto dev = make_host(seed);
    transfer_test::RandomOptions ro;
    ro.ops = 1500;
    ro.seed = seed;
    ro.engine_patterns = true;
    ro.shutdown_in_flight = seed == 303;
    transfer_test::run_random_interleaving(*dev, random_options(small_gqa(), CopyStrategy::kAuto), ro);
    if (HasFatalFailure()) return;
  }
}

TEST(TransferInterleaving, EnginePatternsWithFailures) {
  for (std::uint64_t seed : {311, 312}) {
    auto dev = make_host(seed);
    transfer_test::RandomOptions ro;
    ro.ops = 1200;
    ro.seed = seed;
    ro.engine_patterns = true;
    ro.inject_failures = true;
    ro.failure_permille = 2;
    ro.phase_ops = 30;
    ro.shutdown_in_flight = seed == 312;
    transfer_test::run_random_interleaving(*dev, random_options(small_gqa(6), CopyStrategy::kDmaPerRun), ro);
    if (HasFatalFailure()) return;
  }
}

TEST(TransferInterleaving, EnginePatternsSynchronousSubmit) {
  auto dev = make_host(321);
  transfer_test::RandomOptions ro;
  ro.ops = 800;
  ro.seed = 321;
  ro.engine_patterns = true;
  RigOptions o = random_options(small_gqa(), CopyStrategy::kDmaBatch);
  o.config.async_submit = false;
  transfer_test::run_random_interleaving(*dev, o, ro);
}

}  // namespace
}  // namespace kvtier
