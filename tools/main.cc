// kvtier CLI: `kvtier info`, `kvtier bench copy`, ... (see --help).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <vector>

#include "kvtier/cache/config_knobs.h"
#include "kvtier/core/config.h"
#include "kvtier/core/log.h"
#include "tools/cli.h"

extern char** environ;

namespace kvtier::cli {
Action register_info(CLI::App& app);
Action register_replay(CLI::App& app);
Action register_bench(CLI::App& app);
}  // namespace kvtier::cli

// A report that did not reach stdout (a full disk, a closed pipe, /dev/full) is a failure, not a success.
int report_written() {
  std::cout.flush();
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout) && std::cout.good()) return 0;
  std::fprintf(stderr, "kvtier: writing the report to stdout failed: %s\n",
               errno != 0 ? std::strerror(errno) : "stream error");
  return 1;
}

int main(int argc, char** argv) {
  CLI::App app{"kvtier: move paged LLM KV-cache blocks between GPU, pinned host, disk and remote tiers"};
  app.require_subcommand(1);
  std::vector<kvtier::cli::Action> actions;
  actions.push_back(kvtier::cli::register_info(app));
  actions.push_back(kvtier::cli::register_replay(app));
  actions.push_back(kvtier::cli::register_bench(app));
  kvtier::cli::require_decimal_integers(app);
  app.footer(
      "Exit status: 0 done; 1 the run failed (an error while running, a report that could not be written); 2 usage "
      "(a bad flag, value, setting or KVTIER_* variable).");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version print and end with 0; every other parse error is a usage error, 2 (CLI11's own codes,
    // 105-114, said nothing a caller could rely on).
    return app.exit(e) == 0 ? 0 : 2;
  }
  {
    // Every subcommand logs at KVTIER_LOG_LEVEL (log.level); a bad value is a usage error here, where the
    // library alone would only warn and keep the default.
    kvtier::LogLevel level = kvtier::LogLevel::kInfo;
    kvtier::ConfigTable table;
    kvtier::bind_log_config(table, level);
    if (kvtier::Status s = table.apply_env(environ); !s.ok()) {
      std::fprintf(stderr, "kvtier: %s\n", s.to_string().c_str());
      return 2;
    }
    kvtier::set_log_level(level);
  }
  // A misspelt KVTIER_* setting would otherwise change nothing, silently.
  for (const std::string& message : kvtier::cache::unrecognized_env_vars(environ))
    kvtier::log(kvtier::LogLevel::kWarning, "config", message);
  // The library reports through Status; what can still throw here is the standard library running out of memory
  // for sizes the flags allowed (a clear error and status 1, not std::terminate's abort).
  try {
    for (auto& action : actions)
      if (action) {
        // Each registrar returns an action that checks whether its own subcommand was selected.
        int rc = action();
        if (rc >= 0) return rc == 0 ? report_written() : rc;
      }
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvtier: out of memory (smaller sizes or counts in the flags)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier: internal error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "kvtier: no subcommand ran\n");
  return 2;
}
