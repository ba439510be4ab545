#include "kvtier/testing/disk_fault.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

namespace kvtier::storage {

struct DiskFaultInjector::Impl {
  struct Rule {
    DiskFaultRule rule;
    std::uint64_t matches = 0;
    std::uint64_t hits = 0;
  };
  std::mutex mu;
  std::vector<Rule> rules;
  std::mt19937_64 rng;
  std::array<std::uint64_t, kNumDiskFaultOps> seen{};
  std::array<std::uint64_t, kNumDiskFaultOps> injected{};
};

DiskFaultInjector::DiskFaultInjector(std::uint64_t seed) : impl_(std::make_unique<Impl>()) { impl_->rng.seed(seed); }
DiskFaultInjector::~DiskFaultInjector() = default;

void DiskFaultInjector::add(const DiskFaultRule& rule) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->rules.push_back({rule});
}

void DiskFaultInjector::clear() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->rules.clear();
}

std::uint64_t DiskFaultInjector::seen(DiskFaultOp op) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->seen[static_cast<int>(op)];
}

std::uint64_t DiskFaultInjector::injected(DiskFaultOp op) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->injected[static_cast<int>(op)];
}

namespace {

// The bytes [from, to) of a completed read never arrived: garbage where they were.
void scribble(const DiskFaultEvent& ev, std::uint64_t from, std::uint64_t to) {
  std::uint64_t pos = 0;
  for (int i = 0; i < ev.niov && pos < to; ++i) {
    const std::uint64_t len = ev.iov[i].iov_len;
    const std::uint64_t lo = std::max(pos, from), hi = std::min(pos + len, to);
    if (lo < hi) std::memset(static_cast<std::byte*>(ev.iov[i].iov_base) + (lo - pos), 0xa5, hi - lo);
    pos += len;
  }
}

}  // namespace

int DiskFaultInjector::on_completion(const DiskFaultEvent& ev, int res) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  ++impl_->seen[static_cast<int>(ev.op)];
  for (Impl::Rule& r : impl_->rules) {
    const DiskFaultRule& rule = r.rule;
    if (rule.op != ev.op || r.hits >= rule.max_hits) continue;
    if (rule.key && std::find(ev.keys.begin(), ev.keys.end(), *rule.key) == ev.keys.end()) continue;
    // A short transfer needs bytes to cut, and an error of a call that failed already changes nothing.
    if (rule.action == DiskFaultAction::kShort &&
        (res <= 0 || (ev.op != DiskFaultOp::kRead && ev.op != DiskFaultOp::kWrite)))
      continue;
    if (rule.action == DiskFaultAction::kError && res < 0) continue;
    const std::uint64_t m = ++r.matches;
    if (rule.nth != 0 && m != rule.nth) continue;
    if (rule.every_nth != 0 && m % rule.every_nth != 0) continue;
    if (rule.probability < 1.0 && std::uniform_real_distribution<double>(0.0, 1.0)(impl_->rng) >= rule.probability)
      continue;
    const auto done = static_cast<std::uint64_t>(res);
    std::uint64_t kept = 0;
    if (rule.action == DiskFaultAction::kShort) {
      kept = static_cast<std::uint64_t>(static_cast<double>(done) * std::clamp(rule.keep, 0.0, 1.0));
      if (rule.align > 1) kept -= kept % rule.align;
      if (kept >= done) kept = done - 1;  // short means short
      // A transfer of 0 bytes is an end of file or no progress, not a short transfer: only keep = 0 asks for it
      // (too few bytes left to cut, or none on an aligned boundary: the completion passes unchanged).
      if (kept == 0 && rule.keep > 0) continue;
    }
    ++r.hits;
    ++impl_->injected[static_cast<int>(ev.op)];
    if (rule.action == DiskFaultAction::kError) return -rule.error;
    if (ev.op == DiskFaultOp::kWrite && ev.fd >= 0)
      // The tail never reached the file. Punching works at any offset and on O_DIRECT files.
      (void)::fallocate(ev.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(ev.offset + kept),
                        static_cast<off_t>(done - kept));
    if (ev.op == DiskFaultOp::kRead) scribble(ev, kept, done);
    return static_cast<int>(kept);
  }
  return res;
}

int fsync_directory(DiskFaultInjector* injector, int fd) {
  const int res = ::fsync(fd) == 0 ? 0 : -errno;
  if (injector == nullptr) return res;
  DiskFaultEvent ev;
  ev.op = DiskFaultOp::kDirSync;
  ev.fd = fd;
  return injector->on_completion(ev, res);
}

int create_at(DiskFaultInjector* injector, DiskFaultOp op, int dirfd, const char* name, int flags, unsigned mode,
              std::span<const StorageKey> keys) {
  const int fd = ::openat(dirfd, name, flags, static_cast<mode_t>(mode));
  const int res = fd >= 0 ? fd : -errno;
  if (injector == nullptr) return res;
  DiskFaultEvent ev;
  ev.op = op;
  ev.keys = keys;
  ev.fd = fd;
  const int got = injector->on_completion(ev, res);
  if (got >= 0 || fd < 0) return got;
  ::close(fd);
  if ((flags & O_EXCL) != 0) ::unlinkat(dirfd, name, 0);
  return got;
}

int mkdir_at(DiskFaultInjector* injector, int dirfd, const char* name, unsigned mode) {
  const int res = ::mkdirat(dirfd, name, static_cast<mode_t>(mode)) == 0 ? 0 : -errno;
  if (injector == nullptr) return res;
  DiskFaultEvent ev;
  ev.op = DiskFaultOp::kCreate;
  const int got = injector->on_completion(ev, res);
  if (got < 0 && res == 0) ::unlinkat(dirfd, name, AT_REMOVEDIR);
  return got;
}

}  // namespace kvtier::storage
