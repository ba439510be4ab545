// The disk backend under injected I/O faults (DiskFaultInjector, disk_fault.h): a read that
// fails with EIO, an fsync of the object or of its directory that fails, a write or read that
// comes back short (also torn: short, then failing). Under each:
//   - nothing acknowledged is lost: every object whose put returned OK is served byte-exact,
//     also after the backend is reopened (the one documented exception: an object whose own
//     read failed with EIO is quarantined, so that object becomes a miss);
//   - nothing bad is served: a get reported OK returns the bytes of a put of that key, never a
//     partial or garbled object; a put whose write or fsync failed is not acknowledged;
//   - the backend keeps working once the faults stop.
// Run with buffered I/O (the object is fdatasynced) and with O_DIRECT where the filesystem takes
// it (the directory fsync covers the data on ext4/XFS).
#include "kvtier/testing/disk_fault.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvtier/core/log.h"
#include "kvtier/storage/disk_backend.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::key_of;
using testing::TempDir;
using Bytes = std::vector<std::byte>;

constexpr std::uint64_t kMaxObject = 64 * 1024;

Bytes payload(std::uint64_t seed, std::size_t bytes) {
  Bytes b(bytes);
  fill_random(b.data(), b.size(), seed);
  return b;
}

class DiskFault : public ::testing::TestWithParam<DirectIo> {
 protected:
  void SetUp() override {
    config_.root = dir_.path();
    config_.durability = Durability::kPowerLoss;
    config_.direct_io = GetParam();
    config_.fault_injector = faults_;
    options_.ns = "disk-fault";
    open();
  }

  void open() {
    backend_.reset();
    auto b = create_disk_backend(config_, options_);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    backend_ = std::move(b).value();
  }

  Status put(const StorageKey& k, const Bytes& v) {
    AlignedBuffer buf(v.size());
    std::memcpy(buf.data(), v.data(), v.size());
    auto t = backend_->post(StorageBatch{StorageOp::kPut, {{k, buf.data(), v.size()}}});
    if (!t.ok()) return t.status();
    Status w = t->wait(std::chrono::seconds(30));
    if (!w.ok()) return w;
    return t->item(0).status;
  }

  Result<Bytes> get(const StorageKey& k) {
    AlignedBuffer buf(kMaxObject);
    std::memset(buf.data(), 0x5a, kMaxObject);
    auto t = backend_->post(StorageBatch{StorageOp::kGet, {{k, buf.data(), kMaxObject}}});
    if (!t.ok()) return t.status();
    KVTIER_RETURN_IF_ERROR(t->wait(std::chrono::seconds(30)));
    const ItemResult r = t->item(0);
    if (!r.status.ok()) return r.status;
    return Bytes(buf.data(), buf.data() + r.bytes);
  }

  // Puts `n` objects (sizes alternate between block-aligned and not) with no fault set.
  std::map<int, Bytes> put_acknowledged(int n, std::uint64_t salt) {
    std::map<int, Bytes> acked;
    for (int i = 0; i < n; ++i) {
      Bytes v = payload(salt + i, i % 2 ? 5000 + 17 * i : 8192);
      Status s = put(key_of(salt, i), v);
      EXPECT_TRUE(s.ok()) << s.to_string();
      acked[i] = std::move(v);
    }
    return acked;
  }

  void expect_served(const std::map<int, Bytes>& acked, std::uint64_t salt, const std::set<int>& except = {}) {
    for (const auto& [i, v] : acked) {
      if (except.count(i)) continue;
      auto got = get(key_of(salt, i));
      ASSERT_TRUE(got.ok()) << "object " << i << ": " << got.status().to_string();
      EXPECT_EQ(*got, v) << "object " << i << " not byte-exact";
    }
  }

  // Files of puts that never committed (they must be gone after a failed put).
  std::vector<std::string> leftover_temporaries() {
    std::vector<std::string> out;
    for (auto& e : std::filesystem::recursive_directory_iterator(dir_.path()))
      if (e.path().filename().string().find(".kvo.tmp.") != std::string::npos) out.push_back(e.path().string());
    return out;
  }

  // Faults stop; a fresh object round-trips; the acknowledged ones survive a reopen.
  void expect_recovers(const std::map<int, Bytes>& acked, std::uint64_t salt, const std::set<int>& except = {}) {
    faults_->clear();
    const Bytes fresh = payload(salt ^ 0xf00d, 12288);
    const StorageKey fk = key_of(salt, 1000);
    ASSERT_TRUE(put(fk, fresh).ok());
    auto got = get(fk);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(*got, fresh);
    open();
    expect_served(acked, salt, except);
    got = get(fk);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(*got, fresh);
  }

  // O_DIRECT transfers resume on a block boundary.
  std::uint64_t short_align() const { return GetParam() == DirectIo::kOff ? 1 : 4096; }

  TempDir dir_;
  std::shared_ptr<DiskFaultInjector> faults_ = std::make_shared<DiskFaultInjector>(7);
  DiskBackendConfig config_;
  StorageOptions options_;
  std::unique_ptr<StorageBackend> backend_;
};

TEST_P(DiskFault, ReadErrorIsAMissNeverBytes) {
  const std::uint64_t salt = 11;
  auto acked = put_acknowledged(6, salt);
  DiskFaultRule r;
  r.op = DiskFaultOp::kRead;
  r.key = key_of(salt, 2);
  faults_->add(r);
  auto got = get(key_of(salt, 2));
  EXPECT_FALSE(got.ok()) << "a read that failed with EIO was served";
  EXPECT_GE(faults_->injected(DiskFaultOp::kRead), 1u);
  expect_served(acked, salt, {2});
  // EIO quarantines the object (disk_backend.h): a miss from now on, never other bytes.
  faults_->clear();
  got = get(key_of(salt, 2));
  if (got.ok()) {
    EXPECT_EQ(*got, acked[2]);
  }
  expect_recovers(acked, salt, {2});
}

// A get that fails (here a read error) on a file that a put replaced while the get was reading it: quarantine went
// by the key's name, so it took the put's new, acknowledged object and left the key a miss. The file that failed
// has left the directory already; the new object stays and is served.
TEST_P(DiskFault, AGetThatFailsAfterAReplacingPutLeavesTheNewObject) {
  const StorageKey k = key_of(77, 1);
  constexpr std::size_t kOld = 8 << 20;
  AlignedBuffer old_value(kOld);
  fill_random(old_value.data(), kOld, 1);
  {
    auto t = backend_->post(StorageBatch{StorageOp::kPut, {{k, old_value.data(), kOld}}});
    ASSERT_TRUE(t.ok() && t->wait(std::chrono::seconds(30)).ok() && t->item(0).status.ok());
  }
  // The get's reads come back a thousandth at a time (the backend resubmits the rest), and a later one fails: the
  // replacing put below commits meanwhile.
  DiskFaultRule fail;
  fail.op = DiskFaultOp::kRead;
  fail.key = k;
  fail.nth = GetParam() == DirectIo::kOff ? 1000 : 300;  // direct reads here take milliseconds each
  faults_->add(fail);
  DiskFaultRule trickle;
  trickle.op = DiskFaultOp::kRead;
  trickle.action = DiskFaultAction::kShort;
  trickle.keep = 0.001;
  trickle.align = short_align();
  trickle.key = k;
  faults_->add(trickle);
  AlignedBuffer into(kOld);
  auto get_ticket = backend_->post(StorageBatch{StorageOp::kGet, {{k, into.data(), kOld}}});
  ASSERT_TRUE(get_ticket.ok());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (faults_->injected(DiskFaultOp::kRead) < 10 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  ASSERT_GE(faults_->injected(DiskFaultOp::kRead), 10u) << "the get's reads did not start";
  const Bytes new_value = payload(2, 4096);
  ASSERT_TRUE(put(k, new_value).ok());
  ASSERT_FALSE(get_ticket->poll()) << "the get ended before the put: the test did not reach the race";
  ASSERT_TRUE(get_ticket->wait(std::chrono::seconds(30)).ok());
  EXPECT_EQ(get_ticket->item(0).status.code(), StatusCode::kDataLoss) << get_ticket->item(0).status.to_string();
  faults_->clear();
  auto got = get(k);
  ASSERT_TRUE(got.ok()) << "the acknowledged replacement was quarantined: " << got.status().to_string();
  EXPECT_EQ(*got, new_value);
}

TEST_P(DiskFault, RandomReadErrorsServeOnlyExactBytes) {
  const std::uint64_t salt = 12;
  auto acked = put_acknowledged(8, salt);
  DiskFaultRule r;
  r.op = DiskFaultOp::kRead;
  r.probability = 0.4;
  faults_->add(r);
  std::set<int> failed;
  for (int round = 0; round < 3; ++round)
    for (const auto& [i, v] : acked) {
      auto got = get(key_of(salt, i));
      if (got.ok())
        EXPECT_EQ(*got, v) << "object " << i;
      else
        failed.insert(i);
    }
  EXPECT_GE(faults_->injected(DiskFaultOp::kRead), 1u);
  expect_recovers(acked, salt, failed);
}

TEST_P(DiskFault, FailedObjectSyncIsNotAcknowledged) {
  const std::uint64_t salt = 13;
  auto acked = put_acknowledged(4, salt);
  DiskFaultRule r;
  r.op = DiskFaultOp::kFileSync;
  faults_->add(r);
  // A new key and a replacement of an acknowledged one.
  const Bytes fresh = payload(99, 8192), replacement = payload(98, 5000);
  const Status s_new = put(key_of(salt, 10), fresh);
  const Status s_replace = put(key_of(salt, 0), replacement);
  if (faults_->injected(DiskFaultOp::kFileSync) == 0) {
    // O_DIRECT on ext4/XFS: the object is not fdatasynced (the directory fsync covers it).
    EXPECT_EQ(GetParam(), DirectIo::kAuto);
    EXPECT_TRUE(s_new.ok() && s_replace.ok());
    return;
  }
  EXPECT_FALSE(s_new.ok()) << "a put whose fdatasync failed was acknowledged";
  EXPECT_FALSE(s_replace.ok()) << "a put whose fdatasync failed was acknowledged";
  auto got = get(key_of(salt, 10));
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << got.status().to_string();
  expect_served(acked, salt);  // object 0 still holds its acknowledged bytes
  EXPECT_TRUE(leftover_temporaries().empty());
  expect_recovers(acked, salt);
  EXPECT_EQ(get(key_of(salt, 10)).status().code(), StatusCode::kNotFound);
}

TEST_P(DiskFault, FailedDirectorySyncIsNotAcknowledged) {
  const std::uint64_t salt = 14;
  auto acked = put_acknowledged(4, salt);
  DiskFaultRule r;
  r.op = DiskFaultOp::kDirSync;
  r.key = key_of(salt, 10);
  faults_->add(r);
  const Bytes fresh = payload(97, 8192);
  EXPECT_FALSE(put(key_of(salt, 10), fresh).ok()) << "a put whose directory fsync failed was acknowledged";
  EXPECT_GE(faults_->injected(DiskFaultOp::kDirSync), 1u);
  // Renamed before the fsync, the object may be visible: then whole, never partial.
  auto got = get(key_of(salt, 10));
  if (got.ok()) {
    EXPECT_EQ(*got, fresh);
  }
  expect_served(acked, salt);
  expect_recovers(acked, salt);
  got = get(key_of(salt, 10));
  if (got.ok()) {
    EXPECT_EQ(*got, fresh);
  }
}

// Creating a shard directory, the backend fsyncs the root so the new directory survives a power
// loss. When that fsync fails, the put fails; the next put into the shard (mkdir finds it) must
// fsync the root again before it is acknowledged, else an acknowledged object may sit in a
// directory that was never made durable.
TEST_P(DiskFault, FailedShardCreationSyncIsRetried) {
  const std::uint64_t salt = 19;
  DiskFaultRule r;
  r.op = DiskFaultOp::kDirSync;
  r.max_hits = 1;  // the first directory fsync: the root's, after the shard's mkdir
  faults_->add(r);
  const StorageKey k = key_of(salt, 0);
  EXPECT_FALSE(put(k, payload(90, 8192)).ok()) << "acknowledged although the new shard directory's fsync failed";
  ASSERT_EQ(faults_->injected(DiskFaultOp::kDirSync), 1u);
  const std::uint64_t before = faults_->seen(DiskFaultOp::kDirSync);
  const Bytes v = payload(91, 8192);
  ASSERT_TRUE(put(k, v).ok());
  // The root again, then the shard directory after the rename.
  EXPECT_EQ(faults_->seen(DiskFaultOp::kDirSync) - before, 2u)
      << "the put into the shard was acknowledged without the root fsync that failed before";
  std::map<int, Bytes> acked{{0, v}};
  expect_served(acked, salt);
  expect_recovers(acked, salt);
}

TEST_P(DiskFault, ShortWritesAreCompleted) {
  const std::uint64_t salt = 15;
  DiskFaultRule r;
  r.op = DiskFaultOp::kWrite;
  r.action = DiskFaultAction::kShort;
  r.keep = 0.5;
  r.align = short_align();
  faults_->add(r);
  // Every write is cut in half (its tail punched out of the file): the backend must write the rest.
  auto acked = put_acknowledged(6, salt);
  EXPECT_GE(faults_->injected(DiskFaultOp::kWrite), 6u);
  expect_served(acked, salt);
  expect_recovers(acked, salt);
}

// A file size limit (RLIMIT_FSIZE) stops an O_DIRECT write at the limit, off a block boundary: the backend wrote the
// rest at that unaligned offset, which O_DIRECT refuses, and failed the put with kUnavailable "Invalid argument".
// It is kResourceExhausted now (as EFBIG at a block boundary was), nothing is stored and no temporary is left;
// buffered I/O writes the rest.
TEST_P(DiskFault, AWriteCutOffABlockBoundaryIsOutOfRoomUnderDirectIo) {
  const std::uint64_t salt = 18;
  const StorageKey k = key_of(salt, 1);
  DiskFaultRule r;
  r.op = DiskFaultOp::kWrite;
  r.action = DiskFaultAction::kShort;
  r.keep = 0.37;
  r.align = 1;
  r.key = k;
  r.max_hits = 1;
  faults_->add(r);
  const Bytes v = payload(salt, 40000);
  Status s = put(k, v);
  ASSERT_EQ(faults_->injected(DiskFaultOp::kWrite), 1u);
  if (backend_->stats().direct_io_fallback == 0 && GetParam() != DirectIo::kOff) {
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find("stopped growing"), std::string::npos) << s.to_string();
    EXPECT_EQ(get(k).status().code(), StatusCode::kNotFound);
  } else {
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto got = get(k);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(*got, v);
  }
  EXPECT_TRUE(leftover_temporaries().empty());
}

TEST_P(DiskFault, TornWriteIsNotAcknowledgedNorServed) {
  const std::uint64_t salt = 16;
  auto acked = put_acknowledged(4, salt);
  // Each put below: the first write stops half way, the next one fails (a torn object on disk).
  auto torn = [&](const StorageKey& k) {
    DiskFaultRule shrt;
    shrt.op = DiskFaultOp::kWrite;
    shrt.action = DiskFaultAction::kShort;
    shrt.align = short_align();
    shrt.key = k;
    shrt.max_hits = 1;
    DiskFaultRule fail;
    fail.op = DiskFaultOp::kWrite;
    fail.key = k;
    fail.max_hits = 1;
    faults_->clear();
    faults_->add(shrt);
    faults_->add(fail);
  };
  torn(key_of(salt, 10));
  EXPECT_FALSE(put(key_of(salt, 10), payload(96, 8192)).ok());
  EXPECT_EQ(get(key_of(salt, 10)).status().code(), StatusCode::kNotFound);
  torn(key_of(salt, 1));
  EXPECT_FALSE(put(key_of(salt, 1), payload(95, 8192)).ok());
  // A write that makes no progress at all fails the put too.
  DiskFaultRule none;
  none.op = DiskFaultOp::kWrite;
  none.action = DiskFaultAction::kShort;
  none.keep = 0;
  none.key = key_of(salt, 11);
  faults_->clear();
  faults_->add(none);
  EXPECT_FALSE(put(key_of(salt, 11), payload(94, 5000)).ok());
  EXPECT_EQ(get(key_of(salt, 11)).status().code(), StatusCode::kNotFound);
  expect_served(acked, salt);  // object 1 keeps its acknowledged bytes
  EXPECT_TRUE(leftover_temporaries().empty());
  expect_recovers(acked, salt);
  EXPECT_EQ(get(key_of(salt, 10)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(get(key_of(salt, 11)).status().code(), StatusCode::kNotFound);
}

TEST_P(DiskFault, ShortReadsAreCompleted) {
  const std::uint64_t salt = 17;
  auto acked = put_acknowledged(6, salt);
  DiskFaultRule r;
  r.op = DiskFaultOp::kRead;
  r.action = DiskFaultAction::kShort;
  r.align = short_align();
  faults_->add(r);
  // The buffer past each reported length holds garbage: the backend must read the rest.
  expect_served(acked, salt);
  EXPECT_GE(faults_->injected(DiskFaultOp::kRead), 1u);
  expect_recovers(acked, salt);
}

// Every kind of fault at random over a mix of puts (new keys and replacements) and gets.
TEST_P(DiskFault, RandomFaultsKeepTheInvariants) {
  const std::uint64_t salt = 18;
  constexpr int kKeys = 8;
  for (DiskFaultOp op : {DiskFaultOp::kRead, DiskFaultOp::kWrite, DiskFaultOp::kFileSync, DiskFaultOp::kDirSync}) {
    DiskFaultRule e;
    e.op = op;
    e.probability = 0.15;
    faults_->add(e);
  }
  for (DiskFaultOp op : {DiskFaultOp::kRead, DiskFaultOp::kWrite}) {
    DiskFaultRule s;
    s.op = op;
    s.action = DiskFaultAction::kShort;
    s.align = short_align();
    s.probability = 0.3;
    faults_->add(s);
  }
  // Per key: the bytes a get may return (the acknowledged put's, and those of later failed puts,
  // which may have become visible), and whether a failure made the key's fate uncertain.
  std::map<int, std::optional<Bytes>> acked;
  std::map<int, std::vector<Bytes>> possible;
  std::set<int> uncertain;
  std::uint64_t seed = 1000;
  for (int step = 0; step < 80; ++step) {
    const int i = static_cast<int>(testing::splitmix64(step) % kKeys);
    const StorageKey k = key_of(salt, i);
    if (step % 3 != 2) {
      Bytes v = payload(++seed, step % 2 ? 4096 + 123 * (step % 5) : 8192);
      if (put(k, v).ok()) {
        acked[i] = v;
        possible[i] = {v};
        uncertain.erase(i);
      } else {
        possible[i].push_back(v);
        uncertain.insert(i);
      }
    } else {
      auto got = get(k);
      if (got.ok()) {
        bool match = false;
        for (const Bytes& v : possible[i]) match = match || v == *got;
        EXPECT_TRUE(match) << "step " << step << ": key " << i << " served bytes of no put";
      } else {
        uncertain.insert(i);  // a failed read may have quarantined it
      }
    }
  }
  EXPECT_GT(faults_->injected(DiskFaultOp::kRead) + faults_->injected(DiskFaultOp::kWrite), 0u);
  faults_->clear();
  open();
  for (int i = 0; i < kKeys; ++i) {
    auto got = get(key_of(salt, i));
    if (!uncertain.count(i) && acked[i]) {
      ASSERT_TRUE(got.ok()) << "acknowledged key " << i << " lost: " << got.status().to_string();
      EXPECT_EQ(*got, *acked[i]) << "key " << i;
    } else if (got.ok()) {
      bool match = false;
      for (const Bytes& v : possible[i]) match = match || v == *got;
      EXPECT_TRUE(match) << "key " << i << " served bytes of no put after reopen";
    }
  }
  EXPECT_TRUE(leftover_temporaries().empty());
  std::map<int, Bytes> none;
  expect_recovers(none, salt);
}

// A put whose new file cannot be created because the inodes have run out (ENOSPC) or a quota is
// reached (EDQUOT): the disk is full, so ResourceExhausted (as for a full disk on write), not
// Unavailable. EDQUOT used to be Unavailable. Nothing is left behind and the next put succeeds.
TEST_P(DiskFault, InodeOrQuotaExhaustionOnAPutIsResourceExhausted) {
  const std::uint64_t salt = 20;
  auto acked = put_acknowledged(2, salt);
  int i = 10;
  for (int err : {ENOSPC, EDQUOT}) {
    SCOPED_TRACE(std::strerror(err));
    const StorageKey k = key_of(salt, ++i);
    DiskFaultRule r;
    r.op = DiskFaultOp::kCreate;
    r.error = err;
    r.key = k;  // the put's own file (a new shard directory is created without keys)
    r.max_hits = 1;
    faults_->clear();
    faults_->add(r);
    const std::uint64_t injected = faults_->injected(DiskFaultOp::kCreate);
    const Status s = put(k, payload(salt + i, 8192));
    EXPECT_EQ(faults_->injected(DiskFaultOp::kCreate), injected + 1);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find(std::strerror(err)), std::string::npos) << s.to_string();
    EXPECT_EQ(get(k).status().code(), StatusCode::kNotFound);
    EXPECT_TRUE(leftover_temporaries().empty());
    const Bytes v = payload(salt + 100 + i, 5000);
    ASSERT_TRUE(put(k, v).ok());
    acked[i] = v;
  }
  expect_served(acked, salt);
}

// The same when the put needs a new shard directory: EDQUOT from its mkdir was Unavailable.
TEST_P(DiskFault, InodeOrQuotaExhaustionOnANewShardIsResourceExhausted) {
  const std::uint64_t salt = 21;
  std::set<std::uint8_t> shards;  // none exists yet: the backend creates them at first use
  int i = 0;
  for (int err : {ENOSPC, EDQUOT}) {
    SCOPED_TRACE(std::strerror(err));
    while (shards.count(key_of(salt, i).digest[0])) ++i;
    const StorageKey k = key_of(salt, i);
    shards.insert(k.digest[0]);
    DiskFaultRule r;
    r.op = DiskFaultOp::kCreate;
    r.error = err;
    r.max_hits = 1;  // the first creation of the put: its shard directory
    faults_->clear();
    faults_->add(r);
    const Status s = put(k, payload(salt + i, 8192));
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find(std::strerror(err)), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("mkdir"), std::string::npos) << s.to_string();
    const Bytes v = payload(salt + 100 + i, 8192);
    ASSERT_TRUE(put(k, v).ok());
    auto got = get(k);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(*got, v);
  }
}

INSTANTIATE_TEST_SUITE_P(IoModes, DiskFault, ::testing::Values(DirectIo::kOff, DirectIo::kAuto),
                         [](const ::testing::TestParamInfo<DirectIo>& p) {
                           return std::string(p.param == DirectIo::kOff ? "Buffered" : "Direct");
                         });

// Every file and directory create_disk_backend makes (the root itself, the tenant, namespace,
// quarantine/, incoming/ and free/ directories, the LOCK file), failing for want of inodes or
// quota: create fails ResourceExhausted naming the path and the error. The root's own mkdir and
// the LOCK file were Unavailable for both, the directories below the root for EDQUOT.
TEST(DiskFaultCreate, InodeOrQuotaExhaustionAtCreateIsResourceExhausted) {
  for (int err : {ENOSPC, EDQUOT}) {
    int failed = 0;
    for (std::uint64_t nth = 1; nth < 20; ++nth) {
      SCOPED_TRACE(fmt::format("{}, creation {}", std::strerror(err), nth));
      TempDir dir;
      auto faults = std::make_shared<DiskFaultInjector>(1);
      DiskFaultRule r;
      r.op = DiskFaultOp::kCreate;
      r.error = err;
      r.nth = nth;
      faults->add(r);
      DiskBackendConfig c;
      c.root = dir.path() + "/store";
      c.fault_injector = faults;
      StorageOptions o;
      o.ns = "disk-fault-create";
      o.tenant = "ta";
      auto b = create_disk_backend(c, o);
      if (faults->injected(DiskFaultOp::kCreate) == 0) {  // past the last creation: created
        EXPECT_TRUE(b.ok()) << b.status().to_string();
        break;
      }
      ++failed;
      ASSERT_FALSE(b.ok());
      EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status().to_string();
      EXPECT_NE(b.status().message().find(std::strerror(err)), std::string::npos) << b.status().to_string();
      EXPECT_NE(b.status().message().find(dir.path()), std::string::npos) << b.status().to_string();
    }
    // root, tenant, namespace, quarantine/, incoming/, free/, LOCK
    EXPECT_EQ(failed, 7) << std::strerror(err);
  }
}

// Collects the disk backend's log lines while it lives (at info and above).
class LogCapture {
 public:
  LogCapture() : level_(log_level()) {
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel level, std::string_view component, std::string_view message) {
      std::lock_guard<std::mutex> lk(mu_);
      if (component == "storage/disk") lines_.emplace_back(level, std::string(message));
    });
  }
  ~LogCapture() {
    set_log_sink(nullptr);
    set_log_level(level_);
  }
  // The lines that mention `what`.
  std::vector<std::pair<LogLevel, std::string>> lines(std::string_view what) {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::pair<LogLevel, std::string>> out;
    for (const auto& l : lines_)
      if (l.second.find(what) != std::string::npos) out.push_back(l);
    return out;
  }

 private:
  LogLevel level_;
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

// An O_DIRECT probe that fails (EINVAL: a filesystem that refuses O_DIRECT) switches the backend
// to buffered I/O for its whole life. That used to be an info line only; it is a warning naming
// the directory and the error, and stats().direct_io_fallback (the storage tier's gauge
// kvtier_storage_direct_io_fallback) is 1. The backend works, buffered.
TEST(DiskDirectProbe, FallbackToBufferedIoIsAWarningAndCounted) {
  TempDir dir;
  auto faults = std::make_shared<DiskFaultInjector>(1);
  DiskFaultRule r;
  r.op = DiskFaultOp::kDirectProbe;
  r.error = EINVAL;
  faults->add(r);
  DiskBackendConfig c;
  c.root = dir.path();
  c.direct_io = DirectIo::kAuto;
  c.fault_injector = faults;
  StorageOptions o;
  o.ns = "direct-probe";
  LogCapture log;
  auto b = create_disk_backend(c, o);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(faults->injected(DiskFaultOp::kDirectProbe), 1u);
  EXPECT_EQ((*b)->stats().direct_io_fallback, 1u);
  EXPECT_FALSE((*b)->caps().zero_copy_host);
  EXPECT_EQ((*b)->caps().alignment, 1u);
  const auto lines = log.lines("O_DIRECT");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].first, LogLevel::kWarning) << lines[0].second;
  EXPECT_NE(lines[0].second.find(std::strerror(EINVAL)), std::string::npos) << lines[0].second;
  EXPECT_NE(lines[0].second.find(dir.path()), std::string::npos) << lines[0].second;
  AlignedBuffer v(8192), d(8192);
  fill_random(v.data(), 8192, 5);
  auto t = (*b)->post(StorageBatch{StorageOp::kPut, {{key_of(1, 1), v.data(), 8192}}});
  ASSERT_TRUE(t.ok() && t->wait(std::chrono::seconds(30)).ok());
  ASSERT_TRUE(t->item(0).status.ok()) << t->item(0).status.to_string();
  t = (*b)->post(StorageBatch{StorageOp::kGet, {{key_of(1, 1), d.data(), 8192}}});
  ASSERT_TRUE(t.ok() && t->wait(std::chrono::seconds(30)).ok());
  ASSERT_TRUE(t->item(0).status.ok()) << t->item(0).status.to_string();
  EXPECT_EQ(std::memcmp(v.data(), d.data(), 8192), 0);
  EXPECT_GE((*b)->stats().bounce_copies, 2u) << "buffered I/O goes through bounce buffers";
}

// No fallback without a failed probe: buffered I/O that was asked for (kOff) is not counted, and
// kAuto counts exactly when it ended up buffered. kOn fails create instead of falling back:
// NotSupported for a refused O_DIRECT, ResourceExhausted for a probe that found the disk full (it
// said "O_DIRECT refused", wrongly). kAuto on a full disk still falls back, and says why.
TEST(DiskDirectProbe, OnlyAFailedProbeCountsAndKOnFailsCreate) {
  StorageOptions o;
  o.ns = "direct-probe";
  {
    TempDir dir;
    DiskBackendConfig c;
    c.root = dir.path();
    c.direct_io = DirectIo::kOff;
    auto b = create_disk_backend(c, o);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_EQ((*b)->stats().direct_io_fallback, 0u);
  }
  {
    TempDir dir;
    DiskBackendConfig c;
    c.root = dir.path();
    c.direct_io = DirectIo::kAuto;
    auto b = create_disk_backend(c, o);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_EQ((*b)->stats().direct_io_fallback, (*b)->caps().zero_copy_host ? 0u : 1u);
  }
  for (int err : {EINVAL, ENOSPC, EDQUOT}) {
    SCOPED_TRACE(std::strerror(err));
    TempDir dir;
    auto faults = std::make_shared<DiskFaultInjector>(1);
    DiskFaultRule r;
    r.op = DiskFaultOp::kDirectProbe;
    r.error = err;
    faults->add(r);
    DiskBackendConfig c;
    c.root = dir.path();
    c.direct_io = DirectIo::kOn;
    c.fault_injector = faults;
    auto b = create_disk_backend(c, o);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), err == EINVAL ? StatusCode::kNotSupported : StatusCode::kResourceExhausted)
        << b.status().to_string();
    EXPECT_NE(b.status().message().find(std::strerror(err)), std::string::npos) << b.status().to_string();
    if (err == EINVAL) continue;
    c.direct_io = DirectIo::kAuto;
    LogCapture log;
    auto a = create_disk_backend(c, o);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ((*a)->stats().direct_io_fallback, 1u);
    const auto lines = log.lines("O_DIRECT");
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0].first, LogLevel::kWarning) << lines[0].second;
    EXPECT_NE(lines[0].second.find(std::strerror(err)), std::string::npos) << lines[0].second;
  }
}

}  // namespace
}  // namespace kvtier::storage
