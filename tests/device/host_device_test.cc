// Host-backend-only behaviour: failure injection and propagation, tasks,
// delays, and a multi-stream stress test checked against a sequential model.
#include "kvtier/device/host_device.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/device/cuda_device.h"
#include "tests/device/device_test_util.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using testing::fill_random;
using testing::first_mismatch;
using testing::first_not;

constexpr auto kLong = std::chrono::nanoseconds(30s);

std::string hex_ptr(const void* p) { return fmt::format("{}", p); }

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

class HostDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK_AND_ASSIGN(device_, HostDevice::create(options_)); }
  HostDevice& dev() { return *device_; }

  HostDeviceOptions options_;
  std::unique_ptr<HostDevice> device_;
};

TEST(HostDeviceCreate, RejectsBadOptions) {
  HostDeviceOptions options;
  options.min_delay = 10us;
  options.max_delay = 5us;
  EXPECT_EQ(HostDevice::create(options).status().code(), StatusCode::kInvalidArgument);
  options = {};
  options.simulated_multiprocessors = 0;
  EXPECT_EQ(HostDevice::create(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(HostDeviceCreate, DefaultDeviceWithoutGpuIsHost) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible";
  ASSERT_OK_AND_ASSIGN(auto device, open_default_device());
  EXPECT_EQ(device->backend(), BackendKind::kHost);
  EXPECT_EQ(backend_name(device->backend()), "host");
  EXPECT_EQ(backend_name(BackendKind::kCuda), "cuda");
  ASSERT_OK_AND_ASSIGN(auto second, open_default_device(/*prefer_cuda=*/false, 3));
  EXPECT_EQ(second->ordinal(), 3);
}

TEST_F(HostDeviceTest, DeviceMemoryIsAlignedAndPoisoned) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, dev().allocate_device(1000));
  EXPECT_EQ(buffer.size(), 1000u);
  EXPECT_EQ(buffer.kind(), MemoryKind::kDevice);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % 64, 0u);
  EXPECT_EQ(first_not(buffer.data(), 0xA5, 1000), -1);
}

TEST_F(HostDeviceTest, RejectsForeignStreamsAndEvents) {
  ASSERT_OK_AND_ASSIGN(auto other, HostDevice::create());
  ASSERT_OK_AND_ASSIGN(auto foreign_stream, other->create_stream());
  ASSERT_OK_AND_ASSIGN(auto foreign_event, other->create_event());
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK_AND_ASSIGN(auto e, dev().create_event());
  std::array<std::byte, 16> a{}, b{};
  EXPECT_EQ(dev().memcpy_async(a.data(), b.data(), 16, *foreign_stream).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev().record(*foreign_event, *s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev().record(*e, *foreign_stream).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev().wait(*s, *foreign_event).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev().query(*foreign_event).status().code(), StatusCode::kInvalidArgument);
  // Overlapping copies are a caller bug.
  EXPECT_EQ(dev().memcpy_async(a.data(), a.data() + 4, 8, *s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev().memcpy_sync(a.data() + 4, a.data(), 8).code(), StatusCode::kInvalidArgument);
}

TEST_F(HostDeviceTest, MemcpySync) {
  std::vector<std::byte> src(5000), dst(5000, std::byte{0xCC});
  fill_random(src.data(), src.size(), 3);
  ASSERT_OK(dev().memcpy_sync(dst.data(), src.data(), src.size()));
  EXPECT_EQ(first_mismatch(dst.data(), src.data(), src.size()), -1);
  EXPECT_EQ(dev().operations_executed(), 1u);
  dev().fail_nth_operation(1);
  std::memset(dst.data(), 0xCC, dst.size());
  const Status status = dev().memcpy_sync(dst.data(), src.data(), src.size());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "memcpy_sync")) << status.to_string();
  EXPECT_EQ(first_not(dst.data(), 0xDB, dst.size()), -1);
}

// The n-th operation fails: its destination is poisoned, events before it are
// fine, events after it report it, later operations still run.
TEST_F(HostDeviceTest, NthOperationFails) {
  constexpr std::uint64_t kBytes = 4096;
  ASSERT_OK_AND_ASSIGN(Buffer x, dev().allocate_device(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer y, dev().allocate_device(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer z, dev().allocate_device(kBytes));
  std::vector<std::byte> src(kBytes);
  fill_random(src.data(), kBytes, 9);
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream({StreamPriority::kNormal, "evict"}));
  ASSERT_OK_AND_ASSIGN(auto before, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto after, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto last, dev().create_event());
  ASSERT_OK(dev().memcpy_sync(x.data(), src.data(), 16));           // op #1, not counted below
  dev().fail_nth_operation(2);                                      // => global op #3
  ASSERT_OK(dev().memcpy_async(x.data(), src.data(), kBytes, *s));  // #2
  ASSERT_OK(dev().record(*before, *s));
  ASSERT_OK(dev().memcpy_async(y.data(), src.data(), kBytes, *s));  // #3 fails
  ASSERT_OK(dev().record(*after, *s));
  ASSERT_OK(dev().memcpy_async(z.data(), src.data(), kBytes, *s));  // #4 runs
  ASSERT_OK(dev().record(*last, *s));

  const Status status = dev().synchronize(*s, kLong);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "injected failure in memcpy_async #3")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "dst=" + hex_ptr(y.data()))) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "4096 bytes")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "evict")) << status.to_string();

  ASSERT_OK_AND_ASSIGN(bool before_done, dev().query(*before));
  EXPECT_TRUE(before_done);
  EXPECT_OK(dev().synchronize(*before, kLong));
  EXPECT_EQ(dev().query(*after).status(), status);
  EXPECT_EQ(dev().synchronize(*after, kLong), status);
  EXPECT_EQ(dev().query(*last).status(), status);

  EXPECT_EQ(first_mismatch(x.data(), src.data(), kBytes), -1);
  EXPECT_EQ(first_not(y.data(), 0xDB, kBytes), -1);
  EXPECT_EQ(first_mismatch(z.data(), src.data(), kBytes), -1);
  EXPECT_EQ(dev().operations_executed(), 4u);

  // Clearing the sticky error lets new fences succeed; the injection was one-shot.
  dev().clear_stream_error(*s);
  ASSERT_OK(dev().memcpy_async(y.data(), src.data(), kBytes, *s));
  ASSERT_OK(dev().record(*after, *s));
  EXPECT_OK(dev().synchronize(*after, kLong));
  EXPECT_EQ(first_mismatch(y.data(), src.data(), kBytes), -1);
}

class HostDeviceNoPoisonTest : public HostDeviceTest {
 protected:
  HostDeviceNoPoisonTest() { options_.poison_on_failure = false; }
};

TEST_F(HostDeviceNoPoisonTest, FailedCopyLeavesDestinationUntouched) {
  ASSERT_OK_AND_ASSIGN(Buffer y, dev().allocate_device(4096));
  std::vector<std::byte> src(4096, std::byte{1});
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  dev().fail_nth_operation(1);
  ASSERT_OK(dev().memset_async(y.data(), 7, 4096, *s));
  const Status status = dev().synchronize(*s, kLong);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(status.message(), "memset_async #1")) << status.to_string();
  EXPECT_EQ(first_not(y.data(), 0xA5, 4096), -1);
}

TEST_F(HostDeviceTest, PredicateSelectsByDestination) {
  constexpr std::uint64_t kBytes = 1024;
  ASSERT_OK_AND_ASSIGN(Buffer good, dev().allocate_device(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer bad, dev().allocate_device(kBytes));
  std::vector<std::byte> src(kBytes);
  fill_random(src.data(), kBytes, 10);
  std::mutex mu;
  std::vector<std::uint64_t> seen;
  void* bad_ptr = bad.data();
  dev().set_failure_predicate([&, bad_ptr](std::uint64_t seq, const void* dst, std::uint64_t bytes) {
    std::lock_guard lock(mu);
    seen.push_back(seq);
    return dst == bad_ptr && bytes == kBytes;
  });
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK(dev().memcpy_async(good.data(), src.data(), kBytes, *s));
  ASSERT_OK(dev().memcpy_async(bad.data(), src.data(), kBytes, *s));
  EXPECT_EQ(dev().synchronize(*s, kLong).code(), StatusCode::kDataLoss);
  dev().set_failure_predicate(nullptr);
  EXPECT_EQ(first_mismatch(good.data(), src.data(), kBytes), -1);
  EXPECT_EQ(first_not(bad.data(), 0xDB, kBytes), -1);
  std::lock_guard lock(mu);
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{1, 2}));
}

// A failure predicate is the caller's code: one that throws failed nothing and ended the process (std::terminate on
// the stream's worker; through memcpy_sync the exception left the C++ API). The operation fails with kInternal.
TEST_F(HostDeviceTest, APredicateThatThrowsFailsTheOperation) {
  constexpr std::uint64_t kBytes = 256;
  ASSERT_OK_AND_ASSIGN(Buffer dst, dev().allocate_device(kBytes));
  std::vector<std::byte> src(kBytes);
  dev().set_failure_predicate(
      [](std::uint64_t, const void*, std::uint64_t) -> bool { throw std::runtime_error("predicate bug"); });
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK(dev().memcpy_async(dst.data(), src.data(), kBytes, *s));
  Status st = dev().synchronize(*s, kLong);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.to_string();
  EXPECT_NE(st.message().find("predicate bug"), std::string::npos) << st.to_string();
  Status sync = dev().memcpy_sync(dst.data(), src.data(), kBytes);
  EXPECT_EQ(sync.code(), StatusCode::kInternal) << sync.to_string();
  dev().set_failure_predicate(nullptr);
}

// A stream that waits on failed work inherits the failure; one that does not
// stays healthy; fences before the wait stay healthy.
TEST_F(HostDeviceTest, FailurePropagatesThroughWait) {
  constexpr std::uint64_t kBytes = 2048;
  ASSERT_OK_AND_ASSIGN(Buffer x, dev().allocate_device(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer y, dev().allocate_device(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer w, dev().allocate_device(kBytes));
  std::vector<std::byte> src(kBytes), dst(kBytes, std::byte{0xCC});
  fill_random(src.data(), kBytes, 12);
  ASSERT_OK_AND_ASSIGN(auto a, dev().create_stream({StreamPriority::kNormal, "producer"}));
  ASSERT_OK_AND_ASSIGN(auto b, dev().create_stream({StreamPriority::kNormal, "consumer"}));
  ASSERT_OK_AND_ASSIGN(auto c, dev().create_stream({StreamPriority::kNormal, "bystander"}));
  ASSERT_OK_AND_ASSIGN(auto ea, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto eb_before, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto eb, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto eb2, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto ec, dev().create_event());

  ASSERT_OK(dev().memcpy_async(w.data(), src.data(), kBytes, *b));
  ASSERT_OK(dev().record(*eb_before, *b));
  void* failing = x.data();  // only the producer's copy into x fails
  dev().set_failure_predicate([failing](std::uint64_t, const void* dst, std::uint64_t) { return dst == failing; });
  ASSERT_OK(dev().memcpy_async(x.data(), src.data(), kBytes, *a));
  ASSERT_OK(dev().record(*ea, *a));
  ASSERT_OK(dev().wait(*b, *ea));
  ASSERT_OK(dev().memcpy_async(dst.data(), x.data(), kBytes, *b));
  ASSERT_OK(dev().record(*eb, *b));
  // b -> c through a second hop.
  ASSERT_OK(dev().memcpy_async(y.data(), src.data(), kBytes, *c));
  ASSERT_OK(dev().record(*ec, *c));
  EXPECT_OK(dev().synchronize(*ec, kLong));
  ASSERT_OK(dev().wait(*c, *eb));
  ASSERT_OK(dev().record(*ec, *c));

  const Status producer = dev().synchronize(*ea, kLong);
  EXPECT_EQ(producer.code(), StatusCode::kDataLoss) << producer.to_string();
  const Status consumer = dev().synchronize(*eb, kLong);
  EXPECT_EQ(consumer.code(), StatusCode::kDataLoss) << consumer.to_string();
  EXPECT_TRUE(contains(consumer.message(), "consumer")) << consumer.to_string();
  EXPECT_TRUE(contains(consumer.message(), "producer")) << consumer.to_string();
  EXPECT_TRUE(contains(consumer.message(), "injected failure in memcpy_async #")) << consumer.to_string();
  EXPECT_TRUE(contains(consumer.message(), "dst=" + hex_ptr(x.data()))) << consumer.to_string();
  const Status second_hop = dev().synchronize(*ec, kLong);
  EXPECT_EQ(second_hop.code(), StatusCode::kDataLoss) << second_hop.to_string();
  EXPECT_OK(dev().synchronize(*eb_before, kLong));
  // The consumer copied the poisoned bytes: the failure is real, not only reported.
  EXPECT_EQ(first_not(dst.data(), 0xDB, kBytes), -1);
  EXPECT_EQ(first_mismatch(y.data(), src.data(), kBytes), -1);
  // A later fence on b still reports the failure (sticky).
  ASSERT_OK(dev().record(*eb2, *b));
  EXPECT_EQ(dev().query(*eb2).status().code(), StatusCode::kDataLoss);
}

TEST_F(HostDeviceTest, HostCallbackReceivesPriorStatus) {
  ASSERT_OK_AND_ASSIGN(Buffer x, dev().allocate_device(64));
  std::vector<std::byte> src(64);
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  std::mutex mu;
  std::vector<Status> statuses;
  auto record_status = [&](const Status& status) {
    std::lock_guard lock(mu);
    statuses.push_back(status);
  };
  ASSERT_OK(dev().memcpy_async(x.data(), src.data(), 64, *s));
  ASSERT_OK(dev().launch_host_callback(*s, record_status));
  ASSERT_OK(dev().synchronize(*s, kLong));  // "n-th from now" counts executed operations
  dev().fail_nth_operation(1);
  ASSERT_OK(dev().memcpy_async(x.data(), src.data(), 64, *s));
  ASSERT_OK(dev().launch_host_callback(*s, record_status));
  EXPECT_EQ(dev().synchronize(*s, kLong).code(), StatusCode::kDataLoss);
  std::lock_guard lock(mu);
  ASSERT_EQ(statuses.size(), 2u);
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_EQ(statuses[1].code(), StatusCode::kDataLoss);
}

TEST_F(HostDeviceTest, CallbackThatThrowsFailsTheStream) {
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK(dev().launch_host_callback(*s, [](const Status&) { throw std::runtime_error("callback boom"); }));
  const Status status = dev().synchronize(*s, kLong);
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_TRUE(contains(status.message(), "callback boom")) << status.to_string();
}

TEST_F(HostDeviceTest, EnqueueTaskRunsInOrder) {
  constexpr std::uint64_t kBytes = 512;
  ASSERT_OK_AND_ASSIGN(Buffer x, dev().allocate_device(kBytes));
  std::vector<std::byte> src(kBytes);
  fill_random(src.data(), kBytes, 14);
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  std::vector<int> order;  // touched by the worker only until synchronize
  ASSERT_OK(dev().memcpy_async(x.data(), src.data(), kBytes, *s));
  ASSERT_OK(dev().enqueue_task(
      *s,
      [&] {
        order.push_back(1);
        // Sees the copy before it; increments every byte.
        for (std::uint64_t i = 0; i < kBytes; ++i) x.bytes_ptr()[i] = std::byte(std::to_integer<int>(src[i]) + 1);
        return Status::Ok();
      },
      x.data(), kBytes));
  ASSERT_OK(dev().enqueue_task(*s, [&] {
    order.push_back(2);
    return Status::Ok();
  }));
  ASSERT_OK(dev().synchronize(*s, kLong));
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_EQ(dev().operations_executed(), 3u);
  for (std::uint64_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(std::to_integer<int>(x.bytes_ptr()[i]), (std::to_integer<int>(src[i]) + 1) & 0xFF) << i;
  }
  EXPECT_EQ(dev().enqueue_task(*s, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST_F(HostDeviceTest, FailingTaskMarksStream) {
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream({StreamPriority::kNormal, "kernels"}));
  ASSERT_OK_AND_ASSIGN(auto before, dev().create_event());
  ASSERT_OK_AND_ASSIGN(auto after, dev().create_event());
  bool ran_later = false;
  ASSERT_OK(dev().enqueue_task(*s, [] { return Status::Ok(); }));
  ASSERT_OK(dev().record(*before, *s));
  ASSERT_OK(dev().enqueue_task(*s, [] { return Aborted("kernel boom"); }));
  ASSERT_OK(dev().enqueue_task(*s, [&] {
    ran_later = true;
    return Status::Ok();
  }));
  ASSERT_OK(dev().record(*after, *s));
  const Status status = dev().synchronize(*after, kLong);
  EXPECT_EQ(status.code(), StatusCode::kAborted) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "kernel boom")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "enqueue_task #2")) << status.to_string();
  EXPECT_OK(dev().synchronize(*before, kLong));
  EXPECT_TRUE(ran_later);
}

TEST_F(HostDeviceTest, InjectedTaskFailureSkipsTaskAndPoisons) {
  ASSERT_OK_AND_ASSIGN(Buffer x, dev().allocate_device(256));
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  bool ran = false;
  dev().fail_nth_operation(1);
  ASSERT_OK(dev().enqueue_task(
      *s,
      [&] {
        ran = true;
        return Status::Ok();
      },
      x.data(), 128));
  const Status status = dev().synchronize(*s, kLong);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(status.message(), "injected failure in enqueue_task #1")) << status.to_string();
  EXPECT_FALSE(ran);
  EXPECT_EQ(first_not(x.data(), 0xDB, 128), -1);
  EXPECT_EQ(first_not(x.bytes_ptr() + 128, 0xA5, 128), -1);
}

TEST_F(HostDeviceTest, TaskThatThrowsFailsTheStream) {
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK(dev().enqueue_task(*s, []() -> Status { throw std::runtime_error("task boom"); }));
  const Status status = dev().synchronize(*s, kLong);
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_TRUE(contains(status.message(), "task boom")) << status.to_string();
}

TEST_F(HostDeviceTest, WaitOnOwnStreamEventIsOrdered) {
  ASSERT_OK_AND_ASSIGN(auto s, dev().create_stream());
  ASSERT_OK_AND_ASSIGN(auto e, dev().create_event());
  int value = 0;
  ASSERT_OK(dev().enqueue_task(*s, [&] {
    value = 1;
    return Status::Ok();
  }));
  ASSERT_OK(dev().record(*e, *s));
  ASSERT_OK(dev().wait(*s, *e));
  ASSERT_OK(dev().enqueue_task(*s, [&] {
    value *= 10;
    return Status::Ok();
  }));
  ASSERT_OK(dev().synchronize(*s, kLong));
  EXPECT_EQ(value, 10);
}

// Stress: a random program of copies, memsets and tasks over slots of device
// and pinned memory, spread over 4 streams. Cross-stream hazards (read after
// write, write after read/write) are ordered with record/wait, as a hazard
// tracker would; extra random waits add noise. With random delays the final
// bytes must equal the program executed sequentially.
struct StressParams {
  int streams = 4;
  int ops = 4000;
  int slots = 48;
  std::uint64_t slot_bytes = 1024;
  std::chrono::microseconds max_delay{20};
};

void run_stress(const StressParams& params, std::uint64_t seed) {
  HostDeviceOptions options;
  options.max_delay = params.max_delay;
  options.seed = seed;
  ASSERT_OK_AND_ASSIGN(auto device, HostDevice::create(options));
  HostDevice& dev = *device;
  const std::uint64_t total = params.slots * params.slot_bytes;
  // Half the slots in device memory, half in pinned memory.
  ASSERT_OK_AND_ASSIGN(Buffer dmem, dev.allocate_device(total / 2));
  ASSERT_OK_AND_ASSIGN(auto hmem, dev.allocate_pinned(total / 2));
  auto slot_ptr = [&](int slot) -> std::byte* {
    const int half = params.slots / 2;
    return slot < half ? dmem.bytes_ptr() + slot * params.slot_bytes : hmem->data() + (slot - half) * params.slot_bytes;
  };
  std::vector<std::byte> model(total);
  for (int slot = 0; slot < params.slots; ++slot) {
    fill_random(slot_ptr(slot), params.slot_bytes, seed * 1000 + slot);
    std::memcpy(model.data() + slot * params.slot_bytes, slot_ptr(slot), params.slot_bytes);
  }
  auto model_ptr = [&](int slot) { return model.data() + slot * params.slot_bytes; };

  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::unique_ptr<Event>> events;  // one per stream, re-recorded for every wait
  for (int i = 0; i < params.streams; ++i) {
    ASSERT_OK_AND_ASSIGN(auto s, dev.create_stream({StreamPriority::kNormal, fmt::format("s{}", i)}));
    ASSERT_OK_AND_ASSIGN(auto e, dev.create_event());
    streams.push_back(std::move(s));
    events.push_back(std::move(e));
  }
  // Per slot: the streams that touched it since its last write, and the last writer.
  struct Access {
    int writer = -1;
    std::vector<bool> readers;
  };
  std::vector<Access> access(params.slots, Access{-1, std::vector<bool>(params.streams, false)});
  auto order_after = [&](int s, int other) -> Status {
    if (other < 0 || other == s) return Status::Ok();
    KVTIER_RETURN_IF_ERROR(dev.record(*events[other], *streams[other]));
    return dev.wait(*streams[s], *events[other]);
  };

  std::mt19937_64 rng(seed);
  for (int i = 0; i < params.ops; ++i) {
    const int s = static_cast<int>(rng() % params.streams);
    const int kind = static_cast<int>(rng() % 10);
    const int dst = static_cast<int>(rng() % params.slots);
    int src = static_cast<int>(rng() % params.slots);
    if (src == dst) src = (src + 1) % params.slots;
    const bool reads_src = kind < 6;
    const std::uint64_t off = rng() % params.slot_bytes;
    const std::uint64_t len = 1 + rng() % (params.slot_bytes - off);
    if (rng() % 8 == 0) ASSERT_OK(order_after(s, static_cast<int>(rng() % params.streams)));  // noise
    // Hazards: the writer of src (RAW); the writer and readers of dst (WAW, WAR).
    if (reads_src) ASSERT_OK(order_after(s, access[src].writer));
    ASSERT_OK(order_after(s, access[dst].writer));
    for (int r = 0; r < params.streams; ++r) {
      if (access[dst].readers[r]) ASSERT_OK(order_after(s, r));
    }
    std::byte* d = slot_ptr(dst) + off;
    if (kind < 6) {  // copy src -> dst (same offset)
      ASSERT_OK(dev.memcpy_async(d, slot_ptr(src) + off, len, *streams[s]));
      std::memcpy(model_ptr(dst) + off, model_ptr(src) + off, len);
    } else if (kind < 8) {
      const int value = static_cast<int>(rng() & 0xFF);
      ASSERT_OK(dev.memset_async(d, value, len, *streams[s]));
      std::memset(model_ptr(dst) + off, value, len);
    } else {  // task: rotate-add every byte
      const int add = static_cast<int>(rng() % 255) + 1;
      auto transform = [add](std::byte* p, std::uint64_t n) {
        for (std::uint64_t k = 0; k < n; ++k) p[k] = std::byte((std::to_integer<int>(p[k]) + add) & 0xFF);
      };
      ASSERT_OK(dev.enqueue_task(
          *streams[s],
          [transform, d, len] {
            transform(d, len);
            return Status::Ok();
          },
          d, len));
      transform(model_ptr(dst) + off, len);
    }
    if (reads_src) access[src].readers[s] = true;
    access[dst].writer = s;
    std::fill(access[dst].readers.begin(), access[dst].readers.end(), false);
  }
  for (auto& s : streams) ASSERT_OK(dev.synchronize(*s, kLong));
  EXPECT_EQ(dev.operations_executed(), static_cast<std::uint64_t>(params.ops));
  for (int slot = 0; slot < params.slots; ++slot) {
    ASSERT_EQ(first_mismatch(slot_ptr(slot), model_ptr(slot), params.slot_bytes), -1)
        << "slot " << slot << " seed " << seed;
  }
}

TEST(HostDeviceStress, FourStreamsMatchSequentialModel) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    run_stress({}, seed);
  }
}

TEST(HostDeviceStress, NoDelaysManySmallOps) {
  StressParams params;
  params.ops = 10000;
  params.max_delay = 0us;
  params.slot_bytes = 64;
  run_stress(params, 99);
}

}  // namespace
}  // namespace kvtier
