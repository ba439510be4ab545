// TransferManager: moves KV blocks between one device's cache and its pinned
// host cache, overlapped with the engine's compute (FastDeploy's
// CacheTransferManager, with the data-plane protocol of docs/architecture.md).
//
// Streams. The caller's compute stream C; an input stream I (host->device
// loads, high priority by default) and an output stream O (device->host
// evictions), both created and owned by the manager. Every copy goes through
// CopyEngine::copy on I or O; nothing runs on C except the waits the caller
// asks for. No host synchronisation on any submit path: ordering is by events.
//
// Evict (device blocks d -> host blocks h, every layer and role):
//   record e_c on C (compute that wrote d was enqueued before the call);
//   O waits e_c, and the hazards of d (pending loads writing d) and of h
//   (pending loads reading h); copy on O; record e_o. d is busy until e_o; h
//   is written at e_o. Returns at once with a task id.
// Load (host blocks h -> device blocks d, layer by layer):
//   I waits the hazards of h (evictions writing h) and of d (evictions
//   reading d, compute accesses declared with record_device_access); per
//   layer L: copy L's roles on I, record e_L. The forward pass waits for
//   layer L on the GPU (wait_for_layer: a stream wait, usable in front of a
//   CUDA-graph launch) or on the host (wait_layer_host, with a timeout).
//
// Hazards (per block, per tier; see hazard_tracker.h): a load into d is
// ordered after earlier readers and writers of d; an eviction into h after
// every load still reading h; a device block reused by compute must first be
// fenced with wait_device_blocks_free(blocks, compute) or found free with
// is_device_block_free (the eviction reading it may still be running).
//
// Completion and failure. A progress thread queries the newest pending event
// of each stream (non-blocking) every `poll_interval` while work is pending.
// Every task has a state and a Status; each load layer is pending, done or
// failed. A layer is done only when its copy completed without error AND the
// bytes it read were valid (the eviction that wrote its host blocks, if still
// tracked, succeeded); otherwise it is failed and never reported done. A
// failed copy leaves its destination blocks invalid; failed_blocks(task) and
// poll_completions() list them. On CUDA a copy error is usually sticky, so
// every later event of that stream reports it too: all later tasks fail.
// GPU-side waits cannot carry errors: a forward that waited on a layer must
// check the load's status (poll_completions / wait) before trusting results.
//
// External writes (P/D receives). Bytes a peer writes into device blocks
// (a prefill instance's WRITEs, a copy out of a shared staging ring) are not
// copies of this manager, but get the same guards as its loads:
// begin_external_write(layers, blocks) declares them, and until the blocks
// are released (below) every load into them, eviction of them and
// wait_device_blocks_free on them is refused (FailedPrecondition naming the
// block and the task), a second declaration of them too, and
// is_device_block_free is false. begin_external_write first waits, on the
// host, until every earlier access to the blocks completed (the eviction
// that gave a block up may still be reading it: the peer cannot be ordered on
// the device), up to ExternalWriteOptions::free_timeout (TimedOut, nothing
// declared). The receiving side reports each layer with
// complete_external_layer(task, layer, failed_blocks, after): the layer's
// bytes landed in every block of the task but `failed_blocks`, or land with
// the work enqueued so far on `after` (null: they already have). A layer with
// failed blocks is failed (DataLoss naming them); the task's failed_blocks()
// lists every block of a failed layer it named (all the task's blocks for a
// layer ended without a report), and those bytes are invalid for later
// evictions (as a failed load's). The task is a layer-wise task like a load:
// wait_for_layer (it blocks the calling thread until the layer is reported,
// then enqueues the stream wait), wait_layer_host, wait, task_info,
// poll_completions and the on_layer / on_done callbacks work per layer as for
// loads (on_layer in report order). end_external_write(task, status,
// quiescent) fails every layer not yet reported with `status`; `quiescent`
// (no byte of the peer can still land: PdDecode's `reclaimable`) also
// releases the blocks, otherwise they stay declared, quarantined, until
// release_external_write(task), except, when every layer was reported, the
// blocks no report named failed: each (block, layer) is written once, so no
// late write targets a block that landed in every layer, and those are
// released at the end. shutdown() ends and releases every external write
// (Cancelled).
//
// Callbacks (LoadOptions::on_layer, on_done) run on the progress thread, in
// layer order per task, after the layer is final: status OK means the layer's
// bytes are on the device; an error status means the layer failed (the
// callback is still called exactly once per layer). Host waits (wait,
// wait_layer_host, wait_all) return only after the callbacks of what they
// waited for ran. Callbacks should be short and may call any query/submit
// method of the manager. A callback may host-wait for another task (or for a
// later layer of its own): the waiting callback then drives completion itself
// on the progress thread, so the wait ends when the copy does; a wait inside a
// callback returns once what it waits for is final, not after its callbacks.
// Callbacks of tasks that complete meanwhile run nested inside the waiting
// one, except those of a task that has a callback not yet returned (the
// waiting one, or one queued behind it): those run after it, in order, and
// host waits on other threads for that task return after them. A callback
// must not call shutdown() (FailedPrecondition) or destroy the manager.
//
// Submission (config.async_submit, default on). A submit call validates the
// request (ids, lengths, duplicates, the CopyEngine's checks), takes the
// submit lock, finds the hazards, notes the task's completion events in the
// hazard records and returns its id; a submission thread per stream (I, O)
// then enqueues the waits, copies and event records in acceptance order. An
// error while enqueuing (a device error) fails the task or layer: it is
// reported by wait / poll_completions / callbacks, not by the submit call.
// wait_for_layer blocks the calling thread until the layer's event is
// recorded (submission progress, not device work), then enqueues the stream
// wait; wait_device_blocks_free likewise. Hazards across the two threads are
// safe: a task only waits on events of tasks accepted before it, and each
// thread enqueues in acceptance order. With async_submit = false the calling
// thread enqueues everything before the submit returns.
//
// Thread-safety: every method may be called from any thread. Submissions are
// serialised internally (hazard lookup + note are one step), so the order of
// two concurrent submissions is the order they take the lock.
// Blocking: submit methods, record_device_access and the is_*_free queries
// never block on device work; wait_for_layer and wait_device_blocks_free may
// wait for submission (CPU) but never for device work (wait_for_layer on an
// external write waits until the layer is reported or the write ended);
// wait*, *_host, begin_external_write (earlier accesses to its blocks) and
// shutdown do. complete_external_layer, end_external_write and
// release_external_write never block.
//
// Lifetime: the Device, the compute stream, the streams passed to
// complete_external_layer and caller-owned cache memory must outlive
// shutdown(). shutdown() (also run by the destructor) stops new
// submissions, lets the submission threads enqueue every accepted task and joins them, drains I and O, processes the
// remaining completions (firing callbacks), joins the progress thread, and only then frees events, streams and
// kvtier-allocated host memory.
//
// Config knobs (TransferManagerConfig; bound to the config table as
// KVTIER_TRANSFER_* by transfer_config.h, listed in docs/configuration.md):
//   evict_strategy / load_strategy   kAuto      CopyEngine strategy per direction
//                                               (the engine's kAuto without SM kernels, see copy_engine)
//   copy_engine                      256 slots  options of the manager's own CopyEngine
//   input_priority / output_priority kHigh/kNormal  stream priorities
//   poll_interval                    50 us      progress-thread poll period while work is pending (at most 100 ms)
//   max_in_flight_tasks              4096       submits beyond -> ResourceExhausted (back off)
//   retained_finished_tasks          4096       finished tasks kept queryable by id
//   max_unpolled_completions         65536      completions kept for poll_completions (oldest dropped)
//   latency_samples                  8192       ring of per-layer load latencies (p50/p99)
//   shutdown_timeout                 60 s       per-stream drain limit in shutdown()
//   event_pool_max_free              4096       returned events kept for reuse
//   host_ready_timeout               600 s      wait for kvtier-allocated pinned memory at create
//   async_submit                     true       enqueue on submission threads (see Submission)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/transfer/registration.h"

namespace kvtier {

using TaskId = std::uint64_t;

enum class TaskKind : std::uint8_t { kEvict, kLoad, kExternalWrite };
std::string_view task_kind_name(TaskKind kind) noexcept;
enum class TaskState : std::uint8_t { kPending, kDone, kFailed };
std::string_view task_state_name(TaskState state) noexcept;
using LayerState = TaskState;

struct TransferManagerConfig {
  CopyStrategy evict_strategy = CopyStrategy::kAuto;
  CopyStrategy load_strategy = CopyStrategy::kAuto;
  // descriptor_slots raised from the engine default (8): a 32..80-layer load
  // issues one kernel per layer, and a wrapped ring would block the submit.
  // kAuto keeps the SMs out (auto_kernel_max_* = 0): transfers overlap the
  // forward pass, and on the H200 an SM copy kernel next to a compute kernel
  // waits for SMs (layer-wise overlap 70 ms vs 49 ms bound, GEMM slowed 46%),
  // while the copy engines do not contend with compute (docs/performance.md).
  CopyEngineOptions copy_engine = [] {
    CopyEngineOptions o;
    o.descriptor_slots = 256;
    o.auto_kernel_max_segment_bytes_h2d = 0;
    o.auto_kernel_max_segment_bytes_d2h = 0;
    return o;
  }();
  StreamPriority input_priority = StreamPriority::kHigh;
  StreamPriority output_priority = StreamPriority::kNormal;
  std::chrono::microseconds poll_interval{50};
  std::size_t max_in_flight_tasks = 4096;
  std::size_t retained_finished_tasks = 4096;
  std::size_t max_unpolled_completions = 65536;
  std::size_t latency_samples = 8192;
  std::chrono::milliseconds shutdown_timeout{60000};
  std::size_t event_pool_max_free = 4096;
  std::chrono::milliseconds host_ready_timeout{600000};
  // true: submit methods validate, find hazards and return; two submission
  // threads (one per stream) enqueue the copies, so a 32-layer load returns
  // in microseconds and the caller can enqueue layer 0's compute at once
  // (enqueueing thousands of DMA descriptors costs ~0.5 us each). false:
  // the calling thread enqueues everything before the submit returns.
  bool async_submit = true;
};

// InvalidArgument naming the first bad field: max_in_flight_tasks,
// retained_finished_tasks and max_unpolled_completions >= 1, latency_samples
// in [1, 2^20] (allocated at create), poll_interval,
// shutdown_timeout and host_ready_timeout > 0, strategies and priorities in
// range. TransferManager::create runs it.
Status validate_transfer_config(const TransferManagerConfig& config);

// layer: the model layer index; status: OK = the layer's bytes are on the device.
using LayerCallback = std::function<void(std::uint32_t layer, const Status& status)>;
using TaskCallback = std::function<void(TaskId task, const Status& status)>;

struct EvictOptions {
  // Stream whose enqueued work wrote the blocks; nullptr = the compute stream.
  Stream* after = nullptr;
  TaskCallback on_done;
  // Where the task's completion is listed: poll_completions(completion_queue); 0 is poll_completions()'s.
  std::uint32_t completion_queue = 0;
};

struct LoadOptions {
  LayerCallback on_layer;
  TaskCallback on_done;
  std::uint32_t completion_queue = 0;  // as EvictOptions
};

struct ExternalWriteOptions {
  // As LoadOptions: per reported layer (status OK = the layer's bytes landed in every block), and at the end.
  LayerCallback on_layer;
  TaskCallback on_done;
  // How long begin_external_write waits on the host for earlier accesses to the blocks to complete.
  std::chrono::nanoseconds free_timeout = std::chrono::seconds(60);
  std::uint32_t completion_queue = 0;  // as EvictOptions
};

struct FailedBlocks {
  std::vector<BlockId> device;  // device blocks whose bytes are invalid
  std::vector<BlockId> host;    // host blocks whose bytes are invalid
};

struct TaskCompletion {
  TaskId id = 0;
  TaskKind kind = TaskKind::kEvict;
  KeptStatus status;  // OK, or the first failure
  FailedBlocks failed;
  std::uint64_t bytes = 0;
};

struct TaskInfo {
  TaskKind kind = TaskKind::kEvict;
  TaskState state = TaskState::kPending;
  KeptStatus status;
  std::vector<std::uint32_t> layers;     // loads: in submission order
  std::vector<LayerState> layer_states;  // parallel to layers
  std::uint64_t bytes = 0;
};

struct DirectionStats {
  std::uint64_t tasks_submitted = 0;
  std::uint64_t tasks_done = 0;
  std::uint64_t tasks_failed = 0;
  std::uint64_t bytes_submitted = 0;
  std::uint64_t bytes_done = 0;     // bytes of tasks that completed successfully
  std::uint64_t blocks_done = 0;    // block pairs of tasks that completed successfully
  std::uint64_t blocks_failed = 0;  // destination blocks reported failed (FailedBlocks)
  // Wall time during which at least one task of this direction was in
  // flight (submit to observed completion), and bytes_done / busy_seconds.
  double busy_seconds = 0;
  double gbps = 0;
  std::uint64_t in_flight = 0;      // queue depth now
  std::uint64_t max_in_flight = 0;  // high-water mark
};

struct TransferStats {
  // What get_stats() of FastDeploy's CacheTransferManager gives.
  std::uint32_t num_layers = 0;
  std::uint32_t num_draft_layers = 0;
  int device_ordinal = 0;
  std::string device_name;
  std::uint64_t num_device_blocks = 0;
  std::uint64_t num_host_blocks = 0;
  std::uint64_t block_bytes = 0;  // all layers and roles of one block
  bool has_scales = false;
  bool has_indexer = false;
  bool is_mla = false;
  // Plus.
  DirectionStats evict;
  DirectionStats load;
  DirectionStats external;  // external writes (P/D receives): blocks_done counts blocks of tasks that succeeded
  std::uint64_t layers_done = 0;
  std::uint64_t layers_failed = 0;
  // Submit -> layer observed final, over the last latency_samples layers.
  double layer_latency_p50_us = 0;
  double layer_latency_p99_us = 0;
  std::uint64_t latency_samples = 0;
  std::uint64_t events_created = 0;
  std::string to_json() const;
};

class TransferManager {
 public:
  // Validates the registration (layout, device ordinal, memory kinds, block
  // counts), allocates host memory when asked, creates I, O, the event pool,
  // a CopyEngine (or uses `engine` when non-null; it must belong to `device`
  // and outlive the manager) and the progress thread.
  static Result<std::unique_ptr<TransferManager>> create(Device& device, Stream& compute,
                                                         KvCacheRegistration registration,
                                                         const TransferManagerConfig& config = {},
                                                         CopyEngine* engine = nullptr);
  virtual ~TransferManager() = default;

  // ---- submit (never blocks on device work) ----
  // device_blocks[i] -> host_blocks[i], every layer and role. Validation
  // errors (lengths, ids, duplicate host destinations) return before anything
  // is enqueued.
  virtual Result<TaskId> evict_to_host_async(std::span<const BlockId> device_blocks,
                                             std::span<const BlockId> host_blocks,
                                             const EvictOptions& options = {}) = 0;
  // host_blocks[i] -> device_blocks[i], the given layers in the given order
  // (empty: every layer in order), every role of each layer.
  virtual Result<TaskId> load_layers_to_device_async(std::span<const std::uint32_t> layers,
                                                     std::span<const BlockId> host_blocks,
                                                     std::span<const BlockId> device_blocks,
                                                     LoadOptions options = {}) = 0;
  // Declares that work enqueued so far on `stream` accesses the device
  // blocks; later loads into them are ordered after it (and evictions of
  // them, for writes). kOverwrite also clears the blocks' failure history (a
  // prefill that rewrote every layer of every token makes them valid again);
  // kWrite keeps it (appending tokens to a block whose load failed does not
  // repair the older tokens). kOverwrite of a block an external write still
  // declares is FailedPrecondition (the peer may write it after the overwrite).
  enum class DeviceAccess : std::uint8_t { kRead, kWrite, kOverwrite };
  virtual Status record_device_access(std::span<const BlockId> device_blocks, Stream& stream, DeviceAccess access) = 0;

  // ---- external writes (see "External writes") ----
  // Declares that something outside this manager writes `layers` (empty: every layer) of `device_blocks`.
  // Validation as for loads (ids, duplicates, layers); FailedPrecondition when a block is already declared;
  // TimedOut when earlier accesses did not complete within options.free_timeout (nothing stays declared).
  virtual Result<TaskId> begin_external_write(std::span<const std::uint32_t> layers,
                                              std::span<const BlockId> device_blocks,
                                              ExternalWriteOptions options = {}) = 0;
  // Layer `layer` of external write `task` is final: landed in every block but `failed_blocks` (blocks of the
  // task), once the work enqueued so far on `after` completed (null: landed already). NotFound (task),
  // InvalidArgument (a layer or block not of the task), FailedPrecondition (layer already reported, task ended).
  virtual Status complete_external_layer(TaskId task, std::uint32_t layer, std::span<const BlockId> failed_blocks = {},
                                         Stream* after = nullptr) = 0;
  // Ends the external write: every layer not reported yet fails with `status` (InvalidArgument when one is
  // left and `status` is OK). `quiescent`: no byte can land any more: the blocks are released now; otherwise
  // they stay declared until release_external_write (all of them if a layer was not reported, else the
  // blocks a report named failed). FailedPrecondition when already ended.
  virtual Status end_external_write(TaskId task, const Status& status, bool quiescent) = 0;
  // The peer of an ended external write can no longer write its blocks: they are released (loads, evictions
  // and reuse allowed again). FailedPrecondition when not ended; NotFound when unknown or already released.
  virtual Status release_external_write(TaskId task) = 0;

  // ---- layer waits ----
  // `stream` waits on the device for layer `layer` of load (or external write)
  // `task`. OK at once when the layer is already done; the layer's error when
  // it is known failed; InvalidArgument when the task does not load that layer.
  virtual Status wait_for_layer(TaskId task, std::uint32_t layer, Stream& stream) = 0;
  // Blocks until the layer is final: OK, its failure, or TimedOut.
  virtual Status wait_layer_host(TaskId task, std::uint32_t layer, std::chrono::nanoseconds timeout) = 0;

  // ---- tasks ----
  // Blocks until the task is final; returns its status (or TimedOut).
  virtual Status wait(TaskId task, std::chrono::nanoseconds timeout) = 0;
  // Blocks until every task submitted before the call is final (OK), or TimedOut.
  virtual Status wait_all(std::chrono::nanoseconds timeout) = 0;
  // NotFound once the task was dropped from the retained set; FailedPrecondition after shutdown() (which forgets
  // every task).
  virtual Result<TaskInfo> task_info(TaskId task) const = 0;
  virtual Result<FailedBlocks> failed_blocks(TaskId task) const = 0;
  // Tasks that became final since the last call, in completion order: those submitted with completion_queue 0.
  virtual std::vector<TaskCompletion> poll_completions() = 0;
  // A completion queue of the caller's own (at most 1,024 open at once per manager: ResourceExhausted past). A
  // component that shares the manager with the engine (the cache's plan executor of a PdReceiver) submits with it
  // and polls it, so that neither consumes the other's completions (a completion taken by the wrong consumer was
  // lost: a cache move never acked, an engine's load never seen).
  virtual Result<std::uint32_t> open_completion_queue() = 0;
  // Those of `queue` (empty for a queue not open).
  virtual std::vector<TaskCompletion> poll_completions(std::uint32_t queue) = 0;
  // Gives a queue back (its id may be opened again): its completions, and those of its tasks still in flight,
  // are dropped. InvalidArgument for queue 0 or one not open.
  virtual Status close_completion_queue(std::uint32_t queue) = 0;

  // ---- blocks ----
  // True when no eviction, load, external write or declared access of the block is pending.
  virtual Result<bool> is_device_block_free(BlockId block) = 0;
  virtual Result<bool> is_host_block_free(BlockId block) = 0;
  // `stream` waits (on the device) until the blocks are free to overwrite. FailedPrecondition for a block
  // declared by an external write (its end is a peer's, not a device point); InvalidArgument for a stream of
  // another Device.
  virtual Status wait_device_blocks_free(std::span<const BlockId> blocks, Stream& stream) = 0;
  // The calling thread waits until the host blocks are free (e.g. before a
  // storage read overwrites them with the CPU), or TimedOut.
  virtual Status wait_host_blocks_free(std::span<const BlockId> blocks, std::chrono::nanoseconds timeout) = 0;

  // ---- introspection ----
  virtual TransferStats stats() const = 0;
  virtual const BlockSpace& device_space() const noexcept = 0;
  virtual const BlockSpace& host_space() const noexcept = 0;
  virtual Stream& input_stream() noexcept = 0;
  virtual Stream& output_stream() noexcept = 0;
  virtual Stream& compute_stream() noexcept = 0;
  virtual Device& device() const noexcept = 0;
  virtual const TransferManagerConfig& config() const noexcept = 0;

  // ---- metrics ----
  // Exports this manager into `registry` (metrics/registry.h), every series
  // carrying `labels` (e.g. {{"rank","0"}}), with direction = evict | load |
  // external:
  //   kvtier_transfer_tasks_total{direction,outcome=ok|failed}
  //   kvtier_transfer_bytes_total{direction}, kvtier_transfer_blocks_total{direction}  (completed OK)
  //   kvtier_transfer_failed_blocks_total{direction}
  //   kvtier_transfer_layers_total{outcome}                 (load and external layers final)
  //   kvtier_transfer_in_flight_tasks{direction}            (gauge)
  //   kvtier_transfer_task_latency_seconds{direction}       (submit -> task final)
  //   kvtier_transfer_layer_latency_seconds                 (submit -> load layer final)
  // Latencies are observed on the progress thread as tasks settle (lock-free
  // atomics); the counters and gauges are refreshed from stats() when the
  // registry is scraped, so the hot path pays only for the histograms.
  // Managers attached with the same labels add up. The registry must outlive
  // the manager. FailedPrecondition when already attached; InvalidArgument
  // for bad label names (or a family registered elsewhere with other labels).
  virtual Status attach_metrics(metrics::Registry& registry, const metrics::Labels& labels = {}) = 0;

  // Idempotent: a call while another is draining returns when that one is
  // complete, with its status. After it, submits return FailedPrecondition.
  // Returns the first drain error (e.g. TimedOut when a stream did not
  // drain). FailedPrecondition from a callback.
  virtual Status shutdown() = 0;

 protected:
  TransferManager() = default;
};

}  // namespace kvtier
