// Eviction policies of one tier of the prefix index.
//
// A policy orders the copies resident in its tier; the CacheManager decides
// what may go (leaf of its tier, unpinned, not in flight) and passes that as
// the `evictable` predicate of victim(). A policy never evicts by itself.
//
// To keep parents behind their children in recency order, the manager reports
// the accesses of a path deepest block first, and inserts of a new chain
// deepest first; so recency-ordered policies meet a leaf before its parent.
//
// Policies (make_policy names):
//   lru        least recently used (intrusive list, O(1); victim() walks past non-evictable nodes, once past a
//              blocked one: set_blocked).
//              With the manager's leaf-only predicate this is leaf-first LRU, the order in which vLLM
//              (free-block queue, a request's blocks freed deepest first) and SGLang (radix tree, least
//              recently used evictable leaf) evict: accesses are reported deepest first, so a parent is
//              never older than its children, and only leaves may go.
//   s3fifo     S3-FIFO (Yang et al., SOSP'23): small FIFO (10%), main FIFO with 2-bit frequency,
//              ghost FIFO of keys evicted from small; scan resistant.
//   sieve      SIEVE (Zhang et al., NSDI'24): FIFO queue, a visited bit per entry, and a hand moving from
//              tail to head that clears visited bits and takes the first unvisited evictable entry; a
//              hit only sets the bit. O(1) amortized; the hand keeps its place between calls.
//   arc        ARC (Megiddo & Modha, FAST'03): T1/T2 with ghosts B1/B2 and adaptive target p.
//   lrfu[:b]   recency-frequency: priority = last access time + b * log2(uses), time in admissions,
//              uses = AccessInfo::hit_count + 1 (counted per key across residencies); O(1) per operation
//              (b defaults to kDefaultLrfuBoost); evicts the lowest priority, deeper first on ties.
//   duel:A+B[+...]  two to kMaxDuelExperts online policies of this list (lru, s3fifo, sieve, arc, lrfu[:b]) as
//              experts. Each orders the tier's resident copies (every insert, touch and erase goes to all), and each
//              also runs alone in a shadow cache of the tier's capacity over the same accesses (keys only), counting
//              the hits it would have had; victim() asks the expert whose shadow hit most over about the last
//              10 x capacity accesses (exponentially decayed), and no other before that many accesses. So the tier
//              follows whichever expert suits the traffic of the moment: on Mooncake's conversation trace lrfu (long
//              reuse of blocks seen before), on its synthetic trace arc (recency, short reuse of hot blocks), where
//              each alone loses to the other by up to 30 %, on sessions whose context grows every turn lru
//              (docs/performance.md, "One policy for every trace").
//              From 8,192 blocks the shadows follow a spatial sample of the keys (1 in 2^k, capacity scaled alike,
//              4,096-8,191 keys). Cost per access: every expert's order, and for a sampled key a probe and the
//              expert's bookkeeping per shadow; memory: each expert's order of the tier, plus under a MiB per shadow.
//              Shadows see blocks one by one (no prefix or leaf rule), which ranks experts, not hit ratios.
//   adaptive   duel:lrfu+arc+lru (kAdaptiveExperts): the CacheManager's default device policy.
//   belady     offline optimum: evicts the block whose next use (from an oracle) is farthest, deeper
//              first on ties. Needs CacheConfig::next_use_oracle.
//
// Thread-safety: none; owned and serialized by the CacheManager.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvtier/cache/block_key.h"
#include "kvtier/core/status.h"

namespace kvtier::cache {

using NodeId = std::uint32_t;
inline constexpr NodeId kNoNode = 0xFFFFFFFFu;

// Non-owning callable reference (the predicate lives on the caller's stack).
template <typename Sig>
class FunctionRef;
template <typename R, typename... A>
class FunctionRef<R(A...)> {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef>>>
  FunctionRef(F&& f) noexcept  // NOLINT
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, A... a) -> R { return (*static_cast<std::remove_reference_t<F>*>(o))(a...); }) {}
  R operator()(A... a) const { return call_(obj_, a...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

struct AccessInfo {
  std::uint64_t now = 0;          // logical clock: admissions so far
  const BlockKey* key = nullptr;  // the block's key (ghost lists, oracle)
  std::uint32_t depth = 0;        // 1 for a request's first block
  // Uses so far, minus one. The CacheManager counts them per key across residencies (a bounded
  // history), clamped so that a block never counts more than its parent: priorities derived from
  // (now, hit_count) then never rank a parent below its child.
  std::uint32_t hit_count = 0;
  // False when the copy (re-)enters the tier's policy without a request using it now: protection by an
  // announcement ended (CacheManager::withdraw), so the copy is tracked again. Policies that learn from the access
  // stream (duel's shadows) skip it; orderings treat it as an insert.
  bool accessed = true;
};

// Next use of a block after logical time `now` (UINT64_MAX: never).
using NextUseOracle = std::function<std::uint64_t(const BlockKey& key, std::uint64_t now)>;

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string name() const = 0;
  // A copy became resident in this tier.
  virtual void insert(NodeId n, const AccessInfo& info) = 0;
  // The resident copy was hit.
  virtual void touch(NodeId n, const AccessInfo& info) = 0;
  // The copy left the tier (evicted, dropped, invalidated). No-op if not tracked.
  virtual void erase(NodeId n) = 0;
  // The next victim among tracked nodes with evictable(n), kNoNode if none. Does not erase it.
  virtual NodeId victim(FunctionRef<bool(NodeId)> evictable) = 0;
  // A hint from the caller: until set_blocked(n, false), every evictable predicate it passes rejects the tracked
  // copy n (the CacheManager blocks a device copy while it has children on the device: only leaves may go). A
  // policy may leave blocked copies out of its victim() walk, but must return the same victim it would have found
  // walking past them, and keep a blocked copy's place in its order (touch() and erase() work as usual). The
  // default ignores the hint. Without it, a walk passes every parent whose children are still resident, on every
  // call: ARC's second list fills with shared prefixes whose requests' own blocks sit in its first. An untracked
  // copy that insert() adds starts unblocked. No-op for an untracked n.
  virtual void set_blocked(NodeId n, bool blocked) {
    (void)n;
    (void)blocked;
  }
  virtual std::size_t size() const = 0;
  virtual bool contains(NodeId n) const = 0;

  // For a policy that follows one of several experts (duel:A+B..., adaptive): the expert whose order picks victims
  // now (its position in policy_experts(name()), 0 first) and how many times the lead has changed hands. Other
  // policies: {0, 0}. For operators: which policy the traffic favours, and whether it keeps changing its mind.
  struct Lead {
    std::uint32_t expert = 0;
    std::uint64_t switches = 0;
  };
  virtual Lead lead() const { return {}; }
};

inline constexpr double kDefaultLrfuBoost = 500.0;
// The experts of the "adaptive" policy, and the most a duel takes (each costs a shadow cache).
inline constexpr std::string_view kAdaptiveExperts = "lrfu+arc+lru";
inline constexpr std::size_t kMaxDuelExperts = 4;

// The policy a tier below the first takes when it follows the first tier's `policy` (kvtier replay's --policy): a
// duel's first expert ("adaptive": lrfu), since its shadows learn from the requests' accesses, which only the first
// tier sees (a host tier's inserts are demotions); any other policy itself. On the conversation trace with both
// tiers dueling, 4,000 device + 12,000 host blocks hit 0.2515 against 0.2699 with lrfu below.
std::string_view lower_tier_policy(std::string_view policy);

// The experts of a duel ("adaptive": lrfu, arc, lru; "duel:A+B": A, B), in order; any other policy: itself alone. Names
// are not checked (make_policy does).
std::vector<std::string_view> policy_experts(std::string_view policy);

// `capacity` is the tier's size in blocks (S3-FIFO and ARC size their queues by it).
Result<std::unique_ptr<EvictionPolicy>> make_policy(std::string_view name, std::uint32_t capacity,
                                                    NextUseOracle oracle = {});

}  // namespace kvtier::cache
