// Transport: one-sided block transfers between kvtier instances (agents), on the model of NIXL's nixlAgent.
//
// Model.
//   - An agent registers memory regions (device memory reachable by the backend, or pinned host memory) and
//     exports an opaque metadata blob: its identity (name, layout fingerprint, tensor-parallel size and rank,
//     kvtier transport version), its regions (base, size, kind, the backend's remote key) and the backend's
//     connection address, with a checksum. Blobs travel out of band (a file, a side channel, a test pipe).
//   - load_peer() checks a peer's blob against the local identity: another layout fingerprint, tensor-parallel
//     size, transport version or backend is refused (kFailedPrecondition) with a message naming both values, and a
//     damaged blob is kDataLoss. Nothing is connected on refusal.
//   - post() starts a READ (remote -> local) or WRITE (local -> remote) of a list of (local, remote) descriptor
//     pairs, with a notification message that the peer receives after every byte of the transfer is visible
//     there (WRITE) or has been read (READ). Lists of unequal length, descriptors outside their region, unknown
//     regions or peers and mismatched pair lengths are refused before anything is posted, naming the bad index.
//   - poll() / wait(deadline) report the transfer's state. Completion callbacks do not exist; polling is the API.
//   - Notifications arrive in the order the peer sent them. Besides messages there are negative notifications:
//     kAborted (the initiator aborted a transfer it had posted: some bytes may have landed, none are valid) and
//     kFailedToPost (the initiator's post failed after validation: nothing usable landed). Their text is the
//     transfer's notification message, so the receiver can match them to what it waits for.
//
// Quiescence rule (the one rule callers must follow). A transfer is quiescent when no operation of it can still
// touch local or remote memory: every backend request has completed, successfully or not. Memory of a transfer
// that is not quiescent must not return to any pool: release() and deregister_memory() refuse
// (kFailedPrecondition) until it is. A failed or aborted transfer may stay non-quiescent for a while (requests
// still in the backend); its blocks must be treated as invalid forever (fail closed), never as loaded. A wait
// that times out reports kTimedOut and leaves the transfer in flight: its outcome is unknown, so the same rule
// applies. Destroying a transport cancels what is in flight and waits (bounded) until the backend has let go.
//
// Trust. A blob comes from another process. load_peer bounds and checks every field before the backend sees it
// (names, address and key sizes, a region's base + size not wrapping, regions not overlapping, the backend's key
// and address formats) and post() keeps every remote range inside the peer's region, so a crafted blob is refused
// (kInvalidArgument / kOutOfRange naming the field), never a crash. Without a peer secret, the blob's checksum only
// detects damage: whoever can hand this agent a blob chooses whom it connects to and what memory it addresses
// there, so the channel that carries blobs must be trusted. With a peer secret (the options' `peer_secret`, 32 to
// 64 raw bytes shared by the agents that may talk to each other; other lengths are kInvalidArgument at creation)
// the blob carries a keyed BLAKE2b MAC over all of it, verified before any field is read: a wrong MAC, a missing
// one, or a MAC'd blob at an agent without a secret is refused (kFailedPrecondition, "authentication failed").
// A peer that was loaded is trusted with the regions it was given (UCX RMA is one-sided; on UCX's active-message
// data path the target checks every descriptor's token and bounds itself, and stops landing a disconnected peer's
// writes; a peer's name in those messages is not authenticated beyond the token, so a loaded peer could send
// under another loaded peer's name).
//
// Thread-safety: every method may be called from any thread. Nothing blocks except wait() and
// wait_notification(), each up to its deadline; post() returns once the operations are queued.
//
// Errors: kInvalidArgument / kOutOfRange (bad descriptors, blob, region), kNotFound (unknown transfer, peer,
// region), kFailedPrecondition (refused peer, not quiescent), kUnavailable (peer unreachable or dead),
// kAborted (aborted transfer), kTimedOut (deadline), kDataLoss (damaged blob), kInternal (backend error);
// kFailedPrecondition also for a blob that fails authentication (status.h has no dedicated code).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier::transport {

// Version of the blob format and of the wire protocol built on it, including the block checksum the device and
// ring lanes send (copy_engine.h: block_checksum(); 3: its three-multiply form); peers must agree.
inline constexpr std::uint32_t kTransportVersion = 3;

enum class XferOp : std::uint8_t { kRead, kWrite };
std::string_view xfer_op_name(XferOp op) noexcept;

enum class XferState : std::uint8_t {
  kInProgress,  // operations in the backend
  kDone,        // every byte moved; the notification was handed to the backend
  kFailed,      // some operation failed or the transfer was aborted: the bytes are invalid
};
std::string_view xfer_state_name(XferState state) noexcept;

enum class NotifKind : std::uint8_t { kMessage, kAborted, kFailedToPost };
std::string_view notif_kind_name(NotifKind kind) noexcept;

// Who an agent is. Two agents exchange blocks only when fingerprint, tp_size and version match.
struct AgentIdentity {
  std::string name;  // unique among the agents that talk to each other
  std::uint64_t layout_fingerprint = 0;
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
};

struct MemoryRegion {
  MemoryKind kind = MemoryKind::kPinnedHost;
  int device_ordinal = 0;
  void* base = nullptr;
  std::uint64_t bytes = 0;
};

using RegionId = std::uint32_t;
using PeerId = std::uint32_t;
using XferId = std::uint64_t;

// [offset, offset + bytes) of a local region.
struct LocalDesc {
  RegionId region = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};
// [offset, offset + bytes) of the peer's region number `region` (its index in the peer's blob).
struct RemoteDesc {
  std::uint32_t region = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

struct RegionInfo {
  MemoryKind kind = MemoryKind::kPinnedHost;
  std::uint64_t bytes = 0;
};

struct PeerInfo {
  AgentIdentity identity;
  std::uint32_t version = 0;
  std::string backend;
  std::vector<RegionInfo> regions;  // indexed by RemoteDesc::region
};

struct Notification {
  std::string peer;  // the sender's agent name
  NotifKind kind = NotifKind::kMessage;
  std::string message;
};

struct XferStatus {
  XferState state = XferState::kInProgress;
  bool quiescent = false;  // see the quiescence rule
  KeptStatus error;        // why it failed (OK otherwise)
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view backend_name() const noexcept = 0;
  virtual const AgentIdentity& identity() const noexcept = 0;

  // Regions are numbered in registration order; that number is their index in the blob. A region must not
  // overlap another one of this agent.
  virtual Result<RegionId> register_memory(const MemoryRegion& region) = 0;
  // kFailedPrecondition while a transfer that is not quiescent uses it. Blobs exported before stay stale:
  // peers that loaded them must not address it (the backend refuses where it can).
  virtual Status deregister_memory(RegionId region) = 0;

  virtual Result<std::vector<std::byte>> export_metadata() = 0;
  // A new PeerId for the blob's agent. The same blob again: kAlreadyExists. A blob under a name already loaded but
  // with another address or other regions is that peer restarted (a stable name, as a pod's): its previous
  // incarnation is disconnected (as disconnect_peer) and the new one loaded.
  virtual Result<PeerId> load_peer(std::span<const std::byte> blob) = 0;
  virtual Result<PeerInfo> peer_info(PeerId peer) const = 0;
  // The loaded peer whose agent name is `name` (a Notification's sender); kNotFound when none is (not loaded yet,
  // failed to connect, or disconnected: a disconnected peer's name is free for a new load_peer).
  virtual Result<PeerId> find_peer(std::string_view name) const = 0;
  // Where the peer's region `region` is mapped into this process for direct access by this process's device
  // (kernels read and write it as local memory) or its CPU: the CUDA IPC mapping of a peer's CUDA device memory and
  // the peer's shared memory (allocate_shared) mapped here (ipc backend); the peer's memory from allocate_host
  // mapped by UCX's shared-memory transports (UCX, ucp_rkey_ptr); the peer's own memory (loopback: one process).
  // kNotSupported where the backend reaches the region only through its own copies (UCX over TCP or for memory the
  // peer allocated itself, other ipc host windows), kNotFound for an unknown peer or region. Bytes moved through
  // this address bypass the transport: no transfer, no notification, no quiescence tracking; the caller owns those
  // (the prefill/decode device and host direct lanes of pd.h), and the bounds: the mapping may reach beyond the
  // region's bytes. Valid until the peer is disconnected or the transport destroyed.
  virtual Result<void*> peer_region_address(PeerId peer, std::uint32_t region) = 0;

  // Memory that this process uses in place and that peers map directly (peer_region_address answers for it):
  // allocated by the transport (page-aligned, zeroed), registered as the next region (pinned-host kind), owned by
  // the transport until it is destroyed. The ipc backend shares a sealed memfd that both processes map; loopback
  // hands out the memory itself (one process). The prefill/decode ring lane (pd.h) keeps its ring here. The caller
  // registers it with its device (Device::register_host) where kernels must reach it. kNotSupported where peers
  // cannot map memory (UCX), kInvalidArgument for 0 bytes, kResourceExhausted when the memory is not there.
  struct SharedMemory {
    RegionId region = 0;
    std::byte* data = nullptr;
    std::uint64_t bytes = 0;
  };
  virtual Result<SharedMemory> allocate_shared(std::uint64_t bytes) {
    (void)bytes;
    return NotSupported("this transport cannot share memory that peers map directly");
  }

  // Host memory for blocks that this transport moves (an engine's host pool, pinned staging): page-aligned, zeroed,
  // owned by the transport until it is destroyed. Not a region: register the ranges that peers may address with
  // register_memory as for any memory (any number of them, anywhere inside it). The backend places it where its
  // lanes reach it best: UCX allocates it itself (ucp_mem_map ALLOCATE, a shared-memory segment where its
  // shared-memory transports are enabled), so that a same-host peer copies straight into or out of it, where memory
  // the caller allocated is reached only through UCX's RMA emulation (an active message per fragment, copied by the
  // target's progress thread); the other backends hand out anonymous memory. Trust: on UCX, a region inside an
  // allocation carries the allocation's key, so a peer that loaded the blob can reach the whole allocation; allocate
  // only what you register. The caller registers it with its device (Device::register_host) where DMA must reach it.
  // kInvalidArgument for 0 bytes, kResourceExhausted when the memory is not there.
  virtual Result<std::span<std::byte>> allocate_host(std::uint64_t bytes) = 0;

  virtual Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local,
                              std::span<const RemoteDesc> remote, std::string notification) = 0;
  virtual Result<XferStatus> poll(XferId xfer) = 0;
  // Until the transfer is no longer in progress or the timeout passes (then kTimedOut, the transfer stays).
  virtual Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) = 0;
  // Fails the transfer (kAborted), cancels what the backend can cancel and sends kAborted to the peer. The
  // transfer becomes quiescent once the backend has let go of every request (poll to see it).
  virtual Status abort(XferId xfer) = 0;
  // Forgets a finished, quiescent transfer; kFailedPrecondition otherwise.
  virtual Status release(XferId xfer) = 0;

  // Gives up on `peer` (the caller's lease on it expired): every transfer of this agent to it that is still in
  // progress fails (kAborted) and is cancelled, the backend tears its path down (UCX force-closes the endpoint,
  // so requests that would never complete against a dead peer complete with errors; ipc closes both
  // connections), and later posts and messages to it are refused (kUnavailable). Its requests into this
  // agent's memory are no longer served where this agent serves them (see peer_revoked). The peer may be
  // loaded again from a fresh blob. kNotFound for an unknown peer.
  virtual Status disconnect_peer(PeerId peer) = 0;
  // True when nothing the peer posted can land in this agent's memory any more: after disconnect_peer on the
  // loopback and ipc backends and on UCX's active-message data path (UcxDataPath; TCP's default): this agent lands
  // the peer's writes itself and no longer does, once its receives in flight have ended; on UCX's RMA path only
  // once the connection to the peer has failed (its process is gone), since RMA of a live peer is one-sided and UCX
  // cannot revoke it. False for an unknown peer.
  virtual bool peer_revoked(PeerId peer) const = 0;

  // A message outside any transfer (control traffic). Delivered in order with the transfers' notifications.
  virtual Status send_notification(PeerId peer, std::string message) = 0;
  // As send_notification, but the message may overtake this side's earlier messages and transfers to the peer:
  // for messages whose order does not matter and whose delay would (heartbeats, which behind a long transfer's
  // bytes on one connection arrive only when the bytes have). A backend with one ordered channel per peer sends
  // it as send_notification does; UCX sends it on a connection of its own.
  virtual Status send_urgent_notification(PeerId peer, std::string message) {
    return send_notification(peer, std::move(message));
  }
  // When bytes with `peer` last moved here (a send to it completed, bytes or a message of it were read off the
  // connection), or nullopt where the backend does not track it. Taken when the backend reads or completes them,
  // not when anyone processes them: while a long transfer keeps the peer's heartbeats from being processed (or
  // their echoes from arriving), it is the evidence that the peer is alive.
  virtual std::optional<std::chrono::steady_clock::time_point> last_progress(PeerId peer) const {
    (void)peer;
    return std::nullopt;
  }
  // Notifications received since the last call, in arrival order; never blocks.
  virtual std::vector<Notification> take_notifications() = 0;
  // Blocks until at least one notification is queued (then returns them all) or the timeout passes
  // (kTimedOut).
  virtual Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) = 0;
  // Makes the wait_notifications() blocked now return at once (or the next one, when none is blocked) with what is
  // queued, possibly nothing: an empty list, not kTimedOut. For the owner of the notification stream whose thread
  // also has work that comes without a message: the prefill/decode endpoints (pd.h) launch a layer's copy or
  // declare it ready from the caller's thread, and their progress thread, asleep for its idle period, must start
  // polling that work's events now rather than when the period ends.
  virtual void wake_notification_waiter() = 0;
};

// ---- backends ----------------------------------------------------------------------------------------------

// In-process loopback: agents of one process find each other by name; transfers are memcpy on a worker thread
// of the initiator. The test double of the conformance suite; its fault knobs make outcomes deterministic.
struct LoopbackOptions {
  // Each operation (one descriptor pair) sleeps this long before its copy: keeps transfers in flight.
  std::chrono::microseconds op_delay{0};
  // Called by every post() after validation; a non-OK status makes that post fail as the backend would
  // (the transfer fails, the peer gets kFailedToPost).
  std::function<Status(XferOp)> post_fault;
  // See "Trust" above: 32..64 raw bytes shared by the agents that may talk to each other; empty: none.
  std::string peer_secret;
};
Result<std::unique_ptr<Transport>> create_loopback_transport(AgentIdentity identity, LoopbackOptions options = {});

// How a UCX agent's peers reach its registered memory (UcxOptions::data_path).
//   kRma: one-sided RMA (ucp_put_nbx / ucp_get_nbx) with UCX remote keys packed into the blob. Where UCX has
//     hardware RMA or maps the memory (shared memory, RDMA) this is one copy; over TCP UCX 1.13 emulates it
//     (each put an active message that this agent's progress thread copies into place: three copies of every
//     byte, docs/performance.md "Host lanes"), and UCX checks no bounds there.
//   kActiveMessages: the blob carries a random 128-bit token per region instead of a key; a writer sends each
//     descriptor as an active message naming (region, token, address, bytes), and this agent checks the token and
//     the region's bounds before it lands the bytes (large descriptors by rendezvous, received into the region);
//     a reader asks and this agent answers the same way. Writes complete when this agent has landed
//     every byte and acknowledged it, so completion and notifications keep the RMA lane's meaning. After
//     disconnect_peer this agent lands nothing more from that peer: peer_revoked is true once its receives in
//     flight have ended, without waiting for the peer's process to end.
//   kAuto: kActiveMessages when `tls` names only TCP ("tcp", or "tcp" with "self"), kRma otherwise.
// The writer or reader follows the target's choice (the kind of key in its blob), so agents of either kind talk.
enum class UcxDataPath : std::uint8_t { kAuto, kRma, kActiveMessages };

// UCX (ucp): RMA put/get with rkeys packed into the blob, or active messages (UcxDataPath), active messages for
// notifications, a progress thread.
struct UcxOptions {
  // UCX_TLS for this agent's context ("tcp", "shm", "tcp,self", ...); empty: UCX's default (or the environment).
  std::string tls;
  // UCX_NET_DEVICES ("lo" for TCP over loopback); empty: UCX's default.
  std::string net_devices;
  // See "Trust" above: 32..64 raw bytes shared by the agents that may talk to each other; empty: none.
  std::string peer_secret;
  // The TCP lane's send and receive segment (UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE, unless the environment
  // sets them): UCX's defaults (8 KiB / 64 KiB) cost a system call per segment. 0: UCX's defaults; otherwise 4 KiB
  // to 64 MiB (kInvalidArgument naming the value). 512 KiB: on the H200 machine's 16 cores the raw loopback lane
  // moved a median 3.9 GB/s against 3.3 at 256 KiB and 3.4 at 2 MiB (docs/performance.md, "TCP segments").
  std::uint64_t tcp_segment_bytes = std::uint64_t{512} << 10;
  // How peers reach this agent's memory (see UcxDataPath).
  UcxDataPath data_path = UcxDataPath::kAuto;
};
Result<std::unique_ptr<Transport>> create_ucx_transport(AgentIdentity identity, UcxOptions options = {});

}  // namespace kvtier::transport
