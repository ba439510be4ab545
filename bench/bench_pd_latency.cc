// Latency of one small prefill/decode transfer at a time (the protocol's own cost: messages, thread hand-offs,
// polling; 4 layers of 3 blocks of 4 KiB on the transport lane between two loopback transports in one process),
// against the floor of the same path: a bare message round trip between two loopback transports, each side woken
// by the other's notification. Per iteration one transfer (start, begin, layers_ready, wait until reclaimable,
// forget on both sides) or one round trip.
//
//   ./build/default/bench/bench_pd_latency --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// (the median over the repetitions is the p50; the transfer's time over the round trip's is the ratio to report).
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "kvtier/transport/pd.h"

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kLayers = 4;
constexpr std::uint64_t kBlockBytes = 4096;
constexpr std::uint64_t kBlocks = 8;

std::atomic<int> g_seq{0};

AgentIdentity identity(const char* role, const KvLayout& layout) {
  return {std::string(role) + std::to_string(g_seq.fetch_add(1)), layout.fingerprint(), 1, 0};
}

void BM_MessageRoundTrip(benchmark::State& state) {
  const KvLayout layout = KvLayout::uniform(kLayers, 1, kBlockBytes).value();
  auto a = create_loopback_transport(identity("rtt-a", layout)).value();
  auto b = create_loopback_transport(identity("rtt-b", layout)).value();
  const PeerId a_sees_b = a->load_peer(b->export_metadata().value()).value();
  const PeerId b_sees_a = b->load_peer(a->export_metadata().value()).value();
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    while (!stop.load()) {
      auto got = b->wait_notifications(10ms);
      if (!got.ok()) continue;
      for (std::size_t i = 0; i < got->size(); ++i) b->send_notification(b_sees_a, "pong").ignore_error();
    }
  });
  for (auto _ : state) {
    if (!a->send_notification(a_sees_b, "ping").ok()) state.SkipWithError("send failed");
    auto got = a->wait_notifications(5s);
    if (!got.ok()) state.SkipWithError(got.status().to_string().c_str());
  }
  stop = true;
  echo.join();
}
BENCHMARK(BM_MessageRoundTrip)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_PdTransfer(benchmark::State& state, PdMode mode) {
  const KvLayout layout = KvLayout::uniform(kLayers, 1, kBlockBytes).value();
  std::vector<std::vector<std::byte>> pre_mem(kLayers, std::vector<std::byte>(kBlocks * kBlockBytes, std::byte{1}));
  std::vector<std::vector<std::byte>> dec_mem(kLayers, std::vector<std::byte>(kBlocks * kBlockBytes));
  std::vector<std::vector<void*>> pre_bases(kLayers), dec_bases(kLayers);
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    pre_bases[l].push_back(pre_mem[l].data());
    dec_bases[l].push_back(dec_mem[l].data());
  }
  const BlockSpace pre_space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, kBlocks, pre_bases).value();
  const BlockSpace dec_space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, kBlocks, dec_bases).value();
  auto pt = create_loopback_transport(identity("lat-pre", layout)).value();
  auto dt = create_loopback_transport(identity("lat-dec", layout)).value();
  auto pre = PdPrefill::create(*pt, pre_space).value();
  auto dec = PdDecode::create(*dt, dec_space).value();
  const PeerId to_dec = pt->load_peer(dt->export_metadata().value()).value();
  const PeerId to_pre = dt->load_peer(pt->export_metadata().value()).value();
  const std::uint32_t all[kLayers] = {0, 1, 2, 3};
  TransferId id = 0;
  for (auto _ : state) {
    ++id;
    Status s = dec->start(to_pre, id, mode, {0, 1, 2});
    if (s.ok()) s = pre->begin(to_dec, id, {3, 4, 5});
    if (s.ok()) s = pre->layers_ready(id, all);
    auto st = dec->wait(id, 5s, true);
    if (!s.ok() || !st.ok() || st->leading_loaded_blocks() != 3) {
      state.SkipWithError(!s.ok() ? s.to_string().c_str() : "transfer did not load");
      break;
    }
    auto ps = pre->wait(id, 5s);
    if (!ps.ok() || !pre->forget(id).ok() || !dec->forget(id).ok()) {
      state.SkipWithError("prefill side did not finish");
      break;
    }
  }
}
BENCHMARK_CAPTURE(BM_PdTransfer, push, PdMode::kPush)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_PdTransfer, pull, PdMode::kPull)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
}  // namespace kvtier::transport

BENCHMARK_MAIN();
