"""The Llama family's two weight layouts: per-layer arrays (what `gsm_jax.load` gives;
an unrolled layer loop) and stacked [L, ...] arrays (`lax.scan`). The same weights
must give the same model, float or quantized, with and without GSM; the workflow's
weight transforms keep the layout they were given; w8a16's int8 -> f32 converts
of per-layer weights are not all alive at once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_checks import decode_and_teacher_forced
from tiny_models import tiny_gsm_llama

import gsm_jax
from gsm_jax.models import llama
from gsm_jax.models.linear import QuantizedWeight
from gsm_jax.quant import quantize, smoothquant

ROWS = [[5, 9, 11, 40, 2, 7], [8, 1, 30], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
GSM = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.3, window_size=4)


def per_layer(p):
    return dataclasses.replace(p, weights=llama.unstack_layers(p.weights))


def _scale(a) -> float:
    return float(np.abs(np.asarray(a)).max())


def test_unstack_and_stack_are_inverse_and_exact():
    p = tiny_gsm_llama()
    per = llama.unstack_layers(p.weights)
    assert llama.is_per_layer(per) and not llama.is_per_layer(p.weights)
    assert len(per["layers"]) == p.config.num_layers
    assert per["layers"][1]["qkv"].shape == p.weights["layers"]["qkv"].shape[1:]
    np.testing.assert_array_equal(np.asarray(per["layers"][2]["down"]),
                                  np.asarray(p.weights["layers"]["down"][2]))
    back = llama.stack_layers(per)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(p.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert llama.unstack_layers(per) is per and llama.stack_layers(p.weights) is p.weights


@pytest.mark.parametrize("scheme", [None, "w8a16", "w8a8"])
def test_layouts_give_the_same_forward_and_decode(scheme):
    """Teacher-forced logits, and greedy decode with GSM (rings, caches), agree across
    layouts to f32 rounding (the programs differ only in fusion order)."""
    p = tiny_gsm_llama()
    if scheme is not None:
        p = quantize(p, scheme)
    q = per_layer(p)
    ids = [r + [3] * (9 - len(r)) for r in ROWS]
    a, b = gsm_jax.forward(p, ids), gsm_jax.forward(q, ids)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * _scale(a))
    stacked = decode_and_teacher_forced(p, ROWS, max_new_tokens=6, gsm=GSM)
    unrolled = decode_and_teacher_forced(q, ROWS, max_new_tokens=6, gsm=GSM)
    for (ta, la, _), (tb, lb, fb) in zip(stacked, unrolled, strict=True):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5 * _scale(la))
        # and the per-layer decode is consistent with its own teacher forcing
        np.testing.assert_allclose(lb, fb, rtol=0, atol=1e-4 * _scale(fb))


def test_quantize_keeps_the_layout_it_is_given():
    p = tiny_gsm_llama()
    for scheme in ("w8a16", "w8a8"):
        from_stacked = quantize(p, scheme)
        from_per_layer = quantize(per_layer(p), scheme)
        assert llama.is_per_layer(from_per_layer.weights)
        lw = from_per_layer.weights["layers"][0]
        assert isinstance(lw["gate_up"], QuantizedWeight) and lw["gate_up"].values.ndim == 2
        for a, b in zip(jax.tree.leaves(from_stacked.weights),
                        jax.tree.leaves(llama.stack_layers(from_per_layer.weights)),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_smoothquant_keeps_the_layout_and_is_exact_in_float():
    p = per_layer(tiny_gsm_llama())
    tokens = np.random.default_rng(0).integers(4, 96, (4, 16))
    sq = smoothquant(p, tokens, alpha=0.5)
    assert llama.is_per_layer(sq.weights)
    ids = [list(r) for r in tokens[:2]]
    a, b = gsm_jax.forward(p, ids), gsm_jax.forward(sq, ids)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-5 * _scale(a))
    moved = np.asarray(sq.weights["layers"][1]["down"]) - np.asarray(p.weights["layers"][1]["down"])
    assert np.abs(moved).max() > 0


def _prefill_temp_bytes(weights, cfg):
    """Temporary memory of a compiled prefill of 2 x 24 tokens (48 rows: the w8a16
    products take the converted-weight path)."""
    tokens = jnp.zeros((2, 24), jnp.int32)
    lengths = jnp.full((2,), 24, jnp.int32)

    def run(weights, tokens, lengths):
        cache = llama.init_cache(cfg, 2, 24, dtype=jnp.float32)
        return llama.prefill(weights, cfg, tokens, lengths, cache)[0]

    compiled = jax.jit(run).lower(weights, tokens, lengths).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_w8a16_converts_of_per_layer_weights_do_not_pile_up(monkeypatch):
    """No convert of a per-layer int8 weight depends on an activation, so XLA:CPU's
    scheduler may run them all first, every layer's f32 copy alive at once;
    `linear._after` ties each to its input, which keeps about one layer's worth."""
    import gsm_jax.models.linear as linear_module

    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=512,
                            num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
                            max_position_embeddings=64)
    w = llama.unstack_layers(quantize(gsm_jax.ModelParams(
        llama.init_weights(cfg, jax.random.key(0)), cfg, None, "t"), "w8a16").weights)
    one_layer_f32 = 4 * sum(int(np.prod(x.values.shape)) for x in w["layers"][0].values()
                            if isinstance(x, QuantizedWeight))
    ours = _prefill_temp_bytes(w, cfg)
    assert ours < 3 * one_layer_f32, (ours, one_layer_f32)
    monkeypatch.setattr(linear_module, "_after", lambda x, values: values)
    untied = _prefill_temp_bytes(w, cfg)
    if untied < cfg.num_layers * one_layer_f32 / 2:
        pytest.skip(f"this XLA does not hoist the converts ({untied} bytes): nothing to guard")


def test_per_layer_weights_must_match_the_layer_count():
    p = per_layer(tiny_gsm_llama())
    short = dataclasses.replace(p, weights={**p.weights, "layers": p.weights["layers"][:2]})
    with pytest.raises(gsm_jax.InvalidInputError, match="2 layers but the config says"):
        gsm_jax.forward(short, [[5, 6, 7]])


def test_transforms_refuse_other_families():
    from tiny_models import tiny_dsv4

    from gsm_jax.quant import stacked_weights

    with pytest.raises(gsm_jax.UnsupportedModelError,
                       match="llama and gemma3 families only, not 'deepseek_v4'"):
        stacked_weights(tiny_dsv4())
