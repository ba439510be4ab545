// TransferManager::attach_metrics on the host backend: the exported series
// equal the manager's own stats() after evictions, loads and an injected
// failure; latency histograms count every settled task and layer; in-flight
// gauges return to 0; attaching twice or with bad labels is refused; a
// destroyed manager leaves the registry scrapeable.
#include <gtest/gtest.h>

#include <string>

#include "kvtier/device/host_device.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/transfer/transfer_manager.h"
#include "transfer/transfer_model.h"
#include "transfer/transfer_test_util.h"

namespace kvtier {
namespace {

using transfer_test::make_host;
using transfer_test::small_gqa;
using transfer_test::TransferRig;

std::vector<BlockId> ids(std::initializer_list<BlockId> l) { return l; }

const metrics::FamilySnapshot* family(const std::vector<metrics::FamilySnapshot>& snap, const std::string& name) {
  for (const auto& f : snap)
    if (f.name == name) return &f;
  return nullptr;
}

// The series of `name` whose labels include every pair of `want`.
const metrics::FamilySnapshot::Series* series(const std::vector<metrics::FamilySnapshot>& snap, const std::string& name,
                                              const metrics::Labels& want) {
  const auto* f = family(snap, name);
  if (!f) return nullptr;
  for (const auto& s : f->series) {
    bool all = true;
    for (const auto& w : want) {
      bool found = false;
      for (const auto& l : s.labels) found |= l == w;
      all &= found;
    }
    if (all) return &s;
  }
  return nullptr;
}

double value(const std::vector<metrics::FamilySnapshot>& snap, const std::string& name, const metrics::Labels& want) {
  const auto* s = series(snap, name, want);
  EXPECT_NE(s, nullptr) << name;
  return s ? s->value : -1;
}

TEST(TransferMetrics, SeriesEqualTheManagersStats) {
  auto dev = make_host(6, 20);
  metrics::Registry reg;  // outlives the manager (attach_metrics' contract)
  TransferRig rig(*dev, transfer_test::small_rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  ASSERT_TRUE(rig.init().ok());
  const metrics::Labels base{{"rank", "3"}};
  ASSERT_TRUE(rig.mgr().attach_metrics(reg, base).ok());
  EXPECT_EQ(rig.mgr().attach_metrics(reg, base).code(), StatusCode::kFailedPrecondition);

  ASSERT_TRUE(rig.compute_write(ids({0, 1, 5})).ok());
  ASSERT_TRUE(rig.evict(ids({0, 1, 5}), ids({0, 1, 7})).ok());
  ASSERT_TRUE(rig.load({}, ids({0, 1}), ids({2, 3}), false).ok());
  rig.quiesce_and_verify();
  dev->fail_nth_operation(1);
  ASSERT_TRUE(rig.load({}, ids({7}), ids({4}), false).ok());
  rig.quiesce_and_verify(true);

  const TransferStats s = rig.mgr().stats();
  ASSERT_EQ(s.evict.tasks_done, 1u);
  ASSERT_EQ(s.load.tasks_failed, 1u);
  const auto snap = reg.snapshot();
  auto l = [&](std::initializer_list<std::pair<const char*, const char*>> extra) {
    metrics::Labels out = base;
    for (const auto& [k, v] : extra) out.emplace_back(k, v);
    return out;
  };
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", l({{"direction", "evict"}, {"outcome", "ok"}})), 1);
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", l({{"direction", "load"}, {"outcome", "ok"}})), 1);
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", l({{"direction", "load"}, {"outcome", "failed"}})), 1);
  EXPECT_EQ(value(snap, "kvtier_transfer_bytes_total", l({{"direction", "evict"}})), double(s.evict.bytes_done));
  EXPECT_EQ(value(snap, "kvtier_transfer_bytes_total", l({{"direction", "evict"}})), 3.0 * 1024);
  EXPECT_EQ(value(snap, "kvtier_transfer_bytes_total", l({{"direction", "load"}})), 2.0 * 1024);
  EXPECT_EQ(value(snap, "kvtier_transfer_blocks_total", l({{"direction", "evict"}})), 3);
  EXPECT_EQ(value(snap, "kvtier_transfer_blocks_total", l({{"direction", "load"}})), 2);
  EXPECT_EQ(value(snap, "kvtier_transfer_failed_blocks_total", l({{"direction", "load"}})), 1);
  EXPECT_EQ(value(snap, "kvtier_transfer_failed_blocks_total", l({{"direction", "evict"}})), 0);
  EXPECT_EQ(value(snap, "kvtier_transfer_layers_total", l({{"outcome", "ok"}})), double(s.layers_done));
  EXPECT_EQ(value(snap, "kvtier_transfer_layers_total", l({{"outcome", "failed"}})), double(s.layers_failed));
  EXPECT_GE(s.layers_failed, 1u);
  EXPECT_EQ(value(snap, "kvtier_transfer_in_flight_tasks", l({{"direction", "load"}})), 0);
  const auto* lat = series(snap, "kvtier_transfer_task_latency_seconds", l({{"direction", "load"}}));
  ASSERT_NE(lat, nullptr);
  EXPECT_EQ(lat->count, 2u);
  EXPECT_GT(lat->sum, 0.0);
  const auto* layer = series(snap, "kvtier_transfer_layer_latency_seconds", base);
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->count, s.layers_done + s.layers_failed);
  EXPECT_EQ(layer->count, 8u);  // 4 layers x 2 loads

  // A second scrape with nothing new changes no counter (deltas, not re-adds).
  const auto again = reg.snapshot();
  EXPECT_EQ(value(again, "kvtier_transfer_bytes_total", l({{"direction", "evict"}})), 3.0 * 1024);
  const std::string text = reg.expose();
  EXPECT_NE(text.find("kvtier_transfer_bytes_total{rank=\"3\",direction=\"evict\"} 3072"), std::string::npos) << text;
}

TEST(TransferMetrics, InFlightGaugeCountsPendingTasksAndSharedLabelsAddUp) {
  auto dev = make_host(7, 0);
  metrics::Registry reg;
  TransferRig a(*dev, transfer_test::small_rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  TransferRig b(*dev, transfer_test::small_rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
  ASSERT_TRUE(a.init().ok());
  ASSERT_TRUE(b.init().ok());
  ASSERT_TRUE(a.mgr().attach_metrics(reg).ok());
  ASSERT_TRUE(b.mgr().attach_metrics(reg).ok());
  // Hold a's output stream so its eviction stays in flight while we scrape.
  transfer_test::Gate gate;
  ASSERT_TRUE(gate.block(*dev, a.mgr().output_stream()).ok());
  ASSERT_TRUE(a.compute_write(ids({0})).ok());
  ASSERT_TRUE(a.evict(ids({0}), ids({0})).ok());
  ASSERT_TRUE(b.compute_write(ids({1})).ok());
  ASSERT_TRUE(b.evict(ids({1}), ids({1})).ok());
  ASSERT_TRUE(b.mgr().wait_all(std::chrono::seconds(10)).ok());
  auto snap = reg.snapshot();
  EXPECT_EQ(value(snap, "kvtier_transfer_in_flight_tasks", {{"direction", "evict"}}), 1);
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", {{"direction", "evict"}, {"outcome", "ok"}}), 1);
  gate.release();
  ASSERT_TRUE(a.mgr().wait_all(std::chrono::seconds(10)).ok());
  snap = reg.snapshot();
  EXPECT_EQ(value(snap, "kvtier_transfer_in_flight_tasks", {{"direction", "evict"}}), 0);
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", {{"direction", "evict"}, {"outcome", "ok"}}), 2);
  EXPECT_EQ(value(snap, "kvtier_transfer_blocks_total", {{"direction", "evict"}}), 2);
}

TEST(TransferMetrics, BadLabelsAreRefusedAndADestroyedManagerLeavesTheRegistryScrapeable) {
  auto dev = make_host(8, 0);
  metrics::Registry reg;
  {
    TransferRig rig(*dev, transfer_test::small_rig_options(small_gqa(), CopyStrategy::kDmaPerRun));
    ASSERT_TRUE(rig.init().ok());
    Status bad = rig.mgr().attach_metrics(reg, {{"bad-label", "x"}});
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.message().find("bad-label"), std::string::npos) << bad.to_string();
    ASSERT_TRUE(rig.mgr().attach_metrics(reg, {{"rank", "0"}}).ok()) << "a refused attach leaves it attachable";
    ASSERT_TRUE(rig.compute_write(ids({0})).ok());
    ASSERT_TRUE(rig.evict(ids({0}), ids({0})).ok());
    ASSERT_TRUE(rig.mgr().wait_all(std::chrono::seconds(10)).ok());
    (void)reg.expose();
    // Work after the last scrape: the counters were exported only by scrapes, so it was lost with the manager.
    ASSERT_TRUE(rig.compute_write(ids({1, 2})).ok());
    ASSERT_TRUE(rig.evict(ids({1, 2}), ids({1, 2})).ok());
    ASSERT_TRUE(rig.mgr().wait_all(std::chrono::seconds(10)).ok());
  }
  // The hook left with the manager: scraping reads nothing freed (ASan) and keeps the totals, the work after the
  // last scrape included.
  const auto snap = reg.snapshot();
  EXPECT_EQ(value(snap, "kvtier_transfer_blocks_total", {{"direction", "evict"}, {"rank", "0"}}), 3);
  EXPECT_EQ(value(snap, "kvtier_transfer_tasks_total", {{"direction", "evict"}, {"outcome", "ok"}, {"rank", "0"}}), 2);
  EXPECT_EQ(value(snap, "kvtier_transfer_in_flight_tasks", {{"direction", "evict"}, {"rank", "0"}}), 0);
}

}  // namespace
}  // namespace kvtier
