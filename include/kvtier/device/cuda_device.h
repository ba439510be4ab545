// CudaDevice: the CUDA backend of Device.
//
// Compiled when KVTIER_CUDA is ON (nvcc found). When it is OFF, or no GPU is
// present, create_cuda_device returns NotSupported / Unavailable: callers fall
// back to the host backend.
//
// Streams are created non-blocking (cudaStreamNonBlocking) so they never
// synchronise with the legacy default stream; StreamPriority::kHigh maps to
// the greatest priority the device offers. Events are created with
// cudaEventDisableTiming. Every CUDA call is checked at the call site and
// converted to a Status naming the call and its arguments; sticky errors map
// to kDeviceLost. A DeviceGuard restores the caller's current device.
#pragma once

#include <memory>

#include "kvtier/backend/device.h"

namespace kvtier {

// True when kvtier was built with CUDA.
bool cuda_compiled() noexcept;
// Number of visible CUDA devices (0 when none or not compiled in).
int cuda_device_count() noexcept;
// `ordinal` is the process-visible ordinal (after CUDA_VISIBLE_DEVICES).
Result<std::unique_ptr<Device>> create_cuda_device(int ordinal);

// Opens the CUDA device when available, else a HostDevice with default options.
Result<std::unique_ptr<Device>> open_default_device(bool prefer_cuda = true, int ordinal = 0);

}  // namespace kvtier
