// CopyBackend: how a device backend provides the copy engine for its devices.
//
// CopyEngine::create(device, options) asks the device for this extension (Device::extension(kExtension)) and
// lets it build the engine, so the copy layer names no backend and chooses no code path by Device::backend().
// A backend offers it from its Device's extension() and builds its engine on the copy layer's shared base
// (validation, planning, strategies); the engine keeps a reference to the device, which outlives it.
//
// Thread-safety: create_engine may be called from any thread.
#pragma once

#include <memory>
#include <string_view>

#include "kvtier/backend/device.h"
#include "kvtier/copy/copy_engine.h"

namespace kvtier {

class CopyBackend {
 public:
  static constexpr std::string_view kExtension = "kvtier.copy_backend";

  virtual ~CopyBackend() = default;
  // An engine over `device`, which must be a device of this backend (InvalidArgument naming it otherwise).
  // `options` were checked by CopyEngine::create.
  virtual Result<std::unique_ptr<CopyEngine>> create_engine(Device& device, const CopyEngineOptions& options) const = 0;
};

}  // namespace kvtier
