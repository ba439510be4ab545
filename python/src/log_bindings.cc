// kvtier's log into Python's `logging`. The C++ sink (core/log.h) may be
// called on any kvtier thread, possibly while it holds a lock that a Python
// thread holding the GIL waits for: so it never takes the GIL. It appends the
// line to a bounded queue; a Python daemon thread (kvtier/_logging.py) takes
// lines off it with the GIL released and emits them on the
// "kvtier.<component>" loggers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <tuple>

#include "kvtier/core/log.h"
#include "status_bridge.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {
namespace {

struct LogQueue {
  static constexpr std::size_t kCapacity = 16384;  // oldest lines dropped beyond (and counted)
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::tuple<int, std::string, std::string>> lines;
  std::uint64_t dropped = 0;
  bool stopping = false;  // the interpreter is exiting: waits return at once
};

// Never destroyed: kvtier threads may log after the interpreter is gone. Replaced in a forked child
// (_reset_log_queue_after_fork): the parent's mutex may have been held by one of its threads at the fork, and the
// child has no such thread to release it.
std::atomic<LogQueue*> g_queue{new LogQueue()};
LogQueue& queue() { return *g_queue.load(std::memory_order_acquire); }

int python_level(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return 10;
    case LogLevel::kInfo: return 20;
    case LogLevel::kWarning: return 30;
    case LogLevel::kError: return 40;
    case LogLevel::kOff: return 50;
  }
  return 20;
}

}  // namespace

void bind_log(nb::module_& m) {
  m.def("_install_log_sink", [] {
    set_log_sink([](LogLevel level, std::string_view component, std::string_view message) {
      LogQueue& q = queue();
      {
        std::lock_guard lock(q.mu);
        if (q.lines.size() >= LogQueue::kCapacity) {
          q.lines.pop_front();
          ++q.dropped;
        }
        q.lines.emplace_back(python_level(level), std::string(component), std::string(message));
      }
      q.cv.notify_one();
    });
  });
  m.def(
      "_reset_log_queue_after_fork",
      [] { g_queue.store(new LogQueue(), std::memory_order_release); },  // the parent's queue is left as it was
      "In a forked child, before its pump thread starts: a fresh, empty queue.");
  m.def("_restore_default_log_sink", [] {
    GilReleased release;
    set_log_sink(nullptr);
  });
  m.def(
      "_next_log_lines",
      [](double timeout_s) {
        std::deque<std::tuple<int, std::string, std::string>> out;
        std::uint64_t dropped = 0;
        {
          GilReleased release;
          LogQueue& q = queue();
          std::unique_lock lock(q.mu);
          q.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !q.lines.empty() || q.stopping; });
          out.swap(q.lines);
          dropped = q.dropped;
          q.dropped = 0;
        }
        nb::list lines;
        for (auto& [lvl, comp, msg] : out) lines.append(nb::make_tuple(lvl, comp, msg));
        return nb::make_tuple(lines, dropped);
      },
      "timeout"_a,
      "Lines logged since the last call (waits up to `timeout` s for one, GIL released), and how many "
      "were dropped because the queue was full.");
  m.def(
      "_stop_log_pump",
      [] {
        LogQueue& q = queue();
        {
          std::lock_guard lock(q.mu);
          q.stopping = true;
        }
        q.cv.notify_all();
      },
      "Makes _next_log_lines return at once from now on (atexit: the pump thread must not sit in a wait "
      "with the GIL released while the interpreter finalizes, or it is killed inside C++ frames).");
  m.def(
      "set_log_level", [](const std::string& name) { set_log_level(value_or_raise(parse_log_level(name))); }, "level"_a,
      "kvtier's own level (debug, info, warning, error, off): lines below it are never formatted or queued. "
      "Python's logger levels filter further.");
  m.def("log_level", [] { return std::string(log_level_name(log_level())); });
  m.def(
      "_log",
      [](const std::string& level, const std::string& component, const std::string& message) {
        LogLevel l = value_or_raise(parse_log_level(level));
        GilReleased release;
        log(l, component, message);
      },
      "Logs a line through kvtier's sink (tests).");
}

}  // namespace kvtier::python
