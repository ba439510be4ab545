// StorageTier::attach_metrics over the disk backend: items by outcome (ok,
// not_found, data_loss of a corrupted object), bytes, batch latencies and the
// backend's own counters (quarantined) appear in the exposition with the
// values the operations produced.
#include <gtest/gtest.h>

#include <string>

#include "kvtier/metrics/registry.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/storage_tier.h"
#include "kvtier/testing/disk_fault.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using namespace testing;

bool has_line(const std::string& text, const std::string& line) { return text.find(line + "\n") != std::string::npos; }

// A pinned-host, page-first space of `blocks` blocks of one layer of 4 KiB.
struct OneLayerPages {
  explicit OneLayerPages(std::uint64_t blocks)
      : layout(KvLayout::uniform(1, 1, 4096).value()),
        region(BlockSpace::page_first_page_bytes(layout, 4096) * blocks),
        space(BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, blocks, region.data(), region.size(), 4096)
                  .value()) {}
  KvLayout layout;
  AlignedBuffer region;
  BlockSpace space;
};

TEST(StorageMetrics, ItemsBytesLatencyAndQuarantineFollowTheOperations) {
  metrics::Registry reg;  // outlives the tier, as attach_metrics requires
  auto layout = KvLayout::uniform(2, 1, 4096);
  ASSERT_TRUE(layout.ok());
  constexpr std::uint64_t kBlocks = 8;
  const std::uint64_t page = BlockSpace::page_first_page_bytes(*layout, 4096);
  AlignedBuffer region(page * kBlocks);
  auto space = BlockSpace::page_first(MemoryKind::kPinnedHost, 0, *layout, kBlocks, region.data(), region.size(), 4096);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  for (std::uint64_t b = 0; b < kBlocks; ++b)
    for (std::uint32_t l = 0; l < 2; ++l) fill_random(space->block_ptr(l, 0, b), 4096, b * 10 + l);
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  auto backend = create_disk_backend(c, StorageTier::storage_options(*layout, "metrics-test"));
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  auto tier = StorageTier::create(std::move(backend).value(), *space, 0);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE((*tier)->attach_metrics(reg, {{"instance", "i0"}}).ok());
  EXPECT_EQ((*tier)->attach_metrics(reg).code(), StatusCode::kFailedPrecondition);
  const std::uint64_t object = (*tier)->object_bytes();
  ASSERT_EQ(object, 2u * 4096u);

  std::vector<StorageKey> keys = {key_of(1, 0), key_of(1, 1), key_of(1, 2)};
  auto w = (*tier)->write(keys, std::vector<std::uint64_t>{0, 1, 2});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->wait().ok());
  for (std::size_t i = 0; i < 3; ++i) ASSERT_TRUE(w->status(i).ok()) << w->status(i).to_string();
  // Flip a byte of the third object's payload: its get fails verification (data_loss) and quarantines it.
  auto n = (*tier)->backend().stored_object_bytes(keys[2]);
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  ASSERT_TRUE((*tier)->backend().corrupt_stored_object(keys[2], *n - 1, 0x01).ok());
  std::vector<StorageKey> rkeys = {keys[0], keys[1], key_of(1, 9), keys[2]};
  auto r = (*tier)->read(rkeys, std::vector<std::uint64_t>{4, 5, 6, 7});
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->wait().ok());
  EXPECT_TRUE(r->status(0).ok());
  EXPECT_EQ(r->status(2).code(), StatusCode::kNotFound);
  EXPECT_EQ(r->status(3).code(), StatusCode::kDataLoss) << r->status(3).to_string();
  ASSERT_EQ((*tier)->backend().stats().quarantined, 1u);

  const std::string text = reg.expose();
  const std::string l = "instance=\"i0\",backend=\"" + std::string((*tier)->backend().name()) + "\"";
  EXPECT_TRUE(has_line(text, "kvtier_storage_items_total{" + l + ",op=\"put\",outcome=\"ok\"} 3")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_items_total{" + l + ",op=\"get\",outcome=\"ok\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_items_total{" + l + ",op=\"get\",outcome=\"not_found\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_items_total{" + l + ",op=\"get\",outcome=\"data_loss\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_bytes_total{" + l + ",op=\"put\"} " + std::to_string(3 * object))) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_bytes_total{" + l + ",op=\"get\"} " + std::to_string(2 * object))) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_op_latency_seconds_count{" + l + ",op=\"get\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_op_latency_seconds_count{" + l + ",op=\"put\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_quarantined_total{" + l + "} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_auth_failures_total{" + l + "} 0")) << text;  // no tenant secret
  EXPECT_TRUE(has_line(text, "kvtier_storage_objects{" + l + "} 2")) << text;
  // The tier leaves with its hook: scraping afterwards reads nothing freed and keeps the totals.
  tier->reset();
  EXPECT_TRUE(has_line(reg.expose(), "kvtier_storage_quarantined_total{" + l + "} 1"));
}

// Two tiers attached with the same labels add up (each used to overwrite the other's gauges at every scrape), and
// a tier that goes takes its share out.
TEST(StorageMetrics, TiersWithTheSameLabelsAddUpAndLeaveWithTheirShare) {
  const OneLayerPages pages(2);
  const KvLayout* layout = &pages.layout;
  const BlockSpace* space = &pages.space;
  metrics::Registry reg;  // outlives the tiers
  testing::TempDir dir_a, dir_b;
  auto open = [&](const testing::TempDir& dir, std::uint64_t capacity) {
    DiskBackendConfig c;
    c.root = dir.path();
    c.direct_io = DirectIo::kOff;
    c.capacity_bytes = capacity;
    auto b = create_disk_backend(c, StorageTier::storage_options(*layout, "metrics-shares"));
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    auto tier = StorageTier::create(std::move(b).value(), *space, 0);
    EXPECT_TRUE(tier.ok()) << tier.status().to_string();
    EXPECT_TRUE((*tier)->attach_metrics(reg, {{"instance", "i0"}}).ok());
    return std::move(tier).value();
  };
  auto a = open(dir_a, std::uint64_t{1} << 20);
  const std::string l = "instance=\"i0\",backend=\"" + std::string(a->backend().name()) + "\"";
  {
    auto b = open(dir_b, std::uint64_t{3} << 20);
    EXPECT_TRUE(has_line(reg.expose(), "kvtier_storage_capacity_bytes{" + l + "} 4194304")) << reg.expose();
  }
  EXPECT_TRUE(has_line(reg.expose(), "kvtier_storage_capacity_bytes{" + l + "} 1048576")) << reg.expose();
}

}  // namespace
}  // namespace kvtier::storage

namespace kvtier::storage {
namespace {

// An object sealed under another secret is refused by the tenant MAC: a counted auth failure, a data_loss item.
TEST(StorageMetrics, TenantMacRefusalsAreCounted) {
  OneLayerPages pages(4);
  const KvLayout* layout = &pages.layout;
  BlockSpace* space = &pages.space;
  testing::fill_random(space->block_ptr(0, 0, 0), 4096, 7);
  testing::TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  auto make_tier = [&](char secret_byte) {
    StorageOptions o = StorageTier::storage_options(*layout, "metrics-tenant");
    o.tenant = "t1";
    o.tenant_secret = std::string(32, secret_byte);
    auto b = create_disk_backend(c, o);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    auto t = StorageTier::create(std::move(b).value(), *space, 0);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return std::move(t).value();
  };
  const std::vector<StorageKey> keys = {testing::key_of(2, 0)};
  {
    auto writer = make_tier('a');
    auto w = writer->write(keys, std::vector<std::uint64_t>{0});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->wait().ok());
    ASSERT_TRUE(w->status(0).ok()) << w->status(0).to_string();
  }
  metrics::Registry reg;
  auto reader = make_tier('b');
  ASSERT_TRUE(reader->attach_metrics(reg).ok());
  auto r = reader->read(keys, std::vector<std::uint64_t>{1});
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->wait().ok());
  // The reader's index rebuild already refused (and quarantined) the object: the get is a miss.
  const StatusCode code = r->status(0).code();
  EXPECT_TRUE(code == StatusCode::kNotFound || code == StatusCode::kDataLoss) << r->status(0).to_string();
  const std::string text = reg.expose();
  const std::string l = "backend=\"" + std::string(reader->backend().name()) + "\"";
  EXPECT_TRUE(has_line(text, "kvtier_storage_auth_failures_total{" + l + "} 1")) << text;
  EXPECT_TRUE(has_line(text, "kvtier_storage_items_total{" + l + ",op=\"get\",outcome=\"ok\"} 0")) << text;
}

// A disk backend whose O_DIRECT probe failed runs buffered for its life: the gauge says so (1),
// and one that got O_DIRECT, or was asked for buffered I/O, says 0.
TEST(StorageMetrics, DirectIoFallbackIsAGauge) {
  const OneLayerPages pages(2);
  const KvLayout* layout = &pages.layout;
  const BlockSpace* space = &pages.space;
  for (bool refuse : {true, false}) {
    SCOPED_TRACE(refuse ? "probe refused" : "direct_io off");
    testing::TempDir dir;
    metrics::Registry reg;  // outlives the tier
    DiskBackendConfig c;
    c.root = dir.path();
    if (refuse) {
      c.fault_injector = std::make_shared<DiskFaultInjector>(1);
      DiskFaultRule r;
      r.op = DiskFaultOp::kDirectProbe;
      r.error = EINVAL;
      c.fault_injector->add(r);
    } else {
      c.direct_io = DirectIo::kOff;
    }
    auto b = create_disk_backend(c, StorageTier::storage_options(*layout, "metrics-direct"));
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    auto tier = StorageTier::create(std::move(b).value(), *space, 0);
    ASSERT_TRUE(tier.ok()) << tier.status().to_string();
    ASSERT_TRUE((*tier)->attach_metrics(reg).ok());
    const std::string l = "backend=\"" + std::string((*tier)->backend().name()) + "\"";
    EXPECT_TRUE(has_line(reg.expose(), "kvtier_storage_direct_io_fallback{" + l + "} " + (refuse ? "1" : "0")))
        << reg.expose();
  }
}

}  // namespace
}  // namespace kvtier::storage
