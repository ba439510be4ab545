// Storage tiers below host memory: one StorageBackend interface for every
// backend (local disk, Redis single server or cluster, fault-injection
// wrapper).
//
// Objects. A backend stores self-describing objects (object_format.h): one
// object per (128-bit block key, tensor-parallel rank) in one namespace. The
// namespace (model, revision, dtype/quant, TP layout, LoRA ...) and the
// object schema (layout fingerprint, roles table) are fixed when a backend is
// created (StorageOptions); keys of different namespaces never collide. The
// payload is the block's page-first bytes; the backend adds the header and the
// checksum on put and verifies both on every get before a byte reaches the
// caller's buffer (or, on the zero-copy path, before the item is reported OK).
//
// Operations. post() takes a batch of one kind (exists/get/put/delete) and
// returns at once with a StorageTicket; per-item results are polled without
// blocking (StorageTicket::poll / item) or waited for (StorageTicket::wait).
// Per-item outcome codes:
//   exists: OK (present, bytes = payload size) | NotFound
//   get:    OK (bytes = payload size, dst filled and verified) | NotFound |
//           DataLoss (failed verification: object quarantined, treat as miss) |
//           InvalidArgument (dst capacity < payload) | Unavailable | ...
//   put:    OK = acknowledged: durable per the backend's durability setting and
//           visible atomically (a reader sees the whole old or the whole new
//           object, never a mix) | ResourceExhausted (disk full / object too
//           large for the capacity) | Unavailable | ...
//           A put replaces an existing object (last acknowledged put wins). A put
//           batch names each key at most once (InvalidArgument otherwise).
//   delete: OK (removed) | NotFound (was absent).
//
// Buffers. Items borrow caller memory: the source (put) and destination (get)
// must stay valid and unmodified (put) / untouched (get) until the ticket is
// done. A get item whose status is not OK leaves its destination undefined.
// Memory registered with register_region() and aligned to caps().alignment
// (offset and size) is moved without an intermediate copy where the backend
// can (disk with O_DIRECT); other memory goes through a bounce buffer.
//
// Thread-safety: every StorageBackend method is safe to call concurrently from
// several threads. Destroying a backend waits for in-flight tickets to finish
// (their items complete, with kCancelled if the backend shut down first).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/core/status.h"

namespace kvtier::storage {

// The key of one stored object: the cache manager's 128-bit block key and the
// tensor-parallel rank whose shard the object holds. Namespacing is per
// backend (StorageOptions::ns), not per key.
struct StorageKey {
  std::array<std::uint8_t, 16> digest{};
  std::uint32_t rank = 0;

  static StorageKey from_u64(std::uint64_t hi, std::uint64_t lo, std::uint32_t rank = 0);
  // "<32 hex digits>-r<rank>", the name used in file names and Redis keys.
  std::string to_string() const;
  friend bool operator==(const StorageKey& a, const StorageKey& b) noexcept {
    return a.digest == b.digest && a.rank == b.rank;
  }
};

struct StorageKeyHash {
  std::size_t operator()(const StorageKey& k) const noexcept;
};

enum class StorageOp : std::uint8_t { kExists, kGet, kPut, kDelete };
std::string_view storage_op_name(StorageOp op) noexcept;

struct StorageItem {
  StorageKey key;
  void* buffer = nullptr;   // get: destination; put: source (read only); unused for exists/delete
  std::uint64_t bytes = 0;  // get: destination capacity; put: payload size
};

struct StorageBatch {
  StorageOp op = StorageOp::kGet;
  std::vector<StorageItem> items;
};

struct ItemResult {
  KeptStatus status = Cancelled("not completed");
  std::uint64_t bytes = 0;  // payload bytes of the object (exists/get), bytes stored (put)
};

struct StorageCaps {
  bool zero_copy_host = false;         // registered, aligned host memory is read/written without a copy
  bool native_async = false;           // the backend's own I/O is asynchronous (not a thread pool over sync calls)
  bool shared = false;                 // several machines/instances see the same objects
  bool cancellable = false;            // cancel() can stop work in flight
  bool persistent = false;             // objects survive a process restart
  std::uint32_t max_in_flight = 0;     // items the backend works on concurrently
  std::uint64_t max_object_bytes = 0;  // payload limit per object
  std::uint64_t alignment = 1;         // buffer/size alignment for the zero-copy path
};

struct StorageStats {
  std::uint64_t objects = 0;         // objects indexed (local backends; 0 when unknown)
  std::uint64_t bytes = 0;           // bytes on the medium incl. headers (local backends)
  std::uint64_t capacity_bytes = 0;  // 0 = unlimited / managed by the server
  std::uint64_t evictions = 0;
  std::uint64_t quarantined = 0;  // objects that failed verification
  // Objects refused because their authentication failed (object_format.h): another tenant's,
  // forged, or of the other keying mode. A subset of the objects counted in `quarantined` (disk)
  // or refused by gets (Redis: also counted when the delete that quarantines them fails).
  std::uint64_t auth_failures = 0;
  std::uint64_t bounce_copies = 0;  // items that went through a bounce buffer
  std::uint64_t redirects = 0;      // cluster MOVED/ASK redirects followed (remote backends)
  std::uint64_t reconnects = 0;     // connections re-established after a failure (remote backends)
  // 1 when the disk backend was asked for O_DIRECT where the filesystem allows it (DirectIo::kAuto)
  // and its probe at create failed: it runs on buffered I/O (page cache, bounce copies) for its
  // whole life, which is also logged as a warning. 0 otherwise (also for DirectIo::kOff).
  std::uint64_t direct_io_fallback = 0;
};

namespace detail {
// Shared completion state of one ticket. Backends complete items from any
// thread; callers read them through StorageTicket.
class Completion {
 public:
  explicit Completion(StorageOp op, std::size_t n) : op_(op), results_(n), done_(n, false), remaining_(n) {}
  // Completes item i once (later calls for the same item are ignored).
  void complete(std::size_t i, Status status, std::uint64_t bytes = 0);
  StorageOp op() const noexcept { return op_; }
  std::size_t size() const noexcept { return results_.size(); }
  bool done() const noexcept { return remaining_.load(std::memory_order_acquire) == 0; }
  std::size_t remaining() const noexcept { return remaining_.load(std::memory_order_acquire); }
  bool item_done(std::size_t i) const;
  ItemResult item(std::size_t i) const;
  std::vector<ItemResult> snapshot() const;
  bool wait_for(std::chrono::nanoseconds timeout) const;

 private:
  StorageOp op_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<ItemResult> results_;
  std::vector<bool> done_;
  std::atomic<std::size_t> remaining_;
};
}  // namespace detail

// Handle to one posted batch. Move-only; dropping a ticket does not cancel the
// work (buffers stay borrowed until the backend finishes it). Methods are
// thread-safe and never block except wait().
class StorageTicket {
 public:
  StorageTicket() = default;
  StorageTicket(StorageTicket&&) noexcept = default;
  StorageTicket& operator=(StorageTicket&&) noexcept = default;
  StorageTicket(const StorageTicket&) = delete;
  StorageTicket& operator=(const StorageTicket&) = delete;

  // For backend implementations: a ticket with n pending items.
  static StorageTicket create(StorageOp op, std::size_t n);
  const std::shared_ptr<detail::Completion>& completion() const noexcept { return c_; }

  bool valid() const noexcept { return c_ != nullptr; }
  // An empty ticket (default-constructed or moved from): op() kExists, no items (item() FailedPrecondition).
  StorageOp op() const noexcept { return c_ ? c_->op() : StorageOp::kExists; }
  std::size_t size() const noexcept { return c_ ? c_->size() : 0; }
  // Non-blocking: true when every item has completed.
  bool poll() const noexcept { return c_ == nullptr || c_->done(); }
  std::size_t remaining() const noexcept { return c_ ? c_->remaining() : 0; }
  bool item_done(std::size_t i) const { return c_ != nullptr && c_->item_done(i); }
  // Result of item i (status kCancelled "not completed" while pending; OutOfRange past the batch).
  ItemResult item(std::size_t i) const;
  std::vector<ItemResult> results() const { return c_ ? c_->snapshot() : std::vector<ItemResult>{}; }
  // Blocks until done or timeout: OK when done, TimedOut otherwise (the work
  // continues; poll again later).
  Status wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) const;
  // First non-OK item status (OK if every item succeeded). Call after done.
  // For exists/get, NotFound counts as an error here.
  Status first_error() const;

 private:
  std::shared_ptr<detail::Completion> c_;
};

// Namespace and object schema shared by every object of a backend instance.
struct ObjectSchemaRole {
  std::uint16_t layer = 0;
  std::uint8_t role = 0;     // kvtier::Role value
  std::uint8_t dtype = 0;    // kvtier::DType value
  std::uint64_t offset = 0;  // inside the payload
  std::uint64_t bytes = 0;
};

// Tenants. Several tenants (customers, teams) may share one disk root or one Redis deployment
// while serving the same model. `tenant` gives each its own key space: a directory
// <root>/<tenant>/ (mode dir_mode, 0700 by default) on disk, a key prefix "<prefix>:<tenant>:" in
// Redis (a fixed string per tenant, so a Redis ACL user can be restricted to `~<prefix>:<tenant>:*`),
// and a namespace digest of its own. `tenant_secret` (32..64 bytes, per tenant, never stored)
// makes the objects keyed (object_format.h version 2): header and payload carry tags (keyed
// BLAKE2b; Poly1305 under a per-object key) verified before a get is reported OK, so an object
// another tenant, an unkeyed writer or anyone without the secret wrote or copied is a miss (kDataLoss, quarantined,
// counted in StorageStats::auth_failures), never served; Redis key names become keyed hashes that reveal nothing about
// the namespace or the block. Without a secret objects keep the fast unkeyed xxh3 checksum (version 1): isolation then
// rests on the key space and on permissions / ACLs alone.
struct StorageOptions {
  std::string ns = "default";            // namespace: model/revision/dtype/TP/LoRA/layout version
  std::uint64_t layout_fingerprint = 0;  // KvLayout::fingerprint() (0: opaque payloads)
  std::vector<ObjectSchemaRole> roles;   // page-first roles table written into every header (may be empty)
  std::string tenant;                    // empty: no tenant (single-tenant layout); else [A-Za-z0-9_-]{1,64}
  std::string tenant_secret;             // raw bytes; empty: unkeyed objects (see above)
};

class StorageBackend {
 public:
  virtual ~StorageBackend() = default;

  virtual std::string_view name() const noexcept = 0;
  virtual StorageCaps caps() const noexcept = 0;
  virtual const StorageOptions& options() const noexcept = 0;

  // Declares host memory that items will point into. Backends that move
  // registered memory without copies (caps().zero_copy_host) use it; others
  // accept and ignore it. Never blocks on I/O. Overlapping registrations are
  // InvalidArgument.
  virtual Status register_region(void* ptr, std::uint64_t bytes) = 0;
  virtual Status unregister_region(void* ptr) = 0;

  // Starts a batch. Returns at once (never waits for I/O or the network);
  // per-item failures are reported through the ticket, post() itself fails
  // only for a malformed batch (null buffer with bytes > 0, object larger than
  // caps().max_object_bytes, backend shut down).
  virtual Result<StorageTicket> post(StorageBatch batch) = 0;

  // Best effort: items not yet started complete with kCancelled. Backends
  // without caps().cancellable return NotSupported.
  virtual Status cancel(const StorageTicket& /*ticket*/) { return NotSupported("cancel"); }

  virtual StorageStats stats() const { return {}; }

  // Test and maintenance hook: flips bits of the stored object's bytes at
  // `offset` (counted from the start of the stored object, header included)
  // in place, bypassing the checksum, to simulate bit rot or a torn write.
  // Synchronous. NotSupported where the backend cannot reach its bytes.
  virtual Status corrupt_stored_object(const StorageKey& /*key*/, std::uint64_t /*offset*/, std::uint8_t /*xor_mask*/) {
    return NotSupported("corrupt_stored_object");
  }
  // Size of the stored object incl. header (for corrupt_stored_object).
  virtual Result<std::uint64_t> stored_object_bytes(const StorageKey& /*key*/) {
    return NotSupported("stored_object_bytes");
  }
};

// Forwards everything to an inner backend; decorators override what they change.
class StorageBackendWrapper : public StorageBackend {
 public:
  explicit StorageBackendWrapper(std::unique_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const noexcept override { return inner_->name(); }
  StorageCaps caps() const noexcept override { return inner_->caps(); }
  const StorageOptions& options() const noexcept override { return inner_->options(); }
  Status register_region(void* ptr, std::uint64_t bytes) override { return inner_->register_region(ptr, bytes); }
  Status unregister_region(void* ptr) override { return inner_->unregister_region(ptr); }
  Result<StorageTicket> post(StorageBatch batch) override { return inner_->post(std::move(batch)); }
  Status cancel(const StorageTicket& ticket) override { return inner_->cancel(ticket); }
  StorageStats stats() const override { return inner_->stats(); }
  Status corrupt_stored_object(const StorageKey& key, std::uint64_t offset, std::uint8_t xor_mask) override {
    return inner_->corrupt_stored_object(key, offset, xor_mask);
  }
  Result<std::uint64_t> stored_object_bytes(const StorageKey& key) override { return inner_->stored_object_bytes(key); }
  StorageBackend& inner() noexcept { return *inner_; }

 protected:
  std::unique_ptr<StorageBackend> inner_;
};

// Convenience: post and wait (tests, tools). Returns the per-item results, or
// the post()/wait() error.
Result<std::vector<ItemResult>> run_batch(StorageBackend& backend, StorageBatch batch,
                                          std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

// For backends' post(): InvalidArgument for an op that is none of StorageOp's, naming the first item of a get or put
// batch that has no buffer for its nonzero size, or the two items of a put batch that name one key (the items of a
// batch run concurrently, so which of them would stay is not defined); such a batch is refused whole, nothing posted.
Status check_batch_buffers(const StorageBatch& batch);

// Creates a backend from a spec string (for tools and configuration):
//   disk:<dir>[?capacity=<bytes|10G>&durability=none|process|power&direct=auto|on|off&qd=<n>&<tenant>]
//   redis://[[user]:password@]host:port[,host:port...][?cluster=auto|on|off&prefix=<p>&timeout_ms=<n>&item_deadline_ms=<n>&
//          batch_deadline_ms=<n>&workers=<n>&ttl=<seconds>&<tenant>]
//   memory:?capacity=<bytes|64G>[&evict=on|off&threads=<n>&<tenant>]  (memory_backend.h: this process's RAM)
// Numbers past their range are InvalidArgument naming the parameter: qd at most 65,536; timeout_ms and the
// deadlines at most a day (86,400,000); workers at most 256; ttl at most 2,147,483,647 s; threads at most 64.
// where <tenant> is tenant=<id>&secret_file=<path> (each optional; they override options.tenant and
// options.tenant_secret; the file as read_tenant_secret_file describes).
// A redis:// user name and password are percent-decoded ("%3F" for a '?', "%40" for '@', "%25" for '%'), and
// errors show the spec redacted (redact_storage_spec).
Result<std::unique_ptr<StorageBackend>> make_storage_backend(std::string_view spec, StorageOptions options);
// The spec as errors and logs may show it: the password of a scheme://user:password@host spec replaced by "***"
// (everything between "://" and the last '@' but the user name). Specs without credentials unchanged.
std::string redact_storage_spec(std::string_view spec);

// Reads a tenant secret from a file holding it in hex (64..128 hex digits, surrounding
// whitespace ignored: `openssl rand -hex 32 > f`). The file must be a regular file that neither
// group nor others can read or write (FailedPrecondition otherwise, as ssh does for its keys);
// InvalidArgument naming the file for a bad length or a non-hex character.
Result<std::string> read_tenant_secret_file(const std::string& path);

}  // namespace kvtier::storage
