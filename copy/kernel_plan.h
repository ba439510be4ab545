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
//
// Checksums (KernelArgs::checksums): each lane folds every 16-byte word it
// moves into a running sum of checksum_word(word, position), the warp adds
// its lanes' sums and lane 0 adds that to the pair's slot (atomically on the
// GPU). A sum of per-word terms does not depend on which warp moved which
// word, so any decomposition gives the same value; the position (the plane's
// index among the request's selected planes, and the byte offset in the
// block) makes the value depend on where every word sits. Checksummed
// launches need 16-byte aligned blocks whose size is a multiple of 16 (the
// engine checks), so every item is body-only at width 16. With landed sums
// (KernelArgs::landed) each warp also reads back the item it copied before
// (beside copying the next in CTAs of up to 512 threads, after it in larger
// ones) and folds the words it finds into the pair's landed sum (the last
// item after the loop); the host backend reads every item back in a second
// task behind the copy.
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

// The kernel's pair of a request's ids, which validation keeps below num_blocks, itself at most INT32_MAX
// (BlockSpace::make): the conversion never changes a value.
inline KernelPair kernel_pair(std::uint32_t src, std::uint32_t dst) noexcept {  // BlockId (core/layout.h)
  return KernelPair{static_cast<std::int32_t>(src), static_cast<std::int32_t>(dst)};
}

// Descriptors passed inside the launch's kernel parameters (no upload, no
// descriptor slot): launches of at most kInlineMaxPlanes planes and
// kInlineMaxPairs pairs. The parameter block then stays below CUDA's 32764-byte
// limit (CUDA 12.1+, Volta and newer): 64 + 8 * 48 + 3072 * 8 = 25,024 bytes.
inline constexpr std::uint32_t kInlineMaxPlanes = 8;
inline constexpr std::uint32_t kInlineMaxPairs = 3072;

// Limits of CopyEngineOptions, checked by EngineBase::check_options and carried by their config knobs
// (copy_config.cc): a CTA of at most 1024 threads, whole warps; the split strategy's DMA lanes; the descriptor ring
// (each slot holds descriptor arrays: past this it cost gigabytes, or aborted on bad_alloc).
inline constexpr std::uint32_t kMaxThreadsPerCta = 1024;
inline constexpr std::uint32_t kWarpThreads = 32;
inline constexpr std::uint32_t kMaxSplitDmaLanes = 16;
inline constexpr std::uint32_t kMaxDescriptorSlots = 65536;
// Staged DMA slots per caller stream: each is a staging buffer of staged_slot_bytes of device memory and two events;
// a few keep the pipeline full. Any count was taken, and the first staged copy aborted the process sizing the slot
// array (bad_alloc at 2^32 - 1).
inline constexpr std::uint32_t kMaxStagedSlots = 256;

struct KernelArgs {
  const KernelPlane* planes = nullptr;  // num_planes entries (device-readable)
  // Per pair of this launch (device-writable, zeroed before the launch), or
  // nullptr: no checksums.
  unsigned long long* checksums = nullptr;
  // With checksums and store: per pair, the checksum of the destination words as each warp reads back its
  // previous item after storing the next one (and its last item at the end), or nullptr.
  unsigned long long* landed = nullptr;
  std::uint32_t plane_index_base = 0;  // index of planes[0] among the request's selected planes
  std::uint32_t store = 1;             // 0: read and checksum only (dst pointers unused)
  const KernelPair* pairs = nullptr;   // num_pairs entries (device-readable)
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
  std::uint64_t pair;    // index of the pair in the launch
  std::uint32_t plane;   // index of the plane in the launch
  std::uint64_t offset;  // of the item in its block
};

// Position of the byte `offset` of plane `plane_index` of a block, as the checksum folds it in.
KVTIER_HD std::uint64_t checksum_position(std::uint32_t plane_index, std::uint64_t offset) {
  return (std::uint64_t{plane_index} << 40) + offset;
}

// One 16-byte word's term of a block checksum: a bijection of `lo` for fixed
// (hi, position) and of `hi` for fixed (lo, position), so a change of either
// half of one word always changes the sum; the final multiply spreads every
// input bit over the term, so changes in several words do not cancel in the
// sum by structure. Three 64-bit multiplies, one of them the position's: the
// GPU computes this twice for every word a verified copy moves, and with few
// CTAs its multiplies, not memory, set the pace (a fourth, on `hi`, cost 3-5 %
// of a 32-CTA checksummed copy on an H200, bench/gpu/readback_probe.cu).
KVTIER_HD std::uint64_t checksum_word(std::uint64_t lo, std::uint64_t hi, std::uint64_t position) {
  std::uint64_t h = (lo ^ (position * 0x165667B19E3779F9ull + 0x27D4EB2F165667C5ull)) * 0x9E3779B97F4A7C15ull;
  h ^= (hi << 31) | (hi >> 33);
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return h;
}

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
  w.pair = pair_index;
  w.plane = p;
  w.offset = offset;
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
