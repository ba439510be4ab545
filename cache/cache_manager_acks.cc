// The CacheManager's acks: the executor reports each move of a StepPlan
// (evictions, backups, loads, storage writes, storage prefetches) done or
// failed, and the block settles in its new tier or, on a failure, loses that
// copy or turns with its subtree into a miss (cache_manager.h, "Model").
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

#define KVTIER_ACK_LOOKUP(tier, b, want, what)                                                                 \
  if ((b) >= s.owner[tier].size() || s.owner[tier][b] == kNoNode || s.nodes[s.owner[tier][b]].state != (want)) \
    return FailedPrecondition(                                                                                 \
        fmt::format("{}: {} block {} has no {} in flight", what, tier_name(static_cast<Tier>(tier)), b, what));

Status CacheManager::ack_evictions(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kEvicting;
  for (BlockId b : host_blocks) KVTIER_ACK_LOOKUP(kHst, b, NodeState::kEvicting, "eviction");
  for (BlockId b : host_blocks) {
    NodeId id = s.owner[kHst][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kHst);
      s.announce(id);
      s.track_insert(id, kHst);
      s.retier(id);
      s.store_through(id);
    } else {
      // The device copy is gone (its block was reused) and the host copy is garbage: a miss from here down.
      ++s.st.failed_transfers;
      s.detach_subtree(id);
    }
  }
  return Status::Ok();
}

Status CacheManager::ack_backups(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kBackingUp;
  for (BlockId b : host_blocks) KVTIER_ACK_LOOKUP(kHst, b, NodeState::kBackingUp, "backup");
  for (BlockId b : host_blocks) {
    NodeId id = s.owner[kHst][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kHst);
      s.announce(id);
      s.track_insert(id, kHst);
      s.store_through(id);
    } else {
      ++s.st.failed_transfers;
      s.free_block(kHst, b);
      n.block[kHst] = kNoBlock;  // the device copy stays
    }
  }
  return Status::Ok();
}

Status CacheManager::ack_loads(std::span<const BlockId> device_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kLoading;
  for (BlockId b : device_blocks) KVTIER_ACK_LOOKUP(kDev, b, NodeState::kLoading, "load");
  std::vector<NodeId> landed, failed_lookahead;
  for (BlockId b : device_blocks) {
    NodeId id = s.owner[kDev][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    const bool lookahead = n.lookahead_move;
    if (lookahead) {
      n.lookahead_move = false;
      --s.lookahead_in_flight[kDev];
    }
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kDev);
      s.announce(id);
      landed.push_back(id);
    } else if (lookahead) {
      ++s.st.failed_transfers;
      failed_lookahead.push_back(id);
    } else {
      // Device bytes are garbage, and so is anything computed on top of them.
      ++s.st.failed_transfers;
      s.detach_subtree(id);
    }
  }
  // Deepest first, so that a failed look-ahead load whose children went back to host can go back too.
  std::sort(failed_lookahead.begin(), failed_lookahead.end(),
            [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  for (NodeId id : failed_lookahead) {
    Node& n = s.nodes[id];
    if (n.detached) continue;  // detached with a subtree above: reclaimed there
    if (n.refs == 0 && n.child_tier[kDev] == 0) {
      // Nobody admitted it (a look-ahead prefetch: a match stops at a block in flight) and nothing on the
      // device sits below it: the device block is garbage, the host copy it was read from is intact.
      s.free_block(kDev, n.block[kDev]);
      n.block[kDev] = kNoBlock;
      s.retier(id);
      ++s.epoch;
    } else {
      // Device bytes are garbage, and so is anything computed on top of them.
      s.detach_subtree(id);
    }
  }
  std::sort(landed.begin(), landed.end(), [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  for (NodeId id : landed) {
    if (s.nodes[id].detached) continue;
    s.track_insert(id, kDev);
    s.retier(id);
  }
  return Status::Ok();
}

Status CacheManager::ack_storage_writes(std::span<const BlockId> storage_slots, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  for (BlockId b : storage_slots)
    if (b >= s.owner[kSto].size() || s.owner[kSto][b] == kNoNode ||
        (s.nodes[s.owner[kSto][b]].state != NodeState::kDemoting &&
         s.nodes[s.owner[kSto][b]].state != NodeState::kStoring))
      return FailedPrecondition(fmt::format("storage write: storage slot {} has no write in flight", b));
  for (BlockId b : storage_slots) {
    NodeId id = s.owner[kSto][b];
    if (id == kNoNode || (s.nodes[id].state != NodeState::kDemoting && s.nodes[id].state != NodeState::kStoring))
      continue;  // listed twice
    Node& n = s.nodes[id];
    bool demoting = n.state == NodeState::kDemoting;
    if (demoting) --s.pending_demotions;
    n.state = NodeState::kSettled;
    s.failed_writes_in_a_row = status.ok() ? 0 : s.failed_writes_in_a_row + 1;
    if (n.detached) {
      s.reclaim_if_dead(id);
      continue;
    }
    if (status.ok()) {
      n.present |= bit(kSto);
      s.announce(id);
      n.write_failed = false;
      s.track_insert(id, kSto);
      if (demoting) {  // the host block was read by the write: free it only now
        s.free_block(kHst, n.block[kHst]);
        n.block[kHst] = kNoBlock;
      }
    } else {
      ++s.st.failed_transfers;
      s.free_block(kSto, b);
      n.block[kSto] = kNoBlock;
      if (demoting) {
        int parent_tier = n.parent == Impl::kRoot ? kDev : s.eventual_tier(s.nodes[n.parent]);
        if (parent_tier > kHst) {
          // The parent went to storage meanwhile: a host block below it would break the order.
          s.detach_subtree(id);
          continue;
        }
        n.present |= bit(kHst);  // the host copy is intact: it stays
        s.announce(id);
        n.write_failed = true;
        s.track_insert(id, kHst);
      }
    }
    s.retier(id);
  }
  return Status::Ok();
}

Status CacheManager::ack_storage_prefetches(std::span<const BlockId> host_blocks, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kFetching;
  for (BlockId b : host_blocks) KVTIER_ACK_LOOKUP(kHst, b, NodeState::kFetching, "prefetch");
  for (BlockId b : host_blocks) {
    NodeId id = s.owner[kHst][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    if (n.lookahead_move) {
      n.lookahead_move = false;
      --s.lookahead_in_flight[kHst];
    }
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kHst);
      s.announce(id);
      s.track_insert(id, kHst);
      s.retier(id);
    } else {
      // Descendants may already have landed on host; keeping this block in storage would put
      // host blocks below a storage block. The subtree becomes a miss (recompute).
      ++s.st.failed_transfers;
      s.detach_subtree(id);
    }
  }
  return Status::Ok();
}

#undef KVTIER_ACK_LOOKUP

Status CacheManager::ack_plan(const StepPlan& plan, const Status& status) {
  status.ignore_error();  // taken over here: with no block to ack, the outcome concerns none
  ExportOnReturn exported(*this);
  auto dsts = [](const std::vector<BlockMove>& v) {
    std::vector<BlockId> out;
    out.reserve(v.size());
    for (const BlockMove& m : v) out.push_back(m.dst);
    return out;
  };
  KVTIER_RETURN_IF_ERROR(ack_evictions(dsts(plan.evictions), status));
  KVTIER_RETURN_IF_ERROR(ack_backups(dsts(plan.backups), status));
  KVTIER_RETURN_IF_ERROR(ack_loads(dsts(plan.loads), status));
  KVTIER_RETURN_IF_ERROR(ack_storage_writes(dsts(plan.storage_writes), status));
  KVTIER_RETURN_IF_ERROR(ack_storage_prefetches(dsts(plan.storage_prefetches), status));
  return Status::Ok();
}

}  // namespace kvtier::cache
