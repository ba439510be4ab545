// Synthetic device work for `kvtier bench transfer` and the transfer GPU
// tests: a compute-bound kernel standing in for one model layer, an
// HBM-bound kernel, and a bf16 tensor-core GEMM (hand-written WMMA: the
// toolkit here ships no static cuBLAS).
//
// On the host backend each is a task on the stream's worker that spins for a
// duration proportional to the work (so overlap logic runs on CI).
//
// Thread-safety: calls on different streams may run concurrently; the HBM
// and GEMM buffers are shared, so run those on one stream at a time.
#pragma once

#include <cstdint>
#include <memory>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"

namespace kvtier {

struct BenchComputeOptions {
  std::uint64_t hbm_bytes = std::uint64_t{1} << 30;  // CUDA: buffer size of the HBM kernel (x2: src, dst)
  std::uint32_t gemm_n = 8192;                       // CUDA: n of the n x n x n GEMM (multiple of 128)
  std::uint32_t fma_ctas = 0;                        // 0: 2 per SM
  std::uint32_t fma_threads = 256;
};

class BenchCompute {
 public:
  static Result<std::unique_ptr<BenchCompute>> create(Device& device, const BenchComputeOptions& options = {});
  virtual ~BenchCompute() = default;
  // Compute-bound work: CUDA: `work` dependent FMAs per thread on every CTA;
  // host: `work` nanoseconds of spinning.
  virtual Status fma(Stream& stream, std::uint64_t work) = 0;
  // One read + write pass over the HBM buffer (host: 200 us).
  virtual Status hbm(Stream& stream) = 0;
  // C = A x B, bf16 inputs, fp32 accumulate (host: 1 ms).
  virtual Status gemm(Stream& stream) = 0;
  virtual double gemm_flop() const noexcept = 0;
};

}  // namespace kvtier
