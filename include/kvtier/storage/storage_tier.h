// StorageTier: the adapter the cache manager plugs a StorageBackend in with.
// It moves whole blocks between a pinned host BlockSpace and storage objects,
// addressed by (block key, host block id):
//   write(keys, host_blocks)  host -> storage (write-through / write-back of evicted host blocks)
//   read(keys, host_blocks)   storage -> host (prefetch when a prefix match reaches the storage tier)
//   exists(keys), remove(keys)
//
// Object payload = the block's packed page-first bytes (every layer and role
// in (layer, role) order, no padding: KvLayout::total_block_bytes()), the
// roles table from format::roles_from_layout(layout, 1). Every host layout
// produces the same object, so instances with page-first and layer-first host
// pools share stored blocks. Page-first host spaces whose roles sit at packed
// offsets move blocks without a copy (pointer into the page); other layouts
// gather into / scatter from per-op staging pages (memcpy on the calling
// thread for writes, inside poll() for reads).
//
// Wiring in the cache manager (policy stays in cache/):
//   - write-through: after a D2H eviction into host block h completed, write({key}, {h});
//     write-back: when the host pool evicts h, write({key}, {h}) and release h
//     only after the op is done (the source must stay unmodified until then).
//   - match: probe exists(keys) for the blocks past the host hit, keep the longest OK prefix;
//     prefetch: allocate host blocks, read(keys, hosts); a block whose status
//     is not OK (NotFound, DataLoss, Unavailable) is a miss from there on:
//     truncate the prefix at the first failure and recompute.
//   - destination host blocks must not be read (or handed out) before the op is done.
//
// Thread-safety: StorageTier methods are thread-safe. A StorageTierOp belongs
// to one thread (poll() may scatter into host blocks).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvtier/backend/storage_backend.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/metrics/registry.h"

namespace kvtier::storage {

class StorageTier;
struct StorageTierMetrics;  // storage_tier_metrics.cc

// One block operation of a StorageTier. The backend borrows host blocks (and
// the op's staging pages) until the op is done; destroying an unfinished op
// blocks until its backend work has completed, so no buffer is freed under it.
class StorageTierOp {
 public:
  StorageTierOp() = default;
  StorageTierOp(StorageTierOp&&) noexcept = default;
  StorageTierOp& operator=(StorageTierOp&& other) noexcept {
    if (this != &other) {
      drain();
      tier_ = other.tier_;
      op_ = other.op_;
      ticket_ = std::move(other.ticket_);
      blocks_ = std::move(other.blocks_);
      staging_ = std::move(other.staging_);
      staged_ = other.staged_;
      finished_ = other.finished_;
      posted_ = other.posted_;
      statuses_ = std::move(other.statuses_);
    }
    return *this;
  }
  ~StorageTierOp() { drain(); }

  // Non-blocking. True once every block completed (and, for reads through
  // staging, was scattered into its host block).
  bool poll();
  // Blocks until done or timeout (TimedOut: still pending).
  Status wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
  std::size_t size() const noexcept { return blocks_.size(); }
  // Per-block outcome; valid after poll() returned true.
  Status status(std::size_t i) const;
  // Number of leading blocks that are OK (the usable prefix of a read/exists).
  std::size_t ok_prefix() const;

 private:
  void drain() noexcept {
    while (ticket_.valid() && !ticket_.poll()) ticket_.wait(std::chrono::milliseconds(1000)).ignore_error();
  }
  friend class StorageTier;
  friend void record_metrics(StorageTierMetrics& m, const StorageTierOp& op);
  const StorageTier* tier_ = nullptr;
  StorageOp op_ = StorageOp::kGet;
  StorageTicket ticket_;
  std::vector<std::uint64_t> blocks_;
  std::vector<std::byte> staging_;  // one packed page per block when staged
  bool staged_ = false;
  bool finished_ = false;
  std::chrono::steady_clock::time_point posted_;
  std::vector<KeptStatus> statuses_;
};

class StorageTier {
 public:
  // StorageOptions the backend must be created with for `layout` in namespace `ns`.
  static StorageOptions storage_options(const KvLayout& layout, std::string ns);

  // `host` must be pinned-host memory. The backend's options must equal
  // storage_options(host.layout(), ns) for some ns (checked: fingerprint and roles).
  static Result<std::unique_ptr<StorageTier>> create(std::unique_ptr<StorageBackend> backend, BlockSpace host,
                                                     std::uint32_t rank);

  Result<StorageTierOp> write(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks);
  Result<StorageTierOp> read(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks);
  Result<StorageTierOp> exists(std::span<const StorageKey> keys);
  Result<StorageTierOp> remove(std::span<const StorageKey> keys);

  ~StorageTier();

  // Metrics (metrics/registry.h), every series carrying `labels` plus backend = backend().name():
  //   kvtier_storage_items_total{op,outcome}   items that completed, outcome = ok | not_found | data_loss
  //                                            (failed verification: quarantined, a miss) | timed_out |
  //                                            unavailable | error
  //   kvtier_storage_bytes_total{op}           payload bytes of OK gets and puts
  //   kvtier_storage_op_latency_seconds{op}    post to the op observed done (poll/wait), per batch
  //   kvtier_storage_objects, kvtier_storage_stored_bytes, kvtier_storage_capacity_bytes   (gauges)
  //   kvtier_storage_evictions_total, kvtier_storage_quarantined_total, kvtier_storage_auth_failures_total,
  //   kvtier_storage_bounce_copies_total,
  //   kvtier_storage_redirects_total, kvtier_storage_reconnects_total   (the backend's StorageStats)
  //   kvtier_storage_direct_io_fallback        (gauge) 1 when the disk backend's O_DIRECT probe failed
  //                                            and it runs on buffered I/O (StorageStats::direct_io_fallback)
  // Items and latencies are counted by the thread that polls an op (lock-free); the backend's stats are
  // read when the registry is scraped. The registry must outlive the tier. FailedPrecondition when
  // already attached; InvalidArgument for bad labels.
  Status attach_metrics(metrics::Registry& registry, const metrics::Labels& labels = {});

  StorageBackend& backend() noexcept { return *backend_; }
  const BlockSpace& host() const noexcept { return host_; }
  std::uint64_t object_bytes() const noexcept { return object_bytes_; }
  bool zero_copy() const noexcept { return zero_copy_; }

 private:
  friend class StorageTierOp;
  StorageTier(std::unique_ptr<StorageBackend> backend, BlockSpace host, std::uint32_t rank);
  Status check(std::span<const StorageKey> keys, std::span<const std::uint64_t> host_blocks) const;
  Status size_staging(StorageTierOp& op, std::size_t keys, const char* what) const;
  void gather(std::uint64_t block, std::byte* dst) const;
  void scatter(const std::byte* src, std::uint64_t block) const;
  StorageKey with_rank(StorageKey k) const {
    k.rank = rank_;
    return k;
  }

  std::unique_ptr<StorageBackend> backend_;
  BlockSpace host_;
  std::uint32_t rank_ = 0;
  std::uint64_t object_bytes_ = 0;
  bool zero_copy_ = false;
  std::unique_ptr<StorageTierMetrics> metrics_owned_;
  std::atomic<StorageTierMetrics*> metrics_{nullptr};
  metrics::Registry* metrics_registry_ = nullptr;
  std::uint64_t metrics_hook_ = 0;
};

}  // namespace kvtier::storage
