#include "kvtier/testing/fault_injection.h"

#include <fmt/format.h>

#include <condition_variable>
#include <list>
#include <mutex>
#include <random>
#include <thread>

namespace kvtier::storage {

struct FaultInjectingBackend::Impl {
  struct Watch {
    StorageTicket inner;
    std::shared_ptr<detail::Completion> outer;
    std::vector<std::size_t> outer_index;  // inner item i -> outer item
    std::vector<std::uint8_t> dropped;     // per inner item
    std::vector<std::uint8_t> corrupt_after_put;
    std::vector<StorageKey> keys;
    std::chrono::steady_clock::time_point posted;
  };

  StorageBackend* inner = nullptr;
  mutable std::mutex mu;
  std::condition_variable cv;
  FaultConfig config;
  FaultCounters counters;
  std::uint64_t puts = 0, gets = 0;
  std::mt19937_64 rng;
  std::list<Watch> watches;
  bool stopping = false;
  std::thread monitor;

  void corrupt(const StorageKey& key) {
    auto n = inner->stored_object_bytes(key);
    if (!n.ok() || *n == 0) return;
    std::uint64_t off;
    std::uint8_t mask;
    {
      std::lock_guard<std::mutex> lk(mu);
      off = rng() % *n;
      mask = static_cast<std::uint8_t>(1u << (rng() % 8));
      ++counters.corrupted;
    }
    inner->corrupt_stored_object(key, off, mask).ignore_error();
  }

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      if (stopping && watches.empty()) return;
      const auto now = std::chrono::steady_clock::now();
      for (auto it = watches.begin(); it != watches.end();) {
        if (!it->inner.poll() ||
            now < it->posted + (has_drop(*it) ? config.drop_timeout : std::chrono::milliseconds(0))) {
          ++it;
          continue;
        }
        Watch w = std::move(*it);
        it = watches.erase(it);
        lk.unlock();
        for (std::size_t i = 0; i < w.outer_index.size(); ++i) {
          ItemResult r = w.inner.item(i);
          if (w.dropped[i]) {
            w.outer->complete(w.outer_index[i],
                              Unavailable(fmt::format("fault injection: completion of {} dropped (timed out)",
                                                      w.keys[i].to_string())));
            continue;
          }
          if (w.corrupt_after_put[i] && r.status.ok()) corrupt(w.keys[i]);
          w.outer->complete(w.outer_index[i], r.status, r.bytes);
        }
        lk.lock();
      }
      cv.wait_for(lk, std::chrono::milliseconds(1));
    }
  }

  static bool has_drop(const Watch& w) {
    for (auto d : w.dropped)
      if (d) return true;
    return false;
  }
};

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<StorageBackend> inner, FaultConfig config)
    : StorageBackendWrapper(std::move(inner)), impl_(std::make_unique<Impl>()) {
  name_ = fmt::format("fault({})", inner_->name());
  impl_->inner = inner_.get();
  impl_->config = config;
  impl_->rng.seed(config.seed);
  impl_->monitor = std::thread([this] { impl_->run(); });
}

FaultInjectingBackend::~FaultInjectingBackend() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->monitor.join();
}

void FaultInjectingBackend::set_config(const FaultConfig& config) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->config = config;
}

FaultCounters FaultInjectingBackend::counters() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->counters;
}

Status FaultInjectingBackend::cancel(const StorageTicket& ticket) {
  if (!ticket.valid()) return InvalidArgument("cancel: invalid ticket");
  std::lock_guard<std::mutex> lk(impl_->mu);
  for (auto& w : impl_->watches)
    if (w.outer == ticket.completion()) return inner_->cancel(w.inner);
  return Status::Ok();  // finished already, or every item failed before reaching the inner backend
}

Result<StorageTicket> FaultInjectingBackend::post(StorageBatch batch) {
  // Refused whole before any fault is drawn or any key corrupted, as the backend it wraps would refuse it.
  KVTIER_RETURN_IF_ERROR(check_batch_buffers(batch));
  StorageTicket outer = StorageTicket::create(batch.op, batch.items.size());
  Impl::Watch w;
  w.outer = outer.completion();
  StorageBatch fwd;
  fwd.op = batch.op;
  std::vector<std::pair<std::size_t, Status>> immediate;
  std::vector<StorageKey> corrupt_before_get;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    const FaultConfig& c = impl_->config;
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      const std::uint64_t n = ++impl_->counters.items;
      if (offline_.load()) {
        ++impl_->counters.offline_rejected;
        immediate.emplace_back(i, Unavailable("fault injection: backend offline"));
        continue;
      }
      if ((c.fail_every_nth && n % c.fail_every_nth == 0) || (c.fail_nth && n == c.fail_nth)) {
        ++impl_->counters.failed;
        immediate.emplace_back(i, Status(c.fail_code, fmt::format("fault injection: item {} failed", n)));
        continue;
      }
      bool drop = c.drop_every_nth && n % c.drop_every_nth == 0;
      bool corrupt_put = false;
      if (batch.op == StorageOp::kPut)
        corrupt_put = c.corrupt_every_nth_put && ++impl_->puts % c.corrupt_every_nth_put == 0;
      if (batch.op == StorageOp::kGet && c.corrupt_every_nth_get && ++impl_->gets % c.corrupt_every_nth_get == 0)
        corrupt_before_get.push_back(batch.items[i].key);
      if (drop) ++impl_->counters.dropped;
      w.outer_index.push_back(i);
      w.dropped.push_back(drop);
      w.corrupt_after_put.push_back(corrupt_put);
      w.keys.push_back(batch.items[i].key);
      fwd.items.push_back(batch.items[i]);
    }
  }
  for (const StorageKey& k : corrupt_before_get) impl_->corrupt(k);
  for (auto& [i, st] : immediate) outer.completion()->complete(i, st);
  if (fwd.items.empty()) return outer;
  auto inner = inner_->post(std::move(fwd));
  if (!inner.ok()) return inner.status();
  w.inner = std::move(inner).value();
  w.posted = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->watches.push_back(std::move(w));
  }
  impl_->cv.notify_all();
  return outer;
}

}  // namespace kvtier::storage
