// Helpers shared by the storage tests.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvtier/backend/storage_backend.h"

namespace kvtier::storage::testing {

// A fresh directory under $TMPDIR (or /tmp), removed recursively on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/kvtier-storage-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    if (!path_.empty()) remove_tree(path_);
  }
  const std::string& path() const { return path_; }

  static void remove_tree(const std::string& p) {
    struct stat sb {};
    if (::lstat(p.c_str(), &sb) != 0) return;
    if (S_ISDIR(sb.st_mode)) {
      if (DIR* d = ::opendir(p.c_str())) {
        while (dirent* e = ::readdir(d)) {
          std::string n = e->d_name;
          if (n != "." && n != "..") remove_tree(p + "/" + n);
        }
        ::closedir(d);
      }
      ::rmdir(p.c_str());
    } else {
      ::unlink(p.c_str());
    }
  }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// 4096-aligned buffer.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes) : bytes_(bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes ? bytes : 1) == 0) p_.reset(p);
  }
  std::byte* data() const { return static_cast<std::byte*>(p_.get()); }
  std::size_t size() const { return bytes_; }

 private:
  std::unique_ptr<void, FreeDeleter> p_;
  std::size_t bytes_;
};

inline void fill_random(void* p, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(p);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(b + i, &v, 8);
  }
  std::uint64_t v = rng();
  for (; i < n; ++i) b[i] = static_cast<unsigned char>(v >> (8 * (i % 8)));
}

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A block key spread over shards and slots, unique per (salt, i).
inline StorageKey key_of(std::uint64_t salt, std::uint64_t i, std::uint32_t rank = 0) {
  return StorageKey::from_u64(splitmix64(salt ^ (i * 0x632be59bd9b4e019ULL)), splitmix64(i) ^ salt, rank);
}

inline std::uint64_t random_salt() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
}

}  // namespace kvtier::storage::testing
