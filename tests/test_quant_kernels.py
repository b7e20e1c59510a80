"""The fused smooth + per-token int8 kernels (interpret mode) against smooth() followed by the
reference quantizer, the runtime dispatch, and CUDA lowering via jax.export."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from gsm_jax.pallas_kernels.quant_reference import (
    quantize_rows,
    smooth_quantize_decode_reference,
    smooth_quantize_prefill_reference,
)
from gsm_jax.pallas_kernels.smooth_decode import smooth_decode_pallas
from gsm_jax.pallas_kernels.smooth_prefill import smooth_prefill_pallas
from gsm_jax.pallas_kernels.smooth_quant import (
    smooth_quantize_decode_pallas,
    smooth_quantize_prefill_pallas,
)
from gsm_jax.smoothing import (
    ring_from_prefill,
    smooth,
    smooth_decode_stacked,
    smooth_prefill,
    smooth_quantize_decode_stacked,
    smooth_quantize_prefill,
)

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TRITON = "__gpu$xla.gpu.triton"
GPU_EXPORT = dict(disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])
W = 12  # max_window: block_t 16 >= W, windows cross T-block edges
T, C = 37, 40  # neither a multiple of its block
BC = 16  # 3 channel chunks, the last one ragged

# the fused kernels equal the unfused ones bit for bit under the compiler users run
# (at -O0, some scales differ in their last ulp: the two programs are compiled differently)
pytestmark = pytest.mark.usefixtures("full_xla_optimization")


def ragged_positions(rng, batch: int, seq: int) -> np.ndarray:
    pos = np.full((batch, seq), -1, np.int32)
    for b in range(batch):
        n = seq if b % 4 == 0 else int(rng.integers(0, seq + 1))
        off = 0 if b % 2 else seq - n
        pos[b, off: off + n] = np.arange(n)
    return pos


def prefill_case(seed: int, dtype: str):
    rng = np.random.default_rng(seed)
    batch = 6
    x = rng.standard_normal((batch, T, C)).astype(np.float32)
    x[:, :, 3] *= 25.0  # an outlier channel sets each token's scale
    x[:, 0] *= 10.0  # and a massive first token
    pos = ragged_positions(rng, batch, T)
    window = np.array([0, 1, 3, 8, 12, 5], np.int32)
    strength = np.array([0.3, 0.1, 0.0, 1.0, 0.2, 0.3], np.float32)
    return jnp.asarray(x.astype(DTYPES[dtype])), jnp.asarray(pos), jnp.asarray(window), \
        jnp.asarray(strength)


def assert_q_close(q, s, q_ref, s_ref, *, max_step: int = 1, max_share: float = 0.01,
                   bf16: bool = False):
    """Same scales (to f32 rounding), int8 values equal but for rare one-step flips at a
    rounding boundary (the window sums differ from the reference's in summation order).
    In bf16 arithmetic y itself may differ by one bf16 ulp (see test_pallas_kernels), so
    the scale may differ by 2**-7 and flips are more frequent."""
    if bf16:
        max_share = max(max_share, 0.25)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=2.0**-6 if bf16 else 2e-6,
                               atol=0)
    d = np.abs(np.asarray(q, np.int32) - np.asarray(q_ref, np.int32))
    assert d.max() <= max_step
    assert (d > 0).mean() <= max_share


@pytest.mark.parametrize("protect_first", [0, 2])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_prefill_equals_smooth_then_reference_quantizer(dtype, precision, protect_first):
    x, pos, window, strength = prefill_case(0, dtype)
    args = (x, pos, window, strength, jnp.int32(protect_first))
    q, s = smooth_quantize_prefill_pallas(*args, max_window=W, precision=precision,
                                          interpret=True, block_c=BC)
    assert q.dtype == jnp.int8 and q.shape == x.shape and s.shape == x.shape[:2]
    # bitwise: the unfused GSM kernel (same window-sum arithmetic), then the quantizer
    y_kernel = smooth_prefill_pallas(*args, max_window=W, precision=precision, interpret=True,
                                     block_c=BC)
    q_k, s_k = quantize_rows(y_kernel)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_k))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_k))
    # the XLA runtime path and the plain jnp reference: equal up to summation order
    y_xla = smooth_prefill(*args, max_window=W, precision=precision, impl="xla")
    assert_q_close(q, s, *quantize_rows(y_xla), bf16="bf16" in (precision, dtype))
    q_r, s_r = smooth_quantize_prefill_reference(*args, max_window=W, precision=precision)
    if precision == "f32" and dtype == "f32":
        assert_q_close(q, s, q_r, s_r)


def test_fused_prefill_equals_public_smooth():
    """The issue's wording: fused kernel == smooth() followed by the reference quantizer."""
    x, _, _, _ = prefill_case(1, "f32")
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), (x.shape[0], 1))
    y = smooth(x, pos, window=8, strength=0.25, max_window=W, protect_first=1, precision="f32")
    q, s = smooth_quantize_prefill_pallas(x, pos, 8, 0.25, 1, max_window=W, precision="f32",
                                          interpret=True, block_c=BC)
    assert_q_close(q, s, *quantize_rows(y))


def test_strength_zero_is_the_plain_quantizer():
    x, pos, window, _ = prefill_case(2, "f32")
    q, s = smooth_quantize_prefill_pallas(x, pos, window, 0.0, 0, max_window=W, precision="bf16",
                                          interpret=True, block_c=BC)
    q0, s0 = quantize_rows(x)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q0))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


def decode_case(seed: int, dtype: str, batch: int = 5):
    rng = np.random.default_rng(seed)
    hist = rng.standard_normal((batch, 30, C)).astype(np.float32)
    hist[..., 5] *= 30.0
    hist = jnp.asarray(hist.astype(DTYPES[dtype]))
    lengths = np.array([30, 3, 17, 0, 12][:batch], np.int32)
    pos = np.where(np.arange(30)[None] < lengths[:, None], np.arange(30)[None], -1)
    ring = ring_from_prefill(hist, jnp.asarray(pos, jnp.int32), W)
    x = rng.standard_normal((batch, C)).astype(np.float32)
    x[:, 5] *= 30.0
    return jnp.asarray(x.astype(DTYPES[dtype])), ring, jnp.asarray(lengths)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_decode_equals_smooth_then_reference_quantizer(dtype, precision):
    x, ring, position = decode_case(3, dtype)
    position = position.at[3].set(-1)  # an inactive row
    window = jnp.array([8, 0, 12, 4, 2], jnp.int32)
    strength = jnp.array([0.3, 0.2, 1.0, 0.3, 0.0], jnp.float32)
    args = (x, ring, position, window, strength, jnp.int32(1))
    q, s, new_ring = smooth_quantize_decode_pallas(*args, precision=precision, interpret=True,
                                                   block_c=BC)
    y_k, ring_k = smooth_decode_pallas(*args, precision=precision, interpret=True, block_c=BC)
    q_k, s_k = quantize_rows(y_k)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_k))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_k))
    np.testing.assert_array_equal(np.asarray(new_ring), np.asarray(ring_k))
    q_r, s_r, ring_r = smooth_quantize_decode_reference(*args, precision=precision)
    np.testing.assert_array_equal(np.asarray(new_ring), np.asarray(ring_r))
    assert_q_close(q, s, q_r, s_r, bf16="bf16" in (precision, dtype))


def test_fused_decode_steps_match_fused_prefill():
    """Token-by-token decode through the fused decode kernel == one fused prefill."""
    rng = np.random.default_rng(4)
    n = 20
    x = rng.standard_normal((2, n, C)).astype(np.float32)
    x[..., 7] *= 20
    x = jnp.asarray(x)
    pos = jnp.tile(jnp.arange(n, dtype=jnp.int32), (2, 1))
    window, strength, lo = jnp.array([6, 0], jnp.int32), jnp.array([0.3, 0.2]), jnp.int32(1)
    q_all, s_all = smooth_quantize_prefill_pallas(x, pos, window, strength, lo, max_window=W,
                                                  precision="f32", interpret=True, block_c=BC)
    ring = jnp.zeros((2, W, C), jnp.float32)
    for t in range(n):
        q, s, ring = smooth_quantize_decode_pallas(x[:, t], ring, jnp.full((2,), t), window,
                                                   strength, lo, precision="f32",
                                                   interpret=True, block_c=BC)
        assert_q_close(q, s, q_all[:, t], s_all[:, t], max_share=0.05)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret", "auto"])
def test_runtime_dispatch(impl):
    x, pos, window, strength = prefill_case(5, "f32")
    args = (x, pos, window, strength, jnp.int32(1))
    q, s = jax.jit(functools.partial(smooth_quantize_prefill, max_window=W, precision="f32",
                                     impl=impl))(*args)
    assert_q_close(q, s, *quantize_rows(smooth_prefill(*args, max_window=W, precision="f32",
                                                       impl="xla")))
    # the stacked decode form used by the model: layer 1 of 3, rows 0 and 2 active
    xd, ring, position = decode_case(6, "f32", batch=3)
    rings = jnp.stack([ring * 0.5, ring, ring * 2.0])
    active = jnp.array([True, False, True])
    dargs = (xd, rings, jnp.int32(1), position, active, jnp.array([8, 8, 3], jnp.int32),
             jnp.array([0.3, 0.3, 0.1], jnp.float32), jnp.int32(0))
    qd, sd, new_rings = smooth_quantize_decode_stacked(*dargs, precision="f32", impl=impl)
    y, rings_ref = smooth_decode_stacked(*dargs, precision="f32", impl="xla")
    assert_q_close(qd, sd, *quantize_rows(y), max_share=0.05)
    # active rows write their slot; other layers untouched
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(new_rings[1, b]), np.asarray(rings_ref[1, b]))
    np.testing.assert_array_equal(np.asarray(new_rings[0]), np.asarray(rings[0]))
    np.testing.assert_array_equal(np.asarray(new_rings[2]), np.asarray(rings[2]))


def _specs(dtype, *, decode: bool, max_window: int = 64):
    sd = jax.ShapeDtypeStruct
    rows = (sd((4,), jnp.int32), sd((4,), jnp.float32), sd((), jnp.int32))
    if decode:
        return (sd((4, 1536), dtype), sd((4, max_window, 1536), dtype), sd((4,), jnp.int32),
                *rows)
    return (sd((4, 100, 576), dtype), sd((4, 100), jnp.int32), *rows)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_window", [10, 64])
def test_fused_kernels_lower_for_cuda(dtype, max_window):
    prefill = functools.partial(smooth_quantize_prefill_pallas, max_window=max_window,
                                precision="bf16")
    decode = functools.partial(smooth_quantize_decode_pallas, precision="bf16")
    for fn, decoding in ((prefill, False), (decode, True)):
        exp = export.export(jax.jit(fn), platforms=["cuda"], **GPU_EXPORT)(
            *_specs(dtype, decode=decoding, max_window=max_window))
        text = exp.mlir_module()
        assert TRITON in text
        assert any(str(a.dtype) == "int8" for a in exp.out_avals)
    assert "output_operand_alias" in text  # the ring is updated in place


def test_auto_runtime_picks_the_fused_kernel_on_cuda():
    prefill = functools.partial(smooth_quantize_prefill, max_window=64, precision="bf16")
    exp = export.export(jax.jit(prefill), platforms=["cuda"], **GPU_EXPORT)(
        *_specs(jnp.bfloat16, decode=False))
    assert "gsm_smooth_quantize_prefill" in exp.mlir_module()
    sd = jax.ShapeDtypeStruct
    decode = functools.partial(smooth_quantize_decode_stacked, precision="bf16")
    exp = export.export(jax.jit(decode), platforms=["cuda"], **GPU_EXPORT)(
        sd((4, 1536), jnp.bfloat16), sd((3, 4, 64, 1536), jnp.bfloat16), sd((), jnp.int32),
        sd((4,), jnp.int32), sd((4,), jnp.bool_), sd((4,), jnp.int32), sd((4,), jnp.float32),
        sd((), jnp.int32))
    assert "gsm_smooth_quantize_decode" in exp.mlir_module()


def test_block_arguments_are_checked():
    x = jnp.zeros((1, 8, 16))
    pos = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="block_t"):
        smooth_quantize_prefill_pallas(x, pos, 1, 0.1, 0, max_window=64, precision="f32",
                                       block_t=32)
    with pytest.raises(ValueError, match="block_c"):
        smooth_quantize_prefill_pallas(x, pos, 1, 0.1, 0, max_window=8, precision="f32",
                                       block_c=100)
    with pytest.raises(ValueError, match="impl"):
        smooth_quantize_prefill(x, pos, 1, 0.1, 0, max_window=8, precision="f32", impl="cuda")
