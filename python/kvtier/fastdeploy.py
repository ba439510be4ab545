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
  ``wait_layer_host`` / ``LayerEvent.synchronize`` fail; where FastDeploy returns
  ``False`` this class returns ``False`` too and keeps the reason (``last_error``, logged
  once per distinct reason).

Added (what FastDeploy's callers need and its class lacks):

- ``wait_for_layer(layer_idx, stream=None)``: the forward pass calls it per layer on its
  *current* stream: a GPU-side wait (no host sync, usable before a CUDA-graph replay);
- ``wait_layer_host(layer_idx, timeout=1.0) -> bool``: the host-side wait;
- ``last_error`` (the reason of the last ``False``), ``transfer_manager`` (the native
  :class:`kvtier.TransferManager`), ``close()`` (drain and release; also on garbage
  collection).

Environment: ``KVTIER_FASTDEPLOY_BACKEND`` = ``auto`` (default: CUDA for CUDA tensors, the
host backend for CPU arrays) | ``host`` | ``cuda``; ``KVTIER_FASTDEPLOY_FENCE_EVICTIONS`` =
``1`` (default) | ``0`` (the engine fences reuse itself); ``KVTIER_FASTDEPLOY_SYNC_TIMEOUT``
seconds for ``sync_*_stream`` (default 300); the ``KVTIER_TRANSFER_*`` knobs of
docs/configuration.md.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional

from . import _native
from .errors import KvtierError

logger = logging.getLogger("kvtier.fastdeploy")

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3

__all__ = ["CacheTransferManager", "LayerEvent"]


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


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

    def __init__(self, owner: "CacheTransferManager", task: int, layer: int):
        self._owner, self.task, self.layer = owner, task, layer

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Blocks until the layer is on the device (raises its error, or TimedOutError)."""
        self._owner._require_manager().wait_layer_host(self.task, self.layer, timeout)

    def query(self) -> bool:
        info = self._owner._require_manager().task_info(self.task)
        state = info["layer_states"][info["layers"].index(self.layer)]
        if state == "failed":
            self.synchronize(0)  # raises the layer's error
        return state == "done"

    @property
    def done(self) -> bool:
        return self.query()

    def wait(self, stream: Any = None) -> None:
        """Makes ``stream`` (default: the engine's current stream) wait for the layer on the GPU."""
        owner = self._owner
        owner._require_manager().wait_for_layer(self.task, self.layer, owner._stream_for(stream))


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
        self._num_layers = config.model_config.num_hidden_layers
        self._cache_dtype = self.cache_config.cache_dtype
        self._num_host_blocks = _attr(self.cache_config, "num_cpu_blocks") or 0
        self._block_tokens = int(_attr(self.cache_config, "block_size", 64) or 64)

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
        self._compute = None  # kvtier Stream over the engine's stream (host backend: kvtier's own)
        self._streams: Dict[int, Any] = {}  # adopted engine streams by handle
        self._loads: List[int] = []
        self._evicts: List[int] = []
        self._layer_task: Dict[int, int] = {}
        self._last_submitted: Optional[tuple] = None
        self._last_error: Optional[str] = None
        self._logged_errors: set = set()
        self._fence_evictions = os.environ.get("KVTIER_FASTDEPLOY_FENCE_EVICTIONS", "1") != "0"
        self._sync_timeout = float(os.environ.get("KVTIER_FASTDEPLOY_SYNC_TIMEOUT", "300"))

    # ============ Cache Map Setters ============

    @property
    def cache_kvs_map(self) -> Dict[str, Any]:
        return self._cache_kvs_map

    def set_cache_kvs_map(self, cache_kvs_map: Dict[str, Any]) -> None:
        """Shares the device KV tensor map: ``key_caches_{layer}_rank{r}.device{d}`` -> tensor, ..."""
        with self._lock:
            self._close_manager()
            self._cache_kvs_map = cache_kvs_map
            self._build_device_layer_indices()

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
            if self._num_host_blocks <= 0:
                raise _error("FailedPrecondition", "no host cache: cache_config.num_cpu_blocks is 0")
            if not self._cache_kvs_map:
                raise _error("FailedPrecondition", "set_cache_kvs_map() has not been called")
            if not self._host_cache_kvs_map:
                raise _error("FailedPrecondition", "set_host_cache_kvs_map() has not been called")
            tensors = {k: v for k, v in self._cache_kvs_map.items() if v is not None}
            first = self._first_tensor()
            backend = os.environ.get("KVTIER_FASTDEPLOY_BACKEND", "auto")
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
            host = {k: int(v) for k, v in self._host_cache_kvs_map.items() if v}
            self._mgr = _native.TransferManager.from_tensors(
                self._device, self._compute, tensors, host, self._num_host_blocks, self._num_layers,
                rank=self._local_rank, device_label=self._device_id, block_tokens=self._block_tokens)
            # kvtier's process registry (kvtier.metrics): on unless KVTIER_METRICS=0.
            if os.environ.get("KVTIER_METRICS", "1") != "0":
                self._mgr.attach_metrics({"rank": str(self._local_rank), "device": str(self._device_id)})
            return self._mgr

    def _close_manager(self) -> None:
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            mgr.close()
        self._loads, self._evicts, self._layer_task, self._last_submitted = [], [], {}, None
        self._streams, self._compute, self._device = {}, None, None

    def close(self) -> None:
        """Drains every transfer and releases the engine memory (idempotent)."""
        with self._lock:
            self._close_manager()

    def __del__(self):
        try:
            self._close_manager()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    @staticmethod
    def _ids(ids: List[int]) -> List[int]:
        return [int(i) for i in ids]

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
                task = mgr.evict(d, h, after=stream)
                self._evicts.append(task)
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
                layers = [int(x) for x in layer_indices]
                d, h = self._ids(device_block_ids), self._ids(host_block_ids)
                # The engine's work enqueued so far may still use these blocks.
                mgr.record_device_access(d, stream, "read")
                task = mgr.load(layers, h, d)
                self._loads.append(task)
                for layer in (layers or range(mgr.num_layers)):
                    self._layer_task[layer] = task
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

    # ============ Layer waits (added) ============

    def wait_for_layer(self, layer_idx: int, stream: Any = None) -> None:
        """The engine's stream (default: current) waits on the GPU for the latest load of ``layer_idx``.

        Returns at once when no load of the layer is pending. Raises the layer's error when it is
        known failed (the forward must not use the blocks). No host synchronisation.
        """
        task = self._layer_task.get(layer_idx)
        if task is None or self._mgr is None:
            return
        self._mgr.wait_for_layer(task, layer_idx, self._stream_for(stream))

    def wait_layer_host(self, layer_idx: int, timeout: Optional[float] = 1.0) -> bool:
        """Blocks (GIL released) until the latest load of the layer is on the device.

        True when it is (or no load of it is pending); False on failure or timeout, with the
        reason in ``last_error``.
        """
        task = self._layer_task.get(layer_idx)
        if task is None or self._mgr is None:
            return True
        try:
            self._mgr.wait_layer_host(task, layer_idx, timeout)
            return True
        except KvtierError as e:
            return self._fail(f"wait_layer_host({layer_idx}): {e}")

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
        """Waits for every pending load (H2D). A failure is logged and kept in ``last_error``."""
        with self._lock:
            self._sync(self._loads, "sync_input_stream")
            self._layer_task = {}

    def sync_output_stream(self) -> None:
        """Waits for every pending eviction (D2H). A failure is logged and kept in ``last_error``."""
        with self._lock:
            self._sync(self._evicts, "sync_output_stream")

    def record_input_stream_event(self) -> Any:
        """The completion of the most recently submitted layer, as a :class:`LayerEvent` (None if none)."""
        if self._mgr is None or self._last_submitted is None:
            return None
        return LayerEvent(self, *self._last_submitted)

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
