// Private to kvtier's sources: XXH3-64 (xxHash's XXH3_64bits: the same values) on the widest vectors this CPU has.
//
// Debian's libxxhash is built for the x86-64 baseline, SSE2: on a CPU with AVX2 it hashes at less than half the
// speed that xxHash reaches there when data is in cache (13.4 against 31.1 GiB/s; 7.1 against 8.4 from memory:
// bench/bench_xxh3 on a 2-core VM), and kvtier hashes every block it moves between hosts or stores. Xxh3 runs the same
// header's code built for the widest vectors the CPU has (core/xxh3_variants.h, chosen once per process): AVX-512
// (1.2-1.4x AVX2 in cache on the same VM), AVX2, else the library.
//
// Thread-safety: an Xxh3 is one stream (one thread at a time); the free functions are reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::detail {

struct Xxh3Functions;  // core/xxh3_variants.h

class Xxh3 {
 public:
  enum class Path : std::uint8_t {
    kBest,      // the widest of the builds below this CPU runs
    kAvx512,    // xxHash built for AVX-512F (x86-64 with it only)
    kAvx2,      // xxHash built for AVX2 (x86-64 with it only)
    kPortable,  // the library (tests compare the others with it)
  };
  // A path this CPU or build lacks (xxh3_has_path) runs the library.
  explicit Xxh3(Path path = Path::kBest) noexcept;
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;

  void reset() noexcept;
  void update(const void* data, std::size_t bytes) noexcept;
  std::uint64_t digest() const noexcept;  // of everything since the last reset; the stream may go on

 private:
  const Xxh3Functions* functions_;
  alignas(64) unsigned char state_[640];  // an XXH3_state_t (core/xxh3.cc checks the size)
};

std::uint64_t xxh3_64(const void* data, std::size_t bytes) noexcept;

// Whether this CPU and build run a path's own code (kBest and kPortable always do).
bool xxh3_has_path(Xxh3::Path path) noexcept;
// What Xxh3::Path::kBest runs in this process: "avx512", "avx2" or "library".
const char* xxh3_best_path_name() noexcept;

}  // namespace kvtier::detail
