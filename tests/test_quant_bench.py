"""Smoke tests of the INT8 benchmark script and the report section, on a tiny saved model."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from conftest import import_benchmark

import gsm_jax
from gsm_jax.models import llama
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evidence.quant_quality import report_section


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=512, eos_token_ids=(3,))
    params = ModelParams(llama.init_weights(cfg, jax.random.key(0)), cfg, None, "tiny")
    return gsm_jax.save(params, tmp_path_factory.mktemp("tiny") / "model")


def test_bench_quant_smoke(tiny_path, tmp_path):
    bench_quant = import_benchmark("bench_quant")
    out = tmp_path / "bq"
    assert bench_quant.main(["--model", str(tiny_path), "--out", str(out), "--repeats", "2",
                             "--prefill-repeats", "1", "--prefill-len", "16", "--context", "8",
                             "--batches", "1", "--profile"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["config"]["variants"]) == set(bench_quant.VARIANTS)
    # one batch size (each compiles every variant's programs; the list is parsed and
    # looped by the same code for one size or many)
    assert set(data["results"]) == {"decode, batch 1", "prefill 16 tokens, batch 1"}
    for case in ("decode, batch 1", "prefill 16 tokens, batch 1"):
        entry = data["results"][case]
        assert entry["fp32"]["ratio_vs_fp32_median"] == pytest.approx(1.0)
        assert entry["w8a8"]["tokens_per_s"] > 0
    assert (out / "results.png").stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "Which change made each difference" in md and "load average" in md.lower()
    assert bench_quant.main(["--out", str(out), "--render-only"]) == 0
    text = report_section(None, data)
    assert "w8a16" in text and "Quality table not run" in text


def test_report_section_from_quality_json():
    q = {"config": {"eval_sequences": 2, "lambada_samples": 5},
         "data": {"evaluation": "e", "calibration": "c", "lambada": "l"},
         "table": [
             {"variant": "fp32", "quality": {"mean_kld": 0.0, "mean_kld_stderr": 0.0,
                                             "same_top1_pct": 100.0, "ppl": 10.0,
                                             "ppl_ratio": 1.0}, "lambada_accuracy_pct": 40.0},
             {"variant": "w8a8", "quality": {"mean_kld": 0.04, "mean_kld_stderr": 0.001,
                                             "same_top1_pct": 88.0, "ppl": 10.5,
                                             "ppl_ratio": 1.05}, "lambada_accuracy_pct": 38.0},
             {"variant": "w8a8+GSM (calibrated)",
              "quality": {"mean_kld": 0.04, "mean_kld_stderr": 0.001, "same_top1_pct": 88.0,
                          "ppl": 10.5, "ppl_ratio": 1.05}, "lambada_accuracy_pct": 38.0},
             {"variant": "w8a8+SmoothQuant",
              "quality": {"mean_kld": 0.008, "mean_kld_stderr": 0.001, "same_top1_pct": 95.0,
                          "ppl": 10.1, "ppl_ratio": 1.01}, "lambada_accuracy_pct": 39.0}],
         "gsm_calibration": {"w8a8": {"config": None, "kld": 0.04, "kld_without_gsm": 0.04,
                                      "history": [{"step": "screen", "kld": 0.05}]}}}
    text = report_section(q, None)
    assert "| w8a8+SmoothQuant | 0.00800" in text
    assert "meets the 0.01 mean-KLD target" in text
    assert "smooths nothing" in text and "Speed table not run" in text


def test_evidence_report_fills_q3_from_int8_runs(tmp_path):
    """With INT8 results under <out>/data/quant the report's Q3 is filled, else kept open."""
    import shutil

    from gsm_jax.workflow import report

    src = Path(__file__).resolve().parents[1] / "reports"
    if not (src / "data" / "report_meta.json").exists():
        pytest.skip("no recorded evidence report in reports/")
    out = tmp_path / "reports"
    shutil.copytree(src, out)
    shutil.rmtree(out / "data" / "quant", ignore_errors=True)
    evidence = out / "data" / "evidence" / "smollm2-135m" / "claim_3.json"
    if evidence.exists():  # then Q3 quotes the cross-model evidence's claim 3
        claim3 = json.loads(evidence.read_text())
        text = report.render_report(out).read_text()
        assert "the cross-model evidence measured it (claim 3" in text
        assert claim3["why"][:80] in text
        evidence.unlink()
    text = report.render_report(out).read_text()
    assert "Not measured in this report." in text
    q = {"config": {}, "data": {}, "gsm_calibration": {"w8a8": {"config": None}},
         "table": [{"variant": v, "quality": {"mean_kld": k, "mean_kld_stderr": 0.0,
                                              "same_top1_pct": 90.0, "ppl": 10.0,
                                              "ppl_ratio": 1.0}, "lambada_accuracy_pct": 40.0}
                   for v, k in (("fp32", 0.0), ("w8a8", 0.04), ("w8a8+GSM (calibrated)", 0.04),
                                ("w8a8+SmoothQuant", 0.009))]}
    (out / "data" / "quant").mkdir(parents=True)
    (out / "data" / "quant" / "quality.json").write_text(json.dumps(q))
    text = report.render_report(out).read_text()
    assert report.Q3_MARK in text and "| w8a8+SmoothQuant | 0.00900" in text
    assert "GSM does **not** lower the W8A8 quality loss" in text
    assert "Speed table not run" in text
