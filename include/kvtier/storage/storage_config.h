// The storage backends' knobs in the typed config table (core/config.h): `storage.redis.*` for
// RedisBackendConfig and `storage.disk.*` for DiskBackendConfig, with their KVTIER_STORAGE_*
// variables. Binding keeps the struct's current values as the defaults. Fields that name
// endpoints, paths or secrets stay code-only (they are set by the application, not by a knob).
//
// Thread-safety: as ConfigTable: bind and apply on one thread.
#pragma once

#include <string>

#include "kvtier/core/config.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/redis_backend.h"

namespace kvtier::storage {

void bind_redis_backend_config(ConfigTable& table, RedisBackendConfig& config,
                               const std::string& prefix = "storage.redis");
void bind_disk_backend_config(ConfigTable& table, DiskBackendConfig& config,
                              const std::string& prefix = "storage.disk");

}  // namespace kvtier::storage
