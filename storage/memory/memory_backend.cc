#include "kvtier/storage/memory_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/parallel_loop.h"
#include "storage/object_format.h"
#include "storage/region_set.h"

namespace kvtier::storage {
namespace {

// One stored object (header + payload), immutable once stored: a get copies out of it without the lock.
struct Object {
  std::unique_ptr<std::byte[]> data;
  std::uint64_t bytes = 0;
  std::uint32_t header_size = 0;
};

// Gets copy and verify in chunks that stay in the caches between the two.
constexpr std::uint64_t kVerifyChunk = 256 << 10;
// Freed objects' memory kept for later puts of the same size (an engine re-stores chunks of one size): a fresh
// allocation of a large object costs a page fault per page, more than the copy into it. At most this much, and at
// most a quarter of the capacity.
constexpr std::uint64_t kMaxSpareBytes = std::uint64_t{1} << 30;

class MemoryBackend final : public StorageBackend {
 public:
  MemoryBackend(MemoryBackendConfig config, StorageOptions options)
      : config_(config), options_(std::move(options)), ns_digest_(format::namespace_digest(options_)) {}

  ~MemoryBackend() override {
    std::deque<Batch> left;
    {
      std::lock_guard lock(queue_mu_);
      stop_ = true;
      left.swap(queue_);
    }
    queue_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (Batch& b : left)
      for (std::size_t i = 0; i < b.items.size(); ++i)
        b.ticket->complete(i, Cancelled("memory backend destroyed before the item ran"));
  }

  Status start() {
    unsigned threads = config_.threads;
    if (threads == 0) {
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      threads = std::clamp(cores / 2, 1u, 8u);
    }
    try {
      if (threads > 1) loop_ = std::make_unique<kvtier::detail::ParallelLoop>(threads - 1);
      worker_ = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      return Internal(fmt::format("memory backend worker: {}", e.what()));
    }
    return Status::Ok();
  }

  std::string_view name() const noexcept override { return "memory"; }
  StorageCaps caps() const noexcept override {
    StorageCaps c;
    c.max_in_flight = 1;
    c.max_object_bytes = config_.capacity_bytes;
    return c;
  }
  const StorageOptions& options() const noexcept override { return options_; }

  Status register_region(void* ptr, std::uint64_t bytes) override { return regions_.add(ptr, bytes); }
  Status unregister_region(void* ptr) override { return regions_.remove(ptr); }

  Result<StorageTicket> post(StorageBatch batch) override {
    KVTIER_RETURN_IF_ERROR(check_batch_buffers(batch));
    StorageTicket ticket = StorageTicket::create(batch.op, batch.items.size());
    if (batch.items.empty()) return ticket;
    std::lock_guard lock(queue_mu_);
    if (stop_) return Cancelled("memory backend is shutting down");
    queue_.push_back(Batch{batch.op, std::move(batch.items), ticket.completion()});
    queue_cv_.notify_one();
    return ticket;
  }

  StorageStats stats() const override {
    std::lock_guard lock(mu_);
    StorageStats s;
    s.objects = index_.size();
    s.bytes = stored_bytes_;
    s.capacity_bytes = config_.capacity_bytes;
    s.evictions = evictions_;
    s.quarantined = quarantined_;
    s.auth_failures = auth_failures_;
    return s;
  }

  Status corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) override {
    std::lock_guard lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return NotFound(fmt::format("object {} is not stored", key.to_string()));
    const Object& old = *it->second.object;
    if (offset >= old.bytes) return OutOfRange(fmt::format("offset {} >= object bytes {}", offset, old.bytes));
    // Objects are immutable (a get may be copying out of this one): store a damaged copy in its place.
    auto damaged = std::make_shared<Object>();
    damaged->data = std::make_unique<std::byte[]>(old.bytes);
    damaged->bytes = old.bytes;
    damaged->header_size = old.header_size;
    std::memcpy(damaged->data.get(), old.data.get(), old.bytes);
    damaged->data[offset] ^= std::byte{xor_mask};
    it->second.object = std::move(damaged);
    return Status::Ok();
  }

  Result<std::uint64_t> stored_object_bytes(const StorageKey& key) override {
    std::lock_guard lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return NotFound(fmt::format("object {} is not stored", key.to_string()));
    return it->second.object->bytes;
  }

 private:
  struct Batch {
    StorageOp op = StorageOp::kGet;
    std::vector<StorageItem> items;
    std::shared_ptr<detail::Completion> ticket;
  };
  struct Entry {
    std::shared_ptr<const Object> object;
    std::list<StorageKey>::iterator lru;  // position in lru_ (front: least recently used)
  };

  void run() {
    for (;;) {
      Batch b;
      {
        std::unique_lock lock(queue_mu_);
        queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      if (b.op == StorageOp::kPut)
        run_puts(b);
      else if (b.op == StorageOp::kGet)
        run_gets(b);
      else
        for (std::size_t i = 0; i < b.items.size(); ++i) {
          std::uint64_t bytes = 0;
          Status st = one(b.op, b.items[i], bytes);
          b.ticket->complete(i, std::move(st), bytes);
        }
    }
  }

  // Runs body(i) for i in [0, n), on the helpers too when there are several.
  void for_each(std::size_t n, const std::function<void(std::size_t)>& body) {
    if (!loop_ || n < 2) {
      for (std::size_t i = 0; i < n; ++i) body(i);
      return;
    }
    loop_->run(n, 1, [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) body(i);
    });
  }

  // A unit of a batch's copies: one piece (format::kChecksumChunkBytes) of an unkeyed item, or a whole keyed item
  // (Poly1305 runs over the payload in order).
  struct Unit {
    std::size_t item = 0;
    std::uint64_t piece = 0;
    bool whole = false;
  };

  // Gets: objects found and their headers checked one by one; then every piece copied into the caller's buffer and
  // hashed (from the caches) on the helpers; then each item's checksum compared. A damaged object is quarantined.
  void run_gets(Batch& b) {
    const std::size_t n = b.items.size();
    std::vector<Status> status(n);
    std::vector<std::shared_ptr<const Object>> objects(n);
    std::vector<format::ObjectHeader> headers(n);
    std::vector<std::vector<std::uint64_t>> digests(n);
    std::vector<Unit> units;
    for (std::size_t i = 0; i < n; ++i) {
      const StorageItem& item = b.items[i];
      {
        std::lock_guard lock(mu_);
        auto it = index_.find(item.key);
        if (it == index_.end()) {
          status[i] = NotFound(fmt::format("object {} is not stored", item.key.to_string()));
          continue;
        }
        touch(it->second);
        objects[i] = it->second.object;
      }
      Result<format::ObjectHeader> h = check_get(*objects[i], item);
      if (!h.ok()) {
        status[i] = h.status();
        continue;
      }
      headers[i] = std::move(h).value();
      if (!headers[i].chunked) {
        units.push_back({i, 0, true});
        continue;
      }
      digests[i].resize(format::num_checksum_chunks(headers[i].payload_bytes));
      for (std::uint64_t p = 0; p < digests[i].size(); ++p) units.push_back({i, p, false});
    }
    for_each(units.size(), [&](std::size_t u) {
      const Unit& unit = units[u];
      const StorageItem& item = b.items[unit.item];
      const Object& o = *objects[unit.item];
      const format::ObjectHeader& h = headers[unit.item];
      if (unit.whole) {
        status[unit.item] = copy_verified(o, h, item);
        return;
      }
      const std::uint64_t off = unit.piece * format::kChecksumChunkBytes;
      const std::uint64_t bytes = std::min(format::kChecksumChunkBytes, h.payload_bytes - off);
      const std::byte* src = o.data.get() + h.header_size + off;
      std::memcpy(static_cast<std::byte*>(item.buffer) + off, src, bytes);
      digests[unit.item][unit.piece] = format::chunk_digest(src, bytes);
    });
    for (std::size_t i = 0; i < n; ++i) {
      if (objects[i] && status[i].ok() && headers[i].chunked)
        status[i] = format::verify_chunked(objects[i]->data.get(), headers[i], digests[i]);
      if (status[i].code() == StatusCode::kDataLoss && objects[i])
        status[i] = quarantine(b.items[i].key, objects[i], status[i]);
      b.ticket->complete(i, status[i], status[i].ok() ? headers[i].payload_bytes : 0);
    }
  }

  // Puts: objects allocated one by one; every piece copied from the caller's buffer and hashed on the helpers (a
  // keyed item as a whole); then the headers written and the objects committed in item order. A key put twice in
  // the batch: one item after the other.
  void run_puts(Batch& b) {
    const std::size_t n = b.items.size();
    bool repeated = false;
    {
      std::unordered_set<StorageKey, StorageKeyHash> keys;
      for (const StorageItem& item : b.items) repeated = repeated || !keys.insert(item.key).second;
    }
    if (repeated) {
      for (std::size_t i = 0; i < n; ++i) put_items(b, i, i + 1);
      return;
    }
    put_items(b, 0, n);
  }

  void put_items(Batch& b, std::size_t first, std::size_t last) {
    const bool keyed = !options_.tenant_secret.empty();
    std::vector<Result<std::shared_ptr<Object>>> built;
    std::vector<std::vector<std::uint64_t>> digests(last - first);
    std::vector<Unit> units;
    for (std::size_t i = first; i < last; ++i) {
      built.push_back(allocate(b.items[i]));
      if (!built.back().ok()) continue;
      if (keyed) {
        units.push_back({i, 0, true});
        continue;
      }
      digests[i - first].resize(format::num_checksum_chunks(b.items[i].bytes));
      for (std::uint64_t p = 0; p < digests[i - first].size(); ++p) units.push_back({i, p, false});
    }
    std::vector<Status> encoded(last - first);
    for_each(units.size(), [&](std::size_t u) {
      const Unit& unit = units[u];
      const StorageItem& item = b.items[unit.item];
      Object& o = *built[unit.item - first].value();
      if (unit.whole) {
        encoded[unit.item - first] =
            format::encode_object(options_, ns_digest_, item.key, item.buffer, item.bytes, o.header_size, o.data.get());
        return;
      }
      const std::uint64_t off = unit.piece * format::kChecksumChunkBytes;
      const std::uint64_t bytes = std::min(format::kChecksumChunkBytes, item.bytes - off);
      std::byte* dst = o.data.get() + o.header_size + off;
      std::memcpy(dst, static_cast<const std::byte*>(item.buffer) + off, bytes);
      digests[unit.item - first][unit.piece] = format::chunk_digest(dst, bytes);
    });
    for (std::size_t i = first; i < last; ++i) {
      Result<std::shared_ptr<Object>>& r = built[i - first];
      Status st = r.status();
      if (st.ok() && !keyed)
        st = format::encode_chunked_header(options_, ns_digest_, b.items[i].key, b.items[i].bytes, digests[i - first],
                                           r.value()->header_size, r.value()->data.get());
      if (st.ok()) st = encoded[i - first];
      if (st.ok()) {
        st = commit(b.items[i].key, std::move(r).value());
      } else if (r.ok()) {
        give_back(*r.value());
      }
      b.ticket->complete(i, st, st.ok() ? b.items[i].bytes : 0);
    }
  }

  Status one(StorageOp op, const StorageItem& item, std::uint64_t& bytes) {
    switch (op) {
      case StorageOp::kPut:
      case StorageOp::kGet: break;  // run_puts / run_gets
      case StorageOp::kExists: {
        std::lock_guard lock(mu_);
        auto it = index_.find(item.key);
        if (it == index_.end()) return NotFound(fmt::format("object {} is not stored", item.key.to_string()));
        touch(it->second);
        bytes = it->second.object->bytes - it->second.object->header_size;
        return Status::Ok();
      }
      case StorageOp::kDelete: {
        std::lock_guard lock(mu_);
        auto it = index_.find(item.key);
        if (it == index_.end()) return NotFound(fmt::format("object {} is not stored", item.key.to_string()));
        erase(it);
        return Status::Ok();
      }
    }
    return InvalidArgument(fmt::format("unknown storage op {}", static_cast<int>(op)));
  }

  // The memory of a put's object (header + payload), its header size set; reused from freed objects of the size
  // when there are some.
  Result<std::shared_ptr<Object>> allocate(const StorageItem& item) {
    if (item.buffer == nullptr && item.bytes != 0) return InvalidArgument("put item has no source buffer");
    KVTIER_RETURN_IF_ERROR(format::check_payload_size(options_, item.bytes));
    const std::uint32_t header = format::header_bytes(options_, 8);
    // Compared before adding: a payload near 2^64 wrapped the sum to a few bytes, which passed this check and had
    // the header and the payload written far past the allocation.
    if (item.bytes > config_.capacity_bytes || config_.capacity_bytes - item.bytes < header)
      return ResourceExhausted(
          fmt::format("object of payload {} bytes (header {}) exceeds the memory tier's capacity "
                      "of {}",
                      item.bytes, header, config_.capacity_bytes));
    const std::uint64_t total = std::uint64_t{header} + item.bytes;
    auto object = std::make_shared<Object>();
    object->data = take_spare(total);
    if (!object->data) object->data.reset(new (std::nothrow) std::byte[total]);
    if (!object->data) return ResourceExhausted(fmt::format("memory tier: {} bytes not available", total));
    object->bytes = total;
    object->header_size = header;
    return object;
  }

  // Stores a built object under `key`: room made by evicting least recently used objects (when allowed), the
  // object it replaces dropped. A refused put loses nothing (its memory is kept for reuse).
  Status commit(const StorageKey& key, std::shared_ptr<Object> object) {
    const std::uint64_t total = object->bytes;
    std::lock_guard lock(mu_);
    // The object it replaces frees its bytes, but only once this put succeeds: a refused put loses nothing.
    auto replaced = index_.find(key);
    const std::uint64_t freed = replaced != index_.end() ? replaced->second.object->bytes : 0;
    std::uint64_t room = config_.capacity_bytes - (stored_bytes_ - freed);
    std::vector<StorageKey> victims;
    for (auto v = lru_.begin(); room < total && config_.evict && v != lru_.end(); ++v) {
      if (*v == key) continue;
      victims.push_back(*v);
      room += index_.find(*v)->second.object->bytes;
    }
    if (room < total) {
      Status full = ResourceExhausted(fmt::format("memory tier full: {} of {} bytes stored, {} more needed",
                                                  stored_bytes_, config_.capacity_bytes, total));
      keep_spare(*object);
      return full;
    }
    for (const StorageKey& v : victims) erase(index_.find(v));
    evictions_ += victims.size();
    if (replaced != index_.end()) erase(index_.find(key));
    lru_.push_back(key);
    index_.emplace(key, Entry{std::move(object), std::prev(lru_.end())});
    stored_bytes_ += total;
    return Status::Ok();
  }

  // Removes a damaged object (unless a put replaced it meanwhile) and counts it.
  Status quarantine(const StorageKey& key, const std::shared_ptr<const Object>& object, const Status& st) {
    std::lock_guard lock(mu_);
    if (format::is_auth_failure(st)) ++auth_failures_;
    if (auto it = index_.find(key); it != index_.end() && it->second.object == object) {
      erase(it);
      ++quarantined_;
    }
    return st.with_context("object quarantined (removed)");
  }

  // The stored object's header, checked against the get's key and buffer.
  Result<format::ObjectHeader> check_get(const Object& o, const StorageItem& item) {
    KVTIER_ASSIGN_OR_RETURN(format::ObjectHeader h,
                            format::decode_header(o.data.get(), o.bytes, nullptr, options_.tenant_secret));
    KVTIER_RETURN_IF_ERROR(format::check_object_size(h, o.bytes, true));
    KVTIER_RETURN_IF_ERROR(format::check_identity(h, ns_digest_, options_.layout_fingerprint, item.key));
    if (item.bytes < h.payload_bytes)
      return InvalidArgument(fmt::format("get destination of {} bytes < payload {} of object {}", item.bytes,
                                         h.payload_bytes, item.key.to_string()));
    if (item.buffer == nullptr && h.payload_bytes != 0) return InvalidArgument("get item has no destination buffer");
    return h;
  }

  // The payload into the caller's buffer, verified in the same pass (each chunk is checked right after its copy, from
  // the caches); kDataLoss for a damaged or foreign object, whose bytes in the buffer are then undefined.
  Status copy_verified(const Object& o, const format::ObjectHeader& h, const StorageItem& item) {
    format::ObjectVerifier verifier(o.data.get(), h, options_.tenant_secret);
    const std::byte* src = o.data.get() + h.header_size;
    auto* dst = static_cast<std::byte*>(item.buffer);
    for (std::uint64_t off = 0; off < h.payload_bytes; off += kVerifyChunk) {
      const std::uint64_t n = std::min(kVerifyChunk, h.payload_bytes - off);
      std::memcpy(dst + off, src + off, n);
      verifier.update(src + off, n);
    }
    return verifier.finish();
  }

  std::unique_ptr<std::byte[]> take_spare(std::uint64_t bytes) {
    std::lock_guard lock(mu_);
    auto it = spare_.find(bytes);
    if (it == spare_.end()) return nullptr;
    std::unique_ptr<std::byte[]> p = std::move(it->second);
    spare_.erase(it);
    spare_bytes_ -= bytes;
    return p;
  }

  void give_back(Object& o) {
    std::lock_guard lock(mu_);
    keep_spare(o);
  }

  // (mu_ held) Keeps an unused object's memory for a later put of its size, within the spare limit.
  void keep_spare(Object& o) {
    const std::uint64_t limit = std::min(kMaxSpareBytes, config_.capacity_bytes / 4);
    if (o.data && spare_bytes_ + o.bytes <= limit) {
      spare_.emplace(o.bytes, std::move(o.data));
      spare_bytes_ += o.bytes;
    }
  }

  // (mu_ held)
  void touch(Entry& e) { lru_.splice(lru_.end(), lru_, e.lru); }
  void erase(std::unordered_map<StorageKey, Entry, StorageKeyHash>::iterator it) {
    const std::uint64_t bytes = it->second.object->bytes;
    stored_bytes_ -= bytes;
    // Its memory is kept for reuse when no get is copying out of it (gets hold the object while they do).
    if (it->second.object.use_count() == 1) keep_spare(*const_cast<Object*>(it->second.object.get()));
    lru_.erase(it->second.lru);
    index_.erase(it);
  }

  const MemoryBackendConfig config_;
  const StorageOptions options_;
  const std::uint64_t ns_digest_;
  RegionSet regions_;

  mutable std::mutex mu_;  // the index, the LRU list and the counters
  std::unordered_map<StorageKey, Entry, StorageKeyHash> index_;
  std::list<StorageKey> lru_;
  std::uint64_t stored_bytes_ = 0, evictions_ = 0, quarantined_ = 0, auth_failures_ = 0;
  std::multimap<std::uint64_t, std::unique_ptr<std::byte[]>> spare_;  // freed objects' memory, by size
  std::uint64_t spare_bytes_ = 0;

  std::unique_ptr<kvtier::detail::ParallelLoop> loop_;  // the worker's helpers for a batch's copies (null: one thread)

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Batch> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

Result<std::unique_ptr<StorageBackend>> create_memory_backend(MemoryBackendConfig config, StorageOptions options) {
  if (config.capacity_bytes == 0)
    return InvalidArgument("memory backend: capacity_bytes is 0 (give the tier a capacity, e.g. memory:?capacity=64G)");
  // The header's bound was documented but not checked: 100,000 threads failed deep in thread creation as "Internal".
  if (config.threads > kMaxMemoryBackendThreads)
    return InvalidArgument(fmt::format("memory backend: threads {} not in [0, {}] (0: one per two cores)",
                                       config.threads, kMaxMemoryBackendThreads));
  KVTIER_RETURN_IF_ERROR(format::check_tenant_options(options));
  auto b = std::make_unique<MemoryBackend>(config, std::move(options));
  KVTIER_RETURN_IF_ERROR(b->start());
  return std::unique_ptr<StorageBackend>(std::move(b));
}

}  // namespace kvtier::storage
