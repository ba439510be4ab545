// Work decomposition of the SM copy kernel, shared by the CUDA kernel
// (copy/cuda/block_copy_kernels.cu) and the host backend's emulation of it
// (copy/host_copy_engine.cc), so that CPU tests validate the same index math
// that the GPU runs.
//
// Input (a "descriptor"): a table of planes {src_base, src_stride, dst_base,
// dst_stride, block_bytes} and a list of (src block, dst block) pairs. Block
// `b` of a plane starts at base + b * stride.
//
// Items: every (pair, plane) is cut into pieces of at most `item_bytes`
// (a multiple of 16); item k of the launch is
//   pair   = k / items_per_pair
//   r      = k % items_per_pair
//   plane  = the p with planes[p].item_offset <= r < planes[p+1].item_offset
//   piece  = r - planes[p].item_offset   (bytes [piece*item_bytes, ...))
// Pair-major order keeps one block's planes close together (page-first host
// pages are read/written near-sequentially).
//
// Execution: one warp per item, persistent grid-stride loop over items
// (warp w of `total_warps` takes items w, w + total_warps, ...). Inside an
// item the warp copies: `head` bytes one per lane until both pointers are
// aligned to `width`, then `body` elements of `width` bytes (lane l takes
// elements l, l+32, ...), then `tail` bytes one per lane. `width` is the
// largest of 16/8/4/1 for which src and dst have the same misalignment, so
// 16-byte accesses are used whenever (src - dst) % 16 == 0.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVTIER_HD __host__ __device__ __forceinline__
#else
#define KVTIER_HD inline
#endif

namespace kvtier::copy_detail {

inline constexpr std::uint32_t kWarpLanes = 32;
// Plane table size of one launch (the kernel keeps it in shared memory);
// more selected planes are split over several launches.
inline constexpr std::uint32_t kMaxKernelPlanes = 256;

struct KernelPlane {
  std::uint64_t src_base;
  std::uint64_t src_stride;
  std::uint64_t dst_base;
  std::uint64_t dst_stride;
  std::uint64_t block_bytes;
  std::uint32_t item_offset;  // first item of this plane within a pair
  std::uint32_t items;        // ceil(block_bytes / item_bytes)
};
static_assert(sizeof(KernelPlane) == 48, "KernelPlane layout is shared with the GPU");

struct KernelPair {
  std::int32_t src;
  std::int32_t dst;
};

// Descriptors passed inside the launch's kernel parameters (no upload, no
// descriptor slot): launches of at most kInlineMaxPlanes planes and
// kInlineMaxPairs pairs. The parameter block then stays below CUDA's 32764-byte
// limit (CUDA 12.1+, Volta and newer): 64 + 8 * 48 + 3072 * 8 = 25,024 bytes.
inline constexpr std::uint32_t kInlineMaxPlanes = 8;
inline constexpr std::uint32_t kInlineMaxPairs = 3072;

struct KernelArgs {
  const KernelPlane* planes = nullptr;  // num_planes entries (device-readable)
  const KernelPair* pairs = nullptr;    // num_pairs entries (device-readable)
  std::uint32_t num_planes = 0;
  std::uint32_t num_pairs = 0;
  std::uint32_t item_bytes = 0;
  std::uint32_t items_per_pair = 0;  // sum of planes[p].items
  std::uint64_t num_items = 0;       // num_pairs * items_per_pair
};

struct WorkItem {
  const unsigned char* src;
  unsigned char* dst;
  std::uint64_t bytes;
};

// Fills item_offset/items of `planes` and returns items per pair.
KVTIER_HD std::uint32_t assign_items(KernelPlane* planes, std::uint32_t num_planes, std::uint32_t item_bytes) {
  std::uint32_t offset = 0;
  for (std::uint32_t p = 0; p < num_planes; ++p) {
    planes[p].item_offset = offset;
    planes[p].items = static_cast<std::uint32_t>((planes[p].block_bytes + item_bytes - 1) / item_bytes);
    offset += planes[p].items;
  }
  return offset;
}

// The plane whose item range contains `r` (binary search; planes sorted by item_offset).
KVTIER_HD std::uint32_t find_plane(const KernelPlane* planes, std::uint32_t num_planes, std::uint32_t r) {
  std::uint32_t lo = 0, hi = num_planes;  // invariant: planes[lo].item_offset <= r
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (planes[mid].item_offset <= r)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

KVTIER_HD WorkItem resolve_item(const KernelPlane* planes, std::uint32_t num_planes, const KernelPair* pairs,
                                std::uint32_t items_per_pair, std::uint32_t item_bytes, std::uint64_t item) {
  const std::uint64_t pair_index = item / items_per_pair;
  const std::uint32_t r = static_cast<std::uint32_t>(item - pair_index * items_per_pair);
  const std::uint32_t p = find_plane(planes, num_planes, r);
  const KernelPlane& plane = planes[p];
  const std::uint64_t offset = std::uint64_t{r - plane.item_offset} * item_bytes;
  const std::uint64_t remaining = plane.block_bytes - offset;
  const KernelPair pair = pairs[pair_index];
  WorkItem w;
  w.src = reinterpret_cast<const unsigned char*>(plane.src_base +
                                                 static_cast<std::uint64_t>(pair.src) * plane.src_stride + offset);
  w.dst = reinterpret_cast<unsigned char*>(plane.dst_base + static_cast<std::uint64_t>(pair.dst) * plane.dst_stride +
                                           offset);
  w.bytes = remaining < item_bytes ? remaining : item_bytes;
  return w;
}

struct VectorSplit {
  std::uint32_t width;  // 16, 8, 4 or 1
  std::uint32_t head;   // bytes before the first aligned element (< width)
  std::uint64_t body;   // elements of `width` bytes
  std::uint32_t tail;   // bytes after the body (< width)
};

KVTIER_HD VectorSplit split_for_vectors(const void* src, const void* dst, std::uint64_t bytes) {
  const std::uint64_t s = reinterpret_cast<std::uint64_t>(src);
  const std::uint64_t d = reinterpret_cast<std::uint64_t>(dst);
  const std::uint64_t diff = s ^ d;
  VectorSplit v;
  v.width = (diff & 15) == 0 ? 16 : (diff & 7) == 0 ? 8 : (diff & 3) == 0 ? 4 : 1;
  std::uint64_t head = (v.width - (s & (v.width - 1))) & (v.width - 1);
  if (head > bytes) head = bytes;
  const std::uint64_t rest = bytes - head;
  v.head = static_cast<std::uint32_t>(head);
  v.body = rest / v.width;
  v.tail = static_cast<std::uint32_t>(rest - v.body * v.width);
  return v;
}

}  // namespace kvtier::copy_detail
