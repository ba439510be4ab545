// EventPool: reusable device events handed out as shared leases.
//
// Creating an event costs a driver call (and on CUDA a small allocation); the
// transfer manager needs one per loaded layer and per eviction, thousands per
// second. The pool keeps returned events and hands them out again.
//
// A lease is a std::shared_ptr<Event>: several owners (a task, the hazard
// records of the blocks it touched, a host waiter) may hold the same event;
// the event returns to the pool when the last lease is dropped. Re-recording
// a returned event is safe even if work captured by an earlier record is still
// pending: waits already enqueued keep the point they captured (CUDA event
// semantics, shared by the host backend).
//
// Lifetime: leases keep the pool's state alive, so a lease may outlive the
// EventPool object; the Device must outlive every lease. Events must not be
// destroyed while work that uses them is pending: the owner of the streams
// drains them before dropping the last leases (TransferManager::shutdown).
//
// Thread-safety: acquire() and lease release are safe from any thread.
#pragma once

#include <cstddef>
#include <memory>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"

namespace kvtier {

using EventLease = std::shared_ptr<Event>;

class EventPool {
 public:
  // `max_free`: returned events kept beyond this count are destroyed.
  static Result<std::unique_ptr<EventPool>> create(Device& device, std::size_t preallocate = 0,
                                                   std::size_t max_free = 4096);
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A free event, or a new one (ResourceExhausted / device error when the
  // backend cannot create more). Never blocks on device work.
  Result<EventLease> acquire();

  std::size_t created() const noexcept;     // events created so far
  std::size_t free_count() const noexcept;  // events waiting in the pool

  struct State;

 private:
  explicit EventPool(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvtier
