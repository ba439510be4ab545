// CudaDevice (device/cuda) against a real GPU; skipped where none is visible.
// Bytes are checked against random data with poisoned destinations.
#include "kvtier/device/cuda_device.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/gpu_gate.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using cuda_detail::DeviceGuard;
using cuda_detail::GateFlag;
using cuda_detail::native;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::byte kDevicePoison{0xA5};
constexpr std::byte kHostPoison{0xDB};

std::vector<std::byte> random_bytes(std::uint64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (std::uint64_t i = 0; i < n; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<std::uint64_t>(8, n - i));
  }
  return out;
}

// Index of the first differing byte, or -1.
std::int64_t first_mismatch(const std::byte* a, const std::byte* b, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<std::int64_t>(i);
  return -1;
}

bool all_equal(const std::byte* p, std::uint64_t n, std::byte v) {
  for (std::uint64_t i = 0; i < n; ++i)
    if (p[i] != v) return false;
  return true;
}

int current_device() {
  int d = -1;
  EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
  return d;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
    auto device = create_cuda_device(0);
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    device_ = std::move(device).value();
  }

  std::unique_ptr<Stream> stream(StreamPriority priority = StreamPriority::kNormal) {
    StreamOptions options;
    options.priority = priority;
    options.name = "test";
    auto s = device_->create_stream(options);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  std::unique_ptr<Event> event() {
    auto e = device_->create_event();
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    return e.ok() ? std::move(e).value() : nullptr;
  }
  Buffer device_buffer(std::uint64_t bytes) {
    auto b = device_->allocate_device(bytes);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    return b.ok() ? std::move(b).value() : Buffer();
  }
  std::unique_ptr<PinnedMemory> pinned(std::uint64_t bytes, std::uint64_t chunk_bytes = std::uint64_t{1} << 30) {
    PinnedOptions options;
    options.chunk_bytes = chunk_bytes;
    auto p = device_->allocate_pinned(bytes, options);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? std::move(p).value() : nullptr;
  }
  GateFlag gate() {
    auto g = GateFlag::create(device_->ordinal());
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    return g.ok() ? std::move(g).value() : GateFlag();
  }

  std::unique_ptr<Device> device_;
};

// ---- runs everywhere (no GPU needed) ---------------------------------------

TEST(CudaAvailability, CountDoesNotCrashAndNoDeviceIsUnavailable) {
  EXPECT_TRUE(cuda_compiled());
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  if (count == 0) {
    auto device = create_cuda_device(0);
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), StatusCode::kUnavailable) << device.status().to_string();
  }
}

Status failing_call() {
  KVTIER_CUDA_TRY(cudaErrorIllegalAddress);
  return Status::Ok();
}

TEST(CudaCheck, MapsErrorCodesAndNamesTheCall) {
  EXPECT_TRUE(cuda_detail::cuda_status(cudaSuccess, "x").ok());
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorIllegalAddress, "k").code(), StatusCode::kDeviceLost);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorLaunchFailure, "k").code(), StatusCode::kDeviceLost);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorECCUncorrectable, "k").code(), StatusCode::kDeviceLost);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorAssert, "k").code(), StatusCode::kDeviceLost);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorMemoryAllocation, "m").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorInvalidValue, "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_detail::cuda_status(cudaErrorNoDevice, "n").code(), StatusCode::kUnavailable);
  EXPECT_TRUE(cuda_detail::is_sticky_error(cudaErrorMisalignedAddress));
  EXPECT_FALSE(cuda_detail::is_sticky_error(cudaErrorMemoryAllocation));

  const Status s = failing_call();
  EXPECT_EQ(s.code(), StatusCode::kDeviceLost);
  EXPECT_NE(s.message().find("cudaErrorIllegalAddress"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("cuda_device_test.cc:"), std::string::npos) << s.message();
}

// ---- need a GPU ---------------------------------------------------------------

TEST_F(CudaDeviceTest, ReportsIdentity) {
  EXPECT_EQ(device_->backend(), BackendKind::kCuda);
  EXPECT_EQ(device_->ordinal(), 0);
  EXPECT_FALSE(device_->name().empty());
  EXPECT_GT(device_->multiprocessor_count(), 0);
}

TEST_F(CudaDeviceTest, InvalidOrdinalIsInvalidArgumentNamingIt) {
  const int count = cuda_device_count();
  auto too_big = create_cuda_device(count);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_big.status().message().find(std::to_string(count)), std::string::npos) << too_big.status().to_string();
  auto negative = create_cuda_device(-1);
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, DeviceGuardRestoresCallersDevice) {
  const int other = cuda_device_count() - 1;  // == 0 with one GPU: still checks "unchanged"
  ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
  {
    DeviceGuard guard(0);
    ASSERT_TRUE(guard.status().ok()) << guard.status().to_string();
    EXPECT_EQ(current_device(), 0);
  }
  EXPECT_EQ(current_device(), other);

  DeviceGuard bad(cuda_device_count() + 3);
  EXPECT_FALSE(bad.status().ok());
  EXPECT_EQ(current_device(), other);

  // Every Device method leaves the caller's device alone.
  auto s = stream();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(current_device(), other);
  auto e = event();
  ASSERT_NE(e, nullptr);
  Buffer d = device_buffer(4096);
  EXPECT_EQ(current_device(), other);
  auto host = pinned(4096);
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(current_device(), other);
  ASSERT_TRUE(device_->memset_async(d.data(), 1, 4096, *s).ok());
  ASSERT_TRUE(device_->memcpy_async(host->data(), d.data(), 4096, *s).ok());
  ASSERT_TRUE(device_->record(*e, *s).ok());
  ASSERT_TRUE(device_->wait(*s, *e).ok());
  EXPECT_EQ(current_device(), other);
  ASSERT_TRUE(device_->synchronize(*e, 10s).ok());
  ASSERT_TRUE(device_->synchronize(*s, 10s).ok());
  auto done = device_->query(*e);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  ASSERT_TRUE(device_->memcpy_sync(d.data(), host->data(), 4096).ok());
  EXPECT_EQ(current_device(), other);
  d.reset();
  host.reset();
  s.reset();
  e.reset();
  EXPECT_EQ(current_device(), other);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST_F(CudaDeviceTest, StreamsAreNonBlockingWithPriority) {
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  auto normal = stream(StreamPriority::kNormal);
  auto high = stream(StreamPriority::kHigh);
  ASSERT_NE(normal, nullptr);
  ASSERT_NE(high, nullptr);
  EXPECT_NE(normal->id(), high->id());
  EXPECT_EQ(&normal->device(), device_.get());
  for (Stream* s : {normal.get(), high.get()}) {
    unsigned flags = 0;
    ASSERT_EQ(cudaStreamGetFlags(native(*s), &flags), cudaSuccess);
    EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);
    EXPECT_NE(native(*s), nullptr);
  }
  int p_normal = 0, p_high = 0;
  ASSERT_EQ(cudaStreamGetPriority(native(*normal), &p_normal), cudaSuccess);
  ASSERT_EQ(cudaStreamGetPriority(native(*high), &p_high), cudaSuccess);
  EXPECT_EQ(p_normal, least);
  EXPECT_EQ(p_high, greatest);
}

TEST_F(CudaDeviceTest, MemcpyAllDirectionsByteExact) {
  const std::uint64_t n = 3 * kMiB + 123;  // odd size
  const auto data = random_bytes(n, 42);
  auto src = pinned(n);
  auto dst = pinned(n);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  std::memcpy(src->data(), data.data(), n);
  std::memset(dst->data(), static_cast<int>(kHostPoison), n);
  Buffer a = device_buffer(n);
  Buffer b = device_buffer(n);
  auto s = stream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(device_->memset_async(a.data(), static_cast<int>(kDevicePoison), n, *s).ok());
  ASSERT_TRUE(device_->memset_async(b.data(), static_cast<int>(kDevicePoison), n, *s).ok());
  ASSERT_TRUE(device_->memcpy_async(a.data(), src->data(), n, *s).ok());  // H2D
  ASSERT_TRUE(device_->memcpy_async(b.data(), a.data(), n, *s).ok());     // D2D
  ASSERT_TRUE(device_->memcpy_async(dst->data(), b.data(), n, *s).ok());  // D2H
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  EXPECT_EQ(first_mismatch(dst->data(), data.data(), n), -1);

  // Misaligned sub-range: bytes outside it keep the poison.
  const std::uint64_t off_src = 7, off_dst = 3, len = n - 13;
  std::memset(dst->data(), static_cast<int>(kHostPoison), n);
  ASSERT_TRUE(device_->memset_async(b.data(), static_cast<int>(kDevicePoison), n, *s).ok());
  ASSERT_TRUE(device_->memcpy_async(b.bytes_ptr() + off_dst, src->data() + off_src, len, *s).ok());
  ASSERT_TRUE(device_->memcpy_async(dst->data(), b.data(), n, *s).ok());
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  EXPECT_TRUE(all_equal(dst->data(), off_dst, kDevicePoison));
  EXPECT_EQ(first_mismatch(dst->data() + off_dst, data.data() + off_src, len), -1);
  EXPECT_TRUE(all_equal(dst->data() + off_dst + len, n - off_dst - len, kDevicePoison));

  // memcpy_sync, pageable host memory too.
  std::vector<std::byte> back(n, kHostPoison);
  ASSERT_TRUE(device_->memcpy_sync(a.data(), data.data(), n).ok());
  ASSERT_TRUE(device_->memcpy_sync(back.data(), a.data(), n).ok());
  EXPECT_EQ(first_mismatch(back.data(), data.data(), n), -1);

  // Zero bytes is a no-op; null pointers are rejected.
  EXPECT_TRUE(device_->memcpy_async(nullptr, nullptr, 0, *s).ok());
  EXPECT_EQ(device_->memcpy_async(nullptr, src->data(), 16, *s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->memcpy_sync(a.data(), nullptr, 16).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, MemsetPinnedHostMemory) {
  const std::uint64_t n = kMiB + 5;
  auto host = pinned(n);
  ASSERT_NE(host, nullptr);
  std::memset(host->data(), static_cast<int>(kHostPoison), n);
  auto s = stream();
  ASSERT_TRUE(device_->memset_async(host->data() + 1, 0x3C, n - 2, *s).ok());
  ASSERT_TRUE(device_->synchronize(*s, 10s).ok());
  EXPECT_EQ(host->data()[0], kHostPoison);
  EXPECT_TRUE(all_equal(host->data() + 1, n - 2, std::byte{0x3C}));
  EXPECT_EQ(host->data()[n - 1], kHostPoison);
}

TEST_F(CudaDeviceTest, OversizedAllocationIsResourceExhaustedAndNotSticky) {
  auto huge = device_->allocate_device(std::uint64_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status().to_string();
  EXPECT_NE(huge.status().message().find(std::to_string(std::uint64_t{1} << 50)), std::string::npos);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);  // cleared
  Buffer ok = device_buffer(kMiB);                // still usable
  EXPECT_FALSE(ok.empty());
  EXPECT_EQ(device_->allocate_device(0).status().code(), StatusCode::kInvalidArgument);
}

// Host pointer of each chunk == its device pointer, registered as pinned host
// memory, and every chunk works with memcpy_async.
TEST_F(CudaDeviceTest, PinnedChunkedAllocation) {
  const std::uint64_t n = 5 * kMiB + kMiB / 2;
  auto host = pinned(n, kMiB);
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(host->size(), n);
  EXPECT_FALSE(host->borrowed());
  EXPECT_TRUE(host->ready());
  EXPECT_TRUE(host->wait_ready(1s).ok());
  for (std::uint64_t off = 0; off < n; off += kMiB / 2) {
    std::byte* p = host->data() + off;
    void* dptr = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&dptr, p, 0), cudaSuccess) << "offset " << off;
    EXPECT_EQ(dptr, static_cast<void*>(p)) << "offset " << off;
    cudaPointerAttributes attrs{};
    ASSERT_EQ(cudaPointerGetAttributes(&attrs, p), cudaSuccess) << "offset " << off;
    EXPECT_EQ(attrs.type, cudaMemoryTypeHost) << "offset " << off;
  }
  const auto data = random_bytes(n, 7);
  std::memcpy(host->data(), data.data(), n);
  Buffer d = device_buffer(n);
  auto s = stream();
  ASSERT_TRUE(device_->memset_async(d.data(), static_cast<int>(kDevicePoison), n, *s).ok());
  // One copy per chunk each way (copies inside one registration).
  for (std::uint64_t off = 0; off < n; off += kMiB) {
    const std::uint64_t len = std::min(kMiB, n - off);
    ASSERT_TRUE(device_->memcpy_async(d.bytes_ptr() + off, host->data() + off, len, *s).ok());
  }
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  std::memset(host->data(), static_cast<int>(kHostPoison), n);
  for (std::uint64_t off = 0; off < n; off += kMiB) {
    const std::uint64_t len = std::min(kMiB, n - off);
    ASSERT_TRUE(device_->memcpy_async(host->data() + off, d.bytes_ptr() + off, len, *s).ok());
  }
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  EXPECT_EQ(first_mismatch(host->data(), data.data(), n), -1);
}

// A single copy spanning several registered chunks (the transfer layer may
// issue such copies when chunk and page boundaries disagree).
TEST_F(CudaDeviceTest, PinnedCopySpanningChunks) {
  const std::uint64_t n = 5 * kMiB + kMiB / 2;
  auto host = pinned(n, kMiB);
  ASSERT_NE(host, nullptr);
  const auto data = random_bytes(n, 8);
  std::memcpy(host->data(), data.data(), n);
  Buffer d = device_buffer(n);
  auto s = stream();
  ASSERT_TRUE(device_->memset_async(d.data(), static_cast<int>(kDevicePoison), n, *s).ok());
  const Status h2d = device_->memcpy_async(d.data(), host->data(), n, *s);
  ASSERT_TRUE(h2d.ok()) << h2d.to_string();
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  std::memset(host->data(), static_cast<int>(kHostPoison), n);
  const Status d2h = device_->memcpy_async(host->data(), d.data(), n, *s);
  ASSERT_TRUE(d2h.ok()) << d2h.to_string();
  ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
  EXPECT_EQ(first_mismatch(host->data(), data.data(), n), -1);
}

TEST_F(CudaDeviceTest, RegisterHostBorrowedMemory) {
  const std::uint64_t n = 2 * kMiB + 4096 * 3;
  void* raw = std::aligned_alloc(4096, n);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<void, decltype(&std::free)> owner(raw, &std::free);
  auto* bytes = static_cast<std::byte*>(raw);
  const auto data = random_bytes(n, 9);
  std::memcpy(bytes, data.data(), n);
  {
    PinnedOptions options;
    options.chunk_bytes = kMiB;
    auto reg = device_->register_host(raw, n, options);
    ASSERT_TRUE(reg.ok()) << reg.status().to_string();
    EXPECT_TRUE((*reg)->borrowed());
    EXPECT_EQ((*reg)->data(), bytes);
    void* dptr = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&dptr, bytes + kMiB + 100, 0), cudaSuccess);
    EXPECT_EQ(dptr, static_cast<void*>(bytes + kMiB + 100));
    Buffer d = device_buffer(n);
    auto s = stream();
    ASSERT_TRUE(device_->memcpy_async(d.data(), bytes, n, *s).ok());
    ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
    std::memset(bytes, static_cast<int>(kHostPoison), n);
    ASSERT_TRUE(device_->memcpy_async(bytes, d.data(), n, *s).ok());
    ASSERT_TRUE(device_->synchronize(*s, 30s).ok());
    EXPECT_EQ(first_mismatch(bytes, data.data(), n), -1);
  }
  // Unregistered on destruction: registering again succeeds.
  auto again = device_->register_host(raw, n, {});
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

// The same host range registered twice, by two CudaDevices (two managers over one host cache): the second found it
// "already pinned" and borrowed it, so the first registration's end unpinned it under the second (kernels reading
// it through UVA then fault) and the second knew no chunk ends (a copy across one failed with
// cudaErrorInvalidValue). The second shares the first's chunks now; the range stays pinned until both are gone.
TEST_F(CudaDeviceTest, ARangeRegisteredTwiceStaysPinnedUntilBothRegistrationsGo) {
  const std::uint64_t n = 4 * 64 * 1024;
  void* raw = std::aligned_alloc(4096, n);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<void, decltype(&std::free)> owner(raw, &std::free);
  auto* bytes = static_cast<std::byte*>(raw);
  auto other = create_cuda_device(0);
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  PinnedOptions options;
  options.chunk_bytes = 64 * 1024;
  auto first = device_->register_host(raw, n, options);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto second = (*other)->register_host(raw, n, options);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  const auto reg = (*other)->registration_of(bytes + 100);
  EXPECT_NE(reg.last, 0u) << "the second registration knows no chunk of the range";
  first->reset();  // the first registration goes
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, bytes + 70000), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "the range was unpinned under the second registration";
  // A copy that crosses a chunk end, on the second device: cut there, byte-exact.
  const auto data = random_bytes(8192, 21);
  Buffer d = device_buffer(8192);
  auto s = (*other)->create_stream();
  ASSERT_TRUE(s.ok());
  std::memcpy(bytes + 60 * 1024, data.data(), 8192);
  ASSERT_TRUE((*other)->memcpy_async(d.data(), bytes + 60 * 1024, 8192, **s).ok());
  ASSERT_TRUE((*other)->synchronize(**s, 30s).ok());  // the source is poisoned next
  std::memset(bytes + 60 * 1024, static_cast<int>(kHostPoison), 8192);
  const Status back = (*other)->memcpy_async(bytes + 60 * 1024, d.data(), 8192, **s);
  ASSERT_TRUE(back.ok()) << back.to_string();
  ASSERT_TRUE((*other)->synchronize(**s, 30s).ok());
  EXPECT_EQ(first_mismatch(bytes + 60 * 1024, data.data(), 8192), -1);
  s->reset();
  second->reset();  // the last one: unpinned now
  ASSERT_EQ(cudaPointerGetAttributes(&attr, bytes + 70000), cudaSuccess);
  EXPECT_NE(attr.type, cudaMemoryTypeHost);
}

TEST_F(CudaDeviceTest, EventOrdersWorkAcrossStreams) {
  const std::uint64_t n = kMiB;
  const auto data = random_bytes(n, 11);
  auto src = pinned(n);
  auto dst = pinned(n);
  std::memcpy(src->data(), data.data(), n);
  std::memset(dst->data(), static_cast<int>(kHostPoison), n);
  Buffer d = device_buffer(n);
  auto a = stream();
  auto b = stream();
  auto e = event();
  GateFlag g = gate();
  ASSERT_TRUE(g.valid());

  ASSERT_TRUE(g.close(native(*a)).ok());  // A is held
  ASSERT_TRUE(device_->memcpy_async(d.data(), src->data(), n, *a).ok());
  ASSERT_TRUE(device_->record(*e, *a).ok());
  ASSERT_TRUE(device_->wait(*b, *e).ok());
  ASSERT_TRUE(device_->memcpy_async(dst->data(), d.data(), n, *b).ok());

  std::this_thread::sleep_for(50ms);
  auto pending = device_->query(*e);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending);
  EXPECT_EQ(device_->synchronize(*b, 20ms).code(), StatusCode::kTimedOut);
  EXPECT_TRUE(all_equal(dst->data(), n, kHostPoison));  // B waited for A

  g.open();
  ASSERT_TRUE(device_->synchronize(*b, 10s).ok());
  auto done = device_->query(*e);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_EQ(first_mismatch(dst->data(), data.data(), n), -1);
  EXPECT_FALSE(g.expired());
}

TEST_F(CudaDeviceTest, QueryPendingThenDoneAndNeverRecorded) {
  auto s = stream();
  auto e = event();
  auto never = event();
  auto q0 = device_->query(*never);
  ASSERT_TRUE(q0.ok());
  EXPECT_TRUE(*q0);                             // never recorded: nothing to wait for
  ASSERT_TRUE(device_->wait(*s, *never).ok());  // no-op

  GateFlag g = gate();
  ASSERT_TRUE(g.close(native(*s)).ok());
  ASSERT_TRUE(device_->record(*e, *s).ok());
  auto q1 = device_->query(*e);
  ASSERT_TRUE(q1.ok());
  EXPECT_FALSE(*q1);
  g.open();
  ASSERT_TRUE(device_->synchronize(*e, 10s).ok());
  auto q2 = device_->query(*e);
  ASSERT_TRUE(q2.ok());
  EXPECT_TRUE(*q2);

  // The gate is reusable without re-arming.
  ASSERT_TRUE(g.close(native(*s)).ok());
  ASSERT_TRUE(device_->record(*e, *s).ok());
  std::this_thread::sleep_for(10ms);
  auto q3 = device_->query(*e);
  ASSERT_TRUE(q3.ok());
  EXPECT_FALSE(*q3);
  g.open();
  EXPECT_TRUE(device_->synchronize(*e, 10s).ok());
}

TEST_F(CudaDeviceTest, SynchronizeTimesOutWhileGated) {
  auto s = stream();
  auto e = event();
  GateFlag g = gate();
  ASSERT_TRUE(g.close(native(*s)).ok());
  ASSERT_TRUE(device_->record(*e, *s).ok());

  const auto t0 = std::chrono::steady_clock::now();
  const Status ss = device_->synchronize(*s, 30ms);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(ss.code(), StatusCode::kTimedOut) << ss.to_string();
  EXPECT_GE(waited, 30ms);
  EXPECT_LT(waited, 1500ms);
  EXPECT_EQ(device_->synchronize(*e, 10ms).code(), StatusCode::kTimedOut);
  EXPECT_EQ(device_->synchronize(*e, 0ns).code(), StatusCode::kTimedOut);

  g.open();
  EXPECT_TRUE(device_->synchronize(*s, 10s).ok());
  EXPECT_TRUE(device_->synchronize(*e, std::chrono::nanoseconds::max()).ok());
  EXPECT_FALSE(g.expired());
}

TEST_F(CudaDeviceTest, GateStreamAndOpenGateFreeFunctions) {
  auto s = stream();
  auto e = event();
  void* raw = nullptr;
  ASSERT_EQ(cudaHostAlloc(&raw, 64, cudaHostAllocMapped | cudaHostAllocPortable), cudaSuccess);
  auto* flag = static_cast<volatile std::uint32_t*>(raw);
  *flag = 0;
  ASSERT_TRUE(cuda_detail::gate_stream(native(*s), flag).ok());
  ASSERT_TRUE(device_->record(*e, *s).ok());
  std::this_thread::sleep_for(20ms);
  auto q = device_->query(*e);
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(*q);
  cuda_detail::open_gate(flag);
  EXPECT_TRUE(device_->synchronize(*e, 10s).ok());
  EXPECT_EQ(cuda_detail::gate_stream(native(*s), nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_detail::gate_stream(nullptr, flag).code(), StatusCode::kInvalidArgument);  // legacy stream
  EXPECT_EQ(cudaFreeHost(raw), cudaSuccess);
}

TEST_F(CudaDeviceTest, GateExpiresWhenNeverOpened) {
  auto s = stream();
  GateFlag g = gate();
  ASSERT_TRUE(g.close(native(*s), 50ms).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(device_->synchronize(*s, 10s).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 20ms);
  EXPECT_TRUE(g.expired());
}

TEST_F(CudaDeviceTest, HostCallbackRunsAfterPriorWork) {
  auto s = stream();
  GateFlag g = gate();
  ASSERT_TRUE(g.close(native(*s)).ok());
  std::atomic<int> calls{0};
  std::atomic<bool> ok{false};
  ASSERT_TRUE(device_
                  ->launch_host_callback(*s,
                                         [&](const Status& st) {
                                           ok = st.ok();
                                           calls.fetch_add(1);
                                         })
                  .ok());
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(calls.load(), 0);
  g.open();
  ASSERT_TRUE(device_->synchronize(*s, 10s).ok());
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (calls.load() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(ok.load());
  EXPECT_EQ(device_->launch_host_callback(*s, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, StreamDestructorDrainsPendingWork) {
  const std::uint64_t n = kMiB;
  const auto data = random_bytes(n, 13);
  auto src = pinned(n);
  auto dst = pinned(n);
  std::memcpy(src->data(), data.data(), n);
  std::memset(dst->data(), static_cast<int>(kHostPoison), n);
  Buffer d = device_buffer(n);
  GateFlag g = gate();
  {
    auto s = stream();
    ASSERT_TRUE(g.close(native(*s), 100ms).ok());  // expires: the destructor's sync ends
    ASSERT_TRUE(device_->memcpy_async(d.data(), src->data(), n, *s).ok());
    ASSERT_TRUE(device_->memcpy_async(dst->data(), d.data(), n, *s).ok());
  }
  EXPECT_EQ(first_mismatch(dst->data(), data.data(), n), -1);
}

}  // namespace
}  // namespace kvtier
