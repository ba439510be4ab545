// Cost of the tenant MAC (Poly1305 under a keyed-BLAKE2b one-time key, object format version 2) against the unkeyed
// xxh3 checksum (version 1): pure CPU (seal = encode_header over the payload, verify = decode_header + verify_object)
// on 1-64 MiB payloads, and put / get throughput of the disk backend with and without a tenant secret. Bytes per second
// are payload bytes.
//
//   ./build/default/bench/bench_storage_mac --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// (medians are the p50 over the repetitions). The disk cases write under $TMPDIR (default /tmp).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/storage/disk_backend.h"
#include "storage/object_format.h"
#include "tests/storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

StorageOptions options(bool keyed) {
  StorageOptions o;
  o.ns = "bench-mac";
  if (keyed) {
    o.tenant = "bench";
    o.tenant_secret = std::string(32, '\x42');
  }
  return o;
}

// Seal: the header of an object over the payload (the writer's hashing).
void BM_Seal(benchmark::State& state, bool keyed) {
  const std::uint64_t bytes = static_cast<std::uint64_t>(state.range(0)) * kMiB;
  const StorageOptions o = options(keyed);
  testing::AlignedBuffer payload(bytes);
  testing::fill_random(payload.data(), bytes, 1);
  const std::uint32_t hs = format::header_bytes(o, 8);
  std::vector<std::byte> header(hs);
  const StorageKey k = StorageKey::from_u64(1, 2);
  for (auto _ : state) {
    Status st = format::encode_header(o, format::namespace_digest(o), k, payload.data(), bytes, hs, header.data());
    if (!st.ok()) state.SkipWithError(st.to_string().c_str());
    benchmark::DoNotOptimize(header.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// Verify: what a reader does before it reports a get as OK.
void BM_Verify(benchmark::State& state, bool keyed) {
  const std::uint64_t bytes = static_cast<std::uint64_t>(state.range(0)) * kMiB;
  const StorageOptions o = options(keyed);
  testing::AlignedBuffer payload(bytes);
  testing::fill_random(payload.data(), bytes, 2);
  const std::uint32_t hs = format::header_bytes(o, 8);
  std::vector<std::byte> header(hs);
  const StorageKey k = StorageKey::from_u64(1, 2);
  if (!format::encode_header(o, format::namespace_digest(o), k, payload.data(), bytes, hs, header.data()).ok())
    state.SkipWithError("encode_header failed");
  for (auto _ : state) {
    auto h = format::decode_header(header.data(), hs, nullptr, o.tenant_secret);
    Status st = h.ok() ? format::verify_object(header.data(), *h, payload.data(), o.tenant_secret) : h.status();
    if (!st.ok()) state.SkipWithError(st.to_string().c_str());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// The disk backend: a batch of 8 objects of range(0) MiB per iteration from 4096-aligned host
// memory. `put`: overwrites the same 8 keys; `get`: reads them back verified. `fast`: buffered I/O
// and process-crash durability, so the page cache serves the gets and no flush hides the hashing;
// otherwise the defaults (O_DIRECT where the filesystem allows it, power-loss durability).
void BM_Disk(benchmark::State& state, bool keyed, bool put, bool fast) {
  const std::uint64_t bytes = static_cast<std::uint64_t>(state.range(0)) * kMiB;
  constexpr int kItems = 8;
  testing::TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  if (fast) {
    c.direct_io = DirectIo::kOff;
    c.durability = Durability::kProcessCrash;
  }
  auto backend = create_disk_backend(c, options(keyed));
  if (!backend.ok()) {
    state.SkipWithError(backend.status().to_string().c_str());
    return;
  }
  std::vector<std::unique_ptr<testing::AlignedBuffer>> bufs;
  StorageBatch puts{StorageOp::kPut, {}}, gets{StorageOp::kGet, {}};
  for (int i = 0; i < kItems; ++i) {
    bufs.push_back(std::make_unique<testing::AlignedBuffer>(bytes));
    testing::fill_random(bufs.back()->data(), bytes, 10 + i);
    puts.items.push_back({StorageKey::from_u64(7, i), bufs.back()->data(), bytes});
    (*backend)->register_region(bufs.back()->data(), bytes).ignore_error();  // zero-copy with O_DIRECT
  }
  std::vector<std::unique_ptr<testing::AlignedBuffer>> dsts;
  for (int i = 0; i < kItems; ++i) {
    dsts.push_back(std::make_unique<testing::AlignedBuffer>(bytes));
    gets.items.push_back({StorageKey::from_u64(7, i), dsts.back()->data(), bytes});
    (*backend)->register_region(dsts.back()->data(), bytes).ignore_error();
  }
  auto check = [&](const Result<std::vector<ItemResult>>& r) {
    if (!r.ok()) return state.SkipWithError(r.status().to_string().c_str());
    for (const auto& it : *r)
      if (!it.status.ok()) return state.SkipWithError(it.status.to_string().c_str());
  };
  check(run_batch(**backend, puts));
  for (auto _ : state) check(run_batch(**backend, put ? puts : gets));
  if (!put && std::memcmp(dsts[0]->data(), bufs[0]->data(), bytes) != 0) state.SkipWithError("bytes differ");
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes * kItems));
}

BENCHMARK_CAPTURE(BM_Seal, xxh3, false)->RangeMultiplier(4)->Range(1, 64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Seal, mac, true)->RangeMultiplier(4)->Range(1, 64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Verify, xxh3, false)->RangeMultiplier(4)->Range(1, 64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Verify, mac, true)->RangeMultiplier(4)->Range(1, 64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Disk, cached_put_xxh3, false, true, true)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, cached_put_mac, true, true, true)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, cached_get_xxh3, false, false, true)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, cached_get_mac, true, false, true)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, direct_put_xxh3, false, true, false)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, direct_put_mac, true, true, false)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, direct_get_xxh3, false, false, false)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Disk, direct_get_mac, true, false, false)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace kvtier::storage

BENCHMARK_MAIN();
