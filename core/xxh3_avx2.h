// Private to core/xxh3.cc: xxHash's XXH3-64 compiled for AVX2 (core/xxh3_avx2.cc, built with -mavx2 on x86-64
// only, where CMake defines KVTIER_XXH3_AVX2). Call only on a CPU with AVX2.
#pragma once

#include <cstddef>
#include <cstdint>

struct XXH3_state_s;

namespace kvtier::detail {

void xxh3_avx2_reset(XXH3_state_s* state) noexcept;
void xxh3_avx2_update(XXH3_state_s* state, const void* data, std::size_t bytes) noexcept;
std::uint64_t xxh3_avx2_digest(const XXH3_state_s* state) noexcept;
std::uint64_t xxh3_avx2_oneshot(const void* data, std::size_t bytes) noexcept;

}  // namespace kvtier::detail
