// `kvtier replay`'s observability: the replay's running totals as Prometheus series
// (--metrics-port, --metrics-out) and a progress line on stderr (--progress).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/metrics/registry.h"
#include "sim/replay.h"

namespace kvtier::cli {

// The replay's own outcome series in `registry` (kvtier_replay_*): what the trace's requests got, after
// failed loads are taken off their hits. The library's series (kvtier_cache_*, kvtier_transfer_*,
// kvtier_storage_*) come from the managers attached to the same registry. update() takes the running
// totals of ReplayOptions::on_request and adds what grew since the last call, so counters end equal to
// the final ReplayResult.
class ReplayMetrics {
 public:
  static Result<ReplayMetrics> create(metrics::Registry& registry);
  void update(const cache::ReplayResult& r);

 private:
  using Delta = metrics::CounterDelta;
  Delta requests_, blocks_, misses_, hits_[3], bytes_[4], refused_, truncated_, verification_failures_;
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
