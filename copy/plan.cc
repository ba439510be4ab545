#include "copy/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace kvtier::copy_detail {
namespace {

// Bitmap over block ids, reused per thread. Users clear exactly the bits they
// set, so it stays all-zero between calls and no O(num_blocks) reset is needed.
std::vector<std::uint64_t>& thread_bitmap(std::uint64_t bits) {
  thread_local std::vector<std::uint64_t> bitmap;
  const std::size_t words = static_cast<std::size_t>((bits + 63) / 64);
  if (bitmap.size() < words) bitmap.resize(words, 0);
  return bitmap;
}

bool test_and_set(std::vector<std::uint64_t>& bm, std::uint32_t id) {
  std::uint64_t& w = bm[id >> 6];
  const std::uint64_t bit = std::uint64_t{1} << (id & 63);
  const bool was = (w & bit) != 0;
  w |= bit;
  return was;
}
bool test(const std::vector<std::uint64_t>& bm, std::uint32_t id) { return (bm[id >> 6] >> (id & 63)) & 1; }
void clear_bits(std::vector<std::uint64_t>& bm, std::span<const std::int32_t> ids, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) bm[static_cast<std::uint32_t>(ids[i]) >> 6] = 0;
}

bool layer_selected(const CopyRequest& r, std::uint32_t l) {
  if (r.layers.empty()) return true;
  return std::find(r.layers.begin(), r.layers.end(), l) != r.layers.end();
}

Status check_ids(std::span<const std::int32_t> ids, std::uint64_t num_blocks, const char* side) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (id < 0 || static_cast<std::uint64_t>(id) >= num_blocks)
      return OutOfRange(fmt::format("{} block id {} at index {} is outside [0, {})", side, id, i, num_blocks));
  }
  return Status::Ok();
}

}  // namespace

Status validate_request(const CopyRequest& r, int device_ordinal) {
  if (r.src == nullptr) return InvalidArgument("copy request has a null src BlockSpace");
  if (r.dst == nullptr) return InvalidArgument("copy request has a null dst BlockSpace");
  const KvLayout& layout = r.src->layout();
  if (layout.fingerprint() != r.dst->layout().fingerprint() || layout.num_planes() != r.dst->layout().num_planes())
    return InvalidArgument(fmt::format(
        "copy between different layouts: src fingerprint {:016x} ({}) != dst {:016x} ({})", layout.fingerprint(),
        layout.describe(), r.dst->layout().fingerprint(), r.dst->layout().describe()));
  if (r.src_blocks.size() != r.dst_blocks.size())
    return InvalidArgument(fmt::format("copy request has {} src block ids but {} dst block ids", r.src_blocks.size(),
                                       r.dst_blocks.size()));
  if (r.src_blocks.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    return InvalidArgument(fmt::format("copy request has {} pairs, more than INT32_MAX", r.src_blocks.size()));
  for (const BlockSpace* s : {r.src, r.dst})
    if (s->kind() == MemoryKind::kDevice && s->device_ordinal() != device_ordinal)
      return InvalidArgument(fmt::format("{} BlockSpace is on device {} but the copy engine drives device {}",
                                         s == r.src ? "src" : "dst", s->device_ordinal(), device_ordinal));
  const CopyDirection dir = copy_direction(r.src->kind(), r.dst->kind());
  switch (r.strategy) {
    case CopyStrategy::kSmKernel:
      if (dir == CopyDirection::kHostToHost)
        return NotSupported(
            "strategy sm_kernel needs device memory on at least one side; host->host copies use "
            "dma_per_run or dma_batch");
      break;
    case CopyStrategy::kAuto:
    case CopyStrategy::kDmaPerRun:
    case CopyStrategy::kDmaBatch: break;
  }
  if (static_cast<unsigned>(r.strategy) >= static_cast<unsigned>(kNumCopyStrategies))
    return InvalidArgument(fmt::format("invalid copy strategy value {}", static_cast<int>(r.strategy)));

  // Layers: in range, no duplicates.
  if (!r.layers.empty()) {
    auto& bm = thread_bitmap(layout.num_layers());
    Status st;
    std::size_t set = 0;
    for (; set < r.layers.size(); ++set) {
      const std::uint32_t l = r.layers[set];
      if (l >= layout.num_layers()) {
        st = OutOfRange(fmt::format("layer {} at index {} is outside [0, {})", l, set, layout.num_layers()));
        break;
      }
      if (test_and_set(bm, l)) {
        st = InvalidArgument(fmt::format("layer {} appears twice in the layer list (index {})", l, set));
        ++set;
        break;
      }
    }
    for (std::size_t i = 0; i < set && i < r.layers.size(); ++i)
      if (r.layers[i] < layout.num_layers()) bm[r.layers[i] >> 6] = 0;
    KVTIER_RETURN_IF_ERROR(st);
  }
  // Roles: at least one selected plane.
  bool any_plane = false;
  for (std::uint32_t l = 0; l < layout.num_layers() && !any_plane; ++l) {
    if (!layer_selected(r, l)) continue;
    for (const RoleLayout& role : layout.layer(l).roles)
      if (r.roles & role_bit(role.role)) {
        any_plane = true;
        break;
      }
  }
  if (!any_plane)
    return InvalidArgument(
        fmt::format("role mask {:#x} selects no (layer, role) plane of layout {}", r.roles, layout.describe()));

  if (r.src_blocks.empty()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(check_ids(r.src_blocks, r.src->num_blocks(), "src"));
  KVTIER_RETURN_IF_ERROR(check_ids(r.dst_blocks, r.dst->num_blocks(), "dst"));

  // Duplicate destinations, and (same space) blocks both read and written.
  auto& bm = thread_bitmap(r.dst->num_blocks());
  const std::size_t n = r.dst_blocks.size();
  for (std::size_t i = 0; i < n; ++i) {
    const auto id = static_cast<std::uint32_t>(r.dst_blocks[i]);
    if (test_and_set(bm, id)) {
      clear_bits(bm, r.dst_blocks, i);
      std::size_t first = 0;
      while (r.dst_blocks[first] != r.dst_blocks[i]) ++first;
      return InvalidArgument(
          fmt::format("duplicate destination block id {} at index {} (first at index {})", id, i, first));
    }
  }
  Status st;
  const bool same_space = r.src == r.dst || r.src->plane(0, 0).base == r.dst->plane(0, 0).base;
  if (same_space)
    for (std::size_t i = 0; i < n; ++i) {
      const auto id = static_cast<std::uint32_t>(r.src_blocks[i]);
      if (test(bm, id)) {
        st = InvalidArgument(fmt::format(
            "src block id {} at index {} is also a destination in the same BlockSpace (overlapping copy)", id, i));
        break;
      }
    }
  clear_bits(bm, r.dst_blocks, n);
  return st;
}

void select_planes(const CopyRequest& r, std::vector<SelectedPlane>& out) {
  out.clear();
  const KvLayout& layout = r.src->layout();
  auto add_layer = [&](std::uint32_t l) {
    for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro) {
      if (!(r.roles & role_bit(layout.layer(l).roles[ro].role))) continue;
      const Plane& s = r.src->plane(l, ro);
      const Plane& d = r.dst->plane(l, ro);
      out.push_back({l, ro, s.base, s.stride, d.base, d.stride, layout.block_bytes(l, ro)});
    }
  };
  if (r.layers.empty())
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) add_layer(l);
  else
    for (std::uint32_t l : r.layers) add_layer(l);
}

void find_runs(std::span<const std::int32_t> src, std::span<const std::int32_t> dst, std::vector<Run>& out) {
  out.clear();
  const std::size_t n = src.size();
  std::size_t i = 0;
  while (i < n) {
    std::size_t j = i + 1;
    while (j < n && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1) ++j;
    out.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(j - i)});
    i = j;
  }
}

PlanSummary summarize(const CopyRequest& r, std::span<const SelectedPlane> planes, std::span<const Run> runs) {
  PlanSummary s;
  s.direction = copy_direction(r.src->kind(), r.dst->kind());
  s.pairs = r.src_blocks.size();
  s.planes = planes.size();
  if (s.pairs == 0) return s;
  std::uint32_t min_run = UINT32_MAX;
  for (const Run& run : runs) min_run = std::min(min_run, run.count);
  s.min_segment_bytes = UINT64_MAX;
  for (const SelectedPlane& p : planes) {
    s.bytes += p.block_bytes * s.pairs;
    if (p.mergeable()) {
      s.segments += runs.size();
      s.min_segment_bytes = std::min(s.min_segment_bytes, p.block_bytes * min_run);
    } else {
      s.segments += s.pairs;
      s.min_segment_bytes = std::min(s.min_segment_bytes, p.block_bytes);
    }
  }
  return s;
}

std::uint64_t build_segments(const CopyRequest& r, std::span<const SelectedPlane> planes, std::span<const Run> runs,
                             std::vector<Segment>& out) {
  out.clear();
  auto emit = [&out](std::byte* dst, const std::byte* src, std::uint64_t bytes) {
    if (!out.empty()) {
      Segment& last = out.back();
      if (last.dst + last.bytes == dst && last.src + last.bytes == src) {
        last.bytes += bytes;
        return;
      }
    }
    out.push_back({dst, src, bytes});
  };
  bool any_mergeable = false;
  for (const SelectedPlane& p : planes) any_mergeable |= p.mergeable();
  if (any_mergeable) {
    // Plane-major: runs become single segments inside each plane.
    for (const SelectedPlane& p : planes)
      for (const Run& run : runs) {
        const auto s0 = static_cast<std::uint64_t>(r.src_blocks[run.first]);
        const auto d0 = static_cast<std::uint64_t>(r.dst_blocks[run.first]);
        if (p.mergeable()) {
          emit(p.dst_base + d0 * p.dst_stride, p.src_base + s0 * p.src_stride, p.block_bytes * run.count);
        } else {
          for (std::uint32_t k = 0; k < run.count; ++k)
            emit(p.dst_base + (d0 + k) * p.dst_stride, p.src_base + (s0 + k) * p.src_stride, p.block_bytes);
        }
      }
  } else {
    // Pair-major: a block's planes are adjacent when both sides are page-first.
    const std::size_t n = r.src_blocks.size();
    for (std::size_t i = 0; i < n; ++i) {
      const auto s = static_cast<std::uint64_t>(r.src_blocks[i]);
      const auto d = static_cast<std::uint64_t>(r.dst_blocks[i]);
      for (const SelectedPlane& p : planes)
        emit(p.dst_base + d * p.dst_stride, p.src_base + s * p.src_stride, p.block_bytes);
    }
  }
  std::uint64_t min_bytes = out.empty() ? 0 : UINT64_MAX;
  for (const Segment& s : out) min_bytes = std::min(min_bytes, s.bytes);
  return min_bytes;
}

}  // namespace kvtier::copy_detail
