// A Transport that forwards every call to another one: the base of decorators (the wire-fault wrapper, tests'
// fault injectors), which override only what they disturb.
#pragma once

#include <memory>
#include <utility>

#include "kvtier/backend/transport.h"

namespace kvtier::transport::detail {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  std::string_view backend_name() const noexcept override { return inner_->backend_name(); }
  const AgentIdentity& identity() const noexcept override { return inner_->identity(); }
  Result<RegionId> register_memory(const MemoryRegion& region) override { return inner_->register_memory(region); }
  Status deregister_memory(RegionId region) override { return inner_->deregister_memory(region); }
  Result<std::vector<std::byte>> export_metadata() override { return inner_->export_metadata(); }
  Result<PeerId> load_peer(std::span<const std::byte> blob) override { return inner_->load_peer(blob); }
  Result<PeerInfo> peer_info(PeerId peer) const override { return inner_->peer_info(peer); }
  Result<PeerId> find_peer(std::string_view name) const override { return inner_->find_peer(name); }
  Result<void*> peer_region_address(PeerId peer, std::uint32_t region) override {
    return inner_->peer_region_address(peer, region);
  }
  Result<SharedMemory> allocate_shared(std::uint64_t bytes) override { return inner_->allocate_shared(bytes); }
  Result<std::span<std::byte>> allocate_host(std::uint64_t bytes) override { return inner_->allocate_host(bytes); }
  Result<XferId> post(XferOp op, PeerId peer, std::span<const LocalDesc> local, std::span<const RemoteDesc> remote,
                      std::string notification) override {
    return inner_->post(op, peer, local, remote, std::move(notification));
  }
  Result<XferStatus> poll(XferId xfer) override { return inner_->poll(xfer); }
  Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) override {
    return inner_->wait(xfer, timeout);
  }
  Status abort(XferId xfer) override { return inner_->abort(xfer); }
  Status release(XferId xfer) override { return inner_->release(xfer); }
  Status disconnect_peer(PeerId peer) override { return inner_->disconnect_peer(peer); }
  bool peer_revoked(PeerId peer) const override { return inner_->peer_revoked(peer); }
  std::optional<std::chrono::steady_clock::time_point> last_progress(PeerId peer) const override {
    return inner_->last_progress(peer);
  }
  // Through this class's send_notification, so that a wrapper that watches or drops messages (fault injection,
  // test taps) sees urgent ones too; they lose their urgency only under such a wrapper.
  Status send_urgent_notification(PeerId peer, std::string message) override {
    return send_notification(peer, std::move(message));
  }
  Status send_notification(PeerId peer, std::string message) override {
    return inner_->send_notification(peer, std::move(message));
  }
  std::vector<Notification> take_notifications() override { return inner_->take_notifications(); }
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    return inner_->wait_notifications(timeout);
  }
  void wake_notification_waiter() override { inner_->wake_notification_waiter(); }

 protected:
  Transport& inner() noexcept { return *inner_; }

 private:
  std::unique_ptr<Transport> inner_;
};

}  // namespace kvtier::transport::detail
