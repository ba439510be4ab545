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
    "backends/host": ["copy"],
    "backends/cuda": ["copy"],
    "transport": ["copy"],
    "cache": ["transfer", "storage"],
    "pd": ["cache", "transport"],
    "testing": ["cache"],
    "sim": ["testing", "pd", "backends/host", "backends/cuda"],
    "tools": ["pd", "sim", "backends/host", "backends/cuda"],
    "python/src": ["pd", "backends/host", "backends/cuda"],
    "examples": ["pd", "backends/host", "backends/cuda"],
}
LAYERS = ["core", "metrics", "device", "copy", "transfer", "storage", "transport", "cache", "pd"]

# Private headers used across folders, with the reason (each a known debt or a deliberate sharing).
PRIVATE_EXCEPTIONS = {
    ("backends/host", "copy/"): "a backend's copy engine builds on the copy layer's engine base and kernel plan",
    ("backends/cuda", "copy/"): "a backend's copy engine builds on the copy layer's engine base and kernel plan",
    ("backends/host", "device/pinned.h"): "the pinned-memory machinery the device backends share",
    ("backends/cuda", "device/pinned.h"): "the pinned-memory machinery the device backends share",
    ("sim", "cache/splitmix.h"): "the replay draws its random numbers as the cache's policies do",
    ("sim", "backends/cuda/"): "the synthetic compute's kernels check their CUDA calls as the CUDA backend does",
    ("tools", "sim/"): "the CLI runs the trace replay and the synthetic compute",
    ("storage", "core/parallel_loop.h"): "core's helper threads, shared by the libraries above core",
    ("transport", "core/parallel_loop.h"): "core's helper threads, shared by the libraries above core",
    ("cache", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
    ("storage", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
    ("transport", "core/byte_codec.h"): "the one little-endian codec of kvtier's persisted and wire formats",
    ("storage", "core/xxh3.h"): "the one XXH3 of kvtier's checksums, built for the CPU it runs on",
    ("transport", "core/xxh3.h"): "the one XXH3 of kvtier's checksums, built for the CPU it runs on",
}

# Headers outside include/kvtier/<layer>/ and the layer each belongs to: the interfaces a backend implements
# (include/kvtier/backend/) and the test doubles (include/kvtier/testing/).
HEADER_LAYER = {
    "kvtier/backend/device.h": "device",
    "kvtier/backend/storage_backend.h": "storage",
    "kvtier/backend/transport.h": "transport",
    "kvtier/backend/copy_backend.h": "copy",
    "kvtier/backend/plan_executor.h": "cache",
    "kvtier/backend/eviction_policy.h": "cache",
    "kvtier/testing/disk_fault.h": "storage",
    "kvtier/testing/fault_injection.h": "storage",
    "kvtier/testing/plan_executors.h": "testing",
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
    files_of_layer = [os.path.join(ROOT, "include", h) for h, layer in HEADER_LAYER.items() if layer == folder]
    for path in files_of_layer:
        if not os.path.exists(path):
            raise SystemExit(f"check-layers: {path} is listed in HEADER_LAYER but does not exist")
        yield path
    for d in dirs:
        for base, _, files in os.walk(d):
            for f in files:
                if f.endswith((".cc", ".h", ".cu", ".cuh")):
                    yield os.path.join(base, f)


def main():
    bad = []
    for folder in DEPENDS:
        allowed = closure(folder) | {folder}
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
                    if inc in HEADER_LAYER:
                        if HEADER_LAYER[inc] not in allowed:
                            bad.append(f"{rel}:{n}: {folder} includes {inc}: {folder} does not depend on "
                                       f"{HEADER_LAYER[inc]}")
                    elif parts[0] == "kvtier" and len(parts) > 2 and parts[1] in ("backend", "testing"):
                        bad.append(f"{rel}:{n}: {inc} has no layer in HEADER_LAYER")
                    elif parts[0] == "kvtier" and len(parts) > 2 and parts[1] in LAYERS:
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
