// How a CacheManager makes room and places copies between tiers: the members
// of CacheManager::Impl (cache_manager_impl.h) that pick victims, evict a
// device copy (to host, or a drop when another copy remains), free host
// blocks under pressure and for the host watermarks (a drop, or under
// write-back a demotion to storage), drop storage copies, and queue the
// write-through copies (backup() to host, store_through() to storage).
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

// ---- eviction ------------------------------------------------------------
NodeId CacheManager::Impl::victim(int t, FunctionRef<bool(NodeId)> pred, bool allow_protected) {
  NodeId v = policy[t]->victim(pred);
  if (v != kNoNode || !allow_protected || shield_protected || parked[t].empty()) return v;
  return protected_victim(t, pred);
}

bool CacheManager::Impl::device_evictable(NodeId id) const {
  const Node& n = nodes[id];
  return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kDev)) && n.refs == 0 &&
         n.child_tier[kDev] == 0;
}

bool CacheManager::Impl::host_droppable(NodeId id) const {
  const Node& n = nodes[id];
  return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kHst)) && n.refs == 0 &&
         can_drop(n, kHst);
}

bool CacheManager::Impl::storage_droppable(NodeId id) const {
  const Node& n = nodes[id];
  return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kSto)) && n.refs == 0 &&
         can_drop(n, kSto);
}

void CacheManager::Impl::drop_copy(NodeId id, int t) {
  release_copy(id, t);
  Node& n = nodes[id];
  if (n.present == 0 && n.state == NodeState::kSettled)
    remove_node(id);
  else
    retier(id);
}

// Write-back with a storage tier: a host copy that is a block's last copy ("dirty") is written to
// storage before its host block is given up, whatever takes it (watermarks or pressure).
bool CacheManager::Impl::write_back_to_storage() const {
  return has_tier(kSto) && has_tier(kHst) && cfg.write_policy == WritePolicy::kWriteBack;
}

void CacheManager::Impl::drop_host_copy(NodeId id) {
  if (nodes[id].present == bit(kHst)) ++st.lost_host_drops;
  drop_copy(id, kHst);
  ++st.drops_host;
}

// Frees one host block now by dropping a host copy (never waits on a demotion).
bool CacheManager::Impl::drop_one_host() {
  if (!has_tier(kHst)) return false;
  NodeId v = victim(kHst, [this](NodeId n) { return host_drop[n] != 0; });
  if (v == kNoNode) return false;
  drop_host_copy(v);
  return true;
}

// Settled, unpinned host copy the host policy may consider at all.
bool CacheManager::Impl::host_candidate(NodeId id) const {
  const Node& n = nodes[id];
  return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kHst)) && n.refs == 0;
}

// A host-only block whose children all sit in storage (or are absent): it may move down.
bool CacheManager::Impl::host_demotable(const Node& n) const {
  return has_tier(kSto) && n.present == bit(kHst) && n.child_tier[kHst] == 0 && n.child_tier[kDev] == 0;
}

// Queues host -> storage for v; its host block stays held (read by the write) until the ack.
bool CacheManager::Impl::start_demotion(NodeId v) {
  if (pools[kSto].num_free() == 0 && !drop_one_storage()) return false;
  auto slot = pools[kSto].allocate();
  if (!slot.ok()) return false;
  Node& n = nodes[v];
  queue_move(plan.storage_writes, BlockMove{n.block[kHst], *slot, n.key}, n);
  untrack(v, kHst);
  n.present = static_cast<std::uint8_t>(n.present & ~bit(kHst));  // block kept until the ack
  announce(v);
  set_block(v, kSto, *slot);
  n.state = NodeState::kDemoting;
  retier(v);
  ++pending_demotions;
  ++st.storage_writes;
  return true;
}

// The host tier is full and a block is wanted now. Write-back with storage: a clean copy (another
// copy remains, in storage or on device) among the next kCleanVictimWindow candidates is dropped
// (kFree); otherwise the first dirty candidate is demoted, its block frees at the write's ack
// (kPending). A dirty copy is dropped only when storage cannot take it.
CacheManager::Impl::Room CacheManager::Impl::make_host_room() {
  if (speculative) {
    // A prefetch's room, whatever the write policy and tiers: a host copy that has another copy (device or
    // storage); no demotion is started (storage I/O for a bet on a queued request) and no last copy dropped.
    NodeId v = victim(
        kHst,
        [this](NodeId id) { return host_candidate(id) && nodes[id].present != bit(kHst) && can_drop(nodes[id], kHst); },
        /*allow_protected=*/false);
    if (v == kNoNode) return Room::kNone;
    drop_host_copy(v);
    return Room::kFree;
  }
  if (!write_back_to_storage()) return drop_one_host() ? Room::kFree : Room::kNone;
  NodeId first_dirty = kNoNode;
  std::uint32_t dirty_seen = 0;
  auto pred = [&](NodeId id) {
    if (!host_candidate(id)) return false;
    const Node& n = nodes[id];
    if (n.present != bit(kHst)) return can_drop(n, kHst);
    if (!host_demotable(n)) return false;
    if (first_dirty == kNoNode) first_dirty = id;
    return ++dirty_seen >= kCleanVictimWindow;  // stop scanning: no clean copy near the tail
  };
  NodeId v = victim(kHst, pred, /*allow_protected=*/false);
  // The scan stopped on its window's last dirty copy: no unprotected clean copy either.
  if (v != kNoNode && nodes[v].present == bit(kHst)) v = kNoNode;
  // No unprotected clean copy: a protected clean one before any demotion (dropping it loses nothing and frees a
  // block now, where a demotion frees one only at its ack and the admission asking for room would be refused:
  // protection is a preference, never a refusal). Protected dirty copies only when the policy offers no dirty
  // victim either (same preference order).
  if (v == kNoNode && !shield_protected && !parked[kHst].empty()) {
    const NodeId dirty_unprotected = first_dirty;
    v = protected_victim(kHst, [&](NodeId id) {
      return host_candidate(id) && nodes[id].present != bit(kHst) && can_drop(nodes[id], kHst);
    });
    first_dirty = dirty_unprotected;
    if (v == kNoNode && first_dirty == kNoNode) v = protected_victim(kHst, pred);
  }
  if (v != kNoNode && nodes[v].present != bit(kHst)) {
    drop_host_copy(v);
    return Room::kFree;
  }
  if (first_dirty == kNoNode) return Room::kNone;
  if (nodes[first_dirty].write_failed && can_drop(nodes[first_dirty], kHst)) {
    drop_host_copy(first_dirty);  // its write already failed once: not retried while a block is wanted now
    return Room::kFree;
  }
  if (start_demotion(first_dirty)) {
    ++st.pressure_demotions;
    return Room::kPending;
  }
  if (!can_drop(nodes[first_dirty], kHst)) return Room::kNone;
  drop_host_copy(first_dirty);  // storage is full of blocks it cannot give up: the copy is lost
  return Room::kFree;
}

Result<BlockId> CacheManager::Impl::take_host_block() {
  if (!host_run.empty()) {
    BlockId b = host_run.front();
    host_run.pop_front();
    return b;
  }
  if (pools[kHst].num_free() == 0 && make_host_room() != Room::kFree)
    return ResourceExhausted("host tier: no block free now (none droppable, or a demotion frees one later)");
  return pools[kHst].allocate();
}

bool CacheManager::Impl::drop_one_storage() {
  if (!has_tier(kSto)) return false;
  NodeId v = victim(kSto, [this](NodeId n) { return storage_droppable(n); });
  if (v == kNoNode) return false;
  drop_copy(v, kSto);
  ++st.drops_storage;
  return true;
}

void CacheManager::Impl::evict_to_host(NodeId v, BlockId hb) {
  Node& n = nodes[v];
  queue_move(plan.evictions, BlockMove{n.block[kDev], hb, n.key}, n);
  release_copy(v, kDev);  // same-step reuse: the plan orders this D2H before any write into the device block
  set_block(v, kHst, hb);
  n.state = NodeState::kEvicting;
  retier(v);
  ++st.evictions_d2h;
}

// Evicts one device copy. Returns false when nothing can go.
bool CacheManager::Impl::evict_one_device() {
  std::vector<NodeId> skipped;
  auto pred = [&](NodeId n) {
    return device_evictable(n) && std::find(skipped.begin(), skipped.end(), n) == skipped.end();
  };
  // Once the host has no block now (asking again would only queue more demotions), write-back with
  // storage looks on for a device copy that is also on host; failing that it drops the last copy
  // of the first droppable victim. A victim with children on host cannot be dropped: with no host
  // block it stays, and the eviction fails until the demotions' acks free host blocks; a host copy
  // is dropped for it only while storage writes fail (waiting would not free anything).
  const bool write_back_down = write_back_to_storage();
  bool host_full = false;
  NodeId lossy_fallback = kNoNode, keep_fallback = kNoNode;
  for (int attempt = 0; attempt < 64; ++attempt) {
    NodeId v = victim(kDev, pred);
    if (v == kNoNode) break;
    Node& n = nodes[v];
    if (n.present & bit(kHst)) {  // backed up: no copy needed
      drop_copy(v, kDev);
      ++st.drops_device;
      return true;
    }
    // A prefetch (a bet on a queued request) never drops a last copy: a device-only victim goes only to a free host
    // block, else it stays.
    const bool last_copy = speculative && n.present == bit(kDev);
    bool must_keep = num_children(n) > 0 && !can_drop(n, kDev);
    if (has_tier(kHst) && (cfg.write_policy == WritePolicy::kWriteBack || must_keep || last_copy) && !host_full) {
      auto hb = take_host_block();
      if (hb.ok()) {
        evict_to_host(v, *hb);
        return true;
      }
      host_full = true;
    }
    if (last_copy) {
      skipped.push_back(v);
      continue;
    }
    if (can_drop(n, kDev)) {
      if (!(host_full && write_back_down)) {
        drop_copy(v, kDev);
        ++st.drops_device;
        return true;
      }
      if (lossy_fallback == kNoNode) lossy_fallback = v;
    } else if (host_full && write_back_down && keep_fallback == kNoNode) {
      keep_fallback = v;
    }
    skipped.push_back(v);
  }
  // A prefetch neither drops a last copy because demotions are pending nor frees a host block for it.
  if (speculative) return false;
  if (lossy_fallback != kNoNode) {
    drop_copy(lossy_fallback, kDev);
    ++st.drops_device;
    return true;
  }
  if (keep_fallback != kNoNode && failed_writes_in_a_row > 0 && drop_one_host()) {
    auto hb = pools[kHst].allocate();
    if (hb.ok()) {
      evict_to_host(keep_fallback, *hb);
      return true;
    }
  }
  return false;
}

bool CacheManager::Impl::ensure_device_free(std::uint32_t need) {
  if (pools[kDev].num_free() >= need) return true;
  std::uint32_t shortfall = need - pools[kDev].num_free();
  if (cfg.contiguous_host_runs && has_tier(kHst) && shortfall > 1 && cfg.write_policy == WritePolicy::kWriteBack) {
    std::uint32_t k = std::min(shortfall, pools[kHst].num_free());
    if (k > 1) {
      auto run = pools[kHst].allocate_run(k);
      if (run.ok())
        for (std::uint32_t i = 0; i < k; ++i) host_run.push_back(*run + i);
    }
  }
  bool ok = true;
  while (pools[kDev].num_free() < need) {
    if (!evict_one_device()) {
      ok = false;
      break;
    }
  }
  for (BlockId b : host_run) pools[kHst].free(b).ignore_error();
  host_run.clear();
  return ok;
}

void CacheManager::Impl::mark_blocked_device(std::vector<std::uint8_t>& blocked) const {
  // A pinned or in-flight block on (or bound for) the device keeps every device block above it.
  blocked.assign(nodes.size(), 0);
  for (NodeId id = 1; id < nodes.size(); ++id) {
    const Node& n = nodes[id];
    if (!n.live || n.detached) continue;
    const bool on_device = (n.present & bit(kDev)) || eventual_tier(n) == kDev;
    if (!on_device || (n.refs == 0 && n.state == NodeState::kSettled)) continue;
    for (NodeId x = id; x != kNoNode && x != kRoot && !blocked[x]; x = nodes[x].parent) blocked[x] = 1;
  }
}

std::uint32_t CacheManager::Impl::recount_reclaimable_device_blocks() const {
  std::vector<std::uint8_t> blocked;
  mark_blocked_device(blocked);
  std::uint32_t count = 0;
  for (NodeId id = 1; id < nodes.size(); ++id) {
    const Node& n = nodes[id];
    if (n.live && !n.detached && !blocked[id] && (n.present & bit(kDev)) && n.state == NodeState::kSettled &&
        n.refs == 0)
      ++count;
  }
  return count;
}

// Host eviction for watermarks: drop or demote to storage.
bool CacheManager::Impl::evict_one_host_background() {
  std::vector<NodeId> skipped;
  auto pred = [&](NodeId id) {  // a blocked copy would be skipped below: neither dropped nor demoted
    return host_candidate(id) && !blocked_in(nodes[id], kHst) &&
           std::find(skipped.begin(), skipped.end(), id) == skipped.end();
  };
  for (int attempt = 0; attempt < 64; ++attempt) {
    NodeId v = victim(kHst, pred);
    if (v == kNoNode) return false;
    Node& n = nodes[v];
    if ((n.present & bit(kDev)) || (n.present & bit(kSto))) {
      if (can_drop(n, kHst)) {
        drop_host_copy(v);
        return true;
      }
    } else if (host_demotable(n)) {
      if (start_demotion(v)) return true;
    } else if (can_drop(n, kHst)) {
      drop_host_copy(v);
      return true;
    }
    skipped.push_back(v);
  }
  return false;
}

// Write-through to storage: a block that just settled on host is also copied to storage (the
// host copy stays servable meanwhile), so a later host eviction is a plain drop.
void CacheManager::Impl::store_through(NodeId id) {
  Node& n = nodes[id];
  if (!has_tier(kSto) || cfg.write_policy == WritePolicy::kWriteBack) return;
  if (cfg.write_policy == WritePolicy::kWriteThroughSelective && n.hits < cfg.write_through_threshold) return;
  if (n.detached || n.state != NodeState::kSettled || !(n.present & bit(kHst)) || n.block[kSto] != kNoBlock) return;
  if (pools[kSto].num_free() == 0 && !drop_one_storage()) return;
  auto slot = pools[kSto].allocate();
  if (!slot.ok()) return;
  queue_move(plan.storage_writes, BlockMove{n.block[kHst], *slot, n.key}, n);
  set_block(id, kSto, *slot);
  n.state = NodeState::kStoring;
  sync_reclaim(id);  // a device copy beside the host one is held until the write's ack
  ++st.storage_writes;
}

void CacheManager::Impl::backup(NodeId id) {
  Node& n = nodes[id];
  if (!has_tier(kHst) || n.state != NodeState::kSettled || !(n.present & bit(kDev)) || (n.present & bit(kHst))) return;
  auto hb = take_host_block();
  if (!hb.ok()) return;
  queue_move(plan.backups, BlockMove{n.block[kDev], *hb, n.key}, n);
  set_block(id, kHst, *hb);
  n.state = NodeState::kBackingUp;
  sync_reclaim(id);
  ++st.backups_d2h;
}

}  // namespace kvtier::cache
