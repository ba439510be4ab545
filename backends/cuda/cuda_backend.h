// Private to the CUDA backend: what its device offers through Device::extension.
#pragma once

#include "kvtier/backend/copy_backend.h"

namespace kvtier::copy_detail {

// The CUDA backend's copy engine factory (cuda_copy_engine.cc); CudaDevice offers it as CopyBackend::kExtension.
const CopyBackend& cuda_copy_backend() noexcept;

}  // namespace kvtier::copy_detail
