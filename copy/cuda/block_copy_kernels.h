// Launcher of the SM gather/scatter copy kernel (block_copy_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "copy/kernel_plan.h"

namespace kvtier::copy_detail {

// Launches `ctas` x `threads` on `stream` (the current device must be the
// stream's). args.planes / args.pairs must be device-readable (device memory
// or mapped pinned memory). Returns cudaGetLastError() after the launch.
cudaError_t launch_block_copy(const KernelArgs& args, std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream);

}  // namespace kvtier::copy_detail
