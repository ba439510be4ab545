// `kvtier bench copy`: the markers that time a run on a stream (a timed CUDA
// event on the CUDA backend, a stream-ordered host callback on the host
// backend) and the p50 over the timed repetitions.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "tools/bench_copy.h"

#if defined(KVTIER_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvtier::cli::bench_copy_detail {

namespace {

using Clock = std::chrono::steady_clock;

class HostMarker final : public Marker {
 public:
  explicit HostMarker(Device& d) : device_(d) {}
  Status record(Stream& s) override {
    done_.store(false);
    return device_.launch_host_callback(s, [this](const Status&) {
      t_ = Clock::now();
      done_.store(true, std::memory_order_release);
    });
  }
  Result<double> since(Marker& start) override {
    auto& st = static_cast<HostMarker&>(start);
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (!(done_.load(std::memory_order_acquire) && st.done_.load(std::memory_order_acquire))) {
      if (Clock::now() > deadline) return TimedOut("host marker callback never ran");
      std::this_thread::yield();
    }
    return std::chrono::duration<double, std::milli>(t_ - st.t_).count();
  }

 private:
  Device& device_;
  std::atomic<bool> done_{false};
  Clock::time_point t_{};
};

#if defined(KVTIER_WITH_CUDA)
class CudaMarker final : public Marker {
 public:
  ~CudaMarker() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  static Result<std::unique_ptr<Marker>> create() {
    auto m = std::make_unique<CudaMarker>();
    const cudaError_t e = cudaEventCreate(&m->event_);  // timing enabled
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventCreate: {}", cudaGetErrorString(e)));
    return std::unique_ptr<Marker>(std::move(m));
  }
  Status record(Stream& s) override {
    const cudaError_t e = cudaEventRecord(event_, static_cast<cudaStream_t>(s.native_handle()));
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventRecord: {}", cudaGetErrorString(e)));
    return Status::Ok();
  }
  Result<double> since(Marker& start) override {
    auto& st = static_cast<CudaMarker&>(start);
    cudaEventSynchronize(event_);
    cudaEventSynchronize(st.event_);
    float ms = 0;
    const cudaError_t e = cudaEventElapsedTime(&ms, st.event_, event_);
    if (e != cudaSuccess) return Internal(fmt::format("cudaEventElapsedTime: {}", cudaGetErrorString(e)));
    return static_cast<double>(ms);
  }

 private:
  cudaEvent_t event_ = nullptr;
};
#endif

}  // namespace

Result<std::unique_ptr<Marker>> make_marker(Device& d) {
#if defined(KVTIER_WITH_CUDA)
  if (d.backend() == BackendKind::kCuda) return CudaMarker::create();
#endif
  return std::unique_ptr<Marker>(new HostMarker(d));
}

double p50(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace kvtier::cli::bench_copy_detail
