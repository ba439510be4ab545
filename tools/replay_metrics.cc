#include "tools/replay_metrics.h"

#include <fmt/format.h>

#include <cstdio>

namespace kvtier::cli {

namespace {
constexpr const char* kTierNames[3] = {"device", "host", "storage"};
}  // namespace

Result<ReplayMetrics> ReplayMetrics::create(metrics::Registry& reg) {
  ReplayMetrics m;
  auto counter = [&](Delta& d, const char* name, const char* help, const metrics::Labels& l = {}) -> Status {
    KVTIER_ASSIGN_OR_RETURN(d.c, reg.counter(name, help, l));
    d.seen = 0;
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(counter(m.requests_, "kvtier_replay_requests_total", "Requests replayed."));
  KVTIER_RETURN_IF_ERROR(counter(m.blocks_, "kvtier_replay_lookup_blocks_total", "Blocks of the requests."));
  KVTIER_RETURN_IF_ERROR(
      counter(m.misses_, "kvtier_replay_miss_blocks_total", "Blocks of the requests served by no tier (computed)."));
  for (int t = 0; t < 3; ++t)
    KVTIER_RETURN_IF_ERROR(counter(m.hits_[t], "kvtier_replay_hit_blocks_total",
                                   "Blocks of the requests served from a tier (longest prefix, failed loads "
                                   "excluded).",
                                   {{"tier", kTierNames[t]}}));
  const char* dirs[4] = {"d2h", "h2d", "to_storage", "from_storage"};
  for (int d = 0; d < 4; ++d)
    KVTIER_RETURN_IF_ERROR(counter(m.bytes_[d], "kvtier_replay_moved_bytes_total",
                                   "Bytes the replay's step plans moved between tiers.", {{"direction", dirs[d]}}));
  KVTIER_RETURN_IF_ERROR(counter(m.refused_, "kvtier_replay_refused_requests_total",
                                 "Requests whose admission stayed refused after the replay's retries."));
  KVTIER_RETURN_IF_ERROR(counter(m.truncated_, "kvtier_replay_truncated_requests_total",
                                 "Requests longer than the device tier (cached as far as it fits)."));
  KVTIER_RETURN_IF_ERROR(counter(m.verification_failures_, "kvtier_replay_checksum_mismatches_total",
                                 "Loaded blocks whose bytes did not match their key when read back."));
  const std::vector<double> b = metrics::latency_buckets_seconds();
  KVTIER_ASSIGN_OR_RETURN(m.request_seconds_, reg.histogram("kvtier_replay_request_seconds",
                                                            "Wall time per replayed request (admit to release).", b));
  m.last_ = std::chrono::steady_clock::now();
  return m;
}

void ReplayMetrics::update(const cache::ReplayResult& r) {
  const auto now = std::chrono::steady_clock::now();
  if (r.requests > requests_.seen) request_seconds_->observe(std::chrono::duration<double>(now - last_).count());
  last_ = now;
  requests_.to(r.requests);
  blocks_.to(r.total_blocks);
  misses_.to(r.total_blocks - r.hit_blocks());
  hits_[0].to(r.device_hit_blocks);
  hits_[1].to(r.host_hit_blocks);
  hits_[2].to(r.storage_hit_blocks);
  bytes_[0].to(r.bytes_d2h);
  bytes_[1].to(r.bytes_h2d);
  bytes_[2].to(r.bytes_to_storage);
  bytes_[3].to(r.bytes_from_storage);
  refused_.to(r.failed_admissions);
  truncated_.to(r.truncated_requests);
  verification_failures_.to(r.verification_failures);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

ProgressLine::ProgressLine(std::uint64_t total) : total_(total), start_(std::chrono::steady_clock::now()) {}

void ProgressLine::update(const cache::ReplayResult& r, bool final) {
  const auto now = std::chrono::steady_clock::now();
  if (!final && now - last_draw_ < std::chrono::milliseconds(200)) return;
  last_draw_ = now;
  const double secs = std::chrono::duration<double>(now - start_).count();
  const double frac = total_ ? std::min(1.0, double(r.requests) / double(total_)) : 1.0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(frac * kWidth);
  const double moved = double(r.bytes_d2h + r.bytes_h2d + r.bytes_to_storage + r.bytes_from_storage);
  std::fprintf(stderr, "\r[%s%s] %llu/%llu  hit %.3f  moved %s  %s/s  %.0f req/s ", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), static_cast<unsigned long long>(r.requests),
               static_cast<unsigned long long>(total_), r.hit_ratio(), human_bytes(moved).c_str(),
               human_bytes(secs > 0 ? moved / secs : 0).c_str(), secs > 0 ? double(r.requests) / secs : 0.0);
  if (final) std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace kvtier::cli
