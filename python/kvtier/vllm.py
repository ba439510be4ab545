"""vLLM's native KV offloading (v1 ``OffloadingConnector``) onto kvtier's storage tiers.

:class:`KvtierOffloadingSpec` is an ``OffloadingSpec`` (``vllm/v1/kv_offload/base.py``, vLLM 0.34.0): vLLM
offloads chunks of its paged KV cache to a kvtier disk tier (io_uring, capacity, checksums) or a Redis /
Redis Cluster tier, and loads them back on a prefix hit. vLLM loads it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "storage": "disk:/var/cache/kvtier?capacity=200G&durability=process"}}'

(docs/engines.md has the whole story.) ``kv_connector_extra_config`` keys:

- ``storage`` (required): kvtier's storage spec, ``disk:<dir>[?...]``, ``redis://host:port[?...]`` or
  ``memory:?capacity=<bytes>`` (this worker's RAM) (:meth:`kvtier.StorageBackend.open`);
- ``capacity``: bytes each worker's tier holds for this engine (``"200G"``, an integer); default: the disk
  spec's ``capacity=`` or the ``storage.disk.capacity_bytes`` knob; required for Redis;
- ``namespace``: a string added to the namespace (deployments that share a tier but not pages);
- ``staging_bytes``: the most bytes one worker gathers per storage batch (default ``64M``);
- ``cache.device_policy``: the eviction policy of the scheduler's index of stored chunks (kvtier's
  ``CacheManager``): ``lru`` (default), ``s3fifo``, ``sieve``, ``arc``, ``lrfu[:boost]``, ``adaptive`` or
  ``duel:A+B[+...]`` (docs/configuration.md);
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

The scheduler side (:class:`KvtierOffloadingManager`) keeps the index of stored chunks in kvtier's
``CacheManager``: capacity in chunks, its eviction policy over chunks no load holds, evicted chunks deleted
from the tier by the next store job. The worker side (:class:`KvtierOffloadingWorker`) gathers the chunk's blocks from vLLM's
KV tensors (GPU or CPU) into a staging buffer (pinned for a GPU) and writes it with one storage batch,
or reads and verifies the objects first and scatters them into the KV tensors after.

Failures are misses, never garbage: a job is reported successful only when every object was written
(store) or read whole, verified and of the chunk's exact size (load). A failed store drops its chunks from
the index (``complete_store(success=False)``), and the next store job deletes its objects on every rank; a
failed load is reported failed and vLLM recomputes its blocks where its kv_transfer_config says
``kv_load_failure_policy="recompute"`` (its default, "fail", fails the request; docs/engines.md, "Failures are
misses"; a load of several batches may have scattered the batches before the one that failed into them: they are
recomputed all the same).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qsl

from . import _native
from ._engine_config import split_extra_config
from .errors import (FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError,
                     NotSupportedError, OutOfRangeError, ResourceExhaustedError)

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
        ScheduleEndContext,
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
    "self_describing_kv_events", "sync_load_budget_bytes",
})
# kv_transfer_config fields that are easily put into kv_connector_extra_config, where vLLM never reads them.
_TRANSFER_CONFIG_KEYS = frozenset({"kv_load_failure_policy"})
_OWN_KEYS = frozenset({"storage", "capacity", "namespace", "staging_bytes", "cache.device_policy"})
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# What one object costs on a disk tier beyond its payload rounded to 4 KiB: its header block, and slack.
_DISK_OBJECT_OVERHEAD = 8192
# On a memory tier: its header (a fixed part and the roles table, rounded to 8 bytes), bounded.
_MEMORY_OBJECT_OVERHEAD = 4096


# ---------------------------------------------------------------------------------------------- configuration


def _shown(spec: Any) -> Any:
    """A storage spec as errors and logs show it (a password redacted)."""
    return _native.StorageBackend.redacted_spec(spec) if isinstance(spec, str) else spec


_MAX_CHUNKS = (1 << 32) - 1  # the index's blocks (32-bit ids)


def parse_size(key: str, value: Any, shown: Optional[str] = None) -> int:
    """A byte count: an integer, or a string like ``4096``, ``64K``, ``200G`` (binary units, optional ``B``).
    Errors name ``extra_config['key']``, or ``shown`` where the value came from elsewhere."""
    what = shown if shown is not None else f"extra_config['{key}']"
    if isinstance(value, bool):
        raise InvalidArgumentError(f"kvtier.vllm: {what} = {value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        t = value.strip().upper()
        if t.endswith("B") and len(t) > 1 and t[-2].isalpha():
            t = t[:-1]
        unit = t[-1:] if t[-1:].isalpha() else ""
        digits = t[:-1] if unit else t
        # ASCII digits only: str.isdigit() also takes superscripts ("²", which int() then refuses with a bare
        # ValueError) and other scripts' digits ("٣", which int() reads as 3).
        if unit not in _UNITS or not (digits.isascii() and digits.isdigit()):
            raise InvalidArgumentError(
                f"kvtier.vllm: {what} = {value!r} is not a size (examples: 4096, 64K, 1M, 200G)")
        n = int(digits) * _UNITS[unit]
    else:
        raise InvalidArgumentError(f"kvtier.vllm: {what} = {value!r} is not a size")
    if n <= 0:
        raise InvalidArgumentError(f"kvtier.vllm: {what} = {value!r} must be positive")
    return n


@dataclass(frozen=True)
class KvtierSettings:
    """``kv_connector_extra_config`` as kvtier reads it."""

    storage: str
    namespace: str
    capacity_bytes: Optional[int]  # None: not given (a Redis tier then refuses)
    staging_bytes: int
    knobs: Dict[str, str]
    policy: str = "lru"  # the index's eviction policy (cache.device_policy)

    @property
    def disk(self) -> bool:
        return self.storage.startswith("disk:")

    @property
    def memory(self) -> bool:
        return self.storage.startswith("memory:")

    @property
    def pinned(self) -> bool:
        """The chunks in the worker's own pinned memory, copied straight from and to the GPU."""
        return self.storage.startswith("pinned:")

    @property
    def local(self) -> bool:
        """A tier of this process or this host alone (disk, memory, pinned), not shared by engines (Redis)."""
        return self.disk or self.memory or self.pinned


def parse_extra_config(extra: Optional[Mapping[str, Any]]) -> KvtierSettings:
    """kv_connector_extra_config as kvtier's settings; raises ``InvalidArgumentError`` naming a bad key or value."""
    if not isinstance(extra, Mapping) or not extra.get("storage"):
        raise InvalidArgumentError(
            "kvtier.vllm: kv_connector_extra_config must name the tier, e.g. "
            f"{{\"storage\": \"disk:/var/cache/kvtier?durability=process\", \"capacity\": \"200G\"}} (got {extra!r})")
    spec = extra["storage"]
    if not isinstance(spec, str) or not spec.startswith(("disk:", "redis://", "memory:", "pinned:")):
        raise InvalidArgumentError(
            f"kvtier.vllm: extra_config['storage'] = {_shown(spec)!r} is not 'disk:<dir>[?...]', "
            "'redis://host:port[?...]', 'memory:?capacity=<bytes>' or 'pinned:?capacity=<bytes>'")
    if spec.startswith("pinned:"):
        rest, _, query = spec[len("pinned:"):].partition("?")
        unknown = [k for k, _ in parse_qsl(query) if k != "capacity"]
        if rest or unknown:
            raise InvalidArgumentError(f"kvtier.vllm: extra_config['storage'] = {spec!r}: the pinned tier takes "
                                       "'pinned:?capacity=<bytes>' and nothing else")
    ns, knobs, ignored = split_extra_config("kvtier.vllm", extra, _OWN_KEYS | _VLLM_KEYS | _TRANSFER_CONFIG_KEYS)
    for key in sorted(_TRANSFER_CONFIG_KEYS & set(extra)):
        logger.warning("kvtier.vllm: %r is a field of kv_transfer_config, not of kv_connector_extra_config: vLLM "
                       "does not read it here (give it beside kv_connector_extra_config; docs/engines.md, "
                       "'Failures are misses')", key)
    if ignored:
        logger.warning("kvtier.vllm: ignoring kv_connector_extra_config keys %s (neither kvtier's nor vLLM's)",
                       ignored)
    capacity: Optional[int] = None
    tier_capacity: Optional[int] = None  # what the tier itself holds, where the spec or a knob says
    if spec.startswith(("disk:", "memory:", "pinned:")):
        query = dict(parse_qsl(spec.partition("?")[2]))
        if "capacity" in query:
            tier_capacity = parse_size("storage", query["capacity"], shown="the storage spec's ?capacity")
        elif (spec.startswith("disk:") and "storage.disk.capacity_bytes" in knobs and
              knobs["storage.disk.capacity_bytes"] not in ("0", "")):
            tier_capacity = parse_size("storage.disk.capacity_bytes", knobs["storage.disk.capacity_bytes"])
    if extra.get("capacity") is not None:
        capacity = parse_size("capacity", extra["capacity"])
        if tier_capacity is not None and capacity > tier_capacity:
            # The index would count chunks the tier has evicted behind it: loads of them fail, and a lost chunk
            # stays indexed (docs/engines.md, "Failures are misses").
            raise InvalidArgumentError(
                f"kvtier.vllm: extra_config['capacity'] = {extra['capacity']!r} ({capacity} bytes) is more than the "
                f"tier holds ({tier_capacity} bytes, its spec's ?capacity or storage.disk.capacity_bytes): the tier "
                "would evict chunks the index still counts; give one capacity, or a smaller one here")
    else:
        capacity = tier_capacity
    staging = parse_size("staging_bytes", extra.get("staging_bytes", _DEFAULT_STAGING))
    policy = extra.get("cache.device_policy", "lru")
    if not isinstance(policy, str) or not policy:
        raise InvalidArgumentError(f"kvtier.vllm: extra_config['cache.device_policy'] = {policy!r} is not a policy "
                                   "name (lru, s3fifo, sieve, arc, lrfu[:boost], adaptive, duel:A+B)")
    return KvtierSettings(spec, ns, capacity, staging, knobs, policy)


def namespace_of(config: OffloadingConfig, settings: KvtierSettings, rank: int) -> str:
    """The kvtier namespace of one worker: what must be equal for two processes to share objects."""
    p = config.parallel
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}:{len(g.layer_names)}" for g in config.groups)
    parts = [
        "vllm", f"model={config.model.name}", f"dtype={config.model.dtype}", f"layout={config.kv_cache_layout}",
        f"groups={groups}", f"chunk={config.cache.blocks_per_chunk}x{config.cache.tokens_per_hash}",
        f"block_bytes={config.worker_kv_bytes_per_block}", f"rank={rank}/{p.world_size}",
        f"tp={p.tp_size}", f"pp={p.pp_size}", f"pcp={p.pcp_size}", f"dcp={p.dcp_size}",
        # A chunk's object holds its blocks one after the other, each block's pages in data-reference order (the
        # objects of earlier versions, data reference by data reference, are in another namespace: never read).
        "objects=block-major",
    ]
    if settings.local:
        if p.data_parallel_size > 1:
            parts.append(f"dp={p.data_parallel_index}")  # a disk directory (a memory tier) belongs to one process
    else:
        # A shared tier: each engine its own key space, since its index deletes what it evicts.
        parts.append(f"engine={config.engine_id}")
    if settings.namespace:
        parts.append(f"ns={settings.namespace}")
    return "|".join(parts)


HINT_ACTION = "kvtier.request_hints"


def request_hints(envelope: Any) -> Dict[str, Any]:
    """kvtier's hints for one request from vLLM's KV hints (``kv_hints`` of the request: an envelope of actions), as
    keyword arguments of ``CacheManager.announce``. The action is ``action_type`` "kvtier.request_hints" with a
    payload of any of ``conversation_id`` (an integer, or a string hashed to one), ``continuation`` ("unknown",
    "continues", "last_turn"), ``ttl_steps`` (protection kept after the request leaves the queue, in scheduler
    steps) and ``priority`` (an integer, higher first). Hints are advice: a malformed one is logged and ignored,
    never fails the request; the other hints, of the same payload or of other actions, still apply."""
    out: Dict[str, Any] = {}
    for action in getattr(envelope, "actions", None) or ():
        if getattr(action, "action_type", None) != HINT_ACTION:
            continue
        payload = getattr(action, "payload", None) or {}

        def ignore(what: str) -> None:
            logger.warning("kvtier.vllm: ignoring a request hint of action %r: %s", getattr(action, "action_id", "?"),
                           what)

        if not isinstance(payload, Mapping):
            ignore(f"payload is a {type(payload).__name__}, not a mapping")
            continue
        if "conversation_id" in payload:
            cid = payload["conversation_id"]
            # An integer that fits 64 bits is the id; anything else (a string, a larger integer) is hashed to one,
            # so that ids differing by 2**64 do not collide.
            fits = isinstance(cid, int) and not isinstance(cid, bool) and 0 <= cid < (1 << 64)
            try:
                out["conversation_id"] = (cid if fits else int.from_bytes(
                    hashlib.blake2b(str(cid).encode(), digest_size=8).digest(), "little"))
            except (ValueError, TypeError) as e:  # a str() that raises; a lone surrogate (UnicodeError)
                ignore(f"conversation_id: {e}")
        if "continuation" in payload:
            c = payload["continuation"]
            if isinstance(c, str) and c in ("unknown", "continues", "last_turn"):
                out["continuation"] = c
            else:
                ignore(f"continuation {c!r} is not 'unknown', 'continues' or 'last_turn'")
        for name, lo, hi in (("ttl_steps", 0, (1 << 32) - 1), ("priority", -(1 << 31), (1 << 31) - 1)):
            if name in payload:
                v = payload[name]
                if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi:
                    out[name] = v
                else:
                    ignore(f"{name} {v!r} is not an integer in [{lo}, {hi}]")
    return out


def _key_bytes(key: Any) -> bytes:
    """An ``OffloadKey`` (bytes) as bytes; anything else refused, naming it (``bytes(7)`` is seven zero bytes)."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"kvtier.vllm: offload key {key!r} is a {type(key).__name__}, not bytes (an "
                                   "OffloadKey: block hash + group index)")
    return bytes(key)


def object_key(key: bytes) -> str:
    """The kvtier key (32 hex digits) of one vLLM ``OffloadKey`` (block hash + group index)."""
    return hashlib.blake2b(_key_bytes(key), digest_size=16, person=b"kvtier.vllm").hexdigest()


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


def _serialized(method: Any) -> Any:
    """One call of the manager at a time: its dictionaries and the native index change together, and a scheduler
    that calls from several threads (a lookup beside a store) would otherwise corrupt both."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class KvtierOffloadingManager(OffloadingManager):
    """The index of offloaded chunks (scheduler side), kept by kvtier's ``CacheManager``.

    Each chunk (``OffloadKey``, under its :func:`object_key`) is one block of its KV cache group's ``CacheManager``,
    whose pool is the tier's capacity in chunks (the tier holds that many of every group): the manager's eviction policy (``policy``: lru, s3fifo, sieve, arc, lrfu[:boost], adaptive) chooses
    which stored chunk a store evicts, a load in flight pins its chunks (an admission of them, released by
    ``complete_load``), and a store in flight holds its new chunks uncommitted until ``complete_store`` commits
    them (or drops them, on failure). When the chunks that may be evicted are too few for a store,
    ``prepare_store`` returns None (vLLM counts an allocation failure and does not offload) and evicts nothing.
    Evicted chunks' objects are deleted by the next store job's workers."""

    def __init__(self, capacity_chunks: int, medium: Medium = Medium.STORAGE, locality: Locality = Locality.LOCAL,
                 enable_events: bool = False, info: Optional[KvtierOffloadingInfo] = None, policy: str = "lru"):
        if capacity_chunks <= 0:
            raise InvalidArgumentError(f"kvtier.vllm: capacity of {capacity_chunks} chunks")
        self.capacity_chunks = capacity_chunks
        self.medium = medium
        self.locality = locality
        self.policy = policy
        self._lock = threading.RLock()
        # One index per KV cache group (an OffloadKey's last 4 bytes), each of capacity_chunks chunks: the tier was
        # sized for capacity_chunks chunks of every group (a pinned tier has that many slots per group). One index
        # of them all held capacity_chunks chunks in all, 1/N of the tier with N groups (a hybrid model).
        self._indexes: Dict[int, Any] = {0: self._new_index()}  # raises InvalidArgumentError naming a bad policy
        self._chunks: Dict[str, bytes] = {}  # object_key -> OffloadKey bytes: stored or being stored
        self._pending: Dict[bytes, int] = {}  # being stored: the admission that holds its block
        # Stores in flight when reset_cache() ran, per key: their completions come first (the workers run stores in
        # submission order), and they belong to no chunk of the index; a store of the same key after the reset
        # must not be completed by them.
        self._stale: Dict[bytes, int] = {}
        self._loads: Dict[bytes, List[int]] = {}  # loads in flight: their admissions
        self._orphans: List[str] = []  # evicted objects the next store job deletes
        # Look-ahead: the stored chunks of requests vLLM looked up but has not scheduled yet, announced to the index
        # (kept over other chunks when a store must evict), and each request's hints (RequestHints).
        self._queued: Dict[str, Dict[bytes, int]] = {}
        self._hints: Dict[str, Dict[str, Any]] = {}
        self._events: Optional[List[OffloadingEvent]] = [] if enable_events else None
        self._info = info.as_config_info() if info is not None else {}
        self.stats = {"stores": 0, "stored": 0, "store_failures": 0, "evicted": 0, "loads": 0, "refused": 0}

    def _new_index(self) -> Any:
        # Its settings are this scheduler's alone: a KVTIER_CACHE_* variable meant for an engine's cache (a host
        # tier, watermarks) would give the index moves that nothing here runs or acknowledges.
        index = _native.CacheManager(device_blocks=self.capacity_chunks, device_policy=self.policy, env=False)
        index.enable_kv_events(1, "DISK")  # its BlockRemoved events name the chunks its policy evicts
        return index

    @property
    def _index(self) -> Any:
        """The index of KV cache group 0 (the only one of most models)."""
        return self._indexes[0]

    @staticmethod
    def _group_of(key: bytes) -> int:
        """The KV cache group of an OffloadKey (its last 4 bytes, vLLM's make_offload_key)."""
        return int.from_bytes(key[-4:], "big") if len(key) >= 4 else 0

    def _index_of(self, key: bytes) -> Any:
        """The index of the key's KV cache group (created on its first chunk)."""
        group = self._group_of(key)
        index = self._indexes.get(group)
        if index is None:
            index = self._indexes[group] = self._new_index()
        return index

    def _take_evicted(self) -> List[bytes]:
        """The chunks the indexes evicted since the last call (their events, drained)."""
        evicted: List[bytes] = []
        for index in self._indexes.values():
            for event in index.take_events():
                if event["type"] != "BlockRemoved":
                    continue
                for h in event["block_hashes"]:
                    key = self._chunks.pop(bytes(h).hex(), None)
                    if key is not None:
                        evicted.append(key)
        return evicted

    def _stored(self, key: bytes) -> bool:
        return object_key(key) in self._chunks and key not in self._pending

    # the index

    @_serialized
    def __len__(self) -> int:
        return len(self._chunks)

    def _event(self, keys: List[OffloadKey], removed: bool, **more: Any) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=removed,
                                                locality=self.locality, **more))

    # OffloadingManager

    @_serialized
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = _key_bytes(key)
        if object_key(k) not in self._chunks:
            return LookupResult.MISS
        if k in self._pending:
            return LookupResult.HIT_PENDING
        self._announce(k, req_context)
        return LookupResult.HIT

    # Look-ahead. vLLM looks a waiting request's chunks up before it schedules it, and says which requests it
    # scheduled at the end of each step (on_schedule_end): a chunk a waiting request hit is announced to the
    # index until then, so a store in between evicts other chunks first (as a last resort it may still take it).

    def _announce(self, key: bytes, req_context: ReqContext) -> None:
        rid = getattr(req_context, "req_id", None)
        if rid is None:
            return
        queued = self._queued.setdefault(rid, {})
        if key not in queued:
            queued[key] = self._index_of(key).announce([object_key(key)], **self._hints.get(rid, {}))

    def _withdraw(self, rid: str) -> None:
        for key, qid in self._queued.pop(rid, {}).items():
            try:
                self._index_of(key).withdraw(qid)
            except (FailedPreconditionError, NotFoundError):  # withdrawn already, or the index was reset
                pass

    @_serialized
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # One scheduler step of the index: hinted retentions (ttl_steps, a conversation that continues) count their
        # steps in take_plan(). Counted before this step's withdrawals start their retentions: counted after, a
        # retention of ttl_steps=N lost one step at once (ttl_steps=1 protected nothing). The index has one tier
        # and no watermarks: its plan has no move to run.
        for index in self._indexes.values():
            plan = index.take_plan()
            if any(plan.values()):
                raise InternalError(f"kvtier.vllm: the chunk index planned moves it cannot run: {plan}")
        for rid in context.new_req_ids:
            self._withdraw(rid)

    @_serialized
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._withdraw(req_context.req_id)
        self._hints.pop(req_context.req_id, None)

    @_serialized
    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        if self.medium is Medium.CPU:
            return CacheHitSource.HOST
        return CacheHitSource.DISK if self.locality is Locality.LOCAL else CacheHitSource.EXTERNAL_UNSPECIFIED

    @_serialized
    def prepare_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        for key in keys:
            if not self._stored(_key_bytes(key)):
                raise InvalidArgumentError(
                    f"kvtier.vllm: prepare_load of chunk {_key_bytes(key).hex()}, which is "
                    f"{'still being stored' if _key_bytes(key) in self._pending else 'not stored'}")
        for key in keys:
            # An admission of a stored chunk is a hit: it counts as a use for the policy and pins the chunk.
            k = _key_bytes(key)
            self._loads.setdefault(k, []).append(self._index_of(k).admit([object_key(key)], 0)["id"])
        self.stats["loads"] += len(keys)
        return KvtierLoadStoreSpec([object_key(k) for k in keys])

    @_serialized
    def complete_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            held = self._loads.get(_key_bytes(key))
            if held:
                self._index_of(_key_bytes(key)).release(held.pop())
                if not held:
                    del self._loads[_key_bytes(key)]

    @_serialized
    def prepare_store(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        keys = list(dict.fromkeys(OffloadKey(_key_bytes(k)) for k in keys))  # a bytearray key is not hashable
        to_store = [k for k in keys if object_key(k) not in self._chunks]
        # The stored chunks of this call: a use each, and not evicted for the others.
        held = []  # (index, admission)
        for k in keys:  # bytes already (above)
            if self._stored(k):
                index = self._index_of(k)
                held.append((index, index.admit([object_key(k)], 0)["id"]))
        try:
            if not to_store:
                return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec([]), evicted_keys=[])
            # Room first, so a refused store evicts nothing: per KV cache group, free blocks, then stored chunks no
            # load holds.
            protected = {_key_bytes(k) for k in keys}
            group_of = self._group_of
            wanted: Dict[int, int] = {}
            for k in to_store:
                wanted[group_of(k)] = wanted.get(group_of(k), 0) + 1
            room = {g: self.capacity_chunks for g in wanted}
            for k in self._chunks.values():
                g = group_of(k)
                if g in room and (k in self._pending or k in self._loads or k in protected):
                    room[g] -= 1
            if any(n > room[g] for g, n in wanted.items()):
                self.stats["refused"] += len(to_store)
                return None
            admitted: List[Tuple[OffloadKey, int]] = []
            try:
                for k in to_store:
                    admitted.append((k, self._index_of(_key_bytes(k)).admit([object_key(k)], 0)["id"]))
                    self._chunks[object_key(k)] = _key_bytes(k)
            except ResourceExhaustedError:  # the count above disagreed with the index: refuse, keep the index whole
                for k, admission in admitted:
                    self._index_of(_key_bytes(k)).release(admission)
                    self._chunks.pop(object_key(k), None)
                self.stats["refused"] += len(to_store)
                evicted = self._take_evicted()
                self._orphans.extend(object_key(k) for k in evicted)
                self._event([OffloadKey(k) for k in evicted], removed=True)
                return None
            for k, admission in admitted:
                self._pending[_key_bytes(k)] = admission
            evicted = self._take_evicted()
        finally:
            for index, admission in held:
                index.release(admission)
        self.stats["stores"] += len(to_store)
        self.stats["evicted"] += len(evicted)
        self._event([OffloadKey(k) for k in evicted], removed=True)
        delete = [object_key(k) for k in evicted] + self._orphans
        self._orphans = []
        spec = KvtierLoadStoreSpec([object_key(k) for k in to_store], delete)
        return PrepareStoreOutput(keys_to_store=list(to_store), store_spec=spec,
                                  evicted_keys=[OffloadKey(k) for k in evicted])

    @_serialized
    def complete_store(self, keys: Iterable[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        done: List[OffloadKey] = []
        for key in keys:
            k = _key_bytes(key)
            if self._stale.get(k):  # a store from before reset_cache(), though the key is being stored again
                self._stale[k] -= 1
                if not self._stale[k]:
                    del self._stale[k]
                if object_key(key) not in self._chunks:
                    self._orphans.append(object_key(key))
                continue
            admission = self._pending.pop(k, None)
            if admission is None:
                # A store from before reset_cache(): whatever it wrote belongs to no chunk of this index.
                if object_key(key) not in self._chunks:
                    self._orphans.append(object_key(key))
                continue
            index = self._index_of(_key_bytes(key))
            if success:
                index.commit(admission)
            else:
                # Failed on some rank: the ranks that wrote the object keep it until a store job deletes it
                # (a pinned or memory tier would otherwise fill up with objects no index reports).
                self._chunks.pop(object_key(key), None)
                self._orphans.append(object_key(key))
            index.release(admission)  # uncommitted: its block returns to the pool
            done.append(key)
        self._take_evicted()  # drains the index's own events of these chunks
        if success:
            self.stats["stored"] += len(done)
            self._event(done, removed=False, removal_expected=True, req_context=req_context)
        else:
            self.stats["store_failures"] += len(done)
            self._event(done, removed=True, metadata_only=True)

    @_serialized
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hints = request_hints(getattr(req_context, "kv_hints", None))
        if hints:
            self._hints[req_context.req_id] = hints
        return RequestOffloadingContext()

    @_serialized
    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    @_serialized
    def reset_cache(self) -> None:
        """Forgets every chunk (vLLM's reset_prefix_cache): this index never reports them again, and the next
        store job deletes their objects from the tier (the pinned tier has no eviction of its own, so they would
        fill it for good), as it does what stores in flight at the reset write. Loads in flight complete against
        nothing."""
        self._orphans.extend(self._chunks.keys())
        for k in self._pending:
            self._stale[k] = self._stale.get(k, 0) + 1
        self._indexes = {0: self._new_index()}
        self._queued.clear()  # the new index holds no announcement
        self._chunks.clear()
        self._pending.clear()
        self._loads.clear()

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return [self._info]


# ---------------------------------------------------------------------------------------------- worker side


class KvtierOffloadingWorker(OffloadingWorker):
    """Moves chunks between vLLM's KV tensors and a kvtier storage tier, or its own pinned memory (worker side):
    vLLM's calls on :class:`kvtier._chunk_mover.ChunkMover`.

    Stores run in submission order on one thread (so a chunk evicted by one store and stored again by a later
    one is deleted before it is written); loads run on their own thread, never behind stores. The copies are
    kvtier's (a ``TransferManager`` per KV cache group over vLLM's tensors), after the work the engine's stream had
    when the store was submitted: through pinned batches of at most ``staging_bytes`` that the storage tier writes
    and reads in place, or, with ``pinned_chunks`` (the ``pinned:`` tier), straight into and out of that many
    chunks' slots of pinned memory, each chunk's bytes checksummed when stored and verified before a load."""

    def __init__(self, kv_caches: CanonicalKVCaches, store: Any, blocks_per_chunk: int,
                 staging_bytes: int = _DEFAULT_STAGING, pinned_chunks: int = 0):
        groups = [[(kv_caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes) for ref in refs]
                  for refs in kv_caches.group_data_refs]
        self._mover = ChunkMover(groups, store, blocks_per_chunk, staging_bytes, pinned_chunks)

    @property
    def store(self) -> Any:
        """The storage tier the worker reads and writes (kvtier.StorageBackend; None for the pinned tier)."""
        return self._mover.store

    @property
    def pinned_chunks(self) -> int:
        """Chunks in the worker's pinned memory (the pinned tier)."""
        return self._mover.pinned_chunks

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

    def _submit(self, job_id: int, ptrs: DevicePointers, spec: LoadStoreSpec, is_store: bool,
                expedited: bool = False) -> bool:
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise InvalidArgumentError(f"kvtier.vllm: job id {job_id!r} is a {type(job_id).__name__}, not an int")
        if not isinstance(spec, KvtierLoadStoreSpec):
            raise InvalidArgumentError(f"kvtier.vllm: job {job_id} has a {type(spec).__name__}, not a "
                                       "KvtierLoadStoreSpec")
        self._mover.submit(job_id, ptrs, spec.names, spec.delete if is_store else [], is_store, expedited)
        return True

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, device_ptrs, dst_spec, True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers,
                    expedited: bool = False) -> bool:
        # An expedited load (one the engine step waits for) runs before every queued regular load.
        return self._submit(job_id, device_ptrs, src_spec, False, expedited)

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
                f"kvtier.vllm: the tier '{_shown(self.settings.storage)}' has no capacity: set kv_connector_extra_config"
                "['capacity'] (bytes per worker, e.g. \"200G\")" + (
                    " or the disk spec's ?capacity=" if self.settings.disk else ""))
        per_chunk = chunk_bytes
        # A chunk is one object per KV cache group, each with its own header (and on disk its own rounding).
        extra_groups = len(config.groups) - 1
        if self.settings.disk:
            per_chunk = (-(-chunk_bytes // 4096) * 4096 + _DISK_OBJECT_OVERHEAD +
                         extra_groups * (4096 + _DISK_OBJECT_OVERHEAD))
        elif self.settings.memory:
            per_chunk = chunk_bytes + (1 + extra_groups) * _MEMORY_OBJECT_OVERHEAD
        # pinned: a chunk takes its bytes (its checksum lives beside it)
        self.capacity_chunks = cap // per_chunk
        if self.capacity_chunks < 1:
            raise InvalidArgumentError(
                f"kvtier.vllm: capacity {cap} bytes holds no chunk of {per_chunk} bytes (on the tier)")
        if self.capacity_chunks > _MAX_CHUNKS:
            raise OutOfRangeError(
                f"kvtier.vllm: capacity {cap} bytes is {self.capacity_chunks} chunks of {per_chunk} bytes; the tier's "
                f"index holds at most {_MAX_CHUNKS} (2**32 - 1 blocks): a smaller capacity, or larger chunks "
                "(blocks_per_chunk)")
        self.medium = Medium.CPU if (self.settings.memory or self.settings.pinned) else Medium.STORAGE
        self.locality = Locality.LOCAL if self.settings.local else Locality.REMOTE
        self._manager: Optional[KvtierOffloadingManager] = None
        self._worker: Optional[KvtierOffloadingWorker] = None
        self.store: Any = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            info = KvtierOffloadingInfo(self.settings.storage.split("?")[0].split("@")[-1],
                                        self.capacity_chunks, self.blocks_per_chunk)
            self._manager = KvtierOffloadingManager(
                self.capacity_chunks, self.medium, self.locality,
                enable_events=self.kv_events_config.enable_kv_cache_events, info=info, policy=self.settings.policy)
        return self._manager

    def open_store(self, rank: Optional[int] = None) -> Any:
        """The kvtier storage tier of one worker rank (default: this process's rank); None for the pinned tier (the
        worker holds the chunks itself)."""
        if self.settings.pinned:
            return None
        r = self.config.parallel.rank if rank is None else rank
        return _native.StorageBackend.open(self.settings.storage, namespace_of(self.config, self.settings, r),
                                           self.settings.knobs)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.store is None and not self.settings.pinned:
                self.store = self.open_store()  # first: a bad storage knob is named before anything else
            if len(kv_caches.group_data_refs) != len(self.config.groups):
                raise NotSupportedError(
                    f"kvtier.vllm: {len(kv_caches.group_data_refs)} KV cache groups registered, "
                    f"{len(self.config.groups)} configured")
            # The tier was sized from vLLM's bytes per block; caches that hold more would overrun it (the pinned tier
            # would pin more host memory than `capacity` says), so they are refused before anything is allocated.
            pages = [ref.page_size_bytes for refs in kv_caches.group_data_refs for ref in refs]
            if all(isinstance(p, int) for p in pages) and sum(pages) > self.config.worker_kv_bytes_per_block:
                raise InvalidArgumentError(
                    f"kvtier.vllm: the registered KV caches hold {sum(pages)} bytes per block, vLLM's config "
                    f"{self.config.worker_kv_bytes_per_block} (worker_kv_bytes_per_block): the tier, sized from the "
                    "config, would overrun its capacity")
            self._worker = KvtierOffloadingWorker(kv_caches, self.store, self.blocks_per_chunk,
                                                  self.settings.staging_bytes,
                                                  self.capacity_chunks if self.settings.pinned else 0)
            logger.info("kvtier.vllm: rank %d: %s tier %s, %d groups, chunk objects of %s bytes",
                        self.config.parallel.rank, self.store.name if self.store is not None else "pinned",
                        _native.StorageBackend.redacted_spec(self.settings.storage.split("?")[0]),
                        len(kv_caches.group_data_refs),
                        [self._worker.object_bytes(g) for g in range(len(kv_caches.group_data_refs))])
        return self._worker
