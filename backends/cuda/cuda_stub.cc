#include "kvtier/device/cuda_device.h"
namespace kvtier {
bool cuda_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
Result<std::unique_ptr<Device>> create_cuda_device(int) { return NotSupported("built without CUDA"); }
}  // namespace kvtier
