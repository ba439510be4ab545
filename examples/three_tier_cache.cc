// A three-tier KV cache: GPU blocks, pinned host blocks and a storage tier below them, kept by kvtier's
// CacheManager (prefix index, eviction policy, write-back) while a TransferManager and a storage tier move the
// bytes. Conversations come and go until the first one's KV has left the GPU and the host for storage; when it
// returns, its prefix is prefetched from storage and loaded back instead of recomputed.
//
//   three_tier_cache [--host]
//
// The storage tier here is kvtier's host-memory tier so that the example runs anywhere; a disk directory
// ("disk:/var/cache/kvtier?capacity=200G") or Redis ("redis://host:6379") is one line away
// (storage::make_storage_backend). Every load is checked against the bytes its block held when it was computed
// (TransferPlanExecutor's byte checks); exit status 0 only when the returning prefix was served from storage and
// every checked byte matched.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/cache/block_key.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/cache/storage_executor.h"
#include "kvtier/cache/transfer_executor.h"
#include "kvtier/core/layout.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "kvtier/storage/memory_backend.h"
#include "kvtier/storage/storage_tier.h"
#include "kvtier/transfer/registration.h"
#include "kvtier/transfer/transfer_manager.h"

namespace {

using namespace kvtier;
using namespace kvtier::cache;

constexpr std::uint32_t kDeviceBlocks = 16, kHostBlocks = 24, kStorageBlocks = 512, kBlockTokens = 16;

// The scheduler's side of one step: take the plan, run it, wait for its moves (with a deadline), apply the acks.
Status step(CacheManager& cache, CompositePlanExecutor& exec, TransferPlanExecutor& transfers,
            StoragePlanExecutor& storage) {
  StepPlan plan = cache.take_plan();
  KVTIER_RETURN_IF_ERROR(exec.execute(plan));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (transfers.in_flight() + storage.in_flight() > 0) {
    if (std::chrono::steady_clock::now() > deadline) return TimedOut("a step's moves took over 60 s");
    KVTIER_RETURN_IF_ERROR(apply_completions(cache, exec.poll()));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return apply_completions(cache, exec.poll());
}

Status run(bool force_host) {
  // The device and the model's KV layout (4 layers of GQA K and V, 16 tokens per block).
  std::unique_ptr<Device> device;
  if (!force_host && cuda_device_count() > 0) {
    KVTIER_ASSIGN_OR_RETURN(device, create_cuda_device(0));
  } else {
    KVTIER_ASSIGN_OR_RETURN(auto host, HostDevice::create());
    device = std::move(host);
  }
  KVTIER_ASSIGN_OR_RETURN(auto compute, device->create_stream({StreamPriority::kNormal, "forward"}));
  GqaShape shape;
  shape.num_layers = 4;
  shape.kv_heads = 2;
  shape.block_tokens = kBlockTokens;
  shape.head_dim = 64;
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::gqa(shape));

  // Tier 1 and 2: the engine's device blocks and kvtier's pinned host blocks (page-first: one storage object per
  // block), moved by a TransferManager.
  std::vector<Buffer> regions;
  std::vector<std::vector<void*>> bases(layout.num_layers());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      KVTIER_ASSIGN_OR_RETURN(Buffer b, device->allocate_device(layout.block_bytes(l, r) * kDeviceBlocks));
      bases[l].push_back(b.data());
      regions.push_back(std::move(b));
    }
  KvCacheRegistration reg;
  KVTIER_ASSIGN_OR_RETURN(
      reg.device, BlockSpace::layer_first(MemoryKind::kDevice, device->ordinal(), layout, kDeviceBlocks, bases));
  reg.host.num_blocks = kHostBlocks;
  reg.host.arrangement = HostCacheSpec::Arrangement::kPageFirst;
  KVTIER_ASSIGN_OR_RETURN(auto tm, TransferManager::create(*device, *compute, std::move(reg)));

  // Tier 3: a storage backend behind the host blocks.
  storage::MemoryBackendConfig mem;
  mem.capacity_bytes = 64ull << 20;
  KVTIER_ASSIGN_OR_RETURN(auto backend, storage::create_memory_backend(
                                            mem, storage::StorageTier::storage_options(layout, "org/model@rev")));
  KVTIER_ASSIGN_OR_RETURN(auto tier, storage::StorageTier::create(std::move(backend), tm->host_space(), 0));

  // The cache: pools of the three tiers, LRU, write-back (a block reaches host and storage as it is evicted).
  CacheConfig config;
  config.device_blocks = kDeviceBlocks;
  config.host_blocks = kHostBlocks;
  config.storage_blocks = kStorageBlocks;
  config.write_policy = WritePolicy::kWriteBack;
  KVTIER_ASSIGN_OR_RETURN(auto cache, CacheManager::create(config));
  TransferPlanExecutor transfers(*tm, *device, *compute, tm->device_space(), {});
  StoragePlanExecutor storage_moves(*tier);
  CompositePlanExecutor exec(transfers, storage_moves);

  // Block keys from token ids, chained (a block's key covers its whole prefix).
  KeyNamespace ns;
  ns.model_id = "org/model@rev";
  ns.layout_fingerprint = layout.fingerprint();
  ns.block_tokens = kBlockTokens;
  KVTIER_ASSIGN_OR_RETURN(KeyHasher hasher, KeyHasher::create(ns));
  auto conversation = [&](int c) -> Result<std::vector<BlockKey>> {
    std::vector<std::int32_t> tokens(4 * kBlockTokens);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = 1000 * c + static_cast<std::int32_t>(i);
    return hasher.keys_for(tokens);
  };

  // One request: admit (match, pin, allocate; loads of host hits), run the step, "compute" the rest, release.
  auto request = [&](const std::vector<BlockKey>& keys) -> Result<Admission> {
    Result<Admission> a = cache->admit(keys);
    if (!a.ok() && a.status().code() == StatusCode::kResourceExhausted) {
      KVTIER_RETURN_IF_ERROR(step(*cache, exec, transfers, storage_moves));  // host room once writes land
      a = cache->admit(keys);
    }
    KVTIER_RETURN_IF_ERROR(a.status());
    KVTIER_RETURN_IF_ERROR(step(*cache, exec, transfers, storage_moves));
    KVTIER_RETURN_IF_ERROR(cache->commit_all(a->id));  // the forward computed the blocks that missed
    KVTIER_RETURN_IF_ERROR(cache->release(a->id));
    return a;
  };

  KVTIER_ASSIGN_OR_RETURN(std::vector<BlockKey> first, conversation(0));
  KVTIER_RETURN_IF_ERROR(request(first).status());
  for (int c = 1; c <= 12; ++c) {  // 48 more blocks through 16 device and 24 host blocks
    KVTIER_ASSIGN_OR_RETURN(std::vector<BlockKey> keys, conversation(c));
    KVTIER_RETURN_IF_ERROR(request(keys).status());
  }
  MatchResult m = cache->match(first);
  std::printf("conversation 0 now: %u blocks on device, %u on host, %u in storage\n", m.device_blocks, m.host_blocks,
              m.storage_blocks);
  if (m.storage_blocks != first.size()) return FailedPrecondition("conversation 0 did not reach storage");

  // It returns: prefetch its prefix from storage to host (a few steps while the host makes room), then admit it:
  // its blocks load host -> device instead of being recomputed.
  std::uint32_t queued = 0;
  for (int round = 0; round < 8 && queued < first.size(); ++round) {
    KVTIER_ASSIGN_OR_RETURN(std::uint32_t q, cache->prefetch(first));
    queued += q;
    KVTIER_RETURN_IF_ERROR(step(*cache, exec, transfers, storage_moves));
  }
  KVTIER_ASSIGN_OR_RETURN(Admission back, request(first));
  std::printf("conversation 0 returns: %u blocks loaded from host (prefetched from storage), %u recomputed\n",
              back.host_hit_blocks, back.new_blocks);
  std::printf("device loads checked: %llu, mismatches: %llu; storage wrote %llu bytes\n",
              static_cast<unsigned long long>(transfers.verified()),
              static_cast<unsigned long long>(transfers.verification_failures()),
              static_cast<unsigned long long>(storage_moves.bytes_written()));
  if (transfers.verification_failures() != 0) return DataLoss("a loaded block differs from its computed bytes");
  if (back.host_hit_blocks != first.size()) return FailedPrecondition("the prefix was not served from storage");
  KVTIER_RETURN_IF_ERROR(cache->check_invariants());
  return tm->shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  const bool force_host = argc > 1 && std::strcmp(argv[1], "--host") == 0;
  const Status st = run(force_host);
  if (!st.ok()) {
    std::fprintf(stderr, "three_tier_cache: %s\n", st.to_string().c_str());
    return 1;
  }
  return 0;
}
