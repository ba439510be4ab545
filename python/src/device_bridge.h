// Shared by the bindings that take kvtier devices, streams and the engine's tensors (transfer, pd).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"
#include "kvtier/transfer/registration.h"
#include "status_bridge.h"

namespace kvtier::python {

struct PyDevice {
  std::unique_ptr<Device> device;
  MadeInProcess made;
  Device& get() const { return *device; }
  ~PyDevice() {
    if (made.in_child()) leak_in_child(device);
  }
};

struct PyStream {
  nanobind::object device_ref;  // keeps the PyDevice alive
  std::unique_ptr<Stream> stream;
  bool adopted = false;

  PyStream() = default;
  PyStream(PyStream&&) = default;
  PyStream& operator=(PyStream&&) = default;
  // A stream's destructor waits for its queued work (the host backend drains it): without the GIL, so a dropped
  // stream with work queued does not stop every other Python thread meanwhile.
  MadeInProcess made;
  ~PyStream() {
    if (made.in_child()) {
      leak_in_child(stream);
      return;
    }
    // Not while the interpreter finalizes: a callback thread taking the released GIL then would exit.
    const bool finalizing = interpreter_finalizing();
    if (stream && PyGILState_Check() && !finalizing) {
      GilReleased release;
      stream.reset();
    }
  }
};

// A dict of name -> tensor (DLPack: numpy, torch, ...). InvalidArgument naming the entry for a value that is not a
// tensor or is read-only (kvtier registers tensors it writes into), where nanobind's conversion of the whole
// argument raised a TypeError that named neither.
std::map<std::string, nanobind::ndarray<>> tensor_map_arg(nanobind::handle value, const char* what);

// The engine's tensor as kvtier sees it (data, dtype, shape, strides), checked against the backend of `device`.
Result<TensorDesc> describe_tensor(const std::string& name, const nanobind::ndarray<>& a, const Device& device);
// As describe_tensor, for memory the CPU addresses: DLPack CPU or CUDA-host (pinned) tensors only.
Result<TensorDesc> describe_host_tensor(const std::string& name, const nanobind::ndarray<>& a);
// Bytes from the tensor's first block to the end of its last one.
std::uint64_t tensor_extent_bytes(const TensorDesc& t);
// The names of a FastDeploy tensor map that `layout` uses for this rank and device label (registration.h,
// seed_tensor_name). A map may hold other tensors (other ranks', names the layout does not know): those are kept
// alive but never adopted, copied or sized, since nothing checked their shapes and strides.
std::set<std::string> layout_tensor_names(const KvLayout& layout, int rank, int device_label);

}  // namespace kvtier::python
