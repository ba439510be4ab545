// The shared pinned-memory machinery (device/pinned.h) with a recording
// registrar: chunk boundaries, unregistration, error handling, background
// registration and cancellation.
#include "device/pinned.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <numa.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/device/device_test_util.h"

namespace kvtier::detail {
namespace {

using namespace std::chrono_literals;
using Chunk = std::pair<void*, std::uint64_t>;

const std::uint64_t kPage = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));

// Records calls; fails registration of chunk `fail_at` (0-based) when >= 0;
// blocks each registration until `open` when gated.
struct Recorder {
  std::mutex mu;
  std::vector<Chunk> registered;
  std::vector<Chunk> unregistered;
  int fail_at = -1;
  std::shared_ptr<testing::Gate> gate;
  std::chrono::microseconds per_chunk_sleep{0};

  ChunkRegistrar registrar() {
    return ChunkRegistrar{[this](void* ptr, std::uint64_t bytes) -> Status {
                            if (gate) gate->pass();
                            if (per_chunk_sleep.count() > 0) std::this_thread::sleep_for(per_chunk_sleep);
                            std::lock_guard lock(mu);
                            if (static_cast<int>(registered.size()) == fail_at) {
                              return Unavailable(fmt::format("fake register({}, {}) refused", ptr, bytes));
                            }
                            registered.emplace_back(ptr, bytes);
                            return Status::Ok();
                          },
                          [this](void* ptr, std::uint64_t bytes) {
                            std::lock_guard lock(mu);
                            unregistered.emplace_back(ptr, bytes);
                          }};
  }
  std::vector<Chunk> registered_copy() {
    std::lock_guard lock(mu);
    return registered;
  }
  std::vector<Chunk> unregistered_copy() {
    std::lock_guard lock(mu);
    return unregistered;
  }
};

// Chunks tile [data, data + bytes) in order, each <= chunk, boundaries page-aligned.
void expect_tiling(const std::vector<Chunk>& chunks, const std::byte* data, std::uint64_t bytes, std::uint64_t chunk) {
  ASSERT_FALSE(chunks.empty());
  const std::byte* cursor = data;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].first, cursor) << "chunk " << i;
    EXPECT_GT(chunks[i].second, 0u);
    EXPECT_LE(chunks[i].second, chunk) << "chunk " << i;
    cursor += chunks[i].second;
    if (i + 1 < chunks.size()) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(cursor) % kPage, 0u) << "boundary after chunk " << i;
    }
  }
  EXPECT_EQ(cursor, data + bytes);
}

TEST(PinnedMemory, AllocateRegistersChunksAndUnregistersInReverse) {
  Recorder recorder;
  const std::uint64_t bytes = (11 << 20) / 2;
  PinnedOptions options;
  options.chunk_bytes = 1 << 20;
  std::byte* data = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(bytes, options, recorder.registrar()));
    data = mem->data();
    EXPECT_TRUE(mem->ready());
    const auto chunks = recorder.registered_copy();
    EXPECT_EQ(chunks.size(), 6u);
    expect_tiling(chunks, data, bytes, options.chunk_bytes);
    EXPECT_TRUE(recorder.unregistered_copy().empty());
    // Every page is mapped and writable.
    std::memset(mem->data(), 0x42, bytes);
  }
  auto unregistered = recorder.unregistered_copy();
  std::vector<Chunk> expected = recorder.registered_copy();
  std::reverse(expected.begin(), expected.end());
  EXPECT_EQ(unregistered, expected);
}

TEST(PinnedMemory, ChunkBytesRoundedToPages) {
  Recorder recorder;
  PinnedOptions options;
  options.chunk_bytes = 1000;  // < one page: one page per chunk
  ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(3 * kPage + 5, options, recorder.registrar()));
  const auto chunks = recorder.registered_copy();
  ASSERT_EQ(chunks.size(), 4u);
  expect_tiling(chunks, mem->data(), mem->size(), kPage);
  EXPECT_EQ(chunks.back().second, 5u);
}

TEST(PinnedMemory, BorrowedUnalignedChunksStayOnPageBoundaries) {
  Recorder recorder;
  const std::uint64_t total = 8 * kPage;
  void* raw = std::aligned_alloc(kPage, total);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<void, decltype(&std::free)> owner(raw, &std::free);
  auto* data = static_cast<std::byte*>(raw) + 100;
  const std::uint64_t bytes = total - 300;
  PinnedOptions options;
  options.chunk_bytes = 2 * kPage;
  {
    ASSERT_OK_AND_ASSIGN(auto mem, register_host_memory(data, bytes, options, recorder.registrar()));
    EXPECT_TRUE(mem->borrowed());
    const auto chunks = recorder.registered_copy();
    expect_tiling(chunks, data, bytes, options.chunk_bytes);
    EXPECT_EQ(chunks.front().second, 2 * kPage - 100);  // up to the first chunk boundary
    EXPECT_EQ(chunks.size(), 4u);
  }
  EXPECT_EQ(recorder.unregistered_copy().size(), 4u);
  // Borrowed memory is not unmapped.
  std::memset(data, 1, bytes);
}

TEST(PinnedMemory, RegistrationErrorUndoesAndNamesChunk) {
  Recorder recorder;
  recorder.fail_at = 2;
  PinnedOptions options;
  options.chunk_bytes = 1 << 20;
  auto result = allocate_pinned_memory(4 << 20, options, recorder.registrar());
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(result.status().message().find("chunk 2"), std::string::npos) << result.status().to_string();
  EXPECT_NE(result.status().message().find("fake register"), std::string::npos) << result.status().to_string();
  auto unregistered = recorder.unregistered_copy();
  ASSERT_EQ(unregistered.size(), 2u);
  EXPECT_EQ(unregistered[0], recorder.registered_copy()[1]);
  EXPECT_EQ(unregistered[1], recorder.registered_copy()[0]);
}

TEST(PinnedMemory, BackgroundErrorReportedByWaitReady) {
  Recorder recorder;
  recorder.fail_at = 1;
  PinnedOptions options;
  options.chunk_bytes = 1 << 20;
  options.background = true;
  ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(3 << 20, options, recorder.registrar()));
  const Status status = mem->wait_ready(30s);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_FALSE(mem->ready());
  EXPECT_EQ(mem->bytes_ready(), std::uint64_t{1} << 20);
  // The error stays.
  EXPECT_EQ(mem->wait_ready(0ms), status);
}

TEST(PinnedMemory, BackgroundProgressAndTimeout) {
  Recorder recorder;
  recorder.gate = std::make_shared<testing::Gate>();
  testing::GateGuard guard{recorder.gate};
  PinnedOptions options;
  options.chunk_bytes = 1 << 20;
  options.background = true;
  ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(4 << 20, options, recorder.registrar()));
  const Status status = mem->wait_ready(10ms);
  EXPECT_EQ(status.code(), StatusCode::kTimedOut) << status.to_string();
  EXPECT_EQ(mem->bytes_ready(), 0u);
  EXPECT_FALSE(mem->ready());
  recorder.gate->open.store(true);
  EXPECT_OK(mem->wait_ready(30s));
  EXPECT_TRUE(mem->ready());
  EXPECT_EQ(recorder.registered_copy().size(), 4u);
}

TEST(PinnedMemory, DestroyDuringBackgroundRegistrationCancels) {
  Recorder recorder;
  recorder.per_chunk_sleep = 2ms;
  PinnedOptions options;
  options.chunk_bytes = kPage;
  options.background = true;
  {
    ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(4096 * kPage, options, recorder.registrar()));
    std::this_thread::sleep_for(10ms);
  }
  // Stopped early (4096 chunks would take > 8 s) and undid what it did.
  const auto registered = recorder.registered_copy();
  EXPECT_LT(registered.size(), 4096u);
  EXPECT_EQ(recorder.unregistered_copy().size(), registered.size());
}

TEST(PinnedMemory, TouchThreadCounts) {
  for (unsigned threads : {1u, 3u, 64u, 100000u}) {
    SCOPED_TRACE(threads);
    PinnedOptions options;
    options.touch_threads = threads;
    options.chunk_bytes = 1 << 20;
    ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory((5 << 20) + 17, options, ChunkRegistrar{}));
    EXPECT_TRUE(mem->ready());
    EXPECT_EQ(testing::first_not(mem->data(), 0, mem->size()), -1);
  }
}

TEST(PinnedMemory, NumaBinding) {
  if (numa_available() < 0) GTEST_SKIP() << "no NUMA support";
  PinnedOptions options;
  options.numa_node = 0;
  options.chunk_bytes = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto mem, allocate_pinned_memory(2 << 20, options, ChunkRegistrar{}));
  EXPECT_TRUE(mem->ready());
  options.numa_node = numa_max_node() + 1;
  const Status status = allocate_pinned_memory(2 << 20, options, ChunkRegistrar{}).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(std::to_string(options.numa_node)), std::string::npos) << status.to_string();
  options.numa_node = -2;
  EXPECT_EQ(validate_pinned_options(options).code(), StatusCode::kInvalidArgument);
}

TEST(PinnedMemory, ValidatesOptions) {
  PinnedOptions options;
  EXPECT_OK(validate_pinned_options(options));
  options.chunk_bytes = kMaxPinnedChunkBytes;
  EXPECT_OK(validate_pinned_options(options));
  options.chunk_bytes = kMaxPinnedChunkBytes + 1;
  const Status status = validate_pinned_options(options);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("68719476737"), std::string::npos) << status.to_string();
  EXPECT_EQ(allocate_pinned_memory(0, {}, ChunkRegistrar{}).status().code(), StatusCode::kInvalidArgument);
  int x = 0;
  EXPECT_EQ(register_host_memory(&x, 0, {}, ChunkRegistrar{}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(register_host_memory(nullptr, 4, {}, ChunkRegistrar{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::detail
