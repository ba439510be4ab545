// A BlockKey's bytes in key-derivation inputs (block_key.h, hybrid_cache.h): XXH128's canonical form, big-endian
// high half first, as xxhsum prints it. The one place in the hash inputs that is not little-endian
// (core/byte_codec.h): the specification chose xxhash's own form for digests.
#pragma once

#include <xxhash.h>

#include <array>
#include <cstddef>
#include <cstring>

#include "kvtier/cache/block_key.h"

namespace kvtier::cache {

inline std::array<std::byte, 16> canonical(const BlockKey& k) noexcept {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH128_hash_t{k.lo, k.hi});
  std::array<std::byte, 16> out;
  std::memcpy(out.data(), c.digest, 16);
  return out;
}

}  // namespace kvtier::cache
