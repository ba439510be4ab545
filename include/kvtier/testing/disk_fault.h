// DiskFaultInjector: test-only faults in the disk backend's file I/O, in the spirit of RocksDB's
// FaultInjectionTestFS. Set DiskBackendConfig::fault_injector and the backend's I/O thread hands
// every io_uring completion (the one place reads, writes, file fsyncs and directory fsyncs come
// back) to on_completion() before acting on it; the result returned there is what the backend
// sees. The backend's synchronous calls that create files and directories (create_at(),
// mkdir_at() below) and its O_DIRECT probe go through it too. Unset (the default), the backend
// tests one null pointer per completion or creation and nothing else.
//
// A rule selects completions by operation, optionally by key (a directory fsync matches when it
// covers a put of the key), then by count (the nth match, every nth match) and probability, and
// turns them into:
//   kError  the call failed with `error` (EIO by default): a read error, a failed fsync, a failed
//           write;
//   kShort  a read or write that transferred fewer bytes than it did (`keep` of them, 0 allowed):
//           for a write, the bytes past what is reported are also punched out of the file (they
//           never reached it); for a read, the buffer past them is overwritten with garbage (they
//           never arrived). A correct backend resubmits the rest, or fails the operation. Applies
//           to kRead and kWrite only.
// For kCreate and kDirectProbe a kError undoes what the call created (the new file or directory
// is removed again) and the call fails with `error`: ENOSPC as when the inodes or blocks run out,
// EDQUOT for a quota, EINVAL as a filesystem that refuses O_DIRECT.
// Rules are checked in the order added; the first that selects a completion applies.
//
// Thread-safety: every method may be called from any thread while the backend runs.
#pragma once

#include <cerrno>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>

#include "kvtier/backend/storage_backend.h"

struct iovec;

namespace kvtier::storage {

// kCreate: a file or directory the backend creates (the root's missing components, the tenant,
// namespace, incoming/, quarantine/, free/ and shard directories, the LOCK file, a put's
// temporary file: keys = the put's key). kDirectProbe: the file the O_DIRECT probe creates and
// writes at create (no keys).
enum class DiskFaultOp : std::uint8_t { kRead, kWrite, kFileSync, kDirSync, kCreate, kDirectProbe };
inline constexpr int kNumDiskFaultOps = 6;

enum class DiskFaultAction : std::uint8_t { kError, kShort };

struct DiskFaultRule {
  DiskFaultOp op = DiskFaultOp::kRead;
  DiskFaultAction action = DiskFaultAction::kError;
  int error = EIO;                // kError: the completion's result becomes -error
  double keep = 0.5;              // kShort: fraction of the transferred bytes reported (rounded down)
  std::uint64_t align = 1;        // kShort: bytes reported rounded down to a multiple (4096: an O_DIRECT
                                  // transfer stops at a block boundary, and its rest must start on one)
  std::optional<StorageKey> key;  // only completions for this key
  std::uint64_t nth = 0;          // only the nth completion this rule matches (1-based); 0: any
  std::uint64_t every_nth = 0;    // only every every_nth-th match; 0: any
  double probability = 1.0;       // of applying to a match that passed the counts
  std::uint64_t max_hits = std::numeric_limits<std::uint64_t>::max();
};

// One completion as the backend's I/O thread sees it.
struct DiskFaultEvent {
  DiskFaultOp op = DiskFaultOp::kRead;
  std::span<const StorageKey> keys;  // the op's key; for a directory fsync, the puts it covers
  int fd = -1;
  std::uint64_t offset = 0;    // file offset of a read or write
  const iovec* iov = nullptr;  // the buffers of a read or write as submitted
  int niov = 0;
};

class DiskFaultInjector {
 public:
  explicit DiskFaultInjector(std::uint64_t seed = 1);
  ~DiskFaultInjector();
  DiskFaultInjector(const DiskFaultInjector&) = delete;
  DiskFaultInjector& operator=(const DiskFaultInjector&) = delete;

  void add(const DiskFaultRule& rule);
  // Removes every rule: the faults stop (counters stay).
  void clear();
  // Completions seen and faults injected, per operation.
  std::uint64_t seen(DiskFaultOp op) const;
  std::uint64_t injected(DiskFaultOp op) const;

  // Called by the disk backend for each completion with its result `res` (bytes or -errno);
  // returns the result the backend acts on.
  int on_completion(const DiskFaultEvent& event, int res);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The disk backend's one synchronous fsync, of its root directory after it created a shard
// directory: 0 or -errno, seen by `injector` (as a kDirSync without keys) when one is set.
int fsync_directory(DiskFaultInjector* injector, int fd);

// openat(dirfd, name, flags, mode) for a call with O_CREAT: the new descriptor or -errno, seen by
// `injector` as `op` (kCreate or kDirectProbe) with `keys` when one is set. An injected error
// closes the descriptor and, when the call made the file (O_EXCL), removes it.
int create_at(DiskFaultInjector* injector, DiskFaultOp op, int dirfd, const char* name, int flags, unsigned mode,
              std::span<const StorageKey> keys = {});
// mkdirat(dirfd, name, mode): 0 or -errno, seen by `injector` as a kCreate without keys. An
// injected error removes the directory the call made.
int mkdir_at(DiskFaultInjector* injector, int dirfd, const char* name, unsigned mode);

}  // namespace kvtier::storage
