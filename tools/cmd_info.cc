// `kvtier info`: build configuration, visible devices and (--config) every
// configuration knob with its env var, default and effective value.
#include <unistd.h>

#include <cstdio>

#include "kvtier/cache/config_knobs.h"
#include "kvtier/core/config.h"
#include "kvtier/core/log.h"
#include "kvtier/device/cuda_device.h"
#include "tools/cli.h"

extern char** environ;

namespace kvtier::cli {

Action register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print build configuration, visible devices and configuration knobs");
  auto show_config = std::make_shared<bool>(false);
  cmd->add_flag("--config", *show_config, "print every configuration knob (markdown), after KVTIER_* env vars");
  return [cmd, show_config]() -> int {
    if (!cmd->parsed()) return -1;
    std::printf("kvtier 0.1.0\n");
    std::printf("cuda compiled: %s\n", cuda_compiled() ? "yes" : "no");
    std::printf("cuda devices: %d\n", cuda_device_count());
    if (*show_config) {
      cache::ConfigKnobs knobs;
      ConfigTable& table = knobs.table;
      if (Status s = table.apply_env(environ); !s.ok()) {
        std::fprintf(stderr, "kvtier info: %s\n", s.to_string().c_str());
        return 2;
      }
      set_log_level(knobs.log_level);
      std::printf("\n%s", table.markdown().c_str());
    }
    return 0;
  };
}

}  // namespace kvtier::cli
