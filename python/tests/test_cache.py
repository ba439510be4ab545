"""The scheduler side from Python: keys, CacheManager plans and acks, a disk storage tier."""

from __future__ import annotations

import pytest

import kvtier

pytestmark = pytest.mark.skipif(not kvtier._native.has_cache, reason="built without the cache bindings")


def test_keys_are_chained_and_namespaced():
    a = kvtier.KeyHasher("org/model@1", block_tokens=4)
    b = kvtier.KeyHasher("org/model@1", block_tokens=4, tenant_salt="tenant-b")
    k1 = a.keys_for(list(range(10)))  # two full blocks; the tail gets no key
    assert len(k1) == 2 and all(len(k) == 32 for k in k1)
    assert a.keys_for(list(range(8))) == k1
    assert a.keys_for([0, 1, 2, 3, 9, 9, 9, 9])[0] == k1[0] and a.keys_for([0, 1, 2, 3, 9, 9, 9, 9])[1] != k1[1]
    assert b.keys_for(list(range(8)))[0] != k1[0], "tenants must not share keys"
    with pytest.raises(kvtier.InvalidArgumentError, match="block_tokens"):
        kvtier.KeyHasher("org/model@1", block_tokens=0)


def test_admit_plan_ack_and_prefix_hits():
    cm = kvtier.CacheManager(device_blocks=4, host_blocks=8, write_policy="write_back")
    h = kvtier.KeyHasher("m", block_tokens=2)
    keys_a = h.keys_for(list(range(8)))  # 4 blocks: fill the device
    a = cm.admit(keys_a)
    assert a["new_blocks"] == 4 and len(a["device_blocks"]) == 4
    cm.commit(a["id"])
    cm.release(a["id"])
    # A second request needs the device: the first's blocks go to host (write-back).
    keys_b = h.keys_for(list(range(100, 108)))
    b = cm.admit(keys_b)
    plan = cm.take_plan()
    assert len(plan["evictions"]) == 4
    cm.ack("evictions", [dst for _, dst, _ in plan["evictions"]])
    cm.commit(b["id"])
    cm.release(b["id"])
    m = cm.match(keys_a)
    assert m["host_blocks"] == 4 and m["device_blocks"] == 0
    # Admitting A again loads its prefix from host.
    a2 = cm.admit(keys_a)
    assert a2["host_hit_blocks"] == 4
    plan = cm.take_plan()
    assert len(plan["loads"]) == 4
    cm.ack("loads", [dst for _, dst, _ in plan["loads"]], error="copy failed")  # a failed load: misses, not garbage
    assert cm.admission_status(a2["id"])["failed"]
    cm.release(a2["id"])
    assert cm.match(keys_a)["device_blocks"] == 0
    cm.check_invariants()
    s = cm.stats()
    assert s["failed_transfers"] >= 1 and s["device"]["capacity"] == 4
    with pytest.raises(kvtier.InvalidArgumentError, match="'sideways'"):
        cm.ack("sideways", [0])
    with pytest.raises(kvtier.NotFoundError):
        cm.release(987654)
    with pytest.raises(kvtier.InvalidArgumentError):
        cm.match(["not-a-key"])


def test_eviction_policies_by_name():
    """The default device policy is the lrfu/arc/lru duel; any duel of online policies is accepted, a bad one is named;
    stats() says which expert leads."""
    h = kvtier.KeyHasher("m", block_tokens=2)
    for kwargs in ({}, {"device_policy": "duel:lru+sieve+lrfu:50"}):
        cm = kvtier.CacheManager(device_blocks=4, **kwargs)
        for r in range(6):  # more requests than the device holds: evictions follow the policy
            a = cm.admit(h.keys_for(list(range(100 * r, 100 * r + 4))))
            cm.commit(a["id"])
            cm.release(a["id"])
        assert cm.match(h.keys_for([500, 501, 502, 503]))["device_blocks"] == 2
        cm.check_invariants()
        device = cm.stats()["device"]  # a duel's lead: its first expert until its window of accesses has passed
        assert (device["policy_expert"], device["policy_switches"]) == (0, 0)
    for bad, says in (("duel:lru", "1 experts"), ("duel:lru+belady", "'belady'"), ("duel:lru+x", "'x'")):
        with pytest.raises(kvtier.InvalidArgumentError, match=says):
            kvtier.CacheManager(device_blocks=4, device_policy=bad)


def test_lookahead_integers_out_of_range_or_not_integers_are_named():
    """nanobind's own refusal of -1 for an unsigned argument (or 2**31 for an int32) was a TypeError naming neither the
    argument nor the value."""
    cm = kvtier.CacheManager(device_blocks=8)
    keys = kvtier.KeyHasher("m", block_tokens=2).keys_for(list(range(4)))
    for call, error, says in [
            (lambda: cm.withdraw(-1), kvtier.OutOfRangeError, r"id -1 is not in \[0, 2\*\*64 - 1\]"),
            (lambda: cm.withdraw(1.0), kvtier.InvalidArgumentError, "id 1.0 is not an integer"),
            (lambda: cm.announcement(True), kvtier.InvalidArgumentError, "id True is not an integer"),
            (lambda: cm.extend_announced(-1, keys), kvtier.OutOfRangeError, "id -1"),
            (lambda: cm.announce(keys, conversation_id=-1), kvtier.OutOfRangeError, "conversation_id -1"),
            (lambda: cm.announce(keys, ttl_steps=-1), kvtier.OutOfRangeError, "ttl_steps -1"),
            (lambda: cm.announce(keys, ttl_steps=2**32), kvtier.OutOfRangeError, "ttl_steps 4294967296"),
            (lambda: cm.announce(keys, priority=2**31), kvtier.OutOfRangeError, "priority 2147483648"),
            (lambda: cm.announce(keys, priority="high"), kvtier.InvalidArgumentError, "priority 'high'")]:
        with pytest.raises(error, match=says):
            call()
    assert cm.stats()["queued_requests"] == 0  # nothing above was announced
    qid = cm.announce(keys, conversation_id=2**64 - 1, ttl_steps=2**32 - 1, priority=-(2**31))
    assert cm.announcement(qid)["conversation_id"] == 2**64 - 1
    cm.withdraw(qid)


def test_request_integers_and_hints_out_of_range_or_none_are_named():
    """The request path's integers (admit, commit, release, admission_status; HybridCache's too) and None for a hint
    were refused by nanobind with a TypeError naming neither the argument nor the value."""
    cm = kvtier.CacheManager(device_blocks=8)
    keys = kvtier.KeyHasher("m", block_tokens=2).keys_for(list(range(4)))
    hc = kvtier.HybridCache([dict(name="full", kind="full", block_tokens=16, device_blocks=16)])
    chain = kvtier.KeyHasher("m", block_tokens=16).keys_for(list(range(64)))
    for call, error, says in [
            (lambda: cm.admit(keys, -1), kvtier.OutOfRangeError, "extra_blocks -1"),
            (lambda: cm.commit(1, -1), kvtier.OutOfRangeError, "num_computed -1"),
            (lambda: cm.release(-1), kvtier.OutOfRangeError, "admission -1"),
            (lambda: cm.admission_status(None), kvtier.InvalidArgumentError, "admission None"),
            (lambda: cm.withdraw(None), kvtier.InvalidArgumentError, "id None"),
            (lambda: cm.announce(keys, conversation_id=None), kvtier.InvalidArgumentError, "conversation_id None"),
            (lambda: cm.announce(keys, priority=None), kvtier.InvalidArgumentError, "priority None"),
            (lambda: cm.announce(keys, continuation=None), kvtier.InvalidArgumentError, "continuation None"),
            (lambda: hc.announce(-1, [chain]), kvtier.OutOfRangeError, "num_tokens -1"),
            (lambda: hc.announce(64, [chain], max_hit_tokens=-1), kvtier.OutOfRangeError, "max_hit_tokens -1"),
            (lambda: hc.announce(2**32, [chain]), kvtier.OutOfRangeError, "num_tokens 4294967296"),
            (lambda: hc.admit(64, [chain], extra_tokens=-1), kvtier.OutOfRangeError, "extra_tokens -1"),
            (lambda: hc.match(64.0, [chain]), kvtier.InvalidArgumentError, "num_tokens 64.0"),
            (lambda: hc.commit(1, -1), kvtier.OutOfRangeError, "num_computed_tokens -1"),
            (lambda: hc.release(-1), kvtier.OutOfRangeError, "admission -1"),
            (lambda: hc.withdraw(None), kvtier.InvalidArgumentError, "id None")]:
        with pytest.raises(error, match=says):
            call()
    a = cm.admit(keys)  # the same calls with good values still work
    cm.commit(a["id"], 0)
    cm.release(a["id"])


def _settle(cm):
    """Acks every move of the next plan as done (the engine's copies, all succeeded)."""
    plan = cm.take_plan()
    for kind in ("evictions", "backups", "loads", "storage_writes", "storage_prefetches"):
        if plan[kind]:
            cm.ack(kind, [dst for _, dst, _ in plan[kind]])
    return plan


def _serve(cm, keys, extra=0):
    for _ in range(8):
        try:
            a = cm.admit(keys, extra)
            _settle(cm)
            return a
        except kvtier.ResourceExhaustedError:
            _settle(cm)
    raise AssertionError(f"{len(keys)} blocks never admitted")


def test_an_announcement_never_makes_an_admission_fail():
    """Protection is a preference, never a refusal: with write-back to storage, a full host holding an announced
    block's clean copy (also in storage) and an unprotected dirty one, the admission that needs a host block now
    drops the clean protected copy rather than start a demotion and be refused."""
    hasher = kvtier.KeyHasher("m", block_tokens=1)

    def scenario(announce):
        cm = kvtier.CacheManager(device_blocks=3, host_blocks=2, storage_blocks=4, write_policy="write_back")
        p, z, w = hasher.keys_for([0]), hasher.keys_for([100, 101, 102]), hasher.keys_for([200, 201, 202])
        for keys in (p, z, w):
            a = _serve(cm, keys)
            cm.commit(a["id"])
            cm.release(a["id"])
        cm.release(_serve(cm, w[:2], 1)["id"])
        cm.release(_serve(cm, w[:1], 2)["id"])  # w[1] on device, w[2] dirty on host only
        cm.admit(hasher.keys_for([400, 401]))  # a running request holds two device blocks
        _settle(cm)
        for _ in range(8):  # p: a host copy and a storage copy (clean)
            if cm.match(p)["host_blocks"]:
                break
            cm.prefetch(p)
            _settle(cm)
        assert cm.match(p)["host_blocks"] == 1
        if announce:
            cm.announce(p)
        cm.admit(hasher.keys_for([500]))
        cm.check_invariants()

    scenario(False)
    scenario(True)  # raised ResourceExhaustedError ("the evictable ones wait for host blocks")


def test_an_announcement_never_makes_an_admission_fail_past_the_dirty_window():
    """As above, with more than the scan's window of dirty host copies ahead of the announced clean one: the scan
    stopped on its window's last dirty copy, so the protected clean copy was never considered, a demotion started
    instead and the admission that needed a host block now was refused."""
    def key(i):
        return "%032x" % (0x1000 + i)

    def run(announce_c):
        cfg = {"lookahead_prefetch_blocks": 0, "device_policy": "lru", "host_policy": "lru", "storage_policy": "lru"}
        cm = kvtier.CacheManager(device_blocks=4, host_blocks=70, storage_blocks=300, write_policy="write_back",
                                 config=cfg, env=False)

        def pump(skip_loads=False):
            plan = cm.take_plan()
            for kind in ("evictions", "backups", "loads", "storage_writes", "storage_prefetches"):
                if plan[kind] and not (skip_loads and kind == "loads"):
                    cm.ack(kind, [dst for _, dst, _ in plan[kind]])

        def serve(keys):
            a = cm.admit(keys)
            cm.commit(a["id"])
            cm.release(a["id"])
            pump()

        n = iter(range(100, 1000))
        c, d, m, mc = key(1), key(2), key(3), key(4)
        serve([c, d])
        for _ in range(4):
            serve([key(next(n))])  # d, then c, evicted to host
        a = cm.admit([c])  # c loaded: on device and host (a clean host copy)
        pump()
        cm.release(a["id"])
        a = cm.admit([c, d])  # d's load left in flight holds c's device copy
        pump(skip_loads=True)
        cm.release(a["id"])
        serve([m, mc])
        cm.announce([m])
        last = None
        while cm.stats()["host"]["used"] < 70:  # dirty host-only copies ahead of c
            last = key(next(n))
            serve([last])
        cm.admit([last])  # a running request pins the last one
        if announce_c:
            cm.announce([c])
        cm.admit([key(next(n))])  # needs a host block now
        cm.check_invariants()

    run(False)
    run(True)  # raised ResourceExhaustedError ("evictable ones wait for host blocks")


def test_a_prefetch_starts_no_demotion_and_drops_no_last_copy():
    """A look-ahead load is a bet on a queued request: with write-back to storage and a full host it demoted an
    unprotected dirty host copy and dropped a device block that was on no other tier to make room."""
    hasher = kvtier.KeyHasher("m", block_tokens=1)

    def copies(announce):
        cm = kvtier.CacheManager(device_blocks=4, host_blocks=2, storage_blocks=8, write_policy="write_back")
        p, d, v = hasher.keys_for([0]), hasher.keys_for([50]), hasher.keys_for([100, 101, 102, 103])
        for keys in (p, d, v):  # p, d dirty on host (host full), v fills the device
            a = _serve(cm, keys)
            cm.commit(a["id"])
            cm.release(a["id"])
        if announce:
            cm.announce(p)
        plans = [_settle(cm), _settle(cm)]
        m = cm.match(v)
        cm.check_invariants()
        return m["device_blocks"] + m["host_blocks"] + m["storage_blocks"], cm.stats()["drops_device"], plans

    assert copies(False)[:2] == (4, 0)
    kept, dropped, plans = copies(True)
    assert (kept, dropped) == (4, 0)
    assert not any(plan["storage_writes"] for plan in plans), "the prefetch queued a demotion"


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_a_prefetch_drops_no_last_copy_without_a_storage_tier(write_policy):
    """The prefetch's guards held only for write-back with a storage tier: with device and host tiers alone, a
    look-ahead load of an announced host block dropped a device block that was on no other tier."""
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=1, write_policy=write_policy,
                             config={"lookahead_max_fraction": 1.0, "device_policy": "lru", "host_policy": "lru"},
                             env=False)
    x, w, y = hasher.keys_for([1]), hasher.keys_for([2]), hasher.keys_for([3])
    for keys in (x, w, y):  # y's admission moves x to the host (write-back) or drops x's device copy
        a = _serve(cm, keys)
        cm.commit(a["id"])
        cm.release(a["id"])
        _settle(cm)
    held = {k: sum(cm.match(keys)[t] for t in ("device_blocks", "host_blocks")) for k, keys in
            (("x", x), ("w", w), ("y", y))}
    cm.announce(x)
    _settle(cm)
    _settle(cm)
    for name, keys in (("w", w), ("y", y)):
        if held[name]:
            m = cm.match(keys)
            assert m["device_blocks"] + m["host_blocks"] == 1, f"the prefetch of x destroyed {name}'s only copy"
    cm.check_invariants()


def test_storage_slots_given_up_come_in_the_plan_to_delete():
    """The plan named no storage slot the cache gave up, so an engine's store kept every object ever written (a tier
    of 2,000 blocks left 15,120 files). Now each such slot comes once in storage_drops, as (slot, None, key)."""
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=2, storage_blocks=4, write_policy="write_back")
    written, dropped = [], []

    def settle():
        plan = _settle(cm)
        written.extend(k for _, _, k in plan["storage_writes"])
        dropped.extend(plan["storage_drops"])

    for i in range(30):
        for _ in range(8):
            try:
                a = cm.admit(hasher.keys_for([10 * i, 10 * i + 1]))
                break
            except kvtier.ResourceExhaustedError:
                settle()
        settle()
        cm.commit(a["id"])
        cm.release(a["id"])
        settle()
    assert len(written) > 12 and dropped, "the tier of 4 blocks turned over without a drop"
    assert len(dropped) + cm.stats()["storage"]["used"] == len(written)
    assert cm.stats()["drops_storage"] <= len(dropped)
    cm.ack("storage_drops", [m[1] for m in dropped])  # a loop that acks every list of a plan: nothing to do
    for slot, dst, key in dropped:
        assert dst is None and 0 <= slot < 4
        assert cm.match([key])["storage_blocks"] == 0, key
    assert len({k for _, _, k in dropped}) == len(dropped), "a slot dropped twice"
    cm.check_invariants()


def test_prefetch_reaches_announcements_behind_many_uncached_ones():
    """Each call looks at a bounded number of keys; it walked from the head every time, so an announcement behind
    1,024 uncached ones (a key each) was never prefetched while they stayed queued."""
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    for ahead in (10, 3000):
        cm = kvtier.CacheManager(device_blocks=16, host_blocks=32)
        wanted = hasher.keys_for([0, 1])
        for keys in (wanted, hasher.keys_for(list(range(100, 116)))):  # wanted -> host
            a = _serve(cm, keys)
            cm.commit(a["id"])
            cm.release(a["id"])
        assert cm.match(wanted)["host_blocks"] == 2
        for i in range(ahead):  # fresh prompts, nothing cached
            cm.announce(hasher.keys_for([10**6 + i]))
        cm.announce(wanted)
        loads = sum(len(_settle(cm)["loads"]) for _ in range(100))
        assert loads == 2, f"{ahead} ahead: {loads} loads"
        assert cm.match(wanted)["device_blocks"] == 2


def test_announced_requests_are_prefetched_and_withdrawn():
    """Look-ahead: a queued request's blocks that sit on host come back to the device ahead of its admission;
    a withdrawn announcement is gone; bad hints are refused by name."""
    cm = kvtier.CacheManager(device_blocks=8, host_blocks=16, write_policy="write_back")
    h = kvtier.KeyHasher("m", block_tokens=2)
    keys_a = h.keys_for(list(range(4)))  # 2 blocks
    keys_b = h.keys_for(list(range(100, 116)))  # 8 blocks: the whole device

    def run(keys):
        adm = cm.admit(keys)
        plan = cm.take_plan()
        for kind in ("evictions", "loads"):
            if plan[kind]:
                cm.ack(kind, [dst for _, dst, _ in plan[kind]])
        cm.commit(adm["id"])
        cm.release(adm["id"])

    run(keys_a)
    run(keys_b)  # A goes to host
    assert cm.match(keys_a)["host_blocks"] == 2
    qid = cm.announce(keys_a, conversation_id=7, continuation="continues", priority=1)
    info = cm.announcement(qid)
    assert info["queued"] and info["keys"] == 2 and info["continuation"] == "continues"
    plan = cm.take_plan()
    assert sorted(k for _, _, k in plan["loads"]) == sorted(keys_a)  # prefetched, not yet admitted
    cm.ack("evictions", [dst for _, dst, _ in plan["evictions"]])
    cm.ack("loads", [dst for _, dst, _ in plan["loads"]])
    assert cm.match(keys_a)["device_blocks"] == 2
    s = cm.stats()
    assert s["queued_requests"] == 1 and s["lookahead_loads"] == 2 and s["protected_blocks"][0] == 2
    a = cm.admit(keys_a)
    assert a["device_hit_blocks"] == 2
    cm.release(a["id"])
    cm.withdraw(qid)
    assert cm.stats()["queued_requests"] == 0
    with pytest.raises(kvtier.FailedPreconditionError):
        cm.withdraw(qid)
    with pytest.raises(kvtier.InvalidArgumentError, match="'forever'"):
        cm.announce(keys_a, continuation="forever")
    with pytest.raises(kvtier.NotFoundError):
        cm.announcement(987654)
    cm.check_invariants()


def test_disk_storage_round_trip(tmp_path):
    st = kvtier.StorageBackend.open(f"disk:{tmp_path}/store?durability=process", namespace="model-a")
    key = kvtier.KeyHasher("m", block_tokens=2).keys_for([1, 2])[0]
    payload = bytes(range(256)) * 16
    assert st.get(key, 8192) is None and not st.exists(key)
    st.put(key, payload)
    assert st.exists(key) and st.get(key, 8192) == payload
    with pytest.raises(kvtier.InvalidArgumentError):
        st.get(key, 16)  # the destination is smaller than the object
    assert st.delete(key) and not st.exists(key)
    st.put(key, payload)
    del st  # one backend per directory at a time
    other = kvtier.StorageBackend.open(f"disk:{tmp_path}/store?durability=process", namespace="model-b")
    assert other.get(key, 8192) is None, "namespaces must not share objects"
    with pytest.raises(kvtier.KvtierError, match="nope"):
        kvtier.StorageBackend.open("nope:/x")
    # close() releases the directory (a second backend over it was refused until the first was collected).
    other.close()
    other.close()
    with pytest.raises(kvtier.FailedPreconditionError, match="was closed"):
        other.get(key, 8192)
    spec = f"disk:{tmp_path}/store?durability=process"
    first = kvtier.StorageBackend.open(spec, namespace="model-d")
    with pytest.raises(kvtier.FailedPreconditionError, match="locked by another backend"):
        kvtier.StorageBackend.open(spec, namespace="model-d")
    first.close()
    kvtier.StorageBackend.open(spec, namespace="model-d").close()  # free once closed, the object still referenced
    other = kvtier.StorageBackend.open(f"disk:{tmp_path}/store?durability=process", namespace="model-b")
    with pytest.raises(kvtier.OutOfRangeError, match="rank -1"):
        other.put(key, payload, rank=-1)
    with pytest.raises(kvtier.OutOfRangeError, match="max_bytes -1"):
        other.get(key, -1)
    with pytest.raises(kvtier.OutOfRangeError, match="rank 4294967296"):
        other.exists_many([key], rank=2**32)


def test_a_buffer_stays_exported_while_its_batch_runs():
    """The batch kept the buffer's object but released its export before the backend ran: a bytearray cleared (or
    an mmap closed) on another thread meanwhile let the backend write freed memory (a segfault)."""
    import threading
    import time
    s = kvtier.StorageBackend.open("memory:?capacity=256M")
    key, n = "%032x" % 1, 32 << 20
    s.put(key, b"\xab" * n)
    buf, outcome = bytearray(n), []

    def shrink():
        time.sleep(0.002)
        try:
            buf.clear()
            outcome.append("cleared")
        except BufferError:
            outcome.append("refused")

    t = threading.Thread(target=shrink)
    t.start()
    assert s.get_many([key], [buf]) == [n]
    t.join()
    assert outcome in (["refused"], ["cleared"])
    if outcome == ["refused"]:  # the clear ran while the batch did: it must have been refused
        assert bytes(buf[:4]) == b"\xab" * 4 and len(buf) == n


def test_get_returns_the_current_object_while_another_thread_replaces_it():
    """get() sized its buffer by a separate exists() and retried once: a writer alternating small and large values
    made it raise InvalidArgumentError about a "destination" the caller never passed (up to 23 % of gets)."""
    import threading
    import time
    s = kvtier.StorageBackend.open("memory:?capacity=8M")
    key = "%032x" % 2
    small, large = b"s" * 100, b"L" * 100_000
    s.put(key, small)
    stop = time.monotonic() + 1.0

    def writer():
        i = 0
        while time.monotonic() < stop:
            s.put(key, large if i % 2 else small)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    gets = 0
    while time.monotonic() < stop:
        got = s.get(key, max_bytes=1 << 30)
        assert got in (small, large)
        gets += 1
    t.join()
    assert gets > 0


def test_kv_events_refuse_a_zero_block_size_and_a_tier_medium():
    cm = kvtier.CacheManager(device_blocks=4, host_blocks=8)
    with pytest.raises(kvtier.InvalidArgumentError, match="block_size 0"):
        cm.enable_kv_events(0)
    with pytest.raises(kvtier.InvalidArgumentError, match="storage_medium 'GPU': DISK or REMOTE"):
        cm.enable_kv_events(2, storage_medium="GPU")
    cm.enable_kv_events(2, storage_medium="REMOTE")
    kvtier.CacheManager(device_blocks=4, host_blocks=8).enable_kv_events(2, storage_medium="STORAGE")  # vLLM's name
    with pytest.raises(kvtier.OutOfRangeError, match="block_size -2"):
        cm.enable_kv_events(-2)


_THREADS_THAT_RAISE = """
import threading, kvtier
cm = kvtier.CacheManager(device_blocks=64, host_blocks=64)
h = kvtier.KeyHasher("m", block_tokens=2)
def work(seed):
    for i in range(3000):
        keys = h.keys_for([seed, i, i + 1, i + 2])
        try:
            a = cm.admit(keys)
            cm.commit(a["id"])
            cm.release(a["id"])
        except kvtier.KvtierError:
            pass
        try:
            cm.commit(10**9 + i)  # unknown: raises every time
        except kvtier.KvtierError:
            pass
        cm.stats()
threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print("done")
"""


def test_threads_whose_calls_raise_share_a_cache_manager_without_deadlock():
    # Calls held the manager's mutex while they built results and raised, which runs Python code; a thread given the
    # GIL meanwhile waited for that mutex with the GIL held, and neither went on. They now wait with it released.
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", _THREADS_THAT_RAISE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("threads sharing a CacheManager deadlocked")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "done"


def test_an_ack_of_a_move_take_plan_has_not_handed_out_is_refused():
    """An eviction acked before take_plan() handed it out was accepted: the block was matchable on host although
    no byte had been copied, and the engine's real ack of the move was refused later."""
    h = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=4, write_policy="write_back")
    a_keys, b_keys = h.keys_for([1, 2]), h.keys_for([7, 8])
    a = cm.admit(a_keys)
    cm.commit(a["id"])
    cm.release(a["id"])
    cm.admit(b_keys)  # queues the evictions of a's blocks
    for hb in range(4):
        with pytest.raises(kvtier.FailedPreconditionError, match=f"host block {hb} has"):
            cm.ack("evictions", [hb])
    assert cm.match(a_keys)["host_blocks"] == 0
    plan = cm.take_plan()
    assert len(plan["evictions"]) == 2
    cm.ack("evictions", [d for _, d, _ in plan["evictions"]])
    assert cm.match(a_keys)["host_blocks"] == 2
    cm.check_invariants()


def test_a_refused_attach_metrics_registers_nothing():
    """A label clashing with the manager's own ('tier') was found halfway: the series registered before it stayed,
    and fixed their families' label names, so every later attach in the process was refused."""
    import kvtier.metrics as metrics
    cm1, cm2 = kvtier.CacheManager(device_blocks=2), kvtier.CacheManager(device_blocks=2)
    with pytest.raises(kvtier.InvalidArgumentError, match="'tier'"):
        cm1.attach_metrics({"tier": "x-refused"})
    assert not [line for line in metrics.text().splitlines() if 'tier="x-refused"' in line]
    cm2.attach_metrics({"engine": "attach-after-refusal"})


@pytest.mark.parametrize("kwargs,named", [(dict(device_blocks=-1), "device_blocks -1"),
                                          (dict(device_blocks=4, host_blocks=2**32), "host_blocks 4294967296"),
                                          (dict(device_blocks=4, write_through_threshold=-1),
                                           "write_through_threshold -1")])
def test_constructor_integers_out_of_range_are_named(kwargs, named):
    with pytest.raises(kvtier.OutOfRangeError, match=named):
        kvtier.CacheManager(**kwargs)


def _ack_all(cm):
    p = cm.take_plan()
    for kind in ("evictions", "backups", "loads"):
        if p[kind]:
            cm.ack(kind, [d for _, d, _ in p[kind]])


def _cached_on_host(cm, hasher, keys, others):
    """Serves `keys`, then the ids `others`, which push them to host."""
    a = cm.admit(keys)
    cm.commit(a["id"])
    cm.release(a["id"])
    x = cm.admit(hasher.keys_for(others))
    _ack_all(cm)
    cm.commit(x["id"])
    cm.release(x["id"])


def _loads_of(cm, plan):
    """Acks a plan's evictions; its loads by key: (host source, device destination)."""
    if plan["evictions"]:
        cm.ack("evictions", [d for _, d, _ in plan["evictions"]])
    return {key: (src, dst) for src, dst, key in plan["loads"]}


def _new_requests_never_write(cm, hasher, host_block, rounds=6):
    """Serves `rounds` two-block requests; none of their moves may write `host_block` (a load still reads it)."""
    for i in range(rounds):
        r = cm.admit(hasher.keys_for([100 + 10 * i, 101 + 10 * i]))
        p = cm.take_plan()
        written = [d for _, d, _ in p["evictions"] + p["backups"] + p["storage_prefetches"]]
        assert host_block not in written, f"host block {host_block} is written while a load reading it is in flight"
        for kind in ("evictions", "backups"):
            if p[kind]:
                cm.ack(kind, [d for _, d, _ in p[kind]])
        cm.commit(r["id"])
        cm.release(r["id"])
        cm.check_invariants()


def test_a_failed_load_above_a_lookahead_load_another_admission_pinned_keeps_the_tier_order():
    # K0's admitted load and K1's look-ahead load are in flight; a second request that stopped at K0 computed K0..K2
    # itself and committed K0, K1 (pinning the in-flight nodes). K0's load failed: K1 was sent back to host on its
    # ack while pinned, and the second request's K2 was indexed on the device below it (tier order broken).
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=6, host_blocks=8, write_policy="write_back")
    keys = hasher.keys_for([1, 2, 3])
    _cached_on_host(cm, hasher, keys[:2], list(range(100, 106)))
    assert cm.match(keys[:2])["host_blocks"] == 2
    cm.announce(keys[:2])
    first = cm.admit(keys[:1])
    load_dst = {key: dst for key, (_, dst) in _loads_of(cm, cm.take_plan()).items()}
    assert keys[0] in load_dst and keys[1] in load_dst
    second = cm.admit(keys)
    cm.commit(second["id"], 2)
    cm.ack("loads", [load_dst[keys[0]]], error="copy failed")
    cm.check_invariants()
    cm.commit(second["id"], 3)
    cm.check_invariants()
    assert cm.admission_status(first["id"])["failed"]
    cm.ack("loads", [load_dst[keys[1]]])
    cm.check_invariants()
    for adm in (first, second):
        cm.release(adm["id"])
    cm.check_invariants()


def test_a_host_copy_a_load_still_reads_is_not_reused_before_that_load_acks():
    # A's load failed while B's (below it) was in flight: B's host copy moved to the node that replaced B, which
    # could be dropped and its host block made the destination of a new eviction while B's load still read it.
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=4, host_blocks=4, write_policy="write_back")
    ab = hasher.keys_for([1, 2])
    _cached_on_host(cm, hasher, ab, [10, 11, 12, 13])
    again = cm.admit(ab)
    loads = _loads_of(cm, cm.take_plan())
    src_b, dst_b = loads[ab[1]]
    cm.ack("loads", [loads[ab[0]][1]], error="copy failed")
    cm.release(again["id"])
    cm.check_invariants()
    _new_requests_never_write(cm, hasher, src_b)
    cm.ack("loads", [dst_b])  # now the host copy may go
    cm.check_invariants()


@pytest.mark.parametrize("kind", ["sliding_window", "state"])
def test_hybrid_failed_load_stays_failed_after_a_commit(kind):
    # A commit slid the window (or the state) past the block whose load failed, and admission_status() then said
    # ready, not failed: an engine checking between prefill chunks went on with the failed load's bytes.
    block = 4 if kind == "sliding_window" else 8
    hasher = kvtier.KeyHasher("m", block_tokens=block)
    group = dict(name="g", kind=kind, block_tokens=block, device_blocks=4 if kind == "sliding_window" else 3,
                 host_blocks=8)
    if kind == "sliding_window":
        group["window_tokens"] = 4
    hc = kvtier.HybridCache([group])

    def settle():
        for gi, p in enumerate(hc.take_plan()):
            for k in ("evictions", "backups", "loads", "storage_writes", "storage_prefetches"):
                if p[k]:
                    hc.ack(gi, k, [d for _, d, _ in p[k]])

    prompt = list(range(8))
    a = hc.admit(8, [hasher.keys_for(prompt)])
    hc.commit(a["id"], 8)
    hc.release(a["id"])
    pushes = [range(100, 116)] if kind == "sliding_window" else [range(100, 108), range(200, 208), range(300, 308)]
    for ids in pushes:  # push the prompt's blocks to host
        other = list(ids)
        x = hc.admit(len(other), [hasher.keys_for(other)])
        settle()
        hc.commit(x["id"], len(other))
        hc.release(x["id"])
    settle()
    longer = prompt + list(range(50, 58))
    r = hc.admit(len(longer), [hasher.keys_for(longer)])
    assert r["hit_tokens"] == 8
    plan = hc.take_plan()[0]
    if plan["evictions"]:
        hc.ack(0, "evictions", [d for _, d, _ in plan["evictions"]])
    assert plan["loads"]
    hc.ack(0, "loads", [d for _, d, _ in plan["loads"]], error="copy failed")
    assert hc.admission_status(r["id"])["failed"]
    hc.commit(r["id"], 12 if kind == "state" else len(longer))
    st = hc.admission_status(r["id"])
    assert st["failed"] and not st["ready"] and st["failed_group"] == 0, st
    hc.release(r["id"])
    hc.check_invariants()


def test_a_host_copy_a_load_reads_stays_pinned_when_a_second_load_of_it_fails():
    # X's load of B (from host block hB) is in flight when A's fails; Y loads B again from hB and that load fails
    # too: the node that took hB in the second failure was not pinned for X's load, and hB became an eviction's
    # destination while X's load still read it.
    hasher = kvtier.KeyHasher("m", block_tokens=1)
    cm = kvtier.CacheManager(device_blocks=6, host_blocks=6, write_policy="write_back")
    ab = hasher.keys_for([1, 2])
    _cached_on_host(cm, hasher, ab, list(range(10, 16)))
    first = cm.admit(ab)
    loads = _loads_of(cm, cm.take_plan())
    h_b, d_b = loads[ab[1]]
    cm.ack("loads", [loads[ab[0]][1]], error="copy failed")
    second = cm.admit(ab)
    again = _loads_of(cm, cm.take_plan())
    assert again[ab[1]][0] == h_b
    cm.ack("loads", [again[ab[1]][1]], error="copy failed")
    cm.ack("loads", [again[ab[0]][1]])
    cm.release(second["id"])
    cm.release(first["id"])
    cm.check_invariants()
    _new_requests_never_write(cm, hasher, h_b)
    cm.ack("loads", [d_b])
    cm.check_invariants()


@pytest.mark.parametrize("parent_first", [True, False])
def test_failed_transfers_counts_every_failed_ack_in_any_order(parent_first):
    """Two failed loads of one chain in one ack counted 1 when the parent came first (its failure had already
    invalidated the child) and 2 the other way."""
    key = lambda i: "%032x" % (i + 1)  # noqa: E731
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=4, device_policy="lru", env=False)
    a = cm.admit([key(0), key(1)])
    cm.commit(a["id"])
    cm.release(a["id"])
    b = cm.admit([key(5), key(6)])
    p = cm.take_plan()  # evicts key 0 and 1 to host
    cm.ack("evictions", [m[1] for m in p["evictions"]])
    cm.commit(b["id"])
    cm.release(b["id"])
    c = cm.admit([key(0), key(1)])
    p = cm.take_plan()  # loads them back
    cm.ack("evictions", [m[1] for m in p["evictions"]])
    loads = {m[2]: m[1] for m in p["loads"]}
    order = [loads[key(0)], loads[key(1)]] if parent_first else [loads[key(1)], loads[key(0)]]
    cm.ack("loads", order, "copy failed")
    assert cm.stats()["failed_transfers"] == 2
    assert cm.admission_status(c["id"])["failed"]
    cm.release(c["id"])
    cm.check_invariants()


@pytest.mark.parametrize("load_fails", [False, True])
def test_blocks_computed_past_a_loading_hit_are_committed_only_after_its_ack(load_fails):
    """commit() indexed blocks computed on a host hit whose load was not acked yet; when that load then failed, the
    block computed on it stayed indexed (and moved down the tiers) and was served. Now commit past the hit is
    refused while a hit is loading; after a failed load nothing past it is indexed."""
    key = lambda i: "%032x" % (i + 1)  # noqa: E731
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=4, device_policy="lru", env=False)
    a = cm.admit([key(0)])
    cm.commit(a["id"])
    cm.release(a["id"])
    b = cm.admit([key(5), key(6)])
    p = cm.take_plan()  # key 0 to host
    cm.ack("evictions", [m[1] for m in p["evictions"]])
    cm.commit(b["id"])
    cm.release(b["id"])
    c = cm.admit([key(0), key(1)])  # key 0: a host hit, loading; key 1: computed by the forward
    assert c["host_hit_blocks"] == 1
    p = cm.take_plan()
    cm.ack("evictions", [m[1] for m in p["evictions"]])
    with pytest.raises(kvtier.FailedPreconditionError, match="still loading"):
        cm.commit(c["id"])
    cm.commit(c["id"], 1)  # the hit itself: nothing computed on it
    cm.ack("loads", [m[1] for m in p["loads"]], "copy failed" if load_fails else None)
    cm.commit(c["id"])
    cm.release(c["id"])
    m = cm.match([key(0), key(1)])
    assert m["device_blocks"] + m["host_blocks"] == (1 if load_fails else 2), m
    cm.check_invariants()


def test_a_request_whose_own_host_hits_fill_the_host_is_admitted_after_a_demotion():
    """The device block D is the last copy of a block whose child is in storage only (it can only go to host), and
    the host's one block holds Y, which the request [Y, N] pins as its own host hit: admit() was refused at every
    retry with nothing in flight. Now the refusal serves the request without its host hits, which lets Y's host
    copy be demoted; after that write's ack the request is admitted."""
    key = lambda i: "%032x" % (i + 1)  # noqa: E731
    d, s, x, y, z, n = key(0), key(1), key(10), key(20), key(30), key(40)
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=1, storage_blocks=2, write_policy="write_back",
                             device_policy="lru", host_policy="lru", env=False)

    def step(keys):
        a = cm.admit(keys)
        _settle_until_empty(cm, 4)
        cm.commit(a["id"])
        cm.release(a["id"])

    for keys in ([d, s], [x], [y], [d], [z]):
        step(keys)
    assert cm.match([d, s])["storage_blocks"] == 1 and cm.match([y])["host_blocks"] == 1
    for attempt in range(4):
        try:
            a = cm.admit([y, n])
            break
        except kvtier.ResourceExhaustedError:
            _settle_until_empty(cm, 4)
    else:
        raise AssertionError("refused at every retry")
    assert attempt <= 1 and a["new_blocks"] == 2, a  # Y went to storage meanwhile: computed again with N
    cm.release(a["id"])
    cm.check_invariants()


def _keys(*ids):
    return ["%032x" % (0x1000 + i) for i in ids]


def _ack_plan(cm, plan, error=None):
    for kind, moves in plan.items():
        if moves:
            cm.ack(kind, [m[1] for m in moves], error)


def _settle_until_empty(cm, rounds):
    """Takes and acks plans (storage_drops included: ack() takes them and does nothing) until one is empty."""
    for _ in range(rounds):
        plan = cm.take_plan()
        if not any(plan.values()):
            return
        _ack_plan(cm, plan)


def _run(cm, keys):
    a = cm.admit(keys)
    _ack_plan(cm, cm.take_plan())
    cm.commit(a["id"])
    cm.release(a["id"])


def test_a_refusal_that_an_ack_in_flight_ends_keeps_the_host_hit():
    """The retry without host hits must not fire while a move in flight holds a host block (here an eviction): its
    ack ends the refusal, and serving the request without its hit dropped the hit's only copy."""
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=2, device_policy="lru", host_policy="lru", env=False)
    _run(cm, _keys(1))
    _run(cm, _keys(2, 3))  # key 1 to host
    a = cm.admit(_keys(4))
    in_flight = cm.take_plan()  # an eviction to host, not acked yet
    cm.commit(a["id"])
    cm.release(a["id"])
    before = cm.stats()
    with pytest.raises(kvtier.ResourceExhaustedError):
        cm.admit(_keys(1, 5))
    after = cm.stats()
    assert (after["admissions"] - before["admissions"], after["admission_failures"] - before["admission_failures"]) \
        == (1, 1), "one refused call counts once"
    assert cm.match(_keys(1))["host_blocks"] == 1 and after["lost_host_drops"] == 0
    _ack_plan(cm, in_flight)
    b = cm.admit(_keys(1, 5))
    assert b["host_hit_blocks"] == 1
    cm.release(b["id"])
    cm.check_invariants()


def test_a_dropped_slot_of_an_invalidated_block_never_names_the_key_stored_again():
    """A block invalidated while an admission pinned it, then computed and stored again by another request: when the
    pin went, the old storage slot was dropped under the key, and an executor deleted the new object."""
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=4, storage_blocks=64, write_policy="write_through",
                             device_policy="lru", host_policy="lru", env=False)
    x = _keys(1)

    def settle(failing=()):
        drops = []
        for _ in range(6):
            p = cm.take_plan()
            if not any(p.values()):
                break
            drops += [k for _, _, k in p["storage_drops"]]
            for kind, moves in p.items():
                if moves:
                    cm.ack(kind, [m[1] for m in moves], "copy failed" if kind in failing else None)
        return drops

    a = cm.admit(x)
    settle()
    cm.commit(a["id"])
    cm.release(a["id"])
    for keys in (_keys(50), _keys(51, 52)):  # x off the device
        _run(cm, keys)
        settle()
    a1 = cm.admit(x)
    assert a1["host_hit_blocks"] == 1
    settle(failing=("loads",))
    cm.release(a1["id"])
    settle()
    a2 = cm.admit(x)  # a second failed load: x is invalidated while a2 pins it
    settle(failing=("loads",))
    b = cm.admit(x)  # x computed again, and stored (write-through)
    settle()
    cm.commit(b["id"])
    cm.release(b["id"])
    settle()
    cm.release(a2["id"])
    assert x[0] not in settle(), "the old slot's drop named the key whose new object is stored"
    m = cm.match(x)
    assert m["device_blocks"] + m["host_blocks"] + m["storage_blocks"] == 1
    cm.check_invariants()


def test_reset_gives_up_every_storage_slot_in_the_next_plan():
    """reset() forgot the storage tier's slots with their objects left in the backend (and refused while only drops
    were pending, with nothing to acknowledge)."""
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=2, storage_blocks=8, write_policy="write_through", env=False)
    written = set()
    for i in range(4):
        a = cm.admit(_keys(10 * i))
        p = cm.take_plan()
        _ack_plan(cm, p)
        cm.commit(a["id"])
        cm.release(a["id"])
        for _ in range(3):
            p = cm.take_plan()
            written |= {k for _, _, k in p["storage_writes"]}
            _ack_plan(cm, p)
    held = cm.stats()["storage"]["used"]
    assert held > 0
    cm.reset()
    p = cm.take_plan()
    assert len(p["storage_drops"]) == held and {k for _, _, k in p["storage_drops"]} <= written
    assert sum(len(v) for k, v in p.items() if k != "storage_drops") == 0
    cm.reset()  # nothing pending: fine again
    cm.check_invariants()


def test_a_bad_chain_after_a_refusal_for_host_room_counts_nothing_twice():
    """The retry's flag outlived a refusal: a later admit() with a broken chain ran the retry branch, which took back
    an admission and a refusal it never counted (admission_failures wrapped to 2^64 - 1)."""
    key = lambda i: "%032x" % (i + 1)  # noqa: E731
    d, s, x, y, z, n, w = key(0), key(1), key(10), key(20), key(30), key(40), key(50)
    cm = kvtier.CacheManager(device_blocks=3, host_blocks=1, storage_blocks=2, write_policy="write_back",
                             device_policy="lru", host_policy="lru", env=False)

    b = cm.admit([w])  # another request, open throughout
    _settle_until_empty(cm, 6)
    for keys in ([d, s], [x], [y], [d], [z]):
        a = cm.admit(keys)
        _settle_until_empty(cm, 6)
        cm.commit(a["id"])
        cm.release(a["id"])
    with pytest.raises(kvtier.ResourceExhaustedError):
        cm.admit([y, n])
    _settle_until_empty(cm, 6)
    for _ in range(3):
        before = cm.stats()
        with pytest.raises(kvtier.KvtierError):
            cm.admit([y, s])  # s is indexed below d, not y: not a hash chain
        after = cm.stats()
        assert after["admissions"] == before["admissions"]
        assert after["admission_failures"] == before["admission_failures"]
    cm.release(b["id"])
    cm.check_invariants()


def test_no_object_outlives_its_slot_when_the_key_indexed_again_never_reaches_storage(tmp_path):
    """An invalidated block's storage slot freed while its key was indexed again, device only: no drop was emitted,
    and when the new block never reached storage the object stayed in the backend with no slot, past a reset."""
    store = kvtier.StorageBackend.open(f"disk:{tmp_path}/s", namespace="o")
    cm = kvtier.CacheManager(device_blocks=2, host_blocks=4, storage_blocks=64, write_policy="write_through",
                             device_policy="lru", host_policy="lru", env=False)
    x = _keys(1)

    def settle(failing=()):
        for _ in range(6):
            p = cm.take_plan()
            if not any(p.values()):
                break
            drops = list(dict.fromkeys(k for _, _, k in p["storage_drops"]))
            if drops:
                store.delete_many(drops)
            for _, _, k in p["storage_writes"]:
                if "storage_writes" not in failing:
                    store.put_many([k], [bytes(64)])
            for kind, moves in p.items():
                if moves and kind != "storage_drops":
                    cm.ack(kind, [m[1] for m in moves], "copy failed" if kind in failing else None)

    def run(keys, failing=()):
        a = cm.admit(keys)
        settle(failing)
        cm.commit(a["id"])
        settle(failing)
        cm.release(a["id"])
        settle(failing)

    run(x)
    for keys in (_keys(50), _keys(51, 52)):
        run(keys)
    a1 = cm.admit(x)
    settle(failing=("loads",))
    cm.release(a1["id"])
    settle()
    a2 = cm.admit(x)
    settle(failing=("loads",))  # x invalidated while a2 pins it
    b = cm.admit(x)
    settle()
    cm.commit(b["id"])
    settle(failing=("backups",))  # x again, on the device only
    cm.release(b["id"])
    cm.release(a2["id"])
    settle()
    cm.reset()
    settle()
    assert cm.stats()["storage"]["used"] == 0
    assert store.stats()["objects"] == 0
    assert isinstance(store.exists_many(x)[0], kvtier.NotFoundError)
    cm.check_invariants()
    store.close()


@pytest.mark.parametrize("call", ["admit", "match", "announce", "prefetch"])
def test_a_key_without_a_utf8_form_is_named(call):
    """A key holding a lone surrogate was RuntimeError('std::bad_cast'), naming neither the call nor the key."""
    cm = kvtier.CacheManager(device_blocks=4, env=False)
    bad = "\ud800" + "0" * 31
    with pytest.raises(kvtier.InvalidArgumentError, match=r"\[1\] is not valid UTF-8"):
        getattr(cm, call)(["0" * 32, bad])
