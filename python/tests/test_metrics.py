"""kvtier's Prometheus exposition, parsed by prometheus_client: the counters of `kvtier replay --metrics-out`
equal the replay's own totals (its --json output), with and without injected failures."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kvtier

parser = pytest.importorskip("prometheus_client.parser")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli() -> str:
    candidates = [os.environ.get("KVTIER_CLI", "")]
    try:
        import kvtier

        candidates.append(os.path.join(os.path.dirname(kvtier.__file__), "bin", "kvtier"))
    except ImportError:
        pass
    candidates.append(os.path.join(ROOT, "build", "default", "tools", "kvtier"))
    for c in candidates:
        if c and os.path.exists(c):
            return c
    pytest.skip("no kvtier CLI binary (set KVTIER_CLI)")


def _replay(tmp_path, *extra: str, host_blocks: int = 512, transfer: str = "none"):
    out = tmp_path / "metrics.prom"
    cmd = [_cli(), "replay", os.path.join(ROOT, "data", "traces", "mooncake_sample.jsonl"), "--max-requests", "300",
           "--device-blocks", "256", "--host-blocks", str(host_blocks), "--transfer", transfer, "--json",
           "--metrics-out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    samples = {}
    types = {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return json.loads(p.stdout), samples, types, text


def _v(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_counters_equal_the_replay_totals(tmp_path):
    r, s, types, text = _replay(tmp_path)
    assert "# TYPE kvtier_replay_hit_blocks_total counter" in text
    assert types["kvtier_replay_hit_blocks"] == "counter"  # the parser drops _total from family names
    assert types["kvtier_replay_request_seconds"] == "histogram"
    assert _v(s, "kvtier_replay_requests_total") == r["requests"] == 300
    assert _v(s, "kvtier_replay_lookup_blocks_total") == r["total_blocks"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="device") == r["device_hit_blocks"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    hits = r["device_hit_blocks"] + r["host_hit_blocks"] + r["storage_hit_blocks"]
    assert hits > 0
    assert _v(s, "kvtier_replay_miss_blocks_total") == r["total_blocks"] - hits
    assert _v(s, "kvtier_replay_moved_bytes_total", direction="d2h") == r["bytes_d2h"] > 0
    assert _v(s, "kvtier_replay_moved_bytes_total", direction="h2d") == r["bytes_h2d"] > 0
    assert _v(s, "kvtier_replay_refused_requests_total") == r["failed_admissions"]
    assert _v(s, "kvtier_replay_request_seconds_count") == 300
    assert _v(s, "kvtier_replay_request_seconds_bucket", le="+Inf") == 300
    # The cache manager's own series (attached by the replay): what its admissions saw.
    assert _v(s, "kvtier_cache_failed_transfers_total") == r["failed_transfers"] == 0
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="device") == r["device_hit_blocks"]
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    assert _v(s, "kvtier_cache_moves_total", kind="load") * r["block_bytes"] == r["bytes_h2d"]
    assert _v(s, "kvtier_cache_pool_capacity_blocks", tier="device") == 256
    assert 0 < _v(s, "kvtier_cache_pool_used_blocks", tier="device") <= 256


def test_failures_are_counted(tmp_path):
    r, s, _, _ = _replay(tmp_path, "--failure-rate", "0.05", "--seed", "3")
    assert r["failed_transfers"] > 0
    assert _v(s, "kvtier_cache_failed_transfers_total") == r["failed_transfers"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    # Failed loads are hits the cache manager admitted that the replay then recomputed.
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="host") >= r["host_hit_blocks"]


def test_real_copies_are_counted_by_the_transfer_manager(tmp_path):
    # --transfer host: every device<->host byte goes through a TransferManager on the host backend, whose
    # own series must equal what the replay's executor moved.
    r, s, _, _ = _replay(tmp_path, transfer="host")
    t = r["transfer"]
    assert t["verification_failures"] == 0 and t["failed_tasks"] == 0
    assert _v(s, "kvtier_transfer_bytes_total", direction="evict") == t["bytes_d2h"] > 0
    assert _v(s, "kvtier_transfer_bytes_total", direction="load") == t["bytes_h2d"] > 0
    assert _v(s, "kvtier_transfer_blocks_total", direction="load") * r["block_bytes"] == t["bytes_h2d"]
    assert _v(s, "kvtier_transfer_tasks_total", direction="load", outcome="failed") == 0
    assert _v(s, "kvtier_transfer_in_flight_tasks", direction="evict") == 0
    loads = _v(s, "kvtier_transfer_tasks_total", direction="load", outcome="ok")
    assert _v(s, "kvtier_transfer_task_latency_seconds_count", direction="load") == loads > 0
    assert _v(s, "kvtier_transfer_layer_latency_seconds_count") >= loads


def test_storage_tier_is_counted(tmp_path):
    store = tmp_path / "store"
    r, s, _, _ = _replay(tmp_path, "--storage", f"disk:{store}", transfer="host", host_blocks=128)
    assert r["storage_writes"] > 0
    puts = _v(s, "kvtier_storage_items_total", backend="disk", op="put", outcome="ok")
    assert puts == r["storage_writes"]
    assert _v(s, "kvtier_storage_bytes_total", backend="disk", op="put") == r["bytes_to_storage"] > 0
    assert _v(s, "kvtier_storage_bytes_total", backend="disk", op="get") == r["bytes_from_storage"]
    assert _v(s, "kvtier_storage_items_total", backend="disk", op="get", outcome="data_loss") == 0
    assert _v(s, "kvtier_storage_objects", backend="disk") > 0


# ---- the package: managers attached to kvtier's registry, served through prometheus_client ----

def _scrape(collector_registry):
    from prometheus_client import generate_latest

    text = generate_latest(collector_registry).decode()
    samples = {}
    for fam in parser.text_string_to_metric_families(text):
        for smp in fam.samples:
            samples[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return text, samples


def _engine_arrays(n_blocks, layers=2, block_bytes=256, fill=None, seed=0):
    import numpy as np

    out = {}
    rng = np.random.default_rng(seed)
    for layer in range(layers):
        for role in ("key_caches", "value_caches"):
            a = np.empty((n_blocks, block_bytes), dtype=np.uint8)
            if fill is None:
                a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
            else:
                a.fill(fill)
            out[f"{role}_{layer}_rank0.device0"] = a
    return out


def test_collector_serves_the_transfer_managers_series_equal_to_its_stats():
    import numpy as np
    from prometheus_client import CollectorRegistry

    import kvtier
    from kvtier.metrics import KvtierCollector

    dev = kvtier.host_device(seed=5)
    compute = dev.create_stream("compute")
    d = _engine_arrays(8)
    h = _engine_arrays(8, fill=0xEE)
    mgr = kvtier.TransferManager.from_tensors(dev, compute, d, {k: v.ctypes.data for k, v in h.items()}, 8, 2)
    # The label names of the FastDeploy drop-in (one set of label names per family and registry).
    labels = {"rank": "91", "device": "collector"}
    mgr.attach_metrics(labels)
    with pytest.raises(kvtier.FailedPreconditionError):
        mgr.attach_metrics(labels)
    with pytest.raises(kvtier.InvalidArgumentError, match="bad-name"):
        kvtier.TransferManager.from_tensors(dev, compute, _engine_arrays(8), {k: v.ctypes.data for k, v in h.items()},
                                            8, 2).attach_metrics({"bad-name": "x"})
    before = {k: v[[1, 2, 3]].copy() for k, v in d.items()}
    mgr.wait(mgr.evict([1, 2, 3], [4, 5, 6]), timeout=30)
    for v in d.values():
        v[[0]] = 0x5A
    mgr.wait(mgr.load([], [4], [0]), timeout=30)
    for k, v in d.items():
        np.testing.assert_array_equal(v[0], before[k][0])
    stats = mgr.stats()

    reg = CollectorRegistry()
    reg.register(KvtierCollector())
    text, s = _scrape(reg)
    lab = tuple(labels.items())

    def v(name, **labels):
        return s[(name, tuple(sorted(lab + tuple(labels.items()))))]

    assert v("kvtier_transfer_bytes_total", direction="evict") == stats["evict"]["bytes_done"] == 3 * 4 * 256
    assert v("kvtier_transfer_blocks_total", direction="evict") == 3
    assert v("kvtier_transfer_blocks_total", direction="load") == 1
    assert v("kvtier_transfer_tasks_total", direction="load", outcome="ok") == stats["load"]["tasks_done"] == 1
    assert v("kvtier_transfer_layers_total", outcome="ok") == stats["layers_done"] == 2
    assert v("kvtier_transfer_in_flight_tasks", direction="load") == 0
    assert v("kvtier_transfer_layer_latency_seconds_count") == 2
    assert v("kvtier_transfer_layer_latency_seconds_bucket", le="+Inf") == 2
    assert v("kvtier_transfer_task_latency_seconds_sum", direction="evict") > 0
    # The same series through kvtier's text and its own endpoint.
    assert 'kvtier_transfer_blocks_total{rank="91",device="collector",direction="evict"} 3' in kvtier.metrics.text()
    import urllib.request

    with pytest.raises(kvtier.OutOfRangeError, match="port 70000"):
        kvtier.metrics.start_http_server(70000)
    server = kvtier.metrics.start_http_server(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.stop()
    assert 'kvtier_transfer_blocks_total{rank="91",device="collector",direction="load"} 1' in body
    mgr.close()


@pytest.mark.skipif(not getattr(__import__("kvtier")._native, "has_cache", False), reason="no cache bindings")
def test_cache_manager_series_events_and_reset():
    from prometheus_client import CollectorRegistry

    import kvtier
    from kvtier.metrics import KvtierCollector

    cm = kvtier.CacheManager(device_blocks=4, host_blocks=8, write_policy="write_back")
    cm.attach_metrics({"engine": "py"})
    cm.enable_kv_events(2)
    h = kvtier.KeyHasher("m", block_tokens=2)
    keys_a = h.keys_for(list(range(8)))
    a = cm.admit(keys_a)
    cm.commit(a["id"])
    cm.release(a["id"])
    ev = cm.take_events()
    assert [e["type"] for e in ev] == ["BlockStored"]
    assert ev[0]["medium"] == "GPU" and ev[0]["block_size"] == 2 and ev[0]["parent_block_hash"] is None
    assert [x.hex() for x in ev[0]["block_hashes"]] == keys_a
    b = cm.admit(h.keys_for(list(range(100, 108))))
    plan = cm.take_plan()
    cm.ack("evictions", [dst for _, dst, _ in plan["evictions"]])
    cm.commit(b["id"])
    cm.release(b["id"])
    types = [e["type"] for e in cm.take_events()]
    assert "BlockRemoved" in types and "BlockStored" in types
    st = cm.stats()
    reg = CollectorRegistry()
    reg.register(KvtierCollector())
    _, s = _scrape(reg)

    def v(name, **labels):
        return s[(name, tuple(sorted((("engine", "py"),) + tuple(labels.items()))))]

    assert v("kvtier_cache_lookup_blocks_total") == st["lookup_blocks"] == 8
    assert v("kvtier_cache_miss_blocks_total") == 8
    assert v("kvtier_cache_moves_total", kind="evict") == st["evictions_d2h"] == 4
    assert v("kvtier_cache_pool_used_blocks", tier="host") == st["host"]["used"] == 4
    with pytest.raises(kvtier.FailedPreconditionError, match="admissions are open"):
        c = cm.admit(keys_a[:1])
        cm.reset()
    cm.release(c["id"])
    for kind, moves in cm.take_plan().items():
        if moves:
            cm.ack(kind, [dst for _, dst, _ in moves])
    cm.reset()
    assert cm.take_events()[-1] == {"type": "AllBlocksCleared"}
    assert cm.match(keys_a)["device_blocks"] == 0
    _, s = _scrape(reg)
    assert v("kvtier_cache_resets_total") == 1
    assert v("kvtier_cache_index_blocks") == 0


@pytest.mark.skipif(not getattr(__import__("kvtier")._native, "has_cache", False), reason="no cache bindings")
def test_kv_events_published_over_zmq_reach_a_subscriber():
    import kvtier
    import kvtier.metrics as km

    if not km.zmq_available():
        pytest.skip("libzmq.so.5 not loadable")
    zmq = pytest.importorskip("zmq")
    decode = kvtier._native.decode_kv_event_batch
    with pytest.raises(kvtier.OutOfRangeError, match="buffer_steps -1"):
        km.KvEventPublisher("tcp://127.0.0.1:*", buffer_steps=-1)
    with pytest.raises(kvtier.InvalidArgumentError, match="data_parallel_rank 'a'"):
        km.KvEventPublisher("tcp://127.0.0.1:*", data_parallel_rank="a")
    spare = km.KvEventPublisher("tcp://127.0.0.1:*")
    with pytest.raises(ValueError):
        spare.shutdown(float("nan"))  # refused before the publisher is taken: it still flushes and shuts down
    spare.flush(1.0)
    spare.shutdown(1.0)
    pub = km.KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    cm = kvtier.CacheManager(device_blocks=4)
    cm.enable_kv_events(2)
    h = kvtier.KeyHasher("m", block_tokens=2)
    keys = h.keys_for(list(range(6)))
    import time

    time.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher before the first batch
    a = cm.admit(keys)
    cm.commit(a["id"])
    cm.release(a["id"])
    assert cm.publish_events(pub) == 0
    assert cm.publish_events(pub) is None  # nothing new
    pub.flush(5.0)
    assert sub.poll(5000)
    topic, seq, payload = sub.recv_multipart()
    assert int.from_bytes(seq, "big") == 0
    batch = decode(payload)
    assert batch["events"][0]["type"] == "BlockStored"
    assert [x.hex() for x in batch["events"][0]["block_hashes"]] == keys
    pub.shutdown()
    sub.close()
    ctx.term()


def test_publisher_timeouts_that_are_not_numbers_or_are_huge():
    # flush(1e300) multiplied by 1000 into an int64 (undefined); NaN became a wait of no time.
    import kvtier.metrics as km

    if not km.zmq_available():
        pytest.skip("libzmq.so.5 not loadable")
    pub = km.KvEventPublisher("tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="NaN"):
        pub.flush(float("nan"))
    pub.flush(1e300)
    pub.flush(float("inf"))
    with pytest.raises(ValueError, match="NaN"):
        pub.shutdown(float("nan"))
    pub.shutdown(1e300)


def test_publisher_shutdown_from_two_threads_and_flush_beside_it():
    # Two shutdown()s at once joined the same thread (RuntimeError) or used a freed publisher (SIGSEGV); a
    # flush() beside a shutdown() did the same.
    import threading

    import kvtier.metrics as km

    if not km.zmq_available():
        pytest.skip("libzmq.so.5 not loadable")
    for second in ("shutdown", "flush") * 25:
        pub = km.KvEventPublisher("tcp://127.0.0.1:*")
        barrier, errors = threading.Barrier(2), []

        def call(what):
            barrier.wait()
            try:
                getattr(pub, what)(1.0)
            except kvtier.FailedPreconditionError:
                pass  # flush() after the publisher was shut down: named
            except Exception as e:  # noqa: BLE001 - any other outcome is the bug
                errors.append(e)

        threads = [threading.Thread(target=call, args=("shutdown",)), threading.Thread(target=call, args=(second,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "hung"
        assert not errors, errors
        with pytest.raises(kvtier.FailedPreconditionError):
            pub.flush(0.1)


def test_error_messages_that_are_not_utf8_keep_their_error_class():
    # A message holding bytes that are not UTF-8 became a bare RuntimeError ("conversion error").
    with pytest.raises(kvtier.DataLossError, match="unknown event tag"):
        kvtier._native.decode_kv_event_batch(b"\x92\xcb" + 8 * b"\0" + b"\x91\x91\xa1\xff")


def test_event_batches_with_integers_out_of_range_or_an_unknown_medium_are_refused():
    """A block_size of 2**32 + 5 decoded as 5 and a data_parallel_rank of 2**63 + 1 as a negative number; an unknown
    medium raised InvalidArgumentError where the decoder promises DataLossError for what it cannot take."""
    import struct

    import kvtier

    def text(x):
        b = x.encode()
        return bytes([0xa0 | len(b)]) + b

    def stored(block_size, rank, medium="GPU"):
        event = (b"\x97" + text("BlockStored") + b"\x91\xc4\x10" + b"a" * 16 + b"\xc0" + b"\x92\x01\x02"
                 + b"\xcf" + struct.pack(">Q", block_size) + b"\xc0" + text(medium))
        return b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" + event + b"\xcf" + struct.pack(">Q", rank)

    decode = kvtier._native.decode_kv_event_batch
    ok = decode(stored(16, 3))
    assert ok["events"][0]["block_size"] == 16 and ok["data_parallel_rank"] == 3
    with pytest.raises(kvtier.DataLossError, match="block_size"):
        decode(stored(2**32 + 5, 3))
    with pytest.raises(kvtier.DataLossError, match="data_parallel_rank is not an integer in \\[-2\\*\\*63, 2\\*\\*63 - 1\\]"):
        decode(stored(16, 2**63 + 1))
    with pytest.raises(kvtier.DataLossError, match="medium 'cpu_offload'"):
        decode(stored(16, 3, "cpu_offload"))


def test_publish_events_names_a_publisher_of_the_wrong_type():
    import kvtier
    cm = kvtier.CacheManager(device_blocks=8, host_blocks=8)
    cm.enable_kv_events(block_size=16)
    with pytest.raises(kvtier.InvalidArgumentError, match="publisher is a object"):
        cm.publish_events(object())
