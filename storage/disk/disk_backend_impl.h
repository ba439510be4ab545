// Private to the disk backend's sources (storage/disk/*.cc): the DiskBackend
// class (create_disk_backend() in disk_backend.h makes one), the ops and
// waiters that travel through its io_uring ring, the index entry, and small
// POSIX helpers (ScopedFd, aligned buffers, errno text, logging). Its members
// are defined by purpose: setup and the StorageBackend API in
// disk_backend.cc, the index in disk_index.cc, the I/O thread's loop in
// disk_io_thread.cc, puts in disk_put.cc and gets in disk_get.cc.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvtier/core/log.h"
#include "kvtier/storage/disk_backend.h"
#include "kvtier/testing/disk_fault.h"
#include "storage/region_set.h"

namespace kvtier::storage::disk {

inline constexpr std::uint64_t kAlign = 4096;
inline constexpr std::uint32_t kNumShards = 256;
inline constexpr const char* kObjectSuffix = ".kvo";
inline constexpr const char* kTmpMarker = ".kvo.tmp.";

inline std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }
inline bool aligned(const void* p, std::uint64_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

inline std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

// The medium is full: out of blocks or inodes (ENOSPC), over a quota (EDQUOT), or a file over
// the size limit (EFBIG).
inline bool out_of_space(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

// The Status of a call that failed with `err` on the medium ("<what>: <error>"): ResourceExhausted
// when out_of_space(err) (the disk is full: evict, do not retry elsewhere), else Unavailable.
inline Status fs_error(int err, std::string_view what) {
  std::string msg = fmt::format("{}: {}", what, errno_text(err));
  return out_of_space(err) ? ResourceExhausted(std::move(msg)) : Unavailable(std::move(msg));
}

// Warning by default: a quarantined object or a foreign file in the directory.
inline void log_line(const std::string& s, LogLevel level = LogLevel::kWarning) {
  kvtier::log(level, "storage/disk", s);
}

struct FreeDeleter {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuf = std::unique_ptr<std::byte, FreeDeleter>;
inline AlignedBuf alloc_aligned(std::uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, std::max<std::uint64_t>(bytes, kAlign)) != 0) return nullptr;
  return AlignedBuf(static_cast<std::byte*>(p));
}

class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept {
    reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~ScopedFd() { reset(); }
  int get() const noexcept { return fd_; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Opens a file of the store only if it is a regular file: by name below the directory fd `dirfd`
// (never by a path string, so no directory above it can be swapped for a link), O_NOFOLLOW (a
// symlink is not followed out of the directory), O_NONBLOCK (open() of a FIFO returns at once
// instead of waiting for a writer), then fstat. O_NONBLOCK is cleared again for the I/O (on a
// regular file it would let io_uring answer -EAGAIN), and O_DIRECT set only then (open() refuses
// it on a FIFO with EINVAL). `shown` is the path that messages name. NotFound when absent;
// DataLoss for a symlink or anything not regular (the caller quarantines it); Unavailable for
// other errors.
inline Result<ScopedFd> open_regular(int dirfd, const std::string& name, const std::string& shown, int flags,
                                     struct stat* sb) {
  const int direct = flags & O_DIRECT;
  ScopedFd fd(::openat(dirfd, name.c_str(), (flags & ~O_DIRECT) | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(fmt::format("open {}: {}", shown, errno_text(err)));
    if (err == ELOOP) return DataLoss(fmt::format("{} is a symbolic link", shown));
    // O_RDWR/O_WRONLY on a directory, ENXIO on a FIFO without reader: not a regular file either.
    if (err == EISDIR || err == ENXIO) return DataLoss(fmt::format("{} is not a regular file", shown));
    return Unavailable(fmt::format("open {}: {}", shown, errno_text(err)));
  }
  if (::fstat(fd.get(), sb) != 0) return Unavailable(fmt::format("fstat {}: {}", shown, errno_text(errno)));
  if (!S_ISREG(sb->st_mode))
    return DataLoss(fmt::format("{} is not a regular file (mode {:o})", shown, static_cast<unsigned>(sb->st_mode)));
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(fd.get(), F_SETFL, (fl & ~O_NONBLOCK) | direct) != 0)
    return Unavailable(fmt::format("fcntl {}: {}", shown, errno_text(errno)));
  return fd;
}

// Opens directory `name` below the directory fd `parent` without following a symlink (creating
// it with `mode` first when `create`), and checks that it is a directory owned by this process's
// euid; with `private_mode` also that it is no more open than `mode`. A link planted there, or a
// directory another user created first, would otherwise let the backend delete, overwrite or
// move files outside its root (the rebuild empties incoming/, trims quarantine/, recycles free/).
// FailedPrecondition naming `shown` for each refusal; NotFound when absent and !create. The
// mkdirat goes through `faults` (tests) when set.
Result<ScopedFd> open_owned_dir(int parent, const std::string& name, const std::string& shown, mode_t mode, bool create,
                                bool private_mode, DiskFaultInjector* faults = nullptr);

// The names in directory `dirfd` (read through a fresh open of it, so `dirfd` keeps its offset).
Result<std::vector<std::string>> list_dir(int dirfd, const std::string& shown);

// Tag of everything that has a completion on the ring.
struct Waiter {
  enum class Kind { kOp, kDirSync, kWake } kind;
};

struct IoOp : Waiter {
  enum class Stage { kWrite, kFileSync, kDirSync, kRead };
  std::shared_ptr<detail::Completion> completion;
  std::size_t index = 0;
  StorageOp op = StorageOp::kGet;
  StorageItem item;
  Stage stage = Stage::kWrite;
  ScopedFd fd;
  // A get: the file it opened (device, inode), so that a failed read quarantines that file, not one a put has
  // put under the name since. read_file_known false: nothing was opened.
  dev_t read_dev = 0;
  ino_t read_ino = 0;
  bool read_file_known = false;
  int tmp_dir = -1;        // incoming/ or free/ (a DiskBackend member fd; not owned)
  std::string tmp_name;    // the file written, in tmp_dir
  std::string tmp_path;    // the same, for messages
  std::string final_path;  // for messages; the object is object_name() in its shard directory
  std::uint32_t shard = 0;
  AlignedBuf header;  // header (direct payload) or header + payload (bounced)
  bool bounced = false;
  iovec iov[2] = {};
  int niov = 0;
  std::uint64_t file_offset = 0;  // next byte to transfer
  std::uint64_t total = 0;        // bytes to transfer
  std::uint64_t header_size = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t file_bytes = 0;  // bytes this put writes (a recycled file is cut to it) / the index records for a get
  bool recycled = false;         // the put overwrites a file from the free pool
  bool reader_counted = false;   // a get registered in reading_
  IoOp() : Waiter{Kind::kOp} {}
};

struct DirSync : Waiter {
  std::uint32_t shard = 0;
  bool in_flight = false;
  std::vector<IoOp*> waiting;  // renamed, need a fsync submitted after their rename
  std::vector<IoOp*> covered;  // covered by the fsync in flight
  DirSync() : Waiter{Kind::kDirSync} {}
};

struct IndexEntry {
  std::uint64_t file_bytes = 0;
  std::uint32_t header_size = 0;
  std::uint64_t payload_bytes = 0;
  std::list<StorageKey>::iterator lru;
};

class DiskBackend final : public StorageBackend {
 public:
  DiskBackend(DiskBackendConfig config, StorageOptions options);
  ~DiskBackend() override;
  Status init();

  std::string_view name() const noexcept override { return "disk"; }
  StorageCaps caps() const noexcept override;
  const StorageOptions& options() const noexcept override { return options_; }

  Status register_region(void* ptr, std::uint64_t bytes) override { return regions_.add(ptr, bytes); }
  Status unregister_region(void* ptr) override { return regions_.remove(ptr); }

  Result<StorageTicket> post(StorageBatch batch) override;
  Status cancel(const StorageTicket& ticket) override;
  StorageStats stats() const override;
  Result<std::uint64_t> stored_object_bytes(const StorageKey& key) override;
  Status corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) override;

 private:
  // Paths are for messages only: every file operation goes through the directory fds below.
  static std::string shard_name(std::uint32_t s) { return fmt::format("{:02x}", s); }
  static std::string object_name(const StorageKey& k) { return k.to_string() + kObjectSuffix; }
  std::string shard_dir(std::uint32_t s) const { return fmt::format("{}/{}", dir_, shard_name(s)); }
  std::string final_path(const StorageKey& k) const {
    return fmt::format("{}/{}", shard_dir(k.digest[0]), object_name(k));
  }
  // The fd of the key's shard directory (-1 before it exists: every *at() call then fails with
  // EBADF). Set by the rebuild and by ensure_shard() on the I/O thread under index_mu_; read
  // from other threads under index_mu_.
  int shard_fd(const StorageKey& k) const { return shard_fds_[k.digest[0]].get(); }

  void wake();
  Status probe_direct_io();

  // ---- index (disk_index.cc) ----------------------------------------------
  // Moves the object aside; `status` is why (its authentication failures are counted apart).
  // The object is the key's file in its shard directory.
  void quarantine_locked(const StorageKey& key, const Status& status);
  void erase_locked(std::unordered_map<StorageKey, IndexEntry, StorageKeyHash>::iterator it);
  void insert_locked(const StorageKey& key, std::uint64_t file_bytes, std::uint32_t header_size,
                     std::uint64_t payload_bytes);
  // Ok, or why an object that had to go could not be removed (it stays indexed; nothing more is evicted).
  // `keep`: an object that stays even if it is the least recently used (the put that just landed).
  Status make_room_locked(std::uint64_t incoming, const StorageKey* keep = nullptr);
  void trim_quarantine_locked(std::size_t keep);
  // Forgets the unauthenticated file of `key` (its bytes no longer counted); true if there was one.
  bool forget_unauthenticated_locked(const StorageKey& key);
  void adopt_quarantine_locked();
  // Moves file `name` of directory `dirfd` to free/ or unlinks it; an error (naming `shown`) when it is still there.
  Status recycle_or_unlink_locked(int dirfd, const std::string& name, std::uint64_t bytes, const StorageKey& key,
                                  std::string_view shown);
  Status open_directories();
  Status rebuild_index();
  Status check_object_file(int dirfd, const std::string& name, const std::string& shown, const StorageKey& key,
                           AlignedBuf& buf);

  // ---- I/O thread (disk_io_thread.cc) --------------------------------------
  void arm_wake();
  io_uring_sqe* get_sqe();
  void finish(IoOp* op, Status st, std::uint64_t bytes = 0);
  bool is_cancelled(const IoOp& op);
  void loop();
  void start(IoOp* op);
  void submit_rw(IoOp* op);
  static void advance(IoOp* op, std::uint64_t n);
  // Puts (disk_put.cc).
  void start_put(IoOp* op);
  Status ensure_shard(std::uint32_t s);
  void fail_put(IoOp* op, Status st);
  void on_op_cqe(IoOp* op, int res);
  void commit_put(IoOp* op);
  void submit_dir_sync(DirSync* ds);
  void on_dir_sync_cqe(DirSync* ds, int res);
  // Gets (disk_get.cc).
  void start_get(IoOp* op);
  void on_read(IoOp* op, int res);
  void quarantine_get(IoOp* op, Status st);

  DiskBackendConfig config_;
  StorageOptions options_;
  std::uint64_t ns_digest_ = 0;
  std::string dir_;
  bool direct_ = false;
  bool direct_io_fallback_ = false;  // kAuto and the probe failed: buffered for the backend's life
  bool journal_covers_direct_ = false;
  std::string fs_type_;
  std::uint64_t header_size_ = kAlign;
  ScopedFd lock_fd_;
  // Opened and checked once at create (open_directories()); files below are reached only by name
  // through these, so a directory swapped for a link later does not move the store.
  ScopedFd root_fd_;        // config_.root
  ScopedFd base_fd_;        // the tenant directory, or the root without a tenant
  ScopedFd dir_fd_;         // the namespace directory dir_
  ScopedFd quarantine_fd_;  // dir_/quarantine
  ScopedFd incoming_fd_;    // dir_/incoming
  ScopedFd free_fd_;        // dir_/free
  std::vector<ScopedFd> shard_fds_;
  std::vector<std::unique_ptr<DirSync>> dir_syncs_;

  RegionSet regions_;

  mutable std::mutex index_mu_;
  std::unordered_map<StorageKey, IndexEntry, StorageKeyHash> index_;
  std::list<StorageKey> lru_;  // front = least recently used
  std::uint64_t used_bytes_ = 0;
  std::deque<std::pair<std::string, std::uint64_t>> free_files_;  // recyclable files (names in free/), sizes
  std::size_t max_free_files_ = 0;
  std::unordered_map<StorageKey, int, StorageKeyHash> reading_;  // gets in flight per key
  std::uint64_t reserved_bytes_ = 0;
  std::uint64_t evictions_ = 0;
  std::uint64_t quarantined_ = 0;
  std::uint64_t auth_failures_ = 0;
  std::deque<std::pair<std::string, std::uint64_t>> quarantine_files_;  // names in quarantine/, oldest first
  std::uint64_t quarantine_bytes_ = 0;
  // Object files the rebuild found that do not authenticate with this tenant's secret (rotated, mistyped, none): not
  // served, left in place in case the secret is fixed, but counted against the capacity and removed before any
  // indexed object when room is needed (oldest first), so that rotations do not pile up files beyond it. A put of
  // the same key replaces the file (and its entry here).
  std::unordered_map<StorageKey, std::uint64_t, StorageKeyHash> unauthenticated_;  // key -> file bytes
  std::deque<StorageKey> unauthenticated_order_;  // oldest first; keys no longer in unauthenticated_ are skipped
  std::uint64_t unauthenticated_bytes_ = 0;
  std::uint64_t removed_tmp_ = 0;
  std::uint64_t seq_ = 0;
  std::uint32_t last_header_size_ = 0;
  std::uint64_t last_file_bytes_ = 0;
  std::int64_t last_mtime_ns_ = 0;
  std::uint64_t last_payload_bytes_ = 0;
  std::atomic<std::uint64_t> bounce_copies_{0};

  std::mutex queue_mu_;
  bool stopping_ = false;
  std::deque<std::unique_ptr<IoOp>> incoming_;
  std::vector<std::shared_ptr<detail::Completion>> cancel_requests_;

  // I/O thread only.
  io_uring ring_{};
  bool ring_ready_ = false;
  ScopedFd wake_fd_;
  std::uint64_t wake_value_ = 0;
  Waiter wake_waiter_{Waiter::Kind::kWake};
  std::deque<std::unique_ptr<IoOp>> pending_;
  std::unordered_map<IoOp*, std::unique_ptr<IoOp>> live_;
  std::thread thread_;
};

}  // namespace kvtier::storage::disk
