#include "kvtier/cache/cache_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <unordered_map>

namespace kvtier::cache {

std::string_view tier_name(Tier tier) noexcept {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kStorage: return "storage";
  }
  return "?";
}

std::string_view write_policy_name(WritePolicy policy) noexcept {
  switch (policy) {
    case WritePolicy::kWriteThrough: return "write_through";
    case WritePolicy::kWriteThroughSelective: return "write_through_selective";
    case WritePolicy::kWriteBack: return "write_back";
  }
  return "?";
}

Result<WritePolicy> parse_write_policy(std::string_view name) {
  if (name == "write_through") return WritePolicy::kWriteThrough;
  if (name == "write_through_selective") return WritePolicy::kWriteThroughSelective;
  if (name == "write_back") return WritePolicy::kWriteBack;
  return InvalidArgument(
      fmt::format("unknown write policy '{}' (known: write_through, write_through_selective, write_back)", name));
}

namespace {

constexpr int kDev = 0, kHst = 1, kSto = 2, kNoTier = 3;
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

bool servable(NodeState s) {
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
  std::uint8_t counted_tier = kNoTier;  // the tier this node counts as in its parent's child_tier
  std::uint32_t refs = 0;
  std::uint32_t hits = 0;
  std::uint32_t depth = 0;
  std::array<std::uint32_t, 4> child_tier{};
};

int lowest_tier(std::uint8_t mask) {
  for (int t = 0; t < kNumTiers; ++t)
    if (mask & bit(t)) return t;
  return kNoTier;
}

// Open-addressing (linear probing, backward-shift deletion) map BlockKey -> NodeId. Keys are
// uniform hashes, so their low bits index directly; one cache line per lookup in the common case.
class KeyIndex {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (cap > slots_.size()) rehash(cap);
  }
  NodeId find(const BlockKey& k) const {
    if (slots_.empty()) return kNoNode;
    for (std::size_t i = home(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id == kNoNode) return kNoNode;
      if (s.key == k) return s.id;
    }
  }
  void insert(const BlockKey& k, NodeId id) {
    if (2 * (size_ + 1) > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    std::size_t i = home(k);
    while (slots_[i].id != kNoNode) i = (i + 1) & mask_;
    slots_[i] = Slot{k, id};
    ++size_;
  }
  void erase(const BlockKey& k) {
    if (slots_.empty()) return;
    std::size_t i = home(k);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].id == kNoNode) return;
      if (slots_[i].key == k) break;
    }
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].id == kNoNode) break;
      std::size_t h = home(slots_[j].key);
      bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = Slot{};
    --size_;
  }
  std::size_t size() const { return size_; }

 private:
  struct Slot {
    BlockKey key;
    NodeId id = kNoNode;
  };
  std::size_t home(const BlockKey& k) const { return static_cast<std::size_t>(k.lo ^ (k.hi >> 17)) & mask_; }
  void rehash(std::size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.id != kNoNode) insert(s.key, s.id);
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

// Access counts by key, kept after a block leaves the index: a block's second use is usually
// far beyond what the cache holds, so counts of resident blocks alone would rarely grow. A
// direct-mapped table of (24-bit tag, 8-bit saturating count); a colliding key takes the slot
// over. All counts are halved after 8 x size bumps so that old popularity fades.
class UseHistory {
 public:
  explicit UseHistory(std::size_t min_entries) {
    std::size_t n = std::size_t{1} << 20;
    while (n < min_entries && n < (std::size_t{1} << 24)) n <<= 1;
    slots_.assign(n, 0);
    mask_ = n - 1;
  }
  // Counts one use of `k`; returns the uses so far, including this one.
  std::uint32_t bump(const BlockKey& k) {
    std::uint32_t& slot = slots_[k.lo & mask_];
    std::uint32_t tag = static_cast<std::uint32_t>(k.hi >> 40) | 1u;  // 24 bits, never 0
    std::uint32_t c = (slot & 0xFFFFFFu) == tag ? slot >> 24 : 0;
    if (c < 255) ++c;
    slot = (c << 24) | tag;
    if (++ops_ >= 8 * slots_.size()) {
      ops_ = 0;
      for (auto& v : slots_) {
        std::uint32_t h = (v >> 24) >> 1;
        v = h ? (h << 24) | (v & 0xFFFFFFu) : 0;
      }
    }
    return c;
  }

 private:
  std::vector<std::uint32_t> slots_;
  std::size_t mask_ = 0;
  std::size_t ops_ = 0;
};

struct AdmissionRec {
  std::vector<BlockKey> keys;
  std::vector<NodeId> pos_node;  // node of each key position (kNoNode if none yet)
  std::vector<BlockId> blocks;   // device block per position (keys, then extra)
  std::vector<std::uint8_t> owned;
  std::vector<NodeId> pinned;
  std::uint32_t hit_blocks = 0;  // device + host hits
  std::uint32_t committed = 0;   // key positions committed (starts at hit_blocks)
  bool chain_broken = false;
};

}  // namespace

struct CacheManager::Impl {
  CacheConfig cfg;
  std::array<BlockPool, kNumTiers> pools;
  std::array<std::unique_ptr<EvictionPolicy>, kNumTiers> policy;
  std::array<std::vector<NodeId>, kNumTiers> owner;
  std::vector<Node> nodes;
  std::vector<NodeId> free_nodes;
  KeyIndex map;
  std::unordered_map<AdmissionId, AdmissionRec> admissions;
  AdmissionId next_admission = 1;
  std::uint64_t clock = 0;
  StepPlan plan;
  CacheStats st;
  std::deque<BlockId> host_run;  // pre-allocated contiguous host blocks for an eviction batch
  std::uint32_t pending_demotions = 0;
  std::uint64_t failed_writes_in_a_row = 0;  // storage writes failed since the last one that succeeded
  std::unique_ptr<UseHistory> history;

  static constexpr NodeId kRoot = 0;

  bool has_tier(int t) const { return pools[t].capacity() > 0; }

  // ---- node bookkeeping ----------------------------------------------------
  int eventual_tier(const Node& n) const {
    switch (n.state) {
      case NodeState::kLoading: return kDev;
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
    Node& n = nodes[id];
    if (n.detached || n.parent == kNoNode) return;
    int t = eventual_tier(n);
    if (t == n.counted_tier) return;
    Node& p = nodes[n.parent];
    --p.child_tier[n.counted_tier];
    ++p.child_tier[t];
    n.counted_tier = static_cast<std::uint8_t>(t);
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
    } else {
      id = static_cast<NodeId>(nodes.size());
      nodes.emplace_back();
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
    map.insert(key, id);
    return id;
  }

  void unlink_from_parent(NodeId id) {
    Node& n = nodes[id];
    if (n.parent == kNoNode) return;
    Node& p = nodes[n.parent];
    --p.child_tier[n.counted_tier];
    if (n.prev_sib != kNoNode)
      nodes[n.prev_sib].next_sib = n.next_sib;
    else
      p.first_child = n.next_sib;
    if (n.next_sib != kNoNode) nodes[n.next_sib].prev_sib = n.prev_sib;
    n.parent = n.prev_sib = n.next_sib = kNoNode;
  }

  void set_block(NodeId id, int t, BlockId b) {
    nodes[id].block[t] = b;
    owner[t][b] = id;
  }
  void free_block(int t, BlockId b) {
    owner[t][b] = kNoNode;
    pools[t].free(b).ignore_error();  // ids come from our own bookkeeping
  }
  void release_copy(NodeId id, int t) {
    Node& n = nodes[id];
    if (t == kHst) n.write_failed = false;
    if (n.block[t] != kNoBlock) free_block(t, n.block[t]);
    n.block[t] = kNoBlock;
    n.present = static_cast<std::uint8_t>(n.present & ~bit(t));
    policy[t]->erase(id);
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
    n.live = false;
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
      for (int t = 0; t < kNumTiers; ++t) policy[t]->erase(x);
      ++st.invalidated_blocks;
    }
    // Unlink deepest first so every parent's counts stay consistent.
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      unlink_from_parent(*it);
      nodes[*it].detached = true;
      nodes[*it].first_child = kNoNode;
    }
    for (NodeId x : all) reclaim_if_dead(x);
  }

  // ---- eviction ------------------------------------------------------------
  bool device_evictable(NodeId id) const {
    const Node& n = nodes[id];
    return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kDev)) && n.refs == 0 &&
           n.child_tier[kDev] == 0;
  }

  bool host_droppable(NodeId id) const {
    const Node& n = nodes[id];
    return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kHst)) && n.refs == 0 &&
           can_drop(n, kHst);
  }

  bool storage_droppable(NodeId id) const {
    const Node& n = nodes[id];
    return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kSto)) && n.refs == 0 &&
           can_drop(n, kSto);
  }

  void drop_copy(NodeId id, int t) {
    release_copy(id, t);
    Node& n = nodes[id];
    if (n.present == 0 && n.state == NodeState::kSettled)
      remove_node(id);
    else
      retier(id);
  }

  // Write-back with a storage tier: a host copy that is a block's last copy ("dirty") is written to
  // storage before its host block is given up, whatever takes it (watermarks or pressure).
  bool write_back_to_storage() const {
    return has_tier(kSto) && has_tier(kHst) && cfg.write_policy == WritePolicy::kWriteBack;
  }

  void drop_host_copy(NodeId id) {
    if (nodes[id].present == bit(kHst)) ++st.lost_host_drops;
    drop_copy(id, kHst);
    ++st.drops_host;
  }

  // Frees one host block now by dropping a host copy (never waits on a demotion).
  bool drop_one_host() {
    if (!has_tier(kHst)) return false;
    NodeId v = policy[kHst]->victim([this](NodeId n) { return host_droppable(n); });
    if (v == kNoNode) return false;
    drop_host_copy(v);
    return true;
  }

  // Settled, unpinned host copy the host policy may consider at all.
  bool host_candidate(NodeId id) const {
    const Node& n = nodes[id];
    return n.live && !n.detached && n.state == NodeState::kSettled && (n.present & bit(kHst)) && n.refs == 0;
  }

  // A host-only block whose children all sit in storage (or are absent): it may move down.
  bool host_demotable(const Node& n) const {
    return has_tier(kSto) && n.present == bit(kHst) && n.child_tier[kHst] == 0 && n.child_tier[kDev] == 0;
  }

  // Queues host -> storage for v; its host block stays held (read by the write) until the ack.
  bool start_demotion(NodeId v) {
    if (pools[kSto].num_free() == 0 && !drop_one_storage()) return false;
    auto slot = pools[kSto].allocate();
    if (!slot.ok()) return false;
    Node& n = nodes[v];
    plan.storage_writes.push_back(BlockMove{n.block[kHst], *slot, n.key});
    policy[kHst]->erase(v);
    n.present = static_cast<std::uint8_t>(n.present & ~bit(kHst));  // block kept until the ack
    set_block(v, kSto, *slot);
    n.state = NodeState::kDemoting;
    retier(v);
    ++pending_demotions;
    ++st.storage_writes;
    return true;
  }

  // How far down the host policy's order a clean victim is preferred to the first dirty one.
  static constexpr std::uint32_t kCleanVictimWindow = 64;

  enum class Room : std::uint8_t { kFree, kPending, kNone };

  // The host tier is full and a block is wanted now. Write-back with storage: a clean copy (another
  // copy remains, in storage or on device) among the next kCleanVictimWindow candidates is dropped
  // (kFree); otherwise the first dirty candidate is demoted, its block frees at the write's ack
  // (kPending). A dirty copy is dropped only when storage cannot take it.
  Room make_host_room() {
    if (!write_back_to_storage()) return drop_one_host() ? Room::kFree : Room::kNone;
    NodeId first_dirty = kNoNode;
    std::uint32_t dirty_seen = 0;
    NodeId v = policy[kHst]->victim([&](NodeId id) {
      if (!host_candidate(id)) return false;
      const Node& n = nodes[id];
      if (n.present != bit(kHst)) return can_drop(n, kHst);
      if (!host_demotable(n)) return false;
      if (first_dirty == kNoNode) first_dirty = id;
      return ++dirty_seen >= kCleanVictimWindow;  // stop scanning: no clean copy near the tail
    });
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

  Result<BlockId> take_host_block() {
    if (!host_run.empty()) {
      BlockId b = host_run.front();
      host_run.pop_front();
      return b;
    }
    if (pools[kHst].num_free() == 0 && make_host_room() != Room::kFree)
      return ResourceExhausted("host tier: no block free now (none droppable, or a demotion frees one later)");
    return pools[kHst].allocate();
  }

  bool drop_one_storage() {
    if (!has_tier(kSto)) return false;
    NodeId v = policy[kSto]->victim([this](NodeId n) { return storage_droppable(n); });
    if (v == kNoNode) return false;
    drop_copy(v, kSto);
    ++st.drops_storage;
    return true;
  }

  void evict_to_host(NodeId v, BlockId hb) {
    Node& n = nodes[v];
    plan.evictions.push_back(BlockMove{n.block[kDev], hb, n.key});
    release_copy(v, kDev);  // same-step reuse: the plan orders this D2H before any write into the device block
    set_block(v, kHst, hb);
    n.state = NodeState::kEvicting;
    retier(v);
    ++st.evictions_d2h;
  }

  // Evicts one device copy. Returns false when nothing can go.
  bool evict_one_device() {
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
      NodeId v = policy[kDev]->victim(pred);
      if (v == kNoNode) break;
      Node& n = nodes[v];
      if (n.present & bit(kHst)) {  // backed up: no copy needed
        drop_copy(v, kDev);
        ++st.drops_device;
        return true;
      }
      bool must_keep = num_children(n) > 0 && !can_drop(n, kDev);
      if (has_tier(kHst) && (cfg.write_policy == WritePolicy::kWriteBack || must_keep) && !host_full) {
        auto hb = take_host_block();
        if (hb.ok()) {
          evict_to_host(v, *hb);
          return true;
        }
        host_full = true;
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

  bool ensure_device_free(std::uint32_t need) {
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

  // Host eviction for watermarks: drop or demote to storage.
  bool evict_one_host_background() {
    std::vector<NodeId> skipped;
    auto pred = [&](NodeId id) {
      return host_candidate(id) && std::find(skipped.begin(), skipped.end(), id) == skipped.end();
    };
    for (int attempt = 0; attempt < 64; ++attempt) {
      NodeId v = policy[kHst]->victim(pred);
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
  void store_through(NodeId id) {
    Node& n = nodes[id];
    if (!has_tier(kSto) || cfg.write_policy == WritePolicy::kWriteBack) return;
    if (cfg.write_policy == WritePolicy::kWriteThroughSelective && n.hits < cfg.write_through_threshold) return;
    if (n.detached || n.state != NodeState::kSettled || !(n.present & bit(kHst)) || n.block[kSto] != kNoBlock) return;
    if (pools[kSto].num_free() == 0 && !drop_one_storage()) return;
    auto slot = pools[kSto].allocate();
    if (!slot.ok()) return;
    plan.storage_writes.push_back(BlockMove{n.block[kHst], *slot, n.key});
    set_block(id, kSto, *slot);
    n.state = NodeState::kStoring;
    ++st.storage_writes;
  }

  void backup(NodeId id) {
    Node& n = nodes[id];
    if (!has_tier(kHst) || n.state != NodeState::kSettled || !(n.present & bit(kDev)) || (n.present & bit(kHst)))
      return;
    auto hb = take_host_block();
    if (!hb.ok()) return;
    plan.backups.push_back(BlockMove{n.block[kDev], *hb, n.key});
    set_block(id, kHst, *hb);
    n.state = NodeState::kBackingUp;
    ++st.backups_d2h;
  }

  // ---- match ---------------------------------------------------------------
  // Nodes of the servable prefix, with their tiers.
  MatchResult match_nodes(std::span<const BlockKey> keys, std::vector<NodeId>* out) const {
    MatchResult r;
    int phase = kDev;
    for (const BlockKey& k : keys) {
      NodeId found = map.find(k);
      if (found == kNoNode) break;
      const Node& n = nodes[found];
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

// ---- CacheManager ------------------------------------------------------------

CacheManager::CacheManager(CacheConfig config) : config_(std::move(config)), impl_(std::make_unique<Impl>()) {}
CacheManager::~CacheManager() = default;

Result<std::unique_ptr<CacheManager>> CacheManager::create(CacheConfig config) {
  if (config.device_blocks == 0) return InvalidArgument("cache config: device_blocks is 0");
  if (config.device_blocks >= kNoBlock || config.host_blocks >= kNoBlock || config.storage_blocks >= kNoBlock)
    return InvalidArgument("cache config: a tier has >= 2^32-1 blocks");
  if (config.write_through_threshold == 0) return InvalidArgument("cache config: write_through_threshold is 0");
  for (const Watermarks* w : {&config.device_watermarks, &config.host_watermarks})
    if (w->low < 0 || w->high > 1 || w->low > w->high)
      return InvalidArgument(
          fmt::format("cache config: watermarks low {} high {} must satisfy 0 <= low <= high <= 1", w->low, w->high));
  std::unique_ptr<CacheManager> m(new CacheManager(config));
  Impl& s = *m->impl_;
  s.cfg = config;
  const std::uint32_t caps[kNumTiers] = {config.device_blocks, config.host_blocks, config.storage_blocks};
  const std::string* names[kNumTiers] = {&config.device_policy, &config.host_policy, &config.storage_policy};
  for (int t = 0; t < kNumTiers; ++t) {
    s.pools[t] = BlockPool(caps[t], std::string(tier_name(static_cast<Tier>(t))));
    s.owner[t].assign(caps[t], kNoNode);
    KVTIER_ASSIGN_OR_RETURN(s.policy[t],
                            make_policy(*names[t], std::max<std::uint32_t>(caps[t], 1), config.next_use_oracle));
  }
  std::size_t expect = std::size_t{config.device_blocks} + config.host_blocks + config.storage_blocks + 1;
  s.history = std::make_unique<UseHistory>(expect * 8);
  s.nodes.reserve(expect);
  s.map.reserve(expect);
  // The root: the namespace, always "on device", never evicted.
  s.nodes.emplace_back();
  s.nodes[0].live = true;
  s.nodes[0].counted_tier = kDev;
  return m;
}

MatchResult CacheManager::match(std::span<const BlockKey> keys) const { return impl_->match_nodes(keys, nullptr); }

Result<Admission> CacheManager::admit(std::span<const BlockKey> keys, std::uint32_t extra_blocks) {
  Impl& s = *impl_;
  ++s.clock;
  ++s.st.admissions;
  std::vector<NodeId> matched;
  MatchResult m = s.match_nodes(keys, &matched);
  const std::uint32_t hits = m.device_blocks + m.host_blocks;
  matched.resize(hits);  // storage hits are recomputed here (prefetch() brings them to host)
  const std::uint32_t num_keys = static_cast<std::uint32_t>(keys.size());
  const std::uint32_t need = m.host_blocks + (num_keys - hits) + extra_blocks;
  if (need > s.pools[kDev].capacity()) {
    ++s.st.admission_failures;
    return ResourceExhausted(
        fmt::format("admission needs {} device blocks, the device tier has {}", need, s.pools[kDev].capacity()));
  }
  for (NodeId id : matched) ++s.nodes[id].refs;
  if (!s.ensure_device_free(need)) {
    for (NodeId id : matched) {
      --s.nodes[id].refs;
    }
    ++s.st.admission_failures;
    return ResourceExhausted(fmt::format("admission needs {} free device blocks, {} free and nothing more evictable",
                                         need, s.pools[kDev].num_free()));
  }
  AdmissionRec rec;
  rec.keys.assign(keys.begin(), keys.end());
  rec.pos_node.assign(num_keys, kNoNode);
  rec.blocks.assign(num_keys + extra_blocks, kNoBlock);
  rec.owned.assign(num_keys + extra_blocks, 0);
  rec.pinned = matched;
  rec.hit_blocks = hits;
  rec.committed = hits;
  for (std::uint32_t i = 0; i < hits; ++i) {
    NodeId id = matched[i];
    Node& n = s.nodes[id];
    rec.pos_node[i] = id;
    s.history->bump(n.key);
    ++n.hits;
    if (i < m.device_blocks) {
      rec.blocks[i] = n.block[kDev];
    } else {
      BlockId db = *s.pools[kDev].allocate();  // ensured above
      s.plan.loads.push_back(BlockMove{n.block[kHst], db, n.key});
      s.set_block(id, kDev, db);
      n.state = NodeState::kLoading;
      s.retier(id);
      ++s.st.loads_h2d;
      rec.blocks[i] = db;
    }
  }
  // Deepest first: parents end up more recent than their children.
  for (std::uint32_t i = hits; i-- > 0;) {
    NodeId id = matched[i];
    s.policy[i < m.device_blocks ? kDev : kHst]->touch(id, s.info(id));
  }
  for (std::uint32_t i = hits; i < num_keys + extra_blocks; ++i) {
    rec.blocks[i] = *s.pools[kDev].allocate();
    rec.owned[i] = 1;
  }
  if (s.cfg.write_policy == WritePolicy::kWriteThroughSelective)
    for (std::uint32_t i = 0; i < m.device_blocks; ++i)
      if (s.nodes[matched[i]].hits >= s.cfg.write_through_threshold) s.backup(matched[i]);

  Admission a;
  a.id = s.next_admission++;
  a.device_hit_blocks = m.device_blocks;
  a.host_hit_blocks = m.host_blocks;
  a.storage_hit_blocks = m.storage_blocks;
  a.new_blocks = num_keys - hits;
  a.extra_blocks = extra_blocks;
  a.stopped_at_in_flight = m.stopped_at_in_flight;
  a.device_blocks = rec.blocks;
  s.admissions.emplace(a.id, std::move(rec));
  return a;
}

Status CacheManager::commit(AdmissionId id, std::uint32_t num_computed) {
  Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("commit: admission {} not found", id));
  AdmissionRec& rec = it->second;
  if (num_computed > rec.keys.size())
    return InvalidArgument(
        fmt::format("commit: num_computed {} > {} keys of admission {}", num_computed, rec.keys.size(), id));
  std::vector<NodeId> added;
  for (std::uint32_t pos = rec.committed; pos < num_computed; ++pos) {
    rec.committed = pos + 1;
    if (rec.chain_broken) continue;
    NodeId parent = pos == 0 ? Impl::kRoot : rec.pos_node[pos - 1];
    if (parent == kNoNode || s.nodes[parent].detached) {
      rec.chain_broken = true;
      continue;
    }
    const BlockKey& key = rec.keys[pos];
    NodeId found = s.map.find(key);
    NodeId nid;
    if (found == kNoNode) {
      nid = s.new_node(key, parent);
      std::uint32_t past = s.history->bump(key) - 1;
      s.nodes[nid].hits = parent == Impl::kRoot ? past : std::min(past, s.nodes[parent].hits);
      s.set_block(nid, kDev, rec.blocks[pos]);
      s.nodes[nid].present = bit(kDev);
      s.retier(nid);
      rec.owned[pos] = 0;
      added.push_back(nid);
    } else {
      nid = found;
      Node& n = s.nodes[nid];
      if (n.parent != parent) {  // a key collision or a caller mixing namespaces: do not index
        rec.chain_broken = true;
        continue;
      }
      if (n.state == NodeState::kSettled && !(n.present & bit(kDev))) {
        s.set_block(nid, kDev, rec.blocks[pos]);
        n.present |= bit(kDev);
        s.retier(nid);
        rec.owned[pos] = 0;
        added.push_back(nid);
      } else if (s.eventual_tier(n) != kDev) {  // in flight away from the device
        rec.chain_broken = true;
        continue;
      }
      // else: another request computed it first; ours is freed at release.
    }
    ++s.nodes[nid].refs;
    rec.pinned.push_back(nid);
    rec.pos_node[pos] = nid;
  }
  for (auto a = added.rbegin(); a != added.rend(); ++a) s.policy[kDev]->insert(*a, s.info(*a));
  if (s.cfg.write_policy == WritePolicy::kWriteThrough)
    for (NodeId nid : added) s.backup(nid);
  return Status::Ok();
}

Status CacheManager::commit_all(AdmissionId id) {
  auto it = impl_->admissions.find(id);
  if (it == impl_->admissions.end()) return NotFound(fmt::format("commit: admission {} not found", id));
  return commit(id, static_cast<std::uint32_t>(it->second.keys.size()));
}

Status CacheManager::release(AdmissionId id) {
  Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("release: admission {} not found", id));
  AdmissionRec& rec = it->second;
  for (NodeId nid : rec.pinned) {
    --s.nodes[nid].refs;
    s.reclaim_if_dead(nid);
  }
  for (std::size_t i = 0; i < rec.blocks.size(); ++i)
    if (rec.owned[i]) s.free_block(kDev, rec.blocks[i]);
  s.admissions.erase(it);
  return Status::Ok();
}

Result<AdmissionStatus> CacheManager::admission_status(AdmissionId id) const {
  const Impl& s = *impl_;
  auto it = s.admissions.find(id);
  if (it == s.admissions.end()) return NotFound(fmt::format("admission {} not found", id));
  const AdmissionRec& rec = it->second;
  AdmissionStatus out;
  bool ready = true;
  for (std::uint32_t i = 0; i < rec.hit_blocks; ++i) {
    const Node& n = s.nodes[rec.pos_node[i]];
    if (n.detached) out.failed = true;
    if (n.state == NodeState::kLoading) ++out.loading_blocks;
    ready = ready && !n.detached && (n.present & bit(kDev));
    if (ready) ++out.ready_blocks;
  }
  return out;
}

Result<std::uint32_t> CacheManager::prefetch(std::span<const BlockKey> keys) {
  Impl& s = *impl_;
  if (!s.has_tier(kSto) || !s.has_tier(kHst)) return std::uint32_t{0};
  std::vector<NodeId> matched;
  MatchResult m = s.match_nodes(keys, &matched);
  std::uint32_t queued = 0;
  for (std::uint32_t i = m.device_blocks + m.host_blocks; i < matched.size(); ++i) {
    NodeId id = matched[i];
    Node& n = s.nodes[id];
    auto hb = s.take_host_block();
    if (!hb.ok()) {
      // Write-back: dirty host blocks are being written to storage to make room. Make room for the
      // rest of the segment too, so that a call after their acks can queue it all.
      if (s.write_back_to_storage())
        for (std::size_t rest = matched.size() - i - 1; rest > 0; --rest)
          if (s.make_host_room() == Impl::Room::kNone) break;
      break;
    }
    // Taking a host block may have dropped the host copy of the parent (one also held in
    // storage): a host block below a storage-only parent would break the tier order.
    const NodeId parent = n.parent;
    if (n.detached || (parent != Impl::kRoot && s.eventual_tier(s.nodes[parent]) > kHst)) {
      s.pools[kHst].free(*hb).ignore_error();
      break;
    }
    s.plan.storage_prefetches.push_back(BlockMove{n.block[kSto], *hb, n.key});
    s.set_block(id, kHst, *hb);
    n.state = NodeState::kFetching;
    s.retier(id);
    ++s.st.storage_prefetches;
    ++queued;
  }
  return queued;
}

StepPlan CacheManager::take_plan() {
  Impl& s = *impl_;
  auto below = [](const BlockPool& p, double frac) {
    return static_cast<double>(p.num_free()) < frac * static_cast<double>(p.capacity());
  };
  const Watermarks& dw = s.cfg.device_watermarks;
  if (dw.high > 0 && below(s.pools[kDev], dw.low)) {
    auto target = static_cast<std::uint32_t>(dw.high * s.pools[kDev].capacity() + 0.999999);
    (void)s.ensure_device_free(std::min(target, s.pools[kDev].capacity()));
  }
  const Watermarks& hw = s.cfg.host_watermarks;
  if (hw.high > 0 && s.has_tier(kHst) &&
      static_cast<double>(s.pools[kHst].num_free() + s.pending_demotions) <
          hw.low * static_cast<double>(s.pools[kHst].capacity())) {
    double target = hw.high * s.pools[kHst].capacity();
    while (static_cast<double>(s.pools[kHst].num_free() + s.pending_demotions) < target)
      if (!s.evict_one_host_background()) break;
  }
  StepPlan out = std::move(s.plan);
  s.plan = StepPlan{};
  return out;
}

#define KVTIER_ACK_LOOKUP(tier, b, want, what)                                                                 \
  if ((b) >= s.owner[tier].size() || s.owner[tier][b] == kNoNode || s.nodes[s.owner[tier][b]].state != (want)) \
    return FailedPrecondition(                                                                                 \
        fmt::format("{}: {} block {} has no {} in flight", what, tier_name(static_cast<Tier>(tier)), b, what));

Status CacheManager::ack_evictions(std::span<const BlockId> host_blocks, const Status& status) {
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
      s.policy[kHst]->insert(id, s.info(id));
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
      s.policy[kHst]->insert(id, s.info(id));
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
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kLoading;
  for (BlockId b : device_blocks) KVTIER_ACK_LOOKUP(kDev, b, NodeState::kLoading, "load");
  std::vector<NodeId> landed;
  for (BlockId b : device_blocks) {
    NodeId id = s.owner[kDev][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kDev);
      landed.push_back(id);
    } else {
      // Device bytes are garbage, and so is anything computed on top of them.
      ++s.st.failed_transfers;
      s.detach_subtree(id);
    }
  }
  std::sort(landed.begin(), landed.end(), [&](NodeId a, NodeId b) { return s.nodes[a].depth > s.nodes[b].depth; });
  for (NodeId id : landed) {
    if (s.nodes[id].detached) continue;
    s.policy[kDev]->insert(id, s.info(id));
    s.retier(id);
  }
  return Status::Ok();
}

Status CacheManager::ack_storage_writes(std::span<const BlockId> storage_slots, const Status& status) {
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
      n.write_failed = false;
      s.policy[kSto]->insert(id, s.info(id));
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
        n.write_failed = true;
        s.policy[kHst]->insert(id, s.info(id));
      }
    }
    s.retier(id);
  }
  return Status::Ok();
}

Status CacheManager::ack_storage_prefetches(std::span<const BlockId> host_blocks, const Status& status) {
  Impl& s = *impl_;
  constexpr NodeState want = NodeState::kFetching;
  for (BlockId b : host_blocks) KVTIER_ACK_LOOKUP(kHst, b, NodeState::kFetching, "prefetch");
  for (BlockId b : host_blocks) {
    NodeId id = s.owner[kHst][b];
    if (id == kNoNode || s.nodes[id].state != want) continue;  // listed twice
    Node& n = s.nodes[id];
    n.state = NodeState::kSettled;
    if (n.detached) {
      s.reclaim_if_dead(id);
    } else if (status.ok()) {
      n.present |= bit(kHst);
      s.policy[kHst]->insert(id, s.info(id));
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

CacheStats CacheManager::stats() const {
  const Impl& s = *impl_;
  CacheStats out = s.st;
  for (int t = 0; t < kNumTiers; ++t) {
    out.tiers[t].capacity = s.pools[t].capacity();
    out.tiers[t].used = s.pools[t].num_used();
    out.tiers[t].resident = static_cast<std::uint32_t>(s.policy[t]->size());
  }
  out.nodes = s.map.size();
  return out;
}

Status CacheManager::check_invariants() const {
  const Impl& s = *impl_;
  std::vector<std::uint32_t> refs(s.nodes.size(), 0);
  std::array<std::vector<std::uint8_t>, kNumTiers> seen;
  for (int t = 0; t < kNumTiers; ++t) seen[t].assign(s.pools[t].capacity(), 0);
  for (const auto& [aid, rec] : s.admissions) {
    for (NodeId n : rec.pinned) ++refs[n];
    for (std::size_t i = 0; i < rec.blocks.size(); ++i)
      if (rec.owned[i]) {
        BlockId b = rec.blocks[i];
        if (seen[kDev][b]++) return Internal(fmt::format("device block {} owned twice (admission {})", b, aid));
        if (s.pools[kDev].is_free(b)) return Internal(fmt::format("admission {} owns free device block {}", aid, b));
      }
  }
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
