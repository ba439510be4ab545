// Private to the host backend: what its device offers through Device::extension.
#pragma once

#include "kvtier/backend/copy_backend.h"

namespace kvtier::copy_detail {

// The host backend's copy engine factory (host_copy_engine.cc); HostDevice offers it as CopyBackend::kExtension.
const CopyBackend& host_copy_backend() noexcept;

}  // namespace kvtier::copy_detail
