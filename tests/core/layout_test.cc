#include "kvtier/core/layout.h"

#include <gtest/gtest.h>

#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace kvtier {
namespace {

TEST(KvLayout, GqaShapeBytes) {
  GqaShape s;  // 32 layers, 8 heads, 64 tokens, head_dim 128, bf16
  auto layout = KvLayout::gqa(s);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  EXPECT_EQ(layout->num_layers(), 32u);
  EXPECT_EQ(layout->num_roles(0), 2u);
  EXPECT_EQ(layout->block_bytes(0, 0), 128u * 1024u);  // 8*64*128*2
  EXPECT_EQ(layout->total_block_bytes(), 32u * 2u * 128u * 1024u);
  EXPECT_EQ(layout->num_planes(), 64u);
}

TEST(KvLayout, Fp8ScalesAndDraftLayers) {
  GqaShape s;
  s.num_layers = 4;
  s.num_draft_layers = 1;
  s.dtype = DType::kFp8E4M3;
  s.fp8_scales = true;
  auto layout = KvLayout::gqa(s);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->num_layers(), 5u);
  EXPECT_TRUE(layout->layer(4).draft);
  EXPECT_FALSE(layout->layer(3).draft);
  ASSERT_EQ(layout->num_roles(0), 4u);
  EXPECT_EQ(layout->block_bytes(0, 0), 8u * 64 * 128);  // fp8 K
  EXPECT_EQ(layout->block_bytes(0, 2), 8u * 64 * 2);    // bf16 scale per (head, token)
  auto r = layout->find_role(2, Role::kValueScale);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 3u);
}

TEST(KvLayout, MlaWithIndexerHasNoValue) {
  MlaShape s;
  s.num_layers = 3;
  s.indexer_dim = 128;
  auto layout = KvLayout::mla(s);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->num_roles(0), 2u);
  EXPECT_EQ(layout->layer(0).roles[0].role, Role::kLatent);
  EXPECT_EQ(layout->block_bytes(0, 0), 64u * 576 * 2);  // 73728 B, not a power of two
  EXPECT_EQ(layout->find_role(0, Role::kValue).status().code(), StatusCode::kNotFound);
}

TEST(KvLayout, RejectsBadDescriptions) {
  EXPECT_EQ(KvLayout::create({}, 16).status().code(), StatusCode::kInvalidArgument);
  LayerLayout empty;
  EXPECT_EQ(KvLayout::create({empty}, 16).status().code(), StatusCode::kInvalidArgument);
  LayerLayout zero;
  zero.roles.push_back({Role::kKey, DType::kBf16, 0, {}});
  auto s = KvLayout::create({zero}, 16).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block_bytes 0"), std::string::npos);
  LayerLayout dup;
  dup.roles.push_back({Role::kKey, DType::kBf16, 10, {}});
  dup.roles.push_back({Role::kKey, DType::kBf16, 10, {}});
  EXPECT_EQ(KvLayout::create({dup}, 16).status().code(), StatusCode::kInvalidArgument);
  LayerLayout unnamed;
  unnamed.roles.push_back({Role::kOther, DType::kUint8, 10, {}});
  EXPECT_EQ(KvLayout::create({unnamed}, 16).status().code(), StatusCode::kInvalidArgument);
  unnamed.roles[0].name = "router_cache";
  EXPECT_TRUE(KvLayout::create({unnamed}, 16).ok());
}

// The roles' sizes summed past 2^64: uniform(2, 2, 2^63) was a layout of 0 bytes per block.
TEST(KvLayout, RejectsBlocksWhoseSizeWraps) {
  const auto wrapped = KvLayout::uniform(2, 2, std::uint64_t{1} << 63);
  ASSERT_FALSE(wrapped.ok());
  EXPECT_EQ(wrapped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("9223372036854775808"), std::string::npos) << wrapped.status().to_string();
  EXPECT_FALSE(KvLayout::uniform(1, 1, KvLayout::kMaxBlockBytes + 1).ok());
  const auto largest = KvLayout::uniform(1, 1, KvLayout::kMaxBlockBytes);
  ASSERT_TRUE(largest.ok()) << largest.status().to_string();
  EXPECT_EQ(largest->total_block_bytes(),
            KvLayout::kMaxBlockBytes);  // A shape's product of dimensions wrapped past 2^64 into a size create() took
                                        // (65536 x 65536 x (2^31 + 1) x 2
  // bytes came out as 8 GiB).
  GqaShape gqa;
  gqa.kv_heads = 65536;
  gqa.block_tokens = 65536;
  gqa.head_dim = (1u << 31) + 1;
  EXPECT_EQ(KvLayout::gqa(gqa).status().code(), StatusCode::kInvalidArgument);
  MlaShape mla;
  mla.block_tokens = 1u << 31;
  mla.latent_dim = 1u << 31;
  EXPECT_EQ(KvLayout::mla(mla).status().code(), StatusCode::kInvalidArgument);
}

TEST(KvLayout, FingerprintDistinguishesLayouts) {
  GqaShape a;
  GqaShape b = a;
  b.token_order = TokenOrder::kNhd;
  GqaShape c = a;
  c.head_dim = 64;
  auto la = KvLayout::gqa(a), la2 = KvLayout::gqa(a), lb = KvLayout::gqa(b), lc = KvLayout::gqa(c);
  EXPECT_EQ(la->fingerprint(), la2->fingerprint());
  EXPECT_NE(la->fingerprint(), lb->fingerprint());
  EXPECT_NE(la->fingerprint(), lc->fingerprint());
}

TEST(BlockSpace, LayerFirstAddresses) {
  auto layout = *KvLayout::uniform(2, 2, 100);  // odd size: 100 bytes
  std::vector<std::vector<std::byte>> mem(4, std::vector<std::byte>(100 * 7));
  auto space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, 7,
                                       {{mem[0].data(), mem[1].data()}, {mem[2].data(), mem[3].data()}});
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  EXPECT_EQ(space->block_ptr(1, 0, 3), mem[2].data() + 300);
  EXPECT_EQ(space->page_bytes(), 0u);
}

TEST(BlockSpace, PageFirstPacksEveryRoleOfABlock) {
  auto layout = *KvLayout::uniform(3, 2, 100);
  const auto page = BlockSpace::page_first_page_bytes(layout, 4096, 16);
  // roles at 0,112,224,336,448,560 -> 660 bytes, page aligned to 4096
  EXPECT_EQ(page, 4096u);
  std::vector<std::byte> mem(page * 5);
  auto space = BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, 5, mem.data(), mem.size(), 4096, 16);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  EXPECT_EQ(space->block_ptr(0, 0, 2), mem.data() + 2 * 4096);
  EXPECT_EQ(space->block_ptr(2, 1, 2), mem.data() + 2 * 4096 + 560);
  EXPECT_EQ(space->page_bytes(), 4096u);
  auto small = BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, 5, mem.data(), mem.size() - 1, 4096, 16);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
}

TEST(BlockSpace, InterleavedKvAccepted_OverlapRejected) {
  auto layout = *KvLayout::uniform(1, 2, 64);
  std::vector<std::byte> mem(64 * 2 * 10);
  // K/V interleaved inside each block: [num_blocks, 2, 64 B]
  auto ok = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, 10,
                                    {{Plane{mem.data(), 128}, Plane{mem.data() + 64, 128}}});
  EXPECT_TRUE(ok.ok()) << ok.status().to_string();
  auto overlap = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, 10,
                                         {{Plane{mem.data(), 64}, Plane{mem.data() + 64, 64}}});
  EXPECT_EQ(overlap.status().code(), StatusCode::kInvalidArgument);
  auto small_stride = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, 10,
                                              {{Plane{mem.data(), 32}, Plane{mem.data() + 640, 64}}});
  EXPECT_EQ(small_stride.status().code(), StatusCode::kInvalidArgument);
  auto null_base = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, 10, {{Plane{}, Plane{mem.data(), 64}}});
  EXPECT_EQ(null_base.status().code(), StatusCode::kInvalidArgument);
  auto region = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, 10,
                                        {{Plane{mem.data(), 64}, Plane{mem.data() + 640, 64}}}, {{640, 639}});
  EXPECT_EQ(region.status().code(), StatusCode::kInvalidArgument);
}

// Three planes of one stride: plane 2 starts one stride after plane 0, so it
// overlaps plane 0's block 1 byte for byte, while plane 1 (interleaved with
// both) sits between them after sorting by base. Every pair must be checked,
// not only neighbours.
TEST(BlockSpace, OverlapHiddenBehindAnInterleavedPlaneRejected) {
  std::vector<LayerLayout> layers(1);
  layers[0].roles = {
      {Role::kKey, DType::kBf16, 64, ""}, {Role::kValue, DType::kBf16, 64, ""}, {Role::kIndexer, DType::kBf16, 64, ""}};
  auto layout = KvLayout::create(std::move(layers), 4);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  std::vector<std::byte> mem(128 * 12);
  auto hidden =
      BlockSpace::from_planes(MemoryKind::kDevice, 0, *layout, 8,
                              {{Plane{mem.data(), 128}, Plane{mem.data() + 64, 128}, Plane{mem.data() + 128, 128}}});
  EXPECT_EQ(hidden.status().code(), StatusCode::kInvalidArgument) << "planes 0 and 2 share bytes";
  if (!hidden.ok()) {
    EXPECT_NE(hidden.status().message().find("overlap"), std::string::npos) << hidden.status().to_string();
  }
}

// (num_blocks - 1) * stride + block_bytes must not wrap: 2^30 + 1 blocks of
// stride 16 GiB wrap to 256 bytes in uint64.
TEST(BlockSpace, RegionSizeCheckDoesNotWrap) {
  auto layout = *KvLayout::uniform(1, 1, 256);
  std::vector<std::byte> mem(256);
  const std::uint64_t blocks = (std::uint64_t{1} << 30) + 1;
  const std::uint64_t stride = std::uint64_t{16} << 30;
  auto wrapped =
      BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, blocks, {{Plane{mem.data(), stride}}}, {{mem.size()}});
  EXPECT_EQ(wrapped.status().code(), StatusCode::kInvalidArgument) << "a 256-byte region was accepted";
  // Without a region size too: base + extent must stay inside the address space.
  auto unsized = BlockSpace::from_planes(MemoryKind::kDevice, 0, layout, blocks, {{Plane{mem.data(), stride}}});
  EXPECT_EQ(unsized.status().code(), StatusCode::kInvalidArgument);
  auto page = BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, (std::uint64_t{1} << 31) - 1, mem.data(),
                                     mem.size(), std::uint64_t{1} << 40);
  EXPECT_EQ(page.status().code(), StatusCode::kInvalidArgument);
  // Alignments near 2^64 round up without wrapping (the page was 0 bytes, which any region fitted), and a page past
  // 2^64 saturates.
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t near_max = kMax - 99;
  EXPECT_EQ(BlockSpace::page_first_page_bytes(layout, near_max), near_max);
  EXPECT_EQ(BlockSpace::page_first_page_bytes(layout, 1, near_max), 256u)
      << "one role starts at 0, aligned to anything";
  auto aligned = BlockSpace::page_first(MemoryKind::kPinnedHost, 0, layout, 1, mem.data(), mem.size(), near_max);
  EXPECT_EQ(aligned.status().code(), StatusCode::kInvalidArgument);
  auto two_roles = KvLayout::uniform(1, 2, 256);
  ASSERT_TRUE(two_roles.ok());
  EXPECT_EQ(BlockSpace::page_first_page_bytes(*two_roles, 1, near_max), kMax);
  auto saturated =
      BlockSpace::page_first(MemoryKind::kPinnedHost, 0, *two_roles, 1, mem.data(), mem.size(), 1, near_max);
  EXPECT_EQ(saturated.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(saturated.status().message().find("exceeds the address space"), std::string::npos)
      << saturated.status().to_string();
  // A layer-first region of blocks x block bytes past 2^64.
  auto big = KvLayout::uniform(1, 1, std::uint64_t{1} << 40);
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  EXPECT_EQ(BlockSpace::layer_first_region_bytes(*big, 0, 0, std::uint64_t{1} << 30), kMax);
  auto region = BlockSpace::layer_first(MemoryKind::kDevice, 0, *big, std::uint64_t{1} << 30, {{mem.data()}});
  EXPECT_EQ(region.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(region.status().message().find("exceed the address space"), std::string::npos)
      << region.status().to_string();
}

// Every element type has a name that parses back to it and the size its name says; the values of the
// original seven are unchanged (they are hashed into layout fingerprints).
TEST(DType, EveryTypeRoundTripsThroughItsNameWithItsSize) {
  const std::map<std::string, std::uint32_t> expected_bytes = {
      {"bf16", 2},      {"fp16", 2},          {"fp32", 4},           {"fp8_e4m3", 1},     {"fp8_e5m2", 1},
      {"int8", 1},      {"uint8", 1},         {"int16", 2},          {"uint16", 2},       {"int32", 4},
      {"uint32", 4},    {"int64", 8},         {"uint64", 8},         {"fp64", 8},         {"bool", 1},
      {"complex64", 8}, {"complex128", 16},   {"fp8_e4m3fnuz", 1},   {"fp8_e5m2fnuz", 1}, {"fp8_e8m0", 1},
      {"fp8_e3m4", 1},  {"fp8_e4m3_ieee", 1}, {"fp8_e4m3b11fnuz", 1}};
  ASSERT_EQ(std::size(kAllDTypes), expected_bytes.size());
  for (DType d : kAllDTypes) {
    const std::string name(dtype_name(d));
    ASSERT_TRUE(expected_bytes.count(name)) << name;
    EXPECT_EQ(dtype_bytes(d), expected_bytes.at(name)) << name;
    auto parsed = parse_dtype(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
    EXPECT_EQ(*parsed, d) << name;
    EXPECT_EQ(dtype_is_fp8(d), name.rfind("fp8", 0) == 0) << name;
  }
  EXPECT_EQ(static_cast<int>(DType::kBf16), 0);
  EXPECT_EQ(static_cast<int>(DType::kUint8), 6);
  EXPECT_EQ(*parse_dtype("float64"), DType::kFp64);
  EXPECT_EQ(*parse_dtype("fp8_e4m3fn"), DType::kFp8E4M3);
  auto bad = parse_dtype("fp4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'fp4'"), std::string::npos) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find("complex128"), std::string::npos) << bad.status().to_string();
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// Ids of other widths convert only when they fit: a negative or too large id is an error naming the value, never a
// truncated block id.
TEST(BlockIdConversion, RefusesWhatDoesNotFit) {
  EXPECT_EQ(to_block_id(std::int32_t{0}).value(), 0u);
  EXPECT_EQ(to_block_id(std::int32_t{2147483647}).value(), 2147483647u);
  EXPECT_EQ(to_block_id(std::uint64_t{0xffffffffu}).value(), 0xffffffffu);
  auto neg = to_block_id(std::int32_t{-1}, "dst block");
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(neg.status().message(), "dst block -1 is negative");
  auto big = to_block_id(std::uint64_t{1} << 32);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().message(), "block id 4294967296 does not fit a 32-bit block id");
  static_assert(std::is_same_v<BlockId, std::uint32_t>);
}

}  // namespace
}  // namespace kvtier
