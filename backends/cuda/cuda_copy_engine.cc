// CUDA executors of the CopyEngine: cudaMemcpyAsync per segment,
// cudaMemcpyBatchAsync (optionally gated), and the SM kernel.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "backends/cuda/block_copy_kernels.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/gpu_gate.h"
#include "copy/engine_base.h"

namespace kvtier::copy_detail {
namespace {

struct CudaStreamState final : BackendStreamState {
  cuda_detail::GateFlag gate;
  // Batch descriptor arrays, reused (read by the driver during the call only).
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
};

// Opens the gate on every path out of run_batch (a closed gate would hold the
// stream until the spin kernel's timeout).
struct GateOpener {
  cuda_detail::GateFlag* gate = nullptr;
  ~GateOpener() {
    if (gate != nullptr) gate->open();
  }
};

cudaMemLocation location_of(CopyDirection dir, bool source, int ordinal) {
  bool device_side = false;
  switch (dir) {
    case CopyDirection::kDeviceToHost: device_side = source; break;
    case CopyDirection::kHostToDevice: device_side = !source; break;
    case CopyDirection::kDeviceToDevice: device_side = true; break;
    case CopyDirection::kHostToHost: device_side = false; break;
  }
  cudaMemLocation loc{};
  loc.type = device_side ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
  loc.id = device_side ? ordinal : 0;
  return loc;
}

class CudaCopyEngine final : public EngineBase {
 public:
  using EngineBase::EngineBase;

 protected:
  bool supports_gate() const noexcept override { return true; }

  Result<std::unique_ptr<BackendStreamState>> make_backend_state(Stream&) override {
    auto cs = std::make_unique<CudaStreamState>();
    KVTIER_ASSIGN_OR_RETURN(cs->gate, cuda_detail::GateFlag::create(device_.ordinal()));
    return std::unique_ptr<BackendStreamState>(std::move(cs));
  }

  Status run_per_run(StreamState&, Stream& stream, std::span<const Segment> segments, CopyDirection) override {
    // Through the device: it splits copies that span two pinned registrations.
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const Segment& seg = segments[i];
      Status st = device_.memcpy_async(seg.dst, seg.src, seg.bytes, stream);
      if (!st.ok()) return st.with_context(fmt::format("segment {} of {}", i, segments.size()));
    }
    return Status::Ok();
  }

  Status run_batch(StreamState& st, Stream& stream, std::span<const Segment> segments, CopyDirection dir,
                   bool gated) override {
    if (dir == CopyDirection::kHostToHost) {
      // cudaMemcpy*Async between host buffers blocks the caller until the
      // stream drains (CUDA API synchronization behavior): one host function
      // copies the segments in stream order instead.
      std::vector<Segment> copy(segments.begin(), segments.end());
      return device_.launch_host_callback(stream, [copy = std::move(copy)](const Status& status) {
        if (!status.ok()) return;
        for (const Segment& seg : copy) std::memcpy(seg.dst, seg.src, seg.bytes);
      });
    }
    // cudaMemcpyBatchAsync refuses the legacy default stream (an adopted handle 0, torch's default stream) with
    // cudaErrorInvalidValue: the segments go one copy each there, in stream order as the batch would.
    if (cuda_detail::native(stream) == nullptr) return run_per_run(st, stream, segments, dir);
    KVTIER_CUDA_GUARD(device_.ordinal());
    auto& cs = static_cast<CudaStreamState&>(*st.backend);
    const cudaStream_t s = cuda_detail::native(stream);
    // One descriptor may not span two pinned registrations (the driver
    // rejects it): cut segments at registration ends. The last registration
    // seen is cached, so random blocks of one large registration cost no lookup.
    cs.dsts.clear();
    cs.srcs.clear();
    cs.sizes.clear();
    const bool host_is_dst = dir == CopyDirection::kDeviceToHost;
    const bool has_host = dir == CopyDirection::kDeviceToHost || dir == CopyDirection::kHostToDevice;
    Device::Registration reg;
    for (const Segment& seg : segments) {
      std::uint64_t done = 0;
      while (done < seg.bytes) {
        const auto host = reinterpret_cast<std::uintptr_t>(host_is_dst ? seg.dst : seg.src) + done;
        std::uint64_t piece = seg.bytes - done;
        if (has_host) {
          if (host < reg.first || host >= reg.last) reg = device_.registration_of(reinterpret_cast<const void*>(host));
          if (reg.last != 0) piece = std::min<std::uint64_t>(piece, reg.last - host);
        }
        cs.dsts.push_back(seg.dst + done);
        cs.srcs.push_back(seg.src + done);
        cs.sizes.push_back(piece);
        done += piece;
      }
    }
    const std::size_t n = cs.sizes.size();
    cudaMemcpyAttributes attr{};
    // Stream order: the source may have been written by the previous kernel
    // on this stream (fresh KV); Any would allow reading it early.
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint = location_of(dir, true, device_.ordinal());
    attr.dstLocHint = location_of(dir, false, device_.ordinal());
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t attr_index = 0;
    GateOpener opener;
    if (gated) {
      KVTIER_RETURN_IF_ERROR(cs.gate.close(s));
      opener.gate = &cs.gate;
    }
    const std::size_t chunk = options_.batch_max_descriptors;
    for (std::size_t i = 0; i < n; i += chunk) {
      const std::size_t count = std::min(chunk, n - i);
      KVTIER_CUDA_TRY_CTX(cudaMemcpyBatchAsync(cs.dsts.data() + i, cs.srcs.data() + i, cs.sizes.data() + i, count,
                                               &attr, &attr_index, 1, s),
                          fmt::format("batch descriptors [{}, {}) of {}", i, i + count, n));
    }
    return Status::Ok();
  }

  Status launch_kernel_inline(StreamState&, Stream& stream, const KernelArgs& args, const KernelPlane* planes,
                              const KernelPair* pairs, std::uint32_t ctas) override {
    KVTIER_CUDA_GUARD(device_.ordinal());
    const cudaError_t err = launch_block_copy_inline(args, planes, pairs, ctas, options_.sm_threads_per_cta,
                                                     cuda_detail::native(stream), options_.sm_programmatic_launch);
    if (err != cudaSuccess)
      return cuda_detail::cuda_status(err, "block_copy_inline_kernel launch")
          .with_context(fmt::format("{} CTAs x {} threads, {} pairs, {} planes", ctas, options_.sm_threads_per_cta,
                                    args.num_pairs, args.num_planes));
    return Status::Ok();
  }

  Status launch_kernel(StreamState&, Stream& stream, const KernelArgs& args, std::uint32_t ctas, const std::byte*,
                       std::uint64_t) override {
    KVTIER_CUDA_GUARD(device_.ordinal());
    const cudaError_t err = launch_block_copy(args, ctas, options_.sm_threads_per_cta, cuda_detail::native(stream),
                                              options_.sm_programmatic_launch);
    if (err != cudaSuccess)
      return cuda_detail::cuda_status(err, "block_copy_kernel launch")
          .with_context(fmt::format("{} CTAs x {} threads, {} items, {} planes", ctas, options_.sm_threads_per_cta,
                                    args.num_items, args.num_planes));
    return Status::Ok();
  }
};

class CudaCopyBackend final : public CopyBackend {
 public:
  Result<std::unique_ptr<CopyEngine>> create_engine(Device& device, const CopyEngineOptions& options) const override {
    // CudaDevice offers this backend and asks with itself; the check covers what a caller may pass by hand.
    if (device.extension(CopyBackend::kExtension) != this)
      return InvalidArgument(fmt::format("device '{}' is not a CUDA device", device.name()));
    return std::unique_ptr<CopyEngine>(new CudaCopyEngine(device, options));
  }
};

}  // namespace

const CopyBackend& cuda_copy_backend() noexcept {
  static const CudaCopyBackend backend;
  return backend;
}

}  // namespace kvtier::copy_detail
