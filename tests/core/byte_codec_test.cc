// The byte codec of kvtier's persisted and wire formats (core/byte_codec.h): the exact little-endian bytes of a
// known encoding (what objects and messages already written hold), round trips, and truncated or oversized input
// refused without moving past the input or changing the field.
#include "core/byte_codec.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvtier::codec {
namespace {

std::vector<std::byte> bytes_of(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int b : v) out.push_back(static_cast<std::byte>(b));
  return out;
}

TEST(ByteCodec, KnownEncodingIsLittleEndianByteForByte) {
  ByteWriter<std::vector<std::byte>> w;
  w.u8(0xab).u16(0x1234).u32(0xdeadbeef).u64(0x0123456789abcdefULL).str("kv");
  const std::uint64_t list[] = {1, 0x8000000000000002ULL};
  w.u64s(list).raw("RAW");
  const std::vector<std::byte> want = bytes_of({
      0xab,                                            // u8
      0x34, 0x12,                                      // u16
      0xef, 0xbe, 0xad, 0xde,                          // u32
      0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01,  // u64
      0x02, 0x00, 0x00, 0x00, 'k',  'v',               // str: u32 length, bytes
      0x02, 0x00, 0x00, 0x00,                          // u64s: u32 count
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80,  //
      'R',  'A',  'W',                                 // raw: no length
  });
  EXPECT_EQ(w.out, want);

  // The std::string writer writes the same bytes (the messages sent as notification text).
  ByteWriter<std::string> ws;
  ws.u8(0xab).u16(0x1234).u32(0xdeadbeef).u64(0x0123456789abcdefULL).str("kv").u64s(list).raw("RAW");
  ASSERT_EQ(ws.out.size(), want.size());
  EXPECT_EQ(0, std::memcmp(ws.out.data(), want.data(), want.size()));

  // Fixed offsets: the storage header's fields.
  std::byte fixed[14] = {};
  store_le<std::uint16_t>(fixed, 0x0102);
  store_le<std::uint32_t>(fixed + 2, 0x03040506);
  store_le<std::uint64_t>(fixed + 6, 0x0708090a0b0c0d0eULL);
  EXPECT_EQ(std::vector<std::byte>(fixed, fixed + 14),
            bytes_of({0x02, 0x01, 0x06, 0x05, 0x04, 0x03, 0x0e, 0x0d, 0x0c, 0x0b, 0x0a, 0x09, 0x08, 0x07}));
  EXPECT_EQ(load_le<std::uint16_t>(fixed), 0x0102);
  EXPECT_EQ(load_le<std::uint32_t>(fixed + 2), 0x03040506u);
  EXPECT_EQ(load_le<std::uint64_t>(fixed + 6), 0x0708090a0b0c0d0eULL);
  // The storage object's magic reads as "KVTOBJ\0\1" on disk.
  std::byte magic[8];
  store_le<std::uint64_t>(magic, 0x01004a424f54564bULL);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(magic), 8), std::string("KVTOBJ\0\1", 8));
}

TEST(ByteCodec, FieldsRoundTrip) {
  ByteWriter<std::vector<std::byte>> w;
  const std::vector<std::uint64_t> list = {0, 1, ~std::uint64_t{0}, 0x1122334455667788ULL};
  w.u8(0xff).u16(0xfffe).u32(0).u64(~std::uint64_t{0}).str("layout-fingerprint").str("").u64s(list).u64s({});
  // A list whose count travels elsewhere (the pd messages' second list): values only.
  w.u32(static_cast<std::uint32_t>(list.size()));
  for (std::uint64_t v : list) w.u64(v);

  ByteReader r(w.out);
  std::uint8_t a = 0;
  std::uint16_t b = 0;
  std::uint32_t c = 7, n = 0;
  std::uint64_t d = 0;
  std::string s1, s2 = "x";
  std::vector<std::uint64_t> l1, l2 = {5}, l3;
  ASSERT_TRUE(r.u8(a) && r.u16(b) && r.u32(c) && r.u64(d) && r.str(s1) && r.str(s2) && r.u64s(l1) && r.u64s(l2));
  ASSERT_TRUE(r.u32(n) && r.u64s(l3, n));
  EXPECT_EQ(a, 0xff);
  EXPECT_EQ(b, 0xfffe);
  EXPECT_EQ(c, 0u);
  EXPECT_EQ(d, ~std::uint64_t{0});
  EXPECT_EQ(s1, "layout-fingerprint");
  EXPECT_EQ(s2, "");
  EXPECT_EQ(l1, list);
  EXPECT_TRUE(l2.empty());
  EXPECT_EQ(l3, list);
  EXPECT_TRUE(r.at_end());
  EXPECT_EQ(r.pos(), w.out.size());
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_FALSE(r.u8(a)) << "read past the end";
  EXPECT_FALSE(r.skip(1));
  EXPECT_TRUE(r.skip(0));
}

// Every cut of the input refuses the field it falls in, leaves the field and the position as they were, and
// never reads past the cut.
TEST(ByteCodec, TruncatedInputIsRefusedAtEveryCut) {
  ByteWriter<std::vector<std::byte>> w;
  const std::uint64_t list[] = {11, 22, 33};
  w.u16(1).u32(2).u64(3).str("abcdef").u64s(list).u8(9);
  const std::vector<std::byte>& all = w.out;
  for (std::size_t cut = 0; cut < all.size(); ++cut) {
    // A copy of exactly `cut` bytes: the sanitizers see any read past it.
    const std::vector<std::byte> part(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(cut));
    ByteReader r(part);
    std::uint16_t a = 0xaaaa;
    std::uint32_t b = 0xbbbbbbbb;
    std::uint64_t c = 0xcc;
    std::string s = "kept";
    std::vector<std::uint64_t> l = {42};
    std::uint8_t e = 0xee;
    std::size_t read = 0;
    const auto step = [&](bool ok) {
      if (!ok) return false;
      read = r.pos();
      return true;
    };
    const bool whole =
        step(r.u16(a)) && step(r.u32(b)) && step(r.u64(c)) && step(r.str(s)) && step(r.u64s(l)) && step(r.u8(e));
    EXPECT_FALSE(whole) << "cut " << cut;
    EXPECT_EQ(r.pos(), read) << "a failed read moved the position, cut " << cut;
    EXPECT_LE(r.pos(), cut);
    if (read < 2) {
      EXPECT_EQ(a, 0xaaaa);
    }
    if (read < 6) {
      EXPECT_EQ(b, 0xbbbbbbbbu);
    }
    if (read < 14) {
      EXPECT_EQ(c, 0xccu);
    }
    if (read < 14 + 4 + 6) {
      EXPECT_EQ(s, "kept") << "cut " << cut;
    }
    if (read < 24 + 4 + 24) {
      EXPECT_EQ(l, std::vector<std::uint64_t>{42}) << "cut " << cut;
    }
    EXPECT_EQ(e, 0xee);
  }
}

TEST(ByteCodec, CorruptLengthsAreRefused) {
  // A string length above the reader's bound is refused even when the bytes are there.
  ByteWriter<std::vector<std::byte>> w;
  w.str("eighteen-bytes-str");
  std::string s;
  ByteReader bounded(w.out, 17);
  EXPECT_FALSE(bounded.str(s));
  EXPECT_EQ(bounded.pos(), 0u);
  ByteReader enough(w.out, 18);
  EXPECT_TRUE(enough.str(s));

  // Lengths and counts larger than the input (a huge value) fail without allocating for them.
  ByteWriter<std::vector<std::byte>> huge;
  huge.u32(0xffffffffu).u64(0);
  ByteReader rs(huge.out);
  EXPECT_FALSE(rs.str(s));
  ByteReader rl(huge.out);
  std::vector<std::uint64_t> l;
  EXPECT_FALSE(rl.u64s(l));
  EXPECT_EQ(rl.pos(), 0u);
  EXPECT_TRUE(l.empty());
  ByteReader rn(huge.out);
  EXPECT_FALSE(rn.u64s(l, 2)) << "two values, eight bytes";
  EXPECT_TRUE(rn.u64s(l, 1));
  EXPECT_EQ(l, std::vector<std::uint64_t>{0xffffffffu});
}

// The string_view reader (messages received as text) agrees with the byte one.
TEST(ByteCodec, StringInputReadsLikeBytes) {
  ByteWriter<std::string> ws;
  ws.u32(7).str("ipc");
  ByteReader rs(std::string_view(ws.out));
  std::uint32_t seven = 0;
  std::string ipc;
  ASSERT_TRUE(rs.u32(seven) && rs.str(ipc));
  EXPECT_EQ(seven, 7u);
  EXPECT_EQ(ipc, "ipc");
  EXPECT_TRUE(rs.at_end());
}

}  // namespace
}  // namespace kvtier::codec
