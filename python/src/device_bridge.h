// Shared by the bindings that take kvtier devices, streams and the engine's tensors (transfer, pd).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "kvtier/backend/device.h"
#include "kvtier/core/status.h"
#include "kvtier/transfer/registration.h"

namespace kvtier::python {

struct PyDevice {
  std::unique_ptr<Device> device;
  Device& get() const { return *device; }
};

struct PyStream {
  nanobind::object device_ref;  // keeps the PyDevice alive
  std::unique_ptr<Stream> stream;
  bool adopted = false;
};

// The engine's tensor as kvtier sees it (data, dtype, shape, strides), checked against the backend of `device`.
Result<TensorDesc> describe_tensor(const std::string& name, const nanobind::ndarray<>& a, const Device& device);
// As describe_tensor, for memory the CPU addresses: DLPack CPU or CUDA-host (pinned) tensors only.
Result<TensorDesc> describe_host_tensor(const std::string& name, const nanobind::ndarray<>& a);
// Bytes from the tensor's first block to the end of its last one.
std::uint64_t tensor_extent_bytes(const TensorDesc& t);

}  // namespace kvtier::python
