#include "kvtier/cache/block_key.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "tests/cache/key_fixture.h"

namespace kvtier::cache {
namespace {

std::vector<std::string> in_process_keys() {
  auto h = KeyHasher::create(testing::golden_namespace());
  EXPECT_TRUE(h.ok());
  auto tokens = testing::golden_tokens();
  auto keys = h->keys_for(tokens);
  EXPECT_TRUE(keys.ok());
  std::vector<std::string> out{h->root().hex()};
  for (const BlockKey& k : *keys) out.push_back(k.hex());
  return out;
}

// Computed once with this implementation (xxHash 0.8, XXH3_128bits) and frozen: any change to the
// key format must bump "kvtier.key.v1".
const char* const kGolden[] = {
    "5bb6684e2ced887e76787b8cada99fb4",
    "9f92fa8687199b290eca4a34d49c6ba5",
    "4d5e11a3907f23e80a258a158a95c726",
    "e4ec715c8fcd4312ffbce3ff1f51cb2c",
};

TEST(BlockKey, HexRoundTrip) {
  BlockKey k{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(k.hex(), "0123456789abcdeffedcba9876543210");
  auto back = BlockKey::from_hex(k.hex());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, k);
  EXPECT_FALSE(BlockKey::from_hex("xyz").ok());
  EXPECT_FALSE(BlockKey::from_hex("0123456789abcdeffedcba987654321g").ok());
  // A bad key is shown escaped and cut: a 10,000-character key was repeated whole, a NUL byte went out as is.
  const std::string huge(10000, 'z');
  const std::string message = BlockKey::from_hex(huge).status().message();
  EXPECT_LT(message.size(), 200u) << message;
  EXPECT_NE(message.find("has 10000 digits"), std::string::npos) << message;
  std::string with_nul = "0123456789abcdeffedcba9876543210";
  with_nul[5] = '\0';
  const std::string nul_message = BlockKey::from_hex(with_nul).status().message();
  EXPECT_NE(nul_message.find("01234\\x006789"), std::string::npos) << nul_message;
  EXPECT_EQ(nul_message.find('\0'), std::string::npos);
}

TEST(BlockKey, GoldenVector) {
  auto keys = in_process_keys();
  ASSERT_EQ(keys.size(), 4u) << "3 full blocks + root; the partial block has no key";
  for (std::size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(keys[i], kGolden[i]) << "key " << i;
}

TEST(BlockKey, IdenticalInASecondProcess) {
  std::FILE* p = ::popen(KVTIER_KEY_HELPER, "r");
  ASSERT_NE(p, nullptr);
  std::vector<std::string> lines;
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p)) {
    std::string s(buf);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    lines.push_back(s);
  }
  ASSERT_EQ(::pclose(p), 0);
  EXPECT_EQ(lines, in_process_keys());
}

TEST(BlockKey, EveryNamespaceFieldChangesTheKeys) {
  auto base = testing::golden_namespace();
  auto tokens = testing::golden_tokens();
  auto key_of = [&](const KeyNamespace& ns) {
    auto h = KeyHasher::create(ns);
    EXPECT_TRUE(h.ok()) << h.status().to_string();
    return (*h->keys_for(tokens))[0];
  };
  BlockKey ref = key_of(base);
  std::vector<KeyNamespace> variants(8, base);
  variants[0].model_id += "x";
  variants[1].layout_fingerprint ^= 1;
  variants[2].dtype = "fp8_e4m3";
  variants[3].tp_rank = 0;
  variants[4].tp_size = 4;
  variants[5].tenant_salt = "tenant-a";
  variants[6].extra = "lora:7";
  variants[7].block_tokens = 2;
  for (std::size_t i = 0; i < variants.size(); ++i) EXPECT_NE(key_of(variants[i]), ref) << "variant " << i;
  // Two salts differ from each other too.
  auto a = base, b = base;
  a.tenant_salt = "a";
  b.tenant_salt = "b";
  EXPECT_NE(key_of(a), key_of(b));
}

TEST(BlockKey, ChainsOverParentTokensAndExtras) {
  auto h = *KeyHasher::create(testing::golden_namespace());
  std::vector<std::int32_t> t1{1, 2, 3, 4}, t2{1, 2, 4, 3};
  BlockKey k1 = h.block_key(h.root(), t1);
  EXPECT_NE(k1, h.block_key(h.root(), t2));
  EXPECT_NE(h.block_key(k1, t1), k1);  // same tokens, different parent
  BlockKey img{1, 2};
  EXPECT_NE(h.block_key(h.root(), t1, std::span<const BlockKey>(&img, 1)), k1);
  // Equal prefixes give equal keys; the chain of keys_for matches block_key.
  std::vector<std::int32_t> seq{1, 2, 3, 4, 1, 2, 3, 4};
  auto keys = *h.keys_for(seq);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0], k1);
  EXPECT_EQ(keys[1], h.block_key(k1, t1));
  // Extra keys per block must match the block count.
  std::vector<std::vector<BlockKey>> extras(1);
  EXPECT_EQ(h.keys_for(seq, extras).status().code(), StatusCode::kInvalidArgument);
}

TEST(BlockKey, InvalidNamespacesAreRejected) {
  auto ns = testing::golden_namespace();
  ns.model_id.clear();
  EXPECT_EQ(KeyHasher::create(ns).status().code(), StatusCode::kInvalidArgument);
  ns = testing::golden_namespace();
  ns.tp_rank = 2;
  EXPECT_EQ(KeyHasher::create(ns).status().code(), StatusCode::kInvalidArgument);
  ns = testing::golden_namespace();
  ns.block_tokens = 0;
  EXPECT_EQ(KeyHasher::create(ns).status().code(), StatusCode::kInvalidArgument);
}

TEST(BlockKey, OpaqueIdChains) {
  auto h = *KeyHasher::create(testing::golden_namespace());
  std::vector<std::uint64_t> a{0, 1, 2}, b{0, 1, 3}, c{5, 1, 2};
  auto ka = h.keys_for_ids(a), kb = h.keys_for_ids(b), kc = h.keys_for_ids(c);
  EXPECT_EQ(ka[0], kb[0]);
  EXPECT_EQ(ka[1], kb[1]);
  EXPECT_NE(ka[2], kb[2]);
  EXPECT_NE(ka[1], kc[1]);  // same id under another parent is another block
}

}  // namespace
}  // namespace kvtier::cache
