// Private to core/xxh3.cc: xxHash's XXH3-64 compiled for wider vectors than the library's baseline, each in its own
// translation unit built with its instruction set (core/xxh3_avx2.cc, core/xxh3_avx512.cc; x86-64 only, where CMake
// defines KVTIER_XXH3_VARIANTS) and with its functions renamed (XXH_NAMESPACE) so that they meet neither the
// library's nor each other's. Call one only on a CPU with its instruction set.
#pragma once

#include <cstddef>
#include <cstdint>

struct XXH3_state_s;

namespace kvtier::detail {

struct Xxh3Functions {
  const char* name;
  void (*reset)(XXH3_state_s* state) noexcept;
  void (*update)(XXH3_state_s* state, const void* data, std::size_t bytes) noexcept;
  std::uint64_t (*digest)(const XXH3_state_s* state) noexcept;
  std::uint64_t (*oneshot)(const void* data, std::size_t bytes) noexcept;
};

extern const Xxh3Functions kXxh3Avx2;    // -mavx2
extern const Xxh3Functions kXxh3Avx512;  // -mavx512f: xxHash's 512-bit accumulate and scramble

}  // namespace kvtier::detail
