// A put on the disk backend's I/O thread: header and payload written (the
// payload straight from the caller's buffer under O_DIRECT when aligned, else
// through a bounce buffer) to a new file in incoming/ or a recycled one, made
// durable per DiskBackendConfig::durability, renamed over the object (swapped
// with RENAME_EXCHANGE when replacing one) and, under kPowerLoss,
// acknowledged after an fsync of its shard directory that the puts of the
// shard share. on_op_cqe() steps a put through these stages and hands read
// completions to on_read() (disk_get.cc).
#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "kvtier/testing/disk_fault.h"
#include "storage/disk/disk_backend_impl.h"
#include "storage/object_format.h"

namespace kvtier::storage::disk {

void DiskBackend::start_put(IoOp* op) {
  const StorageKey& key = op->item.key;
  op->shard = key.digest[0];
  op->header_size = header_size_;
  op->payload_bytes = op->item.bytes;
  const bool direct_payload = direct_ && aligned(op->item.buffer, kAlign) && op->item.bytes % kAlign == 0;
  op->file_bytes = header_size_ + (direct_ ? align_up(op->item.bytes, kAlign) : op->item.bytes);
  {
    std::lock_guard<std::mutex> lk(index_mu_);
    if (config_.capacity_bytes && op->file_bytes > config_.capacity_bytes)
      return finish(op, ResourceExhausted(fmt::format("object of {} bytes exceeds the disk tier capacity of {}",
                                                      op->file_bytes, config_.capacity_bytes)));
    if (Status s = make_room_locked(op->file_bytes); !s.ok())
      return finish(op, s.with_context(fmt::format("put {}", op->item.key.to_string())));
    reserved_bytes_ += op->file_bytes;
    // Reuse a free file unless it is much larger than this object (most of it would be cut off).
    if (!free_files_.empty() && free_files_.front().second <= 2 * op->file_bytes + kAlign) {
      op->tmp_dir = free_fd_.get();
      op->tmp_name = std::move(free_files_.front().first);
      op->tmp_path = fmt::format("{}/free/{}", dir_, op->tmp_name);
      free_files_.pop_front();
      op->recycled = true;
    } else if (!free_files_.empty()) {
      ::unlinkat(free_fd_.get(), free_files_.front().first.c_str(), 0);
      free_files_.pop_front();
    }
  }
  op->bounced = !direct_payload;
  op->header = alloc_aligned(op->bounced ? op->file_bytes : header_size_);
  if (!op->header) return fail_put(op, ResourceExhausted("out of memory for a bounce buffer"));
  Status st = format::encode_header(options_, ns_digest_, key, op->item.buffer, op->item.bytes,
                                    static_cast<std::uint32_t>(header_size_), op->header.get());
  if (!st.ok()) return fail_put(op, st);
  if (op->bounced) {
    ++bounce_copies_;
    if (op->item.bytes) std::memcpy(op->header.get() + header_size_, op->item.buffer, op->item.bytes);
    std::memset(op->header.get() + header_size_ + op->item.bytes, 0, op->file_bytes - header_size_ - op->item.bytes);
    op->iov[0] = {op->header.get(), op->file_bytes};
    op->niov = 1;
  } else {
    op->iov[0] = {op->header.get(), header_size_};
    op->iov[1] = {op->item.buffer, op->item.bytes};
    op->niov = op->item.bytes ? 2 : 1;
  }
  if (Status sd = ensure_shard(op->shard); !sd.ok()) return fail_put(op, sd);
  op->final_path = final_path(key);
  if (op->recycled) {
    struct stat sb {};
    auto fd = open_regular(op->tmp_dir, op->tmp_name, op->tmp_path, O_WRONLY | (direct_ ? O_DIRECT : 0), &sb);
    // A file with another name (a hard link) is not overwritten: the bytes would show there too. A longer file is
    // cut to this object's size first: room was made for file_bytes, and the index counts the file's size.
    if (fd.ok() && sb.st_nlink == 1 &&
        (static_cast<std::uint64_t>(sb.st_size) <= op->file_bytes ||
         ::ftruncate(fd->get(), static_cast<off_t>(op->file_bytes)) == 0))
      op->fd = std::move(fd).value();
    if (op->fd.get() < 0) {
      ::unlinkat(op->tmp_dir, op->tmp_name.c_str(), 0);
      op->recycled = false;
    }
  }
  int create_err = 0;
  if (!op->recycled) {
    // New files share one directory: ext4 places a new file's blocks near its directory, so
    // concurrent puts write one region of the disk instead of one region per shard directory.
    op->tmp_dir = incoming_fd_.get();
    op->tmp_name = fmt::format("{}{}{}.{}", key.to_string(), kTmpMarker, ::getpid(), ++seq_);
    op->tmp_path = fmt::format("{}/incoming/{}", dir_, op->tmp_name);
    const int fd = create_at(config_.fault_injector.get(), DiskFaultOp::kCreate, op->tmp_dir, op->tmp_name.c_str(),
                             O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | O_NOFOLLOW | (direct_ ? O_DIRECT : 0),
                             config_.file_mode, std::span<const StorageKey>(&op->item.key, 1));
    if (fd >= 0) op->fd = ScopedFd(fd);
    create_err = fd >= 0 ? 0 : -fd;
  }
  if (op->fd.get() < 0) {
    const int err = create_err;
    return fail_put(op, fs_error(err, fmt::format("create {}", op->tmp_path)));
  }
  op->stage = IoOp::Stage::kWrite;
  op->total = op->file_bytes;
  op->file_offset = 0;
  submit_rw(op);
}

// Creates and opens shard directory s on first use (I/O thread).
Status DiskBackend::ensure_shard(std::uint32_t s) {
  if (shard_fds_[s].get() >= 0) return Status::Ok();
  // Checked as at create: a link or another user's directory planted since is refused.
  KVTIER_ASSIGN_OR_RETURN(
      ScopedFd fd, open_owned_dir(dir_fd_.get(), shard_name(s), shard_dir(s), static_cast<mode_t>(config_.dir_mode),
                                  true, false, config_.fault_injector.get()));
  // A new shard directory must itself be durable before objects in it are acknowledged. Also when
  // mkdir found it: an earlier put (or run) may have created it and then failed, or died, before
  // this fsync. Once per shard and process.
  if (config_.durability == Durability::kPowerLoss) {
    if (const int rc = fsync_directory(config_.fault_injector.get(), dir_fd_.get()); rc != 0)
      return fs_error(-rc, fmt::format("fsync {}", dir_));
  }
  std::lock_guard<std::mutex> lk(index_mu_);  // shard_fd() readers on other threads hold it
  shard_fds_[s] = std::move(fd);
  return Status::Ok();
}

void DiskBackend::fail_put(IoOp* op, Status st) {
  // A namespace directory removed while we hold it open has no links, and every put under it fails for good
  // (ENOENT naming paths that may exist again, recreated): say what happened.
  struct stat dsb {};
  if (!st.ok() && ::fstat(dir_fd_.get(), &dsb) == 0 && dsb.st_nlink == 0)
    st = Unavailable(fmt::format(
        "the namespace directory {} was removed while the tier was open (its objects are gone; reopen the tier): {}",
        dir_, st.message()));
  if (op->fd.get() >= 0) op->fd.reset();
  if (!op->tmp_name.empty()) ::unlinkat(op->tmp_dir, op->tmp_name.c_str(), 0);
  {
    std::lock_guard<std::mutex> lk(index_mu_);
    reserved_bytes_ -= op->file_bytes;
  }
  finish(op, std::move(st));
}

void DiskBackend::on_op_cqe(IoOp* op, int res) {
  switch (op->stage) {
    case IoOp::Stage::kWrite: {
      if (res < 0) return fail_put(op, fs_error(-res, fmt::format("write {}", op->tmp_path)));
      if (res == 0) return fail_put(op, ResourceExhausted(fmt::format("write {}: no progress", op->tmp_path)));
      if (op->file_offset + static_cast<std::uint64_t>(res) < op->total) {
        const std::uint64_t reached = op->file_offset + static_cast<std::uint64_t>(res);
        // Under O_DIRECT a write stops off a block boundary only where the file cannot grow further (a file size
        // limit, RLIMIT_FSIZE, cuts it at the limit): the rest, at an unaligned offset, would be refused with
        // EINVAL and reported as that, not as the want of room it is.
        if (direct_ && reached % kAlign != 0)
          return fail_put(op,
                          ResourceExhausted(fmt::format(
                              "write {}: the file stopped growing at {} of {} bytes (a file size limit, or no room)",
                              op->tmp_path, reached, op->total)));
        advance(op, static_cast<std::uint64_t>(res));
        return submit_rw(op);
      }
      // O_DIRECT data is on the device when the write completes, and on ext4/XFS the directory fsync
      // after the rename commits the journal (inode, extents, size, entry) behind a cache flush, which
      // makes that data durable too; elsewhere, and for buffered writes, the file is fdatasynced first.
      if (config_.durability == Durability::kPowerLoss && !(direct_ && journal_covers_direct_)) {
        op->stage = IoOp::Stage::kFileSync;
        io_uring_sqe* sqe = get_sqe();
        io_uring_prep_fsync(sqe, op->fd.get(), IORING_FSYNC_DATASYNC);
        io_uring_sqe_set_data(sqe, op);
        return;
      }
      return commit_put(op);
    }
    case IoOp::Stage::kFileSync:
      if (res < 0) return fail_put(op, fs_error(-res, fmt::format("fdatasync {}", op->tmp_path)));
      return commit_put(op);
    case IoOp::Stage::kDirSync: return;  // completions come through DirSync
    case IoOp::Stage::kRead: return on_read(op, res);
  }
}

void DiskBackend::commit_put(IoOp* op) {
  op->fd.reset();
  std::lock_guard<std::mutex> lk(index_mu_);
  auto old = index_.find(op->item.key);
  const int sfd = shard_fd(op->item.key);
  const std::string name = object_name(op->item.key);
  // Replacing an object: swap atomically so that the old file can be recycled; else a plain rename.
  bool exchanged = false;
  if (old != index_.end()) {
    exchanged = ::renameat2(op->tmp_dir, op->tmp_name.c_str(), sfd, name.c_str(), RENAME_EXCHANGE) == 0;
    // The old object's file, now under the temporary name: a leftover is removed at the next open.
    if (exchanged)
      recycle_or_unlink_locked(op->tmp_dir, op->tmp_name, old->second.file_bytes, op->item.key, op->tmp_path)
          .ignore_error();
  }
  const bool replaced_unauthenticated = old == index_.end() && unauthenticated_.count(op->item.key) != 0;
  if (!exchanged && ::renameat(op->tmp_dir, op->tmp_name.c_str(), sfd, name.c_str()) != 0) {
    Status st = fs_error(errno, fmt::format("rename {} -> {}", op->tmp_path, op->final_path));
    reserved_bytes_ -= op->file_bytes;
    ::unlinkat(op->tmp_dir, op->tmp_name.c_str(), 0);
    op->tmp_name.clear();
    return finish(op, std::move(st));
  }
  op->tmp_name.clear();
  reserved_bytes_ -= op->file_bytes;
  if (replaced_unauthenticated) forget_unauthenticated_locked(op->item.key);  // the rename replaced its file
  insert_locked(op->item.key, op->file_bytes, static_cast<std::uint32_t>(op->header_size), op->payload_bytes);
  // Room was made when this put started, counting the puts in flight then; puts that started before any of them
  // landed found nothing to evict (every object of the batch was still being written) and went over the capacity.
  // Now that this one is an object, older objects go until the tier fits again (the object written stays, whatever
  // its own write cost the others; a failed removal only leaves the tier over until the next put).
  if (Status s = make_room_locked(0, &op->item.key); !s.ok())
    log_line(fmt::format("over its capacity after put {}: {}", op->item.key.to_string(), s.to_string()));
  op->header.reset();
  if (config_.durability != Durability::kPowerLoss) return finish(op, Status::Ok(), op->payload_bytes);
  op->stage = IoOp::Stage::kDirSync;
  DirSync* ds = dir_syncs_[op->shard].get();
  ds->waiting.push_back(op);
  if (!ds->in_flight) submit_dir_sync(ds);
}

void DiskBackend::submit_dir_sync(DirSync* ds) {
  ds->covered.swap(ds->waiting);
  ds->waiting.clear();
  ds->in_flight = true;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_fsync(sqe, shard_fds_[ds->shard].get(), 0);
  io_uring_sqe_set_data(sqe, ds);
}

void DiskBackend::on_dir_sync_cqe(DirSync* ds, int res) {
  ds->in_flight = false;
  std::vector<IoOp*> covered;
  covered.swap(ds->covered);
  for (IoOp* op : covered) {
    // The object is visible already; a failed directory sync only weakens power-loss durability.
    if (res < 0)
      finish(op, fs_error(-res, fmt::format("fsync of directory {}", shard_dir(ds->shard))));
    else
      finish(op, Status::Ok(), op->payload_bytes);
  }
  if (!ds->waiting.empty()) submit_dir_sync(ds);
}

}  // namespace kvtier::storage::disk
