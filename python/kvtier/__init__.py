"""kvtier: paged KV-cache blocks between GPU memory, pinned host memory and storage.

Native API (kvtier._native, C++ underneath; contracts in include/kvtier/):

- devices: :func:`cuda_device`, :func:`host_device` (device memory in RAM: CI, tests);
  ``Device.create_stream()``, ``Device.adopt_stream(handle)`` (the engine's own stream,
  never destroyed by kvtier), ``Device.synchronize(stream, timeout)``;
- :class:`TransferManager` (``TransferManager.from_tensors``): evictions and layer-wise
  loads on side streams, on the engine's own tensors (DLPack: torch, numpy, cupy, paddle)
  and host memory (integer pointers); GPU-side layer waits (``wait_for_layer``), host
  waits with timeouts, hazards per block, per-task status, stats as dicts;
- :class:`CacheManager` (match, admit, take_plan, ack, commit, release, stats),
  :class:`KeyHasher` (namespaced chained block keys), :class:`StorageBackend`
  (``StorageBackend.open("disk:/path")`` or ``"redis://host:port"``; batches ``exists_many``,
  ``get_many``, ``put_many``, ``delete_many`` on borrowed buffers);
- :class:`HybridCache`: hybrid models' KV groups (full attention, sliding window, Mamba / linear-attention
  state), one CacheManager per group; a prefix hits only as far as every group serves it, admission is all
  or nothing, plans / acks / KV events per group;
- :mod:`kvtier.errors`: exceptions carrying the status code and message;
- :mod:`kvtier.metrics`: kvtier's metrics registry for ``prometheus_client`` (``KvtierCollector``),
  as text, or on kvtier's own ``/metrics``; ``attach_metrics(labels)`` on the managers; KV events
  (``CacheManager.enable_kv_events`` / ``take_events`` / ``publish_events`` on a ``KvEventPublisher``);
- :mod:`kvtier.fastdeploy`: ``CacheTransferManager``, a drop-in for FastDeploy's class (its
  transfer-connector slot holds kvtier's prefill/decode);
- :mod:`kvtier.sglang`: ``HiCacheKvtier``, an SGLang HiCache storage backend (L3) on kvtier's disk and
  Redis tiers (``--hicache-storage-backend dynamic``; docs/engines.md);
- :mod:`kvtier.vllm`: ``KvtierOffloadingSpec``, vLLM's native KV offloading (``OffloadingConnector``) on kvtier's
  disk and Redis tiers (``spec_module_path: kvtier.vllm``; docs/engines.md; imports vLLM, so not imported here);
- :mod:`kvtier.pd`: prefill/decode KV transfer between instances (``Prefill``, ``Decode``):
  metadata as bytes, push or pull, per-layer waits, byte-verified blocks.

kvtier's own log lines (storage backends' warnings, ...) go to the ``kvtier.<component>``
loggers of :mod:`logging`; :func:`set_log_level` sets kvtier's level (``KVTIER_LOG_LEVEL``).

Blocking calls release the GIL. Callbacks run on a kvtier thread with the GIL held for
the call; an exception they raise is logged to the ``kvtier`` logger (and counted by
:func:`callback_errors`), never lost and never fatal.
"""

from __future__ import annotations

import os as _os


def _keep_ucx_to_the_wheels_own() -> None:
    """The wheel carries its own UCX (``kvtier.libs/libucs-*.so``, renamed by auditwheel). UCX loads its transport
    modules from the directory compiled into it, the build machine's (``/usr/lib/x86_64-linux-gnu/ucx`` on Debian);
    where that directory exists those modules, linked against the system's UCX, would bring a second UCX into the
    process. Unless the user chose a module directory, UCX is pointed at ``kvtier.libs``, which holds none: the
    wheel's UCX keeps what it carries (tcp, shared memory, self)."""
    if "UCX_MODULE_DIR" in _os.environ:
        return
    libs = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kvtier.libs")
    try:
        bundled = any(n.startswith("libucs-") for n in _os.listdir(libs))
    except OSError:
        return  # not a wheel: a source build uses the system's UCX and its modules
    if bundled:
        _os.environ["UCX_MODULE_DIR"] = libs


_keep_ucx_to_the_wheels_own()

from . import errors  # noqa: E402
from ._native import (  # noqa: F401,E402
    log_level,
    set_log_level,
    Device,
    Stream,
    TransferManager,
    callback_errors,
    cuda_compiled,
    cuda_device,
    cuda_device_count,
    host_device,
    transfer_config_knobs,
)
from . import _native
from .errors import *  # noqa: F401,F403

if _native.has_cache:  # built with the cache and storage bindings (KVTIER_PYTHON_CACHE)
    from ._native import CacheManager, HybridCache, KeyHasher, StorageBackend  # noqa: F401

_native._register_errors(errors.CLASS_BY_CODE)

from . import _logging  # noqa: E402
from . import metrics  # noqa: E402,F401
from . import pd  # noqa: E402,F401

_logging.install()  # kvtier's C++ log lines go to the "kvtier.<component>" loggers


def _warn_about_unrecognized_settings() -> None:
    """A misspelt KVTIER_* setting would otherwise be ignored silently: each one is logged once, at import."""
    if not hasattr(_native, "unrecognized_env"):
        return  # built without the cache bindings
    import logging

    for message in _native.unrecognized_env():
        logging.getLogger("kvtier.config").warning("%s", message)


_warn_about_unrecognized_settings()

__version__ = "0.1.0"


def open_device(prefer_cuda: bool = True, ordinal: int = 0) -> Device:
    """A CUDA device when one is visible (and ``prefer_cuda``), else the host backend."""
    if isinstance(prefer_cuda, str) or prefer_cuda not in (True, False):
        raise errors.InvalidArgumentError(f"prefer_cuda {prefer_cuda!r} is a {type(prefer_cuda).__name__}, not a bool")
    if isinstance(ordinal, bool) or not hasattr(type(ordinal), "__index__") or int(ordinal) < 0:
        raise errors.InvalidArgumentError(f"ordinal {ordinal!r} is not a device ordinal (an integer, 0 or more)")
    ordinal = int(ordinal)
    if prefer_cuda and cuda_compiled() and cuda_device_count() > ordinal:
        return cuda_device(ordinal)
    return host_device()
