// kvtier's metrics registry and KV event publisher for Python: the process
// registry as a snapshot (kvtier.metrics turns it into prometheus_client
// families) or as text exposition, the native /metrics server, and the ZMQ
// publisher of KV events in vLLM's schema. Every call that can wait on a
// kvtier lock (a scrape runs the managers' collect hooks) releases the GIL.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <string>
#include <vector>

#include "kvtier/metrics/http_server.h"
#include "kvtier/metrics/kv_events.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/metrics/zmq_publisher.h"
#include "metrics_bridge.h"
#include "status_bridge.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtier::python {

// A str as UTF-8 (a lone surrogate has none: nb::cast threw std::bad_cast, naming nothing).
std::string label_text(nb::handle s, const std::string& what) {
  Py_ssize_t n = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
  if (utf8 == nullptr) {
    PyErr_Clear();
    raise_status(InvalidArgument(fmt::format("metric label {}: not valid UTF-8 (a lone surrogate)", what)));
  }
  return std::string(utf8, static_cast<std::size_t>(n));
}

metrics::Labels labels_from(const nb::dict& d) {
  metrics::Labels out;
  for (auto [k, v] : d) {
    if (!nb::isinstance<nb::str>(k))
      raise_status(InvalidArgument(fmt::format("metric labels must map str to str: a key is a {} ({})",
                                               nb::inst_name(k).c_str(), nb::repr(k).c_str())));
    if (!nb::isinstance<nb::str>(v))
      raise_status(InvalidArgument(fmt::format("metric labels must map str to str: label {} is a {} ({})",
                                               nb::repr(k).c_str(), nb::inst_name(v).c_str(), nb::repr(v).c_str())));
    std::string name = label_text(k, "name");
    std::string value = label_text(v, fmt::format("'{}' value", name));
    out.emplace_back(std::move(name), std::move(value));
  }
  return out;
}

nb::bytes hash_bytes(const metrics::BlockHash& h) {
  char b[16];
  for (int i = 0; i < 8; ++i) {
    b[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    b[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return nb::bytes(b, 16);
}

nb::list events_to_python(const std::vector<metrics::KvEvent>& events) {
  nb::list out;
  for (const metrics::KvEvent& ev : events) {
    nb::dict d;
    if (const auto* s = std::get_if<metrics::BlockStored>(&ev)) {
      d["type"] = "BlockStored";
      nb::list hashes;
      for (const auto& h : s->block_hashes) hashes.append(hash_bytes(h));
      d["block_hashes"] = hashes;
      d["parent_block_hash"] = s->parent_block_hash ? nb::object(hash_bytes(*s->parent_block_hash)) : nb::none();
      d["token_ids"] = s->token_ids;
      d["block_size"] = s->block_size;
      d["lora_id"] = s->lora_id ? nb::object(nb::int_(*s->lora_id)) : nb::none();
      d["medium"] = s->medium ? nb::object(nb::str(std::string(metrics::medium_name(*s->medium)).c_str())) : nb::none();
    } else if (const auto* r = std::get_if<metrics::BlockRemoved>(&ev)) {
      d["type"] = "BlockRemoved";
      nb::list hashes;
      for (const auto& h : r->block_hashes) hashes.append(hash_bytes(h));
      d["block_hashes"] = hashes;
      d["medium"] = r->medium ? nb::object(nb::str(std::string(metrics::medium_name(*r->medium)).c_str())) : nb::none();
    } else {
      d["type"] = "AllBlocksCleared";
    }
    out.append(d);
  }
  return out;
}

namespace {

struct PyMetricsServer {
  std::unique_ptr<metrics::MetricsServer> server;
  MadeInProcess made;
  ~PyMetricsServer() {
    if (made.in_child()) leak_in_child(server);
  }
};

// Calls hold their own reference (taken with the GIL held), so a shutdown() on another thread, which drops
// the object's, never frees the publisher under them.
struct PyEventPublisher {
  std::shared_ptr<metrics::ZmqEventPublisher> pub;
  MadeInProcess made;
  ~PyEventPublisher() {
    if (made.in_child()) leak_in_child(pub);
  }
  std::shared_ptr<metrics::ZmqEventPublisher> get() {
    made.check("the KV event publisher");
    if (!pub) raise_status(FailedPrecondition("the KV event publisher was shut down"));
    return pub;
  }
};

nb::list snapshot_to_python(const std::vector<metrics::FamilySnapshot>& snap) {
  nb::list out;
  for (const auto& f : snap) {
    nb::dict fd;
    fd["name"] = f.name;
    fd["help"] = f.help;
    fd["type"] = std::string(metrics::metric_type_name(f.type));
    fd["bounds"] = f.bounds;
    nb::list series;
    for (const auto& s : f.series) {
      nb::dict sd;
      nb::dict labels;
      for (const auto& [k, v] : s.labels) labels[k.c_str()] = v;
      sd["labels"] = labels;
      sd["value"] = s.value;
      sd["buckets"] = s.buckets;
      sd["sum"] = s.sum;
      sd["count"] = s.count;
      series.append(sd);
    }
    fd["series"] = series;
    out.append(fd);
  }
  return out;
}

}  // namespace

void bind_metrics(nb::module_& m) {
  m.def(
      "metrics_snapshot",
      [] {
        std::vector<metrics::FamilySnapshot> snap;
        {
          GilReleased release;
          snap = metrics::default_registry().snapshot();
        }
        return snapshot_to_python(snap);
      },
      "The process registry's families: dicts of name, help, type, bounds and series (labels, value, cumulative "
      "buckets, sum, count).");
  m.def(
      "metrics_text",
      [] {
        GilReleased release;
        return metrics::default_registry().expose();
      },
      "The process registry as Prometheus text exposition (format 0.0.4).");

  nb::class_<PyMetricsServer>(m, "MetricsServer", "kvtier's own /metrics endpoint on 127.0.0.1 (a thread).")
      .def_static(
          "start",
          [](IntArg port) {
            auto p = std::make_unique<PyMetricsServer>();
            const auto number = static_cast<std::uint16_t>(port.in("port", 0, UINT16_MAX));
            p->server = value_or_raise(metrics::MetricsServer::start(metrics::default_registry(), number));
            return p;
          },
          "port"_a = 0, "Serves the process registry on 127.0.0.1:port (0: an ephemeral port).")
      .def_prop_ro("port", [](PyMetricsServer& p) { return p.server ? p.server->port() : 0; })
      .def("stop", [](PyMetricsServer& p) {
        p.made.check("the metrics server");
        // Taken with the GIL held: two threads stopping at once (or one reading .port) each saw the old pointer.
        auto server = std::move(p.server);
        GilReleased release;
        server.reset();
      });

  nb::class_<PyEventPublisher>(m, "KvEventPublisher",
                               "Publishes KV event batches on ZMQ as vLLM's ZmqEventPublisher does "
                               "(include/kvtier/metrics/zmq_publisher.h).")
      .def(
          "__init__",
          [](PyEventPublisher* self, const std::string& endpoint, const std::string& replay_endpoint,
             const std::string& topic, IntArg buffer_steps, nb::handle data_parallel_rank,
             const std::string& encoding) {
            metrics::ZmqPublisherOptions o;
            o.encoding = value_or_raise(metrics::parse_event_encoding(encoding));
            o.endpoint = endpoint;
            o.replay_endpoint = replay_endpoint;
            o.topic = topic;
            o.buffer_steps = buffer_steps.u64("buffer_steps");
            if (!data_parallel_rank.is_none())
              o.data_parallel_rank = int_arg(data_parallel_rank, "data_parallel_rank", 0, INT64_MAX);
            new (self) PyEventPublisher();
            self->pub = value_or_raise(metrics::ZmqEventPublisher::create(std::move(o)));
          },
          "endpoint"_a = "tcp://127.0.0.1:5557", "replay_endpoint"_a = "", "topic"_a = "", "buffer_steps"_a = 10000,
          "data_parallel_rank"_a = nb::none(), "encoding"_a = "map",
          "encoding: 'map' (each event a tagged map, as vLLM 0.34 writes them; the default) or 'array' (the "
          "array_like events of earlier vLLM releases).")
      .def_prop_ro("endpoint", [](PyEventPublisher& p) { return p.get()->endpoint(); })
      .def_prop_ro("replay_endpoint", [](PyEventPublisher& p) { return p.get()->replay_endpoint(); })
      .def(
          "flush",
          [](PyEventPublisher& p, double timeout) {
            const auto pub = p.get();
            const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(to_timeout(timeout));
            Status st;
            {
              GilReleased release;
              st = pub->flush(limit);
            }
            check(st);
          },
          "timeout"_a = 5.0)
      .def(
          "shutdown",
          [](PyEventPublisher& p, double timeout) {
            // The timeout checked first: a bad one (NaN) must not leave the publisher taken and not shut down.
            const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(to_timeout(timeout));
            p.made.check("the KV event publisher");
            // Taken out with the GIL held: a second caller finds it gone and returns.
            const std::shared_ptr<metrics::ZmqEventPublisher> pub = std::move(p.pub);
            if (!pub) return;
            Status st;
            {
              GilReleased release;
              st = pub->shutdown(limit);
            }
            check(st);
          },
          "timeout"_a = 2.0);
  m.def(
      "decode_kv_event_batch",
      [](nb::bytes payload) {
        auto b = metrics::decode_msgpack(std::string_view(payload.c_str(), payload.size()));
        if (!b.ok()) raise_status(b.status());
        nb::dict d;
        d["ts"] = b->ts;
        d["events"] = events_to_python(b->events);
        d["data_parallel_rank"] = b->data_parallel_rank ? nb::object(nb::int_(*b->data_parallel_rank)) : nb::none();
        return d;
      },
      "payload"_a,
      "A KV event batch's msgpack payload (the third ZMQ frame) as a dict: ts, events, "
      "data_parallel_rank. DataLossError for bytes that are not such a batch.");
  m.def(
      "zmq_available", [] { return metrics::zmq_available(); }, "Whether libzmq.so.5 could be loaded.");
}

std::shared_ptr<metrics::ZmqEventPublisher> publisher_of(nb::handle h) {
  if (!nb::isinstance<PyEventPublisher>(h))
    raise_status(InvalidArgument(fmt::format("publisher is a {}, not a kvtier.metrics.KvEventPublisher",
                                             nb::cast<std::string>(nb::str(h.type().attr("__name__"))))));
  return nb::cast<PyEventPublisher&>(h).get();
}

}  // namespace kvtier::python
