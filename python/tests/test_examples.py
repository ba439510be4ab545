"""The Python examples of examples/python/ run against the installed package and succeed (each checks its own
bytes and exits non-zero otherwise)."""
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")
RUNS = [("offload_and_reload.py", ["--host"]), ("prefill_decode.py", ["push"]), ("prefill_decode.py", ["pull"]),
        ("three_tier_cache.py", ["--host"])]


@pytest.mark.parametrize("script,args", RUNS, ids=[f"{s}-{'-'.join(a)}" for s, a in RUNS])
def test_example_runs(script, args):
    path = os.path.join(EXAMPLES, script)
    if not os.path.exists(path):
        pytest.skip(f"{script}: the examples are not beside these tests")
    r = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, f"{script} {args}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "checked" in r.stdout or "verified" in r.stdout, r.stdout
