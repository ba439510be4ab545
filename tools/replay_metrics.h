// `kvtier replay`'s observability: the replay's running totals as Prometheus series
// (--metrics-port, --metrics-out) and a progress line on stderr (--progress).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/cache/replay.h"
#include "kvtier/metrics/registry.h"

namespace kvtier::cli {

// Series of one replay in `registry`. update() takes the running totals of ReplayOptions::on_request and
// adds what grew since the last call to the counters, so counters end equal to the final ReplayResult.
class ReplayMetrics {
 public:
  static Result<ReplayMetrics> create(metrics::Registry& registry, const std::string& policy);
  void update(const cache::ReplayResult& r, const cache::CacheManager& cm);

 private:
  struct Delta {
    metrics::Counter* c = nullptr;
    std::uint64_t seen = 0;
    void to(std::uint64_t total) {
      if (total > seen) c->inc(total - seen);
      seen = total;
    }
  };
  Delta requests_, blocks_, misses_, hits_[3], bytes_[4], failed_transfers_, failed_admissions_, truncated_;
  Delta evictions_[3], storage_writes_, storage_prefetches_, verification_failures_;
  metrics::Gauge* used_[3] = {};
  metrics::Gauge* capacity_[3] = {};
  metrics::Gauge* resident_[3] = {};
  metrics::Histogram* request_seconds_ = nullptr;
  std::chrono::steady_clock::time_point last_;
};

// One progress line, redrawn in place at most every 200 ms (and at the end): requests done of the trace,
// hit ratio, bytes moved device<->host and storage, requests per second.
class ProgressLine {
 public:
  explicit ProgressLine(std::uint64_t total_requests);
  void update(const cache::ReplayResult& r, bool final);

 private:
  std::uint64_t total_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

std::string human_bytes(double bytes);

}  // namespace kvtier::cli
