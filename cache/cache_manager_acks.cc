// The CacheManager's acks: the executor reports each move of a StepPlan
// (evictions, backups, loads, storage writes, storage prefetches) done or
// failed, and the block settles in its new tier or, on a failure, loses that
// copy or turns with its subtree into a miss (cache_manager.h, "Model").
// What each kind of move does on each outcome is one row of kAckRules, applied
// by one loop (ack_moves), so the rules can be read, and changed, side by side.
#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

namespace {

using Impl = CacheManager::Impl;

enum class AckKind : std::uint8_t { kEviction, kBackup, kLoad, kStorageWrite, kStoragePrefetch };

// How an ack finds its moves: by destination block of one tier; `noun` and `what` name them in errors
// ("<noun> <id> has no <what> in flight").
struct AckTarget {
  int tier;
  const char* noun;
  const char* what;
};

constexpr AckTarget kAckTargets[] = {
    /* kEviction */ {kHst, "eviction: host block", "eviction"},
    /* kBackup */ {kHst, "backup: host block", "backup"},
    /* kLoad */ {kDev, "load: device block", "load"},
    /* kStorageWrite */ {kSto, "storage write: storage slot", "write"},
    /* kStoragePrefetch */ {kHst, "prefetch: host block", "prefetch"},
};

// What a failed move leaves.
enum class OnFailure : std::uint8_t {
  // The target's bytes are garbage and the source copy is gone or unusable: the block and everything computed
  // on top of it become a miss (the subtree is invalidated).
  kMiss,
  // The target block is freed; the source copy was only read and stays as it was.
  kDropTarget,
  // A demotion: the storage slot is freed and the host copy, intact, becomes resident again (marked
  // write_failed, so that under pressure it is dropped rather than written again) unless its parent went to
  // storage meanwhile (a host block below it would break the tier order: a miss then).
  kRestoreSource,
  // A look-ahead load nobody asked for: handled after the other acks, deepest first (retreat_failed_loads).
  kRetreat,
  // A load an admission waits for: its device block is garbage, and so is whatever the engine computes on it,
  // but the host copy it was read from is intact, and so are the host and storage copies below it. The device
  // side leaves the index (the admission sees the failure and recomputes); the lower copies stay indexed
  // (keep_lower_copies_of_failed_load).
  kKeepLowerCopies,
};

// One row per move kind and in-flight state: the state the block leaves, the tier its copy joins on success,
// what is released and what is counted. Every ack settles the node (kSettled), clears a look-ahead mark
// (lookahead_in_flight[lands_in] counts it), and, for a node detached meanwhile, only reclaims it if dead.
struct AckRule {
  AckKind kind;
  NodeState from;
  int lands_in;                      // the tier whose copy becomes present on success
  bool ends_demotion = false;        // pending_demotions counts the move until its ack, whatever the outcome
  bool counts_write = false;         // failed_writes_in_a_row follows the outcome (write-back falls back on it)
  bool frees_source_host = false;    // success: the host block was read by the write, freed only now
  bool clears_write_failed = false;  // success: a stored copy, the host copy's failed write is forgotten
  bool defer_landing = false;        // success: policy insert and retier after every ack, deepest first (loads)
  bool stores_through = false;       // success: a copy that settles on host is also written to storage (write-through)
  OnFailure on_failure = OnFailure::kMiss;
  OnFailure on_lookahead_failure = OnFailure::kMiss;  // the same move queued by the look-ahead prefetch
};

constexpr AckRule kAckRules[] = {
    // Device -> host eviction: the device block was given up at once (and may be reused), so a failure leaves
    // no good copy.
    {.kind = AckKind::kEviction,
     .from = NodeState::kEvicting,
     .lands_in = kHst,
     .stores_through = true,
     .on_failure = OnFailure::kMiss,
     .on_lookahead_failure = OnFailure::kMiss},
    // Device -> host backup (write-through): the device copy stays servable throughout.
    {.kind = AckKind::kBackup,
     .from = NodeState::kBackingUp,
     .lands_in = kHst,
     .stores_through = true,
     .on_failure = OnFailure::kDropTarget,
     .on_lookahead_failure = OnFailure::kDropTarget},
    // Host -> device load: an admitted block's device bytes are garbage, and so is anything computed on them;
    // the host copy it was read from is not.
    {.kind = AckKind::kLoad,
     .from = NodeState::kLoading,
     .lands_in = kDev,
     .defer_landing = true,
     .on_failure = OnFailure::kKeepLowerCopies,
     .on_lookahead_failure = OnFailure::kRetreat},
    // Host -> storage write-through: the host copy stays servable throughout.
    {.kind = AckKind::kStorageWrite,
     .from = NodeState::kStoring,
     .lands_in = kSto,
     .counts_write = true,
     .clears_write_failed = true,
     .on_failure = OnFailure::kDropTarget,
     .on_lookahead_failure = OnFailure::kDropTarget},
    // Host -> storage demotion (write-back): the host block was held, unservable, for the write.
    {.kind = AckKind::kStorageWrite,
     .from = NodeState::kDemoting,
     .lands_in = kSto,
     .ends_demotion = true,
     .counts_write = true,
     .frees_source_host = true,
     .clears_write_failed = true,
     .on_failure = OnFailure::kRestoreSource,
     .on_lookahead_failure = OnFailure::kRestoreSource},
    // Storage -> host prefetch: descendants may have landed on host already, so a storage-only block cannot stay
    // above them.
    {.kind = AckKind::kStoragePrefetch,
     .from = NodeState::kFetching,
     .lands_in = kHst,
     .on_failure = OnFailure::kMiss,
     .on_lookahead_failure = OnFailure::kMiss},
};

// The rule for a node in `state` acked as a move of `kind`; nullptr when it has no such move in flight.
const AckRule* find_rule(AckKind kind, NodeState state) {
  for (const AckRule& r : kAckRules)
    if (r.kind == kind && r.from == state) return &r;
  return nullptr;
}

// The node whose move of `kind` lands in block b of the kind's target tier, or kNoNode.
NodeId acked_node(const Impl& s, AckKind kind, BlockId b, const AckRule** rule) {
  const int t = kAckTargets[static_cast<int>(kind)].tier;
  if (b >= s.owner[t].size() || s.owner[t][b] == kNoNode) return kNoNode;
  const NodeId id = s.owner[t][b];
  *rule = find_rule(kind, s.nodes[id].state);
  return *rule ? id : kNoNode;
}

// Success: the copy joins its tier.
void land(Impl& s, NodeId id, const AckRule& r, std::vector<NodeId>& landed, int& deferred_tier) {
  Node& n = s.nodes[id];
  n.present |= bit(r.lands_in);
  s.announce(id);
  if (r.clears_write_failed) n.write_failed = false;
  if (r.lands_in == kDev) n.load_failed = false;  // its host copy read well
  if (r.defer_landing) {
    landed.push_back(id);
    deferred_tier = r.lands_in;
    return;
  }
  s.track_insert(id, r.lands_in);
  if (r.frees_source_host) {
    s.free_block(kHst, n.block[kHst]);
    n.block[kHst] = kNoBlock;
  }
  s.retier(id);
  if (r.stores_through) s.store_through(id);
}

// Gives node `id`'s place in the index (its key, parent, children, protection) to a new node holding its host
// and storage copies, and detaches `id` with what is left: its device block, state and pins, so that the
// admissions that pinned it see it failed and it is reclaimed once they release it (and, if loading, once its
// load acks). Returns the new node. A move still reading the host copy that changed hands is safe: a later
// write to that block waits for it (the TransferManager orders writes after pending reads).
NodeId replace_by_lower_copies(Impl& s, NodeId id, bool load_failed) {
  const NodeId parent = s.nodes[id].parent;
  const BlockKey key = s.nodes[id].key;
  s.map.erase(key);
  const bool prot = s.wanted(id) > 0;
  for (int t = 0; t < kNumTiers; ++t) {
    if (prot)
      s.parked[t].erase(s.park_key(id));
    else
      s.policy[t]->erase(id);
  }
  if (prot) s.want[id] = Impl::NodeWant{};   // the new node takes the key's protection (init_wanted)
  const NodeId y = s.new_node(key, parent);  // may grow s.nodes: references are taken after it
  Node& n = s.nodes[id];
  Node& r = s.nodes[y];
  r.hits = n.hits;
  r.load_failed = load_failed;
  r.write_failed = n.write_failed;
  n.write_failed = false;
  constexpr auto kLower = static_cast<std::uint8_t>(bit(kHst) | bit(kSto));
  for (int t : {kHst, kSto}) {
    if (n.block[t] == kNoBlock) continue;
    s.set_block(y, t, n.block[t]);
    n.block[t] = kNoBlock;
  }
  r.present = n.present & kLower;
  n.present = static_cast<std::uint8_t>(n.present & ~kLower);
  // The copies that changed nodes stay announced: no BlockRemoved / BlockStored pair for bytes that did not move.
  r.announced = n.announced & kLower;
  n.announced = static_cast<std::uint8_t>(n.announced & ~kLower);
  while (n.first_child != kNoNode) {
    const NodeId c = n.first_child;
    s.unlink_from_parent(c);
    s.link_to_parent(c, y);
  }
  s.unlink_from_parent(id);
  n.detached = true;
  ++s.st.invalidated_blocks;
  s.sync_reclaim(id);
  s.announce(id);
  s.retier(y);
  for (int t : {kHst, kSto})
    if (r.present & bit(t)) s.track_insert(y, t, /*accessed=*/false);
  s.announce(y);
  if (n.state == NodeState::kLoading) {  // its load still reads the host block y now holds
    s.pin(y);
    s.reading_replacement.emplace(id, y);
  }
  // `id` itself held the host copy an earlier replaced node's load still reads: that pin moves with the copy.
  for (auto& [reader, holder] : s.reading_replacement)
    if (holder == id) {
      holder = y;
      s.unpin(id);
      s.pin(y);
    }
  return y;
}

// The ack of a replaced node's load: the node that took its host copy may go now.
void release_reading_replacement(Impl& s, NodeId id) {
  auto it = s.reading_replacement.find(id);
  if (it == s.reading_replacement.end()) return;
  const NodeId y = it->second;
  s.reading_replacement.erase(it);
  s.unpin(y);
  s.reclaim_if_dead(y);
}

// A load that failed while an admission waits for it (or a failed look-ahead load with pinned blocks below it):
// node `id`, settled without a device copy, keeps its host copy in the index. Below it, every node on or bound
// for the device goes back to its host copy: a settled, unpinned device copy is released, a look-ahead load
// retreats when it acks, a pinned or admitted one is replaced by its lower copies (the admission recomputes).
// Only a node with no host copy (a device-only block, or one in the middle of another move), or one whose host
// copy already failed a load once (Node::load_failed), is invalidated with its subtree.
void keep_lower_copies_of_failed_load(Impl& s, NodeId id) {
  if (!(s.nodes[id].present & bit(kHst)) || s.nodes[id].load_failed) {
    s.detach_subtree(id);
    return;
  }
  std::vector<NodeId> replaced{id};
  std::vector<NodeId> stack{replace_by_lower_copies(s, id, /*load_failed=*/true)};
  std::vector<NodeId> children;
  while (!stack.empty()) {
    const NodeId p = stack.back();
    stack.pop_back();
    children.clear();
    for (NodeId c = s.nodes[p].first_child; c != kNoNode; c = s.nodes[c].next_sib) children.push_back(c);
    for (NodeId c : children) {
      Node& n = s.nodes[c];
      if (n.counted_tier != kDev) continue;  // the tier order keeps everything below it off the device too
      const bool has_host = (n.present & bit(kHst)) != 0;
      if (has_host && n.state == NodeState::kLoading && n.lookahead_move && n.refs == 0) {
        n.retreat_on_ack = true;
        s.retier(c);
        stack.push_back(c);
      } else if (has_host && n.state == NodeState::kSettled && n.refs == 0) {
        s.release_copy(c, kDev);
        s.retier(c);
        stack.push_back(c);
      } else if (has_host && (n.state == NodeState::kSettled || n.state == NodeState::kLoading)) {
        replaced.push_back(c);
        stack.push_back(replace_by_lower_copies(s, c, n.load_failed));
      } else {
        s.detach_subtree(c);
      }
    }
  }
  for (NodeId x : replaced) s.reclaim_if_dead(x);
  ++s.epoch;
}

// Failure of the move into tier t's block b.
void fail(Impl& s, NodeId id, OnFailure what, int t, BlockId b, std::vector<NodeId>& retreating) {
  Node& n = s.nodes[id];
  ++s.st.failed_transfers;
  switch (what) {
    case OnFailure::kMiss: s.detach_subtree(id); return;
    case OnFailure::kRetreat: retreating.push_back(id); return;
    case OnFailure::kKeepLowerCopies: keep_lower_copies_of_failed_load(s, id); return;
    case OnFailure::kDropTarget:
    case OnFailure::kRestoreSource: break;
  }
  s.free_block(t, b);
  n.block[t] = kNoBlock;
  if (what == OnFailure::kRestoreSource) {
    const int parent_tier = n.parent == Impl::kRoot ? kDev : s.eventual_tier(s.nodes[n.parent]);
    if (parent_tier > kHst) {
      s.detach_subtree(id);
      return;
    }
    n.present |= bit(kHst);
    s.announce(id);
    n.write_failed = true;
    s.track_insert(id, kHst);
  }
  s.retier(id);
}

// The nodes below `id` bound for or on the device, deepest first, when each can go back to its host copy: a
// look-ahead load in flight (it retreats when it acks) or a settled device copy that has a host copy beside it,
// none pinned. Empty when one cannot (then the subtree is invalidated instead).
std::optional<std::vector<NodeId>> device_nodes_that_can_retreat(const Impl& s, NodeId id) {
  std::vector<NodeId> out, stack{id};
  while (!stack.empty()) {
    const NodeId x = stack.back();
    stack.pop_back();
    for (NodeId c = s.nodes[x].first_child; c != kNoNode; c = s.nodes[c].next_sib) {
      const Node& n = s.nodes[c];
      if (n.counted_tier != kDev) continue;  // the tier order keeps everything below it off the device too
      const bool has_host = (n.present & bit(kHst)) != 0;
      const bool loading = n.state == NodeState::kLoading && n.lookahead_move;
      const bool settled = n.state == NodeState::kSettled && (n.present & bit(kDev)) != 0;
      if (n.refs != 0 || !has_host || !(loading || settled)) return std::nullopt;
      out.push_back(c);
      stack.push_back(c);
    }
  }
  std::sort(out.begin(), out.end(), [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  return out;
}

// Failed look-ahead loads, deepest first, so that one whose children went back to host can go back too.
void retreat_failed_loads(Impl& s, std::vector<NodeId>& ids) {
  std::sort(ids.begin(), ids.end(), [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  for (NodeId id : ids) {
    Node& n = s.nodes[id];
    if (n.detached || n.state != NodeState::kSettled || n.block[kDev] == kNoBlock)
      continue;  // detached with a subtree above (reclaimed there), or gone back already
    // Nobody admitted it (a look-ahead prefetch: a match stops at a block in flight): its device block is
    // garbage, the host copy it was read from is intact, and so are the host copies below it. What sits below it
    // on the device goes back to host with it (loads in flight when they ack); only where that cannot be (a
    // pinned block) do the host copies take the device blocks' places in the index
    // (keep_lower_copies_of_failed_load), and only a device-only copy is invalidated with its subtree.
    if (n.load_failed) {  // its host copy failed a load before: it goes now
      s.detach_subtree(id);
      continue;
    }
    std::optional<std::vector<NodeId>> below;
    if (n.refs == 0) below = device_nodes_that_can_retreat(s, id);
    if (!below) {
      keep_lower_copies_of_failed_load(s, id);
      continue;
    }
    for (NodeId c : *below) {
      if (s.nodes[c].state == NodeState::kLoading)
        s.nodes[c].retreat_on_ack = true;
      else
        s.release_copy(c, kDev);
      s.retier(c);
    }
    s.free_block(kDev, n.block[kDev]);
    n.block[kDev] = kNoBlock;
    n.load_failed = true;
    s.retier(id);
    ++s.epoch;
  }
}

// A load acked under a failed one (retreat_on_ack): the device copy is given up, the host copy stays.
void retreat_on_ack(Impl& s, NodeId id) {
  Node& n = s.nodes[id];
  n.retreat_on_ack = false;
  if (n.present & bit(kDev)) {
    s.release_copy(id, kDev);
  } else {
    s.free_block(kDev, n.block[kDev]);
    n.block[kDev] = kNoBlock;
  }
  s.retier(id);
  ++s.epoch;
}

// Applies the rules to every move of `kind` whose destination block is listed; all-or-nothing on a block
// with no such move in flight (FailedPrecondition, nothing changed). A block listed twice is acked once.
Status ack_moves(Impl& s, AckKind kind, std::span<const BlockId> blocks, const Status& status) {
  const AckTarget& target = kAckTargets[static_cast<int>(kind)];
  const AckRule* rule = nullptr;
  for (BlockId b : blocks) {
    const NodeId id = acked_node(s, kind, b, &rule);
    if (id == kNoNode) return FailedPrecondition(fmt::format("{} {} has no {} in flight", target.noun, b, target.what));
    if (s.nodes[id].untaken)
      return FailedPrecondition(
          fmt::format("{} {} has its {} queued, not yet handed out by take_plan()", target.noun, b, target.what));
  }
  std::vector<NodeId> landed, retreating;
  int deferred_tier = kNoTier;
  for (BlockId b : blocks) {
    const NodeId id = acked_node(s, kind, b, &rule);
    if (id == kNoNode) continue;  // listed twice: settled by its first ack
    const AckRule& r = *rule;
    Node& n = s.nodes[id];
    if (r.ends_demotion) --s.pending_demotions;
    n.state = NodeState::kSettled;
    if (r.counts_write) s.failed_writes_in_a_row = status.ok() ? 0 : s.failed_writes_in_a_row + 1;
    const bool lookahead = n.lookahead_move;
    if (lookahead) {
      n.lookahead_move = false;
      --s.lookahead_in_flight[r.lands_in];
    }
    if (n.detached) {
      // A failed move counts whether or not an earlier failure of this ack already invalidated the block.
      if (!status.ok()) ++s.st.failed_transfers;
      release_reading_replacement(s, id);
      s.reclaim_if_dead(id);
    } else if (n.retreat_on_ack)
      retreat_on_ack(s, id);
    else if (status.ok())
      land(s, id, r, landed, deferred_tier);
    else
      fail(s, id, lookahead ? r.on_lookahead_failure : r.on_failure, target.tier, b, retreating);
    s.sync_reclaim(id);  // the settled state counts at once, whatever the outcome deferred
  }
  retreat_failed_loads(s, retreating);
  // Deferred landings (one kind per call, so one tier), deepest first: parents end up more recent in the
  // policy than their children.
  std::sort(landed.begin(), landed.end(), [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  for (NodeId id : landed) {
    if (s.nodes[id].detached) continue;
    s.track_insert(id, deferred_tier);
    s.retier(id);
  }
  return Status::Ok();
}

}  // namespace

Status CacheManager::ack_evictions(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  return ack_moves(*impl_, AckKind::kEviction, host_blocks, status);
}

Status CacheManager::ack_backups(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  return ack_moves(*impl_, AckKind::kBackup, host_blocks, status);
}

Status CacheManager::ack_loads(std::span<const BlockId> device_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  return ack_moves(*impl_, AckKind::kLoad, device_blocks, status);
}

Status CacheManager::ack_storage_writes(std::span<const BlockId> storage_slots, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  return ack_moves(*impl_, AckKind::kStorageWrite, storage_slots, status);
}

Status CacheManager::ack_storage_prefetches(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  return ack_moves(*impl_, AckKind::kStoragePrefetch, host_blocks, status);
}

Status CacheManager::ack_plan(const StepPlan& plan, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  auto dsts = [](const std::vector<BlockMove>& v) {
    std::vector<BlockId> out;
    out.reserve(v.size());
    for (const BlockMove& m : v) out.push_back(m.dst);
    return out;
  };
  // Every kind is acknowledged even after another's ack failed (a kind left out stayed in flight forever); the
  // first error is returned.
  Status first = Status::Ok();
  auto keep_first = [&](Status st) {
    if (!st.ok() && first.ok()) first = std::move(st);
  };
  keep_first(ack_evictions(dsts(plan.evictions), status));
  keep_first(ack_backups(dsts(plan.backups), status));
  keep_first(ack_loads(dsts(plan.loads), status));
  keep_first(ack_storage_writes(dsts(plan.storage_writes), status));
  keep_first(ack_storage_prefetches(dsts(plan.storage_prefetches), status));
  return first;
}

}  // namespace kvtier::cache
