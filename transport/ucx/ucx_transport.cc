// UCX (ucp) transport backend.
//
// One ucp context and worker per agent (features RMA + AM; the lanes are UCX's choice within UcxOptions::tls),
// used in UCS_THREAD_MODE_SERIALIZED under ucx_mu_: every ucp call, and every callback (they run inside
// ucp_worker_progress), happens with ucx_mu_ held. A progress thread drives the worker: it spins while
// requests are outstanding and otherwise sleeps on the worker's event fd (TCP needs the target's progress to
// serve RMA, so the passive side must progress too).
//
// Transfer: per descriptor pair ucp_put_nbx / ucp_get_nbx with the peer's rkey for that region, then
// ucp_ep_flush_nbx: its completion proves remote completion of every put (and local completion of every get).
// Only then is the notification sent (an eager active message: header {kind, sender name}, data the message),
// so the peer never sees it before the bytes. The transfer's outcome is set when the flush and the message
// have completed, and it is quiescent when every request of it has completed. A failed request fails the
// transfer; if the failure happened while posting, the peer gets kFailedToPost.
//
// Peer failure: endpoints use UCP_ERR_HANDLING_MODE_PEER where the lanes support it (TCP; not shared memory,
// where the endpoint is created without it); the error callback marks the peer failed (later posts are
// refused); its outstanding requests complete with errors, which fails their transfers. Where nothing reports a
// dead peer (shared memory), disconnect_peer force-closes the endpoint so its requests complete with errors.
// Whether a disconnected peer can still write here (peer_revoked): RMA is one-sided, so only the peer's end
// proves it: its connection failed, or its process (same host: a pidfd from the pid in its address) exited.
#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstring>
#include <list>
#include <thread>

#include "core/byte_codec.h"
#include "kvtier/core/log.h"
#include "kvtier/transport/ipc.h"
#include "transport/transport_base.h"

namespace kvtier::transport {
namespace {

constexpr unsigned kAmId = 0x4b56;  // "KV"
// UcxOptions::tcp_segment_bytes: at least a page, at most what a receive buffer per connection may sensibly hold.
constexpr std::uint64_t kMinTcpSegment = 4096, kMaxTcpSegment = std::uint64_t{64} << 20;

Status ucs_error(std::string_view what, ucs_status_t st) {
  return Internal(fmt::format("{}: {}", what, ucs_status_string(st)));
}

// Status of a failed request, by what the caller should do.
Status request_error(std::string_view what, ucs_status_t st) {
  switch (st) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED: return Unavailable(fmt::format("{}: {}", what, ucs_status_string(st)));
    case UCS_ERR_CANCELED: return Aborted(fmt::format("{}: {}", what, ucs_status_string(st)));
    default: return Internal(fmt::format("{}: {}", what, ucs_status_string(st)));
  }
}

class UcxTransport;

// One transfer's requests. Owned by UcxTransport::pending_ (under ucx_mu_).
struct Pending {
  UcxTransport* self = nullptr;
  XferId id = 0;
  PeerId peer = 0;
  int outstanding = 0;  // requests not completed
  bool posting = true;  // still inside backend_post
  bool flushed = false;
  bool notified = false;  // the message send completed (or was not needed)
  bool notify_started = false;
  bool outcome_set = false;
  Status error;
  std::string header;
  std::string message;
  std::vector<void*> requests;  // for cancellation (completed ones are removed)
};

// A bare message in flight: its buffers live until the send completes.
struct SendBuf {
  UcxTransport* self = nullptr;
  std::string header;
  std::string message;
  std::list<SendBuf>::iterator pos;
};

// ucp_ep_create and ucp_ep_rkey_unpack parse the peer's address and keys without being told their length. They
// get copies followed by this many zero bytes, so that a crafted length field inside cannot make UCX read past
// our buffer (its rkey format: a u64 map of at most 64 memory domains, one size byte and at most 255 bytes each).
constexpr std::size_t kUnpackPadding = 8 + 64 * 256 + 64;
// The shortest remote key UCX packs: a u64 map of memory domains and a memory-type byte, then per domain a size byte
// and that many bytes (shared memory's key for user memory: 9 bytes, no domain; TCP's: 10, one empty domain).
// Worker addresses are longer.
constexpr std::size_t kMinUcxKeyBytes = 9, kMinUcxAddressBytes = 16;

// The bounds of a packed remote key as UCX 1.13 lays it out (above): every domain the map announces must have its
// size byte and bytes inside the key, so that ucp_ep_rkey_unpack (which is given no length) reads none past it.
Status check_ucx_key(std::string_view name, std::size_t region, std::string_view key) {
  if (key.size() < kMinUcxKeyBytes)
    return InvalidArgument(fmt::format("peer '{}' region {}: remote key of {} bytes (UCX packs at least {})", name,
                                       region, key.size(), kMinUcxKeyBytes));
  std::uint64_t md_map = 0;
  std::memcpy(&md_map, key.data(), 8);
  std::size_t pos = 9;
  for (int i = 0; i < std::popcount(md_map); ++i) {
    if (pos >= key.size())
      return InvalidArgument(fmt::format("peer '{}' region {}: remote key of {} bytes ends inside its domain {} of {}",
                                         name, region, key.size(), i, std::popcount(md_map)));
    pos += 1 + static_cast<std::uint8_t>(key[pos]);
    if (pos > key.size())
      return InvalidArgument(
          fmt::format("peer '{}' region {}: remote key of {} bytes: domain {} claims bytes past its end", name, region,
                      key.size(), i));
  }
  return Status::Ok();
}

std::vector<char> padded(const std::string& s) {
  std::vector<char> v(s.size() + kUnpackPadding, '\0');
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

// The blob's address: "KVUCXA1", the agent's host identity (boot id, pid namespace: u32-length strings) and pid
// (u32), then UCX's worker address. The pid lets a peer on the same host tell a dead agent from a paused one.
constexpr std::string_view kAddressMagic = "KVUCXA1";
struct UcxAddress {
  HostIdentity host;
  std::uint32_t pid = 0;
  std::string worker;
};
std::string format_address(const UcxAddress& a) {
  codec::ByteWriter<std::string> w;
  w.raw(kAddressMagic.data(), kAddressMagic.size());
  w.str(a.host.boot_id);
  w.str(a.host.pid_ns);
  w.u32(a.pid);
  w.raw(a.worker.data(), a.worker.size());
  return std::move(w.out);
}
Result<UcxAddress> parse_address(std::string_view name, std::string_view s) {
  if (s.substr(0, kAddressMagic.size()) != kAddressMagic)
    return InvalidArgument(fmt::format("peer '{}': address of {} bytes is not a kvtier UCX address", name, s.size()));
  codec::ByteReader r(s.substr(kAddressMagic.size()), 256);
  UcxAddress a;
  if (!r.str(a.host.boot_id) || !r.str(a.host.pid_ns) || !r.u32(a.pid))
    return InvalidArgument(fmt::format("peer '{}': UCX address of {} bytes is truncated", name, s.size()));
  a.worker = std::string(s.substr(kAddressMagic.size() + r.pos()));
  if (a.worker.size() < kMinUcxAddressBytes)
    return InvalidArgument(fmt::format("peer '{}': UCX worker address of {} bytes (UCX packs at least {})", name,
                                       a.worker.size(), kMinUcxAddressBytes));
  return a;
}

struct UcxPeer {
  UcxPeer() = default;
  UcxPeer(const UcxPeer&) = delete;
  UcxPeer& operator=(const UcxPeer&) = delete;
  ~UcxPeer() {
    if (pidfd >= 0) close(pidfd);
  }
  // Its process has ended (same host), or its connection failed: nothing it posted can still land here.
  bool gone() const {
    if (conn_failed) return true;
    pollfd p{pidfd, POLLIN, 0};
    return pidfd >= 0 && ::poll(&p, 1, 0) > 0;
  }
  int pidfd = -1;  // the peer's process, when it runs on this host in this pid namespace
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> rkeys;  // by peer region index (null for empty keys)
  struct Bounds {
    std::uint64_t base = 0, bytes = 0;
  };
  std::vector<Bounds> regions;  // the blob's regions: every remote address is checked against them
  std::string name;
  bool failed = false;
  bool conn_failed = false;  // the endpoint's error callback ran: the connection (and so the peer) is gone
};

class UcxTransport final : public detail::TransportBase {
 public:
  UcxTransport(AgentIdentity identity, UcxOptions options)
      : TransportBase(std::move(identity), options.peer_secret), options_(std::move(options)) {}

  Status start() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return ucs_error("ucp_config_read", st);
    if (!options_.tls.empty() && (st = ucp_config_modify(config, "TLS", options_.tls.c_str())) != UCS_OK) {
      ucp_config_release(config);
      return InvalidArgument(fmt::format("UCX TLS '{}': {}", options_.tls, ucs_status_string(st)));
    }
    if (!options_.net_devices.empty() &&
        (st = ucp_config_modify(config, "NET_DEVICES", options_.net_devices.c_str())) != UCS_OK) {
      ucp_config_release(config);
      return InvalidArgument(fmt::format("UCX NET_DEVICES '{}': {}", options_.net_devices, ucs_status_string(st)));
    }
    // TCP moves data in segments of UCX_TCP_TX_SEG_SIZE / RX_SEG_SIZE (8 KiB / 64 KiB by default): a send call and
    // a receive call per segment. KV layers are megabytes, and larger segments move 3-4x the bytes per second over
    // loopback (docs/performance.md, "Host lanes"). The environment's values, when set, win.
    // Only where TCP may be used: UCX warns about settings that no transport of the context took.
    const bool tcp_possible = options_.tls.empty() || options_.tls.find("tcp") != std::string::npos ||
                              options_.tls.find("all") != std::string::npos;
    if (options_.tcp_segment_bytes != 0 && tcp_possible) {
      const std::string seg = std::to_string(options_.tcp_segment_bytes);
      for (const char* name : {"TX_SEG_SIZE", "RX_SEG_SIZE"}) {  // the tcp interface's fields
        if (std::getenv(fmt::format("UCX_TCP_{}", name).c_str()) != nullptr) continue;
        if ((st = ucp_config_modify(config, name, seg.c_str())) != UCS_OK) {
          ucp_config_release(config);
          return InvalidArgument(fmt::format("UCX {} {}: {}", name, options_.tcp_segment_bytes, ucs_status_string(st)));
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st == UCS_ERR_NO_DEVICE && !options_.tls.empty())  // the caller's list names nothing UCX has here
      return InvalidArgument(
          fmt::format("UCX TLS '{}': no transport of that list is available here ({}); e.g. "
                      "'tcp', 'shm' or '' for UCX's choice",
                      options_.tls, ucs_status_string(st)));
    if (st != UCS_OK) return ucs_error(fmt::format("ucp_init (TLS '{}')", options_.tls), st);

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if ((st = ucp_worker_create(context_, &wp, &worker_)) != UCS_OK) return ucs_error("ucp_worker_create", st);
    if ((st = ucp_worker_get_efd(worker_, &efd_)) != UCS_OK) return ucs_error("ucp_worker_get_efd", st);

    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kAmId;
    hp.cb = &UcxTransport::on_am;
    hp.arg = this;
    if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK)
      return ucs_error("ucp_worker_set_am_recv_handler", st);

    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    if ((st = ucp_worker_query(worker_, &attr)) != UCS_OK) return ucs_error("ucp_worker_query", st);
    UcxAddress self;
    // Without procfs the address carries no host identity and peers cannot watch this process's end.
    if (auto h = local_host_identity(); h.ok()) self.host = *h;
    self.pid = static_cast<std::uint32_t>(getpid());
    self.worker.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    ucp_worker_release_address(worker_, attr.address);
    host_ = self.host;
    address_ = format_address(self);

    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Internal(fmt::format("eventfd: {}", std::strerror(errno)));
    try {
      progress_ = std::thread([this] { progress_loop(); });
    } catch (const std::exception& e) {
      return Internal(fmt::format("UCX progress thread: {}", e.what()));
    }
    return Status::Ok();
  }

  ~UcxTransport() override {
    // Cancel what is in flight and close every endpoint (forced: the peer may be dead), then wait, bounded,
    // for the requests to be released before the memory they use is unmapped.
    if (worker_ != nullptr) {
      std::vector<void*> closing;
      {
        std::lock_guard lock(ucx_mu_);
        for (auto& [id, p] : pending_)
          for (void* r : p->requests) ucp_request_cancel(worker_, r);
        for (auto& peer : peers_) {
          if (!peer || peer->ep == nullptr) continue;
          for (ucp_rkey_h k : peer->rkeys)
            if (k != nullptr) ucp_rkey_destroy(k);
          peer->rkeys.clear();
          ucp_request_param_t p{};
          p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
          p.flags = UCP_EP_CLOSE_FLAG_FORCE;
          ucs_status_ptr_t r = ucp_ep_close_nbx(peer->ep, &p);
          if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
          peer->ep = nullptr;
        }
      }
      wake();
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      for (void* r : closing) {
        for (;;) {
          std::lock_guard lock(ucx_mu_);
          if (ucp_request_check_status(r) != UCS_INPROGRESS || std::chrono::steady_clock::now() > deadline) {
            ucp_request_free(r);
            break;
          }
          ucp_worker_progress(worker_);
        }
      }
      if (!wait_all_quiescent(std::chrono::seconds(5)))
        log(LogLevel::kWarning, "transport", "UCX transfers still in flight at shutdown after 5 s");
    }
    stop_.store(true);
    wake();
    if (progress_.joinable()) progress_.join();
    if (worker_ != nullptr) {
      std::lock_guard lock(ucx_mu_);
      for (auto& [id, memh] : memh_)
        if (memh != nullptr) ucp_mem_unmap(context_, memh);
      for (HostAllocation& a : host_allocs_) ucp_mem_unmap(context_, a.memh);
      ucp_worker_destroy(worker_);
    }
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  std::string_view backend_name() const noexcept override { return "ucx"; }

 protected:
  // UCX allocates the memory itself, so that the memory domains of its shared-memory transports (which cannot
  // register memory they did not allocate) hand peers a key that maps it: RMA then copies straight into it.
  Result<void*> backend_allocate_host(std::uint64_t bytes) override {
    std::lock_guard lock(ucx_mu_);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = bytes;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK)
      return ResourceExhausted(
          fmt::format("allocate_host: UCX could not allocate {} bytes: {}", bytes, ucs_status_string(st)));
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    void* rkey = nullptr;
    size_t rkey_len = 0;
    if ((st = ucp_mem_query(memh, &attr)) != UCS_OK ||
        (st = ucp_rkey_pack(context_, memh, &rkey, &rkey_len)) != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return ucs_error("allocate_host: UCX allocation", st);
    }
    HostAllocation a;
    a.base = static_cast<std::byte*>(attr.address);
    a.bytes = bytes;
    a.memh = memh;
    a.key.assign(static_cast<const char*>(rkey), rkey_len);
    ucp_rkey_buffer_release(rkey);
    // UCX may hand out memory it allocated earlier and zeroes nothing; the contract says zeroed.
    std::memset(a.base, 0, bytes);
    host_allocs_.push_back(std::move(a));
    return static_cast<void*>(host_allocs_.back().base);
  }

  Result<std::string> backend_register(RegionId id, const MemoryRegion& region) override {
    std::lock_guard lock(ucx_mu_);
    const auto* base = static_cast<const std::byte*>(region.base);
    for (const HostAllocation& a : host_allocs_) {
      if (base >= a.base && base - a.base <= static_cast<std::ptrdiff_t>(a.bytes) &&
          region.bytes <= a.bytes - static_cast<std::uint64_t>(base - a.base)) {
        memh_[id] = nullptr;  // the allocation's mapping serves it
        return a.key;
      }
    }
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = region.base;
    mp.length = region.bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) return ucs_error(fmt::format("ucp_mem_map of {} bytes at {}", region.bytes, region.base), st);
    void* rkey = nullptr;
    size_t rkey_len = 0;
    if ((st = ucp_rkey_pack(context_, memh, &rkey, &rkey_len)) != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return ucs_error("ucp_rkey_pack", st);
    }
    std::string key(static_cast<const char*>(rkey), rkey_len);
    ucp_rkey_buffer_release(rkey);
    memh_[id] = memh;
    return key;
  }

  void backend_deregister(RegionId id) override {
    std::lock_guard lock(ucx_mu_);
    auto it = memh_.find(id);
    if (it == memh_.end()) return;
    if (it->second != nullptr) ucp_mem_unmap(context_, it->second);
    memh_.erase(it);
  }

  Result<std::string> backend_address() override { return address_; }

  Status backend_check_blob(const detail::Blob& blob) override {
    if (auto a = parse_address(blob.identity.name, blob.address); !a.ok()) return a.status();
    for (std::size_t i = 0; i < blob.regions.size(); ++i)
      if (blob.regions[i].bytes != 0) KVTIER_RETURN_IF_ERROR(check_ucx_key(blob.identity.name, i, blob.regions[i].key));
    return Status::Ok();
  }

  Status backend_connect(PeerId peer, const detail::Blob& blob) override {
    std::lock_guard lock(ucx_mu_);
    if (peers_.size() <= peer) peers_.resize(peer + 1);
    auto rec = std::make_unique<UcxPeer>();
    rec->name = blob.identity.name;
    for (const auto& r : blob.regions) rec->regions.push_back(UcxPeer::Bounds{r.base, r.bytes});
    KVTIER_ASSIGN_OR_RETURN(UcxAddress peer_address, parse_address(blob.identity.name, blob.address));
    if (!host_.boot_id.empty() && peer_address.host == host_ && peer_address.pid != 0)
      rec->pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer_address.pid), 0));
    const std::vector<char> address = padded(peer_address.worker);
    ucp_ep_params_t ep{};
    ep.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::on_ep_error;
    ep.err_handler.arg = this;
    if (!options_.tls.empty() && options_.tls.find("tcp") == std::string::npos &&
        options_.tls.find("all") == std::string::npos)
      ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
    ucs_status_t st = ucp_ep_create(worker_, &ep, &rec->ep);
    if (st == UCS_ERR_UNREACHABLE && (ep.field_mask & UCP_EP_PARAM_FIELD_ERR_HANDLER) != 0) {
      // Shared-memory lanes have no peer failure handling; there a dead peer is found by the protocol's
      // leases instead of by the endpoint.
      ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
      st = ucp_ep_create(worker_, &ep, &rec->ep);
    }
    if (st != UCS_OK)
      return Unavailable(fmt::format("ucp_ep_create to peer '{}': {}", blob.identity.name, ucs_status_string(st)));
    for (std::size_t i = 0; i < blob.regions.size(); ++i) {
      ucp_rkey_h k = nullptr;
      if (!blob.regions[i].key.empty()) {
        const std::vector<char> key = padded(blob.regions[i].key);
        st = ucp_ep_rkey_unpack(rec->ep, key.data(), &k);
        if (st != UCS_OK) {
          for (ucp_rkey_h r : rec->rkeys)
            if (r != nullptr) ucp_rkey_destroy(r);
          close_ep_locked(rec->ep);
          return InvalidArgument(fmt::format("peer '{}' region {}: rkey does not unpack: {}", blob.identity.name, i,
                                             ucs_status_string(st)));
        }
      }
      rec->rkeys.push_back(k);
    }
    peers_[peer] = std::move(rec);
    return Status::Ok();
  }

  Status backend_post(XferId id, XferOp op, PeerId peer, std::vector<detail::ResolvedOp> ops,
                      std::string notification) override {
    {
      std::lock_guard lock(ucx_mu_);
      UcxPeer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
      if (p == nullptr || p->ep == nullptr || p->failed)
        return Unavailable(fmt::format("peer {} is not connected", peer));
      // The base resolved the descriptors against the same regions; checked again here, where the addresses go
      // to UCX, so that no path can hand UCX a range outside what the peer registered.
      for (std::size_t i = 0; i < ops.size(); ++i) {
        const auto& o = ops[i];
        const UcxPeer::Bounds b = o.remote_region < p->regions.size() ? p->regions[o.remote_region] : UcxPeer::Bounds{};
        if (o.remote_addr < b.base || o.remote_addr - b.base > b.bytes || o.bytes > b.bytes - (o.remote_addr - b.base))
          return OutOfRange(fmt::format("descriptor {}: remote [{:#x}, +{}) outside peer '{}' region {} [{:#x}, +{})",
                                        i, o.remote_addr, o.bytes, p->name, o.remote_region, b.base, b.bytes));
      }
      detail::merge_contiguous(ops);
      auto pend = std::make_unique<Pending>();
      Pending* pd = pend.get();
      pd->self = this;
      pd->id = id;
      pd->peer = peer;
      pd->header = make_header(NotifKind::kMessage);
      pd->message = std::move(notification);
      pending_.emplace(id, std::move(pend));
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = &UcxTransport::on_op_done;
      rp.user_data = pd;
      for (std::size_t i = 0; i < ops.size() && pd->error.ok(); ++i) {
        const auto& o = ops[i];
        ucp_rkey_h rkey = o.remote_region < p->rkeys.size() ? p->rkeys[o.remote_region] : nullptr;
        if (rkey == nullptr) {
          pd->error = FailedPrecondition(fmt::format("peer '{}' region {} has no rkey", p->name, o.remote_region));
          break;
        }
        ucs_status_ptr_t r = op == XferOp::kWrite ? ucp_put_nbx(p->ep, o.local_ptr, o.bytes, o.remote_addr, rkey, &rp)
                                                  : ucp_get_nbx(p->ep, o.local_ptr, o.bytes, o.remote_addr, rkey, &rp);
        track(pd, r, op, i, ops.size());
      }
      if (pd->error.ok()) {
        ucp_request_param_t fp = rp;
        fp.cb.send = &UcxTransport::on_flush_done;
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &fp);
        if (UCS_PTR_IS_PTR(r)) {
          ++pd->outstanding;
          pd->requests.push_back(r);
          outstanding_.fetch_add(1);
        } else if (UCS_PTR_IS_ERR(r)) {
          pd->error = request_error("flush", UCS_PTR_STATUS(r));
        } else {
          pd->flushed = true;
        }
      }
      const bool failed_to_post = !pd->error.ok();
      pd->posting = false;
      if (failed_to_post) send_locked(peer, NotifKind::kFailedToPost, pd->message).ignore_error();
      advance(pd);
    }
    wake();
    return Status::Ok();
  }

  Status backend_send(PeerId peer, NotifKind kind, std::string message) override {
    {
      std::lock_guard lock(ucx_mu_);
      KVTIER_RETURN_IF_ERROR(send_locked(peer, kind, std::move(message)));
    }
    wake();
    return Status::Ok();
  }

  bool backend_disconnect(PeerId peer) override {
    void* closing = nullptr;
    bool revoked = false;
    {
      std::lock_guard lock(ucx_mu_);
      UcxPeer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
      if (p == nullptr) return true;
      revoked = p->gone();
      p->failed = true;
      if (p->ep != nullptr) {
        // Forced: the peer may be dead. UCX completes every request still on the endpoint with an error, so
        // transfers that would wait forever on a dead peer (lanes without failure detection) become quiescent.
        ucp_request_param_t cp{};
        cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &cp);
        if (UCS_PTR_IS_PTR(r)) closing = r;
        p->ep = nullptr;
      }
    }
    wake();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    bool closed = true;
    for (bool done = closing == nullptr; !done;) {
      std::lock_guard lock(ucx_mu_);
      const bool late = std::chrono::steady_clock::now() > deadline;
      if (ucp_request_check_status(closing) != UCS_INPROGRESS || late) {
        closed = !late;
        ucp_request_free(closing);
        done = true;
      } else {
        ucp_worker_progress(worker_);
      }
    }
    // Requests may still use the keys when the close did not finish: those are leaked rather than freed under them.
    if (closed) {
      std::lock_guard lock(ucx_mu_);
      UcxPeer* p = peers_[peer].get();
      for (ucp_rkey_h k : p->rkeys)
        if (k != nullptr) ucp_rkey_destroy(k);
      p->rkeys.clear();
    }
    // RMA is one-sided: closing our endpoint does not stop a live peer's puts into our memory (on shared memory
    // the peer copies itself). Only the peer's end proves it: its process gone, or its connection failed.
    return revoked;
  }
  // Where UCX maps the peer's memory into this process (ucp_rkey_ptr: its shared-memory transports, for memory the
  // peer allocated through UCX, allocate_host), this process reaches the region with its own loads and stores.
  // The mapping lives as long as the peer's key, which disconnect_peer destroys: a caller must be done with the
  // address before it disconnects the peer (pd.h's host direct lane waits for its copies).
  Result<void*> backend_peer_address(PeerId peer, std::uint32_t region, const detail::Blob::Region& r) override {
    std::lock_guard lock(ucx_mu_);
    UcxPeer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
    if (p == nullptr || p->ep == nullptr) return NotFound(fmt::format("peer {} is not connected", peer));
    ucp_rkey_h rkey = region < p->rkeys.size() ? p->rkeys[region] : nullptr;
    if (rkey == nullptr) return NotFound(fmt::format("peer '{}' region {} has no key", p->name, region));
    void* local = nullptr;
    const ucs_status_t st = ucp_rkey_ptr(rkey, r.base, &local);
    if (st != UCS_OK || local == nullptr)
      return NotSupported(
          fmt::format("peer '{}' region {}: UCX does not map it here ({}); only memory the peer allocated through UCX "
                      "(allocate_host) on a shared-memory transport is",
                      p->name, region, ucs_status_string(st)));
    return local;
  }
  bool backend_revoked(PeerId peer) const override {
    std::lock_guard lock(ucx_mu_);
    return peer < peers_.size() && peers_[peer] && peers_[peer]->gone();
  }

  void backend_abort(XferId id) override {
    std::lock_guard lock(ucx_mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    // RMA requests of most transports cannot be cancelled; those that can complete with UCS_ERR_CANCELED.
    for (void* r : it->second->requests) ucp_request_cancel(worker_, r);
  }

 private:
  std::string make_header(NotifKind kind) const {
    std::string h(1, static_cast<char>(kind));
    h += identity().name;
    return h;
  }

  // The request of descriptor `i` of `n`; its description is formatted only for an error (posting thousands of
  // descriptors must not format a string each).
  void track(Pending* pd, ucs_status_ptr_t r, XferOp op, std::size_t i, std::size_t n) {
    if (UCS_PTR_IS_PTR(r)) {
      ++pd->outstanding;
      pd->requests.push_back(r);
      outstanding_.fetch_add(1);
    } else if (UCS_PTR_IS_ERR(r)) {
      pd->error = request_error(fmt::format("{} {} of {}", xfer_op_name(op), i, n), UCS_PTR_STATUS(r));
    }
  }

  Status send_locked(PeerId peer, NotifKind kind, std::string message) {
    UcxPeer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
    if (p == nullptr || p->ep == nullptr || p->failed)
      return Unavailable(fmt::format("peer {} is not connected", peer));
    sends_.emplace_back();
    auto pos = std::prev(sends_.end());
    SendBuf& b = *pos;
    b.self = this;
    b.header = make_header(kind);
    b.message = std::move(message);
    b.pos = pos;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxTransport::on_send_done;
    rp.user_data = &b;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r =
        ucp_am_send_nbx(p->ep, kAmId, b.header.data(), b.header.size(), b.message.data(), b.message.size(), &rp);
    if (UCS_PTR_IS_PTR(r)) {
      outstanding_.fetch_add(1);
      return Status::Ok();
    }
    sends_.erase(pos);
    if (UCS_PTR_IS_ERR(r)) return request_error("notification send", UCS_PTR_STATUS(r));
    return Status::Ok();
  }

  // Moves a transfer on after a completion (ucx_mu_ held).
  void advance(Pending* pd) {
    if (pd->posting) return;
    if (pd->error.ok() && pd->flushed && pd->outstanding == 0 && !pd->notify_started) {
      pd->notify_started = true;
      UcxPeer* p = peers_[pd->peer].get();
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      rp.cb.send = &UcxTransport::on_notify_done;
      rp.user_data = pd;
      rp.flags = UCP_AM_SEND_FLAG_EAGER;
      ucs_status_ptr_t r = p->ep == nullptr ? UCS_STATUS_PTR(UCS_ERR_NOT_CONNECTED)
                                            : ucp_am_send_nbx(p->ep, kAmId, pd->header.data(), pd->header.size(),
                                                              pd->message.data(), pd->message.size(), &rp);
      if (UCS_PTR_IS_PTR(r)) {
        ++pd->outstanding;
        pd->requests.push_back(r);
        outstanding_.fetch_add(1);
      } else if (UCS_PTR_IS_ERR(r)) {
        pd->error = request_error("notification", UCS_PTR_STATUS(r));
      } else {
        pd->notified = true;
      }
    }
    if (!pd->outcome_set && (!pd->error.ok() || pd->notified)) {
      pd->outcome_set = true;
      finish_xfer(pd->id, pd->error);
    }
    if (pd->outstanding == 0 && pd->outcome_set) {
      const XferId id = pd->id;
      pending_.erase(id);  // frees pd
      set_quiescent(id);
    }
  }

  void complete(Pending* pd, void* request, ucs_status_t st, std::string_view what) {
    --pd->outstanding;
    outstanding_.fetch_sub(1);
    std::erase(pd->requests, request);
    ucp_request_free(request);
    if (st != UCS_OK && pd->error.ok()) pd->error = request_error(what, st);
  }

  static void on_op_done(void* request, ucs_status_t st, void* user) {
    auto* pd = static_cast<Pending*>(user);
    pd->self->complete(pd, request, st, "rma");
    pd->self->advance(pd);
  }
  static void on_flush_done(void* request, ucs_status_t st, void* user) {
    auto* pd = static_cast<Pending*>(user);
    pd->self->complete(pd, request, st, "flush");
    if (st == UCS_OK) pd->flushed = true;
    pd->self->advance(pd);
  }
  static void on_notify_done(void* request, ucs_status_t st, void* user) {
    auto* pd = static_cast<Pending*>(user);
    pd->self->complete(pd, request, st, "notification");
    if (st == UCS_OK) pd->notified = true;
    pd->self->advance(pd);
  }
  static void on_send_done(void* request, ucs_status_t st, void* user) {
    auto* b = static_cast<SendBuf*>(user);
    UcxTransport* self = b->self;
    ucp_request_free(request);
    self->outstanding_.fetch_sub(1);
    self->sends_.erase(b->pos);
  }

  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (header_length < 1 || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      // Every sender forces eager messages; anything else is not ours.
      log(LogLevel::kWarning, "transport", "UCX: dropped a malformed notification");
      return UCS_OK;
    }
    const auto* h = static_cast<const char*>(header);
    const auto kind = static_cast<std::uint8_t>(h[0]);
    if (kind > static_cast<std::uint8_t>(NotifKind::kFailedToPost)) return UCS_OK;
    self->deliver(Notification{std::string(h + 1, header_length - 1), static_cast<NotifKind>(kind),
                               std::string(static_cast<const char*>(data), length)});
    return UCS_OK;
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<UcxTransport*>(arg);
    for (std::size_t i = 0; i < self->peers_.size(); ++i) {
      UcxPeer* p = self->peers_[i].get();
      if (p == nullptr || p->ep != ep) continue;
      p->failed = true;
      p->conn_failed = true;
      self->mark_peer_failed(static_cast<PeerId>(i), Unavailable(fmt::format("connection to peer '{}' failed: {}",
                                                                             p->name, ucs_status_string(st))));
      // The endpoint is closed later (destructor); its requests complete with errors now.
    }
  }

  void close_ep_locked(ucp_ep_h ep) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
  }

  void wake() {
    const std::uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof one);
  }

  void progress_loop() {
    while (!stop_.load()) {
      ucs_status_t armed = UCS_OK;
      {
        std::lock_guard lock(ucx_mu_);
        while (ucp_worker_progress(worker_) != 0) {
        }
        if (outstanding_.load() > 0) {
          armed = UCS_ERR_BUSY;  // keep spinning while our requests are in flight
        } else {
          armed = ucp_worker_arm(worker_);
        }
      }
      if (armed == UCS_ERR_BUSY) {
        std::this_thread::yield();
        continue;
      }
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      // The timeout bounds the damage of a missed wakeup; events normally end the poll.
      (void)::poll(fds, 2, 2);
      if (fds[1].revents & POLLIN) {
        std::uint64_t v = 0;
        (void)!read(wake_fd_, &v, sizeof v);
      }
    }
  }

  const UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  int wake_fd_ = -1;
  std::string address_;
  HostIdentity host_;
  mutable std::mutex ucx_mu_;
  std::unordered_map<RegionId, ucp_mem_h> memh_;  // null for regions inside a host allocation
  struct HostAllocation {
    std::byte* base = nullptr;
    std::uint64_t bytes = 0;
    ucp_mem_h memh = nullptr;
    std::string key;  // packed once: every region inside shares it
  };
  std::vector<HostAllocation> host_allocs_;  // allocate_host's memory, unmapped when the transport is destroyed
  std::vector<std::unique_ptr<UcxPeer>> peers_;
  std::unordered_map<XferId, std::unique_ptr<Pending>> pending_;
  std::list<SendBuf> sends_;
  std::atomic<int> outstanding_{0};
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_ucx_transport(AgentIdentity identity, UcxOptions options) {
  if (identity.name.empty()) return InvalidArgument("agent name is empty");
  KVTIER_RETURN_IF_ERROR(detail::check_peer_secret(options.peer_secret));
  if (identity.tp_size == 0 || identity.tp_rank >= identity.tp_size)
    return InvalidArgument(
        fmt::format("tensor-parallel rank {} of size {}: need rank < size", identity.tp_rank, identity.tp_size));
  if (options.tcp_segment_bytes != 0 &&
      (options.tcp_segment_bytes < kMinTcpSegment || options.tcp_segment_bytes > kMaxTcpSegment))
    return InvalidArgument(fmt::format("tcp_segment_bytes {}: 0 (UCX's defaults) or {} to {}",
                                       options.tcp_segment_bytes, kMinTcpSegment, kMaxTcpSegment));
  auto t = std::make_unique<UcxTransport>(std::move(identity), std::move(options));
  KVTIER_RETURN_IF_ERROR(t->start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvtier::transport
