#include "storage/object_format.h"

#include <fmt/format.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <cstring>

namespace kvtier::storage::format {
namespace {

template <typename T>
void put_le(std::byte* p, T v) {
  static_assert(std::is_unsigned_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
template <typename T>
T get_le(const std::byte* p) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

constexpr std::size_t kOffMagic = 0, kOffVersion = 8, kOffFlags = 10, kOffHeaderSize = 12, kOffNs = 16, kOffLayout = 24,
                      kOffKey = 32, kOffRank = 48, kOffNumRoles = 52, kOffPayload = 56, kOffHeaderChecksum = 64,
                      kOffChecksum = 72;

std::uint64_t raw_header_bytes(std::size_t num_roles) {
  return kFixedHeaderBytes + std::uint64_t{kRoleEntryBytes} * num_roles;
}

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Hash of the header with both checksum fields zeroed (the payload follows).
void object_checksum_header(XXH3_state_t* state, const std::byte* header, std::uint32_t header_size) {
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, header, kOffHeaderChecksum);
  static constexpr std::byte kZeros[16] = {};
  XXH3_64bits_update(state, kZeros, 16);
  XXH3_64bits_update(state, header + kOffChecksum + 8, header_size - (kOffChecksum + 8));
}

std::uint64_t object_checksum(const std::byte* header, std::uint32_t header_size, const void* payload,
                              std::uint64_t payload_bytes) {
  XXH3_state_t state;
  object_checksum_header(&state, header, header_size);
  if (payload_bytes > 0) XXH3_64bits_update(&state, payload, payload_bytes);
  return XXH3_64bits_digest(&state);
}

std::uint64_t header_checksum(const std::byte* header, std::uint32_t header_size) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, header, kOffHeaderChecksum);
  static constexpr std::byte kZeros[8] = {};
  XXH3_64bits_update(&state, kZeros, 8);
  XXH3_64bits_update(&state, header + kOffChecksum, header_size - kOffChecksum);
  return XXH3_64bits_digest(&state);
}

}  // namespace

std::uint64_t namespace_digest(std::string_view ns) noexcept { return XXH3_64bits(ns.data(), ns.size()); }

std::uint32_t header_bytes(const StorageOptions& options, std::uint32_t alignment) noexcept {
  if (alignment < 8) alignment = 8;
  return static_cast<std::uint32_t>(align_up(raw_header_bytes(options.roles.size()), alignment));
}

Status check_payload_size(const StorageOptions& options, std::uint64_t payload_bytes) {
  std::uint64_t end = 0;
  for (const auto& r : options.roles) end = std::max(end, r.offset + r.bytes);
  if (payload_bytes < end)
    return InvalidArgument(
        fmt::format("payload of {} bytes is smaller than the roles table needs ({} bytes)", payload_bytes, end));
  return Status::Ok();
}

Status encode_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out) {
  if (options.roles.size() >= kMaxRoles)
    return InvalidArgument(fmt::format("roles table of {} entries >= {}", options.roles.size(), kMaxRoles));
  if (header_size < raw_header_bytes(options.roles.size()) || header_size % 8 != 0)
    return InvalidArgument(
        fmt::format("header size {} < {} or not a multiple of 8", header_size, raw_header_bytes(options.roles.size())));
  std::memset(out, 0, header_size);
  put_le<std::uint64_t>(out + kOffMagic, kMagic);
  put_le<std::uint16_t>(out + kOffVersion, kFormatVersion);
  put_le<std::uint16_t>(out + kOffFlags, 0);
  put_le<std::uint32_t>(out + kOffHeaderSize, header_size);
  put_le<std::uint64_t>(out + kOffNs, ns_digest);
  put_le<std::uint64_t>(out + kOffLayout, options.layout_fingerprint);
  std::memcpy(out + kOffKey, key.digest.data(), 16);
  put_le<std::uint32_t>(out + kOffRank, key.rank);
  put_le<std::uint32_t>(out + kOffNumRoles, static_cast<std::uint32_t>(options.roles.size()));
  put_le<std::uint64_t>(out + kOffPayload, payload_bytes);
  std::byte* e = out + kFixedHeaderBytes;
  for (const auto& r : options.roles) {
    put_le<std::uint16_t>(e, r.layer);
    e[2] = static_cast<std::byte>(r.role);
    e[3] = static_cast<std::byte>(r.dtype);
    put_le<std::uint64_t>(e + 8, r.offset);
    put_le<std::uint64_t>(e + 16, r.bytes);
    e += kRoleEntryBytes;
  }
  put_le<std::uint64_t>(out + kOffChecksum, object_checksum(out, header_size, payload, payload_bytes));
  put_le<std::uint64_t>(out + kOffHeaderChecksum, header_checksum(out, header_size));
  return Status::Ok();
}

Result<ObjectHeader> decode_header(const std::byte* data, std::size_t avail, std::uint32_t* needed) {
  if (avail < kFixedHeaderBytes)
    return DataLoss(fmt::format("object of {} bytes is shorter than the {}-byte header", avail, kFixedHeaderBytes));
  const std::uint64_t magic = get_le<std::uint64_t>(data + kOffMagic);
  if (magic != kMagic) return DataLoss(fmt::format("bad magic {:#018x}", magic));
  ObjectHeader h;
  h.version = get_le<std::uint16_t>(data + kOffVersion);
  if (h.version != kFormatVersion)
    return DataLoss(fmt::format("format version {} (this build reads {})", h.version, kFormatVersion));
  const std::uint16_t flags = get_le<std::uint16_t>(data + kOffFlags);
  if (flags != 0) return DataLoss(fmt::format("header flags {:#06x} (this version writes 0)", flags));
  h.header_size = get_le<std::uint32_t>(data + kOffHeaderSize);
  const std::uint32_t num_roles = get_le<std::uint32_t>(data + kOffNumRoles);
  if (num_roles >= kMaxRoles || h.header_size < raw_header_bytes(num_roles) || h.header_size % 8 != 0 ||
      h.header_size > kMaxHeaderBytes)
    return DataLoss(fmt::format("header size {} inconsistent with {} roles (limit {} bytes)", h.header_size, num_roles,
                                kMaxHeaderBytes));
  if (needed) *needed = h.header_size;
  if (avail < h.header_size)
    return OutOfRange(fmt::format("header needs {} bytes, {} available", h.header_size, avail));
  h.header_checksum = get_le<std::uint64_t>(data + kOffHeaderChecksum);
  const std::uint64_t hc = header_checksum(data, h.header_size);
  if (hc != h.header_checksum)
    return DataLoss(fmt::format("header checksum {:#018x} != stored {:#018x}", hc, h.header_checksum));
  h.ns_digest = get_le<std::uint64_t>(data + kOffNs);
  h.layout_fingerprint = get_le<std::uint64_t>(data + kOffLayout);
  std::memcpy(h.key.digest.data(), data + kOffKey, 16);
  h.key.rank = get_le<std::uint32_t>(data + kOffRank);
  h.payload_bytes = get_le<std::uint64_t>(data + kOffPayload);
  if (h.payload_bytes > kMaxPayloadBytes)
    return DataLoss(
        fmt::format("payload size {} exceeds the format's limit of {} bytes", h.payload_bytes, kMaxPayloadBytes));
  h.checksum = get_le<std::uint64_t>(data + kOffChecksum);
  h.roles.resize(num_roles);
  const std::byte* e = data + kFixedHeaderBytes;
  for (auto& r : h.roles) {
    r.layer = get_le<std::uint16_t>(e);
    r.role = static_cast<std::uint8_t>(e[2]);
    r.dtype = static_cast<std::uint8_t>(e[3]);
    if (const std::uint32_t reserved = get_le<std::uint32_t>(e + 4); reserved != 0)
      return DataLoss(
          fmt::format("role entry {} has reserved word {:#x} (this version writes 0)", &r - h.roles.data(), reserved));
    r.offset = get_le<std::uint64_t>(e + 8);
    r.bytes = get_le<std::uint64_t>(e + 16);
    if (r.offset + r.bytes > h.payload_bytes || r.offset + r.bytes < r.offset)
      return DataLoss(fmt::format("role at offset {} of {} bytes exceeds the payload of {} bytes", r.offset, r.bytes,
                                  h.payload_bytes));
    e += kRoleEntryBytes;
  }
  // The padding up to header_size is zero as written: anything else is not this version's object.
  for (std::size_t i = raw_header_bytes(num_roles); i < h.header_size; ++i)
    if (data[i] != std::byte{0}) return DataLoss(fmt::format("non-zero header padding at offset {}", i));
  return h;
}

Status check_object_size(const ObjectHeader& header, std::uint64_t stored_bytes, bool exact) {
  // decode_header bounds both sizes, so their sum cannot wrap; checked without the sum anyway, as
  // callers may pass a header they filled themselves.
  const bool fits = header.header_size <= stored_bytes && header.payload_bytes <= stored_bytes - header.header_size;
  if (!fits || (exact && header.payload_bytes != stored_bytes - header.header_size))
    return DataLoss(fmt::format("object of {} bytes {} header {} + payload {}", stored_bytes,
                                exact ? "does not equal" : "is shorter than", header.header_size,
                                header.payload_bytes));
  return Status::Ok();
}

Status check_identity(const ObjectHeader& header, std::uint64_t ns_digest, std::uint64_t layout_fingerprint,
                      const StorageKey& key) {
  if (header.ns_digest != ns_digest)
    return DataLoss(fmt::format("object of key {} has namespace digest {:#018x}, expected {:#018x}", key.to_string(),
                                header.ns_digest, ns_digest));
  if (header.layout_fingerprint != layout_fingerprint)
    return DataLoss(fmt::format("object of key {} has layout fingerprint {:#018x}, expected {:#018x}", key.to_string(),
                                header.layout_fingerprint, layout_fingerprint));
  if (!(header.key == key))
    return DataLoss(fmt::format("object stored under key {} holds key {}", key.to_string(), header.key.to_string()));
  return Status::Ok();
}

Status verify_object(const std::byte* header_bytes, const ObjectHeader& header, const void* payload) {
  const std::uint64_t c = object_checksum(header_bytes, header.header_size, payload, header.payload_bytes);
  if (c != header.checksum)
    return DataLoss(fmt::format("checksum {:#018x} != stored {:#018x} for key {} ({} payload bytes)", c,
                                header.checksum, header.key.to_string(), header.payload_bytes));
  return Status::Ok();
}

ObjectVerifier::ObjectVerifier(const std::byte* header_bytes, const ObjectHeader& header) : header_(header) {
  auto* st = new XXH3_state_t;
  object_checksum_header(st, header_bytes, header.header_size);
  state_ = st;
}

ObjectVerifier::~ObjectVerifier() { delete static_cast<XXH3_state_t*>(state_); }

void ObjectVerifier::update(const void* data, std::size_t bytes) {
  if (bytes == 0) return;
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
  seen_ += bytes;
}

Status ObjectVerifier::finish() {
  if (seen_ != header_.payload_bytes)
    return DataLoss(
        fmt::format("{} of {} payload bytes read for key {}", seen_, header_.payload_bytes, header_.key.to_string()));
  const std::uint64_t c = XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_));
  if (c != header_.checksum)
    return DataLoss(fmt::format("checksum {:#018x} != stored {:#018x} for key {} ({} payload bytes)", c,
                                header_.checksum, header_.key.to_string(), header_.payload_bytes));
  return Status::Ok();
}

std::vector<ObjectSchemaRole> roles_from_layout(const KvLayout& layout, std::uint64_t role_alignment) {
  std::vector<ObjectSchemaRole> roles;
  std::uint64_t offset = 0;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (std::uint32_t r = 0; r < layout.num_roles(l); ++r) {
      offset = align_up(offset, role_alignment == 0 ? 1 : role_alignment);
      const RoleLayout& rl = layout.layer(l).roles[r];
      roles.push_back({static_cast<std::uint16_t>(l), static_cast<std::uint8_t>(rl.role),
                       static_cast<std::uint8_t>(rl.dtype), offset, rl.block_bytes});
      offset += rl.block_bytes;
    }
  return roles;
}

StorageOptions options_for_layout(std::string ns, const KvLayout& layout, std::uint64_t role_alignment) {
  StorageOptions o;
  o.ns = std::move(ns);
  o.layout_fingerprint = layout.fingerprint();
  o.roles = roles_from_layout(layout, role_alignment);
  return o;
}

}  // namespace kvtier::storage::format
