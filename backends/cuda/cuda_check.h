// Private helpers of the CUDA backend (device/cuda) and of CUDA code above it
// (the copy engine): CUDA error -> Status conversion, a current-device guard,
// and access to the native handles behind Stream / Event.
//
// Error mapping (cuda_status):
//   - sticky errors (the context is unusable: illegal address, launch failure,
//     ECC, assert, ...)            -> kDeviceLost
//   - cudaErrorMemoryAllocation    -> kResourceExhausted
//   - invalid value / handle / device -> kInvalidArgument
//   - no device / driver           -> kUnavailable
//   - anything else                -> kInternal
// Non-sticky errors are cleared from the runtime's per-thread "last error"
// (cudaGetLastError) when converted, so that a later cudaPeekAtLastError or
// kernel-launch check does not report an error that was already handled.
// cudaErrorNotReady is not an error where it is queried (cudaEventQuery,
// cudaStreamQuery): those call sites test for it before converting.
//
// Thread-safety: everything here is thread-safe (the CUDA current device is
// per thread).
#pragma once

#include <cuda_runtime_api.h>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"

namespace kvtier::cuda_detail {

// True when `err` leaves the CUDA context unusable for the rest of the process.
bool is_sticky_error(cudaError_t err) noexcept;
StatusCode status_code_for(cudaError_t err) noexcept;

// OK for cudaSuccess; otherwise "<what>: cudaErrorX (description)".
Status cuda_status(cudaError_t err, const char* what);
// As cuda_status, adding " at file:line".
Status cuda_status_at(cudaError_t err, const char* what, const char* file, int line);

// Sets the current device to `ordinal` for the lifetime of the guard and
// restores the caller's device afterwards. Never throws. If the calling
// thread had no CUDA context yet, the previous device is not "restored" (that
// would create a primary context on device 0 as a side effect).
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) noexcept;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // cudaSuccess when the target device is current.
  cudaError_t error() const noexcept { return error_; }
  // OK, or the cudaSetDevice failure as a Status naming the ordinal.
  Status status() const;

 private:
  int target_ = 0;
  int previous_ = -1;  // -1: nothing to restore
  cudaError_t error_ = cudaSuccess;
};

// Native handles. The caller has checked the backend (a HostDevice stream
// is not a cudaStream_t).
inline cudaStream_t native(Stream& stream) noexcept { return static_cast<cudaStream_t>(stream.native_handle()); }
inline cudaEvent_t native(Event& event) noexcept { return static_cast<cudaEvent_t>(event.native_handle()); }

}  // namespace kvtier::cuda_detail

// Evaluates a CUDA runtime call; on error returns (from the enclosing
// function, which returns Status or Result<T>) a Status naming the call text,
// the error name and description, and file:line.
#define KVTIER_CUDA_TRY(expr)                                                                    \
  do {                                                                                           \
    const cudaError_t kvtier_cuda_err_ = (expr);                                                 \
    if (kvtier_cuda_err_ != cudaSuccess)                                                         \
      return ::kvtier::cuda_detail::cuda_status_at(kvtier_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// As KVTIER_CUDA_TRY, prefixing the message with `context` (any expression
// convertible to std::string_view, evaluated only on error), e.g. the
// arguments: fmt::format("dst={} bytes={}", dst, bytes).
#define KVTIER_CUDA_TRY_CTX(expr, context)                                                                             \
  do {                                                                                                                 \
    const cudaError_t kvtier_cuda_err_ = (expr);                                                                       \
    if (kvtier_cuda_err_ != cudaSuccess)                                                                               \
      return ::kvtier::cuda_detail::cuda_status_at(kvtier_cuda_err_, #expr, __FILE__, __LINE__).with_context(context); \
  } while (0)

// Switches to `ordinal` for the rest of the scope; returns the failure.
#define KVTIER_CUDA_GUARD(ordinal)                                                            \
  ::kvtier::cuda_detail::DeviceGuard KVTIER_CONCAT_(kvtier_device_guard_, __LINE__)(ordinal); \
  KVTIER_RETURN_IF_ERROR(KVTIER_CONCAT_(kvtier_device_guard_, __LINE__).status())
