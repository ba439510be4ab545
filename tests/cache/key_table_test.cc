// The cache manager's open-addressing key tables (cache/key_index.h) against std::unordered_map under random
// inserts, lookups and erases, with keys made to collide so that probe runs are long, wrap around the table's
// end and are closed up by backward-shift deletion. And LargeTable (cache/large_table.h), the vector these tables
// live in, across the size where it switches to huge-page allocations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "cache/key_index.h"
#include "cache/large_table.h"

namespace kvtier::cache {
namespace {

// Keys whose home slot lies in a few slots at the table's end (the home is key_table_hash's low bits): runs cross
// the end and wrap to slot 0. Drawn until the hash's low 12 bits name one of the last `hot_homes` slots of any table
// of up to 4,096 slots.
BlockKey colliding_key(std::mt19937_64& rng, std::uint64_t hot_homes) {
  for (;;) {
    const BlockKey k{rng(), rng()};
    if ((key_table_hash(k) & 0xFFF) >= 0x1000 - hot_homes) return k;
  }
}

// Keys an engine made itself, a counter in one half and the other half fixed: each sat on one probe run (the home
// was the low bits of lo ^ (hi >> 17)), so indexing 20,000 of them took 300 ms and a lookup walked thousands of slots.
TEST(KeyIndex, StructuredKeysSpreadOverTheTable) {
  for (const bool counter_in_hi : {true, false}) {
    KeyIndex index;
    std::vector<BlockKey> keys;
    for (std::uint64_t i = 0; i < 20000; ++i)
      keys.push_back(counter_in_hi ? BlockKey{i, 0} : BlockKey{0x5555, i << 20});
    for (std::size_t i = 0; i < keys.size(); ++i) index.insert(keys[i], static_cast<NodeId>(i));
    std::size_t longest = 0, total = 0;
    for (const BlockKey& k : keys) {
      const std::size_t p = index.probes(k);
      longest = std::max(longest, p);
      total += p;
    }
    EXPECT_LT(longest, 64u) << (counter_in_hi ? "counter in hi" : "counter in lo's high bits");
    EXPECT_LT(static_cast<double>(total) / keys.size(), 3.0);
    for (std::size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(index.find(keys[i]), static_cast<NodeId>(i));
  }
}

TEST(KeyIndex, AgreesWithAReferenceMapUnderCollidingInsertsAndErases) {
  std::mt19937_64 rng(7);
  KeyIndex index;
  std::unordered_map<BlockKey, NodeId, BlockKeyHash> ref;
  std::vector<BlockKey> keys;
  for (int i = 0; i < 600; ++i) keys.push_back(i % 3 ? colliding_key(rng, 4) : BlockKey{rng(), rng()});
  for (int op = 0; op < 200000; ++op) {
    const BlockKey& k = keys[rng() % keys.size()];
    const bool present = ref.count(k) > 0;
    switch (rng() % 3) {
      case 0:
        if (!present) {
          const NodeId id = static_cast<NodeId>(op);
          index.insert(k, id);
          ref[k] = id;
        }
        break;
      case 1:
        index.erase(k);
        ref.erase(k);
        break;
      default: break;
    }
    auto it = ref.find(k);
    ASSERT_EQ(index.find(k), it == ref.end() ? kNoNode : it->second) << "op " << op;
    ASSERT_EQ(index.size(), ref.size()) << "op " << op;
    if (op % 4096 == 0)
      for (const BlockKey& x : keys) {
        auto it = ref.find(x);
        ASSERT_EQ(index.find(x), it == ref.end() ? kNoNode : it->second) << "op " << op;
      }
  }
}

struct Counted {
  std::uint32_t count = 0;
  std::uint64_t tag = 0;
};
struct CountedSlot {
  static constexpr Counted free_value() { return Counted{}; }
  static constexpr bool is_free(const Counted& c) { return c.count == 0; }
};

// The look-ahead's use: find_or_claim then count up; count down and erase at zero.
TEST(OpenKeyTable, CountsUpAndDownLikeAReferenceMap) {
  std::mt19937_64 rng(11);
  OpenKeyTable<Counted, CountedSlot> table;
  std::unordered_map<BlockKey, Counted, BlockKeyHash> ref;
  std::vector<BlockKey> keys;
  for (int i = 0; i < 300; ++i) keys.push_back(i % 2 ? colliding_key(rng, 3) : BlockKey{rng(), rng()});
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(table.find(keys[0]), nullptr);
  table.erase(keys[0]);  // absent: nothing happens
  EXPECT_EQ(table.size(), 0u);
  for (int op = 0; op < 200000; ++op) {
    const BlockKey& k = keys[rng() % keys.size()];
    if (rng() % 2) {
      Counted& c = table.find_or_claim(k);
      if (c.count == 0) c.tag = static_cast<std::uint64_t>(op);
      ++c.count;
      Counted& r = ref[k];
      if (r.count == 0) r.tag = static_cast<std::uint64_t>(op);
      ++r.count;
    } else if (Counted* c = table.find(k)) {
      if (c->count == 1)
        table.erase(k);
      else
        --c->count;
      if (--ref[k].count == 0) ref.erase(k);
    } else {
      ASSERT_EQ(ref.count(k), 0u) << "op " << op;
    }
    ASSERT_EQ(table.size(), ref.size()) << "op " << op;
    const Counted* c = table.find(k);
    auto it = ref.find(k);
    ASSERT_EQ(c != nullptr, it != ref.end()) << "op " << op;
    if (c) {
      ASSERT_EQ(c->count, it->second.count) << "op " << op;
      ASSERT_EQ(c->tag, it->second.tag) << "op " << op;
    }
  }
  for (const BlockKey& k : keys) {
    auto it = ref.find(k);
    const Counted* c = table.find(k);
    ASSERT_EQ(c != nullptr, it != ref.end());
    if (c) {
      EXPECT_EQ(c->count, it->second.count);
    }
  }
}

// Growth past one huge page moves the elements from a standard allocation to an aligned one (and copies and
// shrinks move them back): every element must survive each move, and each allocation must be freed by the
// path that made it (AddressSanitizer reports a mismatch in CI).
TEST(LargeTable, KeepsItsElementsAcrossTheHugePageThreshold) {
  constexpr std::size_t kHugeElements = LargeTableAllocator<std::uint64_t>::kHugePage / sizeof(std::uint64_t);
  LargeTable<std::uint64_t> table;
  for (std::uint64_t i = 0; i < 3 * kHugeElements; ++i) table.push_back(i * 0x9E3779B97F4A7C15ull);
  for (std::uint64_t i = 0; i < table.size(); ++i) ASSERT_EQ(table[i], i * 0x9E3779B97F4A7C15ull) << i;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(table.data()) % LargeTableAllocator<std::uint64_t>::kHugePage, 0u);
#endif
  LargeTable<std::uint64_t> copy = table;
  EXPECT_EQ(copy, table);
  table.resize(16);
  table.shrink_to_fit();
  for (std::uint64_t i = 0; i < table.size(); ++i) ASSERT_EQ(table[i], copy[i]);
  LargeTable<std::uint64_t> assigned(kHugeElements + 1, 7);
  EXPECT_EQ(assigned.front(), 7u);
  EXPECT_EQ(assigned.back(), 7u);
}

}  // namespace
}  // namespace kvtier::cache
