#include "kvtier/core/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>

#include "kvtier/core/integration_config.h"

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

// Permission bits are octal, as chmod takes them: read as a plain integer, "0440" was decimal 440 (0670, files
// group-writable) and "0600" was refused as 1130.
TEST(Config, ModesAreOctal) {
  std::uint32_t mode = 0600;
  ConfigTable t;
  t.add_mode("disk.file_mode", &mode, "permission bits");
  for (auto [text, want] : {std::pair{"0440", 0440u}, std::pair{"0o600", 0600u}, std::pair{"0O700", 0700u},
                            std::pair{" 0 ", 0u}, std::pair{"0777", 0777u}}) {
    ASSERT_TRUE(t.set("disk.file_mode", text).ok()) << text;
    EXPECT_EQ(mode, want) << text;
  }
  // A bare number was the old decimal form: 416 meant 0640, and read as octal it would grant others read access.
  for (const char* bad : {"0800", "1000", "07777", "abc", "", "-1", "0x1ff", "384 ", "416", "600"}) {
    mode = 0600;
    Status s = t.set("disk.file_mode", bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("disk.file_mode"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("octal"), std::string::npos) << s.to_string();
    EXPECT_EQ(mode, 0600u) << bad;
  }
  EXPECT_EQ(t.describe().front().type, "octal mode");
}

// A misspelt setting is ignored by apply_env; unrecognized_env names it, with the knob it was probably meant for,
// and leaves alone known variables and those of families the table does not have (KVTIER_TEST_..., PATH).
TEST(Config, UnrecognizedEnvNamesMisspeltSettingsOfTheTablesFamilies) {
  Demo d;
  ConfigTable t = table_for(d);
  std::string known = "KVTIER_COPY_CTAS=4", typo = "KVTIER_COPY_CTASS=4", other = "KVTIER_CACHE_SOMETHING_ELSE=1",
              foreign = "KVTIER_TEST_REDIS=localhost", path = "PATH=/bin", bare = "KVTIER_COPY=1",
              no_value = "KVTIER_CACHE_NAM";
  char* env[] = {known.data(), typo.data(), other.data(),    foreign.data(),
                 path.data(),  bare.data(), no_value.data(), nullptr};
  ASSERT_TRUE(t.apply_env(env).ok()) << "apply_env still ignores them";
  EXPECT_EQ(d.ctas, 4u);
  const std::vector<std::string> got = t.unrecognized_env(env);
  ASSERT_EQ(got.size(), 3u) << ::testing::PrintToString(got);
  EXPECT_NE(got[0].find("KVTIER_COPY_CTASS is not a kvtier setting"), std::string::npos) << got[0];
  EXPECT_NE(got[0].find("did you mean KVTIER_COPY_CTAS?"), std::string::npos) << got[0];
  EXPECT_NE(got[1].find("KVTIER_CACHE_SOMETHING_ELSE"), std::string::npos) << got[1];
  EXPECT_EQ(got[1].find("did you mean"), std::string::npos) << "nothing near: " << got[1];
  EXPECT_NE(got[2].find("did you mean KVTIER_CACHE_NAME?"), std::string::npos) << got[2];
  EXPECT_TRUE(t.unrecognized_env(nullptr).empty());
}

// Names outside every knob family were never looked at: KVTIER_METRIC=0 (for KVTIER_METRICS, a knob of no family)
// left metrics on without a word. They are named when near a knob or extending one, and left alone otherwise.
TEST(Config, UnrecognizedEnvNamesSlipsOutsideTheFamilies) {
  Demo d;
  ConfigTable t = table_for(d);
  bool metrics = true;
  t.add("metrics", &metrics, "metrics on");
  std::string slip = "KVTIER_METRIC=0", doubled = "KVTIER_METRICSS=0", extended = "KVTIER_METRICS_ENABLED=0",
              joined = "KVTIER_COPYCTAS=4", foreign = "KVTIER_PYTHON_CUDA=OFF", known = "KVTIER_METRICS=0";
  char* env[] = {slip.data(), doubled.data(), extended.data(), joined.data(), foreign.data(), known.data(), nullptr};
  const std::vector<std::string> got = t.unrecognized_env(env);
  ASSERT_EQ(got.size(), 4u) << ::testing::PrintToString(got);
  EXPECT_NE(got[0].find("KVTIER_METRIC is not a kvtier setting and is ignored (did you mean KVTIER_METRICS?)"),
            std::string::npos)
      << got[0];
  EXPECT_NE(got[1].find("KVTIER_METRICSS is not"), std::string::npos) << got[1];
  EXPECT_NE(got[2].find("KVTIER_METRICS_ENABLED is not a kvtier setting and is ignored (did you mean KVTIER_METRICS?)"),
            std::string::npos)
      << got[2];
  EXPECT_NE(got[3].find("did you mean KVTIER_COPY_CTAS?"), std::string::npos) << got[3];
}

// A range checked only by the knob's consumer let `kvtier info --config` show KVTIER_COPY_SM_THREADS_PER_CTA=33 as
// set, and the consumer's later refusal named its field, not the knob or the variable.
TEST(Config, RangedUint32KnobsRefuseWhatTheirConsumerWould) {
  std::uint32_t threads = 512, lanes = 2;
  ConfigTable t;
  t.add("copy.sm_threads_per_cta", &threads, "threads", 32, 1024, 32);
  t.add("copy.split_dma_lanes", &lanes, "lanes", 1, 16);
  for (const auto& [knob, value, says] : {std::tuple{"copy.sm_threads_per_cta", "33", "33 is not a multiple of 32"},
                                          std::tuple{"copy.sm_threads_per_cta", "2048", "2048 is outside [32, 1024]"},
                                          std::tuple{"copy.sm_threads_per_cta", "0", "0 is outside [32, 1024]"},
                                          std::tuple{"copy.split_dma_lanes", "99", "99 is outside [1, 16]"}}) {
    const Status st = t.set(knob, value);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << knob << "=" << value;
    EXPECT_NE(st.message().find(knob), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
  }
  EXPECT_EQ(threads, 512u);
  EXPECT_EQ(lanes, 2u);
  std::string bad = "KVTIER_COPY_SPLIT_DMA_LANES=0";
  char* env[] = {bad.data(), nullptr};
  const Status st = t.apply_env(env);
  EXPECT_NE(st.message().find("KVTIER_COPY_SPLIT_DMA_LANES"), std::string::npos) << st.message();
  ASSERT_TRUE(t.set("copy.sm_threads_per_cta", "64").ok());
  EXPECT_EQ(threads, 64u);
  EXPECT_EQ(t.describe().front().type, "uint32 [32, 1024], multiple of 32");
}

// An unknown knob set by name (a config file, a Python config dict) names the one it was probably meant to be.
TEST(Config, AnUnknownKnobNamesTheNearestOne) {
  Demo d;
  ConfigTable t = table_for(d);
  Status s = t.set("copy.chunk_byts", "4");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unknown config knob 'copy.chunk_byts' (did you mean 'copy.chunk_bytes'?)"),
            std::string::npos)
      << s.message();
  s = t.set("network.mtu", "4");
  EXPECT_NE(s.message().find("unknown config knob 'network.mtu'"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("did you mean"), std::string::npos) << s.message();
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

// A peer secret of 32 bytes in hex, mixed case.
const std::string kSecretHex = std::string(32, 'A') + std::string(32, 'b');

// The engine integrations' knobs (kvtier.fastdeploy reads them through kvtier._native): the defaults the Python
// code had, the KVTIER_* names it read, and bad values rejected naming the value, except the secret's.
TEST(IntegrationConfig, DefaultsNamesAndValidation) {
  IntegrationConfig c;
  ConfigTable t;
  bind_integration_config(t, c);
  std::map<std::string, std::string> env_of;
  for (const KnobInfo& k : t.describe()) env_of[k.name] = k.env_var;
  EXPECT_EQ(env_of.at("fastdeploy.backend"), "KVTIER_FASTDEPLOY_BACKEND");
  EXPECT_EQ(env_of.at("fastdeploy.fence_evictions"), "KVTIER_FASTDEPLOY_FENCE_EVICTIONS");
  EXPECT_EQ(env_of.at("fastdeploy.sync_timeout"), "KVTIER_FASTDEPLOY_SYNC_TIMEOUT");
  EXPECT_EQ(env_of.at("fastdeploy.pd_role"), "KVTIER_FASTDEPLOY_PD_ROLE");
  EXPECT_EQ(env_of.at("fastdeploy.pd_secret"), "KVTIER_FASTDEPLOY_PD_SECRET");
  EXPECT_EQ(env_of.at("fastdeploy.pd_transport"), "KVTIER_FASTDEPLOY_PD_TRANSPORT");
  EXPECT_EQ(env_of.at("fastdeploy.pd_tls"), "KVTIER_FASTDEPLOY_PD_TLS");
  EXPECT_EQ(env_of.at("fastdeploy.pd_net_devices"), "KVTIER_FASTDEPLOY_PD_NET_DEVICES");
  EXPECT_EQ(env_of.at("metrics"), "KVTIER_METRICS");
  EXPECT_EQ(env_of.size(), 9u);

  EXPECT_EQ(c.fastdeploy_backend, "auto");
  EXPECT_TRUE(c.fastdeploy_fence_evictions);
  EXPECT_DOUBLE_EQ(c.fastdeploy_sync_timeout_s, 300.0);
  EXPECT_EQ(c.fastdeploy_pd_transport, "ipc");
  EXPECT_EQ(c.fastdeploy_pd_tls, "auto");
  EXPECT_TRUE(c.metrics);

  std::string a = "KVTIER_FASTDEPLOY_BACKEND=host", b = "KVTIER_METRICS=0", d = "KVTIER_FASTDEPLOY_SYNC_TIMEOUT=2.5",
              e = "KVTIER_FASTDEPLOY_PD_SECRET=" + kSecretHex;
  char* env[] = {a.data(), b.data(), d.data(), e.data(), nullptr};
  ASSERT_TRUE(t.apply_env(env).ok());
  EXPECT_EQ(c.fastdeploy_backend, "host");
  EXPECT_FALSE(c.metrics);
  EXPECT_DOUBLE_EQ(c.fastdeploy_sync_timeout_s, 2.5);
  EXPECT_EQ(c.fastdeploy_pd_secret, kSecretHex);

  Status s = t.set("fastdeploy.backend", "gpu");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'gpu' is not one of auto, host, cuda"), std::string::npos) << s.to_string();
  EXPECT_EQ(c.fastdeploy_backend, "host");  // unchanged
  s = t.set("fastdeploy.pd_transport", "tcp");
  EXPECT_NE(s.message().find("'tcp'"), std::string::npos) << s.to_string();
  s = t.set("fastdeploy.pd_role", "both");
  EXPECT_NE(s.message().find("'both'"), std::string::npos) << s.to_string();
  s = t.set("fastdeploy.sync_timeout", "-1");
  EXPECT_NE(s.message().find("-1"), std::string::npos) << s.to_string();
  s = t.set("metrics", "2");
  EXPECT_NE(s.message().find("'2' is not a boolean"), std::string::npos) << s.to_string();
  s = t.set("fastdeploy.pd_secret", "s3cretvalue");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().find("s3cretvalue"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("fastdeploy.pd_secret"), std::string::npos) << s.to_string();
  EXPECT_EQ(c.fastdeploy_pd_secret, kSecretHex);
  EXPECT_EQ(t.markdown().find(kSecretHex), std::string::npos);  // `kvtier info --config` shows "(set)"
  EXPECT_NE(t.markdown().find("(set)"), std::string::npos);
}

// The peer secret's length is checked where it is configured (it was only refused when the first prefill/decode
// endpoint was made), and a config line that names the secret knob but forgot its '=' is not echoed.
TEST(IntegrationConfig, PeerSecretLengthCheckedAndNeverEchoed) {
  IntegrationConfig c;
  ConfigTable t;
  bind_integration_config(t, c);
  for (const std::string& bad : {std::string("ABab01"), std::string(62, 'a'), std::string(130, 'a')}) {
    Status s = t.set("fastdeploy.pd_secret", bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.size();
    EXPECT_NE(s.message().find("64 to 128"), std::string::npos) << s.to_string();
    EXPECT_EQ(s.message().find(bad), std::string::npos) << s.to_string();
  }
  EXPECT_TRUE(c.fastdeploy_pd_secret.empty());
  EXPECT_TRUE(t.set("fastdeploy.pd_secret", std::string(128, 'f')).ok());
  EXPECT_TRUE(t.set("fastdeploy.pd_secret", "").ok());  // none

  Status s = t.apply_text("fastdeploy.pd_secret " + kSecretHex + "\n");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("line 1"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("fastdeploy.pd_secret"), std::string::npos) << s.to_string();
  EXPECT_EQ(s.message().find(kSecretHex), std::string::npos) << s.to_string();
  // Other lines without '=' are still shown, so a slip can be found.
  s = t.apply_text("metrics off\n");
  EXPECT_NE(s.message().find("'metrics off'"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace kvtier
