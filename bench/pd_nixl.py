#!/usr/bin/env python3
"""NIXL (its UCX backend, default settings) moving the block lists that `kvtier bench pd` moves.

Two processes on one machine, as in `kvtier bench pd`: this process is the decode side and measures; for each
(memory, block size) it spawns a prefill process. Each process creates a nixl agent and registers one pool of
`layers x blocks` blocks (a torch CUDA tensor for --memory device; a pinned torch CPU tensor, a plain torch CPU
tensor or a numpy array for --memory host). The agents' metadata and the pools' addresses travel over a
multiprocessing pipe. Then, per op:

  write (push)  the decode side sends "go" over the pipe; the prefill process builds a transfer request from its
                prepared descriptor lists (make_prepped_xfer) and WRITEs its blocks into the decode side's
                blocks with a notification; the transfer ends when that notification reaches the decode side.
  read  (pull)  the decode side builds the request and READs the prefill side's blocks into its own; the
                transfer ends when check_xfer_state says DONE.

Each timed interval is measured in the decode process (as kvtier measures from the decode side's start() until
the blocks are in place) and includes building the request (as kvtier's includes its descriptor lists); the
prepared descriptor lists of both pools are made once per row, outside it. After one warm-up transfer (--warmup)
--reps transfers are timed; p50_gbps is the median over the reps of payload bytes / seconds, gbps the payload of
all reps over their total time (kvtier's `gbps` is of this kind), initiator_p50_gbps the median of the
initiator's own post-to-DONE time. Before every transfer the destination pool is poisoned (0xA5); after it
every transferred block must hold its source block's bytes (a seeded pattern) and every other block the poison
(compared with torch.equal on the GPU for --memory device). A mismatch raises and the script exits non-zero.

Rows: one JSON object per (op, memory, block size) on stdout, or into --json FILE, with peer "nixl", version,
op (write/read), mode (push/pull), memory, block_bytes, blocks (per layer), layers, reps, p50_gbps, gbps,
bytes_checked; a table follows at the end (on stdout with --json FILE, on stderr otherwise).

How the block lists compare with `kvtier bench pd` (tools/cmd_bench_pd.cc):
  - Same shape: --layers 4, --layer-bytes 8 MiB, blocks per layer = max(4, layer_bytes / block_bytes) (512 of
    16 KiB, 8 of 1 MiB), a pool of exactly that many blocks per layer on each side, every block of the pool
    moved in each transfer, one descriptor per block per layer, same default block sizes and 8 timed
    transfers after 1 warm-up.
  - kvtier moves the block ids 0..n-1 in order on both sides (iota). NIXL merges descriptors that are
    contiguous on both sides into one (1.5.1's transfer telemetry: descCount 1 for 64 such 16 KiB blocks, 64
    for permuted ones), so those lists would become one descriptor per layer for NIXL (one for the whole pool
    here, whose layers are contiguous) while kvtier posts one operation per block. By default
    (--order scattered) the same blocks are therefore moved in a seeded random order (--seed; independent
    permutations for the source and the destination), which keeps one descriptor per block; the row's
    `merged_descs` counts the descriptors left after merging contiguous neighbours (NIXL may merge those).
    --order identity moves kvtier's exact iota lists; --order kvtier (the default) moves the lists of kvtier bench
    pd's direct lane (id_i = (a * i + b) mod pool, a coprime to the pool), with --pool-bytes as there. --pool-blocks larger than the block count picks the
    blocks from a larger pool (kvtier has no such option).
  - kvtier's pool is one allocation per layer; here one allocation holds all layers (one registration).
  - kvtier runs its full protocol (per-layer messages, checksums, leases); NIXL moves bytes and one
    notification. kvtier's device rows stage through pinned host memory; NIXL's UCX moves device memory
    directly (cuda_ipc between the two processes on one machine, when UCX picks it).
  - kvtier pins its UCX to one lane (UCX_TLS=tcp with UCX_NET_DEVICES=lo, or shm); NIXL's UCX here runs with
    default settings (UCX picks its transports: cma for host memory between two processes on a CPU-only VM;
    UCX_PROTO_INFO=y prints its choices) unless --ucx-tls / --ucx-net-devices set those variables.
  - kvtier's gbps is total bytes over total time of the timed transfers; p50_gbps is the median of per-transfer
    rates, and `gbps` here is kvtier's kind.

Usage (the nixl-cu13 wheel on PYTHONPATH, e.g. `python3 -m pip install --no-deps --target /tmp/site nixl_cu13-*.whl`
and `export PYTHONPATH=/tmp/site`; it needs torch and numpy, and for device memory libcudart.so.13, which torch's
CUDA 13 builds bring):
  python3 bench/pd_nixl.py --memory device --block-bytes 16384,1048576 --json out.json
  python3 bench/pd_nixl.py --memory host --block-bytes 16384,1048576          # CPU only: numpy pools
Next to: kvtier bench pd --lanes shm --memory host,device --block-sizes 16384,1048576 --no-perftest --json
"""

import argparse
import ctypes
import glob
import importlib
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import numpy as np

POISON = 0xA5
DEFAULT_BLOCK_SIZES = [16384, 65536, 262144, 1048576]
TIMEOUT_S = float(os.environ.get("PD_NIXL_TIMEOUT_S", "120"))


# ---------------------------------------------------------------------------------------------------------------
# Loading torch and nixl


def try_import_torch():
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def preload_cudart():
    """The nixl-cu13 wheel's UCX CUDA modules need libcudart.so.13 (and the driver's libcuda.so.1), which the
    wheel does not ship. torch's CUDA 13 builds bring it as a package; load it globally before UCX starts so the
    modules find it by soname. Returns the path loaded, or None."""
    candidates = []
    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        candidates += glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcudart.so.13*"))
        candidates += glob.glob(os.path.join(base, "torch", "lib", "libcudart.so.13*"))
    for path in sorted(set(candidates)):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return "libcudart.so.13"
    except OSError:
        return None


def load_nixl():
    """(api module, distribution name, version). The nixl-cu13 wheel installs the module nixl_cu13; the `nixl`
    meta package, where installed, provides the module nixl."""
    errors = []
    for module, dist in (("nixl_cu13._api", "nixl-cu13"), ("nixl._api", "nixl"), ("nixl_cu12._api", "nixl-cu12")):
        try:
            api = importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = getattr(sys.modules.get(module.split(".")[0]), "__version__", "unknown")
        return api, dist, version
    raise SystemExit("pd_nixl: nixl is not importable (pip install nixl-cu13):\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------------------------------------------------------
# Pools and block lists


def blocks_for(layer_bytes, block_bytes):
    return max(4, layer_bytes // block_bytes)


def coprime_step(start, pool):
    a = start
    while math.gcd(a, pool) != 1:
        a += 1
    return a


def block_lists(order, seed, pool, count):
    """(source ids on the prefill side, destination ids on the decode side), `count` distinct ids of `pool`."""
    if order == "identity":
        ids = np.arange(count, dtype=np.int64)
        return ids, ids.copy()
    if order == "kvtier":
        # kvtier bench pd's direct lane (tools/cmd_bench_pd.cc, direct_plan): id_i = (a * i + b) mod pool.
        i = np.arange(count, dtype=np.int64)
        a_src, a_dst = coprime_step(7919, pool), coprime_step(104729, pool)
        return (a_src * i + 13) % pool, (a_dst * i + 101) % pool
    rng = np.random.default_rng(seed)
    return rng.permutation(pool)[:count].astype(np.int64), rng.permutation(pool)[:count].astype(np.int64)


def flat_indices(ids, layers, pool):
    """Descriptor indices into a pool's descriptor list (layer-major, `pool` blocks per layer), every layer."""
    return np.concatenate([ids + layer * pool for layer in range(layers)]).astype(np.int32)


def merged_descs(local_idx, remote_idx):
    """Descriptors left when neighbours contiguous on both sides are merged (one pool per side)."""
    if len(local_idx) == 0:
        return 0
    joins = (np.diff(local_idx) == 1) & (np.diff(remote_idx) == 1)
    return int(len(local_idx) - np.count_nonzero(joins))


def source_pattern(seed, layers, pool, block_bytes):
    return np.random.default_rng(seed ^ 0x5EED).integers(0, 256, size=(layers, pool, block_bytes), dtype=np.uint8)


class Pool:
    """One registered region of layers x pool x block_bytes bytes."""

    def __init__(self, memory, host_alloc, gpu, layers, pool, block_bytes):
        self.memory = memory
        self.layers, self.pool, self.block_bytes = layers, pool, block_bytes
        shape = (layers, pool, block_bytes)
        self.torch = None
        if memory == "device":
            self.torch = importlib.import_module("torch")
            self.device = f"cuda:{gpu}"
            self.torch.cuda.set_device(gpu)
            self.data = self.torch.empty(shape, dtype=self.torch.uint8, device=self.device)
            self.addr, self.dev_id, self.mem_type = self.data.data_ptr(), gpu, "VRAM"
        elif host_alloc in ("pinned", "torch"):
            self.torch = importlib.import_module("torch")
            self.device = "cpu"
            self.data = self.torch.empty(shape, dtype=self.torch.uint8, pin_memory=host_alloc == "pinned")
            self.addr, self.dev_id, self.mem_type = self.data.data_ptr(), 0, "DRAM"
        else:
            self.data = np.empty(shape, dtype=np.uint8)
            self.addr, self.dev_id, self.mem_type = self.data.ctypes.data, 0, "DRAM"
        self.nbytes = layers * pool * block_bytes

    def sync(self):
        if self.memory == "device":
            self.torch.cuda.synchronize(self.device)

    def load(self, array):
        if self.torch is None:
            np.copyto(self.data, array)
        else:
            self.data.copy_(self.torch.from_numpy(array))
        self.sync()

    def poison(self):
        if self.torch is None:
            self.data.fill(POISON)
        else:
            self.data.fill_(POISON)
        self.sync()

    def to_same_place(self, array):
        """`array` where this pool's bytes are, for comparison."""
        if self.torch is None:
            return array
        return self.torch.from_numpy(array).to(self.data.device)

    def equals(self, expected):
        self.sync()
        if self.torch is None:
            return bool(np.array_equal(self.data, expected))
        return bool(self.torch.equal(self.data, expected))

    def first_difference(self, expected):
        """(layer, block) of the first block that differs from `expected` (a numpy array)."""
        got = self.data if self.torch is None else self.data.cpu().numpy()
        bad = np.argwhere(np.any(got != expected, axis=2))
        return tuple(int(x) for x in bad[0]) if len(bad) else None

    def reg_descs(self):
        return [(self.addr, self.nbytes, self.dev_id, "")]

    def block_descs(self, addr=None, dev_id=None):
        """This pool's descriptors, or those of the peer's pool of the same shape at `addr` on `dev_id`."""
        return block_descs(
            self.addr if addr is None else addr,
            self.dev_id if dev_id is None else dev_id,
            self.layers * self.pool,
            self.block_bytes,
        )


def block_descs(addr, dev_id, count, block_bytes):
    """Nx3 (address, length, device id): `count` blocks from `addr`, every layer's blocks, layer-major."""
    d = np.empty((count, 3), dtype=np.uint64)
    d[:, 0] = np.uint64(addr) + np.arange(count, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = dev_id
    return d


def make_agent(api, name):
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def wait_done(agent, handle, deadline):
    state = agent.check_xfer_state(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("transfer still in progress at the deadline")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer state {state}")


# ---------------------------------------------------------------------------------------------------------------
# The prefill process


def prefill_main(conn, cfg):
    """Owns the source pool; on ("write", tag) WRITEs the block list into the decode side's pool."""
    agent = handles = reg = None
    code = 1
    try:
        if cfg["memory"] == "device" or cfg["host_alloc"] in ("pinned", "torch"):
            try_import_torch()
            if cfg["memory"] == "device" or cfg["host_alloc"] == "pinned":
                preload_cudart()
        api, _, _ = load_nixl()
        pool = Pool(
            cfg["memory"], cfg["host_alloc"], cfg["prefill_gpu"], cfg["layers"], cfg["pool"], cfg["block_bytes"]
        )
        pool.load(source_pattern(cfg["seed"], cfg["layers"], cfg["pool"], cfg["block_bytes"]))
        agent = make_agent(api, f"pd-nixl-prefill-{os.getpid()}")
        reg = agent.register_memory(pool.reg_descs(), pool.mem_type)
        conn.send(("hello", agent.get_agent_metadata(), pool.addr, pool.dev_id))
        kind, peer_md, peer_addr, peer_dev = conn.recv()
        assert kind == "peer"
        peer = agent.add_remote_agent(peer_md)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pool.block_descs(), pool.mem_type)
        remote_h = agent.prep_xfer_dlist(peer, pool.block_descs(peer_addr, peer_dev), pool.mem_type)
        handles = (local_h, remote_h)
        src_idx = flat_indices(np.asarray(cfg["src_ids"]), cfg["layers"], cfg["pool"])
        dst_idx = flat_indices(np.asarray(cfg["dst_ids"]), cfg["layers"], cfg["pool"])
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] != "write":
                raise RuntimeError(f"unexpected message {msg[0]!r}")
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("WRITE", local_h, src_idx, remote_h, dst_idx, notif_msg=msg[1])
            if agent.transfer(h) == "ERR":
                raise RuntimeError("posting the WRITE failed")
            wait_done(agent, h, time.monotonic() + TIMEOUT_S)
            secs = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            conn.send(("done", secs))
        agent.remove_remote_agent(peer)
        conn.send(("bye",))
        code = 0
    except BaseException:  # noqa: BLE001 -- everything goes back to the decode side
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if handles:
            for h in handles:
                h.release()
        if agent is not None and reg is not None:
            agent.deregister_memory(reg)
        leave(code)


# ---------------------------------------------------------------------------------------------------------------
# The decode process (this one)


class Peer:
    """The prefill process and its pipe."""

    def __init__(self, ctx, cfg):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, cfg), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, want, timeout=TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"the prefill process exited ({self.proc.exitcode}) while waiting for {want!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {want!r} from the prefill process in {timeout:.0f} s")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError("the prefill process failed:\n" + msg[1])
        if msg[0] != want:
            raise RuntimeError(f"expected {want!r} from the prefill process, got {msg[0]!r}")
        return msg

    def close(self):
        """Stops the prefill process; a reply still in flight (after a failure here) is skipped."""
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                deadline = time.monotonic() + 30
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self.conn.poll(0.05) and self.conn.recv()[0] in ("bye", "error"):
                        break
        except (OSError, EOFError):
            pass
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


def as_str(name):
    return name.decode() if isinstance(name, bytes) else name


def wait_notif(agent, peer_name, tag, stash, deadline):
    """Polls the agent's notifications until `tag` from `peer_name` is among them (others are kept)."""
    while True:
        for name, msgs in agent.get_new_notifs().items():
            stash.setdefault(as_str(name), []).extend(msgs)
        msgs = stash.get(as_str(peer_name), [])
        if tag in msgs:
            msgs.remove(tag)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notification {tag!r} from {peer_name}")


def run_pair(api, args, memory, host_alloc, block_bytes, ops):
    """One prefill process and one decode agent for a (memory, block size); a row per op."""
    n = blocks_for(args.layer_bytes, block_bytes)
    pool_n = max(n, args.pool_blocks or 0)
    if args.pool_bytes:
        pool_n = max(2 * n, args.pool_bytes // (args.layers * block_bytes))
    src_ids, dst_ids = block_lists(args.order, args.seed, pool_n, n)
    cfg = dict(
        memory=memory,
        host_alloc=host_alloc,
        prefill_gpu=args.prefill_gpu,
        layers=args.layers,
        pool=pool_n,
        block_bytes=block_bytes,
        seed=args.seed,
        src_ids=src_ids.tolist(),
        dst_ids=dst_ids.tolist(),
    )
    pattern = source_pattern(args.seed, args.layers, pool_n, block_bytes)
    expected_np = np.full_like(pattern, POISON)
    expected_np[:, dst_ids] = pattern[:, src_ids]
    del pattern
    pool = Pool(memory, host_alloc, args.decode_gpu, args.layers, pool_n, block_bytes)
    expected = pool.to_same_place(expected_np)
    pool.poison()
    src_idx = flat_indices(src_ids, args.layers, pool_n)
    dst_idx = flat_indices(dst_ids, args.layers, pool_n)
    payload = args.layers * n * block_bytes

    ctx = mp.get_context("spawn")
    peer = Peer(ctx, cfg)
    agent = make_agent(api, f"pd-nixl-decode-{os.getpid()}")
    reg = agent.register_memory(pool.reg_descs(), pool.mem_type)
    handles = []
    rows = []
    try:
        _, peer_md, peer_addr, peer_dev = peer.recv("hello")
        peer_name = agent.add_remote_agent(peer_md)
        peer.conn.send(("peer", agent.get_agent_metadata(), pool.addr, pool.dev_id))
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pool.block_descs(), pool.mem_type)
        remote_h = agent.prep_xfer_dlist(peer_name, pool.block_descs(peer_addr, peer_dev), pool.mem_type)
        handles = [local_h, remote_h]
        peer.recv("ready")
        stash = {}

        def check(op, rep):
            if not pool.equals(expected):
                where = pool.first_difference(expected_np)
                raise RuntimeError(
                    f"BYTES DIFFER after {op} rep {rep} ({memory}, {block_bytes} B blocks): first wrong block "
                    f"(layer, block) = {where} of the decode pool"
                )

        for op in ops:
            times, init_times = [], []
            for rep in range(args.warmup + args.reps):
                pool.poison()
                deadline = time.monotonic() + TIMEOUT_S
                if op == "write":
                    tag = f"pd-nixl {block_bytes} {rep}".encode()
                    t0 = time.perf_counter()
                    peer.conn.send(("write", tag))
                    wait_notif(agent, peer_name, tag, stash, deadline)
                    secs = time.perf_counter() - t0
                    check(op, rep)  # on the notification, before the initiator says DONE
                    init_secs = peer.recv("done")[1]
                else:
                    t0 = time.perf_counter()
                    h = agent.make_prepped_xfer("READ", local_h, dst_idx, remote_h, src_idx)
                    if agent.transfer(h) == "ERR":
                        raise RuntimeError("posting the READ failed")
                    wait_done(agent, h, deadline)
                    secs = time.perf_counter() - t0
                    agent.release_xfer_handle(h)
                    init_secs = secs
                    check(op, rep)
                if rep >= args.warmup:
                    times.append(secs)
                    init_times.append(init_secs)
            rates = [payload / t / 1e9 for t in times]
            rows.append(
                dict(
                    bench="pd",
                    peer="nixl",
                    nixl_package=args.nixl_dist,
                    version=args.nixl_version,
                    backend="UCX",
                    op=op,
                    mode="push" if op == "write" else "pull",
                    memory=memory,
                    host_alloc=host_alloc if memory == "host" else None,
                    block_bytes=block_bytes,
                    blocks=n,
                    pool_blocks=pool_n,
                    layers=args.layers,
                    descs=len(src_idx),
                    merged_descs=merged_descs(src_idx, dst_idx),
                    order=args.order,
                    seed=args.seed,
                    warmup=args.warmup,
                    reps=args.reps,
                    bytes_per_transfer=payload,
                    p50_gbps=statistics.median(rates),
                    gbps=payload * len(times) / sum(times) / 1e9,
                    min_gbps=min(rates),
                    max_gbps=max(rates),
                    initiator_p50_gbps=statistics.median(payload / t / 1e9 for t in init_times),
                    p50_us=statistics.median(times) * 1e6,
                    ucx_tls=os.environ.get("UCX_TLS"),
                    ucx_net_devices=os.environ.get("UCX_NET_DEVICES"),
                    gpus=[args.prefill_gpu, args.decode_gpu] if memory == "device" else None,
                    bytes_checked=True,
                )
            )
        agent.remove_remote_agent(peer_name)
    finally:
        try:
            peer.close()
        finally:
            for h in handles:
                h.release()
            agent.deregister_memory(reg)
            del agent
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Command line


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory", type=csv(str), default=["host"], help="host, device, or host,device")
    p.add_argument(
        "--host-alloc",
        choices=["auto", "pinned", "torch", "numpy"],
        default="auto",
        help="host pools: pinned torch CPU tensor, plain torch CPU tensor, numpy (auto: pinned with CUDA, else numpy)",
    )
    p.add_argument("--block-bytes", "--block-sizes", type=csv(int), default=DEFAULT_BLOCK_SIZES, dest="block_bytes")
    p.add_argument(
        "--ops", "--modes", type=csv(str), default=["write", "read"], dest="ops", help="write,read (push,pull)"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layer-bytes", type=int, default=8 << 20, help="sets blocks per layer (>= 4), as kvtier's")
    p.add_argument("--pool-blocks", type=int, default=0, help="pool blocks per layer (default: the block count)")
    p.add_argument("--order", choices=["kvtier", "scattered", "identity"], default="kvtier")
    p.add_argument("--pool-bytes", type=int, default=0,
                   help="pool per side, all layers (as kvtier bench pd --pool-bytes): pool blocks per layer = "
                        "max(2 x blocks, pool_bytes / (layers x block_bytes)); overrides --pool-blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", "--iters", type=int, default=8, dest="reps", help="timed transfers per row")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prefill-gpu", type=int, default=0)
    p.add_argument("--decode-gpu", type=int, default=0)
    p.add_argument("--ucx-tls", help="sets UCX_TLS in both processes (default: UCX's own choice)")
    p.add_argument("--ucx-net-devices", help="sets UCX_NET_DEVICES in both processes")
    p.add_argument("--json", metavar="FILE", help="write the JSON rows to FILE ('-': stdout, the default)")
    a = p.parse_args(argv)
    a.ops = [{"push": "write", "pull": "read"}.get(o, o) for o in a.ops]
    for o in a.ops:
        if o not in ("write", "read"):
            p.error(f"op {o!r} is not write, read, push or pull")
    for m in a.memory:
        if m not in ("host", "device"):
            p.error(f"memory {m!r} is not host or device")
    if a.reps < 1 or a.warmup < 0 or a.layers < 1:
        p.error("--reps >= 1, --warmup >= 0, --layers >= 1")
    for b in a.block_bytes:
        if b <= 0:
            p.error("block sizes must be positive")
    return a


def print_table(rows, out):
    if not rows:
        print("pd_nixl: no rows", file=out)
        return
    head = f"{'op':<6} {'mode':<5} {'memory':<7} {'block_bytes':>11} {'blocks':>7} {'descs':>6} {'p50_gbps':>9}"
    head += f" {'gbps':>8} {'min':>8} {'max':>8} {'init_p50':>9} {'checked':>8}"
    print(f"nixl {rows[0]['version']} (UCX, default settings), {rows[0]['order']} block lists", file=out)
    print(head, file=out)
    for r in rows:
        print(
            f"{r['op']:<6} {r['mode']:<5} {r['memory']:<7} {r['block_bytes']:>11} {r['blocks']:>7} {r['descs']:>6}"
            f" {r['p50_gbps']:>9.2f} {r['gbps']:>8.2f} {r['min_gbps']:>8.2f} {r['max_gbps']:>8.2f}"
            f" {r['initiator_p50_gbps']:>9.2f} {str(r['bytes_checked']).lower():>8}",
            file=out,
        )
    out.flush()


def main(argv=None):
    args = parse_args(argv)
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    if args.ucx_net_devices:
        os.environ["UCX_NET_DEVICES"] = args.ucx_net_devices
    torch = None
    if "device" in args.memory or args.host_alloc in ("auto", "pinned", "torch"):
        torch = try_import_torch()
    cuda = torch is not None and torch.cuda.is_available()
    if "device" in args.memory and not cuda:
        raise SystemExit("pd_nixl: --memory device needs torch with a visible CUDA device")
    if cuda:
        if preload_cudart() is None:
            print(
                f"pd_nixl: warning: no libcudart.so.13 found (torch CUDA {torch.version.cuda}); the nixl-cu13 wheel's"
                " UCX may not load its CUDA transports",
                file=sys.stderr,
            )
    host_alloc = args.host_alloc
    if host_alloc == "auto":
        host_alloc = "pinned" if cuda else "numpy"
    elif host_alloc in ("pinned", "torch") and torch is None:
        raise SystemExit(f"pd_nixl: --host-alloc {host_alloc} needs torch")
    elif host_alloc == "pinned" and not cuda:
        raise SystemExit("pd_nixl: --host-alloc pinned needs a visible CUDA device (use numpy or torch)")
    api, args.nixl_dist, args.nixl_version = load_nixl()

    out = sys.stdout if args.json in (None, "-") else open(args.json, "w")
    rows = []
    rc = 0
    try:
        for memory in args.memory:
            for bs in args.block_bytes:
                try:
                    got = run_pair(api, args, memory, host_alloc, bs, args.ops)
                except Exception as e:  # noqa: BLE001 -- one failed row must not hide the others
                    print(f"pd_nixl: {memory} {bs}: {e}", file=sys.stderr)
                    if "BYTES DIFFER" in str(e):
                        raise
                    rc = 1
                    continue
                for r in got:
                    print(json.dumps(r), file=out, flush=True)
                rows += got
    finally:
        if out is not sys.stdout:
            out.close()
    print_table(rows, sys.stderr if out is sys.stdout else sys.stdout)
    return rc


def leave(code):
    """Exits without running the process's exit handlers: the libnl-route that the nixl-cu13 1.5.1 wheel bundles
    (loaded by its UCX) crashes in its destructor at exit (SIGSEGV in _dl_fini, also with a bare agent), which
    would replace the exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli(argv=None):
    """main() with the exit status kept (see leave())."""
    try:
        status = main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 2
    except BaseException:  # noqa: BLE001 -- printed, then the exit status says it
        traceback.print_exc()
        status = 3
    leave(status)


if __name__ == "__main__":
    cli()
