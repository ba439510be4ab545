// Prefill/decode protocol (include/kvtier/transport/pd.h).
//
// Messages (transport notifications), all integers little-endian:
//   'R' xid u8 mode u8 lane u32 n n*u64 dst     decode -> prefill: start (destination blocks; lane 0: transport,
//                                               1: device, the receiving side verifies; 2: device, the moving
//                                               side verifies)
//   'W' xid u32 layer u32 n n*u64 checksum     prefill -> decode: notification of layer's WRITE (push)
//   'A' xid u32 layer u32 n n*u64 src n*u64 ck prefill -> decode: layer ready for reading (pull)
//   'K' xid u32 layer u32 n n*u64 ck           prefill -> decode: the checksums of a layer announced by an 'A' with
//                                              an empty checksum list (pull, transport lane; see below)
//   'D' xid u32 layer                          decode -> prefill: notification of the layer's READ (pull)
//   'X' xid u32 layer                          prefill -> decode: the layer cannot be sent (failed post)
//   'F' xid u8 ok                              decode -> prefill: the decode side is final
//   'Q' xid                                    prefill -> decode: final, and every write of it is quiescent
//   'H' xid u64 seq u64 echo                   both ways: heartbeat number `seq`; `echo`: the highest heartbeat
//                                              number received from the other side (0: none yet)
// A negative notification (aborted, failed to post) carries the 'W' or 'D' text of its transfer.
//
// A transfer id names one prefill's transfers: a message applies to a transfer only when its sender is the peer the
// transfer was begun or started with (by agent name); another decode's 'R' for a begun id is answered with 'X' on
// every layer. A request that comes before begin() is kept per (id, sender) and both sides heartbeat it, so a prefill
// whose forward begins later than the lease keeps its lease; it ends with the decode's 'F' (answered with 'Q') or its
// silence for a lease. A repeated 'R' of a requested transfer is ignored; an 'R' for a transfer that ended without
// one (begun after its decode gave up on the id) is answered with 'X' on every layer. A closing prefill sends 'X' for
// what it did not send and 'Q' once its copies have drained; a closing decode fails what is not final ('F') and waits,
// up to a lease, for 'Q' before its memory may go.
//
// Leases are renewed only by echoes: a heartbeat that echoes our heartbeat n proves the peer was alive when we
// sent n, so the lease runs from n's send time. A message processed late (queued while this side or the wire
// stalled) can therefore never extend the lease of a peer that has died since; renewing by the time a message
// was processed did. 'Q' is what proves to the decode side that no write of the prefill can still land.
//
// Ring lane (pd.h), lane byte 3 in 'R', which then ends with u32 slots u64 slot_bytes (the decode's ring, its
// region number num_planes):
//   'Y' xid u32 layer                               prefill -> decode: the layer's data is ready here; its pieces may
//                                                  be granted slots (a transfer whose forward has not reached a layer
//                                                  holds no slot)
//   'G' xid u32 layer u32 piece u32 slot            decode -> prefill: write that piece of the layer into the slot
//   'P' xid u32 layer u32 piece u32 slot u32 n ck   prefill -> decode: the piece is in the slot, with the checksums
//                                                  (block_checksum()) its copy kernel computed
// Piece p of a layer holds positions [p * per_slot, min(n, (p + 1) * per_slot)) of the transfer's lists, per_slot
// being the blocks of the largest layer a slot holds.
//
// Transport lane, pull: the prefill announces a ready layer at once ('A' without checksums) and sends its checksums
// in 'K' when they are computed, so the decode's read starts while the prefill hashes. Announcing after the hash
// queued each later 'A' behind the answers to the reads already started (one connection carries both on TCP), so
// the reads went out one hash and one layer's answer late. The decode hashes what its read landed and compares once
// both its hash and 'K' are there.
//
// Device lane (pd.h): 'W', 'A' and 'D' keep their meaning; the bytes move by copy kernels outside the transport,
// and the checksums are block_checksum() values computed on the device. When the moving side verifies (lane 2),
// 'W' carries a second list, u32 n n*u64 landed (the destinations read back after the write), and 'A' an empty
// checksum list (the decode's copy and read-back are compared on the decode side). Only a transfer's first 'A'
// carries the source list and strides; each later one has both lists empty and ends with u32 n, "the list of the
// first 'A'" (n: its length).
#include "kvtier/transport/pd.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "core/byte_codec.h"
#include "core/parallel_loop.h"
#include "core/xxh3.h"
#include "kvtier/backend/device.h"
#include "kvtier/core/deadline.h"
#include "kvtier/core/enum_names.h"
#include "kvtier/core/log.h"

namespace kvtier::transport {

constexpr EnumName<PdMode> kPdModeEntries[] = {
    {PdMode::kPush, "push"},
    {PdMode::kPull, "pull"},
};
constexpr auto kPdModeNames = enum_table("pd mode", kPdModeEntries);
std::string_view pd_mode_name(PdMode mode) noexcept { return kPdModeNames.name(mode); }

CopyEngineOptions lane_engine_options() {
  CopyEngineOptions o;
  o.descriptor_slots = 256;  // 8 transfers of 16 layers in flight; slots are allocated only when used
  return o;
}

constexpr EnumName<PdOptions::LaneVerify> kLaneVerifyEntries[] = {
    {PdOptions::LaneVerify::kMover, "mover"},
    {PdOptions::LaneVerify::kReceiver, "receiver"},
};
constexpr auto kLaneVerifyNames = enum_table("lane verify", kLaneVerifyEntries);
Result<PdOptions::LaneVerify> parse_lane_verify(std::string_view name) { return kLaneVerifyNames.parse(name); }

std::string_view lane_verify_name(PdOptions::LaneVerify verify) noexcept { return kLaneVerifyNames.name(verify); }

constexpr EnumName<LayerState> kLayerStateEntries[] = {
    {LayerState::kPending, "pending"},
    {LayerState::kLoaded, "loaded"},
    {LayerState::kPartial, "partial"},
    {LayerState::kFailed, "failed"},
};
constexpr auto kLayerStateNames = enum_table("layer state", kLayerStateEntries);
std::string_view layer_state_name(LayerState state) noexcept { return kLayerStateNames.name(state); }

namespace {
// block_layer_checksum for a layer and block already checked (the protocol's own lists).
std::uint64_t layer_checksum_of(const BlockSpace& space, std::uint32_t layer, BlockId block) {
  kvtier::detail::Xxh3 h;
  const KvLayout& layout = space.layout();
  for (std::uint32_t r = 0; r < layout.num_roles(layer); ++r)
    h.update(space.block_ptr(layer, r, block), layout.block_bytes(layer, r));
  return h.digest();
}
}  // namespace

Result<std::uint64_t> block_layer_checksum(const BlockSpace& space, std::uint32_t layer, std::uint64_t block) {
  if (layer >= space.layout().num_layers())
    return OutOfRange(
        fmt::format("block_layer_checksum: layer {} >= num_layers {}", layer, space.layout().num_layers()));
  if (block >= space.num_blocks())
    return OutOfRange(fmt::format("block_layer_checksum: block {} >= num_blocks {}", block, space.num_blocks()));
  return layer_checksum_of(space, layer, static_cast<BlockId>(block));
}

std::uint32_t DecodeStatus::leading_loaded_blocks() const {
  std::uint32_t n = 0;
  while (n < block_loaded.size() && block_loaded[n]) ++n;
  return n;
}

namespace {

using Clock = std::chrono::steady_clock;

// A message: its type byte and transfer id, then the fields (core/byte_codec.h), sent as a notification's text.
class Msg {
 public:
  explicit Msg(char type, TransferId id) {
    w_.u8(static_cast<std::uint8_t>(type));
    w_.u64(id);
  }
  Msg& u8(std::uint8_t v) {
    w_.u8(v);
    return *this;
  }
  Msg& u32(std::uint32_t v) {
    w_.u32(v);
    return *this;
  }
  Msg& u64(std::uint64_t v) {
    w_.u64(v);
    return *this;
  }
  Msg& u64s(std::span<const std::uint64_t> v) {
    w_.u64s(v);
    return *this;
  }
  // A reason for the peer's messages (the first 400 bytes).
  Msg& text(std::string_view v) {
    w_.str(v.substr(0, 400));
    return *this;
  }
  std::string str() { return std::move(w_.out); }

 private:
  codec::ByteWriter<std::string> w_;
};

using Parse = codec::ByteReader;

bool header(const std::string& m, char& type, TransferId& id) {
  if (m.size() < 9) return false;
  type = m[0];
  id = codec::load_le<std::uint64_t>(reinterpret_cast<const std::byte*>(m.data() + 1));
  return true;
}

// What both endpoints share: the plane regions, the progress thread, the lock.
// The transport lane's checksums, off the protocol thread: one worker takes layers in the order they became ready
// (the prefill's before it posts them, the decode's as they arrive; each split over the endpoint's checksum helpers),
// so that a layer's checksums overlap the lane's copy of the previous one, which on UCX shared memory is done by the
// protocol thread itself. The worker starts with the first job.
class ChecksumQueue {
 public:
  struct Job {
    std::uint32_t layer = 0;
    std::vector<std::uint64_t> blocks;
    std::vector<std::uint64_t> out;  // the checksums, once `done`
    std::atomic<bool> done{false};
    std::function<void(std::uint64_t* out)> work;  // set: run instead of the queue's checksums (host direct copies)
  };
  using Compute =
      std::function<void(std::uint32_t layer, const std::vector<std::uint64_t>& blocks, std::uint64_t* out)>;
  // `on_done` runs on the worker after each job is done (the endpoint wakes its progress thread, which would
  // otherwise notice the job only at its next poll).
  explicit ChecksumQueue(Compute compute, std::function<void()> on_done = {})
      : compute_(std::move(compute)), on_done_(std::move(on_done)) {}
  ~ChecksumQueue() { stop(); }
  ChecksumQueue(const ChecksumQueue&) = delete;
  ChecksumQueue& operator=(const ChecksumQueue&) = delete;

  // Null when the worker cannot be started (the caller computes the checksums itself).
  std::shared_ptr<Job> submit(std::uint32_t layer, const std::vector<std::uint64_t>& blocks) {
    auto job = std::make_shared<Job>();
    job->layer = layer;
    job->blocks = blocks;
    job->out.resize(blocks.size());
    return enqueue(std::move(job));
  }
  // A job that runs `work` with `outputs` words of out; null when the worker cannot be started.
  std::shared_ptr<Job> submit_work(std::uint32_t layer, std::size_t outputs, std::function<void(std::uint64_t*)> work) {
    auto job = std::make_shared<Job>();
    job->layer = layer;
    job->out.resize(outputs);
    job->work = std::move(work);
    return enqueue(std::move(job));
  }

 private:
  std::shared_ptr<Job> enqueue(std::shared_ptr<Job> job) {
    std::lock_guard lock(mu_);
    if (stop_) return nullptr;
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { run(); });
      } catch (const std::system_error&) {
        return nullptr;
      }
    }
    jobs_.push_back(job);
    cv_.notify_one();
    return job;
  }

 public:
  // Finishes the job in progress; jobs not started never complete (their transfers are gone with the endpoint).
  void stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      jobs_.clear();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      std::shared_ptr<Job> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      if (job->work)
        job->work(job->out.data());
      else
        compute_(job->layer, job->blocks, job->out.data());
      job->done.store(true, std::memory_order_release);
      if (on_done_) on_done_();
      lock.lock();
    }
  }

  Compute compute_;
  std::function<void()> on_done_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

// The longest request_wait, lease and heartbeat an endpoint takes.
constexpr std::chrono::milliseconds kMaxPdTimeout = std::chrono::hours(24);

// The timing options, checked before an endpoint is made: a refused endpoint is still destroyed, and its close
// waits up to a lease (a lease of milliseconds::max() overflowed there as it did everywhere it met a clock).
Status check_timing(std::string_view role, const PdOptions& o) {
  if (o.request_wait.count() <= 0)
    return InvalidArgument(fmt::format("{}: request_wait {} ms: must be > 0", role, o.request_wait.count()));
  // At most a day, as the transports' own timeouts: these are compared with nanosecond clocks, where a value of
  // centuries (milliseconds::max() meant as "never") overflowed to a negative time and failed every transfer at
  // once ("silent for more than the lease (9223372036854775807 ms)").
  for (const auto& [name, value] :
       {std::pair{"request_wait", o.request_wait}, std::pair{"lease", o.lease}, std::pair{"heartbeat", o.heartbeat}})
    if (value > kMaxPdTimeout)
      return InvalidArgument(
          fmt::format("{}: {} {} ms: at most {} ms (a day)", role, name, value.count(), kMaxPdTimeout.count()));
  if (o.heartbeat.count() <= 0 || o.lease <= o.heartbeat)
    return InvalidArgument(fmt::format("{}: heartbeat {} ms and lease {} ms: need 0 < heartbeat < lease", role,
                                       o.heartbeat.count(), o.lease.count()));
  if (o.idle_wait.count() <= 0 || o.idle_wait > o.heartbeat)
    return InvalidArgument(fmt::format("{}: idle_wait {} us: need 0 < idle_wait <= heartbeat ({} ms)", role,
                                       o.idle_wait.count(), o.heartbeat.count()));
  if (o.busy_wait.count() < 0 || o.busy_wait > o.idle_wait)
    return InvalidArgument(fmt::format("{}: busy_wait {} us: need 0 <= busy_wait <= idle_wait ({} us)", role,
                                       o.busy_wait.count(), o.idle_wait.count()));
  return Status::Ok();
}

class Endpoint {
 public:
  Endpoint(Transport& t, BlockSpace blocks, PdOptions options) : t_(t), blocks_(std::move(blocks)), options_(options) {}

  Status init(std::string_view role) {
    role_ = role;  // the timing options were checked by create(), before the endpoint was made
    if (options_.engine != nullptr) {
      Device& dev = options_.engine->device();
      if (blocks_.kind() != MemoryKind::kDevice || blocks_.device_ordinal() != dev.ordinal())
        return InvalidArgument(fmt::format(
            "{}: the device lane needs the blocks in device memory of device {} ('{}'), got {} memory of ordinal {}",
            role, dev.ordinal(), dev.name(), memory_kind_name(blocks_.kind()), blocks_.device_ordinal()));
      if (options_.lane_verify != PdOptions::LaneVerify::kMover &&
          options_.lane_verify != PdOptions::LaneVerify::kReceiver)
        return InvalidArgument(fmt::format("{}: unknown lane_verify {}", role, static_cast<int>(options_.lane_verify)));
      // Named so that logs (and the host backend's per-stream fault hooks) can tell them apart.
      for (auto [s, name] : {std::pair{&lane_stream_, "pd-lane"}, std::pair{&verify_stream_, "pd-verify"}}) {
        auto stream = dev.create_stream(StreamOptions{StreamPriority::kNormal, fmt::format("{}-{}", name, role)});
        if (!stream.ok()) return stream.status().with_context(fmt::format("{}: device lane stream {}", role, name));
        *s = std::move(stream).value();
      }
    }
    if (options_.host_direct && options_.engine != nullptr)
      return InvalidArgument(
          fmt::format("{}: host_direct and a copy engine (the device lane) exclude each other", role));
    if (options_.engine == nullptr) {
      std::uint32_t helpers = options_.checksum_helpers;
      // The host direct lane's copies are its only work: every core but one (the protocol thread's) helps.
      if (helpers == PdOptions::kAutoChecksumHelpers && options_.host_direct)
        helpers = std::clamp(std::thread::hardware_concurrency(), 2u, 5u) - 1;
      if (helpers == PdOptions::kAutoChecksumHelpers)
        helpers = kvtier::detail::ParallelLoop::default_helpers(std::thread::hardware_concurrency());
      if (helpers > PdOptions::kMaxChecksumHelpers)
        return InvalidArgument(
            fmt::format("{}: checksum_helpers {} (at most {})", role, helpers, PdOptions::kMaxChecksumHelpers));
      if (helpers > 0) checksum_loop_ = std::make_unique<kvtier::detail::ParallelLoop>(helpers);
    }
    const KvLayout& layout = blocks_.layout();
    if (blocks_.num_blocks() == 0) return InvalidArgument(fmt::format("{}: block space has no blocks", role));
    const std::uint64_t fingerprint =
        options_.pairing_fingerprint != 0 ? options_.pairing_fingerprint : layout.fingerprint();
    if (fingerprint != t_.identity().layout_fingerprint)
      return InvalidArgument(fmt::format("{}: block space {} fingerprint {:#018x} != transport identity {:#018x}", role,
                                         options_.pairing_fingerprint != 0 ? "pairing" : "layout", fingerprint,
                                         t_.identity().layout_fingerprint));
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const Plane& p = blocks_.plane(l, r);
        const std::uint64_t bytes = (blocks_.num_blocks() - 1) * p.stride + layout.block_bytes(l, r);
        auto id = t_.register_memory({blocks_.kind(), blocks_.device_ordinal(), p.base, bytes});
        if (!id.ok()) return id.status().with_context(fmt::format("{}: plane (layer {}, role {})", role, l, r));
        if (*id != plane_index(l, r))
          return FailedPrecondition(
              fmt::format("{}: plane (layer {}, role {}) got region {}, expected {}: the transport must be fresh", role,
                          l, r, *id, plane_index(l, r)));
      }
    }
    if (static_cast<int>(options_.ring_copy) >= kNumCopyStrategies)
      return InvalidArgument(
          fmt::format("{}: unknown ring_copy strategy {}", role, static_cast<int>(options_.ring_copy)));
    if (options_.ring_slots > 0 && options_.engine == nullptr)
      return InvalidArgument(
          fmt::format("{}: the ring lane ({} slots) needs a copy engine", role, options_.ring_slots));
    KVTIER_RETURN_IF_ERROR(after_planes(role));
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (const std::exception& e) {
      return Internal(fmt::format("{}: progress thread: {}", role, e.what()));
    }
    return Status::Ok();
  }

  void stop() {
    before_stop();
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    wake_progress();
    if (thread_.joinable()) thread_.join();
    checksums_.stop();  // after the progress thread: nothing submits any more
    // Kernels of the device lane cannot be cancelled: wait (bounded) for them before their buffers go.
    std::vector<std::unique_ptr<Stream>*> streams = {&lane_stream_, &verify_stream_};
    for (auto& r : retired_streams_) streams.push_back(&r);
    for (auto* stream : streams) {
      if (!*stream) continue;
      Status s = options_.engine->device().synchronize(**stream, std::chrono::seconds(60));
      // A stream that drained after a failed operation reports that failure again: it was already reported on
      // its layer, so only a stream that did not drain is an error here.
      if (s.code() == StatusCode::kTimedOut)
        log(LogLevel::kError, "transport", fmt::format("pd: device lane did not drain: {}", s.to_string()));
      else if (!s.ok())
        log(LogLevel::kDebug, "transport", fmt::format("pd: device lane drained after a failure: {}", s.to_string()));
      options_.engine->forget_stream(**stream).ignore_error();
    }
    std::lock_guard lock(mu_);
    after_stop();
  }

 protected:
  // PdPrefill / PdDecode::abort_waits: waits in flight wake (cv_) and see waits_aborted_.
  void abort_all_waits() {
    {
      std::lock_guard lock(mu_);
      waits_aborted_ = true;
    }
    cv_.notify_all();
  }
  Status waits_aborted(TransferId id) const {
    return FailedPrecondition(
        fmt::format("{}: the endpoint is closing; transfer {} is no longer waited for", role_, id));
  }

  // At the start of stop(), the progress thread still running (no lock held).
  virtual void before_stop() {}
  // At the end of stop(), under mu_: the progress thread has ended and the device lane's kernels have drained.
  virtual void after_stop() {}

  // How long a closing endpoint waits for its peers' word (a lease, at least 100 ms).
  Clock::duration close_wait() const {
    return std::max<Clock::duration>(options_.lease, std::chrono::milliseconds(100));
  }
  // Waits with `lock` (on mu_) held until `done()` or `timeout`, looking again at least every 10 ms (the progress
  // thread also notifies cv_ after each round).
  template <typename Done>
  void wait_locked(std::unique_lock<std::mutex>& lock, Clock::duration timeout, Done done) {
    const auto deadline = Clock::now() + timeout;
    while (!done() && Clock::now() < deadline)
      cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(10)));
  }
  // A closing endpoint gives up on peers that did not answer in time: disconnecting stops what they may still do
  // to this side's memory where the transport can.
  void disconnect_unanswered(const std::set<PeerId>& peers, std::string_view why) {
    for (PeerId peer : peers) {
      log(LogLevel::kError, "transport", fmt::format("pd: closing, peer {} {}; disconnecting it", peer, why));
      t_.disconnect_peer(peer).ignore_error();
    }
  }

  std::uint32_t plane_index(std::uint32_t l, std::uint32_t r) const {
    std::uint32_t idx = 0;
    for (std::uint32_t i = 0; i < l; ++i) idx += blocks_.layout().num_roles(i);
    return idx + r;
  }

  Status check_blocks(const std::vector<std::uint64_t>& blocks, std::string_view what) const {
    if (blocks.empty()) return InvalidArgument(fmt::format("{} list is empty", what));
    std::vector<bool> seen(blocks_.num_blocks());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i] >= blocks_.num_blocks())
        return OutOfRange(fmt::format("block id {} >= num_blocks {} in {} list at index {}", blocks[i],
                                      blocks_.num_blocks(), what, i));
      if (seen[blocks[i]])
        return InvalidArgument(fmt::format("block id {} repeated in {} list at index {}", blocks[i], what, i));
      seen[blocks[i]] = true;
    }
    return Status::Ok();
  }

  // Descriptors of layer `l` between local blocks and the peer's blocks (same layout, so the same planes).
  void layer_descs(std::uint32_t l, const std::vector<std::uint64_t>& local, const std::vector<std::uint64_t>& remote,
                   const std::vector<std::uint64_t>& remote_strides, std::vector<LocalDesc>& ld,
                   std::vector<RemoteDesc>& rd) const {
    const KvLayout& layout = blocks_.layout();
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      const std::uint32_t idx = plane_index(l, r);
      const std::uint64_t bytes = layout.block_bytes(l, r);
      for (std::size_t i = 0; i < local.size(); ++i) {
        const std::uint64_t lo = local[i] * blocks_.plane(l, r).stride, ro = remote[i] * remote_strides[idx];
        // Blocks that follow each other in memory on both sides travel as one descriptor: one request instead
        // of a run of them (a prompt's blocks are often allocated in order).
        if (i > 0 && ld.back().region == idx && ld.back().offset + ld.back().bytes == lo &&
            rd.back().offset + rd.back().bytes == ro) {
          ld.back().bytes += bytes;
          rd.back().bytes += bytes;
          continue;
        }
        ld.push_back(LocalDesc{idx, lo, bytes});
        rd.push_back(RemoteDesc{idx, ro, bytes});
      }
    }
  }

  // The peer's plane strides travel in 'R' (decode's) and 'A' (prefill's): the layouts are equal, the
  // BlockSpaces (block counts, strides) need not be.
  virtual void on_message(const Notification& n, char type, TransferId id, Parse& p) = 0;
  virtual void tick(Clock::time_point now) = 0;
  // After the planes are registered, before the progress thread starts (the decode's ring).
  virtual Status after_planes(std::string_view role) {
    (void)role;
    return Status::Ok();
  }

  // True while a transfer has work the progress thread must notice without a message: a device lane kernel
  // whose event it polls, a layer whose readiness it polls, a transfer not yet final (under mu_).
  virtual bool busy() const = 0;

  void loop() {
#ifdef __linux__
    // The busy period's waits (busy_wait, 20 us) would otherwise sleep the kernel's default timer slack (50 us) on top.
    // A refusal costs only that latency.
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
#endif
    for (;;) {
      bool active = false;
      {
        std::lock_guard lock(mu_);
        if (stop_) return;
        active = busy();
      }
      // Kernels' events and layers' readiness are seen only by polling: while a transfer is in progress look
      // again soon, so a layer does not wait a whole idle period behind them. Idle, messages wake the thread, and
      // so do the calls that give it work (wake_progress): a copy launched or a layer declared from the caller's
      // thread while this one sleeps would otherwise wait out the idle period.
      if (active && options_.busy_wait.count() == 0) std::this_thread::yield();
      auto got = t_.wait_notifications(active ? options_.busy_wait : options_.idle_wait);
      std::lock_guard lock(mu_);
      if (got.ok()) {
        for (const Notification& n : *got) {
          char type = 0;
          TransferId id = 0;
          if (!header(n.message, type, id)) {
            log(LogLevel::kWarning, "transport", fmt::format("pd: dropped a malformed message from '{}'", n.peer));
            continue;
          }
          Parse p(n.message);
          (void)p.skip(9);  // the header, read above
          on_message(n, type, id, p);
        }
      }
      tick(Clock::now());
      cv_.notify_all();
    }
  }

  // A call of this endpoint gave the progress thread work to poll (a transfer, a layer to watch, a launched copy):
  // end its idle sleep now. Called without mu_ held.
  void wake_progress() { t_.wake_notification_waiter(); }

  // Heartbeats of one transfer, one direction each way.
  struct Beats {
    std::uint64_t sent = 0;                                      // number of our last heartbeat
    std::deque<std::pair<std::uint64_t, Clock::time_point>> at;  // when we sent the recent ones
    std::uint64_t heard = 0;                                     // highest heartbeat number of the peer
  };
  std::string heartbeat(TransferId id, Beats& b, Clock::time_point now) {
    b.at.emplace_back(++b.sent, now);
    // An echo older than these can no longer renew a lease anyway (it is more than a lease old).
    const std::size_t keep = static_cast<std::size_t>(options_.lease / options_.heartbeat) + 4;
    while (b.at.size() > keep) b.at.pop_front();
    return Msg('H', id).u64(b.sent).u64(b.heard).str();
  }
  // A heartbeat from the peer: the lease runs from the send time of the heartbeat of ours it echoes.
  void heard_heartbeat(Beats& b, Parse& p, Clock::time_point& last_heard) {
    std::uint64_t seq = 0, echo = 0;
    if (!p.u64(seq) || !p.u64(echo)) return;
    b.heard = std::max(b.heard, seq);
    for (const auto& [n, when] : b.at)
      if (n == echo) last_heard = std::max(last_heard, when);
  }
  // Bytes of a transfer with `peer` moved within the lease (Transport::last_progress): the peer is alive even when
  // its heartbeats wait behind those bytes on one connection (UCX over TCP), so its lease holds. Asked only once
  // the heartbeats say the lease is over.
  bool bytes_moving(PeerId peer, Clock::time_point now) const {
    const auto moved = t_.last_progress(peer);
    return moved && now - *moved <= options_.lease;
  }

  // The lease on `peer` expired for a transfer. When the peer is silent on every transfer of this side, it is
  // taken for dead: the transport drops it, which fails (and, where the backend can, cancels) every request to
  // it, so memory waiting on them is released; a peer still heard on other transfers keeps its connection.
  template <typename Xfers>
  void lease_expired(PeerId peer, const Xfers& xfers, Clock::time_point now) {
    for (const auto& [id, x] : xfers)
      if (x.peer == peer && now - x.last_heard <= options_.lease) return;
    if (dropped_.insert(peer).second) {
      // Disconnecting unmaps the peer's memory here (UCX): the host direct lane's copies into or out of it end first.
      if (!wait_direct_copies(peer)) {
        log(LogLevel::kError, "transport",
            fmt::format("pd: host direct copies to peer {} did not end in {} s; the peer stays connected", peer,
                        kDirectCopyDrainSeconds));
        return;
      }
      Status s = t_.disconnect_peer(peer);
      if (!s.ok())
        log(LogLevel::kWarning, "transport", fmt::format("pd: disconnecting peer {}: {}", peer, s.to_string()));
    }
  }

  // A peer whose lease expired is dropped (lease_expired) only after this side's last word of each transfer with
  // it went out (a prefill's 'Q', a decode's 'F'), or a lease later: the peer may be alive after all (this side
  // was the one paused, and the peer gave up meanwhile), and it holds blocks until that word reaches it; a
  // disconnected peer gets nothing more.
  void drop_after_last_word(PeerId peer, Clock::time_point now, bool at_once = false) {
    const Clock::time_point due = at_once ? now : now + options_.lease;
    auto [it, added] = drop_due_.try_emplace(peer, due);
    if (!added) it->second = std::min(it->second, due);
  }
  template <typename Xfers, typename Awaiting>
  void drop_peers_due(const Xfers& xfers, Clock::time_point now, const Awaiting& awaits_last_word) {
    for (auto it = drop_due_.begin(); it != drop_due_.end();) {
      const PeerId peer = it->first;
      if (now < it->second && std::any_of(xfers.begin(), xfers.end(), [&](const auto& kv) {
            return kv.second.peer == peer && awaits_last_word(kv.second);
          })) {
        ++it;
        continue;
      }
      it = drop_due_.erase(it);
      lease_expired(peer, xfers, now);
    }
  }
  std::map<PeerId, Clock::time_point> drop_due_;  // drop_after_last_word: the peer and when it goes regardless

  // disconnect_peer (under mu_): refused while a transfer with `peer` is in progress (its copies into the peer's
  // memory could still start after the disconnect unmapped it), then as at a lease: this side's copies touching the
  // peer's memory end first, then the transport drops it.
  template <typename Xfers, typename InProgress>
  Status disconnect_locked(PeerId peer, const Xfers& xfers, InProgress in_progress) {
    for (const auto& [id, x] : xfers)
      if (x.peer == peer && in_progress(x))
        return FailedPrecondition(fmt::format(
            "{}: transfer {} with peer {} is not final: wait for it (or cancel it) before disconnecting the peer",
            role_, id, peer));
    if (!wait_direct_copies(peer))
      return Unavailable(fmt::format("{}: host direct copies touching peer {} did not end in {} s; it stays connected",
                                     role_, peer, kDirectCopyDrainSeconds));
    dropped_.insert(peer);
    drop_due_.erase(peer);
    return t_.disconnect_peer(peer);
  }

  // The first move of a transfer's bytes on this side (PdTimes::move).
  static void mark_move(PdTimes& times, Clock::time_point now) {
    if (times.move == Clock::time_point{}) times.move = now;
  }
  // ... and was handed over (PdTimes::posted).
  static void mark_posted(PdTimes& times) {
    if (times.posted == Clock::time_point{}) times.posted = Clock::now();
  }

  bool device_lane() const noexcept { return options_.engine != nullptr; }
  bool ring_lane() const noexcept { return device_lane() && options_.ring_slots > 0; }
  bool host_direct() const noexcept { return options_.host_direct && !device_lane(); }
  // The lane byte of 'R' this side runs (the device lane's verifying side aside): 0 transport, 1 device, 3 ring,
  // 4 host direct.
  std::uint8_t lane_kind() const noexcept { return ring_lane() ? 3 : device_lane() ? 1 : host_direct() ? 4 : 0; }
  static std::string_view lane_kind_name(std::uint8_t kind) noexcept {
    return kind == 3 ? "ring" : kind == 0 ? "transport" : kind == 4 ? "host direct" : "device";
  }

  // ---- host direct lane ----
  // The side's host direct copies that touch `peer`'s memory have ended (bounded; false: still running).
  virtual bool wait_direct_copies(PeerId peer) = 0;
  static constexpr int kDirectCopyDrainSeconds = 60;
  template <typename Jobs>
  static bool wait_jobs(const Jobs& jobs) {
    const auto deadline = Clock::now() + std::chrono::seconds(kDirectCopyDrainSeconds);
    for (const auto& job : jobs)
      while (!job->done.load(std::memory_order_acquire)) {
        if (Clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    return true;
  }
  // Every id of `ids` names a block of `space` (the peer's pool as mapped here: its registered regions).
  static Status check_ids_in(const BlockSpace& space, const std::vector<std::uint64_t>& ids, std::string_view what) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] >= space.num_blocks())
        return OutOfRange(fmt::format("{} block id {} at index {} is outside the peer's registered regions ({} blocks)",
                                      what, ids[i], i, space.num_blocks()));
    return Status::Ok();
  }
  // Copies `layer` of blocks from[src[i]] to to[dst[i]] (every role), with the xxh3 block checksum of what it read
  // into out[i] and of what landed into out[n + i]: each chunk is hashed on both sides right after its copy, while it
  // is in cache. Split over the checksum helpers like layer_checksums. The ids are checked by the caller.
  void move_layer(const BlockSpace& from, const std::vector<std::uint64_t>& src, const BlockSpace& to,
                  const std::vector<std::uint64_t>& dst, std::uint32_t layer, std::uint64_t* out) const {
    const KvLayout& layout = blocks_.layout();
    const std::size_t n = src.size();
    split_over_helpers(n, layer_bytes(layer, 1), [&](std::size_t begin, std::size_t end) {
      kvtier::detail::Xxh3 read, landed;
      for (std::size_t i = begin; i < end; ++i) {
        read.reset();
        landed.reset();
        for (std::uint32_t r = 0; r < layout.num_roles(layer); ++r) {
          const std::byte* s = from.block_ptr(layer, r, static_cast<BlockId>(src[i]));
          std::byte* d = to.block_ptr(layer, r, static_cast<BlockId>(dst[i]));
          const std::uint64_t bytes = layout.block_bytes(layer, r);
          for (std::uint64_t off = 0; off < bytes; off += kMoveChunkBytes) {
            const std::size_t c = static_cast<std::size_t>(std::min<std::uint64_t>(kMoveChunkBytes, bytes - off));
            std::memcpy(d + off, s + off, c);
            read.update(s + off, c);
            landed.update(d + off, c);
          }
        }
        out[i] = read.digest();
        out[n + i] = landed.digest();
      }
    });
  }
  // A chunk small enough that its source and destination stay in L1/L2 between the copy and the two hashes.
  static constexpr std::uint64_t kMoveChunkBytes = std::uint64_t{16} << 10;
  // A host direct copy on the checksum worker (`from`, `to` and the lists are copied into the job), or null: the
  // caller moves it on the protocol thread. Small layers move in place, as small checksums do.
  std::shared_ptr<ChecksumQueue::Job> submit_move(BlockSpace from, std::vector<std::uint64_t> src, BlockSpace to,
                                                  std::vector<std::uint64_t> dst, std::uint32_t layer) {
    if (layer_bytes(layer, src.size()) < kInlineChecksumBytes) return nullptr;
    const std::size_t n = src.size();
    return checksums_.submit_work(
        layer, 2 * n,
        [this, from = std::move(from), src = std::move(src), to = std::move(to), dst = std::move(dst),
         layer](std::uint64_t* out) { move_layer(from, src, to, dst, layer, out); });
  }
  Device& lane_device() const { return options_.engine->device(); }

  // ---- ring lane ----
  struct RingGeometry {
    std::uint32_t slots = 0;
    std::uint64_t slot_bytes = 0;
    std::uint64_t slot_stride = 0;  // slot_bytes rounded up to a page
    std::uint64_t per_slot = 0;     // blocks of one layer (every role) a slot holds
    std::uint64_t ring_bytes() const { return slot_stride * slots; }
  };
  static constexpr std::uint64_t kRingPage = 4096;
  static constexpr std::uint64_t kMaxPerSlot = std::uint64_t{1} << 20;
  Result<RingGeometry> ring_geometry(std::uint32_t slots, std::uint64_t slot_bytes) const {
    const KvLayout& layout = blocks_.layout();
    if (slots == 0 || slots > PdOptions::kMaxRingSlots)
      return InvalidArgument(fmt::format("ring of {} slots: 1 to {}", slots, PdOptions::kMaxRingSlots));
    std::uint64_t layer_bytes = 0;
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
      std::uint64_t b = 0;
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) b += layout.block_bytes(l, r);
      layer_bytes = std::max(layer_bytes, b);
    }
    if (slot_bytes < layer_bytes || slot_bytes > (std::uint64_t{1} << 40))
      return InvalidArgument(
          fmt::format("ring slot of {} bytes: must hold one block of the largest layer ({} bytes) and be at most 1 TiB",
                      slot_bytes, layer_bytes));
    RingGeometry g;
    g.slots = slots;
    g.slot_bytes = slot_bytes;
    g.slot_stride = (slot_bytes + kRingPage - 1) / kRingPage * kRingPage;
    g.per_slot = std::min(slot_bytes / layer_bytes, kMaxPerSlot);
    return g;
  }
  // One BlockSpace per slot of a ring mapped at `base`: layer l's role r holds per_slot blocks at
  // per_slot x (bytes of l's earlier roles) into the slot (every layer in the same slot memory).
  Result<std::vector<BlockSpace>> ring_slot_spaces(std::byte* base, const RingGeometry& g) const {
    const KvLayout& layout = blocks_.layout();
    std::vector<BlockSpace> out;
    for (std::uint32_t s = 0; s < g.slots; ++s) {
      std::vector<std::vector<Plane>> planes(layout.num_layers());
      for (std::uint32_t l = 0; l < layout.num_layers(); ++l) {
        std::uint64_t off = 0;
        for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
          planes[l].push_back(Plane{base + s * g.slot_stride + off, layout.block_bytes(l, r)});
          off += g.per_slot * layout.block_bytes(l, r);
        }
      }
      KVTIER_ASSIGN_OR_RETURN(BlockSpace space,
                              BlockSpace::layer_slot(MemoryKind::kPinnedHost, blocks_.device_ordinal(), layout,
                                                     g.per_slot, std::move(planes)));
      out.push_back(std::move(space));
    }
    if (ring_ids_.size() < g.per_slot) {
      ring_ids_.resize(g.per_slot);
      for (std::size_t i = 0; i < ring_ids_.size(); ++i) ring_ids_[i] = static_cast<BlockId>(i);
    }
    return out;
  }
  // A ring mapped here, registered with the lane's device for its kernels unless it already is (one process: the
  // peer's ring is this process's memory). Null when nothing was registered.
  Result<std::unique_ptr<PinnedMemory>> register_ring(std::byte* base, std::uint64_t bytes) {
    Device& dev = lane_device();
    const auto at = reinterpret_cast<std::uintptr_t>(base);
    const Device::Registration reg = dev.registration_of(base);
    if (reg.first <= at && at + bytes <= reg.last && reg.last != 0) return std::unique_ptr<PinnedMemory>();
    KVTIER_ASSIGN_OR_RETURN(auto pinned, dev.register_host(base, bytes));
    KVTIER_RETURN_IF_ERROR(pinned->wait_ready(std::chrono::minutes(1)));
    return pinned;
  }
  // Positions [first, end) of piece `piece` of a transfer of n blocks.
  static std::pair<std::uint64_t, std::uint64_t> piece_range(std::uint64_t piece, std::uint64_t per_slot,
                                                             std::uint64_t n) {
    const std::uint64_t a = piece * per_slot;
    return {a, std::min(n, a + per_slot)};
  }
  // Per piece of a ring transfer: [layer * pieces_per_layer + piece].
  enum class PieceState : std::uint8_t { kWaiting, kGranted, kCopying, kDone, kDropped };
  struct Piece {
    PieceState state = PieceState::kWaiting;
    std::uint32_t slot = 0;
  };
  // The event behind piece u's kernel and checksum copy, created on first use.
  Result<Event*> piece_event(std::vector<std::unique_ptr<Event>>& events, std::size_t u) {
    if (events.size() <= u) events.resize(u + 1);
    if (!events[u]) {
      KVTIER_ASSIGN_OR_RETURN(events[u], lane_device().create_event());
    }
    return events[u].get();
  }
  // Enqueues one piece's copy (ids `from_ids` of `from` to `to_ids` of `to`, one layer) on the lane stream with the
  // checksums of its device side (`from` when device_is_source) into `ck_device` (copied to `ck_host`), then records
  // `done`. PdOptions::ring_copy: the SM kernel computes them while it copies; otherwise a checksum pass over the
  // device side runs before (sources) or after (destinations) the copy.
  Status copy_piece(const BlockSpace& from, std::span<const BlockId> from_ids, const BlockSpace& to,
                    std::span<const BlockId> to_ids, std::uint32_t layer, bool device_is_source,
                    std::uint64_t* ck_device, std::uint64_t* ck_host, Event& done) {
    Device& dev = lane_device();
    CopyEngine& engine = *options_.engine;
    const std::uint32_t layers[1] = {layer};
    CopyRequest r{&from, &to, from_ids, to_ids, layers, kAllRoles, options_.ring_copy};
    if (options_.ring_copy == CopyStrategy::kSmKernel) {
      r.checksums = ck_device;
      KVTIER_RETURN_IF_ERROR(engine.copy(r, *lane_stream_).status());
    } else if (device_is_source) {
      KVTIER_RETURN_IF_ERROR(engine.checksum(from, from_ids, layers, kAllRoles, ck_device, *lane_stream_).status());
      KVTIER_RETURN_IF_ERROR(engine.copy(r, *lane_stream_).status());
    } else {
      KVTIER_RETURN_IF_ERROR(engine.copy(r, *lane_stream_).status());
      KVTIER_RETURN_IF_ERROR(engine.checksum(to, to_ids, layers, kAllRoles, ck_device, *lane_stream_).status());
    }
    KVTIER_RETURN_IF_ERROR(
        dev.memcpy_async(ck_host, ck_device, from_ids.size() * sizeof(std::uint64_t), *lane_stream_));
    return dev.record(done, *lane_stream_);
  }

  // Per-transfer device lane state: checksums on the device and their host copy, events per layer. Per layer
  // two lists of n checksums, next to each other so that one copy brings both to the host: [0] what the copy
  // (or the receiver's pass) computed, [1] what the moving side's read-back of the destinations computed.
  struct LaneBuffers {
    Buffer device_checksums;                       // layers x 2 x n
    std::unique_ptr<PinnedMemory> host_checksums;  // layers x 2 x n, copied behind each layer's kernels
    std::vector<std::unique_ptr<Event>> events;    // per layer: its kernels and the checksum copy are done
    std::vector<std::unique_ptr<Event>> copied;    // per layer: its copy is done (the read-back waits for it)
    std::vector<std::unique_ptr<Event>> pieces;    // ring lane, per piece: its copy and checksums are done
    std::vector<BlockId> local_ids, peer_ids;
    std::optional<BlockSpace> peer;  // the peer's pool, mapped here (the moving side)
    // The moving side's copy over every layer, checked once (lane_copy_layer); cleared when the ids change.
    std::optional<PreparedCopy> prepared;
    bool peer_list_known = false;  // pull, the reading side: the prefill's source list arrived in an 'A'
    std::uint64_t n = 0;
    std::uint64_t capacity = 0;  // checksums the buffers hold
    std::uint64_t* device_at(std::uint32_t layer, std::uint32_t list = 0) const {
      return reinterpret_cast<std::uint64_t*>(device_checksums.bytes_ptr()) + (std::uint64_t{layer} * 2 + list) * n;
    }
    std::uint64_t* host_at(std::uint32_t layer, std::uint32_t list = 0) const {
      return reinterpret_cast<std::uint64_t*>(host_checksums->data()) + (std::uint64_t{layer} * 2 + list) * n;
    }
  };
  Result<std::unique_ptr<LaneBuffers>> make_lane(const std::vector<std::uint64_t>& local,
                                                 const std::vector<std::uint64_t>& peer) {
    const std::uint32_t layers = blocks_.layout().num_layers();
    for (const auto* ids : {&local, &peer})
      for (std::uint64_t id : *ids)
        if (id > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
          return OutOfRange(fmt::format("block id {} does not fit the copy engine's 32-bit ids", id));
    const std::uint64_t needed = std::max<std::uint64_t>(1, local.size() * layers * 2);
    std::unique_ptr<LaneBuffers> lb;
    {
      // Buffers of forgotten transfers: allocating pinned and device memory per transfer costs milliseconds
      // (and freeing device memory synchronizes the device).
      std::lock_guard lock(lane_pool_mu_);
      for (auto it = lane_pool_.begin(); it != lane_pool_.end(); ++it)
        if ((*it)->capacity >= needed) {
          lb = std::move(*it);
          lane_pool_.erase(it);
          break;
        }
    }
    if (!lb) {
      lb = std::make_unique<LaneBuffers>();
      lb->capacity = std::bit_ceil(needed);
      Device& dev = lane_device();
      const std::uint64_t bytes = lb->capacity * sizeof(std::uint64_t);
      KVTIER_ASSIGN_OR_RETURN(lb->device_checksums, dev.allocate_device(bytes));
      KVTIER_ASSIGN_OR_RETURN(lb->host_checksums, dev.allocate_pinned(bytes));
      lb->events.resize(layers);
      lb->copied.resize(layers);
      for (auto* list : {&lb->events, &lb->copied})
        for (auto& e : *list) {
          KVTIER_ASSIGN_OR_RETURN(e, dev.create_event());
        }
    }
    lb->n = local.size();
    lb->local_ids.assign(local.begin(), local.end());
    lb->peer_ids.assign(peer.begin(), peer.end());
    lb->peer.reset();
    lb->prepared.reset();
    lb->peer_list_known = false;
    return lb;
  }

  // A forgotten transfer's buffers (no kernel of it runs any more: it was reclaimable) for the next transfer.
  void recycle_lane(std::unique_ptr<LaneBuffers> lb) {
    if (!lb) return;
    lb->peer.reset();
    lb->prepared.reset();
    std::lock_guard lock(lane_pool_mu_);
    if (lane_pool_.size() < kLanePoolSize) lane_pool_.push_back(std::move(lb));
  }

  // The peer's pool as this process's device addresses it: its planes (the regions it registered first, in
  // plane order) at the addresses the transport maps them to, with the strides the peer sent. As many blocks
  // as every plane's registered bytes hold, so the copy engine refuses ids outside the peer's regions.
  Result<BlockSpace> peer_space(PeerId peer, const std::vector<std::uint64_t>& strides) {
    const KvLayout& layout = blocks_.layout();
    KVTIER_ASSIGN_OR_RETURN(PeerInfo info, t_.peer_info(peer));
    if (strides.size() != layout.num_planes())
      return InvalidArgument(
          fmt::format("peer sent {} plane strides for {} planes", strides.size(), layout.num_planes()));
    std::uint64_t blocks = std::numeric_limits<std::uint64_t>::max();
    std::vector<std::vector<Plane>> planes(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint32_t idx = plane_index(l, r);
        if (idx >= info.regions.size())
          return InvalidArgument(fmt::format("peer has {} regions, plane (layer {}, role {}) is region {}",
                                             info.regions.size(), l, r, idx));
        const std::uint64_t bb = layout.block_bytes(l, r), stride = strides[idx], bytes = info.regions[idx].bytes;
        if (stride < bb || bytes < bb)
          return InvalidArgument(
              fmt::format("peer plane (layer {}, role {}): stride {} or region bytes {} below the block size {}", l, r,
                          stride, bytes, bb));
        KVTIER_ASSIGN_OR_RETURN(void* base, t_.peer_region_address(peer, idx));
        blocks = std::min(blocks, (bytes - bb) / stride + 1);
        planes[l].push_back(Plane{static_cast<std::byte*>(base), stride});
      }
    return BlockSpace::from_planes(blocks_.kind(), blocks_.device_ordinal(), layout, blocks, std::move(planes));
  }

  // Behind the layer's kernel on the lane stream: its checksums to the host, then the layer's event.
  Status finish_lane_layer(LaneBuffers& lb, std::uint32_t layer) {
    Device& dev = lane_device();
    KVTIER_RETURN_IF_ERROR(
        dev.memcpy_async(lb.host_at(layer), lb.device_at(layer), lb.n * sizeof(std::uint64_t), *lane_stream_));
    return dev.record(*lb.events[layer], *lane_stream_);
  }

  // One layer of the transfer's copy `all` (its request over every layer) on the lane stream, checksums into
  // `checksums`. The request is checked once per transfer, not per layer: the ids of thousands of blocks cost as
  // much to check as a small layer takes to move.
  Status lane_copy_layer(LaneBuffers& lb, const CopyRequest& all, std::uint32_t layer, std::uint64_t* checksums,
                         std::uint64_t* landed = nullptr) {
    const std::uint32_t layers[1] = {layer};
    return lane_copy_layers(lb, all, layers, checksums, landed);
  }
  // The same for several layers in one copy: each block's checksum is then its sum over those layers' planes.
  Status lane_copy_layers(LaneBuffers& lb, const CopyRequest& all, std::span<const std::uint32_t> layers,
                          std::uint64_t* checksums, std::uint64_t* landed) {
    const CopyRequest* had = lb.prepared ? &lb.prepared->request() : nullptr;
    if (had == nullptr || had->src != all.src || had->dst != all.dst ||
        had->src_blocks.data() != all.src_blocks.data() || had->dst_blocks.data() != all.dst_blocks.data() ||
        had->src_blocks.size() != all.src_blocks.size()) {
      KVTIER_ASSIGN_OR_RETURN(PreparedCopy prepared, options_.engine->prepare(all));
      lb.prepared = prepared;
    }
    return options_.engine->copy(*lb.prepared, layers, *lane_stream_, checksums, landed).status();
  }

  // Whether the moving side moves the layers that are ready at one moment as one copy: when it verifies with the
  // read-back inside the copy. Each launch costs the CPU tens of microseconds (a 64 MiB layer of 16 KiB blocks:
  // about 60 us, as long as the GPU takes to move it), so layer by layer the launching thread, not the GPU, set the
  // pace; layers that become ready one at a time (a forward pass) still go one at a time.
  bool lane_groups_layers(bool mover_verifies) const {
    return mover_verifies && options_.lane_read_back_in_copy && !ring_lane();
  }

  // The moving side's copy of a group of layers ready at once (`group`, at least one), reading back what it wrote
  // inside the copy: both lists hold each block's checksum over the group's planes, in the first layer's slots (a
  // block that fails fails in every layer of the group); both lists to the host, then every layer's event.
  Status copy_group_and_read_back(LaneBuffers& lb, std::span<const std::uint32_t> group, const CopyRequest& all) {
    Device& dev = lane_device();
    const std::uint32_t head = group.front();
    KVTIER_RETURN_IF_ERROR(lane_copy_layers(lb, all, group, lb.device_at(head, 0), lb.device_at(head, 1)));
    KVTIER_RETURN_IF_ERROR(
        dev.memcpy_async(lb.host_at(head, 0), lb.device_at(head, 0), 2 * lb.n * sizeof(std::uint64_t), *lane_stream_));
    for (std::uint32_t l : group) KVTIER_RETURN_IF_ERROR(dev.record(*lb.events[l], *lane_stream_));
    return Status::Ok();
  }

  // The moving side's verification: the layer's copy (of `all`, checksums into list 0) on the lane stream, then on
  // the verify stream, once the copy is done, a read-only pass over the destinations `to` / `to_ids` (list 1),
  // both lists to the host and the layer's event. The read-back of layer l overlaps the copy of layer l + 1.
  // With PdOptions::lane_read_back_in_copy the copy kernel itself reads back what it wrote (list 1), and both
  // lists and the event follow it on the lane stream.
  Status copy_and_read_back(LaneBuffers& lb, std::uint32_t layer, const CopyRequest& all, const BlockSpace& to,
                            std::span<const BlockId> to_ids) {
    Device& dev = lane_device();
    const std::uint32_t layers[1] = {layer};
    if (options_.lane_read_back_in_copy) {
      KVTIER_RETURN_IF_ERROR(lane_copy_layer(lb, all, layer, lb.device_at(layer, 0), lb.device_at(layer, 1)));
      KVTIER_RETURN_IF_ERROR(dev.memcpy_async(lb.host_at(layer, 0), lb.device_at(layer, 0),
                                              2 * lb.n * sizeof(std::uint64_t), *lane_stream_));
      return dev.record(*lb.events[layer], *lane_stream_);
    }
    KVTIER_RETURN_IF_ERROR(lane_copy_layer(lb, all, layer, lb.device_at(layer, 0)));
    KVTIER_RETURN_IF_ERROR(dev.record(*lb.copied[layer], *lane_stream_));
    KVTIER_RETURN_IF_ERROR(dev.wait(*verify_stream_, *lb.copied[layer]));
    KVTIER_RETURN_IF_ERROR(
        options_.engine->checksum(to, to_ids, layers, kAllRoles, lb.device_at(layer, 1), *verify_stream_));
    KVTIER_RETURN_IF_ERROR(dev.memcpy_async(lb.host_at(layer, 0), lb.device_at(layer, 0),
                                            2 * lb.n * sizeof(std::uint64_t), *verify_stream_));
    return dev.record(*lb.events[layer], *verify_stream_);
  }

  // A stream whose work failed stays failed (CUDA's errors are sticky, and the host backend models that), so the
  // lanes' later copies go on a fresh stream; the old one is kept until the endpoint stops (work of other
  // pieces on it reports the failure through their events).
  void renew_failed_lane_streams() {
    Device& dev = lane_device();
    for (auto* stream : {&lane_stream_, &verify_stream_}) {
      if (!*stream || dev.query(**stream).ok()) continue;
      auto fresh = dev.create_stream(StreamOptions{StreamPriority::kNormal, fmt::format("pd-lane-{}", role_)});
      if (!fresh.ok()) continue;  // the next enqueue fails and says why
      retired_streams_.push_back(std::move(*stream));
      *stream = std::move(fresh).value();
    }
  }

  // After a failed enqueue part of a layer's work may be on either stream: let it drain.
  void drain_lane() {
    for (auto* stream : {&lane_stream_, &verify_stream_})
      if (*stream) lane_device().synchronize(**stream, std::chrono::seconds(10)).ignore_error();
  }

  // One layer's checksum list `list` (0: moved, 1: landed) as copied to the host.
  static std::span<const std::uint64_t> list_of(const LaneBuffers& lb, std::uint32_t layer, std::uint32_t list) {
    return {lb.host_at(layer, list), lb.n};
  }
  // The moving side's read-back of the layer found every block as it was moved.
  static bool lists_match(const LaneBuffers& lb, std::uint32_t layer) {
    return std::memcmp(lb.host_at(layer, 0), lb.host_at(layer, 1), lb.n * sizeof(std::uint64_t)) == 0;
  }

  std::vector<std::uint64_t> local_strides() const {
    std::vector<std::uint64_t> s;
    for (std::uint32_t l = 0; l < blocks_.layout().num_layers(); ++l)
      for (std::uint32_t r = 0; r < blocks_.layout().num_roles(l); ++r) s.push_back(blocks_.plane(l, r).stride);
    return s;
  }

  Transport& t_;
  const BlockSpace blocks_;
  const PdOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool waits_aborted_ = false;  // abort_waits(): every wait returns at once (under mu_)
  std::thread thread_;
  std::set<PeerId> dropped_;                              // peers this side disconnected
  std::unique_ptr<Stream> lane_stream_;                   // the device lane's copies and checksum passes, in order
  std::unique_ptr<Stream> verify_stream_;                 // the moving side's read-backs, each behind its layer's copy
  std::vector<std::unique_ptr<Stream>> retired_streams_;  // failed lane streams (renew_failed_lane_streams)
  std::string role_;
  static constexpr std::size_t kLanePoolSize = 16;
  std::mutex lane_pool_mu_;
  std::vector<std::unique_ptr<LaneBuffers>> lane_pool_;
  mutable std::vector<BlockId> ring_ids_;                        // 0, 1, ...: a slot's block ids (under mu_)
  std::unique_ptr<kvtier::detail::ParallelLoop> checksum_loop_;  // host lanes: each layer's xxh3 checksums, split

 protected:
  // Bytes of `count` blocks of `layer` (every role).
  std::uint64_t layer_bytes(std::uint32_t layer, std::size_t count) const {
    const KvLayout& layout = blocks_.layout();
    std::uint64_t block_bytes = 0;
    for (std::uint32_t r = 0; r < layout.num_roles(layer); ++r) block_bytes += layout.block_bytes(layer, r);
    return block_bytes * count;
  }
  // Host lanes: the checksum of `blocks[i]` of `layer` into out[i], split over the checksum helpers when the layer
  // is large enough to pay for waking them (chunks of at least 256 KiB).
  void layer_checksums(std::uint32_t layer, const std::vector<std::uint64_t>& blocks, std::uint64_t* out) const {
    split_over_helpers(blocks.size(), layer_bytes(layer, 1), [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i)
        out[i] = layer_checksum_of(blocks_, layer, static_cast<BlockId>(blocks[i]));
    });
  }
  // body(begin, end) over blocks [0, n) of `block_bytes` each, split over the checksum helpers in chunks of at least
  // 256 KiB (on the caller alone without helpers).
  void split_over_helpers(std::size_t n, std::uint64_t block_bytes,
                          const std::function<void(std::size_t, std::size_t)>& body) const {
    if (checksum_loop_ == nullptr) {
      body(0, n);
      return;
    }
    const std::size_t grain =
        std::max<std::uint64_t>(1, (std::uint64_t{256} << 10) / std::max<std::uint64_t>(block_bytes, 1));
    checksum_loop_->run(n, grain, body);
  }

  // A layer's checksums on the checksum worker, or null: the caller computes them on the protocol thread. Layers of
  // fewer than kInlineChecksumBytes are hashed in place (a few microseconds), since handing them to the worker and
  // back costs two thread wake-ups, more than the hashing: bench/bench_pd_latency's transfers of 12 KiB layers.
  std::shared_ptr<ChecksumQueue::Job> submit_checksums(std::uint32_t layer, const std::vector<std::uint64_t>& blocks) {
    if (layer_bytes(layer, blocks.size()) < kInlineChecksumBytes) return nullptr;
    return checksums_.submit(layer, blocks);
  }
  static constexpr std::uint64_t kInlineChecksumBytes = std::uint64_t{64} << 10;

  // The transport lane's checksum worker (declared after what its jobs read, so it goes first).
  ChecksumQueue checksums_{[this](std::uint32_t layer, const std::vector<std::uint64_t>& blocks, std::uint64_t* out) {
                             layer_checksums(layer, blocks, out);
                           },
                           [this] { wake_progress(); }};
};

// ---- prefill --------------------------------------------------------------------------------------------

class Prefill final : public PdPrefill, public Endpoint {
 public:
  using Endpoint::Endpoint;
  ~Prefill() override { stop(); }

  Status begin(PeerId decode, TransferId id, std::vector<BlockId> src_ids) override {
    Status s = open_transfer(decode, id, std::move(src_ids));
    if (s.ok()) wake_progress();  // an early request applied here may have launched copies
    return s;
  }

  Status open_transfer(PeerId decode, TransferId id, std::vector<BlockId> src_ids) {
    std::vector<std::uint64_t> src_blocks(src_ids.begin(), src_ids.end());  // lists travel as u64 on the wire
    KVTIER_RETURN_IF_ERROR(check_blocks(src_blocks, "source"));
    auto info = t_.peer_info(decode);
    if (!info.ok()) return info.status().with_context("prefill begin");
    std::lock_guard lock(mu_);
    if (xfers_.count(id) != 0) return AlreadyExists(fmt::format("transfer {} exists", id));
    X& x = xfers_[id];
    x.peer = decode;
    x.peer_name = info->identity.name;
    x.src = std::move(src_blocks);
    x.layers.resize(blocks_.layout().num_layers());
    x.last_heard = x.times.started = Clock::now();
    if (given_up_.erase({id, x.peer_name}) != 0) {
      // Nothing was or will be written, and the decode reads nothing: the sources are reclaimable now.
      x.final = x.fin_heard = x.quiet_sent = true;
      x.times.final = x.last_heard;
      x.error = Cancelled(fmt::format("decode '{}' gave up on transfer {} before this begin()", x.peer_name, id));
      return Status::Ok();
    }
    // A request that arrived before begin() from this decode is applied now, its heartbeats carried over; the same
    // transfer id asked for by any other decode is refused (transfer ids name one prefill's transfers).
    for (auto it = early_.lower_bound({id, std::string()}); it != early_.end() && it->first.first == id;) {
      Early& e = it->second;
      if (it->first.second == x.peer_name) {
        x.beats = std::move(e.beats);
        x.last_heard = std::max(x.last_heard, e.last_heard);
        x.last_sent = e.last_sent;
        const std::vector<Grant> grants = std::move(e.grants);
        apply_request(id, x, std::move(e.req));
        for (const Grant& g : grants) grant(id, x, g);
      } else {
        refuse_foreign(it->first.second, id, x.peer_name);
      }
      it = early_.erase(it);
    }
    return Status::Ok();
  }

  Status layer_ready(TransferId id, std::uint32_t layer, ReadyFn ready) override {
    Status s = declare_layer(id, layer, std::move(ready));
    if (s.ok()) wake_progress();  // its readiness, or the copy launched below, is polled by the progress thread
    return s;
  }

  Status declare_layer(TransferId id, std::uint32_t layer, ReadyFn ready) {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    if (layer >= it->second.layers.size())
      return OutOfRange(fmt::format("layer {} >= num_layers {}", layer, it->second.layers.size()));
    L& l = it->second.layers[layer];
    if (l.declared) return AlreadyExists(fmt::format("transfer {} layer {} already declared ready", id, layer));
    l.declared = true;
    l.ready = ready ? std::move(ready) : ReadyFn([] { return Result<bool>(true); });
    // Sent from here when it is ready now: the progress thread may be idle until the next message.
    send_ready_layers(id, it->second);
    return Status::Ok();
  }

  Status layer_ready_after(TransferId id, std::uint32_t layer, Device& device, Event& event) override {
    return layer_ready(id, layer, [&device, &event]() { return device.query(event); });
  }

  Status layers_ready(TransferId id, std::span<const std::uint32_t> layers) override {
    {
      std::lock_guard lock(mu_);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      X& x = it->second;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] >= x.layers.size())
          return OutOfRange(fmt::format("layers[{}] = {} >= num_layers {}", i, layers[i], x.layers.size()));
        if (x.layers[layers[i]].declared)
          return AlreadyExists(fmt::format("transfer {} layer {} already declared ready", id, layers[i]));
        if (std::find(layers.begin(), layers.begin() + static_cast<std::ptrdiff_t>(i), layers[i]) !=
            layers.begin() + static_cast<std::ptrdiff_t>(i))
          return AlreadyExists(fmt::format("layers[{}] = {} is listed twice", i, layers[i]));
      }
      for (std::uint32_t l : layers) {
        x.layers[l].declared = true;
        x.layers[l].ready = ReadyFn([] { return Result<bool>(true); });
      }
      send_ready_layers(id, x);
    }
    wake_progress();
    return Status::Ok();
  }

  Result<PrefillStatus> status(TransferId id) const override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    return summarize(it->second);
  }

  Result<PrefillStatus> wait(TransferId id, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      PrefillStatus s = summarize(it->second);
      if (s.final && s.reclaimable) return s;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("prefill transfer {}: not final after {} ms", id,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  void abort_waits() override { abort_all_waits(); }

  Status disconnect_peer(PeerId peer) override {
    std::lock_guard lock(mu_);
    return disconnect_locked(peer, xfers_, [](const X& x) { return !x.final; });
  }

  Status forget(TransferId id) override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    PrefillStatus s = summarize(it->second);
    if (!s.final || !s.reclaimable)
      return FailedPrecondition(fmt::format("prefill transfer {} is not final and reclaimable", id));
    recycle_lane(std::move(it->second.lane));
    xfers_.erase(it);
    return Status::Ok();
  }

 private:
  struct L {
    bool declared = false;
    ReadyFn ready;
    bool sent = false;                       // written (push) or announced (pull)
    bool acked = false;                      // pull: the decode side's read notification came
    std::optional<XferId> xfer;              // push: the write
    bool lane_pending = false;               // device lane: the layer's kernel is enqueued, its event not yet seen
    std::uint32_t lane_head = 0;             // device lane: the layer whose checksum slots its copy used
    bool ready_seen = false;                 // ring lane: its data is in place; its pieces go as slots are granted
    std::shared_ptr<ChecksumQueue::Job> ck;  // transport lane: the layer's checksums, being computed or done
  };
  struct Req {
    PdMode mode = PdMode::kPush;
    std::uint8_t lane = 0;        // lane_kind() of the decode's request
    bool mover_verifies = false;  // device lane: this side reads the destinations back (lane byte 2)
    std::vector<std::uint64_t> dst;
    std::vector<std::uint64_t> strides;
    std::uint32_t ring_slots = 0;  // ring lane: the decode's ring
    std::uint64_t ring_slot_bytes = 0;
    Clock::time_point arrived;  // when 'R' came (before begin() for an early request)
  };
  // The decode's ring as mapped here (per decode peer, for the endpoint's lifetime).
  struct PeerRing {
    RingGeometry g;
    std::unique_ptr<PinnedMemory> registration;
    std::vector<BlockSpace> slots;
  };
  struct X {
    PeerId peer = 0;
    std::string peer_name;  // its agent name: only its messages apply to this transfer
    std::vector<std::uint64_t> src;
    std::optional<Req> req;
    std::vector<L> layers;
    Clock::time_point last_heard, last_sent;
    Beats beats;
    bool final = false, done = false;
    bool fin_heard = false;   // the decode's 'F' came: it reads nothing of this transfer any more
    bool quiet_sent = false;  // 'Q' went out (or could not: the peer is gone)
    std::optional<Clock::time_point> unquiet_since;  // final, with writes still in flight since then
    KeptStatus error;
    std::unique_ptr<LaneBuffers> lane;  // device and ring lanes
    PeerRing* ring = nullptr;           // ring lane
    std::vector<Piece> pieces;          // ring lane: [layer * pieces_per_layer + piece]
    std::uint32_t pieces_per_layer = 0;
    bool lane_list_sent = false;            // device lane, pull: an 'A' with the source list and strides went out
    std::optional<BlockSpace> direct_peer;  // host direct lane, push: the decode's pool as mapped here
    PdTimes times;
  };

  bool busy() const override {
    for (const auto& [id, x] : xfers_) {
      // A layer whose checksums or host direct copy are on the worker needs no polling: the job wakes this thread.
      for (const L& l : x.layers)
        if (l.lane_pending || l.xfer || (x.req && !x.final && l.declared && !l.sent && !l.ck)) return true;
      for (const Piece& pc : x.pieces)
        if (pc.state == PieceState::kCopying) return true;
    }
    return false;
  }

  // Pull: the decode has said it reads no layer announced to it any more (its 'D' for each, or its 'F'). Until then
  // a decode that was paused past the lease may still read the sources when it resumes, through a mapping this
  // side cannot revoke (UCX's one-sided RMA, the host direct lane's mapping, CUDA IPC): a time-out proves nothing.
  static bool reads_over(const X& x) {
    if (x.fin_heard || !x.req || x.req->mode != PdMode::kPull) return true;
    for (const L& l : x.layers)
      if (l.sent && !l.acked) return false;
    return true;
  }

  // Nothing of the transfer still reads or writes its blocks: no write in flight, no kernel, no checksum job.
  static bool writes_quiet(const X& x) {
    for (const L& l : x.layers)
      if (l.xfer || l.lane_pending || (l.ck && !l.ck->done.load(std::memory_order_acquire))) return false;
    for (const Piece& pc : x.pieces)
      if (pc.state == PieceState::kCopying) return false;
    return true;
  }

  PrefillStatus summarize(const X& x) const {
    PrefillStatus s;
    s.final = x.final;
    s.done = x.done;
    s.error = x.error;
    for (const L& l : x.layers)
      if (l.sent) ++s.layers_sent;
    // Forgetting the transfer before 'Q' went out would leave the decode side's blocks quarantined; in pull, the
    // sources are the caller's again only once no read of the decode can still come.
    s.reclaimable = x.final && writes_quiet(x) && x.quiet_sent && (reads_over(x) || t_.peer_revoked(x.peer));
    s.times = x.times;
    return s;
  }

  void apply_request(TransferId id, X& x, Req r) {
    x.times.request = r.arrived;
    auto refuse = [&](Status why) {
      const std::string reason = why.to_string();
      for (std::uint32_t u = 0; u < x.layers.size(); ++u)
        t_.send_notification(x.peer, Msg('X', id).u32(u).text(reason).str()).ignore_error();
      fail(x, id, std::move(why));
    };
    if (r.dst.size() != x.src.size()) {
      refuse(InvalidArgument(fmt::format("decode asked for {} blocks, prefill has {}", r.dst.size(), x.src.size())));
      return;
    }
    if (r.lane != lane_kind()) {
      refuse(FailedPrecondition(fmt::format("decode asked for the {} lane, this prefill runs the {} lane",
                                            lane_kind_name(r.lane), lane_kind_name(lane_kind()))));
      return;
    }
    if (r.strides.size() != blocks_.layout().num_planes()) {
      // Every lane's descriptors index the strides by plane: a short list was read past its end.
      refuse(InvalidArgument(
          fmt::format("decode sent {} plane strides for {} planes", r.strides.size(), blocks_.layout().num_planes())));
      return;
    }
    if (r.lane == 3) {
      auto ring = map_peer_ring(x.peer, r.ring_slots, r.ring_slot_bytes);
      auto lane = ring.ok() ? make_lane(x.src, r.dst) : Result<std::unique_ptr<LaneBuffers>>(ring.status());
      if (!lane.ok()) {
        refuse(lane.status().with_context("ring lane"));
        return;
      }
      x.lane = std::move(lane).value();
      x.ring = *ring;
      const std::uint64_t per = x.ring->g.per_slot;
      x.pieces_per_layer = static_cast<std::uint32_t>((x.src.size() + per - 1) / per);
      x.pieces.assign(std::size_t{x.pieces_per_layer} * x.layers.size(), Piece{});
    } else if (r.lane == 4) {
      if (r.mode == PdMode::kPush) {
        // Push writes the decode's pool through this process's mapping of it: every destination inside its regions.
        auto peer = peer_space(x.peer, r.strides);
        Status s = peer.ok() ? check_ids_in(*peer, r.dst, "destination") : peer.status();
        if (!s.ok()) {
          refuse(s.with_context("host direct lane"));
          return;
        }
        x.direct_peer = std::move(peer).value();
      }
    } else if (r.lane != 0) {
      auto lane = make_lane(x.src, r.dst);
      if (lane.ok() && r.mode == PdMode::kPush) {
        auto peer = peer_space(x.peer, r.strides);
        if (peer.ok())
          (*lane)->peer = std::move(peer).value();
        else
          lane = peer.status();
      }
      if (!lane.ok()) {
        refuse(lane.status().with_context("device lane"));
        return;
      }
      x.lane = std::move(lane).value();
    }
    x.req = std::move(r);
  }

  // Tells the decode side that none of the layers not yet sent will come ('X'), so it fails them at once rather
  // than at the lease, and fails the transfer.
  void fail_unsent(X& x, TransferId id, Status why) {
    const std::string reason = why.to_string();
    for (std::uint32_t u = 0; u < x.layers.size(); ++u)
      if (!x.layers[u].sent) t_.send_notification(x.peer, Msg('X', id).u32(u).text(reason).str()).ignore_error();
    fail(x, id, std::move(why));
  }

  // Device lane: as fail_unsent, for every layer the decode side has not been told about yet (not enqueued, or
  // enqueued with its notification still to come: those are not announced once the transfer is final).
  void fail_untold(X& x, TransferId id, Status why) {
    if (!x.final) {
      const std::string reason = why.to_string();
      for (std::uint32_t u = 0; u < x.layers.size(); ++u)
        if (!x.layers[u].sent || x.layers[u].lane_pending)
          t_.send_notification(x.peer, Msg('X', id).u32(u).text(reason).str()).ignore_error();
    }
    fail(x, id, std::move(why));
  }

  void fail(X& x, TransferId id, Status why) {
    if (x.final) {
      why.ignore_error();  // the transfer already ended with its first error, which is what the caller sees
      return;
    }
    x.final = true;
    x.error = std::move(why);
    log(LogLevel::kWarning, "transport", fmt::format("pd prefill transfer {}: {}", id, x.error.to_string()));
  }

  // The endpoint closes: transfers not final are failed (the decode is told which layers will not come), and the
  // close waits, up to a lease, until no decode still reads a layer announced to it (pull: its 'D' for every such
  // layer, or its 'F'): the caller frees this side's blocks after it. A decode that does not answer in time is
  // disconnected, which stops its reads where the transport can.
  void before_stop() override {
    std::unique_lock lock(mu_);
    for (auto& [id, x] : xfers_)
      if (!x.final) fail_untold(x, id, Cancelled(fmt::format("transfer {}: the prefill endpoint was closed", id)));
    // A decode whose process has ended (peer_revoked) reads nothing any more: no wait for it.
    const auto settled = [&](const X& x) { return reads_over(x) || t_.peer_revoked(x.peer); };
    wait_locked(lock, close_wait(), [&] {
      return std::all_of(xfers_.begin(), xfers_.end(), [&](const auto& kv) { return settled(kv.second); });
    });
    std::set<PeerId> unsettled;
    for (const auto& [id, x] : xfers_)
      if (!settled(x)) unsettled.insert(x.peer);
    lock.unlock();
    disconnect_unanswered(unsettled, "(a decode) may still read layers announced to it");
  }

  // The endpoint closes: tell each decode that nothing of its transfers will land any more where that holds (the
  // kernels have drained, the workers have stopped; transport writes are cancelled and must be quiescent), so that
  // its blocks and ring slots are not held until this process exits.
  void after_stop() override {
    // Transport writes still in flight are cancelled and given up to a lease to become quiescent (a write a
    // transport cannot cancel usually ends within milliseconds); without that wait the 'Q' of a transfer closed
    // mid-write never went out and its decode's blocks stayed quarantined while this process lived.
    for (auto& [id, x] : xfers_)
      for (L& l : x.layers)
        if (l.xfer && !x.quiet_sent) t_.abort(*l.xfer).ignore_error();
    const auto deadline = Clock::now() + close_wait();
    for (auto& [id, x] : xfers_) {
      if (x.quiet_sent) continue;
      bool quiet = true;
      for (L& l : x.layers) {
        if (!l.xfer) continue;
        for (;;) {
          auto st = t_.poll(*l.xfer);
          if (!st.ok() || st->quiescent || Clock::now() >= deadline) {
            quiet = quiet && st.ok() && st->quiescent;
            break;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      // Checksum and host direct jobs have ended or will never run: stop() joined their worker first.
      if (!quiet) continue;
      t_.send_notification(x.peer, Msg('Q', id).str()).ignore_error();
      x.quiet_sent = true;
    }
    for (const auto& [key, e] : early_)
      refuse_early(key.second, key.first, Cancelled("the prefill endpoint was closed before begin()"));
    early_.clear();
  }

  void on_message(const Notification& n, char type, TransferId id, Parse& p) override {
    auto it = xfers_.find(id);
    if (it != xfers_.end() && it->second.peer_name != n.peer) {
      // Another decode's message for a transfer id this prefill runs with someone else: never applied (a request
      // would redirect the copies, an 'F' would end the transfer). Its request is refused, so it fails at once.
      if (type == 'R') refuse_foreign(n.peer, id, it->second.peer_name);
      return;
    }
    if (it == xfers_.end()) {
      on_early_message(n, type, id, p);
      return;
    }
    if (type == 'R') {
      Req r;
      if (!parse_request(p, r)) return;
      if (it->second.req) {
        // A request repeated for a running transfer is not applied again: its lane buffers may be in use by copies
        // in flight, and its destinations were checked once. One for a transfer that has ended is the decode's
        // start() of the id again (it forgot the old one): dropped, it left the new transfer and a later begin() of
        // the id waiting for each other. Refused at once, and a begin() of the id before another request ends at
        // once too.
        if (it->second.final) {
          refuse_early(n.peer, id,
                       FailedPrecondition(fmt::format(
                           "prefill transfer {} has ended (it was requested before) and is not forgotten yet; start "
                           "the transfer under a new id",
                           id)));
          note_given_up({id, n.peer});
        }
        return;
      }
      if (it->second.final) {
        // A request for a transfer that ended here without one: its begin() came after the decode had given up on
        // the id (cancelled and forgotten it) and before this request for the id again. Refused at once, so the
        // decode's new transfer fails now and not a lease later, when its silence would also have dropped the pair.
        refuse_early(n.peer, id,
                     FailedPrecondition(fmt::format(
                         "prefill transfer {} had ended without a request ({}; as when begun after decode '{}' gave "
                         "up on it, before this request for it again reached the prefill); start the transfer under "
                         "a new id",
                         id, it->second.error.ok() ? std::string("no error") : it->second.error.to_string(), n.peer)));
        return;
      }
      it->second.last_heard = Clock::now();
      apply_request(id, it->second, std::move(r));
      return;
    }
    X& x = it->second;
    std::uint32_t layer = 0;
    switch (type) {
      case 'H': heard_heartbeat(x.beats, p, x.last_heard); return;
      case 'D':
        if (!p.u32(layer) || layer >= x.layers.size()) return;
        if (n.kind == NotifKind::kMessage) x.layers[layer].acked = true;
        return;
      case 'G': {
        Grant g;
        if (p.u32(g.layer) && p.u32(g.piece) && p.u32(g.slot)) grant(id, x, g);
        return;
      }
      case 'F': {
        std::uint8_t ok = 0;
        (void)p.u8(ok);
        x.fin_heard = true;
        if (!x.final) {
          x.final = true;
          x.times.final = Clock::now();
          x.done = ok != 0;
          if (!x.done) x.error = Aborted(fmt::format("decode side ended transfer {} as failed", id));
        }
        return;
      }
      default: return;
    }
  }

  static bool parse_request(Parse& p, Req& r) {
    std::uint8_t mode = 0, lane = 0;
    if (!p.u8(mode) || mode > 1 || !p.u8(lane) || lane > 4 || !p.u64s(r.dst) || !p.u64s(r.strides)) return false;
    if (lane == 3 && (!p.u32(r.ring_slots) || !p.u64(r.ring_slot_bytes))) return false;
    r.mode = static_cast<PdMode>(mode);
    r.lane = lane == 2 ? 1 : lane;
    r.mover_verifies = lane == 2 || lane == 4;
    r.arrived = Clock::now();
    return true;
  }

  // A message for a transfer this prefill has not begun: the decode's request and grants are kept for begin(), and
  // the two sides heartbeat it meanwhile, so a prefill whose forward starts later than the lease is not taken for
  // dead. It ends with the decode's 'F' (answered with 'Q': nothing of it was or will be written) or its silence.
  void on_early_message(const Notification& n, char type, TransferId id, Parse& p) {
    const std::pair<TransferId, std::string> key{id, n.peer};
    auto it = early_.find(key);
    if (type == 'R') {
      Req r;
      if (it != early_.end() || !parse_request(p, r)) return;
      given_up_.erase(key);  // asked for again: a begin() serves this request
      if (early_.size() >= kMaxEarlyRequests) {
        refuse_early(n.peer, id,
                     ResourceExhausted(fmt::format("{} requests wait for begin() here already", kMaxEarlyRequests)));
        return;
      }
      Early& e = early_[key];
      e.req = std::move(r);
      e.last_heard = e.req.arrived;
      return;
    }
    if (it == early_.end()) return;
    Early& e = it->second;
    switch (type) {
      case 'H': heard_heartbeat(e.beats, p, e.last_heard); return;
      case 'G': {
        Grant g;
        if (e.grants.size() < std::size_t{PdOptions::kMaxRingSlots} && p.u32(g.layer) && p.u32(g.piece) &&
            p.u32(g.slot))
          e.grants.push_back(g);
        return;
      }
      case 'F':
        if (auto peer = t_.find_peer(n.peer); peer.ok()) t_.send_notification(*peer, Msg('Q', id).str()).ignore_error();
        note_given_up(it->first);
        early_.erase(it);
        return;
      default: return;
    }
  }

  // The decode gave up on a request before begin() (it cancelled the transfer and may have forgotten it): a later
  // begin() of that transfer ends at once as cancelled instead of heartbeating a decode that ignores it for a lease.
  void note_given_up(const std::pair<TransferId, std::string>& key) {
    if (!given_up_.insert(key).second) return;
    given_up_order_.push_back(key);
    while (given_up_order_.size() > kMaxEarlyRequests) {
      given_up_.erase(given_up_order_.front());
      given_up_order_.pop_front();
    }
  }

  // Fails, on the decode named `peer` (when it is loaded here), its transfer `id` that this prefill cannot serve:
  // every layer 'X' with `why`, then 'Q' (nothing of it was or will be written there).
  void refuse_early(const std::string& peer, TransferId id, const Status& why) {
    auto to = t_.find_peer(peer);
    if (!to.ok()) return;
    const std::string reason = why.to_string();
    for (std::uint32_t u = 0; u < blocks_.layout().num_layers(); ++u)
      t_.send_notification(*to, Msg('X', id).u32(u).text(reason).str()).ignore_error();
    t_.send_notification(*to, Msg('Q', id).str()).ignore_error();
  }
  void refuse_foreign(const std::string& peer, TransferId id, const std::string& owner) {
    refuse_early(peer, id,
                 AlreadyExists(fmt::format("prefill transfer {} belongs to another decode ('{}'), not to '{}'", id,
                                           owner, peer)));
  }

  // Heartbeats of the requests waiting for begin(); a request whose decode went silent for more than the lease is
  // dropped (that decode has failed the transfer by now and may reuse the blocks: a late begin() must not write them).
  void tick_early(Clock::time_point now) {
    for (auto it = early_.begin(); it != early_.end();) {
      Early& e = it->second;
      auto peer = t_.find_peer(it->first.second);
      if (now - e.last_heard > options_.lease && !(peer.ok() && bytes_moving(*peer, now))) {
        note_given_up(it->first);
        it = early_.erase(it);
        continue;
      }
      if (peer.ok() && now - e.last_sent >= options_.heartbeat) {
        t_.send_urgent_notification(*peer, heartbeat(it->first.first, e.beats, now)).ignore_error();
        e.last_sent = now;
      }
      ++it;
    }
  }

  void tick(Clock::time_point now) override {
    tick_early(now);
    for (auto& [id, x] : xfers_) {
      if (x.ring)
        finish_ring_pieces(id, x);
      else if (x.lane)
        finish_lane_layers(id, x);
      // Writes: observe completion, keep the region busy until quiescent.
      for (std::uint32_t li = 0; li < x.layers.size(); ++li) {
        L& l = x.layers[li];
        if (!l.xfer) continue;
        auto st = t_.poll(*l.xfer);
        if (!st.ok()) {
          l.xfer.reset();
          continue;
        }
        // The layers not sent yet will not be: the decode is told now ('X'), not by its lease a second later
        // (which also disconnected this prefill).
        if (st->state == XferState::kFailed && !x.final)
          fail_unsent(x, id, st->error.with_context(fmt::format("layer {} write", li)));
        if (st->state != XferState::kInProgress && st->quiescent) {
          x.times.moved = Clock::now();
          t_.release(*l.xfer).ignore_error();
          l.xfer.reset();
        }
      }
      if (x.final) {
        if (!x.quiet_sent && writes_quiet(x)) {
          // After the write notifications of this transfer: nothing of it can land on the decode side any more.
          t_.send_notification(x.peer, Msg('Q', id).str()).ignore_error();
          x.quiet_sent = true;
        } else if (!x.quiet_sent && !x.done) {
          // Writes that a decode which gave up refuses may never complete (UCX over TCP: a rendezvous it drops):
          // cancelled, and a lease later the peer is dropped if it is silent everywhere, which ends them.
          if (!x.unquiet_since) {
            x.unquiet_since = now;
            for (L& l : x.layers)
              if (l.xfer) t_.abort(*l.xfer).ignore_error();
          } else if (now - *x.unquiet_since > options_.lease) {
            drop_after_last_word(x.peer, now, /*at_once=*/true);
          }
        }
        continue;
      }
      if (!x.req) {
        // Begun before the decode's start(): nothing is written before its request, and the decode does not know
        // the transfer yet, so its silence about it is no sign of death (the lease rule below disconnected a healthy
        // decode whose start() came a lease after begin()). It waits up to request_wait, then fails alone.
        if (now - x.times.started > options_.request_wait) {
          fail(x, id,
               TimedOut(fmt::format("no request from decode '{}' within {} ms of begin()", x.peer_name,
                                    options_.request_wait.count())));
          x.fin_heard = true;  // nothing was or will be written there, nothing is read: the sources are reclaimable
          continue;
        }
      } else if (now - x.last_heard > options_.lease && !bytes_moving(x.peer, now)) {
        fail(x, id,
             Unavailable(fmt::format("decode side silent for more than the lease ({} ms)", options_.lease.count())));
        // Writes in flight to a silent decode side may never complete (a dead peer on a lane without failure
        // detection): cancel them, and drop the peer if it is silent everywhere. Dropped only once 'Q' went out
        // (or a lease later): a decode that is alive after all (this side was the one paused, and the decode gave
        // up meanwhile) keeps its blocks quarantined until 'Q' reaches it, and a disconnected peer gets nothing.
        for (L& l : x.layers)
          if (l.xfer) t_.abort(*l.xfer).ignore_error();
        drop_after_last_word(x.peer, now);
        continue;
      }
      if (now - x.last_sent >= options_.heartbeat) {
        t_.send_urgent_notification(x.peer, heartbeat(id, x.beats, now)).ignore_error();
        x.last_sent = now;
      }
      send_ready_layers(id, x);
    }
    drop_peers_due(xfers_, now, [](const X& x) { return x.final && !x.quiet_sent; });
  }

  // Sends every declared layer whose readiness now says so (requested transfers only).
  void send_ready_layers(TransferId id, X& x) {
    if (!x.req || x.final) return;
    std::vector<std::uint32_t> group;  // device lane, push: the layers ready now, moved by one copy
    const bool grouping = x.lane && x.req->mode == PdMode::kPush && lane_groups_layers(x.req->mover_verifies);
    for (std::uint32_t li = 0; li < x.layers.size(); ++li) {
      L& l = x.layers[li];
      if (!l.declared || l.sent || l.ready_seen) continue;
      if (l.ck) {  // ready already; its checksums are being computed
        if (l.ck->done.load(std::memory_order_acquire)) send_layer(id, x, li);
        if (x.final) return;
        continue;
      }
      auto ready = l.ready();
      if (!ready.ok()) {
        // The layer's data will never be valid (its event or staging copy failed).
        fail_unsent(x, id, ready.status().with_context(fmt::format("layer {} event", li)));
        return;
      }
      if (!*ready) continue;
      if (x.ring) {
        l.ready_seen = true;
        t_.send_notification(x.peer, Msg('Y', id).u32(li).str()).ignore_error();
        continue;
      }
      if (x.direct_peer) {  // host direct push: the copy itself, with both checksums, on the worker
        if ((l.ck = submit_move(blocks_, x.src, *x.direct_peer, x.req->dst, li)) != nullptr) continue;
      } else if (!x.lane && x.req->lane != 4) {
        if (x.req->mode == PdMode::kPull) announce_for_read(id, x, li);
        if ((l.ck = submit_checksums(li, x.src)) != nullptr) continue;
      }
      if (grouping) {
        group.push_back(li);
        continue;
      }
      send_layer(id, x, li);
      if (x.final) return;
    }
    if (group.size() == 1) send_layer(id, x, group[0]);
    if (group.size() > 1) send_lane_group(id, x, group);
    if (x.ring) pump_ring(id, x);
  }

  // Device lane, push with this side verifying: layers ready at once go as one copy (lane_groups_layers).
  void send_lane_group(TransferId id, X& x, std::span<const std::uint32_t> group) {
    LaneBuffers& lb = *x.lane;
    for (std::uint32_t li : group) x.layers[li].sent = true;
    x.last_sent = Clock::now();
    mark_move(x.times, x.last_sent);
    const CopyRequest all{&blocks_, &*lb.peer, lb.local_ids, lb.peer_ids, {}, kAllRoles, CopyStrategy::kSmKernel};
    Status s = copy_group_and_read_back(lb, group, all);
    if (!s.ok()) {
      drain_lane();
      renew_failed_lane_streams();
      const std::string reason = s.to_string();
      for (std::uint32_t li : group)
        t_.send_notification(x.peer, Msg('X', id).u32(li).text(reason).str()).ignore_error();
      fail_untold(x, id, s.with_context(fmt::format("layers {}-{} device lane", group.front(), group.back())));
      return;
    }
    mark_posted(x.times);
    for (std::uint32_t li : group) {
      x.layers[li].lane_pending = true;
      x.layers[li].lane_head = group.front();
    }
  }

  // ---- ring lane ----

  struct Grant {
    std::uint32_t layer = 0, piece = 0, slot = 0;
  };
  // The decode granted a slot to a piece (ignored when out of range or not waiting).
  void grant(TransferId id, X& x, const Grant& g) {
    if (!x.ring || g.layer >= x.layers.size() || g.piece >= x.pieces_per_layer || g.slot >= x.ring->g.slots) return;
    Piece& pc = x.pieces[std::size_t{g.layer} * x.pieces_per_layer + g.piece];
    if (pc.state != PieceState::kWaiting) return;
    pc.state = PieceState::kGranted;
    pc.slot = g.slot;
    pump_ring(id, x);
  }

  // The decode `peer`'s ring, mapped and registered here on first use.
  Result<PeerRing*> map_peer_ring(PeerId peer, std::uint32_t slots, std::uint64_t slot_bytes) {
    KVTIER_ASSIGN_OR_RETURN(RingGeometry g, ring_geometry(slots, slot_bytes));
    if (auto it = peer_rings_.find(peer); it != peer_rings_.end()) {
      const RingGeometry& have = it->second.g;
      if (have.slots != g.slots || have.slot_bytes != g.slot_bytes)
        return InvalidArgument(fmt::format("decode ring of {} slots of {} bytes, earlier {} of {}", g.slots,
                                           g.slot_bytes, have.slots, have.slot_bytes));
      return &it->second;
    }
    const std::uint32_t region = blocks_.layout().num_planes();
    KVTIER_ASSIGN_OR_RETURN(PeerInfo info, t_.peer_info(peer));
    if (region >= info.regions.size() || info.regions[region].bytes < g.ring_bytes())
      return InvalidArgument(fmt::format("decode's ring (its region {}) has {} bytes, {} slots of {} need {}", region,
                                         region < info.regions.size() ? info.regions[region].bytes : 0, g.slots,
                                         g.slot_bytes, g.ring_bytes()));
    KVTIER_ASSIGN_OR_RETURN(void* base, t_.peer_region_address(peer, region));
    PeerRing ring;
    ring.g = g;
    KVTIER_ASSIGN_OR_RETURN(ring.registration, register_ring(static_cast<std::byte*>(base), g.ring_bytes()));
    KVTIER_ASSIGN_OR_RETURN(ring.slots, ring_slot_spaces(static_cast<std::byte*>(base), g));
    return &(peer_rings_[peer] = std::move(ring));
  }

  // Copies every granted piece of a ready layer into its slot (device to host), checksumming what it moves.
  void pump_ring(TransferId id, X& x) {
    if (!x.req || x.final) return;
    LaneBuffers& lb = *x.lane;
    const std::uint64_t n = x.src.size();
    for (std::size_t u = 0; u < x.pieces.size(); ++u) {
      Piece& pc = x.pieces[u];
      const auto li = static_cast<std::uint32_t>(u / x.pieces_per_layer);
      if (pc.state != PieceState::kGranted || !x.layers[li].ready_seen) continue;
      const auto [a, b] = piece_range(u % x.pieces_per_layer, x.ring->g.per_slot, n);
      auto done = piece_event(lb.pieces, u);
      Status s = done.status();
      if (s.ok())
        s = copy_piece(blocks_, std::span<const BlockId>(lb.local_ids).subspan(a, b - a), x.ring->slots[pc.slot],
                       std::span<const BlockId>(ring_ids_).first(b - a), li, true, lb.device_at(li) + a,
                       lb.host_at(li) + a, **done);
      if (!s.ok()) {
        drain_lane();
        renew_failed_lane_streams();
        fail_unsent(x, id, s.with_context(fmt::format("layer {} ring piece {}", li, u % x.pieces_per_layer)));
        return;
      }
      pc.state = PieceState::kCopying;
      x.last_sent = Clock::now();
    }
  }

  // Pieces whose copy completed are announced with their checksums; a layer is sent once all of its pieces are.
  void finish_ring_pieces(TransferId id, X& x) {
    const std::uint64_t n = x.src.size();
    for (std::size_t u = 0; u < x.pieces.size(); ++u) {
      Piece& pc = x.pieces[u];
      if (pc.state != PieceState::kCopying) continue;
      const auto li = static_cast<std::uint32_t>(u / x.pieces_per_layer);
      const std::uint32_t piece = static_cast<std::uint32_t>(u % x.pieces_per_layer);
      auto done = lane_device().query(*x.lane->pieces[u]);
      if (done.ok() && !*done) continue;
      pc.state = PieceState::kDone;
      if (!done.ok()) {
        renew_failed_lane_streams();
        fail_unsent(x, id, done.status().with_context(fmt::format("layer {} ring piece {}", li, piece)));
        continue;
      }
      if (x.final) continue;
      const auto [a, b] = piece_range(piece, x.ring->g.per_slot, n);
      Msg m('P', id);
      m.u32(li).u32(piece).u32(pc.slot).u64s(std::span<const std::uint64_t>(x.lane->host_at(li) + a, b - a));
      t_.send_notification(x.peer, m.str()).ignore_error();
      bool all = true;
      for (std::uint32_t q = 0; q < x.pieces_per_layer; ++q)
        all = all && x.pieces[std::size_t{li} * x.pieces_per_layer + q].state == PieceState::kDone;
      if (all) x.layers[li].sent = true;
    }
  }

  // Device lane: layers whose kernel completed are announced ('W' after the write, 'A' once the sources are
  // checksummed) with the checksums the device computed.
  void finish_lane_layers(TransferId id, X& x) {
    for (std::uint32_t li = 0; li < x.layers.size(); ++li) {
      L& l = x.layers[li];
      if (!l.lane_pending) continue;
      auto done = lane_device().query(*x.lane->events[li]);
      if (done.ok() && !*done) continue;
      l.lane_pending = false;
      x.times.moved = Clock::now();
      if (!done.ok()) {
        t_.send_notification(x.peer, Msg('X', id).u32(li).text(done.status().to_string()).str()).ignore_error();
        renew_failed_lane_streams();
        fail_untold(x, id, done.status().with_context(fmt::format("layer {} device lane kernel", li)));
        continue;
      }
      if (x.final) continue;  // the decode side knows the transfer failed; nothing more is announced
      Msg m(x.req->mode == PdMode::kPull ? 'A' : 'W', id);
      if (x.req->mode == PdMode::kPull)
        append_read_announcement(m.u32(li), x, list_of(*x.lane, li, 0));
      else if (x.req->mover_verifies && lists_match(*x.lane, l.lane_head))
        // Every block read back as moved: the count alone (the decode trusts this side's read-back either way,
        // and 16 bytes per block per layer through the socket cost as much as a small layer's copy).
        m.u32(li).u64s({}).u64s({}).u32(static_cast<std::uint32_t>(x.lane->n));
      else if (x.req->mover_verifies)  // a layer of a group carries the group's lists: its failed blocks fail here
        m.u32(li).u64s(list_of(*x.lane, l.lane_head, 0)).u64s(list_of(*x.lane, l.lane_head, 1));
      else
        m.u32(li).u64s(list_of(*x.lane, li, 0));
      t_.send_notification(x.peer, m.str()).ignore_error();
      x.times.announced = Clock::now();
    }
  }

  // Device lane, pull: the first 'A' of a transfer carries the source list and this side's strides; every later
  // one carries neither and ends with the list's length instead (4,096 blocks are 32 KiB per layer otherwise,
  // parsed and compared again on the decode side for every layer). The transport keeps one peer's messages in
  // order, so the list arrives first.
  void append_read_announcement(Msg& m, X& x, std::span<const std::uint64_t> ck) {
    if (!x.lane_list_sent) {
      m.u64s(x.src).u64s(ck).u64s(local_strides());
      x.lane_list_sent = true;
      return;
    }
    m.u64s({}).u64s(ck).u64s({}).u32(static_cast<std::uint32_t>(x.src.size()));
  }

  // Device lane: push, the layer's kernel writes the decode's blocks and checksums what it moves (and, when
  // this side verifies, a second pass reads them back); pull, a read-only pass checksums the sources, or, when
  // the decode side verifies its own copy, the layer is announced at once. The notification of a kernel's
  // work follows in finish_lane_layers.
  void send_lane_layer(TransferId id, X& x, std::uint32_t li) {
    L& l = x.layers[li];
    LaneBuffers& lb = *x.lane;
    const std::uint32_t layer[1] = {li};
    Status s;
    l.sent = true;
    x.last_sent = Clock::now();
    if (x.req->mode == PdMode::kPull && x.req->mover_verifies) {
      Msg m('A', id);
      append_read_announcement(m.u32(li), x, {});
      t_.send_notification(x.peer, m.str()).ignore_error();
      x.times.announced = Clock::now();
      return;
    }
    mark_move(x.times, x.last_sent);
    if (x.req->mode == PdMode::kPush) {
      const CopyRequest all{&blocks_, &*lb.peer, lb.local_ids, lb.peer_ids, {}, kAllRoles, CopyStrategy::kSmKernel};
      if (x.req->mover_verifies) {
        s = copy_and_read_back(lb, li, all, *lb.peer, lb.peer_ids);
      } else {
        s = lane_copy_layer(lb, all, li, lb.device_at(li));
        if (s.ok()) s = finish_lane_layer(lb, li);
      }
    } else {
      s = options_.engine->checksum(blocks_, lb.local_ids, layer, kAllRoles, lb.device_at(li), *lane_stream_).status();
      if (s.ok()) s = finish_lane_layer(lb, li);
    }
    if (!s.ok()) {
      // Part of it may be enqueued: let it drain before the writes can count as quiescent.
      drain_lane();
      renew_failed_lane_streams();
      t_.send_notification(x.peer, Msg('X', id).u32(li).text(s.to_string()).str()).ignore_error();
      fail_untold(x, id, s.with_context(fmt::format("layer {} device lane", li)));
      return;
    }
    mark_posted(x.times);
    l.lane_pending = true;
    l.lane_head = li;
  }

  void send_layer(TransferId id, X& x, std::uint32_t li) {
    if (x.lane) {
      send_lane_layer(id, x, li);
      return;
    }
    if (x.req->lane == 4) {
      send_direct_layer(id, x, li);
      return;
    }
    L& l = x.layers[li];
    std::vector<std::uint64_t> ck;
    if (l.ck) {
      ck = std::move(l.ck->out);
    } else {
      ck.resize(x.src.size());
      layer_checksums(li, x.src, ck.data());
    }
    l.sent = true;
    x.last_sent = Clock::now();
    if (x.req->mode == PdMode::kPull) {  // announced already: the checksums follow
      t_.send_notification(x.peer, Msg('K', id).u32(li).u64s(ck).str()).ignore_error();
      x.times.announced = Clock::now();
      return;
    }
    std::vector<LocalDesc> ld;
    std::vector<RemoteDesc> rd;
    layer_descs(li, x.src, x.req->dst, x.req->strides, ld, rd);
    Msg m('W', id);
    m.u32(li).u64s(ck);
    mark_move(x.times, Clock::now());
    auto posted = t_.post(XferOp::kWrite, x.peer, ld, rd, m.str());
    if (!posted.ok()) {
      t_.send_notification(x.peer, Msg('X', id).u32(li).text(posted.status().to_string()).str()).ignore_error();
      fail_unsent(x, id, posted.status().with_context(fmt::format("layer {} write", li)));
      return;
    }
    l.xfer = *posted;
    mark_posted(x.times);
    x.times.announced = Clock::now();
  }

  // Transport lane, pull: the layer is ready; 'A' with its source list and no checksums (they follow in 'K').
  void announce_for_read(TransferId id, X& x, std::uint32_t li) {
    Msg m('A', id);
    m.u32(li).u64s(x.src).u64s(std::span<const std::uint64_t>{}).u64s(local_strides());
    t_.send_notification(x.peer, m.str()).ignore_error();
    x.last_sent = x.times.announced = Clock::now();
  }

  // Host direct lane. Push: the layer's copy is done (on the worker, or here for a small layer); 'W' carries the
  // count of blocks whose read-back matched, or both lists when some did not. Pull: 'A' with the source list and
  // this side's strides; the decode copies and reads back.
  void send_direct_layer(TransferId id, X& x, std::uint32_t li) {
    L& l = x.layers[li];
    l.sent = true;
    x.last_sent = Clock::now();
    const std::size_t n = x.src.size();
    if (x.req->mode == PdMode::kPull) {
      Msg m('A', id);
      m.u32(li).u64s(x.src).u64s({}).u64s(local_strides());
      t_.send_notification(x.peer, m.str()).ignore_error();
      return;
    }
    std::vector<std::uint64_t> here;  // a small layer, moved on this thread
    if (!l.ck) {
      here.resize(2 * n);
      move_layer(blocks_, x.src, *x.direct_peer, x.req->dst, li, here.data());
    }
    const std::uint64_t* both = l.ck ? l.ck->out.data() : here.data();  // the job stays: writes_quiet() sees it done
    const std::span<const std::uint64_t> read(both, n), landed(both + n, n);
    Msg m('W', id);
    if (std::equal(read.begin(), read.end(), landed.begin()))
      m.u32(li).u64s({}).u64s({}).u32(static_cast<std::uint32_t>(n));
    else
      m.u32(li).u64s(read).u64s(landed);
    t_.send_notification(x.peer, m.str()).ignore_error();
  }

  bool wait_direct_copies(PeerId peer) override {
    std::vector<std::shared_ptr<ChecksumQueue::Job>> jobs;
    for (const auto& [id, x] : xfers_)
      if (x.peer == peer && x.direct_peer)
        for (const L& l : x.layers)
          if (l.ck) jobs.push_back(l.ck);
    return wait_jobs(jobs);
  }

  std::map<TransferId, X> xfers_;
  // Requests that came before begin(), per (transfer, decode peer).
  struct Early {
    Req req;
    Beats beats;
    Clock::time_point last_heard, last_sent;
    std::vector<Grant> grants;  // ring lane: slots granted before begin()
  };
  static constexpr std::size_t kMaxEarlyRequests = 1u << 16;
  std::map<std::pair<TransferId, std::string>, Early> early_;
  // Requests whose decode gave up before begin() ('F', or silence past the lease), the most recent
  // kMaxEarlyRequests: a later begin() of one ends at once (note_given_up, open_transfer).
  std::set<std::pair<TransferId, std::string>> given_up_;
  std::deque<std::pair<TransferId, std::string>> given_up_order_;
  std::map<PeerId, PeerRing> peer_rings_;  // ring lane (std::map: X::ring points into it)
};

// ---- decode ---------------------------------------------------------------------------------------------

class Decode final : public PdDecode, public Endpoint {
 public:
  using Endpoint::Endpoint;
  ~Decode() override { stop(); }

  Status start(PeerId prefill, TransferId id, PdMode mode, std::vector<BlockId> dst_ids) override {
    std::vector<std::uint64_t> dst_blocks(dst_ids.begin(), dst_ids.end());  // lists travel as u64 on the wire
    KVTIER_RETURN_IF_ERROR(check_blocks(dst_blocks, "destination"));
    if (mode != PdMode::kPush && mode != PdMode::kPull)
      return InvalidArgument(fmt::format("unknown transfer mode {}", static_cast<int>(mode)));
    auto info = t_.peer_info(prefill);
    if (!info.ok()) return info.status().with_context("decode start");
    Msg m('R', id);
    const std::uint8_t lane_byte = ring_lane()                                             ? 3
                                   : host_direct()                                         ? 4
                                   : !device_lane()                                        ? 0
                                   : options_.lane_verify == PdOptions::LaneVerify::kMover ? 2
                                                                                           : 1;
    m.u8(static_cast<std::uint8_t>(mode)).u8(lane_byte).u64s(dst_blocks).u64s(local_strides());
    if (ring_lane()) m.u32(ring_.slots).u64(ring_.slot_bytes);
    std::unique_ptr<LaneBuffers> lane;
    if (device_lane()) {
      KVTIER_ASSIGN_OR_RETURN(lane, make_lane(dst_blocks, dst_blocks));
    }
    {
      std::lock_guard lock(mu_);
      if (xfers_.count(id) != 0) return AlreadyExists(fmt::format("transfer {} exists", id));
      // A block that another transfer may still write or report as loaded: two transfers into one block would
      // both verify their own bytes, and one of them would then read as loaded while holding the other's.
      if (dst_taken_.size() != blocks_.num_blocks()) dst_taken_.assign(blocks_.num_blocks(), 0);
      for (std::size_t i = 0; i < dst_blocks.size(); ++i)
        if (dst_taken_[dst_blocks[i]] != 0) {
          const TransferId owner = destination_owner(dst_blocks[i]);
          recycle_lane(std::move(lane));
          return FailedPrecondition(fmt::format(
              "destination block {} at index {} belongs to transfer {}, not forgotten yet: forget it (when final "
              "and reclaimable) before starting transfer {} into that block",
              dst_blocks[i], i, owner, id));
        }
      for (std::uint64_t b : dst_blocks) dst_taken_[b] = 1;
      X& x = xfers_[id];
      x.lane = std::move(lane);
      x.expected.resize(blocks_.layout().num_layers());
      x.lane_pending.assign(blocks_.layout().num_layers(), 0);
      x.lane_announced.assign(blocks_.layout().num_layers(), 0);
      x.lane_head.assign(blocks_.layout().num_layers(), 0);
      x.peer = prefill;
      x.peer_name = info->identity.name;
      x.mode = mode;
      x.dst = std::move(dst_blocks);
      x.layers.assign(blocks_.layout().num_layers(), LayerState::kPending);
      x.block_layer_ok.assign(x.dst.size() * x.layers.size(), 0);
      x.reads.resize(x.layers.size());
      x.last_heard = x.last_sent = x.times.started = Clock::now();
      // Counted as sent from here: a cancel() on another thread before the send below returns must not make the
      // blocks reclaimable (and forgettable) while the request is on its way to a prefill that will write them.
      x.request_sent = true;
      if (ring_lane()) {
        x.pieces_per_layer = static_cast<std::uint32_t>((x.dst.size() + ring_.per_slot - 1) / ring_.per_slot);
        x.pieces.assign(std::size_t{x.pieces_per_layer} * x.layers.size(), Piece{});
        x.ring_ready.assign(x.layers.size(), 0);
      }
    }
    // Taken before the send: the prefill may have the request before the send call returns.
    const Clock::time_point handed = Clock::now();
    Status s = t_.send_notification(prefill, m.str());
    {
      std::lock_guard lock(mu_);
      // Another thread may have cancelled and forgotten the transfer between the two locks: operator[] re-created
      // it empty (peer 0, no layers) and sent its 'F' to whichever peer had id 0.
      auto found = xfers_.find(id);
      if (found == xfers_.end()) return s;
      X& x = found->second;
      if (!s.ok()) {
        x.request_sent = false;  // the transport did not take it: no prefill knows these destinations
        fail_rest(x, s);
      } else {
        x.times.request = handed;
        // Slots are granted in order, after the request (the prefill ignores grants of transfers it does not know).
        for (std::size_t u = 0; u < x.pieces.size(); ++u) ring_waiting_.emplace_back(id, u);
        grant_ring();
      }
    }
    wake_progress();  // the transfer's lease and, on the ring lane, the copies just granted are the thread's to watch
    return Status::Ok();
  }

  Result<LayerState> wait_layer(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      if (layer >= it->second.layers.size())
        return OutOfRange(fmt::format("layer {} >= num_layers {}", layer, it->second.layers.size()));
      if (it->second.layers[layer] != LayerState::kPending) return it->second.layers[layer];
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("transfer {} layer {} not arrived after {} ms", id, layer,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  Result<DecodeStatus> status(TransferId id) const override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    return summarize(it->second, Clock::now());
  }

  Result<DecodeStatus> wait(TransferId id, std::chrono::nanoseconds timeout, bool reclaimable) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock lock(mu_);
    for (;;) {
      if (waits_aborted_) return waits_aborted(id);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      // The cheap test first: the progress thread wakes waiters at every tick, and a full summary walks every
      // (block, layer).
      const X& x = it->second;
      if (all_final(x) && (!reclaimable || is_reclaimable(x))) return summarize(x, Clock::now());
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return TimedOut(fmt::format("decode transfer {}: not {} after {} ms", id, reclaimable ? "reclaimable" : "final",
                                    std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }

  void abort_waits() override { abort_all_waits(); }

  Status disconnect_peer(PeerId peer) override {
    std::lock_guard lock(mu_);
    return disconnect_locked(peer, xfers_, [this](const X& x) { return !all_final(x); });
  }

  Status forget(TransferId id) override {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(id);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
    // The two flags alone: a full summary walks every (block, layer) of the transfer.
    if (!all_final(it->second) || !is_reclaimable(it->second))
      return FailedPrecondition(fmt::format("decode transfer {} is not final and reclaimable", id));
    // Slots granted to pieces that never came stay out of the ring until the prefill is quiet.
    for (const Piece& pc : it->second.pieces)
      if (pc.state == PieceState::kGranted) quarantined_.push_back(Quarantine{it->second.peer, id, pc.slot});
    for (std::uint64_t b : it->second.dst) dst_taken_[b] = 0;
    recycle_lane(std::move(it->second.lane));
    xfers_.erase(it);
    return Status::Ok();
  }

  Status cancel(TransferId id) override {
    {
      std::lock_guard lock(mu_);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", id));
      X& x = it->second;
      if (all_final(x)) return Status::Ok();
      fail_rest(x, Cancelled(fmt::format("transfer {} was cancelled by the decode side", id)));
      for (Read& r : x.reads)  // this side's reads into its blocks end too
        if (r.active) t_.abort(r.xfer).ignore_error();
    }
    wake_progress();  // its 'F' goes out from the progress thread
    return Status::Ok();
  }

 private:
  // The transfer whose destination list holds `block` (dst_taken_ says one does; under mu_). Only an error path
  // asks, so a scan is enough.
  TransferId destination_owner(std::uint64_t block) const {
    for (const auto& [id, x] : xfers_)
      if (std::find(x.dst.begin(), x.dst.end(), block) != x.dst.end()) return id;
    return 0;
  }

  struct Read {
    XferId xfer = 0;
    std::vector<std::uint64_t> ck;  // transport lane: from 'K', which may come before or after the read is done
    bool active = false;
    bool ck_known = false;
    bool landed = false;  // done: its blocks are being verified (a read done stays active until quiescent)
  };
  struct X {
    PeerId peer = 0;
    std::string peer_name;  // its agent name: only its messages apply to this transfer
    PdMode mode = PdMode::kPush;
    std::vector<std::uint64_t> dst;
    std::vector<LayerState> layers;
    std::vector<std::uint8_t> block_layer_ok;  // [layer * positions + position]: verified
    std::vector<Read> reads;
    Clock::time_point last_heard, last_sent;
    Beats beats;
    bool fin_sent = false;
    bool any_failure = false;
    bool prefill_quiet = false;  // 'Q': no write of the prefill side can still land
    bool request_sent = false;   // 'R' was handed to the transport: the prefill may know the destinations
    KeptStatus error;
    PdTimes times;
    // Device lane: buffers, and per layer the checksums announced by the prefill and whether the layer's
    // kernel (verification pass in push, read in pull) is still running.
    std::unique_ptr<LaneBuffers> lane;
    std::vector<std::vector<std::uint64_t>> expected;
    std::vector<std::uint8_t> lane_pending;
    std::vector<std::uint8_t> lane_announced;  // pull, this side verifying: announced, to be copied at the next tick
    std::vector<std::uint32_t> lane_head;      // the layer whose checksum slots its copy used
    // Ring lane: per piece ([layer * pieces_per_layer + piece]) its slot and state; per layer whether the prefill
    // said its data is ready ('Y').
    std::vector<Piece> pieces;
    std::uint32_t pieces_per_layer = 0;
    std::vector<std::uint8_t> ring_ready;
    // Transport lane: layers whose arrived blocks are being checksummed off the protocol thread.
    struct Verify {
      std::uint32_t layer = 0;
      std::vector<std::uint64_t> expected;
      bool expected_known = false;              // pull: false until the prefill's 'K'
      std::shared_ptr<ChecksumQueue::Job> job;  // null: hashed on the protocol thread, into `actual`
      std::vector<std::uint64_t> actual;
    };
    std::vector<Verify> verifying;
    // Host direct lane, pull: the prefill's pool as mapped here, and the layers this side is copying.
    std::optional<BlockSpace> direct_peer;
    struct Move {
      std::uint32_t layer = 0;
      std::shared_ptr<ChecksumQueue::Job> job;
    };
    std::vector<Move> moving;
  };

  bool busy() const override {
    for (const auto& [id, x] : xfers_) {
      // Checksum jobs and host direct copies wake this thread when they are done: no polling for them.
      for (std::uint8_t p : x.lane_pending)
        if (p != 0) return true;
      for (const Piece& pc : x.pieces)
        if (pc.state == PieceState::kCopying) return true;
      for (const Read& r : x.reads)
        if (r.active) return true;
    }
    return false;
  }

  bool all_final(const X& x) const {
    for (LayerState s : x.layers)
      if (s == LayerState::kPending) return false;
    return true;
  }

  DecodeStatus summarize(const X& x, Clock::time_point now) const {
    DecodeStatus s;
    s.layers = x.layers;
    s.final = all_final(x);
    s.error = x.error;
    s.times = x.times;
    const std::size_t n = x.dst.size();
    s.layer_block_loaded = x.block_layer_ok;
    s.block_loaded.assign(n, true);
    // A loaded layer has every block verified: only the others are walked block by block (a transfer's final
    // status was a walk over every (block, layer), 32,768 of them for 8 layers of 4,096 blocks, on the waiter's
    // path and under the endpoint's lock).
    for (std::size_t l = 0; l < x.layers.size(); ++l)
      if (x.layers[l] != LayerState::kLoaded)
        for (std::size_t i = 0; i < n; ++i)
          if (x.block_layer_ok[l * n + i] == 0) s.block_loaded[i] = false;
    (void)now;
    s.reclaimable = s.final && is_reclaimable(x);
    return s;
  }

  // Whether nothing can still land in the destination blocks (the transfer being final aside).
  bool is_reclaimable(const X& x) const {
    if (!x.verifying.empty()) return false;  // a checksum job still reads the blocks
    if (!x.moving.empty()) return false;     // a host direct copy still writes them
    for (const Read& r : x.reads)
      if (r.active) return false;
    for (std::uint8_t p : x.lane_pending)
      if (p != 0) return false;
    // Ring lane: only this side's kernels write the destinations (the prefill writes slots, never blocks).
    if (ring_lane()) {
      for (const Piece& pc : x.pieces)
        if (pc.state == PieceState::kCopying) return false;
      return true;
    }
    // After a failure in push mode a write of the prefill side may still land (a prefill paused past the lease
    // resumes with its writes posted): the blocks stay quarantined until the prefill proves its writes are done
    // ('Q') or the transport guarantees the peer can no longer write here. Time alone proves nothing. In pull mode
    // the prefill writes nothing here.
    return x.mode == PdMode::kPull || !x.any_failure || !x.request_sent || x.prefill_quiet || t_.peer_revoked(x.peer);
  }

  void fail_layer(X& x, std::uint32_t layer, const Status& why) {
    why.ignore_error();  // the transfer reports its first failure; later ones, and a final layer's, go here
    if (layer >= x.layers.size() || x.layers[layer] != LayerState::kPending) return;
    x.layers[layer] = LayerState::kFailed;
    x.any_failure = true;
    // Its pieces still waiting for a slot will not get one; granted slots wait for the prefill (finish_ring).
    for (std::uint32_t q = 0; q < x.pieces_per_layer; ++q) {
      Piece& pc = x.pieces[std::size_t{layer} * x.pieces_per_layer + q];
      if (pc.state == PieceState::kWaiting) pc.state = PieceState::kDropped;
    }
    std::fill_n(x.block_layer_ok.begin() + static_cast<std::ptrdiff_t>(std::size_t{layer} * x.dst.size()), x.dst.size(),
                std::uint8_t{0});
    if (x.error.ok()) x.error = why;
  }

  void fail_rest(X& x, const Status& why) {
    for (std::uint32_t l = 0; l < x.layers.size(); ++l) fail_layer(x, l, why);
  }

  // The layer's blocks have landed: hashes them (off the protocol thread when large) and compares the hashes with
  // the prefill's checksums `ck` once both are there. Pull on the transport lane may not know `ck` yet (`ck_known`
  // false): its 'K' comes later (expect_checksums).
  void verify_layer(TransferId id, X& x, std::uint32_t layer, std::vector<std::uint64_t> ck, bool ck_known) {
    if (x.layers[layer] != LayerState::kPending) return;
    if (ck_known && ck.size() != x.dst.size()) {
      compare_layer(id, x, layer, ck, nullptr);
      return;
    }
    X::Verify v{layer, std::move(ck), ck_known, submit_checksums(layer, x.dst), {}};
    if (v.job == nullptr) {
      v.actual.resize(x.dst.size());
      layer_checksums(layer, x.dst, v.actual.data());
    }
    x.verifying.push_back(std::move(v));
    finish_verifications(id, x);
  }

  // A layer's checksums from 'K' (pull, transport lane): kept for its read, or compared with its hashes.
  void expect_checksums(TransferId id, X& x, std::uint32_t layer, std::vector<std::uint64_t> ck) {
    if (x.layers[layer] != LayerState::kPending) return;
    if (ck.size() != x.dst.size()) {
      fail_layer(x, layer,
                 InvalidArgument(fmt::format("transfer {} layer {}: prefill sent {} checksums, decode has {} blocks",
                                             id, layer, ck.size(), x.dst.size())));
      return;
    }
    for (X::Verify& v : x.verifying)
      if (v.layer == layer && !v.expected_known) {
        v.expected = std::move(ck);
        v.expected_known = true;
        finish_verifications(id, x);
        return;
      }
    if (layer < x.reads.size()) {
      x.reads[layer].ck = std::move(ck);
      x.reads[layer].ck_known = true;
    }
  }

  // Layers whose hashes and expected checksums are both there are compared (a layer failed meanwhile stays failed;
  // its entry goes once its hashing has ended).
  void finish_verifications(TransferId id, X& x) {
    std::erase_if(x.verifying, [&](X::Verify& v) {
      if (v.job != nullptr && !v.job->done.load(std::memory_order_acquire)) return false;
      if (x.layers[v.layer] != LayerState::kPending) return true;
      if (!v.expected_known) return false;
      compare_layer(id, x, v.layer, v.expected, v.job != nullptr ? v.job->out.data() : v.actual.data());
      return true;
    });
  }

  // The layer's blocks against the checksums the prefill announced; `actual`: what arrived (x.dst.size()).
  void compare_layer(TransferId id, X& x, std::uint32_t layer, std::span<const std::uint64_t> ck,
                     const std::uint64_t* actual) {
    if (x.layers[layer] != LayerState::kPending) return;
    if (ck.size() != x.dst.size()) {
      fail_layer(x, layer,
                 DataLoss(fmt::format("transfer {} layer {}: {} checksums for {} blocks", id, layer, ck.size(),
                                      x.dst.size())));
      return;
    }
    std::size_t bad = 0;
    for (std::size_t i = 0; i < x.dst.size(); ++i) {
      const bool ok = actual[i] == ck[i];
      x.block_layer_ok[std::size_t{layer} * x.dst.size() + i] = ok ? 1 : 0;
      if (!ok) {
        ++bad;
        if (x.error.ok())
          x.error = DataLoss(
              fmt::format("transfer {} layer {} block {} (position {}): checksum mismatch", id, layer, x.dst[i], i));
      }
    }
    if (bad != 0) x.any_failure = true;
    x.layers[layer] = bad == 0 ? LayerState::kLoaded : bad == x.dst.size() ? LayerState::kFailed : LayerState::kPartial;
  }

  // The endpoint closes: transfers not final are failed (their prefills are told with 'F' and stop), and the close
  // waits, up to a lease, until nothing of any transfer can still land here (the prefill's 'Q', or its transport
  // revoked): the caller frees this side's blocks and ring after it. A prefill that does not answer in time is
  // disconnected, which stops its writes where the transport can (docs/transport.md, "Closing an endpoint").
  void before_stop() override {
    std::unique_lock lock(mu_);
    for (auto& [id, x] : xfers_)
      if (!all_final(x)) fail_rest(x, Cancelled(fmt::format("transfer {}: the decode endpoint was closed", id)));
    lock.unlock();
    wake_progress();
    lock.lock();
    wait_locked(lock, close_wait(), [&] {
      return std::all_of(xfers_.begin(), xfers_.end(),
                         [&](const auto& kv) { return kv.second.fin_sent && is_reclaimable(kv.second); });
    });
    std::set<PeerId> unsettled;
    for (auto& [id, x] : xfers_) {
      if (is_reclaimable(x)) continue;
      unsettled.insert(x.peer);
      for (Read& r : x.reads)  // this side's reads into its blocks: cancelled, then waited for below
        if (r.active) t_.abort(r.xfer).ignore_error();
    }
    lock.unlock();
    disconnect_unanswered(unsettled, "(a prefill) did not prove its writes over");
    if (unsettled.empty()) return;
    // The cancelled reads end within one copy's time (the progress thread sees them quiescent).
    lock.lock();
    wait_locked(lock, std::chrono::seconds(5), [&] {
      for (const auto& [id, x] : xfers_)
        for (const Read& r : x.reads)
          if (r.active) return false;
      return true;
    });
  }
  void on_message(const Notification& n, char type, TransferId id, Parse& p) override {
    auto it = xfers_.find(id);
    if (it == xfers_.end()) {
      auto peer = t_.find_peer(n.peer);
      if (!peer.ok()) return;
      if (type == 'Q') release_quarantined(*peer, id);
      // A prefill moving a transfer this side has forgotten (cancelled before the prefill began, then forgotten):
      // it is told the transfer ended, so it stops and its sources are released, rather than held until its lease
      // (a pull's sources stay held until the decode's word). Only messages that follow a request: a prefill may
      // begin (and heartbeat) before this side's start().
      if (type == 'A' || type == 'W' || type == 'K' || type == 'P' || type == 'Y')
        t_.send_notification(*peer, Msg('F', id).u8(0).str()).ignore_error();
      return;
    }
    X& x = it->second;
    if (x.peer_name != n.peer) return;  // another prefill's message for this id: never applied to this transfer
    std::uint32_t layer = 0;
    switch (type) {
      case 'H': heard_heartbeat(x.beats, p, x.last_heard); return;
      case 'Q': x.prefill_quiet = true; return;
      case 'Y':  // ring lane: the layer's data is ready on the prefill side; its pieces may have slots now
        if (x.ring_ready.empty() || !p.u32(layer) || layer >= x.ring_ready.size()) return;
        x.ring_ready[layer] = 1;
        grant_ring();
        return;
      case 'P': {
        std::uint32_t piece = 0, slot = 0;
        std::vector<std::uint64_t> ck;
        if (x.pieces.empty() || !p.u32(layer) || !p.u32(piece) || !p.u32(slot) || !p.u64s(ck) ||
            layer >= x.layers.size() || piece >= x.pieces_per_layer)
          return;
        on_piece(id, x, layer, piece, slot, std::move(ck));
        return;
      }
      case 'W': {
        std::vector<std::uint64_t> ck, landed;
        if (!p.u32(layer) || layer >= x.layers.size() || !p.u64s(ck)) return;
        // Device lane, the prefill verified: what its kernel moved against what it read back here. Host direct lane
        // likewise, what its copy read against what landed.
        const bool read_back = (x.lane && mover_verifies()) || host_direct();
        if (read_back && !p.u64s(landed)) {
          fail_layer(x, layer,
                     DataLoss(fmt::format("transfer {} layer {}: the prefill's write notification lacks the "
                                          "read-back checksums",
                                          id, layer)));
          return;
        }
        if (n.kind != NotifKind::kMessage) {
          fail_layer(
              x, layer,
              Unavailable(fmt::format("transfer {} layer {}: prefill's write {}", id, layer, notif_kind_name(n.kind))));
          return;
        }
        if (read_back) {
          std::uint32_t matched = 0;
          if (ck.empty() && landed.empty() && p.u32(matched)) {
            // The prefill's read-back matched every block: the count must be this transfer's.
            if (x.layers[layer] != LayerState::kPending) return;
            if (matched != x.dst.size()) {
              fail_layer(x, layer,
                         DataLoss(fmt::format("transfer {} layer {}: the prefill verified {} blocks of {}", id, layer,
                                              matched, x.dst.size())));
              return;
            }
            std::fill_n(x.block_layer_ok.begin() + static_cast<std::ptrdiff_t>(std::size_t{layer} * x.dst.size()),
                        x.dst.size(), std::uint8_t{1});
            x.layers[layer] = LayerState::kLoaded;
            return;
          }
          if (landed.size() != ck.size()) {
            if (x.layers[layer] == LayerState::kPending)
              fail_layer(x, layer,
                         DataLoss(fmt::format("transfer {} layer {}: {} checksums of what was read, {} of what landed",
                                              id, layer, ck.size(), landed.size())));
            return;
          }
          compare_layer(id, x, layer, ck, landed.data());
          return;
        }
        if (x.lane) {
          start_lane_layer(id, x, layer, std::move(ck), nullptr);
          return;
        }
        verify_layer(id, x, layer, std::move(ck), true);
        return;
      }
      case 'K': {
        std::vector<std::uint64_t> ck;
        if (!p.u32(layer) || layer >= x.layers.size() || !p.u64s(ck) || x.lane || host_direct()) return;
        expect_checksums(id, x, layer, std::move(ck));
        return;
      }
      case 'X':
        if (p.u32(layer)) {
          // The prefill's reason, when it sent one (printable ASCII only: it comes from the peer).
          std::string why;
          if (!p.str(why)) why.clear();
          for (char& c : why)
            if (c < 0x20 || c > 0x7e) c = '?';
          fail_layer(x, layer,
                     Unavailable(why.empty() ? fmt::format("transfer {} layer {}: prefill could not send it", id, layer)
                                             : fmt::format("transfer {} layer {}: prefill could not send it: {}", id,
                                                           layer, why)));
        }
        return;
      case 'A': {
        std::vector<std::uint64_t> src, ck, strides;
        if (!p.u32(layer) || layer >= x.layers.size() || !p.u64s(src) || !p.u64s(ck) || !p.u64s(strides)) return;
        // Device lane: a trailing count says "the source list of this transfer's first 'A'".
        std::uint32_t same_list = 0;
        const bool repeats_list = x.lane && src.empty() && strides.empty() && p.u32(same_list);
        // When this side verifies its own device lane copy the prefill sends no checksums.
        // The transport lane's come in 'K' (see the top of this file); the device lane's when the decode verifies.
        const std::size_t want_ck = x.lane && !mover_verifies() ? x.dst.size() : 0;
        const std::size_t announced = repeats_list ? same_list : src.size();
        if (announced != x.dst.size() || ck.size() != want_ck) {
          if (x.layers[layer] == LayerState::kPending && !x.reads[layer].active)
            fail_layer(x, layer,
                       InvalidArgument(fmt::format(
                           "transfer {} layer {}: prefill announced {} blocks and {} checksums, decode has {} blocks",
                           id, layer, announced, ck.size(), x.dst.size())));
          return;
        }
        if (x.lane && !repeats_list) {
          // Kept whatever this layer's state: later layers' announcements refer to it.
          Status s = take_source_list(x, src, strides);
          if (!s.ok()) {
            if (x.layers[layer] == LayerState::kPending)
              fail_layer(x, layer, s.with_context(fmt::format("transfer {} layer {}: device lane read", id, layer)));
            return;
          }
        }
        if (x.layers[layer] != LayerState::kPending || x.reads[layer].active) return;
        if (host_direct()) {
          start_direct_layer(id, x, layer, src, strides);
          return;
        }
        if (x.lane) {
          if (!x.lane->peer_list_known) {
            fail_layer(x, layer,
                       InvalidArgument(fmt::format("transfer {} layer {}: the prefill referred to a source list it "
                                                   "never sent",
                                                   id, layer)));
            return;
          }
          if (lane_groups_layers(mover_verifies())) {
            x.lane_announced[layer] = 1;  // copied with the others announced in this batch (start_lane_group)
            return;
          }
          start_lane_layer(id, x, layer, std::move(ck), &*x.lane->peer);
          return;
        }
        if (strides.size() != blocks_.layout().num_planes()) {
          fail_layer(x, layer,
                     InvalidArgument(fmt::format("transfer {} layer {}: prefill sent {} plane strides for {} planes",
                                                 id, layer, strides.size(), blocks_.layout().num_planes())));
          return;
        }
        std::vector<LocalDesc> ld;
        std::vector<RemoteDesc> rd;
        layer_descs(layer, x.dst, src, strides, ld, rd);
        auto posted = t_.post(XferOp::kRead, x.peer, ld, rd, Msg('D', id).u32(layer).str());
        if (!posted.ok()) {
          fail_layer(x, layer, posted.status());
          return;
        }
        mark_move(x.times, Clock::now());
        x.reads[layer].xfer = *posted;  // keeps the checksums of a 'K' that came first
        x.reads[layer].active = true;
        mark_posted(x.times);
        return;
      }
      default: return;
    }
  }

  // Host direct lane, pull: copies the announced layer out of the prefill's pool as mapped here (built from the
  // first 'A'), every source id checked against the prefill's registered regions first.
  void start_direct_layer(TransferId id, X& x, std::uint32_t layer, const std::vector<std::uint64_t>& src,
                          const std::vector<std::uint64_t>& strides) {
    for (const X::Move& mv : x.moving)
      if (mv.layer == layer) return;  // announced twice
    if (!x.direct_peer) {
      auto peer = peer_space(x.peer, strides);
      if (!peer.ok()) {
        fail_layer(x, layer,
                   peer.status().with_context(fmt::format("transfer {} layer {}: host direct read", id, layer)));
        return;
      }
      x.direct_peer = std::move(peer).value();
    }
    Status s = check_ids_in(*x.direct_peer, src, "source");
    if (!s.ok()) {
      fail_layer(x, layer, s.with_context(fmt::format("transfer {} layer {}: host direct read", id, layer)));
      return;
    }
    if (auto job = submit_move(*x.direct_peer, src, blocks_, x.dst, layer)) {
      x.moving.push_back({layer, std::move(job)});
      return;
    }
    std::vector<std::uint64_t> both(2 * x.dst.size());
    move_layer(*x.direct_peer, src, blocks_, x.dst, layer, both.data());
    finish_direct_layer(id, x, layer, both);
  }
  // The copy of `layer` is done: what it read against what landed, then the prefill's sources are free ('D').
  void finish_direct_layer(TransferId id, X& x, std::uint32_t layer, const std::vector<std::uint64_t>& both) {
    const std::size_t n = x.dst.size();
    compare_layer(id, x, layer, std::span<const std::uint64_t>(both.data(), n), both.data() + n);
    t_.send_notification(x.peer, Msg('D', id).u32(layer).str()).ignore_error();
  }
  void finish_direct_layers(TransferId id, X& x) {
    std::erase_if(x.moving, [&](X::Move& mv) {
      if (!mv.job->done.load(std::memory_order_acquire)) return false;
      finish_direct_layer(id, x, mv.layer, mv.job->out);
      return true;
    });
  }
  bool wait_direct_copies(PeerId peer) override {
    std::vector<std::shared_ptr<ChecksumQueue::Job>> jobs;
    for (const auto& [id, x] : xfers_)
      if (x.peer == peer)
        for (const X::Move& mv : x.moving) jobs.push_back(mv.job);
    return wait_jobs(jobs);
  }

  // Device lane, pull: the prefill's source list and strides from its first 'A' (the peer's pool mapped once).
  // A list other than the one the lane's copy was checked with is checked again.
  Status take_source_list(X& x, const std::vector<std::uint64_t>& src, const std::vector<std::uint64_t>& strides) {
    LaneBuffers& lb = *x.lane;
    lb.peer_list_known = false;
    if (!lb.peer) {
      KVTIER_ASSIGN_OR_RETURN(auto peer, peer_space(x.peer, strides));
      lb.peer = std::move(peer);
    }
    for (std::size_t i = 0; i < src.size(); ++i) {
      if (src[i] > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
        return OutOfRange(fmt::format("prefill block id {} does not fit the copy engine's 32-bit ids", src[i]));
      if (lb.peer_ids[i] != static_cast<BlockId>(src[i])) {
        lb.peer_ids[i] = static_cast<BlockId>(src[i]);
        lb.prepared.reset();
      }
    }
    lb.peer_list_known = true;
    return Status::Ok();
  }

  // Device lane: `from` null (push) checksums the layer's destinations in place; otherwise (pull) the layer is
  // copied from the prefill's pool `from` and checksummed by that copy. Compared in finish_lane_layers.
  // When this side verifies its own copy (pull, kMover) `ck` is empty: the copy's checksums are compared with a
  // read-back of the destinations.
  void start_lane_layer(TransferId id, X& x, std::uint32_t layer, std::vector<std::uint64_t> ck,
                        const BlockSpace* from) {
    if (x.layers[layer] != LayerState::kPending || x.lane_pending[layer] != 0) return;
    const bool read_back = from != nullptr && mover_verifies();
    if (!read_back && ck.size() != x.dst.size()) {
      compare_layer(id, x, layer, ck, nullptr);
      return;
    }
    LaneBuffers& lb = *x.lane;
    const std::uint32_t layers[1] = {layer};
    Status s;
    mark_move(x.times, Clock::now());
    if (from == nullptr) {
      s = options_.engine->checksum(blocks_, lb.local_ids, layers, kAllRoles, lb.device_at(layer), *lane_stream_)
              .status();
      if (s.ok()) s = finish_lane_layer(lb, layer);
    } else {
      const CopyRequest all{from, &blocks_, lb.peer_ids, lb.local_ids, {}, kAllRoles, CopyStrategy::kSmKernel};
      if (read_back) {
        s = copy_and_read_back(lb, layer, all, blocks_, lb.local_ids);
      } else {
        s = lane_copy_layer(lb, all, layer, lb.device_at(layer));
        if (s.ok()) s = finish_lane_layer(lb, layer);
      }
    }
    if (!s.ok()) {
      drain_lane();
      renew_failed_lane_streams();
      fail_layer(x, layer, s.with_context(fmt::format("transfer {} layer {}: device lane", id, layer)));
      return;
    }
    mark_posted(x.times);
    x.expected[layer] = std::move(ck);
    x.lane_pending[layer] = 1;
    x.lane_head[layer] = layer;
  }

  // Device lane, pull with this side verifying: the layers announced since the last tick go as one copy
  // (lane_groups_layers).
  void start_lane_group(TransferId id, X& x) {
    std::vector<std::uint32_t> group;
    for (std::uint32_t l = 0; l < x.lane_announced.size(); ++l) {
      if (x.lane_announced[l] == 0) continue;
      x.lane_announced[l] = 0;
      if (x.layers[l] == LayerState::kPending && x.lane_pending[l] == 0) group.push_back(l);
    }
    if (group.empty()) return;
    if (group.size() == 1) {
      start_lane_layer(id, x, group[0], {}, &*x.lane->peer);
      return;
    }
    LaneBuffers& lb = *x.lane;
    const CopyRequest all{&*lb.peer, &blocks_, lb.peer_ids, lb.local_ids, {}, kAllRoles, CopyStrategy::kSmKernel};
    mark_move(x.times, Clock::now());
    Status s = copy_group_and_read_back(lb, group, all);
    if (!s.ok()) {
      drain_lane();
      renew_failed_lane_streams();
      for (std::uint32_t l : group)
        fail_layer(x, l, s.with_context(fmt::format("transfer {} layer {}: device lane", id, l)));
      s.ignore_error();
      return;
    }
    mark_posted(x.times);
    for (std::uint32_t l : group) {
      x.expected[l].clear();
      x.lane_pending[l] = 1;
      x.lane_head[l] = group.front();
    }
  }

  void finish_lane_layers(TransferId id, X& x) {
    for (std::uint32_t l = 0; l < x.lane_pending.size(); ++l) {
      if (x.lane_pending[l] == 0) continue;
      auto done = lane_device().query(*x.lane->events[l]);
      if (done.ok() && !*done) continue;
      x.lane_pending[l] = 0;
      x.times.moved = Clock::now();
      if (!done.ok()) {
        renew_failed_lane_streams();
        fail_layer(x, l, done.status().with_context(fmt::format("transfer {} layer {}: device lane kernel", id, l)));
      } else if (x.mode == PdMode::kPull && mover_verifies()) {
        const std::uint32_t head = x.lane_head[l];  // a layer of a group compares the group's lists
        compare_layer(id, x, l, list_of(*x.lane, head, 0), x.lane->host_at(head, 1));
      } else {
        compare_layer(id, x, l, x.expected[l], x.lane->host_at(l));
      }
      // Pull: the prefill's sources of this layer are no longer read.
      if (x.mode == PdMode::kPull) t_.send_notification(x.peer, Msg('D', id).u32(l).str()).ignore_error();
    }
  }

  void tick(Clock::time_point now) override {
    if (ring_lane()) finish_ring(now);
    for (auto& [id, x] : xfers_) {
      finish_verifications(id, x);
      finish_direct_layers(id, x);
      if (x.lane && !ring_lane()) {
        start_lane_group(id, x);
        finish_lane_layers(id, x);
      }
      for (std::uint32_t l = 0; l < x.reads.size(); ++l) {
        Read& r = x.reads[l];
        if (!r.active) continue;
        auto st = t_.poll(r.xfer);
        if (!st.ok()) {
          r.active = false;
          continue;
        }
        if (st->state == XferState::kInProgress) continue;
        if (st->state == XferState::kDone) {
          if (!r.landed) {
            x.times.moved = Clock::now();
            verify_layer(id, x, l, std::move(r.ck), r.ck_known);
          }
          r.landed = true;
        } else {
          fail_layer(x, l, st->error);
        }
        if (st->quiescent) {
          t_.release(r.xfer).ignore_error();
          r.active = false;
        }
      }
      if (all_final(x)) {
        if (!x.fin_sent) {
          x.fin_sent = true;
          x.times.final = Clock::now();  // not `now`: this tick may have finished the layers after it
          const bool ok =
              std::all_of(x.layers.begin(), x.layers.end(), [](LayerState l) { return l == LayerState::kLoaded; });
          t_.send_notification(x.peer, Msg('F', id).u8(ok ? 1 : 0).str()).ignore_error();
        }
        continue;
      }
      if (now - x.last_heard > options_.lease && !bytes_moving(x.peer, now)) {
        fail_rest(x, Unavailable(fmt::format("transfer {}: prefill side silent for more than the lease ({} ms)", id,
                                             options_.lease.count())));
        // Reads from a silent prefill may never complete (a dead peer on a lane without failure detection, such
        // as UCX shared memory): cancel them, and drop the peer if it is silent everywhere, so that the blocks
        // they hold are released. Dropped after 'F' went out (the next tick): a prefill that is alive after all
        // (this side was the one paused, and the prefill gave up meanwhile) holds its pull sources until it hears
        // that no read of this side will come, and a disconnected peer gets nothing.
        for (Read& r : x.reads)
          if (r.active) t_.abort(r.xfer).ignore_error();
        drop_after_last_word(x.peer, now);
        continue;
      }
      if (now - x.last_sent >= options_.heartbeat) {
        t_.send_urgent_notification(x.peer, heartbeat(id, x.beats, now)).ignore_error();
        x.last_sent = now;
      }
    }
    drop_peers_due(xfers_, now, [](const X& x) { return !x.fin_sent; });
  }

  bool mover_verifies() const noexcept { return options_.lane_verify == PdOptions::LaneVerify::kMover; }

  // ---- ring lane ----

  Status after_planes(std::string_view role) override {
    if (!ring_lane()) return Status::Ok();
    KVTIER_ASSIGN_OR_RETURN(ring_, ring_geometry(options_.ring_slots, options_.ring_slot_bytes));
    auto mem = t_.allocate_shared(ring_.ring_bytes());
    if (!mem.ok())
      return mem.status().with_context(
          fmt::format("{}: ring of {} slots of {} bytes", role, ring_.slots, ring_.slot_bytes));
    if (mem->region != blocks_.layout().num_planes())
      return FailedPrecondition(fmt::format("{}: the ring got region {}, expected {}: the transport must be fresh",
                                            role, mem->region, blocks_.layout().num_planes()));
    KVTIER_ASSIGN_OR_RETURN(ring_registration_, register_ring(mem->data, ring_.ring_bytes()));
    KVTIER_ASSIGN_OR_RETURN(ring_spaces_, ring_slot_spaces(mem->data, ring_));
    for (std::uint32_t sl = 0; sl < ring_.slots; ++sl) free_slots_.push_back(sl);
    return Status::Ok();
  }

  // Grants free slots to the waiting pieces, in order.
  // Free slots go to waiting pieces in start order, among those whose layer the prefill has said is ready ('Y'): a
  // transfer whose forward has not reached a layer holds no slot that a ready transfer could use.
  void grant_ring() {
    for (auto w = ring_waiting_.begin(); w != ring_waiting_.end() && !free_slots_.empty();) {
      const auto [id, u] = *w;
      auto it = xfers_.find(id);
      if (it == xfers_.end() || it->second.pieces[u].state != PieceState::kWaiting) {
        w = ring_waiting_.erase(w);
        continue;
      }
      X& x = it->second;
      const auto layer = static_cast<std::uint32_t>(u / x.pieces_per_layer);
      const auto piece = static_cast<std::uint32_t>(u % x.pieces_per_layer);
      if (x.ring_ready[layer] == 0) {
        ++w;
        continue;
      }
      w = ring_waiting_.erase(w);
      const std::uint32_t slot = free_slots_.front();
      Status s = t_.send_notification(x.peer, Msg('G', id).u32(layer).u32(piece).u32(slot).str());
      if (!s.ok()) {  // the grant never left: the slot stays free
        fail_layer(x, layer, s.with_context(fmt::format("transfer {} layer {}: granting a ring slot", id, layer)));
        continue;
      }
      free_slots_.pop_front();
      x.pieces[u] = Piece{PieceState::kGranted, slot};
    }
  }

  // The prefill put a piece into its slot: scatter it into the destinations, checksumming what is read.
  void on_piece(TransferId id, X& x, std::uint32_t layer, std::uint32_t piece, std::uint32_t slot,
                std::vector<std::uint64_t> ck) {
    Piece& pc = x.pieces[std::size_t{layer} * x.pieces_per_layer + piece];
    if (pc.state != PieceState::kGranted || pc.slot != slot) {
      fail_layer(x, layer,
                 InvalidArgument(fmt::format("transfer {} layer {}: prefill filled slot {} for piece {}, which was not "
                                             "granted it",
                                             id, layer, slot, piece)));
      return;
    }
    const auto [a, b] = piece_range(piece, ring_.per_slot, x.dst.size());
    if (x.layers[layer] != LayerState::kPending) {  // failed meanwhile: the prefill's copy into the slot is over
      pc.state = PieceState::kDropped;
      free_slots_.push_back(slot);
      grant_ring();
      return;
    }
    if (ck.size() != b - a) {
      fail_layer(x, layer,
                 DataLoss(fmt::format("transfer {} layer {} piece {}: {} checksums for {} blocks", id, layer, piece,
                                      ck.size(), b - a)));
      pc.state = PieceState::kDropped;
      free_slots_.push_back(slot);
      grant_ring();
      return;
    }
    LaneBuffers& lb = *x.lane;
    const std::size_t u = std::size_t{layer} * x.pieces_per_layer + piece;
    auto done = piece_event(lb.pieces, u);
    Status s = done.status();
    if (s.ok())
      s = copy_piece(ring_spaces_[slot], std::span<const BlockId>(ring_ids_).first(b - a), blocks_,
                     std::span<const BlockId>(lb.local_ids).subspan(a, b - a), layer, false, lb.device_at(layer) + a,
                     lb.host_at(layer) + a, **done);
    if (!s.ok()) {
      drain_lane();
      renew_failed_lane_streams();
      pc.state = PieceState::kDropped;
      free_slots_.push_back(slot);
      fail_layer(x, layer, s.with_context(fmt::format("transfer {} layer {} piece {}: ring copy", id, layer, piece)));
      grant_ring();
      return;
    }
    auto& expected = x.expected[layer];
    if (expected.size() != x.dst.size()) expected.assign(x.dst.size(), 0);
    std::copy(ck.begin(), ck.end(), expected.begin() + static_cast<std::ptrdiff_t>(a));
    pc.state = PieceState::kCopying;
  }

  // Completed scatters: their blocks compared, their slots freed; a layer is final with its last piece. Slots of
  // pieces that never came return once the prefill is quiet or revoked.
  void finish_ring(Clock::time_point now) {
    (void)now;
    for (auto& [id, x] : xfers_) {
      const std::size_t n = x.dst.size();
      for (std::size_t u = 0; u < x.pieces.size(); ++u) {
        Piece& pc = x.pieces[u];
        const auto layer = static_cast<std::uint32_t>(u / x.pieces_per_layer);
        if (pc.state == PieceState::kGranted && all_final(x) && (x.prefill_quiet || t_.peer_revoked(x.peer))) {
          pc.state = PieceState::kDropped;
          free_slots_.push_back(pc.slot);
          continue;
        }
        if (pc.state != PieceState::kCopying) continue;
        auto done = lane_device().query(*x.lane->pieces[u]);
        if (done.ok() && !*done) continue;
        pc.state = PieceState::kDone;
        free_slots_.push_back(pc.slot);
        const auto [a, b] = piece_range(u % x.pieces_per_layer, ring_.per_slot, n);
        if (!done.ok()) {
          renew_failed_lane_streams();
          fail_layer(x, layer, done.status().with_context(fmt::format("transfer {} layer {}: ring copy", id, layer)));
          continue;
        }
        if (x.layers[layer] != LayerState::kPending) continue;
        const std::uint64_t* got = x.lane->host_at(layer);
        for (std::uint64_t i = a; i < b; ++i) {
          const bool ok = got[i] == x.expected[layer][i];
          x.block_layer_ok[std::size_t{layer} * n + i] = ok ? 1 : 0;
          if (!ok && x.error.ok())
            x.error = DataLoss(
                fmt::format("transfer {} layer {} block {} (position {}): checksum mismatch", id, layer, x.dst[i], i));
        }
        bool all = true;
        for (std::uint32_t q = 0; q < x.pieces_per_layer; ++q)
          all = all && x.pieces[std::size_t{layer} * x.pieces_per_layer + q].state == PieceState::kDone;
        if (!all) continue;
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i) bad += x.block_layer_ok[std::size_t{layer} * n + i] == 0 ? 1 : 0;
        if (bad != 0) x.any_failure = true;
        x.layers[layer] = bad == 0 ? LayerState::kLoaded : bad == n ? LayerState::kFailed : LayerState::kPartial;
      }
    }
    for (auto q = quarantined_.begin(); q != quarantined_.end();) {
      if (t_.peer_revoked(q->peer)) {
        free_slots_.push_back(q->slot);
        q = quarantined_.erase(q);
      } else {
        ++q;
      }
    }
    grant_ring();
  }

  void release_quarantined(PeerId peer, TransferId id) {
    for (auto q = quarantined_.begin(); q != quarantined_.end();) {
      if (q->id == id && q->peer == peer) {
        free_slots_.push_back(q->slot);
        q = quarantined_.erase(q);
      } else {
        ++q;
      }
    }
    grant_ring();
  }

  std::map<TransferId, X> xfers_;
  // Per block of this side's pool: 1 while a transfer not forgotten yet has it in its destination list.
  std::vector<std::uint8_t> dst_taken_;
  // Ring lane: the shared ring (the transport owns its memory), its slots and who may use them.
  RingGeometry ring_;
  std::unique_ptr<PinnedMemory> ring_registration_;
  std::vector<BlockSpace> ring_spaces_;
  std::deque<std::uint32_t> free_slots_;
  std::list<std::pair<TransferId, std::size_t>> ring_waiting_;  // pieces waiting for a slot, in start order
  struct Quarantine {
    PeerId peer = 0;
    TransferId id = 0;
    std::uint32_t slot = 0;
  };
  std::vector<Quarantine> quarantined_;  // slots of forgotten transfers the prefill may still write
};

}  // namespace

Result<std::unique_ptr<PdPrefill>> PdPrefill::create(Transport& transport, BlockSpace blocks, PdOptions options) {
  KVTIER_RETURN_IF_ERROR(check_timing("prefill", options));
  auto p = std::make_unique<Prefill>(transport, std::move(blocks), options);
  KVTIER_RETURN_IF_ERROR(p->init("prefill"));
  return std::unique_ptr<PdPrefill>(std::move(p));
}

Result<std::unique_ptr<PdDecode>> PdDecode::create(Transport& transport, BlockSpace blocks, PdOptions options) {
  KVTIER_RETURN_IF_ERROR(check_timing("decode", options));
  auto d = std::make_unique<Decode>(transport, std::move(blocks), options);
  KVTIER_RETURN_IF_ERROR(d->init("decode"));
  return std::unique_ptr<PdDecode>(std::move(d));
}

}  // namespace kvtier::transport
