"""A drop-in for FastDeploy's ``CacheTransferManager`` (cache_manager/v1/transfer_manager.py).

Same constructor, public methods, properties, argument names and return types as
FastDeploy's class, on the engine's own tensors and streams, with its defects fixed:

- real side streams: loads (host -> device) and evictions (device -> host) run on kvtier's
  input and output streams, ordered after the engine's current stream by events; nothing
  blocks the engine's stream or its launch thread;
- every role moves every way: K, V, fp8 scales (``key_cache_scales_*``), the DSA indexer,
  MLA (no V), draft (MTP) layers found in the map;
- hazards fenced: an evicted device block is not overwritten by the engine's later work
  before its copy read it (the engine's stream waits for it on the GPU; see
  ``KVTIER_FASTDEPLOY_FENCE_EVICTIONS``), a load waits for the engine's work enqueued so
  far on its blocks, host blocks are not rewritten while a load reads them;
- failures are never reported as done: a failed layer makes ``wait_for_layer`` /
  ``wait_layer_host`` / ``LayerEvent.synchronize`` fail, whatever loads of the layer came after it and after
  ``sync_input_stream()`` too, until the next step's first load (a load after a sync); where FastDeploy returns
  ``False`` this class returns ``False`` too and keeps the reason (``last_error``, logged
  once per distinct reason).

Added (what FastDeploy's callers need and its class lacks):

- ``wait_for_layer(layer_idx, stream=None)``: the forward pass calls it per layer on its
  *current* stream: a GPU-side wait (no host sync, usable before a CUDA-graph replay);
- ``wait_layer_host(layer_idx, timeout=1.0) -> bool``: the host-side wait;
- ``last_error`` (the reason of the last ``False``), ``transfer_manager`` (the native
  :class:`kvtier.TransferManager`), ``close()`` (drain and release; also on garbage
  collection);
- ``transfer_connector``: FastDeploy's transfer-connector slot (``self._transfer_connector =
  create_transfer_connector(self.cache_config)`` in its ``__init__``), filled by
  :class:`PdTransferConnector` (prefill/decode over :mod:`kvtier.pd` on the engine's KV
  tensors) when the instance is a prefill or decode instance, else None.

P/D (the transfer connector): FastDeploy's ``config.scheduler_config.splitwise_role``
(``prefill`` / ``decode`` / ``mixed``; ``KVTIER_FASTDEPLOY_PD_ROLE`` overrides it) picks the side;
``mixed`` or none means no connector. ``KVTIER_FASTDEPLOY_PD_TRANSPORT`` = ``ipc`` (default, same host) |
``ucx`` (``KVTIER_FASTDEPLOY_PD_TLS``, default ``tcp``; ``KVTIER_FASTDEPLOY_PD_NET_DEVICES``) |
``loopback`` (one process: tests); ``KVTIER_FASTDEPLOY_PD_SECRET`` = the peer secret in hex
(32 to 64 bytes, the same on both sides).

Environment: ``KVTIER_FASTDEPLOY_BACKEND`` = ``auto`` (default: CUDA for CUDA tensors, the
host backend for CPU arrays) | ``host`` | ``cuda``; ``KVTIER_FASTDEPLOY_FENCE_EVICTIONS`` =
``1`` (default) | ``0`` (the engine fences reuse itself); ``KVTIER_FASTDEPLOY_SYNC_TIMEOUT``
seconds for ``sync_*_stream`` (default 300); ``KVTIER_METRICS`` = ``1`` (default) | ``0`` (the
manager is not attached to :mod:`kvtier.metrics`); the ``KVTIER_TRANSFER_*`` knobs of
docs/configuration.md. These variables are knobs of kvtier's config table (``fastdeploy.*``,
``metrics``; ``kvtier info --config`` lists them): they are read through it, and a bad value raises
``InvalidArgumentError`` naming it.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional

from . import _native
from .errors import DataLossError, InvalidArgumentError, KvtierError, OutOfRangeError, TimedOutError

logger = logging.getLogger("kvtier.fastdeploy")

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3


def _knobs() -> Dict[str, Any]:
    """The ``fastdeploy.*`` and ``metrics`` knobs from the environment, typed, through kvtier's config table
    (read afresh on each call; a bad value raises ``InvalidArgumentError`` naming it)."""
    return _native.integration_config()


__all__ = ["CacheTransferManager", "LayerEvent", "PdTransferConnector", "create_transfer_connector"]


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _count_field(value: Any, name: str, section: str = "cache_config") -> int:
    """A count of FastDeploy's config (blocks, layers, tokens per block): None is 0; a string, float or negative
    number is refused here, naming it, rather than failing later inside a call with a bare TypeError (or, for a
    float, being cut to an integer without a word)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{section}.{name} is {value!r} ({type(value).__name__}), not an integer")
    if value < 0:
        raise InvalidArgumentError(f"{section}.{name} is {value}, not a count (0 or more)")
    return int(value)


def _kv_map(value: Any, what: str) -> Dict[str, Any]:
    """A cache map as the engine passes it: a mapping of tensor names; anything else is refused, naming its type."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{what}: {type(value).__name__} {value!r:.60}, not a mapping of names to tensors")
    return value


def _dlpack_device(t: Any):
    if hasattr(t, "__dlpack_device__"):
        kind, index = t.__dlpack_device__()
        return int(kind), int(index)
    return None


def _current_stream_handle(tensor: Any) -> int:
    """The engine's current CUDA stream on the tensor's device, as an integer handle."""
    mod = type(tensor).__module__
    if mod.startswith("torch"):
        import torch

        return int(torch.cuda.current_stream(tensor.device).cuda_stream)
    if mod.startswith("cupy"):
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if mod.startswith("paddle"):
        import paddle

        return int(paddle.device.current_stream().cuda_stream)
    return 0  # the legacy default stream


class LayerEvent:
    """What ``record_input_stream_event`` returns: the completion of one layer of a load.

    Unlike an event recorded on a stream, it cannot complete before the copy is even
    enqueued, and it reports failures.
    """

    def __init__(self, owner: "CacheTransferManager", mgr: Any, task: int, layer: int):
        # The native manager that runs the task: task ids start again in the manager that
        # set_cache_kvs_map() makes, so another one's task of the same id is not this load.
        self._owner, self._mgr, self.task, self.layer = owner, mgr, task, layer

    def _manager(self):
        if self._owner._mgr is not self._mgr:
            raise _error("FailedPrecondition", f"load task {self.task} layer {self.layer}: its transfer manager was "
                         "closed (set_cache_kvs_map() or close()), which drained its loads; the event is stale")
        return self._mgr

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Blocks until the layer is on the device (raises its error, or TimedOutError)."""
        self._manager().wait_layer_host(self.task, self.layer, timeout)

    def query(self) -> bool:
        info = self._manager().task_info(self.task)
        if self.layer not in info["layers"]:
            raise _error("InvalidArgument", f"load task {self.task} does not load layer {self.layer}")
        state = info["layer_states"][info["layers"].index(self.layer)]
        if state == "failed":
            self.synchronize(0)  # raises the layer's error
        return state == "done"

    @property
    def done(self) -> bool:
        return self.query()

    def wait(self, stream: Any = None) -> None:
        """Makes ``stream`` (default: the engine's current stream) wait for the layer on the GPU."""
        self._manager().wait_for_layer(self.task, self.layer, self._owner._stream_for(stream))


def _engine_defaults(device: Any, environ: Mapping[str, str]) -> Dict[str, str]:
    """Knob values the drop-in sets for an engine, unless the environment sets them.

    Loads on CUDA run as kvtier's copy kernel (``transfer.load_strategy = sm_kernel``): a layer-wise
    load overlaps the engine's forward, and the kernel (one launch per layer) leaves the driver to
    the engine's own launches, where the DMA strategies' many copy calls slowed an eager decode step
    by about a quarter on an H200 (docs/performance.md, "Python: the FastDeploy drop-in").
    """
    out: Dict[str, str] = {}
    if device is not None and device.backend == "cuda" and "KVTIER_TRANSFER_LOAD_STRATEGY" not in environ:
        out["transfer.load_strategy"] = "sm_kernel"
    return out


class CacheTransferManager:
    """KV cache transfer manager (FastDeploy's interface, kvtier underneath).

    H2D (load): layer by layer on kvtier's input stream, overlapping the forward.
    D2H (evict): all layers on kvtier's output stream, ordered after the engine's stream.
    """

    def __init__(self, config: Any, local_rank: int = 0, device_id: int = 0):
        self.config = config
        self.cache_config = config.cache_config
        self.quant_config = _attr(config, "quant_config")

        self._local_rank = local_rank
        self._device_id = device_id
        self._num_layers = _count_field(config.model_config.num_hidden_layers, "num_hidden_layers", "model_config")
        self._cache_dtype = self.cache_config.cache_dtype
        self._num_host_blocks = _count_field(_attr(self.cache_config, "num_cpu_blocks"), "num_cpu_blocks")
        self._block_tokens = _count_field(_attr(self.cache_config, "block_size", 64), "block_size") or 64

        self._lock = threading.RLock()
        self._cache_kvs_map: Dict[str, Any] = {}
        self._host_cache_kvs_map: Dict[str, Any] = {}
        self._device_key_caches: List[Any] = []
        self._device_value_caches: List[Any] = []
        self._device_key_scales: List[Any] = []
        self._device_value_scales: List[Any] = []
        self._host_key_ptrs: List[int] = []
        self._host_value_ptrs: List[int] = []
        self._host_key_scales_ptrs: List[int] = []
        self._host_value_scales_ptrs: List[int] = []

        self._device = None
        self._mgr = None
        self._closed = False  # close() is final: no call creates a manager again
        self._compute = None  # kvtier Stream over the engine's stream (host backend: kvtier's own)
        self._streams: Dict[int, Any] = {}  # adopted engine streams by handle
        self._registration = (0, 0, 0)  # num_layers, local_rank, device_id
        self._loads: List[int] = []
        self._evicts: List[int] = []
        # Host blocks an eviction that failed before the maps were registered again wrote (their bytes undefined):
        # the new native manager does not know them, so a load of one fails here until an eviction rewrites it.
        self._bad_host_blocks: Dict[int, str] = {}
        self._evict_hosts: Dict[int, List[int]] = {}  # eviction task -> its host blocks
        self._host_writer: Dict[int, int] = {}  # host block -> the last eviction task submitted into it
        # Host blocks whose last eviction failed, seen before the maps are registered again: the native manager
        # refuses loads of them itself; they join _bad_host_blocks when it goes.
        self._failed_hosts: Dict[int, str] = {}
        # Per layer, the loads not yet seen finished, in submission order: a wait covers all of them (a later
        # load of the layer does not make an earlier, failed one's blocks good).
        self._layer_tasks: Dict[int, List[int]] = {}
        # Layers a load of this step failed on, with the reason: their waits keep failing (after
        # sync_input_stream() too) until the next step's first load (a load submitted after a sync).
        self._failed_layers: Dict[int, str] = {}
        self._step_synced = False
        self._last_submitted: Optional[tuple] = None
        self._last_error: Optional[str] = None
        self._logged_errors: set = set()
        knobs = _knobs()
        self._fence_evictions = knobs["fastdeploy.fence_evictions"]
        self._sync_timeout = knobs["fastdeploy.sync_timeout"]

        # ============ Connectors ============
        self._transfer_connector = create_transfer_connector(
            self.cache_config, splitwise_role=_attr(_attr(config, "scheduler_config"), "splitwise_role"))

    # ============ Cache Map Setters ============

    @property
    def cache_kvs_map(self) -> Dict[str, Any]:
        return self._cache_kvs_map

    def set_cache_kvs_map(self, cache_kvs_map: Dict[str, Any]) -> None:
        """Shares the device KV tensor map: ``key_caches_{layer}_rank{r}.device{d}`` -> tensor, ..."""
        with self._lock:
            if self._closed:
                raise _error("FailedPrecondition", "set_cache_kvs_map: the CacheTransferManager was closed")
            cache_kvs_map = _kv_map(cache_kvs_map, "set_cache_kvs_map")
            self._close_manager()
            self._cache_kvs_map = cache_kvs_map
            self._build_device_layer_indices()
            if self._transfer_connector is not None:
                self._transfer_connector.register_kv_cache(cache_kvs_map, self._num_layers, self._local_rank,
                                                           self._device_id)

    def _name(self, prefix: str, layer: int) -> str:
        return f"{prefix}_{layer}_rank{self._local_rank}.device{self._device_id}"

    def _build_device_layer_indices(self) -> None:
        self._device_key_caches, self._device_value_caches = [], []
        self._device_key_scales, self._device_value_scales = [], []
        if not self._cache_kvs_map:
            return
        for layer in range(self._num_layers):
            self._device_key_caches.append(self._cache_kvs_map.get(self._name("key_caches", layer)))
            self._device_value_caches.append(self._cache_kvs_map.get(self._name("value_caches", layer)))
            if self._is_fp8_quantization():
                self._device_key_scales.append(self._cache_kvs_map.get(self._name("key_cache_scales", layer)))
                self._device_value_scales.append(self._cache_kvs_map.get(self._name("value_cache_scales", layer)))

    @property
    def host_cache_kvs_map(self) -> Dict[str, Any]:
        return self._host_cache_kvs_map

    def set_host_cache_kvs_map(self, host_cache_kvs_map: Dict[str, Any]) -> None:
        """Shares the host cache map: same names -> host pointers (int), ``num_cpu_blocks`` blocks each."""
        with self._lock:
            if self._closed:
                raise _error("FailedPrecondition", "set_host_cache_kvs_map: the CacheTransferManager was closed")
            host_cache_kvs_map = _kv_map(host_cache_kvs_map, "set_host_cache_kvs_map")
            self._close_manager()
            self._host_cache_kvs_map = host_cache_kvs_map
            self._build_host_layer_indices()

    def _build_host_layer_indices(self) -> None:
        if self._num_host_blocks <= 0 or not self._host_cache_kvs_map or self._num_layers == 0:
            return
        self._host_key_ptrs, self._host_value_ptrs = [], []
        self._host_key_scales_ptrs, self._host_value_scales_ptrs = [], []
        for layer in range(self._num_layers):
            self._host_key_ptrs.append(self._host_cache_kvs_map.get(self._name("key_caches", layer), 0))
            self._host_value_ptrs.append(self._host_cache_kvs_map.get(self._name("value_caches", layer), 0))
            if self._is_fp8_quantization():
                self._host_key_scales_ptrs.append(self._host_cache_kvs_map.get(self._name("key_cache_scales", layer), 0))
                self._host_value_scales_ptrs.append(
                    self._host_cache_kvs_map.get(self._name("value_cache_scales", layer), 0))

    # ============ Metadata Properties ============

    def _get_kv_cache_quant_type(self) -> Optional[str]:
        return _attr(self.quant_config, "kv_cache_quant_type")

    def _is_fp8_quantization(self, quant_type: Optional[str] = None) -> bool:
        if quant_type is None:
            quant_type = self._get_kv_cache_quant_type()
        return quant_type == "block_wise_fp8"

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def cache_dtype(self) -> str:
        return self._cache_dtype

    @property
    def has_cache_scale(self) -> bool:
        return self._is_fp8_quantization()

    @property
    def num_host_blocks(self) -> int:
        return self._num_host_blocks

    # ============ Layer Indexed Access ============

    def get_device_key_cache(self, layer_idx: int) -> Optional[Any]:
        if 0 <= layer_idx < len(self._device_key_caches):
            return self._device_key_caches[layer_idx]
        return None

    def get_device_value_cache(self, layer_idx: int) -> Optional[Any]:
        if 0 <= layer_idx < len(self._device_value_caches):
            return self._device_value_caches[layer_idx]
        return None

    def get_host_key_ptr(self, layer_idx: int) -> int:
        if self._num_host_blocks <= 0:
            return 0
        if 0 <= layer_idx < len(self._host_key_ptrs):
            return self._host_key_ptrs[layer_idx]
        return 0

    def get_host_value_ptr(self, layer_idx: int) -> int:
        if self._num_host_blocks <= 0:
            return 0
        if 0 <= layer_idx < len(self._host_value_ptrs):
            return self._host_value_ptrs[layer_idx]
        return 0

    # ============ kvtier plumbing ============

    def _fail(self, reason: str) -> bool:
        """FastDeploy returns False: so do we, keeping the reason (logged once per reason)."""
        self._last_error = reason
        if reason not in self._logged_errors:
            self._logged_errors.add(reason)
            logger.error("[CacheTransferManager] %s", reason)
        return False

    @property
    def last_error(self) -> Optional[str]:
        """Why the last call returned False (or a sync failed); None when none did."""
        return self._last_error

    @property
    def transfer_connector(self) -> Optional["PdTransferConnector"]:
        """FastDeploy's transfer-connector slot: kvtier's P/D connector, or None (not a P/D instance)."""
        return self._transfer_connector

    @property
    def transfer_manager(self):
        """The native kvtier.TransferManager (created on first use), or None."""
        return self._mgr

    def _first_tensor(self) -> Any:
        for t in self._cache_kvs_map.values():
            if t is not None:
                return t
        raise _error("FailedPrecondition", "set_cache_kvs_map() has not been called (no device KV tensors)")

    def _stream_for(self, stream: Any = None):
        """The kvtier Stream for ``stream`` (torch/cupy stream, int handle; None = the engine's current)."""
        if self._device is None:
            raise _error("FailedPrecondition", "no transfer has been submitted yet")
        if self._device.backend != "cuda":
            return self._compute
        if stream is None:
            handle = _current_stream_handle(self._first_tensor())
        elif isinstance(stream, int):
            handle = stream
        else:
            handle = int(getattr(stream, "cuda_stream", None) or getattr(stream, "ptr", 0))
        s = self._streams.get(handle)
        if s is None:
            s = self._device.adopt_stream(handle, f"engine-{handle:#x}")
            self._streams[handle] = s
        return s

    def _require_manager(self):
        with self._lock:
            if self._mgr is not None:
                return self._mgr
            if self._closed:
                raise _error("FailedPrecondition", "the CacheTransferManager was closed")
            if self._num_host_blocks <= 0:
                raise _error("FailedPrecondition", "no host cache: cache_config.num_cpu_blocks is 0")
            if not self._cache_kvs_map:
                raise _error("FailedPrecondition", "set_cache_kvs_map() has not been called")
            if not self._host_cache_kvs_map:
                raise _error("FailedPrecondition", "set_host_cache_kvs_map() has not been called")
            tensors = {k: v for k, v in self._cache_kvs_map.items() if v is not None}
            first = self._first_tensor()
            knobs = _knobs()
            backend = knobs["fastdeploy.backend"]
            dev = _dlpack_device(first)
            on_cuda = dev is not None and dev[0] == _DLPACK_CUDA
            if backend == "cuda" or (backend == "auto" and on_cuda):
                if not on_cuda:
                    raise _error("InvalidArgument", f"KVTIER_FASTDEPLOY_BACKEND=cuda but the KV tensors are on "
                                 f"DLPack device {dev}")
                self._device = _native.cuda_device(dev[1])
                self._streams = {}
                self._compute = self._stream_for(None)
            elif backend in ("auto", "host"):
                self._device = _native.host_device()
                self._compute = self._device.create_stream("engine")
            else:
                raise _error("InvalidArgument", f"KVTIER_FASTDEPLOY_BACKEND={backend!r} is not auto, host or cuda")
            host = {}
            for name, ptr in self._host_cache_kvs_map.items():
                # FastDeploy's host map holds addresses (ints; 0 or None: no host tensor of that name); int() took
                # strings, and a negative or too large one was reported as a device tensor nanobind could not take.
                if ptr is None:
                    continue
                if isinstance(ptr, bool) or not isinstance(ptr, numbers.Integral) or not 0 <= int(ptr) < 1 << 64:
                    # Named by a short repr: an array given instead of its address put thousands of characters of
                    # its repr into last_error and the log.
                    shown = repr(ptr) if isinstance(ptr, (numbers.Number, str, bytes)) and len(repr(ptr)) <= 64 \
                        else f"a {type(ptr).__name__}"
                    raise _error("InvalidArgument", f"host_cache_kvs_map[{name!r}] = {shown} is not a host address "
                                 f"(an int in [0, 2**64))")
                if ptr:
                    host[name] = int(ptr)
            for name, t in tensors.items():
                if getattr(getattr(t, "flags", None), "writeable", True) is False:
                    raise _error("InvalidArgument", f"cache_kvs_map[{name!r}] is read-only: loads write into it")
            try:
                self._mgr = _native.TransferManager.from_tensors(
                    self._device, self._compute, tensors, host, self._num_host_blocks, self._num_layers,
                    rank=self._local_rank, device_label=self._device_id, block_tokens=self._block_tokens,
                    config=_engine_defaults(self._device, os.environ))
            except TypeError as e:  # a tensor nanobind cannot take (its message names the argument types)
                raise _error("InvalidArgument", f"cache_kvs_map: a tensor kvtier cannot use: {e}") from e
            # kvtier's process registry (kvtier.metrics): on unless KVTIER_METRICS=0.
            if knobs["metrics"]:
                self._mgr.attach_metrics({"rank": str(self._local_rank), "device": str(self._device_id)})
            return self._mgr

    def _close_manager(self) -> None:
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            # The outcome of every transfer in flight is collected before the manager goes (closing drains them
            # and drops their errors): a failed eviction's host blocks stay refused to loads, a failed load's
            # layers keep failing their waits, and last_error says so.
            for task in self._evicts:
                try:
                    mgr.wait(task, self._sync_timeout)
                except KvtierError as e:
                    self._eviction_failed(task, f"eviction task {task} failed: {e}", "set_cache_kvs_map/close")
            self._bad_host_blocks.update(self._failed_hosts)
            for layer, tasks in self._layer_tasks.items():
                for task in tasks:
                    try:
                        mgr.wait_layer_host(task, layer, self._sync_timeout)
                    except KvtierError as e:
                        self._layer_failed(layer, task, e)
            for task in self._loads:
                try:
                    mgr.wait(task, self._sync_timeout)
                except KvtierError as e:
                    self._fail(f"set_cache_kvs_map/close: load task {task}: {e}")
            mgr.close()
        self._loads, self._evicts, self._layer_tasks, self._last_submitted = [], [], {}, None
        self._evict_hosts, self._host_writer, self._failed_hosts, self._step_synced = {}, {}, {}, False
        self._streams, self._compute, self._device = {}, None, None

    def close(self) -> None:
        """Drains every transfer and releases the engine memory (idempotent); closes the transfer connector.

        Final: later transfers return False with ``last_error`` saying so, and the map setters raise.
        """
        with self._lock:
            self._closed = True
            self._close_manager()
            if self._transfer_connector is not None:
                self._transfer_connector.close()

    def __del__(self):
        try:
            self._close_manager()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    @staticmethod
    def _ids(ids: List[int], what: str = "block id") -> List[int]:
        # int() would truncate 1.9 to block 1 and read "1" as block 1: a copy of blocks nobody named. A set or a
        # dict has no order of its own: position i of the device list pairs with position i of the host list.
        if ids is None or isinstance(ids, (str, bytes)):
            raise InvalidArgumentError(f"the {what}s are {ids!r}, not a list of integers")
        if isinstance(ids, (set, frozenset, dict)):
            raise InvalidArgumentError(f"the {what}s are a {type(ids).__name__}, not an ordered list of integers")
        try:
            ids = list(ids)
        except TypeError:
            raise InvalidArgumentError(f"the {what}s are a {type(ids).__name__}, not a list of integers") from None
        out = []
        for i in ids:
            if isinstance(i, bool):
                raise InvalidArgumentError(f"{what} {i!r} is a bool, not an integer")
            try:
                out.append(operator.index(i))
            except TypeError:
                raise InvalidArgumentError(f"{what} {i!r} is a {type(i).__name__}, not an integer") from None
        return out

    # ============ Public Async API ============

    def evict_to_host_async(self, device_block_ids: List[int], host_block_ids: List[int]) -> bool:
        """Evicts all layers and roles of the blocks to host (D2H), after the engine's current stream.

        Returns at once (True when submitted). The engine's later work on its current stream
        does not overwrite the device blocks before the copy read them.
        """
        if self._num_host_blocks <= 0:
            return self._fail("evict_to_host_async: no host cache (cache_config.num_cpu_blocks is 0)")
        try:
            with self._lock:
                mgr = self._require_manager()
                stream = self._stream_for(None)
                d, h = self._ids(device_block_ids), self._ids(host_block_ids)
                self._prune(mgr)
                task = mgr.evict(d, h, after=stream)
                self._evicts.append(task)
                self._evict_hosts[task] = h
                for b in h:  # the manager knows what this eviction leaves there
                    self._bad_host_blocks.pop(b, None)
                    self._failed_hosts.pop(b, None)
                    self._host_writer[b] = task
                if self._fence_evictions:
                    # FastDeploy hands evicted ids to new requests at once: the engine's
                    # later work waits (on the GPU) until the copy has read them.
                    mgr.wait_device_blocks_free(d, stream)
                return True
        except KvtierError as e:
            return self._fail(f"evict_to_host_async: {e}")

    def load_layers_to_device_async(
        self,
        layer_indices: List[int],
        host_block_ids: List[int],
        device_block_ids: List[int],
        on_layer_complete: Optional[Callable[[int], Any]] = None,
    ) -> bool:
        """Loads the layers (every role) from host to device (H2D), layer by layer.

        ``on_layer_complete(layer)`` is called after each layer is submitted, as in
        FastDeploy; the forward waits for a layer with ``wait_for_layer`` (or an event from
        ``record_input_stream_event()`` inside the callback).
        """
        if self._num_host_blocks <= 0:
            return self._fail("load_layers_to_device_async: no host cache (cache_config.num_cpu_blocks is 0)")
        try:
            with self._lock:
                mgr = self._require_manager()
                stream = self._stream_for(None)
                layers = self._ids(layer_indices, "layer index")
                d, h = self._ids(device_block_ids), self._ids(host_block_ids)
                if not layers:
                    return True  # as FastDeploy: no layer, no copy and no callback (the manager takes [] as all)
                bad = next((b for b in h if b in self._bad_host_blocks), None)
                if bad is not None:
                    return self._fail(f"load_layers_to_device_async: host block {bad} holds undefined bytes: "
                                      f"{self._bad_host_blocks[bad]}")
                # The engine's work enqueued so far may still use these blocks.
                try:
                    mgr.record_device_access(d, stream, "read")
                except OutOfRangeError:
                    # Named as the engine's list, not as an index of record_device_access (a call it never made);
                    # looked for only on this path, so a load does not walk its ids twice.
                    n = mgr.num_device_blocks
                    out = next(i for i, b in enumerate(d) if not 0 <= b < n)
                    return self._fail(f"load_layers_to_device_async: device_block_ids[{out}] = {d[out]} is outside "
                                      f"[0, {n}) (the device cache's blocks)")
                self._prune(mgr)
                task = mgr.load(layers, h, d)
                if self._step_synced:  # the first load of a new step: the last step's failures are told
                    self._failed_layers, self._step_synced = {}, False
                self._loads.append(task)
                for layer in (layers or range(mgr.num_layers)):
                    self._layer_tasks.setdefault(layer, []).append(task)
        except KvtierError as e:
            return self._fail(f"load_layers_to_device_async: {e}")
        if on_layer_complete is not None:
            for layer in (layers or range(mgr.num_layers)):
                self._last_submitted = (task, layer)
                try:
                    on_layer_complete(layer)
                except Exception:  # noqa: BLE001 - FastDeploy ignores it; we log it
                    logger.exception("[CacheTransferManager] on_layer_complete(%d) raised", layer)
        else:
            self._last_submitted = (task, layers[-1] if layers else mgr.num_layers - 1)
        return True

    def _eviction_failed(self, task: int, why: str, what: str) -> None:
        """A failed eviction: its host blocks that no later eviction was submitted into hold undefined bytes (a
        manager made after the maps are registered again does not know it, so loads of them are refused here)."""
        for h in self._evict_hosts.pop(task, ()):
            if self._host_writer.get(h) == task:
                self._failed_hosts[h] = why
                del self._host_writer[h]
        self._fail(f"{what}: {why}")

    def _eviction_ended(self, task: int) -> None:
        for h in self._evict_hosts.pop(task, ()):
            if self._host_writer.get(h) == task:
                del self._host_writer[h]

    def _prune(self, mgr: Any) -> None:
        """Forgets the transfers that have ended (under the lock, at each submission). An engine that never calls
        sync_input_stream / sync_output_stream (the per-layer waits order its forward on the GPU) kept every task:
        each wait walked all of them, and once a task left the manager's bounded history of finished ones
        (transfer.retained_finished_tasks) a load that had succeeded was reported failed. An ended task's outcome
        is recorded as a wait would record it: a failed load fails its layers' waits for the step, a failed
        eviction's host blocks are refused to loads after the maps are registered again."""
        pending = []
        for task in self._evicts:
            try:
                info = mgr.task_info(task)
            except KvtierError as e:  # no longer retained: its outcome is unknown
                self._eviction_failed(task, f"eviction task {task}: {e}", "evict_to_host_async")
                continue
            if info["state"] == "pending":
                pending.append(task)
            elif info["state"] == "failed":
                self._eviction_failed(task, f"eviction task {task} failed: {info['status']}", "evict_to_host_async")
            else:
                self._eviction_ended(task)
        self._evicts = pending
        ended = set()
        pending = []
        for task in self._loads:
            try:
                info = mgr.task_info(task)
            except KvtierError as e:
                for layer, tasks in self._layer_tasks.items():
                    if task in tasks:
                        self._layer_failed(layer, task, e)
                ended.add(task)
                continue
            if info["state"] == "pending":
                pending.append(task)
                continue
            ended.add(task)
            if info["state"] == "failed":
                for layer, state in zip(info["layers"], info["layer_states"]):
                    if state == "failed":
                        self._layer_failed(layer, task, _error("DataLoss", str(info["status"])))
        self._loads = pending
        if ended:
            for layer in list(self._layer_tasks):
                left = [t for t in self._layer_tasks[layer] if t not in ended]
                if left:
                    self._layer_tasks[layer] = left
                else:
                    del self._layer_tasks[layer]

    # ============ Layer waits (added) ============

    def _layer(self, layer_idx: Any, what: str) -> int:
        if isinstance(layer_idx, bool):
            raise InvalidArgumentError(f"{what}: layer {layer_idx!r} is a bool, not an integer")
        try:
            layer = operator.index(layer_idx)
        except TypeError:
            raise InvalidArgumentError(f"{what}: layer {layer_idx!r} is a {type(layer_idx).__name__}, not an "
                                       "integer") from None
        if self._mgr is not None and not 0 <= layer < self._mgr.num_layers:
            raise InvalidArgumentError(f"{what}: the model has layers 0..{self._mgr.num_layers - 1}, not {layer}")
        return layer

    def _layer_failed(self, layer: int, task: int, error: KvtierError) -> None:
        self._failed_layers.setdefault(layer, f"load task {task}: {error}")

    def wait_for_layer(self, layer_idx: int, stream: Any = None) -> None:
        """The engine's stream (default: current) waits on the GPU for every pending load of ``layer_idx``.

        Returns at once when no load of the layer is pending. Raises the layer's error when a load of it is
        known failed in this step (the forward must not use the blocks), however many loads of the layer came
        after it, and after ``sync_input_stream()`` too. No host synchronisation.
        """
        layer = self._layer(layer_idx, "wait_for_layer")
        mgr = self._mgr
        if mgr is None and self._closed:
            raise _error("FailedPrecondition", f"wait_for_layer({layer}): the CacheTransferManager was closed")
        if mgr is not None:
            stream = self._stream_for(stream)
            for task in list(self._layer_tasks.get(layer, ())):
                try:
                    mgr.wait_for_layer(task, layer, stream)
                except KvtierError as e:
                    self._layer_failed(layer, task, e)
        if layer in self._failed_layers:
            raise DataLossError(f"wait_for_layer({layer}): {self._failed_layers[layer]}")

    def wait_layer_host(self, layer_idx: int, timeout: Optional[float] = 1.0) -> bool:
        """Blocks (GIL released) until every pending load of the layer is on the device.

        True when they are (or none is pending); False on a timeout, or when a load of the layer failed in
        this step (however many loads of it came after, and after ``sync_input_stream()`` too), with the
        reason in ``last_error``.
        """
        try:
            layer = self._layer(layer_idx, "wait_layer_host")
        except KvtierError as e:
            return self._fail(str(e))
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or
                                    math.isnan(timeout)):
            return self._fail(f"wait_layer_host({layer}): timeout {timeout!r} is not a number of seconds")
        mgr = self._mgr  # close() on another thread may clear it: its waits then fail as closed
        if mgr is None and self._closed:
            return self._fail(f"wait_layer_host({layer}): the CacheTransferManager was closed")
        tasks = self._layer_tasks.get(layer, []) if mgr is not None else []
        for task in list(tasks):
            try:
                mgr.wait_layer_host(task, layer, timeout)
            except TimedOutError as e:
                return self._fail(f"wait_layer_host({layer}): {e}")
            except KvtierError as e:
                self._layer_failed(layer, task, e)
            if task in tasks:
                tasks.remove(task)  # finished, for good or not: its outcome is in _failed_layers
        if layer in self._failed_layers:
            return self._fail(f"wait_layer_host({layer}): {self._failed_layers[layer]}")
        return True

    # ============ Stream Utilities ============

    def _sync(self, tasks: List[int], what: str) -> None:
        if self._mgr is None:
            return
        pending, tasks[:] = list(tasks), []
        for task in pending:
            try:
                self._mgr.wait(task, self._sync_timeout)
            except KvtierError as e:
                self._fail(f"{what}: task {task}: {e}")

    def sync_input_stream(self) -> None:
        """Waits for every pending load (H2D). A failure is logged and kept in ``last_error``; the layer waits
        keep reporting it until the next load is submitted."""
        with self._lock:
            self._sync(self._loads, "sync_input_stream")
            if self._mgr is not None:
                for layer, tasks in self._layer_tasks.items():
                    for task in tasks:
                        try:
                            self._mgr.wait_layer_host(task, layer, 0)
                        except KvtierError as e:
                            self._layer_failed(layer, task, e)
            self._layer_tasks = {}
            self._step_synced = True

    def sync_output_stream(self) -> None:
        """Waits for every pending eviction (D2H). A failure is logged and kept in ``last_error``."""
        with self._lock:
            if self._mgr is None:
                return
            pending, self._evicts = self._evicts, []
            for task in pending:
                try:
                    self._mgr.wait(task, self._sync_timeout)
                    self._eviction_ended(task)
                except KvtierError as e:
                    self._eviction_failed(task, f"eviction task {task} failed: {e}", "sync_output_stream")

    def record_input_stream_event(self) -> Any:
        """The completion of the most recently submitted layer, as a :class:`LayerEvent` (None if none)."""
        if self._mgr is None or self._last_submitted is None:
            return None
        return LayerEvent(self, self._mgr, *self._last_submitted)

    def get_stats(self) -> Dict[str, Any]:
        stats = {
            "num_layers": self._num_layers,
            "local_rank": self._local_rank,
            "device_id": self._device_id,
            "cache_dtype": self._cache_dtype,
            "num_host_blocks": self._num_host_blocks,
            "has_device_cache": len(self._device_key_caches) > 0,
            "has_host_cache": len(self._host_key_ptrs) > 0,
            "is_fp8": self._is_fp8_quantization(),
        }
        if self._mgr is not None:
            stats["kvtier"] = self._mgr.stats()
        stats["last_error"] = self._last_error
        return stats


def _error(code: str, message: str) -> KvtierError:
    from .errors import CLASS_BY_CODE

    return CLASS_BY_CODE[code](message, code)


# ============ Transfer connector (P/D) ============


class PdTransferConnector:
    """FastDeploy's transfer connector, filled by :mod:`kvtier.pd`: one prefill or decode endpoint over the
    engine's KV tensors (the drop-in registers them from ``set_cache_kvs_map``).

    FastDeploy's ``TransferConnector`` moves bytes between addresses (``send``/``recv(addr, buffer, size)``,
    ``send_async``/``recv_async -> handle``, ``wait(handle, timeout=-1)``, ``register_buffer``); kvtier moves
    blocks, layer by layer, checksummed, with leases. The mapping: ``register_buffer`` is
    ``register_kv_cache`` (the whole KV cache, once); the handle is the router's transfer id; ``send_async``
    is ``begin`` + ``layer_ready`` per layer (prefill), ``recv_async`` is ``start`` (decode);
    ``wait(handle, timeout=-1)`` is ``wait`` (-1 or None: no deadline). The peer's address is its metadata
    blob (``metadata()`` on one side, ``add_peer()`` on the other).
    """

    def __init__(self, role: str, transport: str = "ipc", peer_secret: Optional[bytes] = None, tls: str = "",
                 net_devices: str = "", heartbeat_s: float = 0.1, lease_s: float = 1.0):
        if role not in ("prefill", "decode"):
            raise _error("InvalidArgument", f"P/D role {role!r} is not prefill or decode")
        self.role = role
        self._kwargs = dict(transport=transport, peer_secret=peer_secret, tls=tls, net_devices=net_devices,
                            heartbeat_s=heartbeat_s, lease_s=lease_s)
        self._endpoint = None
        self._tensors: Dict[str, Any] = {}
        self._registration = (0, 0, 0)  # num_layers, local_rank, device_id
        self._lock = threading.Lock()

    @property
    def endpoint(self):
        """The :class:`kvtier.pd.Prefill` or :class:`kvtier.pd.Decode` over the registered KV cache (created on
        first use; ``FailedPreconditionError`` before ``register_kv_cache``)."""
        return self._require()

    def register_kv_cache(self, cache_kvs_map: Dict[str, Any], num_layers: int, local_rank: int = 0,
                          device_id: int = 0) -> None:
        """Takes the engine's KV tensors (FastDeploy's name map); the endpoint over them is created on first use
        (errors in the map surface there). CUDA tensors go through pinned staging on their device; CPU tensors
        move directly. A new map replaces the endpoint (its transfers fail at the peer)."""
        tensors = {k: v for k, v in cache_kvs_map.items() if v is not None}
        with self._lock:
            self._close_endpoint()
            self._tensors = tensors
            self._registration = (num_layers, local_rank, device_id)

    def _require(self, role: Optional[str] = None):
        if role is not None and role != self.role:
            raise _error("FailedPrecondition", f"this is a {self.role} connector; the call is a {role} one")
        with self._lock:
            if self._endpoint is not None:
                return self._endpoint
            if not self._tensors:
                raise _error("FailedPrecondition", "no KV cache registered: set_cache_kvs_map() has not been called")
            from . import pd

            num_layers, local_rank, device_id = self._registration
            dev = _dlpack_device(next(iter(self._tensors.values())))
            device = _native.cuda_device(dev[1]) if dev is not None and dev[0] == _DLPACK_CUDA else None
            cls = pd.Prefill if self.role == "prefill" else pd.Decode
            self._endpoint = cls(self._tensors, device=device, num_model_layers=num_layers, rank=local_rank,
                                 device_label=device_id, **self._kwargs)
            return self._endpoint

    def metadata(self) -> bytes:
        """This side's metadata blob (its address, for the other side's ``add_peer``)."""
        return self._require().metadata()

    def add_peer(self, metadata: bytes) -> int:
        return self._require().add_peer(metadata)

    def disconnect_peer(self, peer: int) -> None:
        """:meth:`kvtier.pd.Prefill.disconnect_peer` (before adding a peer again after a lease expired)."""
        self._require().disconnect_peer(peer)

    # prefill (FastDeploy's send_async)
    def begin(self, peer: int, transfer_id: int, src_blocks: List[int]) -> None:
        self._require("prefill").begin(peer, transfer_id, src_blocks)

    def layer_ready(self, transfer_id: int, layer: int, stream: Any = None) -> None:
        """The layer's KV is written: now, or once the work so far on ``stream`` completed (a kvtier Stream,
        a torch/cupy stream, or a CUDA stream handle; CUDA KV only)."""
        ep = self._require("prefill")
        ep.layer_ready(transfer_id, layer, self._stream(ep, stream))

    # decode (FastDeploy's recv_async)
    def start(self, peer: int, transfer_id: int, dst_blocks: List[int], mode: str = "push") -> None:
        self._require("decode").start(peer, transfer_id, dst_blocks, mode)

    def wait_layer(self, transfer_id: int, layer: int, timeout: Optional[float] = 60.0) -> str:
        return self._require("decode").wait_layer(transfer_id, layer, timeout)

    def wait_for_layer(self, transfer_id: int, layer: int, stream: Any = None,
                       timeout: Optional[float] = 60.0) -> None:
        """CUDA KV: the engine's stream (``None``: its current one) waits on the GPU for the layer's copy."""
        ep = self._require("decode")
        if ep.device is None:
            raise _error("InvalidArgument", "wait_for_layer is a GPU-side wait for CUDA KV; this connector's KV is "
                         "host memory: use wait_layer")
        ep.wait_layer_on_stream(transfer_id, layer, self._stream(ep, stream, current=True), timeout)

    def status(self, transfer_id: int):
        return self._require().status(transfer_id)

    def wait(self, transfer_id: int, timeout: Optional[float] = -1):
        """FastDeploy's ``wait(handle, timeout=-1)``: until the transfer is final (-1 or None: no deadline).
        Returns the :class:`kvtier.pd.PrefillStatus` / :class:`kvtier.pd.DecodeStatus`."""
        from . import pd  # imported on use, as where the endpoint is created

        t = pd._timeout(timeout)  # a number of seconds or None, else an error naming it
        return self._require().wait(transfer_id, None if t is not None and t < 0 else t)

    def forget(self, transfer_id: int) -> None:
        self._require().forget(transfer_id)

    def _stream(self, ep, stream: Any, current: bool = False):
        """``stream`` for the endpoint (None: none, or with ``current`` the engine's current stream)."""
        if stream is None and current and ep.device is not None:
            return _current_stream_handle(next(iter(self._tensors.values())))
        return stream

    def _close_endpoint(self) -> None:
        ep, self._endpoint = self._endpoint, None
        if ep is not None:
            ep.close()

    def close(self) -> None:
        """Closes the endpoint and forgets the KV cache (idempotent; ``register_kv_cache`` starts over)."""
        with self._lock:
            self._close_endpoint()
            self._tensors = {}


def create_transfer_connector(cache_config: Any, splitwise_role: Optional[str] = None) -> Optional[PdTransferConnector]:
    """FastDeploy's ``create_transfer_connector(cache_config)``, filled by kvtier's P/D: a
    :class:`PdTransferConnector` for a prefill or decode instance, None otherwise. The role:
    ``KVTIER_FASTDEPLOY_PD_ROLE``, else ``splitwise_role`` (the drop-in passes FastDeploy's
    ``config.scheduler_config.splitwise_role``; FastDeploy's own call passes only ``cache_config``), else
    ``cache_config.splitwise_role``, else ``mixed``. Environment: see the module's docstring."""
    knobs = _knobs()
    role = (knobs["fastdeploy.pd_role"] or splitwise_role or _attr(cache_config, "splitwise_role") or "mixed")
    if role == "mixed":
        return None
    secret_hex = knobs["fastdeploy.pd_secret"]  # hex: checked by the config table
    secret = bytes.fromhex(secret_hex) if secret_hex else None
    transport = knobs["fastdeploy.pd_transport"]
    tls = knobs["fastdeploy.pd_tls"]
    if tls == "auto":
        tls = "tcp" if transport == "ucx" else ""
    return PdTransferConnector(role, transport=transport, peer_secret=secret, tls=tls,
                               net_devices=knobs["fastdeploy.pd_net_devices"])
