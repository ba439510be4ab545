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

struct PlanScratch {
  std::vector<SelectedPlane> planes;
  std::vector<Run> runs;
  std::vector<Segment> segments;
  std::vector<KernelPlane> kernel_planes;
};

struct PlanSummary {
  CopyDirection direction = CopyDirection::kDeviceToHost;
  std::uint64_t pairs = 0;
  std::uint64_t planes = 0;
  std::uint64_t bytes = 0;
  // Without cross-plane merging (an upper bound of the real count).
  std::uint64_t segments = 0;
  std::uint64_t min_segment_bytes = 0;
  std::uint64_t average_segment_bytes() const noexcept { return segments == 0 ? 0 : bytes / segments; }
};

// Full validation (see copy_engine.h). `device_ordinal`: device spaces must be
// on it. Uses thread-local scratch bitmaps (no allocation in steady state).
Status validate_request(const CopyRequest& request, int device_ordinal);

// Selected planes in (layer, role) order. Precondition: a valid request.
void select_planes(const CopyRequest& request, std::vector<SelectedPlane>& out);
// Runs of consecutive ids on both sides.
void find_runs(std::span<const std::int32_t> src, std::span<const std::int32_t> dst, std::vector<Run>& out);
PlanSummary summarize(const CopyRequest& request, std::span<const SelectedPlane> planes, std::span<const Run> runs);
// Materialises the merged segments. Returns the smallest segment size (0 when none).
std::uint64_t build_segments(const CopyRequest& request, std::span<const SelectedPlane> planes,
                             std::span<const Run> runs, std::vector<Segment>& out);

}  // namespace kvtier::copy_detail
