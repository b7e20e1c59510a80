"""Pallas kernel for the GSM prefill filter (GSM_SPEC.md section 3).

One program handles one sequence, `block_t` tokens and `block_c` channels.
The causal window of a token reaches at most `max_window - 1` tokens back, so
with `block_t >= max_window` it lies inside the program's own T-block and the
one before it. The kernel loads both blocks and forms the window sums as two
banded 0/1 matrix products, `A_prev @ x_prev + A_cur @ x_cur`. Why a matmul:
Triton has no shifts of register tensors, the 0/1 weights make the products
exact selections (f32 "ieee" precision, no TF32), and the rounding error is
that of summing at most `max_window` terms whatever T is (a cumulative sum
over T would lose accuracy as T grows).

The helpers at the top are the filter's shared arithmetic; the XLA path and
the decode kernel use them too, so every implementation rounds the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

PRECISIONS = ("f32", "bf16")


def compute_dtype(precision: str) -> jnp.dtype:
    """The dtype of the filter's elementwise arithmetic for `precision`."""
    if precision == "f32":
        return jnp.dtype(jnp.float32)
    if precision == "bf16":
        return jnp.dtype(jnp.bfloat16)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def effective_window(pos: jax.Array, window: jax.Array, max_window: int) -> jax.Array:
    """w_p: the row's fixed window (window > 0) or clamp((p+1)//16, 4, max_window)."""
    # jnp.clip is minimum(maximum(.)), so max_window < 4 wins over the floor of 4.
    adaptive = jnp.clip(lax.div(jnp.maximum(pos + 1, 0), 16), 4, max_window)
    fixed = jnp.clip(window, 1, max_window)
    return jnp.where(window > 0, fixed, adaptive)


def window_bounds(
    pos: jax.Array, window: jax.Array, protect_first: jax.Array, max_window: int
) -> tuple[jax.Array, jax.Array]:
    """(start, count) of the causal window of position `pos`.

    count >= 1 exactly when pos >= protect_first; otherwise it is clamped to 1
    so no division by zero appears even in lanes that are later discarded.
    """
    w = effective_window(pos, window, max_window)
    start = jnp.maximum(protect_first, pos - w + 1)
    return start, jnp.maximum(pos - start + 1, 1)


def smooth_mask(
    pos: jax.Array, count: jax.Array, strength: jax.Array, protect_first: jax.Array
) -> jax.Array:
    """Tokens whose output differs from x. Everything else returns x bitwise:
    padding (pos < 0 <= protect_first), protected tokens, strength 0, and a
    one-token window (the mean is x itself)."""
    return (pos >= protect_first) & (count > 1) & (strength != 0)


def combine(
    x: jax.Array,
    total: jax.Array,
    count: jax.Array,
    strength: jax.Array,
    mask: jax.Array,
    precision: str,
) -> jax.Array:
    """y = x + s * (mean - x) in `precision`, cast to x.dtype; x where ~mask.

    `total` is the f32 window sum. Sums are always accumulated in f32 (as a
    bf16 matmul accumulates in f32); `precision` governs the rounding of the
    mean and of the interpolation. A select, not arithmetic, keeps the
    untouched tokens bit-identical.
    """
    cd = compute_dtype(precision)
    mean = (total / count.astype(jnp.float32)).astype(cd)
    xc = x.astype(cd)
    y = (xc + strength.astype(cd) * (mean - xc)).astype(x.dtype)
    return jnp.where(mask, y, x)


def default_block_t(max_window: int) -> int:
    """The smallest legal T-block: a power of two (Triton), >= 16 (tl.dot),
    and >= max_window so a window spans at most two blocks."""
    return max(16, pl.next_power_of_2(max_window))


def _prefill_kernel(
    x_ref,
    xp_ref,
    pcol_ref,
    prow_ref,
    pprow_ref,
    win_ref,
    str_ref,
    lo_ref,
    o_ref,
    *,
    seq_len: int,
    channels: int,
    block_t: int,
    block_c: int,
    max_window: int,
    precision: str,
    backend: str,
) -> None:
    i = pl.program_id(1)
    j = pl.program_id(2)
    # Positions come twice, as a column (the tokens being smoothed) and as a
    # row (the window's source tokens), so the band mask needs no transpose.
    t_col = i * block_t + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
    t_row = i * block_t + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
    c_row = j * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
    col_ok = c_row < channels
    cur_mask = (t_col < seq_len) & col_ok
    # For i == 0 the index map clamps block i-1 to block 0: ignore it then.
    prev_mask = jnp.broadcast_to((i > 0) & col_ok, (block_t, block_c))

    if backend == "triton":  # explicit masks for ragged edge blocks
        x = plt.load(x_ref, mask=cur_mask, other=0)
        xp = plt.load(xp_ref, mask=prev_mask, other=0)
        pos = plt.load(pcol_ref, mask=t_col < seq_len, other=-1)
        src = plt.load(prow_ref, mask=t_row < seq_len, other=-1)
        srcp = plt.load(pprow_ref, mask=jnp.broadcast_to(i > 0, (1, block_t)), other=-1)
        row = 0
    else:  # Mosaic pads edge blocks itself; the padding is sanitised below.
        x, xp, pos, src, srcp = (r[...] for r in (x_ref, xp_ref, pcol_ref, prow_ref, pprow_ref))
        row = pl.program_id(0)  # per-row scalars are whole arrays in SMEM
    pos = jnp.where(t_col < seq_len, pos, -1)
    src = jnp.where(t_row < seq_len, src, -1)
    srcp = jnp.where(i > 0, srcp, -1)
    window = win_ref[row]
    strength = str_ref[row]
    lo = jnp.maximum(lo_ref[0], 0)

    start, count = window_bounds(pos, window, lo, max_window)  # [bt, 1]

    def band(src_pos: jax.Array) -> jax.Array:
        # A[t, k] = 1 when source token k lies in token t's window. Positions,
        # not indices, decide, so padding can never enter a window.
        return ((src_pos >= start) & (src_pos <= pos)).astype(jnp.float32)

    # Padding lanes may hold garbage (NaN in interpret mode): zero them, since
    # 0 * NaN would poison the product.
    xf = jnp.where(cur_mask, x.astype(jnp.float32), 0.0)
    xpf = jnp.where(prev_mask, xp.astype(jnp.float32), 0.0)
    hi = lax.Precision.HIGHEST  # "ieee" on Triton: TF32 would round x to 10 bits
    total = jnp.dot(band(src), xf, precision=hi, preferred_element_type=jnp.float32)
    total += jnp.dot(band(srcp), xpf, precision=hi, preferred_element_type=jnp.float32)

    mask = smooth_mask(pos, count, strength, lo)
    y = combine(x, total, count, strength, mask, precision)
    if backend == "triton":
        plt.store(o_ref, y, mask=cur_mask)
    else:
        o_ref[...] = y


def smooth_prefill_pallas(
    x: jax.Array,
    positions: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    max_window: int,
    precision: str,
    interpret: bool = False,
    block_c: int = 128,
    block_t: int | None = None,
    backend: str = "triton",
) -> jax.Array:
    """GSM prefill filter as a Pallas kernel.

    x [B, T, C]; positions [B, T] int32 (-1 = padding); window [B] int32
    (0 = adaptive); strength [B] float32; protect_first int32 scalar.
    Grid: (batch, T-blocks, C-blocks); T and C need not be block multiples.
    `backend`: "triton" (GPU; masked loads/stores, also what interpret mode
    runs) or "mosaic" (TPU: per-row scalars in SMEM, block_t a multiple of 128).
    """
    compute_dtype(precision)  # validates
    if backend not in ("triton", "mosaic"):
        raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")
    B, T, C = x.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions shape {positions.shape} != {(B, T)}")
    bt = default_block_t(max_window) if block_t is None else block_t
    if backend == "mosaic" and block_t is None:
        bt = max(bt, 128)  # a (1, bt) positions block must tile TPU lanes
    if bt < max_window or bt & (bt - 1) or bt < 16:
        raise ValueError(f"block_t={bt} must be a power of two >= max(16, max_window)")
    if block_c & (block_c - 1) or block_c < 16:
        raise ValueError(f"block_c={block_c} must be a power of two >= 16")

    positions = positions.astype(jnp.int32)
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (B,))
    strength = jnp.broadcast_to(jnp.asarray(strength, jnp.float32), (B,))
    lo = jnp.reshape(jnp.asarray(protect_first, jnp.int32), (1,))

    grid = (B, pl.cdiv(T, bt), pl.cdiv(C, block_c))
    prev_t = lambda i: jnp.maximum(i - 1, 0)
    x_spec = pl.BlockSpec((None, bt, block_c), lambda b, i, j: (b, i, j))
    xp_spec = pl.BlockSpec((None, bt, block_c), lambda b, i, j: (b, prev_t(i), j))
    pcol_spec = pl.BlockSpec((None, bt, 1), lambda b, i, j: (b, i, 0))
    prow_spec = pl.BlockSpec((None, 1, bt), lambda b, i, j: (b, 0, i))
    pprow_spec = pl.BlockSpec((None, 1, bt), lambda b, i, j: (b, 0, prev_t(i)))
    if backend == "mosaic":
        from jax.experimental.pallas import tpu as pltpu

        row_spec = lo_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
    else:
        row_spec = pl.BlockSpec((1,), lambda b, i, j: (b,))
        lo_spec = pl.BlockSpec((1,), lambda b, i, j: (0,))
        params = plt.CompilerParams(num_warps=4, num_stages=2)

    kernel = functools.partial(
        _prefill_kernel,
        seq_len=T,
        channels=C,
        block_t=bt,
        block_c=block_c,
        max_window=max_window,
        precision=precision,
        backend=backend,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        in_specs=[x_spec, xp_spec, pcol_spec, prow_spec, pprow_spec, row_spec, row_spec, lo_spec],
        out_specs=x_spec,
        compiler_params=None if interpret else params,
        interpret=interpret,
        name="gsm_smooth_prefill",
    )(
        x,
        x,
        positions[:, :, None],
        positions[:, None, :],
        positions[:, None, :],
        window,
        strength,
        lo,
    )
