#!/usr/bin/env python3
"""Synthetic Mooncake-format traces of four workload shapes, to check eviction policies beyond the real traces.

Every trace is deterministic for its seed, one request every 200 ms, blocks of 512 tokens (`input_length` is
512 x the block count, so that every block is full):
  rag    a 4-block system prompt, one of 2,000 documents of 20-60 blocks picked with Zipf(1.0) popularity, and
         a question of 1-3 blocks of its own: frequency pays (popular documents come back often).
  agent  sessions whose context grows by 2-8 blocks per turn (3-30 turns, the last 60 sessions active, a new one
         in about 8 % of requests): each turn re-reads its session's whole context, so recency pays and counts
         from old sessions mislead.
  scan   half the requests re-read one of 20 hot prefixes of 30 blocks (plus 2 blocks of their own), half are
         one-time prompts of 20-80 blocks: scan resistance pays.
  chat   conversations under 200 system prompts of 2-8 blocks picked with Pareto(1.2) popularity: 55 % of requests
         open a conversation (1-20 blocks of its own), 45 % continue one of the last 5,000 (half of them a recent one,
         an exponential 300 conversations back) with 1-6 more blocks, re-reading its whole context, up to 240 blocks.
         Few prefixes are shared by many conversations whose own blocks are seen once: the shape that filled ARC's
         second list with parents (docs/performance.md, "Victim walks past parents").

Usage: bench/workload_traces.py OUT_DIR [--requests 12000] [--seed 7]
then e.g. kvtier replay OUT_DIR/agent.jsonl --sweep 500,2000,8000 --sweep-policies lru,s3fifo,sieve,arc,lrfu,adaptive
"""
import argparse
import json
import os
import random


class Keys:
    """Fresh block ids (hash_ids), never reused across prompts unless a generator reuses them on purpose."""

    def __init__(self):
        self.next = 1_000_000

    def fresh(self, n):
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def rag(rng, keys, n):
    docs = [keys.fresh(rng.randint(20, 60)) for _ in range(2000)]
    system = keys.fresh(4)
    weights = [1.0 / (k + 1) for k in range(len(docs))]
    for _ in range(n):
        doc = rng.choices(range(len(docs)), weights=weights)[0]
        yield system + docs[doc] + keys.fresh(rng.randint(1, 3)), 200


def agent(rng, keys, n):
    sessions = []
    for _ in range(n):
        if len(sessions) < 20 or rng.random() < 0.08:
            sessions.append({"context": keys.fresh(rng.randint(4, 16)), "turns": rng.randint(3, 30)})
        s = rng.choice(sessions[-60:])
        s["context"] = s["context"] + keys.fresh(rng.randint(2, 8))
        yield list(s["context"]), 100
        s["turns"] -= 1
        if s["turns"] <= 0:
            sessions.remove(s)


def scan(rng, keys, n):
    hot = [keys.fresh(30) for _ in range(20)]
    for _ in range(n):
        if rng.random() < 0.5:
            yield list(rng.choice(hot)) + keys.fresh(2), 50
        else:
            yield keys.fresh(rng.randint(20, 80)), 50


def chat(rng, keys, n):
    systems = [keys.fresh(rng.randint(2, 8)) for _ in range(200)]
    conversations = []
    for _ in range(n):
        if conversations and rng.random() < 0.45:
            back = len(conversations) - 1 - min(len(conversations) - 1, int(rng.expovariate(1 / 300)))
            k = rng.randrange(len(conversations)) if rng.random() < 0.5 else back
            conversations[k] = (conversations[k] + keys.fresh(rng.randint(1, 6)))[:240]
            yield list(conversations[k]), rng.randint(1, 800)
        else:
            system = systems[min(len(systems) - 1, int(rng.paretovariate(1.2)) - 1)]
            conversations.append(system + keys.fresh(rng.randint(1, 20)))
            if len(conversations) > 5000:
                conversations.pop(0)
            yield list(conversations[-1]), rng.randint(1, 800)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if a.requests < 1:
        ap.error(f"--requests {a.requests}: need at least 1")
    os.makedirs(a.out_dir, exist_ok=True)
    for name, make in (("rag", rag), ("agent", agent), ("scan", scan), ("chat", chat)):
        rng = random.Random(f"{a.seed}:{name}")
        path = os.path.join(a.out_dir, f"{name}.jsonl")
        with open(path, "w") as f:
            for i, (ids, output) in enumerate(make(rng, Keys(), a.requests)):
                f.write(json.dumps({"timestamp": i * 200, "input_length": len(ids) * 512, "output_length": output,
                                    "hash_ids": ids}) + "\n")
        print(path)


if __name__ == "__main__":
    main()
