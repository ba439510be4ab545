// Same-host IPC transport backend (see include/kvtier/transport/ipc.h for the model).
//
// Sockets: each agent listens on an abstract Unix domain socket (SOCK_SEQPACKET: message boundaries, and file
// descriptors ride along with a message). load_peer connects to the peer's socket; that connection carries this
// agent's requests to the peer and the peer's replies. The peer's own requests come over the connection it opens
// to us, so the notifications of each direction travel on one stream, in order.
//
// Threads: a worker executes this agent's posts in order (copy into the peer's windows, send the request); one
// receiver per outgoing connection handles the replies (WRITE acknowledged, READ window filled: copy out, send
// the READ's notification); the listener accepts connections and one server thread per incoming connection
// serves the peer's requests under regions_mu_, which deregistration also takes, so a region never leaves while
// its window is being copied.
//
// Failure: a connection that closes (the peer died or went away) fails every transfer waiting on it
// (kUnavailable) and marks the peer failed; transfers are quiescent as soon as this side can no longer touch
// their local memory (after the worker's copy for a WRITE; after the reply or the connection's end for a READ).
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "core/byte_codec.h"
#include "kvtier/core/log.h"
#include "kvtier/transport/ipc.h"
#include "transport/ipc/ipc_wire.h"
#include "transport/transport_base.h"

#ifndef KVTIER_IPC_CUDA
#define KVTIER_IPC_CUDA 0
#endif

#if KVTIER_IPC_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;

using ipc_wire::kChallenge;
using ipc_wire::kHello;
using ipc_wire::kNotify;
using ipc_wire::kProof;
using ipc_wire::kRead;
using ipc_wire::kRegion;
using ipc_wire::kRegionsEnd;
using ipc_wire::kReply;
using ipc_wire::kWrite;
using ipc_wire::recv_msg;
using ipc_wire::send_msg;

// The seals every shared window carries: its size can never change again.
constexpr int kWindowSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// Requests larger than this are refused at post (a socket message has to fit the socket's buffer).
constexpr std::size_t kMaxMessage = 4u << 20;

using Buf = codec::ByteWriter<std::string>;
using Parse = codec::ByteReader;

// A system call that made no descriptor or mapping: out of descriptors (the process's or the system's open-file
// limit) or memory is kResourceExhausted, naming the limit (it was kInternal: "the library is broken"), anything else
// kInternal.
Status os_error(std::string_view what, int err) {
  if (err == EMFILE || err == ENFILE)
    return ResourceExhausted(
        fmt::format("{}: {} (the open-file limit, ulimit -n / RLIMIT_NOFILE, is reached)", what, std::strerror(err)));
  if (err == ENOMEM || err == ENOSPC || err == ENOBUFS)
    return ResourceExhausted(fmt::format("{}: {}", what, std::strerror(err)));
  return Internal(fmt::format("{}: {}", what, std::strerror(err)));
}

struct Range {
  std::uint32_t region = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// Buffers for the largest message, and a bound on each send: a peer that stops reading (paused, stopped in a
// debugger, swapping) would otherwise block the sender for good, and with it the one worker that sends to every
// peer (their heartbeats included) and whoever waits for that sender's lock.
void set_buffers(int fd, std::chrono::milliseconds send_timeout) {
  const int sz = static_cast<int>(kMaxMessage + 4096);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
  const auto ms = send_timeout.count();
  timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>((ms % 1000) * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

sockaddr_un abstract_addr(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = '\0';
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof(a.sun_path) - 2));
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof(a.sun_path) - 2));
  return a;
}

#if KVTIER_IPC_CUDA
// A CUDA region's remote key: "cuda;<IPC handle, hex>;<offset of the region in its allocation>;<PCI bus id>".
std::string to_hex(const void* p, std::size_t n) {
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s += fmt::format("{:02x}", static_cast<const unsigned char*>(p)[i]);
  return s;
}
bool from_hex(std::string_view h, void* p, std::size_t n) {
  if (h.size() != 2 * n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    unsigned v = 0;
    if (std::sscanf(std::string(h.substr(2 * i, 2)).c_str(), "%2x", &v) != 1) return false;
    static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(v);
  }
  return true;
}
Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return Internal(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}
// cudaIpcGetMemHandle wants the allocation's base; the driver knows the range a pointer lies in.
Result<std::uintptr_t> allocation_base(const void* p) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return static_cast<Fn>(nullptr);
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return Internal("cuMemGetAddressRange is not available from the CUDA driver");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (fn(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS)
    return InvalidArgument(fmt::format("{} is not CUDA device memory", p));
  return static_cast<std::uintptr_t>(base);
}
#endif

// The blob's address: "ipc1;boot=<boot id>;pidns=<pid namespace>;pid=<pid>;sock=<abstract socket name>".
struct Address {
  HostIdentity host;
  std::string pid;
  std::string sock;
};
std::string format_address(const Address& a) {
  return fmt::format("ipc1;boot={};pidns={};pid={};sock={}", a.host.boot_id, a.host.pid_ns, a.pid, a.sock);
}
Result<Address> parse_address(std::string_view s) {
  Address a;
  bool have_boot = false, have_ns = false, have_sock = false;
  if (s.substr(0, 5) != "ipc1;") return InvalidArgument(fmt::format("ipc address '{}' does not start with ipc1;", s));
  s.remove_prefix(5);
  while (!s.empty()) {
    const auto end = s.find(';');
    const std::string_view kv = s.substr(0, end);
    s = end == std::string_view::npos ? std::string_view() : s.substr(end + 1);
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) return InvalidArgument(fmt::format("ipc address field '{}' has no '='", kv));
    const std::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "boot")
      a.host.boot_id = v, have_boot = true;
    else if (k == "pidns")
      a.host.pid_ns = v, have_ns = true;
    else if (k == "pid")
      a.pid = v;
    else if (k == "sock")
      a.sock = v, have_sock = true;
  }
  if (!have_boot || !have_ns || !have_sock || a.sock.empty())
    return InvalidArgument("ipc address lacks one of boot=, pidns=, sock=");
  return a;
}

class IpcTransport final : public detail::TransportBase {
 public:
  IpcTransport(AgentIdentity identity, IpcOptions options, HostIdentity host)
      : TransportBase(std::move(identity), options.peer_secret), options_(std::move(options)), host_(std::move(host)) {}

  Status start() {
#if KVTIER_IPC_CUDA
    if (options_.device_memory == IpcOptions::DeviceMemory::kCuda) {
      KVTIER_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options_.cuda_device), "cudaSetDevice"));
      KVTIER_RETURN_IF_ERROR(
          cuda_status(cudaStreamCreateWithFlags(&streams_[0], cudaStreamNonBlocking), "cudaStreamCreate"));
      KVTIER_RETURN_IF_ERROR(
          cuda_status(cudaEventCreateWithFlags(&events_[0], cudaEventDisableTiming), "cudaEventCreate"));
    }
#endif
    std::random_device rd;
    sock_name_ = fmt::format("kvtier-ipc-{}-{:016x}", getpid(), (std::uint64_t{rd()} << 32) ^ rd());
    listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return os_error("ipc socket", errno);
    socklen_t len = 0;
    sockaddr_un a = abstract_addr(sock_name_, len);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(listen_fd_, 64) != 0)
      return os_error(fmt::format("ipc socket @{}", sock_name_), errno);
    try {
      listener_ = std::thread([this] { accept_loop(); });
      worker_ = std::thread([this] { work_loop(); });
    } catch (const std::exception& e) {
      return Internal(fmt::format("ipc threads: {}", e.what()));
    }
    return Status::Ok();
  }

  ~IpcTransport() override {
    {
      std::lock_guard lock(jobs_mu_);
      stop_ = true;
    }
    jobs_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
    if (listener_.joinable()) listener_.join();
    std::vector<std::shared_ptr<Conn>> conns;
    {
      std::lock_guard lock(conns_mu_);
      conns = conns_;
    }
    for (auto& c : conns)
      if (c) shutdown(c->fd, SHUT_RDWR);
    for (auto& c : conns)
      if (c && c->receiver.joinable()) c->receiver.join();
    std::vector<std::thread> servers;
    {
      std::lock_guard lock(servers_mu_);
      for (int fd : server_fds_) shutdown(fd, SHUT_RDWR);
      servers.swap(servers_);
    }
    for (auto& t : servers) t.join();
    wait_all_quiescent(5s);
    for (auto& c : conns)
      if (c) {
        for (auto& w : c->windows)
          if (w.base && !w.cuda) munmap(w.base, w.bytes);
        close(c->fd);
      }
    for (int fd : server_fds_) close(fd);
    if (listen_fd_ >= 0) close(listen_fd_);
    std::lock_guard lock(regions_mu_);
    for (auto& [id, w] : own_)
      if (w.base) munmap(w.base, w.bytes), close(w.fd);
    for (auto& w : retired_shared_) munmap(w.base, w.bytes), close(w.fd);
    for (auto& [p, w] : pending_shared_) munmap(w.base, w.bytes), close(w.fd);
#if KVTIER_IPC_CUDA
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
    if (streams_[0]) cudaStreamDestroy(streams_[0]), cudaEventDestroy(events_[0]);
#endif
  }

  std::string_view backend_name() const noexcept override { return "ipc"; }

 protected:
  Result<std::string> backend_register(RegionId id, const MemoryRegion& region) override {
    if (region.kind == MemoryKind::kDevice && options_.device_memory == IpcOptions::DeviceMemory::kCuda) {
#if KVTIER_IPC_CUDA
      KVTIER_RETURN_IF_ERROR(cuda_status(cudaSetDevice(region.device_ordinal), "cudaSetDevice"));
      KVTIER_ASSIGN_OR_RETURN(std::uintptr_t alloc, allocation_base(region.base));
      cudaIpcMemHandle_t h{};
      KVTIER_RETURN_IF_ERROR(
          cuda_status(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(alloc)), "cudaIpcGetMemHandle"));
      char pci[32] = {};
      KVTIER_RETURN_IF_ERROR(
          cuda_status(cudaDeviceGetPCIBusId(pci, sizeof(pci), region.device_ordinal), "cudaDeviceGetPCIBusId"));
      std::lock_guard lock(regions_mu_);
      // The bytes are in place when a WRITE's request arrives: no window, nothing for the server to copy.
      own_[id] = OwnWindow{nullptr, region.bytes, -1, static_cast<std::byte*>(region.base), true};
      return fmt::format("cuda;{};{};{}", to_hex(&h, sizeof(h)), reinterpret_cast<std::uintptr_t>(region.base) - alloc,
                         pci);
#else
      return NotSupported("ipc backend: CUDA device memory (CUDA IPC handles) is not supported by this build");
#endif
    }
    {
      // Memory of allocate_shared: the window is the memory itself, nothing is copied in or out of it.
      std::lock_guard lock(regions_mu_);
      if (auto it = pending_shared_.find(region.base); it != pending_shared_.end()) {
        own_[id] = it->second;
        pending_shared_.erase(it);
        return std::string(kSharedKey);
      }
    }
    KVTIER_ASSIGN_OR_RETURN(Window w, make_window(region.bytes, fmt::format("kvtier-ipc-{}", id)));
    std::lock_guard lock(regions_mu_);
    own_[id] = OwnWindow{w.base, region.bytes, w.fd, static_cast<std::byte*>(region.base)};
    return std::string("memfd");
  }

  Result<void*> backend_allocate_shared(std::uint64_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(Window w, make_window(bytes, "kvtier-ipc-shared"));
    std::lock_guard lock(regions_mu_);
    pending_shared_[w.base] = OwnWindow{w.base, bytes, w.fd, w.base, false, true};
    return static_cast<void*>(w.base);
  }

  void backend_free_shared(void* p) override {
    std::lock_guard lock(regions_mu_);
    auto it = pending_shared_.find(p);
    if (it == pending_shared_.end()) return;
    munmap(it->second.base, it->second.bytes);
    close(it->second.fd);
    pending_shared_.erase(it);
  }

  // A sealed memfd of `bytes`, mapped here (zeroed, as a fresh file is).
  struct Window {
    std::byte* base = nullptr;
    int fd = -1;
  };
  static Result<Window> make_window(std::uint64_t bytes, const std::string& name) {
    const int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return os_error("memfd_create", errno);
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      close(fd);
      return ResourceExhausted(fmt::format("memfd of {} bytes: {}", bytes, std::strerror(e)));
    }
    // Every peer gets this descriptor, and a descriptor lets its holder ftruncate the file: a peer that shrank
    // it would make our own copies in and out of the window fault (SIGBUS) and kill this process. Sealed, its
    // size is fixed for good (F_SEAL_SEAL: nobody can lift the seals either), and peers check the seals.
    if (fcntl(fd, F_ADD_SEALS, kWindowSeals) != 0) {
      const int e = errno;
      close(fd);
      return Internal(fmt::format("sealing the memfd window {}: {}", name, std::strerror(e)));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      close(fd);
      return ResourceExhausted(fmt::format("mapping a window of {} bytes: {}", bytes, std::strerror(e)));
    }
    return Window{static_cast<std::byte*>(p), fd};
  }

  void backend_deregister(RegionId id) override {
    std::lock_guard lock(regions_mu_);  // after any copy of a server thread
    auto it = own_.find(id);
    if (it == own_.end()) return;
    if (it->second.shared)  // the caller uses it in place: it stays mapped until the transport goes
      retired_shared_.push_back(it->second);
    else if (it->second.base)
      munmap(it->second.base, it->second.bytes), close(it->second.fd);
    own_.erase(it);
  }

  Result<std::string> backend_address() override {
    return format_address(Address{host_, std::to_string(getpid()), sock_name_});
  }

  // A peer's progress (TransportBase::last_progress): every message of it read off either connection with it (its
  // requests and notifications on the connection it opened, its replies on ours), and the copies of its requests
  // or replies while they run. A long transfer's requests and replies keep coming while the heartbeats wait behind
  // them on the one ordered connection, and a copy of a whole layer's window keeps the thread that would read them
  // busy for longer than a lease. While a CopyingFor lives, a thread here copies bytes of a transfer with the peer.
  class CopyingFor {
   public:
    CopyingFor(IpcTransport& t, const std::string& name) : t_(t), name_(name) { t_.note_peer_progress(name_, +1); }
    ~CopyingFor() { t_.note_peer_progress(name_, -1); }
    CopyingFor(const CopyingFor&) = delete;
    CopyingFor& operator=(const CopyingFor&) = delete;

   private:
    IpcTransport& t_;
    const std::string& name_;
  };

  Status backend_check_blob(const detail::Blob& blob) override {
    for (std::size_t i = 0; i < blob.regions.size(); ++i) {
      const std::string& key = blob.regions[i].key;
      if (blob.regions[i].bytes != 0 && key != "memfd" && key != kSharedKey && key.rfind("cuda;", 0) != 0)
        return InvalidArgument(
            fmt::format("peer '{}' region {}: ipc key of {} bytes is neither 'memfd', '{}' nor 'cuda;...'",
                        blob.identity.name, i, key.size(), kSharedKey));
    }
    return Status::Ok();
  }

  Status backend_connect(PeerId peer, const detail::Blob& blob) override {
    KVTIER_ASSIGN_OR_RETURN(Address a, parse_address(blob.address));
    if (a.host.boot_id != host_.boot_id)
      return FailedPrecondition(fmt::format("peer '{}' runs on boot id {}, local '{}' on boot id {}: another host",
                                            blob.identity.name, a.host.boot_id, identity().name, host_.boot_id));
    if (a.host.pid_ns != host_.pid_ns)
      return FailedPrecondition(fmt::format("peer '{}' is in pid namespace {}, local '{}' in {}", blob.identity.name,
                                            a.host.pid_ns, identity().name, host_.pid_ns));
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return os_error("ipc socket", errno);
    set_buffers(fd, options_.send_timeout);
    socklen_t len = 0;
    sockaddr_un sa = abstract_addr(a.sock, len);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      const int e = errno;
      close(fd);
      return Unavailable(fmt::format("peer '{}' socket @{}: {}", blob.identity.name, a.sock, std::strerror(e)));
    }
    // The handshake is bounded: a peer that accepts but never answers must not hang load_peer.
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    auto conn = std::make_shared<Conn>();
    conn->fd = fd;
    conn->pidfd = peer_pidfd(fd);
    conn->peer = peer;
    conn->name = blob.identity.name;
    conn->address = blob.address;
    conn->windows.resize(blob.regions.size());
    KVTIER_ASSIGN_OR_RETURN(std::string own_address, backend_address());
    Buf hello;
    hello.u32(kHello);
    hello.str(identity().name);
    hello.str(own_address);  // which incarnation of the name this is (a restarted peer keeps its name)
    Status s = send_msg(fd, hello.out) ? Status::Ok() : Unavailable("ipc hello: peer closed");
    while (s.ok()) {
      std::string m;
      int passed = -1;
      if (!recv_msg(fd, m, &passed)) {
        s = Unavailable(fmt::format("peer '{}' closed during the handshake", blob.identity.name));
        break;
      }
      Parse p(m);
      std::uint32_t type = 0, index = 0;
      std::uint64_t bytes = 0;
      std::uint8_t live = 0;
      static_cast<void>(p.u32(type));  // a short message leaves type 0, which is refused below
      if (type == kRegionsEnd) break;
      if (type == kChallenge) {
        std::string challenge;
        if (passed >= 0) close(passed);
        if (!p.str(challenge) || challenge.size() != detail::kHandshakeChallengeBytes) {
          s = InvalidArgument(fmt::format("peer '{}' sent a malformed challenge", blob.identity.name));
          break;
        }
        if (options_.peer_secret.empty()) {
          s = FailedPrecondition(fmt::format(
              "peer '{}' asks for the peer secret's proof, and this agent has no peer secret", blob.identity.name));
          break;
        }
        Buf proof;
        proof.u32(kProof);
        proof.str(
            detail::handshake_proof(options_.peer_secret, challenge, identity().name, own_address, blob.identity.name));
        if (!send_msg(fd, proof.out))
          s = Unavailable(fmt::format("peer '{}' closed during the handshake", blob.identity.name));
        continue;
      }
      if (type != kRegion || !p.u32(index) || !p.u64(bytes) || !p.u8(live)) {
        if (passed >= 0) close(passed);
        s = InvalidArgument(
            fmt::format("peer '{}' sent a malformed handshake message (type {})", blob.identity.name, type));
        break;
      }
      if (live && passed < 0 && index < conn->windows.size() && bytes == blob.regions[index].bytes && bytes > 0 &&
          blob.regions[index].key.rfind("cuda;", 0) == 0) {
        s = open_cuda_window(*conn, index, blob.regions[index]);
        if (!s.ok()) break;
      }
      if (live && passed >= 0 && index < conn->windows.size()) {
        s = map_window(*conn, index, bytes, blob.regions[index], passed);
        close(passed);
        if (!s.ok()) break;
        continue;
      }
      if (passed >= 0) close(passed);
    }
    if (!s.ok()) {
      for (auto& w : conn->windows)
        if (w.base && !w.cuda) munmap(w.base, w.bytes);
      close(fd);
      return s;
    }
    timeval none{0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    std::lock_guard lock(conns_mu_);
    if (conns_.size() <= peer) conns_.resize(peer + 1);
    conns_[peer] = conn;
    conn->receiver = std::thread([this, conn] { receive_loop(conn); });
    return Status::Ok();
  }

  Status backend_post(XferId id, XferOp op, PeerId peer, std::vector<detail::ResolvedOp> ops,
                      std::string notification) override {
    auto conn = conn_of(peer);
    if (!conn) return NotFound(fmt::format("peer {} is not connected", peer));
    detail::merge_contiguous(ops);
    if (ops.size() * 20 + notification.size() + 64 > kMaxMessage)
      return ResourceExhausted(fmt::format("{} descriptors and a {}-byte notification exceed the {}-byte request",
                                           ops.size(), notification.size(), kMaxMessage));
    auto job = std::make_shared<Job>();
    job->id = id;
    job->op = op;
    job->conn = conn;
    job->ops = std::move(ops);
    job->notification = std::move(notification);
    std::lock_guard lock(jobs_mu_);
    if (stop_) return Cancelled("ipc transport is shutting down");
    jobs_.push_back(job);
    jobs_cv_.notify_all();
    return Status::Ok();
  }

  Status backend_send(PeerId peer, NotifKind kind, std::string message) override {
    auto conn = conn_of(peer);
    if (!conn) return NotFound(fmt::format("peer {} is not connected", peer));
    auto job = std::make_shared<Job>();
    job->conn = conn;
    job->kind = kind;
    job->notification = std::move(message);
    // Through the worker, so it never overtakes the requests of transfers posted before it.
    std::lock_guard lock(jobs_mu_);
    if (stop_) return Cancelled("ipc transport is shutting down");
    jobs_.push_back(job);
    jobs_cv_.notify_all();
    return Status::Ok();
  }

  // Heartbeats: straight onto the connection from the caller's thread, ahead of the posts the worker has queued
  // (behind a layer's copy into the peer's window they left only after it, and a peer waiting for them took this
  // side for dead). Never blocks: when the worker is sending or the peer's socket is full, it goes through the
  // worker like any message.
  Status backend_send_urgent(PeerId peer, std::string message) override {
    auto conn = conn_of(peer);
    if (!conn) return NotFound(fmt::format("peer {} is not connected", peer));
    Buf m;
    m.u32(kNotify);
    m.u8(static_cast<std::uint8_t>(NotifKind::kMessage));
    m.str(message);
    {
      std::unique_lock lock(conn->send_mu, std::try_to_lock);
      if (lock.owns_lock() && !conn->dead.load()) {
        switch (ipc_wire::try_send_msg(conn->fd, m.out)) {
          case ipc_wire::TrySend::kSent: return Status::Ok();
          case ipc_wire::TrySend::kFailed:
            shutdown(conn->fd, SHUT_RDWR);  // as send_on: the receiver sees the end and fails the peer
            return Unavailable(fmt::format("peer '{}' is gone", conn->name));
          case ipc_wire::TrySend::kWouldBlock: break;
        }
      }
    }
    return backend_send(peer, NotifKind::kMessage, std::move(message));
  }

  bool backend_disconnect(PeerId peer) override {
    auto conn = conn_of(peer);
    if (!conn) return true;
    std::vector<int> fds;
    {
      // Under regions_mu_, which every server thread holds while it copies a request's bytes: a copy in progress
      // ends first, and no request of this peer is served after this (the flag is checked under the same lock).
      std::lock_guard lock(regions_mu_);
      // The connections of this incarnation only: a restarted peer of the same name may be connected already.
      for (auto& [fd, sc] : served_)
        if (sc.name == conn->name && sc.address == conn->address) {
          sc.revoked = true;
          fds.push_back(fd);
        }
    }
    for (int fd : fds) shutdown(fd, SHUT_RDWR);
    // Our own connection: its receiver sees the end and fails what still waits on the peer. Not under send_mu: a
    // send blocked on a peer that stopped reading holds it, and the shutdown is what ends that send.
    shutdown(conn->fd, SHUT_RDWR);
    return backend_revoked(peer);
  }
  // Host windows: this agent copies the peer's writes itself and stopped at the disconnect. CUDA regions and
  // shared memory: the peer holds their IPC handles or has the memfd mapped, and its kernels and copies write them
  // directly, which nothing here can stop, so they are safe only once the peer's process has exited.
  bool backend_revoked(PeerId peer) const override {
    {
      std::lock_guard lock(regions_mu_);
      bool direct = !retired_shared_.empty();
      for (const auto& [id, w] : own_) direct = direct || w.cuda || w.shared;
      if (!direct) return true;
    }
    auto conn = conn_of(peer);
    if (!conn || conn->pidfd < 0) return false;
    pollfd p{conn->pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;  // a pidfd turns readable when its process has exited
  }

  // CUDA regions are mapped here from the peer's IPC handles: kernels of this process address them directly.
  Result<void*> backend_peer_address(PeerId peer, std::uint32_t region, const detail::Blob::Region&) override {
    auto conn = conn_of(peer);
    if (!conn) return NotFound(fmt::format("peer {} is not connected", peer));
    if (region >= conn->windows.size() || conn->windows[region].base == nullptr ||
        !(conn->windows[region].cuda || conn->windows[region].shared))
      return NotSupported(fmt::format(
          "peer '{}' region {} is neither CUDA memory nor shared memory mapped here (other host windows are reached "
          "through the owner's copies)",
          conn->name, region));
    return static_cast<void*>(conn->windows[region].base);
  }

  void backend_abort(XferId id) override {
    std::lock_guard lock(jobs_mu_);
    auto it = all_.find(id);
    if (it != all_.end()) it->second->aborted.store(true);
    for (auto& j : jobs_)
      if (j->id == id) j->aborted.store(true);
  }

 private:
  struct PeerWindow {
    std::byte* base = nullptr;  // the window mapped here
    std::uint64_t bytes = 0;
    std::uint64_t remote_base = 0;  // the region's address in the peer (the blob's base)
    bool cuda = false;              // the peer's CUDA memory, opened from its IPC handle
    bool shared = false;            // the peer's allocate_shared memory: the window is the memory itself
  };
  struct OwnWindow {
    std::byte* base = nullptr;
    std::uint64_t bytes = 0;
    int fd = -1;
    std::byte* region = nullptr;
    bool cuda = false;    // CUDA memory: the peer copies into the region itself
    bool shared = false;  // allocate_shared memory: the window is the region
  };
  struct Conn {
    int fd = -1;
    int pidfd = -1;  // the peer's process (SO_PEERCRED of our connection), -1 where the kernel has no pidfd
    ~Conn() {
      if (pidfd >= 0) close(pidfd);
    }
    PeerId peer = 0;
    std::string name;
    std::string address;              // the peer's blob address: its incarnation
    std::vector<PeerWindow> windows;  // by the peer's region index
    std::mutex send_mu;
    std::thread receiver;
    std::atomic<bool> dead{false};
  };
  struct Job {
    XferId id = 0;  // 0: a bare notification
    XferOp op = XferOp::kWrite;
    NotifKind kind = NotifKind::kMessage;
    std::shared_ptr<Conn> conn;
    std::vector<detail::ResolvedOp> ops;
    std::string notification;
    std::atomic<bool> aborted{false};
    // Under jobs_mu_: the worker still executes it (it may touch local memory), so only the worker completes
    // it when the connection ends meanwhile.
    bool in_worker = true;
  };

  // A pidfd of the process at the other end of `fd` (our connection to the peer's listener), or -1.
  static int peer_pidfd(int fd) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return -1;
#ifdef SYS_pidfd_open
    return static_cast<int>(syscall(SYS_pidfd_open, cred.pid, 0));
#else
    return -1;
#endif
  }

  std::shared_ptr<Conn> conn_of(PeerId peer) const {
    std::lock_guard lock(conns_mu_);
    return peer < conns_.size() ? conns_[peer] : nullptr;
  }

  // A send that fails (the peer gone, or not reading for send_timeout) ends the connection: its receiver sees the
  // end and fails the peer, rather than later messages going out with one missing between them.
  bool send_on(Conn& c, const std::string& m) {
    std::lock_guard lock(c.send_mu);
    if (c.dead.load()) return false;
    if (send_msg(c.fd, m)) return true;
    shutdown(c.fd, SHUT_RDWR);
    return false;
  }

  // Ends a transfer: outcome, then quiescence (this side no longer touches its memory).
  void complete(XferId id, Status s) {
    {
      std::lock_guard lock(jobs_mu_);
      all_.erase(id);
    }
    finish_xfer(id, std::move(s));
    set_quiescent(id);
  }

  // ---- initiator ----

  void work_loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(jobs_mu_);
        jobs_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = jobs_.front();
        jobs_.pop_front();
        if (job->id != 0) all_[job->id] = job;
      }
      execute(*job);
    }
  }

  void execute(Job& job) {
    Conn& c = *job.conn;
    if (job.id == 0) {
      Buf m;
      m.u32(kNotify);
      m.u8(static_cast<std::uint8_t>(job.kind));
      m.str(job.notification);
      send_on(c, m.out);
      return;
    }
    if (job.aborted.load()) return complete(job.id, Aborted(fmt::format("transfer {} was aborted", job.id)));
    if (c.dead.load()) return complete(job.id, Unavailable(fmt::format("peer '{}' is gone", c.name)));
    Buf m;
    m.u32(job.op == XferOp::kWrite ? kWrite : kRead);
    m.u64(job.id);
    m.u32(static_cast<std::uint32_t>(job.ops.size()));
    for (const auto& op : job.ops) {
      const PeerWindow& w = op.remote_region < c.windows.size() ? c.windows[op.remote_region] : PeerWindow{};
      if (w.base == nullptr)
        return complete(job.id, FailedPrecondition(
                                    fmt::format("peer '{}' region {} has no shared window", c.name, op.remote_region)));
      // The window is exactly the region's bytes; nothing outside it may be copied (the base checked the
      // descriptor against the same bytes: this guards the copy itself).
      const std::uint64_t off = op.remote_addr - w.remote_base;
      if (op.remote_addr < w.remote_base || off > w.bytes || op.bytes > w.bytes - off)
        return complete(job.id, OutOfRange(fmt::format("peer '{}' region {}: [{}, +{}) outside its window of {} bytes",
                                                       c.name, op.remote_region, off, op.bytes, w.bytes)));
      m.u32(op.remote_region);
      m.u64(window_offset(job, op));
      m.u64(op.bytes);
    }
    if (job.op == XferOp::kWrite) {
      if (job.aborted.load()) return complete(job.id, Aborted(fmt::format("transfer {} was aborted", job.id)));
      Status cs = copy_ops(job, true, 0);
      if (!cs.ok()) return fail_copy(job, std::move(cs));
      m.str(job.notification);
    }
    if (!send_on(c, m.out)) return complete(job.id, Unavailable(fmt::format("peer '{}' is gone", c.name)));
    // The receiver completes it on the peer's reply, or when the connection ends: unless it ended before this.
    bool gone = false;
    {
      std::lock_guard lock(jobs_mu_);
      job.in_worker = false;
      gone = c.dead.load() && all_.count(job.id) > 0;
    }
    if (gone) complete(job.id, Unavailable(fmt::format("peer '{}' closed its ipc connection", c.name)));
  }

  // Copies a job's bytes: local -> the peer's windows (to_peer) or back. A CUDA agent copies with cudaMemcpyAsync
  // (cudaMemcpyDefault: device to device, peer, or to and from host windows) on the worker's stream (stream 0) or
  // a stream of its own (receivers: one per connection may run at once), then polls one event until it
  // completes. Copies already enqueued are drained before an error is returned; kTimedOut means they may still
  // run (the caller keeps the transfer non-quiescent).
  Status copy_ops(const Job& job, bool to_peer, int stream) {
#if KVTIER_IPC_CUDA
    if (options_.device_memory == IpcOptions::DeviceMemory::kCuda) {
      KVTIER_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options_.cuda_device), "cudaSetDevice"));
      cudaStream_t st = streams_[0];
      cudaEvent_t ev = events_[0];
      if (stream != 0) {
        KVTIER_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate"));
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
          cudaStreamDestroy(st);
          return Internal("cudaEventCreate failed");
        }
      }
      Status enq;
      for (const auto& op : job.ops) {
        std::byte* w = job.conn->windows[op.remote_region].base + window_offset(job, op);
        enq = cuda_status(to_peer ? cudaMemcpyAsync(w, op.local_ptr, op.bytes, cudaMemcpyDefault, st)
                                  : cudaMemcpyAsync(op.local_ptr, w, op.bytes, cudaMemcpyDefault, st),
                          "cudaMemcpyAsync");
        if (!enq.ok()) break;
      }
      Status done = cuda_status(cudaEventRecord(ev, st), "cudaEventRecord");
      if (done.ok()) {
        const auto deadline = std::chrono::steady_clock::now() + options_.copy_timeout;
        for (;;) {
          const cudaError_t q = cudaEventQuery(ev);
          if (q == cudaSuccess) break;
          if (q != cudaErrorNotReady) {
            done = cuda_status(q, "cudaEventQuery");
            break;
          }
          if (std::chrono::steady_clock::now() >= deadline) {
            done = TimedOut(fmt::format("transfer {}: CUDA copies not complete after {} ms", job.id,
                                        options_.copy_timeout.count()));
            break;
          }
          std::this_thread::sleep_for(20us);
        }
      } else {
        // Without an event the enqueued copies' state is unknown: fail closed.
        done = TimedOut(fmt::format("transfer {}: {}", job.id, done.message()));
      }
      if (stream != 0) {
        cudaEventDestroy(ev);
        cudaStreamDestroy(st);  // released once its work is done
      }
      if (done.code() == StatusCode::kTimedOut) return done;
      return enq.ok() ? done : enq;
    }
#else
    (void)stream;
#endif
    for (const auto& op : job.ops) {
      std::byte* w = job.conn->windows[op.remote_region].base + window_offset(job, op);
      if (to_peer)
        std::memcpy(w, op.local_ptr, op.bytes);
      else
        std::memcpy(op.local_ptr, w, op.bytes);
    }
    return Status::Ok();
  }

  // A copy failed: the transfer fails; it stays non-quiescent when copies may still be running (fail closed).
  void fail_copy(const Job& job, Status s) {
    if (s.code() != StatusCode::kTimedOut) return complete(job.id, std::move(s));
    {
      std::lock_guard lock(jobs_mu_);
      all_.erase(job.id);
    }
    finish_xfer(job.id, std::move(s));
  }

#if KVTIER_IPC_CUDA
  Status open_cuda_window(Conn& conn, std::uint32_t index, const detail::Blob::Region& r) {
    // An agent without CUDA leaves the peer's CUDA regions unmapped: posts to them fail (no shared window).
    if (options_.device_memory != IpcOptions::DeviceMemory::kCuda) return Status::Ok();
    // "cuda;<hex>;<offset>;<pci>"
    const std::string_view key = r.key;
    const auto a = key.find(';', 5), b = key.find(';', a + 1);
    cudaIpcMemHandle_t h{};
    if (a == std::string_view::npos || b == std::string_view::npos || !from_hex(key.substr(5, a - 5), &h, sizeof(h)))
      return InvalidArgument(fmt::format("peer '{}' region {}: malformed CUDA key", conn.name, index));
    const std::uint64_t offset = std::strtoull(std::string(key.substr(a + 1, b - a - 1)).c_str(), nullptr, 10);
    KVTIER_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options_.cuda_device), "cudaSetDevice"));
    void* p = nullptr;
    KVTIER_RETURN_IF_ERROR(cuda_status(
        cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
        fmt::format("cudaIpcOpenMemHandle (peer '{}' region {}, device {})", conn.name, index, key.substr(b + 1))));
    {
      std::lock_guard lock(jobs_mu_);
      opened_.push_back(p);
    }
    conn.windows[index] = PeerWindow{static_cast<std::byte*>(p) + offset, r.bytes, r.base, true};
    return Status::Ok();
  }
#else
  // Without CUDA in the build the peer's CUDA regions stay unmapped: posts to them fail (no shared window).
  Status open_cuda_window(Conn&, std::uint32_t, const detail::Blob::Region&) { return Status::Ok(); }
#endif

  // Maps the peer's window of region `index` after checking that the peer cannot pull it out from under us: a
  // window that shrinks while mapped turns every copy past its new end into SIGBUS, which kills this process.
  // So the file must be sealed against shrinking and growing, and hold at least the bytes the blob claims for
  // the region (descriptors are checked against those bytes). Anything else refuses the peer.
  Status map_window(Conn& conn, std::uint32_t index, std::uint64_t bytes, const detail::Blob::Region& r, int fd) {
    if (conn.windows[index].base != nullptr)
      return InvalidArgument(fmt::format("peer '{}' sent the window of region {} twice", conn.name, index));
    if (bytes != r.bytes || bytes == 0)
      return InvalidArgument(fmt::format("peer '{}' window of region {}: handshake says {} bytes, its blob {} bytes",
                                         conn.name, index, bytes, r.bytes));
    const int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0)
      return FailedPrecondition(fmt::format("peer '{}' window of region {}: not a sealable memfd ({})", conn.name,
                                            index, std::strerror(errno)));
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
      return FailedPrecondition(
          fmt::format("peer '{}' window of region {}: memfd seals {:#x} lack {}{}: the peer could resize it under "
                      "our mapping",
                      conn.name, index, seals, (seals & F_SEAL_SHRINK) ? "" : "F_SEAL_SHRINK ",
                      (seals & F_SEAL_GROW) ? "" : "F_SEAL_GROW"));
    struct stat st {};
    if (fstat(fd, &st) != 0)
      return Internal(fmt::format("peer '{}' window of region {}: fstat: {}", conn.name, index, std::strerror(errno)));
    if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < bytes)
      return FailedPrecondition(fmt::format("peer '{}' window of region {}: memfd holds {} bytes, its blob claims {}",
                                            conn.name, index, static_cast<std::int64_t>(st.st_size), bytes));
    void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED)
      return ResourceExhausted(fmt::format("peer '{}' window of region {}: mapping {} bytes: {}", conn.name, index,
                                           bytes, std::strerror(errno)));
    conn.windows[index] = PeerWindow{static_cast<std::byte*>(w), bytes, r.base, false, r.key == kSharedKey};
    return Status::Ok();
  }

  // The base resolves remote descriptors to the peer's addresses; the window has the region's layout.
  static std::uint64_t window_offset(const Job& job, const detail::ResolvedOp& op) {
    return op.remote_addr - job.conn->windows[op.remote_region].remote_base;
  }

  void receive_loop(std::shared_ptr<Conn> conn) {
    std::string m;
    while (recv_msg(conn->fd, m)) {
      note_peer_progress(conn->name);
      Parse p(m);
      std::uint32_t type = 0, code = 0;
      std::uint64_t id = 0;
      std::string text;
      if (!p.u32(type) || type != kReply || !p.u64(id) || !p.u32(code) || !p.str(text)) break;
      std::shared_ptr<Job> job;
      {
        std::lock_guard lock(jobs_mu_);
        auto it = all_.find(id);
        if (it != all_.end()) job = it->second;
      }
      if (!job) continue;
      if (code != 0) {
        complete(id, Status(static_cast<StatusCode>(code), fmt::format("peer '{}': {}", conn->name, text)));
        continue;
      }
      if (job->op == XferOp::kRead) {
        if (job->aborted.load()) {
          complete(id, Aborted(fmt::format("transfer {} was aborted", id)));
          continue;
        }
        Status cs;
        {
          CopyingFor busy(*this, conn->name);
          cs = copy_ops(*job, false, 1);
        }
        if (!cs.ok()) {
          fail_copy(*job, std::move(cs));
          continue;
        }
        Buf n;
        n.u32(kNotify);
        n.u8(static_cast<std::uint8_t>(NotifKind::kMessage));
        n.str(job->notification);
        if (!send_on(*conn, n.out)) {
          complete(id, Unavailable(fmt::format("peer '{}' is gone", conn->name)));
          continue;
        }
      }
      complete(id, Status::Ok());
    }
    // The connection ended: the peer died or went away.
    {
      std::lock_guard lock(conn->send_mu);
      conn->dead.store(true);
    }
    const Status gone = Unavailable(fmt::format("peer '{}' closed its ipc connection (died or went away)", conn->name));
    mark_peer_failed(conn->peer, gone);
    // The worker completes jobs it holds; jobs still queued see `dead` when it reaches them.
    std::vector<XferId> waiting;
    {
      std::lock_guard lock(jobs_mu_);
      for (auto& [id, j] : all_)
        if (j->conn == conn && !j->in_worker) waiting.push_back(id);
    }
    for (XferId id : waiting) complete(id, gone);
  }

  // ---- owner ----

  void accept_loop() {
    for (;;) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down
      }
      set_buffers(fd, options_.send_timeout);
      std::lock_guard lock(servers_mu_);
      server_fds_.push_back(fd);
      servers_.emplace_back([this, fd] {
        serve(fd);
        // A peer whose request was malformed (or that was disconnected) sees the end at once; the descriptor
        // itself is closed with the transport, so served_ never sees its number reused.
        shutdown(fd, SHUT_RDWR);
      });
    }
  }

  // Whom this owner serves. Its socket is abstract (no file permissions) and its name is in the blob and in
  // /proc/net/unix, and whoever is served gets every registered region's window and may send notifications under
  // any name: without a peer secret only processes of this process's user (SO_PEERCRED); with one only an agent
  // that answers a fresh challenge with the secret (handshake_proof), whatever its user.
  bool admit(int fd, const std::string& name, const std::string& address) {
    if (options_.peer_secret.empty()) {
      ucred cred{};
      socklen_t len = sizeof(cred);
      if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == geteuid()) return true;
      log(LogLevel::kWarning, "transport",
          fmt::format("ipc '{}': refused a connection calling itself '{}' from user {} (this agent has no peer "
                      "secret, so only its own user {} is served)",
                      identity().name, name, cred.uid, geteuid()));
      return false;
    }
    // The handshake is bounded: a connector that never answers must not hold this thread.
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const std::string challenge = detail::handshake_challenge();
    Buf c;
    c.u32(kChallenge);
    c.str(challenge);
    std::string m, proof;
    std::uint32_t type = 0;
    bool ok = send_msg(fd, c.out) && recv_msg(fd, m);
    Parse p(m);
    ok = ok && p.u32(type) && type == kProof && p.str(proof) &&
         detail::handshake_proof_matches(
             proof, detail::handshake_proof(options_.peer_secret, challenge, name, address, identity().name));
    timeval none{0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    if (!ok)
      log(LogLevel::kWarning, "transport",
          fmt::format("ipc '{}': refused a connection calling itself '{}': it did not prove the peer secret",
                      identity().name, name));
    return ok;
  }

  void serve(int fd) {
    std::string m;
    std::string peer_name;
    bool hello = false;
    while (recv_msg(fd, m)) {
      Parse p(m);
      std::uint32_t type = 0;
      static_cast<void>(p.u32(type));  // a short message leaves type 0, which is refused below
      if (!hello) {
        std::string peer_address;
        if (type != kHello || !p.str(peer_name) || !p.str(peer_address)) return;
        if (!admit(fd, peer_name, peer_address)) return;
        hello = true;
        {
          std::lock_guard lock(regions_mu_);
          served_[fd] = Served{peer_name, false, peer_address};
        }
        if (!send_regions(fd)) return;
        continue;
      }
      note_peer_progress(peer_name);
      if (type == kNotify) {
        std::uint8_t kind = 0;
        std::string text;
        if (!p.u8(kind) || !p.str(text) || kind > static_cast<std::uint8_t>(NotifKind::kFailedToPost)) return;
        {
          std::lock_guard lock(regions_mu_);
          if (served_[fd].revoked) return;
        }
        deliver(Notification{peer_name, static_cast<NotifKind>(kind), std::move(text)});
        continue;
      }
      if (type != kWrite && type != kRead) return;
      std::uint64_t id = 0;
      std::uint32_t n = 0;
      if (!p.u64(id) || !p.u32(n)) return;
      // A range is 20 bytes: a count the message cannot hold is malformed (and must not size an allocation).
      if (n > m.size() / 20) return;
      std::vector<Range> ranges(n);
      for (auto& r : ranges)
        if (!p.u32(r.region) || !p.u64(r.offset) || !p.u64(r.bytes)) return;
      std::string notification;
      if (type == kWrite && !p.str(notification)) return;
      Status s;
      {
        CopyingFor busy(*this, peer_name);
        std::lock_guard lock(regions_mu_);
        if (served_[fd].revoked) return;  // disconnected: this peer's requests no longer touch our memory
        for (const auto& r : ranges) {
          auto it = own_.find(r.region);
          if (it == own_.end() || r.offset > it->second.bytes || r.bytes > it->second.bytes - r.offset) {
            s = FailedPrecondition(
                fmt::format("region {} [{}, +{}) is no longer registered here", r.region, r.offset, r.bytes));
            break;
          }
          // The initiator copied into (or reads from) the region itself.
          if (it->second.cuda || it->second.shared) continue;
          if (type == kWrite)
            std::memcpy(it->second.region + r.offset, it->second.base + r.offset, r.bytes);
          else
            std::memcpy(it->second.base + r.offset, it->second.region + r.offset, r.bytes);
        }
      }
      // A WRITE's notification follows its bytes, before the acknowledgement.
      if (s.ok() && type == kWrite) deliver(Notification{peer_name, NotifKind::kMessage, std::move(notification)});
      Buf reply;
      reply.u32(kReply);
      reply.u64(id);
      reply.u32(static_cast<std::uint32_t>(s.code()));
      reply.str(s.message());
      if (!send_msg(fd, reply.out)) return;
    }
  }

  bool send_regions(int fd) {
    std::lock_guard lock(regions_mu_);
    RegionId top = 0;
    for (auto& [id, w] : own_) top = std::max(top, id + 1);
    for (RegionId i = 0; i < top; ++i) {
      auto it = own_.find(i);
      Buf m;
      m.u32(kRegion);
      m.u32(i);
      m.u64(it == own_.end() ? 0 : it->second.bytes);
      m.u8(it == own_.end() ? 0 : 1);
      if (!send_msg(fd, m.out, it == own_.end() ? -1 : it->second.fd)) return false;
    }
    Buf end;
    end.u32(kRegionsEnd);
    return send_msg(fd, end.out);
  }

  const IpcOptions options_;
  const HostIdentity host_;
#if KVTIER_IPC_CUDA
  cudaStream_t streams_[1] = {};  // the worker's
  cudaEvent_t events_[1] = {};
  std::vector<void*> opened_;  // the peers' allocations, closed at the end
#endif
  std::string sock_name_;
  int listen_fd_ = -1;

  mutable std::mutex regions_mu_;
  std::map<RegionId, OwnWindow> own_;
  std::map<void*, OwnWindow> pending_shared_;  // allocate_shared memory not yet registered
  std::vector<OwnWindow> retired_shared_;      // allocate_shared memory deregistered (still the caller's)
  static constexpr std::string_view kSharedKey = "memfd-shared";
  struct Served {
    std::string name;      // the peer's agent name, from its hello
    bool revoked = false;  // disconnect_peer: its requests are no longer served
    std::string address;   // the peer's blob address, from its hello: which incarnation of the name
  };
  std::map<int, Served> served_;  // by incoming connection

  mutable std::mutex conns_mu_;
  std::vector<std::shared_ptr<Conn>> conns_;

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  std::map<XferId, std::shared_ptr<Job>> all_;  // transfers taken by the worker, until complete
  bool stop_ = false;
  std::thread worker_;
  std::thread listener_;

  std::mutex servers_mu_;
  std::vector<int> server_fds_;
  std::vector<std::thread> servers_;
};

}  // namespace

bool ipc_cuda_supported() noexcept { return KVTIER_IPC_CUDA != 0; }

Result<HostIdentity> ipc_blob_host(std::span<const std::byte> blob, std::string_view peer_secret) {
  KVTIER_ASSIGN_OR_RETURN(detail::Blob b, detail::decode_blob(blob, peer_secret));
  if (b.backend != "ipc") return InvalidArgument(fmt::format("blob of backend '{}', not ipc", b.backend));
  KVTIER_ASSIGN_OR_RETURN(Address a, parse_address(b.address));
  return a.host;
}

Result<std::unique_ptr<Transport>> create_ipc_transport(AgentIdentity identity, IpcOptions options) {
  KVTIER_RETURN_IF_ERROR(detail::check_agent_name(identity.name));
  KVTIER_RETURN_IF_ERROR(detail::check_peer_secret(options.peer_secret));
  if (options.send_timeout.count() <= 0 || options.send_timeout > std::chrono::hours(24))
    return InvalidArgument(
        fmt::format("ipc send_timeout {} ms: must be in (0, 86,400,000] ms", options.send_timeout.count()));
  if (identity.tp_size == 0 || identity.tp_rank >= identity.tp_size)
    return InvalidArgument(
        fmt::format("tensor-parallel rank {} of size {}: need rank < size", identity.tp_rank, identity.tp_size));
  Result<HostIdentity> host = options.host_identity ? options.host_identity() : local_host_identity();
  if (!host.ok()) return host.status();
  auto t = std::make_unique<IpcTransport>(std::move(identity), std::move(options), std::move(host).value());
  KVTIER_RETURN_IF_ERROR(t->start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvtier::transport
