// SM gather/scatter copy kernel. Decomposition and alignment split:
// copy/kernel_plan.h (the host backend runs the same decomposition).
//
// Accesses: streaming loads/stores (__ldcs / __stcs: evict-first, so moving KV
// does not flush the compute kernels' L2 working set); host memory is reached
// through its mapped (UVA) address. Each lane keeps kUnroll loads in flight
// before storing, to cover PCIe read latency with few CTAs.
//
// Programmatic dependent launch (sm_90+): a launch with `programmatic` set may
// start while the kernel before it on the stream still runs. Every CTA first
// waits for that kernel to complete and its memory to be visible
// (griddepcontrol.wait), so stream order holds for every byte; what overlaps
// is the launch and the CTAs' start-up, the gap that held streams of small
// back-to-back requests below the link's ceiling. Once every CTA is past the
// wait, the next copy kernel may launch in turn.
#include <cstring>

#include "backends/cuda/block_copy_kernels.h"

namespace kvtier::copy_detail {
namespace {

constexpr int kUnroll = 4;
// The largest CTA the kernels built for copies that read back what they wrote run in (CopyEngineOptions::
// sm_threads_per_cta is 512 by default); larger CTAs take the general build and its read-back after the copy.
constexpr std::uint32_t kLandedMaxThreads = 512;

template <int W>
struct Vec;
template <>
struct Vec<16> {
  using T = uint4;
};
template <>
struct Vec<8> {
  using T = uint2;
};
template <>
struct Vec<4> {
  using T = unsigned int;
};
template <>
struct Vec<1> {
  using T = unsigned char;
};

template <int W>
__device__ __forceinline__ void copy_body(const unsigned char* src, unsigned char* dst, std::uint64_t n,
                                          std::uint32_t lane) {
  using T = typename Vec<W>::T;
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  std::uint64_t e = lane;
  for (; e + (kUnroll - 1) * kWarpLanes < n; e += kUnroll * kWarpLanes) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(s + e + u * kWarpLanes);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) __stcs(d + e + u * kWarpLanes, v[u]);
  }
  for (; e < n; e += kWarpLanes) __stcs(d + e, __ldcs(s + e));
}

// How a checksummed body reads and writes: sources by streaming loads; destinations by streaming stores, by
// default stores (whose lines stay in L2 for a read-back), or not at all (a read-only pass); kFromL2 reads
// destinations back from L2 (ld.global.cg: a warp's own stores of an item ago are there, and no older copy of
// the line in L1 can answer).
enum class Access { kStreamingStores, kDefaultStores, kReadOnly, kFromL2 };

// The checksummed body (width 16, body-only items: the engine checks the
// alignment). Returns the lane's sum of the words it read.
template <Access kAccess>
__device__ __forceinline__ unsigned long long sum_body(const unsigned char* src, unsigned char* dst, std::uint64_t n,
                                                       std::uint32_t lane, std::uint64_t position) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  auto load = [s](std::uint64_t i) { return kAccess == Access::kFromL2 ? __ldcg(s + i) : __ldcs(s + i); };
  auto store = [d](std::uint64_t i, const uint4& v) {
    if constexpr (kAccess == Access::kStreamingStores) __stcs(d + i, v);
    if constexpr (kAccess == Access::kDefaultStores) d[i] = v;
  };
  unsigned long long acc = 0;
  std::uint64_t e = lane;
  for (; e + (kUnroll - 1) * kWarpLanes < n; e += kUnroll * kWarpLanes) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load(e + u * kWarpLanes);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store(e + u * kWarpLanes, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      acc += checksum_word(std::uint64_t{v[u].x} | (std::uint64_t{v[u].y} << 32),
                           std::uint64_t{v[u].z} | (std::uint64_t{v[u].w} << 32), position + (e + u * kWarpLanes) * 16);
  }
  for (; e < n; e += kWarpLanes) {
    const uint4 v = load(e);
    store(e, v);
    acc += checksum_word(std::uint64_t{v.x} | (std::uint64_t{v.y} << 32),
                         std::uint64_t{v.z} | (std::uint64_t{v.w} << 32), position + e * 16);
  }
  return acc;
}

__device__ __forceinline__ void warp_add(unsigned long long* slot, unsigned long long acc) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % kWarpLanes == 0) atomicAdd(slot, acc);
}

// One item's destination words read back from L2 into its pair's landed sum.
__device__ __forceinline__ void read_back(const KernelArgs& a, const WorkItem& w, std::uint32_t lane) {
  warp_add(a.landed + w.pair, sum_body<Access::kFromL2>(w.dst, nullptr, w.bytes / 16, lane,
                                                        checksum_position(a.plane_index_base + w.plane, w.offset)));
}

// Copies item `w` (when `copy`) and reads item `p` back (when `back`) in one loop: the read-back's loads go out
// beside the copy's source loads, so a warp keeps both kinds in flight instead of waiting for one after the other.
// Each lane reads back, one item after storing them, the words it stored itself. kUnroll loads of each kind need
// more than the 64 registers a thread of a 1024-thread CTA may have (they spilled), so only the kernels built for
// CTAs of at most kLandedMaxThreads threads (kPaired below) run it.
__device__ __forceinline__ void copy_beside_read_back(const KernelArgs& a, const WorkItem& w, bool copy,
                                                      const WorkItem& p, bool back, std::uint32_t lane) {
  const uint4* s = reinterpret_cast<const uint4*>(w.src);
  uint4* d = reinterpret_cast<uint4*>(w.dst);
  const uint4* r = reinterpret_cast<const uint4*>(p.dst);
  const std::uint64_t copy_words = copy ? w.bytes / 16 : 0, back_words = back ? p.bytes / 16 : 0;
  const std::uint64_t words = copy_words > back_words ? copy_words : back_words;
  const std::uint64_t copy_position = copy ? checksum_position(a.plane_index_base + w.plane, w.offset) : 0;
  const std::uint64_t back_position = back ? checksum_position(a.plane_index_base + p.plane, p.offset) : 0;
  unsigned long long copied = 0, landed = 0;
  for (std::uint64_t e = lane; e < words; e += kUnroll * kWarpLanes) {
    uint4 v[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::uint64_t i = e + u * kWarpLanes;
      if (i < copy_words) v[u] = __ldcs(s + i);
      if (i < back_words) b[u] = __ldcg(r + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::uint64_t i = e + u * kWarpLanes;
      if (i < copy_words) {
        d[i] = v[u];
        copied += checksum_word(std::uint64_t{v[u].x} | (std::uint64_t{v[u].y} << 32),
                                std::uint64_t{v[u].z} | (std::uint64_t{v[u].w} << 32), copy_position + i * 16);
      }
      if (i < back_words)
        landed += checksum_word(std::uint64_t{b[u].x} | (std::uint64_t{b[u].y} << 32),
                                std::uint64_t{b[u].z} | (std::uint64_t{b[u].w} << 32), back_position + i * 16);
    }
  }
  if (copy) warp_add(a.checksums + w.pair, copied);
  if (back) warp_add(a.landed + p.pair, landed);
}

// A checksummed copy that reads back what it wrote (KernelArgs::landed): each item is copied with default
// stores (streaming ones would mark its lines first to leave L2) and the warp's previous item is read back, beside
// the copy (kPaired: copy_beside_read_back()) or after it; the last item in one more pass. Reading an item back
// right behind its own stores waits for them; one item later they have reached L2 (measured on an H200,
// bench/gpu/readback_probe.cu).
template <bool kPaired>
__device__ __forceinline__ void copy_items_landed(const KernelArgs& a, const KernelPlane* planes,
                                                  const KernelPair* pairs) {
  const std::uint32_t lane = threadIdx.x % kWarpLanes;
  const std::uint32_t warps = blockDim.x / kWarpLanes;
  const std::uint64_t total_warps = std::uint64_t{gridDim.x} * warps;
  WorkItem previous{};
  bool have_previous = false;
  for (std::uint64_t item = std::uint64_t{blockIdx.x} * warps + threadIdx.x / kWarpLanes;; item += total_warps) {
    const bool copy = item < a.num_items;
    if (!copy && !have_previous) break;
    WorkItem w{};
    if (copy) w = resolve_item(planes, a.num_planes, pairs, a.items_per_pair, a.item_bytes, item);
    if constexpr (kPaired) {
      copy_beside_read_back(a, w, copy, previous, have_previous, lane);
    } else {
      if (copy)
        warp_add(a.checksums + w.pair,
                 sum_body<Access::kDefaultStores>(w.src, w.dst, w.bytes / 16, lane,
                                                  checksum_position(a.plane_index_base + w.plane, w.offset)));
      if (have_previous) read_back(a, previous, lane);
    }
    if (!copy) break;
    previous = w;
    have_previous = true;
  }
}

__device__ __forceinline__ void order_after_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One warp per item over `a.num_items` items; `planes` are in shared memory. kPaired: copies that read back what
// they wrote do it beside the copy (only in kernels built for at most kLandedMaxThreads threads).
template <bool kPaired>
__device__ __forceinline__ void copy_items(const KernelArgs& a, const KernelPlane* planes, const KernelPair* pairs) {
  if (a.landed != nullptr && a.store != 0) {
    copy_items_landed<kPaired>(a, planes, pairs);
    return;
  }
  const std::uint32_t lane = threadIdx.x % kWarpLanes;
  const std::uint32_t warps = blockDim.x / kWarpLanes;
  const std::uint64_t total_warps = std::uint64_t{gridDim.x} * warps;
  for (std::uint64_t item = std::uint64_t{blockIdx.x} * warps + threadIdx.x / kWarpLanes; item < a.num_items;
       item += total_warps) {
    const WorkItem w = resolve_item(planes, a.num_planes, pairs, a.items_per_pair, a.item_bytes, item);
    if (a.checksums != nullptr) {
      const std::uint64_t position = checksum_position(a.plane_index_base + w.plane, w.offset);
      const unsigned long long acc =
          a.store ? sum_body<Access::kStreamingStores>(w.src, w.dst, w.bytes / 16, lane, position)
                  : sum_body<Access::kReadOnly>(w.src, w.dst, w.bytes / 16, lane, position);
      warp_add(a.checksums + w.pair, acc);
      continue;
    }
    const VectorSplit v = split_for_vectors(w.src, w.dst, w.bytes);
    if (lane < v.head) w.dst[lane] = w.src[lane];
    const unsigned char* src = w.src + v.head;
    unsigned char* dst = w.dst + v.head;
    switch (v.width) {
      case 16: copy_body<16>(src, dst, v.body, lane); break;
      case 8: copy_body<8>(src, dst, v.body, lane); break;
      case 4: copy_body<4>(src, dst, v.body, lane); break;
      default: copy_body<1>(src, dst, v.body, lane); break;
    }
    const std::uint64_t tail_at = v.body * v.width;
    if (lane < v.tail) dst[tail_at + lane] = src[tail_at + lane];
  }
}

// kPaired: built for CTAs of at most kLandedMaxThreads threads (up to 128 registers a thread), for the copies
// that read back what they wrote; otherwise for up to 1024.
template <bool kPaired>
__global__ void __launch_bounds__(kPaired ? kLandedMaxThreads : 1024) block_copy_kernel(KernelArgs a) {
  extern __shared__ KernelPlane smem_planes[];
  order_after_previous_grid();
  for (std::uint32_t i = threadIdx.x; i < a.num_planes; i += blockDim.x) smem_planes[i] = a.planes[i];
  __syncthreads();
  copy_items<kPaired>(a, smem_planes, a.pairs);
}

// Parameter block of an inline launch: descriptors travel with the launch.
template <std::uint32_t MaxPairs>
struct InlineParams {
  KernelArgs args;
  KernelPlane planes[kInlineMaxPlanes];
  KernelPair pairs[MaxPairs];
};
static_assert(sizeof(InlineParams<kInlineMaxPairs>) <= 32764, "kernel parameter limit (CUDA 12.1+)");

template <std::uint32_t MaxPairs, bool kPaired>
__global__ void __launch_bounds__(kPaired ? kLandedMaxThreads : 1024)
    block_copy_inline_kernel(const __grid_constant__ InlineParams<MaxPairs> p) {
  __shared__ KernelPlane smem_planes[kInlineMaxPlanes];
  order_after_previous_grid();
  for (std::uint32_t i = threadIdx.x; i < p.args.num_planes; i += blockDim.x) smem_planes[i] = p.planes[i];
  __syncthreads();
  copy_items<kPaired>(p.args, smem_planes, p.pairs);
}

// The kernel for a launch: copies that read back what they wrote in CTAs of at most kLandedMaxThreads take the
// build whose read-back goes beside the copy.
bool paired(const KernelArgs& args, std::uint32_t threads) {
  return args.landed != nullptr && args.store != 0 && threads <= kLandedMaxThreads;
}

template <typename Kernel, typename Params>
cudaError_t launch(Kernel kernel, const Params& params, std::uint32_t ctas, std::uint32_t threads, std::size_t smem,
                   cudaStream_t stream, bool programmatic) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = programmatic ? &attr : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, params);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <std::uint32_t MaxPairs>
cudaError_t launch_inline(const KernelArgs& args, const KernelPlane* planes, const KernelPair* pairs,
                          std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream, bool programmatic) {
  InlineParams<MaxPairs> p;
  p.args = args;
  std::memcpy(p.planes, planes, sizeof(KernelPlane) * args.num_planes);
  std::memcpy(p.pairs, pairs, sizeof(KernelPair) * args.num_pairs);
  if (paired(args, threads))
    return launch(block_copy_inline_kernel<MaxPairs, true>, p, ctas, threads, 0, stream, programmatic);
  return launch(block_copy_inline_kernel<MaxPairs, false>, p, ctas, threads, 0, stream, programmatic);
}

}  // namespace

cudaError_t launch_block_copy(const KernelArgs& args, std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream,
                              bool programmatic) {
  const std::size_t smem = std::size_t{args.num_planes} * sizeof(KernelPlane);
  if (paired(args, threads)) return launch(block_copy_kernel<true>, args, ctas, threads, smem, stream, programmatic);
  return launch(block_copy_kernel<false>, args, ctas, threads, smem, stream, programmatic);
}

cudaError_t launch_block_copy_inline(const KernelArgs& args, const KernelPlane* planes, const KernelPair* pairs,
                                     std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream,
                                     bool programmatic) {
  if (args.num_planes > kInlineMaxPlanes || args.num_pairs > kInlineMaxPairs) return cudaErrorInvalidValue;
  // Size classes: the driver copies the whole parameter block at every launch.
  if (args.num_pairs <= 128) return launch_inline<128>(args, planes, pairs, ctas, threads, stream, programmatic);
  if (args.num_pairs <= 768) return launch_inline<768>(args, planes, pairs, ctas, threads, stream, programmatic);
  return launch_inline<kInlineMaxPairs>(args, planes, pairs, ctas, threads, stream, programmatic);
}

}  // namespace kvtier::copy_detail
