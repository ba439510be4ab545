// `kvtier bench storage`: storage-tier throughput.
//
// Disk: the disk backend's put and get GB/s for --object-kib objects against
// a plain sequential write and read of the same bytes to one file in the same
// directory, in the same run: pwrite/pread of object-sized chunks at queue
// depth 1 (what dd does), both with O_DIRECT (no page cache on either side;
// when the filesystem refuses O_DIRECT both sides fall back to buffered I/O
// and the page cache is dropped, where permitted, before the reads). With
// --durability power the baseline ends its write with one fdatasync, the
// backend fdatasyncs each object and its directory before acknowledging it.
// The ratio is backend / baseline (target >= 0.8 for 1 MiB objects).
//
// Redis: ops/s and GB/s of pipelined put / get / exists batches of
// --redis-value-kib values against --redis (single server) and/or
// --redis-cluster (any master of a cluster).
//
// Every get is compared byte for byte with what was put (nonzero exit on a
// mismatch or any failed item).
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/redis_backend.h"
#include "tools/cli.h"

namespace kvtier::cli {
namespace {

using Clock = std::chrono::steady_clock;
using storage::StorageBackend;
using storage::StorageBatch;
using storage::StorageItem;
using storage::StorageKey;
using storage::StorageOp;

struct BenchStorageArgs {
  std::string dir = "/var/tmp/kvtier-bench-storage";
  std::vector<std::uint64_t> object_kib{1024};
  std::uint64_t total_mib = 1024;
  std::uint32_t queue_depth = 64;
  std::string durability = "power";
  std::string direct = "auto";
  int reps = 5;
  bool skip_disk = false;
  std::string redis;
  std::string redis_password;
  std::string redis_cluster;
  std::vector<std::uint64_t> redis_value_kib{128, 1024};
  std::uint64_t redis_total_mib = 256;
  std::uint32_t redis_workers = 4;
  bool json = false;
};

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;
AlignedBuffer alloc(std::uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) return nullptr;
  std::memset(p, 0, bytes);  // fault the pages in before timing
  return AlignedBuffer(static_cast<std::byte*>(p));
}

void fill(std::byte* p, std::uint64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::uint64_t i = 0; i + 8 <= n; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
}

double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void drop_caches() {
  ::sync();
  if (FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w")) {
    std::fputs("3\n", f);
    std::fclose(f);
  }
}

StorageKey bench_key(std::uint64_t run, std::uint64_t i) {
  return StorageKey::from_u64(0x6b76746965720000ull ^ (run * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull), i,
                              0);
}

// Runs one batch; returns seconds, or a negative value after printing the first error.
double timed_batch(StorageBackend& b, StorageBatch batch, const char* what) {
  const auto t0 = Clock::now();
  auto t = b.post(std::move(batch));
  if (!t.ok()) {
    std::fprintf(stderr, "kvtier bench storage: %s post: %s\n", what, t.status().to_string().c_str());
    return -1;
  }
  if (Status st = t->wait(std::chrono::minutes(10)); !st.ok()) {
    std::fprintf(stderr, "kvtier bench storage: %s: %s\n", what, st.to_string().c_str());
    return -1;
  }
  const auto t1 = Clock::now();
  if (Status st = t->first_error(); !st.ok()) {
    std::fprintf(stderr, "kvtier bench storage: %s: %s\n", what, st.to_string().c_str());
    return -1;
  }
  return secs(t0, t1);
}

struct DiskResult {
  std::uint64_t object_bytes = 0, objects = 0;
  double base_write = 0, base_read = 0, put = 0, get = 0;  // GB/s, medians over reps
  double put_ratio = 0, get_ratio = 0;                     // medians of the per-rep ratios
  bool direct = false;
};

// Plain sequential write (then fdatasync when `sync`) of `bytes` from `src` in `chunk` pieces; GB/s.
Result<double> sequential_write(const std::string& path, const std::byte* src, std::uint64_t bytes, std::uint64_t chunk,
                                bool direct, bool sync) {
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0) return Unavailable(fmt::format("open {}: {}", path, std::strerror(errno)));
  const auto t0 = Clock::now();
  // Linux moves at most 0x7ffff000 bytes per call: a shorter write is continued, not an error.
  for (std::uint64_t off = 0; off < bytes;) {
    const std::uint64_t n = std::min(chunk - off % chunk, bytes - off);
    const ssize_t w = ::pwrite(fd, src + off, n, static_cast<off_t>(off));
    if (w <= 0) {
      const std::string why = w < 0 ? std::strerror(errno) : "wrote nothing (disk full?)";
      ::close(fd);
      ::unlink(path.c_str());
      return Unavailable(fmt::format("pwrite {} at offset {}: {}", path, off, why));
    }
    off += static_cast<std::uint64_t>(w);
  }
  if (sync) ::fdatasync(fd);
  const auto t1 = Clock::now();
  ::close(fd);
  return bytes / secs(t0, t1) / 1e9;
}

// Plain sequential read of the file written above, then deletes it; GB/s.
Result<double> sequential_read(const std::string& path, std::byte* dst, std::uint64_t bytes, std::uint64_t chunk,
                               bool direct) {
  if (!direct) drop_caches();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  if (fd < 0) return Unavailable(fmt::format("open {}: {}", path, std::strerror(errno)));
  const auto t0 = Clock::now();
  for (std::uint64_t off = 0; off < bytes;) {
    const std::uint64_t n = std::min(chunk - off % chunk, bytes - off);
    const ssize_t r = ::pread(fd, dst + off, n, static_cast<off_t>(off));
    if (r <= 0) {
      const std::string why = r < 0 ? std::strerror(errno) : "end of file before the bytes written";
      ::close(fd);
      ::unlink(path.c_str());
      return Unavailable(fmt::format("pread {} at offset {}: {}", path, off, why));
    }
    off += static_cast<std::uint64_t>(r);
  }
  const auto t1 = Clock::now();
  ::close(fd);
  ::unlink(path.c_str());
  return bytes / secs(t0, t1) / 1e9;
}

int run_disk(const BenchStorageArgs& a, std::vector<DiskResult>* out) {
  for (std::uint64_t kib : a.object_kib) {
    const std::uint64_t obj = kib * 1024;
    const std::uint64_t n = std::max<std::uint64_t>(1, a.total_mib * 1024 * 1024 / obj);
    const std::uint64_t bytes = n * obj;
    AlignedBuffer src = alloc(bytes), dst = alloc(bytes);
    if (!src || !dst) {
      std::fprintf(stderr, "kvtier bench storage: cannot allocate 2 x %llu bytes\n",
                   static_cast<unsigned long long>(bytes));
      return 1;
    }
    fill(src.get(), bytes, kib);
    storage::DiskBackendConfig c;
    c.root = a.dir;
    c.queue_depth = a.queue_depth;
    c.durability = a.durability == "process" ? storage::Durability::kProcessCrash : storage::Durability::kPowerLoss;
    c.direct_io = a.direct == "on"    ? storage::DirectIo::kOn
                  : a.direct == "off" ? storage::DirectIo::kOff
                                      : storage::DirectIo::kAuto;
    storage::StorageOptions o;
    o.ns = "kvtier-bench-storage";
    auto b = storage::create_disk_backend(c, o);
    if (!b.ok()) {
      std::fprintf(stderr, "kvtier bench storage: disk backend on %s: %s\n", a.dir.c_str(),
                   b.status().to_string().c_str());
      return 1;
    }
    const bool direct = (*b)->caps().zero_copy_host;
    if (!(*b)->register_region(src.get(), bytes).ok() || !(*b)->register_region(dst.get(), bytes).ok()) return 1;
    // Warm-up (untimed): first use of the shard directories, page faults, allocator state.
    {
      StorageBatch puts{StorageOp::kPut, {}}, dels{StorageOp::kDelete, {}};
      for (std::uint64_t i = 0; i < n; ++i) {
        puts.items.push_back({bench_key(999, i), src.get() + i * obj, obj});
        dels.items.push_back({bench_key(999, i), nullptr, 0});
      }
      if (timed_batch(**b, std::move(puts), "disk warm-up put") < 0) return 1;
      if (timed_batch(**b, std::move(dels), "disk warm-up delete") < 0) return 1;
    }
    // Each rep times baseline write, backend put, baseline read, backend get back to back, so that
    // interference from other processes hits both sides of a ratio alike; medians of the per-rep values.
    std::vector<double> bw, br, pw, pr, wratio, rratio;
    const bool sync = c.durability == storage::Durability::kPowerLoss;
    const std::string base_path = a.dir + "/baseline.bin";
    for (int rep = 0; rep < a.reps; ++rep) {
      StorageBatch puts{StorageOp::kPut, {}}, gets{StorageOp::kGet, {}}, dels{StorageOp::kDelete, {}};
      for (std::uint64_t i = 0; i < n; ++i) {
        puts.items.push_back({bench_key(rep, i), src.get() + i * obj, obj});
        gets.items.push_back({bench_key(rep, i), dst.get() + i * obj, obj});
        dels.items.push_back({bench_key(rep, i), nullptr, 0});
      }
      auto w = sequential_write(base_path, src.get(), bytes, obj, direct, sync);
      if (!w.ok()) {
        std::fprintf(stderr, "kvtier bench storage: baseline: %s\n", w.status().to_string().c_str());
        return 1;
      }
      const double tp = timed_batch(**b, std::move(puts), "disk put");
      if (tp < 0) return 1;
      auto r = sequential_read(base_path, dst.get(), bytes, obj, direct);
      if (!r.ok()) {
        std::fprintf(stderr, "kvtier bench storage: baseline: %s\n", r.status().to_string().c_str());
        return 1;
      }
      std::memset(dst.get(), 0xA5, bytes);
      if (!direct) drop_caches();
      const double tg = timed_batch(**b, std::move(gets), "disk get");
      if (tg < 0) return 1;
      if (std::memcmp(src.get(), dst.get(), bytes) != 0) {
        std::fprintf(stderr, "kvtier bench storage: disk get returned wrong bytes\n");
        return 1;
      }
      if (timed_batch(**b, std::move(dels), "disk delete") < 0) return 1;
      bw.push_back(*w);
      br.push_back(*r);
      pw.push_back(bytes / tp / 1e9);
      pr.push_back(bytes / tg / 1e9);
      wratio.push_back(pw.back() / bw.back());
      rratio.push_back(pr.back() / br.back());
    }
    out->push_back({obj, n, median(bw), median(br), median(pw), median(pr), median(wratio), median(rratio), direct});
  }
  return 0;
}

struct RedisResult {
  std::string target;
  std::uint64_t value_bytes = 0, values = 0;
  double put_ops = 0, get_ops = 0, exists_ops = 0;
};

int run_redis(const BenchStorageArgs& a, const std::string& endpoint, bool cluster, std::vector<RedisResult>* out) {
  storage::RedisBackendConfig c;
  c.endpoints = {endpoint};
  c.mode = cluster ? storage::RedisMode::kCluster : storage::RedisMode::kSingle;
  c.password = cluster ? "" : a.redis_password;
  c.key_prefix = "kvtier-bench";
  c.workers = a.redis_workers;
  c.ttl_seconds = 600;
  storage::StorageOptions o;
  o.ns = "kvtier-bench-storage";
  auto b = storage::create_redis_backend(c, o);
  if (!b.ok()) {
    std::fprintf(stderr, "kvtier bench storage: redis %s: %s\n", endpoint.c_str(), b.status().to_string().c_str());
    return 1;
  }
  for (std::uint64_t kib : a.redis_value_kib) {
    const std::uint64_t vb = kib * 1024;
    const std::uint64_t n = std::max<std::uint64_t>(1, a.redis_total_mib * 1024 * 1024 / vb);
    AlignedBuffer src = alloc(n * vb), dst = alloc(n * vb);
    if (!src || !dst) return 1;
    fill(src.get(), n * vb, kib + 7);
    std::vector<double> po, go, eo;
    for (int rep = 0; rep < a.reps; ++rep) {
      StorageBatch puts{StorageOp::kPut, {}}, gets{StorageOp::kGet, {}}, ex{StorageOp::kExists, {}},
          dels{StorageOp::kDelete, {}};
      for (std::uint64_t i = 0; i < n; ++i) {
        puts.items.push_back({bench_key(1000 + rep, i), src.get() + i * vb, vb});
        gets.items.push_back({bench_key(1000 + rep, i), dst.get() + i * vb, vb});
        ex.items.push_back({bench_key(1000 + rep, i), nullptr, 0});
        dels.items.push_back({bench_key(1000 + rep, i), nullptr, 0});
      }
      const double tp = timed_batch(**b, std::move(puts), "redis put");
      const double tg = tp < 0 ? -1 : timed_batch(**b, std::move(gets), "redis get");
      const double te = tg < 0 ? -1 : timed_batch(**b, std::move(ex), "redis exists");
      if (te < 0) return 1;
      if (std::memcmp(src.get(), dst.get(), n * vb) != 0) {
        std::fprintf(stderr, "kvtier bench storage: redis get returned wrong bytes\n");
        return 1;
      }
      if (timed_batch(**b, std::move(dels), "redis delete") < 0) return 1;
      po.push_back(n / tp);
      go.push_back(n / tg);
      eo.push_back(n / te);
    }
    out->push_back(
        {cluster ? "redis-cluster " + endpoint : "redis " + endpoint, vb, n, median(po), median(go), median(eo)});
  }
  return 0;
}

int run(const BenchStorageArgs& a) {
  std::vector<DiskResult> disk;
  std::vector<RedisResult> redis;
  if (!a.skip_disk) {
    if (int rc = run_disk(a, &disk); rc != 0) return rc;
  }
  if (!a.redis.empty()) {
    if (int rc = run_redis(a, a.redis, false, &redis); rc != 0) return rc;
  }
  if (!a.redis_cluster.empty()) {
    if (int rc = run_redis(a, a.redis_cluster, true, &redis); rc != 0) return rc;
  }
  if (a.json) {
    for (const auto& d : disk) {
      nlohmann::json j;
      j["bench"] = "storage";
      j["backend"] = "disk";
      j["dir"] = a.dir;
      j["object_bytes"] = d.object_bytes;
      j["objects"] = d.objects;
      j["o_direct"] = d.direct;
      j["durability"] = a.durability;
      j["queue_depth"] = a.queue_depth;
      j["baseline_write_gbps"] = d.base_write;
      j["baseline_read_gbps"] = d.base_read;
      j["put_gbps"] = d.put;
      j["get_gbps"] = d.get;
      j["put_ratio"] = d.put_ratio;
      j["get_ratio"] = d.get_ratio;
      std::printf("%s\n", j.dump().c_str());
    }
    for (const auto& r : redis) {
      nlohmann::json j;
      j["bench"] = "storage";
      j["backend"] = r.target;
      j["value_bytes"] = r.value_bytes;
      j["values"] = r.values;
      j["put_ops"] = r.put_ops;
      j["get_ops"] = r.get_ops;
      j["exists_ops"] = r.exists_ops;
      j["put_gbps"] = r.put_ops * r.value_bytes / 1e9;
      j["get_gbps"] = r.get_ops * r.value_bytes / 1e9;
      std::printf("%s\n", j.dump().c_str());
    }
    return 0;
  }
  if (!disk.empty()) {
    std::printf("disk backend vs plain sequential I/O in %s (%s, durability %s, qd %u, medians of %d reps)\n",
                a.dir.c_str(), disk[0].direct ? "O_DIRECT" : "buffered", a.durability.c_str(), a.queue_depth, a.reps);
    std::printf("%10s %8s | %10s %10s %6s | %10s %10s %6s\n", "object", "objects", "seq write", "put", "ratio",
                "seq read", "get", "ratio");
    for (const auto& d : disk)
      std::printf("%7llu KiB %8llu | %7.2f GB/s %5.2f GB/s %5.0f%% | %7.2f GB/s %5.2f GB/s %5.0f%%\n",
                  static_cast<unsigned long long>(d.object_bytes / 1024), static_cast<unsigned long long>(d.objects),
                  d.base_write, d.put, 100 * d.put_ratio, d.base_read, d.get, 100 * d.get_ratio);
  }
  if (!redis.empty()) {
    std::printf("%-28s %9s %7s | %10s %9s | %10s %9s | %10s\n", "redis", "value", "values", "put ops/s", "put GB/s",
                "get ops/s", "get GB/s", "exists/s");
    for (const auto& r : redis)
      std::printf("%-28s %5llu KiB %7llu | %10.0f %9.2f | %10.0f %9.2f | %10.0f\n", r.target.c_str(),
                  static_cast<unsigned long long>(r.value_bytes / 1024), static_cast<unsigned long long>(r.values),
                  r.put_ops, r.put_ops * r.value_bytes / 1e9, r.get_ops, r.get_ops * r.value_bytes / 1e9, r.exists_ops);
  }
  return 0;
}

}  // namespace

Action register_bench_storage(CLI::App& bench) {
  auto args = std::make_shared<BenchStorageArgs>();
  auto* cmd = bench.add_subcommand("storage", "Storage tiers: disk backend vs plain sequential I/O; Redis ops/s");
  cmd->add_option("--dir", args->dir, "directory for the disk backend and the baseline file (a real disk)");
  cmd->add_option("--object-kib", args->object_kib, "disk object sizes, KiB")->delimiter(',');
  // Validated here, so that a bad value is named in the error (CLI11 says which option and why).
  cmd->add_option("--total-mib", args->total_mib, "bytes per disk measurement, MiB")->check(kAtLeastOne);
  cmd->add_option("--qd", args->queue_depth, "disk backend queue depth")->check(kAtLeastOne);
  cmd->add_option("--durability", args->durability, "power (fdatasync + dir fsync per object) | process")
      ->check(CLI::IsMember({"power", "process"}));
  cmd->add_option("--direct", args->direct, "O_DIRECT: auto | on | off")->check(CLI::IsMember({"auto", "on", "off"}));
  cmd->add_option("--reps", args->reps, "repetitions (median reported)")->check(kAtLeastOne);
  cmd->add_flag("--skip-disk", args->skip_disk, "only the Redis measurements");
  cmd->add_option("--redis", args->redis, "host:port of a Redis server to measure");
  cmd->add_option("--redis-password", args->redis_password, "AUTH password for --redis");
  cmd->add_option("--redis-cluster", args->redis_cluster, "host:port of any master of a Redis Cluster");
  cmd->add_option("--redis-value-kib", args->redis_value_kib, "Redis value sizes, KiB")
      ->delimiter(',')
      ->check(kAtLeastOne);
  cmd->add_option("--redis-total-mib", args->redis_total_mib, "bytes per Redis measurement, MiB")->check(kAtLeastOne);
  cmd->add_option("--redis-workers", args->redis_workers, "Redis backend worker threads");
  cmd->add_flag("--json", args->json, "one JSON object per line");
  return [cmd, args]() -> int {
    if (!cmd->parsed()) return -1;
    const BenchStorageArgs& a = *args;
    if (a.reps < 1 || a.total_mib == 0 || a.object_kib.empty() || a.queue_depth == 0 ||
        (a.durability != "power" && a.durability != "process") ||
        (a.direct != "auto" && a.direct != "on" && a.direct != "off")) {
      std::fprintf(stderr, "kvtier bench storage: bad arguments (see --help)\n");
      return 2;
    }
    if (!a.skip_disk && a.dir.empty()) {
      std::fprintf(stderr, "kvtier bench storage: --dir is empty (a directory on the disk to measure)\n");
      return 2;
    }
    if (a.redis_workers == 0) {
      std::fprintf(stderr, "kvtier bench storage: --redis-workers must be >= 1, got 0\n");
      return 2;
    }
    if (a.skip_disk && a.redis.empty() && a.redis_cluster.empty()) {
      std::fprintf(stderr,
                   "kvtier bench storage: --skip-disk leaves nothing to measure: give --redis HOST:PORT or "
                   "--redis-cluster HOST:PORT\n");
      return 2;
    }
    for (auto kib : a.object_kib)
      if (kib == 0 || kib % 4 != 0) {
        std::fprintf(stderr, "kvtier bench storage: --object-kib %llu is not a multiple of 4\n",
                     static_cast<unsigned long long>(kib));
        return 2;
      }
    // A measurement moves whole objects of each size, at least one: an object above the total would move more
    // than the total says (and sizes near 2**64 KiB would overflow the byte counts).
    constexpr std::uint64_t kMaxTotalMib = std::uint64_t{1} << 30;  // 1 PiB
    for (const auto& [total, name] : {std::pair{a.total_mib, "--total-mib"}, {a.redis_total_mib, "--redis-total-mib"}})
      if (total > kMaxTotalMib) {
        std::fprintf(stderr, "kvtier bench storage: %s %llu is above %llu\n", name,
                     static_cast<unsigned long long>(total), static_cast<unsigned long long>(kMaxTotalMib));
        return 2;
      }
    for (const auto& [sizes, total, name, total_name] :
         {std::tuple{&a.object_kib, a.total_mib, "--object-kib", "--total-mib"},
          {&a.redis_value_kib, a.redis_total_mib, "--redis-value-kib", "--redis-total-mib"}})
      for (auto kib : *sizes)
        if (kib > total * 1024) {
          std::fprintf(stderr, "kvtier bench storage: %s %llu is more than %s %llu (%llu KiB): raise %s\n", name,
                       static_cast<unsigned long long>(kib), total_name, static_cast<unsigned long long>(total),
                       static_cast<unsigned long long>(total * 1024), total_name);
          return 2;
        }
    return run(a);
  };
}

}  // namespace kvtier::cli
