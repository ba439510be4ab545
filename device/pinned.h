// Pinned host memory machinery shared by the device backends (private header).
//
// A backend describes how to pin one chunk with a ChunkRegistrar (CUDA:
// cudaHostRegister / cudaHostUnregister with the right device current; the
// host backend: no-ops) and gets a PinnedMemory that
//   - allocate_pinned_memory: maps the whole size once (one contiguous virtual
//     range, MAP_PRIVATE | MAP_ANONYMOUS, no MAP_POPULATE), binds it to
//     `numa_node` with mbind(MPOL_BIND) when >= 0, first-touches it in
//     parallel (`touch_threads` threads, at most 256 and one per page; 0:
//     min(hardware threads, 16, one per 16 MiB); each writes one byte per
//     4 KiB page of its slice, so that pages are placed by the binding or
//     first-touch policy before the driver pins them), then registers it
//     chunk by chunk;
//   - register_host_memory: registers borrowed memory chunk by chunk (no
//     touch, no binding; the bytes are never unmapped by kvtier).
// With options.background the touch and the registration run on a background
// thread; bytes_ready() grows chunk by chunk and wait_ready() reports the
// outcome. Otherwise the call returns when everything is registered, or
// returns the first error (after undoing what was done).
//
// Chunks: chunk_bytes (1 .. 64 GiB, validated) is rounded down to a multiple
// of the page size (at least one page) and chunk boundaries are page-aligned
// addresses, so no two chunks share a page (the CUDA driver refuses to
// register a page twice). The first and last chunk of borrowed memory may be
// shorter than chunk_bytes.
//
// Destruction: stops and joins the background thread (it checks for
// cancellation between chunks and between touch slices), unregisters every
// registered chunk in reverse order, then unmaps owned memory. The caller must
// have drained every copy that uses the memory.
//
// Thread-safety: the returned object's const methods and wait_ready() are safe
// from any thread. The registrar callbacks are called from one thread at a
// time (the caller's, or the background thread) and never concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"

namespace kvtier::detail {

// Driver limit above which single registrations fail or crawl.
inline constexpr std::uint64_t kMaxPinnedChunkBytes = std::uint64_t{64} << 30;

struct ChunkRegistrar {
  // Pins [ptr, ptr + bytes). Null: nothing to do (host backend). The Status
  // message should name the call and its arguments; it is returned as is,
  // prefixed with the chunk index and range.
  std::function<Status(void* ptr, std::uint64_t bytes)> register_chunk;
  // Undoes register_chunk for exactly the same (ptr, bytes). Must not throw;
  // failures can only be logged. Null: nothing to do.
  std::function<void(void* ptr, std::uint64_t bytes)> unregister_chunk;
};

// Checks options shared by both entry points: chunk_bytes in [1, 64 GiB],
// numa_node -1 or an existing node with memory. Messages name the bad value.
Status validate_pinned_options(const PinnedOptions& options);

// Maps, binds, touches and registers `bytes` (>= 1) of host memory.
// InvalidArgument for zero bytes or bad options; ResourceExhausted when the
// mapping fails; the registrar's error (with context) when a chunk fails.
Result<std::unique_ptr<PinnedMemory>> allocate_pinned_memory(std::uint64_t bytes, const PinnedOptions& options,
                                                             ChunkRegistrar registrar);

// Registers borrowed memory [data, data + bytes). The caller keeps ownership
// and must keep the bytes mapped until the returned object is destroyed.
// options.numa_node and touch_threads are validated but not applied.
Result<std::unique_ptr<PinnedMemory>> register_host_memory(void* data, std::uint64_t bytes,
                                                           const PinnedOptions& options, ChunkRegistrar registrar);

}  // namespace kvtier::detail
