// xxHash's implementation from its installed header, compiled in this file with -mavx2 (its XXH_VECTOR follows
// the compiler's target) and its functions renamed (XXH_NAMESPACE) so that they do not meet the library's.
#define XXH_STATIC_LINKING_ONLY
#define XXH_IMPLEMENTATION
#define XXH_NAMESPACE kvtier_avx2_
#include "core/xxh3_avx2.h"

#include <xxhash.h>

namespace kvtier::detail {

void xxh3_avx2_reset(XXH3_state_s* state) noexcept { (void)XXH3_64bits_reset(state); }
void xxh3_avx2_update(XXH3_state_s* state, const void* data, std::size_t bytes) noexcept {
  (void)XXH3_64bits_update(state, data, bytes);
}
std::uint64_t xxh3_avx2_digest(const XXH3_state_s* state) noexcept { return XXH3_64bits_digest(state); }
std::uint64_t xxh3_avx2_oneshot(const void* data, std::size_t bytes) noexcept { return XXH3_64bits(data, bytes); }

}  // namespace kvtier::detail
