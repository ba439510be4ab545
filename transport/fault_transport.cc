// Wire-fault wrapper (include/kvtier/transport/pd.h): corrupts one byte of one descriptor pair, as a bad link
// would, so the protocol's checksums can be tested on any backend.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "kvtier/transport/pd.h"
#include "transport/forwarding_transport.h"

namespace kvtier::transport {
namespace {

class WireFaultTransport final : public detail::ForwardingTransport {
 public:
  WireFaultTransport(std::unique_ptr<Transport> inner, WireFaults faults)
      : ForwardingTransport(std::move(inner)), faults_(faults) {}

  Result<RegionId> register_memory(const MemoryRegion& region) override {
    auto id = inner().register_memory(region);
    if (id.ok()) {
      std::lock_guard lock(mu_);
      bases_[*id] = static_cast<std::byte*>(region.base);
    }
    return id;
  }

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
    auto id = inner().post(op, peer, local, remote, std::move(notification));
    if (target != nullptr) {
      if (id.ok())
        pending_[*id] = Fault{op, target};
      else if (op == XferOp::kWrite)
        *target ^= std::byte{0x40};
    }
    return id;
  }
  Result<XferStatus> poll(XferId xfer) override { return observe(xfer, inner().poll(xfer)); }
  Result<XferStatus> wait(XferId xfer, std::chrono::nanoseconds timeout) override {
    return observe(xfer, inner().wait(xfer, timeout));
  }
  // The device path writes the peer's memory itself: there is no wire to corrupt.

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
