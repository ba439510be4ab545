// Local disk backend (see include/kvtier/storage/disk_backend.h for the contract).
#include "kvtier/storage/disk_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "storage/object_format.h"
#include "storage/region_set.h"

namespace kvtier::storage {
namespace {

constexpr std::uint64_t kAlign = 4096;
constexpr std::uint32_t kNumShards = 256;
constexpr const char* kObjectSuffix = ".kvo";
constexpr const char* kTmpMarker = ".kvo.tmp.";

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }
bool aligned(const void* p, std::uint64_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

void log_line(const std::string& s) { std::fprintf(stderr, "kvtier[storage/disk]: %s\n", s.c_str()); }

struct FreeDeleter {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuf = std::unique_ptr<std::byte, FreeDeleter>;
AlignedBuf alloc_aligned(std::uint64_t bytes) {
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

Status mkdir_p(const std::string& path) {
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return Unavailable(fmt::format("mkdir {}: {}", cur, errno_text(errno)));
  }
  return Status::Ok();
}

Result<StorageKey> parse_key_name(std::string_view name) {
  // "<32 hex>-r<rank>.kvo"
  if (name.size() < 32 + 2 + 1 + 4 || name.substr(name.size() - 4) != kObjectSuffix || name[32] != '-' ||
      name[33] != 'r')
    return InvalidArgument(fmt::format("not an object file name: {}", name));
  StorageKey k;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (int i = 0; i < 16; ++i) {
    int a = hex(name[2 * i]), b = hex(name[2 * i + 1]);
    if (a < 0 || b < 0) return InvalidArgument(fmt::format("bad hex in object file name: {}", name));
    k.digest[i] = static_cast<std::uint8_t>(a * 16 + b);
  }
  std::string_view rank = name.substr(34, name.size() - 34 - 4);
  if (rank.empty() || rank.size() > 10) return InvalidArgument(fmt::format("bad rank in {}", name));
  std::uint64_t r = 0;
  for (char c : rank) {
    if (c < '0' || c > '9') return InvalidArgument(fmt::format("bad rank in {}", name));
    r = r * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (r > UINT32_MAX) return InvalidArgument(fmt::format("bad rank in {}", name));
  k.rank = static_cast<std::uint32_t>(r);
  return k;
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
  std::string tmp_path;
  std::string final_path;
  std::uint32_t shard = 0;
  AlignedBuf header;  // header (direct payload) or header + payload (bounced)
  bool bounced = false;
  iovec iov[2] = {};
  int niov = 0;
  std::uint64_t file_offset = 0;  // next byte to transfer
  std::uint64_t total = 0;        // bytes to transfer
  std::uint64_t header_size = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t file_bytes = 0;   // bytes this put writes / the index records for a get
  std::uint64_t disk_bytes = 0;   // file size after the put (a recycled file may be longer)
  bool recycled = false;          // the put overwrites a file from the free pool
  bool reader_counted = false;    // a get registered in reading_
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
  DiskBackend(DiskBackendConfig config, StorageOptions options)
      : config_(std::move(config)), options_(std::move(options)) {
    ns_digest_ = format::namespace_digest(options_.ns);
  }

  ~DiskBackend() override {
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      stopping_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    if (ring_ready_) io_uring_queue_exit(&ring_);
  }

  Status init() {
    if (config_.root.empty()) return InvalidArgument("disk backend: empty root directory");
    if (config_.queue_depth == 0 || config_.queue_depth > 4096)
      return InvalidArgument(fmt::format("disk backend: queue_depth {} not in [1, 4096]", config_.queue_depth));
    dir_ = fmt::format("{}/{:016x}-{:016x}", config_.root, ns_digest_, options_.layout_fingerprint);
    KVTIER_RETURN_IF_ERROR(mkdir_p(dir_));
    KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/quarantine"));
    KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/incoming"));
    KVTIER_RETURN_IF_ERROR(mkdir_p(dir_ + "/free"));
    max_free_files_ = config_.max_free_files;
    lock_fd_ = ScopedFd(::open((dir_ + "/LOCK").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));
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

  std::string_view name() const noexcept override { return "disk"; }
  StorageCaps caps() const noexcept override {
    StorageCaps c;
    c.zero_copy_host = direct_;
    c.native_async = true;
    c.shared = false;
    c.cancellable = true;
    c.persistent = true;
    c.max_in_flight = config_.queue_depth;
    c.max_object_bytes = config_.capacity_bytes ? config_.capacity_bytes : (std::uint64_t{1} << 40);
    c.alignment = direct_ ? kAlign : 1;
    return c;
  }
  const StorageOptions& options() const noexcept override { return options_; }

  Status register_region(void* ptr, std::uint64_t bytes) override { return regions_.add(ptr, bytes); }
  Status unregister_region(void* ptr) override { return regions_.remove(ptr); }

  Result<StorageTicket> post(StorageBatch batch) override {
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      const StorageItem& it = batch.items[i];
      if ((batch.op == StorageOp::kGet || batch.op == StorageOp::kPut) && it.buffer == nullptr && it.bytes > 0)
        return InvalidArgument(fmt::format("{} item {}: null buffer for {} bytes", storage_op_name(batch.op), i,
                                           it.bytes));
      if (batch.op == StorageOp::kPut) {
        KVTIER_RETURN_IF_ERROR(format::check_payload_size(options_, it.bytes).with_context(fmt::format("put item {}", i)));
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

  Status cancel(const StorageTicket& ticket) override {
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

  StorageStats stats() const override {
    std::lock_guard<std::mutex> lk(index_mu_);
    StorageStats s;
    s.objects = index_.size();
    s.bytes = used_bytes_;
    s.capacity_bytes = config_.capacity_bytes;
    s.evictions = evictions_;
    s.quarantined = quarantined_;
    s.bounce_copies = bounce_copies_.load();
    return s;
  }

  Result<std::uint64_t> stored_object_bytes(const StorageKey& key) override {
    std::lock_guard<std::mutex> lk(index_mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return NotFound(fmt::format("key {} not stored", key.to_string()));
    return it->second.header_size + it->second.payload_bytes;
  }

  Status corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) override {
    std::lock_guard<std::mutex> lk(index_mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return NotFound(fmt::format("key {} not stored", key.to_string()));
    ScopedFd fd(::open(final_path(key).c_str(), O_RDWR | O_CLOEXEC));
    if (fd.get() < 0) return Unavailable(fmt::format("open {}: {}", final_path(key), errno_text(errno)));
    unsigned char b = 0;
    if (::pread(fd.get(), &b, 1, static_cast<off_t>(offset)) != 1)
      return OutOfRange(fmt::format("offset {} beyond object {}", offset, key.to_string()));
    b ^= xor_mask;
    if (::pwrite(fd.get(), &b, 1, static_cast<off_t>(offset)) != 1)
      return Unavailable(fmt::format("pwrite: {}", errno_text(errno)));
    return Status::Ok();
  }

 private:
  std::string shard_dir(std::uint32_t s) const { return fmt::format("{}/{:02x}", dir_, s); }
  std::string final_path(const StorageKey& k) const {
    return fmt::format("{}/{}{}", shard_dir(k.digest[0]), k.to_string(), kObjectSuffix);
  }

  void wake() {
    if (wake_fd_.get() >= 0) {
      std::uint64_t one = 1;
      ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
      (void)n;
    }
  }

  Status probe_direct_io() {
    direct_ = false;
    if (config_.direct_io == DirectIo::kOff) return Status::Ok();
    const std::string probe = dir_ + "/.direct_probe";
    ScopedFd fd(::open(probe.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_DIRECT | O_CLOEXEC, 0644));
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
    log_line(fmt::format("O_DIRECT refused on {} ({}); using buffered I/O", dir_, errno_text(err)));
    return Status::Ok();
  }

  // ---- index --------------------------------------------------------------

  void quarantine_locked(const StorageKey& key, const std::string& path, const std::string& why) {
    const std::string dst = fmt::format("{}/quarantine/{}.{}.{}", dir_, key.to_string(), ::getpid(), ++seq_);
    if (::rename(path.c_str(), dst.c_str()) != 0) ::unlink(path.c_str());
    ++quarantined_;
    log_line(fmt::format("quarantined {}: {}", path, why));
    auto it = index_.find(key);
    if (it != index_.end()) erase_locked(it);
  }

  void erase_locked(std::unordered_map<StorageKey, IndexEntry, StorageKeyHash>::iterator it) {
    used_bytes_ -= it->second.file_bytes;
    lru_.erase(it->second.lru);
    index_.erase(it);
  }

  void insert_locked(const StorageKey& key, std::uint64_t file_bytes, std::uint32_t header_size,
                     std::uint64_t payload_bytes) {
    auto it = index_.find(key);
    if (it != index_.end()) erase_locked(it);
    lru_.push_back(key);
    index_.emplace(key, IndexEntry{file_bytes, header_size, payload_bytes, std::prev(lru_.end())});
    used_bytes_ += file_bytes;
  }

  // Deletes LRU objects until `incoming` more bytes fit. Objects being read stay readable (open fds).
  void make_room_locked(std::uint64_t incoming) {
    if (config_.capacity_bytes == 0) return;
    while (!lru_.empty() && used_bytes_ + reserved_bytes_ + incoming > config_.capacity_bytes) {
      const StorageKey victim = lru_.front();
      auto it = index_.find(victim);
      recycle_or_unlink_locked(final_path(victim), it->second.file_bytes, victim);
      erase_locked(it);
      ++evictions_;
    }
  }

  // Files of deleted, evicted and replaced objects go to a small pool of free files that later puts
  // overwrite in place: creating a file costs ext4 an inode allocation (about a millisecond once many
  // files were deleted) and new blocks, overwriting costs neither. A file that a get may still be
  // reading is unlinked instead, so no reader ever sees its inode rewritten.
  void recycle_or_unlink_locked(const std::string& path, std::uint64_t bytes, const StorageKey& key) {
    auto r = reading_.find(key);
    if (free_files_.size() < max_free_files_ && (r == reading_.end() || r->second == 0)) {
      std::string dst = fmt::format("{}/free/{}.{}", dir_, ::getpid(), ++seq_);
      if (::rename(path.c_str(), dst.c_str()) == 0) {
        free_files_.emplace_back(std::move(dst), bytes);
        return;
      }
    }
    ::unlink(path.c_str());
  }

  Status rebuild_index() {
    struct Found {
      StorageKey key;
      std::uint64_t file_bytes;
      std::uint32_t header_size;
      std::uint64_t payload_bytes;
      std::int64_t mtime_ns;
    };
    std::vector<Found> found;
    AlignedBuf buf = alloc_aligned(kAlign);
    std::lock_guard<std::mutex> lk(index_mu_);
    for (std::uint32_t s = 0; s < kNumShards; ++s) {
      const std::string sd = shard_dir(s);
      DIR* d = ::opendir(sd.c_str());
      if (d == nullptr && errno == ENOENT) continue;
      if (d == nullptr) return Unavailable(fmt::format("opendir {}: {}", sd, errno_text(errno)));
      std::vector<std::string> names;
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") names.push_back(std::move(n));
      }
      ::closedir(d);
      for (const std::string& n : names) {
        const std::string path = sd + "/" + n;
        if (n.find(kTmpMarker) != std::string::npos) {
          ::unlink(path.c_str());  // a put that never committed
          ++removed_tmp_;
          continue;
        }
        auto key = parse_key_name(n);
        if (!key.ok() || key->digest[0] != s) {
          log_line(fmt::format("ignoring unexpected file {}", path));
          continue;
        }
        Status st = check_object_file(path, *key, buf);
        struct stat sb {};
        if (st.ok() && ::stat(path.c_str(), &sb) != 0) st = DataLoss(fmt::format("stat: {}", errno_text(errno)));
        if (!st.ok()) {
          quarantine_locked(*key, path, st.to_string());
          continue;
        }
        found.push_back({*key, static_cast<std::uint64_t>(sb.st_size), last_header_size_, last_payload_bytes_,
                         static_cast<std::int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec});
      }
    }
    if (DIR* d = ::opendir((dir_ + "/incoming").c_str())) {
      std::vector<std::string> names;
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") names.push_back(std::move(n));
      }
      ::closedir(d);
      for (const std::string& n : names) {
        ::unlink((dir_ + "/incoming/" + n).c_str());  // puts that never committed
        ++removed_tmp_;
      }
    }
    if (DIR* d = ::opendir((dir_ + "/free").c_str())) {
      std::vector<std::string> names;
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") names.push_back(std::move(n));
      }
      ::closedir(d);
      for (const std::string& n : names) {
        const std::string path = dir_ + "/free/" + n;
        struct stat sb {};
        if (free_files_.size() < max_free_files_ && ::stat(path.c_str(), &sb) == 0)
          free_files_.emplace_back(path, static_cast<std::uint64_t>(sb.st_size));
        else
          ::unlink(path.c_str());
      }
    }
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime_ns < b.mtime_ns; });
    for (const Found& f : found) insert_locked(f.key, f.file_bytes, f.header_size, f.payload_bytes);
    make_room_locked(0);
    if (removed_tmp_ > 0) log_line(fmt::format("removed {} uncommitted temporary files in {}", removed_tmp_, dir_));
    return Status::Ok();
  }

  // Reads and checks the header of one object file (and the payload when configured).
  Status check_object_file(const std::string& path, const StorageKey& key, AlignedBuf& buf) {
    ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) return DataLoss(fmt::format("open: {}", errno_text(errno)));
    struct stat sb {};
    if (::fstat(fd.get(), &sb) != 0) return DataLoss(fmt::format("fstat: {}", errno_text(errno)));
    std::uint64_t want = std::min<std::uint64_t>(kAlign, static_cast<std::uint64_t>(sb.st_size));
    std::vector<std::byte> big;
    std::byte* hdr = buf.get();
    ssize_t n = ::pread(fd.get(), hdr, want, 0);
    if (n < 0) return DataLoss(fmt::format("pread: {}", errno_text(errno)));
    std::uint32_t needed = 0;
    auto h = format::decode_header(hdr, static_cast<std::size_t>(n), &needed);
    if (!h.ok() && h.status().code() == StatusCode::kOutOfRange && needed <= sb.st_size) {
      big.resize(needed);
      if (::pread(fd.get(), big.data(), needed, 0) != static_cast<ssize_t>(needed))
        return DataLoss("short header read");
      hdr = big.data();
      h = format::decode_header(hdr, needed);
    }
    if (!h.ok()) return h.status().code() == StatusCode::kOutOfRange ? DataLoss(h.status().message()) : h.status();
    KVTIER_RETURN_IF_ERROR(format::check_identity(*h, ns_digest_, options_.layout_fingerprint, key));
    if (static_cast<std::uint64_t>(sb.st_size) < h->header_size + h->payload_bytes)
      return DataLoss(fmt::format("file of {} bytes shorter than header {} + payload {}", sb.st_size,
                                  h->header_size, h->payload_bytes));
    if (config_.verify_payload_on_open) {
      std::vector<std::byte> payload(h->payload_bytes);
      if (::pread(fd.get(), payload.data(), payload.size(), h->header_size) !=
          static_cast<ssize_t>(payload.size()))
        return DataLoss("short payload read");
      std::vector<std::byte> hcopy(hdr, hdr + h->header_size);
      KVTIER_RETURN_IF_ERROR(format::verify_object(hcopy.data(), *h, payload.data()));
    }
    last_header_size_ = h->header_size;
    last_payload_bytes_ = h->payload_bytes;
    return Status::Ok();
  }

  // ---- I/O thread ---------------------------------------------------------

  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_read(sqe, wake_fd_.get(), &wake_value_, sizeof(wake_value_), 0);
    io_uring_sqe_set_data(sqe, &wake_waiter_);
  }

  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  void finish(IoOp* op, Status st, std::uint64_t bytes = 0) {
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

  bool is_cancelled(const IoOp& op) {
    for (auto& c : cancel_requests_)
      if (c == op.completion) return true;
    return false;
  }

  void loop() {
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
        log_line(fmt::format("io_uring_wait_cqe: {}", errno_text(-rc)));
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
        switch (w->kind) {
          case Waiter::Kind::kWake: arm_wake(); break;
          case Waiter::Kind::kOp: on_op_cqe(static_cast<IoOp*>(w), res); break;
          case Waiter::Kind::kDirSync: on_dir_sync_cqe(static_cast<DirSync*>(w), res); break;
        }
      }
    }
  }

  void start(IoOp* op) {
    switch (op->op) {
      case StorageOp::kExists: {
        std::lock_guard<std::mutex> lk(index_mu_);
        auto it = index_.find(op->item.key);
        if (it == index_.end()) return finish(op, NotFound(fmt::format("key {} not stored", op->item.key.to_string())));
        return finish(op, Status::Ok(), it->second.payload_bytes);
      }
      case StorageOp::kDelete: {
        std::lock_guard<std::mutex> lk(index_mu_);
        auto it = index_.find(op->item.key);
        if (it == index_.end()) return finish(op, NotFound(fmt::format("key {} not stored", op->item.key.to_string())));
        recycle_or_unlink_locked(final_path(op->item.key), it->second.file_bytes, op->item.key);
        erase_locked(it);
        return finish(op, Status::Ok());
      }
      case StorageOp::kPut: return start_put(op);
      case StorageOp::kGet: return start_get(op);
    }
  }

  void start_put(IoOp* op) {
    const StorageKey& key = op->item.key;
    op->shard = key.digest[0];
    op->header_size = header_size_;
    op->payload_bytes = op->item.bytes;
    const bool direct_payload = direct_ && aligned(op->item.buffer, kAlign) && op->item.bytes % kAlign == 0;
    op->file_bytes = header_size_ + (direct_ ? align_up(op->item.bytes, kAlign) : op->item.bytes);
    std::uint64_t free_bytes = 0;
    {
      std::lock_guard<std::mutex> lk(index_mu_);
      if (config_.capacity_bytes && op->file_bytes > config_.capacity_bytes)
        return finish(op, ResourceExhausted(fmt::format("object of {} bytes exceeds the disk tier capacity of {}",
                                                        op->file_bytes, config_.capacity_bytes)));
      make_room_locked(op->file_bytes);
      reserved_bytes_ += op->file_bytes;
      // Reuse a free file unless it is much larger than this object (the tail would be wasted).
      if (!free_files_.empty() && free_files_.front().second <= 2 * op->file_bytes + kAlign) {
        op->tmp_path = std::move(free_files_.front().first);
        free_bytes = free_files_.front().second;
        free_files_.pop_front();
        op->recycled = true;
      } else if (!free_files_.empty()) {
        ::unlink(free_files_.front().first.c_str());
        free_files_.pop_front();
      }
    }
    op->disk_bytes = std::max(op->file_bytes, free_bytes);
    op->bounced = !direct_payload;
    op->header = alloc_aligned(op->bounced ? op->file_bytes : header_size_);
    if (!op->header) return fail_put(op, ResourceExhausted("out of memory for a bounce buffer"));
    Status st = format::encode_header(options_, ns_digest_, key, op->item.buffer, op->item.bytes,
                                      static_cast<std::uint32_t>(header_size_), op->header.get());
    if (!st.ok()) return fail_put(op, st);
    if (op->bounced) {
      ++bounce_copies_;
      if (op->item.bytes) std::memcpy(op->header.get() + header_size_, op->item.buffer, op->item.bytes);
      std::memset(op->header.get() + header_size_ + op->item.bytes, 0,
                  op->file_bytes - header_size_ - op->item.bytes);
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
      op->fd = ScopedFd(::open(op->tmp_path.c_str(), O_WRONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0)));
      if (op->fd.get() < 0) {
        ::unlink(op->tmp_path.c_str());
        op->recycled = false;
        op->disk_bytes = op->file_bytes;
      }
    }
    if (!op->recycled) {
      // New files share one directory: ext4 places a new file's blocks near its directory, so
      // concurrent puts write one region of the disk instead of one region per shard directory.
      op->tmp_path = fmt::format("{}/incoming/{}{}{}.{}", dir_, key.to_string(), kTmpMarker, ::getpid(), ++seq_);
      op->fd = ScopedFd(::open(op->tmp_path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0), 0644));
    }
    if (op->fd.get() < 0) {
      const int err = errno;
      return fail_put(op, err == ENOSPC ? ResourceExhausted(fmt::format("create {}: {}", op->tmp_path, errno_text(err)))
                                        : Unavailable(fmt::format("create {}: {}", op->tmp_path, errno_text(err))));
    }
    op->stage = IoOp::Stage::kWrite;
    op->total = op->file_bytes;
    op->file_offset = 0;
    submit_rw(op);
  }

  // Creates and opens shard directory s on first use (I/O thread).
  Status ensure_shard(std::uint32_t s) {
    if (shard_fds_[s].get() >= 0) return Status::Ok();
    const std::string sd = shard_dir(s);
    bool created = true;
    if (::mkdir(sd.c_str(), 0755) != 0) {
      const int err = errno;
      if (err != EEXIST)
        return err == ENOSPC ? ResourceExhausted(fmt::format("mkdir {}: {}", sd, errno_text(err)))
                             : Unavailable(fmt::format("mkdir {}: {}", sd, errno_text(err)));
      created = false;
    }
    int fd = ::open(sd.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Unavailable(fmt::format("open {}: {}", sd, errno_text(errno)));
    // A new shard directory must itself be durable before objects in it are acknowledged.
    if (created && config_.durability == Durability::kPowerLoss && ::fsync(dir_fd_.get()) != 0) {
      const int err = errno;
      ::close(fd);
      return Unavailable(fmt::format("fsync {}: {}", dir_, errno_text(err)));
    }
    shard_fds_[s].reset(fd);
    return Status::Ok();
  }

  void submit_rw(IoOp* op) {
    io_uring_sqe* sqe = get_sqe();
    if (op->op == StorageOp::kPut)
      io_uring_prep_writev(sqe, op->fd.get(), op->iov, op->niov, op->file_offset);
    else
      io_uring_prep_readv(sqe, op->fd.get(), op->iov, op->niov, op->file_offset);
    io_uring_sqe_set_data(sqe, op);
  }

  // Advances the iovecs past `n` transferred bytes (short transfer).
  static void advance(IoOp* op, std::uint64_t n) {
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

  void fail_put(IoOp* op, Status st) {
    if (op->fd.get() >= 0) op->fd.reset();
    if (!op->tmp_path.empty()) ::unlink(op->tmp_path.c_str());
    {
      std::lock_guard<std::mutex> lk(index_mu_);
      reserved_bytes_ -= op->file_bytes;
    }
    finish(op, std::move(st));
  }

  void on_op_cqe(IoOp* op, int res) {
    switch (op->stage) {
      case IoOp::Stage::kWrite: {
        if (res < 0)
          return fail_put(op, res == -ENOSPC || res == -EFBIG || res == -EDQUOT
                                  ? ResourceExhausted(fmt::format("write {}: {}", op->tmp_path,
                                                                             errno_text(-res)))
                                             : Unavailable(fmt::format("write {}: {}", op->tmp_path, errno_text(-res))));
        if (res == 0) return fail_put(op, ResourceExhausted(fmt::format("write {}: no progress", op->tmp_path)));
        if (op->file_offset + static_cast<std::uint64_t>(res) < op->total) {
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
        if (res < 0)
          return fail_put(op, res == -ENOSPC ? ResourceExhausted(fmt::format("fdatasync {}: {}", op->tmp_path,
                                                                             errno_text(-res)))
                                             : Unavailable(fmt::format("fdatasync {}: {}", op->tmp_path,
                                                                       errno_text(-res))));
        return commit_put(op);
      case IoOp::Stage::kDirSync: return;  // completions come through DirSync
      case IoOp::Stage::kRead: return on_read(op, res);
    }
  }

  void commit_put(IoOp* op) {
    op->fd.reset();
    std::lock_guard<std::mutex> lk(index_mu_);
    auto old = index_.find(op->item.key);
    // Replacing an object: swap atomically so that the old file can be recycled; else a plain rename.
    bool exchanged = false;
    if (old != index_.end()) {
      exchanged = ::renameat2(AT_FDCWD, op->tmp_path.c_str(), AT_FDCWD, op->final_path.c_str(), RENAME_EXCHANGE) == 0;
      if (exchanged) recycle_or_unlink_locked(op->tmp_path, old->second.file_bytes, op->item.key);
    }
    if (!exchanged && ::rename(op->tmp_path.c_str(), op->final_path.c_str()) != 0) {
      Status st = Unavailable(fmt::format("rename {} -> {}: {}", op->tmp_path, op->final_path, errno_text(errno)));
      reserved_bytes_ -= op->file_bytes;
      ::unlink(op->tmp_path.c_str());
      op->tmp_path.clear();
      return finish(op, std::move(st));
    }
    op->tmp_path.clear();
    reserved_bytes_ -= op->file_bytes;
    insert_locked(op->item.key, op->disk_bytes, static_cast<std::uint32_t>(op->header_size), op->payload_bytes);
    op->header.reset();
    if (config_.durability != Durability::kPowerLoss) return finish(op, Status::Ok(), op->payload_bytes);
    op->stage = IoOp::Stage::kDirSync;
    DirSync* ds = dir_syncs_[op->shard].get();
    ds->waiting.push_back(op);
    if (!ds->in_flight) submit_dir_sync(ds);
  }

  void submit_dir_sync(DirSync* ds) {
    ds->covered.swap(ds->waiting);
    ds->waiting.clear();
    ds->in_flight = true;
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_fsync(sqe, shard_fds_[ds->shard].get(), 0);
    io_uring_sqe_set_data(sqe, ds);
  }

  void on_dir_sync_cqe(DirSync* ds, int res) {
    ds->in_flight = false;
    std::vector<IoOp*> covered;
    covered.swap(ds->covered);
    for (IoOp* op : covered) {
      // The object is visible already; a failed directory sync only weakens power-loss durability.
      if (res < 0)
        finish(op, Unavailable(fmt::format("fsync of directory {}: {}", shard_dir(ds->shard), errno_text(-res))));
      else
        finish(op, Status::Ok(), op->payload_bytes);
    }
    if (!ds->waiting.empty()) submit_dir_sync(ds);
  }

  void start_get(IoOp* op) {
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
    const bool direct_payload = direct_ && aligned(op->item.buffer, kAlign) && op->payload_bytes % kAlign == 0 &&
                                op->header_size % kAlign == 0;
    op->fd = ScopedFd(::open(op->final_path.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0)));
    if (op->fd.get() < 0) {
      if (errno == ENOENT) return finish(op, NotFound(fmt::format("key {} was removed", key.to_string())));
      return finish(op, Unavailable(fmt::format("open {}: {}", op->final_path, errno_text(errno))));
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

  void on_read(IoOp* op, int res) {
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
    auto h = format::decode_header(hdr, op->header_size);
    if (!h.ok()) return quarantine_get(op, DataLoss(h.status().message()));
    Status st = format::check_identity(*h, ns_digest_, options_.layout_fingerprint, key);
    if (st.ok() && (h->header_size != op->header_size || h->payload_bytes != op->payload_bytes))
      st = DataLoss(fmt::format("object {} header says {}+{} bytes, index {}+{}", key.to_string(), h->header_size,
                                h->payload_bytes, op->header_size, op->payload_bytes));
    const void* payload = op->bounced ? static_cast<const void*>(hdr + op->header_size) : op->item.buffer;
    if (st.ok()) st = format::verify_object(hdr, *h, payload);
    if (!st.ok()) return quarantine_get(op, st);
    if (op->bounced && op->payload_bytes) std::memcpy(op->item.buffer, payload, op->payload_bytes);
    op->header.reset();
    finish(op, Status::Ok(), op->payload_bytes);
  }

  void quarantine_get(IoOp* op, Status st) {
    {
      std::lock_guard<std::mutex> lk(index_mu_);
      quarantine_locked(op->item.key, op->final_path, st.message());
    }
    finish(op, st.with_context("object quarantined"));
  }

  DiskBackendConfig config_;
  StorageOptions options_;
  std::uint64_t ns_digest_ = 0;
  std::string dir_;
  bool direct_ = false;
  bool journal_covers_direct_ = false;
  std::string fs_type_;
  std::uint64_t header_size_ = kAlign;
  ScopedFd lock_fd_;
  ScopedFd dir_fd_;
  std::vector<ScopedFd> shard_fds_;
  std::vector<std::unique_ptr<DirSync>> dir_syncs_;

  RegionSet regions_;

  mutable std::mutex index_mu_;
  std::unordered_map<StorageKey, IndexEntry, StorageKeyHash> index_;
  std::list<StorageKey> lru_;  // front = least recently used
  std::uint64_t used_bytes_ = 0;
  std::deque<std::pair<std::string, std::uint64_t>> free_files_;  // recyclable files and their sizes
  std::size_t max_free_files_ = 0;
  std::unordered_map<StorageKey, int, StorageKeyHash> reading_;    // gets in flight per key
  std::uint64_t reserved_bytes_ = 0;
  std::uint64_t evictions_ = 0;
  std::uint64_t quarantined_ = 0;
  std::uint64_t removed_tmp_ = 0;
  std::uint64_t seq_ = 0;
  std::uint32_t last_header_size_ = 0;
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

}  // namespace

Result<std::unique_ptr<StorageBackend>> create_disk_backend(DiskBackendConfig config, StorageOptions options) {
  auto b = std::make_unique<DiskBackend>(std::move(config), std::move(options));
  KVTIER_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<StorageBackend>(std::move(b));
}

}  // namespace kvtier::storage
