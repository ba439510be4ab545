"""kvtier.fastdeploy.CacheTransferManager: FastDeploy's interface, byte-exact, failures kept."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import types

import numpy as np
import pytest

import kvtier
import kvtier.fastdeploy
from kvtier.fastdeploy import CacheTransferManager, PdTransferConnector
from conftest import fd_config

# FastDeploy's public interface, written down as a table (names, parameters, return types).
INTERFACE = os.path.join(os.path.dirname(__file__), "data", "fastdeploy_interface.json")
# What the drop-in adds to FastDeploy's public interface (documented in kvtier/fastdeploy.py).
EXTRAS = {"wait_for_layer", "wait_layer_host", "last_error", "transfer_manager", "transfer_connector", "close"}

LAYERS, DEV_BLOCKS, HOST_BLOCKS = 3, 10, 12
HEADS, TOKENS, DIM = 2, 16, 8  # 256 bytes of uint8 per (layer, role, block)


def fastdeploy_interface():
    """FastDeploy's public methods, properties, attributes and constructor, from the interface table."""
    with open(INTERFACE) as f:
        table = json.load(f)
    assert table["class"] == "CacheTransferManager"
    return table


def annotation_text(annotation):
    """An annotation as written in source (``from __future__ import annotations`` keeps them as strings)."""
    if annotation is inspect.Signature.empty:
        return None
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def make(engine, quant=None, mla=False, num_cpu_blocks=HOST_BLOCKS, layers=LAYERS, dtype="uint8"):
    """A drop-in with the engine's tensors registered; returns (mgr, device map, host map)."""
    mgr = CacheTransferManager(fd_config(layers, num_cpu_blocks, quant), local_rank=0, device_id=0)
    roles = ["key_caches"] if mla else ["key_caches", "value_caches"]
    scale_roles = ["key_cache_scales", "value_cache_scales"] if quant == "block_wise_fp8" else []
    dev, host, host_ptrs = {}, {}, {}
    for layer in range(layers):
        for role in roles:
            name = f"{role}_{layer}_rank0.device0"
            dev[name] = engine.device_tensor((DEV_BLOCKS, HEADS, TOKENS, DIM), dtype)
            host[name] = engine.host_tensor((max(num_cpu_blocks, 1), HEADS, TOKENS, DIM), dtype)
            engine.poison(host[name], slice(None), 0xEE)
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
    table = fastdeploy_interface()
    methods, props = table["methods"], table["properties"]
    assert methods and props
    ours = {n: v for n, v in vars(CacheTransferManager).items() if not n.startswith("_")}
    our_props = {n: v for n, v in ours.items() if isinstance(v, property)}
    our_methods = {n: v for n, v in ours.items() if callable(v) and not isinstance(v, property)}
    assert set(our_props) - EXTRAS == set(props)
    assert set(our_methods) - EXTRAS == set(methods)
    assert (set(our_props) | set(our_methods)) - set(methods) - set(props) == EXTRAS
    for name, spec in methods.items():
        sig = inspect.signature(our_methods[name])
        assert list(sig.parameters) == spec["params"], name
        assert annotation_text(sig.return_annotation) == spec["returns"], name
    for name, type_text in props.items():
        assert annotation_text(inspect.signature(our_props[name].fget).return_annotation) == type_text, name
    init = inspect.signature(CacheTransferManager.__init__)
    assert list(init.parameters) == table["init"]["params"]
    for arg, default in table["init"]["defaults"].items():
        assert init.parameters[arg].default == default, arg
    mgr = CacheTransferManager(fd_config(2, 4))
    for a in table["attributes"]:
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


# kvtier moves bytes: every fixed-width element type is accepted (numpy code holds bf16 as uint16).
NUMPY_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
                "float64", "bool", "complex64", "complex128"]
# Types numpy lacks, where the engine (torch) has them.
TORCH_ONLY_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + TORCH_ONLY_DTYPES)
def test_every_fixed_width_dtype_is_moved_byte_exact(engine, dtype):
    if dtype in TORCH_ONLY_DTYPES:
        if engine.backend != "cuda":
            pytest.skip(f"numpy has no {dtype}")
        if not hasattr(engine.torch, dtype):
            pytest.skip(f"this torch has no {dtype}")
    if engine.backend == "cuda" and not hasattr(engine.torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    mgr, dev, host = make(engine, dtype=dtype)
    d_ids, h_ids, targets = [0, 6, 9], [11, 3, 5], [4, 1, 7]
    before = {k: engine.numpy(v)[d_ids].copy() for k, v in dev.items()}
    assert mgr.evict_to_host_async(d_ids, h_ids) is True, mgr.last_error
    mgr.sync_output_stream()
    assert mgr.last_error is None
    for k, v in host.items():
        np.testing.assert_array_equal(engine.numpy(v)[h_ids], before[k], err_msg=f"{dtype}: evicted {k}")
    for v in dev.values():
        engine.poison(v, targets)
    assert mgr.load_layers_to_device_async(list(range(LAYERS)), h_ids, targets), mgr.last_error
    mgr.sync_input_stream()
    assert mgr.last_error is None
    for k, v in dev.items():
        np.testing.assert_array_equal(engine.numpy(v)[targets], before[k], err_msg=f"{dtype}: loaded {k}")
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


def test_a_layer_event_from_before_set_cache_kvs_map_is_stale_not_another_load(engine):
    """set_cache_kvs_map() replaces the native manager, whose task ids start again: an event kept across it was
    answered by the new manager's task of the same id (a different load; query() raised a bare ValueError)."""
    mgr, dev, host = make(engine)
    assert mgr.evict_to_host_async([3], [2])
    mgr.sync_output_stream()
    events = []
    assert mgr.load_layers_to_device_async([0, 1, 2], [2], [6],
                                           on_layer_complete=lambda l: events.append(mgr.record_input_stream_event()))
    old = events[2]
    old.synchronize(timeout=30.0)
    mgr.set_cache_kvs_map(dev)
    assert mgr.load_layers_to_device_async([0], [2], [7])  # the new manager's first task, the same id as old's
    for call in (old.query, lambda: old.synchronize(1.0), lambda: old.wait()):
        with pytest.raises(kvtier.FailedPreconditionError, match="stale"):
            call()
    mgr.close()


def test_a_read_only_device_tensor_is_refused_by_name():
    """A read-only array in the map raised nanobind's TypeError out of evict_to_host_async (whose contract is
    False and last_error), naming neither the tensor nor why."""
    from conftest import Engine
    mgr, dev, host = make(Engine("host"))
    dev["key_caches_1_rank0.device0"].setflags(write=False)
    assert mgr.evict_to_host_async([1], [3]) is False
    assert "key_caches_1_rank0.device0" in mgr.last_error and "read-only" in mgr.last_error
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
    # Ids that are not integers were truncated (1.9 -> block 1, "1" -> block 1) and the copy went ahead.
    for bad in (1.9, "1", True):
        assert mgr.evict_to_host_async([bad], [5]) is False
        assert repr(bad) in mgr.last_error
    assert mgr.load_layers_to_device_async([0.7], [5], [2]) is False
    assert "layer index 0.7" in mgr.last_error
    assert mgr.evict_to_host_async([np.int64(1)], [np.int32(5)]) is True  # numpy integers are integers
    assert mgr.wait_layer_host(LAYERS + 7) is False  # no such layer: not "loaded"
    assert str(LAYERS + 7) in mgr.last_error
    mgr.sync_output_stream()
    # Nothing was moved, and it still works.
    assert mgr.evict_to_host_async([0], [0]) is True
    mgr.sync_output_stream()
    mgr.close()


def _host_engine_with_failure_injection(engine):
    if engine.backend != "host":
        pytest.skip("failure injection is the host backend's")
    mgr, dev, host = make(engine)
    mgr.transfer_manager  # the native manager exists: its device takes the injection
    return mgr, dev, host


def test_a_failed_load_stays_failed_after_sync_input_stream(engine):
    # sync_input_stream() forgot the layer's loads: the per-layer waits then said "loaded" for a layer whose
    # copy had failed, and the forward read bytes that never arrived.
    mgr, dev, host = _host_engine_with_failure_injection(engine)
    assert mgr.evict_to_host_async([1], [3]) is True
    mgr.sync_output_stream()
    mgr._device.fail_nth_operation(1)  # the next copy fails
    assert mgr.load_layers_to_device_async([0, 1, 2], [3], [5]) is True
    assert mgr.wait_layer_host(0, 5.0) is False
    mgr.sync_input_stream()
    assert "injected failure" in mgr.last_error
    for _ in range(2):
        assert mgr.wait_layer_host(0, 5.0) is False
        with pytest.raises(kvtier.DataLossError, match="injected failure"):
            mgr.wait_for_layer(0)
    mgr.close()


def test_a_failed_load_is_not_hidden_by_a_later_load_of_the_same_layer(engine):
    # Only the latest load of a layer was waited for: an earlier, failed one's blocks were reported loaded.
    mgr, dev, host = _host_engine_with_failure_injection(engine)
    assert mgr.evict_to_host_async([1], [3]) is True
    mgr.sync_output_stream()
    mgr._device.fail_nth_operation(1)  # this eviction fails: host block 4 holds bytes of a failed copy
    assert mgr.evict_to_host_async([2], [4]) is True
    mgr.sync_output_stream()
    assert mgr.load_layers_to_device_async([0, 1, 2], [4], [5]) is True  # fails: its source is bad
    assert mgr.load_layers_to_device_async([0, 1, 2], [3], [6]) is True  # succeeds
    assert mgr.wait_layer_host(0, 5.0) is False
    assert "holds bytes of failed task" in mgr.last_error
    with pytest.raises(kvtier.DataLossError):
        mgr.wait_for_layer(0)
    mgr.sync_input_stream()
    assert mgr.wait_layer_host(0, 5.0) is False  # still, after the sync
    # The next step's first load starts afresh: its layers are good again, and its bytes are the source's.
    assert mgr.load_layers_to_device_async([0, 1, 2], [3], [7]) is True
    assert mgr.wait_layer_host(0, 5.0) is True
    mgr.wait_for_layer(0)
    mgr.sync_input_stream()
    key = "key_caches_0_rank0.device0"
    np.testing.assert_array_equal(engine.numpy(dev[key])[7], engine.numpy(dev[key])[1])
    mgr.close()


def test_a_failed_eviction_forgotten_by_a_later_submission_still_refuses_its_block_after_registering_again(engine):
    """Ended transfers are forgotten at each submission: a failed eviction so forgotten before the maps are registered
    again must still leave its host block refused to loads by the new native manager."""
    mgr, dev, host = _host_engine_with_failure_injection(engine)
    assert mgr.evict_to_host_async([0], [0]) is True
    mgr.sync_output_stream()
    mgr._device.fail_nth_operation(1)
    assert mgr.evict_to_host_async([1], [2]) is True  # fails: host block 2's bytes are undefined
    mgr.sync_output_stream()
    assert mgr.load_layers_to_device_async([0, 1, 2], [0], [5]) is True  # a submission: forgets the ended ones
    assert not mgr._evicts and not mgr._evict_hosts
    mgr.set_cache_kvs_map(dev)  # the same tensors, registered again
    assert mgr.load_layers_to_device_async([0, 1, 2], [2], [6]) is False
    assert "host block 2 holds undefined bytes" in mgr.last_error
    assert mgr.load_layers_to_device_async([0, 1, 2], [0], [6]) is True
    assert mgr.wait_layer_host(0, 5.0) is True
    mgr.close()


def test_failures_in_flight_survive_registering_the_maps_again(engine):
    """set_cache_kvs_map() closed the native manager, which drained the transfers and dropped their errors: a
    failed eviction's host block then loaded as good (wrong bytes, last_error None), and a failed load's layer
    waited as loaded. Both now stay failed, with the reason in last_error."""
    mgr, dev, host = _host_engine_with_failure_injection(engine)
    assert mgr.evict_to_host_async([0], [0]) is True
    mgr.sync_output_stream()
    mgr._device.fail_nth_operation(1)  # this eviction fails: host block 2's bytes are undefined
    assert mgr.evict_to_host_async([1], [2]) is True
    mgr.set_cache_kvs_map(dev)  # the same tensors, registered again
    assert "eviction task" in mgr.last_error and "injected failure" in mgr.last_error
    assert mgr.load_layers_to_device_async([0, 1, 2], [2], [6]) is False
    assert "host block 2 holds undefined bytes" in mgr.last_error
    assert mgr.load_layers_to_device_async([0, 1, 2], [0], [6]) is True  # other host blocks load as before
    assert mgr.wait_layer_host(2, 5.0) is True
    # A load that fails, then the maps registered again: its layer keeps failing.
    assert mgr.evict_to_host_async([1], [2]) is True  # rewritten: host block 2 is good again
    mgr.sync_output_stream()
    mgr.sync_input_stream()
    mgr._device.fail_nth_operation(1)
    assert mgr.load_layers_to_device_async([0, 1, 2], [2], [7]) is True
    mgr.set_cache_kvs_map(dev)
    assert mgr.wait_layer_host(0, 5.0) is False and "injected failure" in mgr.last_error
    with pytest.raises(kvtier.DataLossError):
        mgr.wait_for_layer(0)
    mgr.close()
    # After close() a wait never says "loaded".
    assert mgr.wait_layer_host(1, 5.0) is False and "closed" in mgr.last_error
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        mgr.wait_for_layer(1)


def test_an_empty_layer_list_loads_nothing(engine):
    """load_layers_to_device_async([], ...) loaded every layer (the native manager takes [] as all of them) and
    called on_layer_complete for each; FastDeploy's loop over the layers copies nothing."""
    mgr, dev, host = make(engine)
    assert mgr.evict_to_host_async([3], [2]) is True
    mgr.sync_output_stream()
    before = {k: engine.numpy(v)[6].copy() for k, v in dev.items()}
    seen = []
    assert mgr.load_layers_to_device_async([], [2], [6], on_layer_complete=seen.append) is True
    mgr.sync_input_stream()
    assert seen == []
    for k, v in dev.items():
        np.testing.assert_array_equal(engine.numpy(v)[6], before[k])
    mgr.close()


def test_layer_and_id_arguments_of_the_wrong_kind_are_named(engine):
    mgr, dev, host = make(engine)
    mgr.transfer_manager  # created: it knows the model's layers
    assert mgr.evict_to_host_async(None, None) is False
    assert "None" in mgr.last_error
    assert mgr.load_layers_to_device_async(None, [0], [1]) is False
    assert "None" in mgr.last_error
    for bad in (None, "1", 1.5, True):
        assert mgr.wait_layer_host(bad) is False  # 1.5 was "loaded"
        assert repr(bad) in mgr.last_error
        with pytest.raises(kvtier.InvalidArgumentError, match=re.escape(repr(bad))):
            mgr.wait_for_layer(bad)
    with pytest.raises(kvtier.InvalidArgumentError, match="layers 0..2, not 99"):
        mgr.wait_for_layer(99)  # returned silently
    # A set's order paired device and host blocks arbitrarily; a bad timeout raised instead of returning False.
    assert mgr.evict_to_host_async({8, 1}, {2, 9}) is False and "set, not an ordered list" in mgr.last_error
    assert mgr.evict_to_host_async({3: 4}, [5]) is False and "dict" in mgr.last_error
    for bad in (float("nan"), "1"):
        assert mgr.wait_layer_host(0, bad) is False and repr(bad) in mgr.last_error
    mgr.close()


def test_close_is_final(engine):
    # A transfer after close() used to build a new native manager over the engine's memory behind the caller's back.
    mgr, dev, host = make(engine)
    assert mgr.evict_to_host_async([0], [0]) is True
    mgr.sync_output_stream()
    mgr.close()
    assert mgr.transfer_manager is None
    assert mgr.evict_to_host_async([1], [1]) is False
    assert "closed" in mgr.last_error
    assert mgr.load_layers_to_device_async([0], [0], [2]) is False
    assert "closed" in mgr.last_error
    assert mgr.transfer_manager is None
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        mgr.set_cache_kvs_map(dev)
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        mgr.set_host_cache_kvs_map({k: engine.ptr(v) for k, v in host.items()})
    mgr.close()  # idempotent


def test_a_bad_host_address_is_named(engine):
    """The host map holds addresses: a negative or too large one was reported as a device tensor nanobind could not
    take (with nanobind's signature), and a string escaped evict_to_host_async as a bare ValueError."""
    name = "value_caches_1_rank0.device0"
    mgr, dev, host = make(engine)
    ptrs = {k: engine.ptr(v) for k, v in host.items()}
    mgr.set_host_cache_kvs_map({**ptrs, "key_caches_9_rank0.device0": None})  # None, like 0: no such host tensor
    assert mgr.evict_to_host_async([1], [1]) is True, mgr.last_error
    mgr.sync_output_stream()
    mgr.close()
    for bad in (-4096, 1 << 64, "0x7f00", 1.5, True):
        mgr, dev, host = make(engine)
        ptrs = {k: engine.ptr(v) for k, v in host.items()}
        ptrs[name] = bad
        mgr.set_host_cache_kvs_map(ptrs)
        assert mgr.evict_to_host_async([1], [1]) is False
        assert f"host_cache_kvs_map[{name!r}] = {bad!r} is not a host address" in mgr.last_error, mgr.last_error
        mgr.close()


def test_a_device_block_outside_the_cache_is_named_in_a_load(engine):
    """It was reported as "index 0 of record_device_access", a call of the drop-in the engine never made."""
    mgr, dev, host = make(engine)
    assert mgr.load_layers_to_device_async([0], [0, 1], [2, DEV_BLOCKS]) is False
    assert f"device_block_ids[1] = {DEV_BLOCKS} is outside [0, {DEV_BLOCKS})" in mgr.last_error, mgr.last_error
    assert mgr.load_layers_to_device_async([0], [0], [-1]) is False
    assert "device_block_ids[0] = -1 is outside" in mgr.last_error, mgr.last_error
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
    # A missing layer.
    dev4 = {k: v for k, v in dev.items() if not k.startswith("key_caches_1_")}
    mgr.set_cache_kvs_map(dev4)
    assert mgr.evict_to_host_async([0], [0]) is False
    assert "key_caches_1_rank0.device0" in mgr.last_error
    mgr.close()


# ---------------------------------------------------------------- the transfer connector (P/D)


def pd_instance(engine, role, fill=None):
    """A drop-in of a prefill or decode instance (``splitwise_role``) with its device KV registered."""
    cfg = fd_config(LAYERS, HOST_BLOCKS)
    cfg.scheduler_config = types.SimpleNamespace(splitwise_role=role)  # where FastDeploy keeps it
    mgr = CacheTransferManager(cfg)
    assert isinstance(mgr.transfer_connector, PdTransferConnector) and mgr.transfer_connector.role == role
    dev = {}
    for layer in range(LAYERS):
        for r in ("key_caches", "value_caches"):
            dev[f"{r}_{layer}_rank0.device0"] = engine.device_tensor((DEV_BLOCKS, HEADS, TOKENS, DIM), "uint8", fill)
    mgr.set_cache_kvs_map(dev)
    return mgr, dev


def test_connectors_are_the_ones_fastdeploy_creates():
    table = fastdeploy_interface()
    assert "create_transfer_connector" in table["connectors"]
    # FastDeploy calls it with the cache config alone; the drop-in adds the role as a keyword.
    params = list(inspect.signature(kvtier.fastdeploy.create_transfer_connector).parameters.values())
    assert params[0].name == "cache_config"
    assert all(p.default is not inspect.Parameter.empty for p in params[1:])


def test_no_transfer_connector_without_pd(monkeypatch):
    monkeypatch.delenv("KVTIER_FASTDEPLOY_PD_ROLE", raising=False)
    assert CacheTransferManager(fd_config(2, 4)).transfer_connector is None
    cfg = fd_config(2, 4)
    cfg.scheduler_config = types.SimpleNamespace(splitwise_role="mixed")
    assert CacheTransferManager(cfg).transfer_connector is None
    cfg.scheduler_config.splitwise_role = "sideways"
    with pytest.raises(kvtier.InvalidArgumentError, match="'sideways'"):
        CacheTransferManager(cfg)
    # The environment overrides the config.
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_ROLE", "decode")
    assert CacheTransferManager(cfg).transfer_connector.role == "decode"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_transfer_connector_moves_kv_between_instances(engine, monkeypatch, mode):
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_TRANSPORT", "loopback")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_SECRET", "ab" * 32)
    monkeypatch.delenv("KVTIER_FASTDEPLOY_PD_ROLE", raising=False)
    pre, pre_dev = pd_instance(engine, "prefill")
    dec, dec_dev = pd_instance(engine, "decode", fill=0xEE)
    rng = np.random.default_rng(3)
    for t in pre_dev.values():
        engine.randomize(t, rng)
    engine.sync()
    p, d = pre.transfer_connector, dec.transfer_connector
    to_decode, to_prefill = p.add_peer(d.metadata()), d.add_peer(p.metadata())
    src, dst = [1, 5, 2], [7, 0, 9]
    d.start(to_prefill, 31, dst, mode=mode)  # FastDeploy's recv_async
    p.begin(to_decode, 31, src)  # send_async: begin, then every layer as the forward writes it
    for layer in range(LAYERS):
        p.layer_ready(31, layer)
    with pytest.raises(kvtier.InvalidArgumentError, match="timeout '5' is a str"):
        d.wait(31, "5")  # was a bare TypeError from comparing the string with 0
    st = d.wait(31, timeout=30.0)  # FastDeploy's wait(handle, timeout)
    assert st.error is None and st.leading_loaded_blocks == 3, st
    assert p.wait(31).done
    engine.sync()
    untouched = [b for b in range(DEV_BLOCKS) if b not in dst]
    for name, t in dec_dev.items():
        np.testing.assert_array_equal(engine.numpy(t)[dst], engine.numpy(pre_dev[name])[src], err_msg=name)
        assert (engine.numpy(t)[untouched] == 0xEE).all(), name
    with pytest.raises(kvtier.FailedPreconditionError, match="decode connector"):
        d.begin(to_prefill, 32, [0])
    pre.close()
    dec.close()
    with pytest.raises(kvtier.FailedPreconditionError, match="set_cache_kvs_map"):
        d.metadata()


def test_loads_on_cuda_default_to_the_copy_kernel_unless_the_environment_says_otherwise():
    defaults = kvtier.fastdeploy._engine_defaults
    cuda = types.SimpleNamespace(backend="cuda")
    assert defaults(cuda, {}) == {"transfer.load_strategy": "sm_kernel"}
    assert defaults(cuda, {"KVTIER_TRANSFER_LOAD_STRATEGY": "dma_batch"}) == {}
    assert defaults(kvtier.host_device(), {}) == {}
    assert defaults(None, {}) == {}


def test_environment_knobs_are_config_table_knobs(monkeypatch):
    """The KVTIER_FASTDEPLOY_* and KVTIER_METRICS variables are knobs of kvtier's config table: read through it
    with the defaults the drop-in always had, and a bad value rejected with a message naming it."""
    for var in ("BACKEND", "FENCE_EVICTIONS", "SYNC_TIMEOUT", "PD_ROLE", "PD_SECRET", "PD_TRANSPORT", "PD_TLS",
                "PD_NET_DEVICES"):
        monkeypatch.delenv("KVTIER_FASTDEPLOY_" + var, raising=False)
    monkeypatch.delenv("KVTIER_METRICS", raising=False)
    knobs = kvtier._native.integration_config()
    assert knobs == {
        "fastdeploy.backend": "auto", "fastdeploy.fence_evictions": True, "fastdeploy.sync_timeout": 300.0,
        "fastdeploy.pd_role": "", "fastdeploy.pd_secret": "", "fastdeploy.pd_transport": "ipc",
        "fastdeploy.pd_tls": "auto", "fastdeploy.pd_net_devices": "", "metrics": True}
    mgr = CacheTransferManager(fd_config(2, 4))
    assert mgr._fence_evictions is True and mgr._sync_timeout == 300.0
    monkeypatch.setenv("KVTIER_FASTDEPLOY_FENCE_EVICTIONS", "0")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_SYNC_TIMEOUT", "2.5")
    mgr = CacheTransferManager(fd_config(2, 4))
    assert mgr._fence_evictions is False and mgr._sync_timeout == 2.5
    monkeypatch.setenv("KVTIER_METRICS", "0")
    assert kvtier._native.integration_config()["metrics"] is False

    monkeypatch.setenv("KVTIER_FASTDEPLOY_SYNC_TIMEOUT", "soon")
    with pytest.raises(kvtier.InvalidArgumentError, match="KVTIER_FASTDEPLOY_SYNC_TIMEOUT.*'soon'"):
        CacheTransferManager(fd_config(2, 4))
    monkeypatch.delenv("KVTIER_FASTDEPLOY_SYNC_TIMEOUT")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_BACKEND", "gpu")
    with pytest.raises(kvtier.InvalidArgumentError, match="'gpu' is not one of auto, host, cuda"):
        CacheTransferManager(fd_config(2, 4))
    monkeypatch.delenv("KVTIER_FASTDEPLOY_BACKEND")
    monkeypatch.setenv("KVTIER_METRICS", "maybe")
    with pytest.raises(kvtier.InvalidArgumentError, match="KVTIER_METRICS.*'maybe'"):
        kvtier._native.integration_config()
    monkeypatch.delenv("KVTIER_METRICS")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_ROLE", "decode")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_TRANSPORT", "carrier-pigeon")
    with pytest.raises(kvtier.InvalidArgumentError, match="'carrier-pigeon'"):
        kvtier.fastdeploy.create_transfer_connector(types.SimpleNamespace())
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_TRANSPORT", "loopback")
    monkeypatch.setenv("KVTIER_FASTDEPLOY_PD_SECRET", "not-hex-secret")
    with pytest.raises(kvtier.InvalidArgumentError, match="KVTIER_FASTDEPLOY_PD_SECRET.*not hex") as err:
        kvtier.fastdeploy.create_transfer_connector(types.SimpleNamespace())
    assert "not-hex-secret" not in str(err.value)  # a secret is never echoed


def test_kvtier_info_lists_the_integration_knobs():
    import subprocess
    cli = os.path.join(os.path.dirname(kvtier.__file__), "bin", "kvtier")
    if not os.path.exists(cli):
        pytest.skip("this installation carries no kvtier CLI")
    out = subprocess.run([cli, "info", "--config"], check=True, capture_output=True, text=True).stdout
    for var in ("KVTIER_FASTDEPLOY_BACKEND", "KVTIER_FASTDEPLOY_FENCE_EVICTIONS", "KVTIER_FASTDEPLOY_SYNC_TIMEOUT",
                "KVTIER_FASTDEPLOY_PD_ROLE", "KVTIER_FASTDEPLOY_PD_SECRET", "KVTIER_FASTDEPLOY_PD_TRANSPORT",
                "KVTIER_FASTDEPLOY_PD_TLS", "KVTIER_FASTDEPLOY_PD_NET_DEVICES", "`KVTIER_METRICS`"):
        assert var in out


def test_an_engine_that_never_syncs_keeps_no_tasks_and_no_false_failures(engine, caplog):
    """An engine whose forward waits per layer (wait_for_layer on the GPU, or wait_layer_host) and never calls
    sync_input_stream / sync_output_stream: the drop-in kept every task, each wait walked all of them, and once the
    native manager had forgotten the oldest (retained_finished_tasks) a wait raised DataLossError for a load that had
    succeeded; evictions' host lists grew without bound even with syncs. Ended tasks are forgotten at each submission
    now, their outcome recorded as a wait would."""
    mgr, dev, host = make(engine)
    caplog.set_level(logging.ERROR, logger="kvtier")
    assert mgr.evict_to_host_async([0], [0])
    mgr.sync_output_stream()
    steps = 4200 if engine.backend == "host" else 600
    for i in range(steps):
        assert mgr.load_layers_to_device_async(list(range(LAYERS)), [0], [1]), mgr.last_error
        for layer in range(LAYERS):
            if i % 2:
                mgr.wait_for_layer(layer)
            else:
                assert mgr.wait_layer_host(layer, 10.0), mgr.last_error
        if i % 3 == 0:
            assert mgr.evict_to_host_async([2], [1 + i % (HOST_BLOCKS - 1)]), mgr.last_error
        assert len(mgr._loads) <= 2 and len(mgr._evicts) <= 2, (i, len(mgr._loads), len(mgr._evicts))
        assert len(mgr._evict_hosts) <= 2 and sum(map(len, mgr._layer_tasks.values())) <= 2 * LAYERS
    mgr.sync_output_stream()
    mgr.sync_input_stream()
    engine.sync()
    assert not mgr._evict_hosts
    for name in dev:
        assert engine.numpy(dev[name])[1].tobytes() == engine.numpy(host[name])[0].tobytes()
    mgr.close()
    assert not [r for r in caplog.records if "NotFound" in r.getMessage()], caplog.text[-2000:]


@pytest.mark.parametrize("value, named", [("8", "'8' (str)"), (8.0, "8.0 (float)"), (-1, "-1"), (True, "True")])
def test_a_host_block_count_of_the_wrong_type_is_refused_naming_it(value, named):
    """num_cpu_blocks read from a config file as "8" was taken: evictions then raised a bare TypeError ('<=' between
    str and int), and -1 was reported as "num_cpu_blocks is 0"."""
    with pytest.raises(kvtier.InvalidArgumentError, match=re.escape(f"cache_config.num_cpu_blocks is {named}")):
        CacheTransferManager(fd_config(LAYERS, value), local_rank=0, device_id=0)
    assert CacheTransferManager(fd_config(LAYERS, None), local_rank=0, device_id=0) is not None


def test_host_arrays_instead_of_addresses_are_named_briefly(engine):
    """The host map takes integer addresses; arrays given instead put their whole repr (8,199 characters) into
    last_error and the log on the first eviction."""
    mgr, dev, host = make(engine)
    name = next(iter(host))
    mgr.set_host_cache_kvs_map({**{k: engine.ptr(v) for k, v in host.items()}, name: np.zeros((4096,), np.uint8)})
    assert mgr.evict_to_host_async([1], [1]) is False
    assert f"host_cache_kvs_map[{name!r}] = a ndarray is not a host address" in mgr.last_error, mgr.last_error
    assert len(mgr.last_error) < 400, len(mgr.last_error)
    mgr.close()


def test_config_fields_and_maps_of_the_wrong_type_are_named():
    """num_hidden_layers '2' failed later inside range() with a bare TypeError; block_size 16.7 was
    cut to 16 and -4 accepted until the first transfer; set_cache_kvs_map('x') stored the string, and the next
    evict_to_host_async raised AttributeError instead of returning False with last_error."""
    for field, value in [("num_hidden_layers", "2"), ("num_hidden_layers", 2.0)]:
        cfg = fd_config(LAYERS, HOST_BLOCKS)
        setattr(cfg.model_config, field, value)
        with pytest.raises(kvtier.InvalidArgumentError, match=f"model_config.{field} is {value!r}"):
            CacheTransferManager(cfg)
    for value in (16.7, "16", -4):
        with pytest.raises(kvtier.InvalidArgumentError, match=f"cache_config.block_size is {value!r}"):
            CacheTransferManager(fd_config(LAYERS, HOST_BLOCKS, block_size=value))
    mgr = CacheTransferManager(fd_config(LAYERS, HOST_BLOCKS))
    for setter in (mgr.set_cache_kvs_map, mgr.set_host_cache_kvs_map):
        with pytest.raises(kvtier.InvalidArgumentError, match="str 'x', not a mapping"):
            setter("x")
    assert mgr.cache_kvs_map == {}  # nothing of the refused map was kept
    assert mgr.evict_to_host_async([0], [0]) is False and mgr.last_error
