#include "kvtier/cache/block_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

namespace kvtier::cache {

BlockPool::BlockPool(std::uint32_t num_blocks, std::string name)
    : capacity_(num_blocks), name_(std::move(name)), pos_(num_blocks), bits_((num_blocks + 63) / 64, 0) {
  free_.reserve(num_blocks);
  // Descending so that the first allocations pop 0, 1, 2, ...: a fresh pool hands out contiguous ids.
  for (std::uint32_t i = 0; i < num_blocks; ++i) {
    BlockId id = num_blocks - 1 - i;
    pos_[id] = i;
    free_.push_back(id);
    set_bit(id, true);
  }
}

void BlockPool::set_bit(BlockId id, bool is_free_bit) {
  std::uint64_t m = std::uint64_t{1} << (id % 64);
  if (is_free_bit)
    bits_[id / 64] |= m;
  else
    bits_[id / 64] &= ~m;
}

void BlockPool::take(BlockId id) {
  std::uint32_t p = pos_[id];
  BlockId last = free_.back();
  free_[p] = last;
  pos_[last] = p;
  free_.pop_back();
  pos_[id] = kNoBlock;
  set_bit(id, false);
}

Result<BlockId> BlockPool::allocate() {
  if (free_.empty()) return ResourceExhausted(fmt::format("{}: all {} blocks in use", name_, capacity_));
  BlockId id = free_.back();
  take(id);
  return id;
}

Status BlockPool::allocate(std::uint32_t n, std::vector<BlockId>& out) {
  if (n > free_.size())
    return ResourceExhausted(fmt::format("{}: {} blocks requested, {} free of {}", name_, n, free_.size(), capacity_));
  for (std::uint32_t i = 0; i < n; ++i) {
    BlockId id = free_.back();
    take(id);
    out.push_back(id);
  }
  return Status::Ok();
}

Result<BlockId> BlockPool::allocate_run(std::uint32_t n) {
  if (n == 0) return InvalidArgument(fmt::format("{}: allocate_run(0)", name_));
  if (n > free_.size())
    return ResourceExhausted(fmt::format("{}: run of {} requested, {} free", name_, n, free_.size()));
  std::uint32_t run_start = 0, run_len = 0;
  for (std::uint32_t w = 0; w < bits_.size(); ++w) {
    std::uint64_t word = bits_[w];
    if (word == ~std::uint64_t{0} && (w + 1) * 64 <= capacity_) {
      if (run_len == 0) run_start = w * 64;
      run_len += 64;
    } else if (word == 0) {
      run_len = 0;
    } else {
      for (std::uint32_t b = 0; b < 64; ++b) {
        std::uint32_t id = w * 64 + b;
        if (id >= capacity_) break;
        if (word >> b & 1) {
          if (run_len == 0) run_start = id;
          if (++run_len >= n) break;
        } else {
          run_len = 0;
        }
      }
    }
    if (run_len >= n) {
      for (std::uint32_t i = 0; i < n; ++i) take(run_start + i);
      return run_start;
    }
  }
  return ResourceExhausted(fmt::format("{}: no run of {} consecutive free blocks ({} free, longest run {})", name_, n,
                                       free_.size(), longest_free_run()));
}

std::uint32_t BlockPool::longest_free_run() const {
  std::uint32_t best = 0, cur = 0;
  for (std::uint32_t id = 0; id < capacity_; ++id) {
    if (pos_[id] != kNoBlock)
      best = std::max(best, ++cur);
    else
      cur = 0;
  }
  return best;
}

Status BlockPool::free(BlockId id) { return free(std::span<const BlockId>(&id, 1)); }

Status BlockPool::free(std::span<const BlockId> ids) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    BlockId id = ids[i];
    if (id >= capacity_)
      return OutOfRange(fmt::format("{}: free of block id {} >= capacity {} at index {}", name_, id, capacity_, i));
    if (pos_[id] != kNoBlock)
      return FailedPrecondition(fmt::format("{}: double free of block id {} at index {}", name_, id, i));
  }
  // Duplicates inside one list are a double free too; mark as we go and undo on error.
  for (std::size_t i = 0; i < ids.size(); ++i) {
    BlockId id = ids[i];
    if (pos_[id] != kNoBlock) {
      for (std::size_t j = 0; j < i; ++j) take(ids[j]);
      return FailedPrecondition(fmt::format("{}: block id {} listed twice in one free (index {})", name_, id, i));
    }
    pos_[id] = static_cast<std::uint32_t>(free_.size());
    free_.push_back(id);
    set_bit(id, true);
  }
  return Status::Ok();
}

}  // namespace kvtier::cache
