#include "sim/bench_compute.h"

#include <fmt/format.h>

#include <chrono>

#include "kvtier/device/host_device.h"
#if defined(KVTIER_WITH_CUDA)
#include "sim/cuda/bench_kernels.h"
#endif

namespace kvtier {
namespace {

void spin_for(std::chrono::nanoseconds d) {
  const auto end = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < end) {
  }
}

class HostBenchCompute final : public BenchCompute {
 public:
  explicit HostBenchCompute(HostDevice& device) : device_(device) {}
  Status fma(Stream& stream, std::uint64_t work) override {
    return device_.enqueue_task(stream, [work]() -> Status {
      spin_for(std::chrono::nanoseconds(work));
      return Status::Ok();
    });
  }
  Status hbm(Stream& stream) override { return fma(stream, 200'000); }
  Status gemm(Stream& stream) override { return fma(stream, 1'000'000); }
  double gemm_flop() const noexcept override { return 0; }

 private:
  HostDevice& device_;
};

#if defined(KVTIER_WITH_CUDA)
class CudaBenchCompute final : public BenchCompute {
 public:
  CudaBenchCompute(Device& device, const BenchComputeOptions& o) : device_(device), o_(o) {}
  Status init() {
    if (o_.gemm_n == 0 || o_.gemm_n % 128 != 0)
      return InvalidArgument(fmt::format("BenchCompute gemm_n {} must be a positive multiple of 128", o_.gemm_n));
    ctas_ = o_.fma_ctas ? o_.fma_ctas : static_cast<std::uint32_t>(2 * device_.multiprocessor_count());
    KVTIER_ASSIGN_OR_RETURN(sink_, device_.allocate_device(sizeof(float) * ctas_ * o_.fma_threads));
    hbm_elems_ = std::max<std::uint64_t>(o_.hbm_bytes / 16, 1);
    KVTIER_ASSIGN_OR_RETURN(hbm_src_, device_.allocate_device(hbm_elems_ * 16));
    KVTIER_ASSIGN_OR_RETURN(hbm_dst_, device_.allocate_device(hbm_elems_ * 16));
    const std::uint64_t n = o_.gemm_n;
    KVTIER_ASSIGN_OR_RETURN(a_, device_.allocate_device(n * n * 2));
    KVTIER_ASSIGN_OR_RETURN(b_, device_.allocate_device(n * n * 2));
    KVTIER_ASSIGN_OR_RETURN(c_, device_.allocate_device(n * n * 4));
    KVTIER_ASSIGN_OR_RETURN(auto s, device_.create_stream());
    KVTIER_RETURN_IF_ERROR(bench_cuda::fill_bf16(*s, a_.data(), n * n, 1));
    KVTIER_RETURN_IF_ERROR(bench_cuda::fill_bf16(*s, b_.data(), n * n, 2));
    KVTIER_RETURN_IF_ERROR(device_.memset_async(hbm_src_.data(), 1, hbm_elems_ * 16, *s));
    return device_.synchronize(*s, std::chrono::seconds(60));
  }
  Status fma(Stream& stream, std::uint64_t work) override {
    return bench_cuda::launch_fma(stream, static_cast<float*>(sink_.data()), ctas_, o_.fma_threads, work);
  }
  Status hbm(Stream& stream) override {
    return bench_cuda::launch_hbm(stream, hbm_src_.data(), hbm_dst_.data(), hbm_elems_,
                                  static_cast<std::uint32_t>(4 * device_.multiprocessor_count()));
  }
  Status gemm(Stream& stream) override {
    return bench_cuda::launch_gemm_bf16(stream, a_.data(), b_.data(), c_.data(), o_.gemm_n);
  }
  double gemm_flop() const noexcept override {
    const double n = o_.gemm_n;
    return 2.0 * n * n * n;
  }

 private:
  Device& device_;
  BenchComputeOptions o_;
  std::uint32_t ctas_ = 0;
  std::uint64_t hbm_elems_ = 0;
  Buffer sink_, hbm_src_, hbm_dst_, a_, b_, c_;
};
#endif

}  // namespace

Result<std::unique_ptr<BenchCompute>> BenchCompute::create(Device& device, const BenchComputeOptions& options) {
  switch (device.backend()) {
    case BackendKind::kHost: {
      auto* host = dynamic_cast<HostDevice*>(&device);
      if (!host) return InvalidArgument("BenchCompute: host backend device is not a HostDevice");
      return std::unique_ptr<BenchCompute>(new HostBenchCompute(*host));
    }
    case BackendKind::kCuda: {
#if defined(KVTIER_WITH_CUDA)
      auto c = std::make_unique<CudaBenchCompute>(device, options);
      KVTIER_RETURN_IF_ERROR(c->init());
      return std::unique_ptr<BenchCompute>(std::move(c));
#else
      return NotSupported("BenchCompute: built without CUDA");
#endif
    }
  }
  return InvalidArgument("BenchCompute: unknown backend");
}

}  // namespace kvtier
