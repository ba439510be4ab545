// CUDA kernels of BenchCompute (sim/bench_compute.h). Private to sim/.
#pragma once

#include <cstdint>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"

namespace kvtier::bench_cuda {

// `ctas` x `threads` threads, each `iters` dependent FMAs; writes `sink`.
Status launch_fma(Stream& stream, float* sink, std::uint32_t ctas, std::uint32_t threads, std::uint64_t iters);
// dst[i] = src[i] * 1.0001 over `elems` 16-byte elements (read + write pass).
Status launch_hbm(Stream& stream, const void* src, void* dst, std::uint64_t elems, std::uint32_t ctas);
// C[n x n] (fp32) = A[n x n] x B[n x n] (bf16, row-major), n % 128 == 0. WMMA tensor cores.
Status launch_gemm_bf16(Stream& stream, const void* a, const void* b, void* c, std::uint32_t n);
// Fills a bf16 buffer with small pseudo-random values.
Status fill_bf16(Stream& stream, void* dst, std::uint64_t elems, std::uint32_t seed);

}  // namespace kvtier::bench_cuda
