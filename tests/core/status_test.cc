#include "kvtier/core/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <new>
#include <string>

namespace kvtier {
namespace {

Result<int> parse_positive(int v) {
  if (v <= 0) return InvalidArgument("value " + std::to_string(v) + " must be > 0");
  return v;
}

Status use_assign(int v, int* out) {
  KVTIER_ASSIGN_OR_RETURN(int x, parse_positive(v));
  *out = x * 2;
  return Status::Ok();
}

Status use_return(int v) {
  KVTIER_RETURN_IF_ERROR(parse_positive(v));
  KVTIER_RETURN_IF_ERROR(Status::Ok());
  return Status::Ok();
}

TEST(Status, OkAndErrors) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.to_string(), "OK");
  EXPECT_EQ(ok.retry_advice(), RetryAdvice::kNone);
  Status bad = OutOfRange("block id 17 >= 16");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(bad.to_string(), "OutOfRange: block id 17 >= 16");
  EXPECT_EQ(bad.with_context("evict").message(), "evict: block id 17 >= 16");
}

TEST(Status, RetryAdviceByCode) {
  EXPECT_EQ(Unavailable("x").retry_advice(), RetryAdvice::kRetry);
  EXPECT_EQ(ResourceExhausted("x").retry_advice(), RetryAdvice::kBackoffRetry);
  EXPECT_EQ(DataLoss("x").retry_advice(), RetryAdvice::kRecompute);
  EXPECT_EQ(DeviceLost("x").retry_advice(), RetryAdvice::kFatal);
  EXPECT_EQ(InvalidArgument("x").retry_advice(), RetryAdvice::kDoNotRetry);
}

TEST(Result, ValueAndErrorPropagation) {
  int out = 0;
  EXPECT_TRUE(use_assign(21, &out).ok());
  EXPECT_EQ(out, 42);
  Status s = use_assign(-3, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("-3"), std::string::npos);
  EXPECT_TRUE(use_return(1).ok());
  EXPECT_FALSE(use_return(0).ok());
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
  Result<std::unique_ptr<int>> e = NotFound("nothing");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
  Result<std::string> copy_src = std::string("abc");
  Result<std::string> copy = copy_src;
  EXPECT_EQ(*copy, "abc");
}

// Assigning a Result whose value's copy throws (std::bad_alloc in a copied vector, say): the target marked itself as
// holding a value before constructing it, so its destructor destroyed an object that was never made.
struct ThrowingCopy {
  static inline int live = 0;
  bool throw_on_copy = false;
  ThrowingCopy() { ++live; }
  ThrowingCopy(const ThrowingCopy& o) : throw_on_copy(o.throw_on_copy) {
    if (throw_on_copy) throw std::bad_alloc();
    ++live;
  }
  ThrowingCopy& operator=(const ThrowingCopy&) = default;
  ~ThrowingCopy() { --live; }
};

TEST(Result, AssignmentWhoseCopyThrowsLeavesNoValueBehind) {
  {
    Result<ThrowingCopy> src(ThrowingCopy{});
    ASSERT_TRUE(src.ok());
    src.value().throw_on_copy = true;
    Result<ThrowingCopy> dst(ThrowingCopy{});
    EXPECT_EQ(ThrowingCopy::live, 2);
    EXPECT_THROW(dst = src, std::bad_alloc);
    EXPECT_FALSE(dst.ok());
    EXPECT_EQ(ThrowingCopy::live, 1);  // src's; dst's old value destroyed, none made
  }
  EXPECT_EQ(ThrowingCopy::live, 0);  // was -1: ~Result destroyed dst's value that was never constructed
}

TEST(Result, OkStatusWithoutValueIsInternalError) {
  Result<int> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

// The status of a temporary Result, returned through KVTIER_RETURN_IF_ERROR: the macro binds what it is given
// to a reference, so status() of an rvalue Result must not hand out a reference into the temporary (under
// AddressSanitizer that was a stack-use-after-scope read of the destroyed Result's message).
Result<std::string> failing_lookup(int key) {
  return NotFound("key " + std::to_string(key) +
                  " is not in the table of this very long message, long enough to live on the heap");
}
Status forward_status_of_temporary(int key) {
  KVTIER_RETURN_IF_ERROR(failing_lookup(key).status());
  return Status::Ok();
}

TEST(Result, StatusOfATemporaryOutlivesIt) {
  Status s = forward_status_of_temporary(7);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("key 7 is not in the table"), std::string::npos) << s.to_string();
}

// KVTIER_STATUS_CHECKED (the asan preset): an error Status or Result nobody looked at aborts, naming it; one that was
// looked at, propagated, moved from or explicitly ignored does not. Assigning over one is not checked (a retry
// loop's latest failure), but the value it ends with is.
#if KVTIER_STATUS_CHECKED
TEST(StatusCheckedDeathTest, UncheckedErrorAbortsWhenDestroyed) {
  EXPECT_DEATH({ Status s = DataLoss("object 42 corrupt"); },
               "unchecked Status destroyed: DataLoss: object 42 corrupt");
}

TEST(StatusCheckedDeathTest, UncheckedResultAbortsWhenDestroyed) {
  EXPECT_DEATH({ Result<int> r = parse_positive(-3); }, "unchecked Result destroyed: InvalidArgument: value -3");
}

TEST(StatusCheckedDeathTest, TheValueAVariableEndsWithIsChecked) {
  EXPECT_DEATH(
      {
        Status latest = Unavailable("attempt 1");
        latest.ignore_error();
        latest = Unavailable("attempt 2");
      },
      "unchecked Status destroyed: Unavailable: attempt 2");
}

TEST(StatusCheckedDeathTest, CopyHandsTheDutyOn) {
  EXPECT_DEATH(
      {
        Status a = Aborted("step 3");
        Status b = a;  // a is handed on; b is not looked at
        a.ignore_error();
      },
      "unchecked Status destroyed: Aborted: step 3");
}

TEST(StatusChecked, LookedAtPropagatedMovedOrIgnoredDoesNotAbort) {
  { EXPECT_FALSE(DataLoss("x").ok()); }
  { EXPECT_EQ(NotFound("x").code(), StatusCode::kNotFound); }
  { NotFound("ignored on purpose in this test").ignore_error(); }
  {
    Status a = Internal("moved");
    Status b = std::move(a);  // a is moved from: only b carries the outcome
    EXPECT_EQ(b.code(), StatusCode::kInternal);
  }
  {
    Status latest = Unavailable("attempt 1");
    latest = Unavailable("attempt 2");  // the retry loop's latest failure replaces the earlier one
    EXPECT_EQ(latest.message(), "attempt 2");
  }
  {
    Result<int> r = parse_positive(-1);
    r = parse_positive(5);
    EXPECT_EQ(*r, 5);
  }
  { EXPECT_EQ(use_return(-1).code(), StatusCode::kInvalidArgument); }
  {
    int out = 0;
    EXPECT_TRUE(use_assign(4, &out).ok());
  }
  { EXPECT_EQ(parse_positive(2).value(), 2); }
  { EXPECT_EQ(parse_positive(-2).value_or(7), 7); }
  {
    Result<int> r = parse_positive(-2);
    if (r) ADD_FAILURE() << "expected an error";
  }
  { parse_positive(-2).ignore_error(); }
  {
    // A success nobody looked at is let go (objects keep outcomes for callers who may never ask).
    Status unlooked = Status::Ok();
    Result<int> unlooked_value = parse_positive(3);
  }
}
#else
TEST(StatusChecked, OffByDefaultAddsNothing) {
  // Built without KVTIER_STATUS_CHECKED, Status is its code and message, nothing more.
  struct Plain {
    StatusCode code;
    std::string message;
  };
  static_assert(sizeof(Status) == sizeof(Plain));
  Status s = DataLoss("unchecked is allowed in this build");
}
#endif

}  // namespace
}  // namespace kvtier
