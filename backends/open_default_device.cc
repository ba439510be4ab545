// open_default_device: the one place that chooses a backend (kvtier/device/cuda_device.h).
#include <memory>
#include <utility>

#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"

namespace kvtier {

Result<std::unique_ptr<Device>> open_default_device(bool prefer_cuda, int ordinal) {
  if (prefer_cuda && cuda_device_count() > 0) return create_cuda_device(ordinal);
  HostDeviceOptions options;
  options.ordinal = ordinal;
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create(options));
  return std::unique_ptr<Device>(std::move(host));
}

}  // namespace kvtier
