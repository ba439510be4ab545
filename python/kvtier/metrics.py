"""kvtier's metrics for Prometheus, and KV events for cache-aware routers.

kvtier keeps one metrics registry per process, in C++ (``include/kvtier/metrics/registry.h``).
A manager joins it with ``attach_metrics(labels)``: ``TransferManager.attach_metrics``,
``CacheManager.attach_metrics`` (the FastDeploy drop-in attaches its manager by default).
The series (``kvtier_transfer_*``, ``kvtier_cache_*``, ``kvtier_storage_*``) are listed in
``docs/observability.md``.

Three ways to serve them:

- into an engine's own ``prometheus_client`` registry (the engine already serves ``/metrics``)::

      from kvtier.metrics import KvtierCollector
      prometheus_client.REGISTRY.register(KvtierCollector())

  (``register()`` does this, once per process);
- as text: :func:`text` (Prometheus text format 0.0.4);
- kvtier's own endpoint: :func:`start_http_server` (``127.0.0.1:port/metrics``, a native thread).

KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``):
``CacheManager.enable_kv_events(block_size)``, then per step either ``take_events()`` (dicts)
or ``publish_events(publisher)`` with a :class:`KvEventPublisher` (ZMQ PUB, the wire format of
vLLM's ``ZmqEventPublisher``, with a replay socket for subscribers that reconnect).
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional

from . import _native

KvEventPublisher = _native.KvEventPublisher
MetricsServer = _native.MetricsServer
zmq_available = _native.zmq_available


def snapshot() -> list:
    """The process registry's families as dicts (name, help, type, bounds, series)."""
    return _native.metrics_snapshot()


def text() -> str:
    """The process registry as Prometheus text exposition (format 0.0.4)."""
    return _native.metrics_text()


def start_http_server(port: int = 0) -> MetricsServer:
    """Serves the registry on ``127.0.0.1:port/metrics`` (0: an ephemeral port, see ``.port``)."""
    return MetricsServer.start(port)


class KvtierCollector:
    """A ``prometheus_client`` collector of kvtier's registry: every scrape of the engine's
    registry reads kvtier's series at that moment (counters, gauges, histograms, with their
    labels). Needs ``prometheus_client`` (``pip install kvtier[metrics]``)."""

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        self._families = {
            "counter": CounterMetricFamily,
            "gauge": GaugeMetricFamily,
            "histogram": HistogramMetricFamily,
        }

    def describe(self) -> list:
        # No fixed description: series appear as managers attach. prometheus_client then
        # skips the duplicate-name check for this collector, which is what we want.
        return []

    def collect(self) -> Iterator[object]:
        for fam in snapshot():
            cls = self._families[fam["type"]]
            label_names = list(fam["series"][0]["labels"].keys()) if fam["series"] else []
            m = cls(fam["name"], fam["help"], labels=label_names)
            for s in fam["series"]:
                values = [s["labels"][k] for k in label_names]
                if fam["type"] == "histogram":
                    bounds = [_le(b) for b in fam["bounds"]] + ["+Inf"]
                    m.add_metric(values, buckets=list(zip(bounds, s["buckets"])), sum_value=s["sum"])
                else:
                    m.add_metric(values, s["value"])
            yield m


def _le(bound: float) -> str:
    return repr(float(bound))


_registered_lock = threading.Lock()
_registered: Optional[KvtierCollector] = None


def register(registry=None) -> KvtierCollector:
    """Registers one :class:`KvtierCollector` with ``registry`` (default: ``prometheus_client.REGISTRY``).
    Idempotent for the default registry."""
    global _registered
    import prometheus_client

    if registry is None or registry is prometheus_client.REGISTRY:
        with _registered_lock:
            if _registered is None:
                _registered = KvtierCollector()
                prometheus_client.REGISTRY.register(_registered)
            return _registered
    c = KvtierCollector()
    registry.register(c)
    return c


__all__ = [
    "KvEventPublisher",
    "KvtierCollector",
    "MetricsServer",
    "register",
    "snapshot",
    "start_http_server",
    "text",
    "zmq_available",
]
