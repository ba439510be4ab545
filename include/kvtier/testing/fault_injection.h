// FaultInjectingBackend: a StorageBackend decorator for tests (RocksDB's
// FaultInjectionTestFS in spirit). Faults are counted per item in posting
// order, across batches; all knobs may be changed at any time (thread-safe).
//
//   fail_every_nth / fail_nth   the item never reaches the inner backend and
//                               completes with `fail_code` (Unavailable default)
//   drop_every_nth              the inner backend does the work, but its
//                               completion is "lost": the item completes with
//                               Unavailable after drop_timeout (never hangs);
//                               a dropped put may or may not have been stored
//   corrupt_every_nth_put       after the inner put is acknowledged, flips a
//                               bit of the stored object (bit rot): a later get
//                               must fail verification (DataLoss), never return it
//   corrupt_every_nth_get       flips a bit of the stored object before the get
//                               reaches the inner backend
//   offline                     every new item completes with Unavailable
//
// Invariants the conformance suite checks through this wrapper: no get
// reports OK with bytes other than those of an acknowledged put, and every
// acknowledged put that was not corrupted stays readable.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "kvtier/backend/storage_backend.h"

namespace kvtier::storage {

struct FaultConfig {
  std::uint64_t fail_every_nth = 0;  // 0 = never
  std::uint64_t fail_nth = 0;        // fail exactly the nth item (1-based), 0 = never
  StatusCode fail_code = StatusCode::kUnavailable;
  std::uint64_t drop_every_nth = 0;
  std::chrono::milliseconds drop_timeout{50};
  std::uint64_t corrupt_every_nth_put = 0;
  std::uint64_t corrupt_every_nth_get = 0;
  std::uint64_t seed = 1;
};

struct FaultCounters {
  std::uint64_t items = 0;
  std::uint64_t failed = 0;
  std::uint64_t dropped = 0;
  std::uint64_t corrupted = 0;
  std::uint64_t offline_rejected = 0;
};

class FaultInjectingBackend : public StorageBackendWrapper {
 public:
  FaultInjectingBackend(std::unique_ptr<StorageBackend> inner, FaultConfig config);
  ~FaultInjectingBackend() override;

  std::string_view name() const noexcept override { return name_; }
  Result<StorageTicket> post(StorageBatch batch) override;
  // Cancels the inner work of a ticket this wrapper returned.
  Status cancel(const StorageTicket& ticket) override;

  void set_config(const FaultConfig& config);
  void set_offline(bool offline) noexcept { offline_.store(offline); }
  FaultCounters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string name_;
  std::atomic<bool> offline_{false};
};

}  // namespace kvtier::storage
