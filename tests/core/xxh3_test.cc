// detail::Xxh3 (core/xxh3.h) gives xxHash's XXH3_64bits values on each of its paths this CPU runs, whatever the
// lengths and however the stream is cut.
#include "core/xxh3.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace kvtier::detail {
namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Lengths around every internal boundary of XXH3 (16, 128, 240 bytes; 64-byte stripes, 1 KiB blocks, the
// 256-byte internal buffer), and large ones.
const std::size_t kLengths[] = {0,   1,   3,   8,   15,   16,   17,   64,   127,   128,   129,     239,          240,
                                241, 255, 256, 257, 1023, 1024, 1025, 4096, 65536, 65537, 1 << 20, (1 << 20) + 7};

TEST(Xxh3, OneShotEqualsTheLibrary) {
  const auto data = random_bytes((1 << 20) + 64, 1);
  for (std::size_t n : kLengths)
    for (std::size_t offset : {0, 1, 13}) {  // unaligned starts too
      SCOPED_TRACE(::testing::Message() << n << " bytes at offset " << offset);
      EXPECT_EQ(xxh3_64(data.data() + offset, n), XXH3_64bits(data.data() + offset, n));
    }
}

TEST(Xxh3, StreamsEqualTheLibraryOnEveryPathHoweverTheyAreCut) {
  const auto data = random_bytes((1 << 20) + 64, 2);
  std::mt19937 rng(3);
  int paths = 0;
  for (Xxh3::Path path : {Xxh3::Path::kBest, Xxh3::Path::kAvx512, Xxh3::Path::kAvx2, Xxh3::Path::kPortable}) {
    if (!xxh3_has_path(path)) continue;
    ++paths;
    Xxh3 h(path);
    for (std::size_t n : kLengths) {
      SCOPED_TRACE(::testing::Message() << n << " bytes, path " << static_cast<int>(path));
      const std::uint64_t want = XXH3_64bits(data.data(), n);
      h.reset();
      h.update(data.data(), n);
      EXPECT_EQ(h.digest(), want) << "one update";
      h.reset();
      for (std::size_t at = 0; at < n;) {  // random cuts, some empty
        const std::size_t cut = std::min<std::size_t>(n - at, rng() % 700);
        h.update(data.data() + at, cut);
        at += cut;
      }
      EXPECT_EQ(h.digest(), want) << "random cuts";
    }
  }
  EXPECT_GE(paths, 2);
  std::printf("xxh3 paths run: %d, the best is %s\n", paths, xxh3_best_path_name());
}

TEST(Xxh3, ThePathsAgreeAndTheBestIsTheWidestThisCpuRuns) {
  const std::string best = xxh3_best_path_name();
  if (xxh3_has_path(Xxh3::Path::kAvx512))
    EXPECT_EQ(best, "avx512");
  else if (xxh3_has_path(Xxh3::Path::kAvx2))
    EXPECT_EQ(best, "avx2");
  else
    EXPECT_EQ(best, "library");
  EXPECT_TRUE(xxh3_has_path(Xxh3::Path::kBest));
  EXPECT_TRUE(xxh3_has_path(Xxh3::Path::kPortable));
  // A path this CPU lacks falls back to the library, with the same values.
  const auto data = random_bytes(4096, 5);
  for (Xxh3::Path path : {Xxh3::Path::kAvx512, Xxh3::Path::kAvx2}) {
    Xxh3 h(path);
    h.update(data.data(), data.size());
    EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), data.size()));
  }
}

TEST(Xxh3, ADigestLeavesTheStreamGoingAndResetStartsAnew) {
  const auto data = random_bytes(5000, 4);
  Xxh3 h;
  h.update(data.data(), 3000);
  EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), 3000));
  h.update(data.data() + 3000, 2000);
  EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), 5000));
  h.reset();
  h.update(data.data(), 10);
  EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), 10));
}

}  // namespace
}  // namespace kvtier::detail
