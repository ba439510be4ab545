#include "kvtier/core/deadline.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>

namespace kvtier {
namespace {

using std::chrono::steady_clock;

// A timeout of milliseconds::max() (or seconds::max()) is "forever" in a coarser unit. It used to be converted to
// nanoseconds implicitly at the call, which overflows: the deadline landed in the past and waits timed out at once.
TEST(Deadline, ForeverInAnyUnitIsFarAhead) {
  const auto now = steady_clock::now();
  const auto far = now + std::chrono::hours(24 * 365 * 50);
  EXPECT_GT(deadline_after(std::chrono::nanoseconds::max(), now), far);
  EXPECT_GT(deadline_after(std::chrono::milliseconds::max(), now), far);
  EXPECT_GT(deadline_after(std::chrono::seconds::max(), now), far);
  EXPECT_GT(deadline_after(std::chrono::duration<double>(1e300), now), far);
  EXPECT_GT(deadline_after(std::chrono::duration<double>(std::numeric_limits<double>::infinity()), now), far);
  EXPECT_EQ(clamp_timeout(std::chrono::milliseconds::max()), kMaxTimeout);
}

TEST(Deadline, NegativeZeroAndNaNTimeoutsMeanNow) {
  const auto now = steady_clock::now();
  EXPECT_EQ(deadline_after(std::chrono::milliseconds(-5), now), now);
  EXPECT_EQ(deadline_after(std::chrono::nanoseconds::min(), now), now);
  EXPECT_EQ(deadline_after(std::chrono::milliseconds::min(), now), now);
  EXPECT_EQ(deadline_after(std::chrono::seconds(0), now), now);
  EXPECT_EQ(deadline_after(std::chrono::duration<double>(std::numeric_limits<double>::quiet_NaN()), now), now);
}

TEST(Deadline, OrdinaryTimeoutsKeepTheirValue) {
  const auto now = steady_clock::now();
  EXPECT_EQ(deadline_after(std::chrono::milliseconds(1500), now), now + std::chrono::milliseconds(1500));
  EXPECT_EQ(deadline_after(std::chrono::hours(3), now), now + std::chrono::hours(3));
  EXPECT_EQ(clamp_timeout(std::chrono::microseconds(7)), std::chrono::nanoseconds(7000));
}

}  // namespace
}  // namespace kvtier
