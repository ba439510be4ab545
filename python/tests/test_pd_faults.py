"""kvtier.pd under faults and misuse: foreign and late requests, endpoints closed mid-transfer, failed device
operations, ring slots, refused calls, argument checks. Byte-exact: random sources, poisoned destinations.

Scenarios that could take the interpreter down (an endpoint's memory written after it was freed) run in a
subprocess, which must exit cleanly."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvtier
from conftest import poisoned_kv, random_kv
from kvtier.pd import Decode, Prefill, Receiver

LAYERS = 3
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 10
BLOCK_SHAPE = (2, 16, 8)  # float16: 512 bytes per (layer, role, block), 1024 per (layer, block)
POISON = 0xEE
TIMEOUT = 3.0  # what a wait that should end gets (every transfer here is a few KiB)
FAST = dict(heartbeat_s=0.05, lease_s=0.5)
# A lease well past the waits of a test: a transfer that ends before it ended on its own, not by the lease.
LONG_LEASE = dict(heartbeat_s=0.05, lease_s=2.0)

# The lanes, as both sides pass them (with device=kvtier.host_device()); "host": host memory, no device.
LANES = {
    "host": None,
    "staged": dict(),
    "direct": dict(lane="direct"),
    "ring": dict(lane="ring", ring_slots=2, ring_slot_bytes=2 * 1024),  # 2 slots of 2 blocks
}


def prefill_kv(seed: int = 1, blocks: int = PREFILL_BLOCKS, shape=BLOCK_SHAPE):
    """One (key, value) pair of float16 tensors per layer, random bytes (a function of the seed)."""
    return random_kv(LAYERS, blocks, shape, seed)


def decode_kv(blocks: int = DECODE_BLOCKS, shape=BLOCK_SHAPE):
    return poisoned_kv(LAYERS, blocks, shape, POISON)


def assert_moved(src_kv, dst_kv, src_blocks, dst_blocks, layers=range(LAYERS)):
    for layer in layers:
        for role in range(2):
            src = src_kv[layer][role].view(np.uint8)
            dst = dst_kv[layer][role].view(np.uint8)
            for s, d in zip(src_blocks, dst_blocks):
                assert np.array_equal(dst[d], src[s]), \
                    f"layer {layer} role {role}: decode block {d} != prefill block {s}"


def assert_poisoned(dst_kv, blocks, layers=range(LAYERS)):
    for layer in layers:
        for role in range(2):
            dst = dst_kv[layer][role].view(np.uint8)
            for b in blocks:
                assert (dst[b] == POISON).all(), f"layer {layer} role {role}: decode block {b} was written"


def connect(prefill, decode):
    """Exchanges metadata; returns (decode's peer id at the prefill, prefill's peer id at the decode)."""
    return prefill.add_peer(decode.metadata()), decode.add_peer(prefill.metadata())


def endpoint_args(lane: str, dev=None, **extra):
    """The keyword arguments of both endpoints on `lane` over loopback (one host Device for both sides)."""
    kw = dict(transport="loopback", **FAST)
    kw.update(extra)
    if LANES[lane] is not None:
        kw.update(device=dev if dev is not None else kvtier.host_device(), **LANES[lane])
    return kw


def wait_final(decode, transfer_id, timeout=TIMEOUT, reclaimable=False, what="the transfer"):
    """decode.wait, failing the test (with the transfer's status) where it is not final in time."""
    try:
        return decode.wait(transfer_id, timeout, reclaimable=reclaimable)
    except kvtier.TimedOutError as e:
        timed_out = str(e)
    pytest.fail(f"{what} (decode transfer {transfer_id}) was not final after {timeout} s: {timed_out}; "
                f"status {decode.status(transfer_id)}")


def run_transfer(p, d, to_decode, to_prefill, xid, src_blocks, dst_blocks, mode="push"):
    """A whole transfer, every layer ready at once; returns the decode's final, reclaimable status."""
    d.start(to_prefill, xid, dst_blocks, mode=mode)
    p.begin(to_decode, xid, src_blocks)
    p.layers_ready(xid, range(LAYERS))
    return wait_final(d, xid, reclaimable=True, what=f"transfer {xid}")


def wait_until(predicate, timeout=TIMEOUT, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout} s")
        time.sleep(0.005)


def run_script(code: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a crash there is an exit code here, a hang a failure)."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    pytest.fail(f"the script hung (no exit within {timeout} s); its output so far:\n{out[-2000:]}")


# ---------------------------------------------------------------- 1: requests from another decode


@pytest.mark.parametrize("lane", ["host", "direct"])
def test_a_request_from_another_decode_is_not_applied(lane):
    """Two decodes use one transfer id (a router bug, two routers): the prefill began it toward A, so B's request
    must not redirect its copies. A loads byte-exact and A's other blocks keep their poison; B's transfer fails or
    stays unanswered, and writes nothing anywhere."""
    dev = kvtier.host_device() if LANES[lane] is not None else None
    kw = endpoint_args(lane, dev)
    src_kv, a_kv, b_kv = prefill_kv(seed=21), decode_kv(), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(a_kv, **kw) as a, Decode(b_kv, **kw) as b:
        to_a, a_to_p = connect(p, a)
        to_b, b_to_p = connect(p, b)
        a.start(a_to_p, 1, [0, 1])
        p.begin(to_a, 1, [2, 3])
        wait_until(lambda: "request" in p.status(1).times, what="the prefill having A's request")
        b.start(b_to_p, 1, [5, 6])  # the same id from another decode, the transfer begun toward A
        wait_until(lambda: "request" in b.status(1).times, what="B's request going out")
        time.sleep(0.1)  # B's request reaches the prefill
        p.layers_ready(1, range(LAYERS))
        st = wait_final(a, 1, reclaimable=True, what="A's transfer")
        assert st.error is None and st.layers == ["loaded"] * LAYERS and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, a_kv, [2, 3], [0, 1])
        assert_poisoned(a_kv, range(2, DECODE_BLOCKS))  # B's list [5, 6] included
        try:
            st_b = b.wait(1, TIMEOUT, reclaimable=True)
            assert not any(st_b.block_loaded) and st_b.error is not None, st_b
        except kvtier.TimedOutError:
            pass  # unanswered: fine, as long as it wrote nothing
        assert_poisoned(b_kv, range(DECODE_BLOCKS))
        # Nothing of B's request landed in A later either.
        assert_moved(src_kv, a_kv, [2, 3], [0, 1])
        assert_poisoned(a_kv, range(2, DECODE_BLOCKS))


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("lane", ["host", "direct"])
def test_a_repeated_request_from_the_same_decode_is_not_applied(lane, mode):
    """After a transfer ended and the decode forgot it, the decode starts the same id again before the prefill
    forgot it: the prefill's transfer has had its request, so the new one is not applied (nothing lands in the new
    destinations)."""
    dev = kvtier.host_device() if LANES[lane] is not None else None
    kw = endpoint_args(lane, dev)
    src_kv, dst_kv = prefill_kv(seed=22), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        st = run_transfer(p, d, to_d, to_p, 1, [2, 3], [0, 1], mode=mode)
        assert st.error is None and st.leading_loaded_blocks == 2, st
        d.forget(1)
        d.start(to_p, 1, [4, 5], mode=mode)  # the prefill still has transfer 1 (not forgotten)
        try:
            st = d.wait(1, 1.0)
            assert not any(st.block_loaded), st
        except kvtier.TimedOutError:
            pass
        assert_moved(src_kv, dst_kv, [2, 3], [0, 1])
        assert_poisoned(dst_kv, range(2, DECODE_BLOCKS))


# ---------------------------------------------------------------- 2: begin later than the lease


@pytest.mark.parametrize("lane", ["host", "direct"])
def test_a_begin_later_than_the_lease_still_completes_the_transfer(lane):
    """begin() and start() come in any order: a prefill that has the decode's request but whose forward pass reaches
    it more than a lease later keeps the transfer alive (it heartbeats the requests it holds). The transfer then
    completes byte-exact, and the next one on the same endpoints works."""
    dev = kvtier.host_device() if LANES[lane] is not None else None
    kw = endpoint_args(lane, dev)
    src_kv, dst_kv = prefill_kv(seed=23), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        d.start(to_p, 1, [0, 1])
        time.sleep(1.6 * FAST["lease_s"])  # the prefill's forward has not reached this prompt yet
        st = d.status(1)
        assert not st.final, f"the decode gave up on a prefill that holds its request: {st}"
        p.begin(to_d, 1, [4, 5])
        p.layers_ready(1, range(LAYERS))
        st = wait_final(d, 1, reclaimable=True)
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [4, 5], [0, 1])
        assert p.wait(1, TIMEOUT).done
        d.forget(1)
        p.forget(1)
        st = run_transfer(p, d, to_d, to_p, 2, [6, 7], [2, 3])
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [4, 5, 6, 7], [0, 1, 2, 3])
        assert_poisoned(dst_kv, range(4, DECODE_BLOCKS))


# ---------------------------------------------------------------- 3: the decode closes mid-transfer (subprocess)

_CLOSE_MID_TRANSFER = """
import gc, sys, time
import numpy as np, kvtier
from kvtier.pd import Decode, Prefill

LAYERS, SHAPE = 3, (2, 64, 128)  # 32 KiB per (layer, role, block)

def kv(n, seed=None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            t = np.empty((n,) + SHAPE, np.float16)
            u = t.view(np.uint8)
            u[...] = 0xEE if seed is None else rng.integers(0, 256, u.shape, dtype=np.uint8)
            pair.append(t)
        out.append(tuple(pair))
    return out

lane = {lane!r}
dev = kvtier.host_device()
o = dict(transport="loopback", device=dev, lane=lane, heartbeat_s=0.05, lease_s=0.5)
if lane == "ring":
    o.update(ring_slots=2, ring_slot_bytes=65536)
src, dst = kv(8, seed=3), kv(10)
p, d = Prefill(src, **o), Decode(dst, **o)
to_d, to_p = p.add_peer(d.metadata()), d.add_peer(p.metadata())
d.start(to_p, 1, [0, 1, 2, 3])
p.begin(to_d, 1, [4, 5, 6, 7])
p.layer_ready(1, 0)
assert d.wait_layer(1, 0, 5) == "loaded"
d.close()  # the decode instance shuts down mid-transfer and frees its KV
del d, dst
gc.collect()
junk = [bytearray(40000) for _ in range(200)]  # the freed memory is reused
p.layer_ready(1, 1)
p.layer_ready(1, 2)
try:
    st = p.wait(1, 5)
    print("PREFILL", "failed" if st.final and not st.done and st.error is not None else "not-failed", repr(st),
          flush=True)
except kvtier.TimedOutError as e:
    print("PREFILL timed-out", e, flush=True)
except kvtier.KvtierError as e:
    print("PREFILL error", repr(e), flush=True)
time.sleep(0.3)
more = [np.ones(1000) for _ in range(100)]
junk = [bytearray(40000) for _ in range(200)]
p.close()
print("survived", flush=True)
"""


@pytest.mark.parametrize("lane", ["direct", "ring"])
def test_closing_the_decode_mid_transfer_fails_the_prefill_and_writes_no_freed_memory(lane):
    """The decode endpoint closes (and its KV is freed) with layers 1 and 2 not sent: the prefill must not write the
    freed memory. Its transfer ends failed within its wait, and the process survives."""
    r = run_script(_CLOSE_MID_TRANSFER.format(lane=lane))
    tail = f"rc={r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"
    assert r.returncode == 0, f"the process died writing a closed decode's memory: {tail}"
    assert "PREFILL failed" in r.stdout or "PREFILL error" in r.stdout, tail
    assert "survived" in r.stdout, tail


# ---------------------------------------------------------------- 4: staged destinations held by another transfer


def test_a_staged_decode_refuses_a_block_still_held_by_another_transfer():
    """As on the host and device lanes: two transfers into one decode block would both report it loaded while it
    holds one prefill's bytes. The second start is refused, naming the block; the first transfer is unaffected."""
    dev = kvtier.host_device()
    kw = endpoint_args("staged", dev)
    src_kv, dst_kv = prefill_kv(seed=24), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        d.start(to_p, 1, [0, 1])
        p.begin(to_d, 1, [3, 4])
        with pytest.raises(kvtier.FailedPreconditionError,
                           match="destination block 1 at index 0 belongs to transfer 1"):
            d.start(to_p, 2, [1, 2])
        p.layers_ready(1, range(LAYERS))
        st = wait_final(d, 1, reclaimable=True)
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [3, 4], [0, 1])
        assert_poisoned(dst_kv, range(2, DECODE_BLOCKS))
        assert p.wait(1, TIMEOUT).done
        d.forget(1)
        p.forget(1)
        st = run_transfer(p, d, to_d, to_p, 2, [5, 6], [1, 2])  # forgotten: the block may be reused
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [3, 5, 6], [0, 1, 2])


# ---------------------------------------------------------------- 5, 6: failed device operations


def test_a_failed_device_lane_copy_fails_the_later_layers_promptly():
    """lane="direct", push: layer 0's copy fails on the device, layers 1 and 2 are declared a little later. They
    fail at once (not after the decode's lease), and the prefill is not dropped: the next transfer loads."""
    dev = kvtier.host_device()
    kw = endpoint_args("direct", dev, **LONG_LEASE)
    src_kv, dst_kv = prefill_kv(seed=25), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        d.start(to_p, 1, [0, 1])
        p.begin(to_d, 1, [2, 3])
        dev.fail_nth_operation(1)  # layer 0's copy
        p.layer_ready(1, 0)
        time.sleep(0.1)  # the forward pass finishes layers 1 and 2 a little later
        p.layer_ready(1, 1)
        p.layer_ready(1, 2)
        st = wait_final(d, 1, timeout=1.0, what="a transfer whose layer 0 failed (lease 2 s)")
        assert st.layers == ["failed"] * LAYERS and st.error is not None, st
        assert st.block_loaded == [False, False]
        st = wait_final(d, 1, reclaimable=True)
        assert p.wait(1, TIMEOUT).final
        d.forget(1)
        p.forget(1)
        st = run_transfer(p, d, to_d, to_p, 2, [4, 5], [4, 5])
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [4, 5], [4, 5])


@pytest.mark.parametrize("lane,mode", [("direct", "push"), ("direct", "pull"), ("staged", "push")])
def test_transfers_after_a_failed_device_operation_load(lane, mode):
    """One device operation fails (a transient copy error): that transfer fails, the ones after it load byte-exact
    (as on the ring lane), not with the first one's error."""
    dev = kvtier.host_device()
    kw = endpoint_args(lane, dev, **LONG_LEASE)
    src_kv, dst_kv = prefill_kv(seed=26), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        dev.fail_nth_operation(1)
        st = run_transfer(p, d, to_d, to_p, 1, [0, 1], [0, 1], mode=mode)
        assert st.error is not None and not any(st.block_loaded), st
        assert p.wait(1, TIMEOUT).final
        d.forget(1)
        p.forget(1)
        for xid, src_blocks, dst_blocks in [(2, [2, 3], [2, 3]), (3, [4, 5], [6, 7])]:
            st = run_transfer(p, d, to_d, to_p, xid, src_blocks, dst_blocks, mode=mode)
            assert st.error is None and st.leading_loaded_blocks == 2, f"transfer {xid}: {st}"
            assert_moved(src_kv, dst_kv, src_blocks, dst_blocks)
            assert p.wait(xid, TIMEOUT).done
            d.forget(xid)
            p.forget(xid)
        assert_poisoned(dst_kv, [4, 5, 8, 9])


# ---------------------------------------------------------------- 7: ring slots of a prefill that closed (ipc)

RING_IPC = dict(lane="ring", ring_slots=2, ring_slot_bytes=2 * 1024, **FAST)


def _ring_prefill_that_closes(conn):
    """A prefill on the ring lane in its own process: sends layer 0 of transfer 7, closes its endpoint when told and
    keeps running until told to exit."""
    try:
        p = Prefill(prefill_kv(seed=27), transport="ipc", device=kvtier.host_device(), **RING_IPC)
        conn.send_bytes(p.metadata())
        if not conn.poll(30):
            return
        peer = p.add_peer(conn.recv_bytes())
        p.begin(peer, 7, [0, 1, 2, 3])
        p.layer_ready(7, 0)
        conn.send("begun")
        if conn.poll(30) and conn.recv() == "close":
            p.close()  # this endpoint shuts down; its process keeps running
            conn.send("closed")
        conn.poll(30)  # until the parent says "exit" (or goes)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", repr(e)))
        except Exception:  # noqa: BLE001
            pass


def test_ring_slots_of_a_closed_prefill_whose_process_lives_on_are_reused():
    """The ring slots granted to a prefill endpoint that closed (its process still running) are given back once it
    closed: a new prefill's transfer completes, and does not wait for the old process to exit."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ring_prefill_that_closes, args=(child,), daemon=True)
    proc.start()
    dev = kvtier.host_device()
    dst_kv = decode_kv()
    try:
        with Decode(dst_kv, transport="ipc", device=dev, **RING_IPC) as d:
            assert parent.poll(30), "the prefill process sent no metadata"
            old = d.add_peer(parent.recv_bytes())
            parent.send_bytes(d.metadata())
            d.start(old, 7, [0, 1, 2, 3])
            assert parent.poll(TIMEOUT) and parent.recv() == "begun"
            assert d.wait_layer(7, 0, TIMEOUT) == "loaded"
            parent.send("close")
            assert parent.poll(TIMEOUT) and parent.recv() == "closed"
            st = wait_final(d, 7, reclaimable=True, what="the closed prefill's transfer")
            assert st.layers[0] == "loaded" and "failed" in st.layers[1:], st
            d.forget(7)
            src_kv = prefill_kv(seed=28)
            with Prefill(src_kv, transport="ipc", device=dev, **RING_IPC) as p2:
                to_d, to_p = connect(p2, d)
                d.start(to_p, 8, [4, 5])
                p2.begin(to_d, 8, [4, 5])
                p2.layers_ready(8, range(LAYERS))
                st = wait_final(d, 8, reclaimable=True, what="the new prefill's transfer (the old process lives)")
                assert st.error is None and st.leading_loaded_blocks == 2, st
                assert_moved(src_kv, dst_kv, [4, 5], [4, 5])
                assert_poisoned(dst_kv, range(6, DECODE_BLOCKS))
    finally:
        try:
            parent.send("exit")
        except Exception:  # noqa: BLE001
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# ---------------------------------------------------------------- 8: ring slots and a transfer not ready yet


def test_a_ready_ring_transfer_completes_while_another_waits_for_its_layers():
    """lane="ring", 2 slots of one block: transfer 1's forward pass is still running (no layer ready) when transfer 2
    is ready in full. Transfer 1 must not hold the slots against it: 2 completes while 1 waits, then 1 completes."""
    dev = kvtier.host_device()
    kw = endpoint_args("ring", dev, ring_slot_bytes=1024)
    src_kv, dst_kv = prefill_kv(seed=29), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        d.start(to_p, 1, [0, 1])
        p.begin(to_d, 1, [0, 1])  # its forward pass is still running
        d.start(to_p, 2, [2, 3])
        p.begin(to_d, 2, [4, 5])
        p.layers_ready(2, range(LAYERS))
        st = wait_final(d, 2, timeout=2.0, reclaimable=True,
                        what="the ready transfer (the other one waiting for its layers)")
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [4, 5], [2, 3])
        assert d.status(1).layers == ["pending"] * LAYERS
        assert_poisoned(dst_kv, [0, 1])
        p.layers_ready(1, range(LAYERS))
        st = wait_final(d, 1, reclaimable=True)
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [0, 1, 4, 5], [0, 1, 2, 3])
        assert_poisoned(dst_kv, range(4, DECODE_BLOCKS))


# ---------------------------------------------------------------- 9: staged layers_ready refusals


@pytest.fixture
def staged_pair():
    dev = kvtier.host_device()
    kw = endpoint_args("staged", dev)
    src_kv, dst_kv = prefill_kv(seed=30), decode_kv()
    p, d = Prefill(src_kv, **kw), Decode(dst_kv, **kw)
    to_d, to_p = connect(p, d)
    d.start(to_p, 1, [0, 1])
    p.begin(to_d, 1, [2, 3])
    yield p, d, src_kv, dst_kv
    p.close()
    d.close()


def _assert_nothing_declared(p, d, src_kv, dst_kv):
    for layer in range(LAYERS):
        with pytest.raises(kvtier.TimedOutError):
            d.wait_layer(1, layer, timeout=0.1)
    assert d.status(1).layers == ["pending"] * LAYERS
    assert_poisoned(dst_kv, range(DECODE_BLOCKS))
    # Declared now, every layer arrives.
    p.layers_ready(1, range(LAYERS))
    st = wait_final(d, 1, reclaimable=True)
    assert st.error is None and st.leading_loaded_blocks == 2, st
    assert_moved(src_kv, dst_kv, [2, 3], [0, 1])


def test_a_staged_layers_ready_with_a_layer_out_of_range_declares_nothing(staged_pair):
    p, d, src_kv, dst_kv = staged_pair
    with pytest.raises(kvtier.OutOfRangeError, match=r"layers\[1\] = 99"):
        p.layers_ready(1, [0, 99])
    _assert_nothing_declared(p, d, src_kv, dst_kv)


def test_a_staged_layers_ready_listing_a_layer_twice_is_refused_as_such_and_declares_nothing(staged_pair):
    p, d, src_kv, dst_kv = staged_pair
    with pytest.raises(kvtier.AlreadyExistsError, match=r"layers\[1\] = 1 is listed twice"):
        p.layers_ready(1, [1, 1])
    _assert_nothing_declared(p, d, src_kv, dst_kv)


# ---------------------------------------------------------------- 10: start toward an unknown peer


@pytest.mark.parametrize("lane", ["host", "direct"])
def test_start_toward_an_unknown_peer_raises_and_takes_no_block(lane):
    dev = kvtier.host_device() if LANES[lane] is not None else None
    kw = endpoint_args(lane, dev)
    src_kv, dst_kv = prefill_kv(seed=31), decode_kv()
    with Prefill(src_kv, **kw) as p, Decode(dst_kv, **kw) as d:
        to_d, to_p = connect(p, d)
        unknown = to_p + 77
        with pytest.raises(kvtier.NotFoundError, match=f"peer {unknown}"):
            d.start(unknown, 1, [0, 1])
        # Neither the id nor the blocks were taken.
        st = run_transfer(p, d, to_d, to_p, 1, [5, 6], [0, 1])
        assert st.error is None and st.leading_loaded_blocks == 2, st
        assert_moved(src_kv, dst_kv, [5, 6], [0, 1])
        assert_poisoned(dst_kv, range(2, DECODE_BLOCKS))


# ---------------------------------------------------------------- 11: argument checks and their messages


def test_staging_blocks_too_large_is_refused_naming_the_request():
    with pytest.raises(kvtier.KvtierError) as e:
        Decode(decode_kv(), transport="loopback", device=kvtier.host_device(), staging_blocks=2**63, **FAST)
    msg = str(e.value)
    assert "0 bytes" not in msg, msg  # 2**63 blocks is not a request for 0 bytes
    assert str(2**63) in msg or "too large" in msg.lower(), msg


def test_a_heartbeat_or_lease_below_a_millisecond_is_refused_naming_the_value_given():
    """Leases run in whole milliseconds: 0.1 ms is refused naming what was given, not rounded up to 1 ms (which
    made 0.1 ms and 1.9 ms read as 'heartbeat 1 ms and lease 1 ms')."""
    with pytest.raises(kvtier.InvalidArgumentError, match=r"heartbeat_s 0\.0001 "):
        Decode(decode_kv(), transport="loopback", heartbeat_s=0.0001, lease_s=0.0019)
    with pytest.raises(kvtier.InvalidArgumentError, match=r"lease_s 0\.0005 "):
        Decode(decode_kv(), transport="loopback", heartbeat_s=0.001, lease_s=0.0005)
    Decode(decode_kv(), transport="loopback", heartbeat_s=0.001, lease_s=0.0019).close()  # 1 ms and 2 ms


@pytest.mark.parametrize("arg,value", [("heartbeat_s", True), ("heartbeat_s", "0.1"), ("lease_s", True),
                                       ("lease_s", "5")])
def test_a_heartbeat_or_lease_that_is_not_a_number_is_refused_naming_it(arg, value):
    """float() took True as 1 s and "0.1" as 0.1 s: a bool or a str is refused, naming the argument and the value
    (as the module's other numeric arguments are: a TypeError, or kvtier's InvalidArgumentError)."""
    kw = dict(heartbeat_s=0.05, lease_s=5.0)
    kw[arg] = value
    with pytest.raises((TypeError, kvtier.InvalidArgumentError), match=re.escape(repr(value))) as e:
        Decode(decode_kv(), transport="loopback", **kw).close()
    assert arg.split("_")[0] in str(e.value), str(e.value)


# ---------------------------------------------------------------- giving up on a transfer, and the Receiver


def test_a_cancelled_transfer_ends_at_once_and_its_blocks_come_back():
    """A prefill that is alive but never begins heartbeats the request it holds, so no lease ends the transfer:
    cancel() does, and the prefill's answer frees the blocks."""
    src_kv, dst_kv = prefill_kv(seed=41), decode_kv()
    with Prefill(src_kv, transport="loopback", heartbeat_s=0.05, lease_s=5.0) as p, \
            Decode(dst_kv, transport="loopback", heartbeat_s=0.05, lease_s=5.0) as d:
        d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        d.start(0, 1, [0, 1])
        time.sleep(0.1)
        assert not d.status(1).final
        t0 = time.monotonic()
        d.cancel(1)
        st = d.wait(1, TIMEOUT, reclaimable=True)
        assert time.monotonic() - t0 < 2.0
        assert st.final and st.reclaimable and isinstance(st.error, kvtier.CancelledError), st.error
        d.forget(1)
        with pytest.raises(kvtier.NotFoundError, match="1"):
            d.cancel(1)


def test_a_receiver_over_a_host_memory_decode_names_the_memory_kinds():
    kv = decode_kv()
    dev = kvtier.host_device()
    tm = kvtier.TransferManager.from_tensors(dev, dev.create_stream("compute"), kvtier.pd._name_map(kv, 0, 0), None,
                                             4, LAYERS)
    cache = kvtier.CacheManager(device_blocks=DECODE_BLOCKS, host_blocks=4)
    d = Decode(kv, transport="loopback")
    try:
        with pytest.raises(kvtier.InvalidArgumentError, match="with device= the manager's device"):
            Receiver(cache, tm, d)
    finally:
        d.close()
        tm.close()


# The scripts below run in a process of their own: three layers of (key, value) float16 pools of N blocks of
# SHAPE, random (a function of the seed) or poisoned.
_SCRIPT_PRELUDE = """
import multiprocessing as mp, os, signal, sys, time
import numpy as np
from kvtier.pd import Decode, Prefill

def kv(fill=None, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        pair = []
        for _ in range(2):
            t = np.empty((N,) + SHAPE, np.float16)
            t.view(np.uint8)[...] = 0xEE if fill else rng.integers(0, 256, t.view(np.uint8).shape, dtype=np.uint8)
            pair.append(t)
        out.append(tuple(pair))
    return out
"""

_CLOSE_AFTER_DECODE_KILLED = _SCRIPT_PRELUDE + """
SHAPE, N = (64, 1024), 64

def decode_proc(conn):
    d = Decode(kv(fill=True), transport="ucx", tls="shm", heartbeat_s=0.05, lease_s=0.5)
    conn.send_bytes(d.metadata())
    peer = d.add_peer(conn.recv_bytes())
    d.start(peer, 1, list(range(N)), "pull")
    conn.send("started")
    time.sleep(60)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    child = ctx.Process(target=decode_proc, args=(b,), daemon=True)
    child.start()
    p = Prefill(kv(seed=7), transport="ucx", tls="shm", heartbeat_s=0.05, lease_s=0.5)
    peer = p.add_peer(a.recv_bytes())
    a.send_bytes(p.metadata())
    assert a.recv() == "started"
    time.sleep(0.05)
    p.begin(peer, 1, list(range(N)))
    p.layers_ready(1, range(3))
    time.sleep(0.003)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    p.wait(1, 5)
    p.close()
    print("closed")
"""


def test_a_prefill_closes_cleanly_after_its_ucx_shared_memory_decode_was_killed_mid_pull(tmp_path):
    """Sends to a dead shared-memory peer wait in UCX's pending queues; the transport unmapped the memory they use
    before destroying the worker, whose purge then deregistered it: a segfault in about half the closes."""
    script = tmp_path / "close_after_kill.py"
    script.write_text(_CLOSE_AFTER_DECODE_KILLED)
    for attempt in range(3):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "closed" in r.stdout, (attempt, r.returncode, r.stdout[-500:], r.stderr[-2000:])


_PEER_STOPPED_MID_TRANSFER = _SCRIPT_PRELUDE + """
SHAPE, N, LEASE = (64, 1024), 256, 0.5

def endpoint(side):
    cls = Prefill if side == "prefill" else Decode
    return cls(kv(fill=side == "decode", seed=7), transport="ucx", tls="shm", heartbeat_s=0.05, lease_s=LEASE)

def child(conn, side, mode):
    ep = endpoint(side)
    conn.send_bytes(ep.metadata())
    peer = ep.add_peer(conn.recv_bytes())
    if side == "decode":
        ep.start(peer, 1, list(range(N)), mode)
        conn.send("ready")
    else:
        assert conn.recv() == "started"
        ep.begin(peer, 1, list(range(N)))
        ep.layers_ready(1, range(3))
        conn.send("ready")
    time.sleep(120)

if __name__ == "__main__":
    victim, mode, action = sys.argv[1], sys.argv[2], sys.argv[3]
    survivor = "decode" if victim == "prefill" else "prefill"
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=child, args=(b, victim, mode), daemon=True)
    proc.start()
    ep = endpoint(survivor)
    peer = ep.add_peer(a.recv_bytes())
    a.send_bytes(ep.metadata())
    if survivor == "decode":
        ep.start(peer, 1, list(range(N)), mode)
        a.send("started")
        assert a.recv() == "ready"
    else:
        assert a.recv() == "ready"
        ep.begin(peer, 1, list(range(N)))
        ep.layers_ready(1, range(3))
    # 192 MiB each way: the victim stops with the survivor's requests to it in flight, then dies or, past the
    # lease of both sides, resumes.
    time.sleep(0.003)
    os.kill(proc.pid, signal.SIGSTOP)
    if action == "kill":
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    else:
        time.sleep(3 * LEASE)
        os.kill(proc.pid, signal.SIGCONT)
    t0 = time.monotonic()
    if survivor == "decode":
        st = ep.wait(1, 10, reclaimable=True)
        ok = st.reclaimable
    else:
        st = ep.wait(1, 10)
        ok = st.reclaimable
    print("back after", round(time.monotonic() - t0, 3), "s; reclaimable", ok, "; error:", st.error)
    ep.close()
    proc.kill()
    print("closed")
"""


def run_stopped_peer(tmp_path, victim: str, mode: str, action: str) -> float:
    """Runs _PEER_STOPPED_MID_TRANSFER: the victim stopped mid-transfer, then killed or resumed; checks that the
    survivor's blocks came back (reclaimable) with the transfer failed; returns how long that took."""
    script = tmp_path / f"peer_{action}.py"
    script.write_text(_PEER_STOPPED_MID_TRANSFER)
    r = subprocess.run([sys.executable, str(script), victim, mode, action], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0 and "closed" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    m = re.search(r"back after ([0-9.]+) s; reclaimable True ; error: (\S+)", r.stdout)
    assert m, r.stdout[-500:]
    assert m.group(2) != "None", f"the transfer ended before the victim stopped: the test did not test: {r.stdout}"
    return float(m.group(1))


@pytest.mark.parametrize("victim,mode", [("prefill", "pull"), ("decode", "push"), ("decode", "pull"),
                                         ("prefill", "push")])
def test_the_blocks_come_back_when_the_ucx_shared_memory_peer_dies_mid_transfer(tmp_path, victim, mode):
    """UCX shared memory emulates RMA with messages the peer's process answers; a dead peer never answers and
    UCX's forced close does not complete requests already sent, so the survivor's transfer stayed in flight and
    its blocks never came back (a decode's destinations of a pull, a prefill's sources of a push). They come back
    once the peer's process is gone and its last messages have been processed."""
    assert run_stopped_peer(tmp_path, victim, mode, "kill") < 5.0


@pytest.mark.parametrize("victim,mode", [("prefill", "push"), ("prefill", "pull"), ("decode", "push"),
                                         ("decode", "pull")])
def test_the_blocks_come_back_when_the_ucx_shared_memory_peer_resumes_after_a_pause_past_the_lease(
        tmp_path, victim, mode):
    """Both sides give up during the pause. The resumed side's own lease check then took the peer for dead and
    disconnected it before its last word ('Q' of a prefill, 'F' of a decode) went out, so the survivor, which
    cannot tell a paused peer from a dead one on UCX's RMA paths, held its blocks while the peer lived (a decode's
    destinations of a push). The last word now goes out before the disconnect."""
    assert run_stopped_peer(tmp_path, victim, mode, "pause") < 5.0


_PAUSED_PAIR_RECOVERS = _SCRIPT_PRELUDE + """
SHAPE, N, LEASE = (2, 16, 8), 8, 0.5
TR = {"ipc": dict(transport="ipc"), "tcp": dict(transport="ucx", tls="tcp", net_devices="lo"),
      "shm": dict(transport="ucx", tls="shm")}

def prefill_proc(conn, tr):
    p = Prefill(kv(seed=7), **TR[tr], heartbeat_s=0.05, lease_s=LEASE)
    conn.send_bytes(p.metadata())
    peer = p.add_peer(conn.recv_bytes())
    begun = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "send":
            p.begin(peer, cmd[1], cmd[2])
            p.layers_ready(cmd[1], range(3))
            begun.append(cmd[1])
            conn.send("ok")
        elif cmd[0] == "readd":
            # disconnect_peer refuses while a transfer with the peer is not final (it unmaps the peer's memory): wait
            # for each first, as the docs say. Transfer 1 may still wait for the decode's word here (the stop came
            # right after it), and it ends at the latest when the lease finds the dropped peer silent.
            for xid in begun:
                st = p.wait(xid, 10)
                assert st.final, (xid, st)
                p.forget(xid)
            begun.clear()
            p.disconnect_peer(peer)
            p.disconnect_peer(peer)  # idempotent
            peer = p.add_peer(conn.recv_bytes())
            conn.send_bytes(p.metadata())
        elif cmd[0] == "exit":
            p.close()
            conn.send("bye")
            return

if __name__ == "__main__":
    tr = sys.argv[1]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=prefill_proc, args=(b, tr), daemon=True)
    proc.start()
    b.close()  # the child's end: a prefill that dies makes recv() raise EOFError instead of waiting forever
    src, dst = kv(seed=7), kv(fill=True)
    d = Decode(dst, **TR[tr], heartbeat_s=0.05, lease_s=LEASE)
    peer = d.add_peer(a.recv_bytes())
    a.send_bytes(d.metadata())

    def transfer(xid, sb, db):
        d.start(peer, xid, db)
        a.send(("send", xid, sb))
        assert a.recv() == "ok"
        st = d.wait(xid, 10, reclaimable=True)
        d.forget(xid)
        moved = all(np.array_equal(dst[l][r].view(np.uint8)[x], src[l][r].view(np.uint8)[y])
                    for l in range(3) for r in range(2) for x, y in zip(db, sb))
        return st, moved

    st, moved = transfer(1, [0], [0])
    assert st.error is None and moved, st
    d.start(peer, 2, [1])  # begun by nobody: the prefill is stopped past the lease
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(3 * LEASE)
    os.kill(proc.pid, signal.SIGCONT)
    # Failed at the lease. Not waited for to be reclaimable: on shared memory a prefill that lives on cannot be
    # revoked, and its block stays held (fail closed) unless the prefill's word came before the drop.
    st = d.wait(2, 10)
    assert st.error is not None, st
    # The pair was dropped: what comes next fails, and says so.
    d.start(peer, 3, [2])
    st = d.wait(3, 10)
    assert st.error is not None and "disconnected" in str(st.error), st
    # Both sides drop the old peer and exchange metadata again: transfers go on.
    d.disconnect_peer(peer)
    a.send(("readd",))
    a.send_bytes(d.metadata())
    peer = d.add_peer(a.recv_bytes())
    for xid, sb, db in ((4, [3], [3]), (5, [4, 5], [6, 7])):
        st, moved = transfer(xid, sb, db)
        assert st.error is None and moved, (xid, st)
    a.send(("exit",))
    assert a.recv() == "bye"
    d.close()
    proc.join(10)
    print("recovered")
"""


@pytest.mark.parametrize("transport", ["ipc", "tcp", "shm"])
def test_a_pair_dropped_at_a_lease_with_both_sides_alive_goes_on_after_both_add_each_other_again(tmp_path, transport):
    """A prefill stopped past the lease (SIGSTOP; a VM migration or swapping does the same) is dropped by its decode
    (fail closed), and every later transfer of the pair fails. Adding the peer again was refused on ipc and over TCP
    as a duplicate (AlreadyExists: the prefill had not noticed), so the pair stayed broken between two live
    processes. disconnect_peer on both sides, then add_peer with fresh metadata, and transfers go on, byte-exact."""
    script = tmp_path / "paused_pair.py"
    script.write_text(_PAUSED_PAIR_RECOVERS)
    r = subprocess.run([sys.executable, str(script), transport], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "recovered" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-3000:])


def test_a_transfer_id_asked_for_again_after_the_prefill_began_it_as_given_up_fails_at_once():
    """The decode cancelled a request before the prefill's begin(), forgot it, and started the id again; the
    prefill took the F, then its begin() (ended as given up), then the new request, which it ignored. The decode
    failed the new transfer a lease later for the prefill's silence and dropped the pair, so the next transfer
    failed too. The prefill now refuses such a request at once, and the pair stays."""
    src_kv, dst_kv = prefill_kv(seed=44), decode_kv()
    with Prefill(src_kv, transport="loopback", **LONG_LEASE) as p, \
            Decode(dst_kv, transport="loopback", **LONG_LEASE) as d:
        to_decode, to_prefill = connect(p, d)
        d.start(to_prefill, 1, [0])
        d.cancel(1)
        wait_final(d, 1, reclaimable=True)
        d.forget(1)
        time.sleep(0.2)  # the prefill takes the request and the F
        p.begin(to_decode, 1, [1])
        assert p.status(1).final and isinstance(p.status(1).error, kvtier.CancelledError)
        d.start(to_prefill, 1, [0])
        started = time.monotonic()
        st = d.wait(1, TIMEOUT, reclaimable=True)
        assert st.final and st.error is not None and "new id" in str(st.error), st
        assert time.monotonic() - started < 1.0  # not the 2 s lease
        assert_poisoned(dst_kv, [0])
        d.forget(1)
        p.forget(1)
        run_transfer(p, d, to_decode, to_prefill, 2, [3, 4], [5, 6])
        assert_moved(src_kv, dst_kv, [3, 4], [5, 6])


def test_a_begin_after_the_decode_cancelled_and_forgot_the_transfer_ends_at_once():
    """The decode cancelled a request the prefill had not begun, and forgot it; the prefill's later begin() of that
    transfer heartbeated a decode that ignores it, so its sources were held for a whole lease."""
    src_kv, dst_kv = prefill_kv(seed=43), decode_kv()
    with Prefill(src_kv, transport="loopback", heartbeat_s=0.05, lease_s=5.0) as p, \
            Decode(dst_kv, transport="loopback", heartbeat_s=0.05, lease_s=5.0) as d:
        d.add_peer(p.metadata())
        to_decode = p.add_peer(d.metadata())
        d.start(0, 1, [0, 1])
        time.sleep(0.1)
        d.cancel(1)
        assert d.wait(1, TIMEOUT, reclaimable=True).reclaimable
        d.forget(1)
        time.sleep(0.1)  # the prefill hears the decode's 'F'
        p.begin(to_decode, 1, [2, 3])
        p.layers_ready(1, range(LAYERS))
        t0 = time.monotonic()
        st = p.wait(1, TIMEOUT)
        assert time.monotonic() - t0 < 1.0
        assert isinstance(st.error, kvtier.CancelledError), st.error
        assert "gave up on transfer 1" in str(st.error)
        p.forget(1)
        assert_poisoned(dst_kv, [0, 1])
        # The same id asked for again is served as usual.
        d.start(0, 1, [0, 1])
        p.begin(to_decode, 1, [2, 3])
        p.layers_ready(1, range(LAYERS))
        assert d.wait(1, TIMEOUT, reclaimable=True).error is None
        assert_moved(src_kv, dst_kv, [2, 3], [0, 1])
