"""Plain jnp references for the GSM filter (GSM_SPEC.md section 3).

Written for obviousness, not speed: an explicit loop over window offsets and
position masks, sharing no code with the kernels so that a bug in the shared
kernel arithmetic cannot hide. Rounding convention (same as the kernels): the
window sum is accumulated in f32, the mean and the interpolation
y = x + s * (mean - x) are rounded to `precision`, and y is cast to x.dtype.
Tokens that are not smoothed (padding, protected, strength 0, one-token
window) are returned bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _window_of(pos: jax.Array, window: jax.Array, max_window: int) -> jax.Array:
    adaptive = jnp.minimum(jnp.maximum((pos + 1) // 16, 4), max_window)
    fixed = jnp.minimum(jnp.maximum(window, 1), max_window)
    return jnp.where(window > 0, fixed, adaptive)


def _finish(x, total, count, strength, smoothed, precision):
    cd = _DTYPES[precision]
    mean = (total / jnp.maximum(count, 1).astype(jnp.float32)).astype(cd)
    xc = x.astype(cd)
    y = (xc + strength.astype(cd) * (mean - xc)).astype(x.dtype)
    return jnp.where(smoothed, y, x)


def smooth_prefill_reference(
    x: jax.Array,
    positions: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    max_window: int,
    precision: str,
) -> jax.Array:
    """y[b, t] from x[b, t - d] for d = 0..max_window-1, chosen by position."""
    B, T, _ = x.shape
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))[:, None]
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))[:, None, None]
    lo = jnp.maximum(jnp.asarray(protect_first, jnp.int32), 0)
    pos = positions.astype(jnp.int32)
    start = jnp.maximum(lo, pos - _window_of(pos, window, max_window) + 1)

    total = jnp.zeros(x.shape, jnp.float32)
    count = jnp.zeros(pos.shape, jnp.int32)
    for d in range(min(max_window, T)):
        src_x = jnp.pad(x, ((0, 0), (d, 0), (0, 0)))[:, :T]
        src_pos = jnp.pad(pos, ((0, 0), (d, 0)), constant_values=-1)[:, :T]
        take = (src_pos >= 0) & (src_pos >= start) & (src_pos <= pos) & (pos >= lo)
        total = total + jnp.where(take[..., None], src_x.astype(jnp.float32), 0.0)
        count = count + take
    smoothed = (pos >= lo) & (count > 1) & (strength[..., 0] != 0)
    return _finish(x, total, count[..., None], strength, smoothed[..., None], precision)


def smooth_decode_reference(
    x: jax.Array,
    ring: jax.Array,
    position: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    precision: str,
) -> tuple[jax.Array, jax.Array]:
    """One decode step: write x into slot n % W, average positions start..n."""
    B, W, _ = ring.shape
    n = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (B,))
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))[:, None]
    lo = jnp.maximum(jnp.asarray(protect_first, jnp.int32), 0)
    active = n >= 0

    slot_of_n = jnp.where(active, n, 0) % W
    new_ring = jnp.where(
        (active[:, None] & (jnp.arange(W)[None, :] == slot_of_n[:, None]))[..., None],
        x[:, None, :].astype(ring.dtype),
        ring,
    )
    start = jnp.maximum(lo, n - _window_of(n, window, W) + 1)
    total = jnp.zeros(x.shape, jnp.float32)
    count = jnp.zeros((B,), jnp.int32)
    for d in range(W):
        q = n - d  # the position d steps back, stored in slot q % W
        row = x if d == 0 else new_ring[jnp.arange(B), jnp.where(q >= 0, q, 0) % W]
        take = active & (q >= 0) & (q >= start)
        total = total + jnp.where(take[:, None], row.astype(jnp.float32), 0.0)
        count = count + take
    smoothed = active & (n >= lo) & (count > 1) & (strength[:, 0] != 0)
    y = _finish(x, total, count[:, None], strength, smoothed[:, None], precision)
    return y, new_ring
