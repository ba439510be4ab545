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

// `timeout`, in any unit, as nanoseconds clamped to [0, kMaxTimeout]. The unit is a template parameter because
// the implicit conversion to nanoseconds overflows for coarse timeouts such as milliseconds::max() (the same
// "forever" in another unit).
template <typename Rep, typename Period>
constexpr std::chrono::nanoseconds clamp_timeout(std::chrono::duration<Rep, Period> timeout) noexcept {
  using Timeout = std::chrono::duration<Rep, Period>;
  if (!(timeout > Timeout::zero())) return std::chrono::nanoseconds::zero();  // also NaN for floating units
  if (timeout >= std::chrono::duration_cast<Timeout>(kMaxTimeout)) return kMaxTimeout;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
}

// now + timeout, saturated (see above).
template <typename Rep, typename Period>
std::chrono::steady_clock::time_point deadline_after(
    std::chrono::duration<Rep, Period> timeout,
    std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
  return now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(clamp_timeout(timeout));
}

// True when `timeout` means "no deadline" for practical purposes.
constexpr bool is_unbounded(std::chrono::nanoseconds timeout) noexcept { return timeout >= kMaxTimeout; }

}  // namespace kvtier
