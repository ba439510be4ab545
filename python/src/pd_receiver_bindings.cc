// kvtier.pd.Receiver: a decode instance's P/D receives through its CacheManager and TransferManager
// (include/kvtier/pd/pd_receiver.h), for Python engines that keep their device blocks in kvtier's CacheManager.
//
// The receiver owns the plan executor that moves the cache's plans on the TransferManager (the evictions that free
// the receive blocks, and with match_prefix the loads of the servable prefix): poll() applies its completions to
// the cache before the receiver's own steps, so an engine that drives a CacheManager through a Receiver takes no
// plans of its own. Every call that touches the cache holds the cache's lock; the receiver's reporter thread
// touches only the TransferManager and the endpoint.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engine_bridge.h"
#include "kvtier/cache/transfer_executor.h"
#include "kvtier/core/deadline.h"
#include "kvtier/pd/pd_receiver.h"
#include "pd_bridge.h"
#include "status_bridge.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {
namespace {

struct PyPdReceiver {
  // Kept alive (and, for the TransferManager, kept open) while the receiver runs.
  nb::object cache_ref, transfers_ref, endpoint_ref;
  PyCacheManager* cache = nullptr;
  PyTransferManager* transfers = nullptr;
  std::shared_ptr<PdNative> endpoint;
  PyPdEndpoint* endpoint_py = nullptr;  // the object of endpoint_ref: its receivers count while this runs
  std::unique_ptr<cache::TransferPlanExecutor> executor;
  std::unique_ptr<pd::PdReceiver> receiver;
  PyCallMutex mu;  // receiver calls from Python (the scheduler's methods run one at a time)
  std::chrono::microseconds poll_interval{100};
  std::chrono::milliseconds free_timeout{10000};

  MadeInProcess made;
  ~PyPdReceiver() {
    if (made.in_child()) {
      leak_in_child(receiver);
      leak_in_child(executor);
      leak_in_child(endpoint);
      return;
    }
    close(/*collected=*/true);
    release_endpoint();  // also for a receiver whose creation failed after it counted itself
  }
  void release_endpoint() {
    if (endpoint_py != nullptr) endpoint_py->receivers.fetch_sub(1);
    endpoint_py = nullptr;
  }

  // The receiver first (its reporter thread; open receives end as Cancelled, their blocks stay declared), then
  // the executor; the TransferManager may be closed after.
  // Then what it kept alive, so that a closed receiver the program still references (a module global at exit)
  // holds no endpoint, manager or Device.
  // `collected`: from the destructor, which the garbage collector may run inside a call that holds the cache's
  // lock on this thread: the cache is then left as it is (what the receiver had not reported stays unreported).
  void close(bool collected = false) {
    auto lock = lock_gil_safe(mu);
    if (!receiver && !executor) return;
    std::shared_ptr<PdNative> ep = std::move(endpoint);
    {
      GilReleased release;  // teardown joins kvtier threads
      // Receives still open are cancelled and, once their peer can write them no more (bounded by free_timeout),
      // completed into the cache, so their blocks come back; destroyed open, they stayed declared for good.
      if (!collected && receiver) {
        receiver->cancel_open();
        const auto deadline = std::chrono::steady_clock::now() + free_timeout;
        for (;;) {
          {
            std::lock_guard cache_lock(cache->mu);
            if (executor) cache::apply_completions(*cache->cm, executor->poll()).ignore_error();
            receiver->poll().status().ignore_error();
            if (receiver->active() == 0 || std::chrono::steady_clock::now() >= deadline) break;
          }
          std::this_thread::sleep_for(poll_interval);
        }
      }
      std::unique_lock cache_lock(cache->mu, std::defer_lock);
      // Collected inside a call of the cache on this thread: try_lock on a mutex this thread holds is undefined.
      if (collected ? (!cache->mu.held_by_this_thread() && cache_lock.try_lock()) : (cache_lock.lock(), true)) {
        // What ended is completed into the cache (a receive that landed and was not polled yet was lost with the
        // receiver), and the cache's moves in flight are acked before the executor goes (unacked, they stayed in
        // flight for good).
        if (receiver) receiver->poll().status().ignore_error();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (executor) {
          cache::apply_completions(*cache->cm, executor->poll()).ignore_error();
          if (executor->in_flight() == 0 || std::chrono::steady_clock::now() >= deadline) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      receiver.reset();
      executor.reset();
      if (cache_lock.owns_lock()) cache_lock.unlock();
      ep.reset();
    }
    if (transfers != nullptr) transfers->receivers.fetch_sub(1);
    release_endpoint();
    transfers = nullptr;
    cache = nullptr;
    cache_ref.reset();
    transfers_ref.reset();
    endpoint_ref.reset();
  }

  pd::PdReceiver& get() {
    if (!receiver) raise_status(FailedPrecondition("the kvtier.pd.Receiver was closed"));
    return *receiver;
  }

  // With the GIL held, before a call that takes the receiver's or the cache's mutex with the GIL released: a call
  // made on the thread of a call of either that has not returned (a __del__ the garbage collector ran inside
  // cache.admit(), say) waited for itself forever. Refused instead, as lock_gil_safe() does.
  void refuse_reentry() const {
    made.check("the kvtier.pd.Receiver");
    if (mu.held_by_this_thread() || (cache != nullptr && cache->mu.held_by_this_thread()))
      raise_status(FailedPrecondition(
          "kvtier.pd.Receiver called on the thread of a call of it or of its CacheManager that has not returned "
          "(from a __del__ or weakref callback that the garbage collector ran inside it?): call it from outside "
          "that call"));
  }

  // Applies the executor's completed moves to the cache (under the cache's lock).
  Status apply_moves() {
    std::lock_guard lock(cache->mu);
    return cache::apply_completions(*cache->cm, executor->poll());
  }

  // A receiver call that waits (finish, drain) as tries of `slice` at most, each under the receiver's mutex and the
  // cache's lock, the caller's mutex and the GIL not held: between tries neither lock is held, so the wait keeps
  // neither the scheduler's other cache calls nor close() from another thread waiting (it held both throughout).
  // `attempt(rx, slice)` returns its status; kTimedOut means "try again" until `limit` has passed.
  template <typename Attempt>
  auto wait_in_slices(std::chrono::nanoseconds limit, Attempt attempt)
      -> decltype(attempt(std::declval<pd::PdReceiver&>(), limit)) {
    const auto deadline = deadline_after(limit);
    for (;;) {
      {
        std::lock_guard lock(mu);
        if (!receiver) return FailedPrecondition("the kvtier.pd.Receiver was closed");
        KVTIER_RETURN_IF_ERROR(apply_moves());
        std::lock_guard cache_lock(cache->mu);
        const auto now = std::chrono::steady_clock::now();
        const auto slice = std::min<std::chrono::nanoseconds>(
            poll_interval, std::max<std::chrono::nanoseconds>(deadline - now, std::chrono::nanoseconds(0)));
        auto got = attempt(*receiver, slice);
        const Status& st = status_of(got);
        if (st.code() != StatusCode::kTimedOut || std::chrono::steady_clock::now() >= deadline) return got;
      }
      // Let a thread waiting for either lock in: a yield was not enough (a mutex is not fair: this loop took the lock
      // again before the woken waiter ran, and a scheduler's cache call waited out the whole finish() on 16 cores).
      std::this_thread::sleep_for(poll_interval);
    }
  }
  static const Status& status_of(const Status& s) { return s; }
  template <typename T>
  static const Status& status_of(const Result<T>& r) {
    return r.status();
  }
};

nb::dict admission_dict(const cache::Admission& a) {
  nb::dict d;
  d["id"] = a.id;
  d["device_hit_blocks"] = a.device_hit_blocks;
  d["host_hit_blocks"] = a.host_hit_blocks;
  d["new_blocks"] = a.new_blocks;
  d["extra_blocks"] = a.extra_blocks;
  std::vector<std::int64_t> blocks(a.device_blocks.begin(), a.device_blocks.end());
  d["device_blocks"] = blocks;
  d["receive_begin"] = a.receive_begin;
  d["receive_blocks"] = a.receive_blocks;
  return d;
}

nb::dict outcome_dict(const pd::ReceiveOutcome& o) {
  nb::dict d;
  d["transfer_id"] = o.id;
  d["admission"] = o.admission;
  d["task"] = o.task;
  d["receive_blocks"] = o.receive_blocks;
  d["loaded_blocks"] = o.loaded_blocks;
  d["reclaimable"] = o.reclaimable;
  d["error"] = o.error.ok() ? nb::none() : nb::cast(o.error.to_string());
  d["transfer"] = decode_status_dict(o.transfer);
  return d;
}

std::unique_ptr<PyPdReceiver> create_receiver(nb::object cache_obj, nb::object transfers_obj, nb::object endpoint_obj,
                                              double poll_interval_s, double receive_timeout_s, double free_timeout_s) {
  if (!nb::isinstance<PyCacheManager>(cache_obj)) raise_status(InvalidArgument("cache is not a kvtier.CacheManager"));
  if (!nb::isinstance<PyTransferManager>(transfers_obj))
    raise_status(InvalidArgument("transfers is not a kvtier.TransferManager"));
  if (!nb::isinstance<PyPdEndpoint>(endpoint_obj))
    raise_status(InvalidArgument("decode is not a kvtier.pd.Decode endpoint"));
  for (auto [what, v] : {std::pair{"poll_interval", poll_interval_s}, std::pair{"receive_timeout", receive_timeout_s},
                         std::pair{"free_timeout", free_timeout_s}})
    if (!(v > 0) || v > 86400)
      raise_status(InvalidArgument(fmt::format("{} {} s: need 0 < seconds <= 86400", what, v)));
  auto out = std::make_unique<PyPdReceiver>();
  out->cache_ref = cache_obj;
  out->transfers_ref = transfers_obj;
  out->endpoint_ref = endpoint_obj;
  out->cache = &nb::cast<PyCacheManager&>(cache_obj);
  // Its plans run on the receiver's TransferPlanExecutor, which moves device <-> host blocks only: a storage move
  // failed the receive (and, unacked, stayed in flight for good).
  if (const std::uint32_t storage = out->cache->cm->config().storage_blocks; storage > 0)
    raise_status(InvalidArgument(fmt::format(
        "cache has a storage tier (storage_blocks {}): a Receiver's cache moves device <-> host blocks only",
        storage)));
  PyTransferManager& tm = nb::cast<PyTransferManager&>(transfers_obj);
  PyPdEndpoint& ep = nb::cast<PyPdEndpoint&>(endpoint_obj);
  if (ep.options.role != "decode")
    raise_status(InvalidArgument(fmt::format("endpoint '{}' is a {} endpoint; a Receiver needs a decode endpoint",
                                             ep.options.name, ep.options.role)));
  out->endpoint_py = &ep;  // counted before the endpoint is taken: a close() between the two refuses or wins
  ep.receivers.fetch_add(1);
  out->endpoint = ep.get();
  TransferManager& manager = tm.get();
  PdNative& n = *out->endpoint;
  // The endpoint's blocks must be the TransferManager's device blocks: the receiver hands the endpoint the block ids
  // the cache admitted, and the TransferManager guards the same ids.
  const BlockSpace& device = manager.device_space();
  const BlockSpace& space = n.space;
  if (space.layout().fingerprint() != device.layout().fingerprint() || space.num_blocks() != device.num_blocks() ||
      space.kind() != device.kind() || space.block_ptr(0, 0, 0) != device.block_ptr(0, 0, 0))
    raise_status(InvalidArgument(fmt::format(
        "endpoint '{}' does not move the TransferManager's device blocks ({} {} blocks of layout {} at {}; the "
        "manager has {} {} blocks of layout {} at {}): create both over the same tensors{}",
        ep.options.name, space.num_blocks(), memory_kind_name(space.kind()), space.layout().describe(),
        fmt::ptr(space.block_ptr(0, 0, 0)), device.num_blocks(), memory_kind_name(device.kind()),
        device.layout().describe(), fmt::ptr(device.block_ptr(0, 0, 0)),
        space.kind() != device.kind() ? ", the decode endpoint with device= the manager's device" : "")));
  Device& dev = nb::cast<PyDevice&>(tm.device_ref).get();
  Stream& compute = *nb::cast<PyStream&>(tm.compute_ref).stream;
  out->executor = std::make_unique<cache::TransferPlanExecutor>(manager, dev, compute, manager.device_space(),
                                                                cache::TransferPlanExecutor::Options{false, 0});
  pd::ReceiverOptions ro;
  ro.poll_interval =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::duration<double>(poll_interval_s));
  ro.receive_timeout =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(receive_timeout_s));
  ro.free_timeout =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(free_timeout_s));
  if (n.staged_decode) {
    out->receiver =
        value_or_raise(pd::PdReceiver::create(*out->cache->cm, manager, *out->executor, *n.staged_decode, ro));
  } else if (n.decode) {
    out->receiver = value_or_raise(pd::PdReceiver::create(*out->cache->cm, manager, *out->executor, *n.decode, ro));
  } else {
    raise_status(InvalidArgument(fmt::format("endpoint '{}' has no decode endpoint", ep.options.name)));
  }
  out->poll_interval = ro.poll_interval;
  out->free_timeout = ro.free_timeout;
  out->transfers = &tm;
  tm.receivers.fetch_add(1);
  return out;
}

}  // namespace

void bind_pd_receiver(nb::module_& m) {
  nb::class_<PyPdReceiver>(m, "PdReceiver",
                           "A decode instance's P/D receives through its CacheManager and TransferManager. See "
                           "kvtier.pd.Receiver and include/kvtier/pd/pd_receiver.h.")
      .def_static("create", &create_receiver, "cache"_a, "transfers"_a, "decode"_a, "poll_interval_s"_a = 1e-4,
                  "receive_timeout_s"_a = 30.0, "free_timeout_s"_a = 10.0)
      .def(
          "start",
          [](PyPdReceiver& r, std::uint32_t peer, std::uint64_t transfer_id, const std::string& mode,
             const std::vector<std::string>& keys, std::uint32_t extra_blocks, std::uint32_t received_extra_blocks,
             bool match_prefix) {
            pd::ReceiveRequest q;
            q.prefill = peer;
            q.id = transfer_id;
            q.mode = pd_mode_from(mode);
            q.keys = block_keys_from_hex(keys);
            q.options.extra_blocks = extra_blocks;
            q.options.received_extra_blocks = received_extra_blocks;
            q.options.match_prefix = match_prefix;
            r.refuse_reentry();
            auto lock = lock_gil_safe(r.mu);
            pd::PdReceiver& rx = r.get();
            pd::Receive got = value_or_raise(released([&]() -> Result<pd::Receive> {
              std::lock_guard cache_lock(r.cache->mu);
              return rx.start(q);
            }));
            nb::dict d;
            d["transfer_id"] = got.id;
            d["task"] = got.task;
            d["admission"] = admission_dict(got.admission);
            return d;
          },
          "peer"_a, "transfer_id"_a, "mode"_a, "keys"_a, "extra_blocks"_a = 0, "received_extra_blocks"_a = 0,
          "match_prefix"_a = false)
      .def("poll",
           [](PyPdReceiver& r) {
             r.refuse_reentry();
             auto lock = lock_gil_safe(r.mu);
             pd::PdReceiver& rx = r.get();
             auto outcomes = value_or_raise(released([&]() -> Result<std::vector<pd::ReceiveOutcome>> {
               KVTIER_RETURN_IF_ERROR(r.apply_moves());
               std::lock_guard cache_lock(r.cache->mu);
               return rx.poll();
             }));
             nb::list out;
             for (const auto& o : outcomes) out.append(outcome_dict(o));
             return out;
           })
      .def(
          "finish",
          [](PyPdReceiver& r, std::uint64_t transfer_id, std::optional<double> timeout_s) {
            const auto limit = to_timeout(timeout_s);
            r.refuse_reentry();
            auto o = value_or_raise(released([&]() -> Result<pd::ReceiveOutcome> {
              auto got = r.wait_in_slices(limit, [&](pd::PdReceiver& rx, std::chrono::nanoseconds slice) {
                return rx.finish(transfer_id, slice);
              });
              if (got.status().code() == StatusCode::kTimedOut)
                return TimedOut(fmt::format("PdReceiver: transfer {} not ended after {} ms", transfer_id,
                                            std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()));
              return got;
            }));
            return outcome_dict(o);
          },
          "transfer_id"_a, "timeout_s"_a = nb::none())
      .def(
          "drain",
          [](PyPdReceiver& r, std::optional<double> timeout_s) {
            const auto limit = to_timeout(timeout_s);
            r.refuse_reentry();
            check(released([&]() -> Status {
              Status st = r.wait_in_slices(
                  limit, [&](pd::PdReceiver& rx, std::chrono::nanoseconds slice) { return rx.drain(slice); });
              if (st.code() != StatusCode::kTimedOut) return st;
              // The last try's list of what is left, with the whole wait's time.
              const std::string_view m = st.message();
              const std::size_t at = m.find("still active");
              return TimedOut(fmt::format("PdReceiver: after {} ms {}",
                                          std::chrono::duration_cast<std::chrono::milliseconds>(limit).count(),
                                          at == std::string_view::npos ? m : m.substr(at)));
            }));
          },
          "timeout_s"_a = nb::none())
      // Under the receiver's mutex, as every call: close() from another thread resets the receiver under it.
      .def_prop_ro("active",
                   [](PyPdReceiver& r) {
                     auto lock = lock_gil_safe(r.mu);
                     return r.get().active();
                   })
      .def_prop_ro("quarantined",
                   [](PyPdReceiver& r) {
                     auto lock = lock_gil_safe(r.mu);
                     return r.get().quarantined();
                   })
      .def("stats",
           [](PyPdReceiver& r) {
             pd::ReceiverStats s;
             {
               auto lock = lock_gil_safe(r.mu);
               s = r.get().stats();
             }
             nb::dict d;
             d["started"] = s.started;
             d["refused"] = s.refused;
             d["completed"] = s.completed;
             d["failed"] = s.failed;
             d["committed_blocks"] = s.committed_blocks;
             d["layers_reported"] = s.layers_reported;
             d["layers_failed"] = s.layers_failed;
             d["quarantined"] = s.quarantined;
             d["reclaimed"] = s.reclaimed;
             d["timed_out"] = s.timed_out;
             return d;
           })
      .def(
          "close",
          [](PyPdReceiver& r) {
            r.refuse_reentry();
            r.close();
          },
          "Stops the receiver (idempotent). Receives still open are cancelled (they end as Cancelled at the peer) "
          "and their blocks return to the cache once the peer can no longer write them, waiting up to "
          "free_timeout_s; a receive not provably quiet by then keeps its blocks guarded for good.");
}

}  // namespace kvtier::python
