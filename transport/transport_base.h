// TransportBase: what every backend shares: the region, peer and transfer tables, the blob format and its
// checks, descriptor validation, transfer states and the quiescence bookkeeping, the notification queue.
//
// Backends implement the hooks. Locking: the base's mutex is never held while a hook runs, so a backend may
// call finish_xfer / set_quiescent / deliver from its own threads while holding its own locks (backend lock
// before base lock, never the other way).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvtier/backend/transport.h"

namespace kvtier::transport::detail {

// One descriptor pair, resolved: the bytes between local_ptr and the peer's address remote_addr.
struct ResolvedOp {
  std::byte* local_ptr = nullptr;
  std::uint64_t remote_addr = 0;
  std::uint32_t remote_region = 0;
  std::uint64_t bytes = 0;
};

// Joins neighbouring operations that are contiguous on both sides (the same peer region, each starting where the
// last one ended locally and remotely) into one, in place, keeping the order: an engine's block lists are often
// runs of consecutive blocks, and one operation per run costs the backend one request instead of one per block.
void merge_contiguous(std::vector<ResolvedOp>& ops);

// The decoded blob (exposed for tests of the format).
struct Blob {
  std::uint32_t version = 0;
  std::string backend;
  AgentIdentity identity;
  struct Region {
    MemoryKind kind = MemoryKind::kPinnedHost;
    std::uint64_t base = 0;
    std::uint64_t bytes = 0;
    std::string key;  // the backend's remote key
  };
  std::vector<Region> regions;
  std::string address;  // the backend's connection address
};
// Bounds of the fields a blob may carry (its sender is not trusted: see "Trust" in transport.h).
inline constexpr std::size_t kMinPeerSecretBytes = 32, kMaxPeerSecretBytes = 64;
inline constexpr std::size_t kBlobMacBytes = 32;
inline constexpr std::size_t kMaxRemoteKeyBytes = 4096;  // UCX's packed rkeys and the ipc keys are far smaller
inline constexpr std::size_t kMaxAddressBytes = 64 * 1024;
inline constexpr std::size_t kMaxNameBytes = 256;

// kInvalidArgument unless `secret` is empty (no secret) or kMinPeerSecretBytes..kMaxPeerSecretBytes long.
Status check_peer_secret(std::string_view secret);
// A connection's handshake under a peer secret (the ipc backend): the owner sends a fresh random challenge
// (kHandshakeChallengeBytes), the initiator answers with this keyed BLAKE2b MAC over the challenge, its own name and
// address and the owner's name. Only an agent holding the secret can answer, and an answer is good for one
// challenge, one initiator and one owner.
inline constexpr std::size_t kHandshakeChallengeBytes = 32;
std::string handshake_challenge();
std::string handshake_proof(std::string_view secret, std::string_view challenge, std::string_view initiator,
                            std::string_view initiator_address, std::string_view owner);
// Constant-time comparison of a received proof with the expected one.
bool handshake_proof_matches(std::string_view got, std::string_view want);
// An agent's own name as its peers will check it in its blob: 1 to 256 printable ASCII characters. Each
// create_*_transport refuses another name at once, naming it, instead of leaving the refusal to every peer.
Status check_agent_name(std::string_view name);

// With a secret, the blob carries a keyed MAC (BLAKE2b-256 keyed with the secret) over everything else and a magic
// of its own, so a receiver knows which kind it holds before it reads any field.
std::vector<std::byte> encode_blob(const Blob& blob, std::string_view secret = {});
// kInvalidArgument: not a blob, or a field out of its bounds (region base + bytes wrapping, a live region at
// base 0, keys, names and addresses too long or malformed, overlapping regions); kDataLoss: checksum;
// kFailedPrecondition: another transport version, or authentication: with a secret, a blob without a MAC or whose
// MAC does not verify (checked before any field is read); without one, a blob that carries a MAC.
Result<Blob> decode_blob(std::span<const std::byte> bytes, std::string_view secret = {});

class TransportBase : public Transport {
 public:
  // `peer_secret`: empty, or checked by check_peer_secret (the factories refuse other lengths).
  explicit TransportBase(AgentIdentity identity, std::string peer_secret = {})
      : identity_(std::move(identity)), peer_secret_(std::move(peer_secret)) {}
  ~TransportBase() override;

  const AgentIdentity& identity() const noexcept override { return identity_; }
  Result<RegionId> register_memory(const MemoryRegion& region) override;
  Status deregister_memory(RegionId region) override;
  Result<std::vector<std::byte>> export_metadata() override;
  Result<PeerId> load_peer(std::span<const std::byte> blob) override;
  Result<PeerInfo> peer_info(PeerId peer) const override;
  Result<PeerId> find_peer(std::string_view name) const override;
  Result<void*> peer_region_address(PeerId peer, std::uint32_t region) override;
  Result<SharedMemory> allocate_shared(std::uint64_t bytes) override;
  Result<std::span<std::byte>> allocate_host(std::uint64_t bytes) override;
  Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local, std::span<const RemoteDesc> remote,
                      std::string notification) override;
  Result<XferStatus> poll(XferId xfer) override;
  Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) override;
  Status abort(XferId xfer) override;
  Status release(XferId xfer) override;
  Status disconnect_peer(PeerId peer) override;
  bool peer_revoked(PeerId peer) const override;
  Status send_notification(PeerId peer, std::string message) override;
  Status send_urgent_notification(PeerId peer, std::string message) override;
  std::vector<Notification> take_notifications() override;
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override;
  void wake_notification_waiter() override;
  // What the backend noted with note_peer_progress (by the peer's agent name): "now" while a copy for the peer runs,
  // else when the last of its bytes or messages was read; nullopt where nothing was noted.
  std::optional<std::chrono::steady_clock::time_point> last_progress(PeerId peer) const override;

 protected:
  // Evidence that the peer named `name` is alive (Transport::last_progress), taken when the backend reads its bytes
  // or messages, not when anyone processes them. `copying`: +1 when a copy of bytes of a transfer with the peer
  // begins here, -1 when it ends (a copy in progress counts as progress throughout).
  void note_peer_progress(const std::string& name, int copying = 0);
  // ---- hooks ----
  // Registers the region with the backend; returns its remote key (packed into the blob).
  virtual Result<std::string> backend_register(RegionId id, const MemoryRegion& region) = 0;
  virtual void backend_deregister(RegionId id) = 0;
  virtual Result<std::string> backend_address() = 0;
  // The backend's own checks of a decoded blob (key formats and sizes, the address), before anything of the
  // peer is recorded or connected. Whatever it refuses never reaches backend_connect.
  virtual Status backend_check_blob(const Blob& blob) {
    (void)blob;
    return Status::Ok();
  }
  virtual Status backend_connect(PeerId peer, const Blob& blob) = 0;
  // Starts the operations. Completion: finish_xfer (state) then set_quiescent (requests gone), from any thread,
  // possibly before this returns. A non-OK return means nothing was started (the base fails the transfer).
  virtual Status backend_post(XferId id, XferOp op, PeerId peer, std::vector<ResolvedOp> ops,
                              std::string notification) = 0;
  virtual Status backend_send(PeerId peer, NotifKind kind, std::string message) = 0;
  // send_urgent_notification's message (kMessage); by default as backend_send.
  virtual Status backend_send_urgent(PeerId peer, std::string message) {
    return backend_send(peer, NotifKind::kMessage, std::move(message));
  }
  // Cancels what can be cancelled; the backend still calls set_quiescent when its requests are gone.
  virtual void backend_abort(XferId id) = 0;
  // disconnect_peer: the transfers to the peer are failed and backend_abort'ed already. Tears the path down so
  // that every request of this agent to the peer completes (fails) and the peer's requests into this agent's
  // memory are no longer served; returns whether the peer can no longer write here (peer_revoked).
  virtual bool backend_disconnect(PeerId peer) = 0;
  // peer_revoked after a disconnect (the backend may learn later that the peer is gone); the base answers
  // false for peers not disconnected.
  virtual bool backend_revoked(PeerId peer) const = 0;
  // peer_region_address for a known, connected peer and a region index inside its blob (`r`, as loaded).
  // Default: kNotSupported (the backend reaches a peer's memory only through its own copies).
  virtual Result<void*> backend_peer_address(PeerId peer, std::uint32_t region, const Blob::Region& r);
  // allocate_shared: memory of `bytes` that peers can map (zeroed), or kNotSupported (the default). The base then
  // registers it; backend_register sees it as a region whose base this hook returned. backend_free_shared takes
  // back memory whose registration failed (a registered one is the backend's until it is destroyed).
  virtual Result<void*> backend_allocate_shared(std::uint64_t bytes);
  virtual void backend_free_shared(void* p) { (void)p; }
  // allocate_host: page-aligned zeroed memory of `bytes`, the backend's until it is destroyed. Default: anonymous
  // memory that the base unmaps when it is destroyed (after the backend's destructor has let go of every request).
  virtual Result<void*> backend_allocate_host(std::uint64_t bytes);

  // ---- for backends ----
  void finish_xfer(XferId id, Status status);
  void set_quiescent(XferId id);
  void deliver(Notification n);
  // The backend's peers fail (dead connection): later posts to it are refused.
  void mark_peer_failed(PeerId peer, Status why);
  // True when [p, p + bytes) lies inside one registered region.
  bool covers(const void* p, std::uint64_t bytes) const;
  // Waits until every transfer is quiescent, up to `timeout`; false on timeout. For destructors.
  bool wait_all_quiescent(std::chrono::nanoseconds timeout);

 private:
  struct RegionRec {
    MemoryRegion region;
    std::string key;
    std::uint32_t users = 0;  // transfers using it that are not quiescent
    bool live = false;
  };
  struct PeerRec {
    PeerInfo info;
    std::string address;  // the blob's backend address: a new one under the same name is the peer restarted
    std::vector<Blob::Region> regions;
    KeptStatus failed;
    bool connected = false;  // backend_connect succeeded (failed may be set later: the connection ended)
    bool disconnected = false;
    bool revoked = false;  // backend_disconnect's answer
  };
  struct XferRec {
    XferOp op = XferOp::kRead;
    PeerId peer = 0;
    XferStatus status;
    std::vector<RegionId> regions;  // distinct local regions used
    std::string notification;
  };

  struct PeerProgress {
    std::chrono::steady_clock::time_point last;
    int copying = 0;
  };
  mutable std::mutex progress_mu_;
  std::unordered_map<std::string, PeerProgress> progress_by_name_;  // note_peer_progress

  const AgentIdentity identity_;
  const std::string peer_secret_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // transfer state, quiescence, notifications
  std::vector<RegionRec> regions_;
  std::vector<PeerRec> peers_;
  std::unordered_map<XferId, XferRec> xfers_;
  XferId next_xfer_ = 1;
  std::deque<Notification> inbox_;
  bool wake_waiter_ = false;  // wake_notification_waiter() was called: the next wait_notifications returns at once
  struct HostMapping {
    void* data = nullptr;
    std::uint64_t bytes = 0;
  };
  std::vector<HostMapping> host_mappings_;  // backend_allocate_host's default memory (under mu_)
};

}  // namespace kvtier::transport::detail
