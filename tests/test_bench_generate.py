"""Smoke test of benchmarks/bench_generate.py: runs end to end on a tiny random model and
writes results.json / results.md / results.png with the documented schema.

No timing assertions: the numbers of a tiny model on a shared CPU mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_hf_llama

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"


def test_bench_generate_smoke(tmp_path: Path) -> None:
    with_tf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    model = write_tiny_hf_llama(tmp_path / "tiny")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(
        f" {i}: the quick brown fox jumps over the lazy dog, and then it runs far away "
        "into the forest where nobody can find it until the end of the long long winter."
        for i in range(4)) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--model", str(model),
           "--batch-sizes", "1,2", "--new-tokens", "4", "--prompt-tokens", "8",
           "--repeats", "1", "--prompt-source", str(prompts)]
    if not with_tf:
        cmd.append("--skip-transformers")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    res = json.loads((out / "results.json").read_text())
    for key in ("machine", "load_average_before", "load_average_after", "settings",
                "definitions", "prompts", "cold_start", "workers", "batches"):
        assert key in res, key
    m = res["machine"]
    assert m["cpu_count"] >= 1 and m["cpu_model"] and m["date"]
    assert set(m["versions"]) >= {"jax", "torch", "transformers"}
    assert res["settings"]["batch_sizes"] == [1, 2] and res["settings"]["new_tokens"] == 4
    assert all(len(r) == 8 for r in res["prompts"]["rows"])

    cold = res["cold_start"]["gsm_jax"]
    run = cold["runs"][0]
    assert run["total_s"] >= run["import_s"] + run["load_s"] + run["compile_and_first_token_s"]
    assert run["peak_rss_mb"] > 0 and isinstance(cold["pass"], bool)

    sides = ["gsm_jax", "transformers"] if with_tf else ["gsm_jax"]
    assert sorted(res["workers"]) == sorted(sides)
    for side in sides:
        assert res["workers"][side]["peak_rss_mb"] > 0
    if with_tf:
        assert res["workers"]["transformers"]["info"]["torch_num_threads"] >= 1
    for b in ("1", "2"):
        entry = res["batches"][b]
        for side in sides:
            st = entry[side]
            for k in ("generate_s", "ttft_s", "e2e_tok_s"):
                assert st[k]["n"] == 1 and st[k]["median"] > 0, (side, k)
            # None (NaN) when a 4-token call of a tiny model is not slower than the 1-token one
            assert st["decode_tok_s"]["n"] == 1
        if with_tf:
            assert "ratio_decode" in entry and "ratio_e2e" in entry
            g = entry["greedy_match"]
            assert g["rows"] == int(b) and 0 <= g["identical_rows"] <= int(b)
            assert all(0 <= n <= 4 for n in g["matching_prefix_tokens"])
    if with_tf:
        assert res["batches"]["1"]["target_ratio"] == 1.5
        assert res["batches"]["2"]["target_ratio"] is None

    md = (out / "results.md").read_text()
    assert "decode tok/s" in md and "Cold start" in md and "gsm_jax" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--new-tokens", "1"], ["--repeats", "0"]])
def test_bench_generate_rejects_bad_options(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "must be" in proc.stderr
