// The stream-gate spin kernel (see gpu_gate.h). Kept free of kvtier/fmt
// headers: nvcc only sees CUDA code here; the host API is in gpu_gate.cc.
#include "backends/cuda/gpu_spin.h"

namespace kvtier::cuda_detail {
namespace {

__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until (int32)(*flag - target) >= 0, i.e. the host has opened ticket
// `target` or a later one, or until `timeout_ns` passes; then marks
// `expired` (may be null). Each read of a volatile host-mapped word crosses
// PCIe (~1-2 us), so the sleep is kept short to release quickly.
__global__ void gate_spin_kernel(const volatile std::uint32_t* flag, std::uint32_t target, std::uint64_t timeout_ns,
                                 volatile std::uint32_t* expired) {
  const std::uint64_t start = global_timer_ns();
  unsigned sleep_ns = 32;
  while (static_cast<std::int32_t>(*flag - target) < 0) {
    if (global_timer_ns() - start > timeout_ns) {
      if (expired != nullptr) *expired = 1u;
      break;
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 512) sleep_ns *= 2;
  }
  // Order the flag read before anything later work observes (the stream
  // orders the work itself).
  __threadfence_system();
}

}  // namespace

cudaError_t launch_gate_spin(cudaStream_t s, const std::uint32_t* device_flag, std::uint32_t target,
                             std::uint64_t timeout_ns, std::uint32_t* device_expired) noexcept {
  const volatile std::uint32_t* flag_arg = device_flag;
  volatile std::uint32_t* expired_arg = device_expired;
  void* args[] = {&flag_arg, &target, &timeout_ns, &expired_arg};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&gate_spin_kernel), dim3(1), dim3(1), args, 0, s);
}

}  // namespace kvtier::cuda_detail
