// ConfigKnobs: every knob of the library in one table (include/kvtier/cache/config_knobs.h).
#include "kvtier/cache/config_knobs.h"

namespace kvtier::cache {

ConfigKnobs::ConfigKnobs() {
  bind_log_config(table, log_level);
  bind_copy_engine_options(table, copy);
  bind_transfer_manager_config(table, transfer);
  bind_cache_config(table, cache);
  storage::bind_redis_backend_config(table, redis);
  storage::bind_disk_backend_config(table, disk);
  storage::bind_tenant_config(table, tenant);
  bind_integration_config(table, integration);
}

std::vector<std::string> unrecognized_env_vars(char* const* env) {
  const ConfigKnobs knobs;
  return knobs.table.unrecognized_env(env);
}

}  // namespace kvtier::cache
