#include "kvtier/metrics/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

namespace kvtier::metrics {
namespace {

// A connected client socket (receive buffer `rcvbuf` bytes where nonzero), or -1.
int connect_to(std::uint16_t port, int rcvbuf = 0) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (rcvbuf > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True while the server has not closed `fd` (nothing to read yet, no end of stream).
bool still_open(int fd) {
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// What follows the header of `response` ("" when it has none).
std::string body_of(const std::string& response) {
  const std::size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? std::string() : response.substr(end + 4);
}

// One request on a fresh connection; the whole response. The receive timeout only ends a hung test: the server's
// own deadlines (2 s for a request, 10 s for a response) bound what a test asserts, and rendering megabytes of
// exposition under a sanitizer on a loaded machine takes seconds.
std::string http(std::uint16_t port, const std::string& request) {
  const int fd = connect_to(port);
  if (fd < 0) return "connect failed";
  timeval tv{30, 0};
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
  EXPECT_EQ(body_of(resp), body);
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

// The server used to serve one connection at a time: each client that connected and sent nothing held every other
// scrape for its 2 s deadline. Now the scrape is answered while those clients are still connected.
TEST(MetricsServer, ClientsThatSendNothingDelayNoOtherScrape) {
  Registry r;
  r.counter("kvtier_served_total", "h").value()->inc(3);
  auto s = MetricsServer::start(r, 0);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const std::uint16_t port = (*s)->port();
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(connect_to(port));
  const int partial = connect_to(port);
  ASSERT_GE(partial, 0);
  ::send(partial, "GET /metr", 9, MSG_NOSIGNAL);
  const std::string resp = http(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(resp.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << resp;
  EXPECT_EQ(body_of(resp), r.expose());
  // Answered before any of them reached its deadline: the server has closed none of them yet.
  for (int fd : idle) {
    ASSERT_GE(fd, 0);
    EXPECT_TRUE(still_open(fd));
  }
  EXPECT_TRUE(still_open(partial));
  // The partial request, completed, is still answered.
  ::send(partial, "ics HTTP/1.1\r\n\r\n", 17, MSG_NOSIGNAL);
  timeval tv{5, 0};
  ::setsockopt(partial, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string second;
  char buf[4096];
  for (ssize_t n; (n = ::recv(partial, buf, sizeof buf, 0)) > 0;) second.append(buf, static_cast<std::size_t>(n));
  EXPECT_EQ(second.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << second;
  for (int fd : idle) ::close(fd);
  ::close(partial);
  EXPECT_EQ((*s)->requests_served(), 2u);
}

// The server used to send each answer with a blocking send(): a client that asked for an exposition larger than
// the socket buffers and never read it stopped the server (and stop()) for good.
TEST(MetricsServer, AClientThatNeverReadsItsAnswerDelaysNoOtherScrape) {
  Registry r;
  const std::string pad(120, 'x');
  for (int i = 0; i < 60000; ++i)
    ASSERT_TRUE(r.counter("kvtier_many_series_total", "h", {{"series", pad + std::to_string(i)}}).ok());
  const std::string body = r.expose();
  ASSERT_GT(body.size(), 8u << 20);  // more than loopback TCP buffers on both sides together
  auto s = MetricsServer::start(r, 0);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const std::uint16_t port = (*s)->port();
  const int stuck = connect_to(port, 4096);
  ASSERT_GE(stuck, 0);
  const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
  ::send(stuck, request.data(), request.size(), MSG_NOSIGNAL);
  // Ask until the stuck client's answer has filled what the sockets buffer (each answer is about as large).
  // Served while the stuck answer waits for its 10 s deadline: a server that waited on it would take that long.
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string resp = http(port, request);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(9));
    ASSERT_EQ(resp.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << resp.substr(0, 200);
    EXPECT_EQ(body_of(resp), body);
  }
  ::close(stuck);
  const auto t0 = std::chrono::steady_clock::now();
  (*s)->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1500));
}

}  // namespace
}  // namespace kvtier::metrics
