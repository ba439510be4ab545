"""Drives an OffloadingSpec the way vLLM 0.34's OffloadingConnector does, on torch tensors (CPU, or CUDA).

vLLM's scheduler side (``offloading/scheduler.py``) and worker side (``offloading/worker.py``) need a whole
``VllmConfig`` and model; this runner keeps their protocol and uses vLLM's own data classes and helpers
wherever they stand alone (``OffloadingConfig``, ``CanonicalKVCaches``, ``GPULoadStoreSpec``,
``make_offload_key``, ``resolve_device_pointers``, ``ReqContext``):

- scheduler: per chunk and KV cache group an ``OffloadKey`` (the chunk's last block hash + group index);
  ``lookup`` per key; ``prepare_store`` then a store job with a ``GPULoadStoreSpec`` of the chunk's blocks
  (group sizes and block indices as vLLM fills them); ``prepare_load`` of the hit prefix and a load job into
  new blocks; a job completes when every worker reported it, failed when any did, then ``complete_store``
  (with success) or ``complete_load``;
- worker: per worker rank its own spec (``config.parallel.rank``) and KV tensors, ``get_worker`` with the
  canonical caches, ``resolve_device_pointers`` per job, ``submit_store`` / ``submit_load``, ``get_finished``
  (and ``wait`` for a sync load).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers


@dataclass
class Group:
    """One KV cache group: ``layers`` layers of ``page`` bytes per block (rows ``row`` bytes wide, >= page)."""

    layers: int
    page: int
    row: int = 0
    tokens_per_block: int = 16

    def __post_init__(self):
        self.row = self.row or self.page


def make_config(extra: dict, groups: Sequence[Group], blocks_per_chunk: int = 1, rank: int = 0,
                world_size: int = 1, model: str = "org/model-8b", events: bool = False,
                canonical: bool = False, dp: Tuple[int, int] = (0, 1)) -> OffloadingConfig:
    """vLLM's OffloadingConfig for one process (rank 0 is also the scheduler's)."""
    gconfs = tuple(
        OffloadingGroupConfig(tokens_per_block=g.tokens_per_block,
                              layer_names=tuple(f"model.layers.{gi}.{i}.attn" for i in range(g.layers)),
                              group_id=gi)
        for gi, g in enumerate(groups))
    extra = dict(extra)
    extra.setdefault("spec_name", "KvtierOffloadingSpec")
    extra.setdefault("spec_module_path", "kvtier.vllm")
    return OffloadingConfig(
        groups=gconfs,
        worker_kv_bytes_per_block=sum(g.layers * g.row for g in groups),
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=groups[0].tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size, tp_size=world_size, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=dp[0],
                                          data_parallel_size=dp[1], data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
        canonical_layout=canonical,
        kv_cache_layout="NHD",
    )


class KVTensors:
    """A worker's KV cache: per group and layer an int8 (num_blocks, row) tensor on the CPU, as vLLM's
    worker canonicalises them (``CanonicalKVCaches``)."""

    def __init__(self, groups: Sequence[Group], num_blocks: int, seed: int = 0, device: str = "cpu"):
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: List[List[torch.Tensor]] = [
            [torch.zeros((num_blocks, g.row), dtype=torch.int8, device=device) for _ in range(g.layers)]
            for g in groups]

    def canonical(self) -> CanonicalKVCaches:
        flat, refs = [], []
        for g, ts in zip(self.groups, self.tensors):
            grefs = []
            for t in ts:
                flat.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=g.row))
                grefs.append(CanonicalKVCacheRef(tensor_idx=len(flat) - 1, page_size_bytes=g.page))
            refs.append(grefs)
        return CanonicalKVCaches(tensors=flat, group_data_refs=refs)

    def fill_random(self, group: int, blocks: Sequence[int]) -> None:
        for t in self.tensors[group]:
            for b in blocks:
                t[b] = torch.randint(-128, 128, (t.shape[1],), dtype=torch.int8, generator=self.gen).to(t.device)

    def poison(self, group: int, blocks: Sequence[int], value: int = 0x5A) -> None:
        for t in self.tensors[group]:
            for b in blocks:
                t[b].fill_(value)

    def block(self, group: int, b: int) -> bytes:
        """The block's page bytes of every layer of the group (what vLLM reads; padding excluded)."""
        page = self.groups[group].page
        return b"".join(t[b, :page].cpu().numpy().tobytes() for t in self.tensors[group])

    def row(self, group: int, b: int) -> bytes:
        return b"".join(t[b].cpu().numpy().tobytes() for t in self.tensors[group])


@dataclass
class Job:
    keys: Tuple[bytes, ...]
    is_store: bool
    src: object
    dst: object
    pending: int
    failed: bool = False
    done: bool = False


@dataclass
class Request:
    req_id: str
    hashes: List[bytes]  # per chunk: the hash of its last block
    ctx: ReqContext = field(default=None)  # type: ignore[assignment]


def chunk_hashes(n: int, tag: str = "p") -> List[bytes]:
    """Chained 32-byte hashes, one per chunk (vLLM's are SHA-256 of parent + tokens)."""
    out, parent = [], b"root"
    for i in range(n):
        parent = hashlib.sha256(parent + f"{tag}{i}".encode()).digest()
        out.append(parent)
    return out


class Connector:
    """The scheduler and ``world_size`` workers of one engine, on one spec class."""

    def __init__(self, extra: dict, groups: Sequence[Group], num_blocks: int = 32, blocks_per_chunk: int = 1,
                 world_size: int = 1, model: str = "org/model-8b", events: bool = False, seed: int = 0,
                 device: str = "cpu"):
        self.groups = list(groups)
        self.bpc = blocks_per_chunk
        cfg0 = make_config(extra, groups, blocks_per_chunk, 0, world_size, model, events)
        self.spec = OffloadingSpecFactory.create_spec(cfg0)  # the scheduler's (rank 0)
        self.manager = self.spec.get_manager()
        self.worker_specs = [self.spec if world_size == 1 else OffloadingSpecFactory.create_spec(
            make_config(extra, groups, blocks_per_chunk, r, world_size, model, events)) for r in range(world_size)]
        self.kv = [KVTensors(groups, num_blocks, seed=seed + 17 * r, device=device) for r in range(world_size)]
        self.caches = [kv.canonical() for kv in self.kv]
        self.workers = [s.get_worker(c) for s, c in zip(self.worker_specs, self.caches)]
        self.jobs: Dict[int, Job] = {}
        self.next_job = 1
        self.requests: Dict[str, Request] = {}

    # ------------------------------------------------------------------ scheduler side

    def request(self, req_id: str, hashes: List[bytes]) -> Request:
        r = Request(req_id, hashes, ReqContext(req_id=req_id))
        self.manager.on_new_request(r.ctx)
        self.requests[req_id] = r
        return r

    def keys(self, req: Request, chunk: int, groups: Optional[Sequence[int]] = None) -> List[bytes]:
        gs = range(len(self.groups)) if groups is None else groups
        return [make_offload_key(req.hashes[chunk], g) for g in gs]

    def scheduled(self, req: Request) -> None:
        """The end of the scheduler step that scheduled ``req`` (vLLM's on_schedule_end, after that step's
        prepare_store / prepare_load)."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[req.req_id], preempted_req_ids=[]))

    def lookup(self, req: Request, groups: Optional[Sequence[int]] = None) -> Tuple[int, List[LookupResult]]:
        """Chunks hit from the start (every group's key a HIT), and the first non-HIT result per group."""
        n = 0
        for c in range(len(req.hashes)):
            res = [self.manager.lookup(k, req.ctx) for k in self.keys(req, c, groups)]
            if any(r is not LookupResult.HIT for r in res):
                return n, res
            n += 1
        return n, []

    def store(self, req: Request, chunks: Sequence[int], block_ids: Dict[int, List[int]],
              groups: Optional[Sequence[int]] = None) -> Optional[int]:
        """One store job of whole chunks: block_ids[g] are the group's blocks of those chunks, in order.
        Returns the job id, 0 when nothing needed storing, None when the manager refused (allocation failure)."""
        gs = list(range(len(self.groups)) if groups is None else groups)
        keys = [make_offload_key(req.hashes[c], g) for g in gs for c in chunks]
        out = self.manager.prepare_store(keys, req.ctx)
        self.scheduled(req)
        if out is None:
            return None
        if not out.keys_to_store:
            return 0
        accepted = {bytes(k) for k in out.keys_to_store}
        src_blocks, sizes, indices = [], [0] * len(self.groups), [0] * len(self.groups)
        for g in gs:
            chosen = [i for i, c in enumerate(chunks) if bytes(make_offload_key(req.hashes[c], g)) in accepted]
            # vLLM stores the chunks of one job as one run per group (contiguous chunk indices).
            assert chosen == list(range(chosen[0], chosen[-1] + 1)) if chosen else True
            for i in chosen:
                src_blocks += block_ids[g][i * self.bpc:(i + 1) * self.bpc]
            sizes[g] = len(chosen) * self.bpc
            indices[g] = chunks[chosen[0]] * self.bpc if chosen else 0
        # keys_to_store come in the order of the device blocks: group by group, chunk by chunk
        assert [bytes(k) for k in out.keys_to_store] == [k for k in map(bytes, keys) if k in accepted]
        src = GPULoadStoreSpec(src_blocks, group_sizes=sizes, block_indices=indices)
        return self._submit(tuple(bytes(k) for k in out.keys_to_store), True, src, out.store_spec)

    def load(self, req: Request, n_chunks: int, block_ids: Dict[int, List[int]], first_block: int = 0,
             groups: Optional[Sequence[int]] = None, sync: bool = False) -> int:
        """A load job of the first ``n_chunks`` chunks' blocks from ``first_block`` (a prefix the GPU does not
        hold yet) into block_ids[g] (one per block). Returns the job id."""
        gs = list(range(len(self.groups)) if groups is None else groups)
        first_chunk = first_block // self.bpc
        keys = [make_offload_key(req.hashes[c], g) for g in gs for c in range(first_chunk, n_chunks)]
        src = self.manager.prepare_load(keys, req.ctx)
        self.scheduled(req)
        dst_blocks, sizes, indices = [], [0] * len(self.groups), [0] * len(self.groups)
        for g in gs:
            n_blocks = n_chunks * self.bpc - first_block
            assert len(block_ids[g]) == n_blocks
            dst_blocks += block_ids[g]
            sizes[g] = n_blocks
            indices[g] = first_block
        dst = GPULoadStoreSpec(dst_blocks, group_sizes=sizes, block_indices=indices)
        return self._submit(tuple(bytes(k) for k in keys), False, src, dst, sync=sync)

    def _submit(self, keys, is_store, src, dst, sync=False) -> int:
        job_id = self.next_job
        self.next_job += 1
        self.jobs[job_id] = Job(keys, is_store, src, dst, pending=len(self.workers))
        for w, caches in zip(self.workers, self.caches):
            if is_store:
                assert w.submit_store(job_id, resolve_device_pointers(src, caches), dst)
            else:
                assert w.submit_load(job_id, src, resolve_device_pointers(dst, caches), expedited=sync)
        if sync:
            for w in self.workers:
                w.wait({job_id})
        return job_id

    # ------------------------------------------------------------------ completions

    def poll(self) -> None:
        """One step's worth of worker results: a job completes when every worker reported it."""
        for w in self.workers:
            for res in w.get_finished():
                job = self.jobs[res.job_id]
                job.pending -= 1
                job.failed |= not res.success
                assert job.pending >= 0
                if job.pending:
                    continue
                job.done = True
                req_ctx = ReqContext(req_id="job")
                if job.is_store:
                    self.manager.complete_store(list(job.keys), req_ctx, success=not job.failed)
                else:
                    self.manager.complete_load(list(job.keys), req_ctx)

    def finish(self, *job_ids: int) -> List[bool]:
        """Waits for the jobs (as vLLM's wait), completes them; per job True when it succeeded."""
        for w in self.workers:
            w.wait(set(job_ids))
        for _ in range(1000):
            self.poll()
            if all(self.jobs[j].done for j in job_ids):
                break
        assert all(self.jobs[j].done for j in job_ids), "jobs never reported finished"
        return [not self.jobs[j].failed for j in job_ids]

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
