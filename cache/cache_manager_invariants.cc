// CacheManager::check_invariants(): a walk over the whole state that checks
// the invariants of cache_manager.h (block ownership against the pools,
// references against the admissions, in-flight bookkeeping, policy tracking,
// the index, tier order along every path and the child tier counts, and the
// look-ahead's announcement counts and protected copies). Tests
// and replay's check_invariants_every call it; the request path does not.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <unordered_map>
#include <vector>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

namespace {

// Announcements against their indexes: queue order, expiry, conversations and the per-key counts.
Status check_lookahead(const CacheManager::Impl& s) {
  using Impl = CacheManager::Impl;
  std::unordered_map<BlockKey, Impl::KeyWant, BlockKeyHash> expect;
  std::size_t queued = 0, retained = 0, by_conversation = 0;
  for (const auto& [qid, a] : s.announcements) {
    if (qid == 0 || qid >= s.next_queued) return Internal(fmt::format("announcement id {} out of range", qid));
    if (a.queued) {
      ++queued;
      auto q = s.queue_order.find({-static_cast<std::int64_t>(a.hints.priority), qid});
      if (q == s.queue_order.end())
        return Internal(fmt::format("queued request {} is missing from the queue order", qid));
      if (q->second != &a) return Internal(fmt::format("queued request {}'s queue entry points elsewhere", qid));
    } else {
      ++retained;
      if (a.expires_at <= s.step)
        return Internal(fmt::format("retention of request {} ended at step {}, now {}", qid, a.expires_at, s.step));
      bool found = false;
      for (auto [e, end] = s.expiry.equal_range(a.expires_at); e != end && !found; ++e) found = e->second == qid;
      if (!found) return Internal(fmt::format("retained request {} is missing from the expiry index", qid));
      if (a.hints.conversation_id != 0) {
        ++by_conversation;
        auto c = s.retained_by_conversation.find(a.hints.conversation_id);
        if (c == s.retained_by_conversation.end() || std::count(c->second.begin(), c->second.end(), qid) != 1)
          return Internal(fmt::format("retained request {} is not listed once under conversation {}", qid,
                                      a.hints.conversation_id));
      }
    }
    for (const BlockKey& k : a.keys) {
      Impl::KeyWant& e = expect[k];
      if (e.count == 0 || a.rank(qid).better_than(e.rank)) e.rank = a.rank(qid);
      ++e.count;
    }
  }
  std::size_t listed = 0;
  for (const auto& [conv, ids] : s.retained_by_conversation) listed += ids.size();
  if (queued != s.queue_order.size() || retained != s.expiry.size() || by_conversation != listed)
    return Internal(
        fmt::format("announcements: {} queued, {} retained ({} with a conversation); indexes hold {}, {} and {}",
                    queued, retained, by_conversation, s.queue_order.size(), s.expiry.size(), listed));
  if (expect.size() != s.wanted_keys.size())
    return Internal(fmt::format("{} keys are announced, {} counted", expect.size(), s.wanted_keys.size()));
  for (const auto& [k, e] : expect) {
    const Impl::KeyWant* w = s.wanted_keys.find(k);
    if (w == nullptr || w->count != e.count)
      return Internal(
          fmt::format("key {} is held by {} announcements, counted {}", k.hex(), e.count, w == nullptr ? 0 : w->count));
    // The kept rank is the best since the count was last 0: never worse than a current holder's.
    if (e.rank.better_than(w->rank))
      return Internal(fmt::format("key {} has rank ({}, {}), worse than its holder's ({}, {})", k.hex(),
                                  w->rank.priority, w->rank.seq, e.rank.priority, e.rank.seq));
  }
  return Status::Ok();
}

}  // namespace

Status CacheManager::check_invariants() const {
  const Impl& s = *impl_;
  std::vector<std::uint32_t> refs(s.nodes.size(), 0);
  std::array<std::vector<std::uint8_t>, kNumTiers> seen;
  for (int t = 0; t < kNumTiers; ++t) seen[t].assign(s.pools[t].capacity(), 0);
  std::uint32_t receiving = 0, quarantined = 0;
  // A node replaced while its load was in flight pins its replacement until that load acks.
  for (const auto& [twin, y] : s.reading_replacement) {
    if (twin >= s.nodes.size() || y >= s.nodes.size() || !s.nodes[twin].live || !s.nodes[twin].detached ||
        s.nodes[twin].state != NodeState::kLoading || !s.nodes[y].live)
      return Internal(
          fmt::format("replaced loading node {} -> {} is not a detached load in flight and a node", twin, y));
    ++refs[y];
  }
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
  KVTIER_RETURN_IF_ERROR(check_lookahead(s));
  std::size_t live_attached = 0;
  std::array<std::size_t, kNumTiers> parked{}, lookahead_moves{};
  for (NodeId id = 1; id < s.nodes.size(); ++id) {
    const Node& n = s.nodes[id];
    if (!n.live) {
      if (s.wanted(id)) return Internal(fmt::format("removed node {} is still protected ({})", id, s.wanted(id)));
      continue;
    }
    if (n.lookahead_move) {
      if (n.state != NodeState::kLoading && n.state != NodeState::kFetching)
        return Internal(fmt::format("node {} is marked as a look-ahead move but is not loading or fetching", id));
      ++lookahead_moves[n.state == NodeState::kLoading ? kDev : kHst];
    }
    // Protection: attached nodes count the announcements holding their key, detached ones none.
    const std::uint32_t wanted = s.wanted(id);
    if (n.detached) {
      if (wanted) return Internal(fmt::format("detached node {} is still protected ({})", id, wanted));
    } else {
      const Impl::KeyWant* w = s.wanted_keys.find(n.key);
      const std::uint32_t count = w == nullptr ? 0 : w->count;
      if (wanted != count)
        return Internal(
            fmt::format("node {} (key {}) counts {} announcements, {} hold its key", id, n.key.hex(), wanted, count));
      if (count && !(Impl::Rank{s.want[id].priority, s.want[id].seq} == w->rank))
        return Internal(fmt::format("node {} has rank ({}, {}), its key ({}, {})", id, s.want[id].priority,
                                    s.want[id].seq, w->rank.priority, w->rank.seq));
    }
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
        // A detached one may have handed its host copy to the node that took its place (a failed load above it).
        if ((!(n.present & bit(kHst)) && !n.detached) || (n.present & bit(kDev)) || n.block[kDev] == kNoBlock)
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
      // A resident copy is tracked by its tier's policy, or parked while protected: never both.
      bool resident = !n.detached && (n.present & bit(t));
      bool tracked = s.policy[t]->contains(id);
      bool in_parked = wanted && s.parked[t].count(s.park_key(id)) != 0;
      if (tracked != (resident && !wanted) || in_parked != (resident && wanted))
        return Internal(fmt::format("node {}: {} policy tracking {}, parked {}, resident {}, protected by {}", id,
                                    tier_name(Tier(t)), tracked, in_parked, resident, wanted));
      if (tracked && (s.told_blocked[t][id] != 0) != s.blocked_in(n, t))
        return Internal(fmt::format("node {}: {} policy told blocked {}, its copies and children give {}", id,
                                    tier_name(Tier(t)), s.told_blocked[t][id] != 0, s.blocked_in(n, t)));
      parked[t] += in_parked;
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
  // The incremental count of reclaimable device blocks against a full recount, and the per-node state behind it
  // (the flags each node was counted with, and how many of its children hold a device block at or below them).
  std::vector<std::uint32_t> held_children(s.nodes.size(), 0);
  for (NodeId id = 1; id < s.nodes.size(); ++id) {
    const Node& n = s.nodes[id];
    const std::uint8_t rc = Impl::reclaim_flags(n, s.eventual_tier(n));
    if (n.rc != rc)
      return Internal(fmt::format("node {} was last counted with reclaim flags {}, its state gives {}", id, n.rc, rc));
    if (n.live && !n.detached && n.parent != Impl::kRoot && holds(n)) ++held_children[n.parent];
  }
  if (s.host_drop.size() != s.nodes.size())
    return Internal(fmt::format("{} host drop flags for {} nodes", s.host_drop.size(), s.nodes.size()));
  for (const auto& told : s.told_blocked)
    if (told.size() != s.nodes.size())
      return Internal(fmt::format("{} blocked flags for {} nodes", told.size(), s.nodes.size()));
  for (NodeId id = 1; id < s.nodes.size(); ++id)
    if ((s.host_drop[id] != 0) != s.host_droppable(id))
      return Internal(fmt::format("node {}: host drop flag {}, its state gives {}", id, s.host_drop[id] != 0,
                                  s.host_droppable(id)));
  for (NodeId id = 1; id < s.nodes.size(); ++id)
    if (s.nodes[id].held_below != held_children[id])
      return Internal(fmt::format("node {} counts {} children holding a device block, {} do", id,
                                  s.nodes[id].held_below, held_children[id]));
  if (const std::uint32_t full = s.recount_reclaimable_device_blocks(); full != s.reclaimable_now)
    return Internal(
        fmt::format("{} device blocks counted reclaimable, a full recount finds {}", s.reclaimable_now, full));
  if (live_attached != s.map.size())
    return Internal(fmt::format("index has {} keys but {} attached nodes", s.map.size(), live_attached));
  for (int t = 0; t < kNumTiers; ++t) {
    if (parked[t] != s.parked[t].size())
      return Internal(fmt::format("{} tier parks {} copies, {} nodes are protected residents there", tier_name(Tier(t)),
                                  s.parked[t].size(), parked[t]));
    if (lookahead_moves[t] != s.lookahead_in_flight[t])
      return Internal(fmt::format("{} tier counts {} look-ahead moves in flight, {} nodes are marked",
                                  tier_name(Tier(t)), s.lookahead_in_flight[t], lookahead_moves[t]));
  }
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
