"""Chunks of an engine's paged KV cache moved between its KV tensors and a kvtier storage tier: the worker side
of :mod:`kvtier.vllm`, written against plain tensors and duck-typed job descriptions so that it runs wherever torch
does (the GPU runner, ``python/tests/gpu/offload_worker_bench.py``, runs it where vLLM is not installed).

Each chunk of ``blocks_per_chunk`` blocks of one KV cache group is one storage object: that rank's bytes of every
layer of the group, data reference by data reference, block by block (pages of ``page_size_bytes`` at the start of
each row of a ``(num_blocks, row_bytes)`` byte tensor). Failures are misses, never garbage: a job succeeds only when
every object was written (store) or read whole, verified and of the chunk's exact size (load), and a load scatters
nothing before all its objects verified.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import InvalidArgumentError, NotSupportedError

logger = logging.getLogger("kvtier.vllm")

DEFAULT_STAGING = 256 << 20


class FinishedJob(NamedTuple):
    job_id: int
    success: bool
    bytes: Optional[int]  # None when it failed
    seconds: Optional[float]


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


class ChunkMover:
    """Moves chunks between an engine's KV tensors and a kvtier storage tier.

    Stores run in submission order on one thread (so a chunk evicted by one store and stored again by a later
    one is deleted before it is written); loads run on their own thread, never behind stores. A job gathers
    (store) or scatters (load) through a staging buffer of at most ``staging_bytes`` per storage batch, pinned
    when the KV tensors are on a GPU, with the copies on a side stream that waits for the engine's stream."""

    def __init__(self, groups: Sequence[Sequence[Tuple[Any, int]]], store: Any, blocks_per_chunk: int,
                 staging_bytes: int = DEFAULT_STAGING):
        self.store = store
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.staging_bytes = int(staging_bytes)
        self.last_error: Optional[str] = None
        self._groups: List[List[_Region]] = []
        self._object_bytes: List[int] = []
        self._device = None
        for g, refs in enumerate(groups):
            regions: List[_Region] = []
            offset = 0
            for i, (t, page_size_bytes) in enumerate(refs):
                if t.dim() != 2 or t.stride(1) != 1 or t.element_size() != 1:
                    raise NotSupportedError(
                        f"kvtier.vllm: KV tensor {i} of group {g} is not a (num_blocks, bytes) byte "
                        f"tensor (shape {tuple(t.shape)}, strides {t.stride()}, dtype {t.dtype})")
                if page_size_bytes > t.shape[1]:
                    raise InvalidArgumentError(
                        f"kvtier.vllm: group {g}: page of {page_size_bytes} bytes in rows of {t.shape[1]}")
                if self._device is None:
                    self._device = t.device
                elif t.device != self._device:
                    raise NotSupportedError(f"kvtier.vllm: KV tensors on {self._device} and {t.device}")
                u = t if t.dtype == torch.uint8 else t.view(torch.uint8)
                arr = u.numpy() if u.device.type == "cpu" else None
                regions.append(_Region(u, arr, t.data_ptr(), t.stride(0), t.shape[0], page_size_bytes, offset))
                offset += page_size_bytes * self.blocks_per_chunk
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

    def _plan(self, ptrs: Any, names: List[str], is_store: bool) -> _Plan:
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
        """For chunks [a, b) in ``staging`` (numpy or torch; chunk i at byte starts[i - a]): per region a (chunks,
        bpc, page) view of its pages there, the (chunk, slot) places of its moves in that view and their tensor
        rows."""
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

    @staticmethod
    def _runs(ci: Any, si: Any):
        """Runs [j0, j1) of moves whose places follow each other inside one chunk (ci equal, si consecutive): one
        contiguous range of the staging buffer each."""
        if len(ci) == 0:
            return
        breaks = np.flatnonzero((np.diff(ci) != 0) | (np.diff(si) != 1)) + 1
        bounds = [0, *breaks.tolist(), len(ci)]
        for j0, j1 in zip(bounds[:-1], bounds[1:]):
            yield j0, j1, int(ci[j0]), int(si[j0])

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
                if self._cuda:
                    # Per region: gathered on the GPU, then one DMA per run of places into the pinned staging.
                    with torch.cuda.stream(self._stream):
                        for r, view, ci, si, rows in self._pages(plan, staging, starts, a, b):
                            idx = torch.from_numpy(rows).to(self._device, non_blocking=True)
                            gathered = r.tensor.index_select(0, idx)[:, :r.page_bytes].contiguous()
                            for j0, j1, c, s0 in self._runs(ci, si):
                                view[c, s0:s0 + (j1 - j0)].copy_(gathered[j0:j1], non_blocking=True)
                    self._stream.synchronize()
                else:
                    for r, view, ci, si, rows in self._pages(plan, host, starts, a, b):
                        view[ci, si] = r.array[rows, :r.page_bytes]
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
            if self._cuda:
                # Per region: one DMA per run of places out of the pinned staging, then scattered on the GPU.
                with torch.cuda.stream(self._stream):
                    for r, view, ci, si, rows in self._pages(plan, staging, starts, a, b):
                        pages = torch.empty((len(rows), r.page_bytes), dtype=torch.uint8, device=self._device)
                        for j0, j1, c, s0 in self._runs(ci, si):
                            pages[j0:j1].copy_(view[c, s0:s0 + (j1 - j0)], non_blocking=True)
                        idx = torch.from_numpy(rows).to(self._device, non_blocking=True)
                        r.tensor[idx, :r.page_bytes] = pages
                self._stream.synchronize()  # the blocks are in place before the job is reported done
            else:
                for r, view, ci, si, rows in self._pages(plan, host, starts, a, b):
                    r.array[rows, :r.page_bytes] = view[ci, si]
        self.stats["loaded_chunks"] += len(plan.names)
        return plan.total_bytes

    # ------------------------------------------------------------------ jobs

    def submit(self, job_id: int, ptrs: Any, names: List[str], delete: List[str], is_store: bool) -> None:
        """Starts a store (KV tensors -> objects ``names``, after deleting ``delete``) or a load (objects -> KV
        tensors). ``ptrs``: the job's device blocks as vLLM's ``DevicePointers`` has them (``ptrs``, ``sizes``,
        ``group_block_counts``, ``group_data_ref_counts``, ``block_indices``). A job that cannot be planned is
        reported failed by ``finished()``."""
        ready = None
        try:
            plan = self._plan(ptrs, names, is_store)
            if self._cuda and is_store:
                ready = torch.cuda.Event()
                ready.record()  # the engine's stream: the blocks are final once it reaches here
        except _JobFailed as e:
            fut: Future = Future()
            fut.set_exception(e)
            with self._lock:
                self._jobs[job_id] = _Job(job_id, fut, 0, is_store)
            return
        if is_store:
            fut = self._store_pool.submit(self._run_store, plan, list(delete), ready)
        else:
            fut = self._load_pool.submit(self._run_load, plan)
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
