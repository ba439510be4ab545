// A small /metrics HTTP endpoint for the CLI and tests: one thread, a plain
// blocking accept loop that serves one connection at a time.
//
// Bounded: a request is read up to 8 KiB with a 2 s deadline per connection;
// anything but "GET /metrics" gets 404 (other paths) or 405 (other methods).
// The listening socket is polled every 100 ms, so stop() (and the destructor)
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
  void serve(int client);

  Registry& registry_;
  int fd_;
  std::uint16_t port_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> served_{0};
  std::thread thread_;
};

}  // namespace kvtier::metrics
