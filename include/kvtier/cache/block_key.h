// Content-addressed block keys: a chained 128-bit hash over (parent key,
// token ids, extra keys), rooted in a namespace digest.
//
// Specification (version 1), all integers little-endian, 128-bit digests in
// XXH128 canonical form (16 bytes, big-endian high half first):
//   namespace digest = XXH3_128(
//       "kvtier.key.v1" (13 bytes) ‖ u32 len ‖ model_id ‖ u64 layout_fingerprint ‖
//       u32 len ‖ dtype ‖ u32 tp_rank ‖ u32 tp_size ‖ u32 block_tokens ‖
//       u32 len ‖ tenant_salt ‖ u32 len ‖ extra)
//   block key        = XXH3_128(0x01 ‖ parent ‖ u32 n ‖ n × i32 token ‖ u32 m ‖ m × extra key)
//   opaque key       = XXH3_128(0x02 ‖ parent ‖ u64 id)        (trace replay: pre-hashed ids)
// The parent of a request's first block is the namespace digest (root()), so
// two engines share a key only when every namespace field is equal. The
// result depends on bytes only: identical across processes, machines, and
// compilers (tested against a golden constant and a second process).
//
// Thread-safety: BlockKey and KeyHasher are immutable values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::cache {

struct BlockKey {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  // 32 lowercase hex digits, high half first (equals the XXH128 canonical form).
  std::string hex() const;
  static Result<BlockKey> from_hex(std::string_view hex);
};

struct BlockKeyHash {
  std::size_t operator()(const BlockKey& k) const noexcept {
    // The key is already a uniform hash; fold both halves.
    return static_cast<std::size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull));
  }
};

// Everything that makes two engines' KV bytes for the same tokens differ.
struct KeyNamespace {
  std::string model_id;                  // "org/model@revision" (required)
  std::uint64_t layout_fingerprint = 0;  // KvLayout::fingerprint()
  std::string dtype = "bf16";            // cache dtype / quantization scheme, e.g. "fp8_e4m3+scales"
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  std::uint32_t block_tokens = 0;  // tokens per block (required, >= 1)
  std::string tenant_salt;         // optional: isolates a tenant's blocks
  std::string extra;               // optional: LoRA id, layout version, ...
};

class KeyHasher {
 public:
  KeyHasher() = default;
  // InvalidArgument for an empty model_id, tp_rank >= tp_size, tp_size == 0 or block_tokens == 0.
  static Result<KeyHasher> create(const KeyNamespace& ns);

  const KeyNamespace& key_namespace() const noexcept { return ns_; }
  // The namespace digest: the parent of every request's first block.
  const BlockKey& root() const noexcept { return root_; }

  BlockKey block_key(const BlockKey& parent, std::span<const std::int32_t> tokens,
                     std::span<const BlockKey> extra_keys = {}) const;
  BlockKey opaque_key(const BlockKey& parent, std::uint64_t id) const;

  // Keys of every full block of `tokens` (a trailing partial block gets none).
  // `extra_keys_per_block`, when non-empty, has one entry per full block (e.g.
  // the hashes of multimodal items overlapping that block).
  Result<std::vector<BlockKey>> keys_for(std::span<const std::int32_t> tokens,
                                         std::span<const std::vector<BlockKey>> extra_keys_per_block = {}) const;
  // Chain of opaque keys for pre-hashed block ids (Mooncake traces).
  std::vector<BlockKey> keys_for_ids(std::span<const std::uint64_t> ids) const;

 private:
  KeyNamespace ns_;
  BlockKey root_;
};

}  // namespace kvtier::cache
