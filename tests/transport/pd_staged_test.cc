// The staged prefill/decode endpoints in one process on the loopback transport, device memory of the host
// backend on both sides: byte-exact with layers declared out of order, the staging pool's back-pressure and
// its return on forget(), and bad input refused at create/begin/start.
#include "kvtier/transport/pd_staged.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include "kvtier/device/host_device.h"
#include "transport/pd_test_util.h"

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;
using testing::fill_pattern;
using testing::matches_pattern;
using testing::pattern;
using testing::pd_layout;

int g_seq = 0;
constexpr std::uint64_t kBlocks = 8;

struct DevBlocks {
  std::vector<Buffer> mem;
  BlockSpace space;
  static DevBlocks make(Device& dev, const KvLayout& layout, bool fill) {
    DevBlocks d;
    std::vector<std::vector<void*>> bases(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        Buffer b = dev.allocate_device(BlockSpace::layer_first_region_bytes(layout, l, r, kBlocks)).value();
        auto* p = b.bytes_ptr();
        for (std::uint64_t blk = 0; blk < kBlocks; ++blk) {
          std::byte* block = p + blk * layout.block_bytes(l, r);
          if (fill)
            fill_pattern(block, l, r, blk, layout.block_bytes(l, r));
          else
            std::memset(block, 0xee, layout.block_bytes(l, r));
        }
        bases[l].push_back(b.data());
        d.mem.push_back(std::move(b));
      }
    d.space = BlockSpace::layer_first(MemoryKind::kDevice, 0, layout, kBlocks, bases).value();
    return d;
  }
};

// Host-backend device memory is RAM: compared in place.
bool matches(const BlockSpace& s, std::uint64_t dst, std::uint32_t l, std::uint64_t src) {
  for (std::uint32_t r = 0; r < s.layout().num_roles(l); ++r)
    if (!matches_pattern(s.block_ptr(l, r, dst), l, r, src, s.layout().block_bytes(l, r))) return false;
  return true;
}

struct Rig {
  KvLayout layout = pd_layout();
  std::unique_ptr<HostDevice> dev = HostDevice::create().value();
  std::unique_ptr<CopyEngine> engine = CopyEngine::create(*dev).value();
  DevBlocks pre_mem = DevBlocks::make(*dev, layout, true);
  DevBlocks dec_mem = DevBlocks::make(*dev, layout, false);
  StagingSpace pre_st = StagingSpace::allocate(*dev, layout, 6).value();
  StagingSpace dec_st = StagingSpace::allocate(*dev, layout, 6).value();
  std::unique_ptr<Transport> pre_t, dec_t;
  std::unique_ptr<PdStagedPrefill> pre;
  std::unique_ptr<PdStagedDecode> dec;
  PeerId to_dec = 0, to_pre = 0;

  Rig() {
    const int n = ++g_seq;
    pre_t = create_loopback_transport({fmt::format("spre{}", n), layout.fingerprint(), 1, 0}).value();
    dec_t = create_loopback_transport({fmt::format("sdec{}", n), layout.fingerprint(), 1, 0}).value();
    pre = PdStagedPrefill::create(*pre_t, *dev, *engine, pre_mem.space, pre_st.space).value();
    dec = PdStagedDecode::create(*dec_t, *dev, *engine, dec_mem.space, dec_st.space).value();
    to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
    to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
  }
  ~Rig() {
    pre.reset();
    dec.reset();
    pre_t.reset();
    dec_t.reset();
  }
};

const std::vector<BlockId> kSrc = {3, 1, 7, 5};
const std::vector<BlockId> kDst = {0, 2, 6, 4};

class StagedModes : public ::testing::TestWithParam<PdMode> {};

TEST_P(StagedModes, LayersOutOfOrderArriveByteExactInDeviceMemory) {
  Rig rig;
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 7, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 7, GetParam(), kDst).ok());
  for (std::uint32_t l : {2u, 0u, 3u, 1u}) {
    ASSERT_TRUE(rig.pre->layer_ready(7, l).ok());
    auto ls = rig.dec->wait_layer(7, l, 5s);
    ASSERT_TRUE(ls.ok()) << ls.status().to_string();
    EXPECT_EQ(*ls, LayerState::kLoaded) << l;
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(matches(rig.dec_mem.space, kDst[i], l, kSrc[i])) << l;
  }
  EXPECT_EQ(rig.pre->layer_ready(7, 1).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(rig.pre->layer_ready(7, 4).code(), StatusCode::kOutOfRange);
  auto fin = rig.dec->wait(7, 5s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u);
  auto pst = rig.pre->wait(7, 5s);
  ASSERT_TRUE(pst.ok()) << pst.status().to_string();
  EXPECT_TRUE(pst->done);
  EXPECT_TRUE(pst->reclaimable);
  // Untouched destination blocks keep their poison.
  EXPECT_EQ(rig.dec_mem.space.block_ptr(0, 0, 1)[0], std::byte{0xee});
  EXPECT_TRUE(rig.pre->forget(7).ok());
  EXPECT_TRUE(rig.dec->forget(7).ok());
}

INSTANTIATE_TEST_SUITE_P(Modes, StagedModes, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });

// A transfer of more blocks than the whole staging pool holds was refused as back-pressure (kResourceExhausted:
// "retry after a forget()"), which no forget() could ever satisfy: a scheduler retried it forever. It is the
// caller's error, naming both counts.
TEST(PdStaged, ATransferLargerThanTheWholeStagingPoolIsRefusedAsInvalid) {
  Rig rig;
  const std::vector<BlockId> seven = {0, 1, 2, 3, 4, 5, 6};
  Status s = rig.pre->begin(rig.to_dec, 3, seven);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("7 blocks asked, the pool holds 6"), std::string::npos) << s.to_string();
  s = rig.dec->start(rig.to_pre, 3, PdMode::kPush, seven);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(rig.pre->staging_blocks_free(), 6u);
  EXPECT_EQ(rig.dec->staging_blocks_free(), 6u);
}

TEST(PdStaged, TheStagingPoolPushesBackAndRefillsOnForget) {
  Rig rig;
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 1, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 1, PdMode::kPush, kDst).ok());
  EXPECT_EQ(rig.pre->staging_blocks_free(), 2u);
  EXPECT_EQ(rig.dec->staging_blocks_free(), 2u);
  // Six staging blocks, four in use: a second transfer of three blocks must wait for the first.
  Status s = rig.pre->begin(rig.to_dec, 2, {0, 2, 4});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("3 blocks asked, 2 free"), std::string::npos) << s.to_string();
  EXPECT_EQ(rig.dec->start(rig.to_pre, 2, PdMode::kPush, {1, 3, 5}).code(), StatusCode::kResourceExhausted);
  // Not final yet: nothing returns to the pool.
  EXPECT_EQ(rig.pre->forget(1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rig.dec->forget(1).code(), StatusCode::kFailedPrecondition);
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(1, l).ok());
  ASSERT_TRUE(rig.dec->wait(1, 5s, true).ok());
  ASSERT_TRUE(rig.pre->wait(1, 5s).ok());
  ASSERT_TRUE(rig.pre->forget(1).ok());
  ASSERT_TRUE(rig.dec->forget(1).ok());
  EXPECT_EQ(rig.pre->staging_blocks_free(), 6u);
  EXPECT_EQ(rig.dec->staging_blocks_free(), 6u);
  // The freed staging blocks carry the next transfer, byte-exact.
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 2, {0, 2, 4}).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 2, PdMode::kPull, {1, 3, 5}).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(2, l).ok());
  auto fin = rig.dec->wait(2, 5s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 3u);
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::uint64_t i = 0; i < 3; ++i) EXPECT_TRUE(matches(rig.dec_mem.space, 1 + 2 * i, l, 2 * i));
}

// An engine that queues the first half of a copy into device memory, then refuses the rest, as a real one can part
// way through (a descriptor slot that could not grow, one DMA of several refused): what it queued still writes the
// destinations after copy() has returned the error.
class QueuesHalfThenFails final : public CopyEngine {
 public:
  explicit QueuesHalfThenFails(CopyEngine& inner) : inner_(inner) {}
  Status validate(const CopyRequest& r) const override { return inner_.validate(r); }
  Result<CopyReport> copy(const CopyRequest& r, Stream& stream) override {
    if (r.dst == nullptr || r.dst->kind() != MemoryKind::kDevice) return inner_.copy(r, stream);
    CopyRequest half = r;
    half.src_blocks = r.src_blocks.first(r.src_blocks.size() / 2);
    half.dst_blocks = r.dst_blocks.first(r.dst_blocks.size() / 2);
    auto queued = inner_.copy(half, stream);
    if (!queued.ok()) return queued.status();
    ++refused_;
    return Internal(fmt::format("queued {} of {} blocks, then refused the rest (test)", half.src_blocks.size(),
                                r.src_blocks.size()));
  }
  Result<PreparedCopy> prepare(const CopyRequest& r) const override { return inner_.prepare(r); }
  Result<CopyReport> copy(const PreparedCopy& p, std::span<const std::uint32_t> layers, Stream& stream,
                          std::uint64_t* checksums, std::uint64_t* landed) override {
    return inner_.copy(p, layers, stream, checksums, landed);
  }
  CopyStrategy choose(const CopyRequest& r) const override { return inner_.choose(r); }
  Result<CopyReport> checksum(const BlockSpace& space, std::span<const BlockId> blocks,
                              std::span<const std::uint32_t> layers, RoleMask roles, std::uint64_t* out,
                              Stream& stream) override {
    return inner_.checksum(space, blocks, layers, roles, out, stream);
  }
  Status forget_stream(Stream& stream) override { return inner_.forget_stream(stream); }
  const CopyEngineOptions& options() const noexcept override { return inner_.options(); }
  Device& device() const noexcept override { return inner_.device(); }
  int refused() const { return refused_.load(); }

 private:
  CopyEngine& inner_;
  std::atomic<int> refused_{0};
};

// A decode's staging copy that fails part way through being queued: the layer is failed, but only once what was
// queued has landed, so the engine never gets back blocks a queued copy still writes. Every operation of the host
// device takes 150 ms here, so a layer failed at once would find the queued half still poisoned.
TEST(PdStaged, ACopyRefusedPartWayThroughQueueingFailsItsLayerOnlyOnceTheQueuedPartLanded) {
  HostDeviceOptions slow;
  slow.min_delay = slow.max_delay = std::chrono::milliseconds(150);
  auto dev = HostDevice::create(slow).value();
  auto engine = CopyEngine::create(*dev).value();
  QueuesHalfThenFails failing(*engine);
  const KvLayout layout = pd_layout();
  DevBlocks pre_mem = DevBlocks::make(*dev, layout, true);
  DevBlocks dec_mem = DevBlocks::make(*dev, layout, false);
  StagingSpace pre_st = StagingSpace::allocate(*dev, layout, 6).value();
  StagingSpace dec_st = StagingSpace::allocate(*dev, layout, 6).value();
  const int n = ++g_seq;
  auto pre_t = create_loopback_transport({fmt::format("hpre{}", n), layout.fingerprint(), 1, 0}).value();
  auto dec_t = create_loopback_transport({fmt::format("hdec{}", n), layout.fingerprint(), 1, 0}).value();
  auto pre = PdStagedPrefill::create(*pre_t, *dev, *engine, pre_mem.space, pre_st.space).value();
  auto dec = PdStagedDecode::create(*dec_t, *dev, failing, dec_mem.space, dec_st.space).value();
  const PeerId to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
  const PeerId to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();

  ASSERT_TRUE(pre->begin(to_dec, 9, kSrc).ok());
  ASSERT_TRUE(dec->start(to_pre, 9, PdMode::kPush, kDst).ok());
  ASSERT_TRUE(pre->layer_ready(9, 0).ok());
  auto ls = dec->wait_layer(9, 0, 30s);
  ASSERT_TRUE(ls.ok()) << ls.status().to_string();
  EXPECT_EQ(*ls, LayerState::kFailed);
  EXPECT_EQ(failing.refused(), 1);
  // By the time the layer reads failed, the half that was queued has landed whole; the other half was never
  // written (its destinations keep their poison) and nothing of the layer is reported loaded.
  const std::size_t queued = kDst.size() / 2;
  for (std::size_t i = 0; i < queued; ++i) EXPECT_TRUE(matches(dec_mem.space, kDst[i], 0, kSrc[i])) << i;
  for (std::size_t i = queued; i < kDst.size(); ++i)
    EXPECT_EQ(dec_mem.space.block_ptr(0, 0, kDst[i])[0], std::byte{0xee}) << i;
  auto st = dec->status(9);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->layers[0], LayerState::kFailed);
  EXPECT_NE(st->error.message().find("queued 2 of 4 blocks"), std::string::npos) << st->error.to_string();
  EXPECT_EQ(st->leading_loaded_blocks(), 0u);
  ASSERT_TRUE(dec->cancel(9).ok());
  pre.reset();
  dec.reset();
}

TEST(PdStaged, BadInputIsRefused) {
  Rig rig;
  EXPECT_EQ(rig.pre->begin(rig.to_dec, 3, {}).code(), StatusCode::kInvalidArgument);
  Status s = rig.pre->begin(rig.to_dec, 3, {1, 8});
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("block id 8 >= num_blocks 8"), std::string::npos) << s.to_string();
  EXPECT_EQ(rig.dec->start(rig.to_pre, 3, PdMode::kPush, {1, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.dec->staging_blocks_free(), 6u);  // a refused start takes no staging block
  EXPECT_EQ(rig.dec->wait_layer(99, 0, 1ms).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(rig.dec->layer_event(99, 0, 1ms).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(rig.pre->layer_ready(99, 0).code(), StatusCode::kNotFound);

  auto t = create_loopback_transport({"sbad", rig.layout.fingerprint(), 1, 0}).value();
  // Staging that is not pinned host memory.
  auto r1 = PdStagedDecode::create(*t, *rig.dev, *rig.engine, rig.dec_mem.space, rig.pre_mem.space);
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r1.status().message().find("must be pinned host"), std::string::npos) << r1.status().to_string();
  // Staging of another layout.
  auto other = StagingSpace::allocate(*rig.dev, pd_layout(4, 4096), 4).value();
  auto r2 = PdStagedPrefill::create(*t, *rig.dev, *rig.engine, rig.pre_mem.space, other.space);
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r2.status().message().find(fmt::format("{:#018x}", other.space.layout().fingerprint())), std::string::npos)
      << r2.status().to_string();
  EXPECT_EQ(StagingSpace::allocate(*rig.dev, rig.layout, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::transport
