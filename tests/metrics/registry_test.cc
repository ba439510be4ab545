#include "kvtier/metrics/registry.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace kvtier::metrics {
namespace {

TEST(Registry, CounterSumsEveryThreadsIncrements) {
  Registry r;
  Counter* c = r.counter("kvtier_test_total", "test counter").value();
  constexpr int kThreads = 8, kPer = 20000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < kPer; ++i) c->inc();
    });
  // Scrapes while the writers run see a count between 0 and the total.
  for (int i = 0; i < 20; ++i) EXPECT_LE(c->value(), std::uint64_t{kThreads} * kPer);
  for (auto& t : ts) t.join();
  EXPECT_EQ(c->value(), std::uint64_t{kThreads} * kPer);
}

TEST(Registry, SameNameAndLabelsIsTheSameSeries) {
  Registry r;
  Counter* a = r.counter("x_total", "h", {{"tier", "gpu"}}).value();
  Counter* b = r.counter("x_total", "h", {{"tier", "gpu"}}).value();
  Counter* c = r.counter("x_total", "h", {{"tier", "cpu"}}).value();
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Registry, RejectsBadNamesAndMismatches) {
  Registry r;
  EXPECT_EQ(r.counter("1bad", "h").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.counter("ok_total", "h", {{"__reserved", "v"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.counter("ok_total", "h", {{"a-b", "v"}}).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.counter("ok_total", "h", {{"tier", "gpu"}}).ok());
  EXPECT_EQ(r.gauge("ok_total", "h", {{"tier", "gpu"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.counter("ok_total", "other help", {{"tier", "gpu"}}).status().code(), StatusCode::kInvalidArgument);
  Status s = r.counter("ok_total", "h", {{"dir", "d2h"}}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(tier)"), std::string::npos) << s.message();
  const double bad_bounds[] = {1, 1};
  EXPECT_EQ(r.histogram("h_seconds", "h", bad_bounds).status().code(), StatusCode::kInvalidArgument);
  const double b1[] = {1, 2}, b2[] = {1, 3};
  ASSERT_TRUE(r.histogram("h2_seconds", "h", b1).ok());
  EXPECT_EQ(r.histogram("h2_seconds", "h", b2, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.histogram("h3_seconds", "h", b1, {{"le", "x"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(exponential_buckets(0, 2, 3).ok());
  EXPECT_FALSE(exponential_buckets(1, 1, 3).ok());
  EXPECT_FALSE(exponential_buckets(1, 2, 0).ok());
}

TEST(Registry, HistogramBucketsAreUpperInclusive) {
  const std::vector<double> bounds{0.001, 0.01, 0.1};
  Histogram h(bounds);
  for (double v : {0.0005, 0.001, 0.002, 0.01, 0.5, 7.0}) h.observe(v);
  EXPECT_EQ(h.bucket_counts(), (std::vector<std::uint64_t>{2, 2, 0, 2}));
  EXPECT_EQ(h.count(), 6u);
  EXPECT_DOUBLE_EQ(h.sum(), 0.0005 + 0.001 + 0.002 + 0.01 + 0.5 + 7.0);
}

TEST(Exposition, Format004) {
  Registry r;
  r.counter("kvtier_hits_total", "Blocks served.\nSecond line with \\ backslash", {{"tier", "gpu"}}).value()->inc(3);
  r.counter("kvtier_hits_total", "Blocks served.\nSecond line with \\ backslash", {{"tier", "a\"b\\c\nd"}})
      .value()
      ->inc();
  r.gauge("kvtier_depth", "In flight.").value()->set(2.5);
  const double bounds[] = {0.5, 1};
  Histogram* h = r.histogram("kvtier_lat_seconds", "Latency.", bounds, {{"dir", "h2d"}}).value();
  h->observe(0.25);
  h->observe(0.75);
  h->observe(3);
  const std::string want =
      "# HELP kvtier_depth In flight.\n"
      "# TYPE kvtier_depth gauge\n"
      "kvtier_depth 2.5\n"
      "# HELP kvtier_hits_total Blocks served.\\nSecond line with \\\\ backslash\n"
      "# TYPE kvtier_hits_total counter\n"
      "kvtier_hits_total{tier=\"a\\\"b\\\\c\\nd\"} 1\n"
      "kvtier_hits_total{tier=\"gpu\"} 3\n"
      "# HELP kvtier_lat_seconds Latency.\n"
      "# TYPE kvtier_lat_seconds histogram\n"
      "kvtier_lat_seconds_bucket{dir=\"h2d\",le=\"0.5\"} 1\n"
      "kvtier_lat_seconds_bucket{dir=\"h2d\",le=\"1\"} 2\n"
      "kvtier_lat_seconds_bucket{dir=\"h2d\",le=\"+Inf\"} 3\n"
      "kvtier_lat_seconds_sum{dir=\"h2d\"} 4\n"
      "kvtier_lat_seconds_count{dir=\"h2d\"} 3\n";
  EXPECT_EQ(r.expose(), want);
}

TEST(Exposition, ValuesAndHooks) {
  EXPECT_EQ(format_value(1.0 / 0.0), "+Inf");
  EXPECT_EQ(format_value(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(format_value(0.0 / 0.0), "NaN");
  EXPECT_EQ(format_value(18446744073709551615.0), "1.8446744073709552e+19");
  EXPECT_EQ(format_value(12345), "12345");
  Registry r;
  Gauge* g = r.gauge("kvtier_pool_used_blocks", "Used.").value();
  int calls = 0;
  std::uint64_t id = r.add_collect_hook([&] { g->set(++calls); });
  EXPECT_NE(r.expose().find("kvtier_pool_used_blocks 1\n"), std::string::npos);
  EXPECT_NE(r.expose().find("kvtier_pool_used_blocks 2\n"), std::string::npos);
  r.remove_collect_hook(id);
  EXPECT_NE(r.expose().find("kvtier_pool_used_blocks 2\n"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::metrics
