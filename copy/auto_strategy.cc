// kAuto: the rule that picks a strategy per request from its plan summary
// (copy_engine.h, "kAuto rule": rules 1-5 in choose_impl(), the staged rule
// 4s in staged_preferred()), and choose(), which answers it for a request
// without copying anything; copy() applies the same rule.
#include <algorithm>
#include <cstdint>
#include <span>

#include "copy/engine_base.h"

namespace kvtier::copy_detail {

namespace {
bool in_range(std::uint64_t v, std::uint64_t lo, std::uint64_t hi) { return v >= lo && v < hi; }
}  // namespace

bool EngineBase::idle_prefers_kernel(std::uint64_t avg, bool caller_busy, bool duplex, std::uint64_t kernel_max) const {
  // From an idle stream the GPU waits for the CPU to enqueue a batch's
  // descriptors; the kernel is one launch. Measured on an H200 with `kvtier
  // bench copy --no-prequeue` (docs/performance.md, idle-stream rows): H2D
  // 64 KiB batch 74 % vs kernel 91 %, 256 KiB 87 % vs 92 %, 1 MiB 96 % vs
  // 92 %; D2H 256 KiB 85 % vs 94 %. SMs kept out (kernel_max 0): never.
  return !caller_busy && !duplex && kernel_max > 0 && avg < options_.auto_idle_kernel_max_segment_bytes;
}

CopyStrategy EngineBase::choose_impl(const PlanSummary& s, const StreamState* self, bool caller_busy) const {
  const std::uint64_t avg = s.average_segment_bytes();
  if (s.segments <= options_.auto_per_run_max_segments || avg >= options_.auto_per_run_min_segment_bytes)
    return CopyStrategy::kDmaPerRun;
  switch (s.direction) {
    case CopyDirection::kDeviceToDevice: return CopyStrategy::kSmKernel;
    case CopyDirection::kHostToHost: return CopyStrategy::kDmaBatch;
    case CopyDirection::kDeviceToHost: {
      const bool duplex = s.full_duplex_hint || in_flight(CopyDirection::kHostToDevice, self);
      if (duplex &&
          in_range(avg, options_.auto_split_duplex_min_segment_bytes, options_.auto_split_duplex_max_segment_bytes))
        return CopyStrategy::kSplit;
      if (idle_prefers_kernel(avg, caller_busy, duplex, options_.auto_kernel_max_segment_bytes_d2h))
        return CopyStrategy::kSmKernel;
      if (avg >= options_.auto_kernel_max_segment_bytes_d2h) return CopyStrategy::kDmaBatch;
      if (avg >= options_.auto_duplex_dma_min_segment_bytes && duplex) return CopyStrategy::kDmaBatch;
      return CopyStrategy::kSmKernel;
    }
    case CopyDirection::kHostToDevice: {
      const bool duplex = s.full_duplex_hint || in_flight(CopyDirection::kDeviceToHost, self);
      // SMs kept out: only the DMA-lanes part of the split range remains.
      const std::uint64_t split_min =
          options_.auto_kernel_max_segment_bytes_h2d == 0
              ? std::max(options_.auto_split_h2d_min_segment_bytes, options_.auto_split_h2d_large_segment_bytes)
              : options_.auto_split_h2d_min_segment_bytes;
      // Behind queued work only (if so configured): enqueueing the DMA part
      // costs about as much CPU as the copy takes, which an idle stream would
      // wait for (measured on an H200, timed from an idle stream: split
      // 30-84 % vs the kernel 72-91 % at 4-48 KiB).
      // Paused: the CPU could not keep the GPU fed even with the fewest DMA
      // descriptors (adaptive CPU budget at its maximum).
      const bool paused = options_.auto_split_cpu_budget_adaptive && tuner_.paused(split_size_class(s.direction, avg));
      const bool split_ok = (caller_busy || !options_.auto_split_only_behind_queued_work) && !paused &&
                            s.bytes >= options_.auto_split_min_request_bytes;
      if (split_ok && (duplex ? in_range(avg, options_.auto_split_duplex_min_segment_bytes,
                                         options_.auto_split_duplex_max_segment_bytes)
                              : in_range(avg, split_min, options_.auto_split_h2d_max_segment_bytes)))
        return CopyStrategy::kSplit;
      if (idle_prefers_kernel(avg, caller_busy, duplex, options_.auto_kernel_max_segment_bytes_h2d))
        return CopyStrategy::kSmKernel;
      if (avg >= options_.auto_kernel_max_segment_bytes_h2d) return CopyStrategy::kDmaBatch;
      if (avg >= options_.auto_duplex_dma_min_segment_bytes && duplex) return CopyStrategy::kDmaBatch;
      return CopyStrategy::kSmKernel;
    }
  }
  return CopyStrategy::kDmaBatch;
}

bool EngineBase::staged_preferred(const CopyRequest& r, const PlanSummary& s, PlanScratch& sc) const {
  std::uint64_t kernel_max = 0;
  switch (s.direction) {
    case CopyDirection::kHostToDevice: kernel_max = options_.auto_kernel_max_segment_bytes_h2d; break;
    case CopyDirection::kDeviceToHost: kernel_max = options_.auto_kernel_max_segment_bytes_d2h; break;
    case CopyDirection::kDeviceToDevice:
    case CopyDirection::kHostToHost: return false;
  }
  const std::uint64_t avg = s.average_segment_bytes();
  if (s.segments <= options_.auto_per_run_max_segments || avg >= options_.auto_per_run_min_segment_bytes ||
      avg >= kernel_max)
    return false;
  const bool h2d = s.direction == CopyDirection::kHostToDevice;
  // Full duplex: staged copies of both directions measured only ~55 GB/s
  // aggregate on the H200 (batched DMA ~100 from 32 KiB, kernels ~70 below):
  // leave it to the duplex and kernel rules.
  if (s.full_duplex_hint || in_flight(h2d ? CopyDirection::kDeviceToHost : CopyDirection::kHostToDevice, nullptr))
    return false;
  const std::span<const BlockId> host_ids = h2d ? r.src_blocks : r.dst_blocks;
  const std::uint64_t ranges = estimate_host_ranges(sc.planes, host_ids, h2d);
  if (ranges == 0 || s.bytes / ranges < options_.staged_min_host_run_bytes) return false;
  if (!plan_staged_chunks(sc.planes, host_ids, h2d, options_.staged_slot_bytes, options_.max_pairs_per_call, sc.staged)
           .ok())
    return false;
  return static_cast<double>(sc.staged.footprint) <= options_.staged_max_span_ratio * static_cast<double>(s.bytes);
}

CopyStrategy EngineBase::choose(const CopyRequest& request) const {
  if (!validate(request).ok() || request.src_blocks.empty()) return CopyStrategy::kDmaPerRun;
  if (request.checksums != nullptr) return CopyStrategy::kSmKernel;  // what copy() runs for a checksummed request
  PlanScratch scratch;
  select_planes(request, scratch.planes);
  find_runs(request.src_blocks, request.dst_blocks, scratch.runs);
  const PlanSummary summary = summarize(request, scratch.planes, scratch.runs);
  if (staged_preferred(request, summary, scratch)) return CopyStrategy::kStagedDma;
  return choose_impl(summary, nullptr);
}

}  // namespace kvtier::copy_detail
