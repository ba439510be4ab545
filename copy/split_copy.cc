// kSplit: one request cut into an SM-kernel part on the caller's stream and
// a batched-DMA part over split_dma_lanes lane streams, forked from the
// caller's stream and joined back into it on every path out. The kernel's
// share is split_kernel_share when kSplit was asked for, kAuto's profile
// otherwise (tuned by the SplitTuner, split_tuner.cc, from the timed splits
// harvest_split_timing() collects); the lanes are made on first use.
#include <fmt/format.h>

#include <algorithm>

#include "copy/engine_base.h"

namespace kvtier::copy_detail {

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
  // API time 6-14 ms for 5 ms of copy at 4 KiB without the cap, on an H200).
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
      // Made whole or not at all: `fork` marks the slot as having its events, so a slot left with `fork` and
      // without the others (an event creation failed) was used later through their null pointers.
      const EventOptions timed{.timing = true};
      KVTIER_ASSIGN_OR_RETURN(auto fork, device_.create_event(timed));
      KVTIER_ASSIGN_OR_RETURN(auto kernel_end, device_.create_event(timed));
      std::vector<std::unique_ptr<Event>> lane_end(ss->lanes.size());
      for (auto& e : lane_end) {
        KVTIER_ASSIGN_OR_RETURN(e, device_.create_event(timed));
      }
      timing->kernel_end = std::move(kernel_end);
      timing->lane_end = std::move(lane_end);
      timing->fork = std::move(fork);
    }
  }
  JoinLanes join{device_, stream, ss};
  // The fork: the lanes read/write blocks that work already on `stream` may
  // touch, so they wait for it. With a kernel part the fork goes after the
  // kernel's descriptor upload: that small DMA shares the copy engines with
  // the lanes, and queued behind thousands of lane descriptors it would hold
  // the kernel back for most of the copy (seen on the H200 as slow samples;
  // docs/architecture.md, copy).
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

}  // namespace kvtier::copy_detail
