// CopyEngine: batched block copies between two BlockSpaces (GPU->host,
// host->GPU, GPU->GPU, host->host) for one layer, some layers or all layers,
// every role or a subset of roles, on a stream the caller gives.
//
// A request is a list of (src block, dst block) pairs. Every selected
// (layer, role) plane copies block_bytes from src block i to dst block i.
// Both spaces must have the same KvLayout (fingerprint).
//
// Strategies:
//   kDmaPerRun  one memcpy_async (cudaMemcpyAsync) per segment: pairs whose
//               blocks are adjacent on both sides (ids consecutive and the
//               plane stride equal to block_bytes on both sides) are merged
//               into one contiguous segment first; segments that happen to be
//               adjacent in memory across planes (page-first on both sides)
//               are merged too.
//   kDmaBatch   cudaMemcpyBatchAsync over the merged segments, in chunks of
//               at most batch_max_descriptors. Host->GPU batches that contain
//               a segment <= batch_gate_max_segment_bytes are submitted
//               behind a gate (a spin kernel holding the stream busy until the
//               whole batch is queued) to avoid the driver's idle-stream cliff
//               (device/cuda/gpu_gate.h). srcAccessOrder is Stream
//               (never Any: unsafe for D2H of freshly written KV).
//   kSmKernel   a gather/scatter kernel with a small, configurable number of
//               CTAs, reading/writing pinned host memory through UVA with
//               16-byte accesses when both pointers allow it (8/4/1-byte
//               otherwise; tails are copied exactly). Needs device memory on at
//               least one side. Work decomposition: copy/kernel_plan.h.
//   kStagedDma  host<->device only. PCIe traffic by the copy engines as a few
//               large contiguous DMAs through a per-stream device staging
//               buffer; the scatter/gather between the staging buffer and the
//               scattered device blocks is the SM kernel run device-to-device
//               (HBM-bound). Pays off when the HOST blocks form long
//               contiguous runs while the device blocks are scattered. Details
//               and contract: "Staged DMA" below.
//   kSplit      host<->device only. One request split across concurrent
//               mechanisms: the first split_kernel_share of the pairs by the
//               SM kernel on the caller's stream, the rest cut into
//               split_dma_lanes equal parts, each a batched DMA on its own
//               engine-owned lane stream (so several copy engines work on one
//               request). The lanes wait for the work already on the caller's
//               stream (a fork event) and the caller's stream waits for every
//               lane at the end (join events), on every path out of copy(),
//               so the usual stream contract holds. Resources per caller
//               stream, created on first split use: split_dma_lanes streams
//               and split_dma_lanes + 1 events.
//   kAuto       chosen per call by choose(), rule below.
// On the host backend each strategy runs its own code path on the stream's
// worker (per-run: one memcpy_async per segment; batch: one task copying
// every segment; kernel: one task executing the kernel's exact work
// decomposition), so every strategy is tested without a GPU.
//
// kAuto rule (thresholds are CopyEngineOptions; defaults measured on the H200,
// docs/performance.md):
//   let avg = payload bytes / merged segments, dir = the request's direction.
//   1. segments <= auto_per_run_max_segments or avg >= auto_per_run_min_segment_bytes
//        -> kDmaPerRun (a few large copies: one DMA each is at the ceiling).
//   2. dir == D2D -> kSmKernel (HBM-bound, no PCIe; one launch beats many DMAs).
//   3. dir == H2H -> kDmaBatch.
//   4. full duplex (CopyRequest::full_duplex, or the engine has work of the
//      opposite PCIe direction in flight) and avg >= auto_duplex_dma_min_segment_bytes -> kDmaBatch:
//      measured at 32 KiB: batched DMA 79 GB/s aggregate on random blocks and
//      100 GB/s with contiguous host runs, SM kernels both ways 73-77, staged
//      both ways only ~55. Below 32 KiB batch submission is CPU-bound
//      (~0.5-1 us per descriptor) and kernels win even in full duplex.
//   4s. (before 4 and 5) dir is H2D or D2H, avg < auto_kernel_max_segment_bytes
//      of that direction, the host side is dense -- average merged host range
//      (host ids consecutive, planes adjacent in host memory) >=
//      staged_min_host_run_bytes -- and the staged chunk plan's total staging
//      footprint <= staged_max_span_ratio x payload -> kStagedDma (copy
//      engines at the ~99% large-DMA ceiling instead of the kernel's ~92%), never
//      in full duplex (staged both ways measured ~55 GB/s aggregate). Random host ids never pass the
//      host-run test.
//   4x. (after 4s, before 4 and 5) avg in [auto_split_h2d_min_segment_bytes,
//      auto_split_h2d_max_segment_bytes) for H2D not in full duplex, or in
//      the auto_split_duplex_* range for either direction in full duplex ->
//      kSplit with the kAuto share: the profile (auto_split_h2d_kernel_share_small
//      / _share / _share_large by average segment size), then tuned at run
//      time from timed completions (auto_split_adaptive), then raised to the
//      CPU-budget floor (auto_split_payload_bytes_per_dma_descriptor).
//      With the SMs kept out (auto_kernel_max_segment_bytes_h2d = 0) the H2D
//      split range starts at auto_split_h2d_large_segment_bytes, DMA only.
//      Measured on the H200 (docs/performance.md): random 4-48 KiB
//      H2D 92-96% with a kernel share, where the kernel alone is ~92% and
//      DMA alone 73-99% depending on the machine.
//   4i. (before 5) the caller's stream idle at copy(), not full duplex, SMs
//      allowed for that direction, avg < auto_idle_kernel_max_segment_bytes
//      -> kSmKernel (the GPU would wait for the CPU to enqueue descriptors).
//   5. D2H: avg < auto_kernel_max_segment_bytes_d2h -> kSmKernel, else kDmaBatch.
//      H2D: avg < auto_kernel_max_segment_bytes_h2d -> kSmKernel, else kDmaBatch
//      (gated when a segment is <= batch_gate_max_segment_bytes). Measured:
//      the kernel reaches ~92% (H2D) / ~94.5% (D2H) of the ceiling at every
//      size; batched DMA, once its submission runs ahead of the GPU, 76% / 84%
//      at 32 KiB, 99.6% / 92.4% at 64 KiB, 96% / 98.5% at 256 KiB, 99.5% at
//      1 MiB (docs/performance.md).
//   Set an auto_kernel_max_* threshold to 0 to keep the SMs out of kAuto.
//   "In flight" = an event the engine recorded after its last copy of that
//   direction on any stream has not completed (queried, never waited).
//
// Staged DMA (kStagedDma). The pairs are cut, in request order, into chunks.
// A chunk's host side is the union over selected planes p of
// [base_p + min_id * stride_p, base_p + max_id * stride_p + block_bytes_p)
// (min/max over the chunk's host ids), merged into disjoint intervals; the
// staging slot holds these intervals packed ("mirror": host address x of
// interval I lives at slot + S_I + (x - I.lo)), so a chunk fits when the sum
// of its interval spans (its footprint) <= staged_slot_bytes. Only the host
// bytes of the copied (pair, plane) blocks cross PCIe (merged into runs, one
// memcpy_async each); gap bytes are never written to host memory.
//   H2D chunk k (slot k % staged_slots): caller stream S waits for the kernel
//   that last read the slot, DMAs host runs -> slot, records; an engine-owned
//   auxiliary stream A (one per caller stream, high priority) waits for that,
//   then the D2D kernel scatters slot -> device blocks. At the end S waits for
//   A's last kernel.
//   D2H: A first waits for all work enqueued on S before copy(); per chunk A
//   waits for the DMA that last read the slot, the D2D kernel gathers device
//   blocks -> slot; S waits for it and DMAs slot -> host runs.
// So the usual stream contract holds: work enqueued on S after copy() (and
// events recorded there) observe the finished copy. Explicit kStagedDma runs
// for any host layout and id pattern (sparse ones just make smaller chunks,
// down to one pair); NotSupported when one pair's footprint exceeds
// staged_slot_bytes (e.g. a huge page-first host page) or for H2H / D2D.
// Resources per caller stream, created on first staged use: A, staged_slots x
// staged_slot_bytes of device memory and 2 x staged_slots + 1 events. The
// kernel descriptors (every chunk's plane table + the pairs) take one slot of
// the descriptor ring per max_pairs_per_call pairs, uploaded on A. Nothing is
// allocated per call afterwards.
//
// Validation happens before anything is enqueued: non-null spaces, same
// layout fingerprint, equal list lengths, ids in [0, num_blocks), no duplicate
// destination block, no block both read and written when src and dst are the
// same space, layers in range and not repeated, a role mask selecting at least
// one plane, device spaces on the engine's device, a strategy the memory
// kinds support. A rejected request writes nothing. An empty request is OK and
// enqueues nothing. Requests larger than max_pairs_per_call are split into
// chunks internally (not an error).
//
// Allocation: steady state allocates nothing per call on the CUDA path. Each
// stream gets, on first use, persistent scratch (plan vectors, batch
// descriptor arrays), a gate flag and a ring of `descriptor_slots` kernel
// descriptor slots (pinned staging + device buffer, grown on demand up to
// max_pairs_per_call pairs). A slot is reused only after the event recorded
// behind its kernel completed; when the ring wraps onto a pending slot, copy()
// blocks in Device::synchronize(event) (cudaEventSynchronize) until it is free
// -- raise descriptor_slots to make that rarer. The host backend's batch
// strategy copies the segment list into its task (one allocation per call; the
// simulator is not a hot path).
//
// Thread-safety: copy(), validate() and choose() may be called concurrently
// from several threads. Calls on the same stream are serialised internally
// (in the order they take the stream's lock). The BlockSpaces' memory must
// stay valid until the copy completed on the stream (the caller owns
// ordering: record an event after copy()).
//
// Lifetime: per-stream resources live until forget_stream() or the engine's
// destruction. The destructor waits for the last work the engine enqueued on
// each stream it knows (its own events), then frees the slots: destroy the
// engine only after its streams are drained or while they are still alive;
// the engine must outlive every copy still in flight that uses its slots.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "kvtier/backend/device.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier {

enum class CopyStrategy : std::uint8_t { kAuto, kDmaPerRun, kDmaBatch, kSmKernel, kStagedDma, kSplit };
inline constexpr int kNumCopyStrategies = 6;
// "auto", "dma_per_run", "dma_batch", "sm_kernel", "staged_dma", "split".
std::string_view copy_strategy_name(CopyStrategy s) noexcept;
Result<CopyStrategy> parse_copy_strategy(std::string_view name);

enum class CopyDirection : std::uint8_t { kDeviceToHost, kHostToDevice, kDeviceToDevice, kHostToHost };
inline constexpr int kNumCopyDirections = 4;
// "d2h", "h2d", "d2d", "h2h".
std::string_view copy_direction_name(CopyDirection d) noexcept;
CopyDirection copy_direction(MemoryKind src, MemoryKind dst) noexcept;

struct CopyEngineOptions {
  // SM kernel shape. Host->GPU needs more outstanding reads than GPU->host
  // (measured on an H200, copy mechanisms probe in docs/performance.md: H2D
  // ~16 CTAs x 512 or 4 x 1024; D2H ~4 CTAs). D2D uses sm_ctas_d2d.
  std::uint32_t sm_ctas_h2d = 16;
  std::uint32_t sm_ctas_d2h = 8;
  std::uint32_t sm_ctas_d2d = 32;
  std::uint32_t sm_threads_per_cta = 512;  // multiple of 32, <= 1024
  // Bytes of one kernel work item: each (pair, plane) is split into items of
  // at most this size so that a few large blocks still spread over all warps.
  // Multiple of 16. A request too small to give every warp of the launch an
  // item of this size is cut finer (payload / warps, at least 2 KiB).
  std::uint32_t sm_item_bytes = 64 * 1024;
  // Copies that read back what they wrote (CopyRequest::landed_checksums): CTAs per launch, 0 for one per SM
  // (the read-back doubles the checksum arithmetic, which bounds such a copy with few CTAs: on an H200 it moved
  // 0.47-0.53 of a plain gather's bytes at 32 CTAs, 0.85-0.90 at 132), and the largest work item (each warp keeps
  // one item's lines in L2 until it reads them back). Measured on an H200 with the kernel that reads back beside
  // the copy (docs/performance.md, "Work items of 8 KiB"), 8 layers of 64 MiB of scattered 1 MiB blocks at one
  // CTA per SM: 2 / 4 / 8 / 12 / 16 KiB items moved 0.57-0.58 / 0.79-0.83 / 0.90-0.96 / 0.85-0.87 / 0.80-0.81
  // of a plain gather with as many CTAs; with 16 KiB blocks 4 and 8 KiB items moved the same (1,597-1,654 GB/s).
  // On the host backend the landed pass follows the launch's copy as a second task.
  std::uint32_t sm_ctas_landed = 0;
  std::uint32_t sm_landed_item_bytes = 8 * 1024;
  // true: descriptors (pair list + plane table) are uploaded to device memory
  // with one memcpy_async before the kernel, so the kernel's descriptor reads
  // never compete with its payload reads for PCIe requests. false: the kernel
  // reads them from the mapped pinned staging through UVA (no extra DMA).
  bool sm_descriptors_in_device_memory = true;
  // Kernel launches of at most this many pairs (and at most 8 selected
  // planes) carry their descriptors inside the kernel parameters instead:
  // no descriptor upload on the stream (whose latency sits between two
  // back-to-back kernels: measured as the gap that held a stream of 1 MiB
  // requests of 4 KiB blocks to ~0.55 of the ceiling), no slot, no event.
  // 0 disables; at most 3072 (the parameter-size limit). Requests with more
  // pairs use the descriptor ring.
  std::uint32_t sm_inline_descriptor_max_pairs = 3072;
  // SM kernels are launched with programmatic dependent launch (sm_90+): the
  // next kernel's launch and start-up overlap the end of the one before it on
  // the stream, and each CTA waits for that kernel's completion before it
  // touches memory, so stream order holds. Earlier GPUs ignore it.
  bool sm_programmatic_launch = true;
  // Descriptor ring per stream: slots x capacity (pairs per kernel launch).
  // Requests with more pairs are split into several launches.
  std::uint32_t descriptor_slots = 8;
  std::uint32_t max_pairs_per_call = 1u << 18;
  // At most this many segments per cudaMemcpyBatchAsync call (the driver
  // accepts a bounded number of pending copies per stream).
  std::uint32_t batch_max_descriptors = 2048;
  // Host->GPU batches with a segment at or below this size are submitted gated.
  std::uint64_t batch_gate_max_segment_bytes = 28 * 1024;
  // Gate every host->GPU batch regardless of segment size (tuning knob).
  bool batch_gate_always = false;
  // kAuto thresholds (see the rule in the file comment).
  std::uint64_t auto_per_run_min_segment_bytes = 2u << 20;
  std::uint32_t auto_per_run_max_segments = 2;
  // Measured (pre-queued): batched DMA 99.6% at 64 KiB H2D, 92.4% at 64 KiB
  // D2H and 98.5% at 256 KiB; the SM kernel ~92% H2D / ~94.5% D2H.
  std::uint64_t auto_kernel_max_segment_bytes_h2d = 64 * 1024;
  std::uint64_t auto_kernel_max_segment_bytes_d2h = 128 * 1024;
  // Measured on an H200 (`kvtier bench copy --directions both`): batched DMA
  // both ways 86.0 GB/s at 24 KiB, 84.4 at 28 KiB, 85.5 at 32 KiB vs SM
  // kernels both ways 73; kernels win at 16 KiB.
  std::uint64_t auto_duplex_dma_min_segment_bytes = 24 * 1024;
  // kStagedDma: device staging per caller stream (staged_slots slots of
  // staged_slot_bytes; a chunk's footprint must fit one slot). More slots let
  // more DMAs queue ahead of the D2D kernels.
  std::uint64_t staged_slot_bytes = 32u << 20;
  std::uint32_t staged_slots = 3;
  // kAuto rule 4s: host density thresholds (footprint / payload, >= 1.0) and
  // the smallest average merged host range.
  double staged_max_span_ratio = 1.25;
  std::uint64_t staged_min_host_run_bytes = 256 * 1024;
  // kSplit: share of the pairs copied by the SM kernel (0..1; the rest by
  // batched DMA), and how many lane streams share the DMA part (>= 1).
  double split_kernel_share = 0.0;
  std::uint32_t split_dma_lanes = 2;
  // kAuto: H2D requests whose average segment is in [min, max) use kSplit
  // when not in full duplex (max 0: never); likewise in full duplex. The
  // kernel share kAuto starts from: auto_split_h2d_kernel_share_small below
  // auto_split_h2d_small_segment_bytes, auto_split_h2d_kernel_share below
  // auto_split_h2d_large_segment_bytes, auto_split_h2d_kernel_share_large
  // from there (none when auto_kernel_max_segment_bytes_h2d is 0: SMs kept
  // out). One DMA lane below the large size, split_dma_lanes from it. With
  // auto_split_adaptive the share then follows the measured rates (below).
  // Measured on the H200 (docs/performance.md): random 4-20 KiB
  // H2D 92-96% with these shares vs ~92% for the kernel alone. At 32-48 KiB
  // DMA alone reached 95-99% on some machines and 73-81% on others (small
  // descriptors slow), where a kernel share of 0.6 gave 94-95%.
  std::uint64_t auto_split_h2d_min_segment_bytes = 4 * 1024;
  std::uint64_t auto_split_h2d_max_segment_bytes = 64 * 1024;
  double auto_split_h2d_kernel_share = 0.6;
  double auto_split_h2d_kernel_share_small = 0.8;
  double auto_split_h2d_kernel_share_large = 0.5;
  std::uint64_t auto_split_h2d_small_segment_bytes = 12 * 1024;
  std::uint64_t auto_split_h2d_large_segment_bytes = 24 * 1024;
  // kAuto split, adaptive share. The best share depends on the machine (how
  // fast its copy engines take small descriptors) and drifts with load, so a
  // fixed profile either leaves bandwidth unused or falls off a cliff when
  // the DMA part finishes late. With auto_split_adaptive, every kAuto split
  // is timed (timing events at the fork, after the kernel part and after each
  // lane; read at later copies, never waited for) and the share of its size
  // class (direction, half-octave of the average segment) moves toward the
  // share that would have made both parts finish together:
  //   s* = r_k / (r_k + r_d), r = bytes / time of each part,
  //   s <- s + gain * (s* - s), clamped to [min_share, max_share];
  // its fixed point is both parts finishing at once. The CPU-budget cap
  // below still applies on top. Engine-wide (all streams share what was
  // learned); a few timing slots per stream, so a copy whose predecessors
  // have not completed yet simply goes untimed.
  bool auto_split_adaptive = true;
  double auto_split_adaptive_gain = 0.5;
  double auto_split_adaptive_min_share = 0.05;
  double auto_split_adaptive_max_share = 0.95;
  // kAuto split, CPU budget: the DMA part gets at most one descriptor per
  // this many payload bytes of the request (the rest goes to the kernel).
  // Enqueueing a descriptor costs ~0.8-0.9 us of CPU on the H200's host
  // (cudaMemcpyBatchAsync, any attributes, batch size; more threads scale
  // poorly: h2d_probe part C, docs/performance.md), about the time the link
  // needs for 45-50 KB, so 48 KiB keeps the submission within the copy time.
  // 0: no cap.
  std::uint64_t auto_split_payload_bytes_per_dma_descriptor = 48 * 1024;
  // With auto_split_cpu_budget_adaptive the cap above is only the starting
  // point of each size class: after each kAuto split the engine checks
  // whether the GPU already reached the split's fork when the last lane was
  // enqueued (the GPU waited for the CPU: fewer descriptors next time, cap x
  // 1.25) or not (the CPU ran ahead: more, cap / 1.25), within
  // [auto_split_min_payload_bytes_per_dma_descriptor,
  //  auto_split_max_payload_bytes_per_dma_descriptor]. A copy behind enough
  // queued work (a load behind the forward pass) thus gets more DMA, a stream
  // of back-to-back copies no more than the CPU can keep up with. A late
  // split also pauses the split of its size class for the next 8 kAuto copies
  // (the SM kernel alone runs them), then one split probes again.
  bool auto_split_cpu_budget_adaptive = true;
  // kAuto splits only requests of at least this many payload bytes: the fork,
  // the join and the lanes' start cost a fixed few tens of microseconds,
  // which small requests cannot amortise (measured on an H200, back-to-back
  // 8 MiB requests of 16 KiB blocks: split 75% vs kernel 85%; with 32 KiB
  // blocks the split still won at 8 and 32 MiB; docs/performance.md).
  std::uint64_t auto_split_min_request_bytes = 16u << 20;
  // 12 KiB lets 4 KiB blocks reach their balanced share (~0.67 with one
  // lane): 0.940-0.945 vs 0.933-0.934 with a 16 KiB floor, for ~25% more
  // submission CPU while the CPU runs ahead (measured on an H200: the samples
  // table of docs/performance.md).
  std::uint64_t auto_split_min_payload_bytes_per_dma_descriptor = 12 * 1024;
  std::uint64_t auto_split_max_payload_bytes_per_dma_descriptor = 256 * 1024;
  // kAuto uses kSplit only when the caller's stream still has work queued at
  // copy() (the CPU then enqueues the DMA part while the GPU is busy); on an
  // idle stream the GPU would wait for that CPU work, and the kernel wins.
  // choose() (no stream) assumes queued work.
  bool auto_split_only_behind_queued_work = true;
  // kAuto: when the caller's stream is idle at copy() (nothing queued, so the
  // GPU would wait for the CPU to enqueue DMA descriptors) and not in full
  // duplex, H2D/D2H requests averaging below this use the SM kernel instead
  // of batched DMA (0: off; engines with SMs kept out: never). choose()
  // assumes queued work.
  std::uint64_t auto_idle_kernel_max_segment_bytes = 512 * 1024;
  std::uint64_t auto_split_duplex_min_segment_bytes = 0;
  std::uint64_t auto_split_duplex_max_segment_bytes = 0;
  // Reserved: the caller's stream priority decides today (a high-priority
  // copy stream halves interference with compute; create it so).
  bool high_priority_kernels = true;
};

struct CopyRequest {
  const BlockSpace* src = nullptr;
  const BlockSpace* dst = nullptr;
  std::span<const BlockId> src_blocks;
  std::span<const BlockId> dst_blocks;
  std::span<const std::uint32_t> layers;  // empty: every layer
  RoleMask roles = kAllRoles;             // by Role bit
  CopyStrategy strategy = CopyStrategy::kAuto;
  // kAuto hint: the caller is about to run copies of the opposite PCIe
  // direction at the same time (e.g. evictions and loads of one step). The
  // engine also detects its own in-flight work, but only once it is enqueued.
  bool full_duplex = false;
  // Optional: the block checksum (block_checksum() below) of every pair's
  // selected planes, computed by the copy itself: the SM kernel folds each
  // 16-byte word it moves into its pair's sum, so the bytes are read once.
  // src_blocks.size() entries of memory the device writes (device memory;
  // the host backend's RAM), zeroed by the engine on the stream first and
  // final when the copy has completed. Runs the kSmKernel strategy (kAuto
  // picks it; other strategies are refused) and needs every selected block
  // at a 16-byte aligned address on both sides with a size that is a multiple
  // of 16 (InvalidArgument naming the plane otherwise).
  std::uint64_t* checksums = nullptr;
  // Optional, with `checksums`: the same checksum of every pair's destination as read back after the copy wrote
  // it, by the same kernel: each warp reads back the work item it copied before while it copies the next one (its
  // stores have reached L2 by then and its lines are still there; with CTAs of more than 512 threads, after it
  // has stored the next one), and its last item at the end. Equal to
  // `checksums` unless a write to the destination was lost or the destination changed between the store and the
  // read-back. Same memory rules as `checksums`. The read-back doubles the checksum arithmetic, so these copies
  // run CopyEngineOptions::sm_ctas_landed CTAs in items of at most sm_landed_item_bytes.
  std::uint64_t* landed_checksums = nullptr;
};

// The checksum of block `block` of `space` over the selected planes (layers
// in the order given, every layer when empty; roles in layout order, those
// of `roles`): the sum mod 2^64, over every 16-byte word w at byte offset o of
// the p-th selected plane, of a 64-bit mix of (w, p, o). Changing either
// 8-byte half of one word always changes it; other changes go undetected with
// probability about 2^-64. It is what CopyRequest::checksums and
// CopyEngine::checksum() compute on the device; this is the CPU reference
// (the memory must be CPU-readable). Blocks whose size is not a multiple of
// 16 fold their last partial word zero-padded. kOutOfRange for a block or a
// layer the space does not have (naming it).
Result<std::uint64_t> block_checksum(const BlockSpace& space, BlockId block, std::span<const std::uint32_t> layers = {},
                                     RoleMask roles = kAllRoles);

struct CopyReport {
  CopyStrategy strategy = CopyStrategy::kAuto;  // what actually ran
  CopyDirection direction = CopyDirection::kDeviceToHost;
  std::uint64_t bytes = 0;     // payload bytes enqueued
  std::uint64_t pairs = 0;     // block pairs
  std::uint64_t planes = 0;    // selected (layer, role) planes
  std::uint64_t segments = 0;  // contiguous segments after run merging
  std::uint32_t calls = 0;     // memcpy / batch / kernel launches issued (staged: DMAs + kernels)
  std::uint32_t chunks = 0;    // staged: pipeline chunks (0 otherwise)
  std::uint32_t ctas = 0;      // CTAs per launch of the kernel strategy (0 otherwise)
  bool gated = false;          // batch submitted on a gated stream
  double kernel_share = 0;     // split: share of the pairs the SM kernel copied
  std::uint32_t lanes = 0;     // split: DMA lane streams used
};

namespace copy_detail {
class EngineBase;
}  // namespace copy_detail

// A request that CopyEngine::prepare() checked once, then copied a part of its layers at a time without its
// block lists being checked again: a load of 32 layers posts each layer on its turn, and its ids, spaces and
// overlaps were checked when it was submitted. It keeps the request's pointers and spans: the spaces, the block
// lists and the layer list must stay alive and unchanged while it is used. It belongs to the engine that prepared
// it (another engine refuses it). Cheap to copy.
class PreparedCopy {
 public:
  PreparedCopy() = default;
  const CopyRequest& request() const noexcept { return request_; }

 private:
  friend class copy_detail::EngineBase;
  CopyRequest request_;
  const void* engine_ = nullptr;
};

// Checks `options` as CopyEngine::create() does, without a device (InvalidArgument naming the bad field and value):
// for settings read from a command line or a config file before any engine exists.
Status check_copy_engine_options(const CopyEngineOptions& options);

class CopyEngine {
 public:
  // The engine of the device's backend, which the device offers as an
  // extension (kvtier/backend/copy_backend.h): the host backend's executors on
  // a HostDevice, the CUDA executors on a CUDA device. NotSupported for a
  // device that offers none.
  static Result<std::unique_ptr<CopyEngine>> create(Device& device, const CopyEngineOptions& options = {});
  virtual ~CopyEngine() = default;

  // Checks a request without enqueuing anything.
  virtual Status validate(const CopyRequest& request) const = 0;
  // Validates, then enqueues the copy on `stream` (a stream of device()).
  // Returns once enqueued; never waits for the copy (it may wait for one of
  // its own descriptor slots, see the file comment).
  virtual Result<CopyReport> copy(const CopyRequest& request, Stream& stream) = 0;
  // Validates `request` as validate() does and returns it prepared for copy(prepared, ...). Its `checksums` and
  // `landed_checksums` are not kept: each copy of the prepared request names its own.
  virtual Result<PreparedCopy> prepare(const CopyRequest& request) const = 0;
  // Enqueues the copy of `layers` of a prepared request (empty: all of the request's layers), as copy() would
  // with the request's layer list replaced by `layers` and its checksums by `checksums` and `landed_checksums`
  // (nullptr: none; landed ones need `checksums`). Only the
  // layer list is checked: each in range, none twice, each one of the request's layers (any layer when the request
  // selected every layer), and at least one plane selected; the block lists are not checked again.
  virtual Result<CopyReport> copy(const PreparedCopy& prepared, std::span<const std::uint32_t> layers, Stream& stream,
                                  std::uint64_t* checksums = nullptr, std::uint64_t* landed_checksums = nullptr) = 0;
  // The strategy kAuto would pick for this request now (the request must be
  // valid; an invalid one gets kDmaPerRun).
  virtual CopyStrategy choose(const CopyRequest& request) const = 0;
  // Enqueues on `stream` the block checksums (block_checksum()) of `blocks`
  // of `space` over the selected planes into `out` (blocks.size() entries of
  // device-writable memory, zeroed first), reading the blocks once with the
  // SM kernel and writing nothing else. Same alignment rule as
  // CopyRequest::checksums; ids must be in range (repeats are allowed).
  virtual Result<CopyReport> checksum(const BlockSpace& space, std::span<const BlockId> blocks,
                                      std::span<const std::uint32_t> layers, RoleMask roles, std::uint64_t* out,
                                      Stream& stream) = 0;
  // Waits for the engine's last work on `stream`, then frees that stream's
  // resources. Call before destroying a stream the engine has seen when the
  // engine lives on (optional: otherwise they are freed with the engine).
  // Must not race with copy() on the same stream.
  virtual Status forget_stream(Stream& stream) = 0;
  virtual const CopyEngineOptions& options() const noexcept = 0;
  virtual Device& device() const noexcept = 0;
};

}  // namespace kvtier
