// Private to the cache manager's sources (cache/cache_manager*.cc): KeyIndex,
// the map from a block's key to its node in the prefix tree, which match()
// walks key by key and commit() extends, and KeyMap, the same table for other
// per-key values (the look-ahead's per-key announcement counts).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cache/large_table.h"
#include "kvtier/backend/eviction_policy.h"
#include "kvtier/cache/block_key.h"

namespace kvtier::cache {

// A key's home slot in the tables below (its low bits): both halves mixed (MurmurHash3's 64-bit finalizer), so keys
// an engine made itself, such as counters in one half, spread as well as the hashes kvtier's KeyHasher makes (the
// low bits of `lo` alone put keys that differ only in `hi` on one probe run: 20,000 of them took 300 ms to index).
inline std::uint64_t key_table_hash(const BlockKey& k) noexcept {
  std::uint64_t h = k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

// Open-addressing (linear probing, backward-shift deletion) map BlockKey -> V, at most half full, keys placed by
// key_table_hash; one cache line per lookup in the common case, and no allocation per entry (a node-based map costs
// a pointer chase per lookup and a malloc per insert).
// A slot is free while Traits::is_free(value): a stored value must never be a free one.
template <class V, class Traits>
class OpenKeyTable {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (cap > slots_.size()) rehash(cap);
  }
  V* find(const BlockKey& k) {
    if (slots_.empty()) return nullptr;
    for (std::size_t i = home(k);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (Traits::is_free(s.value)) return nullptr;
      if (s.key == k) return &s.value;
    }
  }
  const V* find(const BlockKey& k) const { return const_cast<OpenKeyTable*>(this)->find(k); }
  // Slots a lookup of `k` reads before it ends (tests: the length of probe runs).
  std::size_t probes(const BlockKey& k) const {
    std::size_t n = 1;
    for (std::size_t i = home(k); !Traits::is_free(slots_[i].value) && !(slots_[i].key == k); i = (i + 1) & mask_) ++n;
    return n;
  }
  // Inserts a key that is not in the table (callers know it is absent: not checked).
  void insert(const BlockKey& k, const V& value) { claim(k) = value; }
  // The value of k, or a slot claimed for k that holds Traits::free_value(): the caller stores a value in it
  // that is not free before any other call.
  V& find_or_claim(const BlockKey& k) {
    if (V* v = find(k)) return *v;
    return claim(k);
  }
  void erase(const BlockKey& k) {
    if (slots_.empty()) return;
    std::size_t i = home(k);
    for (;; i = (i + 1) & mask_) {
      if (Traits::is_free(slots_[i].value)) return;
      if (slots_[i].key == k) break;
    }
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (Traits::is_free(slots_[j].value)) break;
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
  bool empty() const { return size_ == 0; }

 private:
  struct Slot {
    BlockKey key;
    V value = Traits::free_value();
  };
  std::size_t home(const BlockKey& k) const { return static_cast<std::size_t>(key_table_hash(k)) & mask_; }
  V& claim(const BlockKey& k) {
    if (2 * (size_ + 1) > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    std::size_t i = home(k);
    while (!Traits::is_free(slots_[i].value)) i = (i + 1) & mask_;
    slots_[i].key = k;
    ++size_;
    return slots_[i].value;
  }
  void rehash(std::size_t cap) {
    LargeTable<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (!Traits::is_free(s.value)) insert(s.key, s.value);
  }
  LargeTable<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

struct NodeIdSlot {
  static constexpr NodeId free_value() { return kNoNode; }
  static constexpr bool is_free(NodeId id) { return id == kNoNode; }
};

// BlockKey -> NodeId of the indexed nodes.
class KeyIndex {
 public:
  void reserve(std::size_t n) { table_.reserve(n); }
  NodeId find(const BlockKey& k) const {
    const NodeId* id = table_.find(k);
    return id ? *id : kNoNode;
  }
  void insert(const BlockKey& k, NodeId id) { table_.insert(k, id); }
  void erase(const BlockKey& k) { table_.erase(k); }
  std::size_t size() const { return table_.size(); }
  std::size_t probes(const BlockKey& k) const { return table_.probes(k); }

 private:
  OpenKeyTable<NodeId, NodeIdSlot> table_;
};

}  // namespace kvtier::cache
