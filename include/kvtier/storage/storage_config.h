// The storage backends' knobs in the typed config table (core/config.h): `storage.redis.*` for
// RedisBackendConfig and `storage.disk.*` for DiskBackendConfig, with their KVTIER_STORAGE_*
// variables. Binding keeps the struct's current values as the defaults. Fields that name
// endpoints, paths or secrets stay code-only (they are set by the application, not by a knob).
//
// Thread-safety: as ConfigTable: bind and apply on one thread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "kvtier/core/config.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/redis_backend.h"

namespace kvtier::storage {

void bind_redis_backend_config(ConfigTable& table, RedisBackendConfig& config,
                               const std::string& prefix = "storage.redis");
void bind_disk_backend_config(ConfigTable& table, DiskBackendConfig& config,
                              const std::string& prefix = "storage.disk");

// The tenant of the backends (StorageOptions::tenant / tenant_secret) as knobs: `storage.tenant.id`
// and `storage.tenant.secret_file` (KVTIER_STORAGE_TENANT_ID, KVTIER_STORAGE_TENANT_SECRET_FILE).
// The secret itself is never a knob (knobs are listed by `kvtier info --config`): it is read from
// the file (read_tenant_secret_file: hex, mode 0600 or tighter).
struct TenantConfig {
  std::string id;           // empty: no tenant
  std::string secret_file;  // empty: no secret (unkeyed objects)
};
void bind_tenant_config(ConfigTable& table, TenantConfig& config, const std::string& prefix = "storage.tenant");
// The backends' configuration before a spec string is applied: make_storage_backend(spec, options,
// defaults) starts from these (e.g. the knob table's values) and what the spec names overrides them.
// The disk root and the Redis endpoints always come from the spec.
struct StorageBackendDefaults {
  DiskBackendConfig disk;
  RedisBackendConfig redis;
};
Result<std::unique_ptr<StorageBackend>> make_storage_backend(std::string_view spec, StorageOptions options,
                                                             const StorageBackendDefaults& defaults);
std::string redact_storage_spec(std::string_view spec);

// make_storage_backend() from the knobs: the storage.disk.*, storage.redis.* and storage.tenant.* knobs from their
// KVTIER_STORAGE_* variables in `env` (nullptr: none; a bad value is InvalidArgument naming the variable), then
// `knobs` (knob -> value), then what the spec names. The tenant knobs set options.tenant and tenant_secret.
Result<std::unique_ptr<StorageBackend>> open_storage_backend(std::string_view spec, StorageOptions options, char** env,
                                                             const std::map<std::string, std::string>& knobs = {});

// Sets options.tenant and options.tenant_secret from `config` (the file is read here) and checks
// them (format::check_tenant_options). Leaves `options` unchanged on error.
Status apply_tenant_config(const TenantConfig& config, StorageOptions& options);

}  // namespace kvtier::storage
