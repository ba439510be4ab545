#include "copy/engine_base.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>

namespace kvtier {

std::string_view copy_strategy_name(CopyStrategy s) noexcept {
  switch (s) {
    case CopyStrategy::kAuto: return "auto";
    case CopyStrategy::kDmaPerRun: return "dma_per_run";
    case CopyStrategy::kDmaBatch: return "dma_batch";
    case CopyStrategy::kSmKernel: return "sm_kernel";
    case CopyStrategy::kStagedDma: return "staged_dma";
    case CopyStrategy::kSplit: return "split";
  }
  return "?";
}

Result<CopyStrategy> parse_copy_strategy(std::string_view name) {
  for (int i = 0; i < kNumCopyStrategies; ++i) {
    const auto s = static_cast<CopyStrategy>(i);
    if (copy_strategy_name(s) == name) return s;
  }
  if (name == "per_run") return CopyStrategy::kDmaPerRun;
  if (name == "batch") return CopyStrategy::kDmaBatch;
  if (name == "kernel" || name == "sm") return CopyStrategy::kSmKernel;
  if (name == "staged") return CopyStrategy::kStagedDma;
  if (name == "hybrid") return CopyStrategy::kSplit;
  return InvalidArgument(fmt::format(
      "unknown copy strategy '{}' (expected auto, dma_per_run, dma_batch, sm_kernel, staged_dma, split)", name));
}

std::string_view copy_direction_name(CopyDirection d) noexcept {
  switch (d) {
    case CopyDirection::kDeviceToHost: return "d2h";
    case CopyDirection::kHostToDevice: return "h2d";
    case CopyDirection::kDeviceToDevice: return "d2d";
    case CopyDirection::kHostToHost: return "h2h";
  }
  return "?";
}

CopyDirection copy_direction(MemoryKind src, MemoryKind dst) noexcept {
  const bool sd = src == MemoryKind::kDevice;
  const bool dd = dst == MemoryKind::kDevice;
  if (sd && dd) return CopyDirection::kDeviceToDevice;
  if (sd) return CopyDirection::kDeviceToHost;
  if (dd) return CopyDirection::kHostToDevice;
  return CopyDirection::kHostToHost;
}

Result<std::unique_ptr<CopyEngine>> CopyEngine::create(Device& device, const CopyEngineOptions& options) {
  KVTIER_RETURN_IF_ERROR(copy_detail::EngineBase::check_options(options));
  switch (device.backend()) {
    case BackendKind::kHost: return copy_detail::create_host_copy_engine(device, options);
    case BackendKind::kCuda: return copy_detail::create_cuda_copy_engine(device, options);
  }
  return InvalidArgument(fmt::format("unknown device backend {}", static_cast<int>(device.backend())));
}

namespace copy_detail {
namespace {
constexpr auto kSlotWaitTimeout = std::chrono::seconds(120);
constexpr auto kDrainTimeout = std::chrono::seconds(120);
constexpr std::uint64_t kMinSlotBytes = 16 * 1024;
}  // namespace

Status EngineBase::check_options(const CopyEngineOptions& o) {
  if (o.sm_threads_per_cta == 0 || o.sm_threads_per_cta % 32 != 0 || o.sm_threads_per_cta > 1024)
    return InvalidArgument(
        fmt::format("sm_threads_per_cta must be a multiple of 32 in [32, 1024], got {}", o.sm_threads_per_cta));
  if (o.sm_ctas_h2d == 0 || o.sm_ctas_d2h == 0 || o.sm_ctas_d2d == 0)
    return InvalidArgument(
        fmt::format("sm_ctas_* must be >= 1 (h2d {}, d2h {}, d2d {})", o.sm_ctas_h2d, o.sm_ctas_d2h, o.sm_ctas_d2d));
  if (o.sm_item_bytes == 0 || o.sm_item_bytes % 16 != 0)
    return InvalidArgument(fmt::format("sm_item_bytes must be a positive multiple of 16, got {}", o.sm_item_bytes));
  if (o.descriptor_slots == 0) return InvalidArgument("descriptor_slots must be >= 1, got 0");
  if (o.max_pairs_per_call == 0) return InvalidArgument("max_pairs_per_call must be >= 1, got 0");
  if (o.batch_max_descriptors == 0) return InvalidArgument("batch_max_descriptors must be >= 1, got 0");
  if (o.staged_slots == 0) return InvalidArgument("staged_slots must be >= 1, got 0");
  if (o.staged_slot_bytes < kStagedAlign)
    return InvalidArgument(fmt::format("staged_slot_bytes must be >= {}, got {}", kStagedAlign, o.staged_slot_bytes));
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
  if (o.split_dma_lanes == 0 || o.split_dma_lanes > 16)
    return InvalidArgument(fmt::format("split_dma_lanes must be in [1, 16], got {}", o.split_dma_lanes));
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

Status EngineBase::validate(const CopyRequest& request) const {
  KVTIER_RETURN_IF_ERROR(validate_request(request, device_.ordinal()));
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

namespace {
bool in_range(std::uint64_t v, std::uint64_t lo, std::uint64_t hi) { return v >= lo && v < hi; }
}  // namespace

bool EngineBase::idle_prefers_kernel(std::uint64_t avg, bool caller_busy, bool duplex, std::uint64_t kernel_max) const {
  // From an idle stream the GPU waits for the CPU to enqueue a batch's
  // descriptors; the kernel is one launch. Run 13 (--no-prequeue): H2D 64 KiB
  // batch 74 % vs kernel 91 %, 256 KiB 87 % vs 92 %, 1 MiB 96 % vs 92 %; D2H
  // 256 KiB 85 % vs 94 %. SMs kept out (kernel_max 0): never.
  return !caller_busy && !duplex && kernel_max > 0 && avg < options_.auto_idle_kernel_max_segment_bytes;
}

CopyStrategy EngineBase::choose_impl(const PlanSummary& s, const StreamState* self, bool caller_busy) const {
  const std::uint64_t avg = s.average_segment_bytes();
  if (s.segments <= options_.auto_per_run_max_segments || avg >= options_.auto_per_run_min_segment_bytes)
    return CopyStrategy::kDmaPerRun;
  switch (s.direction) {
    case CopyDirection::kDeviceToDevice: return CopyStrategy::kSmKernel;
    case CopyDirection::kHostToHost: return CopyStrategy::kDmaBatch;
    case CopyDirection::kDeviceToHost: {
      const bool duplex = s.full_duplex_hint || in_flight(CopyDirection::kHostToDevice, self);
      if (duplex &&
          in_range(avg, options_.auto_split_duplex_min_segment_bytes, options_.auto_split_duplex_max_segment_bytes))
        return CopyStrategy::kSplit;
      if (idle_prefers_kernel(avg, caller_busy, duplex, options_.auto_kernel_max_segment_bytes_d2h))
        return CopyStrategy::kSmKernel;
      if (avg >= options_.auto_kernel_max_segment_bytes_d2h) return CopyStrategy::kDmaBatch;
      if (avg >= options_.auto_duplex_dma_min_segment_bytes && duplex) return CopyStrategy::kDmaBatch;
      return CopyStrategy::kSmKernel;
    }
    case CopyDirection::kHostToDevice: {
      const bool duplex = s.full_duplex_hint || in_flight(CopyDirection::kDeviceToHost, self);
      // SMs kept out: only the DMA-lanes part of the split range remains.
      const std::uint64_t split_min =
          options_.auto_kernel_max_segment_bytes_h2d == 0
              ? std::max(options_.auto_split_h2d_min_segment_bytes, options_.auto_split_h2d_large_segment_bytes)
              : options_.auto_split_h2d_min_segment_bytes;
      // Behind queued work only (if so configured): enqueueing the DMA part
      // costs about as much CPU as the copy takes, which an idle stream would
      // wait for (run 12, timed from an idle stream: split 30-84 % vs the
      // kernel 72-91 % at 4-48 KiB).
      // Paused: the CPU could not keep the GPU fed even with the fewest DMA
      // descriptors (adaptive CPU budget at its maximum).
      const bool paused = options_.auto_split_cpu_budget_adaptive && tuner_.paused(split_size_class(s.direction, avg));
      const bool split_ok = (caller_busy || !options_.auto_split_only_behind_queued_work) && !paused &&
                            s.bytes >= options_.auto_split_min_request_bytes;
      if (split_ok && (duplex ? in_range(avg, options_.auto_split_duplex_min_segment_bytes,
                                         options_.auto_split_duplex_max_segment_bytes)
                              : in_range(avg, split_min, options_.auto_split_h2d_max_segment_bytes)))
        return CopyStrategy::kSplit;
      if (idle_prefers_kernel(avg, caller_busy, duplex, options_.auto_kernel_max_segment_bytes_h2d))
        return CopyStrategy::kSmKernel;
      if (avg >= options_.auto_kernel_max_segment_bytes_h2d) return CopyStrategy::kDmaBatch;
      if (avg >= options_.auto_duplex_dma_min_segment_bytes && duplex) return CopyStrategy::kDmaBatch;
      return CopyStrategy::kSmKernel;
    }
  }
  return CopyStrategy::kDmaBatch;
}

bool EngineBase::staged_preferred(const CopyRequest& r, const PlanSummary& s, PlanScratch& sc) const {
  std::uint64_t kernel_max = 0;
  switch (s.direction) {
    case CopyDirection::kHostToDevice: kernel_max = options_.auto_kernel_max_segment_bytes_h2d; break;
    case CopyDirection::kDeviceToHost: kernel_max = options_.auto_kernel_max_segment_bytes_d2h; break;
    case CopyDirection::kDeviceToDevice:
    case CopyDirection::kHostToHost: return false;
  }
  const std::uint64_t avg = s.average_segment_bytes();
  if (s.segments <= options_.auto_per_run_max_segments || avg >= options_.auto_per_run_min_segment_bytes ||
      avg >= kernel_max)
    return false;
  const bool h2d = s.direction == CopyDirection::kHostToDevice;
  // Full duplex: staged copies of both directions measured only ~55 GB/s
  // aggregate on the H200 (batched DMA ~100 from 32 KiB, kernels ~70 below):
  // leave it to the duplex and kernel rules.
  if (s.full_duplex_hint || in_flight(h2d ? CopyDirection::kDeviceToHost : CopyDirection::kHostToDevice, nullptr))
    return false;
  const std::span<const std::int32_t> host_ids = h2d ? r.src_blocks : r.dst_blocks;
  const std::uint64_t ranges = estimate_host_ranges(sc.planes, host_ids, h2d);
  if (ranges == 0 || s.bytes / ranges < options_.staged_min_host_run_bytes) return false;
  if (!plan_staged_chunks(sc.planes, host_ids, h2d, options_.staged_slot_bytes, options_.max_pairs_per_call, sc.staged)
           .ok())
    return false;
  return static_cast<double>(sc.staged.footprint) <= options_.staged_max_span_ratio * static_cast<double>(s.bytes);
}

CopyStrategy EngineBase::choose(const CopyRequest& request) const {
  if (!validate(request).ok() || request.src_blocks.empty()) return CopyStrategy::kDmaPerRun;
  PlanScratch scratch;
  select_planes(request, scratch.planes);
  find_runs(request.src_blocks, request.dst_blocks, scratch.runs);
  const PlanSummary summary = summarize(request, scratch.planes, scratch.runs);
  if (staged_preferred(request, summary, scratch)) return CopyStrategy::kStagedDma;
  return choose_impl(summary, nullptr);
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

Result<DescriptorSlot*> EngineBase::acquire_slot(StreamState& st, std::uint64_t bytes) {
  DescriptorSlot& slot = st.slots[st.next_slot];
  st.next_slot = (st.next_slot + 1) % static_cast<std::uint32_t>(st.slots.size());
  if (slot.pending) {
    // The ring wrapped onto a slot whose kernel may still read it.
    Status s = device_.synchronize(*slot.done, kSlotWaitTimeout);
    if (s.code() == StatusCode::kTimedOut) return s.with_context("waiting for a free kernel descriptor slot");
    slot.pending = false;  // other errors: the work behind it finished (failed); the slot is free
  }
  if (!slot.done) {
    KVTIER_ASSIGN_OR_RETURN(slot.done, device_.create_event());
  }
  if (slot.capacity < bytes) {
    const std::uint64_t cap = std::max({bytes, slot.capacity * 2, kMinSlotBytes});
    slot.staging.reset();
    slot.device.reset();
    KVTIER_ASSIGN_OR_RETURN(slot.staging, device_.allocate_pinned(cap));
    if (options_.sm_descriptors_in_device_memory) {
      KVTIER_ASSIGN_OR_RETURN(slot.device, device_.allocate_device(cap));
    }
    slot.capacity = cap;
  }
  return &slot;
}

Status EngineBase::run_kernel(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir,
                              CopyReport& report, const std::function<Status()>& after_upload) {
  bool hook_pending = static_cast<bool>(after_upload);
  const auto& planes = st.scratch.planes;
  auto& kplanes = st.scratch.kernel_planes;
  const std::uint32_t warps_per_cta = options_.sm_threads_per_cta / kWarpLanes;
  const std::uint32_t max_ctas = ctas_for(dir);
  const std::size_t n = r.src_blocks.size();
  for (std::size_t p0 = 0; p0 < planes.size(); p0 += kMaxKernelPlanes) {
    const auto g = static_cast<std::uint32_t>(std::min<std::size_t>(kMaxKernelPlanes, planes.size() - p0));
    kplanes.resize(g);
    for (std::uint32_t i = 0; i < g; ++i) {
      const SelectedPlane& sp = planes[p0 + i];
      kplanes[i] = KernelPlane{reinterpret_cast<std::uint64_t>(sp.src_base),
                               sp.src_stride,
                               reinterpret_cast<std::uint64_t>(sp.dst_base),
                               sp.dst_stride,
                               sp.block_bytes,
                               0,
                               0};
    }
    const std::uint32_t items_per_pair = assign_items(kplanes.data(), g, options_.sm_item_bytes);
    for (std::size_t i0 = 0; i0 < n; i0 += options_.max_pairs_per_call) {
      const auto count = static_cast<std::uint32_t>(std::min<std::size_t>(options_.max_pairs_per_call, n - i0));
      const std::uint64_t plane_bytes = std::uint64_t{g} * sizeof(KernelPlane);
      const std::uint64_t bytes = plane_bytes + std::uint64_t{count} * sizeof(KernelPair);
      KVTIER_ASSIGN_OR_RETURN(DescriptorSlot * slot, acquire_slot(st, bytes));
      std::byte* staging = slot->staging->data();
      std::memcpy(staging, kplanes.data(), plane_bytes);
      auto* pairs = reinterpret_cast<KernelPair*>(staging + plane_bytes);
      for (std::uint32_t k = 0; k < count; ++k) pairs[k] = KernelPair{r.src_blocks[i0 + k], r.dst_blocks[i0 + k]};
      std::byte* base = staging;
      if (options_.sm_descriptors_in_device_memory) {
        KVTIER_RETURN_IF_ERROR(device_.memcpy_async(slot->device.data(), staging, bytes, stream)
                                   .with_context("uploading kernel descriptors"));
        base = slot->device.bytes_ptr();
      }
      if (hook_pending) {
        hook_pending = false;
        Status hooked = after_upload();
        if (!hooked.ok()) {
          // The upload may be in flight: the slot is busy until it completes.
          if (device_.record(*slot->done, stream).ok()) slot->pending = true;
          return hooked;
        }
      }
      KernelArgs args;
      args.planes = reinterpret_cast<const KernelPlane*>(base);
      args.pairs = reinterpret_cast<const KernelPair*>(base + plane_bytes);
      args.num_planes = g;
      args.num_pairs = count;
      args.item_bytes = options_.sm_item_bytes;
      args.items_per_pair = items_per_pair;
      args.num_items = std::uint64_t{count} * items_per_pair;
      const std::uint64_t useful = (args.num_items + warps_per_cta - 1) / warps_per_cta;
      const auto ctas =
          static_cast<std::uint32_t>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(max_ctas, useful)));
      Status launched = launch_kernel(st, stream, args, ctas, staging, bytes);
      // Record even after a failed launch attempt: the upload may be in flight.
      Status recorded = device_.record(*slot->done, stream);
      if (recorded.ok()) slot->pending = true;
      KVTIER_RETURN_IF_ERROR(launched);
      KVTIER_RETURN_IF_ERROR(recorded);
      report.ctas = std::max(report.ctas, ctas);
      ++report.calls;
    }
  }
  return Status::Ok();
}

Result<StagedStreamState*> EngineBase::staged_state(StreamState& st) {
  if (st.staged) return st.staged.get();
  auto ss = std::make_unique<StagedStreamState>();
  StreamOptions so;
  // The D2D kernels sit between DMAs on the pipeline's critical path.
  so.priority = StreamPriority::kHigh;
  so.name = fmt::format("kvtier-staged-aux-{}", st.stream_id);
  KVTIER_ASSIGN_OR_RETURN(ss->aux, device_.create_stream(so));
  KVTIER_ASSIGN_OR_RETURN(ss->entry, device_.create_event());
  ss->slots.resize(options_.staged_slots);
  for (StagedSlot& slot : ss->slots) {
    KVTIER_ASSIGN_OR_RETURN(slot.staging, device_.allocate_device(options_.staged_slot_bytes));
    KVTIER_ASSIGN_OR_RETURN(slot.dma_done, device_.create_event());
    KVTIER_ASSIGN_OR_RETURN(slot.kern_done, device_.create_event());
  }
  st.staged = std::move(ss);
  return st.staged.get();
}

namespace {
// Makes `stream` wait for the last kernel queued on the aux stream on every
// path out of run_staged, so later work on the caller's stream never
// overtakes a staged kernel (also after a partial failure).
struct JoinAux {
  Device& device;
  Stream& stream;
  Event* last = nullptr;
  ~JoinAux() {
    if (last != nullptr) device.wait(stream, *last).ignore_error();
  }
};
}  // namespace

Status EngineBase::run_staged(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir,
                              CopyReport& report) {
  KVTIER_ASSIGN_OR_RETURN(StagedStreamState * ss, staged_state(st));
  Stream& aux = *ss->aux;
  const bool h2d = dir == CopyDirection::kHostToDevice;
  const std::span<const std::int32_t> host_ids = h2d ? r.src_blocks : r.dst_blocks;
  const auto& planes = st.scratch.planes;
  StagedScratch& sc = st.scratch.staged;
  const auto& chunks = sc.chunks;
  const auto num_planes = static_cast<std::uint32_t>(planes.size());
  const std::uint32_t groups = (num_planes + kMaxKernelPlanes - 1) / kMaxKernelPlanes;
  const std::uint64_t table_bytes = std::uint64_t{num_planes} * sizeof(KernelPlane);  // per chunk
  const std::uint32_t warps_per_cta = options_.sm_threads_per_cta / kWarpLanes;
  const auto num_slots = static_cast<std::uint32_t>(ss->slots.size());
  report.chunks = static_cast<std::uint32_t>(chunks.size());

  auto min_max = [&](const StagedChunk& c) {
    std::int32_t lo = host_ids[c.first], hi = lo;
    for (std::uint32_t k = 1; k < c.count; ++k) {
      lo = std::min(lo, host_ids[c.first + k]);
      hi = std::max(hi, host_ids[c.first + k]);
    }
    return std::pair{lo, hi};
  };

  JoinAux join{device_, stream};
  if (!h2d) {
    // The gather kernels read device blocks that work already on `stream` may write.
    KVTIER_RETURN_IF_ERROR(device_.record(*ss->entry, stream));
    KVTIER_RETURN_IF_ERROR(device_.wait(aux, *ss->entry));
  }
  for (std::size_t c0 = 0; c0 < chunks.size();) {
    // A batch of chunks shares one descriptor slot: their plane tables, then their pairs.
    std::size_t c1 = c0;
    std::uint64_t batch_pairs = 0;
    while (c1 < chunks.size() && (c1 == c0 || batch_pairs + chunks[c1].count <= options_.max_pairs_per_call))
      batch_pairs += chunks[c1++].count;
    const std::uint64_t pairs_at = (c1 - c0) * table_bytes;
    const std::uint64_t bytes = pairs_at + batch_pairs * sizeof(KernelPair);
    KVTIER_ASSIGN_OR_RETURN(DescriptorSlot * dslot, acquire_slot(st, bytes));
    std::byte* staging = dslot->staging->data();
    // Plane tables: the host side points into the chunk's staging slot
    // (mirror mapping; uint64 arithmetic may wrap, the kernel adds id * stride).
    auto* pairs = reinterpret_cast<KernelPair*>(staging + pairs_at);
    for (std::size_t c = c0; c < c1; ++c) {
      const StagedChunk& chunk = chunks[c];
      const auto slot_base =
          reinterpret_cast<std::uint64_t>(ss->slots[(ss->next + (c - c0)) % num_slots].staging.data());
      const auto [lo, hi] = min_max(chunk);
      staged_intervals(planes, h2d, lo, hi, sc);
      auto* table = reinterpret_cast<KernelPlane*>(staging + (c - c0) * table_bytes);
      for (std::uint32_t p = 0; p < num_planes; ++p) {
        const SelectedPlane& sp = planes[p];
        KernelPlane kp{reinterpret_cast<std::uint64_t>(sp.src_base),
                       sp.src_stride,
                       reinterpret_cast<std::uint64_t>(sp.dst_base),
                       sp.dst_stride,
                       sp.block_bytes,
                       0,
                       0};
        std::uint64_t& host_base = h2d ? kp.src_base : kp.dst_base;
        const std::uint64_t stride = h2d ? kp.src_stride : kp.dst_stride;
        const std::uint64_t first = static_cast<std::uint64_t>(lo) * stride;
        host_base = slot_base + staged_offset(sc, host_base + first) - first;
        table[p] = kp;
      }
      for (std::uint32_t g = 0; g < groups; ++g)
        assign_items(table + g * kMaxKernelPlanes, std::min(kMaxKernelPlanes, num_planes - g * kMaxKernelPlanes),
                     options_.sm_item_bytes);
      for (std::uint32_t k = 0; k < chunk.count; ++k)
        *pairs++ = KernelPair{r.src_blocks[chunk.first + k], r.dst_blocks[chunk.first + k]};
    }
    std::byte* base = staging;
    if (options_.sm_descriptors_in_device_memory) {
      // On the aux stream, where the kernels run.
      KVTIER_RETURN_IF_ERROR(device_.memcpy_async(dslot->device.data(), staging, bytes, aux)
                                 .with_context("uploading staged kernel descriptors"));
      base = dslot->device.bytes_ptr();
    }
    auto run_batch_chunks = [&]() -> Status {
      std::uint64_t pair_index = 0;
      for (std::size_t c = c0; c < c1; ++c) {
        const StagedChunk& chunk = chunks[c];
        StagedSlot& slot = ss->slots[ss->next];
        ss->next = (ss->next + 1) % num_slots;
        auto* slot_base = slot.staging.bytes_ptr();
        const auto [lo, hi] = min_max(chunk);
        staged_intervals(planes, h2d, lo, hi, sc);
        staged_host_runs(planes, h2d, host_ids.subspan(chunk.first, chunk.count), sc);
        auto launch = [&]() -> Status {
          const std::uint64_t table_at = (c - c0) * table_bytes;
          for (std::uint32_t g = 0; g < groups; ++g) {
            const std::uint32_t count = std::min(kMaxKernelPlanes, num_planes - g * kMaxKernelPlanes);
            const std::uint64_t plane_at = table_at + std::uint64_t{g} * kMaxKernelPlanes * sizeof(KernelPlane);
            const auto* host_table = reinterpret_cast<const KernelPlane*>(staging + plane_at);
            const KernelPlane& last = host_table[count - 1];
            KernelArgs args;
            args.planes = reinterpret_cast<const KernelPlane*>(base + plane_at);
            args.pairs = reinterpret_cast<const KernelPair*>(base + pairs_at) + pair_index;
            args.num_planes = count;
            args.num_pairs = chunk.count;
            args.item_bytes = options_.sm_item_bytes;
            args.items_per_pair = last.item_offset + last.items;
            args.num_items = std::uint64_t{chunk.count} * args.items_per_pair;
            const std::uint64_t useful = (args.num_items + warps_per_cta - 1) / warps_per_cta;
            const auto ctas = static_cast<std::uint32_t>(
                std::max<std::uint64_t>(1, std::min<std::uint64_t>(options_.sm_ctas_d2d, useful)));
            KVTIER_RETURN_IF_ERROR(
                launch_kernel(st, aux, args, ctas, staging + plane_at, std::uint64_t{count} * sizeof(KernelPlane)));
            report.ctas = std::max(report.ctas, ctas);
            ++report.calls;
          }
          return Status::Ok();
        };
        auto dma = [&]() -> Status {
          for (const HostRun& run : sc.runs) {
            auto* host = reinterpret_cast<std::byte*>(run.host);
            Status s = h2d ? device_.memcpy_async(slot_base + run.offset, host, run.bytes, stream)
                           : device_.memcpy_async(host, slot_base + run.offset, run.bytes, stream);
            if (!s.ok()) return s.with_context(fmt::format("staged DMA of {} bytes (chunk {})", run.bytes, c));
            ++report.calls;
          }
          return Status::Ok();
        };
        if (h2d) {
          if (slot.kern_used) KVTIER_RETURN_IF_ERROR(device_.wait(stream, *slot.kern_done));  // slot free
          KVTIER_RETURN_IF_ERROR(dma());
          KVTIER_RETURN_IF_ERROR(device_.record(*slot.dma_done, stream));
          slot.dma_used = true;
          KVTIER_RETURN_IF_ERROR(device_.wait(aux, *slot.dma_done));
          KVTIER_RETURN_IF_ERROR(launch());
          KVTIER_RETURN_IF_ERROR(device_.record(*slot.kern_done, aux));
          slot.kern_used = true;
          join.last = slot.kern_done.get();
        } else {
          if (slot.dma_used) KVTIER_RETURN_IF_ERROR(device_.wait(aux, *slot.dma_done));  // slot free
          KVTIER_RETURN_IF_ERROR(launch());
          KVTIER_RETURN_IF_ERROR(device_.record(*slot.kern_done, aux));
          slot.kern_used = true;
          join.last = slot.kern_done.get();
          KVTIER_RETURN_IF_ERROR(device_.wait(stream, *slot.kern_done));
          join.last = nullptr;
          KVTIER_RETURN_IF_ERROR(dma());
          KVTIER_RETURN_IF_ERROR(device_.record(*slot.dma_done, stream));
          slot.dma_used = true;
        }
        pair_index += chunk.count;
      }
      return Status::Ok();
    };
    Status ran = run_batch_chunks();
    // Record even after a failure: the upload or some kernels may be in flight.
    Status recorded = device_.record(*dslot->done, aux);
    if (recorded.ok()) dslot->pending = true;
    KVTIER_RETURN_IF_ERROR(ran);
    KVTIER_RETURN_IF_ERROR(recorded);
    c0 = c1;
  }
  if (join.last != nullptr) {
    Event* last = join.last;
    join.last = nullptr;
    KVTIER_RETURN_IF_ERROR(device_.wait(stream, *last));
  }
  return Status::Ok();
}

Result<SplitStreamState*> EngineBase::split_state(StreamState& st) {
  if (st.split) return st.split.get();
  auto ss = std::make_unique<SplitStreamState>();
  KVTIER_ASSIGN_OR_RETURN(ss->fork, device_.create_event());
  ss->lanes.resize(options_.split_dma_lanes);
  for (std::size_t i = 0; i < ss->lanes.size(); ++i) {
    StreamOptions so;
    so.priority = StreamPriority::kHigh;
    so.name = fmt::format("kvtier-split-lane-{}-{}", st.stream_id, i);
    KVTIER_ASSIGN_OR_RETURN(ss->lanes[i].stream, device_.create_stream(so));
    KVTIER_ASSIGN_OR_RETURN(ss->lanes[i].done, device_.create_event());
  }
  st.split = std::move(ss);
  return st.split.get();
}

namespace {
// Makes the caller's stream wait for every lane that got work, on every path
// out of run_split (later work on it must never overtake a lane's DMA).
struct JoinLanes {
  Device& device;
  Stream& stream;
  SplitStreamState* ss = nullptr;
  std::size_t used = 0;
  Status join() {
    Status first;
    for (std::size_t i = 0; i < used; ++i) {
      Status s = device.wait(stream, *ss->lanes[i].done);
      if (first.ok() && !s.ok()) first = s;
    }
    used = 0;
    return first;
  }
  ~JoinLanes() { join().ignore_error(); }
};
}  // namespace

double balanced_split_share(double share, double kernel_bytes, double kernel_ms, double dma_bytes, double dma_ms) {
  if (!(kernel_bytes > 0 && dma_bytes > 0) || std::isnan(kernel_ms) || std::isnan(dma_ms)) return share;
  // A part that finished within the timer's resolution of the fork (or even
  // "before" it, when the two clocks' stamps race) counts as 1 us.
  constexpr double kResolutionMs = 1e-3;
  kernel_ms = std::max(kernel_ms, kResolutionMs);
  dma_ms = std::max(dma_ms, kResolutionMs);
  const double kernel_rate = kernel_bytes / kernel_ms;
  const double dma_rate = dma_bytes / dma_ms;
  return kernel_rate / (kernel_rate + dma_rate);
}

std::uint32_t split_size_class(CopyDirection dir, std::uint64_t average_segment_bytes) {
  const double half_octaves =
      std::floor(2.0 * std::log2(static_cast<double>(std::max<std::uint64_t>(1, average_segment_bytes))));
  return static_cast<std::uint32_t>(dir) * 256u + static_cast<std::uint32_t>(half_octaves);
}

double SplitTuner::share(std::uint32_t size_class, double initial) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.share ? *it->second.share : initial;
}

void SplitTuner::observe(std::uint32_t size_class, double share, double kernel_bytes, double kernel_ms,
                         double dma_bytes, double dma_ms, double gain, double lo, double hi) {
  const double target = balanced_split_share(share, kernel_bytes, kernel_ms, dma_bytes, dma_ms);
  std::lock_guard lock(mu_);
  // Several streams may report samples taken at older shares: step from
  // the current value toward this sample's balance point.
  ClassState& c = classes_[size_class];
  const double current = c.share.value_or(share);
  c.share = std::clamp(current + gain * (target - current), lo, hi);
}

double SplitTuner::budget(std::uint32_t size_class, double initial) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.budget ? *it->second.budget : initial;
}

void SplitTuner::report_submission(std::uint32_t size_class, double budget, bool cpu_late, double lo, double hi) {
  constexpr double kStep = 1.25;
  std::lock_guard lock(mu_);
  ClassState& c = classes_[size_class];
  const double current = c.budget.value_or(budget);
  c.budget = std::clamp(cpu_late ? current * kStep : current / kStep, lo, hi);
  if (cpu_late) {
    c.backoff = c.backoff == 0 ? kSplitPauseCopies : std::min(2 * c.backoff, kSplitMaxPauseCopies);
    c.pause = c.backoff;
  } else {
    c.backoff = 0;
  }
}

bool SplitTuner::paused(std::uint32_t size_class) const {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  return it != classes_.end() && it->second.pause > 0;
}

void SplitTuner::note_copy_while_paused(std::uint32_t size_class) {
  std::lock_guard lock(mu_);
  auto it = classes_.find(size_class);
  if (it != classes_.end() && it->second.pause > 0) --it->second.pause;
}

double EngineBase::split_budget(std::uint32_t size_class) const {
  const auto initial = static_cast<double>(options_.auto_split_payload_bytes_per_dma_descriptor);
  if (initial <= 0 || !options_.auto_split_cpu_budget_adaptive) return initial;
  return tuner_.budget(size_class, initial);
}

double EngineBase::split_share(const PlanSummary& s, bool automatic) const {
  if (!automatic) return options_.split_kernel_share;
  if (s.direction != CopyDirection::kHostToDevice || options_.auto_kernel_max_segment_bytes_h2d == 0) return 0.0;
  const std::uint64_t avg = s.average_segment_bytes();
  double share = avg >= options_.auto_split_h2d_large_segment_bytes  ? options_.auto_split_h2d_kernel_share_large
                 : avg < options_.auto_split_h2d_small_segment_bytes ? options_.auto_split_h2d_kernel_share_small
                                                                     : options_.auto_split_h2d_kernel_share;
  if (options_.auto_split_adaptive) share = tuner_.share(split_size_class(s.direction, avg), share);
  // CPU budget: enqueueing a DMA descriptor costs ~0.8-0.9 us of CPU, about
  // the time the link needs for 45-50 KB. Give the DMA part at most one
  // descriptor per budget bytes of payload (adaptive: copy_engine.h), so
  // that a caller streaming copies does not become CPU-bound (measured host
  // API time 6-14 ms for 5 ms of copy at 4 KiB without the cap, run 11).
  const double budget = split_budget(split_size_class(s.direction, avg));
  if (budget > 0 && s.segments > 0) {
    const double max_dma = static_cast<double>(s.bytes) / budget / static_cast<double>(s.segments);
    share = std::max(share, 1.0 - std::min(1.0, max_dma));
  }
  return share;
}

void EngineBase::harvest_split_timing(StreamState& st) {
  if (!st.split) return;
  for (SplitTiming& t : st.split->timing) {
    if (!t.pending) continue;
    Result<double> kernel_ms = device_.elapsed_ms(*t.fork, *t.kernel_end);
    if (!kernel_ms.ok() && kernel_ms.status().code() == StatusCode::kUnavailable) continue;
    double dma_ms = 0;
    bool ready = kernel_ms.ok(), failed = !kernel_ms.ok();
    for (std::size_t i = 0; i < t.lanes && ready; ++i) {
      Result<double> lane_ms = device_.elapsed_ms(*t.fork, *t.lane_end[i]);
      if (!lane_ms.ok()) {
        ready = false;
        failed = lane_ms.status().code() != StatusCode::kUnavailable;
        break;
      }
      dma_ms = std::max(dma_ms, *lane_ms);
    }
    if (ready)
      tuner_.observe(t.size_class, t.share, t.kernel_bytes, *kernel_ms, t.dma_bytes, dma_ms,
                     options_.auto_split_adaptive_gain, options_.auto_split_adaptive_min_share,
                     options_.auto_split_adaptive_max_share);
    // A copy that failed is not a sample (its error reaches the caller
    // through the stream); drop it.
    if (ready || failed) t.pending = false;
  }
}

Status EngineBase::run_split(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir,
                             double kernel_share, bool automatic, const PlanSummary& summary, CopyReport& report) {
  KVTIER_ASSIGN_OR_RETURN(SplitStreamState * ss, split_state(st));
  const std::size_t n = r.src_blocks.size();
  auto kernel_pairs = static_cast<std::size_t>(static_cast<double>(n) * kernel_share);
  kernel_pairs = std::min(kernel_pairs, n);
  const std::size_t dma_pairs = n - kernel_pairs;
  // kAuto: one lane below the large-segment size (measured on the H200, runs
  // 7-8: with a kernel share, two lanes lost 10-15 points at 4-16 KiB).
  const std::uint64_t avg = summary.average_segment_bytes();
  const std::size_t lane_limit =
      automatic && avg < options_.auto_split_h2d_large_segment_bytes && kernel_share > 0 ? 1 : ss->lanes.size();
  const std::size_t lanes = std::min<std::size_t>(lane_limit, dma_pairs);
  report.lanes = static_cast<std::uint32_t>(lanes);
  // Timing (adaptive kAuto): a free slot, when both parts have work.
  SplitTiming* timing = nullptr;
  if (adaptive_split(automatic) && kernel_pairs > 0 && lanes > 0) {
    for (SplitTiming& t : ss->timing)
      if (!t.pending) {
        timing = &t;
        break;
      }
    if (timing != nullptr && !timing->fork) {
      const EventOptions timed{.timing = true};
      KVTIER_ASSIGN_OR_RETURN(timing->fork, device_.create_event(timed));
      KVTIER_ASSIGN_OR_RETURN(timing->kernel_end, device_.create_event(timed));
      timing->lane_end.resize(ss->lanes.size());
      for (auto& lane_end : timing->lane_end) {
        KVTIER_ASSIGN_OR_RETURN(lane_end, device_.create_event(timed));
      }
    }
  }
  JoinLanes join{device_, stream, ss};
  // The fork: the lanes read/write blocks that work already on `stream` may
  // touch, so they wait for it. With a kernel part the fork goes after the
  // kernel's descriptor upload: that small DMA shares the copy engines with
  // the lanes, and queued behind thousands of lane descriptors it would hold
  // the kernel back for most of the copy (seen on the H200 as slow samples,
  // run 18).
  auto fork = [&]() -> Status {
    if (lanes == 0) return Status::Ok();
    KVTIER_RETURN_IF_ERROR(device_.record(*ss->fork, stream));
    // Timed: the lanes wait for the timing fork (recorded right after, the
    // same point of the stream), so no lane can start before its stamp.
    Event* start = ss->fork.get();
    if (timing != nullptr) {
      KVTIER_RETURN_IF_ERROR(device_.record(*timing->fork, stream));
      start = timing->fork.get();
    }
    for (std::size_t i = 0; i < lanes; ++i) KVTIER_RETURN_IF_ERROR(device_.wait(*ss->lanes[i].stream, *start));
    return Status::Ok();
  };
  if (kernel_pairs > 0) {
    // First: one launch, so the SMs start while the DMA parts are submitted.
    CopyRequest part = r;
    part.src_blocks = r.src_blocks.subspan(0, kernel_pairs);
    part.dst_blocks = r.dst_blocks.subspan(0, kernel_pairs);
    KVTIER_RETURN_IF_ERROR(run_kernel(st, stream, part, dir, report, fork));
    if (timing != nullptr) KVTIER_RETURN_IF_ERROR(device_.record(*timing->kernel_end, stream));
  } else {
    KVTIER_RETURN_IF_ERROR(fork());
  }
  PlanScratch& sc = st.scratch;
  std::size_t begin = kernel_pairs;
  for (std::size_t i = 0; i < lanes; ++i) {
    const std::size_t count = dma_pairs / lanes + (i < dma_pairs % lanes ? 1 : 0);
    CopyRequest part = r;
    part.src_blocks = r.src_blocks.subspan(begin, count);
    part.dst_blocks = r.dst_blocks.subspan(begin, count);
    begin += count;
    find_runs(part.src_blocks, part.dst_blocks, sc.runs);
    build_segments(part, sc.planes, sc.runs, sc.segments);
    report.segments += sc.segments.size();
    SplitLane& lane = ss->lanes[i];
    Status ran = run_batch(st, *lane.stream, sc.segments, dir, /*gated=*/false);
    // Recorded even after a failure: part of the batch may be queued.
    Status recorded = device_.record(*lane.done, *lane.stream);
    if (recorded.ok()) join.used = i + 1;
    KVTIER_RETURN_IF_ERROR(ran.with_context(fmt::format("split lane {} ({} pairs)", i, count)));
    KVTIER_RETURN_IF_ERROR(recorded);
    if (timing != nullptr) KVTIER_RETURN_IF_ERROR(device_.record(*timing->lane_end[i], *lane.stream));
    report.calls += static_cast<std::uint32_t>((sc.segments.size() + options_.batch_max_descriptors - 1) /
                                               options_.batch_max_descriptors);
  }
  if (automatic && lanes > 0 && options_.auto_split_cpu_budget_adaptive &&
      options_.auto_split_payload_bytes_per_dma_descriptor > 0) {
    // Did the GPU wait for this submission? The fork completed already: the
    // work queued ahead ran out before the last lane was enqueued.
    Result<bool> reached = device_.query(*ss->fork);
    if (reached.ok()) {
      const std::uint32_t size_class = split_size_class(dir, avg);
      tuner_.report_submission(size_class, split_budget(size_class), *reached,
                               static_cast<double>(options_.auto_split_min_payload_bytes_per_dma_descriptor),
                               static_cast<double>(options_.auto_split_max_payload_bytes_per_dma_descriptor));
    }
  }
  if (timing != nullptr) {
    const double pair_bytes = static_cast<double>(summary.bytes) / static_cast<double>(n);
    timing->pending = true;
    timing->size_class = split_size_class(dir, avg);
    timing->share = kernel_share;
    timing->kernel_bytes = pair_bytes * static_cast<double>(kernel_pairs);
    timing->dma_bytes = pair_bytes * static_cast<double>(dma_pairs);
    timing->lanes = lanes;
  }
  return join.join();
}

Status EngineBase::note_enqueued(StreamState& st, Stream& stream, CopyDirection dir) {
  const auto d = static_cast<std::size_t>(dir);
  std::lock_guard track(st.track_mu);
  KVTIER_RETURN_IF_ERROR(device_.record(*st.last[d], stream));
  st.maybe_pending[d] = true;
  return Status::Ok();
}

Result<CopyReport> EngineBase::copy(const CopyRequest& r, Stream& stream) {
  if (&stream.device() != &device_)
    return InvalidArgument(fmt::format("stream {} belongs to device '{}', not to this copy engine's device '{}'",
                                       stream.id(), stream.device().name(), device_.name()));
  KVTIER_RETURN_IF_ERROR(validate_request(r, device_.ordinal()));
  CopyReport report;
  report.direction = copy_direction(r.src->kind(), r.dst->kind());
  report.strategy = r.strategy;
  if (r.src_blocks.empty()) return report;

  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<StreamState> st, state_for(stream));
  std::lock_guard lock(st->mu);
  PlanScratch& sc = st->scratch;
  select_planes(r, sc.planes);
  find_runs(r.src_blocks, r.dst_blocks, sc.runs);
  const PlanSummary summary = summarize(r, sc.planes, sc.runs);
  CopyStrategy strategy = r.strategy;
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
      report.gated = supports_gate() && dir == CopyDirection::kHostToDevice &&
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

}  // namespace copy_detail
}  // namespace kvtier
