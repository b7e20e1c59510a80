"""GSM: inference-time activation smoothing along the token axis.

Filter (GSM_SPEC.md section 3), per sequence, p = the token's index in it:

    m_p = mean of x_q for q in [max(lo, p - w_p + 1), p]
    y_p = x_p + s * (m_p - x_p)   for p >= lo;    y_p = x_p for p < lo

lo = protect_first; w_p a fixed window or clamp((p + 1) // 16, 4, max_window).
Padding (position < 0) never enters a window and is returned unchanged.

`smooth` is the public, validated entry point. `smooth_prefill`,
`smooth_decode` and `ring_from_prefill` are the jittable runtime used inside
the model: every numeric knob is an array, so changing it never recompiles;
only `max_window`, `precision` and `impl` are static.

impl: "auto" (Pallas on GPU/TPU, fused XLA elsewhere, decided at lowering
time by `lax.platform_dependent`, so one jitted function serves every
backend), "xla", "pallas" (the kernels; interpret mode on CPU) and
"pallas_interpret" (kernels in interpret mode anywhere, for CPU tests).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.in_place import scatter_set
from gsm_jax.pallas_kernels.quant_reference import quantize_rows
from gsm_jax.pallas_kernels.smooth_decode import smooth_decode_pallas
from gsm_jax.pallas_kernels.smooth_prefill import (
    PRECISIONS,
    combine,
    smooth_mask,
    smooth_prefill_pallas,
    window_bounds,
)
from gsm_jax.pallas_kernels.smooth_quant import (
    smooth_quantize_decode_pallas,
    smooth_quantize_prefill_pallas,
)

__all__ = [
    "IMPLS",
    "PRECISIONS",
    "decode_buckets",
    "prefill_buckets",
    "ring_from_prefill",
    "smooth",
    "smooth_decode",
    "smooth_decode_stacked",
    "smooth_prefill",
]

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
ADAPTIVE = "adaptive"


# ---------------------------------------------------------------- validation


def _check_static(max_window: Any, precision: Any, impl: Any) -> None:
    if isinstance(max_window, bool) or not isinstance(max_window, int | np.integer):
        raise GSMConfigError(f"max_window must be an int >= 1, got {max_window!r}")
    if max_window < 1:
        raise GSMConfigError(f"max_window must be an int >= 1, got {max_window}")
    if precision not in PRECISIONS:
        raise GSMConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if impl not in IMPLS:
        raise GSMConfigError(f"impl must be one of {IMPLS}, got {impl!r}")


def _row_param(value: Any, name: str, batch: int, dtype: Any) -> jax.Array:
    arr = jnp.asarray(value, dtype)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] not in (1, batch)):
        raise InvalidInputError(f"{name} must be a scalar or shape [{batch}], got {arr.shape}")
    return jnp.broadcast_to(arr, (batch,))


def _scalar_param(value: Any, name: str) -> jax.Array:
    arr = jnp.asarray(value, jnp.int32)
    if arr.size != 1:
        raise InvalidInputError(f"{name} must be a scalar, got shape {arr.shape}")
    return arr.reshape(())


def _check_floating(x: jax.Array, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise InvalidInputError(f"{name} must be a floating-point array, got {x.dtype}")


# ------------------------------------------------------------------ XLA paths


def prefill_buckets(max_window: int) -> tuple[int, ...]:
    """Static T-block sizes of the XLA prefill: 16, 32, ... below max_window,
    then max(max_window, 8)."""
    sizes = [b for b in (2**k for k in range(4, 31)) if b < max_window]
    return (*sizes, max(max_window, 8))


def _band_sum(x, pos, start, *, block: int):
    """f32 window sums: T cut into blocks of `block` >= every window count,
    so a window lies in its own block and the previous one, and the sums
    are band_cur @ x_cur + band_prev @ x_prev with 0/1 band matrices built
    from positions (positions, not indices, decide: padding never enters)."""
    B, T, C = x.shape
    K = block
    nb = -(-T // K)
    pad = nb * K - T
    pos = jnp.pad(pos, ((0, 0), (0, pad)), constant_values=-1).reshape(B, nb, K)
    start = jnp.pad(start, ((0, 0), (0, pad))).reshape(B, nb, K)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0))).reshape(B, nb, K, C)

    def band(src: jax.Array) -> jax.Array:  # [B, nb, K(target), K(source)]
        src = src[:, :, None, :]
        return ((src >= start[..., None]) & (src <= pos[..., None])).astype(jnp.float32)

    hi = lax.Precision.HIGHEST  # no TF32 on GPU: the sums stay f32-exact selections
    total = jnp.einsum("bnts,bnsc->bntc", band(pos), xf, precision=hi)
    # Block n's windows reach into block n-1: contract block n-1's tokens.
    pos_prev = jnp.pad(pos[:, :-1], ((0, 0), (1, 0), (0, 0)), constant_values=-1)
    prev = jnp.einsum("bnts,bnsc->bntc", band(pos_prev)[:, 1:], xf[:, :-1], precision=hi)
    total = total + jnp.pad(prev, ((0, 0), (1, 0), (0, 0), (0, 0)))
    return total.reshape(B, nb * K, C)[:, :T]


def _prefill_xla(x, positions, window, strength, lo, *, max_window: int, precision: str):
    """Prefill as blocked banded matmuls (see `_band_sum`).

    Why this formulation: a cumulative-sum difference has an error that
    scales with the running sum over all of T, so long prompts lose
    accuracy; here every output is a sum of at most max_window terms in f32
    with exact 0/1 weights, so the error does not depend on T. A sum over
    max_window shifted slices costs max_window passes; the band matmul costs
    4 * block flops per element and runs as batched GEMMs. The block is the
    smallest bucket holding the batch's largest window count, picked at run
    time by `lax.switch` (no recompiles; the measured gain is in
    docs/performance_notes.md, "GSM filter prefill: band-matmul block size").
    """
    start, count = window_bounds(positions, window[:, None], lo, max_window)  # [B, T]
    mask = smooth_mask(positions, count, strength[:, None], lo)
    need = jnp.max(jnp.where(mask, count, 1))
    buckets = prefill_buckets(max_window)
    branch = sum((need > b).astype(jnp.int32) for b in buckets[:-1])
    branches = [functools.partial(_band_sum, block=k) for k in buckets]
    total = lax.switch(branch, branches, x, positions, start)
    return combine(x, total, count[..., None], strength[:, None, None], mask[..., None], precision)


# A decode batch of rings of at most WHOLE_RING_MAX_WINDOW rows, at most WHOLE_RING_ROWS
# rows in all (B x W), reads every ring row in one masked reduce instead of picking a
# bucket (docs/performance_notes.md, "GSM decode: few rows read the whole ring").
WHOLE_RING_ROWS = 64
WHOLE_RING_MAX_WINDOW = 16


def decode_buckets(max_window: int, rows: int | None = None) -> tuple[int, ...]:
    """Static ring-read sizes of the XLA decode: 8, 16, 32, ... below
    max_window, then max_window itself; only max_window for `rows` (the batch) rings
    of at most WHOLE_RING_MAX_WINDOW rows, WHOLE_RING_ROWS in all."""
    if (rows is not None and max_window <= WHOLE_RING_MAX_WINDOW
            and rows * max_window <= WHOLE_RING_ROWS):
        return (max_window,)
    sizes = [b for b in (2**k for k in range(3, 31)) if b < max_window]
    return (*sizes, max_window)


def _decode_xla(x, ring, position, window, strength, lo, *, precision: str):
    """Decode step on one ring [B, W, C]: the stacked form with a single layer."""
    y, rings = _decode_xla_stacked(x, ring[None], jnp.int32(0), position, window, strength, lo,
                                   precision=precision)
    return y, rings[0]


def _scatter_rows(rings: jax.Array, layer: jax.Array, slot: jax.Array, x: jax.Array):
    """rings[layer, b, slot[b]] = x[b], in place inside the model's layer scan.

    Indices are in range by construction; saying so keeps XLA from guarding the
    write with a select that reads (and so copies) the old ring. At batch 1 the write
    is kept a scatter (`in_place.scatter_set`): as a dynamic-update-slice it copied the
    whole [L, 1, W, C] stack every layer.
    """
    return scatter_set(rings, (layer, jnp.arange(x.shape[0]), slot), x.astype(rings.dtype),
                       mode="promise_in_bounds")


def _decode_xla_stacked(x, rings, layer, position, window, strength, lo, *, precision: str,
                        active=None):
    """Decode step on layer `layer` of stacked rings [L, B, W, C], in place.

    `active` None: rows with position < 0 are inactive (output x, ring untouched).
    `active` [B] bool: every position is >= 0 and every row writes its slot; inactive
    rows only return x. That is what the model wants: an inactive row's position is
    its *next* position, whose slot holds a token no later window reads, and a
    scatter with no dropped rows stays in place (with dropped rows XLA:CPU turned
    the batch-1 scatter into a select that copied the whole ring stack per layer).

    Reads only the ring rows the batch's widest window needs. A window of w
    needs w - 1 ring rows; reading all W rows for w = 8 costs 8x the memory
    traffic. The row count must be static, so each bucket of `decode_buckets`
    is one `lax.switch` branch, picked at run time from the largest count in
    the batch: changing the window never recompiles (docs/performance_notes.md,
    "GSM decode: read only the ring rows the window needs"). A batch of few small
    rings (`decode_buckets` with `rows`) reads the whole ring: no switch to compile.

    The model carries all layers' rings through its layer scan; touching only
    [layer, b, slot] (one scatter) and the gathered rows keeps the step from
    copying a [B, W, C] ring per layer.
    """
    L, B, W, C = rings.shape
    n = position
    start, count = window_bounds(n, window, lo, W)
    mask = smooth_mask(n, count, strength, lo)
    # Write first, read after: the switch then only reads the updated ring,
    # so XLA can scatter in place instead of copying the whole ring to keep
    # the old one alive for the read. Rows d >= 1 back are untouched by the
    # write (d < W).
    if active is None:  # inactive rows scatter out of range and are dropped
        slot = jnp.where(n >= 0, jnp.mod(n, W), W)
        new_rings = rings.at[layer, jnp.arange(B), slot].set(x.astype(rings.dtype), mode="drop")
    else:
        mask = mask & active
        new_rings = _scatter_rows(rings, layer, jnp.mod(n, W), x)

    base = (layer * B + jnp.arange(B, dtype=jnp.int32)) * W

    def window_sum(rows: int, unrolled: bool) -> Callable[[jax.Array], jax.Array]:
        def f(flat: jax.Array) -> jax.Array:
            # One gather of every row back in the window (a gather per row back compiled
            # ~2x slower), then unrolled adds, which fuse into one loop and ran fastest at
            # 8 and 16 rows, or one masked reduce, which compiles in ~60% of the time
            # (docs/performance_notes.md, "GSM decode window sum").
            back = jnp.arange(1, rows, dtype=jnp.int32)  # rows 1 .. rows-1 back
            idx = base[:, None] + jnp.mod(n[:, None] - back, W)  # [B, rows-1]
            got = flat.at[idx].get(mode="promise_in_bounds").astype(jnp.float32)
            keep = mask[:, None] & (back < count[:, None])
            if not unrolled:
                return x.astype(jnp.float32) + jnp.sum(
                    jnp.where(keep[:, :, None], got, 0.0), axis=1)
            total = x.astype(jnp.float32)
            for j in range(rows - 1):
                total = total + jnp.where(keep[:, j, None], got[:, j], 0.0)
            return total

        return f

    flat = new_rings.reshape(L * B * W, C)
    buckets = decode_buckets(W, B)
    if len(buckets) == 1:  # few rows: read the whole ring, no switch
        total = window_sum(W, unrolled=False)(flat)
    else:
        need = jnp.max(jnp.where(mask, count, 1))
        branch = sum((need > b).astype(jnp.int32) for b in buckets[:-1])
        total = lax.switch(branch, [window_sum(r, unrolled=True) for r in buckets], flat)
    y = combine(x, total, count[:, None], strength[:, None], mask[:, None], precision)
    return y, new_rings


# ------------------------------------------------------------------ dispatch


def _dispatch(impl: str, xla: Callable, triton: Callable, mosaic: Callable, interp: Callable):
    if impl == "xla":
        return xla
    if impl == "pallas_interpret":
        return interp
    default = xla if impl == "auto" else interp
    return lambda *args: lax.platform_dependent(*args, cuda=triton, tpu=mosaic, default=default)


@functools.partial(jax.jit, static_argnames=("max_window", "precision", "impl"))
def _smooth_prefill_jit(x, positions, window, strength, lo, *, max_window, precision, impl):
    kw = dict(max_window=max_window, precision=precision)
    fn = _dispatch(
        impl,
        functools.partial(_prefill_xla, **kw),
        functools.partial(smooth_prefill_pallas, **kw),
        functools.partial(smooth_prefill_pallas, backend="mosaic", **kw),
        functools.partial(smooth_prefill_pallas, interpret=True, **kw),
    )
    return fn(x, positions, window, strength, lo)


@functools.partial(jax.jit, static_argnames=("precision", "impl"))
def _smooth_decode_jit(x, ring, position, window, strength, lo, *, precision, impl):
    fn = _dispatch(
        impl,
        functools.partial(_decode_xla, precision=precision),
        functools.partial(smooth_decode_pallas, precision=precision),
        functools.partial(smooth_decode_pallas, backend="mosaic", precision=precision),
        functools.partial(smooth_decode_pallas, interpret=True, precision=precision),
    )
    return fn(x, ring, position, window, strength, lo)


# ------------------------------------------------------------------- runtime


def smooth_prefill(
    x: jax.Array,
    positions: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    max_window: int,
    precision: str,
    impl: str = "auto",
) -> jax.Array:
    """GSM filter over whole sequences (prefill). Jittable.

    x [B, T, C]; positions [B, T] int32, each token's index in its own
    sequence, -1 for padding (a row's tokens are contiguous and numbered
    0..n-1, so left and right padding both work); window [B] int32, 0 for
    adaptive, else a fixed window (clamped to [1, max_window]); strength [B]
    float32; protect_first int32 scalar. Returns y [B, T, C] in x.dtype.
    """
    _check_static(max_window, precision, impl)
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise InvalidInputError(f"x must be [B, T, C], got shape {x.shape}")
    _check_floating(x, "x")
    B, T, _ = x.shape
    positions = jnp.asarray(positions)
    if positions.shape != (B, T) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise InvalidInputError(
            f"positions must be integer [B, T] = [{B}, {T}], got {positions.dtype}{positions.shape}"
        )
    return _smooth_prefill_jit(
        x,
        positions.astype(jnp.int32),
        _row_param(window, "window", B, jnp.int32),
        _row_param(strength, "strength", B, jnp.float32),
        _scalar_param(protect_first, "protect_first"),
        max_window=int(max_window),
        precision=precision,
        impl=impl,
    )


def smooth_decode(
    x: jax.Array,
    ring: jax.Array,
    position: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    precision: str,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One decode step of the GSM filter. Jittable.

    x [B, C] the new token's input; ring [B, W, C] (W = max_window) the raw
    inputs of earlier tokens, position q at slot q % W; position [B] int32,
    the new token's index (-1 = inactive row: y = x, ring row unchanged);
    window, strength, protect_first as in `smooth_prefill`. Returns
    (y [B, C], new_ring) with x written into slot position % W.
    """
    x, ring = jnp.asarray(x), jnp.asarray(ring)
    _check_static(ring.shape[1] if ring.ndim == 3 else 1, precision, impl)
    if x.ndim != 2 or ring.ndim != 3 or ring.shape[0] != x.shape[0] or ring.shape[2] != x.shape[1]:
        raise InvalidInputError(f"need x [B, C] and ring [B, W, C], got {x.shape} and {ring.shape}")
    _check_floating(x, "x")
    _check_floating(ring, "ring")
    B = x.shape[0]
    return _smooth_decode_jit(
        x,
        ring,
        _row_param(position, "position", B, jnp.int32),
        _row_param(window, "window", B, jnp.int32),
        _row_param(strength, "strength", B, jnp.float32),
        _scalar_param(protect_first, "protect_first"),
        precision=precision,
        impl=impl,
    )


def smooth_decode_stacked(
    x: jax.Array,
    rings: jax.Array,
    layer: jax.Array,
    position: jax.Array,
    active: jax.Array,
    window: jax.Array,
    strength: jax.Array,
    protect_first: jax.Array,
    *,
    precision: str,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The model's decode form: layer `layer` of stacked rings [L, B, W, C] (its cache).

    position [B] >= 0 is each row's new position; `active` [B] bool. Active rows get
    `smooth_decode(x, rings[layer], position, ...)`; inactive rows return x, and their
    slot position % W is overwritten, which is harmless when position is the row's
    next position (that slot holds a token no later window reads). The XLA path
    updates the stack in place instead of copying a layer's ring out and back; the
    Pallas paths run the [B, W, C] kernel on the layer's slice.
    """
    def xla(x, rings, layer, position, active, window, strength, lo):
        return _decode_xla_stacked(x, rings, layer, position, window, strength, lo,
                                   precision=precision, active=active)

    def kernel(x, rings, layer, position, active, window, strength, lo):
        y, ring = _smooth_decode_jit(x, rings[layer], jnp.where(active, position, -1), window,
                                     strength, lo, precision=precision, impl=impl)
        return y, lax.dynamic_update_index_in_dim(rings, ring, layer, 0)

    if impl == "xla":
        fn = xla
    elif impl == "auto":
        def fn(*args):
            return lax.platform_dependent(*args, cpu=xla, default=kernel)
    else:
        fn = kernel
    return fn(x, rings, layer, position, active, window, strength, protect_first)


@functools.partial(jax.jit, static_argnames=("max_window",))
def _ring_from_prefill_jit(x, positions, *, max_window):
    B, T, C = x.shape
    n = jnp.max(positions, axis=1, keepdims=True) + 1  # row length (0 if all padding)
    keep = (positions >= 0) & (positions >= n - max_window)
    slot = jnp.where(keep, jnp.mod(positions, max_window), max_window)  # dropped
    ring = jnp.zeros((B, max_window, C), x.dtype)
    return ring.at[jnp.arange(B)[:, None], slot].set(x, mode="drop")


def ring_from_prefill(x: jax.Array, positions: jax.Array, max_window: int) -> jax.Array:
    """Ring state [B, W, C] after a prefill: the raw inputs of each row's last
    W positions at slot q % W (zeros elsewhere, never read), so that decoding
    position n (the row's length) next matches a prefill over n + 1 tokens."""
    _check_static(max_window, "f32", "auto")
    x, positions = jnp.asarray(x), jnp.asarray(positions)
    if x.ndim != 3 or positions.shape != x.shape[:2]:
        raise InvalidInputError(
            f"need x [B, T, C] and positions [B, T], got {x.shape}, {positions.shape}"
        )
    return _ring_from_prefill_jit(x, positions.astype(jnp.int32), max_window=int(max_window))


# -------------------------------------------------------------------- public


def _check_layout(positions: np.ndarray) -> None:
    """Each row's non-negative positions must be 0..n-1, contiguous, in order."""
    for b, row in enumerate(positions):
        idx = np.flatnonzero(row >= 0)
        if idx.size and (
            np.any(row[idx] != np.arange(idx.size)) or idx[-1] - idx[0] + 1 != idx.size
        ):
            raise InvalidInputError(
                f"positions row {b}: tokens must be numbered 0..n-1 contiguously "
                f"(padding = -1 on either side), got {row.tolist()}"
            )


def smooth(
    x: jax.Array,
    positions: jax.Array,
    *,
    window: int | str,
    strength: float,
    max_window: int = 64,
    protect_first: int = 0,
    precision: str = "f32",
) -> jax.Array:
    """Apply the GSM filter to x [B, T, C] (GSM_SPEC.md section 3).

    positions [B, T] int: each token's index in its own sequence, -1 for
    padding. window: int in [1, max_window] or "adaptive". strength: s in
    [0, 1]. Tokens before `protect_first` are neither changed nor averaged
    in. Arithmetic in `precision` ("f32" or "bf16"), result in x.dtype.
    """
    _check_static(max_window, precision, "auto")
    if window == ADAPTIVE:
        w = 0
    elif isinstance(window, int | np.integer) and not isinstance(window, bool):
        if not 1 <= window <= max_window:
            raise GSMConfigError(f"window_size must be in [1, {max_window}], got {window}")
        w = int(window)
    else:
        raise GSMConfigError(f"window_size must be an int or 'adaptive', got {window!r}")
    if isinstance(strength, bool) or not isinstance(strength, int | float | np.number):
        raise GSMConfigError(f"smooth_strength must be a number, got {strength!r}")
    if not (math.isfinite(strength) and 0.0 <= strength <= 1.0):
        raise GSMConfigError(f"smooth_strength must be in [0, 1], got {strength}")
    if isinstance(protect_first, bool) or not isinstance(protect_first, int | np.integer):
        raise GSMConfigError(f"protect_first must be an int >= 0, got {protect_first!r}")
    if protect_first < 0:
        raise GSMConfigError(f"protect_first must be an int >= 0, got {protect_first}")
    try:
        pos_np = np.asarray(positions)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        pos_np = None  # traced: the layout cannot be checked here
    if pos_np is not None and pos_np.ndim == 2 and np.issubdtype(pos_np.dtype, np.integer):
        _check_layout(pos_np)
    x = jnp.asarray(x)
    B = x.shape[0] if x.ndim == 3 else 1
    return smooth_prefill(
        x,
        positions,
        jnp.full((B,), w, jnp.int32),
        jnp.full((B,), strength, jnp.float32),
        jnp.int32(protect_first),
        max_window=int(max_window),
        precision=precision,
    )


# ----------------------------------------------------------------------------- smooth + int8
# The GSM filter followed by the per-token int8 quantizer that a W8A8 projection applies
# (models/gsm_sites.py, "quantize, then smooth"): which implementation runs where. The
# fused kernels themselves are pallas_kernels/smooth_quant.py.


def _check_quant_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def smooth_quantize_prefill(x, positions, window, strength, protect_first, *, max_window: int,
                            precision: str, impl: str = "auto"):
    """GSM prefill filter, then per-token int8: (q int8 [B, T, C], scale f32 [B, T]). Jittable.

    impl "xla": the XLA filter then the reference quantizer (XLA fuses the
    quantizer's passes); "pallas": the fused Triton kernel on GPU, the Mosaic GSM
    kernel + XLA quantizer on TPU, the fused kernel in interpret mode elsewhere;
    "pallas_interpret": the fused kernel in interpret mode anywhere; "auto": the
    fused kernel on GPU, the XLA path elsewhere.
    """
    _check_quant_impl(impl)

    kw = dict(max_window=max_window, precision=precision)
    args = (x, positions, window, strength, protect_first)

    def xla(*a):
        return quantize_rows(smooth_prefill(*a, impl="xla", **kw))

    def tpu(*a):
        return quantize_rows(smooth_prefill(*a, impl="pallas", **kw))

    def kernel(*a, interpret=False):
        return smooth_quantize_prefill_pallas(*a, interpret=interpret, **kw)

    if impl == "xla":
        return xla(*args)
    if impl == "pallas_interpret":
        return kernel(*args, interpret=True)
    default = xla if impl == "auto" else functools.partial(kernel, interpret=True)
    return lax.platform_dependent(*args, cuda=kernel, tpu=tpu, default=default)


def smooth_quantize_decode_stacked(x, rings, layer, position, active, window, strength,
                                   protect_first, *, precision: str, impl: str = "auto"):
    """The model's decode form (see `gsm_jax.smoothing.smooth_decode_stacked`), then
    per-token int8: returns (q int8 [B, C], scale f32 [B], rings [L, B, W, C])."""
    _check_quant_impl(impl)

    def unfused(x, rings, layer, position, active, window, strength, lo, *, sub_impl):
        y, rings = smooth_decode_stacked(x, rings, layer, position, active, window, strength,
                                         lo, precision=precision, impl=sub_impl)
        q, s = quantize_rows(y)
        return q, s, rings

    def kernel(x, rings, layer, position, active, window, strength, lo, *, interpret=False):
        q, s, ring = smooth_quantize_decode_pallas(
            x, rings[layer], jnp.where(active, position, -1), window, strength, lo,
            precision=precision, interpret=interpret)
        return q, s, lax.dynamic_update_index_in_dim(rings, ring, layer, 0)

    args = (x, rings, layer, position, active, window, strength, protect_first)
    if impl == "xla":
        return unfused(*args, sub_impl="xla")
    if impl == "pallas_interpret":
        return kernel(*args, interpret=True)
    if impl == "auto":
        # on CPU the XLA path updates the ring stack in place (see smooth_decode_stacked)
        return lax.platform_dependent(
            *args, cpu=functools.partial(unfused, sub_impl="xla"), cuda=kernel,
            tpu=functools.partial(unfused, sub_impl="pallas"),
            default=functools.partial(unfused, sub_impl="xla"))
    return lax.platform_dependent(
        *args, cuda=kernel, tpu=functools.partial(unfused, sub_impl="pallas"),
        default=functools.partial(kernel, interpret=True))
