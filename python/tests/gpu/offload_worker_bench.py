#!/usr/bin/env python3
"""kvtier.vllm's worker on a GPU, where vLLM is not installed: kvtier._chunk_mover.ChunkMover (the worker's whole
data path; KvtierOffloadingWorker only translates vLLM's calls to it) driven as vLLM's offloading connector drives
the worker: submit_store of whole chunks, poll until finished, submit_load of the same chunks into other blocks,
poll; bytes checked on the GPU against the source blocks, with the destinations poisoned first.

Shape: one KV cache group of --layers data references (vLLM's canonical (num_blocks, page) byte tensors on the
GPU, one per layer), pages of --page-bytes (a 7B model's K+V of one layer for 16 tokens: 256 KiB), chunks of
--blocks-per-chunk blocks, --chunks chunks per job. Three tiers behind the worker:
  - memory:   a Python store (ctypes memmove into host buffers): the worker's own copies, nothing else;
  - kvmemory: kvtier's memory tier (memory:?capacity=...): objects in RAM with their headers and checksums,
              verified on every get;
  - disk:     kvtier's disk tier in --dir (tmpfs by default: no device in the way);
  - pinned:   the chunks in the worker's own pinned memory (storage "pinned:"): copied straight between the KV
              tensors and their slots, checksummed when stored and verified before loaded;
  - discard:  a store that keeps nothing (puts and gets do no copy): the worker's GPU side alone, the copies
              between the KV tensors and its pinned batches; the loaded bytes are not checked on this row.
Beside it, the same bytes moved in the same run by:
  - the PCIe ceiling: one contiguous pinned <-> device copy per layer (torch, non_blocking);
  - vLLM's CPU-offload copy shape: one cudaMemcpyAsync per (layer, block) between the GPU blocks and a pinned
    CPU block pool (torch copy_ per block, non_blocking), the batch synchronised once.
p50 of --repeats. Prints JSON lines; exit code 1 if any check fails.
"""
import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
import types

import numpy as np
import torch

import kvtier
from kvtier._chunk_mover import DEFAULT_STAGING, ChunkMover


class DiscardStore:
    """Keeps nothing: every put and get succeeds at once without a copy (the worker's own copies measured alone)."""

    name = "discard"

    def put_many(self, names, buffers):
        return [size for _, size in buffers]

    def get_many(self, names, buffers):
        return [size for _, size in buffers]

    def delete_many(self, names):
        return [None for _ in names]


class MemoryStore:
    """put_many / get_many / delete_many as kvtier's StorageBackend has them, in host memory."""

    name = "memory"

    def __init__(self):
        self.objects = {}

    def put_many(self, names, buffers):
        out = []
        for n, (ptr, size) in zip(names, buffers):
            b = self.objects.get(n)
            if b is None or len(b) != size:
                b = self.objects[n] = bytearray(size)
            ctypes.memmove((ctypes.c_char * size).from_buffer(b), ptr, size)
            out.append(size)
        return out

    def get_many(self, names, buffers):
        out = []
        for n, (ptr, size) in zip(names, buffers):
            b = self.objects.get(n)
            if b is None:
                out.append(None)
                continue
            ctypes.memmove(ptr, (ctypes.c_char * len(b)).from_buffer(b), min(size, len(b)))
            out.append(len(b))
        return out

    def delete_many(self, names):
        return [len(self.objects.pop(n)) if n in self.objects else None for n in names]


def pointers(tensors, rows, page, first_block):
    """The job's device blocks in vLLM's order (group by group, data reference by data reference, block by block),
    as vLLM's DevicePointers carries them."""
    ptrs = [t.data_ptr() + r * t.stride(0) for t in tensors for r in rows]
    return types.SimpleNamespace(ptrs=np.array(ptrs, dtype=np.uint64), sizes=np.full(len(ptrs), page, np.uint64),
                                 group_block_counts=[len(rows)], group_data_ref_counts=[len(tensors)],
                                 block_indices=[first_block])


def run_job(mover, job_id, ptrs, names, is_store, timeout=120.0):
    t0 = time.perf_counter()
    mover.submit(job_id, ptrs, names, [], is_store)
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        for f in mover.finished():
            if f.job_id == job_id:
                if not f.success:
                    raise RuntimeError(f"job {job_id} failed: {mover.last_error}")
                return time.perf_counter() - t0
        time.sleep(0.0002)
    raise RuntimeError(f"job {job_id} not finished after {timeout} s")


def p50(xs):
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-bytes", type=int, default=256 << 10)
    ap.add_argument("--blocks-per-chunk", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--staging-bytes", type=int, default=DEFAULT_STAGING)
    ap.add_argument("--tiers", default="discard,pinned,memory,kvmemory,disk")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    bpc, n_blocks = a.blocks_per_chunk, a.blocks_per_chunk * a.chunks
    total_blocks = 4 * n_blocks
    torch.manual_seed(7)
    tensors = [torch.randint(0, 256, (total_blocks, a.page_bytes), dtype=torch.uint8, device=dev)
               for _ in range(a.layers)]
    job_bytes = a.layers * n_blocks * a.page_bytes
    rng = np.random.default_rng(3)
    perm = rng.permutation(total_blocks)
    src_rows, dst_rows = perm[:n_blocks], perm[n_blocks:2 * n_blocks]  # scattered, disjoint
    results, ok = [], True

    def emit(row):
        print(json.dumps(row), flush=True)
        results.append(row)

    # ---- the worker, per tier
    for tier in a.tiers.split(","):
        tmp = None
        pinned = 0
        if tier == "pinned":
            store, pinned = None, 2 * a.chunks
        elif tier == "memory":
            store = MemoryStore()
        elif tier == "discard":
            store = DiscardStore()
        elif tier == "kvmemory":  # kvtier's own memory tier (memory:?capacity=...): verified objects in RAM
            cap = 2 * a.chunks * (a.layers * bpc * a.page_bytes + (1 << 20))
            store = kvtier.StorageBackend.open(f"memory:?capacity={cap}", "bench", {})
        else:
            tmp = tempfile.mkdtemp(prefix="kvtier-worker-", dir=a.dir)
            cap = 2 * a.chunks * (a.layers * bpc * a.page_bytes + (1 << 20))
            store = kvtier.StorageBackend.open(f"disk:{tmp}?capacity={cap}&durability=process", "bench", {})
        mover = ChunkMover([[(t, a.page_bytes) for t in tensors]], store, bpc, a.staging_bytes, pinned)
        names = [f"{c:032x}" for c in range(1, a.chunks + 1)]
        store_s, load_s = [], []
        for rep in range(a.repeats + 1):
            torch.cuda.synchronize()
            s = run_job(mover, 2 * rep + 1, pointers(tensors, src_rows, a.page_bytes, 0), names, True)
            for t in tensors:
                t[torch.from_numpy(dst_rows).to(dev)] = 0xEE  # poison the destinations
            torch.cuda.synchronize()
            lo = run_job(mover, 2 * rep + 2, pointers(tensors, dst_rows, a.page_bytes, 0), names, False)
            same = all(torch.equal(t[torch.from_numpy(dst_rows).to(dev)], t[torch.from_numpy(src_rows).to(dev)])
                       for t in tensors)
            checked = tier != "discard"
            ok = ok and (same or not checked)
            if rep > 0:  # the first is the warm-up
                store_s.append(s)
                load_s.append(lo)
        mover.shutdown()
        emit({"what": "worker", "tier": tier, "job_bytes": job_bytes, "store_gbps": job_bytes / p50(store_s) / 1e9,
              "load_gbps": job_bytes / p50(load_s) / 1e9, "bytes_checked": checked,
              "bytes_equal": same if checked else None})
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- the PCIe ceiling: the same bytes, one contiguous copy per layer each way
    pinned = torch.empty((n_blocks, a.page_bytes), dtype=torch.uint8, pin_memory=True)
    contig = [torch.empty((n_blocks, a.page_bytes), dtype=torch.uint8, device=dev) for _ in range(2)]
    d2h, h2d = [], []
    for rep in range(a.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.layers):
            pinned.copy_(contig[0], non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(a.layers):
            contig[1].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rep > 0:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    emit({"what": "pcie_ceiling", "job_bytes": job_bytes, "d2h_gbps": job_bytes / p50(d2h) / 1e9,
          "h2d_gbps": job_bytes / p50(h2d) / 1e9})

    # ---- vLLM's CPU-offload copy shape: a cudaMemcpyAsync per (layer, block) into a pinned CPU block pool
    cpu_pool = [torch.empty((n_blocks, a.page_bytes), dtype=torch.uint8, pin_memory=True) for _ in range(a.layers)]
    s_rows, d_rows = src_rows.tolist(), dst_rows.tolist()
    per_d2h, per_h2d = [], []
    for rep in range(a.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t, c in zip(tensors, cpu_pool):
            for i, r in enumerate(s_rows):
                c[i].copy_(t[r], non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for t, c in zip(tensors, cpu_pool):
            for i, r in enumerate(d_rows):
                t[r].copy_(c[i], non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rep > 0:
            per_d2h.append(t1 - t0)
            per_h2d.append(t2 - t1)
    same = all(torch.equal(t[torch.from_numpy(dst_rows).to(dev)], t[torch.from_numpy(src_rows).to(dev)])
               for t in tensors)
    ok = ok and same
    emit({"what": "vllm_per_block_copies", "job_bytes": job_bytes, "d2h_gbps": job_bytes / p50(per_d2h) / 1e9,
          "h2d_gbps": job_bytes / p50(per_h2d) / 1e9, "bytes_equal": same})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
