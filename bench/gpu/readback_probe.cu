// readback_probe: a standalone experiment (not part of the library) for the
// device lane's landed-bytes check. The lane copies each layer's scattered
// blocks with a kernel that folds the source words into per-block checksums,
// then reads the destination once more on a second stream (the read-back) and
// compares. That third pass over the bytes holds the lane near 0.8 of a plain
// gather. The question here: does reading each warp's previous work item back
// inside the copy kernel, one whole item behind its stores (so the stores have
// reached L2 and the lines are still there), cost less than the separate pass?
//
// Variants, each over the same scattered block lists, per layer one launch
// (or two: copy, then read-back on a second stream behind an event), p50 GB/s
// of moved bytes over reps:
//   gather        plain copy (streaming loads and stores), the reference
//   copy+ck       the copy folding the source words into checksums
//   copy+ck, rb   copy+ck, then the read-back pass on a second stream (today's lane)
//   fused/I       copy+ck with the previous item read back in the same warp,
//                 items of I bytes; `cs` = streaming (evict-first) stores,
//                 `wb` = default stores, the read-back after the copy;
//                 `il` = default stores, the read-back's loads issued beside
//                 the copy's source loads (the library's kernel for CTAs of
//                 at most 512 threads; its 1024-thread build reads back after)
// Every variant is verified: destinations poisoned before each variant, all
// destination blocks compared with their sources on the GPU afterwards, and
// every block's landed checksum equal to its copied one (and to a CPU
// reference for the first layer).
// Usage: readback_probe [layer_mib=64] [layers=8] [reps=5]; PROBE_SIZES=16384,1048576; PROBE_CTAS=32,132
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I. -cudart static bench/gpu/readback_probe.cu
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "copy/kernel_plan.h"
#include "probe_common.cuh"

using kvtier::copy_detail::checksum_word;

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

struct Item {
  const uint4* src;
  uint4* dst;
  unsigned vecs;
  unsigned block;               // index in the layer's list (checksum slot)
  unsigned long long position;  // byte offset of the item in its block
};

__device__ __forceinline__ Item item_at(const char* src, char* dst, const int* sid, const int* did, int block_bytes,
                                        int item_bytes, long long k) {
  const int per_block = block_bytes / item_bytes;
  const long long b = k / per_block;
  const int part = static_cast<int>(k % per_block);
  Item it;
  it.src = reinterpret_cast<const uint4*>(src + static_cast<size_t>(sid[b]) * block_bytes + size_t(part) * item_bytes);
  it.dst = reinterpret_cast<uint4*>(dst + static_cast<size_t>(did[b]) * block_bytes + size_t(part) * item_bytes);
  it.vecs = item_bytes / 16;
  it.block = static_cast<unsigned>(b);
  it.position = static_cast<unsigned long long>(part) * item_bytes;
  return it;
}

__device__ __forceinline__ u64 word_sum(const uint4& v, u64 position) {
  return checksum_word(u64{v.x} | (u64{v.y} << 32), u64{v.z} | (u64{v.w} << 32), position);
}

__device__ __forceinline__ void warp_add(u64* slot, u64 acc) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(slot, acc);
}

// mode 0: copy; 1: copy + checksum; 2: read + checksum of dst (the read-back pass);
// 3: copy + checksum + previous item read back (streaming stores); 4: the same with default stores;
// 5: as 4, with the previous item's read-back loads issued beside this item's source loads.
template <int kMode>
__global__ void __launch_bounds__(kThreads)
    probe_kernel(const char* src, char* dst, const int* sid, const int* did, int n, int block_bytes, int item_bytes,
                 u64* copied, u64* landed) {
  const unsigned lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  const long long items = static_cast<long long>(n) * (block_bytes / item_bytes);
  long long previous = -1;
  if constexpr (kMode == 5) {
    // Interleaved: the previous item's read-back loads go out with this item's source loads.
    Item p{};
    bool have = false;
    for (long long k = warp; k < items + warps; k += warps) {
      const bool cur = k < items;
      Item it{};
      if (cur) it = item_at(src, dst, sid, did, block_bytes, item_bytes, k);
      const unsigned nc = cur ? it.vecs : 0, np = have ? p.vecs : 0;
      const unsigned n = nc > np ? nc : np;
      u64 acc = 0, back = 0;
      for (unsigned e = lane; e < n; e += kUnroll * 32) {
        uint4 v[kUnroll], r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const unsigned i = e + u * 32;
          if (i < nc) v[u] = __ldcs(it.src + i);
          if (i < np) r[u] = __ldcg(p.dst + i);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const unsigned i = e + u * 32;
          if (i < nc) {
            it.dst[i] = v[u];
            acc += word_sum(v[u], it.position + u64{i} * 16);
          }
          if (i < np) back += word_sum(r[u], p.position + u64{i} * 16);
        }
      }
      if (cur) warp_add(copied + it.block, acc);
      if (have) warp_add(landed + p.block, back);
      p = it;
      have = cur;
    }
    return;
  }
  for (long long k = warp; k < items; k += warps) {
    const Item it = item_at(src, dst, sid, did, block_bytes, item_bytes, k);
    u64 acc = 0;
    for (unsigned e = lane; e < it.vecs; e += kUnroll * 32) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const unsigned i = e + u * 32;
        if (i < it.vecs) v[u] = kMode == 2 ? __ldcg(it.dst + i) : __ldcs(it.src + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const unsigned i = e + u * 32;
        if (i >= it.vecs) continue;
        if constexpr (kMode == 0 || kMode == 1 || kMode == 3) __stcs(it.dst + i, v[u]);
        if constexpr (kMode == 4) it.dst[i] = v[u];
        if constexpr (kMode != 0) acc += word_sum(v[u], it.position + u64{i} * 16);
      }
    }
    if constexpr (kMode != 0) warp_add((kMode == 2 ? landed : copied) + it.block, acc);
    if constexpr (kMode >= 3) {
      if (previous >= 0) {
        const Item p = item_at(src, dst, sid, did, block_bytes, item_bytes, previous);
        u64 back = 0;
        for (unsigned e = lane; e < p.vecs; e += kUnroll * 32) {
          uint4 v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (e + u * 32 < p.vecs) v[u] = __ldcg(p.dst + e + u * 32);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (e + u * 32 < p.vecs) back += word_sum(v[u], p.position + u64{e + u * 32} * 16);
        }
        warp_add(landed + p.block, back);
      }
      previous = k;
    }
  }
  if constexpr (kMode >= 3 && kMode != 5) {
    if (previous >= 0) {  // the warp's last item
      const Item p = item_at(src, dst, sid, did, block_bytes, item_bytes, previous);
      u64 back = 0;
      for (unsigned e = lane; e < p.vecs; e += 32) back += word_sum(__ldcg(p.dst + e), p.position + u64{e} * 16);
      warp_add(landed + p.block, back);
    }
  }
}

// Counts destination blocks whose bytes differ from their sources.
__global__ void compare_kernel(const char* src, const char* dst, const int* sid, const int* did, int n, int block_bytes,
                               unsigned* bad) {
  for (long long b = blockIdx.x; b < n; b += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(src + static_cast<size_t>(sid[b]) * block_bytes);
    const uint4* d = reinterpret_cast<const uint4*>(dst + static_cast<size_t>(did[b]) * block_bytes);
    int diff = 0;
    for (int i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) {
      const uint4 x = s[i], y = d[i];
      diff |= (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
    }
    if (__syncthreads_or(diff) && threadIdx.x == 0) atomicAdd(bad, 1u);
  }
}

__global__ void fill_kernel(unsigned* p, size_t words, unsigned seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    p[i] = x ^ (x >> 13);
  }
}

template <int kMode>
void launch(int ctas, cudaStream_t s, const char* src, char* dst, const int* sid, const int* did, int n, int bb, int ib,
            u64* copied, u64* landed) {
  probe_kernel<kMode><<<ctas, kThreads, 0, s>>>(src, dst, sid, did, n, bb, ib, copied, landed);
  CK(cudaGetLastError());
}

}  // namespace

int main(int argc, char** argv) {
  const size_t layer_bytes = size_t(argc > 1 ? std::atoi(argv[1]) : 64) << 20;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 8;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::vector<int> cta_list = {32, 132};
  if (const char* c = std::getenv("PROBE_CTAS")) {
    cta_list.clear();
    for (const char* q = c; *q;) {
      cta_list.push_back(static_cast<int>(std::strtol(q, const_cast<char**>(&q), 10)));
      if (*q == ',') ++q;
    }
  }
  const size_t pool_bytes = layer_bytes * layers * 4;  // listed blocks are a quarter of the pool
  char *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, pool_bytes));
  CK(cudaMalloc(&dst, pool_bytes));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<unsigned*>(src), pool_bytes / 4, 0x1234u);
  CK(cudaGetLastError());
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  std::vector<cudaEvent_t> layer_done(layers);
  for (auto& e : layer_done) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  unsigned* bad = nullptr;
  CK(cudaMallocManaged(&bad, sizeof(unsigned)));

  std::printf("%-8s %-5s %-16s %10s %8s %s\n", "block", "ctas", "variant", "GB/s", "/gather", "check");
  for (size_t block_bytes : probe_sizes({16384, 1048576})) {
    const int n = static_cast<int>(layer_bytes / block_bytes);
    const size_t pool_blocks = pool_bytes / block_bytes;
    size_t stride = pool_blocks / n / 2 * 2 + 1;  // odd, about pool / n: scattered, never adjacent
    while (std::gcd(stride, pool_blocks) != 1) stride += 2;
    std::vector<int> h_sid(size_t(n) * layers), h_did(size_t(n) * layers);
    for (size_t i = 0; i < h_sid.size(); ++i) {
      h_sid[i] = static_cast<int>((i * stride + 7) % pool_blocks);
      h_did[i] = static_cast<int>((i * stride * 3 + 11) % pool_blocks);
    }
    int *sid = nullptr, *did = nullptr;
    CK(cudaMalloc(&sid, h_sid.size() * sizeof(int)));
    CK(cudaMalloc(&did, h_did.size() * sizeof(int)));
    CK(cudaMemcpy(sid, h_sid.data(), h_sid.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(did, h_did.data(), h_did.size() * sizeof(int), cudaMemcpyHostToDevice));
    u64 *copied = nullptr, *landed = nullptr;
    CK(cudaMalloc(&copied, h_sid.size() * sizeof(u64)));
    CK(cudaMalloc(&landed, h_sid.size() * sizeof(u64)));

    // CPU reference of the first layer's checksums (items do not change a block's sum).
    std::vector<u64> reference(n, 0);
    {
      std::vector<unsigned char> host(block_bytes);
      for (int b = 0; b < n; ++b) {
        CK(cudaMemcpy(host.data(), src + size_t(h_sid[b]) * block_bytes, block_bytes, cudaMemcpyDeviceToHost));
        for (size_t w = 0; w < block_bytes / 16; ++w) {
          u64 lo, hi;
          std::memcpy(&lo, host.data() + 16 * w, 8);
          std::memcpy(&hi, host.data() + 16 * w + 8, 8);
          reference[b] += checksum_word(lo, hi, 16 * w);
        }
      }
    }

    for (int ctas : cta_list) {
      double gather_gbps = 0;
      struct Variant {
        const char* name;
        int mode;  // 0 gather, 1 copy+ck, 2 copy+ck then read-back pass, 3/4 fused
        int item;
      };
      std::vector<Variant> variants = {{"gather", 0, 65536}, {"copy+ck", 1, 65536}, {"copy+ck, rb", 2, 65536}};
      for (int item : {2048, 4096, 8192, 16384})
        if (size_t(item) <= block_bytes) variants.push_back({nullptr, 4, item});
      variants.push_back({nullptr, 3, 4096});
      for (int item : {4096, 8192, 16384})
        if (size_t(item) <= block_bytes) variants.push_back({nullptr, 5, item});
      for (const Variant& v : variants) {
        const int item = static_cast<int>(std::min<size_t>(v.item, block_bytes));
        std::string name = v.name ? v.name
                                  : std::string("fused/") + std::to_string(item / 1024) + "K " +
                                        (v.mode == 3   ? "cs"
                                         : v.mode == 5 ? "il"
                                                       : "wb");
        std::vector<double> gbps;
        bool sums_ok = true;
        unsigned mismatched = 0;
        for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up, then verified and timed
          CK(cudaMemsetAsync(dst, 0xA5, pool_bytes, s0));
          CK(cudaMemsetAsync(copied, 0, h_sid.size() * sizeof(u64), s0));
          CK(cudaMemsetAsync(landed, 0, h_sid.size() * sizeof(u64), s0));
          CK(cudaStreamSynchronize(s0));
          CK(cudaEventRecord(t0, s0));
          for (int l = 0; l < layers; ++l) {
            const int* ls = sid + size_t(l) * n;
            const int* ld = did + size_t(l) * n;
            u64* lc = copied + size_t(l) * n;
            u64* ll = landed + size_t(l) * n;
            switch (v.mode) {
              case 0: launch<0>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll); break;
              case 1: launch<1>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll); break;
              case 2:
                launch<1>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll);
                CK(cudaEventRecord(layer_done[l], s0));
                CK(cudaStreamWaitEvent(s1, layer_done[l], 0));
                launch<2>(ctas, s1, src, dst, ls, ld, n, block_bytes, item, lc, ll);
                break;
              case 5: launch<5>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll); break;
              case 3: launch<3>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll); break;
              default: launch<4>(ctas, s0, src, dst, ls, ld, n, block_bytes, item, lc, ll); break;
            }
          }
          CK(cudaEventRecord(layer_done[0], s1));
          CK(cudaStreamWaitEvent(s0, layer_done[0], 0));
          CK(cudaEventRecord(t1, s0));
          CK(cudaEventSynchronize(t1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, t0, t1));
          if (r > 0) gbps.push_back(double(layer_bytes) * layers / (ms * 1e-3) / 1e9);
          *bad = 0;
          compare_kernel<<<1024, 256, 0, s0>>>(src, dst, sid, did, n * layers, block_bytes, bad);
          CK(cudaGetLastError());
          CK(cudaStreamSynchronize(s0));
          mismatched += *bad;
          if (v.mode >= 1) {
            std::vector<u64> c(h_sid.size()), d(h_sid.size());
            CK(cudaMemcpy(c.data(), copied, c.size() * sizeof(u64), cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(d.data(), landed, d.size() * sizeof(u64), cudaMemcpyDeviceToHost));
            for (int b = 0; b < n; ++b) sums_ok &= c[b] == reference[b];
            if (v.mode >= 2)
              for (size_t i = 0; i < c.size(); ++i) sums_ok &= c[i] == d[i];
          }
        }
        const double g = p50(gbps);
        if (v.mode == 0) gather_gbps = g;
        std::printf("%-8zu %-5d %-16s %10.1f %8.2f %s\n", block_bytes, ctas, name.c_str(), g, g / gather_gbps,
                    mismatched == 0 && sums_ok ? "bytes+sums ok" : "MISMATCH");
        std::fflush(stdout);
      }
    }
    CK(cudaFree(sid));
    CK(cudaFree(did));
    CK(cudaFree(copied));
    CK(cudaFree(landed));
  }
  return 0;
}
