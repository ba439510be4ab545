// Object format, key slots, spec parsing and the StorageTier adapter.
#include <dirent.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/memory_backend.h"
#include "kvtier/storage/redis_backend.h"
#include "kvtier/storage/storage_tier.h"
#include "storage/object_format.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::key_of;
using testing::TempDir;

// Objects written before the byte codec moved to core (the disk seeds of fuzz/corpus, written by the disk backend)
// still parse and verify, and today's encoder writes their headers byte for byte.
TEST(ObjectFormat, SeedObjectsOfEarlierBuildsParseAndReencodeIdentically) {
  const std::filesystem::path dir = std::filesystem::path(__FILE__).parent_path() / "../../fuzz/corpus/disk_object";
  int seen = 0;
  for (const char* name : {"object-0", "object-1", "object-2"}) {
    std::ifstream in(dir / name, std::ios::binary);
    if (!in) continue;
    std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(file.size(), 1u) << name;
    // The first byte is the harness's control byte (CONTRIBUTING.md, Fuzzing); the object follows.
    const auto* obj = reinterpret_cast<const std::byte*>(file.data() + 1);
    const std::size_t bytes = file.size() - 1;
    auto h = format::decode_header(obj, bytes);
    ASSERT_TRUE(h.ok()) << name << ": " << h.status().to_string();
    ASSERT_TRUE(format::check_object_size(*h, bytes, false).ok()) << name;
    const std::byte* payload = obj + h->header_size;
    EXPECT_TRUE(format::verify_object(obj, *h, payload).ok()) << name;
    StorageOptions o;
    o.layout_fingerprint = h->layout_fingerprint;
    o.roles = h->roles;
    std::vector<std::byte> again(h->header_size);
    ASSERT_TRUE(
        format::encode_header(o, h->ns_digest, h->key, payload, h->payload_bytes, h->header_size, again.data()).ok());
    EXPECT_EQ(0, std::memcmp(again.data(), obj, h->header_size)) << name << ": the header's bytes changed";
    ++seen;
  }
  EXPECT_GT(seen, 0) << "no seed object under " << dir;
}

TEST(ObjectFormat, EncodeDecodeVerify) {
  auto layout = KvLayout::uniform(3, 2, 4096);
  ASSERT_TRUE(layout.ok());
  StorageOptions o = format::options_for_layout("ns-a", *layout);
  ASSERT_EQ(o.roles.size(), 6u);
  EXPECT_EQ(o.roles[5].offset, 5u * 4096);
  const std::uint32_t hs = format::header_bytes(o, 4096);
  EXPECT_EQ(hs, 4096u);
  EXPECT_EQ(format::header_bytes(o, 8), format::kFixedHeaderBytes + 6 * format::kRoleEntryBytes);
  std::vector<std::byte> payload(6 * 4096);
  fill_random(payload.data(), payload.size(), 1);
  std::vector<std::byte> hdr(hs);
  const StorageKey k = key_of(1, 2, 3);
  const std::uint64_t ns = format::namespace_digest("ns-a");
  ASSERT_TRUE(format::encode_header(o, ns, k, payload.data(), payload.size(), hs, hdr.data()).ok());
  auto h = format::decode_header(hdr.data(), hdr.size());
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->payload_bytes, payload.size());
  EXPECT_EQ(h->header_size, hs);
  EXPECT_TRUE(h->key == k);
  EXPECT_EQ(h->roles.size(), 6u);
  EXPECT_TRUE(format::check_identity(*h, ns, layout->fingerprint(), k).ok());
  EXPECT_EQ(format::check_identity(*h, ns + 1, layout->fingerprint(), k).code(), StatusCode::kDataLoss);
  EXPECT_EQ(format::check_identity(*h, ns, layout->fingerprint() ^ 1, k).code(), StatusCode::kDataLoss);
  EXPECT_EQ(format::check_identity(*h, ns, layout->fingerprint(), key_of(1, 3, 3)).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(format::verify_object(hdr.data(), *h, payload.data()).ok());
  // Every single-bit flip of the payload or header is caught.
  for (std::size_t off : {std::size_t{0}, std::size_t{4095}, payload.size() - 1}) {
    payload[off] ^= std::byte{1};
    EXPECT_EQ(format::verify_object(hdr.data(), *h, payload.data()).code(), StatusCode::kDataLoss);
    payload[off] ^= std::byte{1};
  }
  for (std::size_t off = 0; off < format::header_bytes(o, 8); off += 3) {
    auto copy = hdr;
    copy[off] ^= std::byte{0x40};
    auto bad = format::decode_header(copy.data(), copy.size());
    EXPECT_FALSE(bad.ok() && format::verify_object(copy.data(), *bad, payload.data()).ok()) << "offset " << off;
  }
  // Padding is covered too.
  auto copy = hdr;
  copy[hs - 1] ^= std::byte{1};
  EXPECT_FALSE(format::decode_header(copy.data(), copy.size()).ok());
  // Too short / wrong sizes.
  EXPECT_EQ(format::decode_header(hdr.data(), 10).status().code(), StatusCode::kDataLoss);
  std::uint32_t needed = 0;
  EXPECT_EQ(format::decode_header(hdr.data(), 100, &needed).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(needed, hs);
  EXPECT_EQ(format::check_payload_size(o, 100).code(), StatusCode::kInvalidArgument);
  // A role whose end wraps around 2^64 read as ending early and was accepted: the object was written, and every
  // read then quarantined it as corrupt.
  StorageOptions wrap;
  wrap.roles = {ObjectSchemaRole{0, 0, 0, UINT64_MAX - 7, 16}};
  const Status wrapped = format::check_payload_size(wrap, 16);
  EXPECT_EQ(wrapped.code(), StatusCode::kInvalidArgument) << wrapped.to_string();
  EXPECT_NE(wrapped.message().find("wraps around"), std::string::npos) << wrapped.to_string();
}

// encode_object (the header and the payload copied in one pass) writes the bytes encode_header + a copy write,
// unkeyed and keyed (the keyed header's nonce differs per object: both verify, and the payloads are equal).
TEST(ObjectFormat, EncodeObjectInOnePassEqualsHeaderAndCopy) {
  for (bool keyed : {false, true}) {
    StorageOptions o;
    if (keyed) o.tenant_secret = std::string(32, 's');
    const std::uint32_t hs = format::header_bytes(o, 8);
    const std::uint64_t ns = format::namespace_digest(o);
    for (std::uint64_t n :
         {std::uint64_t{0}, std::uint64_t{5}, std::uint64_t{256} << 10, (std::uint64_t{600} << 10) + 3}) {
      std::vector<std::byte> payload(n);
      fill_random(payload.data(), payload.size(), 7 + n);
      std::vector<std::byte> two(hs + n), one(hs + n, std::byte{0xDB});
      ASSERT_TRUE(format::encode_header(o, ns, key_of(1, 1), payload.data(), n, hs, two.data()).ok());
      std::copy(payload.begin(), payload.end(), two.begin() + hs);
      ASSERT_TRUE(format::encode_object(o, ns, key_of(1, 1), payload.data(), n, hs, one.data()).ok());
      if (!keyed) {
        EXPECT_EQ(one, two) << n;
      }
      EXPECT_TRUE(std::equal(one.begin() + hs, one.end(), payload.begin())) << n;
      auto h = format::decode_header(one.data(), hs, nullptr, o.tenant_secret);
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      EXPECT_TRUE(format::verify_object(one.data(), *h, one.data() + hs, o.tenant_secret).ok()) << n;
      if (n > 0) {
        one[hs + n - 1] ^= std::byte{1};
        EXPECT_EQ(format::verify_object(one.data(), *h, one.data() + hs, o.tenant_secret).code(),
                  StatusCode::kDataLoss);
      }
    }
  }
  std::vector<std::byte> out(format::header_bytes(StorageOptions{}, 8) + 8);
  EXPECT_EQ(format::encode_object(StorageOptions{}, 0, key_of(1, 1), nullptr, 8,
                                  format::header_bytes(StorageOptions{}, 8), out.data())
                .code(),
            StatusCode::kInvalidArgument);
}

// Chunked checksums: a header written from the pieces' digests verifies through verify_chunked, verify_object
// and the streaming verifier fed in pieces of any size; a flipped byte in any piece, a digest of the wrong
// piece, or the digests of an unchunked object are refused.
TEST(ObjectFormat, ChunkedChecksumOverPieceDigests) {
  StorageOptions o;
  o.ns = "chunked";
  const std::uint32_t hs = format::header_bytes(o, 8);
  const std::uint64_t ns = format::namespace_digest(o);
  for (std::uint64_t n :
       {std::uint64_t{0}, std::uint64_t{100}, format::kChecksumChunkBytes, 2 * format::kChecksumChunkBytes + 5}) {
    std::vector<std::byte> payload(n);
    fill_random(payload.data(), n, 40 + n);
    std::vector<std::uint64_t> digests;
    for (std::uint64_t off = 0; off < n; off += format::kChecksumChunkBytes)
      digests.push_back(format::chunk_digest(payload.data() + off, std::min(format::kChecksumChunkBytes, n - off)));
    ASSERT_EQ(digests.size(), format::num_checksum_chunks(n));
    std::vector<std::byte> hdr(hs);
    ASSERT_TRUE(format::encode_chunked_header(o, ns, key_of(2, 2), n, digests, hs, hdr.data()).ok());
    auto h = format::decode_header(hdr.data(), hs);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    EXPECT_TRUE(h->chunked);
    EXPECT_EQ(h->payload_bytes, n);
    EXPECT_TRUE(format::verify_chunked(hdr.data(), *h, digests).ok());
    EXPECT_TRUE(format::verify_object(hdr.data(), *h, payload.data()).ok()) << n;
    for (std::size_t step : {std::size_t{1} << 12, std::size_t{(1 << 20) + 3}, std::size_t{777777}}) {
      format::ObjectVerifier v(hdr.data(), *h);
      for (std::uint64_t off = 0; off < n; off += step)
        v.update(payload.data() + off, std::min<std::uint64_t>(step, n - off));
      EXPECT_TRUE(v.finish().ok()) << n << " " << step;
    }
    if (n == 0) continue;
    for (std::uint64_t off : {std::uint64_t{0}, n / 2, n - 1}) {
      payload[off] ^= std::byte{4};
      EXPECT_EQ(format::verify_object(hdr.data(), *h, payload.data()).code(), StatusCode::kDataLoss) << off;
      payload[off] ^= std::byte{4};
    }
    auto wrong = digests;
    wrong.back() ^= 1;
    EXPECT_EQ(format::verify_chunked(hdr.data(), *h, wrong).code(), StatusCode::kDataLoss);
    wrong.pop_back();
    EXPECT_EQ(format::verify_chunked(hdr.data(), *h, wrong).code(), StatusCode::kDataLoss);
    // An unchunked object of the same payload has no piece digests to compare.
    std::vector<std::byte> plain(hs);
    ASSERT_TRUE(format::encode_header(o, ns, key_of(2, 2), payload.data(), n, hs, plain.data()).ok());
    auto ph = format::decode_header(plain.data(), hs);
    ASSERT_TRUE(ph.ok());
    EXPECT_FALSE(ph->chunked);
    EXPECT_EQ(format::verify_chunked(plain.data(), *ph, digests).code(), StatusCode::kDataLoss);
  }
  std::vector<std::byte> hdr(hs);
  const std::uint64_t one_digest[1] = {0};
  EXPECT_EQ(
      format::encode_chunked_header(o, ns, key_of(2, 2), 3 * format::kChecksumChunkBytes, one_digest, hs, hdr.data())
          .code(),
      StatusCode::kInvalidArgument);
  StorageOptions keyed = o;
  keyed.tenant_secret = std::string(32, 'k');
  EXPECT_EQ(
      format::encode_chunked_header(keyed, ns, key_of(2, 2), 1, one_digest, format::header_bytes(keyed, 8), hdr.data())
          .code(),
      StatusCode::kInvalidArgument);
}

TEST(RedisKeySlot, MatchesRedis) {
  // Reference values from the Redis Cluster specification / CLUSTER KEYSLOT.
  EXPECT_EQ(redis_key_slot("123456789"), 0x31C3 & 16383);
  EXPECT_EQ(redis_key_slot("foo"), 12182);
  EXPECT_EQ(redis_key_slot("bar"), 5061);
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("{user1000}.followers"));
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("user1000"));
  EXPECT_EQ(redis_key_slot("foo{}{bar}"), redis_key_slot("foo{}{bar}"));
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar"));  // empty tag: whole key hashed
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
}

TEST(StorageSpec, ParsesAndRejects) {
  EXPECT_EQ(parse_host_port("127.0.0.1:6379")->second, 6379);
  EXPECT_EQ(parse_host_port("[::1]:7000")->first, "::1");
  EXPECT_FALSE(parse_host_port("localhost").ok());
  EXPECT_FALSE(parse_host_port("h:99999").ok());
  TempDir dir;
  auto b = make_storage_backend(fmt::format("disk:{}?capacity=1M&durability=process&direct=off", dir.path()),
                                StorageOptions{});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->name(), "disk");
  EXPECT_EQ((*b)->stats().capacity_bytes, 1u << 20);
  EXPECT_EQ(make_storage_backend("disk:/x?bogus=1", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_storage_backend("s3://bucket", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_storage_backend("redis://127.0.0.1:1?timeout_ms=100", {}).status().code(), StatusCode::kUnavailable);
  // A bad number names its parameter (it named only the value, and called a timeout "a size"); counts and times are
  // whole numbers (a size's suffix made timeout_ms=5s 5 ms); the disk queue depth is bounded where create bounds it.
  for (const auto& [spec, says] : std::vector<std::pair<std::string, std::string>>{
           {"disk:/x?capacity=10Q", "parameter capacity: '10Q' is not a size"},
           {"disk:/x?capacity=-1", "parameter capacity: '-1' is not a size"},
           {"disk:/x?qd=abc", "parameter qd='abc' is not a whole number"},
           {"disk:/x?qd=5000", "parameter qd=5000 is more than 4096"},
           {"redis://127.0.0.1:1?timeout_ms=5s", "parameter timeout_ms='5s' is not a whole number"},
           {"redis://127.0.0.1:1?workers=two", "parameter workers='two' is not a whole number"},
           {"redis://127.0.0.1:1?ttl=1K", "parameter ttl='1K' is not a whole number"},
           {"memory:?capacity=1G&threads=x", "parameter threads='x' is not a whole number"},
           {"memory:?capacity=1.5G", "parameter capacity: '1.5G' is not a size"}}) {
    auto r = make_storage_backend(spec, {});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(says), std::string::npos) << spec << ": " << r.status().to_string();
  }
}

// A parameter given twice was taken from its last mention, silently: refused now, named, in every kind of spec
// (a redis spec's password still unshown).
TEST(StorageSpec, AParameterGivenTwiceIsRefused) {
  for (const char* spec : {"disk:/tmp/kv?capacity=1M&capacity=2M", "memory:?capacity=1M&evict=on&capacity=2M",
                           "redis://u:S3CRET@127.0.0.1:1?ttl=5&timeout_ms=100&ttl=6"}) {
    Status st = make_storage_backend(spec, {}).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << spec << ": " << st.to_string();
    EXPECT_NE(st.message().find("is given twice"), std::string::npos) << st.to_string();
    EXPECT_NE(
        st.message().find(std::string_view(spec).find("capacity") != std::string_view::npos ? "'capacity'" : "'ttl'"),
        std::string::npos)
        << st.to_string();
    EXPECT_EQ(st.message().find("S3CRET"), std::string::npos) << st.to_string();
  }
}

// A password in a spec was echoed by every error that showed the spec ("unknown redis parameter 'x' in
// 'redis://u:SECRET@...'"), and a '?' in it cut the spec there, the rest of the password shown as a parameter.
TEST(StorageSpec, PasswordsAreNeverShown) {
  EXPECT_EQ(redact_storage_spec("redis://tenant-a:S3CRET@h:1?prefix=p"), "redis://tenant-a:***@h:1?prefix=p");
  EXPECT_EQ(redact_storage_spec("redis://:S3CRET@h:1"), "redis://:***@h:1");
  EXPECT_EQ(redact_storage_spec("redis://S3CRET@h:1"), "redis://***@h:1");
  EXPECT_EQ(redact_storage_spec("redis://u:p@ss@h:1"), "redis://u:***@h:1");
  EXPECT_EQ(redact_storage_spec("rediss://u:S3CRET@h:1"), "rediss://u:***@h:1");  // a mistyped scheme too
  EXPECT_EQ(redact_storage_spec("redis://h:1?prefix=p"), "redis://h:1?prefix=p");
  EXPECT_EQ(redact_storage_spec("disk:/var/kv"), "disk:/var/kv");
  for (const char* spec :
       {"redis://u:S3CRET@127.0.0.1:1?timeot_ms=5", "redis://u:S3C?RET@127.0.0.1:1", "rediss://u:S3CRET@127.0.0.1:1",
        "redis://u:S3CRET%zz@127.0.0.1:1", "redis://u:S3CRET@127.0.0.1:1?ttl=-1"}) {
    Status st = make_storage_backend(spec, {}).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << spec << ": " << st.to_string();
    EXPECT_EQ(st.message().find("S3C"), std::string::npos) << st.to_string();
    EXPECT_EQ(st.message().find("RET"), std::string::npos) << st.to_string();
  }
  // Percent-decoded: "%3F" is a '?' of the password, not the start of the parameters (the server at port 1 is not
  // there: the spec itself parsed).
  EXPECT_EQ(make_storage_backend("redis://u:S3C%3FRET@127.0.0.1:1?timeout_ms=100", {}).status().code(),
            StatusCode::kUnavailable);
}

// The memory tier: its spec, then capacity by least recent use (a get and an exists are uses), a tier that
// must not evict, and an object larger than the tier.
TEST(MemoryBackend, SpecCapacityAndEviction) {
  auto parsed = make_storage_backend("memory:?capacity=1M&evict=off", StorageOptions{});
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ((*parsed)->name(), "memory");
  EXPECT_EQ((*parsed)->stats().capacity_bytes, 1u << 20);
  EXPECT_FALSE((*parsed)->caps().persistent);
  for (const char* bad : {"memory:", "memory:?capacity=0", "memory:?capacity=1M&evict=maybe",
                          "memory:?capacity=1M&colour=blue", "memory:here?capacity=1M"}) {
    auto b = make_storage_backend(bad, StorageOptions{});
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  // A size past 64 bits wrapped (16777217T opened a 1 TiB tier): refused, as the config knobs refuse it.
  for (std::string huge : {"16777217T", "16777216T", "99999999999999999999"}) {
    auto b = make_storage_backend("memory:?capacity=" + huge, StorageOptions{});
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << huge;
    EXPECT_NE(b.status().message().find(huge), std::string::npos) << b.status().to_string();
  }

  const std::uint64_t object = format::header_bytes(StorageOptions{}, 8) + 8192;
  auto put = [](StorageBackend& b, int i, const std::vector<std::byte>& v) {
    return (*run_batch(b,
                       StorageBatch{StorageOp::kPut, {{key_of(3, i), const_cast<std::byte*>(v.data()), v.size()}}}))[0]
        .status;
  };
  auto present = [](StorageBackend& b, int i) {
    return (*run_batch(b, StorageBatch{StorageOp::kExists, {{key_of(3, i), nullptr, 0}}}))[0].status.ok();
  };
  std::vector<std::byte> v(8192), dst(8192);
  MemoryBackendConfig c;
  c.capacity_bytes = 4 * object;
  auto lru = create_memory_backend(c, StorageOptions{});
  ASSERT_TRUE(lru.ok());
  for (int i = 0; i < 4; ++i) {
    fill_random(v.data(), v.size(), 100 + i);
    ASSERT_TRUE(put(**lru, i, v).ok()) << i;
  }
  ASSERT_TRUE(
      (*run_batch(**lru, StorageBatch{StorageOp::kGet, {{key_of(3, 0), dst.data(), dst.size()}}}))[0].status.ok());
  ASSERT_TRUE(present(**lru, 1));  // uses 0 and 1: 2 is now the least recently used
  ASSERT_TRUE(put(**lru, 4, v).ok());
  EXPECT_FALSE(present(**lru, 2));
  for (int i : {0, 1, 3, 4}) EXPECT_TRUE(present(**lru, i)) << i;
  EXPECT_EQ((*lru)->stats().evictions, 1u);
  EXPECT_EQ((*lru)->stats().bytes, 4 * object);
  std::vector<std::byte> big(4 * object);
  EXPECT_EQ(put(**lru, 9, big).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ((*lru)->stats().objects, 4u);  // the refused put evicted nothing
  // Replacements and evictions leave memory that later puts of the size reuse: every object reads back as written.
  std::vector<std::vector<std::byte>> latest(12, std::vector<std::byte>(8192));
  for (int round = 0; round < 3; ++round)
    for (int i : {0, 1, 5, 6}) {
      fill_random(latest[i].data(), latest[i].size(), 1000 * round + i);
      ASSERT_TRUE(put(**lru, i, latest[i]).ok()) << round << " " << i;
    }
  for (int i : {0, 1, 5, 6}) {
    std::fill(dst.begin(), dst.end(), std::byte{0});
    auto r = run_batch(**lru, StorageBatch{StorageOp::kGet, {{key_of(3, i), dst.data(), dst.size()}}});
    ASSERT_TRUE((*r)[0].status.ok()) << i << " " << (*r)[0].status.to_string();
    EXPECT_EQ(dst, latest[i]) << i;
  }

  c.evict = false;
  auto full = create_memory_backend(c, StorageOptions{});
  ASSERT_TRUE(full.ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(put(**full, i, v).ok());
  EXPECT_EQ(put(**full, 4, v).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(put(**full, 2, v).ok());  // a replacement needs no more room
  std::vector<std::byte> bigger(v.size() + 4096);
  EXPECT_EQ(put(**full, 2, bigger).code(), StatusCode::kResourceExhausted);  // ... this one does: refused
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(present(**full, i)) << i;          // and the old object 2 is still there
}

// A batch's items copied on several threads: every get and put of a batch reads back byte-exact, a put batch naming
// a key twice is refused, and a batch of puts evicts as one put after the other would (item order).
TEST(MemoryBackend, BatchesOnSeveralThreadsKeepItemOrder) {
  for (unsigned threads : {1u, 4u}) {
    auto spec = fmt::format("memory:?capacity=64M&threads={}", threads);
    auto b = make_storage_backend(spec, StorageOptions{});
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    constexpr int kItems = 16;
    std::vector<std::vector<std::byte>> data(kItems, std::vector<std::byte>((2 << 20) + 17));  // 3 pieces each
    StorageBatch puts{StorageOp::kPut, {}};
    for (int i = 0; i < kItems; ++i) {
      fill_random(data[i].data(), data[i].size(), 50 + i + 100 * threads);
      puts.items.push_back({key_of(4, i), data[i].data(), data[i].size()});
    }
    auto r = run_batch(**b, puts);
    ASSERT_TRUE(r.ok());
    for (int i = 0; i < kItems; ++i) ASSERT_TRUE((*r)[i].status.ok()) << i << (*r)[i].status.to_string();
    // One key twice in a batch: refused whole (StorageBackend's contract; the disk backend's puts of a batch run at
    // once), the stored object unchanged; put one after the other, the later bytes.
    std::vector<std::byte> later(data[0].size());
    fill_random(later.data(), later.size(), 999);
    r = run_batch(**b, StorageBatch{StorageOp::kPut,
                                    {{key_of(4, 1), data[2].data(), data[2].size()},
                                     {key_of(4, 1), later.data(), later.size()}}});
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(4, 1), later.data(), later.size()}}});
    ASSERT_TRUE(r.ok() && (*r)[0].status.ok());
    data[1] = later;
    std::vector<std::vector<std::byte>> got(kItems, std::vector<std::byte>(data[0].size()));
    StorageBatch gets{StorageOp::kGet, {}};
    for (int i = 0; i < kItems; ++i) gets.items.push_back({key_of(4, i), got[i].data(), got[i].size()});
    r = run_batch(**b, gets);
    ASSERT_TRUE(r.ok());
    for (int i = 0; i < kItems; ++i) {
      ASSERT_TRUE((*r)[i].status.ok()) << i;
      EXPECT_EQ(got[i], data[i]) << threads << " " << i;
    }
    EXPECT_EQ(make_storage_backend("memory:?capacity=1M&threads=65", {}).status().code(), StatusCode::kInvalidArgument);
  }
  // Room for three objects; a batch of five puts leaves the last three (the first two evicted by the later ones).
  const std::uint64_t object = format::header_bytes(StorageOptions{}, 8) + 8192;
  MemoryBackendConfig c;
  c.capacity_bytes = 3 * object;
  c.threads = 4;
  auto lru = create_memory_backend(c, StorageOptions{});
  ASSERT_TRUE(lru.ok());
  std::vector<std::byte> v(8192);
  StorageBatch five{StorageOp::kPut, {}};
  for (int i = 0; i < 5; ++i) five.items.push_back({key_of(5, i), v.data(), v.size()});
  auto r = run_batch(**lru, five);
  ASSERT_TRUE(r.ok());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE((*r)[i].status.ok()) << i;
  for (int i = 0; i < 5; ++i) {
    auto e = run_batch(**lru, StorageBatch{StorageOp::kExists, {{key_of(5, i), nullptr, 0}}});
    EXPECT_EQ((*e)[0].status.ok(), i >= 2) << i;
  }
  EXPECT_EQ((*lru)->stats().evictions, 2u);
}

TEST(DiskBackend, CapacityEvictsLeastRecentlyUsed) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  c.capacity_bytes = 10 * (4096 + 65536);  // ten 64 KiB objects with their 4 KiB headers
  auto b = create_disk_backend(c, StorageOptions{});
  ASSERT_TRUE(b.ok());
  AlignedBuffer v(65536), dst(65536);
  for (int i = 0; i < 10; ++i) {
    fill_random(v.data(), v.size(), i);
    auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(9, i), v.data(), v.size()}}});
    ASSERT_TRUE(r.ok() && (*r)[0].status.ok());
  }
  EXPECT_EQ((*b)->stats().objects, 10u);
  // Touch key 0, then add one more: key 1 (the least recently used) goes.
  ASSERT_TRUE(
      (*run_batch(**b, StorageBatch{StorageOp::kGet, {{key_of(9, 0), dst.data(), dst.size()}}}))[0].status.ok());
  auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(9, 10), v.data(), v.size()}}});
  ASSERT_TRUE((*r)[0].status.ok());
  auto st = (*b)->stats();
  EXPECT_EQ(st.objects, 10u);
  EXPECT_EQ(st.evictions, 1u);
  EXPECT_LE(st.bytes, c.capacity_bytes);
  EXPECT_EQ((*run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(9, 1), nullptr, 0}}}))[0].status.code(),
            StatusCode::kNotFound);
  EXPECT_TRUE((*run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(9, 0), nullptr, 0}}}))[0].status.ok());
  // An exists is a use too, as on the memory tier (an engine's prefetch asks before it reads): key 2, the least
  // recently used, is asked for, so the next put takes key 3 instead.
  ASSERT_TRUE((*run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(9, 2), nullptr, 0}}}))[0].status.ok());
  r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(9, 11), v.data(), v.size()}}});
  ASSERT_TRUE((*r)[0].status.ok());
  EXPECT_EQ((*run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(9, 3), nullptr, 0}}}))[0].status.code(),
            StatusCode::kNotFound);
  EXPECT_EQ((*run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(9, 2), nullptr, 0}}}))[0].status.code(),
            StatusCode::kOk);
  // Larger than the whole tier: refused.
  AlignedBuffer big(c.capacity_bytes);
  r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(9, 12), big.data(), big.size()}}});
  EXPECT_EQ((*r)[0].status.code(), StatusCode::kResourceExhausted);
}

TEST(DiskBackend, OutOfSpaceIsResourceExhaustedAndNotAcknowledged) {
  // No small filesystem can be mounted here: RLIMIT_FSIZE makes the kernel refuse writes past
  // 512 KiB (EFBIG, the per-file analogue of ENOSPC), in a child so the limit stays there.
  TempDir dir;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{512 * 1024, 512 * 1024};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) _exit(10);
    DiskBackendConfig c;
    c.root = dir.path();
    auto b = create_disk_backend(c, StorageOptions{});
    if (!b.ok()) _exit(11);
    AlignedBuffer v(1 << 20);
    auto r = run_batch(
        **b, StorageBatch{StorageOp::kPut, {{key_of(1, 1), v.data(), v.size()}, {key_of(1, 2), v.data(), 4096}}});
    if (!r.ok()) _exit(12);
    if ((*r)[0].status.code() != StatusCode::kResourceExhausted) _exit(13);
    if (!(*r)[1].status.ok()) _exit(14);
    auto e = run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(1, 1), nullptr, 0}}});
    if (!e.ok() || (*e)[0].status.code() != StatusCode::kNotFound) _exit(15);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the exit codes in the child above";
}

TEST(DiskBackend, IndexRebuildQuarantinesBadFilesAndDropsTemporaries) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  StorageOptions o;
  o.ns = "rebuild";
  std::string ns_dir;
  {
    auto b = create_disk_backend(c, o);
    ASSERT_TRUE(b.ok());
    AlignedBuffer v(8192);
    fill_random(v.data(), v.size(), 1);
    for (int i = 0; i < 3; ++i)
      ASSERT_TRUE(
          (*run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(5, i), v.data(), v.size()}}}))[0].status.ok());
    // Corrupt one header at rest.
    ASSERT_TRUE((*b)->corrupt_stored_object(key_of(5, 1), 40, 0xFF).ok());
  }
  // A leftover temporary and a truncated object file.
  const StorageKey k0 = key_of(5, 0);
  ns_dir = fmt::format("{}/{:016x}-{:016x}", dir.path(), format::namespace_digest("rebuild"), 0);
  const std::string shard = fmt::format("{}/{:02x}", ns_dir, k0.digest[0]);
  const std::string tmp = fmt::format("{}/{}.kvo.tmp.1.1", shard, k0.to_string());
  FILE* f = std::fopen(tmp.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("partial", f);
  std::fclose(f);
  const StorageKey k2 = key_of(5, 2);
  ASSERT_EQ(::truncate(fmt::format("{}/{:02x}/{}.kvo", ns_dir, k2.digest[0], k2.to_string()).c_str(), 5000), 0);
  auto b = create_disk_backend(c, o);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->stats().objects, 1u);
  EXPECT_EQ((*b)->stats().quarantined, 2u);
  EXPECT_NE(::access(tmp.c_str(), F_OK), 0);
  AlignedBuffer dst(8192);
  EXPECT_TRUE((*run_batch(**b, StorageBatch{StorageOp::kGet, {{k0, dst.data(), dst.size()}}}))[0].status.ok());
  EXPECT_EQ((*run_batch(**b, StorageBatch{StorageOp::kGet, {{k2, dst.data(), dst.size()}}}))[0].status.code(),
            StatusCode::kNotFound);
}

TEST(DiskBackend, RecycledFilesServeOnlyTheirNewObject) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  c.queue_depth = 4;
  StorageOptions o;
  o.ns = "recycle";
  AlignedBuffer big(1 << 20), small(600 * 1024), dst(1 << 20);
  fill_random(big.data(), big.size(), 1);
  fill_random(small.data(), small.size(), 2);
  const std::string free_dir =
      fmt::format("{}/{:016x}-{:016x}/free", dir.path(), format::namespace_digest("recycle"), 0);
  auto count_free = [&] {
    int n = 0;
    if (DIR* d = ::opendir(free_dir.c_str())) {
      while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
      ::closedir(d);
    }
    return n;
  };
  auto one = [&](StorageBackend& b, StorageOp op, const StorageKey& k, void* p, std::uint64_t n) {
    return (*run_batch(b, StorageBatch{op, {{k, p, n}}}))[0];
  };
  {
    auto b = create_disk_backend(c, o);
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(1, 1), big.data(), big.size()).status.ok());
    ASSERT_TRUE(one(**b, StorageOp::kDelete, key_of(1, 1), nullptr, 0).status.ok());
    EXPECT_EQ(count_free(), 1);
    // The 1 MiB file is rewritten with a 600 KiB object: only the new bytes may come back.
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(1, 2), small.data(), small.size()).status.ok());
    EXPECT_EQ(count_free(), 0);
    ItemResult r = one(**b, StorageOp::kGet, key_of(1, 2), dst.data(), dst.size());
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(r.bytes, small.size());
    EXPECT_EQ(std::memcmp(dst.data(), small.data(), small.size()), 0);
    // Overwrite: the replaced file goes to the pool (atomic exchange), the new object is served.
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(1, 2), big.data(), big.size()).status.ok());
    EXPECT_EQ(count_free(), 1);
    r = one(**b, StorageOp::kGet, key_of(1, 2), dst.data(), dst.size());
    ASSERT_TRUE(r.status.ok());
    EXPECT_EQ(r.bytes, big.size());
    EXPECT_EQ(std::memcmp(dst.data(), big.data(), big.size()), 0);
    // A free file far larger than the object is not reused for it.
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(1, 3), small.data(), 4096).status.ok());
    EXPECT_EQ(count_free(), 0);
    ASSERT_TRUE(one(**b, StorageOp::kPut, key_of(1, 4), small.data(), small.size()).status.ok());
  }
  // After a restart the pool and the objects are back.
  auto b = create_disk_backend(c, o);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->stats().objects, 3u);
  ItemResult r = one(**b, StorageOp::kGet, key_of(1, 2), dst.data(), dst.size());
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(std::memcmp(dst.data(), big.data(), big.size()), 0);
  r = one(**b, StorageOp::kGet, key_of(1, 4), dst.data(), dst.size());
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.bytes, small.size());
  EXPECT_EQ(std::memcmp(dst.data(), small.data(), small.size()), 0);
}

// A recycled free file longer than its new object used to keep its length: the index counted the longer file, for
// which no room had been made, and a batch admitted against the object's own size took the tier past its capacity
// (1,216,512 bytes of objects in a 1 MiB tier here).
TEST(DiskBackend, ARecycledFileNeverTakesTheTierPastItsCapacity) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  c.capacity_bytes = 1 << 20;
  StorageOptions o;
  o.ns = "recycle-capacity";
  const std::string ns_dir = fmt::format("{}/{:016x}-{:016x}", dir.path(), format::namespace_digest(o.ns), 0);
  auto object_file_bytes = [&] {
    std::uint64_t sum = 0;
    for (int s = 0; s < 256; ++s)
      if (DIR* d = ::opendir(fmt::format("{}/{:02x}", ns_dir, s).c_str())) {
        while (dirent* e = ::readdir(d)) {
          struct stat sb {};
          if (e->d_name[0] != '.' && ::fstatat(::dirfd(d), e->d_name, &sb, 0) == 0) sum += sb.st_size;
        }
        ::closedir(d);
      }
    return sum;
  };
  AlignedBuffer a(600'000), b(400'000), x(210'000), y(200'000), dst(600'000);
  fill_random(x.data(), x.size(), 3);
  fill_random(y.data(), y.size(), 4);
  auto backend = create_disk_backend(c, o);
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE(
      (*run_batch(**backend, StorageBatch{StorageOp::kPut, {{key_of(2, 1), a.data(), a.size()}}}))[0].status.ok());
  ASSERT_TRUE(
      (*run_batch(**backend, StorageBatch{StorageOp::kPut, {{key_of(2, 2), b.data(), b.size()}}}))[0].status.ok());
  ASSERT_TRUE((*run_batch(**backend, StorageBatch{StorageOp::kDelete, {{key_of(2, 2), nullptr, 0}}}))[0].status.ok());
  // The 400 KB object's file is free; the first of these two reuses it.
  auto r = run_batch(**backend, StorageBatch{StorageOp::kPut,
                                             {{key_of(2, 3), x.data(), x.size()}, {key_of(2, 4), y.data(), y.size()}}});
  ASSERT_TRUE(r.ok());
  for (const ItemResult& item : *r) EXPECT_TRUE(item.status.ok()) << item.status.to_string();
  EXPECT_LE((*backend)->stats().bytes, c.capacity_bytes);
  EXPECT_LE(object_file_bytes(), c.capacity_bytes);
  EXPECT_EQ(object_file_bytes(), (*backend)->stats().bytes);
  for (auto [i, buf] : {std::pair{3, &x}, std::pair{4, &y}}) {
    ItemResult g = (*run_batch(**backend, StorageBatch{StorageOp::kGet, {{key_of(2, i), dst.data(), dst.size()}}}))[0];
    ASSERT_TRUE(g.status.ok()) << i << ": " << g.status.to_string();
    EXPECT_EQ(g.bytes, buf->size());
    EXPECT_EQ(std::memcmp(dst.data(), buf->data(), buf->size()), 0) << i;
  }
}

class StorageTierTest : public ::testing::TestWithParam<bool> {};

// A host pool, page-first (zero-copy) or layer-first (staged), through the disk backend.
TEST_P(StorageTierTest, WriteReadBlocksByKey) {
  const bool page_first = GetParam();
  GqaShape shape;
  shape.num_layers = 3;
  shape.kv_heads = 2;
  shape.block_tokens = 16;
  shape.head_dim = 64;  // 4 KiB per (layer, role)
  auto layout = KvLayout::gqa(shape);
  ASSERT_TRUE(layout.ok());
  constexpr std::uint64_t kBlocks = 8;
  const std::uint64_t page = BlockSpace::page_first_page_bytes(*layout, 4096);
  AlignedBuffer region(page * kBlocks), region2(page * kBlocks);
  std::vector<std::unique_ptr<AlignedBuffer>> planes;
  auto make_space = [&](AlignedBuffer& r) -> Result<BlockSpace> {
    if (page_first)
      return BlockSpace::page_first(MemoryKind::kPinnedHost, 0, *layout, kBlocks, r.data(), r.size(), 4096);
    std::vector<std::vector<void*>> bases(layout->num_layers());
    for (std::uint32_t l = 0; l < layout->num_layers(); ++l)
      for (std::uint32_t k = 0; k < layout->num_roles(l); ++k) {
        planes.push_back(std::make_unique<AlignedBuffer>(BlockSpace::layer_first_region_bytes(*layout, l, k, kBlocks)));
        bases[l].push_back(planes.back()->data());
      }
    return BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, *layout, kBlocks, bases);
  };
  auto src_space = make_space(region);
  auto dst_space = make_space(region2);
  ASSERT_TRUE(src_space.ok() && dst_space.ok());
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  auto opts = StorageTier::storage_options(*layout, "tier-test");
  auto b1 = create_disk_backend(c, opts);
  ASSERT_TRUE(b1.ok());
  auto tier = StorageTier::create(std::move(b1).value(), *src_space, 0);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  EXPECT_EQ((*tier)->zero_copy(), page_first);
  for (std::uint32_t l = 0; l < layout->num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout->num_roles(l); ++r)
      for (std::uint64_t blk = 0; blk < kBlocks; ++blk)
        fill_random(src_space->block_ptr(l, r, blk), layout->block_bytes(l, r), l * 100 + r * 10 + blk);
  std::vector<StorageKey> keys = {key_of(3, 0), key_of(3, 1), key_of(3, 2)};
  std::vector<std::uint64_t> src_blocks = {5, 1, 7};
  auto w = (*tier)->write(keys, src_blocks);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->wait().ok());
  for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(w->status(i).ok()) << w->status(i).to_string();
  EXPECT_EQ((*tier)->write(keys, std::vector<std::uint64_t>{1, 2, kBlocks}).status().code(), StatusCode::kOutOfRange);

  // Read back through a second tier on the same directory (another host pool).
  tier->reset();
  auto b2 = create_disk_backend(c, opts);
  ASSERT_TRUE(b2.ok());
  auto tier2 = StorageTier::create(std::move(b2).value(), *dst_space, 0);
  ASSERT_TRUE(tier2.ok());
  std::vector<StorageKey> rkeys = {key_of(3, 2), key_of(3, 0), key_of(3, 9)};
  std::vector<std::uint64_t> dst_blocks = {0, 3, 4};
  auto rd = (*tier2)->read(rkeys, dst_blocks);
  ASSERT_TRUE(rd.ok());
  while (!rd->poll()) std::this_thread::yield();
  EXPECT_TRUE(rd->status(0).ok());
  EXPECT_TRUE(rd->status(1).ok());
  EXPECT_EQ(rd->status(2).code(), StatusCode::kNotFound);
  EXPECT_EQ(rd->ok_prefix(), 2u);
  for (std::uint32_t l = 0; l < layout->num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout->num_roles(l); ++r) {
      EXPECT_EQ(std::memcmp(dst_space->block_ptr(l, r, 0), src_space->block_ptr(l, r, 7), layout->block_bytes(l, r)),
                0);
      EXPECT_EQ(std::memcmp(dst_space->block_ptr(l, r, 3), src_space->block_ptr(l, r, 5), layout->block_bytes(l, r)),
                0);
    }
  auto ex = (*tier2)->exists(rkeys);
  ASSERT_TRUE(ex.ok());
  ASSERT_TRUE(ex->wait().ok());
  EXPECT_EQ(ex->ok_prefix(), 2u);
  // A backend created for another layout is refused.
  auto other = KvLayout::uniform(2, 1, 4096);
  DiskBackendConfig other_dir;
  other_dir.root = dir.path() + "/x";
  auto b3 = create_disk_backend(other_dir, StorageTier::storage_options(*other, "tier-test"));
  ASSERT_TRUE(b3.ok());
  EXPECT_EQ(StorageTier::create(std::move(b3).value(), *dst_space, 0).status().code(), StatusCode::kInvalidArgument);
}

// A staged batch (host blocks not packed page-first) stages one object per key, sized from the caller's key count:
// 4,096 keys of 1 GiB objects threw bad_alloc out of read() and aborted the process. More keys than the host space
// has blocks are refused before anything is allocated (the planes here are never touched).
TEST(StorageTierStaging, AStagedBatchBeyondTheHostSpaceIsRefusedNotAllocated) {
  auto layout = KvLayout::uniform(1, 2, std::uint64_t{1} << 30);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  std::vector<std::vector<void*>> bases = {
      {reinterpret_cast<void*>(std::uintptr_t{1} << 40), reinterpret_cast<void*>(std::uintptr_t{2} << 40)}};
  auto space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, *layout, 2, bases);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  auto backend = create_disk_backend(c, StorageTier::storage_options(*layout, "tier-staging"));
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  auto tier = StorageTier::create(std::move(backend).value(), *space, 0);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_FALSE((*tier)->zero_copy());
  std::vector<StorageKey> keys(4096, key_of(1, 0));
  std::vector<std::uint64_t> blocks(4096, 0);
  for (bool read : {true, false}) {
    auto op = read ? (*tier)->read(keys, blocks) : (*tier)->write(keys, blocks);
    ASSERT_FALSE(op.ok());
    EXPECT_EQ(op.status().code(), StatusCode::kInvalidArgument) << op.status().to_string();
    EXPECT_NE(op.status().message().find("4096 keys in one staged batch, more than the host space's 2 blocks"),
              std::string::npos)
        << op.status().to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(HostLayouts, StorageTierTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "page_first" : "layer_first"; });

// A spec with a NUL byte opened what came before the NUL ("disk:/a\0/b" became disk:/a): refused, the NUL shown.
TEST(StorageSpec, ANulByteIsRefusedNotCutAt) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("kvtier-nul-{}", ::getpid());
  std::filesystem::remove_all(dir);
  const std::string spec = "disk:" + dir.string() + std::string(1, '\0') + "/other";
  auto backend = make_storage_backend(spec, StorageOptions{});
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(backend.status().message().find(dir.string() + "\\0/other"), std::string::npos)
      << backend.status().message();
  EXPECT_FALSE(std::filesystem::exists(dir));
  for (const std::string& other : {std::string("memory:?capacity=1M") + '\0', std::string("redis://h") + '\0' + ":1"})
    EXPECT_EQ(make_storage_backend(other, StorageOptions{}).status().code(), StatusCode::kInvalidArgument);
}

// StorageTicket::wait(milliseconds::max()) converted the timeout to nanoseconds implicitly, which overflows: it
// reported TimedOut at once for a batch still in progress instead of waiting for it.
TEST(StorageTicket, WaitWithoutALimitWaitsForTheBatch) {
  StorageTicket ticket = StorageTicket::create(StorageOp::kPut, 1);
  std::thread finisher([c = ticket.completion()] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    c->complete(0, Status::Ok(), 16);
  });
  const Status waited = ticket.wait(std::chrono::milliseconds::max());
  finisher.join();
  EXPECT_TRUE(waited.ok()) << waited.to_string();
  EXPECT_TRUE(ticket.poll());
}

// An empty ticket (default-constructed or moved from) answered size(), poll() and wait(), but item() and op()
// dereferenced its null completion (SIGSEGV).
TEST(StorageTicket, AnEmptyTicketAnswersEveryCall) {
  StorageTicket moved = StorageTicket::create(StorageOp::kGet, 2);
  StorageTicket taker = std::move(moved);
  for (const StorageTicket* t :
       {static_cast<const StorageTicket*>(&moved), static_cast<const StorageTicket*>(nullptr)}) {
    StorageTicket empty;
    const StorageTicket& ticket = t != nullptr ? *t : empty;
    EXPECT_FALSE(ticket.valid());
    EXPECT_EQ(ticket.size(), 0u);
    EXPECT_EQ(ticket.item(0).status.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(ticket.item(0).status.message().find("empty storage ticket"), std::string::npos);
    EXPECT_FALSE(ticket.item_done(0));
    EXPECT_EQ(ticket.op(), StorageOp::kExists);
  }
  EXPECT_EQ(taker.op(), StorageOp::kGet);
  EXPECT_EQ(taker.item(2).status.code(), StatusCode::kOutOfRange);
}

// Config structs set directly, past the spec parser's checks: enum values outside their enums were taken as the
// weakest setting without a word, and a thread count past the documented 64 failed as Internal, naming nothing.
TEST(StorageConfig, ValuesOutsideTheirRangeAreRefusedByName) {
  TempDir dir;
  DiskBackendConfig disk;
  disk.root = dir.path();
  disk.durability = static_cast<Durability>(9);
  auto d = create_disk_backend(disk, StorageOptions{});
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("durability 9"), std::string::npos) << d.status().to_string();
  disk.durability = Durability::kProcessCrash;
  disk.direct_io = static_cast<DirectIo>(9);
  d = create_disk_backend(disk, StorageOptions{});
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("direct_io 9"), std::string::npos) << d.status().to_string();
  MemoryBackendConfig memory;
  memory.capacity_bytes = 1 << 20;
  memory.threads = 100000;
  auto m = create_memory_backend(memory, StorageOptions{});
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("threads 100000"), std::string::npos) << m.status().to_string();
  memory.threads = kMaxMemoryBackendThreads;
  EXPECT_TRUE(create_memory_backend(memory, StorageOptions{}).ok());
}

}  // namespace
}  // namespace kvtier::storage
