// Launcher of the SM gather/scatter copy kernel (block_copy_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "copy/kernel_plan.h"

namespace kvtier::copy_detail {

// Launches `ctas` x `threads` on `stream` (the current device must be the
// stream's). args.planes / args.pairs must be device-readable (device memory
// or mapped pinned memory). Returns cudaGetLastError() after the launch.
// `programmatic`: programmatic dependent launch (the launch may overlap the
// end of the kernel before it on the stream; the kernel waits for that one's
// completion before it reads or writes anything, so stream order holds).
cudaError_t launch_block_copy(const KernelArgs& args, std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream,
                              bool programmatic);

// The same kernel with the descriptors in its parameter block (args.num_planes
// <= kInlineMaxPlanes, args.num_pairs <= kInlineMaxPairs; `planes` and `pairs`
// are host memory, read during the call only). The parameter block is the
// smallest size class that holds num_pairs.
cudaError_t launch_block_copy_inline(const KernelArgs& args, const KernelPlane* planes, const KernelPair* pairs,
                                     std::uint32_t ctas, std::uint32_t threads, cudaStream_t stream, bool programmatic);

}  // namespace kvtier::copy_detail
