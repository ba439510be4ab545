// StorageTier::attach_metrics: per-item outcomes and per-op latencies counted
// by the thread that polls an op; the backend's own StorageStats read at
// scrape time through a collect hook (backends are thread-safe).
#include "storage/storage_tier_metrics.h"

#include <fmt/format.h>

namespace kvtier::storage {

namespace {
constexpr const char* kOutcomes[kNumOutcomes] = {"ok", "not_found", "data_loss", "timed_out", "unavailable", "error"};

int outcome_index(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return 0;
    case StatusCode::kNotFound: return 1;
    case StatusCode::kDataLoss: return 2;
    case StatusCode::kTimedOut: return 3;
    case StatusCode::kUnavailable: return 4;
    default: return 5;
  }
}
}  // namespace

void record_metrics(StorageTierMetrics& m, const StorageTierOp& op) {
  const int o = static_cast<int>(op.op_);
  std::uint64_t ok = 0;
  for (const Status& s : op.statuses_) {
    const int i = outcome_index(s);
    m.items[o][i]->inc();
    ok += i == 0;
  }
  if (op.op_ == StorageOp::kGet || op.op_ == StorageOp::kPut) m.bytes[o]->inc(ok * op.tier_->object_bytes());
  m.latency[o]->observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - op.posted_).count());
}

StorageTier::~StorageTier() {
  if (metrics_registry_ == nullptr) return;
  metrics_registry_->remove_collect_hook(metrics_hook_);  // no scrape runs the hook after this returns
  if (metrics_owned_)
    for (metrics::GaugeShare* g : {&metrics_owned_->objects, &metrics_owned_->stored_bytes,
                                   &metrics_owned_->capacity_bytes, &metrics_owned_->direct_io_fallback})
      g->release();
}

Status StorageTier::attach_metrics(metrics::Registry& reg, const metrics::Labels& labels) {
  if (metrics_owned_) return FailedPrecondition("attach_metrics: this storage tier is already attached to a registry");
  auto m = std::make_unique<StorageTierMetrics>();
  const metrics::Labels base = metrics::with_labels(labels, {{"backend", std::string(backend_->name())}});
  const std::vector<double> buckets = metrics::latency_buckets_seconds();
  for (int o = 0; o < kNumOps; ++o) {
    const std::string op(storage_op_name(static_cast<StorageOp>(o)));
    for (int i = 0; i < kNumOutcomes; ++i) {
      KVTIER_ASSIGN_OR_RETURN(
          m->items[o][i],
          reg.counter("kvtier_storage_items_total", "Storage items that completed, by operation and outcome.",
                      metrics::with_labels(base, {{"op", op}, {"outcome", kOutcomes[i]}})));
    }
    KVTIER_ASSIGN_OR_RETURN(
        m->bytes[o], reg.counter("kvtier_storage_bytes_total", "Payload bytes of storage gets and puts that succeeded.",
                                 metrics::with_labels(base, {{"op", op}})));
    KVTIER_ASSIGN_OR_RETURN(m->latency[o], reg.histogram("kvtier_storage_op_latency_seconds",
                                                         "Post to observed completion of a storage batch.", buckets,
                                                         metrics::with_labels(base, {{"op", op}})));
  }
  KVTIER_ASSIGN_OR_RETURN(m->objects.g, reg.gauge("kvtier_storage_objects", "Objects the backend indexes.", base));
  KVTIER_ASSIGN_OR_RETURN(m->stored_bytes.g,
                          reg.gauge("kvtier_storage_stored_bytes", "Bytes on the medium, headers included.", base));
  KVTIER_ASSIGN_OR_RETURN(m->capacity_bytes.g,
                          reg.gauge("kvtier_storage_capacity_bytes", "Capacity of the medium (0: unlimited).", base));
  KVTIER_ASSIGN_OR_RETURN(
      m->direct_io_fallback.g,
      reg.gauge("kvtier_storage_direct_io_fallback",
                "1 when the disk backend's O_DIRECT probe failed and it runs on buffered I/O for its life.", base));
  auto counter = [&](StorageTierMetrics::Delta& d, const char* name, const char* help) -> Status {
    KVTIER_ASSIGN_OR_RETURN(d.c, reg.counter(name, help, base));
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(counter(m->evictions, "kvtier_storage_evictions_total", "Objects the backend evicted."));
  KVTIER_RETURN_IF_ERROR(counter(m->quarantined, "kvtier_storage_quarantined_total",
                                 "Objects that failed verification and were quarantined."));
  KVTIER_RETURN_IF_ERROR(counter(m->auth_failures, "kvtier_storage_auth_failures_total",
                                 "Objects refused by the tenant MAC (forged, foreign or unkeyed): misses."));
  KVTIER_RETURN_IF_ERROR(
      counter(m->bounce_copies, "kvtier_storage_bounce_copies_total", "Items moved through a bounce buffer."));
  KVTIER_RETURN_IF_ERROR(
      counter(m->redirects, "kvtier_storage_redirects_total", "Cluster MOVED/ASK redirects followed."));
  KVTIER_RETURN_IF_ERROR(counter(m->reconnects, "kvtier_storage_reconnects_total",
                                 "Connections re-established after a failure (retries of remote backends)."));
  metrics_owned_ = std::move(m);
  metrics_registry_ = &reg;
  StorageTierMetrics* raw = metrics_owned_.get();
  metrics_hook_ = reg.add_collect_hook([this, raw] {
    const StorageStats s = backend_->stats();
    raw->objects.to(static_cast<double>(s.objects));
    raw->stored_bytes.to(static_cast<double>(s.bytes));
    raw->capacity_bytes.to(static_cast<double>(s.capacity_bytes));
    raw->direct_io_fallback.to(static_cast<double>(s.direct_io_fallback));
    raw->evictions.to(s.evictions);
    raw->quarantined.to(s.quarantined);
    raw->auth_failures.to(s.auth_failures);
    raw->bounce_copies.to(s.bounce_copies);
    raw->redirects.to(s.redirects);
    raw->reconnects.to(s.reconnects);
  });
  metrics_.store(raw, std::memory_order_release);
  return Status::Ok();
}

}  // namespace kvtier::storage
