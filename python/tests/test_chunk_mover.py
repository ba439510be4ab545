"""kvtier._chunk_mover.ChunkMover (the data path of kvtier.vllm's worker) without vLLM: the copies through kvtier's
TransferManager between (num_blocks, row) byte tensors and a storage tier, on the CPU (kvtier's host backend) and,
where there is one, on a CUDA GPU. Bytes are compared after loads into poisoned blocks; the rows' padding and every
block not in a job must stay as they were."""
import ctypes
import threading
import time
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
from kvtier._chunk_mover import ChunkMover  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
POISON = 0x5A


def tensors(device, layers, num_blocks, page, row, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        t = torch.full((num_blocks, row), POISON, dtype=torch.uint8)
        t[:, :page] = torch.randint(0, 256, (num_blocks, page), generator=g, dtype=torch.uint8)
        out.append(t.to(device))
    return out


def pointers(groups, rows_per_group, first_blocks=None):
    """vLLM's DevicePointers for blocks `rows_per_group[g]` of each group (group by group, data reference by data
    reference, block by block)."""
    ptrs, sizes = [], []
    for refs, rows in zip(groups, rows_per_group):
        for t, page in refs:
            ptrs += [t.data_ptr() + r * t.stride(0) for r in rows]
            sizes += [page] * len(rows)
    return types.SimpleNamespace(ptrs=np.array(ptrs, dtype=np.uint64), sizes=np.array(sizes, dtype=np.uint64),
                                 group_block_counts=[len(r) for r in rows_per_group],
                                 group_data_ref_counts=[len(refs) for refs in groups],
                                 block_indices=first_blocks or [0] * len(groups))


def run(mover, job_id, ptrs, names, is_store, timeout=60.0):
    mover.submit(job_id, ptrs, names, [], is_store)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for f in mover.finished():
            assert f.job_id == job_id
            return f.success
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} not finished in {timeout} s")


@pytest.fixture
def memory_tier():
    return kvtier.StorageBackend.open("memory:?capacity=256M&threads=3", "chunk-mover-test", {})


def mover_for(tier, groups, bpc, memory_tier, staging=64 << 20, pinned_chunks=64):
    if tier == "pinned":
        return ChunkMover(groups, None, bpc, staging, pinned_chunks=pinned_chunks)
    return ChunkMover(groups, memory_tier, bpc, staging)


def stored_objects(mover, memory_tier):
    return mover.pinned_chunks if mover.store is None else memory_tier.stats()["objects"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["memory", "pinned"])
@pytest.mark.parametrize("bpc,staging", [(1, 64 << 20), (4, 64 << 20), (4, 1)])
def test_store_then_load_byte_exact(device, tier, bpc, staging, memory_tier):
    """Whole chunks stored from scattered blocks, loaded into other (poisoned) blocks; with staging of one byte
    every chunk is a batch of its own (more batches than the two buffers a direction has). Behind a storage tier
    (kvtier's memory tier) and in the worker's pinned memory."""
    page, row, n = 4096 + 64, 4096 + 256, 64
    kv = tensors(device, 3, n, page, row, seed=bpc)
    groups = [[(t, page) for t in kv]]
    mover = mover_for(tier, groups, bpc, memory_tier, staging)
    try:
        chunks = 5
        rng = np.random.default_rng(bpc)
        perm = rng.permutation(n)
        src, dst = perm[:chunks * bpc].tolist(), perm[chunks * bpc:2 * chunks * bpc].tolist()
        names = [f"{c + 1:032x}" for c in range(chunks)]
        assert run(mover, 1, pointers(groups, [src]), names, True), mover.last_error
        assert stored_objects(mover, memory_tier) == chunks
        before = [t.clone() for t in kv]
        for t in kv:
            t[dst, :page] = POISON
        assert run(mover, 2, pointers(groups, [dst]), names, False), mover.last_error
        for t, old in zip(kv, before):
            assert torch.equal(t[dst, :page], old[src, :page])
            others = [r for r in range(n) if r not in dst]
            assert torch.equal(t[others], old[others])  # nothing else written
            assert bool((t[:, page:] == POISON).all())  # the rows' padding never written
        assert mover.stats["stored_chunks"] == chunks and mover.stats["loaded_chunks"] == chunks
    finally:
        mover.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_two_groups_and_a_load_from_the_middle_of_a_chunk(device, tier, memory_tier):
    """Two KV cache groups with other pages (full attention and a sliding-window group): each its own objects; a
    load that starts inside a chunk reads the object whole and moves only the blocks it was given."""
    bpc = 4
    g0 = tensors(device, 2, 32, 1024, 1024, seed=1)
    g1 = tensors(device, 1, 16, 512, 640, seed=2)
    groups = [[(t, 1024) for t in g0], [(g1[0], 512)]]
    mover = mover_for(tier, groups, bpc, memory_tier)
    try:
        assert [mover.object_bytes(0), mover.object_bytes(1)] == [2 * 1024 * bpc, 512 * bpc]
        rows0, rows1 = [3, 9, 1, 30, 7, 8, 12, 20], [5, 2, 11, 0]
        names = ["a" * 32, "b" * 32, "c" * 32]  # two chunks of group 0, one of group 1
        assert run(mover, 1, pointers(groups, [rows0, rows1]), names, True), mover.last_error
        want0 = [t[rows0[6:], :1024].clone() for t in g0]  # the load: blocks 6 and 7 of group 0's prefix
        want1 = g1[0][rows1, :512].clone()
        for t in g0:
            t[[14, 15], :] = POISON
        g1[0][[12, 13, 14, 15], :512] = POISON
        ptrs = pointers(groups, [[14, 15], [12, 13, 14, 15]], first_blocks=[6, 0])
        assert run(mover, 2, ptrs, ["b" * 32, "c" * 32], False), mover.last_error
        for t, w in zip(g0, want0):
            assert torch.equal(t[[14, 15], :1024], w)
        assert torch.equal(g1[0][[12, 13, 14, 15], :512], want1)
    finally:
        mover.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_bad_jobs_fail_and_leave_the_blocks(device, tier, memory_tier):
    page = 2048
    kv = tensors(device, 2, 16, page, page, seed=3)
    groups = [[(t, page) for t in kv]]
    mover = mover_for(tier, groups, 2, memory_tier)
    try:
        # The data references of a group disagree on the block (vLLM gives every layer the same block ids).
        p = pointers(groups, [[1, 2]])
        p.ptrs[2] = np.uint64(kv[1].data_ptr() + 5 * page)
        assert not run(mover, 1, p, ["d" * 32], True)
        assert "share block ids" in mover.last_error
        # A block twice in one job.
        assert not run(mover, 2, pointers(groups, [[4, 4]]), ["d" * 32], True)
        assert "twice" in mover.last_error
        # A load of a chunk the tier does not have: a failed job, the blocks untouched.
        before = [t.clone() for t in kv]
        assert not run(mover, 3, pointers(groups, [[6, 7]]), ["e" * 32], False)
        assert "NotFound" in mover.last_error
        assert all(torch.equal(t, b) for t, b in zip(kv, before))
        assert stored_objects(mover, memory_tier) == 0
        assert mover.stats["failed_jobs"] == 3
    finally:
        mover.shutdown()
    # After shutdown a job fails (named), nothing runs.
    assert not run(mover, 4, pointers(groups, [[1, 2]]), ["d" * 32], True)
    assert "shut down" in mover.last_error


def test_bad_tensors_are_refused_naming_them():
    with pytest.raises(kvtier.errors.NotSupportedError, match="not a \\(num_blocks, bytes\\) byte tensor"):
        ChunkMover([[(torch.zeros((4, 8, 2), dtype=torch.uint8), 8)]], object(), 1)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="page of 64 bytes in rows of 32"):
        ChunkMover([[(torch.zeros((4, 32), dtype=torch.uint8), 64)]], object(), 1)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="blocks_per_chunk 0"):
        ChunkMover([[(torch.zeros((4, 32), dtype=torch.uint8), 32)]], object(), 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [4096, 4104])
def test_pinned_tier_full_delete_and_damaged_bytes(device, page):
    """The pinned tier holds as many chunks as it has slots: one more fails the store (nothing of it kept) until a
    delete frees a slot; bytes changed in pinned memory fail the load (the chunk is dropped). With 16-byte aligned
    pages the device compares the loaded blocks' checksums with the stored ones (the failed job's blocks hold
    whatever arrived: never reported loaded); otherwise the CPU verifies the slot before anything is copied."""
    bpc = 2
    kv = tensors(device, 2, 32, page, page, seed=9)
    groups = [[(t, page) for t in kv]]
    mover = ChunkMover(groups, None, bpc, pinned_chunks=3)
    try:
        names = [f"{c + 1:032x}" for c in range(4)]
        assert run(mover, 1, pointers(groups, [[0, 1, 2, 3, 4, 5]]), names[:3], True), mover.last_error
        assert not run(mover, 2, pointers(groups, [[6, 7]]), names[3:], True)
        assert "full (3 chunks)" in mover.last_error and mover.pinned_chunks == 3
        mover.submit(3, pointers(groups, [[6, 7]]), names[3:], [names[0]], True)  # the index evicted chunk 1
        deadline = time.monotonic() + 30
        while not (done := mover.finished()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert done and done[0].success, mover.last_error
        assert mover.pinned_chunks == 3 and mover.stats["deleted_chunks"] == 1
        # Chunk 3 (blocks 4 and 5) damaged in pinned memory: one byte of its second block's first page.
        mgr = mover._groups[0].manager
        slot = mover._tier.slot_of[0][names[2]]
        addr = mgr.host_page(slot * bpc + 1) + 100
        ctypes.c_uint8.from_address(addr).value ^= 0x01
        for t in kv:
            t[[20, 21], :] = POISON
        before = [t.clone() for t in kv]
        assert not run(mover, 4, pointers(groups, [[20, 21]]), [names[2]], False)
        assert "DataLoss" in mover.last_error
        assert mover._tier.on_device[0] == (page % 16 == 0)
        if page % 16:
            assert all(torch.equal(t, b) for t, b in zip(kv, before))
        assert mover.pinned_chunks == 2  # dropped: a later load is a miss
        assert not run(mover, 5, pointers(groups, [[20, 21]]), [names[2]], False)
        assert "NotFound" in mover.last_error
        # The others load byte-exact.
        assert run(mover, 6, pointers(groups, [[20, 21, 22, 23]]), [names[1], names[3]], False), mover.last_error
        for t in kv:
            assert torch.equal(t[[20, 21, 22, 23]], t[[2, 3, 6, 7]])
    finally:
        mover.shutdown()


def test_a_tier_or_pinned_chunks_not_both():
    t = torch.zeros((4, 32), dtype=torch.uint8)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="one of them"):
        ChunkMover([[(t, 32)]], object(), 1, pinned_chunks=4)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="one of them"):
        ChunkMover([[(t, 32)]], None, 1)


def test_sizes_that_are_not_integers_are_refused_and_tiny_pages_stay_bounded(memory_tier):
    t = torch.zeros((64, 32), dtype=torch.uint8)
    # True was taken as 1 and 100.5 as 100.
    for bad in (True, 100.5 / 4, "8"):
        with pytest.raises(kvtier.errors.InvalidArgumentError, match="not an integer"):
            ChunkMover([[(t, bad)]], memory_tier, 1)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="pinned_chunks 2.5"):
        ChunkMover([[(t, 32)]], None, 1, pinned_chunks=2.5)
    with pytest.raises(kvtier.errors.InvalidArgumentError, match="staging_bytes"):
        ChunkMover([[(t, 32)]], memory_tier, 1, staging_bytes=4.0)
    # Pages of one byte behind 4 MiB of staging were 16.7 million host blocks (over 1 GiB of bookkeeping).
    from kvtier._chunk_mover import MAX_BATCH_BLOCKS

    mover = ChunkMover([[(t, 1)]], memory_tier, 1, staging_bytes=4 << 20)
    try:
        assert mover._groups[0].batch_chunks * mover.blocks_per_chunk <= MAX_BATCH_BLOCKS
        assert mover._tier.host_blocks(mover._groups[0]) <= 4 * MAX_BATCH_BLOCKS
    finally:
        mover.shutdown()
    # More pinned chunks than the machine has memory: refused before anything is allocated.
    with pytest.raises(kvtier.errors.ResourceExhaustedError, match="10000000000000 pinned chunks"):
        ChunkMover([[(t, 32)]], None, 1, pinned_chunks=10**13)


def small_mover(memory_tier, seed):
    """One group of one CPU tensor of 8 blocks of 256 bytes, chunks of one block: (groups, mover)."""
    kv = tensors("cpu", 1, 8, 256, 256, seed=seed)
    groups = [[(t, 256) for t in kv]]
    return groups, ChunkMover(groups, memory_tier, 1)


def test_a_job_id_in_flight_is_not_reused_and_negative_block_indices_fail(memory_tier):
    # A second job of the same id replaced the first: a failed load was then reported as a success.
    groups, mover = small_mover(memory_tier, seed=11)
    try:
        mover.submit(7, pointers(groups, [[5]]), ["%032x" % 999], [], False)  # not stored: this load fails
        with pytest.raises(kvtier.errors.InvalidArgumentError, match="job 7 is already submitted"):
            mover.submit(7, pointers(groups, [[6]]), ["%032x" % 1], [], False)
        deadline = time.monotonic() + 30
        while not (done := mover.finished()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [(f.job_id, f.success) for f in done] == [(7, False)]
        # Once collected, the id may be used again.
        assert run(mover, 7, pointers(groups, [[1]]), ["%032x" % 2], True), mover.last_error
        # Too few pointers for the group counts: the message named a valid pointer as "not a block".
        p = pointers(groups, [[3, 4]])
        p.ptrs, p.sizes = p.ptrs[:1], p.sizes[:1]
        assert not run(mover, 9, p, ["%032x" % 5, "%032x" % 6], True)
        assert "1 device pointers and 1 sizes, fewer than the group counts" in mover.last_error
        # A negative first block index was taken modulo the chunk's blocks.
        assert not run(mover, 8, pointers(groups, [[2]], first_blocks=[-1]), ["%032x" % 3], True)
        assert "block index -1 is negative" in mover.last_error
    finally:
        mover.shutdown()


def test_one_job_id_submitted_from_two_threads_is_accepted_once(memory_tier):
    """submit() checked the id under its lock and entered the job after planning it outside: two threads submitting
    one id were both accepted (6 to 15 times in 300), and one job's outcome was never reported."""
    groups, mover = small_mover(memory_tier, seed=13)
    try:
        for trial in range(200):
            job_id = 1000 + trial
            outcomes = []

            def submit(block, name):
                try:
                    mover.submit(job_id, pointers(groups, [[block]]), [name], [], True)
                    outcomes.append("accepted")
                except kvtier.errors.InvalidArgumentError:
                    outcomes.append("refused")

            threads = [threading.Thread(target=submit, args=(b, "%032x" % (10 * trial + b))) for b in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(outcomes) == ["accepted", "refused"], (trial, outcomes)
            deadline = time.monotonic() + 30
            while not (done := mover.finished()) and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert [f.job_id for f in done] == [job_id], (trial, done)
    finally:
        mover.shutdown()


def test_a_store_job_naming_one_chunk_twice_fails_and_leaks_no_pinned_slot():
    """The pinned tier took a slot per name and freed one when the chunk was deleted: a slot lost for good, until
    every store failed as full. Such a job now fails, as the other tiers refuse such a batch of puts."""
    kv = tensors("cpu", 1, 8, 256, 256, seed=14)
    groups = [[(t, 256) for t in kv]]
    mover = ChunkMover(groups, None, 1, pinned_chunks=2)
    try:
        assert not run(mover, 1, pointers(groups, [[1, 2]]), ["a" * 32, "a" * 32], True)
        assert "appears twice" in mover.last_error
        assert mover.pinned_chunks == 0 and len(mover._tier.free[0]) == 2
        assert run(mover, 2, pointers(groups, [[3, 4]]), ["%032x" % 1, "%032x" % 2], True), mover.last_error
        for t in kv:
            t[[6, 7]] = 0
        assert run(mover, 3, pointers(groups, [[6, 7]]), ["%032x" % 1, "%032x" % 2], False), mover.last_error
        assert all(torch.equal(t[[6, 7]], t[[3, 4]]) for t in kv)
    finally:
        mover.shutdown()


def test_a_submit_that_races_shutdown_fails_the_job_not_the_caller(memory_tier):
    # The executor refused the job with RuntimeError("cannot schedule new futures after shutdown"), raised into vLLM.
    groups, mover = small_mover(memory_tier, seed=12)
    try:
        mover._store_pool.shutdown()  # what shutdown() does first, before the worker is marked closed
        assert not run(mover, 1, pointers(groups, [[1]]), ["%032x" % 4], True)
        assert "shut down" in mover.last_error
    finally:
        mover.shutdown()
