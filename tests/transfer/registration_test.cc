// Registration from the name map of FastDeploy's CacheTransferManager, EventPool
// and HazardTracker units.
#include "kvtier/transfer/registration.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kvtier/device/host_device.h"
#include "kvtier/transfer/transfer_manager.h"
#include "transfer/event_pool.h"
#include "transfer/hazard_tracker.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

KvLayout gqa(std::uint32_t layers, bool scales, std::uint32_t draft = 0) {
  GqaShape s;
  s.num_layers = layers;
  s.num_draft_layers = draft;
  s.kv_heads = 2;
  s.block_tokens = 4;
  s.head_dim = 8;
  s.fp8_scales = scales;
  if (scales) s.dtype = DType::kFp8E4M3;
  auto l = KvLayout::gqa(s);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return *l;
}

struct NameMap {
  std::vector<std::vector<std::byte>> storage;
  std::map<std::string, TensorDesc> tensors;
  void add(const std::string& name, std::vector<std::int64_t> shape, DType dtype) {
    std::uint64_t n = dtype_bytes(dtype);
    for (auto d : shape) n *= static_cast<std::uint64_t>(d);
    storage.emplace_back(n);
    TensorDesc t;
    t.data = storage.back().data();
    t.shape = shape;
    t.dtype = dtype;
    tensors[name] = t;
  }
};

// What FastDeploy builds for `layout` on rank r, device d.
NameMap seed_map(const KvLayout& layout, int rank, int dev, std::int64_t blocks, bool fp8_as_uint8) {
  NameMap m;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (const auto& role : layout.layer(l).roles) {
      DType dt = role.dtype;
      if (fp8_as_uint8 && (dt == DType::kFp8E4M3 || dt == DType::kFp8E5M2)) dt = DType::kUint8;
      const std::int64_t elems = static_cast<std::int64_t>(role.block_bytes / dtype_bytes(dt));
      m.add(seed_tensor_name(role.role, role.name, l, rank, dev), {blocks, 2, elems / 2}, dt);
    }
  return m;
}

TEST(Registration, SeedNames) {
  EXPECT_EQ(seed_tensor_name(Role::kKey, "", 3, 0, 1), "key_caches_3_rank0.device1");
  EXPECT_EQ(seed_tensor_name(Role::kValueScale, "", 0, 2, 5), "value_cache_scales_0_rank2.device5");
  EXPECT_EQ(seed_tensor_name(Role::kLatent, "", 7, 0, 0), "key_caches_7_rank0.device0");
  EXPECT_EQ(seed_tensor_name(Role::kIndexer, "", 7, 0, 0), "indexer_caches_7_rank0.device0");
}

TEST(Registration, NameMapGqaWithScalesAndDraft) {
  KvLayout layout = gqa(3, true, 1);
  NameMap m = seed_map(layout, 1, 4, 10, /*fp8_as_uint8=*/true);
  auto space = device_space_from_name_map(m.tensors, layout, 1, 4, /*device_ordinal=*/0);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  EXPECT_EQ(space->num_blocks(), 10u);
  EXPECT_EQ(space->device_ordinal(), 0);
  EXPECT_EQ(space->plane(3, 2).base, static_cast<std::byte*>(m.tensors.at("key_cache_scales_3_rank1.device4").data));
}

// Layers at or above num_model_layers are draft (MTP) layers. 0 took every layer of the map for one, without a word
// (a layer count read as 0); refused naming the value. Fewer than the map's layers is a model with draft layers.
// Shapes and strides whose byte counts wrap 64 bits: [4, 2^62 + 16] of fp32 read as 64-byte blocks, and a block
// stride of 2^62 + 16 elements as 64 bytes; both were registered. Each is refused, naming the tensor.
TEST(Registration, ShapesAndStridesThatWrapAreRefused) {
  const std::int64_t wraps = (std::int64_t{1} << 62) + 16;
  std::map<std::string, TensorDesc> tensors;
  std::vector<std::byte> backing(4096);
  for (const char* name : {"key_caches_0_rank0.device0", "value_caches_0_rank0.device0"}) {
    TensorDesc t;
    t.data = backing.data();
    t.shape = {4, wraps};
    t.dtype = DType::kFp32;
    tensors[name] = t;
  }
  auto layout = layout_from_name_map(tensors, 1, 0, 0, 4);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("is more than"), std::string::npos) << layout.status().to_string();
  // A sane shape with a block stride that wraps in bytes.
  for (auto& [name, t] : tensors) {
    t.shape = {4, 16};
    t.strides = {wraps, 1};
  }
  auto good_layout = layout_from_name_map(tensors, 1, 0, 0, 4);
  ASSERT_TRUE(good_layout.ok()) << good_layout.status().to_string();
  auto space = device_space_from_name_map(tensors, *good_layout, 0, 0, /*device_ordinal=*/0);
  ASSERT_FALSE(space.ok());
  EXPECT_NE(space.status().message().find("overflows 64 bits"), std::string::npos) << space.status().to_string();
}

TEST(Registration, ZeroModelLayersIsRefused) {
  KvLayout layout = gqa(4, false, 0);
  NameMap m = seed_map(layout, 0, 0, 8, false);
  auto zero = layout_from_name_map(m.tensors, 0, 0, 0, 4);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("num_model_layers 0"), std::string::npos) << zero.status().to_string();
  auto with_draft = layout_from_name_map(m.tensors, 3, 0, 0, 4);
  ASSERT_TRUE(with_draft.ok()) << with_draft.status().to_string();
  EXPECT_TRUE(with_draft->layer(3).draft);
  EXPECT_FALSE(with_draft->layer(2).draft);
}

TEST(Registration, NameMapMlaWithIndexer) {
  MlaShape s;
  s.num_layers = 2;
  s.block_tokens = 4;
  s.latent_dim = 8;
  s.indexer_dim = 4;
  auto layout = KvLayout::mla(s);
  ASSERT_TRUE(layout.ok());
  NameMap m = seed_map(*layout, 0, 0, 6, true);
  auto space = device_space_from_name_map(m.tensors, *layout, 0, 0, 0);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  EXPECT_EQ(m.tensors.count("value_caches_0_rank0.device0"), 0u);
}

TEST(Registration, MissingTensorIsNamedWithOtherRankHint) {
  KvLayout layout = gqa(2, false);
  NameMap m = seed_map(layout, 0, 0, 8, false);
  auto r = device_space_from_name_map(m.tensors, layout, /*rank=*/1, 0, 0);  // DP>1: rank 1 looks up rank 0's names
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("key_caches_0_rank1.device0"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("rank0.device0"), std::string::npos) << r.status().message();
  m.tensors.erase("value_caches_1_rank0.device0");
  r = device_space_from_name_map(m.tensors, layout, 0, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("value_caches_1_rank0.device0"), std::string::npos);
}

TEST(Registration, MisshapedTensorsAreErrorsNamingTheTensor) {
  KvLayout layout = gqa(2, false);
  {
    NameMap m = seed_map(layout, 0, 0, 8, false);
    m.tensors["key_caches_1_rank0.device0"].shape = {8, 2, 4, 4};  // half the bytes
    auto r = device_space_from_name_map(m.tensors, layout, 0, 0, 0);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("key_caches_1_rank0.device0"), std::string::npos) << r.status().message();
  }
  {
    NameMap m = seed_map(layout, 0, 0, 8, false);
    m.tensors["value_caches_0_rank0.device0"].shape[0] = 7;  // block count differs
    auto r = device_space_from_name_map(m.tensors, layout, 0, 0, 0);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("7 blocks"), std::string::npos) << r.status().message();
  }
  {
    NameMap m = seed_map(layout, 0, 0, 8, false);
    m.tensors["value_caches_0_rank0.device0"].dtype = DType::kFp32;
    m.tensors["value_caches_0_rank0.device0"].shape = {8, 2, 8};
    auto r = device_space_from_name_map(m.tensors, layout, 0, 0, 0);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("dtype fp32"), std::string::npos) << r.status().message();
  }
  {
    NameMap m = seed_map(layout, 0, 0, 8, false);
    m.tensors["key_caches_0_rank0.device0"].data = nullptr;
    EXPECT_EQ(device_space_from_name_map(m.tensors, layout, 0, 0, 0).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(Registration, UnlistedKvTensorIsAnError) {
  // The model has an MTP draft layer the layout forgot: it would go stale.
  KvLayout with_draft = gqa(2, false, 1);
  KvLayout without = gqa(2, false);
  NameMap m = seed_map(with_draft, 0, 0, 8, false);
  auto r = device_space_from_name_map(m.tensors, without, 0, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("key_caches_2_rank0.device0"), std::string::npos) << r.status().message();
  // Scales present but the layout has none (FastDeploy's CacheTransferManager
  // never loaded them).
  KvLayout scaled = gqa(2, true);
  NameMap ms = seed_map(scaled, 0, 0, 8, true);
  KvLayout plain = gqa(2, false);
  NameMap mp = seed_map(plain, 0, 0, 8, false);
  for (auto& [n, t] : ms.tensors)
    if (n.find("scales") != std::string::npos) mp.tensors[n] = t;
  r = device_space_from_name_map(mp.tensors, plain, 0, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cache_scales"), std::string::npos) << r.status().message();
  // Tensors of other ranks are ignored.
  NameMap other = seed_map(plain, 0, 0, 8, false);
  NameMap rank1 = seed_map(plain, 1, 0, 8, false);
  for (auto& [n, t] : rank1.tensors) other.tensors[n] = t;
  EXPECT_TRUE(device_space_from_name_map(other.tensors, plain, 0, 0, 0).ok());
}

TEST(Registration, HostNameMap) {
  KvLayout layout = gqa(2, false);
  std::map<std::string, void*> ptrs;
  std::vector<std::vector<std::byte>> mem;
  for (std::uint32_t l = 0; l < 2; ++l)
    for (const auto& role : layout.layer(l).roles) {
      mem.emplace_back(role.block_bytes * 5);
      ptrs[seed_tensor_name(role.role, "", l, 0, 2)] = mem.back().data();
    }
  auto hs = host_space_from_name_map(ptrs, layout, 5, 0, 2, 0);
  ASSERT_TRUE(hs.ok()) << hs.status().to_string();
  EXPECT_EQ(hs->kind(), MemoryKind::kPinnedHost);
  EXPECT_EQ(hs->block_ptr(1, 1, 3), mem[3].data() + 3 * layout.block_bytes(1, 1));
  ptrs.erase("key_caches_1_rank0.device2");
  auto bad = host_space_from_name_map(ptrs, layout, 5, 0, 2, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("key_caches_1_rank0.device2"), std::string::npos);
}

// The maps of FastDeploy's CacheTransferManager straight into a working manager:
// evict, then load back.
TEST(Registration, NameMapToWorkingManager) {
  auto dev = HostDevice::create();
  ASSERT_TRUE(dev.ok());
  KvLayout layout = gqa(2, true, 1);
  NameMap m = seed_map(layout, 0, 3, 6, true);
  std::map<std::string, void*> host;
  std::vector<std::vector<std::byte>> host_mem;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (const auto& role : layout.layer(l).roles) {
      host_mem.emplace_back(role.block_bytes * 4, std::byte{0});
      host[seed_tensor_name(role.role, "", l, 0, 3)] = host_mem.back().data();
    }
  for (std::size_t i = 0; i < m.storage.size(); ++i)
    for (std::size_t b = 0; b < m.storage[i].size(); ++b) m.storage[i][b] = static_cast<std::byte>(i * 31 + b);
  auto reg = registration_from_name_map(m.tensors, &host, 4, layout, 0, 3, (*dev)->ordinal());
  ASSERT_TRUE(reg.ok()) << reg.status().to_string();
  auto compute = (*dev)->create_stream();
  auto mgr = TransferManager::create(**dev, **compute, *reg);
  ASSERT_TRUE(mgr.ok()) << mgr.status().to_string();
  std::vector<BlockId> d = {5, 1}, h = {0, 3};
  auto ev = (*mgr)->evict_to_host_async(d, h);
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE((*mgr)->wait(*ev, 5s).ok());
  // Every role of every layer, scales and the draft layer included, reached the host.
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const auto bb = layout.block_bytes(l, r);
      const auto* src = static_cast<const std::byte*>(
          m.tensors.at(seed_tensor_name(layout.layer(l).roles[r].role, "", l, 0, 3)).data);
      const auto* dst =
          static_cast<const std::byte*>(host[seed_tensor_name(layout.layer(l).roles[r].role, "", l, 0, 3)]);
      EXPECT_EQ(std::memcmp(dst + 3 * bb, src + 1 * bb, bb), 0) << "layer " << l << " role " << r;
      EXPECT_EQ(std::memcmp(dst + 0 * bb, src + 5 * bb, bb), 0) << "layer " << l << " role " << r;
    }
  std::vector<BlockId> d2 = {0};
  std::vector<BlockId> h2 = {3};
  auto ld = (*mgr)->load_layers_to_device_async({}, h2, d2);
  ASSERT_TRUE(ld.ok());
  ASSERT_TRUE((*mgr)->wait(*ld, 5s).ok());
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const auto bb = layout.block_bytes(l, r);
      const auto* p = static_cast<const std::byte*>(
          m.tensors.at(seed_tensor_name(layout.layer(l).roles[r].role, "", l, 0, 3)).data);
      EXPECT_EQ(std::memcmp(p, p + 1 * bb, bb), 0) << "layer " << l << " role " << r;
    }
  EXPECT_TRUE((*mgr)->stats().has_scales);
  EXPECT_EQ((*mgr)->stats().num_draft_layers, 1u);
}

TEST(EventPool, ReusesReturnedEvents) {
  auto dev = HostDevice::create();
  ASSERT_TRUE(dev.ok());
  auto pool = EventPool::create(**dev, 2, 8);
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->created(), 2u);
  {
    auto a = (*pool)->acquire();
    auto b = (*pool)->acquire();
    auto c = (*pool)->acquire();
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ((*pool)->created(), 3u);
    EXPECT_EQ((*pool)->free_count(), 0u);
  }
  EXPECT_EQ((*pool)->free_count(), 3u);
  auto d = (*pool)->acquire();
  EXPECT_EQ((*pool)->created(), 3u);
  // A lease may outlive the pool object.
  pool->reset();
  d->reset();
}

TEST(HazardTracker, OrdersReadsAndWritesAcrossStreams) {
  HostDeviceOptions o;
  auto dev = HostDevice::create(o);
  ASSERT_TRUE(dev.ok());
  auto s1 = (*dev)->create_stream();
  auto s2 = (*dev)->create_stream();
  auto pool = EventPool::create(**dev);
  HazardTracker t(**dev, 4, "device");
  EXPECT_EQ(t.check_ids(std::vector<BlockId>{0, 4}, "x").code(), StatusCode::kOutOfRange);
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  ASSERT_TRUE((*dev)
                  ->enqueue_task(**s1,
                                 [&]() -> Status {
                                   std::unique_lock<std::mutex> lock(mu);
                                   cv.wait(lock, [&] { return open; });
                                   return Status::Ok();
                                 })
                  .ok());
  auto w = (*pool)->acquire();
  ASSERT_TRUE((*dev)->record(**w, **s1).ok());
  std::vector<BlockId> b0 = {0};
  auto origin = std::make_shared<WriteOrigin>(1);
  t.note_write(b0, *w, (*s1)->id(), origin, true);
  EXPECT_FALSE(*t.is_free(0));
  EXPECT_TRUE(*t.is_free(1));
  EventSet waits;
  SourceOrigins src;
  t.hazards_for_read(b0, (*s2)->id(), waits, &src);
  EXPECT_EQ(waits.events().size(), 1u);
  ASSERT_EQ(src.size(), 1u);
  EXPECT_EQ(src[0].second, origin);
  waits.clear();
  t.hazards_for_read(b0, (*s1)->id(), waits, nullptr);  // same stream: ordered already
  EXPECT_TRUE(waits.empty());
  EXPECT_EQ(t.wait_free_host(b0, 5ms).code(), StatusCode::kTimedOut);
  {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
  }
  cv.notify_all();
  EXPECT_TRUE(t.wait_free_host(b0, 5s).ok());
  EXPECT_TRUE(*t.is_free(0));
  origin->all_failed = true;
  origin->state.store(WriteOrigin::kFailed);
  EXPECT_TRUE(t.last_write_failed(0));
  auto w2 = (*pool)->acquire();
  ASSERT_TRUE((*dev)->record(**w2, **s2).ok());
  t.note_write(b0, *w2, (*s2)->id(), nullptr, /*full=*/false);
  EXPECT_TRUE(t.last_write_failed(0)) << "a partial write keeps the failure";
  t.note_write(b0, *w2, (*s2)->id(), nullptr, /*full=*/true);
  EXPECT_FALSE(t.last_write_failed(0));
  ASSERT_TRUE((*dev)->synchronize(**s2, 5s).ok());
}

}  // namespace
}  // namespace kvtier
