"""Pallas kernel for one GSM decode step (GSM_SPEC.md section 3).

The ring buffer [B, W, C] (W = max_window) holds the RAW inputs: the input of
position q sits at slot q % W. For the new token at position n the kernel
averages x_n with the ring rows of positions start..n-1, writes x_n into slot
n % W in place (`input_output_aliases`), and returns the smoothed token.

Grid: (batch, C-blocks). On Triton every program reads only the `count - 1`
ring rows its window needs (a loop with a runtime trip count) and writes one
row, so decode cost follows the window, not W. The Mosaic (TPU) variant reads
the whole [W, block_c] tile instead: TPU does not copy an aliased output tile
in before the kernel, so it must write the tile back whole anyway, and a
vectorised masked sum avoids dynamic sublane indexing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .smooth_prefill import (
    combine,
    compute_dtype,
    smooth_mask,
    window_bounds,
)


def _decode_kernel(
    x_ref,
    ring_ref,
    pos_ref,
    win_ref,
    str_ref,
    lo_ref,
    y_ref,
    ring_out_ref,
    *,
    channels: int,
    block_c: int,
    max_window: int,
    precision: str,
    backend: str,
) -> None:
    W = max_window
    j = pl.program_id(1)
    row = 0 if backend == "triton" else pl.program_id(0)  # SMEM scalars: whole arrays
    n = pos_ref[row]
    window = win_ref[row]
    strength = str_ref[row]
    lo = jnp.maximum(lo_ref[0], 0)
    start, count = window_bounds(n, window, lo, W)
    mask = smooth_mask(n, count, strength, lo)
    slot = lax.rem(jnp.maximum(n, 0), W)
    col_ok = j * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1) < channels

    if backend == "triton":
        x = plt.load(x_ref, mask=col_ok, other=0)  # [1, block_c]

        def add_row(d, acc):
            # n - d >= start >= 0 inside the loop, so rem is a true modulo.
            r = plt.load(ring_ref.at[pl.ds(lax.rem(n - d, W), 1), :], mask=col_ok, other=0)
            return acc + r.astype(jnp.float32)

        steps = jnp.where(mask, count, 1)  # no reads at all for untouched rows
        total = lax.fori_loop(1, steps, add_row, x.astype(jnp.float32))
        y = combine(x, total, count, strength, mask, precision)
        plt.store(y_ref, y, mask=col_ok)

        @pl.when(n >= 0)
        def _():
            plt.store(ring_out_ref.at[pl.ds(slot, 1), :], x.astype(ring_out_ref.dtype), mask=col_ok)

    else:
        x = x_ref[...]
        ring = ring_ref[...]  # [W, block_c]
        k = lax.broadcasted_iota(jnp.int32, (W, 1), 0)
        # Slot k holds the most recent position q <= n with q % W == k
        # (n >= -1 and k < W keep the rem argument non-negative).
        q = n - lax.rem(n - k + W, W)
        take = (k != slot) & (q >= start) & mask
        ringf = jnp.where(take, ring.astype(jnp.float32), 0.0)
        total = x.astype(jnp.float32) + jnp.sum(ringf, axis=0, keepdims=True)
        y_ref[...] = combine(x, total, count, strength, mask, precision)
        new = (k == slot) & (n >= 0)
        ring_out_ref[...] = jnp.where(new, x.astype(ring.dtype), ring)


def smooth_decode_pallas(
    x: jax.Array,
    ring: jax.Array,
    position: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    precision: str,
    interpret: bool = False,
    block_c: int = 128,
    backend: str = "triton",
) -> tuple[jax.Array, jax.Array]:
    """One GSM decode step as a Pallas kernel.

    x [B, C]; ring [B, W, C] raw inputs (slot q % W); position [B] int32
    (-1 = inactive row: y = x, ring row unchanged); window [B] int32
    (0 = adaptive); strength [B] float32; protect_first int32 scalar.
    Returns (y [B, C], new_ring [B, W, C]); the ring is updated in place.
    """
    compute_dtype(precision)  # validates
    if backend not in ("triton", "mosaic"):
        raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")
    B, C = x.shape
    if ring.ndim != 3 or ring.shape[0] != B or ring.shape[2] != C:
        raise ValueError(f"ring shape {ring.shape} does not match x {x.shape}")
    if block_c & (block_c - 1) or block_c < 16:
        raise ValueError(f"block_c={block_c} must be a power of two >= 16")
    W = ring.shape[1]
    if backend == "mosaic" and C <= block_c:
        # A full-width block is always a legal TPU tile (and sidesteps padding
        # an aliased buffer, which the TPU interpreter mishandles).
        block_c = C

    position = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (B,))
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))
    lo = jnp.reshape(jnp.asarray(protect_first, jnp.int32), (1,))

    # x and y travel as [B, 1, C] so a block's last two dims are (1, block_c),
    # legal on both Triton and Mosaic.
    vec_spec = pl.BlockSpec((None, 1, block_c), lambda b, j: (b, 0, j))
    ring_spec = pl.BlockSpec((None, W, block_c), lambda b, j: (b, 0, j))
    if backend == "mosaic":
        from jax.experimental.pallas import tpu as pltpu

        row_spec = lo_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    else:
        row_spec = pl.BlockSpec((1,), lambda b, j: (b,))
        lo_spec = pl.BlockSpec((1,), lambda b, j: (0,))
        params = plt.CompilerParams(num_warps=1, num_stages=1)

    kernel = functools.partial(
        _decode_kernel,
        channels=C,
        block_c=block_c,
        max_window=W,
        precision=precision,
        backend=backend,
    )
    y, new_ring = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, 1, C), x.dtype),
            jax.ShapeDtypeStruct(ring.shape, ring.dtype),
        ),
        grid=(B, pl.cdiv(C, block_c)),
        in_specs=[vec_spec, ring_spec, row_spec, row_spec, row_spec, lo_spec],
        out_specs=(vec_spec, ring_spec),
        input_output_aliases={1: 1},
        compiler_params=None if interpret else params,
        interpret=interpret,
        name="gsm_smooth_decode",
    )(x[:, None, :], ring, position, window, strength, lo)
    return y[:, 0, :], new_ring
