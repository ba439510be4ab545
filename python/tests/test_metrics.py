"""kvtier's Prometheus exposition, parsed by prometheus_client: the counters of `kvtier replay --metrics-out`
equal the replay's own totals (its --json output), with and without injected failures."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

parser = pytest.importorskip("prometheus_client.parser")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli() -> str:
    candidates = [os.environ.get("KVTIER_CLI", "")]
    try:
        import kvtier

        candidates.append(os.path.join(os.path.dirname(kvtier.__file__), "bin", "kvtier"))
    except ImportError:
        pass
    candidates.append(os.path.join(ROOT, "build", "default", "tools", "kvtier"))
    for c in candidates:
        if c and os.path.exists(c):
            return c
    pytest.skip("no kvtier CLI binary (set KVTIER_CLI)")


def _replay(tmp_path, *extra: str, host_blocks: int = 512, transfer: str = "none"):
    out = tmp_path / "metrics.prom"
    cmd = [_cli(), "replay", os.path.join(ROOT, "data", "traces", "mooncake_sample.jsonl"), "--max-requests", "300",
           "--device-blocks", "256", "--host-blocks", str(host_blocks), "--transfer", transfer, "--json",
           "--metrics-out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    samples = {}
    types = {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return json.loads(p.stdout), samples, types, text


def _v(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_counters_equal_the_replay_totals(tmp_path):
    r, s, types, text = _replay(tmp_path)
    assert "# TYPE kvtier_replay_hit_blocks_total counter" in text
    assert types["kvtier_replay_hit_blocks"] == "counter"  # the parser drops _total from family names
    assert types["kvtier_replay_request_seconds"] == "histogram"
    assert _v(s, "kvtier_replay_requests_total") == r["requests"] == 300
    assert _v(s, "kvtier_replay_lookup_blocks_total") == r["total_blocks"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="device") == r["device_hit_blocks"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    hits = r["device_hit_blocks"] + r["host_hit_blocks"] + r["storage_hit_blocks"]
    assert hits > 0
    assert _v(s, "kvtier_replay_miss_blocks_total") == r["total_blocks"] - hits
    assert _v(s, "kvtier_replay_moved_bytes_total", direction="d2h") == r["bytes_d2h"] > 0
    assert _v(s, "kvtier_replay_moved_bytes_total", direction="h2d") == r["bytes_h2d"] > 0
    assert _v(s, "kvtier_replay_refused_requests_total") == r["failed_admissions"]
    assert _v(s, "kvtier_replay_request_seconds_count") == 300
    assert _v(s, "kvtier_replay_request_seconds_bucket", le="+Inf") == 300
    # The cache manager's own series (attached by the replay): what its admissions saw.
    assert _v(s, "kvtier_cache_failed_transfers_total") == r["failed_transfers"] == 0
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="device") == r["device_hit_blocks"]
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    assert _v(s, "kvtier_cache_moves_total", kind="load") * r["block_bytes"] == r["bytes_h2d"]
    assert _v(s, "kvtier_cache_pool_capacity_blocks", tier="device") == 256
    assert 0 < _v(s, "kvtier_cache_pool_used_blocks", tier="device") <= 256


def test_failures_are_counted(tmp_path):
    r, s, _, _ = _replay(tmp_path, "--failure-rate", "0.05", "--seed", "3")
    assert r["failed_transfers"] > 0
    assert _v(s, "kvtier_cache_failed_transfers_total") == r["failed_transfers"]
    assert _v(s, "kvtier_replay_hit_blocks_total", tier="host") == r["host_hit_blocks"]
    # Failed loads are hits the cache manager admitted that the replay then recomputed.
    assert _v(s, "kvtier_cache_hit_blocks_total", tier="host") >= r["host_hit_blocks"]


def test_real_copies_are_counted_by_the_transfer_manager(tmp_path):
    # --transfer host: every device<->host byte goes through a TransferManager on the host backend, whose
    # own series must equal what the replay's executor moved.
    r, s, _, _ = _replay(tmp_path, transfer="host")
    t = r["transfer"]
    assert t["verification_failures"] == 0 and t["failed_tasks"] == 0
    assert _v(s, "kvtier_transfer_bytes_total", direction="evict") == t["bytes_d2h"] > 0
    assert _v(s, "kvtier_transfer_bytes_total", direction="load") == t["bytes_h2d"] > 0
    assert _v(s, "kvtier_transfer_blocks_total", direction="load") * r["block_bytes"] == t["bytes_h2d"]
    assert _v(s, "kvtier_transfer_tasks_total", direction="load", outcome="failed") == 0
    assert _v(s, "kvtier_transfer_in_flight_tasks", direction="evict") == 0
    loads = _v(s, "kvtier_transfer_tasks_total", direction="load", outcome="ok")
    assert _v(s, "kvtier_transfer_task_latency_seconds_count", direction="load") == loads > 0
    assert _v(s, "kvtier_transfer_layer_latency_seconds_count") >= loads


def test_storage_tier_is_counted(tmp_path):
    store = tmp_path / "store"
    r, s, _, _ = _replay(tmp_path, "--storage", f"disk:{store}", transfer="host", host_blocks=128)
    assert r["storage_writes"] > 0
    puts = _v(s, "kvtier_storage_items_total", backend="disk", op="put", outcome="ok")
    assert puts == r["storage_writes"]
    assert _v(s, "kvtier_storage_bytes_total", backend="disk", op="put") == r["bytes_to_storage"] > 0
    assert _v(s, "kvtier_storage_bytes_total", backend="disk", op="get") == r["bytes_from_storage"]
    assert _v(s, "kvtier_storage_items_total", backend="disk", op="get", outcome="data_loss") == 0
    assert _v(s, "kvtier_storage_objects", backend="disk") > 0
