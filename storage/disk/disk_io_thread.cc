// The disk backend's I/O thread: the loop that owns the io_uring ring (takes
// queued items, applies cancel requests, keeps at most queue_depth ops in
// flight, reaps completions and routes each to its op or directory sync),
// the start of every op (exists and delete answered from the index, puts
// and gets started in disk_put.cc and disk_get.cc), and the helpers both
// paths share: ring submissions, short-transfer advance, and finish(). Every
// completion passes here, so the tests' fault injector (disk_fault.h) sits here.
#include <fmt/format.h>
#include <liburing.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kvtier/testing/disk_fault.h"
#include "storage/disk/disk_backend_impl.h"

namespace kvtier::storage::disk {

namespace {

// The completion of `w` as a fault injector sees it (tests only: DiskBackendConfig::fault_injector).
int injected_result(DiskFaultInjector& f, Waiter* w, int res) {
  DiskFaultEvent ev;
  std::vector<StorageKey> keys;
  if (w->kind == Waiter::Kind::kDirSync) {
    ev.op = DiskFaultOp::kDirSync;
    for (const IoOp* op : static_cast<DirSync*>(w)->covered) keys.push_back(op->item.key);
  } else {
    const IoOp* op = static_cast<IoOp*>(w);
    switch (op->stage) {
      case IoOp::Stage::kRead: ev.op = DiskFaultOp::kRead; break;
      case IoOp::Stage::kWrite: ev.op = DiskFaultOp::kWrite; break;
      case IoOp::Stage::kFileSync: ev.op = DiskFaultOp::kFileSync; break;
      case IoOp::Stage::kDirSync: return res;  // ops wait in their DirSync; it has the completion
    }
    keys.push_back(op->item.key);
    ev.fd = op->fd.get();
    ev.offset = op->file_offset;
    ev.iov = op->iov;
    ev.niov = op->niov;
  }
  ev.keys = keys;
  return f.on_completion(ev, res);
}

}  // namespace

// ---- I/O thread ---------------------------------------------------------

void DiskBackend::arm_wake() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  io_uring_prep_read(sqe, wake_fd_.get(), &wake_value_, sizeof(wake_value_), 0);
  io_uring_sqe_set_data(sqe, &wake_waiter_);
}

io_uring_sqe* DiskBackend::get_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  return sqe;
}

void DiskBackend::finish(IoOp* op, Status st, std::uint64_t bytes) {
  if (op->reader_counted) {
    std::lock_guard<std::mutex> lk(index_mu_);
    auto r = reading_.find(op->item.key);
    if (r != reading_.end() && --r->second == 0) reading_.erase(r);
    op->reader_counted = false;
  }
  op->completion->complete(op->index, std::move(st), bytes);
  auto it = live_.find(op);
  if (it != live_.end()) live_.erase(it);
}

bool DiskBackend::is_cancelled(const IoOp& op) {
  for (auto& c : cancel_requests_)
    if (c == op.completion) return true;
  return false;
}

void DiskBackend::loop() {
  arm_wake();
  io_uring_submit(&ring_);
  for (;;) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      while (!incoming_.empty()) {
        pending_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
      stopping = stopping_;
      // Cancel requests only concern items that have not started.
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (is_cancelled(**it)) {
          (*it)->completion->complete((*it)->index, Cancelled("cancelled before it started"));
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      cancel_requests_.clear();
    }
    if (stopping) {
      for (auto& op : pending_) op->completion->complete(op->index, Cancelled("disk backend shut down"));
      pending_.clear();
    }
    while (!pending_.empty() && live_.size() < config_.queue_depth) {
      std::unique_ptr<IoOp> op = std::move(pending_.front());
      pending_.pop_front();
      IoOp* raw = op.get();
      live_.emplace(raw, std::move(op));
      start(raw);
    }
    if (stopping && live_.empty()) break;
    io_uring_submit(&ring_);
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(&ring_, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      log_line(fmt::format("io_uring_wait_cqe: {}", errno_text(-rc)), LogLevel::kError);
      continue;
    }
    unsigned head;
    unsigned count = 0;
    std::vector<std::pair<Waiter*, int>> done;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      done.emplace_back(static_cast<Waiter*>(io_uring_cqe_get_data(cqe)), cqe->res);
      ++count;
    }
    io_uring_cq_advance(&ring_, count);
    for (auto& [w, res] : done) {
      if (config_.fault_injector != nullptr && w->kind != Waiter::Kind::kWake) [[unlikely]]
        res = injected_result(*config_.fault_injector, w, res);
      switch (w->kind) {
        case Waiter::Kind::kWake: arm_wake(); break;
        case Waiter::Kind::kOp: on_op_cqe(static_cast<IoOp*>(w), res); break;
        case Waiter::Kind::kDirSync: on_dir_sync_cqe(static_cast<DirSync*>(w), res); break;
      }
    }
  }
}

void DiskBackend::start(IoOp* op) {
  switch (op->op) {
    case StorageOp::kExists: {
      std::lock_guard<std::mutex> lk(index_mu_);
      auto it = index_.find(op->item.key);
      if (it == index_.end()) return finish(op, NotFound(fmt::format("key {} not stored", op->item.key.to_string())));
      // A file removed under the tier is forgotten (an engine that asks before it stores would never store it
      // again).
      struct stat sb {};
      if (::fstatat(shard_fd(op->item.key), object_name(op->item.key).c_str(), &sb, AT_SYMLINK_NOFOLLOW) != 0 &&
          errno == ENOENT) {
        erase_locked(it);
        return finish(op, NotFound(fmt::format("key {} was removed", op->item.key.to_string())));
      }
      // A use, as a get is (and as on the memory tier): an engine asks before it reads, e.g. SGLang's prefetch
      // of a queued request, and what it asked for should not be the next object evicted.
      lru_.splice(lru_.end(), lru_, it->second.lru);
      return finish(op, Status::Ok(), it->second.payload_bytes);
    }
    case StorageOp::kDelete: {
      std::lock_guard<std::mutex> lk(index_mu_);
      auto it = index_.find(op->item.key);
      if (it == index_.end()) return finish(op, NotFound(fmt::format("key {} not stored", op->item.key.to_string())));
      // A file that cannot be removed keeps its index entry: reported deleted, it was served again after a restart.
      Status s = recycle_or_unlink_locked(shard_fd(op->item.key), object_name(op->item.key), it->second.file_bytes,
                                          op->item.key, final_path(op->item.key));
      if (!s.ok()) return finish(op, s.with_context(fmt::format("delete {}", op->item.key.to_string())));
      erase_locked(it);
      return finish(op, Status::Ok());
    }
    case StorageOp::kPut: return start_put(op);
    case StorageOp::kGet: return start_get(op);
  }
}

void DiskBackend::submit_rw(IoOp* op) {
  io_uring_sqe* sqe = get_sqe();
  if (op->op == StorageOp::kPut)
    io_uring_prep_writev(sqe, op->fd.get(), op->iov, op->niov, op->file_offset);
  else
    io_uring_prep_readv(sqe, op->fd.get(), op->iov, op->niov, op->file_offset);
  io_uring_sqe_set_data(sqe, op);
}

// Advances the iovecs past `n` transferred bytes (short transfer).
void DiskBackend::advance(IoOp* op, std::uint64_t n) {
  op->file_offset += n;
  int i = 0;
  while (i < op->niov && n >= op->iov[i].iov_len) n -= op->iov[i++].iov_len;
  int k = 0;
  for (; i < op->niov; ++i, ++k) {
    op->iov[k] = op->iov[i];
    if (k == 0) {
      op->iov[0].iov_base = static_cast<std::byte*>(op->iov[0].iov_base) + n;
      op->iov[0].iov_len -= n;
    }
  }
  op->niov = k;
}

}  // namespace kvtier::storage::disk
