// The block checksum's hash (core/xxh3.h) against Debian's libxxhash and against memcpy of the same bytes (the
// memory ceiling a hash that reads each byte once cannot beat), in cache (16 KiB, 1 MiB) and from memory (256 MiB).
//   build/default/bench/bench_xxh3 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <cstring>
#include <vector>

#include "core/xxh3.h"

namespace {

std::vector<unsigned char>& buffer(std::size_t n) {
  static std::vector<unsigned char> b;
  if (b.size() < 2 * n) {
    b.assign(2 * n, 0);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(i * 131 + 7);
  }
  return b;
}

void BM_Library(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& b = buffer(n);
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(b.data(), n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void BM_Kvtier(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& b = buffer(n);
  for (auto _ : state) benchmark::DoNotOptimize(kvtier::detail::xxh3_64(b.data(), n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetLabel(kvtier::detail::xxh3_uses_avx2() ? "avx2" : "library");
}

void BM_Memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto& b = buffer(n);
  for (auto _ : state) {
    std::memcpy(b.data() + n, b.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

BENCHMARK(BM_Library)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);
BENCHMARK(BM_Kvtier)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);
BENCHMARK(BM_Memcpy)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);

}  // namespace

BENCHMARK_MAIN();
