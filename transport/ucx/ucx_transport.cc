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
// The active-message data path (UcxDataPath::kActiveMessages, TCP's default): UCX 1.13 carries RMA over TCP as
// active messages that the target's progress thread copies into place, without bounds. Instead the target's blob
// carries a random token per region, and a write sends each descriptor as an active message on kDataAmId whose
// header names (transfer, index, region, token, address, bytes, sender): the target checks the token and the
// region's bounds, then copies an eager message's bytes or receives a rendezvous one into place
// (ucp_am_recv_data_nbx; UCX copies its fragments there over TCP, and lands them zero-copy where a lane has RMA).
// Once every descriptor's send has
// completed the writer sends the write's end (kCtlAmId: count, notification); the target holds it, and every
// later message of that writer, until the write's bytes have landed, then delivers the notification and
// acknowledges (or says why not, without delivering it); the writer's transfer completes on the acknowledgement.
// A read sends one request naming every descriptor; the target checks them all, then answers each as a data
// message that lands in the reader's own destinations (matched by transfer, a random nonce and index, never by an
// address the target sends). After disconnect_peer the target lands and answers nothing more of that peer.
//
// Peer failure: endpoints use UCP_ERR_HANDLING_MODE_PEER where the lanes support it (TCP; not shared memory,
// where the endpoint is created without it); the error callback marks the peer failed (later posts are
// refused); its outstanding requests complete with errors, which fails their transfers. Where nothing reports a
// dead peer (shared memory), disconnect_peer force-closes the endpoint so its requests complete with errors; those
// that UCX leaves waiting for a dead process's answers end once that process has exited (abandon_dead_peers_locked).
// Whether a disconnected peer can still write here (peer_revoked): RMA is one-sided, so only the peer's end
// proves it: its connection failed, or its process (same host: a pidfd from the pid in its address) exited. On
// the active-message path this agent lands the peer's bytes itself, so its refusal and the end of its receives
// in flight prove it.
#include <fmt/format.h>
#include <poll.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/byte_codec.h"
#include "kvtier/core/log.h"
#include "kvtier/transport/ipc.h"
#include "transport/transport_base.h"

namespace kvtier::transport {
namespace {

constexpr unsigned kAmId = 0x4b56;  // "KV"
// The active-message data path (UcxDataPath::kActiveMessages): the bytes of writes and of reads' answers, and its
// control messages (a write's end, its acknowledgement, a read's request, a refused read).
constexpr unsigned kDataAmId = 0x4b57, kCtlAmId = 0x4b58;
enum class DataKind : std::uint8_t { kWrite = 1, kReadAnswer = 2 };
enum class CtlKind : std::uint8_t { kWriteDone = 1, kWriteAck = 2, kReadRequest = 3, kReadRefused = 4 };
// A region's key on that path: this magic and a random token that a peer learns only from the blob.
constexpr std::string_view kAmKeyMagic = "KVAM1";
constexpr std::size_t kAmTokenBytes = 16;
// A read request's entry: region (u32), its token, address (u64), bytes (u64).
constexpr std::size_t kReadEntryBytes = 4 + kAmTokenBytes + 8 + 8;
// Bytes of a write that arrived without the write's end message are forgotten after this long (the writer failed
// before it sent the end); a write's end that waits this long for its bytes fails (nothing else of that peer's
// messages is delivered while it waits: notifications keep their order).
constexpr auto kOrphanBytesAfter = std::chrono::seconds(60);
constexpr auto kWriteEndWaitsAtMost = std::chrono::seconds(30);

bool is_am_key(std::string_view key) {
  return key.size() == kAmKeyMagic.size() + kAmTokenBytes && key.substr(0, kAmKeyMagic.size()) == kAmKeyMagic;
}

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  randombytes_buf(&v, sizeof v);
  return v;
}

// A status carried in an acknowledgement or a refusal: its code (unknown codes read as kInternal) and message.
Status status_from_wire(std::uint8_t code, std::string message) {
  if (code == 0) return Status::Ok();
  if (code > static_cast<std::uint8_t>(StatusCode::kInternal)) return Internal(std::move(message));
  return Status(static_cast<StatusCode>(code), std::move(message));
}
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
  std::unordered_set<void*> requests;  // for cancellation (completed ones are removed)
  // The active-message data path (the peer's regions have tokens): a write's per-descriptor headers (alive until
  // their sends complete), then its end message and the peer's acknowledgement; a read's request, then the
  // answers landing into `ops`.
  bool am = false;
  XferOp op = XferOp::kWrite;
  std::uint64_t nonce = 0;  // echoed by the peer: answers and acknowledgements of other transfers do not match
  std::vector<std::string> headers;
  std::vector<detail::ResolvedOp> ops;  // a read's destinations
  std::vector<std::uint8_t> landed;     // a read's descriptors whose answer arrived (or is arriving)
  std::size_t landed_count = 0;         // ... and has landed
  bool end_started = false;             // a write's end message was sent
  bool acknowledged = false;            // ... and the peer acknowledged every byte
  // Its peer's process ended with requests of it outstanding that UCX never completes (abandon_dead_peers_locked):
  // the transfer ended failed and quiescent; the requests and this record stay until the transport goes.
  bool abandoned = false;
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

// The mutex around UCX. The progress thread takes it again and again while bytes flow; a plain mutex lets it
// win every time, so a caller (a heartbeat's send, a post) could wait for a whole transfer. Callers announce
// themselves before they block, and the progress thread lets go until none waits.
class HandoffMutex {
 public:
  void lock() {
    waiting_.fetch_add(1, std::memory_order_relaxed);
    mu_.lock();
    waiting_.fetch_sub(1, std::memory_order_relaxed);
  }
  void unlock() { mu_.unlock(); }
  // Another thread waits for the mutex (the holder's hint to let go soon).
  bool contended() const { return waiting_.load(std::memory_order_relaxed) > 0; }

 private:
  std::mutex mu_;
  std::atomic<int> waiting_{0};
};

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
  // A second endpoint for send_urgent_notification (null: ep): its own connection, so that a heartbeat does not
  // wait behind the bytes queued on ep.
  ucp_ep_h urgent = nullptr;
  std::vector<ucp_rkey_h> rkeys;    // by peer region index (null for empty keys and active-message tokens)
  std::vector<std::string> tokens;  // by peer region index: the active-message path's tokens (empty otherwise)
  bool am = false;                  // the peer's regions take the active-message data path
  struct Bounds {
    std::uint64_t base = 0, bytes = 0;
  };
  std::vector<Bounds> regions;  // the blob's regions: every remote address is checked against them
  std::string name;
  bool failed = false;
  bool conn_failed = false;  // the endpoint's error callback ran: the connection (and so the peer) is gone
  // When this transport first saw the disconnected peer's process gone, and how many dry progress calls it had
  // made by then (abandon_dead_peers_locked).
  std::optional<std::chrono::steady_clock::time_point> gone_seen;
  std::uint64_t dry_at_gone = 0;
};

class UcxTransport final : public detail::TransportBase {
 public:
  UcxTransport(AgentIdentity identity, UcxOptions options)
      : TransportBase(std::move(identity), options.peer_secret),
        options_(std::move(options)),
        am_mode_(options_.data_path == UcxDataPath::kActiveMessages ||
                 (options_.data_path == UcxDataPath::kAuto && names_only_tcp(options_.tls))) {}

  // "tcp", "tcp,self", "self,tcp": the lists whose RMA UCX 1.13 can only emulate.
  static bool names_only_tcp(std::string_view tls) {
    bool tcp = false;
    while (!tls.empty()) {
      const std::size_t comma = tls.find(',');
      const std::string_view item = tls.substr(0, comma);
      if (item == "tcp") {
        tcp = true;
      } else if (item != "self") {
        return false;
      }
      tls = comma == std::string_view::npos ? std::string_view{} : tls.substr(comma + 1);
    }
    return tcp;
  }

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
    // The active-message data path is served whatever this agent's own choice: a peer follows the kind of key in
    // the target's blob, and a target without tokens refuses what names none.
    hp.id = kDataAmId;
    hp.cb = &UcxTransport::on_data;
    if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK)
      return ucs_error("ucp_worker_set_am_recv_handler (data)", st);
    hp.id = kCtlAmId;
    hp.cb = &UcxTransport::on_ctl;
    if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK)
      return ucs_error("ucp_worker_set_am_recv_handler (control)", st);
    if (sodium_init() < 0) return Internal("libsodium did not initialise (the data path's tokens)");

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
      // Messages already sent (a closing endpoint's last words: the prefill/decode protocol's 'X' and 'Q') get up
      // to a second to leave first: a forced close drops what is still queued.
      for (const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);;) {
        {
          std::lock_guard lock(ucx_mu_);
          if (sends_.empty()) break;
          ucp_worker_progress(worker_);
        }
        if (std::chrono::steady_clock::now() > flush_deadline) break;
        std::this_thread::yield();
      }
      std::vector<void*> closing;
      {
        std::lock_guard lock(ucx_mu_);
        closing.swap(urgent_closing_);
        for (auto& [id, p] : pending_)
          for (void* r : p->requests) ucp_request_cancel(worker_, r);
        // Transfers of the active-message path waiting for the peer with no request in flight end now.
        std::vector<XferId> waiting;
        for (const auto& [id, p] : pending_)
          if (p->am) waiting.push_back(id);
        for (XferId id : waiting) {
          auto it = pending_.find(id);
          if (it == pending_.end()) continue;
          if (it->second->error.ok()) it->second->error = Aborted("the transport is shutting down");
          advance(it->second.get());
        }
        for (auto& peer : peers_) {
          if (!peer || peer->ep == nullptr) continue;
          for (ucp_rkey_h k : peer->rkeys)
            if (k != nullptr) ucp_rkey_destroy(k);
          peer->rkeys.clear();
          for (ucp_ep_h* ep : {&peer->ep, &peer->urgent})
            if (*ep != nullptr)
              if (void* r = force_close(*ep); r != nullptr) closing.push_back(r);
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
      // Receives into this agent's memory and answers from it (the active-message path), bounded.
      std::lock_guard lock(ucx_mu_);
      if (!settle_requests_locked([](const auto&) { return true; }))
        log(LogLevel::kWarning, "transport", "UCX receives or answers still in flight at shutdown after 5 s");
    }
    stop_.store(true);
    wake();
    if (progress_.joinable()) progress_.join();
    bool abandoned = false;
    if (worker_ != nullptr) {
      std::lock_guard lock(ucx_mu_);
      if (outstanding_.load() > 0 || !sends_.empty()) {
        // Requests that never completed (sends to a dead shared-memory peer wait in UCX's pending queues for good):
        // purging them in ucp_worker_destroy crashes inside UCX (ucp_request_memory_dereg), so the worker, its
        // context and their mappings are left to the process's exit. No thread progresses them any more.
        abandoned = true;
        log(LogLevel::kWarning, "transport",
            fmt::format("UCX: {} requests still in flight at shutdown (a dead peer's): the worker is not destroyed",
                        outstanding_.load()));
      } else {
        ucp_worker_destroy(worker_);
        for (auto& [id, memh] : memh_)
          if (memh != nullptr) ucp_mem_unmap(context_, memh);
        for (HostAllocation& a : host_allocs_) ucp_mem_unmap(context_, a.memh);
      }
      worker_ = nullptr;
    }
    if (context_ != nullptr && !abandoned) ucp_cleanup(context_);
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
    if (am_mode_) {
      // No UCX key leaves this agent: peers reach the region only through messages this agent checks.
      LocalRegion rec{static_cast<std::byte*>(region.base), region.bytes, std::string(kAmTokenBytes, '\0')};
      randombytes_buf(rec.token.data(), rec.token.size());
      std::string key(kAmKeyMagic);
      key += rec.token;
      local_[id] = std::move(rec);
      memh_[id] = nullptr;
      return key;
    }
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
    if (local_.erase(id) != 0) {
      // Nothing lands in it or is answered from it any more; what is under way is cancelled and waited for.
      const auto touches = [id](const auto& op) { return op.region == id; };
      settle_requests_locked(touches);
    }
    auto it = memh_.find(id);
    if (it == memh_.end()) return;
    if (it->second != nullptr) ucp_mem_unmap(context_, it->second);
    memh_.erase(it);
  }

  Result<std::string> backend_address() override { return address_; }

  Status backend_check_blob(const detail::Blob& blob) override {
    if (auto a = parse_address(blob.identity.name, blob.address); !a.ok()) return a.status();
    std::size_t tokens = 0, keys = 0;
    for (std::size_t i = 0; i < blob.regions.size(); ++i) {
      if (blob.regions[i].bytes == 0) continue;
      if (is_am_key(blob.regions[i].key)) {
        ++tokens;
      } else {
        KVTIER_RETURN_IF_ERROR(check_ucx_key(blob.identity.name, i, blob.regions[i].key));
        ++keys;
      }
    }
    if (tokens != 0 && keys != 0)
      return InvalidArgument(
          fmt::format("peer '{}': {} regions with UCX keys and {} with active-message tokens; an "
                      "agent uses one data path",
                      blob.identity.name, keys, tokens));
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
    // Where it cannot be created, urgent messages take ep (ordered behind its traffic, as before).
    if (ucp_ep_create(worker_, &ep, &rec->urgent) != UCS_OK) rec->urgent = nullptr;
    revoked_names_.erase(rec->name);  // loaded again from a fresh blob
    rec->tokens.resize(blob.regions.size());
    for (std::size_t i = 0; i < blob.regions.size(); ++i) {
      ucp_rkey_h k = nullptr;
      if (is_am_key(blob.regions[i].key)) {
        rec->tokens[i] = blob.regions[i].key.substr(kAmKeyMagic.size());
        rec->am = true;
      } else if (!blob.regions[i].key.empty()) {
        const std::vector<char> key = padded(blob.regions[i].key);
        st = ucp_ep_rkey_unpack(rec->ep, key.data(), &k);
        if (st != UCS_OK) {
          for (ucp_rkey_h r : rec->rkeys)
            if (r != nullptr) ucp_rkey_destroy(r);
          close_ep_locked(rec->ep);
          if (rec->urgent != nullptr) close_ep_locked(rec->urgent);
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
      const bool am = p->am;
      if (am) post_active_messages_locked(pd, op, *p, std::exchange(ops, {}));
      for (std::size_t i = 0; !am && i < ops.size() && pd->error.ok(); ++i) {
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
      if (!am && pd->error.ok()) {
        ucp_request_param_t fp = rp;
        fp.cb.send = &UcxTransport::on_flush_done;
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &fp);
        if (UCS_PTR_IS_PTR(r)) {
          ++pd->outstanding;
          pd->requests.insert(r);
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

  Status backend_send_urgent(PeerId peer, std::string message) override {
    {
      std::lock_guard lock(ucx_mu_);
      KVTIER_RETURN_IF_ERROR(send_locked(peer, NotifKind::kMessage, std::move(message), /*urgent=*/true));
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
      // Forced: the peer may be dead. UCX completes every request still on the endpoint with an error, so
      // transfers that would wait forever on a dead peer (lanes without failure detection) become quiescent.
      if (p->ep != nullptr) closing = force_close(p->ep);
      // The urgent endpoint's messages carry no bytes of a transfer: its close needs no wait (freed at shutdown).
      if (p->urgent != nullptr)
        if (void* r = force_close(p->urgent); r != nullptr) urgent_closing_.push_back(r);
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
    if (am_mode_) return revoke_sender(peer) || revoked;
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
    if (p->am)
      return NotSupported(
          fmt::format("peer '{}' region {}: reached through active messages, not mapped here", p->name, region));
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
    if (peer >= peers_.size() || !peers_[peer]) return false;
    if (peers_[peer]->gone()) return true;
    // This agent lands the peer's bytes itself: once it refuses them and its receives of them have ended, nothing
    // of the peer's can land here.
    const std::string& name = peers_[peer]->name;
    return am_mode_ && revoked_names_.count(name) != 0 &&
           std::none_of(recvs_.begin(), recvs_.end(), [&](const RecvOp& op) { return op.sender == name; });
  }

  void backend_abort(XferId id) override {
    std::lock_guard lock(ucx_mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    // RMA requests of most transports cannot be cancelled; those that can complete with UCS_ERR_CANCELED.
    Pending* pd = it->second.get();
    for (void* r : pd->requests) ucp_request_cancel(worker_, r);
    // A transfer of the active-message path may wait for the peer with no request of its own in flight (an
    // acknowledgement, a read's answers): it ends now, and what the peer sends for it later is dropped.
    if (pd->am && pd->error.ok()) {
      pd->error = Aborted(fmt::format("transfer {} aborted", id));
      advance(pd);
    }
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
      pd->requests.insert(r);
      outstanding_.fetch_add(1);
    } else if (UCS_PTR_IS_ERR(r)) {
      pd->error = request_error(fmt::format("{} {} of {}", xfer_op_name(op), i, n), UCS_PTR_STATUS(r));
    }
  }

  // `urgent`: on the peer's urgent endpoint where it has one (send_urgent_notification).
  Status send_locked(PeerId peer, NotifKind kind, std::string message, bool urgent = false) {
    UcxPeer* p = peer < peers_.size() ? peers_[peer].get() : nullptr;
    if (p == nullptr || p->ep == nullptr || p->failed)
      return Unavailable(fmt::format("peer {} is not connected", peer));
    const ucs_status_t st =
        send_bare(urgent && p->urgent != nullptr ? p->urgent : p->ep, kAmId, make_header(kind), std::move(message));
    if (st != UCS_OK) return request_error("notification send", st);
    return Status::Ok();
  }

  // An eager active message outside any transfer: its buffers live in sends_ until the send completes.
  ucs_status_t send_bare(ucp_ep_h ep, unsigned am_id, std::string header, std::string message) {
    sends_.emplace_back();
    auto pos = std::prev(sends_.end());
    SendBuf& b = *pos;
    b.self = this;
    b.header = std::move(header);
    b.message = std::move(message);
    b.pos = pos;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxTransport::on_send_done;
    rp.user_data = &b;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, am_id, b.header.data(), b.header.size(), b.message.data(), b.message.size(), &rp);
    if (UCS_PTR_IS_PTR(r)) {
      outstanding_.fetch_add(1);
      return UCS_OK;
    }
    sends_.erase(pos);
    return UCS_PTR_IS_ERR(r) ? UCS_PTR_STATUS(r) : UCS_OK;
  }

  // ---- the active-message data path (UcxDataPath::kActiveMessages; every function with ucx_mu_ held) ----

  struct LocalRegion {
    std::byte* base = nullptr;
    std::uint64_t bytes = 0;
    std::string token;
  };
  static constexpr RegionId kNoRegion = std::numeric_limits<RegionId>::max();
  // A rendezvous receive in flight: a peer's write landing in a local region, or the answer to a read of ours.
  struct RecvOp {
    UcxTransport* self = nullptr;
    void* request = nullptr;
    RegionId region = kNoRegion;  // a write's target (a read's answer lands in memory of the transfer's own)
    Pending* read = nullptr;      // the read it answers
    std::uint32_t index = 0;
    std::string sender;  // a write's sender and transfer
    XferId xfer = 0;
    std::list<RecvOp>::iterator pos;
  };
  // The answer to a peer's read in flight from a local region: its header lives until the send completes.
  struct ServeOp {
    UcxTransport* self = nullptr;
    void* request = nullptr;
    RegionId region = kNoRegion;
    std::string sender;  // the reader
    std::string header;
    std::list<ServeOp>::iterator pos;
  };
  // A peer's write as it lands here.
  struct Incoming {
    std::uint64_t landed = 0;
    int in_flight = 0;
    Status error;
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
  };
  // What a peer sent, in its order: a notification, or the end of a write (with its notification), which waits
  // for the write's bytes before it and every later message of that peer is delivered.
  struct Queued {
    Notification note;
    bool write_end = false;
    XferId xfer = 0;
    std::uint64_t nonce = 0;
    std::uint64_t count = 0;
    ucp_ep_h reply = nullptr;
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
  };

  // Posts a transfer to a peer whose regions take active messages: a write sends each descriptor as a message
  // that names (region, token, address, bytes); a read sends one request naming them all.
  void post_active_messages_locked(Pending* pd, XferOp op, UcxPeer& p, std::vector<detail::ResolvedOp> ops) {
    pd->am = true;
    pd->op = op;
    pd->nonce = random_u64();
    for (const auto& o : ops)
      if (o.remote_region >= p.tokens.size() || p.tokens[o.remote_region].empty()) {
        pd->error = FailedPrecondition(fmt::format("peer '{}' region {} has no token", p.name, o.remote_region));
        return;
      }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = &UcxTransport::on_op_done;
    rp.user_data = pd;
    if (op == XferOp::kWrite) {
      pd->headers.reserve(ops.size());  // the headers stay where UCX was given them
      for (std::size_t i = 0; i < ops.size() && pd->error.ok(); ++i) {
        const auto& o = ops[i];
        codec::ByteWriter<std::string> w;
        w.u8(static_cast<std::uint8_t>(DataKind::kWrite)).u64(pd->id).u32(static_cast<std::uint32_t>(i));
        w.u32(o.remote_region).raw(p.tokens[o.remote_region]).u64(o.remote_addr).u64(o.bytes).str(identity().name);
        pd->headers.push_back(std::move(w.out));
        const std::string& h = pd->headers.back();
        ucp_request_param_t dp = rp;
        set_data_protocol(dp, o.bytes);
        track(pd, ucp_am_send_nbx(p.ep, kDataAmId, h.data(), h.size(), o.local_ptr, o.bytes, &dp), op, i, ops.size());
      }
      return;
    }
    codec::ByteWriter<std::string> w, entries;
    w.u8(static_cast<std::uint8_t>(CtlKind::kReadRequest)).u64(pd->id).u64(pd->nonce).u64(ops.size());
    w.str(identity().name);
    for (const auto& o : ops)
      entries.u32(o.remote_region).raw(p.tokens[o.remote_region]).u64(o.remote_addr).u64(o.bytes);
    pd->headers = {std::move(w.out), std::move(entries.out)};
    pd->ops = std::move(ops);
    pd->landed.assign(pd->ops.size(), 0);
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
    track(pd,
          ucp_am_send_nbx(p.ep, kCtlAmId, pd->headers[0].data(), pd->headers[0].size(), pd->headers[1].data(),
                          pd->headers[1].size(), &rp),
          op, 0, 1);
  }

  // Descriptors of at least kRendezvousBytes go by rendezvous, which lands them in place; smaller ones eagerly
  // (copied out of UCX's receive buffer). UCX's own threshold sends megabytes eagerly over TCP, reassembled in
  // buffers it allocates per message (page faults and a copy of every byte).
  static constexpr std::uint64_t kRendezvousBytes = 64 * 1024;
  static void set_data_protocol(ucp_request_param_t& rp, std::uint64_t bytes) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = bytes >= kRendezvousBytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  }

  // A write whose descriptors' sends have all completed: its end message carries the count and the notification.
  void send_write_end(Pending* pd) {
    pd->end_started = true;
    codec::ByteWriter<std::string> w;
    w.u8(static_cast<std::uint8_t>(CtlKind::kWriteDone)).u64(pd->id).u64(pd->nonce).u64(pd->headers.size());
    w.str(identity().name);
    pd->header = std::move(w.out);
    send_transfer_message(pd, kCtlAmId, &UcxTransport::on_op_done, UCP_AM_SEND_FLAG_REPLY, "write end");
  }

  // Sends the transfer's `header` and `message` eagerly as an active message on `am_id` to its peer, as a request
  // of the transfer (`done` on completion); true when it completed at once.
  bool send_transfer_message(Pending* pd, unsigned am_id, ucp_send_nbx_callback_t done, std::uint32_t flags,
                             const char* what) {
    UcxPeer* p = peers_[pd->peer].get();
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = done;
    rp.user_data = pd;
    rp.flags = UCP_AM_SEND_FLAG_EAGER | flags;
    ucs_status_ptr_t r = p == nullptr || p->ep == nullptr
                             ? UCS_STATUS_PTR(UCS_ERR_NOT_CONNECTED)
                             : ucp_am_send_nbx(p->ep, am_id, pd->header.data(), pd->header.size(), pd->message.data(),
                                               pd->message.size(), &rp);
    if (UCS_PTR_IS_PTR(r)) {
      ++pd->outstanding;
      pd->requests.insert(r);
      outstanding_.fetch_add(1);
      return false;
    }
    if (UCS_PTR_IS_ERR(r)) {
      pd->error = request_error(what, UCS_PTR_STATUS(r));
      return false;
    }
    return true;
  }

  // A control message to `ep` (a peer's reply endpoint): its buffers live until the send completes.
  void send_control(ucp_ep_h ep, CtlKind kind, XferId xfer, std::uint64_t nonce, const Status& status) {
    if (ep == nullptr) return;
    codec::ByteWriter<std::string> w;
    w.u8(static_cast<std::uint8_t>(kind)).u64(xfer).u64(nonce).u8(static_cast<std::uint8_t>(status.code()));
    // A failed send: the peer is gone, and its transfer fails on its own side.
    (void)send_bare(ep, kCtlAmId, std::move(w.out), status.message());
  }

  // Checks a descriptor a peer names against this agent's region: registered here with active messages, the
  // peer's token equal to the region's, [addr, addr + bytes) inside it.
  // `op`, `xfer`, `peer` and `index` name the descriptor in a refusal; nothing is formatted when it passes (a
  // transfer names thousands).
  Result<RegionId> check_target(const char* op, XferId xfer, const std::string& peer, std::uint64_t index,
                                std::uint32_t region, std::string_view token, std::uint64_t addr,
                                std::uint64_t bytes) const {
    const auto what = [&] { return fmt::format("{} {} of '{}', descriptor {}", op, xfer, peer, index); };
    auto it = local_.find(region);
    if (it == local_.end())
      return NotFound(fmt::format("{}: region {} is not registered here for active messages", what(), region));
    if (token.size() != kAmTokenBytes || sodium_memcmp(token.data(), it->second.token.data(), kAmTokenBytes) != 0)
      return FailedPrecondition(fmt::format("{}: wrong token for region {}", what(), region));
    const auto base = reinterpret_cast<std::uint64_t>(it->second.base);
    if (addr < base || addr - base > it->second.bytes || bytes > it->second.bytes - (addr - base))
      return OutOfRange(fmt::format("{}: [{:#x}, +{}) outside region {} [{:#x}, +{})", what(), addr, bytes, region,
                                    base, it->second.bytes));
    return it->first;
  }

  static ucs_status_t dropped(std::string_view what) {
    log(LogLevel::kWarning, "transport", fmt::format("UCX: dropped {}", what));
    return UCS_OK;  // a rendezvous descriptor not received is released by UCX (the sender's send completes)
  }

  static ucs_status_t on_data(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    return static_cast<UcxTransport*>(arg)->receive_data(header, header_length, data, length, param);
  }
  ucs_status_t receive_data(const void* header, std::size_t header_length, void* data, std::size_t length,
                            const ucp_am_recv_param_t* param) {
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    codec::ByteReader r(std::string_view(static_cast<const char*>(header), header_length), detail::kMaxNameBytes);
    std::uint8_t kind = 0;
    if (!r.u8(kind)) return dropped("a data message without a header");
    if (kind == static_cast<std::uint8_t>(DataKind::kWrite)) {
      std::uint64_t xfer = 0, addr = 0, bytes = 0;
      std::uint32_t index = 0, region = 0;
      std::array<char, kAmTokenBytes> token{};
      std::string sender;
      if (!r.u64(xfer) || !r.u32(index) || !r.u32(region) || !r.raw(token.data(), token.size()) || !r.u64(addr) ||
          !r.u64(bytes) || !r.str(sender) || r.remaining() != 0)
        return dropped("a malformed write");
      if (revoked_names_.count(sender) != 0) return UCS_OK;  // disconnected here: nothing of it lands any more
      Incoming& in = incoming_[{sender, xfer}];
      if (!in.error.ok()) return UCS_OK;
      auto target = check_target("write", xfer, sender, index, region, {token.data(), token.size()}, addr, bytes);
      if (target.ok() && bytes != length)
        target = InvalidArgument(fmt::format("write {} of '{}', descriptor {}: {} bytes announced, {} sent", xfer,
                                             sender, index, bytes, length));
      if (!target.ok()) {
        log(LogLevel::kWarning, "transport", fmt::format("UCX: refused {}", target.status().message()));
        in.error = target.status();
        settle(sender);
        return UCS_OK;
      }
      void* dest = reinterpret_cast<void*>(addr);
      if (!rndv) {
        if (length != 0) std::memcpy(dest, data, length);
        ++in.landed;
        note_peer_progress(sender);
        settle(sender);
        return UCS_OK;
      }
      RecvOp op;
      op.region = *target;
      op.sender = std::move(sender);
      op.xfer = xfer;
      start_receive(data, dest, bytes, std::move(op));
      return UCS_OK;
    }
    if (kind == static_cast<std::uint8_t>(DataKind::kReadAnswer)) {
      std::uint64_t xfer = 0, nonce = 0, bytes = 0;
      std::uint32_t index = 0;
      if (!r.u64(xfer) || !r.u64(nonce) || !r.u32(index) || !r.u64(bytes) || r.remaining() != 0)
        return dropped("a malformed read answer");
      auto it = pending_.find(xfer);
      Pending* pd = it == pending_.end() ? nullptr : it->second.get();
      // Answers of transfers that ended (aborted, failed) or that are not ours are dropped unread.
      if (pd == nullptr || !pd->am || pd->op != XferOp::kRead || pd->nonce != nonce || !pd->error.ok() ||
          index >= pd->ops.size() || pd->landed[index] != 0 || bytes != pd->ops[index].bytes || bytes != length)
        return UCS_OK;
      pd->landed[index] = 1;
      if (!rndv) {
        if (length != 0) std::memcpy(pd->ops[index].local_ptr, data, length);
        ++pd->landed_count;
        if (pd->peer < peers_.size() && peers_[pd->peer]) note_peer_progress(peers_[pd->peer]->name);
        advance(pd);
        return UCS_OK;
      }
      RecvOp op;
      op.read = pd;
      op.index = index;
      start_receive(data, pd->ops[index].local_ptr, bytes, std::move(op));
      return UCS_OK;
    }
    return dropped("a data message of unknown kind");
  }

  void start_receive(void* desc, void* dest, std::uint64_t bytes, RecvOp proto) {
    recvs_.push_back(std::move(proto));
    auto pos = std::prev(recvs_.end());
    RecvOp& op = *pos;
    op.self = this;
    op.pos = pos;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxTransport::on_receive_done;
    rp.user_data = &op;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, desc, dest, bytes, &rp);
    if (UCS_PTR_IS_PTR(r)) {
      op.request = r;
      outstanding_.fetch_add(1);
      if (op.read != nullptr) {
        ++op.read->outstanding;
        op.read->requests.insert(r);
      } else {
        ++incoming_[{op.sender, op.xfer}].in_flight;
      }
      return;
    }
    finish_receive(op, UCS_PTR_IS_ERR(r) ? UCS_PTR_STATUS(r) : UCS_OK);
  }

  static void on_receive_done(void* request, ucs_status_t st, size_t length, void* user) {
    (void)request;
    (void)length;
    auto* op = static_cast<RecvOp*>(user);
    op->self->finish_receive(*op, st);
  }
  void finish_receive(RecvOp& op, ucs_status_t st) {
    if (Pending* pd = op.read; pd != nullptr) {
      if (op.request != nullptr) {
        complete(pd, op.request, st, "read answer");
      } else if (st != UCS_OK && pd->error.ok()) {
        pd->error = request_error("read answer", st);
      }
      if (st == UCS_OK) ++pd->landed_count;
      recvs_.erase(op.pos);
      advance(pd);
      return;
    }
    if (op.request != nullptr) {
      ucp_request_free(op.request);
      outstanding_.fetch_sub(1);
    }
    auto it = incoming_.find({op.sender, op.xfer});
    if (it != incoming_.end()) {
      if (op.request != nullptr) --it->second.in_flight;
      if (st == UCS_OK) {
        ++it->second.landed;
        note_peer_progress(op.sender);
      } else if (it->second.error.ok()) {
        it->second.error = request_error(fmt::format("write {} of '{}'", op.xfer, op.sender), st);
      }
    }
    std::string sender = std::move(op.sender);
    recvs_.erase(op.pos);
    settle(sender);
  }

  static ucs_status_t on_ctl(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    return static_cast<UcxTransport*>(arg)->receive_control(header, header_length, data, length, param);
  }
  ucs_status_t receive_control(const void* header, std::size_t header_length, void* data, std::size_t length,
                               const ucp_am_recv_param_t* param) {
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return dropped("a control message by rendezvous");
    ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
    const std::string_view body(static_cast<const char*>(data), length);
    codec::ByteReader r(std::string_view(static_cast<const char*>(header), header_length), detail::kMaxNameBytes);
    std::uint8_t kind = 0;
    std::uint64_t xfer = 0, nonce = 0;
    if (!r.u8(kind) || !r.u64(xfer) || !r.u64(nonce)) return dropped("a control message without a header");
    switch (static_cast<CtlKind>(kind)) {
      case CtlKind::kWriteDone: {
        Queued q;
        if (!r.u64(q.count) || !r.str(q.note.peer) || r.remaining() != 0 || reply == nullptr)
          return dropped("a malformed write end");
        if (revoked_names_.count(q.note.peer) != 0) {
          send_control(reply, CtlKind::kWriteAck, xfer, nonce,
                       Unavailable(fmt::format("'{}' was disconnected at '{}': write {} not landed", q.note.peer,
                                               identity().name, xfer)));
          return UCS_OK;
        }
        q.note.kind = NotifKind::kMessage;
        q.note.message.assign(body);
        q.write_end = true;
        q.xfer = xfer;
        q.nonce = nonce;
        q.reply = reply;
        enqueue(std::move(q));
        return UCS_OK;
      }
      case CtlKind::kWriteAck:
      case CtlKind::kReadRefused: {
        std::uint8_t code = 0;
        if (!r.u8(code) || r.remaining() != 0) return dropped("a malformed acknowledgement");
        auto it = pending_.find(xfer);
        Pending* pd = it == pending_.end() ? nullptr : it->second.get();
        const XferOp op = static_cast<CtlKind>(kind) == CtlKind::kWriteAck ? XferOp::kWrite : XferOp::kRead;
        if (pd == nullptr || !pd->am || pd->op != op || pd->nonce != nonce) return UCS_OK;  // ended, or not ours
        if (op == XferOp::kWrite && !pd->end_started) return UCS_OK;
        Status st = status_from_wire(code, std::string(body));
        if (op == XferOp::kRead && st.ok()) st = Internal("peer refused the read without a reason");
        if (!st.ok() && pd->error.ok()) {
          const std::string& name = peers_[pd->peer] ? peers_[pd->peer]->name : std::string();
          pd->error = Status(st.code(), fmt::format("peer '{}': {}", name, st.message()));
        }
        if (st.ok()) pd->acknowledged = true;
        advance(pd);
        return UCS_OK;
      }
      case CtlKind::kReadRequest: {
        std::uint64_t count = 0;
        std::string reader;
        if (!r.u64(count) || !r.str(reader) || r.remaining() != 0 || reply == nullptr)
          return dropped("a malformed read request");
        serve_read(reply, reader, xfer, nonce, count, body);
        return UCS_OK;
      }
    }
    return dropped("a control message of unknown kind");
  }

  // A peer's read: every entry checked first (a bad one refuses the whole read, naming it), then each answered
  // from this agent's region by a message of its own (rendezvous for large ones: the reader receives in place).
  void serve_read(ucp_ep_h reply, const std::string& reader, XferId xfer, std::uint64_t nonce, std::uint64_t count,
                  std::string_view entries) {
    if (revoked_names_.count(reader) != 0) {
      send_control(reply, CtlKind::kReadRefused, xfer, nonce,
                   Unavailable(fmt::format("'{}' was disconnected at '{}'", reader, identity().name)));
      return;
    }
    if (count > entries.size() / kReadEntryBytes || entries.size() != count * kReadEntryBytes) {
      send_control(
          reply, CtlKind::kReadRefused, xfer, nonce,
          InvalidArgument(fmt::format("read {}: {} entries announced in {} bytes", xfer, count, entries.size())));
      return;
    }
    struct Entry {
      RegionId region;
      std::uint64_t addr, bytes;
    };
    std::vector<Entry> list(count);
    codec::ByteReader e(entries);
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint32_t region = 0;
      std::array<char, kAmTokenBytes> token{};
      std::uint64_t addr = 0, bytes = 0;
      if (!e.u32(region) || !e.raw(token.data(), token.size()) || !e.u64(addr) || !e.u64(bytes)) break;
      auto target = check_target("read", xfer, reader, i, region, {token.data(), token.size()}, addr, bytes);
      if (!target.ok()) {
        log(LogLevel::kWarning, "transport", fmt::format("UCX: refused {}", target.status().message()));
        send_control(reply, CtlKind::kReadRefused, xfer, nonce, target.status());
        return;
      }
      list[i] = Entry{*target, addr, bytes};
    }
    for (std::uint64_t i = 0; i < count; ++i) {
      serves_.emplace_back();
      auto pos = std::prev(serves_.end());
      ServeOp& s = *pos;
      s.self = this;
      s.pos = pos;
      s.region = list[i].region;
      s.sender = reader;
      codec::ByteWriter<std::string> w;
      w.u8(static_cast<std::uint8_t>(DataKind::kReadAnswer)).u64(xfer).u64(nonce).u32(static_cast<std::uint32_t>(i));
      w.u64(list[i].bytes);
      s.header = std::move(w.out);
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = &UcxTransport::on_serve_done;
      rp.user_data = &s;
      set_data_protocol(rp, list[i].bytes);
      ucs_status_ptr_t r = ucp_am_send_nbx(reply, kDataAmId, s.header.data(), s.header.size(),
                                           reinterpret_cast<const void*>(list[i].addr), list[i].bytes, &rp);
      if (UCS_PTR_IS_PTR(r)) {
        s.request = r;
        outstanding_.fetch_add(1);
        continue;
      }
      serves_.erase(pos);
      if (UCS_PTR_IS_ERR(r)) {
        send_control(reply, CtlKind::kReadRefused, xfer, nonce,
                     request_error(fmt::format("read {}: answer {} of {}", xfer, i, count), UCS_PTR_STATUS(r)));
        return;
      }
    }
  }
  static void on_serve_done(void* request, ucs_status_t st, void* user) {
    // A failed answer fails the reader's transfer on its side (its answers do not all land).
    auto* s = static_cast<ServeOp*>(user);
    UcxTransport* self = s->self;
    ucp_request_free(request);
    self->outstanding_.fetch_sub(1);
    if (st == UCS_OK) self->note_peer_progress(s->sender);  // the reader takes our answers: it is alive
    self->serves_.erase(s->pos);
  }

  // A peer's message in its order (notifications, ends of writes).
  void enqueue(Queued q) {
    auto& line = fifo_[q.note.peer];
    const std::string sender = q.note.peer;
    note_peer_progress(sender);  // read off its connection now: the peer was alive moments ago
    line.push_back(std::move(q));
    settle(sender);
  }
  // Delivers what is at the head of the peer's line and ready: notifications at once, the end of a write once all
  // its bytes have landed (then acknowledged: OK, or why not, and the notification not delivered).
  void settle(const std::string& sender) {
    auto f = fifo_.find(sender);
    if (f == fifo_.end()) return;
    auto& line = f->second;
    const auto now = std::chrono::steady_clock::now();
    while (!line.empty()) {
      Queued& head = line.front();
      if (head.write_end) {
        auto in = incoming_.find({sender, head.xfer});
        const std::uint64_t landed = in == incoming_.end() ? 0 : in->second.landed;
        const bool failed = in != incoming_.end() && !in->second.error.ok();
        if (in != incoming_.end() && in->second.in_flight > 0) break;  // bytes still landing
        const bool late = now - head.since > kWriteEndWaitsAtMost;
        if (!failed && landed < head.count && !late) break;  // bytes still on their way
        Status outcome;
        if (failed) {
          outcome = in->second.error;
        } else if (landed != head.count) {
          outcome = DataLoss(fmt::format("write {} of '{}': {} of {} descriptors landed at '{}'", head.xfer, sender,
                                         landed, head.count, identity().name));
        }
        if (in != incoming_.end()) incoming_.erase(in);
        if (outcome.ok()) deliver(std::move(head.note));
        send_control(head.reply, CtlKind::kWriteAck, head.xfer, head.nonce, outcome);
      } else {
        deliver(std::move(head.note));
      }
      line.pop_front();
    }
    if (line.empty()) fifo_.erase(f);
  }

  // After disconnect_peer: nothing of the peer lands or is answered any more; its receives in flight are cancelled
  // and waited for (bounded). True when none is left.
  bool revoke_sender(PeerId peer) {
    std::lock_guard lock(ucx_mu_);
    if (peer >= peers_.size() || !peers_[peer]) return false;
    const std::string name = peers_[peer]->name;
    revoked_names_.insert(name);
    const bool none_left = settle_requests_locked([&](const auto& op) { return op.sender == name; });
    for (auto& [key, in] : incoming_)
      if (key.first == name && in.error.ok()) in.error = Unavailable(fmt::format("'{}' was disconnected", name));
    settle(name);
    return none_left;
  }

  // Cancels the receives and answers that `match` selects and progresses the worker until they have completed,
  // up to 5 s; true when none is left.
  template <typename Match>
  bool settle_requests_locked(const Match& match) {
    const auto left = [&] {
      return std::any_of(recvs_.begin(), recvs_.end(), match) || std::any_of(serves_.begin(), serves_.end(), match);
    };
    for (const RecvOp& op : recvs_)
      if (op.request != nullptr && match(op)) ucp_request_cancel(worker_, op.request);
    for (const ServeOp& op : serves_)
      if (op.request != nullptr && match(op)) ucp_request_cancel(worker_, op.request);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (left() && std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
    return !left();
  }

  // A disconnected peer whose process has ended may leave requests that UCX never completes: shared memory's
  // emulated RMA waits for answers the dead process will never send, and a forced close does not purge requests
  // already sent. Their transfers would never become quiescent, so the memory they name (a decode's destination
  // blocks of a pull) could never be reused. Nothing can complete them any more once the dead peer's last messages
  // have been processed here: it writes no new ones, and this worker progressed dry (its receive queues empty)
  // after kAbandonAfter past the sighting. Then each such transfer ends failed and quiescent; its requests and
  // record are kept (a late callback finds them) until the transport goes, which then leaves the worker to the
  // process's exit (see the destructor). Live or merely unreachable peers are never abandoned: their requests may
  // still complete and write.
  void abandon_dead_peers_locked(std::chrono::steady_clock::time_point now) {
    for (PeerId peer = 0; peer < peers_.size(); ++peer) {
      UcxPeer* p = peers_[peer].get();
      if (p == nullptr || p->ep != nullptr || !p->failed || !p->gone()) continue;
      if (!p->gone_seen) {
        p->gone_seen = now;
        p->dry_at_gone = dry_progress_;
        continue;
      }
      if (now - *p->gone_seen < kAbandonAfter || dry_progress_ <= p->dry_at_gone) continue;
      std::vector<XferId> stuck;
      for (const auto& [id, pd] : pending_)
        if (pd->peer == peer && pd->outstanding > 0 && !pd->posting) stuck.push_back(id);
      for (XferId id : stuck) {
        auto node = pending_.extract(id);
        Pending* pd = node.mapped().get();
        pd->abandoned = true;
        if (pd->error.ok())
          pd->error = Unavailable(fmt::format("peer '{}' exited with {} requests of transfer {} outstanding", p->name,
                                              pd->outstanding, id));
        log(LogLevel::kWarning, "transport", fmt::format("UCX: {}; they are abandoned", pd->error.message()));
        if (!pd->outcome_set) {
          pd->outcome_set = true;
          finish_xfer(id, pd->error);
        }
        abandoned_.push_back(std::move(node.mapped()));
        set_quiescent(id);
      }
    }
  }

  // Once a second: bytes of writes whose end never came are forgotten, and ends that waited too long fail.
  void housekeeping_locked(std::chrono::steady_clock::time_point now) {
    for (auto it = incoming_.begin(); it != incoming_.end();) {
      const bool awaited = [&] {
        auto f = fifo_.find(it->first.first);
        return f != fifo_.end() && std::any_of(f->second.begin(), f->second.end(), [&](const Queued& q) {
                 return q.write_end && q.xfer == it->first.second;
               });
      }();
      if (it->second.in_flight == 0 && !awaited && now - it->second.since > kOrphanBytesAfter) {
        it = incoming_.erase(it);
      } else {
        ++it;
      }
    }
    std::vector<std::string> senders;
    for (const auto& [name, line] : fifo_) senders.push_back(name);
    for (const auto& name : senders) settle(name);
  }

  // Moves a transfer on after a completion (ucx_mu_ held).
  void advance(Pending* pd) {
    if (pd->posting || pd->abandoned) return;
    if (pd->am && pd->op == XferOp::kWrite) {
      // Every descriptor's send has completed: the end message (with the notification) follows them, and the peer
      // acknowledges it once every byte has landed there and the notification is delivered.
      if (pd->error.ok() && pd->outstanding == 0 && !pd->end_started) send_write_end(pd);
      if (pd->acknowledged) pd->notified = true;
    } else if (pd->am && pd->landed_count == pd->ops.size()) {
      pd->flushed = true;  // every answer of a read has landed: the notification may follow
    }
    if (pd->error.ok() && pd->flushed && pd->outstanding == 0 && !pd->notify_started) {
      pd->notify_started = true;
      if (send_transfer_message(pd, kAmId, &UcxTransport::on_notify_done, 0, "notification")) pd->notified = true;
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
    pd->requests.erase(request);  // a set: a transfer of 200,000 descriptors erased from a vector was quadratic
    ucp_request_free(request);
    if (st != UCS_OK && pd->error.ok()) pd->error = request_error(what, st);
    if (st == UCS_OK && pd->peer < peers_.size() && peers_[pd->peer]) note_peer_progress(peers_[pd->peer]->name);
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
    Queued q;
    q.note = Notification{std::string(h + 1, header_length - 1), static_cast<NotifKind>(kind),
                          std::string(static_cast<const char*>(data), length)};
    self->enqueue(std::move(q));
    return UCS_OK;
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<UcxTransport*>(arg);
    for (std::size_t i = 0; i < self->peers_.size(); ++i) {
      UcxPeer* p = self->peers_[i].get();
      if (p == nullptr || (p->ep != ep && p->urgent != ep)) continue;
      p->failed = true;
      p->conn_failed = true;
      self->mark_peer_failed(static_cast<PeerId>(i), Unavailable(fmt::format("connection to peer '{}' failed: {}",
                                                                             p->name, ucs_status_string(st))));
      // The endpoint is closed later (destructor); its requests complete with errors now. Transfers of the
      // active-message path that wait for the peer without a request in flight end here.
      std::vector<XferId> waiting;
      for (const auto& [id, pd] : self->pending_)
        if (pd->peer == i && pd->am) waiting.push_back(id);
      for (XferId id : waiting) {
        auto it = self->pending_.find(id);
        if (it == self->pending_.end()) continue;
        if (it->second->error.ok())
          it->second->error =
              Unavailable(fmt::format("connection to peer '{}' failed: {}", p->name, ucs_status_string(st)));
        self->advance(it->second.get());
      }
    }
  }

  // Starts a forced close of `ep` (the peer may be dead) and clears it: the close request to wait for and free,
  // or null when it closed at once.
  static void* force_close(ucp_ep_h& ep) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    ep = nullptr;
    return UCS_PTR_IS_PTR(r) ? r : nullptr;
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

  // ucp_worker_progress calls per hold of ucx_mu_ by the progress thread before it lets other callers in.
  static constexpr int kProgressCallsPerLock = 32;
  // How long the progress thread spins on requests in flight after the last progress, before it naps between looks.
  static constexpr std::chrono::milliseconds kSpinWithoutProgress{5};
  // abandon_dead_peers_locked: how often it looks, and how long after a peer's exit is seen its last messages
  // have to be processed here.
  static constexpr std::chrono::milliseconds kAbandonCheckPeriod{50};
  static constexpr std::chrono::milliseconds kAbandonAfter{100};

  void progress_loop() {
    auto next_housekeeping = std::chrono::steady_clock::now();
    auto next_abandon_check = next_housekeeping;
    auto last_progress = next_housekeeping;
    while (!stop_.load()) {
      ucs_status_t armed = UCS_OK;
      bool more = false, napping = false;
      {
        std::lock_guard lock(ucx_mu_);
        // Bounded: while bytes flow, progress never runs dry, and holding ucx_mu_ until it did kept every other
        // caller (a heartbeat's send, a post, a status) waiting for the whole transfer: a transfer longer than the
        // protocol's lease failed with both sides alive.
        bool progressed = false;
        for (int i = 0; i < kProgressCallsPerLock; ++i) {
          if (ucp_worker_progress(worker_) == 0) {
            ++dry_progress_;
            break;
          }
          progressed = true;
          if (i + 1 == kProgressCallsPerLock || ucx_mu_.contended()) {
            more = true;
            break;
          }
        }
        const auto now = std::chrono::steady_clock::now();
        if (progressed) last_progress = now;
        if (now >= next_housekeeping) {
          housekeeping_locked(now);
          next_housekeeping = now + std::chrono::seconds(1);
        }
        if (now >= next_abandon_check && !pending_.empty()) {
          abandon_dead_peers_locked(now);
          next_abandon_check = now + kAbandonCheckPeriod;
        }
        if (more || (outstanding_.load() > 0 && now - last_progress < kSpinWithoutProgress)) {
          armed = UCS_ERR_BUSY;  // keep spinning while our requests are in flight (or progress has more)
        } else if (outstanding_.load() > 0) {
          // Requests in flight that have not moved for a while (a peer that died holds them until its connection
          // is torn down; on shared memory, for good): look every millisecond rather than burn a core on them.
          napping = true;
        } else {
          armed = ucp_worker_arm(worker_);
        }
      }
      if (armed == UCS_ERR_BUSY) {
        // Let the callers waiting for ucx_mu_ have it before taking it again (bounded: a caller that keeps it long
        // does not stop progress for long).
        for (int i = 0; i < 64 && ucx_mu_.contended(); ++i) std::this_thread::yield();
        std::this_thread::yield();
        continue;
      }
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      // The timeout bounds the damage of a missed wakeup; events normally end the poll.
      (void)::poll(fds, 2, napping ? 1 : 2);
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
  mutable HandoffMutex ucx_mu_;
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
  std::vector<std::unique_ptr<Pending>> abandoned_;  // see abandon_dead_peers_locked
  std::uint64_t dry_progress_ = 0;                   // progress calls that found nothing to do
  std::list<SendBuf> sends_;
  // Close requests of urgent endpoints closed by backend_disconnect, freed at shutdown (one per disconnect).
  std::vector<void*> urgent_closing_;
  // The active-message data path (see UcxDataPath).
  const bool am_mode_;                                           // this agent's regions take active messages
  std::unordered_map<RegionId, LocalRegion> local_;              // its regions, with their tokens
  std::list<RecvOp> recvs_;                                      // rendezvous receives in flight
  std::list<ServeOp> serves_;                                    // answers to peers' reads in flight
  std::map<std::pair<std::string, XferId>, Incoming> incoming_;  // peers' writes landing here
  std::unordered_map<std::string, std::deque<Queued>> fifo_;     // by sender: its messages not yet delivered
  std::set<std::string> revoked_names_;                          // disconnected peers: nothing of theirs lands here
  std::atomic<int> outstanding_{0};
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_ucx_transport(AgentIdentity identity, UcxOptions options) {
  KVTIER_RETURN_IF_ERROR(detail::check_agent_name(identity.name));
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
