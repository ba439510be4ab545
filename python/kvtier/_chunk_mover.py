"""Chunks of an engine's paged KV cache moved between its KV tensors and a kvtier storage tier: the worker side
of :mod:`kvtier.vllm`, written against plain tensors and duck-typed job descriptions so that it runs wherever torch
does (the GPU runner, ``python/tests/gpu/offload_worker_bench.py``, runs it where vLLM is not installed).

Each chunk of ``blocks_per_chunk`` blocks of one KV cache group is one storage object: that rank's bytes of every
layer of the group, block by block, each block's pages data reference by data reference (pages of
``page_size_bytes`` at the start of each row of a ``(num_blocks, row_bytes)`` byte tensor). The copies between the
KV tensors and the objects are kvtier's: per group a :class:`kvtier.TransferManager` over the tensors' pages
(``TransferManager.from_pages``) whose pinned host cache, page-first, holds a batch of chunks as their objects'
exact bytes, so the storage tier writes and reads them in place. Failures are misses, never garbage: a job
succeeds only when every object was written (store) or read whole, verified and of the chunk's exact size (load),
a load moves no byte of a batch before all the batch's objects verified, and every copy is checked by the manager
(a failed copy fails the job).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from . import _native
from .errors import InvalidArgumentError, NotSupportedError, ResourceExhaustedError, TimedOutError

logger = logging.getLogger("kvtier.vllm")

# Bytes of one batch of chunks. Each group's manager holds four batches of pinned host memory: two for stores and
# two for loads, so the copy of one batch overlaps the storage tier's work on the other.
DEFAULT_STAGING = 64 << 20
# The deadline of each wait on a copy (a copy that takes longer fails its job).
COPY_TIMEOUT_S = 120.0
# How long wait() and shutdown() wait for jobs: the copies and Redis have deadlines of their own, but a tier can stop
# answering (a hung mount) and the engine must hear of it rather than hang.
JOB_TIMEOUT_S = 600.0
# Blocks of one batch at most: with tiny pages a staging buffer of many MiB would otherwise mean millions of host
# blocks (each with its bookkeeping in the manager); a batch this large is as fast as a larger one.
MAX_BATCH_BLOCKS = 16384


def _count(value: Any, what: str) -> int:
    """``value`` as an int when it is one (numpy integers too); bool, float and str are refused by name."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"kvtier.vllm: {what} {value!r} is a bool, not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"kvtier.vllm: {what} {value!r} is a {type(value).__name__}, not an "
                                   "integer") from None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class FinishedJob(NamedTuple):
    job_id: int
    success: bool
    bytes: Optional[int]  # None when it failed
    seconds: Optional[float]


@dataclass
class _Group:
    """One KV cache group: its data references and the manager that moves their pages."""

    tensors: List[Any]  # torch.uint8 views, (num_blocks, row_bytes)
    bases: List[int]
    row_strides: List[int]
    num_blocks: int  # rows every data reference has
    pages: List[int]
    block_bytes: int  # one block's pages of every data reference: one host block
    object_bytes: int  # blocks_per_chunk host blocks
    batch_chunks: int  # chunks per batch
    manager: Any = None  # kvtier TransferManager (from_pages); replaced after a failed copy


@dataclass
class _Batch:
    """Chunks [first, first + count) of one group's part of a job, with the moves that touch them: for each moved
    block its place in the batch (host block, relative to the batch's buffer) and its device row."""

    group: int
    names: List[str]
    host: Any  # int64 numpy array: host block (chunk * bpc + slot) within the batch
    rows: Any  # int64 numpy array: device rows
    sums: Any = None  # the pinned tier's checksums of the batch's chunks, taken when a load starts


@dataclass
class _Plan:
    batches: List[_Batch]
    total_bytes: int

    @property
    def names(self) -> List[str]:
        return [n for b in self.batches for n in b.names]


class _Job:
    __slots__ = ("job_id", "future", "bytes", "start", "is_store")

    def __init__(self, job_id: int, future: Future, nbytes: int, is_store: bool):
        self.job_id = job_id
        self.future = future
        self.bytes = nbytes
        self.start = time.perf_counter()
        self.is_store = is_store


class _LoadQueue:
    """One thread that runs loads in order, expedited ones (vLLM's sync loads, which the engine step waits for)
    before every queued regular one: one thread, because loads share the groups' staging buffers."""

    def __init__(self, name: str):
        self._cv = threading.Condition()
        self._expedited: List[Tuple[Future, Any, tuple]] = []
        self._regular: List[Tuple[Future, Any, tuple]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, expedited: bool, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the load queue was shut down")
            (self._expedited if expedited else self._regular).append((fut, fn, args))
            self._cv.notify()
        return fut

    def shutdown(self) -> None:
        """No new loads; those queued still run."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._expedited or self._regular or self._closed):
                    self._cv.wait()
                if not (self._expedited or self._regular):
                    return
                fut, fn, args = (self._expedited or self._regular).pop(0)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (the job's outcome)
                fut.set_exception(e)


class _JobFailed(Exception):
    pass


class _CopyFailed(Exception):
    """A copy of the group's manager failed (on a GPU such errors are usually sticky: the manager is replaced)."""

    def __init__(self, group: int, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.group = group


class _StagedTier:
    """A storage tier behind pinned batches: each direction of each group has two batch buffers in the group's
    manager's host cache; a store puts a copied batch's objects from there, a load gets them there (verified)."""

    pinned = False

    def __init__(self, mover: "ChunkMover", store: Any):
        self.mover = mover
        self.store = store

    def host_blocks(self, grp: _Group) -> int:
        return 4 * grp.batch_chunks * self.mover.blocks_per_chunk

    def reset(self, group: int) -> None:
        pass

    def delete(self, names: List[str]) -> int:
        if not names:
            return 0
        return sum(1 for x in self.store.delete_many(names) if isinstance(x, int))

    def _buffer(self, mgr: Any, b: _Batch, is_store: bool, k: int) -> List[int]:
        """The first host block of each chunk of the batch in the k-th buffer of its direction (stores use buffers 0
        and 1, loads 2 and 3), once no earlier copy uses the buffer."""
        bpc = self.mover.blocks_per_chunk
        span = self.mover._groups[b.group].batch_chunks * bpc
        first = ((0 if is_store else 2) + k % 2) * span
        self.mover._copy(b.group, mgr.wait_host_blocks_free, list(range(first, first + span)), COPY_TIMEOUT_S)
        return [first + i * bpc for i in range(len(b.names))]

    def _objects(self, mgr: Any, b: _Batch, bases: List[int]) -> List[Tuple[int, int]]:
        size = self.mover._groups[b.group].object_bytes
        return [(mgr.host_page(base), size) for base in bases]

    def store_bases(self, mgr: Any, b: _Batch, k: int) -> List[int]:
        return self._buffer(mgr, b, True, k)

    def stored(self, mgr: Any, b: _Batch, bases: List[int]) -> None:
        size = self.mover._groups[b.group].object_bytes
        results = self.store.put_many(b.names, self._objects(mgr, b, bases))
        bad = [(name, res) for name, res in zip(b.names, results) if not (isinstance(res, int) and res == size)]
        if bad:
            # The batch's objects that were written go with the failed job (store_failed deletes earlier batches').
            self.store_failed([n for n, res in zip(b.names, results) if isinstance(res, int) and res == size], [])
            raise _JobFailed(f"writing chunk {bad[0][0]}: {bad[0][1]}")

    def store_failed(self, written: List[str], uncommitted: List[Tuple[int, List[int]]]) -> None:
        if written:  # the index drops every chunk of a failed job: free the space of those written
            try:
                self.store.delete_many(written)
            except Exception:  # noqa: BLE001 (best effort; the tier's capacity evicts them anyway)
                pass

    def load_bases(self, mgr: Any, b: _Batch, k: int) -> List[int]:
        bases = self._buffer(mgr, b, False, k)
        size = self.mover._groups[b.group].object_bytes
        for name, res in zip(b.names, self.store.get_many(b.names, self._objects(mgr, b, bases))):
            if not (isinstance(res, int) and res == size):  # every object whole and verified before a byte moves
                what = res if not isinstance(res, int) else f"object of {res} bytes where the chunk has {size}"
                raise _JobFailed(f"reading chunk {name}: {what}")
        return bases

    def loaded_check(self, mgr: Any, b: _Batch) -> None:
        pass

    def loaded(self, group: int, bases: List[int]) -> None:
        pass


class _PinnedTier:
    """The chunks themselves in pinned host memory: each group's manager's host cache holds ``chunks`` slots of a
    chunk's blocks. A store copies a chunk's blocks straight into a free slot; a load copies them from it. A slot
    being loaded from is never written: a chunk deleted meanwhile frees its slot once the load is done.

    Integrity end to end: when every page is 16-byte aligned (vLLM's are), the device computes the block checksum
    of each stored block as it leaves the KV tensors, and of each loaded block once it is in place; a load whose
    blocks differ fails (the blocks are not reported loaded; vLLM recomputes them) and the chunk is dropped.
    Otherwise the CPU keeps the piece checksum of each slot's bytes and verifies it before the copy."""

    pinned = True

    def __init__(self, mover: "ChunkMover", chunks: int):
        self.mover = mover
        self.chunks = chunks
        self.lock = threading.Lock()
        self.free: List[List[int]] = []
        self.slot_of: List[Dict[str, int]] = []  # per group: chunk -> slot
        self.sums: List[Dict[str, Any]] = []  # per group: chunk -> its blocks' sums (device) or its piece checksum
        self.readers: List[Dict[int, int]] = []  # per group: slot -> loads reading it
        self.doomed: List[set] = []  # per group: slots of deleted chunks still being read
        self.on_device: List[bool] = []

    def host_blocks(self, grp: _Group) -> int:
        return self.chunks * self.mover.blocks_per_chunk

    def reset(self, group: int) -> None:
        """The group's slots all free (at start: no chunk stored yet)."""
        grp = self.mover._groups[group]
        aligned = all(x % 16 == 0 for x in [*grp.pages, *grp.bases, *grp.row_strides])
        with self.lock:
            while len(self.free) <= group:
                self.free.append([])
                self.slot_of.append({})
                self.sums.append({})
                self.readers.append({})
                self.doomed.append(set())
                self.on_device.append(False)
            self.free[group] = list(range(self.chunks - 1, -1, -1))
            self.slot_of[group], self.sums[group] = {}, {}
            self.readers[group], self.doomed[group] = {}, set()
            self.on_device[group] = aligned

    def objects(self) -> int:
        with self.lock:
            return sum(len(m) for m in self.slot_of)

    def _drop(self, g: int, name: str) -> bool:  # (lock held)
        slot = self.slot_of[g].pop(name, None)
        if slot is None:
            return False
        self.sums[g].pop(name, None)
        if self.readers[g].get(slot):
            self.doomed[g].add(slot)
        else:
            self.free[g].append(slot)
        return True

    def delete(self, names: List[str]) -> int:
        with self.lock:
            return sum(1 for name in names for g in range(len(self.slot_of)) if self._drop(g, name))

    def store_bases(self, mgr: Any, b: _Batch, k: int) -> List[int]:
        g, bpc = b.group, self.mover.blocks_per_chunk
        with self.lock:
            for name in b.names:  # stored again: the old bytes are gone first
                self._drop(g, name)
            if len(self.free[g]) < len(b.names):
                raise _JobFailed(f"the pinned tier of KV cache group {g} is full ({self.chunks} chunks)")
            slots = [self.free[g].pop() for _ in b.names]
        return [slot * bpc for slot in slots]

    def _device_sums(self, mgr: Any, b: _Batch, stream: Any) -> Dict[Tuple[int, int], int]:
        """(chunk in the batch, block in the chunk) -> the block checksum of its device block, computed on the device
        behind the work on ``stream``."""
        bpc = self.mover.blocks_per_chunk
        sums = self.mover._copy(b.group, mgr.device_checksums, b.rows.tolist(), stream, COPY_TIMEOUT_S)
        return {(int(h) // bpc, int(h) % bpc): c for h, c in zip(b.host, sums)}

    def _piece_sums(self, mgr: Any, b: _Batch, bases: List[int]) -> List[int]:
        size = self.mover._groups[b.group].object_bytes
        return _native.piece_checksums([(mgr.host_page(base), size) for base in bases])

    def stored(self, mgr: Any, b: _Batch, bases: List[int]) -> None:
        g, bpc = b.group, self.mover.blocks_per_chunk
        if self.on_device[g]:
            # The blocks are the bytes the copy took: the engine does not write blocks it is storing.
            # After the copy that took them (so behind the engine's stream at submit), on the checksum stream: no
            # data operation runs on the engine-facing stream, whose failure would fail every later store.
            by_place = self._device_sums(mgr, b, self.mover._verify_stream)
            sums: List[Any] = [[by_place.get((i, s)) for s in range(bpc)] for i in range(len(b.names))]
        else:
            sums = self._piece_sums(mgr, b, bases)
        with self.lock:
            for name, base, c in zip(b.names, bases, sums):
                self.slot_of[g][name] = base // bpc
                self.sums[g][name] = c

    def store_failed(self, written: List[str], uncommitted: List[Tuple[int, List[int]]]) -> None:
        bpc = self.mover.blocks_per_chunk
        self.delete(written)
        with self.lock:
            for g, bases in uncommitted:
                self.free[g] += [base // bpc for base in bases]

    def _damaged(self, g: int, name: str, what: str) -> _JobFailed:
        with self.lock:
            if self.slot_of[g].get(name) is not None:
                self._drop(g, name)
        return _JobFailed(f"reading chunk {name}: DataLoss: {what} (the chunk is dropped)")

    def load_bases(self, mgr: Any, b: _Batch, k: int) -> List[int]:
        g, bpc = b.group, self.mover.blocks_per_chunk
        with self.lock:
            missing = [name for name in b.names if name not in self.slot_of[g]]
            if missing:
                raise _JobFailed(f"reading chunk {missing[0]}: NotFound: not in the pinned tier")
            slots = [self.slot_of[g][name] for name in b.names]
            b.sums = [self.sums[g][name] for name in b.names]
            for slot in slots:
                self.readers[g][slot] = self.readers[g].get(slot, 0) + 1
        bases = [slot * bpc for slot in slots]
        if self.on_device[g]:
            return bases  # checked on the device once in place (loaded_check)
        try:
            for name, have, want in zip(b.names, self._piece_sums(mgr, b, bases), b.sums):
                if have != want:
                    raise self._damaged(g, name, f"piece checksum {have:#018x} of its pinned bytes != {want:#018x} "
                                                 "when stored")
        except BaseException:
            self.loaded(g, bases)
            raise
        return bases

    def loaded_check(self, mgr: Any, b: _Batch) -> None:
        """After the copy into the KV tensors: the blocks' device checksums equal those they had when stored."""
        g = b.group
        if not self.on_device[g]:
            return
        # On the checksum stream: a load never waits behind the engine's stream a later store waits for.
        for (i, slot), have in self._device_sums(mgr, b, self.mover._verify_stream).items():
            want = b.sums[i][slot]
            if have != want:
                raise self._damaged(g, b.names[i], f"block {slot} of the chunk has checksum {have:#018x} once "
                                                   f"loaded, {want if want is None else hex(want)} when stored")

    def loaded(self, group: int, bases: List[int]) -> None:
        bpc = self.mover.blocks_per_chunk
        with self.lock:
            for base in bases:
                slot = base // bpc
                n = self.readers[group].get(slot, 0) - 1
                if n > 0:
                    self.readers[group][slot] = n
                    continue
                self.readers[group].pop(slot, None)
                if slot in self.doomed[group]:
                    self.doomed[group].discard(slot)
                    self.free[group].append(slot)


class ChunkMover:
    """Moves chunks between an engine's KV tensors and a kvtier storage tier.

    Stores run in submission order on one thread (so a chunk evicted by one store and stored again by a later
    one is deleted before it is written); loads run on their own thread, never behind stores. A job moves its
    chunks in batches of at most ``staging_bytes``: a store copies a batch's blocks into pinned host memory with
    kvtier's copy engine, after the work the engine's stream had at ``submit``, and the storage tier writes the
    batch's objects from there while the next batch is copied; a load reads a batch's objects there, verified,
    and the copy engine moves them into the KV tensors while the tier reads the next batch."""

    def __init__(self, groups: Sequence[Sequence[Tuple[Any, int]]], store: Any, blocks_per_chunk: int,
                 staging_bytes: int = DEFAULT_STAGING, pinned_chunks: int = 0):
        self.blocks_per_chunk = _count(blocks_per_chunk, "blocks_per_chunk")
        self.staging_bytes = _count(staging_bytes, "staging_bytes")
        pinned_chunks = _count(pinned_chunks, "pinned_chunks")
        if self.blocks_per_chunk < 1:
            raise InvalidArgumentError(f"kvtier.vllm: blocks_per_chunk {blocks_per_chunk} is not >= 1")
        if self.staging_bytes < 1:
            raise InvalidArgumentError(f"kvtier.vllm: staging of {staging_bytes} bytes")
        if pinned_chunks < 0 or (pinned_chunks > 0) == (store is not None):
            raise InvalidArgumentError(f"kvtier.vllm: a storage tier ({store!r}) or pinned chunks ({pinned_chunks}), "
                                       "one of them")
        self._tier: Any = _PinnedTier(self, int(pinned_chunks)) if pinned_chunks else _StagedTier(self, store)
        self.last_error: Optional[str] = None
        self._groups: List[_Group] = []
        self._device_of = None
        for g, refs in enumerate(groups):
            tensors, pages = [], []
            for i, (t, page_size_bytes) in enumerate(refs):
                if t.dim() != 2 or t.stride(1) != 1 or t.element_size() != 1:
                    raise NotSupportedError(
                        f"kvtier.vllm: KV tensor {i} of group {g} is not a (num_blocks, bytes) byte "
                        f"tensor (shape {tuple(t.shape)}, strides {t.stride()}, dtype {t.dtype})")
                page_size_bytes = _count(page_size_bytes, f"group {g}: page_size_bytes")
                if page_size_bytes <= 0 or page_size_bytes > t.shape[1]:
                    raise InvalidArgumentError(
                        f"kvtier.vllm: group {g}: page of {page_size_bytes} bytes in rows of {t.shape[1]}")
                if self._device_of is None:
                    self._device_of = t.device
                elif t.device != self._device_of:
                    raise NotSupportedError(f"kvtier.vllm: KV tensors on {self._device_of} and {t.device}")
                tensors.append(t if t.dtype == torch.uint8 else t.view(torch.uint8))
                pages.append(int(page_size_bytes))
            if not tensors:
                raise InvalidArgumentError(f"kvtier.vllm: KV cache group {g} has no data reference")
            block_bytes = sum(pages)
            object_bytes = block_bytes * self.blocks_per_chunk
            self._groups.append(_Group(tensors, [t.data_ptr() for t in tensors], [t.stride(0) for t in tensors],
                                       min(t.shape[0] for t in tensors), pages, block_bytes, object_bytes,
                                       max(1, min(self.staging_bytes // object_bytes,
                                                  MAX_BATCH_BLOCKS // self.blocks_per_chunk))))
        if self._device_of is not None and self._device_of.type not in ("cuda", "cpu"):
            raise NotSupportedError(f"kvtier.vllm: KV tensors on {self._device_of}: CUDA (or ROCm) GPUs and the CPU "
                                    "only")
        self._cuda = self._device_of is not None and self._device_of.type == "cuda"
        # kvtier's device and the stream its managers copy behind: on a GPU a side stream that waits, per job, for
        # the engine's stream at submit; on the CPU (kvtier's host backend) a stream of its own.
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self._device_of)
            self._device = _native.cuda_device(self._device_of.index if self._device_of.index is not None else 0)
            self._kv_stream = self._device.adopt_stream(self._stream.cuda_stream, "kvtier-vllm")
        else:
            self._stream = None
            self._device = _native.host_device()
            self._kv_stream = self._device.create_stream("kvtier-vllm")
        # The pinned tier's checksum passes (renewed after a failed copy: a stream's failure is sticky).
        self._verify_stream = self._device.create_stream("kvtier-vllm-verify")
        # Managers in use by jobs (id -> count) and those replaced but still in use: closed when no job uses them.
        self._mgr_lock = threading.Lock()
        self._users: Dict[int, int] = {}
        self._retired: List[Any] = []
        if pinned_chunks:
            need = pinned_chunks * sum(grp.object_bytes for grp in self._groups)
            ram = _physical_memory()
            if ram and need > ram:
                raise ResourceExhaustedError(f"kvtier.vllm: {pinned_chunks} pinned chunks need {need} bytes of pinned "
                                             f"host memory; this machine has {ram}")
        for g, grp in enumerate(self._groups):
            self._tier.reset(g)
            grp.manager = self._new_manager(grp)
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-store")
        self._load_pool = _LoadQueue("kvtier-vllm-load")
        self._jobs: Dict[int, _Job] = {}
        self._submitting: set = set()  # job ids between submit()'s check and their entry in _jobs
        self._lock = threading.Lock()
        self._logged: set = set()
        self._closed = False
        self.stats = {"stored_chunks": 0, "loaded_chunks": 0, "failed_jobs": 0, "deleted_chunks": 0}

    @property
    def store(self) -> Any:
        """The storage tier (None when the chunks live in the worker's pinned memory)."""
        return None if self._tier.pinned else self._tier.store

    @store.setter
    def store(self, store: Any) -> None:
        if self._tier.pinned:
            raise NotSupportedError("kvtier.vllm: the chunks live in pinned memory; there is no storage tier to set")
        self._tier.store = store

    @property
    def pinned_chunks(self) -> int:
        """Chunks stored in pinned memory now (0 with a storage tier)."""
        return self._tier.objects() if self._tier.pinned else 0

    def _new_manager(self, grp: _Group, host_of: Any = None) -> Any:
        return _native.TransferManager.from_pages(self._device, self._kv_stream, grp.tensors, grp.pages,
                                                  num_host_blocks=self._tier.host_blocks(grp), host_of=host_of)

    def _acquire(self, plan: _Plan) -> Dict[int, Any]:
        """The managers of the job's groups, held until _release."""
        with self._mgr_lock:
            mgrs = {b.group: self._groups[b.group].manager for b in plan.batches}
            for m in mgrs.values():
                self._users[id(m)] = self._users.get(id(m), 0) + 1
        return mgrs

    def _release(self, mgrs: Dict[int, Any], failed: Optional[int]) -> None:
        """Ends a job's use of its managers. A failed copy retires its group's manager (a GPU copy error is sticky:
        every later copy of its streams would fail) for a new one, which on the pinned tier takes over its host cache
        with the bytes in it (the chunks stay, as the scheduler's index says); a retired manager closes once no job
        uses it."""
        close = []
        with self._mgr_lock:
            if failed is not None and not self._closed:
                try:
                    self._verify_stream = self._device.create_stream("kvtier-vllm-verify")
                except Exception as e:  # noqa: BLE001 (later checks fail on the old one, as they would anyway)
                    logger.error("kvtier.vllm: no new checksum stream after a failed copy: %s", e)
            for g, m in mgrs.items():
                self._users[id(m)] -= 1
                grp = self._groups[g]
                if g == failed and grp.manager is m and not self._closed:
                    try:
                        # The pinned tier's chunks live in the host cache: the new manager takes it over. (Not a
                        # staged tier's buffers: the old manager's hazards are not the new one's, and a copy that
                        # timed out may still write its buffer.)
                        grp.manager = self._new_manager(grp, host_of=m if self._tier.pinned else None)
                        self._retired.append(m)
                        logger.warning("kvtier.vllm: KV cache group %d: a copy failed; its copies continue on a new "
                                       "transfer manager", g)
                    except Exception as e:  # noqa: BLE001 (later jobs fail on the old one, as they would anyway)
                        logger.error("kvtier.vllm: KV cache group %d: no new transfer manager after a failed copy: "
                                     "%s", g, e)
            for m in list(self._retired):
                if self._users.get(id(m), 0) == 0:
                    self._retired.remove(m)
                    self._users.pop(id(m), None)
                    close.append(m)
        for m in close:
            try:
                m.close()
            except Exception as e:  # noqa: BLE001 (its copies failed already; nothing is lost)
                logger.debug("kvtier.vllm: closing a retired transfer manager: %s", e)

    def object_bytes(self, group: int) -> int:
        """The size of one chunk's object of a KV cache group (this rank's bytes of every layer of it)."""
        return self._groups[group].object_bytes

    # ------------------------------------------------------------------ resolving a job

    def _plan(self, ptrs: Any, names: List[str], is_store: bool) -> _Plan:
        """Device pointers (vLLM's order: group by group, data reference by data reference, block by block) as
        batches of chunks, each with its blocks' (host block in the batch, device row)."""
        bpc = self.blocks_per_chunk
        missing = [a for a in ("ptrs", "sizes", "group_block_counts", "group_data_ref_counts", "block_indices")
                   if not hasattr(ptrs, a)]
        if missing:
            raise _JobFailed(f"device pointers {type(ptrs).__name__} have no {', '.join(missing)} (vLLM's "
                             "DevicePointers)")
        counts = tuple(ptrs.group_block_counts)
        if len(counts) != len(self._groups):
            raise _JobFailed(f"{len(counts)} KV cache groups in the job, {len(self._groups)} registered")
        all_ptrs = np.asarray(ptrs.ptrs, dtype=np.uint64).astype(np.int64)
        all_sizes = np.asarray(ptrs.sizes, dtype=np.uint64).astype(np.int64)
        chunk0 = at = total = 0
        batches: List[_Batch] = []
        for g, (n_blocks, n_refs, block_idx) in enumerate(zip(counts, ptrs.group_data_ref_counts,
                                                              ptrs.block_indices)):
            if n_blocks == 0:
                continue
            grp = self._groups[g]
            if n_refs != len(grp.tensors):
                raise _JobFailed(f"group {g}: {n_refs} data references in the job, {len(grp.tensors)} registered")
            if isinstance(block_idx, (bool, np.bool_)) or not isinstance(block_idx, (int, np.integer)):
                raise _JobFailed(f"group {g}: block index {block_idx!r} is not an integer")
            if int(block_idx) < 0:
                raise _JobFailed(f"group {g}: block index {block_idx} is negative")
            skip = int(block_idx) % bpc
            n_chunks = (n_blocks + skip + bpc - 1) // bpc
            if is_store and (skip or n_blocks % bpc):
                raise _JobFailed(f"group {g}: a store of {n_blocks} blocks from block {block_idx} is not whole "
                                 f"chunks of {bpc} blocks")
            rows = None
            for i in range(len(grp.tensors)):
                seg, sizes = all_ptrs[at:at + n_blocks], all_sizes[at:at + n_blocks]
                if len(seg) != n_blocks or len(sizes) != n_blocks:
                    raise _JobFailed(f"{len(all_ptrs)} device pointers and {len(all_sizes)} sizes, fewer than the "
                                     f"group counts {counts} and data references need")
                off = seg - grp.bases[i]
                stride = grp.row_strides[i]
                bad = (sizes != grp.pages[i]) | (off < 0) | (off % stride != 0) | (off // stride >= grp.num_blocks)
                if len(seg) != n_blocks or bad.any():
                    j = int(np.argmax(bad)) if len(seg) and bad.any() else 0
                    what = f"{int(seg[j]):#x} of {int(sizes[j])} bytes" if len(seg) else "(missing)"
                    raise _JobFailed(f"group {g}: device pointer {what} is not a block of its KV tensor {i} (base "
                                     f"{grp.bases[i]:#x}, {grp.num_blocks} rows of {stride} bytes, pages of "
                                     f"{grp.pages[i]})")
                r = off // stride
                if rows is None:
                    rows = r
                elif not np.array_equal(rows, r):
                    j = int(np.argmax(rows != r))
                    raise _JobFailed(f"group {g}: block {j} of the job is row {int(rows[j])} of KV tensor 0 and row "
                                     f"{int(r[j])} of KV tensor {i} (a group's data references share block ids)")
                at += n_blocks
            if len(np.unique(rows)) != len(rows):
                raise _JobFailed(f"group {g}: a device block appears twice in the job")
            pos = np.arange(skip, skip + n_blocks, dtype=np.int64)  # place in the group's chunks: chunk * bpc + slot
            for c0 in range(0, n_chunks, grp.batch_chunks):
                c1 = min(n_chunks, c0 + grp.batch_chunks)
                sel = (pos >= c0 * bpc) & (pos < c1 * bpc)
                batches.append(_Batch(g, list(names[chunk0 + c0:chunk0 + c1]), pos[sel] - c0 * bpc, rows[sel]))
            total += n_blocks * grp.block_bytes
            chunk0 += n_chunks
        if at != len(all_ptrs):
            raise _JobFailed(f"{len(all_ptrs)} device pointers, {at} expected from the group counts")
        if chunk0 != len(names):
            raise _JobFailed(f"{len(names)} chunk keys for {chunk0} chunks of device blocks")
        return _Plan(batches, total)

    # ------------------------------------------------------------------ the copies (on the job threads)

    @staticmethod
    def _copy(group: int, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as e:
            raise _CopyFailed(group, e) from e

    def _hosts(self, b: _Batch, bases: List[int]) -> List[int]:
        """The host block of every move of the batch, its chunk at bases[chunk]."""
        bpc = self.blocks_per_chunk
        return (np.asarray(bases, dtype=np.int64)[b.host // bpc] + b.host % bpc).tolist()

    def _run_store(self, plan: _Plan, delete: List[str], ready: Any) -> int:
        self.stats["deleted_chunks"] += self._tier.delete(list(delete))
        if not plan.batches:
            return 0
        written: List[str] = []
        mgrs = self._acquire(plan)
        failed = None
        pending = None
        current = None
        try:
            if ready is not None:
                self._stream.wait_event(ready)  # the blocks are final once the engine's stream got there

            def start(k: int):
                b = plan.batches[k]
                mgr = mgrs[b.group]
                bases = self._tier.store_bases(mgr, b, k)
                try:
                    task = self._copy(b.group, mgr.evict, b.rows.tolist(), self._hosts(b, bases))
                except BaseException:
                    self._tier.store_failed([], [(b.group, bases)])
                    raise
                return b, bases, mgr, task

            pending = start(0)
            for k in range(len(plan.batches)):
                current, pending = pending, None
                b, bases, mgr, task = current
                # The next batch's copy runs while the tier takes this one.
                pending = start(k + 1) if k + 1 < len(plan.batches) else None
                self._copy(b.group, mgr.wait, task, COPY_TIMEOUT_S)
                self._tier.stored(mgr, b, bases)
                written += b.names
                current = None
        except BaseException as e:
            failed = e.group if isinstance(e, _CopyFailed) else None
            uncommitted = [(c[0].group, c[1]) for c in (current, pending) if c is not None]
            for c in (current, pending):  # copies in flight end before their slots or buffers are reused
                if c is not None:
                    try:
                        c[2].wait(c[3], COPY_TIMEOUT_S)
                    except Exception:  # noqa: BLE001 (the job failed already)
                        pass
            self._tier.store_failed(written, uncommitted)
            raise
        finally:
            self._release(mgrs, failed)
        self.stats["stored_chunks"] += len(written)
        return plan.total_bytes

    def _run_load(self, plan: _Plan) -> int:
        mgrs = self._acquire(plan)
        tasks: List[Tuple[_Batch, Any, Any, List[int]]] = []
        failed: Optional[int] = None

        def wait_all() -> None:  # the blocks are in place and checked (or the job failed) before it is reported
            first_error = None
            for b, mgr, task, bases in tasks:
                try:
                    if task is not None:
                        self._copy(b.group, mgr.wait, task, COPY_TIMEOUT_S)
                        if first_error is None:
                            self._tier.loaded_check(mgr, b)
                except (_CopyFailed, _JobFailed) as e:
                    first_error = first_error or e
                finally:
                    self._tier.loaded(b.group, bases)
            tasks.clear()
            if first_error is not None:
                raise first_error

        try:
            for k, b in enumerate(plan.batches):
                mgr = mgrs[b.group]
                bases = self._tier.load_bases(mgr, b, k)
                tasks.append((b, mgr, None, bases))
                # The copy into the KV tensors runs while the tier reads the next batch.
                task = self._copy(b.group, mgr.load, [], self._hosts(b, bases), b.rows.tolist())
                tasks[-1] = (b, mgr, task, bases)
            wait_all()
        except BaseException as e:
            try:
                wait_all()
            except _CopyFailed as copy_error:
                failed = copy_error.group
            except _JobFailed:
                pass
            if isinstance(e, _CopyFailed):
                failed = e.group
            raise
        finally:
            self._release(mgrs, failed)
        self.stats["loaded_chunks"] += len(plan.names)
        return plan.total_bytes

    # ------------------------------------------------------------------ jobs

    def submit(self, job_id: int, ptrs: Any, names: List[str], delete: List[str], is_store: bool,
               expedited: bool = False) -> None:
        """Starts a store (KV tensors -> objects ``names``, after deleting ``delete``) or a load (objects -> KV
        tensors). ``ptrs``: the job's device blocks as vLLM's ``DevicePointers`` has them (``ptrs``, ``sizes``,
        ``group_block_counts``, ``group_data_ref_counts``, ``block_indices``). A job that cannot be planned is
        reported failed by ``finished()``."""
        with self._lock:
            # A second job of one id would hide the first one's outcome. Reserved here, not only checked: two
            # threads submitting one id were both accepted while each planned outside the lock.
            if job_id in self._jobs or job_id in self._submitting:
                raise InvalidArgumentError(f"kvtier.vllm: job {job_id} is already submitted and not yet finished")
            self._submitting.add(job_id)
        try:
            self._submit(job_id, ptrs, names, delete, is_store, expedited)
        finally:
            with self._lock:
                self._submitting.discard(job_id)

    def _submit(self, job_id: int, ptrs: Any, names: List[str], delete: List[str], is_store: bool,
                expedited: bool) -> None:
        ready = None
        try:
            if self._closed:
                raise _JobFailed("the worker was shut down")
            if is_store and len(set(names)) != len(names):
                # One slot per name: the pinned tier took two for it and freed one at the delete (a slot lost for
                # good); the other tiers refuse such a batch of puts.
                twice = next(n for n in names if names.count(n) > 1)
                raise _JobFailed(f"chunk {twice} appears twice in the store job")
            plan = self._plan(ptrs, names, is_store)
            if self._cuda and is_store:
                ready = torch.cuda.Event()
                ready.record()  # the engine's stream: the blocks are final once it reaches here
        except _JobFailed as e:
            fut: Future = Future()
            fut.set_exception(e)
            if is_store and delete and not self._closed:
                # The job's deletes (chunks the index evicted for it) still run: dropped with the job, they left
                # objects no index reports, and a pinned tier full of them refused every later store.
                def deletes_then_fail(names=list(delete), err=e):
                    self.stats["deleted_chunks"] += self._tier.delete(names)
                    raise err
                try:
                    fut = self._store_pool.submit(deletes_then_fail)
                except RuntimeError:  # shut down meanwhile: nothing is stored any more
                    pass
            with self._lock:
                self._jobs[job_id] = _Job(job_id, fut, 0, is_store)
            return
        try:
            if is_store:
                fut = self._store_pool.submit(self._run_store, plan, list(delete), ready)
            else:
                fut = self._load_pool.submit(expedited, self._run_load, plan)
        except RuntimeError:  # shut down between the check above and here
            fut = Future()
            fut.set_exception(_JobFailed("the worker was shut down"))
        with self._lock:
            self._jobs[job_id] = _Job(job_id, fut, plan.total_bytes, is_store)

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

    def finished(self) -> List[FinishedJob]:
        """Jobs that ended since the last call (failures logged once per kind, the last kept in last_error)."""
        with self._lock:
            done = [j for j in self._jobs.values() if j.future.done()]
            for j in done:
                del self._jobs[j.job_id]
        out = []
        for j in done:
            err = j.future.exception()
            if err is not None:
                self._fail(j, err)
            out.append(FinishedJob(j.job_id, err is None, j.bytes if err is None else None,
                                   (time.perf_counter() - j.start) if err is None else None))
        return out

    def wait(self, job_ids: set, timeout: float = JOB_TIMEOUT_S) -> None:
        """Until the jobs have ended (their outcome comes from finished()); TimedOutError naming the first job that
        did not end within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for job_id in job_ids:
            with self._lock:
                j = self._jobs.get(job_id)
            if j is not None:
                try:
                    j.future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise TimedOutError(f"kvtier.vllm: job {job_id} did not end within {timeout:g} s (a storage "
                                        "tier that stopped answering?)") from None
                except BaseException:  # noqa: BLE001 (reported by get_finished)
                    pass

    def shutdown(self, timeout: float = JOB_TIMEOUT_S) -> None:
        """Finishes the jobs submitted so far, up to ``timeout`` seconds, and releases the managers
        (idempotent). Jobs still running then are left to their threads (logged)."""
        self._closed = True
        self._store_pool.shutdown(wait=False)
        self._load_pool.shutdown()
        with self._lock:
            running = [j for j in self._jobs.values() if not j.future.done()]
        deadline = time.monotonic() + timeout
        left_running = False
        for j in running:
            try:
                j.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                logger.error("kvtier.vllm: shutdown: job %d did not end within %g s; left running", j.job_id,
                             timeout)
                left_running = True
                break
            except BaseException:  # noqa: BLE001 (its outcome was the job's)
                pass
        with self._mgr_lock:
            managers = [grp.manager for grp in self._groups if grp.manager is not None] + self._retired
            for grp in self._groups:
                grp.manager = None
            # A manager a job left running still uses (its host pages, its copies) closes when that job releases
            # it (_release closes retired managers nobody uses); closing it here freed memory the job then touched.
            self._retired = [m for m in managers if self._users.get(id(m), 0) > 0]
            idle = [m for m in managers if self._users.get(id(m), 0) == 0]
        for m in idle:
            m.close()
        # The storage tier's backend goes with the worker (a disk tier's directory lock: a new worker of this
        # process over the same directory was refused until the garbage collector ran), unless a job left running
        # still uses it.
        store = None if self._tier.pinned else self._tier.store
        if store is not None and not left_running and hasattr(store, "close"):
            try:
                store.close()
            except Exception as e:  # noqa: BLE001 (shutting down: nothing more to do with it)
                logger.debug("kvtier.vllm: closing the storage tier: %s", e)
