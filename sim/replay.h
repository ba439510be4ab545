// Trace replay: runs the CacheManager over a Mooncake-format request trace
// and reports hit ratios, prefill tokens saved, bytes moved, and the offline
// optimum (Belady) for the same capacity.
//
// Trace format (one JSON object per line): timestamp (ms), input_length,
// output_length, hash_ids (one id per block of the input; equal ids = equal
// prefix blocks). Requests are replayed in file order, one at a time, or, with
// ReplayOptions::queue_model, through a simulated serving queue (see "Queue model").
//
// Semantics per request: the keys are the chained keys of its hash_ids; by
// default only full blocks (input_length / block_tokens of them) are cacheable,
// as in a serving engine that never hashes a partial block; the partial tail is
// allocated as an unkeyed block. Hit = longest prefix present, device then
// host then storage; host hits are loaded (H2D) through the executor, storage
// hits are prefetched to host first (see ReplayOptions::storage); misses are computed
// and committed; the request is released at once (no overlap between
// requests), and every move its step planned (evictions, backups, loads,
// storage writes) lands before the next request is served, so a real
// executor gives the fake executor's hits whatever its threads' timing. Ratios: hit blocks / all blocks of the trace
// (partial included); saved tokens = min(hit blocks * block_tokens, input_length) / input tokens.
//
// Bounds (one tier of `capacity` blocks):
// - replay_min_bypass: MIN with bypass, the true offline optimum. After every
//   request it keeps the `capacity` blocks (cached before, or used or computed
//   by the request) whose next use is nearest, deeper blocks first out on
//   ties, and drops a block that is never used again at once. Capacity holds
//   after every request; a request's own working blocks are not counted.
// - replay_belady: the cache manager with the "belady" eviction policy (the
//   farthest next use out, deeper first on ties). It is MIN *without* bypass:
//   the manager keeps a request's blocks resident until the next request is
//   matched and needs room for that request's blocks at admission, so it is
//   below MIN with bypass at small capacities. It bounds what an eviction
//   policy can do inside the cache manager; replay_min_bypass bounds any
//   policy, admission included.
// - replay_class_ttl: what a policy that keeps blocks for a TTL per class of
//   use count and reuse distance reaches, in hindsight and cross-validated
//   (a reference for online policies, not a bound of every one; see below).
//
// Thread-safety: functions are reentrant; no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/core/status.h"
#include "kvtier/storage/storage_tier.h"
#include "kvtier/testing/plan_executors.h"

namespace kvtier::cache {

struct TraceRequest {
  std::uint64_t timestamp_ms = 0;
  std::uint64_t input_length = 0;   // tokens
  std::uint64_t output_length = 0;  // tokens (optional in the file: 0)
  std::vector<std::uint64_t> hash_ids;
  std::uint64_t line = 0;  // the file's line it was read from (1-based; 0: not read from a file)
};

// max_requests 0: all. Every field is an integer in 0..2^64-1 (output_length may be left out); errors
// name the file, the line, the field and its value. A path that is not a regular file is an error.
Result<std::vector<TraceRequest>> load_mooncake_trace(const std::string& path, std::size_t max_requests = 0);

// Real bytes for the host and storage tiers of a replay: a page-first host
// pool of `host_blocks` pages of `block_bytes` (4096-aligned, O_DIRECT-ready)
// and a StorageTier over a backend in namespace "kvtier-replay". The replay
// fills every host block a D2H move lands in with pattern(key) and verifies
// the bytes of every block prefetched from storage and of every host block a
// load reads, so a wrong, stale or corrupted block is counted, never silently
// served.
class ReplayStorage {
 public:
  using BackendFactory = std::function<Result<std::unique_ptr<storage::StorageBackend>>(storage::StorageOptions)>;
  static Result<std::unique_ptr<ReplayStorage>> create(const BackendFactory& make_backend, std::uint32_t host_blocks,
                                                       std::uint64_t block_bytes);
  // `spec` as make_storage_backend: disk:<dir>[?...] or redis://host:port[?...], over the storage knobs'
  // KVTIER_STORAGE_* variables (open_storage_backend).
  static Result<std::unique_ptr<ReplayStorage>> create(std::string_view spec, std::uint32_t host_blocks,
                                                       std::uint64_t block_bytes);
  // Three tiers with real bytes: the storage tier over an existing host space (the TransferManager's
  // host cache, TransferManager::host_space()), which must be pinned host memory, page-first, of one
  // plane (KvLayout::uniform(1, 1, block_bytes)) and outlive this object. Device<->host bytes are then
  // the ReplayOptions::executor's (a TransferPlanExecutor), and the host pages are checked against
  // TransferPlanExecutor::fill_key_pattern.
  static Result<std::unique_ptr<ReplayStorage>> create_over(const BackendFactory& make_backend, const BlockSpace& host);
  static Result<std::unique_ptr<ReplayStorage>> create_over(std::string_view spec, const BlockSpace& host);
  ~ReplayStorage();

  storage::StorageTier& tier() noexcept { return *tier_; }
  std::uint32_t host_blocks() const noexcept { return host_blocks_; }
  std::uint64_t block_bytes() const noexcept { return block_bytes_; }
  std::span<std::byte> host_block(std::uint64_t b) const;
  // Whether the host space is another component's (create_over): its bytes follow that pattern.
  bool shared_host() const noexcept { return !memory_; }

  // The deterministic bytes of block `key`.
  static void fill_pattern(const BlockKey& key, std::span<std::byte> out);
  static bool check_pattern(const BlockKey& key, std::span<const std::byte> bytes);

 private:
  ReplayStorage() = default;
  struct FreeDeleter {
    void operator()(void* p) const noexcept;
  };
  std::unique_ptr<void, FreeDeleter> memory_;
  std::unique_ptr<storage::StorageTier> tier_;
  BlockSpace host_;
  std::uint32_t host_blocks_ = 0;
  std::uint64_t block_bytes_ = 0;
};

inline constexpr std::uint64_t kDefaultReplayBlockBytes = 64ull << 20;  // 512 tokens of Llama-3-8B bf16 KV

struct ReplayResult;

struct ReplayOptions {
  std::uint32_t device_blocks = 4096;
  std::uint32_t host_blocks = 0;
  std::string policy = "adaptive";  // device and host tiers ("belady" needs the oracle: replay_belady)
  WritePolicy write_policy = WritePolicy::kWriteBack;
  std::uint32_t write_through_threshold = 2;
  std::uint32_t block_tokens = 512;
  bool cache_partial_blocks = false;
  std::uint64_t block_bytes = kDefaultReplayBlockBytes;
  double failure_rate = 0.0;  // injected transfer failures (fake executor)
  std::uint64_t seed = 1;
  PlanExecutor* executor = nullptr;          // null: a FakePlanExecutor (no bytes move)
  std::uint32_t check_invariants_every = 0;  // requests between CacheManager::check_invariants (tests)
  // Storage tier of storage_blocks (0: none). With `storage` set, host and storage moves carry real
  // bytes (its host_blocks must equal host_blocks, block_bytes its block size); without it, storage
  // moves go through the fake executor. When a request's prefix continues in storage, the replay
  // prefetches it to host, waits, then admits (host hits, loaded) instead of recomputing. Write-back:
  // when host room is being made by writing dirty host blocks to storage, the replay waits for those
  // writes, then prefetches the rest (up to 4 rounds) or retries a failed admission once.
  std::uint32_t storage_blocks = 0;
  ReplayStorage* storage = nullptr;
  // Host watermarks when storage_blocks > 0: write_back demotes host blocks to storage in the
  // background to keep this free fraction (write_through copies every block settling on host).
  double host_low_watermark = 0.05, host_high_watermark = 0.15;
  // CacheConfig knobs with no replay flag (kvtier replay takes them from KVTIER_CACHE_*).
  std::string host_policy;             // empty: `policy`, a duel's first expert for a duel (lower_tier_policy)
  std::string storage_policy = "lru";  // with storage_blocks > 0
  Watermarks device_watermarks;        // 0/0: no proactive device eviction
  bool contiguous_host_runs = true;
  // Called after every request with the running totals (bytes_d2h, bytes_h2d and failed_transfers
  // included) and once more with the final result: progress display and metrics export.
  std::function<void(const ReplayResult&, const CacheManager&)> on_request;
  // When set, the replay's cache manager is attached to it (CacheManager::attach_metrics).
  metrics::Registry* metrics = nullptr;
  metrics::Labels metrics_labels;
  // When set, KV events are on (CacheManager::enable_kv_events, block_tokens per block) and each
  // request's events (one step's batch; none when empty) are handed over after the request.
  std::function<void(std::vector<metrics::KvEvent>)> on_kv_events;
  metrics::Medium kv_events_storage_medium = metrics::Medium::kDisk;

  // ---- Queue model (see "Queue model" below) ----
  // Off: requests are served one after another in file order, none waits. On: a discrete-event
  // simulation of one serving instance, so queue depth follows load.
  bool queue_model = false;
  // Arrival-rate multiplier: request i arrives at (timestamp_i - timestamp_0) / load_factor ms (2: twice
  // the trace's rate). > 0.
  double load_factor = 1.0;
  // Service model. The defaults are model-level assumptions for a 7B model on one H200, not measurements:
  // uncached prompt tokens per second of prefill (cached tokens cost nothing), output tokens per second of
  // each decoding sequence, and the most requests running (prefilling or decoding) at once. All > 0.
  double prefill_tokens_per_s = 20000;
  double decode_tokens_per_s = 50;
  std::uint32_t max_batch = 64;
  // With queue_model: announce each request's key chain (CacheManager::announce) when it enters the
  // waiting queue and withdraw it just before its admission.
  bool lookahead = false;
  // The look-ahead's CacheConfig knobs (KVTIER_CACHE_LOOKAHEAD_*), passed to the replay's cache manager.
  std::uint32_t lookahead_prefetch_blocks = CacheConfig{}.lookahead_prefetch_blocks;
  double lookahead_max_fraction = CacheConfig{}.lookahead_max_fraction;
  std::uint32_t lookahead_retain_steps = CacheConfig{}.lookahead_retain_steps;
};

// Queue model (ReplayOptions::queue_model). Requests arrive at their scaled timestamps (ties in file order;
// arrival order is timestamp order, file order among equals) into one FIFO waiting queue. Whenever fewer
// than max_batch requests run, the head is admitted: the replay's usual admit / plan / ack / commit flow
// (its blocks are committed and released at admission, as without the queue model, so running requests pin
// nothing: capacity is the cache's alone). Its prefill then takes (input tokens not hit) /
// prefill_tokens_per_s, serialized in admission order on one prefill server (a request admitted while
// another prefills starts after it), then it decodes output_length tokens at decode_tokens_per_s and
// leaves, freeing its batch slot. Arrivals and completions at the same instant: completions first, then
// arrivals, then admissions. Deterministic: simulated time only, no wall clock.

struct ReplayResult {
  std::string policy;
  std::string host_policy;  // the host tier's policy (empty without a host tier)
  std::uint32_t device_blocks = 0, host_blocks = 0;
  std::uint64_t requests = 0, truncated_requests = 0, failed_admissions = 0;
  std::uint64_t total_blocks = 0, cacheable_blocks = 0;
  std::uint64_t device_hit_blocks = 0, host_hit_blocks = 0;
  std::uint64_t total_tokens = 0, device_hit_tokens = 0, host_hit_tokens = 0;
  std::uint64_t bytes_d2h = 0, bytes_h2d = 0;
  std::uint64_t failed_transfers = 0;
  // Storage tier: hits = blocks prefetched storage -> host and loaded for the request.
  std::uint32_t storage_blocks = 0;
  std::uint64_t storage_hit_blocks = 0, storage_hit_tokens = 0;
  std::uint64_t storage_writes = 0, storage_prefetches = 0, failed_prefetches = 0, failed_storage_writes = 0;
  std::uint64_t bytes_to_storage = 0, bytes_from_storage = 0;
  // With ReplayOptions::storage: blocks whose bytes were checked against their key's pattern
  // (prefetched blocks at their ack, host blocks read by loads), and those that did not match.
  std::uint64_t verified_blocks = 0, verification_failures = 0;
  double seconds = 0;
  // Queue model only: waiting-queue depth averaged over simulated time and its maximum after each
  // instant's admissions, the mean wait from arrival to admission, the simulated span (first arrival to
  // last completion), and requests announced (look-ahead).
  double mean_queue_depth = 0, mean_wait_s = 0, simulated_seconds = 0;
  std::uint64_t max_queue_depth = 0, announced_requests = 0;
  // The device tier's policy when it is a duel (policy_experts of `policy` has more than one): requests served
  // while each expert led, in that order, and the lead's changes over the replay. Empty and 0 otherwise.
  std::vector<std::uint64_t> device_lead_requests;
  std::uint64_t device_policy_switches = 0;

  std::uint64_t hit_blocks() const { return device_hit_blocks + host_hit_blocks + storage_hit_blocks; }
  double hit_ratio() const { return total_blocks ? double(hit_blocks()) / double(total_blocks) : 0.0; }
  double device_hit_ratio() const { return total_blocks ? double(device_hit_blocks) / double(total_blocks) : 0.0; }
  double host_hit_ratio() const { return total_blocks ? double(host_hit_blocks) / double(total_blocks) : 0.0; }
  double storage_hit_ratio() const { return total_blocks ? double(storage_hit_blocks) / double(total_blocks) : 0.0; }
  double token_hit_ratio() const {
    return total_tokens ? double(device_hit_tokens + host_hit_tokens + storage_hit_tokens) / double(total_tokens) : 0.0;
  }
};

// InvalidArgument, naming the value, for queue-model options out of range (checked only with queue_model)
// and for lookahead without queue_model; with queue_model also for a trace out of time order (check_queue_trace).
Result<ReplayResult> replay_trace(const std::vector<TraceRequest>& trace, const ReplayOptions& options);
// The queue model's requests arrive in file order: InvalidArgument naming the first request whose timestamp is
// earlier than the one before it.
Status check_queue_trace(const std::vector<TraceRequest>& trace);
// Single tier of capacity_blocks through the cache manager with the oracle policy "belady" (MIN
// without bypass, see above); other fields of `options` as given.
Result<ReplayResult> replay_belady(const std::vector<TraceRequest>& trace, std::uint32_t capacity_blocks,
                                   const ReplayOptions& options);
// MIN with bypass over one tier of capacity_blocks (see the top of this file); policy "min-bypass".
// Uses block_tokens and cache_partial_blocks of `options`.
Result<ReplayResult> replay_min_bypass(const std::vector<TraceRequest>& trace, std::uint32_t capacity_blocks,
                                       const ReplayOptions& options);
// Hit ratio with unbounded capacity (the ceiling of any policy).
ReplayResult replay_unbounded(const std::vector<TraceRequest>& trace, const ReplayOptions& options);

// ---- Class-TTL bound (sim/replay_bounds.cc) ----
// The best hit ratio of a policy that knows of a block, at each use, only its use count so far (0..6,
// capped) and the distance of its last reuse (bit width of the distance in requests), and keeps it for a
// time-to-live chosen per such class: bench/trace_bounds.py's class_ttl. TTLs come from a geometric grid
// (2^(k/8) requests); the budget is capacity * requests block-requests of residency (an average occupancy
// of `capacity`; the class at the margin mixes two TTLs) and hits are counted per block, both of which
// flatter such a policy; see replay_bounds.cc. Not a bound of every policy: one that uses the prefix
// structure or finer recency can exceed it.
//
// hindsight: TTLs fitted on the whole trace and scored on it (what trace_bounds.py prints); it has seen
// the answers. cross_validated: the requests are split in two halves (conversation_halves); the TTLs
// fitted on one half are scored on the other, both ways. Fitting fixes, per class, the TTLs on the hull
// of that half's (residency, hits) curve and the order in which the classes' TTLs grow (hits per unit
// of residency, on that half); scoring walks the other half along that order until its own share of the
// budget (its share of the block uses) is spent, as an online TTL cache lengthens or shortens its TTLs to
// stay full. A class the fitting half never saw gets TTL 0. cross_validated is hit blocks over all
// blocks, i.e. the mean of the two halves' hit ratios weighted by their blocks; fold[h] is half h's
// hit ratio under the TTLs fitted on the other half.
struct ClassTtlBound {
  std::uint32_t capacity_blocks = 0;
  double hindsight = 0;
  double cross_validated = 0;
  double fold[2] = {0, 0};
};
// Per request, its half (0 or 1) for cross-validation, by conversation: request i continues the
// conversation of request j when j introduced the deepest of i's cacheable blocks seen before, that
// block is j's last cacheable block (i re-reads j's whole cacheable input, as a chat's next turn does),
// and no earlier request continued j (a conversation is a chain of turns; a second continuation, like
// many requests behind one shared system prompt, starts a conversation of its own). A conversation's
// half is a hash of its first request's index, so its turns never straddle the halves. Uses
// block_tokens and cache_partial_blocks of `options`.
Result<std::vector<std::uint8_t>> conversation_halves(const std::vector<TraceRequest>& trace,
                                                      const ReplayOptions& options);
// One result per capacity (each >= 1, else InvalidArgument naming it). `halves`: one 0/1 per request
// (empty: conversation_halves); another size or value is InvalidArgument. Deterministic; O(block uses
// * log + classes * grid).
Result<std::vector<ClassTtlBound>> replay_class_ttl(const std::vector<TraceRequest>& trace,
                                                    std::span<const std::uint32_t> capacities,
                                                    const ReplayOptions& options,
                                                    std::span<const std::uint8_t> halves = {});

// A hit-ratio sweep over single-tier capacities, with the bounds and peers a policy is judged against:
// - min-bypass (the optimum) and belady (the manager with the oracle, no bypass);
// - the cross-validated class-TTL bound (replay_class_ttl; hindsight kept alongside);
// - the peers: leaf-first LRU as vLLM and SGLang evict (kvtier's "lru": the manager only evicts leaves of a
//   tier and reports a path's accesses deepest first, see eviction_policy.h), S3-FIFO ("s3fifo") and SIEVE
//   ("sieve"); sweep() adds any of them, and the default policy, that `policies` leaves out;
// - the default policy's memory multiplier: the capacity it needs to reach min-bypass's hit ratio at C, as
//   a multiple of C, found by doubling from C then bisection to within `multiplier_precision` (relative),
//   up to `max_multiplier` (beyond that: not reached). Probes stop at the capacity that holds every
//   block of the trace (no eviction), where any policy reaches the unbounded hit ratio. The search assumes
//   the hit ratio grows with capacity; where it does not, it finds a capacity that reaches the target,
//   bracketed within the precision by one that does not.
struct SweepOptions {
  std::string default_policy;          // empty: CacheConfig{}.device_policy
  double max_multiplier = 16;          // >= 1
  double multiplier_precision = 0.02;  // > 0
};

inline constexpr const char* kSweepPeers[] = {"lru", "s3fifo", "sieve"};

struct SweepTable {
  std::vector<std::uint32_t> capacities;           // device blocks, single tier
  std::vector<std::string> policies;               // the online ones, then "belady", "min-bypass"
  std::vector<std::vector<ReplayResult>> results;  // [policy][capacity]
  double unbounded_hit_ratio = 0;
  std::vector<ClassTtlBound> class_ttl;  // [capacity]
  std::string default_policy;            // one of `policies`
  // [capacity]: the default's capacity reaching min-bypass(C), / C; +infinity: not within max_multiplier.
  std::vector<double> memory_multiplier;
  // [capacity]: that capacity in blocks (0: not reached).
  std::vector<std::uint32_t> multiplier_capacity;
  double max_multiplier = 16, multiplier_precision = 0.02;
};

// InvalidArgument for no capacities, a capacity 0, an unknown policy or bad SweepOptions, naming the value.
Result<SweepTable> sweep(const std::vector<TraceRequest>& trace, const std::vector<std::uint32_t>& capacities,
                         const std::vector<std::string>& policies, const ReplayOptions& options,
                         const SweepOptions& sweep_options = {});
std::string sweep_markdown(const SweepTable& table, std::uint32_t block_tokens);
std::string sweep_csv(const SweepTable& table, std::uint32_t block_tokens);
std::string sweep_svg(const SweepTable& table, std::uint32_t block_tokens);

}  // namespace kvtier::cache
