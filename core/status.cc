#include "kvtier/core/status.h"

#include <fmt/format.h>

#include "kvtier/core/enum_names.h"
#if KVTIER_STATUS_CHECKED
#include <execinfo.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

// Defined by the sanitizer runtimes; null in a build without one.
extern "C" void __sanitizer_print_stack_trace() __attribute__((weak));
#endif

namespace kvtier {

constexpr EnumName<StatusCode> kStatusCodeEntries[] = {
    {StatusCode::kOk, "OK"},
    {StatusCode::kInvalidArgument, "InvalidArgument"},
    {StatusCode::kOutOfRange, "OutOfRange"},
    {StatusCode::kFailedPrecondition, "FailedPrecondition"},
    {StatusCode::kNotFound, "NotFound"},
    {StatusCode::kAlreadyExists, "AlreadyExists"},
    {StatusCode::kResourceExhausted, "ResourceExhausted"},
    {StatusCode::kUnavailable, "Unavailable"},
    {StatusCode::kAborted, "Aborted"},
    {StatusCode::kCancelled, "Cancelled"},
    {StatusCode::kTimedOut, "TimedOut"},
    {StatusCode::kDataLoss, "DataLoss"},
    {StatusCode::kNotSupported, "NotSupported"},
    {StatusCode::kDeviceLost, "DeviceLost"},
    {StatusCode::kInternal, "Internal"},
};
constexpr auto kStatusCodeNames = enum_table("status code", kStatusCodeEntries, "Unknown");
std::string_view status_code_name(StatusCode code) noexcept { return kStatusCodeNames.name(code); }

RetryAdvice Status::retry_advice() const noexcept {
  mark_checked();
  switch (code_) {
    case StatusCode::kOk: return RetryAdvice::kNone;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kNotSupported:
    case StatusCode::kInternal: return RetryAdvice::kDoNotRetry;
    case StatusCode::kUnavailable:
    case StatusCode::kTimedOut: return RetryAdvice::kRetry;
    case StatusCode::kResourceExhausted: return RetryAdvice::kBackoffRetry;
    case StatusCode::kAborted:
    case StatusCode::kCancelled:
    case StatusCode::kDataLoss: return RetryAdvice::kRecompute;
    case StatusCode::kDeviceLost: return RetryAdvice::kFatal;
  }
  return RetryAdvice::kDoNotRetry;
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string out(status_code_name(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  return Status(code_, std::move(msg));
}

#define KVTIER_DEFINE_STATUS_FACTORY(Name) \
  Status Name(std::string message) { return Status(StatusCode::k##Name, std::move(message)); }
KVTIER_DEFINE_STATUS_FACTORY(InvalidArgument)
KVTIER_DEFINE_STATUS_FACTORY(OutOfRange)
KVTIER_DEFINE_STATUS_FACTORY(FailedPrecondition)
KVTIER_DEFINE_STATUS_FACTORY(NotFound)
KVTIER_DEFINE_STATUS_FACTORY(AlreadyExists)
KVTIER_DEFINE_STATUS_FACTORY(ResourceExhausted)
KVTIER_DEFINE_STATUS_FACTORY(Unavailable)
KVTIER_DEFINE_STATUS_FACTORY(Aborted)
KVTIER_DEFINE_STATUS_FACTORY(Cancelled)
KVTIER_DEFINE_STATUS_FACTORY(TimedOut)
KVTIER_DEFINE_STATUS_FACTORY(DataLoss)
KVTIER_DEFINE_STATUS_FACTORY(NotSupported)
KVTIER_DEFINE_STATUS_FACTORY(DeviceLost)
KVTIER_DEFINE_STATUS_FACTORY(Internal)
#undef KVTIER_DEFINE_STATUS_FACTORY

std::string shown_value(std::string_view value, std::size_t max_bytes) {
  std::string shown;
  for (const char c : value.substr(0, max_bytes))
    shown += c >= 0x20 && c <= 0x7e ? std::string(1, c) : fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
  if (value.size() > max_bytes) shown += "...";
  return shown;
}

}  // namespace kvtier

#if KVTIER_STATUS_CHECKED
namespace kvtier::detail {
void status_unchecked(const Status& status, const char* what, const char* event) noexcept {
  std::fprintf(stderr,
               "kvtier: unchecked %s %s: %s\n"
               "kvtier: KVTIER_STATUS_CHECKED build: look at every Status and Result (ok(), code(), ...), "
               "propagate it, or call ignore_error() with a comment saying why\n",
               what, event, status.to_string().c_str());
  if (__sanitizer_print_stack_trace != nullptr) {
    __sanitizer_print_stack_trace();
  } else {
    void* frames[64];
    int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
  }
  std::fflush(stderr);
  std::abort();
}
}  // namespace kvtier::detail
#endif
