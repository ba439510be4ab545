// Local disk backend (see include/kvtier/storage/disk_backend.h for the contract):
// create_disk_backend(), the backend's setup (directory layout and lock, the
// O_DIRECT probe, the filesystem type, the index rebuild, the ring and its
// I/O thread) and shutdown, and the StorageBackend API: post() and cancel()
// queue work for the I/O thread, stats() and stored_object_bytes() read the
// index, corrupt_stored_object() is the tests' hook. The class is in
// disk_backend_impl.h.
#include "kvtier/storage/disk_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <mutex>
#include <thread>

#include "storage/disk/disk_backend_impl.h"
#include "storage/object_format.h"

namespace kvtier::storage::disk {
namespace {

// An error of the root's own path: FailedPrecondition, naming the path, where retrying cannot help (a component
// that is a file, a missing link target, a name too long, no permission, a read-only filesystem): the operator
// must change the path or the system. Other errors (I/O, out of space) as fs_error().
Status root_error(int err, const std::string& what, const std::string& path) {
  switch (err) {
    case ENOTDIR:
    case ENOENT:
    case ENAMETOOLONG:
    case ELOOP:
    case EACCES:
    case EPERM:
    case EROFS:
    case EEXIST: {
      std::string why = errno_text(err);
      struct stat lsb {};
      struct stat sb {};
      if (::lstat(path.c_str(), &lsb) == 0 && S_ISLNK(lsb.st_mode) && ::stat(path.c_str(), &sb) != 0)
        why = fmt::format("a symbolic link whose target does not resolve ({})", errno_text(errno));
      else if (err == EEXIST || err == ENOTDIR)
        why = fmt::format("{}: a component of the path is not a directory", errno_text(err));
      return FailedPrecondition(fmt::format("disk root {}: {}: {}", path, what, why));
    }
    default: return fs_error(err, fmt::format("{} {}", what, path));
  }
}

// Only for the root's own path, which the operator chose; below the root every directory is
// created and opened through its parent's fd (open_owned_dir()).
Status mkdir_p(const std::string& path, mode_t mode, DiskFaultInjector* faults) {
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (const int rc = mkdir_at(faults, AT_FDCWD, cur.c_str(), mode); rc != 0 && rc != -EEXIST)
      return root_error(-rc, "mkdir", cur);
  }
  return Status::Ok();
}

// The root is named by the operator, so a link in its path is followed; what it resolves to must
// be a directory that only we (or root) can change. A root owned by another user, or one that
// others may write into without the sticky bit, would let them rename our namespace directory
// away and plant a link or a directory of their own in its place between two of our runs.
Result<ScopedFd> open_root(const std::string& root, mode_t mode, DiskFaultInjector* faults) {
  const uid_t me = ::geteuid();
  struct stat lsb {};
  // The root's own name a link that another user planted (say in /tmp) would choose where we write.
  if (::lstat(root.c_str(), &lsb) == 0 && S_ISLNK(lsb.st_mode) && lsb.st_uid != me && lsb.st_uid != 0)
    return FailedPrecondition(fmt::format(
        "disk root {} is a symbolic link owned by uid {}, not by this process (uid {})", root, lsb.st_uid, me));
  KVTIER_RETURN_IF_ERROR(mkdir_p(root, mode, faults));
  ScopedFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return root_error(errno, "open", root);
  struct stat sb {};
  if (::fstat(fd.get(), &sb) != 0) return Unavailable(fmt::format("fstat {}: {}", root, errno_text(errno)));
  if (sb.st_uid != me && sb.st_uid != 0)
    return FailedPrecondition(
        fmt::format("disk root {} is owned by uid {}, not by this process (uid {}) or root", root, sb.st_uid, me));
  if ((sb.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (sb.st_mode & S_ISVTX) == 0)
    return FailedPrecondition(fmt::format(
        "disk root {} has mode {:o}: writable by group or others without the sticky bit", root, sb.st_mode & 07777));
  return fd;
}

// Type of the filesystem holding `path` ("ext4", "xfs", "tmpfs", ...), from the longest matching mount point.
std::string filesystem_type(const std::string& path) {
  char real[PATH_MAX];
  if (::realpath(path.c_str(), real) == nullptr) return "";
  const std::string p = real;
  FILE* f = std::fopen("/proc/self/mounts", "r");
  if (f == nullptr) return "";
  std::string best_type;
  std::size_t best_len = 0;
  char dev[512], mnt[PATH_MAX], type[64];
  while (std::fscanf(f, "%511s %4095s %63s %*[^\n]", dev, mnt, type) == 3) {
    const std::string m = mnt;
    const bool prefix = p == m || (p.compare(0, m.size(), m) == 0 && (m == "/" || p[m.size()] == '/'));
    if (prefix && m.size() >= best_len) {
      best_len = m.size();
      best_type = type;
    }
  }
  std::fclose(f);
  return best_type;
}

}  // namespace

Result<ScopedFd> open_owned_dir(int parent, const std::string& name, const std::string& shown, mode_t mode, bool create,
                                bool private_mode, DiskFaultInjector* faults) {
  if (const int rc = create ? mkdir_at(faults, parent, name.c_str(), mode) : 0; rc != 0 && rc != -EEXIST)
    return fs_error(-rc, fmt::format("mkdir {}", shown));
  ScopedFd fd(::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(fmt::format("{} does not exist", shown));
    struct stat lsb {};
    if (::fstatat(parent, name.c_str(), &lsb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(lsb.st_mode))
      return FailedPrecondition(
          fmt::format("{} is a symbolic link (the disk backend follows no link below its root)", shown));
    if (err == ENOTDIR || err == ELOOP) return FailedPrecondition(fmt::format("{} is not a directory", shown));
    return Unavailable(fmt::format("open {}: {}", shown, errno_text(err)));
  }
  struct stat sb {};
  if (::fstat(fd.get(), &sb) != 0) return Unavailable(fmt::format("fstat {}: {}", shown, errno_text(errno)));
  if (!S_ISDIR(sb.st_mode)) return FailedPrecondition(fmt::format("{} is not a directory", shown));
  if (sb.st_uid != ::geteuid())
    return FailedPrecondition(
        fmt::format("directory {} is owned by uid {}, not by this process (uid {})", shown, sb.st_uid, ::geteuid()));
  if (private_mode && (sb.st_mode & 0777 & ~mode) != 0)
    return FailedPrecondition(
        fmt::format("directory {} has mode {:o}, wider than dir_mode {:o}", shown, sb.st_mode & 0777, mode));
  return fd;
}

Result<std::vector<std::string>> list_dir(int dirfd, const std::string& shown) {
  const int fd = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Unavailable(fmt::format("open {}: {}", shown, errno_text(errno)));
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return Unavailable(fmt::format("opendir {}: {}", shown, errno_text(err)));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  return names;
}

DiskBackend::DiskBackend(DiskBackendConfig config, StorageOptions options)
    : config_(std::move(config)), options_(std::move(options)) {
  ns_digest_ = format::namespace_digest(options_);
}

DiskBackend::~DiskBackend() {
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    stopping_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

Status DiskBackend::init() {
  if (config_.root.empty()) return InvalidArgument("disk backend: empty root directory");
  // Values outside the enums (a cast, an uninitialized field) were taken as the weakest setting without a word.
  if (config_.durability != Durability::kProcessCrash && config_.durability != Durability::kPowerLoss)
    return InvalidArgument(fmt::format("disk backend: durability {} is none of process (0), power (1)",
                                       static_cast<int>(config_.durability)));
  if (config_.direct_io != DirectIo::kAuto && config_.direct_io != DirectIo::kOn && config_.direct_io != DirectIo::kOff)
    return InvalidArgument(fmt::format("disk backend: direct_io {} is none of auto (0), on (1), off (2)",
                                       static_cast<int>(config_.direct_io)));
  if (config_.queue_depth == 0 || config_.queue_depth > kMaxDiskQueueDepth)
    return InvalidArgument(fmt::format("disk backend: queue_depth (storage.disk.queue_depth) {} not in [1, {}]",
                                       config_.queue_depth, kMaxDiskQueueDepth));
  KVTIER_RETURN_IF_ERROR(format::check_tenant_options(options_).with_context("disk backend"));
  // A tenant's namespaces live in a directory of its own (created dir_mode, 0700 by default).
  const std::string base = options_.tenant.empty() ? config_.root : config_.root + "/" + options_.tenant;
  dir_ = fmt::format("{}/{:016x}-{:016x}", base, ns_digest_, options_.layout_fingerprint);
  // The owner reads and writes every file it creates (LOCK is reopened read-write, objects are read back) and
  // searches, lists and changes its directories: less would accept puts that no get can read.
  if ((config_.file_mode & ~0777u) != 0 || (config_.file_mode & 0600u) != 0600u)
    return InvalidArgument(fmt::format(
        "disk backend: file_mode (storage.disk.file_mode) {:04o}: permission bits of at most 0777 that include "
        "the owner's read and write (0600)",
        config_.file_mode));
  if ((config_.dir_mode & ~0777u) != 0 || (config_.dir_mode & 0700u) != 0700u)
    return InvalidArgument(fmt::format(
        "disk backend: dir_mode (storage.disk.dir_mode) {:04o}: permission bits of at most 0777 that include the "
        "owner's read, write and search (0700)",
        config_.dir_mode));
  KVTIER_RETURN_IF_ERROR(open_directories());
  max_free_files_ = config_.max_free_files;
  const int lock = create_at(config_.fault_injector.get(), DiskFaultOp::kCreate, dir_fd_.get(), "LOCK",
                             O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, config_.file_mode);
  if (lock < 0) return fs_error(-lock, fmt::format("open {}/LOCK", dir_));
  lock_fd_ = ScopedFd(lock);
  if (::flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0)
    return FailedPrecondition(fmt::format(
        "disk backend directory {} is locked by another backend open on it (another process, or one of this process "
        "not yet closed)",
        dir_));
  header_size_ = format::header_bytes(options_, kAlign);
  // Shard directories are created on first use (metadata operations are slow on some disks).
  shard_fds_.resize(kNumShards);
  for (std::uint32_t s = 0; s < kNumShards; ++s) {
    dir_syncs_.emplace_back(std::make_unique<DirSync>());
    dir_syncs_.back()->shard = s;
  }
  KVTIER_RETURN_IF_ERROR(probe_direct_io());
  fs_type_ = filesystem_type(dir_);
  journal_covers_direct_ = fs_type_ == "ext4" || fs_type_ == "xfs";
  KVTIER_RETURN_IF_ERROR(rebuild_index());
  const unsigned entries = std::max<unsigned>(16, config_.queue_depth * 2 + 8);
  int rc = io_uring_queue_init(entries, &ring_, 0);
  if (rc < 0) return Unavailable(fmt::format("io_uring_queue_init({}): {}", entries, errno_text(-rc)));
  ring_ready_ = true;
  wake_fd_ = ScopedFd(::eventfd(0, EFD_CLOEXEC));
  if (wake_fd_.get() < 0) return Unavailable(fmt::format("eventfd: {}", errno_text(errno)));
  thread_ = std::thread([this] { loop(); });
  return Status::Ok();
}

// Every directory from the root down, each opened below the one before and checked before
// anything is created inside it: a tenant directory must be ours and no more open than
// dir_mode (one that another user created first would hand them every object the tenant
// writes); the namespace directory and its subdirectories must be ours and not links.
Status DiskBackend::open_directories() {
  const mode_t dmode = static_cast<mode_t>(config_.dir_mode);
  DiskFaultInjector* const faults = config_.fault_injector.get();
  KVTIER_ASSIGN_OR_RETURN(root_fd_, open_root(config_.root, dmode, faults));
  std::string base = config_.root;
  if (options_.tenant.empty()) {
    base_fd_ = ScopedFd(::fcntl(root_fd_.get(), F_DUPFD_CLOEXEC, 0));
    if (base_fd_.get() < 0) return Unavailable(fmt::format("dup: {}", errno_text(errno)));
  } else {
    base = config_.root + "/" + options_.tenant;
    KVTIER_ASSIGN_OR_RETURN(base_fd_, open_owned_dir(root_fd_.get(), options_.tenant, base, dmode, true, true, faults));
  }
  KVTIER_ASSIGN_OR_RETURN(dir_fd_, open_owned_dir(base_fd_.get(), dir_.substr(base.size() + 1), dir_, dmode, true,
                                                  !options_.tenant.empty(), faults));
  KVTIER_ASSIGN_OR_RETURN(
      quarantine_fd_, open_owned_dir(dir_fd_.get(), "quarantine", dir_ + "/quarantine", dmode, true, false, faults));
  KVTIER_ASSIGN_OR_RETURN(incoming_fd_,
                          open_owned_dir(dir_fd_.get(), "incoming", dir_ + "/incoming", dmode, true, false, faults));
  KVTIER_ASSIGN_OR_RETURN(free_fd_, open_owned_dir(dir_fd_.get(), "free", dir_ + "/free", dmode, true, false, faults));
  return Status::Ok();
}

StorageCaps DiskBackend::caps() const noexcept {
  StorageCaps c;
  c.zero_copy_host = direct_;
  c.native_async = true;
  c.shared = false;
  c.cancellable = true;
  c.persistent = true;
  c.max_in_flight = config_.queue_depth;
  c.max_object_bytes =
      config_.capacity_bytes ? std::min(config_.capacity_bytes, format::kMaxPayloadBytes) : format::kMaxPayloadBytes;
  c.alignment = direct_ ? kAlign : 1;
  return c;
}

Result<StorageTicket> DiskBackend::post(StorageBatch batch) {
  KVTIER_RETURN_IF_ERROR(check_batch_buffers(batch));
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const StorageItem& it = batch.items[i];
    if (batch.op == StorageOp::kPut) {
      // Bounded before any size arithmetic (alignment, header, capacity) can wrap.
      if (it.bytes > format::kMaxPayloadBytes)
        return InvalidArgument(
            fmt::format("put item {}: {} bytes > the object limit of {}", i, it.bytes, format::kMaxPayloadBytes));
      KVTIER_RETURN_IF_ERROR(
          format::check_payload_size(options_, it.bytes).with_context(fmt::format("put item {}", i)));
    }
  }
  StorageTicket t = StorageTicket::create(batch.op, batch.items.size());
  if (batch.items.empty()) return t;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (stopping_) return FailedPrecondition("disk backend is shutting down");
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      auto op = std::make_unique<IoOp>();
      op->completion = t.completion();
      op->index = i;
      op->op = batch.op;
      op->item = batch.items[i];
      incoming_.push_back(std::move(op));
    }
  }
  wake();
  return t;
}

Status DiskBackend::cancel(const StorageTicket& ticket) {
  if (!ticket.valid()) return InvalidArgument("cancel: invalid ticket");
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    for (auto it = incoming_.begin(); it != incoming_.end();) {
      if ((*it)->completion == ticket.completion()) {
        (*it)->completion->complete((*it)->index, Cancelled("cancelled before it started"));
        it = incoming_.erase(it);
      } else {
        ++it;
      }
    }
    cancel_requests_.push_back(ticket.completion());
  }
  wake();
  return Status::Ok();
}

StorageStats DiskBackend::stats() const {
  std::lock_guard<std::mutex> lk(index_mu_);
  StorageStats s;
  s.objects = index_.size();
  s.bytes = used_bytes_ + quarantine_bytes_ + unauthenticated_bytes_;
  s.capacity_bytes = config_.capacity_bytes;
  s.evictions = evictions_;
  s.quarantined = quarantined_;
  s.auth_failures = auth_failures_;
  s.bounce_copies = bounce_copies_.load();
  s.direct_io_fallback = direct_io_fallback_ ? 1 : 0;
  return s;
}

Result<std::uint64_t> DiskBackend::stored_object_bytes(const StorageKey& key) {
  std::lock_guard<std::mutex> lk(index_mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return NotFound(fmt::format("key {} not stored", key.to_string()));
  return it->second.header_size + it->second.payload_bytes;
}

Status DiskBackend::corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) {
  std::lock_guard<std::mutex> lk(index_mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return NotFound(fmt::format("key {} not stored", key.to_string()));
  struct stat sb {};
  KVTIER_ASSIGN_OR_RETURN(ScopedFd fd, open_regular(shard_fd(key), object_name(key), final_path(key), O_RDWR, &sb));
  unsigned char b = 0;
  if (::pread(fd.get(), &b, 1, static_cast<off_t>(offset)) != 1)
    return OutOfRange(fmt::format("offset {} beyond object {}", offset, key.to_string()));
  b ^= xor_mask;
  if (::pwrite(fd.get(), &b, 1, static_cast<off_t>(offset)) != 1)
    return Unavailable(fmt::format("pwrite: {}", errno_text(errno)));
  return Status::Ok();
}

void DiskBackend::wake() {
  if (wake_fd_.get() >= 0) {
    std::uint64_t one = 1;
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
    (void)n;
  }
}

Status DiskBackend::probe_direct_io() {
  direct_ = false;
  direct_io_fallback_ = false;
  if (config_.direct_io == DirectIo::kOff) return Status::Ok();
  const char* probe = ".direct_probe";
  // Created new (O_EXCL): an existing name, link or not, is never opened for writing.
  ::unlinkat(dir_fd_.get(), probe, 0);
  const int created = create_at(config_.fault_injector.get(), DiskFaultOp::kDirectProbe, dir_fd_.get(), probe,
                                O_CREAT | O_EXCL | O_WRONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW, config_.file_mode);
  ScopedFd fd(created >= 0 ? created : -1);
  int err = created >= 0 ? 0 : -created;
  if (fd.get() >= 0) {
    AlignedBuf b = alloc_aligned(kAlign);
    if (!b) {
      fd.reset();
      ::unlinkat(dir_fd_.get(), probe, 0);
      return ResourceExhausted(fmt::format("out of memory for the O_DIRECT probe of {}", dir_));
    }
    std::memset(b.get(), 0, kAlign);
    const ssize_t n = ::pwrite(fd.get(), b.get(), kAlign, 0);
    err = n == static_cast<ssize_t>(kAlign) ? 0 : n < 0 ? errno : EIO;  // a short write: nothing more to say
  }
  fd.reset();
  ::unlinkat(dir_fd_.get(), probe, 0);
  if (err == 0) {
    direct_ = true;
    return Status::Ok();
  }
  // A full disk (no inode or block for the probe's file) says nothing about O_DIRECT.
  const bool full = out_of_space(err);
  if (config_.direct_io == DirectIo::kOn)
    return full ? ResourceExhausted(fmt::format("O_DIRECT probe on {} could not run: {}", dir_, errno_text(err)))
                : NotSupported(fmt::format("O_DIRECT refused on {}: {}", dir_, errno_text(err)));
  // Buffered for the backend's whole life (page cache, bounce copies, no zero-copy path): worth
  // a warning and a metric (StorageStats::direct_io_fallback), not an info line alone.
  direct_io_fallback_ = true;
  log_line(full ? fmt::format("O_DIRECT probe on {} could not run ({}); using buffered I/O for this backend's life "
                              "(create it again once the disk has room to use O_DIRECT)",
                              dir_, errno_text(err))
                : fmt::format("O_DIRECT refused on {} ({}); using buffered I/O for this backend's life", dir_,
                              errno_text(err)),
           LogLevel::kWarning);
  return Status::Ok();
}

}  // namespace kvtier::storage::disk

namespace kvtier::storage {

Result<std::unique_ptr<StorageBackend>> create_disk_backend(DiskBackendConfig config, StorageOptions options) {
  auto b = std::make_unique<disk::DiskBackend>(std::move(config), std::move(options));
  KVTIER_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<StorageBackend>(std::move(b));
}

}  // namespace kvtier::storage
