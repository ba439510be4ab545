// Three tiers at once with real bytes on every path: CacheManager plans whose device<->host moves
// run through the TransferManager (host backend, streams reordered by injected delays) and whose
// host<->storage moves run through a disk (or, with KVTIER_TEST_REDIS, Redis) StorageTier over the
// TransferManager's own host cache. Every loaded device block, every host page a load reads and
// every prefetched page must hold its key's bytes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "kvtier/cache/transfer_executor.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transfer/transfer_manager.h"
#include "sim/replay.h"
#include "tests/storage/storage_test_util.h"

namespace kvtier::cache {
namespace {

using storage::testing::TempDir;

constexpr std::uint64_t kBlockBytes = 4096 + 8;  // not a page multiple: pages are padded, tails move too

struct Rig {
  std::unique_ptr<HostDevice> device;
  std::unique_ptr<Stream> compute;
  Buffer memory;
  BlockSpace space;
  std::unique_ptr<TransferManager> manager;
  std::unique_ptr<TransferPlanExecutor> executor;
  std::unique_ptr<ReplayStorage> storage;  // over the manager's host cache: destroyed first
  ~Rig() { storage.reset(); }
};

void make_rig(Rig& rig, std::uint32_t device_blocks, std::uint32_t host_blocks, const std::string& storage_spec) {
  HostDeviceOptions opt;
  opt.min_delay = std::chrono::microseconds(0);
  opt.max_delay = std::chrono::microseconds(20);
  auto d = HostDevice::create(opt);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  rig.device = std::move(*d);
  auto s = rig.device->create_stream();
  ASSERT_TRUE(s.ok());
  rig.compute = std::move(*s);
  auto layout = KvLayout::uniform(1, 1, kBlockBytes);
  ASSERT_TRUE(layout.ok());
  auto mem = rig.device->allocate_device(std::uint64_t{device_blocks} * kBlockBytes);
  ASSERT_TRUE(mem.ok());
  rig.memory = std::move(*mem);
  auto space = BlockSpace::layer_first(MemoryKind::kDevice, 0, *layout, device_blocks, {{rig.memory.data()}});
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  rig.space = *space;
  KvCacheRegistration reg{rig.space, {}};
  reg.host.num_blocks = host_blocks;
  reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
  auto tm = TransferManager::create(*rig.device, *rig.compute, std::move(reg));
  ASSERT_TRUE(tm.ok()) << tm.status().to_string();
  rig.manager = std::move(*tm);
  rig.executor = std::make_unique<TransferPlanExecutor>(*rig.manager, *rig.device, *rig.compute, rig.space,
                                                        TransferPlanExecutor::Options{});
  auto rs = ReplayStorage::create_over(storage_spec, rig.manager->host_space());
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  rig.storage = std::move(*rs);
}

std::vector<TraceRequest> sample(std::size_t n) {
  auto t = load_mooncake_trace(std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl", n);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

// A small device tier and a host tier that catches part of the reuse: every tier serves hits.
ReplayOptions small_tiers(WritePolicy wp) {
  ReplayOptions o;
  o.device_blocks = 64;
  o.host_blocks = 2048;
  o.storage_blocks = 20000;
  o.policy = "lru";
  o.write_policy = wp;
  o.block_bytes = kBlockBytes;
  o.check_invariants_every = 25;
  return o;
}

void run_three_tiers(const std::string& spec, WritePolicy wp, std::size_t requests) {
  const auto trace = sample(requests);
  ASSERT_FALSE(trace.empty());
  ReplayOptions o = small_tiers(wp);
  Rig rig;
  make_rig(rig, o.device_blocks, o.host_blocks, spec);
  if (::testing::Test::HasFatalFailure()) return;
  o.executor = rig.executor.get();
  o.storage = rig.storage.get();
  auto r = replay_trace(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Every tier served hits, every path moved bytes, nothing failed, nothing wrong was served.
  EXPECT_GT(r->device_hit_blocks, 0u);
  EXPECT_GT(r->host_hit_blocks, 0u);
  EXPECT_GT(r->storage_hit_blocks, 0u);
  EXPECT_GT(rig.executor->bytes_d2h(), 0u);
  EXPECT_GT(rig.executor->bytes_h2d(), 0u);
  EXPECT_GT(r->bytes_to_storage, 0u);
  EXPECT_GE(r->bytes_from_storage, r->storage_hit_blocks * kBlockBytes);
  EXPECT_EQ(r->failed_transfers, 0u);
  EXPECT_EQ(rig.executor->failed_tasks(), 0u);
  EXPECT_EQ(r->failed_prefetches, 0u);
  EXPECT_EQ(r->failed_storage_writes, 0u);
  // Host pages (prefetched ones at their ack, and every page a load reads) and loaded device blocks.
  EXPECT_GT(r->verified_blocks, r->storage_hit_blocks);
  EXPECT_EQ(r->verification_failures, 0u);
  EXPECT_GE(rig.executor->verified(), r->host_hit_blocks + r->storage_hit_blocks);
  EXPECT_EQ(rig.executor->verification_failures(), 0u);

  // Write-back: the same replay with no bytes (fake executor, simulated storage) makes the same
  // decisions. (Write-through backs up every block: whether a backup is still in flight when a later
  // request matches depends on the streams' timing.)
  if (wp != WritePolicy::kWriteBack) return;
  ReplayOptions fake = small_tiers(wp);
  auto f = replay_trace(trace, fake);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(r->device_hit_blocks, f->device_hit_blocks);
  EXPECT_EQ(r->host_hit_blocks, f->host_hit_blocks);
  EXPECT_EQ(r->storage_hit_blocks, f->storage_hit_blocks);
}

class ThreeTierReplay : public ::testing::TestWithParam<WritePolicy> {};

TEST_P(ThreeTierReplay, DiskTierRealBytesOnEveryPath) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  // Process durability, buffered I/O: the bytes are under test here, not the disk (O_DIRECT writes
  // take seconds on a loaded CI machine).
  run_three_tiers("disk:" + dir.path() + "?durability=process&direct=off", GetParam(), 300);
}

TEST_P(ThreeTierReplay, RedisTierRealBytesOnEveryPath) {
  const char* ep = std::getenv("KVTIER_TEST_REDIS");
  if (!ep || !*ep) GTEST_SKIP() << "KVTIER_TEST_REDIS not set";
  const char* pw = std::getenv("KVTIER_TEST_REDIS_PASSWORD");
  const std::string spec = std::string("redis://") + (pw && *pw ? std::string(":") + pw + "@" : "") + ep +
                           "?prefix=kvtier-three-tier-test-" + std::to_string(::getpid()) + "-" +
                           std::string(write_policy_name(GetParam()));
  run_three_tiers(spec, GetParam(), 300);
}

INSTANTIATE_TEST_SUITE_P(WritePolicies, ThreeTierReplay,
                         ::testing::Values(WritePolicy::kWriteBack, WritePolicy::kWriteThrough),
                         [](const auto& info) { return std::string(write_policy_name(info.param)); });

TEST(ThreeTierReplay, StorageOverTheHostCacheNeedsAPageFirstHostSpace) {
  TempDir dir;
  std::vector<std::byte> mem(8 * 4096);
  auto layout = KvLayout::uniform(1, 1, 4096);
  ASSERT_TRUE(layout.ok());
  auto layer_first = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, *layout, 8, {{mem.data()}});
  ASSERT_TRUE(layer_first.ok());
  auto rs = ReplayStorage::create_over("disk:" + dir.path(), *layer_first);
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().code(), StatusCode::kInvalidArgument) << rs.status().to_string();
  // A storage tier with its own host memory cannot be combined with a device executor.
  ReplayOptions o = small_tiers(WritePolicy::kWriteBack);
  auto own = ReplayStorage::create("disk:" + dir.path(), o.host_blocks, 4096);
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  Rig rig;
  make_rig(rig, o.device_blocks, o.host_blocks, "disk:" + dir.path() + "/other");
  if (::testing::Test::HasFatalFailure()) return;
  o.executor = rig.executor.get();
  o.storage = own->get();
  o.block_bytes = 4096;
  auto r = replay_trace(sample(10), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
}

}  // namespace
}  // namespace kvtier::cache
