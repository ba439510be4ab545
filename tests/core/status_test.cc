#include "kvtier/core/status.h"

#include <gtest/gtest.h>

#include <memory>
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

}  // namespace
}  // namespace kvtier
