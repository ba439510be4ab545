// CacheConfig bound to a ConfigTable (label cpu): every knob round-trips from
// text and from its env var, bad values name the knob and the value and leave
// the field alone, defaults are the struct's, and an env-built config creates
// a CacheManager holding those values.
#include "kvtier/cache/cache_config.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tests/core/config_test_util.h"

namespace kvtier::cache {
namespace {

using Case = kvtier::testing::KnobCase<CacheConfig>;
using kvtier::testing::apply_one_env;
using kvtier::testing::knobs;

const std::map<std::string, Case>& cases() {
  static const std::map<std::string, Case> c{
      {"cache.device_blocks", {"12", "12", [](const auto& x) { return x.device_blocks == 12; }}},
      {"cache.host_blocks", {"2K", "2048", [](const auto& x) { return x.host_blocks == 2048; }}},
      {"cache.storage_blocks", {"64", "64", [](const auto& x) { return x.storage_blocks == 64; }}},
      {"cache.device_policy", {"s3fifo", "s3fifo", [](const auto& x) { return x.device_policy == "s3fifo"; }}},
      {"cache.host_policy", {" lrfu:2.5 ", "lrfu:2.5", [](const auto& x) { return x.host_policy == "lrfu:2.5"; }}},
      {"cache.storage_policy", {"arc", "arc", [](const auto& x) { return x.storage_policy == "arc"; }}},
      {"cache.write_policy",
       {"write_through_selective", "write_through_selective",
        [](const auto& x) { return x.write_policy == WritePolicy::kWriteThroughSelective; }}},
      {"cache.write_through_threshold", {"5", "5", [](const auto& x) { return x.write_through_threshold == 5; }}},
      {"cache.device_watermarks.low", {"0.1", "0.1", [](const auto& x) { return x.device_watermarks.low == 0.1; }}},
      {"cache.device_watermarks.high", {"0.3", "0.3", [](const auto& x) { return x.device_watermarks.high == 0.3; }}},
      {"cache.host_watermarks.low", {"0.05", "0.05", [](const auto& x) { return x.host_watermarks.low == 0.05; }}},
      {"cache.host_watermarks.high", {"1", "1", [](const auto& x) { return x.host_watermarks.high == 1.0; }}},
      {"cache.contiguous_host_runs", {"off", "false", [](const auto& x) { return !x.contiguous_host_runs; }}},
      {"cache.lookahead_prefetch_blocks", {"0", "0", [](const auto& x) { return x.lookahead_prefetch_blocks == 0; }}},
      {"cache.lookahead_max_fraction", {"0.5", "0.5", [](const auto& x) { return x.lookahead_max_fraction == 0.5; }}},
      {"cache.lookahead_retain_steps", {"2K", "2048", [](const auto& x) { return x.lookahead_retain_steps == 2048; }}},
  };
  return c;
}

TEST(CacheConfigTable, EveryKnobIsCoveredAndDefaultsAreTheStructs) {
  CacheConfig c;
  ConfigTable t;
  bind_cache_config(t, c);
  auto all = knobs(t);
  EXPECT_EQ(all.size(), cases().size());
  for (const auto& [name, k] : all) {
    EXPECT_TRUE(cases().count(name)) << "knob without a round-trip case: " << name;
    EXPECT_EQ(k.value, k.default_value) << name;
    EXPECT_EQ(k.env_var, ConfigTable::env_var_for(name));
    EXPECT_FALSE(k.doc.empty()) << name;
  }
  const CacheConfig fresh;
  const std::map<std::string, std::string> expected{
      {"cache.device_blocks", std::to_string(fresh.device_blocks)},
      {"cache.host_blocks", std::to_string(fresh.host_blocks)},
      {"cache.storage_blocks", std::to_string(fresh.storage_blocks)},
      {"cache.device_policy", fresh.device_policy},
      {"cache.host_policy", fresh.host_policy},
      {"cache.storage_policy", fresh.storage_policy},
      {"cache.write_policy", std::string(write_policy_name(fresh.write_policy))},
      {"cache.write_through_threshold", std::to_string(fresh.write_through_threshold)},
      {"cache.device_watermarks.low", "0"},
      {"cache.device_watermarks.high", "0"},
      {"cache.host_watermarks.low", "0"},
      {"cache.host_watermarks.high", "0"},
      {"cache.contiguous_host_runs", fresh.contiguous_host_runs ? "true" : "false"},
      {"cache.lookahead_prefetch_blocks", std::to_string(fresh.lookahead_prefetch_blocks)},
      {"cache.lookahead_max_fraction", "0.25"},
      {"cache.lookahead_retain_steps", std::to_string(fresh.lookahead_retain_steps)},
  };
  for (const auto& [name, v] : expected) EXPECT_EQ(all.at(name).default_value, v) << name;
  // Spelled out, so that a changed struct default shows up here too.
  EXPECT_EQ(all.at("cache.device_policy").default_value, "adaptive");
  EXPECT_EQ(all.at("cache.write_policy").default_value, "write_back");
  EXPECT_EQ(all.at("cache.write_through_threshold").default_value, "2");
  EXPECT_EQ(all.at("cache.write_policy").type, "enum: write_through, write_through_selective, write_back");
  EXPECT_EQ(all.at("cache.host_watermarks.low").type, "double [0, 1]");
}

TEST(CacheConfigTable, EveryKnobRoundTripsFromTextAndEnv) {
  ASSERT_NO_FATAL_FAILURE(kvtier::testing::expect_knobs_round_trip(
      cases(), [](ConfigTable& t, CacheConfig& c) { bind_cache_config(t, c); }));
  // Every online eviction policy name make_policy knows is accepted by every tier; belady (the offline replay's,
  // its oracle set in code) by the device tier only, and refused by the lower tiers' knobs naming them (it was
  // taken, and CacheManager::create refused it later without naming the knob).
  for (const char* p : {"lru", "s3fifo", "arc", "lrfu", "lrfu:0", "adaptive"}) {
    CacheConfig c;
    ConfigTable t;
    bind_cache_config(t, c);
    ASSERT_TRUE(t.set("cache.storage_policy", p).ok()) << p;
    EXPECT_EQ(c.storage_policy, p);
  }
  CacheConfig c;
  ConfigTable t;
  bind_cache_config(t, c);
  EXPECT_TRUE(t.set("cache.device_policy", "belady").ok());
  for (const char* knob : {"cache.host_policy", "cache.storage_policy"}) {
    const Status s = t.set(knob, "belady");
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << knob;
    EXPECT_NE(s.message().find(knob), std::string::npos) << s.to_string();
  }
  EXPECT_EQ(c.host_policy, "lru");
}

std::vector<std::string> bad_values(const KnobInfo& k) {
  if (k.type == "bool") return {"maybe", "2"};
  if (k.type == "uint32") return {"lots", "-1", "8G"};
  if (k.type == "string") return {"fifo", "lrfu:-1", "lrfu2", ""};
  if (k.type.rfind("enum", 0) == 0) return {"write_sometimes", "writeback"};
  if (k.type.rfind("double [", 0) == 0) return {"1.5", "-0.1", "x", "nan"};
  return {};
}

TEST(CacheConfigTable, BadValuesNameKnobAndValueAndKeepTheField) {
  CacheConfig probe;
  ConfigTable probe_table;
  bind_cache_config(probe_table, probe);
  for (const auto& [name, k] : knobs(probe_table)) {
    const auto bad = bad_values(k);
    ASSERT_FALSE(bad.empty()) << name << " has type " << k.type;
    for (const std::string& v : bad) {
      SCOPED_TRACE(name + " = '" + v + "'");
      CacheConfig c;
      ConfigTable t;
      bind_cache_config(t, c);
      Status s = t.set(name, v);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("'" + v + "'"), std::string::npos) << s.message();
      EXPECT_EQ(knobs(t).at(name).value, k.default_value);
      s = apply_one_env(t, k.env_var, v);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find(k.env_var), std::string::npos) << s.message();
      EXPECT_EQ(knobs(t).at(name).value, k.default_value);
    }
  }
  CacheConfig c;
  ConfigTable t;
  bind_cache_config(t, c);
  EXPECT_NE(t.set("cache.device_policy", "fifo").message().find("known: adaptive, lru"), std::string::npos);
  EXPECT_NE(t.set("cache.write_policy", "x").message().find("write_through_selective"), std::string::npos);
  EXPECT_NE(t.set("cache.host_watermarks.high", "2").message().find("outside [0, 1]"), std::string::npos);
}

TEST(CacheConfigTable, EnvConfigCreatesAManagerWithThoseValues) {
  CacheConfig c;
  ConfigTable t;
  bind_cache_config(t, c, "kv");  // custom prefix: KVTIER_KV_*
  std::vector<std::string> vars{"KVTIER_KV_DEVICE_BLOCKS=16",        "KVTIER_KV_HOST_BLOCKS=32",
                                "KVTIER_KV_DEVICE_POLICY=arc",       "KVTIER_KV_WRITE_POLICY=write_through",
                                "KVTIER_KV_HOST_WATERMARKS_LOW=0.1", "KVTIER_KV_HOST_WATERMARKS_HIGH=0.2",
                                "KVTIER_KV_STORAGE_BLOCKS=64",       "KVTIER_CACHE_DEVICE_BLOCKS=999"};
  std::vector<char*> env;
  for (auto& v : vars) env.push_back(v.data());
  env.push_back(nullptr);
  ASSERT_TRUE(t.apply_env(env.data()).ok());
  EXPECT_EQ(c.device_blocks, 16u);  // KVTIER_CACHE_* is another prefix's
  auto m = CacheManager::create(c);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const CacheConfig& got = (*m)->config();
  EXPECT_EQ(got.device_blocks, 16u);
  EXPECT_EQ(got.host_blocks, 32u);
  EXPECT_EQ(got.storage_blocks, 64u);
  EXPECT_EQ(got.device_policy, "arc");
  EXPECT_EQ(got.write_policy, WritePolicy::kWriteThrough);
  EXPECT_DOUBLE_EQ(got.host_watermarks.low, 0.1);
  EXPECT_DOUBLE_EQ(got.host_watermarks.high, 0.2);
  // Each knob is valid alone; the cross-field rule stays CacheManager::create's.
  ASSERT_TRUE(t.set("kv.device_watermarks.low", "0.5").ok());
  ASSERT_TRUE(t.set("kv.device_watermarks.high", "0.25").ok());
  EXPECT_FALSE(CacheManager::create(c).ok());
}

}  // namespace
}  // namespace kvtier::cache
