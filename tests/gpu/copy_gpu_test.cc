// CopyEngine on the CUDA backend (label gpu): the same conformance body as the
// host backend (tests/copy/copy_engine_test_body.h), plus CUDA-only checks.
// Every test skips when no GPU is visible.
#include "copy/copy_engine_test_body.h"
#include "kvtier/device/cuda_device.h"

namespace kvtier::copy_test {

Result<std::unique_ptr<Device>> make_copy_test_device() {
  if (cuda_device_count() == 0) return Unavailable("no CUDA device visible");
  return create_cuda_device(0);
}

namespace {

TEST_F(CopyEngineTest, SmallHostToDeviceBatchesAreGated) {
  auto layout = KvLayout::uniform(1, 2, 16 * 1024);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 512);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 512);
  ASSERT_TRUE(dev && host);
  fill_random(*host, 1);
  fill_poison(*dev);
  auto s = random_ids(512, 200, 2);  // 200 pairs x 2 planes: fits the pending-copy queue
  auto d = random_ids(512, 200, 3);
  CopyRequest r{&host->space, &dev->space, s, d, {}, kAllRoles, CopyStrategy::kDmaBatch};
  const CopyReport rep = copy_and_check(*host, *dev, r);
  EXPECT_TRUE(rep.gated);
  // A batch larger than the driver's pending-copy queue is not gated (a gate
  // would block the submission until its watchdog fires), and still correct.
  auto s_big = random_ids(512, 500, 4);
  auto d_big = random_ids(512, 500, 5);
  fill_poison(*dev);
  const CopyReport big = copy_and_check(
      *host, *dev, CopyRequest{&host->space, &dev->space, s_big, d_big, {}, kAllRoles, CopyStrategy::kDmaBatch});
  EXPECT_FALSE(big.gated);
  // D2H is never gated.
  fill_poison(*host);
  const CopyReport back =
      copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, d, s, {}, kAllRoles, CopyStrategy::kDmaBatch});
  EXPECT_FALSE(back.gated);
}

// 64 back-to-back kernel calls: through a 2-slot descriptor ring (inline
// descriptors off, so the ring wraps), and with descriptors inline.
TEST_F(CopyEngineTest, ManyBackToBackKernelCallsReuseSlots) {
  for (std::uint32_t inline_max : {0u, 3072u}) {
    SCOPED_TRACE(::testing::Message() << "sm_inline_descriptor_max_pairs " << inline_max);
    CopyEngineOptions o;
    o.descriptor_slots = 2;
    o.sm_inline_descriptor_max_pairs = inline_max;
    ASSERT_TRUE(make_engine(o).ok());
    auto layout = KvLayout::uniform(2, 2, 4096);
    ASSERT_TRUE(layout.ok());
    auto dev = layer_first(MemoryKind::kDevice, *layout, 256);
    auto host = layer_first(MemoryKind::kPinnedHost, *layout, 256);
    ASSERT_TRUE(dev && host);
    fill_random(*dev, 4);
    fill_poison(*host);
    // 64 calls over disjoint destination ranges.
    std::vector<std::vector<BlockId>> src(64), dst(64);
    for (int i = 0; i < 64; ++i) {
      src[i] = random_ids(256, 4, 10 + i);
      for (int k = 0; k < 4; ++k) dst[i].push_back(i * 4 + k);
      CopyRequest r{&dev->space, &host->space, src[i], dst[i], {}, kAllRoles, CopyStrategy::kSmKernel};
      model_copy(*dev, *host, r);
      ASSERT_TRUE(engine_->copy(r, *stream_).ok());
    }
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    expect_matches_model(*host);
  }
}

// Programmatic dependent launch lets a copy kernel launch while the one before
// it on the stream still runs; every byte it touches must still be ordered
// after that kernel. A chain of SM-kernel copies on one stream where each reads
// what the previous one wrote (host -> device -> host -> device ...), large
// enough that a kernel starting early would read the poison still there; with
// the programmatic launch on and off.
TEST_F(CopyEngineTest, ChainedKernelCopiesOnOneStreamKeepStreamOrder) {
  for (bool programmatic : {true, false}) {
    SCOPED_TRACE(::testing::Message() << "sm_programmatic_launch " << programmatic);
    CopyEngineOptions o;
    o.sm_programmatic_launch = programmatic;
    ASSERT_TRUE(make_engine(o).ok());
    auto layout = KvLayout::uniform(2, 2, 64 * 1024);
    ASSERT_TRUE(layout.ok());
    constexpr std::uint64_t kBlocks = 64;  // 32 blocks per hop: 8 MiB per kernel
    auto host_a = layer_first(MemoryKind::kPinnedHost, *layout, kBlocks);
    auto dev = layer_first(MemoryKind::kDevice, *layout, kBlocks);
    auto host_b = layer_first(MemoryKind::kPinnedHost, *layout, kBlocks);
    ASSERT_TRUE(host_a && dev && host_b);
    fill_random(*host_a, 7);
    fill_poison(*dev);
    fill_poison(*host_b);
    // Hop k copies the 32 blocks the previous hop wrote to fresh positions of
    // the next space: a -> dev -> b -> dev -> a -> ... (ids shuffled per hop).
    TestSpace* spaces[3] = {host_a.get(), dev.get(), host_b.get()};
    std::vector<BlockId> prev = random_ids(kBlocks, 32, 100);
    int at = 0;
    for (int hop = 0; hop < 24; ++hop) {
      const int next = (at == 1) ? (hop % 4 == 1 ? 2 : 0) : 1;
      std::vector<BlockId> dst = random_ids(kBlocks, 32, 200 + hop);
      CopyRequest r{&spaces[at]->space, &spaces[next]->space, prev, dst, {}, kAllRoles, CopyStrategy::kSmKernel};
      model_copy(*spaces[at], *spaces[next], r);
      ASSERT_TRUE(engine_->copy(r, *stream_).ok());
      prev = dst;
      at = next;
    }
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    for (TestSpace* ts : spaces) expect_matches_model(*ts);
  }
}

}  // namespace
}  // namespace kvtier::copy_test
