// Devices, streams, layouts and the TransferManager, for Python.
//
// Engine memory crosses as DLPack tensors (torch, numpy, cupy, paddle: any
// object with __dlpack__) or, for host memory, as integer pointers; kvtier
// adopts it (never frees it) and keeps the Python objects alive as long as
// the manager. Every call that can block, or that takes a lock a kvtier
// thread may hold, releases the GIL. Callbacks run on kvtier's progress
// thread: they take the GIL for the call only; an exception they raise is
// logged to the "kvtier" logger and counted, never lost and never fatal to
// the thread. Python objects held by kvtier threads are released under the
// GIL.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device_bridge.h"
#include "engine_bridge.h"
#include "kvtier/core/checksum.h"
#include "kvtier/core/config.h"
#include "kvtier/device/cuda_device.h"
#include "kvtier/device/host_device.h"
#include "kvtier/transfer/registration.h"
#include "kvtier/transfer/transfer_config.h"
#include "kvtier/transfer/transfer_manager.h"
#include "metrics_bridge.h"
#include "status_bridge.h"

extern char** environ;

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {

std::chrono::nanoseconds to_timeout(std::optional<double> seconds) {
  using Seconds = std::chrono::duration<double>;
  if (!seconds) return std::chrono::nanoseconds::max();  // deadline_after saturates it
  // nb::value_error, not raise_status: callers may convert inside a call that released the GIL. A negative
  // timeout is a deadline already passed: the wait only looks.
  if (*seconds != *seconds) throw nb::value_error("timeout is NaN");
  if (*seconds >= 1e9) return std::chrono::nanoseconds::max();
  // Converting -inf or -1e300 overflows (undefined; it showed as "-9223372036854 ms" in messages).
  if (*seconds <= 0) return std::chrono::nanoseconds(0);
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Seconds(*seconds));
}

namespace {

// ---------------------------------------------------------------- objects

// A Python callable that kvtier threads may call and drop: both under the GIL.
struct PyCallable {
  explicit PyCallable(nb::object f) : fn(std::move(f)) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (!fn.is_valid()) return;
    if (!Py_IsInitialized()) {
      (void)fn.release();  // the interpreter is gone: leak rather than crash
      return;
    }
    GilAcquired gil;
    if (!gil.held()) {
      (void)fn.release();  // the process is exiting: leak rather than take the GIL
      return;
    }
    fn.reset();
  }
  nb::object fn;
};

std::atomic<std::uint64_t> g_callback_errors{0};

// Logs a callback's exception (with its traceback) to the "kvtier" logger.
void report_callback_error(nb::python_error& e, const char* what) {
  g_callback_errors.fetch_add(1, std::memory_order_relaxed);
  try {
    nb::object logger = nb::module_::import_("logging").attr("getLogger")("kvtier");
    logger.attr("error")("exception in a kvtier %s callback (ignored; the transfer state is unaffected):\n%s", what,
                         e.what());
  } catch (...) {
    PyErr_Clear();
  }
}

nb::object error_object(const Status& st) {
  if (st.ok()) return nb::none();
  try {
    raise_status(st);
  } catch (nb::python_error& e) {
    return nb::borrow(e.value());
  } catch (const std::exception& e) {
    return nb::str(e.what());
  }
  return nb::none();
}

// The callables a task holds are released (under the GIL) once the task is done, not when its record leaves the
// manager's history of finished tasks: a callback that refers to the manager (a closure over it) would otherwise
// keep it, its threads and its memory alive through a cycle that runs through C++, which Python's collector
// cannot see.
// `what` names the argument: a value that cannot be called is refused when the task is submitted, not found out
// later as a logged callback error.
std::shared_ptr<PyCallable> callable_or_null(nb::object fn, const char* what) {
  if (fn.is_none()) return nullptr;
  if (PyCallable_Check(fn.ptr()) == 0)
    raise_status(InvalidArgument(fmt::format("{} is a {}, not a callable (or None)", what, nb::inst_name(fn).c_str())));
  return std::make_shared<PyCallable>(std::move(fn));
}

LayerCallback wrap_layer_callback(std::shared_ptr<PyCallable> holder) {
  if (!holder) return {};
  return [holder](std::uint32_t layer, const Status& st) {
    if (!Py_IsInitialized()) return;
    GilAcquired gil;
    if (!gil.held()) return;             // the process is exiting
    if (!holder->fn.is_valid()) return;  // released when its task finished
    try {
      holder->fn(layer, error_object(st));
    } catch (nb::python_error& e) {
      report_callback_error(e, "on_layer");
    }
  };
}

// `also_release`: the same task's on_layer callable, released with this one.
TaskCallback wrap_task_callback(nb::object fn, std::shared_ptr<PyCallable> also_release = nullptr) {
  auto holder = callable_or_null(std::move(fn), "on_done");
  if (!holder && !also_release) return {};
  return [holder, also_release](TaskId id, const Status& st) {
    if (!Py_IsInitialized()) return;
    GilAcquired gil;
    if (!gil.held()) return;  // the process is exiting: the callables stay (their holders leak them)
    if (holder && holder->fn.is_valid()) {
      try {
        holder->fn(id, error_object(st));
      } catch (nb::python_error& e) {
        report_callback_error(e, "on_done");
      }
      holder->fn.reset();
    }
    if (also_release) also_release->fn.reset();
  };
}

// ---------------------------------------------------------------- tensors

// kvtier moves bytes: every fixed-width DLPack type is accepted, and its element size (with the
// address alignment it implies) is all that matters. Refused: vector types (lanes != 1), sub-byte
// types (fp4, fp6: DLPack gives no byte layout for them) and codes this build does not know.
Result<DType> dtype_of(const nb::dlpack::dtype& d, const std::string& name) {
  using nb::dlpack::dtype_code;
  const auto code = static_cast<dtype_code>(d.code);
  auto refuse = [&](std::string_view why) -> Status {
    return InvalidArgument(fmt::format("tensor '{}' has DLPack dtype (code {}, bits {}, lanes {}): {}", name, d.code,
                                       d.bits, d.lanes, why));
  };
  if (d.lanes != 1)
    return refuse("vector dtypes (lanes != 1) are not supported; pass the tensor viewed as its scalar type");
  if (d.bits == 0 || d.bits % 8 != 0)
    return refuse("sub-byte element types have no byte layout; pass the packed tensor viewed as uint8");
  switch (code) {
    case dtype_code::Int:
      switch (d.bits) {
        case 8: return DType::kInt8;
        case 16: return DType::kInt16;
        case 32: return DType::kInt32;
        case 64: return DType::kInt64;
      }
      break;
    case dtype_code::UInt:
      switch (d.bits) {
        case 8: return DType::kUint8;
        case 16: return DType::kUint16;
        case 32: return DType::kUint32;
        case 64: return DType::kUint64;
      }
      break;
    case dtype_code::Float:
      switch (d.bits) {
        case 16: return DType::kFp16;
        case 32: return DType::kFp32;
        case 64: return DType::kFp64;
      }
      break;
    case dtype_code::Bfloat:
      if (d.bits == 16) return DType::kBf16;
      break;
    case dtype_code::Complex:
      if (d.bits == 64) return DType::kComplex64;
      if (d.bits == 128) return DType::kComplex128;
      break;
    case dtype_code::Bool:
      if (d.bits == 8) return DType::kBool;
      break;
    case dtype_code::Float8_E4M3FN: return DType::kFp8E4M3;
    case dtype_code::Float8_E5M2: return DType::kFp8E5M2;
    case dtype_code::Float8_E4M3FNUZ: return DType::kFp8E4M3Fnuz;
    case dtype_code::Float8_E5M2FNUZ: return DType::kFp8E5M2Fnuz;
    case dtype_code::Float8_E8M0FNU: return DType::kFp8E8M0;
    case dtype_code::Float8_E3M4: return DType::kFp8E3M4;
    case dtype_code::Float8_E4M3: return DType::kFp8E4M3Ieee;
    case dtype_code::Float8_E4M3B11FNUZ: return DType::kFp8E4M3B11Fnuz;
    default: break;
  }
  return refuse(
      fmt::format("no {}-bit element type with this code; kvtier accepts DLPack's int, uint, float, bfloat, "
                  "complex, bool and fp8 codes",
                  d.bits));
}

// DLPack device types: 1 CPU, 2 CUDA, 3 CUDA host (pinned).
constexpr int kCpu = 1, kCuda = 2, kCudaHost = 3;

Result<TensorDesc> describe_any_tensor(const std::string& name, const nb::ndarray<>& a) {
  TensorDesc t;
  t.data = a.data();
  KVTIER_ASSIGN_OR_RETURN(t.dtype, dtype_of(a.dtype(), name));
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    t.shape.push_back(static_cast<std::int64_t>(a.shape(i)));
    t.strides.push_back(static_cast<std::int64_t>(a.stride(i)));
  }
  return t;
}

// str(value.dtype) for an array-like whose dtype DLPack cannot carry (numpy's object, string, structured, datetime
// dtypes), "" for anything without one. Through the C API, clearing what a failed lookup raised: nanobind's
// attribute helpers throw, and the failed import before this may have left an error behind.
std::string dtype_name_of(nb::handle value) {
  PyErr_Clear();
  PyObject* dtype = PyObject_GetAttrString(value.ptr(), "dtype");
  if (dtype == nullptr) {
    PyErr_Clear();
    return {};
  }
  PyObject* text = PyObject_Str(dtype);
  Py_DECREF(dtype);
  std::string out;
  if (text != nullptr) {
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 != nullptr) out.assign(utf8, static_cast<std::size_t>(std::min<Py_ssize_t>(size, 200)));
    Py_DECREF(text);
  }
  PyErr_Clear();
  return out;
}

}  // namespace

std::map<std::string, nb::ndarray<>> tensor_map_arg(nb::handle value, const char* what) {
  if (!nb::isinstance<nb::dict>(value))
    raise_status(InvalidArgument(fmt::format("{} {} is not a dict of name -> tensor", what, shown_value(value))));
  std::map<std::string, nb::ndarray<>> out;
  for (auto [k, v] : nb::borrow<nb::dict>(value)) {
    if (!nb::isinstance<nb::str>(k))
      raise_status(InvalidArgument(fmt::format("{}: key {} is not a string", what, shown_value(k))));
    std::string name;
    if (!nb::try_cast(k, name))  // a lone surrogate has no UTF-8 form
      raise_status(InvalidArgument(fmt::format("{}: key {} is not valid UTF-8", what, shown_value(k))));
    nb::ndarray<> a;
    if (!nb::try_cast(v, a)) {
      nb::ndarray<nb::ro> read_only;
      if (nb::try_cast(v, read_only))
        raise_status(InvalidArgument(fmt::format(
            "{}['{}'] is read-only: kvtier registers KV tensors writable (pass a writable one)", what, name)));
      const std::string dtype = dtype_name_of(v);
      if (!dtype.empty())
        raise_status(
            InvalidArgument(fmt::format("{}['{}'] is a {} of dtype {}, which DLPack cannot carry (kvtier takes numeric "
                                        "dtypes: integer, float, complex, bool)",
                                        what, name, nb::cast<std::string>(v.type().attr("__name__")), dtype)));
      raise_status(InvalidArgument(fmt::format("{}['{}'] is a {}, not a tensor (numpy, torch or another DLPack array)",
                                               what, name, nb::cast<std::string>(v.type().attr("__name__")))));
    }
    out.emplace(name, std::move(a));
  }
  return out;
}

// The engine's tensor as kvtier sees it, checked against the backend.
Result<TensorDesc> describe_tensor(const std::string& name, const nb::ndarray<>& a, const Device& device) {
  KVTIER_ASSIGN_OR_RETURN(TensorDesc t, describe_any_tensor(name, a));
  const int type = a.device_type();
  if (device.backend() == BackendKind::kCuda) {
    if (type != kCuda)
      return InvalidArgument(
          fmt::format("device tensor '{}' is not CUDA memory (DLPack device type {}); the cache "
                      "is registered on CUDA device {}",
                      name, a.device_type(), device.ordinal()));
    t.device_ordinal = a.device_id();
  } else if (type != kCpu && type != kCudaHost) {
    return InvalidArgument(fmt::format(
        "device tensor '{}' has DLPack device type {}; the host backend keeps its device memory in RAM (use numpy or "
        "CPU tensors)",
        name, a.device_type()));
  }
  return t;
}

Result<TensorDesc> describe_host_tensor(const std::string& name, const nb::ndarray<>& a) {
  KVTIER_ASSIGN_OR_RETURN(TensorDesc t, describe_any_tensor(name, a));
  if (a.device_type() != kCpu && a.device_type() != kCudaHost)
    return InvalidArgument(
        fmt::format("tensor '{}' has DLPack device type {}; this endpoint takes memory the CPU "
                    "addresses (numpy, CPU or pinned tensors)",
                    name, a.device_type()));
  return t;
}

std::uint64_t tensor_extent_bytes(const TensorDesc& t) {
  // A 0-d tensor is one element; a tensor of no blocks covers nothing (a map may hold tensors the layout does not
  // use: other ranks', names it does not know).
  if (t.shape.empty()) return dtype_bytes(t.dtype);
  if (t.shape[0] <= 0) return 0;
  std::uint64_t elems = 1;
  for (std::size_t i = 1; i < t.shape.size(); ++i) elems *= static_cast<std::uint64_t>(t.shape[i]);
  const std::uint64_t stride = t.strides.empty() ? elems : static_cast<std::uint64_t>(t.strides[0]);
  return ((static_cast<std::uint64_t>(t.shape[0]) - 1) * stride + elems) * dtype_bytes(t.dtype);
}

std::set<std::string> layout_tensor_names(const KvLayout& layout, int rank, int device_label) {
  std::set<std::string> names;
  for (std::uint32_t l = 0; l < layout.num_layers(); ++l)
    for (const RoleLayout& role : layout.layer(l).roles)
      names.insert(seed_tensor_name(role.role, role.name, l, rank, device_label));
  return names;
}

namespace {

// ---------------------------------------------------------------- manager

TransferManager::DeviceAccess parse_access(const std::string& s) {
  if (s == "read") return TransferManager::DeviceAccess::kRead;
  if (s == "write") return TransferManager::DeviceAccess::kWrite;
  if (s == "overwrite") return TransferManager::DeviceAccess::kOverwrite;
  raise_status(InvalidArgument(fmt::format("access '{}' is not one of read, write, overwrite", s)));
}

std::vector<BlockId> to_ids(const std::vector<std::int64_t>& ids, const char* what) {
  std::vector<BlockId> out;
  out.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || static_cast<std::uint64_t>(ids[i]) > kMaxBlockId)
      raise_status(OutOfRange(fmt::format("{} block id {} at index {} is not a valid block id", what, ids[i], i)));
    out.push_back(static_cast<BlockId>(ids[i]));
  }
  return out;
}

std::vector<BlockId> to_ids(nb::handle seq, const char* what) {
  return to_ids(int_list(seq, fmt::format("{} block id", what).c_str(), static_cast<std::int64_t>(kMaxBlockId)), what);
}

std::vector<std::uint32_t> to_layers(nb::handle layers) {
  std::vector<std::uint32_t> out;
  for (std::int64_t l : int_list(layers, "layer", UINT32_MAX)) out.push_back(static_cast<std::uint32_t>(l));
  return out;
}

nb::object parse_json(const std::string& s) { return nb::module_::import_("json").attr("loads")(s); }

nb::dict task_info_dict(const TaskInfo& info) {
  nb::dict d;
  d["kind"] = std::string(task_kind_name(info.kind));
  d["state"] = std::string(task_state_name(info.state));
  d["status"] = info.status.ok() ? nb::none() : nb::cast(info.status.to_string());
  d["layers"] = info.layers;
  std::vector<std::string> states;
  for (auto s : info.layer_states) states.emplace_back(task_state_name(s));
  d["layer_states"] = states;
  d["bytes"] = info.bytes;
  return d;
}

// The device and stream arguments of from_tensors / from_pages: nb::cast of another object threw std::bad_cast,
// which reached Python as a RuntimeError naming neither.
PyDevice& device_arg(nb::handle value, const char* what) {
  if (!nb::isinstance<PyDevice>(value))
    raise_status(
        InvalidArgument(fmt::format("{} is a {}, not a kvtier device (kvtier.host_device(), "
                                    "kvtier.cuda_device())",
                                    what, nb::cast<std::string>(nb::str(value.type())))));
  return nb::cast<PyDevice&>(value);
}
PyStream& stream_arg(nb::handle value, const char* what) {
  if (!nb::isinstance<PyStream>(value))
    raise_status(InvalidArgument(fmt::format("{} is a {}, not a kvtier stream (device.create_stream())", what,
                                             nb::cast<std::string>(nb::str(value.type())))));
  return nb::cast<PyStream&>(value);
}

std::unique_ptr<PyTransferManager> create_manager(nb::object device_obj, nb::object compute_obj, nb::handle tensors_obj,
                                                  std::optional<std::map<std::string, std::uintptr_t>> host_pointers,
                                                  IntArg num_host_blocks_arg, IntArg num_model_layers_arg,
                                                  IntArg rank_arg, IntArg device_label_arg, IntArg block_tokens_arg,
                                                  nb::handle config_obj) {
  const std::map<std::string, std::string> config = config_arg(config_obj, "config");
  std::map<std::string, nb::ndarray<>> tensors = tensor_map_arg(tensors_obj, "device_tensors");
  const std::uint64_t num_host_blocks = num_host_blocks_arg.u64("num_host_blocks");
  const std::uint32_t num_model_layers = num_model_layers_arg.u32("num_model_layers");
  const int rank = static_cast<int>(rank_arg.in("rank", 0, INT32_MAX));
  const int device_label = static_cast<int>(device_label_arg.in("device_label", 0, INT32_MAX));
  const std::uint32_t block_tokens = block_tokens_arg.u32("block_tokens");
  PyDevice& pd = device_arg(device_obj, "device");
  PyStream& compute = stream_arg(compute_obj, "compute_stream");
  Device& device = pd.get();
  release_deferred();  // what managers dropped inside their callbacks left behind
  auto out = std::make_unique<PyTransferManager>();
  out->device_ref = device_obj;
  out->compute_ref = compute_obj;
  std::map<std::string, TensorDesc> descs;
  for (auto& [name, array] : tensors) {
    descs[name] = value_or_raise(describe_tensor(name, array, device));
    out->keep_alive.append(nb::cast(array));
  }
  TransferManagerConfig cfg;
  {
    ConfigTable table;
    bind_transfer_manager_config(table, cfg);
    check(table.apply_env(environ).with_context("KVTIER_TRANSFER_* environment"));
    for (const auto& [k, v] : config) check(table.set(k, v));
  }
  const std::uint64_t host_ready_ms = static_cast<std::uint64_t>(cfg.host_ready_timeout.count());
  Status st = released([&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(out->layout,
                            layout_from_name_map(descs, num_model_layers, rank, device_label, block_tokens));
    std::map<std::string, void*> host;
    if (host_pointers)
      for (const auto& [k, v] : *host_pointers) host[k] = reinterpret_cast<void*>(v);
    KVTIER_ASSIGN_OR_RETURN(KvCacheRegistration reg,
                            registration_from_name_map(descs, host_pointers ? &host : nullptr, num_host_blocks,
                                                       out->layout, rank, device_label, device.ordinal()));
    // Engine memory: device ranges made known to the backend; host ranges
    // pinned (registered, or borrowed when already pinned).
    const std::set<std::string> used = layout_tensor_names(out->layout, rank, device_label);
    for (const auto& [name, t] : descs) {
      if (!used.contains(name)) continue;         // not the layout's: never moved
      if (tensor_extent_bytes(t) == 0) continue;  // no blocks: nothing of it is ever copied
      auto b = device.adopt_device_memory(t.data, tensor_extent_bytes(t));
      if (!b.ok()) return b.status().with_context(fmt::format("device tensor '{}'", name));
      out->adopted_device.push_back(std::move(b).value());
    }
    if (reg.host.space) {
      const BlockSpace& hs = *reg.host.space;
      for (std::uint32_t l = 0; l < out->layout.num_layers(); ++l)
        for (std::uint32_t r = 0; r < out->layout.num_roles(l); ++r) {
          const std::uint64_t bytes = out->layout.block_bytes(l, r) * hs.num_blocks();
          auto pin = device.register_host(hs.plane(l, r).base, bytes);
          const std::string what =
              fmt::format("host cache of layer {} {}", l, role_name(out->layout.layer(l).roles[r].role));
          if (!pin.ok()) return pin.status().with_context(what);
          KVTIER_RETURN_IF_ERROR(pin.value()->wait_ready(std::chrono::milliseconds(host_ready_ms)).with_context(what));
          out->host_registrations.push_back(std::move(pin).value());
        }
    }
    KVTIER_ASSIGN_OR_RETURN(out->mgr, TransferManager::create(device, *compute.stream, std::move(reg), cfg));
    return Status::Ok();
  });
  check(st);
  return out;
}

// A manager over pages of an engine's byte tensors (vLLM's canonical KV caches): tensor i is (num_blocks,
// row_bytes) of one-byte elements, block b's page of page_bytes[i] at the start of row b. Each tensor is one
// layer of one role (kOther, "page") of the layout; the host cache kvtier allocates is page-first with no padding,
// so host block b holds every tensor's page of one block back to back and consecutive host blocks are consecutive
// memory (a run of host blocks is one contiguous buffer: a storage object).
std::unique_ptr<PyTransferManager> create_page_manager(nb::object device_obj, nb::object compute_obj,
                                                       std::vector<nb::ndarray<>> tensors,
                                                       std::vector<std::uint64_t> page_bytes,
                                                       IntArg num_host_blocks_arg, IntArg block_tokens_arg,
                                                       nb::handle config_obj, nb::object host_of_obj) {
  const std::map<std::string, std::string> config = config_arg(config_obj, "config");
  const std::uint64_t num_host_blocks = num_host_blocks_arg.u64("num_host_blocks");
  const std::uint32_t block_tokens = block_tokens_arg.u32("block_tokens");
  PyDevice& pd = device_arg(device_obj, "device");
  PyStream& compute = stream_arg(compute_obj, "compute_stream");
  Device& device = pd.get();
  if (tensors.empty()) raise_status(InvalidArgument("from_pages: no tensors"));
  if (tensors.size() != page_bytes.size())
    raise_status(
        InvalidArgument(fmt::format("from_pages: {} tensors and {} page sizes", tensors.size(), page_bytes.size())));
  if (num_host_blocks == 0) raise_status(InvalidArgument("from_pages: num_host_blocks is 0"));
  if (num_host_blocks > std::uint64_t{kMaxBlockId} + 1)
    raise_status(InvalidArgument(fmt::format("from_pages: num_host_blocks {}: at most {} (32-bit block ids)",
                                             num_host_blocks, kMaxBlockId + 1)));
  // What host_of shares, taken with the GIL held (a close() of it on another thread resets them).
  std::shared_ptr<PinnedMemory> shared_host;
  KvLayout shared_layout;
  if (!host_of_obj.is_none()) {
    if (!nb::isinstance<PyTransferManager>(host_of_obj))
      raise_status(InvalidArgument(fmt::format("from_pages: host_of is a {}, not a kvtier TransferManager",
                                               nb::type_name(host_of_obj.type()).c_str())));
    const PyTransferManager& host_of = nb::cast<const PyTransferManager&>(host_of_obj);
    if (!host_of.mgr) raise_status(FailedPrecondition("from_pages: host_of was closed (its host cache with it)"));
    if (!host_of.host_memory)
      raise_status(InvalidArgument("from_pages: host_of was not made by from_pages (its host cache is its own)"));
    shared_host = host_of.host_memory;
    shared_layout = host_of.layout;
  }
  release_deferred();  // what managers dropped inside their callbacks left behind
  auto out = std::make_unique<PyTransferManager>();
  out->device_ref = device_obj;
  out->compute_ref = compute_obj;
  std::vector<TensorDesc> descs;
  std::vector<LayerLayout> layers;
  std::uint64_t num_blocks = std::numeric_limits<std::uint64_t>::max();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = fmt::format("tensor {}", i);
    TensorDesc t = value_or_raise(describe_tensor(name, tensors[i], device));
    if (t.shape.size() != 2 || dtype_bytes(t.dtype) != 1 || t.strides.size() != 2 || t.strides[1] != 1 ||
        t.shape[0] <= 0 || t.strides[0] < t.shape[1])
      raise_status(InvalidArgument(fmt::format(
          "from_pages: {} is not a (num_blocks, row_bytes) tensor of one-byte elements with contiguous rows "
          "(dims {}, {}-byte elements)",
          name, t.shape.size(), dtype_bytes(t.dtype))));
    if (page_bytes[i] == 0 || page_bytes[i] > static_cast<std::uint64_t>(t.shape[1]))
      raise_status(InvalidArgument(
          fmt::format("from_pages: page of {} bytes for {} whose rows hold {}", page_bytes[i], name, t.shape[1])));
    num_blocks = std::min(num_blocks, static_cast<std::uint64_t>(t.shape[0]));
    layers.push_back(LayerLayout{{RoleLayout{Role::kOther, DType::kUint8, page_bytes[i], "page"}}, false});
    descs.push_back(std::move(t));
    out->keep_alive.append(nb::cast(tensors[i]));
  }
  TransferManagerConfig cfg;
  {
    ConfigTable table;
    bind_transfer_manager_config(table, cfg);
    check(table.apply_env(environ).with_context("KVTIER_TRANSFER_* environment"));
    for (const auto& [k, v] : config) check(table.set(k, v));
  }
  Status st = released([&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(out->layout, KvLayout::create(std::move(layers), block_tokens, TokenOrder::kOpaque));
    std::vector<std::vector<Plane>> planes;
    std::vector<std::vector<std::uint64_t>> extents;
    for (std::size_t i = 0; i < descs.size(); ++i) {
      const TensorDesc& t = descs[i];
      planes.push_back({Plane{static_cast<std::byte*>(t.data), static_cast<std::uint64_t>(t.strides[0])}});
      extents.push_back({tensor_extent_bytes(t)});
      auto b = device.adopt_device_memory(t.data, tensor_extent_bytes(t));
      if (!b.ok()) return b.status().with_context(fmt::format("tensor {}", i));
      out->adopted_device.push_back(std::move(b).value());
    }
    KvCacheRegistration reg;
    KVTIER_ASSIGN_OR_RETURN(reg.device, BlockSpace::from_planes(MemoryKind::kDevice, device.ordinal(), out->layout,
                                                                num_blocks, std::move(planes), std::move(extents)));
    // The host cache is the binding's, not the manager's, so that a manager that replaces this one (after a
    // failed copy: a GPU error poisons its streams) can take it over with what it holds (host_of).
    const std::uint64_t page = BlockSpace::page_first_page_bytes(out->layout);
    if (shared_host) {
      if (!(shared_layout == out->layout) || shared_host->size() != page * num_host_blocks)
        return InvalidArgument(fmt::format(
            "from_pages: host_of holds {} bytes of another layout; this manager needs {} host blocks of {} bytes "
            "({})",
            shared_host->size(), num_host_blocks, page, out->layout.describe()));
      out->host_memory = std::move(shared_host);
    } else {
      if (page > std::numeric_limits<std::uint64_t>::max() / num_host_blocks)
        return InvalidArgument(fmt::format("from_pages: {} host blocks of {} bytes overflow", num_host_blocks, page));
      auto mem = device.allocate_pinned(page * num_host_blocks);
      if (!mem.ok())
        return mem.status().with_context(fmt::format("pinned host cache of {} bytes", page * num_host_blocks));
      KVTIER_RETURN_IF_ERROR(mem.value()->wait_ready(cfg.host_ready_timeout));
      out->host_memory = std::shared_ptr<PinnedMemory>(std::move(mem).value());
    }
    KVTIER_ASSIGN_OR_RETURN(
        BlockSpace host_space,
        BlockSpace::page_first(MemoryKind::kPinnedHost, device.ordinal(), out->layout, num_host_blocks,
                               out->host_memory->data(), out->host_memory->size()));
    reg.host.space = std::move(host_space);
    KVTIER_ASSIGN_OR_RETURN(out->mgr, TransferManager::create(device, *compute.stream, std::move(reg), cfg));
    return Status::Ok();
  });
  check(st);
  return out;
}

}  // namespace

void bind_transfer(nb::module_& m) {
  nb::class_<PyDevice>(m, "Device", "A kvtier device: a CUDA GPU, or the host backend (device memory in RAM).")
      .def_prop_ro("backend", [](const PyDevice& d) { return std::string(backend_name(d.get().backend())); })
      .def_prop_ro("ordinal", [](const PyDevice& d) { return d.get().ordinal(); })
      .def_prop_ro("name", [](const PyDevice& d) { return d.get().name(); })
      .def(
          "create_stream",
          [](nb::object self, const std::string& name, bool high_priority) {
            PyDevice& d = nb::cast<PyDevice&>(self);
            auto s = std::make_unique<PyStream>();
            s->device_ref = self;
            StreamOptions o{high_priority ? StreamPriority::kHigh : StreamPriority::kNormal, name};
            s->stream = value_or_raise(d.get().create_stream(o));
            return s;
          },
          "name"_a = "python", "high_priority"_a = false, "A new stream owned by kvtier.")
      .def(
          "adopt_stream",
          [](nb::object self, std::uintptr_t handle, const std::string& name) {
            PyDevice& d = nb::cast<PyDevice&>(self);
            auto s = std::make_unique<PyStream>();
            s->device_ref = self;
            s->adopted = true;
            s->stream = value_or_raise(d.get().adopt_stream(reinterpret_cast<void*>(handle), name));
            return s;
          },
          "handle"_a, "name"_a = "engine",
          "Wraps the engine's stream (e.g. torch.cuda.current_stream().cuda_stream); kvtier never destroys it.")
      .def(
          "synchronize",
          [](PyDevice& d, PyStream& s, std::optional<double> timeout) {
            Status st;
            {
              GilReleased release;
              st = d.get().synchronize(*s.stream, to_timeout(timeout));
            }
            check(st);
          },
          "stream"_a, "timeout"_a = nb::none(), "Blocks (GIL released) until the stream's work completed.")
      .def(
          "fail_nth_operation",
          [](PyDevice& d, IntArg n_arg) {
            const std::uint64_t n = n_arg.u64("n");
            auto* host = dynamic_cast<HostDevice*>(&d.get());
            if (host == nullptr)
              raise_status(
                  NotSupported(fmt::format("fail_nth_operation: the {} backend injects no failures "
                                           "(the host backend does)",
                                           backend_name(d.get().backend()))));
            host->fail_nth_operation(n);
          },
          "n"_a,
          "Host backend, for tests: the n-th data operation (copy, fill, kernel) to start from now (1-based) fails "
          "and poisons its destination, as a failed GPU copy would leave it undefined. The failure is sticky, as a "
          "CUDA copy error is: the stream it ran on fails every later operation, and so does a stream that waited "
          "on it (a compute stream after wait_for_layer); a test of what follows a failure uses a new manager and "
          "a new compute stream.");

  nb::class_<PyStream>(m, "Stream")
      .def_prop_ro("id", [](const PyStream& s) { return s.stream->id(); })
      .def_prop_ro("handle",
                   [](const PyStream& s) { return reinterpret_cast<std::uintptr_t>(s.stream->native_handle()); })
      .def_prop_ro("adopted", [](const PyStream& s) { return s.adopted; });

  m.def(
      "host_device",
      [](IntArg seed, IntArg min_delay_us, IntArg max_delay_us) {
        HostDeviceOptions o;
        o.seed = seed.u64("seed");
        o.min_delay = std::chrono::microseconds(min_delay_us.in("min_delay_us", 0, INT32_MAX));
        o.max_delay = std::chrono::microseconds(max_delay_us.in("max_delay_us", 0, INT32_MAX));
        auto d = std::make_unique<PyDevice>();
        d->device = value_or_raise(HostDevice::create(o));
        return d;
      },
      "seed"_a = 0, "min_delay_us"_a = 0, "max_delay_us"_a = 0,
      "The host backend: device memory in RAM, streams as worker threads (tests, CI). Delays are injected per "
      "operation when max_delay_us > 0.");
  m.def(
      "cuda_device",
      [](IntArg ordinal) {
        auto d = std::make_unique<PyDevice>();
        d->device = value_or_raise(create_cuda_device(static_cast<int>(ordinal.in("ordinal", 0, INT32_MAX))));
        return d;
      },
      "ordinal"_a = 0, "A CUDA device by process-visible ordinal (after CUDA_VISIBLE_DEVICES).");
  m.def(
      "piece_checksums",
      [](const std::vector<std::pair<std::uintptr_t, std::uint64_t>>& buffers) {
        std::vector<std::pair<const void*, std::uint64_t>> spans;
        spans.reserve(buffers.size());
        for (std::size_t i = 0; i < buffers.size(); ++i) {
          if (buffers[i].first == 0 && buffers[i].second != 0)
            raise_status(InvalidArgument(fmt::format("piece_checksums: buffer {} is a null pointer", i)));
          if (buffers[i].first > UINTPTR_MAX - buffers[i].second)
            raise_status(
                InvalidArgument(fmt::format("piece_checksums: buffer {} (address {:#x}, {} bytes) wraps "
                                            "around the address space",
                                            i, buffers[i].first, buffers[i].second)));
          spans.emplace_back(reinterpret_cast<const void*>(buffers[i].first), buffers[i].second);
        }
        GilReleased release;
        return piece_checksums(spans);
      },
      "buffers"_a,
      "Piece checksums (kvtier/core/checksum.h) of host buffers given as (address, bytes), on a pool of threads "
      "(GIL released). The memory must stay valid and unchanged during the call.");
  m.def("cuda_device_count", [] { return cuda_device_count(); });
  m.def("cuda_compiled", [] { return cuda_compiled(); });
  m.def(
      "callback_errors", [] { return g_callback_errors.load(); },
      "Exceptions raised by Python callbacks so far (each was logged to the 'kvtier' logger).");

  nb::class_<PyTransferManager>(m, "TransferManager",
                                "Evictions (device -> host, every layer) and layer-wise loads (host -> device) on "
                                "side streams, ordered by per-block hazards. See include/kvtier/transfer/"
                                "transfer_manager.h for the contract.")
      .def_static("from_tensors", &create_manager, "device"_a, "compute_stream"_a, "device_tensors"_a,
                  "host_pointers"_a.none(), "num_host_blocks"_a, "num_model_layers"_a, "rank"_a = 0,
                  "device_label"_a = 0, "block_tokens"_a = 64, "config"_a.none() = nb::none(),
                  "Registers the engine's KV tensors (FastDeploy names: key_caches_{layer}_rank{r}.device{d}, ...) "
                  "and its host cache (integer pointers to num_host_blocks blocks per tensor, same per-block "
                  "layout; None: kvtier allocates it). Integer pointers keep nothing alive: their memory must "
                  "outlive every copy queued into or out of it, after the manager is dropped too (close() waits for "
                  "them). config: knob -> value (docs/configuration.md).")
      .def_static("from_pages", &create_page_manager, "device"_a, "compute_stream"_a, "tensors"_a, "page_bytes"_a,
                  "num_host_blocks"_a, "block_tokens"_a = 16, "config"_a.none() = nb::none(), "host_of"_a = nb::none(),
                  "Registers pages of an engine's byte tensors (vLLM's canonical KV caches): tensor i is (num_blocks, "
                  "row_bytes) of one-byte elements, block b's page of page_bytes[i] bytes at the start of its row b. "
                  "kvtier allocates num_host_blocks pinned host blocks, page-first with no padding: host block b "
                  "holds the pages of every tensor back to back (host_page(b), host_page_bytes), so a run of host "
                  "blocks is one contiguous buffer. host_of: a from_pages manager of the same tensors whose host "
                  "cache, with its "
                  "bytes, this one takes over (both hold it; it is freed with the last of them).")
      .def(
          "device_checksums",
          [](PyTransferManager& p, nb::handle blocks, PyStream& stream, std::optional<double> timeout) {
            auto ids = to_ids(blocks, "device");
            const std::shared_ptr<TransferManager> held = p.hold();
            TransferManager& tm = *held;
            if (!p.checksums) p.checksums = std::make_unique<DeviceChecksums>();
            DeviceChecksums& c = *p.checksums;
            std::vector<std::uint64_t> out(ids.size());
            const auto wait_for = to_timeout(timeout);  // a bad timeout is refused before anything is queued
            check(released([&]() -> Status {
              std::lock_guard lock(c.mu);
              Device& device = tm.device();
              const std::uint64_t bytes = std::max<std::uint64_t>(8, 8 * ids.size());
              if (!c.engine) {
                KVTIER_ASSIGN_OR_RETURN(c.engine, CopyEngine::create(device));
                c.device = &device;
              }
              c.sweep();
              DeviceChecksums::Scratch& sc = c.scratch;
              if (sc.sums.size() < bytes || !sc.host) {
                sc.sums = Buffer();
                sc.host.reset();
                KVTIER_ASSIGN_OR_RETURN(sc.sums, device.allocate_device(bytes));
                KVTIER_ASSIGN_OR_RETURN(sc.host, device.allocate_pinned(bytes));
                KVTIER_RETURN_IF_ERROR(sc.host->wait_ready(std::chrono::seconds(60)));
              }
              if (ids.empty()) return Status::Ok();
              auto* sums = static_cast<std::uint64_t*>(sc.sums.data());
              Status s = c.engine->checksum(tm.device_space(), ids, {}, kAllRoles, sums, *stream.stream).status();
              if (s.ok()) s = device.memcpy_async(sc.host->data(), sums, 8 * ids.size(), *stream.stream);
              if (s.ok()) s = device.synchronize(*stream.stream, wait_for);
              if (!s.ok()) {
                c.retire(*stream.stream);  // whatever was queued may still write them
                return s;
              }
              std::memcpy(out.data(), sc.host->data(), 8 * ids.size());
              return Status::Ok();
            }));
            return out;
          },
          "device_blocks"_a, "stream"_a, "timeout"_a = nb::none(),
          "Block checksums (kvtier/copy/copy_engine.h, block_checksum: every plane of the block) of device blocks, "
          "computed on the device after the work enqueued so far on `stream`, then read back (waits for the stream, "
          "GIL released). Blocks must be 16-byte aligned (InvalidArgumentError naming the plane otherwise).")
      .def_prop_ro("host_page_bytes", [](PyTransferManager& p) { return p.get().host_space().page_bytes(); })
      .def(
          "host_page",
          [](PyTransferManager& p, std::int64_t block) {
            const BlockSpace& hs = p.get().host_space();
            if (hs.page_bytes() == 0)
              raise_status(FailedPrecondition("the host cache is not page-first (from_pages managers only)"));
            if (block < 0 || static_cast<std::uint64_t>(block) >= hs.num_blocks())
              raise_status(OutOfRange(fmt::format("host block {} is not in [0, {})", block, hs.num_blocks())));
            return reinterpret_cast<std::uintptr_t>(hs.block_ptr(0, 0, static_cast<std::uint64_t>(block)));
          },
          "block"_a, "Address of host block `block`'s page (page-first host caches: from_pages).")
      .def_prop_ro("layout", [](PyTransferManager& p) { return p.layout.describe(); })
      .def_prop_ro("num_layers", [](PyTransferManager& p) { return p.layout.num_layers(); })
      .def_prop_ro("block_bytes", [](PyTransferManager& p) { return p.layout.total_block_bytes(); })
      .def_prop_ro("num_device_blocks", [](PyTransferManager& p) { return p.get().device_space().num_blocks(); })
      .def_prop_ro("num_host_blocks", [](PyTransferManager& p) { return p.get().host_space().num_blocks(); })
      .def(
          "evict",
          [](PyTransferManager& p, nb::handle device_blocks, nb::handle host_blocks, PyStream* after,
             nb::object on_done) {
            EvictOptions o;
            o.after = after ? after->stream.get() : nullptr;
            o.on_done = wrap_task_callback(std::move(on_done));
            auto d = to_ids(device_blocks, "device");
            auto h = to_ids(host_blocks, "host");
            Result<TaskId> id = Internal("not run");
            auto tm = p.hold();
            {
              GilReleased release;
              id = tm->evict_to_host_async(d, h, o);
            }
            return value_or_raise(std::move(id));
          },
          "device_blocks"_a.none(), "host_blocks"_a.none(), "after"_a = nb::none(), "on_done"_a = nb::none(),
          "device_blocks[i] -> host_blocks[i], every layer and role, after the work enqueued so far on `after` "
          "(default: the compute stream). Returns the task id at once. on_done(task, error_or_None).")
      .def(
          "load",
          [](PyTransferManager& p, nb::handle layers, nb::handle host_blocks, nb::handle device_blocks,
             nb::object on_layer, nb::object on_done) {
            LoadOptions o;
            auto layer_callable = callable_or_null(std::move(on_layer), "on_layer");
            o.on_layer = wrap_layer_callback(layer_callable);
            o.on_done = wrap_task_callback(std::move(on_done), layer_callable);
            auto l = to_layers(layers);
            auto h = to_ids(host_blocks, "host");
            auto d = to_ids(device_blocks, "device");
            Result<TaskId> id = Internal("not run");
            auto tm = p.hold();
            {
              GilReleased release;
              id = tm->load_layers_to_device_async(l, h, d, std::move(o));
            }
            return value_or_raise(std::move(id));
          },
          "layers"_a.none(), "host_blocks"_a.none(), "device_blocks"_a.none(), "on_layer"_a = nb::none(),
          "on_done"_a = nb::none(),
          "host_blocks[i] -> device_blocks[i] for `layers` in order ([]: all). on_layer(layer, error_or_None) once "
          "per layer when it is final.")
      .def(
          "record_device_access",
          [](PyTransferManager& p, nb::handle blocks, PyStream& stream, const std::string& access) {
            auto b = to_ids(blocks, "device");
            auto a = parse_access(access);
            auto tm = p.hold();
            check(released([&] { return tm->record_device_access(b, *stream.stream, a); }));
          },
          "device_blocks"_a, "stream"_a, "access"_a,
          "Declares that work enqueued so far on `stream` reads / writes / overwrites the blocks.")
      .def(
          "wait_for_layer",
          [](PyTransferManager& p, nb::handle task_arg, nb::handle layer_arg, PyStream& stream) {
            const TaskId task = u64_arg(task_arg, "task");
            const std::uint32_t layer = u32_arg(layer_arg, "layer");
            auto tm = p.hold();
            check(released([&] { return tm->wait_for_layer(task, layer, *stream.stream); }));
          },
          "task"_a, "layer"_a, "stream"_a, "`stream` waits on the device for the layer (no host blocking).")
      .def(
          "wait_layer_host",
          [](PyTransferManager& p, nb::handle task_arg, nb::handle layer_arg, std::optional<double> timeout) {
            const TaskId task = u64_arg(task_arg, "task");
            const std::uint32_t layer = u32_arg(layer_arg, "layer");
            auto tm = p.hold();
            check(wait_interruptible(to_timeout(timeout),
                                     [&](std::chrono::nanoseconds t) { return tm->wait_layer_host(task, layer, t); }));
          },
          "task"_a, "layer"_a, "timeout"_a = nb::none())
      .def(
          "wait",
          [](PyTransferManager& p, nb::handle task_arg, std::optional<double> timeout) {
            const TaskId task = u64_arg(task_arg, "task");
            auto tm = p.hold();
            check(
                wait_interruptible(to_timeout(timeout), [&](std::chrono::nanoseconds t) { return tm->wait(task, t); }));
          },
          "task"_a, "timeout"_a = nb::none(), "Blocks (GIL released) until the task is final; raises its error.")
      .def(
          "wait_all",
          [](PyTransferManager& p, std::optional<double> timeout) {
            auto tm = p.hold();
            check(released([&] { return tm->wait_all(to_timeout(timeout)); }));  // its target is taken per call
          },
          "timeout"_a = nb::none())
      .def(
          "wait_host_blocks_free",
          [](PyTransferManager& p, nb::handle blocks, std::optional<double> timeout) {
            auto b = to_ids(blocks, "host");
            auto tm = p.hold();
            check(released([&] { return tm->wait_host_blocks_free(b, to_timeout(timeout)); }));
          },
          "host_blocks"_a, "timeout"_a = nb::none())
      .def(
          "wait_device_blocks_free",
          [](PyTransferManager& p, nb::handle blocks, PyStream& stream) {
            auto b = to_ids(blocks, "device");
            auto tm = p.hold();
            check(released([&] { return tm->wait_device_blocks_free(b, *stream.stream); }));
          },
          "device_blocks"_a, "stream"_a)
      .def(
          "is_device_block_free",
          [](PyTransferManager& p, nb::handle block) {
            auto b = to_ids(
                std::vector<std::int64_t>{int_arg(block, "device block", 0, static_cast<std::int64_t>(kMaxBlockId))},
                "device");
            auto tm = p.hold();
            return value_or_raise(released([&] { return tm->is_device_block_free(b[0]); }));
          },
          "block"_a)
      .def(
          "is_host_block_free",
          [](PyTransferManager& p, nb::handle block) {
            auto b = to_ids(
                std::vector<std::int64_t>{int_arg(block, "host block", 0, static_cast<std::int64_t>(kMaxBlockId))},
                "host");
            auto tm = p.hold();
            return value_or_raise(released([&] { return tm->is_host_block_free(b[0]); }));
          },
          "block"_a)
      .def("task_info",
           [](PyTransferManager& p, nb::handle task_arg) {
             const TaskId task = u64_arg(task_arg, "task");
             Result<TaskInfo> info = Internal("not run");
             auto tm = p.hold();
             {
               GilReleased release;
               info = tm->task_info(task);
             }
             return task_info_dict(value_or_raise(std::move(info)));
           })
      .def("failed_blocks",
           [](PyTransferManager& p, nb::handle task_arg) {
             const TaskId task = u64_arg(task_arg, "task");
             Result<FailedBlocks> f = Internal("not run");
             auto tm = p.hold();
             {
               GilReleased release;
               f = tm->failed_blocks(task);
             }
             FailedBlocks v = value_or_raise(std::move(f));
             nb::dict d;
             d["device"] = v.device;
             d["host"] = v.host;
             return d;
           })
      .def("poll_completions",
           [](PyTransferManager& p) {
             std::vector<TaskCompletion> done;
             auto tm = p.hold();
             {
               GilReleased release;
               done = tm->poll_completions();
             }
             nb::list out;
             for (const auto& c : done) {
               nb::dict d;
               d["task"] = c.id;
               d["kind"] = std::string(task_kind_name(c.kind));
               d["ok"] = c.status.ok();
               d["error"] = error_object(c.status);
               d["failed_device_blocks"] = c.failed.device;
               d["failed_host_blocks"] = c.failed.host;
               d["bytes"] = c.bytes;
               out.append(d);
             }
             return out;
           })
      .def("stats",
           [](PyTransferManager& p) {
             std::string json;
             auto tm = p.hold();
             {
               GilReleased release;
               json = tm->stats().to_json();
             }
             return parse_json(json);
           })
      .def(
          "attach_metrics",
          [](PyTransferManager& p, const nb::dict& labels) {
            check(p.get().attach_metrics(metrics::default_registry(), labels_from(labels)));
          },
          "labels"_a = nb::dict(),
          "Exports this manager's series (tasks, bytes, blocks, failures, in-flight, latency histograms) into "
          "kvtier's process registry (kvtier.metrics), every series carrying `labels`.")
      .def_prop_ro(
          "input_stream_handle",
          [](PyTransferManager& p) { return reinterpret_cast<std::uintptr_t>(p.get().input_stream().native_handle()); })
      .def(
          "shutdown",
          [](PyTransferManager& p) {
            if (!p.mgr) return;
            const std::shared_ptr<TransferManager> tm = p.hold();
            Status st;
            {
              GilReleased release;
              st = tm->shutdown();
            }
            check(st);
          },
          "Drains and stops (idempotent; GIL released). Submits afterwards raise FailedPreconditionError.")
      .def("close", &PyTransferManager::close, "shutdown() and release the engine memory (idempotent).");
}

}  // namespace kvtier::python
