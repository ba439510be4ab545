#!/usr/bin/env python3
"""Prints one line per row of `kvtier bench copy --json` / `bench transfer --json` / `bench pd --json`
output files (the short table scripts/gpu-check.sh prints last).
Usage: gpu_table.py NAME=FILE.jsonl ...   (NAME labels the rows)"""
import json
import os
import sys

for arg in sys.argv[1:]:
    name, _, path = arg.partition("=")
    if not os.path.exists(path):
        continue
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("bench") == "pd":
            ratios = " ".join(f"{k[len('ratio_to_'):]} {r[k]:.2f}" for k in sorted(r)
                              if k.startswith("ratio_to_") and isinstance(r[k], (int, float)))
            verify = r.get("lane_verify") or r.get("host_alloc") or ""
            print(f"{name} {r['lane']} {r['memory']} {r['mode']} {r['block_bytes'] // 1024}K x{r['inflight']} "
                  f"{verify} {r['gbps']:.2f} GB/s {ratios}")
            continue
        if "scenario" in r:
            if r["scenario"] in ("copy", "overlap", "duplex", "gemm"):
                keep = ("ms", "bound_ms", "gbps", "pass", "slowdown", "moved_gbps", "compute_stall_ms")
                print(name, r["shape"], r["scenario"],
                      {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in keep})
            continue
        shares = " ".join("%.2f" % x for x in r.get("rep_kernel_shares", [])) if r["ran"] == "split" else ""
        print(f"{name} {r['direction']} {r['block_bytes'] // 1024}K {r['strategy']} {r['ran']} {r['ratio']:.3f} "
              f"{r['gbps']:.1f} api {r['host_api_ms']:.2f} lanes {r.get('lanes', 0)} shares {shares}")
