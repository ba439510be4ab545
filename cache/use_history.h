// Private to the cache manager's sources (cache/cache_manager*.cc):
// UseHistory, the access counts by key that outlive a block's stay in the
// index, so that a block computed again starts with the hits it had
// (admit() counts a hit, commit() seeds a new node's hit count from it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/large_table.h"
#include "kvtier/cache/block_key.h"

namespace kvtier::cache {

// Access counts by key, kept after a block leaves the index: a block's second use is usually
// far beyond what the cache holds, so counts of resident blocks alone would rarely grow. A
// direct-mapped table of (24-bit tag, 8-bit saturating count); a colliding key takes the slot
// over. All counts are halved after 8 x size bumps so that old popularity fades.
class UseHistory {
 public:
  explicit UseHistory(std::size_t min_entries) {
    std::size_t n = std::size_t{1} << 20;
    while (n < min_entries && n < (std::size_t{1} << 24)) n <<= 1;
    slots_.assign(n, 0);
    mask_ = n - 1;
  }
  // Starts loading `k`'s slot into the cache: the table is megabytes and keys are hashes, so every bump misses
  // the CPU caches; a caller that knows its next keys issues these first and lets the misses overlap.
  void prefetch(const BlockKey& k) const { __builtin_prefetch(&slots_[k.lo & mask_], 1); }
  // Counts one use of `k`; returns the uses so far, including this one.
  std::uint32_t bump(const BlockKey& k) {
    std::uint32_t& slot = slots_[k.lo & mask_];
    std::uint32_t tag = static_cast<std::uint32_t>(k.hi >> 40) | 1u;  // 24 bits, never 0
    std::uint32_t c = (slot & 0xFFFFFFu) == tag ? slot >> 24 : 0;
    if (c < 255) ++c;
    slot = (c << 24) | tag;
    if (++ops_ >= 8 * slots_.size()) {
      ops_ = 0;
      for (auto& v : slots_) {
        std::uint32_t h = (v >> 24) >> 1;
        v = h ? (h << 24) | (v & 0xFFFFFFu) : 0;
      }
    }
    return c;
  }

 private:
  LargeTable<std::uint32_t> slots_;
  std::size_t mask_ = 0;
  std::size_t ops_ = 0;
};

}  // namespace kvtier::cache
