#include "kvtier/core/log.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvtier {
namespace {

struct Line {
  LogLevel level;
  std::string component;
  std::string message;
};

// Collects lines; restores the default sink and the level it found when destroyed.
class CapturingSink {
 public:
  CapturingSink() : saved_level_(log_level()) {
    set_log_sink([this](LogLevel level, std::string_view component, std::string_view message) {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.push_back({level, std::string(component), std::string(message)});
    });
  }
  ~CapturingSink() {
    set_log_sink(nullptr);
    set_log_level(saved_level_);
  }
  std::vector<Line> lines() {
    std::lock_guard<std::mutex> lk(mu_);
    return lines_;
  }

 private:
  LogLevel saved_level_;
  std::mutex mu_;
  std::vector<Line> lines_;
};

TEST(Log, SinkReceivesLevelComponentAndMessage) {
  CapturingSink sink;
  set_log_level(LogLevel::kDebug);
  log(LogLevel::kWarning, "storage/disk", "quarantined /x/y.kvo: bad checksum");
  log(LogLevel::kDebug, "core/test", "");
  const auto lines = sink.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].level, LogLevel::kWarning);
  EXPECT_EQ(lines[0].component, "storage/disk");
  EXPECT_EQ(lines[0].message, "quarantined /x/y.kvo: bad checksum");
  EXPECT_EQ(lines[1].level, LogLevel::kDebug);
  EXPECT_EQ(lines[1].component, "core/test");
  EXPECT_EQ(lines[1].message, "");
}

TEST(Log, LevelFiltersLinesBelowIt) {
  CapturingSink sink;
  const std::vector<LogLevel> all{LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError,
                                  LogLevel::kOff};
  std::size_t expected = 0;
  for (LogLevel threshold : all) {
    set_log_level(threshold);
    EXPECT_EQ(log_level(), threshold);
    for (LogLevel level : all) {
      const bool shown = level != LogLevel::kOff && threshold != LogLevel::kOff && level >= threshold;
      EXPECT_EQ(log_enabled(level), shown) << log_level_name(level) << " at " << log_level_name(threshold);
      log(level, "core/test", fmt::format("{} at {}", log_level_name(level), log_level_name(threshold)));
      if (shown) ++expected;
    }
  }
  const auto lines = sink.lines();
  ASSERT_EQ(lines.size(), expected);
  // warning threshold: warning and error only.
  std::vector<std::string> at_warning;
  for (const Line& l : lines)
    if (l.message.ends_with(" at warning")) at_warning.push_back(l.message);
  EXPECT_EQ(at_warning, (std::vector<std::string>{"warning at warning", "error at warning"}));
  for (const Line& l : lines) EXPECT_FALSE(l.message.ends_with(" at off")) << l.message;
}

TEST(Log, NamesRoundTripAndParseErrorsNameTheValue) {
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError, LogLevel::kOff}) {
    auto parsed = parse_log_level(log_level_name(l));
    ASSERT_TRUE(parsed.ok()) << log_level_name(l);
    EXPECT_EQ(*parsed, l);
  }
  EXPECT_EQ(log_level_name(LogLevel::kWarning), "warning");
  for (const char* bad : {"loud", "WARNING", "warn", "", "info "}) {
    auto r = parse_log_level(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(fmt::format("'{}'", bad)), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().message().find("debug, info, warning, error, off"), std::string::npos)
        << r.status().to_string();
  }
}

TEST(Log, ConfigKnobBindsLevel) {
  LogLevel level = LogLevel::kInfo;
  ConfigTable t;
  bind_log_config(t, level);
  const auto knobs = t.describe();
  ASSERT_EQ(knobs.size(), 1u);
  EXPECT_EQ(knobs[0].name, "log.level");
  EXPECT_EQ(knobs[0].env_var, "KVTIER_LOG_LEVEL");
  EXPECT_EQ(knobs[0].type, "enum: debug, info, warning, error, off");
  EXPECT_EQ(knobs[0].default_value, "info");
  ASSERT_TRUE(t.set("log.level", " error ").ok());
  EXPECT_EQ(level, LogLevel::kError);
  Status bad = t.set("log.level", "loud");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("'loud'"), std::string::npos) << bad.to_string();
  EXPECT_EQ(level, LogLevel::kError);
  std::string env0 = "KVTIER_LOG_LEVEL=debug";
  char* env[] = {env0.data(), nullptr};
  ASSERT_TRUE(t.apply_env(env).ok());
  EXPECT_EQ(level, LogLevel::kDebug);
}

TEST(Log, DefaultSinkWritesOneLineToStderrAndIsRestoredByNullptr) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kInfo);
  int calls = 0;
  set_log_sink([&calls](LogLevel, std::string_view, std::string_view) { ++calls; });
  log(LogLevel::kInfo, "core/test", "to the sink");
  set_log_sink(nullptr);
  testing::internal::CaptureStderr();
  log(LogLevel::kWarning, "core/test", "to stderr");
  log(LogLevel::kDebug, "core/test", "filtered");
  const std::string err = testing::internal::GetCapturedStderr();
  set_log_level(saved);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(err, "kvtier[core/test] warning: to stderr\n");
}

TEST(Log, ReplacedSinkIsNeverCalledAgainAndIsDestroyed) {
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> alive = token;
  int old_calls = 0;
  set_log_sink([&old_calls, token](LogLevel, std::string_view, std::string_view) { ++old_calls; });
  token.reset();
  log(LogLevel::kError, "core/test", "old");
  {
    CapturingSink sink;
    EXPECT_TRUE(alive.expired());  // the previous sink (and what it captured) is gone once set_log_sink returns
    log(LogLevel::kError, "core/test", "new");
    EXPECT_EQ(old_calls, 1);
    ASSERT_EQ(sink.lines().size(), 1u);
  }
}

TEST(Log, ThrowingSinkLosesTheLineOnly) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kInfo);
  int calls = 0;
  set_log_sink([&calls](LogLevel, std::string_view, std::string_view message) {
    ++calls;
    if (message == "throw") throw std::runtime_error("sink failed");
  });
  log(LogLevel::kError, "core/test", "throw");  // noexcept: must not terminate
  log(LogLevel::kError, "core/test", "next");
  set_log_sink(nullptr);
  set_log_level(saved);
  EXPECT_EQ(calls, 2);
}

// 8 threads log while another swaps in a fresh sink each round and flips the
// level between two values that both let the lines through (the loggers keep
// going until every swap is done, so each swap overlaps logging): every line
// lands in exactly one sink, and a sink receives nothing after it was replaced.
TEST(Log, ConcurrentLoggingWhileSwappingSinks) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kInfo);
  constexpr int kThreads = 8;
  constexpr int kMinLinesPerThread = 1000;
  constexpr int kSinks = 200;
  struct Slot {
    std::atomic<std::uint64_t> lines{0};
    std::atomic<std::uint64_t> bad{0};
  };
  std::vector<Slot> slots(kSinks);
  auto sink_for = [&slots](int i) {
    return [slot = &slots[i]](LogLevel level, std::string_view component, std::string_view message) {
      if (level != LogLevel::kWarning || component != "core/test" || !message.starts_with("line "))
        slot->bad.fetch_add(1, std::memory_order_relaxed);
      slot->lines.fetch_add(1, std::memory_order_relaxed);
    };
  };
  set_log_sink(sink_for(0));
  std::atomic<int> started{0};
  std::atomic<bool> swaps_done{false};
  std::atomic<std::uint64_t> logged{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      started.fetch_add(1);
      int i = 0;
      for (; i < kMinLinesPerThread || !swaps_done.load(); ++i)
        log(LogLevel::kWarning, "core/test", fmt::format("line {} of thread {}", i, t));
      logged.fetch_add(static_cast<std::uint64_t>(i));
    });
  while (started.load() < kThreads) std::this_thread::yield();
  std::vector<std::uint64_t> at_replacement(kSinks, 0);
  for (int i = 1; i < kSinks; ++i) {
    set_log_sink(sink_for(i));
    at_replacement[i - 1] = slots[i - 1].lines.load();
    set_log_level(i % 2 ? LogLevel::kWarning : LogLevel::kDebug);
    std::this_thread::yield();
  }
  swaps_done = true;
  for (auto& th : threads) th.join();
  set_log_sink(nullptr);
  at_replacement[kSinks - 1] = slots[kSinks - 1].lines.load();
  set_log_level(saved);

  std::uint64_t total = 0;
  for (int i = 0; i < kSinks; ++i) {
    EXPECT_EQ(slots[i].bad.load(), 0u) << "sink " << i;
    EXPECT_EQ(slots[i].lines.load(), at_replacement[i]) << "sink " << i << " called after it was replaced";
    total += slots[i].lines.load();
  }
  EXPECT_EQ(total, logged.load());
  EXPECT_GE(total, static_cast<std::uint64_t>(kThreads) * kMinLinesPerThread);
}

// The environment is read once per process, at the first use: these run in a
// fresh process (death-test style "threadsafe" re-executes the binary).
TEST(LogEnv, LevelComesFromTheEnvironmentAtFirstUse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("KVTIER_LOG_LEVEL", "error", 1);
        std::exit(log_level() == LogLevel::kError && !log_enabled(LogLevel::kWarning) ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::unsetenv("KVTIER_LOG_LEVEL");
        std::exit(log_level() == LogLevel::kInfo ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  // set_log_level before the first use wins over the environment.
  EXPECT_EXIT(
      {
        ::setenv("KVTIER_LOG_LEVEL", "error", 1);
        set_log_level(LogLevel::kDebug);
        std::exit(log_level() == LogLevel::kDebug ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}

TEST(LogEnv, BadValueKeepsInfoAndWarnsOnceThroughTheSink) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("KVTIER_LOG_LEVEL", "loud", 1);
        std::vector<Line> lines;
        set_log_sink([&lines](LogLevel level, std::string_view component, std::string_view message) {
          lines.push_back({level, std::string(component), std::string(message)});
        });
        const bool info =
            log_level() == LogLevel::kInfo && log_enabled(LogLevel::kInfo) && !log_enabled(LogLevel::kDebug);
        set_log_sink(nullptr);
        if (lines.size() == 1) std::fprintf(stderr, "[%s] %s\n", lines[0].component.c_str(), lines[0].message.c_str());
        const bool warned = lines.size() == 1 && lines[0].level == LogLevel::kWarning &&
                            lines[0].component == "core/log" &&
                            lines[0].message.find("KVTIER_LOG_LEVEL") != std::string::npos &&
                            lines[0].message.find("'loud'") != std::string::npos;
        std::exit(info && warned ? 0 : 1);
      },
      testing::ExitedWithCode(0), "\\[core/log\\] KVTIER_LOG_LEVEL: .*'loud'");
}

}  // namespace
}  // namespace kvtier
