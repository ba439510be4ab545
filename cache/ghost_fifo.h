// Private to the cache manager's sources (cache/eviction_policy.cc): GhostFifo, the ghost entries of the
// S3-FIFO and ARC policies.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "cache/large_table.h"

namespace kvtier::cache {

// One or two bounded FIFO sets of key fingerprints (ghost entries): each list holds the `cap` fingerprints added to
// it last, a re-add (to either list) counting as the latest of the list it is added to. ARC keeps its two ghost
// lists in one object, so that an insert finds out in one probe whether, and in which list, a key is a ghost.
//
// One open-addressing table (linear probing, backward-shift deletion) serves all lists: 8 bytes a slot, a 32-bit
// tag of the fingerprint and a 32-bit stamp (the list in the low bit, that list's sequence number of the latest add
// above it), so a table of a 32,768-block tier's two ghost lists fits in 1 MiB. Each list's FIFO holds (tag, stamp)
// records; a record whose tag was re-added or removed since is stale and skipped when it reaches the front. Stale
// records are also dropped in a sweep whenever a list's records outnumber twice its cap plus kSlack: without it,
// entries removed before the FIFO fills (a block that keeps coming back) left their records behind forever.
//
// Fingerprints are compared by their 32-bit tags: two fingerprints that share a tag count as one ghost (a lookup
// finds a false ghost with a probability of about 2 * cap / 2^32), which only shifts an adaptive policy's guess,
// never correctness. Sequence
// numbers wrap at 2^31; a record can match only a slot of its own list, and a list's records are at most 2 * cap +
// kSlack of its adds old, so a wrapped stamp never meets a stale record while cap < 2^29.
class GhostFifo {
 public:
  static constexpr int kMaxLists = 2;
  static constexpr int kNotFound = -1;
  static constexpr std::size_t kSlack = 64;

  // Lists 0 and 1, `cap` fingerprints each (a caller that needs one list uses list 0 only).
  explicit GhostFifo(std::size_t cap) : cap_(std::max<std::size_t>(cap, 1)) {}

  void add(std::uint64_t h, int list = 0) {
    const std::uint32_t t = tag(h);
    std::uint32_t& seq = seq_[list];
    seq = (seq + 1) & 0x7FFFFFFFu;
    if (seq == 0) seq = 1;
    const std::uint32_t stamp = (seq << 1) | static_cast<std::uint32_t>(list);
    put(t, stamp);
    fifo_[list].emplace_back(t, stamp);
    while (size_[list] > cap_) pop_oldest(list);
    if (fifo_[list].size() > 2 * cap_ + kSlack) drop_stale_records(list);
  }
  bool contains(std::uint64_t h) const { return find(tag(h)) != kAbsent; }
  // Removes the fingerprint; returns the list it was in, or kNotFound.
  int take(std::uint64_t h) {
    const std::size_t i = find(tag(h));
    if (i == kAbsent) return kNotFound;
    const int list = static_cast<int>(slots_[i].stamp & 1u);
    erase_at(i);
    return list;
  }
  bool remove(std::uint64_t h) { return take(h) != kNotFound; }
  std::size_t size(int list = 0) const { return size_[list]; }
  // A list's records, stale ones included: at most 2 * cap + kSlack after any call.
  std::size_t records(int list = 0) const { return fifo_[list].size(); }

 private:
  struct Slot {
    std::uint32_t tag = 0;
    std::uint32_t stamp = 0;  // 0: empty (sequence numbers start at 1)
  };
  using Record = std::pair<std::uint32_t, std::uint32_t>;  // (tag, stamp)
  static constexpr std::size_t kAbsent = SIZE_MAX;
  static std::uint32_t tag(std::uint64_t h) { return static_cast<std::uint32_t>(h ^ (h >> 32)); }
  std::size_t home(std::uint32_t t) const {
    return static_cast<std::size_t>((std::uint64_t{t} * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  std::size_t find(std::uint32_t t) const {
    if (slots_.empty()) return kAbsent;
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = home(t);; i = (i + 1) & mask) {
      if (slots_[i].stamp == 0) return kAbsent;
      if (slots_[i].tag == t) return i;
    }
  }
  void put(std::uint32_t t, std::uint32_t stamp) {
    if ((total() + 1) * 2 > slots_.size()) grow();
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = home(t);
    while (slots_[i].stamp != 0 && slots_[i].tag != t) i = (i + 1) & mask;
    if (slots_[i].stamp != 0) --size_[slots_[i].stamp & 1u];
    ++size_[stamp & 1u];
    slots_[i] = Slot{t, stamp};
  }
  void pop_oldest(int list) {
    auto& fifo = fifo_[list];
    while (!fifo.empty()) {
      const auto [t, stamp] = fifo.front();
      fifo.pop_front();
      const std::size_t i = find(t);
      if (i != kAbsent && slots_[i].stamp == stamp) {
        erase_at(i);
        return;
      }
    }
  }
  // Empties slot i and moves later entries of its probe run back, so that lookups need no tombstones.
  void erase_at(std::size_t i) {
    --size_[slots_[i].stamp & 1u];
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t j = (i + 1) & mask; slots_[j].stamp != 0; j = (j + 1) & mask) {
      const std::size_t k = home(slots_[j].tag);
      // slots_[j] may move to i when its home is not cyclically within (i, j].
      if (((j - k) & mask) >= ((j - i) & mask)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
  }
  // Keeps the list's records that are their tag's latest add (the live ones), in order: O(records), paid for by
  // the at least cap + kSlack adds that made the stale ones.
  void drop_stale_records(int list) {
    std::deque<Record> live;
    for (const auto& [t, stamp] : fifo_[list]) {
      const std::size_t i = find(t);
      if (i != kAbsent && slots_[i].stamp == stamp) live.emplace_back(t, stamp);
    }
    fifo_[list].swap(live);
  }
  std::size_t total() const { return size_[0] + size_[1]; }
  void grow() {
    LargeTable<Slot> old = std::move(slots_);
    const std::size_t n = std::max<std::size_t>(16, old.size() * 2);
    slots_.assign(n, Slot{});
    shift_ = 64;
    for (std::size_t v = n; v > 1; v >>= 1) --shift_;
    size_[0] = size_[1] = 0;
    for (const Slot& s : old)
      if (s.stamp != 0) put(s.tag, s.stamp);
  }

  std::size_t cap_;
  std::uint32_t seq_[kMaxLists] = {0, 0};
  std::size_t size_[kMaxLists] = {0, 0};
  int shift_ = 64;
  LargeTable<Slot> slots_;
  std::deque<Record> fifo_[kMaxLists];
};

}  // namespace kvtier::cache
