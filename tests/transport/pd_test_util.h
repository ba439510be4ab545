// Shared by the prefill/decode tests: a small layout, block spaces in host memory, the bytes every prefill
// block holds (a pure function of layer, role, block and byte index, so two processes agree).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvtier/core/layout.h"
#include "kvtier/transport/transport.h"

namespace kvtier::transport::testing {

// Forwards every call to `inner`; tests override what they need to disturb.
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
  Status send_notification(PeerId peer, std::string message) override {
    return inner_->send_notification(peer, std::move(message));
  }
  std::vector<Notification> take_notifications() override { return inner_->take_notifications(); }
  Result<std::vector<Notification>> wait_notifications(std::chrono::nanoseconds timeout) override {
    return inner_->wait_notifications(timeout);
  }

 protected:
  std::unique_ptr<Transport> inner_;
};

inline KvLayout pd_layout(std::uint32_t layers = 4, std::uint64_t block_bytes = 8192) {
  return KvLayout::uniform(layers, 2, block_bytes).value();
}

inline std::byte pattern(std::uint32_t l, std::uint32_t r, std::uint64_t b, std::uint64_t i) {
  std::uint64_t x = (static_cast<std::uint64_t>(l) << 48) ^ (static_cast<std::uint64_t>(r) << 40) ^ (b << 24) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 29;
  return static_cast<std::byte>(x);
}

// Layer-first host block space; the memory lives in `storage`.
struct HostBlocks {
  std::vector<std::vector<std::unique_ptr<std::byte[]>>> storage;
  BlockSpace space;

  static HostBlocks make(const KvLayout& layout, std::uint64_t num_blocks, bool fill,
                         std::byte poison = std::byte{0xee}) {
    HostBlocks h;
    std::vector<std::vector<void*>> bases(layout.num_layers());
    h.storage.resize(layout.num_layers());
    for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
      for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
        const std::uint64_t bytes = layout.block_bytes(l, r) * num_blocks;
        h.storage[l].emplace_back(new std::byte[bytes]);
        std::byte* p = h.storage[l].back().get();
        for (std::uint64_t b = 0; b < num_blocks; ++b)
          for (std::uint64_t i = 0; i < layout.block_bytes(l, r); ++i)
            p[b * layout.block_bytes(l, r) + i] = fill ? pattern(l, r, b, i) : poison;
        bases[l].push_back(p);
      }
    h.space = BlockSpace::layer_first(MemoryKind::kPinnedHost, 0, layout, num_blocks, bases).value();
    return h;
  }
};

// True when decode block `dst` holds, in layer l, what prefill block `src` holds.
inline bool layer_matches(const BlockSpace& decode, std::uint64_t dst, std::uint32_t l, std::uint64_t src) {
  const KvLayout& layout = decode.layout();
  for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
    const std::byte* p = decode.block_ptr(l, r, dst);
    for (std::uint64_t i = 0; i < layout.block_bytes(l, r); ++i)
      if (p[i] != pattern(l, r, src, i)) return false;
  }
  return true;
}

}  // namespace kvtier::transport::testing
