#include "backends/cuda/cuda_check.h"

#include <cuda.h>
#include <fmt/format.h>

namespace kvtier::cuda_detail {

bool is_sticky_error(cudaError_t err) noexcept {
  // cudaError_t is a foreign enum with ~150 values: list the sticky ones
  // (documented "the process must be terminated and relaunched").
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorDevicesUnavailable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice: return true;
    default: return false;
  }
}

StatusCode status_code_for(cudaError_t err) noexcept {
  if (err == cudaSuccess) return StatusCode::kOk;
  if (is_sticky_error(err)) return StatusCode::kDeviceLost;
  switch (err) {
    case cudaErrorMemoryAllocation: return StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidPitchValue:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered: return StatusCode::kInvalidArgument;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorCudartUnloading:
    case cudaErrorStubLibrary:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorDeviceUninitialized:
    case cudaErrorNotReady: return StatusCode::kUnavailable;
    case cudaErrorLaunchOutOfResources: return StatusCode::kResourceExhausted;
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
    case cudaErrorCompatNotSupportedOnDevice: return StatusCode::kNotSupported;
    case cudaErrorTimeout: return StatusCode::kTimedOut;
    default: return StatusCode::kInternal;
  }
}

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  // Clear a non-sticky error from the per-thread last-error slot (NCCL's
  // CUDACHECK does the same); sticky errors cannot be cleared anyway.
  if (!is_sticky_error(err)) static_cast<void>(cudaGetLastError());
  const char* name = cudaGetErrorName(err);
  const char* text = cudaGetErrorString(err);
  return Status(
      status_code_for(err),
      fmt::format("{}: {} ({}){}", what != nullptr ? what : "CUDA call", name != nullptr ? name : "cudaError?",
                  text != nullptr ? text : "", is_sticky_error(err) ? " [sticky: the CUDA context is unusable]" : ""));
}

Status cuda_status_at(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  Status s = cuda_status(err, what);
  return Status(s.code(), fmt::format("{} at {}:{}", s.message(), file != nullptr ? file : "?", line));
}

namespace {

using CtxGetCurrentFn = CUresult(CUDAAPI*)(CUcontext*);

// cuCtxGetCurrent through the runtime's driver entry point, so that the
// binary does not link libcuda (it must load where there is no driver).
CtxGetCurrentFn ctx_get_current() noexcept {
  static const CtxGetCurrentFn fn = []() noexcept -> CtxGetCurrentFn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      static_cast<void>(cudaGetLastError());
      return nullptr;
    }
    return reinterpret_cast<CtxGetCurrentFn>(p);
  }();
  return fn;
}

// True when the calling thread has a current context (so its current device
// is meaningful and worth restoring).
bool thread_has_context() noexcept {
  CtxGetCurrentFn fn = ctx_get_current();
  if (fn == nullptr) return true;  // unknown: restore conservatively
  CUcontext ctx = nullptr;
  if (fn(&ctx) != CUDA_SUCCESS) return true;
  return ctx != nullptr;
}

}  // namespace

DeviceGuard::DeviceGuard(int ordinal) noexcept : target_(ordinal) {
  int current = -1;
  const bool had_context = thread_has_context();
  if (cudaGetDevice(&current) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    current = -1;
  }
  if (had_context && current == ordinal) return;  // already there: nothing to do or restore
  error_ = cudaSetDevice(ordinal);
  if (error_ != cudaSuccess) {
    if (!is_sticky_error(error_)) static_cast<void>(cudaGetLastError());
    return;
  }
  if (had_context && current >= 0) previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != target_) {
    if (cudaSetDevice(previous_) != cudaSuccess) static_cast<void>(cudaGetLastError());
  }
}

Status DeviceGuard::status() const {
  if (error_ == cudaSuccess) return Status::Ok();
  return cuda_status(error_, "cudaSetDevice").with_context(fmt::format("device ordinal {}", target_));
}

}  // namespace kvtier::cuda_detail
