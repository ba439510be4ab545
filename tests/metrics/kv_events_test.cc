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
  for (EventEncoding enc : {EventEncoding::kMap, EventEncoding::kArray}) {
    EventBatch b = sample();
    b.events.push_back(BlockStored{{{5, 6}}, BlockHash{1, 2}, {}, 16, std::nullopt, Medium::kRemote});
    b.events.push_back(BlockRemoved{{{5, 6}}, Medium::kRemote});
    b.events.push_back(BlockRemoved{{{5, 6}}, std::nullopt});
    auto d = decode_msgpack(encode_msgpack(b, enc));
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(*d, b) << event_encoding_name(enc);
    b.data_parallel_rank = 2;
    d = decode_msgpack(encode_msgpack(b, enc));
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(*d, b) << event_encoding_name(enc);
  }
}

// The bytes msgspec writes for vLLM 0.34's tagged structs (maps, the tag first, then the fields in their order,
// defaults left out), as `msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[h],
// parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="STORAGE", lora_name=None,
// locality="REMOTE"), AllBlocksCleared()]))` with vLLM's classes.
TEST(KvEvents, WireBytesAsMaps) {
  EventBatch b;
  b.ts = 1.5;
  b.events.push_back(BlockStored{{{0, 0x0102}}, std::nullopt, {}, 16, std::nullopt, Medium::kRemote});
  b.events.push_back(AllBlocksCleared{});
  const std::string got = encode_msgpack(b, EventEncoding::kMap);
  std::string want;
  want += "\x93";                                      // [ts, events, rank]
  want += std::string("\xcb\x3f\xf8\0\0\0\0\0\0", 9);  // float64 1.5
  want += "\x92";                                      // two events
  want += std::string("\xde\x00\x09", 3);              // nine entries (a map16 header, as msgspec sizes it)
  want +=
      "\xa4"
      "type"
      "\xab"
      "BlockStored";  // the tag first
  want +=
      "\xac"
      "block_hashes"
      "\x91\xc4\x10" +
      std::string(14, '\0') + "\x01\x02";
  want +=
      "\xb1"
      "parent_block_hash"
      "\xc0";
  want +=
      "\xa9"
      "token_ids"
      "\x90";
  want +=
      "\xaa"
      "block_size"
      "\x10";
  want +=
      "\xa7"
      "lora_id"
      "\xc0";
  want +=
      "\xa6"
      "medium"
      "\xa7"
      "STORAGE";
  want +=
      "\xa9"
      "lora_name"
      "\xc0";
  want +=
      "\xa8"
      "locality"
      "\xa6"
      "REMOTE";
  want +=
      "\x81\xa4"
      "type"
      "\xb0"
      "AllBlocksCleared";
  want += "\xc0";  // no rank: nil
  EXPECT_EQ(got, want);
}

// A map event as vLLM may write it: fields kvtier does not keep (group_idx, extra_keys, a bool), in another order.
TEST(KvEvents, DecodesMapEventsWithFieldsItDoesNotKeep) {
  std::string bytes;
  bytes += "\x92\xcb" + std::string(8, '\0') + "\x91";
  bytes +=
      "\x87\xa4"
      "type"
      "\xac"
      "BlockRemoved";
  bytes +=
      "\xa9"
      "group_idx"
      "\x03";
  bytes +=
      "\xaa"
      "extra_keys"
      "\x91\x92\xa2"
      "mm"
      "\x05";
  bytes +=
      "\xa4"
      "flag"
      "\xc3";
  bytes +=
      "\xa8"
      "locality"
      "\xa5"
      "LOCAL";
  bytes +=
      "\xa6"
      "medium"
      "\xa7"
      "STORAGE";
  bytes +=
      "\xac"
      "block_hashes"
      "\x91\x07";
  auto d = decode_msgpack(bytes);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_EQ(d->events.size(), 1u);
  const auto* r = std::get_if<BlockRemoved>(&d->events[0]);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->block_hashes, (std::vector<BlockHash>{{0, 7}}));
  EXPECT_EQ(r->medium, Medium::kDisk);
  // A locality that is neither of vLLM's (its type is any string) reads as local storage, not a batch refused.
  std::string other_locality = bytes;
  other_locality.replace(other_locality.find("LOCAL"), 5, "THERE");
  auto e = decode_msgpack(other_locality);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(std::get<BlockRemoved>(e->events[0]).medium, Medium::kDisk);
  // A map without its tag is refused by name.
  const std::string untagged = "\x92\xcb" + std::string(8, '\0') +
                               "\x91\x81\xa1"
                               "x"
                               "\x01";
  EXPECT_NE(decode_msgpack(untagged).status().message().find("\"type\""), std::string::npos);
  EXPECT_EQ(*parse_medium("STORAGE"), Medium::kDisk);
  EXPECT_EQ(*parse_event_encoding("array"), EventEncoding::kArray);
  EXPECT_FALSE(parse_event_encoding("json").ok());
}

// The bytes msgspec writes for the array_like, tagged structs of earlier vLLM releases.
TEST(KvEvents, WireBytesAsArrays) {
  EventBatch b;
  b.ts = 1.5;
  b.events.push_back(BlockRemoved{{{0, 0x0102}}, Medium::kGpu});
  b.events.push_back(AllBlocksCleared{});
  const std::string got = encode_msgpack(b, EventEncoding::kArray);
  std::string want;
  want += "\x93";                                      // [ts, events, rank]
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
  want += "\xc0";  // no rank: nil, as msgspec writes an array_like struct's None
  EXPECT_EQ(got, want);
}

// vLLM's integer block hashes use all 64 bits (half of them are above 2**63 - 1, msgpack's uint64): a batch with
// one was refused whole, as was one with such an integer in a field kvtier skips. int64 fields still refuse them.
TEST(KvEvents, DecodesIntegerHashesOfAll64Bits) {
  std::string bytes = "\x93\xcb" + std::string(8, '\0') + "\x91";
  bytes +=
      "\x84\xa4"
      "type"
      "\xac"
      "BlockRemoved";
  bytes +=
      "\xac"
      "block_hashes"
      "\x92\xcf" +
      std::string(8, '\xff') + "\xcf\x80" + std::string(7, '\0');
  bytes +=
      "\xaa"
      "extra_keys"
      "\x91\xcf" +
      std::string(8, '\xee');
  bytes +=
      "\xa6"
      "medium"
      "\xa3"
      "GPU";
  bytes += "\xc0";
  auto d = decode_msgpack(bytes);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(std::get<BlockRemoved>(d->events[0]).block_hashes,
            (std::vector<BlockHash>{{0, ~std::uint64_t{0}}, {0, std::uint64_t{1} << 63}}));
  std::string rank_too_large = bytes;
  rank_too_large.back() = '\xcf';
  rank_too_large += std::string(8, '\xff');
  auto r = decode_msgpack(rank_too_large);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("data_parallel_rank"), std::string::npos) << r.status().message();
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
