#include "sim/replay.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "kvtier/backend/plan_executor.h"
#include "kvtier/testing/plan_executors.h"

namespace kvtier::cache {
namespace {

const std::string kSample = std::string(KVTIER_SOURCE_DIR) + "/data/traces/mooncake_sample.jsonl";

const std::vector<TraceRequest>& sample() {
  static const std::vector<TraceRequest> trace = [] {
    auto t = load_mooncake_trace(kSample, 1000);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() ? *t : std::vector<TraceRequest>{};
  }();
  return trace;
}

TEST(Replay, LoadsTheCommittedSample) {
  ASSERT_EQ(sample().size(), 1000u);
  EXPECT_EQ(sample()[0].hash_ids.size(), 14u);
  EXPECT_EQ(sample()[0].input_length, 6758u);
  EXPECT_EQ(load_mooncake_trace("/nonexistent.jsonl").status().code(), StatusCode::kNotFound);
}

// A trace that exists but cannot be opened was reported NotFound ("cannot be opened", no reason). A unix socket
// stands in for an unreadable file (permissions do not hold for root): opening it fails with ENXIO.
TEST(Replay, ATraceThatExistsButCannotBeOpenedSaysWhy) {
  const auto path = std::filesystem::temp_directory_path() / fmt::format("kvtier_trace_{}.sock", ::getpid());
  std::filesystem::remove(path);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.string().size(), sizeof(addr.sun_path));
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  auto t = load_mooncake_trace(path.string());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << t.status().to_string();
  EXPECT_NE(t.status().message().find(std::strerror(ENXIO)), std::string::npos) << t.status().to_string();
  ::close(fd);
  std::filesystem::remove(path);
}

TEST(Replay, RejectsMalformedLines) {
  auto path = std::filesystem::temp_directory_path() / "kvtier_bad_trace.jsonl";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 5}\n",
               f);
    std::fclose(f);
  }
  auto t = load_mooncake_trace(path.string());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(":2:"), std::string::npos) << t.status().to_string();
  std::filesystem::remove(path);
}

// A bad value is named in the error by its kind and size, never dumped whole: a value nested 100,000 deep crashed the
// loader while it wrote the message (the dump recursed once per level), and a long string was copied in full.
TEST(Replay, ABadValueIsShownBoundedHoweverDeepOrLongItIs) {
  auto path = std::filesystem::temp_directory_path() / "kvtier_deep_trace.jsonl";
  const auto load_line = [&](const std::string& line) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(line.c_str(), f);
    std::fclose(f);
    return load_mooncake_trace(path.string());
  };
  constexpr int kDepth = 100000;
  auto deep = load_line("{\"timestamp\": " + std::string(kDepth, '[') + std::string(kDepth, ']') +
                        ", \"input_length\": 1, \"hash_ids\": [1]}\n");
  EXPECT_EQ(deep.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("timestamp is an array of 1 elements"), std::string::npos)
      << deep.status().to_string();

  auto long_string =
      load_line("{\"timestamp\": 0, \"input_length\": 1, \"hash_ids\": [1, \"" + std::string(1 << 20, 'x') + "\"]}\n");
  EXPECT_EQ(long_string.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(long_string.status().message().find("hash_ids[1] is \"xxx"), std::string::npos);
  EXPECT_NE(long_string.status().message().find("(1048578 characters)"), std::string::npos)
      << long_string.status().message().substr(0, 300);
  EXPECT_LT(long_string.status().message().size(), 400u);
  std::filesystem::remove(path);
}

TEST(Replay, SaneNumbersAndBeladyBoundsEveryPolicy) {
  ReplayOptions o;
  o.device_blocks = 1000;
  o.host_blocks = 0;
  ReplayResult unb = replay_unbounded(sample(), o);
  auto bel = replay_belady(sample(), 1000, o);
  ASSERT_TRUE(bel.ok()) << bel.status().to_string();
  for (const char* p : {"lru", "s3fifo", "arc", "lrfu", "adaptive"}) {
    o.policy = p;
    auto r = replay_trace(sample(), o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_GE(r->hit_ratio(), 0.0);
    EXPECT_LE(r->hit_ratio(), 1.0);
    EXPECT_GT(r->hit_ratio(), 0.01) << p;
    EXPECT_LE(r->hit_ratio(), bel->hit_ratio() + 1e-12) << p << " beats Belady";
    EXPECT_LE(bel->hit_ratio(), unb.hit_ratio() + 1e-12);
    EXPECT_EQ(r->total_blocks, unb.total_blocks);
    EXPECT_EQ(r->host_hit_blocks, 0u);
    EXPECT_LE(r->token_hit_ratio(), 1.0);
  }
}

// A refused admission whose evictions were queued succeeds once their acks are in (admit()'s contract): the replay
// retried only after a write-back demotion, so a host tier smaller than the device's working set refused 206 of the
// first 300 requests at 4 + 1 blocks and its hit ratio fell below that of no host tier at all.
TEST(Replay, AnAdmissionRefusedWhileItsEvictionsRunIsRetried) {
  ReplayOptions o;
  o.device_blocks = 4;
  o.host_blocks = 0;
  const std::vector<TraceRequest> head(sample().begin(), sample().begin() + 300);
  auto alone = replay_trace(head, o);
  ASSERT_TRUE(alone.ok()) << alone.status().to_string();
  for (std::uint32_t host : {1u, 2u, 3u}) {
    o.host_blocks = host;
    auto r = replay_trace(head, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->failed_admissions, 0u) << host << " host blocks";
    EXPECT_GE(r->hit_ratio(), alone->hit_ratio()) << host << " host blocks";
  }
}

// The unbounded ratio is an upper bound of every policy: it counts the keys the cache sees, each chained to its
// prefix. It counted raw ids, so an id seen before under another prefix was a hit no cache could have.
TEST(Replay, UnboundedCountsChainedKeysNotRawIds) {
  std::vector<TraceRequest> t(2);
  t[0].input_length = 1024;
  t[0].hash_ids = {1, 2};
  t[1].timestamp_ms = 1;
  t[1].input_length = 512;
  t[1].hash_ids = {2};  // id 2 again, but at the start of a chain: another block
  ReplayOptions o;
  o.device_blocks = 10240;
  o.host_blocks = 0;
  EXPECT_EQ(replay_unbounded(t, o).device_hit_blocks, 0u);
  t[1].hash_ids = {1};  // the same first block: a hit
  EXPECT_EQ(replay_unbounded(t, o).device_hit_blocks, 1u);
}

// The host tier follows the device's policy, but a duel's shadows learn from the requests' accesses, which a host
// tier below the device does not see (its inserts are demotions): it takes the duel's first expert instead.
TEST(Replay, TheHostTierFollowsADuelWithItsFirstExpert) {
  ReplayOptions o;
  o.device_blocks = 300;
  o.host_blocks = 1200;
  ASSERT_EQ(o.policy, "adaptive");
  auto r = replay_trace(sample(), o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->policy, "adaptive");
  EXPECT_EQ(r->host_policy, "lrfu");
  o.host_policy = "adaptive";  // asked for: kept
  auto both = replay_trace(sample(), o);
  ASSERT_TRUE(both.ok()) << both.status().to_string();
  EXPECT_EQ(both->host_policy, "adaptive");
  o.host_policy.clear();
  o.policy = "s3fifo";
  auto plain = replay_trace(sample(), o);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_EQ(plain->host_policy, "s3fifo");
  o.host_blocks = 0;
  auto one_tier = replay_trace(sample(), o);
  ASSERT_TRUE(one_tier.ok()) << one_tier.status().to_string();
  EXPECT_EQ(one_tier->host_policy, "");
}

// A dueling device policy's lead over the replay: every request counted under the expert that led when it was
// served, and the lead's changes (lru leads first here, lrfu's counts take over); none for a policy of one expert.
TEST(Replay, ReportsWhichExpertOfADuelLed) {
  ReplayOptions o;
  o.device_blocks = 300;
  o.policy = "duel:lru+lrfu";
  auto r = replay_trace(sample(), o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->device_lead_requests.size(), 2u);
  EXPECT_EQ(r->device_lead_requests[0] + r->device_lead_requests[1], r->requests);
  EXPECT_GT(r->device_lead_requests[0], 0u);
  EXPECT_GT(r->device_lead_requests[1], 0u);
  EXPECT_GE(r->device_policy_switches, 1u);
  o.policy = "lru";
  auto plain = replay_trace(sample(), o);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_TRUE(plain->device_lead_requests.empty());
  EXPECT_EQ(plain->device_policy_switches, 0u);
}

TEST(Replay, TwoTiersWithInvariantChecksAndInjectedFailures) {
  ReplayOptions o;
  o.device_blocks = 300;
  o.host_blocks = 1200;
  o.policy = "lru";
  o.check_invariants_every = 50;
  auto clean = replay_trace(sample(), o);
  ASSERT_TRUE(clean.ok()) << clean.status().to_string();
  EXPECT_GT(clean->host_hit_blocks, 0u);
  EXPECT_GT(clean->bytes_h2d, 0u);
  EXPECT_GT(clean->bytes_d2h, 0u);
  auto bel = replay_belady(sample(), 1500, o);
  ASSERT_TRUE(bel.ok());
  EXPECT_LE(clean->hit_ratio(), bel->hit_ratio());
  o.failure_rate = 0.05;
  auto faulty = replay_trace(sample(), o);
  ASSERT_TRUE(faulty.ok()) << faulty.status().to_string();
  EXPECT_GT(faulty->failed_transfers, 0u);
  EXPECT_LE(faulty->hit_ratio(), bel->hit_ratio());
  o.failure_rate = 0;
  o.write_through_threshold = 1;
  o.write_policy = WritePolicy::kWriteThrough;
  auto through = replay_trace(sample(), o);
  ASSERT_TRUE(through.ok()) << through.status().to_string();
  EXPECT_GT(through->host_hit_blocks, 0u);
  EXPECT_GE(through->bytes_d2h, clean->bytes_d2h) << "write-through copies every block";
  // Selective backs up only blocks hit on device: far fewer bytes, and here (few device hits
  // besides the shared first block) no host hits at all.
  o.write_policy = WritePolicy::kWriteThroughSelective;
  auto selective = replay_trace(sample(), o);
  ASSERT_TRUE(selective.ok()) << selective.status().to_string();
  EXPECT_LT(selective->bytes_d2h, through->bytes_d2h / 10);
  EXPECT_LE(selective->hit_ratio(), through->hit_ratio());
}

TEST(Replay, SweepTablesAndPlot) {
  ReplayOptions o;
  SweepOptions so;
  so.default_policy = "lru";  // the columns of a default named explicitly (CacheConfig's is lrfu: below)
  auto t = sweep(sample(), {250, 1000}, {"lru", "lrfu"}, o, so);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  // The named policies, then the peers not named (S3-FIFO, SIEVE; lru is leaf-first LRU), then the bounds.
  const std::vector<std::string> want = {"lru", "lrfu", "s3fifo", "sieve", "belady", "min-bypass"};
  ASSERT_EQ(t->policies, want);
  ASSERT_EQ(t->default_policy, "lru");
  std::string md = sweep_markdown(*t, 512);
  EXPECT_NE(md.find("| 1000 | 512000 |"), std::string::npos) << md;
  EXPECT_NE(md.find("best / MIN-bypass"), std::string::npos) << md;
  EXPECT_NE(md.find("lru (default) / MIN-bypass"), std::string::npos) << md;
  EXPECT_NE(md.find("lru (leaf-first LRU, as vLLM and SGLang) [default]"), std::string::npos) << md;
  EXPECT_NE(md.find("class-TTL bound (cross-validated)"), std::string::npos) << md;
  EXPECT_NE(md.find("lru (default) / class-TTL bound"), std::string::npos) << md;
  EXPECT_NE(md.find("memory multiplier (lru)"), std::string::npos) << md;
  const std::string csv = sweep_csv(*t, 512);
  EXPECT_NE(csv.find("capacity_blocks,capacity_tokens,lru,lrfu,s3fifo,sieve,belady,min-bypass,class_ttl_cv,"
                     "class_ttl_hindsight,memory_multiplier_lru\n"),
            std::string::npos)
      << csv;
  // MIN with bypass bounds every column, the no-bypass Belady included.
  for (std::size_t c = 0; c < 2; ++c)
    for (std::size_t p = 0; p + 1 < t->policies.size(); ++p)
      EXPECT_LE(t->results[p][c].hit_ratio(), t->results.back()[c].hit_ratio() + 1e-12) << t->policies[p];
  // The class-TTL columns are replay_class_ttl's, and the markdown prints them.
  const std::vector<std::uint32_t> caps = {250, 1000};
  auto ttl = replay_class_ttl(sample(), caps, o);
  ASSERT_TRUE(ttl.ok());
  ASSERT_EQ(t->class_ttl.size(), 2u);
  for (std::size_t c = 0; c < 2; ++c) {
    EXPECT_EQ(t->class_ttl[c].cross_validated, (*ttl)[c].cross_validated);
    EXPECT_GT(t->class_ttl[c].cross_validated, 0.0);
    EXPECT_NE(md.find(fmt::format(" {:.4f} |", t->class_ttl[c].cross_validated)), std::string::npos) << md;
  }
  // The memory multiplier. At 250 blocks lru needs more than 16x (the first 1000 requests hold blocks that
  // MIN keeps for their next turn and LRU does not), and 16 * 250 blocks indeed fall short; at 1000 the default
  // at multiplier * C reaches min-bypass at C, and 2% less does not (the bracket the bisection ends on).
  ASSERT_EQ(t->memory_multiplier.size(), 2u);
  ReplayOptions d = o;
  d.policy = t->default_policy;
  d.host_blocks = 0;
  EXPECT_TRUE(std::isinf(t->memory_multiplier[0])) << t->memory_multiplier[0];
  EXPECT_EQ(t->multiplier_capacity[0], 0u);
  d.device_blocks = 16 * 250;
  auto at16 = replay_trace(sample(), d);
  ASSERT_TRUE(at16.ok());
  EXPECT_LT(at16->hit_blocks(), t->results.back()[0].hit_blocks());
  EXPECT_NE(md.find("| >16x |"), std::string::npos) << md;
  {
    const std::uint32_t cap = t->capacities[1];
    const std::uint64_t target = t->results.back()[1].hit_blocks();
    ASSERT_FALSE(std::isinf(t->memory_multiplier[1])) << cap;
    EXPECT_GT(t->memory_multiplier[1], 1.0) << cap;
    const std::uint32_t reach = t->multiplier_capacity[1];
    EXPECT_DOUBLE_EQ(t->memory_multiplier[1], double(reach) / cap);
    d.device_blocks = reach;
    auto at = replay_trace(sample(), d);
    ASSERT_TRUE(at.ok());
    EXPECT_GE(at->hit_blocks(), target) << cap;
    d.device_blocks = static_cast<std::uint32_t>(reach / 1.02);
    auto below = replay_trace(sample(), d);
    ASSERT_TRUE(below.ok());
    EXPECT_LT(below->hit_blocks(), target) << cap << ": " << d.device_blocks << " blocks already reach it";
    EXPECT_NE(md.find(fmt::format("| {:.2f}x |", t->memory_multiplier[1])), std::string::npos) << md;
  }
  std::string svg = sweep_svg(*t, 512);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("class-TTL (CV)"), std::string::npos);
  EXPECT_NE(svg.find("lru (default)"), std::string::npos);
}

// CacheConfig's default policy, a multiplier cap too small to reach MIN, and bad input named.
TEST(Replay, SweepDefaultAndBadInput) {
  ReplayOptions o;
  SweepOptions so;  // no default named: CacheConfig's, lrfu, arc and lru dueling
  ASSERT_EQ(CacheConfig{}.device_policy, "adaptive");
  so.max_multiplier = 1.5;
  auto t = sweep(sample(), {250}, {"arc"}, o, so);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const std::vector<std::string> want = {"arc", "lru", "s3fifo", "sieve", "adaptive", "belady", "min-bypass"};
  EXPECT_EQ(t->policies, want);
  ASSERT_EQ(t->memory_multiplier.size(), 1u);
  EXPECT_TRUE(std::isinf(t->memory_multiplier[0])) << t->memory_multiplier[0];
  const std::string md = sweep_markdown(*t, 512);
  EXPECT_NE(md.find("| >1.5x |"), std::string::npos) << md;
  EXPECT_NE(md.find("adaptive (default) - best peer"), std::string::npos) << md;
  EXPECT_NE(sweep_csv(*t, 512).find(",inf\n"), std::string::npos);
  // The best peer column names a peer and the signed difference.
  const double adaptive = t->results[4][0].hit_ratio();
  double best = 0;
  std::string best_name;
  for (std::size_t p = 1; p <= 3; ++p)
    if (t->results[p][0].hit_ratio() > best) best = t->results[p][0].hit_ratio(), best_name = t->policies[p];
  EXPECT_NE(md.find(fmt::format(" {:+.4f} ({}) |", adaptive - best, best_name)), std::string::npos) << md;

  auto bad = [&](std::vector<std::uint32_t> caps, std::vector<std::string> pols, SweepOptions x, const char* says) {
    auto r = sweep(sample(), caps, pols, o, x);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << says;
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().to_string();
  };
  bad({}, {"lru"}, {}, "no capacities");
  bad({100, 0}, {"lru"}, {}, "capacity 0 (entry 1)");
  bad({100}, {"lru", "nope"}, {}, "'nope'");
  SweepOptions x;
  x.default_policy = "bogus";
  bad({100}, {"lru"}, x, "'bogus'");
  x.default_policy = "belady";
  bad({100}, {"lru"}, x, "'belady'");
  x = {};
  x.max_multiplier = 0.5;
  bad({100}, {"lru"}, x, "max_multiplier 0.5");
  x = {};
  x.multiplier_precision = 0;
  bad({100}, {"lru"}, x, "multiplier_precision 0");
}

// An executor whose moves take wall-clock time, as real copies do: completions are held back until they are
// `delay` old, however often poll() is called.
class SlowExecutor final : public PlanExecutor {
 public:
  explicit SlowExecutor(std::chrono::milliseconds delay) : delay_(delay) {}
  Status execute(const StepPlan& plan) override {
    KVTIER_RETURN_IF_ERROR(inner_.execute(plan));
    for (Completion& c : inner_.poll()) held_.push_back({std::chrono::steady_clock::now() + delay_, std::move(c)});
    return Status::Ok();
  }
  std::vector<Completion> poll() override {
    std::vector<Completion> out;
    const auto now = std::chrono::steady_clock::now();
    while (!held_.empty() && held_.front().ready <= now) {
      out.push_back(std::move(held_.front().c));
      held_.pop_front();
    }
    return out;
  }

 private:
  struct Held {
    std::chrono::steady_clock::time_point ready;
    Completion c;
  };
  std::chrono::milliseconds delay_;
  FakePlanExecutor inner_;
  std::deque<Held> held_;
};

// The replay reports only after every move it started is acknowledged: the evictions of its last requests
// too (they used to be left in flight, so the final counters and the cache it handed to on_request missed
// them).
TEST(Replay, WaitsForEveryMoveBeforeItReports) {
  SlowExecutor slow(std::chrono::milliseconds(30));
  ReplayOptions o;
  o.device_blocks = 64;
  o.host_blocks = 1024;
  o.executor = &slow;
  CacheStats last{};
  o.on_request = [&](const ReplayResult&, const CacheManager& cache) { last = cache.stats(); };
  const std::vector<TraceRequest> part(sample().begin(), sample().begin() + 40);
  auto r = replay_trace(part, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_GT(last.evictions_d2h, 0u) << "the test needs evictions";
  // A host block is used either by a settled copy or by a move in flight.
  EXPECT_EQ(last.tiers[1].used, last.tiers[1].resident) << "moves still in flight when the replay reported";
  EXPECT_TRUE(slow.poll().empty()) << "completions nobody acknowledged";
}

}  // namespace
}  // namespace kvtier::cache
