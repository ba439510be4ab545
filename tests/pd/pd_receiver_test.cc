// PdReceiver (include/kvtier/pd/pd_receiver.h) end to end in one process on the host backend: a prefill
// endpoint and a decode endpoint on loopback transports, the decode side's CacheManager, TransferManager and
// plan executor over one device block space that the decode endpoint writes into. Success in push and pull
// (bytes compared, layer waits through the TransferManager, blocks committed and then matched as device hits),
// a corrupted block on the wire (that block not committed, recomputed by a later request), a silent prefill
// (blocks quarantined until its transport is gone), an eviction of a receiving block refused, and refusals that
// leave nothing behind.
#include "kvtier/pd/pd_receiver.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <optional>

#include "kvtier/cache/transfer_executor.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transfer/transfer_manager.h"
#include "tests/cache/cache_test_util.h"
#include "transport/pd_test_util.h"

namespace kvtier::pd {
namespace {

using namespace std::chrono_literals;
using cache::Admission;
using cache::BlockId;
using cache::BlockKey;
using cache::CacheManager;
using transport::PdMode;
using transport::testing::HostBlocks;
using transport::testing::layer_matches;

constexpr std::uint32_t kLayers = 4;
constexpr std::uint32_t kDeviceBlocks = 8;
constexpr std::uint32_t kHostBlocks = 8;

int g_seq = 0;

// The prefill's transport, whose outgoing notifications can be dropped: a prefill alive but silent (paused,
// partitioned), which proves nothing about its writes.
class Muting final : public transport::testing::ForwardingTransport {
 public:
  explicit Muting(std::unique_ptr<transport::Transport> inner) : ForwardingTransport(std::move(inner)) {}
  Status send_notification(transport::PeerId peer, std::string message) override {
    if (muted.load()) return Status::Ok();
    return ForwardingTransport::send_notification(peer, std::move(message));
  }
  std::atomic<bool> muted{false};
};

// The decode's transport with UCX's revocation rule (transport.h, peer_revoked): RMA of a live peer is
// one-sided, so disconnecting it proves nothing while `peer_alive`; the loopback backend itself copies the
// peer's writes and stops at the disconnect.
class OneSidedWrites final : public transport::testing::ForwardingTransport {
 public:
  explicit OneSidedWrites(std::unique_ptr<transport::Transport> inner) : ForwardingTransport(std::move(inner)) {}
  bool peer_revoked(transport::PeerId peer) const override {
    return !peer_alive.load() && ForwardingTransport::peer_revoked(peer);
  }
  std::atomic<bool> peer_alive{false};
};

std::vector<BlockId> receive_blocks(const Admission& a) {
  return {a.device_blocks.begin() + a.receive_begin, a.device_blocks.begin() + a.receive_begin + a.receive_blocks};
}

struct Rig {
  KvLayout layout = KvLayout::uniform(kLayers, 2, 1024).value();
  // Prefill: pinned host blocks holding the pattern of testing::pattern (prefill block b -> its bytes).
  HostBlocks pre_mem = HostBlocks::make(layout, 8, true);
  Muting* pre_mute = nullptr;
  OneSidedWrites* dec_rma = nullptr;
  std::unique_ptr<transport::Transport> pre_t, dec_t;
  std::unique_ptr<transport::PdPrefill> pre;
  // Decode: device memory of the host backend, registered with the TransferManager and written by the endpoint.
  std::unique_ptr<HostDevice> dev = HostDevice::create().value();
  std::unique_ptr<Stream> compute, forward;
  Buffer device_mem;
  std::unique_ptr<TransferManager> tm;
  std::unique_ptr<CacheManager> cache;
  std::unique_ptr<cache::TransferPlanExecutor> exec;
  std::unique_ptr<transport::PdDecode> dec;
  // Staged decode (device memory the transport does not reach): its own copy engine and pinned staging.
  std::unique_ptr<CopyEngine> engine;
  std::optional<transport::StagingSpace> staging;
  std::unique_ptr<transport::PdStagedDecode> sdec;
  std::unique_ptr<PdReceiver> rx;
  transport::PeerId to_dec = 0, to_pre = 0;

  explicit Rig(transport::WireFaults pre_faults = {}, transport::PdOptions opt = {}, bool staged = false,
               std::chrono::milliseconds receive_timeout = 10s) {
    const int n = ++g_seq;
    auto muting = std::make_unique<Muting>(transport::wrap_with_wire_faults(
        transport::create_loopback_transport({fmt::format("rx-pre{}", n), layout.fingerprint(), 1, 0}).value(),
        pre_faults));
    pre_mute = muting.get();
    pre_t = std::move(muting);
    auto one_sided = std::make_unique<OneSidedWrites>(
        transport::create_loopback_transport({fmt::format("rx-dec{}", n), layout.fingerprint(), 1, 0}).value());
    dec_rma = one_sided.get();
    dec_t = std::move(one_sided);
    pre = transport::PdPrefill::create(*pre_t, pre_mem.space, opt).value();

    compute = dev->create_stream(StreamOptions{StreamPriority::kNormal, "compute"}).value();
    forward = dev->create_stream(StreamOptions{StreamPriority::kNormal, "forward"}).value();
    const std::uint64_t plane = layout.block_bytes(0, 0) * kDeviceBlocks;
    device_mem = dev->allocate_device(plane * layout.num_layers() * 2).value();
    std::vector<std::vector<void*>> bases(layout.num_layers());
    std::byte* p = device_mem.bytes_ptr();
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < 2; ++r, p += plane) {
        std::memset(p, 0xee, plane);
        bases[l].push_back(p);
      }
    KvCacheRegistration reg;
    reg.device =
        BlockSpace::layer_first(MemoryKind::kDevice, dev->ordinal(), layout, kDeviceBlocks, std::move(bases)).value();
    reg.host.num_blocks = kHostBlocks;
    TransferManagerConfig tcfg;
    tcfg.poll_interval = 20us;
    tm = TransferManager::create(*dev, *compute, std::move(reg), tcfg).value();
    cache = cache::testing::make_cache(cache::testing::config(kDeviceBlocks, kHostBlocks));
    exec = std::make_unique<cache::TransferPlanExecutor>(*tm, *dev, *compute, tm->device_space(),
                                                         cache::TransferPlanExecutor::Options{false, 0});
    if (staged) {
      engine = CopyEngine::create(*dev).value();
      staging = transport::StagingSpace::allocate(*dev, layout, 6).value();
      transport::StagedOptions so;
      so.pd = opt;
      sdec = transport::PdStagedDecode::create(*dec_t, *dev, *engine, tm->device_space(), staging->space, so).value();
    } else {
      dec = transport::PdDecode::create(*dec_t, tm->device_space(), opt).value();
    }
    to_dec = pre_t->load_peer(dec_t->export_metadata().value()).value();
    to_pre = dec_t->load_peer(pre_t->export_metadata().value()).value();
    ReceiverOptions ro;
    ro.poll_interval = 50us;
    ro.receive_timeout = receive_timeout;
    rx = (staged ? PdReceiver::create(*cache, *tm, *exec, *sdec, ro) : PdReceiver::create(*cache, *tm, *exec, *dec, ro))
             .value();
  }
  ~Rig() {
    rx.reset();
    pre.reset();
    dec.reset();
    sdec.reset();
    tm->shutdown().ignore_error();
  }

  // The engine's step: plan moves acknowledged to the cache as they complete.
  Status settle_moves() {
    const auto limit = std::chrono::steady_clock::now() + 10s;
    while (exec->in_flight() > 0 && std::chrono::steady_clock::now() < limit) {
      KVTIER_RETURN_IF_ERROR(cache::apply_completions(*cache, exec->poll()));
      std::this_thread::sleep_for(1ms);
    }
    return exec->in_flight() == 0 ? Status::Ok() : TimedOut("plan moves still in flight");
  }

  ReceiveRequest request(transport::TransferId id, PdMode mode, std::vector<BlockKey> keys) const {
    ReceiveRequest r;
    r.prefill = to_pre;
    r.id = id;
    r.mode = mode;
    r.keys = std::move(keys);
    return r;
  }

  bool block_holds(BlockId dst, std::uint64_t src) const {
    for (std::uint32_t l = 0; l < kLayers; ++l)
      if (!layer_matches(tm->device_space(), dst, l, src)) return false;
    return true;
  }
};

const std::vector<BlockId> kSrc = {3, 1, 7, 5};

class Modes : public ::testing::TestWithParam<PdMode> {};

// The whole path: layers become final one by one on the TransferManager (the forward's waits), the bytes that
// landed are the prefill's, the blocks join the prefix index and a later request is served from them.
TEST_P(Modes, AReceivedPromptIsAwaitedPerLayerCommittedAndServedAsDeviceHits) {
  Rig rig;
  const auto keys = cache::testing::path({1, 2, 3, 4});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 11, kSrc).ok());
  auto rcv = rig.rx->start(rig.request(11, GetParam(), keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  ASSERT_EQ(rcv->admission.receive_blocks, 4u);
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);

  // Nothing sent yet: the forward's wait for layer 0 does not pass.
  EXPECT_EQ(rig.tm->wait_layer_host(rcv->task, 0, 30ms).code(), StatusCode::kTimedOut);
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(rig.pre->layer_ready(11, l).ok());
    // The forward waits as for a local load: on its stream, then (the test) on the host.
    ASSERT_TRUE(rig.tm->wait_for_layer(rcv->task, l, *rig.forward).ok()) << l;
    ASSERT_TRUE(rig.tm->wait_layer_host(rcv->task, l, 5s).ok()) << l;
    ASSERT_TRUE(rig.dev->synchronize(*rig.forward, 5s).ok());
    for (std::size_t i = 0; i < blocks.size(); ++i)
      EXPECT_TRUE(layer_matches(rig.tm->device_space(), blocks[i], l, kSrc[i])) << "layer " << l << " block " << i;
    if (l + 1 < kLayers) {
      EXPECT_EQ(rig.tm->wait_layer_host(rcv->task, l + 1, 1ms).code(), StatusCode::kTimedOut);
    }
  }
  auto out = rig.rx->finish(11, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_TRUE(out->error.ok()) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 4u);
  EXPECT_TRUE(out->reclaimable);
  EXPECT_TRUE(rig.tm->wait(rcv->task, 5s).ok());
  EXPECT_TRUE(rig.tm->failed_blocks(rcv->task)->device.empty());
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  EXPECT_EQ(rig.rx->active(), 0u);
  for (BlockId b : blocks) EXPECT_TRUE(*rig.tm->is_device_block_free(b)) << b;
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());

  // A later request with the same prompt: every block a device hit, in the blocks that hold the received bytes.
  auto later = rig.cache->admit(keys);
  ASSERT_TRUE(later.ok()) << later.status().to_string();
  EXPECT_EQ(later->device_hit_blocks, 4u);
  EXPECT_EQ(later->new_blocks, 0u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(later->device_blocks[i], blocks[i]);
    EXPECT_TRUE(rig.block_holds(blocks[i], kSrc[i])) << i;
  }
  ASSERT_TRUE(rig.cache->release(later->id).ok());
  const auto cs = rig.cache->stats();
  EXPECT_EQ(cs.received_committed_blocks, 4u);
  EXPECT_EQ(cs.quarantined_device_blocks, 0u);
  EXPECT_TRUE(rig.cache->check_invariants().ok());
  const auto st = rig.rx->stats();
  EXPECT_EQ(st.completed, 1u);
  EXPECT_EQ(st.committed_blocks, 4u);
  EXPECT_EQ(st.layers_reported, kLayers);
  EXPECT_EQ(st.layers_failed, 0u);
  EXPECT_EQ(rig.dec->status(11).status().code(), StatusCode::kNotFound);  // forgotten by the receiver
}

// One byte of layer 0 of the block at position 2 flipped on the wire: that layer fails on the data plane
// (never reported loaded), the blocks before it are committed, the corrupted one and those after are not, and a
// later request recomputes them.
TEST_P(Modes, ACorruptedBlockIsNeverCommittedAndALaterRequestRecomputesIt) {
  // Descriptor pairs are posted per layer, role by role, block by block: op 4 + 2 is layer 0's role 1 of the
  // block at position 2 (the prefill's writes in push, the decode's reads in pull).
  const transport::WireFaults f{4 + 2, 100};
  Rig rig(GetParam() == PdMode::kPush ? f : transport::WireFaults{});
  if (GetParam() == PdMode::kPull) {
    // Pull reads through the decode's transport: corrupt there instead.
    rig.rx.reset();
    rig.dec.reset();
    rig.dec_rma = nullptr;
    rig.dec_t = transport::wrap_with_wire_faults(
        transport::create_loopback_transport({fmt::format("rx-decf{}", ++g_seq), rig.layout.fingerprint(), 1, 0})
            .value(),
        f);
    rig.dec = transport::PdDecode::create(*rig.dec_t, rig.tm->device_space()).value();
    rig.to_dec = rig.pre_t->load_peer(rig.dec_t->export_metadata().value()).value();
    rig.to_pre = rig.dec_t->load_peer(rig.pre_t->export_metadata().value()).value();
    rig.rx = PdReceiver::create(*rig.cache, *rig.tm, *rig.exec, *rig.dec).value();
  }
  const auto keys = cache::testing::path({5, 6, 7, 8});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 12, kSrc).ok());
  for (std::uint32_t l = 0; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(12, l).ok());
  auto rcv = rig.rx->start(rig.request(12, GetParam(), keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);

  auto out = rig.rx->finish(12, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->error.code(), StatusCode::kDataLoss) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 2u);
  EXPECT_EQ(out->transfer.block_loaded, (std::vector<bool>{true, true, false, true}));
  // The data plane: layer 0 failed, naming the corrupted block only; the other layers landed.
  const Status l0 = rig.tm->wait_layer_host(rcv->task, 0, 5s);
  EXPECT_EQ(l0.code(), StatusCode::kDataLoss) << l0.to_string();
  EXPECT_NE(l0.message().find(std::to_string(blocks[2])), std::string::npos) << l0.to_string();
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_TRUE(rig.tm->wait_layer_host(rcv->task, l, 5s).ok()) << l;
  auto failed = rig.tm->failed_blocks(rcv->task);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->device, (std::vector<BlockId>{blocks[2]}));
  EXPECT_EQ(rig.cache->stats().received_committed_blocks, 2u);

  // Once the prefill's writes are proven over, nothing stays quarantined.
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 0u);
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  auto later = rig.cache->admit(keys);
  ASSERT_TRUE(later.ok()) << later.status().to_string();
  EXPECT_EQ(later->device_hit_blocks, 2u);
  EXPECT_EQ(later->new_blocks, 2u);  // the corrupted block and the one after it: recomputed
  EXPECT_EQ(later->device_blocks[0], blocks[0]);
  EXPECT_EQ(later->device_blocks[1], blocks[1]);
  EXPECT_TRUE(rig.block_holds(blocks[0], kSrc[0]));
  EXPECT_TRUE(rig.block_holds(blocks[1], kSrc[1]));
  EXPECT_FALSE(rig.block_holds(blocks[2], kSrc[2]));
  ASSERT_TRUE(rig.cache->release(later->id).ok());
  EXPECT_TRUE(rig.cache->check_invariants().ok());
  EXPECT_EQ(rig.rx->stats().failed, 1u);
}

// A layer with one corrupted block fails on the data plane as soon as the endpoint verified it, naming that block,
// while later layers are still to come: a forward waiting on it does not wait for the whole transfer.
TEST(PdReceiver, APartialLayerFailsAtOnceNamingItsBadBlock) {
  const transport::WireFaults f{4 + 2, 100};  // layer 0, role 1, position 2 (see the test above)
  Rig rig(f);
  const auto keys = cache::testing::path({9, 10, 11, 12});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 14, kSrc).ok());
  ASSERT_TRUE(rig.pre->layer_ready(14, 0).ok());  // only layer 0: the transfer cannot become final
  auto rcv = rig.rx->start(rig.request(14, PdMode::kPush, keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);
  const Status l0 = rig.tm->wait_layer_host(rcv->task, 0, 3s);
  EXPECT_EQ(l0.code(), StatusCode::kDataLoss) << l0.to_string();
  EXPECT_NE(l0.message().find(std::to_string(blocks[2])), std::string::npos) << l0.to_string();
  EXPECT_EQ(rig.tm->wait_layer_host(rcv->task, 1, 50ms).code(), StatusCode::kTimedOut);  // not declared yet
  for (std::uint32_t l = 1; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(14, l).ok());
  auto out = rig.rx->finish(14, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->loaded_blocks, 2u);
  for (std::uint32_t l = 1; l < kLayers; ++l) EXPECT_TRUE(rig.tm->wait_layer_host(rcv->task, l, 5s).ok()) << l;
  auto failed = rig.tm->failed_blocks(rcv->task);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->device, (std::vector<BlockId>{blocks[2]}));
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

INSTANTIATE_TEST_SUITE_P(PdReceiver, Modes, ::testing::Values(PdMode::kPush, PdMode::kPull),
                         [](const auto& info) { return std::string(transport::pd_mode_name(info.param)); });

// The staged decode (device blocks written by its own staging copies): the same guards and the same waits; the
// layer is reported once its staging -> device copy completed, and the staging blocks return at the end.
TEST(PdReceiver, AStagedReceiveIsAwaitedCommittedAndItsStagingReturned) {
  Rig rig({}, {}, /*staged=*/true);
  const auto keys = cache::testing::path({100, 101, 102, 103});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 19, kSrc).ok());
  auto rcv = rig.rx->start(rig.request(19, PdMode::kPull, keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);
  EXPECT_EQ(rig.sdec->staging_blocks_free(), 2u);
  auto evict = rig.tm->evict_to_host_async(std::vector<BlockId>{blocks[3]}, std::vector<BlockId>{0});
  EXPECT_EQ(evict.status().code(), StatusCode::kFailedPrecondition) << evict.status().to_string();
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(rig.pre->layer_ready(19, l).ok());
    ASSERT_TRUE(rig.tm->wait_layer_host(rcv->task, l, 5s).ok()) << l;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      EXPECT_TRUE(layer_matches(rig.tm->device_space(), blocks[i], l, kSrc[i])) << "layer " << l << " block " << i;
  }
  auto out = rig.rx->finish(19, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_TRUE(out->error.ok()) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 4u);
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  EXPECT_EQ(rig.sdec->staging_blocks_free(), 6u);
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  auto later = rig.cache->admit(keys);
  ASSERT_TRUE(later.ok()) << later.status().to_string();
  EXPECT_EQ(later->device_hit_blocks, 4u);
  ASSERT_TRUE(rig.cache->release(later->id).ok());
}

// The request is aborted mid-transfer (its admission released while receiving): nothing is committed, the
// blocks stay out of the pool until the transfer is over, then return.
TEST(PdReceiver, AnAdmissionReleasedWhileReceivingCommitsNothingAndGetsItsBlocksBack) {
  Rig rig;
  const auto keys = cache::testing::path({110, 111, 112, 113});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 20, kSrc).ok());
  auto rcv = rig.rx->start(rig.request(20, PdMode::kPush, keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 4u);
  EXPECT_EQ(rig.cache->admit(cache::testing::path({120, 121, 122, 123, 124, 125})).status().code(),
            StatusCode::kResourceExhausted);
  for (std::uint32_t l = 0; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(20, l).ok());
  auto out = rig.rx->finish(20, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->error.code(), StatusCode::kFailedPrecondition) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 0u);
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 0u);
  EXPECT_EQ(rig.cache->stats().received_committed_blocks, 0u);
  EXPECT_EQ(rig.cache->match(keys).total(), 0u);
  auto all = rig.cache->admit(cache::testing::path({120, 121, 122, 123, 124, 125, 126, 127}));
  EXPECT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

// A prefill that falls silent mid-transfer (alive, its notifications lost): the lease fails the rest, the
// forward's waits end with the failure, nothing is committed, and the blocks stay out of every pool and
// declared to the data plane while the prefill could still write them (a live peer's one-sided writes, as on
// UCX); once its process is gone they return.
TEST(PdReceiver, ASilentPrefillKeepsTheBlocksQuarantinedUntilItCanNoLongerWrite) {
  Rig rig({}, transport::PdOptions{20ms, 150ms});
  rig.dec_rma->peer_alive = true;  // as on UCX: a live peer's posted writes cannot be revoked
  const auto keys = cache::testing::path({9, 10, 11, 12});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 13, kSrc).ok());
  ASSERT_TRUE(rig.pre->layer_ready(13, 0).ok());
  auto rcv = rig.rx->start(rig.request(13, PdMode::kPush, keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);
  ASSERT_TRUE(rig.tm->wait_layer_host(rcv->task, 0, 5s).ok());
  rig.pre_mute->muted = true;  // no heartbeat, no layer, no proof of quiescence

  // The forward's wait for layer 1 ends, failed (the data plane names the blocks), after about the lease.
  const Status l1 = rig.tm->wait_layer_host(rcv->task, 1, 5s);
  EXPECT_EQ(l1.code(), StatusCode::kDataLoss) << l1.to_string();
  auto out = rig.rx->finish(13, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->error.code(), StatusCode::kUnavailable) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 0u);
  EXPECT_FALSE(out->reclaimable);
  EXPECT_EQ(rig.rx->quarantined(), 1u);
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());

  // Quarantined: not matched, not in the pool, not free on the data plane; time alone does not end it.
  EXPECT_EQ(rig.rx->drain(300ms).code(), StatusCode::kTimedOut);
  auto cs = rig.cache->stats();
  EXPECT_EQ(cs.quarantined_device_blocks, 4u);
  EXPECT_EQ(cs.received_committed_blocks, 0u);
  EXPECT_EQ(rig.cache->match(keys).total(), 0u);
  for (BlockId b : blocks) EXPECT_FALSE(*rig.tm->is_device_block_free(b)) << b;
  auto others = rig.cache->admit(cache::testing::path({20, 21, 22, 23}));
  ASSERT_TRUE(others.ok()) << others.status().to_string();
  for (BlockId b : others->device_blocks) EXPECT_EQ(std::count(blocks.begin(), blocks.end(), b), 0) << b;
  EXPECT_EQ(rig.cache->admit(cache::testing::path({30})).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(rig.cache->release(others->id).ok());
  EXPECT_EQ(rig.cache->reset().code(), StatusCode::kFailedPrecondition);

  // The prefill's process is gone (its connection failed): nothing can write any more, the blocks come back.
  rig.pre.reset();
  rig.pre_t.reset();
  rig.dec_rma->peer_alive = false;
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  EXPECT_EQ(rig.rx->quarantined(), 0u);
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 0u);
  for (BlockId b : blocks) EXPECT_TRUE(*rig.tm->is_device_block_free(b)) << b;
  auto all = rig.cache->admit(cache::testing::path({40, 41, 42, 43, 44, 45, 46, 47}));
  EXPECT_TRUE(all.ok()) << all.status().to_string();
  const auto st = rig.rx->stats();
  EXPECT_EQ(st.quarantined, 1u);
  EXPECT_EQ(st.reclaimed, 1u);
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

// While receiving, neither the cache nor the data plane lets anything evict, load into, commit or match the
// blocks; once received, the same eviction goes through and carries the received bytes.
TEST(PdReceiver, AnEvictionOfAReceivingBlockIsRefused) {
  Rig rig;
  const auto keys = cache::testing::path({50, 51, 52, 53});
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 14, kSrc).ok());
  auto rcv = rig.rx->start(rig.request(14, PdMode::kPush, keys));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  const std::vector<BlockId> blocks = receive_blocks(rcv->admission);
  const auto b0 = blocks[0];

  auto evict = rig.tm->evict_to_host_async(std::vector<BlockId>{b0}, std::vector<BlockId>{0});
  EXPECT_EQ(evict.status().code(), StatusCode::kFailedPrecondition) << evict.status().to_string();
  auto load = rig.tm->load_layers_to_device_async({}, std::vector<BlockId>{1}, std::vector<BlockId>{b0});
  EXPECT_EQ(load.status().code(), StatusCode::kFailedPrecondition) << load.status().to_string();
  EXPECT_EQ(rig.cache->commit_all(rcv->admission.id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rig.cache->match(keys).total(), 0u);
  EXPECT_EQ(rig.cache->reclaimable_device_blocks(), 0u);
  // Memory pressure: a request that would need the receiving blocks is refused rather than evicting them.
  EXPECT_EQ(rig.cache->admit(cache::testing::path({60, 61, 62, 63, 64})).status().code(),
            StatusCode::kResourceExhausted);

  for (std::uint32_t l = 0; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(14, l).ok());
  auto out = rig.rx->finish(14, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  ASSERT_EQ(out->loaded_blocks, 4u);
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  // Received and released: pressure now evicts them through the plan, and the host copies are the received bytes.
  auto big = rig.cache->admit(cache::testing::path({60, 61, 62, 63, 64, 65, 66}));
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  cache::StepPlan plan = rig.cache->take_plan();
  ASSERT_FALSE(plan.evictions.empty());
  ASSERT_TRUE(rig.exec->execute(plan).ok());
  ASSERT_TRUE(rig.settle_moves().ok());
  std::size_t checked = 0;
  for (const cache::BlockMove& m : plan.evictions) {
    auto it = std::find(blocks.begin(), blocks.end(), m.src);
    ASSERT_NE(it, blocks.end()) << "evicted a block that was not received: " << m.src;
    const std::uint64_t src = kSrc[static_cast<std::size_t>(it - blocks.begin())];
    for (std::uint32_t l = 0; l < kLayers; ++l) EXPECT_TRUE(layer_matches(rig.tm->host_space(), m.dst, l, src));
    ++checked;
  }
  EXPECT_GT(checked, 0u);
  EXPECT_EQ(rig.cache->stats().evictions_d2h, checked);
  ASSERT_TRUE(rig.cache->release(big->id).ok());
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

// A receive whose prefill is alive but never begins (it heartbeats the request it holds, so no lease ends it): at
// the receive timeout the endpoint gives up too (cancel), the prefill answers that nothing can land, and the blocks
// come back, where they stayed pending and quarantined for good. Its outcome, once taken, is reported: a second
// finish() is NotFound at once (it spun until its deadline while the blocks were quarantined).
TEST(PdReceiver, AReceiveWhosePrefillNeverBeginsEndsAtTheTimeoutAndItsBlocksComeBack) {
  Rig rig({}, transport::PdOptions{20ms, 5s}, false, 300ms);
  auto rcv = rig.rx->start(rig.request(21, PdMode::kPush, cache::testing::path({60, 61})));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  auto out = rig.rx->finish(21, 5s);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->error.code(), StatusCode::kTimedOut) << out->error.to_string();
  EXPECT_EQ(out->loaded_blocks, 0u);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(rig.rx->finish(21, 2s).status().code(), StatusCode::kNotFound);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 500ms);
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  ASSERT_TRUE(rig.rx->drain(3s).ok()) << "the receive's blocks stayed quarantined";
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 0u);
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

// Refusals undo every step: a duplicate transfer id, an admission the cache cannot make, and a peer the
// endpoint cannot reach (the request never left: nothing can land, the blocks come back at once).
TEST(PdReceiver, RefusalsAndUnreachablePeersLeaveNothingHeld) {
  Rig rig;
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 15, {kSrc[0], kSrc[1]}).ok());
  auto rcv = rig.rx->start(rig.request(15, PdMode::kPush, cache::testing::path({70, 71})));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  auto dup = rig.rx->start(rig.request(15, PdMode::kPush, cache::testing::path({72})));
  EXPECT_EQ(dup.status().code(), StatusCode::kAlreadyExists) << dup.status().to_string();
  EXPECT_NE(dup.status().message().find("15"), std::string::npos);
  auto big = rig.rx->start(rig.request(16, PdMode::kPush, cache::testing::path({80, 81, 82, 83, 84, 85, 86})));
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted) << big.status().to_string();
  EXPECT_NE(big.status().message().find("transfer 16"), std::string::npos) << big.status().to_string();
  auto none = rig.rx->start(rig.request(17, PdMode::kPush, {}));
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.rx->active(), 1u);

  ReceiveRequest lost = rig.request(18, PdMode::kPush, cache::testing::path({90, 91}));
  lost.prefill = 9999;  // no such peer: the decode endpoint refuses before anything is sent
  auto r = rig.rx->start(lost);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().to_string();
  EXPECT_NE(r.status().message().find("9999"), std::string::npos) << r.status().to_string();
  EXPECT_EQ(rig.rx->active(), 1u);

  for (std::uint32_t l = 0; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(15, l).ok());
  auto fin = rig.rx->finish(15, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_TRUE(fin->error.ok()) << fin->error.to_string();
  EXPECT_EQ(fin->loaded_blocks, 2u);
  ASSERT_TRUE(rig.rx->drain(5s).ok());
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
  EXPECT_EQ(rig.cache->stats().quarantined_device_blocks, 0u);
  EXPECT_EQ(rig.rx->finish(15, 1ms).status().code(), StatusCode::kNotFound);
  const auto st = rig.rx->stats();
  EXPECT_EQ(st.started, 1u);
  EXPECT_EQ(st.refused, 4u);
  EXPECT_TRUE(rig.cache->check_invariants().ok());
}

// Durations at the limit of their type: a free_timeout of milliseconds::max() overflowed when made nanoseconds, and
// every start() failed "free_timeout -1000000 ns is negative"; a huge poll interval made the reporter wait unbounded.
TEST(PdReceiver, TimeoutsAtTheirTypesLimitWork) {
  Rig rig;
  ReceiverOptions ro;
  ro.free_timeout = std::chrono::milliseconds::max();
  ro.poll_interval = std::chrono::microseconds::max();
  ro.receive_timeout = std::chrono::milliseconds::max();
  rig.rx.reset();
  rig.rx = PdReceiver::create(*rig.cache, *rig.tm, *rig.exec, *rig.dec, ro).value();
  ASSERT_TRUE(rig.pre->begin(rig.to_dec, 31, {kSrc[0], kSrc[1]}).ok());
  auto rcv = rig.rx->start(rig.request(31, PdMode::kPush, cache::testing::path({140, 141})));
  ASSERT_TRUE(rcv.ok()) << rcv.status().to_string();
  for (std::uint32_t l = 0; l < kLayers; ++l) ASSERT_TRUE(rig.pre->layer_ready(31, l).ok());
  auto fin = rig.rx->finish(31, 5s);
  ASSERT_TRUE(fin.ok()) << fin.status().to_string();
  EXPECT_EQ(fin->loaded_blocks, 2u);
  ASSERT_TRUE(rig.cache->release(rcv->admission.id).ok());
}

// A receive the decode endpoint refuses at start() (a peer it does not know; the staged pool's back-pressure) ended
// its external write failed, and that failure stayed in the blocks' history: the next eviction of what the engine
// computed in them failed with DataLoss ("holds bytes of failed task"), and the cache dropped them.
TEST(PdReceiver, BlocksOfARefusedStartEvictCleanlyLater) {
  for (bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "direct");
    Rig rig({}, {}, staged);
    ReceiveRequest lost = rig.request(21, PdMode::kPush, cache::testing::path({90, 91}));
    lost.prefill = 9999;
    EXPECT_EQ(rig.rx->start(lost).status().code(), StatusCode::kNotFound);
    if (staged) {  // more blocks than the staging pool (6) holds: refused by the endpoint
      auto big = rig.rx->start(rig.request(22, PdMode::kPush, cache::testing::path({1, 2, 3, 4, 5, 6, 7})));
      EXPECT_FALSE(big.ok());
    }
    ASSERT_TRUE(rig.tm->wait_all(5s).ok());
    for (BlockId b = 0; b < kDeviceBlocks && b < kHostBlocks; ++b) {
      const BlockId one[] = {b};
      auto task = rig.tm->evict_to_host_async(one, one);
      ASSERT_TRUE(task.ok()) << task.status().to_string();
      Status st = rig.tm->wait(*task, 5s);
      EXPECT_TRUE(st.ok()) << "block " << b << ": " << st.to_string();
    }
  }
}

}  // namespace
}  // namespace kvtier::pd
