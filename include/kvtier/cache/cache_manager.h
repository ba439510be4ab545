// CacheManager: the scheduler-side brain of kvtier. It owns the block pools of
// every tier, the content-addressed prefix index, the eviction and write
// policies, and turns each scheduling step into a StepPlan of block moves that
// a PlanExecutor (the TransferManager, or a fake) carries out.
//
// Model. The index is a tree of blocks keyed by chained BlockKeys (one block
// per edge). A block may hold settled copies in several tiers (device, host,
// storage); its tier is the fastest one. Invariants (check_invariants()):
//   - along every root-to-leaf path tiers are ordered device, then host, then
//     storage; matches return ordered segments [device][host][storage];
//   - only leaves of a tier are evicted from it (a block whose children all
//     sit in slower tiers), so no subtree is ever orphaned;
//   - a block in flight (loading, evicting, fetching, demoting) is never
//     returned by a match; its state changes only with the executor's ack;
//   - a host block is freed only once no transfer reads it; a device block
//     given up by an eviction may be reused by the same plan's loads and the
//     step's forward pass: the executor must order a plan's evictions before
//     them (StepPlan contract);
//   - every reference an Admission takes is released by release().
// A failed eviction ack turns the block and its subtree into misses (recompute),
// never into served garbage; a failed backup just drops the copy. A failed load
// turns the block's device copy, and those below it, into misses for the
// admissions waiting on them (admission_status().failed: recompute); the host
// and storage copies it read from, and those below it, stay indexed (the load
// only read them) unless a load of that host copy failed before without one
// succeeding since: then the block and its subtree become misses.
// (One failure may be the copy's; two in a row say the bytes may be bad, and
// dropping them bounds what bad bytes cost to one more failed load.)
//
// Flow per step: admit() each scheduled request (match + pin + allocate +
// queue loads/evictions) -> take_plan() -> executor -> ack_*() -> after the
// forward pass commit() the computed blocks -> release() at request end.
//
// P/D receives (a decode instance receiving a prompt's KV from a prefill
// peer). admit_receive() allocates like admit() and marks the blocks the peer
// writes as receiving: they are never indexed, so never matched, never
// evicted, never planned as a load or eviction source, and never returned to
// the pool while a byte may still land in them. commit() of a receiving
// position is FailedPrecondition (a block being received is never reported
// loaded). complete_receive(id, loaded, reclaimable) ends the receive: the
// first `loaded` positions (the peer's leading_loaded_blocks()) join the index
// as commit() would join them, with or without `reclaimable` (each of their
// layers was verified after its write landed, and the peer writes a (block,
// layer) once, so no late write targets them); the rest hold no valid data.
// With `reclaimable` (no byte of the peer can still land) they are plain
// blocks of the admission again (recompute into them and commit(), or
// release()).
// Without it they are quarantined: not committable, and release() keeps them
// out of the pool until ack_receive_reclaimable(id). release() of an
// admission still receiving quarantines all its receive blocks (fail closed:
// it cannot know whether the peer stopped writing). reset() refuses while
// blocks are quarantined. The engine ties this to the data plane: it declares
// the same blocks to its TransferManager (begin_external_write) for as long
// as the peer may write them (docs/architecture.md, "P/D receives").
//
// Look-ahead (announce(), see "Look-ahead" below CacheConfig): the engine
// tells the cache which requests wait in its queue (their key chains) and
// which left it; their indexed blocks are kept over others and prefetched to
// faster tiers by take_plan(), within a budget.
//
// Thread-safety: none; one scheduler thread drives a CacheManager.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvtier/backend/eviction_policy.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/cache/block_pool.h"
#include "kvtier/core/status.h"
#include "kvtier/metrics/kv_events.h"
#include "kvtier/metrics/registry.h"

namespace kvtier::cache {

enum class Tier : std::uint8_t { kDevice = 0, kHost = 1, kStorage = 2 };
inline constexpr int kNumTiers = 3;
std::string_view tier_name(Tier tier) noexcept;

enum class WritePolicy : std::uint8_t {
  kWriteThrough,           // every committed block is backed up to host at once
  kWriteThroughSelective,  // backed up once its hit count reaches write_through_threshold
  kWriteBack,              // copied to host only when evicted from the device
};
// With a storage tier the same policy applies one level down: write-through (and selective, once the
// hit threshold is reached) also writes every block that settles on host to storage (state "storing",
// the host copy stays servable except for loads: match() treats a host-only storing block as in
// flight). Write-back writes a host copy to storage before giving up its block whenever it is the
// block's last copy ("dirty"): through the host watermarks, and also under pressure, when the host
// tier is full and a block is wanted now (a device eviction, a prefetch). Under pressure a clean host
// copy (also in storage, or also on device) among the policy's next 64 candidates is dropped first;
// otherwise the policy's first dirty victim is demoted ("demoting": held, unservable, freed only at
// the write's ack) and no host block is had this step: the device eviction then drops a device copy
// that is also on host, else the last copy of a droppable device victim; a device victim with
// children on host cannot be dropped, so admit() may fail (ResourceExhausted) until the acks free
// host blocks. A failed demotion never leaves a storage copy: the block stays on host (unless its parent
// went to storage meanwhile: then it and its subtree become misses), and the next pressure eviction
// drops it rather than retry the write. A dirty host copy is also dropped when storage can take
// nothing (every slot pinned or in flight). Write-through and selective drop host copies under
// pressure, as before; so does every policy without a storage tier.

std::string_view write_policy_name(WritePolicy policy) noexcept;
Result<WritePolicy> parse_write_policy(std::string_view name);

struct Watermarks {
  // When the free fraction of a tier falls below `low`, take_plan() evicts
  // until `high` is free (device: to host; host: to storage or dropped).
  // 0/0 disables proactive eviction.
  double low = 0.0;
  double high = 0.0;
};

struct CacheConfig {
  std::uint32_t device_blocks = 0;   // required >= 1
  std::uint32_t host_blocks = 0;     // 0: no host tier
  std::uint32_t storage_blocks = 0;  // 0: no storage tier; needs host_blocks > 0 (written from host blocks)
  std::string device_policy =
      "adaptive";  // lrfu, arc and lru dueling: docs/performance.md, "One policy for every trace"
  std::string host_policy = "lru";
  std::string storage_policy = "lru";
  WritePolicy write_policy = WritePolicy::kWriteBack;
  std::uint32_t write_through_threshold = 2;  // hits, for kWriteThroughSelective
  Watermarks device_watermarks;
  Watermarks host_watermarks;
  // Host blocks for an eviction batch are taken as one contiguous run when one exists.
  bool contiguous_host_runs = true;
  // Only for the offline "belady" policy (replay).
  NextUseOracle next_use_oracle;
  // Look-ahead (announce()). Moves take_plan() queues per call to bring announced blocks to a faster tier
  // (storage -> host, host -> device, together); 0: no prefetch (announced blocks are still protected).
  std::uint32_t lookahead_prefetch_blocks = 64;
  // Prefetch fills a tier only while its protected copies (resident copies of announced blocks) plus the
  // look-ahead moves in flight to it stay below this fraction of its capacity; 0: no prefetch.
  double lookahead_max_fraction = 0.25;
  // How long, in take_plan() calls, a withdrawn request hinted Continuation::kContinues without a ttl_steps
  // keeps its chain protected.
  std::uint32_t lookahead_retain_steps = 512;
};

// ---- Look-ahead ----
// A request the engine has queued and not yet scheduled, announced with its key chain (announce()).
//
// Protection. Every indexed block whose key is in an active announcement's chain (the prefix of it that is
// cached: a chain's keys are indexed parent first) is protected: eviction, demotion and drops take
// unprotected victims first, whatever the tier's policy says, and the watermark evictions of take_plan() never
// take a protected copy. Protection is a preference, never a refusal: when admit() (or prefetch()) needs room
// and only protected copies can give it, the least important protected copy goes (lowest priority, then the
// latest announced, deeper first), so admit() succeeds exactly where it did without announcements
// (CacheStats::protected_evictions counts those). Blocks indexed after the announce (a key committed later)
// are protected from the moment they join the index; a block that leaves the index simply stops being
// protected. A protected copy sits outside its tier's policy until its protection ends, then re-enters it as
// just used.
//
// Prefetch. Each take_plan() walks the queued announcements by priority (higher first), then announce order,
// and queues, for the cached prefix of each chain, storage -> host fetches (StepPlan::storage_prefetches) and
// host -> device loads (StepPlan::loads) of blocks not yet admitted, at most lookahead_prefetch_blocks moves
// per call and only while the target tier's protected copies plus look-ahead moves in flight stay below
// lookahead_max_fraction of it. Room is made only from free blocks and unprotected, unpinned, settled
// victims: a prefetch never evicts a block pinned by an admission (a running request) nor a block of any
// announcement, so a later announcement never displaces an earlier one's blocks. The moves are acked like
// any other (ack_loads, ack_storage_prefetches); until then the blocks are in flight and match() stops at
// them (Admission::stopped_at_in_flight: admit a step later, or announce earlier). A prefetched copy nobody
// admits is an ordinary cached block. A failed prefetch load leaves the block on host, and the blocks below
// it that were loaded or are loading to the device go back to their host copies with it (those in flight
// when they ack); a pinned one leaves the index for its host copy (its admission recomputes), and only a
// block on the device alone becomes a miss with its subtree (a second failure in a row drops the copy). A
// failed storage fetch makes the block and its subtree misses, as for prefetch(); neither is ever served.
//
// Hints. Optional, and never able to do harm when wrong. `priority` orders prefetch and the last-resort
// eviction of protected blocks (a block's rank is the best rank of the announcements that referenced it since
// it was last unreferenced). `continuation` and `ttl_steps` decide what happens at withdraw(): by default
// protection ends there; a request hinted kContinues, or given ttl_steps > 0 (a tool call's context), keeps
// its chain protected (not prefetched) for ttl_steps take_plan() calls (kContinues without ttl_steps:
// CacheConfig::lookahead_retain_steps), or until a new announcement of the same `conversation_id` (non-zero)
// takes over; kLastTurn never retains (ttl_steps is ignored). A conversation that ends anyway loses only the
// retention when it expires, one that returns after kLastTurn is an ordinary hit or miss: expiry drops
// protection, never data.
using QueuedId = std::uint64_t;

enum class Continuation : std::uint8_t {
  kUnknown,    // nothing known: protection ends at withdraw() unless ttl_steps says otherwise
  kContinues,  // the conversation comes back: keep the chain protected a while after withdraw()
  kLastTurn,   // its last turn: protection ends at withdraw(), whatever ttl_steps says
};
std::string_view continuation_name(Continuation c) noexcept;

struct RequestHints {
  std::uint64_t conversation_id = 0;  // 0: none
  Continuation continuation = Continuation::kUnknown;
  std::uint32_t ttl_steps = 0;  // protection kept after withdraw(), in take_plan() calls; 0: see Continuation
  std::int32_t priority = 0;    // higher: prefetched first, its protected blocks evicted last
};

// An announcement as the cache holds it (announcement()).
struct AnnouncementInfo {
  RequestHints hints;
  std::uint32_t keys = 0;
  bool queued = false;               // false: withdrawn, its chain retained (protected) until expiry
  std::uint32_t retained_steps = 0;  // take_plan() calls left of the retention (queued: 0)
};

// Index memory a CacheManager of `config` needs at most (nodes, key index, owners, policy state per
// block of every tier); create() refuses a config whose index would not fit in physical memory.
std::uint64_t index_memory_bytes(const CacheConfig& config) noexcept;
// Physical memory of this machine (sysconf); UINT64_MAX when it cannot be told.
std::uint64_t physical_memory_bytes() noexcept;

// One block move. `key` names the block (storage objects are keyed by it).
struct BlockMove {
  BlockId src = kNoBlock;
  BlockId dst = kNoBlock;
  BlockKey key;
};

// The moves of one scheduling step. Contract for the executor: evictions
// (D2H) complete, or are ordered on the device, before the loads (H2D) of the
// same plan and before the step's forward pass writes any device block.
// Backups (D2H, the device copy stays) may overlap anything. Storage writes
// read host blocks; storage prefetches write host blocks.
struct StepPlan {
  std::vector<BlockMove> evictions;           // device -> host, device copy given up
  std::vector<BlockMove> backups;             // device -> host, device copy kept
  std::vector<BlockMove> loads;               // host -> device
  std::vector<BlockMove> storage_writes;      // host -> storage slot (dst = storage slot id)
  std::vector<BlockMove> storage_prefetches;  // storage slot -> host
  // Storage slots the cache gave up (src = the slot, dst = kNoBlock, key): the tier no longer holds the key, so
  // its object may be deleted from the backend (StoragePlanExecutor does), which keeps the backend's use within
  // storage_blocks objects; an executor that shares the backend with other caches may keep them instead. Not
  // acknowledged. A later write of the same key in this or a later plan must land after the delete.
  std::vector<BlockMove> storage_drops;
  bool empty() const noexcept {
    return evictions.empty() && backups.empty() && loads.empty() && storage_writes.empty() &&
           storage_prefetches.empty() && storage_drops.empty();
  }
  // The moves to acknowledge (storage_drops are not).
  std::size_t size() const noexcept {
    return evictions.size() + backups.size() + loads.size() + storage_writes.size() + storage_prefetches.size();
  }
};

// Longest-prefix match: ordered segments, then why it stopped.
struct MatchResult {
  std::uint32_t device_blocks = 0;    // keys[0 .. device_blocks) settled on device
  std::uint32_t host_blocks = 0;      // next host_blocks keys on host
  std::uint32_t storage_blocks = 0;   // next storage_blocks keys in storage
  bool stopped_at_in_flight = false;  // the next key is in flight: retry next step rather than recompute
  std::vector<BlockId> device_ids, host_ids, storage_ids;
  std::uint32_t total() const noexcept { return device_blocks + host_blocks + storage_blocks; }
};

using AdmissionId = std::uint64_t;
// admit()'s default `max_hit_blocks`: serve the whole servable prefix.
inline constexpr std::uint32_t kNoHitLimit = 0xFFFFFFFFu;

// A P/D receive admission (admit_receive()).
struct ReceiveOptions {
  // Unkeyed blocks after the keys, as admit()'s `extra_blocks` (the prompt's partial tail, decode space).
  std::uint32_t extra_blocks = 0;
  // Of the extra blocks, how many leading ones the peer also writes (the prompt's partial tail block): they are
  // receive destinations too (guarded, quarantined on a failed receive), but never indexed.
  std::uint32_t received_extra_blocks = 0;
  // false: every key is received into a fresh block (the peer sends the whole prompt). true: the servable
  // prefix is served and loaded as admit() does, and only the keys after it are received (the peer must then
  // send only those: Admission::receive_begin tells where they start).
  bool match_prefix = false;
};

struct Admission {
  AdmissionId id = 0;
  std::uint32_t device_hit_blocks = 0;   // served from device
  std::uint32_t host_hit_blocks = 0;     // loaded host -> device by this step's plan
  std::uint32_t storage_hit_blocks = 0;  // present in storage only: recomputed here (see prefetch())
  std::uint32_t new_blocks = 0;          // keyed blocks to compute
  std::uint32_t extra_blocks = 0;        // unkeyed blocks (partial tail, decode space)
  bool stopped_at_in_flight = false;
  // Device block of every position: keys, then extra blocks.
  std::vector<BlockId> device_blocks;
  // admit_receive(): device_blocks[receive_begin, receive_begin + receive_blocks) are the blocks the peer writes,
  // in the order of its block list (keys first, then the received extra blocks). 0 blocks for admit().
  std::uint32_t receive_begin = 0;
  std::uint32_t receive_blocks = 0;
};

// Where an admission's loads stand.
struct AdmissionStatus {
  std::uint32_t ready_blocks = 0;  // leading blocks whose data is on device
  std::uint32_t loading_blocks = 0;
  bool failed = false;                   // a load failed: release() and recompute
  std::uint32_t receiving_blocks = 0;    // receive blocks a peer is writing (before complete_receive)
  std::uint32_t quarantined_blocks = 0;  // receive blocks a peer may still write after a failed receive
};

struct TierStats {
  std::uint32_t capacity = 0;
  std::uint32_t used = 0;
  std::uint32_t resident = 0;  // settled copies indexed in this tier
  // The tier's eviction policy (EvictionPolicy::lead): for a duel, the expert whose order evicts now (its position in
  // policy_experts(policy)) and how many times the lead has changed hands; 0 and 0 for other policies.
  std::uint32_t policy_expert = 0;
  std::uint64_t policy_switches = 0;
};

struct CacheStats {
  std::array<TierStats, kNumTiers> tiers{};
  std::uint64_t nodes = 0;
  std::uint64_t admissions = 0, admission_failures = 0;
  std::uint64_t evictions_d2h = 0, drops_device = 0, backups_d2h = 0, loads_h2d = 0;
  std::uint64_t drops_host = 0, storage_writes = 0, storage_prefetches = 0, drops_storage = 0;
  std::uint64_t lost_host_drops = 0;     // host drops of a block's last copy (of drops_host)
  std::uint64_t pressure_demotions = 0;  // write-back demotions for a host block wanted now (of storage_writes)
  std::uint64_t failed_transfers = 0, invalidated_blocks = 0;
  // Of successful admissions: keys looked up, and those found per tier (device: served; host: loaded by the
  // plan; storage: present in storage only, prefetched or recomputed by the caller).
  std::uint64_t lookup_blocks = 0;
  std::array<std::uint64_t, kNumTiers> hit_blocks{};
  std::uint64_t resets = 0;  // reset() calls that cleared the index
  // P/D receives: receive blocks admitted, reported loaded by complete_receive(), of those the ones that joined
  // the index, and receive blocks that went into quarantine (a failed receive without `reclaimable`, or an
  // admission released while receiving).
  std::uint64_t received_blocks = 0, received_loaded_blocks = 0, received_committed_blocks = 0;
  std::uint64_t quarantined_blocks = 0;
  // Now: device blocks a peer is writing, and quarantined device blocks (in no pool until acknowledged reclaimable).
  std::uint32_t receiving_device_blocks = 0, quarantined_device_blocks = 0;
  // Look-ahead, now: announcements queued and withdrawn-but-retained, and protected copies per tier (resident
  // copies of announced blocks; included in TierStats::resident).
  std::uint32_t queued_requests = 0, retained_requests = 0;
  std::array<std::uint32_t, kNumTiers> protected_blocks{};
  // Look-ahead counters: moves take_plan() queued for announced blocks (also counted in loads_h2d and
  // storage_prefetches), and copies of protected blocks given up because nothing unprotected could go.
  std::uint64_t lookahead_loads = 0, lookahead_fetches = 0, protected_evictions = 0;
};

class CacheManager {
 public:
  static Result<std::unique_ptr<CacheManager>> create(CacheConfig config);
  ~CacheManager();
  CacheManager(const CacheManager&) = delete;
  CacheManager& operator=(const CacheManager&) = delete;

  const CacheConfig& config() const noexcept { return config_; }

  // Longest prefix of `keys` servable now. No side effects.
  MatchResult match(std::span<const BlockKey> keys) const;

  // Matches, pins the matched blocks, allocates device blocks for host hits
  // (queued as loads), for the keys to compute and for `extra_blocks`
  // unkeyed blocks, evicting as needed. `keys` must be a hash chain (one
  // request's keys in order): a repeated key, or a key indexed below another
  // block than the previous key, is InvalidArgument (nothing changed).
  // ResourceExhausted when free plus evictable device blocks (settled,
  // unpinned, nothing pinned or in flight below them) are fewer than needed:
  // checked before anything is evicted, so the index, the pools and the
  // policies are as they were. Otherwise evictions run and succeed, except
  // when the evictable blocks must move to a host tier that has no block now
  // (every host block pinned or in flight, or, write-back with a storage
  // tier, being written to storage: CacheStats::pressure_demotions grew);
  // then the evictions and demotions queued so far stay queued (blocks moved
  // down a tier, or dropped) and a retry after the plan's acks can succeed.
  // `max_hit_blocks` caps the served prefix: keys past it get fresh blocks to
  // compute into even when cached (the Admission counts them as new), for a
  // caller whose forward pass starts earlier than this cache could serve
  // (a hybrid model whose other KV groups served less: hybrid_cache.h).
  // `hold`: other indexed keys whose copies this call's evictions must leave in place, as if pinned for its
  // duration (a caller that admits several root-level entries one call at a time, such as a hybrid window's
  // host hits: without it, a block demoted for the first could drop the host copy of the next). Where a demotion
  // finds no other host block, the device victim is dropped instead, or the call is refused as above.
  Result<Admission> admit(std::span<const BlockKey> keys, std::uint32_t extra_blocks = 0,
                          std::uint32_t max_hit_blocks = kNoHitLimit, std::span<const BlockKey> hold = {});

  // After the forward pass: the first `num_computed` keys of the admission
  // hold data; the new ones join the index (still pinned by the admission).
  // A key computed while another copy appeared, or below a block that went
  // in flight, is not indexed; its block is freed by release(). Keys past the
  // hit are refused (FailedPrecondition) while a hit block is still loading:
  // ack the loads first (after a failed one, nothing past it is indexed).
  Status commit(AdmissionId id, std::uint32_t num_computed);
  Status commit_all(AdmissionId id);

  // Unpins; frees the admission's device blocks that did not join the index, except receive blocks that a peer
  // may still write (still receiving, or quarantined): those stay out of the pool until
  // ack_receive_reclaimable(id).
  Status release(AdmissionId id);

  // ---- P/D receives (see "P/D receives" above) ----
  // As admit(keys, options.extra_blocks) (same checks, same errors, same transactional refusal), and marks the
  // receive blocks (Admission::receive_begin / receive_blocks). InvalidArgument when received_extra_blocks >
  // extra_blocks.
  Result<Admission> admit_receive(std::span<const BlockKey> keys, const ReceiveOptions& options = {});
  // Ends the receive of admission `id`: the first `loaded_blocks` receive blocks hold verified data (keyed ones
  // join the index, pinned by the admission, like commit()); the others do not. `reclaimable`: no byte of the
  // peer can still land in any of them; otherwise the failed ones are quarantined. NotFound for an unknown
  // admission; FailedPrecondition when it is not receiving (admit(), or completed already, or released:
  // then its blocks are quarantined and only ack_receive_reclaimable applies); InvalidArgument when
  // loaded_blocks > receive_blocks.
  Status complete_receive(AdmissionId id, std::uint32_t loaded_blocks, bool reclaimable);
  // No byte of the peer can land in admission `id`'s quarantined blocks any more: if the admission is open they
  // become plain blocks of it (recompute and commit()), if it was released they return to the pool.
  // FailedPrecondition when it holds no quarantined block (still receiving: complete_receive first); NotFound
  // for an unknown id.
  Status ack_receive_reclaimable(AdmissionId id);

  Result<AdmissionStatus> admission_status(AdmissionId id) const;

  // Storage segment -> host (fetches queued in the next plan); returns the number of blocks queued.
  // Write-back: when the host tier has no block now it queues demotions of dirty host blocks for
  // the rest of the segment (CacheStats::pressure_demotions grows): call again after their acks.
  Result<std::uint32_t> prefetch(std::span<const BlockKey> keys);

  // ---- Look-ahead (see "Look-ahead" above) ----
  // The engine queued a request whose full blocks have `keys` (a hash chain, as for admit(); it may be empty
  // and grow with extend_announced()). Its cached blocks are protected from now on and prefetched by
  // take_plan(). O(1) per key, plus O(log n) per protected resident copy. InvalidArgument (nothing changed)
  // when the keys are not a hash chain, naming the key.
  Result<QueuedId> announce(std::span<const BlockKey> keys, const RequestHints& hints = {});
  // Appends keys to a queued announcement's chain (tokens arrived). NotFound for an unknown id,
  // FailedPrecondition when it was withdrawn, InvalidArgument when the keys do not continue the chain: a key
  // repeated within more_keys, or indexed under another parent than the chain's last key. A new key equal to an
  // earlier key of the chain that is not indexed is not looked for (that would cost O(chain) per key); it is held
  // twice and released twice, which changes nothing else.
  Status extend_announced(QueuedId id, std::span<const BlockKey> more_keys);
  // The request left the queue (scheduled: call it before admit(), or cancelled). Protection ends, or, with
  // kContinues / ttl_steps, becomes a retention (see Hints). admit() does not depend on it: a request admitted
  // while still announced is served the same; its blocks just stay protected until the withdraw. NotFound for
  // an id never announced, FailedPrecondition for one already withdrawn (retained or expired). retain = false:
  // protection ends now whatever the hints said (an announcement taken back as if it had not been made, as
  // HybridCache does for the groups of an announcement another group refused).
  Status withdraw(QueuedId id, bool retain = true);
  // An announcement's state. NotFound for an id never announced; FailedPrecondition once withdrawn without
  // retention, or once its retention ended.
  Result<AnnouncementInfo> announcement(QueuedId id) const;

  // Moves queued since the last call, plus watermark evictions, plus look-ahead prefetches of announced
  // blocks; it also counts one step of every retention (RequestHints::ttl_steps).
  StepPlan take_plan();

  // Completion acknowledgements, by destination block id of each move take_plan() handed out: a block with no such
  // move in flight, or whose move is queued but not yet handed out, is FailedPrecondition and nothing changes.
  Status ack_evictions(std::span<const BlockId> host_blocks, const Status& status);
  Status ack_backups(std::span<const BlockId> host_blocks, const Status& status);
  Status ack_loads(std::span<const BlockId> device_blocks, const Status& status);
  Status ack_storage_writes(std::span<const BlockId> storage_slots, const Status& status);
  Status ack_storage_prefetches(std::span<const BlockId> host_blocks, const Status& status);
  // Acks every move of `plan` with `status`.
  Status ack_plan(const StepPlan& plan, const Status& status);

  CacheStats stats() const;
  // Device blocks that evictions could free now, whatever the policy: settled, unpinned device copies
  // with nothing pinned or in flight on the device below them (the bound admit() checks). O(1): kept up to
  // date on every change (check_invariants() compares it with a full recount).
  std::uint32_t reclaimable_device_blocks() const;
  // How many of `keys` name device copies counted in reclaimable_device_blocks() now (a request's own hits, which
  // admitting it pins: a caller checking room subtracts these, and only these). O(keys).
  std::uint32_t reclaimable_device_blocks_of(std::span<const BlockKey> keys) const;
  // Internal, O(nodes): tree links, tier order, in-flight bookkeeping, pool ownership, reference counts, the
  // count of reclaimable device blocks.
  Status check_invariants() const;

  // KV events (vLLM's schema, metrics/kv_events.h): from this call on, every settled copy that joins
  // the index is a BlockStored of its tier's medium (device GPU, host CPU, storage `storage_medium`),
  // every one that leaves it (dropped, evicted, invalidated) a BlockRemoved; copies already indexed are
  // announced at once. Consecutive blocks of one chain and medium share an event. `block_size` is the
  // tokens per block reported in BlockStored (token ids are not known here: empty). Off by default
  // (then no cost but one branch per index change). Calling it again with the same arguments changes nothing;
  // with another block size or medium it is FailedPrecondition (a consumer would see blocks stored on one medium
  // removed from another); block_size 0 is InvalidArgument.
  Status enable_kv_events(std::uint32_t block_size, metrics::Medium storage_medium = metrics::Medium::kDisk);
  // The events since the last call, in order (one step's batch).
  std::vector<metrics::KvEvent> take_events();
  // Puts events that take_events() returned back in front of any taken since, for a caller whose consumer refused
  // them (a full or closed publisher): the next take_events() returns them first, in their order. Events that
  // did not come from this manager's take_events() must not be returned (consumers would see changes that never
  // happened).
  void return_events(std::vector<metrics::KvEvent> events);
  struct CachedBlock {
    BlockKey key;
    Tier tier;
    friend bool operator==(const CachedBlock&, const CachedBlock&) = default;
  };
  // Every settled copy in the index, by (key, tier): what KV events describe. O(nodes).
  std::vector<CachedBlock> cached_blocks() const;

  // Forgets every cached block (vLLM's reset_prefix_cache): device and host blocks return to their pools, the
  // index and the policies start empty; every storage slot is given up, so the next take_plan() lists them all in
  // storage_drops (an executor deletes their objects, so none outlives the reset in the backend). With KV events
  // on, an AllBlocksCleared follows the events queued so far. Counters (stats()) keep counting.
  // FailedPrecondition, changing nothing, while an admission is open, a move is queued or in flight, or a
  // failed receive's blocks are quarantined (storage drops not taken yet do not count: they carry over).
  Status reset();

  // Metrics (metrics/registry.h): exports stats() into `registry`, every series carrying `labels`:
  //   kvtier_cache_lookup_blocks_total, kvtier_cache_hit_blocks_total{tier}, kvtier_cache_miss_blocks_total
  //   kvtier_cache_admissions_total, kvtier_cache_admission_refusals_total
  //   kvtier_cache_evictions_total{tier,policy,action=moved|dropped}, kvtier_cache_lost_host_drops_total
  //   kvtier_cache_moves_total{kind=load|evict|backup|storage_write|storage_prefetch|pressure_demotion}
  //   kvtier_cache_failed_transfers_total, kvtier_cache_invalidated_blocks_total, kvtier_cache_resets_total
  //   kvtier_cache_receive_blocks_total{outcome=admitted|loaded|committed|quarantined}
  //   kvtier_cache_receiving_blocks, kvtier_cache_quarantined_blocks   (gauges)
  //   kvtier_cache_pool_used_blocks{tier}, kvtier_cache_pool_capacity_blocks{tier},
  //   kvtier_cache_resident_blocks{tier}, kvtier_cache_index_blocks   (gauges)
  // The manager is single-threaded, so it pushes (lock-free atomics) rather than being read at scrape time:
  // every public call that changes state ends with an export when attached; a scrape from another thread
  // sees the values as of the last such call. The registry must outlive the manager. FailedPrecondition
  // when already attached; InvalidArgument for bad labels.
  Status attach_metrics(metrics::Registry& registry, const metrics::Labels& labels = {});

  struct Impl;
  struct MetricSeries;

 private:
  explicit CacheManager(CacheConfig config);
  static Status init_state(Impl& s, const CacheConfig& config);
  friend struct ExportOnReturn;
  void export_metrics();  // no-op unless attached
  CacheConfig config_;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<MetricSeries> metrics_;
};

}  // namespace kvtier::cache
