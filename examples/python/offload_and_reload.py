#!/usr/bin/env python3
"""Offload a prompt's KV blocks to pinned host memory, then reload them layer by layer while the forward waits for
each layer: kvtier's TransferManager from Python.

    python3 examples/python/offload_and_reload.py [--host]

On the first CUDA GPU when torch sees one (KV tensors in CUDA memory), else (or with --host) on kvtier's host
backend with numpy arrays, so it runs in CI. Exits 0 only when every reloaded byte equals what was offloaded.
"""
import sys

import numpy as np

import kvtier

LAYERS, BLOCKS, PAGE = 8, 64, 16 << 10  # per layer: K and V of 16 tokens in one 16 KiB page per block


def main(argv):
    try:
        import torch
        cuda = torch.cuda.is_available() and "--host" not in argv
    except ImportError:
        torch, cuda = None, False
    rng = np.random.default_rng(7)
    prompt, host, reload = list(range(3, 11)), list(range(100, 108)), list(range(20, 28))
    pages = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
    want = [p[prompt].copy() for p in pages]  # what the prefill wrote into the prompt's blocks

    # The device, the engine's KV tensors (one (num_blocks, page) byte tensor per layer) and the stream its
    # forward runs on.
    if cuda:
        dev = kvtier.cuda_device(0)
        kv = [torch.from_numpy(p).cuda() for p in pages]
        compute = dev.adopt_stream(torch.cuda.current_stream().cuda_stream, "forward")
    else:
        dev = kvtier.host_device()
        kv = pages
        compute = dev.create_stream("forward")
    tm = kvtier.TransferManager.from_pages(dev, compute, kv, [PAGE] * LAYERS, num_host_blocks=256)

    # Offload the prompt's blocks to host blocks 100..107 (after the work on the compute stream) and wait.
    tm.wait(tm.evict(prompt, host), timeout=30)
    print(f"offloaded {len(prompt)} blocks of {LAYERS} layers ({tm.host_page_bytes} bytes per host block)")

    # The device blocks are reused (poisoned here); later the prompt comes back into blocks 20..27 (poisoned too).
    for t in kv:
        t[prompt] = 0xDB
        t[reload] = 0xDB
    task = tm.load([], host, reload, on_layer=lambda layer, err: print(f"  layer {layer} {err or 'loaded'}"))
    for layer in range(LAYERS):
        tm.wait_for_layer(task, layer, compute)  # the forward's stream waits on the device (no host block)
        # ... the layer's attention would be enqueued on the stream here ...
    tm.wait(task, timeout=30)  # the load's status: returns, or raises the copy's error
    dev.synchronize(compute, timeout=30)

    got = [(t[reload].cpu().numpy() if cuda else t[reload]) for t in kv]
    bad = [layer for layer in range(LAYERS) if not np.array_equal(got[layer], want[layer])]
    tm.close()
    if bad:
        print(f"layers {bad} differ from what was offloaded", file=sys.stderr)
        return 1
    print(f"reloaded and checked {sum(w.nbytes for w in want)} bytes on the {dev.backend} backend")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
