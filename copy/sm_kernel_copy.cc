// kSmKernel, and the kernel descriptor protocol every launch of the copy
// kernel goes through (kStagedDma's and kSplit's too): the per-stream ring of
// descriptor slots (pinned staging, uploaded to device memory when
// sm_descriptors_in_device_memory, reused once the kernel that read it has
// completed), and run_kernel(), which cuts a request into launches of at
// most max_pairs_per_call pairs and kMaxKernelPlanes planes for the
// backend's launch_kernel().
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "copy/engine_base.h"
#include "copy/kernel_plan.h"

namespace kvtier::copy_detail {

namespace {
constexpr auto kSlotWaitTimeout = std::chrono::seconds(120);
constexpr std::uint64_t kMinSlotBytes = 16 * 1024;
// Smallest work item the kernel is cut into for small requests: 32 lanes x 16 B x 4 loads in flight.
constexpr std::uint64_t kMinItemBytes = 2048;
}  // namespace

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
    slot.capacity = 0;  // until both are there again: a failed allocation must not leave a slot that seems to fit
    KVTIER_ASSIGN_OR_RETURN(slot.staging, device_.allocate_pinned(cap));
    if (options_.sm_descriptors_in_device_memory) {
      KVTIER_ASSIGN_OR_RETURN(slot.device, device_.allocate_device(cap));
    }
    slot.capacity = cap;
  }
  return &slot;
}

Status EngineBase::run_kernel(StreamState& st, Stream& stream, const CopyRequest& r, CopyDirection dir,
                              CopyReport& report, const std::function<Status()>& after_upload, bool store) {
  auto* const checksums = reinterpret_cast<unsigned long long*>(r.checksums);
  // A copy that reads back what it wrote: more CTAs (its checksum arithmetic doubles) and small items (each warp
  // keeps one item in L2 until it reads it back).
  auto* const landed =
      store && checksums != nullptr ? reinterpret_cast<unsigned long long*>(r.landed_checksums) : nullptr;
  bool hook_pending = static_cast<bool>(after_upload);
  const auto& planes = st.scratch.planes;
  auto& kplanes = st.scratch.kernel_planes;
  const std::uint32_t warps_per_cta = options_.sm_threads_per_cta / kWarpLanes;
  const std::uint32_t max_ctas = landed == nullptr ? ctas_for(dir)
                                 : options_.sm_ctas_landed > 0
                                     ? options_.sm_ctas_landed
                                     : static_cast<std::uint32_t>(std::max(1, device_.multiprocessor_count()));
  const std::uint64_t max_item_bytes = landed == nullptr ? options_.sm_item_bytes : options_.sm_landed_item_bytes;
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
    // Small requests get smaller items, so that every warp of max_ctas CTAs
    // has one (a 1 MiB request of 32 KiB blocks in 64 KiB items kept 2 CTAs
    // busy, at 0.63 of the H2D ceiling); never below kMinItemBytes, where a
    // warp's 16-byte lanes with kUnroll loads in flight would idle.
    std::uint64_t payload = 0;
    for (std::uint32_t i = 0; i < g; ++i) payload += kplanes[i].block_bytes;
    payload *= n;
    const std::uint64_t warps_wanted = std::uint64_t{max_ctas} * warps_per_cta;
    const std::uint64_t fair = ((payload + warps_wanted - 1) / warps_wanted + 15) / 16 * 16;
    const auto item_bytes = static_cast<std::uint32_t>(
        std::min<std::uint64_t>(max_item_bytes, std::max<std::uint64_t>(fair, kMinItemBytes)));
    const std::uint32_t items_per_pair = assign_items(kplanes.data(), g, item_bytes);
    auto ctas_for_items = [&](std::uint64_t items) {
      const std::uint64_t useful = (items + warps_per_cta - 1) / warps_per_cta;
      return static_cast<std::uint32_t>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(max_ctas, useful)));
    };
    const std::uint32_t inline_max =
        g <= kInlineMaxPlanes ? std::min(options_.sm_inline_descriptor_max_pairs, options_.max_pairs_per_call) : 0;
    if (inline_max > 0 && n <= std::size_t{inline_max} * 4) {
      // Descriptors in the kernel parameters: back-to-back launches with
      // nothing between them on the stream. Requests of up to four launches
      // go this way; larger ones amortize the upload over bigger launches.
      auto& pairs = st.scratch.kernel_pairs;
      for (std::size_t i0 = 0; i0 < n; i0 += inline_max) {
        const auto count = static_cast<std::uint32_t>(std::min<std::size_t>(inline_max, n - i0));
        pairs.resize(count);
        for (std::uint32_t k = 0; k < count; ++k) pairs[k] = kernel_pair(r.src_blocks[i0 + k], r.dst_blocks[i0 + k]);
        if (hook_pending) {
          hook_pending = false;
          KVTIER_RETURN_IF_ERROR(after_upload());
        }
        KernelArgs args;
        args.checksums = checksums != nullptr ? checksums + i0 : nullptr;
        args.landed = landed != nullptr ? landed + i0 : nullptr;
        args.plane_index_base = static_cast<std::uint32_t>(p0);
        args.store = store ? 1 : 0;
        args.num_planes = g;
        args.num_pairs = count;
        args.item_bytes = item_bytes;
        args.items_per_pair = items_per_pair;
        args.num_items = std::uint64_t{count} * items_per_pair;
        const std::uint32_t ctas = ctas_for_items(args.num_items);
        KVTIER_RETURN_IF_ERROR(launch_kernel_inline(st, stream, args, kplanes.data(), pairs.data(), ctas));
        report.ctas = std::max(report.ctas, ctas);
        ++report.calls;
      }
      continue;
    }
    for (std::size_t i0 = 0; i0 < n; i0 += options_.max_pairs_per_call) {
      const auto count = static_cast<std::uint32_t>(std::min<std::size_t>(options_.max_pairs_per_call, n - i0));
      const std::uint64_t plane_bytes = std::uint64_t{g} * sizeof(KernelPlane);
      const std::uint64_t bytes = plane_bytes + std::uint64_t{count} * sizeof(KernelPair);
      KVTIER_ASSIGN_OR_RETURN(DescriptorSlot * slot, acquire_slot(st, bytes));
      std::byte* staging = slot->staging->data();
      std::memcpy(staging, kplanes.data(), plane_bytes);
      auto* pairs = reinterpret_cast<KernelPair*>(staging + plane_bytes);
      for (std::uint32_t k = 0; k < count; ++k) pairs[k] = kernel_pair(r.src_blocks[i0 + k], r.dst_blocks[i0 + k]);
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
      args.checksums = checksums != nullptr ? checksums + i0 : nullptr;
      args.landed = landed != nullptr ? landed + i0 : nullptr;
      args.plane_index_base = static_cast<std::uint32_t>(p0);
      args.store = store ? 1 : 0;
      args.num_planes = g;
      args.num_pairs = count;
      args.item_bytes = item_bytes;
      args.items_per_pair = items_per_pair;
      args.num_items = std::uint64_t{count} * items_per_pair;
      const std::uint32_t ctas = ctas_for_items(args.num_items);
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

}  // namespace kvtier::copy_detail
