#include "copy/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>

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
void clear_bits(std::vector<std::uint64_t>& bm, std::span<const BlockId> ids, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) bm[static_cast<std::uint32_t>(ids[i]) >> 6] = 0;
}

bool layer_selected(const CopyRequest& r, std::uint32_t l) {
  if (r.layers.empty()) return true;
  return std::find(r.layers.begin(), r.layers.end(), l) != r.layers.end();
}

Status check_ids(std::span<const BlockId> ids, std::uint64_t num_blocks, const char* side) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const BlockId id = ids[i];
    if (static_cast<std::uint64_t>(id) >= num_blocks)
      return OutOfRange(fmt::format("{} block id {} at index {} is outside [0, {})", side, id, i, num_blocks));
  }
  return Status::Ok();
}

// Same kind, block count and planes: block id i names the same bytes in both.
bool same_geometry(const BlockSpace& a, const BlockSpace& b) {
  if (&a == &b) return true;
  if (a.num_blocks() != b.num_blocks() || a.kind() != b.kind()) return false;
  const KvLayout& layout = a.layout();
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro) {
      const Plane& pa = a.plane(l, ro);
      const Plane& pb = b.plane(l, ro);
      if (pa.base != pb.base || pa.stride != pb.stride) return false;
    }
  return true;
}

// [lowest, highest) address any block of `s` covers.
std::pair<std::uintptr_t, std::uintptr_t> footprint(const BlockSpace& s) {
  std::uintptr_t lo = std::numeric_limits<std::uintptr_t>::max(), hi = 0;
  const KvLayout& layout = s.layout();
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro) {
      const Plane& p = s.plane(l, ro);
      const auto begin = reinterpret_cast<std::uintptr_t>(p.base);
      lo = std::min(lo, begin);
      // BlockSpace::from_planes checked that this does not wrap.
      hi = std::max(hi, begin + (s.num_blocks() - 1) * p.stride + layout.block_bytes(l, ro));
    }
  return {lo, hi};
}

bool footprints_intersect(const BlockSpace& a, const BlockSpace& b) {
  const auto fa = footprint(a);
  const auto fb = footprint(b);
  return fa.first < fb.second && fb.first < fa.second;
}

// [lowest, highest) address any block of plane (l, ro) of `s` covers.
std::pair<std::uintptr_t, std::uintptr_t> plane_footprint(const BlockSpace& s, std::uint32_t l, std::uint32_t ro) {
  const Plane& p = s.plane(l, ro);
  const auto begin = reinterpret_cast<std::uintptr_t>(p.base);
  return {begin, begin + (s.num_blocks() - 1) * p.stride + s.layout().block_bytes(l, ro)};
}

// Whether any selected plane of the source covers bytes of any selected plane of the destination. Engines keep
// one allocation per layer (and a peer's pool is mapped region by region), so two spaces' whole footprints
// interleave although no plane of one touches a plane of the other; only planes that meet need the per-block
// check, whose sort costs tens of microseconds per thousand blocks.
bool selected_planes_intersect(const CopyRequest& r) {
  const KvLayout& layout = r.src->layout();
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> dst;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    if (!layer_selected(r, l)) continue;
    for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro)
      if (r.roles & role_bit(layout.layer(l).roles[ro].role)) dst.push_back(plane_footprint(*r.dst, l, ro));
  }
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
    if (!layer_selected(r, l)) continue;
    for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro) {
      if (!(r.roles & role_bit(layout.layer(l).roles[ro].role))) continue;
      const auto src = plane_footprint(*r.src, l, ro);
      for (const auto& d : dst)
        if (src.first < d.second && d.first < src.second) return true;
    }
  }
  return false;
}

// Byte ranges of the request's source blocks against those of its
// destination blocks (which never overlap each other: destinations are
// distinct and planes of a space are disjoint).
Status check_byte_overlap(const CopyRequest& r) {
  struct Range {
    std::uintptr_t begin, end;
    std::size_t index;
  };
  const KvLayout& layout = r.src->layout();
  std::vector<Range> dst;
  auto for_planes = [&](auto&& fn) {
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
      if (!layer_selected(r, l)) continue;
      for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro)
        if (r.roles & role_bit(layout.layer(l).roles[ro].role)) fn(l, ro);
    }
  };
  for_planes([&](std::uint32_t l, std::uint32_t ro) {
    const Plane& p = r.dst->plane(l, ro);
    const std::uint64_t bb = layout.block_bytes(l, ro);
    for (std::size_t i = 0; i < r.dst_blocks.size(); ++i) {
      const auto b = reinterpret_cast<std::uintptr_t>(p.base) + static_cast<std::uint64_t>(r.dst_blocks[i]) * p.stride;
      dst.push_back({b, b + bb, i});
    }
  });
  std::sort(dst.begin(), dst.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  Status st;
  for_planes([&](std::uint32_t l, std::uint32_t ro) {
    if (!st.ok()) return;
    const Plane& p = r.src->plane(l, ro);
    const std::uint64_t bb = layout.block_bytes(l, ro);
    for (std::size_t i = 0; i < r.src_blocks.size(); ++i) {
      const auto b = reinterpret_cast<std::uintptr_t>(p.base) + static_cast<std::uint64_t>(r.src_blocks[i]) * p.stride;
      const auto e = b + bb;
      // First destination ending after b (ends are sorted too: disjoint ranges).
      auto it = std::partition_point(dst.begin(), dst.end(), [&](const Range& d) { return d.end <= b; });
      if (it != dst.end() && it->begin < e) {
        st = InvalidArgument(fmt::format(
            "src block {} at index {} (layer {}, {}) overlaps the bytes of dst block {} at index {}: the two "
            "BlockSpaces alias the same memory",
            r.src_blocks[i], i, l, role_name(layout.layer(l).roles[ro].role), r.dst_blocks[it->index], it->index));
        return;
      }
    }
  });
  return st;
}

}  // namespace

Status validate_layers(const CopyRequest& r) {
  const KvLayout& layout = r.src->layout();
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
  return Status::Ok();
}

Status validate_request(const CopyRequest& r, int device_ordinal, bool read_only) {
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
    case CopyStrategy::kStagedDma:
      if (dir == CopyDirection::kHostToHost || dir == CopyDirection::kDeviceToDevice)
        return NotSupported(fmt::format(
            "strategy staged_dma moves blocks between host and device memory only, not {} (use sm_kernel for d2d, "
            "dma_per_run or dma_batch for h2h)",
            copy_direction_name(dir)));
      break;
    case CopyStrategy::kSplit:
      if (dir == CopyDirection::kHostToHost || dir == CopyDirection::kDeviceToDevice)
        return NotSupported(fmt::format(
            "strategy split moves blocks between host and device memory only, not {} (use sm_kernel for d2d, "
            "dma_per_run or dma_batch for h2h)",
            copy_direction_name(dir)));
      break;
    case CopyStrategy::kAuto:
    case CopyStrategy::kDmaPerRun:
    case CopyStrategy::kDmaBatch: break;
  }
  if (static_cast<unsigned>(r.strategy) >= static_cast<unsigned>(kNumCopyStrategies))
    return InvalidArgument(fmt::format("invalid copy strategy value {}", static_cast<int>(r.strategy)));

  KVTIER_RETURN_IF_ERROR(validate_layers(r));
  if (!read_only)
    for (const BlockSpace* s : {r.src, r.dst}) {
      // Every layer of a layer slot is the same bytes: a copy of several layers into one wrote each over the last
      // (and out of one copied one layer's bytes into every destination layer), reporting success.
      const std::size_t selected = r.layers.empty() ? layout.num_layers() : r.layers.size();
      if (s->layers_share_memory() && selected != 1)
        return InvalidArgument(fmt::format(
            "the {} BlockSpace holds one layer at a time (a layer slot): the copy selects {} layers, it must "
            "select one",
            s == r.src ? "src" : "dst", selected));
    }

  if (r.src_blocks.empty()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(check_ids(r.src_blocks, r.src->num_blocks(), "src"));
  KVTIER_RETURN_IF_ERROR(check_ids(r.dst_blocks, r.dst->num_blocks(), "dst"));
  if (read_only) return Status::Ok();

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
  if (same_geometry(*r.src, *r.dst)) {
    // One space (or a copy of it): block ids name the same bytes on both sides.
    for (std::size_t i = 0; i < n; ++i) {
      const auto id = static_cast<std::uint32_t>(r.src_blocks[i]);
      if (test(bm, id)) {
        st = InvalidArgument(fmt::format(
            "src block id {} at index {} is also a destination in the same BlockSpace (overlapping copy)", id, i));
        break;
      }
    }
  }
  clear_bits(bm, r.dst_blocks, n);
  KVTIER_RETURN_IF_ERROR(st);
  // Two different spaces over the same memory: compare the bytes each block
  // of the request covers. Rejected here, before anything is enqueued.
  if (!same_geometry(*r.src, *r.dst) && footprints_intersect(*r.src, *r.dst) && selected_planes_intersect(r))
    return check_byte_overlap(r);
  return Status::Ok();
}

Status check_checksum_alignment(std::span<const SelectedPlane> planes) {
  for (const SelectedPlane& p : planes) {
    const auto misaligned = [](std::uint64_t v) { return (v & 15) != 0; };
    if (misaligned(reinterpret_cast<std::uintptr_t>(p.src_base)) || misaligned(p.src_stride) ||
        misaligned(reinterpret_cast<std::uintptr_t>(p.dst_base)) || misaligned(p.dst_stride) ||
        misaligned(p.block_bytes))
      return InvalidArgument(fmt::format(
          "checksummed copy of (layer {}, role {}): blocks must be 16-byte aligned with sizes that are multiples of 16 "
          "(src base {}, stride {}; dst base {}, stride {}; block_bytes {})",
          p.layer, p.role, static_cast<const void*>(p.src_base), p.src_stride, static_cast<const void*>(p.dst_base),
          p.dst_stride, p.block_bytes));
  }
  return Status::Ok();
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

void find_runs(std::span<const BlockId> src, std::span<const BlockId> dst, std::vector<Run>& out) {
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
  s.full_duplex_hint = r.full_duplex;
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

// ------------------------------------------------------------ staged DMA

namespace {

struct HostSide {
  std::uint64_t base;
  std::uint64_t stride;
  std::uint64_t bytes;
};
HostSide host_side(const SelectedPlane& p, bool host_is_src) {
  return host_is_src ? HostSide{reinterpret_cast<std::uint64_t>(p.src_base), p.src_stride, p.block_bytes}
                     : HostSide{reinterpret_cast<std::uint64_t>(p.dst_base), p.dst_stride, p.block_bytes};
}

void sort_planes_by_host_base(std::span<const SelectedPlane> planes, bool host_is_src, StagedScratch& sc) {
  sc.order.resize(planes.size());
  std::iota(sc.order.begin(), sc.order.end(), 0u);
  std::sort(sc.order.begin(), sc.order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return host_side(planes[a], host_is_src).base < host_side(planes[b], host_is_src).base;
  });
}

}  // namespace

std::uint64_t estimate_host_ranges(std::span<const SelectedPlane> planes, std::span<const BlockId> host_ids,
                                   bool host_is_src) {
  if (host_ids.empty() || planes.empty()) return 0;
  std::uint64_t id_runs = 1;
  for (std::size_t i = 1; i < host_ids.size(); ++i) id_runs += host_ids[i] != host_ids[i - 1] + 1;
  // Do the selected planes tile one page (same stride, adjacent, covering it)?
  std::vector<HostSide> sides;
  sides.reserve(planes.size());
  for (const SelectedPlane& p : planes) sides.push_back(host_side(p, host_is_src));
  std::sort(sides.begin(), sides.end(), [](const HostSide& a, const HostSide& b) { return a.base < b.base; });
  bool tiles = true;
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < sides.size() && tiles; ++i) {
    tiles = sides[i].stride == sides[0].stride && (i == 0 || sides[i - 1].base + sides[i - 1].bytes == sides[i].base);
    covered += sides[i].bytes;
  }
  if (tiles && covered == sides[0].stride) return id_runs;
  std::uint64_t ranges = 0;
  for (const HostSide& h : sides) ranges += h.stride == h.bytes ? id_runs : host_ids.size();
  return ranges;
}

std::uint64_t staged_intervals(std::span<const SelectedPlane> planes, bool host_is_src, BlockId min_id, BlockId max_id,
                               StagedScratch& sc) {
  auto& iv = sc.intervals;
  iv.clear();
  for (std::uint32_t p : sc.order) {
    const HostSide h = host_side(planes[p], host_is_src);
    iv.push_back({h.base + static_cast<std::uint64_t>(min_id) * h.stride,
                  h.base + static_cast<std::uint64_t>(max_id) * h.stride + h.bytes, 0});
  }
  // Sorted by base is sorted by lo unless strides differ a lot; check.
  const auto by_lo = [](const StagedInterval& a, const StagedInterval& b) { return a.lo < b.lo; };
  if (!std::is_sorted(iv.begin(), iv.end(), by_lo)) std::sort(iv.begin(), iv.end(), by_lo);
  std::size_t out = 0;
  for (std::size_t i = 1; i < iv.size(); ++i) {
    if (iv[i].lo <= iv[out].hi)  // overlapping or touching: one DMA may span both
      iv[out].hi = std::max(iv[out].hi, iv[i].hi);
    else
      iv[++out] = iv[i];
  }
  if (!iv.empty()) iv.resize(out + 1);
  std::uint64_t at = 0;
  for (StagedInterval& i : iv) {
    at += (i.lo - at) & (kStagedAlign - 1);  // at == lo (mod kStagedAlign)
    i.offset = at;
    at += i.hi - i.lo;
  }
  return at;
}

Status plan_staged_chunks(std::span<const SelectedPlane> planes, std::span<const BlockId> host_ids, bool host_is_src,
                          std::uint64_t slot_bytes, std::uint32_t max_pairs, StagedScratch& sc) {
  sort_planes_by_host_base(planes, host_is_src, sc);
  sc.chunks.clear();
  sc.footprint = 0;
  const std::size_t n = host_ids.size();
  auto& pmin = sc.prefix_min;
  auto& pmax = sc.prefix_max;
  std::size_t i = 0;
  while (i < n) {
    const std::size_t limit = std::min<std::size_t>(max_pairs, n - i);
    pmin.clear();
    pmax.clear();
    // Footprint of the chunk [i, i + k); extends the prefix min/max lazily.
    auto footprint = [&](std::size_t k) {
      while (pmin.size() < k) {
        const BlockId id = host_ids[i + pmin.size()];
        pmin.push_back(pmin.empty() ? id : std::min(pmin.back(), id));
        pmax.push_back(pmax.empty() ? id : std::max(pmax.back(), id));
      }
      return staged_intervals(planes, host_is_src, pmin[k - 1], pmax[k - 1], sc);
    };
    std::uint64_t fit_bytes = footprint(1);
    if (fit_bytes > slot_bytes)
      return NotSupported(fmt::format(
          "staged_dma: host block {} (pair {}) alone needs {} bytes of staging (its selected planes' host span), "
          "more than staged_slot_bytes = {}; raise staged_slot_bytes or use another strategy",
          host_ids[i], i, fit_bytes, slot_bytes));
    // The footprint grows with the chunk: gallop, then bisect.
    std::size_t fit = 1, over = limit + 1;
    while (fit < limit) {
      const std::size_t k = std::min(fit * 2, limit);
      const std::uint64_t f = footprint(k);
      if (f > slot_bytes) {
        over = k;
        break;
      }
      fit = k;
      fit_bytes = f;
    }
    while (over - fit > 1) {
      const std::size_t mid = fit + (over - fit) / 2;
      const std::uint64_t f = footprint(mid);
      if (f <= slot_bytes) {
        fit = mid;
        fit_bytes = f;
      } else {
        over = mid;
      }
    }
    sc.chunks.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(fit), fit_bytes});
    sc.footprint += fit_bytes;
    i += fit;
  }
  return Status::Ok();
}

std::uint64_t staged_offset(const StagedScratch& sc, std::uint64_t x) {
  auto it = std::upper_bound(sc.intervals.begin(), sc.intervals.end(), x,
                             [](std::uint64_t v, const StagedInterval& iv) { return v < iv.lo; });
  const StagedInterval& iv = *(it - 1);  // precondition: x lies in some interval
  return iv.offset + (x - iv.lo);
}

void staged_host_runs(std::span<const SelectedPlane> planes, bool host_is_src, std::span<const BlockId> host_ids,
                      StagedScratch& sc) {
  auto& runs = sc.runs;
  runs.clear();
  auto emit = [&runs](std::uint64_t host, std::uint64_t bytes) {
    if (!runs.empty() && runs.back().host + runs.back().bytes == host) {
      runs.back().bytes += bytes;
      return;
    }
    runs.push_back({host, bytes, 0});
  };
  bool any_mergeable = false;
  for (const SelectedPlane& p : planes) {
    const HostSide h = host_side(p, host_is_src);
    any_mergeable |= h.stride == h.bytes;
  }
  const std::size_t n = host_ids.size();
  if (any_mergeable) {
    // Plane-major: a run of consecutive host ids is one range per plane.
    for (std::uint32_t p : sc.order) {
      const HostSide h = host_side(planes[p], host_is_src);
      for (std::size_t i = 0; i < n;) {
        std::size_t j = i + 1;
        if (h.stride == h.bytes)
          while (j < n && host_ids[j] == host_ids[j - 1] + 1) ++j;
        emit(h.base + static_cast<std::uint64_t>(host_ids[i]) * h.stride, h.bytes * (j - i));
        i = j;
      }
    }
  } else {
    // Pair-major: a page-first page's planes are adjacent.
    for (std::size_t i = 0; i < n; ++i)
      for (std::uint32_t p : sc.order) {
        const HostSide h = host_side(planes[p], host_is_src);
        emit(h.base + static_cast<std::uint64_t>(host_ids[i]) * h.stride, h.bytes);
      }
  }
  const auto by_host = [](const HostRun& a, const HostRun& b) { return a.host < b.host; };
  if (!std::is_sorted(runs.begin(), runs.end(), by_host)) std::sort(runs.begin(), runs.end(), by_host);
  std::size_t out = 0;
  for (std::size_t i = 1; i < runs.size(); ++i) {
    HostRun& last = runs[out];
    if (runs[i].host <= last.host + last.bytes)  // touching, or overlapping (a repeated H2D source)
      last.bytes = std::max(last.host + last.bytes, runs[i].host + runs[i].bytes) - last.host;
    else
      runs[++out] = runs[i];
  }
  if (!runs.empty()) runs.resize(out + 1);
  for (HostRun& r : runs) r.offset = staged_offset(sc, r.host);
}

}  // namespace kvtier::copy_detail
