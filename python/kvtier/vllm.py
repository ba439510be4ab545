"""vLLM's native KV offloading (v1 ``OffloadingConnector``) onto kvtier's storage tiers.

:class:`KvtierOffloadingSpec` is an ``OffloadingSpec`` (``vllm/v1/kv_offload/base.py``, vLLM 0.34.0): vLLM
offloads chunks of its paged KV cache to a kvtier disk tier (io_uring, capacity, checksums) or a Redis /
Redis Cluster tier, and loads them back on a prefix hit. vLLM loads it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "storage": "disk:/var/cache/kvtier?capacity=200G&durability=process"}}'

(docs/engines.md has the whole story.) ``kv_connector_extra_config`` keys:

- ``storage`` (required): kvtier's storage spec, ``disk:<dir>[?...]`` or ``redis://host:port[?...]``
  (:meth:`kvtier.StorageBackend.open`);
- ``capacity``: bytes each worker's tier holds for this engine (``"200G"``, an integer); default: the disk
  spec's ``capacity=`` or the ``storage.disk.capacity_bytes`` knob; required for Redis;
- ``namespace``: a string added to the namespace (deployments that share a tier but not pages);
- ``staging_bytes``: the most bytes one worker gathers per storage batch (default ``256M``);
- ``storage.disk.*``, ``storage.redis.*``, ``storage.tenant.*``: kvtier's knobs (docs/configuration.md),
  as strings, numbers or booleans; an unknown knob or a bad value raises ``InvalidArgumentError`` naming it;
- vLLM's own keys (``spec_name``, ``spec_module_path``, ``block_size``, ``blocks_per_chunk``,
  ``offload_prompt_only``, ``self_describing_kv_events``, ``sync_load_budget_bytes``, ...) are vLLM's;
  any other key is logged and ignored.

What is stored: one kvtier object per offloaded chunk (vLLM's ``OffloadKey``: the chunk's block hash and
its KV cache group) and worker rank, holding that rank's bytes of every layer of the group, layer by layer,
block by block. The object's key is a 128-bit BLAKE2b of the ``OffloadKey``; the namespace carries the
model, the KV dtype and layout, the chunk geometry and the rank identity (rank, TP, PP, PCP, DCP; on disk
also the DP replica, on Redis the engine id), so a different model or parallel layout never reads these objects.

The scheduler side (:class:`KvtierOffloadingManager`) keeps the index of stored chunks: capacity in
chunks, least-recently-used eviction of chunks no load holds, evicted chunks deleted from the tier by the
next store job. The worker side (:class:`KvtierOffloadingWorker`) gathers the chunk's blocks from vLLM's
KV tensors (GPU or CPU) into a staging buffer (pinned for a GPU) and writes it with one storage batch,
or reads and verifies the objects first and scatters them into the KV tensors after.

Failures are misses, never garbage: a job is reported successful only when every object was written
(store) or read whole, verified and of the chunk's exact size (load). A failed store drops its chunks from
the index (``complete_store(success=False)``) and deletes what it wrote; a failed load leaves the
destination blocks as they were and vLLM recomputes them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qsl

import numpy as np

from . import _native
from ._engine_config import split_extra_config
from .errors import InvalidArgumentError, NotSupportedError

try:
    import torch
    import vllm
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        ConfigInfo,
        DevicePointers,
        LoadStoreSpec,
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
        TransferResult,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as _e:  # kvtier.vllm lives inside vLLM's processes: without vLLM there is nothing to plug into
    raise ImportError(
        f"kvtier.vllm needs vLLM's offloading interface (vllm.v1.kv_offload, tested with vLLM 0.34.0) and "
        f"torch: {_e}") from _e

logger = logging.getLogger("kvtier.vllm")

__all__ = [
    "KvtierOffloadingSpec", "KvtierOffloadingManager", "KvtierOffloadingWorker", "KvtierLoadStoreSpec",
    "VLLM_TESTED", "parse_extra_config", "namespace_of", "object_key",
]

#: The vLLM release whose interface this module implements (python/tests/data/vllm_interface.json).
VLLM_TESTED = "0.34.0"

if getattr(vllm, "__version__", None) != VLLM_TESTED:
    logger.warning("kvtier.vllm: vLLM %s is installed; kvtier.vllm was tested with vLLM %s (the offloading "
                   "interface changes between releases)", getattr(vllm, "__version__", "?"), VLLM_TESTED)

# kv_connector_extra_config keys that belong to vLLM (its connector, spec factory and base spec).
_VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout", "offload_prompt_only",
    "self_describing_kv_events", "sync_load_budget_bytes", "kv_load_failure_policy",
})
_OWN_KEYS = frozenset({"storage", "capacity", "namespace", "staging_bytes"})
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# What one object costs on a disk tier beyond its payload rounded to 4 KiB: its header block, and slack.
_DISK_OBJECT_OVERHEAD = 8192
_DEFAULT_STAGING = 256 << 20


# ---------------------------------------------------------------------------------------------- configuration


def parse_size(key: str, value: Any) -> int:
    """A byte count: an integer, or a string like ``4096``, ``64K``, ``200G`` (binary units, optional ``B``)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"kvtier.vllm: extra_config['{key}'] = {value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        t = value.strip().upper()
        if t.endswith("B") and len(t) > 1 and t[-2].isalpha():
            t = t[:-1]
        unit = t[-1:] if t[-1:].isalpha() else ""
        digits = t[:-1] if unit else t
        if unit not in _UNITS or not digits.isdigit():
            raise InvalidArgumentError(
                f"kvtier.vllm: extra_config['{key}'] = {value!r} is not a size (examples: 4096, 64K, 1M, 200G)")
        n = int(digits) * _UNITS[unit]
    else:
        raise InvalidArgumentError(f"kvtier.vllm: extra_config['{key}'] = {value!r} is not a size")
    if n <= 0:
        raise InvalidArgumentError(f"kvtier.vllm: extra_config['{key}'] = {value!r} must be positive")
    return n


@dataclass(frozen=True)
class KvtierSettings:
    """``kv_connector_extra_config`` as kvtier reads it."""

    storage: str
    namespace: str
    capacity_bytes: Optional[int]  # None: not given (a Redis tier then refuses)
    staging_bytes: int
    knobs: Dict[str, str]

    @property
    def disk(self) -> bool:
        return self.storage.startswith("disk:")


def parse_extra_config(extra: Optional[Mapping[str, Any]]) -> KvtierSettings:
    """kv_connector_extra_config as kvtier's settings; raises ``InvalidArgumentError`` naming a bad key or value."""
    if not isinstance(extra, Mapping) or not extra.get("storage"):
        raise InvalidArgumentError(
            "kvtier.vllm: kv_connector_extra_config must name the tier, e.g. "
            f"{{\"storage\": \"disk:/var/cache/kvtier?durability=process\", \"capacity\": \"200G\"}} (got {extra!r})")
    spec = extra["storage"]
    if not isinstance(spec, str) or not (spec.startswith("disk:") or spec.startswith("redis://")):
        raise InvalidArgumentError(
            f"kvtier.vllm: extra_config['storage'] = {spec!r} is neither 'disk:<dir>[?...]' nor "
            "'redis://host:port[?...]'")
    ns, knobs, ignored = split_extra_config("kvtier.vllm", extra, _OWN_KEYS | _VLLM_KEYS)
    if ignored:
        logger.warning("kvtier.vllm: ignoring kv_connector_extra_config keys %s (neither kvtier's nor vLLM's)",
                       ignored)
    capacity: Optional[int] = None
    if extra.get("capacity") is not None:
        capacity = parse_size("capacity", extra["capacity"])
    elif spec.startswith("disk:"):
        query = dict(parse_qsl(spec.partition("?")[2]))
        if "capacity" in query:
            capacity = parse_size("storage", query["capacity"])
        elif "storage.disk.capacity_bytes" in knobs and knobs["storage.disk.capacity_bytes"] not in ("0", ""):
            capacity = parse_size("storage.disk.capacity_bytes", knobs["storage.disk.capacity_bytes"])
    staging = parse_size("staging_bytes", extra.get("staging_bytes", _DEFAULT_STAGING))
    return KvtierSettings(spec, ns, capacity, staging, knobs)


def namespace_of(config: OffloadingConfig, settings: KvtierSettings, rank: int) -> str:
    """The kvtier namespace of one worker: what must be equal for two processes to share objects."""
    p = config.parallel
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}:{len(g.layer_names)}" for g in config.groups)
    parts = [
        "vllm", f"model={config.model.name}", f"dtype={config.model.dtype}", f"layout={config.kv_cache_layout}",
        f"groups={groups}", f"chunk={config.cache.blocks_per_chunk}x{config.cache.tokens_per_hash}",
        f"block_bytes={config.worker_kv_bytes_per_block}", f"rank={rank}/{p.world_size}",
        f"tp={p.tp_size}", f"pp={p.pp_size}", f"pcp={p.pcp_size}", f"dcp={p.dcp_size}",
    ]
    if settings.disk:
        if p.data_parallel_size > 1:
            parts.append(f"dp={p.data_parallel_index}")  # a disk directory belongs to one process
    else:
        # A shared tier: each engine its own key space, since its index deletes what it evicts.
        parts.append(f"engine={config.engine_id}")
    if settings.namespace:
        parts.append(f"ns={settings.namespace}")
    return "|".join(parts)


def object_key(key: bytes) -> str:
    """The kvtier key (32 hex digits) of one vLLM ``OffloadKey`` (block hash + group index)."""
    return hashlib.blake2b(bytes(key), digest_size=16, person=b"kvtier.vllm").hexdigest()


# ---------------------------------------------------------------------------------------------- specs


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The offloaded side of one job: the chunks' kvtier keys, in the order of the job's device blocks (group by
    group, chunk by chunk); for a store also the keys of chunks the manager evicted (deleted first)."""

    def __init__(self, names: List[str], delete: Optional[List[str]] = None):
        self.names = list(names)
        self.delete = list(delete or [])

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.names)} chunks, {len(self.delete)} deletes)"


@dataclass(frozen=True)
class KvtierOffloadingInfo(ConfigInfo):
    """Static facts of the tier, on vllm:kv_offload_config_info."""

    kvtier_tier: str
    kvtier_capacity_chunks: int
    kvtier_blocks_per_chunk: int


# ---------------------------------------------------------------------------------------------- scheduler side


class _Entry:
    __slots__ = ("ready", "refs")

    def __init__(self) -> None:
        self.ready = False  # False: its store is in flight
        self.refs = 0  # loads in flight


class KvtierOffloadingManager(OffloadingManager):
    """The index of offloaded chunks (scheduler side): which are stored, which are being stored or loaded.

    ``capacity_chunks`` chunks at most; a store that needs room evicts least-recently-used stored chunks that no
    load holds (their objects are deleted by the store job's workers); when there are not enough, ``prepare_store``
    returns None (vLLM counts an allocation failure and does not offload)."""

    def __init__(self, capacity_chunks: int, medium: Medium = Medium.STORAGE, locality: Locality = Locality.LOCAL,
                 enable_events: bool = False, info: Optional[KvtierOffloadingInfo] = None):
        if capacity_chunks <= 0:
            raise InvalidArgumentError(f"kvtier.vllm: capacity of {capacity_chunks} chunks")
        self.capacity_chunks = capacity_chunks
        self.medium = medium
        self.locality = locality
        self._index: "OrderedDict[bytes, _Entry]" = OrderedDict()  # least recently used first
        self._events: Optional[List[OffloadingEvent]] = [] if enable_events else None
        self._info = info.as_config_info() if info is not None else {}
        self.stats = {"stores": 0, "stored": 0, "store_failures": 0, "evicted": 0, "loads": 0, "refused": 0}

    # the index

    def __len__(self) -> int:
        return len(self._index)

    def _event(self, keys: List[OffloadKey], removed: bool, **more: Any) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=removed,
                                                locality=self.locality, **more))

    # OffloadingManager

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        e = self._index.get(bytes(key))
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT if e.ready else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.DISK if self.locality is Locality.LOCAL else CacheHitSource.EXTERNAL_UNSPECIFIED

    def prepare_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        for key in keys:
            e = self._index.get(bytes(key))
            if e is None or not e.ready:
                raise InvalidArgumentError(
                    f"kvtier.vllm: prepare_load of chunk {bytes(key).hex()}, which is "
                    f"{'not stored' if e is None else 'still being stored'}")
        for key in keys:
            e = self._index[bytes(key)]
            e.refs += 1
            self._index.move_to_end(bytes(key))
        self.stats["loads"] += len(keys)
        return KvtierLoadStoreSpec([object_key(k) for k in keys])

    def complete_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            e = self._index.get(bytes(key))
            if e is not None and e.refs > 0:
                e.refs -= 1

    def prepare_store(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        keys = list(dict.fromkeys(keys))
        to_store = [k for k in keys if bytes(k) not in self._index]
        for k in keys:
            if bytes(k) in self._index:
                self._index.move_to_end(bytes(k))
        if not to_store:
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec([]), evicted_keys=[])
        need = len(self._index) + len(to_store) - self.capacity_chunks
        evicted: List[bytes] = []
        if need > 0:
            protected = {bytes(k) for k in keys}
            for k, e in self._index.items():  # least recently used first
                if len(evicted) == need:
                    break
                if e.ready and e.refs == 0 and k not in protected:
                    evicted.append(k)
            if len(evicted) < need:
                self.stats["refused"] += len(to_store)
                return None
            for k in evicted:
                del self._index[k]
            self.stats["evicted"] += len(evicted)
            self._event([OffloadKey(k) for k in evicted], removed=True)
        for k in to_store:
            self._index[bytes(k)] = _Entry()
        self.stats["stores"] += len(to_store)
        spec = KvtierLoadStoreSpec([object_key(k) for k in to_store], [object_key(k) for k in evicted])
        return PrepareStoreOutput(keys_to_store=list(to_store), store_spec=spec,
                                  evicted_keys=[OffloadKey(k) for k in evicted])

    def complete_store(self, keys: Iterable[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        done: List[OffloadKey] = []
        for key in keys:
            e = self._index.get(bytes(key))
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                self._index.move_to_end(bytes(key))
            else:
                del self._index[bytes(key)]
            done.append(key)
        if success:
            self.stats["stored"] += len(done)
            self._event(done, removed=False, removal_expected=True, req_context=req_context)
        else:
            self.stats["store_failures"] += len(done)
            self._event(done, removed=True, metadata_only=True)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forgets every chunk (vLLM's reset_prefix_cache). The objects stay on the tier until overwritten or
        evicted by the tier's own capacity; this index never reports them again."""
        self._index.clear()

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return [self._info]


# ---------------------------------------------------------------------------------------------- worker side


@dataclass
class _Region:
    """One data reference of a group: rows of a canonical (num_blocks, page) byte tensor."""

    tensor: Any  # torch.uint8 view, (num_blocks, row_bytes)
    array: Any  # the same memory as a numpy array (CPU tensors), else None
    base: int
    row_stride: int
    num_blocks: int
    page_bytes: int
    offset: int  # where its pages start in the chunk's object


@dataclass
class _GroupMoves:
    """The blocks of one KV cache group in a job: chunks [first, first + count) of the job, each an object of
    ``object_bytes``; per region the (chunk - first, slot, row) of every block moved."""

    first: int
    count: int
    object_bytes: int
    moves: List[Tuple[_Region, Any, Any, Any]]  # region, chunk, slot, row (int64 numpy arrays)


@dataclass
class _Plan:
    names: List[str]
    groups: List[_GroupMoves]
    total_bytes: int

    def object_bytes(self) -> List[int]:
        out: List[int] = []
        for g in self.groups:
            out += [g.object_bytes] * g.count
        return out


class _Job:
    __slots__ = ("job_id", "future", "bytes", "start", "is_store")

    def __init__(self, job_id: int, future: Future, nbytes: int, is_store: bool):
        self.job_id = job_id
        self.future = future
        self.bytes = nbytes
        self.start = time.perf_counter()
        self.is_store = is_store


class _JobFailed(Exception):
    pass


class KvtierOffloadingWorker(OffloadingWorker):
    """Moves chunks between vLLM's KV tensors and a kvtier storage tier (worker side).

    Stores run in submission order on one thread (so a chunk evicted by one store and stored again by a later
    one is deleted before it is written); loads run on their own thread, never behind stores. A job gathers
    (store) or scatters (load) through a staging buffer of at most ``staging_bytes`` per storage batch, pinned
    when the KV tensors are on a GPU, with the copies on a side stream that waits for the engine's stream."""

    def __init__(self, kv_caches: CanonicalKVCaches, store: Any, blocks_per_chunk: int,
                 staging_bytes: int = _DEFAULT_STAGING):
        self.store = store
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.staging_bytes = int(staging_bytes)
        self.last_error: Optional[str] = None
        self._groups: List[List[_Region]] = []
        self._object_bytes: List[int] = []
        self._device = None
        for g, refs in enumerate(kv_caches.group_data_refs):
            regions: List[_Region] = []
            offset = 0
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx].tensor
                if t.dim() != 2 or t.stride(1) != 1 or t.element_size() != 1:
                    raise NotSupportedError(
                        f"kvtier.vllm: KV tensor {ref.tensor_idx} of group {g} is not a (num_blocks, bytes) byte "
                        f"tensor (shape {tuple(t.shape)}, strides {t.stride()}, dtype {t.dtype})")
                if ref.page_size_bytes > t.shape[1]:
                    raise InvalidArgumentError(
                        f"kvtier.vllm: group {g}: page of {ref.page_size_bytes} bytes in rows of {t.shape[1]}")
                if self._device is None:
                    self._device = t.device
                elif t.device != self._device:
                    raise NotSupportedError(f"kvtier.vllm: KV tensors on {self._device} and {t.device}")
                u = t if t.dtype == torch.uint8 else t.view(torch.uint8)
                arr = u.numpy() if u.device.type == "cpu" else None
                regions.append(_Region(u, arr, t.data_ptr(), t.stride(0), t.shape[0], ref.page_size_bytes, offset))
                offset += ref.page_size_bytes * self.blocks_per_chunk
            self._groups.append(regions)
            self._object_bytes.append(offset)
        if self._device is not None and self._device.type not in ("cuda", "cpu"):
            raise NotSupportedError(f"kvtier.vllm: KV tensors on {self._device}: CUDA (or ROCm) GPUs and the CPU only")
        self._cuda = self._device is not None and self._device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self._device) if self._cuda else None
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-store")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load")
        self._jobs: Dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._logged: set = set()
        self.stats = {"stored_chunks": 0, "loaded_chunks": 0, "failed_jobs": 0, "deleted_chunks": 0}

    def object_bytes(self, group: int) -> int:
        """The size of one chunk's object of a KV cache group (this rank's bytes of every layer of it)."""
        return self._object_bytes[group]

    # ------------------------------------------------------------------ resolving a job

    def _plan(self, ptrs: DevicePointers, names: List[str], is_store: bool) -> _Plan:
        """Device pointers (vLLM's order: group by group, data reference by data reference, block by block) as
        moves between tensor rows and (chunk, slot) places of the objects."""
        bpc = self.blocks_per_chunk
        counts = tuple(ptrs.group_block_counts)
        if len(counts) != len(self._groups):
            raise _JobFailed(f"{len(counts)} KV cache groups in the job, {len(self._groups)} registered")
        all_ptrs = np.asarray(ptrs.ptrs, dtype=np.uint64).astype(np.int64)
        all_sizes = np.asarray(ptrs.sizes, dtype=np.uint64).astype(np.int64)
        chunk0 = at = total = 0
        groups: List[_GroupMoves] = []
        for g, (n_blocks, n_refs, block_idx) in enumerate(zip(counts, ptrs.group_data_ref_counts,
                                                              ptrs.block_indices)):
            if n_blocks == 0:
                continue
            regions = self._groups[g]
            if n_refs != len(regions):
                raise _JobFailed(f"group {g}: {n_refs} data references in the job, {len(regions)} registered")
            skip = int(block_idx) % bpc
            n_chunks = (n_blocks + skip + bpc - 1) // bpc
            if is_store and (skip or n_blocks % bpc):
                raise _JobFailed(f"group {g}: a store of {n_blocks} blocks from block {block_idx} is not whole "
                                 f"chunks of {bpc} blocks")
            pos = np.arange(skip, skip + n_blocks, dtype=np.int64)
            chunk, slot = pos // bpc, pos % bpc
            moves = []
            for r in regions:
                seg, sizes = all_ptrs[at:at + n_blocks], all_sizes[at:at + n_blocks]
                off = seg - r.base
                bad = (sizes != r.page_bytes) | (off < 0) | (off % r.row_stride != 0) | (
                    off // r.row_stride >= r.num_blocks)
                if len(seg) != n_blocks or bad.any():
                    i = int(np.argmax(bad)) if len(seg) and bad.any() else 0
                    what = f"{int(seg[i]):#x} of {int(sizes[i])} bytes" if len(seg) else "(missing)"
                    raise _JobFailed(f"group {g}: device pointer {what} is not a block of its KV tensor (base "
                                     f"{r.base:#x}, {r.num_blocks} rows of {r.row_stride} bytes, pages of "
                                     f"{r.page_bytes})")
                at += n_blocks
                moves.append((r, chunk, slot, off // r.row_stride))
                total += n_blocks * r.page_bytes
            groups.append(_GroupMoves(chunk0, n_chunks, self._object_bytes[g], moves))
            chunk0 += n_chunks
        if at != len(all_ptrs):
            raise _JobFailed(f"{len(all_ptrs)} device pointers, {at} expected from the group counts")
        if chunk0 != len(names):
            raise _JobFailed(f"{len(names)} chunk keys for {chunk0} chunks of device blocks")
        return _Plan(list(names), groups, total)

    # ------------------------------------------------------------------ the copies (on the job threads)

    def _batches(self, sizes: List[int]) -> List[Tuple[int, int]]:
        """Chunk ranges [a, b) whose objects fit in staging_bytes (one chunk at least)."""
        out = []
        a = 0
        while a < len(sizes):
            b, size = a, 0
            while b < len(sizes) and (b == a or size + sizes[b] <= self.staging_bytes):
                size += sizes[b]
                b += 1
            out.append((a, b))
            a = b
        return out

    def _staging(self, sizes: List[int]) -> Tuple[Any, Any, List[int]]:
        """A staging buffer for objects of ``sizes`` (pinned for a GPU): the tensor, a numpy view, the offsets."""
        starts, at = [], 0
        for s in sizes:
            starts.append(at)
            at += s
        t = torch.empty(at, dtype=torch.uint8, pin_memory=self._cuda)
        return t, t.numpy(), starts

    def _pages(self, plan: _Plan, staging: Any, starts: List[int], a: int, b: int):
        """For chunks [a, b) in ``staging`` (numpy; chunk i at byte starts[i - a]): per region a (chunks, bpc,
        page) view of its pages there, the (chunk, slot) places of its moves in that view and their tensor rows."""
        bpc = self.blocks_per_chunk
        for g in plan.groups:
            lo, hi = max(a, g.first), min(b, g.first + g.count)
            if lo >= hi:
                continue
            n = hi - lo
            objects = staging[starts[lo - a]:starts[lo - a] + n * g.object_bytes].reshape(n, g.object_bytes)
            for r, chunk, slot, rows in g.moves:
                sel = (chunk + g.first >= lo) & (chunk + g.first < hi)
                if not sel.any():
                    continue
                view = objects[:, r.offset:r.offset + bpc * r.page_bytes].reshape(n, bpc, r.page_bytes)
                yield r, view, chunk[sel] + g.first - lo, slot[sel], rows[sel]

    def _run_store(self, plan: _Plan, delete: List[str], ready: Any) -> int:
        if delete:
            res = self.store.delete_many(delete)
            self.stats["deleted_chunks"] += sum(1 for x in res if isinstance(x, int))
        if not plan.names:
            return 0
        sizes = plan.object_bytes()
        written: List[str] = []
        try:
            if self._cuda:
                torch.cuda.set_device(self._device)
                self._stream.wait_event(ready)  # the blocks are final once the engine's stream got there
            for a, b in self._batches(sizes):
                staging, host, starts = self._staging(sizes[a:b])
                for r, view, ci, si, rows in self._pages(plan, host, starts, a, b):
                    if self._cuda:
                        with torch.cuda.stream(self._stream):
                            idx = torch.from_numpy(rows).to(self._device)
                            pages = r.tensor.index_select(0, idx)[:, :r.page_bytes].cpu().numpy()
                    else:
                        pages = r.array[rows, :r.page_bytes]
                    view[ci, si] = pages
                base = staging.data_ptr()
                results = self.store.put_many(plan.names[a:b], [(base + starts[i], sizes[a + i])
                                                                 for i in range(b - a)])
                for i, res in enumerate(results):
                    if not (isinstance(res, int) and res == sizes[a + i]):
                        raise _JobFailed(f"writing chunk {plan.names[a + i]}: {res}")
                    written.append(plan.names[a + i])
        except BaseException:
            if written:  # the index drops every chunk of a failed job: free the space of those written
                try:
                    self.store.delete_many(written)
                except Exception:  # noqa: BLE001 (best effort; the tier's capacity evicts them anyway)
                    pass
            raise
        self.stats["stored_chunks"] += len(written)
        return plan.total_bytes

    def _run_load(self, plan: _Plan) -> int:
        sizes = plan.object_bytes()
        if self._cuda:
            torch.cuda.set_device(self._device)
        for a, b in self._batches(sizes):
            staging, host, starts = self._staging(sizes[a:b])
            base = staging.data_ptr()
            results = self.store.get_many(plan.names[a:b], [(base + starts[i], sizes[a + i]) for i in range(b - a)])
            for i, res in enumerate(results):  # every object whole and verified before a byte is scattered
                if not (isinstance(res, int) and res == sizes[a + i]):
                    what = res if not isinstance(res, int) else (
                        f"object of {res} bytes where the chunk has {sizes[a + i]}")
                    raise _JobFailed(f"reading chunk {plan.names[a + i]}: {what}")
            for r, view, ci, si, rows in self._pages(plan, host, starts, a, b):
                pages = view[ci, si]
                if self._cuda:
                    with torch.cuda.stream(self._stream):
                        idx = torch.from_numpy(rows).to(self._device)
                        r.tensor[idx, :r.page_bytes] = torch.from_numpy(pages).to(self._device)
                else:
                    r.array[rows, :r.page_bytes] = pages
            if self._cuda:
                self._stream.synchronize()  # the blocks are in place before the job is reported done
        self.stats["loaded_chunks"] += len(plan.names)
        return plan.total_bytes

    # ------------------------------------------------------------------ OffloadingWorker

    def _submit(self, job_id: int, ptrs: DevicePointers, spec: LoadStoreSpec, is_store: bool) -> bool:
        if not isinstance(spec, KvtierLoadStoreSpec):
            raise InvalidArgumentError(f"kvtier.vllm: job {job_id} has a {type(spec).__name__}, not a "
                                       "KvtierLoadStoreSpec")
        ready = None
        try:
            plan = self._plan(ptrs, spec.names, is_store)
            if self._cuda and is_store:
                ready = torch.cuda.Event()
                ready.record()  # the engine's stream: the blocks are final once it reaches here
        except _JobFailed as e:
            fut: Future = Future()
            fut.set_exception(e)
            with self._lock:
                self._jobs[job_id] = _Job(job_id, fut, 0, is_store)
            return True
        if is_store:
            fut = self._store_pool.submit(self._run_store, plan, spec.delete, ready)
        else:
            fut = self._load_pool.submit(self._run_load, plan)
        with self._lock:
            self._jobs[job_id] = _Job(job_id, fut, plan.total_bytes, is_store)
        return True

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, device_ptrs, dst_spec, True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, device_ptrs, src_spec, False)

    def _fail(self, job: _Job, err: BaseException) -> None:
        reason = f"{'store' if job.is_store else 'load'} job {job.job_id}: {err}"
        self.last_error = reason
        self.stats["failed_jobs"] += 1
        kind = f"{type(err).__name__}:{'store' if job.is_store else 'load'}"
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("kvtier.vllm: %s (the job fails: %s)", reason,
                           "its chunks are not offloaded" if job.is_store else "vLLM recomputes its blocks")
        else:
            logger.debug("kvtier.vllm: %s", reason)

    def get_finished(self) -> List[TransferResult]:
        with self._lock:
            done = [j for j in self._jobs.values() if j.future.done()]
            for j in done:
                del self._jobs[j.job_id]
        out = []
        for j in done:
            err = j.future.exception()
            if err is not None:
                self._fail(j, err)
            out.append(TransferResult(job_id=j.job_id, success=err is None,
                                      transfer_size=j.bytes if err is None else None,
                                      transfer_time=(time.perf_counter() - j.start) if err is None else None))
        return out

    def wait(self, job_ids: set) -> None:
        for job_id in job_ids:
            with self._lock:
                j = self._jobs.get(job_id)
            if j is not None:
                try:
                    j.future.result()
                except BaseException:  # noqa: BLE001 (reported by get_finished)
                    pass

    def shutdown(self) -> None:
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------- the spec


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec on kvtier (see the module's doc). vLLM constructs it on the scheduler (rank 0)
    and on every worker, as ``KvtierOffloadingSpec(OffloadingConfig)``."""

    @classmethod
    def config_info_keys(cls, extra_config: Dict[str, Any]) -> Tuple[str, ...]:
        return KvtierOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.settings = parse_extra_config(config.extra_config)
        if config.canonical_layout:
            raise NotSupportedError(
                "kvtier.vllm: kv_connector_extra_config['canonical_layout'] = True (vLLM's parallelism-free page "
                "layout) is not supported: kvtier stores each worker's own bytes; leave it unset")
        if not config.groups:
            raise NotSupportedError("kvtier.vllm: no KV cache group to offload")
        if config.worker_kv_bytes_per_block <= 0:
            raise NotSupportedError(
                "kvtier.vllm: vLLM gives no KV bytes per block (worker_kv_bytes_per_block = "
                f"{config.worker_kv_bytes_per_block}; host-resident HiSparse caches): the tier cannot be sized")
        chunk_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.chunk_bytes = chunk_bytes
        cap = self.settings.capacity_bytes
        if cap is None:
            raise InvalidArgumentError(
                f"kvtier.vllm: the tier '{self.settings.storage}' has no capacity: set kv_connector_extra_config"
                "['capacity'] (bytes per worker, e.g. \"200G\")" + (
                    " or the disk spec's ?capacity=" if self.settings.disk else ""))
        per_chunk = chunk_bytes
        if self.settings.disk:
            per_chunk = -(-chunk_bytes // 4096) * 4096 + _DISK_OBJECT_OVERHEAD
        self.capacity_chunks = cap // per_chunk
        if self.capacity_chunks < 1:
            raise InvalidArgumentError(
                f"kvtier.vllm: capacity {cap} bytes holds no chunk of {per_chunk} bytes (on the tier)")
        self.medium = Medium.STORAGE
        self.locality = Locality.LOCAL if self.settings.disk else Locality.REMOTE
        self._manager: Optional[KvtierOffloadingManager] = None
        self._worker: Optional[KvtierOffloadingWorker] = None
        self.store: Any = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            info = KvtierOffloadingInfo(self.settings.storage.split("?")[0].split("@")[-1],
                                        self.capacity_chunks, self.blocks_per_chunk)
            self._manager = KvtierOffloadingManager(
                self.capacity_chunks, self.medium, self.locality,
                enable_events=self.kv_events_config.enable_kv_cache_events, info=info)
        return self._manager

    def open_store(self, rank: Optional[int] = None) -> Any:
        """The kvtier storage tier of one worker rank (default: this process's rank)."""
        r = self.config.parallel.rank if rank is None else rank
        return _native.StorageBackend.open(self.settings.storage, namespace_of(self.config, self.settings, r),
                                           self.settings.knobs)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.store is None:
                self.store = self.open_store()  # first: a bad storage knob is named before anything else
            if len(kv_caches.group_data_refs) != len(self.config.groups):
                raise NotSupportedError(
                    f"kvtier.vllm: {len(kv_caches.group_data_refs)} KV cache groups registered, "
                    f"{len(self.config.groups)} configured")
            self._worker = KvtierOffloadingWorker(kv_caches, self.store, self.blocks_per_chunk,
                                                  self.settings.staging_bytes)
            logger.info("kvtier.vllm: rank %d: %s tier %s, %d groups, chunk objects of %s bytes",
                        self.config.parallel.rank, self.store.name, self.settings.storage.split("?")[0],
                        len(kv_caches.group_data_refs),
                        [self._worker.object_bytes(g) for g in range(len(kv_caches.group_data_refs))])
        return self._worker
