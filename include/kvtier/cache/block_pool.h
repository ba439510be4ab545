// BlockPool: the free list of one tier's block ids (device, pinned host, or
// storage slots). The pool hands out ids only; the memory behind them is a
// BlockSpace owned elsewhere.
//
// Costs: allocate()/free() of one id are O(1) (an indexed free stack: reuse is
// LIFO, which keeps the working set warm). allocate_run(n) returns n
// consecutive ids (so an eviction batch lands in one contiguous host run that
// copies at full DMA speed); it scans a free bitmap, O(capacity / 64).
//
// Errors: a double free or an unknown id fails the whole call with
// FailedPrecondition / OutOfRange and frees nothing (all-or-nothing).
//
// Thread-safety: none; the CacheManager serializes access.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::cache {

using BlockId = std::uint32_t;
inline constexpr BlockId kNoBlock = 0xFFFFFFFFu;

class BlockPool {
 public:
  BlockPool() = default;
  explicit BlockPool(std::uint32_t num_blocks, std::string name = "pool");

  std::uint32_t capacity() const noexcept { return capacity_; }
  std::uint32_t num_free() const noexcept { return static_cast<std::uint32_t>(free_.size()); }
  std::uint32_t num_used() const noexcept { return capacity_ - num_free(); }
  bool is_free(BlockId id) const noexcept { return id < capacity_ && pos_[id] != kNoBlock; }
  const std::string& name() const noexcept { return name_; }

  // One id; ResourceExhausted when empty.
  Result<BlockId> allocate();
  // n ids appended to `out`, all or nothing.
  Status allocate(std::uint32_t n, std::vector<BlockId>& out);
  // n consecutive ids [first, first + n), lowest such run; ResourceExhausted when none.
  Result<BlockId> allocate_run(std::uint32_t n);
  // Length of the longest free run (O(capacity / 64)); for diagnostics and tests.
  std::uint32_t longest_free_run() const;

  Status free(BlockId id);
  // Validates every id first (range, currently allocated, no duplicate in the list).
  Status free(std::span<const BlockId> ids);

 private:
  void take(BlockId id);  // removes a known-free id from the free stack
  void set_bit(BlockId id, bool is_free_bit);

  std::uint32_t capacity_ = 0;
  std::string name_;
  std::vector<BlockId> free_;        // free stack; top = back
  std::vector<BlockId> pos_;         // index in free_, kNoBlock when allocated
  std::vector<std::uint64_t> bits_;  // 1 = free
};

}  // namespace kvtier::cache
