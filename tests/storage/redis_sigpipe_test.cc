// Regression test: a Redis server that closes a connection while the client
// writes a command must not kill the process with SIGPIPE (seen once in CI
// under TSan). The Redis backend blocks SIGPIPE in the threads that write to
// its sockets (init, admin commands on the caller's thread, worker threads);
// without that, the write() inside hiredis raises SIGPIPE, whose default
// action terminates the whole process.
//
// A fake server on 127.0.0.1 (no real Redis needed) reproduces the failure
// deterministically. In "drop" mode, for every connection it:
//   1. sends FIN (shutdown(SHUT_WR)): the client's socket moves to CLOSE_WAIT,
//      as when Redis closes an idle or timed-out client;
//   2. waits for the first bytes of a command, reads a few KiB of it;
//   3. closes with SO_LINGER 0 (RST) while the client is still writing.
// A RST that reaches a socket in CLOSE_WAIT makes the kernel report EPIPE
// (not ECONNRESET), so the client's next write() fails with EPIPE and raises
// SIGPIPE. The commands are 32 MiB (a SET value, or an AUTH password), more
// than the loopback socket buffers hold, so the write cannot complete before
// the close and hiredis always calls write() again after the RST.
// In "serve" mode the server answers a tiny subset of Redis (AUTH, SET, GET,
// STRLEN, DEL, PING) so the test can check that the backend recovers.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvtier/storage/redis_backend.h"
#include "kvtier/storage/storage_backend.h"
#include "storage/storage_test_util.h"

namespace kvtier::storage {
namespace {

using testing::fill_random;
using testing::key_of;

::testing::AssertionResult has_substr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

constexpr std::size_t kBigBytes = std::size_t{32} << 20;
// "No hang" bound per operation: above the worst case of the timeouts used
// (5 attempts x (1 s connect + 2 s command) + backoff), and ~10x what one
// operation takes under TSan on a loaded 2-core machine (~2 s; ~0.2 s without).
constexpr auto kOpBound = std::chrono::seconds(20);

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// True when fd has something to read (data, EOF or an error) within timeout.
bool wait_readable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) > 0;
}

bool send_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);  // the server must not die either
    if (n <= 0) return false;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Parses one RESP array of bulk strings (what hiredis sends) at the start of
// `in`. Returns the bytes consumed, 0 when incomplete, -1 when malformed.
long parse_command(const std::string& in, std::vector<std::string>* args) {
  std::size_t p = 0;
  auto read_int = [&](char tag, long* v) -> int {  // 1 ok, 0 incomplete, -1 bad
    if (p >= in.size()) return 0;
    if (in[p] != tag) return -1;
    const std::size_t eol = in.find("\r\n", p);
    if (eol == std::string::npos) return 0;
    *v = std::strtol(in.c_str() + p + 1, nullptr, 10);
    p = eol + 2;
    return 1;
  };
  long argc = 0;
  if (int r = read_int('*', &argc); r <= 0) return r;
  args->clear();
  for (long i = 0; i < argc; ++i) {
    long len = 0;
    if (int r = read_int('$', &len); r <= 0) return r;
    if (len < 0) return -1;
    if (in.size() < p + static_cast<std::size_t>(len) + 2) return 0;
    args->emplace_back(in, p, static_cast<std::size_t>(len));
    p += static_cast<std::size_t>(len) + 2;
  }
  return static_cast<long>(p);
}

class FakeRedis {
 public:
  enum class Mode { kDrop, kServe };

  explicit FakeRedis(Mode mode) : mode_(mode) {
    listen_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;  // ephemeral
    socklen_t len = sizeof a;
    if (listen_.get() < 0 || ::bind(listen_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_.get(), 64) != 0 || ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      error_ = fmt::format("fake redis: socket setup failed: {}", std::strerror(errno));
      return;
    }
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~FakeRedis() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& t : handlers_) t.join();
  }

  const std::string& error() const { return error_; }
  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port_); }
  void set_mode(Mode m) { mode_ = m; }
  // Connections closed after the client had started writing a command.
  int dropped_mid_command() const { return dropped_.load(); }

 private:
  void accept_loop() {
    while (!stop_) {
      if (!wait_readable(listen_.get(), std::chrono::milliseconds(20))) continue;
      UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (fd.get() < 0) continue;
      const Mode m = mode_.load();
      handlers_.emplace_back([this, m, f = fd.release()] {
        UniqueFd conn(f);
        if (m == Mode::kDrop)
          drop(std::move(conn));
        else
          serve(conn.get());
      });
    }
  }

  void drop(UniqueFd conn) {
    ::shutdown(conn.get(), SHUT_WR);  // FIN: the client's socket goes to CLOSE_WAIT
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!stop_ && std::chrono::steady_clock::now() < deadline) {
      if (!wait_readable(conn.get(), std::chrono::milliseconds(20))) continue;
      char buf[4096];
      const ssize_t n = ::recv(conn.get(), buf, sizeof buf, 0);  // a little; the rest stays unread
      if (n > 0) ++dropped_;
      break;  // n == 0: the client closed an idle connection (init's probe)
    }
    const linger rst{1, 0};
    ::setsockopt(conn.get(), SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
    conn.reset();  // RST while the client is mid-write
  }

  void serve(int fd) {
    std::string in;
    std::vector<char> buf(std::size_t{1} << 18);
    std::vector<std::string> args;
    while (!stop_) {
      if (!wait_readable(fd, std::chrono::milliseconds(20))) continue;
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n <= 0) return;
      in.append(buf.data(), static_cast<std::size_t>(n));
      for (;;) {
        const long used = parse_command(in, &args);
        if (used < 0) return;
        if (used == 0) break;
        in.erase(0, static_cast<std::size_t>(used));
        if (!send_all(fd, reply(args))) return;
      }
    }
  }

  std::string reply(const std::vector<std::string>& a) {
    const std::string cmd = a.empty() ? "" : a[0];
    std::lock_guard<std::mutex> lk(mu_);
    if (cmd == "AUTH") return "+OK\r\n";
    if (cmd == "PING") return "+PONG\r\n";
    if (cmd == "SET" && a.size() >= 3) {
      store_[a[1]] = a[2];
      return "+OK\r\n";
    }
    if (cmd == "GET" && a.size() == 2) {
      auto it = store_.find(a[1]);
      if (it == store_.end()) return "$-1\r\n";
      return fmt::format("${}\r\n", it->second.size()) + it->second + "\r\n";
    }
    if (cmd == "STRLEN" && a.size() == 2) {
      auto it = store_.find(a[1]);
      return fmt::format(":{}\r\n", it == store_.end() ? 0 : it->second.size());
    }
    if (cmd == "DEL" && a.size() == 2) return fmt::format(":{}\r\n", store_.erase(a[1]));
    return fmt::format("-ERR unknown command '{}'\r\n", cmd);
  }

  std::atomic<Mode> mode_;
  std::atomic<bool> stop_{false};
  std::atomic<int> dropped_{0};
  UniqueFd listen_;
  int port_ = 0;
  std::string error_;
  std::thread acceptor_;
  std::vector<std::thread> handlers_;  // only the acceptor adds; joined after it
  std::mutex mu_;
  std::map<std::string, std::string> store_;
};

class RedisSigpipeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The bug is only visible with SIGPIPE's default action (terminate) and
    // the signal deliverable: make sure neither the runner nor gtest changed it.
    struct sigaction sa {};
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    ASSERT_EQ(::sigaction(SIGPIPE, &sa, nullptr), 0);
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    ASSERT_EQ(::pthread_sigmask(SIG_UNBLOCK, &pipe, nullptr), 0);
  }

  // The backend must leave the process's SIGPIPE handling as it found it:
  // default action, not blocked in the calling thread, nothing left pending.
  static void expect_sigpipe_untouched() {
    struct sigaction sa {};
    ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &sa), 0);
    EXPECT_EQ(sa.sa_handler, SIG_DFL);
    sigset_t mask, pending;
    ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, nullptr, &mask), 0);
    EXPECT_FALSE(sigismember(&mask, SIGPIPE)) << "SIGPIPE left blocked in the caller's thread";
    ASSERT_EQ(::sigpending(&pending), 0);
    EXPECT_FALSE(sigismember(&pending, SIGPIPE)) << "SIGPIPE left pending";
  }

  static RedisBackendConfig big_password_config(const std::string& endpoint) {
    RedisBackendConfig c;
    c.endpoints = {endpoint};
    c.password.assign(kBigBytes, 'p');  // AUTH becomes a 32 MiB write
    c.mode = RedisMode::kSingle;
    c.connect_timeout = std::chrono::milliseconds(1000);
    c.command_timeout = std::chrono::milliseconds(2000);
    c.workers = 1;
    return c;
  }
};

// Worker threads: a 32 MiB put to a server that drops every connection
// mid-write, retries included. The put completes Unavailable (the process
// survives), and the same backend works once the server behaves again.
TEST_F(RedisSigpipeTest, WorkerPutToDroppingServerFailsCleanlyThenRecovers) {
  FakeRedis server(FakeRedis::Mode::kDrop);
  ASSERT_EQ(server.error(), "");
  std::vector<std::byte> value(kBigBytes);
  fill_random(value.data(), value.size(), 7);
  std::vector<std::byte> dst(kBigBytes);
  const StorageKey key = key_of(0x5151, 1);

  auto backend = make_storage_backend(
      fmt::format("redis://{}?cluster=off&timeout_ms=2000&workers=1", server.endpoint()), StorageOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  StorageBackend& b = **backend;

  auto t0 = std::chrono::steady_clock::now();
  auto put = run_batch(b, StorageBatch{StorageOp::kPut, {{key, value.data(), value.size()}}}, kOpBound);
  ASSERT_TRUE(put.ok()) << put.status().to_string();  // not TimedOut
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kOpBound);
  const Status& st = (*put)[0].status;
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_TRUE(has_substr(st.message(), server.endpoint()));
  // EPIPE is the error that comes with SIGPIPE: proves the scenario was hit.
  EXPECT_TRUE(has_substr(st.message(), "Broken pipe"));
  EXPECT_GE(server.dropped_mid_command(), 2) << "retries should reconnect and hit closed sockets too";
  EXPECT_GE(b.stats().reconnects, 2u);

  // A small command to the same dropping server fails the same clean way.
  auto get = run_batch(b, StorageBatch{StorageOp::kGet, {{key, dst.data(), dst.size()}}}, kOpBound);
  ASSERT_TRUE(get.ok()) << get.status().to_string();
  EXPECT_EQ((*get)[0].status.code(), StatusCode::kUnavailable) << (*get)[0].status.to_string();
  expect_sigpipe_untouched();

  // The server comes back: the same backend reconnects and round-trips the bytes.
  server.set_mode(FakeRedis::Mode::kServe);
  t0 = std::chrono::steady_clock::now();
  put = run_batch(b, StorageBatch{StorageOp::kPut, {{key, value.data(), value.size()}}}, kOpBound);
  ASSERT_TRUE(put.ok()) << put.status().to_string();
  ASSERT_TRUE((*put)[0].status.ok()) << (*put)[0].status.to_string();
  std::memset(dst.data(), 0xA5, dst.size());
  get = run_batch(b, StorageBatch{StorageOp::kGet, {{key, dst.data(), dst.size()}}}, kOpBound);
  ASSERT_TRUE(get.ok()) << get.status().to_string();
  ASSERT_TRUE((*get)[0].status.ok()) << (*get)[0].status.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kOpBound);
  EXPECT_EQ((*get)[0].bytes, value.size());
  EXPECT_EQ(std::memcmp(dst.data(), value.data(), value.size()), 0);
  expect_sigpipe_untouched();
}

// init() on the caller's thread: AUTH with a 32 MiB password to a dropping
// server. Creation fails with Unavailable instead of killing the process.
TEST_F(RedisSigpipeTest, CreateAgainstDroppingServerFailsCleanly) {
  FakeRedis server(FakeRedis::Mode::kDrop);
  ASSERT_EQ(server.error(), "");
  const auto t0 = std::chrono::steady_clock::now();
  auto backend = create_redis_backend(big_password_config(server.endpoint()), StorageOptions{});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kOpBound);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status().to_string();
  EXPECT_TRUE(has_substr(backend.status().message(), fmt::format("AUTH on {}", server.endpoint())));
  EXPECT_TRUE(has_substr(backend.status().message(), "Broken pipe"));
  EXPECT_GE(server.dropped_mid_command(), 1);
  expect_sigpipe_untouched();
}

// Admin commands (stored_object_bytes, corrupt_stored_object) connect and
// write on the caller's thread: with the server dropping connections they
// fail cleanly, and work again when it behaves.
TEST_F(RedisSigpipeTest, AdminCommandsOnCallerThreadFailCleanlyThenRecover) {
  FakeRedis server(FakeRedis::Mode::kServe);
  ASSERT_EQ(server.error(), "");
  std::vector<std::byte> value(4096);
  fill_random(value.data(), value.size(), 9);
  const StorageKey key = key_of(0x5152, 1);
  auto backend = create_redis_backend(big_password_config(server.endpoint()), StorageOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  StorageBackend& b = **backend;
  auto put = run_batch(b, StorageBatch{StorageOp::kPut, {{key, value.data(), value.size()}}}, kOpBound);
  ASSERT_TRUE(put.ok()) << put.status().to_string();
  ASSERT_TRUE((*put)[0].status.ok()) << (*put)[0].status.to_string();
  auto stored = b.stored_object_bytes(key);
  ASSERT_TRUE(stored.ok()) << stored.status().to_string();
  EXPECT_GT(*stored, value.size());  // header + payload

  server.set_mode(FakeRedis::Mode::kDrop);
  const auto t0 = std::chrono::steady_clock::now();
  auto bytes = b.stored_object_bytes(key);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), StatusCode::kUnavailable) << bytes.status().to_string();
  EXPECT_TRUE(has_substr(bytes.status().message(), fmt::format("AUTH on {}", server.endpoint())));
  EXPECT_TRUE(has_substr(bytes.status().message(), "Broken pipe"));
  const Status corrupt = b.corrupt_stored_object(key, 0, 1);
  EXPECT_EQ(corrupt.code(), StatusCode::kUnavailable) << corrupt.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kOpBound);
  EXPECT_GE(server.dropped_mid_command(), 2);
  expect_sigpipe_untouched();

  server.set_mode(FakeRedis::Mode::kServe);
  auto again = b.stored_object_bytes(key);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, *stored);
  expect_sigpipe_untouched();
}

}  // namespace
}  // namespace kvtier::storage
