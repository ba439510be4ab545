// Self-describing block object format shared by every storage backend. Two versions, chosen by
// whether the backend has a tenant secret (StorageOptions::tenant_secret):
//
// Version 1, unkeyed (no secret): integrity against damage, fast (xxh3), no authenticity.
//   offset size  field (little-endian)
//   0      8     magic "KVTOBJ\0\1"
//   8      2     format version (1)
//   10     2     flags (0; 2 = kFlagChunked: the object checksum is over the payload's piece digests, below)
//   12     4     header size: payload starts here (fixed part + roles table, zero padded to the
//                backend's alignment: 4096 on disk for O_DIRECT, 8 in Redis)
//   16     8     namespace digest (namespace_digest(StorageOptions): xxh3-64 of ns, and of the
//                tenant id when one is set)
//   24     8     layout fingerprint (KvLayout::fingerprint(), 0 for opaque payloads)
//   32     16    block key digest
//   48     4     tensor-parallel rank
//   52     4     number of roles
//   56     8     payload bytes
//   64     8     header checksum: xxh3-64 of [0, header size) with this field zeroed
//   72     8     object checksum: xxh3-64 of [0, header size) with both checksum fields zeroed,
//                followed by the payload (chunked: by the payload's piece digests)
//   80     24*n  roles table {u16 layer, u8 role, u8 dtype, u32 0, u64 offset, u64 bytes}
//   ...          zero padding up to header size, then the page-first payload
//
// Version 2, keyed (a tenant secret of 32..64 bytes): header and payload authenticated with
// libsodium. The header tag is keyed BLAKE2b-256 (crypto_generichash with the secret as key,
// personalisation "kvtier-hdr-v2") of the canonical header: the header with [64, 72) and
// [96, 144) zeroed. The payload tag is Poly1305 (crypto_onetimeauth, incremental) under a
// one-time key = keyed BLAKE2b-256 ("kvtier-otk-v2") of the same canonical header, which holds a
// random 16-byte nonce per written object, the sizes and the identity: the key is never reused
// and the payload is bound to its header (the construction of NaCl's secretbox, with BLAKE2b as
// the key derivation). Poly1305 rather than BLAKE2b or HMAC over the payload for speed: 3.2 GB/s
// against 0.82 (keyed BLAKE2b), 0.45 (HMAC-SHA-512-256) and 0.22 (HMAC-SHA-256) on the 2-vCPU
// EPYC VM of docs/performance.md; the per-object BLAKE2b over a 4 KiB header is microseconds.
//   0..63        as version 1, with version 2 and flags bit 0 (kFlagKeyed) set
//   64     8     header checksum: xxh3-64 of the canonical header (tells damage from forgery;
//                authenticates nothing)
//   72     8     zero (reserved)
//   80     16    nonce (random per written object)
//   96     32    header tag
//   128    16    payload tag
//   144    24*n  roles table, padding and payload as in version 1
//
// A reader checks the header alone (decode_header: magic, version, flags, sizes, header checksum,
// and with a secret the header tag) when it indexes objects, the identity (namespace, layout,
// key) and the object checksum or tag before it reports a get as OK. Any failure is kDataLoss:
// the object is quarantined and the get counts as a miss. A keyed reader refuses version 1 and
// an unkeyed reader refuses version 2 (kDataLoss, never a misparse). Failures of the keyed
// checks and refusals of the other version are authentication failures (is_auth_failure; the
// backends count them in StorageStats::auth_failures): a foreign tenant's object, a forged or
// unkeyed one, or a keyed payload damaged on the medium (a tag cannot tell damage from forgery).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/xxh3.h"
#include "kvtier/backend/storage_backend.h"
#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"

namespace kvtier::storage::format {

inline constexpr std::uint64_t kMagic = 0x01004a424f54564bULL;  // "KVTOBJ\0\1" little-endian
inline constexpr std::uint16_t kFormatVersion = 1;              // unkeyed
inline constexpr std::uint16_t kKeyedFormatVersion = 2;         // keyed
inline constexpr std::uint16_t kFlagKeyed = 1;
inline constexpr std::uint16_t kFlagChunked = 2;              // version 1: chunked checksum (below)
inline constexpr std::uint32_t kFixedHeaderBytes = 80;        // version 1
inline constexpr std::uint32_t kKeyedFixedHeaderBytes = 144;  // version 2
inline constexpr std::size_t kHeaderTagBytes = 32;
inline constexpr std::size_t kPayloadTagBytes = 16;
// Tenant secrets: BLAKE2b keys of 32 (its security level) to 64 bytes (its maximum).
inline constexpr std::size_t kMinSecretBytes = 32;
inline constexpr std::size_t kMaxSecretBytes = 64;
inline constexpr std::size_t kMaxTenantIdBytes = 64;
inline constexpr std::uint32_t kRoleEntryBytes = 24;
inline constexpr std::uint32_t kMaxRoles = 1u << 16;
// Limits every reader enforces before it trusts a size field: the largest header a roles table
// below kMaxRoles needs (aligned to the disk's 4096), and the largest payload any backend stores
// (the disk tier's 1 TiB; Redis values stop at 512 MiB). With both bounded, header + payload
// cannot wrap.
inline constexpr std::uint32_t kMaxHeaderBytes =
    (kFixedHeaderBytes + kRoleEntryBytes * (kMaxRoles - 1) + 4095) / 4096 * 4096;
inline constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{1} << 40;
static_assert(kKeyedFixedHeaderBytes + std::uint64_t{kRoleEntryBytes} * (kMaxRoles - 1) <= kMaxHeaderBytes);

struct ObjectHeader {
  std::uint16_t version = 0;
  bool keyed = false;  // version 2
  std::uint32_t header_size = 0;
  std::uint64_t ns_digest = 0;
  std::uint64_t layout_fingerprint = 0;
  StorageKey key;
  std::vector<ObjectSchemaRole> roles;
  std::uint64_t payload_bytes = 0;
  std::uint64_t header_checksum = 0;
  std::uint64_t checksum = 0;                                // version 1
  bool chunked = false;                                      // version 1, flags bit 1 (kFlagChunked)
  std::array<std::uint8_t, kPayloadTagBytes> payload_tag{};  // version 2
};

// Digest of a namespace without a tenant (what version-1 stores of earlier builds used).
std::uint64_t namespace_digest(std::string_view ns) noexcept;
// The backend's namespace digest: namespace_digest(ns) without a tenant; with one, a digest of
// both, so tenants of one model never share a namespace even without a secret.
std::uint64_t namespace_digest(const StorageOptions& options) noexcept;

// Checks the tenant fields of `options`: the id is at most kMaxTenantIdBytes of [A-Za-z0-9_-]
// (it names a directory and a Redis key prefix), the secret empty or kMinSecretBytes..
// kMaxSecretBytes long. InvalidArgument naming the field otherwise.
Status check_tenant_options(const StorageOptions& options);

// Hex name of a stored object for key-value stores whose key names others may list (Redis
// SCAN): keyed BLAKE2b-128 ("kvtier-name-v2") of tenant, ns, layout fingerprint and key, so the
// name reveals nothing about the namespace or the block. Requires a secret.
std::string keyed_object_name(const StorageOptions& options, const StorageKey& key);

// An authentication failure from this file's checks (see the format comment above).
bool is_auth_failure(const Status& status) noexcept;

// Header bytes for `options` (version 2 when it has a secret), rounded up to `alignment` (>= 8, a power of two).
std::uint32_t header_bytes(const StorageOptions& options, std::uint32_t alignment) noexcept;

// Checks that a payload of `payload_bytes` fits the roles table of `options`.
Status check_payload_size(const StorageOptions& options, std::uint64_t payload_bytes);

// Writes the header of an object holding `payload` into out[0, header_size), checksums included
// (version 2 with its tags when options.tenant_secret is set).
// `header_size` must be >= header_bytes(options, 8) and a multiple of 8.
Status encode_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out);

// The whole object in one pass: the header into out[0, header_size) as encode_header writes it, and the
// payload copied to out + header_size, each chunk checksummed (or authenticated) right after its copy, from the
// caches. `out` holds header_size + payload_bytes bytes.
Status encode_object(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out);

// Chunked checksums (version 1 with flags bit 1, kFlagChunked; unkeyed only): the object checksum is xxh3-64 of the
// header with both checksum fields zeroed, followed by the xxh3-64 digests (8 bytes little-endian each) of the
// payload's pieces of kChecksumChunkBytes (the last one shorter), so the pieces of one object can be copied and
// hashed on several threads. Readers of this format version verify both kinds; builds before it refuse the flag
// (kDataLoss: a miss, never a misparse).
inline constexpr std::uint64_t kChecksumChunkBytes = std::uint64_t{1} << 20;
std::uint64_t num_checksum_chunks(std::uint64_t payload_bytes) noexcept;
std::uint64_t chunk_digest(const void* data, std::uint64_t bytes) noexcept;
// The header of a chunked object whose payload pieces have `digests` (num_checksum_chunks of them).
// InvalidArgument for a keyed `options` or a wrong number of digests.
Status encode_chunked_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key,
                             std::uint64_t payload_bytes, std::span<const std::uint64_t> digests,
                             std::uint32_t header_size, std::byte* out);
// A chunked object's checksum from its pieces' digests (kDataLoss when they do not match, or for an object that is
// not chunked).
Status verify_chunked(const std::byte* header_bytes, const ObjectHeader& header,
                      std::span<const std::uint64_t> digests);

// Parses and checks the header alone. `avail` bytes are readable at `data`; when the header is
// longer than that, returns kOutOfRange with the needed size in the message and sets *needed.
// Every size field is bounded (kMaxHeaderBytes, kMaxPayloadBytes, roles inside the payload)
// before anything is allocated or read by it. `secret`: the reader's tenant secret (empty: an
// unkeyed reader); a keyed reader verifies the header tag here.
Result<ObjectHeader> decode_header(const std::byte* data, std::size_t avail, std::uint32_t* needed = nullptr,
                                   std::string_view secret = {});

// The object's header and payload fit in `stored_bytes` (the value's length in Redis, `exact`;
// the file's size on disk, which may be longer: recycled files keep their old length).
// Overflow-safe; kDataLoss naming the sizes otherwise.
Status check_object_size(const ObjectHeader& header, std::uint64_t stored_bytes, bool exact);

// Identity: the object belongs to this namespace, layout and key.
Status check_identity(const ObjectHeader& header, std::uint64_t ns_digest, std::uint64_t layout_fingerprint,
                      const StorageKey& key);

// Verifies the object checksum (version 1) or tag (version 2, with `secret`) over header bytes
// and payload. `header` comes from decode_header with the same secret.
Status verify_object(const std::byte* header_bytes, const ObjectHeader& header, const void* payload,
                     std::string_view secret = {});

// The same check over a payload that arrives in pieces (the disk's index rebuild reads large
// objects through a fixed buffer instead of allocating the payload's size).
class ObjectVerifier {
 public:
  ObjectVerifier(const std::byte* header_bytes, const ObjectHeader& header, std::string_view secret = {});
  ObjectVerifier(const ObjectVerifier&) = delete;
  ObjectVerifier& operator=(const ObjectVerifier&) = delete;
  ~ObjectVerifier();
  void update(const void* data, std::size_t bytes);
  // kDataLoss unless exactly header.payload_bytes were passed and the checksum or tag matches.
  Status finish();

 private:
  const ObjectHeader& header_;
  std::uint64_t seen_ = 0;
  std::unique_ptr<kvtier::detail::Xxh3> state_;        // version 1
  void* mac_state_ = nullptr;                          // crypto_onetimeauth_state (version 2)
  std::unique_ptr<kvtier::detail::Xxh3> piece_state_;  // of the current piece (chunked)
  std::uint64_t piece_seen_ = 0;
  void end_piece();
  Status error_;  // a keyed object met without a secret
};

// Page-first roles table of a layout, matching BlockSpace::page_first(page_alignment, role_alignment).
std::vector<ObjectSchemaRole> roles_from_layout(const KvLayout& layout, std::uint64_t role_alignment = 1);
StorageOptions options_for_layout(std::string ns, const KvLayout& layout, std::uint64_t role_alignment = 1);

}  // namespace kvtier::storage::format
