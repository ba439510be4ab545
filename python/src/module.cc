// kvtier._native: the extension module behind the `kvtier` Python package.
// Python-facing API and its contract: python/kvtier/__init__.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "kvtier/core/config.h"
#include "kvtier/core/integration_config.h"
#include "kvtier/transfer/transfer_config.h"
#include "status_bridge.h"

namespace nb = nanobind;

extern char** environ;

namespace kvtier::python {
void bind_transfer(nb::module_& m);
void bind_cache(nb::module_& m);
void bind_log(nb::module_& m);
void bind_metrics(nb::module_& m);
void bind_pd(nb::module_& m);
void bind_pd_receiver(nb::module_& m);
}  // namespace kvtier::python

NB_MODULE(_native, m) {
  m.doc() = "kvtier native extension (see the kvtier package)";
  kvtier::python::g_main_thread_ident.store(
      nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident")));
  kvtier::python::bind_errors(m);
  kvtier::python::bind_transfer(m);
  kvtier::python::bind_log(m);
  kvtier::python::bind_metrics(m);
  kvtier::python::bind_pd(m);
  // References handed back by managers that a callback dropped (defer_release) are dropped at exit too, before
  // nanobind's leak check, which otherwise reported their device and stream as leaked.
  m.def("_release_deferred", [] { kvtier::python::release_deferred(); });
  // Registered first, so it runs after every later atexit hook (the user's, kvtier's own), while those may still
  // call kvtier from any thread; then no thread but the main one takes the GIL from C++ again (status_bridge.h).
  m.def("_close_gil_gate", [] { kvtier::python::gil_gate().close_for_exit(std::chrono::seconds(2)); });
  nb::module_::import_("atexit").attr("register")(m.attr("_close_gil_gate"));
  nb::module_::import_("atexit").attr("register")(m.attr("_release_deferred"));
#ifdef KVTIER_PYTHON_WITH_CACHE
  kvtier::python::bind_cache(m);
  kvtier::python::bind_pd_receiver(m);
  m.attr("has_cache") = true;
#else
  m.attr("has_cache") = false;
#endif
  m.def(
      "transfer_config_knobs",
      [] {
        kvtier::TransferManagerConfig cfg;
        kvtier::ConfigTable table;
        kvtier::bind_transfer_manager_config(table, cfg);
        nb::list out;
        for (const auto& k : table.describe()) {
          nb::dict d;
          d["name"] = k.name;
          d["env"] = k.env_var;
          d["type"] = k.type;
          d["default"] = k.default_value;
          d["doc"] = k.doc;
          out.append(d);
        }
        return out;
      },
      "The TransferManager's knobs (name, KVTIER_* env var, type, default, doc).");
  m.def(
      "integration_config",
      [] {
        // Read afresh on each call, as os.environ was: a process may set the variables after import.
        kvtier::IntegrationConfig c;
        kvtier::ConfigTable table;
        kvtier::bind_integration_config(table, c);
        kvtier::python::check(table.apply_env(environ));
        nb::dict d;
        d["fastdeploy.backend"] = c.fastdeploy_backend;
        d["fastdeploy.fence_evictions"] = c.fastdeploy_fence_evictions;
        d["fastdeploy.sync_timeout"] = c.fastdeploy_sync_timeout_s;
        d["fastdeploy.pd_role"] = c.fastdeploy_pd_role;
        d["fastdeploy.pd_secret"] = c.fastdeploy_pd_secret;
        d["fastdeploy.pd_transport"] = c.fastdeploy_pd_transport;
        d["fastdeploy.pd_tls"] = c.fastdeploy_pd_tls;
        d["fastdeploy.pd_net_devices"] = c.fastdeploy_pd_net_devices;
        d["metrics"] = c.metrics;
        return d;
      },
      "The engine integrations' knobs (fastdeploy.*, metrics) from the KVTIER_* environment, typed; "
      "InvalidArgumentError naming a bad value.");
}
