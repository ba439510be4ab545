// `kvtier bench copy`: the source pattern. Counter-based pseudo-random bytes,
// recomputable from (region seed, offset), so that a destination can be
// checked byte by byte without a reference copy.
#include <cstring>
#include <vector>

#include "tools/bench_copy.h"

namespace kvtier::cli::bench_copy_detail {

namespace {

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Byte `offset` of the pattern of region `seed` (words of 8 bytes).
inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset) {
  return static_cast<std::uint8_t>(mix64(seed * 0x100000001B3ull + offset / 8) >> (8 * (offset % 8)));
}

}  // namespace

void fill_pattern(std::byte* dst, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes) {
  std::uint64_t i = 0;
  for (; i < bytes && (offset + i) % 8 != 0; ++i) dst[i] = static_cast<std::byte>(pattern_byte(seed, offset + i));
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t w = mix64(seed * 0x100000001B3ull + (offset + i) / 8);
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < bytes; ++i) dst[i] = static_cast<std::byte>(pattern_byte(seed, offset + i));
}
// Index of the first byte differing from the pattern, or -1.
std::int64_t check_pattern(const std::byte* p, std::uint64_t seed, std::uint64_t offset, std::uint64_t bytes) {
  thread_local std::vector<std::byte> expect;
  expect.resize(bytes);
  fill_pattern(expect.data(), seed, offset, bytes);
  if (std::memcmp(p, expect.data(), bytes) == 0) return -1;
  for (std::uint64_t i = 0; i < bytes; ++i)
    if (p[i] != expect[i]) return static_cast<std::int64_t>(i);
  return -1;
}

}  // namespace kvtier::cli::bench_copy_detail
