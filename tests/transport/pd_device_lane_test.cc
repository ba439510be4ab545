// The prefill/decode device lane (pd.h, "Device lane") on the host backend: loopback transports in one process
// hand out each other's pools (Transport::peer_region_address), the host copy engine runs the SM kernel's exact
// work decomposition with its checksums. Push and pull, with either side making the second checksum pass
// (PdOptions::lane_verify), byte-exact layer by layer; bytes damaged between the kernel and the verification
// caught in every combination; a failed kernel never reported loaded; a prefill on the
// other lane refused; blocks of a failed push kept until the prefill's writes are proven over. The ring lane
// (pd.h, "Ring lane") likewise: layers in more pieces than the ring has slots, byte-exact; bytes damaged in a slot
// caught; a failed copy failing its layer; slots of pieces that never came kept out of the ring until the prefill
// is quiet or gone.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "kvtier/copy/copy_engine.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transport/pd.h"
#include "transport/pd_test_util.h"

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;
using testing::as_device;
using testing::HostBlocks;
using testing::layer_matches;
using testing::pd_layout;

int g_seq = 0;

// Runs `hook` on every notification before the endpoint sees it (a hook may change it).
class Watching final : public testing::ForwardingTransport {
 public:
  using Hook = std::function<void(Notification&)>;
  Watching(std::unique_ptr<Transport> inner, Hook hook)
      : ForwardingTransport(std::move(inner)), hook_(std::move(hook)) {}
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    auto got = inner().wait_notifications(timeout);
    if (got.ok() && hook_)
      for (Notification& n : *got) hook_(n);
    return got;
  }

 private:
  Hook hook_;
};

std::uint32_t layer_of(const Notification& n) {
  std::uint32_t l = 0;
  if (n.message.size() >= 13) std::memcpy(&l, n.message.data() + 9, 4);
  return l;
}

// Both sides' pools (the prefill's filled with the pattern, the decode's poisoned) and the host copy engine.
struct LaneMemory {
  KvLayout layout = pd_layout();
  HostBlocks pre_mem = HostBlocks::make(layout, 8, true);
  HostBlocks dec_mem = HostBlocks::make(layout, 8, false);
  std::unique_ptr<HostDevice> device = HostDevice::create().value();
  std::unique_ptr<CopyEngine> engine = CopyEngine::create(*device).value();
};

struct LaneRig : LaneMemory {
  std::unique_ptr<Transport> pre_t, dec_t;
  testing::Mutable* pre_mute = nullptr;  // pre_t, to make the prefill fall silent
  std::unique_ptr<PdPrefill> pre;
  std::unique_ptr<PdDecode> dec;
  PeerId to_dec = 0, to_pre = 0;

  explicit LaneRig(Watching::Hook on_decode = {}, bool prefill_lane = true, PdOptions opt = {}) {
    const int n = ++g_seq;
    auto mutable_pre = std::make_unique<testing::Mutable>(
        create_loopback_transport({fmt::format("lane-pre{}", n), layout.fingerprint(), 1, 0}).value());
    pre_mute = mutable_pre.get();
    pre_t = std::move(mutable_pre);
    dec_t = std::make_unique<Watching>(
        create_loopback_transport({fmt::format("lane-dec{}", n), layout.fingerprint(), 1, 0}).value(),
        std::move(on_decode));
    PdOptions pre_opt = opt, dec_opt = opt;
    pre_opt.engine = prefill_lane ? engine.get() : nullptr;
    dec_opt.engine = engine.get();
    auto p = PdPrefill::create(*pre_t, prefill_lane ? as_device(pre_mem.space) : pre_mem.space, pre_opt);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    pre = std::move(p).value();
    auto d = PdDecode::create(*dec_t, as_device(dec_mem.space), dec_opt);
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    dec = std::move(d).value();
    to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
    to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
  }
  ~LaneRig() {
    pre.reset();
    dec.reset();
  }
};

const std::vector<BlockId> kSrc = {3, 1, 7, 5};
const std::vector<BlockId> kDst = {0, 2, 6, 4};

struct LaneCase {
  PdMode mode;
  PdOptions::LaneVerify verify;
  bool read_back_in_copy = true;  // PdOptions::lane_read_back_in_copy (both sides)
};

class LaneModes : public ::testing::TestWithParam<LaneCase> {
 protected:
  static PdOptions options() {
    PdOptions o;
    o.lane_verify = GetParam().verify;
    o.lane_read_back_in_copy = GetParam().read_back_in_copy;
    return o;
  }
  static PdMode mode() { return GetParam().mode; }
  static bool mover_verifies() { return GetParam().verify == PdOptions::LaneVerify::kMover; }
};

TEST_P(LaneModes, LayersMoveByteExactThroughTheKernelLayerByLayer) {
  LaneRig rig({}, true, options());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 42, kSrc).ok());
  ASSERT_TRUE(rig.pre->layer_ready(42, 2).ok());  // ready before the request
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 42, mode(), kDst).ok());
  auto st = rig.dec->wait_layer(42, 2, 5s);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(*st, LayerState::kLoaded);
  for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], 2, kSrc[i]));
  EXPECT_EQ(rig.dec->status(42)->layers[0], LayerState::kPending);
  for (std::size_t i = 0; i < kDst.size(); ++i)
    EXPECT_FALSE(layer_matches(rig.dec_mem.space, kDst[i], 0, kSrc[i])) << "layer 0 was never declared ready";
  for (std::uint32_t l : {0u, 1u, 3u}) {
    ASSERT_TRUE(rig.pre->layer_ready(42, l).ok());
    auto ls = rig.dec->wait_layer(42, l, 5s);
    ASSERT_TRUE(ls.ok());
    EXPECT_EQ(*ls, LayerState::kLoaded) << l;
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  }
  auto fin = rig.dec->wait(42, 5s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u);
  EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
  for (std::uint64_t untouched : {1u, 3u, 5u, 7u})
    for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(rig.dec_mem.space.block_ptr(l, 1, untouched)[17], std::byte{0xee});
  auto pf = rig.pre->wait(42, 5s);
  ASSERT_TRUE(pf.ok()) << pf.status().to_string();
  EXPECT_TRUE(pf->done);
  EXPECT_TRUE(rig.pre->forget(42).ok());
  EXPECT_TRUE(rig.dec->forget(42).ok());
}

// The progress threads sleep their idle period (here far longer than the deadlines) while no transfer needs them.
// The decode's request reaches the prefill before begin() and is parked there, and its thread goes back to sleep;
// begin() and layer_ready() then launch the copies from this thread. Their completion must not wait out the idle
// period (it did: the launching call did not wake the thread that polls the copies' events, which one transfer
// at a time cost up to a millisecond per transfer at the default period).
TEST_P(LaneModes, CallsThatGiveTheProgressThreadWorkWakeItFromItsIdleSleep) {
  PdOptions o = options();
  o.heartbeat = 20s;  // no heartbeat wakes anyone during the test
  o.lease = 60s;
  o.idle_wait = 20s;
  LaneRig rig({}, true, o);
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 9, mode(), kDst).ok());
  std::this_thread::sleep_for(100ms);  // the request arrives, is parked, and the prefill's thread sleeps again
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 9, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(9, l).ok());
  auto fin = rig.dec->wait(9, 5s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->leading_loaded_blocks(), kDst.size());
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  auto pf = rig.pre->wait(9, 5s);
  ASSERT_TRUE(pf.ok()) << pf.status().to_string();
  EXPECT_TRUE(pf->done);
  EXPECT_TRUE(rig.pre->forget(9).ok());
  EXPECT_TRUE(rig.dec->forget(9).ok());
}

// The receiving side verifies. Push: a byte of a destination block damaged after the prefill's kernel wrote it
// (before the decode's verification pass). Pull: a byte of a source block damaged after the prefill checksummed
// it (before the decode's kernel reads it). Either way that block of that layer fails; the others load.
TEST_P(LaneModes, BytesDamagedBetweenKernelAndVerificationAreCaught) {
  if (mover_verifies()) GTEST_SKIP() << "the receiving side's pass: BytesDamagedBetweenCopyAndReadBackAreCaught";
  const PdMode mode = GetParam().mode;
  HostBlocks* pre_mem = nullptr;
  HostBlocks* dec_mem = nullptr;
  std::atomic<bool> damaged{false};
  LaneRig rig(
      [&](const Notification& n) {
        const char want = mode == PdMode::kPush ? 'W' : 'A';
        if (n.message.empty() || n.message[0] != want || layer_of(n) != 1 || damaged.exchange(true)) return;
        if (mode == PdMode::kPush)
          dec_mem->space.block_ptr(1, 1, kDst[2])[100] ^= std::byte{0x01};
        else
          pre_mem->space.block_ptr(1, 0, kSrc[2])[4000] ^= std::byte{0x80};
      },
      true, options());
  pre_mem = &rig.pre_mem;
  dec_mem = &rig.dec_mem;
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 9, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(9, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 9, mode, kDst).ok());
  auto fin = rig.dec->wait(9, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_TRUE(damaged.load());
  EXPECT_EQ(fin->layers[1], LayerState::kPartial);
  for (std::uint32_t l : {0u, 2u, 3u}) EXPECT_EQ(fin->layers[l], LayerState::kLoaded) << l;
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(fin->leading_loaded_blocks(), 2u);
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(fin->error.message().find("layer 1 block 6 (position 2): checksum mismatch"), std::string::npos)
      << fin->error.to_string();
}

// The moving side verifies: a byte of a destination block damaged after the moving kernel wrote it and before
// its read-back fails that block of that layer; the others load. The damage is done on the device's own worker
// thread just before the read-back's first operation, so it is ordered after the copy and before the read-back:
// with a separate pass, the zeroing of its checksums (the layer's second checksum-sized operation, after the
// copy's zeroing); inside the copy, the host backend's read-back task (the third: both lists are zeroed before
// the copy).
TEST_P(LaneModes, BytesDamagedBetweenCopyAndReadBackAreCaught) {
  if (!mover_verifies())
    GTEST_SKIP() << "the moving side's read-back: BytesDamagedBetweenKernelAndVerificationAreCaught";
  LaneRig rig({}, true, options());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 5, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 5, mode(), kDst).ok());
  ASSERT_TRUE(rig.pre->layer_ready(5, 0).ok());
  ASSERT_EQ(rig.dec->wait_layer(5, 0, 5s).value(), LayerState::kLoaded);
  std::atomic<int> checksum_memsets{0};
  std::atomic<bool> damaged{false};
  rig.device->set_failure_predicate([&](std::uint64_t, const void*, std::uint64_t bytes) {
    const int read_back_op = GetParam().read_back_in_copy ? 3 : 2;
    if (bytes == kDst.size() * sizeof(std::uint64_t) && checksum_memsets.fetch_add(1) + 1 == read_back_op) {
      rig.dec_mem.space.block_ptr(1, 1, kDst[2])[100] ^= std::byte{0x01};
      damaged = true;
    }
    return false;  // nothing fails: the bytes are silently wrong
  });
  ASSERT_TRUE(rig.pre->layer_ready(5, 1).ok());
  auto l1 = rig.dec->wait_layer(5, 1, 5s);
  rig.device->set_failure_predicate(nullptr);
  ASSERT_TRUE(l1.ok()) << l1.status().to_string();
  EXPECT_TRUE(damaged.load());
  EXPECT_EQ(*l1, LayerState::kPartial);
  for (std::uint32_t l : {2u, 3u}) ASSERT_TRUE(rig.pre->layer_ready(5, l).ok());
  auto fin = rig.dec->wait(5, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  for (std::uint32_t l : {0u, 2u, 3u}) EXPECT_EQ(fin->layers[l], LayerState::kLoaded) << l;
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(fin->error.message().find("layer 1 block 6 (position 2): checksum mismatch"), std::string::npos)
      << fin->error.to_string();
}

// Layers that are ready when the moving side starts go as one copy (each launch costs the CPU about what a large
// layer of small blocks costs the GPU): push, every layer declared before the decode's request arrives. One copy
// zeroes its two checksum lists once (two list-sized operations before the read-back, against eight layer by
// layer); every layer lands byte-exact.
TEST(PdDeviceLane, LayersReadyTogetherMoveAsOneCopy) {
  LaneRig rig;
  std::atomic<int> list_ops{0};
  rig.device->set_failure_predicate([&](std::uint64_t, const void*, std::uint64_t bytes) {
    if (bytes == kDst.size() * sizeof(std::uint64_t)) list_ops.fetch_add(1);
    return false;
  });
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 3, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(3, l).ok());  // before the request
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 3, PdMode::kPush, kDst).ok());
  auto fin = rig.dec->wait(3, 5s, true);
  rig.device->set_failure_predicate(nullptr);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
  EXPECT_EQ(fin->leading_loaded_blocks(), kDst.size());
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  EXPECT_EQ(list_ops.load(), 3) << "two lists zeroed and one read-back for the whole transfer";
  ASSERT_TRUE(rig.pre->wait(3, 5s).ok());
}

// The same when the request came first and the prefill then declares every layer in one call (layers_ready), as a
// prefill whose forward has finished does; layer_ready called layer by layer launches each alone.
TEST(PdDeviceLane, LayersDeclaredInOneCallAfterTheRequestMoveAsOneCopy) {
  for (const bool one_call : {true, false}) {
    SCOPED_TRACE(one_call ? "layers_ready" : "layer_ready x 4");
    LaneRig rig;
    std::atomic<int> list_ops{0};
    rig.device->set_failure_predicate([&](std::uint64_t, const void*, std::uint64_t bytes) {
      if (bytes == kDst.size() * sizeof(std::uint64_t)) list_ops.fetch_add(1);
      return false;
    });
    ASSERT_TRUE(rig.dec->start(rig.to_pre, 6, PdMode::kPush, kDst).ok());
    ASSERT_TRUE(rig.pre->begin(rig.to_dec, 6, kSrc).ok());
    std::this_thread::sleep_for(50ms);  // the request reaches the prefill (before or after begin: applied either way)
    if (one_call) {
      const std::uint32_t all[] = {0, 1, 2, 3};
      ASSERT_TRUE(rig.pre->layers_ready(6, all).ok());
    } else {
      for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(6, l).ok());
    }
    auto fin = rig.dec->wait(6, 5s, true);
    rig.device->set_failure_predicate(nullptr);
    ASSERT_TRUE(fin.ok()) << fin.status().to_string();
    EXPECT_EQ(fin->leading_loaded_blocks(), kDst.size());
    for (std::uint32_t l = 0; l < 4; ++l)
      for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
    EXPECT_EQ(list_ops.load(), one_call ? 3 : 12);
    ASSERT_TRUE(rig.pre->wait(6, 5s).ok());
  }
}

// Holds back the announcements ('A') a decode side receives until `want` of them have come, then hands them over
// in one batch: the pull side's grouping made deterministic.
class BatchingAnnouncements final : public testing::ForwardingTransport {
 public:
  BatchingAnnouncements(std::unique_ptr<Transport> inner, std::size_t want)
      : ForwardingTransport(std::move(inner)), want_(want) {}
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    auto got = inner().wait_notifications(timeout);
    if (!got.ok()) return got;
    std::vector<Notification> out;
    for (Notification& n : *got) (n.message.rfind("A", 0) == 0 ? held_ : out).push_back(std::move(n));
    if (held_.size() >= want_) {
      for (Notification& n : held_) out.push_back(std::move(n));
      held_.clear();
    }
    return out;
  }

 private:
  std::size_t want_;
  std::vector<Notification> held_;  // only the progress thread calls wait_notifications
};

// Pull: the layers announced in one batch go as one copy on the decode side; a byte damaged between that copy and
// its read-back fails that block in every layer of the batch, the other blocks load.
TEST(PdDeviceLane, LayersAnnouncedInOneBatchArePulledAsOneCopy) {
  for (const bool damage : {false, true}) {
    SCOPED_TRACE(damage ? "a byte damaged before the read-back" : "byte-exact");
    LaneMemory mem;
    const int n = ++g_seq;
    auto pre_t = create_loopback_transport({fmt::format("batch-pre{}", n), mem.layout.fingerprint(), 1, 0}).value();
    auto dec_t = std::make_unique<BatchingAnnouncements>(
        create_loopback_transport({fmt::format("batch-dec{}", n), mem.layout.fingerprint(), 1, 0}).value(), 4);
    PdOptions o;
    o.engine = mem.engine.get();
    auto pre = PdPrefill::create(*pre_t, as_device(mem.pre_mem.space), o).value();
    auto dec = PdDecode::create(*dec_t, as_device(mem.dec_mem.space), o).value();
    const PeerId to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
    const PeerId to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
    std::atomic<int> list_ops{0};
    mem.device->set_failure_predicate([&](std::uint64_t, const void*, std::uint64_t bytes) {
      // The third list-sized operation is the read-back (after the two lists are zeroed).
      if (bytes == kDst.size() * sizeof(std::uint64_t) && list_ops.fetch_add(1) + 1 == 3 && damage)
        mem.dec_mem.space.block_ptr(2, 1, kDst[1])[7] ^= std::byte{0x10};
      return false;
    });
    ASSERT_TRUE(dec->start(to_pre, 8, PdMode::kPull, kDst).ok());
    ASSERT_TRUE(pre->begin(to_dec, 8, kSrc).ok());
    for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(pre->layer_ready(8, l).ok());  // four 'A's, one batch
    auto fin = dec->wait(8, 5s, true);
    mem.device->set_failure_predicate(nullptr);
    ASSERT_TRUE(fin.ok()) << fin.status().to_string();
    EXPECT_EQ(list_ops.load(), 3) << "two lists zeroed and one read-back for the four layers";
    if (!damage) {
      EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
      EXPECT_EQ(fin->leading_loaded_blocks(), kDst.size());
      for (std::uint32_t l = 0; l < 4; ++l)
        for (std::size_t i = 0; i < kDst.size(); ++i)
          EXPECT_TRUE(layer_matches(mem.dec_mem.space, kDst[i], l, kSrc[i]));
    } else {
      for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(fin->layers[l], LayerState::kPartial) << l;
      EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, false, true, true}));
      EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss);
      EXPECT_NE(fin->error.message().find("block 2 (position 1): checksum mismatch"), std::string::npos)
          << fin->error.to_string();
    }
    ASSERT_TRUE(pre->wait(8, 5s).ok());
    dec.reset();
    pre.reset();
  }
}

// A byte damaged between a grouped copy and its read-back: the damaged block fails in every layer of the group (its
// checksum is its sum over the group's planes, so the layer cannot be told), the other blocks load, and the error
// names the block.
TEST(PdDeviceLane, ADamagedByteInAGroupedCopyFailsThatBlockInEveryLayerOfTheGroup) {
  LaneRig rig;
  std::atomic<int> list_ops{0};
  std::atomic<bool> damaged{false};
  rig.device->set_failure_predicate([&](std::uint64_t, const void*, std::uint64_t bytes) {
    // The third list-sized operation is the read-back (after the two lists are zeroed): damage just before it.
    if (bytes == kDst.size() * sizeof(std::uint64_t) && list_ops.fetch_add(1) + 1 == 3) {
      rig.dec_mem.space.block_ptr(1, 1, kDst[2])[100] ^= std::byte{0x01};
      damaged = true;
    }
    return false;
  });
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 4, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(4, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 4, PdMode::kPush, kDst).ok());
  auto fin = rig.dec->wait(4, 5s, true);
  rig.device->set_failure_predicate(nullptr);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_TRUE(damaged.load());
  for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(fin->layers[l], LayerState::kPartial) << l;
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(fin->leading_loaded_blocks(), 2u);
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(fin->error.message().find("block 6 (position 2): checksum mismatch"), std::string::npos)
      << fin->error.to_string();
}

// Push with the prefill verifying: when its read-back matched every block, 'W' carries only the count of blocks it
// verified. A count that is not the transfer's (a prefill that verified fewer blocks, or a damaged message), or
// none at all, fails that layer; the others load.
TEST_P(LaneModes, AWriteNotificationWithAWrongOrMissingCountFailsItsLayer) {
  if (mode() != PdMode::kPush || !mover_verifies())
    GTEST_SKIP() << "the count travels in push when the prefill verifies";
  for (const bool truncate : {false, true}) {
    SCOPED_TRACE(truncate ? "count missing" : "count one short");
    std::atomic<int> edited{0};
    LaneRig rig(
        [&](Notification& n) {
          if (n.message.size() < 13 + 12 || n.message[0] != 'W' || layer_of(n) != 1) return;
          const std::size_t at = n.message.size() - 4;  // the count is the message's last field
          if (truncate) {
            n.message.resize(at);
          } else {
            std::uint32_t count = 0;
            std::memcpy(&count, n.message.data() + at, 4);
            --count;
            std::memcpy(n.message.data() + at, &count, 4);
          }
          ++edited;
        },
        true, options());
    ASSERT_TRUE(rig.pre->begin(rig.to_dec, 13, kSrc).ok());
    ASSERT_TRUE(rig.dec->start(rig.to_pre, 13, mode(), kDst).ok());
    for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(13, l).ok());
    auto fin = rig.dec->wait(13, 5s);
    ASSERT_TRUE(fin.ok()) << fin.status().to_string();
    EXPECT_EQ(edited.load(), 1);
    EXPECT_EQ(fin->layers[1], LayerState::kFailed);
    for (std::uint32_t l : {0u, 2u, 3u}) EXPECT_EQ(fin->layers[l], LayerState::kLoaded) << l;
    EXPECT_EQ(fin->block_loaded, (std::vector<bool>{false, false, false, false}));
    EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss) << fin->error.to_string();
    if (!truncate) {
      EXPECT_NE(fin->error.message().find("the prefill verified 3 blocks of 4"), std::string::npos)
          << fin->error.to_string();
    }
  }
}

// A kernel that fails (the device reports the launch's operation failed): its layer is failed, never loaded.
TEST_P(LaneModes, AFailedKernelFailsItsLayer) {
  LaneRig rig({}, true, options());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 11, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 11, mode(), kDst).ok());
  ASSERT_TRUE(rig.pre->layer_ready(11, 0).ok());
  ASSERT_EQ(rig.dec->wait_layer(11, 0, 5s).value(), LayerState::kLoaded);
  // The next operation on the host backend fails: in push the prefill's write kernel of layer 1, in pull the
  // prefill's checksum pass (the receiving side verifies) or the decode's copy (the moving side verifies). Either
  // way the decode side fails the layer (after the prefill's 'X', or from its own kernel's event).
  rig.device->fail_nth_operation(1);
  ASSERT_TRUE(rig.pre->layer_ready(11, 1).ok());
  auto l1 = rig.dec->wait_layer(11, 1, 5s);
  ASSERT_TRUE(l1.ok()) << l1.status().to_string();
  EXPECT_EQ(*l1, LayerState::kFailed);
  auto st = rig.dec->status(11).value();
  EXPECT_EQ(st.block_loaded, (std::vector<bool>{false, false, false, false}));
}

INSTANTIATE_TEST_SUITE_P(Modes, LaneModes,
                         ::testing::Values(LaneCase{PdMode::kPush, PdOptions::LaneVerify::kMover},
                                           LaneCase{PdMode::kPull, PdOptions::LaneVerify::kMover},
                                           LaneCase{PdMode::kPush, PdOptions::LaneVerify::kMover, false},
                                           LaneCase{PdMode::kPull, PdOptions::LaneVerify::kMover, false},
                                           LaneCase{PdMode::kPush, PdOptions::LaneVerify::kReceiver},
                                           LaneCase{PdMode::kPull, PdOptions::LaneVerify::kReceiver}),
                         [](const auto& info) {
                           const bool pass =
                               info.param.verify == PdOptions::LaneVerify::kMover && !info.param.read_back_in_copy;
                           return fmt::format("{}_{}_verifies{}", pd_mode_name(info.param.mode),
                                              lane_verify_name(info.param.verify), pass ? "_in_a_pass" : "");
                         });

TEST(PdDeviceLane, LaneVerifyNamesParseBackAndUnknownOnesAreRefusedByName) {
  for (auto v : {PdOptions::LaneVerify::kMover, PdOptions::LaneVerify::kReceiver}) {
    auto parsed = parse_lane_verify(lane_verify_name(v));
    ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
    EXPECT_EQ(*parsed, v);
  }
  auto bad = parse_lane_verify("both");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'both'"), std::string::npos) << bad.status().to_string();
}

TEST(PdDeviceLane, APrefillOnTheTransportLaneIsRefused) {
  LaneRig rig({}, /*prefill_lane=*/false);
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 3, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(3, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 3, PdMode::kPush, kDst).ok());
  auto fin = rig.dec->wait(3, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->leading_loaded_blocks(), 0u);
  for (LayerState s : fin->layers) EXPECT_EQ(s, LayerState::kFailed);
  auto pf = rig.pre->wait(3, 5s);
  ASSERT_TRUE(pf.ok());
  EXPECT_EQ(pf->error.code(), StatusCode::kFailedPrecondition) << pf->error.to_string();
  EXPECT_NE(pf->error.message().find("device lane"), std::string::npos) << pf->error.to_string();
  for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_FALSE(layer_matches(rig.dec_mem.space, kDst[i], 0, kSrc[i]));
}

TEST(PdDeviceLane, HostMemoryIsRefusedAtCreation) {
  const KvLayout layout = pd_layout();
  HostBlocks mem = HostBlocks::make(layout, 8, false);
  auto device = HostDevice::create().value();
  auto engine = CopyEngine::create(*device).value();
  auto t = create_loopback_transport({fmt::format("lane-host{}", ++g_seq), layout.fingerprint(), 1, 0}).value();
  PdOptions opt;
  opt.engine = engine.get();
  auto d = PdDecode::create(*t, mem.space, opt);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("device memory"), std::string::npos) << d.status().to_string();
}

// After a failed push the prefill may still hold the decode's pool mapped: a silent prefill's blocks are not
// reclaimable while it lives, even once the decode side gave up on it; they are once the prefill's transport
// (with its mapping) is gone.
// A failed device operation fails its transfer's untold layers at once (not at the lease, which would also
// disconnect the peer), and the lane's stream, failed for good, is replaced: the next transfer loads.
class LaneFailures : public ::testing::TestWithParam<PdMode> {};

TEST_P(LaneFailures, AFailedCopyEndsTheTransferAtOnceAndTheNextOneLoads) {
  LaneRig rig({}, true, PdOptions{20ms, 2s});
  rig.device->fail_nth_operation(1);
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 1, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 1, GetParam(), kDst).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(rig.pre->layer_ready(1, 0).ok());
  std::this_thread::sleep_for(50ms);
  for (std::uint32_t l = 1; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(1, l).ok());
  auto fin = rig.dec->wait(1, 1500ms);
  ASSERT_TRUE(fin.ok()) << "not final before the lease: " << fin.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_FALSE(fin->error.ok());
  EXPECT_LT(fin->leading_loaded_blocks(), 4u);
  ASSERT_TRUE(rig.dec->wait(1, 5s, true).ok());
  ASSERT_TRUE(rig.pre->wait(1, 5s).ok());
  ASSERT_TRUE(rig.dec->forget(1).ok());
  ASSERT_TRUE(rig.pre->forget(1).ok());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 2, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 2, GetParam(), kDst).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(2, l).ok());
  auto next = rig.dec->wait(2, 5s, true);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  EXPECT_TRUE(next->error.ok()) << next->error.to_string();
  EXPECT_EQ(next->leading_loaded_blocks(), 4u);
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  EXPECT_FALSE(rig.dec_t->peer_revoked(rig.to_pre));
}

INSTANTIATE_TEST_SUITE_P(Modes, LaneFailures, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(pd_mode_name(info.param)); });

TEST(PdDeviceLane, AFailedPushKeepsTheBlocksWhileThePrefillCanStillWrite) {
  PdOptions opt{20ms, 150ms};
  LaneRig rig({}, true, opt);
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 5, kSrc).ok());
  ASSERT_TRUE(rig.pre->layer_ready(5, 0).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 5, PdMode::kPush, kDst).ok());
  ASSERT_EQ(rig.dec->wait_layer(5, 0, 5s).value(), LayerState::kLoaded);
  // The prefill falls silent without proving its writes over (a paused process): muted, its endpoint stops
  // (what its close says reaches nobody), its transport (and the mapping of the decode's pool it was handed) lives on.
  rig.pre_mute->mute();
  rig.pre.reset();
  auto fin = rig.dec->wait(5, 5s);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->error.code(), StatusCode::kUnavailable);
  auto held = rig.dec->wait(5, 400ms, true);
  EXPECT_EQ(held.status().code(), StatusCode::kTimedOut) << "reclaimable while the prefill can still write";
  EXPECT_EQ(rig.dec->forget(5).code(), StatusCode::kFailedPrecondition);
  rig.pre_t.reset();  // the prefill's transport is gone: nothing can write any more
  auto rec = rig.dec->wait(5, 5s, true);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string();
  EXPECT_TRUE(rec->reclaimable);
  EXPECT_TRUE(rig.dec->forget(5).ok());
}

// ---- ring lane ----------------------------------------------------------------------------------------------

// Two slots of two blocks of a layer (both roles): the 4-block transfers below go as 2 pieces per layer, 8 pieces
// per transfer through 2 slots.
PdOptions ring_options(PdOptions o = {}, CopyStrategy how = CopyStrategy::kAuto) {
  o.ring_slots = 2;
  o.ring_slot_bytes = 2 * 2 * 8192;
  o.ring_copy = how;
  return o;
}

// Where the decode's ring lies (the loopback hands out the decode's memory to the prefill).
std::byte* ring_base(LaneRig& rig) {
  return static_cast<std::byte*>(rig.pre_t->peer_region_address(rig.to_dec, rig.layout.num_planes()).value());
}

// Push and pull, each with the checksums in the SM kernel's copy and with the engine's own copy plus a checksum
// pass over the device side.
class RingModes : public ::testing::TestWithParam<std::tuple<PdMode, CopyStrategy>> {
 protected:
  static PdMode mode() { return std::get<0>(GetParam()); }
  static PdOptions options(PdOptions o = {}) { return ring_options(o, std::get<1>(GetParam())); }
};

TEST_P(RingModes, LayersMoveByteExactInMorePiecesThanSlots) {
  LaneRig rig({}, true, options());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 42, kSrc).ok());
  ASSERT_TRUE(rig.pre->layer_ready(42, 2).ok());  // ready before the request, and out of order
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 42, mode(), kDst).ok());
  // Layer 0 is not ready: its pieces hold no slot, so layer 2 moves through both while layer 0 waits.
  EXPECT_EQ(rig.dec->wait_layer(42, 2, 5s).value(), LayerState::kLoaded);
  EXPECT_EQ(rig.dec->wait_layer(42, 0, 50ms).status().code(), StatusCode::kTimedOut);
  for (std::uint32_t l : {0u, 1u, 3u}) ASSERT_TRUE(rig.pre->layer_ready(42, l).ok());
  for (std::uint32_t l = 0; l < 4; ++l) {
    auto ls = rig.dec->wait_layer(42, l, 5s);
    ASSERT_TRUE(ls.ok()) << ls.status().to_string();
    EXPECT_EQ(*ls, LayerState::kLoaded) << l;
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  }
  auto fin = rig.dec->wait(42, 5s, true);
  ASSERT_TRUE(fin.ok());
  EXPECT_EQ(fin->leading_loaded_blocks(), 4u);
  EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
  for (std::uint64_t untouched : {1u, 3u, 5u, 7u})
    for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(rig.dec_mem.space.block_ptr(l, 1, untouched)[17], std::byte{0xee});
  auto pf = rig.pre->wait(42, 5s);
  ASSERT_TRUE(pf.ok()) << pf.status().to_string();
  EXPECT_TRUE(pf->done);
  EXPECT_EQ(pf->layers_sent, 4u);
  EXPECT_TRUE(rig.pre->forget(42).ok());
  EXPECT_TRUE(rig.dec->forget(42).ok());
  // The slots came back: a second transfer on the same ring.
  const std::vector<BlockId> src2 = {0, 2}, dst2 = {7, 5};
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 43, src2).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(43, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 43, mode(), dst2).ok());
  auto fin2 = rig.dec->wait(43, 5s, true);
  ASSERT_TRUE(fin2.ok()) << fin2.status().to_string();
  EXPECT_EQ(fin2->leading_loaded_blocks(), 2u) << fin2->error.to_string();
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::size_t i = 0; i < dst2.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, dst2[i], l, src2[i]));
}

// A byte of the slot changed after the prefill's kernel filled it and before the decode's kernel read it: that
// block of that layer fails (the two kernels' checksums differ); the others load.
TEST_P(RingModes, BytesDamagedInTheSlotAreCaught) {
  std::byte* ring = nullptr;
  std::atomic<bool> damaged{false};
  LaneRig rig(
      [&](const Notification& n) {
        // 'P' xid layer piece slot: piece 1 of layer 1 holds positions 2 and 3.
        if (n.message.size() < 21 || n.message[0] != 'P' || layer_of(n) != 1) return;
        std::uint32_t piece = 0, slot = 0;
        std::memcpy(&piece, n.message.data() + 13, 4);
        std::memcpy(&slot, n.message.data() + 17, 4);
        if (piece != 1 || damaged.exchange(true)) return;
        // Role 0 of the slot's first block (position 2), well inside it.
        ring[slot * 32768 + 100] ^= std::byte{0x04};
      },
      true, options());
  ring = ring_base(rig);
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 9, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(9, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 9, mode(), kDst).ok());
  auto fin = rig.dec->wait(9, 5s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_TRUE(damaged.load());
  EXPECT_EQ(fin->layers[1], LayerState::kPartial);
  for (std::uint32_t l : {0u, 2u, 3u}) EXPECT_EQ(fin->layers[l], LayerState::kLoaded) << l;
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(fin->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(fin->error.message().find("layer 1 block 6 (position 2): checksum mismatch"), std::string::npos)
      << fin->error.to_string();
  EXPECT_TRUE(fin->reclaimable);
}

// A copy that fails fails its layer (never loaded) and the prefill's transfer; the slots granted to pieces that
// never came return once the prefill is quiet, so the ring carries the next transfer.
TEST_P(RingModes, AFailedCopyFailsItsLayerAndTheRingRecovers) {
  LaneRig rig({}, true, options());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 11, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 11, mode(), kDst).ok());
  ASSERT_TRUE(rig.pre->layer_ready(11, 0).ok());
  ASSERT_EQ(rig.dec->wait_layer(11, 0, 5s).value(), LayerState::kLoaded);
  rig.device->fail_nth_operation(1);  // the prefill's first copy of layer 1
  ASSERT_TRUE(rig.pre->layer_ready(11, 1).ok());
  auto l1 = rig.dec->wait_layer(11, 1, 5s);
  ASSERT_TRUE(l1.ok()) << l1.status().to_string();
  EXPECT_EQ(*l1, LayerState::kFailed);
  auto fin = rig.dec->wait(11, 5s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->block_loaded, (std::vector<bool>{false, false, false, false}));
  EXPECT_FALSE(fin->error.ok());
  ASSERT_TRUE(rig.pre->wait(11, 5s).ok());
  EXPECT_TRUE(rig.pre->forget(11).ok());
  EXPECT_TRUE(rig.dec->forget(11).ok());
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 12, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(rig.pre->layer_ready(12, l).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 12, mode(), kDst).ok());
  auto again = rig.dec->wait(12, 5s, true);
  ASSERT_TRUE(again.ok()) << again.status().to_string() << " (slots lost to the failed transfer?)";
  EXPECT_EQ(again->leading_loaded_blocks(), 4u) << again->error.to_string();
}

INSTANTIATE_TEST_SUITE_P(Modes, RingModes,
                         ::testing::Combine(::testing::Values(PdMode::kPush, PdMode::kPull),
                                            ::testing::Values(CopyStrategy::kSmKernel, CopyStrategy::kAuto)),
                         [](const auto& info) {
                           return fmt::format("{}_{}", pd_mode_name(std::get<0>(info.param)),
                                              copy_strategy_name(std::get<1>(info.param)));
                         });

// A prefill that falls silent holding granted slots: the decode's blocks are reclaimable at once (only its own
// kernels write them), the slots stay out of the ring while that prefill could still write them, and return when
// its transport (with its mapping of the ring) is gone.
TEST(PdRingLane, SlotsOfASilentPrefillReturnOnlyWhenItCanNoLongerWrite) {
  PdOptions opt = ring_options(PdOptions{20ms, 150ms});
  LaneRig rig({}, true, opt);
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 5, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(rig.to_pre, 5, PdMode::kPush, kDst).ok());
  ASSERT_TRUE(rig.pre->layer_ready(5, 0).ok());
  ASSERT_EQ(rig.dec->wait_layer(5, 0, 5s).value(), LayerState::kLoaded);
  // Layer 1 ready: the prefill says so ('Y') and falls silent at once, so the slots the decode grants its pieces
  // are never filled. Then its endpoint stops (silently), its transport alive.
  rig.pre_mute->mute_after([](const std::string& m) { return !m.empty() && m[0] == 'Y'; });
  ASSERT_TRUE(rig.pre->layer_ready(5, 1).ok());
  std::this_thread::sleep_for(50ms);
  rig.pre.reset();
  auto fin = rig.dec->wait(5, 5s, true);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->error.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(fin->reclaimable);
  EXPECT_TRUE(rig.dec->forget(5).ok());
  // A second prefill: the ring has no free slot while the first could still write its two.
  auto pre2_t =
      create_loopback_transport({fmt::format("lane-pre2-{}", ++g_seq), rig.layout.fingerprint(), 1, 0}).value();
  PdOptions pre_opt = opt;
  pre_opt.engine = rig.engine.get();
  pre_opt.lease = 5s;
  pre_opt.heartbeat = 50ms;
  auto pre2 = PdPrefill::create(*pre2_t, as_device(rig.pre_mem.space), pre_opt).value();
  const PeerId to_dec2 = pre2_t->load_peer(rig.dec_t->export_metadata().value()).value();
  const PeerId to_pre2 = rig.dec_t->load_peer(pre2_t->export_metadata().value()).value();
  ASSERT_TRUE(pre2->begin(to_dec2, 6, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(pre2->layer_ready(6, l).ok());
  ASSERT_TRUE(rig.dec->start(to_pre2, 6, PdMode::kPush, kDst).ok());
  EXPECT_EQ(rig.dec->wait_layer(6, 0, 100ms).status().code(), StatusCode::kTimedOut)
      << "a slot the silent prefill may still write was granted again";
  rig.pre_t.reset();  // the first prefill's mapping is gone
  auto fin2 = rig.dec->wait(6, 5s, true);
  ASSERT_TRUE(fin2.ok()) << fin2.status().to_string();
  EXPECT_EQ(fin2->leading_loaded_blocks(), 4u) << fin2->error.to_string();
  for (std::uint32_t l = 0; l < 4; ++l)
    for (std::size_t i = 0; i < kDst.size(); ++i) EXPECT_TRUE(layer_matches(rig.dec_mem.space, kDst[i], l, kSrc[i]));
  pre2.reset();
}

// Rewrites the notifications a decode receives: a prefill that sends crafted ring messages.
class Rewriting final : public testing::ForwardingTransport {
 public:
  using Fn = std::function<void(Notification&)>;
  Rewriting(std::unique_ptr<Transport> inner, Fn fn) : ForwardingTransport(std::move(inner)), fn_(std::move(fn)) {}
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    auto got = inner().wait_notifications(timeout);
    if (got.ok())
      for (Notification& n : *got) fn_(n);
    return got;
  }

 private:
  Fn fn_;
};

// A 'P' naming a slot its piece was not granted, and one whose checksum list is cut, fail their layers (never
// loaded, nothing copied out of a slot the piece does not own); the other layers load; the ring's slots come back
// (the prefill's 'Q') and carry the next transfer.
TEST(PdRingLane, CraftedPieceMessagesFailTheirLayersAndTheRingRecovers) {
  LaneMemory mem;
  auto& [layout, pre_mem, dec_mem, device, engine] = mem;
  const int n = ++g_seq;
  auto pre_t = create_loopback_transport({fmt::format("craft-pre{}", n), layout.fingerprint(), 1, 0}).value();
  std::atomic<bool> crafting{true};
  auto dec_t = std::make_unique<Rewriting>(
      create_loopback_transport({fmt::format("craft-dec{}", n), layout.fingerprint(), 1, 0}).value(),
      [&](Notification& m) {
        if (!crafting || m.message.size() < 25 || m.message[0] != 'P') return;
        std::uint32_t layer = 0, piece = 0, slot = 0;
        std::memcpy(&layer, m.message.data() + 9, 4);
        std::memcpy(&piece, m.message.data() + 13, 4);
        std::memcpy(&slot, m.message.data() + 17, 4);
        if (layer == 1 && piece == 0) {
          slot ^= 1;  // the other slot: granted to another piece, or to none
          std::memcpy(m.message.data() + 17, &slot, 4);
        } else if (layer == 2 && piece == 1) {
          const std::uint32_t none = 0;
          m.message.resize(25);
          std::memcpy(m.message.data() + 21, &none, 4);  // no checksums
        }
      });
  PdOptions opt = ring_options();
  opt.engine = engine.get();
  auto pre = PdPrefill::create(*pre_t, as_device(pre_mem.space), opt).value();
  auto dec = PdDecode::create(*dec_t, as_device(dec_mem.space), opt).value();
  const PeerId to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
  const PeerId to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
  ASSERT_TRUE(pre->begin(to_dec, 1, kSrc).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(pre->layer_ready(1, l).ok());
  ASSERT_TRUE(dec->start(to_pre, 1, PdMode::kPush, kDst).ok());
  auto fin = dec->wait(1, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[0], LayerState::kLoaded);
  EXPECT_EQ(fin->layers[1], LayerState::kFailed);
  EXPECT_EQ(fin->layers[2], LayerState::kFailed);
  EXPECT_EQ(fin->layers[3], LayerState::kLoaded);
  EXPECT_EQ(fin->leading_loaded_blocks(), 0u);
  EXPECT_FALSE(fin->error.ok());
  for (std::size_t i = 0; i < kDst.size(); ++i) {
    EXPECT_TRUE(layer_matches(dec_mem.space, kDst[i], 0, kSrc[i]));
    EXPECT_TRUE(layer_matches(dec_mem.space, kDst[i], 3, kSrc[i]));
  }
  ASSERT_TRUE(dec->wait(1, 5s, true).ok());
  ASSERT_TRUE(pre->wait(1, 5s).ok());
  EXPECT_TRUE(pre->forget(1).ok());
  EXPECT_TRUE(dec->forget(1).ok());
  crafting = false;
  const std::vector<BlockId> src2 = {0, 2}, dst2 = {7, 5};
  ASSERT_TRUE(pre->begin(to_dec, 2, src2).ok());
  for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(pre->layer_ready(2, l).ok());
  ASSERT_TRUE(dec->start(to_pre, 2, PdMode::kPush, dst2).ok());
  auto again = dec->wait(2, 5s, true);
  ASSERT_TRUE(again.ok()) << again.status().to_string() << " (ring slots lost to the crafted transfer?)";
  EXPECT_EQ(again->leading_loaded_blocks(), 2u) << again->error.to_string();
  pre.reset();
  dec.reset();
}

// Pull over the device lane: only a transfer's first 'A' carries the source list (the others end with its
// length), and the bytes still land exactly. A crafted 'A' that refers to a list never sent, or gives another
// length, fails its layer without copying anything into it; the other layers load.
TEST(PdDeviceLane, PullSendsTheSourceListOnceAndRefusesReferencesToAnother) {
  LaneMemory mem;
  auto& [layout, pre_mem, dec_mem, device, engine] = mem;
  const int n = ++g_seq;
  // 'A' xid u64, layer u32, then three u64 lists (u32 length + items) and, without a list, u32 length.
  constexpr std::size_t kHead = 13;
  auto list_length = [](const Notification& m) {
    std::uint32_t len = 0;
    std::memcpy(&len, m.message.data() + kHead, 4);
    return len;
  };
  auto as_reference = [](Notification& m, std::uint32_t length) {
    const std::uint32_t none = 0;
    m.message.resize(kHead + 16);
    for (int i = 0; i < 3; ++i) std::memcpy(m.message.data() + kHead + 4 * i, &none, 4);
    std::memcpy(m.message.data() + kHead + 12, &length, 4);
  };
  std::mutex mu;
  std::vector<std::pair<std::uint32_t, std::size_t>> seen;  // (list length, message size) of each 'A'
  int craft = 0;  // 0: observe only; 1: the first 'A' loses its list; 2: layer 2's reference gives length 3
  auto pre_t = create_loopback_transport({fmt::format("alist-pre{}", n), layout.fingerprint(), 1, 0}).value();
  auto dec_t = std::make_unique<Rewriting>(
      create_loopback_transport({fmt::format("alist-dec{}", n), layout.fingerprint(), 1, 0}).value(),
      [&](Notification& m) {
        if (m.message.size() < kHead + 4 || m.message[0] != 'A') return;
        std::lock_guard lock(mu);
        const std::uint32_t len = list_length(m);
        seen.emplace_back(len, m.message.size());
        if (craft == 1 && seen.size() == 1) as_reference(m, len);
        if (craft == 2 && layer_of(m) == 2) as_reference(m, 3);
      });
  PdOptions opt;
  opt.engine = engine.get();
  ASSERT_EQ(opt.lane_verify, PdOptions::LaneVerify::kMover);
  auto pre = PdPrefill::create(*pre_t, as_device(pre_mem.space), opt).value();
  auto dec = PdDecode::create(*dec_t, as_device(dec_mem.space), opt).value();
  const PeerId to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
  const PeerId to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
  auto run = [&](TransferId id) -> Result<DecodeStatus> {
    KVTIER_RETURN_IF_ERROR(pre->begin(to_dec, id, kSrc));
    for (std::uint32_t l = 0; l < 4; ++l) KVTIER_RETURN_IF_ERROR(pre->layer_ready(id, l));
    KVTIER_RETURN_IF_ERROR(dec->start(to_pre, id, PdMode::kPull, kDst));
    auto fin = dec->wait(id, 5s, true);
    KVTIER_RETURN_IF_ERROR(pre->wait(id, 5s).status());
    KVTIER_RETURN_IF_ERROR(pre->forget(id));
    KVTIER_RETURN_IF_ERROR(dec->forget(id));
    return fin;
  };

  auto fin = run(1);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->leading_loaded_blocks(), kDst.size()) << fin->error.to_string();
  for (std::size_t i = 0; i < kDst.size(); ++i)
    for (std::uint32_t l = 0; l < 4; ++l) EXPECT_TRUE(layer_matches(dec_mem.space, kDst[i], l, kSrc[i])) << i;
  {
    std::lock_guard lock(mu);
    ASSERT_EQ(seen.size(), 4u);
    EXPECT_EQ(seen[0].first, kSrc.size());
    for (std::size_t i = 1; i < seen.size(); ++i) {
      EXPECT_EQ(seen[i].first, 0u) << i;
      EXPECT_LT(seen[i].second, seen[0].second) << i;
    }
    seen.clear();
    craft = 1;
  }

  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r)
      for (std::uint64_t b = 0; b < 8; ++b)
        std::memset(dec_mem.space.block_ptr(l, r, b), 0xee, layout.block_bytes(l, r));
  fin = run(2);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(fin->layers[l], LayerState::kFailed) << l;
  EXPECT_EQ(fin->error.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fin->error.message().find("source list it never sent"), std::string::npos) << fin->error.to_string();
  for (std::uint64_t dst : kDst)
    for (std::uint32_t l = 0; l < 4; ++l) EXPECT_EQ(dec_mem.space.block_ptr(l, 1, dst)[17], std::byte{0xee});
  {
    std::lock_guard lock(mu);
    seen.clear();
    craft = 2;
  }

  fin = run(3);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->layers[2], LayerState::kFailed);
  for (std::uint32_t l : {0u, 1u, 3u}) EXPECT_EQ(fin->layers[l], LayerState::kLoaded) << l;
  EXPECT_NE(fin->error.message().find("prefill announced 3 blocks"), std::string::npos) << fin->error.to_string();
  for (std::size_t i = 0; i < kDst.size(); ++i) {
    EXPECT_TRUE(layer_matches(dec_mem.space, kDst[i], 0, kSrc[i])) << i;
    EXPECT_EQ(dec_mem.space.block_ptr(2, 1, kDst[i])[17], std::byte{0xee}) << i;
  }
  pre.reset();
  dec.reset();
}

TEST(PdRingLane, APrefillOnTheDeviceLaneIsRefused) {
  const KvLayout layout = pd_layout();
  LaneRig rig({}, true, ring_options());
  // A second prefill without the ring.
  auto t = create_loopback_transport({fmt::format("lane-dev{}", ++g_seq), layout.fingerprint(), 1, 0}).value();
  PdOptions o;
  o.engine = rig.engine.get();
  auto pre = PdPrefill::create(*t, as_device(rig.pre_mem.space), o).value();
  const PeerId to_dec = t->load_peer(rig.dec_t->export_metadata().value()).value();
  const PeerId to_pre = rig.dec_t->load_peer(t->export_metadata().value()).value();
  ASSERT_TRUE(pre->begin(to_dec, 3, kSrc).ok());
  ASSERT_TRUE(rig.dec->start(to_pre, 3, PdMode::kPush, kDst).ok());
  auto fin = rig.dec->wait(3, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  for (LayerState st : fin->layers) EXPECT_EQ(st, LayerState::kFailed);
  auto pf = pre->wait(3, 5s);
  ASSERT_TRUE(pf.ok());
  EXPECT_EQ(pf->error.code(), StatusCode::kFailedPrecondition) << pf->error.to_string();
  EXPECT_NE(pf->error.message().find("decode asked for the ring lane, this prefill runs the device lane"),
            std::string::npos)
      << pf->error.to_string();
  pre.reset();
}

TEST(PdRingLane, BadGeometryIsRefusedAtCreationNamingTheValue) {
  const KvLayout layout = pd_layout();
  HostBlocks mem = HostBlocks::make(layout, 8, false);
  auto device = HostDevice::create().value();
  auto engine = CopyEngine::create(*device).value();
  struct Case {
    std::uint32_t slots;
    std::uint64_t slot_bytes;
    const char* says;
  };
  for (const Case& c : {Case{65, 1 << 20, "ring of 65 slots"}, Case{2, 16000, "ring slot of 16000 bytes"}}) {
    auto t = create_loopback_transport({fmt::format("ring-geo{}", ++g_seq), layout.fingerprint(), 1, 0}).value();
    PdOptions opt;
    opt.engine = engine.get();
    opt.ring_slots = c.slots;
    opt.ring_slot_bytes = c.slot_bytes;
    auto d = PdDecode::create(*t, as_device(mem.space), opt);
    ASSERT_FALSE(d.ok()) << c.says;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(c.says), std::string::npos) << d.status().to_string();
  }
  auto t = create_loopback_transport({fmt::format("ring-noeng{}", ++g_seq), layout.fingerprint(), 1, 0}).value();
  PdOptions opt;
  opt.ring_slots = 2;
  auto d = PdDecode::create(*t, mem.space, opt);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("needs a copy engine"), std::string::npos) << d.status().to_string();
}

}  // namespace
}  // namespace kvtier::transport
