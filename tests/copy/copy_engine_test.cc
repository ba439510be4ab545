// CopyEngine on the host backend (label cpu). The shared body runs every
// strategy's host executor; the tests below use host-only fault and delay
// injection.
#include <thread>

#include "copy/copy_engine_test_body.h"
#include "copy/engine_base.h"
#include "copy/kernel_plan.h"
#include "copy/plan.h"
#include "kvtier/copy/copy_config.h"

namespace kvtier::copy_test {

Result<std::unique_ptr<Device>> make_copy_test_device() {
  KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
  return std::unique_ptr<Device>(std::move(host));
}

namespace {

HostDevice& host_of(Device& d) { return static_cast<HostDevice&>(d); }

TEST_F(CopyEngineTest, AutoPrefersCopyEnginesWhenFullDuplex) {
  CopyEngineOptions o;
  o.auto_split_min_request_bytes = 0;  // small requests
  ASSERT_TRUE(make_engine(o).ok());
  // 32 KiB blocks: kernels when one-way, batched DMA in full duplex.
  auto layout = KvLayout::uniform(1, 2, 32 * 1024);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 64);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  auto host2 = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  ASSERT_TRUE(dev && host && host2);
  fill_random(*dev, 1);
  fill_random(*host2, 2);
  fill_poison(*host);
  auto other = device_->create_stream();
  ASSERT_TRUE(other.ok());
  auto s = random_ids(32, 16, 3);
  auto d = random_ids(32, 16, 4);
  auto d2 = random_ids(32, 16, 5);
  for (auto& x : d2) x += 32;  // H2D writes device blocks 32..63, disjoint from the D2H reads
  // Slow the simulated streams so that the D2H copy is still in flight.
  host_of(*device_).set_delays(std::chrono::milliseconds(300), std::chrono::milliseconds(300));
  CopyRequest d2h{&dev->space, &host->space, s, d, {}, kAllRoles, CopyStrategy::kAuto};
  auto r1 = engine_->copy(d2h, **other);
  ASSERT_TRUE(r1.ok()) << r1.status().to_string();
  EXPECT_EQ(r1->strategy, CopyStrategy::kSmKernel);  // nothing else in flight
  CopyRequest h2d{&host2->space, &dev->space, s, d2, {}, kAllRoles, CopyStrategy::kAuto};
  EXPECT_EQ(engine_->choose(h2d), CopyStrategy::kDmaBatch);  // D2H in flight: full duplex
  auto r2 = engine_->copy(h2d, *stream_);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->strategy, CopyStrategy::kDmaBatch);
  ASSERT_TRUE(device_->synchronize(**other, kWait).ok());
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  host_of(*device_).set_delays({}, {});
  // Once the D2H completed, small H2D goes back to the kernel + DMA split.
  EXPECT_EQ(engine_->choose(h2d), CopyStrategy::kSplit);
  model_copy(*dev, *host, d2h);
  expect_matches_model(*host);
  EXPECT_TRUE(engine_->forget_stream(**other).ok());
}

TEST_F(CopyEngineTest, FailedCopyIsReportedByTheStream) {
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 8);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  ASSERT_TRUE(dev && host);
  std::vector<BlockId> s{0, 2}, d{1, 3};
  for (CopyStrategy strategy : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kSmKernel,
                                CopyStrategy::kStagedDma, CopyStrategy::kSplit}) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    host_of(*device_).fail_nth_operation(1);
    auto rep = engine_->copy(CopyRequest{&dev->space, &host->space, s, d, {}, kAllRoles, strategy}, *stream_);
    ASSERT_TRUE(rep.ok());  // enqueued; the failure shows on the stream
    EXPECT_FALSE(device_->synchronize(*stream_, kWait).ok());
    host_of(*device_).clear_stream_error(*stream_);
  }
}

// A failure predicate that picks operations by their destination (as the transfer suites' do) fails a copy of
// every strategy into that memory. A batched DMA ran as a task without a destination, so no such predicate could
// ever fail it (the failure scenarios covered per-run DMA and kernels only), and its destination was not poisoned.
TEST_F(CopyEngineTest, ADestinationKeyedFailureFailsEveryStrategy) {
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 8);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 7);
  const std::byte* lo = host->space.plane(0, 0).base;
  const std::byte* hi = lo + 8 * 4096;
  std::vector<BlockId> s{0, 2, 5}, d{1, 3, 6};
  for (CopyStrategy strategy : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kSmKernel,
                                CopyStrategy::kStagedDma, CopyStrategy::kSplit}) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    fill_poison(*host);
    host_of(*device_).set_failure_predicate([lo, hi](std::uint64_t, const void* dst, std::uint64_t) {
      const auto* p = static_cast<const std::byte*>(dst);
      return p != nullptr && p >= lo && p < hi;
    });
    auto rep = engine_->copy(CopyRequest{&dev->space, &host->space, s, d, {}, kAllRoles, strategy}, *stream_);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    EXPECT_FALSE(device_->synchronize(*stream_, kWait).ok()) << "a copy into the failing memory succeeded";
    host_of(*device_).set_failure_predicate(nullptr);
    host_of(*device_).clear_stream_error(*stream_);
    // The failed copy left no block of the source behind as if it had landed.
    for (std::size_t i = 0; i < d.size(); ++i)
      EXPECT_NE(std::memcmp(host->space.block_ptr(0, 0, d[i]), dev->space.block_ptr(0, 0, s[i]), 4096), 0) << i;
  }
}

// A kernel descriptor slot that had to grow when memory ran out kept its old capacity with its buffers freed: the next
// request small enough for that capacity wrote its descriptors through a null staging buffer (a segfault). The slot
// now counts as empty until both buffers are there again; the failed copy is refused, later ones move their bytes.
TEST_F(CopyEngineTest, AFailedDescriptorSlotGrowthLeavesNoBrokenSlot) {
  CopyEngineOptions o;
  o.descriptor_slots = 1;
  o.sm_inline_descriptor_max_pairs = 0;  // every kernel copy takes its descriptors from the slot
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 1, 256);
  ASSERT_TRUE(layout.ok());
  constexpr std::uint64_t kBlocks = 8192;
  auto dev = layer_first(MemoryKind::kDevice, *layout, kBlocks);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, kBlocks);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 31);
  fill_poison(*host);
  auto copy = [&](std::vector<BlockId> ids) {
    return engine_->copy(CopyRequest{&dev->space, &host->space, ids, ids, {}, kAllRoles, CopyStrategy::kSmKernel},
                         *stream_);
  };
  std::vector<BlockId> one{0}, many, again{2};
  for (BlockId b = 4; b < kBlocks; b += 2) many.push_back(b);  // scattered: one descriptor each
  ASSERT_TRUE(copy(one).ok());
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  host_of(*device_).fail_allocations(1);
  auto refused = copy(many);
  ASSERT_FALSE(refused.ok()) << "the slot's growth did not fail: the test did not reach the fault";
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().to_string();
  host_of(*device_).fail_allocations(0);
  ASSERT_TRUE(copy(again).ok());
  ASSERT_TRUE(copy(many).ok());
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  model_copy(*dev, *host, CopyRequest{&dev->space, &host->space, one, one, {}, kAllRoles, CopyStrategy::kSmKernel});
  model_copy(*dev, *host, CopyRequest{&dev->space, &host->space, again, again, {}, kAllRoles, CopyStrategy::kSmKernel});
  model_copy(*dev, *host, CopyRequest{&dev->space, &host->space, many, many, {}, kAllRoles, CopyStrategy::kSmKernel});
  expect_matches_model(*host);
}

// block_checksum() read outside the space for a block or a layer it does not have (a crash or a garbage value).
TEST_F(CopyEngineTest, BlockChecksumRefusesABlockOrLayerTheSpaceLacks) {
  auto layout = KvLayout::uniform(2, 2, 64);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 4);
  ASSERT_TRUE(host);
  fill_random(*host, 5);
  EXPECT_TRUE(block_checksum(host->space, 3).ok());
  auto block = block_checksum(host->space, 4);
  EXPECT_EQ(block.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(block.status().message().find("block 4 of a space of 4 blocks"), std::string::npos)
      << block.status().to_string();
  const std::uint32_t bad_layer[] = {0, 2};
  auto layer = block_checksum(host->space, 0, bad_layer);
  EXPECT_EQ(layer.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(layer.status().message().find("layer 2 of a layout of 2 layers"), std::string::npos)
      << layer.status().to_string();
}

// A layer slot (BlockSpace::layer_slot: every layer's planes in the same memory) must be copied one layer at a
// time. A copy of every layer into one was accepted: each layer overwrote the last and the copy reported success.
TEST_F(CopyEngineTest, ALayerSlotTakesOneLayerPerCopy) {
  auto layout = KvLayout::uniform(2, 1, 128);
  ASSERT_TRUE(layout.ok());
  constexpr std::uint64_t kBlocks = 4;
  auto dev = layer_first(MemoryKind::kDevice, *layout, kBlocks);
  ASSERT_TRUE(dev);
  fill_random(*dev, 9);
  auto slot_mem = device_->allocate_pinned(kBlocks * 128);
  ASSERT_TRUE(slot_mem.ok());
  std::memset((*slot_mem)->data(), 0x5A, kBlocks * 128);
  std::vector<std::vector<Plane>> planes(2, std::vector<Plane>{Plane{(*slot_mem)->data(), 128}});
  auto slot = BlockSpace::layer_slot(MemoryKind::kPinnedHost, 0, *layout, kBlocks, planes);
  ASSERT_TRUE(slot.ok()) << slot.status().to_string();
  EXPECT_TRUE(slot->layers_share_memory());
  EXPECT_FALSE(dev->space.layers_share_memory());
  const std::vector<BlockId> ids{0, 1, 2, 3};
  for (const std::vector<std::uint32_t>& layers : {std::vector<std::uint32_t>{}, std::vector<std::uint32_t>{0, 1}}) {
    auto all =
        engine_->copy(CopyRequest{&dev->space, &*slot, ids, ids, layers, kAllRoles, CopyStrategy::kAuto}, *stream_);
    ASSERT_FALSE(all.ok()) << layers.size() << " layers into a layer slot were accepted";
    EXPECT_EQ(all.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(all.status().message().find("select one"), std::string::npos) << all.status().to_string();
    auto out =
        engine_->copy(CopyRequest{&*slot, &dev->space, ids, ids, layers, kAllRoles, CopyStrategy::kAuto}, *stream_);
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << "out of a layer slot, several layers";
  }
  const std::uint32_t one[] = {1};
  ASSERT_TRUE(
      engine_->copy(CopyRequest{&dev->space, &*slot, ids, ids, one, kAllRoles, CopyStrategy::kAuto}, *stream_).ok());
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  for (BlockId b : ids)
    EXPECT_EQ(std::memcmp(slot->block_ptr(1, 0, b), dev->mirror_of(dev->space.block_ptr(1, 0, b)), 128), 0) << b;
}

// validate() said OK to checksummed requests that copy() refuses (a DMA strategy, host to host, landed checksums
// without checksums, one array for both), and choose() named a strategy copy() would not run for them.
TEST_F(CopyEngineTest, ValidateRefusesTheChecksummedRequestsCopyRefuses) {
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 4);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 4);
  auto host2 = layer_first(MemoryKind::kPinnedHost, *layout, 4);
  ASSERT_TRUE(dev && host && host2);
  auto sums = device_->allocate_device(4 * sizeof(std::uint64_t));
  auto sums2 = device_->allocate_device(4 * sizeof(std::uint64_t));
  ASSERT_TRUE(sums.ok() && sums2.ok());
  auto* ck = static_cast<std::uint64_t*>(sums->data());
  auto* ck2 = static_cast<std::uint64_t*>(sums2->data());
  const std::vector<BlockId> ids{0, 1, 2, 3};
  auto req = [&](TestSpace& from, TestSpace& to, CopyStrategy strategy, std::uint64_t* c, std::uint64_t* landed) {
    CopyRequest r{&from.space, &to.space, ids, ids, {}, kAllRoles, strategy};
    r.checksums = c;
    r.landed_checksums = landed;
    return r;
  };
  const CopyRequest bad[] = {
      req(*dev, *host, CopyStrategy::kDmaBatch, ck, nullptr), req(*host, *host2, CopyStrategy::kAuto, ck, nullptr),
      req(*dev, *host, CopyStrategy::kSmKernel, nullptr, ck2), req(*dev, *host, CopyStrategy::kSmKernel, ck, ck)};
  for (const CopyRequest& r : bad) {
    const Status v = engine_->validate(r);
    auto c = engine_->copy(r, *stream_);
    EXPECT_FALSE(c.ok());
    EXPECT_FALSE(v.ok()) << "validate() accepted what copy() refuses: " << c.status().to_string();
    EXPECT_EQ(v.code(), c.status().code()) << v.to_string() << " / " << c.status().to_string();
  }
  const CopyRequest good = req(*dev, *host, CopyStrategy::kAuto, ck, nullptr);
  EXPECT_TRUE(engine_->validate(good).ok());
  EXPECT_EQ(engine_->choose(good), CopyStrategy::kSmKernel);
}

// Staged DMA with random per-operation delays on every stream (the caller's
// and the engine's aux stream): a missing wait between DMA and kernel, on
// slot reuse, at copy() entry (D2H reading freshly written device blocks) or
// at the end (H2D: an event recorded after copy() must cover the kernels)
// shows up as wrong bytes.
TEST_F(CopyEngineTest, StagedDmaWithDelaysKeepsOrder) {
  auto layout = KvLayout::uniform(2, 2, 4096);
  ASSERT_TRUE(layout.ok());
  ASSERT_TRUE(make_engine(staged_test_options(4 * (4096 + kStagedTestPad))).ok());
  const std::size_t n = 24;
  auto host_a = layer_first(MemoryKind::kPinnedHost, *layout, n);
  auto host_b = page_first(MemoryKind::kPinnedHost, *layout, n + 4);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  auto fresh = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  ASSERT_TRUE(host_a && host_b && dev && fresh);
  auto event = device_->create_event();
  ASSERT_TRUE(event.ok());
  host_of(*device_).set_delays(std::chrono::microseconds(0), std::chrono::microseconds(400));
  for (int iter = 0; iter < 4; ++iter) {
    SCOPED_TRACE(iter);
    const auto h = staged_range_ids(0, n);
    const auto hb = staged_range_ids(2, n);
    const auto d = random_ids(2 * n, n, 800 + iter);
    // H2D, then an event on the stream: once it completed, dev holds the data.
    fill_random(*host_a, 810 + iter);
    fill_poison(*dev);
    CopyRequest up{&host_a->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kStagedDma};
    model_copy(*host_a, *dev, up);
    ASSERT_TRUE(engine_->copy(up, *stream_).ok());
    ASSERT_TRUE(device_->record(**event, *stream_).ok());
    ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
    expect_matches_model(*dev);
    // D2H of device blocks written by earlier work on the stream (plain
    // copies of whole regions), then the same blocks back (slot reuse).
    fill_random(*fresh, 820 + iter);
    fill_poison(*host_b);
    for (std::size_t k = 0; k < dev->regions.size(); ++k) {
      ASSERT_TRUE(
          device_->memcpy_async(dev->regions[k].base, fresh->regions[k].base, dev->regions[k].bytes, *stream_).ok());
      dev->regions[k].mirror = fresh->regions[k].mirror;
    }
    CopyRequest down{&dev->space, &host_b->space, d, hb, {}, kAllRoles, CopyStrategy::kStagedDma};
    model_copy(*dev, *host_b, down);
    ASSERT_TRUE(engine_->copy(down, *stream_).ok());
    ASSERT_TRUE(device_->record(**event, *stream_).ok());
    ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
    expect_matches_model(*host_b);
    if (HasFailure()) break;
  }
  host_of(*device_).set_delays({}, {});
}

// kSplit with random per-operation delays on every stream (the caller's and
// each lane): a missing fork (lanes reading device blocks before the work
// that wrote them) or join (an event after copy() not covering a lane) shows
// up as wrong bytes.
TEST_F(CopyEngineTest, SplitWithDelaysKeepsOrder) {
  auto layout = KvLayout::uniform(2, 2, 4096);
  ASSERT_TRUE(layout.ok());
  CopyEngineOptions o;
  o.split_kernel_share = 0.25;
  o.split_dma_lanes = 3;
  ASSERT_TRUE(make_engine(o).ok());
  const std::size_t n = 24;
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, n);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  auto fresh = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  ASSERT_TRUE(host && dev && fresh);
  auto event = device_->create_event();
  ASSERT_TRUE(event.ok());
  host_of(*device_).set_delays(std::chrono::microseconds(0), std::chrono::microseconds(400));
  for (int iter = 0; iter < 4; ++iter) {
    SCOPED_TRACE(iter);
    const auto h = random_ids(n, n, 700 + iter);
    const auto d = random_ids(2 * n, n, 710 + iter);
    fill_random(*fresh, 720 + iter);
    fill_poison(*host);
    for (std::size_t k = 0; k < dev->regions.size(); ++k) {
      ASSERT_TRUE(
          device_->memcpy_async(dev->regions[k].base, fresh->regions[k].base, dev->regions[k].bytes, *stream_).ok());
      dev->regions[k].mirror = fresh->regions[k].mirror;
    }
    CopyRequest down{&dev->space, &host->space, d, h, {}, kAllRoles, CopyStrategy::kSplit};
    model_copy(*dev, *host, down);
    ASSERT_TRUE(engine_->copy(down, *stream_).ok());
    ASSERT_TRUE(device_->record(**event, *stream_).ok());
    ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
    expect_matches_model(*host);
    if (HasFailure()) break;
  }
  host_of(*device_).set_delays({}, {});
}

// The index math of the kernel decomposition, checked directly: every byte
// of every (pair, plane) is covered exactly once, items never cross blocks.
// Two BlockSpaces on one base with different block counts: the same-space
// check must not index its destination-sized bitmap with source ids (an
// out-of-bounds read under ASan), and it must compare bytes, not bases.
TEST_F(CopyEngineTest, AliasedSpacesWithDifferentBlockCounts) {
  auto layout = *KvLayout::uniform(1, 1, 64);
  std::vector<std::byte> mem(64 * 4096);
  auto big = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 4096, {{mem.data()}});
  auto small = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 4, {{mem.data()}});
  ASSERT_TRUE(big.ok() && small.ok());
  const std::vector<BlockId> src = {4000, 3999};
  const std::vector<BlockId> dst = {0, 1};
  Status st;
  // A fresh thread: its bitmap is sized for the 4-block destination only.
  std::thread([&] {
    CopyRequest r;
    r.src = &*big;
    r.dst = &*small;
    r.src_blocks = src;
    r.dst_blocks = dst;
    r.strategy = CopyStrategy::kDmaPerRun;
    st = engine_->validate(r);
  }).join();
  EXPECT_TRUE(st.ok()) << "disjoint bytes: " << st.to_string();

  // Source block 2 of the big space is destination block 2 of the small one.
  const std::vector<BlockId> src2 = {2};
  const std::vector<BlockId> dst2 = {2};
  CopyRequest r;
  r.src = &*big;
  r.dst = &*small;
  r.src_blocks = src2;
  r.dst_blocks = dst2;
  r.strategy = CopyStrategy::kDmaPerRun;
  Status overlap = engine_->validate(r);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument) << overlap.to_string();
}

// Two different spaces over the same memory, offset by one block: block 1 of
// one is block 0 of the other. Rejected before anything is written.
TEST_F(CopyEngineTest, AliasedSpacesOnDifferentBasesRejectedBeforeEnqueue) {
  auto layout = *KvLayout::uniform(1, 1, 64);
  std::vector<std::byte> mem(64 * 8);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<std::byte>(i);
  const std::vector<std::byte> before = mem;
  auto a = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 8, {{mem.data()}});
  auto b = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 7, {{mem.data() + 64}});
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<BlockId> src = {5, 1};
  const std::vector<BlockId> dst = {6, 0};  // a's block 1 is b's block 0
  CopyRequest r;
  r.src = &*a;
  r.dst = &*b;
  r.src_blocks = src;
  r.dst_blocks = dst;
  r.strategy = CopyStrategy::kDmaPerRun;
  auto report = engine_->copy(r, *stream_);
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  if (!report.ok()) {
    EXPECT_NE(report.status().message().find("alias"), std::string::npos) << report.status().to_string();
  }
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  EXPECT_EQ(mem, before) << "part of an aliasing copy was written";
}

// Per-layer allocations (as engines keep their caches), the two spaces' planes interleaved in memory. Only
// planes that meet are compared block by block: here layer 1 of `a` and layer 0 of `b` share one allocation, so
// copies of layer 0 alone are plain, while copies of both layers where a source block of a's layer 1 is a
// destination block of b's layer 0 are refused, naming that pair.
TEST_F(CopyEngineTest, InterleavedPerLayerSpacesAreCheckedWhereTheirPlanesMeet) {
  auto layout = *KvLayout::uniform(2, 1, 64);
  std::vector<std::byte> mem(64 * 8 * 3);
  std::byte* a0 = mem.data();
  std::byte* shared = mem.data() + 64 * 8;  // a's layer 1 and b's layer 0
  std::byte* b1 = mem.data() + 64 * 16;
  auto a = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 8, {{a0}, {shared}});
  auto b = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 8, {{shared}, {b1}});
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<BlockId> src = {1, 3};
  const std::vector<BlockId> dst = {3, 5};
  const std::uint32_t layer0[1] = {0};
  CopyRequest r;
  r.src = &*a;
  r.dst = &*b;
  r.src_blocks = src;
  r.dst_blocks = dst;
  r.layers = layer0;
  r.strategy = CopyStrategy::kDmaPerRun;
  EXPECT_TRUE(engine_->validate(r).ok()) << "layer 0 of a and layer 0 of b do not meet";
  r.layers = {};  // both layers: a's layer-1 block 3 is b's layer-0 block 3, a destination
  Status overlap = engine_->validate(r);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument) << overlap.to_string();
  EXPECT_NE(overlap.message().find("src block 3 at index 1 (layer 1"), std::string::npos) << overlap.to_string();
  EXPECT_NE(overlap.message().find("dst block 3 at index 0"), std::string::npos) << overlap.to_string();
  const std::vector<BlockId> far_dst = {6, 7};  // no source block of a's layer 1 lands there
  r.dst_blocks = far_dst;
  EXPECT_TRUE(engine_->validate(r).ok()) << "meeting planes, disjoint blocks";
}

// Strategy names come from one table (kvtier/core/enum_names.h): every name parses back, the short spellings
// still parse, and a bad one is refused with the accepted spellings listed.
TEST(CopyStrategyNames, NamesAndAliasesParse) {
  for (int i = 0; i < kNumCopyStrategies; ++i) {
    const auto s = static_cast<CopyStrategy>(i);
    EXPECT_EQ(parse_copy_strategy(copy_strategy_name(s)).value(), s) << copy_strategy_name(s);
  }
  EXPECT_EQ(parse_copy_strategy("per_run").value(), CopyStrategy::kDmaPerRun);
  EXPECT_EQ(parse_copy_strategy("batch").value(), CopyStrategy::kDmaBatch);
  EXPECT_EQ(parse_copy_strategy("kernel").value(), CopyStrategy::kSmKernel);
  EXPECT_EQ(parse_copy_strategy("sm").value(), CopyStrategy::kSmKernel);
  EXPECT_EQ(parse_copy_strategy("staged").value(), CopyStrategy::kStagedDma);
  EXPECT_EQ(parse_copy_strategy("hybrid").value(), CopyStrategy::kSplit);
  EXPECT_EQ(copy_strategy_name(CopyStrategy::kSplit), "split");
  auto bad = parse_copy_strategy("fast");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("unknown copy strategy 'fast' (expected one of auto, dma_per_run, dma_batch, "
                                        "sm_kernel, staged_dma, split, per_run"),
            std::string::npos)
      << bad.status().message();
}

TEST(KernelPlanTest, ItemsCoverEveryByteOnce) {
  using namespace copy_detail;
  const std::uint64_t sizes[] = {1, 15, 16, 17, 100, 4096, 4097, 70000};
  std::vector<KernelPlane> planes;
  std::uint64_t base = 0x10000;
  for (std::uint64_t bb : sizes) {
    planes.push_back({base, bb + 3, base + (1u << 24), bb, bb, 0, 0});
    base += (bb + 3) * 8;
  }
  const std::uint32_t item_bytes = 4096;
  const std::uint32_t ipp = assign_items(planes.data(), static_cast<std::uint32_t>(planes.size()), item_bytes);
  const KernelPair pairs[] = {{0, 5}, {3, 1}, {7, 7}};
  std::map<std::uint64_t, std::uint64_t> covered;  // dst address -> bytes
  std::uint64_t total = 0;
  for (std::uint64_t item = 0; item < 3ull * ipp; ++item) {
    const WorkItem w =
        resolve_item(planes.data(), static_cast<std::uint32_t>(planes.size()), pairs, ipp, item_bytes, item);
    ASSERT_GT(w.bytes, 0u);
    ASSERT_LE(w.bytes, item_bytes);
    covered[reinterpret_cast<std::uint64_t>(w.dst)] += w.bytes;
    total += w.bytes;
  }
  std::uint64_t expected = 0;
  for (std::uint64_t bb : sizes) expected += 3 * bb;
  EXPECT_EQ(total, expected);
  // No overlaps: sorted item ranges never intersect.
  std::uint64_t end = 0;
  for (auto [addr, bytes] : covered) {
    EXPECT_GE(addr, end);
    end = addr + bytes;
  }
}

// kAuto's adaptive split (copy_engine.h, auto_split_adaptive): one
// mechanism made slow on the host backend (a fixed delay per operation on
// its streams); the tuned kernel share must move work away from it, copy
// after copy, with every copy byte-exact on a poisoned destination.
class AdaptiveSplit : public CopyEngineTest {
 protected:
  // 64 pairs of 16 KiB (initial share 0.6), timed copies one after another
  // on `caller`; returns the kernel share of each copy.
  std::vector<double> run(Stream& caller, int copies, bool adaptive) {
    CopyEngineOptions o;
    o.auto_split_only_behind_queued_work = false;
    o.auto_split_payload_bytes_per_dma_descriptor = 0;
    o.auto_split_cpu_budget_adaptive = false;  // from an idle stream a late split would pause the class
    o.auto_split_min_request_bytes = 0;
    o.auto_split_adaptive = adaptive;
    EXPECT_TRUE(make_engine(o).ok());
    auto layout = KvLayout::uniform(1, 1, 16 * 1024);
    EXPECT_TRUE(layout.ok());
    auto host = layer_first(MemoryKind::kPinnedHost, *layout, 128);
    auto dev = layer_first(MemoryKind::kDevice, *layout, 128);
    EXPECT_TRUE(host && dev);
    std::vector<double> shares;
    if (!host || !dev) return shares;
    fill_random(*host, 91);
    for (int i = 0; i < copies; ++i) {
      fill_poison(*dev);
      const auto h = random_ids(128, 64, 100 + i);
      const auto d = random_ids(128, 64, 200 + i);
      CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto};
      model_copy(*host, *dev, up);
      auto rep = engine_->copy(up, caller);
      EXPECT_TRUE(rep.ok()) << rep.status().to_string();
      if (!rep.ok()) return shares;
      EXPECT_EQ(rep->strategy, CopyStrategy::kSplit);
      EXPECT_TRUE(device_->synchronize(caller, kWait).ok());
      expect_matches_model(*dev);
      shares.push_back(rep->kernel_share);
    }
    return shares;
  }
};

TEST_F(AdaptiveSplit, SlowDmaLanesShiftWorkToTheKernel) {
  host_of(*device_).set_stream_delay("kvtier-split-lane", std::chrono::milliseconds(30));
  const std::vector<double> shares = run(*stream_, 8, /*adaptive=*/true);
  host_of(*device_).set_stream_delay("", {});
  ASSERT_EQ(shares.size(), 8u);
  EXPECT_DOUBLE_EQ(shares[0], 0.6) << "the first copy of a size class starts from the profile";
  for (std::size_t i = 1; i < shares.size(); ++i) EXPECT_GE(shares[i], shares[i - 1]) << "copy " << i;
  EXPECT_GT(shares.back(), 0.9) << "the lanes take 30 ms per batch, the kernel part well under that";
  EXPECT_LE(shares.back(), 0.95) << "clamped to auto_split_adaptive_max_share";
}

TEST_F(AdaptiveSplit, SlowKernelShiftsWorkToTheLanes) {
  StreamOptions so;
  so.name = "slow-caller";
  auto caller = device_->create_stream(so);
  ASSERT_TRUE(caller.ok());
  host_of(*device_).set_stream_delay("slow-caller", std::chrono::milliseconds(30));
  const std::vector<double> shares = run(**caller, 8, /*adaptive=*/true);
  host_of(*device_).set_stream_delay("", {});
  ASSERT_EQ(shares.size(), 8u);
  for (std::size_t i = 1; i < shares.size(); ++i) EXPECT_LE(shares[i], shares[i - 1]) << "copy " << i;
  EXPECT_LT(shares.back(), 0.15) << ::testing::PrintToString(shares);
  EXPECT_GE(shares.back(), 0.05) << "clamped to auto_split_adaptive_min_share: the kernel part stays measurable";
  EXPECT_TRUE(engine_->forget_stream(**caller).ok());
}

TEST_F(AdaptiveSplit, FixedProfileWhenNotAdaptive) {
  host_of(*device_).set_stream_delay("kvtier-split-lane", std::chrono::milliseconds(10));
  const std::vector<double> shares = run(*stream_, 4, /*adaptive=*/false);
  host_of(*device_).set_stream_delay("", {});
  ASSERT_EQ(shares.size(), 4u);
  for (double s : shares) EXPECT_DOUBLE_EQ(s, 0.6);
}

// The adaptive CPU budget: copies enqueued while the stream is held (the
// CPU runs ahead of the GPU) lower the budget step by step to its minimum,
// so kAuto gives the DMA lanes more of each later request. The share here
// is the budget's floor (profile share 0.1, share tuning off), so it shows
// the budget: 1 - 4 KiB / budget.
TEST_F(CopyEngineTest, SplitCpuBudgetGrowsWhileTheCpuRunsAhead) {
  CopyEngineOptions o;
  o.auto_split_adaptive = false;
  o.auto_split_h2d_kernel_share_small = 0.1;
  o.auto_split_min_request_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 256);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 256);
  ASSERT_TRUE(host && dev);
  fill_random(*host, 301);
  fill_poison(*dev);
  std::vector<double> shares;
  auto open = hold_stream();
  for (int i = 0; i < 8; ++i) {
    // Disjoint destinations per copy: [32 i, 32 i + 32). 48 -> 12 KiB takes 7 steps of 1.25.
    auto d = random_ids(32, 32, 400 + i);
    for (auto& x : d) x += 32 * i;
    const auto h = random_ids(256, 32, 500 + i);
    CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto};
    model_copy(*host, *dev, up);
    auto rep = engine_->copy(up, *stream_);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    ASSERT_EQ(rep->strategy, CopyStrategy::kSplit);
    shares.push_back(rep->kernel_share);
  }
  open->store(true);
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*dev);
  EXPECT_NEAR(shares[0], 1.0 - 4.0 / 48.0, 1e-9) << "starts from auto_split_payload_bytes_per_dma_descriptor";
  for (std::size_t i = 1; i < shares.size(); ++i) EXPECT_LE(shares[i], shares[i - 1]) << "copy " << i;
  EXPECT_LT(shares[1], shares[0]);
  EXPECT_NEAR(shares.back(), 1.0 - 4.0 / 12.0, 1e-9) << "down to auto_split_min_payload_bytes_per_dma_descriptor";
}

// The other way: the lanes' submission is slow (each enqueue on a lane
// blocks the caller 50 ms, like thousands of DMA descriptors), the caller's
// stream is idle, so the GPU reaches the fork long before the last lane is
// enqueued. The split pauses its size class: the next 8 kAuto copies run the
// SM kernel, then one split probes, is late again and pauses for 16.
TEST_F(CopyEngineTest, LateSplitPausesItsSizeClass) {
  CopyEngineOptions o;
  o.auto_split_only_behind_queued_work = false;  // split from an idle stream
  o.auto_split_min_request_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 1, 16 * 1024);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 64);
  ASSERT_TRUE(host && dev);
  fill_random(*host, 601);
  host_of(*device_).set_enqueue_delay("kvtier-split-lane", std::chrono::milliseconds(50));
  std::vector<CopyStrategy> ran;
  for (int i = 0; i < 11; ++i) {
    fill_poison(*dev);
    const auto h = random_ids(64, 32, 700 + i);
    const auto d = random_ids(64, 32, 800 + i);
    CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto};
    ran.push_back(copy_and_check(*host, *dev, up).strategy);
    if (HasFailure()) break;
  }
  host_of(*device_).set_enqueue_delay("", {});
  ASSERT_EQ(ran.size(), 11u);
  EXPECT_EQ(ran[0], CopyStrategy::kSplit);
  for (int i = 1; i <= 8; ++i) EXPECT_EQ(ran[i], CopyStrategy::kSmKernel) << "paused, copy " << i;
  EXPECT_EQ(ran[9], CopyStrategy::kSplit) << "one split probes after the pause";
  EXPECT_EQ(ran[10], CopyStrategy::kSmKernel) << "late again: paused again";
}

TEST(SplitTunerTest, CpuBudgetSteps) {
  using namespace copy_detail;
  SplitTuner tuner;
  const std::uint32_t c = split_size_class(CopyDirection::kHostToDevice, 4096);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 48 * 1024), 48 * 1024);
  EXPECT_FALSE(tuner.paused(c));
  tuner.report_submission(c, 48 * 1024, /*cpu_late=*/true, 16 * 1024, 256 * 1024);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 0), 60 * 1024);
  ASSERT_TRUE(tuner.paused(c)) << "a late split pauses the class";
  for (int i = 0; i < SplitTuner::kSplitPauseCopies; ++i) {
    EXPECT_TRUE(tuner.paused(c)) << i;
    tuner.note_copy_while_paused(c);
  }
  EXPECT_FALSE(tuner.paused(c)) << "one split probes again after the pause";
  // A second late probe in a row: twice the pause.
  tuner.report_submission(c, 0, /*cpu_late=*/true, 16 * 1024, 256 * 1024);
  for (int i = 0; i < 2 * SplitTuner::kSplitPauseCopies; ++i) {
    EXPECT_TRUE(tuner.paused(c)) << i;
    tuner.note_copy_while_paused(c);
  }
  EXPECT_FALSE(tuner.paused(c));
  tuner.report_submission(c, 0, /*cpu_late=*/false, 16 * 1024, 256 * 1024);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 0), 60 * 1024);
  tuner.report_submission(c, 0, /*cpu_late=*/false, 16 * 1024, 256 * 1024);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 0), 48 * 1024);
  EXPECT_FALSE(tuner.paused(c)) << "in time: no pause";
  // After a split in time the backoff starts over.
  tuner.report_submission(c, 0, /*cpu_late=*/true, 16 * 1024, 256 * 1024);
  for (int i = 0; i < SplitTuner::kSplitPauseCopies; ++i) tuner.note_copy_while_paused(c);
  EXPECT_FALSE(tuner.paused(c));
  for (int i = 0; i < 20; ++i) tuner.report_submission(c, 0, true, 16 * 1024, 256 * 1024);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 0), 256 * 1024);
  for (int i = 0; i < SplitTuner::kSplitMaxPauseCopies - 1; ++i) tuner.note_copy_while_paused(c);
  EXPECT_TRUE(tuner.paused(c)) << "the pause doubled up to its maximum";
  tuner.note_copy_while_paused(c);
  EXPECT_FALSE(tuner.paused(c));
  for (int i = 0; i < 30; ++i) tuner.report_submission(c, 0, false, 16 * 1024, 256 * 1024);
  EXPECT_DOUBLE_EQ(tuner.budget(c, 0), 16 * 1024);
}

TEST(SplitTunerTest, BalancedShareAndSteps) {
  using namespace copy_detail;
  // Kernel 100 B/ms, DMA 100 B in 3 ms: both finish together at 3/4.
  EXPECT_DOUBLE_EQ(balanced_split_share(0.5, 100, 1, 100, 3), 0.75);
  EXPECT_DOUBLE_EQ(balanced_split_share(0.5, 300, 3, 100, 1), 0.5);  // equal rates
  EXPECT_DOUBLE_EQ(balanced_split_share(0.4, 0, 1, 100, 3), 0.4);    // no kernel part: unchanged
  // A part done within the timer's resolution counts as 1 us: the other part was slow.
  EXPECT_NEAR(balanced_split_share(0.4, 100, 0, 100, 3), 1.0, 1e-3);
  EXPECT_NEAR(balanced_split_share(0.4, 100, 3, 100, -0.01), 0.0, 1e-3);
  // The balance point is the fixed point: parts that finished together.
  EXPECT_NEAR(balanced_split_share(0.3, 30, 2, 70, 2), 0.3, 1e-12);
  SplitTuner tuner;
  const std::uint32_t c = split_size_class(CopyDirection::kHostToDevice, 16 * 1024);
  EXPECT_EQ(c, split_size_class(CopyDirection::kHostToDevice, 16 * 1024 + 4000));  // same half-octave
  EXPECT_NE(c, split_size_class(CopyDirection::kHostToDevice, 24 * 1024));
  EXPECT_NE(c, split_size_class(CopyDirection::kDeviceToHost, 16 * 1024));
  EXPECT_DOUBLE_EQ(tuner.share(c, 0.6), 0.6);
  tuner.observe(c, 0.5, 100, 1, 100, 3, /*gain=*/0.5, 0.05, 0.95);  // target 0.75
  EXPECT_DOUBLE_EQ(tuner.share(c, 0.6), 0.625);
  tuner.observe(c, 0.625, 1000, 1, 1, 1, 1.0, 0.05, 0.95);  // target ~1, clamped
  EXPECT_DOUBLE_EQ(tuner.share(c, 0.6), 0.95);
  tuner.observe(c, 0.95, 1, 1, 1000, 1, 1.0, 0.05, 0.95);  // target ~0, clamped
  EXPECT_DOUBLE_EQ(tuner.share(c, 0.6), 0.05);
}

TEST(KernelPlanTest, VectorSplit) {
  using namespace copy_detail;
  auto at = [](std::uint64_t a) { return reinterpret_cast<const void*>(a); };
  VectorSplit v = split_for_vectors(at(0x1000), at(0x2000), 100);
  EXPECT_EQ(v.width, 16u);
  EXPECT_EQ(v.head, 0u);
  EXPECT_EQ(v.body, 6u);
  EXPECT_EQ(v.tail, 4u);
  v = split_for_vectors(at(0x1003), at(0x2003), 100);  // same misalignment: head then 16-byte body
  EXPECT_EQ(v.width, 16u);
  EXPECT_EQ(v.head, 13u);
  EXPECT_EQ(v.head + v.body * v.width + v.tail, 100u);
  v = split_for_vectors(at(0x1008), at(0x2000), 100);
  EXPECT_EQ(v.width, 8u);
  v = split_for_vectors(at(0x1001), at(0x2000), 100);
  EXPECT_EQ(v.width, 1u);
  EXPECT_EQ(v.body, 100u);
  v = split_for_vectors(at(0x1001), at(0x2001), 5);  // head longer than the item
  EXPECT_EQ(v.head, 5u);
  EXPECT_EQ(v.body, 0u);
  EXPECT_EQ(v.tail, 0u);
}

}  // namespace
}  // namespace kvtier::copy_test

namespace kvtier {
namespace {

TEST(CopyConfig, KnobsBindToOptionsAndEnv) {
  CopyEngineOptions o;
  ConfigTable t;
  bind_copy_engine_options(t, o);
  ASSERT_TRUE(t.set("copy.sm_ctas_h2d", "4").ok());
  EXPECT_EQ(o.sm_ctas_h2d, 4u);
  ASSERT_TRUE(t.set("copy.staged_slot_bytes", "16M").ok());
  EXPECT_EQ(o.staged_slot_bytes, 16u << 20);
  std::string var = "KVTIER_COPY_AUTO_KERNEL_MAX_SEGMENT_BYTES_H2D=0";
  char* env[] = {var.data(), nullptr};
  ASSERT_TRUE(t.apply_env(env).ok());
  EXPECT_EQ(o.auto_kernel_max_segment_bytes_h2d, 0u);
  EXPECT_FALSE(t.set("copy.sm_ctas_h2d", "lots").ok());
  EXPECT_EQ(o.sm_ctas_h2d, 4u);
  EXPECT_NE(t.markdown().find("KVTIER_COPY_BATCH_MAX_DESCRIPTORS"), std::string::npos);
}

TEST(CopyConfig, OptionsAreCheckedWithoutADevice) {
  EXPECT_TRUE(check_copy_engine_options(CopyEngineOptions{}).ok());
  CopyEngineOptions o;
  o.sm_landed_item_bytes = 17;
  const Status bad_item = check_copy_engine_options(o);
  EXPECT_EQ(bad_item.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_item.message().find("sm_landed_item_bytes"), std::string::npos) << bad_item.message();
  EXPECT_NE(bad_item.message().find("17"), std::string::npos) << bad_item.message();
  // Any staged slot count was taken, and the first staged copy aborted the process (bad_alloc sizing the slots).
  o = CopyEngineOptions{};
  o.staged_slots = 0xFFFFFFFFu;
  const Status slots = check_copy_engine_options(o);
  EXPECT_EQ(slots.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(slots.message().find("staged_slots must be <="), std::string::npos) << slots.message();
  o = CopyEngineOptions{};
  o.staged_slots = 256;
  o.staged_slot_bytes = UINT64_MAX / 128;
  EXPECT_NE(check_copy_engine_options(o).message().find("overflows"), std::string::npos);
  o = CopyEngineOptions{};
  o.sm_threads_per_cta = 1056;
  EXPECT_EQ(check_copy_engine_options(o).code(), StatusCode::kInvalidArgument);
  // What create() refuses, the check refuses with the same message.
  auto device = HostDevice::create();
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  auto engine = CopyEngine::create(**device, o);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().message(), check_copy_engine_options(o).message());
}

}  // namespace
}  // namespace kvtier
