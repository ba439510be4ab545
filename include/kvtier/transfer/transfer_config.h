// Binds TransferManagerConfig to a ConfigTable (knob names "<prefix>.<field>",
// env vars KVTIER_<PREFIX>_<FIELD>; the nested copy-engine options as
// "<prefix>.copy_engine.<field>"), so that every transfer knob is declared
// once with its doc string and can be set from the environment or a config
// file. Strategies take copy_strategy_name values, priorities "normal" or
// "high", durations a unit suffix ("50us", "60s"; bare integers are in the
// field's unit).
//
// The table keeps pointers into `config`: bind, apply, then pass the config on.
#pragma once

#include <string>
#include <string_view>

#include "kvtier/backend/device.h"
#include "kvtier/core/config.h"
#include "kvtier/transfer/transfer_manager.h"

namespace kvtier {

void bind_transfer_manager_config(ConfigTable& table, TransferManagerConfig& config,
                                  const std::string& prefix = "transfer");

// "normal", "high".
std::string_view stream_priority_name(StreamPriority priority) noexcept;
Result<StreamPriority> parse_stream_priority(std::string_view name);

}  // namespace kvtier
