// Private to kvtier's sources: XXH3-64 (xxHash's XXH3_64bits: the same values) on the widest vectors this CPU has.
//
// Debian's libxxhash is built for the x86-64 baseline, SSE2: on a CPU with AVX2 it hashes at less than half the
// speed that xxHash reaches there when data is in cache (13.4 against 31.1 GiB/s; 7.1 against 8.4 from memory:
// bench/bench_xxh3 on a 2-core VM), and kvtier hashes every block it moves between hosts or stores. Xxh3 runs the same
// header's code built for AVX2 where the CPU has it (core/xxh3_avx2.cc, chosen once per process), the library
// elsewhere.
//
// Thread-safety: an Xxh3 is one stream (one thread at a time); the free functions are reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::detail {

class Xxh3 {
 public:
  enum class Path : std::uint8_t {
    kBest,      // AVX2 where the CPU has it, else the library
    kPortable,  // the library (tests compare the two)
  };
  explicit Xxh3(Path path = Path::kBest) noexcept;
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;

  void reset() noexcept;
  void update(const void* data, std::size_t bytes) noexcept;
  std::uint64_t digest() const noexcept;  // of everything since the last reset; the stream may go on

 private:
  bool avx2_;
  alignas(64) unsigned char state_[640];  // an XXH3_state_t (core/xxh3.cc checks the size)
};

std::uint64_t xxh3_64(const void* data, std::size_t bytes) noexcept;

// Whether Xxh3::Path::kBest runs the AVX2 build in this process.
bool xxh3_uses_avx2() noexcept;

}  // namespace kvtier::detail
