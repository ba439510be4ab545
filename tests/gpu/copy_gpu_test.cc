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
    std::vector<std::vector<std::int32_t>> src(64), dst(64);
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

}  // namespace
}  // namespace kvtier::copy_test
