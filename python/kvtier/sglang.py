"""An SGLang HiCache storage backend (the L3 tier) over kvtier's storage tiers.

:class:`HiCacheKvtier` implements SGLang's ``HiCacheStorage`` (``sglang/srt/mem_cache/
hicache_storage.py``) on a kvtier :class:`~kvtier.StorageBackend`: a local disk tier (io_uring,
O_DIRECT where the filesystem allows it, capacity with LRU eviction) or Redis / Redis Cluster,
with tenants. Every object carries kvtier's header and checksum (a keyed MAC with a tenant
secret), verified before a page is reported loaded. SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "HiCacheKvtier",
        "storage": "disk:/var/cache/kvtier?capacity=200G&durability=process",
        "interface_v1": 1}'

(docs/engines.md has the whole story.) ``extra_config`` keys:

- ``storage`` (required): kvtier's storage spec, ``disk:<dir>[?...]``, ``redis://host:port[?...]`` or
  ``memory:?capacity=<bytes>`` (the rank's own RAM)
  (:meth:`kvtier.StorageBackend.open`);
- ``namespace``: a string added to the namespace (keeps deployments that share a tier apart);
- ``storage.disk.*``, ``storage.redis.*``, ``storage.tenant.*``: kvtier's knobs
  (docs/configuration.md; their ``KVTIER_STORAGE_*`` variables apply first), values as strings,
  numbers or booleans; an unknown knob or a bad value raises ``InvalidArgumentError`` naming it;
- ``interface_v1``: SGLang's own switch to the zero-copy page calls (``batch_get_v1`` /
  ``batch_set_v1``), recommended; SGLang's other keys (``backend_name``, ``module_path``,
  ``class_name``, prefetch settings) are ignored here, and any other key is logged and ignored.

Objects: one kvtier object per page and pool, or per page, pool and buffer segment on the
zero-copy paths (one per pointer of the host pool's ``get_page_buffer_meta``: K and V of a
page_first MHA pool, one for MLA). An object's key is a 128-bit BLAKE2b of SGLang's page key, the
pool's name, layout and dtype, and the segment; the namespace carries the model name and the
rank identity SGLang shards by (TP rank unless MLA, PP, attention CP, DCP; on disk also the DP
rank, since a disk directory belongs to one process).

Failures are misses, never garbage: a page is reported loaded only when every one of its
objects was read whole and verified (a missing, evicted, corrupt, foreign or wrongly sized object
makes it ``False`` / ``None``); a write that a full tier refuses is ``False``. kvtier errors inside
a batch call are logged (once per distinct reason; ``last_error`` keeps it) and reported as
misses; malformed arguments raise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import numbers
import operator
from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

from . import _native
from ._engine_config import split_extra_config
from .errors import InvalidArgumentError, KvtierError, NotSupportedError

logger = logging.getLogger("kvtier.sglang")

__all__ = ["HiCacheKvtier", "SGLANG_AVAILABLE", "parse_extra_config", "namespace_of"]

try:  # the real ABC when SGLang is importable (always, inside SGLang)
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore
        HiCacheStorage,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    SGLANG_AVAILABLE = True
    SGLANG_IMPORT_ERROR: Optional[str] = None
except ImportError as _e:
    SGLANG_AVAILABLE = False
    SGLANG_IMPORT_ERROR = str(_e)

    # A stand-in with the interface of SGLang's HiCacheStorage (0.5.23), so that the backend can
    # be driven without SGLang (tests). SGLang's loader requires a subclass of its own class:
    # inside SGLang the import above always succeeds.
    class PoolName(str, Enum):  # type: ignore[no-redef]
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"
        INDEXER = "indexer"

        def __str__(self) -> str:
            return self.value

    class PoolHitPolicy(str, Enum):  # type: ignore[no-redef]
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"
        BLOCK_GROUPS = "block_groups"

    @dataclasses.dataclass
    class PoolTransfer:  # type: ignore[no-redef]
        name: Any
        host_indices: Any = None
        device_indices: Any = None
        keys: Optional[List[str]] = None
        hit_policy: Any = PoolHitPolicy.ALL_PAGES
        nodes_to_load: Optional[List[Any]] = None
        indices_from_pool: Any = None

    @dataclasses.dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: Optional[List[int]] = None

    class HiCacheStorage(ABC):  # type: ignore[no-redef]
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def on_host_pools_registered(self) -> None:
            pass

        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            raise NotImplementedError()

        def batch_get_v2(self, transfers, extra_info=None):
            raise NotImplementedError()

        def batch_set_v2(self, transfers, extra_info=None):
            raise NotImplementedError()

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            pass

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            pass

        @abstractmethod
        def get(self, key, target_location=None, target_sizes=None):
            pass

        @abstractmethod
        def batch_get(self, keys, target_locations=None, target_sizes=None):
            pass

        @abstractmethod
        def set(self, key, value=None, target_location=None, target_sizes=None):
            pass

        @abstractmethod
        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            pass

        @abstractmethod
        def exists(self, key):
            pass

        def batch_exists(self, keys, extra_info=None):
            for i in range(len(keys)):
                if not self.exists(keys[i]):
                    return i
            return len(keys)

        def clear(self) -> None:
            pass

        def get_stats(self):
            return None


# extra_config keys that belong to SGLang (its loader and cache controller), not to kvtier.
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
_KV = "kv"


def parse_extra_config(extra: Optional[dict]) -> Tuple[str, str, Dict[str, str], bool]:
    """SGLang's extra_config as (storage spec, namespace addition, kvtier knobs, zero-copy)."""
    if not isinstance(extra, dict) or not extra.get("storage"):
        raise InvalidArgumentError(
            "kvtier.sglang: --hicache-storage-backend-extra-config must name the tier, e.g. "
            f"{{\"storage\": \"disk:/var/cache/kvtier\"}} (got {extra!r})")
    spec = extra["storage"]
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"kvtier.sglang: extra_config['storage'] = {spec!r} is not a string")
    ns, knobs, ignored = split_extra_config("kvtier.sglang", extra, _SGLANG_KEYS | {"storage"})
    if ignored:
        logger.warning("kvtier.sglang: ignoring extra_config keys %s (not kvtier's, not SGLang's known ones)",
                       ignored)
    # SGLang's own test (cache_controller.py), so that exists queries use the objects its calls write.
    zero_copy = bool(extra.get("interface_v1", 0))
    return spec, ns, knobs, zero_copy


def namespace_of(cfg: Any, extra_ns: str, disk: bool) -> str:
    """The kvtier namespace of one SGLang rank: the model and the shard identity SGLang keys by."""
    ints: Dict[str, int] = {}

    def g(name: str, default: Any = 0) -> Any:  # fields differ by version
        return ints[name] if name in ints else getattr(cfg, name, default)

    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("attn_cp_rank", "attn_cp_size"),
                       ("dcp_rank", "dcp_size"), ("dp_rank", "")):
        for field, default in ((rank, 0), (size, 1)):
            if not field:
                continue
            value = getattr(cfg, field, default)
            value = default if value is None else value
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidArgumentError(f"kvtier.sglang: {field} {value!r} is not an integer")
            ints[field] = int(value)
        r, n = ints[rank], ints.get(size, 1)
        if n < 1 or not 0 <= r < (n if size else r + 1):
            # A rank outside its group would share (or invent) another shard's namespace.
            raise InvalidArgumentError(f"kvtier.sglang: {rank} {r!r} with {size or 'no group size'} {n!r}: the "
                                       f"rank must be in 0..{size or 'size'}-1")
    parts = ["sglang", f"model={g('model_name', '') or ''}"]
    if not g("is_mla_model", False):
        parts.append(f"tp={g('tp_rank')}/{g('tp_size', 1)}")
    if g("pp_size", 1) > 1:
        parts.append(f"pp={g('pp_rank')}/{g('pp_size', 1)}")
    if g("attn_cp_size", 1) > 1:
        parts.append(f"cp={g('attn_cp_rank')}/{g('attn_cp_size', 1)}")
    if g("dcp_size", 1) > 1:
        parts.append(f"dcp={g('dcp_rank')}/{g('dcp_size', 1)}")
    if disk and g("dp_rank", 0):
        parts.append(f"dp={g('dp_rank')}")
    if extra_ns:
        parts.append(f"ns={extra_ns}")
    return "|".join(parts)


def _flatten_meta(ptrs, sizes) -> Tuple[List[int], List[int]]:
    """get_page_buffer_meta's (pointers, sizes), nested entries expanded."""
    out_p: List[int] = []
    out_s: List[int] = []
    for p, s in zip(ptrs, sizes):
        if isinstance(p, (list, tuple)):
            out_p.extend(int(x) for x in p)
            out_s.extend(int(x) for x in (s if isinstance(s, (list, tuple)) else [s] * len(p)))
        else:
            out_p.append(int(p))
            out_s.append(int(s))
    return out_p, out_s


def _length(indices: Any) -> int:
    if hasattr(indices, "numel"):
        return int(indices.numel())
    return len(indices)


def _none_given(what: str, items: Any) -> None:
    """A batch of no keys with items for some (host indices, values, targets): their counts disagree, which the
    calls with keys refuse too (it returned an empty result as if nothing had been asked)."""
    if items is not None and _length(items) != 0:
        raise InvalidArgumentError(f"kvtier.sglang: 0 keys but {_length(items)} {what}")


def _one_dimension(host_indices: Any) -> None:
    shape = getattr(host_indices, "shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        raise InvalidArgumentError(f"kvtier.sglang: host indices of shape {tuple(shape)}: need one dimension")


def _nbytes(t: Any) -> int:
    if isinstance(t, tuple):  # (address, bytes)
        return int(t[1])
    if hasattr(t, "nbytes"):
        return int(t.nbytes)
    if hasattr(t, "numel") and hasattr(t, "element_size"):
        return int(t.numel()) * int(t.element_size())
    try:
        return memoryview(t).nbytes  # bytes, bytearray: the buffer protocol
    except TypeError:
        raise InvalidArgumentError(f"kvtier.sglang: a page of type {type(t).__name__} ({t!r:.60}): need a CPU tensor, "
                                   "an array, a buffer or an (address, bytes) pair") from None


def _keys(keys: Any) -> List[str]:
    """The keys of a batch: a sequence of strings (a string alone would be taken as one key per character)."""
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise InvalidArgumentError(f"kvtier.sglang: keys {keys!r:.60} is not a list of keys")
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, str):
            raise InvalidArgumentError(f"kvtier.sglang: key {k!r:.60} at index {i} is a {type(k).__name__}, not a "
                                       "string")
        try:
            k.encode()
        except UnicodeEncodeError:  # a lone surrogate: the object name could not be derived (a bare error before)
            raise InvalidArgumentError(f"kvtier.sglang: key {k!r:.60} at index {i} is not valid Unicode text (a "
                                       "lone surrogate)") from None
    return out


def _address_target(location: Any, size: Any, i: int) -> Any:
    """A target as get_many / put_many take it: an (address, bytes) pair for an integer address (its size from
    target_sizes), otherwise the buffer itself."""
    if isinstance(location, tuple) or not isinstance(location, numbers.Integral) or isinstance(location, bool):
        if isinstance(location, tuple) and (len(location) != 2 or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in location)):
            raise InvalidArgumentError(f"kvtier.sglang: target {i} is {location!r}, not an (address, bytes) pair")
        return location
    if size is None or isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0 or location <= 0:
        raise InvalidArgumentError(f"kvtier.sglang: target {i} at address {location!r} needs a size in bytes "
                                   f"(target_sizes[{i}] = {size!r})")
    return (int(location), int(size))


class HiCacheKvtier(HiCacheStorage):
    """SGLang's HiCache L3 storage on a kvtier tier (see the module's doc).

    ``HiCacheKvtier(storage_config, kwargs=None)``: SGLang's dynamic loader passes its
    ``HiCacheStorageConfig`` and a dict of extra arguments (``mem_pool_host`` is taken from it
    when present; SGLang registers the host pool right after anyway).
    """

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        cfg = storage_config
        spec, extra_ns, knobs, zero_copy = parse_extra_config(getattr(cfg, "extra_config", None))
        disk = spec.startswith(("disk:", "memory:"))  # a tier of one process (a disk directory, its RAM)
        if getattr(cfg, "should_split_heads", False):
            raise NotSupportedError(
                "kvtier.sglang: heterogeneous TP (tp_lcm_size, should_split_heads) is not supported")
        if disk and getattr(cfg, "is_mla_model", False) and getattr(cfg, "tp_size", 1) > 1:
            raise NotSupportedError(
                f"kvtier.sglang: an MLA model at tp_size {cfg.tp_size} on the process-local tier '{spec}': SGLang writes MLA "
                "pages from one rank and reads them on every rank, and a kvtier disk directory belongs to one "
                "process (and a memory tier is the process's own); use a redis:// tier")
        self.storage_config = cfg
        self.spec = spec
        self.zero_copy = zero_copy
        self.namespace = namespace_of(cfg, extra_ns, disk)
        self.store = _native.StorageBackend.open(spec, self.namespace, knobs)
        self.last_error: Optional[str] = None
        self._logged: set = set()
        self._segments: Dict[Any, List[int]] = {}
        self.registered_pools: Dict[Any, Any] = {}
        pool = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        if pool is not None:
            self.register_mem_pool_host(pool)
        logger.info("kvtier.sglang: %s tier %s, namespace %s, %s pages", self.store.name,
                    _native.StorageBackend.redacted_spec(spec), self.namespace,
                    "zero-copy" if zero_copy else "flat")

    # ------------------------------------------------------------------ keys and batches

    # The host pool's geometry as SGLang's pools carry it (MHA: heads and head size; MLA: the latent and rope
    # sizes): part of every object's name, so a model of another geometry under the same served name (whose pages
    # may have the same byte size: 8 heads x 64 against 4 x 128) misses instead of loading the other model's bytes.
    _GEOMETRY = ("layer_num", "start_layer", "page_size", "head_num", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
                 "v_head_dim", "size_per_token")

    def _pool_desc(self, pool: Any, name: Any) -> str:
        """What a page's objects are named after besides its key: the pool, its layout, dtype and geometry (the
        attributes of _GEOMETRY it has). Weights changed under the same geometry are not seen: a new model needs its
        own model_name or namespace (docs/engines.md)."""
        geometry = ",".join(f"{a}={getattr(pool, a)}" for a in self._GEOMETRY if getattr(pool, a, None) is not None)
        return f"{name}|{getattr(pool, 'layout', '')}|{getattr(pool, 'dtype', '')}|{geometry}"

    def _names(self, keys: List[str], desc: str, segments: int) -> List[str]:
        out = []
        for key in keys:
            for s in range(segments):
                out.append(hashlib.blake2b(f"{desc}|{s}\x00{key}".encode(), digest_size=16).hexdigest())
        return out

    def _fail(self, what: str, err: Exception) -> None:
        reason = f"{what}: {err}"
        self.last_error = reason
        # Logged once per kind of failure (the call and the error's class and code), not per message: messages name
        # files and keys, so a failing tier logged every page (5,120 warnings for 2,560 backups on a full disk) and
        # the set of logged reasons grew with them.
        kind = (what, type(err).__name__, getattr(err, "code", None))
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("kvtier.sglang: %s (reported as misses; later failures of this kind are not logged, "
                           "last_error has the latest)", reason)

    def _run(self, op: str, names: List[str], buffers=None) -> Optional[list]:
        try:
            if buffers is None:
                return getattr(self.store, op + "_many")(names)
            return getattr(self.store, op + "_many")(names, buffers)
        except InvalidArgumentError:
            raise  # the caller's buffers (not contiguous, read only, of another device): malformed arguments raise
        except KvtierError as e:
            self._fail(op, e)
            return None

    def _ok(self, results: Optional[list], sizes: Optional[List[int]], what: str) -> List[bool]:
        """Per item: done, and (sizes given) exactly that many bytes."""
        if results is None:
            return [False] * (len(sizes) if sizes is not None else 0)
        out = []
        for i, r in enumerate(results):
            good = isinstance(r, int) and (sizes is None or r == sizes[i])
            if not good and not (isinstance(r, KvtierError) and r.code == "NotFound"):
                self._fail(what, r if isinstance(r, Exception) else ValueError(
                    f"object of {r} bytes where the page holds {sizes[i]}"))
            out.append(good)
        return out

    @staticmethod
    def _pages(flags: List[bool], segments: int) -> List[bool]:
        return [all(flags[i * segments:(i + 1) * segments]) for i in range(len(flags) // max(segments, 1))]

    def _present(self, names: List[str], sizes: Optional[List[Optional[int]]] = None) -> List[bool]:
        """Per object: stored, and (sizes[i] given) of that many bytes."""
        r = self._run("exists", names)
        if r is None:
            return [False] * len(names)
        return [isinstance(x, int) and (sizes is None or sizes[i] is None or x == sizes[i]) for i, x in enumerate(r)]

    def _put_missing(self, names: List[str], buffers: list, sizes: List[int]) -> List[bool]:
        """Stores the objects not stored yet (pages are content-addressed: a stored key holds these bytes); one of
        another size (written by a pool of another geometry) is written again. A name given twice is written once,
        from its first buffer: a page's segments all come from one page, never some from each of two (SGLang's keys
        are content hashes, so the pages of one key are alike; an engine that repeats a key with other bytes gets
        the first)."""
        first: Dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        if len(first) < len(names):
            once = sorted(first.values())
            stored = dict(zip((names[i] for i in once),
                              self._put_missing([names[i] for i in once], [buffers[i] for i in once],
                                                [sizes[i] for i in once])))
            return [stored[name] and sizes[i] == sizes[first[name]] for i, name in enumerate(names)]
        present = self._present(names, sizes)
        todo = [i for i, p in enumerate(present) if not p]
        done = list(present)
        if todo:
            r = self._run("put", [names[i] for i in todo], [buffers[i] for i in todo])
            for i, ok in zip(todo, self._ok(r, [sizes[i] for i in todo], "put")):
                done[i] = ok
        return done

    # ------------------------------------------------------------------ zero-copy pages

    def _pool(self, name: Any) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None and str(name) == _KV:
            pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise InvalidArgumentError(f"kvtier.sglang: no host pool registered as '{name}'")
        return pool

    @staticmethod
    def _check_indices(pool: Any, host_indices: Any) -> None:
        """Every page of host indices (page_size of them each) inside the pool and contiguous: the pool turns each
        page's first index into the raw address of page_size slots, which kvtier then reads or writes, so a page
        that starts near the end of the pool (or whose indices are not start, start + 1, ...) would read or write
        memory that is not the pool's, or slots other than the ones named."""
        size = getattr(pool, "size", None)
        n = _length(host_indices)
        if size is None or n == 0:  # a pool that does not say its size cannot be checked against it
            return
        # A numpy or torch integer is a size like any other: an `isinstance(size, int)` test had turned the check off
        # for them, and a load then wrote past the pool's end without a word.
        if isinstance(size, bool) or not hasattr(type(size), "__index__"):
            raise InvalidArgumentError(f"kvtier.sglang: the host pool's size {size!r} ({type(size).__name__}) is not "
                                       "a slot count")
        size = operator.index(size)
        import numpy as np

        page_size = getattr(pool, "page_size", 1) or 1
        try:
            values = np.asarray(host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"kvtier.sglang: host indices are not integers: {e}") from None
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise InvalidArgumentError(f"kvtier.sglang: host indices of dtype {values.dtype}: need integers")
        values = values.astype(np.int64)
        starts = values[::page_size]
        outside = np.flatnonzero((starts < 0) | (starts > size - page_size))
        if outside.size:
            start = int(starts[outside[0]])
            raise InvalidArgumentError(
                f"kvtier.sglang: the page at host index {start} (page size {page_size}) is outside the host pool of "
                f"{size} slots")
        expected = np.repeat(starts, page_size)[:n] + np.tile(np.arange(page_size, dtype=np.int64), len(starts))[:n]
        wrong = np.flatnonzero(values != expected)
        if wrong.size:
            at = int(wrong[0])
            raise InvalidArgumentError(
                f"kvtier.sglang: host index {int(values[at])} at position {at} does not continue its page (which "
                f"starts at {int(expected[at - at % page_size])}; page size {page_size})")

    def _meta(self, pool: Any, keys: List[str], host_indices: Any) -> Tuple[List[Tuple[int, int]], int]:
        """(address, nbytes) of every segment of every page, and segments per page."""
        page_size = getattr(pool, "page_size", 1) or 1
        _one_dimension(host_indices)
        if _length(host_indices) != len(keys) * page_size:
            raise InvalidArgumentError(
                f"kvtier.sglang: {len(keys)} keys but {_length(host_indices)} host indices (page size {page_size})")
        self._check_indices(pool, host_indices)
        ptrs, sizes = _flatten_meta(*pool.get_page_buffer_meta(host_indices))
        if not keys or len(ptrs) % len(keys):
            raise InvalidArgumentError(
                f"kvtier.sglang: the host pool gave {len(ptrs)} buffers for {len(keys)} pages")
        return list(zip(ptrs, sizes)), len(ptrs) // len(keys)

    def _segments_of(self, pool: Any, name: Any) -> List[int]:
        """The bytes of each segment of a page of the pool (from its metadata of one page), for exists queries."""
        k = (id(pool), str(name))
        if k not in self._segments:
            page_size = getattr(pool, "page_size", 1) or 1
            try:
                import torch

                idx = torch.arange(page_size, dtype=torch.int64)
            except ImportError:
                import numpy as np

                idx = np.arange(page_size, dtype=np.int64)
            _, sizes = _flatten_meta(*pool.get_page_buffer_meta(idx))
            self._segments[k] = [int(x) for x in sizes] or [0]
        return self._segments[k]

    def _io_pages(self, name: Any, keys: List[str], host_indices: Any, is_set: bool) -> List[bool]:
        keys = _keys(keys)
        if not keys:
            if host_indices is not None and (hasattr(host_indices, "__len__") or hasattr(host_indices, "numel")):
                _none_given("host indices", host_indices)
            return []
        if host_indices is None or not (hasattr(host_indices, "__len__") or hasattr(host_indices, "numel")):
            raise InvalidArgumentError(f"kvtier.sglang: host indices {host_indices!r:.60} are not a sequence of "
                                       "indices")
        pool = self._pool(name)
        if not hasattr(pool, "get_page_buffer_meta"):
            return self._io_flat_pages(name, pool, keys, host_indices, is_set)
        segs, n = self._meta(pool, keys, host_indices)
        self._segments[(id(pool), str(name))] = [size for _, size in segs[:n]]
        names = self._names(keys, self._pool_desc(pool, name), n)
        live = [i for i, (_, size) in enumerate(segs) if size > 0]  # empty segments (no state) are not stored
        flags = [True] * len(segs)
        bufs = [segs[i] for i in live]
        sizes = [segs[i][1] for i in live]
        if is_set:
            done = self._put_missing([names[i] for i in live], bufs, sizes)
        else:
            done = self._ok(self._run("get", [names[i] for i in live], bufs), sizes, "get")
        for i, ok in zip(live, done):
            flags[i] = ok
        return self._pages(flags, n)

    def _io_flat_pages(self, name: Any, pool: Any, keys: List[str], host_indices: Any, is_set: bool) -> List[bool]:
        """Pools without buffer metadata: one object per flat page (get_data_page / set_from_flat_data_page)."""
        page_size = getattr(pool, "page_size", 1) or 1
        _one_dimension(host_indices)
        if _length(host_indices) != len(keys) * page_size:
            raise InvalidArgumentError(
                f"kvtier.sglang: {len(keys)} keys but {_length(host_indices)} host indices (page size {page_size})")
        self._check_indices(pool, host_indices)
        starts = [int(host_indices[i * page_size]) for i in range(len(keys))]
        names = self._names(keys, self._pool_desc(pool, name) + "|flat", 1)
        if is_set:
            pages = [pool.get_data_page(s, flat=True) for s in starts]
            return self._put_missing(names, pages, [_nbytes(p) for p in pages])
        pages = [pool.get_dummy_flat_data_page() for _ in keys]
        ok = self._ok(self._run("get", names, pages), [_nbytes(p) for p in pages], "get")
        for s, page, good in zip(starts, pages, ok):
            if good:
                pool.set_from_flat_data_page(s, page)
        return ok

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads pages into the registered host pool at ``host_indices`` (its buffers, no copy)."""
        return self._io_pages(_KV, keys, host_indices, False)

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Stores pages of the registered host pool (pages already stored are not rewritten)."""
        return self._io_pages(_KV, keys, host_indices, True)

    # ------------------------------------------------------------------ v2: several pools

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Per pool transfer (keys + host_indices), pages read into that pool: {pool name: [bool]}."""
        return {t.name: self._io_pages(t.name, list(t.keys or []), t.host_indices, False) for t in transfers}

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Per pool transfer, pages stored: {pool name: [bool]}."""
        return {t.name: self._io_pages(t.name, list(t.keys or []), t.host_indices, True) for t in transfers}

    def _page_present(self, name: Any, keys: List[str]) -> List[bool]:
        if not keys:
            return []
        if str(name) == _KV and not self.zero_copy:
            return self._present(self._flat_names(keys),
                                 [self._flat_page_bytes(getattr(self, "mem_pool_host", None))] * len(keys))
        pool = self._pool(name)
        if not hasattr(pool, "get_page_buffer_meta"):
            flat = [self._flat_page_bytes(pool)] * len(keys)
            return self._present(self._names(keys, self._pool_desc(pool, name) + "|flat", 1), flat)
        # Presence only: a page's segment sizes may differ from the pool's first page's. An object of another
        # geometry reads as a miss and the next backup writes it again.
        n = len(self._segments_of(pool, name))
        return self._pages(self._present(self._names(keys, self._pool_desc(pool, name), n)), n)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Any = None) -> Any:
        """The usable prefix: the KV pages present, cut by each pool's hit policy (ALL_PAGES: every page of
        the prefix; TRAILING_PAGES: the last len(transfer.keys) pages before each stop point)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: Dict[Any, int] = {}
        if kv_pages:
            hits[PoolName.KV] = kv_pages
        restorable = list(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            present = self._page_present(t.name, keys[:kv_pages])
            policy = str(getattr(t.hit_policy, "value", t.hit_policy))
            if policy == "all_pages":
                boundary = present.index(False) if False in present else kv_pages
                ok = set(range(1, boundary + 1))
            elif policy == "trailing_pages":
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - window):p])}
                boundary = max(ok, default=0)
            else:
                self._fail("exists", NotSupportedError(f"pool hit policy '{policy}' of pool '{t.name}'"))
                return _transfer_result(0, {}, [])
            if boundary:
                hits[t.name] = boundary
            restorable = [p for p in restorable if p in ok]
        return _transfer_result(restorable[-1] if restorable else 0, hits, restorable)

    # ------------------------------------------------------------------ flat pages (SGLang's generic path)

    def _flat_page_bytes(self, pool: Any) -> Optional[int]:
        """The bytes of one flat page of the pool (None without a pool that makes them)."""
        if pool is None or not hasattr(pool, "get_dummy_flat_data_page"):
            return None
        k = (id(pool), "|flat")
        if k not in self._segments:
            self._segments[k] = [_nbytes(pool.get_dummy_flat_data_page())]
        return self._segments[k][0]

    def _flat_names(self, keys: List[str]) -> List[str]:
        pool = getattr(self, "mem_pool_host", None)
        return self._names(keys, self._pool_desc(pool, _KV) + "|flat", 1)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page read into ``target_location`` (a CPU tensor/array; default: a new flat page of the host
        pool), or None when it is absent or unusable."""
        return self.batch_get([key], [target_location] if target_location is not None else None,
                              [target_sizes] if target_sizes is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        """Per key its target filled with the page, or None (absent, evicted, corrupt, wrong size)."""
        keys = _keys(keys)
        if not keys:
            _none_given("target locations", None if target_locations is None else list(target_locations))
            return []
        if target_locations is None:
            pool = getattr(self, "mem_pool_host", None)
            if pool is None:
                raise InvalidArgumentError("kvtier.sglang: no target locations and no host pool registered "
                                           "(register_mem_pool_host) to read pages into")
            target_locations = [pool.get_dummy_flat_data_page() for _ in keys]
        targets = list(target_locations)
        if len(targets) != len(keys):
            raise InvalidArgumentError(f"kvtier.sglang: {len(keys)} keys but {len(targets)} target locations")
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(targets)
        if len(sizes) != len(targets):
            raise InvalidArgumentError(f"kvtier.sglang: {len(targets)} target locations but {len(sizes)} target sizes")
        targets = [_address_target(t, n, i) for i, (t, n) in enumerate(zip(targets, sizes))]
        ok = self._ok(self._run("get", self._flat_names(keys), targets), [_nbytes(t) for t in targets], "get")
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores one page: ``value`` (a CPU tensor/array) or the memory at ``target_location`` (an address)
        of ``target_sizes`` bytes."""
        if value is None and target_location is None:
            raise InvalidArgumentError(f"kvtier.sglang: set({key!r}) needs a value or target_location + target_sizes")
        if value is None:
            return self.batch_set([key], None, [target_location], [target_sizes])
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores pages (``values``, or addresses + sizes); True when every page is stored."""
        keys = _keys(keys)
        if not keys:
            _none_given("values", None if values is None else list(values))
            _none_given("target locations", None if target_locations is None else list(target_locations))
            return True
        if values is not None:
            bufs = list(values)
            sizes = [_nbytes(v) for v in bufs]
        elif target_locations is not None and target_sizes is not None:
            locations, sizes = list(target_locations), list(target_sizes)
            if len(locations) != len(sizes):
                raise InvalidArgumentError(
                    f"kvtier.sglang: {len(locations)} target locations but {len(sizes)} target sizes")
            bufs = [_address_target(p, n, i) for i, (p, n) in enumerate(zip(locations, sizes))]
            sizes = [n for _, n in bufs]
        else:
            raise InvalidArgumentError("kvtier.sglang: batch_set needs values or target_locations + target_sizes")
        if len(bufs) != len(keys):
            raise InvalidArgumentError(f"kvtier.sglang: {len(keys)} keys but {len(bufs)} values")
        return all(self._put_missing(self._flat_names(keys), bufs, sizes))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many pages from the start are stored (every segment of each, on the zero-copy path)."""
        present = self._page_present(_KV, _keys(keys))
        return present.index(False) if False in present else len(present)

    # ------------------------------------------------------------------ the rest

    def close(self) -> None:
        """Releases the tier (a disk tier's directory lock, a Redis tier's connections) once its calls in flight
        end; idempotent. SGLang calls it when it detaches the backend or its attach fails: without it the old
        backend kept a disk directory locked until it was collected, and attaching the tier again failed. Later
        calls report misses."""
        self.store.close()

    def clear(self) -> bool:
        """Not supported: kvtier's tiers are cleared by their operator (the disk namespace directory, the
        Redis key prefix). Logs and returns False."""
        logger.warning("kvtier.sglang: clear() is not supported; remove the tier's namespace to clear it")
        return False

    def get_stats(self) -> Any:
        """None: SGLang's per-batch storage metrics are not reported (the tier's counters: tier_stats())."""
        return None

    def object_names(self, key: str, pool: Any = _KV) -> List[str]:
        """The kvtier objects of one page of a registered pool (``StorageBackend.object_name``: on disk the
        files ``<name>.kvo`` under the namespace's directory), for operators and tests."""
        p = self._pool(pool)
        if (str(pool) == _KV and not self.zero_copy) or not hasattr(p, "get_page_buffer_meta"):
            hexes = self._names([key], self._pool_desc(p, pool) + "|flat", 1)
        else:
            hexes = self._names([key], self._pool_desc(p, pool), len(self._segments_of(p, pool)))
        return [_native.StorageBackend.object_name(h) for h in hexes]

    def tier_stats(self) -> dict:
        """The kvtier tier's own counters (objects, bytes, evictions, quarantined, auth_failures, ...)."""
        return self.store.stats()


def _transfer_result(kv_hit_pages: int, hits: dict, restorable: List[int]) -> Any:
    fields = {f.name for f in dataclasses.fields(PoolTransferResult)}
    if "restorable_prefix_pages" in fields:
        return PoolTransferResult(kv_hit_pages, hits, restorable)
    return PoolTransferResult(kv_hit_pages, hits)
