// Self-describing block object format shared by every storage backend.
//
//   offset size  field (little-endian)
//   0      8     magic "KVTOBJ\0\1"
//   8      2     format version (1)
//   10     2     flags (0)
//   12     4     header size: payload starts here (fixed part + roles table, zero padded to the
//                backend's alignment: 4096 on disk for O_DIRECT, 8 in Redis)
//   16     8     namespace digest (xxh3-64 of StorageOptions::ns)
//   24     8     layout fingerprint (KvLayout::fingerprint(), 0 for opaque payloads)
//   32     16    block key digest
//   48     4     tensor-parallel rank
//   52     4     number of roles
//   56     8     payload bytes
//   64     8     header checksum: xxh3-64 of [0, header size) with this field zeroed
//   72     8     object checksum: xxh3-64 of [0, header size) with both checksum fields zeroed,
//                followed by the payload
//   80     24*n  roles table {u16 layer, u8 role, u8 dtype, u32 0, u64 offset, u64 bytes}
//   ...          zero padding up to header size, then the page-first payload
//
// A reader checks the header alone (decode_header: magic, version, sizes, header checksum) when it
// indexes objects, the identity (namespace, layout, key) and the object checksum before it reports
// a get as OK. Any failure is kDataLoss: the object is quarantined and the get counts as a miss.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvtier/core/layout.h"
#include "kvtier/core/status.h"
#include "kvtier/storage/storage_backend.h"

namespace kvtier::storage::format {

inline constexpr std::uint64_t kMagic = 0x01004a424f54564bULL;  // "KVTOBJ\0\1" little-endian
inline constexpr std::uint16_t kFormatVersion = 1;
inline constexpr std::uint32_t kFixedHeaderBytes = 80;
inline constexpr std::uint32_t kRoleEntryBytes = 24;
inline constexpr std::uint32_t kMaxRoles = 1u << 16;
// Limits every reader enforces before it trusts a size field: the largest header a roles table
// below kMaxRoles needs (aligned to the disk's 4096), and the largest payload any backend stores
// (the disk tier's 1 TiB; Redis values stop at 512 MiB). With both bounded, header + payload
// cannot wrap.
inline constexpr std::uint32_t kMaxHeaderBytes =
    (kFixedHeaderBytes + kRoleEntryBytes * (kMaxRoles - 1) + 4095) / 4096 * 4096;
inline constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{1} << 40;

struct ObjectHeader {
  std::uint16_t version = 0;
  std::uint32_t header_size = 0;
  std::uint64_t ns_digest = 0;
  std::uint64_t layout_fingerprint = 0;
  StorageKey key;
  std::vector<ObjectSchemaRole> roles;
  std::uint64_t payload_bytes = 0;
  std::uint64_t header_checksum = 0;
  std::uint64_t checksum = 0;
};

std::uint64_t namespace_digest(std::string_view ns) noexcept;

// Header bytes for `options`, rounded up to `alignment` (>= 8, a power of two).
std::uint32_t header_bytes(const StorageOptions& options, std::uint32_t alignment) noexcept;

// Checks that a payload of `payload_bytes` fits the roles table of `options`.
Status check_payload_size(const StorageOptions& options, std::uint64_t payload_bytes);

// Writes the header of an object holding `payload` into out[0, header_size), checksums included.
// `header_size` must be >= header_bytes(options, 8) and a multiple of 8.
Status encode_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out);

// Parses and checks the header alone. `avail` bytes are readable at `data`; when the header is
// longer than that, returns kOutOfRange with the needed size in the message and sets *needed.
// Every size field is bounded (kMaxHeaderBytes, kMaxPayloadBytes, roles inside the payload)
// before anything is allocated or read by it.
Result<ObjectHeader> decode_header(const std::byte* data, std::size_t avail, std::uint32_t* needed = nullptr);

// The object's header and payload fit in `stored_bytes` (the value's length in Redis, `exact`;
// the file's size on disk, which may be longer: recycled files keep their old length).
// Overflow-safe; kDataLoss naming the sizes otherwise.
Status check_object_size(const ObjectHeader& header, std::uint64_t stored_bytes, bool exact);

// Identity: the object belongs to this namespace, layout and key.
Status check_identity(const ObjectHeader& header, std::uint64_t ns_digest, std::uint64_t layout_fingerprint,
                      const StorageKey& key);

// Verifies the object checksum over header bytes and payload.
Status verify_object(const std::byte* header_bytes, const ObjectHeader& header, const void* payload);

// The same check over a payload that arrives in pieces (the disk's index rebuild reads large
// objects through a fixed buffer instead of allocating the payload's size).
class ObjectVerifier {
 public:
  ObjectVerifier(const std::byte* header_bytes, const ObjectHeader& header);
  ObjectVerifier(const ObjectVerifier&) = delete;
  ObjectVerifier& operator=(const ObjectVerifier&) = delete;
  ~ObjectVerifier();
  void update(const void* data, std::size_t bytes);
  // kDataLoss unless exactly header.payload_bytes were passed and the checksum matches.
  Status finish();

 private:
  const ObjectHeader& header_;
  std::uint64_t seen_ = 0;
  void* state_ = nullptr;  // XXH3_state_t
};

// Page-first roles table of a layout, matching BlockSpace::page_first(page_alignment, role_alignment).
std::vector<ObjectSchemaRole> roles_from_layout(const KvLayout& layout, std::uint64_t role_alignment = 1);
StorageOptions options_for_layout(std::string ns, const KvLayout& layout, std::uint64_t role_alignment = 1);

}  // namespace kvtier::storage::format
