// The ipc backend's own cases: host identity in the blob and the refusals built on it (another host, another pid
// namespace, damaged blobs), the peer going away, and the choice between ipc and the staged path.
#include "kvtier/transport/ipc.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "core/byte_codec.h"
#include "transport/ipc/ipc_wire.h"
#include "transport/transport_base.h"

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;

int g_seq = 0;
AgentIdentity ident(const char* base) { return AgentIdentity{fmt::format("{}-{}", base, ++g_seq), 0x1234, 1, 0}; }

IpcOptions with_host(HostIdentity h) {
  IpcOptions o;
  o.host_identity = [h] { return Result<HostIdentity>(h); };
  return o;
}

TEST(IpcHostIdentity, ComesFromProcAndTravelsInTheBlob) {
  auto h = local_host_identity();
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->boot_id.size(), 36u) << h->boot_id;
  EXPECT_EQ(h->pid_ns.rfind("pid:[", 0), 0u) << h->pid_ns;
  auto t = create_ipc_transport(ident("a"));
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  auto blob = (*t)->export_metadata();
  ASSERT_TRUE(blob.ok());
  auto got = ipc_blob_host(*blob);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, *h);
}

// A process out of file descriptors: the ipc backend's socket, window and host identity calls failed as kInternal
// (Python's FatalError: "the library is broken") or as "no procfs?". Each says the open-file limit now
// (kResourceExhausted). In a child process, whose descriptors are used up to its limit.
TEST(IpcBackend, OutOfFileDescriptorsIsResourceExhaustedNamingTheLimit) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rlimit lim{64, 64};
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(10);
    while (::open("/dev/null", O_RDONLY | O_CLOEXEC) >= 0) {
    }
    auto host = local_host_identity();
    if (host.ok() || host.status().code() != StatusCode::kResourceExhausted ||
        host.status().message().find("open-file limit") == std::string::npos)
      _exit(11);
    IpcOptions o;  // a fixed identity, so that the transport's own descriptors are what runs out
    o.host_identity = [] { return Result<HostIdentity>(HostIdentity{"boot", "pid:[1]"}); };
    auto t = create_ipc_transport(ident("nofd"), o);
    if (t.ok() || t.status().code() != StatusCode::kResourceExhausted ||
        t.status().message().find("open-file limit") == std::string::npos)
      _exit(12);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: setrlimit, 11: the host identity, 12: the transport";
}

TEST(IpcBlob, APeerOnAnotherHostIsRefusedNamingBothBootIds) {
  auto local = local_host_identity().value();
  HostIdentity other = local;
  other.boot_id = "00000000-0000-4000-8000-000000000042";
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b"), with_host(other)).value();
  std::vector<std::byte> mem(4096);
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mem.data(), mem.size()}).ok());
  auto p = a->load_peer(b->export_metadata().value());
  ASSERT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().to_string();
  EXPECT_NE(p.status().message().find(other.boot_id), std::string::npos) << p.status().to_string();
  EXPECT_NE(p.status().message().find(local.boot_id), std::string::npos) << p.status().to_string();
  // The refused peer is not connected: nothing can be posted to it.
  std::vector<std::byte> src(64);
  RegionId ra = a->register_memory({MemoryKind::kPinnedHost, 0, src.data(), src.size()}).value();
  LocalDesc l{ra, 0, 64};
  RemoteDesc r{0, 0, 64};
  EXPECT_FALSE(a->post(XferOp::kWrite, 0, {&l, 1}, {&r, 1}, "x").ok());
  EXPECT_EQ(mem, std::vector<std::byte>(4096));
}

TEST(IpcBlob, APeerInAnotherPidNamespaceIsRefusedNamingBoth) {
  auto local = local_host_identity().value();
  HostIdentity other = local;
  other.pid_ns = "pid:[1]";
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b"), with_host(other)).value();
  auto p = a->load_peer(b->export_metadata().value());
  ASSERT_EQ(p.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("pid:[1]"), std::string::npos) << p.status().to_string();
  EXPECT_NE(p.status().message().find(local.pid_ns), std::string::npos) << p.status().to_string();
}

TEST(IpcBlob, DamagedTruncatedAndMalformedBlobsAreRefused) {
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b")).value();
  auto blob = b->export_metadata().value();
  auto damaged = blob;
  damaged[damaged.size() / 2] ^= std::byte{0x01};
  EXPECT_EQ(a->load_peer(damaged).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ipc_blob_host(damaged).status().code(), StatusCode::kDataLoss);
  std::vector<std::byte> truncated(blob.begin(), blob.begin() + 12);
  EXPECT_EQ(a->load_peer(truncated).status().code(), StatusCode::kInvalidArgument);
  // A well-formed blob of the ipc backend whose address is not an ipc address.
  auto decoded = detail::decode_blob(blob).value();
  decoded.address = "ipc1;boot=x";
  auto p = a->load_peer(detail::encode_blob(decoded));
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
  // The intact blob still loads.
  EXPECT_TRUE(a->load_peer(blob).ok());
}

TEST(IpcBackend, CudaDeviceMemoryIsNotSupportedByABuildWithoutCuda) {
  if (ipc_cuda_supported()) GTEST_SKIP() << "this build has the CUDA data path (ipc_gpu_test covers it)";
  IpcOptions o;
  o.device_memory = IpcOptions::DeviceMemory::kCuda;
  auto a = create_ipc_transport(ident("a"), o).value();
  std::vector<std::byte> mem(64);
  EXPECT_EQ(a->register_memory({MemoryKind::kDevice, 0, mem.data(), mem.size()}).status().code(),
            StatusCode::kNotSupported);
  // The host backend's device memory is RAM and is shared like pinned host memory.
  auto h = create_ipc_transport(ident("h")).value();
  EXPECT_TRUE(h->register_memory({MemoryKind::kDevice, 0, mem.data(), mem.size()}).ok());
}

TEST(IpcBackend, APeerThatGoesAwayFailsTransfersWithUnavailableAndNothingHangs) {
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> ma(1 << 16, std::byte{1}), mb(1 << 16, std::byte{2});
  RegionId ra = a->register_memory({MemoryKind::kPinnedHost, 0, ma.data(), ma.size()}).value();
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  PeerId pb = a->load_peer(b->export_metadata().value()).value();
  LocalDesc l{ra, 0, ma.size()};
  RemoteDesc r{0, 0, ma.size()};
  auto x = a->post(XferOp::kWrite, pb, {&l, 1}, {&r, 1}, "before");
  ASSERT_TRUE(x.ok());
  auto st = a->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  EXPECT_EQ(mb, ma);
  b.reset();
  // The connection's end reaches a's receiver; from then on posts are refused, and one that raced it fails.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  Status last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto y = a->post(XferOp::kRead, pb, {&l, 1}, {&r, 1}, "after");
    if (!y.ok()) {
      last = y.status();
      break;
    }
    auto s = a->wait(*y, 10s);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ASSERT_EQ(s->state, XferState::kFailed);
    last = s->error;
    break;
  }
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.to_string();
}

// A peer that dropped this agent (it gave up at a lease while both lived) closed the connection; its metadata, the
// same as before, was refused as a duplicate (AlreadyExists) however long this agent waited, so the pair could not
// be connected again without new processes. Once the connection has failed, the same blob reconnects.
TEST(IpcBackend, APeerThatDroppedThisAgentIsLoadedAgainFromTheSameBlob) {
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> ma(1 << 16), mb(1 << 16, std::byte{2});
  for (std::size_t i = 0; i < ma.size(); ++i) ma[i] = static_cast<std::byte>(i * 7 + 1);
  RegionId ra = a->register_memory({MemoryKind::kPinnedHost, 0, ma.data(), ma.size()}).value();
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  const std::vector<std::byte> blob_a = a->export_metadata().value(), blob_b = b->export_metadata().value();
  PeerId pb = a->load_peer(blob_b).value();
  PeerId pa = b->load_peer(blob_a).value();
  ASSERT_TRUE(b->disconnect_peer(pa).ok());
  // While a has not seen the connection end, the blob is a duplicate; then it loads.
  Result<PeerId> again = AlreadyExists("not tried");
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    again = a->load_peer(blob_b);
    if (again.status().code() != StatusCode::kAlreadyExists) break;
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_NE(*again, pb);
  EXPECT_EQ(a->load_peer(blob_b).status().code(), StatusCode::kAlreadyExists);  // connected again: a duplicate
  ASSERT_TRUE(b->load_peer(blob_a).ok());                                       // b dropped a: its name is free
  LocalDesc l{ra, 0, ma.size()};
  RemoteDesc r{0, 0, ma.size()};
  auto x = a->post(XferOp::kWrite, *again, {&l, 1}, {&r, 1}, "reconnected");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  auto st = a->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  EXPECT_EQ(mb, ma);
}

// ---- shared windows: a peer must not be able to resize them ---------------------------------------------

// The ipc handshake as the backend speaks it (transport/ipc/ipc_wire.h): kHello {name, address}, kRegion {index, bytes,
// live} + the window's descriptor, kRegionsEnd.
using ipc_wire::kHello;
using ipc_wire::kRegion;
using ipc_wire::kRegionsEnd;

bool send_with_fd(int sock, const std::string& m, int fd) { return ipc_wire::send_msg(sock, m, fd); }
bool recv_with_fd(int sock, std::string& m, int& fd) { return ipc_wire::recv_msg(sock, m, &fd); }

int abstract_socket(const std::string& name, bool listen_on) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  const int rc = listen_on ? (bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0 ? listen(fd, 4) : -1)
                           : connect(fd, reinterpret_cast<sockaddr*>(&a), len);
  if (rc != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A crafted owner: it advertises one region of `claimed` bytes and hands over `window` as its shared window.
class FakeIpcOwner {
 public:
  // `reads`: false for an owner that stops reading once the handshake is done (a paused process).
  FakeIpcOwner(int window, std::uint64_t claimed, bool reads = true)
      : window_(window), claimed_(claimed), reads_(reads) {
    std::random_device rd;
    sock_ = fmt::format("kvtier-fake-owner-{}-{:08x}", getpid(), rd());
    listen_fd_ = abstract_socket(sock_, true);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeIpcOwner() {
    stop_.store(true);
    shutdown(listen_fd_, SHUT_RDWR);
    if (conn_fd_.load() >= 0) shutdown(conn_fd_.load(), SHUT_RDWR);
    thread_.join();
    close(listen_fd_);
    if (conn_fd_.load() >= 0) close(conn_fd_.load());
  }
  std::vector<std::byte> blob() const {
    const HostIdentity h = local_host_identity().value();
    detail::Blob b;
    b.version = kTransportVersion;
    b.backend = "ipc";
    b.identity = AgentIdentity{"fake-owner", 0x1234, 1, 0};
    b.regions.push_back(detail::Blob::Region{MemoryKind::kPinnedHost, 0x7f0000000000ULL, claimed_, "memfd"});
    b.address = fmt::format("ipc1;boot={};pidns={};pid={};sock={}", h.boot_id, h.pid_ns, getpid(), sock_);
    return detail::encode_blob(b);
  }

 private:
  void serve() {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    conn_fd_.store(fd);
    if (fd < 0) return;
    std::string m;
    int ignored = -1;
    if (!recv_with_fd(fd, m, ignored)) return;
    codec::ByteWriter<std::string> r;
    r.u32(kRegion);
    r.u32(0);
    r.u64(claimed_);
    r.u8(1);
    if (!send_with_fd(fd, r.out, window_)) return;
    codec::ByteWriter<std::string> end;
    end.u32(kRegionsEnd);
    send_with_fd(fd, end.out, -1);
    // Stay connected until the test ends (the loader's receiver reads until the connection closes).
    if (!reads_) {
      while (!stop_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    while (recv_with_fd(fd, m, ignored)) {
      if (ignored >= 0) close(ignored);
    }
  }

  int window_;
  std::uint64_t claimed_;
  bool reads_ = true;
  std::atomic<bool> stop_{false};
  std::string sock_;
  int listen_fd_ = -1;
  std::atomic<int> conn_fd_{-1};
  std::thread thread_;
};

int memfd_of(std::uint64_t bytes, int seals) {
  const int fd = memfd_create("kvtier-test-window", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return -1;
  if (seals != 0 && fcntl(fd, F_ADD_SEALS, seals) != 0) return -1;
  return fd;
}

// A peer that hands over a window it can still shrink (and then does) is refused before anything is mapped: a
// copy into a shrunk mapping would raise SIGBUS and kill this process.
TEST(IpcWindows, AnUnsealedOrShrunkWindowIsRefusedAtLoad) {
  constexpr std::uint64_t kBytes = 1 << 16;
  auto a = create_ipc_transport(ident("a")).value();
  std::vector<std::byte> src(kBytes, std::byte{0x5a});
  RegionId ra = a->register_memory({MemoryKind::kPinnedHost, 0, src.data(), src.size()}).value();

  const int unsealed = memfd_of(kBytes, 0);
  ASSERT_GE(unsealed, 0);
  {
    FakeIpcOwner owner(unsealed, kBytes);
    auto p = a->load_peer(owner.blob());
    ASSERT_FALSE(p.ok()) << "an unsealed window was mapped";
    EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().to_string();
    EXPECT_NE(p.status().message().find("region 0"), std::string::npos) << p.status().to_string();
    EXPECT_NE(p.status().message().find("F_SEAL_SHRINK"), std::string::npos) << p.status().to_string();
    // What the crafted peer does next: shrink the file. Nothing of it is mapped here, so nothing faults, and
    // the refused peer takes no transfer.
    ASSERT_EQ(ftruncate(unsealed, 0), 0);
    LocalDesc l{ra, 0, kBytes};
    RemoteDesc r{0, 0, kBytes};
    EXPECT_FALSE(a->post(XferOp::kWrite, 0, {&l, 1}, {&r, 1}, "x").ok());
  }
  close(unsealed);

  // Sealed, but smaller than the region its blob claims: a copy past the file's end would fault as well.
  const int short_window = memfd_of(kBytes / 4, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ASSERT_GE(short_window, 0);
  {
    FakeIpcOwner owner(short_window, kBytes);
    auto p = a->load_peer(owner.blob());
    ASSERT_FALSE(p.ok()) << "a window smaller than its region was mapped";
    EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().to_string();
    EXPECT_NE(p.status().message().find(fmt::format("holds {} bytes", kBytes / 4)), std::string::npos)
        << p.status().to_string();
  }
  close(short_window);

  // Only the grow seal missing is refused too.
  const int growable = memfd_of(kBytes, F_SEAL_SHRINK);
  ASSERT_GE(growable, 0);
  {
    FakeIpcOwner owner(growable, kBytes);
    auto p = a->load_peer(owner.blob());
    EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().to_string();
    EXPECT_NE(p.status().message().find("F_SEAL_GROW"), std::string::npos) << p.status().to_string();
  }
  close(growable);

  // A properly sealed window of the claimed size loads (the crafted owner is otherwise well-formed).
  const int sealed = memfd_of(kBytes, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ASSERT_GE(sealed, 0);
  {
    FakeIpcOwner owner(sealed, kBytes);
    auto p = a->load_peer(owner.blob());
    EXPECT_TRUE(p.ok()) << p.status().to_string();
  }
  close(sealed);
}

// A blob (checksum recomputed) that claims a region twice as large as the window its owner shares would let a
// descriptor inside the claimed size copy past the mapped window: refused at load, nothing touched.
TEST(IpcWindows, ABlobClaimingMoreBytesThanItsWindowIsRefusedAtLoad) {
  auto a = create_ipc_transport(ident("a")).value();
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> mb(1 << 16, std::byte{7});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  auto decoded = detail::decode_blob(b->export_metadata().value()).value();
  decoded.regions[0].bytes *= 2;
  auto p = a->load_peer(detail::encode_blob(decoded));
  ASSERT_FALSE(p.ok()) << "a region larger than its window loaded";
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
  EXPECT_NE(p.status().message().find("region 0"), std::string::npos) << p.status().to_string();
  EXPECT_EQ(mb, std::vector<std::byte>(1 << 16, std::byte{7}));
}

// The other direction: the windows this agent hands out are sealed, so a peer holding the descriptor cannot
// shrink it under the owner's own mapping (the owner copies between window and region on every request).
TEST(IpcWindows, WindowsHandedToPeersAreSealedAgainstResizing) {
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> mb(1 << 16, std::byte{7});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  auto decoded = detail::decode_blob(b->export_metadata().value()).value();
  const auto at = decoded.address.find("sock=");
  ASSERT_NE(at, std::string::npos) << decoded.address;
  const int sock = abstract_socket(decoded.address.substr(at + 5), false);
  ASSERT_GE(sock, 0);
  timeval tv{10, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  codec::ByteWriter<std::string> hello;
  hello.u32(kHello);
  hello.str("prober");
  hello.str("");  // its address (incarnation)
  ASSERT_TRUE(send_with_fd(sock, hello.out, -1));
  std::string m;
  int window = -1;
  ASSERT_TRUE(recv_with_fd(sock, m, window));
  ASSERT_GE(window, 0) << "no window descriptor in the first region message";
  const int seals = fcntl(window, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
      << "seals " << seals;
  EXPECT_NE(ftruncate(window, 0), 0) << "a peer could shrink the owner's window";
  struct stat st {};
  ASSERT_EQ(fstat(window, &st), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), mb.size());
  close(window);
  close(sock);
}

// A well-behaved peer (options `o`) loads `blob` and WRITEs 64 KiB into its first region, `owner_memory`:
// it lands byte-exact.
void expect_a_write_lands(const std::vector<std::byte>& blob, const std::vector<std::byte>& owner_memory,
                          const IpcOptions& o) {
  auto a = create_ipc_transport(ident("a"), o).value();
  std::vector<std::byte> ma(owner_memory.size(), std::byte{0x3c});
  RegionId ra = a->register_memory({MemoryKind::kPinnedHost, 0, ma.data(), ma.size()}).value();
  PeerId pb = a->load_peer(blob).value();
  LocalDesc l{ra, 0, ma.size()};
  RemoteDesc r{0, 0, ma.size()};
  auto x = a->post(XferOp::kWrite, pb, {&l, 1}, {&r, 1}, "after");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  auto st = a->wait(*x, 10s);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  EXPECT_EQ(owner_memory, ma);
}

// A request whose range count is far beyond what its message holds used to size an allocation from it (about
// 96 GiB for 2^32 - 1 ranges). The owner drops such a request (and the connection that sent it) and keeps serving.
TEST(IpcWindows, ARequestClaimingMoreRangesThanItHoldsIsDroppedAndTheOwnerKeepsServing) {
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> mb(1 << 16, std::byte{7});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  const auto blob = b->export_metadata().value();
  auto decoded = detail::decode_blob(blob).value();
  const int sock = abstract_socket(decoded.address.substr(decoded.address.find("sock=") + 5), false);
  ASSERT_GE(sock, 0);
  timeval tv{10, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  codec::ByteWriter<std::string> hello;
  hello.u32(kHello);
  hello.str("crafted");
  hello.str("");  // its address (incarnation)
  ASSERT_TRUE(send_with_fd(sock, hello.out, -1));
  std::string m;
  int fd = -1;
  do {
    ASSERT_TRUE(recv_with_fd(sock, m, fd));
    if (fd >= 0) close(fd);
  } while (m.size() < 4 || m[0] != static_cast<char>(kRegionsEnd));
  codec::ByteWriter<std::string> req;
  req.u32(4);  // kWrite
  req.u64(1);
  req.u32(0xffffffffu);  // ranges claimed; none follow
  ASSERT_TRUE(send_with_fd(sock, req.out, -1));
  // The owner ends this connection instead of answering (well before the 10 s receive timeout).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(recv_with_fd(sock, m, fd));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  close(sock);
  // And still serves a well-behaved peer: a WRITE lands byte-exact.
  expect_a_write_lands(blob, mb, {});
}

// The owner's socket is abstract (no file permissions) and its name is in the blob and in /proc/net/unix. It served
// every connector: a hello under any name got every registered region's window (read and write of the pool) and
// the right to send notifications under that name, the peer secret notwithstanding. Under a secret a connector must
// now answer a fresh challenge with it; a raw connector that cannot gets no window.
TEST(IpcHandshake, UnderAPeerSecretAConnectorWithoutItGetsNoWindow) {
  const std::string secret(32, 's');
  IpcOptions o;
  o.peer_secret = secret;
  auto b = create_ipc_transport(ident("b"), o).value();
  std::vector<std::byte> mb(1 << 16, std::byte{7});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  const auto blob = b->export_metadata().value();
  auto decoded = detail::decode_blob(blob, secret).value();
  const std::string sock_name = decoded.address.substr(decoded.address.find("sock=") + 5);
  for (const std::string& proof : {std::string(), std::string(32, 'x')}) {
    const int sock = abstract_socket(sock_name, false);
    ASSERT_GE(sock, 0);
    timeval tv{10, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    codec::ByteWriter<std::string> hello;
    hello.u32(kHello);
    hello.str("intruder");
    hello.str("");
    ASSERT_TRUE(send_with_fd(sock, hello.out, -1));
    std::string m;
    int fd = -1;
    ASSERT_TRUE(recv_with_fd(sock, m, fd)) << "no challenge";
    EXPECT_LT(fd, 0);
    codec::ByteReader first{std::string_view(m)};
    std::uint32_t type = 0;
    ASSERT_TRUE(first.u32(type));
    EXPECT_EQ(type, ipc_wire::kChallenge) << "the owner handed out regions before any proof";
    codec::ByteWriter<std::string> answer;
    answer.u32(ipc_wire::kProof);
    answer.str(proof);
    send_with_fd(sock, answer.out, -1);
    // The owner ends the connection: no region, no window.
    bool got_window = false;
    while (recv_with_fd(sock, m, fd)) {
      if (fd >= 0) {
        got_window = true;
        close(fd);
      }
    }
    EXPECT_FALSE(got_window);
    close(sock);
  }
  // Agents holding the secret still connect and move bytes.
  expect_a_write_lands(blob, mb, o);
}

// A peer that stops reading (paused, stopped in a debugger): the one worker that sends to every peer blocked in
// sendmsg for good once the socket's buffer was full, and disconnect_peer() then waited for that sender's lock
// forever. Sends are bounded (send_timeout: the peer is taken as gone) and the disconnect no longer waits for them.
TEST(IpcBackend, APeerThatStopsReadingBlocksNeitherTheAgentNorItsDisconnect) {
  constexpr std::uint64_t kBytes = 1 << 16;
  const int window = memfd_of(kBytes, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ASSERT_GE(window, 0);
  FakeIpcOwner owner(window, kBytes, /*reads=*/false);
  IpcOptions o;
  o.send_timeout = std::chrono::milliseconds(300);
  auto a = create_ipc_transport(ident("a"), o).value();
  auto peer = a->load_peer(owner.blob());
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  const std::string big(64 << 10, 'n');
  for (int i = 0; i < 512; ++i) (void)a->send_notification(*peer, big);  // 32 MiB: more than any socket buffer holds
  std::this_thread::sleep_for(std::chrono::milliseconds(100));           // the worker is blocked by now
  auto done = std::async(std::launch::async, [&] { return a->disconnect_peer(*peer); });
  ASSERT_EQ(done.wait_for(std::chrono::seconds(5)), std::future_status::ready) << "disconnect_peer() hung";
  (void)done.get();
  // Another peer is served again (its messages were stuck behind the blocked send).
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> mb(kBytes, std::byte{1});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  PeerId pb = a->load_peer(b->export_metadata().value()).value();
  ASSERT_TRUE(a->send_notification(pb, "after").ok());
  auto n = b->wait_notifications(std::chrono::seconds(5));
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  ASSERT_EQ(n->size(), 1u);
  EXPECT_EQ((*n)[0].message, "after");
  IpcOptions bad;
  bad.send_timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(create_ipc_transport(ident("c"), bad).status().code(), StatusCode::kInvalidArgument);
}

// Without a secret the owner serves only processes of its own user: another user's process on the host got every
// window. (Needs root, to connect as another user from a child process.)
TEST(IpcHandshake, WithoutASecretAnotherUsersProcessGetsNoWindow) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to connect as another user";
  auto b = create_ipc_transport(ident("b")).value();
  std::vector<std::byte> mb(1 << 16, std::byte{7});
  ASSERT_TRUE(b->register_memory({MemoryKind::kPinnedHost, 0, mb.data(), mb.size()}).ok());
  auto decoded = detail::decode_blob(b->export_metadata().value()).value();
  const std::string sock_name = decoded.address.substr(decoded.address.find("sock=") + 5);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // 2: could not switch user or connect; 3: served a window; 0: refused.
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    const int sock = abstract_socket(sock_name, false);
    if (sock < 0) _exit(2);
    timeval tv{10, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    codec::ByteWriter<std::string> hello;
    hello.u32(kHello);
    hello.str("other-user");
    hello.str("");
    if (!send_with_fd(sock, hello.out, -1)) _exit(0);
    std::string m;
    int fd = -1;
    while (recv_with_fd(sock, m, fd))
      if (fd >= 0) _exit(3);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: the child could not switch user; 3: it was served a window";
  // A process of the owner's own user is served (IpcWindows' tests above connect the same way).
}

// ---- path selection -------------------------------------------------------------------------------------

PathEndpoint ep(HostIdentity h, MemoryKind kind, bool cuda, int ordinal) {
  return PathEndpoint{h, kind, cuda, ordinal};
}

TEST(IpcSelection, SameHostPicksIpcAndAnyDifferencePicksTheStagedPathWithTheReason) {
  const HostIdentity h{"boot-a", "pid:[7]"};
  const HostIdentity other_boot{"boot-b", "pid:[7]"};
  const HostIdentity other_ns{"boot-a", "pid:[8]"};
  int asked = 0;
  auto access = [&](int from, int to) {
    ++asked;
    return (from == 0 && to == 1) || (from == 1 && to == 0);
  };
  auto host = ep(h, MemoryKind::kPinnedHost, false, 0);

  auto c = choose_transfer_path(host, host, access, true);
  EXPECT_TRUE(c.ipc) << c.reason;
  c = choose_transfer_path(host, ep(other_boot, MemoryKind::kPinnedHost, false, 0), access, true);
  EXPECT_FALSE(c.ipc);
  EXPECT_NE(c.reason.find("boot-b"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("boot-a"), std::string::npos) << c.reason;
  c = choose_transfer_path(host, ep(other_ns, MemoryKind::kPinnedHost, false, 0), access, true);
  EXPECT_FALSE(c.ipc);
  EXPECT_NE(c.reason.find("pid:[8]"), std::string::npos) << c.reason;
  // The host backend's device memory is RAM: ipc.
  c = choose_transfer_path(ep(h, MemoryKind::kDevice, false, 0), host, access, true);
  EXPECT_TRUE(c.ipc) << c.reason;

  // CUDA on both sides: the same ordinal always works and peer access is not asked.
  auto gpu = [&](int o) { return ep(h, MemoryKind::kDevice, true, o); };
  c = choose_transfer_path(gpu(0), gpu(0), access, true);
  EXPECT_TRUE(c.ipc) << c.reason;
  EXPECT_EQ(asked, 0);
  c = choose_transfer_path(gpu(0), gpu(1), access, true);
  EXPECT_TRUE(c.ipc) << c.reason;
  EXPECT_EQ(asked, 1);
  c = choose_transfer_path(gpu(0), gpu(2), access, true);
  EXPECT_FALSE(c.ipc);
  EXPECT_NE(c.reason.find("GPU 0 to GPU 2"), std::string::npos) << c.reason;
  c = choose_transfer_path(gpu(0), gpu(1), nullptr, true);
  EXPECT_FALSE(c.ipc) << c.reason;
  // CUDA on one side only, or a build without the CUDA data path: staged.
  c = choose_transfer_path(gpu(0), host, access, true);
  EXPECT_FALSE(c.ipc);
  EXPECT_NE(c.reason.find("local side only"), std::string::npos) << c.reason;
  c = choose_transfer_path(gpu(0), gpu(0), access, false);
  EXPECT_FALSE(c.ipc);
  EXPECT_NE(c.reason.find("no CUDA data path"), std::string::npos) << c.reason;
  EXPECT_EQ(choose_transfer_path(gpu(0), gpu(0), access).ipc, ipc_cuda_supported());  // this build
}

}  // namespace
}  // namespace kvtier::transport
