// Helpers shared by the fuzz harnesses: a scratch directory per process, file I/O, and the
// reseal of a version-1 (unkeyed) object. A mutated object almost never keeps a valid xxh3
// checksum, so without a reseal the fuzzer would only ever reach the first checksum test; the
// harnesses let one control bit recompute both checksums (as an attacker who knows the format
// would) and copy the expected identity in, which takes the input past those checks into the
// size, roles and padding checks and into the backends' handling of what they accept.
#pragma once

#include <fcntl.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "storage/storage_test_util.h"

namespace kvtier::fuzz {

// Stops the run with a crash report: libFuzzer saves the input that got here.
#define KVTIER_FUZZ_CHECK(cond)                                                               \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

inline constexpr std::size_t kOffHeaderSize = 12, kOffIdentity = 16, kOffIdentityEnd = 52, kOffPayload = 56,
                             kOffHeaderChecksum = 64, kOffChecksum = 72, kFixedHeader = 80;

inline std::uint64_t load_le(const std::byte* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{static_cast<std::uint8_t>(p[i])} << (8 * i);
  return v;
}
inline void store_le(std::byte* p, std::uint64_t v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

// Copies the identity fields (namespace digest, layout fingerprint, key, rank) of `reference`
// into `obj` when both are long enough.
inline void copy_identity(std::vector<std::byte>& obj, const std::vector<std::byte>& reference) {
  if (obj.size() >= kOffIdentityEnd && reference.size() >= kOffIdentityEnd)
    std::memcpy(obj.data() + kOffIdentity, reference.data() + kOffIdentity, kOffIdentityEnd - kOffIdentity);
}

// Recomputes the object checksum (over the payload bytes present) and then the header checksum of
// a version-1 object, as storage/object_format.cc writes them. Leaves `obj` alone when its header
// size field does not fit the bytes.
inline void reseal(std::vector<std::byte>& obj) {
  if (obj.size() < kFixedHeader) return;
  const std::uint64_t hs = load_le(obj.data() + kOffHeaderSize, 4);
  if (hs < kFixedHeader || hs > obj.size()) return;
  const std::uint64_t payload = load_le(obj.data() + kOffPayload, 8);
  const std::uint64_t avail = std::min<std::uint64_t>(payload, obj.size() - hs);
  static constexpr std::byte kZeros[16] = {};
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  XXH3_64bits_update(&st, obj.data(), kOffHeaderChecksum);
  XXH3_64bits_update(&st, kZeros, 16);
  XXH3_64bits_update(&st, obj.data() + kFixedHeader, hs - kFixedHeader);
  XXH3_64bits_update(&st, obj.data() + hs, avail);
  store_le(obj.data() + kOffChecksum, XXH3_64bits_digest(&st), 8);
  XXH3_64bits_reset(&st);
  XXH3_64bits_update(&st, obj.data(), kOffHeaderChecksum);
  XXH3_64bits_update(&st, kZeros, 8);
  XXH3_64bits_update(&st, obj.data() + kOffChecksum, hs - kOffChecksum);
  store_le(obj.data() + kOffHeaderChecksum, XXH3_64bits_digest(&st), 8);
}

inline bool write_file(const std::string& path, const void* data, std::size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  const auto* p = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, p + done, size - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return done == size;
}

inline std::vector<std::byte> read_file(const std::string& path) {
  std::vector<std::byte> out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  std::byte buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.insert(out.end(), buf, buf + n);
  ::close(fd);
  return out;
}

// The first file under `dir` (recursively) whose name ends with `suffix`; empty when none.
inline std::string find_file(const std::string& dir, const std::string& suffix) {
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec); !ec && it != end(it); it.increment(ec)) {
    const std::string p = it->path().string();
    if (p.size() >= suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0) return p;
  }
  return "";
}

}  // namespace kvtier::fuzz
