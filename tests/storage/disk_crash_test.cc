// kill -9 during writes: a child process writes objects in a loop and reports
// each acknowledged key through a pipe; the parent kills it at a random
// moment, reopens the directory and checks that the index was rebuilt, every
// acknowledged object is readable and verified, no object is partial and no
// temporary file is left.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "kvtier/storage/disk_backend.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::key_of;
using testing::TempDir;

constexpr std::uint64_t kSalt = 0xC0FFEE;

std::uint64_t object_size(std::uint64_t id) {
  // A mix of tiny, odd, page-multiple and 1 MiB objects.
  switch (id % 5) {
    case 0: return 1 + id % 97;
    case 1: return 4096 * (1 + id % 8);
    case 2: return 100000 + id;
    case 3: return 1 << 20;
    case 4: return 65536 + 17;
  }
  return 1;
}

StorageOptions crash_options() {
  StorageOptions o;
  o.ns = "crash-test";
  o.layout_fingerprint = 0xABCD;
  return o;
}

[[noreturn]] void child_main(const std::string& dir, int fd, Durability durability, bool overwrite) {
  DiskBackendConfig c;
  c.root = dir;
  c.durability = durability;
  c.queue_depth = 32;
  auto b = create_disk_backend(c, crash_options());
  if (!b.ok()) _exit(3);
  AlignedBuffer buf(8 * (1 << 20) + 4096);
  for (std::uint64_t id = 0;; id += 8) {
    StorageBatch batch{StorageOp::kPut, {}};
    std::uint64_t off = 0;
    for (std::uint64_t j = 0; j < 8; ++j) {
      // With `overwrite`, ids cycle over 64 keys so puts replace existing objects.
      const std::uint64_t n = object_size(id + j);
      fill_random(buf.data() + off, n, id + j);
      batch.items.push_back({key_of(kSalt, overwrite ? (id + j) % 64 : id + j), buf.data() + off, n});
      off += (n + 4095) / 4096 * 4096;
    }
    auto r = run_batch(**b, std::move(batch));
    if (!r.ok()) _exit(4);
    for (std::uint64_t j = 0; j < 8; ++j) {
      if (!(*r)[j].status.ok()) _exit(5);
      const std::uint64_t v = id + j;
      if (::write(fd, &v, sizeof(v)) != sizeof(v)) _exit(6);
    }
  }
}

std::size_t count_tmp_files(const std::string& dir) {
  std::size_t n = 0;
  std::function<void(const std::string&)> walk = [&](const std::string& p) {
    DIR* d = ::opendir(p.c_str());
    if (!d) return;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      if (e->d_type == DT_DIR)
        walk(p + "/" + name);
      else if (name.find(".tmp.") != std::string::npos)
        ++n;
    }
    ::closedir(d);
  };
  walk(dir);
  return n;
}

void crash_round(Durability durability, bool overwrite, unsigned seed) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    child_main(dir.path(), pipefd[1], durability, overwrite);
  }
  ::close(pipefd[1]);
  // Wait for the first acknowledgement (the child is writing), then kill it at a random moment.
  std::vector<std::uint64_t> acked;
  std::uint64_t v;
  if (::read(pipefd[0], &v, sizeof(v)) == sizeof(v)) acked.push_back(v);
  std::mt19937 rng(seed);
  const int run_ms = 50 + static_cast<int>(rng() % 600);
  std::this_thread::sleep_for(std::chrono::milliseconds(run_ms));
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited early with code " << WEXITSTATUS(status);
  // Acknowledged ids: everything the child wrote to the pipe before it died.
  while (::read(pipefd[0], &v, sizeof(v)) == sizeof(v)) acked.push_back(v);
  std::printf("[ crash    ] killed after %d ms: %zu acknowledged puts\n", run_ms, acked.size());
  ::close(pipefd[0]);
  ASSERT_GT(acked.size(), 0u) << "child acknowledged nothing in " << run_ms << " ms";
  const std::uint64_t max_posted = acked.back() + 16;

  DiskBackendConfig c;
  c.root = dir.path();
  auto b = create_disk_backend(c, crash_options());
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(count_tmp_files(dir.path()), 0u);
  EXPECT_EQ((*b)->stats().quarantined, 0u);

  // For each key, the id whose bytes it must hold: the last acknowledged put (overwrite mode may
  // also hold a later put that committed but was not acknowledged before the kill).
  std::map<std::uint64_t, std::uint64_t> last_acked;
  for (std::uint64_t id : acked) last_acked[overwrite ? id % 64 : id] = id;
  if (!overwrite) {
    EXPECT_GE((*b)->stats().objects, acked.size());
  }

  AlignedBuffer dst(1 << 20);
  const std::uint64_t keys = overwrite ? 64 : max_posted;
  for (std::uint64_t k = 0; k < keys; ++k) {
    StorageBatch batch{StorageOp::kGet, {{key_of(kSalt, k), dst.data(), dst.size()}}};
    auto r = run_batch(**b, std::move(batch));
    ASSERT_TRUE(r.ok());
    const ItemResult& res = (*r)[0];
    auto it = last_acked.find(k);
    if (it == last_acked.end()) {
      // Never acknowledged: a miss or a whole object, never partial or corrupt.
      if (res.status.ok()) {
        ASSERT_EQ(res.bytes, object_size(k)) << "key " << k;
        AlignedBuffer want(res.bytes);
        fill_random(want.data(), res.bytes, k);
        EXPECT_EQ(std::memcmp(want.data(), dst.data(), res.bytes), 0) << "key " << k;
      } else {
        EXPECT_EQ(res.status.code(), StatusCode::kNotFound) << "key " << k << ": " << res.status.to_string();
      }
      continue;
    }
    ASSERT_TRUE(res.status.ok()) << "acknowledged key " << k << " (id " << it->second
                                 << ") lost: " << res.status.to_string();
    // The object holds the last acknowledged id or a later one of the same key (committed, not yet acked).
    bool matched = false;
    for (std::uint64_t id = it->second; id < max_posted && !matched; id += overwrite ? 64 : max_posted) {
      if (res.bytes != object_size(id)) continue;
      AlignedBuffer want(res.bytes);
      fill_random(want.data(), res.bytes, id);
      matched = std::memcmp(want.data(), dst.data(), res.bytes) == 0;
    }
    EXPECT_TRUE(matched) << "key " << k << " holds bytes of no put at or after acknowledged id " << it->second;
  }
}

TEST(DiskCrash, KillDuringWritesProcessDurability) {
  for (unsigned round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    crash_round(Durability::kProcessCrash, false, 100 + round);
    if (HasFatalFailure()) return;
  }
}

TEST(DiskCrash, KillDuringWritesPowerLossDurability) {
  for (unsigned round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    crash_round(Durability::kPowerLoss, false, 200 + round);
    if (HasFatalFailure()) return;
  }
}

TEST(DiskCrash, KillDuringOverwrites) {
  for (unsigned round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    crash_round(Durability::kProcessCrash, true, 300 + round);
    if (HasFatalFailure()) return;
  }
}

TEST(DiskCrash, SecondProcessIsLockedOut) {
  TempDir dir;
  DiskBackendConfig c;
  c.root = dir.path();
  auto a = create_disk_backend(c, crash_options());
  ASSERT_TRUE(a.ok());
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    auto b = create_disk_backend(c, crash_options());
    const char code = !b.ok() && b.status().code() == StatusCode::kFailedPrecondition ? 'L' : 'X';
    (void)::write(pipefd[1], &code, 1);
    _exit(0);
  }
  char code = 0;
  ASSERT_EQ(::read(pipefd[0], &code, 1), 1);
  ::waitpid(pid, nullptr, 0);
  EXPECT_EQ(code, 'L');
}

}  // namespace
}  // namespace kvtier::storage
