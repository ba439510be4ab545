"""Drives a HiCache storage backend the way SGLang's HiCacheController does (managers/cache_controller.py,
0.5.23): backups of host pages in batches of STORAGE_BATCH_SIZE (zero-copy ``batch_set_v1`` when the
extra_config sets ``interface_v1``, else ``batch_set`` of flat pages), hit queries with ``batch_exists``
(the leading run of stored pages), prefetches into preallocated host pages (``batch_get_v1``, or
``batch_get`` into dummy flat pages then ``set_from_flat_data_page``), each batch stopping at the first
failed page, and the v2 multi-pool calls of the hybrid controller. Written for kvtier's tests; no SGLang
code is in it.

``HostPool`` stands in for SGLang's MHA host pool (pool_host/mha.py): a K/V buffer in numpy with the
layouts ``page_first`` (2, size, layers, heads, dim) and ``layer_first`` (2, layers, size, heads, dim),
and the calls a storage backend makes on it (``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

STORAGE_BATCH_SIZE = 128  # SGLang's pages per storage call


class HostPool:
    def __init__(self, pages: int, page_size: int = 4, layers: int = 2, heads: int = 2, dim: int = 8,
                 layout: str = "page_first", dtype=np.float16, seed: int = 0):
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layers, heads, dim
        self.size = pages * page_size
        self.layout, self.dtype = layout, np.dtype(dtype)
        shape = (2, self.size, layers, heads, dim) if layout == "page_first" else (2, layers, self.size, heads, dim)
        self.kv_buffer = np.zeros(shape, self.dtype)
        self.rng = np.random.default_rng(seed)

    def fill_random(self, page: int) -> None:
        """New random bytes in one page (K and V, every layer)."""
        tok = slice(page * self.page_size, (page + 1) * self.page_size)
        view = self.kv_buffer[:, tok] if self.layout == "page_first" else self.kv_buffer[:, :, tok]
        view.view(np.uint8)[...] = self.rng.integers(0, 256, view.view(np.uint8).shape, dtype=np.uint8)

    def page_bytes(self, page: int) -> bytes:
        tok = slice(page * self.page_size, (page + 1) * self.page_size)
        view = self.kv_buffer[:, tok] if self.layout == "page_first" else self.kv_buffer[:, :, tok]
        return np.ascontiguousarray(view).tobytes()

    def clear(self, byte: int = 0xEE) -> None:
        self.kv_buffer.view(np.uint8)[...] = byte

    def indices(self, pages: List[int]) -> np.ndarray:
        """Host token indices of whole pages (as SGLang's host_indices)."""
        return np.concatenate([np.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]).astype(
            np.int64) if pages else np.zeros(0, np.int64)

    # --- what a storage backend calls
    def get_page_buffer_meta(self, indices):
        idx = [int(i) for i in indices]
        assert len(idx) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.ctypes.data
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        if self.layout == "page_first":
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
            size = self.layer_num * self.page_size * self.head_num * self.head_dim * item
        else:
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + (idx[i] + layer * self.size) * self.head_num * self.head_dim * item
                    ptrs += [k, k + v_offset]
            size = self.page_size * self.head_num * self.head_dim * item
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index, flat: bool = True):
        tok = slice(int(index), int(index) + self.page_size)
        page = self.kv_buffer[:, tok] if self.layout == "page_first" else self.kv_buffer[:, :, tok]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return np.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, self.dtype)

    def set_from_flat_data_page(self, index, data_page) -> None:
        tok = slice(int(index), int(index) + self.page_size)
        if self.layout == "page_first":
            self.kv_buffer[:, tok] = data_page.reshape(2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, :, tok] = data_page.reshape(2, self.layer_num, self.page_size, self.head_num,
                                                         self.head_dim)


class Controller:
    """The storage side of SGLang's HiCacheController over one backend and one host pool."""

    def __init__(self, backend, pool: HostPool, zero_copy: bool, extra_info_cls=None):
        self.backend, self.pool, self.zero_copy = backend, pool, zero_copy
        self.extra_info_cls = extra_info_cls
        backend.register_mem_pool_host(pool)
        if hasattr(backend, "on_host_pools_registered"):
            backend.on_host_pools_registered()

    def _extra(self, prefix):
        return self.extra_info_cls(prefix_keys=prefix) if self.extra_info_cls else None

    def backup(self, hashes: List[str], pages: List[int]) -> int:
        """Writes pages; returns how many were stored before the first failed batch."""
        ps, done, prefix = self.pool.page_size, 0, []
        host = self.pool.indices(pages)
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host[i * ps:(i + len(batch)) * ps]
            if self.zero_copy:
                ok = all(self.backend.batch_set_v1(batch, idx, self._extra(prefix)))
            else:
                data = [self.pool.get_data_page(idx[j * ps]) for j in range(len(batch))]
                ok = self.backend.batch_set(batch, data)
            if not ok:
                break
            prefix = prefix + batch
            done += len(batch)
        return done

    def query(self, hashes: List[str]) -> int:
        """The stored prefix, in pages (batch_exists per batch, stopping at the first short batch)."""
        hit, prefix = 0, []
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            n = self.backend.batch_exists(batch, self._extra(prefix))
            hit += n
            if n < len(batch):
                break
            prefix = prefix + batch
        return hit

    def prefetch(self, hashes: List[str], pages: List[int]) -> int:
        """Reads pages into the host pool; returns the pages loaded before the first failure."""
        ps, done, prefix = self.pool.page_size, 0, []
        host = self.pool.indices(pages)
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host[i * ps:(i + len(batch)) * ps]
            got = 0
            if self.zero_copy:
                results = self.backend.batch_get_v1(batch, idx, self._extra(prefix))
                for r in results:
                    if not r:
                        break
                    got += 1
            else:
                dst = [self.pool.get_dummy_flat_data_page() for _ in batch]
                data: Optional[list] = self.backend.batch_get(batch, dst)
                for j in range(len(batch)):
                    if data is None or data[j] is None:
                        break
                    self.pool.set_from_flat_data_page(idx[j * ps], data[j])
                    got += 1
            done += got
            if got < len(batch):
                break
            prefix = prefix + batch
        return done


class FlatHostPool(HostPool):
    """A pool without buffer metadata (as some sidecar pools): backends fall back to flat pages."""

    @property
    def get_page_buffer_meta(self):
        raise AttributeError("no buffer metadata")
