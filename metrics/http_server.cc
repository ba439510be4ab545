// MetricsServer: poll() on the listening socket, accept, read one request, answer, close.
#include "kvtier/metrics/http_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace kvtier::metrics {

namespace {
constexpr std::size_t kMaxRequestBytes = 8192;
constexpr int kPollMs = 100;
constexpr auto kConnectionDeadline = std::chrono::seconds(2);

void send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the client went away; nothing to report to
    data.remove_prefix(static_cast<std::size_t>(n));
  }
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
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
  while (!stopping_.load(std::memory_order_relaxed)) {
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, kPollMs);
    if (r <= 0) continue;  // timeout or EINTR: check the stop flag
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    serve(c);
    ::close(c);
  }
}

void MetricsServer::serve(int c) {
  const auto deadline = std::chrono::steady_clock::now() + kConnectionDeadline;
  std::string req;
  char buf[1024];
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < kMaxRequestBytes) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || stopping_.load(std::memory_order_relaxed)) return;
    pollfd p{c, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), kPollMs))) <= 0) continue;
    ssize_t n = ::recv(c, buf, sizeof buf, 0);
    if (n <= 0) return;
    req.append(buf, static_cast<std::size_t>(n));
  }
  const std::size_t line_end = req.find("\r\n");
  if (line_end == std::string::npos) {
    send_all(c, response("400 Bad Request", "text/plain", "bad request\n"));
    return;
  }
  std::string_view line(req.data(), line_end);
  const std::size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 == std::string_view::npos ? 0 : sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos) {
    send_all(c, response("400 Bad Request", "text/plain", "bad request\n"));
    return;
  }
  std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const std::size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  if (method != "GET") {
    send_all(c, response("405 Method Not Allowed", "text/plain", "only GET\n"));
  } else if (target != "/metrics") {
    send_all(c, response("404 Not Found", "text/plain", "see /metrics\n"));
  } else {
    send_all(c, response("200 OK", kExpositionContentType, registry_.expose()));
    served_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace kvtier::metrics
