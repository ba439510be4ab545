#include "kvtier/core/checksum.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <thread>

#include "core/byte_codec.h"
#include "core/parallel_loop.h"
#include "core/xxh3.h"

namespace kvtier {
namespace {

std::uint64_t combine(std::span<const std::uint64_t> digests) {
  std::vector<std::byte> le(8 * digests.size());
  for (std::size_t p = 0; p < digests.size(); ++p) codec::store_le(le.data() + 8 * p, digests[p]);
  return detail::xxh3_64(le.data(), le.size());
}

// Rounded up without forming bytes + piece - 1, which wraps for sizes within a piece of 2^64 (and gave 0 pieces:
// the empty buffer's checksum).
std::uint64_t num_pieces(std::uint64_t bytes) {
  return bytes / kChecksumPieceBytes + (bytes % kChecksumPieceBytes != 0 ? 1 : 0);
}

std::uint64_t piece_digest(const void* data, std::uint64_t bytes, std::uint64_t piece) {
  const std::uint64_t off = piece * kChecksumPieceBytes;
  return detail::xxh3_64(static_cast<const unsigned char*>(data) + off,
                         static_cast<std::size_t>(std::min(kChecksumPieceBytes, bytes - off)));
}

detail::ParallelLoop& pool() {
  static std::unique_ptr<detail::ParallelLoop> loop = [] {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    return std::make_unique<detail::ParallelLoop>(std::clamp(cores / 2, 1u, 8u) - 1);
  }();
  return *loop;
}

}  // namespace

std::uint64_t piece_checksum(const void* data, std::uint64_t bytes) {
  std::vector<std::uint64_t> digests(num_pieces(bytes));
  for (std::uint64_t p = 0; p < digests.size(); ++p) digests[p] = piece_digest(data, bytes, p);
  return combine(digests);
}

std::vector<std::uint64_t> piece_checksums(std::span<const std::pair<const void*, std::uint64_t>> buffers) {
  // (buffer, piece) units, every piece's digest in its buffer's slice of one array.
  std::vector<std::uint64_t> first(buffers.size() + 1, 0);
  for (std::size_t i = 0; i < buffers.size(); ++i) first[i + 1] = first[i] + num_pieces(buffers[i].second);
  std::vector<std::uint64_t> digests(first.back());
  std::vector<std::uint32_t> owner(digests.size());
  for (std::size_t i = 0; i < buffers.size(); ++i)
    std::fill(owner.begin() + static_cast<std::ptrdiff_t>(first[i]),
              owner.begin() + static_cast<std::ptrdiff_t>(first[i + 1]), static_cast<std::uint32_t>(i));
  pool().run(digests.size(), 1, [&](std::size_t begin, std::size_t end) {
    for (std::size_t u = begin; u < end; ++u) {
      const auto& [data, bytes] = buffers[owner[u]];
      digests[u] = piece_digest(data, bytes, u - first[owner[u]]);
    }
  });
  std::vector<std::uint64_t> out(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i)
    out[i] = combine(std::span<const std::uint64_t>(digests).subspan(first[i], first[i + 1] - first[i]));
  return out;
}

}  // namespace kvtier
