// Hostile and unlucky input to the disk tier: objects crafted with a valid header checksum but
// impossible sizes, files that are not regular files under an object's name. Each must end as a
// quarantined object and a miss, never as an abort, a wedged I/O thread or bytes served.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <array>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/storage/disk_backend.h"
#include "storage/object_format.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::key_of;
using testing::TempDir;

constexpr std::size_t kOffFlags = 10, kOffHeaderSize = 12, kOffNumRoles = 52, kOffPayload = 56, kOffHeaderChecksum = 64,
                      kOffChecksum = 72;

template <typename T>
void put_le(std::byte* p, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
template <typename T>
T get_le(const std::byte* p) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

// Recomputes the unkeyed header checksum (object_format.h), as an attacker who knows the format would.
void reseal(std::byte* hdr, std::size_t len) {
  const std::size_t hs = std::min<std::size_t>(get_le<std::uint32_t>(hdr + kOffHeaderSize), len);
  if (hs < format::kFixedHeaderBytes) return;
  std::vector<std::byte> copy(hdr, hdr + hs);
  std::memset(copy.data() + kOffHeaderChecksum, 0, 8);
  put_le<std::uint64_t>(hdr + kOffHeaderChecksum, XXH3_64bits(copy.data(), hs));
}

std::string read_file(const std::string& path) {
  std::string s;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return s;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

void write_file(const std::string& path, const std::string& s) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(s.data(), 1, s.size(), f), s.size());
  std::fclose(f);
}

class DiskHardening : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.root = dir_.path();
    config_.durability = Durability::kProcessCrash;
    options_.ns = "hardening";
    ns_dir_ = fmt::format("{}/{:016x}-{:016x}", dir_.path(), format::namespace_digest(options_.ns), 0);
  }
  std::string object_path(const StorageKey& k) const {
    return fmt::format("{}/{:02x}/{}.kvo", ns_dir_, k.digest[0], k.to_string());
  }
  // Stores `n` objects of 8 KiB with keys key_of(salt, i) and closes the backend.
  void store(int n, std::uint64_t salt = 7) {
    auto b = create_disk_backend(config_, options_);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    AlignedBuffer v(8192);
    for (int i = 0; i < n; ++i) {
      fill_random(v.data(), v.size(), salt + i);
      auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(salt, i), v.data(), v.size()}}});
      ASSERT_TRUE(r.ok() && (*r)[0].status.ok());
    }
  }
  // Rewrites the header of the stored object of `k` through `edit`, then reseals its checksum.
  template <typename F>
  void craft(const StorageKey& k, F edit) {
    std::string s = read_file(object_path(k));
    ASSERT_GE(s.size(), 4096u);
    auto* h = reinterpret_cast<std::byte*>(s.data());
    edit(h);
    reseal(h, s.size());
    write_file(object_path(k), s);
  }
  Status get(StorageBackend& b, const StorageKey& k, AlignedBuffer& dst) {
    auto r = run_batch(b, StorageBatch{StorageOp::kGet, {{k, dst.data(), dst.size()}}}, std::chrono::seconds(10));
    if (!r.ok()) return r.status();
    return (*r)[0].status;
  }

  TempDir dir_;
  DiskBackendConfig config_;
  StorageOptions options_;
  std::string ns_dir_;
};

// Payload sizes that no file can hold, that wrap header + payload, or that exceed the format's
// limit: every one is quarantined at the index rebuild, with and without payload verification.
TEST_F(DiskHardening, ImpossibleSizesAreQuarantinedAtRebuild) {
  const std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  // kMax and kMax - 4000: header + payload wraps to less than the file size.
  const std::vector<std::uint64_t> payloads = {kMax, kMax - 4000, std::uint64_t{1} << 41, 8192 + 1};
  for (bool verify : {true, false}) {
    SCOPED_TRACE(verify ? "verify_payload_on_open" : "defaults");
    TempDir::remove_tree(ns_dir_);
    config_.verify_payload_on_open = verify;
    store(static_cast<int>(payloads.size()) + 1);
    for (std::size_t i = 0; i < payloads.size(); ++i)
      craft(key_of(7, i), [&](std::byte* h) { put_le<std::uint64_t>(h + kOffPayload, payloads[i]); });
    auto b = create_disk_backend(config_, options_);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    const StorageStats st = (*b)->stats();
    EXPECT_EQ(st.objects, 1u);
    EXPECT_EQ(st.quarantined, payloads.size());
    // The healthy object and the quarantined files (at most max_quarantine_files of them).
    EXPECT_EQ(st.bytes, (4096u + 8192u) * (1 + std::min<std::uint64_t>(payloads.size(), config_.max_quarantine_files)));
    AlignedBuffer dst(8192);
    for (std::size_t i = 0; i < payloads.size(); ++i) {
      auto e = run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(7, i), nullptr, 0}}});
      ASSERT_TRUE(e.ok());
      EXPECT_EQ((*e)[0].status.code(), StatusCode::kNotFound) << "payload " << payloads[i];
      EXPECT_EQ(get(**b, key_of(7, i), dst).code(), StatusCode::kNotFound) << "payload " << payloads[i];
    }
    AlignedBuffer want(8192);
    fill_random(want.data(), want.size(), 7 + payloads.size());
    ASSERT_TRUE(get(**b, key_of(7, payloads.size()), dst).ok());
    EXPECT_EQ(std::memcmp(dst.data(), want.data(), 8192), 0);
  }
}

// Header sizes and role tables out of bounds: larger than the file, past the format's limit, a
// role whose end wraps.
TEST_F(DiskHardening, ImpossibleHeaderFieldsAreQuarantinedAtRebuild) {
  config_.verify_payload_on_open = true;
  store(4);
  craft(key_of(7, 0), [](std::byte* h) { put_le<std::uint32_t>(h + kOffHeaderSize, 0xfffffff8u); });
  craft(key_of(7, 1), [](std::byte* h) {
    // A role table of 100 entries in a 4096-byte header, the last one wrapping.
    put_le<std::uint32_t>(h + kOffNumRoles, 100);
    std::byte* e = h + format::kFixedHeaderBytes + 99 * format::kRoleEntryBytes;
    put_le<std::uint64_t>(e + 8, std::numeric_limits<std::uint64_t>::max());
    put_le<std::uint64_t>(e + 16, 2);
  });
  craft(key_of(7, 2), [](std::byte* h) { put_le<std::uint32_t>(h + kOffHeaderSize, 12 * 4096); });
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->stats().objects, 1u);
  EXPECT_EQ((*b)->stats().quarantined, 3u);
  AlignedBuffer dst(8192);
  EXPECT_TRUE(get(**b, key_of(7, 3), dst).ok());
}

// Unblocks a reader stuck in open() on a FIFO (the old behaviour), so a failing test ends.
void release_fifo(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) ::close(fd);
}

// A FIFO, a symlink and a directory under object names: the index rebuild quarantines them
// without blocking and keeps the healthy objects.
TEST_F(DiskHardening, NonRegularFilesAreQuarantinedAtRebuild) {
  store(4);
  const std::string fifo = object_path(key_of(7, 0));
  ASSERT_EQ(::unlink(fifo.c_str()), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string link = object_path(key_of(7, 1));
  ASSERT_EQ(::unlink(link.c_str()), 0);
  ASSERT_EQ(::symlink(object_path(key_of(7, 3)).c_str(), link.c_str()), 0);
  const std::string dir = object_path(key_of(7, 2));
  ASSERT_EQ(::unlink(dir.c_str()), 0);
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  auto fut = std::async(std::launch::async, [&] { return create_disk_backend(config_, options_); });
  const bool blocked = fut.wait_for(std::chrono::seconds(5)) != std::future_status::ready;
  if (blocked) release_fifo(fifo);
  ASSERT_FALSE(blocked) << "the index rebuild blocked on a FIFO";
  auto b = fut.get();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->stats().objects, 1u);
  EXPECT_EQ((*b)->stats().quarantined, 3u);
  AlignedBuffer dst(8192);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(get(**b, key_of(7, i), dst).code(), StatusCode::kNotFound) << i;
  ASSERT_TRUE(get(**b, key_of(7, 3), dst).ok());
}

// At run time: an indexed object replaced by a FIFO (or a symlink) under the backend's feet must
// not block the I/O thread; a get of it is a miss, gets of healthy keys go on.
TEST_F(DiskHardening, FifoAtRunTimeDoesNotBlockOtherGets) {
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok());
  AlignedBuffer v(8192), want(8192), dst(8192);
  for (int i = 0; i < 3; ++i) {
    fill_random(v.data(), v.size(), 100 + i);
    ASSERT_TRUE((*run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(8, i), v.data(), v.size()}}}))[0].status.ok());
  }
  const std::string fifo = object_path(key_of(8, 0));
  ASSERT_EQ(::unlink(fifo.c_str()), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string link = object_path(key_of(8, 1));
  ASSERT_EQ(::unlink(link.c_str()), 0);
  ASSERT_EQ(::symlink(object_path(key_of(8, 2)).c_str(), link.c_str()), 0);
  auto bad = (*b)->post(StorageBatch{StorageOp::kGet, {{key_of(8, 0), dst.data(), dst.size()}}});
  ASSERT_TRUE(bad.ok());
  AlignedBuffer dst2(8192);
  auto good = (*b)->post(StorageBatch{StorageOp::kGet, {{key_of(8, 2), dst2.data(), dst2.size()}}});
  ASSERT_TRUE(good.ok());
  const Status waited = good->wait(std::chrono::seconds(3));
  if (!waited.ok()) release_fifo(fifo);
  ASSERT_TRUE(waited.ok()) << "a get of a healthy key waited behind a FIFO";
  ASSERT_TRUE(good->item(0).status.ok()) << good->item(0).status.to_string();
  fill_random(want.data(), want.size(), 102);
  EXPECT_EQ(std::memcmp(dst2.data(), want.data(), 8192), 0);
  ASSERT_TRUE(bad->wait(std::chrono::seconds(3)).ok());
  EXPECT_EQ(bad->item(0).status.code(), StatusCode::kDataLoss) << bad->item(0).status.to_string();
  AlignedBuffer dst3(8192);
  EXPECT_EQ(get(**b, key_of(8, 1), dst3).code(), StatusCode::kDataLoss);  // the symlink: not followed
  EXPECT_EQ((*b)->stats().quarantined, 2u);
  EXPECT_EQ(get(**b, key_of(8, 0), dst).code(), StatusCode::kNotFound);
  // A put over the quarantined name works again.
  fill_random(v.data(), v.size(), 100);
  ASSERT_TRUE((*run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(8, 0), v.data(), v.size()}}}))[0].status.ok());
  ASSERT_TRUE(get(**b, key_of(8, 0), dst).ok());
  EXPECT_EQ(std::memcmp(dst.data(), v.data(), 8192), 0);
}

// Fields this format version fixes to zero (flags, each role's reserved word, the header's
// padding): an object that sets them was not written by this version and is not trusted.
TEST_F(DiskHardening, NonZeroFlagsAndReservedBytesAreQuarantined) {
  store(3);
  craft(key_of(7, 0), [](std::byte* h) { put_le<std::uint16_t>(h + kOffFlags, 1); });
  craft(key_of(7, 1), [](std::byte* h) { h[2000] = std::byte{0x5a}; });
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->stats().objects, 1u);
  EXPECT_EQ((*b)->stats().quarantined, 2u);

  StorageOptions o;
  o.roles.push_back({0, 0, 0, 0, 64});
  const std::uint32_t hs = format::header_bytes(o, 64);
  std::vector<std::byte> hdr(hs), payload(64);
  ASSERT_TRUE(format::encode_header(o, 1, key_of(1, 1), payload.data(), 64, hs, hdr.data()).ok());
  ASSERT_TRUE(format::decode_header(hdr.data(), hs).ok());
  hdr[format::kFixedHeaderBytes + 5] = std::byte{1};  // the role entry's reserved u32
  reseal(hdr.data(), hs);
  EXPECT_EQ(format::decode_header(hdr.data(), hs).status().code(), StatusCode::kDataLoss);
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

// quarantine/ keeps at most max_quarantine_files (oldest removed first), and its files count in
// capacity_bytes: they are dropped before any healthy object is evicted.
TEST_F(DiskHardening, QuarantineIsBoundedAndCountedInCapacity) {
  constexpr std::uint64_t kUnit = 4096 + 8192;
  config_.capacity_bytes = 6 * kUnit;
  config_.max_quarantine_files = 2;
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok());
  AlignedBuffer v(8192), dst(8192);
  auto put = [&](int i) {
    fill_random(v.data(), v.size(), 300 + i);
    auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(9, i), v.data(), v.size()}}});
    ASSERT_TRUE(r.ok() && (*r)[0].status.ok());
  };
  for (int i = 0; i < 6; ++i) put(i);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE((*b)->corrupt_stored_object(key_of(9, i), 4096 + 10, 0x01).ok());
    EXPECT_EQ(get(**b, key_of(9, i), dst).code(), StatusCode::kDataLoss);
  }
  const std::string qdir = ns_dir_ + "/quarantine";
  EXPECT_EQ(list_dir(qdir).size(), 2u);
  EXPECT_EQ((*b)->stats().quarantined, 4u);
  EXPECT_EQ((*b)->stats().bytes, 4 * kUnit);  // 2 objects + 2 quarantined files
  put(6);
  put(7);  // 6 units: full
  EXPECT_EQ((*b)->stats().evictions, 0u);
  put(8);  // the oldest quarantined file goes, no object
  EXPECT_EQ((*b)->stats().evictions, 0u);
  EXPECT_EQ(list_dir(qdir).size(), 1u);
  put(9);
  EXPECT_EQ(list_dir(qdir).size(), 0u);
  EXPECT_EQ((*b)->stats().evictions, 0u);
  EXPECT_EQ((*b)->stats().objects, 6u);
  put(10);  // now an object
  EXPECT_EQ((*b)->stats().evictions, 1u);
  EXPECT_LE((*b)->stats().bytes, config_.capacity_bytes);
  b->reset();
  // Left over from earlier runs: bounded and counted at the rebuild too.
  for (int i = 0; i < 5; ++i) write_file(fmt::format("{}/old.{}", qdir, i), std::string(kUnit, 'x'));
  config_.capacity_bytes = 0;
  b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(list_dir(qdir).size(), 2u);
  EXPECT_EQ((*b)->stats().bytes, 8 * kUnit);
}

mode_t mode_of(const std::string& path) {
  struct stat sb {};
  return ::lstat(path.c_str(), &sb) == 0 ? (sb.st_mode & 07777) : 07777;
}

// Files 0600 and directories 0700 by default: other local users can neither read a tenant's
// blocks nor plant files in its directories. Configurable for a shared group.
TEST_F(DiskHardening, FilesAndDirectoriesAreOwnerOnlyByDefault) {
  const mode_t old_umask = ::umask(022);
  config_.root = dir_.path() + "/root";
  ns_dir_ = fmt::format("{}/{:016x}-{:016x}", config_.root, format::namespace_digest(options_.ns), 0);
  store(1);
  const StorageKey k = key_of(7, 0);
  EXPECT_EQ(mode_of(object_path(k)), 0600u);
  EXPECT_EQ(mode_of(ns_dir_ + "/LOCK"), 0600u);
  for (const std::string& d : {config_.root, ns_dir_, ns_dir_ + "/quarantine", ns_dir_ + "/incoming", ns_dir_ + "/free",
                               fmt::format("{}/{:02x}", ns_dir_, k.digest[0])})
    EXPECT_EQ(mode_of(d), 0700u) << d;
  config_.root = dir_.path() + "/group";
  ns_dir_ = fmt::format("{}/{:016x}-{:016x}", config_.root, format::namespace_digest(options_.ns), 0);
  config_.file_mode = 0640;
  config_.dir_mode = 0750;
  store(1);
  EXPECT_EQ(mode_of(object_path(k)), 0640u);
  EXPECT_EQ(mode_of(ns_dir_), 0750u);
  config_.file_mode = 01777;
  EXPECT_EQ(create_disk_backend(config_, options_).status().code(), StatusCode::kInvalidArgument);
  // Modes that leave the owner unable to read back what it stored, or to reopen LOCK, are refused up front
  // (they were accepted: puts acknowledged, every get and the next open failing with EACCES for a non-root user).
  for (std::uint32_t bad : {0400u, 0200u, 0000u, 0644u & 0244u}) {
    config_.file_mode = bad;
    const Status s = create_disk_backend(config_, options_).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << fmt::format("{:o}", bad);
    EXPECT_NE(s.message().find("storage.disk.file_mode"), std::string::npos) << s.to_string();
  }
  config_.file_mode = 0600;
  config_.dir_mode = 0500;
  const Status dir = create_disk_backend(config_, options_).status();
  EXPECT_EQ(dir.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.message().find("storage.disk.dir_mode"), std::string::npos) << dir.to_string();
  ::umask(old_umask);
}

// An object file longer than any put writes (header + payload, aligned up) is quarantined at the rebuild, not
// indexed at its length: one file extended to 2 MiB under a 1 MiB capacity made the rebuild evict every object.
TEST_F(DiskHardening, AFileLongerThanItsObjectIsQuarantinedNotCharged) {
  store(20);
  ASSERT_EQ(::truncate(object_path(key_of(7, 3)).c_str(), 2 << 20), 0);
  config_.capacity_bytes = 1 << 20;
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const StorageStats st = (*b)->stats();
  EXPECT_EQ(st.objects, 19u);
  EXPECT_EQ(st.quarantined, 1u);
  AlignedBuffer dst(8192);
  for (int i = 0; i < 20; ++i) {
    const Status s = get(**b, key_of(7, i), dst);
    if (i == 3)
      EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
    else
      EXPECT_TRUE(s.ok()) << i << ": " << s.to_string();
  }
}

// A root path that cannot work until the operator changes it is FailedPrecondition naming the path (it was
// Unavailable, which a caller retries): a file, a path under a file, a link to nothing, a name too long.
TEST_F(DiskHardening, RootPathsThatNoRetryCanFixAreFailedPrecondition) {
  const std::string file = dir_.path() + "/a-file";
  ASSERT_EQ(::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600)), 0);
  const std::string dangling = dir_.path() + "/dangling";
  ASSERT_EQ(::symlink((dir_.path() + "/nowhere/else").c_str(), dangling.c_str()), 0);
  const std::string too_long = dir_.path() + "/" + std::string(300, 'x');
  for (const std::string& root : {file, file + "/below", dangling, too_long}) {
    config_.root = root;
    const Status s = create_disk_backend(config_, options_).status();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << root << ": " << s.to_string();
    EXPECT_NE(s.message().find(root.substr(0, 40)), std::string::npos) << s.to_string();
  }
  config_.root = dangling;
  EXPECT_NE(create_disk_backend(config_, options_).status().message().find("symbolic link"), std::string::npos);
}

// Sizes whose sum with the header wraps below the stored length: the parser rejects them before
// any check that adds them (the disk's "file at least header + payload", the Redis value length).
TEST(ObjectFormatBounds, SizesThatWrapAreDataLoss) {
  StorageOptions o;
  const std::uint32_t hs = format::header_bytes(o, 8);
  std::vector<std::byte> value(hs + 100);
  ASSERT_TRUE(format::encode_header(o, 1, key_of(1, 1), value.data() + hs, 100, hs, value.data()).ok());
  ASSERT_TRUE(format::decode_header(value.data(), value.size()).ok());
  const std::uint64_t wrapping = std::numeric_limits<std::uint64_t>::max() - hs + 50;  // hs + it == 49
  put_le<std::uint64_t>(value.data() + kOffPayload, wrapping);
  reseal(value.data(), value.size());
  EXPECT_EQ(format::decode_header(value.data(), value.size()).status().code(), StatusCode::kDataLoss);
  format::ObjectHeader h;
  h.header_size = hs;
  h.payload_bytes = wrapping;
  EXPECT_EQ(format::check_object_size(h, value.size(), true).code(), StatusCode::kDataLoss);
  EXPECT_EQ(format::check_object_size(h, value.size(), false).code(), StatusCode::kDataLoss);
  h.payload_bytes = 100;
  EXPECT_TRUE(format::check_object_size(h, value.size(), true).ok());
  EXPECT_EQ(format::check_object_size(h, value.size() + 1, true).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(format::check_object_size(h, value.size() + 1, false).ok());
  EXPECT_EQ(format::check_object_size(h, value.size() - 1, false).code(), StatusCode::kDataLoss);
}

// A put whose size would wrap the disk's alignment arithmetic is refused at post().
TEST_F(DiskHardening, HugePutIsRefused) {
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok());
  AlignedBuffer v(4096);
  for (std::uint64_t bytes : {std::numeric_limits<std::uint64_t>::max(), std::uint64_t{0} - 4096}) {
    auto t = (*b)->post(StorageBatch{StorageOp::kPut, {{key_of(3, 1), v.data(), bytes}}});
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << bytes;
  }
  EXPECT_EQ((*b)->stats().objects, 0u);
}

// The memory backend added the header to the payload size unchecked: a payload near 2^64 wrapped the object's size
// to a few bytes, which passed the capacity check, and the header (or, with a tenant secret, the whole payload) was
// written far past a 72-byte allocation. Refused now, naming the size; nothing is stored.
TEST(MemoryHardening, APayloadSizeNear2To64IsRefusedNotWrapped) {
  for (const std::string& secret : {std::string(), std::string(32, 't')}) {
    StorageOptions o;
    o.tenant = secret.empty() ? "" : "t";
    o.tenant_secret = secret;
    auto b = make_storage_backend("memory:?capacity=1M", o);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    std::array<std::byte, 16> v{};
    for (std::uint64_t bytes : {std::numeric_limits<std::uint64_t>::max() - 7, std::uint64_t{1} << 63}) {
      auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(5, 1), v.data(), bytes}}});
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ((*r)[0].status.code(), StatusCode::kResourceExhausted) << (*r)[0].status.to_string();
      EXPECT_NE((*r)[0].status.message().find(std::to_string(bytes)), std::string::npos) << (*r)[0].status.to_string();
    }
    auto e = run_batch(**b, StorageBatch{StorageOp::kExists, {{key_of(5, 1), nullptr, 0}}});
    ASSERT_TRUE(e.ok());
    EXPECT_EQ((*e)[0].status.code(), StatusCode::kNotFound);
  }
}

// Free files are named "<pid>.<n>" with n counted from 1 by each backend instance, and a rebuild adopts those
// already there. A later instance with the same pid (a tier reopened in one process, a container restarted as pid
// 1) recycled a deleted object onto a name in use, replacing that file: the name was listed twice, two puts took
// the one inode, and an acknowledged put came back as DataLoss (or another put's bytes). Each name is used once.
TEST_F(DiskHardening, AFreeFileNameIsNeverHandedOutTwice) {
  config_.direct_io = DirectIo::kOff;
  AlignedBuffer v(64 << 10);
  {
    auto b0 = create_disk_backend(config_, options_);
    ASSERT_TRUE(b0.ok()) << b0.status().to_string();
    for (int i = 1; i <= 2; ++i) {
      fill_random(v.data(), v.size(), 100 + i);
      auto r = run_batch(**b0, StorageBatch{StorageOp::kPut, {{key_of(11, i), v.data(), v.size()}}});
      ASSERT_TRUE(r.ok() && (*r)[0].status.ok());
    }
  }
  auto remove = [&](StorageBackend& backend, const StorageKey& k) {
    auto r = run_batch(backend, StorageBatch{StorageOp::kDelete, {{k, nullptr, 0}}});
    ASSERT_TRUE(r.ok() && (*r)[0].status.ok()) << (r.ok() ? (*r)[0].status.to_string() : r.status().to_string());
  };
  {
    auto b1 = create_disk_backend(config_, options_);  // its delete names the free file "<pid>.1"
    ASSERT_TRUE(b1.ok()) << b1.status().to_string();
    remove(**b1, key_of(11, 1));
  }
  // The next instance adopts "<pid>.1" and names its own first free file the same.
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  remove(**b, key_of(11, 2));
  AlignedBuffer a(64 << 10), d(64 << 10);
  fill_random(a.data(), a.size(), 201);
  fill_random(d.data(), d.size(), 202);
  auto r = run_batch(
      **b, StorageBatch{StorageOp::kPut, {{key_of(12, 1), a.data(), a.size()}, {key_of(12, 2), d.data(), d.size()}}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status.to_string();
  EXPECT_TRUE((*r)[1].status.ok()) << (*r)[1].status.to_string();
  for (const auto& [k, want] : {std::pair{key_of(12, 1), &a}, std::pair{key_of(12, 2), &d}}) {
    AlignedBuffer got(64 << 10);
    Status st = get(**b, k, got);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(std::memcmp(got.data(), want->data(), got.size()), 0);
  }
}

// A directory outside the store, full of files a planted link could hand the backend. Every file's
// name and bytes are recorded, so a test can assert that not one was deleted, changed or moved.
class OutsideFiles {
 public:
  explicit OutsideFiles(int n) {
    for (int i = 0; i < n; ++i) {
      // Names an object, a temporary file and a free file could have: a store that follows a
      // link into this directory would treat each as its own.
      const std::string name = i % 3 == 0   ? fmt::format("{}.kvo", key_of(99, i).to_string())
                               : i % 3 == 1 ? fmt::format("{}.kvo.tmp.1.{}", key_of(99, i).to_string(), i)
                                            : fmt::format("victim-{}", i);
      const std::string bytes = fmt::format("the victim's file {} ({})", i, std::string(100 + i, 'v'));
      write_file(dir_.path() + "/" + name, bytes);
      files_.emplace_back(name, bytes);
    }
  }
  const std::string& path() const { return dir_.path(); }
  // Fails the test unless the directory holds exactly the files it was made with, byte for byte.
  void expect_untouched() const {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir_.path().c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
      ::closedir(d);
    }
    EXPECT_EQ(names.size(), files_.size()) << "entries added to or removed from " << dir_.path();
    int lost = 0;
    for (const auto& [name, bytes] : files_)
      if (read_file(dir_.path() + "/" + name) != bytes) ++lost;
    EXPECT_EQ(lost, 0) << lost << " of " << files_.size() << " outside files deleted or changed";
  }

 private:
  TempDir dir_;
  std::vector<std::pair<std::string, std::string>> files_;
};

// The traffic of create_and_use exercises the backend's files; whether a put or delete succeeds is not what
// its callers test, only what create returned.
void ignore_outcomes(const Result<std::vector<ItemResult>>& r) {
  if (!r.ok()) return;
  for (const ItemResult& item : *r) item.status.ignore_error();
}

// Opens the backend and, if that succeeded, puts objects through it (which would recycle free/
// files and create files in incoming/); returns the status of create.
Status create_and_use(const DiskBackendConfig& config, const StorageOptions& options) {
  auto b = create_disk_backend(config, options);
  if (!b.ok()) return b.status();
  AlignedBuffer v(8192);
  for (int i = 0; i < 8; ++i) {
    fill_random(v.data(), v.size(), i);
    ignore_outcomes(run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(5, i), v.data(), v.size()}}}));
  }
  for (int i = 0; i < 8; ++i)
    ignore_outcomes(run_batch(**b, StorageBatch{StorageOp::kDelete, {{key_of(5, i), nullptr, 0}}}));
  return Status::Ok();
}

// incoming/, quarantine/, free/ or a shard directory planted as a symlink to a directory of
// someone's files: create refuses, naming the link, and not one of those files is deleted (the
// rebuild used to empty incoming/ and trim quarantine/ through the link), overwritten or moved
// into the store (free/ files used to be recycled as object files).
TEST_F(DiskHardening, PlantedSubdirectoryLinksAreRefused) {
  store(2);  // a real store, with its subdirectories and shard directories
  // A shard directory that no object of this test uses.
  std::uint32_t shard = 0;
  auto used = [](std::uint32_t s) {
    for (int i = 0; i < 8; ++i)
      if (key_of(7, i).digest[0] == s || key_of(5, i).digest[0] == s) return true;
    return false;
  };
  while (used(shard)) ++shard;
  const std::string shard_name = fmt::format("{:02x}", shard);
  for (const std::string& sub : {std::string("incoming"), std::string("quarantine"), std::string("free"), shard_name}) {
    SCOPED_TRACE(sub);
    OutsideFiles outside(80);
    const std::string link = ns_dir_ + "/" + sub;
    TempDir::remove_tree(link);
    ASSERT_EQ(::symlink(outside.path().c_str(), link.c_str()), 0);
    const Status st = create_and_use(config_, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find(link), std::string::npos) << st.to_string();
    outside.expect_untouched();
    ASSERT_EQ(::unlink(link.c_str()), 0);
    if (sub != shard_name) {
      ASSERT_EQ(::mkdir(link.c_str(), 0700), 0);
    }
  }
  // With the links gone the store opens again and still serves what it held.
  auto b = create_disk_backend(config_, options_);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  AlignedBuffer dst(8192);
  EXPECT_TRUE(get(**b, key_of(7, 1), dst).ok());
}

// The namespace directory itself a link to an outside directory: the whole store would run
// there (subdirectories, LOCK, objects). Refused before anything is created through it.
TEST_F(DiskHardening, NamespaceDirectoryLinkIsRefused) {
  OutsideFiles outside(80);
  ASSERT_EQ(::symlink(outside.path().c_str(), ns_dir_.c_str()), 0);
  const Status st = create_and_use(config_, options_);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find(ns_dir_), std::string::npos) << st.to_string();
  outside.expect_untouched();
}

// The same under a tenant directory, and the tenant directory itself as a link.
TEST_F(DiskHardening, LinksBelowATenantDirectoryAreRefused) {
  options_.tenant = "t1";
  options_.tenant_secret = std::string(32, 's');
  const std::string tenant_dir = dir_.path() + "/t1";
  const std::string ns = fmt::format("{}/{:016x}-{:016x}", tenant_dir, format::namespace_digest(options_), 0);
  {
    OutsideFiles outside(40);
    ASSERT_EQ(::symlink(outside.path().c_str(), tenant_dir.c_str()), 0);
    const Status st = create_and_use(config_, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    outside.expect_untouched();
    ASSERT_EQ(::unlink(tenant_dir.c_str()), 0);
  }
  ASSERT_EQ(::mkdir(tenant_dir.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir(ns.c_str(), 0700), 0);
  OutsideFiles outside(40);
  ASSERT_EQ(::symlink(outside.path().c_str(), (ns + "/incoming").c_str()), 0);
  const Status st = create_and_use(config_, options_);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  outside.expect_untouched();
}

// Another local user (uid 65534 here) owning the root, or having pre-created the namespace
// directory with incoming/ linked to the victim's files: create refuses; the victim's files stay.
// A root that anyone may write into needs the sticky bit (as /tmp has). Needs root to chown.
TEST_F(DiskHardening, DirectoriesOfAnotherUserAreRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create directories owned by another user";
  constexpr uid_t kOther = 65534;
  {
    SCOPED_TRACE("namespace directory pre-created by another user, incoming/ linked to the victim's files");
    OutsideFiles victim(80);
    ASSERT_EQ(::mkdir(ns_dir_.c_str(), 0777), 0);
    ASSERT_EQ(::chown(ns_dir_.c_str(), kOther, kOther), 0);
    const std::string link = ns_dir_ + "/incoming";
    ASSERT_EQ(::symlink(victim.path().c_str(), link.c_str()), 0);
    ASSERT_EQ(::lchown(link.c_str(), kOther, kOther), 0);
    const Status st = create_and_use(config_, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find(ns_dir_), std::string::npos) << st.to_string();
    victim.expect_untouched();
    TempDir::remove_tree(ns_dir_);
  }
  {
    SCOPED_TRACE("incoming/ a real directory of another user");
    ASSERT_EQ(::mkdir(ns_dir_.c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((ns_dir_ + "/incoming").c_str(), 0700), 0);
    ASSERT_EQ(::chown((ns_dir_ + "/incoming").c_str(), kOther, kOther), 0);
    const Status st = create_and_use(config_, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find(ns_dir_ + "/incoming"), std::string::npos) << st.to_string();
    TempDir::remove_tree(ns_dir_);
  }
  const std::string root = dir_.path() + "/root";
  DiskBackendConfig c = config_;
  c.root = root;
  {
    SCOPED_TRACE("root owned by another user");
    ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
    ASSERT_EQ(::chown(root.c_str(), kOther, kOther), 0);
    const Status st = create_and_use(c, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find(root), std::string::npos) << st.to_string();
    ASSERT_EQ(::chown(root.c_str(), ::geteuid(), ::getegid()), 0);
  }
  {
    SCOPED_TRACE("world-writable root without the sticky bit");
    ASSERT_EQ(::chmod(root.c_str(), 0777), 0);
    const Status st = create_and_use(c, options_);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  }
  {
    SCOPED_TRACE("world-writable root with the sticky bit, as /tmp");
    ASSERT_EQ(::chmod(root.c_str(), 01777), 0);
    const Status st = create_and_use(c, options_);
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
}

}  // namespace
}  // namespace kvtier::storage
