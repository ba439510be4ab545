// TransferManager's life cycle and reports: task kind and state names,
// TransferStats::to_json, validate_transfer_config, TransferManager::create,
// and of TransferManagerImpl (transfer_manager_impl.h) init(), which places
// the host cache and starts the streams, the progress thread and the
// submission threads, stats(), and shutdown(), which stops and drains them.
#include "kvtier/transfer/transfer_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "kvtier/core/config.h"
#include "kvtier/core/deadline.h"
#include "kvtier/core/enum_names.h"
#include "transfer/transfer_manager_impl.h"

namespace kvtier {

constexpr EnumName<TaskKind> kTaskKindEntries[] = {
    {TaskKind::kEvict, "evict"},
    {TaskKind::kLoad, "load"},
    {TaskKind::kExternalWrite, "external_write"},
};
constexpr auto kTaskKindNames = enum_table("task kind", kTaskKindEntries);
std::string_view task_kind_name(TaskKind kind) noexcept { return kTaskKindNames.name(kind); }

constexpr EnumName<TaskState> kTaskStateEntries[] = {
    {TaskState::kPending, "pending"},
    {TaskState::kDone, "done"},
    {TaskState::kFailed, "failed"},
};
constexpr auto kTaskStateNames = enum_table("task state", kTaskStateEntries);
std::string_view task_state_name(TaskState state) noexcept { return kTaskStateNames.name(state); }

namespace {

std::string dir_json(const DirectionStats& d) {
  return fmt::format(
      "{{\"tasks_submitted\":{},\"tasks_done\":{},\"tasks_failed\":{},\"bytes_submitted\":{},\"bytes_done\":{},"
      "\"blocks_done\":{},\"blocks_failed\":{},\"busy_seconds\":{:.6f},\"gbps\":{:.3f},\"in_flight\":{},"
      "\"max_in_flight\":{}}}",
      d.tasks_submitted, d.tasks_done, d.tasks_failed, d.bytes_submitted, d.bytes_done, d.blocks_done, d.blocks_failed,
      d.busy_seconds, d.gbps, d.in_flight, d.max_in_flight);
}

}  // namespace

std::string TransferStats::to_json() const {
  return fmt::format(
      "{{\"num_layers\":{},\"num_draft_layers\":{},\"device_ordinal\":{},\"device_name\":\"{}\","
      "\"num_device_blocks\":{},\"num_host_blocks\":{},\"block_bytes\":{},\"has_scales\":{},\"has_indexer\":{},"
      "\"is_mla\":{},\"evict\":{},\"load\":{},\"external\":{},\"layers_done\":{},\"layers_failed\":{},"
      "\"layer_latency_p50_us\":{:.2f},\"layer_latency_p99_us\":{:.2f},\"latency_samples\":{},\"events_created\":{}}}",
      num_layers, num_draft_layers, device_ordinal, device_name, num_device_blocks, num_host_blocks, block_bytes,
      has_scales, has_indexer, is_mla, dir_json(evict), dir_json(load), dir_json(external), layers_done, layers_failed,
      layer_latency_p50_us, layer_latency_p99_us, latency_samples, events_created);
}

namespace transfer_detail {

Status TransferManagerImpl::init(KvCacheRegistration reg, CopyEngine* engine) {
  if (reg.device.kind() != MemoryKind::kDevice)
    return InvalidArgument("TransferManager: registration.device must be a kDevice BlockSpace");
  if (reg.device.device_ordinal() != device_.ordinal())
    return InvalidArgument(
        fmt::format("TransferManager: device cache is on ordinal {} but the Device is ordinal {} "
                    "(process-visible ordinals, after CUDA_VISIBLE_DEVICES)",
                    reg.device.device_ordinal(), device_.ordinal()));
  if (reg.device.num_blocks() == 0) return InvalidArgument("TransferManager: device cache has 0 blocks");
  device_space_ = std::move(reg.device);
  const KvLayout& layout = device_space_.layout();

  if (reg.host.space) {
    if (reg.host.space->kind() != MemoryKind::kPinnedHost)
      return InvalidArgument("TransferManager: registration.host.space must be a kPinnedHost BlockSpace");
    if (!(reg.host.space->layout() == layout))
      return InvalidArgument(fmt::format("TransferManager: host layout ({}) differs from device layout ({})",
                                         reg.host.space->layout().describe(), layout.describe()));
    host_space_ = *reg.host.space;
  } else {
    const HostCacheSpec& h = reg.host;
    if (h.num_blocks == 0)
      return InvalidArgument("TransferManager: host cache needs either a space or num_blocks >= 1");
    // Block ids are 32-bit; past that the size below wrapped to a small (or zero) allocation.
    if (h.num_blocks > kMaxBlockId + 1)
      return InvalidArgument(fmt::format("TransferManager: host cache of {} blocks: at most {} (32-bit block ids)",
                                         h.num_blocks, kMaxBlockId + 1));
    // Every sum and product checked: a host cache whose size does not fit in 64 bits is refused, not allocated
    // at its wrapped (small) size.
    std::uint64_t bytes = 0;
    bool fits = true;
    if (h.arrangement == HostCacheSpec::Arrangement::kLayerFirst) {
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
          const std::uint64_t region = BlockSpace::layer_first_region_bytes(layout, l, r, h.num_blocks);
          std::uint64_t padded = 0;
          fits = fits && !__builtin_add_overflow(region, 255, &padded) &&
                 !__builtin_add_overflow(bytes, padded / 256 * 256, &bytes);
        }
    } else {
      fits = !__builtin_mul_overflow(BlockSpace::page_first_page_bytes(layout, h.page_alignment), h.num_blocks, &bytes);
    }
    if (!fits)
      return InvalidArgument(fmt::format(
          "TransferManager: a host cache of {} blocks of this layout ({}, page_alignment {}) exceeds the address space",
          h.num_blocks, layout.describe(), h.page_alignment));
    auto mem = device_.allocate_pinned(bytes, h.pinned);
    if (!mem.ok())
      return mem.status().with_context(fmt::format("TransferManager: pinned host cache of {} bytes", bytes));
    host_memory_ = std::move(mem).value();
    KVTIER_RETURN_IF_ERROR(host_memory_->wait_ready(config_.host_ready_timeout));
    if (h.fill_byte >= 0) std::memset(host_memory_->data(), h.fill_byte, host_memory_->size());
    if (h.arrangement == HostCacheSpec::Arrangement::kLayerFirst) {
      std::vector<std::vector<void*>> bases(layout.num_layers());
      std::byte* p = host_memory_->data();
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
          bases[l].push_back(p);
          p += (BlockSpace::layer_first_region_bytes(layout, l, r, h.num_blocks) + 255) / 256 * 256;
        }
      KVTIER_ASSIGN_OR_RETURN(host_space_, BlockSpace::layer_first(MemoryKind::kPinnedHost, device_.ordinal(), layout,
                                                                   h.num_blocks, std::move(bases)));
    } else {
      KVTIER_ASSIGN_OR_RETURN(host_space_,
                              BlockSpace::page_first(MemoryKind::kPinnedHost, device_.ordinal(), layout, h.num_blocks,
                                                     host_memory_->data(), host_memory_->size(), h.page_alignment));
    }
  }

  StreamOptions in_opts{config_.input_priority, "kvtier-transfer-input"};
  StreamOptions out_opts{config_.output_priority, "kvtier-transfer-output"};
  KVTIER_ASSIGN_OR_RETURN(in_, device_.create_stream(in_opts));
  KVTIER_ASSIGN_OR_RETURN(out_, device_.create_stream(out_opts));
  KVTIER_ASSIGN_OR_RETURN(ext_,
                          device_.create_stream(StreamOptions{StreamPriority::kNormal, "kvtier-transfer-external"}));
  external_of_.assign(device_space_.num_blocks(), 0);
  if (engine) {
    if (&engine->device() != &device_)
      return InvalidArgument("TransferManager: the CopyEngine given belongs to another Device");
    engine_ = engine;
  } else {
    auto created = CopyEngine::create(device_, config_.copy_engine);
    if (!created.ok())  // its options are the transfer.copy_engine.* knobs
      return created.status().with_context(
          "TransferManagerConfig.copy_engine (knobs transfer.copy_engine.*, "
          "KVTIER_TRANSFER_COPY_ENGINE_*)");
    owned_engine_ = std::move(created).value();
    engine_ = owned_engine_.get();
  }
  KVTIER_ASSIGN_OR_RETURN(pool_, EventPool::create(device_, 2 * layout.num_layers() + 8, config_.event_pool_max_free));
  dev_hazards_ = std::make_unique<HazardTracker>(device_, device_space_.num_blocks(), "device", &gate_);
  host_hazards_ = std::make_unique<HazardTracker>(device_, host_space_.num_blocks(), "host", &gate_);
  latency_us_.assign(std::max<std::size_t>(config_.latency_samples, 1), 0.0);
  in_worker_ = std::make_unique<SubmitWorker>();
  in_worker_->stream = in_.get();
  in_worker_->queue = &in_queue_;
  out_worker_ = std::make_unique<SubmitWorker>();
  out_worker_->stream = out_.get();
  out_worker_->queue = &out_queue_;
  progress_ = std::thread([this] {
    progress_id_.store(std::this_thread::get_id(), std::memory_order_release);
    progress_loop();
    // A thread id may be reused once this thread is gone: a later thread that
    // got it must not be taken for the progress thread (shutdown() would
    // refuse it, waits would try to drive progress).
    progress_id_.store(std::thread::id{}, std::memory_order_release);
  });
  if (config_.async_submit) {
    in_worker_->thread = std::thread([this] { worker_loop(*in_worker_); });
    out_worker_->thread = std::thread([this] { worker_loop(*out_worker_); });
  }
  return Status::Ok();
}

TransferStats TransferManagerImpl::stats() const {
  TransferStats s;
  const KvLayout& layout = device_space_.layout();
  s.num_layers = layout.num_layers();
  for (const auto& l : layout.layers()) {
    if (l.draft) s.num_draft_layers++;
    for (const auto& r : l.roles) {
      if (r.role == Role::kKeyScale || r.role == Role::kValueScale) s.has_scales = true;
      if (r.role == Role::kIndexer) s.has_indexer = true;
      if (r.role == Role::kLatent) s.is_mla = true;
    }
  }
  s.device_ordinal = device_.ordinal();
  s.device_name = device_.name();
  s.num_device_blocks = device_space_.num_blocks();
  s.num_host_blocks = host_space_.num_blocks();
  s.block_bytes = layout.total_block_bytes();
  s.events_created = pool_ ? pool_->created() : 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto fill = [](const DirCounters& d) {
    DirectionStats out = d.s;
    std::uint64_t ns = d.busy_ns;
    if (d.s.in_flight > 0)
      ns += static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - d.busy_since).count());
    out.busy_seconds = static_cast<double>(ns) * 1e-9;
    out.gbps = out.busy_seconds > 0 ? static_cast<double>(out.bytes_done) / out.busy_seconds * 1e-9 : 0.0;
    return out;
  };
  s.evict = fill(evict_);
  s.load = fill(load_);
  s.external = fill(external_);
  s.layers_done = layers_done_;
  s.layers_failed = layers_failed_;
  std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(latency_count_, latency_us_.size()));
  s.latency_samples = n;
  if (n > 0) {
    std::vector<double> v(latency_us_.begin(), latency_us_.begin() + static_cast<std::ptrdiff_t>(n));
    auto pct = [&](double p) {
      std::size_t k = std::min(n - 1, static_cast<std::size_t>(p * static_cast<double>(n - 1) + 0.5));
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
      return v[k];
    };
    s.layer_latency_p50_us = pct(0.50);
    s.layer_latency_p99_us = pct(0.99);
  }
  return s;
}

Status TransferManagerImpl::shutdown() {
  if (on_progress_thread())
    return FailedPrecondition(
        "TransferManager::shutdown called from a transfer callback: shutdown joins the thread that runs callbacks");
  {
    std::unique_lock<std::mutex> submit(submit_mu_);
    if (shut_) {
      // Idempotent: a later call returns once the first one completed, with its status.
      const auto limit = deadline_after(2 * config_.shutdown_timeout + std::chrono::seconds(10));
      if (!shutdown_cv_.wait_until(submit, limit, [&] { return shutdown_done_; }))
        return TimedOut("TransferManager::shutdown: the shutdown already under way did not complete");
      return shutdown_status_;
    }
    shut_ = true;
    // No peer will report to a manager that is going away: external writes end now, and their blocks are
    // released (nothing can be submitted any more), so that no waiter hangs.
    std::vector<TaskId> open;
    for (const auto& [id, x] : externals_) open.push_back(id);
    for (TaskId id : open) {
      auto it = externals_.find(id);
      if (!it->second.ended)
        end_external_locked(it->second, Cancelled("transfer manager shut down before the external write ended"),
                            /*quiescent=*/true);
      release_external_locked(id);
    }
  }
  // Every accepted task is enqueued (or failed) before the streams drain.
  stop_workers();
  Status result;
  if (in_ && out_ && ext_) {
    for (Stream* s : {in_.get(), out_.get(), ext_.get()}) {
      Status st = device_.synchronize(*s, config_.shutdown_timeout);
      if (st.code() == StatusCode::kTimedOut && result.ok())
        result = st.with_context("TransferManager::shutdown draining a transfer stream");
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  if (!owned_engine_ && engine_ && in_ && out_) {
    // An external engine lives on: release its per-stream state before our streams go.
    engine_->forget_stream(*in_).ignore_error();
    engine_->forget_stream(*out_).ignore_error();
  }
  if (!result.ok() && host_memory_) {
    // Copies may still be writing the host cache: never free it under them.
    (void)host_memory_.release();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.clear();
    in_queue_.clear();
    out_queue_.clear();
    ext_queue_.clear();
  }
  {
    std::lock_guard<std::mutex> submit(submit_mu_);
    shutdown_status_ = result;
    shutdown_done_ = true;
  }
  shutdown_cv_.notify_all();
  return result;
}

}  // namespace transfer_detail

constexpr std::size_t kMaxLatencySamples = std::size_t{1} << 20;

Status validate_transfer_config(const TransferManagerConfig& c) {
  // Names the field and the knob that sets it (bind_transfer_manager_config: transfer.<field>,
  // KVTIER_TRANSFER_<FIELD>).
  auto bad = [](std::string_view field, auto value, std::string_view rule) {
    return InvalidArgument(fmt::format("TransferManagerConfig.{} = {} ({}; knob transfer.{}, {})", field, value, rule,
                                       field, ConfigTable::env_var_for(fmt::format("transfer.{}", field))));
  };
  if (c.max_in_flight_tasks == 0) return bad("max_in_flight_tasks", 0, "must be >= 1: every submit would fail");
  if (c.retained_finished_tasks == 0) return bad("retained_finished_tasks", 0, "must be >= 1");
  // Completions past the cap are dropped: at 0 every one was, and a poller waiting for its tasks (the cache's plan
  // executor) spun forever.
  if (c.max_unpolled_completions == 0)
    return bad("max_unpolled_completions", 0, "must be >= 1: every completion would be dropped unseen");
  // The ring is allocated and written whole at create: a large value cost gigabytes, or aborted the process.
  if (c.latency_samples == 0 || c.latency_samples > kMaxLatencySamples)
    return bad("latency_samples", c.latency_samples, fmt::format("must be in [1, {}]", kMaxLatencySamples));
  // The progress thread looks at pending work this often, so every completion is seen up to this late: a value in
  // seconds ("50s" for "50us") made each transfer take that long, with nothing to say why.
  if (c.poll_interval.count() <= 0 || c.poll_interval > std::chrono::milliseconds(100))
    return bad("poll_interval", fmt::format("{}us", c.poll_interval.count()), "must be in (0, 100ms]");
  // At most a day: shutdown() waits twice this in nanoseconds, and milliseconds::max() ("never") overflowed to a
  // negative wait, so a shutdown with work pending timed out at once.
  if (c.shutdown_timeout.count() <= 0 || c.shutdown_timeout > std::chrono::hours(24))
    return bad("shutdown_timeout", fmt::format("{}ms", c.shutdown_timeout.count()), "must be in (0, 24h]");
  if (c.host_ready_timeout.count() <= 0 || c.host_ready_timeout > std::chrono::hours(24))
    return bad("host_ready_timeout", fmt::format("{}ms", c.host_ready_timeout.count()), "must be in (0, 24h]");
  for (auto [field, st] : {std::pair{"evict_strategy", c.evict_strategy}, std::pair{"load_strategy", c.load_strategy}})
    if (static_cast<unsigned>(st) >= static_cast<unsigned>(kNumCopyStrategies))
      return bad(field, static_cast<int>(st), "not a CopyStrategy");
  for (auto [field, p] :
       {std::pair{"input_priority", c.input_priority}, std::pair{"output_priority", c.output_priority}})
    if (p != StreamPriority::kNormal && p != StreamPriority::kHigh)
      return bad(field, static_cast<int>(p), "not a StreamPriority");
  return Status::Ok();
}

Result<std::unique_ptr<TransferManager>> TransferManager::create(Device& device, Stream& compute,
                                                                 KvCacheRegistration registration,
                                                                 const TransferManagerConfig& config,
                                                                 CopyEngine* engine) {
  if (&compute.device() != &device)
    return InvalidArgument("TransferManager::create: the compute stream belongs to another Device");
  KVTIER_RETURN_IF_ERROR(validate_transfer_config(config).with_context("TransferManager::create"));
  auto mgr = std::make_unique<transfer_detail::TransferManagerImpl>(device, compute, config);
  KVTIER_RETURN_IF_ERROR(mgr->init(std::move(registration), engine));
  return std::unique_ptr<TransferManager>(std::move(mgr));
}

}  // namespace kvtier
