// CopyEngine conformance tests, shared by the host-backend binary
// (tests/copy/copy_engine_test.cc, label cpu) and the CUDA binary
// (tests/gpu/copy_gpu_test.cc, label gpu). The including file defines
// make_copy_test_device(); a failure to create the device skips every test.
//
// Every test fills sources with random bytes and destinations with a poison
// pattern, copies, then compares every byte of every destination region with
// a CPU model (poison everywhere except the moved blocks of the selected
// planes, which hold the source bytes): exact tails and untouched blocks are
// checked at once.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/layout.h"
#include "kvtier/device/host_device.h"

namespace kvtier::copy_test {

Result<std::unique_ptr<Device>> make_copy_test_device();

inline constexpr std::uint8_t kPoison = 0xA5;
inline constexpr auto kWait = std::chrono::seconds(60);
// Per-interval alignment padding of a staging slot (at most kStagedAlign - 1).
inline constexpr std::uint64_t kStagedTestPad = 64;

// A BlockSpace with its memory and a CPU mirror of that memory.
struct TestSpace {
  struct Region {
    std::byte* base = nullptr;
    std::uint64_t bytes = 0;
    std::vector<std::byte> mirror;
  };
  std::vector<Buffer> device_buffers;
  std::vector<std::unique_ptr<PinnedMemory>> pinned;
  std::vector<Region> regions;
  BlockSpace space;

  std::byte* mirror_of(const std::byte* p) {
    for (auto& r : regions)
      if (p >= r.base && p < r.base + r.bytes) return r.mirror.data() + (p - r.base);
    ADD_FAILURE() << "pointer outside every region";
    return nullptr;
  }
};

class CopyEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = make_copy_test_device();
    if (!dev.ok()) GTEST_SKIP() << "no device: " << dev.status().to_string();
    device_ = std::move(dev).value();
    auto s = device_->create_stream();
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    stream_ = std::move(s).value();
    ASSERT_TRUE(make_engine().ok());
  }
  void TearDown() override {
    if (stream_) {
      EXPECT_TRUE(device_->synchronize(*stream_, kWait).ok());
    }
    engine_.reset();
  }

  Status make_engine(const CopyEngineOptions& options = {}) {
    engine_.reset();
    auto e = CopyEngine::create(*device_, options);
    if (!e.ok()) return e.status();
    engine_ = std::move(e).value();
    return Status::Ok();
  }
  bool is_host() const { return device_->backend() == BackendKind::kHost; }

  Result<std::byte*> alloc(TestSpace& ts, MemoryKind kind, std::uint64_t bytes) {
    if (kind == MemoryKind::kDevice) {
      KVTIER_ASSIGN_OR_RETURN(Buffer b, device_->allocate_device(bytes));
      std::byte* p = b.bytes_ptr();
      ts.device_buffers.push_back(std::move(b));
      ts.regions.push_back({p, bytes, {}});
      return p;
    }
    KVTIER_ASSIGN_OR_RETURN(auto pm, device_->allocate_pinned(bytes));
    std::byte* p = pm->data();
    ts.pinned.push_back(std::move(pm));
    ts.regions.push_back({p, bytes, {}});
    return p;
  }

  // Layer-first: one region per (layer, role), stride = block_bytes (+ pad).
  std::unique_ptr<TestSpace> layer_first(MemoryKind kind, const KvLayout& layout, std::uint64_t blocks,
                                         std::uint64_t pad = 0, std::uint64_t base_offset = 0) {
    auto ts = std::make_unique<TestSpace>();
    std::vector<std::vector<Plane>> planes(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint64_t stride = layout.block_bytes(l, r) + pad;
        auto p = alloc(*ts, kind, stride * blocks + base_offset);
        EXPECT_TRUE(p.ok()) << p.status().to_string();
        if (!p.ok()) return nullptr;
        planes[l].push_back({*p + base_offset, stride});
      }
    auto s = BlockSpace::from_planes(kind, device_->ordinal(), layout, blocks, std::move(planes));
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    if (!s.ok()) return nullptr;
    ts->space = std::move(s).value();
    return ts;
  }

  std::unique_ptr<TestSpace> page_first(MemoryKind kind, const KvLayout& layout, std::uint64_t blocks,
                                        std::uint64_t page_alignment = 1, std::uint64_t role_alignment = 1) {
    auto ts = std::make_unique<TestSpace>();
    const std::uint64_t page = BlockSpace::page_first_page_bytes(layout, page_alignment, role_alignment);
    auto p = alloc(*ts, kind, page * blocks);
    EXPECT_TRUE(p.ok());
    if (!p.ok()) return nullptr;
    auto s = BlockSpace::page_first(kind, device_->ordinal(), layout, blocks, *p, page * blocks, page_alignment,
                                    role_alignment);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    if (!s.ok()) return nullptr;
    ts->space = std::move(s).value();
    return ts;
  }

  // K/V interleaved per layer: [blocks, 2, block] (stride 2 * block_bytes).
  std::unique_ptr<TestSpace> kv_interleaved(MemoryKind kind, const KvLayout& layout, std::uint64_t blocks) {
    auto ts = std::make_unique<TestSpace>();
    std::vector<std::vector<Plane>> planes(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
      std::uint64_t row = 0;
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) row += layout.block_bytes(l, r);
      auto p = alloc(*ts, kind, row * blocks);
      EXPECT_TRUE(p.ok());
      if (!p.ok()) return nullptr;
      std::uint64_t off = 0;
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        planes[l].push_back({*p + off, row});
        off += layout.block_bytes(l, r);
      }
    }
    auto s = BlockSpace::from_planes(kind, device_->ordinal(), layout, blocks, std::move(planes));
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    if (!s.ok()) return nullptr;
    ts->space = std::move(s).value();
    return ts;
  }

  void fill_random(TestSpace& ts, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (auto& r : ts.regions) {
      r.mirror.resize(r.bytes);
      std::uint64_t i = 0;
      for (; i + 8 <= r.bytes; i += 8) {
        const std::uint64_t v = rng();
        std::memcpy(r.mirror.data() + i, &v, 8);
      }
      for (; i < r.bytes; ++i) r.mirror[i] = static_cast<std::byte>(rng());
      ASSERT_TRUE(device_->memcpy_sync(r.base, r.mirror.data(), r.bytes).ok());
    }
  }
  void fill_poison(TestSpace& ts) {
    for (auto& r : ts.regions) {
      r.mirror.assign(r.bytes, static_cast<std::byte>(kPoison));
      ASSERT_TRUE(device_->memcpy_sync(r.base, r.mirror.data(), r.bytes).ok());
    }
  }
  // Applies a request to the CPU model of dst.
  void model_copy(TestSpace& src, TestSpace& dst, const CopyRequest& r) {
    const KvLayout& layout = src.space.layout();
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
      if (!r.layers.empty() && std::find(r.layers.begin(), r.layers.end(), l) == r.layers.end()) continue;
      for (std::uint32_t ro = 0; ro < layout.num_roles(l); ++ro) {
        if (!(r.roles & role_bit(layout.layer(l).roles[ro].role))) continue;
        for (std::size_t i = 0; i < r.src_blocks.size(); ++i) {
          const std::byte* s = src.mirror_of(src.space.block_ptr(l, ro, r.src_blocks[i]));
          std::byte* d = dst.mirror_of(dst.space.block_ptr(l, ro, r.dst_blocks[i]));
          std::memcpy(d, s, layout.block_bytes(l, ro));
        }
      }
    }
  }
  // Every byte of every dst region equals the model.
  void expect_matches_model(TestSpace& ts) {
    for (std::size_t k = 0; k < ts.regions.size(); ++k) {
      auto& r = ts.regions[k];
      std::vector<std::byte> actual(r.bytes);
      ASSERT_TRUE(device_->memcpy_sync(actual.data(), r.base, r.bytes).ok());
      if (actual != r.mirror) {
        std::uint64_t first = 0;
        while (first < r.bytes && actual[first] == r.mirror[first]) ++first;
        std::uint64_t count = 0;
        for (std::uint64_t i = 0; i < r.bytes; ++i) count += actual[i] != r.mirror[i];
        ADD_FAILURE() << "region " << k << " (" << r.bytes << " bytes): " << count << " bytes differ, first at offset "
                      << first << " (got " << static_cast<int>(actual[first]) << ", expected "
                      << static_cast<int>(r.mirror[first]) << ")";
        return;
      }
    }
  }

  // Copies, waits, and checks dst against the model. Returns the report.
  CopyReport copy_and_check(TestSpace& src, TestSpace& dst, const CopyRequest& r) {
    model_copy(src, dst, r);
    auto report = engine_->copy(r, *stream_);
    EXPECT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_TRUE(device_->synchronize(*stream_, kWait).ok());
    expect_matches_model(dst);
    return report.ok() ? *report : CopyReport{};
  }

  // Holds stream_ with a host callback until the returned flag is set (at
  // most 20 s), so that copies enqueued meanwhile sit behind queued work.
  std::shared_ptr<std::atomic<bool>> hold_stream() {
    auto open = std::make_shared<std::atomic<bool>>(false);
    EXPECT_TRUE(device_
                    ->launch_host_callback(*stream_,
                                           [open](const Status&) {
                                             const auto until =
                                                 std::chrono::steady_clock::now() + std::chrono::seconds(20);
                                             while (!open->load() && std::chrono::steady_clock::now() < until)
                                               std::this_thread::sleep_for(std::chrono::microseconds(100));
                                           })
                    .ok());
    return open;
  }

  // Expects `code` and an untouched (still poisoned) destination.
  void expect_rejected(TestSpace& dst, const CopyRequest& r, StatusCode code) {
    EXPECT_EQ(engine_->validate(r).code(), code) << engine_->validate(r).to_string();
    auto report = engine_->copy(r, *stream_);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), code) << report.status().to_string();
    EXPECT_FALSE(report.status().message().empty());
    EXPECT_TRUE(device_->synchronize(*stream_, kWait).ok());
    expect_matches_model(dst);
  }

  static std::vector<BlockId> random_ids(std::uint64_t pool, std::size_t n, std::uint64_t seed) {
    std::vector<BlockId> all(pool);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(n);
    return all;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<CopyEngine> engine_;
};

inline constexpr CopyStrategy kStrategies[] = {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch,
                                               CopyStrategy::kSmKernel, CopyStrategy::kAuto};

// ---------------------------------------------------------------- validation

struct ValidationFixture {
  std::unique_ptr<TestSpace> src, dst;
  std::vector<BlockId> s{0, 1, 2}, d{3, 4, 5};
  CopyRequest req() const {
    CopyRequest r;
    r.src = &src->space;
    r.dst = &dst->space;
    r.src_blocks = s;
    r.dst_blocks = d;
    return r;
  }
};

class CopyValidationTest : public CopyEngineTest {
 protected:
  void SetUp() override {
    CopyEngineTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    auto layout = KvLayout::uniform(2, 2, 100);
    ASSERT_TRUE(layout.ok());
    layout_ = *layout;
    v_.src = layer_first(MemoryKind::kDevice, layout_, 8);
    v_.dst = layer_first(MemoryKind::kPinnedHost, layout_, 8);
    ASSERT_TRUE(v_.src && v_.dst);
    fill_random(*v_.src, 1);
    fill_poison(*v_.dst);
  }
  KvLayout layout_;
  ValidationFixture v_;
};

TEST_F(CopyValidationTest, NullSrc) {
  auto r = v_.req();
  r.src = nullptr;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, NullDst) {
  auto r = v_.req();
  r.dst = nullptr;
  EXPECT_EQ(engine_->copy(r, *stream_).status().code(), StatusCode::kInvalidArgument);
  expect_matches_model(*v_.dst);
}
TEST_F(CopyValidationTest, LayoutMismatch) {
  auto other = KvLayout::uniform(2, 2, 101);
  ASSERT_TRUE(other.ok());
  auto src = layer_first(MemoryKind::kDevice, *other, 8);
  auto r = v_.req();
  r.src = &src->space;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, LengthMismatch) {
  auto r = v_.req();
  std::vector<BlockId> d{3, 4};
  r.dst_blocks = d;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, EmptyIsNoop) {
  for (CopyStrategy s : kStrategies) {
    auto r = v_.req();
    r.src_blocks = {};
    r.dst_blocks = {};
    r.strategy = s;
    auto report = engine_->copy(r, *stream_);
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->bytes, 0u);
    EXPECT_EQ(report->calls, 0u);
  }
  EXPECT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*v_.dst);
}
TEST_F(CopyValidationTest, SrcIdOutOfRange) {
  v_.s = {0, 8, 2};
  expect_rejected(*v_.dst, v_.req(), StatusCode::kOutOfRange);
  EXPECT_NE(engine_->validate(v_.req()).message().find("index 1"), std::string::npos);
}
TEST_F(CopyValidationTest, LargestSrcIdIsOutOfRange) {
  v_.s = {0, 1, static_cast<BlockId>(kMaxBlockId)};  // what an engine's -1 becomes unchecked
  expect_rejected(*v_.dst, v_.req(), StatusCode::kOutOfRange);
  EXPECT_NE(engine_->validate(v_.req()).message().find("4294967295"), std::string::npos);
}
TEST_F(CopyValidationTest, DstIdOutOfRange) {
  v_.d = {3, 4, 100};
  expect_rejected(*v_.dst, v_.req(), StatusCode::kOutOfRange);
}
TEST_F(CopyValidationTest, DuplicateDestination) {
  v_.d = {3, 4, 3};
  expect_rejected(*v_.dst, v_.req(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine_->validate(v_.req()).message().find("duplicate"), std::string::npos);
  // The per-thread bitmap was cleared: a valid request right after passes.
  v_.d = {3, 4, 5};
  EXPECT_TRUE(engine_->validate(v_.req()).ok());
}
TEST_F(CopyValidationTest, DuplicateSourceIsAllowed) {
  v_.s = {1, 1, 1};
  auto r = v_.req();
  copy_and_check(*v_.src, *v_.dst, r);
}
TEST_F(CopyValidationTest, LayerOutOfRange) {
  std::vector<std::uint32_t> layers{0, 2};
  auto r = v_.req();
  r.layers = layers;
  expect_rejected(*v_.dst, r, StatusCode::kOutOfRange);
}
TEST_F(CopyValidationTest, DuplicateLayer) {
  std::vector<std::uint32_t> layers{1, 1};
  auto r = v_.req();
  r.layers = layers;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, RoleMaskSelectsNothing) {
  auto r = v_.req();
  r.roles = role_bit(Role::kLatent);  // uniform(2, 2) has key and value only
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
  r.roles = 0;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, KernelHostToHostNotSupported) {
  auto src = layer_first(MemoryKind::kPinnedHost, layout_, 8);
  fill_random(*src, 2);
  auto r = v_.req();
  r.src = &src->space;
  r.strategy = CopyStrategy::kSmKernel;
  expect_rejected(*v_.dst, r, StatusCode::kNotSupported);
  // DMA strategies move host->host.
  for (CopyStrategy s : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kAuto}) {
    r.strategy = s;
    v_.d = {3, 4, 5};
    copy_and_check(*src, *v_.dst, r);
  }
}
TEST_F(CopyValidationTest, OverlappingCopyInSameSpace) {
  auto r = v_.req();
  r.src = &v_.dst->space;
  v_.s = {0, 1, 2};
  v_.d = {2, 6, 7};  // block 2 is read and written
  r.src_blocks = v_.s;
  r.dst_blocks = v_.d;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, DeviceOrdinalMismatch) {
  auto planes = std::vector<std::vector<Plane>>(2);
  for (std::uint32_t l = 0; l < 2; ++l)
    for (std::uint32_t ro = 0; ro < 2; ++ro) planes[l].push_back(v_.src->space.plane(l, ro));
  auto other = BlockSpace::from_planes(MemoryKind::kDevice, device_->ordinal() + 1, layout_, 8, planes);
  ASSERT_TRUE(other.ok());
  auto r = v_.req();
  r.src = &*other;
  expect_rejected(*v_.dst, r, StatusCode::kInvalidArgument);
}
TEST_F(CopyValidationTest, BadOptions) {
  CopyEngineOptions o;
  o.sm_threads_per_cta = 100;
  EXPECT_EQ(CopyEngine::create(*device_, o).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.sm_item_bytes = 1000;
  EXPECT_EQ(CopyEngine::create(*device_, o).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.descriptor_slots = 0;
  EXPECT_EQ(CopyEngine::create(*device_, o).status().code(), StatusCode::kInvalidArgument);
  // A ring of 2^32 - 1 slots aborted the process (bad_alloc) instead of naming the knob.
  o.descriptor_slots = 4294967295u;
  auto huge = CopyEngine::create(*device_, o);
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("descriptor_slots"), std::string::npos) << huge.status().to_string();
}

// ------------------------------------------------------------- byte-exactness

struct DirectionCase {
  MemoryKind src, dst;
};
inline constexpr DirectionCase kDirections[] = {{MemoryKind::kDevice, MemoryKind::kPinnedHost},
                                                {MemoryKind::kPinnedHost, MemoryKind::kDevice},
                                                {MemoryKind::kDevice, MemoryKind::kDevice}};

TEST_F(CopyEngineTest, EveryStrategyEverySizeEveryDirection) {
  const std::uint64_t sizes[] = {1, 100, 4095, 4096, 4097, 16 * 1024, 73728, 1 << 20};
  int seed = 10;
  for (std::uint64_t bb : sizes) {
    const std::uint32_t roles = bb >= (1 << 20) ? 1 : 2;
    auto layout = KvLayout::uniform(roles, roles, bb);
    ASSERT_TRUE(layout.ok());
    const std::uint64_t pool = 20;
    for (const DirectionCase& dc : kDirections) {
      auto src = layer_first(dc.src, *layout, pool);
      auto dst = layer_first(dc.dst, *layout, pool);
      ASSERT_TRUE(src && dst);
      fill_random(*src, ++seed);
      // 9 random ids plus a run of 3 consecutive ids on both sides
      // (src 17..19 -> dst 10..12), so that per-run merging is exercised.
      std::vector<BlockId> s = random_ids(17, 9, ++seed);
      s.insert(s.end(), {17, 18, 19});
      std::vector<BlockId> d;
      for (BlockId x : random_ids(pool, pool, ++seed))
        if ((x < 10 || x > 12) && d.size() < 9) d.push_back(x);
      d.insert(d.end(), {10, 11, 12});
      ASSERT_EQ(s.size(), d.size());
      for (CopyStrategy strategy : kStrategies) {
        SCOPED_TRACE(::testing::Message() << "block_bytes=" << bb << " " << memory_kind_name(dc.src) << "->"
                                          << memory_kind_name(dc.dst) << " " << copy_strategy_name(strategy));
        fill_poison(*dst);
        CopyRequest r;
        r.src = &src->space;
        r.dst = &dst->space;
        r.src_blocks = s;
        r.dst_blocks = d;
        r.strategy = strategy;
        const CopyReport rep = copy_and_check(*src, *dst, r);
        EXPECT_EQ(rep.bytes, bb * s.size() * roles * roles);
        EXPECT_EQ(rep.pairs, s.size());
        if (strategy != CopyStrategy::kAuto) {
          EXPECT_EQ(rep.strategy, strategy);
        }
        if (HasFailure()) return;
      }
    }
  }
}

// Every strategy on the legacy default stream (an adopted handle 0, as kvtier.pd adopts torch's default stream):
// a host->device batch of small segments, which the engine gates, failed there ("the legacy default stream cannot
// be gated"), and cudaMemcpyBatchAsync refuses that stream whatever the segments (cudaErrorInvalidValue), so
// kDmaBatch, and kAuto where it picks it, failed on it. (Backends without native streams skip.)
TEST_F(CopyEngineTest, EveryStrategyRunsOnTheLegacyDefaultStream) {
  auto legacy = device_->adopt_stream(nullptr, "legacy-default");
  if (!legacy.ok()) GTEST_SKIP() << "no native streams: " << legacy.status().to_string();
  auto layout = KvLayout::uniform(2, 2, 4096);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 16);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
  ASSERT_TRUE(host && dev);
  const std::vector<BlockId> s{1, 5, 9, 13}, d{0, 4, 8, 12};  // scattered 4 KiB segments: a gated batch elsewhere
  std::uint64_t seed = 41;
  for (CopyStrategy strategy : {CopyStrategy::kDmaBatch, CopyStrategy::kAuto, CopyStrategy::kDmaPerRun,
                                CopyStrategy::kSmKernel, CopyStrategy::kStagedDma, CopyStrategy::kSplit}) {
    for (const bool h2d : {true, false}) {
      SCOPED_TRACE(fmt::format("{} {}", copy_strategy_name(strategy), h2d ? "h2d" : "d2h"));
      TestSpace& from = h2d ? *host : *dev;
      TestSpace& to = h2d ? *dev : *host;
      fill_random(from, ++seed);
      fill_poison(to);
      const CopyRequest r{&from.space, &to.space, s, d, {}, kAllRoles, strategy};
      auto rep = engine_->copy(r, **legacy);
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      EXPECT_FALSE(rep->gated);
      ASSERT_TRUE(device_->synchronize(**legacy, kWait).ok());
      model_copy(from, to, r);
      expect_matches_model(to);
    }
  }
}

TEST_F(CopyEngineTest, MisalignedPlanesUseNarrowAccesses) {
  auto layout = KvLayout::uniform(1, 2, 4097);
  ASSERT_TRUE(layout.ok());
  // Bases offset by 1 and 3 bytes, strides padded by 5: every width path.
  auto src = layer_first(MemoryKind::kDevice, *layout, 16, 5, 1);
  auto dst = layer_first(MemoryKind::kPinnedHost, *layout, 16, 5, 3);
  ASSERT_TRUE(src && dst);
  fill_random(*src, 3);
  std::vector<BlockId> s{0, 3, 5, 9, 15, 2}, d{7, 1, 2, 3, 0, 14};
  for (CopyStrategy strategy : kStrategies) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    fill_poison(*dst);
    CopyRequest r{&src->space, &dst->space, s, d, {}, kAllRoles, strategy};
    copy_and_check(*src, *dst, r);
  }
}

TEST_F(CopyEngineTest, LayerSubsetsAndRoleMasks) {
  GqaShape shape;
  shape.num_layers = 4;
  shape.num_draft_layers = 1;
  shape.kv_heads = 2;
  shape.block_tokens = 16;
  shape.head_dim = 64;
  shape.fp8_scales = true;
  shape.dtype = DType::kFp8E4M3;
  auto layout = KvLayout::gqa(shape);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 32);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 32);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 4);
  const std::vector<std::vector<std::uint32_t>> layer_sets{{2}, {0, 3}, {4, 1}, {}};
  const RoleMask masks[] = {kAllRoles, role_bit(Role::kKeyScale) | role_bit(Role::kValueScale), role_bit(Role::kValue)};
  auto s = random_ids(32, 12, 5);
  auto d = random_ids(32, 12, 6);
  for (CopyStrategy strategy : kStrategies)
    for (const auto& layers : layer_sets)
      for (RoleMask mask : masks) {
        SCOPED_TRACE(::testing::Message()
                     << copy_strategy_name(strategy) << " layers=" << layers.size() << " mask=" << mask);
        fill_poison(*host);
        CopyRequest r{&dev->space, &host->space, s, d, layers, mask, strategy};
        const CopyReport rep = copy_and_check(*dev, *host, r);
        std::uint32_t planes_per_layer = mask == kAllRoles ? 4 : mask == role_bit(Role::kValue) ? 1 : 2;
        EXPECT_EQ(rep.planes, (layers.empty() ? 5 : layers.size()) * planes_per_layer);
        if (HasFailure()) return;
      }
}

// A request prepared once and posted a layer at a time (as a load is) lands the same bytes as one copy of it; only
// the layer list is checked at each post.
TEST_F(CopyEngineTest, PreparedCopyPostsLayersOneAtATime) {
  auto layout = KvLayout::uniform(4, 2, 4096);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 32);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 32);
  ASSERT_TRUE(dev && host);
  fill_random(*host, 21);
  fill_poison(*dev);
  auto s = random_ids(32, 12, 22);
  auto d = random_ids(32, 12, 23);
  const std::vector<std::uint32_t> layers{3, 0, 2};  // layer 1 is not part of it
  for (CopyStrategy strategy : kStrategies) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    CopyRequest r{&host->space, &dev->space, s, d, layers, kAllRoles, strategy};
    if (!engine_->validate(r).ok()) continue;  // a strategy this direction does not support
    auto prepared = engine_->prepare(r);
    ASSERT_TRUE(prepared.ok()) << prepared.status().to_string();
    for (std::uint32_t l : layers) {
      const std::uint32_t one[1] = {l};
      auto rep = engine_->copy(*prepared, one, *stream_);
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    }
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    model_copy(*host, *dev, r);
    expect_matches_model(*dev);
    if (HasFailure()) return;
  }
  auto prepared = engine_->prepare(CopyRequest{&host->space, &dev->space, s, d, layers, kAllRoles});
  ASSERT_TRUE(prepared.ok());
  const std::uint32_t not_prepared[1] = {1};
  Status st = engine_->copy(*prepared, not_prepared, *stream_).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("layer 1 at index 0"), std::string::npos) << st.to_string();
  const std::uint32_t twice[2] = {2, 2};
  st = engine_->copy(*prepared, twice, *stream_).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(engine_->copy(PreparedCopy{}, {}, *stream_).status().code(), StatusCode::kInvalidArgument);
  auto other = CopyEngine::create(*device_);
  ASSERT_TRUE(other.ok());
  st = (*other)->copy(*prepared, {}, *stream_).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("another copy engine"), std::string::npos) << st.to_string();
  // An invalid request is refused at prepare(), naming the bad id.
  std::vector<BlockId> bad = d;
  bad[3] = 99;
  auto refused = engine_->prepare(CopyRequest{&host->space, &dev->space, s, bad, layers, kAllRoles});
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange) << refused.status().to_string();
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*dev);  // nothing refused wrote anything
}

TEST_F(CopyEngineTest, HostLayoutsAndInterleavedDevice) {
  GqaShape shape;
  shape.num_layers = 3;
  shape.kv_heads = 1;
  shape.block_tokens = 8;
  shape.head_dim = 40;  // 640-byte blocks (not a multiple of 16 blocks per page)
  shape.fp8_scales = true;
  auto layout = KvLayout::gqa(shape);
  ASSERT_TRUE(layout.ok());
  const std::uint64_t n = 24;
  auto dev_kv = kv_interleaved(MemoryKind::kDevice, *layout, n);
  auto dev_lf = layer_first(MemoryKind::kDevice, *layout, n);
  auto host_pf = page_first(MemoryKind::kPinnedHost, *layout, n, 4096, 16);
  auto host_pf_packed = page_first(MemoryKind::kPinnedHost, *layout, n);
  auto host_lf = layer_first(MemoryKind::kPinnedHost, *layout, n);
  ASSERT_TRUE(dev_kv && dev_lf && host_pf && host_pf_packed && host_lf);
  auto s = random_ids(n, 10, 7);
  auto d = random_ids(n, 10, 8);
  std::vector<std::uint32_t> some_layers{1, 2};
  for (TestSpace* dev : {dev_kv.get(), dev_lf.get()})
    for (TestSpace* host : {host_pf.get(), host_pf_packed.get(), host_lf.get()})
      for (CopyStrategy strategy : kStrategies)
        for (bool all_layers : {true, false}) {
          SCOPED_TRACE(::testing::Message() << copy_strategy_name(strategy) << " dev="
                                            << (dev == dev_kv.get() ? "kv" : "lf") << " all_layers=" << all_layers);
          std::span<const std::uint32_t> layers;
          if (!all_layers) layers = some_layers;
          // D2H
          fill_random(*dev, 9);
          fill_poison(*host);
          copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, s, d, layers, kAllRoles, strategy});
          // H2D back into a poisoned device space
          fill_poison(*dev);
          copy_and_check(*host, *dev, CopyRequest{&host->space, &dev->space, d, s, layers, kAllRoles, strategy});
          if (HasFailure()) return;
        }
}

TEST_F(CopyEngineTest, MlaAndIndexerLayouts) {
  MlaShape shape;
  shape.num_layers = 3;
  shape.num_draft_layers = 1;
  shape.block_tokens = 16;
  shape.latent_dim = 576;
  shape.indexer_dim = 36;  // 576 bytes fp8
  auto layout = KvLayout::mla(shape);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
  auto host = page_first(MemoryKind::kPinnedHost, *layout, 16);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 11);
  auto s = random_ids(16, 7, 12);
  auto d = random_ids(16, 7, 13);
  for (CopyStrategy strategy : kStrategies)
    for (RoleMask mask : {kAllRoles, role_bit(Role::kLatent), role_bit(Role::kIndexer)}) {
      SCOPED_TRACE(::testing::Message() << copy_strategy_name(strategy) << " mask=" << mask);
      fill_poison(*host);
      copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, s, d, {}, mask, strategy});
    }
}

// ------------------------------------------------------------- run merging

TEST_F(CopyEngineTest, RunsAreMerged) {
  auto layout = KvLayout::uniform(2, 2, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 64);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 14);
  // Two runs (8..15 -> 40..47, 20..23 -> 0..3) and one singleton.
  std::vector<BlockId> s{8, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 30};
  std::vector<BlockId> d{40, 41, 42, 43, 44, 45, 46, 47, 0, 1, 2, 3, 60};
  for (CopyStrategy strategy : {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch}) {
    fill_poison(*host);
    const CopyReport rep =
        copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, s, d, {}, kAllRoles, strategy});
    EXPECT_EQ(rep.segments, 3u * 4u);  // 3 runs x 4 planes
  }
  // Source adjacent but destination not: no merge.
  std::vector<BlockId> d2{40, 42, 44, 46, 48, 50, 52, 54, 0, 2, 4, 6, 60};
  fill_poison(*host);
  const CopyReport rep = copy_and_check(
      *dev, *host, CopyRequest{&dev->space, &host->space, s, d2, {}, kAllRoles, CopyStrategy::kDmaPerRun});
  EXPECT_EQ(rep.segments, 13u * 4u);
}

TEST_F(CopyEngineTest, PageFirstBothSidesMergesAcrossPlanes) {
  auto layout = KvLayout::uniform(4, 2, 1000);
  ASSERT_TRUE(layout.ok());
  auto dev = page_first(MemoryKind::kDevice, *layout, 32);
  auto host = page_first(MemoryKind::kPinnedHost, *layout, 32);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 15);
  std::vector<BlockId> s{4, 5, 6, 20}, d{10, 11, 12, 0};
  fill_poison(*host);
  const CopyReport rep = copy_and_check(
      *dev, *host, CopyRequest{&dev->space, &host->space, s, d, {}, kAllRoles, CopyStrategy::kDmaPerRun});
  EXPECT_EQ(rep.segments, 2u);  // pages 4..6 as one segment, page 20 as another
}

// ------------------------------------------------------------- chunking

TEST_F(CopyEngineTest, ChunkingBeyondDescriptorCapacity) {
  CopyEngineOptions o;
  o.max_pairs_per_call = 7;
  o.batch_max_descriptors = 5;
  o.descriptor_slots = 2;  // 15 launches on a 2-slot ring: it wraps
  o.sm_item_bytes = 256;   // several items per block
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 2, 1000);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 200);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 200);
  ASSERT_TRUE(dev && host);
  fill_random(*host, 16);
  auto s = random_ids(200, 100, 17);
  auto d = random_ids(200, 100, 18);
  for (CopyStrategy strategy : kStrategies) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    fill_poison(*dev);
    const CopyReport rep =
        copy_and_check(*host, *dev, CopyRequest{&host->space, &dev->space, s, d, {}, kAllRoles, strategy});
    if (rep.strategy == CopyStrategy::kSmKernel) {
      EXPECT_EQ(rep.calls, 15u);
    }
    if (rep.strategy == CopyStrategy::kDmaBatch) {
      EXPECT_EQ(rep.calls, 40u);  // 200 segments / 5
    }
  }
}

// Descriptors in the kernel parameters: byte-exact at every size class and
// launch boundary, up to four launches inline, then the descriptor ring; more
// planes than an inline launch holds also take the ring.
TEST_F(CopyEngineTest, InlineDescriptorsAtTheirLimits) {
  ASSERT_TRUE(make_engine(CopyEngineOptions{}).ok());
  constexpr std::uint64_t kBlocks = 4 * 3072 + 8;
  for (std::uint32_t layers : {4u, 5u}) {  // 8 planes: inline; 10: ring
    auto layout = KvLayout::uniform(layers, 2, 48);
    ASSERT_TRUE(layout.ok());
    auto dev = layer_first(MemoryKind::kDevice, *layout, kBlocks);
    auto host = layer_first(MemoryKind::kPinnedHost, *layout, kBlocks);
    ASSERT_TRUE(dev && host);
    std::uint64_t seed = 40;
    for (std::size_t n : {std::size_t{1}, std::size_t{128}, std::size_t{129}, std::size_t{768}, std::size_t{769},
                          std::size_t{3072}, std::size_t{3073}, std::size_t{4 * 3072}, std::size_t{4 * 3072 + 1}}) {
      SCOPED_TRACE(::testing::Message() << layers * 2 << " planes, " << n << " pairs");
      auto s = random_ids(kBlocks, n, ++seed);
      auto d = random_ids(kBlocks, n, ++seed);
      const bool inline_path = layers == 4 && n <= 4 * 3072;
      const std::uint32_t expected_calls = inline_path ? static_cast<std::uint32_t>((n + 3071) / 3072) : 1u;
      fill_random(*host, ++seed);
      fill_poison(*dev);
      const CopyReport up = copy_and_check(
          *host, *dev, CopyRequest{&host->space, &dev->space, s, d, {}, kAllRoles, CopyStrategy::kSmKernel});
      EXPECT_EQ(up.calls, expected_calls);
      fill_random(*dev, ++seed);
      fill_poison(*host);
      const CopyReport down = copy_and_check(
          *dev, *host, CopyRequest{&dev->space, &host->space, d, s, {}, kAllRoles, CopyStrategy::kSmKernel});
      EXPECT_EQ(down.calls, expected_calls);
    }
  }
  CopyEngineOptions too_many;
  too_many.sm_inline_descriptor_max_pairs = 3073;
  EXPECT_EQ(make_engine(too_many).code(), StatusCode::kInvalidArgument);
}

// A small request is cut into items small enough for every CTA of the launch
// (32 blocks of 32 KiB in 64 KiB items once kept 2 of 16 CTAs busy).
TEST_F(CopyEngineTest, SmallRequestsSpreadOverEveryCta) {
  CopyEngineOptions o;
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 1, 32 * 1024);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 64);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  ASSERT_TRUE(dev && host);
  fill_random(*host, 77);
  fill_poison(*dev);
  auto s = random_ids(64, 32, 78);
  auto d = random_ids(64, 32, 79);
  const CopyReport up =
      copy_and_check(*host, *dev, CopyRequest{&host->space, &dev->space, s, d, {}, kAllRoles, CopyStrategy::kSmKernel});
  EXPECT_EQ(up.ctas, o.sm_ctas_h2d);
  fill_poison(*host);
  const CopyReport down =
      copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, d, s, {}, kAllRoles, CopyStrategy::kSmKernel});
  EXPECT_EQ(down.ctas, o.sm_ctas_d2h);
}

TEST_F(CopyEngineTest, ManyPlanesSplitAcrossLaunches) {
  auto layout = KvLayout::uniform(130, 2, 48);  // 260 planes > one launch's table
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 8);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 19);
  fill_poison(*host);
  std::vector<BlockId> s{1, 3, 5}, d{0, 7, 2};
  const CopyReport rep =
      copy_and_check(*dev, *host, CopyRequest{&dev->space, &host->space, s, d, {}, kAllRoles, CopyStrategy::kSmKernel});
  EXPECT_EQ(rep.calls, 2u);
}

// ------------------------------------------------------------- concurrency

TEST_F(CopyEngineTest, ConcurrentCopiesOnSeveralStreams) {
  constexpr int kThreads = 4;
  constexpr int kIterations = 12;
  auto layout = KvLayout::uniform(2, 2, 2048 + 16);
  ASSERT_TRUE(layout.ok());
  const std::uint64_t n = 64;
  auto dev = layer_first(MemoryKind::kDevice, *layout, n * kThreads);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, n * kThreads);
  ASSERT_TRUE(dev && host);
  fill_random(*dev, 20);
  fill_poison(*host);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int t = 0; t < kThreads; ++t) {
    auto s = device_->create_stream();
    ASSERT_TRUE(s.ok());
    streams.push_back(std::move(s).value());
  }
  // Thread t owns destination blocks [t*n, (t+1)*n).
  std::vector<std::vector<BlockId>> src_ids(kThreads), dst_ids(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    src_ids[t] = random_ids(n * kThreads, 24, 100 + t);
    dst_ids[t] = random_ids(n, 24, 200 + t);
    for (auto& x : dst_ids[t]) x += static_cast<BlockId>(t * n);
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        CopyRequest r{&dev->space, &host->space, src_ids[t], dst_ids[t], {}, kAllRoles, kStrategies[(t + i) % 4]};
        if (!engine_->copy(r, *streams[t]).ok()) ++failures;
        (void)engine_->choose(r);
      }
      if (!device_->synchronize(*streams[t], kWait).ok()) ++failures;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t)
    model_copy(*dev, *host, CopyRequest{&dev->space, &host->space, src_ids[t], dst_ids[t], {}, kAllRoles, {}});
  expect_matches_model(*host);
  for (auto& s : streams) EXPECT_TRUE(engine_->forget_stream(*s).ok());
}

// ------------------------------------------------------------- kAuto

TEST_F(CopyEngineTest, AutoPicksExpectedStrategies) {
  // The requests below are small; the split's minimum request size is
  // checked at the end.
  CopyEngineOptions o;
  o.auto_split_min_request_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  auto small = KvLayout::uniform(1, 2, 16 * 1024);
  auto big = KvLayout::uniform(1, 1, 4u << 20);
  auto mid = KvLayout::uniform(1, 2, 1024 * 1024);
  ASSERT_TRUE(small.ok() && big.ok() && mid.ok());
  auto dev_s = layer_first(MemoryKind::kDevice, *small, 32);
  auto host_s = layer_first(MemoryKind::kPinnedHost, *small, 32);
  auto host_s2 = layer_first(MemoryKind::kPinnedHost, *small, 32);
  auto dev_b = layer_first(MemoryKind::kDevice, *big, 4);
  auto host_b = layer_first(MemoryKind::kPinnedHost, *big, 4);
  auto dev_m = layer_first(MemoryKind::kDevice, *mid, 16);
  auto host_m = layer_first(MemoryKind::kPinnedHost, *mid, 16);
  ASSERT_TRUE(dev_s && host_s && host_s2 && dev_b && host_b && dev_m && host_m);
  auto s = random_ids(32, 16, 21);
  auto d = random_ids(32, 16, 22);
  auto req = [&](TestSpace& a, TestSpace& b, std::span<const BlockId> x, std::span<const BlockId> y) {
    return CopyRequest{&a.space, &b.space, x, y, {}, kAllRoles, CopyStrategy::kAuto};
  };
  // Small scattered blocks, nothing else in flight: the SM kernel for D2H,
  // the kernel + batched DMA split for H2D.
  EXPECT_EQ(engine_->choose(req(*dev_s, *host_s, s, d)), CopyStrategy::kSmKernel);
  EXPECT_EQ(engine_->choose(req(*host_s, *dev_s, s, d)), CopyStrategy::kSplit);
  EXPECT_EQ(engine_->choose(req(*dev_s, *dev_s, std::span(s).first(8), std::span(s).last(8))), CopyStrategy::kSmKernel);
  EXPECT_EQ(engine_->choose(req(*host_s, *host_s2, s, d)), CopyStrategy::kDmaBatch);
  // Large merged segments: one DMA per run.
  std::vector<BlockId> b0{0, 1, 2}, b1{1, 2, 3};
  EXPECT_EQ(engine_->choose(req(*dev_b, *host_b, b0, b1)), CopyStrategy::kDmaPerRun);
  // 1 MiB scattered: copy engines (batch) in both directions.
  auto ms = random_ids(16, 8, 23);
  auto md = random_ids(16, 8, 24);
  EXPECT_EQ(engine_->choose(req(*dev_m, *host_m, ms, md)), CopyStrategy::kDmaBatch);
  EXPECT_EQ(engine_->choose(req(*host_m, *dev_m, ms, md)), CopyStrategy::kDmaBatch);
  // The caller's full-duplex hint moves 32 KiB scattered blocks to the copy
  // engines (measured: batched DMA 79-100 GB/s aggregate vs kernels ~73).
  {
    auto dup = KvLayout::uniform(1, 1, 32 * 1024);
    ASSERT_TRUE(dup.ok());
    auto dev_d = layer_first(MemoryKind::kDevice, *dup, 32);
    auto host_d = layer_first(MemoryKind::kPinnedHost, *dup, 32);
    ASSERT_TRUE(dev_d && host_d);
    CopyRequest one_way = req(*host_d, *dev_d, s, d);
    EXPECT_EQ(engine_->choose(one_way), CopyStrategy::kSplit);
    one_way.full_duplex = true;
    EXPECT_EQ(engine_->choose(one_way), CopyStrategy::kDmaBatch);
    CopyRequest back = req(*dev_d, *host_d, s, d);
    back.full_duplex = true;
    EXPECT_EQ(engine_->choose(back), CopyStrategy::kDmaBatch);
  }
  // A single pair: per-run regardless of size.
  EXPECT_EQ(engine_->choose(req(*dev_s, *host_s, std::span(s).first(1), std::span(d).first(1))),
            CopyStrategy::kDmaPerRun);
  // copy() reports what kAuto ran.
  fill_random(*dev_s, 25);
  fill_poison(*host_s);
  const CopyReport rep = copy_and_check(*dev_s, *host_s, req(*dev_s, *host_s, s, d));
  EXPECT_EQ(rep.strategy, CopyStrategy::kSmKernel);
  // The split needs a request of auto_split_min_request_bytes (512 KiB here:
  // the 16 pairs x 2 roles x 16 KiB above; one pair less is not enough).
  ASSERT_EQ(s.size(), 16u);
  o.auto_split_min_request_bytes = 512 * 1024;
  ASSERT_TRUE(make_engine(o).ok());
  EXPECT_EQ(engine_->choose(req(*host_s, *dev_s, s, d)), CopyStrategy::kSplit);
  EXPECT_EQ(engine_->choose(req(*host_s, *dev_s, std::span(s).first(15), std::span(d).first(15))),
            CopyStrategy::kSmKernel);
}

// ------------------------------------------------------------- staged DMA

inline std::vector<BlockId> staged_range_ids(BlockId first, std::size_t n, BlockId step = 1) {
  std::vector<BlockId> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = first + static_cast<BlockId>(i) * step;
  return ids;
}

// Small staging slots (a few pairs each, 2 slots) so that every request runs
// many pipeline chunks and wraps the slot ring several times.
inline CopyEngineOptions staged_test_options(std::uint64_t pair_footprint) {
  CopyEngineOptions o;
  o.staged_slot_bytes = std::max<std::uint64_t>(4096, 3 * pair_footprint);
  o.staged_slots = 2;
  o.sm_item_bytes = 4096;
  return o;
}

// Contiguous host ids, random device ids, odd sizes, layer-first and
// page-first host, several layers and roles, both directions; gaps around the
// moved host range (and the unselected device blocks) stay poisoned.
TEST_F(CopyEngineTest, StagedDmaByteExact) {
  const std::uint64_t sizes[] = {100, 4097, 16 * 1024, 73728};
  int seed = 500;
  for (std::uint64_t bb : sizes) {
    auto layout = KvLayout::uniform(2, 2, bb);
    ASSERT_TRUE(layout.ok());
    ASSERT_TRUE(make_engine(staged_test_options(4 * (bb + kStagedTestPad))).ok());
    const std::size_t n = bb < 4096 ? 64 : 24;
    const std::uint64_t host_blocks = n + 9, dev_blocks = 2 * n;
    for (bool page : {false, true}) {
      auto host = page ? page_first(MemoryKind::kPinnedHost, *layout, host_blocks)
                       : layer_first(MemoryKind::kPinnedHost, *layout, host_blocks);
      auto dev = layer_first(MemoryKind::kDevice, *layout, dev_blocks);
      ASSERT_TRUE(host && dev);
      const auto h = staged_range_ids(5, n);
      const auto d = random_ids(dev_blocks, n, ++seed);
      for (bool h2d : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << "block_bytes=" << bb << (page ? " page-first" : " layer-first") << (h2d ? " h2d" : " d2h"));
        TestSpace& src = h2d ? *host : *dev;
        TestSpace& dst = h2d ? *dev : *host;
        fill_random(src, ++seed);
        fill_poison(dst);
        CopyRequest r{&src.space, &dst.space, h2d ? h : d, h2d ? d : h, {}, kAllRoles, CopyStrategy::kStagedDma};
        const CopyReport rep = copy_and_check(src, dst, r);
        EXPECT_EQ(rep.strategy, CopyStrategy::kStagedDma);
        EXPECT_EQ(rep.bytes, bb * n * 4);
        EXPECT_GT(rep.chunks, 2u * engine_->options().staged_slots) << "the slot ring should wrap";
        // A second copy on the same stream reuses the slots and events.
        fill_poison(dst);
        copy_and_check(src, dst, r);
        if (HasFailure()) return;
      }
    }
  }
}

// Host ids with gaps (every other block), layer subsets and role masks: the
// gap blocks and unselected planes must stay poisoned after a D2H (the DMA
// never writes bytes that are not part of the copy).
TEST_F(CopyEngineTest, StagedDmaHostGapsAndSubsets) {
  auto layout = KvLayout::uniform(3, 2, 4097);
  ASSERT_TRUE(layout.ok());
  ASSERT_TRUE(make_engine(staged_test_options(6 * (4097 + kStagedTestPad) * 2)).ok());
  const std::size_t n = 20;
  auto dev = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  ASSERT_TRUE(dev);
  const auto h = staged_range_ids(1, n, 2);
  const auto d = random_ids(2 * n, n, 77);
  const std::uint32_t layer_sets[][2] = {{0, 2}, {1, 1}};
  int seed = 600;
  for (bool page : {false, true}) {
    auto host = page ? page_first(MemoryKind::kPinnedHost, *layout, 2 * n + 2)
                     : layer_first(MemoryKind::kPinnedHost, *layout, 2 * n + 2);
    ASSERT_TRUE(host);
    for (const auto& ls : layer_sets) {
      const std::vector<std::uint32_t> layers =
          ls[0] == ls[1] ? std::vector<std::uint32_t>{ls[0]} : std::vector<std::uint32_t>{ls[0], ls[1]};
      for (RoleMask roles : {kAllRoles, role_bit(layout->layer(0).roles[1].role)}) {
        for (bool h2d : {false, true}) {
          SCOPED_TRACE(::testing::Message() << (page ? "page-first" : "layer-first") << " layers=" << layers.size()
                                            << " roles=" << roles << (h2d ? " h2d" : " d2h"));
          TestSpace& src = h2d ? *host : *dev;
          TestSpace& dst = h2d ? *dev : *host;
          fill_random(src, ++seed);
          fill_poison(dst);
          CopyRequest r{&src.space, &dst.space, h2d ? h : d, h2d ? d : h, layers, roles, CopyStrategy::kStagedDma};
          const CopyReport rep = copy_and_check(src, dst, r);
          EXPECT_EQ(rep.strategy, CopyStrategy::kStagedDma);
          EXPECT_GT(rep.chunks, 1u);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Repeated H2D sources are allowed: their host ranges overlap in the DMA plan.
TEST_F(CopyEngineTest, StagedDmaRepeatedSources) {
  auto layout = KvLayout::uniform(1, 2, 1000);
  ASSERT_TRUE(layout.ok());
  ASSERT_TRUE(make_engine(staged_test_options(2 * (1000 + kStagedTestPad))).ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 16);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
  ASSERT_TRUE(host && dev);
  fill_random(*host, 31);
  fill_poison(*dev);
  std::vector<BlockId> s{3, 4, 4, 5, 3, 6, 7, 7}, d{0, 9, 2, 11, 4, 15, 6, 1};
  copy_and_check(*host, *dev, CopyRequest{&host->space, &dev->space, s, d, {}, kAllRoles, CopyStrategy::kStagedDma});
}

// A copy on S followed by copies on S reading its result see it, with the
// staged strategy on both ends and another strategy in between; an event
// recorded on S after copy() completes only after the copy.
TEST_F(CopyEngineTest, StagedDmaKeepsStreamOrder) {
  auto layout = KvLayout::uniform(2, 2, 8192);
  ASSERT_TRUE(layout.ok());
  ASSERT_TRUE(make_engine(staged_test_options(4 * (8192 + kStagedTestPad))).ok());
  const std::size_t n = 32;
  auto host_a = layer_first(MemoryKind::kPinnedHost, *layout, n);
  auto host_b = page_first(MemoryKind::kPinnedHost, *layout, n);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  auto dev2 = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  ASSERT_TRUE(host_a && host_b && dev && dev2);
  auto event = device_->create_event();
  ASSERT_TRUE(event.ok());
  for (int iter = 0; iter < 3; ++iter) {
    SCOPED_TRACE(iter);
    fill_random(*host_a, 700 + iter);
    fill_poison(*dev);
    fill_poison(*dev2);
    fill_poison(*host_b);
    const auto h = staged_range_ids(0, n);
    const auto d = random_ids(2 * n, n, 710 + iter);
    const auto d2 = random_ids(2 * n, n, 720 + iter);
    // host_a -> dev (staged), dev -> dev2 (kernel), dev2 -> host_b (staged).
    CopyRequest up{&host_a->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kStagedDma};
    CopyRequest mid{&dev->space, &dev2->space, d, d2, {}, kAllRoles, CopyStrategy::kSmKernel};
    CopyRequest down{&dev2->space, &host_b->space, d2, h, {}, kAllRoles, CopyStrategy::kStagedDma};
    model_copy(*host_a, *dev, up);
    model_copy(*dev, *dev2, mid);
    model_copy(*dev2, *host_b, down);
    for (const CopyRequest* r : {&up, &mid, &down}) {
      auto rep = engine_->copy(*r, *stream_);
      ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    }
    ASSERT_TRUE(device_->record(**event, *stream_).ok());
    ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
    expect_matches_model(*host_b);
    expect_matches_model(*dev);
  }
}

TEST_F(CopyEngineTest, StagedDmaRejections) {
  auto layout = KvLayout::uniform(1, 2, 4096);
  ASSERT_TRUE(layout.ok());
  CopyEngineOptions o;
  o.staged_slot_bytes = 6000;  // smaller than one page-first page (8 KiB), larger than one layer-first pair
  ASSERT_TRUE(make_engine(o).ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 8);
  auto dev2 = layer_first(MemoryKind::kDevice, *layout, 8);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  auto host2 = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  auto page = page_first(MemoryKind::kPinnedHost, *layout, 8);
  ASSERT_TRUE(dev && dev2 && host && host2 && page);
  fill_random(*dev, 1);
  fill_random(*host, 2);
  fill_poison(*dev2);
  fill_poison(*host2);
  fill_poison(*page);
  std::vector<BlockId> s{0, 1, 2}, d{3, 4, 5};
  expect_rejected(*dev2, CopyRequest{&dev->space, &dev2->space, s, d, {}, kAllRoles, CopyStrategy::kStagedDma},
                  StatusCode::kNotSupported);
  expect_rejected(*host2, CopyRequest{&host->space, &host2->space, s, d, {}, kAllRoles, CopyStrategy::kStagedDma},
                  StatusCode::kNotSupported);
  // A page-first host page (2 x 4 KiB, one interval) does not fit a 6000-byte slot.
  expect_rejected(*page, CopyRequest{&dev->space, &page->space, s, d, {}, kAllRoles, CopyStrategy::kStagedDma},
                  StatusCode::kNotSupported);
  // Layer-first: one pair needs two 4 KiB intervals (8 KiB) > 6000 as well;
  // one role alone (4 KiB) fits.
  expect_rejected(*host2, CopyRequest{&dev->space, &host2->space, s, d, {}, kAllRoles, CopyStrategy::kStagedDma},
                  StatusCode::kNotSupported);
  const RoleMask one = role_bit(layout->layer(0).roles[0].role);
  const CopyReport rep =
      copy_and_check(*dev, *host2, CopyRequest{&dev->space, &host2->space, s, d, {}, one, CopyStrategy::kStagedDma});
  EXPECT_EQ(rep.strategy, CopyStrategy::kStagedDma);
  EXPECT_EQ(rep.chunks, 3u);
  CopyEngineOptions bad;
  bad.staged_slots = 0;
  EXPECT_EQ(CopyEngine::create(*device_, bad).status().code(), StatusCode::kInvalidArgument);
  bad = {};
  bad.staged_max_span_ratio = 0.5;
  EXPECT_EQ(CopyEngine::create(*device_, bad).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CopyEngineTest, AutoPicksStagedForDenseHostRuns) {
  auto layout = KvLayout::uniform(2, 2, 32 * 1024);
  ASSERT_TRUE(layout.ok());
  CopyEngineOptions o;
  o.staged_slot_bytes = 1u << 20;
  o.auto_split_min_request_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  const std::size_t n = 64;
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 2 * n);
  auto page = page_first(MemoryKind::kPinnedHost, *layout, 2 * n);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 2 * n);
  ASSERT_TRUE(host && page && dev);
  const auto contiguous = staged_range_ids(3, n);
  const auto every_other = staged_range_ids(0, n, 2);
  const auto random_host = random_ids(2 * n, n, 41);
  const auto d = random_ids(2 * n, n, 42);
  auto req = [&](TestSpace& hs, std::span<const BlockId> h, bool h2d) {
    return h2d ? CopyRequest{&hs.space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto}
               : CopyRequest{&dev->space, &hs.space, d, h, {}, kAllRoles, CopyStrategy::kAuto};
  };
  for (bool h2d : {true, false}) {
    SCOPED_TRACE(h2d ? "h2d" : "d2h");
    // Dense host runs (2 MiB per plane / 8 MiB per page range), scattered device blocks.
    EXPECT_EQ(engine_->choose(req(*host, contiguous, h2d)), CopyStrategy::kStagedDma);
    EXPECT_EQ(engine_->choose(req(*page, contiguous, h2d)), CopyStrategy::kStagedDma);
    // Random host ids: short host ranges, what kAuto picks without them.
    const CopyStrategy scattered = h2d ? CopyStrategy::kSplit : CopyStrategy::kSmKernel;
    EXPECT_EQ(engine_->choose(req(*host, random_host, h2d)), scattered);
    // Every other block: 32 KiB host ranges, below staged_min_host_run_bytes.
    EXPECT_EQ(engine_->choose(req(*host, every_other, h2d)), scattered);
    // Device ids contiguous too: one DMA per plane already reaches the ceiling.
    const auto dev_run = staged_range_ids(0, n);
    CopyRequest both = req(*host, contiguous, h2d);
    (h2d ? both.dst_blocks : both.src_blocks) = dev_run;
    EXPECT_EQ(engine_->choose(both), CopyStrategy::kDmaPerRun);
  }
  // Every other block is dense enough with a ratio of 2.1 and small runs allowed (not with 1.25).
  o.staged_min_host_run_bytes = 16 * 1024;
  ASSERT_TRUE(make_engine(o).ok());
  EXPECT_EQ(engine_->choose(req(*host, every_other, true)), CopyStrategy::kSplit);
  o.staged_max_span_ratio = 2.1;
  ASSERT_TRUE(make_engine(o).ok());
  EXPECT_EQ(engine_->choose(req(*host, every_other, true)), CopyStrategy::kStagedDma);
  // Keeping the SMs out of kAuto keeps staged out as well (32 KiB: DMA lanes).
  o.auto_kernel_max_segment_bytes_h2d = 0;
  ASSERT_TRUE(make_engine(o).ok());
  EXPECT_EQ(engine_->choose(req(*host, contiguous, true)), CopyStrategy::kSplit);
  o.auto_split_h2d_max_segment_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  EXPECT_EQ(engine_->choose(req(*host, contiguous, true)), CopyStrategy::kDmaBatch);
  // copy() runs what kAuto picked.
  ASSERT_TRUE(make_engine(o).ok());
  fill_random(*dev, 43);
  fill_poison(*page);
  const CopyReport rep = copy_and_check(*dev, *page, req(*page, contiguous, false));
  EXPECT_EQ(rep.strategy, CopyStrategy::kStagedDma);
  EXPECT_EQ(copy_strategy_name(CopyStrategy::kStagedDma), "staged_dma");
  auto parsed = parse_copy_strategy("staged_dma");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed, CopyStrategy::kStagedDma);
}

// ---------------------------------------------------------------- split

// kSplit: every kernel share and lane count, both PCIe directions, odd sizes,
// a few pairs (fewer pairs than lanes too), random data, poisoned targets.
// The copy is followed by an event on the caller's stream: once it completed
// the bytes must be there (the join), and the D2H side reads device blocks
// that a plain copy enqueued just before wrote (the fork).
TEST_F(CopyEngineTest, SplitEveryShareAndLaneCount) {
  const double shares[] = {0.0, 0.3, 0.5, 1.0};
  const std::uint32_t lanes[] = {1, 2, 3};
  const std::uint64_t sizes[] = {100, 4097, 16 * 1024};
  int seed = 900;
  auto event = device_->create_event();
  ASSERT_TRUE(event.ok());
  for (double share : shares)
    for (std::uint32_t lane_count : lanes) {
      CopyEngineOptions o;
      o.split_kernel_share = share;
      o.split_dma_lanes = lane_count;
      ASSERT_TRUE(make_engine(o).ok());
      for (std::uint64_t bb : sizes)
        for (std::size_t pairs : {std::size_t{2}, std::size_t{13}}) {
          SCOPED_TRACE(::testing::Message()
                       << "share=" << share << " lanes=" << lane_count << " block_bytes=" << bb << " pairs=" << pairs);
          auto layout = KvLayout::uniform(2, 2, bb);
          ASSERT_TRUE(layout.ok());
          auto host = layer_first(MemoryKind::kPinnedHost, *layout, 20);
          auto dev = layer_first(MemoryKind::kDevice, *layout, 20);
          auto fresh = layer_first(MemoryKind::kDevice, *layout, 20);
          auto back = page_first(MemoryKind::kPinnedHost, *layout, 20);
          ASSERT_TRUE(host && dev && fresh && back);
          fill_random(*host, ++seed);
          fill_poison(*dev);
          const auto h = random_ids(20, pairs, ++seed);
          const auto d = random_ids(20, pairs, ++seed);
          CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kSplit};
          model_copy(*host, *dev, up);
          auto rep = engine_->copy(up, *stream_);
          ASSERT_TRUE(rep.ok()) << rep.status().to_string();
          EXPECT_EQ(rep->strategy, CopyStrategy::kSplit);
          EXPECT_EQ(rep->bytes, bb * 4 * pairs);
          ASSERT_TRUE(device_->record(**event, *stream_).ok());
          ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
          expect_matches_model(*dev);
          // D2H of blocks written by work enqueued on the stream just before.
          fill_random(*fresh, ++seed);
          fill_poison(*back);
          for (std::size_t k = 0; k < dev->regions.size(); ++k) {
            ASSERT_TRUE(
                device_->memcpy_async(dev->regions[k].base, fresh->regions[k].base, dev->regions[k].bytes, *stream_)
                    .ok());
            dev->regions[k].mirror = fresh->regions[k].mirror;
          }
          const auto hb = random_ids(20, pairs, ++seed);
          CopyRequest down{&dev->space, &back->space, d, hb, {}, kAllRoles, CopyStrategy::kSplit};
          model_copy(*dev, *back, down);
          ASSERT_TRUE(engine_->copy(down, *stream_).ok());
          ASSERT_TRUE(device_->record(**event, *stream_).ok());
          ASSERT_TRUE(device_->synchronize(**event, kWait).ok());
          expect_matches_model(*back);
          if (HasFailure()) return;
        }
    }
}

TEST_F(CopyEngineTest, SplitRejectsHostToHostAndDeviceToDevice) {
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 8);
  auto dev2 = layer_first(MemoryKind::kDevice, *layout, 8);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  auto host2 = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  ASSERT_TRUE(dev && dev2 && host && host2);
  fill_poison(*dev2);
  fill_poison(*host2);
  std::vector<BlockId> s{0, 2}, d{1, 3};
  expect_rejected(*dev2, CopyRequest{&dev->space, &dev2->space, s, d, {}, kAllRoles, CopyStrategy::kSplit},
                  StatusCode::kNotSupported);
  expect_rejected(*host2, CopyRequest{&host->space, &host2->space, s, d, {}, kAllRoles, CopyStrategy::kSplit},
                  StatusCode::kNotSupported);
  CopyEngineOptions bad;
  bad.split_kernel_share = 1.5;
  EXPECT_EQ(make_engine(bad).code(), StatusCode::kInvalidArgument);
  bad.split_kernel_share = 0.5;
  bad.split_dma_lanes = 0;
  EXPECT_EQ(make_engine(bad).code(), StatusCode::kInvalidArgument);
  auto parsed = parse_copy_strategy("split");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed, CopyStrategy::kSplit);
}

// kAuto's split profile: the H2D range picks kSplit, with the kernel share
// below the DMA-only size and none from it, and none when SMs are kept out.
TEST_F(CopyEngineTest, AutoSplitProfile) {
  CopyEngineOptions o;
  o.auto_split_h2d_min_segment_bytes = 8 * 1024;
  o.auto_split_h2d_max_segment_bytes = 64 * 1024;
  o.auto_split_h2d_kernel_share = 0.5;
  o.auto_split_h2d_large_segment_bytes = 24 * 1024;
  o.auto_split_h2d_kernel_share_large = 0.25;
  o.auto_split_h2d_small_segment_bytes = 4 * 1024;
  o.auto_split_adaptive = false;  // the fixed profile; AdaptiveSplit tests the tuning
  o.auto_split_min_request_bytes = 0;
  o.auto_split_payload_bytes_per_dma_descriptor = 0;  // the CPU-budget cap is checked below
  o.auto_split_only_behind_queued_work = false;       // checked in AutoSplitOnlyBehindQueuedWork
  for (bool sms_out : {false, true}) {
    o.auto_kernel_max_segment_bytes_h2d = sms_out ? 0 : 64 * 1024;
    ASSERT_TRUE(make_engine(o).ok());
    for (std::uint64_t bb : {std::uint64_t{4096}, std::uint64_t{16 * 1024}, std::uint64_t{32 * 1024}}) {
      SCOPED_TRACE(::testing::Message() << "block_bytes=" << bb << " sms_out=" << sms_out);
      auto layout = KvLayout::uniform(1, 1, bb);
      ASSERT_TRUE(layout.ok());
      auto host = layer_first(MemoryKind::kPinnedHost, *layout, 16);
      auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
      ASSERT_TRUE(host && dev);
      fill_random(*host, 77);
      fill_poison(*dev);
      const auto h = random_ids(16, 8, 78);
      const auto d = random_ids(16, 8, 79);
      CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto};
      // SMs out: only the DMA-lanes part of the range (from 24 KiB) remains.
      const bool split = sms_out ? bb >= 24 * 1024 : bb >= 8 * 1024;
      const CopyStrategy expected =
          split ? CopyStrategy::kSplit : (sms_out ? CopyStrategy::kDmaBatch : CopyStrategy::kSmKernel);
      EXPECT_EQ(engine_->choose(up), expected);
      const CopyReport rep = copy_and_check(*host, *dev, up);
      EXPECT_EQ(rep.strategy, expected);
      if (expected == CopyStrategy::kSplit) {
        const bool large = bb >= 24 * 1024;
        EXPECT_EQ(rep.kernel_share, sms_out ? 0.0 : large ? 0.25 : 0.5);
        EXPECT_EQ(rep.lanes, large || sms_out ? o.split_dma_lanes : 1u);
      }
      if (HasFailure()) return;
    }
  }
  // CPU budget: at most one DMA descriptor per 64 KiB of payload. 16 KiB
  // blocks: DMA <= 1/4 of the pairs (share 0.75 over the profile's 0.5);
  // 32 KiB (profile: 0.25): DMA <= 1/2.
  o.auto_kernel_max_segment_bytes_h2d = 64 * 1024;
  o.auto_split_payload_bytes_per_dma_descriptor = 64 * 1024;
  ASSERT_TRUE(make_engine(o).ok());
  for (std::uint64_t bb : {std::uint64_t{16 * 1024}, std::uint64_t{32 * 1024}}) {
    SCOPED_TRACE(::testing::Message() << "capped, block_bytes=" << bb);
    auto layout = KvLayout::uniform(1, 1, bb);
    ASSERT_TRUE(layout.ok());
    auto host = layer_first(MemoryKind::kPinnedHost, *layout, 16);
    auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
    ASSERT_TRUE(host && dev);
    fill_random(*host, 80);
    fill_poison(*dev);
    const auto h = random_ids(16, 8, 81);
    const auto d = random_ids(16, 8, 82);
    const CopyReport rep =
        copy_and_check(*host, *dev, CopyRequest{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto});
    EXPECT_EQ(rep.strategy, CopyStrategy::kSplit);
    EXPECT_DOUBLE_EQ(rep.kernel_share, bb == 16 * 1024 ? 0.75 : 0.5);
    EXPECT_EQ(rep.lanes, bb == 16 * 1024 ? 1u : o.split_dma_lanes);
  }
}

// Host memory registered in 64 KiB chunks, blocks of 24 KiB + 1 KiB padding:
// many blocks straddle two registrations. One DMA descriptor may not span two
// registrations on CUDA (the driver rejects it), so every DMA strategy must
// cut there. Byte-exact both ways, random ids, poisoned targets.
TEST_F(CopyEngineTest, DmaStrategiesCutAtPinnedRegistrationEnds) {
  const std::uint64_t bb = 24 * 1024, stride = bb + 1024, blocks = 40;
  auto layout = KvLayout::uniform(1, 1, bb);
  ASSERT_TRUE(layout.ok());
  PinnedOptions po;
  po.chunk_bytes = 64 * 1024;
  auto pinned = device_->allocate_pinned(stride * blocks, po);
  ASSERT_TRUE(pinned.ok()) << pinned.status().to_string();
  ASSERT_TRUE((*pinned)->wait_ready(kWait).ok());
  TestSpace host;
  host.regions.push_back({(*pinned)->data(), stride * blocks, {}});
  std::vector<std::vector<Plane>> planes{{Plane{(*pinned)->data(), stride}}};
  auto space = BlockSpace::from_planes(MemoryKind::kPinnedHost, device_->ordinal(), *layout, blocks, std::move(planes));
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  host.space = std::move(space).value();
  host.pinned.push_back(std::move(pinned).value());
  auto dev = layer_first(MemoryKind::kDevice, *layout, blocks);
  ASSERT_TRUE(dev);
  const auto h = random_ids(blocks, blocks, 61);
  const auto d = random_ids(blocks, blocks, 62);
  for (CopyStrategy strategy : {CopyStrategy::kDmaBatch, CopyStrategy::kDmaPerRun, CopyStrategy::kSplit,
                                CopyStrategy::kStagedDma, CopyStrategy::kAuto}) {
    SCOPED_TRACE(copy_strategy_name(strategy));
    fill_random(host, 63);
    fill_poison(*dev);
    copy_and_check(host, *dev, CopyRequest{&host.space, &dev->space, h, d, {}, kAllRoles, strategy});
    fill_random(*dev, 64);
    fill_poison(host);
    copy_and_check(*dev, host, CopyRequest{&dev->space, &host.space, d, h, {}, kAllRoles, strategy});
    if (HasFailure()) return;
  }
}

// kAuto's split needs work queued ahead of it on the caller's stream (the CPU
// enqueues the DMA part while the GPU is busy): on an idle stream the kernel.
TEST_F(CopyEngineTest, AutoSplitOnlyBehindQueuedWork) {
  CopyEngineOptions o;
  o.auto_split_min_request_bytes = 0;
  ASSERT_TRUE(make_engine(o).ok());
  auto layout = KvLayout::uniform(1, 2, 16 * 1024);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 32);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 32);
  ASSERT_TRUE(host && dev);
  const auto h = random_ids(32, 16, 91);
  const auto d = random_ids(32, 16, 92);
  CopyRequest up{&host->space, &dev->space, h, d, {}, kAllRoles, CopyStrategy::kAuto};
  fill_random(*host, 93);
  fill_poison(*dev);
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  EXPECT_EQ(copy_and_check(*host, *dev, up).strategy, CopyStrategy::kSmKernel) << "idle stream";
  // Hold the stream with a host callback, then copy behind it.
  auto open = hold_stream();
  fill_random(*host, 94);
  fill_poison(*dev);
  model_copy(*host, *dev, up);
  auto rep = engine_->copy(up, *stream_);
  open->store(true);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  EXPECT_EQ(rep->strategy, CopyStrategy::kSplit) << "behind queued work";
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*dev);
}

// From an idle caller stream kAuto prefers the SM kernel over batched DMA
// below auto_idle_kernel_max_segment_bytes; behind queued work, batched DMA.
TEST_F(CopyEngineTest, AutoIdleStreamPrefersKernelOverBatch) {
  auto layout = KvLayout::uniform(1, 1, 256 * 1024);
  ASSERT_TRUE(layout.ok());
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 16);
  auto dev = layer_first(MemoryKind::kDevice, *layout, 16);
  ASSERT_TRUE(host && dev);
  const auto h = random_ids(16, 8, 95);
  const auto d = random_ids(16, 8, 96);
  for (bool h2d : {true, false}) {
    SCOPED_TRACE(h2d ? "h2d" : "d2h");
    TestSpace& src = h2d ? *host : *dev;
    TestSpace& dst = h2d ? *dev : *host;
    CopyRequest r{&src.space, &dst.space, h2d ? h : d, h2d ? d : h, {}, kAllRoles, CopyStrategy::kAuto};
    EXPECT_EQ(engine_->choose(r), CopyStrategy::kDmaBatch) << "choose() assumes queued work";
    fill_random(src, 97);
    fill_poison(dst);
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    EXPECT_EQ(copy_and_check(src, dst, r).strategy, CopyStrategy::kSmKernel) << "idle stream";
    auto open = hold_stream();
    fill_random(src, 98);
    fill_poison(dst);
    model_copy(src, dst, r);
    auto rep = engine_->copy(r, *stream_);
    open->store(true);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    EXPECT_EQ(rep->strategy, CopyStrategy::kDmaBatch) << "behind queued work";
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    expect_matches_model(dst);
  }
}

// ---------------------------------------------------------------- checksums

// A BlockSpace of the same geometry over the CPU mirror of `ts` (where block_checksum() can read).
inline BlockSpace mirror_space(TestSpace& ts) {
  const KvLayout& layout = ts.space.layout();
  std::vector<std::vector<Plane>> planes(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const Plane& p = ts.space.plane(l, r);
      planes[l].push_back({ts.mirror_of(p.base), p.stride});
    }
  auto s = BlockSpace::from_planes(MemoryKind::kPinnedHost, 0, layout, ts.space.num_blocks(), std::move(planes));
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(s).value() : BlockSpace{};
}

class CopyChecksumTest : public CopyEngineTest {
 protected:
  // Device memory for `n` checksums, poisoned (the engine must zero it).
  std::uint64_t* checksum_buffer(std::size_t n) {
    auto b = device_->allocate_device(n * 8);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    if (!b.ok()) return nullptr;
    std::vector<std::uint64_t> poison(n, 0xDEADBEEFDEADBEEFull);
    EXPECT_TRUE(device_->memcpy_sync(b->bytes_ptr(), poison.data(), n * 8).ok());
    buffers_.push_back(std::move(b).value());
    return reinterpret_cast<std::uint64_t*>(buffers_.back().bytes_ptr());
  }
  std::vector<std::uint64_t> read(const std::uint64_t* p, std::size_t n) {
    std::vector<std::uint64_t> v(n);
    EXPECT_TRUE(device_->memcpy_sync(v.data(), p, n * 8).ok());
    return v;
  }
  std::vector<std::uint64_t> reference(TestSpace& ts, std::span<const BlockId> ids,
                                       std::span<const std::uint32_t> layers, RoleMask roles = kAllRoles) {
    const BlockSpace m = mirror_space(ts);
    std::vector<std::uint64_t> v;
    for (BlockId id : ids) {
      auto sum = block_checksum(m, id, layers, roles);
      EXPECT_TRUE(sum.ok()) << sum.status().to_string();
      v.push_back(sum.value_or(0));
    }
    return v;
  }
  std::vector<Buffer> buffers_;
};

TEST_F(CopyChecksumTest, ChecksummedCopyMovesTheBytesAndMatchesTheReference) {
  auto layout = KvLayout::uniform(3, 2, 16 * 1024);
  ASSERT_TRUE(layout.ok());
  auto dev_a = layer_first(MemoryKind::kDevice, *layout, 64);
  auto dev_b = layer_first(MemoryKind::kDevice, *layout, 64);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 64);
  ASSERT_TRUE(dev_a && dev_b && host);
  const auto s = random_ids(64, 40, 201);
  const auto d = random_ids(64, 40, 202);
  std::uint64_t* ck = checksum_buffer(s.size());
  ASSERT_NE(ck, nullptr);
  struct Case {
    TestSpace* src;
    TestSpace* dst;
    const char* name;
  };
  const std::vector<std::uint32_t> one_layer{1}, two_layers{2, 0};
  for (const Case& c : {Case{dev_a.get(), dev_b.get(), "d2d"}, Case{dev_a.get(), host.get(), "d2h"},
                        Case{host.get(), dev_b.get(), "h2d"}}) {
    for (std::span<const std::uint32_t> layers :
         {std::span<const std::uint32_t>{}, std::span<const std::uint32_t>(one_layer),
          std::span<const std::uint32_t>(two_layers)}) {
      for (CopyStrategy strategy : {CopyStrategy::kAuto, CopyStrategy::kSmKernel}) {
        SCOPED_TRACE(::testing::Message()
                     << c.name << ", " << layers.size() << " layers, " << copy_strategy_name(strategy));
        fill_random(*c.src, 203 + layers.size());
        fill_poison(*c.dst);
        CopyRequest r{&c.src->space, &c.dst->space, s, d, layers, kAllRoles, strategy};
        r.checksums = ck;
        const CopyReport rep = copy_and_check(*c.src, *c.dst, r);
        EXPECT_EQ(rep.strategy, CopyStrategy::kSmKernel);
        EXPECT_EQ(read(ck, s.size()), reference(*c.src, s, layers));
        EXPECT_EQ(read(ck, s.size()), reference(*c.dst, d, layers)) << "the copy's checksum is the destination's";
      }
    }
  }
}

TEST_F(CopyChecksumTest, ChecksumDoesNotDependOnTheKernelShapeOrLaunchCuts) {
  // 5,000 pairs of 32-byte blocks: several inline launches with max_pairs_per_call 2,000, then the
  // descriptor ring with more pairs than inline launches take; one CTA or many; small items or large.
  auto layout = KvLayout::uniform(2, 2, 32);
  ASSERT_TRUE(layout.ok());
  auto src = layer_first(MemoryKind::kDevice, *layout, 8192);
  auto dst = layer_first(MemoryKind::kDevice, *layout, 8192);
  ASSERT_TRUE(src && dst);
  fill_random(*src, 211);
  const auto s = random_ids(8192, 5000, 212);
  const auto d = random_ids(8192, 5000, 213);
  const auto want = reference(*src, s, {});
  std::uint64_t* ck = checksum_buffer(s.size());
  ASSERT_NE(ck, nullptr);
  CopyEngineOptions shapes[3];
  shapes[0].max_pairs_per_call = 2000;
  shapes[1].sm_inline_descriptor_max_pairs = 0;
  shapes[1].sm_ctas_d2d = 1;
  shapes[1].sm_threads_per_cta = 64;
  shapes[2].sm_item_bytes = 16;
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(make_engine(shapes[i]).ok());
    fill_poison(*dst);
    CopyRequest r{&src->space, &dst->space, s, d, {}, kAllRoles, CopyStrategy::kSmKernel};
    r.checksums = ck;
    copy_and_check(*src, *dst, r);
    EXPECT_EQ(read(ck, s.size()), want);
    auto rep = engine_->checksum(dst->space, d, {}, kAllRoles, ck, *stream_);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
    EXPECT_EQ(read(ck, d.size()), want);
  }
}

// CopyRequest::landed_checksums: the copy reads back what it wrote (each warp its previous item) and both lists
// equal the CPU reference of the destination, for every direction, layer selection and kernel shape: one CTA of
// two warps with 16-byte items (a warp reads back dozens of items, each one behind), inline and ring launches,
// 1024-thread CTAs (on CUDA the general kernel build, whose read-back follows the copy; up to 512 threads the
// read-back goes beside the copy), through copy() and a prepared copy. Both lists start poisoned.
TEST_F(CopyChecksumTest, LandedChecksumsAreTheDestinationsAsWritten) {
  auto layout = KvLayout::uniform(3, 2, 4096);
  ASSERT_TRUE(layout.ok());
  auto dev_a = layer_first(MemoryKind::kDevice, *layout, 96);
  auto dev_b = layer_first(MemoryKind::kDevice, *layout, 96);
  auto host = layer_first(MemoryKind::kPinnedHost, *layout, 96);
  ASSERT_TRUE(dev_a && dev_b && host);
  const auto s = random_ids(96, 70, 241);
  const auto d = random_ids(96, 70, 242);
  CopyEngineOptions shapes[4];
  shapes[1].sm_ctas_landed = 1;
  shapes[1].sm_threads_per_cta = 64;
  shapes[1].sm_landed_item_bytes = 16;
  shapes[2].sm_inline_descriptor_max_pairs = 0;
  shapes[2].max_pairs_per_call = 32;
  shapes[2].sm_landed_item_bytes = 1024;
  shapes[3].sm_ctas_landed = 2;
  shapes[3].sm_threads_per_cta = 1024;
  shapes[3].sm_landed_item_bytes = 256;
  struct Case {
    TestSpace* src;
    TestSpace* dst;
    const char* name;
  };
  const std::vector<std::uint32_t> one_layer{1}, two_layers{2, 0};
  for (int shape = 0; shape < 4; ++shape) {
    ASSERT_TRUE(make_engine(shapes[shape]).ok());
    for (const Case& c : {Case{dev_a.get(), dev_b.get(), "d2d"}, Case{dev_a.get(), host.get(), "d2h"},
                          Case{host.get(), dev_b.get(), "h2d"}}) {
      for (std::span<const std::uint32_t> layers :
           {std::span<const std::uint32_t>{}, std::span<const std::uint32_t>(one_layer),
            std::span<const std::uint32_t>(two_layers)}) {
        for (bool prepared : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "shape " << shape << ", " << c.name << ", " << layers.size() << " layers"
                                            << (prepared ? ", prepared" : ""));
          fill_random(*c.src, 243 + shape * 10 + layers.size());
          fill_poison(*c.dst);
          std::uint64_t* ck = checksum_buffer(s.size());
          std::uint64_t* landed = checksum_buffer(s.size());
          ASSERT_TRUE(ck != nullptr && landed != nullptr);
          CopyRequest r{&c.src->space, &c.dst->space, s, d, layers, kAllRoles, CopyStrategy::kAuto};
          r.checksums = ck;
          r.landed_checksums = landed;
          if (prepared) {
            CopyRequest whole = r;
            whole.layers = {};
            auto p = engine_->prepare(whole);
            ASSERT_TRUE(p.ok()) << p.status().to_string();
            model_copy(*c.src, *c.dst, r);
            auto rep = engine_->copy(*p, layers, *stream_, ck, landed);
            ASSERT_TRUE(rep.ok()) << rep.status().to_string();
            EXPECT_EQ(rep->strategy, CopyStrategy::kSmKernel);
            ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
            expect_matches_model(*c.dst);
          } else {
            EXPECT_EQ(copy_and_check(*c.src, *c.dst, r).strategy, CopyStrategy::kSmKernel);
          }
          const auto want = reference(*c.dst, d, layers);
          EXPECT_EQ(want, reference(*c.src, s, layers));
          EXPECT_EQ(read(ck, s.size()), want);
          EXPECT_EQ(read(landed, s.size()), want) << "the read-back sees the destination as written";
        }
      }
    }
  }
}

// Landed checksums need the copy's own checksums and an array of their own; refused by name, nothing written.
TEST_F(CopyChecksumTest, LandedChecksumsWithoutChecksumsOrInTheSameArrayAreRefused) {
  auto layout = KvLayout::uniform(1, 1, 256);
  ASSERT_TRUE(layout.ok());
  auto src = layer_first(MemoryKind::kDevice, *layout, 4);
  auto dst = layer_first(MemoryKind::kDevice, *layout, 4);
  ASSERT_TRUE(src && dst);
  fill_random(*src, 251);
  fill_poison(*dst);
  const std::vector<BlockId> ids{0, 2};
  std::uint64_t* ck = checksum_buffer(2);
  ASSERT_NE(ck, nullptr);
  CopyRequest alone{&src->space, &dst->space, ids, ids, {}, kAllRoles, CopyStrategy::kAuto};
  alone.landed_checksums = ck;
  auto r1 = engine_->copy(alone, *stream_);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r1.status().message().find("without checksums"), std::string::npos) << r1.status().to_string();
  CopyRequest same = alone;
  same.checksums = ck;
  auto r2 = engine_->copy(same, *stream_);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r2.status().message().find("same array"), std::string::npos) << r2.status().to_string();
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*dst);
}

// On the host backend, where the read-back is its own task behind the copy: a destination byte changed between
// the copy and the read-back shows in that block's landed checksum only.
TEST_F(CopyChecksumTest, LandedChecksumsSeeADestinationChangedAfterTheCopy) {
  auto* host_device = dynamic_cast<HostDevice*>(device_.get());
  if (host_device == nullptr) GTEST_SKIP() << "the read-back is inside the kernel on a GPU";
  auto layout = KvLayout::uniform(2, 2, 1024);
  ASSERT_TRUE(layout.ok());
  auto src = layer_first(MemoryKind::kDevice, *layout, 16);
  auto dst = layer_first(MemoryKind::kDevice, *layout, 16);
  ASSERT_TRUE(src && dst);
  fill_random(*src, 261);
  fill_poison(*dst);
  const std::vector<BlockId> s{3, 7, 11}, d{2, 9, 14};
  std::uint64_t* ck = checksum_buffer(3);
  std::uint64_t* landed = checksum_buffer(3);
  ASSERT_TRUE(ck != nullptr && landed != nullptr);
  // The operations writing `landed`: its zeroing before the copy, then the read-back after it.
  std::atomic<int> landed_ops{0};
  std::atomic<bool> damaged{false};
  host_device->set_failure_predicate([&](std::uint64_t, const void* op_dst, std::uint64_t) {
    if (op_dst == landed && landed_ops.fetch_add(1) + 1 == 2) {
      dst->space.block_ptr(1, 1, d[1])[40] ^= std::byte{0x10};
      damaged = true;
    }
    return false;  // nothing fails: the bytes are silently wrong
  });
  CopyRequest r{&src->space, &dst->space, s, d, {}, kAllRoles, CopyStrategy::kAuto};
  r.checksums = ck;
  r.landed_checksums = landed;
  auto rep = engine_->copy(r, *stream_);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  host_device->set_failure_predicate(nullptr);
  ASSERT_TRUE(damaged.load());
  const auto moved = reference(*src, s, {});
  const auto got = read(landed, 3);
  EXPECT_EQ(read(ck, 3), moved);
  EXPECT_EQ(got[0], moved[0]);
  EXPECT_NE(got[1], moved[1]) << "the changed block";
  EXPECT_EQ(got[2], moved[2]);
}

TEST_F(CopyChecksumTest, ChecksumReadsWithoutWritingAndSeesEveryFlippedHalfWord) {
  auto layout = KvLayout::uniform(1, 2, 256);
  ASSERT_TRUE(layout.ok());
  auto dev = layer_first(MemoryKind::kDevice, *layout, 4);
  ASSERT_TRUE(dev);
  fill_random(*dev, 221);
  const std::vector<BlockId> ids{2, 0, 2};  // repeats are allowed: nothing is written
  std::uint64_t* ck = checksum_buffer(ids.size());
  ASSERT_NE(ck, nullptr);
  auto run = [&]() {
    auto rep = engine_->checksum(dev->space, ids, {}, kAllRoles, ck, *stream_);
    EXPECT_TRUE(rep.ok()) << rep.status().to_string();
    EXPECT_TRUE(device_->synchronize(*stream_, kWait).ok());
    return read(ck, ids.size());
  };
  const auto base = run();
  EXPECT_EQ(base, reference(*dev, ids, {}));
  EXPECT_EQ(base[0], base[2]);
  EXPECT_NE(base[0], base[1]);
  expect_matches_model(*dev);  // nothing written
  // Flip one bit in each 8-byte half of block 2 (role 0 and role 1): the checksum changes every time.
  for (std::uint32_t role = 0; role < 2; ++role)
    for (std::uint64_t half = 0; half < 256 / 8; ++half) {
      std::byte* p = dev->space.block_ptr(0, role, 2) + half * 8 + (half % 8);
      std::byte* m = dev->mirror_of(p);
      *m ^= std::byte{0x10};
      ASSERT_TRUE(device_->memcpy_sync(p, m, 1).ok());
      const auto flipped = run();
      EXPECT_NE(flipped[0], base[0]) << "role " << role << " half-word " << half;
      EXPECT_EQ(flipped[0], reference(*dev, ids, {})[0]);
      *m ^= std::byte{0x10};
      ASSERT_TRUE(device_->memcpy_sync(p, m, 1).ok());
    }
  // Two words swapped: same bytes, other places.
  std::byte* w0 = dev->space.block_ptr(0, 0, 2);
  std::byte tmp[16];
  std::memcpy(tmp, dev->mirror_of(w0), 16);
  std::memcpy(dev->mirror_of(w0), dev->mirror_of(w0 + 16), 16);
  std::memcpy(dev->mirror_of(w0 + 16), tmp, 16);
  ASSERT_TRUE(device_->memcpy_sync(w0, dev->mirror_of(w0), 32).ok());
  EXPECT_NE(run()[0], base[0]);
}

TEST_F(CopyChecksumTest, ChecksummedCopyRefusesMisalignedBlocksAndDmaStrategies) {
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto src = layer_first(MemoryKind::kDevice, *layout, 8);
  auto padded = layer_first(MemoryKind::kDevice, *layout, 8, /*pad=*/8);
  auto dst = layer_first(MemoryKind::kPinnedHost, *layout, 8);
  auto odd_layout = KvLayout::uniform(1, 1, 4100);
  ASSERT_TRUE(odd_layout.ok());
  auto odd_src = layer_first(MemoryKind::kDevice, *odd_layout, 8);
  auto odd_dst = layer_first(MemoryKind::kDevice, *odd_layout, 8);
  ASSERT_TRUE(src && padded && dst && odd_src && odd_dst);
  fill_random(*src, 231);
  fill_random(*padded, 232);
  fill_random(*odd_src, 233);
  fill_poison(*dst);
  fill_poison(*odd_dst);
  const std::vector<BlockId> s{1, 3}, d{0, 2};
  std::uint64_t* ck = checksum_buffer(2);
  ASSERT_NE(ck, nullptr);
  CopyRequest misaligned{&padded->space, &dst->space, s, d, {}, kAllRoles, CopyStrategy::kAuto};
  misaligned.checksums = ck;
  auto r1 = engine_->copy(misaligned, *stream_);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r1.status().message().find("stride 4104"), std::string::npos) << r1.status().to_string();
  CopyRequest odd{&odd_src->space, &odd_dst->space, s, d, {}, kAllRoles, CopyStrategy::kSmKernel};
  odd.checksums = ck;
  auto r2 = engine_->copy(odd, *stream_);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("block_bytes 4100"), std::string::npos) << r2.status().to_string();
  for (CopyStrategy strategy :
       {CopyStrategy::kDmaPerRun, CopyStrategy::kDmaBatch, CopyStrategy::kStagedDma, CopyStrategy::kSplit}) {
    CopyRequest r{&src->space, &dst->space, s, d, {}, kAllRoles, strategy};
    r.checksums = ck;
    auto rep = engine_->copy(r, *stream_);
    ASSERT_FALSE(rep.ok()) << copy_strategy_name(strategy);
    EXPECT_EQ(rep.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(rep.status().message().find(copy_strategy_name(strategy)), std::string::npos);
  }
  auto r3 = engine_->checksum(dst->space, s, {}, kAllRoles, ck, *stream_);
  EXPECT_EQ(r3.status().code(), StatusCode::kNotSupported) << "host memory: block_checksum() on the CPU";
  const std::vector<BlockId> bad{1, 8};
  auto r4 = engine_->checksum(src->space, bad, {}, kAllRoles, ck, *stream_);
  EXPECT_EQ(r4.status().code(), StatusCode::kOutOfRange) << r4.status().to_string();
  ASSERT_TRUE(device_->synchronize(*stream_, kWait).ok());
  expect_matches_model(*dst);
  expect_matches_model(*odd_dst);
}

}  // namespace kvtier::copy_test
