#include "device/pinned.h"

#include <fmt/format.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier::detail {
namespace {

constexpr std::uint64_t kTouchStride = 4096;
// Pages one touch thread writes between two cancellation checks (64 MiB).
constexpr std::uint64_t kTouchPagesPerCheck = 16384;
// Below this many bytes per thread, extra touch threads cost more than they save.
constexpr std::uint64_t kMinTouchBytesPerThread = std::uint64_t{16} << 20;
constexpr unsigned kMaxDefaultTouchThreads = 16;
// Upper bound for an explicit touch_threads (more only adds thread start-up cost).
constexpr std::uint64_t kMaxTouchThreads = 256;

std::uint64_t page_size() {
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<std::uint64_t>(page) : 4096;
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string allowed_nodes_text() {
  std::string text;
  const int max_node = numa_max_node();
  for (int node = 0; node <= max_node; ++node) {
    if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node))) {
      if (!text.empty()) text += ",";
      text += std::to_string(node);
    }
  }
  return text.empty() ? "none" : text;
}

// Waits on `cv` for `pred`, treating huge timeouts as "forever" (steady_clock
// arithmetic would overflow). Returns pred().
template <typename Pred>
bool wait_with_timeout(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                       std::chrono::milliseconds timeout, Pred pred) {
  if (timeout >= std::chrono::hours(24 * 365)) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_for(lock, timeout, pred);
}

class PinnedRegion final : public PinnedMemory {
 public:
  PinnedRegion(std::byte* data, std::uint64_t bytes, std::uint64_t map_bytes, bool borrowed,
               const PinnedOptions& options, ChunkRegistrar registrar)
      : data_(data),
        size_(bytes),
        map_bytes_(map_bytes),
        borrowed_(borrowed),
        options_(options),
        registrar_(std::move(registrar)) {}

  ~PinnedRegion() override {
    cancel_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
    // The join (or the synchronous path) orders every write to registered_.
    for (auto it = registered_.rbegin(); it != registered_.rend(); ++it) {
      if (registrar_.unregister_chunk) registrar_.unregister_chunk(it->first, it->second);
    }
    if (!borrowed_ && data_ != nullptr) ::munmap(data_, map_bytes_);
  }

  std::byte* data() const noexcept override { return data_; }
  std::uint64_t size() const noexcept override { return size_; }
  bool borrowed() const noexcept override { return borrowed_; }
  std::uint64_t bytes_ready() const noexcept override { return bytes_ready_.load(std::memory_order_acquire); }

  Status wait_ready(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!wait_with_timeout(done_cv_, lock, timeout, [&] { return done_; })) {
      return TimedOut(fmt::format("pinned memory at {} not ready after {} ms ({} of {} bytes registered)",
                                  static_cast<const void*>(data_), timeout.count(), bytes_ready(), size_));
    }
    return result_;
  }

  // Binds owned memory to the NUMA node (before any page is touched).
  Status bind() {
    if (borrowed_ || options_.numa_node < 0) return Status::Ok();
    const auto node = static_cast<unsigned>(options_.numa_node);
    const std::size_t bits_per_word = 8 * sizeof(unsigned long);
    std::vector<unsigned long> mask(node / bits_per_word + 1, 0UL);
    mask[node / bits_per_word] |= 1UL << (node % bits_per_word);
    // maxnode counts bits and the kernel ignores the last one: pass one more.
    if (::mbind(data_, map_bytes_, MPOL_BIND, mask.data(), mask.size() * bits_per_word + 1, 0) != 0) {
      const int err = errno;
      std::string message =
          fmt::format("mbind(MPOL_BIND, numa_node={}, {} bytes) failed: {}", node, map_bytes_, errno_text(err));
      return err == EINVAL ? InvalidArgument(std::move(message)) : Unavailable(std::move(message));
    }
    return Status::Ok();
  }

  // Runs touch + registration on this thread (background=false) or on a
  // background thread.
  Status start() {
    if (!options_.background) {
      Status status = run();
      finish(status);
      return status;
    }
    try {
      thread_ = std::thread([this] { finish(run()); });
    } catch (const std::system_error& e) {
      return ResourceExhausted(fmt::format("cannot start the pinned registration thread: {}", e.what()));
    }
    return Status::Ok();
  }

 private:
  Status run() {
    if (!borrowed_) touch();
    if (cancelled()) return Cancelled("pinned memory destroyed before it was ready");
    return register_chunks();
  }

  bool cancelled() const { return cancel_.load(std::memory_order_relaxed); }

  void touch_pages(std::uint64_t first_page, std::uint64_t end_page) {
    for (std::uint64_t page = first_page; page < end_page; ++page) {
      if ((page - first_page) % kTouchPagesPerCheck == 0 && cancelled()) return;
      data_[page * kTouchStride] = std::byte{0};
    }
  }

  void touch() {
    const std::uint64_t pages = (size_ + kTouchStride - 1) / kTouchStride;
    std::uint64_t threads = options_.touch_threads;
    if (threads == 0) {
      threads = std::clamp<std::uint64_t>(std::thread::hardware_concurrency(), 1, kMaxDefaultTouchThreads);
      threads = std::min<std::uint64_t>(threads, std::max<std::uint64_t>(1, size_ / kMinTouchBytesPerThread));
    }
    threads = std::clamp<std::uint64_t>(threads, 1, std::min(pages, kMaxTouchThreads));
    const std::uint64_t per_thread = (pages + threads - 1) / threads;
    std::vector<std::thread> workers;
    std::uint64_t inline_from = pages;  // slices a thread could not be started for
    for (std::uint64_t t = 1; t < threads; ++t) {
      const std::uint64_t first = std::min(pages, t * per_thread);
      const std::uint64_t end = std::min(pages, first + per_thread);
      try {
        workers.emplace_back([this, first, end] { touch_pages(first, end); });
      } catch (const std::system_error&) {
        inline_from = first;  // touch the rest here
        break;
      }
    }
    touch_pages(0, std::min(pages, per_thread));
    if (inline_from < pages) touch_pages(inline_from, pages);
    for (auto& worker : workers) worker.join();
  }

  Status register_chunks() {
    const std::uint64_t page = page_size();
    const std::uint64_t chunk = std::max(page, options_.chunk_bytes / page * page);
    const auto begin = reinterpret_cast<std::uintptr_t>(data_);
    const std::uintptr_t end = begin + size_;
    std::uintptr_t cursor = begin;
    std::uint64_t index = 0;
    while (cursor < end) {
      if (cancelled()) return Cancelled("pinned memory destroyed before it was ready");
      // Next boundary: a multiple of `chunk` counted from the page holding `begin`.
      const std::uintptr_t origin = begin / page * page;
      const std::uintptr_t boundary = origin + ((cursor - origin) / chunk + 1) * chunk;
      const std::uintptr_t stop = std::min(end, boundary);
      void* ptr = reinterpret_cast<void*>(cursor);
      const std::uint64_t bytes = stop - cursor;
      if (registrar_.register_chunk) {
        Status status = registrar_.register_chunk(ptr, bytes);
        if (!status.ok()) {
          return status.with_context(fmt::format("registering chunk {} [{}, +{} bytes) of {} bytes at {}", index, ptr,
                                                 bytes, size_, static_cast<const void*>(data_)));
        }
      }
      registered_.emplace_back(ptr, bytes);
      bytes_ready_.fetch_add(bytes, std::memory_order_release);
      cursor = stop;
      ++index;
    }
    return Status::Ok();
  }

  void finish(Status status) {
    {
      std::lock_guard lock(mu_);
      result_ = std::move(status);
      done_ = true;
    }
    done_cv_.notify_all();
  }

  std::byte* const data_;
  const std::uint64_t size_;
  const std::uint64_t map_bytes_;  // owned mapping length (page multiple)
  const bool borrowed_;
  const PinnedOptions options_;
  const ChunkRegistrar registrar_;

  std::vector<std::pair<void*, std::uint64_t>> registered_;  // written by the registering thread only
  std::atomic<std::uint64_t> bytes_ready_{0};
  std::atomic<bool> cancel_{false};
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;  // guarded by mu_
  KeptStatus result_;  // guarded by mu_
  std::thread thread_;
};

}  // namespace

Status validate_pinned_options(const PinnedOptions& options) {
  if (options.chunk_bytes == 0) return InvalidArgument("pinned chunk_bytes 0: must be >= 1");
  if (options.chunk_bytes > kMaxPinnedChunkBytes) {
    return InvalidArgument(fmt::format("pinned chunk_bytes {} exceeds the 64 GiB registration limit ({})",
                                       options.chunk_bytes, kMaxPinnedChunkBytes));
  }
  if (options.numa_node < -1) {
    return InvalidArgument(fmt::format("numa_node {}: must be -1 (no binding) or a node id", options.numa_node));
  }
  if (options.numa_node >= 0) {
    if (numa_available() < 0) {
      return InvalidArgument(
          fmt::format("numa_node {} requested but NUMA is not available on this system", options.numa_node));
    }
    if (options.numa_node > numa_max_node() ||
        !numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(options.numa_node))) {
      return InvalidArgument(fmt::format("numa_node {} does not exist or has no memory for this process (nodes: {})",
                                         options.numa_node, allowed_nodes_text()));
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<PinnedMemory>> allocate_pinned_memory(std::uint64_t bytes, const PinnedOptions& options,
                                                             ChunkRegistrar registrar) {
  if (bytes == 0) return InvalidArgument("allocate_pinned: bytes is 0");
  KVTIER_RETURN_IF_ERROR(validate_pinned_options(options));
  const std::uint64_t page = page_size();
  if (bytes > UINT64_MAX - page) return InvalidArgument(fmt::format("allocate_pinned: bytes {} too large", bytes));
  const std::uint64_t map_bytes = (bytes + page - 1) / page * page;
  void* ptr = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    return ResourceExhausted(fmt::format("allocate_pinned: mmap of {} bytes failed: {}", map_bytes, errno_text(errno)));
  }
  auto region = std::make_unique<PinnedRegion>(static_cast<std::byte*>(ptr), bytes, map_bytes, /*borrowed=*/false,
                                               options, std::move(registrar));
  KVTIER_RETURN_IF_ERROR(region->bind());
  KVTIER_RETURN_IF_ERROR(region->start());
  return std::unique_ptr<PinnedMemory>(std::move(region));
}

Result<std::unique_ptr<PinnedMemory>> register_host_memory(void* data, std::uint64_t bytes,
                                                           const PinnedOptions& options, ChunkRegistrar registrar) {
  if (data == nullptr) return InvalidArgument(fmt::format("register_host: data is null ({} bytes)", bytes));
  if (bytes == 0) return InvalidArgument(fmt::format("register_host: bytes is 0 (data={})", data));
  if (reinterpret_cast<std::uintptr_t>(data) > UINTPTR_MAX - bytes) {
    return InvalidArgument(fmt::format("register_host: range {} + {} bytes wraps around", data, bytes));
  }
  KVTIER_RETURN_IF_ERROR(validate_pinned_options(options));
  auto region = std::make_unique<PinnedRegion>(static_cast<std::byte*>(data), bytes, /*map_bytes=*/0,
                                               /*borrowed=*/true, options, std::move(registrar));
  KVTIER_RETURN_IF_ERROR(region->start());
  return std::unique_ptr<PinnedMemory>(std::move(region));
}

}  // namespace kvtier::detail
