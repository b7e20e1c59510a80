"""FP8 / FP4 block formats (models/block_quant.py) against plain-python tables and loops.

Pins the checkpoint facts the loader relies on (../shared/research/deepseek_v4_checkpoints.md
section 2a): the E2M1 value table, low nibble = even input index, E8M0 = 2 ** (b - 127)
with 0xFF = NaN, block scales over the torch [out, in] layout with partial edge blocks.
Every comparison here is exact: the formats' values and power-of-two scales are exactly
representable in float32, so the numpy and jnp paths must agree bit for bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gsm_jax.models import block_quant as bq
from gsm_jax.models.linear import linear

# E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal.
E2M1_BY_FORMULA = [
    (-1.0 if c & 8 else 1.0) * ((c & 1) * 0.5 if (c >> 1) & 3 == 0
                                else 2.0 ** (((c >> 1) & 3) - 1) * (1 + (c & 1) / 2))
    for c in range(16)
]


def test_e2m1_table_matches_the_bit_layout():
    assert list(bq.E2M1_VALUES) == E2M1_BY_FORMULA
    assert bq.E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert math.copysign(1.0, bq.E2M1_VALUES[8]) == -1.0  # code 8 is -0


def test_nibble_order_low_nibble_is_the_even_index():
    packed = np.array([[0x21, 0xF7, 0x80]], np.uint8)  # (lo, hi) = (1, 2), (7, 15), (0, 8)
    want = [0.5, 1.0, 6.0, -6.0, 0.0, -0.0]
    np.testing.assert_array_equal(bq.unpack_e2m1(packed)[0], want)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(bq._unpack_e2m1_jnp(jnp.asarray(packed), dtype), np.float32)[0]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    codes = np.array([1, 2, 7, 15, 0, 8], np.uint8)
    np.testing.assert_array_equal(bq.pack_e2m1(codes), packed[0])


def test_every_byte_unpacks_like_a_python_loop():
    every = np.arange(256, dtype=np.uint8).reshape(16, 16)
    loop = np.array([[v for b in row for v in (E2M1_BY_FORMULA[b & 15], E2M1_BY_FORMULA[b >> 4])]
                     for row in every], np.float32)
    np.testing.assert_array_equal(bq.unpack_e2m1(every), loop)
    for dtype in (jnp.float32, jnp.bfloat16):  # the table route and the float4 bitcast route
        got = bq._unpack_e2m1_jnp(jnp.asarray(every), dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), loop)
    # the checkpoint stores these bytes as I8: the same bits
    np.testing.assert_array_equal(bq.unpack_e2m1(every.view(np.int8)), loop)


def test_e2m1_rounding_is_nearest_with_ties_to_even_and_saturates():
    x = np.array([0.2, 0.25, 0.26, 0.75, 1.25, 2.5, 3.5, 5.0, 5.1, 9.0, -0.75, -7.0], np.float32)
    got = np.asarray(bq.E2M1_VALUES)[bq.e2m1_codes(x)]
    np.testing.assert_array_equal(got, [0, 0, 0.5, 1.0, 1.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0])


def test_e8m0_decoding():
    b = np.arange(255, dtype=np.uint8)
    want = np.array([2.0 ** (int(v) - 127) for v in b], np.float32)
    np.testing.assert_array_equal(bq.e8m0_to_float(b), want)
    np.testing.assert_array_equal(np.asarray(bq._scale_f32(jnp.asarray(b))), want)
    assert np.isnan(bq.e8m0_to_float(np.array([0xFF], np.uint8))[0])
    np.testing.assert_array_equal(bq.float_to_e8m0(want[1:]), b[1:])
    with pytest.raises(ValueError, match="powers of two"):
        bq.float_to_e8m0(np.array([3.0], np.float32))


def _dequant_loop(values_f32, scale_f32, block):
    """Scale every element by the scale of the block it lies in (plain loops)."""
    out = np.empty_like(values_f32)
    rows, cols = values_f32.shape
    for i in range(rows):
        for j in range(cols):
            out[i, j] = values_f32[i, j] * scale_f32[i // block[0], j // block[1]]
    return out


@pytest.mark.parametrize("fmt,shape,block", [
    ("e4m3", (300, 200), (128, 128)),  # partial edge blocks on both axes
    ("e4m3", (256, 384), (128, 128)),  # whole blocks
    ("e4m3", (64, 96), (32, 32)),  # V4.1's dense block
    ("e2m1", (5, 96), (1, 32)),  # MXFP4 experts
    ("e2m1", (3, 80), (1, 32)),  # a partial last group
])
def test_block_dequantization_against_a_loop(fmt, shape, block):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, (shape[0], 1))
    values, scale = bq.quantize_np(w, fmt, block)
    assert scale.shape == bq.scale_grid(shape, block) and scale.dtype == np.uint8
    raw = bq.unpack_e2m1(values) if fmt == "e2m1" else values.astype(np.float32)
    want = _dequant_loop(raw, bq.e8m0_to_float(scale), block)
    np.testing.assert_array_equal(bq.dequantize_np(values, scale, fmt, block), want)
    weight = bq.BlockQuantWeight(jnp.asarray(values), jnp.asarray(scale), fmt, block)
    assert weight.shape == (shape[1], shape[0]) and weight.stored_shape == shape
    np.testing.assert_array_equal(np.asarray(weight.dequantize_stored()), want)
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want.T)
    # the quantizer keeps every block in range and the error within the format's half step
    top = bq.E2M1_MAX if fmt == "e2m1" else bq.E4M3_MAX
    s = bq.expand_scale(bq.e8m0_to_float(scale), *shape, block)
    assert np.all(np.abs(raw) <= top)
    # half a step of the format at that magnitude: e4m3 3 mantissa bits (subnormal step
    # 2 ** -9), e2m1 steps 0.5 / 1 / 2 on [0, 2) / [2, 4) / [4, 6]
    rel, floor = (0.25, 0.25) if fmt == "e2m1" else (2.0 ** -4, 2.0 ** -10)
    assert np.all(np.abs(want - w) <= np.maximum(np.abs(w) * rel, s * floor))


def test_float32_scales_and_expert_indexing():
    rng = np.random.default_rng(1)
    values = rng.standard_normal((3, 256, 128)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (3, 2, 1)).astype(np.float32)  # Flash-Base: F32 block scales
    w = bq.BlockQuantWeight(jnp.asarray(values), jnp.asarray(scale), "e4m3", (128, 128))
    assert w.shape == (3, 128, 256) and w[1].shape == (128, 256)
    want = _dequant_loop(values[2].astype(np.float32), scale[2], (128, 128))
    np.testing.assert_array_equal(np.asarray(w[2].dequantize_stored()), want)
    np.testing.assert_array_equal(np.asarray(w.astype(jnp.float32))[2], want.T)
    assert w.nbytes == values.nbytes + scale.nbytes


def _act_quant_reference(x: np.ndarray, block: int = 128) -> np.ndarray:
    """V4's act_quant (ue8m0), one token and one block at a time."""
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for b0 in range(0, x.shape[1], block):
            seg = x[t, b0: b0 + block]
            amax = max(float(np.abs(seg).max()), 1e-4)
            scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
            q = (seg / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn)
            out[t, b0: b0 + block] = q.astype(np.float32) * np.float32(scale)
    return out


def test_fp8_activation_quantization_per_token_and_block():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 300)) * rng.uniform(1e-3, 50, (5, 1))).astype(np.float32)
    x[3] = 0.0  # an all-zero token stays zero
    got = np.asarray(bq.quantize_activation_e4m3(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _act_quant_reference(x))
    assert np.all(got[3] == 0)


@pytest.mark.parametrize("fmt,block,act", [("e4m3", (128, 128), "none"),
                                            ("e2m1", (1, 32), "none"),
                                            ("e4m3", (128, 128), "e4m3")])
def test_linear_multiplies_the_dequantized_weight(fmt, block, act):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((192, 160)).astype(np.float32)  # stored [out, in]
    values, scale = bq.quantize_np(w, fmt, block)
    weight = bq.BlockQuantWeight(jnp.asarray(values), jnp.asarray(scale), fmt, block, act)
    x = rng.standard_normal((2, 3, 160)).astype(np.float32)
    xin = _act_quant_reference(x.reshape(6, 160)).reshape(x.shape) if act == "e4m3" else x
    want = xin.astype(np.float64) @ bq.dequantize_np(values, scale, fmt, block).T.astype(np.float64)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), weight))
    assert got.shape == (2, 3, 192)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_block_quant_linear_lowers_for_cuda():
    """GPU lowering without a GPU: the jitted product exports for CUDA."""
    from jax import export

    values, scale = bq.quantize_np(np.ones((256, 128), np.float32), "e2m1", (1, 32))
    weight = bq.BlockQuantWeight(jnp.asarray(values), jnp.asarray(scale), "e2m1", (1, 32), "e4m3")
    exported = export.export(jax.jit(linear), platforms=["cuda"])(
        jax.ShapeDtypeStruct((4, 128), jnp.bfloat16), weight)
    assert exported.platforms == ("cuda",)
    assert "f4E2M1FN" in exported.mlir_module() or "bitcast_convert" in exported.mlir_module()
