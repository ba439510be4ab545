#include "core/xxh3.h"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <new>

#include "core/xxh3_avx2.h"

namespace kvtier::detail {
namespace {

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64, "Xxh3::state_ holds an XXH3_state_t");

bool cpu_has_avx2() noexcept {
#if defined(KVTIER_XXH3_AVX2)
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
#else
  return false;
#endif
}

}  // namespace

bool xxh3_uses_avx2() noexcept { return cpu_has_avx2(); }

Xxh3::Xxh3(Path path) noexcept : avx2_(path == Path::kBest && cpu_has_avx2()) {
  new (state_) XXH3_state_t;
  reset();
}

void Xxh3::reset() noexcept {
  auto* s = reinterpret_cast<XXH3_state_t*>(state_);
#if defined(KVTIER_XXH3_AVX2)
  if (avx2_) return xxh3_avx2_reset(s);
#endif
  (void)XXH3_64bits_reset(s);
}

void Xxh3::update(const void* data, std::size_t bytes) noexcept {
  auto* s = reinterpret_cast<XXH3_state_t*>(state_);
#if defined(KVTIER_XXH3_AVX2)
  if (avx2_) return xxh3_avx2_update(s, data, bytes);
#endif
  (void)XXH3_64bits_update(s, data, bytes);
}

std::uint64_t Xxh3::digest() const noexcept {
  const auto* s = reinterpret_cast<const XXH3_state_t*>(state_);
#if defined(KVTIER_XXH3_AVX2)
  if (avx2_) return xxh3_avx2_digest(s);
#endif
  return XXH3_64bits_digest(s);
}

std::uint64_t xxh3_64(const void* data, std::size_t bytes) noexcept {
#if defined(KVTIER_XXH3_AVX2)
  if (cpu_has_avx2()) return xxh3_avx2_oneshot(data, bytes);
#endif
  return XXH3_64bits(data, bytes);
}

}  // namespace kvtier::detail
