// The host backend's copy engine: every strategy runs on the simulated
// stream's worker, so CPU tests exercise the same planning, chunking,
// descriptor slots and kernel work decomposition as the CUDA backend. Offered
// to CopyEngine::create through HostDevice::extension (host_backend.h).
#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "backends/host/host_backend.h"
#include "copy/engine_base.h"
#include "copy/kernel_plan.h"
#include "kvtier/device/host_device.h"

namespace kvtier::copy_detail {
namespace {

// One warp's copy of one item, lane by lane, exactly as the GPU kernel
// splits it (split_for_vectors): head bytes, `width`-byte body elements
// strided by 32 lanes, tail bytes.
void warp_copy_emulated(const WorkItem& w) {
  const VectorSplit v = split_for_vectors(w.src, w.dst, w.bytes);
  for (std::uint32_t lane = 0; lane < kWarpLanes; ++lane)
    if (lane < v.head) w.dst[lane] = w.src[lane];
  const unsigned char* src = w.src + v.head;
  unsigned char* dst = w.dst + v.head;
  for (std::uint32_t lane = 0; lane < kWarpLanes; ++lane)
    for (std::uint64_t e = lane; e < v.body; e += kWarpLanes)
      std::memcpy(dst + e * v.width, src + e * v.width, v.width);
  const std::uint64_t tail_at = v.body * v.width;
  for (std::uint32_t lane = 0; lane < kWarpLanes; ++lane)
    if (lane < v.tail) dst[tail_at + lane] = src[tail_at + lane];
}

// A checksummed item (width 16, body only), word by word as the lanes take them: copied unless the launch
// only reads, and folded into the pair's sum.
void warp_sum_emulated(const KernelArgs& a, const WorkItem& w) {
  const std::uint64_t words = w.bytes / 16;
  const std::uint64_t position = checksum_position(a.plane_index_base + w.plane, w.offset);
  unsigned long long acc = 0;
  for (std::uint64_t e = 0; e < words; ++e) {
    std::uint64_t half[2];
    std::memcpy(half, w.src + e * 16, 16);
    if (a.store != 0) std::memcpy(w.dst + e * 16, half, 16);
    acc += checksum_word(half[0], half[1], position + e * 16);
  }
  a.checksums[w.pair] += acc;
}

// An inline launch's descriptors, owned by its tasks as a GPU launch owns its parameter block.
using InlineDescriptors = std::pair<std::vector<KernelPlane>, std::vector<KernelPair>>;

// The read-back of a launch with KernelArgs::landed: every item's destination words folded into its pair's landed
// sum. The GPU kernel reads each warp's items back one item behind its stores; here it is a second task on the
// stream after the whole copy (an order the kernel's allows), so a test can change a destination in between.
void landed_pass_emulated(const KernelArgs& a) {
  for (std::uint64_t item = 0; item < a.num_items; ++item) {
    const WorkItem w = resolve_item(a.planes, a.num_planes, a.pairs, a.items_per_pair, a.item_bytes, item);
    const std::uint64_t position = checksum_position(a.plane_index_base + w.plane, w.offset);
    unsigned long long acc = 0;
    for (std::uint64_t e = 0; e < w.bytes / 16; ++e) {
      std::uint64_t half[2];
      std::memcpy(half, w.dst + e * 16, 16);
      acc += checksum_word(half[0], half[1], position + e * 16);
    }
    a.landed[w.pair] += acc;
  }
}

// The kernel's grid: CTA c, warp w takes items c*warps + w, + total_warps, ...
void run_kernel_emulated(const KernelArgs& a, std::uint32_t ctas, std::uint32_t threads) {
  const std::uint32_t warps = threads / kWarpLanes;
  const std::uint64_t total = std::uint64_t{ctas} * warps;
  for (std::uint32_t c = 0; c < ctas; ++c)
    for (std::uint32_t w = 0; w < warps; ++w)
      for (std::uint64_t item = std::uint64_t{c} * warps + w; item < a.num_items; item += total) {
        const WorkItem wi = resolve_item(a.planes, a.num_planes, a.pairs, a.items_per_pair, a.item_bytes, item);
        if (a.checksums != nullptr)
          warp_sum_emulated(a, wi);
        else
          warp_copy_emulated(wi);
      }
}

// The first block a kernel launch writes: given to the host backend as the
// task's destination (with 0 bytes: nothing is poisoned on failure), so fault
// injection that selects operations by destination reaches kernel launches as
// it reaches DMAs, and a failed launch writes nothing, as on a GPU.
void* first_destination(const KernelPlane* planes, const KernelPair* pairs, const KernelArgs& args) {
  if (args.num_planes == 0 || args.num_pairs == 0) return nullptr;
  return reinterpret_cast<void*>(planes[0].dst_base + static_cast<std::uint64_t>(pairs[0].dst) * planes[0].dst_stride);
}

class HostCopyEngine final : public EngineBase {
 public:
  HostCopyEngine(HostDevice& host, const CopyEngineOptions& options) : EngineBase(host, options), host_(host) {}

 protected:
  Status run_batch(StreamState&, Stream& stream, std::span<const Segment> segments, CopyDirection, bool) override {
    const std::size_t chunk = options_.batch_max_descriptors;
    for (std::size_t i = 0; i < segments.size(); i += chunk) {
      const std::size_t n = std::min(chunk, segments.size() - i);
      std::vector<Segment> copy(segments.begin() + i, segments.begin() + i + n);
      // Named by its first destination, as a kernel's launch is: failure injection that picks operations by
      // where they write reaches batched DMAs too (a failed batch writes nothing but the poison, as on a GPU).
      void* first_dst = copy.front().dst;
      const std::uint64_t first_bytes = copy.front().bytes;
      KVTIER_RETURN_IF_ERROR(host_.enqueue_task(
          stream,
          [copy = std::move(copy)]() -> Status {
            for (const Segment& s : copy) std::memcpy(s.dst, s.src, s.bytes);
            return Status::Ok();
          },
          first_dst, first_bytes));
    }
    return Status::Ok();
  }

  Status launch_kernel(StreamState&, Stream& stream, const KernelArgs& args, std::uint32_t ctas,
                       const std::byte* staging, std::uint64_t descriptor_bytes) override {
    const std::uint32_t threads = options_.sm_threads_per_cta;
    // The staging copy is what the upload carries (args.planes may not hold it
    // yet); args.pairs lies at the same offset from args.planes in both.
    const auto* staged_planes = reinterpret_cast<const KernelPlane*>(staging);
    const auto* staged_pairs = reinterpret_cast<const KernelPair*>(
        staging + (reinterpret_cast<const std::byte*>(args.pairs) - reinterpret_cast<const std::byte*>(args.planes)));
    void* first_dst = first_destination(staged_planes, staged_pairs, args);
    KVTIER_RETURN_IF_ERROR(host_.enqueue_task(
        stream,
        [args, ctas, threads, staging, descriptor_bytes]() -> Status {
          // A failed (injected) descriptor upload leaves garbage where a GPU
          // kernel would fault; refuse to run on it instead of scribbling memory.
          if (static_cast<const void*>(args.planes) != static_cast<const void*>(staging) &&
              std::memcmp(args.planes, staging, descriptor_bytes) != 0)
            return Internal("sm_kernel descriptors in device memory differ from the staged ones (the upload failed)");
          run_kernel_emulated(args, ctas, threads);
          return Status::Ok();
        },
        first_dst, 0));
    return enqueue_landed_pass(stream, args, nullptr);
  }

  Status launch_kernel_inline(StreamState&, Stream& stream, const KernelArgs& meta, const KernelPlane* planes,
                              const KernelPair* pairs, std::uint32_t ctas) override {
    if (meta.num_planes > kInlineMaxPlanes || meta.num_pairs > kInlineMaxPairs)
      return InvalidArgument(fmt::format("inline kernel descriptors: {} planes, {} pairs (limits {}, {})",
                                         meta.num_planes, meta.num_pairs, kInlineMaxPlanes, kInlineMaxPairs));
    // The task owns its copy, as a GPU launch owns its parameter block.
    auto owned = std::make_shared<const InlineDescriptors>(std::vector<KernelPlane>(planes, planes + meta.num_planes),
                                                           std::vector<KernelPair>(pairs, pairs + meta.num_pairs));
    const std::uint32_t threads = options_.sm_threads_per_cta;
    void* first_dst = first_destination(planes, pairs, meta);
    KVTIER_RETURN_IF_ERROR(host_.enqueue_task(
        stream,
        [meta, owned, ctas, threads]() -> Status {
          KernelArgs args = meta;
          args.planes = owned->first.data();
          args.pairs = owned->second.data();
          run_kernel_emulated(args, ctas, threads);
          return Status::Ok();
        },
        first_dst, 0));
    return enqueue_landed_pass(stream, meta, owned);
  }

 private:
  // The landed pass of a launch that asked for one, as its own task (its destination the landed sums: fault
  // injection that selects by size or address reaches it). `owner` keeps inline descriptors alive; slot ones
  // stay valid until the event recorded after the launch, which follows this task on the stream.
  Status enqueue_landed_pass(Stream& stream, const KernelArgs& meta, std::shared_ptr<const InlineDescriptors> owner) {
    if (meta.landed == nullptr || meta.store == 0 || meta.checksums == nullptr) return Status::Ok();
    return host_.enqueue_task(
        stream,
        [meta, owner]() -> Status {
          KernelArgs args = meta;
          if (owner != nullptr) {
            args.planes = owner->first.data();
            args.pairs = owner->second.data();
          }
          landed_pass_emulated(args);
          return Status::Ok();
        },
        meta.landed, std::uint64_t{meta.num_pairs} * sizeof(std::uint64_t));
  }

  HostDevice& host_;
};

class HostCopyBackend final : public CopyBackend {
 public:
  Result<std::unique_ptr<CopyEngine>> create_engine(Device& device, const CopyEngineOptions& options) const override {
    // HostDevice offers this backend and asks with itself; the cast checks what a caller may pass by hand.
    auto* host = dynamic_cast<HostDevice*>(&device);
    if (host == nullptr)
      return InvalidArgument(fmt::format("device '{}' is not a device of the host backend", device.name()));
    return std::unique_ptr<CopyEngine>(new HostCopyEngine(*host, options));
  }
};

}  // namespace

const CopyBackend& host_copy_backend() noexcept {
  static const HostCopyBackend backend;
  return backend;
}

}  // namespace kvtier::copy_detail
