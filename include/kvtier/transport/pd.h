// Prefill/decode KV transfer on top of a Transport: layer by layer, checksummed, with leases.
//
// Roles. A prefill instance holds a prompt's KV in its blocks; a decode instance continues from it in its own
// blocks. Both sides know the transfer id (the router gives it to both) and their own block ids; the decode
// side starts the transfer by telling the prefill side its destination blocks and the mode:
//   - push: the prefill side WRITEs layer L into the decode blocks as soon as layer L is ready (its event has
//     fired), with a notification carrying the layer's per-block checksums;
//   - pull: the prefill side announces layer L (its source blocks) once it is ready and sends the layer's
//     checksums once computed (the decode side's read runs meanwhile); the decode side READs it, and the read's
//     notification tells the prefill side that layer's source is free.
// A layer that becomes ready before the decode side's request arrives waits for it. A layer whose readiness
// reports an error (its event failed) fails the transfer: the prefill side tells the decode side that this
// layer and every layer not yet sent will not come ('X'), so their blocks are failed there at once. The
// decode side verifies every (block, layer) against its checksum (xxh3-64 over the block's roles of that layer,
// in role order: the checksum of kvtier's storage object format) before it reports the layer loaded; a block
// of a layer that fails (mismatch, failed or aborted write, the peer's failure notice, a lease that expired)
// is failed, never loaded.
// A block is loaded when every layer of it is; leading_loaded_blocks() is what may be committed to a prefix
// index (CacheManager::commit), the rest is recomputed.
//
// Leases. Each side sends a heartbeat per active transfer every `heartbeat`, echoing the latest heartbeat number
// it received; an echo renews the lease to the time the echoed heartbeat was sent (a heartbeat processed late
// never extends the lease of a peer that died since). A side that hears nothing from the other for `lease` fails
// the transfer (every layer not yet final), aborts its own requests of it and, when the peer is silent on every
// transfer, disconnects it (Transport::disconnect_peer), so requests that would never complete against a dead peer
// release their blocks. The decode side's blocks are reclaimable (may return to their pool) when the transfer is
// final and no byte can still land in them: after success; in pull mode once its own reads are quiescent; after a
// failure in push mode only once the prefill side confirmed that its writes are quiescent, or the transport
// guarantees the prefill can no longer write (Transport::peer_revoked). Time alone proves nothing (a prefill
// paused past the lease resumes with its writes posted); on UCX a live but silent prefill keeps them quarantined.
// The prefill side's source blocks are reclaimable once the transfer is final, its writes are quiescent and it has
// told the decode side so.
//
// Memory. Each side's blocks are one BlockSpace in memory the transport can reach (pinned host; the host
// backend's device memory). Each endpoint registers one region per (layer, role) plane, in that order, as the
// first regions of its transport, and owns the transport's notification stream (nothing else may take them).
// KV in device memory the transport cannot reach (CUDA memory with Debian's UCX) goes through the staged
// endpoints of pd_staged.h, which run this protocol between pinned host staging spaces and move each layer
// between device and staging with the CopyEngine.
//
// Device lane (PdOptions::engine). When both sides' pools are device memory that this process's device can
// address directly in the peer (Transport::peer_region_address: the ipc backend between CUDA processes, which
// maps the peer's pool through CUDA IPC; the loopback backend in one process), layers bypass the transport's
// data path: push, the prefill's copy kernel writes the layer's scattered blocks straight into the decode's
// pool, one launch per layer; pull, the decode's kernel reads them out of the prefill's pool likewise. The
// transport carries only the messages. Checksums are the copy engine's block_checksum() (copy_engine.h), not
// xxh3: the side that moves the layer gets them from the moving kernel itself (every word read once); the
// host only compares 8 bytes per block. What they are compared with is PdOptions::lane_verify (the decode
// side's choice, carried in its request):
//   kMover: the moving side reads the layer's destinations back, inside its copy kernel (each warp reads back
//     what it wrote one work item earlier, from L2) or in a read-only pass on a second stream of its own
//     (PdOptions::lane_read_back_in_copy), and the moved words are compared with what landed. All GPU work
//     of a transfer runs in one CUDA context, so two processes sharing a GPU do not alternate contexts per layer.
//     It proves every block landed intact; it does not notice a source the prefill changes after the copy.
//   kReceiver: the other side makes the second pass over its own blocks: the prefill's sources before it
//     announces them in pull (so a source changed between that pass and the decode's copy is caught), the
//     decode's destinations in push. One pass in each process's context.
// When the mover verifies with the read-back inside its copy (the default), the layers that are ready at one moment
// go as one copy (pull: the layers announced in one batch of messages; push: the layers ready when the request
// arrives, or declared together with layers_ready()): each launch costs the CPU about as much as a large layer of
// small blocks costs the GPU. A block's
// checksums are then its sums over the group's layers, so a block that fails verification fails in every layer of
// its group. A layer's notification goes out once the kernels' event has completed (its bytes are then visible to the
// peer's later work). Both endpoints of a transfer must use the same lane: the decode side's request names
// it, and a prefill on the other lane fails the transfer (every layer 'X', kFailedPrecondition). Kernels
// cannot be cancelled: a side whose lease expires waits for its launched kernels (they are short) before its
// writes count as quiescent. A peer that holds a direct mapping can write at any time, so after a failed push
// the decode's blocks are reclaimable only once the prefill proved its writes are over ('Q') or the transport
// reports it revoked (the ipc backend: the prefill's process has exited).
//
// Ring lane (PdOptions::ring_slots > 0, with `engine`): for device pools that cannot map each other (two GPUs
// without peer access, containers that forbid CUDA IPC). The decode side owns a ring of ring_slots slots of pinned
// host memory that both processes map (Transport::allocate_shared: a sealed memfd on the ipc backend, registered
// with each side's device). A slot holds up to ring_slot_bytes of one layer: blocks [a, b) of the transfer's list,
// every role (a layer larger than a slot goes as several pieces). The decode side grants slots to the pieces of
// its transfers in order ('G'); the prefill's copy kernel gathers a granted piece from its pool into the slot once
// the piece's layer is ready (device to host) and announces it with the checksums that kernel computed ('P'); the
// decode's kernel scatters the slot into the destination blocks (host to device), checksumming what it reads in
// the same pass (PdOptions::ring_copy: or copies by DMA and checksums its device side in a pass over device
// memory), and frees the slot for the next piece. So D2H of one piece overlaps H2D of another, ring_slots deep,
// with integrity checked end to end (what left the prefill's pool is what reached the decode's). The prefill never
// addresses the decode's blocks: after any failure they are reclaimable once the decode's own kernels are done; only
// slots granted to pieces that never arrived wait for the prefill's quiescence ('Q', or the transport's peer_revoked),
// and stay out of the ring until then (fail closed). Push and pull move the same way on this lane. Both sides set
// ring_slots (the decode's geometry is used and sent in its request); a prefill without it refuses the transfer as on
// the device lane.
//
// Host direct lane (PdOptions::host_direct, no engine): for host pools on one machine that the other process maps
// (Transport::peer_region_address: memory from allocate_host on UCX's shared-memory transports, allocate_shared on
// the ipc backend, one process on loopback). Instead of the transport's copy plus a checksum pass on each side, the
// moving side (the prefill in push, the decode in pull) copies each layer's blocks itself on its checksum worker and
// helpers, taking the xxh3 checksum of what it read and of what landed chunk by chunk while both are in cache, and
// compares them: every byte is read and written once and hashed from cache twice. A push's 'W' then carries only
// the count of blocks that matched (or both lists when some did not), and the decode trusts that read-back as it
// trusts the device lane's kMover; a pull's 'A' carries the source list and strides and no checksums, and the decode
// reads back its own copy. As on the device lane this proves every block landed intact, not that the prefill's
// source did not change after the copy read it. Block ids are checked against the peer's registered regions before
// any byte moves (the mapping may reach further). A copy cannot be cancelled: a side whose lease expires waits for
// its copies to end before it disconnects the peer (which unmaps its memory here), and after a failed push the
// decode's blocks stay quarantined until 'Q' or the transport's peer_revoked, as on the device lane.
//
// Thread-safety: every method may be called from any thread; a progress thread per endpoint handles messages,
// layer readiness, heartbeats and leases. Every wait has a deadline. Errors: kInvalidArgument / kOutOfRange
// (block ids, layers), kNotFound (transfer), kAlreadyExists (transfer id reused), kFailedPrecondition (memory
// not reachable, transport not fresh), kTimedOut.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvtier/backend/transport.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier::transport {

using TransferId = std::uint64_t;

enum class PdMode : std::uint8_t { kPush, kPull };
std::string_view pd_mode_name(PdMode mode) noexcept;

enum class LayerState : std::uint8_t {
  kPending,  // not arrived
  kLoaded,   // every block of the layer arrived and matched its checksum
  kPartial,  // final: some blocks matched, others failed (see BlockState)
  kFailed,   // final: no block of the layer is usable
};
std::string_view layer_state_name(LayerState state) noexcept;

struct PdOptions {
  std::chrono::milliseconds heartbeat{100};
  std::chrono::milliseconds lease{1000};
  // Prefill: how long a transfer begun before its decode's start() waits for the decode's request (> 0). The lease
  // does not apply until the request has come (the decode does not know the transfer before its start(), so it is
  // not silent about it); past this wait the transfer fails with kTimedOut, nothing written, its sources
  // reclaimable, the decode peer left connected.
  std::chrono::milliseconds request_wait{60000};
  // The layout fingerprint the transport's identity carries (and load_peer compares): 0, the blocks' own
  // KvLayout::fingerprint(); otherwise one that covers it and more that both sides must agree on, which a caller
  // that knows more than the layout adds (kvtier.pd: each tensor's per-block shape and the tensor-parallel rank).
  std::uint64_t pairing_fingerprint = 0;
  // How long the progress thread sleeps while no transfer needs polling (1 us up to `heartbeat`). A message, or a
  // call of this endpoint that gives the thread work (begin, layer_ready, start), wakes it at once; the period
  // bounds how late heartbeats are sent and leases checked, and how often an idle endpoint wakes up.
  std::chrono::microseconds idle_wait{1000};
  // How long the progress thread waits between looks while a transfer needs polling (a device lane kernel's
  // event, a layer's readiness; at most `idle_wait`): what it can add to the moment a completion is seen. 0: it
  // does not sleep but yields between looks (a core busy while such work is pending, for the lowest latency).
  std::chrono::microseconds busy_wait{20};
  // The device lane (see "Device lane" above): blocks in device memory of engine->device(), moved by its SM
  // kernel straight between the two pools. Null: the transport lane. Must outlive the endpoint. Create it with
  // lane_engine_options() (below), so that the progress thread does not wait for descriptor slots.
  CopyEngine* engine = nullptr;
  // The device lane's second checksum pass (see "Device lane" above); the decode side's value is used.
  enum class LaneVerify : std::uint8_t { kMover, kReceiver };
  LaneVerify lane_verify = LaneVerify::kMover;
  // How this side reads back a layer it moved when the mover verifies (each side's own choice). true: inside the
  // copy kernel (CopyRequest::landed_checksums: each warp reads back the item it wrote before, from L2), which
  // then runs CopyEngineOptions::sm_ctas_landed CTAs (one per SM by default). false: a read-only pass over the
  // destinations on a second stream behind the copy, which keeps sm_ctas_d2d CTAs but reads every byte from
  // memory a third time. On an H200 (bench/gpu/readback_probe.cu, 64 MiB layers of scattered blocks) the copy
  // with its read-back moved 0.85-0.90 of a plain gather's bytes at one CTA per SM, against 0.70-0.72 with the
  // separate pass at any CTA count; with 32 CTAs the in-copy read-back falls to about 0.5. The engine's kernel in
  // its default 8 KiB items (CopyEngineOptions::sm_landed_item_bytes) moved 0.90-0.96 at 1 MiB blocks.
  bool lane_read_back_in_copy = true;
  // The ring lane (see "Ring lane" above), with `engine` set: slots of the decode's shared pinned ring (0: the
  // device lane), at most kMaxRingSlots; and the bytes of one slot (at least one block of every layer's roles).
  // The decode side allocates ring_slots x ring_slot_bytes from its transport at create().
  std::uint32_t ring_slots = 0;
  std::uint64_t ring_slot_bytes = std::uint64_t{32} << 20;
  // How each side copies between its pool and a slot. kSmKernel folds the checksums into the copy (every byte
  // crosses PCIe once and is read nowhere else), but SM kernels share a PCIe link poorly when both directions run
  // at once (one GPU serving both sides, or a prefill that also loads); any other strategy copies with the engine's
  // choice (DMA where it pays) and checksums the device side of the piece in a separate pass over device memory
  // (the prefill's sources, the decode's destinations: local reads, a small fraction of the copy's time).
  CopyStrategy ring_copy = CopyStrategy::kAuto;
  static constexpr std::uint32_t kMaxRingSlots = 64;
  // The transport lane (no `engine`): threads beside the protocol thread that share each layer's checksums (xxh3 of
  // every block, on both sides), which on one thread cost more than a shared-memory lane's copy. kAuto: by the
  // machine's cores (none on two cores or fewer, then one per two cores beyond, at most 4); at most
  // kMaxChecksumHelpers.
  static constexpr std::uint32_t kAutoChecksumHelpers = ~std::uint32_t{0};
  static constexpr std::uint32_t kMaxChecksumHelpers = 32;
  std::uint32_t checksum_helpers = kAutoChecksumHelpers;
  // The host direct lane (see "Host direct lane" above; no `engine`): the side that moves a layer copies its blocks
  // itself through the transport's mapping of the peer's pool, hashing what it read and what landed in the same
  // pass. Both sides set it; the decode's request names it and a prefill without it refuses the transfer. kAuto
  // checksum helpers here are one per core but one, at most 4 (the copy is this lane's only work).
  bool host_direct = false;
};
std::string_view lane_verify_name(PdOptions::LaneVerify verify) noexcept;
// "mover" or "receiver"; InvalidArgument naming `name` otherwise.
Result<PdOptions::LaneVerify> parse_lane_verify(std::string_view name);
// Options for the CopyEngine of PdOptions::engine: the device lane enqueues one or two launches per layer and transfer
// from the progress thread, and a launch of more pairs than fit inline takes a descriptor slot until it has run;
// with the engine's default ring a few transfers in flight would make the progress thread wait for the GPU.
CopyEngineOptions lane_engine_options();

// The checksum of one block of one layer (xxh3-64 over its roles in order); OutOfRange for a layer or block outside
// the space.
Result<std::uint64_t> block_layer_checksum(const BlockSpace& space, std::uint32_t layer, std::uint64_t block);

// When a transfer's steps happened on one side (steady_clock, which is system-wide on Linux, so the two sides'
// times compare across processes of one host; a default time_point: not yet, or not a step of this lane). What
// `kvtier bench pd` splits one transfer's time into.
struct PdTimes {
  using TimePoint = std::chrono::steady_clock::time_point;
  TimePoint started;    // prefill: begin(); decode: start()
  TimePoint request;    // prefill: the decode's 'R' arrived; decode: just before 'R' went to the transport
  TimePoint move;       // this side's first move of the transfer's bytes began (its copy's launch, write or read)
  TimePoint posted;     // ... and was handed over (the launch call returned, the transport took the write or read)
  TimePoint moved;      // this side saw its last move complete (a copy's event, a write's or read's completion)
  TimePoint announced;  // prefill: its last layer's notification ('W', 'A' or 'K') handed to the transport
  TimePoint final;      // every layer final on this side
};

// ---- prefill side ----------------------------------------------------------------------------------------

struct PrefillStatus {
  bool final = false;        // done or failed
  bool done = false;         // the decode side confirmed every layer
  bool reclaimable = false;  // source blocks may be reused
  std::uint32_t layers_sent = 0;
  KeptStatus error;
  PdTimes times;
};

class PdPrefill {
 public:
  // Polled (never blocking) by the progress thread, and once by layer_ready() on the caller's thread; true once the
  // layer's data is in place. It runs with the endpoint's lock held: it must not call this endpoint (a call would
  // deadlock) nor wait for a thread that does.
  using ReadyFn = std::function<Result<bool>()>;

  virtual ~PdPrefill() = default;
  static Result<std::unique_ptr<PdPrefill>> create(Transport& transport, BlockSpace blocks, PdOptions options = {});

  // Declares a transfer to `decode` of the prefill blocks `src_blocks` (in the order of the decode side's
  // destination list).
  virtual Status begin(PeerId decode, TransferId id, std::vector<BlockId> src_blocks) = 0;
  // Layer `layer` becomes ready when `ready` says so (nullptr: now). Layers may be declared in any order.
  virtual Status layer_ready(TransferId id, std::uint32_t layer, ReadyFn ready = nullptr) = 0;
  // Layers that are all ready now (the forward pass that computed them has finished), declared in one call: the
  // device lane moves those whose destinations are known as one copy (see "Device lane"), where layer_ready() called
  // layer by layer launches each alone. Every layer is checked (the transfer known, each layer in range, not declared
  // before, none twice: kNotFound / kOutOfRange / kAlreadyExists naming it) before any is declared.
  virtual Status layers_ready(TransferId id, std::span<const std::uint32_t> layers) = 0;
  // The layer is ready when `event` has completed on `device` (no host sync on the compute stream: the progress
  // thread queries the event). Both must outlive the transfer.
  virtual Status layer_ready_after(TransferId id, std::uint32_t layer, Device& device, Event& event) = 0;
  virtual Result<PrefillStatus> status(TransferId id) const = 0;
  // Until final and reclaimable, or the timeout (kTimedOut).
  virtual Result<PrefillStatus> wait(TransferId id, std::chrono::nanoseconds timeout) = 0;
  // Forgets a final, reclaimable transfer; kFailedPrecondition otherwise.
  virtual Status forget(TransferId id) = 0;
  // Every wait in flight (wait, wait_layer) returns kFailedPrecondition ("closing") at once, and so does every
  // later one: for an owner about to destroy the endpoint while other threads wait on it. Transfers are not touched
  // (destroying the endpoint ends them).
  virtual void abort_waits() = 0;
  // Drops `peer` as a lease expiry does (Transport::disconnect_peer: its name is free for a new load_peer), for
  // the owner going on with a peer that this side or the other dropped at a lease. kFailedPrecondition while a
  // transfer with the peer is not final (copies into its memory, mapped here on the host direct lane, may still
  // start: the disconnect unmaps it); kUnavailable when such copies do not end in time. Idempotent.
  virtual Status disconnect_peer(PeerId peer) = 0;
};

// ---- decode side -----------------------------------------------------------------------------------------

struct DecodeStatus {
  bool final = false;        // every layer final
  bool reclaimable = false;  // destination blocks may return to their pool
  std::vector<LayerState> layers;
  std::vector<bool> block_loaded;  // by position in the destination list: every layer verified
  // Per (layer, position): that block's layer verified, [layer * positions + position]; what a partial layer
  // loaded before the transfer is final. Empty where an endpoint does not know it.
  std::vector<std::uint8_t> layer_block_loaded;
  KeptStatus error;  // first failure seen (OK when every block loaded)
  PdTimes times;
  bool layer_block_is_loaded(std::uint32_t layer, std::size_t position) const {
    const std::size_t n = block_loaded.size(), at = std::size_t{layer} * n + position;
    return position < n && at < layer_block_loaded.size() && layer_block_loaded[at] != 0;
  }
  // Positions [0, n) all loaded: what may join a prefix index.
  std::uint32_t leading_loaded_blocks() const;
};

class PdDecode {
 public:
  virtual ~PdDecode() = default;
  static Result<std::unique_ptr<PdDecode>> create(Transport& transport, BlockSpace blocks, PdOptions options = {});

  // Starts transfer `id` from `prefill` into `dst_blocks` (distinct ids of this side's BlockSpace). A block that is
  // a destination of another transfer not forgotten yet is refused (kFailedPrecondition naming both): until
  // forget() that transfer may still write it or report it loaded.
  virtual Status start(PeerId prefill, TransferId id, PdMode mode, std::vector<BlockId> dst_blocks) = 0;
  // Until layer `layer` is final (loaded, partial or failed) or the timeout (kTimedOut).
  virtual Result<LayerState> wait_layer(TransferId id, std::uint32_t layer, std::chrono::nanoseconds timeout) = 0;
  virtual Result<DecodeStatus> status(TransferId id) const = 0;
  // Until final (or also reclaimable, when `reclaimable`), or the timeout (kTimedOut).
  virtual Result<DecodeStatus> wait(TransferId id, std::chrono::nanoseconds timeout, bool reclaimable = false) = 0;
  // Forgets a final, reclaimable transfer; kFailedPrecondition otherwise.
  virtual Status forget(TransferId id) = 0;
  // Gives up on transfer `id` now (a receive timeout, a request the engine dropped): every layer not final fails
  // (kCancelled) and the prefill is told ('F'), which stops and proves its writes over ('Q'); the blocks are
  // reclaimable once nothing can still land (wait(id, timeout, true)). Nothing changes on a final transfer.
  // kNotFound for an unknown id.
  virtual Status cancel(TransferId id) = 0;
  // Every wait in flight (wait, wait_layer) returns kFailedPrecondition ("closing") at once, and so does every
  // later one: for an owner about to destroy the endpoint while other threads wait on it. Transfers are not touched
  // (destroying the endpoint ends them).
  virtual void abort_waits() = 0;
  // As PdPrefill::disconnect_peer (a transfer in progress with the peer: cancel it, or wait, first).
  virtual Status disconnect_peer(PeerId peer) = 0;
};

// ---- fault wrapper ---------------------------------------------------------------------------------------

// Wraps a transport and corrupts bytes "on the wire": the n-th descriptor pair (counted over every post, from
// 0) of a WRITE has one byte of its source flipped while the transfer is in flight (restored when its
// completion is observed through poll/wait); of a READ, one byte of the destination flipped when its completion
// is first observed. Everything else is forwarded.
struct WireFaults {
  std::int64_t corrupt_op = -1;   // -1: none
  std::uint64_t byte_offset = 0;  // within that descriptor (clamped to its length)
};
std::unique_ptr<Transport> wrap_with_wire_faults(std::unique_ptr<Transport> inner, WireFaults faults);

}  // namespace kvtier::transport
