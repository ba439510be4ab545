"""pytest wrapper for llama_offload.py (the real-model offload proof).

test_llama_offload: on a CUDA machine, the 7B-shaped model with a shorter prompt through the
real kvtier.fastdeploy.CacheTransferManager; tokens after offload + layer-wise reload must equal
the reference run's. Skipped without CUDA.
test_paged_attention_matches_reference: the paged decode attention kernel against a CPU
float64 reference. Skipped without CUDA and Triton.
test_script_with_fake_manager: the script itself on a tiny CPU model with its in-script stand-in
manager (no kvtier involved). Skipped where torch or transformers are missing.
"""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_offload  # noqa: E402


def _run(args, tmp_path):
    out = tmp_path / "llama_offload.json"
    rc = llama_offload.main(args + ["--out", str(out)])
    res = json.loads(out.read_text())
    failed = [k for k, v in res["checks"].items() if not v]
    assert res["offload_tokens"] == res["ref_tokens"], failed
    assert rc == 0 and res["ok"], failed
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llama_offload(tmp_path):
    res = _run(["--prompt-tokens", "2048", "--new-tokens", "8", "--repeats", "3"], tmp_path)
    assert not res["fake_kvtier"]
    assert isinstance(res["kvtier_stats"], dict)


def test_script_with_fake_manager(tmp_path):
    _run(["--device", "cpu", "--fake-kvtier", "--layers", "2", "--hidden", "64", "--heads", "4",
          "--kv-heads", "2", "--intermediate", "128", "--prompt-tokens", "200", "--block-tokens", "16",
          "--new-tokens", "8", "--repeats", "2", "--check-tokens", "96"], tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available() or llama_offload.triton is None, reason="needs a CUDA GPU and Triton")
def test_paged_attention_matches_reference():
    # The decode step's paged attention kernel against a CPU float64 reference, NaN outside the context.
    for dtype in (torch.bfloat16, torch.float16):
        ok, worst, worst_gather = llama_offload.check_paged_attention(torch.device("cuda"), dtype)
        assert ok, (dtype, worst, worst_gather)
