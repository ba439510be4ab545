// kvtier's log: one process-wide level and one process-wide sink that every
// kvtier subsystem writes its log lines to (storage backends today: a
// quarantined object, a refused O_DIRECT, a Redis slot map that no node
// answers). The library never writes to stderr by any other path.
//
// Sink: `set_log_sink(fn)` routes every line to `fn(level, component,
// message)`; `set_log_sink(nullptr)` restores the default sink, which writes
// "kvtier[<component>] <level>: <message>\n" to stderr in one write(2) call, so
// lines from different threads do not interleave. `component` names the
// subsystem ("storage/redis", "storage/disk", "core/log"); `message` is one
// line without a trailing newline. Both views are valid only during the call.
//
// Level: lines below log_level() are dropped before the sink is called (and
// before anything is formatted by log() itself; callers that build the message
// with fmt::format can test log_enabled() first). The level defaults to kInfo.
// At the first call of log(), log_enabled(), log_level() or set_log_level(),
// the environment variable KVTIER_LOG_LEVEL (the `log.level` knob,
// bind_log_config) is read once; a bad value keeps kInfo and is reported as one
// kWarning line through the sink installed at that moment. set_log_level()
// overrides the environment from then on. kOff drops every line; a line logged
// at kOff is never emitted.
//
// Thread-safety: every function here may be called from any thread at any
// time. The level is an atomic. set_log_sink() swaps the sink under a short
// lock (never held while a sink runs), so new lines go to the new sink at
// once, then waits for the calls still running in the previous sink: once it
// has returned, the previous sink is never called again and has been destroyed
// (on the calling thread), so a sink may capture references to state that its
// installer destroys after replacing it. Calls into one sink may run
// concurrently on several threads; a sink that is not reentrant must serialise
// itself.
//
// What a sink must not do: call back into kvtier (log(), set_log_sink() or any
// other kvtier function: set_log_sink() from inside a sink deadlocks, and kvtier
// may call the sink while it holds internal locks of the subsystem that logs),
// or block for long (the caller may be an I/O completion thread or hold a
// backend's lock; a slow sink stalls that subsystem). A sink may be called from
// any kvtier thread: worker, completion and progress threads, not only the
// threads that call kvtier. An exception thrown by a sink is caught and dropped
// (the line is lost); log() never throws and never fails.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kvtier/core/config.h"
#include "kvtier/core/status.h"

namespace kvtier {

enum class LogLevel : std::uint8_t { kDebug, kInfo, kWarning, kError, kOff };

// "debug", "info", "warning", "error", "off".
std::string_view log_level_name(LogLevel level) noexcept;
// The inverse of log_level_name. InvalidArgument names the value and the valid names.
Result<LogLevel> parse_log_level(std::string_view name);

using LogSink = std::function<void(LogLevel level, std::string_view component, std::string_view message)>;

// Installs `sink` for every later line; nullptr (or an empty function) restores
// the default stderr sink. Returns after calls into the previous sink have
// finished. Out of memory: the previous sink stays.
void set_log_sink(LogSink sink) noexcept;

void set_log_level(LogLevel level) noexcept;
LogLevel log_level() noexcept;
// True when a line at `level` would reach the sink (false for kOff).
bool log_enabled(LogLevel level) noexcept;

// Sends one line to the sink when log_enabled(level).
void log(LogLevel level, std::string_view component, std::string_view message) noexcept;

// Binds the log level to `table` as the knob "<prefix>.level" (env var
// KVTIER_<PREFIX>_LEVEL; with the default prefix "log": KVTIER_LOG_LEVEL). The
// table only fills `level`; apply it with set_log_level(level) afterwards.
void bind_log_config(ConfigTable& table, LogLevel& level, const std::string& prefix = "log");

}  // namespace kvtier
