// Piece checksums: integrity of large host buffers at memory bandwidth.
//
// A piece checksum is xxh3-64 over the little-endian xxh3-64 digests of the buffer's pieces of kChecksumPieceBytes
// (the last one shorter; an empty buffer has no pieces). Its pieces are independent, so one large buffer is hashed
// by several threads, and the value does not depend on how many did it. Used where bytes wait in host memory
// between two copies and must be proven unchanged before they are used again (an engine's pinned CPU tier).
//
// Thread-safety: free functions. piece_checksums runs on a process-wide pool of threads created on first use; its
// concurrent callers take turns.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace kvtier {

inline constexpr std::uint64_t kChecksumPieceBytes = std::uint64_t{1} << 20;

// One buffer on the calling thread.
std::uint64_t piece_checksum(const void* data, std::uint64_t bytes);

// Many buffers (pointer, bytes), every piece of every buffer spread over the pool (one thread per two cores, at
// most 8, the caller included). out[i] is piece_checksum of buffers[i].
std::vector<std::uint64_t> piece_checksums(std::span<const std::pair<const void*, std::uint64_t>> buffers);

}  // namespace kvtier
