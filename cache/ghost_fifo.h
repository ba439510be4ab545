// Private to the cache manager's sources (cache/eviction_policy.cc): GhostFifo, the ghost entries of the
// S3-FIFO and ARC policies.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace kvtier::cache {

// Bounded FIFO set of key fingerprints (ghost entries): the `cap` most recently added, a re-add counting as
// the latest. An open-addressing table (linear probing, backward-shift deletion) maps each fingerprint to the
// sequence number of its latest add, over a FIFO of (fingerprint, sequence) records; a record whose
// fingerprint was re-added or removed since is stale and skipped when it reaches the front. S3-FIFO and ARC
// add or look up a ghost on every insert and erase of their tier, so the table keeps that to a probe or two,
// with no allocation per entry. Stale records are also dropped in a sweep whenever they outnumber the live
// ones plus `cap`: without it, entries removed before the FIFO fills (a block that keeps coming back) left their
// records behind forever, 16 bytes each.
class GhostFifo {
 public:
  explicit GhostFifo(std::size_t cap) : cap_(std::max<std::size_t>(cap, 1)) {}
  void add(std::uint64_t h) {
    const std::uint64_t seq = ++seq_;
    put(h, seq);
    fifo_.emplace_back(h, seq);
    while (size_ > cap_) pop_oldest();
    if (fifo_.size() > 2 * cap_ + kSlack) drop_stale_records();
  }
  bool contains(std::uint64_t h) const { return find(h) != kAbsent; }
  bool remove(std::uint64_t h) {
    const std::size_t i = find(h);
    if (i == kAbsent) return false;
    erase_at(i);
    return true;
  }
  std::size_t size() const { return size_; }
  // Records in the FIFO, stale ones included: at most 2 * cap + kSlack after any call.
  std::size_t records() const { return fifo_.size(); }
  static constexpr std::size_t kSlack = 64;
  void pop_oldest() {
    while (!fifo_.empty()) {
      auto [h, seq] = fifo_.front();
      fifo_.pop_front();
      const std::size_t i = find(h);
      if (i != kAbsent && slots_[i].seq == seq) {
        erase_at(i);
        return;
      }
    }
  }

 private:
  struct Slot {
    std::uint64_t h = 0;
    std::uint64_t seq = 0;  // 0: empty (sequence numbers start at 1)
  };
  static constexpr std::size_t kAbsent = SIZE_MAX;
  std::size_t home(std::uint64_t h) const { return static_cast<std::size_t>((h * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::size_t find(std::uint64_t h) const {
    if (slots_.empty()) return kAbsent;
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = home(h);; i = (i + 1) & mask) {
      if (slots_[i].seq == 0) return kAbsent;
      if (slots_[i].h == h) return i;
    }
  }
  void put(std::uint64_t h, std::uint64_t seq) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = home(h);
    while (slots_[i].seq != 0 && slots_[i].h != h) i = (i + 1) & mask;
    if (slots_[i].seq == 0) ++size_;
    slots_[i] = Slot{h, seq};
  }
  // Empties slot i and moves later entries of its probe run back, so that lookups need no tombstones.
  void erase_at(std::size_t i) {
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t j = (i + 1) & mask; slots_[j].seq != 0; j = (j + 1) & mask) {
      const std::size_t k = home(slots_[j].h);
      // slots_[j] may move to i when its home is not cyclically within (i, j].
      if (((j - k) & mask) >= ((j - i) & mask)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }
  // Keeps the records that are their fingerprint's latest add (the live ones), in order: O(records), paid for
  // by the at least cap + kSlack adds that made the stale ones.
  void drop_stale_records() {
    std::deque<std::pair<std::uint64_t, std::uint64_t>> live;
    for (const auto& [h, seq] : fifo_) {
      const std::size_t i = find(h);
      if (i != kAbsent && slots_[i].seq == seq) live.emplace_back(h, seq);
    }
    fifo_.swap(live);
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    const std::size_t n = std::max<std::size_t>(16, old.size() * 2);
    slots_.assign(n, Slot{});
    shift_ = 64;
    for (std::size_t v = n; v > 1; v >>= 1) --shift_;
    size_ = 0;
    for (const Slot& s : old)
      if (s.seq != 0) put(s.h, s.seq);
  }

  std::size_t cap_;
  std::uint64_t seq_ = 0;
  std::size_t size_ = 0;
  int shift_ = 64;
  std::vector<Slot> slots_;
  std::deque<std::pair<std::uint64_t, std::uint64_t>> fifo_;
};

}  // namespace kvtier::cache
