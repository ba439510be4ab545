"""kvtier.HybridCache: hybrid models' KV groups from Python (include/kvtier/cache/hybrid_cache.h): a Gemma-style
model (sliding-window and full attention) and a Jamba-style one (Mamba state and attention)."""

import pytest

import kvtier

pytestmark = pytest.mark.skipif(not kvtier._native.has_cache, reason="built without the cache bindings")

BLOCK = 16


def keys(tokens, block=BLOCK, model="hybrid-test"):
    return kvtier.KeyHasher(model, block_tokens=block).keys_for(tokens)


def gemma(device_blocks=64):
    return kvtier.HybridCache([
        dict(name="full", kind="full", block_tokens=BLOCK, device_blocks=device_blocks),
        dict(name="swa", kind="sliding_window", block_tokens=BLOCK, window_tokens=2 * BLOCK,
             device_blocks=device_blocks),
    ])


def jamba(device_blocks=64):
    return kvtier.HybridCache([
        dict(name="attention", kind="full", block_tokens=BLOCK, device_blocks=device_blocks),
        dict(name="mamba", kind="state", block_tokens=4 * BLOCK, device_blocks=device_blocks),
    ])


def test_sliding_window_and_full_attention_hit_together_and_the_window_slides():
    hc = gemma()
    assert hc.num_groups == 2 and hc.hit_granularity == BLOCK
    prompt = list(range(8 * BLOCK))
    chain = keys(prompt)
    assert len(chain) == 8
    a = hc.admit(len(prompt), [chain, chain], extra_tokens=BLOCK)
    assert a["hit_tokens"] == 0
    full, swa = a["groups"]
    assert full["kind"] == "full" and swa["kind"] == "sliding_window"
    assert full["new_blocks"] == 8 and full["extra_blocks"] == 1
    assert len(full["device_blocks"]) == 9 and None not in full["device_blocks"]
    hc.commit(a["id"], len(prompt))
    hc.release(a["id"])
    hc.check_invariants()
    # The same prompt plus one more block: both groups serve the 8 blocks; the window group only needs the last
    # two blocks before the hit (its window), the full group every block.
    longer = prompt + list(range(1000, 1000 + BLOCK))
    chain2 = keys(longer)
    m = hc.match(len(longer), [chain2, chain2])
    assert m["hit_tokens"] == 8 * BLOCK, m
    b = hc.admit(len(longer), [chain2, chain2])
    assert b["hit_tokens"] == 8 * BLOCK
    full, swa = b["groups"]
    assert full["hit_blocks"] == 8 and full["new_blocks"] == 1
    assert swa["first_block"] > 0, swa  # positions before the window hold no block
    assert all(x is None for x in swa["device_blocks"][:swa["first_block"]])
    assert all(x is not None for x in swa["device_blocks"][swa["first_block"]:])
    hc.commit(b["id"], len(longer))
    hc.release(b["id"])
    s = hc.stats()
    assert s["admissions"] == 2 and s["hit_tokens"] == 8 * BLOCK
    assert len(s["groups"]) == 2
    # Each group reports every counter a CacheManager does, counting that group's own work.
    plain = kvtier.CacheManager(device_blocks=4).stats()
    full_stats, swa_stats = s["groups"]
    for g in (full_stats, swa_stats):
        assert set(g) == set(plain), set(plain) ^ set(g)
        assert g["admission_failures"] == 0 and g["device"]["used"] == 9
    assert full_stats["admissions"] == 2 and full_stats["lookup_blocks"] == 8 + 9
    assert full_stats["hit_blocks"] == (8, 0, 0)
    # The window group admits key by key (docs/python.md): of its lookups two hit, the window before the hit.
    assert swa_stats["admissions"] > 2 and swa_stats["hit_blocks"] == (2, 0, 0)
    hc.check_invariants()


def test_a_state_group_hits_only_at_its_saved_states():
    hc = jamba()
    assert hc.hit_granularity == 4 * BLOCK
    prompt = list(range(10 * BLOCK))  # 160 tokens: states can be saved at 64 and 128
    att, mamba = keys(prompt), keys(prompt, block=4 * BLOCK)
    a = hc.admit(len(prompt), [att, mamba], save_states_at=[4 * BLOCK, 8 * BLOCK])
    assert a["hit_tokens"] == 0
    st = a["groups"][1]
    assert st["kind"] == "state" and st["state_in"] is None
    assert [t for t, _ in st["state_saves"]] == [4 * BLOCK, 8 * BLOCK]
    assert st["device_blocks"] == []
    hc.commit(a["id"], len(prompt))
    hc.release(a["id"])
    # A request sharing the first 160 tokens: the attention group could serve 10 blocks, the state group only up
    # to its last saved state (128 tokens): the hit is 128, limited by the state group.
    longer = prompt + list(range(5000, 5000 + 6 * BLOCK))
    att2, mamba2 = keys(longer), keys(longer, block=4 * BLOCK)
    m = hc.match(len(longer), [att2, mamba2])
    assert m["hit_tokens"] == 8 * BLOCK, m
    assert m["groups"][0]["alone_hit_tokens"] >= 8 * BLOCK
    b = hc.admit(len(longer), [att2, mamba2])
    assert b["hit_tokens"] == 8 * BLOCK
    assert b["groups"][1]["state_in"] is not None  # the saved state the forward starts from
    hc.release(b["id"])
    hc.check_invariants()


def test_admission_is_all_or_nothing_across_groups():
    # The window group has room for the request, the full group does not: nothing stays admitted.
    hc = kvtier.HybridCache([
        dict(name="swa", kind="sliding_window", block_tokens=BLOCK, window_tokens=BLOCK, device_blocks=64),
        dict(name="full", kind="full", block_tokens=BLOCK, device_blocks=4),
    ])
    prompt = list(range(8 * BLOCK))
    chain = keys(prompt)
    with pytest.raises(kvtier.ResourceExhaustedError):
        hc.admit(len(prompt), [chain, chain])
    s = hc.stats()
    assert s["refusals"] == 1 and s["admissions"] == 0
    assert s["groups"][0]["device"]["used"] == 0 and s["groups"][1]["device"]["used"] == 0
    hc.check_invariants()


def test_kv_events_and_bad_input_name_the_group():
    hc = gemma()
    hc.enable_kv_events()
    prompt = list(range(4 * BLOCK))
    chain = keys(prompt)
    a = hc.admit(len(prompt), [chain, chain])
    hc.commit(a["id"], len(prompt))
    ev = hc.take_events()
    assert {e["group"] for e in ev} == {0, 1}
    assert all(e["type"] == "BlockStored" for e in ev)
    hc.release(a["id"])
    with pytest.raises(kvtier.InvalidArgumentError, match="kind 'banded'"):
        kvtier.HybridCache([dict(name="x", kind="banded", block_tokens=BLOCK, device_blocks=8)])
    with pytest.raises(kvtier.InvalidArgumentError, match="unknown key 'blocks'"):
        kvtier.HybridCache([dict(name="x", kind="full", block_tokens=BLOCK, blocks=8)])
    with pytest.raises(kvtier.KvtierError):
        hc.admit(len(prompt), [chain])  # one chain for two groups
    with pytest.raises(kvtier.InvalidArgumentError, match="group 1 key at index 0"):
        hc.match(len(prompt), [chain, ["not-hex"] + chain[1:]])
    with pytest.raises(kvtier.InvalidArgumentError, match="ack kind 'teleports'"):
        hc.ack(0, "teleports", [1])


def test_an_announced_request_is_protected_in_every_group_until_withdrawn():
    hc = gemma(device_blocks=64)
    prompt = list(range(8 * BLOCK))
    chain = keys(prompt)
    a = hc.admit(len(prompt), [chain, chain])
    hc.commit(a["id"], len(prompt))
    hc.release(a["id"])
    q = hc.announce(len(prompt), [chain, chain], conversation_id=7, priority=1)
    s = hc.stats()["groups"]
    # The full group protects the whole chain on device, the window group the two blocks before the hit.
    assert s[0]["queued_requests"] == 1 and s[0]["protected_blocks"][0] == 8, s[0]
    assert s[1]["queued_requests"] == 2 and s[1]["protected_blocks"][0] == 2, s[1]
    hc.check_invariants()
    hc.withdraw(q)
    s = hc.stats()["groups"]
    assert s[0]["queued_requests"] == 0 and s[1]["queued_requests"] == 0
    assert s[0]["protected_blocks"][0] == 0
    with pytest.raises(kvtier.FailedPreconditionError, match="withdrawn already"):  # as CacheManager.withdraw
        hc.withdraw(q)
    with pytest.raises(kvtier.NotFoundError, match="never made"):
        hc.withdraw(q + 1000)
    with pytest.raises(kvtier.InvalidArgumentError, match="hybrid announce"):
        hc.announce(len(prompt), [chain])


def test_group_numbers_of_the_wrong_kind_are_named():
    # A negative, too large or non-integer number in a group dict escaped as RuntimeError("std::bad_cast").
    for key, value in (("device_blocks", -1), ("device_blocks", 2**40), ("block_tokens", "x"), ("window_tokens", -16)):
        g = dict(name="s", kind="sliding_window", block_tokens=16, window_tokens=64, device_blocks=16)
        g[key] = value
        with pytest.raises(kvtier.InvalidArgumentError, match=f"group 0: {key} is {value!r}"):
            kvtier.HybridCache([g])
    with pytest.raises(kvtier.InvalidArgumentError, match="key 1 is not a string"):
        kvtier.HybridCache([{1: 2}])


# ---- faults: host hits lost to their own demotions, repeated keys, the window's width, state saves, errors ---------

def _keys(tokens, block):
    return kvtier.KeyHasher("hybrid-faults", block_tokens=block).keys_for(tokens)


def _ack_all(hc):
    for g, plan in enumerate(hc.take_plan()):
        for kind, moves in plan.items():
            if moves:
                hc.ack(g, kind, [m[1] for m in moves])


def test_a_window_served_from_a_full_host_tier_is_admitted_and_keeps_its_blocks():
    """A sliding window's host hits were admitted one key at a time: the device block allocated for the first
    evicted a device block to the (full) host tier, which dropped the second planned host hit. The admission was
    refused ("retry after the plan's acks"), and the prefix was gone for good (its hit fell from 16 to 0)."""
    hc = kvtier.HybridCache([dict(name="g", kind="sliding_window", block_tokens=4, window_tokens=8,
                                  device_blocks=4, host_blocks=2)])

    def run(tokens):
        a = hc.admit(len(tokens), [_keys(tokens, 4)])
        _ack_all(hc)
        hc.commit(a["id"], len(tokens))
        hc.release(a["id"])
        _ack_all(hc)

    prompt = list(range(16))
    run(prompt)
    run(list(range(500, 508)))
    run(list(range(600, 608)))  # the prompt's window blocks (2 and 3) now fill the host tier
    longer = prompt + list(range(900, 904))
    chain = _keys(longer, 4)
    assert hc.match(20, [chain])["hit_tokens"] == 16
    a = hc.admit(20, [chain])
    assert a["hit_tokens"] == 16 and a["groups"][0]["loaded_blocks"] == 2
    _ack_all(hc)
    hc.commit(a["id"], 20)
    hc.release(a["id"])
    hc.check_invariants()


def test_the_default_state_save_is_where_a_hit_can_end():
    """With an attention group of 8-token blocks and a state group of 4, hits are multiples of 8: the default save at
    the last 4-token boundary (12 of 12 tokens) could never be read, and explicit saves off the 8-token grid were
    accepted."""
    hc = kvtier.HybridCache([dict(name="att", kind="full", block_tokens=8, device_blocks=32),
                             dict(name="mamba", kind="state", block_tokens=4, device_blocks=32)])
    assert hc.hit_granularity == 8
    prompt = list(range(12))
    a = hc.admit(12, [_keys(prompt, 8), _keys(prompt, 4)])
    assert [t for t, _ in a["groups"][1]["state_saves"]] == [8]
    hc.commit(a["id"], 12)
    hc.release(a["id"])
    longer = prompt + list(range(100, 112))
    assert hc.match(24, [_keys(longer, 8), _keys(longer, 4)])["hit_tokens"] == 8
    with pytest.raises(kvtier.InvalidArgumentError, match=r"save_states_at\[0\] = 4 is not a multiple of the hit "
                                                          r"granularity 8"):
        hc.admit(24, [_keys(longer, 8), _keys(longer, 4)], save_states_at=[4, 16])


def test_repeated_keys_are_refused_in_window_and_state_groups():
    """A full group refused a chain repeating a key; a window or state group took it and then reported a hit of 16
    tokens served by one block."""
    k = _keys(list(range(4)), 4)[0]
    for kind in ("full", "sliding_window", "state"):
        g = dict(name="g", kind=kind, block_tokens=4, device_blocks=16)
        if kind == "sliding_window":
            g["window_tokens"] = 8
        hc = kvtier.HybridCache([g])
        with pytest.raises(kvtier.InvalidArgumentError, match="repeats"):
            hc.admit(16, [[k, k, k, k]])
        if kind != "full":  # a full group's chain is checked where it is admitted
            with pytest.raises(kvtier.InvalidArgumentError, match="repeats"):
                hc.match(16, [[k, k, k, k]])


def test_a_window_needs_what_its_first_recomputed_token_attends_to():
    """A window of W tokens attends to W tokens, the token itself included (vLLM keeps cdiv(W - 1, B) blocks before a
    hit): with W = 5 and 4-token blocks a hit of 8 needs block 1 only. kvtier asked for blocks 0 and 1."""
    hc = kvtier.HybridCache([dict(name="swa", kind="sliding_window", block_tokens=4, window_tokens=5,
                                  device_blocks=5, device_policy="lru")])
    prompt = list(range(12))
    chain = _keys(prompt, 4)
    a = hc.admit(12, [chain])
    hc.commit(a["id"], 12)
    hc.release(a["id"])
    b = hc.admit(12, [chain], max_hit_tokens=8)
    assert b["hit_tokens"] == 8 and b["groups"][0]["first_block"] == 1


def test_bad_group_settings_name_the_group_and_matching_nothing_is_no_error():
    base = dict(name="full", kind="full", block_tokens=16, device_blocks=8)
    with pytest.raises(kvtier.InvalidArgumentError, match=r"group 1 \('swa'\).*'writeback'"):
        kvtier.HybridCache([base, dict(name="swa", kind="sliding_window", block_tokens=16, window_tokens=64,
                                       device_blocks=8, write_policy="writeback")])
    hc = kvtier.HybridCache([base])
    assert hc.match(0, [[]])["hit_tokens"] == 0
    with pytest.raises(kvtier.InvalidArgumentError, match="nothing to admit"):
        hc.admit(0, [[]])


def test_a_request_the_group_can_serve_is_not_refused_for_hits_behind_moves_in_flight():
    """The room check subtracted every unpinned device hit of the request from the group's reclaimable count, also
    hits that were never in it (a backup in flight below them): a request the group could serve was refused until
    those acks came, where CacheManager.admit on the same state admitted it."""
    hc = kvtier.HybridCache([dict(name="g", kind="full", block_tokens=1, device_blocks=6, host_blocks=8,
                                  write_policy="write_through")])
    chain = _keys(list(range(6)), 1)
    a = hc.admit(2, [chain[:2]])
    hc.commit(a["id"], 2)
    hc.release(a["id"])
    held = hc.take_plan()  # the two backups handed out, not acked: k1, k2 not reclaimable yet
    assert held[0]["backups"], held
    b = hc.admit(1, [_keys([900], 1)])
    hc.commit(b["id"], 1)
    hc.release(b["id"])
    for g, plan in enumerate(hc.take_plan()):
        for kind, moves in plan.items():
            if moves:
                hc.ack(g, kind, [m[1] for m in moves])
    c = hc.admit(6, [chain])  # 3 free, k9 reclaimable, k1 and k2 its own hits: room for the 4 new ones
    assert c["hit_tokens"] == 2, c
    hc.release(c["id"])
    hc.check_invariants()


def test_a_refused_announcement_leaves_no_retention_behind():
    """An announcement another group refused was taken back from the groups that had taken it with withdraw(),
    which under a 'continues' hint turned it into a retention: the refused call left protections behind."""
    hc = kvtier.HybridCache([
        dict(name="swa", kind="sliding_window", block_tokens=1, window_tokens=2, device_blocks=16),
        dict(name="full", kind="full", block_tokens=1, device_blocks=16),
    ])
    w, f = _keys([1, 2, 3], 1), _keys([7, 8, 9], 1)
    with pytest.raises(kvtier.InvalidArgumentError):  # the full group refuses its chain (a key repeated)
        hc.announce(3, [w, [f[0], f[1], f[0]]], conversation_id=7, continuation="continues")
    for g in hc.stats()["groups"]:
        assert g["queued_requests"] == 0 and g.get("retained_requests", 0) == 0, g
    hc.check_invariants()
