#include "kvtier/cache/replay.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "kvtier/cache/plan_executor.h"

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

TEST(Replay, SaneNumbersAndBeladyBoundsEveryPolicy) {
  ReplayOptions o;
  o.device_blocks = 1000;
  o.host_blocks = 0;
  ReplayResult unb = replay_unbounded(sample(), o);
  auto bel = replay_belady(sample(), 1000, o);
  ASSERT_TRUE(bel.ok()) << bel.status().to_string();
  for (const char* p : {"lru", "s3fifo", "arc", "lrfu"}) {
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
  auto t = sweep(sample(), {250, 1000}, {"lru", "lrfu"}, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->policies.size(), 4u);
  EXPECT_EQ(t->policies[2], "belady");
  ASSERT_EQ(t->policies.back(), "min-bypass");
  std::string md = sweep_markdown(*t, 512);
  EXPECT_NE(md.find("| 1000 | 512000 |"), std::string::npos) << md;
  EXPECT_NE(md.find("best / MIN-bypass"), std::string::npos) << md;
  EXPECT_NE(md.find("lrfu (default) / MIN-bypass"), std::string::npos) << md;
  EXPECT_NE(sweep_csv(*t, 512).find("capacity_blocks,capacity_tokens,lru,lrfu,belady,min-bypass"), std::string::npos);
  // MIN with bypass bounds every column, the no-bypass Belady included.
  for (std::size_t c = 0; c < 2; ++c)
    for (std::size_t p = 0; p + 1 < t->policies.size(); ++p)
      EXPECT_LE(t->results[p][c].hit_ratio(), t->results.back()[c].hit_ratio() + 1e-12) << t->policies[p];
  std::string svg = sweep_svg(*t, 512);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  for (std::size_t c = 0; c < 2; ++c)
    for (std::size_t p = 0; p + 1 < t->policies.size(); ++p)
      EXPECT_LE(t->results[p][c].hit_ratio(), t->results.back()[c].hit_ratio());
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
