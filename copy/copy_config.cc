#include "kvtier/copy/copy_config.h"

#include <limits>

#include "copy/kernel_plan.h"

namespace kvtier {

void bind_copy_engine_options(ConfigTable& t, CopyEngineOptions& o, const std::string& p) {
  constexpr std::uint32_t kU32Max = std::numeric_limits<std::uint32_t>::max();
  t.add(p + ".sm_ctas_h2d", &o.sm_ctas_h2d, "SM kernel CTAs for host->device copies", 1, kU32Max);
  t.add(p + ".sm_ctas_d2h", &o.sm_ctas_d2h, "SM kernel CTAs for device->host copies", 1, kU32Max);
  t.add(p + ".sm_ctas_d2d", &o.sm_ctas_d2d, "SM kernel CTAs for device->device copies (and staged DMA)", 1, kU32Max);
  t.add(p + ".sm_threads_per_cta", &o.sm_threads_per_cta, "SM kernel threads per CTA", copy_detail::kWarpThreads,
        copy_detail::kMaxThreadsPerCta, copy_detail::kWarpThreads);
  t.add(p + ".sm_item_bytes", &o.sm_item_bytes, "bytes one warp copies per work item", 16, kU32Max - 15, 16);
  t.add(p + ".sm_ctas_landed", &o.sm_ctas_landed,
        "SM kernel CTAs for copies that read back what they wrote (landed checksums; 0: one per SM)");
  t.add(p + ".sm_landed_item_bytes", &o.sm_landed_item_bytes,
        "largest work item of a copy that reads back what it wrote", 16, kU32Max - 15, 16);
  t.add(p + ".sm_inline_descriptor_max_pairs", &o.sm_inline_descriptor_max_pairs,
        "kernel launches of at most this many pairs pass descriptors as kernel parameters (0: never)", 0,
        copy_detail::kInlineMaxPairs);
  t.add(p + ".sm_programmatic_launch", &o.sm_programmatic_launch,
        "SM kernels use programmatic dependent launch (launch overlaps the previous kernel's end; order kept)");
  t.add(p + ".descriptor_slots", &o.descriptor_slots, "kernel descriptor slots per stream (ring)", 1,
        copy_detail::kMaxDescriptorSlots);
  t.add(p + ".max_pairs_per_call", &o.max_pairs_per_call, "pairs per kernel launch; larger requests are split", 1,
        kU32Max);
  t.add(p + ".batch_max_descriptors", &o.batch_max_descriptors, "segments per cudaMemcpyBatchAsync call", 1, kU32Max);
  t.add(p + ".batch_gate_max_segment_bytes", &o.batch_gate_max_segment_bytes,
        "gate H2D batches whose smallest segment is at most this (idle-stream cliff)");
  t.add(p + ".batch_gate_always", &o.batch_gate_always, "gate every H2D batch");
  t.add(p + ".auto_per_run_min_segment_bytes", &o.auto_per_run_min_segment_bytes,
        "kAuto: one DMA per run from this average segment size");
  t.add(p + ".auto_kernel_max_segment_bytes_h2d", &o.auto_kernel_max_segment_bytes_h2d,
        "kAuto: H2D segments below this use the SM kernel (0: never)");
  t.add(p + ".auto_kernel_max_segment_bytes_d2h", &o.auto_kernel_max_segment_bytes_d2h,
        "kAuto: D2H segments below this use the SM kernel (0: never)");
  t.add(p + ".auto_duplex_dma_min_segment_bytes", &o.auto_duplex_dma_min_segment_bytes,
        "kAuto: in full duplex, batched DMA from this segment size");
  t.add(p + ".split_kernel_share", &o.split_kernel_share, "split: share of the pairs copied by the SM kernel (0..1)",
        0.0, 1.0);
  t.add(p + ".split_dma_lanes", &o.split_dma_lanes, "split: lane streams sharing the batched-DMA part", 1,
        copy_detail::kMaxSplitDmaLanes);
  t.add(p + ".auto_split_h2d_min_segment_bytes", &o.auto_split_h2d_min_segment_bytes,
        "kAuto: H2D (not duplex) uses split from this average segment size");
  t.add(p + ".auto_split_h2d_max_segment_bytes", &o.auto_split_h2d_max_segment_bytes,
        "kAuto: ... below this one (0: never)");
  t.add(p + ".auto_split_h2d_kernel_share", &o.auto_split_h2d_kernel_share,
        "kAuto split: SM kernel share below auto_split_h2d_large_segment_bytes", 0.0, 1.0);
  t.add(p + ".auto_split_h2d_kernel_share_small", &o.auto_split_h2d_kernel_share_small,
        "kAuto split: SM kernel share below auto_split_h2d_small_segment_bytes", 0.0, 1.0);
  t.add(p + ".auto_split_h2d_small_segment_bytes", &o.auto_split_h2d_small_segment_bytes,
        "kAuto split: the small-segment share applies below this average segment size");
  t.add(p + ".auto_split_h2d_large_segment_bytes", &o.auto_split_h2d_large_segment_bytes,
        "kAuto split: the large-segment share and split_dma_lanes lanes from this average segment size");
  t.add(p + ".auto_split_h2d_kernel_share_large", &o.auto_split_h2d_kernel_share_large,
        "kAuto split: initial SM kernel share from auto_split_h2d_large_segment_bytes", 0.0, 1.0);
  t.add(p + ".auto_split_adaptive", &o.auto_split_adaptive,
        "kAuto split: tune the kernel share at run time from timed completions");
  t.add(p + ".auto_split_adaptive_gain", &o.auto_split_adaptive_gain,
        "kAuto split: step toward the balanced share per timed copy (0..1]");
  t.add(p + ".auto_split_adaptive_min_share", &o.auto_split_adaptive_min_share,
        "kAuto split: lowest tuned kernel share (keeps the kernel part measurable)");
  t.add(p + ".auto_split_adaptive_max_share", &o.auto_split_adaptive_max_share,
        "kAuto split: highest tuned kernel share");
  t.add(p + ".auto_split_payload_bytes_per_dma_descriptor", &o.auto_split_payload_bytes_per_dma_descriptor,
        "kAuto split: at most one DMA descriptor per this many payload bytes (CPU budget; 0: no cap)");
  t.add(p + ".auto_split_min_request_bytes", &o.auto_split_min_request_bytes,
        "kAuto: split only requests of at least this many payload bytes");
  t.add(p + ".auto_split_cpu_budget_adaptive", &o.auto_split_cpu_budget_adaptive,
        "kAuto split: move the CPU-budget cap with whether the CPU kept ahead of the GPU");
  t.add(p + ".auto_split_min_payload_bytes_per_dma_descriptor", &o.auto_split_min_payload_bytes_per_dma_descriptor,
        "kAuto split: smallest adaptive CPU-budget cap (most DMA descriptors)");
  t.add(p + ".auto_split_max_payload_bytes_per_dma_descriptor", &o.auto_split_max_payload_bytes_per_dma_descriptor,
        "kAuto split: largest adaptive CPU-budget cap (fewest DMA descriptors)");
  t.add(p + ".auto_split_only_behind_queued_work", &o.auto_split_only_behind_queued_work,
        "kAuto split only when the caller's stream has work queued at copy()");
  t.add(p + ".auto_idle_kernel_max_segment_bytes", &o.auto_idle_kernel_max_segment_bytes,
        "kAuto: from an idle caller stream, the SM kernel below this average segment size (0: off)");
  t.add(p + ".auto_split_duplex_min_segment_bytes", &o.auto_split_duplex_min_segment_bytes,
        "kAuto: in full duplex, split from this average segment size");
  t.add(p + ".auto_split_duplex_max_segment_bytes", &o.auto_split_duplex_max_segment_bytes,
        "kAuto: ... below this one (0: never)");
  t.add(p + ".staged_slot_bytes", &o.staged_slot_bytes, "staged DMA: device staging slot size");
  t.add(p + ".staged_slots", &o.staged_slots, "staged DMA: staging slots per stream", 1, copy_detail::kMaxStagedSlots);
  t.add(p + ".staged_max_span_ratio", &o.staged_max_span_ratio,
        "kAuto: staged DMA only when staged bytes <= ratio x payload");
  t.add(p + ".staged_min_host_run_bytes", &o.staged_min_host_run_bytes,
        "kAuto: staged DMA only when host runs average at least this");
}

}  // namespace kvtier
