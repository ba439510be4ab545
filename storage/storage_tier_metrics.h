// The registry series of a StorageTier (StorageTier::attach_metrics).
#pragma once

#include <array>

#include "kvtier/metrics/registry.h"
#include "kvtier/storage/storage_tier.h"

namespace kvtier::storage {

inline constexpr int kNumOps = 4;       // StorageOp values
inline constexpr int kNumOutcomes = 6;  // ok, not_found, data_loss, timed_out, unavailable, error

struct StorageTierMetrics {
  using Delta = metrics::CounterDelta;
  std::array<std::array<metrics::Counter*, kNumOutcomes>, kNumOps> items{};
  std::array<metrics::Counter*, kNumOps> bytes{};
  std::array<metrics::Histogram*, kNumOps> latency{};
  metrics::Gauge* objects = nullptr;
  metrics::Gauge* stored_bytes = nullptr;
  metrics::Gauge* capacity_bytes = nullptr;
  metrics::Gauge* direct_io_fallback = nullptr;
  Delta evictions, quarantined, auth_failures, bounce_copies, redirects, reconnects;
};

// Counts a finished op's items, bytes and latency (the polling thread).
void record_metrics(StorageTierMetrics& m, const StorageTierOp& op);

}  // namespace kvtier::storage
