#include "kvtier/core/config.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier {
namespace {

struct Demo {
  std::uint64_t chunk = 1 << 20;
  std::uint32_t ctas = 16;
  bool gate = true;
  double ratio = 0.5;
  std::string name = "x";
  int prio = -1;
};

ConfigTable table_for(Demo& d) {
  ConfigTable t;
  t.add("copy.chunk_bytes", &d.chunk, "bytes per chunk");
  t.add("copy.ctas", &d.ctas, "CTAs");
  t.add("copy.gate", &d.gate, "gate small batches");
  t.add("cache.ratio", &d.ratio, "a ratio");
  t.add("cache.name", &d.name, "a name");
  t.add("stream.priority", &d.prio, "priority");
  return t;
}

TEST(Config, SetParsesTypesAndSizes) {
  Demo d;
  ConfigTable t = table_for(d);
  ASSERT_TRUE(t.set("copy.chunk_bytes", "64K").ok());
  EXPECT_EQ(d.chunk, 65536u);
  ASSERT_TRUE(t.set("copy.chunk_bytes", "2MiB").ok() == false);  // MiB is not accepted
  ASSERT_TRUE(t.set("copy.chunk_bytes", "2MB").ok());
  EXPECT_EQ(d.chunk, 2u << 20);
  ASSERT_TRUE(t.set("copy.gate", "off").ok());
  EXPECT_FALSE(d.gate);
  ASSERT_TRUE(t.set("cache.ratio", "0.25").ok());
  EXPECT_DOUBLE_EQ(d.ratio, 0.25);
  ASSERT_TRUE(t.set("stream.priority", "-3").ok());
  EXPECT_EQ(d.prio, -3);
}

TEST(Config, ErrorsNameKnobAndValue) {
  Demo d;
  ConfigTable t = table_for(d);
  Status s = t.set("copy.nope", "1");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("copy.nope"), std::string::npos);
  s = t.set("copy.ctas", "many");
  EXPECT_NE(s.message().find("many"), std::string::npos);
  EXPECT_NE(s.message().find("copy.ctas"), std::string::npos);
  EXPECT_EQ(d.ctas, 16u);  // unchanged
  EXPECT_FALSE(t.set("copy.ctas", "8G").ok());
}

TEST(Config, EnvAndTextApply) {
  Demo d;
  ConfigTable t = table_for(d);
  std::string a = "KVTIER_COPY_CTAS=4", b = "PATH=/bin", c = "KVTIER_CACHE_NAME=lru";
  char* env[] = {a.data(), b.data(), c.data(), nullptr};
  ASSERT_TRUE(t.apply_env(env).ok());
  EXPECT_EQ(d.ctas, 4u);
  EXPECT_EQ(d.name, "lru");
  ASSERT_TRUE(t.apply_text("# comment\ncopy.ctas = 8  # trailing\n\ncache.ratio=1.5\n").ok());
  EXPECT_EQ(d.ctas, 8u);
  Status s = t.apply_text("copy.ctas 3\n");
  EXPECT_NE(s.message().find("line 1"), std::string::npos);
  auto rows = t.describe();
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_NE(t.markdown().find("KVTIER_COPY_CTAS"), std::string::npos);
  for (const auto& r : rows)
    if (r.name == "copy.ctas") {
      EXPECT_EQ(r.default_value, "16");
      EXPECT_EQ(r.value, "8");
    }
}

}  // namespace
}  // namespace kvtier
