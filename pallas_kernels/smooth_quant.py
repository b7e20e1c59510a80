"""Fused GSM filter + per-token int8 quantization ("quantize, then smooth").

At a W8A8 site (the input of o_proj / down_proj) the float activation is
smoothed along the token axis (GSM_SPEC.md section 3), then each token's absmax
over the channels gives its scale, then it is cast to int8. Separately that is
three passes over [B, T, C] (smooth writes y, the absmax reads it, the cast
reads it again and writes int8); the kernels here read x once from HBM and
write only int8 values and one scale per token.

Prefill kernel: grid (batch, T-blocks); a program owns `block_t` tokens and all
C channels, walked in chunks of `block_c`. Per chunk the window sums are the
prefill kernel's two banded 0/1 products (`smooth_prefill.py`: the window lies
in the program's T-block and the one before it). The per-token absmax needs
every channel before the first int8 can be written, so the chunks are walked
twice: the first sweep takes the absmax, the second recomputes the chunk (two
tiny [bt, bt] @ [bt, bc] products, and the chunk just left the L2) and stores
int8. That costs a few extra flops, never an extra HBM round trip of y.

Decode kernel: grid (batch,); one program per row walks the channel chunks
twice the same way, summing the ring rows of its window (as
`smooth_decode.py`), writes the raw x into the ring slot (in place, aliased)
and stores the row's int8 values and scale.

Both kernels share the filter arithmetic (`combine`, `window_bounds`,
`smooth_mask`) with the GSM kernels and the quantizer arithmetic
(`scale_from_absmax`, `quantize_with_scale`) with the jnp reference, so
they round the same way.

Backends: Triton (GPU; masked loads/stores; also what interpret mode runs on
CPU for tests). TPU runs the Mosaic GSM kernel followed by the XLA quantizer
(no fused Mosaic variant). `smooth_quantize_prefill` / `_decode_stacked` below
are the jittable runtime entry points with the same `impl` choices as
`gsm_jax.smoothing`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .quant_reference import QMAX, quantize_with_scale, scale_from_absmax
from .smooth_prefill import combine, compute_dtype, default_block_t, smooth_mask, window_bounds

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")


def _check_block(name: str, value: int) -> None:
    if value & (value - 1) or value < 16:
        raise ValueError(f"{name}={value} must be a power of two >= 16")


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(x_ref, xp_ref, pcol_ref, prow_ref, pprow_ref, win_ref, str_ref, lo_ref,
                    q_ref, s_ref, *, seq_len: int, channels: int, block_t: int, block_c: int,
                    max_window: int, precision: str) -> None:
    i = pl.program_id(1)
    t_col = i * block_t + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
    t_row = i * block_t + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
    rows_ok = t_col < seq_len
    pos = plt.load(pcol_ref, mask=rows_ok, other=-1)
    src = plt.load(prow_ref, mask=t_row < seq_len, other=-1)
    srcp = plt.load(pprow_ref, mask=jnp.broadcast_to(i > 0, (1, block_t)), other=-1)
    pos = jnp.where(rows_ok, pos, -1)
    src = jnp.where(t_row < seq_len, src, -1)
    srcp = jnp.where(i > 0, srcp, -1)
    window, strength = win_ref[0], str_ref[0]
    lo = jnp.maximum(lo_ref[0], 0)
    start, count = window_bounds(pos, window, lo, max_window)  # [bt, 1]
    mask = smooth_mask(pos, count, strength, lo)

    def band(src_pos):
        return ((src_pos >= start) & (src_pos <= pos)).astype(jnp.float32)

    band_cur, band_prev = band(src), band(srcp)
    hi = lax.Precision.HIGHEST
    n_chunks = pl.cdiv(channels, block_c)

    def chunk(j):
        cols = j * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
        col_ok = cols < channels
        ok = rows_ok & col_ok
        prev_ok = jnp.broadcast_to((i > 0) & col_ok, (block_t, block_c))
        x = plt.load(x_ref.at[:, pl.ds(j * block_c, block_c)], mask=ok, other=0)
        xp = plt.load(xp_ref.at[:, pl.ds(j * block_c, block_c)], mask=prev_ok, other=0)
        xf = jnp.where(ok, x.astype(jnp.float32), 0.0)
        xpf = jnp.where(prev_ok, xp.astype(jnp.float32), 0.0)
        total = jnp.dot(band_cur, xf, precision=hi, preferred_element_type=jnp.float32)
        total += jnp.dot(band_prev, xpf, precision=hi, preferred_element_type=jnp.float32)
        y = combine(x, total, count, strength, mask, precision)
        return jnp.where(ok, y.astype(jnp.float32), 0.0), ok

    def absmax_step(j, amax):
        y, _ = chunk(j)
        return jnp.maximum(amax, jnp.max(jnp.abs(y), axis=1, keepdims=True))

    amax = lax.fori_loop(0, n_chunks, absmax_step, jnp.zeros((block_t, 1), jnp.float32))
    scale = scale_from_absmax(amax)

    def store_step(j, carry):
        y, ok = chunk(j)
        plt.store(q_ref.at[:, pl.ds(j * block_c, block_c)], quantize_with_scale(y, scale),
                  mask=ok)
        return carry

    lax.fori_loop(0, n_chunks, store_step, 0)
    plt.store(s_ref, scale, mask=rows_ok)


def smooth_quantize_prefill_pallas(x, positions, window, strength, protect_first, *,
                                   max_window: int, precision: str, interpret: bool = False,
                                   block_c: int = 128, block_t: int | None = None):
    """Fused GSM prefill filter + per-token int8: x [B, T, C] -> (q int8 [B, T, C],
    scale float32 [B, T]). Arguments as `smooth_prefill_pallas`."""
    compute_dtype(precision)
    B, T, C = x.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions shape {positions.shape} != {(B, T)}")
    bt = default_block_t(max_window) if block_t is None else block_t
    if bt < max_window:
        raise ValueError(f"block_t={bt} must be >= max_window={max_window}")
    _check_block("block_t", bt)
    _check_block("block_c", block_c)
    c_block = max(block_c, pl.next_power_of_2(C))  # the program's whole channel range
    positions = positions.astype(jnp.int32)
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))
    lo = jnp.reshape(jnp.asarray(protect_first, jnp.int32), (1,))
    prev_t = lambda i: jnp.maximum(i - 1, 0)
    x_spec = pl.BlockSpec((None, bt, c_block), lambda b, i: (b, i, 0))
    xp_spec = pl.BlockSpec((None, bt, c_block), lambda b, i: (b, prev_t(i), 0))
    pcol_spec = pl.BlockSpec((None, bt, 1), lambda b, i: (b, i, 0))
    prow_spec = pl.BlockSpec((None, 1, bt), lambda b, i: (b, 0, i))
    pprow_spec = pl.BlockSpec((None, 1, bt), lambda b, i: (b, 0, prev_t(i)))
    row_spec = pl.BlockSpec((1,), lambda b, i: (b,))
    lo_spec = pl.BlockSpec((1,), lambda b, i: (0,))
    kernel = functools.partial(_prefill_kernel, seq_len=T, channels=C, block_t=bt,
                               block_c=block_c, max_window=max_window, precision=precision)
    q, s = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, C), jnp.int8),
                   jax.ShapeDtypeStruct((B, T, 1), jnp.float32)),
        grid=(B, pl.cdiv(T, bt)),
        in_specs=[x_spec, xp_spec, pcol_spec, prow_spec, pprow_spec, row_spec, row_spec, lo_spec],
        out_specs=(x_spec, pcol_spec),
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gsm_smooth_quantize_prefill",
    )(x, x, positions[:, :, None], positions[:, None, :], positions[:, None, :], window,
      strength, lo)
    return q, s[..., 0]


# ----------------------------------------------------------------------------- decode


def _decode_kernel(x_ref, ring_ref, pos_ref, win_ref, str_ref, lo_ref, q_ref, s_ref,
                   ring_out_ref, *, channels: int, block_c: int, max_window: int,
                   precision: str) -> None:
    W = max_window
    n = pos_ref[0]
    window, strength = win_ref[0], str_ref[0]
    lo = jnp.maximum(lo_ref[0], 0)
    start, count = window_bounds(n, window, lo, W)
    mask = smooth_mask(n, count, strength, lo)
    slot = lax.rem(jnp.maximum(n, 0), W)
    steps = jnp.where(mask, count, 1)  # no ring reads for untouched rows
    n_chunks = pl.cdiv(channels, block_c)

    def chunk(j, write_ring: bool):
        c0 = j * block_c
        col_ok = c0 + lax.broadcasted_iota(jnp.int32, (1, block_c), 1) < channels
        x = plt.load(x_ref.at[:, pl.ds(c0, block_c)], mask=col_ok, other=0)  # [1, bc]

        def add_row(d, acc):
            # n - d >= start >= 0 inside the loop, so rem is a true modulo
            r = plt.load(ring_ref.at[pl.ds(lax.rem(n - d, W), 1), pl.ds(c0, block_c)],
                         mask=col_ok, other=0)
            return acc + r.astype(jnp.float32)

        total = lax.fori_loop(1, steps, add_row, x.astype(jnp.float32))
        y = combine(x, total, count, strength, mask, precision)
        if write_ring:
            @pl.when(n >= 0)
            def _():
                plt.store(ring_out_ref.at[pl.ds(slot, 1), pl.ds(c0, block_c)],
                          x.astype(ring_out_ref.dtype), mask=col_ok)
        return jnp.where(col_ok, y.astype(jnp.float32), 0.0), col_ok

    def absmax_step(j, amax):
        y, _ = chunk(j, write_ring=False)
        return jnp.maximum(amax, jnp.max(jnp.abs(y), axis=1, keepdims=True))

    amax = lax.fori_loop(0, n_chunks, absmax_step, jnp.zeros((1, 1), jnp.float32))
    scale = scale_from_absmax(amax)

    def store_step(j, carry):
        # The raw x goes into the ring in this sweep: every read of this row's
        # window (d >= 1, slot != n % W) is done by then or touches other slots.
        y, ok = chunk(j, write_ring=True)
        plt.store(q_ref.at[:, pl.ds(j * block_c, block_c)], quantize_with_scale(y, scale),
                  mask=ok)
        return carry

    lax.fori_loop(0, n_chunks, store_step, 0)
    plt.store(s_ref, scale)


def smooth_quantize_decode_pallas(x, ring, position, window, strength, protect_first, *,
                                  precision: str, interpret: bool = False, block_c: int = 128):
    """Fused GSM decode step + per-token int8: x [B, C], ring [B, W, C] ->
    (q int8 [B, C], scale float32 [B], new ring). position -1 = inactive row (the
    ring row is left alone; its output is x quantized). Arguments as
    `smooth_decode_pallas`; the ring is updated in place."""
    compute_dtype(precision)
    _check_block("block_c", block_c)
    B, C = x.shape
    if ring.ndim != 3 or ring.shape[0] != B or ring.shape[2] != C:
        raise ValueError(f"ring shape {ring.shape} does not match x {x.shape}")
    W = ring.shape[1]
    c_block = max(block_c, pl.next_power_of_2(C))
    position = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (B,))
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))
    lo = jnp.reshape(jnp.asarray(protect_first, jnp.int32), (1,))
    vec_spec = pl.BlockSpec((None, 1, c_block), lambda b: (b, 0, 0))
    ring_spec = pl.BlockSpec((None, W, c_block), lambda b: (b, 0, 0))
    row_spec = pl.BlockSpec((1,), lambda b: (b,))
    lo_spec = pl.BlockSpec((1,), lambda b: (0,))
    s_spec = pl.BlockSpec((None, 1, 1), lambda b: (b, 0, 0))
    kernel = functools.partial(_decode_kernel, channels=C, block_c=block_c, max_window=W,
                               precision=precision)
    q, s, new_ring = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, 1, C), jnp.int8),
                   jax.ShapeDtypeStruct((B, 1, 1), jnp.float32),
                   jax.ShapeDtypeStruct(ring.shape, ring.dtype)),
        grid=(B,),
        in_specs=[vec_spec, ring_spec, row_spec, row_spec, row_spec, lo_spec],
        out_specs=(vec_spec, s_spec, ring_spec),
        input_output_aliases={1: 2},
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gsm_smooth_quantize_decode",
    )(x[:, None, :], ring, position, window, strength, lo)
    return q[:, 0, :], s[:, 0, 0], new_ring


# ----------------------------------------------------------------------------- runtime


__all__ = [
    "IMPLS",
    "QMAX",
    "smooth_quantize_decode_pallas",
    "smooth_quantize_prefill_pallas",
]
