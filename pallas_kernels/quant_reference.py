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


def quantize_weight_grouped(w: jax.Array, group: int
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int8 per `group` consecutive input channels and output channel, with an offset.

    w [..., in, out] -> (q int8 [..., in, out], scale float16 [..., in / group, out],
    zero float16 [..., in / group, out]) with w ~= scale * q + zero per group. Of two
    grids, each group keeps the one with the smaller largest error:
    - asymmetric: 256 levels spanning the group's [min, max] (zero = min + 128 * (max -
      min) / 255 in float16, then scale = the smallest float16 reaching both ends from it);
      a group made of 4-bit levels (a Q4_1 or Q4_K GGUF: 16 equally spaced values per 32)
      lands on it to within float16 rounding, 255 / 15 = 17 int8 steps per 4-bit step;
    - symmetric: zero = 0, scale = max |w| / 127 in float16; a Q8_0 group (int8 times a
      float16 scale per 32) is kept exactly.
    Either way q never clips past half a step: |w - (scale * q + zero)| <= scale / 2."""
    w = w.astype(jnp.float32)
    k, n = w.shape[-2], w.shape[-1]
    g = w.reshape(w.shape[:-2] + (k // group, group, n))
    lo, hi = jnp.min(g, axis=-2), jnp.max(g, axis=-2)

    def grid(scale, zero):
        s, z = scale.astype(jnp.float32)[..., None, :], zero.astype(jnp.float32)[..., None, :]
        q = jnp.where(s > 0, jnp.round((g - z) / jnp.where(s > 0, s, 1.0)), 0.0)
        q = jnp.clip(q, -128, 127)
        return q, jnp.max(jnp.abs(q * s + z - g), axis=-2)

    zero = (lo + 128.0 * ((hi - lo) / 255.0)).astype(jnp.float16)
    z = zero.astype(jnp.float32)
    need = jnp.maximum((hi - z) / 127.0, (z - lo) / 128.0)
    scale = need.astype(jnp.float16)
    scale = jnp.where(scale.astype(jnp.float32) < need,
                      jnp.nextafter(scale, jnp.float16(jnp.inf)), scale)
    sym_scale = (jnp.maximum(jnp.abs(lo), jnp.abs(hi)) / 127.0).astype(jnp.float16)
    q_a, err_a = grid(scale, zero)
    q_s, err_s = grid(sym_scale, jnp.zeros_like(zero))
    use_sym = err_s < err_a
    q = jnp.where(use_sym[..., None, :], q_s, q_a).astype(jnp.int8).reshape(w.shape)
    return (q, jnp.where(use_sym, sym_scale, scale),
            jnp.where(use_sym, jnp.zeros_like(zero), zero))


def dequantize_weight_grouped(q: jax.Array, scale: jax.Array, zero: jax.Array,
                              dtype=jnp.float32) -> jax.Array:
    """scale * q + zero per group: q [..., in, out], scale and zero [..., in / group, out]."""
    k, n = q.shape[-2], q.shape[-1]
    groups = scale.shape[-2]
    g = q.astype(jnp.float32).reshape(q.shape[:-2] + (groups, k // groups, n))
    w = g * scale.astype(jnp.float32)[..., None, :] + zero.astype(jnp.float32)[..., None, :]
    return w.reshape(q.shape).astype(dtype)


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
