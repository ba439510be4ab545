// Publishes KV event batches over ZMQ as vLLM's ZmqEventPublisher does, so
// a subscriber written for vLLM (examples/online_serving/kv_events_subscriber.py)
// reads kvtier's events unchanged.
//
// Wire: a PUB socket sends each batch as three frames (topic, sequence number
// as 8 bytes big-endian, msgpack payload; kv_events.h). Sequence numbers count
// batches from 0. The last `buffer_steps` batches are kept: a subscriber that
// missed some sends the first sequence number it wants (8 bytes big-endian) to
// the ROUTER replay socket and gets, per buffered batch from there on, frames
// (seq, payload), then (-1 as 8 bytes, empty payload) as the end marker.
//
// libzmq is loaded at run time (libzmq.so.5): kvtier's binaries link
// everything but glibc statically, and Debian's libzmq.a needs shared-only
// libraries (GSSAPI). Without libzmq, create() returns Unavailable.
//
// Thread-safety: publish() from any thread (a bounded queue); the sockets live
// on the publisher's own thread. shutdown() (and the destructor) sends what
// is queued, for at most the given deadline, then closes the sockets; it may
// be called from several threads at once (the first shuts down, the others
// wait for it and return Ok), and flush() may run beside it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvtier/core/status.h"
#include "kvtier/metrics/kv_events.h"

namespace kvtier::metrics {

struct ZmqPublisherOptions {
  std::string endpoint = "tcp://127.0.0.1:5557";  // PUB; "tcp://127.0.0.1:*" binds an ephemeral port
  std::string replay_endpoint;                    // ROUTER; empty: no replay
  std::size_t buffer_steps = 10000;               // batches kept for replay
  std::size_t max_queue_batches = 100000;         // publish() refuses beyond (ResourceExhausted)
  std::string topic;                              // vLLM's default is empty
  std::optional<std::int64_t> data_parallel_rank;
  EventEncoding encoding = EventEncoding::kMap;  // kArray for routers written for vLLM's earlier array events
};

class ZmqEventPublisher {
 public:
  static Result<std::unique_ptr<ZmqEventPublisher>> create(ZmqPublisherOptions options);
  ~ZmqEventPublisher();
  ZmqEventPublisher(const ZmqEventPublisher&) = delete;
  ZmqEventPublisher& operator=(const ZmqEventPublisher&) = delete;

  // Queues one batch (one step's events; an empty list is not sent). Returns its sequence number.
  // ResourceExhausted when max_queue_batches are queued; FailedPrecondition after shutdown(). `events` is moved
  // from only when the batch is queued: a refused batch stays with the caller (CacheManager::return_events puts
  // events taken from a cache back), so a refusal loses nothing and uses no sequence number.
  Result<std::uint64_t> publish(std::vector<KvEvent>&& events);
  // The endpoints actually bound (ephemeral ports resolved).
  const std::string& endpoint() const noexcept;
  const std::string& replay_endpoint() const noexcept;
  // Waits until every queued batch was handed to the PUB socket; TimedOut after `timeout`.
  Status flush(std::chrono::milliseconds timeout);
  Status shutdown(std::chrono::milliseconds timeout = std::chrono::seconds(2));

  struct Impl;

 private:
  explicit ZmqEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether libzmq could be loaded (tests skip without it).
bool zmq_available() noexcept;

}  // namespace kvtier::metrics
