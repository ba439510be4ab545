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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qsl

from . import _native
from ._engine_config import split_extra_config
from .errors import InvalidArgumentError, NotSupportedError

try:
    import torch  # noqa: F401 (kvtier._chunk_mover's copies)
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

from ._chunk_mover import DEFAULT_STAGING as _DEFAULT_STAGING  # noqa: E402 (after the import check above)
from ._chunk_mover import ChunkMover  # noqa: E402

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


class KvtierOffloadingWorker(OffloadingWorker):
    """Moves chunks between vLLM's KV tensors and a kvtier storage tier (worker side): vLLM's calls on
    :class:`kvtier._chunk_mover.ChunkMover`.

    Stores run in submission order on one thread (so a chunk evicted by one store and stored again by a later
    one is deleted before it is written); loads run on their own thread, never behind stores. A job gathers
    (store) or scatters (load) through a staging buffer of at most ``staging_bytes`` per storage batch, pinned
    when the KV tensors are on a GPU, with the copies on a side stream that waits for the engine's stream."""

    def __init__(self, kv_caches: CanonicalKVCaches, store: Any, blocks_per_chunk: int,
                 staging_bytes: int = _DEFAULT_STAGING):
        groups = [[(kv_caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes) for ref in refs]
                  for refs in kv_caches.group_data_refs]
        self._mover = ChunkMover(groups, store, blocks_per_chunk, staging_bytes)

    @property
    def store(self) -> Any:
        """The storage tier the worker reads and writes (kvtier.StorageBackend)."""
        return self._mover.store

    @store.setter
    def store(self, store: Any) -> None:
        self._mover.store = store

    @property
    def stats(self) -> Dict[str, int]:
        return self._mover.stats

    @property
    def last_error(self) -> Optional[str]:
        return self._mover.last_error

    def object_bytes(self, group: int) -> int:
        """The size of one chunk's object of a KV cache group (this rank's bytes of every layer of it)."""
        return self._mover.object_bytes(group)

    def _submit(self, job_id: int, ptrs: DevicePointers, spec: LoadStoreSpec, is_store: bool) -> bool:
        if not isinstance(spec, KvtierLoadStoreSpec):
            raise InvalidArgumentError(f"kvtier.vllm: job {job_id} has a {type(spec).__name__}, not a "
                                       "KvtierLoadStoreSpec")
        self._mover.submit(job_id, ptrs, spec.names, spec.delete if is_store else [], is_store)
        return True

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, device_ptrs, dst_spec, True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, device_ptrs, src_spec, False)

    def get_finished(self) -> List[TransferResult]:
        return [TransferResult(job_id=f.job_id, success=f.success, transfer_size=f.bytes, transfer_time=f.seconds)
                for f in self._mover.finished()]

    def wait(self, job_ids: set) -> None:
        self._mover.wait(job_ids)

    def shutdown(self) -> None:
        self._mover.shutdown()


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
