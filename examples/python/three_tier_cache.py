#!/usr/bin/env python3
"""A three-tier KV cache from Python: kvtier's CacheManager keeps GPU blocks, pinned host blocks and a storage tier
(prefix index, LRU, write-back), and the engine runs each step's plan with a TransferManager (device <-> host) and
a StorageBackend (host <-> storage). Conversations come and go until the first one's KV has left the device and
the host for storage; when it returns, its prefix is prefetched from storage and loaded instead of recomputed.

    python3 examples/python/three_tier_cache.py [--host]

The storage tier is kvtier's host-memory tier so that the example runs anywhere; "disk:/var/cache/kvtier" or
"redis://host:6379" is the same call. Exits 0 only when the returning prefix came back from storage byte-exact.
"""
import sys

import numpy as np

import kvtier

LAYERS, PAGE, BLOCK_TOKENS = 4, 8 << 10, 16
DEVICE_BLOCKS, HOST_BLOCKS, STORAGE_BLOCKS = 16, 24, 512


class Engine:
    def __init__(self, cuda):
        if cuda:
            import torch
            self.dev = kvtier.cuda_device(0)
            self.kv = [torch.zeros((DEVICE_BLOCKS, PAGE), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
            self.compute = self.dev.adopt_stream(torch.cuda.current_stream().cuda_stream, "forward")
        else:
            self.dev = kvtier.host_device()
            self.kv = [np.zeros((DEVICE_BLOCKS, PAGE), np.uint8) for _ in range(LAYERS)]
            self.compute = self.dev.create_stream("forward")
        self.cuda = cuda
        # Device <-> pinned host: host block b is one page holding every layer's page of a block (a storage object).
        self.tm = kvtier.TransferManager.from_pages(self.dev, self.compute, self.kv, [PAGE] * LAYERS,
                                                    num_host_blocks=HOST_BLOCKS)
        self.store = kvtier.StorageBackend.open("memory:?capacity=64M", "org/model@rev", {})
        self.cache = kvtier.CacheManager(device_blocks=DEVICE_BLOCKS, host_blocks=HOST_BLOCKS,
                                         storage_blocks=STORAGE_BLOCKS, write_policy="write_back")
        self.hasher = kvtier.KeyHasher("org/model@rev", block_tokens=BLOCK_TOKENS)

    def block(self, b):  # every layer's page of device block b
        return b"".join(bytes(t[b].cpu().numpy() if self.cuda else t[b]) for t in self.kv)

    def compute_blocks(self, keys, blocks):
        """The forward writes each block's KV (here: bytes derived from the block's key)."""
        for key, b in zip(keys, blocks):
            seed = int(key[:8], 16)
            for layer, t in enumerate(self.kv):
                page = np.random.default_rng(seed + layer).integers(0, 256, PAGE, dtype=np.uint8)
                if self.cuda:
                    import torch
                    t[b] = torch.from_numpy(page).cuda()
                else:
                    t[b] = page

    def step(self):
        """One step's plan: device -> host first (the loads may reuse those device blocks), the storage moves, then
        host -> device. Each kind is acknowledged by destination block; a failure makes its blocks misses."""
        plan = self.cache.take_plan()
        for kind in ("evictions", "backups"):
            if plan[kind]:
                src, dst = [m[0] for m in plan[kind]], [m[1] for m in plan[kind]]
                self.tm.wait(self.tm.evict(src, dst), timeout=30)
                self.cache.ack(kind, dst)
        # Storage slots the cache gave up: their objects go first (so the store holds no more objects than the
        # tier has slots, and a key written again below is not deleted after its write). Not acknowledged.
        if plan["storage_drops"]:
            self.store.delete_many([m[2] for m in plan["storage_drops"]])  # per key 0, or the error (NotFoundError: absent)
        # Storage objects are named by the block's key; writes read host block src (acked by storage slot dst),
        # prefetches write host block dst. Per item: the bytes moved (int) or the error (a miss, never served).
        for kind, call, host in (("storage_writes", self.store.put_many, 0), ("storage_prefetches",
                                                                              self.store.get_many, 1)):
            moves = plan[kind]
            if moves:
                res = call([m[2] for m in moves], [(self.tm.host_page(m[host]), self.tm.host_page_bytes) for m in moves])
                for m, r in zip(moves, res):
                    self.cache.ack(kind, [m[1]], None if isinstance(r, int) else str(r))
        if plan["loads"]:
            src, dst = [m[0] for m in plan["loads"]], [m[1] for m in plan["loads"]]
            self.tm.wait(self.tm.load([], src, dst), timeout=30)
            self.cache.ack("loads", dst)

    def request(self, keys):
        """Admit (match, pin, allocate), run the step, compute what missed, commit, release."""
        try:
            a = self.cache.admit(keys)
        except kvtier.errors.ResourceExhaustedError:  # the host makes room once its writes to storage land
            self.step()
            a = self.cache.admit(keys)
        self.step()
        hits = a["device_hit_blocks"] + a["host_hit_blocks"]
        self.compute_blocks(keys[hits:], a["device_blocks"][hits:len(keys)])
        self.cache.commit(a["id"])
        self.cache.release(a["id"])
        return a


def main(argv):
    try:
        import torch
        cuda = torch.cuda.is_available() and "--host" not in argv
    except ImportError:
        cuda = False
    e = Engine(cuda)

    def conversation(c):
        return e.hasher.keys_for([1000 * c + i for i in range(4 * BLOCK_TOKENS)])

    first = conversation(0)
    a = e.request(first)
    computed = [e.block(b) for b in a["device_blocks"][:len(first)]]
    for c in range(1, 13):  # 48 more blocks through 16 device and 24 host blocks
        e.request(conversation(c))
    m = e.cache.match(first)
    print(f"conversation 0 now: {m['device_blocks']} blocks on device, {m['host_blocks']} on host, "
          f"{m['storage_blocks']} in storage")
    if m["storage_blocks"] != len(first):
        print("conversation 0 did not reach storage", file=sys.stderr)
        return 1

    queued = 0
    for _ in range(8):  # prefetch from storage to host (a few steps while the host makes room)
        if queued >= len(first):
            break
        queued += e.cache.prefetch(first)
        e.step()
    back = e.cache.admit(first)
    e.step()
    print(f"conversation 0 returns: {back['host_hit_blocks']} blocks loaded from host (prefetched from storage), "
          f"{back['new_blocks']} recomputed")
    same = all(e.block(b) == want for b, want in zip(back["device_blocks"][:len(first)], computed))
    e.cache.release(back["id"])
    e.cache.check_invariants()
    e.tm.close()
    if back["host_hit_blocks"] != len(first) or not same:
        print("the prefix did not come back from storage byte-exact", file=sys.stderr)
        return 1
    print(f"checked {len(first)} blocks of {LAYERS * PAGE} bytes: as computed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
