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
#include <unordered_map>
#include <vector>

#include "kvtier/transport/transport.h"

namespace kvtier::transport::detail {

// One descriptor pair, resolved: the bytes between local_ptr and the peer's address remote_addr.
struct ResolvedOp {
  std::byte* local_ptr = nullptr;
  std::uint64_t remote_addr = 0;
  std::uint32_t remote_region = 0;
  std::uint64_t bytes = 0;
};

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
std::vector<std::byte> encode_blob(const Blob& blob);
// kInvalidArgument: not a blob; kDataLoss: checksum; kFailedPrecondition: another transport version.
Result<Blob> decode_blob(std::span<const std::byte> bytes);

class TransportBase : public Transport {
 public:
  explicit TransportBase(AgentIdentity identity) : identity_(std::move(identity)) {}

  const AgentIdentity& identity() const noexcept override { return identity_; }
  Result<RegionId> register_memory(const MemoryRegion& region) override;
  Status deregister_memory(RegionId region) override;
  Result<std::vector<std::byte>> export_metadata() override;
  Result<PeerId> load_peer(std::span<const std::byte> blob) override;
  Result<PeerInfo> peer_info(PeerId peer) const override;
  Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local, std::span<const RemoteDesc> remote,
                      std::string notification) override;
  Result<XferStatus> poll(XferId xfer) override;
  Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) override;
  Status abort(XferId xfer) override;
  Status release(XferId xfer) override;
  Status send_notification(PeerId peer, std::string message) override;
  std::vector<Notification> take_notifications() override;
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override;

 protected:
  // ---- hooks ----
  // Registers the region with the backend; returns its remote key (packed into the blob).
  virtual Result<std::string> backend_register(RegionId id, const MemoryRegion& region) = 0;
  virtual void backend_deregister(RegionId id) = 0;
  virtual Result<std::string> backend_address() = 0;
  virtual Status backend_connect(PeerId peer, const Blob& blob) = 0;
  // Starts the operations. Completion: finish_xfer (state) then set_quiescent (requests gone), from any thread,
  // possibly before this returns. A non-OK return means nothing was started (the base fails the transfer).
  virtual Status backend_post(XferId id, XferOp op, PeerId peer, std::vector<ResolvedOp> ops,
                              std::string notification) = 0;
  virtual Status backend_send(PeerId peer, NotifKind kind, std::string message) = 0;
  // Cancels what can be cancelled; the backend still calls set_quiescent when its requests are gone.
  virtual void backend_abort(XferId id) = 0;

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
    std::vector<Blob::Region> regions;
    Status failed;
  };
  struct XferRec {
    XferOp op = XferOp::kRead;
    PeerId peer = 0;
    XferStatus status;
    std::vector<RegionId> regions;  // distinct local regions used
    std::string notification;
  };

  const AgentIdentity identity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // transfer state, quiescence, notifications
  std::vector<RegionRec> regions_;
  std::vector<PeerRec> peers_;
  std::unordered_map<XferId, XferRec> xfers_;
  XferId next_xfer_ = 1;
  std::deque<Notification> inbox_;
};

}  // namespace kvtier::transport::detail
