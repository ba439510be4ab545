// Every configuration knob of the library in one table, bound to its defaults: what `kvtier info --config`
// lists, and what the KVTIER_* variables of a process are checked against for misspellings.
#pragma once

#include <string>
#include <vector>

#include "kvtier/cache/cache_config.h"
#include "kvtier/copy/copy_config.h"
#include "kvtier/core/config.h"
#include "kvtier/core/integration_config.h"
#include "kvtier/core/log.h"
#include "kvtier/storage/storage_config.h"
#include "kvtier/transfer/transfer_config.h"

namespace kvtier::cache {

// The table holds pointers to the fields: not copyable, not movable.
struct ConfigKnobs {
  ConfigKnobs();
  ConfigKnobs(const ConfigKnobs&) = delete;
  ConfigKnobs& operator=(const ConfigKnobs&) = delete;

  LogLevel log_level = LogLevel::kInfo;
  CopyEngineOptions copy;
  TransferManagerConfig transfer;
  CacheConfig cache;
  storage::RedisBackendConfig redis;
  storage::DiskBackendConfig disk;
  storage::TenantConfig tenant;
  IntegrationConfig integration;
  ConfigTable table;  // every knob, bound to the fields above
};

// One message per KVTIER_* variable of `env` that looks like a setting of some family (KVTIER_CACHE_,
// KVTIER_TRANSFER_, ...) but names no knob: ConfigTable::unrecognized_env over every knob. Empty when all are known.
std::vector<std::string> unrecognized_env_vars(char* const* env);

}  // namespace kvtier::cache
