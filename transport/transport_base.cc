#include "transport/transport_base.h"

#include <fmt/format.h>
#include <sodium.h>
#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

#include "core/byte_codec.h"
#include "kvtier/core/deadline.h"
#include "kvtier/core/enum_names.h"
#include "kvtier/core/log.h"

namespace kvtier::transport {

constexpr EnumName<XferOp> kXferOpEntries[] = {
    {XferOp::kRead, "read"},
    {XferOp::kWrite, "write"},
};
constexpr auto kXferOpNames = enum_table("xfer op", kXferOpEntries);
std::string_view xfer_op_name(XferOp op) noexcept { return kXferOpNames.name(op); }

constexpr EnumName<XferState> kXferStateEntries[] = {
    {XferState::kInProgress, "in_progress"},
    {XferState::kDone, "done"},
    {XferState::kFailed, "failed"},
};
constexpr auto kXferStateNames = enum_table("xfer state", kXferStateEntries);
std::string_view xfer_state_name(XferState state) noexcept { return kXferStateNames.name(state); }

constexpr EnumName<NotifKind> kNotifKindEntries[] = {
    {NotifKind::kMessage, "message"},
    {NotifKind::kAborted, "aborted"},
    {NotifKind::kFailedToPost, "failed_to_post"},
};
constexpr auto kNotifKindNames = enum_table("notif kind", kNotifKindEntries);
std::string_view notif_kind_name(NotifKind kind) noexcept { return kNotifKindNames.name(kind); }

namespace detail {
namespace {

constexpr std::uint64_t kBlobMagic = 0x31545250584b564bULL;       // "KVKXPRT1" little-endian
constexpr std::uint64_t kBlobMagicKeyed = 0x314b5250584b564bULL;  // "KVKXPRK1": a MAC follows the checksum
constexpr std::size_t kMaxString = 1u << 20;
constexpr std::uint32_t kMaxRegions = 1u << 16;
// BLAKE2b personalisation: a MAC of a peer blob is never valid as any other keyed hash of kvtier.
constexpr unsigned char kPersonalPeerBlob[crypto_generichash_blake2b_PERSONALBYTES] = "kvtier-peer-v1";

using Writer = codec::ByteWriter<std::vector<std::byte>>;

bool ensure_sodium() {
  static const int rc = sodium_init();
  return rc >= 0;
}

// Keyed BLAKE2b of `bytes` under `secret` with a personalisation per use, so a MAC of one use is never valid as
// another's.
std::array<unsigned char, kBlobMacBytes> keyed_mac(std::span<const std::byte> bytes, std::string_view secret,
                                                   const unsigned char* personal) {
  ensure_sodium();
  crypto_generichash_state st;
  crypto_generichash_blake2b_init_salt_personal(&st, reinterpret_cast<const unsigned char*>(secret.data()),
                                                secret.size(), kBlobMacBytes, nullptr, personal);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  std::array<unsigned char, kBlobMacBytes> out{};
  crypto_generichash_final(&st, out.data(), out.size());
  sodium_memzero(&st, sizeof(st));
  return out;
}

std::array<unsigned char, kBlobMacBytes> blob_mac(std::span<const std::byte> bytes, std::string_view secret) {
  return keyed_mac(bytes, secret, kPersonalPeerBlob);
}

// Names end up in messages and logs: printable ASCII only, bounded.
bool sane_name(std::string_view s) {
  return !s.empty() && s.size() <= kMaxNameBytes &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

// The bounds every blob must keep, whatever its backend: nothing a crafted blob carries may make a later
// address computation wrap or point at memory outside what the peer registered.
Status check_fields(const Blob& b) {
  if (!sane_name(b.backend))
    return InvalidArgument(fmt::format("peer blob backend name of {} bytes: need 1..{} printable characters",
                                       b.backend.size(), kMaxNameBytes));
  if (!sane_name(b.identity.name))
    return InvalidArgument(fmt::format("peer blob agent name of {} bytes: need 1..{} printable characters",
                                       b.identity.name.size(), kMaxNameBytes));
  if (b.address.empty() || b.address.size() > kMaxAddressBytes)
    return InvalidArgument(fmt::format("peer '{}' blob: address of {} bytes (need 1..{})", b.identity.name,
                                       b.address.size(), kMaxAddressBytes));
  std::vector<std::pair<std::uint64_t, std::uint64_t>> live;  // [base, end) of live regions
  for (std::size_t i = 0; i < b.regions.size(); ++i) {
    const Blob::Region& r = b.regions[i];
    if (r.key.size() > kMaxRemoteKeyBytes)
      return InvalidArgument(fmt::format("peer '{}' region {}: remote key of {} bytes (max {})", b.identity.name, i,
                                         r.key.size(), kMaxRemoteKeyBytes));
    if (r.bytes == 0) {
      // A deregistered region keeps its index with zero bytes and no key; it can never be addressed.
      if (!r.key.empty())
        return InvalidArgument(
            fmt::format("peer '{}' region {}: 0 bytes but a remote key of {} bytes", b.identity.name, i, r.key.size()));
      continue;
    }
    if (r.base == 0)
      return InvalidArgument(
          fmt::format("peer '{}' region {}: base 0 for a region of {} bytes", b.identity.name, i, r.bytes));
    if (r.bytes > ~std::uint64_t{0} - r.base)
      return OutOfRange(fmt::format("peer '{}' region {}: base {:#x} + {} bytes wraps around the address space",
                                    b.identity.name, i, r.base, r.bytes));
    live.emplace_back(r.base, r.base + r.bytes);
  }
  // An agent never registers overlapping regions; a blob that claims them describes memory nobody registered.
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i)
    if (live[i].first < live[i - 1].second)
      return InvalidArgument(fmt::format("peer '{}' blob: region at {:#x} overlaps the region [{:#x}, {:#x})",
                                         b.identity.name, live[i].first, live[i - 1].first, live[i - 1].second));
  return Status::Ok();
}

}  // namespace

void merge_contiguous(std::vector<ResolvedOp>& ops) {
  if (ops.size() < 2) return;
  std::size_t out = 0;
  for (std::size_t i = 1; i < ops.size(); ++i) {
    ResolvedOp& last = ops[out];
    const ResolvedOp& o = ops[i];
    if (o.remote_region == last.remote_region && o.local_ptr == last.local_ptr + last.bytes &&
        o.remote_addr == last.remote_addr + last.bytes) {
      last.bytes += o.bytes;
    } else {
      ops[++out] = o;
    }
  }
  ops.resize(out + 1);
}

Status check_agent_name(std::string_view name) {
  if (sane_name(name)) return Status::Ok();
  return InvalidArgument(fmt::format("agent name '{}' ({} bytes): need 1..{} printable ASCII characters",
                                     shown_value(name), name.size(), kMaxNameBytes));
}

std::string handshake_challenge() {
  ensure_sodium();
  std::string c(kHandshakeChallengeBytes, '\0');
  randombytes_buf(c.data(), c.size());
  return c;
}

std::string handshake_proof(std::string_view secret, std::string_view challenge, std::string_view initiator,
                            std::string_view initiator_address, std::string_view owner) {
  // A different personalisation from the blob's: a proof is never valid as a blob MAC, or the reverse.
  static constexpr unsigned char kPersonal[crypto_generichash_blake2b_PERSONALBYTES] = "kvtier-ipc-hi1";
  codec::ByteWriter<std::string> w;  // length-prefixed fields: no two field lists hash alike
  w.str(challenge).str(initiator).str(initiator_address).str(owner);
  const auto mac = keyed_mac(std::as_bytes(std::span<const char>(w.out.data(), w.out.size())), secret, kPersonal);
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

bool handshake_proof_matches(std::string_view got, std::string_view want) {
  return got.size() == want.size() && sodium_memcmp(got.data(), want.data(), want.size()) == 0;
}

Status check_peer_secret(std::string_view secret) {
  if (secret.empty() || (secret.size() >= kMinPeerSecretBytes && secret.size() <= kMaxPeerSecretBytes))
    return Status::Ok();
  return InvalidArgument(fmt::format("peer_secret is {} bytes; a peer secret needs {} to {} bytes", secret.size(),
                                     kMinPeerSecretBytes, kMaxPeerSecretBytes));
}

// Layout: u64 magic, u32 version, then the fields, then u64 xxh3 of everything before it; keyed (magic
// "KVKXPRK1"): then the 32-byte MAC of everything before it.
std::vector<std::byte> encode_blob(const Blob& blob, std::string_view secret) {
  Writer w;
  w.u64(secret.empty() ? kBlobMagic : kBlobMagicKeyed);
  w.u32(blob.version);
  w.str(blob.backend);
  w.str(blob.identity.name);
  w.u64(blob.identity.layout_fingerprint);
  w.u32(blob.identity.tp_size);
  w.u32(blob.identity.tp_rank);
  w.u32(static_cast<std::uint32_t>(blob.regions.size()));
  for (const auto& r : blob.regions) {
    w.u8(static_cast<std::uint8_t>(r.kind));
    w.u64(r.base);
    w.u64(r.bytes);
    w.str(r.key);
  }
  w.str(blob.address);
  w.u64(XXH3_64bits(w.out.data(), w.out.size()));
  if (!secret.empty()) {
    const auto mac = blob_mac(w.out, secret);
    w.raw(mac.data(), mac.size());
  }
  return std::move(w.out);
}

Result<Blob> decode_blob(std::span<const std::byte> all, std::string_view secret) {
  if (all.size() < 20) return InvalidArgument(fmt::format("peer blob of {} bytes is too short", all.size()));
  const std::uint64_t magic = codec::load_le<std::uint64_t>(all.data());
  if (magic != kBlobMagic && magic != kBlobMagicKeyed)
    return InvalidArgument(fmt::format("peer blob has magic {:#018x}, not a kvtier transport blob", magic));
  const bool keyed = magic == kBlobMagicKeyed;
  // Authentication comes first: with a secret, not one field of a blob is read before its MAC verifies.
  if (!secret.empty() && !keyed)
    return FailedPrecondition(
        "peer blob carries no MAC, but this agent has a peer_secret: only agents holding the same secret may load "
        "each other");
  if (secret.empty() && keyed)
    return FailedPrecondition(
        "peer blob is authenticated with a peer secret (it carries a MAC), but this agent has no peer_secret");
  std::span<const std::byte> bytes = all;
  if (keyed) {
    if (all.size() < 20 + kBlobMacBytes)
      return FailedPrecondition(
          fmt::format("peer blob authentication failed: {} bytes cannot hold the fields and a MAC", all.size()));
    bytes = all.first(all.size() - kBlobMacBytes);
    const auto mac = blob_mac(bytes, secret);
    if (sodium_memcmp(mac.data(), all.data() + bytes.size(), kBlobMacBytes) != 0)
      return FailedPrecondition(
          "peer blob authentication failed: its MAC does not verify under this agent's peer_secret (the peer holds "
          "another secret, or the blob was changed)");
  }
  codec::ByteReader r(bytes, kMaxString);
  (void)r.skip(8);  // the magic, read above
  const std::uint64_t stored = codec::load_le<std::uint64_t>(bytes.data() + bytes.size() - 8);
  const std::uint64_t computed = XXH3_64bits(bytes.data(), bytes.size() - 8);
  if (stored != computed)
    return DataLoss(fmt::format("peer blob checksum {:#018x} != computed {:#018x} (damaged blob)", stored, computed));
  Blob b;
  (void)r.u32(b.version);
  if (b.version != kTransportVersion)
    return FailedPrecondition(
        fmt::format("peer transport version {} != local version {}", b.version, kTransportVersion));
  std::uint32_t n = 0;
  bool ok = r.str(b.backend) && r.str(b.identity.name) && r.u64(b.identity.layout_fingerprint) &&
            r.u32(b.identity.tp_size) && r.u32(b.identity.tp_rank) && r.u32(n);
  if (ok && n > kMaxRegions) return InvalidArgument(fmt::format("peer blob lists {} regions (max {})", n, kMaxRegions));
  for (std::uint32_t i = 0; ok && i < n; ++i) {
    Blob::Region reg;
    std::uint8_t kind = 0;
    ok = r.u8(kind) && r.u64(reg.base) && r.u64(reg.bytes) && r.str(reg.key);
    if (ok && kind > static_cast<std::uint8_t>(MemoryKind::kPinnedHost))
      return InvalidArgument(fmt::format("peer blob region {} has memory kind {}", i, kind));
    reg.kind = static_cast<MemoryKind>(kind);
    b.regions.push_back(std::move(reg));
  }
  ok = ok && r.str(b.address);
  if (!ok || r.pos() != bytes.size() - 8)
    return InvalidArgument(fmt::format("peer blob of {} bytes is truncated or malformed", bytes.size()));
  KVTIER_RETURN_IF_ERROR(check_fields(b));
  return b;
}

std::optional<std::chrono::steady_clock::time_point> TransportBase::last_progress(PeerId peer) const {
  auto info = peer_info(peer);
  if (!info.ok()) return std::nullopt;
  std::lock_guard lock(progress_mu_);
  auto it = progress_by_name_.find(info->identity.name);
  if (it == progress_by_name_.end()) return std::nullopt;
  return it->second.copying > 0 ? std::chrono::steady_clock::now() : it->second.last;
}

void TransportBase::note_peer_progress(const std::string& name, int copying) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(progress_mu_);
  PeerProgress& p = progress_by_name_[name];
  p.last = now;
  p.copying += copying;
}

Result<RegionId> TransportBase::register_memory(const MemoryRegion& region) {
  if (region.base == nullptr || region.bytes == 0)
    return InvalidArgument(
        fmt::format("memory region base {} bytes {}: base must be non-null and bytes >= 1", region.base, region.bytes));
  const auto lo = reinterpret_cast<std::uintptr_t>(region.base);
  if (lo + region.bytes < lo)
    return OutOfRange(fmt::format("memory region at {} of {} bytes wraps", region.base, region.bytes));
  RegionId id = 0;
  {
    std::lock_guard lock(mu_);
    for (std::size_t i = 0; i < regions_.size(); ++i) {
      const auto& r = regions_[i];
      if (!r.live) continue;
      const auto rlo = reinterpret_cast<std::uintptr_t>(r.region.base);
      if (lo < rlo + r.region.bytes && rlo < lo + region.bytes)
        return InvalidArgument(fmt::format("memory region [{}, +{}) overlaps registered region {} [{}, +{})",
                                           region.base, region.bytes, i, r.region.base, r.region.bytes));
    }
    id = static_cast<RegionId>(regions_.size());
    regions_.push_back(RegionRec{region, {}, 0, false});
  }
  auto key = backend_register(id, region);
  std::lock_guard lock(mu_);
  if (!key.ok()) return key.status();
  regions_[id].key = std::move(key).value();
  regions_[id].live = true;
  return id;
}

Status TransportBase::deregister_memory(RegionId region) {
  {
    std::lock_guard lock(mu_);
    if (region >= regions_.size() || !regions_[region].live)
      return NotFound(fmt::format("region {} is not registered", region));
    if (regions_[region].users > 0)
      return FailedPrecondition(
          fmt::format("region {} is used by {} transfers that are not quiescent", region, regions_[region].users));
    regions_[region].live = false;
  }
  backend_deregister(region);
  return Status::Ok();
}

Result<std::vector<std::byte>> TransportBase::export_metadata() {
  KVTIER_ASSIGN_OR_RETURN(std::string address, backend_address());
  Blob b;
  b.version = kTransportVersion;
  b.backend = std::string(backend_name());
  b.identity = identity_;
  b.address = std::move(address);
  std::lock_guard lock(mu_);
  for (const auto& r : regions_) {
    // Deregistered regions keep their index (peers address regions by index) with zero bytes.
    b.regions.push_back(Blob::Region{r.region.kind, reinterpret_cast<std::uint64_t>(r.region.base),
                                     r.live ? r.region.bytes : 0, r.live ? r.key : std::string()});
  }
  return encode_blob(b, peer_secret_);
}

Result<PeerId> TransportBase::load_peer(std::span<const std::byte> bytes) {
  KVTIER_ASSIGN_OR_RETURN(Blob b, decode_blob(bytes, peer_secret_));
  const AgentIdentity& peer = b.identity;
  if (b.backend != backend_name())
    return FailedPrecondition(fmt::format("peer '{}' uses transport backend '{}', local '{}' uses '{}'", peer.name,
                                          b.backend, identity_.name, backend_name()));
  if (peer.layout_fingerprint != identity_.layout_fingerprint)
    return FailedPrecondition(fmt::format(
        "peer '{}' layout fingerprint {:#018x} != local '{}' fingerprint {:#018x} (the blocks differ in dtype, bytes, "
        "roles, tokens per block, per-block tensor shape or tensor-parallel rank)",
        peer.name, peer.layout_fingerprint, identity_.name, identity_.layout_fingerprint));
  if (peer.tp_size != identity_.tp_size)
    return FailedPrecondition(fmt::format("peer '{}' tensor-parallel size {} != local '{}' tensor-parallel size {}",
                                          peer.name, peer.tp_size, identity_.name, identity_.tp_size));
  if (peer.tp_rank >= peer.tp_size)
    return InvalidArgument(
        fmt::format("peer '{}' tensor-parallel rank {} >= its size {}", peer.name, peer.tp_rank, peer.tp_size));
  if (peer.name == identity_.name)
    return InvalidArgument(fmt::format("peer blob names this agent itself ('{}')", peer.name));
  KVTIER_RETURN_IF_ERROR(backend_check_blob(b));
  // A peer loaded under this name before: the same blob again is a duplicate; another address or other regions are
  // the peer restarted (a process with a stable name, as a pod's). The old incarnation is disconnected first (its
  // transfers fail, what it could still write is revoked where the backend can), so the restart is served without
  // recreating this agent; a disconnected peer's name is free already.
  for (;;) {
    std::optional<PeerId> previous;
    {
      std::lock_guard lock(mu_);
      for (std::size_t i = 0; i < peers_.size(); ++i) {
        const PeerRec& p = peers_[i];
        if (p.info.identity.name != peer.name) continue;
        const bool same_regions =
            std::equal(p.regions.begin(), p.regions.end(), b.regions.begin(), b.regions.end(),
                       [](const Blob::Region& x, const Blob::Region& y) {
                         return x.kind == y.kind && x.base == y.base && x.bytes == y.bytes && x.key == y.key;
                       });
        // The same blob: a duplicate while its connection is up; once the connection failed (the peer closed it,
        // as after it gave up on this agent at a lease), loaded again to reconnect.
        if (p.address == b.address && same_regions && !(p.connected && !p.failed.ok()))
          return AlreadyExists(fmt::format("peer '{}' is already loaded", peer.name));
        previous = static_cast<PeerId>(i);
      }
    }
    if (!previous) break;
    log(LogLevel::kWarning, "transport",
        fmt::format("peer '{}' loaded again (restarted with new metadata, or its connection failed): disconnecting its "
                    "previous incarnation",
                    peer.name));
    KVTIER_RETURN_IF_ERROR(disconnect_peer(*previous));
  }
  PeerId id = 0;
  {
    std::lock_guard lock(mu_);
    for (const auto& p : peers_)
      if (p.info.identity.name == peer.name)
        return AlreadyExists(fmt::format("peer '{}' is already loaded", peer.name));
    id = static_cast<PeerId>(peers_.size());
    PeerRec rec;
    rec.info.identity = peer;
    rec.info.version = b.version;
    rec.info.backend = b.backend;
    for (const auto& r : b.regions) rec.info.regions.push_back(RegionInfo{r.kind, r.bytes});
    rec.regions = b.regions;
    rec.address = b.address;
    rec.failed = Unavailable(fmt::format("peer '{}' is still connecting", peer.name));
    rec.failed.ignore_error();  // the peer's state: a call that meets it returns a copy to look at
    peers_.push_back(std::move(rec));
  }
  Status s = backend_connect(id, b);
  std::lock_guard lock(mu_);
  // A refused connection leaves a failed record, so the peer's index stays stable for the backend.
  peers_[id].failed = s.ok() ? Status::Ok() : s;
  peers_[id].connected = s.ok();
  peers_[id].failed.ignore_error();  // the peer's state (as above); s itself is returned below
  if (!s.ok()) {
    peers_[id].info.identity.name += " (failed)";
    return s;
  }
  return id;
}

Result<PeerInfo> TransportBase::peer_info(PeerId peer) const {
  std::lock_guard lock(mu_);
  if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
  return peers_[peer].info;
}

Result<PeerId> TransportBase::find_peer(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < peers_.size(); ++i)
    if (peers_[i].info.identity.name == name && peers_[i].failed.ok() && !peers_[i].disconnected)
      return static_cast<PeerId>(i);
  return NotFound(fmt::format("no connected peer named '{}'", name));
}

Result<void*> TransportBase::peer_region_address(PeerId peer, std::uint32_t region) {
  Blob::Region r;
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
    const PeerRec& p = peers_[peer];
    if (p.disconnected) return Unavailable(fmt::format("peer {} was disconnected", peer));
    if (!p.failed.ok()) return p.failed;
    if (region >= p.regions.size())
      return NotFound(fmt::format("peer {} has no region {} ({} regions)", peer, region, p.regions.size()));
    r = p.regions[region];
  }
  if (r.bytes == 0) return NotFound(fmt::format("peer {} region {} was deregistered", peer, region));
  return backend_peer_address(peer, region, r);
}

Result<Transport::SharedMemory> TransportBase::allocate_shared(std::uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("allocate_shared: 0 bytes");
  KVTIER_ASSIGN_OR_RETURN(void* p, backend_allocate_shared(bytes));
  auto id = register_memory({MemoryKind::kPinnedHost, 0, p, bytes});
  if (!id.ok()) {
    backend_free_shared(p);
    return id.status().with_context("allocate_shared");
  }
  return SharedMemory{*id, static_cast<std::byte*>(p), bytes};
}

TransportBase::~TransportBase() {
  for (const HostMapping& m : host_mappings_) munmap(m.data, m.bytes);
}

Result<std::span<std::byte>> TransportBase::allocate_host(std::uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("allocate_host: 0 bytes");
  KVTIER_ASSIGN_OR_RETURN(void* p, backend_allocate_host(bytes));
  return std::span<std::byte>(static_cast<std::byte*>(p), bytes);
}

Result<void*> TransportBase::backend_allocate_host(std::uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return ResourceExhausted(fmt::format("allocate_host: {} bytes: {}", bytes, std::strerror(errno)));
  std::lock_guard lock(mu_);
  host_mappings_.push_back({p, bytes});
  return p;
}

Result<void*> TransportBase::backend_allocate_shared(std::uint64_t) {
  return NotSupported(fmt::format("the {} backend cannot share memory that peers map directly", backend_name()));
}

Result<void*> TransportBase::backend_peer_address(PeerId, std::uint32_t, const Blob::Region&) {
  return NotSupported(
      fmt::format("the {} backend reaches a peer's memory only through its own copies", backend_name()));
}

Result<XferId> TransportBase::post(XferOp op, PeerId peer, std::span<const LocalDesc> local,
                                   std::span<const RemoteDesc> remote, std::string notification) {
  std::vector<ResolvedOp> ops;
  XferId id = 0;
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
    const PeerRec& p = peers_[peer];
    if (!p.failed.ok()) return p.failed;
    if (local.size() != remote.size())
      return InvalidArgument(fmt::format("local descriptor list has {} entries, remote list {}: they must be equal",
                                         local.size(), remote.size()));
    if (local.empty()) return InvalidArgument("descriptor lists are empty");
    ops.reserve(local.size());
    std::set<RegionId> used;
    for (std::size_t i = 0; i < local.size(); ++i) {
      const LocalDesc& l = local[i];
      const RemoteDesc& r = remote[i];
      if (l.bytes == 0) return InvalidArgument(fmt::format("descriptor {}: 0 bytes", i));
      if (l.bytes != r.bytes)
        return InvalidArgument(fmt::format("descriptor {}: local {} bytes != remote {} bytes", i, l.bytes, r.bytes));
      if (l.region >= regions_.size() || !regions_[l.region].live)
        return NotFound(fmt::format("descriptor {}: local region {} is not registered", i, l.region));
      const RegionRec& lr = regions_[l.region];
      if (l.offset > lr.region.bytes || l.bytes > lr.region.bytes - l.offset)
        return OutOfRange(fmt::format("descriptor {}: local [{}, +{}) outside region {} of {} bytes", i, l.offset,
                                      l.bytes, l.region, lr.region.bytes));
      if (r.region >= p.regions.size())
        return OutOfRange(fmt::format("descriptor {}: remote region {} >= peer '{}' regions {}", i, r.region,
                                      p.info.identity.name, p.regions.size()));
      const Blob::Region& rr = p.regions[r.region];
      if (r.offset > rr.bytes || r.bytes > rr.bytes - r.offset)
        return OutOfRange(fmt::format("descriptor {}: remote [{}, +{}) outside peer '{}' region {} of {} bytes", i,
                                      r.offset, r.bytes, p.info.identity.name, r.region, rr.bytes));
      ops.push_back(
          ResolvedOp{static_cast<std::byte*>(lr.region.base) + l.offset, rr.base + r.offset, r.region, l.bytes});
      used.insert(l.region);
    }
    id = next_xfer_++;
    XferRec rec;
    rec.op = op;
    rec.peer = peer;
    rec.regions.assign(used.begin(), used.end());
    rec.notification = notification;
    for (RegionId u : rec.regions) ++regions_[u].users;
    xfers_.emplace(id, std::move(rec));
  }
  Status s = backend_post(id, op, peer, std::move(ops), notification);
  if (!s.ok()) {
    // Nothing was started: the transfer fails at once and is quiescent; the peer hears of it.
    finish_xfer(id, s);
    set_quiescent(id);
    backend_send(peer, NotifKind::kFailedToPost, std::move(notification)).ignore_error();
  }
  return id;
}

Result<XferStatus> TransportBase::poll(XferId xfer) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", xfer));
  return it->second.status;
}

Result<XferStatus> TransportBase::wait(XferId xfer, std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mu_);
  for (;;) {
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", xfer));
    if (it->second.status.state != XferState::kInProgress) return it->second.status;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && std::chrono::steady_clock::now() >= deadline) {
      it = xfers_.find(xfer);
      if (it != xfers_.end() && it->second.status.state != XferState::kInProgress) return it->second.status;
      return TimedOut(fmt::format("transfer {} still in progress after {} ms (outcome unknown)", xfer,
                                  std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
  }
}

Status TransportBase::abort(XferId xfer) {
  PeerId peer = 0;
  std::string notification;
  {
    std::lock_guard lock(mu_);
    auto it = xfers_.find(xfer);
    if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", xfer));
    if (it->second.status.state != XferState::kInProgress) return Status::Ok();
    it->second.status.state = XferState::kFailed;
    it->second.status.error = Aborted(fmt::format("transfer {} was aborted", xfer));
    peer = it->second.peer;
    notification = it->second.notification;
    cv_.notify_all();
  }
  backend_abort(xfer);
  return backend_send(peer, NotifKind::kAborted, std::move(notification));
}

Status TransportBase::release(XferId xfer) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(xfer);
  if (it == xfers_.end()) return NotFound(fmt::format("transfer {} is unknown", xfer));
  const XferStatus& st = it->second.status;
  if (st.state == XferState::kInProgress || !st.quiescent)
    return FailedPrecondition(fmt::format("transfer {} is {}{}: not quiescent", xfer, xfer_state_name(st.state),
                                          st.quiescent ? "" : " with requests in the backend"));
  xfers_.erase(it);
  return Status::Ok();
}

Status TransportBase::disconnect_peer(PeerId peer) {
  std::vector<XferId> cancel;
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
    PeerRec& p = peers_[peer];
    if (p.disconnected) return Status::Ok();
    p.disconnected = true;
    p.failed = Unavailable(fmt::format("peer '{}' was disconnected by this agent", p.info.identity.name));
    p.failed.ignore_error();  // the peer's state: a call that meets it returns a copy to look at
    // The peer may come back as a fresh process: its name is free for a new load_peer.
    p.info.identity.name += " (disconnected)";
    for (auto& [id, x] : xfers_) {
      if (x.peer != peer || x.status.state != XferState::kInProgress) continue;
      x.status.state = XferState::kFailed;
      x.status.error = Aborted(fmt::format("transfer {}: peer was disconnected", id));
      cancel.push_back(id);
    }
    cv_.notify_all();
  }
  for (XferId id : cancel) backend_abort(id);
  const bool revoked = backend_disconnect(peer);
  std::lock_guard lock(mu_);
  peers_[peer].revoked = revoked;
  return Status::Ok();
}

bool TransportBase::peer_revoked(PeerId peer) const {
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size() || !peers_[peer].disconnected) return false;
    if (peers_[peer].revoked) return true;
  }
  return backend_revoked(peer);
}

Status TransportBase::send_notification(PeerId peer, std::string message) {
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
    if (!peers_[peer].failed.ok()) return peers_[peer].failed;
  }
  return backend_send(peer, NotifKind::kMessage, std::move(message));
}

Status TransportBase::send_urgent_notification(PeerId peer, std::string message) {
  {
    std::lock_guard lock(mu_);
    if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not loaded ({} peers)", peer, peers_.size()));
    if (!peers_[peer].failed.ok()) return peers_[peer].failed;
  }
  return backend_send_urgent(peer, std::move(message));
}

std::vector<Notification> TransportBase::take_notifications() {
  std::lock_guard lock(mu_);
  std::vector<Notification> out(std::make_move_iterator(inbox_.begin()), std::make_move_iterator(inbox_.end()));
  inbox_.clear();
  return out;
}

Result<std::vector<Notification>> TransportBase::wait_notifications(std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return !inbox_.empty() || wake_waiter_; }))
    return TimedOut(fmt::format("no notification within {} ms",
                                std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
  wake_waiter_ = false;
  std::vector<Notification> out(std::make_move_iterator(inbox_.begin()), std::make_move_iterator(inbox_.end()));
  inbox_.clear();
  return out;
}

void TransportBase::wake_notification_waiter() {
  {
    std::lock_guard lock(mu_);
    wake_waiter_ = true;
  }
  cv_.notify_all();
}

void TransportBase::finish_xfer(XferId id, Status status) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(id);
  XferStatus* st_or_null = it == xfers_.end() ? nullptr : &it->second.status;
  if (st_or_null == nullptr || st_or_null->state != XferState::kInProgress) {
    status.ignore_error();  // released, or aborted meanwhile: the transfer keeps the outcome it already has
    return;
  }
  XferStatus& st = *st_or_null;
  st.state = status.ok() ? XferState::kDone : XferState::kFailed;
  st.error = std::move(status);
  cv_.notify_all();
}

void TransportBase::set_quiescent(XferId id) {
  std::lock_guard lock(mu_);
  auto it = xfers_.find(id);
  if (it == xfers_.end() || it->second.status.quiescent) return;
  XferStatus& st = it->second.status;
  if (st.state == XferState::kInProgress) {
    // Requests are gone but no outcome was reported: fail closed.
    st.state = XferState::kFailed;
    st.error = Internal(fmt::format("transfer {} ended without an outcome", id));
  }
  st.quiescent = true;
  for (RegionId r : it->second.regions) --regions_[r].users;
  cv_.notify_all();
}

void TransportBase::deliver(Notification n) {
  std::lock_guard lock(mu_);
  inbox_.push_back(std::move(n));
  cv_.notify_all();
}

void TransportBase::mark_peer_failed(PeerId peer, Status why) {
  std::lock_guard lock(mu_);
  why.ignore_error();  // kept as the peer's state below when it is its first failure; a later one goes here
  if (peer < peers_.size() && peers_[peer].failed.ok()) {
    peers_[peer].failed = std::move(why);
    peers_[peer].failed.ignore_error();  // the peer's state: a call that meets it returns a copy to look at
  }
}

bool TransportBase::covers(const void* p, std::uint64_t bytes) const {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  for (const auto& r : regions_) {
    if (!r.live) continue;
    const auto rlo = reinterpret_cast<std::uintptr_t>(r.region.base);
    if (lo >= rlo && lo - rlo <= r.region.bytes && bytes <= r.region.bytes - (lo - rlo)) return true;
  }
  return false;
}

bool TransportBase::wait_all_quiescent(std::chrono::nanoseconds timeout) {
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mu_);
  return cv_.wait_until(lock, deadline, [&] {
    for (const auto& [id, x] : xfers_)
      if (!x.status.quiescent) return false;
    return true;
  });
}

}  // namespace detail
}  // namespace kvtier::transport
