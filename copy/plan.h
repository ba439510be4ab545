// Request validation and copy planning, shared by every backend.
//
// Planning turns (pairs x selected planes) into contiguous segments:
//   1. runs: maximal stretches of pairs i..j where src[k+1] = src[k] + 1 and
//      dst[k+1] = dst[k] + 1 (computed once per request);
//   2. per plane, a run becomes one segment when stride == block_bytes on both
//      sides, else one segment per pair;
//   3. consecutive segments that are adjacent on both sides are merged (this
//      joins planes when they are contiguous in memory, e.g. page-first on
//      both sides, where segments are emitted pair-major).
// All vectors live in a PlanScratch owned by the caller (one per stream), so
// the steady state allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "copy/kernel_plan.h"
#include "kvtier/copy/copy_engine.h"

namespace kvtier::copy_detail {

struct SelectedPlane {
  std::uint32_t layer = 0;
  std::uint32_t role = 0;
  const std::byte* src_base = nullptr;
  std::uint64_t src_stride = 0;
  std::byte* dst_base = nullptr;
  std::uint64_t dst_stride = 0;
  std::uint64_t block_bytes = 0;
  bool mergeable() const noexcept { return src_stride == block_bytes && dst_stride == block_bytes; }
};

struct Segment {
  std::byte* dst;
  const std::byte* src;
  std::uint64_t bytes;
};

struct Run {
  std::uint32_t first;  // index into the pair lists
  std::uint32_t count;
};

// ------------------------------------------------------------ staged DMA
// Planning of kStagedDma (copy_engine.h, "Staged DMA"). "Host side" is src
// for H2D and dst for D2H.

// A disjoint host interval [lo, hi) of one chunk, mirrored at slot + offset.
struct StagedInterval {
  std::uint64_t lo;
  std::uint64_t hi;
  std::uint64_t offset;
};

struct StagedChunk {
  std::uint32_t first;  // index into the pair lists
  std::uint32_t count;
  std::uint64_t footprint;  // staging bytes (interval spans + alignment padding)
};

// One DMA: `bytes` of host memory at `host`, mirrored at slot + `offset`.
struct HostRun {
  std::uint64_t host;
  std::uint64_t bytes;
  std::uint64_t offset;
};

struct StagedScratch {
  std::vector<std::uint32_t> order;  // selected planes sorted by host base
  std::vector<StagedChunk> chunks;
  std::vector<BlockId> prefix_min, prefix_max;
  std::vector<StagedInterval> intervals;
  std::vector<HostRun> runs;
  std::uint64_t footprint = 0;  // sum over chunks
};

// Mirrored offsets keep host address and staging address congruent modulo
// this (staging slots are at least this aligned), so the kernel's vector
// width and the DMA alignment are the same as with the host block itself.
inline constexpr std::uint64_t kStagedAlign = 64;

// Estimated number of merged host ranges of the whole request (the DMAs a
// staged copy would issue, ignoring chunk boundaries): host-id runs times the
// planes, or just the host-id runs when the selected planes tile each host
// page (page-first, every plane selected).
std::uint64_t estimate_host_ranges(std::span<const SelectedPlane> planes, std::span<const BlockId> host_ids,
                                   bool host_is_src);
// Cuts the pairs into chunks (greedy, in order, each as large as fits in
// `slot_bytes` and has at most `max_pairs` pairs); fills sc.order, sc.chunks,
// sc.footprint. NotSupported when a single pair does not fit.
Status plan_staged_chunks(std::span<const SelectedPlane> planes, std::span<const BlockId> host_ids, bool host_is_src,
                          std::uint64_t slot_bytes, std::uint32_t max_pairs, StagedScratch& sc);
// The merged host intervals (with packed offsets) of a chunk whose host ids
// span [min_id, max_id], into sc.intervals; returns the footprint. Needs sc.order.
std::uint64_t staged_intervals(std::span<const SelectedPlane> planes, bool host_is_src, BlockId min_id, BlockId max_id,
                               StagedScratch& sc);
// The merged host ranges of a chunk's (pair, plane) blocks, mapped into the
// slot through sc.intervals (staged_intervals of the same chunk), into sc.runs.
void staged_host_runs(std::span<const SelectedPlane> planes, bool host_is_src, std::span<const BlockId> host_ids,
                      StagedScratch& sc);
// Offset of host address `x` (inside one of sc.intervals) in the slot.
std::uint64_t staged_offset(const StagedScratch& sc, std::uint64_t x);

struct PlanScratch {
  std::vector<SelectedPlane> planes;
  std::vector<Run> runs;
  std::vector<Segment> segments;
  std::vector<KernelPlane> kernel_planes;
  std::vector<KernelPair> kernel_pairs;  // one inline launch's pairs
  StagedScratch staged;
};

struct PlanSummary {
  CopyDirection direction = CopyDirection::kDeviceToHost;
  std::uint64_t pairs = 0;
  std::uint64_t planes = 0;
  std::uint64_t bytes = 0;
  // Without cross-plane merging (an upper bound of the real count).
  std::uint64_t segments = 0;
  std::uint64_t min_segment_bytes = 0;
  bool full_duplex_hint = false;  // CopyRequest::full_duplex
  std::uint64_t average_segment_bytes() const noexcept { return segments == 0 ? 0 : bytes / segments; }
};

// Full validation (see copy_engine.h). `device_ordinal`: device spaces must be
// on it. Uses thread-local scratch bitmaps (no allocation in steady state).
// `read_only`: the request only reads its src blocks (checksums): no
// destination checks.
// The layer list (in range, no repeats) and the role mask (at least one selected plane) of a request whose spaces
// are set: the part of validate_request that a prepared request's later layer subsets still need.
Status validate_layers(const CopyRequest& request);
Status validate_request(const CopyRequest& request, int device_ordinal, bool read_only = false);
// Checksummed requests: every selected plane 16-byte aligned on both sides, block sizes multiples of 16.
Status check_checksum_alignment(std::span<const SelectedPlane> planes);

// Selected planes in (layer, role) order. Precondition: a valid request.
void select_planes(const CopyRequest& request, std::vector<SelectedPlane>& out);
// Runs of consecutive ids on both sides.
void find_runs(std::span<const BlockId> src, std::span<const BlockId> dst, std::vector<Run>& out);
PlanSummary summarize(const CopyRequest& request, std::span<const SelectedPlane> planes, std::span<const Run> runs);
// Materialises the merged segments. Returns the smallest segment size (0 when none).
std::uint64_t build_segments(const CopyRequest& request, std::span<const SelectedPlane> planes,
                             std::span<const Run> runs, std::vector<Segment>& out);

}  // namespace kvtier::copy_detail
