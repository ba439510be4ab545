// The scheduler side for Python: block keys, the CacheManager (match, admit,
// plan, ack) and storage backends (disk, Redis). Keys cross as 32-digit hex
// strings (BlockKey::hex); plans as dicts of move lists. The CacheManager has
// no internal locking (one scheduler thread drives it, as in C++); the
// wrapper serialises calls with a mutex so that Python threads cannot race.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "engine_bridge.h"
#include "kvtier/backend/storage_backend.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/cache/cache_config.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/cache/config_knobs.h"
#include "kvtier/cache/hybrid_cache.h"
#include "kvtier/core/config.h"
#include "kvtier/core/log.h"
#include "kvtier/storage/storage_config.h"
#include "metrics_bridge.h"
#include "status_bridge.h"

extern char** environ;

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {
namespace {

// release() called while this thread holds the cache's mutex: from a finalizer the garbage collector ran inside
// another call of the same cache (an engine's request object released in __del__ is a common pattern). Queued to
// run when the interrupted call unlocks (an error is logged); true when it was queued.
template <typename Cache>
bool defer_release_of(PyCallMutex& mu, Cache& cache, std::uint64_t id) {
  if (!mu.held_by_this_thread()) return false;
  mu.defer([&cache, id] {
    if (Status st = cache.release(id); !st.ok())
      log(LogLevel::kWarning, "python", fmt::format("release({}) from a finalizer: {}", id, st.to_string()));
  });
  return true;
}

// The medium KV events name the storage tier by: DISK or REMOTE (GPU and CPU are the device and host tiers').
metrics::Medium storage_medium_from(const std::string& name) {
  const metrics::Medium m = value_or_raise(metrics::parse_medium(name));
  if (m != metrics::Medium::kDisk && m != metrics::Medium::kRemote)
    raise_status(
        InvalidArgument(fmt::format("storage_medium '{}': DISK or REMOTE (vLLM's STORAGE is DISK; GPU and CPU are "
                                    "the device and host tiers' own media)",
                                    name)));
  return m;
}

using cache::BlockId;
using cache::BlockKey;

std::vector<BlockKey> parse_keys(const std::vector<std::string>& hex) {
  std::vector<BlockKey> out;
  out.reserve(hex.size());
  for (std::size_t i = 0; i < hex.size(); ++i) {
    auto k = BlockKey::from_hex(hex[i]);
    if (!k.ok()) raise_status(k.status().with_context(fmt::format("key at index {}", i)));
    out.push_back(*k);
  }
  return out;
}

std::vector<std::string> key_strings(const std::vector<BlockKey>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(k.hex());
  return out;
}

std::vector<BlockId> to_block_ids(const std::vector<std::int64_t>& ids) {
  std::vector<BlockId> out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > static_cast<std::int64_t>(UINT32_MAX))
      raise_status(OutOfRange(fmt::format("block id {} at index {} is not a valid block id", ids[i], i)));
    out.push_back(static_cast<BlockId>(ids[i]));
  }
  return out;
}

Status ack_status(const std::optional<std::string>& error) {
  return error ? Status(StatusCode::kAborted, *error) : Status::Ok();
}

nb::list moves(const std::vector<cache::BlockMove>& v) {
  nb::list out;
  // A dropped storage slot has no destination: None.
  for (const auto& m : v)
    out.append(nb::make_tuple(m.src, m.dst == cache::kNoBlock ? nb::object(nb::none()) : nb::object(nb::int_(m.dst)),
                              m.key.hex()));
  return out;
}

struct PyKeyHasher {
  cache::KeyHasher hasher;
};

// Shared with the calls in flight (they run with the GIL released), so close() from another thread never frees
// what one of them uses: the last holder destroys the backend (its directory lock, its connections).
struct PyStorage {
  std::mutex mu;
  std::shared_ptr<storage::StorageBackend> backend;  // null once closed
  std::string name;                                  // kept for after close()
  MadeInProcess made;

  ~PyStorage() {
    if (made.in_child()) leak_in_child(backend);
  }
  std::shared_ptr<storage::StorageBackend> get() {
    made.check(fmt::format("the storage backend '{}'", name));
    std::shared_ptr<storage::StorageBackend> b;
    {
      std::lock_guard lock(mu);
      b = backend;
    }
    if (!b) raise_status(FailedPrecondition(fmt::format("the storage backend '{}' was closed", name)));
    return b;
  }
  void close() {
    made.check(fmt::format("the storage backend '{}'", name));
    std::shared_ptr<storage::StorageBackend> b;
    {
      std::lock_guard lock(mu);
      b = std::move(backend);
    }
    GilReleased release;  // a backend's teardown joins its threads
    b.reset();
  }
};

// ---------------------------------------------------------------- hybrid models

struct PyHybridCache {
  PyCallMutex mu;
  std::unique_ptr<cache::HybridCache> hc;
};

// One group of HybridCache's config from a dict: name, kind ("full", "sliding_window", "state"), block_tokens,
// window_tokens (sliding window), and the group's pools and policies as CacheManager's constructor names them.
cache::KvGroupConfig group_config(const nb::dict& d, std::size_t index) {
  static const char* known[] = {"name",        "kind",           "block_tokens", "window_tokens", "device_blocks",
                                "host_blocks", "storage_blocks", "write_policy", "device_policy", "host_policy"};
  for (auto [k, v] : d) {
    std::string key;
    if (!nb::try_cast<std::string>(k, key))
      raise_status(
          InvalidArgument(fmt::format("group {}: key {} is not a string", index, nb::cast<std::string>(nb::repr(k)))));
    if (std::find(std::begin(known), std::end(known), key) == std::end(known))
      raise_status(InvalidArgument(fmt::format("group {}: unknown key '{}'", index, key)));
  }
  // nb::try_cast, not nb::cast: a failed cast throws std::bad_cast, which reaches Python naming nothing.
  auto get_u32 = [&](const char* key, std::uint32_t fallback) {
    if (!d.contains(key)) return fallback;
    std::uint32_t v = 0;
    if (!nb::try_cast<std::uint32_t>(d[key], v))
      raise_status(InvalidArgument(fmt::format("group {}: {} is {}, not an integer in 0..2^32-1", index, key,
                                               nb::cast<std::string>(nb::repr(d[key])))));
    return v;
  };
  auto get_str = [&](const char* key, const char* fallback) {
    if (!d.contains(key)) return std::string(fallback);
    std::string v;
    if (!nb::try_cast<std::string>(d[key], v))
      raise_status(InvalidArgument(
          fmt::format("group {}: {} is {}, not a string", index, key, nb::cast<std::string>(nb::repr(d[key])))));
    return v;
  };
  cache::KvGroupConfig g;
  g.name = get_str("name", "");
  const std::string kind = get_str("kind", "full");
  if (kind == "full")
    g.kind = cache::GroupKind::kFull;
  else if (kind == "sliding_window")
    g.kind = cache::GroupKind::kSlidingWindow;
  else if (kind == "state")
    g.kind = cache::GroupKind::kState;
  else
    raise_status(InvalidArgument(
        fmt::format("group {} ('{}'): kind '{}' is not full, sliding_window or state", index, g.name, kind)));
  g.block_tokens = get_u32("block_tokens", 0);
  g.window_tokens = get_u32("window_tokens", 0);
  g.cache.device_blocks = get_u32("device_blocks", 0);
  g.cache.host_blocks = get_u32("host_blocks", 0);
  g.cache.storage_blocks = get_u32("storage_blocks", 0);
  auto write_policy = cache::parse_write_policy(get_str("write_policy", "write_back"));
  if (!write_policy.ok())
    raise_status(write_policy.status().with_context(fmt::format("group {} ('{}')", index, g.name)));
  g.cache.write_policy = *write_policy;
  g.cache.device_policy = get_str("device_policy", "adaptive");
  g.cache.host_policy = get_str("host_policy", "lru");
  return g;
}

// A request from Python: chains[g] the hex keys of group g (KeyHasher.keys_for at that group's block size).
struct HybridRequestArgs {
  std::vector<std::vector<BlockKey>> chains;
  cache::HybridRequest request;
};
HybridRequestArgs hybrid_request(std::uint32_t num_tokens, const std::vector<std::vector<std::string>>& chains,
                                 std::uint32_t extra_tokens, std::optional<std::uint32_t> max_hit_tokens,
                                 const std::vector<std::uint32_t>& save_states_at) {
  HybridRequestArgs a;
  for (std::size_t g = 0; g < chains.size(); ++g) {
    std::vector<BlockKey> keys;
    keys.reserve(chains[g].size());
    for (std::size_t i = 0; i < chains[g].size(); ++i) {
      auto k = BlockKey::from_hex(chains[g][i]);
      if (!k.ok()) raise_status(k.status().with_context(fmt::format("group {} key at index {}", g, i)));
      keys.push_back(*k);
    }
    a.chains.push_back(std::move(keys));
  }
  a.request.num_tokens = num_tokens;
  for (const auto& c : a.chains) a.request.chains.emplace_back(c);
  a.request.extra_tokens = extra_tokens;
  if (max_hit_tokens) a.request.max_hit_tokens = *max_hit_tokens;
  a.request.save_states_at = save_states_at;
  return a;
}

// A plan's storage_drops: ack() takes them and does nothing (they are not acknowledged).
constexpr std::string_view kDropsKind = "storage_drops";

// The dst_blocks ack() is given with storage_drops: the plan's own list (None for each drop's destination) or any
// other sequence, never a str, bytes or a scalar (a caller's bug, which was taken silently).
void check_drops_list(nb::handle seq) {
  if (seq.is_none() || nb::isinstance<nb::str>(seq) || nb::isinstance<nb::bytes>(seq) ||
      PySequence_Check(seq.ptr()) == 0)
    raise_status(InvalidArgument(fmt::format("dst_blocks of storage_drops is a {}, not a sequence (a plan's list)",
                                             nb::inst_name(seq).c_str())));
}

// The ack kinds of CacheManager.ack / HybridCache.ack: the StepPlan lists by name.
cache::MoveKind move_kind(const std::string& kind) {
  if (kind == "evictions") return cache::MoveKind::kEviction;
  if (kind == "backups") return cache::MoveKind::kBackup;
  if (kind == "loads") return cache::MoveKind::kLoad;
  if (kind == "storage_writes") return cache::MoveKind::kStorageWrite;
  if (kind == "storage_prefetches") return cache::MoveKind::kStoragePrefetch;
  raise_status(InvalidArgument(fmt::format(
      "ack kind '{}' is not one of evictions, backups, loads, storage_writes, storage_prefetches (storage_drops: "
      "nothing to acknowledge)",
      kind)));
}

cache::Continuation parse_continuation(const std::string& name) {
  for (auto c : {cache::Continuation::kUnknown, cache::Continuation::kContinues, cache::Continuation::kLastTurn})
    if (name == cache::continuation_name(c)) return c;
  raise_status(InvalidArgument(fmt::format("continuation '{}' is not unknown, continues or last_turn", name)));
}

// The announce() hints of CacheManager.announce and HybridCache.announce, from their keyword arguments.
cache::RequestHints request_hints(nb::handle conversation_id, nb::handle continuation, nb::handle ttl_steps,
                                  nb::handle priority) {
  cache::RequestHints h;
  h.conversation_id = u64_arg(conversation_id, "conversation_id");
  h.continuation = parse_continuation(str_arg(continuation, "continuation"));
  h.ttl_steps = static_cast<std::uint32_t>(int_arg(ttl_steps, "ttl_steps", 0, UINT32_MAX));
  h.priority = static_cast<std::int32_t>(int_arg(priority, "priority", INT32_MIN, INT32_MAX));
  return h;
}

// A CacheManager's tiers as {"device": {capacity, used, resident, policy_expert, policy_switches}, "host": ...,
// "storage": ...} in `d`.

void put_tier_stats(nb::dict& d, const cache::CacheStats& s) {
  for (int t = 0; t < cache::kNumTiers; ++t) {
    nb::dict td;
    td["capacity"] = s.tiers[t].capacity;
    td["used"] = s.tiers[t].used;
    td["resident"] = s.tiers[t].resident;
    td["policy_expert"] = s.tiers[t].policy_expert;
    td["policy_switches"] = s.tiers[t].policy_switches;
    d[std::string(cache::tier_name(static_cast<cache::Tier>(t))).c_str()] = td;
  }
}

// Every counter of a CacheManager (or of one HybridCache group) as a dict: its tiers and the counters of
// cache::CacheStats under their own names.
nb::dict cache_stats_dict(const cache::CacheStats& s) {
  nb::dict d;
  put_tier_stats(d, s);
  d["nodes"] = s.nodes;
  d["admissions"] = s.admissions;
  d["admission_failures"] = s.admission_failures;
  d["evictions_d2h"] = s.evictions_d2h;
  d["loads_h2d"] = s.loads_h2d;
  d["backups_d2h"] = s.backups_d2h;
  d["drops_device"] = s.drops_device;
  d["drops_host"] = s.drops_host;
  d["drops_storage"] = s.drops_storage;
  d["lost_host_drops"] = s.lost_host_drops;
  d["pressure_demotions"] = s.pressure_demotions;
  d["storage_writes"] = s.storage_writes;
  d["storage_prefetches"] = s.storage_prefetches;
  d["failed_transfers"] = s.failed_transfers;
  d["invalidated_blocks"] = s.invalidated_blocks;
  d["received_blocks"] = s.received_blocks;
  d["received_loaded_blocks"] = s.received_loaded_blocks;
  d["received_committed_blocks"] = s.received_committed_blocks;
  d["quarantined_blocks"] = s.quarantined_blocks;
  d["receiving_device_blocks"] = s.receiving_device_blocks;
  d["quarantined_device_blocks"] = s.quarantined_device_blocks;
  d["lookup_blocks"] = s.lookup_blocks;
  d["hit_blocks"] = nb::make_tuple(s.hit_blocks[0], s.hit_blocks[1], s.hit_blocks[2]);
  d["resets"] = s.resets;
  d["queued_requests"] = s.queued_requests;
  d["retained_requests"] = s.retained_requests;
  d["protected_blocks"] = nb::make_tuple(s.protected_blocks[0], s.protected_blocks[1], s.protected_blocks[2]);
  d["lookahead_loads"] = s.lookahead_loads;
  d["lookahead_fetches"] = s.lookahead_fetches;
  d["protected_evictions"] = s.protected_evictions;
  return d;
}

nb::object group_or_none(std::uint32_t g) {
  if (g == cache::kNoGroup) return nb::none();
  return nb::int_(g);
}
nb::object block_or_none(cache::BlockId b) {
  if (b == cache::kNoBlock) return nb::none();
  return nb::int_(b);
}

nb::dict step_plan_dict(const cache::StepPlan& plan) {
  nb::dict d;
  d["evictions"] = moves(plan.evictions);
  d["backups"] = moves(plan.backups);
  d["loads"] = moves(plan.loads);
  d["storage_writes"] = moves(plan.storage_writes);
  d["storage_prefetches"] = moves(plan.storage_prefetches);
  d["storage_drops"] = moves(plan.storage_drops);
  return d;
}

storage::StorageKey storage_key(const std::string& hex, std::uint32_t rank) {
  auto k = BlockKey::from_hex(hex);
  if (!k.ok()) raise_status(k.status());
  // As the cache manager's storage executor keys its objects.
  return storage::StorageKey::from_u64(k->hi, k->lo, rank);
}

// One item of `op` (GIL released while it runs). The item's bytes, or nullopt
// when the object is absent; any other failure raises.
std::optional<std::uint64_t> run_one(PyStorage& p, storage::StorageOp op, const std::string& key, std::uint32_t rank,
                                     void* buffer = nullptr, std::uint64_t bytes = 0) {
  storage::StorageBatch b;
  b.op = op;
  b.items.push_back({storage_key(key, rank), buffer, bytes});
  const auto backend = p.get();
  auto r = value_or_raise(released([&] { return storage::run_batch(*backend, std::move(b)); }));
  if (r.at(0).status.code() == StatusCode::kNotFound) return std::nullopt;
  check(r.at(0).status);
  return r.at(0).bytes;
}

// ---------------------------------------------------------------- storage batches

// DLPack device types of memory the CPU addresses: 1 CPU, 3 CUDA host (pinned).
constexpr int kDlCpu = 1, kDlCudaHost = 3;

// One item's memory: borrowed from the caller for the whole batch.
struct Borrowed {
  void* data = nullptr;
  std::uint64_t bytes = 0;
};

template <typename Array>
Borrowed borrow_array(const Array& a, std::size_t index) {
  if (a.device_type() != kDlCpu && a.device_type() != kDlCudaHost)
    raise_status(InvalidArgument(fmt::format(
        "buffer at index {} has DLPack device type {}; storage items take memory the CPU addresses (numpy, CPU or "
        "pinned tensors)",
        index, a.device_type())));
  // C-contiguous, checked here: the bytes are moved as they lie, never through a converted copy. An array with a
  // dimension of size 0 holds no byte, whatever its strides (numpy calls it contiguous): an empty object.
  bool empty = false;
  for (std::size_t d = 0; d < a.ndim(); ++d) empty = empty || a.shape(d) == 0;
  if (empty) return {const_cast<void*>(static_cast<const void*>(a.data())), 0};
  std::int64_t expect = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expect)
      raise_status(InvalidArgument(
          fmt::format("buffer at index {} is not C-contiguous (dimension {} has stride {} elements, {} expected)",
                      index, d, a.stride(d), expect)));
    expect *= static_cast<std::int64_t>(a.shape(d));
  }
  return {const_cast<void*>(static_cast<const void*>(a.data())), static_cast<std::uint64_t>(a.nbytes())};
}

// A buffer of a batch: a C-contiguous CPU array (DLPack or the buffer protocol: numpy, CPU or pinned
// torch tensors; never converted or copied) or an (address, nbytes) pair of host memory the caller owns.
// The arrays themselves (their DLPack or buffer-protocol export, not only the Python object) are kept in `keep` until
// the batch has completed: with the export released, a bytearray could be cleared or an mmap closed while the
// backend still read or wrote its memory.
struct KeptBuffers {
  std::vector<nb::ndarray<>> writable;
  std::vector<nb::ndarray<nb::ro>> read_only;
};
Borrowed borrow_buffer(nb::handle h, bool writable, std::size_t index, KeptBuffers& keep) {
  if (nb::isinstance<nb::tuple>(h) && nb::len(h) == 2) {
    nb::tuple t = nb::borrow<nb::tuple>(h);
    std::uint64_t address = 0, bytes = 0;
    if (!nb::try_cast(t[0], address, false) || !nb::try_cast(t[1], bytes, false))
      raise_status(InvalidArgument(
          fmt::format("buffer at index {} is a tuple but not (address, nbytes) of non-negative integers", index)));
    if (address == 0 && bytes > 0)
      raise_status(InvalidArgument(fmt::format("buffer at index {} has address 0 and {} bytes", index, bytes)));
    return {reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), bytes};
  }
  try {
    if (writable) {
      keep.writable.push_back(nb::cast<nb::ndarray<>>(h, false));
      return borrow_array(keep.writable.back(), index);
    }
    keep.read_only.push_back(nb::cast<nb::ndarray<nb::ro>>(h, false));
    return borrow_array(keep.read_only.back(), index);
  } catch (const nb::cast_error&) {
    std::string type = nb::cast<std::string>(nb::str(nb::handle(h.type())));
    raise_status(InvalidArgument(
        fmt::format("buffer at index {} ({}) is neither a {}CPU array (DLPack or buffer protocol) nor an (address, "
                    "nbytes) pair",
                    index, type, writable ? "writable " : "")));
  }
}

// Posts one batch and waits until every item has completed: items borrow the caller's memory, so
// the call never returns while the backend may still touch it (Redis items end within the
// backend's deadlines; disk items when their I/O completes). Runs without the GIL.
Result<std::vector<storage::ItemResult>> run_to_completion(storage::StorageBackend& backend,
                                                           storage::StorageBatch batch) {
  KVTIER_ASSIGN_OR_RETURN(storage::StorageTicket ticket, backend.post(std::move(batch)));
  while (!ticket.poll()) ticket.wait(std::chrono::milliseconds(1000)).ignore_error();  // a timeout: poll again
  return ticket.results();
}

// Per-item outcome for Python: the payload bytes (int) when OK, else the exception object of the
// item's status (kvtier.errors: NotFoundError for an absent object, DataLossError for one that failed
// verification, ResourceExhaustedError for a full tier, ...), not raised.
nb::list item_results(const std::vector<storage::ItemResult>& results) {
  nb::list out;
  for (const auto& r : results) {
    if (r.status.ok())
      out.append(nb::int_(r.bytes));
    else
      out.append(exception_object(r.status));
  }
  return out;
}

nb::list run_many(PyStorage& p, storage::StorageOp op, const std::vector<std::string>& keys,
                  std::optional<nb::sequence> buffers, std::uint32_t rank) {
  storage::StorageBatch b;
  b.op = op;
  b.items.resize(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto k = BlockKey::from_hex(keys[i]);
    if (!k.ok()) raise_status(k.status().with_context(fmt::format("key at index {}", i)));
    b.items[i].key = storage::StorageKey::from_u64(k->hi, k->lo, rank);
  }
  KeptBuffers keep;
  if (op == storage::StorageOp::kGet || op == storage::StorageOp::kPut) {
    if (!buffers)
      raise_status(InvalidArgument(fmt::format("{} needs buffers (one per key)", storage::storage_op_name(op))));
    const std::size_t n = nb::len(*buffers);
    if (n != keys.size()) raise_status(InvalidArgument(fmt::format("{} keys but {} buffers", keys.size(), n)));
    if (op == storage::StorageOp::kGet)
      keep.writable.reserve(n);
    else
      keep.read_only.reserve(n);
    // By index, 0..n-1: iterating wrote past b.items when the sequence's iteration yielded more than its len() (a
    // custom Sequence, or a list another thread grew while an item's __dlpack__ ran Python code).
    for (std::size_t i = 0; i < n; ++i) {
      nb::object h = nb::steal(PySequence_GetItem(buffers->ptr(), static_cast<Py_ssize_t>(i)));
      if (!h.is_valid()) {
        PyErr_Clear();
        raise_status(InvalidArgument(fmt::format("buffers[{}] cannot be read", i)));
      }
      Borrowed m = borrow_buffer(h, op == storage::StorageOp::kGet, i, keep);
      b.items[i].buffer = m.data;
      b.items[i].bytes = m.bytes;
    }
  }
  if (b.items.empty()) return nb::list();
  const auto backend = p.get();
  auto r = value_or_raise(released([&] { return run_to_completion(*backend, std::move(b)); }));
  return item_results(r);
}

}  // namespace

std::vector<cache::BlockKey> block_keys_from_hex(const std::vector<std::string>& hex) { return parse_keys(hex); }

void bind_cache(nb::module_& m) {
  m.def(
      "unrecognized_env", [] { return cache::unrecognized_env_vars(environ); },
      "One message per KVTIER_* variable of the environment that looks like a setting (KVTIER_CACHE_..., "
      "KVTIER_TRANSFER_...) but names none: a misspelt setting is otherwise ignored silently.");
  nb::class_<PyKeyHasher>(m, "KeyHasher",
                          "Chained 128-bit block keys in a namespace (model, layout, dtype, TP shard, block size, "
                          "tenant): equal token prefixes give equal keys, different namespaces never collide.")
      .def(
          "__init__",
          [](PyKeyHasher* self, const std::string& model_id, IntArg block_tokens, IntArg layout_fingerprint,
             const std::string& dtype, IntArg tp_rank, IntArg tp_size, const std::string& tenant_salt,
             const std::string& extra) {
            cache::KeyNamespace ns;
            ns.model_id = model_id;
            ns.block_tokens = block_tokens.u32("block_tokens");
            ns.layout_fingerprint = layout_fingerprint.u64("layout_fingerprint");
            ns.dtype = dtype;
            ns.tp_rank = tp_rank.u32("tp_rank");
            ns.tp_size = tp_size.u32("tp_size");
            ns.tenant_salt = tenant_salt;
            ns.extra = extra;
            new (self) PyKeyHasher{value_or_raise(cache::KeyHasher::create(ns))};
          },
          "model_id"_a, "block_tokens"_a, "layout_fingerprint"_a = 0, "dtype"_a = "bf16", "tp_rank"_a = 0,
          "tp_size"_a = 1, "tenant_salt"_a = "", "extra"_a = "")
      .def(
          "keys_for",
          [](const PyKeyHasher& h, nb::handle tokens_obj) {
            // Each id checked and named (tokens[i] 2**31 or -1), where nanobind refused the whole call unnamed.
            const std::vector<std::int64_t> ids = int_list(tokens_obj, "tokens", INT32_MAX);
            const std::vector<std::int32_t> tokens(ids.begin(), ids.end());
            return key_strings(value_or_raise(h.hasher.keys_for(tokens)));
          },
          "tokens"_a, "Keys (hex) of every full block of the token ids; a partial tail block gets none.")
      .def_prop_ro("root", [](const PyKeyHasher& h) { return h.hasher.root().hex(); });

  nb::class_<PyCacheManager>(m, "CacheManager",
                             "Block pools, prefix index, eviction and write policies, step plans "
                             "(include/kvtier/cache/cache_manager.h). Settings: CacheConfig's defaults, then the "
                             "KVTIER_CACHE_* environment, then config (knob -> value, as the table of "
                             "docs/configuration.md, with or without the 'cache.' prefix), then the arguments given. "
                             "env=False leaves the environment out (an index whose every setting the caller owns).")
      .def(
          "__init__",
          [](PyCacheManager* self, nb::handle device_blocks, nb::handle host_blocks, nb::handle storage_blocks,
             nb::handle write_policy, nb::handle device_policy, nb::handle host_policy,
             nb::handle write_through_threshold, nb::handle config_obj, bool env) {
            // CacheConfig's defaults, then the KVTIER_CACHE_* environment, then `config`, then the arguments
            // given (None: not given). Every knob of docs/configuration.md is reachable, look-ahead and
            // watermarks included, not only the arguments'.
            cache::CacheConfig c;
            {
              ConfigTable table;
              cache::bind_cache_config(table, c);
              if (env) check(table.apply_env(environ).with_context("KVTIER_CACHE_* environment"));
              for (const auto& [knob, value] : config_arg(config_obj, "config"))
                check(table.set(knob.rfind("cache.", 0) == 0 ? knob : "cache." + knob, value));
            }
            if (!device_blocks.is_none()) c.device_blocks = u32_arg(device_blocks, "device_blocks");
            if (!host_blocks.is_none()) c.host_blocks = u32_arg(host_blocks, "host_blocks");
            if (!storage_blocks.is_none()) c.storage_blocks = u32_arg(storage_blocks, "storage_blocks");
            if (!write_policy.is_none())
              c.write_policy = value_or_raise(cache::parse_write_policy(str_arg(write_policy, "write_policy")));
            if (!device_policy.is_none()) c.device_policy = str_arg(device_policy, "device_policy");
            if (!host_policy.is_none()) c.host_policy = str_arg(host_policy, "host_policy");
            if (!write_through_threshold.is_none())
              c.write_through_threshold = u32_arg(write_through_threshold, "write_through_threshold");
            new (self) PyCacheManager();
            self->cm = value_or_raise(cache::CacheManager::create(std::move(c)));
          },
          "device_blocks"_a.none() = nb::none(), "host_blocks"_a.none() = nb::none(),
          "storage_blocks"_a.none() = nb::none(), "write_policy"_a.none() = nb::none(),
          "device_policy"_a.none() = nb::none(), "host_policy"_a.none() = nb::none(),
          "write_through_threshold"_a.none() = nb::none(), "config"_a.none() = nb::none(), "env"_a = true)
      .def(
          "match",
          [](PyCacheManager& p, StrListArg keys_arg) {
            auto k = parse_keys(keys_arg.get("keys"));
            auto lock = lock_gil_safe(p.mu);
            cache::MatchResult r = p.cm->match(k);
            nb::dict d;
            d["device_blocks"] = r.device_blocks;
            d["host_blocks"] = r.host_blocks;
            d["storage_blocks"] = r.storage_blocks;
            d["stopped_at_in_flight"] = r.stopped_at_in_flight;
            d["device_ids"] = r.device_ids;
            d["host_ids"] = r.host_ids;
            d["storage_ids"] = r.storage_ids;
            return d;
          },
          "keys"_a.none())
      .def(
          "admit",
          [](PyCacheManager& p, StrListArg keys_arg, nb::handle extra_blocks) {
            auto k = parse_keys(keys_arg.get("keys"));
            const std::uint32_t extra = u32_arg(extra_blocks, "extra_blocks");
            auto lock = lock_gil_safe(p.mu);
            cache::Admission a = value_or_raise(p.cm->admit(k, extra));
            nb::dict d;
            d["id"] = a.id;
            d["device_hit_blocks"] = a.device_hit_blocks;
            d["host_hit_blocks"] = a.host_hit_blocks;
            d["storage_hit_blocks"] = a.storage_hit_blocks;
            d["new_blocks"] = a.new_blocks;
            d["extra_blocks"] = a.extra_blocks;
            d["device_blocks"] = a.device_blocks;
            return d;
          },
          "keys"_a.none(), "extra_blocks"_a.none() = 0)
      .def(
          "commit",
          [](PyCacheManager& p, nb::handle admission, nb::handle num_computed) {
            const std::uint64_t id = u64_arg(admission, "admission");
            const std::optional<std::uint32_t> n = opt_u32_arg(num_computed, "num_computed");
            auto lock = lock_gil_safe(p.mu);
            check(n ? p.cm->commit(id, *n) : p.cm->commit_all(id));
          },
          "admission"_a.none(), "num_computed"_a.none() = nb::none())
      .def(
          "release",
          [](PyCacheManager& p, nb::handle admission) {
            const std::uint64_t id = u64_arg(admission, "admission");
            if (defer_release_of(p.mu, *p.cm, id)) return;
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->release(id));
          },
          "admission"_a.none())
      .def(
          "admission_status",
          [](PyCacheManager& p, nb::handle admission) {
            const std::uint64_t id = u64_arg(admission, "admission");
            auto lock = lock_gil_safe(p.mu);
            auto s = value_or_raise(p.cm->admission_status(id));
            nb::dict d;
            d["ready_blocks"] = s.ready_blocks;
            d["loading_blocks"] = s.loading_blocks;
            d["failed"] = s.failed;
            d["receiving_blocks"] = s.receiving_blocks;
            d["quarantined_blocks"] = s.quarantined_blocks;
            return d;
          },
          "admission"_a.none())
      .def(
          "prefetch",
          [](PyCacheManager& p, StrListArg keys_arg) {
            auto k = parse_keys(keys_arg.get("keys"));
            auto lock = lock_gil_safe(p.mu);
            return value_or_raise(p.cm->prefetch(k));
          },
          "keys"_a.none())
      .def(
          "take_plan",
          [](PyCacheManager& p) {
            auto lock = lock_gil_safe(p.mu);
            return step_plan_dict(p.cm->take_plan());
          },
          "Moves queued since the last call: dict of lists of (src, dst, key_hex).")
      .def(
          "ack",
          [](PyCacheManager& p, const std::string& kind, nb::handle dst_blocks, std::optional<std::string> error) {
            // Nothing to acknowledge for drops (a loop over every list of a plan works: their destinations are None),
            // but what is passed must still be such a list.
            if (kind == kDropsKind) return check_drops_list(dst_blocks);
            const cache::MoveKind k = move_kind(kind);
            auto ids = to_block_ids(int_list(dst_blocks, "dst_blocks", static_cast<std::int64_t>(kMaxBlockId)));
            Status st = ack_status(error);
            auto lock = lock_gil_safe(p.mu);
            switch (k) {
              case cache::MoveKind::kEviction: return check(p.cm->ack_evictions(ids, st));
              case cache::MoveKind::kBackup: return check(p.cm->ack_backups(ids, st));
              case cache::MoveKind::kLoad: return check(p.cm->ack_loads(ids, st));
              case cache::MoveKind::kStorageWrite: return check(p.cm->ack_storage_writes(ids, st));
              case cache::MoveKind::kStoragePrefetch: return check(p.cm->ack_storage_prefetches(ids, st));
            }
          },
          "kind"_a, "dst_blocks"_a.none(), "error"_a = nb::none(),
          "Acknowledges moves of one kind by destination block; error: None (done) or why it failed (the blocks "
          "become misses). 'storage_drops' needs no ack: taken and ignored.")
      .def("stats",
           [](PyCacheManager& p) {
             auto lock = lock_gil_safe(p.mu);
             cache::CacheStats s = p.cm->stats();
             return cache_stats_dict(s);
           })
      .def(
          "announce",
          [](PyCacheManager& p, StrListArg keys_arg, nb::handle conversation_id, nb::handle continuation,
             nb::handle ttl_steps, nb::handle priority) {
            auto k = parse_keys(keys_arg.get("keys"));
            const cache::RequestHints h = request_hints(conversation_id, continuation, ttl_steps, priority);
            auto lock = lock_gil_safe(p.mu);
            return value_or_raise(p.cm->announce(k, h));
          },
          "keys"_a.none(), "conversation_id"_a.none() = 0, "continuation"_a.none() = "unknown",
          "ttl_steps"_a.none() = 0, "priority"_a.none() = 0,
          "The engine queued a request with these block keys (a hash chain, hex): its cached blocks are kept over "
          "others and prefetched to faster tiers by take_plan(). Hints are optional: conversation_id (0: none), "
          "continuation 'unknown' | 'continues' | 'last_turn', ttl_steps (protection kept after withdraw, in "
          "take_plan() calls), priority (higher first). Returns the announcement's id.")
      .def(
          "extend_announced",
          [](PyCacheManager& p, nb::handle id, StrListArg keys_arg) {
            const std::uint64_t queued = u64_arg(id, "id");
            auto k = parse_keys(keys_arg.get("keys"));
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->extend_announced(queued, k));
          },
          "id"_a.none(), "keys"_a.none(), "Appends keys (tokens arrived) to a queued announcement's chain.")
      .def(
          "withdraw",
          [](PyCacheManager& p, nb::handle id) {
            const std::uint64_t queued = u64_arg(id, "id");
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->withdraw(queued));
          },
          "id"_a.none(), "The request left the queue (scheduled or cancelled).")
      .def(
          "announcement",
          [](PyCacheManager& p, nb::handle id) {
            const std::uint64_t queued = u64_arg(id, "id");
            auto lock = lock_gil_safe(p.mu);
            const cache::AnnouncementInfo a = value_or_raise(p.cm->announcement(queued));
            nb::dict d;
            d["keys"] = a.keys;
            d["queued"] = a.queued;
            d["retained_steps"] = a.retained_steps;
            d["conversation_id"] = a.hints.conversation_id;
            d["continuation"] = std::string(cache::continuation_name(a.hints.continuation));
            d["ttl_steps"] = a.hints.ttl_steps;
            d["priority"] = a.hints.priority;
            return d;
          },
          "id"_a.none())
      .def("check_invariants",
           [](PyCacheManager& p) {
             auto lock = lock_gil_safe(p.mu);
             check(p.cm->check_invariants());
           })
      .def(
          "reset",
          [](PyCacheManager& p) {
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->reset());
          },
          "Forgets every cached block (vLLM's reset_prefix_cache); FailedPreconditionError while an admission is "
          "open or a move is queued or in flight. With KV events on, an AllBlocksCleared event follows.")
      .def(
          "attach_metrics",
          [](PyCacheManager& p, const nb::dict& labels) {
            metrics::Labels l = labels_from(labels);
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->attach_metrics(metrics::default_registry(), l));
          },
          "labels"_a = nb::dict(),
          "Exports this manager's counters into kvtier's process registry (kvtier.metrics), every series "
          "carrying `labels`.")
      .def(
          "enable_kv_events",
          [](PyCacheManager& p, IntArg block_size_arg, const std::string& storage_medium) {
            const std::uint32_t block_size = block_size_arg.u32("block_size");
            auto medium = storage_medium_from(storage_medium);
            auto lock = lock_gil_safe(p.mu);
            check(p.cm->enable_kv_events(block_size, medium));
          },
          "block_size"_a, "storage_medium"_a = "DISK",
          "KV events in vLLM's schema from now on (what is indexed already is announced at once); block_size: "
          "tokens per block; storage_medium: DISK or REMOTE.")
      .def(
          "take_events",
          [](PyCacheManager& p) {
            std::vector<metrics::KvEvent> ev;
            {
              auto lock = lock_gil_safe(p.mu);
              ev = p.cm->take_events();
            }
            return events_to_python(ev);
          },
          "The events since the last call (one step's batch) as dicts: type BlockStored (block_hashes, "
          "parent_block_hash, token_ids, block_size, lora_id, medium), BlockRemoved (block_hashes, medium) or "
          "AllBlocksCleared.")
      .def(
          "publish_events",
          [](PyCacheManager& p, nb::handle publisher) -> nb::object {
            const auto pub = publisher_of(publisher);
            std::vector<metrics::KvEvent> ev;
            {
              auto lock = lock_gil_safe(p.mu);
              ev = p.cm->take_events();
            }
            if (ev.empty()) return nb::none();
            Result<std::uint64_t> seq = pub->publish(std::move(ev));
            if (!seq.ok()) {
              // Refused (a full queue, a publisher shut down meanwhile): the batch is still in `ev`; it goes back in
              // front of the manager's queue, so the next call sends it.
              auto lock = lock_gil_safe(p.mu);
              p.cm->return_events(std::move(ev));
            }
            return nb::int_(value_or_raise(std::move(seq)));
          },
          "publisher"_a,
          "Takes the events since the last call and publishes them as one batch on a KvEventPublisher; returns "
          "its sequence number, or None when there was nothing to send. When the publisher refuses the batch "
          "(ResourceExhaustedError: its queue is full; FailedPreconditionError: it was shut down) the events stay "
          "in this manager and the next call sends them.");

  nb::class_<PyHybridCache>(m, "HybridCache",
                            "Hybrid models' KV groups (full attention, sliding window, Mamba / linear-attention "
                            "state), one CacheManager per group; a prefix hits only as far as every group serves it "
                            "(include/kvtier/cache/hybrid_cache.h). Chains cross as lists of hex keys per group.")
      .def(
          "__init__",
          [](PyHybridCache* self, const std::vector<nb::dict>& groups) {
            cache::HybridConfig c;
            for (std::size_t i = 0; i < groups.size(); ++i) c.groups.push_back(group_config(groups[i], i));
            new (self) PyHybridCache();
            self->hc = value_or_raise(cache::HybridCache::create(std::move(c)));
          },
          "groups"_a,
          "groups: one dict per KV group: name, kind ('full' | 'sliding_window' | 'state'), block_tokens, "
          "window_tokens (sliding window), device_blocks, host_blocks, storage_blocks, write_policy, device_policy, "
          "host_policy.")
      .def_prop_ro("num_groups", [](PyHybridCache& p) { return p.hc->num_groups(); })
      .def_prop_ro(
          "hit_granularity", [](PyHybridCache& p) { return p.hc->hit_granularity(); },
          "Tokens a hit is a multiple of (the lcm of the groups' block sizes).")
      .def(
          "match",
          [](PyHybridCache& p, nb::handle num_tokens, const std::vector<std::vector<std::string>>& chains,
             nb::handle max_hit_tokens) {
            HybridRequestArgs a = hybrid_request(u32_arg(num_tokens, "num_tokens"), chains, 0,
                                                 opt_u32_arg(max_hit_tokens, "max_hit_tokens"), {});
            auto lock = lock_gil_safe(p.mu);
            cache::HybridMatch r = value_or_raise(p.hc->match(a.request));
            nb::dict d;
            d["hit_tokens"] = r.hit_tokens;
            d["limited_by"] = group_or_none(r.limited_by);
            d["stopped_at_in_flight"] = r.stopped_at_in_flight;
            nb::list groups;
            for (const auto& g : r.groups) {
              nb::dict gd;
              gd["alone_hit_tokens"] = g.alone_hit_tokens;
              gd["in_flight"] = g.in_flight;
              groups.append(gd);
            }
            d["groups"] = groups;
            return d;
          },
          "num_tokens"_a.none(), "chains"_a, "max_hit_tokens"_a.none() = nb::none(),
          "The hit every group can serve together (changes nothing).")
      .def(
          "admit",
          [](PyHybridCache& p, nb::handle num_tokens, const std::vector<std::vector<std::string>>& chains,
             nb::handle extra_tokens, nb::handle max_hit_tokens, nb::handle save_states_arg) {
            std::vector<std::uint32_t> save_states_at;
            for (std::int64_t t : int_list(save_states_arg, "save_states_at", UINT32_MAX))
              save_states_at.push_back(static_cast<std::uint32_t>(t));
            HybridRequestArgs a =
                hybrid_request(u32_arg(num_tokens, "num_tokens"), chains, u32_arg(extra_tokens, "extra_tokens"),
                               opt_u32_arg(max_hit_tokens, "max_hit_tokens"), save_states_at);
            auto lock = lock_gil_safe(p.mu);
            cache::HybridAdmission r = value_or_raise(p.hc->admit(a.request));
            nb::dict d;
            d["id"] = r.id;
            d["hit_tokens"] = r.hit_tokens;
            d["limited_by"] = group_or_none(r.limited_by);
            d["stopped_at_in_flight"] = r.stopped_at_in_flight;
            nb::list groups;
            for (const auto& g : r.groups) {
              nb::dict gd;
              gd["group"] = g.group;
              gd["kind"] = std::string(cache::group_kind_name(g.kind));
              nb::list blocks;
              for (cache::BlockId b : g.device_blocks) blocks.append(block_or_none(b));
              gd["device_blocks"] = blocks;
              gd["first_block"] = g.first_block;
              gd["hit_blocks"] = g.hit_blocks;
              gd["loaded_blocks"] = g.loaded_blocks;
              gd["new_blocks"] = g.new_blocks;
              gd["extra_blocks"] = g.extra_blocks;
              gd["state_in"] = block_or_none(g.state_in);
              nb::list saves;
              for (const auto& s : g.state_saves) saves.append(nb::make_tuple(s.tokens, s.block));
              gd["state_saves"] = saves;
              gd["state_work"] = block_or_none(g.state_work);
              groups.append(gd);
            }
            d["groups"] = groups;
            return d;
          },
          "num_tokens"_a.none(), "chains"_a, "extra_tokens"_a.none() = 0, "max_hit_tokens"_a.none() = nb::none(),
          "save_states_at"_a.none() = nb::make_tuple(),
          "Admits a request in every group or in none (ResourceExhaustedError, nothing left admitted). Per group: "
          "the device block of every position (None outside a window), hits, loads, new blocks; state groups: the "
          "state to start from, where to save states, the working block.")
      .def(
          "announce",
          [](PyHybridCache& p, nb::handle num_tokens, const std::vector<std::vector<std::string>>& chains,
             nb::handle max_hit_tokens, nb::handle conversation_id, nb::handle continuation, nb::handle ttl_steps,
             nb::handle priority) {
            HybridRequestArgs a = hybrid_request(u32_arg(num_tokens, "num_tokens"), chains, 0,
                                                 opt_u32_arg(max_hit_tokens, "max_hit_tokens"), {});
            const cache::RequestHints h = request_hints(conversation_id, continuation, ttl_steps, priority);
            auto lock = lock_gil_safe(p.mu);
            return value_or_raise(p.hc->announce(a.request, h));
          },
          "num_tokens"_a.none(), "chains"_a, "max_hit_tokens"_a.none() = nb::none(), "conversation_id"_a.none() = 0,
          "continuation"_a.none() = "unknown", "ttl_steps"_a.none() = 0, "priority"_a.none() = 0,
          "The engine queued this request (chains as for admit): every group keeps and prefetches what the "
          "request's largest hit would need from it (full groups their chain, sliding-window groups the window's "
          "blocks, state groups the state at the hit). Hints as CacheManager.announce. Returns the id.")
      .def(
          "withdraw",
          [](PyHybridCache& p, nb::handle id) {
            const std::uint64_t queued = u64_arg(id, "id");
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->withdraw(queued));
          },
          "id"_a.none(),
          "The request left the queue (scheduled: before admit, or cancelled): every group withdraws it.")
      .def(
          "commit",
          [](PyHybridCache& p, nb::handle admission, nb::handle num_computed_tokens) {
            const std::uint64_t id = u64_arg(admission, "admission");
            const std::uint32_t n = u32_arg(num_computed_tokens, "num_computed_tokens");
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->commit(id, n));
          },
          "admission"_a.none(), "num_computed_tokens"_a.none())
      .def(
          "release",
          [](PyHybridCache& p, nb::handle admission) {
            const std::uint64_t id = u64_arg(admission, "admission");
            if (defer_release_of(p.mu, *p.hc, id)) return;
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->release(id));
          },
          "admission"_a.none())
      .def(
          "admission_status",
          [](PyHybridCache& p, nb::handle admission) {
            const std::uint64_t id = u64_arg(admission, "admission");
            auto lock = lock_gil_safe(p.mu);
            auto s = value_or_raise(p.hc->admission_status(id));
            nb::dict d;
            d["ready"] = s.ready;
            d["loading_blocks"] = s.loading_blocks;
            d["failed"] = s.failed;
            d["failed_group"] = group_or_none(s.failed_group);
            return d;
          },
          "admission"_a.none())
      .def(
          "take_plan",
          [](PyHybridCache& p) {
            auto lock = lock_gil_safe(p.mu);
            cache::HybridPlan plan = p.hc->take_plan();
            nb::list out;
            for (const auto& g : plan.groups) out.append(step_plan_dict(g));
            return out;
          },
          "Moves queued since the last call, one dict per group (as CacheManager.take_plan), in that group's block "
          "ids.")
      .def(
          "ack",
          [](PyHybridCache& p, nb::handle group, const std::string& kind, nb::handle dst_blocks,
             std::optional<std::string> error) {
            cache::GroupCompletion c;
            c.group = u32_arg(group, "group");
            if (kind == kDropsKind) return check_drops_list(dst_blocks);  // nothing to acknowledge
            c.completion.kind = move_kind(kind);
            c.completion.dst = to_block_ids(int_list(dst_blocks, "dst_blocks", static_cast<std::int64_t>(kMaxBlockId)));
            c.completion.status = ack_status(error);
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->apply_completions(std::span<const cache::GroupCompletion>(&c, 1)));
          },
          "group"_a, "kind"_a, "dst_blocks"_a.none(), "error"_a = nb::none(),
          "Acknowledges one group's moves of one kind by destination block; error: None or why they failed.")
      .def("stats",
           [](PyHybridCache& p) {
             auto lock = lock_gil_safe(p.mu);
             cache::HybridStats s = p.hc->stats();
             nb::dict d;
             d["admissions"] = s.admissions;
             d["refusals"] = s.refusals;
             d["rollbacks"] = s.rollbacks;
             d["lookup_tokens"] = s.lookup_tokens;
             d["hit_tokens"] = s.hit_tokens;
             nb::list groups;
             for (const auto& g : s.groups) {
               groups.append(cache_stats_dict(g));
             }
             d["groups"] = groups;
             return d;
           })
      .def("check_invariants",
           [](PyHybridCache& p) {
             auto lock = lock_gil_safe(p.mu);
             check(p.hc->check_invariants());
           })
      .def(
          "enable_kv_events",
          [](PyHybridCache& p, const std::string& storage_medium) {
            auto medium = storage_medium_from(storage_medium);
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->enable_kv_events(medium));
          },
          "storage_medium"_a = "DISK")
      .def(
          "take_events",
          [](PyHybridCache& p) {
            std::vector<cache::GroupEvent> ev;
            {
              auto lock = lock_gil_safe(p.mu);
              ev = p.hc->take_events();
            }
            nb::list out;
            for (auto& e : ev) {
              std::vector<metrics::KvEvent> one{std::move(e.event)};
              nb::list l = events_to_python(one);
              for (auto item : l) {
                nb::dict d = nb::cast<nb::dict>(item);
                d["group"] = e.group;
                out.append(d);
              }
            }
            return out;
          },
          "The events since the last call, as CacheManager.take_events, each with its 'group'.")
      .def(
          "attach_metrics",
          [](PyHybridCache& p, const nb::dict& labels) {
            metrics::Labels l = labels_from(labels);
            auto lock = lock_gil_safe(p.mu);
            check(p.hc->attach_metrics(metrics::default_registry(), l));
          },
          "labels"_a = nb::dict(),
          "Exports every group's counters into kvtier's process registry, with a kv_group label per group.");

  nb::class_<PyStorage>(m, "StorageBackend",
                        "A storage tier (disk with io_uring, Redis or Redis Cluster): verified objects keyed by "
                        "(block key, rank) in one namespace.")
      .def_static(
          "open",
          [](const std::string& spec, const std::string& ns, nb::handle config_obj) {
            // Numbers and bools too, as the other config dicts take them (a Mapping[str, str] refused 128).
            const std::map<std::string, std::string> config = config_arg(config_obj, "config");
            storage::StorageOptions o;
            o.ns = ns;
            // The environment as it is now, read with the GIL held (os.environ's setenv in another thread may
            // move `environ` while the backend opens without the GIL).
            std::vector<std::string> env_copy;
            for (char** e = environ; *e != nullptr; ++e) env_copy.emplace_back(*e);
            std::vector<char*> env;
            for (std::string& v : env_copy) env.push_back(v.data());
            env.push_back(nullptr);
            auto p = std::make_unique<PyStorage>();
            p->backend =
                value_or_raise(released([&] { return storage::open_storage_backend(spec, o, env.data(), config); }));
            p->name = std::string(p->backend->name());
            return p;
          },
          "spec"_a, "namespace"_a = "default", "config"_a.none() = nb::none(),
          "spec: memory:?capacity=<bytes> (in process, for tests and replays), "
          "disk:<dir>[?capacity=10G&durability=process|power&direct=auto|on|off&tenant=<id>] or "
          "redis://[[user]:password@]host:port[,host:port...][?prefix=<p>&tenant=<id>...] (make_storage_backend). "
          "config: knob -> value of the storage.disk.*, storage.redis.* and storage.tenant.* knobs "
          "(docs/configuration.md), applied over their KVTIER_STORAGE_* variables; what the spec names wins.")
      .def_static(
          "redacted_spec", [](const std::string& spec) { return storage::redact_storage_spec(spec); }, "spec"_a,
          "The spec as logs and errors may show it: a redis:// spec's password replaced by \"***\".")
      .def_static(
          "object_name",
          [](const std::string& key, IntArg rank) { return storage_key(key, rank.u32("rank")).to_string(); }, "key"_a,
          "rank"_a = 0,
          "The stored object's name (\"<32 hex digits>-r<rank>\"): the disk file <name>.kvo, the end of the Redis key.")
      .def_prop_ro("name", [](PyStorage& p) { return p.name; })
      .def("close", &PyStorage::close,
           "Releases the backend (a disk tier's directory lock, a Redis tier's connections) once the calls in "
           "flight on other threads end (idempotent); later calls raise FailedPreconditionError.")
      .def(
          "put",
          [](PyStorage& p, const std::string& key, nb::bytes data, IntArg rank) {
            run_one(p, storage::StorageOp::kPut, key, rank.u32("rank"), const_cast<char*>(data.c_str()), data.size());
          },
          "key"_a, "data"_a, "rank"_a = 0)
      .def(
          "get",
          [](PyStorage& p, const std::string& key, IntArg max_bytes_arg, IntArg rank_arg) -> nb::object {
            const std::uint64_t max_bytes = max_bytes_arg.u64("max_bytes");
            const std::uint32_t rank = rank_arg.u32("rank");
            // The buffer is sized by the object (exists), not by max_bytes: a generous bound costs no memory. An
            // object replaced by a larger one between the two is read again into a buffer twice as large (bounded
            // by max_bytes), so a writer alternating sizes cannot keep the read failing; it raised InvalidArgument
            // about a destination the caller never passed. Unavailable (retryable) after kGetAttempts.
            constexpr int kGetAttempts = 16;
            std::uint64_t room = 0, largest = 0;  // the buffer; the largest size exists() reported
            for (int attempt = 0;; ++attempt) {
              auto size = run_one(p, storage::StorageOp::kExists, key, rank);
              if (!size) return nb::none();
              if (*size > max_bytes)
                check(InvalidArgument(
                    fmt::format("get {}: the object has {} bytes, more than max_bytes = {}", key, *size, max_bytes)));
              const std::uint64_t grown = room > max_bytes / 2 ? max_bytes : room * 2;
              largest = std::max(largest, *size);
              room = std::max(largest, attempt == 0 ? 0 : grown);
              std::string buf(room, '\0');
              storage::StorageBatch b;
              b.op = storage::StorageOp::kGet;
              b.items.push_back({storage_key(key, rank), buf.data(), buf.size()});
              const auto backend = p.get();
              auto r = value_or_raise(released([&] { return storage::run_batch(*backend, std::move(b)); }));
              const Status& st = r.at(0).status;
              if (st.code() == StatusCode::kNotFound) return nb::none();
              if (st.code() == StatusCode::kInvalidArgument) {  // replaced by a larger one since the size was read
                if (room >= max_bytes)
                  check(
                      InvalidArgument(fmt::format("get {}: the object has more than max_bytes = {}", key, max_bytes)));
                if (attempt + 1 < kGetAttempts) continue;
                check(
                    Unavailable(fmt::format("get {}: the object was replaced by a larger one {} times while it was "
                                            "read; try again",
                                            key, kGetAttempts)));
              }
              check(st);
              return nb::bytes(buf.data(), r.at(0).bytes);
            }
          },
          "key"_a, "max_bytes"_a, "rank"_a = 0, "The payload, or None when absent (DataLossError if corrupted).")
      .def(
          "exists",
          [](PyStorage& p, const std::string& key, IntArg rank) {
            return run_one(p, storage::StorageOp::kExists, key, rank.u32("rank")).has_value();
          },
          "key"_a, "rank"_a = 0)
      .def(
          "delete",
          [](PyStorage& p, const std::string& key, IntArg rank) {
            return run_one(p, storage::StorageOp::kDelete, key, rank.u32("rank")).has_value();
          },
          "key"_a, "rank"_a = 0, "True when it was removed, False when it was absent.")
      .def(
          "exists_many",
          [](PyStorage& p, StrListArg keys_arg, IntArg rank) {
            return run_many(p, storage::StorageOp::kExists, keys_arg.get("keys"), std::nullopt, rank.u32("rank"));
          },
          "keys"_a.none(), "rank"_a = 0,
          "One batch; per key the payload size (int) when present, else the exception object (NotFoundError when "
          "absent), not raised.")
      .def(
          "get_many",
          [](PyStorage& p, StrListArg keys_arg, nb::sequence buffers, IntArg rank) {
            return run_many(p, storage::StorageOp::kGet, keys_arg.get("keys"), buffers, rank.u32("rank"));
          },
          "keys"_a.none(), "buffers"_a, "rank"_a = 0,
          "Reads each object into its buffer: a writable C-contiguous CPU array (numpy, CPU or pinned torch "
          "tensor; DLPack or buffer protocol) or an (address, nbytes) pair. Per key the payload bytes read (int; "
          "the object was verified before it was reported) or the exception object: NotFoundError (absent), "
          "DataLossError (failed verification: quarantined), InvalidArgumentError (object larger than the buffer), "
          "... A buffer whose item failed holds undefined bytes. Returns when every item is done (GIL released).")
      .def(
          "put_many",
          [](PyStorage& p, StrListArg keys_arg, nb::sequence buffers, IntArg rank) {
            return run_many(p, storage::StorageOp::kPut, keys_arg.get("keys"), buffers, rank.u32("rank"));
          },
          "keys"_a.none(), "buffers"_a, "rank"_a = 0,
          "Stores each buffer (as get_many's; read only) as the object of its key, replacing any. Per key the bytes "
          "stored (int) or the exception object (ResourceExhaustedError: the tier is full or the object exceeds "
          "its capacity, UnavailableError, ...). Returns when every item is done (GIL released). A batch that names "
          "one key twice raises InvalidArgumentError and stores nothing.")
      .def(
          "delete_many",
          [](PyStorage& p, StrListArg keys_arg, IntArg rank) {
            return run_many(p, storage::StorageOp::kDelete, keys_arg.get("keys"), std::nullopt, rank.u32("rank"));
          },
          "keys"_a.none(), "rank"_a = 0, "Per key 0 when removed, else the exception object (NotFoundError: absent).")
      .def("stats", [](PyStorage& p) {
        storage::StorageStats s = p.get()->stats();
        nb::dict d;
        d["objects"] = s.objects;
        d["bytes"] = s.bytes;
        d["capacity_bytes"] = s.capacity_bytes;
        d["evictions"] = s.evictions;
        d["quarantined"] = s.quarantined;
        d["auth_failures"] = s.auth_failures;
        d["bounce_copies"] = s.bounce_copies;
        d["redirects"] = s.redirects;
        d["reconnects"] = s.reconnects;
        d["direct_io_fallback"] = s.direct_io_fallback;
        return d;
      });
}

}  // namespace kvtier::python
