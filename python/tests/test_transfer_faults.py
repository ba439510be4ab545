"""kvtier.TransferManager, HybridCache and the CLI under misuse: a tensor the layout does not use, close() from a
callback, integers nanobind would refuse without naming them, a report stdout cannot take. Each failed before its
fix (a segfault, std::terminate, unnamed TypeErrors, exit status 0)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvtier

LAYERS, BLOCKS, HOST_BLOCKS, BLOCK_BYTES = 2, 8, 8, 512


def arrays(n, fill=None, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(LAYERS):
        for role in ("key_caches", "value_caches"):
            a = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
            a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8) if fill is None else fill
            out[f"{role}_{layer}_rank0.device0"] = a
    return out


def manager(extra=None, num_host_blocks=HOST_BLOCKS):
    dev = kvtier.host_device()
    compute = dev.create_stream("compute")
    d, h = arrays(BLOCKS, seed=1), arrays(HOST_BLOCKS, fill=0xEE)
    d.update(extra or {})
    mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()},
                                              num_host_blocks, LAYERS)
    return mgr, d, h


@pytest.mark.parametrize("name", ["extra", "key_caches_0_rank1.device0"])
def test_a_zero_d_tensor_the_layout_does_not_use_is_harmless(name):
    """A 0-d tensor under a name the layout skips (not a KV name, another rank's) crashed from_tensors: its extent
    was computed from a shape[0] it does not have."""
    mgr, d, h = manager(extra={name: np.array(5, dtype=np.uint8)})
    mgr.wait(mgr.evict([3], [1]), 10.0)
    for k in h:
        assert np.array_equal(h[k][1], d[k][3])
    mgr.close()


def test_close_from_a_callback_raises_and_the_manager_still_works():
    """close() inside on_done dropped the manager's last reference on its own progress thread: std::terminate."""
    mgr, d, h = manager()
    seen = []

    def on_done(task, error):
        try:
            mgr.close()
            seen.append("closed")
        except kvtier.FailedPreconditionError as e:
            seen.append(str(e))

    mgr.wait(mgr.evict([0], [0], on_done=on_done), 10.0)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and "callback" in seen[0], seen
    mgr.wait(mgr.evict([1], [1]), 10.0)
    assert np.array_equal(h["key_caches_1_rank0.device0"][1], d["key_caches_1_rank0.device0"][1])
    mgr.close()


def test_integers_nanobind_would_refuse_are_named():
    mgr, d, h = manager()
    with pytest.raises(kvtier.OutOfRangeError, match=r"device block id\[0\] 9223372036854775808"):
        mgr.evict([2**63], [0])
    with pytest.raises(kvtier.InvalidArgumentError, match=r"host block id\[1\] 1.5 is not an integer"):
        mgr.evict([0, 1], [0, 1.5])
    with pytest.raises(kvtier.InvalidArgumentError, match="is not a sequence of integers"):
        mgr.evict(3, [0])
    with pytest.raises(kvtier.OutOfRangeError, match=r"layer\[0\] -1"):
        mgr.load([-1], [0], [0])
    with pytest.raises(kvtier.OutOfRangeError, match="task -1"):
        mgr.wait(-1)
    with pytest.raises(kvtier.OutOfRangeError, match="layer -1"):
        mgr.wait_layer_host(1, -1)
    mgr.wait(mgr.evict(np.array([2, 3]), (4, 5)), 10.0)  # numpy arrays and tuples still work
    assert np.array_equal(h["value_caches_0_rank0.device0"][5], d["value_caches_0_rank0.device0"][3])
    mgr.close()
    # A host cache kvtier allocates (no host pointers): the size wrapped to "0 bytes".
    dev = kvtier.host_device()
    with pytest.raises(kvtier.InvalidArgumentError, match="1152921504606846976 blocks"):
        kvtier.TransferManager.from_tensors(dev, dev.create_stream("c"), arrays(BLOCKS), None, 2**60, LAYERS)


def test_cache_manager_ack_integers_and_odd_metric_labels_are_named():
    """CacheManager.ack refused 2**63, 1.5 and "01" with nanobind's unnamed TypeError; a metric label that is not
    valid UTF-8 (a lone surrogate) raised RuntimeError('std::bad_cast')."""
    cm = kvtier.CacheManager(device_blocks=8)
    with pytest.raises(kvtier.OutOfRangeError, match=r"dst_blocks\[0\] 9223372036854775808"):
        cm.ack("loads", [2**63])
    with pytest.raises(kvtier.InvalidArgumentError, match=r"dst_blocks\[1\] 1.5 is not an integer"):
        cm.ack("loads", [0, 1.5])
    with pytest.raises(kvtier.InvalidArgumentError, match="dst_blocks"):
        cm.ack("loads", "01")
    mgr, d, h = manager()
    for labels, named in [({"odd": "\ud800"}, "'odd' value"), ({"\ud800": "x"}, "name")]:
        with pytest.raises(kvtier.InvalidArgumentError, match=f"metric label {named}: not valid UTF-8"):
            mgr.attach_metrics(labels)
        with pytest.raises(kvtier.InvalidArgumentError, match=f"metric label {named}: not valid UTF-8"):
            cm.attach_metrics(labels)
    mgr.close()


def test_arguments_found_wrong_only_later_are_refused_at_the_call():
    """Wrong arguments taken without a word: a callback that cannot be called was taken and failed only as a
    logged callback error later; ack of 'storage_drops' took any dst_blocks; a metric label of another type than str
    was refused without naming it; piece_checksums of a range that wraps around the address space returned the empty
    buffer's checksum (its piece count wrapped to 0); open_device(ordinal=-1) gave a host device without a word."""
    mgr, d, h = manager()
    with pytest.raises(kvtier.InvalidArgumentError, match="on_layer is a int, not a callable"):
        mgr.load([], [0], [0], on_layer=5)
    with pytest.raises(kvtier.InvalidArgumentError, match="on_done is a str, not a callable"):
        mgr.load([], [0], [0], on_done="x")
    with pytest.raises(kvtier.InvalidArgumentError, match="on_done is a str, not a callable"):
        mgr.evict([0], [0], on_done="x")
    # A stream of another host device: both are named 'host-sim', so the message tells them apart by address.
    other = kvtier.host_device().create_stream("elsewhere")
    with pytest.raises(kvtier.InvalidArgumentError, match=r"another device \('host-sim' at 0x[0-9a-f]+\) than"):
        mgr.device_checksums([0], other, 10.0)
    mgr.wait(mgr.evict([0], [1], on_done=lambda task, err: None), 10.0)  # callables and None still work
    assert np.array_equal(h["key_caches_0_rank0.device0"][1], d["key_caches_0_rank0.device0"][0])
    with pytest.raises(kvtier.InvalidArgumentError, match=r"a key is a int \(1\)"):
        mgr.attach_metrics({1: "x"})
    with pytest.raises(kvtier.InvalidArgumentError, match=r"label 'a' is a NoneType \(None\)"):
        mgr.attach_metrics({"a": None})
    mgr.close()
    cm = kvtier.CacheManager(device_blocks=8)
    with pytest.raises(kvtier.InvalidArgumentError, match="dst_blocks"):
        cm.ack("storage_drops", "garbage")
    cm.ack("storage_drops", [None, None])  # a plan's drop list (None for each destination) is still taken and ignored
    hc = kvtier.HybridCache([dict(name="full", kind="full", block_tokens=16, device_blocks=8)])
    with pytest.raises(kvtier.InvalidArgumentError, match="dst_blocks"):
        hc.ack(0, "storage_drops", "garbage")
    a = np.arange(16, dtype=np.uint8)
    with pytest.raises(kvtier.InvalidArgumentError, match="buffer 1 .* wraps around"):
        kvtier._native.piece_checksums([(a.ctypes.data, 16), (a.ctypes.data, 2**64 - 5)])
    assert kvtier._native.piece_checksums([(a.ctypes.data, 16)]) != kvtier._native.piece_checksums([(a.ctypes.data, 0)])
    for bad in (-1, 1.5, "0", True):
        with pytest.raises(kvtier.InvalidArgumentError, match="ordinal"):
            kvtier.open_device(ordinal=bad)
    with pytest.raises(kvtier.InvalidArgumentError, match="prefer_cuda 'x'"):
        kvtier.open_device("x")
    assert kvtier.open_device(False, np.int64(0)).backend == "host"


def test_hybrid_cache_integers_are_named():
    hc = kvtier.HybridCache([dict(name="full", kind="full", block_tokens=16, device_blocks=8)])
    with pytest.raises(kvtier.OutOfRangeError, match="group -1"):
        hc.ack(-1, "loads", [0])
    with pytest.raises(kvtier.OutOfRangeError, match=r"dst_blocks\[0\] -2"):
        hc.ack(0, "loads", [-2])
    with pytest.raises(kvtier.OutOfRangeError, match=r"save_states_at\[0\] -1"):
        hc.admit(32, [["%032x" % 1, "%032x" % 2]], save_states_at=[-1])


def test_the_cli_fails_when_its_report_cannot_be_written():
    """`kvtier info > /dev/full` exited 0: the report was lost and nobody was told."""
    exe = os.path.join(os.path.dirname(kvtier.__file__), "bin", "kvtier")
    if not os.path.exists("/dev/full") or not os.access(exe, os.X_OK):
        pytest.skip("no /dev/full or no kvtier executable in the package")
    with open("/dev/full", "w") as full:
        r = subprocess.run([exe, "info"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode != 0 and "stdout" in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout


def test_objects_that_are_not_a_device_or_a_stream_are_named():
    """from_tensors(stream, stream, ...) raised RuntimeError('std::bad_cast')."""
    dev = kvtier.host_device()
    s = dev.create_stream("c")
    with pytest.raises(kvtier.InvalidArgumentError, match="device is a .*not a kvtier device"):
        kvtier.TransferManager.from_tensors(s, s, arrays(BLOCKS), None, HOST_BLOCKS, LAYERS)
    with pytest.raises(kvtier.InvalidArgumentError, match="compute_stream is a .*not a kvtier stream"):
        kvtier.TransferManager.from_tensors(dev, dev, arrays(BLOCKS), None, HOST_BLOCKS, LAYERS)


def test_a_page_manager_takes_over_another_ones_host_cache():
    """from_pages(host_of=...): a manager that replaces one whose copy failed (its streams poisoned) keeps the host
    cache's bytes (the vLLM connector's pinned tier lost every chunk with the old manager)."""
    dev = kvtier.host_device()
    compute = dev.create_stream("compute")
    rng = np.random.default_rng(3)
    tensors = [rng.integers(0, 256, (BLOCKS, 640), dtype=np.uint8) for _ in range(LAYERS)]
    old = kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, num_host_blocks=HOST_BLOCKS)
    old.wait(old.evict([2, 5], [0, 3]), 10.0)
    dev.fail_nth_operation(1)
    with pytest.raises(kvtier.KvtierError, match="injected failure"):
        old.wait(old.evict([1], [6]), 10.0)
    new = kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, num_host_blocks=HOST_BLOCKS,
                                            host_of=old)
    old.close()  # the host cache lives on with the new manager
    for t in tensors:
        t[6:8] = 0x5A
    new.wait(new.load([], [0, 3], [6, 7]), 10.0)
    for t in tensors:
        assert np.array_equal(t[6, :512], t[2, :512]) and np.array_equal(t[7, :512], t[5, :512])
    with pytest.raises(kvtier.InvalidArgumentError, match="host_of is a str"):
        kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, HOST_BLOCKS, host_of="old")
    with pytest.raises(kvtier.InvalidArgumentError, match="another layout"):
        kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, HOST_BLOCKS + 1, host_of=new)
    with pytest.raises(kvtier.InvalidArgumentError, match="another layout"):
        kvtier.TransferManager.from_pages(dev, compute, tensors, [256] * LAYERS, HOST_BLOCKS, host_of=new)
    new.close()


def test_close_gives_the_engines_memory_back():
    """close() promised to release the engine memory, but the manager's tensors, adopted device memory and host
    cache stayed until Python dropped the closed object (on a GPU: the KV tensors and the pinned cache held)."""
    import gc
    import weakref

    dev = kvtier.host_device()
    compute = dev.create_stream("compute")
    tensors = [np.zeros((BLOCKS, 512), dtype=np.uint8) for _ in range(LAYERS)]
    refs = [weakref.ref(t) for t in tensors]
    mgr = kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, num_host_blocks=HOST_BLOCKS)
    mgr.wait(mgr.evict([1], [1]), 10.0)
    del tensors
    gc.collect()
    assert all(r() is not None for r in refs)  # the manager keeps them while open
    mgr.close()
    gc.collect()
    assert all(r() is None for r in refs), "closed, the manager still holds the engine's tensors"
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        mgr.evict([1], [1])
    with pytest.raises(kvtier.FailedPreconditionError, match="host_of was closed"):
        kvtier.TransferManager.from_pages(dev, compute, [np.zeros((BLOCKS, 512), np.uint8)] * LAYERS, [512] * LAYERS,
                                          HOST_BLOCKS, host_of=mgr)
    mgr.close()  # idempotent


def test_close_keeps_its_deadline_and_says_the_drain_timed_out():
    """close() with copies that outlast transfer.shutdown_timeout returned None after every queued copy had run (4 s
    against 0.3 s), and then freed the registered memory and the engine's tensors: on a GPU under copies still in
    flight. It now raises TimedOutError within the deadline and keeps that memory."""
    import gc
    import weakref

    dev = kvtier.host_device(min_delay_us=1_000_000, max_delay_us=1_000_000)  # every device operation takes 1 s
    compute = dev.create_stream("compute")
    tensors = [np.zeros((BLOCKS, 512), dtype=np.uint8) for _ in range(LAYERS)]
    refs = [weakref.ref(t) for t in tensors]
    mgr = kvtier.TransferManager.from_pages(dev, compute, tensors, [512] * LAYERS, num_host_blocks=HOST_BLOCKS,
                                            config={"transfer.shutdown_timeout": "300ms"})
    for i in range(4):
        mgr.evict([i], [i])
    time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(kvtier.TimedOutError, match="shutdown"):
        mgr.close()
    assert time.monotonic() - t0 < 2.5, "close() waited for the copies instead of its deadline"
    del tensors
    gc.collect()
    assert all(r() is not None for r in refs), "the engine's tensors were freed under copies that may still run"
    mgr.close()  # idempotent: closed
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        mgr.evict([1], [1])


def test_cache_manager_takes_every_knob_from_the_environment_and_config(monkeypatch):
    """The docstring promised config=, which did not exist, and KVTIER_CACHE_* variables were ignored from Python: the
    look-ahead, watermarks and storage policy could not be set at all. Defaults, then the environment, then config,
    then the arguments given."""
    monkeypatch.setenv("KVTIER_CACHE_HOST_BLOCKS", "16")
    monkeypatch.setenv("KVTIER_CACHE_DEVICE_POLICY", "lru")

    def tiers(cm):
        return {t: cm.stats()[t]["capacity"] for t in ("device", "host", "storage")}

    assert tiers(kvtier.CacheManager(8)) == {"device": 8, "host": 16, "storage": 0}
    assert tiers(kvtier.CacheManager(8, config={"host_blocks": 24, "cache.storage_blocks": 32})) == {
        "device": 8, "host": 24, "storage": 32}
    assert tiers(kvtier.CacheManager(8, host_blocks=4, config={"host_blocks": 24})) == {
        "device": 8, "host": 4, "storage": 0}
    monkeypatch.setenv("KVTIER_CACHE_DEVICE_BLOCKS", "12")
    assert tiers(kvtier.CacheManager())["device"] == 12
    # env=False: an index whose settings its owner keeps (kvtier.vllm's) takes none of the environment.
    assert tiers(kvtier.CacheManager(8, env=False)) == {"device": 8, "host": 0, "storage": 0}
    # The look-ahead's prefetch budget (a knob no argument reaches): 0 queues no load for an announced request whose
    # blocks are on host, the default does.
    h = kvtier.KeyHasher("m", block_tokens=1)
    first, second = h.keys_for(list(range(4))), h.keys_for(list(range(100, 108)))

    def serve(cm, keys):
        adm = cm.admit(keys)
        for when in ("before", "after"):
            if when == "after":
                cm.commit(adm["id"])
                cm.release(adm["id"])
            for _ in range(4):
                plan = cm.take_plan()
                for kind in ("evictions", "backups", "loads"):
                    if plan[kind]:
                        cm.ack(kind, [dst for _, dst, _ in plan[kind]])

    for budget, prefetches in (("0", False), (None, True)):
        cm = kvtier.CacheManager(8, host_blocks=16, config={} if budget is None else {
            "lookahead_prefetch_blocks": budget})
        serve(cm, first)
        serve(cm, second)  # the first request's blocks go to host
        assert cm.match(first)["host_blocks"] == 4
        cm.announce(first)
        assert bool(cm.take_plan()["loads"]) == prefetches, budget
    with pytest.raises(kvtier.InvalidArgumentError, match="cache.device_watermarks.low"):
        kvtier.CacheManager(8, config={"device_watermarks.low": "nan"})
    with pytest.raises(kvtier.InvalidArgumentError, match="cache.host_policy.*belady"):
        kvtier.CacheManager(8, host_blocks=8, config={"host_policy": "belady"})
    with pytest.raises(kvtier.InvalidArgumentError, match="nope"):
        kvtier.CacheManager(8, config={"nope": 1})
    with pytest.raises(kvtier.InvalidArgumentError, match=r"config\['host_blocks'\]"):
        kvtier.CacheManager(8, config={"host_blocks": [1]})
    with pytest.raises(kvtier.InvalidArgumentError, match="config"):
        kvtier.CacheManager(8, config=[("host_blocks", 1)])
    monkeypatch.setenv("KVTIER_CACHE_HOST_BLOCKS", "many")
    with pytest.raises(kvtier.InvalidArgumentError, match="KVTIER_CACHE"):
        kvtier.CacheManager(8)


def test_lists_and_none_are_named_where_nanobind_refused_the_call():
    """KeyHasher.keys_for([2**31]), ack(kind, None), admit(None), match("ab") and save_states_at=None raised nanobind's
    unnamed "incompatible function arguments"; negative token ids were taken."""
    h = kvtier.KeyHasher("m", block_tokens=1)
    with pytest.raises(kvtier.OutOfRangeError, match=r"tokens\[0\] 2147483648"):
        h.keys_for([2**31, 1])
    with pytest.raises(kvtier.OutOfRangeError, match=r"tokens\[1\] -1"):
        h.keys_for([1, -1])
    assert h.keys_for(np.arange(3, dtype=np.int64)) == h.keys_for([0, 1, 2])
    cm = kvtier.CacheManager(device_blocks=8)
    with pytest.raises(kvtier.InvalidArgumentError, match="dst_blocks None"):
        cm.ack("loads", None)
    for call in (lambda: cm.admit(None), lambda: cm.match("ab"), lambda: cm.prefetch(None)):
        with pytest.raises(kvtier.InvalidArgumentError, match="keys"):
            call()
    with pytest.raises(kvtier.InvalidArgumentError, match=r"keys\[1\] 5 is not a string"):
        cm.admit([h.keys_for([1])[0], 5])
    hc = kvtier.HybridCache([dict(name="full", kind="full", block_tokens=16, device_blocks=8)])
    with pytest.raises(kvtier.InvalidArgumentError, match="save_states_at"):
        hc.admit(32, [["%032x" % 1, "%032x" % 2]], save_states_at=None)
    # TransferManager's config takes numbers and bools as well as strings; anything else is named.
    dev = kvtier.host_device()
    tensors = [np.zeros((BLOCKS, 512), dtype=np.uint8) for _ in range(LAYERS)]
    mgr = kvtier.TransferManager.from_pages(dev, dev.create_stream("c"), tensors, [512] * LAYERS, HOST_BLOCKS,
                                            config={"transfer.latency_samples": 5})
    mgr.close()
    with pytest.raises(kvtier.InvalidArgumentError, match=r"config\['transfer.latency_samples'\]"):
        kvtier.TransferManager.from_pages(dev, dev.create_stream("c"), tensors, [512] * LAYERS, HOST_BLOCKS,
                                          config={"transfer.latency_samples": None})


def test_an_empty_numpy_buffer_is_an_empty_object(tmp_path):
    """put_many / get_many refused np.zeros(0) as "not C-contiguous (dimension 0 has stride 0 elements, 1
    expected)", though put(key, b"") stores an empty object."""
    h = kvtier.KeyHasher("m", block_tokens=1)
    k = h.keys_for([1, 2])
    for spec in (f"disk:{tmp_path}/d", "memory:?capacity=1M"):
        s = kvtier.StorageBackend.open(spec)
        empty = np.zeros(0, np.uint8)
        assert s.put_many([k[1]], [empty]) == [0]
        assert s.get(k[1], 16) == b""
        assert s.get_many([k[1]], [np.zeros((0, 4), np.uint8)]) == [0]
        s.close()


def test_none_block_lists_and_read_only_tensors_are_named():
    """evict(None, ...) and load(None, ...) raised nanobind's TypeError ("incompatible function arguments"), and a
    read-only KV tensor refused by from_tensors named no tensor."""
    dev = kvtier.host_device()
    compute = dev.create_stream("c")

    def kv(read_only=None):
        out = {f"{role}_0_rank0.device0": np.zeros((4, 64), np.uint8) for role in ("key_caches", "value_caches")}
        if read_only:
            out[read_only].flags.writeable = False
        return out

    host = kv()
    pointers = {k: v.ctypes.data for k, v in host.items()}
    mgr = kvtier.TransferManager.from_tensors(dev, compute, kv(), pointers, 4, 1)
    try:
        with pytest.raises(kvtier.InvalidArgumentError, match="device"):
            mgr.evict(None, [0])
        with pytest.raises(kvtier.InvalidArgumentError, match="host"):
            mgr.evict([0], None)
        with pytest.raises(kvtier.InvalidArgumentError, match="layer None is not a sequence"):
            mgr.load(None, None, [0])
    finally:
        mgr.close()
    with pytest.raises(kvtier.InvalidArgumentError, match=r"device_tensors\['value_caches_0_rank0.device0'\] is "
                                                          r"read-only"):
        kvtier.TransferManager.from_tensors(dev, compute, kv("value_caches_0_rank0.device0"), pointers, 4, 1)
    with pytest.raises(kvtier.InvalidArgumentError, match=r"device_tensors\['key_caches_0_rank0.device0'\] is a "
                                                          r"list"):
        kvtier.TransferManager.from_tensors(dev, compute, {**kv(), "key_caches_0_rank0.device0": [1, 2]}, pointers,
                                            4, 1)



def test_an_array_whose_dtype_dlpack_cannot_carry_is_named_with_its_dtype():
    """A numpy array of object, string, structured or datetime dtype was refused as "is a ndarray, not a tensor",
    which reads as if numpy arrays were not accepted at all."""
    dev = kvtier.host_device()
    compute = dev.create_stream("c")
    good = {f"{role}_0_rank0.device0": np.zeros((4, 64), np.uint8) for role in ("key_caches", "value_caches")}
    pointers = {k: v.ctypes.data for k, v in good.items()}
    for bad, shown in ((np.zeros(4, dtype=object), "object"), (np.zeros(4, dtype="U3"), "<U3"),
                       (np.zeros(4, dtype="datetime64[s]"), r"datetime64\[s\]"),
                       (np.zeros(4, dtype=[("a", "i4"), ("b", "f4")]), "a")):
        tensors = {**good, "value_caches_0_rank0.device0": bad}
        with pytest.raises(kvtier.InvalidArgumentError,
                           match=r"device_tensors\['value_caches_0_rank0.device0'\] is a ndarray of dtype .*" + shown
                           + r".*DLPack cannot carry"):
            kvtier.TransferManager.from_tensors(dev, compute, tensors, pointers, 4, 1)
    # Objects with a dtype attribute that is not an array's keep the plain message, and the interpreter is fine.
    class Odd:
        dtype = property(lambda self: 1 / 0)

    with pytest.raises(kvtier.InvalidArgumentError, match=r"is a Odd, not a tensor"):
        kvtier.TransferManager.from_tensors(dev, compute, {**good, "key_caches_0_rank0.device0": Odd()}, pointers, 4,
                                            1)
    mgr = kvtier.TransferManager.from_tensors(dev, compute, good, pointers, 4, 1)
    mgr.close()


_CHECKSUMS_AFTER_TIMEOUTS = r"""
import sys
import numpy as np
import kvtier
sys.path.insert(0, sys.argv[1])
from test_transfer_faults import BLOCKS, HOST_BLOCKS, LAYERS, arrays

dev = kvtier.host_device(seed=1, min_delay_us=0, max_delay_us=30_000)
compute = dev.create_stream("compute")
d, h = arrays(BLOCKS, seed=3), arrays(HOST_BLOCKS, fill=0xEE)
mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()}, HOST_BLOCKS,
                                          LAYERS)
a, b = dev.create_stream("a"), dev.create_stream("b")
ref = [mgr.device_checksums([blk], compute, 10.0)[0] for blk in range(BLOCKS)]
assert len(set(ref)) == BLOCKS
wrong = 0
for trial in range(30):
    try:
        mgr.device_checksums([0], a, 0.0)  # times out with its work queued on a
    except kvtier.TimedOutError:
        pass
    wrong += mgr.device_checksums([1], b, 10.0)[0] != ref[1]
    if trial % 10 == 9:  # a larger call grows the scratch while queued work may still write the old one
        got = mgr.device_checksums(list(range(BLOCKS)), b, 10.0)
        wrong += got != ref
try:
    mgr.device_checksums([0], a, float("nan"))  # refused before anything is queued
except ValueError:
    pass
print("wrong", wrong)
mgr.close()
"""


def test_checksums_after_a_timed_out_call_are_right_and_exit_is_clean():
    """A device_checksums call that timed out left its kernel and read-back queued on its stream over the shared
    scratch: the next call on another stream read another block's sums (33 of 40 wrong), a larger call freed the
    scratch under the queued copy, and the process crashed at exit on a stream worker. The scratch of a failed call
    is retired behind an event now."""
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _CHECKSUMS_AFTER_TIMEOUTS, here], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrong 0" in r.stdout, r.stdout


def test_a_dropped_stream_with_work_queued_lets_other_threads_run():
    """A Stream's destructor waits for its queued work (host backend): it ran with the GIL held, so every other
    Python thread stopped for as long as that work took (0 ticks of another thread in 1.35 s)."""
    import threading
    import time

    dev = kvtier.host_device(min_delay_us=400_000, max_delay_us=400_000)
    compute = dev.create_stream("compute")
    d, h = arrays(BLOCKS), arrays(HOST_BLOCKS)
    mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()},
                                              HOST_BLOCKS, LAYERS)
    stream = dev.create_stream("busy")
    with pytest.raises(kvtier.TimedOutError):
        mgr.device_checksums([0], stream, timeout=0.05)  # leaves its work queued on the stream
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.05)
        start = time.monotonic()
        del stream
        end = time.monotonic()
    finally:
        stop.set()
        t.join()
        mgr.close()
    during = [x for x in ticks if start < x < end]
    assert end - start < 0.1 or len(during) >= 5, (end - start, len(during))


def _run_script(code, timeout=60):
    """Runs `code` in a fresh interpreter (a crash or a hang there must not take pytest with it)."""
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_a_manager_dropped_inside_its_callback_keeps_the_engines_tensors_until_its_copies_end():
    """The last reference dropped inside on_done hands the manager to a thread that drains its queued copies; the
    engine's arrays were released at once, so those copies wrote freed (unmapped) memory: a segfault."""
    code = """
import gc, threading, time, numpy as np, kvtier
BB = 4 << 20  # large enough that numpy maps each array on its own: a freed one is unmapped
dev = kvtier.host_device(min_delay_us=20000, max_delay_us=20000)
compute = dev.create_stream("compute")
d = {f"{r}_{l}_rank0.device0": np.zeros((8, BB), np.uint8) for l in range(2) for r in ("key_caches", "value_caches")}
holder = {"m": kvtier.TransferManager.from_tensors(dev, compute, d, None, 8, 2)}
del d
m = holder["m"]
done = threading.Event()
def drop(task, err):
    holder.clear()
    gc.collect()
    done.set()
m.evict([0], [0], on_done=drop)
for i in range(8):
    m.load([], [0], [i])
del m
assert done.wait(10)
time.sleep(2)
print("survived")
"""
    r = _run_script(code)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    # What the drained manager handed back (the device, the stream, the tensors) is dropped by exit: nanobind's
    # leak check reported the device and stream as leaked instances.
    assert "leaked" not in r.stderr, r.stderr[-2000:]


def test_a_finalizer_that_calls_the_cache_manager_inside_one_of_its_calls_does_not_hang():
    """Building a call's result (or its exception) may run the garbage collector, and a finalizer it runs may call
    the same CacheManager on the same thread: that call waited for its own mutex forever. Now release() there is
    applied by the next call, and other calls raise FailedPreconditionError."""
    code = """
import gc, kvtier
cm = kvtier.CacheManager(device_blocks=4, host_blocks=4)
h = kvtier.KeyHasher("m", block_tokens=4)
small, big = h.keys_for(list(range(8))), h.keys_for(list(range(100, 200)))
seen = []
class Request:
    def __init__(self, adm):
        self.adm, self.me = adm, self  # a cycle: only the cyclic collector frees it
    def __del__(self):
        try:
            cm.release(self.adm)
            seen.append("released")
            cm.stats()
        except kvtier.FailedPreconditionError as e:
            seen.append("refused: " + str(e))
first = cm.admit(small)["id"]
Request(first)
gc.set_threshold(1)
try:
    cm.admit(big)
except kvtier.KvtierError as e:
    print("raised", type(e).__name__)
gc.set_threshold(700)
gc.collect()
print(seen)
# The release made inside admit() is applied by the next call: the admission is gone.
try:
    cm.admission_status(first)
    print("still open")
except kvtier.NotFoundError:
    print("released")
cm.check_invariants()
print("done")
"""
    r = _run_script(code, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    # The collector ran inside admit() (threshold 1): the finalizer's release was deferred, its stats() call (any
    # other call) refused, and the next call applied the release.
    assert "'released', 'refused: FailedPrecondition: called again on the thread" in r.stdout, r.stdout
    assert "released\ndone" in r.stdout, r.stdout


def test_storage_buffers_are_read_by_index_not_by_iteration(tmp_path):
    """get_many/put_many checked len(buffers) and then iterated: a sequence that yields more than its len() was
    written past the end of the batch (heap corruption, a segfault later)."""
    code = """
import numpy as np, kvtier
s = kvtier.StorageBackend.open("memory:?capacity=1000000")
key = "%032x" % 1
s.put_many([key], [np.arange(512, dtype=np.uint8)])
class Bufs:
    def __init__(self, items): self.items = items
    def __len__(self): return 1
    def __getitem__(self, i):
        if i >= 1: raise IndexError(i)
        return self.items[i]
    def __iter__(self): return iter(self.items)
bufs = [np.zeros(512, np.uint8) for _ in range(64)]
for _ in range(20):
    print(s.get_many([key], Bufs(bufs)))
assert np.array_equal(bufs[0], np.arange(512, dtype=np.uint8))
assert not bufs[1].any()
s.close()
print("ok")
"""
    r = _run_script(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_ctrl_c_ends_a_wait_without_a_deadline():
    """Waits release the GIL and blocked in C++ for their whole timeout: with timeout=None on a stream that does not
    finish, SIGINT was handled only once the work ended (16 s for an 8 s copy per block)."""
    import signal
    import threading

    dev = kvtier.host_device(min_delay_us=3_000_000, max_delay_us=3_000_000)
    compute = dev.create_stream("compute")
    d, h = arrays(BLOCKS), arrays(HOST_BLOCKS)
    mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()},
                                              HOST_BLOCKS, LAYERS)
    task = mgr.evict([0], [0])
    # A process started in the background by a shell inherits SIGINT ignored, and Python then installs no handler:
    # the test installs Python's own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(task)
        assert time.monotonic() - start < 2.0, time.monotonic() - start
        # Bounded waits still time out with their own timeout in the message.
        with pytest.raises(kvtier.TimedOutError, match="after 20000 us"):
            mgr.wait(task, 0.02)
        mgr.wait(task, 30.0)
        assert np.array_equal(h["key_caches_0_rank0.device0"][0], d["key_caches_0_rank0.device0"][0])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        mgr.close()


def test_dropping_a_manager_whose_close_timed_out_lets_other_threads_run():
    """close() that timed out keeps the manager until the object goes; its destruction waits for the queued copies
    (host backend) and ran with the GIL held: no other Python thread ran for as long as the copies took."""
    import gc
    import threading

    dev = kvtier.host_device(min_delay_us=1_500_000, max_delay_us=1_500_000)
    compute = dev.create_stream("compute")
    d, h = arrays(BLOCKS), arrays(HOST_BLOCKS)
    mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()},
                                              HOST_BLOCKS, LAYERS, config={"transfer.shutdown_timeout": "200ms"})
    mgr.evict([0], [0])
    with pytest.raises(kvtier.TimedOutError):
        mgr.close()
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.05)
        start = time.monotonic()
        del mgr
        gc.collect()
        end = time.monotonic()
    finally:
        stop.set()
        t.join()
    inside = [x for x in ticks if start - 0.05 <= x <= end + 0.05]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    assert end - start > 0.5, "the queued copies were expected to still be running"
    assert gaps and max(gaps) < 0.5, f"another thread stalled {max(gaps or [0]):.2f} s of {end - start:.2f} s"


_RECEIVER_FROM_A_FINALIZER = r"""
import gc, sys, numpy as np, kvtier, kvtier.pd as pd
LAYERS, NB = 2, 4
dst = [(np.zeros((NB, 4, 16), np.float16), np.zeros((NB, 4, 16), np.float16)) for _ in range(LAYERS)]
dev = kvtier.host_device()
compute = dev.create_stream("compute")
tm = kvtier.TransferManager.from_tensors(dev, compute, pd._name_map(dst, 0, 0), None, 4, LAYERS)
cache = kvtier.CacheManager(device_blocks=NB, host_blocks=4)
d = pd.Decode(dst, transport="loopback", device=dev, heartbeat_s=0.05, lease_s=0.5)
rx = pd.Receiver(cache, tm, d)
big = kvtier.KeyHasher("m", block_tokens=4).keys_for(list(range(100, 200)))
outcome = []

class Req:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it

    def __del__(self):
        try:
            cache.stats()
            inside = False
        except kvtier.FailedPreconditionError:
            inside = True
        try:
            getattr(rx, sys.argv[1])()
            outcome.append((inside, "returned"))
        except kvtier.FailedPreconditionError as e:
            outcome.append((inside, "refused: " + str(e)))

Req()
gc.set_threshold(1)
try:
    cache.admit(big)
except kvtier.KvtierError:
    pass
gc.set_threshold(700)
gc.collect()
print(outcome)
assert any(o[0] for o in outcome), ("the finalizer did not run inside the cache call", outcome)
assert all(o[1] == "returned" for o in outcome if not o[0]), outcome
assert all(o[1].startswith("refused") and "__del__" in o[1] for o in outcome if o[0]), outcome
rx.close(); d.close(); tm.close()
print("ok")
"""


@pytest.mark.parametrize("call", ["poll", "close"])
def test_a_receiver_called_from_a_finalizer_inside_a_cache_call_is_refused_not_deadlocked(call):
    """kvtier.pd.Receiver's calls took the cache's mutex with the GIL released: called from a __del__ the garbage
    collector ran inside cache.admit() (which holds it), the thread waited for itself forever."""
    r = subprocess.run([sys.executable, "-c", _RECEIVER_FROM_A_FINALIZER, call], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])


_EXIT_WHILE_A_DAEMON_THREAD_WAITS = r"""
import sys, threading, time
import numpy as np
import kvtier

dev = kvtier.host_device(min_delay_us=3_000_000, max_delay_us=3_000_000)  # each copy takes 3 s
stream = dev.create_stream()
kv = {f"{r}_0_rank0.device0": np.zeros((8, 64), np.uint8) for r in ("key_caches", "value_caches")}
tm = kvtier.TransferManager.from_tensors(dev, stream, kv, None, 8, 1)
task = tm.load([], [0, 1], [0, 1])
if sys.argv[1] == "wait":
    target = lambda: tm.wait(task, timeout=None)
else:
    target = lambda: tm.wait_layer_host(task, 0, timeout=None)
threading.Thread(target=target, daemon=True).start()  # an engine's watcher thread
time.sleep(0.3)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("call", ["wait", "wait_layer_host"])
def test_exit_while_a_daemon_thread_waits_without_a_deadline_is_clean(call):
    """A wait without a deadline takes the GIL back every 50 ms to look for Ctrl-C; once the interpreter finalized,
    CPython ended that thread inside kvtier's C++ frames: 'terminate called without an active exception', the
    process aborted (exit 134) in 6 of 6 runs."""
    r = subprocess.run([sys.executable, "-c", _EXIT_WHILE_A_DAEMON_THREAD_WAITS, call], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "exiting" in r.stdout and "terminate" not in r.stderr, r.stderr[-2000:]
