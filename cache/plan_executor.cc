#include "kvtier/backend/plan_executor.h"

#include <fmt/format.h>

namespace kvtier::cache {

std::string_view move_kind_name(MoveKind kind) noexcept {
  switch (kind) {
    case MoveKind::kEviction: return "eviction";
    case MoveKind::kBackup: return "backup";
    case MoveKind::kLoad: return "load";
    case MoveKind::kStorageWrite: return "storage write";
    case MoveKind::kStoragePrefetch: return "storage prefetch";
  }
  return "move";
}

Status apply_completions(CacheManager& cache, const std::vector<Completion>& completions) {
  for (const Completion& c : completions) {
    switch (c.kind) {
      case MoveKind::kEviction: KVTIER_RETURN_IF_ERROR(cache.ack_evictions(c.dst, c.status)); break;
      case MoveKind::kBackup: KVTIER_RETURN_IF_ERROR(cache.ack_backups(c.dst, c.status)); break;
      case MoveKind::kLoad: KVTIER_RETURN_IF_ERROR(cache.ack_loads(c.dst, c.status)); break;
      case MoveKind::kStorageWrite: KVTIER_RETURN_IF_ERROR(cache.ack_storage_writes(c.dst, c.status)); break;
      case MoveKind::kStoragePrefetch: KVTIER_RETURN_IF_ERROR(cache.ack_storage_prefetches(c.dst, c.status)); break;
    }
  }
  return Status::Ok();
}

}  // namespace kvtier::cache
