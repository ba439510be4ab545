// A private redis-server for one test: started on a free loopback port, with optional extra
// arguments (requirepass, ACL users), killed when the object goes. Tests that stop it with
// SIGSTOP do not disturb the shared test services of scripts/start-test-services.sh.
#pragma once

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::storage::testing {

class RedisServer {
 public:
  // Empty `error()` when the server answers PING within 10 s.
  explicit RedisServer(std::vector<std::string> extra_args = {}) {
    port_ = free_port();
    if (port_ <= 0) {
      error_ = "no free port";
      return;
    }
    std::vector<std::string> args = {
        "redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1", "--save",   "",
        "--appendonly", "no",     "--daemonize",         "no",     "--logfile", "/dev/null"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp("redis-server", argv.data());
      ::_exit(127);
    }
    if (pid_ < 0) {
      error_ = "fork failed";
      return;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      timeval tv{0, 200000};
      redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
      if (c && !c->err) {
        auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
        const bool up = r != nullptr;  // +PONG, or NOAUTH when a password is set: it answers
        if (r) freeReplyObject(r);
        redisFree(c);
        if (up) return;
      } else if (c) {
        redisFree(c);
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        error_ = "redis-server exited at start";
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    error_ = "redis-server did not answer PING within 10 s";
  }
  ~RedisServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  const std::string& error() const { return error_; }
  int port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  void stop() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }

 private:
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    int port = -1;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    ::close(fd);
    return port;
  }

  int port_ = -1;
  pid_t pid_ = -1;
  std::string error_;
};

}  // namespace kvtier::storage::testing
