// kStagedDma (copy_engine.h, "Staged DMA"): host<->device copies through
// device staging slots. Per chunk, a few large DMAs between the host runs and
// a slot on the caller's stream, and the D2D kernel between the slot and the
// scattered device blocks on an auxiliary stream; the per-stream slots and
// aux stream are made on the first staged copy.
#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <utility>

#include "copy/engine_base.h"
#include "copy/kernel_plan.h"

namespace kvtier::copy_detail {

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
  const std::span<const BlockId> host_ids = h2d ? r.src_blocks : r.dst_blocks;
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
    BlockId lo = host_ids[c.first], hi = lo;
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
        *pairs++ = kernel_pair(r.src_blocks[chunk.first + k], r.dst_blocks[chunk.first + k]);
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

}  // namespace kvtier::copy_detail
