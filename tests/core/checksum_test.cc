// Piece checksums (kvtier/core/checksum.h): the pool's value equals the one-thread value for every size around
// the piece boundaries, and any changed byte changes it.
#include "kvtier/core/checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace kvtier {
namespace {

TEST(PieceChecksum, PoolEqualsOneThreadAndSeesEveryByte) {
  std::mt19937_64 rng(5);
  const std::uint64_t sizes[] = {
      0, 1, kChecksumPieceBytes - 1, kChecksumPieceBytes, kChecksumPieceBytes + 1, 3 * kChecksumPieceBytes + 5};
  std::vector<std::vector<unsigned char>> data;
  for (std::uint64_t n : sizes) {
    data.emplace_back(n);
    for (auto& b : data.back()) b = static_cast<unsigned char>(rng());
  }
  std::vector<std::pair<const void*, std::uint64_t>> buffers;
  for (const auto& d : data) buffers.emplace_back(d.data(), d.size());
  const std::vector<std::uint64_t> sums = piece_checksums(buffers);
  ASSERT_EQ(sums.size(), data.size());
  for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(sums[i], piece_checksum(data[i].data(), data[i].size())) << i;
  EXPECT_NE(sums[1], sums[0]);
  auto& big = data.back();
  for (std::uint64_t at : {std::uint64_t{0}, kChecksumPieceBytes - 1, kChecksumPieceBytes, big.size() - 1}) {
    big[at] ^= 0x10;
    EXPECT_NE(piece_checksum(big.data(), big.size()), sums.back()) << at;
    EXPECT_NE(piece_checksums(std::vector<std::pair<const void*, std::uint64_t>>{{big.data(), big.size()}})[0],
              sums.back())
        << at;
    big[at] ^= 0x10;
  }
  EXPECT_TRUE(piece_checksums({}).empty());
}

}  // namespace
}  // namespace kvtier
