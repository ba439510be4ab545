// CacheManager::check_invariants(): a walk over the whole state that checks
// the invariants of cache_manager.h (block ownership against the pools,
// references against the admissions, in-flight bookkeeping, policy tracking,
// the index, tier order along every path and the child tier counts). Tests
// and replay's check_invariants_every call it; the request path does not.
#include <fmt/format.h>

#include <array>
#include <vector>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

Status CacheManager::check_invariants() const {
  const Impl& s = *impl_;
  std::vector<std::uint32_t> refs(s.nodes.size(), 0);
  std::array<std::vector<std::uint8_t>, kNumTiers> seen;
  for (int t = 0; t < kNumTiers; ++t) seen[t].assign(s.pools[t].capacity(), 0);
  std::uint32_t receiving = 0, quarantined = 0;
  for (const auto& [aid, rec] : s.admissions) {
    for (NodeId n : rec.pinned) ++refs[n];
    // Receive blocks a peer may still write: owned by the admission, never indexed, never committed.
    if (rec.recv_end > rec.blocks.size() || rec.recv_begin > rec.recv_end ||
        (rec.recv != AdmissionRec::Recv::kNone && rec.recv_begin != rec.hit_blocks) ||
        rec.recv_loaded > rec.recv_end - rec.recv_begin)
      return Internal(fmt::format("admission {} has a malformed receive range [{}, {}) loaded {}", aid, rec.recv_begin,
                                  rec.recv_end, rec.recv_loaded));
    const std::uint32_t guard = rec.guard_begin();
    for (std::uint32_t i = guard; i < rec.recv_end; ++i) {
      if (!rec.owned[i])
        return Internal(fmt::format("admission {}: guarded receive position {} (device block {}) is not owned", aid, i,
                                    rec.blocks[i]));
      if (i < rec.keys.size() && (rec.pos_node[i] != kNoNode || rec.committed > i))
        return Internal(fmt::format("admission {}: guarded receive position {} (device block {}) was committed", aid, i,
                                    rec.blocks[i]));
    }
    if (rec.recv == AdmissionRec::Recv::kReceiving) receiving += rec.recv_end - guard;
    if (rec.recv == AdmissionRec::Recv::kQuarantined) quarantined += rec.recv_end - guard;
    for (std::size_t i = 0; i < rec.blocks.size(); ++i)
      if (rec.owned[i]) {
        BlockId b = rec.blocks[i];
        if (seen[kDev][b]++) return Internal(fmt::format("device block {} owned twice (admission {})", b, aid));
        if (s.pools[kDev].is_free(b)) return Internal(fmt::format("admission {} owns free device block {}", aid, b));
      }
  }
  for (const auto& [aid, held] : s.quarantine) {
    if (s.admissions.count(aid)) return Internal(fmt::format("admission {} is both open and released", aid));
    if (held.empty()) return Internal(fmt::format("admission {} has an empty quarantine entry", aid));
    for (BlockId b : held) {
      if (b >= seen[kDev].size()) return Internal(fmt::format("quarantined device block {} out of range", b));
      if (seen[kDev][b]++) return Internal(fmt::format("quarantined device block {} owned twice", b));
      if (s.pools[kDev].is_free(b))
        return Internal(fmt::format("quarantined device block {} (admission {}) is in the free pool", b, aid));
    }
    quarantined += static_cast<std::uint32_t>(held.size());
  }
  if (receiving != s.receiving_now || quarantined != s.quarantined_now)
    return Internal(fmt::format("receive gauges say {} receiving, {} quarantined; admissions hold {} and {}",
                                s.receiving_now, s.quarantined_now, receiving, quarantined));
  std::size_t live_attached = 0;
  for (NodeId id = 1; id < s.nodes.size(); ++id) {
    const Node& n = s.nodes[id];
    if (!n.live) continue;
    if (n.refs != refs[id])
      return Internal(fmt::format("node {} has {} refs, admissions hold {}", id, n.refs, refs[id]));
    for (int t = 0; t < kNumTiers; ++t) {
      BlockId b = n.block[t];
      if (b == kNoBlock) {
        if (n.present & bit(t)) return Internal(fmt::format("node {} present in {} without a block", id, t));
        continue;
      }
      if (seen[t][b]++) return Internal(fmt::format("{} block {} owned twice", tier_name(Tier(t)), b));
      if (s.pools[t].is_free(b)) return Internal(fmt::format("node {} holds free {} block {}", id, t, b));
      if (s.owner[t][b] != id) return Internal(fmt::format("owner of {} block {} is not node {}", t, b, id));
    }
    // In-flight bookkeeping.
    switch (n.state) {
      case NodeState::kSettled: break;
      case NodeState::kLoading:
        if (!(n.present & bit(kHst)) || (n.present & bit(kDev)) || n.block[kDev] == kNoBlock)
          return Internal(fmt::format("loading node {} malformed", id));
        break;
      case NodeState::kEvicting:
        if ((n.present & (bit(kDev) | bit(kHst))) || n.block[kDev] != kNoBlock || n.block[kHst] == kNoBlock)
          return Internal(fmt::format("evicting node {} malformed", id));
        break;
      case NodeState::kBackingUp:
        if (!(n.present & bit(kDev)) || (n.present & bit(kHst)) || n.block[kHst] == kNoBlock)
          return Internal(fmt::format("backing-up node {} malformed", id));
        break;
      case NodeState::kFetching:
        if (!(n.present & bit(kSto)) || (n.present & bit(kHst)) || n.block[kHst] == kNoBlock)
          return Internal(fmt::format("fetching node {} malformed", id));
        break;
      case NodeState::kStoring:
      case NodeState::kDemoting:
        if ((n.present & bit(kSto)) || n.block[kSto] == kNoBlock)
          return Internal(fmt::format("storing node {} malformed", id));
        break;
    }
    for (int t = 0; t < kNumTiers; ++t) {
      bool tracked = s.policy[t]->contains(id);
      bool want = !n.detached && (n.present & bit(t));
      if (tracked != want)
        return Internal(
            fmt::format("node {}: {} policy tracking {} != resident {}", id, tier_name(Tier(t)), tracked, want));
    }
    if (n.detached) {
      if (s.map.find(n.key) == id) return Internal(fmt::format("detached node {} indexed", id));
      if (n.refs == 0 && n.state == NodeState::kSettled)
        return Internal(fmt::format("detached node {} not reclaimed", id));
      continue;
    }
    ++live_attached;
    if (s.map.find(n.key) != id) return Internal(fmt::format("node {} not indexed by its key", id));
    if (n.parent == kNoNode || !s.nodes[n.parent].live || s.nodes[n.parent].detached)
      return Internal(fmt::format("node {} is orphaned (parent {})", id, n.parent));
    const Node& p = s.nodes[n.parent];
    if (n.depth != p.depth + 1) return Internal(fmt::format("node {} depth {} parent depth {}", id, n.depth, p.depth));
    int t = s.eventual_tier(n);
    if (t == kNoTier) return Internal(fmt::format("node {} has no copy and nothing in flight", id));
    if (t != n.counted_tier)
      return Internal(fmt::format("node {} counted as tier {} is tier {}", id, n.counted_tier, t));
    int pt = n.parent == Impl::kRoot ? kDev : s.eventual_tier(p);
    if (pt > t)
      return Internal(
          fmt::format("tier order broken: node {} in tier {} below node {} in tier {}", id, t, n.parent, pt));
    std::array<std::uint32_t, 4> ct{};
    bool found_self = false;
    for (NodeId c = n.first_child; c != kNoNode; c = s.nodes[c].next_sib) {
      if (s.nodes[c].parent != id)
        return Internal(fmt::format("child {} of node {} has parent {}", c, id, s.nodes[c].parent));
      ++ct[s.nodes[c].counted_tier];
    }
    for (NodeId c = p.first_child; c != kNoNode && !found_self; c = s.nodes[c].next_sib) found_self = c == id;
    if (!found_self) return Internal(fmt::format("node {} missing from its parent's children", id));
    if (ct != n.child_tier) return Internal(fmt::format("node {} child tier counts stale", id));
  }
  if (live_attached != s.map.size())
    return Internal(fmt::format("index has {} keys but {} attached nodes", s.map.size(), live_attached));
  for (int t = 0; t < kNumTiers; ++t) {
    std::uint32_t used = 0;
    for (auto v : seen[t]) used += v;
    if (used != s.pools[t].num_used())
      return Internal(
          fmt::format("{} pool has {} used blocks, {} accounted for", tier_name(Tier(t)), s.pools[t].num_used(), used));
  }
  return Status::Ok();
}

}  // namespace kvtier::cache
