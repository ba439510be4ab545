"""Engine memory for the tests, per backend.

``host``: numpy arrays as the engine's "device" tensors on kvtier's host backend (CI).
``cuda``: torch CUDA tensors on the engine's current stream, host caches in pinned torch
tensors (where torch and a GPU are present; the GPU script runs this).
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import kvtier


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and kvtier.cuda_compiled() and kvtier.cuda_device_count() > 0
    except ImportError:
        return False


BACKENDS = ["host"] + (["cuda"] if _cuda_available() else [])


class Engine:
    """Allocates the engine's tensors for one backend and reads them back as numpy."""

    def __init__(self, backend: str):
        self.backend = backend
        if backend == "cuda":
            import torch

            self.torch = torch

    def device_tensor(self, shape, dtype="uint8", fill=None):
        if self.backend == "host":
            a = np.empty(shape, dtype=dtype)
            if fill is not None:
                a.fill(fill)
            return a
        t = self.torch.empty(shape, dtype=getattr(self.torch, dtype), device="cuda")
        if fill is not None:
            t.fill_(fill)
        return t

    def host_tensor(self, shape, dtype="uint8", fill=None):
        if self.backend == "host":
            return self.device_tensor(shape, dtype, fill)
        t = self.torch.empty(shape, dtype=getattr(self.torch, dtype), pin_memory=True)
        if fill is not None:
            t.fill_(fill)
        return t

    def ptr(self, t) -> int:
        return t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()

    def numpy(self, t) -> np.ndarray:
        """The tensor's bytes as a uint8 numpy array (last dimension in bytes)."""
        if isinstance(t, np.ndarray):
            return t.view(np.uint8)
        self.torch.cuda.synchronize()
        return t.view(self.torch.uint8).cpu().numpy()

    def randomize(self, t, rng: np.random.Generator):
        if isinstance(t, np.ndarray):
            b = t.view(np.uint8)
            b[...] = rng.integers(0, 256, size=b.shape, dtype=np.uint8)
        else:
            b = t.view(self.torch.uint8)
            b.copy_(self.torch.from_numpy(rng.integers(0, 256, size=tuple(b.shape), dtype=np.uint8)))

    def poison(self, t, blocks, byte: int = 0x5A):
        if isinstance(t, np.ndarray):
            t.view(np.uint8)[blocks] = byte
        else:
            t.view(self.torch.uint8)[blocks] = byte

    def sync(self):
        if self.backend == "cuda":
            self.torch.cuda.synchronize()


@pytest.fixture(params=BACKENDS)
def engine(request) -> Engine:
    return Engine(request.param)


def fd_config(num_layers: int, num_cpu_blocks: int, quant=None, block_size: int = 16):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(num_hidden_layers=num_layers),
        cache_config=types.SimpleNamespace(cache_dtype="bfloat16", num_cpu_blocks=num_cpu_blocks,
                                           block_size=block_size),
        quant_config=types.SimpleNamespace(kv_cache_quant_type=quant),
    )


def random_kv(layers: int, blocks: int, shape: tuple, seed: int) -> list:
    """kvtier.pd's KV form: one (key, value) pair of float16 tensors per layer, ``[blocks, *shape]``, random bytes
    (a function of the seed)."""
    rng = np.random.default_rng(seed)
    kv = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            t = np.empty((blocks,) + tuple(shape), dtype=np.float16)
            t.view(np.uint8)[...] = rng.integers(0, 256, size=t.view(np.uint8).shape, dtype=np.uint8)
            pair.append(t)
        kv.append(tuple(pair))
    return kv


def poisoned_kv(layers: int, blocks: int, shape: tuple, poison: int) -> list:
    """As random_kv, every byte ``poison``: a destination whose every written byte shows."""
    kv = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            t = np.empty((blocks,) + tuple(shape), dtype=np.float16)
            t.view(np.uint8)[...] = poison
            pair.append(t)
        kv.append(tuple(pair))
    return kv
