#include "storage/object_format.h"

#include <fmt/format.h>
#include <sodium.h>

#include <algorithm>
#include <cstring>

#include "core/byte_codec.h"
#include "core/xxh3.h"

namespace kvtier::storage::format {
namespace {

// Every field little-endian at its fixed offset (core/byte_codec.h).
using codec::load_le;
using codec::store_le;
using kvtier::detail::Xxh3;
using kvtier::detail::xxh3_64;

constexpr std::size_t kOffMagic = 0, kOffVersion = 8, kOffFlags = 10, kOffHeaderSize = 12, kOffNs = 16, kOffLayout = 24,
                      kOffKey = 32, kOffRank = 48, kOffNumRoles = 52, kOffPayload = 56, kOffHeaderChecksum = 64,
                      kOffChecksum = 72, kOffReserved = 72, kOffNonce = 80, kOffHeaderTag = 96, kOffPayloadTag = 128;
static_assert(kOffPayloadTag + kPayloadTagBytes == kKeyedFixedHeaderBytes);
static_assert(kOffHeaderTag + kHeaderTagBytes == kOffPayloadTag);

// BLAKE2b personalisation (16 bytes each): the header tag, the one-time keys and the key names
// never collide across uses.
constexpr unsigned char kPersonalHeader[crypto_generichash_blake2b_PERSONALBYTES] = "kvtier-hdr-v2";
constexpr unsigned char kPersonalOneTimeKey[crypto_generichash_blake2b_PERSONALBYTES] = "kvtier-otk-v2";
constexpr unsigned char kPersonalName[crypto_generichash_blake2b_PERSONALBYTES] = "kvtier-name-v2";

constexpr std::string_view kAuthFailure = "authentication failed: ";

Status auth_failure(std::string what) { return DataLoss(fmt::format("{}{}", kAuthFailure, what)); }

// sodium_init picks the fastest implementations and seeds randombytes (thread-safe; once is enough).
bool ensure_sodium() {
  static const int rc = sodium_init();
  return rc >= 0;
}

// Feeds the canonical version-2 header: the header with its checksum and both tags zeroed (the
// nonce, the reserved word and everything else as stored).
template <typename Update>
void feed_canonical(const std::byte* header, std::uint32_t header_size, Update&& update) {
  static constexpr std::byte kZeros[kHeaderTagBytes + kPayloadTagBytes] = {};
  update(header, kOffHeaderChecksum);
  update(kZeros, 8);
  update(header + kOffReserved, kOffHeaderTag - kOffReserved);
  update(kZeros, kHeaderTagBytes + kPayloadTagBytes);
  update(header + kKeyedFixedHeaderBytes, header_size - kKeyedFixedHeaderBytes);
}

// Keyed BLAKE2b-256 of the canonical header under `personal`.
std::array<std::uint8_t, 32> keyed_header_hash(const std::byte* header, std::uint32_t header_size,
                                               std::string_view secret, const unsigned char* personal) {
  ensure_sodium();
  crypto_generichash_state st;
  crypto_generichash_blake2b_init_salt_personal(&st, reinterpret_cast<const unsigned char*>(secret.data()),
                                                secret.size(), 32, nullptr, personal);
  feed_canonical(header, header_size, [&](const void* p, std::size_t n) {
    crypto_generichash_update(&st, static_cast<const unsigned char*>(p), n);
  });
  std::array<std::uint8_t, 32> out{};
  crypto_generichash_final(&st, out.data(), out.size());
  sodium_memzero(&st, sizeof(st));
  return out;
}

// The payload's Poly1305 state under the object's one-time key (derived from the canonical
// header, whose random nonce makes it unique per written object).
void payload_mac_init(crypto_onetimeauth_state* st, const std::byte* header, std::uint32_t header_size,
                      std::string_view secret) {
  static_assert(crypto_onetimeauth_KEYBYTES == 32 && crypto_onetimeauth_BYTES == kPayloadTagBytes);
  auto otk = keyed_header_hash(header, header_size, secret, kPersonalOneTimeKey);
  crypto_onetimeauth_init(st, otk.data());
  sodium_memzero(otk.data(), otk.size());
}

std::uint32_t fixed_bytes(bool keyed) { return keyed ? kKeyedFixedHeaderBytes : kFixedHeaderBytes; }

std::uint64_t raw_header_bytes(std::size_t num_roles, bool keyed) {
  return fixed_bytes(keyed) + std::uint64_t{kRoleEntryBytes} * num_roles;
}

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Hash of the header with both checksum fields zeroed (the payload follows).
void object_checksum_header(Xxh3* state, const std::byte* header, std::uint32_t header_size) {
  state->reset();
  state->update(header, kOffHeaderChecksum);
  static constexpr std::byte kZeros[16] = {};
  state->update(kZeros, 16);
  state->update(header + kOffChecksum + 8, header_size - (kOffChecksum + 8));
}

std::uint64_t object_checksum(const std::byte* header, std::uint32_t header_size, const void* payload,
                              std::uint64_t payload_bytes) {
  Xxh3 state;
  object_checksum_header(&state, header, header_size);
  if (payload_bytes > 0) state.update(payload, payload_bytes);
  return state.digest();
}

std::uint64_t header_checksum(const std::byte* header, std::uint32_t header_size, bool keyed) {
  Xxh3 state;
  state.reset();
  if (keyed) {
    feed_canonical(header, header_size, [&](const void* p, std::size_t n) { state.update(p, n); });
    return state.digest();
  }
  state.update(header, kOffHeaderChecksum);
  static constexpr std::byte kZeros[8] = {};
  state.update(kZeros, 8);
  state.update(header + kOffChecksum, header_size - kOffChecksum);
  return state.digest();
}

bool valid_tenant_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

}  // namespace

std::uint64_t namespace_digest(std::string_view ns) noexcept { return xxh3_64(ns.data(), ns.size()); }

std::uint64_t namespace_digest(const StorageOptions& options) noexcept {
  if (options.tenant.empty()) return namespace_digest(options.ns);
  // Length-prefixed, so ("a", "bc") and ("ab", "c") differ.
  std::string m = fmt::format("tenant:{}:{}\n{}", options.tenant.size(), options.tenant, options.ns);
  return xxh3_64(m.data(), m.size());
}

Status check_tenant_options(const StorageOptions& options) {
  const std::string& t = options.tenant;
  if (t.size() > kMaxTenantIdBytes || !std::all_of(t.begin(), t.end(), valid_tenant_char))
    return InvalidArgument(
        fmt::format("StorageOptions::tenant '{}': at most {} characters of [A-Za-z0-9_-]", t, kMaxTenantIdBytes));
  const std::size_t n = options.tenant_secret.size();
  if (n != 0 && (n < kMinSecretBytes || n > kMaxSecretBytes))
    return InvalidArgument(
        fmt::format("StorageOptions::tenant_secret is {} bytes; a tenant secret needs {} to {} bytes", n,
                    kMinSecretBytes, kMaxSecretBytes));
  return Status::Ok();
}

std::string keyed_object_name(const StorageOptions& options, const StorageKey& key) {
  ensure_sodium();
  crypto_generichash_state st;
  crypto_generichash_blake2b_init_salt_personal(&st,
                                                reinterpret_cast<const unsigned char*>(options.tenant_secret.data()),
                                                options.tenant_secret.size(), 16, nullptr, kPersonalName);
  std::byte fixed[8 + 8 + 8 + 16 + 4];
  store_le<std::uint64_t>(fixed, options.tenant.size());
  store_le<std::uint64_t>(fixed + 8, options.ns.size());
  store_le<std::uint64_t>(fixed + 16, options.layout_fingerprint);
  std::memcpy(fixed + 24, key.digest.data(), 16);
  store_le<std::uint32_t>(fixed + 40, key.rank);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(fixed), sizeof(fixed));
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(options.tenant.data()), options.tenant.size());
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(options.ns.data()), options.ns.size());
  unsigned char name[16];
  crypto_generichash_final(&st, name, sizeof(name));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = kHex[name[i] >> 4];
    s[2 * i + 1] = kHex[name[i] & 15];
  }
  return s;
}

bool is_auth_failure(const Status& status) noexcept {
  return status.code() == StatusCode::kDataLoss && status.message().find(kAuthFailure) != std::string::npos;
}

std::uint32_t header_bytes(const StorageOptions& options, std::uint32_t alignment) noexcept {
  if (alignment < 8) alignment = 8;
  return static_cast<std::uint32_t>(
      align_up(raw_header_bytes(options.roles.size(), !options.tenant_secret.empty()), alignment));
}

Status check_payload_size(const StorageOptions& options, std::uint64_t payload_bytes) {
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < options.roles.size(); ++i) {
    const auto& r = options.roles[i];
    // A role whose end wraps around 2^64 passed here (its end read as small) and was written; every reader then
    // refused the object as corrupt and quarantined it: a put reported done whose block was lost.
    if (r.bytes > UINT64_MAX - r.offset)
      return InvalidArgument(fmt::format("roles[{}]: offset {} + {} bytes wraps around 2^64", i, r.offset, r.bytes));
    end = std::max(end, r.offset + r.bytes);
  }
  if (payload_bytes < end)
    return InvalidArgument(
        fmt::format("payload of {} bytes is smaller than the roles table needs ({} bytes)", payload_bytes, end));
  return Status::Ok();
}

namespace {

// Payload bytes hashed per step when the payload is copied as it is hashed: the copy's destination is hashed
// while it is still in the caches.
constexpr std::uint64_t kCopyChunk = 256 << 10;

// Feeds the payload to `update`; with `copy_to`, copies each chunk there first and feeds the copy.
template <typename Update>
void feed_payload(const void* payload, std::uint64_t payload_bytes, std::byte* copy_to, Update&& update) {
  if (payload_bytes == 0) return;
  if (copy_to == nullptr) {
    update(payload, payload_bytes);
    return;
  }
  const auto* src = static_cast<const std::byte*>(payload);
  for (std::uint64_t off = 0; off < payload_bytes; off += kCopyChunk) {
    const std::uint64_t n = std::min(kCopyChunk, payload_bytes - off);
    std::memcpy(copy_to + off, src + off, n);
    update(copy_to + off, n);
  }
}

Status encode(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
              std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out, std::byte* copy_to) {
  const std::string_view secret = options.tenant_secret;
  const bool keyed = !secret.empty();
  if (keyed && (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes))
    return InvalidArgument(
        fmt::format("StorageOptions::tenant_secret is {} bytes; a tenant secret needs {} to {} bytes", secret.size(),
                    kMinSecretBytes, kMaxSecretBytes));
  if (options.roles.size() >= kMaxRoles)
    return InvalidArgument(fmt::format("roles table of {} entries >= {}", options.roles.size(), kMaxRoles));
  if (header_size < raw_header_bytes(options.roles.size(), keyed) || header_size % 8 != 0)
    return InvalidArgument(fmt::format("header size {} < {} or not a multiple of 8", header_size,
                                       raw_header_bytes(options.roles.size(), keyed)));
  std::memset(out, 0, header_size);
  store_le<std::uint64_t>(out + kOffMagic, kMagic);
  store_le<std::uint16_t>(out + kOffVersion, keyed ? kKeyedFormatVersion : kFormatVersion);
  store_le<std::uint16_t>(out + kOffFlags, keyed ? kFlagKeyed : 0);
  store_le<std::uint32_t>(out + kOffHeaderSize, header_size);
  store_le<std::uint64_t>(out + kOffNs, ns_digest);
  store_le<std::uint64_t>(out + kOffLayout, options.layout_fingerprint);
  std::memcpy(out + kOffKey, key.digest.data(), 16);
  store_le<std::uint32_t>(out + kOffRank, key.rank);
  store_le<std::uint32_t>(out + kOffNumRoles, static_cast<std::uint32_t>(options.roles.size()));
  store_le<std::uint64_t>(out + kOffPayload, payload_bytes);
  std::byte* e = out + fixed_bytes(keyed);
  for (const auto& r : options.roles) {
    store_le<std::uint16_t>(e, r.layer);
    e[2] = static_cast<std::byte>(r.role);
    e[3] = static_cast<std::byte>(r.dtype);
    store_le<std::uint64_t>(e + 8, r.offset);
    store_le<std::uint64_t>(e + 16, r.bytes);
    e += kRoleEntryBytes;
  }
  if (!keyed) {
    Xxh3 state;
    object_checksum_header(&state, out, header_size);
    feed_payload(payload, payload_bytes, copy_to,
                 [&](const void* p, std::uint64_t n) { state.update(p, static_cast<std::size_t>(n)); });
    store_le<std::uint64_t>(out + kOffChecksum, state.digest());
    store_le<std::uint64_t>(out + kOffHeaderChecksum, header_checksum(out, header_size, false));
    return Status::Ok();
  }
  // A fresh nonce per written object: the payload's one-time key is never reused, even when the
  // same block is written again with other bytes.
  if (!ensure_sodium()) return Internal("sodium_init failed: no randomness for the object nonce");
  randombytes_buf(out + kOffNonce, 16);
  crypto_onetimeauth_state st;
  payload_mac_init(&st, out, header_size, secret);
  feed_payload(payload, payload_bytes, copy_to, [&](const void* p, std::uint64_t n) {
    crypto_onetimeauth_update(&st, static_cast<const unsigned char*>(p), n);
  });
  crypto_onetimeauth_final(&st, reinterpret_cast<unsigned char*>(out + kOffPayloadTag));
  sodium_memzero(&st, sizeof(st));
  const auto htag = keyed_header_hash(out, header_size, secret, kPersonalHeader);
  std::memcpy(out + kOffHeaderTag, htag.data(), kHeaderTagBytes);
  store_le<std::uint64_t>(out + kOffHeaderChecksum, header_checksum(out, header_size, true));
  return Status::Ok();
}

}  // namespace

Status encode_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out) {
  return encode(options, ns_digest, key, payload, payload_bytes, header_size, out, nullptr);
}

Status encode_object(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key, const void* payload,
                     std::uint64_t payload_bytes, std::uint32_t header_size, std::byte* out) {
  if (payload_bytes != 0 && payload == nullptr) return InvalidArgument("encode_object: no payload");
  return encode(options, ns_digest, key, payload, payload_bytes, header_size, out, out + header_size);
}

Result<ObjectHeader> decode_header(const std::byte* data, std::size_t avail, std::uint32_t* needed,
                                   std::string_view secret) {
  if (avail < kFixedHeaderBytes)
    return DataLoss(fmt::format("object of {} bytes is shorter than the {}-byte header", avail, kFixedHeaderBytes));
  const std::uint64_t magic = load_le<std::uint64_t>(data + kOffMagic);
  if (magic != kMagic) return DataLoss(fmt::format("bad magic {:#018x}", magic));
  ObjectHeader h;
  h.version = load_le<std::uint16_t>(data + kOffVersion);
  if (h.version != kFormatVersion && h.version != kKeyedFormatVersion)
    return DataLoss(
        fmt::format("format version {} (this build reads {} and {})", h.version, kFormatVersion, kKeyedFormatVersion));
  h.keyed = h.version == kKeyedFormatVersion;
  // The keying mode is refused before anything else is parsed: a reader never interprets the
  // other version's fields as its own.
  if (h.keyed && secret.empty())
    return auth_failure("keyed object (format version 2) and this reader has no tenant secret");
  if (!h.keyed && !secret.empty())
    return auth_failure("unkeyed object (format version 1) and this reader requires a tenant MAC");
  const std::uint16_t flags = load_le<std::uint16_t>(data + kOffFlags);
  const std::uint16_t want_flags = h.keyed ? kFlagKeyed : 0;
  h.chunked = !h.keyed && flags == kFlagChunked;
  if (flags != want_flags && !h.chunked)
    return DataLoss(fmt::format("header flags {:#06x} (version {} writes {:#06x}{})", flags, h.version, want_flags,
                                h.keyed ? "" : " or 0x0002"));
  const std::uint32_t fixed = fixed_bytes(h.keyed);
  if (avail < fixed)
    return DataLoss(fmt::format("object of {} bytes is shorter than the {}-byte header", avail, fixed));
  h.header_size = load_le<std::uint32_t>(data + kOffHeaderSize);
  const std::uint32_t num_roles = load_le<std::uint32_t>(data + kOffNumRoles);
  if (num_roles >= kMaxRoles || h.header_size < raw_header_bytes(num_roles, h.keyed) || h.header_size % 8 != 0 ||
      h.header_size > kMaxHeaderBytes)
    return DataLoss(fmt::format("header size {} inconsistent with {} roles (limit {} bytes)", h.header_size, num_roles,
                                kMaxHeaderBytes));
  if (needed) *needed = h.header_size;
  if (avail < h.header_size)
    return OutOfRange(fmt::format("header needs {} bytes, {} available", h.header_size, avail));
  h.header_checksum = load_le<std::uint64_t>(data + kOffHeaderChecksum);
  const std::uint64_t hc = header_checksum(data, h.header_size, h.keyed);
  if (hc != h.header_checksum)
    return DataLoss(fmt::format("header checksum {:#018x} != stored {:#018x}", hc, h.header_checksum));
  if (h.keyed) {
    if (load_le<std::uint64_t>(data + kOffReserved) != 0) return DataLoss("version-2 header: non-zero reserved word");
    const auto tag = keyed_header_hash(data, h.header_size, secret, kPersonalHeader);
    if (sodium_memcmp(tag.data(), data + kOffHeaderTag, kHeaderTagBytes) != 0)
      return auth_failure("header tag does not match this tenant's secret (foreign, forged or damaged object)");
    std::memcpy(h.payload_tag.data(), data + kOffPayloadTag, kPayloadTagBytes);
  } else {
    h.checksum = load_le<std::uint64_t>(data + kOffChecksum);
  }
  h.ns_digest = load_le<std::uint64_t>(data + kOffNs);
  h.layout_fingerprint = load_le<std::uint64_t>(data + kOffLayout);
  std::memcpy(h.key.digest.data(), data + kOffKey, 16);
  h.key.rank = load_le<std::uint32_t>(data + kOffRank);
  h.payload_bytes = load_le<std::uint64_t>(data + kOffPayload);
  if (h.payload_bytes > kMaxPayloadBytes)
    return DataLoss(
        fmt::format("payload size {} exceeds the format's limit of {} bytes", h.payload_bytes, kMaxPayloadBytes));
  h.roles.resize(num_roles);
  const std::byte* e = data + fixed;
  for (auto& r : h.roles) {
    r.layer = load_le<std::uint16_t>(e);
    r.role = static_cast<std::uint8_t>(e[2]);
    r.dtype = static_cast<std::uint8_t>(e[3]);
    if (const std::uint32_t reserved = load_le<std::uint32_t>(e + 4); reserved != 0)
      return DataLoss(
          fmt::format("role entry {} has reserved word {:#x} (this version writes 0)", &r - h.roles.data(), reserved));
    r.offset = load_le<std::uint64_t>(e + 8);
    r.bytes = load_le<std::uint64_t>(e + 16);
    if (r.offset + r.bytes > h.payload_bytes || r.offset + r.bytes < r.offset)
      return DataLoss(fmt::format("role at offset {} of {} bytes exceeds the payload of {} bytes", r.offset, r.bytes,
                                  h.payload_bytes));
    e += kRoleEntryBytes;
  }
  // The padding up to header_size is zero as written: anything else is not this version's object.
  for (std::size_t i = raw_header_bytes(num_roles, h.keyed); i < h.header_size; ++i)
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

Status verify_object(const std::byte* header_bytes, const ObjectHeader& header, const void* payload,
                     std::string_view secret) {
  if (!header.keyed && !header.chunked && secret.empty()) {  // the unkeyed fast path, without the verifier's state
    const std::uint64_t c = object_checksum(header_bytes, header.header_size, payload, header.payload_bytes);
    if (c != header.checksum)
      return DataLoss(fmt::format("checksum {:#018x} != stored {:#018x} for key {} ({} payload bytes)", c,
                                  header.checksum, header.key.to_string(), header.payload_bytes));
    return Status::Ok();
  }
  ObjectVerifier v(header_bytes, header, secret);
  v.update(payload, header.payload_bytes);
  return v.finish();
}

ObjectVerifier::ObjectVerifier(const std::byte* header_bytes, const ObjectHeader& header, std::string_view secret)
    : header_(header) {
  if (header.keyed) {
    if (secret.empty()) {
      error_ = auth_failure("keyed object (format version 2) and this reader has no tenant secret");
      return;
    }
    auto* st = new crypto_onetimeauth_state;
    payload_mac_init(st, header_bytes, header.header_size, secret);
    mac_state_ = st;
    return;
  }
  if (!secret.empty()) {
    error_ = auth_failure("unkeyed object (format version 1) and this reader requires a tenant MAC");
    return;
  }
  state_ = std::make_unique<Xxh3>();
  object_checksum_header(state_.get(), header_bytes, header.header_size);
  if (header.chunked) piece_state_ = std::make_unique<Xxh3>();
}

ObjectVerifier::~ObjectVerifier() {
  if (mac_state_ != nullptr) {
    auto* st = static_cast<crypto_onetimeauth_state*>(mac_state_);
    sodium_memzero(st, sizeof(*st));  // holds key material
    delete st;
  }
}

void ObjectVerifier::update(const void* data, std::size_t bytes) {
  if (bytes == 0) return;
  if (piece_state_ != nullptr) {  // chunked: each piece's digest goes into the object checksum
    Xxh3* piece = piece_state_.get();
    const auto* p = static_cast<const std::byte*>(data);
    std::size_t left = bytes;
    while (left > 0) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, kChecksumChunkBytes - piece_seen_));
      piece->update(p, n);
      piece_seen_ += n;
      p += n;
      left -= n;
      if (piece_seen_ == kChecksumChunkBytes) end_piece();
    }
    seen_ += bytes;
    return;
  }
  if (state_ != nullptr) state_->update(data, bytes);
  if (mac_state_ != nullptr)
    crypto_onetimeauth_update(static_cast<crypto_onetimeauth_state*>(mac_state_),
                              static_cast<const unsigned char*>(data), bytes);
  seen_ += bytes;
}

Status ObjectVerifier::finish() {
  if (!error_.ok()) return error_;
  if (seen_ != header_.payload_bytes)
    return DataLoss(
        fmt::format("{} of {} payload bytes read for key {}", seen_, header_.payload_bytes, header_.key.to_string()));
  if (mac_state_ != nullptr) {
    std::array<std::uint8_t, kPayloadTagBytes> tag{};
    crypto_onetimeauth_final(static_cast<crypto_onetimeauth_state*>(mac_state_), tag.data());
    if (crypto_verify_16(tag.data(), header_.payload_tag.data()) != 0)
      return auth_failure(fmt::format("payload tag does not match for key {} ({} payload bytes)",
                                      header_.key.to_string(), header_.payload_bytes));
    return Status::Ok();
  }
  if (piece_state_ != nullptr && piece_seen_ > 0) end_piece();
  const std::uint64_t c = state_->digest();
  if (c != header_.checksum)
    return DataLoss(fmt::format("checksum {:#018x} != stored {:#018x} for key {} ({} payload bytes)", c,
                                header_.checksum, header_.key.to_string(), header_.payload_bytes));
  return Status::Ok();
}

void ObjectVerifier::end_piece() {
  std::byte digest[8];
  store_le<std::uint64_t>(digest, piece_state_->digest());
  state_->update(digest, 8);
  piece_state_->reset();
  piece_seen_ = 0;
}

std::uint64_t num_checksum_chunks(std::uint64_t payload_bytes) noexcept {
  return (payload_bytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
}

std::uint64_t chunk_digest(const void* data, std::uint64_t bytes) noexcept {
  return xxh3_64(data, static_cast<std::size_t>(bytes));
}

namespace {

std::uint64_t chunked_checksum(const std::byte* header, std::uint32_t header_size,
                               std::span<const std::uint64_t> digests) {
  Xxh3 state;
  object_checksum_header(&state, header, header_size);
  for (std::uint64_t d : digests) {
    std::byte le[8];
    store_le<std::uint64_t>(le, d);
    state.update(le, 8);
  }
  return state.digest();
}

}  // namespace

Status encode_chunked_header(const StorageOptions& options, std::uint64_t ns_digest, const StorageKey& key,
                             std::uint64_t payload_bytes, std::span<const std::uint64_t> digests,
                             std::uint32_t header_size, std::byte* out) {
  if (!options.tenant_secret.empty())
    return InvalidArgument("chunked checksums are for unkeyed objects (this backend has a tenant secret)");
  if (digests.size() != num_checksum_chunks(payload_bytes))
    return InvalidArgument(fmt::format("{} piece digests for a payload of {} bytes ({} pieces)", digests.size(),
                                       payload_bytes, num_checksum_chunks(payload_bytes)));
  // The fields as an unkeyed header has them, then the flag and the checksums over the digests.
  KVTIER_RETURN_IF_ERROR(encode(options, ns_digest, key, nullptr, 0, header_size, out, nullptr));
  store_le<std::uint64_t>(out + kOffPayload, payload_bytes);
  store_le<std::uint16_t>(out + kOffFlags, kFlagChunked);
  store_le<std::uint64_t>(out + kOffChecksum, 0);
  store_le<std::uint64_t>(out + kOffHeaderChecksum, 0);
  store_le<std::uint64_t>(out + kOffChecksum, chunked_checksum(out, header_size, digests));
  store_le<std::uint64_t>(out + kOffHeaderChecksum, header_checksum(out, header_size, false));
  return Status::Ok();
}

Status verify_chunked(const std::byte* header_bytes, const ObjectHeader& header,
                      std::span<const std::uint64_t> digests) {
  if (!header.chunked) return DataLoss(fmt::format("object of key {} has no chunked checksum", header.key.to_string()));
  if (digests.size() != num_checksum_chunks(header.payload_bytes))
    return DataLoss(fmt::format("{} piece digests for a payload of {} bytes", digests.size(), header.payload_bytes));
  const std::uint64_t c = chunked_checksum(header_bytes, header.header_size, digests);
  if (c != header.checksum)
    return DataLoss(fmt::format("checksum {:#018x} != stored {:#018x} for key {} ({} payload bytes)", c,
                                header.checksum, header.key.to_string(), header.payload_bytes));
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
