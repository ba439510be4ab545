// A fake Redis server on 127.0.0.1 for tests that need a server to misbehave
// on cue (no real Redis needed). Modes:
//   kDrop:  for every connection, send FIN, read the first bytes of a command,
//           then close with RST while the client is still writing (the
//           SIGPIPE scenario of redis_sigpipe_test.cc);
//   kServe: answer a small subset of Redis: AUTH, PING, SET, GET, STRLEN, DEL,
//           GETRANGE, SETRANGE, and CLUSTER SLOTS (one node owning every slot)
//           when set_cluster(true), else the error a non-cluster server gives.
// In kServe, drop_next(cmd, n) makes the next n commands named cmd close the
// connection with RST instead of being applied or answered.
#pragma once

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier::storage::testing {

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
inline bool wait_readable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) > 0;
}

inline bool send_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);  // the server must not die either
    if (n <= 0) return false;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Parses one RESP array of bulk strings (what hiredis sends) at the start of
// `in`. Returns the bytes consumed, 0 when incomplete, -1 when malformed.
inline long parse_command(const std::string& in, std::vector<std::string>* args) {
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
  // kServe: CLUSTER SLOTS answers with this server owning every slot.
  void set_cluster(bool on) {
    std::lock_guard<std::mutex> lk(mu_);
    cluster_ = on;
  }
  // kServe: the next n commands named cmd ("DEL", "CLUSTER", ...) close the
  // connection (RST) instead of being applied and answered.
  // With skip > 0, the first skip such commands are served normally first.
  void drop_next(const std::string& cmd, int n, int skip = 0) {
    std::lock_guard<std::mutex> lk(mu_);
    drops_[cmd] = {skip, n};
  }
  // kServe: the next n commands named cmd are applied, then the connection closes (RST) before the answer: a
  // reply lost to a timeout or a reset after the server did the work.
  void lose_reply_next(const std::string& cmd, int n) {
    std::lock_guard<std::mutex> lk(mu_);
    losses_[cmd] = n;
  }
  // kServe: replies to commands named cmd are sent one byte at a time, per_byte apart: a server
  // (or a network) that keeps a reply arriving, too slowly for it ever to finish in time.
  void trickle(const std::string& cmd, std::chrono::milliseconds per_byte) {
    std::lock_guard<std::mutex> lk(mu_);
    trickles_[cmd] = per_byte;
  }
  // kServe: commands named cmd get this raw RESP reply instead of their own (a server, or whatever answers on
  // its port, that replies out of spec).
  void canned_reply(const std::string& cmd, std::string raw) {
    std::lock_guard<std::mutex> lk(mu_);
    canned_[cmd] = std::move(raw);
  }
  // Reply bytes sent on every connection so far.
  std::uint64_t reply_bytes_sent() const { return reply_bytes_.load(); }
  // Commands named cmd received in kServe (dropped ones included).
  int count(const std::string& cmd) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = counts_.find(cmd);
    return it == counts_.end() ? 0 : it->second;
  }
  // Keys stored now.
  std::size_t stored_keys() {
    std::lock_guard<std::mutex> lk(mu_);
    return store_.size();
  }
  // Their names.
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    for (const auto& [k, v] : store_) out.push_back(k);
    return out;
  }
  // Stores value under key, as a SET from another client would.
  void set(const std::string& key, std::string value) {
    std::lock_guard<std::mutex> lk(mu_);
    store_[key] = std::move(value);
  }
  // The value stored under key ("" if none).
  std::string value(const std::string& key) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = store_.find(key);
    return it == store_.end() ? std::string() : it->second;
  }
  // kServe: right before the next command not named `except` is applied, key is set to value, as another client's
  // SET landing between two commands of ours would.
  void set_before_next_command_except(const std::string& except, const std::string& key, std::string value) {
    std::lock_guard<std::mutex> lk(mu_);
    interleaved_ = Interleaved{except, key, std::move(value)};
  }

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
        if (take_drop(args)) {
          const linger rst{1, 0};
          ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
          return;  // the handler's UniqueFd closes: RST, the command neither applied nor answered
        }
        const std::string out = reply(args);
        if (take_loss(args)) {
          const linger rst{1, 0};
          ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
          return;  // applied, never answered
        }
        const std::chrono::milliseconds pause = trickle_for(args);
        if (!(pause.count() > 0 ? send_slowly(fd, out, pause) : send_all(fd, out))) return;
        reply_bytes_ += out.size();
      }
    }
  }

  std::chrono::milliseconds trickle_for(const std::vector<std::string>& a) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = a.empty() ? trickles_.end() : trickles_.find(a[0]);
    return it == trickles_.end() ? std::chrono::milliseconds(0) : it->second;
  }

  // Stops when the client has gone (send fails) or the server stops.
  bool send_slowly(int fd, std::string_view s, std::chrono::milliseconds per_byte) {
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (stop_ || !send_all(fd, s.substr(i, 1))) return false;
      const auto next = std::chrono::steady_clock::now() + per_byte;
      while (!stop_ && std::chrono::steady_clock::now() < next)
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            std::chrono::milliseconds(10), next - std::chrono::steady_clock::now()));
    }
    return true;
  }

  bool take_loss(const std::vector<std::string>& a) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = a.empty() ? losses_.end() : losses_.find(a[0]);
    if (it == losses_.end() || it->second == 0) return false;
    --it->second;
    return true;
  }

  bool take_drop(const std::vector<std::string>& a) {
    std::lock_guard<std::mutex> lk(mu_);
    if (a.empty()) return false;
    ++counts_[a[0]];
    auto it = drops_.find(a[0]);
    if (it == drops_.end() || it->second.drop == 0) return false;
    if (it->second.skip > 0) {
      --it->second.skip;
      return false;
    }
    --it->second.drop;
    return true;
  }

  std::string reply(const std::vector<std::string>& a) {
    const std::string cmd = a.empty() ? "" : a[0];
    std::lock_guard<std::mutex> lk(mu_);
    if (interleaved_ && cmd != interleaved_->except) {
      store_[interleaved_->key] = std::move(interleaved_->value);
      interleaved_.reset();
    }
    if (auto canned = canned_.find(cmd); canned != canned_.end()) return canned->second;
    if (cmd == "CLUSTER" && a.size() == 2 && a[1] == "SLOTS") {
      if (!cluster_) return "-ERR This instance has cluster support disabled\r\n";
      return fmt::format("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{}\r\n", port_);
    }
    if (cmd == "GETRANGE" && a.size() == 4) {
      auto it = store_.find(a[1]);
      const long lo = std::strtol(a[2].c_str(), nullptr, 10), hi = std::strtol(a[3].c_str(), nullptr, 10);
      if (it == store_.end() || lo < 0 || hi < lo || static_cast<std::size_t>(lo) >= it->second.size())
        return "$0\r\n\r\n";
      const std::string part = it->second.substr(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo + 1));
      return fmt::format("${}\r\n", part.size()) + part + "\r\n";
    }
    if (cmd == "SETRANGE" && a.size() == 4) {
      std::string& v = store_[a[1]];
      const std::size_t off = std::strtoul(a[2].c_str(), nullptr, 10);
      if (v.size() < off + a[3].size()) v.resize(off + a[3].size(), '\0');
      v.replace(off, a[3].size(), a[3]);
      return fmt::format(":{}\r\n", v.size());
    }
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
    // The one script the Redis backend sends: delete KEYS[1] while it holds ARGV[1].
    if (cmd == "EVAL" && a.size() == 5 && a[2] == "1" &&
        a[1].find("redis.call('GETRANGE', KEYS[1], 0, -1) == ARGV[1]") != std::string::npos) {
      auto it = store_.find(a[3]);
      if (it == store_.end() || it->second != a[4]) return ":0\r\n";
      store_.erase(it);
      return ":1\r\n";
    }
    return fmt::format("-ERR unknown command '{}'\r\n", cmd);
  }

  std::atomic<Mode> mode_;
  std::atomic<bool> stop_{false};
  std::atomic<int> dropped_{0};
  std::atomic<std::uint64_t> reply_bytes_{0};
  UniqueFd listen_;
  int port_ = 0;
  std::string error_;
  std::thread acceptor_;
  std::vector<std::thread> handlers_;  // only the acceptor adds; joined after it
  std::mutex mu_;
  std::map<std::string, std::string> store_;
  struct Drops {
    int skip = 0, drop = 0;
  };
  std::map<std::string, Drops> drops_;
  std::map<std::string, int> losses_;
  std::map<std::string, int> counts_;
  std::map<std::string, std::chrono::milliseconds> trickles_;
  std::map<std::string, std::string> canned_;
  struct Interleaved {
    std::string except, key, value;
  };
  std::optional<Interleaved> interleaved_;
  bool cluster_ = false;
};

}  // namespace kvtier::storage::testing
