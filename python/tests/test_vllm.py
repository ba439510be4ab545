"""kvtier.vllm: vLLM's native KV offloading (OffloadingSpec) on kvtier's tiers, byte-exact, failures as misses.

The runner (vllm_runner.py) drives the spec as vLLM's OffloadingConnector does, with vLLM's own classes, on CPU
torch tensors. The interface test compares the installed vLLM's ABCs and data classes with the ones recorded
from the pinned release (data/vllm_interface.json), and kvtier's classes with both, so that a vLLM release that
changes the interface fails here, loudly. Skipped where vLLM is not installed (scripts/test-wheel.sh installs
it: ``pip install --no-deps vllm==0.34.0`` and torch).

Regenerate the recorded interface from a newly pinned release with ``python test_vllm.py > data/vllm_interface.json``
and review the diff.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import logging
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="kvtier.vllm's tests need torch (scripts/test-wheel.sh installs it)")
pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed (pip install --no-deps vllm==0.34.0)")

import kvtier  # noqa: E402

if not kvtier._native.has_cache:
    pytest.skip("kvtier built without the storage bindings (KVTIER_PYTHON_CACHE=OFF)", allow_module_level=True)

import vllm as vllm_pkg  # noqa: E402
from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload import config as vconfig  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, Medium, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import kvtier.vllm as kv  # noqa: E402
from kvtier.errors import InvalidArgumentError, NotSupportedError  # noqa: E402
from vllm_runner import Connector, Group, KVTensors, chunk_hashes, make_config  # noqa: E402

INTERFACE = os.path.join(os.path.dirname(__file__), "data", "vllm_interface.json")

ABCS = ["OffloadingManager", "OffloadingWorker", "OffloadingSpec"]
DATACLASSES = {
    "base": ["ReqContext", "PrepareStoreOutput", "OffloadingEvent", "CanonicalKVCacheTensor", "CanonicalKVCacheRef",
             "CanonicalKVCaches", "DevicePointers", "TransferResult", "RequestOffloadingContext", "ConfigInfo"],
    "config": ["OffloadingConfig", "OffloadingGroupConfig", "OffloadingModelConfig", "OffloadingCacheConfig",
               "OffloadingParallelConfig"],
}
ENUMS = ["LookupResult", "Medium", "Locality", "OffloadPolicy"]
FUNCTIONS = ["make_offload_key", "get_offload_block_hash", "get_offload_group_idx"]
OURS = {"OffloadingManager": kv.KvtierOffloadingManager, "OffloadingWorker": kv.KvtierOffloadingWorker,
        "OffloadingSpec": kv.KvtierOffloadingSpec}


def _sig(fn) -> dict:
    sig = inspect.signature(fn)
    return {
        "params": list(sig.parameters),
        "defaults": {k: repr(p.default) for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty},
    }


def _members(cls) -> dict:
    out = {}
    for name, raw in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(raw, property):
            out[name] = {"kind": "property", "abstract": bool(getattr(raw.fget, "__isabstractmethod__", False))}
            continue
        if isinstance(raw, classmethod):
            kind, fn = "classmethod", raw.__func__
        elif isinstance(raw, staticmethod):
            kind, fn = "staticmethod", raw.__func__
        elif callable(raw):
            kind, fn = "method", raw
        else:
            continue
        out[name] = {"kind": kind, "abstract": bool(getattr(fn, "__isabstractmethod__", False)), **_sig(fn)}
    return out


def describe_installed() -> dict:
    """The offloading interface of the installed vLLM, as recorded in data/vllm_interface.json."""
    mods = {"base": vbase, "config": vconfig}
    return {
        "about": "vLLM's native KV offloading interface (vllm/v1/kv_offload/base.py and config.py), recorded from "
                 "the released package for kvtier.vllm's interface test: the ABCs' members (parameters with self "
                 "first, defaults as repr, abstract or not), the data classes' fields, the enums' members and the "
                 "key helpers. Regenerate from a newly pinned release (python test_vllm.py) and review the diff.",
        "vllm_version": vllm_pkg.__version__,
        "abcs": {name: _members(getattr(vbase, name)) for name in ABCS},
        "dataclasses": {name: [f.name for f in dataclasses.fields(getattr(mods[m], name))]
                        for m, names in DATACLASSES.items() for name in names},
        "enums": {name: [m.name for m in getattr(vbase, name)] for name in ENUMS},
        "functions": {name: _sig(getattr(vbase, name)) for name in FUNCTIONS},
        "GPULoadStoreSpec": _sig(vbase.GPULoadStoreSpec.__init__),
    }


def recorded() -> dict:
    with open(INTERFACE) as f:
        return json.load(f)


G1 = [Group(layers=3, page=512, row=640)]  # one group, 3 layers, padded rows
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def extra(path, **more):
    e = {"storage": f"disk:{path}?durability=process", "capacity": "64M"}
    e.update(more)
    return e


@pytest.fixture
def connectors():
    made = []

    def make(*args, **kw):
        c = Connector(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.shutdown()


# ------------------------------------------------------------------ the interface, pinned


def test_recorded_interface_is_the_installed_one():
    want, have = recorded(), describe_installed()
    assert have["vllm_version"] == kv.VLLM_TESTED == want["vllm_version"], (
        f"vLLM {have['vllm_version']} is installed; kvtier.vllm is pinned to {kv.VLLM_TESTED}")
    for key in ("abcs", "dataclasses", "enums", "functions", "GPULoadStoreSpec"):
        assert have[key] == want[key], f"vLLM's offloading interface changed ({key}): re-record and review"


@pytest.mark.parametrize("abc", ABCS)
def test_our_classes_implement_the_installed_abcs(abc):
    base = getattr(vbase, abc)
    ours = OURS[abc]
    assert issubclass(ours, base)
    assert not getattr(ours, "__abstractmethods__", set()), f"{ours.__name__} leaves abstract methods"
    for name, want in recorded()["abcs"][abc].items():
        if want["kind"] == "property" or name == "__init__" or name not in vars(ours):
            continue  # inherited as vLLM wrote it
        raw = vars(ours)[name]
        kind = "classmethod" if isinstance(raw, classmethod) else "staticmethod" if isinstance(
            raw, staticmethod) else "method"
        assert kind == want["kind"], f"{ours.__name__}.{name} is a {kind}, vLLM's a {want['kind']}"
        have = _sig(getattr(raw, "__func__", raw))
        assert have["params"] == want["params"], f"{ours.__name__}.{name}{have['params']} vs vLLM's {want['params']}"
        assert have["defaults"] == want["defaults"], f"{ours.__name__}.{name} defaults"
    # The spec is constructed as vLLM's factory constructs every spec: spec_cls(config).
    assert list(inspect.signature(kv.KvtierOffloadingSpec.__init__).parameters) == \
        recorded()["abcs"]["OffloadingSpec"]["__init__"]["params"]


def test_vllms_factory_loads_the_spec_by_module_path(tmp_path):
    cfg = make_config(extra(tmp_path), G1)
    assert OffloadingSpecFactory.get_spec_cls(cfg.extra_config) is kv.KvtierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, kv.KvtierOffloadingSpec) and isinstance(spec.get_manager(), vbase.OffloadingManager)
    assert spec.capacity_chunks == (64 << 20) // (4096 + 8192)  # 3 x 640-byte rows = 1920 bytes in 4 KiB + header


# ------------------------------------------------------------------ store, then load: bytes compared


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 4])
def test_store_then_load_byte_exact_into_poisoned_blocks(tmp_path, connectors, bpc, device):
    c = connectors(extra(tmp_path), G1, num_blocks=40, blocks_per_chunk=bpc, device=device)
    kvt = c.kv[0]
    req = c.request("r1", chunk_hashes(4))
    src = list(range(1, 1 + 4 * bpc))
    kvt.fill_random(0, src)
    want = {b: kvt.block(0, b) for b in src}
    assert c.lookup(req) == (0, [LookupResult.MISS])
    job = c.store(req, [0, 1, 2, 3], {0: src})
    assert c.lookup(req)[1] == [LookupResult.HIT_PENDING]  # stored but not complete: not loadable yet
    assert c.finish(job) == [True]
    assert c.lookup(req) == (4, [])
    assert c.store(req, [0, 1, 2, 3], {0: src}) == 0  # already offloaded: nothing to do
    # A new request with the same prefix loads it into other blocks, poisoned first.
    req2 = c.request("r2", chunk_hashes(4))
    dst = list(range(20, 20 + 4 * bpc))
    kvt.poison(0, dst)
    rows_before = {b: kvt.row(0, b) for b in range(40) if b not in dst}
    assert c.finish(c.load(req2, 4, {0: dst})) == [True]
    for s, d in zip(src, dst):
        assert kvt.block(0, d) == want[s]
    # Padding beyond the page and every other block are untouched.
    for d in dst:
        assert kvt.row(0, d)[-128:] == bytes([0x5A]) * 128
    assert all(kvt.row(0, b) == rows_before[b] for b in rows_before)
    stats = c.workers[0].stats
    assert stats["stored_chunks"] == 4 and stats["loaded_chunks"] == 4 and stats["failed_jobs"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_partial_first_chunk_and_sync_load(tmp_path, connectors, device):
    """A load from the middle of a chunk (the GPU holds the first blocks): the object is read whole and only its
    tail is scattered; an expedited (sync) load is complete once ``wait`` returns."""
    bpc = 4
    c = connectors(extra(tmp_path), G1, num_blocks=40, blocks_per_chunk=bpc, device=device)
    kvt = c.kv[0]
    req = c.request("r1", chunk_hashes(3))
    src = list(range(1, 13))
    kvt.fill_random(0, src)
    assert c.finish(c.store(req, [0, 1, 2], {0: src})) == [True]
    req2 = c.request("r2", chunk_hashes(3))
    dst = list(range(30, 36))  # blocks 6..11 of the prefix: chunk 1 from its slot 2, then chunk 2
    kvt.poison(0, dst)
    job = c.load(req2, 3, {0: dst}, first_block=6, sync=True)
    for i, d in enumerate(dst):  # wait() returned: the bytes are in place before get_finished
        assert kvt.block(0, d) == kvt.block(0, src[6 + i])
    assert c.finish(job) == [True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["disk", "pinned"])
def test_hybrid_groups_keep_keys_per_group(tmp_path, connectors, device, tier):
    """Two KV cache groups of different page sizes (full attention and a sliding-window group): each chunk has
    one object per group (on the pinned tier, one slot per group); a group's chunk can be stored and found
    without the other's."""
    groups = [Group(layers=2, page=256), Group(layers=1, page=1024, tokens_per_block=16)]
    e = extra(tmp_path) if tier == "disk" else {"storage": "pinned:?capacity=1M"}
    c = connectors(e, groups, num_blocks=24, device=device)
    kvt = c.kv[0]
    assert [c.workers[0].object_bytes(g) for g in (0, 1)] == [512, 1024]
    req = c.request("r", chunk_hashes(3))
    blocks = {0: [1, 2, 3], 1: [4, 5, 6]}
    kvt.fill_random(0, blocks[0])
    kvt.fill_random(1, blocks[1])
    assert c.finish(c.store(req, [0, 1, 2], blocks)) == [True]
    assert c.lookup(req) == (3, [])
    # Group 1 only (a sliding window keeps the last chunks): other keys, other objects.
    req2 = c.request("r2", chunk_hashes(3, "other"))
    kvt.fill_random(1, [7])
    assert c.finish(c.store(req2, [0], {1: [7]}, groups=[1])) == [True]
    assert c.lookup(req2, groups=[1])[0] == 1
    assert c.lookup(req2, groups=[0]) == (0, [LookupResult.MISS])
    dst = {0: [10, 11, 12], 1: [13, 14, 15]}
    kvt.poison(0, dst[0])
    kvt.poison(1, dst[1])
    req3 = c.request("r3", chunk_hashes(3))
    assert c.finish(c.load(req3, 3, dst)) == [True]
    for g in (0, 1):
        for s, d in zip(blocks[g], dst[g]):
            assert kvt.block(g, d) == kvt.block(g, s)
    # Keys differ by group for one block hash; so do the tier's objects.
    h = req.hashes[0]
    assert kv.object_key(make_offload_key(h, 0)) != kv.object_key(make_offload_key(h, 1))


@pytest.mark.parametrize("storage", ["pinned:?capacity=8K", "disk"])
def test_a_hybrid_models_index_holds_the_capacity_of_every_group(tmp_path, connectors, storage):
    """The index counted each group's chunk as one of capacity_chunks, while the tier held capacity_chunks chunks of
    every group: with two groups only half the pinned slots (and disk bytes) were ever used. Each group now has its
    own index of capacity_chunks chunks, and the tier never holds more than its capacity."""
    groups = [Group(layers=2, page=512, row=512), Group(layers=2, page=512, row=512)]  # 1 KiB per chunk and group
    e = {"storage": storage} if storage.startswith("pinned") else \
        extra(tmp_path, capacity=8 * (4096 + 8192))  # room for 8 one-block objects on disk, so 4 whole chunks
    c = connectors(e, groups, num_blocks=64)
    n = c.spec.capacity_chunks
    assert n == 4
    kvt = c.kv[0]
    kvt.fill_random(0, range(64))
    kvt.fill_random(1, range(64))
    hashes = chunk_hashes(3 * n, storage[:3])
    req = c.request("r", hashes)
    for i in range(3 * n):
        assert c.finish(c.store(req, [i], {0: [i], 1: [i]})) == [True], c.workers[0].last_error
    held = [i for i, h in enumerate(hashes) if c.lookup(c.request(f"q{i}", [h]))[0] == 1]
    assert held == list(range(2 * n, 3 * n)), held  # the last n whole chunks: both groups' halves
    w = c.workers[0]
    if w.store is None:
        assert w.pinned_chunks == 2 * n
    else:
        assert w.store.stats()["objects"] == 2 * n
        assert w.store.stats()["bytes"] <= 8 * (4096 + 8192)  # the configured capacity
    dst = {0: [60, 61, 62, 63], 1: [60, 61, 62, 63]}
    kvt.poison(0, dst[0])
    kvt.poison(1, dst[1])
    assert c.finish(c.load(c.request("back", hashes[2 * n:]), n, dst)) == [True]
    for g in (0, 1):
        for s_, d in zip(range(2 * n, 3 * n), dst[g]):
            assert kvt.block(g, d) == kvt.block(g, s_)


def test_tensor_parallel_workers_store_and_load_their_own_bytes(tmp_path, connectors):
    c = connectors(extra(tmp_path), G1, num_blocks=16, world_size=2)
    assert c.worker_specs[0].store is not c.worker_specs[1].store
    for kvt in c.kv:
        kvt.fill_random(0, [1, 2])
    assert c.kv[0].block(0, 1) != c.kv[1].block(0, 1)
    req = c.request("r", chunk_hashes(2))
    assert c.finish(c.store(req, [0, 1], {0: [1, 2]})) == [True]
    for kvt in c.kv:
        kvt.poison(0, [8, 9])
    assert c.finish(c.load(c.request("r2", chunk_hashes(2)), 2, {0: [8, 9]})) == [True]
    for kvt in c.kv:
        assert kvt.block(0, 8) == kvt.block(0, 1) and kvt.block(0, 9) == kvt.block(0, 2)
    # Each rank has its own namespace, so its own disk directory.
    dirs = sorted(os.listdir(tmp_path))
    assert len(dirs) == 2


def test_staging_smaller_than_a_job_moves_it_in_batches(tmp_path, connectors):
    c = connectors(extra(tmp_path, staging_bytes="4K"), G1, num_blocks=40, blocks_per_chunk=2)
    kvt = c.kv[0]
    req = c.request("r", chunk_hashes(8))
    src = list(range(1, 17))
    kvt.fill_random(0, src)
    assert c.finish(c.store(req, list(range(8)), {0: src})) == [True]  # 3 KiB objects: one per batch
    dst = list(range(20, 36))
    kvt.poison(0, dst)
    assert c.finish(c.load(c.request("r2", chunk_hashes(8)), 8, {0: dst})) == [True]
    assert all(kvt.block(0, d) == kvt.block(0, s) for s, d in zip(src, dst))


# ------------------------------------------------------------------ failures: misses and failed jobs, never garbage


def _object_file(root, name):
    (path,) = glob.glob(os.path.join(str(root), "**", kvtier.StorageBackend.object_name(name) + ".kvo"),
                        recursive=True)
    return path


def test_corrupt_object_fails_the_load_and_leaves_the_blocks(tmp_path, connectors, caplog):
    c = connectors(extra(tmp_path), G1, num_blocks=16)
    kvt = c.kv[0]
    req = c.request("r", chunk_hashes(3))
    kvt.fill_random(0, [1, 2, 3])
    assert c.finish(c.store(req, [0, 1, 2], {0: [1, 2, 3]})) == [True]
    want = kvt.block(0, 2)
    path = _object_file(tmp_path, kv.object_key(make_offload_key(req.hashes[1], 0)))
    with open(path, "r+b") as f:  # flip one payload byte: bit rot under the tier
        data = f.read()
        at = data.find(want[-64:])
        assert at > 0
        f.seek(at + 7)
        f.write(bytes([data[at + 7] ^ 0x01]))
    kvt.poison(0, [8, 9, 10])
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        assert c.finish(c.load(c.request("r2", chunk_hashes(3)), 3, {0: [8, 9, 10]})) == [False]
    assert "DataLoss" in c.workers[0].last_error
    assert any("load job" in r.getMessage() for r in caplog.records)
    # Nothing of the job reached the blocks: vLLM recomputes them, it never reads a torn chunk.
    assert all(kvt.row(0, b) == bytes([0x5A]) * 3 * 640 for b in (8, 9, 10))
    assert c.worker_specs[0].store.stats()["quarantined"] == 1
    # The chunk is gone from the tier: a later load of it fails the same way (until the index evicts it).
    assert c.finish(c.load(c.request("r3", chunk_hashes(3)), 3, {0: [8, 9, 10]})) == [False]
    assert "NotFound" in c.workers[0].last_error


def test_object_of_another_size_fails_the_load(tmp_path, connectors):
    """An object under the chunk's key but of another size (a model or layout change under the same namespace):
    a failed load, not a partial copy."""
    c = connectors(extra(tmp_path), G1, num_blocks=16)
    req = c.request("r", chunk_hashes(1))
    c.kv[0].fill_random(0, [1])
    assert c.finish(c.store(req, [0], {0: [1]})) == [True]
    name = kv.object_key(make_offload_key(req.hashes[0], 0))
    c.worker_specs[0].store.put(name, b"\x01" * 100)  # a shorter object under the same key
    c.kv[0].poison(0, [5])
    assert c.finish(c.load(c.request("r2", chunk_hashes(1)), 1, {0: [5]})) == [False]
    assert c.kv[0].row(0, 5) == bytes([0x5A]) * 3 * 640


def test_full_tier_fails_the_store_and_the_chunks_stay_misses(tmp_path, connectors):
    # The index has room, the tier refuses every object (full: a capacity below what the index was told is refused
    # at start, so the tier's answer is what a full filesystem gives).
    c = connectors(extra(tmp_path), G1, num_blocks=16, events=True)
    store = c.worker_specs[0].store

    class Full:
        def __getattr__(self, name):
            return getattr(store, name)

        def put_many(self, names, bufs):
            return [kvtier.errors.ResourceExhaustedError("no space left on the tier")] * len(names)

    c.workers[0].store = Full()
    req = c.request("r", chunk_hashes(2))
    c.kv[0].fill_random(0, [1, 2])
    assert c.finish(c.store(req, [0, 1], {0: [1, 2]})) == [False]
    assert "ResourceExhausted" in c.workers[0].last_error
    assert c.lookup(req) == (0, [LookupResult.MISS])  # complete_store(success=False) dropped them
    assert len(c.manager) == 0
    ev = list(c.manager.take_events())
    assert len(ev) == 1 and ev[0].removed and ev[0].metadata_only and ev[0].medium is Medium.STORAGE


def test_failed_copy_fails_the_job_and_deletes_what_it_wrote(tmp_path, connectors, monkeypatch):
    c = connectors(extra(tmp_path), G1, num_blocks=16)
    req = c.request("r", chunk_hashes(3))
    c.kv[0].fill_random(0, [1, 2, 3])
    store = c.worker_specs[0].store

    class Flaky:  # the tier takes the first object of a batch, then fails (a Redis node lost mid-batch)
        def __getattr__(self, name):
            return getattr(store, name)

        def put_many(self, names, bufs):
            res = store.put_many(names[:1], bufs[:1])
            return res + [kvtier.errors.UnavailableError("connection reset")] * (len(names) - 1)

    monkeypatch.setattr(c.workers[0], "store", Flaky())
    assert c.finish(c.store(req, [0, 1, 2], {0: [1, 2, 3]})) == [False]
    assert "connection reset" in c.workers[0].last_error
    assert c.lookup(req) == (0, [LookupResult.MISS])
    assert store.stats()["objects"] == 0  # the one object written was deleted again
    monkeypatch.setattr(c.workers[0], "store", store)
    assert c.finish(c.store(req, [0, 1, 2], {0: [1, 2, 3]})) == [True]  # vLLM offers them again: stored


def test_failed_device_copy_fails_the_job_never_reports_garbage(tmp_path, connectors):
    """The copy engine's copy fails (kvtier's host backend injects it where a GPU copy would fail): a store writes
    no object, a load is a failed job (vLLM recomputes the blocks), and the next jobs run normally."""
    c = connectors(extra(tmp_path), G1, num_blocks=16, blocks_per_chunk=2)
    kvt = c.kv[0]
    device = c.workers[0]._mover._device
    req = c.request("r", chunk_hashes(2))
    kvt.fill_random(0, [1, 2, 3, 4])
    store = c.worker_specs[0].store
    device.fail_nth_operation(1)  # the store's copy out of the KV tensors
    assert c.finish(c.store(req, [0, 1], {0: [1, 2, 3, 4]})) == [False]
    assert "injected failure" in c.workers[0].last_error
    assert store.stats()["objects"] == 0 and c.lookup(req) == (0, [LookupResult.MISS])
    assert c.finish(c.store(req, [0, 1], {0: [1, 2, 3, 4]})) == [True], c.workers[0].last_error  # offered again
    kvt.poison(0, [8, 9, 10, 11])
    device.fail_nth_operation(1)  # the load's copy into the KV tensors
    assert c.finish(c.load(c.request("r2", chunk_hashes(2)), 2, {0: [8, 9, 10, 11]})) == [False]
    assert "injected failure" in c.workers[0].last_error
    assert c.finish(c.load(c.request("r3", chunk_hashes(2)), 2, {0: [8, 9, 10, 11]})) == [True]
    assert all(kvt.block(0, d) == kvt.block(0, s) for s, d in zip([1, 2, 3, 4], [8, 9, 10, 11]))


def test_device_pointers_outside_the_kv_tensors_fail_the_job(tmp_path, connectors):
    c = connectors(extra(tmp_path), G1, num_blocks=16)
    req = c.request("r", chunk_hashes(1))
    job = c.store(req, [0], {0: [999]})  # a block id past the tensor: vLLM's pointer lands outside it
    assert c.finish(job) == [False]
    assert "not a block of its KV tensor" in c.workers[0].last_error
    assert c.lookup(req) == (0, [LookupResult.MISS])


def test_malformed_keys_job_ids_and_pointers_are_named(tmp_path, connectors):
    """lookup(5) was a miss and prepare_store([7]) planned a store of key b"\\0" * 7 (bytes(7)); a str key raised
    TypeError; a job id "x" was accepted; device pointers None raised AttributeError from submit."""
    from vllm.v1.kv_offload.base import ReqContext
    m = kv.KvtierOffloadingManager(8)
    ctx = ReqContext(req_id="r")
    for bad in (5, "abc", -1, None):
        with pytest.raises(InvalidArgumentError, match="offload key .* not bytes"):
            m.lookup(bad, ctx)
    with pytest.raises(InvalidArgumentError, match="offload key 7 is a int"):
        m.prepare_store([7], ctx)
    assert len(m) == 0
    c = connectors(extra(tmp_path), G1, num_blocks=16)
    worker = c.workers[0]
    with pytest.raises(InvalidArgumentError, match="job id 'x' is a str"):
        worker.submit_store("x", None, kv.KvtierLoadStoreSpec(["0" * 32]))
    assert worker.submit_load(77, kv.KvtierLoadStoreSpec(["0" * 32]), None)
    worker.wait({77})
    done = [r for r in worker.get_finished() if r.job_id == 77]
    assert done and not done[0].success and "have no ptrs" in worker.last_error


# The index's settings are its own: with KVTIER_CACHE_* settings meant for an engine's cache in the environment (a
# host tier, watermarks), its evictions became demotions that nothing ran or acknowledged.
@pytest.mark.parametrize("env", [{}, {"KVTIER_CACHE_HOST_BLOCKS": "64", "KVTIER_CACHE_DEVICE_WATERMARKS_LOW": "0.5",
                                      "KVTIER_CACHE_DEVICE_WATERMARKS_HIGH": "0.9"}], ids=["", "cache_env"])
def test_index_capacity_evicts_lru_deletes_objects_and_refuses_when_all_pinned(tmp_path, connectors, env,
                                                                                monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    chunk_on_disk = 4096 + 8192
    c = connectors(extra(tmp_path, capacity=3 * chunk_on_disk), G1, num_blocks=32, events=True)
    assert c.spec.capacity_chunks == 3
    store = c.worker_specs[0].store
    reqs = [c.request(f"r{i}", chunk_hashes(1, f"p{i}")) for i in range(5)]
    c.kv[0].fill_random(0, range(1, 6))
    for i in range(3):
        assert c.finish(c.store(reqs[i], [0], {0: [1 + i]})) == [True]
    c.lookup(reqs[0])  # lookups do not reorder; a load does
    assert c.finish(c.load(c.request("again", reqs[0].hashes), 1, {0: [20]})) == [True]
    # The fourth chunk evicts the least recently used one: r1's (r0's was just loaded).
    assert c.finish(c.store(reqs[3], [0], {0: [4]})) == [True]
    assert [c.lookup(r)[0] for r in reqs[:4]] == [1, 0, 1, 1]
    assert store.stats()["objects"] == 3  # the evicted chunk's object was deleted by the store job
    assert c.workers[0].stats["deleted_chunks"] == 1
    events = list(c.manager.take_events())
    assert [(e.removed, len(e.keys)) for e in events if e.removed] == [(True, 1)]
    # Loads in flight pin their chunks: with every chunk pinned there is no room, and prepare_store says None.
    pinned = [c.load(c.request(f"l{i}", r.hashes), 1, {0: [24 + i]}) for i, r in enumerate([reqs[0], reqs[2],
                                                                                             reqs[3]])]
    assert c.store(reqs[4], [0], {0: [5]}) is None
    assert c.finish(*pinned) == [True, True, True]
    assert c.finish(c.store(reqs[4], [0], {0: [5]})) == [True]


def test_job_specs_survive_pickling(tmp_path, connectors):
    """vLLM ships store and load specs to the worker processes pickled (the connector metadata)."""
    import pickle

    c = connectors(extra(tmp_path), G1, num_blocks=8)
    req = c.request("r", chunk_hashes(2))
    out = c.manager.prepare_store([make_offload_key(h, 0) for h in req.hashes], req.ctx)
    back = pickle.loads(pickle.dumps(out.store_spec))
    assert isinstance(back, kv.KvtierLoadStoreSpec) and back.names == out.store_spec.names and back.delete == []
    assert back.names == [kv.object_key(make_offload_key(h, 0)) for h in req.hashes]


def test_reset_cache_forgets_every_chunk(tmp_path, connectors):
    c = connectors(extra(tmp_path), G1, num_blocks=8)
    req = c.request("r", chunk_hashes(2))
    c.kv[0].fill_random(0, [1, 2])
    assert c.finish(c.store(req, [0, 1], {0: [1, 2]})) == [True]
    c.manager.reset_cache()
    assert c.lookup(req) == (0, [LookupResult.MISS])


def test_a_store_in_flight_at_reset_does_not_complete_the_next_store_of_its_chunk():
    """reset_cache() while a store job J1 of chunk K was in flight, then a store J2 of K: J1's complete_store took J2's
    pending entry and committed it (K a hit while J2 still wrote it), and J2's failure was then ignored: K stayed
    indexed with no object behind it, and every load of it failed."""
    from vllm.v1.kv_offload.base import ReqContext

    m = kv.KvtierOffloadingSpec(make_config({"storage": "memory:?capacity=1M", "capacity": "64K"}, G1)).get_manager()
    key = make_offload_key((7).to_bytes(16, "big"), 0)
    r1, r2 = ReqContext(req_id="r1"), ReqContext(req_id="r2")
    j1 = m.prepare_store([key], r1)
    assert len(j1.keys_to_store) == 1
    m.reset_cache()
    j2 = m.prepare_store([key], r2)
    assert len(j2.keys_to_store) == 1
    m.complete_store(j1.keys_to_store, r1, True)
    assert m.lookup(key, r1) == LookupResult.HIT_PENDING  # J2 still writes it
    m.complete_store(j2.keys_to_store, r2, False)
    assert m.lookup(key, r1) == LookupResult.MISS
    # Once J2 succeeds instead, the chunk is a hit.
    j3 = m.prepare_store([key], r2)
    m.complete_store(j3.keys_to_store, r2, True)
    assert m.lookup(key, r1) == LookupResult.HIT


def test_events_announce_stored_and_evicted_chunks(tmp_path, connectors):
    c = connectors(extra(tmp_path), G1, num_blocks=8, events=True)
    req = c.request("r", chunk_hashes(2))
    c.kv[0].fill_random(0, [1, 2])
    assert c.finish(c.store(req, [0, 1], {0: [1, 2]})) == [True]
    (ev,) = list(c.manager.take_events())
    assert not ev.removed and ev.medium is Medium.STORAGE and ev.locality is vbase.Locality.LOCAL
    assert [bytes(k) for k in ev.keys] == [bytes(make_offload_key(h, 0)) for h in req.hashes]
    assert list(c.manager.take_events()) == []


# ------------------------------------------------------------------ configuration


def test_extra_config_maps_onto_kvtier_knobs_and_names_bad_values(tmp_path, caplog):
    s = kv.parse_extra_config({"storage": "redis://h:1", "capacity": "2G", "namespace": "blue",
                               "storage.redis.workers": 4, "storage.tenant.id": "team-a",
                               "spec_name": "KvtierOffloadingSpec", "blocks_per_chunk": 4})
    assert (s.storage, s.namespace, s.capacity_bytes, s.knobs) == (
        "redis://h:1", "blue", 2 << 30, {"storage.redis.workers": "4", "storage.tenant.id": "team-a"})
    assert kv.parse_extra_config({"storage": "disk:/x?capacity=3M&durability=process"}).capacity_bytes == 3 << 20
    assert kv.parse_extra_config({"storage": "disk:/x", "storage.disk.capacity_bytes": "5K"}).capacity_bytes == 5120
    bad = [
        ({}, "must name the tier"),
        ({"storage": "s3://bucket"}, "'s3://bucket'"),
        ({"storage": "disk:/x", "capacity": "12X"}, "'12X'"),
        ({"storage": "disk:/x", "capacity": -1}, "-1"),
        # Digits other than ASCII: a superscript raised a bare ValueError, an Arabic-Indic three was read as 3 bytes.
        ({"storage": "disk:/x", "capacity": "\u00b2"}, "is not a size"),
        ({"storage": "disk:/x", "capacity": "\u0663"}, "is not a size"),
        ({"storage": "disk:/x", "storage.cache.host_blocks": 3}, "storage.cache.host_blocks"),
        ({"storage": "disk:/x", "storage.disk.qd": [1]}, "storage.disk.qd"),
        ({"storage": "disk:/x", "namespace": 3}, "namespace"),
        ({"storage": "disk:/x?capacity=abc"}, "the storage spec's ?capacity = 'abc'"),
        # More than the tier holds: the tier evicted behind the index (6 of 12 loads failed), accepted silently.
        ({"storage": "disk:/x?capacity=1G", "capacity": "2G"}, "is more than the tier holds (1073741824 bytes"),
        ({"storage": "disk:/x", "storage.disk.capacity_bytes": "1M", "capacity": "2M"}, "is more than the tier"),
        ({"storage": "memory:?capacity=1M", "capacity": "2M"}, "is more than the tier"),
    ]
    for cfg, needle in bad:
        with pytest.raises(InvalidArgumentError, match=None) as e:
            kv.parse_extra_config(cfg)
        assert needle in str(e.value), (cfg, str(e.value))
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        kv.parse_extra_config({"storage": "disk:/x", "capcity": "1G"})
    assert "capcity" in caplog.text
    # kv_load_failure_policy belongs to kv_transfer_config: vLLM never reads it here, where it was taken silently.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        kv.parse_extra_config({"storage": "disk:/x", "kv_load_failure_policy": "recompute"})
    assert "'kv_load_failure_policy' is a field of kv_transfer_config" in caplog.text
    # A capacity of more chunks than the index's 32-bit block ids named only the index's device_blocks.
    with pytest.raises(kvtier.OutOfRangeError, match="capacity .* chunks .* at most 4294967295"):
        kv.KvtierOffloadingSpec(make_config({"storage": "disk:/x?durability=process", "capacity": "999999999T"}, G1))
    # A Redis tier needs a capacity; a knob's bad value is named when the worker opens the tier.
    with pytest.raises(InvalidArgumentError, match="capacity"):
        kv.KvtierOffloadingSpec(make_config({"storage": "redis://127.0.0.1:1"}, G1))
    for knob, value in [("storage.disk.queue_depth", "deep"), ("storage.disk.durability", "process")]:
        spec = kv.KvtierOffloadingSpec(make_config(extra(tmp_path, **{knob: value}), G1))
        with pytest.raises(InvalidArgumentError, match=knob if value == "process" else value):
            spec.get_worker(None)  # the tier opens before the caches are read
    with pytest.raises(InvalidArgumentError, match="holds no chunk"):
        kv.KvtierOffloadingSpec(make_config(extra(tmp_path, capacity="4K"), G1))


def test_unsupported_layouts_are_refused_at_start(tmp_path):
    with pytest.raises(NotSupportedError, match="canonical_layout"):
        kv.KvtierOffloadingSpec(make_config(extra(tmp_path), G1, canonical=True))
    cfg = make_config(extra(tmp_path), G1)
    with pytest.raises(NotSupportedError, match="worker_kv_bytes_per_block"):
        kv.KvtierOffloadingSpec(dataclasses.replace(cfg, worker_kv_bytes_per_block=0))
    spec = kv.KvtierOffloadingSpec(cfg)
    caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(torch.zeros((4, 8, 8), dtype=torch.float16), 128)],
        group_data_refs=[[vbase.CanonicalKVCacheRef(0, 128)]])
    with pytest.raises(NotSupportedError, match="byte tensor"):
        spec.get_worker(caches)


def test_namespaces_separate_models_ranks_dp_replicas_and_engines():
    s = kv.parse_extra_config({"storage": "disk:/x", "namespace": "blue"})
    base = kv.namespace_of(make_config({}, G1), s, 0)
    assert "model=org/model-8b" in base and "rank=0/1" in base and "ns=blue" in base
    assert kv.namespace_of(make_config({}, G1, model="org/other"), s, 0) != base
    assert kv.namespace_of(make_config({}, G1, world_size=2), s, 1) != kv.namespace_of(
        make_config({}, G1, world_size=2), s, 0)
    dp = [kv.namespace_of(make_config({}, G1, dp=(i, 2)), s, 0) for i in range(2)]
    assert dp[0] != dp[1]  # two DP engines never share a disk directory
    # On a shared (Redis) tier each engine has its own key space: its index deletes what it evicts.
    r = kv.parse_extra_config({"storage": "redis://h:1", "capacity": "1G"})
    cfg = make_config({}, G1)
    assert "engine=engine-0" in kv.namespace_of(cfg, r, 0)
    assert kv.namespace_of(dataclasses.replace(cfg, engine_id="engine-1"), r, 0) != kv.namespace_of(cfg, r, 0)


# ------------------------------------------------------------------ Redis (scripts/start-test-services.sh)

REDIS = os.environ.get("KVTIER_TEST_REDIS")
REDIS_PW = os.environ.get("KVTIER_TEST_REDIS_PASSWORD", "")


def round_trip_three_chunks(c):
    """Stores three chunks of two blocks (blocks 1-6), loads them into poisoned blocks 8-13 for a request with the
    same prefix, and checks the bytes; returns the storing request."""
    kvt = c.kv[0]
    req = c.request("r", chunk_hashes(3))
    kvt.fill_random(0, range(1, 7))
    assert c.finish(c.store(req, [0, 1, 2], {0: list(range(1, 7))})) == [True]
    kvt.poison(0, range(8, 14))
    assert c.finish(c.load(c.request("r2", chunk_hashes(3)), 3, {0: list(range(8, 14))})) == [True]
    assert all(kvt.block(0, 7 + i) == kvt.block(0, i) for i in range(1, 7))
    return req


@pytest.mark.skipif(not REDIS, reason="no test Redis (KVTIER_TEST_REDIS; scripts/start-test-services.sh)")
def test_redis_tier_round_trip(connectors):
    import uuid

    prefix = f"kvtier-vllm-{uuid.uuid4().hex[:12]}"
    e = {"storage": f"redis://:{REDIS_PW}@{REDIS}?prefix={prefix}&cluster=off", "capacity": "16M",
         "storage.redis.item_deadline": "2s"}
    c = connectors(e, G1, num_blocks=16, blocks_per_chunk=2)
    req = round_trip_three_chunks(c)
    assert c.manager.get_load_source(make_offload_key(req.hashes[0], 0), req.ctx).value == "external_unspecified"
    store = c.worker_specs[0].store
    store.delete_many([kv.object_key(make_offload_key(h, 0)) for h in req.hashes])


def test_memory_tier_round_trip_and_capacity(connectors):
    """storage "memory:": the worker's own RAM as the tier (vLLM's CPU medium), byte-exact, verified, bounded."""
    probe = connectors({"storage": "memory:?capacity=64M"}, G1, num_blocks=24, blocks_per_chunk=2)
    chunk = probe.spec.chunk_bytes
    e = {"storage": f"memory:?capacity={3 * (chunk + 4096)}", "cache.device_policy": "lru"}
    c = connectors(e, G1, num_blocks=24, blocks_per_chunk=2, events=True)
    assert c.spec.capacity_chunks == 3 and c.spec.medium is Medium.CPU
    kvt = c.kv[0]
    req = round_trip_three_chunks(c)
    assert c.manager.get_load_source(make_offload_key(req.hashes[0], 0), req.ctx).value == "host"
    (stored,) = [ev for ev in c.manager.take_events() if not ev.removed]
    assert stored.medium is Medium.CPU
    store = c.worker_specs[0].store
    assert store.stats()["objects"] == 3
    # A fourth chunk evicts one; the worker deletes its object, and the memory tier's own capacity holds.
    other = c.request("o", chunk_hashes(1, "other"))
    kvt.fill_random(0, [20, 21])
    assert c.finish(c.store(other, [0], {0: [20, 21]})) == [True]
    assert store.stats()["objects"] == 3 and store.stats()["bytes"] <= 3 * (chunk + 4096)


def test_pinned_tier_round_trip_capacity_and_damage(connectors):
    """storage "pinned:": the chunks in the worker's pinned memory (vLLM's CPU medium), copied straight from and
    to the KV tensors, byte-exact; the index's capacity is the tier's; a damaged chunk is a failed load (vLLM
    recomputes), never garbage."""
    probe = connectors({"storage": "pinned:?capacity=64M"}, G1, num_blocks=24, blocks_per_chunk=2)
    chunk = probe.spec.chunk_bytes
    c = connectors({"storage": f"pinned:?capacity={3 * chunk}"}, G1, num_blocks=24, blocks_per_chunk=2,
                   events=True)
    assert c.spec.capacity_chunks == 3 and c.spec.medium is Medium.CPU
    assert c.worker_specs[0].store is None
    kvt = c.kv[0]
    req = round_trip_three_chunks(c)
    assert c.manager.get_load_source(make_offload_key(req.hashes[0], 0), req.ctx).value == "host"
    worker = c.workers[0]
    assert worker.pinned_chunks == 3
    # A fourth chunk evicts one: the worker frees its slot and the tier keeps three.
    other = c.request("o", chunk_hashes(1, "other"))
    kvt.fill_random(0, [20, 21])
    assert c.finish(c.store(other, [0], {0: [20, 21]})) == [True]
    assert worker.pinned_chunks == 3 and worker.stats["deleted_chunks"] == 1
    for bad in ("pinned:/x?capacity=1M", "pinned:?capacity=1M&evict=off"):
        with pytest.raises(kvtier.errors.InvalidArgumentError, match="pinned tier takes"):
            kv.parse_extra_config({"storage": bad})


if __name__ == "__main__":  # records the installed interface: python test_vllm.py > data/vllm_interface.json
    json.dump(describe_installed(), sys.stdout, indent=1)
    sys.stdout.write("\n")


# ------------------------------------------------------------------ the index is kvtier's CacheManager


@pytest.mark.parametrize("policy, evicted", [("lru", 0), ("lrfu", 1)])
def test_index_evicts_by_the_configured_kvtier_policy(tmp_path, connectors, policy, evicted):
    """A chunk loaded often but not lately: LRU evicts it, LRFU (recency and frequency) keeps it and evicts the
    younger chunk used once."""
    chunk_on_disk = 4096 + 8192
    c = connectors(extra(tmp_path, capacity=3 * chunk_on_disk, **{"cache.device_policy": policy}), G1, num_blocks=32)
    assert c.spec.settings.policy == policy and c.manager.policy == policy
    reqs = [c.request(f"r{i}", chunk_hashes(1, f"p{i}")) for i in range(4)]
    c.kv[0].fill_random(0, range(1, 5))
    assert c.finish(c.store(reqs[0], [0], {0: [1]})) == [True]
    for i in range(3):
        assert c.finish(c.load(c.request(f"again{i}", reqs[0].hashes), 1, {0: [20 + i]})) == [True]
    for i in (1, 2):
        assert c.finish(c.store(reqs[i], [0], {0: [1 + i]})) == [True]
    assert c.finish(c.store(reqs[3], [0], {0: [4]})) == [True]
    hits = [c.lookup(r)[0] for r in reqs]
    assert hits[evicted] == 0 and sum(hits) == 3, hits


def test_a_refused_store_evicts_nothing(tmp_path, connectors):
    chunk_on_disk = 4096 + 8192
    c = connectors(extra(tmp_path, capacity=2 * chunk_on_disk), G1, num_blocks=32)
    reqs = [c.request(f"r{i}", chunk_hashes(1, f"q{i}")) for i in range(3)]
    c.kv[0].fill_random(0, range(1, 4))
    for i in range(2):
        assert c.finish(c.store(reqs[i], [0], {0: [1 + i]})) == [True]
    pinned = [c.load(c.request(f"l{i}", reqs[i].hashes), 1, {0: [24 + i]}) for i in range(2)]
    assert c.store(reqs[2], [0], {0: [3]}) is None
    assert [c.lookup(r)[0] for r in reqs[:2]] == [1, 1] and c.manager.stats["evicted"] == 0
    assert c.finish(*pinned) == [True, True]
    assert c.finish(c.store(reqs[2], [0], {0: [3]})) == [True]
    assert sorted(c.lookup(r)[0] for r in reqs) == [0, 1, 1] and c.manager.stats["evicted"] == 1


def test_a_waiting_requests_chunks_are_evicted_last(tmp_path, connectors):
    """Look-ahead: chunks a waiting request hit (looked up, not yet scheduled) are kept when a store must evict;
    once vLLM scheduled it (on_schedule_end) they are ordinary chunks again."""
    chunk_on_disk = 4096 + 8192
    c = connectors(extra(tmp_path, capacity=3 * chunk_on_disk), G1, num_blocks=32)
    reqs = [c.request(f"r{i}", chunk_hashes(1, f"w{i}")) for i in range(4)]
    c.kv[0].fill_random(0, range(1, 5))
    for i in range(3):
        assert c.finish(c.store(reqs[i], [0], {0: [1 + i]})) == [True]
    waiting = c.request("waiting", reqs[0].hashes)  # r0's chunk: the least recently used
    assert c.lookup(waiting)[0] == 1
    assert c.manager._index.stats()["queued_requests"] == 1
    assert c.finish(c.store(reqs[3], [0], {0: [4]})) == [True]
    assert c.manager.stats["evicted"] == 1
    c.scheduled(waiting)
    assert c.manager._index.stats()["queued_requests"] == 0
    assert [c.lookup(r)[0] for r in reqs] == [1, 0, 1, 1], "r1 went, not the waiting request's r0"


def test_request_hints_come_from_vllms_kv_hints_and_bad_ones_are_ignored(tmp_path, connectors, caplog):
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope
    from vllm.v1.kv_offload.base import ReqContext

    def envelope(payload):
        return KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
            KvHintAction(action_id="a", action_type=kv.HINT_ACTION, action_version="1", payload=payload)])

    assert kv.request_hints(envelope({"conversation_id": 7, "continuation": "continues", "ttl_steps": 5,
                                      "priority": 2})) == {"conversation_id": 7, "continuation": "continues",
                                                           "ttl_steps": 5, "priority": 2}
    assert kv.request_hints(envelope({"conversation_id": "chat-1"}))["conversation_id"] == \
        kv.request_hints(envelope({"conversation_id": "chat-1"}))["conversation_id"] != 0
    assert kv.request_hints(None) == {}
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        assert kv.request_hints(envelope({"continuation": "forever"})) == {}
        assert kv.request_hints(envelope({"priority": "high"})) == {}
    assert "forever" in caplog.text and "priority" in caplog.text
    # A malformed hint is ignored alone: the valid hints of its payload and of other actions still apply (one bad
    # action threw every hint of the envelope away, the log saying only that one action's were ignored).
    two = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="good", action_type=kv.HINT_ACTION, action_version="1",
                     payload={"conversation_id": 42, "continuation": "continues"}),
        KvHintAction(action_id="bad", action_type=kv.HINT_ACTION, action_version="1",
                     payload={"priority": "high", "ttl_steps": 8})])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        assert kv.request_hints(two) == {"conversation_id": 42, "continuation": "continues", "ttl_steps": 8}
    assert "'bad'" in caplog.text and "priority 'high'" in caplog.text
    # A payload that is not a mapping raised TypeError out of on_new_request; ids past 64 bits kept only their low
    # bits (2**100 became 0, "no conversation").
    def raw(payload):
        return types.SimpleNamespace(actions=[types.SimpleNamespace(action_id="r", action_type=kv.HINT_ACTION,
                                                                    payload=payload)])

    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        for payload in (["ttl_steps"], "conversation_id", ("priority", 1), 42):
            assert kv.request_hints(raw(payload)) == {}
    assert "not a mapping" in caplog.text
    big = kv.request_hints(raw({"conversation_id": 2**100}))["conversation_id"]
    assert big != 0 and 0 <= big < 2**64
    assert kv.request_hints(raw({"conversation_id": 2**64 + 5}))["conversation_id"] != 5
    assert kv.request_hints(raw({"conversation_id": 2**64 - 1}))["conversation_id"] == 2**64 - 1
    chunk_on_disk = 4096 + 8192
    c = connectors(extra(tmp_path, capacity=2 * chunk_on_disk), G1, num_blocks=32)
    r = c.request("r", chunk_hashes(1, "h"))
    c.kv[0].fill_random(0, [1])
    assert c.finish(c.store(r, [0], {0: [1]})) == [True]
    ctx = ReqContext(req_id="hinted", kv_hints=envelope({"conversation_id": 9, "continuation": "last_turn",
                                                          "priority": 3}))
    c.manager.on_new_request(ctx)
    from vllm.v1.kv_offload.base import make_offload_key
    assert c.manager.lookup(make_offload_key(r.hashes[0], 0), ctx) is kv.LookupResult.HIT
    (qid,) = c.manager._queued["hinted"].values()
    info = c.manager._index.announcement(qid)
    assert (info["conversation_id"], info["continuation"], info["priority"]) == (9, "last_turn", 3)
    c.manager.on_request_finished(ctx)
    assert c.manager._index.stats()["queued_requests"] == 0 and "hinted" not in c.manager._hints


def test_a_hinted_retention_ends_after_its_steps():
    """A request's ttl_steps (or a conversation that continues) keeps its chunks for that many scheduler steps once
    it finished. The index counted the steps only in take_plan(), which nothing called here: the chunks stayed
    protected for good (1,000 steps after a ttl_steps of 2)."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key

    def envelope(payload):
        return types.SimpleNamespace(actions=[types.SimpleNamespace(action_id="a", action_type=kv.HINT_ACTION,
                                                                    payload=payload)])

    for payload, steps in (({"ttl_steps": 3}, 3), ({"continuation": "continues"}, None)):
        m = kv.KvtierOffloadingManager(4)
        key = make_offload_key(b"k".ljust(32, b"\0"), 0)
        c = ReqContext(req_id="store")
        out = m.prepare_store([key], c)
        m.complete_store(out.keys_to_store, c)
        hinted = ReqContext(req_id="hinted", kv_hints=envelope(payload))
        m.on_new_request(hinted)
        assert m.lookup(key, hinted) is kv.LookupResult.HIT
        m.on_schedule_end(ScheduleEndContext(new_req_ids=["hinted"], preempted_req_ids=[]))
        m.on_request_finished(hinted)
        assert m._index.stats()["retained_requests"] == 1
        ended_after = None
        for step in range(1, 2000):
            m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
            if m._index.stats()["retained_requests"] == 0:
                ended_after = step
                break
        assert ended_after is not None, payload
        # Counted from the step after the one that scheduled it (its on_schedule_end withdrew the announcement):
        # ttl_steps exactly, a conversation that continues CacheConfig::lookahead_retain_steps (512). It ended one
        # step early: the withdrawing call counted a step of the retention too.
        assert ended_after == (steps if steps is not None else 512), (payload, ended_after)


def test_a_retention_of_one_step_protects_through_the_next_step():
    """ttl_steps=N protected for N-1 steps after the request left the queue: ttl_steps=1 protected nothing, and the
    next step's stores evicted the hinted request's chunk first."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key

    def key(i):
        return make_offload_key(i.to_bytes(16, "big"), 0)

    for ttl, kept in ((0, False), (1, True), (2, True)):
        m = kv.KvtierOffloadingManager(4)

        def step(new=()):
            m.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

        def store(keys):
            c = ReqContext(req_id="w")
            out = m.prepare_store(keys, c)
            m.complete_store(out.keys_to_store, c)
            return [int.from_bytes(k[:16], "big") for k in out.evicted_keys]

        store([key(1), key(2), key(3), key(4)])
        step()
        hinted = ReqContext(req_id="r", kv_hints=types.SimpleNamespace(actions=[types.SimpleNamespace(
            action_id="a", action_type=kv.HINT_ACTION, payload={"ttl_steps": ttl})]))
        m.on_new_request(hinted)
        assert m.lookup(key(1), hinted) is kv.LookupResult.HIT  # step N: waiting, its hit chunk announced
        step(["r"])  # scheduled at the end of step N
        evicted = store([key(5), key(6), key(7)]) + store([key(8)])  # step N+1: the tier must evict all four
        assert (1 not in evicted) == kept, (ttl, evicted)


def test_an_unknown_policy_is_named(tmp_path):
    with pytest.raises(InvalidArgumentError, match="bogus"):
        kv.KvtierOffloadingManager(4, policy="bogus")
    with pytest.raises(InvalidArgumentError, match="cache.device_policy"):
        kv.parse_extra_config(extra(tmp_path, **{"cache.device_policy": 7}))


# ---- faults an adversarial pass found: space that was never given back, a wait with no deadline ----------------

G_UNPADDED = [Group(layers=2, page=512, row=512)]  # 1 KiB per chunk: capacities below count in chunks


def test_reset_cache_gives_the_pinned_tier_its_slots_back():
    """reset_cache() cleared only the scheduler's index: the worker's pinned slots stayed taken, and every later
    store failed 'the pinned tier ... is full' for good."""
    c = Connector({"storage": "pinned:?capacity=4K"}, G_UNPADDED, num_blocks=16)
    try:
        c.kv[0].fill_random(0, range(1, 9))
        assert c.finish(c.store(c.request("a", chunk_hashes(4, "a")), [0, 1, 2, 3], {0: [1, 2, 3, 4]})) == [True]
        c.manager.reset_cache()
        for i in range(3):
            r = c.request(f"b{i}", chunk_hashes(1, f"b{i}"))
            assert c.finish(c.store(r, [0], {0: [5 + i]})) == [True], c.workers[0].last_error
        assert c.workers[0].pinned_chunks == len(c.manager) == 3
    finally:
        c.shutdown()


def test_caches_larger_than_the_configured_bytes_per_block_are_refused():
    """The tier is sized from vLLM's worker_kv_bytes_per_block; caches registered with more bytes per block were
    taken, so the pinned tier pinned (and a storage tier stored) more than its capacity said."""
    spec = kv.KvtierOffloadingSpec(make_config({"storage": "pinned:?capacity=4K"}, G_UNPADDED))
    bigger = KVTensors([Group(layers=4, page=512, row=512)], num_blocks=8)  # 2 KiB per block, configured 1 KiB
    with pytest.raises(InvalidArgumentError, match="2048 bytes per block.*1024"):
        spec.get_worker(bigger.canonical())
    fits = KVTensors(G_UNPADDED, num_blocks=8)
    worker = spec.get_worker(fits.canonical())
    try:
        assert worker.object_bytes(0) == 1024 and worker.pinned_chunks == 0
    finally:
        worker.shutdown()


def test_a_failed_load_copy_keeps_every_pinned_chunk(connectors):
    """A failed copy replaced the group's transfer manager, whose host cache is the pinned tier: every pinned chunk
    was dropped while the scheduler's index still reported them, so each later load of them failed. The chunks stay;
    the failed load's rows take the engine's recomputed bytes and store again."""
    chunk = kv.KvtierOffloadingSpec(make_config({"storage": "pinned:?capacity=64M"}, G1, blocks_per_chunk=2)).chunk_bytes
    c = connectors({"storage": f"pinned:?capacity={4 * chunk}"}, G1, num_blocks=24, blocks_per_chunk=2)
    kvt, worker = c.kv[0], c.workers[0]
    req = c.request("r", chunk_hashes(3))
    kvt.fill_random(0, range(1, 7))
    assert c.finish(c.store(req, [0, 1, 2], {0: list(range(1, 7))})) == [True]
    kvt.poison(0, range(8, 14))
    worker._mover._device.fail_nth_operation(1)  # the load's copy into the KV tensors
    assert c.finish(c.load(c.request("r2", chunk_hashes(3)), 3, {0: list(range(8, 14))})) == [False]
    assert "injected failure" in worker.last_error
    assert worker.pinned_chunks == 3 and c.lookup(req)[0] == 3
    kvt.poison(0, range(8, 14))
    assert c.finish(c.load(c.request("r3", chunk_hashes(3)), 3, {0: list(range(8, 14))})) == [True], worker.last_error
    assert all(kvt.block(0, 7 + i) == kvt.block(0, i) for i in range(1, 7))
    # The rows of the failed load, rewritten by the engine, store and load like any others.
    kvt.fill_random(0, [8, 9])
    other = c.request("o", chunk_hashes(1, "other"))
    assert c.finish(c.store(other, [0], {0: [8, 9]})) == [True], worker.last_error
    kvt.poison(0, [16, 17])
    assert c.finish(c.load(c.request("o2", chunk_hashes(1, "other")), 1, {0: [16, 17]})) == [True]
    assert kvt.block(0, 16) == kvt.block(0, 8) and kvt.block(0, 17) == kvt.block(0, 9)
    assert worker.pinned_chunks == len(c.manager) == 4


@pytest.mark.parametrize("phase", ["store", "load"])
def test_any_failed_operation_of_a_pinned_job_leaves_later_jobs_working(connectors, phase):
    """The pinned tier checksums on streams of its own: a failed operation there (a stream's failure is sticky)
    failed every later store, or every later load of every pinned chunk while the index still reported them. Each
    operation of the job fails in turn; the job fails, and the jobs after it store and load byte-exact."""
    for n in range(1, 9):
        c = connectors({"storage": "pinned:?capacity=64M"}, G1, num_blocks=40, blocks_per_chunk=2)
        kvt, worker = c.kv[0], c.workers[0]
        kvt.fill_random(0, range(16))
        req = c.request("a", chunk_hashes(4))
        assert c.finish(c.store(req, [0, 1, 2, 3], {0: list(range(8))})) == [True]
        worker._mover._device.fail_nth_operation(n)
        if phase == "store":
            c.finish(c.store(c.request("b", chunk_hashes(4, "b")), [0, 1, 2, 3], {0: list(range(8, 16))}))
        else:
            kvt.poison(0, range(20, 28))
            ok = c.finish(c.load(c.request("l", chunk_hashes(4)), 4, {0: list(range(20, 28))}))
            assert not ok[0] or all(kvt.block(0, 20 + i) == kvt.block(0, i) for i in range(8)), n
        worker._mover._device.fail_nth_operation(0)  # a job of fewer operations: the injection ends with it
        for i in range(2):
            kvt.poison(0, range(30, 38))
            assert c.finish(c.load(c.request(f"l{i}", chunk_hashes(4)), 4, {0: list(range(30, 38))})) == [True], \
                (n, worker.last_error)
            assert all(kvt.block(0, 30 + j) == kvt.block(0, j) for j in range(8))
            job = c.store(c.request(f"s{i}", chunk_hashes(4, f"s{i}")), [0, 1, 2, 3], {0: list(range(8, 16))})
            assert job is None or c.finish(job) == [True], (n, worker.last_error)
        c.shutdown()


def test_the_index_is_whole_after_calls_from_several_threads():
    """The scheduler-side manager shared its dictionaries and the native index across threads without a lock:
    "dictionary changed size during iteration", and afterwards a store of `capacity` fresh chunks (nothing pinned)
    was refused while the index had silently dropped the stored chunks."""
    import random
    import threading
    from vllm.v1.kv_offload.base import ReqContext
    m = kv.KvtierOffloadingManager(64, enable_events=True)
    errors = []

    def scheduler(seed):
        rnd, ctx = random.Random(seed), ReqContext(req_id=f"r{seed}")
        try:
            for _ in range(1500):
                keys = [make_offload_key(bytes([rnd.randrange(200)]) * 32, 0) for _ in range(rnd.randrange(1, 4))]
                op = rnd.randrange(4)
                if op == 0:
                    for k in keys:
                        m.lookup(k, ctx)
                elif op == 1:
                    out = m.prepare_store(keys, ctx)
                    if out is not None and out.keys_to_store:
                        m.complete_store(out.keys_to_store, ctx, success=rnd.random() < 0.8)
                elif op == 2:
                    hits = [k for k in keys if m.lookup(k, ctx) is LookupResult.HIT]
                    if hits:
                        m.prepare_load(hits, ctx)
                        m.complete_load(hits, ctx)
                else:
                    m.take_events()
                    m.on_request_finished(ctx)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=scheduler, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    fresh = [make_offload_key(b"Z" + bytes([i]) * 31, 0) for i in range(64)]
    out = m.prepare_store(fresh, ReqContext(req_id="check"))
    assert out is not None and len(out.keys_to_store) == 64, "a store of the whole capacity, nothing pinned"
    m.complete_store(out.keys_to_store, ReqContext(req_id="check"))
    assert len(m) == 64 and all(m.lookup(k, ReqContext(req_id="c2")) is LookupResult.HIT for k in fresh)


def test_a_store_that_cannot_be_planned_still_deletes_what_the_index_evicted_for_it():
    """The deletes of the chunks the index evicted for a store rode on that store's job; a job that failed in
    planning (a block id out of range) dropped them, and the pinned tier filled with objects no index reports."""
    c = Connector({"storage": "pinned:?capacity=2K"}, G_UNPADDED, num_blocks=16)
    try:
        c.kv[0].fill_random(0, range(1, 9))
        ra, rb, rc = (c.request(n, chunk_hashes(1, n)) for n in "abc")
        assert c.finish(c.store(ra, [0], {0: [1]}), c.store(rb, [0], {0: [2]})) == [True, True]
        assert c.finish(c.store(rc, [0], {0: [999]})) == [False]
        for i in range(3):
            r = c.request(f"d{i}", chunk_hashes(1, f"d{i}"))
            assert c.finish(c.store(r, [0], {0: [3 + i]})) == [True], c.workers[0].last_error
        assert c.workers[0].pinned_chunks == len(c.manager)
    finally:
        c.shutdown()


def test_a_store_failed_on_one_rank_has_its_objects_deleted_on_the_others():
    """complete_store(success=False) dropped the chunk from the index but nobody deleted what the other ranks had
    written: a memory tier without eviction filled up and refused every store."""
    c = Connector({"storage": "memory:?capacity=64K&evict=off"}, G_UNPADDED, num_blocks=16, world_size=2)
    try:
        for k in c.kv:
            k.fill_random(0, range(1, 9))
        for i in range(30):
            c.workers[1]._mover._device.fail_nth_operation(1)
            assert c.finish(c.store(c.request(f"f{i}", chunk_hashes(1, f"f{i}")), [0], {0: [1]})) == [False]
        for i in range(3):
            r = c.request(f"d{i}", chunk_hashes(1, f"d{i}"))
            assert c.finish(c.store(r, [0], {0: [2 + i]})) == [True], [w.last_error for w in c.workers]
        assert [s.store.stats()["objects"] for s in c.worker_specs] == [len(c.manager)] * 2
    finally:
        c.shutdown()


def test_wait_and_shutdown_end_when_a_tier_stops_answering(tmp_path, monkeypatch):
    """A tier that stops answering (a hung mount) held vLLM's wait() of a sync load, and shutdown(), forever."""
    import threading

    import kvtier._chunk_mover as mover
    c = Connector({"storage": f"disk:{tmp_path}?durability=process", "capacity": "64M"}, G_UNPADDED, num_blocks=16)
    c.kv[0].fill_random(0, [1])
    assert c.finish(c.store(c.request("r", chunk_hashes(1)), [0], {0: [1]})) == [True]
    real, release = c.workers[0].store, threading.Event()

    class Stalled:
        def __getattr__(self, name):
            return getattr(real, name)

        def get_many(self, names, bufs):
            release.wait(30)
            return real.get_many(names, bufs)

    c.workers[0].store = Stalled()
    monkeypatch.setattr(mover, "JOB_TIMEOUT_S", 0.5)
    monkeypatch.setattr(mover.ChunkMover.wait, "__defaults__", (0.5,))
    monkeypatch.setattr(mover.ChunkMover.shutdown, "__defaults__", (0.5,))
    with pytest.raises(kvtier.TimedOutError, match="did not end within 0.5 s"):
        c.load(c.request("r2", chunk_hashes(1)), 1, {0: [5]}, sync=True)
    release.set()
    c.shutdown()


def test_shutdown_leaves_a_job_it_gave_up_on_its_transfer_manager(tmp_path, monkeypatch):
    """shutdown() gives up on a job stuck in a slow tier after its deadline, and closed the job's transfer manager
    anyway: the job, once the tier answered, read the freed host pages (a segfault). The manager now closes when
    the job ends."""
    import threading
    import time

    import kvtier._chunk_mover as mover
    c = Connector({"storage": f"disk:{tmp_path}?durability=process", "capacity": "64M"}, G_UNPADDED, num_blocks=16)
    worker = c.workers[0]
    real, entered, release = worker.store, threading.Event(), threading.Event()

    class Slow:
        def __getattr__(self, name):
            return getattr(real, name)

        def put_many(self, names, bufs):
            entered.set()
            release.wait(30)
            return real.put_many(names, bufs)

    worker.store = Slow()
    monkeypatch.setattr(mover.ChunkMover.shutdown, "__defaults__", (0.2,))
    c.kv[0].fill_random(0, range(1, 5))
    job = c.store(c.request("r", chunk_hashes(4)), [0, 1, 2, 3], {0: [1, 2, 3, 4]})
    assert entered.wait(10)
    c.shutdown()  # gives up on the job after 0.2 s
    release.set()  # the tier answers: the job reads its host pages and stores them
    deadline = time.monotonic() + 10
    done = []
    while not done and time.monotonic() < deadline:
        done = [r for r in worker.get_finished() if r.job_id == job]
        time.sleep(0.01)
    assert done and done[0].success, done
    with worker._mover._mgr_lock:
        assert worker._mover._retired == [], "the job's manager stays open after the job ended"


def test_a_worker_shut_down_releases_its_disk_tier(tmp_path):
    """shutdown() kept the disk tier open: a new worker of this process over the same directory was refused
    ("locked by another process") until the garbage collector freed the old spec."""
    extra = {"storage": f"disk:{tmp_path}?durability=process", "capacity": "64M"}
    c1 = Connector(extra, G_UNPADDED, num_blocks=16)
    c1.kv[0].fill_random(0, [1])
    assert c1.finish(c1.store(c1.request("r", chunk_hashes(1)), [0], {0: [1]})) == [True]
    c1.shutdown()
    c2 = Connector(extra, G_UNPADDED, num_blocks=16)  # c1 still referenced
    try:
        c2.kv[0].fill_random(0, [2])
        assert c2.finish(c2.store(c2.request("r2", chunk_hashes(1, "x")), [0], {0: [2]})) == [True]
    finally:
        c2.shutdown()


def test_an_expedited_load_does_not_queue_behind_regular_loads(tmp_path):
    """vLLM waits for an expedited (sync) load within the step; it ran after every queued regular load."""
    import time
    c = Connector({"storage": f"disk:{tmp_path}?durability=process", "capacity": "64M"}, G_UNPADDED, num_blocks=64)
    try:
        c.kv[0].fill_random(0, range(1, 9))
        assert c.finish(c.store(c.request("r", chunk_hashes(8)), list(range(8)), {0: list(range(1, 9))})) == [True]
        real = c.workers[0].store

        class Slow:  # a remote tier: 0.3 s per batch read
            def __getattr__(self, name):
                return getattr(real, name)

            def get_many(self, names, bufs):
                time.sleep(0.3)
                return real.get_many(names, bufs)

        c.workers[0].store = Slow()
        regular = [c.load(c.request(f"a{i}", chunk_hashes(8)), 1, {0: [20 + i]}) for i in range(6)]
        t0 = time.monotonic()
        c.load(c.request("sync", chunk_hashes(8)), 1, {0: [40]}, sync=True)
        assert time.monotonic() - t0 < 1.2, "the expedited load waited for the queued regular ones"
        assert c.kv[0].block(0, 40) == c.kv[0].block(0, 1)
        assert c.finish(*regular) == [True] * 6
    finally:
        c.shutdown()
