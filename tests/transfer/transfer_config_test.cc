// TransferManagerConfig bound to a ConfigTable (label cpu): every knob
// round-trips from text and from its env var, bad values name the knob and the
// value and leave the field alone, defaults are the struct's, and a config
// built from env vars drives a real TransferManager on the host backend.
#include "kvtier/transfer/transfer_config.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvtier/copy/copy_config.h"
#include "kvtier/device/host_device.h"
#include "tests/core/config_test_util.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

constexpr const char* kNested = "transfer.copy_engine.";

using Case = kvtier::testing::KnobCase<TransferManagerConfig>;
using kvtier::testing::apply_one_env;
using kvtier::testing::knobs;

// Every top-level (non copy_engine) knob, with a non-default value.
const std::map<std::string, Case>& cases() {
  static const std::map<std::string, Case> c{
      {"transfer.evict_strategy",
       {"dma_batch", "dma_batch", [](const auto& x) { return x.evict_strategy == CopyStrategy::kDmaBatch; }}},
      {"transfer.load_strategy",
       {"sm_kernel", "sm_kernel", [](const auto& x) { return x.load_strategy == CopyStrategy::kSmKernel; }}},
      {"transfer.input_priority",
       {"normal", "normal", [](const auto& x) { return x.input_priority == StreamPriority::kNormal; }}},
      {"transfer.output_priority",
       {"high", "high", [](const auto& x) { return x.output_priority == StreamPriority::kHigh; }}},
      {"transfer.poll_interval", {"2ms", "2000us", [](const auto& x) { return x.poll_interval == 2000us; }}},
      {"transfer.max_in_flight_tasks", {"17", "17", [](const auto& x) { return x.max_in_flight_tasks == 17; }}},
      {"transfer.retained_finished_tasks",
       {"1K", "1024", [](const auto& x) { return x.retained_finished_tasks == 1024; }}},
      {"transfer.max_unpolled_completions",
       {"99", "99", [](const auto& x) { return x.max_unpolled_completions == 99; }}},
      {"transfer.latency_samples", {"128", "128", [](const auto& x) { return x.latency_samples == 128; }}},
      {"transfer.shutdown_timeout", {"5s", "5000ms", [](const auto& x) { return x.shutdown_timeout == 5000ms; }}},
      {"transfer.event_pool_max_free", {"3", "3", [](const auto& x) { return x.event_pool_max_free == 3; }}},
      {"transfer.host_ready_timeout", {"250", "250ms", [](const auto& x) { return x.host_ready_timeout == 250ms; }}},
      {"transfer.async_submit", {"false", "false", [](const auto& x) { return !x.async_submit; }}},
  };
  return c;
}

// A non-default value for a nested copy-engine knob, by type.
std::string nested_value(const KnobInfo& k) {
  if (k.type == "bool") return k.default_value == "true" ? "false" : "true";
  if (k.type.rfind("double", 0) == 0) return k.default_value == "0.5" ? "0.25" : "0.5";  // plain or [0, 1]
  unsigned long lo = 0, hi = 0, multiple = 1;  // a ranged uint32: a value in range, other than the default
  if (std::sscanf(k.type.c_str(), "uint32 [%lu, %lu], multiple of %lu", &lo, &hi, &multiple) >= 2) {
    const unsigned long v = std::to_string(lo + multiple) == k.default_value ? lo : lo + multiple;
    return std::to_string(v);
  }
  return k.default_value == "7" ? "9" : "7";  // uint32 / uint64
}

// Reads a nested knob back from the struct through an independent binding of config.copy_engine.
std::string nested_field(TransferManagerConfig& config, const std::string& knob) {
  ConfigTable check;
  bind_copy_engine_options(check, config.copy_engine, "check");
  return knobs(check).at("check." + knob.substr(std::strlen(kNested))).value;
}

TEST(TransferConfig, EveryKnobIsCoveredAndDefaultsAreTheStructs) {
  TransferManagerConfig c;
  ConfigTable t;
  bind_transfer_manager_config(t, c);
  const TransferManagerConfig fresh;
  std::size_t nested = 0;
  for (const auto& [name, k] : knobs(t)) {
    EXPECT_EQ(k.value, k.default_value) << name;
    EXPECT_EQ(k.env_var, ConfigTable::env_var_for(name));
    EXPECT_FALSE(k.doc.empty()) << name;
    if (name.rfind(kNested, 0) == 0)
      ++nested;
    else
      EXPECT_TRUE(cases().count(name)) << "knob without a round-trip case: " << name;
  }
  for (const auto& [name, c_] : cases()) EXPECT_TRUE(knobs(t).count(name)) << "case without a knob: " << name;
  // The nested table is the whole CopyEngineOptions binding.
  CopyEngineOptions o;
  ConfigTable copy_table;
  bind_copy_engine_options(copy_table, o);
  EXPECT_EQ(nested, copy_table.describe().size());

  // Defaults, spelled out for the top-level knobs.
  const std::map<std::string, std::string> expected{
      {"transfer.evict_strategy", "auto"},
      {"transfer.load_strategy", "auto"},
      {"transfer.input_priority", "high"},
      {"transfer.output_priority", "normal"},
      {"transfer.poll_interval", "50us"},
      {"transfer.max_in_flight_tasks", "4096"},
      {"transfer.retained_finished_tasks", "4096"},
      {"transfer.max_unpolled_completions", "65536"},
      {"transfer.latency_samples", "8192"},
      {"transfer.shutdown_timeout", "60000ms"},
      {"transfer.event_pool_max_free", "4096"},
      {"transfer.host_ready_timeout", "600000ms"},
      {"transfer.async_submit", "true"},
  };
  auto all = knobs(t);
  for (const auto& [name, v] : expected) EXPECT_EQ(all.at(name).default_value, v) << name;
  // The manager's own copy-engine defaults, not CopyEngineOptions{}'s.
  EXPECT_EQ(all.at("transfer.copy_engine.descriptor_slots").default_value,
            std::to_string(fresh.copy_engine.descriptor_slots));
  EXPECT_EQ(all.at("transfer.copy_engine.descriptor_slots").default_value, "256");
  EXPECT_EQ(all.at("transfer.copy_engine.auto_kernel_max_segment_bytes_h2d").default_value, "0");
  EXPECT_EQ(all.at("transfer.copy_engine.auto_kernel_max_segment_bytes_d2h").default_value, "0");
  EXPECT_EQ(all.at("transfer.copy_engine.staged_slot_bytes").default_value,
            std::to_string(fresh.copy_engine.staged_slot_bytes));
  // Binding changes nothing.
  EXPECT_EQ(c.poll_interval, fresh.poll_interval);
  EXPECT_EQ(c.copy_engine.descriptor_slots, fresh.copy_engine.descriptor_slots);
  EXPECT_EQ(c.async_submit, fresh.async_submit);
}

TEST(TransferConfig, TopLevelKnobsRoundTripFromTextAndEnv) {
  ASSERT_NO_FATAL_FAILURE(kvtier::testing::expect_knobs_round_trip(
      cases(), [](ConfigTable& t, TransferManagerConfig& c) { bind_transfer_manager_config(t, c); }));
}

TEST(TransferConfig, NestedCopyEngineKnobsLandInCopyEngine) {
  TransferManagerConfig probe;
  ConfigTable probe_table;
  bind_transfer_manager_config(probe_table, probe);
  for (const auto& [name, k] : knobs(probe_table)) {
    if (name.rfind(kNested, 0) != 0) continue;
    const std::string v = nested_value(k);
    for (bool via_env : {false, true}) {
      SCOPED_TRACE(name + (via_env ? " (env)" : " (set)"));
      TransferManagerConfig c;
      ConfigTable t;
      bind_transfer_manager_config(t, c);
      ASSERT_EQ(nested_field(c, name), k.default_value);
      Status s = via_env ? apply_one_env(t, k.env_var, v) : t.set(name, v);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(nested_field(c, name), v);
      EXPECT_EQ(knobs(t).at(name).value, v);
    }
  }
  // Two spelled-out fields, and that the plain copy.* knobs are not the manager's.
  TransferManagerConfig c;
  ConfigTable t;
  bind_transfer_manager_config(t, c);
  CopyEngineOptions plain;
  bind_copy_engine_options(t, plain);
  ASSERT_TRUE(t.set("transfer.copy_engine.descriptor_slots", "64").ok());
  ASSERT_TRUE(t.set("transfer.copy_engine.auto_kernel_max_segment_bytes_h2d", "16K").ok());
  ASSERT_TRUE(t.set("copy.descriptor_slots", "5").ok());
  EXPECT_EQ(c.copy_engine.descriptor_slots, 64u);
  EXPECT_EQ(c.copy_engine.auto_kernel_max_segment_bytes_h2d, 16u << 10);
  EXPECT_EQ(plain.descriptor_slots, 5u);
}

std::vector<std::string> bad_values_for(const std::string& type) {
  if (type == "bool") return {"maybe", "2"};
  if (type == "double") return {"x1", "0.5.5"};
  if (type.rfind("double [", 0) == 0) return {"x1", "1.5", "-0.1", "nan"};  // a share: [0, 1]
  if (type.rfind("uint32", 0) == 0) return {"lots", "-1", "8G"};            // plain or ranged
  if (type == "uint64") return {"lots", "-1", "1Q"};
  if (type.rfind("enum", 0) == 0) return {"fastest", ""};
  if (type.rfind("duration", 0) == 0) return {"5parsecs", "-1ms", "1.5ms", "1ns"};
  return {};
}

TEST(TransferConfig, BadValuesNameKnobAndValueAndKeepTheField) {
  TransferManagerConfig probe;
  ConfigTable probe_table;
  bind_transfer_manager_config(probe_table, probe);
  for (const auto& [name, k] : knobs(probe_table)) {
    const auto bad = bad_values_for(k.type);
    ASSERT_FALSE(bad.empty()) << name << " has type " << k.type;
    for (const std::string& v : bad) {
      SCOPED_TRACE(name + " = '" + v + "'");
      TransferManagerConfig c;
      ConfigTable t;
      bind_transfer_manager_config(t, c);
      Status s = t.set(name, v);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("'" + v + "'"), std::string::npos) << s.message();
      EXPECT_EQ(knobs(t).at(name).value, k.default_value);
      s = apply_one_env(t, k.env_var, v);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find(k.env_var), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("'" + v + "'"), std::string::npos) << s.message();
      EXPECT_EQ(knobs(t).at(name).value, k.default_value);
    }
  }
  // The enum errors list the accepted names.
  TransferManagerConfig c;
  ConfigTable t;
  bind_transfer_manager_config(t, c);
  EXPECT_NE(t.set("transfer.load_strategy", "warp").message().find("dma_batch"), std::string::npos);
  EXPECT_NE(t.set("transfer.input_priority", "urgent").message().find("normal, high"), std::string::npos);
  EXPECT_FALSE(t.set("transfer.no_such_knob", "1").ok());
}

TEST(TransferConfig, PrefixAndNames) {
  TransferManagerConfig c;
  ConfigTable t;
  bind_transfer_manager_config(t, c, "tm2");
  ASSERT_TRUE(apply_one_env(t, "KVTIER_TM2_POLL_INTERVAL", "7us").ok());
  ASSERT_TRUE(apply_one_env(t, "KVTIER_TM2_COPY_ENGINE_STAGED_SLOTS", "5").ok());
  EXPECT_EQ(c.poll_interval, 7us);
  EXPECT_EQ(c.copy_engine.staged_slots, 5u);
  EXPECT_FALSE(t.set("transfer.poll_interval", "1us").ok());
  for (StreamPriority p : {StreamPriority::kNormal, StreamPriority::kHigh}) {
    auto r = parse_stream_priority(stream_priority_name(p));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, p);
  }
  const std::string md = t.markdown();
  EXPECT_NE(md.find("KVTIER_TM2_EVICT_STRATEGY"), std::string::npos);
  EXPECT_NE(md.find("duration (us)"), std::string::npos);
}

// A config read from env vars drives a real manager: its config() holds the
// values and an evict + load round trip moves the right bytes.
TEST(TransferConfig, EnvConfiguredManagerMovesBytes) {
  TransferManagerConfig config;
  ConfigTable t;
  bind_transfer_manager_config(t, config);
  std::vector<std::string> vars{"KVTIER_TRANSFER_ASYNC_SUBMIT=false", "KVTIER_TRANSFER_LOAD_STRATEGY=dma_per_run",
                                "KVTIER_TRANSFER_EVICT_STRATEGY=dma_batch", "KVTIER_TRANSFER_POLL_INTERVAL=20us",
                                "KVTIER_TRANSFER_COPY_ENGINE_DESCRIPTOR_SLOTS=32"};
  std::vector<char*> env;
  for (auto& v : vars) env.push_back(v.data());
  env.push_back(nullptr);
  ASSERT_TRUE(t.apply_env(env.data()).ok());

  auto dev = HostDevice::create();
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  constexpr std::uint64_t kBlockBytes = 4096, kBlocks = 8;
  auto layout = KvLayout::uniform(2, 2, kBlockBytes);
  ASSERT_TRUE(layout.ok());
  auto compute = (*dev)->create_stream({StreamPriority::kNormal, "compute"});
  ASSERT_TRUE(compute.ok());
  auto mem = (*dev)->allocate_device(layout->total_block_bytes() * kBlocks);
  ASSERT_TRUE(mem.ok());
  std::vector<std::vector<void*>> bases(2);
  std::byte* p = mem->bytes_ptr();
  for (auto& layer : bases)
    for (int r = 0; r < 2; ++r, p += kBlockBytes * kBlocks) layer.push_back(p);
  auto space = BlockSpace::layer_first(MemoryKind::kDevice, (*dev)->ordinal(), *layout, kBlocks, bases);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  KvCacheRegistration reg{*space, {}};
  reg.host.num_blocks = kBlocks;
  auto mgr = TransferManager::create(**dev, **compute, std::move(reg), config);
  ASSERT_TRUE(mgr.ok()) << mgr.status().to_string();
  EXPECT_FALSE((*mgr)->config().async_submit);
  EXPECT_EQ((*mgr)->config().load_strategy, CopyStrategy::kDmaPerRun);
  EXPECT_EQ((*mgr)->config().evict_strategy, CopyStrategy::kDmaBatch);
  EXPECT_EQ((*mgr)->config().poll_interval, 20us);
  EXPECT_EQ((*mgr)->config().copy_engine.descriptor_slots, 32u);

  // Random bytes in device blocks 1, 2; poisoned device blocks 6, 4. Evict 1, 2 -> host 5, 3, then
  // load host 5, 3 -> device 6, 4: every plane of 6, 4 must hold 1's, 2's bytes.
  const std::vector<BlockId> dsrc{1, 2}, hblk{5, 3}, ddst{6, 4};
  std::mt19937_64 rng(11);
  std::vector<std::byte> data(kBlockBytes), got(kBlockBytes), poison(kBlockBytes, std::byte{0xA5});
  std::map<std::pair<int, int>, std::vector<std::byte>> expect;  // (layer * 2 + role, block) -> bytes
  for (int lr = 0; lr < 4; ++lr) {
    for (BlockId b : dsrc) {
      for (auto& x : data) x = static_cast<std::byte>(rng());
      ASSERT_TRUE((*dev)->memcpy_sync(space->block_ptr(lr / 2, lr % 2, b), data.data(), kBlockBytes).ok());
      expect[{lr, b}] = data;
    }
    for (BlockId b : ddst)
      ASSERT_TRUE((*dev)->memcpy_sync(space->block_ptr(lr / 2, lr % 2, b), poison.data(), kBlockBytes).ok());
  }
  auto ev = (*mgr)->evict_to_host_async(dsrc, hblk);
  ASSERT_TRUE(ev.ok()) << ev.status().to_string();
  ASSERT_TRUE((*mgr)->wait(*ev, 10s).ok());
  auto ld = (*mgr)->load_layers_to_device_async({}, hblk, ddst);
  ASSERT_TRUE(ld.ok()) << ld.status().to_string();
  ASSERT_TRUE((*mgr)->wait(*ld, 10s).ok());
  for (int lr = 0; lr < 4; ++lr)
    for (std::size_t i = 0; i < ddst.size(); ++i) {
      ASSERT_TRUE((*dev)->memcpy_sync(got.data(), space->block_ptr(lr / 2, lr % 2, ddst[i]), kBlockBytes).ok());
      EXPECT_EQ(got, (expect[{lr, dsrc[i]}])) << "layer/role " << lr << " block " << ddst[i];
    }
  ASSERT_TRUE((*mgr)->shutdown().ok());
}

}  // namespace
}  // namespace kvtier
