// Private to the cache manager's sources (cache/cache_manager*.cc): the state
// behind a CacheManager (struct CacheManager::Impl) and the node of its
// prefix tree. A node is one block: its copies per tier, its in-flight state,
// pins and hits, and per child tier a count of its children. Impl owns the
// nodes, the key index, the pools and eviction policies of every tier, the
// open admissions and the plan being built, and keeps the tree's bookkeeping
// consistent (retier, detach_subtree, ...). Its eviction and placement
// members are defined in cache_manager_eviction.cc, its look-ahead members
// (announcements, protection, prefetch) in cache_manager_lookahead.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache/key_index.h"
#include "cache/large_table.h"
#include "cache/use_history.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/metrics/kv_events.h"

namespace kvtier::cache {

inline constexpr int kDev = 0, kHst = 1, kSto = 2, kNoTier = 3;
constexpr std::uint8_t bit(int t) { return static_cast<std::uint8_t>(1u << t); }

enum class NodeState : std::uint8_t {
  kSettled,
  kLoading,    // host -> device; device block is the target
  kEvicting,   // device -> host; the device block was given up, host block is the target
  kBackingUp,  // device -> host; device copy stays servable
  kFetching,   // storage -> host
  kStoring,    // host -> storage; host copy stays servable
  kDemoting,   // host -> storage; host block held (read) until the ack, then freed
};

inline bool servable(NodeState s) {
  return s == NodeState::kSettled || s == NodeState::kBackingUp || s == NodeState::kStoring;
}

struct Node {
  BlockKey key;
  NodeId parent = kNoNode;
  NodeId first_child = kNoNode, next_sib = kNoNode, prev_sib = kNoNode;
  std::array<BlockId, kNumTiers> block{kNoBlock, kNoBlock, kNoBlock};
  std::uint8_t present = 0;  // settled copies
  NodeState state = NodeState::kSettled;
  bool live = false;
  bool detached = false;
  // A storage write of this host copy failed: under pressure it is dropped rather than written again.
  bool write_failed = false;
  // A load from this host copy failed and the copy was kept (its bytes may be fine: the copy failed, or they
  // may be what failed); a second failure drops it, so bad bytes cost one more failed load, not one per request.
  bool load_failed = false;
  std::uint8_t counted_tier = kNoTier;  // the tier this node counts as in its parent's child_tier
  std::uint8_t announced = 0;           // tiers a BlockStored event was emitted for and not yet removed
  // A look-ahead prefetch (take_plan()) is moving this block to the tier it is in flight to.
  bool lookahead_move = false;
  // A look-ahead load below one that failed: its device copy is given up when it acks, whatever the outcome (a
  // device block under a host-only parent would break the tier order); until then it counts as its host copy.
  bool retreat_on_ack = false;
  // Its move is queued in the plan and take_plan() has not handed it out yet: an ack of it is refused (the engine
  // cannot have copied a block it was never told to move, and landing it would serve garbage).
  bool untaken = false;
  std::uint32_t refs = 0;
  std::uint32_t hits = 0;
  std::uint32_t depth = 0;
  std::array<std::uint32_t, 4> child_tier{};
  // Incremental count of reclaimable device blocks (Impl::reclaimable_now): the flags this node was last
  // counted with (kRcFree, kRcHeld) and how many of its children hold a device block below or at them. Kept
  // per node so that a change updates the count by walking up only while an ancestor's standing changes.
  std::uint32_t held_below = 0;
  std::uint8_t rc = 0;
  // (Look-ahead protection lives beside the nodes, in Impl::want: a node stays this size, and the O(nodes)
  // walks stay as fast, whether or not anything is announced.)
};

// Node::rc: kRcFree, a settled, unpinned device copy (reclaimable unless a held block sits below it); kRcHeld,
// a pinned or in-flight block on (or bound for) the device, which keeps itself and every device block above it.
inline constexpr std::uint8_t kRcFree = 1, kRcHeld = 2;
// A held block at or below n: n's device copy, and its ancestors', cannot be reclaimed.
inline bool holds(const Node& n) { return (n.rc & kRcHeld) || n.held_below > 0; }
// n counts in Impl::reclaimable_now.
inline bool counts_reclaimable(const Node& n) { return (n.rc & kRcFree) && n.held_below == 0; }

inline int lowest_tier(std::uint8_t mask) {
  for (int t = 0; t < kNumTiers; ++t)
    if (mask & bit(t)) return t;
  return kNoTier;
}

struct AdmissionRec {
  std::vector<BlockKey> keys;
  std::vector<NodeId> pos_node;  // node of each key position (kNoNode if none yet)
  std::vector<BlockId> blocks;   // device block per position (keys, then extra)
  std::vector<std::uint8_t> owned;
  std::vector<NodeId> pinned;
  std::uint32_t hit_blocks = 0;  // device + host hits
  std::uint32_t committed = 0;   // key positions committed (starts at hit_blocks)
  bool chain_broken = false;
  // P/D receive (admit_receive): positions [recv_begin, recv_end) are written by a peer. kReceiving: all of
  // them, until complete_receive; kQuarantined: [recv_begin + recv_loaded, recv_end) failed and may still be
  // written. Receive positions that are not indexed stay owned; release() hands the guarded ones to
  // Impl::quarantine instead of the pool.
  enum class Recv : std::uint8_t { kNone, kReceiving, kQuarantined, kDone };
  Recv recv = Recv::kNone;
  std::uint32_t recv_begin = 0, recv_end = 0, recv_loaded = 0;
  // Positions no byte may be written to by anyone but the peer (and never freed): [guard_begin(), recv_end).
  std::uint32_t guard_begin() const {
    if (recv == Recv::kReceiving) return recv_begin;
    if (recv == Recv::kQuarantined) return recv_begin + recv_loaded;
    return recv_end;
  }
};

struct CacheManager::Impl {
  CacheConfig cfg;
  std::array<BlockPool, kNumTiers> pools;
  std::array<std::unique_ptr<EvictionPolicy>, kNumTiers> policy;
  std::array<std::vector<NodeId>, kNumTiers> owner;
  LargeTable<Node> nodes;
  std::vector<NodeId> free_nodes;
  KeyIndex map;
  std::unordered_map<AdmissionId, AdmissionRec> admissions;
  // Device blocks of released admissions that a peer may still write, by admission (ack_receive_reclaimable).
  std::unordered_map<AdmissionId, std::vector<BlockId>> quarantine;
  std::uint32_t receiving_now = 0, quarantined_now = 0;  // device blocks (CacheStats gauges)
  AdmissionId next_admission = 1;
  std::uint64_t clock = 0;
  StepPlan plan;
  // Queues a move of node `n` into one of plan's lists: acknowledgeable once take_plan() has handed it out
  // (Node::untaken).
  static void queue_move(std::vector<BlockMove>& moves, BlockMove m, Node& n) {
    moves.push_back(m);
    n.untaken = true;
  }
  CacheStats st;

  // ---- look-ahead (cache_manager_lookahead.cc) --------------------------------
  // Rank of an announcement: higher priority first, then the earlier announced (smaller id).
  struct Rank {
    std::int32_t priority = 0;
    std::uint64_t seq = 0;
    bool better_than(const Rank& o) const { return priority != o.priority ? priority > o.priority : seq < o.seq; }
    friend bool operator==(const Rank&, const Rank&) = default;
  };
  struct Announcement {
    std::vector<BlockKey> keys;
    RequestHints hints;
    bool queued = true;            // false: withdrawn, chain retained until expires_at
    std::uint64_t expires_at = 0;  // step of the retention's end
    // Prefetch cursor: keys[0, cursor) were on (or loading to) the device when last walked, keys[cursor - 1]
    // being node cursor_node; valid while cursor_epoch == Impl::epoch (a protected copy that leaves a tier
    // or a detached subtree bumps the epoch, as either can undo what the cursor skips).
    std::uint32_t cursor = 0;
    NodeId cursor_node = 0;
    std::uint64_t cursor_epoch = 0;
    Rank rank(QueuedId id) const { return Rank{hints.priority, id}; }
  };
  // Per announced key: how many active announcements (queued or retained) hold it, and the best rank among
  // those that held it since the count was last 0 (kept, not recomputed, when the best one leaves: O(1) per
  // key, and a rank only orders the last-resort eviction of protected blocks).
  struct KeyWant {
    std::uint32_t count = 0;  // 0 only in a free slot of wanted_keys
    Rank rank;
  };
  struct KeyWantSlot {
    static constexpr KeyWant free_value() { return KeyWant{}; }
    static constexpr bool is_free(const KeyWant& w) { return w.count == 0; }
  };
  std::unordered_map<QueuedId, Announcement> announcements;  // node-based: queue_order points into it
  // Queued announcements in prefetch order, (-priority, id), each with its entry in `announcements`.
  using QueueKey = std::tuple<std::int64_t, QueuedId>;  // (-priority, id): highest priority, then oldest, first
  std::map<QueueKey, Announcement*> queue_order;
  std::optional<QueueKey> lookahead_resume;       // where the last look-ahead walk stopped on its key limit
  std::multimap<std::uint64_t, QueuedId> expiry;  // retained: (expires_at, id)
  std::unordered_map<std::uint64_t, std::vector<QueuedId>> retained_by_conversation;
  OpenKeyTable<KeyWant, KeyWantSlot> wanted_keys;  // keys held by at least one announcement
  // Protected resident copies per tier, least important first: (priority, -seq, -depth, node).
  using ParkKey = std::tuple<std::int32_t, std::int64_t, std::int64_t, NodeId>;
  std::array<std::set<ParkKey>, kNumTiers> parked;
  // Per node: announcements whose chain holds its key (wanted_keys[key].count while indexed; 0 once detached
  // or removed) and the rank kept for that key. While count > 0 the node's resident copies are protected: in
  // parked, not in their tier's policy. Sized on the first announcement that reaches an indexed node: shorter
  // than nodes means 0 for the rest.
  struct NodeWant {
    std::uint32_t count = 0;
    std::int32_t priority = 0;
    std::uint64_t seq = 0;
  };
  std::vector<NodeWant> want;
  // A node replaced by its lower copies while its load was in flight (keep_lower_copies_of_failed_load) -> the
  // node that took its host copy, pinned until that load acks: the load still reads the host block, which must
  // not be dropped and reused meanwhile (not every executor orders a write after the reads before it).
  std::unordered_map<NodeId, NodeId> reading_replacement;
  std::array<std::uint32_t, kNumTiers> lookahead_in_flight{};  // look-ahead moves in flight, by target tier
  std::uint64_t step = 0;                                      // take_plan() calls (retention clock)
  std::uint64_t epoch = 1;  // prefetch cursors older than this are walked again from the chain's start
  QueuedId next_queued = 1;
  // Set while take_plan() evicts on its own account (watermarks, prefetch): victims never include protected
  // copies then.
  bool shield_protected = false;
  // Set while the look-ahead prefetch makes room (a bet on a queued request, not a block wanted now): room comes
  // only from copies that exist on another tier or a free block; no last copy is dropped and no demotion started.
  bool speculative = false;

  std::uint32_t wanted(NodeId id) const { return id < want.size() ? want[id].count : 0; }
  NodeWant& want_of(NodeId id) {
    if (id >= want.size()) want.resize(std::max(nodes.size(), std::size_t{id} + 1));
    return want[id];
  }
  ParkKey park_key(NodeId id) const {
    const NodeWant& w = want[id];  // only for protected nodes: in range
    return ParkKey{w.priority, -static_cast<std::int64_t>(w.seq), -static_cast<std::int64_t>(nodes[id].depth), id};
  }
  bool resident_in(const Node& n, int t) const { return n.live && !n.detached && (n.present & bit(t)); }
  // A copy of `id` became resident in tier t (or, with accessed false, its protection ended): its policy tracks it,
  // unless it is protected.
  void track_insert(NodeId id, int t, bool accessed = true) {
    if (wanted(id)) {
      parked[t].insert(park_key(id));
      return;
    }
    AccessInfo i = info(id);
    i.accessed = accessed;
    policy[t]->insert(id, i);
    told_blocked[t][id] = blocked_in(nodes[id], t);  // the policy takes it unblocked
    if (told_blocked[t][id]) policy[t]->set_blocked(id, true);
  }
  // The resident copy in tier t was hit: protected copies are outside the policy until protection ends.
  void track_touch(NodeId id, int t) {
    if (!wanted(id)) policy[t]->touch(id, info(id));
  }
  // The copy in tier t stops being resident (evicted, dropped, demoted, invalidated).
  void untrack(NodeId id, int t) {
    if (wanted(id)) {
      if (parked[t].erase(park_key(id)) && !nodes[id].detached) {
        ++st.protected_evictions;
        ++epoch;
      }
    } else {
      policy[t]->erase(id);
    }
  }
  // Sets a node's announcement count and rank, moving its resident copies between policy and parked.
  void set_wanted(NodeId id, std::uint32_t count, Rank rank);
  // Protection of a node that joined the index: from wanted_keys.
  void init_wanted(NodeId id) {
    if (wanted_keys.empty()) return;
    const KeyWant* w = wanted_keys.find(nodes[id].key);
    if (w == nullptr) return;
    want_of(id) = NodeWant{w->count, w->rank.priority, w->rank.seq};
  }
  // Adds (+1) or removes (-1) one announcement's hold on `key`.
  void hold_key(const BlockKey& key, Rank rank);
  void unhold_key(const BlockKey& key);
  // Ends an announcement's protection and forgets it.
  void drop_announcement(QueuedId id);
  void expire_retentions();
  // take_plan()'s prefetch of queued announcements' blocks, within the budget.
  void lookahead_prefetch();
  bool lookahead_load(NodeId id);   // host -> device; false when no device block can be had
  bool lookahead_fetch(NodeId id);  // storage -> host; false when no host block can be had
  // The policy's victim in tier t among `pred`; failing that, unless shield_protected, the least important
  // protected copy among `pred` (a last resort: protection never refuses room).
  NodeId victim(int t, FunctionRef<bool(NodeId)> pred, bool allow_protected = true);
  NodeId protected_victim(int t, FunctionRef<bool(NodeId)> pred) const {
    for (const ParkKey& k : parked[t])
      if (pred(std::get<3>(k))) return std::get<3>(k);
    return kNoNode;
  }
  // Keys form a hash chain continuing after node `prev` (kRoot: a request's start) at position `first_pos`;
  // `what` names the caller in the message.
  Status check_chain(std::span<const BlockKey> keys, std::string_view what, NodeId prev = kRoot,
                     std::size_t first_pos = 0) const;
  std::deque<BlockId> host_run;  // pre-allocated contiguous host blocks for an eviction batch
  std::uint32_t pending_demotions = 0;
  bool refused_for_host_room = false;        // the last admit_in() refused: its device victims wait for host blocks
  std::uint64_t failed_writes_in_a_row = 0;  // storage writes failed since the last one that succeeded
  std::unique_ptr<UseHistory> history;
  // KV events (enable_kv_events()): emitted by announce() wherever a settled copy joins or leaves the index.
  bool events_on = false;
  std::uint32_t event_block_size = 0;
  metrics::Medium storage_medium = metrics::Medium::kDisk;
  std::vector<metrics::KvEvent> events;

  static constexpr NodeId kRoot = 0;

  bool has_tier(int t) const { return pools[t].capacity() > 0; }

  // ---- KV events (cache_manager_events.cc) ------------------------------------
  // Emits the difference between what was announced for n and its indexed settled copies now.
  void announce(NodeId id) {
    if (events_on) announce_slow(id);
  }
  void announce_slow(NodeId id);

  // ---- node bookkeeping ----------------------------------------------------
  int eventual_tier(const Node& n) const {
    switch (n.state) {
      case NodeState::kLoading: return n.retreat_on_ack ? lowest_tier(n.present) : kDev;
      case NodeState::kEvicting: return kHst;
      case NodeState::kFetching: return kHst;
      case NodeState::kDemoting: return kSto;
      case NodeState::kSettled:
      case NodeState::kBackingUp:
      case NodeState::kStoring: return lowest_tier(n.present);
    }
    return kNoTier;
  }

  void retier(NodeId id) {
    sync_reclaim(id);
    Node& n = nodes[id];
    if (n.detached || n.parent == kNoNode) return;
    int t = eventual_tier(n);
    if (t == n.counted_tier) return;
    Node& p = nodes[n.parent];
    --p.child_tier[n.counted_tier];
    ++p.child_tier[t];
    n.counted_tier = static_cast<std::uint8_t>(t);
    sync_host_drop(n.parent);
  }

  // ---- reclaimable device blocks (incremental) ------------------------------
  // reclaimable_now counts the nodes whose device copy evictions could free now: settled, unpinned device
  // copies with no pinned or in-flight block on (or bound for) the device at or below them. Every change of a
  // node's refs, state, copies or attachment is followed by sync_reclaim(id) before the count is read;
  // check_invariants() compares it, and every node's flags, with a full recount.
  std::uint32_t reclaimable_now = 0;
  static std::uint8_t reclaim_flags(const Node& n, int eventual) {
    if (!n.live || n.detached) return 0;
    const bool idle = n.state == NodeState::kSettled && n.refs == 0;
    if (idle) return (n.present & bit(kDev)) ? kRcFree : 0;
    return ((n.present & bit(kDev)) || eventual == kDev) ? kRcHeld : 0;
  }
  void sync_reclaim(NodeId id) {
    if (id == kRoot) return;  // the root is never evicted and blocks nothing
    sync_host_drop(id);
    Node& n = nodes[id];
    const std::uint8_t rc = reclaim_flags(n, eventual_tier(n));
    if (rc == n.rc) return;
    const bool held_before = holds(n), counted_before = counts_reclaimable(n);
    n.rc = rc;
    reclaimable_now = reclaimable_now - counted_before + counts_reclaimable(n);
    if (holds(n) != held_before) add_held_below(n.parent, holds(n));
  }
  // One child of `id` started (up) or stopped holding: up the path while an ancestor's standing changes.
  void add_held_below(NodeId id, bool up) {
    while (id != kNoNode && id != kRoot) {
      Node& p = nodes[id];
      const bool held_before = holds(p), counted_before = counts_reclaimable(p);
      p.held_below = up ? p.held_below + 1 : p.held_below - 1;
      reclaimable_now = reclaimable_now - counted_before + counts_reclaimable(p);
      if (holds(p) == held_before) return;
      id = p.parent;
    }
  }
  // host_drop[id] == host_droppable(id), kept beside the nodes: the host policy's victim scan reads one byte per
  // candidate instead of a node (it passes over host-only parents whose children are still on host, at times
  // many per call). Updated with the reclaim flags, and for a parent whose children change.
  std::vector<std::uint8_t> host_drop;
  void sync_host_drop(NodeId id) {
    if (id == kRoot || id == kNoNode) return;
    host_drop[id] = host_droppable(id);
    sync_blocked(id);
  }

  // ---- blocked copies ------------------------------------------------------
  // A copy that no victim predicate of its tier accepts while the tree around it stays as it is, whatever its pins
  // and moves: a device copy with children on (or bound for) the device (only leaves go); a host copy that can be
  // neither dropped (its children need it) nor demoted; a storage copy that cannot be dropped. Each tier's policy is
  // told when a copy it tracks starts or stops being one (EvictionPolicy::set_blocked), so its victim walks leave
  // such copies out instead of passing every shared prefix on every eviction. Kept where host_drop is (the same
  // changes of a node's copies, state and children), and when a copy enters a policy (track_insert).
  bool blocked_in(const Node& n, int t) const {
    if (t == kDev) return n.child_tier[kDev] > 0;
    if (t == kHst) return !can_drop(n, kHst) && !host_demotable(n);
    return !can_drop(n, kSto);
  }
  // told_blocked[t][id]: what tier t's policy was last told of id; current while the policy tracks id.
  std::array<std::vector<std::uint8_t>, kNumTiers> told_blocked;
  void sync_blocked(NodeId id) {
    const Node& n = nodes[id];
    for (int t = 0; t < kNumTiers; ++t) {
      if (!(n.present & bit(t))) continue;  // not tracked: track_insert tells the policy when it is
      const bool blocked = blocked_in(n, t);
      if (blocked == (told_blocked[t][id] != 0)) continue;
      told_blocked[t][id] = blocked;
      policy[t]->set_blocked(id, blocked);
    }
  }
  // A pin taken or dropped by an admission.
  void pin(NodeId id) {
    ++nodes[id].refs;
    sync_reclaim(id);
  }
  void unpin(NodeId id) {
    --nodes[id].refs;
    sync_reclaim(id);
  }

  std::uint32_t num_children(const Node& n) const {
    return n.child_tier[0] + n.child_tier[1] + n.child_tier[2] + n.child_tier[3];
  }

  // May the copy in tier t go without breaking the order below n?
  bool can_drop(const Node& n, int t) const {
    int nt = lowest_tier(static_cast<std::uint8_t>(n.present & ~bit(t)));
    if (nt == kNoTier) return num_children(n) == 0;
    for (int c = 0; c < nt; ++c)
      if (n.child_tier[c]) return false;
    return true;
  }

  AccessInfo info(NodeId id) const {
    const Node& n = nodes[id];
    return AccessInfo{clock, &n.key, n.depth, n.hits};
  }

  NodeId new_node(const BlockKey& key, NodeId parent) {
    NodeId id;
    if (!free_nodes.empty()) {
      id = free_nodes.back();
      free_nodes.pop_back();
      nodes[id] = Node{};
      host_drop[id] = 0;
      for (auto& told : told_blocked) told[id] = 0;
    } else {
      id = static_cast<NodeId>(nodes.size());
      nodes.emplace_back();
      host_drop.push_back(0);
      for (auto& told : told_blocked) told.push_back(0);
    }
    Node& n = nodes[id];
    n.key = key;
    n.live = true;
    n.parent = parent;
    Node& p = nodes[parent];
    n.depth = p.depth + 1;
    n.next_sib = p.first_child;
    if (p.first_child != kNoNode) nodes[p.first_child].prev_sib = id;
    p.first_child = id;
    n.counted_tier = kNoTier;
    ++p.child_tier[kNoTier];
    sync_host_drop(parent);
    map.insert(key, id);
    init_wanted(id);
    return id;
  }

  void unlink_from_parent(NodeId id) {
    Node& n = nodes[id];
    if (n.parent == kNoNode) return;
    if (holds(n)) add_held_below(n.parent, false);
    Node& p = nodes[n.parent];
    --p.child_tier[n.counted_tier];
    if (n.prev_sib != kNoNode)
      nodes[n.prev_sib].next_sib = n.next_sib;
    else
      p.first_child = n.next_sib;
    if (n.next_sib != kNoNode) nodes[n.next_sib].prev_sib = n.prev_sib;
    sync_host_drop(n.parent);
    n.parent = n.prev_sib = n.next_sib = kNoNode;
  }

  // Links a node without a parent (taken from another by unlink_from_parent) under `parent`; its depth stays.
  void link_to_parent(NodeId id, NodeId parent) {
    Node& n = nodes[id];
    Node& p = nodes[parent];
    n.parent = parent;
    n.prev_sib = kNoNode;
    n.next_sib = p.first_child;
    if (p.first_child != kNoNode) nodes[p.first_child].prev_sib = id;
    p.first_child = id;
    ++p.child_tier[n.counted_tier];
    if (holds(n)) add_held_below(parent, true);
    sync_host_drop(parent);
  }

  void set_block(NodeId id, int t, BlockId b) {
    nodes[id].block[t] = b;
    owner[t][b] = id;
  }
  void free_block(int t, BlockId b) {
    // A storage slot given up, whatever the reason (room, an invalidation, a failed write or prefetch): the
    // executor may delete its object, so the backend holds no more objects than the tier has slots. Not where
    // another node indexes the key now with a storage slot of its own (this one was invalidated and the key computed
    // and stored again): that copy, or its write, is the same object. A node of the key without one writes it, if
    // ever, in a later plan, after the delete.
    if (t == kSto && owner[t][b] != kNoNode) {
      const NodeId holder = owner[t][b];
      const NodeId current = map.find(nodes[holder].key);
      if (current == kNoNode || current == holder || nodes[current].block[kSto] == kNoBlock)
        plan.storage_drops.push_back(BlockMove{b, kNoBlock, nodes[holder].key});
    }
    owner[t][b] = kNoNode;
    pools[t].free(b).ignore_error();  // ids come from our own bookkeeping
  }
  void release_copy(NodeId id, int t) {
    Node& n = nodes[id];
    if (t == kHst) n.write_failed = n.load_failed = false;
    if (n.block[t] != kNoBlock) free_block(t, n.block[t]);
    n.block[t] = kNoBlock;
    const bool was_resident = resident_in(n, t);
    n.present = static_cast<std::uint8_t>(n.present & ~bit(t));
    if (was_resident) untrack(id, t);
    sync_reclaim(id);
    announce(id);
  }

  // Removes a childless, unreferenced, settled node with no copies left.
  void remove_node(NodeId id) {
    Node& n = nodes[id];
    for (int t = 0; t < kNumTiers; ++t)
      if (n.block[t] != kNoBlock) release_copy(id, t);
    if (!n.detached) {
      map.erase(n.key);
      unlink_from_parent(id);
    }
    if (id < want.size()) want[id] = NodeWant{};
    n.live = false;
    sync_reclaim(id);
    free_nodes.push_back(id);
  }

  void reclaim_if_dead(NodeId id) {
    Node& n = nodes[id];
    if (n.live && n.detached && n.refs == 0 && n.state == NodeState::kSettled) remove_node(id);
  }

  // Invalidates n and its subtree: out of the index at once; blocks freed when unpinned and settled.
  void detach_subtree(NodeId id) {
    std::vector<NodeId> stack{id};
    std::vector<NodeId> all;
    while (!stack.empty()) {
      NodeId x = stack.back();
      stack.pop_back();
      all.push_back(x);
      for (NodeId c = nodes[x].first_child; c != kNoNode; c = nodes[c].next_sib) stack.push_back(c);
    }
    for (NodeId x : all) {
      Node& n = nodes[x];
      map.erase(n.key);
      const bool prot = wanted(x) > 0;
      for (int t = 0; t < kNumTiers; ++t) {
        if (prot)
          parked[t].erase(park_key(x));
        else
          policy[t]->erase(x);
      }
      if (prot) {
        ++epoch;
        want[x] = NodeWant{};  // out of the index: wanted_keys still counts the key for a node that joins later
      }
      ++st.invalidated_blocks;
    }
    // Unlink deepest first so every parent's counts stay consistent (a node's children have taken their held
    // blocks off its held_below before it leaves its parent).
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      unlink_from_parent(*it);
      nodes[*it].detached = true;
      nodes[*it].first_child = kNoNode;
      sync_reclaim(*it);
    }
    for (NodeId x : all) announce(x);
    for (NodeId x : all) reclaim_if_dead(x);
  }

  // ---- eviction (cache_manager_eviction.cc) ---------------------------------
  bool device_evictable(NodeId id) const;
  bool host_droppable(NodeId id) const;
  bool storage_droppable(NodeId id) const;
  void drop_copy(NodeId id, int t);
  bool write_back_to_storage() const;
  void drop_host_copy(NodeId id);
  bool drop_one_host();
  bool host_candidate(NodeId id) const;
  bool host_demotable(const Node& n) const;
  bool start_demotion(NodeId v);
  // How far down the host policy's order a clean victim is preferred to the first dirty one.
  static constexpr std::uint32_t kCleanVictimWindow = 64;

  enum class Room : std::uint8_t { kFree, kPending, kNone };
  Room make_host_room();
  Result<BlockId> take_host_block();
  bool drop_one_storage();
  void evict_to_host(NodeId v, BlockId hb);
  bool evict_one_device();
  bool ensure_device_free(std::uint32_t need);
  // reclaimable_now recounted from scratch, O(nodes), by the policy-independent definition: settled, unpinned
  // device copies with no pinned or in-flight device block at or below them (check_invariants() only).
  std::uint32_t recount_reclaimable_device_blocks() const;
  // blocked[id] = 1 for every node at or above a pinned or in-flight node on (or bound for) the device.
  void mark_blocked_device(std::vector<std::uint8_t>& blocked) const;
  bool evict_one_host_background();
  void store_through(NodeId id);
  void backup(NodeId id);

  // ---- match ---------------------------------------------------------------
  // Nodes of the servable prefix, with their tiers.
  MatchResult match_nodes(std::span<const BlockKey> keys, std::vector<NodeId>* out) const {
    MatchResult r;
    int phase = kDev;
    NodeId parent = kRoot;
    for (const BlockKey& k : keys) {
      NodeId found = map.find(k);
      if (found == kNoNode) break;
      const Node& n = nodes[found];
      if (n.parent != parent) break;  // not the chain below the previous key (admit() rejects such keys)
      parent = found;
      int t = lowest_tier(n.present);
      // A host-only block being written to storage is servable in place, but a load would have
      // to change its state under the write: treat it as in flight.
      if (!servable(n.state) || (n.state == NodeState::kStoring && t == kHst)) {
        r.stopped_at_in_flight = true;
        break;
      }
      if (t == kNoTier || t < phase) break;  // t < phase cannot happen while the invariants hold
      phase = t;
      if (t == kDev) {
        ++r.device_blocks;
        r.device_ids.push_back(n.block[kDev]);
      } else if (t == kHst) {
        ++r.host_blocks;
        r.host_ids.push_back(n.block[kHst]);
      } else {
        ++r.storage_blocks;
        r.storage_ids.push_back(n.block[kSto]);
      }
      if (out) out->push_back(found);
    }
    return r;
  }
};

// The registry series of an attached manager (cache_manager_metrics.cc); `seen` is the last export.
struct CacheManager::MetricSeries {
  using Delta = metrics::CounterDelta;
  Delta lookups, misses, admissions, refusals, lost_host_drops, failed, invalidated, resets;
  Delta hits[kNumTiers];
  Delta moved_device, dropped[kNumTiers];
  Delta loads, evictions, backups, storage_writes, storage_prefetches, pressure_demotions;
  Delta received, received_loaded, received_committed, quarantined;
  // Gauges as this manager's shares (metrics::GaugeShare): managers attached with the same labels add up.
  using Share = metrics::GaugeShare;
  Share receiving_now, quarantined_now, index_blocks;
  Share used[kNumTiers], capacity[kNumTiers], resident[kNumTiers];
  // Per tier: lead changes of its policy, and one 0/1 share per expert (policy_experts) saying which leads.
  Delta policy_switches[kNumTiers];
  std::vector<Share> policy_lead[kNumTiers];

  MetricSeries() = default;
  MetricSeries(const MetricSeries&) = delete;
  MetricSeries& operator=(const MetricSeries&) = delete;
  // The manager's shares leave the gauges with it (the registry outlives the manager).
  ~MetricSeries() {
    for (Share* s : {&receiving_now, &quarantined_now, &index_blocks}) s->release();
    for (int t = 0; t < kNumTiers; ++t) {
      used[t].release();
      capacity[t].release();
      resident[t].release();
      for (Share& s : policy_lead[t]) s.release();
    }
  }
};

// Ends a public CacheManager call: exports the counters when metrics are attached.
struct ExportOnReturn {
  explicit ExportOnReturn(CacheManager& m) : m_(m) {}
  ~ExportOnReturn() { m_.export_metrics(); }
  ExportOnReturn(const ExportOnReturn&) = delete;
  ExportOnReturn& operator=(const ExportOnReturn&) = delete;

 private:
  CacheManager& m_;
};

}  // namespace kvtier::cache
