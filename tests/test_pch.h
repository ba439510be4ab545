// Precompiled once and reused by every test binary (tests/CMakeLists.txt,
// option KVTIER_PRECOMPILED_HEADERS): GoogleTest, fmt and the standard headers
// most tests include, about 4 s of parsing per test file. Third-party and
// standard headers only, so that editing a kvtier header does not rebuild it,
// and nothing that depends on a macro set by the including file (xxhash.h is
// included with XXH_INLINE_ALL by one test).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
