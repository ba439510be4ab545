// kvtier._native: the extension module behind the `kvtier` Python package.
// Python-facing API and its contract: python/kvtier/__init__.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "kvtier/core/config.h"
#include "kvtier/transfer/transfer_config.h"
#include "status_bridge.h"

namespace nb = nanobind;

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
  kvtier::python::bind_errors(m);
  kvtier::python::bind_transfer(m);
  kvtier::python::bind_log(m);
  kvtier::python::bind_metrics(m);
  kvtier::python::bind_pd(m);
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
}
