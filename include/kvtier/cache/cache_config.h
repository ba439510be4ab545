// Binds CacheConfig to a ConfigTable (knob names "<prefix>.<field>", env vars
// KVTIER_<PREFIX>_<FIELD>; watermarks as "<prefix>.<tier>_watermarks.low" /
// ".high"), so that every cache knob is declared once with its doc string and
// can be set from the environment or a config file. Policy names are checked
// when set (make_policy names: lru, s3fifo, sieve, arc, lrfu[:boost], belady);
// write_policy takes write_policy_name values. Cross-field rules (device_blocks
// >= 1, low <= high, belady's oracle) are CacheManager::create's.
//
// Not a knob: next_use_oracle (a callback, set in code by the offline replay).
// The table keeps pointers into `config`: bind, apply, then pass the config on.
#pragma once

#include <string>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/config.h"

namespace kvtier::cache {

void bind_cache_config(ConfigTable& table, CacheConfig& config, const std::string& prefix = "cache");

}  // namespace kvtier::cache
