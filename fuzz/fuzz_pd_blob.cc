// Fuzzes the transport's peer metadata (the blob an agent exports and its peers load: transport_base.cc,
// decode_blob) and a loopback transport's load_peer of it. A mutated blob almost never keeps its xxh3 checksum, so
// the first input byte's low bit recomputes it (as a peer that knows the format would), which takes the input past
// that check into the field parsing and bounds checks.
//
// Invariants: decode_blob returns (a Result, never a crash, an exception or a sanitizer report); a blob it accepts
// keeps every bound the transport relies on (names and address of sane length, no live region at base 0 or
// wrapping the address space, no two live regions overlapping, keys bounded) and encodes back to bytes that decode to
// the same blob; under a peer secret the same fields, keyed, decode only with that secret, and any one byte changed
// in the keyed blob is refused as an authentication failure before a field is read; load_peer of an accepted blob
// on a loopback transport returns an error or a peer whose info names the blob's agent.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/byte_codec.h"
#include "fuzz/fuzz_util.h"  // xxh3, inline
#include "kvtier/backend/transport.h"
#include "transport/transport_base.h"

namespace {

using namespace kvtier;
using namespace kvtier::transport;
namespace td = kvtier::transport::detail;
using td::Blob;

bool same(const Blob& a, const Blob& b) {
  if (a.version != b.version || a.backend != b.backend || a.identity.name != b.identity.name ||
      a.identity.layout_fingerprint != b.identity.layout_fingerprint || a.identity.tp_size != b.identity.tp_size ||
      a.identity.tp_rank != b.identity.tp_rank || a.address != b.address || a.regions.size() != b.regions.size())
    return false;
  for (std::size_t i = 0; i < a.regions.size(); ++i) {
    const Blob::Region &x = a.regions[i], &y = b.regions[i];
    if (x.kind != y.kind || x.base != y.base || x.bytes != y.bytes || x.key != y.key) return false;
  }
  return true;
}

bool keeps_bounds(const Blob& b) {
  auto sane = [](const std::string& s) {
    return !s.empty() && s.size() <= td::kMaxNameBytes &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
  };
  if (!sane(b.backend) || !sane(b.identity.name)) return false;
  if (b.address.empty() || b.address.size() > td::kMaxAddressBytes) return false;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> live;
  for (const Blob::Region& r : b.regions) {
    if (r.key.size() > td::kMaxRemoteKeyBytes) return false;
    if (r.bytes == 0) {
      if (!r.key.empty()) return false;
      continue;
    }
    if (r.base == 0 || r.base + r.bytes < r.base) return false;
    live.emplace_back(r.base, r.base + r.bytes);
  }
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i)
    if (live[i].first < live[i - 1].second) return false;
  return true;
}

// A seed blob, so the loopback transport below has a real peer to be confused with.
std::unique_ptr<Transport>& loopback() {
  static auto* t = new std::unique_ptr<Transport>(create_loopback_transport({"fuzz-blob-local", 7, 1, 0}).value());
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const bool reseal = data[0] & 1;
  std::vector<std::byte> blob(reinterpret_cast<const std::byte*>(data) + 1,
                              reinterpret_cast<const std::byte*>(data) + size);
  if (reseal && blob.size() >= 20) {
    const std::uint64_t sum = XXH3_64bits(blob.data(), blob.size() - 8);
    codec::store_le<std::uint64_t>(blob.data() + blob.size() - 8, sum);
  }
  static const std::string kSecret(32, 's');
  auto plain = td::decode_blob(blob);
  auto keyed_try = td::decode_blob(blob, kSecret);  // an unkeyed (or forged) blob never passes a secret
  if (keyed_try.ok()) {
    // Only possible if the input carries a valid MAC under kSecret: the fuzzer cannot forge one.
    KVTIER_FUZZ_CHECK(!plain.ok());
  } else {
    keyed_try.status().ignore_error();
  }
  if (!plain.ok()) {
    plain.status().ignore_error();
    return 0;
  }
  const Blob& b = *plain;
  KVTIER_FUZZ_CHECK(keeps_bounds(b));
  auto again = td::decode_blob(td::encode_blob(b));
  KVTIER_FUZZ_CHECK(again.ok() && same(*again, b));

  // The same fields under a peer secret: decode with it, refused without it or with another, and every one-byte
  // change refused by the MAC.
  std::vector<std::byte> keyed = td::encode_blob(b, kSecret);
  auto with = td::decode_blob(keyed, kSecret);
  KVTIER_FUZZ_CHECK(with.ok() && same(*with, b));
  auto without = td::decode_blob(keyed);
  KVTIER_FUZZ_CHECK(!without.ok() && without.status().code() == StatusCode::kFailedPrecondition);
  auto other = td::decode_blob(keyed, std::string(32, 't'));
  KVTIER_FUZZ_CHECK(!other.ok() && other.status().code() == StatusCode::kFailedPrecondition);
  const std::size_t at = (size * 131) % keyed.size();
  keyed[at] ^= std::byte{static_cast<std::uint8_t>(data[size - 1] | 1)};
  auto changed = td::decode_blob(keyed, kSecret);
  KVTIER_FUZZ_CHECK(!changed.ok());
  // A changed magic is "not a blob" (InvalidArgument); every other change fails authentication.
  KVTIER_FUZZ_CHECK(at < 8 || changed.status().code() == StatusCode::kFailedPrecondition);

  // A loopback transport loads it (names the blob's agent) or refuses it; it never crashes on what it accepted.
  auto peer = loopback()->load_peer(blob);
  if (peer.ok()) {
    auto info = loopback()->peer_info(*peer);
    KVTIER_FUZZ_CHECK(info.ok() && info->identity.name == b.identity.name);
    loopback()->disconnect_peer(*peer).ignore_error();
  } else {
    peer.status().ignore_error();
  }
  return 0;
}
