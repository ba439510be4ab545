// Shared by the bindings that attach managers to the registry or hand over KV events.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <vector>

#include "kvtier/metrics/kv_events.h"
#include "kvtier/metrics/registry.h"
#include "kvtier/metrics/zmq_publisher.h"

namespace kvtier::python {

// {"rank": "0", ...} -> registry labels; InvalidArgumentError for non-str keys or values.
metrics::Labels labels_from(const nanobind::dict& d);
// Events as dicts in vLLM's field names; block hashes as 16 bytes (hi then lo, big-endian).
nanobind::list events_to_python(const std::vector<metrics::KvEvent>& events);
// The native publisher behind a KvEventPublisher object (FailedPreconditionError after shutdown).
std::shared_ptr<metrics::ZmqEventPublisher> publisher_of(nanobind::handle publisher);

}  // namespace kvtier::python
