// TransferManager::attach_metrics: the registry series of one manager. The
// histograms are observed by the progress thread as tasks settle; counters and
// gauges follow stats() when the registry is scraped (its collect hook).
#include <fmt/format.h>

#include "transfer/transfer_manager_impl.h"

namespace kvtier::transfer_detail {

namespace {
constexpr const char* kDirs[kNumDirs] = {"evict", "load", "external"};
}  // namespace

Status TransferManagerImpl::attach_metrics(metrics::Registry& registry, const metrics::Labels& labels) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (metrics_) return FailedPrecondition("attach_metrics: this transfer manager is already attached to a registry");
  }
  auto m = std::make_unique<TransferMetricSeries>();
  const std::vector<double> buckets = metrics::latency_buckets_seconds();
  for (int d = 0; d < kNumDirs; ++d) {
    const char* dir = kDirs[d];
    KVTIER_ASSIGN_OR_RETURN(m->tasks_ok[d].c,
                            registry.counter("kvtier_transfer_tasks_total", "Transfer tasks that became final.",
                                             metrics::with_labels(labels, {{"direction", dir}, {"outcome", "ok"}})));
    KVTIER_ASSIGN_OR_RETURN(
        m->tasks_failed[d].c,
        registry.counter("kvtier_transfer_tasks_total", "Transfer tasks that became final.",
                         metrics::with_labels(labels, {{"direction", dir}, {"outcome", "failed"}})));
    KVTIER_ASSIGN_OR_RETURN(m->bytes[d].c, registry.counter("kvtier_transfer_bytes_total",
                                                            "Bytes of transfer tasks that completed successfully.",
                                                            metrics::with_labels(labels, {{"direction", dir}})));
    KVTIER_ASSIGN_OR_RETURN(m->blocks[d].c, registry.counter("kvtier_transfer_blocks_total",
                                                             "Blocks of transfer tasks that completed successfully.",
                                                             metrics::with_labels(labels, {{"direction", dir}})));
    KVTIER_ASSIGN_OR_RETURN(m->failed_blocks[d].c,
                            registry.counter("kvtier_transfer_failed_blocks_total",
                                             "Destination blocks of failed tasks reported failed (never loaded).",
                                             metrics::with_labels(labels, {{"direction", dir}})));
    KVTIER_ASSIGN_OR_RETURN(m->in_flight[d], registry.gauge("kvtier_transfer_in_flight_tasks",
                                                            "Transfer tasks submitted and not yet final.",
                                                            metrics::with_labels(labels, {{"direction", dir}})));
    KVTIER_ASSIGN_OR_RETURN(m->task_latency[d], registry.histogram("kvtier_transfer_task_latency_seconds",
                                                                   "Submit to final of a transfer task.", buckets,
                                                                   metrics::with_labels(labels, {{"direction", dir}})));
  }
  KVTIER_ASSIGN_OR_RETURN(
      m->layers_ok.c,
      registry.counter("kvtier_transfer_layers_total", "Layers of load tasks and external writes that became final.",
                       metrics::with_labels(labels, {{"outcome", "ok"}})));
  KVTIER_ASSIGN_OR_RETURN(
      m->layers_failed.c,
      registry.counter("kvtier_transfer_layers_total", "Layers of load tasks and external writes that became final.",
                       metrics::with_labels(labels, {{"outcome", "failed"}})));
  KVTIER_ASSIGN_OR_RETURN(m->layer_latency,
                          registry.histogram("kvtier_transfer_layer_latency_seconds",
                                             "Submit of a load to the layer's completion (what a forward pass "
                                             "waiting on the layer sees).",
                                             buckets, labels));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (metrics_) return FailedPrecondition("attach_metrics: this transfer manager is already attached to a registry");
    metrics_ = std::move(m);
    metrics_registry_ = &registry;
  }
  metrics_hook_ = registry.add_collect_hook([this] { export_metrics(); });
  return Status::Ok();
}

void TransferManagerImpl::export_metrics() {
  const TransferStats s = stats();
  std::lock_guard<std::mutex> lock(mu_);
  TransferMetricSeries& m = *metrics_;
  const DirectionStats* dirs[kNumDirs] = {&s.evict, &s.load, &s.external};
  for (int d = 0; d < kNumDirs; ++d) {
    m.tasks_ok[d].to(dirs[d]->tasks_done);
    m.tasks_failed[d].to(dirs[d]->tasks_failed);
    m.bytes[d].to(dirs[d]->bytes_done);
    m.blocks[d].to(dirs[d]->blocks_done);
    m.failed_blocks[d].to(dirs[d]->blocks_failed);
    // add(), not set(): managers sharing the series sum up.
    const double now = static_cast<double>(dirs[d]->in_flight);
    m.in_flight[d]->add(now - m.in_flight_seen[d]);
    m.in_flight_seen[d] = now;
  }
  m.layers_ok.to(s.layers_done);
  m.layers_failed.to(s.layers_failed);
}

}  // namespace kvtier::transfer_detail
