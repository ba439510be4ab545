#include "kvtier/metrics/kv_events.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier::metrics {
namespace {

EventBatch sample() {
  EventBatch b;
  b.ts = 1700000000.25;
  BlockStored s;
  s.block_hashes = {{1, 2}, {0xffffffffffffffffull, 0x0123456789abcdefull}};
  s.parent_block_hash = BlockHash{7, 8};
  s.token_ids = {0, 127, 128, 65536, -1, -33, -200000, 5000000000};
  s.block_size = 64;
  s.medium = Medium::kCpu;
  b.events.push_back(s);
  BlockStored root;
  root.block_hashes = {{9, 9}};
  root.block_size = 16;
  root.lora_id = 3;
  b.events.push_back(root);
  b.events.push_back(BlockRemoved{{{1, 2}}, Medium::kDisk});
  b.events.push_back(AllBlocksCleared{});
  return b;
}

TEST(KvEvents, RoundTrip) {
  EventBatch b = sample();
  auto d = decode_msgpack(encode_msgpack(b));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(*d, b);
  b.data_parallel_rank = 2;
  d = decode_msgpack(encode_msgpack(b));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, b);
}

// The bytes msgspec writes for vLLM's array_like, tagged structs.
TEST(KvEvents, WireBytes) {
  EventBatch b;
  b.ts = 1.5;
  b.events.push_back(BlockRemoved{{{0, 0x0102}}, Medium::kGpu});
  b.events.push_back(AllBlocksCleared{});
  const std::string got = encode_msgpack(b);
  std::string want;
  want += "\x92";                                      // [ts, events] (no rank: omit_defaults)
  want += std::string("\xcb\x3f\xf8\0\0\0\0\0\0", 9);  // float64 1.5
  want += "\x92";                                      // two events
  want +=
      "\x93\xac"
      "BlockRemoved";      // ["BlockRemoved", hashes, medium]
  want += "\x91\xc4\x10";  // one 16-byte bin
  want += std::string(14, '\0') + "\x01\x02";
  want += "\xa3GPU";
  want +=
      "\x91\xb0"
      "AllBlocksCleared";
  EXPECT_EQ(got, want);
}

TEST(KvEvents, DecodeRejectsMalformed) {
  const std::string good = encode_msgpack(sample());
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, good.size() / 2, good.size() - 1}) {
    auto d = decode_msgpack(std::string_view(good).substr(0, cut));
    EXPECT_EQ(d.status().code(), StatusCode::kDataLoss) << cut;
  }
  EXPECT_EQ(decode_msgpack(good + "x").status().code(), StatusCode::kDataLoss);
  const std::string unknown_tag(
      "\x92\xcb\0\0\0\0\0\0\0\0\x91\x91\xa3"
      "Foo",
      16);
  auto u = decode_msgpack(unknown_tag);
  EXPECT_EQ(u.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(u.status().message().find("'Foo'"), std::string::npos) << u.status().message();
  // An array header claiming 2^32-1 items is refused before anything is reserved.
  EXPECT_EQ(decode_msgpack("\xdd\xff\xff\xff\xff").status().code(), StatusCode::kDataLoss);
  EXPECT_FALSE(parse_medium("SSD").ok());
  EXPECT_EQ(parse_medium("REMOTE").value(), Medium::kRemote);
}

}  // namespace
}  // namespace kvtier::metrics
