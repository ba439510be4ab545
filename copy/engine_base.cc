// The CopyEngine itself: strategy and direction names, the backend factory,
// the options check, per-stream state (created on first use, drained by
// forget_stream() and the destructor), in-flight tracking per direction, and
// copy(), which plans a request and runs the strategy asked for or picked by
// kAuto (auto_strategy.cc). The strategies: kDmaPerRun here, kDmaBatch in the
// backends, kSmKernel in sm_kernel_copy.cc, kStagedDma in staged_dma_copy.cc,
// kSplit in split_copy.cc.
#include "copy/engine_base.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "kvtier/backend/copy_backend.h"
#include "kvtier/core/enum_names.h"

namespace kvtier {

constexpr EnumName<CopyStrategy> kCopyStrategyEntries[] = {
    {CopyStrategy::kAuto, "auto"},
    {CopyStrategy::kDmaPerRun, "dma_per_run"},
    {CopyStrategy::kDmaBatch, "dma_batch"},
    {CopyStrategy::kSmKernel, "sm_kernel"},
    {CopyStrategy::kStagedDma, "staged_dma"},
    {CopyStrategy::kSplit, "split"},
    // Short spellings.
    {CopyStrategy::kDmaPerRun, "per_run"},
    {CopyStrategy::kDmaBatch, "batch"},
    {CopyStrategy::kSmKernel, "kernel"},
    {CopyStrategy::kSmKernel, "sm"},
    {CopyStrategy::kStagedDma, "staged"},
    {CopyStrategy::kSplit, "hybrid"},
};
constexpr auto kCopyStrategyNames = enum_table("copy strategy", kCopyStrategyEntries);
static_assert(kCopyStrategyNames.covers_dense(kNumCopyStrategies), "a CopyStrategy without a name");
std::string_view copy_strategy_name(CopyStrategy s) noexcept { return kCopyStrategyNames.name(s); }

Result<CopyStrategy> parse_copy_strategy(std::string_view name) { return kCopyStrategyNames.parse(name); }

constexpr EnumName<CopyDirection> kCopyDirectionEntries[] = {
    {CopyDirection::kDeviceToHost, "d2h"},
    {CopyDirection::kHostToDevice, "h2d"},
    {CopyDirection::kDeviceToDevice, "d2d"},
    {CopyDirection::kHostToHost, "h2h"},
};
constexpr auto kCopyDirectionNames = enum_table("copy direction", kCopyDirectionEntries);
std::string_view copy_direction_name(CopyDirection d) noexcept { return kCopyDirectionNames.name(d); }

CopyDirection copy_direction(MemoryKind src, MemoryKind dst) noexcept {
  const bool sd = src == MemoryKind::kDevice;
  const bool dd = dst == MemoryKind::kDevice;
  if (sd && dd) return CopyDirection::kDeviceToDevice;
  if (sd) return CopyDirection::kDeviceToHost;
  if (dd) return CopyDirection::kHostToDevice;
  return CopyDirection::kHostToHost;
}

Status check_copy_engine_options(const CopyEngineOptions& options) {
  return copy_detail::EngineBase::check_options(options);
}

Result<std::unique_ptr<CopyEngine>> CopyEngine::create(Device& device, const CopyEngineOptions& options) {
  KVTIER_RETURN_IF_ERROR(copy_detail::EngineBase::check_options(options));
  const auto* backend = static_cast<const CopyBackend*>(device.extension(CopyBackend::kExtension));
  if (backend == nullptr)
    return NotSupported(
        fmt::format("device '{}' ({} backend) offers no copy engine", device.name(), backend_name(device.backend())));
  return backend->create_engine(device, options);
}

namespace copy_detail {
namespace {
constexpr auto kDrainTimeout = std::chrono::seconds(120);
}  // namespace

Status EngineBase::check_options(const CopyEngineOptions& o) {
  if (o.sm_threads_per_cta == 0 || o.sm_threads_per_cta % kWarpThreads != 0 || o.sm_threads_per_cta > kMaxThreadsPerCta)
    return InvalidArgument(fmt::format("sm_threads_per_cta must be a multiple of {} in [{}, {}], got {}", kWarpThreads,
                                       kWarpThreads, kMaxThreadsPerCta, o.sm_threads_per_cta));
  if (o.sm_ctas_h2d == 0 || o.sm_ctas_d2h == 0 || o.sm_ctas_d2d == 0)
    return InvalidArgument(
        fmt::format("sm_ctas_* must be >= 1 (h2d {}, d2h {}, d2d {})", o.sm_ctas_h2d, o.sm_ctas_d2h, o.sm_ctas_d2d));
  if (o.sm_item_bytes == 0 || o.sm_item_bytes % 16 != 0)
    return InvalidArgument(fmt::format("sm_item_bytes must be a positive multiple of 16, got {}", o.sm_item_bytes));
  if (o.sm_landed_item_bytes == 0 || o.sm_landed_item_bytes % 16 != 0)
    return InvalidArgument(
        fmt::format("sm_landed_item_bytes must be a positive multiple of 16, got {}", o.sm_landed_item_bytes));
  if (o.sm_inline_descriptor_max_pairs > kInlineMaxPairs)
    return InvalidArgument(fmt::format("sm_inline_descriptor_max_pairs must be <= {}, got {}", kInlineMaxPairs,
                                       o.sm_inline_descriptor_max_pairs));
  if (o.descriptor_slots == 0) return InvalidArgument("descriptor_slots must be >= 1, got 0");
  // Each slot holds descriptor arrays: past this the ring cost gigabytes, or aborted the process (bad_alloc).
  if (o.descriptor_slots > kMaxDescriptorSlots)
    return InvalidArgument(
        fmt::format("descriptor_slots must be <= {}, got {}", kMaxDescriptorSlots, o.descriptor_slots));
  if (o.max_pairs_per_call == 0) return InvalidArgument("max_pairs_per_call must be >= 1, got 0");
  if (o.batch_max_descriptors == 0) return InvalidArgument("batch_max_descriptors must be >= 1, got 0");
  if (o.staged_slots == 0) return InvalidArgument("staged_slots must be >= 1, got 0");
  if (o.staged_slots > kMaxStagedSlots)
    return InvalidArgument(fmt::format("staged_slots must be <= {}, got {}", kMaxStagedSlots, o.staged_slots));
  if (o.staged_slot_bytes < kStagedAlign)
    return InvalidArgument(fmt::format("staged_slot_bytes must be >= {}, got {}", kStagedAlign, o.staged_slot_bytes));
  // The staging of one stream is staged_slots x staged_slot_bytes of device memory: that product must exist.
  if (o.staged_slot_bytes > UINT64_MAX / o.staged_slots)
    return InvalidArgument(
        fmt::format("staged_slots {} x staged_slot_bytes {} overflows 64 bits", o.staged_slots, o.staged_slot_bytes));
  if (!(o.split_kernel_share >= 0.0 && o.split_kernel_share <= 1.0))  // also rejects NaN
    return InvalidArgument(fmt::format("split_kernel_share must be in [0, 1], got {}", o.split_kernel_share));
  for (const auto& [name, v] : {std::pair{"auto_split_h2d_kernel_share", o.auto_split_h2d_kernel_share},
                                std::pair{"auto_split_h2d_kernel_share_small", o.auto_split_h2d_kernel_share_small},
                                std::pair{"auto_split_h2d_kernel_share_large", o.auto_split_h2d_kernel_share_large},
                                std::pair{"auto_split_adaptive_min_share", o.auto_split_adaptive_min_share},
                                std::pair{"auto_split_adaptive_max_share", o.auto_split_adaptive_max_share}})
    if (!(v >= 0.0 && v <= 1.0)) return InvalidArgument(fmt::format("{} must be in [0, 1], got {}", name, v));
  if (o.auto_split_min_payload_bytes_per_dma_descriptor == 0 ||
      o.auto_split_min_payload_bytes_per_dma_descriptor > o.auto_split_max_payload_bytes_per_dma_descriptor)
    return InvalidArgument(fmt::format(
        "auto_split_min_payload_bytes_per_dma_descriptor must be in [1, "
        "auto_split_max_payload_bytes_per_dma_descriptor "
        "= {}], got {}",
        o.auto_split_max_payload_bytes_per_dma_descriptor, o.auto_split_min_payload_bytes_per_dma_descriptor));
  if (o.auto_split_adaptive_min_share > o.auto_split_adaptive_max_share)
    return InvalidArgument(fmt::format("auto_split_adaptive_min_share {} is above auto_split_adaptive_max_share {}",
                                       o.auto_split_adaptive_min_share, o.auto_split_adaptive_max_share));
  if (!(o.auto_split_adaptive_gain > 0.0 && o.auto_split_adaptive_gain <= 1.0))
    return InvalidArgument(
        fmt::format("auto_split_adaptive_gain must be in (0, 1], got {}", o.auto_split_adaptive_gain));
  if (o.split_dma_lanes == 0 || o.split_dma_lanes > kMaxSplitDmaLanes)
    return InvalidArgument(
        fmt::format("split_dma_lanes must be in [1, {}], got {}", kMaxSplitDmaLanes, o.split_dma_lanes));
  if (!(o.staged_max_span_ratio >= 1.0))  // also rejects NaN
    return InvalidArgument(fmt::format("staged_max_span_ratio must be >= 1.0, got {}", o.staged_max_span_ratio));
  return Status::Ok();
}

EngineBase::EngineBase(Device& device, const CopyEngineOptions& options) : device_(device), options_(options) {}

EngineBase::~EngineBase() {
  // Wait for the last work enqueued through this engine before its slots (and
  // their pinned/device buffers and events) are freed.
  for (auto& [id, st] : streams_) {
    for (std::size_t d = 0; d < st->last.size(); ++d)
      if (st->maybe_pending[d] && st->last[d]) device_.synchronize(*st->last[d], kDrainTimeout).ignore_error();
    for (auto& slot : st->slots)
      if (slot.pending && slot.done) device_.synchronize(*slot.done, kDrainTimeout).ignore_error();
  }
}

// What a checksummed request must be, checked by validate() and copy() alike.
Status EngineBase::check_checksum_request(const CopyRequest& r) {
  if (r.checksums != nullptr && r.strategy != CopyStrategy::kAuto && r.strategy != CopyStrategy::kSmKernel)
    return InvalidArgument(
        fmt::format("a checksummed copy runs the sm_kernel strategy, not {}", copy_strategy_name(r.strategy)));
  if (r.checksums != nullptr && copy_direction(r.src->kind(), r.dst->kind()) == CopyDirection::kHostToHost)
    return NotSupported("a checksummed copy needs device memory on at least one side (the SM kernel computes it)");
  if (r.landed_checksums != nullptr && r.checksums == nullptr)
    return InvalidArgument(
        "landed_checksums of a copy without checksums (the kernel that reads back its writes is "
        "the checksummed one)");
  if (r.landed_checksums != nullptr && r.landed_checksums == r.checksums)
    return InvalidArgument("landed_checksums and checksums are the same array; each needs its own");
  return Status::Ok();
}

Status EngineBase::validate(const CopyRequest& request) const {
  KVTIER_RETURN_IF_ERROR(validate_request(request, device_.ordinal()));
  KVTIER_RETURN_IF_ERROR(check_checksum_request(request));
  if (request.checksums != nullptr && !request.src_blocks.empty()) {
    PlanScratch sc;
    select_planes(request, sc.planes);
    return check_checksum_alignment(sc.planes);
  }
  if (request.strategy == CopyStrategy::kStagedDma && !request.src_blocks.empty()) {
    // Whether every pair fits a staging slot (copy() rejects it otherwise).
    PlanScratch sc;
    select_planes(request, sc.planes);
    const bool h2d = request.src->kind() != MemoryKind::kDevice;
    return plan_staged_chunks(sc.planes, h2d ? request.src_blocks : request.dst_blocks, h2d, options_.staged_slot_bytes,
                              options_.max_pairs_per_call, sc.staged);
  }
  return Status::Ok();
}

Result<std::shared_ptr<StreamState>> EngineBase::state_for(Stream& stream) {
  std::lock_guard lock(map_mu_);
  auto it = streams_.find(stream.id());
  if (it != streams_.end()) return it->second;
  auto st = std::make_shared<StreamState>();
  st->stream_id = stream.id();
  for (auto& e : st->last) {
    KVTIER_ASSIGN_OR_RETURN(e, device_.create_event());
  }
  st->slots.resize(options_.descriptor_slots);
  KVTIER_ASSIGN_OR_RETURN(st->backend, make_backend_state(stream));
  streams_.emplace(stream.id(), st);
  return st;
}

Status EngineBase::forget_stream(Stream& stream) {
  std::shared_ptr<StreamState> st;
  {
    std::lock_guard lock(map_mu_);
    auto it = streams_.find(stream.id());
    if (it == streams_.end()) return Status::Ok();
    st = std::move(it->second);
    streams_.erase(it);
  }
  // Wait for a copy() in progress on this stream to finish enqueuing (not
  // under map_mu_: copy() takes map_mu_ while holding the stream lock).
  std::lock_guard stream_lock(st->mu);
  Status result;
  for (std::size_t d = 0; d < st->last.size(); ++d)
    if (st->maybe_pending[d]) {
      Status s = device_.synchronize(*st->last[d], kDrainTimeout);
      if (s.code() == StatusCode::kTimedOut && result.ok()) result = s;
    }
  for (auto& slot : st->slots)
    if (slot.pending) {
      Status s = device_.synchronize(*slot.done, kDrainTimeout);
      if (s.code() == StatusCode::kTimedOut && result.ok()) result = s;
    }
  if (!result.ok()) {
    // Do not free buffers a copy may still use: keep them alive with the engine.
    std::lock_guard lock(map_mu_);
    const std::uint64_t id = st->stream_id;
    streams_.emplace(id, std::move(st));
    return result.with_context("forget_stream");
  }
  return Status::Ok();
}

std::uint32_t EngineBase::ctas_for(CopyDirection dir) const noexcept {
  switch (dir) {
    case CopyDirection::kHostToDevice: return options_.sm_ctas_h2d;
    case CopyDirection::kDeviceToHost: return options_.sm_ctas_d2h;
    case CopyDirection::kDeviceToDevice: return options_.sm_ctas_d2d;
    case CopyDirection::kHostToHost: return options_.sm_ctas_d2d;
  }
  return options_.sm_ctas_d2h;
}

bool EngineBase::in_flight(CopyDirection dir, const StreamState* exclude) const {
  const auto d = static_cast<std::size_t>(dir);
  std::lock_guard lock(map_mu_);
  for (const auto& [id, st] : streams_) {
    if (st.get() == exclude) continue;
    std::lock_guard track(st->track_mu);
    if (!st->maybe_pending[d]) continue;
    Result<bool> done = device_.query(*st->last[d]);
    if (!done.ok() || *done) {
      st->maybe_pending[d] = false;  // completed (or failed: not occupying the link)
      continue;
    }
    return true;
  }
  return false;
}

Status EngineBase::run_per_run(StreamState&, Stream& stream, std::span<const Segment> segments, CopyDirection) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    Status st = device_.memcpy_async(s.dst, s.src, s.bytes, stream);
    if (!st.ok())
      return st.with_context(fmt::format("dma_per_run segment {} of {} ({} bytes)", i, segments.size(), s.bytes));
  }
  return Status::Ok();
}

Status EngineBase::note_enqueued(StreamState& st, Stream& stream, CopyDirection dir) {
  const auto d = static_cast<std::size_t>(dir);
  std::lock_guard track(st.track_mu);
  KVTIER_RETURN_IF_ERROR(device_.record(*st.last[d], stream));
  st.maybe_pending[d] = true;
  return Status::Ok();
}

Result<CopyReport> EngineBase::copy(const CopyRequest& r, Stream& stream) {
  KVTIER_RETURN_IF_ERROR(validate_request(r, device_.ordinal()));
  return copy_valid(r, stream);
}

Result<PreparedCopy> EngineBase::prepare(const CopyRequest& request) const {
  KVTIER_RETURN_IF_ERROR(validate(request));
  PreparedCopy prepared;
  prepared.request_ = request;
  prepared.request_.checksums = nullptr;
  prepared.request_.landed_checksums = nullptr;
  prepared.engine_ = this;
  return prepared;
}

Result<CopyReport> EngineBase::copy(const PreparedCopy& prepared, std::span<const std::uint32_t> layers, Stream& stream,
                                    std::uint64_t* checksums, std::uint64_t* landed_checksums) {
  if (prepared.engine_ != this)
    return InvalidArgument(prepared.engine_ == nullptr ? std::string("copy of a PreparedCopy that was never prepared")
                                                       : std::string("copy of a PreparedCopy of another copy engine"));
  CopyRequest r = prepared.request_;
  r.checksums = checksums;
  r.landed_checksums = landed_checksums;
  if (!layers.empty()) {
    if (!r.layers.empty())
      for (std::size_t i = 0; i < layers.size(); ++i)
        if (std::find(r.layers.begin(), r.layers.end(), layers[i]) == r.layers.end())
          return InvalidArgument(fmt::format("layer {} at index {} is not one of the prepared request's {} layers",
                                             layers[i], i, r.layers.size()));
    r.layers = layers;
    KVTIER_RETURN_IF_ERROR(validate_layers(r));
  }
  return copy_valid(r, stream);
}

// The body of copy() for a request that passed validation.
Result<CopyReport> EngineBase::copy_valid(const CopyRequest& r, Stream& stream) {
  if (&stream.device() != &device_)
    return InvalidArgument(
        fmt::format("stream {} belongs to another device ('{}' at {}) than this copy engine's "
                    "('{}' at {})",
                    stream.id(), stream.device().name(), static_cast<const void*>(&stream.device()), device_.name(),
                    static_cast<const void*>(&device_)));
  KVTIER_RETURN_IF_ERROR(check_checksum_request(r));
  CopyReport report;
  report.direction = copy_direction(r.src->kind(), r.dst->kind());
  report.strategy = r.strategy;
  if (r.src_blocks.empty()) return report;

  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<StreamState> st, state_for(stream));
  std::lock_guard lock(st->mu);
  PlanScratch& sc = st->scratch;
  select_planes(r, sc.planes);
  if (r.checksums != nullptr) {
    KVTIER_RETURN_IF_ERROR(check_checksum_alignment(sc.planes));
    KVTIER_RETURN_IF_ERROR(device_.memset_async(r.checksums, 0, r.src_blocks.size() * sizeof(std::uint64_t), stream)
                               .with_context("zeroing the copy's checksums"));
  }
  if (r.landed_checksums != nullptr)
    KVTIER_RETURN_IF_ERROR(
        device_.memset_async(r.landed_checksums, 0, r.src_blocks.size() * sizeof(std::uint64_t), stream)
            .with_context("zeroing the copy's landed checksums"));
  find_runs(r.src_blocks, r.dst_blocks, sc.runs);
  const PlanSummary summary = summarize(r, sc.planes, sc.runs);
  CopyStrategy strategy = r.checksums != nullptr ? CopyStrategy::kSmKernel : r.strategy;
  const bool host_is_src = r.src->kind() != MemoryKind::kDevice;
  if (strategy == CopyStrategy::kAuto) {
    bool caller_busy = true;
    if (options_.auto_split_only_behind_queued_work || options_.auto_idle_kernel_max_segment_bytes > 0) {
      Result<bool> idle = device_.query(stream);
      caller_busy = idle.ok() && !*idle;  // an errored stream counts as idle
    }
    strategy =
        staged_preferred(r, summary, sc) ? CopyStrategy::kStagedDma : choose_impl(summary, st.get(), caller_busy);
    // Only H2D splits pause (choose_impl); other copies need no tuner lock.
    if (options_.auto_split_cpu_budget_adaptive && summary.direction == CopyDirection::kHostToDevice)
      tuner_.note_copy_while_paused(split_size_class(summary.direction, summary.average_segment_bytes()));
  } else if (strategy == CopyStrategy::kStagedDma) {
    // Before anything is enqueued: a pair larger than a slot rejects the request.
    KVTIER_RETURN_IF_ERROR(plan_staged_chunks(sc.planes, host_is_src ? r.src_blocks : r.dst_blocks, host_is_src,
                                              options_.staged_slot_bytes, options_.max_pairs_per_call, sc.staged));
  }
  report.strategy = strategy;
  report.bytes = summary.bytes;
  report.pairs = summary.pairs;
  report.planes = summary.planes;
  const CopyDirection dir = report.direction;
  Status status;
  switch (strategy) {
    case CopyStrategy::kAuto:  // choose_impl never returns kAuto
    case CopyStrategy::kDmaPerRun: {
      report.strategy = CopyStrategy::kDmaPerRun;
      build_segments(r, sc.planes, sc.runs, sc.segments);
      report.segments = sc.segments.size();
      report.calls = static_cast<std::uint32_t>(sc.segments.size());
      status = run_per_run(*st, stream, sc.segments, dir);
      break;
    }
    case CopyStrategy::kDmaBatch: {
      const std::uint64_t min_segment = build_segments(r, sc.planes, sc.runs, sc.segments);
      report.segments = sc.segments.size();
      report.calls = static_cast<std::uint32_t>((sc.segments.size() + options_.batch_max_descriptors - 1) /
                                                options_.batch_max_descriptors);
      // A gate holds the stream while the batch is queued, but the driver
      // accepts only 512-1023 pending copies per stream: a larger gated batch
      // blocks inside cudaMemcpyBatchAsync until the gate's watchdog fires
      // (measured 0.1 GB/s at 65536 x 4 KiB). Such batches go ungated.
      // Never on the legacy default stream (an adopted handle 0, torch's default): it cannot be gated, and a
      // gated batch there failed instead of running ungated.
      report.gated = supports_gate() && stream.native_handle() != nullptr && dir == CopyDirection::kHostToDevice &&
                     sc.segments.size() <= kMaxGatedBatchDescriptors &&
                     (options_.batch_gate_always || min_segment <= options_.batch_gate_max_segment_bytes);
      status = run_batch(*st, stream, sc.segments, dir, report.gated);
      break;
    }
    case CopyStrategy::kSmKernel:
      report.segments = summary.segments;
      status = run_kernel(*st, stream, r, dir, report);
      break;
    case CopyStrategy::kStagedDma:
      report.segments = summary.segments;
      status = run_staged(*st, stream, r, dir, report);
      break;
    case CopyStrategy::kSplit: {
      const bool automatic = r.strategy == CopyStrategy::kAuto;
      if (adaptive_split(automatic)) harvest_split_timing(*st);
      report.kernel_share = split_share(summary, automatic);
      status = run_split(*st, stream, r, dir, report.kernel_share, automatic, summary, report);
      break;
    }
  }
  // Track the direction even after a partial failure: some work may be queued.
  Status noted = note_enqueued(*st, stream, dir);
  if (!status.ok())
    return status.with_context(fmt::format("{} {} copy of {} pairs", copy_strategy_name(report.strategy),
                                           copy_direction_name(dir), report.pairs));
  KVTIER_RETURN_IF_ERROR(noted);
  return report;
}

Result<CopyReport> EngineBase::checksum(const BlockSpace& space, std::span<const BlockId> blocks,
                                        std::span<const std::uint32_t> layers, RoleMask roles, std::uint64_t* out,
                                        Stream& stream) {
  if (&stream.device() != &device_)
    return InvalidArgument(
        fmt::format("stream {} belongs to another device ('{}' at {}) than this copy engine's "
                    "('{}' at {})",
                    stream.id(), stream.device().name(), static_cast<const void*>(&stream.device()), device_.name(),
                    static_cast<const void*>(&device_)));
  if (space.kind() != MemoryKind::kDevice)
    return NotSupported("checksum() reads device memory with the SM kernel; use block_checksum() on host memory");
  if (out == nullptr && !blocks.empty()) return InvalidArgument("checksum() needs an output array, got nullptr");
  CopyRequest r;
  r.src = &space;
  r.dst = &space;
  r.src_blocks = blocks;
  r.dst_blocks = blocks;
  r.layers = layers;
  r.roles = roles;
  r.strategy = CopyStrategy::kSmKernel;
  r.checksums = out;
  KVTIER_RETURN_IF_ERROR(validate_request(r, device_.ordinal(), /*read_only=*/true));
  CopyReport report;
  report.direction = CopyDirection::kDeviceToDevice;
  report.strategy = CopyStrategy::kSmKernel;
  if (blocks.empty()) return report;
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<StreamState> st, state_for(stream));
  std::lock_guard lock(st->mu);
  PlanScratch& sc = st->scratch;
  select_planes(r, sc.planes);
  KVTIER_RETURN_IF_ERROR(check_checksum_alignment(sc.planes));
  KVTIER_RETURN_IF_ERROR(device_.memset_async(out, 0, blocks.size() * sizeof(std::uint64_t), stream)
                             .with_context("zeroing the checksums"));
  find_runs(r.src_blocks, r.dst_blocks, sc.runs);
  const PlanSummary summary = summarize(r, sc.planes, sc.runs);
  report.bytes = summary.bytes;
  report.pairs = summary.pairs;
  report.planes = summary.planes;
  report.segments = summary.segments;
  Status status = run_kernel(*st, stream, r, CopyDirection::kDeviceToDevice, report, {}, /*store=*/false);
  Status noted = note_enqueued(*st, stream, CopyDirection::kDeviceToDevice);
  if (!status.ok()) return status.with_context(fmt::format("checksum of {} blocks", blocks.size()));
  KVTIER_RETURN_IF_ERROR(noted);
  return report;
}

}  // namespace copy_detail
}  // namespace kvtier
