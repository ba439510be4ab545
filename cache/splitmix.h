// SplitMix64: the deterministic byte pattern a block key expands to (replay checks and the transfer
// executor's fills must agree on it, so both take it from here).
#pragma once

#include <cstdint>

namespace kvtier::cache {

// Advances `state` and returns the next 64 pseudo-random bits.
inline std::uint64_t splitmix64_next(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace kvtier::cache
