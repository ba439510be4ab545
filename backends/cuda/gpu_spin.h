// Launcher of the stream-gate spin kernel (gpu_spin.cu). Private to
// device/cuda; use gpu_gate.h. Includes no kvtier headers so that nvcc
// compiles gpu_spin.cu without them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvtier::cuda_detail {

// Enqueues a 1-thread kernel on `s` that returns once
// (int32)(*device_flag - target) >= 0 or after `timeout_ns` (then writes 1 to
// *device_expired when non-null). Returns the launch error.
cudaError_t launch_gate_spin(cudaStream_t s, const std::uint32_t* device_flag, std::uint32_t target,
                             std::uint64_t timeout_ns, std::uint32_t* device_expired) noexcept;

}  // namespace kvtier::cuda_detail
