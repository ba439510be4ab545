// Enum names from one table (kvtier/core/enum_names.h): name and parse agree, aliases parse to their value but
// never name it, a bad spelling is refused with every accepted one listed, and the library's tables keep their
// spellings (the config files and the CLI use them).
#include "kvtier/core/enum_names.h"

#include <gtest/gtest.h>

#include "kvtier/core/layout.h"
#include "kvtier/core/log.h"

namespace kvtier {
namespace {

enum class Fruit : std::uint8_t { kApple, kPear, kFig };

constexpr EnumName<Fruit> kFruitEntries[] = {
    {Fruit::kApple, "apple"}, {Fruit::kPear, "pear"}, {Fruit::kFig, "fig"}, {Fruit::kApple, "malus"},  // an alias
};
constexpr auto kFruitNames = enum_table("fruit", kFruitEntries);
constexpr auto kFruitNamesUnknown = enum_table("fruit", kFruitEntries, "no fruit");

// Evaluated at compile time: the tables are usable in constant expressions.
static_assert(kFruitNames.name(Fruit::kPear) == "pear");
static_assert(kFruitNames.find("malus") == Fruit::kApple);
static_assert(!kFruitNames.find("Apple").has_value());
static_assert(kFruitNames.covers_dense(3));
static_assert(!kFruitNames.covers_dense(4), "value 3 has no name");
static_assert(!kFruitNames.covers_dense(2), "fig lies outside 0..1");

TEST(EnumNames, NameAndParseAgree) {
  for (Fruit f : {Fruit::kApple, Fruit::kPear, Fruit::kFig}) {
    auto parsed = kFruitNames.parse(kFruitNames.name(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(kFruitNames.name(Fruit::kApple), "apple") << "the first entry names the value, not the alias";
  EXPECT_EQ(kFruitNames.parse("malus").value(), Fruit::kApple);
  EXPECT_EQ(kFruitNames.name(static_cast<Fruit>(9)), "?");
  EXPECT_EQ(kFruitNamesUnknown.name(static_cast<Fruit>(9)), "no fruit");
  EXPECT_EQ(kFruitNames.accepted(), "apple, pear, fig, malus");
  EXPECT_EQ(kFruitNames.what(), "fruit");
}

TEST(EnumNames, BadSpellingNamesItAndListsTheAcceptedOnes) {
  for (std::string_view bad : {"", "Apple", "apple ", "kiwi"}) {
    auto r = kFruitNames.parse(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(),
              "unknown fruit '" + std::string(bad) + "' (expected one of apple, pear, fig, malus)");
  }
}

TEST(EnumNames, DuplicateSpellingsAreCaught) {
  constexpr EnumName<Fruit> dup[] = {{Fruit::kApple, "apple"}, {Fruit::kPear, "apple"}};
  static_assert(!enum_table("fruit", dup).distinct_names());
  static_assert(kFruitNames.distinct_names());
}

// Converted tables keep their spellings, aliases included.
TEST(EnumNames, LibraryTablesKeepTheirSpellings) {
  EXPECT_EQ(parse_dtype("bfloat16").value(), DType::kBf16);
  EXPECT_EQ(parse_dtype("fp8_e4m3fn").value(), DType::kFp8E4M3);
  EXPECT_EQ(parse_dtype("fp8").value(), DType::kFp8E4M3);
  EXPECT_EQ(dtype_name(DType::kFp8E4M3), "fp8_e4m3");
  for (DType d : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(d)).value(), d) << dtype_name(d);
  EXPECT_EQ(parse_log_level("warning").value(), LogLevel::kWarning);
  EXPECT_EQ(status_code_name(StatusCode::kDataLoss), "DataLoss");
  EXPECT_EQ(status_code_name(static_cast<StatusCode>(200)), "Unknown");
  auto bad = parse_dtype("bf17");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown dtype 'bf17' (expected one of bf16, fp16,"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace kvtier
