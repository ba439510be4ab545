// `kvtier replay [TRACE.jsonl]`: runs the cache manager over a Mooncake-format trace.
// Configuration: KVTIER_CACHE_* env vars (docs/configuration.md) replace the defaults of the matching
// flags (device/host/storage blocks, device_policy -> --policy, write policy, threshold) and set the host
// watermarks; flags given on the command line override them. KVTIER_TRANSFER_* configure the
// TransferManager of --transfer host|cuda.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kvtier/cache/cache_config.h"
#include "kvtier/cache/multi_rank_executor.h"
#include "kvtier/cache/transfer_executor.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "kvtier/metrics/http_server.h"
#include "kvtier/metrics/zmq_publisher.h"
#include "kvtier/storage/storage_config.h"
#include "kvtier/testing/plan_executors.h"
#include "kvtier/transfer/transfer_config.h"
#include "kvtier/transfer/transfer_manager.h"
#include "sim/replay.h"
#include "tools/cli.h"
#include "tools/replay_metrics.h"

extern char** environ;

namespace kvtier::cli {
namespace {

constexpr const char* kDefaultTrace = "data/traces/mooncake_sample.jsonl";

// The committed sample, found from the working directory or from the binary (build/tools/kvtier).
std::string resolve_trace(const std::string& path) {
  namespace fs = std::filesystem;
  if (path != kDefaultTrace || fs::exists(path)) return path;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return path;
  for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.parent_path(); dir = dir.parent_path())
    if (fs::exists(dir / kDefaultTrace)) return (dir / kDefaultTrace).string();
  return path;
}

// A comma-separated flag value: items with the spaces around them trimmed. An empty item ("1,,2", "1,", " ")
// is an error naming the flag (it was dropped silently), as is a value with no item.
std::optional<std::string> parse_list(std::string_view flag, const std::string& s, std::vector<std::string>& out,
                                      std::string_view example) {
  std::size_t start = 0;
  for (std::size_t n = 1;; ++n) {
    const std::size_t comma = s.find(',', start);
    std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const std::size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    if (first == std::string::npos)
      return fmt::format("{} '{}': item {} is empty (a comma-separated list, e.g. {})", flag, s, n, example);
    out.push_back(item.substr(first, last - first + 1));
    if (comma == std::string::npos) return std::nullopt;
    start = comma + 1;
  }
}

// Per expert of a dueling device policy, in order: its name (a view into r.policy) and the share of requests it led.
// Empty for other policies.
std::vector<std::pair<std::string_view, double>> lead_shares(const cache::ReplayResult& r) {
  std::vector<std::pair<std::string_view, double>> shares;
  std::uint64_t all = 0;
  for (std::uint64_t n : r.device_lead_requests) all += n;
  const std::vector<std::string_view> experts = cache::policy_experts(r.policy);
  for (std::size_t e = 0; e < r.device_lead_requests.size() && e < experts.size(); ++e)
    shares.emplace_back(experts[e], all ? static_cast<double>(r.device_lead_requests[e]) / double(all) : 0.0);
  return shares;
}

nlohmann::json lead_shares_json(const cache::ReplayResult& r) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [expert, share] : lead_shares(r)) j[std::string(expert)] = share;
  return j;
}

nlohmann::json to_json(const cache::ReplayResult& r) {
  return {{"policy", r.policy},
          {"host_policy", r.host_policy},
          {"policy_lead_share", lead_shares_json(r)},
          {"policy_switches", r.device_policy_switches},
          {"device_blocks", r.device_blocks},
          {"host_blocks", r.host_blocks},
          {"requests", r.requests},
          {"total_blocks", r.total_blocks},
          {"cacheable_blocks", r.cacheable_blocks},
          {"hit_ratio", r.hit_ratio()},
          {"device_hit_ratio", r.device_hit_ratio()},
          {"host_hit_ratio", r.host_hit_ratio()},
          {"storage_blocks", r.storage_blocks},
          {"storage_hit_ratio", r.storage_hit_ratio()},
          {"storage_hit_blocks", r.storage_hit_blocks},
          {"storage_writes", r.storage_writes},
          {"storage_prefetches", r.storage_prefetches},
          {"failed_prefetches", r.failed_prefetches},
          {"failed_storage_writes", r.failed_storage_writes},
          {"bytes_to_storage", r.bytes_to_storage},
          {"bytes_from_storage", r.bytes_from_storage},
          {"verified_blocks", r.verified_blocks},
          {"verification_failures", r.verification_failures},
          {"token_hit_ratio", r.token_hit_ratio()},
          {"device_hit_blocks", r.device_hit_blocks},
          {"host_hit_blocks", r.host_hit_blocks},
          {"total_tokens", r.total_tokens},
          {"prefill_tokens_saved", r.device_hit_tokens + r.host_hit_tokens + r.storage_hit_tokens},
          {"bytes_d2h", r.bytes_d2h},
          {"bytes_h2d", r.bytes_h2d},
          {"failed_transfers", r.failed_transfers},
          {"truncated_requests", r.truncated_requests},
          {"failed_admissions", r.failed_admissions},
          {"seconds", r.seconds}};
}

// `--queue`: per load factor, the queue model's hit ratio without (and with --lookahead, with) look-ahead,
// the queue depth and wait, and the same capacity's hit ratio without the queue model for reference.
int run_load_table(const std::vector<cache::TraceRequest>& trace, const std::string& path,
                   const cache::ReplayOptions& base, const std::vector<double>& loads, bool lookahead, bool json) {
  const auto start = std::chrono::steady_clock::now();
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "kvtier replay: %s\n", s.to_string().c_str());
    return 1;
  };
  if (Status st = cache::check_queue_trace(trace); !st.ok()) return fail(st);  // before the reference replay
  auto reference = cache::replay_trace(trace, base);
  if (!reference.ok()) return fail(reference.status());
  struct Row {
    double load;
    cache::ReplayResult plain, ahead;
  };
  std::vector<Row> rows;
  for (double load : loads) {
    cache::ReplayOptions o = base;
    o.queue_model = true;
    o.load_factor = load;
    Row row{load, {}, {}};
    auto plain = cache::replay_trace(trace, o);
    if (!plain.ok()) return fail(plain.status());
    row.plain = *plain;
    if (lookahead) {
      o.lookahead = true;
      auto ahead = cache::replay_trace(trace, o);
      if (!ahead.ok()) return fail(ahead.status());
      row.ahead = *ahead;
    }
    rows.push_back(std::move(row));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (json) {
    nlohmann::json j;
    j["trace"] = path;
    j["policy"] = base.policy;
    j["device_blocks"] = base.device_blocks;
    j["host_blocks"] = base.host_blocks;
    j["prefill_tokens_per_s"] = base.prefill_tokens_per_s;
    j["decode_tokens_per_s"] = base.decode_tokens_per_s;
    j["max_batch"] = base.max_batch;
    j["no_queue_hit_ratio"] = reference->hit_ratio();
    for (const Row& r : rows) {
      auto side = [](const cache::ReplayResult& x) {
        return nlohmann::json{{"hit_ratio", x.hit_ratio()},
                              {"token_hit_ratio", x.token_hit_ratio()},
                              {"mean_queue_depth", x.mean_queue_depth},
                              {"max_queue_depth", x.max_queue_depth},
                              {"mean_wait_s", x.mean_wait_s},
                              {"simulated_seconds", x.simulated_seconds},
                              {"failed_admissions", x.failed_admissions}};
      };
      nlohmann::json e{{"load", r.load}, {"queue", side(r.plain)}};
      if (lookahead) e["lookahead"] = side(r.ahead);
      j["loads"].push_back(e);
    }
    j["seconds"] = seconds;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::string out = fmt::format("trace: {} ({} requests), policy {}, {} device + {} host blocks\n\n", path,
                                trace.size(), base.policy, base.device_blocks, base.host_blocks);
  out += "| load | hit ratio, no queue model | hit ratio, queue |";
  if (lookahead) out += " hit ratio, queue + look-ahead | look-ahead gain |";
  out += " mean queue depth | max queue depth | mean wait (s) |\n|---:|---:|---:|";
  if (lookahead) out += "---:|---:|";
  out += "---:|---:|---:|\n";
  for (const Row& r : rows) {
    out += fmt::format("| {:g}x | {:.4f} | {:.4f} |", r.load, reference->hit_ratio(), r.plain.hit_ratio());
    if (lookahead) {
      out += fmt::format(" {:.4f} | {:+.4f} |", r.ahead.hit_ratio(), r.ahead.hit_ratio() - r.plain.hit_ratio());
      out += fmt::format(" {:.1f} / {:.1f} | {} / {} | {:.1f} / {:.1f} |\n", r.plain.mean_queue_depth,
                         r.ahead.mean_queue_depth, r.plain.max_queue_depth, r.ahead.max_queue_depth,
                         r.plain.mean_wait_s, r.ahead.mean_wait_s);
    } else {
      out += fmt::format(" {:.1f} | {} | {:.1f} |\n", r.plain.mean_queue_depth, r.plain.max_queue_depth,
                         r.plain.mean_wait_s);
    }
  }
  out += fmt::format(
      "\nBlock hit ratio (hit blocks / all blocks). load: arrival-rate multiplier of the trace's timestamps. Service "
      "model: {:g} uncached prompt tokens/s of prefill (serialized), {:g} output tokens/s per sequence, at most {} "
      "running (model-level assumptions, not measurements). Queue depth: waiting requests, mean over simulated "
      "time{}.\n\nload table time {:.1f} s\n",
      base.prefill_tokens_per_s, base.decode_tokens_per_s, base.max_batch,
      lookahead ? "; depth and wait as without / with look-ahead" : "", seconds);
  std::printf("%s", out.c_str());
  return 0;
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  return static_cast<bool>(f);
}

}  // namespace

Action register_replay(CLI::App& app) {
  struct Args {
    std::string trace = kDefaultTrace;
    std::uint32_t device_blocks = 2048, host_blocks = 8192;
    std::uint64_t device_tokens = 0, host_tokens = 0;
    std::string policy = "adaptive";
    std::string write_policy = "write_back";
    std::uint32_t threshold = 2;
    std::uint32_t block_tokens = 512;
    std::uint64_t block_bytes = cache::kDefaultReplayBlockBytes;
    bool cache_partial = false;
    double failure_rate = 0;
    std::uint64_t seed = 1;
    std::size_t max_requests = 0;
    bool json = false;
    std::string sweep;
    std::string sweep_policies = "lru,s3fifo,sieve,arc,lrfu,adaptive";
    std::string sweep_default;
    double sweep_max_multiplier = 16;
    std::string out = "replay_sweep";
    std::uint32_t check_every = 0;
    std::string storage;
    std::uint32_t storage_blocks = 65536;
    std::string transfer = "host";
    std::uint16_t metrics_port = 0;
    std::string metrics_out;
    bool progress = false;
    std::string kv_events;
    std::string kv_events_replay;
    std::string kv_events_encoding = "map";
    std::uint32_t tp = 1;
    std::uint32_t tp_gpus = 0;
    std::int64_t failure_rank = -1;
    std::uint64_t rank_deadline_ms = 30000;
    bool queue = false;
    std::string loads = "0.5,1,2";
    bool lookahead = false;
    double prefill_tps = cache::ReplayOptions{}.prefill_tokens_per_s;
    double decode_tps = cache::ReplayOptions{}.decode_tokens_per_s;
    std::uint32_t max_batch = cache::ReplayOptions{}.max_batch;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("replay", "Replay a Mooncake-format trace through the cache manager");
  cmd->add_option("trace", args->trace, "trace file (JSON lines: timestamp, input_length, output_length, hash_ids)")
      ->capture_default_str();
  cmd->add_option("--device-blocks", args->device_blocks, "device tier capacity in blocks")->capture_default_str();
  cmd->add_option("--host-blocks", args->host_blocks, "host tier capacity in blocks (0: no host tier)")
      ->capture_default_str();
  // CLI11 reads "-3" into an unsigned 64-bit option as 2^64-3: negative values are refused up front.
  cmd->add_option("--device-tokens", args->device_tokens, "device capacity in tokens (overrides --device-blocks)")
      ->check(kAtLeastZero);
  cmd->add_option("--host-tokens", args->host_tokens, "host capacity in tokens (overrides --host-blocks)")
      ->check(kAtLeastZero);
  cmd->add_option("--policy", args->policy,
                  "eviction policy: adaptive, lru, s3fifo, sieve, arc, lrfu[:boost], duel:A+B[+...], belady (the host "
                  "tier follows it; a duel's first expert there)")
      ->capture_default_str();
  cmd->add_option("--write-policy", args->write_policy, "write_back, write_through, write_through_selective")
      ->capture_default_str();
  cmd->add_option("--write-through-threshold", args->threshold, "hits before a selective backup")
      ->capture_default_str();
  cmd->add_option("--block-tokens", args->block_tokens, "tokens per block of the trace")->capture_default_str();
  auto* block_bytes_opt =
      cmd->add_option(
             "--block-bytes", args->block_bytes,
             "KV bytes per block: byte counters on the fake executor (--transfer none); bytes moved per block with "
             "real transfers (--transfer host|cuda) or --storage, 4096 by default then")
          ->capture_default_str()
          ->check(kAtLeastZero);
  cmd->add_option("--storage", args->storage,
                  "storage tier moving real, verified bytes: disk:<dir>[?...], redis://host:port[?...] or "
                  "memory:?capacity=<bytes>");
  cmd->add_option("--storage-blocks", args->storage_blocks, "storage tier capacity in blocks (with --storage)")
      ->capture_default_str();
  cmd->add_flag("--cache-partial-blocks", args->cache_partial, "also index each request's partial last block");
  cmd->add_option("--failure-rate", args->failure_rate,
                  "inject transfer failures with this probability (with --transfer host|cuda: moves run and are "
                  "reported failed, on --failure-rank or rank 0)");
  cmd->add_option("--seed", args->seed, "seed of injected failures");
  cmd->add_option("--max-requests", args->max_requests, "replay only the first N requests")->check(kAtLeastZero);
  cmd->add_flag("--json", args->json, "machine-readable output");
  cmd->add_option("--transfer", args->transfer,
                  "device<->host bytes: host (TransferManager on the simulated host device, default), cuda (on the "
                  "GPU), none (fake executor). With --storage: device, host and storage tiers together.")
      ->capture_default_str();
  cmd->add_option("--tp", args->tp,
                  "tensor-parallel ranks (with --transfer host|cuda): one TransferManager per rank (GPU r for rank "
                  "r with cuda), each holding --block-bytes / N of every block; one cache plan drives them all")
      ->capture_default_str();
  cmd->add_option("--tp-gpus", args->tp_gpus,
                  "with --tp and --transfer cuda: GPUs the ranks share, rank r on GPU r % N (0: one GPU per rank)")
      ->capture_default_str();
  cmd->add_option("--failure-rank", args->failure_rank,
                  "inject --failure-rate failures on this rank only (default 0; real transfers on every rank)")
      ->check(kAtLeastZero);
  cmd->add_option("--rank-deadline-ms", args->rank_deadline_ms,
                  "with --tp: a move that a rank has not reported by then fails (TimedOut) on all ranks")
      ->capture_default_str()
      ->check(kAtLeastOne);
  cmd->add_option("--sweep", args->sweep, "comma-separated device capacities (blocks): hit ratio table + plot");
  cmd->add_option("--sweep-policies", args->sweep_policies,
                  "policies of the sweep (Belady, MIN with bypass, the class-TTL bound and the peers lru, s3fifo, "
                  "sieve are always added)")
      ->capture_default_str();
  cmd->add_option("--sweep-default", args->sweep_default,
                  "the policy the sweep calls the default: its share of the bounds, its distance to the peers and "
                  "its memory multiplier (default: the CacheConfig default device policy)");
  cmd->add_option("--sweep-max-multiplier", args->sweep_max_multiplier,
                  "largest memory multiplier the sweep searches (capacities up to this times each swept one)")
      ->capture_default_str();
  cmd->add_flag("--queue", args->queue,
                "queue model: arrivals at the trace's timestamps / each --load, a FIFO queue and a service model; "
                "prints a load table (hit ratio, queue depth) against the replay without the queue model");
  cmd->add_option("--load", args->loads, "with --queue: comma-separated arrival-rate multipliers (each > 0)")
      ->capture_default_str();
  cmd->add_flag("--lookahead", args->lookahead,
                "with --queue: also run with look-ahead (each queued request announced until its admission)");
  // Defaults: model-level assumptions for a 7B model on one H200 (ReplayOptions), not measurements.
  cmd->add_option("--prefill-tokens-per-s", args->prefill_tps,
                  "with --queue: uncached prompt tokens prefilled per second (cached tokens cost nothing)")
      ->capture_default_str();
  cmd->add_option("--decode-tokens-per-s", args->decode_tps, "with --queue: output tokens per second per sequence")
      ->capture_default_str();
  cmd->add_option("--max-batch", args->max_batch, "with --queue: most requests running at once")->capture_default_str();
  cmd->add_option("--out", args->out, "sweep output prefix: PREFIX.md, PREFIX.csv, PREFIX.svg")->capture_default_str();
  cmd->add_option("--check-invariants", args->check_every, "check the index invariants every N requests (slow)");
  cmd->add_option("--metrics-port", args->metrics_port, "serve Prometheus /metrics on 127.0.0.1:PORT while it runs");
  cmd->add_option("--metrics-out", args->metrics_out, "write the final /metrics scrape to FILE");
  cmd->add_flag("--progress", args->progress, "progress line on stderr: hit ratio, bytes moved, throughput");
  cmd->add_option("--kv-events", args->kv_events,
                  "publish KV events (vLLM's schema) on a ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557");
  cmd->add_option("--kv-events-replay", args->kv_events_replay,
                  "ZMQ ROUTER endpoint where a subscriber that missed batches asks for them again");
  cmd->add_option("--kv-events-encoding", args->kv_events_encoding,
                  "map: each event a tagged map, as vLLM 0.34 writes them; array: the array_like events of earlier "
                  "vLLM releases")
      ->capture_default_str();

  return [cmd, args, block_bytes_opt]() -> int {
    if (!cmd->parsed()) return -1;
    Args& a = *args;
    // Env first (as a CacheConfig holding replay's defaults), then the flags given on the command line.
    const cache::ReplayOptions replay_defaults;
    cache::CacheConfig env_cache;
    {
      const Args d;
      env_cache.device_blocks = d.device_blocks;
      env_cache.host_blocks = d.host_blocks;
      env_cache.storage_blocks = d.storage_blocks;
      env_cache.device_policy = env_cache.host_policy = d.policy;
      env_cache.write_policy = replay_defaults.write_policy;
      env_cache.write_through_threshold = d.threshold;
      env_cache.host_watermarks =
          cache::Watermarks{replay_defaults.host_low_watermark, replay_defaults.host_high_watermark};
    }
    TransferManagerConfig transfer_config;
    bool host_policy_set = false;
    {
      ConfigTable table;
      cache::bind_cache_config(table, env_cache);
      bind_transfer_manager_config(table, transfer_config);
      if (Status s = table.apply_env(environ); !s.ok()) {
        std::fprintf(stderr, "kvtier replay: %s\n", s.to_string().c_str());
        return 2;
      }
      // The host tier follows --policy unless KVTIER_CACHE_HOST_POLICY says otherwise.
      for (const KnobInfo& k : table.describe())
        if (k.name == "cache.host_policy" && k.value != k.default_value) host_policy_set = true;
    }
    auto given = [&](const char* flag) { return cmd->get_option(flag)->count() > 0; };
    auto bad = [](const std::string& what) {
      std::fprintf(stderr, "kvtier replay: %s\n", what.c_str());
      return 2;
    };
    // A flag given an empty value, or 0 where 0 is what "not given" looks like, was taken as not given (no storage
    // tier, a plain replay instead of a sweep, the default host tier): refused instead.
    for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--sweep", &a.sweep},
                                      {"--storage", &a.storage},
                                      {"--out", &a.out},
                                      {"--kv-events", &a.kv_events},
                                      {"--kv-events-replay", &a.kv_events_replay},
                                      {"--metrics-out", &a.metrics_out}})
      if (given(flag) && value->empty()) return bad(fmt::format("{} is given an empty value", flag));
    if (given("--device-tokens") && a.device_tokens == 0)
      return bad("--device-tokens must be at least one block's tokens, got 0");
    if (given("--host-tokens") && a.host_tokens == 0)
      return bad("--host-tokens must be at least one block's tokens, got 0 (--host-blocks 0 for no host tier)");
    if (given("--metrics-port") && a.metrics_port == 0) return bad("--metrics-port must be 1..65535, got 0");
    if (!given("--device-blocks")) a.device_blocks = env_cache.device_blocks;
    if (!given("--host-blocks")) a.host_blocks = env_cache.host_blocks;
    if (!given("--storage-blocks")) a.storage_blocks = env_cache.storage_blocks;
    if (!given("--policy")) a.policy = env_cache.device_policy;
    if (!given("--write-policy")) a.write_policy = std::string(cache::write_policy_name(env_cache.write_policy));
    if (!given("--write-through-threshold")) a.threshold = env_cache.write_through_threshold;
    if (a.block_tokens == 0) {
      std::fprintf(stderr, "kvtier replay: --block-tokens must be >= 1\n");
      return 2;
    }
    constexpr std::uint64_t kMaxBlocks = 0xFFFFFFFEu;  // block ids are 32-bit, 2^32-1 is "no block"
    if (a.device_tokens) {
      const std::uint64_t blocks = a.device_tokens / a.block_tokens;
      if (blocks == 0 || blocks > kMaxBlocks)
        return bad(fmt::format("--device-tokens {} is {} blocks of {} tokens: must be 1..{} blocks", a.device_tokens,
                               blocks, a.block_tokens, kMaxBlocks));
      a.device_blocks = static_cast<std::uint32_t>(blocks);
    }
    if (a.host_tokens) {
      const std::uint64_t blocks = a.host_tokens / a.block_tokens;
      // Less than one block took the host tier away without a word (--host-blocks 0 says that).
      if (blocks == 0 || blocks > kMaxBlocks)
        return bad(
            fmt::format("--host-tokens {} is {} blocks of {} tokens: must be 1..{} blocks (--host-blocks 0 "
                        "for no host tier)",
                        a.host_tokens, blocks, a.block_tokens, kMaxBlocks));
      a.host_blocks = static_cast<std::uint32_t>(blocks);
    }
    if (a.device_blocks == 0)
      return bad(fmt::format("--device-blocks must be >= 1, got 0{}",
                             given("--device-blocks") ? "" : " (from KVTIER_CACHE_DEVICE_BLOCKS)"));
    if (a.threshold == 0)
      return bad(fmt::format("--write-through-threshold must be >= 1, got 0{}",
                             given("--write-through-threshold") ? "" : " (from KVTIER_CACHE_WRITE_THROUGH_THRESHOLD)"));
    for (const auto& [tier, w] :
         {std::pair{"DEVICE", env_cache.device_watermarks}, {"HOST", env_cache.host_watermarks}})
      if (!(w.low >= 0 && w.high <= 1 && w.low <= w.high))
        return bad(
            fmt::format("KVTIER_CACHE_{0}_WATERMARKS_LOW {1} and KVTIER_CACHE_{0}_WATERMARKS_HIGH {2} must "
                        "satisfy 0 <= low <= high <= 1",
                        tier, w.low, w.high));
    if (!(a.failure_rate >= 0.0 && a.failure_rate <= 1.0))
      return bad(fmt::format("--failure-rate must be a probability in [0, 1], got {}", a.failure_rate));
    constexpr std::uint64_t kMaxBlockBytes = std::uint64_t{1} << 40;
    if (a.block_bytes == 0 || a.block_bytes > kMaxBlockBytes)
      return bad(fmt::format("--block-bytes must be 1..{} (1 TiB), got {}", kMaxBlockBytes, a.block_bytes));
    const std::uint64_t phys = cache::physical_memory_bytes();
    // Every capacity is checked against physical memory before anything is allocated.
    auto index_fits = [&](std::uint64_t device, std::uint64_t host, std::uint64_t storage, const std::string& flags) {
      cache::CacheConfig c;
      c.device_blocks = static_cast<std::uint32_t>(device);
      c.host_blocks = static_cast<std::uint32_t>(host);
      c.storage_blocks = static_cast<std::uint32_t>(storage);
      const std::uint64_t need = cache::index_memory_bytes(c);
      if (need <= phys) return true;
      std::fprintf(stderr, "kvtier replay: %s: the cache index needs about %llu MiB, the machine has %llu MiB\n",
                   flags.c_str(), (unsigned long long)(need >> 20), (unsigned long long)(phys >> 20));
      return false;
    };
    if (!index_fits(a.device_blocks, a.host_blocks, a.storage.empty() ? 0 : a.storage_blocks,
                    fmt::format("--device-blocks {} --host-blocks {}{}", a.device_blocks, a.host_blocks,
                                a.storage.empty() ? "" : fmt::format(" --storage-blocks {}", a.storage_blocks))))
      return 2;
    if (!(a.sweep_max_multiplier >= 1.0 && a.sweep_max_multiplier <= 1024.0))
      return bad(fmt::format("--sweep-max-multiplier must be a number in [1, 1024], got {}", a.sweep_max_multiplier));
    // Sweep capacities: 1..kMaxBlocks each, digits only ("-5" is not a block count).
    std::vector<std::uint32_t> sweep_caps;
    if (!a.sweep.empty()) {
      std::vector<std::string> caps_s;
      if (auto err = parse_list("--sweep", a.sweep, caps_s, "1000,4000")) return bad(*err);
      for (const auto& c : caps_s) {
        std::uint64_t v = 0;
        const bool digits = c.size() <= 19 && c.find_first_not_of("0123456789") == std::string::npos;
        if (digits) v = std::stoull(c);
        if (!digits || v == 0 || v > kMaxBlocks)
          return bad(fmt::format("--sweep value '{}' is not a block count in 1..{}", c, kMaxBlocks));
        if (!index_fits(v, 0, 0, fmt::format("--sweep value {}", v))) return 2;
        if (std::find(sweep_caps.begin(), sweep_caps.end(), v) != sweep_caps.end())
          return bad(fmt::format("--sweep lists capacity {} twice", v));
        sweep_caps.push_back(static_cast<std::uint32_t>(v));
      }
      // In capacity order: the table's rows and the plot's lines read left to right (the plot zigzagged).
      std::sort(sweep_caps.begin(), sweep_caps.end());
    }
    // Output paths are checked before the work, not after it (a sweep of minutes lost to a typo in --out).
    const auto writable = [](const std::string& file) {
      const std::filesystem::path p(file);
      const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
      std::error_code ec;
      return std::filesystem::is_directory(dir, ec) && ::access(dir.c_str(), W_OK) == 0;
    };
    if (!a.sweep.empty() && !writable(a.out + ".md"))
      return bad(fmt::format("--out {}: its directory does not exist or cannot be written", a.out));
    if (!a.metrics_out.empty() && !writable(a.metrics_out))
      return bad(fmt::format("--metrics-out {}: its directory does not exist or cannot be written", a.metrics_out));
    // The policy names this mode uses are checked before the trace is read, so a misspelt one is a usage error
    // (exit 2), not a failure of the run (exit 1) after reading it. belady's oracle is the replay's; any oracle
    // makes the name check. A sweep runs belady and min-bypass by itself (listed, they are skipped there).
    {
      auto check_policy = [&](const char* flag, const std::string& name) -> std::optional<std::string> {
        auto made = cache::make_policy(name, 1, [](const cache::BlockKey&, std::uint64_t) { return std::uint64_t{0}; });
        if (made.ok()) return std::nullopt;
        return fmt::format("{} {}: {}", flag, name, made.status().message());
      };
      std::vector<std::pair<const char*, std::string>> names;
      if (a.sweep.empty()) {
        names.emplace_back("--policy", a.policy);
      } else {
        if (given("--sweep-default")) names.emplace_back("--sweep-default", a.sweep_default);
        std::vector<std::string> listed;
        if (given("--sweep-policies") && !parse_list("--sweep-policies", a.sweep_policies, listed, "lru,adaptive"))
          for (std::string& name : listed)
            if (name != "belady" && name != "min-bypass") names.emplace_back("--sweep-policies", std::move(name));
      }
      for (const auto& [flag, name] : names)
        if (auto err = check_policy(flag, name)) return bad(*err);
    }
    std::string path = resolve_trace(a.trace);
    auto trace = cache::load_mooncake_trace(path, a.max_requests);
    if (!trace.ok()) {
      std::fprintf(stderr, "kvtier replay: %s\n", trace.status().to_string().c_str());
      return 1;
    }
    // A trace's hash ids are one per block of its own block size: where most requests hold another count than
    // their tokens need at --block-tokens, the flag is likely not the trace's (the report then mixes a hit ratio of
    // blocks with token counts of another size). Warned, not refused: a trace may hash only part of its input.
    {
      std::size_t off = 0, with_ids = 0;
      std::uint64_t ids = 0, tokens = 0;
      for (const cache::TraceRequest& r : *trace) {
        if (r.hash_ids.empty() || r.input_length == 0) continue;
        ++with_ids;
        ids += r.hash_ids.size();
        tokens += r.input_length;
        if (r.hash_ids.size() != (r.input_length + a.block_tokens - 1) / a.block_tokens) ++off;
      }
      if (with_ids > 0 && off * 2 > with_ids)
        std::fprintf(stderr,
                     "kvtier replay: warning: %zu of %zu requests hold another number of hash ids than their "
                     "input_length needs at --block-tokens %u (%.0f tokens per hash id on average): is the trace's "
                     "block size another?\n",
                     off, with_ids, a.block_tokens, static_cast<double>(tokens) / static_cast<double>(ids));
    }
    auto wp = cache::parse_write_policy(a.write_policy);
    if (!wp.ok()) return bad(fmt::format("--write-policy {}: {}", a.write_policy, wp.status().message()));
    cache::ReplayOptions o;
    o.device_blocks = a.device_blocks;
    o.host_blocks = a.host_blocks;
    o.policy = a.policy;
    o.write_policy = *wp;
    o.write_through_threshold = a.threshold;
    o.block_tokens = a.block_tokens;
    o.block_bytes = a.block_bytes;
    o.cache_partial_blocks = a.cache_partial;
    o.failure_rate = a.failure_rate;
    o.seed = a.seed;
    o.check_invariants_every = a.check_every;
    o.host_low_watermark = env_cache.host_watermarks.low;
    o.host_high_watermark = env_cache.host_watermarks.high;
    if (host_policy_set) o.host_policy = env_cache.host_policy;
    o.storage_policy = env_cache.storage_policy;
    o.device_watermarks = env_cache.device_watermarks;
    o.contiguous_host_runs = env_cache.contiguous_host_runs;
    o.lookahead_prefetch_blocks = env_cache.lookahead_prefetch_blocks;
    o.lookahead_max_fraction = env_cache.lookahead_max_fraction;
    o.lookahead_retain_steps = env_cache.lookahead_retain_steps;
    if (!a.storage.empty() && a.host_blocks == 0) {
      std::fprintf(stderr, "kvtier replay: --storage needs a host tier (--host-blocks >= 1)\n");
      return 2;
    }
    if (a.lookahead && !a.queue) return bad("--lookahead needs --queue (requests are announced while they wait)");
    // A flag the chosen mode does not use is refused, not ignored: the report would describe another run.
    const auto first_given = [&](const std::vector<const char*>& flags) -> const char* {
      for (const char* f : flags)
        if (given(f)) return f;
      return nullptr;
    };
    if (!a.queue)
      if (const char* f = first_given({"--load", "--prefill-tokens-per-s", "--decode-tokens-per-s", "--max-batch"}))
        return bad(fmt::format("{} needs --queue (the queue model's service)", f));
    if (a.sweep.empty())
      if (const char* f = first_given({"--sweep-policies", "--sweep-default", "--sweep-max-multiplier", "--out"}))
        return bad(fmt::format("{} needs --sweep", f));
    if (a.storage.empty() && given("--storage-blocks")) return bad("--storage-blocks needs --storage");
    if (!a.storage.empty() && a.storage_blocks == 0)
      return bad(fmt::format("--storage-blocks must be >= 1 with --storage, got 0{}",
                             given("--storage-blocks") ? "" : " (from KVTIER_CACHE_STORAGE_BLOCKS)"));
    if (!a.kv_events_replay.empty() && a.kv_events.empty())
      return bad("--kv-events-replay needs --kv-events (the endpoint whose events it replays)");
    if (given("--kv-events-encoding") && a.kv_events.empty()) return bad("--kv-events-encoding needs --kv-events");
    if (auto e = metrics::parse_event_encoding(a.kv_events_encoding); !e.ok())
      return bad(fmt::format("--kv-events-encoding: {}", e.status().message()));
    // --transfer none says what the fake executor does: allowed there.
    const bool given_none_transfer = a.transfer == "none";
    const std::vector<const char*> real_run_flags = {given_none_transfer ? "--tp" : "--transfer",
                                                     "--tp",
                                                     "--tp-gpus",
                                                     "--failure-rank",
                                                     "--rank-deadline-ms",
                                                     "--metrics-out",
                                                     "--metrics-port",
                                                     "--kv-events",
                                                     "--kv-events-replay",
                                                     "--kv-events-encoding",
                                                     "--progress"};
    if (a.queue)
      if (const char* f = first_given(real_run_flags))
        return bad(fmt::format("--queue runs the fake executor and prints its own table: no {}", f));
    if (!a.sweep.empty()) {
      if (!a.storage.empty()) return bad("--sweep replays one device tier per capacity: no --storage");
      if (const char* f = first_given(real_run_flags))
        return bad(fmt::format("--sweep replays one device tier per capacity on the fake executor: no {}", f));
      if (given("--policy"))
        return bad("--sweep runs every policy of --sweep-policies (and --sweep-default): no --policy");
      if (const char* f =
              first_given({"--device-blocks", "--host-blocks", "--device-tokens", "--host-tokens", "--write-policy",
                           "--write-through-threshold", "--failure-rate", "--seed", "--block-bytes"}))
        return bad(
            fmt::format("--sweep replays one device tier of each --sweep capacity, with nothing to write "
                        "back or fail: no {}",
                        f));
    }
    if (a.policy == "belady" && a.sweep.empty() && !a.queue) {
      // Belady is an offline bound: one tier (device plus host capacity) on the fake executor.
      if (!a.storage.empty()) return bad("--policy belady is one tier of device + host capacity: no --storage");
      if (a.failure_rate > 0) return bad("--policy belady is an offline bound: no --failure-rate");
      if (const char* f = first_given({given_none_transfer ? "--tp" : "--transfer", "--tp", "--tp-gpus",
                                       "--failure-rank", "--rank-deadline-ms"}))
        return bad(fmt::format("--policy belady runs on the fake executor (no bytes move): no {}", f));
    }
    // A day: a rank silent that long is lost, not late (and 10^13 ms overflowed the deadline's nanoseconds).
    constexpr std::uint64_t kMaxRankDeadlineMs = 86'400'000;
    if (a.rank_deadline_ms == 0 || a.rank_deadline_ms > kMaxRankDeadlineMs)
      return bad(
          fmt::format("--rank-deadline-ms must be 1..{} (a day), got {}", kMaxRankDeadlineMs, a.rank_deadline_ms));
    if (a.queue) {
      if (!a.sweep.empty() || !a.storage.empty()) return bad("--queue runs the fake executor: no --sweep or --storage");
      std::vector<std::string> load_s;
      if (auto err = parse_list("--load", a.loads, load_s, "0.5,1,2")) return bad(*err);
      std::vector<double> loads;
      for (const auto& l : load_s) {
        char* end = nullptr;
        // Decimal only: strtod also reads hexadecimal ("0x10" was a load of 16), "inf" and "nan".
        const bool decimal = l.find_first_not_of("0123456789.eE+-") == std::string::npos;
        const double v = decimal ? std::strtod(l.c_str(), &end) : 0.0;
        if (!decimal || end != l.c_str() + l.size() || !(v > 0.0) || !std::isfinite(v))
          return bad(fmt::format("--load value '{}' is not a finite decimal number > 0", l));
        loads.push_back(v);
      }
      for (auto [flag, v] :
           {std::pair{"--prefill-tokens-per-s", a.prefill_tps}, {"--decode-tokens-per-s", a.decode_tps}})
        if (!(v > 0.0) || !std::isfinite(v)) return bad(fmt::format("{} {} is not a finite number > 0", flag, v));
      if (a.max_batch == 0) return bad("--max-batch 0 is not a batch size >= 1");
      o.prefill_tokens_per_s = a.prefill_tps;
      o.decode_tokens_per_s = a.decode_tps;
      o.max_batch = a.max_batch;
      return run_load_table(*trace, path, o, loads, a.lookahead, a.json);
    }
    if (!a.sweep.empty()) {
      std::vector<std::string> pols;
      const std::vector<std::uint32_t>& caps = sweep_caps;
      if (auto err = parse_list("--sweep-policies", a.sweep_policies, pols, "lru,adaptive")) return bad(*err);
      cache::SweepOptions so;
      so.default_policy = a.sweep_default;
      so.max_multiplier = a.sweep_max_multiplier;
      const auto sweep_start = std::chrono::steady_clock::now();
      auto table = cache::sweep(*trace, caps, pols, o, so);
      const double sweep_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - sweep_start).count();
      if (!table.ok()) {
        std::fprintf(stderr, "kvtier replay: %s\n", table.status().to_string().c_str());
        return 1;
      }
      std::string md = cache::sweep_markdown(*table, a.block_tokens);
      bool ok = write_file(a.out + ".md", md) && write_file(a.out + ".csv", cache::sweep_csv(*table, a.block_tokens)) &&
                write_file(a.out + ".svg", cache::sweep_svg(*table, a.block_tokens));
      if (!ok) {
        std::fprintf(stderr, "kvtier replay: cannot write %s.{md,csv,svg}\n", a.out.c_str());
        return 1;
      }
      if (a.json) {
        nlohmann::json j;
        j["trace"] = path;
        j["unbounded_hit_ratio"] = table->unbounded_hit_ratio;
        j["capacities"] = table->capacities;
        for (std::size_t p = 0; p < table->policies.size(); ++p)
          for (const auto& r : table->results[p]) j["results"][table->policies[p]].push_back(to_json(r));
        j["default_policy"] = table->default_policy;
        for (std::size_t c = 0; c < table->capacities.size(); ++c) {
          const cache::ClassTtlBound& b = table->class_ttl[c];
          j["class_ttl"].push_back({{"capacity_blocks", b.capacity_blocks},
                                    {"cross_validated", b.cross_validated},
                                    {"hindsight", b.hindsight},
                                    {"fold", {b.fold[0], b.fold[1]}}});
          // null: not reached within --sweep-max-multiplier
          const double m = table->memory_multiplier[c];
          j["memory_multiplier"].push_back(std::isinf(m) ? nlohmann::json() : nlohmann::json(m));
        }
        j["max_multiplier"] = table->max_multiplier;
        j["seconds"] = sweep_seconds;
        std::printf("%s\n", j.dump(2).c_str());
      } else {
        std::printf("trace: %s (%zu requests)\n\n%s\nsweep time %.1f s\nwrote %s.md, %s.csv, %s.svg\n", path.c_str(),
                    trace->size(), md.c_str(), sweep_seconds, a.out.c_str(), a.out.c_str(), a.out.c_str());
      }
      return 0;
    }

    // Real device<->host bytes through a TransferManager: the executor writes each computed
    // block's key pattern into device memory before its eviction and checks every loaded block.
    struct RealTransfer {
      std::unique_ptr<Device> device;
      std::unique_ptr<Stream> compute;
      Buffer device_memory;
      std::optional<BlockSpace> space;
      std::unique_ptr<TransferManager> manager;
      std::unique_ptr<cache::TransferPlanExecutor> executor;
    };
    // Injected failures (--failure-rate) with real transfers: rank --failure-rank's executor (rank 0
    // without it) is wrapped by a FaultInjectingPlanExecutor, which runs every move and reports a
    // seeded fraction as failed. Real copy failures are not injected: a failed copy on a device
    // stream is sticky (as on a GPU), which would end a replay; the transfer manager's failure
    // handling is tested in tests/transfer. With --transfer none the fake executor fails them.
    // With --storage as well, the three tiers run together: the storage tier reads and writes the
    // TransferManager's host cache.
    // --tp N / --failure-rank R: N TransferManagers under one MultiRankPlanExecutor; the injected
    // failures are reported by rank R's executor (FaultInjectingPlanExecutor), its copies stay real.
    const bool multi_rank = a.tp != 1 || a.failure_rank >= 0;
    const bool use_transfer = a.transfer != "none" && a.host_blocks > 0;
    const std::int64_t inject_rank = a.failure_rate > 0 ? std::max<std::int64_t>(a.failure_rank, 0) : -1;
    if (a.transfer != "none" && a.transfer != "host" && a.transfer != "cuda") {
      std::fprintf(stderr, "kvtier replay: --transfer must be host, cuda or none, got '%s'\n", a.transfer.c_str());
      return 2;
    }
    if (a.tp == 0) return std::fprintf(stderr, "kvtier replay: --tp must be >= 1, got 0\n"), 2;
    // Each rank is a TransferManager with its own streams and threads: thousands of ranks exhausted the
    // machine's threads before anything failed. Tensor-parallel degrees are at most a few dozen.
    constexpr std::uint32_t kMaxTp = 64;
    if (a.tp > kMaxTp) return std::fprintf(stderr, "kvtier replay: --tp %u: at most %u ranks\n", a.tp, kMaxTp), 2;
    if (a.failure_rank >= 0 && std::uint64_t(a.failure_rank) >= a.tp)
      return std::fprintf(stderr, "kvtier replay: --failure-rank %lld must be < --tp %u (ranks 0..%u)\n",
                          (long long)a.failure_rank, a.tp, a.tp - 1),
             2;
    if (multi_rank && !use_transfer)
      return std::fprintf(stderr,
                          "kvtier replay: --tp %u%s needs real transfers: --transfer host or cuda and a host tier "
                          "(--host-blocks >= 1), got --transfer %s --host-blocks %u\n",
                          a.tp, a.failure_rank >= 0 ? " --failure-rank" : "", a.transfer.c_str(), a.host_blocks),
             2;
    if (multi_rank && !a.storage.empty())
      return std::fprintf(stderr,
                          "kvtier replay: --tp %u with --storage is not supported yet (per-rank storage objects in "
                          "the replay); run the storage tier with --tp 1\n",
                          a.tp),
             2;
    if ((use_transfer || !a.storage.empty()) && block_bytes_opt->count() == 0) a.block_bytes = 4096;
    if (a.block_bytes % a.tp != 0)
      return std::fprintf(stderr,
                          "kvtier replay: --block-bytes %llu is not divisible by --tp %u (each rank holds block_bytes "
                          "/ tp of every block)\n",
                          (unsigned long long)a.block_bytes, a.tp),
             2;
    if (a.block_bytes / a.tp == 0 && use_transfer)
      return std::fprintf(stderr, "kvtier replay: --block-bytes 0 moves nothing; give at least --tp bytes\n"), 2;
    const std::uint64_t shard_bytes = a.block_bytes / a.tp;
    o.block_bytes = a.block_bytes;
    {
      // Real bytes: device memory (in RAM on the host backend) and the host tier's pages. Block counts
      // < 2^32 and block bytes <= 2^40: the products fit in 128 bits.
      using u128 = unsigned __int128;
      const std::uint64_t page = (shard_bytes + 4095) / 4096 * 4096 * a.tp;  // one host page per rank
      const bool in_ram_device = use_transfer && a.transfer == "host";
      const u128 host = use_transfer || !a.storage.empty() ? u128{a.host_blocks} * page : 0;
      const u128 device = in_ram_device ? u128{a.device_blocks} * a.block_bytes : 0;
      const auto clamp = [](u128 v) { return v > UINT64_MAX ? UINT64_MAX : static_cast<std::uint64_t>(v); };
      const std::uint64_t host_bytes = clamp(host), device_bytes = clamp(device), need = clamp(host + device);
      if (need > phys) {
        std::fprintf(stderr,
                     "kvtier replay: --device-blocks %u --host-blocks %u of --block-bytes %llu need %llu MiB of "
                     "memory (device %llu MiB%s, host %llu MiB), the machine has %llu MiB\n",
                     a.device_blocks, a.host_blocks, (unsigned long long)a.block_bytes,
                     (unsigned long long)(need >> 20), (unsigned long long)(device_bytes >> 20),
                     in_ram_device ? " in RAM (--transfer host)" : "", (unsigned long long)(host_bytes >> 20),
                     (unsigned long long)(phys >> 20));
        return 2;
      }
    }
    if (a.tp_gpus > a.tp)
      return std::fprintf(stderr, "kvtier replay: --tp-gpus %u must be <= --tp %u\n", a.tp_gpus, a.tp), 2;
    const std::uint32_t gpus = a.tp_gpus ? a.tp_gpus : a.tp;
    if (use_transfer && a.transfer == "cuda" && multi_rank && cuda_device_count() < int(gpus))
      return std::fprintf(stderr,
                          "kvtier replay: --tp %u --transfer cuda needs %u GPUs (%s), %d visible; --tp-gpus N lets "
                          "ranks share N GPUs\n",
                          a.tp, gpus, a.tp_gpus ? "--tp-gpus" : "one per rank", cuda_device_count()),
             1;
    std::vector<RealTransfer> ranks(use_transfer ? a.tp : 1);
    RealTransfer& rt = ranks[0];
    std::vector<std::unique_ptr<cache::FaultInjectingPlanExecutor>> faults(ranks.size());
    std::unique_ptr<cache::MultiRankPlanExecutor> multi;
    for (std::uint32_t rank = 0; use_transfer && rank < a.tp; ++rank) {
      RealTransfer& rr = ranks[rank];
      const std::string who = multi_rank ? fmt::format(" of rank {}", rank) : std::string();
      auto fail = [&who](const char* what, const Status& st) {
        std::fprintf(stderr, "kvtier replay: --transfer: %s%s: %s\n", what, who.c_str(), st.to_string().c_str());
        return 1;
      };
      if (a.transfer == "cuda") {
        auto d = create_cuda_device(int(rank % gpus));
        if (!d.ok()) return fail("cuda device", d.status());
        rr.device = std::move(*d);
      } else {
        auto d = HostDevice::create();
        if (!d.ok()) return fail("host device", d.status());
        rr.device = std::move(*d);
      }
      auto layout = KvLayout::uniform(1, 1, shard_bytes);
      if (!layout.ok()) return fail("layout", layout.status());
      auto compute = rr.device->create_stream({StreamPriority::kNormal, "replay-compute"});
      if (!compute.ok()) return fail("compute stream", compute.status());
      rr.compute = std::move(*compute);
      auto mem = rr.device->allocate_device(std::uint64_t{a.device_blocks} * shard_bytes);
      if (!mem.ok()) return fail("device memory", mem.status());
      rr.device_memory = std::move(*mem);
      auto space = BlockSpace::layer_first(MemoryKind::kDevice, rr.device->ordinal(), *layout, a.device_blocks,
                                           {{rr.device_memory.data()}});
      if (!space.ok()) return fail("device space", space.status());
      rr.space = std::move(*space);
      KvCacheRegistration reg{*rr.space, {}};
      reg.host.num_blocks = a.host_blocks;
      reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
      auto tm = TransferManager::create(*rr.device, *rr.compute, std::move(reg), transfer_config);
      if (!tm.ok()) return fail("transfer manager", tm.status());
      rr.manager = std::move(*tm);
      cache::TransferPlanExecutor::Options eo;
      eo.rank = rank;
      rr.executor = std::make_unique<cache::TransferPlanExecutor>(*rr.manager, *rr.device, *rr.compute, *rr.space, eo);
      o.executor = rr.executor.get();
      if (inject_rank >= 0 && std::uint64_t(inject_rank) == rank) {
        cache::FaultInjectingPlanExecutor::Options fo;
        fo.failure_rate = a.failure_rate;
        fo.seed = a.seed;
        faults[rank] = std::make_unique<cache::FaultInjectingPlanExecutor>(*rr.executor, fo);
      }
    }
    if (use_transfer && !multi_rank && faults[0]) {
      o.executor = faults[0].get();
      o.failure_rate = 0;  // injected by the wrapper, not by the fake executor
    }
    if (use_transfer && multi_rank) {
      std::vector<cache::PlanExecutor*> execs;
      for (std::uint32_t r = 0; r < a.tp; ++r)
        execs.push_back(faults[r] ? static_cast<cache::PlanExecutor*>(faults[r].get()) : ranks[r].executor.get());
      cache::MultiRankPlanExecutor::Options mo;
      mo.move_deadline = std::chrono::milliseconds(a.rank_deadline_ms);
      auto m = cache::MultiRankPlanExecutor::create(std::move(execs), mo);
      if (!m.ok()) return std::fprintf(stderr, "kvtier replay: --tp: %s\n", m.status().to_string().c_str()), 1;
      multi = std::move(*m);
      o.executor = multi.get();
      o.failure_rate = 0;  // injected on one rank, not by the fake executor
    }
    // Per-rank totals of the executors (rank 0 alone without --tp).
    auto total = [&ranks](auto get) {
      std::uint64_t sum = 0;
      for (const RealTransfer& x : ranks)
        if (x.executor) sum += get(*x.executor);
      return sum;
    };
    // Declared after the transfer manager: destroyed (its storage ops finished) before the host cache.
    std::unique_ptr<cache::ReplayStorage> storage;
    if (!a.storage.empty()) {
      auto rs = use_transfer ? cache::ReplayStorage::create_over(a.storage, rt.manager->host_space())
                             : cache::ReplayStorage::create(a.storage, a.host_blocks, a.block_bytes);
      if (!rs.ok()) {
        std::fprintf(stderr, "kvtier replay: --storage %s: %s\n", storage::redact_storage_spec(a.storage).c_str(),
                     rs.status().to_string().c_str());
        return 1;
      }
      storage = std::move(*rs);
      o.storage = storage.get();
      o.storage_blocks = a.storage_blocks;
    }

    // --metrics-port, --metrics-out, --progress: fed by the replay's running totals (ReplayOptions::on_request).
    metrics::Registry& registry = metrics::default_registry();
    std::optional<ReplayMetrics> rm;
    std::unique_ptr<metrics::MetricsServer> server;
    std::optional<ProgressLine> progress;
    if (a.metrics_port || !a.metrics_out.empty()) {
      auto m = ReplayMetrics::create(registry);
      if (!m.ok()) return std::fprintf(stderr, "kvtier replay: metrics: %s\n", m.status().to_string().c_str()), 1;
      rm.emplace(*m);
      o.metrics = &registry;
      Status st = rt.manager ? rt.manager->attach_metrics(registry) : Status::Ok();
      if (st.ok() && storage) st = storage->tier().attach_metrics(registry);
      if (!st.ok()) return std::fprintf(stderr, "kvtier replay: metrics: %s\n", st.to_string().c_str()), 1;
    }
    if (a.metrics_port) {
      auto s = metrics::MetricsServer::start(registry, a.metrics_port);
      if (!s.ok()) return std::fprintf(stderr, "kvtier replay: %s\n", s.status().to_string().c_str()), 1;
      server = std::move(*s);
      std::fprintf(stderr, "kvtier replay: serving http://127.0.0.1:%u/metrics\n", unsigned{server->port()});
    }
    std::unique_ptr<metrics::ZmqEventPublisher> publisher;
    if (!a.kv_events_replay.empty() && a.kv_events.empty())
      return std::fprintf(stderr, "kvtier replay: --kv-events-replay needs --kv-events\n"), 1;
    if (!a.kv_events.empty()) {
      metrics::ZmqPublisherOptions po;
      po.endpoint = a.kv_events;
      po.replay_endpoint = a.kv_events_replay;
      po.encoding = *metrics::parse_event_encoding(a.kv_events_encoding);  // checked with the flags
      auto p = metrics::ZmqEventPublisher::create(po);
      if (!p.ok())
        return std::fprintf(stderr, "kvtier replay: --kv-events %s: %s\n", a.kv_events.c_str(),
                            p.status().to_string().c_str()),
               1;
      publisher = std::move(*p);
      std::fprintf(stderr, "kvtier replay: publishing KV events on %s\n", publisher->endpoint().c_str());
      o.kv_events_storage_medium = a.storage.rfind("redis", 0) == 0 ? metrics::Medium::kRemote : metrics::Medium::kDisk;
      o.on_kv_events = [&publisher,
                        refused = std::vector<metrics::KvEvent>()](std::vector<metrics::KvEvent> events) mutable {
        // A full queue (a stalled publisher thread) refuses the batch and leaves it here: it goes out in front of
        // the next step's events, so subscribers see every change, later, and no gap.
        if (!refused.empty()) {
          refused.insert(refused.end(), std::make_move_iterator(events.begin()), std::make_move_iterator(events.end()));
          events.swap(refused);
          refused.clear();
        }
        if (!publisher->publish(std::move(events)).ok()) refused = std::move(events);
      };
    }
    if (a.progress) progress.emplace(trace->size());
    // --metrics-out: the scrape at the replay's end, taken while its cache manager is there (the manager's gauges
    // leave the registry with it).
    std::string final_scrape;
    if (rm || progress || !a.metrics_out.empty())
      o.on_request = [&](const cache::ReplayResult& r, const cache::CacheManager& cm) {
        (void)cm;
        if (rm) rm->update(r);
        if (progress) progress->update(r, r.seconds > 0);
        if (r.seconds > 0 && !a.metrics_out.empty()) final_scrape = registry.expose();  // the last call
      };
    auto res = cache::replay_trace(*trace, o);
    o.executor = nullptr;  // Belady and the unbounded bound run on the fake executor
    o.on_request = nullptr;
    o.metrics = nullptr;  // the bounds below are not the deployment's cache
    o.on_kv_events = nullptr;
    if (publisher) {
      Status ps = publisher->shutdown(std::chrono::seconds(5));
      if (!ps.ok()) std::fprintf(stderr, "kvtier replay: KV events: %s\n", ps.to_string().c_str());
    }
    if (!res.ok()) {
      std::fprintf(stderr, "kvtier replay: %s\n", res.status().to_string().c_str());
      return 1;
    }
    if (!a.metrics_out.empty()) {
      std::ofstream f(a.metrics_out, std::ios::binary | std::ios::trunc);
      f << (final_scrape.empty() ? registry.expose() : final_scrape);
      if (!f.good())
        return std::fprintf(stderr, "kvtier replay: cannot write --metrics-out %s\n", a.metrics_out.c_str()), 1;
    }
    auto bel = cache::replay_belady(*trace, a.device_blocks + a.host_blocks, o);
    if (!bel.ok()) {
      std::fprintf(stderr, "kvtier replay: belady: %s\n", bel.status().to_string().c_str());
      return 1;
    }
    auto bound = cache::replay_min_bypass(*trace, a.device_blocks + a.host_blocks, o);
    if (!bound.ok()) {
      std::fprintf(stderr, "kvtier replay: min-bypass: %s\n", bound.status().to_string().c_str());
      return 1;
    }
    cache::ReplayResult unb = cache::replay_unbounded(*trace, o);
    const cache::ReplayResult& r = *res;
    using Exec = cache::TransferPlanExecutor;
    const std::uint64_t t_verified = total([](const Exec& e) { return e.verified(); });
    const std::uint64_t t_mismatches = total([](const Exec& e) { return e.verification_failures(); });
    const std::uint64_t t_failed_tasks = total([](const Exec& e) { return e.failed_tasks(); });
    const std::uint64_t t_d2h = total([](const Exec& e) { return e.bytes_d2h(); });
    const std::uint64_t t_h2d = total([](const Exec& e) { return e.bytes_h2d(); });
    std::uint64_t t_injected = 0;
    for (const auto& f : faults) t_injected += f ? f->injected() : 0;
    if (a.json) {
      nlohmann::json j = to_json(r);
      j["trace"] = path;
      j["write_policy"] = a.write_policy;
      j["block_tokens"] = a.block_tokens;
      j["block_bytes"] = a.block_bytes;
      j["belady"] = to_json(*bel);
      j["min_bypass"] = to_json(*bound);
      j["unbounded_hit_ratio"] = unb.hit_ratio();
      if (!a.storage.empty()) j["storage"] = storage::redact_storage_spec(a.storage);
      if (rt.executor) {
        j["transfer"] = {{"backend", a.transfer},
                         {"verified_blocks", t_verified},
                         {"verification_failures", t_mismatches},
                         {"failed_tasks", t_failed_tasks},
                         {"injected_failures", t_injected},
                         {"bytes_d2h", t_d2h},
                         {"bytes_h2d", t_h2d}};
      }
      if (multi) {
        nlohmann::json per_rank = nlohmann::json::array();
        for (std::uint32_t k = 0; k < a.tp; ++k) {
          const Exec& e = *ranks[k].executor;
          const auto& st = multi->rank_stats(k);
          per_rank.push_back({{"rank", k},
                              {"verified_blocks", e.verified()},
                              {"mismatches", e.verification_failures()},
                              {"failed_tasks", e.failed_tasks()},
                              {"failed_moves", st.failed_moves},
                              {"injected_failures", faults[k] ? faults[k]->injected() : 0},
                              {"missing_reports", st.missing_reports},
                              {"bytes_d2h", e.bytes_d2h()},
                              {"bytes_h2d", e.bytes_h2d()}});
        }
        j["tp"] = {{"ranks", a.tp},
                   {"shard_bytes", shard_bytes},
                   {"failure_rank", a.failure_rank},
                   {"rank_deadline_ms", a.rank_deadline_ms},
                   {"completed_moves", multi->completed_moves()},
                   {"failed_moves", multi->failed_moves()},
                   {"timed_out_moves", multi->timed_out_moves()},
                   {"per_rank", per_rank}};
      }
      // Per path: what the executors moved (real bytes), or what the plans asked for (fake executor).
      j["bytes_moved"] = {{"device_to_host", rt.executor ? t_d2h : r.bytes_d2h},
                          {"host_to_device", rt.executor ? t_h2d : r.bytes_h2d},
                          {"host_to_storage", r.bytes_to_storage},
                          {"storage_to_host", r.bytes_from_storage}};
      std::printf("%s\n", j.dump(2).c_str());
      const bool bad = r.verification_failures || t_mismatches;
      return bad ? 3 : 0;
    }
    auto gib = [](std::uint64_t b) { return static_cast<double>(b) / double(1ull << 30); };
    std::printf("trace            %s: %llu requests, %llu blocks (%llu cacheable), %llu input tokens\n", path.c_str(),
                (unsigned long long)r.requests, (unsigned long long)r.total_blocks,
                (unsigned long long)r.cacheable_blocks, (unsigned long long)r.total_tokens);
    const std::string host_policy =
        r.host_policy.empty() || r.host_policy == r.policy ? "" : fmt::format(" (host {})", r.host_policy);
    std::printf("cache            device %u blocks (%llu tokens), host %u blocks (%llu tokens), policy %s%s, %s\n",
                r.device_blocks, (unsigned long long)r.device_blocks * a.block_tokens, r.host_blocks,
                (unsigned long long)r.host_blocks * a.block_tokens, r.policy.c_str(), host_policy.c_str(),
                a.write_policy.c_str());
    if (!r.device_lead_requests.empty()) {
      std::string led;
      for (const auto& [expert, share] : lead_shares(r))
        led += fmt::format("{}{} {:.1f} %", led.empty() ? "" : ", ", expert, 100.0 * share);
      std::printf("policy lead      %s of requests, %llu switches\n", led.c_str(),
                  (unsigned long long)r.device_policy_switches);
    }
    if (!a.storage.empty())
      std::printf("storage          %u blocks (%llu tokens), %s\n", r.storage_blocks,
                  (unsigned long long)r.storage_blocks * a.block_tokens,
                  storage::redact_storage_spec(a.storage).c_str());
    std::printf("hit ratio        %.4f (device %.4f + host %.4f + storage %.4f) of blocks\n", r.hit_ratio(),
                r.device_hit_ratio(), r.host_hit_ratio(), r.storage_hit_ratio());
    std::printf("prefill saved    %llu of %llu tokens (%.2f%%; %llu from host, %llu from storage)\n",
                (unsigned long long)(r.device_hit_tokens + r.host_hit_tokens + r.storage_hit_tokens),
                (unsigned long long)r.total_tokens, 100.0 * r.token_hit_ratio(), (unsigned long long)r.host_hit_tokens,
                (unsigned long long)r.storage_hit_tokens);
    if (r.failed_admissions > 0)
      std::printf("refused          %llu requests the cache could not admit (computed without it)\n",
                  (unsigned long long)r.failed_admissions);
    if (r.truncated_requests > 0)
      std::printf("truncated        %llu requests longer than the device tier (their first %u blocks cached)\n",
                  (unsigned long long)r.truncated_requests, r.device_blocks);
    std::printf("bytes moved      D2H %.1f GiB, H2D %.1f GiB (%.1f MiB per block)\n", gib(r.bytes_d2h),
                gib(r.bytes_h2d), static_cast<double>(a.block_bytes) / double(1 << 20));
    if (a.failure_rate > 0 && inject_rank >= 0 && use_transfer)
      std::printf("failed transfers %llu (each became a miss; %llu injected on rank %lld, its copies ran)\n",
                  (unsigned long long)r.failed_transfers, (unsigned long long)t_injected, (long long)inject_rank);
    else if (a.failure_rate > 0)
      std::printf("failed transfers %llu (each became a miss)\n", (unsigned long long)r.failed_transfers);
    std::printf("min-bypass       %.4f (offline optimum: MIN with bypass, one tier of %u blocks = device + host)\n",
                bound->hit_ratio(), a.device_blocks + a.host_blocks);
    std::printf("belady           %.4f (MIN without bypass: the cache manager with the oracle policy, %u blocks)\n",
                bel->hit_ratio(), a.device_blocks + a.host_blocks);
    std::printf("unbounded        %.4f (every reusable block kept)\n", unb.hit_ratio());
    std::printf("replay time      %.3f s (%s), %.3f s (belady)\n", r.seconds, r.policy.c_str(), bel->seconds);
    auto mib = [](std::uint64_t b) { return static_cast<double>(b) / double(1 << 20); };
    if (!rt.executor && a.storage.empty()) {
      std::printf("bytes            not moved: fake executor (--transfer none, or no host tier)\n");
      return 0;
    }
    // Real bytes: device<->host through the TransferManager, host<->storage through the backend.
    const std::uint64_t d2h = rt.executor ? t_d2h : r.bytes_d2h;
    const std::uint64_t h2d = rt.executor ? t_h2d : r.bytes_h2d;
    const std::string device_side = rt.executor ? a.transfer + " backend TransferManager" : "simulated device";
    std::printf("paths            device->host %.1f MiB, host->device %.1f MiB (%s)", mib(d2h), mib(h2d),
                device_side.c_str());
    if (!a.storage.empty())
      std::printf(", host->storage %.1f MiB in %llu writes, storage->host %.1f MiB in %llu prefetches (%s)",
                  mib(r.bytes_to_storage), (unsigned long long)r.storage_writes, mib(r.bytes_from_storage),
                  (unsigned long long)r.storage_prefetches, storage::redact_storage_spec(a.storage).c_str());
    std::printf("\n");
    std::printf("failures         %llu failed transfer tasks, %llu failed moves acked as misses",
                (unsigned long long)t_failed_tasks, (unsigned long long)r.failed_transfers);
    if (!a.storage.empty())
      std::printf(", %llu failed prefetches, %llu failed storage writes", (unsigned long long)r.failed_prefetches,
                  (unsigned long long)r.failed_storage_writes);
    std::printf(" (each became a miss)\n");
    const std::uint64_t device_checked = t_verified;
    const std::uint64_t mismatches = r.verification_failures + t_mismatches;
    if (multi) {
      std::printf(
          "tensor parallel  %u ranks of %llu bytes per block: %llu moves done on all ranks, %llu failed (%llu "
          "timed out)\n",
          a.tp, (unsigned long long)shard_bytes, (unsigned long long)multi->completed_moves(),
          (unsigned long long)multi->failed_moves(), (unsigned long long)multi->timed_out_moves());
      for (std::uint32_t k = 0; k < a.tp; ++k)
        std::printf("  rank %u         %llu loaded shards checked, %llu mismatches, %llu moves failed here%s\n", k,
                    (unsigned long long)ranks[k].executor->verified(),
                    (unsigned long long)ranks[k].executor->verification_failures(),
                    (unsigned long long)multi->rank_stats(k).failed_moves,
                    faults[k] ? fmt::format(" ({} injected)", faults[k]->injected()).c_str() : "");
    }
    std::printf(
        "verification     %llu loaded device blocks and %llu host pages (prefetched, or read by a load) checked "
        "against their key's pattern, %llu mismatches\n",
        (unsigned long long)device_checked, (unsigned long long)r.verified_blocks, (unsigned long long)mismatches);
    return mismatches ? 3 : 0;
  };
}

}  // namespace kvtier::cli
