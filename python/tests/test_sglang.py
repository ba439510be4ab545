"""kvtier.sglang.HiCacheKvtier: SGLang's HiCache storage calls, byte-exact, failures as misses.

The runner (sglang_runner.py) drives the backend as SGLang's HiCacheController does. Without SGLang
installed the backend subclasses kvtier's stand-in of the ABC and the runner still runs; with it
(``pip install --no-deps sglang``), the backend subclasses the real ``HiCacheStorage``, SGLang's own
dynamic loader constructs it, and the recorded interface (data/sglang_interface.json) is compared
with the installed one.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import logging
import os
import types

import numpy as np
import pytest

import kvtier

if not kvtier._native.has_cache:
    pytest.skip("kvtier built without the storage bindings (KVTIER_PYTHON_CACHE=OFF)", allow_module_level=True)

import sglang_real  # noqa: E402

REAL_H, REAL_FACTORY, HOW = sglang_real.load()  # before kvtier.sglang, which subclasses what it finds

import kvtier.sglang as ks  # noqa: E402
from kvtier.errors import InvalidArgumentError, NotSupportedError  # noqa: E402
from sglang_runner import STORAGE_BATCH_SIZE, Controller, FlatHostPool, HostPool  # noqa: E402

INTERFACE = os.path.join(os.path.dirname(__file__), "data", "sglang_interface.json")
needs_sglang = pytest.mark.skipif(REAL_H is None, reason=HOW if REAL_H is None else "")


def interface():
    with open(INTERFACE) as f:
        return json.load(f)


def make_config(extra: dict, **fields):
    """SGLang's HiCacheStorageConfig (the real dataclass when SGLang is installed) for one rank."""
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=True, model_name="org/model-7b")
    base.update(fields)
    base["extra_config"] = extra
    if REAL_H is not None:
        names = {f.name for f in dataclasses.fields(REAL_H.HiCacheStorageConfig)}
        return REAL_H.HiCacheStorageConfig(**{k: v for k, v in base.items() if k in names})
    return types.SimpleNamespace(**base)


def disk_extra(path, **more):
    extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "HiCacheKvtier",
             "storage": f"disk:{path}?durability=process"}
    extra.update(more)
    return extra


def hashes(n, tag="h"):
    return [f"{tag}{i:062x}" for i in range(n)]


def open_backend(path, zero_copy=True, pool=None, fields=None, **more):
    extra = disk_extra(path, **more)
    if zero_copy:
        extra["interface_v1"] = 1
    b = ks.HiCacheKvtier(make_config(extra, **(fields or {})), {})
    return b


def written(pool: HostPool, pages):
    for p in pages:
        pool.fill_random(p)
    return {p: pool.page_bytes(p) for p in pages}


# ------------------------------------------------------------------ the interface


def describe_methods(cls):
    out = {}
    for name in interface()["methods"]:
        fn = getattr(cls, name)
        sig = inspect.signature(fn)
        out[name] = {
            "params": list(sig.parameters),
            "defaults": {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty},
        }
    return out


def test_backend_methods_match_recorded_interface():
    table = interface()
    ours = describe_methods(ks.HiCacheKvtier)
    for name, want in table["methods"].items():
        assert ours[name]["params"] == want["params"], name
        assert ours[name]["defaults"] == want["defaults"], name
    assert not getattr(ks.HiCacheKvtier, "__abstractmethods__", set())
    # The stand-in (used without SGLang) has the recorded methods too, the same ones abstract.
    if not ks.SGLANG_AVAILABLE:
        base = ks.HiCacheStorage
        assert sorted(n for n in table["methods"] if table["methods"][n]["abstract"]) == sorted(
            base.__abstractmethods__)
        for name, want in describe_methods(base).items():
            assert want["params"] == table["methods"][name]["params"], name
        assert [m.value for m in ks.PoolHitPolicy] == table["enums"]["PoolHitPolicy"]


@needs_sglang
def test_recorded_interface_is_the_installed_one():
    table = interface()
    H = REAL_H.HiCacheStorage
    public = sorted(n for n, f in vars(H).items() if not n.startswith("_") and callable(f))
    assert public == sorted(table["methods"]), "SGLang's HiCacheStorage methods changed: re-record the table"
    for name, want in table["methods"].items():
        sig = inspect.signature(getattr(H, name))
        assert list(sig.parameters) == want["params"], name
        assert bool(getattr(getattr(H, name), "__isabstractmethod__", False)) == want["abstract"], name
    for cls, fields in table["dataclasses"].items():
        have = [f.name for f in dataclasses.fields(getattr(REAL_H, cls))]
        assert have == fields, cls
    assert [m.value for m in REAL_H.PoolHitPolicy] == table["enums"]["PoolHitPolicy"]


@needs_sglang
def test_subclasses_installed_abc_and_loads_through_sglangs_dynamic_factory(tmp_path):
    assert ks.SGLANG_AVAILABLE and issubclass(ks.HiCacheKvtier, REAL_H.HiCacheStorage)
    pool = HostPool(pages=8)
    cfg = make_config(disk_extra(tmp_path, interface_v1=1))
    backend = REAL_FACTORY.StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, ks.HiCacheKvtier)
    ctl = Controller(backend, pool, zero_copy=True, extra_info_cls=REAL_H.HiCacheStorageExtraInfo)
    want = written(pool, range(4))
    assert ctl.backup(hashes(4), list(range(4))) == 4
    pool.clear()
    assert ctl.query(hashes(4)) == 4
    assert ctl.prefetch(hashes(4), [7, 6, 5, 4]) == 4
    for src, dst in zip(range(4), [7, 6, 5, 4]):
        assert pool.page_bytes(dst) == want[src]


# ------------------------------------------------------------------ the controller's calls, bytes checked


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1-zero-copy", "flat-pages"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_backup_query_prefetch_byte_exact(tmp_path, zero_copy, layout):
    n = STORAGE_BATCH_SIZE + 22  # two storage batches
    pool = HostPool(pages=2 * n, layout=layout, seed=3)
    backend = open_backend(tmp_path, zero_copy)
    ctl = Controller(backend, pool, zero_copy)
    keys = hashes(n)
    want = written(pool, range(n))
    assert ctl.backup(keys, list(range(n))) == n
    assert ctl.query(keys + hashes(3, "x")) == n
    assert ctl.query(hashes(3, "x") + keys) == 0
    pool.clear()
    dst = list(range(2 * n - 1, n - 1, -1))  # other host pages, reversed
    assert ctl.prefetch(keys, dst) == n
    for src, d in zip(range(n), dst):
        assert pool.page_bytes(d) == want[src]
    # A second backup of stored pages writes nothing new and still reports success.
    objects = backend.tier_stats()["objects"]
    assert ctl.backup(keys[:10], list(range(10))) == 10
    assert backend.tier_stats()["objects"] == objects


def test_single_page_calls_and_zero_copy_set(tmp_path):
    pool = HostPool(pages=4)
    backend = open_backend(tmp_path, zero_copy=False)
    backend.register_mem_pool_host(pool)
    want = written(pool, [0])
    page = pool.get_data_page(0)
    assert backend.set("k0", page) and backend.exists("k0") and not backend.exists("k1")
    out = backend.get("k0", pool.get_dummy_flat_data_page())
    assert out is not None and out.tobytes() == page.tobytes()
    assert backend.get("k1", pool.get_dummy_flat_data_page()) is None
    assert backend.get("k0") is not None  # a new flat page of the pool
    # set with an address and a size (as SGLang's zero-copy backends are called)
    buf = np.frombuffer(want[0], np.uint8).copy()
    assert backend.set("k2", None, buf.ctypes.data, buf.nbytes)
    got = np.zeros_like(buf)
    assert backend.batch_get(["k2", "k1"], [got, np.zeros_like(buf)])[1] is None
    assert got.tobytes() == want[0]
    assert backend.batch_exists(["k0", "k2", "k1", "k0"]) == 2


# ------------------------------------------------------------------ failures: a miss, never garbage


def test_missing_page_stops_prefetch_at_the_gap(tmp_path):
    pool = HostPool(pages=20)
    backend = open_backend(tmp_path)
    ctl = Controller(backend, pool, True)
    keys = hashes(8)
    want = written(pool, range(8))
    assert ctl.backup(keys[:3] + keys[4:], [0, 1, 2, 4, 5, 6, 7]) == 7  # page 3 never stored
    assert ctl.query(keys) == 3
    pool.clear()
    results = backend.batch_get_v1(keys, pool.indices(list(range(10, 18))))
    assert results == [True, True, True, False, True, True, True, True]
    for i in [0, 1, 2, 4]:
        assert pool.page_bytes(10 + i) == want[i]
    assert ctl.prefetch(keys, list(range(10, 18))) == 3


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1-zero-copy", "flat-pages"])
def test_corrupt_object_on_disk_is_a_miss(tmp_path, zero_copy):
    pool = HostPool(pages=8)
    backend = open_backend(tmp_path, zero_copy)
    ctl = Controller(backend, pool, zero_copy)
    keys = hashes(3)
    want = written(pool, range(3))
    assert ctl.backup(keys, [0, 1, 2]) == 3
    # Flip one payload byte of page 1's (last) object in its file: bit rot under the tier.
    name = backend.object_names(keys[1])[-1]
    (path,) = glob.glob(os.path.join(str(tmp_path), "**", name + ".kvo"), recursive=True)
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(want[1][-64:])  # the page's last bytes: the end of its last object's payload
        assert at > 0
        f.seek(at + 10)
        f.write(bytes([data[at + 10] ^ 0x40]))
    pool.clear(0x11)
    if zero_copy:
        assert backend.batch_get_v1(keys, pool.indices([4, 5, 6])) == [True, False, True]
    else:
        dst = [pool.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, dst)
        assert got[1] is None and got[0] is dst[0] and got[2] is dst[2]
        for j, g in zip([4, 6], [got[0], got[2]]):
            pool.set_from_flat_data_page(j * pool.page_size, g)
    assert pool.page_bytes(4) == want[0] and pool.page_bytes(6) == want[2]
    stats = backend.tier_stats()
    assert stats["quarantined"] >= 1
    assert "DataLoss" in (backend.last_error or "")
    assert ctl.query(keys) == 1  # quarantined: gone from the tier


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1-zero-copy", "flat-pages"])
def test_full_tier_refuses_writes_and_evicts_as_misses(tmp_path, zero_copy):
    pool = HostPool(pages=40, page_size=16, layers=4, heads=4, dim=16, dtype=np.uint8)  # 8 KiB pages
    backend = open_backend(tmp_path / "small", zero_copy, **{"storage.disk.capacity_bytes": "4K"})
    ctl = Controller(backend, pool, zero_copy)
    written(pool, [0])
    assert backend.tier_stats()["capacity_bytes"] == 4096
    assert ctl.backup(hashes(1), [0]) == 0
    assert ctl.query(hashes(1)) == 0
    assert "ResourceExhausted" in (backend.last_error or "")
    # A tier with room for four pages: the oldest are evicted (LRU), later pages stay exact.
    probe = open_backend(tmp_path / "probe", zero_copy)
    assert Controller(probe, pool, zero_copy).backup(hashes(1), [0]) == 1
    page_on_disk = probe.tier_stats()["bytes"]  # the page's objects with their headers
    backend2 = open_backend(tmp_path / "lru", zero_copy, **{"storage.disk.capacity_bytes": 4 * page_on_disk})
    ctl2 = Controller(backend2, pool, zero_copy)
    keys = hashes(12)
    want = written(pool, range(12))
    for i in range(12):
        assert ctl2.backup(keys[i:i + 1], [i]) == 1
    assert backend2.tier_stats()["evictions"] > 0
    assert ctl2.query(keys) == 0  # the first pages were evicted
    tail = [k for k in range(12) if ctl2.query([keys[k]]) == 1]
    assert tail and tail == list(range(tail[0], 12))
    pool.clear()
    assert ctl2.prefetch([keys[i] for i in tail], [20 + i for i in tail]) == len(tail)
    for i in tail:
        assert pool.page_bytes(20 + i) == want[i]
    assert ctl2.prefetch(keys, list(range(20, 32))) == 0


def test_a_failing_tier_logs_each_kind_of_failure_once(tmp_path, caplog):
    """Failures were logged once per message, and messages name files and keys: a tier too small for any page
    logged every backup (5,120 warnings for 2,560 backups on a full disk) and kept every message in memory."""
    pool = HostPool(pages=40, page_size=16, layers=4, heads=4, dim=16, dtype=np.uint8)
    backend = open_backend(tmp_path / "small", True, **{"storage.disk.capacity_bytes": "4K"})
    ctl = Controller(backend, pool, True)
    written(pool, range(40))
    keys = hashes(40)
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        for i in range(40):
            assert ctl.backup(keys[i:i + 1], [i]) == 0
    warnings = [r for r in caplog.records if r.name == "kvtier.sglang" and r.levelno == logging.WARNING]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert len(backend._logged) == len(warnings)
    assert "ResourceExhausted" in backend.last_error


def test_close_releases_the_tier_so_it_can_be_attached_again(tmp_path):
    """SGLang calls close() when it detaches a backend (and when an attach fails); there was none, so the old
    backend held the disk directory's lock while anything referenced it, and attaching the tier again failed."""
    pool = HostPool(pages=4, page_size=16, layers=2, heads=2, dim=16, dtype=np.uint8)
    first = open_backend(tmp_path / "t", True)
    ctl = Controller(first, pool, True)
    want = written(pool, [0])
    assert ctl.backup(hashes(1), [0]) == 1
    with pytest.raises(kvtier.FailedPreconditionError, match="locked"):
        open_backend(tmp_path / "t", True)
    first.close()
    first.close()  # idempotent
    assert Controller(first, pool, True).query(hashes(1)) == 0  # a closed backend reports misses
    again = open_backend(tmp_path / "t", True)
    pool.clear()
    assert Controller(again, pool, True).prefetch(hashes(1), [1]) == 1
    assert pool.page_bytes(1) == want[0]


def test_page_of_another_geometry_is_a_miss(tmp_path):
    pool = HostPool(pages=4, heads=2)
    backend = open_backend(tmp_path / "a")
    ctl = Controller(backend, pool, True)
    written(pool, [0])
    assert ctl.backup(hashes(1), [0]) == 1
    del backend, ctl
    bigger = HostPool(pages=4, heads=4)  # same layout and dtype, larger pages
    backend = open_backend(tmp_path / "a")
    ctl = Controller(backend, bigger, True)
    bigger.clear(0x33)
    assert ctl.prefetch(hashes(1), [1]) == 0
    # The new geometry's own backup of the page is stored and read back (it was reported stored while the old
    # object stayed, and the page never loaded).
    want = written(bigger, [0])
    assert ctl.backup(hashes(1), [0]) == 1
    bigger.clear(0x44)
    assert backend.batch_exists(hashes(1)) == 1 and ctl.prefetch(hashes(1), [1]) == 1
    assert bigger.page_bytes(1) == want[0]
    smaller = HostPool(pages=4, heads=1)
    backend2 = open_backend(tmp_path / "b")
    Controller(backend2, pool, True).backup(hashes(1), [0])
    del backend2
    backend2 = open_backend(tmp_path / "b")
    assert Controller(backend2, smaller, True).prefetch(hashes(1), [1]) == 0


def test_a_model_of_another_geometry_with_pages_of_the_same_size_misses(tmp_path):
    """A model of other heads and head size under the same served name (8 heads x 64 against 4 x 128: pages of the
    same byte size) loaded the first model's pages as hits: objects were named by pool, layout and dtype only."""
    first = HostPool(pages=4, heads=8, dim=64)
    written(first, [0, 1])
    assert Controller(open_backend(tmp_path), first, True).backup(hashes(2), [0, 1]) == 2
    other = HostPool(pages=4, heads=4, dim=128)
    assert other.page_bytes(0) is not None and len(other.page_bytes(0)) == len(first.page_bytes(0))
    backend = open_backend(tmp_path)
    ctl = Controller(backend, other, True)
    other.clear(0x55)
    assert backend.batch_exists(hashes(2)) == 0
    assert ctl.prefetch(hashes(2), [2, 3]) == 0
    assert other.page_bytes(2) == bytes([0x55]) * len(other.page_bytes(2))


def test_a_flat_page_of_another_geometry_is_written_again(tmp_path):
    """The flat path names pages by key only: a page stored by a pool of another geometry was reported present,
    never rewritten, and never loaded."""
    pool = FlatHostPool(pages=4, heads=2)
    written(pool, [0])
    assert Controller(open_backend(tmp_path, zero_copy=False), pool, False).backup(hashes(1), [0]) == 1
    bigger = FlatHostPool(pages=4, heads=4)
    backend = open_backend(tmp_path, zero_copy=False)
    ctl = Controller(backend, bigger, False)
    assert backend.batch_exists(hashes(1)) == 0
    want = written(bigger, [0])
    assert ctl.backup(hashes(1), [0]) == 1 and backend.batch_exists(hashes(1)) == 1
    bigger.clear(0x44)
    assert ctl.prefetch(hashes(1), [1]) == 1 and bigger.page_bytes(1) == want[0]


def test_a_key_repeated_in_one_backup_stores_one_whole_page(tmp_path):
    """batch_set_v1 with one key for pages of other bytes wrote every page's segments under the same names at once:
    the page read back could mix one page's K with another's V, reported loaded."""
    for trial in range(8):
        backend = open_backend(tmp_path / str(trial))
        pool = HostPool(pages=16, seed=trial)
        backend.register_mem_pool_host(pool)
        want = written(pool, [0, 1, 2])
        assert backend.batch_set_v1(["dup"] * 3, pool.indices([0, 1, 2])) == [True] * 3
        pool.clear(0x44)
        assert backend.batch_get_v1(["dup"], pool.indices([8])) == [True]
        assert pool.page_bytes(8) == want[0]  # the first page, whole


def test_address_targets_read_and_bad_ones_are_named(tmp_path):
    """get / batch_get took no (address, size) target where set does (AttributeError: 'int' object has no attribute
    'numel'), and set() without a value or a size raised AttributeError / TypeError."""
    backend = open_backend(tmp_path, zero_copy=False)
    pool = HostPool(pages=4)
    backend.register_mem_pool_host(pool)
    written(pool, [0])
    page = pool.get_data_page(0)
    assert backend.set("k", page)
    buf = np.zeros(page.nbytes, np.uint8)
    assert backend.get("k", buf.ctypes.data, page.nbytes) == (buf.ctypes.data, page.nbytes)
    assert buf.tobytes() == np.asarray(page).tobytes()
    other = np.zeros(page.nbytes, np.uint8)
    assert backend.batch_get(["k", "absent"], [(other.ctypes.data, other.nbytes), buf.ctypes.data],
                             [None, buf.nbytes])[0] is not None and other.tobytes() == buf.tobytes()
    with pytest.raises(InvalidArgumentError, match="needs a value"):
        backend.set("k3")
    with pytest.raises(InvalidArgumentError, match=r"target_sizes\[0\] = None"):
        backend.set("k3", None, buf.ctypes.data)
    with pytest.raises(InvalidArgumentError, match="not an \\(address, bytes\\) pair"):
        backend.batch_get(["k"], [(buf.ctypes.data,)])


# ------------------------------------------------------------------ v2: several pools


def test_v2_pools_exist_get_set_with_hit_policies(tmp_path):
    kv = HostPool(pages=16, seed=1)
    state = HostPool(pages=16, page_size=1, layers=1, heads=1, dim=32, seed=2)  # one state slot per page
    flat = FlatHostPool(pages=16, page_size=1, layers=1, heads=1, dim=8, seed=4)  # no buffer metadata
    backend = open_backend(tmp_path)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, ks.PoolName.KV)
    backend.register_mem_host_pool_v2(state, ks.PoolName.MAMBA)
    backend.register_mem_host_pool_v2(flat, ks.PoolName.SWA)
    keys = hashes(6)
    want_kv = written(kv, range(6))
    want_state = written(state, [4, 5])  # states only at the last two pages
    want_flat = written(flat, range(6))
    T = ks.PoolTransfer
    res = backend.batch_set_v2([
        T(name=ks.PoolName.KV, keys=keys, host_indices=kv.indices(list(range(6)))),
        T(name=ks.PoolName.MAMBA, keys=keys[4:], host_indices=state.indices([4, 5])),
        T(name=ks.PoolName.SWA, keys=keys, host_indices=flat.indices(list(range(6)))),
    ])
    assert res == {ks.PoolName.KV: [True] * 6, ks.PoolName.MAMBA: [True, True], ks.PoolName.SWA: [True] * 6}
    trailing = ks.PoolHitPolicy.TRAILING_PAGES
    r = backend.batch_exists_v2(keys, [T(name=ks.PoolName.MAMBA, keys=keys[-1:], hit_policy=trailing)])
    assert r.kv_hit_pages == 6 and r.extra_pool_hit_pages[ks.PoolName.MAMBA] == 6
    assert r.restorable_prefix_pages == [5, 6]
    r = backend.batch_exists_v2(keys, [T(name=ks.PoolName.MAMBA, keys=keys[:3], hit_policy=trailing)])
    assert r.kv_hit_pages == 0  # a window of 3 states ending at a stop point: none is complete
    r = backend.batch_exists_v2(keys + hashes(2, "x"), [T(name=ks.PoolName.SWA, keys=keys)])
    assert r.kv_hit_pages == 6 and r.extra_pool_hit_pages == {ks.PoolName.KV: 6, ks.PoolName.SWA: 6}
    r = backend.batch_exists_v2(keys, [T(name=ks.PoolName.MAMBA, keys=keys)])  # ALL_PAGES: page 0 has no state
    assert r.kv_hit_pages == 0
    for p in (kv, state, flat):
        p.clear()
    got = backend.batch_get_v2([
        T(name=ks.PoolName.KV, keys=keys, host_indices=kv.indices(list(range(10, 16)))),
        T(name=ks.PoolName.MAMBA, keys=keys[3:], host_indices=state.indices([13, 14, 15])),
        T(name=ks.PoolName.SWA, keys=keys, host_indices=flat.indices(list(range(10, 16)))),
    ])
    assert got == {ks.PoolName.KV: [True] * 6, ks.PoolName.MAMBA: [False, True, True], ks.PoolName.SWA: [True] * 6}
    for i in range(6):
        assert kv.page_bytes(10 + i) == want_kv[i] and flat.page_bytes(10 + i) == want_flat[i]
    assert state.page_bytes(14) == want_state[4] and state.page_bytes(15) == want_state[5]


# ------------------------------------------------------------------ configuration


def test_extra_config_maps_onto_kvtier_knobs(tmp_path):
    b = open_backend(tmp_path / "k", **{"storage.disk.capacity_bytes": "1M", "storage.disk.max_free_files": 8,
                                        "storage.disk.verify_payload_on_open": True})
    assert b.tier_stats()["capacity_bytes"] == 1 << 20
    with pytest.raises(InvalidArgumentError, match="storage.disk.capacity"):
        open_backend(tmp_path / "x", **{"storage.disk.capacity": "1M"})
    with pytest.raises(InvalidArgumentError, match="lots"):
        open_backend(tmp_path / "x", **{"storage.disk.capacity_bytes": "lots"})
    with pytest.raises(InvalidArgumentError, match="storage.cache.x"):
        open_backend(tmp_path / "x", **{"storage.cache.x": "1"})
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        open_backend(tmp_path / "x", **{"storage.disk.queue_depth": [1]})
    with pytest.raises(InvalidArgumentError, match="must name the tier"):
        ks.HiCacheKvtier(make_config({"backend_name": "kvtier"}), {})
    with pytest.raises(InvalidArgumentError, match="s3://bucket"):
        ks.HiCacheKvtier(make_config({"storage": "s3://bucket"}), {})
    spec, ns, knobs, zc = ks.parse_extra_config({"storage": "redis://h:1", "namespace": "blue", "interface_v1": "1",
                                                 "storage.redis.workers": 4, "backend_name": "kvtier"})
    assert (spec, ns, knobs, zc) == ("redis://h:1", "blue", {"storage.redis.workers": "4"}, True)


def test_spec_parameters_win_over_knobs(tmp_path):
    extra = disk_extra(tmp_path)
    extra["storage"] += "&capacity=2M"
    extra["storage.disk.capacity_bytes"] = "1M"
    b = ks.HiCacheKvtier(make_config(extra), {})
    assert b.tier_stats()["capacity_bytes"] == 2 << 20


def test_tenant_secret_pages_of_another_secret_are_misses(tmp_path):
    pool = HostPool(pages=4)
    want = written(pool, [0])
    secrets = []
    for i, hexkey in enumerate(["11" * 32, "22" * 32]):
        f = tmp_path / f"secret{i}"
        f.write_text(hexkey + "\n")
        f.chmod(0o600)
        secrets.append(str(f))
    tenant = {"storage.tenant.id": "team-a"}
    a = open_backend(tmp_path / "t", **tenant, **{"storage.tenant.secret_file": secrets[0]})
    assert Controller(a, pool, True).backup(hashes(1), [0]) == 1
    del a
    b = open_backend(tmp_path / "t", **tenant, **{"storage.tenant.secret_file": secrets[1]})
    ctl = Controller(b, pool, True)
    pool.clear()
    assert ctl.query(hashes(1)) == 0 and ctl.prefetch(hashes(1), [1]) == 0
    assert pool.page_bytes(1) == bytes([0xEE]) * len(want[0])
    assert b.tier_stats()["auth_failures"] >= 1  # the other secret's objects: quarantined, never served
    del b, ctl
    a = open_backend(tmp_path / "t2", **tenant, **{"storage.tenant.secret_file": secrets[0]})
    ctl = Controller(a, pool, True)
    written(pool, [0])
    want = pool.page_bytes(0)
    assert ctl.backup(hashes(1), [0]) == 1 and ctl.prefetch(hashes(1), [2]) == 1 and pool.page_bytes(2) == want
    with pytest.raises(kvtier.errors.NotFoundError, match="absent"):
        open_backend(tmp_path / "t3", **{"storage.tenant.secret_file": str(tmp_path / "absent")})


def test_ranks_and_tenants_get_their_own_namespaces(tmp_path):
    pool = HostPool(pages=4)
    written(pool, [0])
    r0 = open_backend(tmp_path, fields=dict(tp_rank=0, tp_size=2))
    r1 = open_backend(tmp_path, fields=dict(tp_rank=1, tp_size=2))  # same root: its own directory
    assert Controller(r0, pool, True).backup(hashes(1), [0]) == 1
    assert Controller(r1, pool, True).query(hashes(1)) == 0
    a = open_backend(tmp_path, fields=dict(tp_rank=0, tp_size=2), namespace="a", **{"storage.tenant.id": "alice"})
    assert Controller(a, pool, True).query(hashes(1)) == 0  # tenant alice: another key space
    assert Controller(a, pool, True).backup(hashes(1), [0]) == 1
    assert "tp=0/2" in r0.namespace and "ns=a" in a.namespace
    with pytest.raises(InvalidArgumentError, match="bad tenant"):
        open_backend(tmp_path, **{"storage.tenant.id": "bad tenant"})
    with pytest.raises(NotSupportedError, match="MLA"):
        open_backend(tmp_path, fields=dict(is_mla_model=True, tp_size=2))
    mla = open_backend(tmp_path / "mla", fields=dict(is_mla_model=True, tp_size=1))
    assert "tp=" not in mla.namespace


# ------------------------------------------------------------------ Redis (scripts/start-test-services.sh)

REDIS = os.environ.get("KVTIER_TEST_REDIS")
REDIS_PW = os.environ.get("KVTIER_TEST_REDIS_PASSWORD", "")


@pytest.mark.skipif(not REDIS, reason="no test Redis (KVTIER_TEST_REDIS; scripts/start-test-services.sh)")
def test_redis_tier_byte_exact_and_corrupt_value_is_a_miss(tmp_path):
    import shutil
    import subprocess
    import uuid

    prefix = f"kvtier-sgl-{uuid.uuid4().hex[:12]}"
    extra = {"storage": f"redis://:{REDIS_PW}@{REDIS}?prefix={prefix}&cluster=off", "interface_v1": 1,
             "storage.redis.item_deadline": "2s"}
    backend = ks.HiCacheKvtier(make_config(extra), {})
    pool = HostPool(pages=16, seed=9)
    ctl = Controller(backend, pool, True)
    keys = hashes(6)
    want = written(pool, range(6))
    assert ctl.backup(keys, list(range(6))) == 6
    assert ctl.query(keys + hashes(1, "x")) == 6
    pool.clear()
    assert ctl.prefetch(keys, list(range(10, 16))) == 6
    assert all(pool.page_bytes(10 + i) == want[i] for i in range(6))
    if shutil.which("redis-cli") is None:
        return
    host, port = REDIS.rsplit(":", 1)
    cli = ["redis-cli", "-h", host, "-p", port, "--no-auth-warning"] + (["-a", REDIS_PW] if REDIS_PW else [])
    name = backend.object_names(keys[2])[0]
    (rkey,) = subprocess.run(cli + ["--scan", "--pattern", f"{prefix}:*{name}"], capture_output=True, text=True,
                             check=True).stdout.split()
    size = int(subprocess.run(cli + ["strlen", rkey], capture_output=True, text=True, check=True).stdout)
    byte = subprocess.run(cli + ["getrange", rkey, str(size - 10), str(size - 10)], capture_output=True,
                          check=True).stdout[:1]
    subprocess.run(cli + ["setrange", rkey, str(size - 10), "A" if byte != b"A" else "B"], capture_output=True,
                   check=True)
    pool.clear()
    assert backend.batch_get_v1(keys, pool.indices(list(range(10, 16)))) == [True, True, False, True, True, True]
    assert ctl.query(keys) == 2  # the corrupt value was deleted (quarantine = removal on Redis)
    for k in subprocess.run(cli + ["--scan", "--pattern", f"{prefix}:*"], capture_output=True, text=True,
                            check=True).stdout.split():
        subprocess.run(cli + ["del", k], capture_output=True, check=True)


def test_memory_tier_byte_exact_and_an_mla_model_across_ranks_is_refused():
    """storage "memory:": the rank's own RAM; byte-exact through SGLang's calls. An MLA model at TP > 1 reads on every
    rank what one rank wrote, which a process's own tier cannot serve: refused, naming the tier."""
    extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "HiCacheKvtier",
             "storage": "memory:?capacity=64M", "interface_v1": 1}
    backend = ks.HiCacheKvtier(make_config(extra), {})
    pool = HostPool(pages=16, layout="page_first", seed=5)
    ctl = Controller(backend, pool, True)
    keys = hashes(8, "m")
    want = written(pool, range(8))
    assert ctl.backup(keys, list(range(8))) == 8
    pool.clear()
    assert ctl.prefetch(keys, list(range(8, 16))) == 8
    assert all(pool.page_bytes(8 + i) == want[i] for i in range(8))
    assert backend.tier_stats()["objects"] == sum(len(backend.object_names(k)) for k in keys)
    with pytest.raises(NotSupportedError, match="memory"):
        ks.HiCacheKvtier(make_config(extra, is_mla_model=True, tp_size=2), {})


def test_a_rank_outside_its_group_is_refused():
    # tp_rank 5 of 2 was accepted and keyed its pages under a shard namespace no real rank has.
    from kvtier.sglang import namespace_of
    cfg = types.SimpleNamespace(tp_rank=5, tp_size=2, pp_rank=0, pp_size=1, model_name="m", is_mla_model=False)
    with pytest.raises(kvtier.InvalidArgumentError, match="tp_rank 5 with tp_size 2"):
        namespace_of(cfg, "", disk=True)
    cfg.tp_rank = 1
    assert "tp=1/2" in namespace_of(cfg, "", disk=True)
    # A NumPy integer skipped the check (isinstance int) and keyed tp=5/2; other types are named.
    cfg.tp_rank = np.int64(5)
    with pytest.raises(kvtier.InvalidArgumentError, match="tp_rank 5 with tp_size 2"):
        namespace_of(cfg, "", disk=True)
    cfg.tp_rank = np.int64(1)
    assert "tp=1/2" in namespace_of(cfg, "", disk=True)
    cfg.tp_rank = "1"
    with pytest.raises(kvtier.InvalidArgumentError, match="tp_rank '1' is not an integer"):
        namespace_of(cfg, "", disk=True)


def test_host_indices_outside_the_pool_and_mismatched_lists_are_refused(tmp_path):
    # The pool turns host indices into raw addresses: indices past its end crashed the process (kvtier read or wrote
    # there), negative ones stored bytes from before it.
    pool = HostPool(pages=8)
    backend = open_backend(tmp_path)
    backend.register_mem_pool_host(pool)
    want = written(pool, [1])
    # Each page's first index is what the pool turns into the address of the whole page: a page that starts inside
    # the pool but runs past its end (every index in range: 30, 31, 31, 31 of 32 slots) wrote past the pool, and a
    # page whose indices do not follow its first read or wrote slots other than the ones named.
    ps = pool.page_size
    for bad, named in ((np.arange(10**6, 10**6 + ps), 10**6), (np.arange(-ps, 0), -ps),
                       (np.arange(pool.size - 2, pool.size + ps - 2), pool.size - 2),
                       (np.array([pool.size - 2] + [pool.size - 1] * (ps - 1)), pool.size - 2)):
        with pytest.raises(InvalidArgumentError,
                           match=rf"page at host index {named} \(page size {ps}\) is outside the host pool of {pool.size}"):
            backend.batch_set_v1(["k"], bad)
        with pytest.raises(InvalidArgumentError, match=f"page at host index {named} "):
            backend.batch_get_v1(["k"], bad)
    # A pool whose size is a numpy integer (or any integer type but int) was not checked at all: a load wrote past
    # its end and returned True. Its size is a size; one that is no integer is named.
    plain_size = pool.size
    pool.size = np.int64(plain_size)
    far = np.arange(10**6, 10**6 + ps)
    with pytest.raises(InvalidArgumentError, match=rf"page at host index {10**6} .* outside the host pool of {plain_size}"):
        backend.batch_get_v1(["k"], far)
    pool.size = "32"
    with pytest.raises(InvalidArgumentError, match=r"the host pool's size '32' \(str\) is not a slot count"):
        backend.batch_get_v1(["k"], pool.indices([1]))
    pool.size = plain_size
    gap = np.concatenate([np.arange(0, 2), np.arange(5, 5 + ps - 2)])
    with pytest.raises(InvalidArgumentError, match="host index 5 at position 2 does not continue its page"):
        backend.batch_get_v1(["k"], gap)
    assert backend.batch_exists(["k"]) == 0  # nothing was stored
    assert backend.batch_set_v1(["k"], pool.indices([1])) == [True]
    pool.clear()
    assert backend.batch_get_v1(["k"], pool.indices([1])) == [True]
    assert pool.page_bytes(1) == want[1]
    # batch_get returned as many results as targets, whatever the keys; batch_set ignored extra locations.
    flat = open_backend(tmp_path / "flat", zero_copy=False)
    flat.register_mem_pool_host(pool)
    page = pool.get_data_page(1)
    assert flat.batch_set(["a"], [page])
    with pytest.raises(InvalidArgumentError, match="3 keys but 1 target locations"):
        flat.batch_get(["a", "b", "c"], [pool.get_dummy_flat_data_page()])
    buf = np.zeros(64, np.uint8)
    with pytest.raises(InvalidArgumentError, match="2 target locations but 1 target sizes"):
        flat.batch_set(["x"], None, [buf.ctypes.data, buf.ctypes.data], [64])


def test_malformed_batches_raise_naming_what_is_wrong(tmp_path):
    """bytes values, numbers as targets, None as host indices raised AttributeError / TypeError; a string as the
    keys was taken as one key per character; a non-contiguous array was logged and reported as a miss."""
    pool = HostPool(pages=4)
    backend = open_backend(tmp_path)
    backend.register_mem_pool_host(pool)
    flat = open_backend(tmp_path / "flat", zero_copy=False)
    flat.register_mem_pool_host(pool)
    with pytest.raises(InvalidArgumentError, match="keys 'abc' is not a list of keys"):
        backend.batch_exists("abc")
    with pytest.raises(InvalidArgumentError, match="key 1 at index 1 is a int"):
        backend.batch_exists(["a", 1])
    with pytest.raises(InvalidArgumentError, match="host indices None"):
        backend.batch_set_v1(["a"], None)
    with pytest.raises(InvalidArgumentError, match="a page of type float"):
        flat.batch_set(["x"], [1.5])
    assert flat.batch_set(["b"], [b"hello"])  # bytes are a buffer: stored as they are
    buf = bytearray(5)
    assert flat.batch_get(["b"], [buf]) == [buf] and bytes(buf) == b"hello"
    strided = np.zeros((8, 2), np.uint8)[:, 0]
    with pytest.raises(InvalidArgumentError):
        flat.batch_set(["c"], [strided])
    # No keys with host indices, values or targets: a mismatch like any other (returned [] / True as if nothing had
    # been asked); indices of two dimensions were counted as one; a lone surrogate key raised UnicodeEncodeError.
    ps = pool.page_size
    with pytest.raises(InvalidArgumentError, match=f"0 keys but {ps} host indices"):
        backend.batch_get_v1([], pool.indices([1]))
    with pytest.raises(InvalidArgumentError, match="0 keys but 1 values"):
        flat.batch_set([], [bytearray(4)])
    with pytest.raises(InvalidArgumentError, match="0 keys but 2 target locations"):
        flat.batch_get([], [bytearray(4), bytearray(4)])
    assert backend.batch_get_v1([], pool.indices([])) == [] and flat.batch_set([], []) is True
    with pytest.raises(InvalidArgumentError, match=r"host indices of shape \(1, "):
        backend.batch_set_v1(["k"], np.arange(ps).reshape(1, ps))
    for call in (lambda: backend.batch_exists(["\ud800"]), lambda: flat.batch_set(["\ud800"], [b"x"])):
        with pytest.raises(InvalidArgumentError, match="lone surrogate"):
            call()


def test_get_without_a_pool_or_targets_names_what_is_missing(tmp_path):
    # It raised AttributeError: 'HiCacheKvtier' object has no attribute 'mem_pool_host'.
    backend = open_backend(tmp_path, zero_copy=False)
    with pytest.raises(InvalidArgumentError, match="no host pool registered"):
        backend.get("k0")
