"""Smoke test of benchmarks/bench_best_of_each.py: the real SmolLM2-135M GGUF at tiny sizes
(batch 1, 8 new tokens, 1 repeat, one 32-token KLD window), end to end in a subprocess,
and the JSON / Markdown / PNG it writes.

No timing assertions: 8 tokens on a shared 2-core CPU mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import import_benchmark

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH_DIR / "bench_best_of_each.py"


def _module():
    return import_benchmark("bench_best_of_each")


def test_best_of_each_tiny(smollm2_gguf_path: str, shared_data_dir: Path, tmp_path: Path) -> None:
    with_tf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    with_llama = importlib.util.find_spec("llama_cpp") is not None
    settings = ["gsm_jax:fp32", "gsm_jax:w8a8", "llama_cpp:gguf"]
    if with_tf:
        settings.append("transformers:fp32")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--new-tokens", "8", "--out", str(out),
         "--settings", ",".join(settings), "--data",
         str(shared_data_dir / "wikitext2_test.txt")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[best_of_each" in proc.stderr  # progress lines

    res = json.loads((out / "results.json").read_text())
    for key in ("machine", "cpu_flags", "bf16_on_xla_cpu", "load_average_before",
                "load_average_after", "options", "definitions", "settings", "sanity", "best",
                "ratio_best", "contention", "wall_s"):
        assert key in res, key
    assert res["options"]["batch_sizes"] == [1] and res["options"]["new_tokens"] == 8
    assert res["options"]["kld_windows"] == 1 and res["options"]["kld_tokens"] == 32
    assert "avx512_bf16" in res["cpu_flags"] and "amx_bf16" in res["cpu_flags"]
    assert isinstance(res["bf16_on_xla_cpu"]["sentence"], str)

    recs = {r["name"]: r for r in res["settings"]}
    order = ["gsm_jax:fp32", "gsm_jax:w8a8", "transformers:fp32", "llama_cpp:gguf"]
    assert list(recs) == [n for n in order if n in settings]
    for name, r in recs.items():
        for key in ("side", "setting", "status", "error", "decode_tok_s", "kld", "kld_stats",
                    "within_budget", "comparable", "load_1m_before", "load_1m_after",
                    "best_at_batch"):
            assert key in r, (name, key)
        assert r["side"] == name.split(":")[0]
    for name in [n for n in settings if not n.startswith("llama_cpp")]:
        r = recs[name]
        assert r["status"] == "ok", (name, r["error"])
        assert r["speed"]["1"]["generate_s"]["n"] == 1 and r["speed"]["1"]["generate_s"][
            "median"] > 0
        assert isinstance(r["comparable"], bool)
        assert len(r["load_1m_before"]["1"]) == 1 and len(r["load_1m_after"]["1"]) == 1
        assert r["kld_stats"]["tokens"] == 31
    # each side's fp32 against itself, and w8a8 against fp32
    assert recs["gsm_jax:fp32"]["kld"] == pytest.approx(0.0, abs=1e-7)
    assert recs["gsm_jax:fp32"]["within_budget"] is True
    assert recs["gsm_jax:w8a8"]["kld"] > 0
    assert recs["gsm_jax:w8a8"]["kld_reference"] == "gsm_jax:fp32"
    if not with_llama:
        llama = recs["llama_cpp:gguf"]
        assert llama["status"] == "skipped"
        assert llama["error"] == "llama-cpp-python not installed (optional extra)"
        assert llama["decode_tok_s"]["1"] is None
    if with_tf:
        assert recs["transformers:fp32"]["kld"] == pytest.approx(0.0, abs=1e-7)
        sanity = res["sanity"]["gsm_jax_fp32_vs_transformers_fp32"]
        assert -1e-9 < sanity["mean_kld"] < 1e-3 and sanity["tokens"] == 31
    # the best of a side is its fastest setting within the budget (fp32 always is). A
    # decode tok/s is None when an 8-token call happened not to be slower than its 1-token
    # call (a loaded machine): then that setting cannot be the best
    for side in ("gsm_jax", "transformers"):
        fits = [r for r in recs.values() if r["side"] == side and r["within_budget"]
                and r["decode_tok_s"]["1"] is not None]
        if fits:
            best = res["best"][side]["1"]
            assert best["setting"] == max(fits, key=lambda r: r["decode_tok_s"]["1"])["name"]
            assert 1 in recs[best["setting"]]["best_at_batch"]
        else:
            assert "1" not in res["best"].get(side, {})
    ratio = res["ratio_best"]["1"]["ratio"]
    assert ratio is None or ratio > 0

    md = (out / "results.md").read_text()
    assert "| side | setting | status | tok/s b1 |" in md
    assert "Best of each side" in md and "ratio gsm_jax / transformers" in md
    assert "llama-cpp-python" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_setting_is_rejected() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--settings", "gsm_jax:fp32,gsm_jax:fp4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown setting" in proc.stderr and "'gsm_jax:fp4'" in proc.stderr
    assert "gsm_jax:w8a8+smoothquant" in proc.stderr and "transformers:int8-dynamic" in proc.stderr


def test_parse_settings() -> None:
    mod = _module()
    assert mod.parse_settings(None) == list(mod.SETTINGS)
    assert mod.parse_settings("transformers:fp32, gsm_jax:w8a8") == [
        "gsm_jax:w8a8", "transformers:fp32"]
    assert mod.parse_settings("transformers") == [
        "transformers:fp32", "transformers:bf16", "transformers:int8-dynamic"]
    with pytest.raises(ValueError, match="valid settings"):
        mod.parse_settings("fp32")


def test_hlo_dtype_summary() -> None:
    hlo = """
    %fused_computation (param_0: bf16[512,256]) -> f32[512,256] {
      %param_0 = bf16[512,256]{1,0} parameter(0)
      ROOT %convert.1 = f32[512,256]{1,0} convert(%param_0)
    }
    %fused_dot (param_0.1: f32[1,512], param_1.1: f32[512,256]) -> f32[1,256] {
      %param_0.1 = f32[1,512]{1,0} parameter(0)
      %param_1.1 = f32[512,256]{1,0} parameter(1)
      ROOT %dot.2 = f32[1,256]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}
    }
    ENTRY %main (x: f32[1,512], w: bf16[512,256], q: bf16[1,8]) -> f32[1,256] {
      %x = f32[1,512]{1,0} parameter(0)
      %q = bf16[1,8]{1,0} parameter(2)
      %small = f32[1,8]{1,0} convert(%q)
      %dot.3 = f32[1,1]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={1}
    }
    """
    s = _module().hlo_dtype_summary(hlo, min_elements=65536)
    assert s["dots_by_operand_dtypes"] == {"f32xf32->f32": 1, "bf16xbf16->f32": 1}
    assert s["dots_with_bf16_operands"] == 1 and s["dots_with_f32_operands_only"] == 1
    assert s["bf16_to_f32_converts"] == 2
    assert s["bf16_to_f32_converts_of_at_least_65536_elements"] == 1
