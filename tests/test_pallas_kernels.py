"""Pallas kernels (interpret mode) against the plain jnp references, and GPU/TPU lowering.

Kernel and reference follow the same rounding convention (f32 window sums;
mean and interpolation rounded to `precision`), so they differ only by the
f32 summation order: ~1e-7 relative in f32. In bf16, XLA may also keep
excess f32 precision between bf16 ops (differently in differently fused
code), so the mean, m - x, s (m - x) and y may each differ by about one bf16
ulp (2**-7 relative). With s (|m| + |x|) <= |y| + 3 |x| (from
y - x = s (m - x)), |dy| <= 2**-6 (|y| + 3 |x|) bounds that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from gsm_jax.pallas_kernels.reference import smooth_decode_reference, smooth_prefill_reference
from gsm_jax.pallas_kernels.smooth_decode import smooth_decode_pallas
from gsm_jax.pallas_kernels.smooth_prefill import smooth_prefill_pallas
from gsm_jax.smoothing import smooth_decode, smooth_prefill

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TRITON = "__gpu$xla.gpu.triton"
# Triton kernels are opaque to export's compatibility guarantee: say so explicitly.
GPU_EXPORT = dict(disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])

W = 12  # max_window; block_t 16 >= W, so windows cross T-block edges
BT, BC = 16, 16
T, C = 37, 40  # neither a multiple of its block


def ragged_positions(rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    pos = np.full((batch, seq), -1, np.int32)
    for b in range(batch):
        n = seq if b % 4 == 0 else int(rng.integers(0, seq + 1))
        off = 0 if b % 2 else seq - n  # alternate left / right padding
        pos[b, off : off + n] = np.arange(n)
    return pos


def assert_matches(got, want, x, precision_or_dtype_bf16: bool) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not precision_or_dtype_bf16:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return
    tol = 2.0**-6 * (np.abs(want) + 3 * np.abs(np.asarray(x, np.float64))) + 1e-6
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} elements off, max err {np.abs(got - want).max()}"


def prefill_case(seed: int, dtype: str):
    rng = np.random.default_rng(seed)
    batch = W + 1  # one row per window: 0 (adaptive), 1, ..., W
    x = jnp.asarray(rng.standard_normal((batch, T, C)).astype(DTYPES[dtype]))
    pos = jnp.asarray(ragged_positions(rng, batch, T))
    window = jnp.arange(batch, dtype=jnp.int32)
    strength = jnp.asarray(rng.choice([0.0, 0.1, 0.3, 1.0], batch), jnp.float32)
    return x, pos, window, strength


@pytest.mark.parametrize("protect_first", [0, 2])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_prefill_kernel_matches_reference(dtype, precision, protect_first):
    x, pos, window, strength = prefill_case(0, dtype)
    lo = jnp.int32(protect_first)
    kw = dict(max_window=W, precision=precision)
    got = smooth_prefill_pallas(
        x, pos, window, strength, lo, interpret=True, block_t=BT, block_c=BC, **kw
    )
    want = smooth_prefill_reference(x, pos, window, strength, lo, **kw)
    assert got.dtype == x.dtype
    assert_matches(got, want, x, "bf16" in (dtype, precision))
    untouched = (np.asarray(pos) < protect_first) | (np.asarray(strength) == 0)[:, None]
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(x)[untouched])


def test_prefill_kernel_adaptive_long_rows():
    """Adaptive windows only grow past 4 from position 79; several T-blocks."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 200, 24)).astype(np.float32))
    pos = jnp.asarray(np.stack([np.arange(200), np.r_[np.full(30, -1), np.arange(170)]]))
    args = (x, pos, jnp.zeros(2, jnp.int32), jnp.full(2, 0.5), jnp.int32(1))
    got = smooth_prefill_pallas(*args, max_window=16, precision="f32", interpret=True)
    want = smooth_prefill_reference(*args, max_window=16, precision="f32")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def decode_case(seed: int, dtype: str):
    rng = np.random.default_rng(seed)
    batch = W + 1
    x = jnp.asarray(rng.standard_normal((batch, C)).astype(DTYPES[dtype]))
    ring = jnp.asarray(rng.standard_normal((batch, W, C)).astype(DTYPES[dtype]))
    # inactive, protected, warming up (< W tokens), wrapped ring, far past W
    position = jnp.asarray(rng.choice([-1, 0, 1, 3, 7, 11, 12, 25, 300], batch), jnp.int32)
    position = position.at[0].set(-1).at[1].set(30)
    window = jnp.arange(batch, dtype=jnp.int32)  # 0 = adaptive, then 1..W
    strength = jnp.asarray(rng.choice([0.0, 0.1, 0.3, 1.0], batch), jnp.float32)
    return x, ring, position, window, strength


@pytest.mark.parametrize("protect_first", [0, 2])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_decode_kernel_matches_reference(dtype, precision, protect_first):
    x, ring, position, window, strength = decode_case(2, dtype)
    lo = jnp.int32(protect_first)
    y, new_ring = smooth_decode_pallas(
        x, ring, position, window, strength, lo, precision=precision, interpret=True, block_c=BC
    )
    y_ref, ring_ref = smooth_decode_reference(
        x, ring, position, window, strength, lo, precision=precision
    )
    assert_matches(y, y_ref, x, "bf16" in (dtype, precision))
    np.testing.assert_array_equal(new_ring, ring_ref)
    inactive = np.asarray(position) < 0
    np.testing.assert_array_equal(np.asarray(y)[inactive], np.asarray(x)[inactive])
    np.testing.assert_array_equal(np.asarray(new_ring)[inactive], np.asarray(ring)[inactive])


def test_decode_kernel_steps_match_prefill_kernel():
    """Token-by-token decode through the kernel equals one prefill pass."""
    rng = np.random.default_rng(3)
    n, prefix = 40, 9
    x = rng.standard_normal((3, n, C)).astype(np.float32)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (3, n))
    window, strength, lo = jnp.array([0, 5, W]), jnp.array([0.3, 0.2, 0.6]), jnp.int32(1)
    want = smooth_prefill_reference(x, pos, window, strength, lo, max_window=W, precision="f32")
    # ring after the prefix: positions q < prefix at slot q % W
    ring = np.zeros((3, W, C), np.float32)
    for q in range(max(0, prefix - W), prefix):
        ring[:, q % W] = x[:, q]
    step = jax.jit(
        functools.partial(smooth_decode_pallas, precision="f32", interpret=True, block_c=BC)
    )
    ring = jnp.asarray(ring)
    for q in range(prefix, n):
        y, ring = step(x[:, q], ring, jnp.full(3, q, jnp.int32), window, strength, lo)
        np.testing.assert_allclose(y, want[:, q], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- TPU (Mosaic) variant


def test_mosaic_variants_in_tpu_interpreter():
    """The Mosaic variants (SMEM scalars, unmasked edge blocks, whole-tile ring
    write) under the interpreter that mimics TPU semantics."""
    x, pos, window, strength = prefill_case(4, "f32")
    lo = jnp.int32(1)
    got = smooth_prefill_pallas(
        x,
        pos,
        window,
        strength,
        lo,
        max_window=W,
        precision="f32",
        backend="mosaic",
        interpret=pltpu.InterpretParams(),
    )
    want = smooth_prefill_reference(x, pos, window, strength, lo, max_window=W, precision="f32")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    x, ring, position, window, strength = decode_case(5, "f32")
    y, new_ring = smooth_decode_pallas(
        x,
        ring,
        position,
        window,
        strength,
        lo,
        precision="f32",
        backend="mosaic",
        interpret=pltpu.InterpretParams(),
        block_c=128,
    )
    y_ref, ring_ref = smooth_decode_reference(
        x, ring, position, window, strength, lo, precision="f32"
    )
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_ring, ring_ref)


# ------------------------------------------------------------------ lowering


def _specs(dtype, *, decode: bool, max_window: int = 64):
    sd = jax.ShapeDtypeStruct
    rows = (sd((4,), jnp.int32), sd((4,), jnp.float32), sd((), jnp.int32))
    if decode:
        return (sd((4, 200), dtype), sd((4, max_window, 200), dtype), sd((4,), jnp.int32), *rows)
    return (sd((4, 100, 200), dtype), sd((4, 100), jnp.int32), *rows)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_window", [10, 64])  # 10: not a power of two
def test_kernels_lower_for_cuda(dtype, max_window):
    prefill = functools.partial(smooth_prefill_pallas, max_window=max_window, precision="bf16")
    decode = functools.partial(smooth_decode_pallas, precision="bf16")
    for fn, decoding in ((prefill, False), (decode, True)):
        exp = export.export(jax.jit(fn), platforms=["cuda"], **GPU_EXPORT)(
            *_specs(dtype, decode=decoding, max_window=max_window)
        )
        text = exp.mlir_module()
        assert TRITON in text
    assert "output_operand_alias" in text  # the ring is updated in place


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_tpu(dtype):
    """Mosaic lowering of both kernels. Export runs JAX's lowering to the
    Mosaic dialect; the TPU compiler's own layout passes only run on a TPU,
    so this does not prove the kernels compile there."""
    prefill = functools.partial(
        smooth_prefill_pallas, max_window=64, precision="bf16", backend="mosaic"
    )
    decode = functools.partial(smooth_decode_pallas, precision="bf16", backend="mosaic")
    for fn, decoding in ((prefill, False), (decode, True)):
        exp = export.export(jax.jit(fn), platforms=["tpu"])(*_specs(dtype, decode=decoding))
        assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("platform, marker", [("cuda", TRITON), ("tpu", "tpu_custom_call")])
def test_auto_runtime_picks_the_kernels_on_accelerators(platform, marker):
    prefill = functools.partial(smooth_prefill, max_window=64, precision="bf16")
    decode = functools.partial(smooth_decode, precision="bf16")
    for fn, decoding in ((prefill, False), (decode, True)):
        exp = export.export(jax.jit(fn), platforms=[platform], **GPU_EXPORT)(
            *_specs(jnp.bfloat16, decode=decoding)
        )
        assert marker in exp.mlir_module()


def test_block_arguments_are_checked():
    x = jnp.zeros((1, 8, 16))
    pos = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="block_t"):
        smooth_prefill_pallas(x, pos, 1, 0.1, 0, max_window=64, precision="f32", block_t=32)
    with pytest.raises(ValueError, match="block_c"):
        smooth_prefill_pallas(x, pos, 1, 0.1, 0, max_window=8, precision="f32", block_c=100)
