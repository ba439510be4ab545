#!/usr/bin/env python3
"""Checks the layer rule of docs/architecture.md on every C++ and CUDA source of the libraries: a folder includes
public headers (include/kvtier/<layer>/) only of the layers it may depend on (dependencies point down), and no
other folder's private headers (<layer>/...), but for the exceptions listed below with their reasons. Prints
every violation and fails when there is one.

Usage: scripts/check-layers.py
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# What each library folder may include (besides itself); the closure is taken below.
DEPENDS = {
    "core": [],
    "metrics": ["core"],
    "device": ["core"],
    "copy": ["device"],
    "transfer": ["copy", "metrics"],
    "storage": ["core", "metrics"],
    "transport": ["copy"],
    "cache": ["transfer", "storage"],
    "pd": ["cache", "transport"],
    "tools": ["pd"],
    "python/src": ["pd"],
    "examples": ["pd"],
}
LAYERS = ["core", "metrics", "device", "copy", "transfer", "storage", "transport", "cache", "pd"]

# Private headers used across folders, with the reason (each a known debt or a deliberate sharing).
PRIVATE_EXCEPTIONS = {
    ("copy", "device/cuda/"): "the CUDA backend spans device/cuda, copy/cuda and transfer/cuda",
    ("transfer", "device/cuda/"): "the CUDA backend spans device/cuda, copy/cuda and transfer/cuda",
    ("tools", "transfer/bench_compute.h"): "the transfer benchmark's compute model lives in transfer/",
    ("storage", "core/parallel_loop.h"): "core's helper threads, shared by the libraries above core",
    ("transport", "core/parallel_loop.h"): "core's helper threads, shared by the libraries above core",
    ("cache", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
    ("storage", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
    ("transport", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def closure(folder):
    seen, queue = set(), list(DEPENDS[folder])
    while queue:
        d = queue.pop()
        if d not in seen:
            seen.add(d)
            queue += DEPENDS.get(d, [])
    return seen


def sources(folder):
    dirs = [os.path.join(ROOT, folder)]
    if folder in LAYERS:
        dirs.append(os.path.join(ROOT, "include", "kvtier", folder))
    for d in dirs:
        for base, _, files in os.walk(d):
            for f in files:
                if f.endswith((".cc", ".h", ".cu", ".cuh")):
                    yield os.path.join(base, f)


def main():
    bad = []
    for folder in DEPENDS:
        allowed = closure(folder) | ({folder} if folder in LAYERS else set())
        own = folder if folder in LAYERS else None
        for path in sources(folder):
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    parts = inc.split("/")
                    if parts[0] == "kvtier" and len(parts) > 2 and parts[1] in LAYERS:
                        if parts[1] not in allowed:
                            bad.append(f"{rel}:{n}: {folder} includes {inc}: {folder} does not depend on {parts[1]}")
                    elif parts[0] in LAYERS and len(parts) > 1 and parts[0] != own:
                        if not any(folder == ex[0] and inc.startswith(ex[1]) for ex in PRIVATE_EXCEPTIONS):
                            bad.append(f"{rel}:{n}: {folder} includes {inc}, a private header of {parts[0]}")
    if bad:
        print("check-layers: includes against the layer rule (docs/architecture.md):", file=sys.stderr)
        for b in bad:
            print("  " + b, file=sys.stderr)
        return 1
    print(f"check-layers: {len(DEPENDS)} folders include only what their layer allows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
