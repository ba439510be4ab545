// Tenant isolation of the storage tiers: two tenants of one model on one disk root and on one
// Redis server / cluster, each trying to read, overwrite and pre-seed the other's blocks through
// the library (same block key, same namespace, wrong or no secret) and around it (raw file
// copies and writes; raw Redis commands with the other tenant's ACL user, and forged or copied
// values written with an admin connection). Every attempt must end as a miss or an error, never
// as the other tenant's bytes served, and what the victim stored is still served to it afterwards
// unless it was overwritten (then a miss). Also: the keyed object format itself, the tenant
// options' validation, the secret file, and single-tenant compatibility (no tenant, no secret).
//
// Redis parts need KVTIER_TEST_REDIS(_PASSWORD) / KVTIER_TEST_REDIS_CLUSTER
// (scripts/start-test-services.sh) and skip without them; they create the ACL users
// kvtier-tenant-a / kvtier-tenant-b themselves with an admin connection (the same ones the script
// creates), restricted to the key prefixes kvtier-iso:ta:* / kvtier-iso:tb:*.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvtier/core/config.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/storage/redis_backend.h"
#include "kvtier/storage/storage_config.h"
#include "storage/object_format.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::fill_random;
using testing::key_of;
using testing::TempDir;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

std::string secret_of(char c) { return std::string(32, c); }

std::vector<std::byte> bytes_of(std::uint64_t seed, std::size_t n) {
  std::vector<std::byte> v(n);
  fill_random(v.data(), n, seed);
  return v;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, std::string_view data, mode_t mode = 0600) {
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, mode);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  ::close(fd);
}

mode_t mode_of(const std::string& path) {
  struct stat sb {};
  return ::lstat(path.c_str(), &sb) == 0 ? (sb.st_mode & 0777) : 0;
}

// A complete object (header + payload) as a backend with `o` writes it, header aligned to `align`.
std::string make_object(const StorageOptions& o, const StorageKey& k, const std::vector<std::byte>& payload,
                        std::uint32_t align) {
  const std::uint32_t hs = format::header_bytes(o, align);
  std::string obj(hs + payload.size(), '\0');
  auto* out = reinterpret_cast<std::byte*>(obj.data());
  EXPECT_TRUE(format::encode_header(o, format::namespace_digest(o), k, payload.data(), payload.size(), hs, out).ok());
  std::memcpy(out + hs, payload.data(), payload.size());
  return obj;
}

StorageOptions tenant_options(const std::string& ns, const std::string& tenant, std::string secret) {
  StorageOptions o;
  o.ns = ns;
  o.layout_fingerprint = 0x1a70;
  o.tenant = tenant;
  o.tenant_secret = std::move(secret);
  o.roles = {{0, 0, 0, 0, 1000}, {0, 1, 0, 1000, 1000}};
  return o;
}

// ---- the keyed object format -------------------------------------------------

TEST(KeyedFormat, RoundTripAndLayout) {
  const StorageOptions o = tenant_options("fmt", "ta", secret_of('a'));
  const StorageKey k = key_of(1, 1, 3);
  const auto payload = bytes_of(1, 5000);
  const std::string obj = make_object(o, k, payload, 8);
  const auto* data = reinterpret_cast<const std::byte*>(obj.data());
  EXPECT_EQ(format::header_bytes(o, 8), format::kKeyedFixedHeaderBytes + 2 * format::kRoleEntryBytes);
  EXPECT_EQ(static_cast<std::uint8_t>(data[8]), format::kKeyedFormatVersion);
  EXPECT_EQ(static_cast<std::uint8_t>(data[10]), format::kFlagKeyed);
  auto h = format::decode_header(data, obj.size(), nullptr, o.tenant_secret);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_TRUE(h->keyed);
  EXPECT_EQ(h->key, k);
  EXPECT_EQ(h->ns_digest, format::namespace_digest(o));
  ASSERT_EQ(h->roles.size(), 2u);
  EXPECT_EQ(h->roles[1].offset, 1000u);
  EXPECT_TRUE(format::verify_object(data, *h, data + h->header_size, o.tenant_secret).ok());
  // Streamed in uneven pieces: the same verdict.
  format::ObjectVerifier v(data, *h, o.tenant_secret);
  for (std::size_t off = 0; off < payload.size(); off += 777)
    v.update(data + h->header_size + off, std::min<std::size_t>(777, payload.size() - off));
  EXPECT_TRUE(v.finish().ok());
  // Without a tenant or secret the format stays version 1, byte for byte as before.
  StorageOptions plain = o;
  plain.tenant.clear();
  plain.tenant_secret.clear();
  const std::string old = make_object(plain, k, payload, 8);
  EXPECT_EQ(static_cast<std::uint8_t>(old[8]), format::kFormatVersion);
  EXPECT_EQ(format::header_bytes(plain, 8), format::kFixedHeaderBytes + 2 * format::kRoleEntryBytes);
  EXPECT_EQ(format::namespace_digest(plain), format::namespace_digest(plain.ns));
  EXPECT_NE(format::namespace_digest(o), format::namespace_digest(o.ns));
}

TEST(KeyedFormat, EveryFlippedBitIsRefused) {
  const StorageOptions o = tenant_options("fmt", "ta", secret_of('a'));
  const StorageKey k = key_of(1, 2);
  const auto payload = bytes_of(2, 2100);  // the roles table covers 2000 bytes
  const std::string obj = make_object(o, k, payload, 8);
  for (std::size_t off = 0; off < obj.size(); ++off) {
    std::string bad = obj;
    bad[off] = static_cast<char>(bad[off] ^ 0x04);
    const auto* d = reinterpret_cast<const std::byte*>(bad.data());
    auto h = format::decode_header(d, bad.size(), nullptr, o.tenant_secret);
    const bool accepted = h.ok() &&
                          format::check_identity(*h, format::namespace_digest(o), o.layout_fingerprint, k).ok() &&
                          format::check_object_size(*h, bad.size(), true).ok() &&
                          format::verify_object(d, *h, d + h->header_size, o.tenant_secret).ok();
    EXPECT_FALSE(accepted) << "flipped byte at offset " << off << " accepted";
  }
  // The unflipped object is accepted (so the loop above tested the checks, not a broken object).
  const auto* d = reinterpret_cast<const std::byte*>(obj.data());
  auto h = format::decode_header(d, obj.size(), nullptr, o.tenant_secret);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_TRUE(format::verify_object(d, *h, d + h->header_size, o.tenant_secret).ok());
}

TEST(KeyedFormat, ForeignKeysAndOtherModesAreAuthenticationFailures) {
  const StorageOptions a = tenant_options("fmt", "ta", secret_of('a'));
  const StorageKey k = key_of(1, 3);
  const auto payload = bytes_of(3, 2000);
  const std::string obj = make_object(a, k, payload, 8);
  const auto* d = reinterpret_cast<const std::byte*>(obj.data());
  // Wrong secret: the header tag fails.
  auto wrong = format::decode_header(d, obj.size(), nullptr, secret_of('b'));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(format::is_auth_failure(wrong.status())) << wrong.status().to_string();
  // An unkeyed reader refuses the keyed object before parsing it.
  auto unkeyed = format::decode_header(d, obj.size());
  ASSERT_FALSE(unkeyed.ok());
  EXPECT_TRUE(format::is_auth_failure(unkeyed.status())) << unkeyed.status().to_string();
  // A keyed reader refuses an unkeyed object with the right identity (what anyone can write).
  StorageOptions forger = a;
  forger.tenant_secret.clear();
  const std::string forged = make_object(forger, k, payload, 8);
  auto f =
      format::decode_header(reinterpret_cast<const std::byte*>(forged.data()), forged.size(), nullptr, a.tenant_secret);
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(format::is_auth_failure(f.status())) << f.status().to_string();
  // The payload tag: a header copied from a valid object onto another payload.
  std::string spliced = obj;
  spliced[spliced.size() - 1] = static_cast<char>(spliced.back() ^ 1);
  const auto* sd = reinterpret_cast<const std::byte*>(spliced.data());
  auto h = format::decode_header(sd, spliced.size(), nullptr, a.tenant_secret);
  ASSERT_TRUE(h.ok());
  Status st = format::verify_object(sd, *h, sd + h->header_size, a.tenant_secret);
  EXPECT_TRUE(format::is_auth_failure(st)) << st.to_string();
  // Damage the xxh3 header checksum catches is plain damage, not an authentication failure.
  std::string damaged = obj;
  damaged[20] = static_cast<char>(damaged[20] ^ 1);
  auto dh = format::decode_header(reinterpret_cast<const std::byte*>(damaged.data()), damaged.size(), nullptr,
                                  a.tenant_secret);
  ASSERT_FALSE(dh.ok());
  EXPECT_FALSE(format::is_auth_failure(dh.status())) << dh.status().to_string();
}

// Two writes of one block by its own tenant: each has its own nonce, so the payload's one-time key
// differs, and a header of one write spliced onto the other's payload (both authentic) is refused.
TEST(KeyedFormat, EachWriteHasItsOwnKeyAndHeadersDoNotMoveBetweenWrites) {
  const StorageOptions a = tenant_options("fmt", "ta", secret_of('a'));
  const StorageKey k = key_of(1, 4);
  const auto p1 = bytes_of(4, 2000), p2 = bytes_of(5, 2000);
  const std::string o1 = make_object(a, k, p1, 8), o1_again = make_object(a, k, p1, 8), o2 = make_object(a, k, p2, 8);
  const std::uint32_t hs = format::header_bytes(a, 8);
  EXPECT_NE(o1.substr(80, 16), o1_again.substr(80, 16)) << "nonce repeated";
  EXPECT_NE(o1.substr(128, 16), o1_again.substr(128, 16)) << "payload tag repeated for a new write";
  const std::string spliced = o1.substr(0, hs) + o2.substr(hs);
  const auto* d = reinterpret_cast<const std::byte*>(spliced.data());
  auto h = format::decode_header(d, spliced.size(), nullptr, a.tenant_secret);
  ASSERT_TRUE(h.ok()) << h.status().to_string();  // an authentic header of this tenant
  Status st = format::verify_object(d, *h, d + hs, a.tenant_secret);
  EXPECT_TRUE(format::is_auth_failure(st)) << st.to_string();
  // A nonce changed by someone without the secret: the header tag no longer matches.
  std::string renonced = o1;
  renonced[85] = static_cast<char>(renonced[85] ^ 1);
  auto r = format::decode_header(reinterpret_cast<const std::byte*>(renonced.data()), renonced.size(), nullptr,
                                 a.tenant_secret);
  EXPECT_FALSE(r.ok());
}

TEST(KeyedFormat, TenantOptionsAreChecked) {
  StorageOptions o = tenant_options("fmt", "ta", secret_of('a'));
  EXPECT_TRUE(format::check_tenant_options(o).ok());
  o.tenant_secret = std::string(31, 'x');
  Status st = format::check_tenant_options(o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tenant_secret"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("31"), std::string::npos) << st.to_string();
  o.tenant_secret = std::string(65, 'x');
  EXPECT_EQ(format::check_tenant_options(o).code(), StatusCode::kInvalidArgument);
  o.tenant_secret = std::string(64, 'x');
  EXPECT_TRUE(format::check_tenant_options(o).ok());
  for (const char* bad : {"a/b", "..", "t:a", "a*", "t a"}) {
    o.tenant = bad;
    st = format::check_tenant_options(o);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("StorageOptions::tenant"), std::string::npos) << st.to_string();
  }
  o.tenant = std::string(65, 'a');
  EXPECT_EQ(format::check_tenant_options(o).code(), StatusCode::kInvalidArgument);
  // The backends refuse them at create.
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  o.tenant = "ta";
  o.tenant_secret = std::string(16, 'x');
  auto b = create_disk_backend(c, o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("tenant_secret"), std::string::npos) << b.status().to_string();
  RedisBackendConfig rc;
  rc.endpoints = {"127.0.0.1:1"};
  auto r = create_redis_backend(rc, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
}

TEST(KeyedFormat, KeyedNamesRevealNothing) {
  const StorageOptions a = tenant_options("model-x", "ta", secret_of('a'));
  const StorageKey k = key_of(5, 5);
  const std::string n = format::keyed_object_name(a, k);
  EXPECT_EQ(n.size(), 32u);
  EXPECT_EQ(n.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(n, format::keyed_object_name(a, k));
  EXPECT_EQ(n.find(k.to_string().substr(0, 8)), std::string::npos);
  std::set<std::string> names{n};
  StorageOptions other = a;
  other.tenant_secret = secret_of('b');
  names.insert(format::keyed_object_name(other, k));
  other = a;
  other.ns = "model-y";
  names.insert(format::keyed_object_name(other, k));
  other = a;
  other.tenant = "tb";
  names.insert(format::keyed_object_name(other, k));
  other = a;
  other.layout_fingerprint ^= 1;
  names.insert(format::keyed_object_name(other, k));
  names.insert(format::keyed_object_name(a, key_of(5, 5, 1)));
  names.insert(format::keyed_object_name(a, key_of(5, 6)));
  EXPECT_EQ(names.size(), 7u);
}

TEST(TenantConfig, SecretFileAndKnobs) {
  TempDir dir;
  const std::string hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
  const std::string path = dir.path() + "/secret";
  write_file(path, hex + "\n", 0600);
  auto s = read_tenant_secret_file(path);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_EQ(s->size(), 32u);
  EXPECT_EQ(static_cast<std::uint8_t>((*s)[1]), 0x11);
  EXPECT_EQ(static_cast<std::uint8_t>((*s)[31]), 0xff);
  // Through a link, as Kubernetes mounts secrets (refused as "Too many levels of symbolic links" before).
  ASSERT_EQ(::mkdir((dir.path() + "/..data").c_str(), 0700), 0);
  ASSERT_EQ(::rename(path.c_str(), (dir.path() + "/..data/secret").c_str()), 0);
  ASSERT_EQ(::symlink("..data/secret", path.c_str()), 0);
  auto linked = read_tenant_secret_file(path);
  ASSERT_TRUE(linked.ok()) << linked.status().to_string();
  EXPECT_EQ(*linked, *s);
  // Readable by others: refused, like ssh refuses its keys (the mode of the file the link leads to).
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  EXPECT_EQ(read_tenant_secret_file(path).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::rename((dir.path() + "/..data/secret").c_str(), path.c_str()), 0);
  write_file(path, hex.substr(0, 62), 0600);  // 31 bytes
  auto short_secret = read_tenant_secret_file(path);
  EXPECT_EQ(short_secret.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_secret.status().message().find(path), std::string::npos);
  write_file(path, "zz" + hex.substr(2), 0600);
  EXPECT_EQ(read_tenant_secret_file(path).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(read_tenant_secret_file(dir.path() + "/absent").status().code(), StatusCode::kNotFound);
  // The knobs: storage.tenant.id and storage.tenant.secret_file.
  write_file(path, hex, 0600);
  ConfigTable table;
  TenantConfig tc;
  bind_tenant_config(table, tc);
  ASSERT_TRUE(
      table.apply_text(fmt::format("storage.tenant.id = team-a\nstorage.tenant.secret_file = {}\n", path)).ok());
  StorageOptions o;
  ASSERT_TRUE(apply_tenant_config(tc, o).ok());
  EXPECT_EQ(o.tenant, "team-a");
  EXPECT_EQ(o.tenant_secret, *s);
  tc.id = "bad/id";
  Status st = apply_tenant_config(tc, o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(o.tenant, "team-a");  // unchanged on error
  // And in a spec string.
  auto b = make_storage_backend(fmt::format("disk:{}/spec?tenant=tc&secret_file={}", dir.path(), path), o);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->options().tenant, "tc");
  EXPECT_EQ((*b)->options().tenant_secret, *s);
  EXPECT_EQ(mode_of(dir.path() + "/spec/tc"), 0700u);
}

// ---- disk: two tenants, one root ----------------------------------------------

class DiskTenants : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.root = dir_.path();
    config_.direct_io = DirectIo::kOff;
    config_.durability = Durability::kProcessCrash;
    a_ = tenant_options("llama-70b", "ta", secret_of('A'));
    b_ = tenant_options("llama-70b", "tb", secret_of('B'));
    open_a();
    open_b();
  }
  void open_a() {
    backend_a_.reset();
    auto r = create_disk_backend(config_, a_);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    backend_a_ = std::move(r).value();
  }
  void open_b() {
    auto r = create_disk_backend(config_, b_);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    backend_b_ = std::move(r).value();
  }
  std::string ns_dir(const StorageOptions& o) const {
    return fmt::format("{}/{}/{:016x}-{:016x}", dir_.path(), o.tenant, format::namespace_digest(o),
                       o.layout_fingerprint);
  }
  std::string object_path(const StorageOptions& o, const StorageKey& k) const {
    return fmt::format("{}/{:02x}/{}.kvo", ns_dir(o), k.digest[0], k.to_string());
  }

  TempDir dir_;
  DiskBackendConfig config_;
  StorageOptions a_, b_;
  std::unique_ptr<StorageBackend> backend_a_, backend_b_;
};

Status put(StorageBackend& b, const StorageKey& k, const std::vector<std::byte>& v) {
  auto r = run_batch(b, {StorageOp::kPut, {{k, const_cast<std::byte*>(v.data()), v.size()}}});
  return r.ok() ? (*r)[0].status : r.status();
}

// Get into a buffer pre-filled with 0xEE; returns the status and what the buffer holds.
std::pair<Status, std::vector<std::byte>> get(StorageBackend& b, const StorageKey& k, std::size_t cap = 4000) {
  std::vector<std::byte> dst(cap, std::byte{0xEE});
  auto r = run_batch(b, {StorageOp::kGet, {{k, dst.data(), dst.size()}}});
  if (!r.ok()) return {r.status(), {}};
  dst.resize((*r)[0].status.ok() ? (*r)[0].bytes : cap);
  return {(*r)[0].status, dst};
}

TEST_F(DiskTenants, OwnDirectoriesAndPermissions) {
  const auto v = bytes_of(1, 3000);
  ASSERT_TRUE(put(*backend_a_, key_of(1, 1), v).ok());
  EXPECT_EQ(mode_of(dir_.path() + "/ta"), 0700u);
  EXPECT_EQ(mode_of(dir_.path() + "/tb"), 0700u);
  EXPECT_EQ(mode_of(ns_dir(a_)), 0700u);
  EXPECT_EQ(mode_of(object_path(a_, key_of(1, 1))), 0600u);
  // Keyed: version 2 on the medium.
  EXPECT_EQ(static_cast<std::uint8_t>(read_file(object_path(a_, key_of(1, 1)))[8]), format::kKeyedFormatVersion);
  // A tenant directory created by someone else first, or opened up, is refused.
  StorageOptions c = a_;
  c.tenant = "tc";
  ASSERT_EQ(::mkdir((dir_.path() + "/tc").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((dir_.path() + "/tc").c_str(), 0755), 0);
  auto r = create_disk_backend(config_, c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().to_string();
  ASSERT_EQ(::symlink((dir_.path() + "/ta").c_str(), (dir_.path() + "/td").c_str()), 0);
  c.tenant = "td";
  EXPECT_FALSE(create_disk_backend(config_, c).ok());
}

TEST_F(DiskTenants, ThroughTheLibrary) {
  const StorageKey k = key_of(2, 1);  // a shared prompt: both tenants compute the same block key
  const auto va = bytes_of(10, 3000), vb = bytes_of(11, 3000);
  ASSERT_TRUE(put(*backend_a_, k, va).ok());
  // B reads A's block: a miss.
  EXPECT_EQ(get(*backend_b_, k).first.code(), StatusCode::kNotFound);
  // B "overwrites" it: lands in B's own space; A still gets its own bytes.
  ASSERT_TRUE(put(*backend_b_, k, vb).ok());
  auto [sa, da] = get(*backend_a_, k);
  ASSERT_TRUE(sa.ok()) << sa.to_string();
  EXPECT_EQ(da, va);
  auto [sb, db] = get(*backend_b_, k);
  ASSERT_TRUE(sb.ok());
  EXPECT_EQ(db, vb);
  // B pre-seeds a block A has not written yet; A's later get is a miss, A's put then wins.
  const StorageKey seed = key_of(2, 2);
  ASSERT_TRUE(put(*backend_b_, seed, vb).ok());
  EXPECT_EQ(get(*backend_a_, seed).first.code(), StatusCode::kNotFound);
  // An instance of tenant A configured with another secret, or without one, reads nothing of A's and destroys
  // nothing of A's: the index rebuild leaves every object it cannot authenticate where it is, unserved (it
  // quarantined them, and the quarantine keeps only a few: a typo in the secret file lost the store). Opened with the
  // right secret again, A finds them all.
  const StorageKey k2 = key_of(2, 3);
  ASSERT_TRUE(put(*backend_a_, k2, va).ok());
  backend_a_.reset();
  for (const std::string& secret : {secret_of('B'), std::string()}) {
    StorageOptions misconfigured = a_;
    misconfigured.tenant_secret = secret;
    auto w = create_disk_backend(config_, misconfigured);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_EQ((*w)->stats().objects, 0u) << "the index admitted objects it cannot authenticate";
    EXPECT_EQ((*w)->stats().auth_failures, 2u);
    EXPECT_EQ((*w)->stats().quarantined, 0u);
    auto [s, d] = get(**w, k);
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(d, va);
  }
  open_a();
  EXPECT_EQ(backend_a_->stats().objects, 2u);
  auto [s1, d1] = get(*backend_a_, k);
  ASSERT_TRUE(s1.ok()) << s1.to_string();
  EXPECT_EQ(d1, va);
  auto [s2, d2] = get(*backend_a_, k2);
  ASSERT_TRUE(s2.ok()) << s2.to_string();
  EXPECT_EQ(d2, va);
  // Beside objects that authenticate, one that does not is never served either.
  backend_a_.reset();
  const StorageKey forged = key_of(2, 5);
  const std::string forged_path = object_path(a_, forged);
  ::mkdir(forged_path.substr(0, forged_path.rfind('/')).c_str(), 0700);  // its shard directory, if new
  write_file(forged_path, make_object(tenant_options("llama-70b", "ta", secret_of('B')), forged, va, 4096));
  open_a();
  EXPECT_EQ(backend_a_->stats().objects, 2u);
  EXPECT_EQ(backend_a_->stats().auth_failures, 1u);
  EXPECT_EQ(get(*backend_a_, forged).first.code(), StatusCode::kNotFound);
}

// Objects that do not authenticate stay in place (above), but they used to count for nothing: every rotation of the
// secret left the earlier objects beside the new ones, and the directory grew past the capacity without bound (four
// rotations: four times the capacity on disk, stats() reporting one). They now count against the capacity and go
// first when room is needed; a put of the same key replaces one.
TEST_F(DiskTenants, ObjectsOfEarlierSecretsStayWithinTheCapacity) {
  backend_a_.reset();
  auto object_file_bytes = [&] {
    std::uint64_t sum = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(ns_dir(a_)))
      if (e.is_regular_file() && e.path().extension() == ".kvo") sum += e.file_size();
    return sum;
  };
  const auto v = bytes_of(3, 3000);
  config_.capacity_bytes = 0;
  open_a();
  ASSERT_TRUE(put(*backend_a_, key_of(7, 1000), v).ok());
  const std::uint64_t one = backend_a_->stats().bytes;
  ASSERT_GT(one, 0u);
  ASSERT_TRUE(run_batch(*backend_a_, {StorageOp::kDelete, {{key_of(7, 1000), nullptr, 0}}}).ok());
  backend_a_.reset();
  config_.capacity_bytes = 8 * one;
  for (int round = 0; round < 4; ++round) {
    a_.tenant_secret = secret_of(static_cast<char>('C' + round));
    open_a();
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(put(*backend_a_, key_of(7, round * 10 + i), v).ok()) << round << " " << i;
    EXPECT_LE(object_file_bytes(), config_.capacity_bytes) << "after rotation " << round;
    EXPECT_EQ(backend_a_->stats().bytes, object_file_bytes()) << "after rotation " << round;
    EXPECT_EQ(backend_a_->stats().objects, 6u);
    backend_a_.reset();
  }
  // The last secret's objects are all there; two of the previous one's remain, unserved. With room for one more
  // object, a put of one of their keys replaces its file (nothing is removed to make room) without counting it twice.
  config_.capacity_bytes = 9 * one;
  open_a();
  EXPECT_EQ(backend_a_->stats().objects, 6u);
  EXPECT_EQ(backend_a_->stats().auth_failures, 2u);
  EXPECT_EQ(backend_a_->stats().bytes, 8 * one);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(get(*backend_a_, key_of(7, 30 + i)).first.ok()) << i;
  ASSERT_TRUE(put(*backend_a_, key_of(7, 24), v).ok());
  EXPECT_EQ(backend_a_->stats().bytes, 8 * one);
  EXPECT_EQ(backend_a_->stats().bytes, object_file_bytes());
  ASSERT_TRUE(put(*backend_a_, key_of(7, 25), v).ok());
  EXPECT_EQ(backend_a_->stats().bytes, object_file_bytes());
  EXPECT_EQ(backend_a_->stats().bytes, 8 * one);
  EXPECT_EQ(backend_a_->stats().objects, 8u);
  auto [s, d] = get(*backend_a_, key_of(7, 25));
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(d, v);
}

TEST_F(DiskTenants, AroundTheLibrary) {
  const auto va1 = bytes_of(20, 3000), va2 = bytes_of(21, 2000), vb = bytes_of(22, 3000);
  const StorageKey k1 = key_of(3, 1), k2 = key_of(3, 2), k3 = key_of(3, 3), k4 = key_of(3, 4), k5 = key_of(3, 5);
  ASSERT_TRUE(put(*backend_a_, k1, va1).ok());
  ASSERT_TRUE(put(*backend_a_, k2, va2).ok());
  ASSERT_TRUE(put(*backend_a_, k3, va1).ok());
  for (const auto& k : {k1, k4, k5}) ASSERT_TRUE(put(*backend_b_, k, vb).ok());
  // 1. B's file for k1 copied over A's k1 (same key, same namespace, B's secret).
  const std::string b_k1 = read_file(object_path(b_, k1));
  write_file(object_path(a_, k1), b_k1);
  {
    auto [s, d] = get(*backend_a_, k1);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
    EXPECT_NE(d, vb);
  }
  EXPECT_EQ(backend_a_->stats().auth_failures, 1u);
  EXPECT_EQ(get(*backend_a_, k1).first.code(), StatusCode::kNotFound);  // overwritten: a miss from now on
  // 2. An unkeyed object with A's exact identity (what anyone who knows tenant, model and prompt
  //    can build) written over A's k2.
  StorageOptions forger = a_;
  forger.tenant_secret.clear();
  write_file(object_path(a_, k2), make_object(forger, k2, vb, 4096));
  EXPECT_EQ(get(*backend_a_, k2).first.code(), StatusCode::kDataLoss);
  // 3. A keyed object under a guessed secret.
  forger.tenant_secret = secret_of('G');
  write_file(object_path(a_, k3), make_object(forger, k3, vb, 4096));
  EXPECT_EQ(get(*backend_a_, k3).first.code(), StatusCode::kDataLoss);
  EXPECT_EQ(backend_a_->stats().auth_failures, 3u);
  // 4. Pre-seeding: B's files for k4 and a forged k5 planted in A's directory while A is down.
  backend_a_.reset();
  ASSERT_EQ(::mkdir(fmt::format("{}/{:02x}", ns_dir(a_), k4.digest[0]).c_str(), 0700) == 0 || errno == EEXIST, true);
  ASSERT_EQ(::mkdir(fmt::format("{}/{:02x}", ns_dir(a_), k5.digest[0]).c_str(), 0700) == 0 || errno == EEXIST, true);
  write_file(object_path(a_, k4), read_file(object_path(b_, k4)));
  forger.tenant_secret.clear();
  write_file(object_path(a_, k5), make_object(forger, k5, vb, 4096));
  open_a();
  EXPECT_EQ(backend_a_->stats().auth_failures, 2u) << "the index rebuild must refuse both planted files";
  EXPECT_EQ(get(*backend_a_, k4).first.code(), StatusCode::kNotFound);
  EXPECT_EQ(get(*backend_a_, k5).first.code(), StatusCode::kNotFound);
  // B's own objects were never touched.
  for (const auto& k : {k1, k4, k5}) {
    auto [s, d] = get(*backend_b_, k);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(d, vb);
  }
  // A's objects nobody touched are still served to A.
  const StorageKey k6 = key_of(3, 6);
  ASSERT_TRUE(put(*backend_a_, k6, va2).ok());
  open_a();
  auto [s6, d6] = get(*backend_a_, k6);
  ASSERT_TRUE(s6.ok());
  EXPECT_EQ(d6, va2);
}

// Tenants without secrets: separate directories and namespace digests still keep a copied file
// from being served to the other tenant (identity check), though nothing is authenticated.
TEST_F(DiskTenants, TenantsWithoutSecrets) {
  backend_a_.reset();
  backend_b_.reset();
  a_.tenant_secret.clear();
  b_.tenant_secret.clear();
  open_a();
  open_b();
  const StorageKey k = key_of(4, 1);
  const auto va = bytes_of(30, 3000), vb = bytes_of(31, 3000);
  ASSERT_TRUE(put(*backend_a_, k, va).ok());
  EXPECT_EQ(get(*backend_b_, k).first.code(), StatusCode::kNotFound);
  ASSERT_TRUE(put(*backend_b_, k, vb).ok());
  EXPECT_EQ(get(*backend_a_, k).second, va);
  write_file(object_path(a_, k), read_file(object_path(b_, k)));
  auto [s, d] = get(*backend_a_, k);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(d, vb);
  EXPECT_EQ(backend_a_->stats().auth_failures, 0u);  // refused by identity, not by a MAC
  EXPECT_EQ(static_cast<std::uint8_t>(read_file(object_path(b_, k))[8]), format::kFormatVersion);
}

// No tenant, no secret: the layout and format of earlier builds.
TEST(SingleTenant, LayoutAndFormatAsBefore) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  c.direct_io = DirectIo::kOff;
  StorageOptions o;
  o.ns = "single";
  const StorageKey k = key_of(5, 1);
  const auto v = bytes_of(40, 5000);
  {
    auto b = create_disk_backend(c, o);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    ASSERT_TRUE(put(**b, k, v).ok());
  }
  const std::string ns_dir = fmt::format("{}/{:016x}-{:016x}", dir.path(), format::namespace_digest("single"), 0);
  const std::string file = fmt::format("{}/{:02x}/{}.kvo", ns_dir, k.digest[0], k.to_string());
  const std::string obj = read_file(file);
  ASSERT_GT(obj.size(), 4096u);
  EXPECT_EQ(static_cast<std::uint8_t>(obj[8]), format::kFormatVersion);
  EXPECT_EQ(static_cast<std::uint8_t>(obj[10]), 0);
  // An object written by the encoder of the unkeyed format is read back after a restart.
  auto b = create_disk_backend(c, o);
  ASSERT_TRUE(b.ok());
  auto [s, d] = get(**b, k, 8000);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(d, v);
  EXPECT_EQ((*b)->stats().auth_failures, 0u);
}

// ---- Redis: two tenants, ACL users ----------------------------------------------

constexpr const char* kPrefix = "kvtier-iso";

struct Reply {
  redisReply* r = nullptr;
  ~Reply() {
    if (r) freeReplyObject(r);
  }
  bool error() const { return r == nullptr || r->type == REDIS_REPLY_ERROR; }
  std::string str() const { return r && r->str ? std::string(r->str, r->len) : std::string(); }
};

class Conn {
 public:
  Conn(const std::string& node, const std::string& user, const std::string& password) {
    auto hp = parse_host_port(node);
    if (!hp.ok()) return;
    timeval tv{5, 0};
    c_ = redisConnectWithTimeout(hp->first.c_str(), hp->second, tv);
    if (!ok()) return;
    redisSetTimeout(c_, tv);
    if (!password.empty()) {
      Reply r;
      if (user.empty())
        r.r = static_cast<redisReply*>(redisCommand(c_, "AUTH %b", password.data(), password.size()));
      else
        r.r = static_cast<redisReply*>(
            redisCommand(c_, "AUTH %b %b", user.data(), user.size(), password.data(), password.size()));
      auth_error_ = r.error() ? r.str() : "";
    }
  }
  ~Conn() {
    if (c_) redisFree(c_);
  }
  bool ok() const { return c_ && !c_->err && auth_error_.empty(); }
  const std::string& auth_error() const { return auth_error_; }
  std::unique_ptr<Reply> cmd(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto r = std::make_unique<Reply>();
    r->r = static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    return r;
  }

 private:
  redisContext* c_ = nullptr;
  std::string auth_error_;
};

struct RedisCase {
  std::string name;
  bool cluster;
};
void PrintTo(const RedisCase& c, std::ostream* os) { *os << c.name; }

// The ACL users of scripts/start-test-services.sh: each limited to its tenant's key prefix and to
// the commands the backend sends (GETRANGE SET DEL STRLEN, EVAL of its delete-if-unchanged script, PING, and in a
// cluster CLUSTER SLOTS and ASKING).
const std::vector<std::string>& acl_rule_tail() {
  static const std::vector<std::string> tail{"resetchannels", "-@all", "+getrange", "+set",    "+del",
                                             "+strlen",       "+eval", "+ping",     "+asking", "+cluster|slots"};
  return tail;
}

class RedisTenants : public ::testing::TestWithParam<RedisCase> {
 protected:
  void SetUp() override {
    const char* ep = env(GetParam().cluster ? "KVTIER_TEST_REDIS_CLUSTER" : "KVTIER_TEST_REDIS");
    if (!ep)
      GTEST_SKIP() << (GetParam().cluster ? "KVTIER_TEST_REDIS_CLUSTER" : "KVTIER_TEST_REDIS")
                   << " not set; scripts/start-test-services.sh starts the services";
    seed_ = ep;
    if (!GetParam().cluster && env("KVTIER_TEST_REDIS_PASSWORD")) admin_password_ = env("KVTIER_TEST_REDIS_PASSWORD");
    nodes_ = {seed_};
    if (GetParam().cluster) {
      Conn c(seed_, "", "");
      ASSERT_TRUE(c.ok());
      auto r = c.cmd({"CLUSTER", "SLOTS"});
      ASSERT_FALSE(r->error());
      std::set<std::string> nodes;
      for (std::size_t i = 0; i < r->r->elements; ++i) {
        const redisReply* m = r->r->element[i]->element[2];
        nodes.insert(fmt::format("{}:{}", std::string(m->element[0]->str, m->element[0]->len), m->element[1]->integer));
      }
      nodes_.assign(nodes.begin(), nodes.end());
    }
    // The ACL users, on every node (Redis keeps ACLs per node).
    for (const auto& n : nodes_) {
      Conn admin(n, "", admin_password_);
      ASSERT_TRUE(admin.ok()) << n << " " << admin.auth_error();
      for (const auto& [user, tenant] : {std::pair{kUserA, "ta"}, std::pair{kUserB, "tb"}}) {
        std::vector<std::string> args{
            "ACL", "SETUSER", user, "reset", "on", ">" + password_of(user), fmt::format("~{}:{}:*", kPrefix, tenant)};
        for (const auto& t : acl_rule_tail()) args.push_back(t);
        auto r = admin.cmd(args);
        ASSERT_FALSE(r->error()) << r->str();
      }
    }
    ns_ = fmt::format("iso-{:x}", testing::random_salt());
    a_ = tenant_options(ns_, "ta", secret_of('A'));
    b_ = tenant_options(ns_, "tb", secret_of('B'));
    backend_a_ = open(a_, kUserA);
    backend_b_ = open(b_, kUserB);
    ASSERT_TRUE(backend_a_ && backend_b_);
  }

  static std::string password_of(const std::string& user) { return "pw-" + user; }

  std::unique_ptr<StorageBackend> open(const StorageOptions& o, const std::string& user) {
    RedisBackendConfig c;
    c.endpoints = {seed_};
    c.username = user;
    c.password = password_of(user);
    c.mode = GetParam().cluster ? RedisMode::kCluster : RedisMode::kSingle;
    c.key_prefix = kPrefix;
    c.ttl_seconds = 600;  // leftovers of failed runs expire
    c.item_deadline = std::chrono::milliseconds(5000);
    auto b = create_redis_backend(c, o);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    return b.ok() ? std::move(b).value() : nullptr;
  }

  // The node serving `key` (MOVED followed), for raw commands.
  std::string node_of(const std::string& key) {
    if (!GetParam().cluster) return seed_;
    Conn c(seed_, "", admin_password_);
    auto r = c.cmd({"CLUSTER", "KEYSLOT", key});
    const auto slot = r->r ? r->r->integer : -1;
    auto slots = c.cmd({"CLUSTER", "SLOTS"});
    for (std::size_t i = 0; i < slots->r->elements; ++i) {
      const redisReply* e = slots->r->element[i];
      if (slot >= e->element[0]->integer && slot <= e->element[1]->integer)
        return fmt::format("{}:{}", std::string(e->element[2]->element[0]->str, e->element[2]->element[0]->len),
                           e->element[2]->element[1]->integer);
    }
    return seed_;
  }
  std::unique_ptr<Reply> raw(const std::string& user, const std::vector<std::string>& args, std::size_t key_arg = 1) {
    const std::string node = args.size() > key_arg ? node_of(args[key_arg]) : seed_;
    Conn c(node, user, user.empty() ? admin_password_ : password_of(user));
    EXPECT_TRUE(c.ok()) << c.auth_error();
    return c.cmd(args);
  }
  // Every key of `pattern` on every node (admin).
  std::vector<std::string> scan_all(const std::string& pattern) {
    std::vector<std::string> keys;
    for (const auto& n : nodes_) {
      Conn c(n, "", admin_password_);
      std::string cursor = "0";
      do {
        auto r = c.cmd({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
        if (r->error()) break;
        cursor = std::string(r->r->element[0]->str, r->r->element[0]->len);
        for (std::size_t i = 0; i < r->r->element[1]->elements; ++i)
          keys.emplace_back(r->r->element[1]->element[i]->str, r->r->element[1]->element[i]->len);
      } while (cursor != "0");
    }
    return keys;
  }
  std::string key_a(const StorageKey& k) const {
    return fmt::format("{}:ta:{}", kPrefix, format::keyed_object_name(a_, k));
  }
  std::string key_b(const StorageKey& k) const {
    return fmt::format("{}:tb:{}", kPrefix, format::keyed_object_name(b_, k));
  }

  static constexpr const char* kUserA = "kvtier-tenant-a";
  static constexpr const char* kUserB = "kvtier-tenant-b";
  std::string seed_, admin_password_, ns_;
  std::vector<std::string> nodes_;
  StorageOptions a_, b_;
  std::unique_ptr<StorageBackend> backend_a_, backend_b_;
};

TEST_P(RedisTenants, ThroughTheLibrary) {
  const StorageKey k = key_of(testing::random_salt(), 1);
  const auto va = bytes_of(50, 3000), vb = bytes_of(51, 3000);
  ASSERT_TRUE(put(*backend_a_, k, va).ok());
  EXPECT_EQ(get(*backend_b_, k).first.code(), StatusCode::kNotFound);
  ASSERT_TRUE(put(*backend_b_, k, vb).ok());
  auto [sa, da] = get(*backend_a_, k);
  ASSERT_TRUE(sa.ok()) << sa.to_string();
  EXPECT_EQ(da, va);
  EXPECT_EQ(get(*backend_b_, k).second, vb);
  // B configured as tenant A (A's prefix) with its own ACL user: every command is refused.
  StorageOptions b_as_a = a_;
  b_as_a.tenant_secret = b_.tenant_secret;
  auto imposter = open(b_as_a, kUserB);
  ASSERT_TRUE(imposter);
  auto [si, di] = get(*imposter, k);
  EXPECT_FALSE(si.ok());
  EXPECT_NE(si.code(), StatusCode::kNotFound);  // an error (NOPERM), not a quiet miss
  EXPECT_NE(di, va);
  EXPECT_FALSE(put(*imposter, k, vb).ok());
  EXPECT_EQ(get(*backend_a_, k).second, va);
  // Tenant A without its secret (or with B's, through A's own ACL user): keys differ, nothing read.
  StorageOptions a_unkeyed = a_;
  a_unkeyed.tenant_secret.clear();
  auto plain = open(a_unkeyed, kUserA);
  ASSERT_TRUE(plain);
  EXPECT_EQ(get(*plain, k).first.code(), StatusCode::kNotFound);
  StorageOptions a_wrong = a_;
  a_wrong.tenant_secret = secret_of('W');
  auto wrong = open(a_wrong, kUserA);
  ASSERT_TRUE(wrong);
  EXPECT_EQ(get(*wrong, k).first.code(), StatusCode::kNotFound);
  EXPECT_EQ(get(*backend_a_, k).second, va);
}

TEST_P(RedisTenants, KeyNamesRevealNothing) {
  const StorageKey k = key_of(testing::random_salt(), 2);
  ASSERT_TRUE(put(*backend_a_, k, bytes_of(52, 3000)).ok());
  const std::string name = key_a(k);
  std::vector<std::string> keys = scan_all(fmt::format("{}:ta:*", kPrefix));
  ASSERT_NE(std::find(keys.begin(), keys.end(), name), keys.end()) << name;
  const std::string digest_hex = k.to_string().substr(0, 32);
  const std::string ns_hex = fmt::format("{:016x}", format::namespace_digest(a_));
  for (const auto& key : keys) {
    EXPECT_EQ(key.find(digest_hex.substr(0, 12)), std::string::npos) << key;
    EXPECT_EQ(key.find(ns_hex), std::string::npos) << key;
    EXPECT_EQ(key.find(ns_), std::string::npos) << key;
  }
}

TEST_P(RedisTenants, AroundTheLibrary) {
  const std::uint64_t salt = testing::random_salt();
  const StorageKey k1 = key_of(salt, 1), k2 = key_of(salt, 2), k3 = key_of(salt, 3), k4 = key_of(salt, 4);
  const auto va = bytes_of(60, 3000), vb = bytes_of(61, 3000);
  for (const auto& k : {k1, k2, k3}) ASSERT_TRUE(put(*backend_a_, k, va).ok());
  for (const auto& k : {k1, k4}) ASSERT_TRUE(put(*backend_b_, k, vb).ok());
  // B's ACL user against A's keys: NOPERM for every command, listing included; on its own keys for
  // every command the backend does not send (GET: gets use GETRANGE).
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"GET", key_a(k1)},
                                             {"GETRANGE", key_a(k1), "0", "10"},
                                             {"SET", key_a(k1), "x"},
                                             {"SET", key_a(k4), "x"},
                                             {"DEL", key_a(k2)},
                                             {"EVAL", "return redis.call('DEL', KEYS[1])", "1", key_a(k2)},
                                             {"STRLEN", key_a(k1)},
                                             {"GET", key_b(k1)},
                                             {"SETRANGE", key_b(k1), "0", "x"}}) {
    auto r = raw(kUserB, args);
    ASSERT_TRUE(r->error()) << args[0] << " " << args[1];
    EXPECT_TRUE(r->str().starts_with("NOPERM")) << args[0] << ": " << r->str();
  }
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"SCAN", "0"}, {"KEYS", "*"}, {"FLUSHALL"}, {"ACL", "LIST"}, {"CONFIG", "GET", "*"}}) {
    auto r = raw(kUserB, args, 99);
    ASSERT_TRUE(r->error()) << args[0];
    EXPECT_TRUE(r->str().starts_with("NOPERM")) << args[0] << ": " << r->str();
  }
  // B's own key works for B's user (the ACL is not simply closed).
  auto own = raw(kUserB, {"STRLEN", key_b(k1)});
  ASSERT_FALSE(own->error()) << own->str();
  EXPECT_GT(own->r->integer, 3000);
  // An admin copies B's value of the same block key over A's (same namespace, B's secret).
  auto bv = raw("", {"GET", key_b(k1)});
  ASSERT_FALSE(bv->error());
  ASSERT_FALSE(raw("", {"SET", key_a(k1), bv->str(), "EX", "600"})->error());
  const std::uint64_t before = backend_a_->stats().auth_failures;
  {
    auto [s, d] = get(*backend_a_, k1);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
    EXPECT_NE(d, vb);
  }
  EXPECT_EQ(backend_a_->stats().auth_failures, before + 1);
  EXPECT_EQ(get(*backend_a_, k1).first.code(), StatusCode::kNotFound);  // quarantined (deleted): a miss
  // A forged unkeyed object with A's identity over k2, and a pre-seeded one for a block A has not
  // stored yet, keyed under a guessed secret.
  StorageOptions forger = a_;
  forger.tenant_secret.clear();
  ASSERT_FALSE(raw("", {"SET", key_a(k2), make_object(forger, k2, vb, 8), "EX", "600"})->error());
  forger.tenant_secret = secret_of('G');
  const StorageKey k5 = key_of(salt, 5);
  ASSERT_FALSE(raw("", {"SET", key_a(k5), make_object(forger, k5, vb, 8), "EX", "600"})->error());
  EXPECT_EQ(get(*backend_a_, k2).first.code(), StatusCode::kDataLoss);
  EXPECT_EQ(get(*backend_a_, k5).first.code(), StatusCode::kDataLoss);
  EXPECT_EQ(backend_a_->stats().auth_failures, before + 3);
  // The victim's untouched object is still served, and B's objects are B's.
  auto [s3, d3] = get(*backend_a_, k3);
  ASSERT_TRUE(s3.ok()) << s3.to_string();
  EXPECT_EQ(d3, va);
  for (const auto& k : {k1, k4}) EXPECT_EQ(get(*backend_b_, k).second, vb);
  for (const auto& k : {k1, k2, k3, k4, k5}) {
    raw("", {"DEL", key_a(k)});
    raw("", {"DEL", key_b(k)});
  }
}

// The documented recipe: a spec string with the ACL user in the URL and the tenant's secret file.
TEST_P(RedisTenants, SpecWithAclUserAndSecretFile) {
  TempDir dir;
  std::string hex;
  for (char c : a_.tenant_secret) hex += fmt::format("{:02x}", static_cast<unsigned char>(c));
  write_file(dir.path() + "/ta.secret", hex + "\n", 0600);
  const StorageKey k = key_of(testing::random_salt(), 7);
  const auto va = bytes_of(70, 3000);
  ASSERT_TRUE(put(*backend_a_, k, va).ok());
  StorageOptions o = a_;
  o.tenant.clear();
  o.tenant_secret.clear();
  auto spec = [&](const std::string& user) {
    return fmt::format("redis://{}:{}@{}?cluster={}&prefix={}&tenant=ta&secret_file={}/ta.secret", user,
                       password_of(user), seed_, GetParam().cluster ? "on" : "off", kPrefix, dir.path());
  };
  auto b = make_storage_backend(spec(kUserA), o);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  auto [s, d] = get(**b, k);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(d, va);
  // The same spec with tenant B's user: refused by the server, never A's bytes.
  auto imposter = make_storage_backend(spec(kUserB), o);
  ASSERT_TRUE(imposter.ok()) << imposter.status().to_string();
  auto [si, di] = get(**imposter, k);
  EXPECT_FALSE(si.ok());
  EXPECT_NE(si.code(), StatusCode::kNotFound) << si.to_string();
  EXPECT_NE(di, va);
}

INSTANTIATE_TEST_SUITE_P(Servers, RedisTenants,
                         ::testing::Values(RedisCase{"single", false}, RedisCase{"cluster", true}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kvtier::storage
