// Status -> Python exception, and the helpers every binding shares.
//
// Errors cross into Python as instances of the classes of kvtier/errors.py
// (one per StatusCode, grouped under one base per retry advice), registered
// by kvtier/__init__.py at import through _register_errors(). Each carries
// the Status code name and the full message.
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/core/deadline.h"
#include "kvtier/core/status.h"

namespace kvtier::python {

// Raises the Python exception for `status` (must not be OK).
[[noreturn]] void raise_status(const Status& status);

// Integer and string arguments taken as Python objects and checked here: nanobind's own conversion refuses -1
// for an unsigned argument, or 2**31 for an int32, with a TypeError that names neither the argument nor the
// value. Each raises InvalidArgument (not an integer / not a string) or OutOfRange naming `what` and the value.
nanobind::object index_arg(nanobind::handle value, const char* what);
std::int64_t int_arg(nanobind::handle value, const char* what, std::int64_t low, std::int64_t high);
std::uint64_t u64_arg(nanobind::handle value, const char* what);
std::uint32_t u32_arg(nanobind::handle value, const char* what);
std::optional<std::uint32_t> opt_u32_arg(nanobind::handle value, const char* what);  // None, or as u32_arg
std::string str_arg(nanobind::handle value, const char* what);
// A sequence of strings (a list, a tuple): InvalidArgument naming `what` for anything else (None, a str, bytes) and
// `what`[i] for an element that is not a string.
std::vector<std::string> str_list(nanobind::handle value, const char* what);
// A config mapping (knob -> value) as text: None is empty; keys must be strings, values strings, ints, floats or
// bools (True / False as "true" / "false"); anything else is InvalidArgument naming the knob and the value.
std::map<std::string, std::string> config_arg(nanobind::handle value, const char* what);
// A sequence (list, tuple, numpy array) of integers in [0, high], each named `what[i]` when it is not.
std::vector<std::int64_t> int_list(nanobind::handle seq, const char* what, std::int64_t high);

// An integer parameter that nanobind hands over unconverted (its signature still reads `int`): the binding
// converts it with int_arg / u32_arg / u64_arg, so -1 for a count is an error that names the parameter and the
// value instead of nanobind's "incompatible function arguments".
struct IntArg {
  nanobind::handle value;
  std::int64_t in(const char* what, std::int64_t low, std::int64_t high) const {
    return int_arg(value, what, low, high);
  }
  std::uint32_t u32(const char* what) const { return u32_arg(value, what); }
  std::uint64_t u64(const char* what) const { return u64_arg(value, what); }
};

// A list-of-strings parameter handed over unconverted (its signature reads `list[str]`): str_list names a bad value
// (None, a str split per character, a non-string element) instead of nanobind's "incompatible function arguments".
struct StrListArg {
  nanobind::handle value;
  std::vector<std::string> get(const char* what) const { return str_list(value, what); }
};

inline void check(const Status& status) {
  if (!status.ok()) raise_status(status);
}

template <typename T>
T value_or_raise(Result<T>&& result) {
  if (!result.ok()) raise_status(result.status());
  return std::move(result).value();
}

// Objects made before fork(): their threads (streams' workers, progress threads, a transport's) exist only in
// the parent, and a mutex one of them held at the fork stays held in the child. In a child, such an object's
// calls raise FailedPrecondition, and its destructor leaves what it owns alone (leak_in_child) instead of joining
// threads that are not there (the child hung or crashed at exit).
class MadeInProcess {
 public:
  bool in_child() const noexcept { return ::getpid() != pid_; }
  void check(std::string_view what) const {
    if (in_child())
      raise_status(FailedPrecondition(fmt::format(
          "{} was made in process {} before fork(); its threads are not in this child process ({}): make a new one "
          "here",
          what, pid_, ::getpid())));
  }

 private:
  pid_t pid_ = ::getpid();
};
// Never destroyed: what an object made before fork() owns, left alone in the child.
template <typename T>
void leak_in_child(T& owned) {
  new T(std::move(owned));
}

// Whether the interpreter has begun to finalize (safe without the GIL: the runtime's flag is read atomically).
inline bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}
// The ident (PyThread_get_thread_ident) of the interpreter's main thread, set when the module is imported.
inline std::atomic<unsigned long> g_main_thread_ident{0};

// Where a thread other than the main one takes the GIL from C++ (a kvtier call returning, a callback on a kvtier
// thread). Once the interpreter finalizes, CPython ends such a thread inside the C++ frames it takes the GIL from
// (std::terminate: the process aborted at exit while a daemon thread was in kvtier). A check of "finalizing" before
// taking the GIL left a window: finalization could begin while the thread waited for the GIL. So the gate closes
// earlier, at exit (an atexit hook, close_for_exit(), before finalization), and waits, the GIL released, for the
// threads already on their way in; from then on a thread that would take the GIL stays out: a returning call waits
// without it for the process to end (Python code never runs on it again, as CPython would have ended it), and a
// callback is skipped. The main thread always goes through.
class GilGate {
 public:
  // False: closed for exit; the caller must not take the GIL. True: it may, and calls entered() once it has it.
  bool enter() {
    if (on_main_thread()) return true;
    std::lock_guard lock(mu_);
    if (exiting_) return false;
    ++entering_;
    return true;
  }
  void entered() {
    if (on_main_thread()) return;
    std::lock_guard lock(mu_);
    --entering_;
    cv_.notify_all();
  }
  // With the GIL held, at exit: closes the gate, then lets the threads already entering take the GIL (bounded).
  void close_for_exit(std::chrono::milliseconds limit) {
    {
      std::lock_guard lock(mu_);
      exiting_ = true;
    }
    PyThreadState* st = PyEval_SaveThread();
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, limit, [this] { return entering_ == 0; });
    }
    PyEval_RestoreThread(st);
  }
  static bool on_main_thread() { return PyThread_get_thread_ident() == g_main_thread_ident.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool exiting_ = false;
  int entering_ = 0;
};
inline GilGate& gil_gate() {
  static auto* g = new GilGate();  // never destroyed: threads may pass it during and after finalization
  return *g;
}
// A thread that may not take the GIL back: it waits, without it, for the process to end.
[[noreturn]] inline void park_until_exit() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// The GIL released for a C++ call, and taken back after it through the gate (above).
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    if (!gil_gate().enter()) park_until_exit();
    PyEval_RestoreThread(state_);
    gil_gate().entered();
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// The GIL taken on a kvtier thread (a callback), through the gate: held() false once the process is exiting, and
// the caller then does without Python (skips the callback, leaves the object it would have dropped).
class GilAcquired {
 public:
  GilAcquired() {
    if (!gil_gate().enter()) return;
    state_ = PyGILState_Ensure();
    held_ = true;
    gil_gate().entered();
  }
  ~GilAcquired() {
    if (held_) PyGILState_Release(state_);
  }
  bool held() const { return held_; }
  GilAcquired(const GilAcquired&) = delete;
  GilAcquired& operator=(const GilAcquired&) = delete;

 private:
  PyGILState_STATE state_{};
  bool held_ = false;
};

// Runs `f` with the GIL released. Its result is turned into a Python
// exception only after the GIL is back (raise_status needs it):
// check(released([&] { return ...; })).
template <typename F>
auto released(F&& f) {
  GilReleased release;
  return f();
}

inline const Status& status_of(const Status& s) { return s; }
template <typename T>
const Status& status_of(const Result<T>& r) {
  return r.status();
}

// A wait with the GIL released that Ctrl-C can end. A wait without a deadline (timeout None) runs in slices of
// kSignalCheckSlice: between two, the GIL is taken back and pending signals are handled, so KeyboardInterrupt (or a
// signal handler's exception) is raised within a slice instead of never. `wait(t)` waits up to t and returns
// kTimedOut when t ran out; a TimedOut that comes back before its slice has passed is the outcome of what was
// waited for (a task that itself ended TimedOut) and is returned. A bounded wait runs whole (its TimedOut message
// names the caller's timeout). Only for waits whose target is fixed when the call starts (one task, one layer):
// each slice looks again.
inline constexpr std::chrono::milliseconds kSignalCheckSlice{50};
// Python runs signal handlers on the main thread only: another thread's wait runs whole (each slice's return to
// the GIL gained it nothing, and taking the GIL back every slice raced with the interpreter's finalization).
template <typename F>
auto wait_interruptible(std::chrono::nanoseconds timeout, F&& wait) -> decltype(wait(timeout)) {
  if (!is_unbounded(timeout) || PyThread_get_thread_ident() != g_main_thread_ident.load())
    return released([&] { return wait(timeout); });
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    auto r = released([&] { return wait(std::chrono::nanoseconds(kSignalCheckSlice)); });
    if (status_of(r).code() != StatusCode::kTimedOut || std::chrono::steady_clock::now() - start < kSignalCheckSlice)
      return r;
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
  }
}

// A wrapper's mutex that knows which thread holds it. A call that holds it builds Python objects (its result, an
// exception); allocating them may run the garbage collector, and a finalizer it runs (an engine's __del__ that
// releases an admission, a weakref callback) may call the same wrapper on the same thread. With a plain mutex that
// call waited for itself forever; lock_gil_safe() raises instead.
class PyCallMutex {
 public:
  void lock() {
    mu_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    return true;
  }
  void unlock() {
    run_deferred();  // the interrupted call is over: what its finalizers left runs now (no Python in it)
    owner_.store(std::thread::id(), std::memory_order_relaxed);
    mu_.unlock();
  }
  // Only this thread writes its own id, so a relaxed load tells exactly whether it holds the mutex.
  bool held_by_this_thread() const { return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id(); }
  // Work that a call made while this thread holds the mutex leaves for when the interrupted call ends (unlock();
  // no Python in it, no GIL needed): release() from a finalizer the garbage collector ran inside another call.
  // Only the holder touches it. Each item runs on its own: one that throws does not drop the others.
  void defer(std::function<void()> work) { deferred_.push_back(std::move(work)); }
  void run_deferred() noexcept {
    std::vector<std::function<void()>> work;
    work.swap(deferred_);  // (the items run no Python, so none adds more)
    for (auto& w : work) {
      try {
        w();
      } catch (...) {  // (std::bad_alloc: this item is lost, the others run)
      }
    }
  }

 private:
  std::mutex mu_;
  std::atomic<std::thread::id> owner_{};
  std::vector<std::function<void()>> deferred_;
};

// Locks a wrapper's mutex from a call that holds the GIL, without waiting for it with the GIL held: the thread
// that holds the mutex may need the GIL to go on (it builds the result's Python objects or raises, and Python may
// hand the GIL to another thread meanwhile), so waiting with the GIL held could deadlock both. A call made while
// this thread already holds it (from a finalizer the garbage collector ran inside another call of the same object)
// raises FailedPreconditionError.
inline std::unique_lock<PyCallMutex> lock_gil_safe(PyCallMutex& mu) {
  std::unique_lock<PyCallMutex> lock(mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    if (mu.held_by_this_thread())
      raise_status(FailedPrecondition(
          "called again on the thread of a call of the same object that has not returned (from a __del__ or "
          "weakref callback that the garbage collector ran inside it?): call it from outside that call"));
    GilReleased release;
    lock.lock();
  }
  return lock;
}

// References that a thread without the GIL gives up (one that must not take it: a detached thread may still run
// while the interpreter exits): defer_release() takes one, thread-safe, and the next release_deferred() (with the
// GIL: a TransferManager's creation or shutdown calls it) drops them. What is left at exit is never dropped.
void defer_release(PyObject* owned);
void release_deferred();

// The exception object of `status` (not raised): None for OK, kvtier.errors' class otherwise.
nanobind::object exception_object(const Status& status);

void bind_errors(nanobind::module_& m);

// Seconds (None: no deadline; 1e9 or more saturates) as a timeout; ValueError for NaN. A negative timeout is a
// deadline already passed: a wait given one only looks.
std::chrono::nanoseconds to_timeout(std::optional<double> seconds);

}  // namespace kvtier::python

namespace nanobind::detail {
// Parameters handed over unconverted (IntArg, StrListArg): every object is taken, and the binding's own check names
// a bad one (the flags' type differs between nanobind versions, hence the template). `Label` is what signatures
// show.
template <typename Arg, typename Label>
struct unconverted_arg_caster {
  NB_TYPE_CASTER(Arg, Label::value)
  template <typename Flags>
  bool from_python(handle src, Flags, cleanup_list*) noexcept {
    value.value = src;
    return true;
  }
  static handle from_cpp(const Arg& v, rv_policy, cleanup_list*) noexcept { return v.value.inc_ref(); }
};
struct int_arg_name {
  static constexpr auto value = const_name("int");
};
struct str_list_arg_name {
  static constexpr auto value = const_name("list[str]");
};
template <>
struct type_caster<kvtier::python::IntArg> : unconverted_arg_caster<kvtier::python::IntArg, int_arg_name> {};
template <>
struct type_caster<kvtier::python::StrListArg> : unconverted_arg_caster<kvtier::python::StrListArg, str_list_arg_name> {
};
}  // namespace nanobind::detail
