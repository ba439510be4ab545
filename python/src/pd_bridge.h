// The native side of kvtier.pd's endpoints, shared by the bindings that take an endpoint (pd, pd receiver).
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device_bridge.h"
#include "kvtier/backend/transport.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/transport/pd.h"
#include "kvtier/transport/pd_staged.h"
#include "status_bridge.h"

namespace kvtier::python {

namespace nb = nanobind;

struct EndpointOptions {
  std::string role;       // prefill | decode
  std::string transport;  // loopback | ipc | ucx
  std::string name;
  std::string peer_secret;
  std::string tls;
  std::string net_devices;
  double heartbeat_s = 0.1;
  double request_wait_s = 60.0;  // PdOptions::request_wait (the prefill side's wait for a request after begin())
  double lease_s = 1.0;
  std::uint32_t num_model_layers = 0;
  int rank = 0;
  int device_label = 0;
  std::uint32_t block_tokens = 64;
  std::uint64_t staging_blocks = 0;  // staged only; 0: as many as the device space has
  // "auto": host memory without a device, staged with one; "direct": the device lane of pd.h (device memory,
  // the peer's pool mapped here: ipc between CUDA processes, loopback in one process); "ring": the ring lane of
  // pd.h (device memory, through the decode's shared pinned ring: GPUs that cannot map each other's pools).
  std::string lane = "auto";
  // The device lane's second checksum pass (PdOptions::lane_verify): "mover" or "receiver".
  std::string verify = "mover";
  // How this side reads back a layer it moved when the mover verifies (PdOptions::lane_read_back_in_copy):
  // "copy" (inside the copy kernel) or "pass" (a separate read-only pass).
  std::string read_back = "copy";
  // The ring lane (the decode's values are used): slots, bytes per slot, the copies' strategy.
  std::uint32_t ring_slots = 4;
  std::uint64_t ring_slot_bytes = std::uint64_t{32} << 20;
  std::string ring_copy = "auto";
};

// Everything native of one endpoint. Shared by the Python object and the calls in flight (which hold a
// reference while the GIL is released), so close() from one thread never frees what another thread's wait uses:
// the last holder tears it down.
struct PdNative {
  nb::object device_ref;  // the PyDevice (staged), or None
  nb::object keep_alive;  // a list of the engine's tensors
  std::vector<Buffer> adopted_device;
  KvLayout layout;
  BlockSpace space;
  std::optional<transport::StagingSpace> staging;
  std::unique_ptr<CopyEngine> engine;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<transport::PdPrefill> prefill;
  std::unique_ptr<transport::PdDecode> decode;
  std::unique_ptr<transport::PdStagedPrefill> staged_prefill;
  std::unique_ptr<transport::PdStagedDecode> staged_decode;
  // The host direct lane: the pool this endpoint allocated in its transport's memory (the peer maps it), one entry
  // per engine tensor, shaped as the tensor it was copied from (PdEndpoint.kv_pool()).
  struct PoolTensor {
    std::string name;
    std::byte* data = nullptr;
    std::vector<std::size_t> shape;
    std::vector<std::int64_t> strides;
    nb::dlpack::dtype dtype;
  };
  std::vector<PoolTensor> pool;
  // kv_pool() arrays alive. Each holds a reference to this state for the transport's memory it views; they are not
  // calls in flight: close() stops the protocol under them (close_protocol) and leaves them the memory, which goes
  // with the transport once the last of them is gone. Counted up after the array's reference is taken and down
  // before it is dropped, so it never exceeds the references they hold.
  std::atomic<int> pool_arrays{0};

  Device* device() const { return device_ref.is_none() ? nullptr : &nb::cast<PyDevice&>(device_ref).get(); }

  // Every wait in flight on this endpoint returns now (FailedPrecondition), and every later one.
  void abort_waits() {
    if (prefill) prefill->abort_waits();
    if (decode) decode->abort_waits();
    if (staged_prefill) staged_prefill->abort_waits();
    if (staged_decode) staged_decode->abort_waits();
  }

  // Ends the protocol: its progress threads stop, transfers that are not final fail at the peers (pd.h, closing), and
  // nothing of this side moves blocks any more. The transport, its memory and the copy engine stay until the
  // destructor. Only once no call is in flight.
  void close_protocol() {
    prefill.reset();
    decode.reset();
    staged_prefill.reset();
    staged_decode.reset();
  }

  // Endpoints first (their progress threads), then the copy engine, the staging (unpinned before the transport
  // that allocated its memory goes), the transport and the adoptions; the Python references last, under the GIL.
  ~PdNative() {
    prefill.reset();
    decode.reset();
    staged_prefill.reset();
    staged_decode.reset();
    engine.reset();
    staging.reset();
    transport.reset();
    adopted_device.clear();
    if (!device_ref.is_valid() && !keep_alive.is_valid()) return;
    if (!Py_IsInitialized()) {  // the interpreter is gone: leak rather than crash
      (void)device_ref.release();
      (void)keep_alive.release();
      return;
    }
    GilAcquired gil;
    if (!gil.held()) {  // the process is exiting: leak rather than take the GIL
      (void)device_ref.release();
      (void)keep_alive.release();
      return;
    }
    device_ref.reset();
    keep_alive.reset();
  }
};

struct PyPdEndpoint {
  EndpointOptions options;
  // Kept for after close().
  std::string backend;
  std::string layout;
  std::uint32_t num_layers = 0;
  std::uint64_t num_blocks = 0;
  std::uint64_t block_bytes = 0;
  bool staged = false;
  std::string lane;  // "host", "host-direct", "staged", "direct" or "ring"
  PyCallMutex mu;
  std::shared_ptr<PdNative> native;  // null once closed
  // kvtier.pd.Receiver objects driving this (decode) endpoint: it cannot be closed under them.
  std::atomic<int> receivers{0};

  MadeInProcess made;
  ~PyPdEndpoint() {
    if (made.in_child()) {
      leak_in_child(native);
      return;
    }
    close();
  }

  // Endpoint.close() from Python: refused while a Receiver drives the endpoint (it would keep the endpoint working
  // through its own reference, after a close that waited for it in vain).
  void close_checked() {
    if (!close(/*refuse_if_driven=*/true))
      raise_status(FailedPrecondition(
          fmt::format("the {} endpoint '{}' is driven by a kvtier.pd.Receiver: close the receiver first", options.role,
                      options.name)));
  }

  // False (nothing done) when `refuse_if_driven` and a Receiver drives the endpoint. A Receiver counts itself in
  // `receivers` before it takes the endpoint (get()), so one being created either is refused the endpoint or is
  // counted here.
  bool close(bool refuse_if_driven = false) {
    made.check(fmt::format("the {} endpoint '{}'", options.role, options.name));
    std::shared_ptr<PdNative> n;
    {
      auto lock = lock_gil_safe(mu);
      if (refuse_if_driven && native != nullptr && receivers.load() > 0) return false;
      n = std::move(native);
    }
    if (!n) return true;
    GilReleased release;  // teardown joins kvtier threads
    // Calls in flight on other threads hold their own reference (the GIL released): their waits return now, so
    // the teardown, which ends the transfers at the peers, happens here and not whenever the last of them would
    // have returned. Bounded: past it, the last holder tears down.
    // kv_pool() arrays hold references too, but they are not calls: the protocol ends under them.
    n->abort_waits();
    const auto calls_in_flight = [&] { return n.use_count() > 1 + n->pool_arrays.load(); };
    const auto deadline = std::chrono::steady_clock::now() + kCloseWaitForCalls;
    while (calls_in_flight() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // No new call can start (native is null), and the counts only fall.
    if (!calls_in_flight()) n->close_protocol();
    n.reset();
    return true;
  }
  static constexpr std::chrono::seconds kCloseWaitForCalls{10};

  std::shared_ptr<PdNative> get() {
    made.check(fmt::format("the {} endpoint '{}'", options.role, options.name));
    std::shared_ptr<PdNative> n;
    {
      auto lock = lock_gil_safe(mu);
      n = native;
    }
    // Raised after the mutex is released: raising runs Python code, which may hand the GIL to a thread that
    // then waits for the mutex.
    if (!n)
      raise_status(FailedPrecondition(fmt::format("the {} endpoint '{}' was closed", options.role, options.name)));
    return n;
  }
  bool is_prefill() const { return options.role == "prefill"; }
  std::shared_ptr<PdNative> get(const char* role, const char* method) {
    if (options.role != role)
      raise_status(FailedPrecondition(
          fmt::format("{}() is a {} call; '{}' is a {} endpoint", method, role, options.name, options.role)));
    return get();
  }
};

// A DecodeStatus as kvtier.pd reports it (a dict), and a mode name ("push" | "pull", else InvalidArgument).
nb::dict decode_status_dict(const transport::DecodeStatus& s);
transport::PdMode pd_mode_from(const std::string& mode);

}  // namespace kvtier::python
