// GhostFifo (cache/ghost_fifo.h), the ghost entries of the S3-FIFO and ARC policies: a FIFO set of the `cap`
// fingerprints added last, against a reference model under random adds, re-adds and removals, with one list and
// with two; and its memory, which must stay bounded when entries are removed before the FIFO fills.
#include "cache/ghost_fifo.h"

#include <gtest/gtest.h>

#include <list>
#include <random>
#include <unordered_map>

namespace kvtier::cache {
namespace {

// The specification: an ordered list, oldest first; a re-add moves a fingerprint to the newest end.
class ReferenceGhost {
 public:
  explicit ReferenceGhost(std::size_t cap) : cap_(cap) {}
  void add(std::uint64_t h) {
    remove(h);
    order_.push_back(h);
    at_[h] = std::prev(order_.end());
    while (order_.size() > cap_) {
      at_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool remove(std::uint64_t h) {
    auto it = at_.find(h);
    if (it == at_.end()) return false;
    order_.erase(it->second);
    at_.erase(it);
    return true;
  }
  bool contains(std::uint64_t h) const { return at_.count(h) > 0; }
  std::size_t size() const { return order_.size(); }

 private:
  std::size_t cap_;
  std::list<std::uint64_t> order_;
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> at_;
};

TEST(GhostFifo, MatchesTheReferenceUnderRandomAddsReaddsAndRemovals) {
  for (std::size_t cap : {1u, 7u, 64u, 300u}) {
    SCOPED_TRACE(cap);
    std::mt19937_64 rng(cap);
    GhostFifo ghost(cap);
    ReferenceGhost ref(cap);
    const std::uint64_t universe = 3 * cap + 5;  // small enough for re-adds and hits
    for (int op = 0; op < 100000; ++op) {
      const std::uint64_t h = rng() % universe * 0x9E3779B97F4A7C15ull;  // spread over the table
      switch (rng() % 3) {
        case 0:
          ghost.add(h);
          ref.add(h);
          break;
        case 1: ASSERT_EQ(ghost.remove(h), ref.remove(h)) << "op " << op; break;
        default: ASSERT_EQ(ghost.contains(h), ref.contains(h)) << "op " << op;
      }
      ASSERT_EQ(ghost.size(), ref.size()) << "op " << op;
      ASSERT_LE(ghost.records(), 2 * cap + GhostFifo::kSlack) << "op " << op;
    }
    for (std::uint64_t x = 0; x < universe; ++x)
      ASSERT_EQ(ghost.contains(x * 0x9E3779B97F4A7C15ull), ref.contains(x * 0x9E3779B97F4A7C15ull));
  }
}

// Entries that come back (removed on a ghost hit) before the FIFO ever fills: their records used to stay
// behind for good, one per add (100,000 here, growing without bound in a long-running server).
TEST(GhostFifo, RecordsStayBoundedWhenEntriesComeBackBeforeTheFifoFills) {
  constexpr std::size_t kCap = 64;
  GhostFifo ghost(kCap);
  for (std::uint64_t i = 1; i <= 100000; ++i) {
    ghost.add(i * 0x9E3779B97F4A7C15ull);
    ASSERT_TRUE(ghost.remove(i * 0x9E3779B97F4A7C15ull));
    ASSERT_LE(ghost.records(), 2 * kCap + GhostFifo::kSlack) << "after " << i << " adds";
  }
  EXPECT_EQ(ghost.size(), 0u);
  // Re-adds of one fingerprint leave one live record each time; the others are swept too.
  for (int i = 0; i < 100000; ++i) ghost.add(42);
  EXPECT_EQ(ghost.size(), 1u);
  EXPECT_TRUE(ghost.contains(42));
  EXPECT_LE(ghost.records(), 2 * kCap + GhostFifo::kSlack);
}

// ARC's two ghost lists in one object: each list is its own FIFO of `cap`, a fingerprint lives in one list at a
// time (an add to the other list moves it there), and take() names the list it was found in.
TEST(GhostFifo, TwoListsMatchTwoReferencesWithMovesBetweenThem) {
  for (std::size_t cap : {1u, 5u, 200u}) {
    SCOPED_TRACE(cap);
    std::mt19937_64 rng(cap + 1000);
    GhostFifo ghost(cap);
    ReferenceGhost ref[2] = {ReferenceGhost(cap), ReferenceGhost(cap)};
    const std::uint64_t universe = 4 * cap + 5;
    for (int op = 0; op < 100000; ++op) {
      const std::uint64_t h = rng() % universe * 0x9E3779B97F4A7C15ull;
      const int list = static_cast<int>(rng() % 2);
      switch (rng() % 3) {
        case 0:
          ghost.add(h, list);
          ref[1 - list].remove(h);
          ref[list].add(h);
          break;
        case 1: {
          const int want = ref[0].contains(h) ? 0 : ref[1].contains(h) ? 1 : GhostFifo::kNotFound;
          ref[0].remove(h);
          ref[1].remove(h);
          ASSERT_EQ(ghost.take(h), want) << "op " << op;
          break;
        }
        default: ASSERT_EQ(ghost.contains(h), ref[0].contains(h) || ref[1].contains(h)) << "op " << op;
      }
      for (int l = 0; l < 2; ++l) {
        ASSERT_EQ(ghost.size(l), ref[l].size()) << "op " << op << " list " << l;
        ASSERT_LE(ghost.records(l), 2 * cap + GhostFifo::kSlack) << "op " << op << " list " << l;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::cache
