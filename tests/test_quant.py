"""INT8 schemes: quantizer bounds, exact integer products, `linear` dispatch, the model on
quantized params, orbax round trip."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_dsv4

import gsm_jax
from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.models import llama
from gsm_jax.models.linear import (
    QuantizedActivation,
    QuantizedWeight,
    hadamard_matrix,
    hadamard_rotate,
    linear,
    quantize_activation,
)
from gsm_jax.models.llama import LlamaConfig, init_weights
from gsm_jax.pallas_kernels.quant_reference import (
    dequantize_rows,
    dequantize_weight,
    dequantize_weight_grouped,
    int8_dot,
    quantize_rows,
    quantize_weight,
    quantize_weight_grouped,
)
from gsm_jax.params import ModelParams
from gsm_jax.quant import (
    apply_quantize_option,
    dequantize,
    quantization_of,
    quantize,
    restore_quantized,
)

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(1,))


def _tiny_params(seed: int = 0, cfg: LlamaConfig = TINY) -> ModelParams:
    weights = init_weights(cfg, jax.random.key(seed))
    # spikier than N(0, 0.02): a few large input channels, as real models have
    rng = np.random.RandomState(seed)
    layers = dict(weights["layers"])
    boost = np.ones(cfg.hidden_size, np.float32)
    boost[rng.choice(cfg.hidden_size, 3, replace=False)] = 8.0
    layers["attn_norm"] = layers["attn_norm"] * boost
    weights["layers"] = layers
    return ModelParams(weights, cfg, None, source="tiny")


def _spiky(rng, shape, scale=1.0):
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[..., rng.integers(0, shape[-1], 2)] *= 20.0  # outlier channels
    return x


# ----------------------------------------------------------------------------- quantizers


def test_weight_quantization_error_within_half_step():
    rng = np.random.default_rng(0)
    w = jnp.asarray(_spiky(rng, (3, 96, 40)))
    q, s = quantize_weight(w)
    assert q.dtype == jnp.int8 and s.shape == (3, 40) and s.dtype == jnp.float32
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # the absmax hits the grid end
    assert int(jnp.min(q.astype(jnp.int32))) >= -127
    err = jnp.abs(dequantize_weight(q, s) - w)
    bound = s[:, None, :] / 2
    assert bool(jnp.all(err <= bound * (1 + 1e-6) + 1e-12))


def test_row_quantization_error_and_zero_rows():
    rng = np.random.default_rng(1)
    x = _spiky(rng, (4, 7, 33))
    x[1, 2] = 0.0  # an all-zero token stays exactly zero
    q, s = quantize_rows(jnp.asarray(x))
    assert q.shape == x.shape and s.shape == (4, 7)
    assert float(s[1, 2]) == 1.0 and not np.any(np.asarray(q[1, 2]))
    err = np.abs(np.asarray(dequantize_rows(q, s)) - x)
    assert np.all(err <= np.asarray(s)[..., None] / 2 * (1 + 1e-6) + 1e-12)
    # per token: each row's absmax maps to +-127
    nz = np.abs(x).max(-1) > 0
    assert np.all(np.abs(np.asarray(q)).max(-1)[nz] == 127)


def test_bf16_rows_quantize_in_f32():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 64)), jnp.bfloat16)
    q, s = quantize_rows(x)
    q32, s32 = quantize_rows(x.astype(jnp.float32))
    assert s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q32))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s32))


# ----------------------------------------------------------------------------- products


def test_int8_matmul_is_exact_integer_arithmetic():
    rng = np.random.default_rng(3)
    xq = rng.integers(-127, 128, (6, 512)).astype(np.int8)
    wq = rng.integers(-127, 128, (512, 48)).astype(np.int8)
    xq[0] = 127  # worst case magnitudes: 512 * 127 * 127 > 2**23
    wq[:, 0] = 127
    got = np.asarray(int8_dot(jnp.asarray(xq), jnp.asarray(wq)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, xq.astype(np.int64) @ wq.astype(np.int64))


def test_w8a8_linear_equals_product_of_dequantized_operands():
    """linear(x, W8A8) == (x_q s_x) @ (w_q s_w): exactly the integer product, rescaled."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(_spiky(rng, (2, 5, 96)))
    w = jnp.asarray(_spiky(rng, (96, 40), 0.05))
    wq, ws = quantize_weight(w)
    qw = QuantizedWeight(wq, ws, "w8a8")
    y = np.asarray(linear(x, qw), np.float64)
    xq, xs = quantize_rows(x)
    exact = (np.asarray(xq, np.int64) @ np.asarray(wq, np.int64)).astype(np.float64)
    expected = exact * np.asarray(xs, np.float64)[..., None] * np.asarray(ws, np.float64)
    # the only rounding is the final float32 rescale (two multiplies)
    np.testing.assert_allclose(y, expected, rtol=3e-7, atol=0)
    # the same through an already quantized activation
    y2 = np.asarray(linear(QuantizedActivation(xq, xs, "float32"), qw))
    np.testing.assert_array_equal(y2, np.asarray(linear(x, qw)))
    # against the float product: within the quantization bound
    #   |x w - x^ w^| <= sum_i |x_i| |dw_i| + |dx_i| |w^_i| <= sum_i |x_i| s_w/2 + s_x/2 |w^_i|
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    w_hat = np.asarray(dequantize_weight(wq, ws), np.float64)
    bound = (np.abs(xf).sum(-1, keepdims=True) * np.asarray(ws)[None, None] / 2
             + np.asarray(xs, np.float64)[..., None] / 2 * np.abs(w_hat).sum(0))
    err = np.abs(y - xf @ wf)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-6)
    assert err.max() > 0  # it is a lossy scheme after all


@pytest.mark.parametrize("path", ["kernel", "digits"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_w8a16_linear_equals_float_product_of_dequantized_weight(rows, path, monkeypatch):
    """Weight-only: activations stay float; the product with the dequantized weight.
    Decode-sized inputs on CPU run on the int8 matrix-vector kernel (x rounded to int16
    per row: error <= absmax / 65534 per element) or, without it, as exact int8 digit
    products (error <= 4.8e-7 absmax; see linear.py)."""
    from gsm_jax.pallas_kernels import int8_matvec_cpu

    if path == "kernel" and not int8_matvec_cpu.available():
        pytest.skip(f"int8 kernel unavailable: {int8_matvec_cpu.unavailable_reason()}")
    if path == "digits":
        monkeypatch.setattr(int8_matvec_cpu, "available", lambda: False)
    rng = np.random.default_rng(5)
    x = jnp.asarray(_spiky(rng, (rows, 96)))
    w = jnp.asarray(_spiky(rng, (96, 40), 0.05))
    wq, ws = quantize_weight(w)
    # a fresh function: jit's cache is per Python function, and `linear` was traced with
    # the other path by the previous case
    y = np.asarray(jax.jit(lambda a, b: linear(a, b))(x, QuantizedWeight(wq, ws, "w8a16")),
                   np.float64)
    w_hat = np.asarray(dequantize_weight(wq, ws), np.float64)
    xf = np.asarray(x, np.float64)
    ref = xf @ w_hat
    scale = np.abs(xf) @ np.abs(w_hat)
    rounding = 1 / 65534 if path == "kernel" else 4.8e-7
    x_err = np.abs(xf).max(-1, keepdims=True) * rounding * np.abs(w_hat).sum(0)
    err = np.abs(y - ref)
    assert np.all(err <= 2e-6 * scale + x_err + 1e-9)
    if path == "kernel":  # the int16 rounding is really there, well inside its bound
        assert err.max() > 1e-6 * scale.max()
    # and within the weight-quantization bound of the float product (plus x's rounding)
    bound = np.abs(xf).sum(-1, keepdims=True) * np.asarray(ws) / 2 + x_err
    assert np.all(np.abs(y - xf @ np.asarray(w, np.float64)) <= bound * (1 + 1e-5) + 1e-6)


@pytest.mark.parametrize("digits", [3, 4])
def test_int8_digit_expansion_is_exact_to_its_bound(digits):
    """Power-of-two digit scales: the expansion's error is the last residual only,
    < absmax / 127 / 128**(digits - 1) (no float rounding on the way)."""
    from gsm_jax.models.linear import _int8_digits

    rng = np.random.default_rng(6)
    x = _spiky(rng, (3, 512), 3.0).astype(np.float32)
    x[2] = 0.0  # an all-zero row stays zero
    q, s = _int8_digits(jnp.asarray(x), digits)
    x = x.astype(np.float64)
    assert q.dtype == jnp.int8 and q.shape == (digits, 3, 512) and s.shape == (digits, 3)
    s = np.asarray(s, np.float64)
    assert np.all(np.log2(s[:, :2]) == np.round(np.log2(s[:, :2])))  # powers of two
    back = sum(np.asarray(q[k], np.float64) * s[k][:, None] for k in range(digits))
    absmax = np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(back - x)[:2] < absmax[:2] / 127 / 128.0 ** (digits - 1))
    np.testing.assert_array_equal(back[2], 0.0)


def test_w8a16_digit_path_keeps_non_finite_rows_non_finite():
    """A NaN or inf in a decode row must not vanish into int8 digits: that row's
    output is NaN like the float product's, the other rows are untouched."""
    rng = np.random.default_rng(8)
    w = jnp.asarray(_spiky(rng, (64, 24), 0.05))
    qw = QuantizedWeight(*quantize_weight(w), "w8a16")
    x = _spiky(rng, (3, 64)).astype(np.float32)
    clean = np.asarray(linear(jnp.asarray(x), qw))
    x[0, 5], x[2, 9] = np.nan, np.inf
    y = np.asarray(linear(jnp.asarray(x), qw))
    assert np.isnan(y[0]).all() and not np.isfinite(y[2]).any()
    np.testing.assert_array_equal(y[1], clean[1])


def test_linear_refuses_int8_activation_for_float_weight():
    xa = quantize_activation(jnp.ones((2, 8)))
    with pytest.raises(TypeError):
        linear(xa, jnp.ones((8, 4)))
    with pytest.raises(TypeError):
        linear(xa, QuantizedWeight(jnp.ones((8, 4), jnp.int8), jnp.ones((4,)), "w8a16"))


def test_hadamard_rotation_is_orthogonal_and_exact_in_float():
    h = hadamard_matrix(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    rng = np.random.default_rng(7)
    x = jnp.asarray(_spiky(rng, (3, 64)))
    np.testing.assert_allclose(np.asarray(hadamard_rotate(hadamard_rotate(x, 16), 16)),
                               np.asarray(x), atol=1e-5)
    with pytest.raises(ValueError):
        hadamard_matrix(12)


# ----------------------------------------------------------------------------- quantize()


def test_quantize_replaces_every_llama_linear():
    p = _tiny_params()
    for scheme in ("w8a16", "w8a8"):
        q = quantize(p, scheme)
        assert quantization_of(q) == scheme and quantization_of(p) is None
        for name in ("qkv", "o", "gate_up", "down"):
            w = q.weights["layers"][name]
            assert isinstance(w, QuantizedWeight) and w.scheme == scheme
            assert w.values.dtype == jnp.int8 and w.values.shape == p.weights["layers"][name].shape
            assert w.scale.shape == (TINY.num_layers, w.values.shape[-1])
        for name in ("embed", "final_norm"):
            assert q.weights[name] is p.weights[name]  # head and embedding stay float
        assert q.dtype == jnp.float32


def test_quantize_refuses_bad_input():
    p = _tiny_params()
    with pytest.raises(InvalidInputError):
        quantize(p, "int4")
    with pytest.raises(InvalidInputError):
        quantize(quantize(p, "w8a8"), "w8a8")
    with pytest.raises(InvalidInputError):
        quantize(p.weights, "w8a8")
    with pytest.raises(InvalidInputError):
        quantize(p, "w8a8", hadamard_down=48)


# ----------------------------------------------------------------------------- grouped w8a16


def test_grouped_weight_quantization_bounds():
    """quantize_weight_grouped: |w - (scale * q + zero)| <= scale / 2 in every group, the
    256 levels spanning the group's [min, max]; an all-zero group stays exactly zero and a
    constant one within float16 rounding of its value."""
    rng = np.random.default_rng(21)
    w = _spiky(rng, (3, 96, 40))
    w[0, :32, 0] = 0.0            # an all-zero group
    w[1, 32:64, 1] = 0.7          # a constant group
    q, scale, zero = quantize_weight_grouped(jnp.asarray(w), 32)
    assert q.dtype == jnp.int8 and scale.dtype == zero.dtype == jnp.float16
    assert scale.shape == zero.shape == (3, 3, 40)
    back = np.asarray(dequantize_weight_grouped(q, scale, zero))
    step = np.repeat(np.asarray(scale, np.float32), 32, axis=-2)
    err = np.abs(back - w)
    assert np.all(err <= step / 2 * (1 + 1e-3) + 1e-7)
    assert np.all(back[0, :32, 0] == 0.0)
    assert abs(back[1, 32:64, 1] - 0.7).max() <= 0.7 * 2.0**-11
    # the levels reach both ends of each group: an asymmetric group's q spans [-128, 127],
    # a symmetric one's (zero 0) reaches +-127 on its larger side; flat groups aside
    qg = np.asarray(q).reshape(3, 3, 32, 40)
    spread = np.ptp(w.reshape(3, 3, 32, 40), axis=2) > 0
    asym = np.asarray(zero) != 0
    assert np.all((qg.min(2) <= -127)[spread & asym]) and np.all((qg.max(2) >= 126)[spread & asym])
    assert np.all((np.abs(qg).max(2) >= 126)[spread & ~asym])
    assert asym[spread].mean() > 0.5  # spiky random groups: mostly the asymmetric grid


def test_grouped_int8_keeps_gguf_groups():
    """Weights that came from 4-bit groups of 32 (a Q4_1 / Q4_K GGUF: 16 equally spaced
    levels, float16 step and minimum) land on the int8 grid (17 int8 steps per 4-bit step)
    to within float16 rounding of the offset and scale (here under 5% of a 4-bit step),
    where per-channel int8 is off by up to half its own step (here ~40% of a 4-bit step).
    Q8_0 groups are kept exactly."""
    rng = np.random.default_rng(22)
    d = rng.uniform(0.01, 0.1, (4, 1, 64)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-1.0, 0.0, (4, 1, 64)).astype(np.float16).astype(np.float32)
    levels = rng.integers(0, 16, (4, 32, 64))
    levels[:, 0], levels[:, 1] = 0, 15  # both ends used, as Q4_1's quantizer makes them
    w = (levels * d + m).reshape(128, 64).astype(np.float32)
    q, scale, zero = quantize_weight_grouped(jnp.asarray(w), 32)
    back = np.asarray(dequantize_weight_grouped(q, scale, zero))
    # the offset is rounded to float16 (dz <= |zero| * 2**-11), the scale computed from that
    # offset (which moves it by up to dz / 127) and rounded up (one ulp, scale * 2**-10):
    # 128 levels from the offset, |error| <= 2 dz + 128 * scale * 2**-10
    bound = (np.abs(np.asarray(zero, np.float32)) + 128 * np.asarray(scale, np.float32)) \
        * 2.0**-10
    assert np.all(np.abs(back - w) <= np.repeat(bound, 32, axis=0) * (1 + 1e-3))
    step4 = np.repeat(d.reshape(4, 64), 32, axis=0)
    assert (np.abs(back - w) / step4).max() < 0.05
    per_channel = np.asarray(dequantize_weight(*quantize_weight(jnp.asarray(w))))
    assert (np.abs(per_channel - w) / step4).max() > 0.1
    # Q8_0 groups (int8 times a float16 scale per 32; the largest at +-127): exact, on
    # the symmetric grid
    d8 = rng.uniform(1e-3, 1e-2, (4, 1, 64)).astype(np.float16).astype(np.float32)
    q8 = rng.integers(-127, 128, (4, 32, 64))
    q8[:, 0] = np.where(rng.random((4, 64)) < 0.5, 127, -127)
    w8 = (q8 * d8).reshape(128, 64).astype(np.float32)
    q, scale, zero = quantize_weight_grouped(jnp.asarray(w8), 32)
    assert np.all(np.asarray(zero) == 0)
    np.testing.assert_array_equal(np.asarray(dequantize_weight_grouped(q, scale, zero)), w8)


def test_quantize_group_size_model():
    """quantize(..., "w8a16", group_size=16): every linear and the head grouped; prefill
    and decode (the kernel's grouped form on CPU) equal the dequantized float model, GSM
    on; a tied model's lookup table is rounded to the head's grid."""
    p = _tiny_params()
    q = quantize(p, "w8a16", group_size=16, head=True)
    assert q.extra["group_size"] == 16 and q.extra["quantized_head"] is True
    for name in ("qkv", "o", "gate_up", "down"):
        w = q.weights["layers"][name]
        k, n = p.weights["layers"][name].shape[-2:]
        assert w.group == 16 and w.scale.shape == w.zero.shape == (TINY.num_layers, k // 16, n)
    head = q.weights["lm_head"]
    assert head.group == 16 and head.values.shape == (TINY.hidden_size, TINY.vocab_size)
    tied = dataclasses.replace(p, config=dataclasses.replace(p.config, tie_word_embeddings=True),
                               weights={k: v for k, v in p.weights.items() if k != "lm_head"})
    qt = quantize(tied, "w8a16", group_size=16, head=True)  # the table is the head's grid
    np.testing.assert_array_equal(np.asarray(qt.weights["embed"]),
                                  np.asarray(qt.weights["lm_head"].dequantize().T))
    deq = dequantize(q)
    ids = np.random.default_rng(12).integers(2, TINY.vocab_size, (2, 10))
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(q, ids)),
                               np.asarray(gsm_jax.forward(deq, ids)), rtol=1e-4, atol=1e-4)
    gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.2, target_layers="all")
    rows = [list(ids[0, :6]), list(ids[1, :3])]
    got, got_logits = gsm_jax.generate_tokens(q, rows, max_new_tokens=5, eos_ids=[], gsm=gsm,
                                              return_logits=True)
    ref, ref_logits = gsm_jax.generate_tokens(deq, rows, max_new_tokens=5, eos_ids=[],
                                              gsm=gsm, return_logits=True)
    for a, b in zip(got_logits, ref_logits, strict=True):  # int16 decode rows: 1/65534
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)


def test_quantize_group_size_refusals():
    p = _tiny_params()
    with pytest.raises(InvalidInputError, match="w8a16 scheme only"):
        quantize(p, "w8a8", group_size=32)
    for bad in (1, 3, 1024, True, 32.0):
        with pytest.raises(InvalidInputError, match="must be an even integer"):
            quantize(p, "w8a16", group_size=bad)
    with pytest.raises(InvalidInputError, match=r"input width 64 of weight 'qkv'"):
        quantize(p, "w8a16", group_size=48)
    with pytest.raises(UnsupportedModelError, match="group_size"):
        quantize(tiny_dsv4(), "w8a16", group_size=32)
    # a grouped container marked w8a8 by hand is refused, not multiplied without its offsets
    values, scale, zero = quantize_weight_grouped(jnp.ones((32, 8), jnp.float32), 16)
    with pytest.raises(ValueError, match="w8a16 only"):
        linear(jnp.ones((1, 32)), QuantizedWeight(values, scale, "w8a8", zero=zero))


def test_apply_quantize_option():
    p = _tiny_params()
    assert apply_quantize_option(p, None) is p and apply_quantize_option(p, "none") is p
    q = apply_quantize_option(p, "w8a16")
    assert quantization_of(q) == "w8a16" and apply_quantize_option(q, "w8a16") is q
    with pytest.raises(InvalidInputError):
        apply_quantize_option(q, "w8a8")


def test_w8a16_model_equals_float_model_of_dequantized_weights():
    p = _tiny_params()
    q = quantize(p, "w8a16")
    ids = np.random.default_rng(8).integers(2, TINY.vocab_size, (2, 12))
    got = np.asarray(gsm_jax.forward(q, ids))
    ref = np.asarray(gsm_jax.forward(dequantize(q), ids))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    base = np.asarray(gsm_jax.forward(p, ids))
    assert 0 < np.abs(got - base).max() < 0.1 * np.abs(base).max()


def test_w8a8_model_runs_and_stays_close():
    p = _tiny_params()
    ids = np.random.default_rng(9).integers(2, TINY.vocab_size, (2, 12))
    base = np.asarray(gsm_jax.forward(p, ids))
    for scheme in ("w8a8",):
        got = np.asarray(gsm_jax.forward(quantize(p, scheme), ids))
        assert np.all(np.isfinite(got))
        assert 0 < np.abs(got - base).max() < 0.2 * np.abs(base).max()
    # generation (prefill + while_loop decode) on quantized params
    out = gsm_jax.generate_tokens(quantize(p, "w8a8"), [ids[0, :5]], max_new_tokens=4)
    assert len(out[0]) == 4


def test_hadamard_down_is_float_exact():
    p = _tiny_params()
    q = quantize(p, "w8a8", hadamard_down=32)
    w = q.weights["layers"]["down"]
    assert w.hadamard == 32 and q.weights["layers"]["o"].hadamard == 0
    # dequantize() undoes the rotation: the stored weight is H W
    np.testing.assert_allclose(np.asarray(w.dequantize()), np.asarray(p.weights["layers"]["down"]),
                               atol=float(jnp.max(w.scale)) * 8)
    ids = np.random.default_rng(10).integers(2, TINY.vocab_size, (1, 10))
    got = np.asarray(gsm_jax.forward(q, ids))
    base = np.asarray(gsm_jax.forward(p, ids))
    assert np.all(np.isfinite(got)) and np.abs(got - base).max() < 0.2 * np.abs(base).max()


def test_orbax_round_trip(tmp_path):
    p = _tiny_params()
    ids = np.random.default_rng(11).integers(2, TINY.vocab_size, (2, 9))
    for scheme, group in (("w8a16", None), ("w8a8", None), ("w8a16", 32)):
        q = quantize(p, scheme, hadamard_down=32 if scheme == "w8a8" else 0, group_size=group)
        path = gsm_jax.save(q, tmp_path / f"{scheme}_{group}")
        back = restore_quantized(gsm_jax.load(path))
        assert back.extra == q.extra
        # saved stacked, loaded as per-layer arrays (the run-time layout)
        assert llama.is_per_layer(back.weights) and not llama.is_per_layer(q.weights)
        leaves_q = jax.tree.leaves(q.weights)
        leaves_b = jax.tree.leaves(llama.stack_layers(back.weights))
        assert len(leaves_q) == len(leaves_b)
        for a, b in zip(leaves_q, leaves_b, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for lw in back.weights["layers"]:
            w = lw["down"]
            assert isinstance(w, QuantizedWeight) and w.scheme == scheme
            assert w.values.ndim == 2 and w.hadamard == q.weights["layers"]["down"].hadamard
            assert w.group == (group or 0)
        np.testing.assert_allclose(np.asarray(gsm_jax.forward(back, ids)),
                                   np.asarray(gsm_jax.forward(q, ids)), rtol=0, atol=1e-5)
        again = restore_quantized(back).weights["layers"][0]["o"]  # idempotent
        assert again.scheme == scheme


@pytest.mark.parametrize("routed", [False, True])
def test_deepseek_v4_dense_projections_and_shared_experts(routed):
    p = tiny_dsv4()
    q = quantize(p, "w8a8", routed_experts=routed)
    layer = q.weights["layers"][1]
    for name in ("q_a", "q_b", "kv", "o_b"):
        assert isinstance(layer["attn"][name], QuantizedWeight)
    assert isinstance(layer["attn"]["compressor"]["kv_gate"], QuantizedWeight)
    assert isinstance(layer["moe"]["shared_down"], QuantizedWeight)
    assert isinstance(layer["moe"]["experts_down"], QuantizedWeight) == routed
    assert not isinstance(layer["moe"]["router"], QuantizedWeight)  # selection stays float
    assert not isinstance(layer["attn"]["o_a"], QuantizedWeight)  # grouped einsum, float
    ids = np.random.default_rng(12).integers(2, 96, (2, 10))
    base = np.asarray(gsm_jax.forward(p, ids))
    for params in (q, quantize(p, "w8a16", routed_experts=routed)):
        got = np.asarray(gsm_jax.forward(params, ids))
        assert np.all(np.isfinite(got))
        assert np.abs(got - base).max() < 0.2 * np.abs(base).max() + 1e-3


def test_round_half_even_matches_jnp_round():
    from gsm_jax.pallas_kernels.quant_reference import round_half_even

    rng = np.random.default_rng(13)
    v = np.concatenate([rng.uniform(-130, 130, 20000), np.arange(-130, 130, 0.5),
                        [2.0**23 + 1, -(2.0**24), 0.49999997, -0.5, 1e30]]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_half_even(jnp.asarray(v))),
                                  np.round(v))


# ----------------------------------------------------------------------------- SmoothQuant


def test_capture_follows_the_model():
    from gsm_jax.models.llama import hidden_states
    from gsm_jax.quant import smoothquant_inputs

    p = _tiny_params()
    ids = jnp.asarray(np.random.default_rng(14).integers(2, TINY.vocab_size, (2, 11)), jnp.int32)
    lengths = jnp.array([11, 11], jnp.int32)
    x, stats = smoothquant_inputs(p.weights, TINY, ids, lengths)
    ref = hidden_states(p.weights, TINY, ids, lengths)[0]
    np.testing.assert_allclose(np.asarray(x), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert stats["down"].shape == (TINY.num_layers, TINY.intermediate_size)
    assert stats["o"].shape == (TINY.num_layers, TINY.num_heads * TINY.head_dim)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
@pytest.mark.parametrize("bias", [False, True])
def test_smoothquant_migration_leaves_float_logits_unchanged(alpha, bias):
    import dataclasses

    from gsm_jax.quant import smoothquant

    cfg = dataclasses.replace(TINY, attention_bias=bias)
    p = _tiny_params(1, cfg)
    if bias:
        w = dict(p.weights)
        w["layers"] = {**w["layers"], "qkv_bias": jnp.asarray(
            np.random.default_rng(15).standard_normal(w["layers"]["qkv_bias"].shape) * 0.3,
            jnp.float32)}
        p = ModelParams(w, cfg, None)
    calib = np.random.default_rng(16).integers(2, TINY.vocab_size, (4, 16))
    sq = smoothquant(p, calib, alpha=alpha, batch_size=2)
    assert sq.extra["smoothquant_alpha"] == alpha and quantization_of(sq) is None
    # the weights really moved
    assert np.abs(np.asarray(sq.weights["layers"]["down"] - p.weights["layers"]["down"])).max() > 0
    ids = np.random.default_rng(17).integers(2, TINY.vocab_size, (2, 13))
    base = np.asarray(gsm_jax.forward(p, ids))
    got = np.asarray(gsm_jax.forward(sq, ids))
    np.testing.assert_allclose(got, base, rtol=0, atol=2e-5 * np.abs(base).max())
    # and quantization runs on the migrated params
    assert np.all(np.isfinite(np.asarray(gsm_jax.forward(quantize(sq, "w8a8"), ids))))


def test_smoothquant_refuses_quantized_or_other_families():
    from gsm_jax.errors import UnsupportedModelError
    from gsm_jax.quant import smoothquant

    p = _tiny_params()
    calib = np.zeros((1, 4), np.int32)
    with pytest.raises(InvalidInputError):
        smoothquant(quantize(p, "w8a8"), calib)
    with pytest.raises(UnsupportedModelError):
        smoothquant(tiny_dsv4(), calib)
    with pytest.raises(InvalidInputError):
        smoothquant(p, calib, alpha=1.5)


def test_smoothquant_on_smollm2_is_exact_in_float_and_helps_w8a8(smollm2, wikitext_passages):
    """The real model: migration keeps fp32 logits; W8A8 after it is closer to fp32."""
    from gsm_jax.quant import smoothquant

    tok = smollm2.tokenizer
    calib = np.array([tok.encode(wikitext_passages[0])[:64], tok.encode(wikitext_passages[1])[:64]])
    sq = smoothquant(smollm2, calib, alpha=0.5, batch_size=2)
    ids = [tok.encode(wikitext_passages[3])[:64]]
    base = np.asarray(gsm_jax.forward(smollm2, ids), np.float64)
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(sq, ids)), base, rtol=0,
                               atol=1e-4 * np.abs(base).max())

    def kld(logits):
        lp = base - np.logaddexp.reduce(base, -1, keepdims=True)
        lq = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
        return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))

    plain = kld(np.asarray(gsm_jax.forward(quantize(smollm2, "w8a8"), ids), np.float64))
    migrated = kld(np.asarray(gsm_jax.forward(quantize(sq, "w8a8"), ids), np.float64))
    assert migrated < plain


def test_w8a8_single_row_equals_batched_rows():
    """The CPU one-row form (two identical rows) gives the same integers as a batch."""
    rng = np.random.default_rng(18)
    x = jnp.asarray(_spiky(rng, (5, 96)))
    wq, ws = quantize_weight(jnp.asarray(_spiky(rng, (96, 40), 0.05)))
    qw = QuantizedWeight(wq, ws, "w8a8")
    batched = np.asarray(linear(x, qw))
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(linear(x[i:i + 1], qw)), batched[i:i + 1])
        np.testing.assert_array_equal(np.asarray(linear(x[i], qw)), batched[i])
