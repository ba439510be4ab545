// PdReceiver (include/kvtier/pd/pd_receiver.h): the receive steps on the scheduler thread, the per-layer
// reports and the quarantine watch on one reporter thread, one mutex over the table of receives.
#include "kvtier/pd/pd_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>

#include "kvtier/core/deadline.h"

namespace kvtier::pd {
namespace {

using Clock = std::chrono::steady_clock;
using transport::DecodeStatus;
using transport::LayerState;
using transport::TransferId;

// The two decode endpoints, as the receiver uses them.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  virtual Status start(transport::PeerId peer, TransferId id, transport::PdMode mode, std::vector<BlockId> dst) = 0;
  virtual Result<DecodeStatus> status(TransferId id) const = 0;
  virtual Status forget(TransferId id) = 0;
  virtual Status cancel(TransferId id) = 0;
};

template <class E>
class EndpointOf final : public Endpoint {
 public:
  explicit EndpointOf(E& e) : e_(e) {}
  Status start(transport::PeerId peer, TransferId id, transport::PdMode mode, std::vector<BlockId> dst) override {
    return e_.start(peer, id, mode, std::move(dst));
  }
  Result<DecodeStatus> status(TransferId id) const override { return e_.status(id); }
  Status forget(TransferId id) override { return e_.forget(id); }
  Status cancel(TransferId id) override { return e_.cancel(id); }

 private:
  E& e_;
};

struct Entry {
  Receive r;
  std::vector<BlockId> blocks;         // the receive blocks, as the TransferManager names them
  std::vector<std::uint8_t> reported;  // per layer: reported to the TransferManager
  Clock::time_point deadline;
  // Reporter thread.
  bool ended = false;        // end_external_write called
  bool quiescent = false;    // ... with quiescent: the TransferManager released the blocks then
  bool reclaimable = false;  // no byte can land any more: released on the data plane, endpoint forgot it
  bool timed_out = false;
  DecodeStatus final_status;
  KeptStatus error;
  // Scheduler thread.
  bool completed = false;         // complete_receive called (or refused)
  bool cache_quarantine = false;  // the CacheManager holds quarantined blocks of it until acked
  std::uint32_t loaded = 0;       // leading receive blocks committed
};

class Receiver final : public PdReceiver {
 public:
  Receiver(cache::CacheManager& cache, TransferManager& transfers, cache::PlanExecutor& executor,
           std::unique_ptr<Endpoint> endpoint, ReceiverOptions options)
      : cache_(cache),
        tm_(transfers),
        executor_(executor),
        ep_(std::move(endpoint)),
        options_(options),
        num_layers_(transfers.device_space().layout().num_layers()) {
    thread_ = std::thread([this] { run(); });
  }

  ~Receiver() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    // Open receives: the peer may still write their blocks, so they stay declared (fail closed).
    for (auto& [id, e] : entries_)
      if (!e.ended)
        tm_.end_external_write(e.r.task, Cancelled(fmt::format("PdReceiver destroyed while receiving transfer {}", id)),
                               /*quiescent=*/false)
            .ignore_error();
  }

  Result<Receive> start(const ReceiveRequest& req) override {
    Result<Receive> r = start_steps(req);
    std::lock_guard lock(mu_);
    starting_.erase(req.id);
    if (!r.ok()) {
      ++stats_.refused;
      return r;
    }
    Entry e;
    e.r = *r;
    e.blocks.assign(r->admission.device_blocks.begin() + r->admission.receive_begin,
                    r->admission.device_blocks.begin() + r->admission.receive_begin + r->admission.receive_blocks);
    e.reported.assign(num_layers_, 0);
    e.deadline = deadline_after(options_.receive_timeout);
    entries_.emplace(req.id, std::move(e));
    ++stats_.started;
    cv_.notify_all();
    return r;
  }

  Result<std::vector<ReceiveOutcome>> poll() override {
    std::lock_guard lock(mu_);
    complete_locked();
    std::vector<ReceiveOutcome> out;
    for (auto& [id, o] : ready_) out.push_back(std::move(o));
    ready_.clear();
    return out;
  }

  Result<ReceiveOutcome> finish(TransferId id, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      complete_locked();
      if (auto it = ready_.find(id); it != ready_.end()) {
        ReceiveOutcome o = std::move(it->second);
        ready_.erase(it);
        return o;
      }
      auto it = entries_.find(id);
      // An entry whose outcome was taken stays while its blocks are quarantined: it was reported.
      if (it == entries_.end() || it->second.completed)
        return NotFound(fmt::format("PdReceiver: transfer {} is not a receive of this receiver (or was reported)", id));
      if (Clock::now() >= deadline)
        return TimedOut(fmt::format("PdReceiver: transfer {} not ended after {} ms", id,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
      cv_.wait_until(lock, deadline, [&] { return entries_.count(id) == 0 || entries_.at(id).ended; });
    }
  }

  Status drain(std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      complete_locked();
      if (entries_.empty()) return Status::Ok();
      if (Clock::now() >= deadline) {
        std::string left;
        for (const auto& [id, e] : entries_)
          left += fmt::format("{}transfer {} ({})", left.empty() ? "" : ", ", id,
                              !e.ended         ? "receiving"
                              : !e.reclaimable ? "quarantined"
                                               : "ended");
        return TimedOut(fmt::format("PdReceiver: after {} ms still active: {}",
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(), left));
      }
      // The reporter thread notifies on every change; poll again at least every 10 ms.
      cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(10)));
    }
  }

  void cancel_open() override {
    std::vector<TransferId> open;
    {
      std::lock_guard lock(mu_);
      for (const auto& [id, e] : entries_)
        if (!e.ended) open.push_back(id);
    }
    // Outside mu_: the endpoint takes its own lock, which its progress thread holds while the reporter thread
    // may wait for mu_. A receive that ended meanwhile is final on the endpoint, where cancel changes nothing.
    for (TransferId id : open) ep_->cancel(id).ignore_error();
    cv_.notify_all();
  }

  std::size_t active() const override {
    std::lock_guard lock(mu_);
    return entries_.size();
  }
  std::size_t quarantined() const override {
    std::lock_guard lock(mu_);
    return static_cast<std::size_t>(std::count_if(
        entries_.begin(), entries_.end(), [](const auto& kv) { return kv.second.ended && !kv.second.reclaimable; }));
  }
  ReceiverStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  // Steps 1-4; on failure the earlier steps are undone (nothing was sent to the peer).
  Result<Receive> start_steps(const ReceiveRequest& req) {
    {
      std::lock_guard lock(mu_);
      if (stop_) return FailedPrecondition("PdReceiver is shutting down");
      if (entries_.count(req.id) != 0 || ready_.count(req.id) != 0 || !starting_.insert(req.id).second)
        return AlreadyExists(fmt::format("PdReceiver: transfer {} is already a receive here", req.id));
    }
    if (req.keys.empty() && req.options.received_extra_blocks == 0)
      return InvalidArgument(
          fmt::format("PdReceiver: transfer {} receives no block (no keys, no received extra blocks)", req.id));
    const std::string what = fmt::format("P/D receive of transfer {}", req.id);
    Receive r;
    r.id = req.id;
    KVTIER_ASSIGN_OR_RETURN(r.admission, wrap(cache_.admit_receive(req.keys, req.options), what + ": admit_receive"));
    const cache::AdmissionId adm = r.admission.id;
    auto undo_admission = [&](const Status& why) -> Status {
      // Nothing of the peer can land: the blocks are plain blocks again, released with the admission.
      cache_.complete_receive(adm, 0, /*reclaimable=*/true).ignore_error();
      cache_.release(adm).ignore_error();
      return why;
    };
    if (r.admission.receive_blocks == 0)
      return undo_admission(InvalidArgument(
          fmt::format("{}: every key was served from the prefix index (match_prefix); nothing to receive", what)));
    cache::StepPlan plan = cache_.take_plan();
    if (!plan.empty()) {
      Status s = executor_.execute(plan);
      if (!s.ok()) return undo_admission(s.with_context(what + ": executing the admission's plan"));
    }
    std::vector<BlockId> blocks(
        r.admission.device_blocks.begin() + r.admission.receive_begin,
        r.admission.device_blocks.begin() + r.admission.receive_begin + r.admission.receive_blocks);
    ExternalWriteOptions wo;
    wo.free_timeout = clamp_timeout(options_.free_timeout);  // milliseconds::max() overflowed in nanoseconds
    auto task = tm_.begin_external_write({}, blocks, wo);
    if (!task.ok()) return undo_admission(task.status().with_context(what + ": begin_external_write"));
    r.task = *task;
    Status s = ep_->start(req.prefill, req.id, req.mode, blocks);
    if (!s.ok()) {
      // The endpoints refuse before the request leaves (a failed send is reported in the transfer's status
      // instead): nobody can write the blocks.
      tm_.end_external_write(r.task, s, /*quiescent=*/true).ignore_error();
      // Its failure stays in the blocks' history once the write is final: they go back declared rewritten by the
      // engine's compute stream, as the blocks of a finished receive that did not land do. Left failed, the next
      // eviction of what the engine computes there failed with DataLoss (a refusal as routine as the staged pool's
      // back-pressure dropped cached blocks later).
      tm_.wait(r.task, std::chrono::seconds(5)).ignore_error();
      tm_.record_device_access(blocks, tm_.compute_stream(), TransferManager::DeviceAccess::kOverwrite).ignore_error();
      return undo_admission(s.with_context(what + ": the decode endpoint's start"));
    }
    return r;
  }

  template <class T>
  static Result<T> wrap(Result<T> r, const std::string& context) {
    if (!r.ok()) return r.status().with_context(context);
    return r;
  }

  // ---- reporter thread ----------------------------------------------------------------------------------

  void run() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      bool watching = false;
      for (auto& [id, e] : entries_) {
        if (!e.ended) step_receiving(id, e, Clock::now());
        if (e.ended && !e.reclaimable) step_quarantined(id, e);
        watching = watching || !e.reclaimable;
      }
      // Idle: start() and the destructor notify; the bound only keeps every wait finite.
      cv_.wait_for(lock, watching ? std::min<std::chrono::nanoseconds>(clamp_timeout(options_.poll_interval),
                                                                       std::chrono::milliseconds(50))
                                  : std::chrono::nanoseconds(std::chrono::milliseconds(50)));
    }
  }

  void report(Entry& e, std::uint32_t layer, std::span<const BlockId> failed) {
    Status s = tm_.complete_external_layer(e.r.task, layer, failed);
    e.reported[layer] = 1;
    ++stats_.layers_reported;
    if (!failed.empty()) ++stats_.layers_failed;
    if (!s.ok() && e.error.ok()) e.error = s.with_context(fmt::format("transfer {} layer {} report", e.r.id, layer));
  }

  void step_receiving(TransferId id, Entry& e, Clock::time_point now) {
    auto st = ep_->status(id);
    if (!st.ok()) {
      end(e, st.status().with_context(fmt::format("transfer {}", id)), /*quiescent=*/false);
      return;
    }
    const std::uint32_t layers = std::min<std::uint32_t>(num_layers_, static_cast<std::uint32_t>(st->layers.size()));
    for (std::uint32_t l = 0; l < layers; ++l) {
      if (e.reported[l] != 0) continue;
      if (st->layers[l] == LayerState::kLoaded) report(e, l, {});
      if (st->layers[l] == LayerState::kFailed) report(e, l, e.blocks);
      if (st->layers[l] == LayerState::kPartial && !st->layer_block_loaded.empty()) {
        // The endpoint says which blocks of the layer arrived: the others fail now, not at the end.
        std::vector<BlockId> failed;
        for (std::size_t i = 0; i < e.blocks.size(); ++i)
          if (!st->layer_block_is_loaded(l, i)) failed.push_back(e.blocks[i]);
        report(e, l, failed);
      }
    }
    if (st->final) {
      std::vector<BlockId> not_loaded;
      for (std::size_t i = 0; i < e.blocks.size(); ++i)
        if (i >= st->block_loaded.size() || !st->block_loaded[i]) not_loaded.push_back(e.blocks[i]);
      for (std::uint32_t l = 0; l < num_layers_; ++l)
        if (e.reported[l] == 0) report(e, l, not_loaded.empty() ? std::span<const BlockId>(e.blocks) : not_loaded);
      e.final_status = *st;
      if (e.error.ok()) e.error = st->error;
      end(e, st->error, st->reclaimable);
      if (st->reclaimable) reclaimed(id, e);
      return;
    }
    if (now >= e.deadline) {
      ++stats_.timed_out;
      e.timed_out = true;
      // The endpoint gives up too (its prefill is told and proves its writes over): without it a prefill that is
      // alive but never began kept the transfer, and the blocks, pending for good.
      ep_->cancel(id).ignore_error();
      end(e,
          TimedOut(fmt::format("transfer {} not final after the receive timeout ({} ms)", id,
                               options_.receive_timeout.count())),
          /*quiescent=*/false);
    }
  }

  void end(Entry& e, const Status& why, bool quiescent) {
    why.ignore_error();  // the entry reports its first failure; a later one goes here
    if (e.error.ok()) e.error = why;
    tm_.end_external_write(e.r.task, why, quiescent).ignore_error();
    e.ended = true;
    e.quiescent = quiescent;
    if (!quiescent) ++stats_.quarantined;
    cv_.notify_all();
  }

  void step_quarantined(TransferId id, Entry& e) {
    auto st = ep_->status(id);
    if (!st.ok() || !st->final || !st->reclaimable) return;  // unknown to the endpoint: stays quarantined
    if (!e.quiescent) {
      Status s = tm_.release_external_write(e.r.task);
      // NotFound: every block was released at the end already (each landed in every layer).
      if (!s.ok() && s.code() != StatusCode::kNotFound && e.error.ok()) e.error = s;
    }
    ++stats_.reclaimed;
    reclaimed(id, e);
  }

  void reclaimed(TransferId id, Entry& e) {
    ep_->forget(id).ignore_error();
    e.reclaimable = true;
    cv_.notify_all();
  }

  // ---- scheduler thread, mu_ held ----------------------------------------------------------------------

  void complete_locked() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      const TransferId id = it->first;
      Entry& e = it->second;
      if (e.ended && !e.completed) {
        ReceiveOutcome o;
        o.id = id;
        o.admission = e.r.admission.id;
        o.task = e.r.task;
        o.receive_blocks = e.r.admission.receive_blocks;
        o.loaded_blocks = e.timed_out ? 0 : std::min(e.final_status.leading_loaded_blocks(), o.receive_blocks);
        o.reclaimable = e.reclaimable;
        o.error = e.error;
        o.transfer = e.final_status;
        Status s = cache_.complete_receive(o.admission, o.loaded_blocks, o.reclaimable);
        if (s.ok()) {
          e.cache_quarantine = !o.reclaimable && o.loaded_blocks < o.receive_blocks;
          stats_.committed_blocks += o.loaded_blocks;
        } else {
          // Released while receiving (FailedPrecondition): every receive block is quarantined, none committed.
          e.cache_quarantine = s.code() == StatusCode::kFailedPrecondition;
          o.loaded_blocks = 0;
          o.error = s.with_context(fmt::format("transfer {}: complete_receive", id));
        }
        e.completed = true;
        e.loaded = o.loaded_blocks;
        if (o.error.ok() && o.loaded_blocks == o.receive_blocks)
          ++stats_.completed;
        else
          ++stats_.failed;
        ready_.emplace(id, std::move(o));
      }
      if (e.completed && e.reclaimable) {
        // The blocks that did not land go back to the engine (to recompute) or the pool, for new bytes of its
        // compute: the data plane forgets the receive's failure in them, which would fail the eviction of what
        // the engine computes there and commits (its forward declares no access of its own).
        if (e.loaded < e.blocks.size())
          tm_.record_device_access(std::span<const BlockId>(e.blocks).subspan(e.loaded), tm_.compute_stream(),
                                   TransferManager::DeviceAccess::kOverwrite)
              .ignore_error();
        if (e.cache_quarantine) cache_.ack_receive_reclaimable(e.r.admission.id).ignore_error();
        it = entries_.erase(it);
        continue;
      }
      ++it;
    }
  }

  cache::CacheManager& cache_;
  TransferManager& tm_;
  cache::PlanExecutor& executor_;
  std::unique_ptr<Endpoint> ep_;
  const ReceiverOptions options_;
  const std::uint32_t num_layers_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<TransferId, Entry> entries_;
  std::set<TransferId> starting_;
  std::map<TransferId, ReceiveOutcome> ready_;
  ReceiverStats stats_;
  std::thread thread_;
};

Status check_options(const cache::CacheManager& cache, const TransferManager& transfers,
                     const ReceiverOptions& options) {
  if (options.poll_interval.count() <= 0)
    return InvalidArgument(
        fmt::format("ReceiverOptions::poll_interval must be > 0, got {} us", options.poll_interval.count()));
  if (options.receive_timeout.count() <= 0)
    return InvalidArgument(
        fmt::format("ReceiverOptions::receive_timeout must be > 0, got {} ms", options.receive_timeout.count()));
  if (options.free_timeout.count() <= 0)
    return InvalidArgument(
        fmt::format("ReceiverOptions::free_timeout must be > 0, got {} ms", options.free_timeout.count()));
  if (cache.config().device_blocks > transfers.device_space().num_blocks())
    return InvalidArgument(fmt::format(
        "the CacheManager's device_blocks ({}) exceed the TransferManager's device blocks ({}): not the same cache",
        cache.config().device_blocks, transfers.device_space().num_blocks()));
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<PdReceiver>> PdReceiver::create(cache::CacheManager& cache, TransferManager& transfers,
                                                       cache::PlanExecutor& executor, transport::PdDecode& endpoint,
                                                       ReceiverOptions options) {
  KVTIER_RETURN_IF_ERROR(check_options(cache, transfers, options));
  return std::unique_ptr<PdReceiver>(std::make_unique<Receiver>(
      cache, transfers, executor, std::make_unique<EndpointOf<transport::PdDecode>>(endpoint), options));
}

Result<std::unique_ptr<PdReceiver>> PdReceiver::create(cache::CacheManager& cache, TransferManager& transfers,
                                                       cache::PlanExecutor& executor,
                                                       transport::PdStagedDecode& endpoint, ReceiverOptions options) {
  KVTIER_RETURN_IF_ERROR(check_options(cache, transfers, options));
  return std::unique_ptr<PdReceiver>(std::make_unique<Receiver>(
      cache, transfers, executor, std::make_unique<EndpointOf<transport::PdStagedDecode>>(endpoint), options));
}

}  // namespace kvtier::pd
