// The CLI applies KVTIER_CACHE_* / KVTIER_TRANSFER_* env vars before its
// flags (flags win), and rejects bad env values naming the variable and value
// (label cpu; runs the built `kvtier` binary on the host backend).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

extern char** environ;

namespace {

struct CliRun {
  int rc = -1;
  std::string out;
};

enum class Capture { kStdout, kBoth, kStderr };

// Runs `env_prefix kvtier args` through the shell and captures what `what` says.
CliRun run(const std::string& env_prefix, const std::string& args, Capture what) {
  const char* redirect = what == Capture::kStdout ? " 2>/dev/null"
                         : what == Capture::kBoth ? " 2>&1"
                                                  : " 2>&1 >/dev/null";
  const std::string cmd = env_prefix + " '" KVTIER_CLI "' " + args + redirect;
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kReplay =
    std::string("replay --json --max-requests 60 '") + KVTIER_SOURCE_DIR + "/data/traces/mooncake_sample.jsonl'";

class ConfigCli : public ::testing::Test {
 protected:
  void SetUp() override {
    // Inherited KVTIER_* variables would change the defaults under test.
    std::vector<std::string> names;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry(*e);
      if (entry.rfind("KVTIER_", 0) == 0) names.push_back(entry.substr(0, entry.find('=')));
    }
    for (const auto& n : names) unsetenv(n.c_str());
  }
};

nlohmann::json json_of(const CliRun& r) {
  auto j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

TEST_F(ConfigCli, ReplayEnvSetsDefaultsAndFlagsOverride) {
  CliRun base = run("", kReplay, Capture::kStdout);
  ASSERT_EQ(base.rc, 0) << base.out;
  auto j = json_of(base);
  EXPECT_EQ(j["device_blocks"], 2048);
  EXPECT_EQ(j["host_blocks"], 8192);
  EXPECT_EQ(j["policy"], "adaptive");
  EXPECT_EQ(j["write_policy"], "write_back");

  const std::string env =
      "KVTIER_CACHE_DEVICE_BLOCKS=100 KVTIER_CACHE_HOST_BLOCKS=300 KVTIER_CACHE_DEVICE_POLICY=arc "
      "KVTIER_CACHE_WRITE_POLICY=write_through KVTIER_TRANSFER_ASYNC_SUBMIT=false KVTIER_TRANSFER_POLL_INTERVAL=10us";
  CliRun from_env = run(env, kReplay, Capture::kStdout);
  ASSERT_EQ(from_env.rc, 0) << from_env.out;
  j = json_of(from_env);
  EXPECT_EQ(j["device_blocks"], 100);
  EXPECT_EQ(j["host_blocks"], 300);
  EXPECT_EQ(j["policy"], "arc");
  EXPECT_EQ(j["write_policy"], "write_through");
  // The env-configured TransferManager moved real bytes.
  EXPECT_GT(j["transfer"]["bytes_d2h"].get<long>(), 0);
  EXPECT_EQ(j["transfer"]["failed_tasks"], 0);
  EXPECT_EQ(j["transfer"]["verification_failures"], 0);

  CliRun flags = run(env, kReplay + " --device-blocks 50 --policy lru", Capture::kStdout);
  ASSERT_EQ(flags.rc, 0) << flags.out;
  j = json_of(flags);
  EXPECT_EQ(j["device_blocks"], 50);              // flag beats env
  EXPECT_EQ(j["policy"], "lru");                  // flag beats env
  EXPECT_EQ(j["host_blocks"], 300);               // env, no flag
  EXPECT_EQ(j["write_policy"], "write_through");  // env, no flag
}

TEST_F(ConfigCli, ReplayRejectsBadEnvAndUsesEveryCacheKnob) {
  CliRun bad = run("KVTIER_CACHE_DEVICE_BLOCKS=lots", kReplay, Capture::kBoth);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.out.find("KVTIER_CACHE_DEVICE_BLOCKS"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("'lots'"), std::string::npos) << bad.out;
  bad = run("KVTIER_TRANSFER_SHUTDOWN_TIMEOUT=soon", kReplay, Capture::kBoth);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.out.find("transfer.shutdown_timeout"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("'soon'"), std::string::npos) << bad.out;
  // The knobs without a replay flag reach the CacheManager (they were ignored
  // before): a host policy that only the offline Belady replay can serve is
  // rejected by its knob, named, not silently replaced by --policy.
  CliRun host = run("KVTIER_CACHE_HOST_POLICY=belady", kReplay, Capture::kBoth);
  EXPECT_NE(host.rc, 0) << host.out;
  EXPECT_NE(host.out.find("KVTIER_CACHE_HOST_POLICY"), std::string::npos) << host.out;
  EXPECT_NE(host.out.find("needs a next-use oracle"), std::string::npos) << host.out;
  CliRun ok = run("KVTIER_CACHE_HOST_POLICY=arc KVTIER_CACHE_CONTIGUOUS_HOST_RUNS=false", kReplay, Capture::kBoth);
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_EQ(ok.out.find("not used by replay"), std::string::npos) << ok.out;
}

TEST_F(ConfigCli, BenchTransferEnvThenStrategyFlag) {
  const std::string bench = "bench transfer --backend host --shape gqa --reps 1 --gemm-iters 1 --json";
  CliRun env_only = run("KVTIER_TRANSFER_EVICT_STRATEGY=dma_batch", bench, Capture::kStdout);
  ASSERT_EQ(env_only.rc, 0) << env_only.out;
  auto first = nlohmann::json::parse(env_only.out.substr(0, env_only.out.find('\n')));
  EXPECT_EQ(first["strategy"], "auto");
  EXPECT_EQ(first["evict_strategy"], "dma_batch");
  CliRun flag = run("KVTIER_TRANSFER_EVICT_STRATEGY=dma_batch", bench + " --strategy dma_per_run", Capture::kStdout);
  ASSERT_EQ(flag.rc, 0) << flag.out;
  first = nlohmann::json::parse(flag.out.substr(0, flag.out.find('\n')));
  EXPECT_EQ(first["strategy"], "dma_per_run");
  EXPECT_EQ(first["evict_strategy"], "dma_per_run");
  CliRun bad = run("KVTIER_TRANSFER_INPUT_PRIORITY=urgent", bench, Capture::kBoth);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.out.find("KVTIER_TRANSFER_INPUT_PRIORITY"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("'urgent'"), std::string::npos) << bad.out;
}

TEST_F(ConfigCli, BenchCopyEnvThenFlags) {
  const std::string bench =
      "bench copy --backend host --block-sizes 16 --strategies split --directions h2d --reps 1 --warmup 1 "
      "--total-mib 2 --json";
  CliRun env_only = run("KVTIER_COPY_SPLIT_KERNEL_SHARE=0.25", bench, Capture::kStdout);
  ASSERT_EQ(env_only.rc, 0) << env_only.out;
  auto row = nlohmann::json::parse(env_only.out.substr(0, env_only.out.find('\n')));
  EXPECT_EQ(row["split_kernel_share"], 0.25);
  EXPECT_EQ(row["kernel_share"], 0.25) << "what the split ran with";
  EXPECT_EQ(row["rep_kernel_shares"].size(), 1u);
  EXPECT_EQ(row["warmup"], 1);
  CliRun flag = run("KVTIER_COPY_SPLIT_KERNEL_SHARE=0.25", bench + " --split-kernel-share 0.5", Capture::kStdout);
  ASSERT_EQ(flag.rc, 0) << flag.out;
  row = nlohmann::json::parse(flag.out.substr(0, flag.out.find('\n')));
  EXPECT_EQ(row["kernel_share"], 0.5);
  CliRun bad = run("KVTIER_COPY_AUTO_SPLIT_ADAPTIVE=maybe", bench, Capture::kBoth);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.out.find("KVTIER_COPY_AUTO_SPLIT_ADAPTIVE"), std::string::npos) << bad.out;
}

// Bad benchmark flags are usage errors (exit 2) named before anything runs: runs16 with fewer than 4 blocks
// segfaulted (its pools had no run of 16), a huge block size divided by zero, --total-mib past 2^44 wrapped to 0 MiB
// (exit 0), copy-engine flags exited 1 naming internal knobs, bench transfer ran an unknown backend on the host and
// ran the good shapes before failing on a bad one (exit 1), and a failed verification exited 3.
TEST_F(ConfigCli, BenchFlagsAreCheckedBeforeAnythingRuns) {
  const std::string copy = "bench copy --backend host --reps 1 --warmup 0 --strategies dma_batch --directions h2d ";
  CliRun runs16 = run("", copy + "--pattern runs16 --block-sizes 1024 --total-mib 1 --json", Capture::kStdout);
  EXPECT_EQ(runs16.rc, 0) << runs16.out;
  EXPECT_FALSE(json_of(runs16).is_null());
  struct Bad {
    std::string args;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {copy + "--total-mib 1 --block-sizes 18014398509481984", "--block-sizes 18014398509481984"},
      {copy + "--layers 4096 --roles 6 --block-sizes 1048576", "--block-sizes 1048576"},
      {copy + "--total-mib 17592186044416", "--total-mib 17592186044416"},
      {copy + "--pool-min-mib 17592186044416", "--pool-min-mib"},
      {copy + "--sm-item-kib 4194304", "--sm-item-kib 4194304"},  // 32-bit bytes: wrapped to 0
      {copy + "--sm-item-kib 4194305", "--sm-item-kib 4194305"},  // wrapped to 1024-byte items, exit 0
      {copy + "--gate-max-kib 18014398509481985", "--gate-max-kib"},
      {copy + "--staged-slot-mib 17592186044417", "--staged-slot-mib"},
      {copy + "--sm-threads 7", "sm_threads_per_cta"},
      {copy + "--split-kernel-share nan", "split_kernel_share"},
      {"bench transfer --backend bogus", "--backend 'bogus'"},
      {"bench transfer --backend host --shape gqa,foo", "--shape 'foo'"},
      {"bench transfer --backend host --shape gqa,gqa", "'gqa' twice"},
      {"bench transfer --backend host --compute-ratio 1000000", "--compute-ratio"},
      {"bench storage --dir ''", "--dir is empty"},
      {"bench storage --dir /tmp --redis-workers 0", "--redis-workers"},
      {"bench pd --lanes direct-inproc --pool-bytes 18446744073709551615", "--pool-bytes 18446744073709551615"},
      // A lane's flags on a run without that lane changed nothing (they ran the host lanes as if configured).
      {"bench pd --lanes tcp,shm --ring-slots 8", "--ring-slots is for the ring lane only, and --lanes is tcp,shm"},
      {"bench pd --lanes shm --ring-copy sm_kernel", "--ring-copy is for the ring lane"},
      {"bench pd --lanes direct-inproc --ring-slot-bytes 4096", "--ring-slot-bytes is for the ring lane"},
      {"bench pd --lanes tcp --lane-verify receiver", "--lane-verify is for the direct and direct-inproc lanes"},
      {"bench pd --lanes shm --decode-wait final", "--decode-wait is for the direct"},
      {"bench pd --lanes tcp --pool-bytes 1048576", "--pool-bytes is for the direct"},
  };
  for (const Bad& b : bad) {
    CliRun r = run("", b.args, Capture::kBoth);
    EXPECT_EQ(r.rc, 2) << b.args << ": " << r.out;
    EXPECT_NE(r.out.find(b.says), std::string::npos) << b.args << ": " << r.out;
  }
  // --pieces beyond the block count: the descriptors per piece were multiplied by every piece asked for, empty
  // ones included, so host_us_per_descriptor came out several times too small. It is the enqueue time over the
  // segments of the pieces that ran, which the row's `segments` now counts.
  for (const char* pieces : {"1", "4", "64"}) {
    CliRun p =
        run("", copy + "--block-sizes 256 --total-mib 1 --layers 1 --roles 1 --json --pieces " + std::string(pieces),
            Capture::kStdout);
    ASSERT_EQ(p.rc, 0) << p.out;
    const auto row = json_of(p);
    ASSERT_TRUE(row.contains("segments") && row.contains("host_api_ms")) << p.out;
    const double segments = row["segments"].get<double>();
    if (std::string(pieces) == "1")
      EXPECT_TRUE(segments >= 1 && segments <= 4) << p.out;
    else
      EXPECT_EQ(segments, 4.0) << "4 blocks: 4 pieces of one block run, whatever was asked: " << p.out;
    EXPECT_NEAR(row["host_us_per_descriptor"].get<double>(), row["host_api_ms"].get<double>() * 1e3 / segments, 1e-9)
        << p.out;
  }
  CliRun shapes = run("", "bench transfer --backend host --shape gqa,mla --blocks 4 --reps 1 --gemm-iters 1 --json",
                      Capture::kStdout);
  EXPECT_EQ(shapes.rc, 0) << shapes.out;
  EXPECT_NE(shapes.out.find("\"mla\""), std::string::npos) << "both shapes of a comma list ran: " << shapes.out;
}

// A misspelt setting of any table is reported on stderr with the knob it was probably meant for; the command still
// runs (a warning, as the variable changes nothing), and correct or foreign variables say nothing.
TEST_F(ConfigCli, MisspeltSettingsAreNamedWithTheKnobMeant) {
  CliRun r =
      run("KVTIER_CACHE_DEVICE_BLOKS=100 KVTIER_TRANSFER_POLL_INTERVALL=10us KVTIER_STORAGE_DISK_PATHH=/tmp "
          "KVTIER_CACHE_HOST_BLOCKS=300 KVTIER_TEST_ANYTHING=1",
          "info", Capture::kBoth);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("KVTIER_CACHE_DEVICE_BLOKS is not a kvtier setting and is ignored (did you mean "
                       "KVTIER_CACHE_DEVICE_BLOCKS?)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("did you mean KVTIER_TRANSFER_POLL_INTERVAL?"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("KVTIER_STORAGE_DISK_PATHH is not a kvtier setting"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("KVTIER_CACHE_HOST_BLOCKS"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("KVTIER_TEST_ANYTHING"), std::string::npos) << r.out;
  CliRun clean = run("KVTIER_CACHE_HOST_BLOCKS=300", "info", Capture::kStderr);
  EXPECT_EQ(clean.rc, 0);
  EXPECT_EQ(clean.out.find("not a kvtier setting"), std::string::npos) << clean.out;
}

TEST_F(ConfigCli, InfoListsEveryTable) {
  CliRun info = run("KVTIER_TRANSFER_POLL_INTERVAL=2ms", "info --config", Capture::kStdout);
  ASSERT_EQ(info.rc, 0) << info.out;
  for (const char* s :
       {"KVTIER_COPY_SM_CTAS_H2D", "KVTIER_TRANSFER_COPY_ENGINE_DESCRIPTOR_SLOTS", "KVTIER_TRANSFER_EVICT_STRATEGY",
        "KVTIER_CACHE_WRITE_POLICY", "KVTIER_CACHE_HOST_WATERMARKS_LOW", "| duration (us) | 50us | 2000us |"})
    EXPECT_NE(info.out.find(s), std::string::npos) << s;
}

// docs/configuration.md documents every knob `kvtier info --config` prints (two copy-engine knobs were once
// missing from it): a row per knob name.
TEST_F(ConfigCli, TheConfigurationDocListsEveryKnob) {
  CliRun info = run("", "info --config", Capture::kStdout);
  ASSERT_EQ(info.rc, 0) << info.out;
  std::FILE* f = std::fopen(KVTIER_SOURCE_DIR "/docs/configuration.md", "r");
  ASSERT_NE(f, nullptr) << "docs/configuration.md";
  std::string doc;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) doc.append(buf.data(), n);
  std::fclose(f);
  int knobs = 0;
  for (std::size_t at = info.out.find("\n| `"); at != std::string::npos; at = info.out.find("\n| `", at + 1)) {
    const std::size_t end = info.out.find('`', at + 4);
    ASSERT_NE(end, std::string::npos);
    const std::string row_start = info.out.substr(at, end - at + 1);  // "\n| `name`"
    ++knobs;
    EXPECT_NE(doc.find(row_start), std::string::npos)
        << row_start.substr(1) << " is not in docs/configuration.md (regenerate its table from kvtier info --config)";
  }
  EXPECT_GT(knobs, 100);
}

}  // namespace
