"""bench/trace_bounds.py's cache model against kvtier's CacheManager, and its class-TTL policy run as a cache."""
import importlib.util
import os
import random

import pytest

import kvtier

BOUNDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "trace_bounds.py")


@pytest.fixture(scope="module")
def tb():
    if not os.path.exists(BOUNDS):
        pytest.skip("bench/trace_bounds.py is not beside these tests")
    spec = importlib.util.spec_from_file_location("trace_bounds", BOUNDS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic_trace(seed, requests=400):
    """Mooncake-style hash-id lists: a few shared system prompts, conversations that come back with their
    whole history plus a new turn (up to 30 blocks), and one-off requests of up to 30 blocks."""
    rng = random.Random(seed)
    next_id = [0]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    prompts = [fresh(rng.randint(1, 3)) for _ in range(3)]
    conversations = []
    out = []
    for _ in range(requests):
        r = rng.random()
        if conversations and r < 0.45:
            c = rng.choice(conversations)
            if len(c) < 25:
                c.extend(fresh(rng.randint(1, 5)))
            out.append(list(c))
        else:
            c = rng.choice(prompts) + fresh(rng.randint(1, 27))
            if r < 0.8:
                conversations.append(c)
            out.append(list(c))
    return [(h, len(h)) for h in out]


def kvtier_lru_hit_ratio(raw, capacity):
    cm = kvtier.CacheManager(device_blocks=capacity, host_blocks=0, device_policy="lru")
    hasher = kvtier.KeyHasher("trace", block_tokens=1)
    hits = total = 0
    for ids, _ in raw:
        a = cm.admit(hasher.keys_for(ids))
        hits += a["device_hit_blocks"]
        total += len(ids)
        cm.commit(a["id"])
        cm.release(a["id"])
    cm.check_invariants()
    return hits / total


@pytest.mark.skipif(not kvtier._native.has_cache, reason="built without the cache bindings")
@pytest.mark.parametrize("seed,capacity", [(1, 60), (2, 90), (3, 250)])
def test_the_cache_model_is_kvtiers_leaf_first_lru(tb, seed, capacity):
    raw = synthetic_trace(seed)
    reqs, _ = tb.chained(raw)
    model = tb.leaf_first_lru(reqs, capacity)
    assert 0 < model < 1
    assert model == pytest.approx(kvtier_lru_hit_ratio(raw, capacity), abs=1e-12)


def test_class_ttl_run_as_a_cache(tb):
    reqs, nkeys = tb.chained(synthetic_trace(4))
    unbounded = tb.min_bypass(reqs, nkeys, nkeys)
    classes = {(u, w) for u in range(7) for w in range(20)}
    # Kept forever with room for everything: every reuse hits, as with unbounded capacity.
    assert tb.class_ttl_realized(reqs, nkeys, {c: len(reqs) for c in classes}) == pytest.approx(unbounded)
    # No time to live: nothing outlives its request.
    assert tb.class_ttl_realized(reqs, nkeys, {}) == 0
    # The fitted TTLs as a cache: never above the optimum with bypass, and a small cache loses to the
    # averaged budget of the estimate it was fitted for here.
    for cap in (30, 120):
        estimate, ttl = tb.class_ttl_fit(reqs, [cap])[0]
        realized = tb.class_ttl_realized(reqs, cap, ttl)
        assert 0 < realized <= tb.min_bypass(reqs, nkeys, cap) + 1e-12
    assert tb.class_ttl_realized(reqs, 30, tb.class_ttl_fit(reqs, [30])[0][1]) < tb.class_ttl_fit(reqs, [30])[0][0]
