// ParallelLoop (core/parallel_loop.h): every index once, whatever the helpers and grain; runs back to back.
#include "core/parallel_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

namespace kvtier::detail {
namespace {

TEST(ParallelLoop, EveryIndexExactlyOnceOnAnyNumberOfHelpers) {
  for (unsigned helpers : {0u, 1u, 3u}) {
    ParallelLoop loop(helpers);
    EXPECT_EQ(loop.helpers(), helpers);
    for (std::size_t n : {0u, 1u, 7u, 1000u}) {
      for (std::size_t grain : {0u, 1u, 3u, 64u, 5000u}) {
        std::vector<std::atomic<int>> seen(n);
        loop.run(n, grain, [&](std::size_t begin, std::size_t end) {
          ASSERT_LT(begin, end);
          ASSERT_LE(end, n);
          for (std::size_t i = begin; i < end; ++i) seen[i].fetch_add(1);
        });
        for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i].load(), 1) << helpers << " " << n << " " << grain;
      }
    }
  }
}

TEST(ParallelLoop, ManyShortRunsBackToBackEachCoverEveryIndex) {
  ParallelLoop loop(3);
  std::atomic<std::uint64_t> sum{0};
  for (int run = 0; run < 2000; ++run)
    loop.run(64, 1, [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) sum.fetch_add(i);
    });
  EXPECT_EQ(sum.load(), 2000u * (63u * 64u / 2));
}

// Two threads running loops on one ParallelLoop at once (the decode's worker and, when it could not start, the
// protocol thread): they take turns, and each covers its own indices.
TEST(ParallelLoop, ConcurrentCallersTakeTurns) {
  ParallelLoop loop(2);
  std::atomic<std::uint64_t> a{0}, b{0};
  auto caller = [&loop](std::atomic<std::uint64_t>& sum) {
    for (int run = 0; run < 500; ++run)
      loop.run(100, 7, [&](std::size_t begin, std::size_t end) {
        for (std::size_t i = begin; i < end; ++i) sum.fetch_add(i);
      });
  };
  std::thread t1(caller, std::ref(a)), t2(caller, std::ref(b));
  t1.join();
  t2.join();
  EXPECT_EQ(a.load(), 500u * (99u * 100u / 2));
  EXPECT_EQ(b.load(), 500u * (99u * 100u / 2));
}

TEST(ParallelLoop, DefaultHelpersLeaveSmallMachinesAlone) {
  EXPECT_EQ(ParallelLoop::default_helpers(1), 0u);
  EXPECT_EQ(ParallelLoop::default_helpers(2), 0u);
  EXPECT_EQ(ParallelLoop::default_helpers(4), 1u);
  EXPECT_EQ(ParallelLoop::default_helpers(16), 4u);
  EXPECT_EQ(ParallelLoop::default_helpers(128), 4u);
}

}  // namespace
}  // namespace kvtier::detail
