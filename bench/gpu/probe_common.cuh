// Shared by the standalone GPU probes (copy_probe.cu, h2d_probe.cu, host_pages_probe.cu): error
// check that exits (probes are not library code), a spin kernel that holds a
// stream until a mapped host flag is set (2 s watchdog), the plain block
// gather kernel, and the median.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

using u64 = unsigned long long;

__global__ void spin_kernel(volatile unsigned* flag) {
  u64 start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*flag == 0) {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 2000000000ull) break;
    __nanosleep(200);
  }
}

// Gather/scatter of scattered blocks: one warp per block (sid[b] -> did[b]),
// U 16-byte streaming loads in flight per thread.
template <int U>
__global__ void gather_kernel(const char* __restrict__ src, char* __restrict__ dst, const int* __restrict__ sid,
                              const int* __restrict__ did, int n, int block_bytes) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const int vecs = block_bytes / 16;
  for (int b = warp; b < n; b += nwarps) {
    const int4* s = reinterpret_cast<const int4*>(src + (size_t)sid[b] * block_bytes);
    int4* d = reinterpret_cast<int4*>(dst + (size_t)did[b] * block_bytes);
    for (int base = 0; base < vecs; base += 32 * U) {
      int4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int i = base + u * 32 + lane;
        if (i < vecs) r[u] = __ldcs(s + i);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int i = base + u * 32 + lane;
        if (i < vecs) __stcs(d + i, r[u]);
      }
    }
  }
}

static double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Block sizes from PROBE_SIZES (comma-separated bytes), else `defaults`.
static std::vector<size_t> probe_sizes(std::vector<size_t> defaults) {
  const char* list = std::getenv("PROBE_SIZES");
  if (list == nullptr) return defaults;
  std::vector<size_t> sizes;
  for (const char* q = list; *q;) {
    sizes.push_back(std::strtoull(q, const_cast<char**>(&q), 10));
    if (*q == ',') ++q;
  }
  return sizes;
}

// n distinct random source ids and n distinct random destination ids in
// [0, pool_blocks), drawn from `rng`.
static void random_pairs(std::mt19937& rng, int pool_blocks, int n, std::vector<int>& sid, std::vector<int>& did) {
  std::vector<int> perm(pool_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  sid.assign(perm.begin(), perm.begin() + n);
  std::shuffle(perm.begin(), perm.end(), rng);
  did.assign(perm.begin(), perm.begin() + n);
}
