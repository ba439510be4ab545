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
  // Every completion is applied, also after one whose acknowledgement failed: the executor has forgotten them all,
  // so stopping lost the rest (their moves stayed in flight in the cache forever). The first error is returned.
  Status first = Status::Ok();
  for (const Completion& c : completions) {
    Status st = Status::Ok();
    switch (c.kind) {
      case MoveKind::kEviction: st = cache.ack_evictions(c.dst, c.status); break;
      case MoveKind::kBackup: st = cache.ack_backups(c.dst, c.status); break;
      case MoveKind::kLoad: st = cache.ack_loads(c.dst, c.status); break;
      case MoveKind::kStorageWrite: st = cache.ack_storage_writes(c.dst, c.status); break;
      case MoveKind::kStoragePrefetch: st = cache.ack_storage_prefetches(c.dst, c.status); break;
    }
    if (!st.ok() && first.ok()) first = std::move(st);
  }
  return first;
}

}  // namespace kvtier::cache
