// host_pages_probe: a standalone experiment (not part of the library). Does the
// page size behind pinned host memory change scattered-block copy speed? With
// 4 KiB pages a 32 KiB block is 8 translations for the GPU's MMU (and for the
// IOMMU, where one is on); transparent huge pages make it one. Per host-memory
// kind, as ratios to the contiguous ceiling of the same kind and run (p50 over
// reps, every variant verified byte-exact on sampled blocks against a poisoned
// destination):
//   - SM gather kernel H2D and scatter kernel D2H, random blocks,
//   - cudaMemcpyBatchAsync H2D, D2H and both directions at once, pre-queued
//     behind a held stream (the CPU's submission outside the timing).
// Kinds: cudaHostAlloc; mmap + MADV_NOHUGEPAGE + cudaHostRegister (4 KiB);
// mmap 2 MiB-aligned + MADV_HUGEPAGE + cudaHostRegister (THP); MAP_HUGETLB
// (only where huge pages are reserved). AnonHugePages of the process is
// printed so that a THP row shows whether it really got huge pages.
// Usage: host_pages_probe [total_mib=256] [reps=5]; PROBE_SIZES=4096,32768
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"

// Comma-separated numbers from the environment variable `name`, else `defaults`.
static std::vector<double> env_list(const char* name, std::vector<double> defaults) {
  const char* list = std::getenv(name);
  if (list == nullptr) return defaults;
  std::vector<double> v;
  for (const char* q = list; *q;) {
    v.push_back(std::strtod(q, const_cast<char**>(&q)));
    if (*q == ',')
      ++q;
    else if (*q)
      break;
  }
  return v;
}

static long anon_huge_kib() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string key;
  long value = 0;
  while (f >> key) {
    if (key == "AnonHugePages:") {
      f >> value;
      return value;
    }
    f.ignore(1 << 20, '\n');
  }
  return -1;
}

static std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

struct HostPool {
  char* ptr = nullptr;
  void* map = nullptr;
  size_t map_bytes = 0;
  bool registered = false;
  bool host_alloc = false;
};

// Returns false (and prints why) when this kind cannot be had here.
static bool make_pool(const std::string& kind, size_t bytes, HostPool& p) {
  constexpr size_t k2M = size_t{2} << 20;
  if (kind == "hostalloc") {
    CK(cudaHostAlloc(reinterpret_cast<void**>(&p.ptr), bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    p.host_alloc = true;
    return true;
  }
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  size_t map_bytes = bytes + k2M;
  if (kind == "hugetlb") {
    flags |= MAP_HUGETLB | (21 << MAP_HUGE_SHIFT);
    map_bytes = bytes;
  }
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (m == MAP_FAILED) {
    std::printf("# %s: mmap failed (%s), skipped\n", kind.c_str(), std::strerror(errno));
    return false;
  }
  p.map = m;
  p.map_bytes = map_bytes;
  char* base = static_cast<char*>(m);
  if (kind != "hugetlb") base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + k2M - 1) / k2M * k2M);
  if (kind == "thp" && madvise(base, bytes, MADV_HUGEPAGE) != 0)
    std::printf("# thp: madvise(MADV_HUGEPAGE) failed: %s\n", std::strerror(errno));
  if (kind == "mmap4k" && madvise(base, bytes, MADV_NOHUGEPAGE) != 0)
    std::printf("# mmap4k: madvise(MADV_NOHUGEPAGE) failed: %s\n", std::strerror(errno));
  // First touch in parallel, before registration pins the pages.
  std::vector<std::thread> th;
  const int nt = 16;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([=] {
      for (size_t off = bytes * t / nt; off < bytes * (t + 1) / nt; off += 4096) base[off] = 0;
    });
  for (auto& t : th) t.join();
  CK(cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  p.ptr = base;
  p.registered = true;
  return true;
}

static void free_pool(HostPool& p) {
  if (p.host_alloc) CK(cudaFreeHost(p.ptr));
  if (p.registered) CK(cudaHostUnregister(p.ptr));
  if (p.map != nullptr) munmap(p.map, p.map_bytes);
  p = HostPool{};
}

int main(int argc, char** argv) {
  const size_t total = (argc > 1 ? std::atoll(argv[1]) : 256) << 20;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const size_t pool = size_t{2} << 30;  // per side: [0, pool/2) sources, [pool/2, pool) destinations
  setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device %s, %d SMs, %zu MiB per measurement, reps %d\n", prop.name, prop.multiProcessorCount,
              total >> 20, reps);
  std::printf("# THP enabled: %s; defrag: %s; HugePages_Total (2M): %s\n",
              read_line("/sys/kernel/mm/transparent_hugepage/enabled").c_str(),
              read_line("/sys/kernel/mm/transparent_hugepage/defrag").c_str(),
              read_line("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").c_str());
  std::printf("# IOMMU groups present: %s\n",
              std::system("test -n \"$(ls -A /sys/kernel/iommu_groups 2>/dev/null)\"") == 0 ? "yes" : "no");
  int host_ptr_ok = 0;
  CK(cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, 0));
  if (!host_ptr_ok) {
    std::printf("# registered host memory needs cudaHostGetDevicePointer here: not supported by this probe\n");
    return 1;
  }
  char* dev;
  CK(cudaMalloc(&dev, pool));
  cudaStream_t st[4];
  cudaEvent_t ea, eb[4];
  CK(cudaEventCreate(&ea));
  for (int i = 0; i < 4; ++i) {
    CK(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking));
    CK(cudaEventCreate(&eb[i]));
  }
  cudaStream_t s1 = st[0], s2 = st[1];
  int *sid2_d, *did2_d;
  unsigned* flag;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 64, cudaHostAllocMapped));
  int *sid_d, *did_d;
  const int max_pairs = static_cast<int>(total / 4096);
  CK(cudaMalloc(&sid_d, max_pairs * sizeof(int)));
  CK(cudaMalloc(&did_d, max_pairs * sizeof(int)));
  CK(cudaMalloc(&sid2_d, max_pairs * sizeof(int)));
  CK(cudaMalloc(&did2_d, max_pairs * sizeof(int)));
  const std::vector<size_t> sizes = probe_sizes({4096, 32768});

  const char* kinds_env = std::getenv("PROBE_KINDS");
  for (const std::string kind : {"hostalloc", "mmap4k", "thp", "hugetlb"}) {
    if (kinds_env != nullptr && std::strstr(kinds_env, kind.c_str()) == nullptr) continue;
    const long huge0 = anon_huge_kib();
    HostPool hp;
    if (!make_pool(kind, pool, hp)) continue;
    char* host = hp.ptr;
    std::printf("# kind %s: AnonHugePages +%ld MiB\n", kind.c_str(), (anon_huge_kib() - huge0) / 1024);
    {
      std::mt19937_64 rng(42);
      auto* q = reinterpret_cast<uint64_t*>(host);
      for (size_t i = 0; i < pool / 2 / 8; ++i) q[i] = rng();
    }
    // Device sources: random too.
    CK(cudaMemcpy(dev, host, pool / 2, cudaMemcpyHostToDevice));
    char* const host_dst = host + pool / 2;
    char* const dev_dst = dev + pool / 2;

    // Times `enqueue` on held streams: st[0..k) wait for a spin kernel on
    // st[0]; the flag is set after everything is submitted.
    auto timed_k = [&](int k, const std::function<void()>& enqueue) {
      std::vector<double> v;
      for (int r = 0; r < reps + 1; ++r) {
        CK(cudaDeviceSynchronize());
        *reinterpret_cast<volatile unsigned*>(flag) = 0;
        spin_kernel<<<1, 1, 0, st[0]>>>(flag);
        CK(cudaGetLastError());
        CK(cudaEventRecord(ea, st[0]));
        for (int i = 1; i < k; ++i) CK(cudaStreamWaitEvent(st[i], ea, 0));
        enqueue();
        for (int i = 0; i < k; ++i) CK(cudaEventRecord(eb[i], st[i]));
        std::atomic_thread_fence(std::memory_order_seq_cst);
        *reinterpret_cast<volatile unsigned*>(flag) = 1;
        double worst = 0;
        for (int i = 0; i < k; ++i) {
          float ms;
          CK(cudaEventSynchronize(eb[i]));
          CK(cudaEventElapsedTime(&ms, ea, eb[i]));
          worst = std::max(worst, double(ms));
        }
        if (r > 0) v.push_back(worst);
      }
      return p50(v);
    };
    auto timed = [&](bool two, const std::function<void()>& enqueue) { return timed_k(two ? 2 : 1, enqueue); };
    auto gbps = [&](double bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; };
    const double c_h2d =
        gbps(total, timed(false, [&] { CK(cudaMemcpyAsync(dev_dst, host, total, cudaMemcpyHostToDevice, s1)); }));
    const double c_d2h =
        gbps(total, timed(false, [&] { CK(cudaMemcpyAsync(host_dst, dev, total, cudaMemcpyDeviceToHost, s1)); }));
    const double c_both = gbps(2.0 * total, timed(true, [&] {
                                 CK(cudaMemcpyAsync(dev_dst, host, total, cudaMemcpyHostToDevice, s1));
                                 CK(cudaMemcpyAsync(host_dst, dev, total, cudaMemcpyDeviceToHost, s2));
                               }));
    std::printf("%-9s ceiling h2d %.1f d2h %.1f both %.1f GB/s\n", kind.c_str(), c_h2d, c_d2h, c_both);

    for (const size_t bs : sizes) {
      const int n = static_cast<int>(total / bs);
      const int half_blocks = static_cast<int>(pool / 2 / bs);
      std::mt19937 rng(7 + static_cast<unsigned>(bs));
      std::vector<int> sid, did, sid2, did2;
      random_pairs(rng, half_blocks, n, sid, did);
      random_pairs(rng, half_blocks, n, sid2, did2);
      CK(cudaMemcpy(sid_d, sid.data(), n * sizeof(int), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(did_d, did.data(), n * sizeof(int), cudaMemcpyHostToDevice));
      int bad = 0;
      // Sampled check of pairs (src[s] -> dst[d]) against the source bytes.
      auto verify = [&](const char* what, const char* src_base, const char* dst_base, bool dst_on_device,
                        const std::vector<int>& s, const std::vector<int>& d) {
        std::vector<char> got(bs), want(bs);
        for (int i = 0; i < n; i += std::max(1, n / 64)) {
          const char* dp = dst_base + (size_t)d[i] * bs;
          const char* sp = src_base + (size_t)s[i] * bs;
          if (dst_on_device)
            CK(cudaMemcpy(got.data(), dp, bs, cudaMemcpyDeviceToHost));
          else
            std::memcpy(got.data(), dp, bs);
          if (src_base == host)
            std::memcpy(want.data(), sp, bs);
          else
            CK(cudaMemcpy(want.data(), sp, bs, cudaMemcpyDeviceToHost));
          if (std::memcmp(got.data(), want.data(), bs) != 0) {
            std::printf("VERIFY FAILED %s %s bs=%zu pair %d\n", kind.c_str(), what, bs, i);
            ++bad;
            return;
          }
        }
      };
      auto poison = [&] {
        CK(cudaMemset(dev_dst, 0x5A, pool / 2));
        std::memset(host_dst, 0xA5, pool / 2);
      };
      // SM kernels, 16 and 32 CTAs x 512 threads.
      for (int ctas : {16, 32}) {
        poison();
        const double kh = gbps(total, timed(false, [&] {
                                 gather_kernel<4><<<ctas, 512, 0, s1>>>(host, dev_dst, sid_d, did_d, n, (int)bs);
                                 CK(cudaGetLastError());
                               }));
        verify("sm_h2d", host, dev_dst, true, sid, did);
        const double kd = gbps(total, timed(false, [&] {
                                 gather_kernel<4><<<ctas, 512, 0, s1>>>(dev, host_dst, sid_d, did_d, n, (int)bs);
                                 CK(cudaGetLastError());
                               }));
        verify("sm_d2h", dev, host_dst, false, sid, did);
        std::printf("%-9s bs=%2zuK sm ctas=%d h2d %.1f (%.3f) d2h %.1f (%.3f)\n", kind.c_str(), bs >> 10, ctas, kh,
                    kh / c_h2d, kd, kd / c_d2h);
      }
      // Batched DMA, 2048 descriptors per call; from 16 KiB (smaller blocks
      // fill the driver's queue behind the held stream).
      if (bs < 16384) continue;
      std::vector<void*> hd(n), hs(n), dd(n), ds(n);
      for (int i = 0; i < n; ++i) {
        hs[i] = host + (size_t)sid[i] * bs;
        hd[i] = dev_dst + (size_t)did[i] * bs;
        ds[i] = dev + (size_t)sid2[i] * bs;
        dd[i] = host_dst + (size_t)did2[i] * bs;
      }
      std::vector<size_t> szs(n, bs);
      auto batch_range = [&](std::vector<void*>& d, std::vector<void*>& s, bool h2d, cudaStream_t stream, int lo,
                             int hi) {
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        attr.srcLocHint.type = h2d ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
        attr.dstLocHint.type = h2d ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
        size_t idx = 0;
        for (int off = lo; off < hi; off += 2048) {
          const int c = std::min(2048, hi - off);
          CK(cudaMemcpyBatchAsync(d.data() + off, (const void**)s.data() + off, szs.data() + off, c, &attr, &idx, 1,
                                  stream));
        }
      };
      auto batch = [&](std::vector<void*>& d, std::vector<void*>& s, bool h2d, cudaStream_t stream) {
        batch_range(d, s, h2d, stream, 0, n);
      };
      poison();
      const double bh = gbps(total, timed(false, [&] { batch(hd, hs, true, s1); }));
      verify("dma_h2d", host, dev_dst, true, sid, did);
      const double bd = gbps(total, timed(false, [&] { batch(dd, ds, false, s1); }));
      verify("dma_d2h", dev, host_dst, false, sid2, did2);
      poison();
      const double bb = gbps(2.0 * total, timed(true, [&] {
                               std::thread other([&] { batch(dd, ds, false, s2); });
                               batch(hd, hs, true, s1);
                               other.join();
                             }));
      verify("dma_both_h2d", host, dev_dst, true, sid, did);
      verify("dma_both_d2h", dev, host_dst, false, sid2, did2);
      std::printf("%-9s bs=%2zuK dma h2d %.1f (%.3f) d2h %.1f (%.3f) both %.1f GB/s (%.3f of both ceiling)%s\n",
                  kind.c_str(), bs >> 10, bh, bh / c_h2d, bd, bd / c_d2h, bb, bb / c_both, bad ? " BAD" : "");
      // Both directions at once, mixed mechanisms (first kind only): per
      // direction a kernel share k (pairs [n(1-k), n) by a 16-CTA kernel on
      // its own stream, the rest by batched DMA).
      if (kind != "hostalloc") continue;
      CK(cudaMemcpy(sid2_d, sid2.data(), n * sizeof(int), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(did2_d, did2.data(), n * sizeof(int), cudaMemcpyHostToDevice));
      const std::vector<double> h_shares = env_list("PROBE_MIX_H2D_SHARES", {0.0, 0.15, 0.3, 0.5, 1.0});
      const std::vector<double> d_shares = env_list("PROBE_MIX_D2H_SHARES", {0.0, 0.15, 0.3, 0.5, 1.0});
      const std::vector<double> d_ctas_list = env_list("PROBE_MIX_D2H_CTAS", {16});
      for (double kh : h_shares)
        for (double kd : d_shares)
          for (double d_ctas_v : d_ctas_list) {
            const int d_ctas = static_cast<int>(d_ctas_v);
            const int kh_first = static_cast<int>(n * (1.0 - kh)), kd_first = static_cast<int>(n * (1.0 - kd));
            poison();
            const double g = gbps(2.0 * total, timed_k(4, [&] {
                                    if (kh_first < n) {
                                      gather_kernel<4><<<16, 512, 0, st[2]>>>(host, dev_dst, sid_d + kh_first,
                                                                              did_d + kh_first, n - kh_first, (int)bs);
                                      CK(cudaGetLastError());
                                    }
                                    if (kd_first < n) {
                                      gather_kernel<4><<<d_ctas, 512, 0, st[3]>>>(
                                          dev, host_dst, sid2_d + kd_first, did2_d + kd_first, n - kd_first, (int)bs);
                                      CK(cudaGetLastError());
                                    }
                                    std::thread other([&] { batch_range(dd, ds, false, s2, 0, kd_first); });
                                    batch_range(hd, hs, true, s1, 0, kh_first);
                                    other.join();
                                  }));
            verify("mix_h2d", host, dev_dst, true, sid, did);
            verify("mix_d2h", dev, host_dst, false, sid2, did2);
            std::printf(
                "mix       bs=%2zuK h2d kernel share %.2f d2h kernel share %.2f (%2d CTAs): both %.1f GB/s (%.3f)%s\n",
                bs >> 10, kh, kd, d_ctas, g, g / c_both, bad ? " BAD" : "");
          }
    }
    free_pool(hp);
  }
  std::printf("# done\n");
  return 0;
}
