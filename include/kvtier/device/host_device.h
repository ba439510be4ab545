// HostDevice: a device simulated in RAM, so that everything above the device
// layer runs and is tested where there is no GPU (CI).
//
//   - "Device memory" is ordinary host memory (64-byte aligned), poisoned
//     with 0xA5 on allocation so that unwritten bytes are visible.
//   - Each Stream is one worker thread executing its queue in order.
//   - Events are fences: record() captures the queue position; query() reads it;
//     wait() makes the waiting stream's worker block until the marker passes.
//   - Injected delays (uniform in [min_delay, max_delay] before each
//     operation, per stream, seeded) reorder completions across streams to
//     expose missing ordering. Injected failures make a chosen operation fail:
//     its bytes are not written (poisoned instead, when poison_on_failure),
//     and events recorded after it on that stream report the failure.
//
// Details the conformance suite and host_device_test pin down:
//   - record() captures the stream's queue tail (a sequence number); no
//     marker is enqueued, except for timing events (EventOptions::timing),
//     whose record enqueues a marker that stamps the steady clock when it
//     runs (not a data operation: no delay, no failure, not counted). wait() on a never-recorded event, or on an event
//     recorded on the same stream, enqueues nothing. An Event may be
//     destroyed while a wait on it is still pending (the wait holds the
//     fence, not the event).
//   - Failure: a failing operation (injected, or a task returning an error)
//     makes the stream's status sticky from that operation on; query() /
//     synchronize() of any fence at or after it return that Status. Injected
//     failures are kDataLoss with a message such as "injected failure in
//     memcpy_async #17 on stream 'evict' (3) (dst=0x..., 4096 bytes)", #17
//     being the global data-operation number. Later operations on the
//     stream still run (their inputs may be wrong), as bytes would flow on a
//     GPU. A wait() on a failed fence fails the waiting stream too (with the
//     original message, prefixed with both stream names), so failures
//     propagate along every dependency. Callbacks receive the stream's
//     status; a callback or task that throws fails the stream (kInternal).
//   - Delays are drawn when an operation starts; memcpy_sync runs on the
//     calling thread without delay (failure injection still applies).
//   - Caller bugs are InvalidArgument: null pointers, overlapping copy
//     ranges, zero-byte allocations, streams/events of another device.
//     Zero-byte copies and memsets are no-ops. StreamPriority is ignored.
//   - Lifetime: destroy streams and events before the device. A stream's
//     destructor drains its queue (the worker exits only when the queue is
//     empty; destroying a stream from its own callback detaches the worker,
//     which still drains). Waits cannot deadlock: a wait only targets a fence
//     captured before it was enqueued, so waits never form a cycle.
//
// Thread-safety: as Device. Failure-injection setters may be called from any
// thread at any time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kvtier/backend/device.h"

namespace kvtier {

struct HostDeviceOptions {
  int ordinal = 0;
  std::string name = "host-sim";
  int simulated_multiprocessors = 132;
  std::chrono::microseconds min_delay{0};
  std::chrono::microseconds max_delay{0};
  std::uint64_t seed = 1;
  bool poison_on_failure = true;  // a failed copy writes 0xDB over its destination
};

// Decides whether one asynchronous data operation fails. Called on the stream
// worker with the operation's destination and size and a global 1-based
// sequence number of data operations (copies, memsets and tasks, numbered in
// the order they start). Workers call it concurrently: it must be thread-safe.
using FailurePredicate = std::function<bool(std::uint64_t seq, const void* dst, std::uint64_t bytes)>;

class HostDevice final : public Device {
 public:
  static Result<std::unique_ptr<HostDevice>> create(const HostDeviceOptions& options = {});
  ~HostDevice() override;

  BackendKind backend() const noexcept override { return BackendKind::kHost; }
  // Offers the host backend's copy engine (CopyBackend::kExtension).
  const void* extension(std::string_view id) const noexcept override;
  int ordinal() const noexcept override;
  std::string name() const override;
  int multiprocessor_count() const noexcept override;

  Result<std::unique_ptr<Stream>> create_stream(const StreamOptions& options = {}) override;
  using Device::create_event;
  Result<std::unique_ptr<Event>> create_event(const EventOptions& options) override;
  Result<Buffer> allocate_device(std::uint64_t bytes) override;
  Result<std::unique_ptr<PinnedMemory>> allocate_pinned(std::uint64_t bytes,
                                                        const PinnedOptions& options = {}) override;
  Result<std::unique_ptr<PinnedMemory>> register_host(void* data, std::uint64_t bytes,
                                                      const PinnedOptions& options = {}) override;
  Status memcpy_async(void* dst, const void* src, std::uint64_t bytes, Stream& stream) override;
  Status memset_async(void* dst, int value, std::uint64_t bytes, Stream& stream) override;
  Status memcpy_sync(void* dst, const void* src, std::uint64_t bytes) override;
  Status record(Event& event, Stream& stream) override;
  Status wait(Stream& stream, Event& event) override;
  Result<bool> query(Event& event) override;
  Status synchronize(Event& event, std::chrono::nanoseconds timeout) override;
  Status synchronize(Stream& stream, std::chrono::nanoseconds timeout) override;
  Result<bool> query(Stream& stream) override;
  Status launch_host_callback(Stream& stream, std::function<void(const Status&)> fn) override;
  Result<double> elapsed_ms(Event& start, Event& end) override;

  // Enqueues arbitrary work on a stream's worker, ordered like a copy. The
  // task's Status becomes the stream's status for later events (a failing
  // task marks the stream failed, as a failed kernel would). Used by the copy
  // engine to run its batched and kernel strategies on the host backend.
  // `dst`/`bytes` describe what the task writes, for failure injection and
  // poisoning (dst may be null).
  Status enqueue_task(Stream& stream, std::function<Status()> task, void* dst = nullptr, std::uint64_t bytes = 0);

  // Fault injection (nullptr clears). Applies to operations that start after the call.
  void set_failure_predicate(FailurePredicate predicate);
  // Convenience: the n-th data operation to start from now (1-based) fails;
  // counted from operations_executed() at the call. n == 0 clears. Replaces
  // any predicate.
  void fail_nth_operation(std::uint64_t n);
  // The next `n` calls of allocate_device / allocate_pinned fail with kResourceExhausted (0: none), as when the GPU
  // or the host is out of memory.
  void fail_allocations(std::uint64_t n);
  void set_delays(std::chrono::microseconds min_delay, std::chrono::microseconds max_delay);
  // Every data operation on a stream whose name starts with `name_prefix`
  // sleeps `delay` before it runs (on top of set_delays), e.g. to make one
  // mechanism slow. An empty prefix clears it.
  void set_stream_delay(std::string_view name_prefix, std::chrono::microseconds delay);
  // Enqueueing a data operation (copy, memset, task) on a stream whose name
  // starts with `name_prefix` blocks the calling thread for `delay` first,
  // like a slow driver submission (e.g. thousands of DMA descriptors). An
  // empty prefix clears it.
  void set_enqueue_delay(std::string_view name_prefix, std::chrono::microseconds delay);
  // Data operations executed so far (copies, memsets, tasks).
  std::uint64_t operations_executed() const noexcept;
  // Clears the sticky failure state of a stream (tests only; CUDA cannot).
  void clear_stream_error(Stream& stream);

  struct Impl;

 private:
  explicit HostDevice(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier
