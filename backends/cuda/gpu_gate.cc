// Host side of the stream gate (see gpu_gate.h); the kernel is in gpu_spin.cu.
#include "backends/cuda/gpu_gate.h"

#include <fmt/format.h>

#include <utility>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/gpu_spin.h"

namespace kvtier::cuda_detail {
namespace {

Status launch_gate(cudaStream_t s, const std::uint32_t* device_flag, std::uint32_t target,
                   std::chrono::nanoseconds timeout, std::uint32_t* device_expired) {
  if (s == nullptr) return InvalidArgument("gate_stream: the legacy default stream (null) cannot be gated");
  if (device_flag == nullptr) return InvalidArgument("gate_stream: null flag");
  const std::uint64_t timeout_ns = timeout.count() <= 0 ? 0 : static_cast<std::uint64_t>(timeout.count());
  KVTIER_CUDA_TRY(launch_gate_spin(s, device_flag, target, timeout_ns, device_expired));
  return Status::Ok();
}

}  // namespace

Status gate_stream(cudaStream_t s, volatile std::uint32_t* host_flag, std::chrono::nanoseconds timeout) {
  if (s == nullptr) return InvalidArgument("gate_stream: the legacy default stream (null) cannot be gated");
  if (host_flag == nullptr) return InvalidArgument("gate_stream: null host flag");
  void* device_flag = nullptr;
  KVTIER_CUDA_TRY_CTX(cudaHostGetDevicePointer(&device_flag, const_cast<std::uint32_t*>(host_flag), 0),
                      fmt::format("gate_stream: flag {} is not mapped pinned memory",
                                  static_cast<const void*>(const_cast<const std::uint32_t*>(host_flag))));
  return launch_gate(s, static_cast<const std::uint32_t*>(device_flag), 1u, timeout, nullptr);
}

void open_gate(volatile std::uint32_t* flag) noexcept {
  if (flag == nullptr) return;
  __atomic_store_n(flag, 1u, __ATOMIC_RELEASE);
}

Result<GateFlag> GateFlag::create(int device_ordinal) {
  KVTIER_CUDA_GUARD(device_ordinal);
  void* host = nullptr;
  KVTIER_CUDA_TRY(cudaHostAlloc(&host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  GateFlag gate;
  gate.words_ = static_cast<volatile std::uint32_t*>(host);
  gate.ordinal_ = device_ordinal;
  gate.words_[0] = 0;
  gate.words_[1] = 0;
  void* device = nullptr;
  KVTIER_CUDA_TRY(cudaHostGetDevicePointer(&device, host, 0));  // `gate` frees `host` on error
  gate.device_words_ = static_cast<std::uint32_t*>(device);
  return gate;
}

GateFlag::GateFlag(GateFlag&& other) noexcept { *this = std::move(other); }

GateFlag& GateFlag::operator=(GateFlag&& other) noexcept {
  if (this != &other) {
    release();
    words_ = std::exchange(other.words_, nullptr);
    device_words_ = std::exchange(other.device_words_, nullptr);
    ordinal_ = std::exchange(other.ordinal_, -1);
    issued_ = std::exchange(other.issued_, 0);
    opened_ = std::exchange(other.opened_, 0);
    events_ = std::exchange(other.events_, {});
  }
  return *this;
}

GateFlag::~GateFlag() { release(); }

void GateFlag::release() noexcept {
  if (words_ == nullptr) return;
  open();
  {
    DeviceGuard guard(ordinal_);
    // Every launched kernel now sees the flag open (or times out): wait for
    // them, so none reads the flag after cudaFreeHost.
    for (cudaEvent_t e : events_) {
      if (cudaEventSynchronize(e) != cudaSuccess) static_cast<void>(cudaGetLastError());
      if (cudaEventDestroy(e) != cudaSuccess) static_cast<void>(cudaGetLastError());
    }
    events_.clear();
    if (cudaFreeHost(const_cast<std::uint32_t*>(words_)) != cudaSuccess) static_cast<void>(cudaGetLastError());
  }
  words_ = nullptr;
  device_words_ = nullptr;
}

Status GateFlag::close(cudaStream_t s, std::chrono::nanoseconds timeout) {
  if (words_ == nullptr) return FailedPrecondition("GateFlag::close on an empty (moved-from) gate");
  KVTIER_CUDA_GUARD(ordinal_);
  // An event marks when this kernel has finished; reuse a completed one.
  cudaEvent_t done = nullptr;
  for (cudaEvent_t e : events_) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) {
      done = e;
      break;
    }
    if (q != cudaErrorNotReady) return cuda_status_at(q, "cudaEventQuery(gate event)", __FILE__, __LINE__);
  }
  if (done == nullptr) {
    KVTIER_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    events_.push_back(done);
  }
  const std::uint32_t target = issued_ + 1;
  KVTIER_RETURN_IF_ERROR(launch_gate(s, device_words_, target, timeout, device_words_ + 1));
  issued_ = target;
  KVTIER_CUDA_TRY(cudaEventRecord(done, s));
  return Status::Ok();
}

void GateFlag::open() noexcept {
  if (words_ == nullptr || opened_ == issued_) return;
  __atomic_store_n(&words_[0], issued_, __ATOMIC_RELEASE);
  opened_ = issued_;
}

bool GateFlag::expired() const noexcept { return words_ != nullptr && words_[1] != 0; }

}  // namespace kvtier::cuda_detail
