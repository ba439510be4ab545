// Private to the cache manager's sources (cache/cache_manager*.cc): KeyIndex,
// the map from a block's key to its node in the prefix tree, which match()
// walks key by key and commit() extends.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kvtier/backend/eviction_policy.h"
#include "kvtier/cache/block_key.h"

namespace kvtier::cache {

// Open-addressing (linear probing, backward-shift deletion) map BlockKey -> NodeId. Keys are
// uniform hashes, so their low bits index directly; one cache line per lookup in the common case.
class KeyIndex {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (cap > slots_.size()) rehash(cap);
  }
  NodeId find(const BlockKey& k) const {
    if (slots_.empty()) return kNoNode;
    for (std::size_t i = home(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id == kNoNode) return kNoNode;
      if (s.key == k) return s.id;
    }
  }
  void insert(const BlockKey& k, NodeId id) {
    if (2 * (size_ + 1) > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    std::size_t i = home(k);
    while (slots_[i].id != kNoNode) i = (i + 1) & mask_;
    slots_[i] = Slot{k, id};
    ++size_;
  }
  void erase(const BlockKey& k) {
    if (slots_.empty()) return;
    std::size_t i = home(k);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].id == kNoNode) return;
      if (slots_[i].key == k) break;
    }
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].id == kNoNode) break;
      std::size_t h = home(slots_[j].key);
      bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = Slot{};
    --size_;
  }
  std::size_t size() const { return size_; }

 private:
  struct Slot {
    BlockKey key;
    NodeId id = kNoNode;
  };
  std::size_t home(const BlockKey& k) const { return static_cast<std::size_t>(k.lo ^ (k.hi >> 17)) & mask_; }
  void rehash(std::size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.id != kNoNode) insert(s.key, s.id);
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvtier::cache
