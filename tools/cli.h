// Subcommand registry for the kvtier CLI. Each tools/cmd_<name>.cc defines a
// registration function and adds it to the list in main.cc.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kvtier::cli {

// A subcommand registers its options on `app` and returns the action run when
// it was selected. The action returns the process exit code.
using Action = std::function<int()>;
using Registrar = Action (*)(CLI::App& app);

}  // namespace kvtier::cli
