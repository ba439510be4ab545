// The P/D receive hazard with both guards in place (docs/architecture.md,
// "P/D receives"): a decode instance's CacheManager hands device blocks to a
// receive (admit_receive) and its TransferManager declares them written by
// the peer (begin_external_write), on the host backend with real bytes. While
// the peer writes, memory pressure never evicts them, no plan, load or
// eviction touches them, no request matches them and nothing reports them
// loaded; a failed receive whose peer may still write keeps them out of every
// pool until the peer is proven quiescent; a successful one is indexed and
// served from the bytes that landed.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>

#include "kvtier/cache/cache_manager.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transfer/transfer_manager.h"
#include "tests/cache/cache_test_util.h"
#include "transfer/transfer_model.h"
#include "transfer/transfer_test_util.h"

namespace kvtier::cache {
namespace {

using namespace std::chrono_literals;
using testing::make_cache;
using testing::path;
using transfer_test::check_pattern;
using transfer_test::fill_pattern;
using transfer_test::make_host;
using transfer_test::RigOptions;
using transfer_test::small_gqa;
using transfer_test::TransferRig;

constexpr std::uint32_t kDeviceBlocks = 6;
constexpr std::uint32_t kHostBlocks = 12;

RigOptions rig_options() {
  RigOptions o;
  o.layout = small_gqa(4);
  o.device_blocks = kDeviceBlocks;
  o.host_blocks = kHostBlocks;
  o.config.poll_interval = std::chrono::microseconds(20);
  o.arena_bytes = 1u << 20;
  o.timeout = std::chrono::seconds(60);
  return o;
}

std::vector<BlockId> as_ids(const std::vector<BlockId>& v) { return {v.begin(), v.end()}; }

std::vector<BlockId> receive_blocks(const Admission& a) {
  return {a.device_blocks.begin() + a.receive_begin, a.device_blocks.begin() + a.receive_begin + a.receive_blocks};
}

bool disjoint(const std::vector<BlockId>& a, const std::vector<BlockId>& b) {
  std::set<BlockId> s(a.begin(), a.end());
  return std::none_of(b.begin(), b.end(), [&](BlockId x) { return s.count(x) > 0; });
}

// The decode side: a CacheManager and a TransferManager over the same device blocks, and the plan executor
// the engine runs each step (evictions, then loads, acked to the cache).
struct Decode {
  std::unique_ptr<HostDevice> dev = make_host(301, 50);
  TransferRig rig{*dev, rig_options()};
  std::unique_ptr<CacheManager> cache = make_cache(testing::config(kDeviceBlocks, kHostBlocks));

  TransferManager& tm() { return rig.mgr(); }
  const KvLayout& layout() const { return rig.layout(); }

  Status run_plan() {
    StepPlan plan = cache->take_plan();
    if (!plan.evictions.empty()) {
      std::vector<BlockId> d, h;
      for (const BlockMove& m : plan.evictions) {
        d.push_back(static_cast<BlockId>(m.src));
        h.push_back(static_cast<BlockId>(m.dst));
      }
      KVTIER_ASSIGN_OR_RETURN(TaskId t, tm().evict_to_host_async(d, h));
      KVTIER_RETURN_IF_ERROR(cache->ack_evictions(testing::dsts(plan.evictions), tm().wait(t, 10s)));
    }
    if (!plan.loads.empty()) {
      std::vector<BlockId> h, d;
      for (const BlockMove& m : plan.loads) {
        h.push_back(static_cast<BlockId>(m.src));
        d.push_back(static_cast<BlockId>(m.dst));
      }
      KVTIER_ASSIGN_OR_RETURN(TaskId t, tm().load_layers_to_device_async({}, h, d));
      KVTIER_RETURN_IF_ERROR(cache->ack_loads(testing::dsts(plan.loads), tm().wait(t, 10s)));
    }
    return Status::Ok();
  }

  // A request computed here: admitted, its plan run, its blocks written by the forward, committed, released.
  Status compute_request(const std::vector<BlockKey>& keys) {
    KVTIER_ASSIGN_OR_RETURN(Admission a, cache->admit(keys));
    KVTIER_RETURN_IF_ERROR(run_plan());
    std::vector<BlockId> fresh(a.device_blocks.begin() + a.device_hit_blocks + a.host_hit_blocks,
                               a.device_blocks.end());
    if (!fresh.empty()) KVTIER_RETURN_IF_ERROR(rig.compute_write(fresh));
    KVTIER_RETURN_IF_ERROR(cache->commit_all(a.id));
    return cache->release(a.id);
  }

  // The prefill's bytes for (block, layer), as its WRITE lands in the device cache.
  void peer_write(BlockId block, std::uint32_t layer, std::uint64_t tag) {
    for (std::uint32_t r = 0; r < layout().num_roles(layer); ++r)
      fill_pattern(tm().device_space().block_ptr(layer, r, block), layout().block_bytes(layer, r), tag, layer, r);
  }
  bool host_holds(BlockId host_block, std::uint32_t layer, std::uint64_t tag) {
    for (std::uint32_t r = 0; r < layout().num_roles(layer); ++r)
      if (check_pattern(tm().host_space().block_ptr(layer, r, static_cast<std::uint64_t>(host_block)),
                        layout().block_bytes(layer, r), tag, layer, r) != -1)
        return false;
    return true;
  }
};

TEST(ReceiveHazard, BlockBeingReceivedIsNeitherEvictedNorReadAsLoaded) {
  Decode d;
  ASSERT_TRUE(d.rig.init().ok());
  CacheManager& cache = *d.cache;
  TransferManager& tm = d.tm();
  ASSERT_TRUE(d.compute_request(path({1, 2, 3})).ok());  // cached, evictable

  // The receive: blocks from the cache, declared to the data plane before the peer is told about them.
  const auto recv_keys = path({10, 11, 12});
  auto r = cache.admit_receive(recv_keys);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(d.run_plan().ok());
  const std::vector<BlockId> receiving = receive_blocks(*r);
  auto task = tm.begin_external_write({}, as_ids(receiving));
  ASSERT_TRUE(task.ok()) << task.status().to_string();
  for (BlockId b : receiving) d.peer_write(b, 0, 500 + b);
  ASSERT_TRUE(tm.complete_external_layer(*task, 0).ok());

  // Memory pressure: another request needs three blocks. The cached request goes; the receive stays.
  auto b = cache.admit(path({20, 21, 22}));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  StepPlan peek = cache.take_plan();
  ASSERT_EQ(peek.evictions.size(), 3u);
  for (const BlockMove& e : peek.evictions)
    EXPECT_EQ(std::count(receiving.begin(), receiving.end(), e.src), 0) << "the plan evicts receiving block " << e.src;
  EXPECT_TRUE(disjoint(receiving, b->device_blocks));
  {
    std::vector<BlockId> dsrc, hdst;
    for (const BlockMove& e : peek.evictions) {
      dsrc.push_back(static_cast<BlockId>(e.src));
      hdst.push_back(static_cast<BlockId>(e.dst));
    }
    auto ev = tm.evict_to_host_async(dsrc, hdst);
    ASSERT_TRUE(ev.ok()) << ev.status().to_string();
    ASSERT_TRUE(cache.ack_evictions(testing::dsts(peek.evictions), tm.wait(*ev, 10s)).ok());
  }
  // A stale or buggy plan that evicts a receiving block is refused by the data plane.
  auto bad_evict = tm.evict_to_host_async(std::vector<BlockId>{static_cast<BlockId>(receiving[0])},
                                          std::vector<BlockId>{static_cast<BlockId>(kHostBlocks - 1)});
  EXPECT_EQ(bad_evict.status().code(), StatusCode::kFailedPrecondition) << bad_evict.status().to_string();
  // Nothing more can be had: the receive's blocks are not evictable, another request for its keys fails.
  auto again = cache.admit(recv_keys);
  EXPECT_EQ(again.status().code(), StatusCode::kResourceExhausted) << again.status().to_string();
  EXPECT_EQ(cache.reclaimable_device_blocks(), 0u);

  // Never read as loaded: not matched, not committable, layer 1 not done, no load may overwrite it.
  EXPECT_EQ(cache.match(recv_keys).total(), 0u);
  EXPECT_EQ(cache.commit_all(r->id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(tm.wait_layer_host(*task, 1, 20ms).code(), StatusCode::kTimedOut);
  auto info = tm.task_info(*task);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->layer_states.at(1), TaskState::kPending);
  auto bad_load = tm.load_layers_to_device_async({}, std::vector<BlockId>{0},
                                                 std::vector<BlockId>{static_cast<BlockId>(receiving[1])});
  EXPECT_EQ(bad_load.status().code(), StatusCode::kFailedPrecondition) << bad_load.status().to_string();
  EXPECT_FALSE(*tm.is_device_block_free(static_cast<BlockId>(receiving[2])));
  EXPECT_INVARIANTS(cache);

  // The prefill stops answering; its posted writes may still land: fail, not reclaimable.
  ASSERT_TRUE(tm.end_external_write(*task, Aborted("prefill lease expired"), /*quiescent=*/false).ok());
  EXPECT_EQ(tm.wait(*task, 10s).code(), StatusCode::kAborted);
  ASSERT_TRUE(cache.complete_receive(r->id, 0, /*reclaimable=*/false).ok());
  ASSERT_TRUE(cache.release(r->id).ok());
  EXPECT_EQ(cache.stats().quarantined_device_blocks, 3u);
  ASSERT_TRUE(cache.commit_all(b->id).ok());
  ASSERT_TRUE(cache.release(b->id).ok());
  // Pressure again: the next request gets B's blocks, never the quarantined ones, and one more is refused.
  auto c = cache.admit(path({30, 31, 32}));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(disjoint(receiving, c->device_blocks));
  ASSERT_TRUE(d.run_plan().ok());
  ASSERT_TRUE(cache.release(c->id).ok());
  auto more = cache.admit(path({40, 41, 42, 43}));
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted) << more.status().to_string();
  EXPECT_EQ(tm.wait_device_blocks_free(as_ids(receiving), d.rig.compute()).code(), StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(cache);

  // The peer's connection is torn down (its writes can no longer land): the blocks are reused.
  ASSERT_TRUE(tm.release_external_write(*task).ok());
  ASSERT_TRUE(cache.ack_receive_reclaimable(r->id).ok());
  auto reuse = cache.admit(path({40, 41, 42, 43}));
  ASSERT_TRUE(reuse.ok()) << reuse.status().to_string();
  EXPECT_FALSE(disjoint(receiving, reuse->device_blocks));
  ASSERT_TRUE(d.run_plan().ok());
  EXPECT_TRUE(d.rig.compute_write(as_ids(reuse->device_blocks)).ok());
  ASSERT_TRUE(cache.commit_all(reuse->id).ok());
  ASSERT_TRUE(cache.release(reuse->id).ok());
  EXPECT_INVARIANTS(cache);
}

TEST(ReceiveHazard, LeadingLoadedBlocksJoinTheIndexAndServeTheirBytes) {
  Decode d;
  ASSERT_TRUE(d.rig.init().ok());
  CacheManager& cache = *d.cache;
  TransferManager& tm = d.tm();
  const auto keys = path({1, 2, 3});
  auto r = cache.admit_receive(keys);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(d.run_plan().ok());
  const std::vector<BlockId> receiving = receive_blocks(*r);
  auto task = tm.begin_external_write({}, as_ids(receiving));
  ASSERT_TRUE(task.ok());
  const std::uint32_t layers = d.layout().num_layers();
  for (std::uint32_t l = 0; l < layers; ++l) {
    for (BlockId b : receiving) d.peer_write(b, l, 700 + b);
    // The third block's layer 1 fails its checksum.
    std::vector<BlockId> failed;
    if (l == 1) failed.push_back(static_cast<BlockId>(receiving[2]));
    ASSERT_TRUE(tm.complete_external_layer(*task, l, failed).ok());
    // The decode forward waits for each layer on its stream, as for a local load.
    Status w = tm.wait_for_layer(*task, l, d.rig.compute());
    EXPECT_EQ(w.ok(), l != 1) << w.to_string();
  }
  EXPECT_EQ(tm.wait(*task, 10s).code(), StatusCode::kDataLoss);
  ASSERT_TRUE(tm.end_external_write(*task, Status::Ok(), /*quiescent=*/true).ok());
  // What may be committed: the leading blocks not failed (PdDecode's leading_loaded_blocks()).
  auto failed = tm.failed_blocks(*task);
  ASSERT_TRUE(failed.ok());
  std::uint32_t leading = 0;
  while (leading < receiving.size() &&
         std::count(failed->device.begin(), failed->device.end(), static_cast<BlockId>(receiving[leading])) == 0)
    ++leading;
  EXPECT_EQ(leading, 2u);
  ASSERT_TRUE(cache.complete_receive(r->id, leading, /*reclaimable=*/true).ok());
  MatchResult m = cache.match(keys);
  EXPECT_EQ(m.device_blocks, 2u);
  EXPECT_EQ(m.device_ids, std::vector<BlockId>(receiving.begin(), receiving.begin() + 2));
  // The failed block is recomputed into the same block and committed.
  ASSERT_TRUE(d.rig.compute_write(std::vector<BlockId>{static_cast<BlockId>(receiving[2])}).ok());
  ASSERT_TRUE(cache.commit_all(r->id).ok());
  ASSERT_TRUE(cache.release(r->id).ok());
  EXPECT_EQ(cache.match(keys).device_blocks, 3u);

  // Pressure moves the received blocks to host through the data plane: their host copies hold the peer's bytes.
  auto other = cache.admit(path({50, 51, 52, 53, 54, 55}));
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  ASSERT_TRUE(d.run_plan().ok());
  MatchResult after = cache.match(keys);
  ASSERT_EQ(after.host_blocks, 3u);
  for (std::uint32_t i = 0; i < 2; ++i)
    for (std::uint32_t l = 0; l < layers; ++l)
      EXPECT_TRUE(d.host_holds(static_cast<BlockId>(after.host_ids[i]), l, 700 + receiving[i]))
          << "block " << i << " layer " << l;
  ASSERT_TRUE(cache.release(other->id).ok());
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.received_blocks, 3u);
  EXPECT_EQ(s.received_committed_blocks, 2u);
  EXPECT_EQ(s.failed_transfers, 0u);
  EXPECT_INVARIANTS(cache);
}

// A failed receive whose peer may still write: the blocks that landed in every layer are served, evicted and
// reused like any cached block (the cache indexes them, the data plane releases them at the end); the failed
// one stays out of every pool and refuses every move until the peer is proven quiescent.
TEST(ReceiveHazard, FailedReceiveServesWhatLandedAndQuarantinesTheRest) {
  Decode d;
  ASSERT_TRUE(d.rig.init().ok());
  CacheManager& cache = *d.cache;
  TransferManager& tm = d.tm();
  const auto keys = path({1, 2, 3});
  auto r = cache.admit_receive(keys);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(d.run_plan().ok());
  const std::vector<BlockId> receiving = receive_blocks(*r);
  auto task = tm.begin_external_write({}, as_ids(receiving));
  ASSERT_TRUE(task.ok());
  for (std::uint32_t l = 0; l < d.layout().num_layers(); ++l) {
    for (BlockId b : receiving) d.peer_write(b, l, 900 + b);
    std::vector<BlockId> failed;
    if (l == 2) failed.push_back(static_cast<BlockId>(receiving[2]));
    ASSERT_TRUE(tm.complete_external_layer(*task, l, failed).ok());
  }
  // The prefill did not confirm that its writes are quiescent: not reclaimable.
  ASSERT_TRUE(tm.end_external_write(*task, Aborted("prefill silent"), /*quiescent=*/false).ok());
  ASSERT_TRUE(cache.complete_receive(r->id, 2, /*reclaimable=*/false).ok());
  ASSERT_TRUE(cache.release(r->id).ok());
  EXPECT_EQ(cache.match(keys).device_blocks, 2u);
  EXPECT_EQ(cache.stats().quarantined_device_blocks, 1u);

  // Pressure: a request that needs every other block. The two received blocks move to host through the
  // data plane (they are no longer declared), the quarantined one is neither given out nor moved.
  auto big = cache.admit(path({60, 61, 62, 63, 64}));
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  EXPECT_EQ(std::count(big->device_blocks.begin(), big->device_blocks.end(), receiving[2]), 0);
  ASSERT_TRUE(d.run_plan().ok());
  MatchResult m = cache.match(keys);
  ASSERT_EQ(m.host_blocks, 2u) << "the received blocks' evictions were refused or failed";
  for (std::uint32_t i = 0; i < 2; ++i)
    for (std::uint32_t l = 0; l < d.layout().num_layers(); ++l)
      EXPECT_TRUE(d.host_holds(static_cast<BlockId>(m.host_ids[i]), l, 900 + receiving[i]));
  EXPECT_EQ(cache.admit(path({70})).status().code(), StatusCode::kResourceExhausted);
  auto bad_load = tm.load_layers_to_device_async({}, std::vector<BlockId>{0},
                                                 std::vector<BlockId>{static_cast<BlockId>(receiving[2])});
  EXPECT_EQ(bad_load.status().code(), StatusCode::kFailedPrecondition) << bad_load.status().to_string();
  ASSERT_TRUE(cache.release(big->id).ok());
  EXPECT_INVARIANTS(cache);

  ASSERT_TRUE(tm.release_external_write(*task).ok());
  ASSERT_TRUE(cache.ack_receive_reclaimable(r->id).ok());
  auto all = cache.admit({}, kDeviceBlocks);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(std::count(all->device_blocks.begin(), all->device_blocks.end(), receiving[2]), 1);
  ASSERT_TRUE(d.rig.compute_write(as_ids(all->device_blocks)).ok());
  ASSERT_TRUE(cache.release(all->id).ok());
  EXPECT_EQ(cache.stats().failed_transfers, 0u);
  EXPECT_INVARIANTS(cache);
}

}  // namespace
}  // namespace kvtier::cache
