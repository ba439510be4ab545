// The block checksum's hash (core/xxh3.h) against Debian's libxxhash and against memcpy of the same bytes (the
// memory ceiling a hash that reads each byte once cannot beat), in cache (16 KiB, 1 MiB) and from memory (256 MiB).
// And what a host lane's moving side would pay to copy a block and checksum it in one go, from memory: the copy
// alone, the copy then a hash of the source as a second pass, and the copy chunk by chunk with each chunk hashed
// while it is in cache (the source alone, or the source and the landed bytes: what the receiver would no longer
// hash).
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
  state.SetLabel(kvtier::detail::xxh3_best_path_name());
}

// range(1): the path (Xxh3::Path), to compare the builds in one run; a path this CPU lacks is skipped.
void BM_KvtierPath(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto path = static_cast<kvtier::detail::Xxh3::Path>(state.range(1));
  if (!kvtier::detail::xxh3_has_path(path)) {
    state.SkipWithError("this CPU lacks the path's instruction set");
    return;
  }
  auto& b = buffer(n);
  kvtier::detail::Xxh3 h(path);
  for (auto _ : state) {
    h.reset();
    h.update(b.data(), n);
    benchmark::DoNotOptimize(h.digest());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
  constexpr const char* kNames[] = {"best", "avx512", "avx2", "library"};
  state.SetLabel(kNames[state.range(1)]);
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

// 256 MiB from one region into another, 1 MiB blocks, as a host lane's layer of large blocks.
constexpr std::size_t kRegion = std::size_t{256} << 20, kBlock = std::size_t{1} << 20;

void BM_CopyBlocks(benchmark::State& state) {
  auto& b = buffer(kRegion);
  for (auto _ : state) {
    for (std::size_t o = 0; o < kRegion; o += kBlock) std::memcpy(b.data() + kRegion + o, b.data() + o, kBlock);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kRegion));
}

void BM_CopyThenHashBlocks(benchmark::State& state) {
  auto& b = buffer(kRegion);
  for (auto _ : state) {
    std::uint64_t sum = 0;
    for (std::size_t o = 0; o < kRegion; o += kBlock) {
      std::memcpy(b.data() + kRegion + o, b.data() + o, kBlock);
      sum += kvtier::detail::xxh3_64(b.data() + o, kBlock);
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kRegion));
}

// range(0): chunk bytes; range(1): 1 hashes the source chunk, 2 the source and the landed chunk.
void BM_CopyHashInCacheBlocks(benchmark::State& state) {
  const auto chunk = static_cast<std::size_t>(state.range(0));
  const bool landed = state.range(1) == 2;
  auto& b = buffer(kRegion);
  kvtier::detail::Xxh3 src_hash, dst_hash;
  for (auto _ : state) {
    std::uint64_t sum = 0;
    for (std::size_t o = 0; o < kRegion; o += kBlock) {
      src_hash.reset();
      dst_hash.reset();
      for (std::size_t c = o; c < o + kBlock; c += chunk) {
        std::memcpy(b.data() + kRegion + c, b.data() + c, chunk);
        src_hash.update(b.data() + c, chunk);
        if (landed) dst_hash.update(b.data() + kRegion + c, chunk);
      }
      sum += src_hash.digest() ^ (landed ? dst_hash.digest() : 0);
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kRegion));
}

BENCHMARK(BM_Library)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);
BENCHMARK(BM_Kvtier)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);
BENCHMARK(BM_KvtierPath)->ArgsProduct({{16 << 10, 1 << 20, 256 << 20}, {1, 2}});
BENCHMARK(BM_Memcpy)->Arg(16 << 10)->Arg(1 << 20)->Arg(256 << 20);
BENCHMARK(BM_CopyBlocks);
BENCHMARK(BM_CopyThenHashBlocks);
BENCHMARK(BM_CopyHashInCacheBlocks)
    ->Args({16 << 10, 1})
    ->Args({64 << 10, 1})
    ->Args({64 << 10, 2})
    ->Args({256 << 10, 2});

}  // namespace

BENCHMARK_MAIN();
