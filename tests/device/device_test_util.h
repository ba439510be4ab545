// Helpers shared by the device tests.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "kvtier/core/status.h"

#define KVTIER_TEST_CONCAT_INNER_(a, b) a##b
#define KVTIER_TEST_CONCAT_(a, b) KVTIER_TEST_CONCAT_INNER_(a, b)

#define ASSERT_OK(expr)                                                       \
  do {                                                                        \
    const ::kvtier::Status kvtier_test_status_ = (expr);                      \
    ASSERT_TRUE(kvtier_test_status_.ok()) << kvtier_test_status_.to_string(); \
  } while (0)
#define EXPECT_OK(expr)                                                       \
  do {                                                                        \
    const ::kvtier::Status kvtier_test_status_ = (expr);                      \
    EXPECT_TRUE(kvtier_test_status_.ok()) << kvtier_test_status_.to_string(); \
  } while (0)
// `lhs = value of expr`, or a fatal test failure naming the status.
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(KVTIER_TEST_CONCAT_(kvtier_test_result_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)   \
  auto tmp = (expr);                                 \
  ASSERT_TRUE(tmp.ok()) << tmp.status().to_string(); \
  lhs = std::move(tmp).value()

namespace kvtier::testing {

inline void fill_random(void* dst, std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* out = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t word = rng();
    std::memcpy(out + i, &word, 8);
  }
  const std::uint64_t tail = rng();
  std::memcpy(out + i, &tail, bytes - i);
}

// Index of the first differing byte, or -1 when equal.
inline std::int64_t first_mismatch(const void* a, const void* b, std::size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < bytes; ++i) {
    if (x[i] != y[i]) return static_cast<std::int64_t>(i);
  }
  return -1;
}

// Index of the first byte != value, or -1.
inline std::int64_t first_not(const void* a, unsigned char value, std::size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  for (std::size_t i = 0; i < bytes; ++i) {
    if (x[i] != value) return static_cast<std::int64_t>(i);
  }
  return -1;
}

// Blocks a stream (through a host callback) until opened. Open on every path:
// GateGuard opens it on scope exit so that a failed assertion never leaves a
// stream blocked (which would hang the stream's destructor).
struct Gate {
  std::atomic<bool> open{false};
  std::atomic<bool> entered{false};
  void pass() {
    entered.store(true);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!open.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
};
struct GateGuard {
  std::shared_ptr<Gate> gate;
  ~GateGuard() { gate->open.store(true); }
};

}  // namespace kvtier::testing
