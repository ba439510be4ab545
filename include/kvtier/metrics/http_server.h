// A small /metrics HTTP endpoint for the CLI, the Python package and tests: one
// thread polling the listening socket and every open connection, so a client
// that connects and sends nothing, or asks and never reads the answer, delays
// nobody else's scrape.
//
// Bounded: at most 64 connections at once (more wait in the listen backlog);
// a request is read up to 8 KiB within 2 s of the connection's accept, and its
// answer must be taken by the client within 10 s, or the connection is closed.
// Anything but "GET /metrics" gets 404 (other paths) or 405 (other methods).
// The thread wakes at least every 100 ms, so stop() (and the destructor)
// returns within about that long. Binds 127.0.0.1 unless told otherwise: the
// exposition is not authenticated.
//
// Thread-safety: start() and stop() from one owner thread; the registry is
// read on the server thread (Registry is thread-safe).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "kvtier/core/status.h"
#include "kvtier/metrics/registry.h"

namespace kvtier::metrics {

class MetricsServer {
 public:
  // Listens on host:port (port 0: an ephemeral port, see port()). InvalidArgument for a host that is
  // not an IPv4 address; Unavailable when the port cannot be bound (the message names it).
  static Result<std::unique_ptr<MetricsServer>> start(Registry& registry, std::uint16_t port,
                                                      const std::string& host = "127.0.0.1");
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  std::uint16_t port() const noexcept { return port_; }
  std::uint64_t requests_served() const noexcept { return served_.load(std::memory_order_relaxed); }
  // Stops accepting and joins the thread; idempotent.
  void stop();

 private:
  MetricsServer(Registry& registry, int fd, std::uint16_t port);
  void loop();
  // The whole HTTP response to one request's bytes (the request line decides).
  std::string answer(std::string_view request);

  Registry& registry_;
  int fd_;
  std::uint16_t port_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> served_{0};
  std::thread thread_;
};

}  // namespace kvtier::metrics
