// CudaDevice: the CUDA backend of Device (see kvtier/device/cuda_device.h).
//
// Every method switches to the device with a DeviceGuard, so the caller's
// current device is unchanged, and checks every CUDA call.
#include "kvtier/device/cuda_device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_check.h"
#include "device/pinned.h"
#include "kvtier/core/deadline.h"

namespace kvtier {
namespace {

using cuda_detail::cuda_status;
using cuda_detail::cuda_status_at;
using cuda_detail::DeviceGuard;

class CudaDevice;

class CudaStream final : public Stream {
 public:
  CudaStream(Device& device, int ordinal, cudaStream_t stream, std::string name, bool owned = true)
      : device_(device), ordinal_(ordinal), stream_(stream), name_(std::move(name)), owned_(owned) {}

  // Drains as a last resort (the owner should have), then destroys. Never
  // throws; errors can only be dropped here. An adopted stream belongs to
  // the engine: neither drained nor destroyed.
  ~CudaStream() override {
    if (!owned_) return;
    DeviceGuard guard(ordinal_);
    if (cudaStreamSynchronize(stream_) != cudaSuccess) static_cast<void>(cudaGetLastError());
    if (cudaStreamDestroy(stream_) != cudaSuccess) static_cast<void>(cudaGetLastError());
  }

  Device& device() const noexcept override { return device_; }
  void* native_handle() const noexcept override { return stream_; }
  int ordinal() const noexcept { return ordinal_; }
  cudaStream_t stream() const noexcept { return stream_; }
  const std::string& name() const noexcept { return name_; }

 private:
  Device& device_;
  const int ordinal_;
  const cudaStream_t stream_;
  const std::string name_;
  const bool owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t event, bool timing) : ordinal_(ordinal), event_(event), timing_(timing) {}
  // cudaEventDestroy on a pending event is allowed: CUDA releases it once
  // the captured work completes.
  ~CudaEvent() override {
    DeviceGuard guard(ordinal_);
    if (cudaEventDestroy(event_) != cudaSuccess) static_cast<void>(cudaGetLastError());
  }
  void* native_handle() const noexcept override { return event_; }
  int ordinal() const noexcept { return ordinal_; }
  cudaEvent_t event() const noexcept { return event_; }
  bool timing() const noexcept { return timing_; }
  std::atomic<bool> recorded{false};

 private:
  const int ordinal_;
  const cudaEvent_t event_;
  const bool timing_;
};

struct HostCallback {
  std::function<void(const Status&)> fn;
};

// Runs on a CUDA driver thread. No CUDA call is allowed here, and no
// exception may escape into the driver.
void CUDART_CB run_host_callback(void* data) {
  std::unique_ptr<HostCallback> callback(static_cast<HostCallback*>(data));
  try {
    callback->fn(Status::Ok());
  } catch (...) {  // NOLINT(bugprone-empty-catch): nothing can be reported from a driver thread
  }
}

// Polls `query` (cudaEventQuery / cudaStreamQuery) until it is not
// cudaErrorNotReady or `timeout` passes. Spins with yield for the first few
// polls (completion is often imminent), then sleeps with a doubling interval
// capped at 200 us.
template <typename Query>
Status poll_until_done(Query&& query, std::chrono::nanoseconds timeout, const std::string& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = deadline_after(timeout, start);
  std::chrono::microseconds sleep{2};
  int polls = 0;
  for (;;) {
    const cudaError_t err = query();
    if (err == cudaSuccess) return Status::Ok();
    if (err != cudaErrorNotReady) return cuda_status(err, what.c_str());
    const auto now = Clock::now();
    if (now >= deadline) {
      return TimedOut(fmt::format("{}: work not complete after {} ns (it continues)", what, timeout.count()));
    }
    if (++polls <= 64) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline - now));
    sleep = std::min(sleep * 2, std::chrono::microseconds(200));
  }
}

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> create(int ordinal) {
    KVTIER_CUDA_GUARD(ordinal);
    auto device = std::unique_ptr<CudaDevice>(new CudaDevice(ordinal));
    cudaDeviceProp props{};
    KVTIER_CUDA_TRY(cudaGetDeviceProperties(&props, ordinal));
    device->name_ = props.name;
    KVTIER_CUDA_TRY(cudaDeviceGetAttribute(&device->multiprocessors_, cudaDevAttrMultiProcessorCount, ordinal));
    int host_ptr_ok = 0;
    KVTIER_CUDA_TRY(cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, ordinal));
    device->host_pointer_is_device_pointer_ = host_ptr_ok == 1;
    KVTIER_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&device->least_priority_, &device->greatest_priority_));
    KVTIER_CUDA_TRY(cudaStreamCreateWithFlags(&device->sync_stream_, cudaStreamNonBlocking));
    return std::unique_ptr<Device>(std::move(device));
  }

  ~CudaDevice() override {
    if (sync_stream_ == nullptr) return;
    DeviceGuard guard(ordinal_);
    if (cudaStreamSynchronize(sync_stream_) != cudaSuccess) static_cast<void>(cudaGetLastError());
    if (cudaStreamDestroy(sync_stream_) != cudaSuccess) static_cast<void>(cudaGetLastError());
  }

  BackendKind backend() const noexcept override { return BackendKind::kCuda; }
  const void* extension(std::string_view id) const noexcept override {
    if (id == CopyBackend::kExtension) return &copy_detail::cuda_copy_backend();
    return nullptr;
  }
  int ordinal() const noexcept override { return ordinal_; }
  std::string name() const override { return name_; }
  int multiprocessor_count() const noexcept override { return multiprocessors_; }

  Result<std::unique_ptr<Stream>> create_stream(const StreamOptions& options) override {
    KVTIER_CUDA_GUARD(ordinal_);
    const int priority = options.priority == StreamPriority::kHigh ? greatest_priority_ : least_priority_;
    cudaStream_t stream = nullptr;
    KVTIER_CUDA_TRY_CTX(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority),
                        fmt::format("create_stream '{}' (priority {}) on device {}", options.name, priority, ordinal_));
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(*this, ordinal_, stream, options.name));
  }

  Result<std::unique_ptr<Stream>> adopt_stream(void* native_handle, const std::string& name) override {
    KVTIER_CUDA_GUARD(ordinal_);
    auto stream = static_cast<cudaStream_t>(native_handle);
    // The legacy default stream (0) and the per-thread one are valid handles too.
    int device = -1;
    KVTIER_CUDA_TRY_CTX(cudaStreamGetDevice(stream, &device),
                        fmt::format("adopt_stream('{}'): handle {} is not a CUDA stream", name, native_handle));
    if (device != ordinal_)
      return InvalidArgument(fmt::format("adopt_stream('{}'): stream {} belongs to CUDA device {}, not device {}", name,
                                         native_handle, device, ordinal_));
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(*this, ordinal_, stream, name, /*owned=*/false));
  }

  Result<Buffer> adopt_device_memory(void* data, std::uint64_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Device::adopt_device_memory(data, bytes).status());  // null, empty, wrapping
    KVTIER_CUDA_GUARD(ordinal_);
    for (const void* p :
         {static_cast<const void*>(data), static_cast<const void*>(static_cast<std::byte*>(data) + bytes - 1)}) {
      cudaPointerAttributes attr{};
      KVTIER_CUDA_TRY_CTX(cudaPointerGetAttributes(&attr, p),
                          fmt::format("adopt_device_memory: cudaPointerGetAttributes({})", p));
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return InvalidArgument(
            fmt::format("adopt_device_memory: {} (in [{}, +{} bytes)) is not device memory (CUDA memory type {})", p,
                        data, bytes, static_cast<int>(attr.type)));
      if (attr.device != ordinal_)
        return InvalidArgument(fmt::format("adopt_device_memory: {} is memory of CUDA device {}, not device {}", p,
                                           attr.device, ordinal_));
    }
    std::shared_ptr<ChunkMap> map = device_map_;
    map->add(data, bytes);
    return Buffer(data, bytes, MemoryKind::kDevice, [map, data]() noexcept { map->remove(data); });
  }

  using Device::create_event;
  Result<std::unique_ptr<Event>> create_event(const EventOptions& options) override {
    KVTIER_CUDA_GUARD(ordinal_);
    cudaEvent_t event = nullptr;
    KVTIER_CUDA_TRY_CTX(cudaEventCreateWithFlags(&event, options.timing ? cudaEventDefault : cudaEventDisableTiming),
                        fmt::format("create_event(timing={}) on device {}", options.timing, ordinal_));
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(ordinal_, event, options.timing));
  }

  Result<double> elapsed_ms(Event& start, Event& end) override {
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * a, cuda_event(start, "elapsed_ms"));
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * b, cuda_event(end, "elapsed_ms"));
    int i = 0;
    for (CudaEvent* e : {a, b}) {
      const char* which = i++ == 0 ? "start" : "end";
      if (!e->timing())
        return FailedPrecondition(fmt::format("elapsed_ms: the {} event was created without timing", which));
      if (!e->recorded.load(std::memory_order_acquire))
        return FailedPrecondition(fmt::format("elapsed_ms: the {} event was never recorded", which));
      KVTIER_ASSIGN_OR_RETURN(bool done, query(*e));
      if (!done) return Unavailable(fmt::format("elapsed_ms: the {} event has not completed yet", which));
    }
    KVTIER_CUDA_GUARD(ordinal_);
    float ms = 0;
    KVTIER_CUDA_TRY_CTX(cudaEventElapsedTime(&ms, a->event(), b->event()),
                        fmt::format("elapsed_ms on device {}", ordinal_));
    return static_cast<double>(ms);
  }

  Result<Buffer> allocate_device(std::uint64_t bytes) override {
    if (bytes == 0) return InvalidArgument(fmt::format("allocate_device: 0 bytes on device {}", ordinal_));
    KVTIER_CUDA_GUARD(ordinal_);
    void* ptr = nullptr;
    KVTIER_CUDA_TRY_CTX(cudaMalloc(&ptr, bytes),
                        fmt::format("allocate_device({} bytes) on device {}", bytes, ordinal_));
    const int ordinal = ordinal_;
    // Known device ranges let memcpy_async tell host->host copies apart
    // without a driver query per call.
    std::shared_ptr<ChunkMap> map = device_map_;
    map->add(ptr, bytes);
    return Buffer(ptr, bytes, MemoryKind::kDevice, [ordinal, ptr, map]() noexcept {
      map->remove(ptr);
      DeviceGuard guard(ordinal);
      if (cudaFree(ptr) != cudaSuccess) static_cast<void>(cudaGetLastError());
    });
  }

  Result<std::unique_ptr<PinnedMemory>> allocate_pinned(std::uint64_t bytes, const PinnedOptions& options) override {
    KVTIER_RETURN_IF_ERROR(check_host_pointer_access("allocate_pinned"));
    return detail::allocate_pinned_memory(bytes, options, registrar());
  }

  Result<std::unique_ptr<PinnedMemory>> register_host(void* data, std::uint64_t bytes,
                                                      const PinnedOptions& options) override {
    KVTIER_RETURN_IF_ERROR(check_host_pointer_access("register_host"));
    if (data != nullptr && bytes != 0 && already_pinned(data, bytes) &&
        !pinned_chunks().covers(data, bytes, options.chunk_bytes)) {
      // Pinned by its owner (cudaHostAlloc, torch pin_memory): borrowed as
      // is; registering it again would fail, unregistering it is the owner's.
      // A range kvtier registered itself, chunk for chunk, is shared instead
      // (the registrar counts its chunks).
      return detail::register_host_memory(data, bytes, options, detail::ChunkRegistrar{});
    }
    return detail::register_host_memory(data, bytes, options, registrar());
  }

  Status memcpy_async(void* dst, const void* src, std::uint64_t bytes, Stream& stream) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "memcpy_async"));
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr) {
      return InvalidArgument(fmt::format("memcpy_async: null pointer (dst={}, src={}, bytes={})", dst, src, bytes));
    }
    KVTIER_CUDA_GUARD(ordinal_);
    KVTIER_ASSIGN_OR_RETURN(bool host_to_host, both_host(dst, src));
    if (host_to_host) {
      // cudaMemcpyAsync between two host buffers is "fully synchronous with
      // respect to the host" (CUDA API synchronization behavior): it blocks
      // the caller until the stream drains. Found on the H200: a re-record
      // behind a blocked host callback took 30 s. A host function keeps it
      // asynchronous and in stream order.
      return launch_host_callback(stream, [dst, src, bytes](const Status& st) {
        if (st.ok()) std::memcpy(dst, src, bytes);
      });
    }
    return split_memcpy(dst, src, bytes, s->stream(), fmt::format("stream {} '{}'", stream.id(), s->name()));
  }

  Status memset_async(void* dst, int value, std::uint64_t bytes, Stream& stream) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "memset_async"));
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr) return InvalidArgument(fmt::format("memset_async: null dst (bytes={})", bytes));
    KVTIER_CUDA_GUARD(ordinal_);
    // Like copies, a memset may not span two pinned registrations.
    std::uint64_t done = 0;
    while (done < bytes) {
      auto* d = static_cast<std::byte*>(dst) + done;
      std::uint64_t piece = bytes - done;
      if (const std::uint64_t c = chunk_map_->contiguous_from(d); c != 0) piece = std::min(piece, c);
      KVTIER_CUDA_TRY_CTX(cudaMemsetAsync(d, value, piece, s->stream()),
                          fmt::format("memset_async(dst={}, value={}, bytes={}, stream {} '{}')", static_cast<void*>(d),
                                      value, piece, stream.id(), s->name()));
      done += piece;
    }
    return Status::Ok();
  }

  Status memcpy_sync(void* dst, const void* src, std::uint64_t bytes) override {
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr) {
      return InvalidArgument(fmt::format("memcpy_sync: null pointer (dst={}, src={}, bytes={})", dst, src, bytes));
    }
    KVTIER_CUDA_GUARD(ordinal_);
    KVTIER_ASSIGN_OR_RETURN(bool host_to_host, both_host(dst, src));
    if (host_to_host) {
      std::memcpy(dst, src, bytes);
      return Status::Ok();
    }
    const auto context = [&] { return fmt::format("memcpy_sync(dst={}, src={}, bytes={})", dst, src, bytes); };
    // Cut at registration ends like memcpy_async (found on the H200 by
    // DmaStrategiesCutAtPinnedRegistrationEnds, which fills such memory).
    Status split = split_memcpy(dst, src, bytes, sync_stream_, "memcpy_sync");
    // Concurrent memcpy_sync calls share the stream: each waits for its own
    // copy and possibly others queued before it (correct, serialised). Also
    // when a later piece failed to enqueue: the earlier pieces are in flight,
    // and a synchronous call must not return while they still use the
    // caller's buffers.
    const cudaError_t synced = cudaStreamSynchronize(sync_stream_);
    KVTIER_RETURN_IF_ERROR(split);
    KVTIER_CUDA_TRY_CTX(synced, context());
    return Status::Ok();
  }

  Status record(Event& event, Stream& stream) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "record"));
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, cuda_event(event, "record"));
    if (e->ordinal() != ordinal_) {
      return InvalidArgument(
          fmt::format("record: event of device {} on stream {} of device {}", e->ordinal(), stream.id(), ordinal_));
    }
    KVTIER_CUDA_GUARD(ordinal_);
    KVTIER_CUDA_TRY_CTX(cudaEventRecord(e->event(), s->stream()),
                        fmt::format("record on stream {} '{}'", stream.id(), s->name()));
    e->recorded.store(true, std::memory_order_release);
    return Status::Ok();
  }

  // The event may belong to another CUDA device (cross-device waits are legal).
  Status wait(Stream& stream, Event& event) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "wait"));
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, cuda_event(event, "wait"));
    KVTIER_CUDA_GUARD(ordinal_);
    KVTIER_CUDA_TRY_CTX(
        cudaStreamWaitEvent(s->stream(), e->event(), cudaEventWaitDefault),
        fmt::format("wait: stream {} '{}' on an event of device {}", stream.id(), s->name(), e->ordinal()));
    return Status::Ok();
  }

  Result<bool> query(Event& event) override {
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, cuda_event(event, "query"));
    KVTIER_CUDA_GUARD(e->ordinal());
    const cudaError_t err = cudaEventQuery(e->event());
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return cuda_status_at(err, "cudaEventQuery", __FILE__, __LINE__)
        .with_context(fmt::format("query event of device {}", e->ordinal()));
  }

  Status synchronize(Event& event, std::chrono::nanoseconds timeout) override {
    KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, cuda_event(event, "synchronize"));
    KVTIER_CUDA_GUARD(e->ordinal());
    const cudaEvent_t native = e->event();
    return poll_until_done([native] { return cudaEventQuery(native); }, timeout,
                           fmt::format("synchronize(event of device {})", e->ordinal()));
  }

  Status synchronize(Stream& stream, std::chrono::nanoseconds timeout) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "synchronize"));
    KVTIER_CUDA_GUARD(ordinal_);
    const cudaStream_t native = s->stream();
    return poll_until_done([native] { return cudaStreamQuery(native); }, timeout,
                           fmt::format("synchronize(stream {} '{}')", stream.id(), s->name()));
  }

  Result<bool> query(Stream& stream) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "query"));
    KVTIER_CUDA_GUARD(ordinal_);
    const cudaError_t err = cudaStreamQuery(s->stream());
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    const std::string what = fmt::format("query(stream {} '{}')", stream.id(), s->name());
    return cuda_detail::cuda_status(err, what.c_str());
  }

  // fn always receives OK: a host function may not call CUDA to learn the
  // stream's state, and cudaLaunchHostFunc does not run it at all once the
  // context has a sticky error (then fn never runs; callers bound their waits
  // with timeouts and learn the error from query/synchronize).
  Registration registration_of(const void* p) const override {
    const auto [first, last] = chunk_map_->chunk_of(p);
    return Registration{first, last};
  }

  Status launch_host_callback(Stream& stream, std::function<void(const Status&)> fn) override {
    KVTIER_ASSIGN_OR_RETURN(CudaStream * s, cuda_stream(stream, "launch_host_callback"));
    if (!fn) return InvalidArgument("launch_host_callback: empty function");
    KVTIER_CUDA_GUARD(ordinal_);
    auto callback = std::make_unique<HostCallback>(HostCallback{std::move(fn)});
    KVTIER_CUDA_TRY_CTX(cudaLaunchHostFunc(s->stream(), &run_host_callback, callback.get()),
                        fmt::format("launch_host_callback on stream {} '{}'", stream.id(), s->name()));
    static_cast<void>(callback.release());  // owned by run_host_callback from now on
    return Status::Ok();
  }

 private:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {}

  Result<CudaStream*> cuda_stream(Stream& stream, const char* op) const {
    auto* s = dynamic_cast<CudaStream*>(&stream);
    if (s == nullptr) {
      return InvalidArgument(fmt::format("{}: stream {} is not a CUDA stream (backend {})", op, stream.id(),
                                         backend_name(stream.device().backend())));
    }
    if (s->ordinal() != ordinal_) {
      return InvalidArgument(fmt::format("{}: stream {} '{}' belongs to CUDA device {}, not device {}", op, stream.id(),
                                         s->name(), s->ordinal(), ordinal_));
    }
    return s;
  }

  static Result<CudaEvent*> cuda_event(Event& event, const char* op) {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgument(fmt::format("{}: the event is not a CUDA event", op));
    return e;
  }

  // Kernels read pinned host memory through the host pointer (UVA); that
  // needs the device to accept host pointers for registered memory.
  Status check_host_pointer_access(const char* op) const {
    if (host_pointer_is_device_pointer_) return Status::Ok();
    return NotSupported(fmt::format(
        "{}: device {} ({}) has cudaDevAttrCanUseHostPointerForRegisteredMem = 0; kvtier needs registered host "
        "memory at the same address on the GPU",
        op, ordinal_, name_));
  }

  // Registered host chunks [start, end). The driver rejects one cudaMemcpyAsync
  // whose host range spans two separate registrations (cudaErrorInvalidValue,
  // seen on the H200), so copies are split at chunk ends.
  struct ChunkMap {
    std::mutex mu;
    std::map<std::uintptr_t, std::uintptr_t> chunks;
    std::map<std::uintptr_t, int> refs;  // registrations of this device holding the chunk
    void add(const void* p, std::uint64_t bytes) {
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      std::lock_guard<std::mutex> lock(mu);
      chunks[a] = a + bytes;
      ++refs[a];
    }
    void remove(const void* p) noexcept {
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      std::lock_guard<std::mutex> lock(mu);
      auto r = refs.find(a);
      if (r != refs.end() && --r->second > 0) return;
      if (r != refs.end()) refs.erase(r);
      chunks.erase(a);
    }
    // The registered chunk holding p ({0, 0}: none).
    std::pair<std::uintptr_t, std::uintptr_t> chunk_of(const void* p) {
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      std::lock_guard<std::mutex> lock(mu);
      auto it = chunks.upper_bound(a);
      if (it == chunks.begin()) return {0, 0};
      --it;
      return a < it->second ? std::pair{it->first, it->second} : std::pair<std::uintptr_t, std::uintptr_t>{0, 0};
    }
    // Bytes from p to the end of the registered chunk holding p (0: not registered).
    std::uint64_t contiguous_from(const void* p) {
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      std::lock_guard<std::mutex> lock(mu);
      auto it = chunks.upper_bound(a);
      if (it == chunks.begin()) return 0;
      --it;
      return a < it->second ? it->second - a : 0;
    }
  };

  // Whether a pointer is host memory: registered pinned chunks and this
  // device's allocations are looked up locally; anything else asks the
  // driver (other device memory, managed or plain host).
  Result<bool> is_host_pointer(const void* p) const {
    if (chunk_map_->contiguous_from(p) != 0) return true;
    if (device_map_->contiguous_from(p) != 0) return false;
    cudaPointerAttributes attr{};
    KVTIER_CUDA_TRY_CTX(cudaPointerGetAttributes(&attr, p), fmt::format("cudaPointerGetAttributes({})", p));
    return attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeUnregistered;
  }
  // Both ends of the range are page-locked host memory (cudaHostAlloc'd or
  // registered by someone else).
  bool already_pinned(void* data, std::uint64_t bytes) const {
    DeviceGuard guard(ordinal_);
    for (const void* p :
         {static_cast<const void*>(data), static_cast<const void*>(static_cast<std::byte*>(data) + bytes - 1)}) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        return false;
      }
      if (attr.type != cudaMemoryTypeHost) return false;
    }
    return true;
  }
  Result<bool> both_host(const void* dst, const void* src) const {
    KVTIER_ASSIGN_OR_RETURN(bool dst_host, is_host_pointer(dst));
    if (!dst_host) return false;
    return is_host_pointer(src);
  }

  // One cudaMemcpyAsync per piece that lies within one registration.
  Status split_memcpy(void* dst, const void* src, std::uint64_t bytes, cudaStream_t stream, std::string_view where) {
    std::uint64_t done = 0;
    while (done < bytes) {
      auto* d = static_cast<std::byte*>(dst) + done;
      const auto* sp = static_cast<const std::byte*>(src) + done;
      std::uint64_t piece = bytes - done;
      if (const std::uint64_t c = chunk_map_->contiguous_from(d); c != 0) piece = std::min(piece, c);
      if (const std::uint64_t c = chunk_map_->contiguous_from(sp); c != 0) piece = std::min(piece, c);
      KVTIER_CUDA_TRY_CTX(cudaMemcpyAsync(d, sp, piece, cudaMemcpyDefault, stream),
                          fmt::format("memcpy(dst={}, src={}, bytes={}) on {}", static_cast<void*>(d),
                                      static_cast<const void*>(sp), piece, where));
      done += piece;
    }
    return Status::Ok();
  }

  // The chunks kvtier registered (cudaHostRegister, Portable: one registration serves every device), process-wide
  // and counted: a second registration of the same range (another CudaDevice, or this one again: two managers
  // over one host cache) shares them, and the last one to go unregisters. Borrowed as "already pinned" instead,
  // it lost its pinning when the first went (kernels then faulted reading it through UVA) and knew none of the
  // chunk ends its copies must be cut at.
  struct PinnedChunks {
    std::mutex mu;
    std::map<std::uintptr_t, std::pair<std::uint64_t, int>> chunks;  // base -> (bytes, registrations)
    // True when every chunk that register_host_memory (device/pinned.cc) cuts [data, data + bytes) into at
    // `chunk_bytes` is one of these, exactly: boundaries at multiples of the chunk (chunk_bytes rounded down to
    // pages, at least one page) counted from the page holding `data`.
    bool covers(const void* data, std::uint64_t bytes, std::uint64_t chunk_bytes) {
      const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
      const std::uint64_t chunk = std::max(page, chunk_bytes / page * page);
      const auto begin = reinterpret_cast<std::uintptr_t>(data);
      const std::uintptr_t end = begin + bytes, origin = begin / page * page;
      std::lock_guard<std::mutex> lock(mu);
      for (std::uintptr_t cursor = begin; cursor < end;) {
        const std::uintptr_t stop = std::min<std::uintptr_t>(end, origin + ((cursor - origin) / chunk + 1) * chunk);
        auto it = chunks.find(cursor);
        if (it == chunks.end() || it->second.first != stop - cursor) return false;
        cursor = stop;
      }
      return true;
    }
  };
  static PinnedChunks& pinned_chunks() {
    static auto* p = new PinnedChunks();  // never destroyed: registrations may outlive static destruction
    return *p;
  }

  detail::ChunkRegistrar registrar() const {
    const int ordinal = ordinal_;
    std::shared_ptr<ChunkMap> map = chunk_map_;
    detail::ChunkRegistrar r;
    // Portable: usable from every device's context; Mapped: reachable by
    // kernels (at the host address, checked above).
    r.register_chunk = [ordinal, map](void* ptr, std::uint64_t bytes) -> Status {
      PinnedChunks& pc = pinned_chunks();
      std::lock_guard<std::mutex> lock(pc.mu);
      const auto a = reinterpret_cast<std::uintptr_t>(ptr);
      if (auto it = pc.chunks.find(a); it != pc.chunks.end() && it->second.first == bytes) {
        ++it->second.second;
        map->add(ptr, bytes);
        return Status::Ok();
      }
      DeviceGuard guard(ordinal);
      KVTIER_RETURN_IF_ERROR(guard.status());
      KVTIER_CUDA_TRY_CTX(
          cudaHostRegister(ptr, bytes, cudaHostRegisterDefault | cudaHostRegisterPortable | cudaHostRegisterMapped),
          fmt::format("cudaHostRegister(ptr={}, bytes={}) for device {}", ptr, bytes, ordinal));
      pc.chunks[a] = {bytes, 1};
      map->add(ptr, bytes);
      return Status::Ok();
    };
    r.unregister_chunk = [ordinal, map](void* ptr, std::uint64_t /*bytes*/) noexcept {
      map->remove(ptr);
      PinnedChunks& pc = pinned_chunks();
      std::lock_guard<std::mutex> lock(pc.mu);
      auto it = pc.chunks.find(reinterpret_cast<std::uintptr_t>(ptr));
      if (it != pc.chunks.end() && --it->second.second > 0) return;  // another registration still holds it
      if (it != pc.chunks.end()) pc.chunks.erase(it);
      DeviceGuard guard(ordinal);
      if (cudaHostUnregister(ptr) != cudaSuccess) static_cast<void>(cudaGetLastError());
    };
    return r;
  }

  const int ordinal_;
  std::shared_ptr<ChunkMap> chunk_map_ = std::make_shared<ChunkMap>();
  std::shared_ptr<ChunkMap> device_map_ = std::make_shared<ChunkMap>();  // cudaMalloc'd ranges
  std::string name_;
  int multiprocessors_ = 0;
  bool host_pointer_is_device_pointer_ = false;
  int least_priority_ = 0;
  int greatest_priority_ = 0;
  cudaStream_t sync_stream_ = nullptr;  // memcpy_sync
};

}  // namespace

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // No driver, no device, driver too old: CUDA is simply not available.
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return count;
}

Result<std::unique_ptr<Device>> create_cuda_device(int ordinal) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return Status(StatusCode::kUnavailable, cuda_status(err, "cudaGetDeviceCount").message())
        .with_context(fmt::format("create_cuda_device({}): no usable CUDA device", ordinal));
  }
  if (count == 0) return Unavailable(fmt::format("create_cuda_device({}): no CUDA device visible", ordinal));
  if (ordinal < 0 || ordinal >= count) {
    return InvalidArgument(
        fmt::format("create_cuda_device: ordinal {} out of range, {} CUDA device(s) visible", ordinal, count));
  }
  return CudaDevice::create(ordinal);
}

}  // namespace kvtier
