// Device abstraction: streams, events, device and pinned memory. The interface
// a device backend implements; users get one from a backend's factory
// (kvtier/device/host_device.h, kvtier/device/cuda_device.h).
//
// Two backends implement it, each in its own folder with everything of that
// backend (its copy engine too, offered through Device::extension):
//   - CudaDevice (backends/cuda): one CUDA device, non-blocking streams, events
//     with timing disabled, cudaMalloc, chunked cudaHostRegister.
//   - HostDevice (backends/host): a device simulated in RAM. Streams are
//     in-order worker threads, events are fences, device memory is host
//     memory. Optional injected delays and failures. Every layer above runs on
//     it in CI, where there is no GPU.
//
// Semantics shared by both backends (the conformance suite checks them):
//   - Work enqueued on one stream runs in order. Streams run concurrently.
//   - record(e, s) captures all work enqueued on s so far; re-recording
//     replaces the captured point (CUDA semantics). wait(s, e) makes later
//     work on s wait for the captured point; waiting on a never-recorded event
//     is a no-op. Neither call blocks the host.
//   - query(e) never blocks: true when the captured work completed, false
//     while pending, an error Status when that work failed (a failed copy on
//     the host backend; a sticky error on CUDA). An event recorded after a
//     failed operation on the same stream reports that failure.
//   - synchronize(...) blocks the calling thread up to `timeout`; TimedOut
//     when it expires (the work continues).
//   - Stream and Event objects must not be destroyed while work that uses
//     them is pending; the owner drains first (Stream's destructor
//     synchronizes as a last resort).
//
// Thread-safety: Device methods are safe to call from any thread. A single
// Stream may be used from several threads, but the caller orders their
// submissions; a Stream is not a mutex.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier {

class Device;

enum class BackendKind : std::uint8_t { kHost, kCuda };
std::string_view backend_name(BackendKind kind) noexcept;

enum class StreamPriority : std::uint8_t { kNormal, kHigh };

struct StreamOptions {
  StreamPriority priority = StreamPriority::kNormal;
  std::string name;  // for logs and stats
};

// An in-order queue of device work. Owned through std::unique_ptr; created by
// Device::create_stream. Non-copyable, non-movable (the address is the identity).
class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  virtual Device& device() const noexcept = 0;
  // Unique per process, never reused.
  std::uint64_t id() const noexcept { return id_; }
  // Backend handle (cudaStream_t for CUDA; the worker for the host backend).
  virtual void* native_handle() const noexcept = 0;

 protected:
  Stream();

 private:
  std::uint64_t id_;
};

struct EventOptions {
  // The event's completion time can be read with Device::elapsed_ms.
  bool timing = false;
};

// A point in a stream's work. Owned through std::unique_ptr.
class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  virtual void* native_handle() const noexcept = 0;

 protected:
  Event() = default;
};

// Owner of a memory allocation (device or pinned host). Move-only; frees on
// destruction. The releaser runs exactly once and never throws.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, std::uint64_t bytes, MemoryKind kind, std::function<void()> releaser)
      : data_(data), bytes_(bytes), kind_(kind), releaser_(std::move(releaser)) {}
  Buffer(Buffer&& other) noexcept { swap(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      swap(other);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void* data() const noexcept { return data_; }
  std::byte* bytes_ptr() const noexcept { return static_cast<std::byte*>(data_); }
  std::uint64_t size() const noexcept { return bytes_; }
  MemoryKind kind() const noexcept { return kind_; }
  bool empty() const noexcept { return data_ == nullptr; }
  void reset() noexcept {
    if (releaser_) {
      auto releaser = std::move(releaser_);
      releaser_ = nullptr;
      releaser();
    }
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void swap(Buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(kind_, other.kind_);
    std::swap(releaser_, other.releaser_);
  }
  void* data_ = nullptr;
  std::uint64_t bytes_ = 0;
  MemoryKind kind_ = MemoryKind::kDevice;
  std::function<void()> releaser_;
};

// Pinned host memory options. Large regions are mapped once (contiguous
// virtual range) and registered in chunks of at most `chunk_bytes` (the driver
// rejects or slows single registrations over 64 GiB), after a parallel first
// touch so that pages land on the intended NUMA node.
struct PinnedOptions {
  // <= 64 GiB. One CUDA copy may not span two registrations (the driver
  // rejects it): CudaDevice::memcpy_async and the CopyEngine's batched DMA
  // split copies at chunk ends (registration_of). Smaller chunks only to
  // spread registration over time.
  std::uint64_t chunk_bytes = std::uint64_t{64} << 30;
  int numa_node = -1;          // -1: no binding
  unsigned touch_threads = 0;  // 0: min(hardware threads, 16)
  // true: return immediately; registration continues in the background and
  // PinnedMemory::wait_ready / progress report it.
  bool background = false;
};

// Pinned host memory: allocated by kvtier (allocate_pinned) or borrowed and
// registered (register_host; the caller keeps ownership of the bytes and must
// keep them alive until this object is destroyed). Usable for copies only
// once ready().
class PinnedMemory {
 public:
  virtual ~PinnedMemory() = default;
  virtual std::byte* data() const noexcept = 0;
  virtual std::uint64_t size() const noexcept = 0;
  virtual bool borrowed() const noexcept = 0;
  // Bytes touched and registered so far.
  virtual std::uint64_t bytes_ready() const noexcept = 0;
  bool ready() const noexcept { return bytes_ready() == size(); }
  // Blocks until every chunk is registered (or failed) or the timeout passes.
  virtual Status wait_ready(std::chrono::milliseconds timeout) = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // For messages and for callers that must know the hardware (a CUDA tensor needs a CUDA device). Layers above
  // never choose code paths by it: they ask for what they need with extension().
  virtual BackendKind backend() const noexcept = 0;
  // An optional capability that the backend offers to the layers above the device, named by `id` (each such
  // interface defines its id, e.g. CopyBackend::kExtension in kvtier/backend/copy_backend.h), so that this layer
  // depends on none of them. The object lives as long as the device. nullptr where the backend does not offer it.
  virtual const void* extension(std::string_view id) const noexcept {
    (void)id;
    return nullptr;
  }
  // Ordinal as the process sees it (after CUDA_VISIBLE_DEVICES remapping).
  virtual int ordinal() const noexcept = 0;
  virtual std::string name() const = 0;
  // Number of SMs (host backend: a simulated count).
  virtual int multiprocessor_count() const noexcept = 0;

  virtual Result<std::unique_ptr<Stream>> create_stream(const StreamOptions& options = {}) = 0;
  // A Stream over a stream the caller owns (an engine's current
  // cudaStream_t): work kvtier enqueues on it runs in the engine's order.
  // kvtier never synchronizes or destroys it; the caller keeps it alive
  // until the returned object (and everything using it) is gone. The handle
  // must belong to this device (InvalidArgument otherwise). NotSupported on
  // backends without native streams (the host backend).
  virtual Result<std::unique_ptr<Stream>> adopt_stream(void* native_handle, const std::string& name);
  // Device memory that kvtier does not own (an engine's KV tensor): checked
  // to be device memory of this device over [data, data + bytes), then made
  // known to the backend. The returned Buffer's release forgets the range; it
  // never frees it. The host backend accepts any non-null RAM range.
  virtual Result<Buffer> adopt_device_memory(void* data, std::uint64_t bytes);
  // Events are created without timing unless asked (timing makes a record
  // slightly dearer on CUDA). `create_event()` = create_event({}).
  virtual Result<std::unique_ptr<Event>> create_event(const EventOptions& options) = 0;
  Result<std::unique_ptr<Event>> create_event() { return create_event(EventOptions{}); }

  // Device memory, uninitialised.
  virtual Result<Buffer> allocate_device(std::uint64_t bytes) = 0;
  virtual Result<std::unique_ptr<PinnedMemory>> allocate_pinned(std::uint64_t bytes,
                                                                const PinnedOptions& options = {}) = 0;
  virtual Result<std::unique_ptr<PinnedMemory>> register_host(void* data, std::uint64_t bytes,
                                                              const PinnedOptions& options = {}) = 0;

  // Asynchronous copy of `bytes` on `stream`; any direction between device and
  // pinned host memory. Never blocks on the copy. Copies that span several
  // pinned registrations are cut at registration ends. Host->host copies
  // run in stream order on a host function on CUDA (cudaMemcpyAsync between
  // host buffers would block the caller until the stream drained).
  virtual Status memcpy_async(void* dst, const void* src, std::uint64_t bytes, Stream& stream) = 0;
  virtual Status memset_async(void* dst, int value, std::uint64_t bytes, Stream& stream) = 0;
  // Blocking copy (tests, setup). Uses an internal stream.
  virtual Status memcpy_sync(void* dst, const void* src, std::uint64_t bytes) = 0;

  virtual Status record(Event& event, Stream& stream) = 0;
  virtual Status wait(Stream& stream, Event& event) = 0;
  virtual Result<bool> query(Event& event) = 0;
  virtual Status synchronize(Event& event, std::chrono::nanoseconds timeout) = 0;
  virtual Status synchronize(Stream& stream, std::chrono::nanoseconds timeout) = 0;
  // True when every operation enqueued on `stream` so far has completed.
  // Non-blocking (cudaStreamQuery). An error of the stream's work is returned.
  virtual Result<bool> query(Stream& stream) = 0;

  // Runs `fn` on a backend thread after all work enqueued on `stream` so far
  // has completed (cudaLaunchHostFunc). `fn` receives the status of that
  // work. It must not call back into this stream's device synchronously.
  // Keep it short: CUDA runs the host functions of all streams on one
  // thread, so a blocked `fn` delays every other host function, including
  // the CUDA backend's host->host copies (memcpy_async between host buffers).
  virtual Status launch_host_callback(Stream& stream, std::function<void(const Status&)> fn) = 0;

  // Milliseconds from the completion of `start` to that of `end` (negative
  // when `end` completed first): both timing events of this device, recorded.
  // Non-blocking: kUnavailable while either has not completed (ask again
  // later); the error of the work before either when that failed;
  // kFailedPrecondition for an event created without timing or never
  // recorded. Resolution: ~0.5 us on CUDA, the steady clock on the host.
  virtual Result<double> elapsed_ms(Event& start, Event& end) = 0;

  // The pinned registration holding `p`: [first, last) addresses, or {0, 0}
  // when `p` is not in memory this device registered. One DMA descriptor may
  // not span two registrations on CUDA (the driver rejects it), so batched
  // copies split segments at `last`. Thread-safe, non-blocking.
  struct Registration {
    std::uintptr_t first = 0;
    std::uintptr_t last = 0;
  };
  virtual Registration registration_of(const void* /*p*/) const { return {}; }

 protected:
  Device() = default;
};

}  // namespace kvtier
