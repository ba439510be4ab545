// The Python objects of kvtier's CacheManager and TransferManager, shared by the bindings that take them
// (cache, transfer, and the P/D receiver that drives both).
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/backend/device.h"
#include "kvtier/cache/cache_manager.h"
#include "kvtier/copy/copy_engine.h"
#include "kvtier/core/layout.h"
#include "kvtier/transfer/transfer_manager.h"
#include "status_bridge.h"

namespace kvtier::python {

struct PyCacheManager {
  PyCallMutex mu;  // every call of cm
  std::unique_ptr<cache::CacheManager> cm;
};

// Block checksums of a manager's device blocks computed on its device (TransferManager.device_checksums): an engine
// of their own and scratch memory for the sums, grown as needed.
//
// A call whose wait fails (its timeout passed) leaves its checksum kernel and read-back queued on the caller's
// stream: their scratch is retired, never reused or freed under them (a later call on another stream read another
// call's sums; a larger call freed the memory a queued copy still wrote). A retired pair is freed once an event
// recorded behind its work has completed, and left allocated for good when that cannot be proven.
struct DeviceChecksums {
  struct Scratch {
    Buffer sums;                         // device memory, 8 bytes per block
    std::unique_ptr<PinnedMemory> host;  // where they are read back
    std::unique_ptr<Event> done;         // retired: recorded behind the work that uses them
  };
  std::mutex mu;
  std::unique_ptr<CopyEngine> engine;
  Device* device = nullptr;  // the manager's, set with the engine
  Scratch scratch;
  std::vector<Scratch> retired;

  // Frees the retired scratch whose work is over (under mu).
  void sweep() {
    std::erase_if(retired, [this](Scratch& r) {
      auto over = device->query(*r.done);
      return over.ok() && *over;
    });
  }
  // Retires the current scratch behind what is queued on `stream` (under mu). If no event can be recorded there,
  // the memory is never freed: nothing proves the queued work is over.
  void retire(Stream& stream) {
    Scratch r = std::move(scratch);
    scratch = Scratch{};
    auto ev = device->create_event(EventOptions{});
    if (ev.ok() && device->record(**ev, stream).ok()) {
      r.done = std::move(ev).value();
      retired.push_back(std::move(r));
    } else {
      ev.status().ignore_error();
      new Scratch(std::move(r));  // deliberately leaked
    }
  }
  ~DeviceChecksums() {
    if (device == nullptr) return;
    sweep();
    for (Scratch& r : retired) new Scratch(std::move(r));  // still in use by queued work: leaked, never freed
  }
};

struct PyTransferManager {
  // Destroyed in reverse order: the manager (after shutdown) first, then the
  // host registrations and device adoptions it used, then the Python refs.
  nanobind::object device_ref;
  nanobind::object compute_ref;
  nanobind::list keep_alive;  // the engine's tensors
  std::vector<Buffer> adopted_device;
  std::vector<std::unique_ptr<PinnedMemory>> host_registrations;
  std::shared_ptr<PinnedMemory> host_memory;  // from_pages: the host cache, shared with a manager that replaces it
  // Shared with the calls running on it with the GIL released: close() from another thread drops this reference
  // and shuts the manager down (those calls then fail cleanly), and the last call to return frees it.
  std::shared_ptr<TransferManager> mgr;
  // A manager whose shutdown timed out (close()): destroyed with this object, before the device and the compute
  // stream its streams belong to (members go in reverse order), not while copies may still be queued on them.
  std::shared_ptr<TransferManager> retired;
  std::unique_ptr<DeviceChecksums> checksums;  // created on first use; destroyed before the device it uses
  KvLayout layout;
  // kvtier.pd.Receiver objects driving this manager: it cannot be closed under them.
  std::atomic<int> receivers{0};

  MadeInProcess made;
  ~PyTransferManager() {
    if (made.in_child()) {
      leak_in_child(mgr);
      leak_in_child(retired);
      leak_in_child(checksums);
      leak_in_child(host_registrations);
      leak_in_child(host_memory);
      leak_in_child(adopted_device);
      return;
    }
    shutdown(/*from_close=*/false);
    // A manager whose shutdown timed out waits for its streams' work as it goes (the host backend drains them):
    // without the GIL, so every other Python thread does not stop meanwhile (15.8 s of a frozen interpreter for
    // 8 s copies). Not while the interpreter finalizes (as ~PyStream).
    const bool finalizing = interpreter_finalizing();
    if (retired && PyGILState_Check() && !finalizing) {
      GilReleased release;
      retired.reset();
    }
  }
  void close() {
    made.check("the TransferManager");
    if (receivers.load() > 0)
      raise_status(FailedPrecondition("the TransferManager drives a kvtier.pd.Receiver: close the receiver first"));
    shutdown(/*from_close=*/true);
  }
  // The manager refuses to shut down from one of its callbacks (FailedPrecondition: shutting down joins the
  // thread that runs them), and dropping its last reference there destroyed it under that thread (std::terminate:
  // a joinable thread destroyed). close() then raises and keeps the manager; a Python object collected inside a
  // callback hands the manager to a thread of its own, which shuts it down once the callback has returned.
  void shutdown(bool from_close) {
    release_deferred();
    std::shared_ptr<TransferManager> m = std::move(mgr);
    if (!m) return;
    Status s;
    {
      GilReleased release;  // callbacks in flight need the GIL to finish
      s = m->shutdown();
    }
    if (s.code() == StatusCode::kFailedPrecondition) {
      if (from_close) {
        mgr = std::move(m);
        raise_status(s);
      }
      // The memory the manager copies into goes with it (the host cache is the binding's since from_pages shares
      // it): freed after its shutdown, not under copies still in flight. So do the engine's tensors (copies still
      // queued write them: they were released with this object, a use after free) and the device and compute
      // stream that its streams belong to: the thread hands their references back once the manager is gone, and
      // the next release_deferred() drops them with the GIL.
      PyObject* tensors = keep_alive.release().ptr();
      PyObject* device = device_ref.release().ptr();
      PyObject* compute = compute_ref.release().ptr();
      keep_alive = nanobind::list();
      std::thread([m = std::move(m), host = host_memory, regs = std::move(host_registrations),
                   adopted = std::move(adopted_device), tensors, device, compute]() mutable {
        m->shutdown().ignore_error();
        m.reset();
        regs.clear();
        host.reset();
        adopted.clear();
        defer_release(tensors);
        defer_release(device);
        defer_release(compute);
      }).detach();
      return;
    }
    if (!s.ok()) {
      // The streams did not drain within transfer.shutdown_timeout: copies may still read or write the host cache,
      // the registered host memory, the adopted device memory and the engine's tensors, so none of it is freed
      // (as the manager keeps its own host memory then). The manager is kept (`retired`) and destroyed with this
      // object, before the device and stream it uses: destroying its streams waits for their work, which close()
      // does not, so that it keeps its deadline. close() raises.
      if (host_memory) new std::shared_ptr<PinnedMemory>(std::move(host_memory));  // never released
      for (auto& r : host_registrations) (void)r.release();
      host_registrations.clear();
      for (auto& b : adopted_device) new Buffer(std::move(b));  // never released
      adopted_device.clear();
      if (checksums) (void)checksums.release();
      keep_alive.inc_ref();  // the engine's tensors stay referenced for the process's life
      keep_alive = nanobind::list();
      retired = std::move(m);
      if (from_close)
        raise_status(s.with_context("TransferManager.close: its memory is kept (transfers may still use it)"));
      return;
    }
    // close() promises the engine's memory back: once no call holds the manager any more (one that does ends
    // with it; the destructor frees the rest then), what it used goes now, not when Python drops this object.
    const bool last = m.use_count() == 1;
    {
      GilReleased release;
      m.reset();
      if (from_close && last) {
        checksums.reset();
        host_registrations.clear();
        host_memory.reset();
        adopted_device.clear();
      }
    }
    if (from_close && last) keep_alive.clear();  // the engine's tensors, last (with the GIL)
  }
  // With the GIL held (it raises): for calls that use the manager without releasing the GIL.
  TransferManager& get() { return *hold(); }
  // With the GIL held (it raises): the reference a call keeps while it runs with the GIL released.
  std::shared_ptr<TransferManager> hold() {
    made.check("the TransferManager");
    if (!mgr) raise_status(FailedPrecondition("the TransferManager was closed"));
    return mgr;
  }
};

// Keys as 32 hex digits each (InvalidArgument naming the index of a bad one).
std::vector<cache::BlockKey> block_keys_from_hex(const std::vector<std::string>& hex);

}  // namespace kvtier::python
