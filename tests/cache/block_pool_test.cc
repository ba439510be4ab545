#include "kvtier/cache/block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <set>

namespace kvtier::cache {
namespace {

TEST(BlockPool, AllocatesEveryIdOnceThenExhausts) {
  BlockPool pool(16, "test");
  std::set<BlockId> seen;
  for (int i = 0; i < 16; ++i) {
    auto id = pool.allocate();
    ASSERT_TRUE(id.ok());
    EXPECT_LT(*id, 16u);
    EXPECT_TRUE(seen.insert(*id).second);
  }
  EXPECT_EQ(pool.num_free(), 0u);
  auto none = pool.allocate();
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
}

TEST(BlockPool, FreshPoolHandsOutAscendingIds) {
  BlockPool pool(8);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool.allocate(4, ids).ok());
  EXPECT_EQ(ids, (std::vector<BlockId>{0, 1, 2, 3}));
}

TEST(BlockPool, DoubleFreeAndUnknownIdFailWithoutSideEffects) {
  BlockPool pool(8);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool.allocate(3, ids).ok());
  ASSERT_TRUE(pool.free(ids[0]).ok());
  Status s = pool.free(ids[0]);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("double free"), std::string::npos) << s.to_string();
  EXPECT_EQ(pool.free(BlockId{8}).code(), StatusCode::kOutOfRange);
  // All-or-nothing: a bad id late in the list frees nothing.
  std::vector<BlockId> mixed{ids[1], 99};
  EXPECT_EQ(pool.free(mixed).code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(pool.is_free(ids[1]));
  // A duplicate inside one list is a double free; nothing freed.
  std::vector<BlockId> dup{ids[1], ids[2], ids[1]};
  EXPECT_EQ(pool.free(dup).code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(pool.is_free(ids[1]));
  EXPECT_FALSE(pool.is_free(ids[2]));
  EXPECT_EQ(pool.num_free(), 6u);
}

TEST(BlockPool, AllOrNothingBulkAllocate) {
  BlockPool pool(4);
  std::vector<BlockId> ids;
  EXPECT_EQ(pool.allocate(5, ids).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(ids.empty());
  EXPECT_EQ(pool.num_free(), 4u);
}

TEST(BlockPool, ContiguousRunsSkipHoles) {
  BlockPool pool(200);
  std::vector<BlockId> all;
  ASSERT_TRUE(pool.allocate(200, all).ok());
  // Free a scattered pattern plus one run [100, 170).
  for (BlockId id = 0; id < 60; id += 2) ASSERT_TRUE(pool.free(id).ok());
  for (BlockId id = 100; id < 170; ++id) ASSERT_TRUE(pool.free(id).ok());
  EXPECT_EQ(pool.longest_free_run(), 70u);
  auto run = pool.allocate_run(65);
  ASSERT_TRUE(run.ok()) << run.status().to_string();
  EXPECT_EQ(*run, 100u);
  for (BlockId id = 100; id < 165; ++id) EXPECT_FALSE(pool.is_free(id));
  EXPECT_EQ(pool.allocate_run(6).status().code(), StatusCode::kResourceExhausted);
  auto small = pool.allocate_run(5);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(*small, 165u);
  // The free list stays consistent after runs: every remaining free id comes out once.
  std::set<BlockId> rest;
  while (pool.num_free() > 0) rest.insert(*pool.allocate());
  EXPECT_EQ(rest.size(), 30u);
  for (BlockId id : rest) EXPECT_TRUE(id < 60 && id % 2 == 0);
}

TEST(BlockPool, RandomOpsMatchAModel) {
  BlockPool pool(300);
  std::set<BlockId> used;
  std::mt19937 rng(7);
  for (int step = 0; step < 20000; ++step) {
    int op = rng() % 3;
    if (op == 0) {
      auto id = pool.allocate();
      if (used.size() == 300) {
        EXPECT_FALSE(id.ok());
      } else {
        ASSERT_TRUE(id.ok());
        EXPECT_TRUE(used.insert(*id).second);
      }
    } else if (op == 1 && !used.empty()) {
      auto it = used.begin();
      std::advance(it, rng() % used.size());
      ASSERT_TRUE(pool.free(*it).ok());
      used.erase(it);
    } else {
      std::uint32_t n = 1 + rng() % 8;
      auto run = pool.allocate_run(n);
      if (run.ok()) {
        for (std::uint32_t i = 0; i < n; ++i) EXPECT_TRUE(used.insert(*run + i).second);
      }
    }
    ASSERT_EQ(pool.num_used(), used.size());
  }
}

TEST(BlockPool, SingleAllocateFreeIsConstantTime) {
  // O(1): the cost per op does not grow with the pool size (loose bound: 8x).
  auto time_ops = [](std::uint32_t n) {
    BlockPool pool(n);
    std::vector<BlockId> ids;
    EXPECT_TRUE(pool.allocate(n / 2, ids).ok());
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200000; ++i) {
      BlockId id = *pool.allocate();
      if (!pool.free(id).ok()) ADD_FAILURE() << "free of block " << id;
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double small = time_ops(1 << 10), large = time_ops(1 << 22);
  EXPECT_LT(large, 8 * small + 0.05) << "small " << small << " s, large " << large << " s";
}

}  // namespace
}  // namespace kvtier::cache
