// Stream gating: hold a CUDA stream busy with a one-thread kernel that spins
// until a host-mapped flag is set, so that work submitted behind it is queued
// on a busy stream. Fixes the idle-stream cliff: a host->device
// cudaMemcpyBatchAsync of small descriptors (<= 24 KiB) submitted to an idle
// stream blocks in the API call and runs at 2.5-5.5 GB/s; submitted behind a
// gate and then released it runs at ~49 GB/s (both measured on an H200).
//
// Usage (one owner thread):
//   KVTIER_ASSIGN_OR_RETURN(GateFlag gate, GateFlag::create(ordinal));
//   KVTIER_RETURN_IF_ERROR(gate.close(stream));   // stream is now busy
//   ... submit the batch on `stream` ...
//   gate.open();                                  // release (always, also on error paths)
//
// Safety: the spin kernel gives up after `timeout` (default 2 s, measured with
// %globaltimer on the GPU) so that a host that never opens the gate (crash,
// forgotten open on an error path) cannot hold the stream or the GPU forever.
// A gate that expired is reported by GateFlag::expired(); the work behind it
// then ran without the gate (still correct, possibly slower).
//
// The flag lives in pinned, mapped, portable host memory (cudaHostAlloc with
// cudaHostAllocMapped | cudaHostAllocPortable), read by the kernel through its
// device pointer.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::cuda_detail {

inline constexpr std::chrono::nanoseconds kDefaultGateTimeout = std::chrono::seconds(2);

// Launches the spin kernel on `s` (the current device must be the stream's
// device): it returns once *host_flag != 0 or after `timeout`. `host_flag`
// must be in mapped pinned memory (cudaHostAllocMapped, or registered with
// cudaHostRegisterMapped). Does not block the host.
Status gate_stream(cudaStream_t s, volatile std::uint32_t* host_flag,
                   std::chrono::nanoseconds timeout = kDefaultGateTimeout);

// Opens a gate: stores 1 with release semantics (everything the host wrote
// before is visible to work that runs after the kernel observes the flag).
void open_gate(volatile std::uint32_t* flag) noexcept;

// One gate flag, reusable without re-arming: each close() waits for a new
// ticket number, open() releases every ticket issued so far. Move-only. The
// destructor opens pending gates and waits (bounded by the kernel timeout) for
// every spin kernel it launched to finish before freeing the flag, so that no
// kernel reads freed host memory.
//
// Thread-safety: not thread-safe; one owner thread closes and opens.
class GateFlag {
 public:
  GateFlag() = default;
  // Allocates the flag while `device_ordinal` is current (DeviceGuard).
  static Result<GateFlag> create(int device_ordinal);

  GateFlag(GateFlag&& other) noexcept;
  GateFlag& operator=(GateFlag&& other) noexcept;
  GateFlag(const GateFlag&) = delete;
  GateFlag& operator=(const GateFlag&) = delete;
  ~GateFlag();

  bool valid() const noexcept { return words_ != nullptr; }
  int device_ordinal() const noexcept { return ordinal_; }

  // Makes `s` wait (on the GPU) until the next open() or `timeout`.
  // `s` must belong to device_ordinal(). Never blocks the host.
  Status close(cudaStream_t s, std::chrono::nanoseconds timeout = kDefaultGateTimeout);
  // Releases every gate closed so far. Idempotent. Release semantics.
  void open() noexcept;
  // Gates closed and not yet opened by this object.
  bool pending() const noexcept { return opened_ != issued_; }
  // True once a spin kernel of this flag gave up waiting (timeout).
  bool expired() const noexcept;

  // Host pointer to the flag word (mapped pinned memory).
  volatile std::uint32_t* host_flag() const noexcept { return words_; }

 private:
  void release() noexcept;

  volatile std::uint32_t* words_ = nullptr;  // [0] ticket opened, [1] expired marker
  std::uint32_t* device_words_ = nullptr;    // the same words as the GPU sees them
  // Recorded after each spin kernel; completed ones are reused.
  std::vector<cudaEvent_t> events_;
  int ordinal_ = -1;
  std::uint32_t issued_ = 0;
  std::uint32_t opened_ = 0;
};

}  // namespace kvtier::cuda_detail
