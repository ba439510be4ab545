// kvtier metrics: one registry of counters, gauges and histograms, exposed as
// Prometheus text (format 0.0.4).
//
// Model. A family has a name, a help text, a type and a fixed set of label
// names; each label-value tuple of a family is one series (a Counter, Gauge or
// Histogram object). Registering a series takes the registry's mutex and
// returns a pointer that stays valid for the registry's lifetime; callers look
// series up once and keep the pointer.
//
// Hot path. inc()/add()/set()/observe() take no lock and allocate nothing:
// relaxed atomics, one cache line per shard, a thread's shard chosen once per
// thread (counters and histograms are written by the submit, progress and
// storage threads at once; reads sum the shards). A scrape may see one
// histogram's count and sum from slightly different instants; each value is
// exact on its own.
//
// Thread-safety: every member is safe to call from any thread. Collect hooks
// run under the registry's mutex during expose()/snapshot() and must not
// register series.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

// `base` with `extra` appended: one series' labels, the caller's own ones first.
inline Labels with_labels(const Labels& base, std::initializer_list<std::pair<std::string, std::string>> extra) {
  Labels l = base;
  l.insert(l.end(), extra.begin(), extra.end());
  return l;
}

inline constexpr std::size_t kShards = 8;

namespace detail {
// The calling thread's shard, chosen round-robin at its first use.
std::size_t this_thread_shard() noexcept;
}  // namespace detail

class Counter {
 public:
  void inc(std::uint64_t n = 1) noexcept {
    shards_[detail::this_thread_shard()].v.fetch_add(n, std::memory_order_relaxed);
  }
  std::uint64_t value() const noexcept;

 private:
  struct alignas(64) Shard {
    std::atomic<std::uint64_t> v{0};
  };
  std::array<Shard, kShards> shards_{};
};

// Exports a running total that another object owns (a manager's stats()) as a Counter: to(total) adds
// what grew since the last call. Totals that went down (a component restarted) re-base without going back.
struct CounterDelta {
  Counter* c = nullptr;
  std::uint64_t seen = 0;
  void to(std::uint64_t total) noexcept {
    if (total > seen) c->inc(total - seen);
    seen = total;
  }
};

// A value that goes up and down (queue depth, blocks in use). One atomic: gauges are written
// by the one owner of the quantity, so there is no contention to shard away.
class Gauge {
 public:
  void set(double v) noexcept { v_.store(v, std::memory_order_relaxed); }
  void add(double d) noexcept { v_.fetch_add(d, std::memory_order_relaxed); }
  double value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0.0};
};

// One owner's share of a gauge. Owners attached with the same labels (two cache managers in one process, a storage
// tier reopened beside the old one) add up, as their counters do, instead of overwriting each other's value at every
// export: to(v) adds what changed since the last call, and release() takes the owner's share back out when it goes.
struct GaugeShare {
  Gauge* g = nullptr;
  double seen = 0;
  void to(double v) noexcept {
    if (g == nullptr || v == seen) return;
    g->add(v - seen);
    seen = v;
  }
  void release() noexcept { to(0); }
};

// Fixed upper bounds (strictly increasing, finite); the +Inf bucket is implicit.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v) noexcept;
  const std::vector<double>& bounds() const noexcept { return bounds_; }
  // Per bucket (bounds, then +Inf) counts, not cumulative.
  std::vector<std::uint64_t> bucket_counts() const;
  std::uint64_t count() const noexcept;
  double sum() const noexcept;

 private:
  struct alignas(64) Shard {
    std::unique_ptr<std::atomic<std::uint64_t>[]> buckets;
    std::atomic<std::uint64_t> count{0};
    std::atomic<double> sum{0.0};
  };
  std::vector<double> bounds_;
  std::array<Shard, kShards> shards_;
};

// Bucket bounds for latencies in seconds: 1 us .. ~16 s, x2 per bucket.
std::vector<double> latency_buckets_seconds();
// `count` bounds start, start*factor, ...; InvalidArgument unless start > 0, factor > 1, 1 <= count <= 64.
Result<std::vector<double>> exponential_buckets(double start, double factor, int count);

enum class MetricType : std::uint8_t { kCounter, kGauge, kHistogram };
std::string_view metric_type_name(MetricType t) noexcept;

// A point-in-time copy of one family, for exporters that build their own format (the Python collector).
struct FamilySnapshot {
  struct Series {
    Labels labels;
    double value = 0;                    // counter, gauge
    std::vector<std::uint64_t> buckets;  // histogram: cumulative counts per bound, then +Inf
    double sum = 0;                      // histogram
    std::uint64_t count = 0;             // histogram
  };
  std::string name, help;
  MetricType type = MetricType::kCounter;
  std::vector<double> bounds;  // histogram
  std::vector<Series> series;
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The series of `name` with `labels` (created at the first call). InvalidArgument for a bad metric or
  // label name, a label value set whose names differ from the family's, a help text or type other than the
  // family's, or (histograms) bounds other than the family's or not strictly increasing and finite.
  Result<Counter*> counter(std::string_view name, std::string_view help, const Labels& labels = {});
  Result<Gauge*> gauge(std::string_view name, std::string_view help, const Labels& labels = {});
  Result<Histogram*> histogram(std::string_view name, std::string_view help, std::span<const double> bounds,
                               const Labels& labels = {});

  // Runs before every expose()/snapshot(): refreshes gauges computed from other state (pool occupancy).
  // Returns an id for remove_collect_hook().
  std::uint64_t add_collect_hook(std::function<void()> hook);
  void remove_collect_hook(std::uint64_t id);

  // Prometheus text exposition, format 0.0.4: families sorted by name, series by labels.
  std::string expose() const;
  std::vector<FamilySnapshot> snapshot() const;

 private:
  struct Family;
  Result<Family*> family(std::string_view name, std::string_view help, MetricType type, const Labels& labels,
                         std::span<const double> bounds);
  void run_hooks() const;

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Family>, std::less<>> families_;
  std::vector<std::pair<std::uint64_t, std::function<void()>>> hooks_;
  std::uint64_t next_hook_ = 1;
};

// The process-wide registry the library's layers and the CLI use.
Registry& default_registry();

// Text helpers of the exposition format (exposed for tests and other exporters).
bool valid_metric_name(std::string_view name) noexcept;
bool valid_label_name(std::string_view name) noexcept;
std::string escape_label_value(std::string_view v);  // \ -> \\, " -> \", newline -> \n
std::string escape_help(std::string_view v);         // \ -> \\, newline -> \n
std::string format_value(double v);                  // +Inf, -Inf, NaN, shortest round-trip decimal

// Content-Type of the text exposition.
inline constexpr std::string_view kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace kvtier::metrics
