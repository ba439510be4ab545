#include "kvtier/storage/storage_config.h"

#include "storage/object_format.h"

namespace kvtier::storage {

void bind_redis_backend_config(ConfigTable& t, RedisBackendConfig& c, const std::string& p) {
  t.add(p + ".connect_timeout", &c.connect_timeout, "Redis: limit of one connect (capped by the deadlines)");
  t.add(p + ".command_timeout", &c.command_timeout,
        "Redis: limit of one socket read or write (capped by the deadlines)");
  t.add(p + ".item_deadline", &c.item_deadline,
        "Redis: every item completes within this of its sub-batch's start, retries and reconnects "
        "included (TimedOut after)");
  t.add(p + ".batch_deadline", &c.batch_deadline,
        "Redis: every item of a batch completes within this of post(), queueing included (TimedOut after)");
  t.add(p + ".create_deadline", &c.create_deadline,
        "Redis: create (connect, AUTH, PING / CLUSTER SLOTS over every seed, retries) fails after this");
  t.add(p + ".max_retries", &c.max_retries,
        "Redis: retries of an item after I/O errors and TRYAGAIN (within the deadlines)");
  t.add(p + ".workers", &c.workers, "Redis: worker threads (connections per node)", 1, kMaxRedisWorkers);
  t.add(p + ".max_batch_items", &c.max_batch_items, "Redis: items per pipelined sub-batch", 1, kMaxRedisBatchItems);
  t.add(p + ".ttl_seconds", &c.ttl_seconds, "Redis: expiry of every put (0: none)");
}

void bind_disk_backend_config(ConfigTable& t, DiskBackendConfig& c, const std::string& p) {
  t.add(p + ".capacity_bytes", &c.capacity_bytes, "disk: capacity incl. headers (0: unlimited)");
  t.add(p + ".queue_depth", &c.queue_depth, "disk: items in flight on the io_uring ring", 1, kMaxDiskQueueDepth);
  t.add(p + ".verify_payload_on_open", &c.verify_payload_on_open,
        "disk: verify every payload checksum while rebuilding the index");
  t.add(p + ".max_free_files", &c.max_free_files, "disk: recycled-file pool size");
  t.add(p + ".max_quarantine_files", &c.max_quarantine_files,
        "disk: quarantined files kept for inspection (oldest removed first; counted in capacity)");
  t.add_mode(p + ".file_mode", &c.file_mode, "disk: permission bits of created files, in octal (0600)");
  t.add_mode(p + ".dir_mode", &c.dir_mode, "disk: permission bits of created directories, in octal (0700)");
}

void bind_tenant_config(ConfigTable& t, TenantConfig& c, const std::string& p) {
  t.add(p + ".id", &c.id,
        "storage: tenant id ([A-Za-z0-9_-]{1,64}): own disk directory, Redis key prefix and namespace (empty: none)");
  t.add(p + ".secret_file", &c.secret_file,
        "storage: file with the tenant's MAC secret in hex (32..64 bytes, mode 0600): objects MAC-"
        "authenticated, Redis key names hashed (empty: unkeyed xxh3 objects)");
}

Status apply_tenant_config(const TenantConfig& c, StorageOptions& options) {
  StorageOptions o = options;
  o.tenant = c.id;
  o.tenant_secret.clear();
  if (!c.secret_file.empty()) {
    auto secret = read_tenant_secret_file(c.secret_file);
    if (!secret.ok()) return secret.status().with_context("storage.tenant.secret_file");
    o.tenant_secret = std::move(secret).value();
  }
  KVTIER_RETURN_IF_ERROR(format::check_tenant_options(o).with_context("storage.tenant.id"));
  options = std::move(o);
  return Status::Ok();
}

Result<std::unique_ptr<StorageBackend>> open_storage_backend(std::string_view spec, StorageOptions options, char** env,
                                                             const std::map<std::string, std::string>& knobs) {
  StorageBackendDefaults defaults;
  TenantConfig tenant;
  ConfigTable table;
  bind_disk_backend_config(table, defaults.disk);
  bind_redis_backend_config(table, defaults.redis);
  bind_tenant_config(table, tenant);
  if (env != nullptr) KVTIER_RETURN_IF_ERROR(table.apply_env(env).with_context("KVTIER_STORAGE_* environment"));
  for (const auto& [k, v] : knobs) KVTIER_RETURN_IF_ERROR(table.set(k, v));
  KVTIER_RETURN_IF_ERROR(apply_tenant_config(tenant, options));
  return make_storage_backend(spec, std::move(options), defaults);
}

}  // namespace kvtier::storage
