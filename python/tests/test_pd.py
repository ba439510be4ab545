"""kvtier.pd: prefill/decode through the Python API on the host backend, byte-exact, push and pull."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvtier
from conftest import poisoned_kv, random_kv
from kvtier.pd import Decode, DecodeStatus, Prefill, PrefillStatus, Receiver

LAYERS = 3
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 10
BLOCK_SHAPE = (2, 16, 8)  # float16: 512 bytes per (layer, role, block)
POISON = 0xEE
SECRET = bytes(range(32))
TIMEOUT = 10.0
# Short leases: a dead peer fails a transfer quickly.
FAST = dict(heartbeat_s=0.05, lease_s=0.5)

TRANSPORTS = {
    "loopback": dict(transport="loopback"),
    "ipc": dict(transport="ipc"),
    "ucx-tcp": dict(transport="ucx", tls="tcp", net_devices="lo"),
}


def prefill_kv(seed: int = 1, blocks: int = PREFILL_BLOCKS, shape=BLOCK_SHAPE):
    """One (key, value) pair of float16 tensors per layer, random bytes (a function of the seed)."""
    return random_kv(LAYERS, blocks, shape, seed)


def decode_kv(blocks: int = DECODE_BLOCKS, shape=BLOCK_SHAPE):
    return poisoned_kv(LAYERS, blocks, shape, POISON)


def assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks):
    for role in range(2):
        src = src_kv[layer][role].view(np.uint8)
        dst = dst_kv[layer][role].view(np.uint8)
        for s, d in zip(src_blocks, dst_blocks):
            assert np.array_equal(dst[d], src[s]), f"layer {layer} role {role}: decode block {d} != prefill block {s}"


def assert_poisoned(dst_kv, layer, blocks):
    for role in range(2):
        dst = dst_kv[layer][role].view(np.uint8)
        for b in blocks:
            assert (dst[b] == POISON).all(), f"layer {layer} role {role}: decode block {b} was written"


def connect(prefill, decode):
    """Exchanges metadata as bytes; returns (decode's peer id at the prefill, prefill's peer id at the decode)."""
    p_meta, d_meta = prefill.metadata(), decode.metadata()
    assert isinstance(p_meta, bytes) and isinstance(d_meta, bytes)
    return prefill.add_peer(d_meta), decode.add_peer(p_meta)


@pytest.fixture
def pair(request):
    """A connected (prefill, decode, src_kv, dst_kv, peer of decode, peer of prefill) on the loopback transport."""
    src_kv, dst_kv = prefill_kv(), decode_kv()
    p = Prefill(src_kv, transport="loopback", **FAST)
    d = Decode(dst_kv, transport="loopback", **FAST)
    to_decode, to_prefill = connect(p, d)
    yield p, d, src_kv, dst_kv, to_decode, to_prefill
    p.close()
    d.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_transfer_is_byte_exact(transport, mode):
    src_kv, dst_kv = prefill_kv(seed=11), decode_kv()
    src_blocks, dst_blocks = [5, 0, 7, 2], [9, 3, 0, 6]
    with Prefill(src_kv, peer_secret=SECRET, **TRANSPORTS[transport]) as p, \
            Decode(dst_kv, peer_secret=SECRET, **TRANSPORTS[transport]) as d:
        assert (p.num_blocks, d.num_blocks, p.num_layers) == (PREFILL_BLOCKS, DECODE_BLOCKS, LAYERS)
        assert p.block_bytes == LAYERS * 2 * 512
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 42, dst_blocks, mode=mode)
        p.begin(to_decode, 42, src_blocks)
        for layer in range(LAYERS):
            p.layer_ready(42, layer)
        st = d.wait(42, TIMEOUT, reclaimable=True)
        assert isinstance(st, DecodeStatus)
        assert st.final and st.reclaimable and st.error is None
        assert st.layers == ["loaded"] * LAYERS
        assert st.block_loaded == [True] * 4 and st.leading_loaded_blocks == 4
        pst = p.wait(42, TIMEOUT)
        assert isinstance(pst, PrefillStatus)
        assert pst.final and pst.done and pst.reclaimable and pst.error is None and pst.layers_sent == LAYERS
        # Each side's step times, on time.monotonic()'s clock, in the order the transfer took them.
        mover, now = (pst if mode == "push" else st).times, time.monotonic()
        assert st.times["started"] <= st.times["request"] <= pst.times["request"] <= mover["move"] <= mover["posted"] <= mover["moved"]
        assert pst.times["started"] <= pst.times["announced"] <= pst.times["final"] <= now
        assert st.times["request"] <= st.times["final"] <= pst.times["final"]
        untouched = sorted(set(range(DECODE_BLOCKS)) - set(dst_blocks))
        for layer in range(LAYERS):
            assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
            assert_poisoned(dst_kv, layer, untouched)
        d.forget(42)
        p.forget(42)
        with pytest.raises(kvtier.NotFoundError):
            d.status(42)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_layers_ready_in_one_call(pair, mode):
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    src_blocks, dst_blocks = [6, 4, 1], [2, 8, 5]
    with pytest.raises(kvtier.NotFoundError):
        p.layers_ready(12, range(LAYERS))
    d.start(to_prefill, 12, dst_blocks, mode=mode)
    p.begin(to_decode, 12, src_blocks)
    with pytest.raises(kvtier.OutOfRangeError, match=f"layers\\[1\\] = {LAYERS}"):
        p.layers_ready(12, [0, LAYERS])
    with pytest.raises(kvtier.AlreadyExistsError, match="listed twice"):
        p.layers_ready(12, [1, 1])
    for bad in (None, 3, "012"):  # a bare TypeError from a list comprehension before
        with pytest.raises(kvtier.InvalidArgumentError, match=f"layers {bad!r} is a {type(bad).__name__}, not a"):
            p.layers_ready(12, bad)
    assert d.status(12).layers == ["pending"] * LAYERS  # the refused calls declared nothing
    p.layers_ready(12, range(LAYERS))
    st = d.wait(12, TIMEOUT, reclaimable=True)
    assert st.error is None and st.leading_loaded_blocks == 3
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
    assert p.wait(12, TIMEOUT).done


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_layer_by_layer(pair, mode):
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    src_blocks, dst_blocks = [1, 2, 3], [4, 5, 6]
    d.start(to_prefill, 7, dst_blocks, mode=mode)
    p.begin(to_decode, 7, src_blocks)
    for layer in range(LAYERS):
        # Not declared ready yet: the layer does not arrive, the wait times out, nothing was written.
        with pytest.raises(kvtier.TimedOutError) as e:
            d.wait_layer(7, layer, timeout=0.05)
        assert isinstance(e.value, TimeoutError)
        assert d.status(7).layers[layer] == "pending"
        assert_poisoned(dst_kv, layer, dst_blocks)
        p.layer_ready(7, layer)
        assert d.wait_layer(7, layer, TIMEOUT) == "loaded"
        assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
        st = d.status(7)
        assert st.layers == ["loaded"] * (layer + 1) + ["pending"] * (LAYERS - layer - 1)
        # A block is loaded only when every layer of it is.
        assert st.block_loaded == [layer == LAYERS - 1] * 3
        for later in range(layer + 1, LAYERS):
            assert_poisoned(dst_kv, later, dst_blocks)
    assert d.wait(7, TIMEOUT, reclaimable=True).leading_loaded_blocks == 3
    assert p.wait(7, TIMEOUT).done


def test_waits_release_the_gil(pair):
    """The layers are declared ready by a Python thread while the main thread waits: only runs if the wait lets go."""
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    d.start(to_prefill, 3, [7, 8])
    p.begin(to_decode, 3, [2, 3])

    def declare():
        for layer in range(LAYERS):
            time.sleep(0.02)
            p.layer_ready(3, layer)

    t = threading.Thread(target=declare)
    t.start()
    assert d.wait_layer(3, LAYERS - 1, TIMEOUT) == "loaded"
    assert d.wait(3, TIMEOUT).leading_loaded_blocks == 2
    t.join()
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, [2, 3], [7, 8])


def test_layers_ready_before_the_decode_starts(pair):
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    p.begin(to_decode, 8, [6, 7])
    for layer in reversed(range(LAYERS)):  # any order
        p.layer_ready(8, layer)
    assert not p.status(8).final
    d.start(to_prefill, 8, [0, 1], mode="pull")
    assert d.wait(8, TIMEOUT).layers == ["loaded"] * LAYERS
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, [6, 7], [0, 1])


def test_a_begin_long_before_the_decodes_start_still_moves(pair):
    """The prefill's begin() three leases before the decode's start(): it used to fail the transfer as "decode side
    silent" and disconnect the decode; it waits for the request (request_wait_s), and a transfer whose request never
    comes fails alone after it."""
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    p.begin(to_decode, 21, [2, 3])
    p.layers_ready(21, range(LAYERS))
    time.sleep(3 * FAST["lease_s"])
    d.start(to_prefill, 21, [4, 5], mode="push")
    assert d.wait(21, TIMEOUT).layers == ["loaded"] * LAYERS
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, [2, 3], [4, 5])
    with Prefill(prefill_kv(), transport="loopback", request_wait_s=0.2, **FAST) as p2, \
            Decode(decode_kv(), transport="loopback", **FAST) as d2:
        to_d2, _ = connect(p2, d2)
        p2.begin(to_d2, 1, [0])
        st = p2.wait(1, TIMEOUT)
        assert not st.done and "no request from decode" in str(st.error)
    with pytest.raises(kvtier.InvalidArgumentError, match="request_wait"):
        Prefill(prefill_kv(), transport="loopback", request_wait_s=0)


def test_name_map_and_list_describe_the_same_layout():
    src_kv = prefill_kv()
    names = {}
    for layer, (k, v) in enumerate(src_kv):
        names[f"key_caches_{layer}_rank0.device0"] = k
        names[f"value_caches_{layer}_rank0.device0"] = v
    with Prefill(names, transport="loopback") as a, Prefill(src_kv, transport="loopback") as b:
        assert a.layout == b.layout and a.num_layers == LAYERS


# ---------------------------------------------------------------- errors


def test_bad_block_ids_are_refused(pair):
    p, d, _, dst_kv, to_decode, to_prefill = pair
    with pytest.raises(kvtier.OutOfRangeError, match=f"block id {DECODE_BLOCKS + 5} .* index 1"):
        d.start(to_prefill, 1, [0, DECODE_BLOCKS + 5])
    with pytest.raises(IndexError):  # OutOfRangeError is an IndexError too
        d.start(to_prefill, 1, [DECODE_BLOCKS])
    with pytest.raises(kvtier.OutOfRangeError, match="-3"):
        d.start(to_prefill, 2, [0, -3])
    with pytest.raises(kvtier.InvalidArgumentError, match="block id 4 repeated"):
        d.start(to_prefill, 2, [4, 4])
    with pytest.raises(kvtier.OutOfRangeError, match=f"block id {PREFILL_BLOCKS} .* source"):
        p.begin(to_decode, 3, [PREFILL_BLOCKS])
    with pytest.raises(kvtier.InvalidArgumentError, match="'sideways'"):
        d.start(to_prefill, 4, [0], mode="sideways")
    p.begin(to_decode, 5, [0])
    with pytest.raises(kvtier.OutOfRangeError, match="layer 99"):
        p.layer_ready(5, 99)
    for layer in range(LAYERS):
        assert_poisoned(dst_kv, layer, range(DECODE_BLOCKS))


def test_unknown_transfer_and_peer(pair):
    p, d, _, _, to_decode, to_prefill = pair
    with pytest.raises(kvtier.NotFoundError, match="12345"):
        d.status(12345)
    with pytest.raises(kvtier.NotFoundError, match="12345"):
        d.wait_layer(12345, 0, timeout=1.0)
    with pytest.raises(kvtier.NotFoundError, match="12345"):
        p.layer_ready(12345, 0)
    with pytest.raises(kvtier.NotFoundError, match="12345"):
        p.status(12345)
    # An unknown peer is refused at once, naming it, as begin() refuses one; nothing of the transfer is kept.
    with pytest.raises(kvtier.NotFoundError, match=str(to_prefill + 77)):
        d.start(to_prefill + 77, 6, [0])
    with pytest.raises(kvtier.NotFoundError, match="6"):
        d.status(6)


def test_transfer_id_reused(pair):
    p, d, _, _, to_decode, to_prefill = pair
    d.start(to_prefill, 9, [0])
    with pytest.raises(kvtier.AlreadyExistsError, match="9"):
        d.start(to_prefill, 9, [1])


def test_wrong_metadata_bytes():
    src_kv, dst_kv = prefill_kv(), decode_kv()
    with Prefill(src_kv, transport="loopback") as p, Decode(dst_kv, transport="loopback") as d:
        with pytest.raises(kvtier.KvtierError):
            d.add_peer(b"not a kvtier blob")
        with pytest.raises(kvtier.KvtierError):
            d.add_peer(b"")
        blob = bytearray(p.metadata())
        blob[len(blob) // 2] ^= 0xFF
        with pytest.raises(kvtier.DataLossError):
            d.add_peer(bytes(blob))
        with pytest.raises(kvtier.InvalidArgumentError, match="str"):
            d.add_peer("text")
    # Another per-block layout (another fingerprint): refused, naming both.
    with Prefill(prefill_kv(shape=(2, 16, 16)), transport="loopback") as p, \
            Decode(dst_kv, transport="loopback") as d:
        with pytest.raises(kvtier.FailedPreconditionError, match="fingerprint"):
            d.add_peer(p.metadata())


def test_peer_secret():
    src_kv, dst_kv = prefill_kv(), decode_kv()
    with Prefill(src_kv, transport="loopback", peer_secret=SECRET) as p, \
            Decode(dst_kv, transport="loopback") as d, \
            Decode(decode_kv(), transport="loopback", peer_secret=bytes(32)) as other:
        with pytest.raises(kvtier.FailedPreconditionError, match="peer_secret"):
            d.add_peer(p.metadata())  # a MAC'd blob at an agent without the secret
        with pytest.raises(kvtier.FailedPreconditionError, match="authentication"):
            other.add_peer(p.metadata())  # another secret
        with pytest.raises(kvtier.FailedPreconditionError, match="no MAC"):
            p.add_peer(d.metadata())  # a blob without a MAC at an agent with a secret
    with pytest.raises(kvtier.InvalidArgumentError):
        Prefill(src_kv, transport="loopback", peer_secret=b"short")
    # An empty secret (an unset variable read as b"") is not "no secret": it was taken as none, and such an endpoint
    # paired with one that has no secret at all.
    for empty in (b"", bytearray(), memoryview(b"")):
        with pytest.raises(kvtier.InvalidArgumentError, match="peer_secret is empty"):
            Decode(dst_kv, transport="loopback", peer_secret=empty)


def test_timeouts(pair):
    p, d, _, _, to_decode, to_prefill = pair
    d.start(to_prefill, 10, [0, 1])
    p.begin(to_decode, 10, [0, 1])
    t0 = time.monotonic()
    with pytest.raises(kvtier.TimedOutError):
        d.wait(10, timeout=0.1)
    with pytest.raises(kvtier.TimedOutError):
        p.wait(10, timeout=0.1)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(kvtier.FailedPreconditionError, match="10"):
        d.forget(10)  # not final
    with pytest.raises(ValueError):
        d.wait(10, timeout=float("nan"))
    # A deadline already passed only looks, however far back; the message does not show an overflowed count.
    for gone in (-1e300, float("-inf"), -9.3e9):
        with pytest.raises(kvtier.TimedOutError, match=r"after 0 ms"):
            d.wait(10, timeout=gone)


def test_dead_prefill_fails_the_transfer(pair):
    p, d, _, dst_kv, to_decode, to_prefill = pair
    d.start(to_prefill, 11, [2, 3], mode="push")
    p.begin(to_decode, 11, [0, 1])
    p.layer_ready(11, 0)
    assert d.wait_layer(11, 0, TIMEOUT) == "loaded"
    p.close()  # the prefill goes away with layers 1.. not sent
    st = d.wait(11, TIMEOUT, reclaimable=True)
    assert st.final and st.reclaimable
    assert st.layers[0] == "loaded" and set(st.layers[1:]) == {"failed"}
    assert st.block_loaded == [False, False] and st.leading_loaded_blocks == 0
    assert isinstance(st.error, kvtier.KvtierError) and st.error.message
    assert d.wait_layer(11, 1, TIMEOUT) == "failed"
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        p.begin(to_decode, 12, [0])
    d.forget(11)


def test_close_while_another_thread_waits(pair):
    """close() wakes a wait in flight on another thread (even one without a deadline), tears the endpoint down before
    it returns, and the peer's transfer fails: before, the wait kept the endpoint, which went on receiving, until
    the wait returned by itself (never, without a timeout)."""
    p, d, _, _, to_decode, to_prefill = pair
    d.start(to_prefill, 13, [0])
    p.begin(to_decode, 13, [0])  # no layer is ever declared ready
    outcome = []

    def waiter():
        try:
            d.wait(13, timeout=None)
        except kvtier.KvtierError as e:
            outcome.append(e)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.2)
    began = time.monotonic()
    d.close()
    t.join(TIMEOUT)
    assert not t.is_alive() and time.monotonic() - began < 5
    assert len(outcome) == 1
    assert isinstance(outcome[0], kvtier.FailedPreconditionError) and "clos" in outcome[0].message, outcome
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        d.status(13)
    assert d.num_blocks == DECODE_BLOCKS  # the description outlives close()
    # The decode is gone: the prefill's transfer ends failed, and nothing it declares later lands anywhere.
    s = p.wait(13, TIMEOUT)
    assert s.final and not s.done and s.error is not None


@pytest.mark.parametrize("transport", ["ipc", "ucx-tcp"])
def test_a_restarted_peer_with_the_same_name_is_added_again(transport):
    """A prefill with a stable name (a pod's) that restarted while no transfer was in flight could never be added
    again ("already loaded"): the decode had to be recreated. Its new metadata now replaces the old incarnation;
    the same metadata twice is still refused."""
    dst_kv = decode_kv()
    with Decode(dst_kv, name="decode-stable", **TRANSPORTS[transport], **FAST) as d:
        for incarnation in range(3):
            src_kv = prefill_kv(seed=20 + incarnation)
            with Prefill(src_kv, name="prefill-stable", **TRANSPORTS[transport], **FAST) as p:
                to_decode, to_prefill = connect(p, d)
                with pytest.raises(kvtier.AlreadyExistsError, match="already loaded"):
                    d.add_peer(p.metadata())
                d.start(to_prefill, 30 + incarnation, [incarnation])
                p.begin(to_decode, 30 + incarnation, [2])
                p.layers_ready(30 + incarnation, range(LAYERS))
                assert d.wait(30 + incarnation, TIMEOUT, reclaimable=True).leading_loaded_blocks == 1
                for layer in range(LAYERS):
                    assert_layer_moved(src_kv, dst_kv, layer, [2], [incarnation])
                d.forget(30 + incarnation)
                p.wait(30 + incarnation, TIMEOUT)


def test_blocks_of_another_shape_or_rank_are_refused_at_pairing():
    """A prefill in HND order paired with a decode in NHD order (as many bytes per block), or rank 0 with rank 1,
    was accepted and every block reported loaded: bytes of another meaning, committed as verified."""
    def kv(shape):
        return [tuple(np.zeros((4,) + shape, np.float16) for _ in range(2)) for _ in range(2)]
    for pkw, dkw, pshape, dshape in (({}, {}, (8, 64, 128), (64, 8, 128)),
                                     (dict(rank=0), dict(rank=1), (8, 64, 128), (8, 64, 128))):
        with Prefill(kv(pshape), transport="loopback", **pkw) as p, \
                Decode(kv(dshape), transport="loopback", **dkw) as d:
            with pytest.raises(kvtier.FailedPreconditionError, match="per-block tensor shape or tensor-parallel rank"):
                d.add_peer(p.metadata())
            with pytest.raises(kvtier.FailedPreconditionError, match="fingerprint"):
                p.add_peer(d.metadata())
    # The same shape and rank pair as before.
    with Prefill(kv((8, 64, 128)), transport="loopback", rank=1) as p, \
            Decode(kv((8, 64, 128)), transport="loopback", rank=1) as d:
        connect(p, d)


def test_bad_arguments():
    src_kv = prefill_kv()
    with pytest.raises(kvtier.InvalidArgumentError, match="'carrier-pigeon'"):
        Prefill(src_kv, transport="carrier-pigeon")
    with pytest.raises(kvtier.InvalidArgumentError, match="kv"):
        Prefill([], transport="loopback")
    with pytest.raises(kvtier.InvalidArgumentError, match=r"kv\[1\]"):
        Prefill([src_kv[0], (src_kv[1][0], src_kv[1][1], src_kv[1][0])], transport="loopback")
    with pytest.raises(kvtier.InvalidArgumentError, match="lease"):
        Prefill(src_kv, transport="loopback", lease_s=0)
    # A name refused for its length is not repeated whole in the error (it was 100 KB long).
    with pytest.raises(kvtier.InvalidArgumentError) as long_name:
        Prefill(src_kv, transport="loopback", name="a" * 100000)
    assert len(str(long_name.value)) < 1000 and "100000 bytes" in str(long_name.value)
    with Prefill(src_kv, transport="loopback") as p, Decode(decode_kv(), transport="loopback") as d:
        to_decode, to_prefill = connect(p, d)
        # Each was nanobind's "incompatible function arguments", naming neither the argument nor the value; a set's
        # order would pair source and destination blocks arbitrarily.
        with pytest.raises(kvtier.InvalidArgumentError, match="mode None is not 'push' or 'pull'"):
            d.start(to_prefill, 2, [0], mode=None)
        with pytest.raises(kvtier.InvalidArgumentError, match="reclaimable 'yes' is a str, not a bool"):
            d.wait(2, 0.1, reclaimable="yes")
        with pytest.raises(kvtier.InvalidArgumentError, match="ordered"):
            d.start(to_prefill, 3, {9, 3, 5})
        with pytest.raises(kvtier.InvalidArgumentError, match="ordered"):
            p.begin(to_decode, 3, {1: 0, 2: 0})
    with Decode(decode_kv(), transport="loopback") as d:
        with pytest.raises(kvtier.InvalidArgumentError, match="without a device"):
            d.wait_layer_on_stream(1, 0, kvtier.host_device().create_stream())
    with Prefill(src_kv, transport="loopback") as p:
        with pytest.raises(kvtier.InvalidArgumentError, match="without a device"):
            p.layer_ready(1, 0, stream=0x1234)  # an engine's stream handle, but the KV is host memory
        with pytest.raises(kvtier.InvalidArgumentError, match="transfer id -1"):
            p.begin(0, -1, [0])
    with Prefill(src_kv, transport="loopback", device=kvtier.host_device()) as p:
        with pytest.raises(kvtier.InvalidArgumentError, match="'not a stream'"):
            p.layer_ready(1, 0, stream="not a stream")


def test_ids_layers_and_counts_must_be_integers_in_range(pair):
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    # int() would take 7.9 as transfer 7, 2.7 as block 2 and True as 1: each is refused, naming it.
    for call, named in [(lambda: d.start(to_prefill, 7.9, [2]), "transfer id 7.9 is a float"),
                        (lambda: d.start(to_prefill, 7, [2.7]), "destination block id at index 0: 2.7 is a float"),
                        (lambda: p.begin(to_decode, 7, [1, True]), "source block id at index 1: True is a bool"),
                        (lambda: p.layer_ready(7, 0.99), "layer 0.99 is a float"),
                        (lambda: d.status(True), "transfer id True is a bool"),
                        (lambda: d.forget("7"), "transfer id '7' is a str"),
                        # a bool waited True as 1 s, False as 0 s; a string raised nanobind's unnamed TypeError
                        (lambda: d.wait(7, timeout=True), "timeout True is a bool"),
                        (lambda: p.wait(7, timeout="0.5"), "timeout '0.5' is a str"),
                        (lambda: d.wait_layer(7, 0, timeout=False), "timeout False is a bool")]:
        with pytest.raises(kvtier.InvalidArgumentError, match=named):
            call()
    # Values the native layer cannot take are named too (nanobind's own TypeError names nothing).
    for call, named in [(lambda: p.begin(-1, 1, [0]), r"peer -1 is not in \[0, 4294967295\]"),
                        (lambda: d.start(to_prefill, 2**63, [0]), "transfer id 9223372036854775808"),
                        (lambda: p.begin(to_decode, 1, [2**63]), "source block id 9223372036854775808 at index 0"),
                        (lambda: d.wait_layer(1, 2**64), "layer 18446744073709551616")]:
        with pytest.raises(kvtier.OutOfRangeError, match=named):
            call()
    # numpy integers are integers; nothing above declared or started anything.
    d.start(to_prefill, np.int64(7), [np.uint32(2)])
    p.begin(to_decode, np.int32(7), [np.int64(1)])
    p.layers_ready(7, range(LAYERS))
    st = d.wait(7, TIMEOUT, reclaimable=True)
    assert st.leading_loaded_blocks == 1
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, [1], [2])


def test_tensors_and_names_the_native_layer_cannot_take_are_named():
    src_kv = prefill_kv()
    ro = src_kv[0][0].copy()
    ro.flags.writeable = False
    with pytest.raises(kvtier.InvalidArgumentError, match=r"tensor 'key_caches_0_rank0.device0' is read-only"):
        Prefill([(ro, src_kv[0][1])] + src_kv[1:], transport="loopback")
    with pytest.raises(kvtier.InvalidArgumentError, match=r"'value_caches_1_rank0.device0' is a list"):
        Prefill([src_kv[0], (src_kv[1][0], [1, 2])], transport="loopback")
    with pytest.raises(kvtier.InvalidArgumentError, match=r"dtype object"):
        Prefill([(src_kv[0][0], np.empty((8, 4), dtype=object))], transport="loopback")
    with pytest.raises(kvtier.OutOfRangeError, match="block_tokens 1099511627776"):
        Prefill(src_kv, transport="loopback", block_tokens=2**40)
    with pytest.raises(kvtier.OutOfRangeError, match="num_model_layers -1"):
        Prefill(src_kv, transport="loopback", num_model_layers=-1)
    # A name every peer would refuse in the metadata is refused here, at creation.
    for transport in ("loopback", "ipc"):
        for name in ["x" * 300, "a\nb", "na\u00efve"]:
            with pytest.raises(kvtier.InvalidArgumentError, match="agent name"):
                Prefill(src_kv, transport=transport, name=name)


def test_one_ucx_in_the_process():
    # The wheel carries its own UCX; the system's UCX modules (linked against the system's UCX) must not load beside
    # it (two UCX libraries in one process: a crash seen once in UCX's endpoint close).
    code = ("import numpy as np\nfrom kvtier.pd import Decode, Prefill\n"
            "kv = [(np.zeros((4, 256), np.float16), np.zeros((4, 256), np.float16))]\n"
            "p = Prefill(kv, transport='ucx', tls='tcp', net_devices='lo')\n"
            "d = Decode([(np.zeros((4, 256), np.float16), np.zeros((4, 256), np.float16))], transport='ucx', "
            "tls='tcp', net_devices='lo')\n"
            "to_d, to_p = p.add_peer(d.metadata()), d.add_peer(p.metadata())\n"
            "d.start(to_p, 1, [0]); p.begin(to_d, 1, [3]); p.layers_ready(1, [0])\n"
            "assert d.wait(1, 10, reclaimable=True).leading_loaded_blocks == 1\n"
            "print('\\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if '/libucs' in l})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "UCX_MODULE_DIR"})
    assert out.returncode == 0, out.stderr
    libs = [line for line in out.stdout.splitlines() if line]
    assert len(libs) == 1, f"UCX libraries loaded: {libs}"


def test_a_block_still_held_by_another_transfer_is_refused(pair):
    # Two transfers into one decode block would each verify their own bytes and both report the block loaded while
    # it holds one prefill's data: the second start is refused until the first is forgotten.
    p, d, src_kv, dst_kv, to_decode, to_prefill = pair
    d.start(to_prefill, 1, [0, 3])
    with pytest.raises(kvtier.FailedPreconditionError, match="destination block 3 at index 0 belongs to transfer 1"):
        d.start(to_prefill, 2, [3])
    p.begin(to_decode, 1, [5, 6])
    p.layers_ready(1, range(LAYERS))
    assert d.wait(1, TIMEOUT, reclaimable=True).leading_loaded_blocks == 2
    d.forget(1)
    p.wait(1, TIMEOUT)
    p.forget(1)
    d.start(to_prefill, 2, [3], mode="pull")
    p.begin(to_decode, 2, [7])
    p.layers_ready(2, range(LAYERS))
    assert d.wait(2, TIMEOUT, reclaimable=True).leading_loaded_blocks == 1
    for layer in range(LAYERS):
        assert_layer_moved(src_kv, dst_kv, layer, [5, 7], [0, 3])


# ---------------------------------------------------------------- staged (a Device: its memory, its streams)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_staged_on_the_host_backend_with_streams(mode):
    dev = kvtier.host_device()
    fwd = dev.create_stream("forward")
    src_kv, dst_kv = prefill_kv(seed=5), decode_kv()
    src_blocks, dst_blocks = [3, 4, 0], [8, 1, 2]
    with Prefill(src_kv, transport="loopback", device=dev, **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, staging_blocks=4, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, dst_blocks, mode=mode)
        p.begin(to_decode, 1, src_blocks)
        for layer in range(LAYERS):
            p.layer_ready(1, layer, stream=fwd)  # ready once the forward's work so far completed
        for layer in range(LAYERS):
            d.wait_layer_on_stream(1, layer, fwd, TIMEOUT)  # the forward's stream waits on the device
            assert d.wait_layer(1, layer, TIMEOUT) == "loaded"
        dev.synchronize(fwd, TIMEOUT)
        st = d.wait(1, TIMEOUT, reclaimable=True)
        assert st.leading_loaded_blocks == 3 and st.error is None
        for layer in range(LAYERS):
            assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
            assert_poisoned(dst_kv, layer, [0, 3, 4, 5, 6, 7, 9])
        # A stream of another Device is refused, naming the stream.
        other = kvtier.host_device().create_stream("elsewhere")
        with pytest.raises(kvtier.InvalidArgumentError, match=f"stream {other.id} belongs to another"):
            d.wait_layer_on_stream(1, 0, other, TIMEOUT)
        # 3 of 4 staging blocks are taken until forget(): a second transfer of 2 blocks is refused.
        with pytest.raises(kvtier.ResourceExhaustedError):
            d.start(to_prefill, 2, [5, 6], mode=mode)
        assert p.wait(1, TIMEOUT).done
        d.forget(1)
        p.forget(1)


@pytest.mark.parametrize("verify,read_back", [("mover", "copy"), ("mover", "pass"), ("receiver", "copy")])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_direct_lane_on_the_host_backend(mode, verify, read_back):
    """lane="direct": the copy kernel moves each layer between the pools (loopback maps the peer's pool here),
    with either side making the second checksum pass, the mover inside its copy or in a pass of its own."""
    dev = kvtier.host_device()
    fwd = dev.create_stream("forward")
    src_kv, dst_kv = prefill_kv(seed=6), decode_kv()
    src_blocks, dst_blocks = [7, 2, 5, 0], [3, 9, 1, 6]
    lane = dict(lane="direct", verify=verify, read_back=read_back)
    with Prefill(src_kv, transport="loopback", device=dev, **lane, **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **lane, **FAST) as d:
        assert p.lane == "direct" and d.lane == "direct"
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, dst_blocks, mode=mode)
        p.begin(to_decode, 1, src_blocks)
        p.layer_ready(1, 1, stream=fwd)
        assert d.wait_layer(1, 1, TIMEOUT) == "loaded"
        assert_layer_moved(src_kv, dst_kv, 1, src_blocks, dst_blocks)
        assert_poisoned(dst_kv, 0, dst_blocks)  # layer 0 was never declared ready
        for layer in (0, 2):
            p.layer_ready(1, layer)
            d.wait_layer_on_stream(1, layer, fwd, TIMEOUT)
        st = d.wait(1, TIMEOUT, reclaimable=True)
        assert st.leading_loaded_blocks == 4 and st.error is None, st
        for layer in range(LAYERS):
            assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
            assert_poisoned(dst_kv, layer, [0, 2, 4, 5, 7, 8])
        assert p.wait(1, TIMEOUT).done
        d.forget(1)
        p.forget(1)


@pytest.mark.parametrize("ring_copy", ["auto", "sm_kernel"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ring_lane_on_the_host_backend(mode, ring_copy):
    """lane="ring": each layer goes through the decode's shared ring (2 slots of 2 blocks: 2 pieces per layer of 4
    blocks, more pieces than slots), byte-exact, the destinations outside the list untouched."""
    dev = kvtier.host_device()
    src_kv, dst_kv = prefill_kv(seed=7), decode_kv()
    src_blocks, dst_blocks = [7, 2, 5, 0], [3, 9, 1, 6]
    ring = dict(lane="ring", ring_slots=2, ring_slot_bytes=2 * 2 * 512, ring_copy=ring_copy)
    with Prefill(src_kv, transport="loopback", device=dev, **ring, **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **ring, **FAST) as d:
        assert p.lane == "ring" and d.lane == "ring"
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, dst_blocks, mode=mode)
        p.begin(to_decode, 1, src_blocks)
        for layer in (2, 0, 1):
            p.layer_ready(1, layer)
        for layer in range(LAYERS):
            assert d.wait_layer(1, layer, TIMEOUT) == "loaded"
        st = d.wait(1, TIMEOUT, reclaimable=True)
        assert st.leading_loaded_blocks == 4 and st.error is None, st
        for layer in range(LAYERS):
            assert_layer_moved(src_kv, dst_kv, layer, src_blocks, dst_blocks)
            assert_poisoned(dst_kv, layer, [0, 2, 4, 5, 7, 8])
        assert p.wait(1, TIMEOUT).done
        d.forget(1)
        p.forget(1)


def test_ring_lane_refusals():
    src_kv = prefill_kv()
    dev = kvtier.host_device()
    with pytest.raises(kvtier.InvalidArgumentError, match="lane 'ring' moves device memory"):
        Prefill(src_kv, transport="loopback", lane="ring")
    with pytest.raises(kvtier.InvalidArgumentError, match="not ucx"):
        Prefill(src_kv, transport="ucx", device=dev, lane="ring")
    with pytest.raises(kvtier.InvalidArgumentError, match="ring_copy"):
        Decode(decode_kv(), transport="loopback", device=dev, lane="ring", ring_copy="teleport")
    with pytest.raises(kvtier.InvalidArgumentError, match="ring slot of 100 bytes"):
        Decode(decode_kv(), transport="loopback", device=dev, lane="ring", ring_slot_bytes=100)


def test_direct_lane_verify_must_be_known():
    dev = kvtier.host_device()
    with pytest.raises(kvtier.InvalidArgumentError,
                       match=r"unknown lane verify 'both' \(expected one of mover, receiver\)"):
        Decode(decode_kv(), transport="loopback", device=dev, lane="direct", verify="both", **FAST)
    with pytest.raises(kvtier.InvalidArgumentError, match=r"read_back 'later' is not copy or pass"):
        Prefill(prefill_kv(), transport="loopback", device=dev, lane="direct", read_back="later", **FAST)


def test_direct_lane_refusals():
    src_kv = prefill_kv()
    with pytest.raises(kvtier.InvalidArgumentError, match="device="):
        Prefill(src_kv, transport="loopback", lane="direct")
    with pytest.raises(kvtier.InvalidArgumentError, match="not ucx"):
        Prefill(src_kv, transport="ucx", device=kvtier.host_device(), lane="direct")
    with pytest.raises(kvtier.InvalidArgumentError, match="lane 'sideways'"):
        Prefill(src_kv, transport="loopback", lane="sideways")
    # A decode on the direct lane and a prefill staging through host memory: the transfer is refused, no block
    # loaded.
    dev = kvtier.host_device()
    dst_kv = decode_kv()
    with Prefill(src_kv, transport="loopback", device=dev, **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, lane="direct", **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, [0, 1], mode="push")
        p.begin(to_decode, 1, [2, 3])
        for layer in range(LAYERS):
            p.layer_ready(1, layer)
        st = d.wait(1, TIMEOUT)
        assert st.leading_loaded_blocks == 0 and st.error is not None


def test_a_default_stream_handle_of_zero_is_a_stream():
    """torch's default stream has cuda_stream == 0 (the legacy default stream): it is a stream, not "no stream".
    On the host backend adopting it is then refused as the backend has no native streams (on CUDA it is adopted)."""

    class DefaultStream:  # what torch.cuda.default_stream() looks like to kvtier
        cuda_stream = 0

    dev = kvtier.host_device()
    with Prefill(prefill_kv(), transport="loopback", device=dev, **FAST) as p:
        with pytest.raises(kvtier.KvtierError) as e:
            p.layer_ready(1, 0, stream=DefaultStream())
        assert "is not a kvtier Stream" not in str(e.value), str(e.value)
        assert "native streams" in str(e.value), str(e.value)


def test_stream_handles_that_are_not_handles_are_named():
    """stream=True was taken as handle 1 (cudaStreamLegacy on CUDA: silently another stream than the engine's), and a
    negative or too large handle raised nanobind's TypeError naming nothing."""
    dev = kvtier.host_device()
    with Prefill(prefill_kv(), transport="loopback", device=dev, **FAST) as p:
        with pytest.raises(kvtier.InvalidArgumentError, match="stream True is a bool"):
            p.layer_ready(1, 0, stream=True)
        for bad in (-1, 1 << 70):
            with pytest.raises(kvtier.InvalidArgumentError, match=f"stream handle {bad} is not a CUDA stream handle"):
                p.layer_ready(1, 0, stream=bad)


# ---------------------------------------------------------------- two processes (ipc)


def _prefill_process(conn, mode_seed):
    """The prefill in its own process: metadata over the pipe, then every layer declared ready."""
    import kvtier.pd

    try:
        with kvtier.pd.Prefill(prefill_kv(seed=mode_seed), transport="ipc", peer_secret=SECRET, **FAST) as p:
            conn.send_bytes(p.metadata())
            if not conn.poll(TIMEOUT):
                conn.send(("error", "no metadata from the decode process"))
                return
            peer = p.add_peer(conn.recv_bytes())
            p.begin(peer, 500, [7, 1, 4])
            for layer in range(LAYERS):
                p.layer_ready(500, layer)
            st = p.wait(500, TIMEOUT)
            conn.send(("done", st.done, st.layers_sent))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(e)))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_processes_over_ipc(mode):
    seed = 100 + (mode == "pull")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_process, args=(child, seed), daemon=True)
    proc.start()
    try:
        dst_kv = decode_kv()
        with Decode(dst_kv, transport="ipc", peer_secret=SECRET, **FAST) as d:
            assert parent.poll(30), "the prefill process sent no metadata"
            peer = d.add_peer(parent.recv_bytes())
            parent.send_bytes(d.metadata())
            d.start(peer, 500, [0, 9, 5], mode=mode)
            st = d.wait(500, TIMEOUT, reclaimable=True)
            assert st.error is None and st.leading_loaded_blocks == 3, st
            assert parent.poll(TIMEOUT)
            assert parent.recv() == ("done", True, LAYERS)
            src_kv = prefill_kv(seed=seed)
            for layer in range(LAYERS):
                assert_layer_moved(src_kv, dst_kv, layer, [7, 1, 4], [0, 9, 5])
                assert_poisoned(dst_kv, layer, [1, 2, 3, 4, 6, 7, 8])
            d.forget(500)
    finally:
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


# ------------------------------------------------------------------ receives through the cache (kvtier.pd.Receiver)

needs_cache = pytest.mark.skipif(not kvtier._native.has_cache, reason="built without the cache bindings")


def receiver_rig(dst_kv, host_blocks: int = 4):
    """The decode side's TransferManager (host backend) over dst_kv and a CacheManager of as many blocks."""
    dev = kvtier.host_device()
    compute = dev.create_stream("compute")
    names = kvtier.pd._name_map(dst_kv, 0, 0)
    tm = kvtier.TransferManager.from_tensors(dev, compute, names, None, host_blocks, LAYERS)
    cache = kvtier.CacheManager(device_blocks=DECODE_BLOCKS, host_blocks=host_blocks)
    return dev, tm, cache


def chain(n: int, salt: int = 0):
    return [f"{salt:016x}{i + 1:016x}" for i in range(n)]


@needs_cache
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_receiver_guards_awaits_and_commits_a_prompt(mode):
    """Blocks being received are neither reused by the cache nor loaded into by the TransferManager; the forward's
    per-layer waits pass as layers arrive; what arrived verified joins the prefix index and serves a later request."""
    src_kv, dst_kv = prefill_kv(seed=11), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    src_blocks, keys = [6, 1, 4, 3], chain(4)
    with Prefill(src_kv, transport="loopback", **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        rx = Receiver(cache, tm, d, receive_timeout=TIMEOUT)
        r = rx.start(to_prefill, 7, keys, mode)
        a = r.admission
        blocks = a["device_blocks"][a["receive_begin"]:a["receive_begin"] + a["receive_blocks"]]
        assert len(blocks) == 4 and rx.active == 1
        # Nothing sent yet: the forward's wait does not pass, and the blocks are not the cache's to reuse.
        with pytest.raises(kvtier.TimedOutError):
            tm.wait_layer_host(r.task, 0, 0.05)
        with pytest.raises(kvtier.ResourceExhaustedError):
            cache.admit(chain(DECODE_BLOCKS - 3, salt=9), 0)  # needs a receive block
        with pytest.raises(kvtier.KvtierError):
            tm.wait(tm.load([0], [0], [blocks[0]]), TIMEOUT)  # a load into a block being received is refused
        p.begin(to_decode, 7, src_blocks)
        for layer in range(LAYERS):
            p.layer_ready(7, layer)
            tm.wait_layer_host(r.task, layer, TIMEOUT)
            assert_layer_moved(src_kv, dst_kv, layer, src_blocks, blocks)
        out = rx.finish(7, TIMEOUT)
        assert out.loaded_blocks == 4 and out.error is None and out.reclaimable, out
        assert out.transfer.leading_loaded_blocks == 4
        m = cache.match(keys)
        assert m["device_blocks"] == 4 and list(m["device_ids"]) == list(blocks)
        cache.release(a["id"])
        assert p.wait(7, TIMEOUT).done
        st = rx.stats()
        assert st["started"] == 1 and st["completed"] == 1 and st["committed_blocks"] == 4
        with pytest.raises(kvtier.FailedPreconditionError, match="receiver"):
            tm.close()  # the receiver drives it
        rx.close()
        rx.close()
    tm.close()


@needs_cache
def test_a_receive_that_landed_is_committed_when_the_receiver_closes():
    """close() before poll() dropped a landed receive: its admission stayed 'receiving', release() quarantined its
    blocks for good and reset() was refused for the cache's life."""
    src_kv, dst_kv = prefill_kv(seed=12), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    keys = chain(4, salt=3)
    with Prefill(src_kv, transport="loopback", **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        rx = Receiver(cache, tm, d, receive_timeout=TIMEOUT)
        r = rx.start(to_prefill, 9, keys, "push")
        p.begin(to_decode, 9, [0, 1, 2, 3])
        p.layers_ready(9, range(LAYERS))
        tm.wait(r.task, TIMEOUT)
        assert p.wait(9, TIMEOUT).done
        blocks = r.admission["device_blocks"][r.admission["receive_begin"]:]
        deadline = time.monotonic() + TIMEOUT
        # The receiver's reporter ended it (quiescent: the data plane released the blocks).
        while not all(tm.is_device_block_free(b) for b in blocks) and time.monotonic() < deadline:
            time.sleep(0.01)
        rx.close()  # no poll() or finish() before
        st = cache.admission_status(r.admission["id"])
        assert st["receiving_blocks"] == 0 and st["quarantined_blocks"] == 0, st
        cache.release(r.admission["id"])
        assert cache.match(keys)["device_blocks"] == 4
        stats = cache.stats()
        assert stats["received_committed_blocks"] == 4 and stats["quarantined_device_blocks"] == 0, stats
        cache.check_invariants()
        cache.reset()
    tm.close()


@needs_cache
def test_receiver_refuses_a_storage_tier_and_negative_ids():
    """A cache with a storage tier was taken: its first plan with a storage move failed the receive and stayed in
    flight for good. A negative transfer id raised nanobind's unnamed TypeError."""
    src_kv, dst_kv = prefill_kv(seed=13), decode_kv()
    dev, tm, _ = receiver_rig(dst_kv)
    stored = kvtier.CacheManager(device_blocks=DECODE_BLOCKS, host_blocks=4, storage_blocks=16)
    with Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        with pytest.raises(kvtier.InvalidArgumentError, match="storage tier"):
            Receiver(stored, tm, d)
        _, _, cache = receiver_rig(dst_kv)
        with Receiver(cache, tm, d, receive_timeout=TIMEOUT) as rx:
            with pytest.raises(kvtier.OutOfRangeError, match="transfer id -1"):
                rx.start(0, -1, chain(2), "push")
            with pytest.raises(kvtier.OutOfRangeError, match="transfer id -1"):
                rx.finish(-1, 0.1)
            with pytest.raises(kvtier.InvalidArgumentError, match="key 5 at index 1 is a int"):
                rx.start(0, 1, [chain(1)[0], 5], "push")
            with pytest.raises(kvtier.InvalidArgumentError, match="mode 'sideways'"):
                rx.start(0, 1, chain(2), "sideways")
            with pytest.raises(kvtier.InvalidArgumentError, match="match_prefix 'no' is a str"):
                rx.start(0, 1, chain(2), "push", match_prefix="no")
    tm.close()


@needs_cache
def test_closing_a_receiver_with_a_receive_open_gives_its_blocks_back():
    """close() with a receive open declared its blocks for good: the transfer ended and was reclaimable, yet they
    stayed quarantined in the cache (4 of its 10 blocks lost for the cache's life). The receive is now cancelled
    and its blocks return once the peer can write them no more."""
    src_kv, dst_kv = prefill_kv(seed=15), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    keys = chain(4, salt=5)
    with Prefill(src_kv, transport="loopback", **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        rx = Receiver(cache, tm, d, receive_timeout=TIMEOUT)
        r = rx.start(to_prefill, 4, keys, "push")
        p.begin(to_decode, 4, [0, 1, 2, 3])
        p.layer_ready(4, 0)
        tm.wait_layer_host(r.task, 0, TIMEOUT)
        rx.close()  # layers 1 and 2 never sent
        s = p.wait(4, TIMEOUT)
        assert s.final and not s.done and s.error is not None  # the prefill was told
        cache.release(r.admission["id"])
        st = cache.stats()
        assert st["quarantined_device_blocks"] == 0 and st["receiving_device_blocks"] == 0, st
        assert cache.match(keys)["device_blocks"] == 0  # nothing of the cancelled receive joined the index
        a = cache.admit(chain(DECODE_BLOCKS, salt=6), 0)  # every device block is the cache's again
        assert len(a["device_blocks"]) == DECODE_BLOCKS
        cache.check_invariants()
        cache.release(a["id"])
    tm.close()


@needs_cache
def test_a_receivers_wait_holds_neither_the_cache_nor_close():
    """finish() and drain() held the cache's lock and the receiver's mutex for their whole wait: the scheduler's
    other cache calls waited the full timeout, and close() from another thread until the receive timed out."""
    import threading
    src_kv, dst_kv = prefill_kv(seed=16), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    with Prefill(src_kv, transport="loopback", **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        rx = Receiver(cache, tm, d, receive_timeout=TIMEOUT)
        r = rx.start(to_prefill, 5, chain(3, salt=7), "push")
        p.begin(to_decode, 5, [0, 1, 2])  # no layer ready yet
        outcome = []

        def wait(call):
            try:
                outcome.append(call())
            except kvtier.KvtierError as e:
                outcome.append(e)

        t = threading.Thread(target=wait, args=(lambda: rx.finish(5, 2.0),))
        t.start()
        time.sleep(0.1)
        began = time.monotonic()
        cache.match(chain(1, salt=8))
        assert time.monotonic() - began < 0.5, "a cache call waited behind finish()"
        t.join(TIMEOUT)
        assert isinstance(outcome[-1], kvtier.TimedOutError) and "not ended after 2000 ms" in outcome[-1].message
        t = threading.Thread(target=wait, args=(lambda: rx.finish(5, None),))
        t.start()
        time.sleep(0.1)
        began = time.monotonic()
        rx.close()
        t.join(TIMEOUT)
        assert not t.is_alive() and time.monotonic() - began < 5
        assert isinstance(outcome[-1], kvtier.FailedPreconditionError) and "closed" in outcome[-1].message
        cache.release(r.admission["id"])
        assert cache.stats()["quarantined_device_blocks"] == 0
    tm.close()


@needs_cache
def test_receiver_commits_only_what_arrived_when_the_prefill_dies():
    src_kv, dst_kv = prefill_kv(seed=12), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    keys = chain(4, salt=1)
    p = Prefill(src_kv, transport="loopback", **FAST)
    with Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        with Receiver(cache, tm, d, receive_timeout=TIMEOUT) as rx:
            r = rx.start(to_prefill, 3, keys, "push")
            p.begin(to_decode, 3, [0, 1, 2, 3])
            p.layer_ready(3, 0)
            tm.wait_layer_host(r.task, 0, TIMEOUT)
            p.close()  # gone before layers 1 and 2
            out = rx.finish(3, TIMEOUT)
            assert out.loaded_blocks == 0 and out.error is not None, out
            assert cache.match(keys)["device_blocks"] == 0  # nothing joined the index
            with pytest.raises(kvtier.KvtierError):
                tm.wait(r.task, TIMEOUT)  # the receive's task failed: never reported loaded
            rx.drain(TIMEOUT)
            assert rx.quarantined == 0
            cache.release(r.admission["id"])
    tm.close()


@needs_cache
def test_blocks_of_a_failed_receive_store_what_the_engine_computes_there_later():
    """A failed receive's blocks kept its failure on the data plane: what an unrelated request later computed and
    committed in them failed its eviction (failed_transfers, invalidated): the cache dropped good data."""
    src_kv, dst_kv = prefill_kv(seed=14), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv, host_blocks=8)
    p = Prefill(src_kv, transport="loopback", **FAST)
    with Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        with Receiver(cache, tm, d, receive_timeout=TIMEOUT) as rx:
            r = rx.start(to_prefill, 1, chain(4, salt=1), "push")
            p.begin(to_decode, 1, [0, 1, 2, 3])
            p.layer_ready(1, 0)
            tm.wait_layer_host(r.task, 0, TIMEOUT)
            p.close()  # gone before layers 1 and 2
            assert rx.finish(1, TIMEOUT).loaded_blocks == 0
            rx.drain(TIMEOUT)
            cache.release(r.admission["id"])
            # An unrelated request computes into the same blocks (its forward declares no access) and commits.
            local = chain(4, salt=50)
            a = cache.admit(local, 0)
            assert set(a["device_blocks"]) & set(r.admission["device_blocks"])
            for layer in range(LAYERS):
                for role in range(2):
                    for i, b in enumerate(a["device_blocks"]):
                        dst_kv[layer][role].view(np.uint8)[b] = (i + 1) * 7
            cache.commit(a["id"])
            cache.release(a["id"])
            # Another request needs every device block: the committed ones go to host.
            b = cache.admit(chain(DECODE_BLOCKS, salt=60), 0)
            plan = cache.take_plan()
            assert plan["evictions"], plan
            done = tm.evict([m[0] for m in plan["evictions"]], [m[1] for m in plan["evictions"]])
            tm.wait(done, TIMEOUT)  # failed with the receive's failure before
            cache.ack("evictions", [m[1] for m in plan["evictions"]])
            cache.release(b["id"])
            st = cache.stats()
            assert st["failed_transfers"] == 0 and st["invalidated_blocks"] == 0, st
            assert cache.match(local)["host_blocks"] == 4
            cache.check_invariants()
    tm.close()


@needs_cache
def test_a_decode_endpoint_a_receiver_drives_cannot_be_closed_under_it():
    """Decode.close() under a Receiver waited 10 s for the receiver's reference, returned, and the endpoint went on
    receiving through the receiver. It is refused as TransferManager.close() is; after the receiver, it closes."""
    src_kv, dst_kv = prefill_kv(), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    with Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        rx = Receiver(cache, tm, d)
        started = time.monotonic()
        with pytest.raises(kvtier.FailedPreconditionError, match="Receiver"):
            d.close()
        assert time.monotonic() - started < 1.0
        rx.close()
        d.close()
        with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
            d.metadata()
    tm.close()


def test_receiver_refusals_name_the_problem():
    src_kv, dst_kv = prefill_kv(), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    other_kv = decode_kv()
    with Decode(other_kv, transport="loopback", device=dev, **FAST) as other, \
            Prefill(src_kv, transport="loopback", **FAST) as p:
        with pytest.raises(kvtier.InvalidArgumentError, match="does not move the TransferManager's device blocks"):
            Receiver(cache, tm, other)
        with pytest.raises(kvtier.InvalidArgumentError, match="Decode"):
            Receiver(cache, tm, p)
        with pytest.raises(kvtier.InvalidArgumentError, match="receive_timeout"):
            Receiver(cache, tm, other, receive_timeout=0)
    tm.close()


HOST_DIRECT = {
    "loopback": dict(transport="loopback"),
    "ucx-shm": dict(transport="ucx", tls="shm"),
}


def test_host_direct_lane_over_ucx_without_shared_memory_is_refused_at_construction():
    """tls="tcp" reaches the peer through active messages only: the endpoint was made and paired, then every
    transfer failed ("not mapped here")."""
    for tls in ("tcp", "tcp,self"):
        with pytest.raises(kvtier.InvalidArgumentError, match=f"tls '{tls}' reaches the peer through active messages"):
            Prefill(prefill_kv(), lane="host-direct", transport="ucx", tls=tls, **FAST)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("transport", list(HOST_DIRECT))
def test_host_direct_lane_moves_the_pools_byte_exact(transport, mode):
    """lane="host-direct": each endpoint's pool is a copy of its kv in the transport's memory (kv_pool()), the
    moving side copies through the transport's mapping of the peer's pool. Byte-exact into the decode's pool,
    untouched blocks keep their poison, the caller's own tensors are not the pool."""
    src_kv, dst_kv = prefill_kv(seed=5), decode_kv()
    src_blocks, dst_blocks = [1, 6, 3], [2, 8, 5]
    lane = dict(lane="host-direct", **HOST_DIRECT[transport])
    with Prefill(src_kv, **lane, **FAST) as p, Decode(dst_kv, **lane, **FAST) as d:
        assert p.lane == d.lane == "host-direct"
        src_pool, dst_pool = p.kv_pool(), d.kv_pool()
        assert len(src_pool) == len(dst_pool) == LAYERS
        for layer in range(LAYERS):
            for role in range(2):
                assert np.array_equal(src_pool[layer][role].view(np.uint8), src_kv[layer][role].view(np.uint8))
                assert src_pool[layer][role].ctypes.data != src_kv[layer][role].ctypes.data
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 7, dst_blocks, mode=mode)
        p.begin(to_decode, 7, src_blocks)
        p.layers_ready(7, list(range(LAYERS)))
        st = d.wait(7, TIMEOUT, reclaimable=True)
        assert st.final and st.error is None and st.leading_loaded_blocks == 3
        untouched = sorted(set(range(DECODE_BLOCKS)) - set(dst_blocks))
        for layer in range(LAYERS):
            assert_layer_moved(src_pool, dst_pool, layer, src_blocks, dst_blocks)
            assert_poisoned(dst_pool, layer, untouched)
            assert_poisoned(dst_kv, layer, range(DECODE_BLOCKS))  # the caller's tensors are not the pool
        assert p.wait(7, TIMEOUT).done
        d.forget(7)
        p.forget(7)
    # The arrays outlive the endpoints that made them.
    assert dst_pool[0][0].view(np.uint8)[dst_blocks[0]].tobytes() == src_pool[0][0].view(np.uint8)[1].tobytes()


@pytest.mark.parametrize("lane", ["host", "host-direct"])
def test_tensors_of_the_map_the_layout_does_not_use_are_left_alone(lane):
    """A name map may hold tensors the layout does not use (another rank's, names it does not know). On the host
    direct lane each was sized from its first dimension alone and copied into the pool: a negative stride wrapped
    the size (a segfault in the copy), a transposed one was copied short (its pool view read past its slot). They are
    neither copied nor paired now (another rank's tensors in one side's map refused the pairing), and the layout's
    tensors move byte-exact."""
    from kvtier.pd import _name_map

    src_names, dst_names = _name_map(prefill_kv(seed=9), 0, 0), _name_map(decode_kv(), 0, 0)
    src_names["extra_reversed"] = np.zeros((4, 8), np.uint8)[::-1]
    src_names["extra_transposed"] = np.arange(64, dtype=np.int32).reshape(16, 4).T
    src_names["key_caches_0_rank1.device0"] = np.zeros((3, 5), np.float16)  # another rank's
    lane_kw = dict(lane=lane, **HOST_DIRECT["loopback"]) if lane == "host-direct" else dict(transport="loopback")
    with Prefill(src_names, **lane_kw, **FAST) as p, Decode(dst_names, **lane_kw, **FAST) as d:
        src, dst = (p.kv_pool(), d.kv_pool()) if lane == "host-direct" else (src_names, dst_names)
        if lane == "host-direct":
            assert not {"extra_reversed", "extra_transposed", "key_caches_0_rank1.device0"} & set(src)
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 3, [4, 0])
        p.begin(to_decode, 3, [2, 5])
        p.layers_ready(3, list(range(LAYERS)))
        st = d.wait(3, TIMEOUT, reclaimable=True)
        assert st.final and st.error is None and st.leading_loaded_blocks == 2
        for layer in range(LAYERS):
            for role in ("key_caches", "value_caches"):
                name = f"{role}_{layer}_rank0.device0"
                for s_block, d_block in ((2, 4), (5, 0)):
                    assert dst[name].view(np.uint8)[d_block].tobytes() == src[name].view(np.uint8)[s_block].tobytes()
        assert p.wait(3, TIMEOUT).done


@pytest.mark.parametrize("transport", list(HOST_DIRECT))
def test_closing_a_host_direct_endpoint_whose_pool_the_engine_holds(transport):
    """The engine keeps its KV in kv_pool()'s arrays, which hold the pool's memory. close() used to count them as
    calls in flight: it waited 10 s for them, then left the endpoint running, and the prefill went on to write every
    layer into the closed decode's pool and reported the transfer done."""
    src_kv, dst_kv = prefill_kv(seed=5), decode_kv()
    lane = dict(lane="host-direct", **HOST_DIRECT[transport])
    with Prefill(src_kv, **lane, **FAST) as p:
        d = Decode(dst_kv, **lane, **FAST)
        dst_pool = d.kv_pool()
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, [0, 1])
        p.begin(to_decode, 1, [2, 3])
        started = time.monotonic()
        d.close()
        assert time.monotonic() - started < 2.0
        with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
            d.status(1)
        p.layers_ready(1, list(range(LAYERS)))
        st = p.wait(1, TIMEOUT)
        assert st.final and not st.done and st.error is not None
        for layer in range(LAYERS):
            assert_poisoned(dst_pool, layer, range(DECODE_BLOCKS))
        # The arrays still read and write the pool's memory.
        dst_pool[0][0][0] = 1
        assert (dst_pool[0][0][0] == 1).all()
    started = time.monotonic()
    with Prefill(src_kv, **lane, **FAST) as q:
        pool = q.kv_pool()
    assert time.monotonic() - started < 2.0
    assert np.array_equal(pool[1][1].view(np.uint8), src_kv[1][1].view(np.uint8))


def test_disconnect_peer_waits_for_transfers_with_the_peer_to_end():
    """disconnect_peer went straight to the transport, which unmaps the peer's pool: a host direct copy into it in
    flight segfaulted the process. It is refused while a transfer with the peer is not final, then drops the peer
    (idempotent), and the pair connects again from fresh metadata."""
    src_kv, dst_kv = prefill_kv(seed=6), decode_kv()
    lane = dict(lane="host-direct", **HOST_DIRECT["ucx-shm"])
    with Prefill(src_kv, **lane, **FAST) as p, Decode(dst_kv, **lane, **FAST) as d:
        src_pool, dst_pool = p.kv_pool(), d.kv_pool()
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, [0, 1])
        p.begin(to_decode, 1, [2, 3])
        with pytest.raises(kvtier.FailedPreconditionError, match="transfer 1 with peer .* is not final"):
            p.disconnect_peer(to_decode)
        with pytest.raises(kvtier.FailedPreconditionError, match="is not final"):
            d.disconnect_peer(to_prefill)
        p.layers_ready(1, list(range(LAYERS)))
        assert d.wait(1, TIMEOUT, reclaimable=True).error is None
        assert p.wait(1, TIMEOUT).done
        p.disconnect_peer(to_decode)
        p.disconnect_peer(to_decode)
        d.disconnect_peer(to_prefill)
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 2, [4, 5])
        p.begin(to_decode, 2, [6, 7])
        p.layers_ready(2, list(range(LAYERS)))
        assert d.wait(2, TIMEOUT, reclaimable=True).error is None
        for layer in range(LAYERS):
            assert_layer_moved(src_pool, dst_pool, layer, [2, 3, 6, 7], [0, 1, 4, 5])


def test_leaving_a_with_block_keeps_the_bodys_exception():
    """A Receiver still driving the endpoint made close() raise in __exit__, which replaced the body's exception."""
    dst_kv = decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    rx = None
    with pytest.raises(KeyError, match="the body's"):
        with Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
            rx = Receiver(cache, tm, d)
            raise KeyError("the body's")
    rx.close()
    d.close()
    tm.close()


def test_host_direct_lane_is_checked():
    with pytest.raises(kvtier.InvalidArgumentError, match="host-direct"):
        Prefill(prefill_kv(), transport="ipc", lane="host-direct")
    with pytest.raises(kvtier.InvalidArgumentError, match="no device"):
        Prefill(prefill_kv(), transport="loopback", lane="host-direct", device=kvtier.host_device())
    with Prefill(prefill_kv(), transport="loopback") as p:
        with pytest.raises(kvtier.InvalidArgumentError, match="kv_pool"):
            p.kv_pool()


_CLOSED_ENDPOINT_THREADS = """
import threading, numpy as np, kvtier
from kvtier.pd import Decode
d = Decode([(np.zeros((4, 256), np.uint8), np.zeros((4, 256), np.uint8))], transport="loopback")
d.close()
def hammer():
    for _ in range(100000):
        try:
            d.status(1)
        except kvtier.FailedPreconditionError:
            pass
threads = [threading.Thread(target=hammer) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print("done")
"""


def test_threads_calling_a_closed_endpoint_get_errors_not_a_deadlock():
    # The "closed" error was raised while the endpoint's mutex was held; raising runs Python code, which could hand
    # the GIL to a thread that then waited for the mutex with the GIL held: both hung for good.
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", _CLOSED_ENDPOINT_THREADS], capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("threads calling a closed endpoint deadlocked")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "done"


def test_ring_lane_without_slots_and_a_secret_that_is_not_bytes_are_refused():
    kv = decode_kv()
    # ring_slots 0 meant "no ring" inside: the endpoint came up on the device lane and every transfer failed later.
    with pytest.raises(kvtier.InvalidArgumentError, match="ring_slots 0"):
        Decode(kv, transport="loopback", device=kvtier.host_device(), lane="ring", ring_slots=0)
    # bytes(40) is 40 zero bytes: an int secret was taken as that and authenticated.
    with pytest.raises(kvtier.InvalidArgumentError, match="peer_secret is a int"):
        Prefill(prefill_kv(), transport="loopback", peer_secret=40)
    with pytest.raises(kvtier.InvalidArgumentError, match="peer_secret is a str"):
        Prefill(prefill_kv(), transport="loopback", peer_secret="s" * 32)
    p = Prefill(prefill_kv(), transport="loopback", peer_secret=bytearray(SECRET))  # bytes-like is fine
    p.close()


def test_a_ucx_transport_list_that_names_nothing_is_an_invalid_argument():
    with pytest.raises(kvtier.InvalidArgumentError, match="TLS 'no_such_transport'"):
        Prefill(prefill_kv(), transport="ucx", tls="no_such_transport")


def test_add_peer_refuses_an_endpoint_of_its_own_role():
    # Two prefills paired with each other each waited for a request that never came, until a lease or the caller's
    # timeout ended it with a misleading reason.
    with Prefill(prefill_kv(1), transport="loopback") as a, Prefill(prefill_kv(2), transport="loopback") as b, \
            Decode(decode_kv(), transport="loopback") as d, Decode(decode_kv(), transport="loopback") as e:
        with pytest.raises(kvtier.FailedPreconditionError, match="another prefill endpoint's"):
            a.add_peer(b.metadata())
        with pytest.raises(kvtier.FailedPreconditionError, match="another decode endpoint's"):
            d.add_peer(e.metadata())
        with pytest.raises(kvtier.DataLossError, match="not a kvtier.pd endpoint's"):
            d.add_peer(b"X" + a.metadata()[1:])
        with pytest.raises(kvtier.DataLossError):
            d.add_peer(b"")
        with pytest.raises(kvtier.FailedPreconditionError, match="this decode endpoint's"):
            d.add_peer(d.metadata())
        # A cut blob is named with the size the caller passed (the role byte included).
        meta = a.metadata()
        with pytest.raises(kvtier.KvtierError, match=f"metadata of 10 bytes"):
            d.add_peer(meta[:10])
        assert d.add_peer(a.metadata()) >= 0 and a.add_peer(d.metadata()) >= 0


def assert_exits_without_leaks(script: str) -> None:
    """Runs `script` in a fresh interpreter: it must exit 0 with no nanobind leak report."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "leaked" not in r.stderr, r.stderr[-2000:]


def test_endpoints_left_open_at_exit_are_closed_without_leaks():
    # An endpoint with a device that the program never closed outlived the extension at exit: nanobind reported
    # the Device and the extension's types as leaked.
    script = (
        "import numpy as np, kvtier\n"
        "from kvtier.pd import Decode\n"
        "kv = [(np.zeros((4, 256), np.uint8), np.zeros((4, 256), np.uint8))]\n"
        "d = Decode(kv, transport='loopback', device=kvtier.host_device())\n")
    assert_exits_without_leaks(script)


@needs_cache
def test_a_closed_receiver_the_program_still_references_holds_nothing_at_exit():
    # A closed Receiver kept its references to the endpoint, the managers and so the Device: left in a module
    # global, it outlived the extension at exit and nanobind reported leaks.
    script = (
        "import numpy as np, kvtier\n"
        "from kvtier.pd import Decode, Receiver\n"
        "dev = kvtier.host_device()\n"
        "compute = dev.create_stream('compute')\n"
        "kv = [(np.zeros((10, 2, 16, 8), np.float16), np.zeros((10, 2, 16, 8), np.float16)) for _ in range(3)]\n"
        "tm = kvtier.TransferManager.from_tensors(dev, compute, kvtier.pd._name_map(kv, 0, 0), None, 4, 3)\n"
        "cache = kvtier.CacheManager(device_blocks=10, host_blocks=4)\n"
        "d = Decode(kv, transport='loopback', device=dev)\n"
        "rx = Receiver(cache, tm, d)\n"
        "rx.close(); d.close(); tm.close()\n")
    assert_exits_without_leaks(script)


def test_an_unbounded_wait_returns_a_layer_that_itself_timed_out():
    """A wait with timeout=None runs in 50 ms slices (so Ctrl-C works); a layer that ended TimedOut (its receive
    timed out: no prefill ever began) answered every slice with TimedOut at once, and the wait spun forever instead
    of raising it."""
    import threading

    src_kv, dst_kv = prefill_kv(seed=11), decode_kv()
    dev, tm, cache = receiver_rig(dst_kv)
    with Prefill(src_kv, transport="loopback", **FAST) as p, \
            Decode(dst_kv, transport="loopback", device=dev, **FAST) as d:
        to_decode, to_prefill = connect(p, d)
        rx = Receiver(cache, tm, d, receive_timeout=0.3)
        r = rx.start(to_prefill, 7, chain(4), "push")
        deadline = time.monotonic() + 10
        while rx.active and time.monotonic() < deadline:
            rx.poll()
            time.sleep(0.05)
        outcome = {}

        def wait():
            try:
                tm.wait_layer_host(r.task, 0)  # timeout=None
                outcome["r"] = "returned"
            except kvtier.KvtierError as e:
                outcome["r"] = e

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "the unbounded wait still spins"
        assert isinstance(outcome["r"], kvtier.TimedOutError), outcome
        with pytest.raises(kvtier.TimedOutError):
            tm.wait(r.task)
        rx.close()
