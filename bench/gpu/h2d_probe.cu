// h2d_probe: a standalone experiment (not part of the library) for the hardest
// H2D target: random scattered host->GPU blocks of 4-48 KiB at >= 93 % of
// the contiguous DMA ceiling. Measures, as ratios to the ceiling of the same run
// (p50 over reps, every variant verified byte-exact on sampled blocks against a
// poisoned destination):
//   A. the SM gather kernel with different load instructions: the question is
//      whether GPU-initiated reads of pinned host memory are capped at ~92.5 %
//      by the size of the read requests the L2 sends (128 B) and whether the
//      L2 prefetch-size qualifier (.L2::256B) or a bulk L2 prefetch
//      (cp.async.bulk.prefetch.L2) issues larger ones;
//   B. kernel + batched DMA on lane streams sharing one request, pre-queued
//      (the kernel's stream held by a spin kernel while the DMA part is
//      submitted by one thread per lane).
// Usage: h2d_probe [total_mib=256] [reps=5]; PROBE_ONLY=a,b; PROBE_SIZES=4096,...
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "probe_common.cuh"

template <int L>
__device__ __forceinline__ int4 load16(const int4* p) {
  int4 r;
  if constexpr (L == 0) {
    r = __ldcs(p);
  } else if constexpr (L == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else if constexpr (L == 2) {
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else if constexpr (L == 3) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else if constexpr (L == 4) {
    asm volatile("ld.global.cs.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.cg.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  }
  return r;
}

__device__ __forceinline__ void bulk_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// One warp per block; U 16-byte loads in flight per thread. PF: 0 none,
// 1 lane 0 bulk-prefetches the warp's next block into L2, 2 the current one.
template <int L, int U, int PF>
__global__ void gather_kernel(const char* __restrict__ src, char* __restrict__ dst, const int* __restrict__ sid,
                              const int* __restrict__ did, int first, int n, int block_bytes) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const int vecs = block_bytes / 16;
  if (PF == 1 && lane == 0 && first + warp < n)
    bulk_prefetch_l2(src + (size_t)sid[first + warp] * block_bytes, block_bytes);
  for (int b = first + warp; b < n; b += nwarps) {
    if (PF == 1 && lane == 0 && b + nwarps < n)
      bulk_prefetch_l2(src + (size_t)sid[b + nwarps] * block_bytes, block_bytes);
    if (PF == 2 && lane == 0) bulk_prefetch_l2(src + (size_t)sid[b] * block_bytes, block_bytes);
    const int4* s = reinterpret_cast<const int4*>(src + (size_t)sid[b] * block_bytes);
    int4* d = reinterpret_cast<int4*>(dst + (size_t)did[b] * block_bytes);
    for (int base = 0; base < vecs; base += 32 * U) {
      int4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int i = base + u * 32 + lane;
        if (i < vecs) r[u] = load16<L>(s + i);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int i = base + u * 32 + lane;
        if (i < vecs) __stcs(d + i, r[u]);
      }
    }
  }
}

using KernelFn = void (*)(const char*, char*, const int*, const int*, int, int, int);

struct Variant {
  const char* name;
  KernelFn fn;
};

int main(int argc, char** argv) {
  const size_t total = (argc > 1 ? std::atoll(argv[1]) : 256) << 20;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const size_t pool = size_t{2} << 30;
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const char* only = std::getenv("PROBE_ONLY");
  auto want = [&](const char* what) { return only == nullptr || std::strstr(only, what) != nullptr; };
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device %s, %d SMs, %zu MiB per measurement, reps %d\n", prop.name, prop.multiProcessorCount,
              total >> 20, reps);
  char *dev, *host;
  CK(cudaMalloc(&dev, pool));
  CK(cudaHostAlloc(&host, pool, cudaHostAllocMapped | cudaHostAllocPortable));
  {
    std::mt19937_64 rng(42);
    auto* p = reinterpret_cast<uint64_t*>(host);
    for (size_t i = 0; i < pool / 8; ++i) p[i] = rng();
  }
  CK(cudaMemset(dev, 0x5A, pool));
  int lo, hi;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t s1;
  CK(cudaStreamCreateWithPriority(&s1, cudaStreamNonBlocking, hi));
  constexpr int kMaxLanes = 3;
  cudaStream_t lanes[kMaxLanes];
  cudaEvent_t lane_done[kMaxLanes];
  for (int i = 0; i < kMaxLanes; ++i) {
    CK(cudaStreamCreateWithPriority(&lanes[i], cudaStreamNonBlocking, hi));
    CK(cudaEventCreateWithFlags(&lane_done[i], cudaEventDisableTiming));
  }
  cudaEvent_t ea, eb;
  CK(cudaEventCreate(&ea));
  CK(cudaEventCreate(&eb));
  unsigned* flag;
  CK(cudaHostAlloc(&flag, 64, cudaHostAllocMapped));
  auto gbps = [&](double ms) { return total / (ms * 1e-3) / 1e9; };
  auto time_plain = [&](const std::function<void()>& enqueue) {
    std::vector<double> v;
    for (int r = 0; r < reps + 1; ++r) {
      CK(cudaStreamSynchronize(s1));
      CK(cudaEventRecord(ea, s1));
      enqueue();
      CK(cudaEventRecord(eb, s1));
      CK(cudaEventSynchronize(eb));
      float ms;
      CK(cudaEventElapsedTime(&ms, ea, eb));
      if (r > 0) v.push_back(ms);
    }
    return p50(v);
  };
  const double ceiling = gbps(time_plain([&] { CK(cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, s1)); }));
  std::printf("ceiling h2d %.2f GB/s\n", ceiling);

  const Variant variants[] = {
      {"cs", gather_kernel<0, 4, 0>},
      {"nc.L2::256B", gather_kernel<1, 4, 0>},
      {"L2::256B", gather_kernel<2, 4, 0>},
      {"nc.L2::128B", gather_kernel<3, 4, 0>},
      {"cs.L2::256B", gather_kernel<4, 4, 0>},
      {"cg.L2::256B", gather_kernel<5, 4, 0>},
      {"cs+pf_next", gather_kernel<0, 4, 1>},
      {"cs+pf_cur", gather_kernel<0, 4, 2>},
      {"nc256+pf_next", gather_kernel<1, 4, 1>},
      {"cs u8", gather_kernel<0, 8, 0>},
      {"nc.L2::256B u8", gather_kernel<1, 8, 0>},
  };

  const std::vector<size_t> sizes = probe_sizes({4096, 8192, 16384, 32768, 49152});
  int* ids_d;
  CK(cudaMalloc(&ids_d, sizeof(int) * 2 * (total / 4096)));
  for (size_t bs : sizes) {
    const int n = static_cast<int>(total / bs);
    const int nblk = static_cast<int>(pool / bs);
    std::mt19937 rng(static_cast<unsigned>(bs));
    std::vector<int> sid, did;
    random_pairs(rng, nblk, n, sid, did);
    CK(cudaMemcpy(ids_d, sid.data(), sizeof(int) * n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ids_d + n, did.data(), sizeof(int) * n, cudaMemcpyHostToDevice));
    const int* sid_d = ids_d;
    const int* did_d = ids_d + n;
    auto verify = [&](const char* what) {
      CK(cudaDeviceSynchronize());
      std::vector<char> tmp(bs);
      bool ok = true;
      for (int k = 0; k < 256 && ok; ++k) {
        int i = static_cast<int>((static_cast<long long>(k) * 7919) % n);
        if (k == 0) i = 0;
        if (k == 1) i = n - 1;
        CK(cudaMemcpy(tmp.data(), dev + (size_t)did[i] * bs, bs, cudaMemcpyDeviceToHost));
        if (std::memcmp(tmp.data(), host + (size_t)sid[i] * bs, bs) != 0) {
          std::printf("VERIFY FAILED %s bs=%zu pair %d\n", what, bs, i);
          ok = false;
        }
      }
      CK(cudaMemset(dev, 0x5A, pool));
      CK(cudaDeviceSynchronize());
    };
    if (want("a")) {
      for (const Variant& v : variants)
        for (int ctas : {16, 32}) {
          const double ms = time_plain([&] {
            v.fn<<<ctas, 512, 0, s1>>>(host, dev, sid_d, did_d, 0, n, (int)bs);
            CK(cudaGetLastError());
          });
          std::printf("A bs=%5zuK %-16s ctas=%2d %6.2f GB/s ratio %.3f\n", bs >> 10, v.name, ctas, gbps(ms),
                      gbps(ms) / ceiling);
          verify(v.name);
        }
    }
    if (want("c")) {
      // CPU cost of cudaMemcpyBatchAsync per descriptor: 16384 descriptors
      // submitted to held streams (a spin kernel waits for a host flag), by
      // attribute variant, descriptors per call and submitting threads.
      const int nd = std::min(n, 16384);
      std::vector<void*> dsts(nd), srcs(nd);
      std::vector<size_t> szs(nd, bs);
      for (int i = 0; i < nd; ++i) {
        srcs[i] = host + (size_t)sid[i] * bs;
        dsts[i] = dev + (size_t)did[i] * bs;
      }
      for (int hints : {0, 1})
        for (int overlap : {0, 1})
          for (int chunk : {256, 2048})
            for (int threads : {1, 2, 3}) {
              if ((hints != 1 || overlap != 1) && (chunk != 2048 || threads != 1)) continue;
              cudaMemcpyAttributes attr{};
              attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
              if (overlap) attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
              if (hints) {
                attr.srcLocHint.type = cudaMemLocationTypeHost;
                attr.dstLocHint.type = cudaMemLocationTypeDevice;
                attr.dstLocHint.id = 0;
              }
              std::vector<double> us;
              for (int r = 0; r < 3; ++r) {
                CK(cudaDeviceSynchronize());
                *reinterpret_cast<volatile unsigned*>(flag) = 0;
                for (int t = 0; t < threads; ++t) spin_kernel<<<1, 1, 0, lanes[t]>>>(flag);
                const auto t0 = std::chrono::steady_clock::now();
                std::vector<std::thread> th;
                for (int t = 0; t < threads; ++t)
                  th.emplace_back([&, t] {
                    size_t idx = 0;
                    const int lo_i = nd * t / threads, hi_i = nd * (t + 1) / threads;
                    for (int off = lo_i; off < hi_i; off += chunk) {
                      const int c = std::min(chunk, hi_i - off);
                      CK(cudaMemcpyBatchAsync(dsts.data() + off, (const void**)srcs.data() + off, szs.data() + off, c,
                                              &attr, &idx, 1, lanes[t]));
                    }
                  });
                for (auto& t : th) t.join();
                const double wall =
                    std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
                *reinterpret_cast<volatile unsigned*>(flag) = 1;
                CK(cudaDeviceSynchronize());
                us.push_back(wall);
              }
              const double w = p50(us);
              std::printf(
                  "C bs=%5zuK hints=%d overlap=%d chunk=%5d threads=%d wall %.0f us for %d desc: %.3f us/desc wall, "
                  "%.3f us/desc cpu\n",
                  bs >> 10, hints, overlap, chunk, threads, w, nd, w / nd, w * threads / nd);
            }
      // Check the first and last submitted descriptor, then re-poison.
      CK(cudaDeviceSynchronize());
      std::vector<char> tmp(bs);
      for (int i : {0, nd - 1}) {
        CK(cudaMemcpy(tmp.data(), dev + (size_t)did[i] * bs, bs, cudaMemcpyDeviceToHost));
        if (std::memcmp(tmp.data(), host + (size_t)sid[i] * bs, bs) != 0)
          std::printf("VERIFY FAILED batch bs=%zu pair %d\n", bs, i);
      }
      CK(cudaMemset(dev, 0x5A, pool));
    }
    if (want("b")) {
      // Split: pairs [0, k) by DMA (lanes equal parts), [k, n) by the kernel.
      std::vector<void*> dsts(n), srcs(n);
      std::vector<size_t> szs(n, bs);
      for (int i = 0; i < n; ++i) {
        srcs[i] = host + (size_t)sid[i] * bs;
        dsts[i] = dev + (size_t)did[i] * bs;
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      attr.srcLocHint.type = cudaMemLocationTypeHost;
      attr.dstLocHint.type = cudaMemLocationTypeDevice;
      attr.dstLocHint.id = 0;
      size_t attr_idx = 0;
      const int kern_variants[] = {0, 1};
      for (int kv : kern_variants)
        for (int nl : {1, 2, 3})
          for (double share : {0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.2, 0.0}) {
            if (bs <= 8192 && share < 0.5) continue;
            if (kv == 1 && !(std::strstr(variants[1].name, "256"))) continue;
            const int k = static_cast<int>(n * (1.0 - share));
            std::vector<double> v;
            double api_ms = 0;
            for (int r = 0; r < reps + 1; ++r) {
              CK(cudaDeviceSynchronize());
              *reinterpret_cast<volatile unsigned*>(flag) = 0;
              spin_kernel<<<1, 1, 0, s1>>>(flag);
              CK(cudaEventRecord(ea, s1));
              std::atomic<int> ready{0};
              std::vector<std::thread> th;
              const auto t0 = std::chrono::steady_clock::now();
              for (int l = 0; l < nl; ++l) {
                th.emplace_back([&, l] {
                  CK(cudaStreamWaitEvent(lanes[l], ea, 0));
                  const int lo_i = static_cast<int>(static_cast<long long>(k) * l / nl);
                  const int hi_i = static_cast<int>(static_cast<long long>(k) * (l + 1) / nl);
                  int submitted = 0;
                  for (int off = lo_i; off < hi_i; off += 512) {
                    const int c = std::min(512, hi_i - off);
                    CK(cudaMemcpyBatchAsync(dsts.data() + off, (const void**)srcs.data() + off, szs.data() + off, c,
                                            &attr, &attr_idx, 1, lanes[l]));
                    submitted += c;
                    if (submitted >= 512 && submitted - c < 512) ready.fetch_add(1);
                  }
                  if (submitted < 512) ready.fetch_add(1);
                  CK(cudaEventRecord(lane_done[l], lanes[l]));
                });
              }
              if (k < n) {
                variants[kv].fn<<<16, 512, 0, s1>>>(host, dev, sid_d, did_d, k, n, (int)bs);
                CK(cudaGetLastError());
              }
              while (ready.load() < nl) std::this_thread::yield();
              std::atomic_thread_fence(std::memory_order_seq_cst);
              *reinterpret_cast<volatile unsigned*>(flag) = 1;
              for (auto& t : th) t.join();
              api_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
              for (int l = 0; l < nl; ++l) CK(cudaStreamWaitEvent(s1, lane_done[l], 0));
              CK(cudaEventRecord(eb, s1));
              CK(cudaEventSynchronize(eb));
              float ms;
              CK(cudaEventElapsedTime(&ms, ea, eb));
              if (r > 0) v.push_back(ms);
            }
            const double g = gbps(p50(v));
            std::printf("B bs=%5zuK kern=%-12s lanes=%d share=%.1f %6.2f GB/s ratio %.3f api %.1f ms\n", bs >> 10,
                        variants[kv].name, nl, share, g, g / ceiling, api_ms / (reps + 1));
            verify("split");
          }
    }
  }
  std::printf("# done\n");
  return 0;
}
