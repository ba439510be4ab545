#include "kvtier/cache/block_key.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <array>
#include <cstring>

#include "cache/canonical_key.h"
#include "core/byte_codec.h"

namespace kvtier::cache {
namespace {

// The key-derivation input: integers little-endian (core/byte_codec.h), 128-bit keys in XXH128's canonical form.
class KeyInput {
 public:
  codec::ByteWriter<std::vector<std::byte>> w;
  void key(const BlockKey& k) { w.raw(canonical(k).data(), 16); }
  BlockKey digest() const {
    XXH128_hash_t h = XXH3_128bits(w.out.data(), w.out.size());
    return BlockKey{h.high64, h.low64};
  }
};

}  // namespace

std::string BlockKey::hex() const { return fmt::format("{:016x}{:016x}", hi, lo); }

Result<BlockKey> BlockKey::from_hex(std::string_view hex) {
  if (hex.size() != 32)
    return InvalidArgument(fmt::format("block key hex '{}' has {} digits, want 32", shown_value(hex), hex.size()));
  BlockKey k;
  for (std::size_t i = 0; i < 32; ++i) {
    char c = hex[i];
    std::uint64_t d;
    if (c >= '0' && c <= '9')
      d = static_cast<std::uint64_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      d = static_cast<std::uint64_t>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      d = static_cast<std::uint64_t>(c - 'A' + 10);
    else
      return InvalidArgument(fmt::format("block key hex '{}' has non-hex character at index {}", shown_value(hex), i));
    std::uint64_t& half = i < 16 ? k.hi : k.lo;
    half = (half << 4) | d;
  }
  return k;
}

Result<KeyHasher> KeyHasher::create(const KeyNamespace& ns) {
  if (ns.model_id.empty()) return InvalidArgument("key namespace: model_id is empty");
  if (ns.tp_size == 0) return InvalidArgument("key namespace: tp_size is 0");
  if (ns.tp_rank >= ns.tp_size)
    return InvalidArgument(fmt::format("key namespace: tp_rank {} >= tp_size {}", ns.tp_rank, ns.tp_size));
  if (ns.block_tokens == 0) return InvalidArgument("key namespace: block_tokens is 0");
  KeyInput in;
  in.w.raw("kvtier.key.v1");
  in.w.str(ns.model_id).u64(ns.layout_fingerprint).str(ns.dtype);
  in.w.u32(ns.tp_rank).u32(ns.tp_size).u32(ns.block_tokens);
  in.w.str(ns.tenant_salt).str(ns.extra);
  KeyHasher h;
  h.ns_ = ns;
  h.root_ = in.digest();
  return h;
}

BlockKey KeyHasher::block_key(const BlockKey& parent, std::span<const std::int32_t> tokens,
                              std::span<const BlockKey> extra_keys) const {
  KeyInput in;
  in.w.u8(0x01);
  in.key(parent);
  in.w.u32(static_cast<std::uint32_t>(tokens.size()));
  for (std::int32_t t : tokens) in.w.u32(static_cast<std::uint32_t>(t));
  in.w.u32(static_cast<std::uint32_t>(extra_keys.size()));
  for (const BlockKey& e : extra_keys) in.key(e);
  return in.digest();
}

BlockKey KeyHasher::opaque_key(const BlockKey& parent, std::uint64_t id) const {
  // On the stack: opaque keys are derived per block on the hot path.
  std::byte buf[1 + 16 + 8];
  buf[0] = std::byte{0x02};
  const auto c = canonical(parent);
  std::memcpy(buf + 1, c.data(), 16);
  codec::store_le<std::uint64_t>(buf + 17, id);
  XXH128_hash_t h = XXH3_128bits(buf, sizeof(buf));
  return BlockKey{h.high64, h.low64};
}

Result<std::vector<BlockKey>> KeyHasher::keys_for(std::span<const std::int32_t> tokens,
                                                  std::span<const std::vector<BlockKey>> extra_keys_per_block) const {
  const std::size_t bt = ns_.block_tokens;
  if (bt == 0) return FailedPrecondition("KeyHasher used before create()");
  const std::size_t full = tokens.size() / bt;
  if (!extra_keys_per_block.empty() && extra_keys_per_block.size() != full)
    return InvalidArgument(
        fmt::format("extra_keys_per_block has {} entries for {} full blocks", extra_keys_per_block.size(), full));
  std::vector<BlockKey> keys;
  keys.reserve(full);
  BlockKey parent = root_;
  for (std::size_t b = 0; b < full; ++b) {
    std::span<const BlockKey> extras;
    if (!extra_keys_per_block.empty()) extras = extra_keys_per_block[b];
    parent = block_key(parent, tokens.subspan(b * bt, bt), extras);
    keys.push_back(parent);
  }
  return keys;
}

std::vector<BlockKey> KeyHasher::keys_for_ids(std::span<const std::uint64_t> ids) const {
  std::vector<BlockKey> keys;
  keys.reserve(ids.size());
  BlockKey parent = root_;
  for (std::uint64_t id : ids) {
    parent = opaque_key(parent, id);
    keys.push_back(parent);
  }
  return keys;
}

}  // namespace kvtier::cache
