// One conformance suite for every Transport backend: loopback (the test double), UCX over TCP on 127.0.0.1,
// UCX over shared memory and the same-host ipc backend. Two agents live in this process; each UCX agent has its own
// context and worker. Deterministic fault cases (operations held in flight, failed posts) use the loopback's knobs and
// run only there.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <random>
#include <thread>

#include "kvtier/backend/transport.h"
#include "kvtier/transport/ipc.h"
#include "transport/transport_base.h"

namespace kvtier::transport {
namespace {

using namespace std::chrono_literals;

// kUcxTcp takes TCP's default data path (active messages: UcxDataPath), kUcxTcpRma UCX's emulated RMA over TCP.
enum class Kind { kLoopback, kUcxTcp, kUcxTcpRma, kUcxShm, kIpc };

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::kLoopback: return "loopback";
    case Kind::kUcxTcp: return "ucx_tcp";
    case Kind::kUcxTcpRma: return "ucx_tcp_rma";
    case Kind::kUcxShm: return "ucx_shm";
    case Kind::kIpc: return "ipc";
  }
  return "?";
}

int g_agent_seq = 0;

AgentIdentity ident(std::string base, std::uint64_t fp = 0xabcdef, std::uint32_t tp_size = 1) {
  return AgentIdentity{fmt::format("{}-{}", base, ++g_agent_seq), fp, tp_size, 0};
}

Result<std::unique_ptr<Transport>> make(Kind kind, AgentIdentity id, LoopbackOptions lo = {}) {
  switch (kind) {
    case Kind::kLoopback: return create_loopback_transport(std::move(id), std::move(lo));
    case Kind::kUcxTcp: return create_ucx_transport(std::move(id), UcxOptions{"tcp", "lo", {}});
    case Kind::kUcxTcpRma: {
      UcxOptions o{"tcp", "lo", {}};
      o.data_path = UcxDataPath::kRma;
      return create_ucx_transport(std::move(id), std::move(o));
    }
    case Kind::kUcxShm: return create_ucx_transport(std::move(id), UcxOptions{"shm", "", {}});
    case Kind::kIpc: return create_ipc_transport(std::move(id));
  }
  return Internal("kind");
}

// An agent holding `secret` as its peer secret (UcxOptions / IpcOptions / LoopbackOptions::peer_secret).
Result<std::unique_ptr<Transport>> make_keyed(Kind kind, AgentIdentity id, std::string secret) {
  switch (kind) {
    case Kind::kLoopback: {
      LoopbackOptions o;
      o.peer_secret = std::move(secret);
      return create_loopback_transport(std::move(id), std::move(o));
    }
    case Kind::kUcxTcp:
    case Kind::kUcxTcpRma:
    case Kind::kUcxShm: {
      const bool tcp = kind != Kind::kUcxShm;
      UcxOptions o{tcp ? "tcp" : "shm", tcp ? "lo" : "", std::move(secret)};
      if (kind == Kind::kUcxTcpRma) o.data_path = UcxDataPath::kRma;
      return create_ucx_transport(std::move(id), std::move(o));
    }
    case Kind::kIpc: {
      IpcOptions o;
      o.peer_secret = std::move(secret);
      return create_ipc_transport(std::move(id), std::move(o));
    }
  }
  return Internal("kind");
}

std::vector<std::byte> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Two connected agents, a (initiator) and b, each with one region of `bytes`.
struct Pair {
  // Memory first: it must outlive the transports that have it registered (destruction runs in reverse).
  std::vector<std::byte> mem_a, mem_b;
  std::unique_ptr<Transport> a, b;
  RegionId ra = 0, rb = 0;
  PeerId a_sees_b = 0, b_sees_a = 0;
};

void connect(Kind kind, Pair& p, std::size_t bytes, LoopbackOptions lo = {}) {
  auto a = make(kind, ident("a"), lo);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = make(kind, ident("b"));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  p.a = std::move(a).value();
  p.b = std::move(b).value();
  p.mem_a = random_bytes(bytes, 1);
  p.mem_b.assign(bytes, std::byte{0x5a});
  auto ra = p.a->register_memory({MemoryKind::kPinnedHost, 0, p.mem_a.data(), bytes});
  auto rb = p.b->register_memory({MemoryKind::kPinnedHost, 0, p.mem_b.data(), bytes});
  ASSERT_TRUE(ra.ok() && rb.ok());
  p.ra = *ra;
  p.rb = *rb;
  auto blob_a = p.a->export_metadata();
  auto blob_b = p.b->export_metadata();
  ASSERT_TRUE(blob_a.ok() && blob_b.ok());
  auto pb = p.a->load_peer(*blob_b);
  ASSERT_TRUE(pb.ok()) << pb.status().to_string();
  auto pa = p.b->load_peer(*blob_a);
  ASSERT_TRUE(pa.ok()) << pa.status().to_string();
  p.a_sees_b = *pb;
  p.b_sees_a = *pa;
}

// Waits until `t` has received a notification with `message` (others are kept in `seen`).
Result<Notification> await_notification(Transport& t, const std::string& message, std::vector<Notification>& seen,
                                        std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    for (auto it = seen.begin(); it != seen.end(); ++it)
      if (it->message == message) {
        Notification n = *it;
        seen.erase(it);
        return n;
      }
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= 0s) return TimedOut("no notification " + message);
    auto got = t.wait_notifications(left);
    if (!got.ok()) return got.status();
    for (auto& n : *got) seen.push_back(std::move(n));
  }
}

Status await_quiescent(Transport& t, XferId x, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto st = t.poll(x);
    if (!st.ok()) return st.status();
    if (st->quiescent) return Status::Ok();
    std::this_thread::sleep_for(1ms);
  }
  return TimedOut("not quiescent");
}

class TransportConformance : public ::testing::TestWithParam<Kind> {};

TEST_P(TransportConformance, WriteLandsBeforeItsNotification) {
  Pair p;
  connect(GetParam(), p, 1 << 20);
  // Pairs of several sizes at scattered offsets, including a 1-byte one and a 256 KiB one.
  std::vector<LocalDesc> l = {{p.ra, 0, 4096}, {p.ra, 100000, 1}, {p.ra, 300000, 262144}, {p.ra, 4096, 777}};
  std::vector<RemoteDesc> r = {{0, 500000, 4096}, {0, 7, 1}, {0, 600000, 262144}, {0, 8192, 777}};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "w1");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  std::vector<Notification> seen;
  auto n = await_notification(*p.b, "w1", seen);
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(n->kind, NotifKind::kMessage);
  EXPECT_EQ(n->peer, p.a->identity().name);
  // Checked at the notification's arrival: the bytes must already be there.
  std::vector<std::byte> model(p.mem_b.size(), std::byte{0x5a});
  for (std::size_t i = 0; i < l.size(); ++i) std::memcpy(&model[r[i].offset], &p.mem_a[l[i].offset], l[i].bytes);
  EXPECT_TRUE(model == p.mem_b);
  auto st = p.a->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kDone) << st->error.to_string();
  ASSERT_TRUE(await_quiescent(*p.a, *x).ok());
  EXPECT_TRUE(p.a->release(*x).ok());
  EXPECT_EQ(p.a->poll(*x).status().code(), StatusCode::kNotFound);
}

TEST_P(TransportConformance, ReadIsByteExactAndNotifiesTheSource) {
  Pair p;
  connect(GetParam(), p, 1 << 20);
  // b reads from a: b's local is its own region, the remote is a's region 0.
  std::vector<LocalDesc> l = {{p.rb, 0, 65536}, {p.rb, 200000, 3}, {p.rb, 400000, 131072}};
  std::vector<RemoteDesc> r = {{0, 1000, 65536}, {0, 999999, 3}, {0, 0, 131072}};
  auto x = p.b->post(XferOp::kRead, p.b_sees_a, l, r, "r1");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  auto st = p.b->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  std::vector<std::byte> model(p.mem_b.size(), std::byte{0x5a});
  for (std::size_t i = 0; i < l.size(); ++i) std::memcpy(&model[l[i].offset], &p.mem_a[r[i].offset], l[i].bytes);
  EXPECT_TRUE(model == p.mem_b);
  std::vector<Notification> seen;
  auto n = await_notification(*p.a, "r1", seen);
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(n->peer, p.b->identity().name);
}

TEST_P(TransportConformance, ManyTransfersEachNotifyOnceAndBareMessagesKeepTheirOrder) {
  Pair p;
  connect(GetParam(), p, 1 << 20);
  std::vector<XferId> xs;
  for (int i = 0; i < 32; ++i) {
    LocalDesc l{p.ra, static_cast<std::uint64_t>(i) * 16384, 16384};
    RemoteDesc r{0, static_cast<std::uint64_t>(31 - i) * 16384, 16384};
    auto x = p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, fmt::format("t{}", i));
    ASSERT_TRUE(x.ok());
    xs.push_back(*x);
  }
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(p.a->send_notification(p.a_sees_b, fmt::format("m{}", i)).ok());
  std::vector<Notification> seen;
  for (int i = 0; i < 32; ++i) ASSERT_TRUE(await_notification(*p.b, fmt::format("t{}", i), seen).ok()) << i;
  std::vector<std::string> bare;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (bare.size() < 8 && std::chrono::steady_clock::now() < deadline) {
    for (auto& n : seen)
      if (n.message[0] == 'm') bare.push_back(n.message);
    seen.clear();
    if (bare.size() < 8) {
      auto got = p.b->wait_notifications(100ms);
      if (got.ok()) seen = *got;
    }
  }
  ASSERT_EQ(bare.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bare[i], fmt::format("m{}", i));
  for (XferId x : xs) {
    auto st = p.a->wait(x, 10s);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->state, XferState::kDone);
  }
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(0, std::memcmp(&p.mem_b[static_cast<std::size_t>(31 - i) * 16384],
                             &p.mem_a[static_cast<std::size_t>(i) * 16384], 16384));
  // No transfer notified twice.
  EXPECT_TRUE(p.b->take_notifications().empty());
}

TEST_P(TransportConformance, BadDescriptorListsAreRefusedBeforeAnythingIsPosted) {
  Pair p;
  connect(GetParam(), p, 65536);
  const auto before = p.mem_b;
  auto expect = [&](std::vector<LocalDesc> l, std::vector<RemoteDesc> r, StatusCode code, std::string_view words) {
    auto x = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "bad");
    ASSERT_FALSE(x.ok());
    EXPECT_EQ(x.status().code(), code) << x.status().to_string();
    EXPECT_NE(x.status().message().find(words), std::string::npos) << x.status().to_string();
  };
  // Unequal lengths; the good pairs before the bad one must not be posted either.
  expect({{p.ra, 0, 8}, {p.ra, 8, 8}}, {{0, 0, 8}}, StatusCode::kInvalidArgument, "2 entries, remote list 1");
  expect({{p.ra, 0, 8}, {p.ra, 65530, 8}}, {{0, 0, 8}, {0, 8, 8}}, StatusCode::kOutOfRange, "descriptor 1: local");
  expect({{p.ra, 0, 8}, {p.ra, 8, 8}}, {{0, 0, 8}, {0, 65536, 8}}, StatusCode::kOutOfRange, "descriptor 1: remote");
  expect({{p.ra, 0, 8}}, {{1, 0, 8}}, StatusCode::kOutOfRange, "remote region 1");
  expect({{p.ra + 7, 0, 8}}, {{0, 0, 8}}, StatusCode::kNotFound, "local region");
  expect({{p.ra, 0, 8}}, {{0, 0, 9}}, StatusCode::kInvalidArgument, "local 8 bytes != remote 9");
  expect({}, {}, StatusCode::kInvalidArgument, "empty");
  expect({{p.ra, ~0ull - 3, 8}}, {{0, 0, 8}}, StatusCode::kOutOfRange, "local");
  EXPECT_EQ(p.a->post(XferOp::kWrite, 9, {}, {}, "x").status().code(), StatusCode::kNotFound);
  // Nothing landed and no notification came.
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(p.mem_b == before);
  EXPECT_TRUE(p.b->take_notifications().empty());
}

// A name every peer would refuse in the blob (empty, too long, not printable ASCII) is refused at creation.
TEST_P(TransportConformance, AgentNamesPeersWouldRefuseAreRefusedAtCreationNamingThem) {
  for (const std::string& bad :
       {std::string(), std::string(300, 'x'), std::string("a\nb"), std::string("na\xc3\xafve")}) {
    AgentIdentity id = ident("unused");
    id.name = bad;
    auto t = make(GetParam(), id);
    ASSERT_FALSE(t.ok()) << "accepted agent name of " << bad.size() << " bytes";
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(fmt::format("({} bytes)", bad.size())), std::string::npos)
        << t.status().to_string();
  }
  EXPECT_NE(make(GetParam(), ident("a\tb")).status().message().find("a\\x09b"), std::string::npos);
  AgentIdentity longest = ident("longest");
  longest.name.resize(256, 'y');
  auto fine = make(GetParam(), longest);
  EXPECT_TRUE(fine.ok()) << fine.status().to_string();
}

TEST_P(TransportConformance, PeerBlobsOfAnotherLayoutTpSizeOrVersionAreRefusedNamingBothValues) {
  auto a = make(GetParam(), ident("a", 0x1111, 2));
  auto other_fp = make(GetParam(), ident("fp", 0x2222, 2));
  auto other_tp = make(GetParam(), ident("tp", 0x1111, 4));
  ASSERT_TRUE(a.ok() && other_fp.ok() && other_tp.ok());
  auto s = (*a)->load_peer(*(*other_fp)->export_metadata());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("0x0000000000002222"), std::string::npos) << s.status().to_string();
  EXPECT_NE(s.status().message().find("0x0000000000001111"), std::string::npos) << s.status().to_string();
  s = (*a)->load_peer(*(*other_tp)->export_metadata());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("size 4 != local"), std::string::npos) << s.status().to_string();
  EXPECT_NE(s.status().message().find("size 2"), std::string::npos);

  auto good = make(GetParam(), ident("good", 0x1111, 2));
  ASSERT_TRUE(good.ok());
  auto blob = (*good)->export_metadata();
  ASSERT_TRUE(blob.ok());
  auto decoded = detail::decode_blob(*blob);
  ASSERT_TRUE(decoded.ok());
  detail::Blob v2 = *decoded;
  v2.version = kTransportVersion + 1;
  s = (*a)->load_peer(detail::encode_blob(v2));
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find(
                fmt::format("version {} != local version {}", kTransportVersion + 1, kTransportVersion)),
            std::string::npos)
      << s.status().to_string();
  detail::Blob other_backend = *decoded;
  other_backend.backend = "carrier-pigeon";
  s = (*a)->load_peer(detail::encode_blob(other_backend));
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("carrier-pigeon"), std::string::npos);
  auto damaged = *blob;
  damaged[damaged.size() / 2] ^= std::byte{1};
  EXPECT_EQ((*a)->load_peer(damaged).status().code(), StatusCode::kDataLoss);
  std::vector<std::byte> junk(64, std::byte{7});
  EXPECT_EQ((*a)->load_peer(junk).status().code(), StatusCode::kInvalidArgument);
  // The refusals connected nothing; the good blob still loads, once.
  auto ok = (*a)->load_peer(*blob);
  EXPECT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ((*a)->load_peer(*blob).status().code(), StatusCode::kAlreadyExists);
  auto info = (*a)->peer_info(*ok);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->identity.tp_size, 2u);
  EXPECT_EQ(info->backend, (*a)->backend_name());
}

TEST_P(TransportConformance, RegionsMustNotOverlapAndDeregisterAfterQuiescence) {
  Pair p;
  connect(GetParam(), p, 65536);
  EXPECT_EQ(p.a->register_memory({MemoryKind::kPinnedHost, 0, p.mem_a.data() + 100, 10}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(p.a->register_memory({MemoryKind::kPinnedHost, 0, nullptr, 10}).status().code(),
            StatusCode::kInvalidArgument);
  LocalDesc l{p.ra, 0, 65536};
  RemoteDesc r{0, 0, 65536};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, "q");
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(p.a->wait(*x, 10s).ok());
  ASSERT_TRUE(await_quiescent(*p.a, *x).ok());
  EXPECT_TRUE(p.a->deregister_memory(p.ra).ok());
  EXPECT_EQ(p.a->deregister_memory(p.ra).code(), StatusCode::kNotFound);
  auto again = p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, "q2");
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound);
}

// ---- peer metadata is untrusted input ---------------------------------------------------------------------

// With a peer secret, a blob loads only when its keyed MAC verifies under the same secret: a peer without the
// secret, with another one, or a blob changed on the way (checksum recomputed) is refused before any field of it
// is used, and nothing is connected.
TEST_P(TransportConformance, WithAPeerSecretOnlyBlobsMacedUnderTheSameSecretLoad) {
  const std::string secret(32, 'k'), other(48, 'o');
  auto a = make_keyed(GetParam(), ident("a"), secret);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = make_keyed(GetParam(), ident("b"), secret);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  // A secret of the wrong length is refused at creation.
  auto short_secret = make_keyed(GetParam(), ident("s"), std::string(10, 'x'));
  EXPECT_EQ(short_secret.status().code(), StatusCode::kInvalidArgument) << short_secret.status().to_string();
  auto long_secret = make_keyed(GetParam(), ident("s"), std::string(65, 'x'));
  EXPECT_EQ(long_secret.status().code(), StatusCode::kInvalidArgument) << long_secret.status().to_string();

  std::vector<std::byte> mem_a = random_bytes(65536, 7), mem_b(65536, std::byte{0x5a});
  RegionId ra = (*a)->register_memory({MemoryKind::kPinnedHost, 0, mem_a.data(), mem_a.size()}).value();
  ASSERT_TRUE((*b)->register_memory({MemoryKind::kPinnedHost, 0, mem_b.data(), mem_b.size()}).ok());
  const auto blob_b = (*b)->export_metadata().value();
  const auto expect_refused = [&](Transport& t, const std::vector<std::byte>& blob, std::string_view words) {
    auto p = t.load_peer(blob);
    ASSERT_FALSE(p.ok()) << "loaded: " << words;
    EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().to_string();
    EXPECT_NE(p.status().message().find(words), std::string::npos) << p.status().to_string();
  };

  // Another secret.
  auto c = make_keyed(GetParam(), ident("c"), other);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  expect_refused(**c, blob_b, "authentication failed");
  expect_refused(**a, (*c)->export_metadata().value(), "authentication failed");
  // No secret on either side of a keyed agent.
  auto u = make(GetParam(), ident("u"));
  ASSERT_TRUE(u.ok());
  expect_refused(**a, (*u)->export_metadata().value(), "no MAC");
  expect_refused(**u, blob_b, "peer_secret");
  // A keyed blob changed on the way, its xxh3 recomputed (layout: fields, u64 xxh3, 32-byte MAC): a region's
  // size doubled would let this agent write past the peer's region.
  auto tampered = blob_b;
  tampered[20] ^= std::byte{1};
  if (tampered.size() > 40) {
    const std::uint64_t ck = XXH3_64bits(tampered.data(), tampered.size() - 40);
    std::memcpy(tampered.data() + tampered.size() - 40, &ck, 8);
  }
  expect_refused(**a, tampered, "authentication failed");
  // Truncated to less than a MAC.
  expect_refused(**a, std::vector<std::byte>(blob_b.begin(), blob_b.begin() + 24), "");

  // The same secret on both sides: loads, and a transfer lands byte-exact.
  auto pb = (*a)->load_peer(blob_b);
  ASSERT_TRUE(pb.ok()) << pb.status().to_string();
  ASSERT_TRUE((*b)->load_peer((*a)->export_metadata().value()).ok());
  LocalDesc l{ra, 0, 65536};
  RemoteDesc r{0, 0, 65536};
  auto x = (*a)->post(XferOp::kWrite, *pb, {&l, 1}, {&r, 1}, "keyed");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  auto st = (*a)->wait(*x, 10s);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  // Read on b's side once b has the notification: the bytes landed before it (the transport's contract), and
  // the notification orders b's writer thread before this read.
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(**b, "keyed", seen).ok());
  EXPECT_EQ(mem_b, mem_a);
}

// Without a secret a blob with a valid checksum can still be crafted: every field is bounded and checked at
// load, before the backend (UCX, the ipc handshake) sees any of it.
TEST_P(TransportConformance, CraftedRegionFieldsAreRefusedAtLoadEvenWithAValidChecksum) {
  auto a = make(GetParam(), ident("a"));
  auto good = make(GetParam(), ident("good"));
  ASSERT_TRUE(a.ok() && good.ok());
  std::vector<std::byte> mem(65536, std::byte{3});
  ASSERT_TRUE((*good)->register_memory({MemoryKind::kPinnedHost, 0, mem.data(), mem.size()}).ok());
  const auto blob = (*good)->export_metadata().value();
  const detail::Blob decoded = detail::decode_blob(blob).value();
  ASSERT_EQ(decoded.regions.size(), 1u);
  const auto expect_refused = [&](detail::Blob b, std::string_view words) {
    auto p = (*a)->load_peer(detail::encode_blob(b));
    ASSERT_FALSE(p.ok()) << "loaded a blob with " << words;
    EXPECT_TRUE(p.status().code() == StatusCode::kInvalidArgument || p.status().code() == StatusCode::kOutOfRange)
        << p.status().to_string();
    EXPECT_NE(p.status().message().find(words), std::string::npos) << p.status().to_string();
  };
  detail::Blob b = decoded;
  b.regions[0].base = ~std::uint64_t{0} - 100;  // base + bytes wraps around the address space
  expect_refused(b, "wraps");
  b = decoded;
  b.regions[0].base = 0;
  expect_refused(b, "base 0");
  b = decoded;
  b.regions[0].bytes = 0;
  b.regions[0].key = "not-empty";  // a deregistered slot has zero bytes and no key
  expect_refused(b, "0 bytes");
  b = decoded;
  b.regions[0].key.assign(70000, 'k');
  expect_refused(b, "key of 70000 bytes");
  b = decoded;
  b.regions.push_back(b.regions[0]);  // two regions over the same bytes
  expect_refused(b, "overlaps");
  b = decoded;
  b.address.clear();
  expect_refused(b, "address");
  b = decoded;
  b.identity.name.clear();
  expect_refused(b, "name");
  b = decoded;
  b.identity.name = "evil\n\x1b[2J";
  expect_refused(b, "name");
  // Nothing was connected by the refusals: the intact blob loads, and a descriptor past its region's end is
  // refused before anything is posted.
  auto p = (*a)->load_peer(blob);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  std::vector<std::byte> src(65536, std::byte{9});
  RegionId ra = (*a)->register_memory({MemoryKind::kPinnedHost, 0, src.data(), src.size()}).value();
  LocalDesc l{ra, 0, 16};
  RemoteDesc r{0, 65536 - 8, 16};
  auto x = (*a)->post(XferOp::kWrite, *p, {&l, 1}, {&r, 1}, "past");
  EXPECT_EQ(x.status().code(), StatusCode::kOutOfRange) << x.status().to_string();
  // Connected both ways and a write of the bytes already there completed before both agents go: with a one-way
  // connection still in its wireup at teardown UCX aborted on an assertion now and then (1 run in 152 of this
  // test on tcp).
  ASSERT_TRUE((*good)->load_peer((*a)->export_metadata().value()).ok());
  std::fill(src.begin(), src.begin() + 16, std::byte{3});
  RemoteDesc inside{0, 0, 16};
  auto y = (*a)->post(XferOp::kWrite, *p, {&l, 1}, {&inside, 1}, "inside");
  ASSERT_TRUE(y.ok()) << y.status().to_string();
  auto st = (*a)->wait(*y, 10s);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_EQ(st->state, XferState::kDone) << st->error.to_string();
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(**good, "inside", seen).ok());
  EXPECT_EQ(mem, std::vector<std::byte>(65536, std::byte{3}));
}

// The UCX backend hands the key to ucp_ep_rkey_unpack, which takes no length: a key cut short made it read past
// the blob. Keys shorter than any UCX packs are refused, and UCX's own refusal is an error, not a crash.
TEST(UcxBlob, ShortOrGarbageRemoteKeysAreRefusedBeforeOrByUcx) {
  for (const char* tls : {"tcp", "shm"}) {
    SCOPED_TRACE(tls);
    UcxOptions o{tls, std::string(tls) == "tcp" ? "lo" : "", {}};
    o.data_path = UcxDataPath::kRma;  // UCX keys in the blob (TCP's default path sends tokens instead)
    auto a = create_ucx_transport(ident("a"), o);
    auto good = create_ucx_transport(ident("good"), o);
    ASSERT_TRUE(a.ok() && good.ok());
    std::vector<std::byte> mem(65536);
    ASSERT_TRUE((*good)->register_memory({MemoryKind::kPinnedHost, 0, mem.data(), mem.size()}).ok());
    const detail::Blob decoded = detail::decode_blob((*good)->export_metadata().value()).value();
    ASSERT_GE(decoded.regions[0].key.size(), 9u);
    for (std::size_t n = 1; n <= 9 && n < decoded.regions[0].key.size(); ++n) {
      detail::Blob b = decoded;
      b.regions[0].key.resize(n);
      auto p = (*a)->load_peer(detail::encode_blob(b));
      ASSERT_FALSE(p.ok()) << "a " << n << "-byte key loaded";
      EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
      EXPECT_NE(p.status().message().find(fmt::format("key of {} bytes", n)), std::string::npos)
          << p.status().to_string();
    }
    // A key whose domain claims more bytes than the key holds (where the lane's key has a domain).
    detail::Blob b = decoded;
    Result<PeerId> p = NotFound("");
    if (b.regions[0].key.size() >= 10) {
      b.regions[0].key[9] = static_cast<char>(0xff);
      p = (*a)->load_peer(detail::encode_blob(b));
      EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
      EXPECT_NE(p.status().message().find("past its end"), std::string::npos) << p.status().to_string();
    }
    // A short worker address is refused before ucp_ep_create reads it.
    b = decoded;
    b.address.resize(4);
    p = (*a)->load_peer(detail::encode_blob(b));
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().to_string();
    // Nothing was connected by the refusals. (The intact blob's loading is covered by the suite; connecting one
    // way only and tearing both agents down at once here tripped a UCX wireup assertion now and then.)
    EXPECT_TRUE(detail::decode_blob(detail::encode_blob(decoded)).ok());
  }
}

// allocate_shared: memory the owner uses in place and a peer maps directly. What the peer writes through its mapping
// is in the owner's memory, a transfer into it lands there like into any region, and a later blob carries it;
// backends that cannot share say so. Zero bytes is refused.
TEST_P(TransportConformance, SharedMemoryIsTheSameBytesOnBothSidesOrNotSupported) {
  std::vector<std::byte> mem_b = random_bytes(1 << 16, 3);  // outlives the transport it is registered with
  auto a = make(GetParam(), ident("a"));
  auto b = make(GetParam(), ident("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->allocate_shared(0).status().code(), StatusCode::kInvalidArgument);
  auto shared = (*a)->allocate_shared(1 << 20);
  if (GetParam() == Kind::kUcxTcp || GetParam() == Kind::kUcxTcpRma || GetParam() == Kind::kUcxShm) {
    EXPECT_EQ(shared.status().code(), StatusCode::kNotSupported) << shared.status().to_string();
    return;
  }
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  ASSERT_NE(shared->data, nullptr);
  EXPECT_EQ(shared->bytes, std::uint64_t{1} << 20);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(shared->data) % 4096, 0u);
  EXPECT_EQ(shared->data[12345], std::byte{0});  // zeroed
  auto rb = (*b)->register_memory({MemoryKind::kPinnedHost, 0, mem_b.data(), mem_b.size()});
  ASSERT_TRUE(rb.ok());
  auto b_sees_a = (*b)->load_peer((*a)->export_metadata().value());
  ASSERT_TRUE(b_sees_a.ok()) << b_sees_a.status().to_string();
  ASSERT_TRUE((*a)->load_peer((*b)->export_metadata().value()).ok());
  // The peer's direct mapping: its stores are the owner's bytes, and the owner's are its.
  auto mapped = (*b)->peer_region_address(*b_sees_a, shared->region);
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  auto* view = static_cast<std::byte*>(*mapped);
  view[777] = std::byte{0x42};
  EXPECT_EQ(shared->data[777], std::byte{0x42});
  shared->data[4242] = std::byte{0x17};
  EXPECT_EQ(view[4242], std::byte{0x17});
  // A transfer into it lands in the owner's memory.
  std::vector<LocalDesc> l = {{*rb, 0, 1 << 16}};
  std::vector<RemoteDesc> r = {{shared->region, 65536, 1 << 16}};
  auto x = (*b)->post(XferOp::kWrite, *b_sees_a, l, r, "into-shared");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(**a, "into-shared", seen).ok());
  EXPECT_EQ(std::memcmp(shared->data + 65536, mem_b.data(), mem_b.size()), 0);
  ASSERT_TRUE(await_quiescent(**b, *x).ok());
  EXPECT_TRUE((*b)->release(*x).ok());
}

// allocate_host: zeroed, page-aligned memory that regions anywhere inside it use like any memory (several per
// allocation, beside regions of caller memory). Lists with contiguous runs (which backends join) and gaps move
// byte-exact both ways, and bytes outside the descriptors stay as they were.
TEST_P(TransportConformance, HostAllocationHoldsRegionsThatMoveBytesBothWays) {
  std::vector<std::byte> caller_b = random_bytes(1 << 16, 9);  // outlives the transports
  auto a = make(GetParam(), ident("a"));
  auto b = make(GetParam(), ident("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->allocate_host(0).status().code(), StatusCode::kInvalidArgument);
  constexpr std::uint64_t kBytes = 1 << 20, kQ = kBytes / 4;
  auto ha = (*a)->allocate_host(kBytes);
  auto hb = (*b)->allocate_host(kBytes);
  ASSERT_TRUE(ha.ok() && hb.ok()) << ha.status().to_string() << " " << hb.status().to_string();
  ASSERT_EQ(ha->size(), kBytes);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ha->data()) % 4096, 0u);
  EXPECT_TRUE(std::all_of(ha->begin(), ha->end(), [](std::byte x) { return x == std::byte{0}; }));
  const std::vector<std::byte> src = random_bytes(kBytes, 5), poison(kBytes, std::byte{0xEE});
  std::memcpy(ha->data(), src.data(), kBytes);
  std::memcpy(hb->data(), poison.data(), kBytes);
  // a: two regions inside its allocation with a gap between them; b: one inside, one of caller memory.
  auto a0 = (*a)->register_memory({MemoryKind::kPinnedHost, 0, ha->data(), kQ});
  auto a1 = (*a)->register_memory({MemoryKind::kPinnedHost, 0, ha->data() + 2 * kQ, kQ});
  auto b0 = (*b)->register_memory({MemoryKind::kPinnedHost, 0, hb->data() + kQ, 2 * kQ});
  auto b1 = (*b)->register_memory({MemoryKind::kPinnedHost, 0, caller_b.data(), caller_b.size()});
  ASSERT_TRUE(a0.ok() && a1.ok() && b0.ok() && b1.ok());
  auto a_sees_b = (*a)->load_peer((*b)->export_metadata().value());
  auto b_sees_a = (*b)->load_peer((*a)->export_metadata().value());
  ASSERT_TRUE(a_sees_b.ok() && b_sees_a.ok()) << a_sees_b.status().to_string();
  // WRITE: a run of three contiguous 4 KiB pieces, a gap, one more; then one from a1 into b's caller memory.
  std::vector<LocalDesc> l = {
      {*a0, 0, 4096}, {*a0, 4096, 4096}, {*a0, 8192, 4096}, {*a0, 20000, 3000}, {*a1, 100, 5000}};
  std::vector<RemoteDesc> r = {{0, 0, 4096}, {0, 4096, 4096}, {0, 8192, 4096}, {0, 30000, 3000}, {1, 7, 5000}};
  auto x = (*a)->post(XferOp::kWrite, *a_sees_b, l, r, "host-write");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(**b, "host-write", seen).ok());
  std::byte* b0p = hb->data() + kQ;
  EXPECT_EQ(std::memcmp(b0p, src.data(), 12288), 0);
  EXPECT_EQ(std::memcmp(b0p + 30000, src.data() + 20000, 3000), 0);
  EXPECT_EQ(std::memcmp(caller_b.data() + 7, src.data() + 2 * kQ + 100, 5000), 0);
  EXPECT_EQ(std::memcmp(b0p + 12288, poison.data(), 30000 - 12288), 0);  // the gap
  EXPECT_EQ(std::memcmp(hb->data(), poison.data(), kQ), 0);              // outside b's region
  ASSERT_TRUE(await_quiescent(**a, *x).ok());
  EXPECT_TRUE((*a)->release(*x).ok());
  // READ back into a's second region, contiguous runs again, and the bytes land where asked.
  std::fill(ha->data() + 2 * kQ, ha->data() + 3 * kQ, std::byte{0x11});
  l = {{*a1, 0, 8192}, {*a1, 8192, 8192}};
  r = {{0, 0, 8192}, {0, 8192, 8192}};
  x = (*a)->post(XferOp::kRead, *a_sees_b, l, r, "host-read");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  ASSERT_TRUE(await_quiescent(**a, *x).ok());
  auto st = (*a)->poll(*x);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kDone) << st->error.to_string();
  EXPECT_EQ(std::memcmp(ha->data() + 2 * kQ, b0p, 16384), 0);
  EXPECT_EQ(ha->data()[2 * kQ + 16384], std::byte{0x11});
  EXPECT_TRUE((*a)->release(*x).ok());
}

// peer_region_address on memory from allocate_host: where the backend maps it into the peer (UCX's shared-memory
// transports through ucp_rkey_ptr; loopback, one process) the peer's loads and stores are the owner's bytes, at the
// region's offset; elsewhere (UCX over TCP) kNotSupported. A region of the caller's own memory is not mapped by UCX.
TEST_P(TransportConformance, PeerRegionAddressOfHostAllocationsIsTheOwnersBytesOrNotSupported) {
  std::vector<std::byte> caller_a = random_bytes(1 << 16, 4);  // outlives the transport
  auto a = make(GetParam(), ident("a"));
  auto b = make(GetParam(), ident("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr std::uint64_t kBytes = 1 << 20;
  auto ha = (*a)->allocate_host(kBytes);
  ASSERT_TRUE(ha.ok()) << ha.status().to_string();
  auto r0 = (*a)->register_memory({MemoryKind::kPinnedHost, 0, ha->data() + 8192, kBytes / 2});
  auto r1 = (*a)->register_memory({MemoryKind::kPinnedHost, 0, caller_a.data(), caller_a.size()});
  ASSERT_TRUE(r0.ok() && r1.ok());
  auto b_sees_a = (*b)->load_peer((*a)->export_metadata().value());
  ASSERT_TRUE(b_sees_a.ok()) << b_sees_a.status().to_string();
  auto a_sees_b = (*a)->load_peer((*b)->export_metadata().value());
  ASSERT_TRUE(a_sees_b.ok()) << a_sees_b.status().to_string();
  // A message each way first: UCX's TCP wireup must finish before either side is destroyed (Debian's UCX asserts in
  // its wireup when the peer goes away mid-connection).
  std::vector<Notification> seen;
  ASSERT_TRUE((*b)->send_notification(*b_sees_a, "hello-a").ok());
  ASSERT_TRUE(await_notification(**a, "hello-a", seen).ok());
  ASSERT_TRUE((*a)->send_notification(*a_sees_b, "hello-b").ok());
  ASSERT_TRUE(await_notification(**b, "hello-b", seen).ok());
  EXPECT_EQ((*b)->peer_region_address(*b_sees_a, 7).status().code(), StatusCode::kNotFound);
  auto mapped = (*b)->peer_region_address(*b_sees_a, *r0);
  if (GetParam() == Kind::kUcxTcp || GetParam() == Kind::kUcxTcpRma || GetParam() == Kind::kIpc) {
    EXPECT_EQ(mapped.status().code(), StatusCode::kNotSupported) << mapped.status().to_string();
    return;
  }
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  auto* view = static_cast<std::byte*>(*mapped);
  view[100] = std::byte{0x5A};
  EXPECT_EQ(ha->data()[8192 + 100], std::byte{0x5A});
  ha->data()[8192 + 4000] = std::byte{0xA5};
  EXPECT_EQ(view[4000], std::byte{0xA5});
  if (GetParam() == Kind::kUcxShm) {
    EXPECT_EQ((*b)->peer_region_address(*b_sees_a, *r1).status().code(), StatusCode::kNotSupported);
  }
}

// wake_notification_waiter ends a blocked wait at once with nothing (not kTimedOut); a wake with nobody waiting
// ends the next wait; it is used up by that wait (the one after it waits again); queued notifications still come.
TEST_P(TransportConformance, AWakeEndsTheNotificationWaitAtOnceAndOnlyOnce) {
  Pair p;
  connect(GetParam(), p, 4096);
  auto blocked = std::async(std::launch::async, [&] { return p.b->wait_notifications(60s); });
  EXPECT_EQ(blocked.wait_for(50ms), std::future_status::timeout) << "returned before anything happened";
  p.b->wake_notification_waiter();
  ASSERT_EQ(blocked.wait_for(10s), std::future_status::ready) << "the wake did not end the wait";
  auto got = blocked.get();
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_TRUE(got->empty());
  auto again = p.b->wait_notifications(30ms);
  EXPECT_EQ(again.status().code(), StatusCode::kTimedOut) << "the wake was not used up";
  p.b->wake_notification_waiter();  // nobody waits: the next wait returns at once
  const auto t0 = std::chrono::steady_clock::now();
  auto early = p.b->wait_notifications(60s);
  ASSERT_TRUE(early.ok()) << early.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  ASSERT_TRUE(p.a->send_notification(p.a_sees_b, "after-wake").ok());
  std::vector<Notification> seen;
  EXPECT_TRUE(await_notification(*p.b, "after-wake", seen).ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportConformance,
                         ::testing::Values(Kind::kLoopback, Kind::kUcxTcp, Kind::kUcxTcpRma, Kind::kUcxShm, Kind::kIpc),
                         [](const auto& info) { return kind_name(info.param); });

// ---- deterministic fault cases on the loopback -------------------------------------------------------------

TEST(LoopbackFaults, TransferInFlightHoldsItsRegionAndTimesOutAsUnknown) {
  Pair p;
  connect(Kind::kLoopback, p, 65536, LoopbackOptions{50ms, {}, {}});
  std::vector<LocalDesc> l = {{p.ra, 0, 8}, {p.ra, 8, 8}, {p.ra, 16, 8}};
  std::vector<RemoteDesc> r = {{0, 0, 8}, {0, 8, 8}, {0, 16, 8}};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "slow");
  ASSERT_TRUE(x.ok());
  auto st = p.a->wait(*x, 1ms);
  EXPECT_EQ(st.status().code(), StatusCode::kTimedOut);
  EXPECT_EQ(p.a->deregister_memory(p.ra).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.a->release(*x).code(), StatusCode::kFailedPrecondition);
  st = p.a->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kDone);
  ASSERT_TRUE(await_quiescent(*p.a, *x).ok());
  EXPECT_TRUE(p.a->release(*x).ok());
  EXPECT_TRUE(p.a->deregister_memory(p.ra).ok());
}

TEST(LoopbackFaults, AbortFailsTheTransferSendsAbortedAndIsQuiescentOnlyWhenTheBackendLetsGo) {
  Pair p;
  connect(Kind::kLoopback, p, 65536, LoopbackOptions{30ms, {}, {}});
  std::vector<LocalDesc> l(8);
  std::vector<RemoteDesc> r(8);
  for (int i = 0; i < 8; ++i) {
    l[i] = {p.ra, static_cast<std::uint64_t>(i) * 64, 64};
    r[i] = {0, static_cast<std::uint64_t>(i) * 64, 64};
  }
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "xfer-7");
  ASSERT_TRUE(x.ok());
  std::this_thread::sleep_for(40ms);
  ASSERT_TRUE(p.a->abort(*x).ok());
  auto st = p.a->poll(*x);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kAborted);
  std::vector<Notification> seen;
  auto n = await_notification(*p.b, "xfer-7", seen);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->kind, NotifKind::kAborted);
  ASSERT_TRUE(await_quiescent(*p.a, *x).ok());
  EXPECT_TRUE(p.a->release(*x).ok());
  // The positive notification never follows the abort.
  std::this_thread::sleep_for(50ms);
  for (auto& m : p.b->take_notifications()) EXPECT_NE(m.kind, NotifKind::kMessage) << m.message;
}

TEST(LoopbackFaults, FailedPostFailsTheTransferAndTellsThePeer) {
  Pair p;
  connect(Kind::kLoopback, p, 4096,
          LoopbackOptions{0us, [](XferOp) { return Unavailable("injected: the NIC is gone"); }, {}});
  LocalDesc l{p.ra, 0, 64};
  RemoteDesc r{0, 0, 64};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, "xfer-9");
  ASSERT_TRUE(x.ok());
  auto st = p.a->poll(*x);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kFailed);
  EXPECT_TRUE(st->quiescent);
  EXPECT_NE(st->error.message().find("NIC is gone"), std::string::npos);
  std::vector<Notification> seen;
  auto n = await_notification(*p.b, "xfer-9", seen);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->kind, NotifKind::kFailedToPost);
  EXPECT_TRUE(std::all_of(p.mem_b.begin(), p.mem_b.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
}

TEST(LoopbackFaults, APeerThatIsGoneFailsTransfersInsteadOfTouchingItsMemory) {
  Pair p;
  connect(Kind::kLoopback, p, 4096);
  p.b.reset();
  LocalDesc l{p.ra, 0, 64};
  RemoteDesc r{0, 0, 64};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, "late");
  ASSERT_TRUE(x.ok());
  auto st = p.a->wait(*x, 10s);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, XferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kUnavailable);
  // Later posts are refused outright.
  EXPECT_EQ(p.a->post(XferOp::kWrite, p.a_sees_b, {&l, 1}, {&r, 1}, "later").status().code(), StatusCode::kUnavailable);
}

// ---- UCX over TCP: the active-message data path (UcxDataPath) ------------------------------------------------

// Two TCP agents, `a` taking `a_path` and `b` taking `b_path`; a's region random, b's poisoned. When `tamper` is
// set, `a` loads b's blob after it has changed it.
struct AmPair {
  std::vector<std::byte> mem_a, mem_b;
  std::unique_ptr<Transport> a, b;
  RegionId ra = 0, rb = 0;
  PeerId a_sees_b = 0, b_sees_a = 0;
};
void connect_am(AmPair& p, std::size_t bytes, UcxDataPath a_path, UcxDataPath b_path,
                const std::function<void(detail::Blob&)>& tamper = {}) {
  UcxOptions oa{"tcp", "lo", {}}, ob{"tcp", "lo", {}};
  oa.data_path = a_path;
  ob.data_path = b_path;
  auto a = create_ucx_transport(ident("am-a"), oa);
  auto b = create_ucx_transport(ident("am-b"), ob);
  ASSERT_TRUE(a.ok() && b.ok());
  p.a = std::move(a).value();
  p.b = std::move(b).value();
  p.mem_a = random_bytes(bytes, 11);
  p.mem_b.assign(bytes, std::byte{0x5a});
  p.ra = p.a->register_memory({MemoryKind::kPinnedHost, 0, p.mem_a.data(), bytes}).value();
  p.rb = p.b->register_memory({MemoryKind::kPinnedHost, 0, p.mem_b.data(), bytes}).value();
  auto blob_b = p.b->export_metadata().value();
  if (tamper) {
    detail::Blob decoded = detail::decode_blob(blob_b).value();
    tamper(decoded);
    blob_b = detail::encode_blob(decoded);
  }
  auto pb = p.a->load_peer(blob_b);
  ASSERT_TRUE(pb.ok()) << pb.status().to_string();
  p.a_sees_b = *pb;
  auto pa = p.b->load_peer(p.a->export_metadata().value());
  ASSERT_TRUE(pa.ok()) << pa.status().to_string();
  p.b_sees_a = *pa;
}

// The blob of a TCP agent names no UCX key: a random token per region, different for every region and agent.
// An urgent message is delivered like any other (it may overtake earlier traffic); an unknown peer is named. After
// a write, a backend that tracks progress (UCX) reports when bytes with the peer last moved.
TEST_P(TransportConformance, UrgentMessagesArriveAndProgressIsReportedOrUnknown) {
  Pair p;
  connect(GetParam(), p, 1 << 20);
  const auto before = std::chrono::steady_clock::now();
  const std::vector<LocalDesc> l = {{p.ra, 0, 1 << 20}};
  const std::vector<RemoteDesc> r = {{0, 0, 1 << 20}};
  auto x = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "bulk");
  ASSERT_TRUE(x.ok()) << x.status().to_string();
  ASSERT_TRUE(p.a->send_urgent_notification(p.a_sees_b, "urgent").ok());
  std::vector<Notification> seen;
  auto u = await_notification(*p.b, "urgent", seen);
  ASSERT_TRUE(u.ok()) << u.status().to_string();
  EXPECT_EQ(u->peer, p.a->identity().name);
  ASSERT_TRUE(await_notification(*p.b, "bulk", seen).ok());
  EXPECT_TRUE(p.mem_a == p.mem_b);
  EXPECT_EQ(p.a->send_urgent_notification(PeerId{77}, "nobody").code(), StatusCode::kNotFound);
  ASSERT_TRUE(p.a->wait(*x, 10s).ok());
  for (Transport* t : {p.a.get(), p.b.get()}) {
    const auto moved = t->last_progress(t == p.a.get() ? p.a_sees_b : p.b_sees_a);
    if (moved) {
      EXPECT_GE(*moved, before);
      EXPECT_LE(*moved, std::chrono::steady_clock::now());
    }
  }
  EXPECT_FALSE(p.a->last_progress(PeerId{77}).has_value());
}

TEST(UcxActiveMessages, TcpBlobsCarryTokensNotUcxKeys) {
  AmPair p;
  connect_am(p, 4096, UcxDataPath::kAuto, UcxDataPath::kAuto);
  std::vector<std::byte> more(4096);
  ASSERT_TRUE(p.b->register_memory({MemoryKind::kPinnedHost, 0, more.data(), more.size()}).ok());
  const detail::Blob b = detail::decode_blob(p.b->export_metadata().value()).value();
  const detail::Blob a = detail::decode_blob(p.a->export_metadata().value()).value();
  ASSERT_EQ(b.regions.size(), 2u);
  for (const auto& r : b.regions) {
    EXPECT_EQ(r.key.size(), 21u);
    EXPECT_EQ(r.key.substr(0, 5), "KVAM1");
  }
  EXPECT_NE(b.regions[0].key, b.regions[1].key);
  EXPECT_NE(b.regions[0].key, a.regions[0].key);
  // A blob mixing tokens and UCX keys is refused before anything connects.
  UcxOptions rma{"tcp", "lo", {}};
  rma.data_path = UcxDataPath::kRma;
  auto c = create_ucx_transport(ident("am-c"), rma);
  ASSERT_TRUE(c.ok());
  std::vector<std::byte> mem_c(4096);
  ASSERT_TRUE((*c)->register_memory({MemoryKind::kPinnedHost, 0, mem_c.data(), mem_c.size()}).ok());
  detail::Blob mixed = b;
  mixed.regions[1].key = detail::decode_blob((*c)->export_metadata().value()).value().regions[0].key;
  auto loaded = p.a->load_peer(detail::encode_blob(mixed));
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument) << loaded.status().to_string();
  EXPECT_NE(loaded.status().message().find("one data path"), std::string::npos) << loaded.status().to_string();
}

// A peer that names a region with the wrong token, or a range the region does not hold (a blob whose region was
// made larger), gets its transfer refused by the target: nothing lands there, the notification is not delivered,
// and a read's destination keeps its bytes. UCX's emulated RMA checks neither.
TEST(UcxActiveMessages, AWrongTokenOrARangeOutsideTheRegionMovesNothing) {
  const std::vector<std::function<void(detail::Blob&)>> tampers = {
      [](detail::Blob& b) { b.regions[0].key.back() = static_cast<char>(b.regions[0].key.back() ^ 1); },
      [](detail::Blob& b) { b.regions[0].bytes += 8192; },
  };
  const char* wants[] = {"wrong token", "outside region"};
  for (std::size_t t = 0; t < tampers.size(); ++t) {
    SCOPED_TRACE(wants[t]);
    AmPair p;
    connect_am(p, 1 << 16, UcxDataPath::kAuto, UcxDataPath::kAuto, tampers[t]);
    const std::uint64_t offset = t == 0 ? 0 : (1 << 16) + 4096;  // the second reaches past the real region
    std::vector<LocalDesc> l = {{p.ra, 0, 4096}};
    std::vector<RemoteDesc> r = {{0, offset, 4096}};
    auto w = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "refused-write");
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    auto st = p.a->wait(*w, 10s);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    EXPECT_EQ(st->state, XferState::kFailed);
    EXPECT_NE(st->error.message().find(wants[t]), std::string::npos) << st->error.to_string();
    ASSERT_TRUE(await_quiescent(*p.a, *w).ok());
    EXPECT_EQ(p.mem_b, std::vector<std::byte>(1 << 16, std::byte{0x5a})) << "bytes landed";
    const std::vector<std::byte> before = p.mem_a;
    auto rd = p.a->post(XferOp::kRead, p.a_sees_b, l, r, "refused-read");
    ASSERT_TRUE(rd.ok()) << rd.status().to_string();
    st = p.a->wait(*rd, 10s);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    EXPECT_EQ(st->state, XferState::kFailed);
    EXPECT_NE(st->error.message().find(wants[t]), std::string::npos) << st->error.to_string();
    ASSERT_TRUE(await_quiescent(*p.a, *rd).ok());
    EXPECT_EQ(p.mem_a, before) << "a refused read changed its destination";
    // The target delivered neither notification; a message sent afterwards still arrives (nothing is stuck).
    ASSERT_TRUE(p.a->send_notification(p.a_sees_b, "after").ok());
    std::vector<Notification> seen;
    ASSERT_TRUE(await_notification(*p.b, "after", seen).ok());
    for (const auto& n : seen) EXPECT_TRUE(n.message != "refused-write" && n.message != "refused-read") << n.message;
  }
}

// After the target disconnects the peer, nothing the peer sends lands any more: peer_revoked is true at once
// (while the peer lives), and a later write of the peer, eager or rendezvous, lands nothing and is not delivered;
// the writer hears no acknowledgement (the target closed its side), so its write ends when it gives up on the
// target too (abort, disconnect_peer). With
// UCX's emulated RMA only the peer's end could prove that (the pd lane kept such blocks quarantined until then).
TEST(UcxActiveMessages, AfterDisconnectNothingOfALivePeerLands) {
  AmPair p;
  connect_am(p, 1 << 20, UcxDataPath::kAuto, UcxDataPath::kAuto);
  std::vector<LocalDesc> l = {{p.ra, 0, 1 << 19}};
  std::vector<RemoteDesc> r = {{0, 0, 1 << 19}};
  auto first = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "before");
  ASSERT_TRUE(first.ok());
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(*p.b, "before", seen).ok());
  EXPECT_EQ(std::memcmp(p.mem_a.data(), p.mem_b.data(), 1 << 19), 0);
  EXPECT_FALSE(p.b->peer_revoked(p.b_sees_a));
  ASSERT_TRUE(p.b->disconnect_peer(p.b_sees_a).ok());
  EXPECT_TRUE(p.b->peer_revoked(p.b_sees_a)) << "a live peer's writes are refused after the disconnect";
  std::fill(p.mem_b.begin(), p.mem_b.end(), std::byte{0x5a});
  std::vector<LocalDesc> l2 = {{p.ra, 0, 4096}, {p.ra, 1 << 19, 1 << 19}};
  std::vector<RemoteDesc> r2 = {{0, 0, 4096}, {0, 1 << 19, 1 << 19}};
  auto late = p.a->post(XferOp::kWrite, p.a_sees_b, l2, r2, "late");
  ASSERT_TRUE(late.ok()) << late.status().to_string();
  auto st = p.a->wait(*late, 1s);
  if (st.ok()) {
    EXPECT_EQ(st->state, XferState::kFailed) << "a write into a target that disconnected it completed";
  }
  // The writer gives up on the target as the target gave up on it (its lease), which ends what it still sends.
  ASSERT_TRUE(p.a->abort(*late).ok());
  ASSERT_TRUE(p.a->disconnect_peer(p.a_sees_b).ok());
  ASSERT_TRUE(await_quiescent(*p.a, *late).ok());
  auto got = p.b->wait_notifications(200ms);
  if (got.ok()) {
    for (const auto& n : *got) EXPECT_FALSE(n.kind == NotifKind::kMessage && n.message == "late");  // kAborted may
  }
  EXPECT_EQ(p.mem_b, std::vector<std::byte>(1 << 20, std::byte{0x5a})) << "a late write landed";
}

// Agents that chose different paths talk both ways: each follows the target's blob.
TEST(UcxActiveMessages, AgentsOfEitherPathMoveBytesBothWays) {
  AmPair p;
  connect_am(p, 1 << 21, UcxDataPath::kRma, UcxDataPath::kActiveMessages);
  // a (RMA) writes into b (tokens): 1 MiB (rendezvous) and small pieces, scattered.
  std::vector<LocalDesc> l = {{p.ra, 0, 1 << 20}, {p.ra, (1 << 20) + 17, 100}, {p.ra, (1 << 20) + 4096, 8192}};
  std::vector<RemoteDesc> r = {{0, 4096, 1 << 20}, {0, (1 << 20) + 8192, 100}, {0, 3 << 19, 8192}};
  auto w = p.a->post(XferOp::kWrite, p.a_sees_b, l, r, "mixed-write");
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  std::vector<Notification> seen;
  ASSERT_TRUE(await_notification(*p.b, "mixed-write", seen).ok());
  for (std::size_t i = 0; i < l.size(); ++i)
    EXPECT_EQ(std::memcmp(p.mem_a.data() + l[i].offset, p.mem_b.data() + r[i].offset, l[i].bytes), 0) << i;
  auto st = p.a->wait(*w, 10s);
  ASSERT_TRUE(st.ok() && st->state == XferState::kDone) << (st.ok() ? st->error.to_string() : "");
  // a reads them back from b into another place of its own region.
  std::vector<LocalDesc> lr = {{p.ra, 0, 1 << 20}};
  std::vector<RemoteDesc> rr = {{0, 4096, 1 << 20}};
  std::fill(p.mem_a.begin(), p.mem_a.begin() + (1 << 20), std::byte{0});
  auto rd = p.a->post(XferOp::kRead, p.a_sees_b, lr, rr, "mixed-read");
  ASSERT_TRUE(rd.ok()) << rd.status().to_string();
  st = p.a->wait(*rd, 10s);
  ASSERT_TRUE(st.ok() && st->state == XferState::kDone) << (st.ok() ? st->error.to_string() : "");
  EXPECT_EQ(std::memcmp(p.mem_a.data(), p.mem_b.data() + 4096, 1 << 20), 0);
  ASSERT_TRUE(await_notification(*p.b, "mixed-read", seen).ok());
  // b (tokens) writes into a (RMA keys): b follows a's blob.
  std::vector<LocalDesc> lb = {{p.rb, 0, 1 << 20}};
  std::vector<RemoteDesc> rb = {{0, 1 << 20, 1 << 20}};
  auto wb = p.b->post(XferOp::kWrite, p.b_sees_a, lb, rb, "rma-write");
  ASSERT_TRUE(wb.ok()) << wb.status().to_string();
  ASSERT_TRUE(await_notification(*p.a, "rma-write", seen).ok());
  EXPECT_EQ(std::memcmp(p.mem_b.data(), p.mem_a.data() + (1 << 20), 1 << 20), 0);
}

// An abort of a read whose answers are still coming ends it; answers that come later are dropped unread.
TEST(UcxActiveMessages, AnAbortedReadIsQuiescentAndLaterAnswersAreDropped) {
  AmPair p;
  connect_am(p, 8 << 20, UcxDataPath::kAuto, UcxDataPath::kAuto);
  std::vector<LocalDesc> l;
  std::vector<RemoteDesc> r;
  for (std::uint64_t i = 0; i < 2048; ++i) {
    l.push_back({p.ra, i * 4096, 4096});
    r.push_back({0, i * 4096, 4096});
  }
  for (int round = 0; round < 5; ++round) {
    auto rd = p.a->post(XferOp::kRead, p.a_sees_b, l, r, "aborted");
    ASSERT_TRUE(rd.ok()) << rd.status().to_string();
    ASSERT_TRUE(p.a->abort(*rd).ok());
    ASSERT_TRUE(await_quiescent(*p.a, *rd).ok()) << round;
    auto st = p.a->poll(*rd);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->state, XferState::kFailed);
    EXPECT_TRUE(p.a->release(*rd).ok());
  }
  // A read after them moves the right bytes.
  std::fill(p.mem_a.begin(), p.mem_a.end(), std::byte{0});
  auto rd = p.a->post(XferOp::kRead, p.a_sees_b, l, r, "after");
  ASSERT_TRUE(rd.ok());
  auto st = p.a->wait(*rd, 10s);
  ASSERT_TRUE(st.ok() && st->state == XferState::kDone) << (st.ok() ? st->error.to_string() : "");
  EXPECT_EQ(std::memcmp(p.mem_a.data(), p.mem_b.data(), 8 << 20), 0);
}

// The TCP segment size is checked before UCX sees it; 0 keeps UCX's defaults, and those transports still move bytes.
TEST(UcxOptionsCheck, TcpSegmentOutOfRangeIsRefusedNamingIt) {
  for (std::uint64_t bad : {std::uint64_t{1}, std::uint64_t{4095}, (std::uint64_t{64} << 20) + 1}) {
    UcxOptions o;
    o.tls = "tcp";
    o.net_devices = "lo";
    o.tcp_segment_bytes = bad;
    auto t = create_ucx_transport(ident("seg"), o);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(fmt::format("tcp_segment_bytes {}", bad)), std::string::npos)
        << t.status().to_string();
  }
  for (std::uint64_t good : {std::uint64_t{0}, std::uint64_t{4096}, std::uint64_t{1} << 20}) {
    UcxOptions o;
    o.tls = "tcp";
    o.net_devices = "lo";
    o.tcp_segment_bytes = good;
    auto a = create_ucx_transport(ident(fmt::format("seg-a{}", good)), o);
    auto b = create_ucx_transport(ident(fmt::format("seg-b{}", good)), o);
    ASSERT_TRUE(a.ok() && b.ok()) << good;
    std::vector<std::byte> src = random_bytes(3 << 20, 21), dst(3 << 20);
    auto ra = (*a)->register_memory({MemoryKind::kPinnedHost, 0, src.data(), src.size()});
    auto rb = (*b)->register_memory({MemoryKind::kPinnedHost, 0, dst.data(), dst.size()});
    ASSERT_TRUE(ra.ok() && rb.ok());
    auto peer = (*a)->load_peer((*b)->export_metadata().value());
    ASSERT_TRUE(peer.ok() && (*b)->load_peer((*a)->export_metadata().value()).ok());
    std::vector<LocalDesc> l = {{*ra, 0, src.size()}};
    std::vector<RemoteDesc> r = {{0, 0, src.size()}};
    auto x = (*a)->post(XferOp::kWrite, *peer, l, r, "seg");
    ASSERT_TRUE(x.ok());
    std::vector<Notification> seen;
    ASSERT_TRUE(await_notification(**b, "seg", seen).ok()) << good;
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0) << good;
    ASSERT_TRUE(await_quiescent(**a, *x).ok());
  }
}

TEST(MergeContiguous, JoinsRunsContiguousOnBothSidesAndKeepsTheRest) {
  std::vector<std::byte> mem(1 << 12);
  std::byte* p = mem.data();
  using detail::ResolvedOp;
  std::vector<ResolvedOp> ops = {{p, 1000, 0, 10},        // run 1 ...
                                 {p + 10, 1010, 0, 20},   // ... continues on both sides
                                 {p + 30, 1030, 1, 5},    // another remote region: kept apart
                                 {p + 35, 2000, 1, 5},    // local continues, remote does not
                                 {p + 40, 2005, 1, 5},    // continues the previous one
                                 {p + 100, 2010, 1, 5},   // remote continues, local does not
                                 {p + 100, 2010, 1, 5}};  // the same range again (not after its end): kept
  detail::merge_contiguous(ops);
  ASSERT_EQ(ops.size(), 5u);
  EXPECT_EQ(ops[0].local_ptr, p);
  EXPECT_EQ(ops[0].bytes, 30u);
  EXPECT_EQ(ops[1].remote_region, 1u);
  EXPECT_EQ(ops[1].bytes, 5u);
  EXPECT_EQ(ops[2].remote_addr, 2000u);
  EXPECT_EQ(ops[2].bytes, 10u);
  EXPECT_EQ(ops[3].local_ptr, p + 100);
  EXPECT_EQ(ops[4].local_ptr, p + 100);
  std::vector<ResolvedOp> none;
  detail::merge_contiguous(none);
  EXPECT_TRUE(none.empty());
}

}  // namespace
}  // namespace kvtier::transport
