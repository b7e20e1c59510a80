"""The section-7-question-3 machinery on a tiny model: KLD against a reference model,
SmoothQuant alpha search, GSM calibration against fp32, the quality table."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gsm_jax.config import GSMConfig
from gsm_jax.models import llama
from gsm_jax.params import ModelParams
from gsm_jax.quant import activation_absmax, quantize
from gsm_jax.quant_quality import (
    ReferenceKLD,
    Variant,
    calibrate_gsm_vs_reference,
    quality_table,
    search_smoothquant_alphas,
    smoothquant_params,
)


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=512, eos_token_ids=(3,))
    w = llama.init_weights(cfg, jax.random.key(3))
    layers = dict(w["layers"])
    boost = np.ones(48, np.float32)
    boost[[5, 17]] = 12.0  # outlier channels, so W8A8 has something to lose
    layers["attn_norm"] = layers["attn_norm"] * boost
    layers["ffn_norm"] = layers["ffn_norm"] * boost
    w["layers"] = layers
    return ModelParams(w, cfg, None, "tiny")


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(4, 96, (4, 24)).astype(np.int32)


def test_reference_kld(tiny, tokens):
    ref = ReferenceKLD(tiny, tokens, batch_size=2)
    assert ref(tiny) == pytest.approx(0.0, abs=1e-6)
    w8a8 = ref(quantize(tiny, "w8a8"))
    assert w8a8 > 0 and np.isfinite(w8a8)
    stats = ref.stats(quantize(tiny, "w8a16"))
    assert stats["kld"].shape == (4, 23)  # every token with a next token


def test_smoothquant_alpha_search_never_worse_than_its_start(tiny, tokens):
    ref = ReferenceKLD(tiny, tokens, batch_size=2)
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    alphas, trials = search_smoothquant_alphas(tiny, absmax, ref, grid=(0.3, 0.7),
                                               log=lambda m: None)
    assert set(alphas) == {"qkv", "o", "gate_up", "down"}
    assert min(t["kld"] for t in trials) == pytest.approx(
        ref(quantize(smoothquant_params(tiny, absmax, alphas), "w8a8")), rel=1e-5)
    assert trials[0]["kld"] >= min(t["kld"] for t in trials)


def test_gsm_calibration_against_reference(tiny, tokens):
    ref = ReferenceKLD(tiny, tokens, batch_size=2)
    q = quantize(tiny, "w8a8")
    run = calibrate_gsm_vs_reference(q, ref, strengths=(0.05,), windows=(4,),
                                     log=lambda m: None)
    assert run["kld"] <= run["kld_without_gsm"]
    screened = [h for h in run["history"] if h["step"] == "screen"]
    assert len(screened) == 2 * 2  # every (layer, site) pair
    if run["config"] is not None:
        assert isinstance(run["config"], GSMConfig)
        assert run["kld"] == pytest.approx(ref(q, run["config"]), rel=1e-5)


def test_quality_table(tiny, tokens):
    q = quantize(tiny, "w8a8")
    cfg = GSMConfig(target_layers="all", smooth_strength=0.1, window_size=4)
    rows = quality_table(tiny, [Variant("fp32", tiny), Variant("w8a8", q),
                                Variant("w8a8+GSM", q, cfg)], tokens, batch_size=2,
                         lambada=False, log=lambda m: None)
    assert [r["variant"] for r in rows] == ["fp32", "w8a8", "w8a8+GSM"]
    assert rows[0]["quality"]["mean_kld"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["quality"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert rows[1]["quality"]["mean_kld"] > 0
    assert rows[2]["gsm"]["smooth_strength"] == 0.1
    assert rows[1]["lambada_accuracy_pct"] is None


def test_workflow_evaluate_and_profile_run_on_quantized_params(tiny, tokens):
    """`gsm-jax eval/calibrate/profile --quantize ...` only quantize after loading: the
    workflow functions must take quantized params as they are."""
    from gsm_jax.workflow.evaluate import evaluate
    from gsm_jax.workflow.profile import capture_partials

    q = quantize(tiny, "w8a8")
    cfg = GSMConfig(target_layers="all", smooth_strength=0.1, window_size=4)
    res = evaluate(q, cfg, data=tokens, lambada=None, num_sequences=4, seq_len=24,
                   batch_size=2, greedy_prompts=1, greedy_tokens=4, progress=False)
    assert res.quality["mean_kld"] > 0 and res.greedy is not None
    parts = capture_partials(q, tokens[:2], np.full((2,), 24, np.int32))
    assert parts[0]["max_abs"].shape[0] == tiny.config.num_layers


def test_smoothquant_params_save_and_load(tiny, tokens, tmp_path):
    """Migrated + quantized params round-trip through gsm_jax.save/load and still jit."""
    import gsm_jax
    from gsm_jax.quant import restore_quantized

    absmax = activation_absmax(tiny, tokens, batch_size=2)
    sq = quantize(smoothquant_params(tiny, absmax, {"qkv": 0.5, "o": 0.6, "gate_up": 0.7,
                                                    "down": 0.4}), "w8a8")
    back = restore_quantized(gsm_jax.load(gsm_jax.save(sq, tmp_path / "m")))
    assert back.extra == sq.extra
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(back, tokens[:1])),
                                  np.asarray(gsm_jax.forward(sq, tokens[:1])))
