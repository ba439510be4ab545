#include "kvtier/core/log.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "kvtier/core/enum_names.h"

extern char** environ;

namespace kvtier {
namespace {

constexpr std::string_view kComponent = "core/log";

// One installed sink and the number of calls into it that are running.
struct SinkBox {
  LogSink fn;            // empty: the default sink
  int calls = 0;         // guarded by LogState::sink_mu
  bool retired = false;  // replaced: set_log_sink waits on `drained` for calls == 0
};

// Never destroyed: kvtier threads may log while static destructors run.
struct LogState {
  std::atomic<LogLevel> level{LogLevel::kInfo};
  std::once_flag env_once;
  // Held only to pick the sink and count a call in or out, never during a
  // call: a sink runs unlocked, and heavy logging cannot starve a swap.
  std::mutex sink_mu;
  std::condition_variable drained;
  std::unique_ptr<SinkBox> sink = std::make_unique<SinkBox>();
};

LogState& state() {
  static LogState* const s = new LogState;
  return *s;
}

void write_stderr(LogLevel level, std::string_view component, std::string_view message) {
  const std::string line = fmt::format("kvtier[{}] {}: {}\n", component, log_level_name(level), message);
  // One write(2) for the whole line (a partial write is finished by more).
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Calls the sink without the level check and without the environment read.
void emit(LogLevel level, std::string_view component, std::string_view message) noexcept {
  LogState& s = state();
  SinkBox* box = nullptr;
  {
    std::lock_guard<std::mutex> lk(s.sink_mu);
    box = s.sink.get();
    ++box->calls;
  }
  try {
    if (box->fn)
      box->fn(level, component, message);
    else
      write_stderr(level, component, message);
  } catch (...) {
    // A throwing sink (or an allocation failure formatting the default line) loses this line only.
  }
  // `box` is touched only under the lock: set_log_sink destroys it after seeing calls == 0 under it.
  std::lock_guard<std::mutex> lk(s.sink_mu);
  if (--box->calls == 0 && box->retired) s.drained.notify_all();
}

void read_env_once() noexcept {
  LogState& s = state();
  std::call_once(s.env_once, [&s] {
    std::string warning;
    try {
      LogLevel level = LogLevel::kInfo;
      ConfigTable table;
      bind_log_config(table, level);
      if (Status st = table.apply_env(environ); st.ok()) {
        s.level.store(level, std::memory_order_relaxed);
      } else {
        warning = fmt::format("{}; keeping log level {}", st.message(), log_level_name(LogLevel::kInfo));
      }
    } catch (...) {
      warning = "could not read KVTIER_LOG_LEVEL; keeping log level info";
    }
    // Inside call_once: emit() neither reads the level nor re-enters read_env_once.
    if (!warning.empty()) emit(LogLevel::kWarning, kComponent, warning);
  });
}

}  // namespace

constexpr EnumName<LogLevel> kLogLevelEntries[] = {
    {LogLevel::kDebug, "debug"}, {LogLevel::kInfo, "info"}, {LogLevel::kWarning, "warning"},
    {LogLevel::kError, "error"}, {LogLevel::kOff, "off"},
};
constexpr auto kLogLevelNames = enum_table("log level", kLogLevelEntries);
std::string_view log_level_name(LogLevel level) noexcept { return kLogLevelNames.name(level); }

Result<LogLevel> parse_log_level(std::string_view name) { return kLogLevelNames.parse(name); }

void set_log_sink(LogSink sink) noexcept {
  LogState& s = state();
  std::unique_ptr<SinkBox> fresh(new (std::nothrow) SinkBox);
  if (fresh == nullptr) return;  // out of memory: the previous sink stays
  fresh->fn = std::move(sink);
  std::unique_ptr<SinkBox> old;
  {
    std::unique_lock<std::mutex> lk(s.sink_mu);
    old = std::exchange(s.sink, std::move(fresh));
    // No call can enter `old` any more; wait for the ones running in it.
    old->retired = true;
    s.drained.wait(lk, [&old] { return old->calls == 0; });
  }
  // Destroyed here, outside the lock (its destructor may do anything a sink's captures do).
}

void set_log_level(LogLevel level) noexcept {
  read_env_once();  // so that a later first use does not override this call with the environment
  state().level.store(level, std::memory_order_relaxed);
}

LogLevel log_level() noexcept {
  read_env_once();
  return state().level.load(std::memory_order_relaxed);
}

bool log_enabled(LogLevel level) noexcept {
  if (level == LogLevel::kOff) return false;
  const LogLevel threshold = log_level();
  return threshold != LogLevel::kOff && level >= threshold;
}

void log(LogLevel level, std::string_view component, std::string_view message) noexcept {
  if (log_enabled(level)) emit(level, component, message);
}

void bind_log_config(ConfigTable& table, LogLevel& level, const std::string& prefix) {
  const std::vector<LogLevel> levels{LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError,
                                     LogLevel::kOff};
  table.add_enum(prefix + ".level", &level, parse_log_level, log_level_name, levels,
                 "lowest level of the lines kvtier logs (to stderr unless set_log_sink installs a sink)");
}

}  // namespace kvtier
