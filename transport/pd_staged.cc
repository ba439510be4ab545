// The staged prefill/decode path (include/kvtier/transport/pd_staged.h): device blocks moved through pinned
// staging blocks with the CopyEngine, the PD protocol of pd.cc between the staging spaces.
#include "kvtier/transport/pd_staged.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include "kvtier/core/deadline.h"
#include "kvtier/core/log.h"

namespace kvtier::transport {

Result<StagingSpace> StagingSpace::allocate(Device& device, const KvLayout& layout, std::uint64_t num_blocks,
                                            Transport* transport) {
  if (num_blocks == 0) return InvalidArgument("staging space: num_blocks is 0");
  if (num_blocks > std::uint64_t{kMaxBlockId} + 1)
    return InvalidArgument(fmt::format("staging space of {} blocks: block ids hold at most {}", num_blocks,
                                       std::uint64_t{kMaxBlockId} + 1));
  std::uint64_t total = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const std::uint64_t bytes = BlockSpace::layer_first_region_bytes(layout, l, r, num_blocks);
      if (bytes / num_blocks < layout.block_bytes(l, r) || total + bytes < total)
        return InvalidArgument(fmt::format("staging space of {} blocks of {} layers: its bytes overflow 64 bits",
                                           num_blocks, layout.num_layers()));
      total += bytes;
    }
  StagingSpace s;
  if (transport != nullptr) {
    KVTIER_ASSIGN_OR_RETURN(std::span<std::byte> host, transport->allocate_host(total));
    KVTIER_ASSIGN_OR_RETURN(s.memory, device.register_host(host.data(), host.size()));
  } else {
    KVTIER_ASSIGN_OR_RETURN(s.memory, device.allocate_pinned(total));
  }
  KVTIER_RETURN_IF_ERROR(s.memory->wait_ready(std::chrono::minutes(1)));
  std::vector<std::vector<void*>> bases(layout.num_layers());
  std::uint64_t off = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      bases[l].push_back(s.memory->data() + off);
      off += BlockSpace::layer_first_region_bytes(layout, l, r, num_blocks);
    }
  KVTIER_ASSIGN_OR_RETURN(s.space, BlockSpace::layer_first(MemoryKind::kPinnedHost, device.ordinal(), layout,
                                                           num_blocks, std::move(bases)));
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;

Status check_spaces(std::string_view role, const Device& device, const BlockSpace& dev, const BlockSpace& staging) {
  if (staging.kind() != MemoryKind::kPinnedHost)
    return InvalidArgument(
        fmt::format("{}: staging space is {} memory, must be pinned host", role, memory_kind_name(staging.kind())));
  if (dev.num_blocks() == 0) return InvalidArgument(fmt::format("{}: device block space has no blocks", role));
  if (dev.layout().fingerprint() != staging.layout().fingerprint())
    return InvalidArgument(fmt::format("{}: device layout fingerprint {:#018x} != staging layout fingerprint {:#018x}",
                                       role, dev.layout().fingerprint(), staging.layout().fingerprint()));
  if (dev.kind() == MemoryKind::kDevice && dev.device_ordinal() != device.ordinal())
    return InvalidArgument(fmt::format("{}: device blocks on device {}, the endpoint's device is {}", role,
                                       dev.device_ordinal(), device.ordinal()));
  return Status::Ok();
}

// Free staging block ids (the caller holds the endpoint's lock).
class StagingPool {
 public:
  // `n`: the staging space's num_blocks (at most INT32_MAX, BlockSpace::make).
  explicit StagingPool(std::uint64_t n) : total_(n) {
    for (std::uint64_t i = n; i > 0; --i) free_.push_back(static_cast<BlockId>(i - 1));
  }
  Result<std::vector<BlockId>> take(std::size_t n) {
    // More than the whole pool is no back-pressure (no forget() makes room for it): refused as the caller's.
    if (n > total_)
      return InvalidArgument(
          fmt::format("staging pool: {} blocks asked, the pool holds {} in all (a transfer must "
                      "fit the staging space)",
                      n, total_));
    if (n > free_.size())
      return ResourceExhausted(fmt::format("staging pool: {} blocks asked, {} free", n, free_.size()));
    std::vector<BlockId> out(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
    free_.resize(free_.size() - n);
    return out;
  }
  void give(const std::vector<BlockId>& ids) { free_.insert(free_.end(), ids.begin(), ids.end()); }
  std::uint64_t free() const { return free_.size(); }

 private:
  std::uint64_t total_ = 0;
  std::vector<BlockId> free_;
};

Status check_ids(std::span<const BlockId> ids, const BlockSpace& space, std::string_view what) {
  if (ids.empty()) return InvalidArgument(fmt::format("{} list is empty", what));
  std::set<BlockId> seen;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= space.num_blocks())
      return OutOfRange(
          fmt::format("block id {} >= num_blocks {} in {} list at index {}", ids[i], space.num_blocks(), what, i));
    if (!seen.insert(ids[i]).second)
      return InvalidArgument(fmt::format("block id {} repeated in {} list at index {}", ids[i], what, i));
  }
  return Status::Ok();
}

// A stream whose work failed stays failed (CUDA's errors are sticky, and the host backend models that): later
// transfers' copies go on a fresh one; the failed one is kept in `retired` until the endpoint ends (work still on
// it reports the failure through its events). Caller holds the endpoint's lock.
void renew_if_failed(Device& device, std::unique_ptr<Stream>& stream, std::vector<std::unique_ptr<Stream>>& retired,
                     std::string_view name) {
  if (!stream || device.query(*stream).ok()) return;
  auto fresh = device.create_stream({StreamPriority::kHigh, std::string(name)});
  if (!fresh.ok()) return;  // the next copy fails and says why
  retired.push_back(std::move(stream));
  stream = std::move(fresh).value();
}

// ---- prefill --------------------------------------------------------------------------------------------

class StagedPrefill final : public PdStagedPrefill {
 public:
  StagedPrefill(Device& device, CopyEngine& engine, BlockSpace dev, BlockSpace staging, StagedOptions options)
      : device_(device),
        engine_(engine),
        dev_(std::move(dev)),
        staging_(std::move(staging)),
        options_(options),
        pool_(staging_.num_blocks()) {}

  ~StagedPrefill() override {
    // The PD endpoint first (it polls our events), then the copies drain before the events go.
    pd_.reset();
    if (stream_) device_.synchronize(*stream_, std::chrono::seconds(30)).ignore_error();
    for (auto& r : retired_) device_.synchronize(*r, std::chrono::seconds(30)).ignore_error();
  }

  Status init(Transport& t) {
    KVTIER_RETURN_IF_ERROR(check_spaces("staged prefill", device_, dev_, staging_));
    if (options_.poll_interval.count() <= 0)  // wait() sleeps it between looks: 0 was a busy loop
      return InvalidArgument(
          fmt::format("staged prefill: poll_interval {} us must be > 0", options_.poll_interval.count()));
    KVTIER_ASSIGN_OR_RETURN(stream_, device_.create_stream({StreamPriority::kHigh, "pd-stage-d2h"}));
    KVTIER_ASSIGN_OR_RETURN(pd_, PdPrefill::create(t, staging_, options_.pd));
    return Status::Ok();
  }

  Status begin(PeerId decode, TransferId id, std::vector<BlockId> src_blocks) override {
    KVTIER_RETURN_IF_ERROR(check_ids(src_blocks, dev_, "source"));
    std::lock_guard lock(mu_);
    if (xfers_.count(id) != 0) return AlreadyExists(fmt::format("transfer {} exists", id));
    KVTIER_ASSIGN_OR_RETURN(auto staged, pool_.take(src_blocks.size()));
    Status s = pd_->begin(decode, id, staged);
    if (!s.ok()) {
      pool_.give(staged);
      return s;
    }
    X& x = xfers_[id];
    x.src = std::move(src_blocks);
    x.staging = std::move(staged);
    x.events.resize(dev_.layout().num_layers());
    return Status::Ok();
  }

  Status layer_ready_after(TransferId id, std::uint32_t layer, Event& compute_done) override {
    return stage(id, layer, &compute_done);
  }
  Status layer_ready(TransferId id, std::uint32_t layer) override { return stage(id, layer, nullptr); }

  Status layers_ready(TransferId id, std::span<const std::uint32_t> layers) override {
    {
      std::lock_guard lock(mu_);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      const X& x = it->second;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] >= x.events.size())
          return OutOfRange(fmt::format("layers[{}] = {} >= num_layers {}", i, layers[i], x.events.size()));
        if (x.events[layers[i]])
          return AlreadyExists(fmt::format("transfer {} layer {} already declared ready", id, layers[i]));
        if (std::find(layers.begin(), layers.begin() + static_cast<std::ptrdiff_t>(i), layers[i]) !=
            layers.begin() + static_cast<std::ptrdiff_t>(i))
          return AlreadyExists(fmt::format("layers[{}] = {} is listed twice", i, layers[i]));
      }
    }
    // Checked above; only a failure of the copy's enqueue can stop it from here (that layer then fails on the wire).
    for (std::uint32_t l : layers) KVTIER_RETURN_IF_ERROR(stage(id, l, nullptr));
    return Status::Ok();
  }

  Result<PrefillStatus> status(TransferId id) const override {
    std::lock_guard lock(mu_);
    return summarize(id);
  }

  void abort_waits() override { pd_->abort_waits(); }
  Status disconnect_peer(PeerId peer) override { return pd_->disconnect_peer(peer); }

  Result<PrefillStatus> wait(TransferId id, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
      auto s = pd_->wait(id, std::max(left, std::chrono::nanoseconds(0)));
      if (!s.ok()) return s.status();
      {
        std::lock_guard lock(mu_);
        auto mine = summarize(id);
        if (!mine.ok() || mine->reclaimable) return mine;
      }
      if (Clock::now() >= deadline)
        return TimedOut(fmt::format("staged prefill transfer {}: staging copies not complete after {} ms", id,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
      // No longer than the time left (a poll interval past the deadline was an overshoot).
      const auto rest = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
      std::this_thread::sleep_for(std::clamp<std::chrono::nanoseconds>(
          rest, std::chrono::nanoseconds(0),
          std::max<std::chrono::nanoseconds>(clamp_timeout(options_.poll_interval), std::chrono::microseconds(1))));
    }
  }

  Status forget(TransferId id) override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    KVTIER_ASSIGN_OR_RETURN(PrefillStatus s, summarize(id));
    if (!s.final || !s.reclaimable)
      return FailedPrecondition(fmt::format("staged prefill transfer {} is not final and reclaimable", id));
    // After pd_->forget no ready function of this transfer runs again: its events may go.
    KVTIER_RETURN_IF_ERROR(pd_->forget(id));
    pool_.give(it->second.staging);
    xfers_.erase(it);
    return Status::Ok();
  }

  std::uint64_t staging_blocks_free() const override {
    std::lock_guard lock(mu_);
    return pool_.free();
  }

 private:
  struct X {
    std::vector<BlockId> src;
    std::vector<BlockId> staging;
    std::vector<std::unique_ptr<Event>> events;  // per layer, recorded behind its staging copy
  };

  Status stage(TransferId id, std::uint32_t layer, Event* after) {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    X& x = it->second;
    if (layer >= x.events.size()) return OutOfRange(fmt::format("layer {} >= num_layers {}", layer, x.events.size()));
    if (x.events[layer]) return AlreadyExists(fmt::format("transfer {} layer {} already declared ready", id, layer));
    KVTIER_ASSIGN_OR_RETURN(auto ev, device_.create_event());
    renew_if_failed(device_, stream_, retired_, "pd-stage-d2h");  // an earlier copy failed on it (sticky)
    if (after != nullptr) KVTIER_RETURN_IF_ERROR(device_.wait(*stream_, *after));
    const std::uint32_t layers[1] = {layer};
    CopyRequest req;
    req.src = &dev_;
    req.dst = &staging_;
    req.src_blocks = x.src;
    req.dst_blocks = x.staging;
    req.layers = layers;
    req.strategy = options_.strategy;
    auto copied = engine_.copy(req, *stream_);
    Status recorded = copied.ok() ? device_.record(*ev, *stream_) : copied.status();
    Event* e = ev.get();
    x.events[layer] = std::move(ev);
    if (!recorded.ok()) {
      // The PD endpoint learns it as a failed layer (the decode side's blocks of it are failed).
      const Status why = recorded.with_context(fmt::format("layer {} staging copy", layer));
      return pd_->layer_ready(id, layer, [why]() -> Result<bool> { return why; });
    }
    return pd_->layer_ready(id, layer, [this, e]() { return device_.query(*e); });
  }

  // Caller holds mu_.
  Result<PrefillStatus> summarize(TransferId id) const {
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    KVTIER_ASSIGN_OR_RETURN(PrefillStatus s, pd_->status(id));
    for (const auto& e : it->second.events) {
      if (!e) continue;
      auto q = device_.query(*e);
      if (q.ok() && !*q) s.reclaimable = false;  // an error is a completed (failed) copy
    }
    return s;
  }

  Device& device_;
  CopyEngine& engine_;
  const BlockSpace dev_;
  const BlockSpace staging_;
  const StagedOptions options_;
  mutable std::mutex mu_;
  StagingPool pool_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::unique_ptr<Stream>> retired_;  // failed streams (renew_if_failed)
  std::map<TransferId, X> xfers_;
  std::unique_ptr<PdPrefill> pd_;  // last member: destroyed first
};

// ---- decode ---------------------------------------------------------------------------------------------

class StagedDecode final : public PdStagedDecode {
 public:
  StagedDecode(Device& device, CopyEngine& engine, BlockSpace dev, BlockSpace staging, StagedOptions options)
      : device_(device),
        engine_(engine),
        dev_(std::move(dev)),
        staging_(std::move(staging)),
        options_(options),
        pool_(staging_.num_blocks()) {}

  ~StagedDecode() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    pd_.reset();
    if (stream_) device_.synchronize(*stream_, std::chrono::seconds(30)).ignore_error();
    for (auto& r : retired_) device_.synchronize(*r, std::chrono::seconds(30)).ignore_error();
  }

  Status init(Transport& t) {
    KVTIER_RETURN_IF_ERROR(check_spaces("staged decode", device_, dev_, staging_));
    if (options_.poll_interval.count() <= 0)
      return InvalidArgument(
          fmt::format("staged decode: poll_interval {} us must be > 0", options_.poll_interval.count()));
    KVTIER_ASSIGN_OR_RETURN(stream_, device_.create_stream({StreamPriority::kHigh, "pd-stage-h2d"}));
    KVTIER_ASSIGN_OR_RETURN(pd_, PdDecode::create(t, staging_, options_.pd));
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (const std::exception& e) {
      return Internal(fmt::format("staged decode: progress thread: {}", e.what()));
    }
    return Status::Ok();
  }

  Status start(PeerId prefill, TransferId id, PdMode mode, std::vector<BlockId> dst_blocks) override {
    KVTIER_RETURN_IF_ERROR(check_ids(dst_blocks, dev_, "destination"));
    std::lock_guard lock(mu_);
    if (xfers_.count(id) != 0) return AlreadyExists(fmt::format("transfer {} exists", id));
    // A block another transfer not forgotten yet may still write or report as loaded (PdDecode::start refuses
    // that for its own blocks, which here are staging blocks: the device destinations are checked here).
    for (std::size_t i = 0; i < dst_blocks.size(); ++i)
      if (auto owner = dst_owner_.find(dst_blocks[i]); owner != dst_owner_.end())
        return FailedPrecondition(fmt::format(
            "destination block {} at index {} belongs to transfer {}, not forgotten yet: forget it (when final "
            "and reclaimable) before starting transfer {} into that block",
            dst_blocks[i], i, owner->second, id));
    KVTIER_ASSIGN_OR_RETURN(auto staged, pool_.take(dst_blocks.size()));
    std::vector<L> layers(dev_.layout().num_layers());
    for (L& l : layers) {
      auto ev = device_.create_event();
      if (!ev.ok()) {
        pool_.give(staged);
        return ev.status();
      }
      l.event = std::move(ev).value();
    }
    // Validates the destination ids (distinct) as PdDecode would, before any staging block is in use.
    Status s = pd_->start(prefill, id, mode, staged);
    if (!s.ok()) {
      pool_.give(staged);
      return s;
    }
    for (BlockId b : dst_blocks) dst_owner_.emplace(b, id);
    X& x = xfers_[id];
    x.dst = std::move(dst_blocks);
    x.staging = std::move(staged);
    x.layers = std::move(layers);
    cv_.notify_all();
    return Status::Ok();
  }

  void abort_waits() override {
    {
      std::lock_guard lock(mu_);
      waits_aborted_ = true;
    }
    cv_.notify_all();
  }
  Status disconnect_peer(PeerId peer) override { return pd_->disconnect_peer(peer); }
  static Status waits_aborted(TransferId id) {
    return FailedPrecondition(
        fmt::format("staged decode: the endpoint is closing; transfer {} is no longer waited for", id));
  }

  Result<Event*> layer_event(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      KVTIER_ASSIGN_OR_RETURN(L * l, find_layer(id, layer));
      if (l->phase != Phase::kWire) {
        if (l->enqueued) return l->event.get();
        return l->error.ok() ? Status(Unavailable(fmt::format("transfer {} layer {} failed", id, layer))) : l->error;
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("transfer {} layer {} not in the staging space after {} ms", id, layer,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  Result<LayerState> wait_layer(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      KVTIER_ASSIGN_OR_RETURN(L * l, find_layer(id, layer));
      if (l->phase == Phase::kFinal) return l->state;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("transfer {} layer {} not in device memory after {} ms", id, layer,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  Result<DecodeStatus> status(TransferId id) const override {
    std::lock_guard lock(mu_);
    return summarize(id);
  }

  Result<DecodeStatus> wait(TransferId id, std::chrono::nanoseconds timeout, bool reclaimable) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      KVTIER_ASSIGN_OR_RETURN(DecodeStatus s, summarize(id));
      if (s.final && (!reclaimable || s.reclaimable)) return s;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("staged decode transfer {}: not {} after {} ms", id,
                                    reclaimable ? "reclaimable" : "final",
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  Status cancel(TransferId id) override {
    {
      std::lock_guard lock(mu_);
      if (xfers_.count(id) == 0) return NotFound(fmt::format("transfer {} is unknown", id));
    }
    return pd_->cancel(id);  // the layers fail on the wire; this side's copies follow them (advance)
  }

  Status forget(TransferId id) override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    KVTIER_ASSIGN_OR_RETURN(DecodeStatus s, summarize(id));
    if (!s.final || !s.reclaimable)
      return FailedPrecondition(fmt::format("staged decode transfer {} is not final and reclaimable", id));
    KVTIER_RETURN_IF_ERROR(pd_->forget(id));
    pool_.give(it->second.staging);
    for (BlockId b : it->second.dst) dst_owner_.erase(b);
    xfers_.erase(it);
    return Status::Ok();
  }

  std::uint64_t staging_blocks_free() const override {
    std::lock_guard lock(mu_);
    return pool_.free();
  }

 private:
  enum class Phase : std::uint8_t { kWire, kCopying, kFinal };
  struct L {
    Phase phase = Phase::kWire;
    LayerState wire = LayerState::kPending;   // what the PD endpoint reported
    LayerState state = LayerState::kPending;  // final state in device memory
    bool enqueued = false;                    // the staging -> device copy is on the stream
    std::unique_ptr<Event> event;             // recorded behind that copy
    KeptStatus error;
    KeptStatus enqueue_error;  // the copy failed while being queued: the layer fails once what was queued is over
  };
  struct X {
    std::vector<BlockId> dst;
    std::vector<BlockId> staging;
    std::vector<L> layers;
    KeptStatus copy_error;
  };

  Result<L*> find_layer(TransferId id, std::uint32_t layer) {
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    if (layer >= it->second.layers.size())
      return OutOfRange(fmt::format("layer {} >= num_layers {}", layer, it->second.layers.size()));
    return &it->second.layers[layer];
  }

  // Caller holds mu_.
  Result<DecodeStatus> summarize(TransferId id) const {
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    const X& x = it->second;
    KVTIER_ASSIGN_OR_RETURN(DecodeStatus s, pd_->status(id));
    bool all_final = true, copies_ok = true;
    for (std::size_t l = 0; l < x.layers.size(); ++l) {
      s.layers[l] = x.layers[l].phase == Phase::kFinal ? x.layers[l].state : LayerState::kPending;
      all_final = all_final && x.layers[l].phase == Phase::kFinal;
      // A layer whose copy failed loads no block; one failed on the wire is already so in block_loaded.
      copies_ok = copies_ok && !(x.layers[l].phase == Phase::kFinal && x.layers[l].wire != LayerState::kFailed &&
                                 x.layers[l].state == LayerState::kFailed);
    }
    // Until a layer is in device memory no block of it is loaded there; a failed copy loads none.
    const std::size_t n = s.block_loaded.size();
    for (std::size_t l = 0; l < x.layers.size(); ++l)
      if (x.layers[l].phase != Phase::kFinal || x.layers[l].state == LayerState::kFailed)
        for (std::size_t i = 0; i < n && l * n + i < s.layer_block_loaded.size(); ++i)
          s.layer_block_loaded[l * n + i] = 0;
    // Until a layer is in device memory no block containing it is loaded.
    for (std::size_t i = 0; i < s.block_loaded.size(); ++i)
      s.block_loaded[i] = s.block_loaded[i] && all_final && copies_ok;
    if (s.error.ok() && !x.copy_error.ok()) s.error = x.copy_error;
    s.final = all_final;
    s.reclaimable = all_final && s.reclaimable;
    return s;
  }

  void loop() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      bool busy = false;
      for (auto& [id, x] : xfers_) busy = advance(id, x) || busy;
      cv_.notify_all();
      if (busy)
        cv_.wait_for(lock, clamp_timeout(options_.poll_interval));
      else
        cv_.wait_for(lock, std::chrono::milliseconds(2));
    }
  }

  // One step of a transfer's layers; true while some layer is not final. Caller holds mu_.
  bool advance(TransferId id, X& x) {
    bool pending = false;
    std::optional<DecodeStatus> wire;
    for (std::uint32_t li = 0; li < x.layers.size(); ++li) {
      L& l = x.layers[li];
      if (l.phase == Phase::kWire) {
        if (!wire) {
          auto s = pd_->status(id);
          if (!s.ok()) return false;
          wire = std::move(s).value();
        }
        if (wire->layers[li] == LayerState::kPending) {
          pending = true;
          continue;
        }
        l.wire = wire->layers[li];
        if (l.wire == LayerState::kFailed) {
          l.phase = Phase::kFinal;
          l.state = LayerState::kFailed;
          l.error = wire->error;
          continue;
        }
        Status s = enqueue_copy(x, li);
        if (!s.ok()) {
          // A copy can fail part way through being queued (a descriptor slot that could not grow, one DMA of
          // several refused): what was queued still writes the destinations. The layer fails, but is final (and
          // its blocks can go back) only once that work is over: an event behind it, or, where none can be
          // recorded, the stream drained (bounded; past it, the stream's work is assumed dead).
          s = s.with_context(fmt::format("transfer {} layer {} staging copy", id, li));
          if (device_.record(*l.event, *stream_).ok()) {
            l.enqueue_error = std::move(s);
            l.enqueued = true;
            l.phase = Phase::kCopying;
          } else {
            device_.synchronize(*stream_, std::chrono::seconds(30)).ignore_error();
            finish_failed(x, l, std::move(s));
            continue;
          }
        } else {
          l.enqueued = true;
          l.phase = Phase::kCopying;
        }
      }
      if (l.phase == Phase::kCopying) {
        auto done = device_.query(*l.event);
        if (!done.ok()) {
          finish_failed(x, l,
                        l.enqueue_error.ok()
                            ? done.status().with_context(fmt::format("transfer {} layer {} staging copy", id, li))
                            : Status(l.enqueue_error));
        } else if (*done && !l.enqueue_error.ok()) {
          finish_failed(x, l, Status(l.enqueue_error));
        } else if (*done) {
          l.phase = Phase::kFinal;
          l.state = l.wire;
        } else {
          pending = true;
        }
      }
    }
    return pending;
  }

  void finish_failed(X& x, L& l, Status why) {
    l.phase = Phase::kFinal;
    l.state = LayerState::kFailed;
    l.error = why;
    if (x.copy_error.ok()) {
      log(LogLevel::kWarning, "transport", fmt::format("pd staged decode: {}", why.to_string()));
      x.copy_error = std::move(why);
    }
  }

  Status enqueue_copy(X& x, std::uint32_t layer) {
    renew_if_failed(device_, stream_, retired_, "pd-stage-h2d");  // an earlier copy failed on it (sticky)
    const std::uint32_t layers[1] = {layer};
    CopyRequest req;
    req.src = &staging_;
    req.dst = &dev_;
    req.src_blocks = x.staging;
    req.dst_blocks = x.dst;
    req.layers = layers;
    req.strategy = options_.strategy;
    auto copied = engine_.copy(req, *stream_);
    if (!copied.ok()) return copied.status();
    return device_.record(*x.layers[layer].event, *stream_);
  }

  Device& device_;
  CopyEngine& engine_;
  const BlockSpace dev_;
  const BlockSpace staging_;
  const StagedOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool waits_aborted_ = false;  // abort_waits() (under mu_)
  StagingPool pool_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::unique_ptr<Stream>> retired_;  // failed streams (renew_if_failed)
  std::map<TransferId, X> xfers_;
  std::unordered_map<BlockId, TransferId> dst_owner_;  // destination blocks of transfers not forgotten yet
  std::unique_ptr<PdDecode> pd_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<PdStagedPrefill>> PdStagedPrefill::create(Transport& transport, Device& device,
                                                                 CopyEngine& engine, BlockSpace device_blocks,
                                                                 BlockSpace staging, StagedOptions options) {
  auto p = std::make_unique<StagedPrefill>(device, engine, std::move(device_blocks), std::move(staging), options);
  KVTIER_RETURN_IF_ERROR(p->init(transport));
  return std::unique_ptr<PdStagedPrefill>(std::move(p));
}

Result<std::unique_ptr<PdStagedDecode>> PdStagedDecode::create(Transport& transport, Device& device, CopyEngine& engine,
                                                               BlockSpace device_blocks, BlockSpace staging,
                                                               StagedOptions options) {
  auto d = std::make_unique<StagedDecode>(device, engine, std::move(device_blocks), std::move(staging), options);
  KVTIER_RETURN_IF_ERROR(d->init(transport));
  return std::unique_ptr<PdStagedDecode>(std::move(d));
}

}  // namespace kvtier::transport
