// kvtier error model: Status and Result<T>.
//
// Contract: every fallible library function returns a [[nodiscard]] Status or
// Result<T>. No exception crosses the public API; the library never aborts.
// Codes say what the caller should do next (see retry_advice()); messages name
// the offending value ("block id 17 >= num_blocks 16 in dst list at index 3").
//
// Thread-safety: Status and Result are values; copying them is safe.
//
// Checked mode (debug): built with KVTIER_STATUS_CHECKED=1 (CMake option KVTIER_STATUS_CHECKED; on in
// the debug preset), an error Status or Result destroyed without anyone having looked at
// it aborts the process with a message naming it. (A success nobody looked at is let go: objects
// keep outcomes for callers who may never ask, and most of those outcomes are successes.) Looking
// at it: ok(), code(), message(),
// retry_advice(), to_string(), with_context(), ==, ignore_error(); for a Result also operator bool,
// status(), value(), *, -> and value_or(). Copying or moving hands the duty on: the copy (or the
// moved-to object) must be looked at, the source no longer. Assigning over a Status is not checked:
// a variable that keeps the latest failure of a retry loop is the common, intended case; the value
// it ends with must be looked at. A record that keeps an outcome for callers who may never ask holds it as a
// KeptStatus (below), which is let go unread. This is the one deliberate abort of the library, and only in that
// debug mode; built without it (the default) Status and Result carry no flag and the checks compile
// to nothing.
#pragma once

#include <cstdint>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace kvtier {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,     // caller bug: fix the input, do not retry
  kOutOfRange,          // an index/id outside its valid range: do not retry
  kFailedPrecondition,  // system state must be fixed first (e.g. not registered)
  kNotFound,            // lookup miss (key, tensor name)
  kAlreadyExists,       // duplicate registration / key
  kResourceExhausted,   // out of memory / pool empty / queue full: back off, retry
  kUnavailable,         // transient (server down, busy): retry the call
  kAborted,             // retry at a higher level (the whole step / request)
  kCancelled,           // the caller (or shutdown) cancelled it
  kTimedOut,            // deadline passed; state unknown until the work completes
  kDataLoss,            // bytes corrupted or lost: treat as a miss, recompute
  kNotSupported,        // this backend/strategy cannot do it
  kDeviceLost,          // sticky device error: the device context is unusable
  kInternal,            // kvtier bug: invariant broken
};

// What a caller should do with a failed status.
enum class RetryAdvice : std::uint8_t {
  kNone,          // success
  kDoNotRetry,    // fix the input or the configuration
  kRetry,         // retry the same call
  kBackoffRetry,  // retry after freeing resources / waiting
  kRecompute,     // the data is gone: recompute it (KV cache miss)
  kFatal,         // the device or library instance is unusable
};

std::string_view status_code_name(StatusCode code) noexcept;

#ifndef KVTIER_STATUS_CHECKED
#define KVTIER_STATUS_CHECKED 0
#endif

class Status;
namespace detail {
// Checked mode only: prints "kvtier: unchecked <what> <event>: <status>" and a stack trace, then aborts.
void status_unchecked(const Status& status, const char* what, const char* event) noexcept;
}  // namespace detail

class [[nodiscard]] Status {
 public:
  Status() noexcept = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() noexcept { return Status(); }

  bool ok() const noexcept {
    mark_checked();
    return code_ == StatusCode::kOk;
  }
  StatusCode code() const noexcept {
    mark_checked();
    return code_;
  }
  const std::string& message() const noexcept {
    mark_checked();
    return message_;
  }
  RetryAdvice retry_advice() const noexcept;
  // "InvalidArgument: block id 17 >= 16"; "OK" for success.
  std::string to_string() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status with_context(std::string_view context) const;

  // Explicitly discards a status (greppable). Say why at the call site.
  void ignore_error() const noexcept { mark_checked(); }

  friend bool operator==(const Status& a, const Status& b) noexcept {
    a.mark_checked();
    b.mark_checked();
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

#if KVTIER_STATUS_CHECKED
  Status(const Status& other) : code_(other.code_), message_(other.message_) { other.mark_checked(); }
  Status(Status&& other) noexcept : code_(other.code_), message_(std::move(other.message_)) { other.mark_checked(); }
  Status& operator=(const Status& other) {
    if (this != &other) {
      code_ = other.code_;
      message_ = other.message_;
      checked_ = false;
      other.mark_checked();
    }
    return *this;
  }
  Status& operator=(Status&& other) noexcept {
    if (this != &other) {
      code_ = other.code_;
      message_ = std::move(other.message_);
      checked_ = false;
      other.mark_checked();
    }
    return *this;
  }
  ~Status() {
    if (!checked_ && code_ != StatusCode::kOk) detail::status_unchecked(*this, "Status", "destroyed");
  }
#endif

 private:
  template <typename T>
  friend class Result;

  void mark_checked() const noexcept {
#if KVTIER_STATUS_CHECKED
    checked_ = true;
#endif
  }
#if KVTIER_STATUS_CHECKED
  bool checked() const noexcept { return checked_; }
#endif

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
#if KVTIER_STATUS_CHECKED
  mutable bool checked_ = false;
#endif
};

// A Status a record keeps for callers who may or may not ask for it: a batch item's outcome, a transfer's first
// failure. Holding an error there is the record's job, so in checked mode a KeptStatus destroyed unread does not
// abort; what is read or copied out of it is an ordinary Status again, with the duty to look at it.
class [[nodiscard]] KeptStatus : public Status {
 public:
  KeptStatus() noexcept = default;
  KeptStatus(Status status) : Status(std::move(status)) {}  // NOLINT: records are assigned from results
  KeptStatus(const KeptStatus&) = default;
  KeptStatus(KeptStatus&&) noexcept = default;
  KeptStatus& operator=(const KeptStatus&) = default;
  KeptStatus& operator=(KeptStatus&&) noexcept = default;
  KeptStatus& operator=(Status status) {
    Status::operator=(std::move(status));
    return *this;
  }
  ~KeptStatus() { ignore_error(); }
};

Status InvalidArgument(std::string message);
Status OutOfRange(std::string message);
Status FailedPrecondition(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status ResourceExhausted(std::string message);
Status Unavailable(std::string message);
Status Aborted(std::string message);
Status Cancelled(std::string message);
Status TimedOut(std::string message);
Status DataLoss(std::string message);
Status NotSupported(std::string message);
Status DeviceLost(std::string message);
Status Internal(std::string message);

// A value from outside (a key, a name) as an error message shows it: printable ASCII as is, any other byte as \xNN,
// cut after `max_bytes` bytes with "...", so a message never carries control characters or megabytes (give the size
// beside it where it matters).
std::string shown_value(std::string_view value, std::size_t max_bytes = 64);

// Result<T>: a T or a non-OK Status. Modelled on std::expected.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "Result<Status> is meaningless");
  static_assert(!std::is_reference_v<T>, "Result<T&> is not supported");

 public:
  Result(const T& value) : has_value_(true) { new (&value_) T(value); }        // NOLINT
  Result(T&& value) : has_value_(true) { new (&value_) T(std::move(value)); }  // NOLINT
  template <typename U, typename = std::enable_if_t<
                            std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
                            !std::is_same_v<std::decay_t<U>, Status> && !std::is_same_v<std::decay_t<U>, Result<T>>>>
  Result(U&& value) : has_value_(true) {  // NOLINT
    new (&value_) T(std::forward<U>(value));
  }
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.code_ == StatusCode::kOk) {
      status_.mark_checked();
      status_ = Status(StatusCode::kInternal, "Result constructed from OK status without a value");
    }
  }

  Result(const Result& other) : status_(other.status_), has_value_(other.has_value_) {
    if (has_value_) new (&value_) T(other.value_);
  }
  Result(Result&& other) noexcept(std::is_nothrow_move_constructible_v<T>)
      : status_(std::move(other.status_)), has_value_(other.has_value_) {
    if (has_value_) new (&value_) T(std::move(other.value_));
  }
  Result& operator=(const Result& other) {
    if (this != &other) {
      status_.mark_checked();  // assigning over it is not checked (see the file comment)
      reset();
      status_ = other.status_;
      // has_value_ only once T exists: a constructor that throws leaves no value for ~Result to destroy.
      if (other.has_value_) {
        new (&value_) T(other.value_);
        has_value_ = true;
      }
    }
    return *this;
  }
  Result& operator=(Result&& other) noexcept(std::is_nothrow_move_constructible_v<T>) {
    if (this != &other) {
      status_.mark_checked();  // assigning over it is not checked (see the file comment)
      reset();
      status_ = std::move(other.status_);
      // has_value_ only once T exists: a constructor that throws leaves no value for ~Result to destroy.
      if (other.has_value_) {
        new (&value_) T(std::move(other.value_));
        has_value_ = true;
      }
    }
    return *this;
  }
  ~Result() {
#if KVTIER_STATUS_CHECKED
    if (!status_.checked() && !has_value_) detail::status_unchecked(status_, "Result", "destroyed");
    status_.mark_checked();  // reported above, as the Result
#endif
    reset();
  }

  bool ok() const noexcept {
    status_.mark_checked();
    return has_value_;
  }
  explicit operator bool() const noexcept { return ok(); }
  // OK when a value is held. A temporary Result hands its Status out by value, so that
  // `KVTIER_RETURN_IF_ERROR(f().status())` does not bind a reference into a destroyed Result.
  const Status& status() const& noexcept {
    status_.mark_checked();
    return status_;
  }
  Status status() && noexcept { return std::move(status_); }

  // Precondition: ok(). Calling these on an error is a caller bug.
  T& value() & noexcept {
    status_.mark_checked();
    return value_;
  }
  const T& value() const& noexcept {
    status_.mark_checked();
    return value_;
  }
  T&& value() && noexcept {
    status_.mark_checked();
    return std::move(value_);
  }
  T& operator*() & noexcept { return value(); }
  const T& operator*() const& noexcept { return value(); }
  T&& operator*() && noexcept { return std::move(*this).value(); }
  T* operator->() noexcept { return &value(); }
  const T* operator->() const noexcept { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    status_.mark_checked();
    return has_value_ ? value_ : static_cast<T>(std::forward<U>(fallback));
  }

  // Explicitly discards the outcome (greppable). Say why at the call site.
  void ignore_error() const noexcept { status_.mark_checked(); }

 private:
  void reset() noexcept {
    if (has_value_) {
      value_.~T();
      has_value_ = false;
    }
  }

  Status status_;
  bool has_value_ = false;
  union {
    T value_;
  };
};

namespace detail {
inline const Status& status_of(const Status& s) noexcept { return s; }
template <typename T>
const Status& status_of(const Result<T>& r) noexcept {
  return r.status();
}
}  // namespace detail

}  // namespace kvtier

#define KVTIER_CONCAT_INNER_(a, b) a##b
#define KVTIER_CONCAT_(a, b) KVTIER_CONCAT_INNER_(a, b)

// Returns the status of `expr` (a Status or Result) from the enclosing function if not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                                 \
  do {                                                               \
    auto&& kvtier_status_or_result_ = (expr);                        \
    if (!::kvtier::detail::status_of(kvtier_status_or_result_).ok()) \
      return ::kvtier::detail::status_of(kvtier_status_or_result_);  \
  } while (0)

// `lhs = value of expr` or returns its status. lhs may be a declaration: `auto x`, so it cannot be
// parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr) \
  KVTIER_ASSIGN_OR_RETURN_IMPL_(KVTIER_CONCAT_(kvtier_result_, __LINE__), lhs, expr)
#define KVTIER_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)
