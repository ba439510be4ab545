#!/usr/bin/env python3
"""Move one prompt's KV from a prefill instance to a decode instance, layer by layer, every block verified on
arrival: kvtier.pd.

    python3 examples/python/prefill_decode.py [push|pull]

Both endpoints live in this one process on the loopback transport so that the example runs anywhere (CI
included). In a deployment each runs in its own process with transport="ipc" (one host) or "ucx" (across hosts),
and the metadata bytes travel between them out of band (the router, a socket). Exits 0 only when every block
arrived verified and byte-exact.
"""
import sys

import numpy as np

from kvtier.pd import Decode, Prefill

LAYERS = 8


def kv_cache(num_blocks, fill=None, seed=0):
    """One (key, value) pair of [num_blocks, heads, tokens, head_dim] tensors per layer."""
    rng = np.random.default_rng(seed)
    shape = (num_blocks, 2, 16, 64)
    if fill is not None:
        return [tuple(np.full(shape, fill, np.float16) for _ in range(2)) for _ in range(LAYERS)]
    return [tuple(rng.standard_normal(shape).astype(np.float16) for _ in range(2)) for _ in range(LAYERS)]


def main(argv):
    mode = argv[0] if argv else "push"
    secret = b"k" * 32  # 32..64 bytes shared by the two instances (from a secret store): authenticates metadata
    prefill_kv, decode_kv = kv_cache(32, seed=1), kv_cache(48, fill=-1.0)
    src, dst = [4, 5, 6, 7, 8, 9], [40, 12, 33, 2, 17, 25]

    prefill = Prefill(prefill_kv, transport="loopback", name="prefill-0", peer_secret=secret)
    decode = Decode(decode_kv, transport="loopback", name="decode-0", peer_secret=secret)
    prefill_peer = decode.add_peer(prefill.metadata())  # the metadata exchange (out of band between processes)
    decode_peer = prefill.add_peer(decode.metadata())

    transfer_id = 1
    decode.start(prefill_peer, transfer_id, dst, mode=mode)
    prefill.begin(decode_peer, transfer_id, src)
    for layer in range(LAYERS):
        prefill.layer_ready(transfer_id, layer)  # as the prefill's forward finishes each layer
    for layer in range(LAYERS):  # the decode's forward: a layer's attention once it is loaded (verified)
        state = decode.wait_layer(transfer_id, layer, timeout=5.0)
        if state != "loaded":
            print(f"layer {layer}: {state}", file=sys.stderr)
            return 1
    status = decode.wait(transfer_id, timeout=10.0, reclaimable=True)
    prefill.wait(transfer_id, timeout=10.0)
    prefill.forget(transfer_id)
    decode.forget(transfer_id)
    print(f"{mode}: {status.leading_loaded_blocks} of {len(dst)} blocks loaded and verified")

    for (pk, pv), (dk, dv) in zip(prefill_kv, decode_kv):
        if not (np.array_equal(pk[src], dk[dst]) and np.array_equal(pv[src], dv[dst])):
            print("a block differs from the prefill's", file=sys.stderr)
            return 1
    others = [b for b in range(48) if b not in dst]
    if not all((dk[others] == -1.0).all() and (dv[others] == -1.0).all() for dk, dv in decode_kv):
        print("a block outside the destination list changed", file=sys.stderr)
        return 1
    prefill.close()
    decode.close()
    return 0 if status.leading_loaded_blocks == len(dst) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
