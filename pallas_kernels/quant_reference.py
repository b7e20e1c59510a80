"""INT8 quantization arithmetic in plain jnp: the reference every fast path must match.

Symmetric int8 with the range [-127, 127] (-128 is never produced, so negation is
exact and the grid is symmetric):

    scale = absmax / 127   (1 where absmax == 0, so all-zero rows stay zero)
    q     = clip(round_half_even(x / scale), -127, 127)
    x    ~= q * scale,     |x - q * scale| <= scale / 2

- weights: one scale per output channel (`quantize_weight`: the absmax runs over
  the input axis of a [..., in, out] weight);
- activations: one scale per token (`quantize_rows`: the absmax runs over the
  channel axis, dynamically, at run time).

The arithmetic is float32 whatever the input dtype. The model's XLA path calls
these very functions (`models/linear.py`), and the fused Pallas kernel
(`smooth_quant.py`) rounds the same way, so the three agree bitwise on the same
float input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

QMAX = 127


def scale_from_absmax(absmax: jax.Array) -> jax.Array:
    """absmax / 127 in float32; 1 where absmax is 0 (an all-zero row quantizes to 0)."""
    absmax = absmax.astype(jnp.float32)
    return jnp.where(absmax > 0, absmax / QMAX, 1.0).astype(jnp.float32)


def round_half_even(v: jax.Array) -> jax.Array:
    """Round to nearest, ties to even (= jnp.round) from floor and selects only, so the
    Triton kernels (which have no `round` primitive) round exactly like the XLA path.
    Exact for every finite float32: v - floor(v) is exact below 2**23, and above it
    v is already an integer (d = 0)."""
    f = jnp.floor(v)
    d = v - f
    odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return jnp.where(up, f + 1.0, f)


def quantize_with_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
    """round(x / scale) clipped to [-127, 127], as int8 (`scale` broadcasts against x)."""
    q = round_half_even(x.astype(jnp.float32) / scale)
    return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token (last-axis) dynamic symmetric int8.

    x [..., C] -> (q int8 [..., C], scale float32 [...]).
    """
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = scale_from_absmax(absmax)
    return quantize_with_scale(x, scale[..., None]), scale


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-output-channel symmetric int8.

    w [..., in, out] -> (q int8 [..., in, out], scale float32 [..., out]).
    """
    absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-2)
    scale = scale_from_absmax(absmax)
    return quantize_with_scale(w, scale[..., None, :]), scale


def dequantize_rows(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def dequantize_weight(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale[..., None, :]).astype(dtype)


def int8_dot(xq: jax.Array, wq: jax.Array) -> jax.Array:
    """Exact integer product xq [..., K] @ wq [K, N] -> int32 [..., N] (int8 x int8 -> int32)."""
    return lax.dot_general(xq, wq, (((xq.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=jnp.int32)


def w8a8_matmul_reference(x: jax.Array, wq: jax.Array, w_scale: jax.Array) -> jax.Array:
    """W8A8: quantize x per token, integer product, rescale by both scales (float32)."""
    xq, xs = quantize_rows(x)
    acc = int8_dot(xq, wq)
    return acc.astype(jnp.float32) * xs[..., None] * w_scale


def smooth_quantize_prefill_reference(x, positions, window, strength, protect_first, *,
                                      max_window: int, precision: str):
    """The fused kernel's meaning: the GSM filter (jnp reference), then `quantize_rows`."""
    from gsm_jax.pallas_kernels.reference import smooth_prefill_reference

    y = smooth_prefill_reference(x, positions, window, strength, protect_first,
                                 max_window=max_window, precision=precision)
    return quantize_rows(y)


def smooth_quantize_decode_reference(x, ring, position, window, strength, protect_first, *,
                                     precision: str):
    """One decode step of the filter (jnp reference), then `quantize_rows`; also the new ring."""
    from gsm_jax.pallas_kernels.reference import smooth_decode_reference

    y, new_ring = smooth_decode_reference(x, ring, position, window, strength, protect_first,
                                          precision=precision)
    q, s = quantize_rows(y)
    return q, s, new_ring
