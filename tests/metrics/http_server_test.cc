#include "kvtier/metrics/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace kvtier::metrics {
namespace {

// One request on a fresh connection; the whole response.
std::string http(std::uint16_t port, const std::string& request) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return "connect failed";
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

TEST(MetricsServer, ServesTheExposition) {
  Registry r;
  r.counter("kvtier_served_total", "h").value()->inc(7);
  auto s = MetricsServer::start(r, 0);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const std::uint16_t port = (*s)->port();
  ASSERT_NE(port, 0);
  std::string resp = http(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(resp.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << resp;
  EXPECT_NE(resp.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), std::string::npos);
  const std::string body = r.expose();
  EXPECT_NE(resp.find("Content-Length: " + std::to_string(body.size()) + "\r\n"), std::string::npos);
  EXPECT_EQ(resp.substr(resp.find("\r\n\r\n") + 4), body);
  EXPECT_NE(http(port, "GET /other HTTP/1.1\r\n\r\n").find("404"), std::string::npos);
  EXPECT_NE(http(port, "POST /metrics HTTP/1.1\r\n\r\n").find("405"), std::string::npos);
  EXPECT_NE(http(port, "garbage\r\n\r\n").find("400"), std::string::npos);
  EXPECT_EQ((*s)->requests_served(), 1u);
}

TEST(MetricsServer, StopsPromptlyAndRejectsBadHost) {
  Registry r;
  EXPECT_EQ(MetricsServer::start(r, 0, "localhost").status().code(), StatusCode::kInvalidArgument);
  auto s = MetricsServer::start(r, 0);
  ASSERT_TRUE(s.ok());
  const std::uint16_t port = (*s)->port();
  // A second server on the same port is refused with the port in the message.
  auto dup = MetricsServer::start(r, port);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find(std::to_string(port)), std::string::npos);
  // A client that connects and never sends does not hold stop() past the connection deadline.
  int idle = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(::connect(idle, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const auto t0 = std::chrono::steady_clock::now();
  (*s)->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1500));
  ::close(idle);
  (*s)->stop();  // idempotent
}

}  // namespace
}  // namespace kvtier::metrics
