#include "kvtier/backend/plan_executor.h"

#include <fmt/format.h>

#include "kvtier/core/enum_names.h"

namespace kvtier::cache {

namespace {
constexpr EnumName<MoveKind> kMoveKindEntries[] = {
    {MoveKind::kEviction, "eviction"},
    {MoveKind::kBackup, "backup"},
    {MoveKind::kLoad, "load"},
    {MoveKind::kStorageWrite, "storage write"},
    {MoveKind::kStoragePrefetch, "storage prefetch"},
};
constexpr auto kMoveKindNames = enum_table("move kind", kMoveKindEntries, "move");
}  // namespace

std::string_view move_kind_name(MoveKind kind) noexcept { return kMoveKindNames.name(kind); }

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
