// MetricsServer: one poll() over the listening socket and every open connection; each connection reads one
// request, is answered, and is closed.
#include "kvtier/metrics/http_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

namespace kvtier::metrics {

namespace {
constexpr std::size_t kMaxRequestBytes = 8192;
constexpr std::size_t kMaxConnections = 64;
constexpr int kPollMs = 100;
constexpr auto kRequestDeadline = std::chrono::seconds(2);
constexpr auto kResponseDeadline = std::chrono::seconds(10);

using Clock = std::chrono::steady_clock;

// One accepted client: its request as read so far, then the answer as sent so far.
struct Connection {
  int fd = -1;
  std::string request;
  std::string response;  // empty while the request is still being read
  std::size_t sent = 0;
  Clock::time_point deadline;
};

bool request_complete(const std::string& request) {
  return request.find("\r\n\r\n") != std::string::npos || request.size() >= kMaxRequestBytes;
}

// Reads what the socket has; false when the client closed or failed.
bool read_available(Connection& c) {
  char buf[1024];
  while (!request_complete(c.request)) {
    const ssize_t n = ::recv(c.fd, buf, std::min(sizeof buf, kMaxRequestBytes - c.request.size()), 0);
    if (n > 0) {
      c.request.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  return true;
}

// Sends what the socket takes; false when done (all sent) or the client failed.
bool write_available(Connection& c) {
  while (c.sent < c.response.size()) {
    const ssize_t n = ::send(c.fd, c.response.data() + c.sent, c.response.size() - c.sent, MSG_NOSIGNAL);
    if (n > 0) {
      c.sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  return false;
}

int poll_timeout_ms(const std::vector<Connection>& conns, Clock::time_point now) {
  auto wait = std::chrono::milliseconds(kPollMs);
  for (const Connection& c : conns) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(c.deadline - now);
    wait = std::max(std::chrono::milliseconds(0), std::min(wait, left));
  }
  return static_cast<int>(wait.count());
}

std::string response(std::string_view status, std::string_view type, std::string_view body) {
  return fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status,
                     type, body.size(), body);
}
}  // namespace

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(Registry& registry, std::uint16_t port,
                                                            const std::string& host) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1)
    return InvalidArgument(fmt::format("metrics server: host '{}' is not an IPv4 address", host));
  // Non-blocking: the loop accepts until none is left.
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Unavailable(fmt::format("metrics server: socket(): {}", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0) {
    int e = errno;
    ::close(fd);
    return Unavailable(fmt::format("metrics server: cannot listen on {}:{}: {}", host, port, std::strerror(e)));
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::unique_ptr<MetricsServer> s(new MetricsServer(registry, fd, ntohs(addr.sin_port)));
  s->thread_ = std::thread([p = s.get()] { p->loop(); });
  return s;
}

MetricsServer::MetricsServer(Registry& registry, int fd, std::uint16_t port)
    : registry_(registry), fd_(fd), port_(port) {}

MetricsServer::~MetricsServer() { stop(); }

void MetricsServer::stop() {
  stopping_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void MetricsServer::loop() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  while (!stopping_.load(std::memory_order_relaxed)) {
    fds.clear();
    fds.push_back({fd_, static_cast<short>(conns.size() < kMaxConnections ? POLLIN : 0), 0});
    for (const Connection& c : conns)
      fds.push_back({c.fd, static_cast<short>(c.response.empty() ? POLLIN : POLLOUT), 0});
    const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(conns, Clock::now()));
    if (ready < 0) {  // EINTR, or a failure that a retry may not cure: only the deadlines below, then retry
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
      fds.assign(fds.size(), pollfd{-1, 0, 0});
    }
    const auto now = Clock::now();
    for (std::size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      bool keep = now < c.deadline;
      if (keep && fds[i + 1].revents != 0) {
        if (c.response.empty()) {
          keep = read_available(c);
          if (keep && request_complete(c.request)) {
            c.response = answer(c.request);
            c.deadline = now + kResponseDeadline;
          }
        }
        if (keep && !c.response.empty()) keep = write_available(c);
      }
      if (!keep) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(conns, [](const Connection& c) { return c.fd < 0; });
    if (ready > 0 && (fds[0].revents & POLLIN) != 0) {
      while (conns.size() < kMaxConnections) {
        const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) break;  // none left (EAGAIN), or the client gave up before accept
        conns.push_back(Connection{c, {}, {}, 0, now + kRequestDeadline});
      }
    }
  }
  for (const Connection& c : conns) ::close(c.fd);
}

std::string MetricsServer::answer(std::string_view req) {
  const std::size_t line_end = req.find("\r\n");
  if (line_end == std::string_view::npos) return response("400 Bad Request", "text/plain", "bad request\n");
  const std::string_view line = req.substr(0, line_end);
  const std::size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 == std::string_view::npos ? 0 : sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos)
    return response("400 Bad Request", "text/plain", "bad request\n");
  std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const std::size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  if (method != "GET") return response("405 Method Not Allowed", "text/plain", "only GET\n");
  if (target != "/metrics") return response("404 Not Found", "text/plain", "see /metrics\n");
  served_.fetch_add(1, std::memory_order_relaxed);
  return response("200 OK", kExpositionContentType, registry_.expose());
}

}  // namespace kvtier::metrics
