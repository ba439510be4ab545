// `kvtier info`: build configuration and visible devices.
#include <cstdio>

#include "kvtier/device/cuda_device.h"
#include "tools/cli.h"

namespace kvtier::cli {

Action register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print build configuration and visible devices");
  return [cmd]() -> int {
    if (!cmd->parsed()) return -1;
    std::printf("kvtier 0.1.0\n");
    std::printf("cuda compiled: %s\n", cuda_compiled() ? "yes" : "no");
    std::printf("cuda devices: %d\n", cuda_device_count());
    return 0;
  };
}

}  // namespace kvtier::cli
