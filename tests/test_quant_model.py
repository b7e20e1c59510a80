"""GSM on quantized models ("quantize, then smooth"): strength 0 is bit-identical to no GSM,
the fused (Pallas, interpret) and XLA site paths agree, decode agrees with teacher forcing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_checks import decode_and_teacher_forced
from tiny_models import tiny_gsm_llama

import gsm_jax
from gsm_jax.gsm_runtime import kernel_impl
from gsm_jax.models import gsm_sites, llama
from gsm_jax.models.gsm_sites import ATTN_OUT, GSMInputs
from gsm_jax.models.linear import QuantizedActivation, linear
from gsm_jax.pallas_kernels.quant_reference import quantize_rows
from gsm_jax.quant import quantize
from gsm_jax.smoothing import smooth_prefill

ALL = dict(target_layers="all", smooth_strength=0.3, precision="f32", window_size=4)


@pytest.fixture(scope="module")
def tiny():
    return tiny_gsm_llama()


def _rows(lengths, seed: int = 0, vocab: int = 96):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(4, vocab, size=n)) for n in lengths]


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_strength_zero_on_quantized_model_is_bit_identical(tiny, scheme, impl):
    q = quantize(tiny, scheme)
    rows = _rows([7, 12])
    base = np.asarray(gsm_jax.forward(q, rows))
    gen = gsm_jax.generate_tokens(q, rows, max_new_tokens=6, eos_ids=[], return_logits=True)
    with kernel_impl(impl):
        for cfg in (gsm_jax.GSMConfig(**{**ALL, "smooth_strength": 0.0}),
                    gsm_jax.GSMConfig(**{**ALL, "smooth_strength": 0.0, "precision": "bf16"}),
                    gsm_jax.GSMConfig(enable=False, **ALL)):
            np.testing.assert_array_equal(np.asarray(gsm_jax.forward(q, rows, gsm=cfg)), base)
            toks, logits = gsm_jax.generate_tokens(q, rows, max_new_tokens=6, eos_ids=[],
                                                   gsm=cfg, return_logits=True)
            for a, b in zip(toks, gen[0], strict=True):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(logits, gen[1], strict=True):
                np.testing.assert_array_equal(a, b)
        # and GSM on changes the quantized model's output
        on = np.asarray(gsm_jax.forward(q, rows, gsm=gsm_jax.GSMConfig(**ALL)))
        assert np.abs(on - base).max() > 1e-3


def test_site_returns_int8_for_w8a8_weights_only(tiny):
    """The W8A8 site hands `linear` the smoothed-then-quantized activation."""
    q = quantize(tiny, "w8a8")
    w_o = q.weights["layers"]["o"][0]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, 48)).astype(np.float32))
    pos = jnp.tile(jnp.arange(9, dtype=jnp.int32), (2, 1))
    gsm = GSMInputs(strength=jnp.full((3, 2), 0.3), row_enabled=jnp.ones(2),
                    window=jnp.int32(4), protect_first=jnp.int32(1), precision="f32",
                    impl="xla")
    y, ring = gsm_sites.smooth_site_prefill(gsm, jnp.int32(0), ATTN_OUT, x, pos, w_o)
    assert isinstance(y, QuantizedActivation) and y.values.dtype == jnp.int8 and ring is not None
    ref = smooth_prefill(x, pos, jnp.full((2,), 4, jnp.int32), jnp.full((2,), 0.3), 1,
                         max_window=64, precision="f32", impl="xla")
    rq, rs = quantize_rows(ref)
    np.testing.assert_array_equal(np.asarray(y.values), np.asarray(rq))
    np.testing.assert_array_equal(np.asarray(y.scale), np.asarray(rs))
    np.testing.assert_array_equal(np.asarray(linear(y, w_o)),
                                  np.asarray(linear(ref, w_o)))
    # float and weight-only weights get the float smoothed activation
    for w in (tiny.weights["layers"]["o"][0], quantize(tiny, "w8a16").weights["layers"]["o"][0]):
        y, _ = gsm_sites.smooth_site_prefill(gsm, jnp.int32(0), ATTN_OUT, x, pos, w)
        assert not isinstance(y, QuantizedActivation)


def test_fused_kernel_path_matches_xla_path_in_the_model(tiny):
    q = quantize(tiny, "w8a8")
    rows = _rows([9, 20], seed=1)
    cfg = gsm_jax.GSMConfig(**ALL)
    with kernel_impl("xla"):
        ref = np.asarray(gsm_jax.forward(q, rows, gsm=cfg))
        gen_ref = gsm_jax.generate_tokens(q, rows, max_new_tokens=5, eos_ids=[], gsm=cfg,
                                          return_logits=True)
    with kernel_impl("pallas_interpret"):
        got = np.asarray(gsm_jax.forward(q, rows, gsm=cfg))
        gen = gsm_jax.generate_tokens(q, rows, max_new_tokens=5, eos_ids=[], gsm=cfg,
                                      return_logits=True)
    # int8 flips at rounding boundaries are possible (summation order): small differences
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 2e-2 * scale
    for a, b in zip(gen[1], gen_ref[1], strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 2e-2 * scale


def test_quantized_decode_with_gsm_follows_teacher_forcing(tiny):
    """Decode step by step (ring buffers + per-token int8) vs one forward pass: the same
    activations up to f32 summation order, so logits agree closely."""
    q = quantize(tiny, "w8a8")
    cfg = gsm_jax.GSMConfig(**ALL)
    rows = _rows([5, 14], seed=2)
    for _, got, ref in decode_and_teacher_forced(q, rows, max_new_tokens=12, gsm=cfg):
        np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max(), rtol=0)


def test_quantized_model_with_gsm_lowers_for_cuda_with_the_fused_kernel(tiny):
    """The W8A8 model with GSM exports for CUDA with the fused smooth + quantize kernel at
    the sites (prefill and decode), int8 x int8 -> int32 products in between."""
    from jax import export

    from gsm_jax.gsm_runtime import gsm_inputs_for_batch

    triton = "__gpu$xla.gpu.triton"
    q = quantize(tiny, "w8a8")
    cfg = q.config
    with kernel_impl("pallas"):
        gsm = gsm_inputs_for_batch(gsm_jax.GSMConfig(**ALL), cfg.num_layers, 2, [16, 16])
    tokens = jnp.zeros((2, 16), jnp.int32)
    lengths = jnp.array([16, 9], jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call(triton)]
    fwd = export.export(jax.jit(lambda w, t, n, g: llama.forward(w, cfg, t, n, g)),
                        platforms=["cuda"], disabled_checks=checks)(q.weights, tokens, lengths,
                                                                     gsm)
    text = fwd.mlir_module()
    assert "gsm_smooth_quantize_prefill" in text
    assert "xi8>" in text and "xi32>" in text  # int8 operands, int32 accumulators
    cache = llama.init_cache(cfg, 2, 32, gsm_max_window=gsm.max_window)
    dec = export.export(jax.jit(lambda w, t, c, g: llama.decode_step(w, cfg, t, c, g)),
                        platforms=["cuda"], disabled_checks=checks)(
        q.weights, tokens[:, 0], cache, gsm)
    assert "gsm_smooth_quantize_decode" in dec.mlir_module()


# ----------------------------------------------------------------------------- DeepSeek-V4


@pytest.fixture(scope="module")
def dsv4_w8a8():
    from tiny_models import tiny_dsv4

    return quantize(tiny_dsv4(), "w8a8")


def test_deepseek_v4_ffn_mid_site_returns_int8_for_w8a8_shared_down(dsv4_w8a8):
    """The shared expert's GSM site hands its W8A8 down projection the smoothed-then-
    quantized activation; the same numbers as smoothing and letting `linear` quantize."""
    from gsm_jax.models import deepseek_v4 as dv

    q = dsv4_w8a8
    cfg = q.config
    moe_w = q.weights["layers"][1]["moe"]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.tile(jnp.arange(9, dtype=jnp.int32), (2, 1))
    gsm = GSMInputs(strength=jnp.full((cfg.num_layers, 2), 0.3), row_enabled=jnp.ones(2),
                    window=jnp.int32(4), protect_first=jnp.int32(1), precision="f32",
                    impl="xla")
    seen = []

    def site(m, w):
        y, ring = gsm_sites.smooth_site_prefill(gsm, jnp.int32(1), 1, m, pos, next_weight=w)
        seen.append(y)
        return y, ring

    def plain_site(m, w):  # smooth only: `linear` quantizes
        return gsm_sites.smooth_site_prefill(gsm, jnp.int32(1), 1, m, pos)

    moe = dv.MoE(cfg, 1)
    fused, _ = moe.apply({"params": moe_w}, x, tokens, site)
    unfused, _ = moe.apply({"params": moe_w}, x, tokens, plain_site)
    assert isinstance(seen[0], QuantizedActivation) and seen[0].values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(unfused))


def test_deepseek_v4_quantized_gsm(dsv4_w8a8):
    """W8A8 DeepSeek-V4 with GSM: strength 0 is bit-identical to no GSM; the Pallas
    (interpret) sites agree with XLA; decode follows teacher forcing."""
    q = dsv4_w8a8
    rows = _rows([7, 13], seed=4)
    base = np.asarray(gsm_jax.forward(q, rows))
    zero = gsm_jax.GSMConfig(**{**ALL, "smooth_strength": 0.0})
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(q, rows, gsm=zero)), base)
    cfg = gsm_jax.GSMConfig(**ALL)
    with kernel_impl("xla"):
        ref = np.asarray(gsm_jax.forward(q, rows, gsm=cfg))
    with kernel_impl("pallas_interpret"):
        got = np.asarray(gsm_jax.forward(q, rows, gsm=cfg))
    scale = np.abs(ref).max()
    assert np.abs(ref - base).max() > 1e-4 * scale  # GSM is on
    assert np.abs(got - ref).max() <= 2e-2 * scale  # int8 flips at rounding boundaries
    for _, got, want in decode_and_teacher_forced(q, rows, max_new_tokens=10, gsm=cfg):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)


def test_deepseek_v4_w8a8_gsm_lowers_for_cuda_with_the_fused_kernel(dsv4_w8a8):
    from jax import export

    from gsm_jax.gsm_runtime import gsm_inputs_for_batch
    from gsm_jax.models import deepseek_v4 as dv

    q = dsv4_w8a8
    cfg = q.config
    with kernel_impl("pallas"):
        gsm = gsm_inputs_for_batch(gsm_jax.GSMConfig(**ALL), cfg.num_layers, 2, [16, 16])
    tokens = jnp.zeros((2, 16), jnp.int32)
    lengths = jnp.array([16, 9], jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fwd = export.export(jax.jit(lambda w, t, n, g: dv.forward(w, cfg, t, n, g)),
                        platforms=["cuda"], disabled_checks=checks)(q.weights, tokens, lengths,
                                                                     gsm)
    assert "gsm_smooth_quantize_prefill" in fwd.mlir_module()
    cache = dv.init_cache(cfg, 2, 32, gsm_max_window=gsm.max_window)
    dec = export.export(jax.jit(lambda w, t, c, g: dv.decode_step(w, cfg, t, c, g)),
                        platforms=["cuda"], disabled_checks=checks)(
        q.weights, tokens[:, 0], cache, gsm)
    assert "gsm_smooth_quantize_decode" in dec.mlir_module()
