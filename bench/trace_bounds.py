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

The gap between the two is what no policy that ranks blocks by these statistics can close.
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


def class_ttl(reqs, nkeys, capacities):
    total = sum(n for _, n in reqs)
    uses = defaultdict(list)
    for i, (chain, _) in enumerate(reqs):
        for k in chain:
            uses[k].append(i)
    per_class = defaultdict(list)  # class -> distances to the next use (NEVER: none)
    for v in uses.values():
        for j, i in enumerate(v):
            prev = i - v[j - 1] if j else 0
            cls = (min(j, 6), int(prev).bit_length())
            per_class[cls].append(v[j + 1] - i if j + 1 < len(v) else NEVER)
    horizon = len(reqs)
    grid = sorted({int(2 ** (x / 8)) for x in range(0, 8 * horizon.bit_length())} | {horizon})
    segments = []  # (slope, cost, hits) of the upper concave hull of each class's (cost, hits) curve
    for ds in per_class.values():
        ds.sort()
        pts = [(0.0, 0.0)]
        j = 0
        acc = 0.0
        for t in grid:
            while j < len(ds) and ds[j] <= t:
                acc += ds[j]
                j += 1
            pts.append((acc + (len(ds) - j) * t, float(j)))
        hull = [pts[0]]
        for p in pts[1:]:
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            if p[0] > hull[-1][0]:
                hull.append(p)
        for a, b in zip(hull, hull[1:]):
            if b[1] > a[1]:
                segments.append(((b[1] - a[1]) / (b[0] - a[0]), b[0] - a[0], b[1] - a[1]))
    segments.sort(reverse=True)
    out = []
    for cap in capacities:
        budget = cap * len(reqs)  # block-requests of residency
        hits = 0.0
        for slope, cost, h in segments:
            take = min(cost, budget)
            hits += slope * take
            budget -= take
            if budget <= 0:
                break
        out.append(hits / total)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--capacities", default="1000,4000,5860,16000,32000")
    ap.add_argument("--block-tokens", type=int, default=512)
    a = ap.parse_args()
    caps = [int(c) for c in a.capacities.split(",")]
    reqs, nkeys = chained(load(a.trace, a.block_tokens))
    ttl = class_ttl(reqs, nkeys, caps)
    print("| capacity (blocks) | min_bypass | class_ttl | class_ttl / min_bypass |")
    print("|---:|---:|---:|---:|")
    for cap, t in zip(caps, ttl):
        m = min_bypass(reqs, nkeys, cap)
        print(f"| {cap} | {m:.4f} | {t:.4f} | {100 * t / m:.1f}% |")


if __name__ == "__main__":
    main()
