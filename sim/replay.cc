#include "sim/replay.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <queue>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "cache/splitmix.h"
#include "kvtier/cache/storage_executor.h"
#include "kvtier/cache/transfer_executor.h"
#include "kvtier/storage/storage_config.h"
#include "kvtier/testing/plan_executors.h"

namespace kvtier::cache {

namespace {

// A JSON value as an unsigned 64-bit integer (any integer 0..2^64-1; no floats, no negatives).
bool as_u64(const nlohmann::json& v, std::uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    return true;
  }
  return false;
}

// A bad field's value for an error message: scalars as JSON, at most kMaxShown characters; arrays and objects by
// their size only (dumping them recurses once per level of nesting, and a line can nest deeper than a stack).
std::string shown_value(const nlohmann::json& v) {
  constexpr std::size_t kMaxShown = 64;
  if (v.is_array()) return fmt::format("an array of {} elements", v.size());
  if (v.is_object()) return fmt::format("an object of {} fields", v.size());
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  if (s.size() > kMaxShown) s = s.substr(0, kMaxShown) + fmt::format("... ({} characters)", s.size());
  return s;
}

}  // namespace

namespace {

// A trace line is at most this long (about 25 million hash ids): a file without newlines (a device, a binary
// file) is refused at that size instead of read into memory whole.
constexpr std::size_t kMaxTraceLineBytes = std::size_t{256} << 20;

enum class LineRead { kLine, kEnd, kTooLong };

// The next line of `in` into `line`, without its '\n' (NUL bytes kept).
LineRead read_trace_line(std::istream& in, std::string& line) {
  line.clear();
  char buf[1 << 16];
  for (;;) {
    in.getline(buf, sizeof buf);
    const auto got = static_cast<std::size_t>(in.gcount());
    if (in.bad()) return LineRead::kEnd;
    if (in.fail() && !in.eof()) {  // the buffer filled before a '\n'
      line.append(buf, got);
      if (line.size() > kMaxTraceLineBytes) return LineRead::kTooLong;
      in.clear();
      continue;
    }
    if (in.eof()) {  // the last line, without a '\n'
      line.append(buf, got);
      return line.empty() ? LineRead::kEnd : LineRead::kLine;
    }
    line.append(buf, got > 0 ? got - 1 : 0);  // got counts the '\n'
    return line.size() > kMaxTraceLineBytes ? LineRead::kTooLong : LineRead::kLine;
  }
}

}  // namespace

Result<std::vector<TraceRequest>> load_mooncake_trace(const std::string& path, std::size_t max_requests) {
  std::error_code ec;
  const auto type = std::filesystem::status(path, ec).type();
  if (type == std::filesystem::file_type::not_found)
    return NotFound(fmt::format("trace file '{}' does not exist", path));
  if (type == std::filesystem::file_type::directory)
    return InvalidArgument(fmt::format("trace '{}' is a directory, not a trace file", path));
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    // The reason (permission denied, ...): the file exists, so NotFound would send the reader to look for it.
    const int err = errno;
    return FailedPrecondition(
        fmt::format("trace file '{}' cannot be opened: {}", path, err != 0 ? std::strerror(err) : "unknown reason"));
  }
  std::vector<TraceRequest> out;
  std::string line;
  std::size_t lineno = 0;
  std::uint64_t input_tokens = 0;
  for (;;) {
    const LineRead got = read_trace_line(in, line);
    if (got == LineRead::kEnd) break;
    ++lineno;
    if (got == LineRead::kTooLong)
      return InvalidArgument(fmt::format("{}:{}: a line longer than {} MiB (no newline: not a JSON-lines trace?)", path,
                                         lineno, kMaxTraceLineBytes >> 20));
    if (lineno == 1 && line.size() >= 2 && static_cast<unsigned char>(line[0]) == 0x1f &&
        static_cast<unsigned char>(line[1]) == 0x8b)
      return InvalidArgument(fmt::format("{}: a gzip-compressed file, not JSON lines: decompress it first", path));
    if (const auto nul = line.find('\0'); nul != std::string::npos)
      return InvalidArgument(fmt::format("{}:{}: a NUL byte at column {}", path, lineno, nul + 1));
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // The parser's reason and byte (a truncated last line, a comment, invalid UTF-8, ...), or a number it cannot
      // hold (out_of_range: "1e9551615").
      return InvalidArgument(fmt::format("{}:{}: not JSON: {}", path, lineno, e.what()));
    }
    if (!j.is_object())
      return InvalidArgument(fmt::format("{}:{}: not a JSON object but {}", path, lineno, j.type_name()));
    TraceRequest r;
    r.line = lineno;
    auto field = [&](const char* k, std::uint64_t& dst, bool required) -> Status {
      auto it = j.find(k);
      if (it == j.end())
        return required ? InvalidArgument(fmt::format("{}:{}: {} missing", path, lineno, k)) : Status::Ok();
      if (!as_u64(*it, dst))
        return InvalidArgument(
            fmt::format("{}:{}: {} is {}, not an integer in 0..2^64-1", path, lineno, k, shown_value(*it)));
      return Status::Ok();
    };
    KVTIER_RETURN_IF_ERROR(field("timestamp", r.timestamp_ms, true));
    KVTIER_RETURN_IF_ERROR(field("input_length", r.input_length, true));
    KVTIER_RETURN_IF_ERROR(field("output_length", r.output_length, false));
    auto h = j.find("hash_ids");
    if (h == j.end() || !h->is_array())
      return InvalidArgument(fmt::format("{}:{}: hash_ids missing or not an array", path, lineno));
    r.hash_ids.resize(h->size());
    for (std::size_t i = 0; i < h->size(); ++i)
      if (!as_u64((*h)[i], r.hash_ids[i]))
        return InvalidArgument(fmt::format("{}:{}: hash_ids[{}] is {}, not an integer in 0..2^64-1", path, lineno, i,
                                           shown_value((*h)[i])));
    if (r.input_length > UINT64_MAX - input_tokens)
      return InvalidArgument(
          fmt::format("{}:{}: input_length {}: the trace's input tokens exceed 2^64-1", path, lineno, r.input_length));
    input_tokens += r.input_length;
    out.push_back(std::move(r));
    if (max_requests && out.size() >= max_requests) break;
  }
  if (in.bad()) return Unavailable(fmt::format("trace file '{}': read error at line {}", path, lineno + 1));
  if (out.empty()) return InvalidArgument(fmt::format("trace file '{}' holds no requests", path));
  return out;
}

void ReplayStorage::FreeDeleter::operator()(void* p) const noexcept { std::free(p); }

ReplayStorage::~ReplayStorage() { tier_.reset(); }  // the tier (and its in-flight ops) before the memory

Result<std::unique_ptr<ReplayStorage>> ReplayStorage::create(const BackendFactory& make_backend,
                                                             std::uint32_t host_blocks, std::uint64_t block_bytes) {
  if (host_blocks == 0) return InvalidArgument("replay storage: host_blocks is 0 (storage needs a host tier)");
  if (block_bytes == 0) return InvalidArgument("replay storage: block_bytes is 0");
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::uniform(1, 1, block_bytes));
  constexpr std::uint64_t kAlign = 4096;
  std::unique_ptr<ReplayStorage> rs(new ReplayStorage());
  rs->host_blocks_ = host_blocks;
  rs->block_bytes_ = block_bytes;
  std::uint64_t region = 0;
  if (__builtin_mul_overflow(BlockSpace::page_first_page_bytes(layout, kAlign), std::uint64_t{host_blocks}, &region))
    return InvalidArgument(
        fmt::format("replay storage: {} host blocks of {} bytes exceed the address space", host_blocks, block_bytes));
  rs->memory_.reset(std::aligned_alloc(kAlign, region));
  if (!rs->memory_) return ResourceExhausted(fmt::format("replay storage: cannot allocate {} host bytes", region));
  std::memset(rs->memory_.get(), 0, region);
  KVTIER_ASSIGN_OR_RETURN(rs->host_, BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, host_blocks,
                                                            rs->memory_.get(), region, kAlign));
  KVTIER_ASSIGN_OR_RETURN(auto backend, make_backend(storage::StorageTier::storage_options(layout, "kvtier-replay")));
  KVTIER_ASSIGN_OR_RETURN(rs->tier_, storage::StorageTier::create(std::move(backend), rs->host_, 0));
  return rs;
}

Result<std::unique_ptr<ReplayStorage>> ReplayStorage::create(std::string_view spec, std::uint32_t host_blocks,
                                                             std::uint64_t block_bytes) {
  std::string sp(spec);
  // The storage knobs' KVTIER_STORAGE_* variables apply, as for StorageBackend.open (they were ignored here).
  return create([sp](storage::StorageOptions o) { return storage::open_storage_backend(sp, std::move(o), environ); },
                host_blocks, block_bytes);
}

Result<std::unique_ptr<ReplayStorage>> ReplayStorage::create_over(const BackendFactory& make_backend,
                                                                  const BlockSpace& host) {
  const KvLayout& layout = host.layout();
  if (host.kind() != MemoryKind::kPinnedHost || host.page_bytes() == 0)
    return InvalidArgument("replay storage: the shared host space must be page-first pinned host memory");
  if (layout.num_layers() != 1 || layout.num_roles(0) != 1)
    return InvalidArgument(
        fmt::format("replay storage: the shared host space has {} layers; one plane expected", layout.num_layers()));
  if (host.num_blocks() == 0 || host.num_blocks() >= kNoBlock)
    return InvalidArgument(fmt::format("replay storage: the shared host space has {} blocks", host.num_blocks()));
  std::unique_ptr<ReplayStorage> rs(new ReplayStorage());
  rs->host_ = host;
  rs->host_blocks_ = static_cast<std::uint32_t>(host.num_blocks());
  rs->block_bytes_ = layout.total_block_bytes();
  KVTIER_ASSIGN_OR_RETURN(auto backend, make_backend(storage::StorageTier::storage_options(layout, "kvtier-replay")));
  KVTIER_ASSIGN_OR_RETURN(rs->tier_, storage::StorageTier::create(std::move(backend), host, 0));
  return rs;
}

Result<std::unique_ptr<ReplayStorage>> ReplayStorage::create_over(std::string_view spec, const BlockSpace& host) {
  std::string sp(spec);
  // The storage knobs' KVTIER_STORAGE_* variables apply here too, as in create() (they were ignored on this path: a
  // replay with real transfers took neither a valid capacity nor refused a malformed one).
  return create_over(
      [sp](storage::StorageOptions o) { return storage::open_storage_backend(sp, std::move(o), environ); }, host);
}

std::span<std::byte> ReplayStorage::host_block(std::uint64_t b) const {
  return {host_.block_ptr(0, 0, b), block_bytes_};
}

void ReplayStorage::fill_pattern(const BlockKey& key, std::span<std::byte> out) {
  std::uint64_t x = key.hi ^ (key.lo * 0xD6E8FEB86659FD93ull);
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    std::uint64_t v = splitmix64_next(x);
    std::memcpy(out.data() + i, &v, 8);
  }
  if (i < out.size()) {
    std::uint64_t v = splitmix64_next(x);
    std::memcpy(out.data() + i, &v, out.size() - i);
  }
}

bool ReplayStorage::check_pattern(const BlockKey& key, std::span<const std::byte> bytes) {
  std::vector<std::byte> want(bytes.size());
  fill_pattern(key, want);
  return std::memcmp(want.data(), bytes.data(), bytes.size()) == 0;
}

Status check_queue_trace(const std::vector<TraceRequest>& trace) {
  // Sorted by time instead, the queue model served another order than the replay without it, and the difference
  // in hit ratio read as the queue's doing.
  // Named by the file's line where the requests came from one (blank lines make the two differ).
  auto where = [&](std::size_t i) {
    return trace[i].line != 0
               ? fmt::format("request {} (line {}, timestamp {} ms)", i + 1, trace[i].line, trace[i].timestamp_ms)
               : fmt::format("request {} (timestamp {} ms)", i + 1, trace[i].timestamp_ms);
  };
  for (std::size_t i = 1; i < trace.size(); ++i)
    if (trace[i].timestamp_ms < trace[i - 1].timestamp_ms)
      return InvalidArgument(fmt::format("replay: the queue model needs the trace in time order: {} comes after {}",
                                         where(i), where(i - 1)));
  return Status::Ok();
}

namespace {

// The device side of the real-bytes replay where there is no device memory: a FakePlanExecutor whose D2H moves
// (evictions, backups) land the block's pattern in its host page, or garbage where it failed the move.
class SimulatedDeviceExecutor final : public PlanExecutor {
 public:
  SimulatedDeviceExecutor(ReplayStorage& rs, double failure_rate, std::uint64_t seed)
      : rs_(rs), rng_(seed), fake_(fake_options(failure_rate)) {}

  Status execute(const StepPlan& plan) override {
    failed_.clear();
    KVTIER_RETURN_IF_ERROR(fake_.execute(plan));
    for (const auto* list : {&plan.evictions, &plan.backups})
      for (const BlockMove& m : *list) {
        auto page = rs_.host_block(m.dst);
        if (failed_.count(m.dst))
          std::memset(page.data(), 0xEE, page.size());
        else
          ReplayStorage::fill_pattern(m.key, page);
      }
    return Status::Ok();
  }
  std::vector<Completion> poll() override { return fake_.poll(); }

 private:
  FakePlanExecutor::Options fake_options(double failure_rate) {
    FakePlanExecutor::Options o;
    o.fail = [this, failure_rate](MoveKind kind, const BlockMove& m) {
      if (failure_rate <= 0 || std::uniform_real_distribution<double>(0, 1)(rng_) >= failure_rate) return false;
      if (kind == MoveKind::kEviction || kind == MoveKind::kBackup) failed_.insert(m.dst);
      return true;
    };
    return o;
  }

  ReplayStorage& rs_;
  std::mt19937_64 rng_;
  std::unordered_set<BlockId> failed_;
  FakePlanExecutor fake_;
};

// The byte-check mode, a decorator over any executor: it poisons each storage prefetch's destination page before
// the wrapped executor runs it and checks the page when the prefetch is acknowledged, and checks the host page of
// every load before the load runs. `holds(key, page)` says whether a page holds the key's bytes.
class ByteCheckingExecutor final : public PlanExecutor {
 public:
  using Holds = std::function<bool(const BlockKey&, std::span<const std::byte>)>;
  ByteCheckingExecutor(PlanExecutor& inner, ReplayStorage& rs, Holds holds)
      : inner_(inner), rs_(rs), holds_(std::move(holds)) {}

  Status execute(const StepPlan& plan) override {
    for (const BlockMove& m : plan.storage_prefetches) {
      auto page = rs_.host_block(m.dst);
      std::memset(page.data(), 0xA5, page.size());
      prefetching_[m.dst] = m.key;
    }
    for (const BlockMove& m : plan.loads) verify(m.key, m.src);
    return inner_.execute(plan);
  }

  std::vector<Completion> poll() override {
    std::vector<Completion> out = inner_.poll();
    for (const Completion& c : out) {
      if (c.kind != MoveKind::kStoragePrefetch) continue;
      for (BlockId b : c.dst) {
        auto it = prefetching_.find(b);
        if (it == prefetching_.end()) continue;
        if (c.status.ok()) verify(it->second, b);
        prefetching_.erase(it);
      }
    }
    return out;
  }

  std::uint64_t verified = 0, verification_failures = 0;

 private:
  void verify(const BlockKey& key, BlockId host_block) {
    ++verified;
    if (!holds_(key, rs_.host_block(host_block))) ++verification_failures;
  }

  PlanExecutor& inner_;
  ReplayStorage& rs_;
  Holds holds_;
  std::unordered_map<BlockId, BlockKey> prefetching_;
};

// Replay with real host and storage bytes: the storage moves through a StoragePlanExecutor beside the device
// side, all of it under the byte check. Two device sides:
//  - none given: there is no device memory; a SimulatedDeviceExecutor lands D2H moves in the host pages;
//  - one given (a TransferPlanExecutor over the same host space): device<->host bytes are real, moved by the
//    TransferManager, which also checks every loaded device block; host pages hold its pattern.
class RealBytesExecutor final : public PlanExecutor {
 public:
  RealBytesExecutor(ReplayStorage& rs, double failure_rate, std::uint64_t seed, PlanExecutor* device_side)
      : simulated_(device_side ? nullptr : std::make_unique<SimulatedDeviceExecutor>(rs, failure_rate, seed)),
        sto_(rs.tier()),
        comp_(device_side ? *device_side : *simulated_, sto_),
        checked_(comp_, rs, holds(device_side == nullptr)) {}

  Status execute(const StepPlan& plan) override { return checked_.execute(plan); }
  std::vector<Completion> poll() override { return checked_.poll(); }

  std::size_t storage_in_flight() const { return sto_.in_flight(); }
  const StoragePlanExecutor& storage() const { return sto_; }
  std::uint64_t verified() const { return checked_.verified; }
  std::uint64_t verification_failures() const { return checked_.verification_failures; }

 private:
  static ByteCheckingExecutor::Holds holds(bool simulated_device) {
    if (simulated_device) return &ReplayStorage::check_pattern;
    return [want = std::vector<std::byte>()](const BlockKey& key, std::span<const std::byte> page) mutable {
      want.resize(page.size());
      TransferPlanExecutor::fill_key_pattern(key, want.data(), want.size());
      return std::memcmp(want.data(), page.data(), page.size()) == 0;
    };
  }

  std::unique_ptr<SimulatedDeviceExecutor> simulated_;
  StoragePlanExecutor sto_;
  CompositePlanExecutor comp_;
  ByteCheckingExecutor checked_;
};

struct Prepared {
  std::vector<std::vector<BlockKey>> keys;  // cacheable keys per request
  std::vector<std::uint32_t> extra;         // unkeyed blocks per request
};

Result<Prepared> prepare(const std::vector<TraceRequest>& trace, const ReplayOptions& o) {
  if (o.block_tokens == 0) return InvalidArgument("replay: block_tokens is 0");
  KeyNamespace ns;
  ns.model_id = "mooncake-trace";
  ns.block_tokens = o.block_tokens;
  KVTIER_ASSIGN_OR_RETURN(KeyHasher hasher, KeyHasher::create(ns));
  Prepared p;
  p.keys.reserve(trace.size());
  for (const TraceRequest& r : trace) {
    std::size_t n = r.hash_ids.size();
    std::size_t cacheable = o.cache_partial_blocks ? n : std::min<std::size_t>(n, r.input_length / o.block_tokens);
    p.keys.push_back(hasher.keys_for_ids(std::span<const std::uint64_t>(r.hash_ids.data(), cacheable)));
    p.extra.push_back(static_cast<std::uint32_t>(n - cacheable));
  }
  return p;
}

// Queue-model options, each named with its value when out of range (NaN and infinity included).
Status check_queue_options(const ReplayOptions& o) {
  if (o.lookahead && !o.queue_model)
    return InvalidArgument("replay: lookahead needs queue_model (requests are announced as they enter the queue)");
  if (!o.queue_model) return Status::Ok();
  auto positive = [](const char* name, double v) -> Status {
    if (v > 0.0 && std::isfinite(v)) return Status::Ok();
    return InvalidArgument(fmt::format("replay: {} {} is not a finite number > 0", name, v));
  };
  KVTIER_RETURN_IF_ERROR(positive("load_factor", o.load_factor));
  KVTIER_RETURN_IF_ERROR(positive("prefill_tokens_per_s", o.prefill_tokens_per_s));
  KVTIER_RETURN_IF_ERROR(positive("decode_tokens_per_s", o.decode_tokens_per_s));
  if (o.max_batch == 0) return InvalidArgument("replay: max_batch 0 is not a batch size >= 1");
  return Status::Ok();
}

// The discrete-event simulation of the queue model (replay.h, "Queue model"). `serve(i, hit_tokens)` runs
// request i through the cache at its admission; `step()` runs a take_plan() round, so that announcements
// are prefetched before the next admission. Only simulated time is used, so results are deterministic.
template <class Serve, class Step>
Status simulate_queue(const std::vector<TraceRequest>& trace, const Prepared& prep, const ReplayOptions& o,
                      CacheManager& cache, Serve& serve, Step step, ReplayResult& res) {
  const std::size_t n = trace.size();
  KVTIER_RETURN_IF_ERROR(check_queue_trace(trace));  // requests arrive in file order
  const std::uint64_t first_ms = n ? trace[0].timestamp_ms : 0;
  auto arrival = [&](std::size_t k) {
    return static_cast<double>(trace[k].timestamp_ms - first_ms) / 1000.0 / o.load_factor;
  };
  {
    // Every instant of the simulation is at most the last arrival plus all the service: a rate so small
    // that this is not a finite number of seconds would turn times into inf - inf = NaN.
    double service = 0, longest = -1;
    std::size_t longest_at = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const TraceRequest& r = trace[i];
      const double s = static_cast<double>(r.input_length) / o.prefill_tokens_per_s +
                       static_cast<double>(r.output_length) / o.decode_tokens_per_s;
      service += s;
      if (s > longest) longest = s, longest_at = i;
    }
    const double last = n ? arrival(n - 1) : 0.0;
    if (!std::isfinite(last) || !std::isfinite(last + service) || last + service > 1e15)
      return InvalidArgument(fmt::format(
          "replay: the queue model's events would run past 1e15 s: the last arrival at {} s (load_factor {}), {} s "
          "of service at prefill_tokens_per_s {} and decode_tokens_per_s {}, the longest request {}{} "
          "(input_length {}, output_length {}) {} s",
          last, o.load_factor, service, o.prefill_tokens_per_s, o.decode_tokens_per_s, longest_at + 1,
          n && trace[longest_at].line ? fmt::format(" (line {})", trace[longest_at].line) : std::string(),
          n ? trace[longest_at].input_length : 0, n ? trace[longest_at].output_length : 0, longest));
  }
  // The keys serve() admits (a request longer than the device is cut to what fits), announced as such.
  auto admitted_keys = [&](std::size_t i) {
    std::span<const BlockKey> keys = prep.keys[i];
    const std::uint32_t cap = cache.config().device_blocks;
    if (keys.size() + prep.extra[i] > cap) keys = keys.first(cap - std::min(prep.extra[i], cap));
    return keys;
  };
  struct Waiting {
    std::size_t request;
    bool announced;
    QueuedId announcement;
    double arrived;
  };
  std::deque<Waiting> waiting;
  std::priority_queue<double, std::vector<double>, std::greater<>> finishes;  // running requests' ends
  double now = 0, prefill_free = 0, depth_area = 0, wait_sum = 0;
  std::size_t next = 0;
  while (next < n || !waiting.empty() || !finishes.empty()) {
    double t = std::numeric_limits<double>::infinity();
    if (next < n) t = arrival(next);
    if (!finishes.empty()) t = std::min(t, finishes.top());
    depth_area += static_cast<double>(waiting.size()) * (t - now);
    now = t;
    while (!finishes.empty() && finishes.top() <= now) finishes.pop();
    bool announced = false;
    while (next < n && arrival(next) <= now) {
      const std::size_t i = next++;
      QueuedId id = 0;
      if (o.lookahead) {
        KVTIER_ASSIGN_OR_RETURN(id, cache.announce(admitted_keys(i)));
        ++res.announced_requests;
        announced = true;
      }
      waiting.push_back({i, o.lookahead, id, now});
    }
    if (announced) KVTIER_RETURN_IF_ERROR(step());
    while (!waiting.empty() && finishes.size() < o.max_batch) {
      const Waiting w = waiting.front();
      waiting.pop_front();
      if (w.announced) KVTIER_RETURN_IF_ERROR(cache.withdraw(w.announcement));
      std::uint64_t hit_tokens = 0;
      KVTIER_RETURN_IF_ERROR(serve(w.request, hit_tokens));
      wait_sum += now - w.arrived;
      const TraceRequest& r = trace[w.request];
      const std::uint64_t uncached = r.input_length - std::min(hit_tokens, r.input_length);
      prefill_free = std::max(now, prefill_free) + static_cast<double>(uncached) / o.prefill_tokens_per_s;
      finishes.push(prefill_free + static_cast<double>(r.output_length) / o.decode_tokens_per_s);
    }
    res.max_queue_depth = std::max<std::uint64_t>(res.max_queue_depth, waiting.size());
  }
  res.simulated_seconds = now;
  res.mean_queue_depth = now > 0 ? depth_area / now : 0.0;
  res.mean_wait_s = n ? wait_sum / static_cast<double>(n) : 0.0;
  return Status::Ok();
}

Result<ReplayResult> run(const std::vector<TraceRequest>& trace, const Prepared& prep, const ReplayOptions& o,
                         CacheConfig cfg, const std::string& label) {
  auto t0 = std::chrono::steady_clock::now();
  KVTIER_RETURN_IF_ERROR(check_queue_options(o));
  KVTIER_ASSIGN_OR_RETURN(auto cache, CacheManager::create(std::move(cfg)));
  if (o.metrics) KVTIER_RETURN_IF_ERROR(cache->attach_metrics(*o.metrics, o.metrics_labels));
  if (o.on_kv_events) KVTIER_RETURN_IF_ERROR(cache->enable_kv_events(o.block_tokens, o.kv_events_storage_medium));
  auto hand_over_events = [&] {
    if (!o.on_kv_events) return;
    std::vector<metrics::KvEvent> events = cache->take_events();
    if (!events.empty()) o.on_kv_events(std::move(events));
  };
  FakePlanExecutor::Options fo;
  fo.failure_rate = o.failure_rate;
  fo.seed = o.seed;
  fo.block_bytes = o.block_bytes;
  FakePlanExecutor fake(fo);
  const bool has_storage = cache->config().storage_blocks > 0 && cache->config().host_blocks > 0;
  std::unique_ptr<RealBytesExecutor> real;
  if (o.storage && has_storage) {
    if (o.storage->host_blocks() != cache->config().host_blocks)
      return InvalidArgument(fmt::format("replay: storage host pool has {} blocks, the host tier {}",
                                         o.storage->host_blocks(), cache->config().host_blocks));
    if (o.executor && !o.storage->shared_host())
      return InvalidArgument(
          "replay: an executor and a storage tier with its own host memory given (three tiers need "
          "ReplayStorage::create_over the executor's host space)");
    if (o.executor && o.failure_rate > 0)
      return InvalidArgument("replay: injected failures (failure_rate) need the fake device side, not an executor");
    real = std::make_unique<RealBytesExecutor>(*o.storage, o.failure_rate, o.seed, o.executor);
  }
  PlanExecutor* exec = real ? real.get() : o.executor ? o.executor : &fake;
  std::uint64_t plan_d2h = 0, plan_h2d = 0;
  // Device-side moves submitted and not yet acknowledged (evictions, backups, loads).
  std::uint64_t device_moves_out = 0;
  std::uint64_t completions_applied = 0, plans_executed = 0;
  auto poll_and_apply = [&]() -> Result<std::size_t> {
    std::vector<Completion> done = exec->poll();
    for (const Completion& c : done)
      if (c.kind == MoveKind::kEviction || c.kind == MoveKind::kBackup || c.kind == MoveKind::kLoad)
        device_moves_out -= std::min<std::uint64_t>(device_moves_out, c.dst.size());
    const std::size_t n = done.size();
    completions_applied += n;
    KVTIER_RETURN_IF_ERROR(apply_completions(*cache, done));
    return n;
  };

  // Every move a step started is waited for before the next request (device<->host copies as well
  // as storage moves): the replay is a simulation without forward passes to hide them behind, and
  // landed moves make the next requests' matches, and so the hit ratio, independent of thread timing.
  auto drive = [&](AdmissionId wait_for) -> Status {
    StepPlan plan = cache->take_plan();
    plan_d2h += plan.evictions.size() + plan.backups.size();
    plan_h2d += plan.loads.size();
    device_moves_out += plan.evictions.size() + plan.backups.size() + plan.loads.size();
    if (!plan.empty()) {
      ++plans_executed;
      KVTIER_RETURN_IF_ERROR(exec->execute(plan));
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    // The moves run on other threads (the host backend's streams, storage workers) that need the cores this loop
    // would spin on: a few yields catch a move about to end, then sleeps from 5 us, doubling up to 200 us.
    std::chrono::microseconds pause{0};
    for (int spins = 0;; ++spins) {
      KVTIER_RETURN_IF_ERROR(poll_and_apply());
      const bool storage_idle = !real || real->storage_in_flight() == 0;
      const bool device_idle = device_moves_out == 0;
      bool loads_done = true;
      if (wait_for != 0) {
        KVTIER_ASSIGN_OR_RETURN(AdmissionStatus as, cache->admission_status(wait_for));
        loads_done = as.loading_blocks == 0;
      }
      if (storage_idle && device_idle && loads_done) return Status::Ok();
      if (spins >= 16 && std::chrono::steady_clock::now() > deadline)
        return TimedOut(
            fmt::format("replay: moves of admission {} never completed ({} device moves, {} storage "
                        "moves in flight)",
                        wait_for, device_moves_out, real ? real->storage_in_flight() : 0));
      if (storage_idle && device_idle) continue;  // nothing in flight to wait for
      if (spins < 16) {
        std::this_thread::yield();
      } else {
        pause = std::clamp(pause * 2, std::chrono::microseconds(5), std::chrono::microseconds(200));
        std::this_thread::sleep_for(pause);
      }
    }
  };

  ReplayResult res;
  res.policy = label;
  if (cache->config().host_blocks > 0) res.host_policy = cache->config().host_policy;
  res.device_blocks = cache->config().device_blocks;
  res.host_blocks = cache->config().host_blocks;
  res.storage_blocks = cache->config().storage_blocks;
  if (const std::size_t experts = policy_experts(cache->config().device_policy).size(); experts > 1)
    res.device_lead_requests.assign(experts, 0);
  const std::uint32_t bt = o.block_tokens;
  // One request through the cache: admit (after a storage prefetch of its prefix), load, commit, release.
  // hit_tokens: its input tokens served from the cache (what prefill skips).
  std::uint64_t served = 0;
  auto serve = [&](std::size_t i, std::uint64_t& hit_tokens) -> Status {
    hit_tokens = 0;
    const TraceRequest& r = trace[i];
    std::span<const BlockKey> keys = prep.keys[i];
    std::uint32_t extra = prep.extra[i];
    res.total_blocks += r.hash_ids.size();
    res.cacheable_blocks += keys.size();
    res.total_tokens += r.input_length;
    ++res.requests;
    if (keys.size() + extra > res.device_blocks) {  // longer than the device: cache what fits
      ++res.truncated_requests;
      extra = std::min<std::uint32_t>(extra, res.device_blocks);
      keys = keys.first(res.device_blocks - extra);
    }
    // The prefix continues in storage: fetch it to host and wait, so the admission loads it.
    std::uint32_t fetch_base = 0, fetched = 0;
    if (has_storage) {
      MatchResult m = cache->match(keys);
      if (m.storage_blocks > 0) {
        fetch_base = m.device_blocks + m.host_blocks;
        // Write-back: a host tier full of dirty blocks first writes them to storage to make room
        // (prefetch() queues what fits now); wait for those writes and fetch the rest.
        for (int round = 0; round < 4; ++round) {
          const std::uint64_t demotions = cache->stats().pressure_demotions;
          KVTIER_ASSIGN_OR_RETURN(std::uint32_t queued, cache->prefetch(keys));
          fetched += queued;
          const bool room_coming = cache->stats().pressure_demotions > demotions;
          if (queued == 0 && !room_coming) break;
          KVTIER_RETURN_IF_ERROR(drive(0));
          if (!room_coming) break;
        }
      }
    }
    auto adm = cache->admit(keys, extra);
    // A refused admission may have queued evictions and demotions (blocks moved down a tier, dirty host blocks
    // written to storage to make room): once their acks are in, the same admission can succeed (admit()'s
    // contract). Retry while each round had moves to run; a round that queued nothing cannot make room. (Only a
    // growth of pressure_demotions was retried, once: a host tier smaller than the device's working set then
    // refused admissions that a retry serves, and the hit ratio fell below that of no host tier at all.)
    for (int round = 0; !adm.ok() && adm.status().code() == StatusCode::kResourceExhausted && round < 8; ++round) {
      const std::uint64_t plans_before = plans_executed;
      KVTIER_RETURN_IF_ERROR(drive(0));
      if (plans_executed == plans_before) break;
      adm = cache->admit(keys, extra);
    }
    // No device move is in flight here (drive() waits for all of them), so a device block still being copied
    // never makes an admission fail.
    if (!adm.ok()) {
      ++res.failed_admissions;
      return Status::Ok();
    }
    KVTIER_RETURN_IF_ERROR(drive(adm->id));
    KVTIER_ASSIGN_OR_RETURN(AdmissionStatus as, cache->admission_status(adm->id));
    const std::uint32_t ready = as.ready_blocks;
    std::uint32_t dev = std::min(adm->device_hit_blocks, ready);
    std::uint32_t sto = ready > fetch_base && fetched ? std::min(ready, fetch_base + fetched) - fetch_base : 0;
    sto = std::min(sto, ready - dev);
    std::uint32_t host = ready - dev - sto;
    res.device_hit_blocks += dev;
    res.host_hit_blocks += host;
    res.storage_hit_blocks += sto;
    std::uint64_t dev_tokens = std::min<std::uint64_t>(std::uint64_t{dev} * bt, r.input_length);
    std::uint64_t dh_tokens = std::min<std::uint64_t>(std::uint64_t{dev + host} * bt, r.input_length);
    std::uint64_t all_tokens = std::min<std::uint64_t>(std::uint64_t{ready} * bt, r.input_length);
    res.device_hit_tokens += dev_tokens;
    res.host_hit_tokens += dh_tokens - dev_tokens;
    res.storage_hit_tokens += all_tokens - dh_tokens;
    hit_tokens = all_tokens;
    if (as.failed) {  // a load failed: recompute from scratch (a fresh admission in a real engine)
      KVTIER_RETURN_IF_ERROR(cache->release(adm->id));
    } else {
      KVTIER_RETURN_IF_ERROR(cache->commit_all(adm->id));
      KVTIER_RETURN_IF_ERROR(cache->release(adm->id));
    }
    KVTIER_RETURN_IF_ERROR(drive(0));
    if (!res.device_lead_requests.empty()) {
      const std::uint32_t lead = cache->stats().tiers[static_cast<int>(Tier::kDevice)].policy_expert;
      if (lead < res.device_lead_requests.size()) ++res.device_lead_requests[lead];
    }
    if (o.on_request) {
      res.bytes_d2h = plan_d2h * o.block_bytes;
      res.bytes_h2d = plan_h2d * o.block_bytes;
      res.failed_transfers = cache->stats().failed_transfers;
      o.on_request(res, *cache);
    }
    hand_over_events();
    if (o.check_invariants_every && ++served % o.check_invariants_every == 0)
      KVTIER_RETURN_IF_ERROR(cache->check_invariants().with_context(fmt::format("after request {}", i)));
    return Status::Ok();
  };
  if (o.queue_model) {
    KVTIER_RETURN_IF_ERROR(simulate_queue(
        trace, prep, o, *cache, serve, [&] { return drive(0); }, res));
  } else {
    std::uint64_t hit_tokens = 0;
    for (std::size_t i = 0; i < trace.size(); ++i) KVTIER_RETURN_IF_ERROR(serve(i, hit_tokens));
  }
  // Drain: report only once every move the replay started is acknowledged (the evictions of the last
  // requests too), and the plans those acknowledgements produce (store-through writes) have run as well.
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (;;) {
    const std::uint64_t acks_before = completions_applied, plans_before = plans_executed;
    KVTIER_RETURN_IF_ERROR(drive(0));  // runs what the last acknowledgements planned, and polls
    const bool quiet = completions_applied == acks_before && plans_executed == plans_before;
    const bool idle =
        device_moves_out == 0 && (exec != &fake || fake.in_flight() == 0) && (!real || real->storage_in_flight() == 0);
    if (idle && quiet) break;  // nothing in flight, and no acknowledgement left a new plan behind
    if (std::chrono::steady_clock::now() > drain_until)
      return TimedOut(fmt::format("replay: {} device moves still unacknowledged after 120 s", device_moves_out));
    if (quiet) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  res.bytes_d2h = plan_d2h * o.block_bytes;
  res.bytes_h2d = plan_h2d * o.block_bytes;
  const CacheStats cs = cache->stats();
  res.failed_transfers = cs.failed_transfers;
  res.storage_writes = cs.storage_writes;
  res.storage_prefetches = cs.storage_prefetches;
  res.device_policy_switches = cs.tiers[static_cast<int>(Tier::kDevice)].policy_switches;
  if (real) {
    res.bytes_to_storage = real->storage().bytes_written();
    res.bytes_from_storage = real->storage().bytes_read();
    res.failed_prefetches = real->storage().failed_reads();
    res.failed_storage_writes = real->storage().failed_writes();
    res.verified_blocks = real->verified();
    res.verification_failures = real->verification_failures();
  } else if (exec == &fake) {
    res.bytes_to_storage = fake.bytes_to_storage();
    res.bytes_from_storage = fake.bytes_from_storage();
  }
  if (o.check_invariants_every) KVTIER_RETURN_IF_ERROR(cache->check_invariants().with_context("at the end"));
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  hand_over_events();
  if (o.on_request) o.on_request(res, *cache);
  return res;
}

CacheConfig base_config(const ReplayOptions& o) {
  CacheConfig cfg;
  cfg.device_blocks = o.device_blocks;
  cfg.host_blocks = o.host_blocks;
  cfg.device_policy = o.policy;
  cfg.host_policy = o.host_policy.empty() ? std::string(lower_tier_policy(o.policy)) : o.host_policy;
  cfg.storage_policy = o.storage_policy;
  cfg.write_policy = o.write_policy;
  cfg.write_through_threshold = o.write_through_threshold;
  cfg.storage_blocks = o.host_blocks > 0 ? o.storage_blocks : 0;
  if (cfg.storage_blocks > 0) cfg.host_watermarks = Watermarks{o.host_low_watermark, o.host_high_watermark};
  cfg.device_watermarks = o.device_watermarks;
  cfg.contiguous_host_runs = o.contiguous_host_runs;
  cfg.lookahead_prefetch_blocks = o.lookahead_prefetch_blocks;
  cfg.lookahead_max_fraction = o.lookahead_max_fraction;
  cfg.lookahead_retain_steps = o.lookahead_retain_steps;
  return cfg;
}

Result<ReplayResult> run_belady(const std::vector<TraceRequest>& trace, const Prepared& prep, std::uint32_t capacity,
                                const ReplayOptions& o) {
  // Next-use lists per key: the clock value of each admission that holds it (request i -> i + 1).
  auto index = std::make_shared<std::unordered_map<BlockKey, std::uint32_t, BlockKeyHash>>();
  auto uses = std::make_shared<std::vector<std::vector<std::uint64_t>>>();
  for (std::size_t i = 0; i < prep.keys.size(); ++i)
    for (const BlockKey& k : prep.keys[i]) {
      auto [it, inserted] = index->emplace(k, static_cast<std::uint32_t>(uses->size()));
      if (inserted) uses->emplace_back();
      (*uses)[it->second].push_back(i + 1);
    }
  CacheConfig cfg = base_config(o);
  cfg.device_blocks = capacity;
  cfg.host_blocks = 0;
  cfg.storage_blocks = 0;
  cfg.host_watermarks = Watermarks{};
  cfg.device_policy = "belady";
  cfg.host_policy = "lru";
  cfg.storage_policy = "lru";
  cfg.next_use_oracle = [index, uses](const BlockKey& key, std::uint64_t now) -> std::uint64_t {
    auto it = index->find(key);
    if (it == index->end()) return UINT64_MAX;
    const auto& v = (*uses)[it->second];
    auto u = std::upper_bound(v.begin(), v.end(), now);
    return u == v.end() ? UINT64_MAX : *u;
  };
  ReplayOptions single = o;
  single.failure_rate = 0;
  single.executor = nullptr;
  single.storage = nullptr;
  return run(trace, prep, single, std::move(cfg), "belady");
}

}  // namespace

Result<ReplayResult> replay_trace(const std::vector<TraceRequest>& trace, const ReplayOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(Prepared prep, prepare(trace, options));
  if (options.policy == "belady") return run_belady(trace, prep, options.device_blocks + options.host_blocks, options);
  return run(trace, prep, options, base_config(options), options.policy);
}

Result<ReplayResult> replay_belady(const std::vector<TraceRequest>& trace, std::uint32_t capacity_blocks,
                                   const ReplayOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(Prepared prep, prepare(trace, options));
  return run_belady(trace, prep, capacity_blocks, options);
}

ReplayResult replay_unbounded(const std::vector<TraceRequest>& trace, const ReplayOptions& o) {
  ReplayResult res;
  res.policy = "unbounded";
  // The keys the cache sees: each chained to its prefix (an id seen under another prefix is another block).
  auto prep = prepare(trace, o);
  if (!prep.ok()) return res;
  std::unordered_set<BlockKey, BlockKeyHash> seen;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::vector<BlockKey>& keys = prep->keys[i];
    ++res.requests;
    res.total_blocks += r.hash_ids.size();
    res.total_tokens += r.input_length;
    const std::size_t cacheable = keys.size();
    res.cacheable_blocks += cacheable;
    std::uint32_t hits = 0;
    while (hits < cacheable && seen.count(keys[hits])) ++hits;
    for (std::size_t k = hits; k < cacheable; ++k) seen.insert(keys[k]);
    res.device_hit_blocks += hits;
    res.device_hit_tokens += std::min<std::uint64_t>(std::uint64_t{hits} * o.block_tokens, r.input_length);
  }
  return res;
}

Result<SweepTable> sweep(const std::vector<TraceRequest>& trace, const std::vector<std::uint32_t>& capacities,
                         const std::vector<std::string>& policies, const ReplayOptions& options,
                         const SweepOptions& so) {
  if (capacities.empty()) return InvalidArgument("sweep: no capacities");
  for (std::size_t i = 0; i < capacities.size(); ++i)
    if (capacities[i] == 0)
      return InvalidArgument(fmt::format("sweep: capacity 0 (entry {}) is not a block count >= 1", i));
  if (!(so.max_multiplier >= 1.0 && std::isfinite(so.max_multiplier)))
    return InvalidArgument(fmt::format("sweep: max_multiplier {} is not a number >= 1", so.max_multiplier));
  if (!(so.multiplier_precision > 0.0 && std::isfinite(so.multiplier_precision)))
    return InvalidArgument(fmt::format("sweep: multiplier_precision {} is not a number > 0", so.multiplier_precision));
  SweepTable t;
  t.capacities = capacities;
  t.max_multiplier = so.max_multiplier;
  t.multiplier_precision = so.multiplier_precision;
  t.default_policy = so.default_policy.empty() ? CacheConfig{}.device_policy : so.default_policy;
  if (t.default_policy == "belady" || t.default_policy == "min-bypass")
    return InvalidArgument(
        fmt::format("sweep: default policy '{}' is an offline bound, not a policy", t.default_policy));
  auto add = [&t](const std::string& p) {
    if (p != "belady" && p != "min-bypass" && std::find(t.policies.begin(), t.policies.end(), p) == t.policies.end())
      t.policies.push_back(p);
  };
  for (const std::string& p : policies) add(p);
  for (const char* p : kSweepPeers) add(p);
  add(t.default_policy);
  for (const std::string& p : t.policies)
    if (auto made = make_policy(p, 1); !made.ok())
      return InvalidArgument(fmt::format("sweep: policy '{}': {}", p, made.status().message()));
  t.policies.push_back("belady");
  t.policies.push_back("min-bypass");
  KVTIER_ASSIGN_OR_RETURN(Prepared prep, prepare(trace, options));
  auto single_tier = [&options](std::uint32_t cap, const std::string& policy) {
    ReplayOptions o = options;
    o.device_blocks = cap;
    o.host_blocks = 0;
    o.storage_blocks = 0;
    o.storage = nullptr;
    o.policy = policy;
    return o;
  };
  t.results.resize(t.policies.size());
  for (std::size_t pi = 0; pi < t.policies.size(); ++pi) {
    for (std::uint32_t cap : capacities) {
      const ReplayOptions o = single_tier(cap, t.policies[pi]);
      if (o.policy == "min-bypass") {
        KVTIER_ASSIGN_OR_RETURN(ReplayResult r, replay_min_bypass(trace, cap, o));
        t.results[pi].push_back(std::move(r));
      } else if (o.policy == "belady") {
        KVTIER_ASSIGN_OR_RETURN(ReplayResult r, run_belady(trace, prep, cap, o));
        t.results[pi].push_back(std::move(r));
      } else {
        KVTIER_ASSIGN_OR_RETURN(ReplayResult r, run(trace, prep, o, base_config(o), o.policy));
        t.results[pi].push_back(std::move(r));
      }
    }
  }
  t.unbounded_hit_ratio = replay_unbounded(trace, options).hit_ratio();
  KVTIER_ASSIGN_OR_RETURN(t.class_ttl, replay_class_ttl(trace, capacities, options));

  // Memory multiplier. From `all_fit` blocks on nothing is ever evicted (every key of the trace plus the
  // largest request's blocks), so the default reaches the unbounded ratio there, which no bound exceeds.
  std::uint64_t all_fit = 1;
  {
    std::unordered_set<BlockKey, BlockKeyHash> distinct;
    std::uint64_t largest = 0;
    for (std::size_t i = 0; i < prep.keys.size(); ++i) {
      distinct.insert(prep.keys[i].begin(), prep.keys[i].end());
      largest = std::max<std::uint64_t>(largest, prep.keys[i].size() + prep.extra[i]);
    }
    all_fit = std::max<std::uint64_t>(1, distinct.size() + largest);
  }
  const std::size_t def = std::find(t.policies.begin(), t.policies.end(), t.default_policy) - t.policies.begin();
  std::unordered_map<std::uint32_t, std::uint64_t> hits_at;  // the default's hit blocks per capacity
  for (std::size_t c = 0; c < capacities.size(); ++c) hits_at[capacities[c]] = t.results[def][c].hit_blocks();
  auto default_hits = [&](std::uint32_t cap) -> Result<std::uint64_t> {
    if (auto it = hits_at.find(cap); it != hits_at.end()) return it->second;
    const ReplayOptions o = single_tier(cap, t.default_policy);
    KVTIER_ASSIGN_OR_RETURN(ReplayResult r, run(trace, prep, o, base_config(o), o.policy));
    hits_at[cap] = r.hit_blocks();
    return r.hit_blocks();
  };
  for (std::size_t c = 0; c < capacities.size(); ++c) {
    const std::uint64_t cap = capacities[c];
    const std::uint64_t target = t.results.back()[c].hit_blocks();  // min-bypass at cap
    const std::uint64_t limit = std::max<std::uint64_t>(
        cap,
        std::min<std::uint64_t>({static_cast<std::uint64_t>(std::floor(static_cast<double>(cap) * so.max_multiplier)),
                                 all_fit, 0xFFFFFFFEu}));
    std::uint64_t lo = cap, hi = 0;  // lo misses the target (or is cap), hi reaches it
    KVTIER_ASSIGN_OR_RETURN(std::uint64_t at_cap, default_hits(static_cast<std::uint32_t>(cap)));
    if (at_cap >= target) {
      hi = cap;
    } else {
      for (std::uint64_t x = cap; x < limit;) {
        x = std::min(limit, 2 * x);
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t h, default_hits(static_cast<std::uint32_t>(x)));
        if (h >= target) {
          hi = x;
          break;
        }
        lo = x;
      }
      while (hi != 0 && hi - lo > 1 &&
             static_cast<double>(hi) > static_cast<double>(lo) * (1.0 + so.multiplier_precision)) {
        const std::uint64_t mid = lo + (hi - lo) / 2;
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t h, default_hits(static_cast<std::uint32_t>(mid)));
        (h >= target ? hi : lo) = mid;
      }
    }
    t.multiplier_capacity.push_back(static_cast<std::uint32_t>(hi));
    t.memory_multiplier.push_back(hi ? static_cast<double>(hi) / static_cast<double>(cap)
                                     : std::numeric_limits<double>::infinity());
  }
  return t;
}

namespace {
// The two bound columns (belady, min-bypass) close the table.
constexpr std::size_t kBoundColumns = 2;

// Index of the best online policy at capacity column c.
std::size_t best_policy(const SweepTable& t, std::size_t c) {
  std::size_t best = 0;
  for (std::size_t p = 0; p + kBoundColumns < t.policies.size(); ++p)
    if (t.results[p][c].hit_ratio() > t.results[best][c].hit_ratio()) best = p;
  return best;
}

// Column of `name` among the online policies; policies.size() when absent.
std::size_t column_of(const SweepTable& t, const std::string& name) {
  for (std::size_t p = 0; p + kBoundColumns < t.policies.size(); ++p)
    if (t.policies[p] == name) return p;
  return t.policies.size();
}

// The best peer (kSweepPeers) other than the default at capacity column c; policies.size() when none.
std::size_t best_peer(const SweepTable& t, std::size_t c) {
  std::size_t best = t.policies.size();
  for (const char* peer : kSweepPeers) {
    const std::size_t p = column_of(t, peer);
    if (p == t.policies.size() || t.policies[p] == t.default_policy) continue;
    if (best == t.policies.size() || t.results[p][c].hit_ratio() > t.results[best][c].hit_ratio()) best = p;
  }
  return best;
}

// "lru" is leaf-first LRU: the manager evicts only leaves of a tier and reports a path's accesses
// deepest first, so a parent is never older than its children; vLLM's free-block queue (a finished
// request's blocks appended deepest first, taken from the front) and SGLang's radix cache (the least
// recently used evictable leaf) evict in that order.
std::string column_label(const SweepTable& t, const std::string& p) {
  std::string label = p;
  if (p == "belady") label = "belady (no bypass)";
  if (p == "lru") label = "lru (leaf-first LRU, as vLLM and SGLang)";
  if (p == t.default_policy) label += " [default]";
  return label;
}

std::string multiplier_text(const SweepTable& t, std::size_t c) {
  if (c >= t.memory_multiplier.size()) return "-";
  if (std::isinf(t.memory_multiplier[c])) return fmt::format(">{:g}x", t.max_multiplier);
  return fmt::format("{:.2f}x", t.memory_multiplier[c]);
}
}  // namespace

std::string sweep_markdown(const SweepTable& t, std::uint32_t block_tokens) {
  const std::size_t def = column_of(t, t.default_policy);
  const bool has_def = def < t.policies.size();
  const bool has_cv = t.class_ttl.size() == t.capacities.size();
  std::string out = "| capacity (blocks) | capacity (tokens) |";
  for (const auto& p : t.policies) out += fmt::format(" {} |", column_label(t, p));
  out += " best online | best / MIN-bypass |";
  if (has_def) out += fmt::format(" {} (default) / MIN-bypass |", t.default_policy);
  if (has_cv) out += " class-TTL bound (cross-validated) |";
  if (has_def && has_cv) out += fmt::format(" {} (default) / class-TTL bound |", t.default_policy);
  if (has_def) out += fmt::format(" {} (default) - best peer |", t.default_policy);
  if (has_def) out += fmt::format(" memory multiplier ({}) |", t.default_policy);
  out += "\n|---:|---:|";
  for (std::size_t i = 0; i < t.policies.size(); ++i) out += "---:|";
  out += "---|---:|";
  if (has_def) out += "---:|";
  if (has_cv) out += "---:|";
  if (has_def && has_cv) out += "---:|";
  if (has_def) out += "---|---:|";
  out += "\n";
  const std::size_t bound = t.policies.size() - 1;
  // A share of nothing is not 100 %: "n/a" where the reference (MIN, the bound) is 0.
  auto share = [&](double v, double of) -> std::string {
    return of > 0 ? fmt::format("{:.1f}%", 100.0 * v / of) : std::string("n/a");
  };
  for (std::size_t c = 0; c < t.capacities.size(); ++c) {
    const double min_bypass = t.results[bound][c].hit_ratio();
    out += fmt::format("| {} | {} |", t.capacities[c], std::uint64_t{t.capacities[c]} * block_tokens);
    for (std::size_t p = 0; p < t.policies.size(); ++p) out += fmt::format(" {:.4f} |", t.results[p][c].hit_ratio());
    const std::size_t b = best_policy(t, c);
    out += fmt::format(" {} | {} |", t.policies[b], share(t.results[b][c].hit_ratio(), min_bypass));
    if (has_def) out += fmt::format(" {} |", share(t.results[def][c].hit_ratio(), min_bypass));
    if (has_cv) out += fmt::format(" {:.4f} |", t.class_ttl[c].cross_validated);
    if (has_def && has_cv)
      out += fmt::format(" {} |", share(t.results[def][c].hit_ratio(), t.class_ttl[c].cross_validated));
    if (has_def) {
      const std::size_t peer = best_peer(t, c);
      if (peer < t.policies.size())
        out += fmt::format(" {:+.4f} ({}) |", t.results[def][c].hit_ratio() - t.results[peer][c].hit_ratio(),
                           t.policies[peer]);
      else
        out += " - |";
      out += fmt::format(" {} |", multiplier_text(t, c));
    }
    out += "\n";
  }
  out += fmt::format(
      "\nBlock hit ratio (hit blocks / all blocks), one tier of C blocks. min-bypass: MIN with bypass, the offline "
      "optimum of any policy; belady (no bypass): the cache manager with the oracle eviction policy, keeping each "
      "request resident. Unbounded capacity: {:.4f}.\n",
      t.unbounded_hit_ratio);
  if (has_cv)
    out +=
        "class-TTL bound (cross-validated): the best policy that keeps a block for a time-to-live chosen by its use "
        "count so far and the distance of its last reuse, with those TTLs fitted on one half of the requests and "
        "scored on the other, both ways (halves by conversation: a request that re-reads a previous request's whole "
        "input continues its conversation; a conversation's half is a hash of its first request); residency "
        "budgeted on average, hits counted per block. The hindsight value (fitted and scored on the whole trace, "
        "bench/trace_bounds.py's class_ttl) is in the CSV.\n";
  if (has_def)
    out += fmt::format(
        "{0} is the CacheConfig default (or the sweep's --sweep-default). best peer: the best of leaf-first LRU "
        "(lru), S3-FIFO and SIEVE other than the default; negative: the default is below it. memory multiplier: "
        "the capacity {0} needs to reach min-bypass's hit ratio at C, as a multiple of C (doubling, then bisection "
        "to {1:g}%; >{2:g}x: not reached within {2:g}C).\n",
        t.default_policy, 100.0 * t.multiplier_precision, t.max_multiplier);
  return out;
}

std::string sweep_csv(const SweepTable& t, std::uint32_t block_tokens) {
  const bool has_cv = t.class_ttl.size() == t.capacities.size();
  const bool has_mult = t.memory_multiplier.size() == t.capacities.size();
  std::string out = "capacity_blocks,capacity_tokens";
  for (const auto& p : t.policies) out += "," + p;
  if (has_cv) out += ",class_ttl_cv,class_ttl_hindsight";
  if (has_mult) out += ",memory_multiplier_" + t.default_policy;
  out += "\n";
  for (std::size_t c = 0; c < t.capacities.size(); ++c) {
    out += fmt::format("{},{}", t.capacities[c], std::uint64_t{t.capacities[c]} * block_tokens);
    for (std::size_t p = 0; p < t.policies.size(); ++p) out += fmt::format(",{:.6f}", t.results[p][c].hit_ratio());
    if (has_cv) out += fmt::format(",{:.6f},{:.6f}", t.class_ttl[c].cross_validated, t.class_ttl[c].hindsight);
    if (has_mult)
      out += std::isinf(t.memory_multiplier[c]) ? std::string(",inf") : fmt::format(",{:.4f}", t.memory_multiplier[c]);
    out += "\n";
  }
  return out;
}

std::string sweep_svg(const SweepTable& t, std::uint32_t block_tokens) {
  const double W = 760, H = 460, L = 70, R = 170, T = 30, B = 60;
  double xmin = std::log10(std::max(1u, *std::min_element(t.capacities.begin(), t.capacities.end())));
  double xmax = std::log10(std::max(1u, *std::max_element(t.capacities.begin(), t.capacities.end())));
  if (xmax <= xmin) xmax = xmin + 1;
  double ymax = std::max(0.05, t.unbounded_hit_ratio);
  for (const auto& row : t.results)
    for (const auto& r : row) ymax = std::max(ymax, r.hit_ratio());
  for (const ClassTtlBound& b : t.class_ttl) ymax = std::max(ymax, b.cross_validated);
  ymax = std::ceil(ymax * 20) / 20;
  auto X = [&](double cap) { return L + (std::log10(std::max(1.0, cap)) - xmin) / (xmax - xmin) * (W - L - R); };
  auto Y = [&](double v) { return H - B - v / ymax * (H - T - B); };
  static const char* colors[] = {"#d62728", "#1f77b4", "#2ca02c", "#9467bd",
                                 "#8c564b", "#e377c2", "#17becf", "#000000"};
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      W, H);
  s += fmt::format(
      "<text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">Prefix-cache block hit ratio vs "
      "capacity</text>\n",
      (W - R + L) / 2);
  for (int i = 0; i <= 5; ++i) {
    double v = ymax * i / 5;
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L, Y(v), W - R, Y(v));
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.2f}</text>\n", L - 6, Y(v) + 4, v);
  }
  for (std::uint32_t cap : t.capacities) {
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#eee\"/>\n", X(cap), T, X(cap),
                     H - B);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", X(cap), H - B + 16, cap);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">capacity (blocks of {} tokens, log scale)</text>\n",
                   (W - R + L) / 2, H - 18, block_tokens);
  s += fmt::format("<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">hit ratio</text>\n",
                   (H - B + T) / 2, (H - B + T) / 2);
  s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#999\" stroke-dasharray=\"4 4\"/>\n",
                   L, Y(t.unbounded_hit_ratio), W - R, Y(t.unbounded_hit_ratio));
  double ly = T + 20;
  auto legend = [&](const std::string& color, const char* dash, const std::string& label) {
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"{}/>\n", W - R + 15,
                     ly, W - R + 40, ly, color, dash);
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", W - R + 46, ly + 4, label);
    ly += 20;
  };
  for (std::size_t p = 0; p < t.policies.size(); ++p) {
    const bool bound = t.policies[p] == "belady" || t.policies[p] == "min-bypass";
    const char* color = colors[p % 7];
    if (t.policies[p] == "min-bypass") color = "#000000";
    if (t.policies[p] == "belady") color = "#7f7f7f";
    std::string pts;
    for (std::size_t c = 0; c < t.capacities.size(); ++c)
      pts += fmt::format("{:.1f},{:.1f} ", X(t.capacities[c]), Y(t.results[p][c].hit_ratio()));
    s += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} points=\"{}\"/>\n", color,
                     bound ? " stroke-dasharray=\"6 3\"" : "", pts);
    legend(color, bound ? " stroke-dasharray=\"6 3\"" : "",
           t.policies[p] == t.default_policy ? t.policies[p] + " (default)" : t.policies[p]);
  }
  if (t.class_ttl.size() == t.capacities.size()) {
    const char* color = "#bcbd22";
    std::string pts;
    for (std::size_t c = 0; c < t.capacities.size(); ++c)
      pts += fmt::format("{:.1f},{:.1f} ", X(t.capacities[c]), Y(t.class_ttl[c].cross_validated));
    s += fmt::format(
        "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"2 3\" points=\"{}\"/>\n", color,
        pts);
    legend(color, " stroke-dasharray=\"2 3\"", "class-TTL (CV)");
  }
  legend("#999", " stroke-dasharray=\"4 4\"", "unbounded");
  s += "</svg>\n";
  return s;
}

}  // namespace kvtier::cache
