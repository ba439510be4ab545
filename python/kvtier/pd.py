"""Prefill/decode KV transfer between two inference instances (kvtier.pd).

A prefill instance holds a prompt's KV in its blocks; a decode instance continues from it in
its own blocks. Each side creates an endpoint over its KV tensors, the two exchange their
metadata as bytes (out of band: the router, a socket, a pipe), and for every prompt:

- the decode side calls ``start(peer, transfer_id, dst_blocks, mode)``: ``"push"`` (the
  prefill writes each layer into the decode blocks as soon as it is ready) or ``"pull"`` (the
  decode reads each layer once the prefill announced it);
- the prefill side calls ``begin(peer, transfer_id, src_blocks)`` and ``layer_ready(transfer_id,
  layer)`` per layer as its forward pass finishes it (any order; before or after ``start``);
- the decode side waits per layer (``wait_layer``) or for all (``wait``), reads ``status``
  (which blocks were verified: ``leading_loaded_blocks`` is what may join a prefix index),
  and both sides ``forget`` the transfer once it is final and reclaimable.

Every (block, layer) is checksummed on the prefill side and verified on the decode side
before it is reported loaded; a failed block is never reported loaded. Leases (``heartbeat_s``,
``lease_s``) fail a transfer whose peer went silent. Contract: include/kvtier/transport/pd.h.

KV tensors. ``kv`` is either a list with one entry per layer, each a ``(key, value)`` pair of
tensors (or one tensor: MLA's latent), every tensor ``[num_blocks, ...]`` with each block
contiguous; or the name map of FastDeploy's ``CacheTransferManager``
(``key_caches_{layer}_rank{r}.device{d}``, ``value_caches_...``, ``*_cache_scales_...``), as
:meth:`kvtier.TransferManager.from_tensors` takes. Tensors are DLPack objects (numpy, torch,
cupy, paddle). Both sides must have the same per-block layout: dtype, bytes, roles, tokens per
block, each tensor's per-block shape and the tensor-parallel ``rank`` (the metadata exchange
refuses another one); their block counts may differ.

Memory. Without ``device`` the tensors are memory the CPU addresses (numpy, CPU or pinned
tensors) and the transfer moves them directly. With ``device`` (:func:`kvtier.cuda_device`,
or :func:`kvtier.host_device` in tests) they are that device's memory: each layer moves
through pinned host staging with kvtier's copy engine; ``Prefill.layer_ready(..., stream=s)``
declares a layer ready once the work enqueued so far on the engine's stream ``s`` completed
(no host sync), and ``Decode.wait_layer_on_stream(..., stream=s)`` makes ``s`` wait on the GPU
for the layer's copy.

``lane="direct"`` (with ``device``, and ``transport="ipc"`` between CUDA processes or
``"loopback"`` in one) is the device lane: each side maps the other's pool (CUDA IPC) and each
layer moves by one copy-kernel launch straight between the two pools, checksummed on the GPU by
the kernel that moves it; nothing is staged. A layer reported loaded by ``wait_layer`` is then
final in device memory. ``verify`` (the decode side's choice) names who checksums every block a
second time, after the copy: ``"mover"`` (default; the side that moved the layer reads its
destinations back, so the GPU work of a transfer stays in one process's CUDA context) or
``"receiver"`` (the other side checks its own blocks; in pull that also catches a source the
prefill changed after announcing it). ``read_back`` (each side's own choice) is how a moving side
reads back: ``"copy"`` (default; inside its copy kernel, each warp re-reading from L2 what it wrote
one work item earlier, with one CTA per SM) or ``"pass"`` (a separate read-only pass on a second
stream, the copy keeping 32 CTAs: fewer SMs taken from a forward pass running beside it, about 0.7
of a plain gather's rate against 0.85-0.9 on an H200).

``lane="ring"`` (with ``device``, ``transport="ipc"`` or ``"loopback"``) is the ring lane, for
GPUs that cannot map each other's pools (no peer access, containers without CUDA IPC): the
decode side owns a ring of ``ring_slots`` slots of ``ring_slot_bytes`` pinned host memory that
both processes map; the prefill's copy engine moves each piece of a layer from its pool into a
slot the decode granted, the decode's moves it on into its pool, and the checksums of both
device sides are compared (``ring_copy``: ``"auto"`` copies with the engine's choice and
checksums in a pass over device memory; ``"sm_kernel"`` folds them into the copy). Both sides
pass ``lane="ring"``; the decode's ring settings are the ones used.

``lane="host-direct"`` (host memory, ``transport="ucx"`` with ``tls="shm"`` between processes of
one host, or ``"loopback"`` in one) is the host direct lane: the endpoint allocates its pool in
its transport's memory, which the peer's transport maps, as a copy of ``kv`` (the same tensors
and shapes); the engine then keeps its KV in :meth:`kv_pool`'s arrays, not in ``kv``. The side
that moves a layer copies it through that mapping and checksums what it read and what landed in
the same pass: with the checksums on it moves 0.9-1.2x the raw UCX transport on two cores and
2-3x on sixteen (``docs/performance.md``). Both sides pass ``lane="host-direct"``.

Transports: ``"ipc"`` (same host, two processes; memory shared through sealed memfd windows),
``"ucx"`` (``tls="tcp"`` across hosts, ``"shm"`` on one; ``net_devices="lo"`` for loopback TCP;
over TCP each side checks and lands the other's bytes itself, so a peer given up on after its lease
lands nothing more: docs/transport.md, "Data path over TCP"), ``"loopback"`` (one process: tests). ``peer_secret`` (32 to 64 bytes shared by the two sides)
authenticates the metadata blobs with a keyed MAC; without it the channel that carries them
must be trusted (docs/transport.md, "Trust").

Errors are the exceptions of :mod:`kvtier.errors` with kvtier's message (a bad block id is an
``OutOfRangeError`` or ``InvalidArgumentError``, an unknown transfer ``NotFoundError``, a
damaged or foreign blob ``DataLossError`` / ``FailedPreconditionError``, a wait past its
timeout ``TimedOutError``). Waits release the GIL and take ``timeout`` in seconds (``None``:
no deadline).

Through the cache. An engine whose device blocks are kept by kvtier's ``CacheManager`` (with a
``TransferManager`` over the same tensors) receives through a :class:`Receiver`: it admits the
prompt's keys (blocks being received are never matched, evicted or reused), guards the blocks on
the ``TransferManager`` (the forward waits per layer with ``wait_for_layer`` / ``wait_layer_host``,
as for a local load, and a block that failed is never reported loaded), and commits what arrived
verified to the prefix index.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import numbers
import operator
import os
import re
import socket
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from . import _native
from .errors import InvalidArgumentError, KvtierError, OutOfRangeError

logger = logging.getLogger("kvtier.pd")


def _int(value: Any, what: str) -> int:
    """``value`` as an integer (Python or numpy integers): a float, a bool or anything else is refused, naming it;
    ``int()`` would silently take 7.9 as 7 and True as 1."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} {value!r} is a bool, not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} {value!r} is a {type(value).__name__}, not an integer") from None


def _ranged(value: Any, what: str, low: int, high: int) -> int:
    v = _int(value, what)
    if not low <= v <= high:
        raise OutOfRangeError(f"{what} {v} is not in [{low}, {high}]")
    return v


def _seconds(value: Any, what: str) -> float:
    """``value`` as a number of seconds (an int or a float, numpy's included): a bool, a string or anything else is
    refused, naming it; ``float()`` would take True as 1.0 and "0.1" as 0.1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} {value!r} is a {type(value).__name__}, not a number of seconds")
    return float(value)


def _timeout(value: Any) -> Optional[float]:
    """A wait's timeout: None (no deadline) or a number of seconds (a bool or a string is refused, naming it)."""
    return None if value is None else _seconds(value, "timeout")


def _rxid(value: Any) -> int:
    # A receiver's transfer ids are the unsigned 63 bits the decode endpoint starts (a negative one raised
    # nanobind's unnamed TypeError).
    return _ranged(value, "transfer id", 0, (1 << 63) - 1)


def _peer(value: Any) -> int:
    return _ranged(value, "peer", 0, (1 << 32) - 1)


def _xid(value: Any) -> int:
    # Negative ids get the native layer's message; the native layer takes 63 bits.
    return _ranged(value, "transfer id", -(1 << 63), (1 << 63) - 1)


def _layer(value: Any) -> int:
    return _ranged(value, "layer", -(1 << 63), (1 << 63) - 1)


def _count(value: Any, what: str) -> int:
    return _ranged(value, what, 0, (1 << 32) - 1)


def _mode(value: Any) -> str:
    if value not in ("push", "pull") or not isinstance(value, str):
        raise InvalidArgumentError(f"mode {value!r} is not 'push' or 'pull'")
    return value


def _flag(value: Any, what: str) -> bool:
    """A bool (numpy's included): "yes" or 1 are refused, naming them; ``bool()`` would take "no" as True."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")):
        return bool(value)
    raise InvalidArgumentError(f"{what} {value!r} is a {type(value).__name__}, not a bool")


def _keys(keys: Any) -> List[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) and not hasattr(keys, "tolist"):
        raise InvalidArgumentError(f"keys {keys!r} is not a sequence of keys (32 hex digits each)")
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, str):
            raise InvalidArgumentError(f"key {k!r} at index {i} is a {type(k).__name__}, not 32 hex digits")
    return out


def _blocks(ids: Sequence[Any], what: str) -> List[int]:
    # An ordered sequence only: position i of one side's list pairs with position i of the other's, so a set's or
    # a dict's arbitrary order would pair blocks arbitrarily.
    if isinstance(ids, (str, bytes, set, frozenset, dict)) or not hasattr(ids, "__iter__"):
        raise InvalidArgumentError(f"{what} blocks {ids!r} is not a sequence of block ids (an ordered one: a list, a "
                                   "tuple, a range, an array)")
    out = []
    for i, b in enumerate(ids):
        v = _int(b, f"{what} block id at index {i}:")
        if not -(1 << 63) <= v < (1 << 63):  # the native layer names negative and too large ids that fit 64 bits
            raise OutOfRangeError(f"{what} block id {v} at index {i} does not fit a 32-bit block id")
        out.append(v)
    return out

__all__ = ["Prefill", "Decode", "Receiver", "Receive", "ReceiveOutcome", "PrefillStatus", "DecodeStatus",
           "DEFAULT_TIMEOUT"]

#: The timeout (seconds) of every wait that is not given one.
DEFAULT_TIMEOUT = 60.0

_names = itertools.count()

# Endpoints and receivers still open when the interpreter exits are closed by atexit, before the extension's
# types go: left to finalization, their native parts (which hold the Device) could outlive the module, and
# nanobind reports them as leaked.
_open_receivers: "weakref.WeakSet" = weakref.WeakSet()
_open_endpoints: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_objects() -> None:
    for group in (_open_receivers, _open_endpoints):  # receivers drive endpoints: first
        for obj in list(group):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 (exiting: nothing to report to)
                pass


_KEY_RE = re.compile(r"^key_caches_(\d+)_rank")


@dataclass
class PrefillStatus:
    """A prefill transfer's state. ``error`` is the exception of its failure (None when none).

    ``times``: the steps this side has reached, in seconds of ``time.monotonic()``'s clock (system-wide, so the two
    sides compare on one host): ``started`` (begin), ``request`` (the decode's request arrived), ``move`` and
    ``moved`` (this side's first copy or write began, its last was seen complete), ``announced`` (its last layer's
    notification went out), ``final``.
    """

    final: bool
    done: bool
    reclaimable: bool
    layers_sent: int
    error: Optional[KvtierError] = None
    times: Dict[str, float] = field(default_factory=dict)


@dataclass
class DecodeStatus:
    """A decode transfer's state.

    ``layers``: per layer ``"pending"``, ``"loaded"``, ``"partial"`` or ``"failed"``;
    ``block_loaded``: per position of the destination list, every layer verified;
    ``leading_loaded_blocks``: positions ``[0, n)`` all loaded (what may join a prefix index);
    ``reclaimable``: no byte can still land in the destination blocks;
    ``error``: the exception of the first failure (None when every block loaded);
    ``times``: the steps this side has reached (as ``PrefillStatus.times``: ``started``, ``request`` sent, ``move``
    and ``moved`` where this side reads, ``final``).
    """

    final: bool
    reclaimable: bool
    layers: List[str] = field(default_factory=list)
    block_loaded: List[bool] = field(default_factory=list)
    leading_loaded_blocks: int = 0
    error: Optional[KvtierError] = None
    times: Dict[str, float] = field(default_factory=dict)


KvTensors = Union[Mapping[str, Any], Sequence[Any]]


def _name_map(kv: KvTensors, rank: int, device_label: int) -> Dict[str, Any]:
    """The FastDeploy name map of ``kv`` (a name map already, or one entry per layer)."""
    if isinstance(kv, Mapping):
        return {str(k): v for k, v in kv.items() if v is not None}
    if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence) or len(kv) == 0:
        raise InvalidArgumentError(f"kv is {type(kv).__name__}; expected a non-empty list with one (key, value) "
                                   f"pair per layer, or FastDeploy's name -> tensor map")
    out: Dict[str, Any] = {}
    suffix = f"_rank{rank}.device{device_label}"
    for layer, entry in enumerate(kv):
        parts = list(entry) if isinstance(entry, (tuple, list)) else [entry]
        if not 1 <= len(parts) <= 2:
            raise InvalidArgumentError(f"kv[{layer}] has {len(parts)} tensors; expected (key, value) or one tensor "
                                       f"(MLA's latent)")
        for role, tensor in zip(("key_caches", "value_caches"), parts):
            out[f"{role}_{layer}{suffix}"] = tensor
    return out


def _check_tensors(tensors: Mapping[str, Any]) -> None:
    """What the native layer would refuse with a message naming no tensor: objects that are not DLPack tensors,
    read-only arrays (the decode side writes into them, and every endpoint registers its memory writable), and
    arrays of Python objects."""
    for name, t in tensors.items():
        if not hasattr(t, "__dlpack__"):
            raise InvalidArgumentError(f"tensor '{name}' is a {type(t).__name__}, not a DLPack tensor (numpy, torch, "
                                       f"cupy, paddle)")
        flags = getattr(t, "flags", None)
        if flags is not None and getattr(flags, "writeable", True) is False:
            raise InvalidArgumentError(f"tensor '{name}' is read-only; kvtier needs tensors it may write")
        if getattr(getattr(t, "dtype", None), "kind", None) == "O":
            raise InvalidArgumentError(f"tensor '{name}' holds Python objects (dtype object), not KV bytes")


def _num_layers(names: Mapping[str, Any]) -> int:
    layers = {int(m.group(1)) for m in (_KEY_RE.match(n) for n in names) if m}
    return len(layers)


class _Endpoint:
    _role = ""

    def __init__(self, kv: KvTensors, *, transport: str = "ipc", name: Optional[str] = None,
                 peer_secret: Optional[bytes] = None, tls: str = "", net_devices: str = "",
                 heartbeat_s: float = 0.1, lease_s: float = 1.0, device: Any = None,
                 staging_blocks: int = 0, num_model_layers: Optional[int] = None, rank: int = 0,
                 device_label: int = 0, block_tokens: int = 64, lane: str = "auto", verify: str = "mover",
                 ring_slots: int = 4, ring_slot_bytes: int = 32 << 20, ring_copy: str = "auto",
                 read_back: str = "copy", request_wait_s: float = 60.0):
        tensors = _name_map(kv, rank, device_label)
        _check_tensors(tensors)
        self._pairs = None if isinstance(kv, Mapping) else len(kv)  # kv_pool() answers in the caller's form
        if num_model_layers is None:
            num_model_layers = _num_layers(tensors)
        if name is None:  # unique across the hosts and processes that talk to each other
            name = f"{self._role}-{socket.gethostname()[:64]}-{os.getpid()}-{next(_names)}"
        if peer_secret is not None and not isinstance(peer_secret, (bytes, bytearray, memoryview)):
            # bytes(40) would be 40 zero bytes: a secret anyone could guess, accepted without a word.
            raise InvalidArgumentError(
                f"peer_secret is a {type(peer_secret).__name__}; it must be bytes (32 to 64 of them)")
        if peer_secret is not None and len(peer_secret) == 0:
            # An unset variable read as b"" would otherwise mean "no secret": unauthenticated, without a word.
            raise InvalidArgumentError("peer_secret is empty; give 32 to 64 bytes, or None for no secret")
        secret = b"" if peer_secret is None else bytes(peer_secret)
        self._device = device
        self._streams: Dict[int, Any] = {}  # engine streams adopted on the device, by handle
        self._ep = _native.PdEndpoint.create(
            self._role, tensors, transport, name, _count(num_model_layers, "num_model_layers"), device=device,
            peer_secret=secret, tls=tls, net_devices=net_devices, heartbeat_s=_seconds(heartbeat_s, "heartbeat_s"),
            lease_s=_seconds(lease_s, "lease_s"), rank=_ranged(rank, "rank", 0, (1 << 31) - 1),
            device_label=_ranged(device_label, "device_label", 0, (1 << 31) - 1),
            block_tokens=_count(block_tokens, "block_tokens"),
            staging_blocks=_ranged(staging_blocks, "staging_blocks", 0, (1 << 64) - 1), lane=lane, verify=verify,
            ring_slots=_count(ring_slots, "ring_slots"),
            ring_slot_bytes=_ranged(ring_slot_bytes, "ring_slot_bytes", 0, (1 << 64) - 1), ring_copy=ring_copy,
            read_back=read_back, request_wait_s=_seconds(request_wait_s, "request_wait_s"))
        _open_endpoints.add(self)

    # ---- identity and peers

    @property
    def name(self) -> str:
        """This endpoint's agent name (unique among the endpoints that talk to each other)."""
        return self._ep.name

    @property
    def transport(self) -> str:
        """The transport's backend name."""
        return self._ep.transport

    def kv_pool(self) -> KvTensors:
        """The host direct lane's pool (``lane="host-direct"``): numpy arrays over the transport's memory, in the
        form ``kv`` was given (a list of (key, value) per layer, or the name map). The engine reads and writes its KV
        there; each array keeps the pool alive. Other lanes: InvalidArgumentError."""
        pool = self._ep.kv_pool()
        if not pool:
            raise InvalidArgumentError(f"endpoint '{self.name}' runs the {self.lane} lane; kv_pool() is the "
                                       f"host direct lane's (lane='host-direct')")
        if self._pairs is None:
            return pool
        out = []
        for layer in range(self._pairs):
            parts = [v for role in ("key_caches", "value_caches") for k, v in pool.items()
                     if k.startswith(f"{role}_{layer}_")]
            out.append(tuple(parts) if len(parts) == 2 else parts[0])
        return out

    @property
    def lane(self) -> str:
        """How blocks move: "host" (the transport on host memory), "host-direct" (the host direct lane),
        "staged" (device memory through pinned
        staging), "direct" (the copy kernel between the two device pools) or "ring" (through the decode's shared
        pinned ring)."""
        return self._ep.lane

    @property
    def device(self) -> Any:
        """The :class:`kvtier.Device` the KV lives on (staged endpoints), or None (host memory)."""
        return self._device

    @property
    def num_layers(self) -> int:
        return self._ep.num_layers

    @property
    def num_blocks(self) -> int:
        return self._ep.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer and role."""
        return self._ep.block_bytes

    @property
    def layout(self) -> str:
        return self._ep.layout

    def metadata(self) -> bytes:
        """This endpoint's metadata blob, for the other side's :meth:`add_peer`."""
        return self._ep.metadata()

    def add_peer(self, metadata: bytes) -> int:
        """Loads the other side's metadata blob; returns its peer id."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"metadata is {type(metadata).__name__}, not bytes")
        return self._ep.add_peer(bytes(metadata))

    def disconnect_peer(self, peer: int) -> None:
        """Drops a peer (idempotent): its name is free for :meth:`add_peer`, which connects afresh.
        ``FailedPreconditionError`` while a transfer with the peer is not final (wait for it, or cancel it). After a lease expired with both sides alive (a paused process), each side has
        dropped or will drop the other: both call ``disconnect_peer`` on the old peer id, exchange metadata again
        and go on with the new peer ids (docs/transport.md, "After a lease expired with both sides alive")."""
        self._ep.disconnect_peer(_peer(peer))

    def forget(self, transfer_id: int) -> None:
        """Forgets a final, reclaimable transfer (``FailedPreconditionError`` otherwise)."""
        self._ep.forget(_xid(transfer_id))

    def _stream(self, stream: Any):
        """A :class:`kvtier.Stream` for ``stream``: one already, or the engine's stream (a torch or cupy stream,
        or a ``cudaStream_t`` as an int) adopted on the endpoint's device (never destroyed by kvtier)."""
        if stream is None or isinstance(stream, _native.Stream):
            return stream
        if self._device is None:
            raise InvalidArgumentError(f"a stream was given to endpoint '{self.name}', which was created without a "
                                       f"device (host memory needs no stream)")
        if isinstance(stream, bool):  # an int to Python, and True would be handle 1: the legacy default stream
            raise InvalidArgumentError(f"stream {stream!r} is a bool, not a stream or a CUDA stream handle")
        if isinstance(stream, int):
            handle = stream
        else:
            # torch: .cuda_stream, cupy: .ptr; 0 is a valid handle (the legacy default stream, torch's default).
            handle = getattr(stream, "cuda_stream", None)
            if handle is None:
                handle = getattr(stream, "ptr", None)
            if handle is None:
                raise InvalidArgumentError(f"stream {stream!r} is not a kvtier Stream, a torch or cupy stream, or a "
                                           f"CUDA stream handle")
            handle = int(handle)
        if not 0 <= handle < 1 << 64:
            raise InvalidArgumentError(f"stream handle {handle} is not a CUDA stream handle (0 to 2**64 - 1)")
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = self._device.adopt_stream(handle, f"engine-{handle:#x}")
        return s

    def close(self) -> None:
        """Stops the endpoint and its transport (idempotent). Waits in flight on other threads raise
        ``FailedPreconditionError`` at once, and the endpoint is torn down before this returns (unless a call
        in flight keeps it for more than 10 s); transfers in flight fail at the peer. Arrays of :meth:`kv_pool`
        still referenced keep only the pool's memory (and the transport that owns it) until they go: the protocol
        ends at once, and nothing the peer sends lands in them through it any more. ``FailedPreconditionError``
        while a :class:`Receiver` drives the endpoint (close the receiver first)."""
        self._ep.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except KvtierError as e:
            # The body's own exception is what the caller must see (a Receiver still driving the endpoint made
            # close() raise, which replaced it).
            logger.warning("kvtier.pd: closing '%s' while %s propagates: %s", self.name, exc_type.__name__, e)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, transport={self._ep.transport!r}, blocks={self.num_blocks})"


class Prefill(_Endpoint):
    """The prefill side: sends its blocks, layer by layer, to decode endpoints."""

    _role = "prefill"

    def begin(self, peer: int, transfer_id: int, src_blocks: Sequence[int]) -> None:
        """Declares transfer ``transfer_id`` of ``src_blocks`` (in the order of the decode side's destination list)."""
        self._ep.begin(_peer(peer), _xid(transfer_id), _blocks(src_blocks, "source"))

    def layer_ready(self, transfer_id: int, layer: int, stream: Any = None) -> None:
        """Declares ``layer`` ready: now, or (``stream``: a :class:`kvtier.Stream` of the endpoint's device, or the
        engine's torch / cupy stream or ``cudaStream_t``) once the work enqueued so far on that stream completed,
        without blocking the host."""
        self._ep.layer_ready(_xid(transfer_id), _layer(layer), self._stream(stream))

    def layers_ready(self, transfer_id: int, layers: Sequence[int]) -> None:
        """Declares every layer of ``layers`` ready now, in one call (the forward pass that computed them has
        finished): the device lane moves those whose destinations it knows as one copy, where ``layer_ready`` layer
        by layer launches each alone. Every layer is checked before any is declared."""
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise InvalidArgumentError(f"layers {layers!r} is a {type(layers).__name__}, not a sequence of layer indices")
        self._ep.layers_ready(_xid(transfer_id), [_layer(l) for l in layers])

    def status(self, transfer_id: int) -> PrefillStatus:
        return PrefillStatus(**self._ep.status(_xid(transfer_id)))

    def wait(self, transfer_id: int, timeout: Optional[float] = DEFAULT_TIMEOUT) -> PrefillStatus:
        """Until the transfer is final and its source blocks reclaimable (``TimedOutError`` past ``timeout``)."""
        return PrefillStatus(**self._ep.wait(_xid(transfer_id), _timeout(timeout)))


class Decode(_Endpoint):
    """The decode side: receives a prefill's blocks into its own."""

    _role = "decode"

    def start(self, peer: int, transfer_id: int, dst_blocks: Sequence[int], mode: str = "push") -> None:
        """Starts transfer ``transfer_id`` from ``peer`` into ``dst_blocks`` (distinct ids of this side's blocks);
        ``mode`` ``"push"`` or ``"pull"``."""
        self._ep.start(_peer(peer), _xid(transfer_id), _blocks(dst_blocks, "destination"), _mode(mode))

    def wait_layer(self, transfer_id: int, layer: int, timeout: Optional[float] = DEFAULT_TIMEOUT) -> str:
        """Until ``layer`` is final: returns ``"loaded"``, ``"partial"`` or ``"failed"`` (``TimedOutError`` past
        ``timeout``)."""
        return self._ep.wait_layer(_xid(transfer_id), _layer(layer), _timeout(timeout))

    def wait_layer_on_stream(self, transfer_id: int, layer: int, stream: Any,
                             timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        """Endpoints with a ``device``: once the layer's copy into device memory is enqueued (a host wait up to
        ``timeout``), makes ``stream`` wait for it on the device. The copy's event also completes when the layer
        failed: check :meth:`status` before trusting (committing) its blocks."""
        if stream is None:
            raise InvalidArgumentError("wait_layer_on_stream needs the stream that is to wait")
        self._ep.wait_layer_on_stream(_xid(transfer_id), _layer(layer), self._stream(stream), _timeout(timeout))

    def status(self, transfer_id: int) -> DecodeStatus:
        return DecodeStatus(**self._ep.status(_xid(transfer_id)))

    def wait(self, transfer_id: int, timeout: Optional[float] = DEFAULT_TIMEOUT,
             reclaimable: bool = False) -> DecodeStatus:
        """Until every layer is final (and, with ``reclaimable``, the blocks may be reused)."""
        return DecodeStatus(**self._ep.wait(_xid(transfer_id), _timeout(timeout), _flag(reclaimable, "reclaimable")))

    def cancel(self, transfer_id: int) -> None:
        """Gives up on a transfer now (the engine dropped the request, or waited long enough): its layers not final
        fail, the prefill is told, stops and proves its writes over; ``wait(..., reclaimable=True)`` then returns
        once the blocks may be reused. Nothing changes on a final transfer."""
        self._ep.cancel(_xid(transfer_id))


# ---------------------------------------------------------------------------------------------- receives


@dataclass
class Receive:
    """A receive started by :meth:`Receiver.start`: the forward waits on ``task`` per layer
    (``TransferManager.wait_for_layer`` / ``wait_layer_host``) and runs in ``admission["device_blocks"]``;
    ``device_blocks[receive_begin : receive_begin + receive_blocks]`` are the blocks the peer writes."""

    transfer_id: int
    task: int
    admission: Dict[str, Any]


@dataclass
class ReceiveOutcome:
    """A receive that ended: ``loaded_blocks`` leading blocks verified and committed to the prefix index; without
    ``reclaimable`` the others are quarantined (the peer may still write them) until a later poll reclaims them."""

    transfer_id: int
    admission: int
    task: int
    receive_blocks: int
    loaded_blocks: int
    reclaimable: bool
    error: Optional[str]
    transfer: DecodeStatus


class Receiver:
    """A decode instance's prefill/decode receives through its ``CacheManager`` and ``TransferManager``
    (include/kvtier/pd/pd_receiver.h).

    ``decode`` is a :class:`Decode` endpoint over the same tensors as ``transfers`` (the same blocks; checked).
    The receiver moves the cache's plans itself (the evictions that free the receive blocks, the loads of a
    matched prefix) on ``transfers`` and applies their completions in :meth:`poll`, :meth:`finish` and
    :meth:`drain`: the engine takes no plans of that cache itself. Per prompt: ``start`` (the peer is told the
    blocks only after they are admitted and guarded), the forward's per-layer waits on ``Receive.task``, then
    ``poll`` / ``finish`` for the outcome, and ``cache.release(admission)`` at the request's end. The
    ``TransferManager`` cannot be closed while a receiver drives it (close the receiver first)."""

    def __init__(self, cache: Any, transfers: Any, decode: "Decode", *, poll_interval: float = 1e-4,
                 receive_timeout: float = 30.0, free_timeout: float = 10.0):
        if not isinstance(decode, Decode):
            raise InvalidArgumentError(f"Receiver needs a kvtier.pd.Decode endpoint, got {type(decode).__name__}")
        self._rx = _native.PdReceiver.create(cache, transfers, decode._ep,
                                             _seconds(poll_interval, "poll_interval"),
                                             _seconds(receive_timeout, "receive_timeout"),
                                             _seconds(free_timeout, "free_timeout"))
        _open_receivers.add(self)

    def start(self, peer: int, transfer_id: int, keys: Sequence[str], mode: str = "push", *,
              extra_blocks: int = 0, received_extra_blocks: int = 0, match_prefix: bool = False) -> Receive:
        """Admits the prompt's ``keys`` (32 hex digits each, chained as the cache's keys are), guards the blocks and
        starts transfer ``transfer_id`` from ``peer`` into them. ``match_prefix``: the cached prefix is served (and
        loaded) and only the keys after it are received (the peer must send only those)."""
        d = self._rx.start(_peer(peer), _rxid(transfer_id), _mode(mode), _keys(keys),
                           _count(extra_blocks, "extra_blocks"), _count(received_extra_blocks, "received_extra_blocks"),
                           _flag(match_prefix, "match_prefix"))
        return Receive(d["transfer_id"], d["task"], d["admission"])

    @staticmethod
    def _outcome(d: Dict[str, Any]) -> ReceiveOutcome:
        d = dict(d)
        d["transfer"] = DecodeStatus(**d["transfer"])
        return ReceiveOutcome(**d)

    def poll(self) -> List[ReceiveOutcome]:
        """The receives that ended since the last call (their blocks committed or released), in transfer id order."""
        return [self._outcome(d) for d in self._rx.poll()]

    def finish(self, transfer_id: int, timeout: Optional[float] = DEFAULT_TIMEOUT) -> ReceiveOutcome:
        """Until receive ``transfer_id`` ended (``TimedOutError`` past ``timeout``)."""
        return self._outcome(self._rx.finish(_rxid(transfer_id), _timeout(timeout)))

    def drain(self, timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        """Until no receive is open or quarantined."""
        self._rx.drain(_timeout(timeout))

    @property
    def active(self) -> int:
        return self._rx.active

    @property
    def quarantined(self) -> int:
        return self._rx.quarantined

    def stats(self) -> Dict[str, int]:
        return self._rx.stats()

    def close(self) -> None:
        """Stops the receiver (idempotent). Receives still open are cancelled (failed at the peer); their blocks
        return to the cache once the peer can no longer write them, waiting up to ``free_timeout``; a receive not
        provably quiet by then keeps its blocks guarded for good (fail closed)."""
        self._rx.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
