// HostDevice implementation.
//
// Model: each stream is a worker thread draining an in-order queue of
// operations, each with a 1-based per-stream sequence number. The stream keeps
// `enqueued` (last sequence number handed out) and `completed` (last one
// finished) plus a sticky failure: the sequence number of the first failed
// operation and its Status. An event is a fence (stream, seq): record()
// captures the stream's current `enqueued`, so no marker operation is needed;
// the event is complete when `completed >= seq` and failed when the stream's
// first failure is at or before seq. wait(s, e) enqueues an operation on s
// whose worker blocks until e's fence completes; if the fenced work failed,
// the wait operation fails with that status, so the failure becomes sticky on
// s too (as wrong bytes would flow through a GPU dependency).
//
// Deadlock freedom: a wait operation only targets a fence captured before it
// was enqueued, so waits cannot form a cycle, and every worker keeps draining
// its queue until it is empty, even while its stream is being destroyed
// (destruction = stop flag + join, which drains). Later operations on a failed
// stream still run (their inputs may be wrong); only the events report it.
//
// Memory ordering: a worker publishes `completed` under the stream mutex after
// the operation's writes; anyone observing completion (query, synchronize,
// another worker's wait) takes that mutex, which orders the bytes for them.
#include "kvtier/device/host_device.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "backends/host/host_backend.h"
#include "device/pinned.h"
#include "kvtier/core/deadline.h"
#include "kvtier/core/enum_names.h"

namespace kvtier {
namespace {

constexpr unsigned char kDevicePoison = 0xA5;
constexpr unsigned char kFailurePoison = 0xDB;
constexpr std::uint64_t kDeviceAlignment = 64;

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Waits for `pred` up to `timeout` (saturated: deadline.h). Returns pred().
template <typename Pred>
bool wait_for(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, std::chrono::nanoseconds timeout,
              Pred pred) {
  if (timeout <= std::chrono::nanoseconds::zero()) return pred();
  return cv.wait_until(lock, deadline_after(timeout), pred);
}

// State shared by the device object and its streams, so that workers never
// depend on the HostDevice object's lifetime.
struct Core {
  explicit Core(HostDeviceOptions opts)
      : options(std::move(opts)), min_delay_us(options.min_delay.count()), max_delay_us(options.max_delay.count()) {}

  std::shared_ptr<const FailurePredicate> predicate() const {
    std::lock_guard lock(predicate_mu);
    return failure_predicate;
  }

  const HostDeviceOptions options;
  std::atomic<std::int64_t> min_delay_us;
  std::atomic<std::int64_t> max_delay_us;
  std::atomic<std::uint64_t> operations_executed{0};
  std::atomic<std::uint64_t> failing_allocations{0};  // the next this many allocations fail (fail_allocations)
  std::atomic<std::uint64_t> streams_created{0};
  mutable std::mutex predicate_mu;
  std::shared_ptr<const FailurePredicate> failure_predicate;  // guarded by predicate_mu
  // A fixed delay for the data operations of streams whose label starts with
  // a prefix (set_stream_delay: before each runs; set_enqueue_delay: in the
  // caller, before each is enqueued). Guarded by predicate_mu.
  struct LabelDelay {
    std::string label_prefix;  // empty: none
    std::chrono::microseconds delay{0};
    void set(std::string_view name_prefix, std::chrono::microseconds d) {
      label_prefix = name_prefix.empty() ? std::string() : fmt::format("stream '{}", name_prefix);
      delay = std::max(d, std::chrono::microseconds(0));
    }
  };
  LabelDelay run_delay, enqueue_delay;
  // Sleeps for `which`'s delay when `label` matches its prefix.
  void sleep_if_delayed(const LabelDelay Core::*which, std::string_view label) const {
    std::chrono::microseconds d{0};
    {
      std::lock_guard lock(predicate_mu);
      const LabelDelay& ld = this->*which;
      if (!ld.label_prefix.empty() && label.starts_with(ld.label_prefix)) d = ld.delay;
    }
    if (d.count() > 0) std::this_thread::sleep_for(d);
  }
};

enum class OpKind : std::uint8_t { kMemcpy, kMemset, kTask, kWait, kCallback, kStamp };

constexpr EnumName<OpKind> kOpEntries[] = {
    {OpKind::kMemcpy, "memcpy_async"}, {OpKind::kMemset, "memset_async"},           {OpKind::kTask, "enqueue_task"},
    {OpKind::kWait, "wait"},           {OpKind::kCallback, "launch_host_callback"}, {OpKind::kStamp, "record (timing)"},
};
constexpr auto kOpNames = enum_table("op", kOpEntries, "operation");
std::string_view op_name(OpKind kind) { return kOpNames.name(kind); }

struct StreamState;

struct Op {
  OpKind kind = OpKind::kMemcpy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::uint64_t bytes = 0;
  int value = 0;
  std::function<Status()> task;
  std::function<void(const Status&)> callback;
  std::shared_ptr<std::atomic<std::int64_t>> stamp;  // kStamp: completion time (steady clock, ns)
  std::shared_ptr<StreamState> wait_stream;          // kWait: the fence to wait for
  std::uint64_t wait_seq = 0;
  std::uint64_t seq = 0;  // 1-based position in its stream
};

struct StreamState {
  StreamState(std::shared_ptr<Core> c, std::string l, std::uint64_t seed)
      : core(std::move(c)), label(std::move(l)), rng(seed) {}

  // Status of the work up to and including `seq`. Caller holds mu.
  Status status_through(std::uint64_t seq) const {
    if (failed_seq != 0 && failed_seq <= seq) return failure;
    return Status::Ok();
  }

  const std::shared_ptr<Core> core;
  const std::string label;  // "'name' (stream 7)" for messages
  std::mt19937_64 rng;      // worker thread only

  std::mutex mu;
  std::condition_variable work_cv;  // queue non-empty or stopping
  std::condition_variable done_cv;  // completed advanced
  std::deque<Op> queue;
  std::uint64_t enqueued = 0;
  std::uint64_t completed = 0;
  std::uint64_t failed_seq = 0;  // 0: no failure
  Status failure;
  bool stopping = false;
};

void inject_delay(Core& core, std::mt19937_64& rng) {
  std::int64_t lo = core.min_delay_us.load(std::memory_order_relaxed);
  std::int64_t hi = core.max_delay_us.load(std::memory_order_relaxed);
  if (hi <= 0) return;
  lo = std::clamp<std::int64_t>(lo, 0, hi);
  const std::int64_t us = std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

std::string exception_text(std::exception_ptr e) {
  try {
    std::rethrow_exception(std::move(e));
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

// Runs one data operation (copy, memset, task) with failure injection.
// `rng` null: no injected delay (synchronous calls).
Status execute_data_op(Core& core, std::mt19937_64* rng, std::string_view where, Op& op) {
  if (rng != nullptr) {
    inject_delay(core, *rng);
    core.sleep_if_delayed(&Core::run_delay, where);
  }
  const std::uint64_t n = core.operations_executed.fetch_add(1, std::memory_order_relaxed) + 1;
  bool inject = false;
  if (auto predicate = core.predicate(); predicate) {
    // The caller's hook: one that throws fails the operation instead of ending the process on a stream worker.
    try {
      inject = (*predicate)(n, op.dst, op.bytes);
    } catch (...) {
      return Internal(fmt::format("failure predicate threw on {} #{} on {}: {}", op_name(op.kind), n, where,
                                  exception_text(std::current_exception())));
    }
  }
  if (inject) {
    if (core.options.poison_on_failure && op.dst != nullptr && op.bytes > 0) {
      std::memset(op.dst, kFailurePoison, op.bytes);
    }
    return DataLoss(fmt::format("injected failure in {} #{} on {} (dst={}, {} bytes)", op_name(op.kind), n, where,
                                op.dst, op.bytes));
  }
  switch (op.kind) {
    case OpKind::kMemcpy: std::memcpy(op.dst, op.src, op.bytes); return Status::Ok();
    case OpKind::kMemset: std::memset(op.dst, op.value, op.bytes); return Status::Ok();
    case OpKind::kTask: {
      Status status;
      try {
        status = op.task();
      } catch (...) {
        status = Internal(fmt::format("task threw: {}", exception_text(std::current_exception())));
      }
      if (!status.ok()) return status.with_context(fmt::format("enqueue_task #{} on {}", n, where));
      return status;
    }
    case OpKind::kWait:
    case OpKind::kCallback:
    case OpKind::kStamp: break;
  }
  return Internal(fmt::format("{} is not a data operation", op_name(op.kind)));
}

Status execute_wait(StreamState& self, const Op& op) {
  StreamState& other = *op.wait_stream;
  Status status;
  {
    std::unique_lock lock(other.mu);
    other.done_cv.wait(lock, [&] { return other.completed >= op.wait_seq; });
    status = other.status_through(op.wait_seq);
  }
  if (status.ok()) return status;
  return status.with_context(
      fmt::format("{} waited (op #{}) on work of {} that failed", self.label, op.seq, other.label));
}

Status execute(StreamState& self, Op& op) {
  switch (op.kind) {
    case OpKind::kMemcpy:
    case OpKind::kMemset:
    case OpKind::kTask: return execute_data_op(*self.core, &self.rng, self.label, op);
    case OpKind::kWait: return execute_wait(self, op);
    case OpKind::kStamp:
      op.stamp->store(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
              .count(),
          std::memory_order_release);
      return Status::Ok();
    case OpKind::kCallback: {
      Status prior;
      {
        std::lock_guard lock(self.mu);
        prior = self.status_through(op.seq - 1);
      }
      try {
        op.callback(prior);
      } catch (...) {
        return Internal(fmt::format("host callback (op #{}) on {} threw: {}", op.seq, self.label,
                                    exception_text(std::current_exception())));
      }
      return Status::Ok();
    }
  }
  return Internal("unknown operation kind");
}

void worker_main(std::shared_ptr<StreamState> state) {
  StreamState& s = *state;
  for (;;) {
    std::uint64_t seq = 0;
    Status status;
    {
      Op op;
      {
        std::unique_lock lock(s.mu);
        s.work_cv.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
        if (s.queue.empty()) return;  // stopping and drained
        op = std::move(s.queue.front());
        s.queue.pop_front();
      }
      seq = op.seq;
      status = execute(s, op);
    }  // the op's captures are released before completion is published
    {
      std::lock_guard lock(s.mu);
      s.completed = seq;
      if (!status.ok() && s.failed_seq == 0) {
        s.failed_seq = seq;
        s.failure = std::move(status);
      }
    }
    s.done_cv.notify_all();
  }
}

class HostStream final : public Stream {
 public:
  HostStream(HostDevice& device, std::shared_ptr<Core> core, const std::string& name, std::uint64_t seed)
      : device_(device),
        state_(std::make_shared<StreamState>(
            std::move(core),
            name.empty() ? fmt::format("stream {}", id()) : fmt::format("stream '{}' ({})", name, id()), seed)) {}

  // Drains: the worker exits only once its queue is empty. Destroying a
  // stream from its own callback detaches the worker, which still drains.
  ~HostStream() override {
    {
      std::lock_guard lock(state_->mu);
      state_->stopping = true;
    }
    state_->work_cv.notify_all();
    if (!worker_.joinable()) return;
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }

  Status start() {
    try {
      worker_ = std::thread(worker_main, state_);
    } catch (const std::system_error& e) {
      return ResourceExhausted(fmt::format("cannot start the worker thread of {}: {}", state_->label, e.what()));
    }
    return Status::Ok();
  }

  Device& device() const noexcept override { return device_; }
  void* native_handle() const noexcept override { return state_.get(); }
  const std::shared_ptr<StreamState>& state() const { return state_; }

 private:
  HostDevice& device_;
  std::shared_ptr<StreamState> state_;
  std::thread worker_;
};

class HostEvent final : public Event {
 public:
  HostEvent(const Core* owner, bool timing) : owner_(owner), timing_(timing) {}
  void* native_handle() const noexcept override { return const_cast<HostEvent*>(this); }
  const Core* owner() const { return owner_; }
  bool timing() const { return timing_; }

  void set(std::shared_ptr<StreamState> stream, std::uint64_t seq,
           std::shared_ptr<std::atomic<std::int64_t>> stamp = nullptr) {
    std::lock_guard lock(mu_);
    stream_ = std::move(stream);
    seq_ = seq;
    stamp_ = std::move(stamp);
  }
  // (null, 0) when never recorded.
  std::pair<std::shared_ptr<StreamState>, std::uint64_t> fence() const {
    std::lock_guard lock(mu_);
    return {stream_, seq_};
  }
  // Timing events: the completion time of the last record (null: never recorded).
  std::shared_ptr<std::atomic<std::int64_t>> stamp() const {
    std::lock_guard lock(mu_);
    return stamp_;
  }

 private:
  const Core* const owner_;
  mutable std::mutex mu_;
  std::shared_ptr<StreamState> stream_;
  std::uint64_t seq_ = 0;
  const bool timing_;
  std::shared_ptr<std::atomic<std::int64_t>> stamp_;
};

Status check_range(std::string_view what, const void* ptr, std::uint64_t bytes) {
  if (ptr == nullptr) return InvalidArgument(fmt::format("{} pointer is null ({} bytes)", what, bytes));
  if (reinterpret_cast<std::uintptr_t>(ptr) > UINTPTR_MAX - bytes) {
    return InvalidArgument(fmt::format("{} range {} + {} bytes wraps around", what, ptr, bytes));
  }
  return Status::Ok();
}

Status check_copy(void* dst, const void* src, std::uint64_t bytes) {
  KVTIER_RETURN_IF_ERROR(check_range("memcpy dst", dst, bytes));
  KVTIER_RETURN_IF_ERROR(check_range("memcpy src", src, bytes));
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {
    return InvalidArgument(fmt::format("memcpy ranges overlap: dst={} src={} ({} bytes)", dst, src, bytes));
  }
  return Status::Ok();
}

}  // namespace

struct HostDevice::Impl {
  std::shared_ptr<Core> core;

  Result<HostStream*> stream_of(Stream& stream) const {
    auto* host = dynamic_cast<HostStream*>(&stream);
    if (host == nullptr || host->state()->core != core) {
      return InvalidArgument(fmt::format("stream {} does not belong to host device '{}' (ordinal {})", stream.id(),
                                         core->options.name, core->options.ordinal));
    }
    return host;
  }
  Result<HostEvent*> event_of(Event& event) const {
    auto* host = dynamic_cast<HostEvent*>(&event);
    if (host == nullptr || host->owner() != core.get()) {
      return InvalidArgument(fmt::format("event {} does not belong to host device '{}' (ordinal {})",
                                         event.native_handle(), core->options.name, core->options.ordinal));
    }
    return host;
  }
  static std::uint64_t enqueue(StreamState& s, Op op) {
    // The caller's thread: a slow submission.
    if (op.kind == OpKind::kMemcpy || op.kind == OpKind::kMemset || op.kind == OpKind::kTask)
      s.core->sleep_if_delayed(&Core::enqueue_delay, s.label);
    std::uint64_t seq = 0;
    {
      std::lock_guard lock(s.mu);
      seq = ++s.enqueued;
      op.seq = seq;
      s.queue.push_back(std::move(op));
    }
    s.work_cv.notify_one();
    return seq;
  }
  static Status wait_fence(StreamState& s, std::uint64_t seq, std::chrono::nanoseconds timeout, std::string_view what) {
    std::unique_lock lock(s.mu);
    if (!wait_for(s.done_cv, lock, timeout, [&] { return s.completed >= seq; })) {
      return TimedOut(fmt::format("synchronize({}) timed out after {} us: {} completed {} of {} operations", what,
                                  std::chrono::duration_cast<std::chrono::microseconds>(timeout).count(), s.label,
                                  s.completed, seq));
    }
    return s.status_through(seq);
  }
};

Result<std::unique_ptr<HostDevice>> HostDevice::create(const HostDeviceOptions& options) {
  if (options.min_delay.count() < 0 || options.max_delay < options.min_delay) {
    return InvalidArgument(fmt::format("host device delays must satisfy 0 <= min_delay <= max_delay, got [{}, {}] us",
                                       options.min_delay.count(), options.max_delay.count()));
  }
  if (options.simulated_multiprocessors < 1) {
    return InvalidArgument(fmt::format("simulated_multiprocessors {} must be >= 1", options.simulated_multiprocessors));
  }
  auto impl = std::make_unique<Impl>();
  impl->core = std::make_shared<Core>(options);
  return std::unique_ptr<HostDevice>(new HostDevice(std::move(impl)));
}

HostDevice::HostDevice(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostDevice::~HostDevice() = default;

const void* HostDevice::extension(std::string_view id) const noexcept {
  if (id == CopyBackend::kExtension) return &copy_detail::host_copy_backend();
  return nullptr;
}

int HostDevice::ordinal() const noexcept { return impl_->core->options.ordinal; }
std::string HostDevice::name() const { return impl_->core->options.name; }
int HostDevice::multiprocessor_count() const noexcept { return impl_->core->options.simulated_multiprocessors; }

Result<std::unique_ptr<Stream>> HostDevice::create_stream(const StreamOptions& options) {
  Core& core = *impl_->core;
  const std::uint64_t index = core.streams_created.fetch_add(1, std::memory_order_relaxed);
  // Streams of one device get distinct, reproducible delay sequences.
  auto stream =
      std::make_unique<HostStream>(*this, impl_->core, options.name, splitmix64(core.options.seed ^ splitmix64(index)));
  KVTIER_RETURN_IF_ERROR(stream->start());
  return std::unique_ptr<Stream>(std::move(stream));
}

Result<std::unique_ptr<Event>> HostDevice::create_event(const EventOptions& options) {
  return std::unique_ptr<Event>(std::make_unique<HostEvent>(impl_->core.get(), options.timing));
}

namespace {
// fail_allocations(): takes one of the failures still to give, if any.
bool take_failing_allocation(std::atomic<std::uint64_t>& left) {
  std::uint64_t n = left.load();
  while (n != 0 && !left.compare_exchange_weak(n, n - 1)) {
  }
  return n != 0;
}
}  // namespace

void HostDevice::fail_allocations(std::uint64_t n) { impl_->core->failing_allocations.store(n); }

Result<Buffer> HostDevice::allocate_device(std::uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("allocate_device: bytes is 0");
  if (take_failing_allocation(impl_->core->failing_allocations))
    return ResourceExhausted(fmt::format("allocate_device: {} bytes: injected failure", bytes));
  if (bytes > UINT64_MAX - kDeviceAlignment) {
    return InvalidArgument(fmt::format("allocate_device: bytes {} too large", bytes));
  }
  const std::uint64_t rounded = (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
  void* ptr = std::aligned_alloc(kDeviceAlignment, rounded);
  if (ptr == nullptr) {
    return ResourceExhausted(fmt::format("allocate_device: cannot allocate {} bytes of simulated device memory on '{}'",
                                         bytes, impl_->core->options.name));
  }
  std::memset(ptr, kDevicePoison, rounded);
  return Buffer(ptr, bytes, MemoryKind::kDevice, [ptr] { std::free(ptr); });
}

Result<std::unique_ptr<PinnedMemory>> HostDevice::allocate_pinned(std::uint64_t bytes, const PinnedOptions& options) {
  if (take_failing_allocation(impl_->core->failing_allocations))
    return ResourceExhausted(fmt::format("allocate_pinned: {} bytes: injected failure", bytes));
  return detail::allocate_pinned_memory(bytes, options, detail::ChunkRegistrar{});
}

Result<std::unique_ptr<PinnedMemory>> HostDevice::register_host(void* data, std::uint64_t bytes,
                                                                const PinnedOptions& options) {
  return detail::register_host_memory(data, bytes, options, detail::ChunkRegistrar{});
}

Status HostDevice::memcpy_async(void* dst, const void* src, std::uint64_t bytes, Stream& stream) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  if (bytes == 0) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(check_copy(dst, src, bytes));
  Op op;
  op.kind = OpKind::kMemcpy;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  Impl::enqueue(*host->state(), std::move(op));
  return Status::Ok();
}

Status HostDevice::memset_async(void* dst, int value, std::uint64_t bytes, Stream& stream) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  if (bytes == 0) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(check_range("memset dst", dst, bytes));
  Op op;
  op.kind = OpKind::kMemset;
  op.dst = dst;
  op.value = value & 0xFF;
  op.bytes = bytes;
  Impl::enqueue(*host->state(), std::move(op));
  return Status::Ok();
}

Status HostDevice::memcpy_sync(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(check_copy(dst, src, bytes));
  // Runs on the calling thread: it is ordered with nothing else, like a copy
  // on an otherwise idle internal stream. No injected delay.
  Op op;
  op.kind = OpKind::kMemcpy;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  return execute_data_op(*impl_->core, nullptr, "memcpy_sync", op);
}

Status HostDevice::record(Event& event, Stream& stream) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host_stream, impl_->stream_of(stream));
  KVTIER_ASSIGN_OR_RETURN(HostEvent * host_event, impl_->event_of(event));
  const std::shared_ptr<StreamState>& state = host_stream->state();
  if (host_event->timing()) {
    // A marker that stamps its completion time; not a data operation (no
    // delay, no failure injection, not counted).
    Op op;
    op.kind = OpKind::kStamp;
    op.stamp = std::make_shared<std::atomic<std::int64_t>>(0);
    auto stamp = op.stamp;
    const std::uint64_t seq = Impl::enqueue(*state, std::move(op));
    host_event->set(state, seq, std::move(stamp));
    return Status::Ok();
  }
  std::uint64_t seq = 0;
  {
    std::lock_guard lock(state->mu);
    seq = state->enqueued;
  }
  host_event->set(state, seq);
  return Status::Ok();
}

Result<double> HostDevice::elapsed_ms(Event& start, Event& end) {
  KVTIER_ASSIGN_OR_RETURN(HostEvent * a, impl_->event_of(start));
  KVTIER_ASSIGN_OR_RETURN(HostEvent * b, impl_->event_of(end));
  std::int64_t stamps[2] = {0, 0};
  int i = 0;
  for (HostEvent* e : {a, b}) {
    const char* which = i == 0 ? "start" : "end";
    if (!e->timing())
      return FailedPrecondition(fmt::format("elapsed_ms: the {} event was created without timing", which));
    auto stamp = e->stamp();
    if (stamp == nullptr) return FailedPrecondition(fmt::format("elapsed_ms: the {} event was never recorded", which));
    KVTIER_ASSIGN_OR_RETURN(bool done, query(*e));
    if (!done) return Unavailable(fmt::format("elapsed_ms: the {} event has not completed yet", which));
    stamps[i++] = stamp->load(std::memory_order_acquire);
  }
  return static_cast<double>(stamps[1] - stamps[0]) / 1e6;
}

Status HostDevice::wait(Stream& stream, Event& event) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host_stream, impl_->stream_of(stream));
  KVTIER_ASSIGN_OR_RETURN(HostEvent * host_event, impl_->event_of(event));
  auto [fence_stream, fence_seq] = host_event->fence();
  // Never recorded, or recorded on this stream (in-order already): nothing to wait for.
  if (fence_stream == nullptr || fence_stream == host_stream->state()) return Status::Ok();
  Op op;
  op.kind = OpKind::kWait;
  op.wait_stream = std::move(fence_stream);
  op.wait_seq = fence_seq;
  Impl::enqueue(*host_stream->state(), std::move(op));
  return Status::Ok();
}

Result<bool> HostDevice::query(Event& event) {
  KVTIER_ASSIGN_OR_RETURN(HostEvent * host_event, impl_->event_of(event));
  auto [stream, seq] = host_event->fence();
  if (stream == nullptr) return true;
  std::lock_guard lock(stream->mu);
  if (stream->completed < seq) return false;
  Status status = stream->status_through(seq);
  if (!status.ok()) return status;
  return true;
}

Status HostDevice::synchronize(Event& event, std::chrono::nanoseconds timeout) {
  KVTIER_ASSIGN_OR_RETURN(HostEvent * host_event, impl_->event_of(event));
  auto [stream, seq] = host_event->fence();
  if (stream == nullptr) return Status::Ok();
  return Impl::wait_fence(*stream, seq, timeout, "event");
}

Status HostDevice::synchronize(Stream& stream, std::chrono::nanoseconds timeout) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  StreamState& state = *host->state();
  std::uint64_t seq = 0;
  {
    std::lock_guard lock(state.mu);
    seq = state.enqueued;
  }
  return Impl::wait_fence(state, seq, timeout, "stream");
}

Result<bool> HostDevice::query(Stream& stream) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  StreamState& state = *host->state();
  std::lock_guard lock(state.mu);
  if (state.completed < state.enqueued) return false;
  Status status = state.status_through(state.enqueued);
  if (!status.ok()) return status;
  return true;
}

Status HostDevice::launch_host_callback(Stream& stream, std::function<void(const Status&)> fn) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  if (!fn) return InvalidArgument(fmt::format("launch_host_callback: empty callback on {}", host->state()->label));
  Op op;
  op.kind = OpKind::kCallback;
  op.callback = std::move(fn);
  Impl::enqueue(*host->state(), std::move(op));
  return Status::Ok();
}

Status HostDevice::enqueue_task(Stream& stream, std::function<Status()> task, void* dst, std::uint64_t bytes) {
  KVTIER_ASSIGN_OR_RETURN(HostStream * host, impl_->stream_of(stream));
  if (!task) return InvalidArgument(fmt::format("enqueue_task: empty task on {}", host->state()->label));
  if (dst != nullptr) KVTIER_RETURN_IF_ERROR(check_range("enqueue_task dst", dst, bytes));
  Op op;
  op.kind = OpKind::kTask;
  op.task = std::move(task);
  op.dst = dst;
  op.bytes = dst != nullptr ? bytes : 0;
  Impl::enqueue(*host->state(), std::move(op));
  return Status::Ok();
}

void HostDevice::set_failure_predicate(FailurePredicate predicate) {
  std::shared_ptr<const FailurePredicate> shared;
  if (predicate) shared = std::make_shared<const FailurePredicate>(std::move(predicate));
  std::lock_guard lock(impl_->core->predicate_mu);
  impl_->core->failure_predicate = std::move(shared);
}

void HostDevice::fail_nth_operation(std::uint64_t n) {
  if (n == 0) {
    set_failure_predicate(nullptr);
    return;
  }
  const std::uint64_t target = operations_executed() + n;
  set_failure_predicate([target](std::uint64_t seq, const void*, std::uint64_t) { return seq == target; });
}

void HostDevice::set_stream_delay(std::string_view name_prefix, std::chrono::microseconds delay) {
  std::lock_guard lock(impl_->core->predicate_mu);
  impl_->core->run_delay.set(name_prefix, delay);
}

void HostDevice::set_enqueue_delay(std::string_view name_prefix, std::chrono::microseconds delay) {
  std::lock_guard lock(impl_->core->predicate_mu);
  impl_->core->enqueue_delay.set(name_prefix, delay);
}

void HostDevice::set_delays(std::chrono::microseconds min_delay, std::chrono::microseconds max_delay) {
  const std::int64_t lo = std::max<std::int64_t>(0, min_delay.count());
  const std::int64_t hi = std::max<std::int64_t>(lo, max_delay.count());
  impl_->core->min_delay_us.store(lo, std::memory_order_relaxed);
  impl_->core->max_delay_us.store(hi, std::memory_order_relaxed);
}

std::uint64_t HostDevice::operations_executed() const noexcept {
  return impl_->core->operations_executed.load(std::memory_order_relaxed);
}

void HostDevice::clear_stream_error(Stream& stream) {
  auto host = impl_->stream_of(stream);
  if (!host.ok()) return;
  StreamState& state = *(*host)->state();
  std::lock_guard lock(state.mu);
  state.failed_seq = 0;
  state.failure = Status::Ok();
}

}  // namespace kvtier
