// `kvtier bench copy`: BenchCopy, the measurement itself. Sets up the engine,
// the two streams and the pattern-filled pools once; per block size builds
// the block spaces over the pools' halves and the block ids of --pattern;
// per direction times the ceiling, then per strategy runs a verification
// copy, the warm-up and the timed reps, and prints a row (text or JSON).
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/core/enum_names.h"
#include "tools/bench_copy.h"
#include "tools/cpu_time.h"

namespace kvtier::cli::bench_copy_detail {

namespace {

constexpr EnumName<Dir> kDirEntries[] = {
    {Dir::kH2D, "h2d"},
    {Dir::kD2H, "d2h"},
    {Dir::kBoth, "both"},
};
constexpr auto kDirNames = enum_table("dir", kDirEntries);
std::string_view dir_name(Dir d) { return kDirNames.name(d); }

// Layer-first spaces: plane p of a half covers [off + p*half*bb, ...).
Result<BlockSpace> make_half(MemoryKind kind, int ordinal, const KvLayout& layout, std::byte* base,
                             std::uint64_t half_blocks) {
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::uint64_t off = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      bases[l].push_back(base + off);
      off += layout.block_bytes(l, r) * half_blocks;
    }
  return BlockSpace::layer_first(kind, ordinal, layout, half_blocks, std::move(bases));
}

// `count` ids out of [0, pool) following `pattern`; `runs_of` consecutive ids per run.
std::vector<BlockId> pick_ids(std::uint64_t pool, std::uint64_t count, std::mt19937_64& rng, std::uint32_t run) {
  const std::uint64_t slots = pool / run;
  std::vector<BlockId> slot_ids(slots);
  std::iota(slot_ids.begin(), slot_ids.end(), 0);
  std::shuffle(slot_ids.begin(), slot_ids.end(), rng);
  std::vector<BlockId> ids;
  ids.reserve(count);
  for (std::uint64_t s = 0; ids.size() < count; ++s)
    for (std::uint32_t k = 0; k < run && ids.size() < count; ++k) ids.push_back(slot_ids[s] * run + k);
  return ids;
}

void make_ids(SizeSetup& z, const std::string& pattern, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (pattern == "runs16") {
    z.h2d_src = pick_ids(z.host_half, z.n, rng, 16);
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 16);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 16);
    z.d2h_dst = pick_ids(z.host_half, z.n, rng, 16);
  } else if (pattern == "contiguous") {
    // The >= 98% case: host pages contiguous, device ids scattered.
    z.h2d_src.resize(z.n);
    std::iota(z.h2d_src.begin(), z.h2d_src.end(), 0);
    z.d2h_dst = z.h2d_src;
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 1);
  } else {
    z.h2d_src = pick_ids(z.host_half, z.n, rng, 1);
    z.h2d_dst = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_src = pick_ids(z.dev_half, z.n, rng, 1);
    z.d2h_dst = pick_ids(z.host_half, z.n, rng, 1);
  }
}

}  // namespace

int BenchCopy::run() {
  Status st = setup();
  if (!st.ok()) return fail(st);
  if (!a_.json) print_header();
  for (std::uint64_t kib : a_.block_kib) {
    st = run_size(kib * 1024);
    if (!st.ok()) return fail(st);
  }
  return exit_code_;
}

int BenchCopy::fail(const Status& st) {
  std::fprintf(stderr, "kvtier bench copy: %s\n", st.to_string().c_str());
  return 1;
}

Status BenchCopy::setup() {
  KVTIER_ASSIGN_OR_RETURN(engine_, CopyEngine::create(device_, a_.engine));
  for (auto* s : {&stream_a_, &stream_b_}) {
    StreamOptions so;
    so.priority = StreamPriority::kHigh;
    KVTIER_ASSIGN_OR_RETURN(*s, device_.create_stream(so));
  }
  KVTIER_ASSIGN_OR_RETURN(start_event_, device_.create_event());
  for (auto* m : {&m_start_, &m_end_a_, &m_end_b_}) {
    KVTIER_ASSIGN_OR_RETURN(*m, make_marker(device_));
  }
  std::uint64_t dev_bytes = 0, host_bytes = 0;
  for (std::uint64_t kib : a_.block_kib) {
    const std::uint64_t bb = kib * 1024, unit = bb * planes();
    dev_bytes = std::max(dev_bytes, 2 * dev_half_for(bb) * unit);
    host_bytes = std::max(host_bytes, 2 * host_half_for(bb) * unit);
  }
  dev_bytes = (dev_bytes + 255) / 256 * 256;  // halves stay 128-byte aligned
  host_bytes = (host_bytes + 255) / 256 * 256;
  {}
  if (!a_.json)
    std::printf("# backend %s (%s), pools: device %.2f GiB, pinned host %.2f GiB, %.0f MiB moved per direction\n",
                std::string(backend_name(device_.backend())).c_str(), device_.name().c_str(),
                dev_bytes / double(1 << 30), host_bytes / double(1 << 30), total_bytes() / double(1 << 20));
  KVTIER_ASSIGN_OR_RETURN(pools_.device, device_.allocate_device(dev_bytes));
  KVTIER_ASSIGN_OR_RETURN(pools_.host, device_.allocate_pinned(host_bytes));
  pools_.device_bytes = dev_bytes;
  pools_.host_bytes = host_bytes;
  // Sources: the whole pools get the pattern (halves A are never written).
  fill_pattern(pools_.host->data(), kHostSeed, 0, host_bytes);
  std::vector<std::byte> chunk(std::min<std::uint64_t>(dev_bytes, 64ull << 20));
  for (std::uint64_t off = 0; off < dev_bytes; off += chunk.size()) {
    const std::uint64_t len = std::min<std::uint64_t>(chunk.size(), dev_bytes - off);
    fill_pattern(chunk.data(), kDeviceSeed, off, len);
    KVTIER_RETURN_IF_ERROR(device_.memcpy_sync(pools_.device.bytes_ptr() + off, chunk.data(), len));
  }
  return Status::Ok();
}

Status BenchCopy::build(SizeSetup& z, std::uint64_t bb) {
  z.block_bytes = bb;
  z.unit = bb * planes();
  z.n = blocks_for(bb);
  z.dev_half = dev_half_for(bb);
  z.host_half = host_half_for(bb);
  KVTIER_ASSIGN_OR_RETURN(z.layout, KvLayout::uniform(a_.layers, a_.roles, bb));
  std::byte* dev = pools_.device.bytes_ptr();
  std::byte* host = pools_.host->data();
  const int ord = device_.ordinal();
  KVTIER_ASSIGN_OR_RETURN(z.dev_a, make_half(MemoryKind::kDevice, ord, z.layout, dev, z.dev_half));
  // Halves B start at the middle of the pools for every block size, so a
  // destination of one size never overlaps a source (half A) of another.
  KVTIER_ASSIGN_OR_RETURN(z.dev_b, make_half(MemoryKind::kDevice, ord, z.layout, dev_b_base(), z.dev_half));
  KVTIER_ASSIGN_OR_RETURN(z.host_a, make_half(MemoryKind::kPinnedHost, ord, z.layout, host, z.host_half));
  KVTIER_ASSIGN_OR_RETURN(z.host_b, make_half(MemoryKind::kPinnedHost, ord, z.layout, host_b_base(), z.host_half));
  make_ids(z, a_.pattern, 1234 + bb);
  return Status::Ok();
}

CopyRequest BenchCopy::request(const SizeSetup& z, bool h2d, CopyStrategy s) const {
  CopyRequest r;
  r.strategy = s;
  if (h2d) {
    r.src = &z.host_a;
    r.dst = &z.dev_b;
    r.src_blocks = z.h2d_src;
    r.dst_blocks = z.h2d_dst;
  } else {
    r.src = &z.dev_a;
    r.dst = &z.host_b;
    r.src_blocks = z.d2h_src;
    r.dst_blocks = z.d2h_dst;
  }
  return r;
}

// Poisons the destination blocks of `r`.
Status BenchCopy::poison(const SizeSetup& z, bool h2d) {
  if (h2d) return device_.memset_async(dev_b_base(), 0xA5, z.dev_half * z.unit, *stream_a_);
  const auto* dst = &z.host_b;
  for (std::uint32_t l = 0; l < z.layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < z.layout.num_roles(l); ++r)
      for (BlockId id : z.d2h_dst) std::memset(dst->block_ptr(l, r, id), 0xA5, z.block_bytes);
  return Status::Ok();
}

// Every moved byte equals the source pattern.
Status BenchCopy::verify(const SizeSetup& z, bool h2d) {
  const std::byte* pool_base = h2d ? pools_.host->data() : pools_.device.bytes_ptr();
  const std::uint64_t seed = h2d ? kHostSeed : kDeviceSeed;
  const BlockSpace& src = h2d ? z.host_a : z.dev_a;
  const BlockSpace& dst = h2d ? z.dev_b : z.host_b;
  const auto& sids = h2d ? z.h2d_src : z.d2h_src;
  const auto& dids = h2d ? z.h2d_dst : z.d2h_dst;
  for (std::uint32_t l = 0; l < z.layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < z.layout.num_roles(l); ++r) {
      // Bring the destination plane to the host when it is device memory.
      const std::byte* plane = dst.plane(l, r).base;
      if (h2d) {
        readback_.resize(z.dev_half * z.block_bytes);
        KVTIER_RETURN_IF_ERROR(device_.memcpy_sync(readback_.data(), plane, readback_.size()));
        plane = readback_.data();
      }
      for (std::size_t i = 0; i < dids.size(); ++i) {
        const std::byte* got = plane + static_cast<std::uint64_t>(dids[i]) * z.block_bytes;
        const std::uint64_t src_off = static_cast<std::uint64_t>(src.block_ptr(l, r, sids[i]) - pool_base);
        const std::int64_t bad = check_pattern(got, seed, src_off, z.block_bytes);
        if (bad >= 0)
          return DataLoss(fmt::format("verification failed: layer {} role {} pair {} (src {} -> dst {}), byte {} of {}",
                                      l, r, i, sids[i], dids[i], bad, z.block_bytes));
      }
    }
  return Status::Ok();
}

// One timed run of `fn_a` on stream A (and `fn_b` on stream B, from a
// second thread, when set). Returns milliseconds.
template <typename FA, typename FB>
Result<double> BenchCopy::timed(FA&& fn_a, FB* fn_b, bool prequeue) {
  // Shared with the hold callback, which may outlive this frame only until the watchdog fires.
  auto release = std::make_shared<std::atomic<bool>>(false);
  if (prequeue) {
    KVTIER_RETURN_IF_ERROR(device_.launch_host_callback(*stream_a_, [release](const Status&) {
      const auto t0 = std::chrono::steady_clock::now();
      while (!release->load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200))
        std::this_thread::yield();
    }));
  }
  KVTIER_RETURN_IF_ERROR(m_start_->record(*stream_a_));
  Status sb;
  std::atomic<bool> go{false};
  std::thread other;
  if (fn_b != nullptr) {
    KVTIER_RETURN_IF_ERROR(device_.record(*start_event_, *stream_a_));
    KVTIER_RETURN_IF_ERROR(device_.wait(*stream_b_, *start_event_));
    other = std::thread([&] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      sb = (*fn_b)();
      if (sb.ok()) sb = m_end_b_->record(*stream_b_);
    });
  }
  const auto api0 = std::chrono::steady_clock::now();
  const double cpu0 = process_cpu_ms();
  go.store(true, std::memory_order_release);
  Status sa = fn_a();
  if (sa.ok()) sa = m_end_a_->record(*stream_a_);
  if (other.joinable()) other.join();
  last_host_api_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - api0).count();
  release->store(true, std::memory_order_release);
  KVTIER_RETURN_IF_ERROR(sa);
  KVTIER_RETURN_IF_ERROR(sb);
  // The benchmark thread's waiting is not the copy's CPU cost: subtract it.
  const double wait0 = thread_cpu_ms();
  KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_a_, std::chrono::seconds(120)));
  if (fn_b != nullptr) KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_b_, std::chrono::seconds(120)));
  last_cpu_ms_ = (process_cpu_ms() - cpu0) - (thread_cpu_ms() - wait0);
  KVTIER_ASSIGN_OR_RETURN(double ms, m_end_a_->since(*m_start_));
  if (fn_b != nullptr) {
    KVTIER_ASSIGN_OR_RETURN(double mb, m_end_b_->since(*m_start_));
    ms = std::max(ms, mb);
  }
  return ms;
}

Result<double> BenchCopy::ceiling(const SizeSetup& z, Dir dir) {
  const std::uint64_t bytes = z.n * z.unit;
  std::byte* dev_b = dev_b_base();
  std::byte* dev_a = pools_.device.bytes_ptr();
  std::byte* host_a = pools_.host->data();
  std::byte* host_b = host_b_base();
  auto h2d = [&] { return device_.memcpy_async(dev_b, host_a, bytes, *stream_a_); };
  auto d2h_b = [&]() -> Status { return device_.memcpy_async(host_b, dev_a, bytes, *stream_b_); };
  auto d2h_a = [&] { return device_.memcpy_async(host_b, dev_a, bytes, *stream_a_); };
  std::vector<double> ms;
  for (int rep = 0; rep < a_.reps + 1; ++rep) {
    Result<double> t = dir == Dir::kH2D   ? timed(h2d, static_cast<decltype(d2h_b)*>(nullptr), a_.prequeue)
                       : dir == Dir::kD2H ? timed(d2h_a, static_cast<decltype(d2h_b)*>(nullptr), a_.prequeue)
                                          : timed(h2d, &d2h_b, a_.prequeue);
    KVTIER_RETURN_IF_ERROR(t.status());
    if (rep > 0) ms.push_back(*t);  // the first run warms up
  }
  const double total = dir == Dir::kBoth ? 2.0 * bytes : double(bytes);
  return total / (p50(ms) * 1e6);
}

Status BenchCopy::run_size(std::uint64_t bb) {
  SizeSetup z;
  KVTIER_RETURN_IF_ERROR(build(z, bb));
  for (const std::string& dname : a_.directions) {
    const Dir dir = kDirNames.find(dname).value_or(Dir::kBoth);
    KVTIER_ASSIGN_OR_RETURN(const double ceil_gbps, ceiling(z, dir));
    for (const std::string& sname : a_.strategies) {
      KVTIER_ASSIGN_OR_RETURN(const CopyStrategy strategy, parse_copy_strategy(sname));
      Row row;
      row.strategy = sname;
      row.dir = dir;
      row.block_bytes = bb;
      row.blocks = z.n;
      row.ceiling_gbps = ceil_gbps;
      CopyRequest rh = request(z, true, strategy);
      CopyRequest rd = request(z, false, strategy);
      // "both": tell kAuto that the other direction runs at the same time.
      rh.full_duplex = rd.full_duplex = dir == Dir::kBoth;
      CopyReport rep_h, rep_d;
      // --pieces: the request as that many copies back to back (the report
      // is the last piece's, but its segments are those of every piece: with
      // more pieces than blocks some pieces are empty and never run).
      auto copy_pieces = [&](const CopyRequest& whole, Stream& s, CopyReport& out) -> Status {
        const std::size_t n = whole.src_blocks.size(), k = std::max<std::uint32_t>(1, a_.pieces);
        std::uint64_t segments = 0;
        for (std::size_t i = 0; i < k; ++i) {
          const std::size_t b = n * i / k, e = n * (i + 1) / k;
          if (b == e) continue;
          CopyRequest part = whole;
          part.src_blocks = whole.src_blocks.subspan(b, e - b);
          part.dst_blocks = whole.dst_blocks.subspan(b, e - b);
          auto r = engine_->copy(part, s);
          if (!r.ok()) return r.status();
          out = *r;
          segments += r->segments;
        }
        out.segments = segments;
        return Status::Ok();
      };
      auto copy_h = [&]() -> Status { return copy_pieces(rh, *stream_a_, rep_h); };
      auto copy_d_on = [&](Stream& s) -> Status { return copy_pieces(rd, s, rep_d); };
      auto copy_d_a = [&]() -> Status { return copy_d_on(*stream_a_); };
      auto copy_d_b = [&]() -> Status { return copy_d_on(*stream_b_); };
      using FB = decltype(copy_d_b);
      // Verification run (not timed).
      if (a_.verify) {
        const bool do_h = dir != Dir::kD2H, do_d = dir != Dir::kH2D;
        if (do_h) KVTIER_RETURN_IF_ERROR(poison(z, true));
        if (do_d) KVTIER_RETURN_IF_ERROR(poison(z, false));
        KVTIER_RETURN_IF_ERROR(device_.synchronize(*stream_a_, std::chrono::seconds(120)));
        Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr))
                           : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr))
                                              : timed(copy_h, &copy_d_b);
        KVTIER_RETURN_IF_ERROR(t.status());
        if (do_h) {
          Status v = verify(z, true);
          if (!v.ok()) return v.with_context(fmt::format("{} h2d {} B", sname, bb));
        }
        if (do_d) {
          Status v = verify(z, false);
          if (!v.ok()) return v.with_context(fmt::format("{} d2h {} B", sname, bb));
        }
      }
      std::vector<double> ms, api_ms, cpu_ms;
      // Untimed warm-up: adaptive kAuto (split share, CPU budget) settles
      // within a few copies; the timed reps measure the steady state.
      for (int rep = 0; rep < a_.warmup; ++rep) {
        Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr), a_.prequeue)
                           : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr), a_.prequeue)
                                              : timed(copy_h, &copy_d_b, a_.prequeue);
        KVTIER_RETURN_IF_ERROR(t.status().with_context(fmt::format("warm-up {} {} {} B", sname, dir_name(dir), bb)));
      }
      for (int rep = 0; rep < a_.reps; ++rep) {
        Result<double> t = dir == Dir::kH2D   ? timed(copy_h, static_cast<FB*>(nullptr), a_.prequeue)
                           : dir == Dir::kD2H ? timed(copy_d_a, static_cast<FB*>(nullptr), a_.prequeue)
                                              : timed(copy_h, &copy_d_b, a_.prequeue);
        KVTIER_RETURN_IF_ERROR(t.status().with_context(fmt::format("{} {} {} B", sname, dir_name(dir), bb)));
        ms.push_back(*t);
        api_ms.push_back(last_host_api_ms_);
        cpu_ms.push_back(last_cpu_ms_);
        row.rep_shares.push_back(dir == Dir::kD2H ? rep_d.kernel_share : rep_h.kernel_share);
      }
      row.host_api_ms = p50(api_ms);
      row.cpu_ms = p50(cpu_ms);
      row.bytes = (dir == Dir::kBoth ? 2 : 1) * z.n * z.unit;
      row.p50_ms = p50(ms);
      row.gbps = row.bytes / (row.p50_ms * 1e6);
      const CopyReport& main = dir == Dir::kD2H ? rep_d : rep_h;
      row.ctas = main.ctas;
      row.gated = main.gated;
      row.segments = main.segments;
      row.calls = main.calls;
      row.ran = std::string(copy_strategy_name(main.strategy));
      row.kernel_share = main.kernel_share;
      row.lanes = main.lanes;
      if (dir == Dir::kBoth) {
        row.ctas = std::max(rep_h.ctas, rep_d.ctas);
        row.segments += rep_d.segments;
        row.calls += rep_d.calls;
        row.ran = fmt::format("h2d:{},d2h:{}", copy_strategy_name(rep_h.strategy), copy_strategy_name(rep_d.strategy));
      }
      emit(row);
    }
  }
  return Status::Ok();
}

void BenchCopy::print_header() const {
  std::printf("%-9s %-5s %-12s %-32s %8s %9s %8s %8s %6s %5s %5s %8s\n", "block", "dir", "strategy", "ran", "blocks",
              "p50_ms", "GB/s", "ceiling", "ratio", "ctas", "gated", "segments");
}

void BenchCopy::emit(const Row& r) const {
  const double ratio = r.ceiling_gbps > 0 ? r.gbps / r.ceiling_gbps : 0;
  if (a_.json) {
    nlohmann::json j;
    j["strategy"] = r.strategy;
    j["ran"] = r.ran;
    j["direction"] = std::string(dir_name(r.dir));
    j["block_bytes"] = r.block_bytes;
    j["blocks"] = r.blocks;
    j["layers"] = a_.layers;
    j["roles"] = a_.roles;
    j["bytes"] = r.bytes;
    j["gbps"] = r.gbps;
    j["ceiling_gbps"] = r.ceiling_gbps;
    j["ratio"] = ratio;
    j["ctas"] = r.ctas;
    j["split_kernel_share"] = a_.engine.split_kernel_share;
    j["split_dma_lanes"] = a_.engine.split_dma_lanes;
    j["kernel_share"] = r.kernel_share;
    j["lanes"] = r.lanes;
    j["rep_kernel_shares"] = r.rep_shares;
    j["p50_ms"] = r.p50_ms;
    j["host_api_ms"] = r.host_api_ms;
    j["cpu_ms"] = r.cpu_ms;
    j["cpu_ms_per_gb"] = r.bytes > 0 ? r.cpu_ms / (static_cast<double>(r.bytes) * 1e-9) : 0.0;
    // Enqueue time per descriptor (DMA segment or kernel item) on the submitting thread.
    // (segments of every piece of the request)
    const double descriptors = static_cast<double>(r.segments);
    j["host_us_per_descriptor"] = descriptors > 0 ? r.host_api_ms * 1e3 / descriptors : 0.0;
    j["prequeued"] = a_.prequeue;
    j["pieces"] = a_.pieces;
    j["reps"] = a_.reps;
    j["warmup"] = a_.warmup;
    j["pattern"] = a_.pattern;
    j["backend"] = std::string(backend_name(device_.backend()));
    j["gated"] = r.gated;
    j["segments"] = r.segments;
    j["calls"] = r.calls;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%-9s %-5s %-12s %-32s %8llu %9.3f %8.2f %8.2f %6.3f %5u %5s %8llu\n",
                fmt::format("{}KiB", r.block_bytes / 1024).c_str(), std::string(dir_name(r.dir)).c_str(),
                r.strategy.c_str(), r.ran.c_str(), static_cast<unsigned long long>(r.blocks), r.p50_ms, r.gbps,
                r.ceiling_gbps, ratio, r.ctas, r.gated ? "yes" : "no", static_cast<unsigned long long>(r.segments));
  }
  std::fflush(stdout);
}

}  // namespace kvtier::cli::bench_copy_detail
