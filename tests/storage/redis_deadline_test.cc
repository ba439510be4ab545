// Overall deadlines of Redis storage operations against a hung server: a redis-server this test
// starts itself accepts connections but answers nothing once stopped with SIGSTOP. Before the
// deadlines, one get took (max_retries + 1) x command_timeout (25.8 s with the defaults) and a
// batch of 200 twice that; now each returns within its deadline plus a small margin, as TimedOut.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <vector>

#include "kvtier/storage/redis_backend.h"
#include "kvtier/storage/storage_config.h"
#include "sanitizers.h"
#include "storage/redis_server.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::fill_random;
using testing::key_of;
using testing::RedisServer;
using Clock = std::chrono::steady_clock;

// Scheduling and the sanitizers' slowdown; far below one command_timeout (5 s).
constexpr std::chrono::milliseconds kMargin{400};

std::chrono::milliseconds since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

TEST(RedisDeadline, HungServerGetReturnsWithinItsDeadline) {
  RedisServer server;
  ASSERT_TRUE(server.error().empty()) << server.error();
  RedisBackendConfig c;
  c.endpoints = {server.endpoint()};
  c.mode = RedisMode::kSingle;
  c.item_deadline = std::chrono::milliseconds(500);
  c.batch_deadline = std::chrono::milliseconds(1000);
  // The defaults otherwise: 5 s command timeout, 4 retries, each on a fresh connection.
  auto b = create_redis_backend(c, StorageOptions{});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  constexpr int kN = 200;
  constexpr std::size_t kBytes = 4096;
  std::vector<std::byte> src(kN * kBytes), dst(kN * kBytes);
  fill_random(src.data(), src.size(), 5);
  StorageBatch put{StorageOp::kPut, {}};
  for (int i = 0; i < kN; ++i) put.items.push_back({key_of(11, i), src.data() + i * kBytes, kBytes});
  auto pr = run_batch(**b, put);
  ASSERT_TRUE(pr.ok());
  for (auto& r : *pr) ASSERT_TRUE(r.status.ok()) << r.status.to_string();

  server.stop();
  auto t0 = Clock::now();
  auto one =
      run_batch(**b, StorageBatch{StorageOp::kGet, {{key_of(11, 0), dst.data(), kBytes}}}, std::chrono::seconds(60));
  const auto single_ms = since(t0);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ((*one)[0].status.code(), StatusCode::kTimedOut) << (*one)[0].status.to_string();
  EXPECT_LE(single_ms, c.item_deadline + kMargin);

  StorageBatch get{StorageOp::kGet, {}};
  for (int i = 0; i < kN; ++i) get.items.push_back({key_of(11, i), dst.data() + i * kBytes, kBytes});
  t0 = Clock::now();
  auto many = run_batch(**b, get, std::chrono::seconds(120));
  const auto batch_ms = since(t0);
  ASSERT_TRUE(many.ok()) << many.status().to_string();
  for (auto& r : *many) EXPECT_EQ(r.status.code(), StatusCode::kTimedOut) << r.status.to_string();
  EXPECT_LE(batch_ms, c.batch_deadline + kMargin);

  // Back: the backend reconnects and serves the stored bytes.
  server.resume();
  std::memset(dst.data(), 0, dst.size());
  auto again = run_batch(**b, get, std::chrono::seconds(30));
  ASSERT_TRUE(again.ok());
  for (auto& r : *again) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
  EXPECT_GE((*b)->stats().reconnects, 1u);
}

TEST(RedisDeadline, HungServerPutReturnsWithinItsDeadline) {
  RedisServer server;
  ASSERT_TRUE(server.error().empty()) << server.error();
  RedisBackendConfig c;
  c.endpoints = {server.endpoint()};
  c.mode = RedisMode::kSingle;
  c.item_deadline = std::chrono::milliseconds(300);
  auto b = create_redis_backend(c, StorageOptions{});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  std::vector<std::byte> src(4096);
  server.stop();
  const auto t0 = Clock::now();
  auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(12, 0), src.data(), src.size()}}},
                     std::chrono::seconds(60));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].status.code(), StatusCode::kTimedOut) << (*r)[0].status.to_string();
  EXPECT_LE(since(t0), c.item_deadline + kMargin);
}

TEST(RedisDeadline, DeadlinesAreValidated) {
  RedisBackendConfig c;
  c.endpoints = {"127.0.0.1:1"};
  c.item_deadline = std::chrono::milliseconds(0);
  EXPECT_EQ(create_redis_backend(c, StorageOptions{}).status().code(), StatusCode::kInvalidArgument);
  c.item_deadline = std::chrono::milliseconds(100);
  c.batch_deadline = std::chrono::milliseconds(-1);
  EXPECT_EQ(create_redis_backend(c, StorageOptions{}).status().code(), StatusCode::kInvalidArgument);
  // Past about 292 years `now + deadline` overflowed: create gave up at once, or every put failed naming another
  // limit. Knobs past a day (as the spec's parameters) are named.
  c.batch_deadline = std::chrono::milliseconds(1000);
  for (auto* knob : {&c.create_deadline, &c.item_deadline, &c.batch_deadline, &c.command_timeout}) {
    const auto kept = *knob;
    *knob = std::chrono::milliseconds(std::numeric_limits<std::int64_t>::max());
    Status st = create_redis_backend(c, StorageOptions{}).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("9223372036854775807 ms is not within a day"), std::string::npos) << st.to_string();
    *knob = kept;
  }
}

// A server that requires a password, and a backend configured without one: create fails with
// FailedPrecondition (in auto mode the NOAUTH reply to CLUSTER SLOTS used to be taken for "not a
// cluster", and single mode sent nothing at create), instead of every later item failing.
TEST(RedisCreate, MissingPasswordIsDetectedAtCreate) {
  RedisServer server({"--requirepass", "s3cret"});
  ASSERT_TRUE(server.error().empty()) << server.error();
  RedisBackendConfig c;
  c.endpoints = {server.endpoint()};
  for (RedisMode mode : {RedisMode::kAuto, RedisMode::kSingle, RedisMode::kCluster}) {
    c.mode = mode;
    c.password.clear();
    auto b = create_redis_backend(c, StorageOptions{});
    EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status().to_string();
    c.password = "wrong";
    b = create_redis_backend(c, StorageOptions{});
    EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status().to_string();
  }
  c.mode = RedisMode::kAuto;
  c.password = "s3cret";
  auto b = create_redis_backend(c, StorageOptions{});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->name(), "redis");
}

// A 256 MiB put: the value goes from the caller's buffer to the socket. It used to be copied into
// a command string and again into hiredis's output buffer (peak memory + 2x the value). Measured
// in a child process, whose peak RSS (ru_maxrss) is this put's alone.
TEST(RedisPut, LargeValueIsNotCopied) {
  RedisServer server;
  ASSERT_TRUE(server.error().empty()) << server.error();
#if defined(KVTIER_TEST_ASAN) || defined(KVTIER_TEST_TSAN)
  // The sanitizers' allocators copy on every realloc, and hiredis grows its read buffer by realloc as the reply
  // arrives: the get of 256 MiB took 33-44 s under ASan and TSan, most of it page faults in those copies. One
  // extra copy of 16 MiB still shows (16 MiB > 4 MiB).
  constexpr std::size_t kBytes = std::size_t{16} << 20;
#else
  constexpr std::size_t kBytes = std::size_t{256} << 20;
#endif
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    long growth_kib = -1;
    RedisBackendConfig c;
    c.endpoints = {server.endpoint()};
    c.mode = RedisMode::kSingle;
    c.workers = 1;
    c.item_deadline = std::chrono::seconds(60);
    c.batch_deadline = std::chrono::seconds(60);
    c.command_timeout = std::chrono::seconds(30);
    auto b = create_redis_backend(c, StorageOptions{});
    std::vector<std::byte> src(kBytes);
    fill_random(src.data(), src.size(), 77);
    rusage before{}, after{};
    ::getrusage(RUSAGE_SELF, &before);
    if (b.ok()) {
      auto r = run_batch(**b, StorageBatch{StorageOp::kPut, {{key_of(13, 1), src.data(), src.size()}}},
                         std::chrono::seconds(90));
      ::getrusage(RUSAGE_SELF, &after);
      if (r.ok() && (*r)[0].status.ok()) growth_kib = after.ru_maxrss - before.ru_maxrss;
    }
    (void)!::write(fds[1], &growth_kib, sizeof growth_kib);
    ::_exit(0);
  }
  ::close(fds[1]);
  long growth_kib = -1;
  ASSERT_EQ(::read(fds[0], &growth_kib, sizeof growth_kib), static_cast<ssize_t>(sizeof growth_kib));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_GE(growth_kib, 0) << "the put failed in the child";
  EXPECT_LT(growth_kib, static_cast<long>(kBytes / 1024 / 4)) << "peak memory grew by " << growth_kib << " KiB";
  // And the value arrived whole.
  RedisBackendConfig c;
  c.endpoints = {server.endpoint()};
  c.mode = RedisMode::kSingle;
  // The same deadlines as the put's: the default 10 s batch deadline is too short for 256 MiB on a loaded
  // machine (a get that timed out failed the test, not the property it checks).
  // The deadline now bounds the whole reply, not each recv: under ASan on a loaded 2-core machine reading 256 MiB
  // took over 60 s once, so the read gets 150 s (this test checks memory, not speed).
  c.item_deadline = std::chrono::seconds(150);
  c.batch_deadline = std::chrono::seconds(150);
  c.command_timeout = std::chrono::seconds(60);
  auto b = create_redis_backend(c, StorageOptions{});
  ASSERT_TRUE(b.ok());
  std::vector<std::byte> want(kBytes), dst(kBytes);
  fill_random(want.data(), want.size(), 77);
  auto r = run_batch(**b, StorageBatch{StorageOp::kGet, {{key_of(13, 1), dst.data(), dst.size()}}},
                     std::chrono::seconds(180));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), want.data(), kBytes), 0);
}

// A loopback socket that listens and never accepts: the kernel completes every connect, nothing
// is ever answered (a server that hangs, or a port something else holds).
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd_, 64) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port_ = ntohs(a.sin_port);
  }
  ~SilentListener() {
    if (fd_ >= 0) ::close(fd_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  bool ok() const { return port_ != 0; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Create against seeds that accept connections and never answer: it used to take (max_retries +
// 1) x command_timeout per seed (25.6 s each with the defaults, 51 s for two); create_deadline now
// bounds the whole of it, and the failure says so.
TEST(RedisDeadline, CreateAgainstSilentSeedsReturnsWithinCreateDeadline) {
  SilentListener a, b;
  ASSERT_TRUE(a.ok() && b.ok());
  RedisBackendConfig c;
  c.endpoints = {a.endpoint(), b.endpoint()};
  c.mode = RedisMode::kAuto;  // asks CLUSTER SLOTS and retries on no answer
  c.create_deadline = std::chrono::milliseconds(1500);
  // The defaults otherwise: 5 s command timeout, 4 retries.
  const auto t0 = Clock::now();
  auto r = create_redis_backend(c, StorageOptions{});
  const auto ms = since(t0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().to_string();
  EXPECT_NE(r.status().message().find("create_deadline"), std::string::npos) << r.status().to_string();
  EXPECT_LT(ms, c.create_deadline + std::chrono::seconds(1));
  // A sane default: a stopped server fails create in seconds, not half a minute.
  EXPECT_GT(RedisBackendConfig{}.create_deadline.count(), 0);
  EXPECT_LE(RedisBackendConfig{}.create_deadline, std::chrono::seconds(10));
}

TEST(RedisDeadline, KnobsInTheConfigTable) {
  RedisBackendConfig c;
  ConfigTable t;
  bind_redis_backend_config(t, c);
  ASSERT_TRUE(t.apply_text("storage.redis.item_deadline = 250ms\nstorage.redis.batch_deadline = 2s\n").ok());
  EXPECT_EQ(c.item_deadline, std::chrono::milliseconds(250));
  EXPECT_EQ(c.batch_deadline, std::chrono::milliseconds(2000));
  EXPECT_FALSE(t.set("storage.redis.item_deadline", "-5ms").ok());
  EXPECT_EQ(c.item_deadline, std::chrono::milliseconds(250));
  ASSERT_TRUE(t.set("storage.redis.create_deadline", "3s").ok());
  EXPECT_EQ(c.create_deadline, std::chrono::milliseconds(3000));
}

}  // namespace
}  // namespace kvtier::storage
