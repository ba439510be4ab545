#include "transfer/event_pool.h"

#include <mutex>
#include <vector>

namespace kvtier {

struct EventPool::State : std::enable_shared_from_this<EventPool::State> {
  State(Device& d, std::size_t max) : device(d), max_free(max) {}
  Device& device;
  std::size_t max_free;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<Event>> free;
  std::size_t created = 0;

  void give_back(Event* event) noexcept {
    std::unique_ptr<Event> owned(event);
    std::lock_guard<std::mutex> lock(mu);
    if (free.size() < max_free) free.push_back(std::move(owned));
    // else: destroyed here; the owner drained the streams before dropping it.
  }
};

EventPool::EventPool(std::shared_ptr<State> state) : state_(std::move(state)) {}
EventPool::~EventPool() = default;

Result<std::unique_ptr<EventPool>> EventPool::create(Device& device, std::size_t preallocate, std::size_t max_free) {
  auto state = std::make_shared<State>(device, max_free);
  for (std::size_t i = 0; i < preallocate; ++i) {
    KVTIER_ASSIGN_OR_RETURN(auto event, device.create_event());
    state->free.push_back(std::move(event));
    ++state->created;
  }
  return std::unique_ptr<EventPool>(new EventPool(std::move(state)));
}

Result<EventLease> EventPool::acquire() {
  std::unique_ptr<Event> event;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->free.empty()) {
      event = std::move(state_->free.back());
      state_->free.pop_back();
    }
  }
  if (!event) {
    auto created = state_->device.create_event();
    if (!created.ok()) return created.status().with_context("EventPool::acquire");
    event = std::move(created).value();
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->created;
  }
  std::shared_ptr<State> keep = state_;
  return EventLease(event.release(), [keep](Event* e) { keep->give_back(e); });
}

std::size_t EventPool::created() const noexcept {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->created;
}

std::size_t EventPool::free_count() const noexcept {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->free.size();
}

}  // namespace kvtier
