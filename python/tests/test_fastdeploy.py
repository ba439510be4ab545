"""kvtier.fastdeploy.CacheTransferManager: FastDeploy's interface, byte-exact, failures kept."""

from __future__ import annotations

import ast
import inspect
import logging
import os

import numpy as np
import pytest

import kvtier
from kvtier.fastdeploy import CacheTransferManager
from conftest import fd_config

SEED = os.path.join(os.path.dirname(__file__), "data", "fastdeploy_transfer_manager.py")
# What the drop-in adds to FastDeploy's public interface (documented in kvtier/fastdeploy.py).
EXTRAS = {"wait_for_layer", "wait_layer_host", "last_error", "transfer_manager", "close"}

LAYERS, DEV_BLOCKS, HOST_BLOCKS = 3, 10, 12
HEADS, TOKENS, DIM = 2, 16, 8  # 256 bytes of uint8 per (layer, role, block)


def seed_interface():
    """FastDeploy's public methods (with parameter names) and properties, from its source."""
    tree = ast.parse(open(SEED).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheTransferManager")
    methods, props, attrs = {}, set(), set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            if any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                props.add(node.name)
            else:
                methods[node.name] = [a.arg for a in node.args.args]
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            init_args = [a.arg for a in node.args.args]
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store) and not sub.attr.startswith("_"):
                    attrs.add(sub.attr)
    return methods, props, attrs, init_args


def make(engine, quant=None, mla=False, num_cpu_blocks=HOST_BLOCKS, layers=LAYERS):
    """A drop-in with the engine's tensors registered; returns (mgr, device map, host map)."""
    mgr = CacheTransferManager(fd_config(layers, num_cpu_blocks, quant), local_rank=0, device_id=0)
    roles = ["key_caches"] if mla else ["key_caches", "value_caches"]
    scale_roles = ["key_cache_scales", "value_cache_scales"] if quant == "block_wise_fp8" else []
    dev, host, host_ptrs = {}, {}, {}
    for layer in range(layers):
        for role in roles:
            name = f"{role}_{layer}_rank0.device0"
            dev[name] = engine.device_tensor((DEV_BLOCKS, HEADS, TOKENS, DIM), "uint8")
            host[name] = engine.host_tensor((max(num_cpu_blocks, 1), HEADS, TOKENS, DIM), "uint8", fill=0xEE)
        for role in scale_roles:
            name = f"{role}_{layer}_rank0.device0"
            dev[name] = engine.device_tensor((DEV_BLOCKS, HEADS, TOKENS), "float16")
            host[name] = engine.host_tensor((max(num_cpu_blocks, 1), HEADS, TOKENS), "float16", fill=0)
    rng = np.random.default_rng(7)
    for t in dev.values():
        engine.randomize(t, rng)
    host_ptrs = {k: engine.ptr(v) for k, v in host.items()}
    mgr.set_cache_kvs_map(dev)
    mgr.set_host_cache_kvs_map(host_ptrs)
    return mgr, dev, host


def test_public_interface_is_fastdeploys():
    methods, props, attrs, init_args = seed_interface()
    assert methods and props
    ours = {n: v for n, v in vars(CacheTransferManager).items() if not n.startswith("_")}
    our_props = {n for n, v in ours.items() if isinstance(v, property)}
    our_methods = {n: v for n, v in ours.items() if callable(v) and not isinstance(v, property)}
    assert our_props - EXTRAS == props
    assert set(our_methods) - EXTRAS == set(methods)
    assert (set(our_props) | set(our_methods)) - set(methods) - props == EXTRAS
    for name, args in methods.items():
        assert list(inspect.signature(our_methods[name]).parameters) == args, name
    assert list(inspect.signature(CacheTransferManager.__init__).parameters) == init_args
    mgr = CacheTransferManager(fd_config(2, 4))
    for a in attrs:
        assert hasattr(mgr, a), a


@pytest.mark.parametrize("quant,mla", [(None, False), ("block_wise_fp8", False), (None, True)])
def test_evict_then_load_is_byte_exact(engine, quant, mla):
    mgr, dev, host = make(engine, quant=quant, mla=mla)
    d_ids, h_ids = [1, 4, 5], [7, 0, 11]
    before = {k: engine.numpy(v)[d_ids].copy() for k, v in dev.items()}
    assert mgr.evict_to_host_async(d_ids, h_ids) is True
    mgr.sync_output_stream()
    assert mgr.last_error is None
    for k, v in host.items():
        np.testing.assert_array_equal(engine.numpy(v)[h_ids], before[k], err_msg=f"evicted {k}")
    # Poison the device blocks, load every layer (every role: scales too) back elsewhere.
    targets = [2, 9, 0]
    for v in dev.values():
        engine.poison(v, targets)
    seen = []
    assert mgr.load_layers_to_device_async(list(range(LAYERS)), h_ids, targets, on_layer_complete=seen.append)
    assert seen == list(range(LAYERS))
    for layer in range(LAYERS):
        assert mgr.wait_layer_host(layer, timeout=30.0), mgr.last_error
    mgr.sync_input_stream()
    for k, v in dev.items():
        np.testing.assert_array_equal(engine.numpy(v)[targets], before[k], err_msg=f"loaded {k}")
    stats = mgr.get_stats()
    assert stats["is_fp8"] == (quant == "block_wise_fp8")
    assert stats["kvtier"]["load"]["tasks_done"] == 1 and stats["kvtier"]["evict"]["tasks_done"] == 1
    assert stats["kvtier"]["is_mla"] == mla
    mgr.close()


def test_partial_layers_and_layer_event(engine):
    mgr, dev, host = make(engine)
    assert mgr.evict_to_host_async([3], [2])
    mgr.sync_output_stream()
    events = []
    assert mgr.load_layers_to_device_async([2, 0], [2], [6],
                                           on_layer_complete=lambda l: events.append(mgr.record_input_stream_event()))
    assert [e.layer for e in events] == [2, 0]
    for e in events:
        e.synchronize(timeout=30.0)
        assert e.done
    for layer in (0, 2):
        for role in ("key_caches", "value_caches"):
            name = f"{role}_{layer}_rank0.device0"
            np.testing.assert_array_equal(engine.numpy(dev[name])[6], engine.numpy(dev[name])[3])
    mgr.close()


def test_false_keeps_the_reason(engine, caplog):
    mgr, dev, host = make(engine)
    caplog.set_level(logging.ERROR, logger="kvtier.fastdeploy")
    assert mgr.evict_to_host_async([0, 1], [0]) is False
    assert "1 host blocks" in mgr.last_error or "2 device blocks" in mgr.last_error
    assert mgr.evict_to_host_async([DEV_BLOCKS + 3], [0]) is False
    assert str(DEV_BLOCKS + 3) in mgr.last_error
    assert mgr.load_layers_to_device_async([LAYERS + 4], [0], [0]) is False
    assert str(LAYERS + 4) in mgr.last_error
    assert mgr.load_layers_to_device_async([0], [0, 0], [1, 1]) is False
    assert "twice" in mgr.last_error
    # Logged once per distinct reason.
    n = len(caplog.records)
    assert mgr.load_layers_to_device_async([0], [0, 0], [1, 1]) is False
    assert len(caplog.records) == n
    # Nothing was moved, and it still works.
    assert mgr.evict_to_host_async([0], [0]) is True
    mgr.sync_output_stream()
    mgr.close()


def test_no_host_cache_returns_false(engine):
    mgr = CacheTransferManager(fd_config(2, 0))
    assert mgr.evict_to_host_async([0], [0]) is False
    assert "num_cpu_blocks" in mgr.last_error
    assert mgr.load_layers_to_device_async([0], [0], [0]) is False
    assert mgr.get_host_key_ptr(0) == 0


def test_registration_errors_name_the_bad_value(engine):
    # A tensor whose blocks are not contiguous (dim 0 is not the block index).
    mgr, dev, host = make(engine)
    name = "key_caches_1_rank0.device0"
    bad = engine.device_tensor((HEADS, DEV_BLOCKS, TOKENS, DIM), "uint8")
    dev2 = dict(dev)
    dev2[name] = bad.transpose(1, 0, 2, 3) if isinstance(bad, np.ndarray) else bad.transpose(0, 1)
    mgr.set_cache_kvs_map(dev2)
    assert mgr.evict_to_host_async([0], [0]) is False
    assert name in mgr.last_error and "contiguous" in mgr.last_error
    # A dtype kvtier does not move.
    dev3 = dict(dev)
    dev3["value_caches_2_rank0.device0"] = engine.device_tensor((DEV_BLOCKS, HEADS, TOKENS, DIM), "float64")
    mgr.set_cache_kvs_map(dev3)
    assert mgr.evict_to_host_async([0], [0]) is False
    assert "value_caches_2_rank0.device0" in mgr.last_error and "bits 64" in mgr.last_error
    # A missing layer.
    dev4 = {k: v for k, v in dev.items() if not k.startswith("key_caches_1_")}
    mgr.set_cache_kvs_map(dev4)
    assert mgr.evict_to_host_async([0], [0]) is False
    assert "key_caches_1_rank0.device0" in mgr.last_error
    mgr.close()
