// CacheManager::attach_metrics: stats() as registry series. The manager is
// driven by one thread, so it pushes deltas into the (lock-free) series at the
// end of each public call instead of being read from the scrape thread.
#include <fmt/format.h>

#include "cache/cache_manager_impl.h"

namespace kvtier::cache {

Status CacheManager::attach_metrics(metrics::Registry& reg, const metrics::Labels& labels) {
  if (metrics_) return FailedPrecondition("attach_metrics: this cache manager is already attached to a registry");
  // The manager's own label names, checked before anything is registered: a clash found halfway left series
  // registered under the caller's labels, which fixed their families' label names for every later attach.
  for (const char* own : {"tier", "policy", "action", "expert", "kind", "outcome"})
    for (const auto& label : labels)
      if (label.first == own)
        return InvalidArgument(fmt::format("attach_metrics: label '{}' is one the cache manager sets itself", own));
  auto m = std::make_unique<MetricSeries>();
  auto counter = [&](MetricSeries::Delta& d, const char* name, const char* help, const metrics::Labels& l) -> Status {
    KVTIER_ASSIGN_OR_RETURN(d.c, reg.counter(name, help, l));
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(
      counter(m->lookups, "kvtier_cache_lookup_blocks_total", "Keys looked up by successful admissions.", labels));
  KVTIER_RETURN_IF_ERROR(counter(m->misses, "kvtier_cache_miss_blocks_total",
                                 "Keys of successful admissions found in no tier (computed).", labels));
  KVTIER_RETURN_IF_ERROR(counter(m->admissions, "kvtier_cache_admissions_total", "admit() calls.", labels));
  KVTIER_RETURN_IF_ERROR(counter(m->refusals, "kvtier_cache_admission_refusals_total",
                                 "admit() calls refused (too few free or evictable device blocks).", labels));
  KVTIER_RETURN_IF_ERROR(
      counter(m->lost_host_drops, "kvtier_cache_lost_host_drops_total", "Host drops of a block's last copy.", labels));
  KVTIER_RETURN_IF_ERROR(counter(m->failed, "kvtier_cache_failed_transfers_total",
                                 "Block moves acknowledged as failed (their blocks and subtrees became misses).",
                                 labels));
  KVTIER_RETURN_IF_ERROR(counter(m->invalidated, "kvtier_cache_invalidated_blocks_total",
                                 "Indexed blocks invalidated by a failed move below or at them.", labels));
  KVTIER_RETURN_IF_ERROR(
      counter(m->resets, "kvtier_cache_resets_total", "reset() calls that cleared the index.", labels));
  const std::string policies[kNumTiers] = {config_.device_policy, config_.host_policy, config_.storage_policy};
  for (int t = 0; t < kNumTiers; ++t) {
    const std::string tier(tier_name(static_cast<Tier>(t)));
    KVTIER_RETURN_IF_ERROR(counter(m->hits[t], "kvtier_cache_hit_blocks_total",
                                   "Keys of successful admissions found in a tier (device served, host loaded, "
                                   "storage present).",
                                   metrics::with_labels(labels, {{"tier", tier}})));
    KVTIER_RETURN_IF_ERROR(
        counter(m->dropped[t], "kvtier_cache_evictions_total",
                "Copies a tier's eviction policy gave up: moved to the next tier or dropped.",
                metrics::with_labels(labels, {{"tier", tier}, {"policy", policies[t]}, {"action", "dropped"}})));
    KVTIER_ASSIGN_OR_RETURN(m->used[t].g, reg.gauge("kvtier_cache_pool_used_blocks", "Blocks in use in a tier's pool.",
                                                    metrics::with_labels(labels, {{"tier", tier}})));
    KVTIER_ASSIGN_OR_RETURN(m->capacity[t].g, reg.gauge("kvtier_cache_pool_capacity_blocks", "Blocks of a tier's pool.",
                                                        metrics::with_labels(labels, {{"tier", tier}})));
    KVTIER_ASSIGN_OR_RETURN(m->resident[t].g,
                            reg.gauge("kvtier_cache_resident_blocks", "Settled copies indexed in a tier.",
                                      metrics::with_labels(labels, {{"tier", tier}})));
    KVTIER_RETURN_IF_ERROR(counter(m->policy_switches[t], "kvtier_cache_policy_switches_total",
                                   "Times the lead of a tier's dueling eviction policy changed hands.",
                                   metrics::with_labels(labels, {{"tier", tier}, {"policy", policies[t]}})));
    for (const std::string_view expert : policy_experts(policies[t])) {
      metrics::Gauge* g = nullptr;
      KVTIER_ASSIGN_OR_RETURN(
          g, reg.gauge("kvtier_cache_policy_lead",
                       "1 for the expert whose order a tier's eviction policy follows now (a duel's; any other "
                       "policy is its own one expert), 0 for the others; managers with the same labels add up.",
                       metrics::with_labels(
                           labels, {{"tier", tier}, {"policy", policies[t]}, {"expert", std::string(expert)}})));
      m->policy_lead[t].push_back(metrics::GaugeShare{g});
    }
  }
  KVTIER_RETURN_IF_ERROR(
      counter(m->moved_device, "kvtier_cache_evictions_total",
              "Copies a tier's eviction policy gave up: moved to the next tier or dropped.",
              metrics::with_labels(labels, {{"tier", "device"}, {"policy", policies[0]}, {"action", "moved"}})));
  struct {
    MetricSeries::Delta* d;
    const char* kind;
  } moves[] = {{&m->loads, "load"},
               {&m->evictions, "evict"},
               {&m->backups, "backup"},
               {&m->storage_writes, "storage_write"},
               {&m->storage_prefetches, "storage_prefetch"},
               {&m->pressure_demotions, "pressure_demotion"}};
  for (auto& mv : moves)
    KVTIER_RETURN_IF_ERROR(counter(*mv.d, "kvtier_cache_moves_total", "Block moves queued in step plans, by kind.",
                                   metrics::with_labels(labels, {{"kind", mv.kind}})));
  struct {
    MetricSeries::Delta* d;
    const char* outcome;
  } receives[] = {{&m->received, "admitted"},
                  {&m->received_loaded, "loaded"},
                  {&m->received_committed, "committed"},
                  {&m->quarantined, "quarantined"}};
  for (auto& r : receives)
    KVTIER_RETURN_IF_ERROR(counter(*r.d, "kvtier_cache_receive_blocks_total",
                                   "P/D receive blocks: admitted, reported loaded, joined the index, quarantined.",
                                   metrics::with_labels(labels, {{"outcome", r.outcome}})));
  KVTIER_ASSIGN_OR_RETURN(m->receiving_now.g, reg.gauge("kvtier_cache_receiving_blocks",
                                                        "Device blocks a P/D peer is writing now.", labels));
  KVTIER_ASSIGN_OR_RETURN(m->quarantined_now.g,
                          reg.gauge("kvtier_cache_quarantined_blocks",
                                    "Device blocks of failed receives a peer may still write (in no pool).", labels));
  KVTIER_ASSIGN_OR_RETURN(m->index_blocks.g,
                          reg.gauge("kvtier_cache_index_blocks", "Blocks in the prefix index.", labels));
  metrics_ = std::move(m);
  export_metrics();
  return Status::Ok();
}

void CacheManager::export_metrics() {
  if (!metrics_) return;
  MetricSeries& m = *metrics_;
  const CacheStats s = stats();
  m.lookups.to(s.lookup_blocks);
  m.misses.to(s.lookup_blocks - s.hit_blocks[0] - s.hit_blocks[1] - s.hit_blocks[2]);
  m.admissions.to(s.admissions);
  m.refusals.to(s.admission_failures);
  m.lost_host_drops.to(s.lost_host_drops);
  m.failed.to(s.failed_transfers);
  m.invalidated.to(s.invalidated_blocks);
  m.resets.to(s.resets);
  for (int t = 0; t < kNumTiers; ++t) m.hits[t].to(s.hit_blocks[t]);
  m.moved_device.to(s.evictions_d2h);
  m.dropped[0].to(s.drops_device);
  m.dropped[1].to(s.drops_host);
  m.dropped[2].to(s.drops_storage);
  m.loads.to(s.loads_h2d);
  m.evictions.to(s.evictions_d2h);
  m.backups.to(s.backups_d2h);
  m.storage_writes.to(s.storage_writes);
  m.storage_prefetches.to(s.storage_prefetches);
  m.pressure_demotions.to(s.pressure_demotions);
  for (int t = 0; t < kNumTiers; ++t) {
    m.used[t].to(static_cast<double>(s.tiers[t].used));
    m.capacity[t].to(static_cast<double>(s.tiers[t].capacity));
    m.resident[t].to(static_cast<double>(s.tiers[t].resident));
    m.policy_switches[t].to(s.tiers[t].policy_switches);
    // An expert named twice in a duel is one series (the registry's) with two shares: 1 when either place leads.
    auto& lead = m.policy_lead[t];
    for (std::size_t e = 0; e < lead.size(); ++e) lead[e].to(e == s.tiers[t].policy_expert ? 1.0 : 0.0);
  }
  m.received.to(s.received_blocks);
  m.received_loaded.to(s.received_loaded_blocks);
  m.received_committed.to(s.received_committed_blocks);
  m.quarantined.to(s.quarantined_blocks);
  m.receiving_now.to(static_cast<double>(s.receiving_device_blocks));
  m.quarantined_now.to(static_cast<double>(s.quarantined_device_blocks));
  m.index_blocks.to(static_cast<double>(s.nodes));
}

}  // namespace kvtier::cache
