// Deadlines from timeouts, without overflow.
//
// `steady_clock::now() + timeout` is signed arithmetic: with a timeout of
// nanoseconds::max() ("wait forever") it overflows (undefined behaviour, in
// practice a deadline in the past, so the wait times out at once). Every wait
// in kvtier computes its deadline here: negative timeouts mean "do not wait",
// timeouts beyond kMaxTimeout are capped there (about 100 years: forever for
// any caller, and far from the clock's range).
#pragma once

#include <algorithm>
#include <chrono>

namespace kvtier {

inline constexpr std::chrono::nanoseconds kMaxTimeout = std::chrono::hours(24 * 365 * 100);

// `timeout` clamped to [0, kMaxTimeout].
constexpr std::chrono::nanoseconds clamp_timeout(std::chrono::nanoseconds timeout) noexcept {
  return std::clamp(timeout, std::chrono::nanoseconds::zero(), kMaxTimeout);
}

// now + timeout, saturated (see above).
inline std::chrono::steady_clock::time_point deadline_after(
    std::chrono::nanoseconds timeout, std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
  return now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(clamp_timeout(timeout));
}

// True when `timeout` means "no deadline" for practical purposes.
constexpr bool is_unbounded(std::chrono::nanoseconds timeout) noexcept { return timeout >= kMaxTimeout; }

}  // namespace kvtier
