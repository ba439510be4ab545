// Local disk backend (see include/kvtier/storage/disk_backend.h for the contract):
// create_disk_backend(), the backend's setup (directory layout and lock, the
// O_DIRECT probe, the filesystem type, the index rebuild, the ring and its
// I/O thread) and shutdown, and the StorageBackend API: post() and cancel()
// queue work for the I/O thread, stats() and stored_object_bytes() read the
// index, corrupt_stored_object() is the tests' hook. The class is in
// disk_backend_impl.h.
#include "kvtier/storage/disk_backend.h"

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

Status mkdir_p(const std::string& path, mode_t mode) {
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), mode) != 0 && errno != EEXIST)
      return Unavailable(fmt::format("mkdir {}: {}", cur, errno_text(errno)));
  }
  return Status::Ok();
}

// A tenant's directory must be ours and no more open than dir_mode: one that another user
// created first (or a symlink planted there) would hand them every object the tenant writes.
Status check_private_dir(const std::string& path, mode_t mode) {
  struct stat sb {};
  if (::lstat(path.c_str(), &sb) != 0) return Unavailable(fmt::format("lstat {}: {}", path, errno_text(errno)));
  if (!S_ISDIR(sb.st_mode)) return FailedPrecondition(fmt::format("tenant directory {} is not a directory", path));
  if (sb.st_uid != ::geteuid())
    return FailedPrecondition(fmt::format("tenant directory {} is owned by uid {}, not by this process (uid {})", path,
                                          sb.st_uid, ::geteuid()));
  if ((sb.st_mode & 0777 & ~mode) != 0)
    return FailedPrecondition(
        fmt::format("tenant directory {} has mode {:o}, wider than dir_mode {:o}", path, sb.st_mode & 0777, mode));
  return Status::Ok();
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
  if (config_.queue_depth == 0 || config_.queue_depth > 4096)
    return InvalidArgument(fmt::format("disk backend: queue_depth {} not in [1, 4096]", config_.queue_depth));
  KVTIER_RETURN_IF_ERROR(format::check_tenant_options(options_).with_context("disk backend"));
  // A tenant's namespaces live in a directory of its own (created dir_mode, 0700 by default).
  const std::string base = options_.tenant.empty() ? config_.root : config_.root + "/" + options_.tenant;
  dir_ = fmt::format("{}/{:016x}-{:016x}", base, ns_digest_, options_.layout_fingerprint);
  if ((config_.file_mode & ~0777u) != 0 || (config_.dir_mode & ~0777u) != 0 || (config_.dir_mode & 0700u) != 0700u)
    return InvalidArgument(
        fmt::format("disk backend: file_mode {:o} / dir_mode {:o} not permission bits (dir_mode needs 0700)",
                    config_.file_mode, config_.dir_mode));
  const mode_t dmode = static_cast<mode_t>(config_.dir_mode);
  KVTIER_RETURN_IF_ERROR(mkdir_p(dir_, dmode));
  if (!options_.tenant.empty()) KVTIER_RETURN_IF_ERROR(check_private_dir(base, dmode));
  KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/quarantine", dmode));
  KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/incoming", dmode));
  KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/free", dmode));
  max_free_files_ = config_.max_free_files;
  lock_fd_ = ScopedFd(::open((dir_ + "/LOCK").c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW,
                             static_cast<mode_t>(config_.file_mode)));
  if (lock_fd_.get() < 0) return Unavailable(fmt::format("open {}/LOCK: {}", dir_, errno_text(errno)));
  if (::flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0)
    return FailedPrecondition(fmt::format("disk backend directory {} is locked by another process", dir_));
  header_size_ = format::header_bytes(options_, kAlign);
  dir_fd_ = ScopedFd(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd_.get() < 0) return Unavailable(fmt::format("open {}: {}", dir_, errno_text(errno)));
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
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const StorageItem& it = batch.items[i];
    if ((batch.op == StorageOp::kGet || batch.op == StorageOp::kPut) && it.buffer == nullptr && it.bytes > 0)
      return InvalidArgument(
          fmt::format("{} item {}: null buffer for {} bytes", storage_op_name(batch.op), i, it.bytes));
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
  s.bytes = used_bytes_ + quarantine_bytes_;
  s.capacity_bytes = config_.capacity_bytes;
  s.evictions = evictions_;
  s.quarantined = quarantined_;
  s.auth_failures = auth_failures_;
  s.bounce_copies = bounce_copies_.load();
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
  KVTIER_ASSIGN_OR_RETURN(ScopedFd fd, open_regular(final_path(key), O_RDWR, &sb));
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
  if (config_.direct_io == DirectIo::kOff) return Status::Ok();
  const std::string probe = dir_ + "/.direct_probe";
  ScopedFd fd(::open(probe.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_DIRECT | O_CLOEXEC,
                     static_cast<mode_t>(config_.file_mode)));
  int err = errno;
  bool ok = fd.get() >= 0;
  if (ok) {
    AlignedBuf b = alloc_aligned(kAlign);
    std::memset(b.get(), 0, kAlign);
    ok = ::pwrite(fd.get(), b.get(), kAlign, 0) == static_cast<ssize_t>(kAlign);
    err = errno;
  }
  fd.reset();
  ::unlink(probe.c_str());
  if (ok) {
    direct_ = true;
    return Status::Ok();
  }
  if (config_.direct_io == DirectIo::kOn)
    return NotSupported(fmt::format("O_DIRECT refused on {}: {}", dir_, errno_text(err)));
  log_line(fmt::format("O_DIRECT refused on {} ({}); using buffered I/O", dir_, errno_text(err)), LogLevel::kInfo);
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
