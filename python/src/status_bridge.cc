#include "status_bridge.h"

#include <nanobind/stl/string.h>

#include <array>

namespace nb = nanobind;

namespace kvtier::python {
namespace {

constexpr int kNumCodes = static_cast<int>(StatusCode::kInternal) + 1;
// Borrowed from kvtier.errors, which lives as long as the interpreter.
std::array<PyObject*, kNumCodes> g_classes{};

}  // namespace

void raise_status(const Status& status) {
  const int code = static_cast<int>(status.code());
  PyObject* cls = code >= 0 && code < kNumCodes ? g_classes[static_cast<std::size_t>(code)] : nullptr;
  const std::string name(status_code_name(status.code()));
  if (cls == nullptr) {
    // kvtier.errors not registered (the extension imported on its own).
    throw std::runtime_error(name + ": " + status.message());
  }
  nb::object exc = nb::borrow(cls)(nb::str(status.message().c_str()), nb::str(name.c_str()));
  PyErr_SetObject(cls, exc.ptr());
  throw nb::python_error();
}

nb::object exception_object(const Status& status) {
  if (status.ok()) return nb::none();
  const int code = static_cast<int>(status.code());
  PyObject* cls = code >= 0 && code < kNumCodes ? g_classes[static_cast<std::size_t>(code)] : nullptr;
  const std::string name(status_code_name(status.code()));
  if (cls == nullptr) return nb::str((name + ": " + status.message()).c_str());
  return nb::borrow(cls)(nb::str(status.message().c_str()), nb::str(name.c_str()));
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

}  // namespace kvtier::python
