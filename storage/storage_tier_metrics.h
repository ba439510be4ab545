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
  // This tier's shares (metrics::GaugeShare): tiers attached with the same labels add up; released when it goes.
  metrics::GaugeShare objects, stored_bytes, capacity_bytes, direct_io_fallback;
  Delta evictions, quarantined, auth_failures, bounce_copies, redirects, reconnects;
};

// Counts a finished op's items, bytes and latency (the polling thread).
void record_metrics(StorageTierMetrics& m, const StorageTierOp& op);

}  // namespace kvtier::storage
