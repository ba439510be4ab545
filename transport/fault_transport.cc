// Wire-fault wrapper (include/kvtier/transport/pd.h): corrupts one byte of one descriptor pair, as a bad link
// would, so the protocol's checksums can be tested on any backend.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "kvtier/transport/pd.h"

namespace kvtier::transport {
namespace {

class WireFaultTransport final : public Transport {
 public:
  WireFaultTransport(std::unique_ptr<Transport> inner, WireFaults faults) : inner_(std::move(inner)), faults_(faults) {}

  std::string_view backend_name() const noexcept override { return inner_->backend_name(); }
  const AgentIdentity& identity() const noexcept override { return inner_->identity(); }
  Result<RegionId> register_memory(const MemoryRegion& region) override {
    auto id = inner_->register_memory(region);
    if (id.ok()) {
      std::lock_guard lock(mu_);
      bases_[*id] = static_cast<std::byte*>(region.base);
    }
    return id;
  }
  Status deregister_memory(RegionId region) override { return inner_->deregister_memory(region); }
  Result<std::vector<std::byte>> export_metadata() override { return inner_->export_metadata(); }
  Result<PeerId> load_peer(std::span<const std::byte> blob) override { return inner_->load_peer(blob); }
  Result<PeerInfo> peer_info(PeerId peer) const override { return inner_->peer_info(peer); }

  Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local, std::span<const RemoteDesc> remote,
                      std::string notification) override {
    std::lock_guard lock(mu_);
    std::byte* target = nullptr;
    if (local.size() == remote.size()) {
      const std::int64_t first = next_op_;
      next_op_ += static_cast<std::int64_t>(local.size());
      if (faults_.corrupt_op >= first && faults_.corrupt_op < next_op_) {
        const LocalDesc& d = local[static_cast<std::size_t>(faults_.corrupt_op - first)];
        auto it = bases_.find(d.region);
        if (it != bases_.end() && d.bytes > 0)
          target = it->second + d.offset + std::min(faults_.byte_offset, d.bytes - 1);
      }
    }
    if (target != nullptr && op == XferOp::kWrite) *target ^= std::byte{0x40};  // the wire flips a bit
    auto id = inner_->post(op, peer, local, remote, std::move(notification));
    if (target != nullptr) {
      if (id.ok())
        pending_[*id] = Fault{op, target};
      else if (op == XferOp::kWrite)
        *target ^= std::byte{0x40};
    }
    return id;
  }
  Result<XferStatus> poll(XferId xfer) override { return observe(xfer, inner_->poll(xfer)); }
  Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) override {
    return observe(xfer, inner_->wait(xfer, timeout));
  }
  Status abort(XferId xfer) override { return inner_->abort(xfer); }
  Status disconnect_peer(PeerId peer) override { return inner_->disconnect_peer(peer); }
  bool peer_revoked(PeerId peer) const override { return inner_->peer_revoked(peer); }
  Status release(XferId xfer) override { return inner_->release(xfer); }
  Status send_notification(PeerId peer, std::string message) override {
    return inner_->send_notification(peer, std::move(message));
  }
  std::vector<Notification> take_notifications() override { return inner_->take_notifications(); }
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    return inner_->wait_notifications(timeout);
  }

 private:
  struct Fault {
    XferOp op;
    std::byte* target;
  };

  Result<XferStatus> observe(XferId xfer, Result<XferStatus> st) {
    if (!st.ok() || st->state == XferState::kInProgress) return st;
    std::lock_guard lock(mu_);
    auto it = pending_.find(xfer);
    if (it != pending_.end()) {
      // A write's source gets its byte back; a read's destination keeps the flipped byte.
      *it->second.target ^= std::byte{0x40};
      pending_.erase(it);
    }
    return st;
  }

  std::unique_ptr<Transport> inner_;
  const WireFaults faults_;
  std::mutex mu_;
  std::map<RegionId, std::byte*> bases_;
  std::int64_t next_op_ = 0;
  std::map<XferId, Fault> pending_;
};

}  // namespace

std::unique_ptr<Transport> wrap_with_wire_faults(std::unique_ptr<Transport> inner, WireFaults faults) {
  return std::make_unique<WireFaultTransport>(std::move(inner), faults);
}

}  // namespace kvtier::transport
