// The eviction policies' recency lists (cache/node_lists.h) against a reference model under random pushes, moves,
// unlinks, blocks, unblocks, victim walks that park the blocked nodes they pass, and unpark_all() merges; with a
// small stamp limit, so that the clock is renumbered again and again in the middle of it all.
#include "cache/node_lists.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace kvtier::cache {
namespace {

struct Model {
  std::vector<std::vector<NodeId>> order;  // per list, every member, head (newest) first
  std::vector<int> list_of;
  std::vector<std::uint8_t> blocked;
  void remove(NodeId n) {
    auto& o = order[list_of[n]];
    o.erase(std::find(o.begin(), o.end(), n));
    list_of[n] = -1;
  }
};

// The chain from the tail is the model's order from the tail without the parked nodes; every parked node is
// blocked; sizes count parked nodes too.
void expect_same(const NodeLists& lists, const Model& m, int step) {
  for (std::size_t l = 0; l < m.order.size(); ++l) {
    std::vector<NodeId> chain;
    for (NodeId n = lists.tail(static_cast<int>(l)); n != kNoNode; n = lists.prev(n)) chain.push_back(n);
    std::vector<NodeId> want;
    for (auto it = m.order[l].rbegin(); it != m.order[l].rend(); ++it)
      if (!lists.parked(*it)) want.push_back(*it);
    ASSERT_EQ(chain, want) << "list " << l << " step " << step;
    ASSERT_EQ(lists.size(static_cast<int>(l)), m.order[l].size()) << "list " << l << " step " << step;
    for (std::size_t i = 1; i < chain.size(); ++i)
      ASSERT_LT(lists.stamp(chain[i - 1]), lists.stamp(chain[i])) << "step " << step;
  }
  for (NodeId n = 0; n < m.list_of.size(); ++n) {
    if (lists.parked(n)) ASSERT_TRUE(m.blocked[n]) << "node " << n << " step " << step;
    ASSERT_EQ(lists.list_of(n), m.list_of[n] < 0 ? NodeLists::kNone : m.list_of[n]) << "node " << n;
  }
}

TEST(NodeLists, ParkedNodesReturnToTheirPlaces) {
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    constexpr int kLists = 3;
    constexpr NodeId kNodes = 120;
    NodeLists lists(kLists, /*stamp_limit=*/seed % 2 ? 300 : UINT32_MAX);
    Model m{std::vector<std::vector<NodeId>>(kLists), std::vector<int>(kNodes, -1),
            std::vector<std::uint8_t>(kNodes, 0)};
    std::mt19937 rng(seed);
    std::size_t parked_seen = 0, merges = 0;
    for (int step = 0; step < 12000; ++step) {
      const NodeId n = rng() % kNodes;
      const int l = static_cast<int>(rng() % kLists);
      const int op = static_cast<int>(rng() % 12);
      if (op < 3) {
        if (m.list_of[n] < 0) {
          lists.push_head(l, n);
          m.order[l].insert(m.order[l].begin(), n);
          m.list_of[n] = l;
          m.blocked[n] = 0;
        } else {
          lists.move_head(l, n);
          m.remove(n);
          m.order[l].insert(m.order[l].begin(), n);
          m.list_of[n] = l;
        }
      } else if (op < 4) {
        if (m.list_of[n] >= 0) {
          lists.unlink(n);
          m.remove(n);
          m.blocked[n] = 0;
        }
      } else if (op < 8) {
        const bool b = rng() % 2;
        lists.set_blocked(n, b);  // no-op for a node in no list
        if (m.list_of[n] >= 0) m.blocked[n] = b;
      } else if (op < 11) {
        // A victim walk: the unblocked nodes from the tail, as the model orders them, up to a random stop.
        const std::size_t stop = rng() % 8;
        std::vector<NodeId> met, want;
        for (NodeId x = lists.skip_blocked(lists.tail(l)); x != kNoNode && met.size() < stop;
             x = lists.skip_blocked(lists.prev(x)))
          met.push_back(x);
        for (auto it = m.order[l].rbegin(); it != m.order[l].rend() && want.size() < stop; ++it)
          if (!m.blocked[*it]) want.push_back(*it);
        ASSERT_EQ(met, want) << "seed " << seed << " step " << step;
        parked_seen = std::max(parked_seen, lists.num_parked());
      } else {
        lists.unpark_all();
        ASSERT_EQ(lists.num_parked(), 0u);
        ++merges;
      }
      expect_same(lists, m, step);
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_GT(parked_seen, 5u) << "seed " << seed;
    EXPECT_GT(merges, 100u);
  }
}

// A walk passes a blocked node once: it parks it, and the next walk starts past it.
TEST(NodeLists, AWalkParksWhatItPasses) {
  NodeLists lists(1);
  for (NodeId n = 0; n < 1000; ++n) lists.push_head(0, n);
  for (NodeId n = 0; n < 990; ++n) lists.set_blocked(n, true);
  EXPECT_EQ(lists.skip_blocked(lists.tail(0)), 990u);
  EXPECT_EQ(lists.num_parked(), 990u);
  EXPECT_EQ(lists.tail(0), 990u);
  EXPECT_EQ(lists.size(0), 1000u);
  lists.set_blocked(500, false);  // back between 499 (parked) and 501 (parked): the chain's new tail
  EXPECT_EQ(lists.tail(0), 500u);
  EXPECT_EQ(lists.prev(500), 990u);
  lists.unpark_all();
  NodeId n = lists.tail(0);
  for (NodeId want = 0; want < 1000; ++want, n = lists.prev(n)) ASSERT_EQ(n, want);
}

}  // namespace
}  // namespace kvtier::cache
