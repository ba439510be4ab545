// ConfigTable knob types added for the transfer and cache configs: chrono
// durations, enums, ranged doubles and validated strings.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>

#include "kvtier/core/config.h"

namespace kvtier {
namespace {

enum class Color : std::uint8_t { kRed, kGreen };
std::string_view color_name(Color c) noexcept { return c == Color::kRed ? "red" : "green"; }
Result<Color> parse_color(std::string_view s) {
  if (s == "red") return Color::kRed;
  if (s == "green") return Color::kGreen;
  return InvalidArgument(fmt::format("unknown color '{}' (expected red, green)", s));
}

struct Typed {
  std::chrono::microseconds poll{50};
  std::chrono::milliseconds timeout{60000};
  std::chrono::seconds linger{3};
  std::chrono::nanoseconds tick{7};
  Color color = Color::kGreen;
  double share = 0.25;
  std::string policy = "lru";
};

ConfigTable table_for(Typed& t) {
  ConfigTable c;
  c.add("x.poll", &t.poll, "poll");
  c.add("x.timeout", &t.timeout, "timeout");
  c.add("x.linger", &t.linger, "linger");
  c.add("x.tick", &t.tick, "tick");
  c.add_enum("x.color", &t.color, parse_color, color_name, {Color::kRed, Color::kGreen}, "color");
  c.add("x.share", &t.share, "share", 0.0, 1.0);
  c.add("x.policy", &t.policy, "policy", [](std::string_view v) -> Status {
    if (v == "lru" || v == "arc") return Status::Ok();
    return InvalidArgument(fmt::format("unknown policy '{}'", v));
  });
  return c;
}

std::string value_of(const ConfigTable& c, const std::string& name, bool want_default = false) {
  for (const KnobInfo& k : c.describe())
    if (k.name == name) return want_default ? k.default_value : k.value;
  return "<missing>";
}

TEST(ConfigTypes, DescribeTypesAndDefaults) {
  Typed t;
  ConfigTable c = table_for(t);
  const std::map<std::string, std::string> types{{"x.poll", "duration (us)"},     {"x.timeout", "duration (ms)"},
                                                 {"x.linger", "duration (s)"},    {"x.tick", "duration (ns)"},
                                                 {"x.color", "enum: red, green"}, {"x.share", "double [0, 1]"},
                                                 {"x.policy", "string"}};
  ASSERT_EQ(c.describe().size(), types.size());
  for (const KnobInfo& k : c.describe()) {
    EXPECT_EQ(k.type, types.at(k.name)) << k.name;
    EXPECT_EQ(k.value, k.default_value) << k.name;
  }
  EXPECT_EQ(value_of(c, "x.poll", true), "50us");
  EXPECT_EQ(value_of(c, "x.timeout", true), "60000ms");
  EXPECT_EQ(value_of(c, "x.linger", true), "3s");
  EXPECT_EQ(value_of(c, "x.tick", true), "7ns");
  EXPECT_EQ(value_of(c, "x.color", true), "green");
  EXPECT_EQ(value_of(c, "x.share", true), "0.25");
  EXPECT_EQ(value_of(c, "x.policy", true), "lru");
}

TEST(ConfigTypes, DurationsConvertUnits) {
  Typed t;
  ConfigTable c = table_for(t);
  ASSERT_TRUE(c.set("x.poll", "2ms").ok());
  EXPECT_EQ(t.poll, std::chrono::microseconds(2000));
  EXPECT_EQ(value_of(c, "x.poll"), "2000us");
  ASSERT_TRUE(c.set("x.poll", " 75 ").ok());  // bare: the field's unit
  EXPECT_EQ(t.poll.count(), 75);
  ASSERT_TRUE(c.set("x.poll", "3000ns").ok());
  EXPECT_EQ(t.poll.count(), 3);
  ASSERT_TRUE(c.set("x.poll", "0").ok());
  EXPECT_EQ(t.poll.count(), 0);
  ASSERT_TRUE(c.set("x.timeout", "5 s").ok());
  EXPECT_EQ(t.timeout, std::chrono::milliseconds(5000));
  ASSERT_TRUE(c.set("x.timeout", "7000us").ok());
  EXPECT_EQ(t.timeout.count(), 7);
  ASSERT_TRUE(c.set("x.linger", "4000ms").ok());
  EXPECT_EQ(t.linger.count(), 4);
  ASSERT_TRUE(c.set("x.tick", "1s").ok());
  EXPECT_EQ(t.tick.count(), 1000000000);
  // Round trip: the printed value parses back to the same duration.
  ASSERT_TRUE(c.set("x.timeout", value_of(c, "x.timeout")).ok());
  EXPECT_EQ(t.timeout.count(), 7);
}

TEST(ConfigTypes, BadDurationsNameKnobAndValueAndLeaveField) {
  Typed t;
  ConfigTable c = table_for(t);
  for (const char* bad :
       {"", "ms", "-5ms", "1.5ms", "5parsecs", "5 m s", "12abc", "99999999999999999999", "9223372036854775807s"}) {
    Status s = c.set("x.poll", bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("x.poll"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(std::string("'") + bad + "'"), std::string::npos) << s.message();
    EXPECT_EQ(t.poll.count(), 50) << bad;
  }
  Status s = c.set("x.timeout", "1500us");  // not a whole number of ms
  EXPECT_NE(s.message().find("whole number of ms"), std::string::npos) << s.message();
  EXPECT_EQ(t.timeout.count(), 60000);
}

TEST(ConfigTypes, ParseDurationDirect) {
  auto r = parse_duration("250ms", 1000);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 250000);
  EXPECT_FALSE(parse_duration("1", 7).ok());  // unsupported field unit
  EXPECT_FALSE(parse_duration("9223372036854775807s", 1).ok());
}

TEST(ConfigTypes, EnumsParseAndReject) {
  Typed t;
  ConfigTable c = table_for(t);
  ASSERT_TRUE(c.set("x.color", " red ").ok());
  EXPECT_EQ(t.color, Color::kRed);
  EXPECT_EQ(value_of(c, "x.color"), "red");
  Status s = c.set("x.color", "blue");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("x.color"), std::string::npos);
  EXPECT_NE(s.message().find("'blue'"), std::string::npos);
  EXPECT_NE(s.message().find("expected red, green"), std::string::npos);
  EXPECT_EQ(t.color, Color::kRed);
}

TEST(ConfigTypes, RangedDoubleAndValidatedString) {
  Typed t;
  ConfigTable c = table_for(t);
  ASSERT_TRUE(c.set("x.share", "1").ok());
  EXPECT_DOUBLE_EQ(t.share, 1.0);
  ASSERT_TRUE(c.set("x.share", "0").ok());
  for (const char* bad : {"1.5", "-0.1", "nan", "half"}) {
    Status s = c.set("x.share", bad);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.message().find("x.share"), std::string::npos);
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
  EXPECT_DOUBLE_EQ(t.share, 0.0);
  ASSERT_TRUE(c.set("x.policy", " arc").ok());
  EXPECT_EQ(t.policy, "arc");
  Status s = c.set("x.policy", "fifo");
  EXPECT_NE(s.message().find("x.policy"), std::string::npos);
  EXPECT_NE(s.message().find("'fifo'"), std::string::npos);
  EXPECT_EQ(t.policy, "arc");
}

TEST(ConfigTypes, EnvAppliesNewTypes) {
  Typed t;
  ConfigTable c = table_for(t);
  std::string a = "KVTIER_X_POLL=1ms", b = "KVTIER_X_COLOR=red", d = "KVTIER_X_SHARE=0.75";
  char* env[] = {a.data(), b.data(), d.data(), nullptr};
  ASSERT_TRUE(c.apply_env(env).ok());
  EXPECT_EQ(t.poll.count(), 1000);
  EXPECT_EQ(t.color, Color::kRed);
  EXPECT_DOUBLE_EQ(t.share, 0.75);
  std::string e = "KVTIER_X_TIMEOUT=soon";
  char* env2[] = {e.data(), nullptr};
  Status s = c.apply_env(env2);
  EXPECT_NE(s.message().find("KVTIER_X_TIMEOUT"), std::string::npos);
  EXPECT_NE(s.message().find("'soon'"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
