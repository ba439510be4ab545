// Precompiled for the kvtier CLI (tools/CMakeLists.txt, option
// KVTIER_PRECOMPILED_HEADERS): CLI11 and nlohmann-json alone take ~7 s to
// parse in every subcommand's file. Third-party and standard headers only.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>
