#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "backends/cuda/cuda_check.h"
#include "sim/cuda/bench_kernels.h"

namespace kvtier::bench_cuda {
namespace {

__global__ void fma_kernel(float* sink, std::uint64_t iters) {
  float a = 1.0f + threadIdx.x * 1e-6f, b = 0.999999f, c = 1e-7f;
  float x0 = a, x1 = a + 1, x2 = a + 2, x3 = a + 3;
  for (std::uint64_t i = 0; i < iters; ++i) {
    x0 = fmaf(x0, b, c);
    x1 = fmaf(x1, b, c);
    x2 = fmaf(x2, b, c);
    x3 = fmaf(x3, b, c);
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = x0 + x1 + x2 + x3;
}

__global__ void hbm_kernel(const float4* __restrict__ src, float4* __restrict__ dst, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    float4 v = src[i];
    v.x *= 1.0001f;
    v.y *= 1.0001f;
    v.z *= 1.0001f;
    v.w *= 1.0001f;
    dst[i] = v;
  }
}

__global__ void fill_kernel(__nv_bfloat16* dst, std::uint64_t n, std::uint32_t seed) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed * 40503u;
    h ^= h >> 13;
    dst[i] = __float2bfloat16(static_cast<float>(h & 255) / 256.0f - 0.5f);
  }
}

// 128 x 128 tile per CTA, 4 warps in 2 x 2, each warp 64 x 64 (4 x 4 WMMA
// fragments of 16 x 16), K step 32 staged through shared memory.
constexpr int kTile = 128;
constexpr int kK = 32;

__global__ void __launch_bounds__(128)
    gemm_bf16_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, float* __restrict__ c,
                     int n) {
  using namespace nvcuda;
  __shared__ __align__(32) __nv_bfloat16 sa[kTile][kK + 8];
  __shared__ __align__(32) __nv_bfloat16 sb[kK][kTile + 8];
  const int warp = threadIdx.x / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  for (int k0 = 0; k0 < n; k0 += kK) {
    // A tile: 128 x 32 bf16 = 512 x 16 B; B tile: 32 x 128 bf16 = 512 x 16 B.
    for (int v = threadIdx.x; v < 512; v += 128) {
      int r = v / 4, cc = (v % 4) * 8;
      *reinterpret_cast<int4*>(&sa[r][cc]) =
          *reinterpret_cast<const int4*>(&a[static_cast<std::size_t>(row0 + r) * n + k0 + cc]);
      int rb = v / 16, cb = (v % 16) * 8;
      *reinterpret_cast<int4*>(&sb[rb][cb]) =
          *reinterpret_cast<const int4*>(&b[static_cast<std::size_t>(k0 + rb) * n + col0 + cb]);
    }
    __syncthreads();
    for (int kk = 0; kk < kK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[4];
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fa[i], &sa[wm * 64 + i * 16][kk], kK + 8);
      for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(fb[j], &sb[kk][wn * 64 + j * 16], kTile + 8);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(&c[static_cast<std::size_t>(row0 + wm * 64 + i * 16) * n + col0 + wn * 64 + j * 16],
                              acc[i][j], n, wmma::mem_row_major);
}

}  // namespace

Status launch_fma(Stream& stream, float* sink, std::uint32_t ctas, std::uint32_t threads, std::uint64_t iters) {
  cuda_detail::DeviceGuard guard(stream.device().ordinal());
  KVTIER_RETURN_IF_ERROR(guard.status());
  fma_kernel<<<ctas, threads, 0, cuda_detail::native(stream)>>>(sink, iters);
  KVTIER_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status launch_hbm(Stream& stream, const void* src, void* dst, std::uint64_t elems, std::uint32_t ctas) {
  cuda_detail::DeviceGuard guard(stream.device().ordinal());
  KVTIER_RETURN_IF_ERROR(guard.status());
  hbm_kernel<<<ctas, 512, 0, cuda_detail::native(stream)>>>(static_cast<const float4*>(src), static_cast<float4*>(dst),
                                                            elems);
  KVTIER_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status launch_gemm_bf16(Stream& stream, const void* a, const void* b, void* c, std::uint32_t n) {
  if (n == 0 || n % kTile != 0) return InvalidArgument("launch_gemm_bf16: n must be a positive multiple of 128");
  cuda_detail::DeviceGuard guard(stream.device().ordinal());
  KVTIER_RETURN_IF_ERROR(guard.status());
  dim3 grid(n / kTile, n / kTile);
  gemm_bf16_kernel<<<grid, 128, 0, cuda_detail::native(stream)>>>(static_cast<const __nv_bfloat16*>(a),
                                                                  static_cast<const __nv_bfloat16*>(b),
                                                                  static_cast<float*>(c), static_cast<int>(n));
  KVTIER_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status fill_bf16(Stream& stream, void* dst, std::uint64_t elems, std::uint32_t seed) {
  cuda_detail::DeviceGuard guard(stream.device().ordinal());
  KVTIER_RETURN_IF_ERROR(guard.status());
  fill_kernel<<<1024, 256, 0, cuda_detail::native(stream)>>>(static_cast<__nv_bfloat16*>(dst), elems, seed);
  KVTIER_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kvtier::bench_cuda
