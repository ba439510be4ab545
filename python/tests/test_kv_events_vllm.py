"""kvtier's KV events read by vLLM's own event classes (vllm/distributed/kv_events.py, vLLM 0.34).

vLLM's module imports its config, logger and network helpers, which pull in transformers; the test environment
has vLLM without it (scripts/test-wheel.sh). So the module's source is run in a namespace of its own with those
imports replaced by stand-ins: the event classes, their msgspec settings and fields are vLLM's, unchanged.
"""

import time

import pytest

import kvtier

vllm = pytest.importorskip("vllm")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")


def _vllm_event_classes():
    path = vllm.__path__[0] + "/distributed/kv_events.py"
    with open(path) as f:
        src = f.read()
    stand_ins = {
        "from vllm.config.kv_events import KVEventsConfig": "KVEventsConfig = object",
        "from vllm.logger import init_logger": "init_logger = lambda name: None",
        "from vllm.v1.core.kv_cache_utils import ExternalBlockHash": "ExternalBlockHash = bytes | int",
    }
    for imp, stand_in in stand_ins.items():
        assert imp in src, f"vLLM's kv_events.py no longer has '{imp}': update this test's stand-ins"
        src = src.replace(imp, stand_in)
    start = src.index("from vllm.utils.network_utils import (")
    src = src[:start] + src[src.index(")", start) + 1 :]
    assert "from vllm" not in src, "vLLM's kv_events.py imports more of vLLM: update this test's stand-ins"
    ns = {"__name__": "vllm_kv_events_under_test"}
    exec(compile(src, path, "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def vk():
    return _vllm_event_classes()


def _settle(cm):
    plan = cm.take_plan()
    for kind in ("evictions", "backups", "loads", "storage_writes", "storage_prefetches"):
        if plan[kind]:
            cm.ack(kind, [dst for _, dst, _ in plan[kind]])


def _published_batch(encoding, storage_medium="DISK"):
    import kvtier.metrics as km

    if not km.zmq_available():
        pytest.skip("libzmq.so.5 not loadable")
    pub = km.KvEventPublisher("tcp://127.0.0.1:*", encoding=encoding)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher before the first batch
    try:
        # Device 2 blocks, host 2, storage 8, write-back: requests of 2 blocks each go to the device and are
        # demoted to the host and on to storage as later ones need room: every medium stores and removes.
        cm = kvtier.CacheManager(device_blocks=2, host_blocks=2, storage_blocks=8, write_policy="write_back")
        cm.enable_kv_events(16, storage_medium=storage_medium)
        hasher = kvtier.KeyHasher("m", 16)
        keys = []
        for r in range(4):
            chain = hasher.keys_for(list(range(1000 * r, 1000 * r + 32)))
            keys += chain
            for _ in range(8):
                try:
                    a = cm.admit(chain)
                    break
                except kvtier.ResourceExhaustedError:
                    _settle(cm)
            _settle(cm)
            cm.commit(a["id"])
            cm.release(a["id"])
            _settle(cm)
        for _ in range(4):
            _settle(cm)
        assert cm.publish_events(pub) == 0
        pub.flush(5.0)
        assert sub.poll(5000)
        _, _, payload = sub.recv_multipart()
        return payload, keys
    finally:
        pub.shutdown()
        sub.close()
        ctx.term()


@pytest.mark.skipif(not getattr(kvtier._native, "has_cache", False), reason="no cache bindings")
@pytest.mark.parametrize("storage_medium,locality", [("DISK", "LOCAL"), ("REMOTE", "REMOTE")])
def test_vllm_reads_kvtiers_events_and_writes_the_same_bytes(vk, storage_medium, locality):
    payload, keys = _published_batch("map", storage_medium)
    batch = msgspec.msgpack.Decoder(type=vk["KVEventBatch"]).decode(payload)
    kinds = {type(e).__name__ for e in batch.events}
    assert {"BlockStored", "BlockRemoved"} <= kinds, kinds
    media = {e.medium for e in batch.events if type(e).__name__ != "AllBlocksCleared"}
    assert media == {"GPU", "CPU", "STORAGE"}, media
    stored = [e for e in batch.events if type(e).__name__ == "BlockStored"]
    assert {h.hex() for e in stored for h in e.block_hashes} <= set(keys)
    assert all(e.block_size == 16 and e.lora_name is None for e in stored)
    for e in batch.events:
        if getattr(e, "medium", None) == "STORAGE":
            assert e.locality == locality
        elif type(e).__name__ != "AllBlocksCleared":
            assert e.locality is None
    # vLLM's encoder writes exactly kvtier's bytes for the batch it decoded.
    assert msgspec.msgpack.encode(batch) == payload
    # kvtier's own decoder reads them back with kvtier's names of the media.
    ours = kvtier._native.decode_kv_event_batch(payload)
    ours_media = {e["medium"] for e in ours["events"] if "medium" in e}
    assert ours_media == {"GPU", "CPU", "DISK" if storage_medium == "DISK" else "REMOTE"}


@pytest.mark.skipif(not getattr(kvtier._native, "has_cache", False), reason="no cache bindings")
def test_the_array_encoding_is_the_earlier_form(vk):
    payload, keys = _published_batch("array")
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw[1][0], list) and raw[1][0][0] == "BlockStored"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(type=vk["KVEventBatch"]).decode(payload)  # vLLM 0.34 reads maps only
    assert kvtier._native.decode_kv_event_batch(payload)["events"][0]["type"] == "BlockStored"


def test_kvtier_reads_what_vllm_writes(vk):
    # vLLM's default hashes are integers of all 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): half of them are
    # above 2**63 - 1, which refused the whole batch.
    h1, h2, h3, h4 = bytes(range(16)), 12345, 2**64 - 1, 2**63
    batch = vk["KVEventBatch"](
        ts=2.5,
        events=[
            vk["BlockStored"](
                block_hashes=[h1, h2, h3],
                parent_block_hash=h4,
                token_ids=[1, 2, 3],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name="adapter",
                extra_keys=[("mm", 3), None, ("mm", 2**64 - 1)],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
            ),
            vk["BlockRemoved"](block_hashes=[h1], medium="STORAGE", locality="REMOTE", group_idx=1),
            vk["AllBlocksCleared"](),
        ],
        data_parallel_rank=3,
    )
    got = kvtier._native.decode_kv_event_batch(msgspec.msgpack.encode(batch))
    assert got["ts"] == 2.5 and got["data_parallel_rank"] == 3
    stored, removed, cleared = got["events"]
    assert stored["type"] == "BlockStored" and stored["token_ids"] == [1, 2, 3] and stored["medium"] == "GPU"
    assert stored["block_hashes"] == [h1, h2.to_bytes(16, "big"), h3.to_bytes(16, "big")]
    assert stored["parent_block_hash"] == h4.to_bytes(16, "big")
    assert removed == {"type": "BlockRemoved", "block_hashes": [h1], "medium": "REMOTE"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_an_encoding_that_is_neither_is_refused():
    import kvtier.metrics as km

    if not km.zmq_available():
        pytest.skip("libzmq.so.5 not loadable")
    with pytest.raises(kvtier.InvalidArgumentError, match="'json'"):
        km.KvEventPublisher("tcp://127.0.0.1:*", encoding="json")
