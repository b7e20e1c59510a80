"""benchmarks/bench_deepseek_v4.py end to end on its tiny preset (a smoke test: the
numbers mean nothing here; the same weights on both sides must agree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deepseek_v4.py"


def test_bench_deepseek_v4_smoke(tmp_path: Path) -> None:
    out = tmp_path / "dsv4"
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--out", str(out), "--repeats", "1",
           "--prompt-tokens", "12", "--new-tokens", "5", "--batches", "1", "2", "--threads",
           "1", "--profile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["threads"] == 1 and len(data["cpu_affinity"]) == 1  # pinned to one core
    for entry in data["results"]:
        assert entry["greedy_rows_equal"] == entry["batch"]
        assert entry["prefill_logits_max_rel_diff"] < 1e-4
        assert entry["decode_speedup"] > 0
        scopes = entry["gsm_jax"]["decode_profile_ms"]
        # flax module scopes ("<module>/<named_scope>"): the routed experts and the attention
        assert sum(v for k, v in scopes.items() if k.endswith("routed_experts")) > 0
        assert sum(v for k, v in scopes.items() if k.endswith("/attention")) > 0
        assert entry["gsm_jax"]["decode_profile_kind_ms"]["matmul (dot / library fusion)"] > 0
    md = (out / "results.md").read_text()
    assert "decode step by named scope" in md and "by kind of op" in md
    assert (out / "results.png").stat().st_size > 0
