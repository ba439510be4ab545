// A get on the disk backend's I/O thread: the object's sizes from the index,
// a read of header and payload (the payload straight into the caller's
// buffer under O_DIRECT when aligned, else through a bounce buffer), then the
// header and payload checks; an object that fails them, or a read failing
// with EIO, is quarantined and the get fails.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "storage/disk/disk_backend_impl.h"
#include "storage/object_format.h"

namespace kvtier::storage::disk {

void DiskBackend::start_get(IoOp* op) {
  const StorageKey& key = op->item.key;
  {
    std::lock_guard<std::mutex> lk(index_mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return finish(op, NotFound(fmt::format("key {} not stored", key.to_string())));
    op->header_size = it->second.header_size;
    op->payload_bytes = it->second.payload_bytes;
    op->file_bytes = it->second.file_bytes;
    lru_.splice(lru_.end(), lru_, it->second.lru);  // touch
  }
  if (op->payload_bytes > op->item.bytes)
    return finish(op, InvalidArgument(fmt::format("get {}: object of {} bytes > destination capacity {}",
                                                  key.to_string(), op->payload_bytes, op->item.bytes)));
  op->final_path = final_path(key);
  const bool direct_payload =
      direct_ && aligned(op->item.buffer, kAlign) && op->payload_bytes % kAlign == 0 && op->header_size % kAlign == 0;
  struct stat sb {};
  auto fd = open_regular(shard_fd(key), object_name(key), op->final_path, O_RDONLY | (direct_ ? O_DIRECT : 0), &sb);
  if (!fd.ok()) {
    if (fd.status().code() == StatusCode::kNotFound) {
      // Removed under the tier: the index forgets it (exists() answered yes, and an engine that asks before it
      // stores would never store it again). Checked under the index lock, which a put's commit also holds.
      std::lock_guard<std::mutex> lk(index_mu_);
      struct stat gone {};
      auto it = index_.find(key);
      if (it != index_.end() && ::fstatat(shard_fd(key), object_name(key).c_str(), &gone, AT_SYMLINK_NOFOLLOW) != 0 &&
          errno == ENOENT)
        erase_locked(it);
      return finish(op, NotFound(fmt::format("key {} was removed", key.to_string())));
    }
    // A FIFO, device or symlink put under the object's name: never read from it.
    if (fd.status().code() == StatusCode::kDataLoss) return quarantine_get(op, fd.status());
    return finish(op, fd.status());
  }
  op->fd = std::move(fd).value();
  if (struct stat sb{}; ::fstat(op->fd.get(), &sb) == 0) {
    op->read_dev = sb.st_dev;
    op->read_ino = sb.st_ino;
    op->read_file_known = true;
  }
  {
    std::lock_guard<std::mutex> lk(index_mu_);
    ++reading_[key];
  }
  op->reader_counted = true;
  op->bounced = !direct_payload;
  op->total = op->header_size + op->payload_bytes;
  if (op->bounced) {
    ++bounce_copies_;
    const std::uint64_t len = direct_ ? align_up(op->total, kAlign) : op->total;
    op->header = alloc_aligned(len);
    if (!op->header) return finish(op, ResourceExhausted("out of memory for a bounce buffer"));
    op->iov[0] = {op->header.get(), len};
    op->niov = 1;
    op->total = std::min<std::uint64_t>(len, op->file_bytes);
  } else {
    op->header = alloc_aligned(op->header_size);
    if (!op->header) return finish(op, ResourceExhausted("out of memory for a header buffer"));
    op->iov[0] = {op->header.get(), op->header_size};
    op->iov[1] = {op->item.buffer, op->payload_bytes};
    op->niov = op->payload_bytes ? 2 : 1;
  }
  op->stage = IoOp::Stage::kRead;
  op->file_offset = 0;
  submit_rw(op);
}

void DiskBackend::on_read(IoOp* op, int res) {
  const StorageKey& key = op->item.key;
  if (res < 0) {
    if (res == -EIO) return quarantine_get(op, DataLoss(fmt::format("read {}: {}", op->final_path, errno_text(-res))));
    return finish(op, Unavailable(fmt::format("read {}: {}", op->final_path, errno_text(-res))));
  }
  if (res > 0 && op->file_offset + static_cast<std::uint64_t>(res) < op->total) {
    advance(op, static_cast<std::uint64_t>(res));
    return submit_rw(op);
  }
  const std::uint64_t got = op->file_offset + static_cast<std::uint64_t>(res);
  op->fd.reset();
  if (got < op->header_size + op->payload_bytes)
    return quarantine_get(op, DataLoss(fmt::format("object {} is truncated: {} of {} bytes", key.to_string(), got,
                                                   op->header_size + op->payload_bytes)));
  const std::byte* hdr = op->header.get();
  auto h = format::decode_header(hdr, op->header_size, nullptr, options_.tenant_secret);
  if (!h.ok()) return quarantine_get(op, DataLoss(h.status().message()));
  Status st = format::check_identity(*h, ns_digest_, options_.layout_fingerprint, key);
  if (st.ok() && (h->header_size != op->header_size || h->payload_bytes != op->payload_bytes))
    st = DataLoss(fmt::format("object {} header says {}+{} bytes, index {}+{}", key.to_string(), h->header_size,
                              h->payload_bytes, op->header_size, op->payload_bytes));
  const void* payload = op->bounced ? static_cast<const void*>(hdr + op->header_size) : op->item.buffer;
  if (st.ok()) st = format::verify_object(hdr, *h, payload, options_.tenant_secret);
  if (!st.ok()) return quarantine_get(op, st);
  if (op->bounced && op->payload_bytes) std::memcpy(op->item.buffer, payload, op->payload_bytes);
  op->header.reset();
  finish(op, Status::Ok(), op->payload_bytes);
}

void DiskBackend::quarantine_get(IoOp* op, Status st) {
  {
    std::lock_guard<std::mutex> lk(index_mu_);
    // Quarantine works by name. A put that replaced the object while this get read the old file has put a new,
    // acknowledged file under the name (the old one left the directory): that one is not what failed here.
    struct stat now {};
    const bool replaced =
        op->read_file_known &&
        ::fstatat(shard_fd(op->item.key), object_name(op->item.key).c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        (now.st_dev != op->read_dev || now.st_ino != op->read_ino);
    if (replaced) {
      log_line(fmt::format("{} failed a get ({}), but a put replaced it meanwhile: the new object stays",
                           op->final_path, st.to_string()));
      st = st.with_context("the object read was replaced meanwhile");
    } else {
      quarantine_locked(op->item.key, st);
      st = st.with_context("object quarantined");
    }
  }
  finish(op, std::move(st));
}

}  // namespace kvtier::storage::disk
