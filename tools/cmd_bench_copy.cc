// `kvtier bench copy`: block-copy throughput of every CopyEngine strategy
// against the contiguous-DMA ceiling measured in the same run.
//
// Per block size: n = total / (block_bytes x planes) block ids are moved per
// direction. Memory (allocated once for the largest need):
//   device pool: halves A (D2H sources, never written) and B (H2D destinations),
//                each >= 4n blocks and together >= --pool-min-mib (default
//                2 GiB on CUDA) so that scattered ids do not sit in L2;
//   host pool:   halves A (H2D sources, never written) and B (D2H destinations),
//                each 4n blocks.
// Sources hold a counter-based pseudo-random pattern (recomputable, so no
// reference copy is kept); before timing each (size, direction, strategy) is
// run once on a poisoned destination and every moved byte is compared with
// the pattern (nonzero exit on a mismatch).
//
// Timing: CUDA events with timing on the copy stream (host backend: stream-
// ordered host callbacks), from a start marker recorded before the first
// enqueue to an end marker after the copy, so CPU submission time is included
// when the stream is idle. "both": a start marker on stream A that stream B
// waits on, both directions submitted from two host threads (released after
// the start marker), time to the later of the two end markers; GB/s counts
// both directions' bytes. The ceiling is one contiguous memcpy_async of the
// same bytes in the same direction (both: two at once on the two streams);
// p50 over --reps.
//
// This file holds the flags and the subcommand's registration; the bench
// itself is BenchCopy (tools/bench_copy.h, bench_copy_runner.cc), with the
// pattern in bench_copy_pattern.cc and the markers in bench_copy_timing.cc.
#include <fmt/format.h>

#include <cstdio>
#include <limits>
#include <memory>
#include <string>

extern char** environ;

#include "kvtier/copy/copy_config.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/config.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "tools/bench_copy.h"
#include "tools/cli.h"

namespace kvtier::cli::bench_copy_detail {
namespace {

Result<std::unique_ptr<Device>> open_device(const std::string& backend) {
  const bool want_cuda = backend == "cuda" || (backend == "auto" && cuda_device_count() > 0);
  if (want_cuda) return create_cuda_device(0);
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
  return std::unique_ptr<Device>(std::move(host));
}

Status check_args(const BenchCopyArgs& a) {
  for (const auto& s : a.strategies) {
    Result<CopyStrategy> parsed = parse_copy_strategy(s);
    if (!parsed.ok()) return parsed.status();
  }
  for (const auto& d : a.directions)
    if (d != "h2d" && d != "d2h" && d != "both")
      return InvalidArgument(fmt::format("unknown direction '{}' (expected h2d, d2h, both)", d));
  if (a.pattern != "random" && a.pattern != "runs16" && a.pattern != "contiguous")
    return InvalidArgument(fmt::format("unknown pattern '{}' (expected random, runs16, contiguous)", a.pattern));
  if (a.backend != "auto" && a.backend != "cuda" && a.backend != "host")
    return InvalidArgument(fmt::format("unknown backend '{}' (expected auto, cuda, host)", a.backend));
  if (a.reps < 1) return InvalidArgument(fmt::format("--reps must be >= 1, got {}", a.reps));
  if (a.warmup < 0) return InvalidArgument(fmt::format("--warmup must be >= 0, got {}", a.warmup));
  if (a.layers < 1 || a.roles < 1 || a.roles > 6)
    return InvalidArgument(fmt::format("--layers must be >= 1 and --roles in [1, 6] (got {}, {})", a.layers, a.roles));
  // A block of every layer and role must be a size kvtier takes (KvLayout::kMaxBlockBytes): bigger products
  // wrapped to small or zero sizes (a division by zero, a 0-byte pool).
  const std::uint64_t max_kib = KvLayout::kMaxBlockBytes / 1024 / (std::uint64_t{a.layers} * a.roles);
  for (auto k : a.block_kib)
    if (k == 0 || k > max_kib)
      return InvalidArgument(
          fmt::format("--block-sizes {}: each entry must be 1..{} KiB ({} layers x {} roles of a "
                      "block at most {} bytes)",
                      k, max_kib, a.layers, a.roles, KvLayout::kMaxBlockBytes));
  constexpr std::uint64_t kMaxMib = std::uint64_t{1} << 30;  // 1 PiB: past it `<< 20` wraps
  if (a.total_mib > kMaxMib) return InvalidArgument(fmt::format("--total-mib {}: at most {}", a.total_mib, kMaxMib));
  if (a.pool_min_mib > kMaxMib)
    return InvalidArgument(fmt::format("--pool-min-mib {}: at most {}", a.pool_min_mib, kMaxMib));
  if (a.staged_slot_mib > kMaxMib)
    return InvalidArgument(fmt::format("--staged-slot-mib {}: at most {}", a.staged_slot_mib, kMaxMib));
  // sm_item_bytes is 32-bit: its KiB times 1024 must fit (4194305 wrapped to 1024-byte items).
  constexpr std::uint64_t kMaxItemKib = std::numeric_limits<std::uint32_t>::max() / 1024;
  if (std::uint64_t{a.sm_item_kib} > kMaxItemKib)
    return InvalidArgument(fmt::format("--sm-item-kib {}: at most {}", a.sm_item_kib, kMaxItemKib));
  constexpr std::uint64_t kMaxKib = std::uint64_t{1} << 40;
  if (a.gate_max_kib > kMaxKib)
    return InvalidArgument(fmt::format("--gate-max-kib {}: at most {}", a.gate_max_kib, kMaxKib));
  return Status::Ok();
}

}  // namespace
}  // namespace kvtier::cli::bench_copy_detail

namespace kvtier::cli {

Action register_bench_copy(CLI::App& bench) {
  auto args = std::make_shared<bench_copy_detail::BenchCopyArgs>();
  auto* cmd = bench.add_subcommand("copy", "Block-copy throughput per strategy vs the contiguous DMA ceiling");
  cmd->add_option("--backend", args->backend, "auto | cuda | host (auto: cuda when a GPU is visible)");
  cmd->add_option("--block-sizes", args->block_kib, "block sizes in KiB (per layer and role)")->delimiter(',');
  cmd->add_option("--total-mib", args->total_mib,
                  "bytes moved per measurement and direction, MiB (default 256 on CUDA, 32 on the host backend)");
  cmd->add_option("--pool-min-mib", args->pool_min_mib,
                  "minimum device pool, MiB (default 2048 on CUDA so scattered blocks miss L2)");
  cmd->add_option("--reps", args->reps, "timed repetitions (p50 reported)");
  cmd->add_option("--warmup", args->warmup, "untimed repetitions before the timed ones (adaptive kAuto settles)");
  cmd->add_option("--strategies", args->strategies, "dma_per_run,dma_batch,sm_kernel,staged_dma,split,auto")
      ->delimiter(',');
  cmd->add_option("--directions", args->directions, "h2d,d2h,both")->delimiter(',');
  cmd->add_option("--pattern", args->pattern,
                  "random | runs16 | contiguous (contiguous: host ids contiguous, device ids random)");
  cmd->add_option("--layers", args->layers, "layers per block (each a plane)")
      ->check(CLI::Range(std::uint32_t{1}, KvLayout::kMaxLayers));
  cmd->add_option("--roles", args->roles, "roles per layer (1..6)");
  cmd->add_flag("--json", args->json, "one JSON object per line");
  cmd->add_flag("!--no-verify", args->verify, "skip the byte-exact verification run");
  cmd->add_flag("!--no-prequeue", args->prequeue,
                "time from an idle stream (CPU planning + submission inside the timed region) instead of holding the "
                "stream while the copy is enqueued");
  cmd->add_option(
      "--pieces", args->pieces,
      "enqueue each measurement as this many copies back to back (with --no-prequeue: CPU-bound streaming)");
  auto& e = args->engine;
  {
    // Engine knobs from the environment (docs/configuration.md, copy.*);
    // the flags below, parsed later, override them.
    ConfigTable table;
    bind_copy_engine_options(table, e);
    args->env_status = table.apply_env(environ);
  }
  cmd->add_option("--sm-ctas-h2d", e.sm_ctas_h2d, "SM kernel CTAs for host->device");
  cmd->add_option("--sm-ctas-d2h", e.sm_ctas_d2h, "SM kernel CTAs for device->host");
  cmd->add_option("--sm-threads", e.sm_threads_per_cta, "SM kernel threads per CTA");
  cmd->add_option("--sm-item-kib", args->sm_item_kib, "SM kernel work item size, KiB");
  cmd->add_option("--staged-slot-mib", args->staged_slot_mib, "staged_dma: device staging slot size, MiB");
  cmd->add_option("--staged-slots", e.staged_slots, "staged_dma: staging slots per stream");
  cmd->add_option("--sm-ctas-d2d", e.sm_ctas_d2d, "SM kernel CTAs for device->device (staged_dma's kernels)");
  cmd->add_flag("!--sm-descriptors-uva", e.sm_descriptors_in_device_memory,
                "kernel reads descriptors from mapped pinned memory instead of uploading them");
  cmd->add_option("--batch-max-descriptors", e.batch_max_descriptors, "segments per cudaMemcpyBatchAsync call");
  cmd->add_option("--gate-max-kib", args->gate_max_kib, "gate H2D batches with a segment <= this, KiB");
  cmd->add_flag("--gate-always", e.batch_gate_always, "gate every H2D batch");
  cmd->add_option("--auto-kernel-max-bytes-h2d", e.auto_kernel_max_segment_bytes_h2d,
                  "kAuto: H2D segments below this many BYTES use the SM kernel");
  cmd->add_option("--auto-kernel-max-bytes-d2h", e.auto_kernel_max_segment_bytes_d2h,
                  "kAuto: D2H segments below this many BYTES use the SM kernel");
  cmd->add_option("--split-kernel-share", e.split_kernel_share, "split: share of the pairs copied by the SM kernel");
  cmd->add_option("--split-dma-lanes", e.split_dma_lanes, "split: lane streams sharing the batched-DMA part");
  return [cmd, args]() -> int {
    if (!cmd->parsed()) return -1;
    if (!args->env_status.ok()) {
      std::fprintf(stderr, "kvtier bench copy: %s\n", args->env_status.to_string().c_str());
      return 2;
    }
    bench_copy_detail::BenchCopyArgs a = *args;
    a.engine.batch_gate_max_segment_bytes = a.gate_max_kib * 1024;
    a.engine.sm_item_bytes = a.sm_item_kib * 1024;
    a.engine.staged_slot_bytes = a.staged_slot_mib << 20;
    // staged_dma needs dense host runs; on random host ids it degenerates to a
    // chunk per pair, so the default list leaves it out for that pattern.
    if (cmd->count("--strategies") == 0 && a.pattern == "random") std::erase(a.strategies, std::string("staged_dma"));
    if (Status st = bench_copy_detail::check_args(*args); !st.ok()) {
      std::fprintf(stderr, "kvtier bench copy: %s\n", st.to_string().c_str());
      return 2;
    }
    // The engine's options as the flags and KVTIER_COPY_* set them, checked before the device opens: a bad one
    // was found by the engine later and exited 1 (a failed run) instead of 2.
    if (Status st = check_copy_engine_options(a.engine); !st.ok()) {
      std::fprintf(stderr, "kvtier bench copy: a copy-engine flag or KVTIER_COPY_* setting: %s\n",
                   st.to_string().c_str());
      return 2;
    }
    auto device = bench_copy_detail::open_device(a.backend);
    if (!device.ok()) {
      std::fprintf(stderr, "kvtier bench copy: cannot open the %s device: %s\n", a.backend.c_str(),
                   device.status().to_string().c_str());
      return 1;
    }
    bench_copy_detail::BenchCopy bench_copy(**device, a);
    return bench_copy.run();
  };
}

}  // namespace kvtier::cli
