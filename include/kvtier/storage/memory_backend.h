// Host-memory storage backend: a tier in this process's RAM, below the host blocks and above disk and Redis.
//
// For engines whose own KV offloading wants a CPU tier with kvtier's guarantees (vLLM's offloading spec, SGLang's
// HiCache storage), and for tests and replays that want a storage tier without a disk or a server. Objects are
// the format every backend stores (object_format.h: header, checksum, tenant tags), each in its own allocation,
// verified on every get: a damaged or foreign object is a miss (DataLoss, removed), never served.
//
// Capacity: capacity_bytes counts every stored object's bytes (header + payload). A put that needs room evicts the
// least recently used objects (a get or an exists is a use); an object larger than the capacity is
// ResourceExhausted, and so is every put when `evict` is false and the tier is full. Not persistent, not shared:
// the objects live as long as the backend, and each backend has its own. The memory of freed objects (up to a
// quarter of the capacity, at most 1 GiB, beyond it) is kept for later puts of the same size: a fresh allocation of
// a large object costs a page fault per page, more than the copy into it.
//
// post() returns at once; one worker thread runs the batches in the order they were posted. Within a batch the
// copies run on `threads` threads (the worker and helpers), in pieces of 1 MiB: a put copies each piece of the
// caller's payload into the object and hashes it from the caches, a get copies each piece into the caller's
// buffer and hashes it likewise; the object's checksum is over its pieces' digests (object_format.h, "chunked
// checksums"), so one large object is copied by every thread, and a get is reported OK only once every piece
// verified. Keyed tiers (a tenant secret) authenticate each object in one pass, objects on several threads. A batch's
// puts are then committed in item order (the room, the evictions and the LRU order are those of one put after the
// other), so a batch of puts holds up to its own bytes beyond the capacity while it is copied. A put batch naming one
// key twice is refused (StorageBackend's contract). register_region() only records the region.
//
// Thread-safety: as StorageBackend. Destroying the backend finishes the batch in progress and cancels the rest.
#pragma once

#include <cstdint>
#include <memory>

#include "kvtier/backend/storage_backend.h"

namespace kvtier::storage {

struct MemoryBackendConfig {
  std::uint64_t capacity_bytes = 0;  // required: > 0
  bool evict = true;                 // a full tier evicts least recently used objects (false: the put fails)
  // Threads that copy a batch's items: 0 = one per two cores, at most 8 (1 on two cores); else 1..64.
  unsigned threads = 0;
};
inline constexpr unsigned kMaxMemoryBackendThreads = 64;

// InvalidArgument for a zero capacity, more than 64 threads or bad tenant options (naming them).
Result<std::unique_ptr<StorageBackend>> create_memory_backend(MemoryBackendConfig config, StorageOptions options);

}  // namespace kvtier::storage
