"""The section-7-question-3 machinery on a tiny model: KLD against a reference model,
SmoothQuant alpha search, GSM calibration against fp32, the quality table."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from gsm_jax.config import GSMConfig
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.models.linear import linear
from gsm_jax.params import ModelParams
from gsm_jax.quant import (
    activation_absmax,
    activation_samples,
    quantize,
    smoothquant_scales,
)
from gsm_jax.workflow.evidence.quant_quality import (
    ReferenceKLD,
    Variant,
    _w8a8_relative_error,
    calibrate_gsm_vs_reference,
    local_smoothquant_alphas,
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


def test_activation_samples_agree_with_absmax(tiny, tokens):
    samples = activation_samples(tiny, tokens)
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    for k, v in samples.items():
        assert v.shape == (2, 4 * 24, absmax[k].shape[-1])
        # one batch of 4 rows vs batches of 2: f32 rounding differs, nothing more
        np.testing.assert_allclose(np.abs(v).max(axis=1), absmax[k], rtol=1e-5)


def test_per_layer_alpha_equals_each_layer_at_its_own_alpha(tiny, tokens):
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    both = smoothquant_scales(tiny, absmax, np.array([0.3, 0.8]))
    for layer, a in enumerate((0.3, 0.8)):
        one = smoothquant_scales(tiny, absmax, a)
        for k in both:
            np.testing.assert_allclose(both[k][layer], one[k][layer], rtol=1e-6)
    for bad in (np.array([0.5, 0.5, 0.5]), np.array([0.5, 1.2]), -0.1):
        with pytest.raises(InvalidInputError, match="alpha"):
            smoothquant_scales(tiny, absmax, bad)


def test_local_w8a8_error_is_the_error_of_the_int8_linear(tiny, tokens):
    """The float emulation the per-layer search scores equals the real W8A8 `linear`
    (int8 x int8 -> int32) on the migrated operands."""
    samples = activation_samples(tiny, tokens)
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    s = smoothquant_scales(tiny, absmax, 0.6)["down"]
    x, w = samples["down"], np.asarray(tiny.weights["layers"]["down"], np.float32)
    got = np.asarray(_w8a8_relative_error(x, w, s))
    q = quantize(tiny, "w8a8").weights["layers"]["down"]
    for layer in range(2):
        qw = quantize(ModelParams({**tiny.weights, "layers": {
            **tiny.weights["layers"], "down": w * s[:, :, None]}}, tiny.config, None),
            "w8a8").weights["layers"]["down"][layer]
        y = np.asarray(linear(x[layer] / s[layer], qw))
        ref = x[layer] @ w[layer]
        want = np.sum((y - ref) ** 2) / np.sum(ref**2)
        assert got[layer] == pytest.approx(want, rel=1e-3)
        assert q[layer].values.dtype == np.int8


def test_local_alphas_pick_the_smallest_error_and_stay_exact_in_float(tiny, tokens):
    samples = activation_samples(tiny, tokens)
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    grid = (0.0, 0.5, 0.9)
    alphas, errors = local_smoothquant_alphas(tiny, absmax, samples, grid=grid,
                                              log=lambda m: None)
    for k, e in errors.items():
        assert e.shape == (2, 3) and np.all(e > 0)
        chosen = [grid.index(a) for a in alphas[k]]
        np.testing.assert_array_equal(e[np.arange(2), chosen], e.min(axis=1))
    # the outlier channels (x12 on the norms) make migration pay at qkv and gate_up
    assert errors["qkv"].min(axis=1).max() < errors["qkv"][:, 0].min()
    sq = smoothquant_params(tiny, absmax, alphas)
    assert "[" in sq.extra["smoothquant_alphas"]  # per-layer values recorded
    ids = tokens[:2]
    import gsm_jax

    base = np.asarray(gsm_jax.forward(tiny, ids))
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(sq, ids)), base,
                               atol=2e-5 * np.abs(base).max(), rtol=0)


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
    # loaded as per-layer arrays: bit-identical to the same weights unstacked
    per_layer = dataclasses.replace(sq, weights=llama.unstack_layers(sq.weights))
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(back, tokens[:1])),
                                  np.asarray(gsm_jax.forward(per_layer, tokens[:1])))


def test_local_alphas_refuse_samples_of_the_wrong_shape(tiny, tokens):
    absmax = activation_absmax(tiny, tokens, batch_size=2)
    samples = activation_samples(tiny, tokens)
    with pytest.raises(InvalidInputError, match="'down'"):
        local_smoothquant_alphas(tiny, absmax, {**samples, "down": samples["down"][:1]},
                                 log=lambda m: None)
    with pytest.raises(InvalidInputError, match="'o'"):
        local_smoothquant_alphas(tiny, absmax, {k: v for k, v in samples.items() if k != "o"},
                                 log=lambda m: None)
