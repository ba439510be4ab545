// The ipc backend's own cases: host identity in the blob and the refusals built on it (another host, another pid
// namespace, damaged blobs), the peer going away, and the choice between ipc and the staged path.
#include "kvtier/transport/ipc.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

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
