// HybridCache: the cache manager for hybrid models, whose requests hold several
// KV groups of different kinds: full attention, sliding-window attention (SWA,
// e.g. Gemma-style SWA + full layers) and recurrent state (Mamba / linear
// attention, e.g. Jamba, Qwen3-Next). Each group has its own kind, block size
// in tokens, and CacheManager (pools of every tier, index, policies, storage
// slots, KV events, metrics); HybridCache decides what a prefix hit is across
// them and keeps their admissions together.
//
// Keys. The caller passes, per group, the token chain of the request: one
// BlockKey per full block of that group's block size (KeyHasher::keys_for with
// KeyNamespace::block_tokens set to it). Each group stores
// group_block_key(chain key, group index, kind), so two groups never share a
// key (nor a storage object, nor a KV event hash) even at equal block sizes.
//   - full: block i under the group key of chain key i, as a chain in its
//     CacheManager (parent = block i - 1).
//   - sliding window: block i likewise, but every block is its own root-level
//     entry: a block does not need the blocks before it (they may have slid
//     out of the window and been evicted), and the chain key already names
//     the whole prefix it was computed after.
//   - state: the state after k blocks (k * block_tokens tokens) under the
//     group key of chain key k - 1, one "block" per saved boundary, each a
//     root-level entry.
//
// Hits. A prefix of h tokens is a hit only if every group serves it (a block
// counts as served when it is settled on device or host: host copies are
// loaded by the plan; storage-only copies are not served, as in CacheManager):
//   - full: every block of [0, h);
//   - sliding window (window W): the blocks overlapping [h - W + 1, h), what the
//     first recomputed token attends to besides itself (a token at p attends to
//     [p - W + 1, p], the sliding_window of Hugging Face's and vLLM's models);
//   - state: the state saved at h (h = 0 needs none: the zero state).
// h is a multiple of hit_granularity(), the lcm of every group's block size
// (a hit ends on a block boundary of every group: blocks are whole, states
// exist only at boundaries), at most num_tokens and max_hit_tokens. Because a
// window group need not serve every shorter prefix, the hit is the largest
// candidate all groups serve, not the minimum of what each serves alone.
//
// What each group holds for an admission (device blocks of its own pool):
//   - full: every block position of [0, ceil((num_tokens + extra_tokens) / B)):
//     the hit ones served (pinned, loaded from host by the plan), the keyed
//     rest fresh (computed, joined to the index by commit()), the partial tail
//     and decode space unkeyed. Hits are capped at the common hit: a block this
//     group holds past it is computed into a fresh block, never written over a
//     cached one that other requests read.
//   - sliding window: the positions from the window's start at the hit
//     (first_block) on; positions before it hold no block (kNoBlock: they are
//     neither matched, nor loaded, nor allocated). commit(id, n) releases the
//     blocks that no later token's window reaches (those ending at or before
//     n - W + 1): unpinned, still indexed, so a later request whose hit falls
//     within a window of them can use them until the eviction policy takes them.
//   - state: the state at the hit (state_in, loaded if on host), one fresh
//     block per boundary the forward saves (state_saves: every entry of
//     save_states_at past the hit, by default only the last multiple of
//     hit_granularity() at or before num_tokens), and one unkeyed working block for the running
//     state (state_work, never indexed: it changes at every token). commit(id, n)
//     indexes the saves at or before n and unpins them (the request does not
//     read them again), and unpins state_in once n passes the hit.
// A request prefilled in chunks keeps only a window of SWA blocks if each
// chunk is admitted on its own (admit the next chunk, whose hit is the last
// one's commit, then release the last one).
//
// admit() is all or nothing: it validates, matches every group and checks that
// each group's pool can give its blocks (free plus evictable, the blocks this
// request pins excluded) before it admits anything; a refusal there changes
// nothing in any group. Within a group, served blocks are pinned before fresh
// ones are allocated, so the request's own evictions never take a block it is
// about to serve. A group whose admission still fails afterwards (the host
// tier has no block for an eviction now, see CacheManager::admit:
// ResourceExhausted, retry after the plan's acks; or its index rejects the
// chain: InvalidArgument) gets the groups and blocks admitted so far released
// (their queued evictions stay queued, as CacheManager's own refusal leaves
// them), and the call returns that error naming the group.
//
// Plans. take_plan() returns one StepPlan per group (HybridPlan::groups[g]),
// in that group's block ids: each group has its own device and host regions
// (its blocks have their own size), so each group's plan goes to the executor
// over that group's memory (HybridPlanExecutor holds one per group). Acks go to
// the group they came from: ack_plan(group, ...), apply_completions() of
// GroupCompletions. Storage objects are named by the group's keys, so the
// groups' storage executors may share one backend.
//
// Events and metrics: per group. take_events() returns each group's KV events
// with its group index (GroupEvent); attach_metrics() exports every group's
// CacheManager series with the label kv_group="<group name>". A group's
// admission counters count its CacheManager admissions: one per block for
// sliding-window and state groups.
//
// Errors: Status / Result, never an exception or an abort. Bad configs and
// requests (no group, a block size of 0, a window of 0, a chain whose length
// does not match num_tokens, a save point off a block boundary, an unknown
// group or admission) are InvalidArgument / OutOfRange / NotFound naming the
// value.
//
// Thread-safety: none; one scheduler thread drives a HybridCache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/status.h"
#include "kvtier/metrics/kv_events.h"
#include "kvtier/metrics/registry.h"

namespace kvtier::cache {

enum class GroupKind : std::uint8_t { kFull = 0, kSlidingWindow = 1, kState = 2 };
std::string_view group_kind_name(GroupKind kind) noexcept;  // "full", "sliding_window", "state"

inline constexpr std::uint32_t kNoGroup = 0xFFFFFFFFu;

struct KvGroupConfig {
  std::string name;                   // unique, non-empty: messages and the kv_group metrics label
  GroupKind kind = GroupKind::kFull;  // what the group keeps: blocks of every token, a window of them, a state
  std::uint32_t block_tokens = 0;     // tokens per block (state: tokens between boundaries); >= 1
  std::uint32_t window_tokens = 0;  // kSlidingWindow: the model's sliding_window (a token attends to this many, itself
                                    // included), >= 1; otherwise 0
  CacheConfig cache;                // this group's pools, policies, write policy
};

struct HybridConfig {
  std::vector<KvGroupConfig> groups;  // >= 1; a group's index names it in keys, requests, plans and events
};

// The key group `group` of kind `kind` stores the block (state) named by `chain_key` under:
//   XXH3_128("kvtier.group.v1" (15 bytes) ‖ chain_key (16 bytes, canonical) ‖ u32 group ‖ u8 kind)
// (little-endian integers). Depends on bytes only, like BlockKey.
BlockKey group_block_key(const BlockKey& chain_key, std::uint32_t group, GroupKind kind) noexcept;

struct HybridRequest {
  // Tokens whose ids are known (the prompt so far). Keys cover their full blocks.
  std::uint32_t num_tokens = 0;
  // Per group: exactly num_tokens / block_tokens chain keys of that group's block size (KeyHasher::keys_for);
  // groups of equal block size may pass the same span. The spans must outlive the call.
  std::vector<std::span<const BlockKey>> chains;
  // Room for tokens still to come (decode): unkeyed blocks in full and sliding-window groups.
  std::uint32_t extra_tokens = 0;
  // Upper bound of the hit, e.g. num_tokens - 1 to recompute the last prompt token for its logits.
  std::uint32_t max_hit_tokens = kNoHitLimit;
  // State groups: token counts (each a multiple of hit_granularity(), where a hit can end; increasing, at most
  // num_tokens) after which the forward saves the state, e.g. the ends of prefill chunks. Points at or before
  // the hit are skipped. Empty: the last multiple of hit_granularity() at or before num_tokens.
  std::vector<std::uint32_t> save_states_at;
};

struct GroupMatch {
  // The longest hit (a multiple of hit_granularity()) this group could serve by itself, within the request's
  // limit.
  std::uint32_t alone_hit_tokens = 0;
  // A block (state) this group needs for a longer hit is in flight.
  bool in_flight = false;
};

struct HybridMatch {
  std::uint32_t hit_tokens = 0;
  // The group whose alone hit is the smallest, when it is below the request's limit (the weakest group);
  // kNoGroup when every group serves up to the limit.
  std::uint32_t limited_by = kNoGroup;
  // A longer hit waits only on blocks in flight: retry next step rather than recompute.
  bool stopped_at_in_flight = false;
  std::vector<GroupMatch> groups;
};

using HybridAdmissionId = std::uint64_t;
using HybridQueuedId = std::uint64_t;

struct StateSave {
  std::uint32_t tokens = 0;  // the state after this many tokens
  BlockId block = kNoBlock;  // is written here by the forward
};

struct GroupAdmission {
  std::uint32_t group = 0;
  GroupKind kind = GroupKind::kFull;
  // Full and sliding window: the device block of every block position [0, ceil((num_tokens + extra_tokens) /
  // block_tokens)); kNoBlock where the group holds none (a window's positions before first_block). Empty for a
  // state group.
  std::vector<BlockId> device_blocks;
  std::uint32_t first_block = 0;    // first position holding a block
  std::uint32_t hit_blocks = 0;     // positions (state: states) served
  std::uint32_t loaded_blocks = 0;  // of those, loaded host -> device by the plan
  std::uint32_t new_blocks = 0;     // keyed positions to compute (state: saved states)
  std::uint32_t extra_blocks = 0;   // unkeyed blocks (tail, decode space; state: the working block)
  // State groups.
  BlockId state_in = kNoBlock;  // the state at the hit (kNoBlock at hit 0: start from the zero state)
  std::vector<StateSave> state_saves;
  BlockId state_work = kNoBlock;
};

struct HybridAdmission {
  HybridAdmissionId id = 0;
  std::uint32_t hit_tokens = 0;
  std::uint32_t limited_by = kNoGroup;
  bool stopped_at_in_flight = false;
  std::vector<GroupAdmission> groups;  // one per group, in group order
};

struct HybridAdmissionStatus {
  bool ready = false;  // every served block of every group is on device
  std::uint32_t loading_blocks = 0;
  bool failed = false;  // a load failed: release() and recompute
  std::uint32_t failed_group = kNoGroup;
};

struct HybridPlan {
  std::vector<StepPlan> groups;  // one per group, in that group's block ids
  bool empty() const noexcept;
  std::size_t size() const noexcept;
};

struct GroupCompletion {
  std::uint32_t group = 0;
  Completion completion;
};

struct GroupEvent {
  std::uint32_t group = 0;
  metrics::KvEvent event;
};

struct HybridStats {
  std::uint64_t admissions = 0;                     // admit() calls that admitted
  std::uint64_t refusals = 0;                       // admit() calls refused for want of blocks (nothing left admitted)
  std::uint64_t rollbacks = 0;                      // of the refusals, those that released groups already admitted
  std::uint64_t lookup_tokens = 0, hit_tokens = 0;  // of admissions: tokens looked up, tokens served
  std::vector<CacheStats> groups;
};

class HybridCache {
 public:
  // InvalidArgument naming the group and value for a bad group; a group's CacheManager::create errors with the
  // group named.
  static Result<std::unique_ptr<HybridCache>> create(HybridConfig config);
  ~HybridCache();
  HybridCache(const HybridCache&) = delete;
  HybridCache& operator=(const HybridCache&) = delete;

  const HybridConfig& config() const noexcept { return config_; }
  std::uint32_t num_groups() const noexcept { return static_cast<std::uint32_t>(config_.groups.size()); }
  // Hits are multiples of this: the lcm of the groups' block sizes.
  std::uint32_t hit_granularity() const noexcept { return granularity_; }

  // The common hit of `request` now, and what limits it. No side effects.
  Result<HybridMatch> match(const HybridRequest& request) const;

  // Matches, then admits every group or none (see the contract above).
  Result<HybridAdmission> admit(const HybridRequest& request);

  // After the forward pass: the first `num_computed_tokens` tokens hold data in every group (at most
  // num_tokens + extra_tokens; a smaller value than an earlier call changes nothing). Full and sliding-window
  // groups index their computed keyed blocks; windows slide; states at saved boundaries are indexed.
  // Tokens past the hit were computed on every group's hit bytes: FailedPrecondition while a hit block is still
  // loading (commit once admission_status() is ready), and after a failed load nothing more of the admission
  // is indexed (windows still slide; release() frees its blocks).
  Status commit(HybridAdmissionId id, std::uint32_t num_computed_tokens);
  // Unpins and frees whatever the admission still holds in every group.
  Status release(HybridAdmissionId id);
  Result<HybridAdmissionStatus> admission_status(HybridAdmissionId id) const;

  // ---- Look-ahead (CacheManager's "Look-ahead", per group) ----
  // The engine queued `request` (chains and limits as for admit(); extra_tokens and save_states_at unused).
  // Each group announces, to its CacheManager, what the largest hit the request can have (min(num_tokens,
  // max_hit_tokens) rounded down to hit_granularity()) would need from it: a full group its chain up to that
  // hit; a sliding-window group the blocks of the window before it, each on its own (they are root-level
  // entries); a state group the state at it. Those blocks are then protected and prefetched as CacheManager
  // protects and prefetches announced blocks; `hints` go to every group. A shorter hit may need other window
  // blocks or another state: they are simply not protected (a hint never does harm). All or nothing: a group
  // refusing withdraws what the groups before it announced and returns its error, naming the group.
  Result<HybridQueuedId> announce(const HybridRequest& request, const RequestHints& hints = {});
  // The request left the queue (scheduled: call it before admit(), or cancelled): every group's announcement
  // is withdrawn (CacheManager::withdraw: kContinues / ttl_steps become retentions). NotFound for an id never
  // announced, FailedPrecondition for one withdrawn already (as CacheManager::withdraw); a group's error names the
  // group (the other groups are still withdrawn).
  Status withdraw(HybridQueuedId id);
  // Announcements not yet withdrawn.
  std::size_t announced() const noexcept { return announced_.size(); }

  // Every group's moves queued since the last call (HybridPlan::groups[g] is group g's), with each group's
  // look-ahead prefetches.
  HybridPlan take_plan();
  // Acks every move of `plan` with `status`, each group's to its group.
  Status ack_plan(const HybridPlan& plan, const Status& status);
  Status ack_plan(std::uint32_t group, const StepPlan& plan, const Status& status);
  // Acks each completion on its group's CacheManager; OutOfRange for an unknown group (nothing acked), else
  // stops at the first ack error.
  Status apply_completions(std::span<const GroupCompletion> completions);

  HybridStats stats() const;
  // Every group's CacheManager::check_invariants(), and this layer's own bookkeeping (pins it counts per key
  // against the open admissions). O(nodes).
  Status check_invariants() const;
  // A group's CacheManager, read-only (stats, cached_blocks, check_invariants). OutOfRange for a bad index.
  Result<const CacheManager*> group_manager(std::uint32_t group) const;

  // KV events of every group (CacheManager::enable_kv_events with the group's block size; the same rules for a
  // second call).
  Status enable_kv_events(metrics::Medium storage_medium = metrics::Medium::kDisk);
  // The events since the last call: group 0's in order, then group 1's, ...
  std::vector<GroupEvent> take_events();
  // Every group's CacheManager::attach_metrics with `labels` plus kv_group="<name>". InvalidArgument when
  // `labels` has a kv_group label already.
  Status attach_metrics(metrics::Registry& registry, const metrics::Labels& labels = {});

  // CacheManager::reset() of every group. FailedPrecondition while an admission is open; a group refusing
  // (moves in flight) stops the call with that group named, the groups before it cleared (a cleared group only
  // turns hits into misses).
  Status reset();

  struct Sub;
  struct GroupRec;
  struct Rec;
  struct Plan;

 private:
  explicit HybridCache(HybridConfig config);
  Status validate(const HybridRequest& request) const;
  Result<Plan> plan(const HybridRequest& request) const;
  Status close(std::uint32_t group, GroupRec& gr, Sub& s);  // releases one CacheManager admission
  void release_subs(Rec& rec);
  void pin(std::uint32_t group, const BlockKey& key);
  void unpin(std::uint32_t group, const BlockKey& key);

  HybridConfig config_;
  std::uint32_t granularity_ = 1;
  std::vector<std::unique_ptr<CacheManager>> managers_;
  // Per group: how many open sub-admissions pin each key (hits, and keyed blocks once committed). admit()
  // uses it to tell which of its device hits free-plus-evictable counted as evictable.
  std::vector<std::unordered_map<BlockKey, std::uint32_t, BlockKeyHash>> pins_;
  std::unordered_map<HybridAdmissionId, std::unique_ptr<Rec>> admissions_;
  HybridAdmissionId next_id_ = 1;
  // Per announcement: each group's CacheManager announcements (group, id); a window group has one per block.
  std::unordered_map<HybridQueuedId, std::vector<std::pair<std::uint32_t, QueuedId>>> announced_;
  HybridQueuedId next_queued_ = 1;
  HybridStats stats_;
};

// One executor per group (each over that group's device and host memory, or a fake): execute() hands each
// group's plan to its executor, poll() gathers their completions tagged with the group.
class HybridPlanExecutor {
 public:
  // The executors must outlive this object; one per group (nullptr for a group whose plans are always empty:
  // execute() refuses a non-empty plan for it).
  explicit HybridPlanExecutor(std::vector<PlanExecutor*> executors) : executors_(std::move(executors)) {}
  // InvalidArgument when the plan has another group count, or a non-empty group plan has no executor; else
  // the first executor error, naming the group (groups before it were handed their plans).
  Status execute(const HybridPlan& plan);
  std::vector<GroupCompletion> poll();

 private:
  std::vector<PlanExecutor*> executors_;
};

}  // namespace kvtier::cache
