// Binds CopyEngineOptions to a ConfigTable (knob names "<prefix>.<field>",
// env vars KVTIER_<PREFIX>_<FIELD>), so that every copy knob is declared once
// with its doc string and can be set from the environment or a config file.
#pragma once

#include <string>

#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/config.h"

namespace kvtier {

void bind_copy_engine_options(ConfigTable& table, CopyEngineOptions& options, const std::string& prefix = "copy");

}  // namespace kvtier
