#include "kvtier/backend/eviction_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache/ghost_fifo.h"
#include "cache/key_index.h"
#include "cache/node_lists.h"

namespace kvtier::cache {
namespace {

// A policy ordered by NodeLists, which parks blocked copies as its walks pass them (victim() walks with
// lists_.skip_blocked).
class ListPolicy : public EvictionPolicy {
 public:
  explicit ListPolicy(int num_lists) : lists_(num_lists) {}
  void set_blocked(NodeId n, bool blocked) override { lists_.set_blocked(n, blocked); }
  // Puts every parked copy back in its place: for an expert of a duel that stops leading (its victim() is no longer
  // asked, so nothing would be near its parked copies' places when they are unblocked).
  void unpark_all() { lists_.unpark_all(); }
  // Blocked copies are those whose byte in *flags has a bit of `mask`, which a duel keeps for all its experts.
  void follow_blocked(const std::vector<std::uint8_t>* flags, std::uint8_t mask) { lists_.follow_blocked(flags, mask); }

 protected:
  NodeLists lists_;
};

std::uint64_t fingerprint(const AccessInfo& info) {
  return info.key ? info.key->lo ^ (info.key->hi * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) : 0;
}

// ---- LRU -----------------------------------------------------------------
class LruPolicy final : public ListPolicy {
 public:
  LruPolicy() : ListPolicy(1) {}
  std::string name() const override { return "lru"; }
  void insert(NodeId n, const AccessInfo&) override {
    if (lists_.list_of(n) == NodeLists::kNone)
      lists_.push_head(0, n);
    else
      lists_.move_head(0, n);
  }
  void touch(NodeId n, const AccessInfo& info) override { insert(n, info); }
  void erase(NodeId n) override {
    if (lists_.list_of(n) != NodeLists::kNone) lists_.unlink(n);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    for (NodeId n = lists_.skip_blocked(lists_.tail(0)); n != kNoNode; n = lists_.skip_blocked(lists_.prev(n)))
      if (evictable(n)) return n;
    return kNoNode;
  }
  std::size_t size() const override { return lists_.size(0); }
  bool contains(NodeId n) const override { return lists_.list_of(n) != NodeLists::kNone; }
};

// ---- S3-FIFO -------------------------------------------------------------
class S3FifoPolicy final : public EvictionPolicy {
 public:
  explicit S3FifoPolicy(std::uint32_t capacity)
      : lists_(2),
        small_target_(std::max<std::size_t>(1, capacity / 10)),
        ghost_(std::max<std::uint32_t>(capacity, 1)) {}
  std::string name() const override { return "s3fifo"; }
  void insert(NodeId n, const AccessInfo& info) override {
    if (contains(n)) return touch(n, info);
    grow(n);
    freq_[n] = 0;
    fp_[n] = fingerprint(info);
    if (ghost_.remove(fp_[n]))
      lists_.push_head(kMain, n);
    else
      lists_.push_head(kSmall, n);
  }
  void touch(NodeId n, const AccessInfo&) override {
    if (!contains(n)) return;
    if (freq_[n] < 3) ++freq_[n];
  }
  void erase(NodeId n) override {
    if (!contains(n)) return;
    if (lists_.list_of(n) == kSmall) ghost_.add(fp_[n]);
    lists_.unlink(n);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    // Each step moves one node; two full passes plus the frequency decay bound the work.
    std::size_t budget = 8 * (lists_.size(kSmall) + lists_.size(kMain)) + 8;
    // Zero-frequency main nodes passed over as not evictable, in a row. Once a whole queue's worth
    // went by, main holds nothing evictable for this call (frequencies only fall here): take from
    // small even below its target, or the small queue's evictable nodes would never be found.
    std::size_t main_skipped = 0;
    while (budget-- > 0) {
      if (lists_.size(kSmall) == 0 && lists_.size(kMain) == 0) return kNoNode;
      bool main_exhausted = main_skipped >= lists_.size(kMain);
      bool from_small = lists_.size(kSmall) > 0 && (lists_.size(kSmall) >= small_target_ || main_exhausted);
      if (!from_small && main_exhausted) return kNoNode;  // small is empty and main has nothing
      if (from_small) {
        NodeId t = lists_.tail(kSmall);
        if (freq_[t] > 0) {
          freq_[t] = 0;
          // Promoted to main's head. With main exhausted, the lap that found it so never reaches the head: a
          // node that may go now goes (nothing in main could), rather than the call giving up.
          if (main_exhausted && evictable(t)) return t;
          lists_.move_head(kMain, t);
        } else if (evictable(t)) {
          return t;
        } else {
          lists_.move_head(kMain, t);  // in use or a parent: it has proven its worth
        }
      } else {
        NodeId t = lists_.tail(kMain);
        if (freq_[t] > 0) {
          --freq_[t];
          main_skipped = 0;  // a node that may still be evictable comes round again
          lists_.move_head(kMain, t);
        } else if (evictable(t)) {
          return t;
        } else {
          ++main_skipped;
          lists_.move_head(kMain, t);
        }
      }
    }
    return kNoNode;
  }
  std::size_t size() const override { return lists_.size(kSmall) + lists_.size(kMain); }
  bool contains(NodeId n) const override { return lists_.list_of(n) != NodeLists::kNone; }

 private:
  static constexpr int kSmall = 0, kMain = 1;
  void grow(NodeId n) {
    if (n >= freq_.size()) {
      freq_.resize(std::max<std::size_t>(n + 1, freq_.size() * 2), 0);
      fp_.resize(freq_.size(), 0);
    }
  }
  NodeLists lists_;
  std::size_t small_target_;
  GhostFifo ghost_;
  std::vector<std::uint8_t> freq_;
  std::vector<std::uint64_t> fp_;
};

// ---- SIEVE ---------------------------------------------------------------
// SIEVE (Zhang et al., NSDI'24): one FIFO queue, new entries at the head, a visited bit per entry set
// by a hit, and a hand that walks from the tail toward the head, clearing visited bits and stopping at
// the first unvisited entry; it wraps to the tail past the head. Entries never move on a hit, so a hit
// is one bit and the hand's walk is paid for by the bits it clears: O(1) amortized per eviction.
//
// The manager's predicate: the hand passes over an entry that may not go now (pinned, a parent in its
// tier) as over a visited one, clearing its bit, and keeps its place between calls, so such entries cost
// one step per lap, not a rescan from the tail each time. One lap clears every bit, so two laps find any
// evictable entry; a call that finds none gives up after them.
class SievePolicy final : public EvictionPolicy {
 public:
  SievePolicy() : lists_(1) {}
  std::string name() const override { return "sieve"; }
  void insert(NodeId n, const AccessInfo& info) override {
    if (contains(n)) return touch(n, info);
    if (n >= visited_.size()) visited_.resize(std::max<std::size_t>(n + 1, visited_.size() * 2), 0);
    visited_[n] = 0;
    lists_.push_head(0, n);
  }
  void touch(NodeId n, const AccessInfo&) override {
    if (contains(n)) visited_[n] = 1;
  }
  void erase(NodeId n) override {
    if (!contains(n)) return;
    if (hand_ == n) hand_ = lists_.prev(n);  // toward the head; kNoNode: wraps at the next call
    lists_.unlink(n);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    const std::size_t steps = 2 * lists_.size(0) + 1;
    for (std::size_t i = 0; i < steps && lists_.size(0) > 0; ++i) {
      if (hand_ == kNoNode) hand_ = lists_.tail(0);
      const NodeId n = hand_;
      if (!visited_[n] && evictable(n)) return n;  // the hand stays on it until erase() moves it on
      visited_[n] = 0;
      hand_ = lists_.prev(n);
    }
    return kNoNode;
  }
  std::size_t size() const override { return lists_.size(0); }
  bool contains(NodeId n) const override { return lists_.list_of(n) != NodeLists::kNone; }

 private:
  NodeLists lists_;
  std::vector<std::uint8_t> visited_;
  NodeId hand_ = kNoNode;  // next entry the hand looks at; kNoNode: start from the tail
};

// ---- ARC -----------------------------------------------------------------
class ArcPolicy final : public ListPolicy {
 public:
  explicit ArcPolicy(std::uint32_t capacity) : ListPolicy(2), c_(std::max<std::uint32_t>(capacity, 1)), ghosts_(c_) {}
  std::string name() const override { return "arc"; }
  void insert(NodeId n, const AccessInfo& info) override {
    if (contains(n)) return touch(n, info);
    grow(n);
    fp_[n] = fingerprint(info);
    const double s1 = static_cast<double>(ghosts_.size(kB1)), s2 = static_cast<double>(ghosts_.size(kB2));
    const int ghost = ghosts_.take(fp_[n]);
    if (ghost == kB1) {
      p_ = std::min<double>(c_, p_ + std::max(1.0, s2 / std::max(s1, 1.0)));
      lists_.push_head(kT2, n);
    } else if (ghost == kB2) {
      p_ = std::max(0.0, p_ - std::max(1.0, s1 / std::max(s2, 1.0)));
      lists_.push_head(kT2, n);
    } else {
      lists_.push_head(kT1, n);
    }
  }
  void touch(NodeId n, const AccessInfo&) override {
    if (contains(n)) lists_.move_head(kT2, n);
  }
  void erase(NodeId n) override {
    if (!contains(n)) return;
    ghosts_.add(fp_[n], lists_.list_of(n) == kT1 ? kB1 : kB2);
    lists_.unlink(n);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    bool t1_first = lists_.size(kT1) > 0 && static_cast<double>(lists_.size(kT1)) >= std::max(p_, 1.0);
    int order[2] = {t1_first ? kT1 : kT2, t1_first ? kT2 : kT1};
    for (int l : order)
      for (NodeId n = lists_.skip_blocked(lists_.tail(l)); n != kNoNode; n = lists_.skip_blocked(lists_.prev(n)))
        if (evictable(n)) return n;
    return kNoNode;
  }
  // Blocked copies still count in |T1| and |T2| (NodeLists::size), which steer ARC's choice of list.
  std::size_t size() const override { return lists_.size(kT1) + lists_.size(kT2); }
  bool contains(NodeId n) const override { return lists_.list_of(n) != NodeLists::kNone; }

 private:
  static constexpr int kT1 = 0, kT2 = 1;  // resident lists
  static constexpr int kB1 = 0, kB2 = 1;  // their ghost lists, in ghosts_
  void grow(NodeId n) {
    if (n >= fp_.size()) fp_.resize(std::max<std::size_t>(n + 1, fp_.size() * 2), 0);
  }
  std::uint32_t c_;
  double p_ = 0;
  GhostFifo ghosts_;  // B1 and B2 in one table: one probe per insert
  std::vector<std::uint64_t> fp_;
};

// ---- priority-ordered policies (LRFU, Belady) ----------------------------
class PriorityPolicy : public EvictionPolicy {
 public:
  void insert(NodeId n, const AccessInfo& info) override { set(n, priority(info), info.depth); }
  void touch(NodeId n, const AccessInfo& info) override {
    if (contains(n)) set(n, priority(info), info.depth);
  }
  void erase(NodeId n) override {
    if (!contains(n)) return;
    if (present_[n] == kInOrder)
      order_.erase(entry_[n]);
    else
      --blocked_;
    present_[n] = 0;
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    for (const auto& e : order_)
      if (evictable(std::get<2>(e))) return std::get<2>(e);
    return kNoNode;
  }
  // A blocked copy keeps its entry (updated by touch()) out of the order until it is unblocked.
  void set_blocked(NodeId n, bool blocked) override {
    if (!contains(n) || (present_[n] == kBlocked) == blocked) return;
    if (blocked)
      order_.erase(entry_[n]);
    else
      order_.insert(entry_[n]);
    present_[n] = blocked ? kBlocked : kInOrder;
    blocked_ = blocked ? blocked_ + 1 : blocked_ - 1;
  }
  std::size_t size() const override { return order_.size() + blocked_; }
  bool contains(NodeId n) const override { return n < present_.size() && present_[n]; }

 protected:
  virtual double priority(const AccessInfo& info) = 0;

 private:
  // (priority, -depth: deeper first on ties, node)
  using Entry = std::tuple<double, std::int64_t, NodeId>;
  void set(NodeId n, double prio, std::uint32_t depth) {
    if (n >= present_.size()) {
      std::size_t sz = std::max<std::size_t>(n + 1, present_.size() * 2);
      present_.resize(sz, 0);
      entry_.resize(sz);
    }
    if (present_[n] == kBlocked) {  // stays out of the order until unblocked
      entry_[n] = Entry{prio, -static_cast<std::int64_t>(depth), n};
      return;
    }
    if (present_[n] == kInOrder) order_.erase(entry_[n]);
    entry_[n] = Entry{prio, -static_cast<std::int64_t>(depth), n};
    order_.insert(entry_[n]);
    present_[n] = kInOrder;
  }
  static constexpr std::uint8_t kInOrder = 1, kBlocked = 2;  // present_: 0 untracked
  std::set<Entry> order_;
  std::vector<Entry> entry_;
  std::vector<std::uint8_t> present_;
  std::size_t blocked_ = 0;
};

// LRFU: priority = last access + boost * log2(uses), evict the lowest. Uses are quantized to
// half-octave classes, one LRU list per class (within a class, list order is priority order),
// so every operation is O(1) and victim() merges the class tails (O(classes) per step).
class LrfuPolicy final : public EvictionPolicy {
 public:
  LrfuPolicy(double boost, std::uint32_t capacity) : boost_(boost), lists_(kClasses) {}
  std::string name() const override { return boost_ == kDefaultLrfuBoost ? "lrfu" : fmt::format("lrfu:{}", boost_); }
  void insert(NodeId n, const AccessInfo& info) override { place(n, info); }
  void touch(NodeId n, const AccessInfo& info) override {
    if (contains(n)) place(n, info);
  }
  void erase(NodeId n) override {
    if (contains(n)) lists_.unlink(n);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override {
    NodeId cur[kClasses];
    for (int c = 0; c < kClasses; ++c) cur[c] = lists_.tail(c);
    for (;;) {
      int best = -1;
      double best_prio = 0;
      for (int c = 0; c < kClasses; ++c) {
        if (cur[c] == kNoNode) continue;
        double prio = static_cast<double>(last_[cur[c]]) + boost_ * 0.5 * c;
        if (best < 0 || prio < best_prio || (prio == best_prio && depth_[cur[c]] > depth_[cur[best]])) {
          best = c;
          best_prio = prio;
        }
      }
      if (best < 0) return kNoNode;
      if (evictable(cur[best])) return cur[best];
      cur[best] = lists_.prev(cur[best]);
    }
  }
  // set_blocked is ignored: the merge breaks ties of priority by depth, which a class list's order does not follow
  // (two copies last used at one tick sit in push order), so a blocked copy taken out of its list could let the one
  // behind it win a tie that the blocked one would have lost, and change the victim.
  std::size_t size() const override {
    std::size_t n = 0;
    for (int c = 0; c < kClasses; ++c) n += lists_.size(c);
    return n;
  }
  bool contains(NodeId n) const override { return lists_.list_of(n) != NodeLists::kNone; }

 private:
  static constexpr int kClasses = 16;
  void place(NodeId n, const AccessInfo& info) {
    std::uint64_t uses = std::uint64_t{info.hit_count} + 1;
    int cls = std::min(kClasses - 1, static_cast<int>(2.0 * std::log2(static_cast<double>(uses))));
    if (n >= last_.size()) {
      last_.resize(std::max<std::size_t>(n + 1, last_.size() * 2), 0);
      depth_.resize(last_.size(), 0);
    }
    last_[n] = info.now;
    depth_[n] = info.depth;
    if (contains(n))
      lists_.move_head(cls, n);
    else
      lists_.push_head(cls, n);
  }
  double boost_;
  NodeLists lists_;
  std::vector<std::uint64_t> last_;
  std::vector<std::uint32_t> depth_;
};

class BeladyPolicy final : public PriorityPolicy {
 public:
  explicit BeladyPolicy(NextUseOracle oracle) : oracle_(std::move(oracle)) {}
  std::string name() const override { return "belady"; }

 protected:
  double priority(const AccessInfo& info) override {
    std::uint64_t next = info.key ? oracle_(*info.key, info.now) : UINT64_MAX;
    return -static_cast<double>(next);  // farthest next use = lowest priority
  }

 private:
  NextUseOracle oracle_;
};

// ---- dueling experts -----------------------------------------------------
// One expert's shadow: a cache of `capacity` keys that the expert alone manages, fed the tier's accesses, counting
// the hits it would have had. Keys only (no blocks; the key index's open-addressing table), so it costs a probe and
// the expert's own bookkeeping per access. It sees accesses block by block: no prefix rule and no leaf rule, which the
// experts' orders mostly respect anyway (a parent is accessed whenever its child is); the blocks accessed at the
// current clock tick (the running request's) are not evicted, as a cache pins them. A request longer than the capacity
// overfills it until the next tick (bounded by kMaxOverfill, then the oldest goes regardless).
class ShadowCache {
 public:
  ShadowCache(std::unique_ptr<EvictionPolicy> expert, std::uint32_t capacity)
      : expert_(std::move(expert)), capacity_(capacity) {
    where_.reserve(std::size_t{capacity} + kMaxOverfill);
  }
  // True on a hit.
  bool access(const BlockKey& key, const AccessInfo& info) {
    if (const NodeId hit = where_.find(key); hit != kNoNode) {
      seen_at_[hit] = info.now;
      expert_->touch(hit, info);
      return true;
    }
    while (expert_->size() >= capacity_) {
      const std::uint64_t now = info.now;
      NodeId v = expert_->victim([&](NodeId x) { return seen_at_[x] != now; });
      if (v == kNoNode && expert_->size() < std::size_t{capacity_} + kMaxOverfill) break;
      if (v == kNoNode) v = expert_->victim([](NodeId) { return true; });
      expert_->erase(v);
      where_.erase(key_of_[v]);
      free_ids_.push_back(v);
    }
    NodeId id;
    if (!free_ids_.empty()) {
      id = free_ids_.back();
      free_ids_.pop_back();
    } else {
      id = static_cast<NodeId>(key_of_.size());
      key_of_.emplace_back();
      seen_at_.push_back(0);
    }
    key_of_[id] = key;
    seen_at_[id] = info.now;
    where_.insert(key, id);
    expert_->insert(id, info);
    return false;
  }
  static constexpr std::size_t kMaxOverfill = 4096;

 private:
  std::unique_ptr<EvictionPolicy> expert_;
  std::uint32_t capacity_;
  KeyIndex where_;
  std::vector<BlockKey> key_of_;
  std::vector<std::uint64_t> seen_at_;
  std::vector<NodeId> free_ids_;
};

class DuelingPolicy final : public EvictionPolicy {
 public:
  // Each expert twice: one orders the tier's resident copies, the other runs in a shadow cache.
  DuelingPolicy(std::string name, std::vector<std::unique_ptr<EvictionPolicy>> real,
                std::vector<std::unique_ptr<EvictionPolicy>> shadow, std::uint32_t capacity)
      : name_(std::move(name)), real_(std::move(real)) {
    // Spatial sampling: a large tier's shadows follow only keys whose hash falls in 1 / 2^shift of the space, with
    // capacities scaled alike (a sampled cache's hit ratio tracks the full one's, as SHARDS-style miniature
    // simulations use); small tiers are shadowed whole.
    std::uint32_t cap = std::max<std::uint32_t>(capacity, 1);
    while (sample_shift_ < 16 && (cap >> 1) >= kMinShadowBlocks) {
      cap >>= 1;
      ++sample_shift_;
    }
    for (auto& expert : shadow) shadows_.emplace_back(std::move(expert), cap);
    score_.assign(real_.size(), 0.0);
    disagree_.assign(real_.size(), 0);
    lead_over_leader_.assign(real_.size(), 0);
    window_ = kWindowPerBlock * static_cast<double>(cap);
    decay_ = 1.0 - 1.0 / window_;
    for (auto& e : real_) {
      auto* lists = dynamic_cast<ListPolicy*>(e.get());
      if (lists != nullptr) lists->follow_blocked(&state_, kBlocked);
      follows_blocked_.push_back(lists != nullptr);
    }
  }
  // The list experts keep a pointer to state_.
  DuelingPolicy(const DuelingPolicy&) = delete;
  DuelingPolicy& operator=(const DuelingPolicy&) = delete;
  std::string name() const override { return name_; }
  void insert(NodeId n, const AccessInfo& info) override {
    if (info.accessed) observe(info);
    if (!contains(n)) {
      if (n >= state_.size()) state_.resize(std::max<std::size_t>(std::size_t{n} + 1, state_.size() * 2), 0);
      state_[n] = kTracked;
    }
    for (auto& e : real_) e->insert(n, info);
  }
  void touch(NodeId n, const AccessInfo& info) override {
    if (!contains(n)) return;
    observe(info);
    for (auto& e : real_) e->touch(n, info);
  }
  void erase(NodeId n) override {
    if (!contains(n)) return;
    for (auto& e : real_) e->erase(n);
    state_[n] = 0;
  }
  // One bit for every expert (experts that keep lists read it in state_; others are told). Only the leader walks, so
  // only it may have n parked: the others put theirs back when they stopped leading (lead_to).
  void set_blocked(NodeId n, bool blocked) override {
    if (!contains(n) || ((state_[n] & kBlocked) != 0) == blocked) return;
    state_[n] = blocked ? kTracked | kBlocked : kTracked;
    for (std::size_t i = 0; i < real_.size(); ++i)
      if (!follows_blocked_[i] || (i == leader_ && !blocked)) real_[i]->set_blocked(n, blocked);
  }
  NodeId victim(FunctionRef<bool(NodeId)> evictable) override { return real_[leader_]->victim(evictable); }
  std::size_t size() const override { return real_[0]->size(); }
  bool contains(NodeId n) const override { return n < state_.size() && (state_[n] & kTracked); }
  Lead lead() const override { return {static_cast<std::uint32_t>(leader_), switches_}; }

  // The shadows' hits are averaged over about this many accesses per block of capacity; no switch before that many.
  static constexpr double kWindowPerBlock = 10.0;
  // Shadows are sampled down to no fewer blocks than this.
  static constexpr std::uint32_t kMinShadowBlocks = 4096;

 private:
  void observe(const AccessInfo& info) {
    if (info.key == nullptr) return;  // nothing to follow it by
    const std::uint64_t fp = fingerprint(info);
    if (sample_shift_ != 0 && ((fp * 0xD6E8FEB86659FD93ull) >> (64 - sample_shift_)) != 0) return;
    bool hit[kMaxDuelExperts];
    for (std::size_t i = 0; i < shadows_.size(); ++i) {
      hit[i] = shadows_[i].access(*info.key, info);
      score_[i] = score_[i] * decay_ + (hit[i] ? 1.0 : 0.0);
    }
    if (static_cast<double>(++observed_) < window_) {
      early_switch(hit);
      return;
    }
    std::size_t best = leader_;
    for (std::size_t i = 0; i < score_.size(); ++i)
      if (score_[i] > score_[best]) best = i;
    if (best != leader_) lead_to(best);
  }
  // Before the first window has passed the averaged scores say little, but a trace shorter than the window (or a
  // long first phase) would otherwise keep the first expert throughout. A sign test on the accesses where an expert
  // and the leader disagree decides early instead: under "no better than the leader" the expert's wins among n
  // disagreements are Binomial(n, 1/2), so a lead of kEarlyZ standard deviations (sqrt(n)) is evidence, not noise. The
  // bar is set high (5 and 7 also switched early on traces where the window's average later chose otherwise, and lost
  // hits there): an early switch must be unmistakable, and the window's rule takes over once it has passed.
  void early_switch(const bool* hit) {
    for (std::size_t i = 0; i < shadows_.size(); ++i) {
      if (i == leader_ || hit[i] == hit[leader_]) continue;
      ++disagree_[i];
      lead_over_leader_[i] += hit[i] ? 1 : -1;
      const double n = static_cast<double>(disagree_[i]);
      if (disagree_[i] < kEarlyMinDisagreements || lead_over_leader_[i] <= 0 ||
          static_cast<double>(lead_over_leader_[i]) * static_cast<double>(lead_over_leader_[i]) < kEarlyZ * kEarlyZ * n)
        continue;
      lead_to(i);
      std::fill(disagree_.begin(), disagree_.end(), 0);
      std::fill(lead_over_leader_.begin(), lead_over_leader_.end(), 0);
      return;
    }
  }
  void lead_to(std::size_t expert) {
    if (auto* former = dynamic_cast<ListPolicy*>(real_[leader_].get())) former->unpark_all();
    leader_ = expert;
    ++switches_;
  }
  static constexpr double kEarlyZ = 10.0;
  static constexpr std::uint64_t kEarlyMinDisagreements = 256;

  std::string name_;
  std::vector<std::unique_ptr<EvictionPolicy>> real_;
  // Per node: kTracked (every expert tracks it; one byte to ask, not an expert's lists), kBlocked (set_blocked; the
  // experts that keep lists read it there).
  static constexpr std::uint8_t kTracked = 1, kBlocked = 2;
  std::vector<std::uint8_t> state_;
  std::vector<bool> follows_blocked_;  // per expert: reads kBlocked in state_ (ListPolicy)
  std::vector<ShadowCache> shadows_;
  std::vector<std::uint64_t> disagree_;         // per expert: accesses where it and the leader disagreed (early)
  std::vector<std::int64_t> lead_over_leader_;  // per expert: its hits minus the leader's on those accesses
  std::vector<double> score_;
  double window_ = 1, decay_ = 0;
  std::uint64_t observed_ = 0;
  std::size_t leader_ = 0;
  std::uint64_t switches_ = 0;
  int sample_shift_ = 0;
};

}  // namespace

std::vector<std::string_view> policy_experts(std::string_view policy) {
  std::string_view list;
  if (policy == "adaptive")
    list = kAdaptiveExperts;
  else if (policy.substr(0, 5) == "duel:")
    list = policy.substr(5);
  else
    return {policy};
  std::vector<std::string_view> experts;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t plus = std::min(list.find('+', at), list.size());
    experts.push_back(list.substr(at, plus - at));
    at = plus + 1;
  }
  return experts;
}

std::string_view lower_tier_policy(std::string_view policy) { return policy_experts(policy).front(); }

Result<std::unique_ptr<EvictionPolicy>> make_policy(std::string_view name, std::uint32_t capacity,
                                                    NextUseOracle oracle) {
  if (name == "lru") return std::unique_ptr<EvictionPolicy>(new LruPolicy());
  if (name == "s3fifo") return std::unique_ptr<EvictionPolicy>(new S3FifoPolicy(capacity));
  if (name == "arc") return std::unique_ptr<EvictionPolicy>(new ArcPolicy(capacity));
  if (name == "sieve") return std::unique_ptr<EvictionPolicy>(new SievePolicy());
  if (name == "belady") {
    if (!oracle) return InvalidArgument("policy 'belady' needs a next-use oracle (offline replay only)");
    return std::unique_ptr<EvictionPolicy>(new BeladyPolicy(std::move(oracle)));
  }
  if (name == "adaptive" || name.substr(0, 5) == "duel:") {
    const std::vector<std::string_view> experts = policy_experts(name);
    for (const std::string_view expert : experts)
      if (expert.empty() || expert == "adaptive" || expert.substr(0, 5) == "duel:" || expert == "belady")
        return InvalidArgument(
            fmt::format("policy '{}': '{}' cannot be an expert (an online policy of make_policy: "
                        "lru, s3fifo, sieve, arc, lrfu[:boost])",
                        name, expert));
    // Counted before any is built: each expert costs an order and a shadow of the tier.
    if (experts.size() < 2 || experts.size() > kMaxDuelExperts)
      return InvalidArgument(
          fmt::format("policy '{}': {} experts; a duel takes 2 to {}", name, experts.size(), kMaxDuelExperts));
    std::vector<std::unique_ptr<EvictionPolicy>> real, shadow;
    for (const std::string_view expert : experts)
      for (auto* side : {&real, &shadow}) {
        auto made = make_policy(expert, capacity);
        if (!made.ok())
          return Status(made.status().code(), fmt::format("policy '{}': {}", name, made.status().message()));
        side->push_back(std::move(made).value());
      }
    return std::unique_ptr<EvictionPolicy>(
        new DuelingPolicy(std::string(name), std::move(real), std::move(shadow), capacity));
  }
  if (name.substr(0, 4) == "lrfu") {
    double boost = kDefaultLrfuBoost;
    if (name.size() > 4) {
      if (name[4] != ':') return InvalidArgument(fmt::format("unknown eviction policy '{}'", name));
      std::string arg(name.substr(5));
      char* end = nullptr;
      boost = std::strtod(arg.c_str(), &end);
      // At most a billion admissions: priorities (last access + boost x half-octaves of uses) stay exact in a
      // double; an infinite boost made every class's priority inf or NaN, and the order ties broken by depth.
      constexpr double kMaxBoost = 1e9;
      if (arg.empty() || end == nullptr || *end != '\0' || !(boost >= 0) || !(boost <= kMaxBoost))
        return InvalidArgument(
            fmt::format("policy '{}': boost '{}' is not a number in [0, {:g}] (admissions)", name, arg, kMaxBoost));
    }
    return std::unique_ptr<EvictionPolicy>(new LrfuPolicy(boost, capacity));
  }
  return InvalidArgument(fmt::format(
      "unknown eviction policy '{}' (known: adaptive, lru, s3fifo, sieve, arc, lrfu[:boost], duel:A+B[+...], belady)",
      name));
}

}  // namespace kvtier::cache
