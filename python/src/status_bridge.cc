#include "status_bridge.h"

#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <array>

namespace nb = nanobind;

namespace kvtier::python {
namespace {

constexpr int kNumCodes = static_cast<int>(StatusCode::kInternal) + 1;
// Borrowed from kvtier.errors, which lives as long as the interpreter.
std::array<PyObject*, kNumCodes> g_classes{};

// A message as a Python str: bytes that are not UTF-8 (a name read from a file, a spec cut at a byte limit) come
// through as U+FFFD instead of failing the conversion, which lost the error for a bare RuntimeError.
nb::str message_str(std::string_view text) {
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  if (s == nullptr) throw nb::python_error();
  return nb::steal<nb::str>(s);
}

}  // namespace

void raise_status(const Status& status) {
  const int code = static_cast<int>(status.code());
  PyObject* cls = code >= 0 && code < kNumCodes ? g_classes[static_cast<std::size_t>(code)] : nullptr;
  const std::string name(status_code_name(status.code()));
  if (cls == nullptr) {
    // kvtier.errors not registered (the extension imported on its own).
    throw std::runtime_error(name + ": " + status.message());
  }
  nb::object exc = nb::borrow(cls)(message_str(status.message()), nb::str(name.c_str()));
  PyErr_SetObject(cls, exc.ptr());
  throw nb::python_error();
}

nb::object exception_object(const Status& status) {
  if (status.ok()) return nb::none();
  const int code = static_cast<int>(status.code());
  PyObject* cls = code >= 0 && code < kNumCodes ? g_classes[static_cast<std::size_t>(code)] : nullptr;
  const std::string name(status_code_name(status.code()));
  if (cls == nullptr) return message_str(name + ": " + status.message());
  return nb::borrow(cls)(message_str(status.message()), nb::str(name.c_str()));
}

void bind_errors(nb::module_& m) {
  m.def(
      "_register_errors",
      [](nb::dict classes) {
        for (int c = 0; c < kNumCodes; ++c) {
          nb::str key(std::string(status_code_name(static_cast<StatusCode>(c))).c_str());
          if (!classes.contains(key)) continue;
          nb::object cls = classes[key];
          g_classes[static_cast<std::size_t>(c)] = cls.inc_ref().ptr();  // kept for the process
        }
      },
      "Installs the exception class of each status code name (kvtier.errors does this at import).");
  m.def("_status_code_names", [] {
    nb::list out;
    for (int c = 0; c < kNumCodes; ++c) out.append(std::string(status_code_name(static_cast<StatusCode>(c))));
    return out;
  });
  m.def(
      "_raise_status",
      [](int code, const std::string& message) {
        if (code <= 0 || code >= kNumCodes) throw nb::value_error("status code out of range");
        raise_status(Status(static_cast<StatusCode>(code), message));
      },
      "Raises the exception of a status code (tests).");
}

// An integer argument in [low, high] (a Python int or anything with __index__, not a bool): nanobind's own
// conversion refuses -1 for an unsigned argument, or 2**31 for an int32, with a TypeError that names neither the
// argument nor the value.
// `value` as a Python int (InvalidArgument naming it otherwise). Its repr is built only for a message: these run
// once per element of block and token lists.
static std::string shown_value(nb::handle value) { return nb::cast<std::string>(nb::repr(value)); }
nb::object index_arg(nb::handle value, const char* what) {
  PyObject* o = value.ptr();
  nb::object index = PyBool_Check(o) || !PyIndex_Check(o) ? nb::object() : nb::steal(PyNumber_Index(o));
  if (!index.is_valid()) {
    PyErr_Clear();
    raise_status(InvalidArgument(fmt::format("{} {} is not an integer", what, shown_value(value))));
  }
  return index;
}
std::int64_t int_arg(nb::handle value, const char* what, std::int64_t low, std::int64_t high) {
  const nb::object index = index_arg(value, what);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0 || v < low || v > high)
    raise_status(OutOfRange(fmt::format("{} {} is not in [{}, {}]", what, shown_value(value), low, high)));
  return v;
}
// An unsigned 64-bit argument (ids, hashes up to 2**64 - 1).
std::uint64_t u64_arg(nb::handle value, const char* what) {
  const nb::object index = index_arg(value, what);
  const unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    raise_status(OutOfRange(fmt::format("{} {} is not in [0, 2**64 - 1]", what, shown_value(value))));
  }
  return v;
}

std::uint32_t u32_arg(nb::handle value, const char* what) {
  return static_cast<std::uint32_t>(int_arg(value, what, 0, UINT32_MAX));
}
// An optional unsigned 32-bit argument: None, or as u32_arg.
std::optional<std::uint32_t> opt_u32_arg(nb::handle value, const char* what) {
  if (value.is_none()) return std::nullopt;
  return u32_arg(value, what);
}
// A string argument (InvalidArgument naming the value otherwise).
std::string str_arg(nb::handle value, const char* what) {
  if (!nb::isinstance<nb::str>(value))
    raise_status(InvalidArgument(fmt::format("{} {} is not a string", what, nb::cast<std::string>(nb::repr(value)))));
  return nb::cast<std::string>(value);
}

std::map<std::string, std::string> config_arg(nb::handle value, const char* what) {
  std::map<std::string, std::string> out;
  if (value.is_none()) return out;
  if (!nb::isinstance<nb::dict>(value))
    raise_status(InvalidArgument(
        fmt::format("{} {} is not a dict of knob -> value", what, nb::cast<std::string>(nb::repr(value)))));
  for (auto [k, v] : nb::borrow<nb::dict>(value)) {
    if (!nb::isinstance<nb::str>(k))
      raise_status(
          InvalidArgument(fmt::format("{}: knob {} is not a string", what, nb::cast<std::string>(nb::repr(k)))));
    const std::string knob = nb::cast<std::string>(k);
    std::string text;
    if (nb::isinstance<nb::bool_>(v)) {
      text = nb::cast<bool>(v) ? "true" : "false";
    } else if (nb::isinstance<nb::str>(v)) {
      text = nb::cast<std::string>(v);
    } else if (nb::isinstance<nb::int_>(v) || nb::isinstance<nb::float_>(v)) {
      text = nb::cast<std::string>(nb::str(v));
    } else {
      raise_status(InvalidArgument(
          fmt::format("{}['{}'] {} is not a string, number or bool", what, knob, nb::cast<std::string>(nb::repr(v)))));
    }
    out[knob] = std::move(text);
  }
  return out;
}

namespace {
// Calls each(i, item) for the items of a Python sequence (a list, a tuple, a numpy array): InvalidArgument naming
// `what` when `seq` is none (None, a str or bytes, which would be split per character) or has no length, or naming
// `what`[i] for an item that cannot be read.
template <typename Each>
void for_each_item(nb::handle seq, const char* what, const char* of, Each&& each) {
  if (seq.is_none() || nb::isinstance<nb::str>(seq) || nb::isinstance<nb::bytes>(seq) ||
      PySequence_Check(seq.ptr()) == 0)
    raise_status(InvalidArgument(fmt::format("{} {} is not a sequence of {}", what, shown_value(seq), of)));
  const Py_ssize_t n = PySequence_Size(seq.ptr());
  if (n < 0) {
    PyErr_Clear();
    raise_status(InvalidArgument(fmt::format("{}: the sequence has no length", what)));
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    nb::object item = nb::steal(PySequence_GetItem(seq.ptr(), i));
    if (!item.is_valid()) {
      PyErr_Clear();
      raise_status(InvalidArgument(fmt::format("{}[{}] cannot be read", what, i)));
    }
    each(i, item);
  }
}
}  // namespace

namespace {
// Never destroyed: a detached shutdown thread may hand references back while the process exits, after static
// destructors ran.
struct Deferred {
  std::mutex mu;
  std::vector<PyObject*> refs;
};
Deferred& deferred() {
  static Deferred* d = new Deferred();
  return *d;
}
}  // namespace

void defer_release(PyObject* owned) {
  if (owned == nullptr) return;
  Deferred& d = deferred();
  std::lock_guard lock(d.mu);
  d.refs.push_back(owned);
}

void release_deferred() {
  std::vector<PyObject*> drop;
  {
    Deferred& d = deferred();
    std::lock_guard lock(d.mu);
    drop.swap(d.refs);
  }
  for (PyObject* o : drop) Py_DECREF(o);
}

std::vector<std::string> str_list(nb::handle value, const char* what) {
  std::vector<std::string> out;
  for_each_item(value, what, "strings", [&](Py_ssize_t i, nb::handle item) {
    if (!nb::isinstance<nb::str>(item))
      raise_status(InvalidArgument(fmt::format("{}[{}] {} is not a string", what, i, shown_value(item))));
    // A str that has no UTF-8 form (a lone surrogate such as '\ud800') was std::bad_cast, naming nothing.
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(item.ptr(), &size);
    if (utf8 == nullptr) {
      PyErr_Clear();
      raise_status(InvalidArgument(fmt::format("{}[{}] is not valid UTF-8 (a lone surrogate?)", what, i)));
    }
    out.emplace_back(utf8, static_cast<std::size_t>(size));
  });
  return out;
}

// A Python sequence of integers, each checked by int_arg: a value nanobind would refuse (2**63, a float, None) is
// named with its index rather than a TypeError about the whole call.
std::vector<std::int64_t> int_list(nb::handle seq, const char* what, std::int64_t high) {
  std::vector<std::int64_t> out;
  for_each_item(seq, what, "integers", [&](Py_ssize_t i, nb::handle item) {
    // A plain int in range (the common case) without building the element's name; anything else (a numpy
    // integer, a bool, a value out of range) through int_arg, which names it.
    if (PyLong_CheckExact(item.ptr())) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
      if (overflow == 0 && v >= 0 && v <= high) {
        out.push_back(v);
        return;
      }
      PyErr_Clear();
    }
    out.push_back(int_arg(item, fmt::format("{}[{}]", what, i).c_str(), 0, high));
  });
  return out;
}
}  // namespace kvtier::python
