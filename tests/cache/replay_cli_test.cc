// `kvtier replay` on bad input (flags and trace files): each ends with a clear error that names the
// flag or the trace line and the value, a nonzero exit, within seconds and without allocating more
// than the machine has. Also values that are valid although large (hash ids up to 2^64-1, lengths
// beyond 2^32), and the three tiers together from the command line (--transfer host --storage).
// Runs the built `kvtier` binary (label cpu).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

struct CliRun {
  int rc = -1;
  std::string out;
};

// `kvtier args` with stdout and stderr together; a run that hangs is killed (rc 124).
CliRun run(const std::string& args, bool with_stderr = true) {
  const std::string cmd = "timeout 120 '" KVTIER_CLI "' " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
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

const std::string kSample = std::string("'") + KVTIER_SOURCE_DIR + "/data/traces/mooncake_sample.jsonl'";

class ReplayCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> names;  // inherited KVTIER_* variables would change the defaults
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry(*e);
      if (entry.rfind("KVTIER_", 0) == 0 && entry.rfind("KVTIER_TEST_", 0) != 0)
        names.push_back(entry.substr(0, entry.find('=')));
    }
    for (const auto& n : names) unsetenv(n.c_str());
    char tmpl[] = "/tmp/kvtier-replay-cli-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // A trace file holding `lines`; returns its quoted path.
  std::string trace(const std::string& name, const std::vector<std::string>& lines) {
    const std::string path = dir_ + "/" + name;
    std::ofstream f(path);
    for (const auto& l : lines) f << l << "\n";
    return "'" + path + "'";
  }
  std::string dir_;
};

void expect_error(const CliRun& r, const std::vector<std::string>& says, const std::string& what) {
  EXPECT_NE(r.rc, 0) << what << ": " << r.out;
  EXPECT_NE(r.rc, 124) << what << ": hung (killed by timeout)";
  EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << what << ": " << r.out;
  EXPECT_EQ(r.out.find("terminate"), std::string::npos) << what << ": " << r.out;
  for (const auto& s : says)
    EXPECT_NE(r.out.find(s), std::string::npos) << what << ": want '" << s << "' in: " << r.out;
}

TEST_F(ReplayCli, BadFlagsNameTheFlagAndTheValue) {
  struct Case {
    std::string args;
    std::vector<std::string> says;
    int rc = 2;  // a usage error, unless the run itself fails on what the flag did
  };
  const std::vector<Case> cases = {
      {"--sweep -5", {"--sweep", "'-5'"}},  // once parsed as 4294967291: a hang
      {"--sweep 99999999999", {"--sweep", "99999999999"}},
      {"--sweep 1000,abc", {"--sweep", "'abc'"}},
      {"--sweep 0", {"--sweep", "'0'"}},
      {"--sweep 250,500,250", {"--sweep lists capacity 250 twice"}},                  // printed the row twice
      {"--sweep 4000000000", {"--sweep value 4000000000", "machine has"}},            // index beyond memory
      {"--device-blocks 2000000000", {"--device-blocks 2000000000", "machine has"}},  // was std::bad_alloc
      {"--device-blocks 0", {"--device-blocks", "got 0"}},  // was "allocate_device: bytes is 0"
      {"--device-blocks -5", {"--device-blocks", "-5"}},
      {"--device-tokens 100 --block-tokens 512", {"--device-tokens 100", "0 blocks"}},
      {"--host-tokens 511 --block-tokens 512", {"--host-tokens 511", "0 blocks"}},  // took the host tier away
      {"--failure-rate 2", {"--failure-rate", "got 2"}},
      {"--failure-rate -1", {"--failure-rate", "got -1"}},
      {"--failure-rate nan", {"--failure-rate", "nan"}},
      {"--failure-rate ''", {"--failure-rate", "empty"}},  // read as 0: a run without failures, exit 0
      {"--sweep 100 --sweep-max-multiplier ''", {"--sweep-max-multiplier", "empty"}},  // named "got 0"
      // Beyond 64 bits: CLI11 saturated these (the seed ran as 2^64 - 1; errors named 18446744073709551615).
      {"--seed 18446744073709551616", {"--seed", "'18446744073709551616' is out of range"}},
      {"--max-requests 99999999999999999999999", {"--max-requests", "out of range"}},
      {"--block-bytes 18446744073709551616", {"--block-bytes", "'18446744073709551616' is out of range"}},
      {"--max-requests -3", {"--max-requests", "-3"}},
      {"--block-bytes 0", {"--block-bytes", "got 0"}},
      {"--block-bytes -1", {"--block-bytes", "-1"}},
      {"--host-blocks 4000000 --block-bytes 1099511627776", {"--host-blocks 4000000", "machine has"}},
      {"--transfer host --device-blocks 4000000 --block-bytes 1099511627776",
       {"--device-blocks 4000000", "machine has"}},
      {"--transfer gpu", {"--transfer", "'gpu'"}},
      {"--storage disk:/nonexistent --host-blocks 0", {"--storage", "--host-blocks"}},
      {"--sweep 100 --sweep-max-multiplier 0.5", {"--sweep-max-multiplier", "got 0.5"}},
      {"--sweep 100 --sweep-default nope", {"'nope'"}},
      {"--sweep 100 --sweep-policies lru,bogus", {"'bogus'"}},
      // Flags the chosen mode does not use were accepted and ignored (exit 0, a report of another run).
      {"--queue --transfer host", {"--queue", "no --transfer"}},
      {"--queue --tp 2", {"--queue", "no --tp"}},
      {"--queue --metrics-out /tmp/never.txt", {"--queue", "no --metrics-out"}},
      {"--sweep 64 --policy bogus", {"--sweep", "no --policy"}},
      {"--sweep 64 --storage bogus:xx", {"--sweep", "no --storage"}},
      {"--sweep 64 --transfer bogus", {"--sweep", "no --transfer"}},
      {"--policy belady --storage memory:?capacity=1G", {"belady", "no --storage"}},
      {"--policy belady --failure-rate 0.5", {"belady", "no --failure-rate"}},
      {"--policy belady --tp 2", {"belady", "no --tp"}},
      {"--load 2", {"--load needs --queue"}},
      {"--max-batch 8", {"--max-batch needs --queue"}},
      {"--out /tmp/x", {"--out needs --sweep"}},
      {"--sweep-policies lru", {"--sweep-policies needs --sweep"}},
      {"--storage-blocks 10", {"--storage-blocks needs --storage"}},
      {"--storage memory:?capacity=1G --storage-blocks 0", {"--storage-blocks", "got 0"}},  // turned the tier off
      {"--kv-events-replay tcp://127.0.0.1:5", {"--kv-events-replay needs --kv-events"}},
      // 10^13 ms overflowed the deadline's nanoseconds: every move "timed out", exit 0.
      {"--tp 2 --rank-deadline-ms 10000000000000", {"--rank-deadline-ms", "10000000000000"}},
      {"--rank-deadline-ms 0", {"--rank-deadline-ms", "'0'"}},
      {"--write-through-threshold 0", {"--write-through-threshold", "got 0"}},
      {"--queue --load 1e-320", {"load_factor 1e-320", "1e15 s"}, 1},  // arrivals at inf: NaN depths (it exited 0)
      // Given, but empty or 0 where that is what "not given" looks like: these were taken as not given (a default
      // host tier, a plain replay instead of a sweep, no storage tier) and the run exited 0.
      {"--device-tokens 0", {"--device-tokens", "got 0"}},
      {"--host-tokens 0", {"--host-tokens", "got 0"}},
      {"--sweep ''", {"--sweep is given an empty value"}},
      {"--storage ''", {"--storage is given an empty value"}},
      {"--metrics-out ''", {"--metrics-out is given an empty value"}},
      {"--metrics-port 0", {"--metrics-port", "got 0"}},
      {"--policy lrfu:inf", {"lrfu:inf", "boost"}},  // was accepted: priorities inf or NaN, ties broken by depth
      // Lists: an empty item was dropped, and strtod read hexadecimal (a load of 16).
      {"--queue --load 1,,2", {"--load '1,,2'", "item 2 is empty"}},
      {"--queue --load '1, '", {"--load '1, '", "item 2 is empty"}},
      {"--queue --load 0x10", {"--load value '0x10'"}},
      {"--queue --load inf", {"--load value 'inf'"}},
      {"--sweep 100,,200", {"--sweep '100,,200'", "item 2 is empty"}},
      {"--sweep 100 --sweep-policies lru,", {"--sweep-policies 'lru,'", "item 2 is empty"}},
      // Integers in another base: "0512" was read as octal (330 tokens per block), "0x10" as 16.
      {"--block-tokens 0512", {"--block-tokens", "'0512'", "decimal"}},
      {"--device-blocks 0x10", {"--device-blocks", "'0x10'", "decimal"}},
      {"--max-requests 010", {"--max-requests", "'010'", "decimal"}},  // flags with a range check too (8 requests)
      {"--host-tokens 01000", {"--host-tokens", "'01000'", "decimal"}},
      // --sweep replays one device tier per capacity: these were ignored (the same output without them).
      {"--sweep 64 --device-blocks 100", {"--sweep", "no --device-blocks"}},
      {"--sweep 64 --host-blocks 100", {"--sweep", "no --host-blocks"}},
      {"--sweep 64 --seed 3", {"--sweep", "no --seed"}},
      // Output paths are checked first: a sweep ran to its end and then could not write.
      {"--sweep 64 --out /nonexistent/dir/x", {"--out /nonexistent/dir/x", "cannot be written"}},
      {"--metrics-out /nonexistent/dir/m.prom", {"--metrics-out /nonexistent/dir/m.prom", "cannot be written"}},
      // Policy names are checked before the run: a misspelt one exited 1 (a failed run) once the trace was read.
      {"--policy bogus", {"--policy bogus", "unknown eviction policy 'bogus'"}},
      {"--sweep 64 --sweep-default nope", {"--sweep-default nope", "unknown eviction policy"}},
      {"--sweep 64 --sweep-policies lru,bogus", {"--sweep-policies bogus", "unknown eviction policy"}},
      // A value outside a flag's choices exited with CLI11's own code (114), not the usage status.
      {"--write-policy sometimes", {"--write-policy"}},
  };
  for (const Case& c : cases) {
    CliRun r = run("replay --max-requests 20 " + kSample + " " + c.args);
    expect_error(r, c.says, c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args << ": a bad flag is a usage error (exit status 2): " << r.out;
  }
}

// The exit status: 0 done, 1 a failed run, 2 usage; CLI11's parse errors returned its own codes (105-114).
TEST_F(ReplayCli, ExitStatusSaysUsageOrFailure) {
  EXPECT_EQ(run("nosuch").rc, 2);
  EXPECT_EQ(run("replay --device-blocks x " + kSample).rc, 2);
  EXPECT_EQ(run("replay --no-such-flag " + kSample).rc, 2);
  CliRun help = run("--help");
  EXPECT_EQ(help.rc, 0) << help.out;
  EXPECT_NE(help.out.find("Exit status"), std::string::npos) << help.out;
  CliRun missing = run("replay --transfer none '" + dir_ + "/missing.jsonl'");
  EXPECT_EQ(missing.rc, 1) << "a trace that cannot be read fails the run: " << missing.out;
  // A misspelt policy is named before the trace is read (a missing trace is not what it reports).
  CliRun policy = run("replay --transfer none --policy bogus '" + dir_ + "/missing.jsonl'");
  EXPECT_EQ(policy.rc, 2) << policy.out;
  EXPECT_NE(policy.out.find("--policy bogus"), std::string::npos) << policy.out;
  // What a sweep accepts stays accepted: spaces after commas, and the bounds it runs anyway.
  for (const std::string list : {"'lru, arc'", "lru,min-bypass", "lru,belady"}) {
    CliRun sweep =
        run("replay --max-requests 20 --sweep 8,16 --out " + dir_ + "/s --sweep-policies " + list + " " + kSample);
    EXPECT_EQ(sweep.rc, 0) << list << ": " << sweep.out;
  }
}

TEST_F(ReplayCli, BadTracesNameTheLineAndTheValue) {
  const std::string ok = R"({"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]})";
  struct Case {
    std::vector<std::string> lines;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {{ok, R"({"timestamp": 1, "input_length": 512, "output_length": -5, "hash_ids": [1]})"},
       {":2:", "output_length is -5"}},
      {{ok, R"({"timestamp": 1, "input_length": 512, "output_length": 1e20, "hash_ids": [1]})"},
       {":2:", "output_length is 1e+20"}},
      {{R"({"timestamp": 1, "input_length": -1, "hash_ids": [1]})"}, {":1:", "input_length is -1"}},
      {{R"({"timestamp": 1, "input_length": 2.5, "hash_ids": [1]})"}, {":1:", "input_length is 2.5"}},
      {{R"({"timestamp": 1, "input_length": 18446744073709551616, "hash_ids": [1]})"}, {":1:", "input_length is"}},
      {{R"({"timestamp": -3, "input_length": 5, "hash_ids": [1]})"}, {":1:", "timestamp is -3"}},
      {{R"({"timestamp": 1, "hash_ids": [1]})"}, {":1:", "input_length missing"}},
      {{ok, ok, R"({"timestamp": 1, "input_length": 512, "hash_ids": [1, "x"]})"}, {":3:", "hash_ids[1] is \"x\""}},
      {{R"({"timestamp": 1, "input_length": 512, "hash_ids": [-1]})"}, {":1:", "hash_ids[0] is -1"}},
      {{R"({"timestamp": 1, "input_length": 512, "hash_ids": 7})"}, {":1:", "hash_ids"}},
      // The parser's reason is shown (every failure was "not a JSON object"); a JSON value that is no object says so.
      {{"not json"}, {":1:", "not JSON", "syntax error"}},
      {{ok, R"({"timestamp": 1, "input_length": 512, "hash_ids": [1])"}, {":2:", "not JSON", "unexpected end"}},
      {{"[1, 2]"}, {":1:", "not a JSON object but array"}},
      // A number JSON cannot hold is the parser's out_of_range, not a parse_error: it ended the process.
      {{R"({"timestamp": 1844674407370E9551615, "input_length": 4, "hash_ids": [1]})"}, {":1:", "number overflow"}},
      {{std::string("\x1f\x8b\x08\x00") + "compressed"}, {"gzip-compressed", "decompress"}},
      {{R"({"timestamp": 0, "input_length": 18446744073709551615, "hash_ids": [1]})",
        R"({"timestamp": 0, "input_length": 1, "hash_ids": [1]})"},
       {":2:", "exceed 2^64-1"}},
      {{}, {"holds no requests"}},
      // Garbage behind a NUL byte was never seen by the JSON parser.
      {{ok + std::string(1, '\0') + " garbage {{{"}, {":1:", "NUL byte at column"}},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string path = trace("bad" + std::to_string(i) + ".jsonl", cases[i].lines);
    expect_error(run("replay --transfer none " + path), cases[i].says, "trace case " + std::to_string(i));
  }
  // The queue model: a trace out of time order was sorted there but not in the replay it is compared with (a hit
  // ratio that moved for no reason of the queue's), and a huge output_length was blamed on the service rates.
  const std::string unordered =
      trace("unordered.jsonl", {R"({"timestamp": 0, "input_length": 512, "hash_ids": [1]})", "",
                                R"({"timestamp": 10000, "input_length": 512, "hash_ids": [2]})",
                                R"({"timestamp": 5000, "input_length": 512, "hash_ids": [1]})"});
  // Named by request and by the file's line (the blank line makes them differ).
  expect_error(run("replay --transfer none --host-blocks 0 --queue " + unordered),
               {"time order", "request 3 (line 4, timestamp 5000 ms)", "request 2 (line 3, timestamp 10000 ms)"},
               "unordered");
  const std::string long_output =
      trace("long_output.jsonl", {ok, "",
                                  R"({"timestamp": 1, "input_length": 512, "output_length": )"
                                  R"(1000000000000000000, "hash_ids": [1]})"});
  expect_error(run("replay --transfer none --host-blocks 0 --queue " + long_output),
               {"1e15 s", "request 2 (line 3)", "output_length 1000000000000000000"}, "long output");
  expect_error(run("replay --transfer none '" + dir_ + "'"), {dir_, "is a directory"}, "a directory as the trace");
  // A source without newlines was read into memory whole (until none was left).
  expect_error(run("replay --transfer none /dev/zero"), {"/dev/zero:1:", "longer than 256 MiB"}, "/dev/zero");
  expect_error(run("replay --transfer none '" + dir_ + "/missing.jsonl'"), {"missing.jsonl", "does not exist"},
               "a missing trace");
}

// Hash ids of another block size than --block-tokens: the report mixed a hit ratio of 16-token blocks with token
// counts of 512-token ones ("hit ratio 0.0311", "prefill saved 99.50 %") without a word. A warning names it now; a
// trace of the flag's size gets none.
TEST_F(ReplayCli, HashIdsOfAnotherBlockSizeAreWarnedAbout) {
  std::vector<std::string> lines;
  for (int i = 0; i < 8; ++i) {
    std::string ids;
    for (int b = 0; b < 32; ++b) ids += (b ? "," : "") + std::to_string(b < 16 ? b : 1000 * i + b);
    lines.push_back(R"({"timestamp": )" + std::to_string(i) + R"(, "input_length": 512, "hash_ids": [)" + ids + "]}");
  }
  const CliRun sixteen = run("replay --transfer none --host-blocks 0 " + trace("sixteen.jsonl", lines));
  EXPECT_EQ(sixteen.rc, 0) << sixteen.out;
  EXPECT_NE(sixteen.out.find("warning: 8 of 8 requests"), std::string::npos) << sixteen.out;
  EXPECT_NE(sixteen.out.find("16 tokens per hash id"), std::string::npos) << sixteen.out;
  const CliRun fits = run("replay --transfer none --host-blocks 0 --block-tokens 16 " + trace("fits.jsonl", lines));
  EXPECT_EQ(fits.rc, 0) << fits.out;
  EXPECT_EQ(fits.out.find("warning"), std::string::npos) << fits.out;
}

TEST_F(ReplayCli, LargeValidValuesAreKeptExactly) {
  // Hash ids up to 2^64-1 are valid; lengths are kept in 64 bits (2^32 once became 0 tokens, and
  // 99999999999999 became 276447231).
  const std::string path =
      trace("large.jsonl", {R"({"timestamp": 0, "input_length": 99999999999999, "hash_ids": [18446744073709551615]})",
                            R"({"timestamp": 1, "input_length": 4294967296, "output_length": 4294967296, )"
                            R"("hash_ids": [18446744073709551615, 1]})"});
  CliRun r = run("replay --transfer none --json --device-blocks 8 --host-blocks 8 " + path, false);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["requests"], 2);
  EXPECT_EQ(j["total_tokens"].get<std::uint64_t>(), 99999999999999ull + 4294967296ull);
  EXPECT_EQ(j["device_hit_blocks"], 1);  // the second request reuses the first block (id 2^64-1)
}

// --sweep prints the bounds and the peers per capacity: the cross-validated class-TTL bound, leaf-first
// LRU, S3-FIFO, SIEVE, the default's shares and its memory multiplier; the CSV and JSON carry them too.
TEST_F(ReplayCli, SweepPrintsBoundsPeersAndTheMemoryMultiplier) {
  const std::string args =
      "replay --transfer none --max-requests 300 " + kSample + " --sweep 100,400 --sweep-policies adaptive --out '";
  CliRun text = run(args + dir_ + "/sw'");
  ASSERT_EQ(text.rc, 0) << text.out;
  // No --sweep-default: CacheConfig's default policy, adaptive.
  for (const char* s :
       {"| lru (leaf-first LRU, as vLLM and SGLang) |", "| s3fifo |", "| sieve |", "| adaptive [default] |",
        "class-TTL bound (cross-validated)", "adaptive (default) / class-TTL bound", "adaptive (default) - best peer",
        "memory multiplier (adaptive)", "sweep time"})
    EXPECT_NE(text.out.find(s), std::string::npos) << s << " in: " << text.out;
  std::ifstream csv(dir_ + "/sw.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(
      header,
      "capacity_blocks,capacity_tokens,adaptive,lru,s3fifo,sieve,belady,min-bypass,class_ttl_cv,class_ttl_hindsight,"
      "memory_multiplier_adaptive");
  CliRun js = run(args + dir_ + "/sw2' --json --sweep-default lru", false);
  ASSERT_EQ(js.rc, 0) << js.out;
  auto j = nlohmann::json::parse(js.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << js.out;
  EXPECT_EQ(j["default_policy"], "lru");
  ASSERT_EQ(j["class_ttl"].size(), 2u);
  ASSERT_EQ(j["memory_multiplier"].size(), 2u);
  for (std::size_t c = 0; c < 2; ++c) {
    const double cv = j["class_ttl"][c]["cross_validated"].get<double>();
    EXPECT_GT(cv, 0.0);
    EXPECT_LT(cv, j["results"]["min-bypass"][c]["hit_ratio"].get<double>());
    // lru never reaches MIN at the same capacity: a multiplier above 1, or null (not within 16x).
    if (!j["memory_multiplier"][c].is_null()) {
      EXPECT_GT(j["memory_multiplier"][c].get<double>(), 1.0);
    }
  }
  EXPECT_EQ(j["results"]["sieve"].size(), 2u);
}

// --transfer host --storage disk:DIR: device, host and storage tiers together, real bytes on every
// path, every loaded block verified.
void expect_three_tiers(const CliRun& r) {
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_GT(j["device_hit_ratio"].get<double>(), 0.0);
  EXPECT_GT(j["host_hit_ratio"].get<double>(), 0.0);
  EXPECT_GT(j["storage_hit_ratio"].get<double>(), 0.0);
  EXPECT_EQ(j["verification_failures"], 0);
  EXPECT_GT(j["verified_blocks"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(j["transfer"]["backend"], "host");
  EXPECT_GT(j["transfer"]["verified_blocks"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(j["transfer"]["verification_failures"], 0);
  EXPECT_EQ(j["transfer"]["failed_tasks"], 0);
  EXPECT_GT(j["bytes_moved"]["device_to_host"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["bytes_moved"]["host_to_device"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["bytes_moved"]["host_to_storage"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["bytes_moved"]["storage_to_host"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(j["failed_prefetches"], 0);
  EXPECT_EQ(j["failed_storage_writes"], 0);
}

const std::string kThreeTiers =
    "replay --json --transfer host --device-blocks 64 --host-blocks 2048 --storage-blocks 20000 --policy lru "
    "--max-requests 300 " +
    kSample;

TEST_F(ReplayCli, ThreeTiersWithADiskTier) {
  expect_three_tiers(run(kThreeTiers + " --storage 'disk:" + dir_ + "/store?durability=process&direct=off'", false));
  // The text report names every tier and path.
  CliRun text =
      run(kThreeTiers.substr(0, kThreeTiers.find("--json")) + kThreeTiers.substr(kThreeTiers.find("--json") + 7) +
          " --storage 'disk:" + dir_ + "/store2?durability=process&direct=off'");
  ASSERT_EQ(text.rc, 0) << text.out;
  for (const char* s : {"device->host", "host->device", "host->storage", "storage->host", "0 mismatches"})
    EXPECT_NE(text.out.find(s), std::string::npos) << s << " in: " << text.out;
}

// With real transfers the storage tier is made over the transfer manager's host space (ReplayStorage::create_over),
// a path that ignored the KVTIER_STORAGE_* variables: a malformed one was not refused and a valid capacity not
// applied. Now a bad one fails the run naming the variable, as it does with the fake executor.
TEST_F(ReplayCli, StorageKnobVariablesApplyWithRealTransfers) {
  for (const char* transfer : {"--transfer host", "--transfer none"}) {
    setenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH", "banana", 1);
    CliRun r = run("replay --device-blocks 16 --host-blocks 64 --max-requests 20 " + std::string(transfer) +
                   " --storage 'disk:" + dir_ + "/knobs?durability=process&direct=off' " + kSample);
    unsetenv("KVTIER_STORAGE_DISK_QUEUE_DEPTH");
    EXPECT_NE(r.rc, 0) << transfer << ": " << r.out;
    EXPECT_NE(r.out.find("KVTIER_STORAGE_DISK_QUEUE_DEPTH"), std::string::npos) << transfer << ": " << r.out;
  }
}

TEST_F(ReplayCli, ThreeTiersWithARedisTier) {
  const char* ep = std::getenv("KVTIER_TEST_REDIS");
  if (!ep || !*ep) GTEST_SKIP() << "KVTIER_TEST_REDIS not set";
  const char* pw = std::getenv("KVTIER_TEST_REDIS_PASSWORD");
  const std::string spec = std::string("redis://") + (pw && *pw ? std::string(":") + pw + "@" : "") + ep +
                           "?prefix=kvtier-replay-cli-test-" + std::to_string(::getpid());
  expect_three_tiers(run(kThreeTiers + " --storage '" + spec + "'", false));
}

// --failure-rate with real transfers (one rank, no --failure-rank): the moves run on the TransferManager and a
// seeded fraction is reported failed; it used to switch silently to the fake executor (no bytes moved, a
// 64 MiB block size in the report). Alone and with a storage tier.
// Real copies land on worker threads; the replay lets each request's moves land before the next, so its
// hits equal the instant fake executor's in every run, also on a busy machine (bursts of spinning threads
// here). Before it did, these shapes gave 0-4 host hits against 4, 0-27 against 27, 5-91 against 92 and
// 0 against 3 from run to run.
TEST_F(ReplayCli, RealTransfersGiveTheFakeExecutorsHitsInEveryRun) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (unsigned i = 0; i < std::max(2u, std::thread::hardware_concurrency()); ++i)
    spinners.emplace_back([&stop, i] {
      std::uint64_t x = 0x9e3779b97f4a7c15ull * (i + 1);
      while (!stop.load(std::memory_order_relaxed)) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(x % 3000);
        while (std::chrono::steady_clock::now() < until) {
        }
        std::this_thread::sleep_for(std::chrono::microseconds((x >> 20) % 3000));
      }
    });
  struct Join {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~Join() {
      stop = true;
      for (auto& t : threads) t.join();
    }
  } join{stop, spinners};
  struct Shape {
    int device, host, requests;
  };
  for (const Shape& s : {Shape{256, 512, 300}, Shape{128, 256, 600}, Shape{64, 512, 600}, Shape{128, 128, 1000}}) {
    const std::string base = "replay " + kSample + " --max-requests " + std::to_string(s.requests) +
                             " --device-blocks " + std::to_string(s.device) + " --host-blocks " +
                             std::to_string(s.host) + " --json --transfer ";
    SCOPED_TRACE(base);
    CliRun fake = run(base + "none", false);
    ASSERT_EQ(fake.rc, 0) << fake.out;
    const auto f = nlohmann::json::parse(fake.out);
    ASSERT_GT(f["host_hit_blocks"].get<std::uint64_t>(), 0u) << "the shape must reach host hits to test anything";
    for (int round = 0; round < 2; ++round) {
      CliRun r = run(base + "host", false);
      ASSERT_EQ(r.rc, 0) << r.out;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["host_hit_blocks"], f["host_hit_blocks"]) << "round " << round;
      EXPECT_EQ(j["device_hit_blocks"], f["device_hit_blocks"]) << "round " << round;
      EXPECT_EQ(j["transfer"]["bytes_h2d"].get<std::uint64_t>(),
                f["host_hit_blocks"].get<std::uint64_t>() * j["block_bytes"].get<std::uint64_t>())
          << "round " << round;
      EXPECT_EQ(j["transfer"]["verification_failures"], 0);
    }
  }
}

TEST_F(ReplayCli, InjectedFailuresRunOnRealTransfers) {
  const std::string base =
      "replay " + kSample + " --transfer host --max-requests 300 --device-blocks 64 --host-blocks 1024 --json";
  for (const bool with_storage : {false, true}) {
    SCOPED_TRACE(with_storage ? "with a disk tier" : "device and host");
    const std::string storage =
        with_storage ? " --storage-blocks 20000 --storage 'disk:" + dir_ + "/faults?durability=process&direct=off'"
                     : std::string();
    CliRun r = run(base + " --failure-rate 0.05" + storage, false);
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["block_bytes"], 4096) << "real transfers use the real default block size";
    ASSERT_TRUE(j.contains("transfer")) << r.out;
    EXPECT_EQ(j["transfer"]["backend"], "host");
    EXPECT_GT(j["transfer"]["verified_blocks"].get<std::uint64_t>(), 0u);
    EXPECT_EQ(j["transfer"]["verification_failures"], 0);
    EXPECT_EQ(j["verification_failures"], 0);
    EXPECT_GT(j["bytes_moved"]["device_to_host"].get<std::uint64_t>(), 0u);
    const std::uint64_t injected = j["transfer"]["injected_failures"].get<std::uint64_t>();
    EXPECT_GT(injected, 0u);
    // Injected failures are the only failures (no real copy failed); the cache counts those whose block was still
    // cached when the failure arrived (a block already dropped with a failed ancestor is only reclaimed).
    EXPECT_GT(j["failed_transfers"].get<std::uint64_t>(), 0u);
    EXPECT_LE(j["failed_transfers"].get<std::uint64_t>(), injected);
    EXPECT_EQ(j["transfer"]["failed_tasks"], 0);
    if (with_storage) {
      EXPECT_GT(j["bytes_moved"]["host_to_storage"].get<std::uint64_t>(), 0u);
      EXPECT_EQ(j["failed_storage_writes"], 0);
    }
  }
  // The text report says where the failures came from.
  CliRun text = run("replay " + kSample +
                    " --transfer host --max-requests 300 --device-blocks 64 --host-blocks 1024 "
                    "--failure-rate 0.05");
  ASSERT_EQ(text.rc, 0) << text.out;
  EXPECT_NE(text.out.find("injected on rank 0, its copies ran"), std::string::npos) << text.out;
  EXPECT_EQ(text.out.find("fake executor"), std::string::npos) << text.out;
}

// Tensor-parallel ranks: --tp 2 over two host-backend TransferManagers, every rank's loaded shards
// checked; failures injected on rank 1 only are misses on both, with 0 mismatches.
TEST_F(ReplayCli, TensorParallelRanksOnTheHostBackend) {
  const std::string base =
      "replay " + kSample + " --tp 2 --transfer host --max-requests 300 --device-blocks 64 --host-blocks 1024 --json";
  for (const bool inject : {false, true}) {
    SCOPED_TRACE(inject ? "failures on rank 1" : "no failures");
    CliRun r = run(base + (inject ? " --failure-rank 1 --failure-rate 0.05" : ""), false);
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_TRUE(j.contains("tp")) << r.out;
    const auto& tp = j["tp"];
    EXPECT_EQ(tp["ranks"], 2);
    EXPECT_EQ(tp["shard_bytes"], 2048);
    EXPECT_EQ(tp["timed_out_moves"], 0);
    ASSERT_EQ(tp["per_rank"].size(), 2u);
    for (int k = 0; k < 2; ++k) {
      const auto& pr = tp["per_rank"][k];
      EXPECT_EQ(pr["rank"], k);
      EXPECT_GT(pr["verified_blocks"].get<std::uint64_t>(), 0u) << "rank " << k;
      EXPECT_EQ(pr["mismatches"], 0) << "rank " << k;
    }
    EXPECT_EQ(j["transfer"]["verification_failures"], 0);
    if (inject) {
      EXPECT_EQ(tp["per_rank"][0]["failed_moves"], 0);
      EXPECT_GT(tp["per_rank"][1]["injected_failures"].get<std::uint64_t>(), 0u);
      // Every move rank 1 was made to fail is a failed move, and no other move failed (none timed out); the
      // replay reports once every move is acknowledged.
      EXPECT_GT(tp["failed_moves"].get<std::uint64_t>(), 0u);
      EXPECT_EQ(tp["failed_moves"], tp["per_rank"][1]["injected_failures"]);
      EXPECT_GT(j["failed_transfers"].get<std::uint64_t>(), 0u) << "one rank's failures are misses for the cache";
    } else {
      EXPECT_EQ(tp["failed_moves"], 0);
      EXPECT_EQ(j["failed_transfers"], 0);
    }
  }
}

TEST_F(ReplayCli, TensorParallelBadInput) {
  const std::string base = "replay " + kSample + " --max-requests 5 --transfer host";
  expect_error(run(base + " --tp 0"), {"--tp must be >= 1, got 0"}, "tp 0");
  // Each rank's manager has its own threads: --tp 65536 exhausted the machine's threads.
  expect_error(run(base + " --tp 65"), {"--tp 65", "at most 64"}, "tp beyond any machine");
  expect_error(run(base + " --tp 2 --block-bytes 4097"), {"--block-bytes 4097 is not divisible by --tp 2"},
               "block bytes not divisible");
  expect_error(run(base + " --tp 2 --failure-rank 2 --failure-rate 0.1"), {"--failure-rank 2 must be < --tp 2"},
               "failure rank >= tp");
  expect_error(run("replay " + kSample + " --max-requests 5 --tp 2 --transfer none"),
               {"--tp 2 needs real transfers", "--transfer none"}, "tp without transfers");
  expect_error(run(base + " --tp 2 --tp-gpus 3"), {"--tp-gpus 3 must be <= --tp 2"}, "more GPUs than ranks");
}

// `--queue`: a load table per --load, with and without look-ahead, against the replay without the queue
// model; bad queue flags name the flag and the value.
TEST_F(ReplayCli, QueuePrintsTheLoadTable) {
  CliRun r = run("replay --transfer none --host-blocks 0 --device-blocks 200 --max-requests 300 " + kSample +
                 " --queue --load 0.01,4 --lookahead");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* s : {"hit ratio, no queue model", "hit ratio, queue + look-ahead", "mean queue depth", "| 0.01x |",
                        "| 4x |", "model-level assumptions", "load table time"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << " in: " << r.out;
  CliRun j = run("replay --transfer none --host-blocks 0 --device-blocks 200 --max-requests 300 " + kSample +
                     " --queue --load 0.01,4 --json",
                 /*with_stderr=*/false);
  ASSERT_EQ(j.rc, 0) << j.out;
  auto doc = nlohmann::json::parse(j.out, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << j.out;
  ASSERT_EQ(doc["loads"].size(), 2u) << j.out;
  EXPECT_EQ(doc["loads"][0]["queue"]["max_queue_depth"].get<std::uint64_t>(), 0u) << j.out;  // 100x slower: idle
  EXPECT_GT(doc["loads"][1]["queue"]["max_queue_depth"].get<std::uint64_t>(), 0u) << j.out;
  EXPECT_FALSE(doc["loads"][0].contains("lookahead")) << j.out;  // only with --lookahead
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"--queue --load 0", {"--load", "'0'"}},
      {"--queue --load 1,x", {"--load", "'x'"}},
      {"--queue --prefill-tokens-per-s -5", {"--prefill-tokens-per-s", "-5"}},
      {"--queue --decode-tokens-per-s 0", {"--decode-tokens-per-s", "0"}},
      {"--queue --max-batch 0", {"--max-batch", "0"}},
      {"--lookahead", {"--lookahead", "--queue"}},
  };
  for (const auto& [args, says] : bad) {
    CliRun e = run("replay --transfer none --max-requests 5 " + kSample + " " + args);
    expect_error(e, says, args);
    EXPECT_EQ(e.rc, 2) << args << ": " << e.out;
  }
}

// The look-ahead's knobs (KVTIER_CACHE_LOOKAHEAD_*) reach the queue model's cache manager: they were read and
// dropped, so a run with the prefetch off gave the default run's table.
TEST_F(ReplayCli, QueueLookaheadFollowsItsEnvKnobs) {
  const std::string args = "replay --max-requests 1000 --device-blocks 256 --host-blocks 1024 " + kSample +
                           " --queue --lookahead --load 4 --json";
  auto lookahead_hits = [&](const char* prefetch_blocks) {
    if (prefetch_blocks) setenv("KVTIER_CACHE_LOOKAHEAD_PREFETCH_BLOCKS", prefetch_blocks, 1);
    CliRun r = run(args, /*with_stderr=*/false);
    unsetenv("KVTIER_CACHE_LOOKAHEAD_PREFETCH_BLOCKS");
    EXPECT_EQ(r.rc, 0) << r.out;
    auto doc = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_FALSE(doc.is_discarded()) << r.out;
    return doc.is_discarded() ? std::string() : doc["loads"][0]["lookahead"].dump();
  };
  const std::string base = lookahead_hits(nullptr);
  const std::string off = lookahead_hits("0");
  ASSERT_FALSE(base.empty());
  EXPECT_NE(base, off) << "no prefetch moves the same blocks as the default's 64 per plan";
}

}  // namespace

// The benches' counts and sizes of 0 divided by zero (SIGFPE: `bench pd --block-sizes 0`, `bench storage
// --redis-value-kib 0` against a live server) or printed a PASS over nothing (`bench transfer --reps 0`).
TEST(BenchCli, CountsAndSizesOfZeroAreRefusedNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"bench pd --lanes ipc --block-sizes 0 --no-perftest --iters 1", "--block-sizes: '0'"},
      {"bench pd --lanes ipc --iters 0 --no-perftest", "--iters: '0'"},
      {"bench pd --lanes ipc --layers 0", "--layers: '0'"},
      {"bench transfer --backend host --reps 0", "--reps: '0'"},
      {"bench transfer --backend host --gemm-iters 0", "--gemm-iters: '0'"},
      {"bench transfer --backend host --gemm-n 100", "--gemm-n 100"},
      {"bench storage --skip-disk --redis 127.0.0.1:1 --redis-value-kib 0", "--redis-value-kib: '0'"},
      // Unbounded: a vector of 2^32 layers before any check, std::bad_alloc and an abort.
      {"bench pd --lanes ipc --layers 4294967295 --no-perftest --iters 1", "--layers"},
      {"bench copy --backend host --layers 4294967295", "--layers"},
      // NaN passed CLI::Range (every comparison with it is false): a calibration cast from NaN, exit 0.
      {"bench transfer --backend host --compute-ratio nan", "--compute-ratio: 'nan'"}};
  for (const auto& [args, named] : cases) {
    const CliRun r = run(args);
    EXPECT_NE(r.rc, 0) << args << ": " << r.out;
    EXPECT_NE(r.rc, -1) << args << " died of a signal: " << r.out;
    EXPECT_NE(r.out.find(named), std::string::npos) << args << ": " << r.out;
  }
}
