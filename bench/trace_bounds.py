#!/usr/bin/env python3
"""Offline hit-ratio bounds of a Mooncake-format trace, for one cache tier of C blocks.

Prints, per capacity:
  min_bypass   Belady's MIN with bypass (the optimum of any policy; `kvtier replay` computes the same).
  class_ttl    the best a policy can do that knows, for each block, only what an online policy can know
               about it -- its use count so far and the distance of its last reuse -- and keeps a block
               for a time-to-live chosen per such class (the shape that hit-density policies such as
               LHD or EVA converge to). Computed with hindsight over the whole trace (each class's TTL
               is the best for that trace), so it is an optimistic estimate of such policies; blocks
               are counted one by one (prefix order ignored), which only raises it further.

  class_ttl_realized
               the same TTLs run as a cache of C blocks under the rules every prefix cache lives by: a
               request's blocks are resident while it runs, a hit is the leading run of resident blocks of
               its chain, and the cache never holds more than C blocks (when full, the block whose TTL ends
               first goes). class_ttl budgets C blocks on average and counts blocks one by one; the
               difference between the two is what those relaxations add, not information a policy lacks.
  leaf_first_lru
               leaf-first LRU in that same cache model: equal to `kvtier replay --policy lru`, which
               checks the model.

The gap between min_bypass and class_ttl is what no policy that ranks blocks by these statistics can
close.
Usage: bench/trace_bounds.py TRACE.jsonl [--capacities 1000,4000,...] [--block-tokens 512]
"""
import argparse
import heapq
import json
from collections import defaultdict

NEVER = float("inf")


def load(path, block_tokens):
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                o = json.loads(line)
                h = o["hash_ids"]
                reqs.append((h, min(len(h), o["input_length"] // block_tokens)))
    return reqs


def chained(reqs):
    """Replaces hash ids by ids of the whole prefix (a Mooncake id names a prefix block already,
    but chaining makes the bound correct for traces that reuse ids at other positions)."""
    ids = {}
    out = []
    for h, c in reqs:
        parent = -1
        chain = []
        for x in h[:c]:
            parent = ids.setdefault((parent, x), len(ids))
            chain.append(parent)
        out.append((chain, len(h)))
    return out, len(ids)


def min_bypass(reqs, nkeys, capacity):
    nxt = [None] * len(reqs)
    seen = [NEVER] * nkeys
    for i in range(len(reqs) - 1, -1, -1):
        chain = reqs[i][0]
        nxt[i] = [seen[k] for k in chain]
        for k in chain:
            seen[k] = i
    resident = {}
    heap = []
    hits = total = 0
    for i, (chain, nblocks) in enumerate(reqs):
        total += nblocks
        m = 0
        while m < len(chain) and chain[m] in resident:
            m += 1
        hits += m
        for d, k in enumerate(chain):
            nu = nxt[i][d]
            if nu == NEVER:
                resident.pop(k, None)
                continue
            resident[k] = nu
            heapq.heappush(heap, (-nu, -d, k))
        while len(resident) > capacity:
            nu, _, k = heapq.heappop(heap)
            if resident.get(k) == -nu:
                del resident[k]
    return hits / total


def class_of(uses_so_far, reuse_distance):
    """A block's class when it is used: its earlier uses (capped at 6) and the bit width of the
    distance, in requests, since its previous use (0: none)."""
    return (min(uses_so_far, 6), int(reuse_distance).bit_length())


def class_ttl_fit(reqs, capacities):
    """Per capacity: (hit ratio of the hindsight class-TTL policy, {class: TTL in requests}).

    Each class's (residency, hits) curve over TTLs is reduced to its upper concave hull; the budget of
    C blocks on average goes to the hull segments by falling hits per residency. A class's TTL is the end
    of the last segment it was given (a segment given less than half rounds down to its start)."""
    total = sum(n for _, n in reqs)
    uses = defaultdict(list)
    for i, (chain, _) in enumerate(reqs):
        for k in chain:
            uses[k].append(i)
    per_class = defaultdict(list)  # class -> distances to the next use (NEVER: none)
    for v in uses.values():
        for j, i in enumerate(v):
            per_class[class_of(j, i - v[j - 1] if j else 0)].append(v[j + 1] - i if j + 1 < len(v) else NEVER)
    horizon = len(reqs)
    grid = sorted({int(2 ** (x / 8)) for x in range(0, 8 * horizon.bit_length())} | {horizon})
    segments = []  # (slope, cost, hits, class, TTL at the segment's end)
    for cls, ds in per_class.items():
        ds.sort()
        pts = [(0.0, 0.0, 0)]
        j = 0
        acc = 0.0
        for t in grid:
            while j < len(ds) and ds[j] <= t:
                acc += ds[j]
                j += 1
            pts.append((acc + (len(ds) - j) * t, float(j), t))
        hull = [pts[0]]
        for p in pts[1:]:
            while len(hull) >= 2:
                (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
                if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            if p[0] > hull[-1][0]:
                hull.append(p)
        for a, b in zip(hull, hull[1:]):
            if b[1] > a[1]:
                segments.append(((b[1] - a[1]) / (b[0] - a[0]), b[0] - a[0], b[1] - a[1], cls, b[2]))
    segments.sort(key=lambda x: x[0], reverse=True)
    out = []
    for cap in capacities:
        budget = cap * len(reqs)  # block-requests of residency
        hits = 0.0
        ttl = {}
        for slope, cost, _, cls, end in segments:
            take = min(cost, budget)
            hits += slope * take
            budget -= take
            if take >= cost / 2:
                ttl[cls] = max(ttl.get(cls, 0), end)
            if budget <= 0:
                break
        out.append((hits / total, ttl))
    return out


def class_ttl(reqs, nkeys, capacities):
    return [r for r, _ in class_ttl_fit(reqs, capacities)]


def prefix_cache(reqs, capacity, rank, expires=True):
    """Hit ratio of a cache of `capacity` blocks: a request hits the leading resident run of its chain,
    then all its blocks are resident (evicting others first, lowest rank(i, depth, key) first). With
    `expires`, a rank is the last request a block stays for: below the request's index it has expired
    and goes at once."""
    total = sum(n for _, n in reqs)
    rank_of = {}
    heap = []
    hits = 0
    for i, (chain, _) in enumerate(reqs):
        while expires and heap and heap[0][0] < i:  # expired
            r, _, k = heapq.heappop(heap)
            if rank_of.get(k) == r:
                del rank_of[k]
        m = 0
        while m < len(chain) and chain[m] in rank_of:
            m += 1
        hits += m
        wanted = set(chain)
        need = sum(1 for k in chain if k not in rank_of)
        kept = []
        while len(rank_of) + need > capacity and heap:
            entry = heapq.heappop(heap)
            r, _, k = entry
            if rank_of.get(k) != r:
                continue
            if k in wanted:
                kept.append(entry)
                continue
            del rank_of[k]
        for entry in kept:
            heapq.heappush(heap, entry)
        for d, k in enumerate(chain):
            r = rank(i, d, k)
            rank_of[k] = r
            heapq.heappush(heap, (r, -d, k))
    return hits / total


def class_ttl_realized(reqs, capacity, ttl):
    """The class-TTL policy `ttl` run as a prefix cache of `capacity` blocks (prefix_cache): a block
    ranks by the end of its TTL, so the one that would leave first goes first."""
    uses = defaultdict(int)
    last = {}

    def rank(i, d, k):
        cls = class_of(uses[k], i - last[k] if k in last else 0)
        uses[k] += 1
        last[k] = i
        return i + ttl.get(cls, 0)

    return prefix_cache(reqs, capacity, rank)


def leaf_first_lru(reqs, capacity):
    """Leaf-first LRU in prefix_cache's model (a request's deeper blocks count as older than its
    shallower ones, so a chain is evicted from its leaf): the model's check against kvtier replay."""
    return prefix_cache(reqs, capacity, lambda i, d, k: (i, -d), expires=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--capacities", default="1000,4000,5860,16000,32000")
    ap.add_argument("--block-tokens", type=int, default=512)
    a = ap.parse_args()
    caps = [int(c) for c in a.capacities.split(",")]
    reqs, nkeys = chained(load(a.trace, a.block_tokens))
    fits = class_ttl_fit(reqs, caps)
    print("| capacity (blocks) | min_bypass | class_ttl | class_ttl / min_bypass | class_ttl_realized "
          "| leaf_first_lru |")
    print("|---:|---:|---:|---:|---:|---:|")
    for cap, (t, ttl) in zip(caps, fits):
        m = min_bypass(reqs, nkeys, cap)
        r = class_ttl_realized(reqs, cap, ttl)
        lru = leaf_first_lru(reqs, cap)
        print(f"| {cap} | {m:.4f} | {t:.4f} | {100 * t / m:.1f}% | {r:.4f} | {lru:.4f} |")


if __name__ == "__main__":
    main()
