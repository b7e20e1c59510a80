"""gsm_jax.smoothing against a plain numpy loop written from GSM_SPEC.md section 3.

Tolerances (x ~ N(0, 1)):
- precision "f32": each mean is a sum of at most max_window f32 terms, so
  its relative error is below max_window * 2**-24 ~ 4e-6 of the summed
  magnitudes; rtol = atol = 2e-5 covers it with margin.
- bf16 (activations or arithmetic): the implementation and the loop may
  round the same exact value to neighbouring bf16 numbers (a different f32
  summation order flips a rounding; XLA may also keep excess precision
  between bf16 ops). Each of the mean, the difference, the product and the
  sum can be off by one bf16 ulp (2**-7 relative at most), and
  y = x + s (m - x) has |y| <= max(|x|, |m|), so |dy| <= 2**-6 (|x| + |m|).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.smoothing import (
    decode_buckets,
    prefill_buckets,
    ring_from_prefill,
    smooth,
    smooth_decode,
    smooth_prefill,
)

BF16 = ml_dtypes.bfloat16
DTYPES = {"f32": np.float32, "bf16": BF16}


def np_smooth(x, positions, window, strength, max_window, protect_first, precision):
    """Spec section 3 literally: per row, per token, a Python loop over its window.

    Returns (y, m) with m the exact (float64) window mean, NaN where unsmoothed.
    """
    x = np.asarray(x)
    y = x.copy()
    m_out = np.full(x.shape, np.nan)
    for b in range(x.shape[0]):
        where = {int(p): t for t, p in enumerate(positions[b]) if p >= 0}  # position -> index
        for p, t in where.items():
            if p < protect_first:
                continue
            w = window if window != "adaptive" else min(max((p + 1) // 16, 4), max_window)
            qs = range(max(protect_first, p - w + 1), p + 1)
            m = np.mean([x[b, where[q]].astype(np.float64) for q in qs], axis=0)
            m_out[b, t] = m
            if precision == "f32":
                y[b, t] = (x[b, t].astype(np.float64) + strength * (m - x[b, t])).astype(x.dtype)
            else:  # every op rounded to bf16, as the spec's "arithmetic in bf16"
                xc, mc, sc = x[b, t].astype(BF16), m.astype(BF16), np.array(strength, BF16)
                y[b, t] = (xc + sc * (mc - xc)).astype(x.dtype)
    return y, m_out


def assert_close(y, y_ref, x, m_ref, *, bf16: bool) -> None:
    y, y_ref, x = (np.asarray(a, np.float64) for a in (y, y_ref, x))
    m = np.nan_to_num(m_ref)
    if bf16:
        tol = 2.0**-6 * (np.abs(x) + np.abs(m)) + 1e-6
    else:
        tol = 2e-5 * (1 + np.abs(y_ref))
    bad = np.abs(y - y_ref) > tol
    assert not bad.any(), f"{bad.sum()} elements off, max err {np.abs(y - y_ref).max()}"


def ragged_positions(rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """Rows of random length, padded left or right (the model uses both)."""
    pos = np.full((batch, seq), -1, np.int32)
    for b in range(batch):
        n = int(rng.integers(0, seq + 1)) if b else seq  # row 0 full, others ragged
        off = 0 if rng.random() < 0.5 else seq - n
        pos[b, off : off + n] = np.arange(n)
    return pos


# ------------------------------------------------------------ vs numpy loop

B, T, C = 3, 100, 16  # T > 79: the adaptive window grows past its floor of 4


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    seed=st.integers(0, 2**31 - 1),
    max_window=st.sampled_from([4, 16, 24]),
    window=st.one_of(st.just("adaptive"), st.integers(1, 24)),
    strength=st.sampled_from([0.05, 0.1, 0.3, 1.0]),
    protect_first=st.sampled_from([0, 1, 2]),
    dtype=st.sampled_from(["f32", "bf16"]),
    precision=st.sampled_from(["f32", "bf16"]),
)
def test_smooth_matches_numpy_loop(
    seed, max_window, window, strength, protect_first, dtype, precision
):
    if window != "adaptive":
        window = min(window, max_window)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, C)).astype(DTYPES[dtype])
    pos = ragged_positions(rng, B, T)
    y = smooth(
        jnp.asarray(x),
        pos,
        window=window,
        strength=strength,
        max_window=max_window,
        protect_first=protect_first,
        precision=precision,
    )
    y_ref, m_ref = np_smooth(x, pos, window, strength, max_window, protect_first, precision)
    assert y.dtype == x.dtype
    assert_close(y, y_ref, x, m_ref, bf16=dtype == "bf16" or precision == "bf16")
    # untouched tokens are returned bitwise
    untouched = np.isnan(m_ref[..., 0])
    np.testing.assert_array_equal(np.asarray(y)[untouched], x[untouched])


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_adaptive_window_long_rows(precision):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 300, 8)).astype(np.float32)
    pos = np.stack([np.arange(300), np.where(np.arange(300) >= 40, np.arange(300) - 40, -1)])
    kw = dict(window="adaptive", strength=0.5, max_window=16, protect_first=1)
    y = smooth(x, pos, precision=precision, **kw)
    y_ref, m_ref = np_smooth(x, pos, "adaptive", 0.5, 16, 1, precision)
    assert_close(y, y_ref, x, m_ref, bf16=precision == "bf16")


def test_long_sequence_error_does_not_grow_with_t():
    """A large common offset makes a cumulative-sum difference lose digits as T
    grows; the blocked window sums must stay at f32 rounding level."""
    rng = np.random.default_rng(0)
    n, w = 8192, 48
    x = (1000.0 + rng.standard_normal((1, n, 8))).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)[None]
    y = np.asarray(smooth(x, pos, window=w, strength=1.0, max_window=64))
    x64 = x[0].astype(np.float64)
    c = np.concatenate([np.zeros((1, 8)), np.cumsum(x64, axis=0)])
    starts = np.maximum(0, np.arange(n) - w + 1)
    mean = (c[1:] - c[starts]) / (np.arange(n) - starts + 1)[:, None]
    # strength 1: y is the mean itself. A sum of 48 f32 terms of ~1000 is
    # off by a few ulp(48000) / 48, ~2e-4 here; an f32 cumulative-sum
    # difference over this T is off by ~0.09.
    assert np.abs(y[0] - mean).max() < 1e-3


# -------------------------------------------------------------- exactness


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_exact_identities(impl, dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 37, 20)).astype(DTYPES[dtype]))
    pos = jnp.asarray(ragged_positions(rng, 4, 37))
    run = functools.partial(smooth_prefill, x, pos, max_window=16, precision="bf16", impl=impl)
    # strength 0 and window 1 leave every token bit-identical
    np.testing.assert_array_equal(run(jnp.array([8, 0, 16, 3]), jnp.zeros(4), 0), x)
    np.testing.assert_array_equal(run(jnp.ones(4, jnp.int32), jnp.full(4, 0.3), 0), x)
    # padding and protected tokens too, while the rest does change
    y = run(jnp.array([8, 0, 16, 3]), jnp.full(4, 0.3), 2)
    keep = np.asarray(pos) < 2
    np.testing.assert_array_equal(np.asarray(y)[keep], np.asarray(x)[keep])
    assert not np.array_equal(np.asarray(y)[~keep], np.asarray(x)[~keep])


def test_per_row_strength_zero_is_bitwise():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 30, 8)).astype(np.float32))
    pos = jnp.asarray(ragged_positions(rng, 3, 30))
    y = smooth_prefill(x, pos, 8, jnp.array([0.2, 0.0, 0.2]), 0, max_window=8, precision="f32")
    np.testing.assert_array_equal(y[1], x[1])


# ------------------------------------------------------------------ decode


def _decode_vs_prefill(impl, windows, max_window):
    rng = np.random.default_rng(3)
    b, t, c = len(windows), 100, 24
    lengths = np.array([100, 50, 96, 30])[:b]  # ragged; rows finish at different steps
    prefix = np.array([20, 3, 40, 30])[:b]  # row 3 is done after prefill: inactive
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    full_pos = np.where(np.arange(t)[None] < lengths[:, None], np.arange(t)[None], -1)
    window = jnp.asarray(windows, jnp.int32)
    strength = jnp.array([0.3, 0.2, 0.25, 0.1][:b])
    lo = jnp.int32(1)
    kw = dict(max_window=max_window, precision="f32")
    want = np.asarray(smooth_prefill(x, full_pos, window, strength, lo, impl="xla", **kw))

    # Prefill the prefixes left-padded (the model's batched prompt layout).
    pre_x = np.zeros_like(x)
    pre_pos = np.full((b, t), -1, np.int32)
    for r in range(b):
        pre_x[r, t - prefix[r] :] = x[r, : prefix[r]]
        pre_pos[r, t - prefix[r] :] = np.arange(prefix[r])
    got_pre = smooth_prefill(pre_x, pre_pos, window, strength, lo, impl=impl, **kw)
    for r in range(b):
        np.testing.assert_allclose(
            got_pre[r, t - prefix[r] :], want[r, : prefix[r]], rtol=2e-5, atol=2e-5
        )

    ring = ring_from_prefill(pre_x, pre_pos, max_window)
    step = jax.jit(functools.partial(smooth_decode, precision="f32", impl=impl))
    for k in range(t - prefix.min()):
        n = prefix + k
        active = n < lengths
        position = jnp.asarray(np.where(active, n, -1), jnp.int32)
        xt = x[np.arange(b), np.minimum(n, t - 1)]
        y, new_ring = step(xt, ring, position, window, strength, lo)
        y, new_ring = np.asarray(y), np.asarray(new_ring)
        for r in range(b):
            if active[r]:
                np.testing.assert_allclose(y[r], want[r, n[r]], rtol=2e-5, atol=2e-5)
            else:  # inactive rows: y = x, ring row untouched, bitwise
                np.testing.assert_array_equal(y[r], xt[r])
                np.testing.assert_array_equal(new_ring[r], np.asarray(ring)[r])
        ring = jnp.asarray(new_ring)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_decode_matches_prefill(impl):
    # max_window 20 -> buckets (8, 16, 20): row 2's window 20 needs the widest.
    _decode_vs_prefill(impl, [3, 0, 20, 12], max_window=20)


def test_decode_matches_prefill_small_windows_and_adaptive():
    # Every count <= 8: the XLA decode stays in its smallest bucket.
    _decode_vs_prefill("xla", [0, 1, 8, 0], max_window=20)


def test_decode_few_rows_read_the_whole_ring():
    # 2 rings of 16 rows: one masked reduce over the whole ring, no switch; windows 3 and
    # 16 need what the buckets 8 and 16 would read.
    assert decode_buckets(16, 2) == (16,)
    _decode_vs_prefill("xla", [3, 16], max_window=16)
    _decode_vs_prefill("xla", [0, 1], max_window=16)


@pytest.mark.parametrize("rows, switch", [(1, False), (4, False), (5, True), (16, True)])
def test_decode_switches_on_buckets_only_for_many_rows(rows, switch):
    x = jnp.zeros((rows, 8), jnp.float32)
    ring = jnp.zeros((rows, 16, 8), jnp.float32)
    args = (x, ring, jnp.zeros(rows, jnp.int32), jnp.full(rows, 8, jnp.int32),
            jnp.full(rows, 0.3, jnp.float32), jnp.int32(0))
    text = jax.jit(functools.partial(smooth_decode, precision="f32", impl="xla")).lower(
        *args).as_text()
    assert ("case" in text) == switch


def test_decode_strength_zero_and_protected_are_bitwise():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 16)).astype(BF16))
    ring = jnp.asarray(rng.standard_normal((3, 8, 16)).astype(BF16))
    pos = jnp.array([5, 1, 7])
    for impl in ("xla", "pallas_interpret"):
        y, _ = smooth_decode(
            x, ring, pos, 8, jnp.array([0.0, 0.3, 0.0]), 2, precision="bf16", impl=impl
        )
        np.testing.assert_array_equal(y, x)  # rows 0, 2: s = 0; row 1: p < protect_first


def test_ring_from_prefill_slots():
    w = 4
    x = np.arange(2 * 7 * 1, dtype=np.float32).reshape(2, 7, 1)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6], [-1, -1, -1, -1, 0, 1, 2]])
    ring = np.asarray(ring_from_prefill(x, pos, w))[..., 0]
    # row 0: positions 3..6 at slots 3, 0, 1, 2
    np.testing.assert_array_equal(ring[0], [x[0, 4, 0], x[0, 5, 0], x[0, 6, 0], x[0, 3, 0]])
    # row 1: positions 0..2 at slots 0..2; slot 3 never written
    np.testing.assert_array_equal(ring[1], [x[1, 4, 0], x[1, 5, 0], x[1, 6, 0], 0])


def test_buckets():
    assert decode_buckets(64) == (8, 16, 32, 64)
    assert decode_buckets(10) == (8, 10)
    assert decode_buckets(4) == (4,)
    assert decode_buckets(16, 4) == (16,)  # 64 ring rows in all: the whole ring
    assert decode_buckets(16, 5) == (8, 16)
    assert decode_buckets(8, 8) == (8,)
    assert decode_buckets(32, 1) == (8, 16, 32)  # longer rings keep the buckets
    assert decode_buckets(64, 1) == (8, 16, 32, 64)
    assert prefill_buckets(64) == (16, 32, 64)
    assert prefill_buckets(4) == (8,)


# ------------------------------------------------------------------- impls


def _prefill_args():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 40, 24)).astype(np.float32))
    pos = jnp.asarray(ragged_positions(rng, 2, 40))
    return x, pos, jnp.array([8, 0]), jnp.array([0.3, 0.1]), jnp.int32(1)


def test_auto_picks_xla_on_cpu():
    args = _prefill_args()

    def f(*a):
        return smooth_prefill(*a, max_window=16, precision="f32")  # impl="auto"

    text = jax.jit(f).lower(*args).as_text()
    assert "custom_call" not in text  # neither Triton nor Mosaic
    assert "while" not in text  # nor interpret mode, which loops over the grid
    xla = smooth_prefill(*args, max_window=16, precision="f32", impl="xla")
    np.testing.assert_array_equal(jax.jit(f)(*args), xla)


def test_model_can_force_interpreted_kernels():
    args = _prefill_args()

    @jax.jit
    def f(*a):
        return smooth_prefill(*a, max_window=16, precision="f32", impl="pallas_interpret")

    assert "while" in jax.jit(f).lower(*args).as_text()
    want = smooth_prefill(*args, max_window=16, precision="f32", impl="xla")
    np.testing.assert_allclose(f(*args), want, rtol=2e-5, atol=2e-5)


def test_runtime_knobs_do_not_recompile():
    args = _prefill_args()
    f = jax.jit(functools.partial(smooth_prefill, max_window=16, precision="f32"))
    f(*args)
    n = f._cache_size()
    f(args[0], args[1], jnp.array([3, 16]), jnp.array([0.0, 0.2]), jnp.int32(0))
    assert f._cache_size() == n


# -------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=0, strength=0.1),
        dict(window=65, strength=0.1),
        dict(window="fixed", strength=0.1),
        dict(window=True, strength=0.1),
        dict(window=8, strength=-0.1),
        dict(window=8, strength=1.5),
        dict(window=8, strength=float("nan")),
        dict(window=8, strength=0.1, protect_first=-1),
        dict(window=8, strength=0.1, precision="fp16"),
        dict(window=8, strength=0.1, max_window=0),
    ],
)
def test_smooth_rejects_bad_config(kwargs):
    x = np.zeros((1, 4, 2), np.float32)
    with pytest.raises(GSMConfigError):
        smooth(x, np.arange(4)[None], **kwargs)


@pytest.mark.parametrize(
    "x_shape, pos",
    [
        ((4, 2), [[0, 1, 2, 3]]),  # x not [B, T, C]
        ((1, 4, 2), [[0, 1, 2]]),  # positions shape
        ((1, 4, 2), [[1, 2, 3, 4]]),  # not starting at 0
        ((1, 4, 2), [[0, -1, 1, 2]]),  # not contiguous
        ((1, 4, 2), [[0.0, 1.0, 2.0, 3.0]]),  # not integer
    ],
)
def test_smooth_rejects_bad_input(x_shape, pos):
    with pytest.raises(InvalidInputError):
        smooth(np.zeros(x_shape, np.float32), np.asarray(pos), window=2, strength=0.1)


def test_runtime_rejects_bad_static_args():
    x, pos, w, s, lo = _prefill_args()
    with pytest.raises(GSMConfigError):
        smooth_prefill(x, pos, w, s, lo, max_window=16, precision="f32", impl="cuda")
    with pytest.raises(InvalidInputError):
        smooth_prefill(x, pos, jnp.zeros(3, jnp.int32), s, lo, max_window=16, precision="f32")


@pytest.mark.parametrize("window,max_window,totals,want", [
    (8, 64, [40], 8), (5, 64, [40], 8), (12, 64, [40], 16), (64, 64, [40], 64),
    (33, 64, [40], 64), ("adaptive", 64, [100], 8), ("adaptive", 64, [300, 700], 64),
    ("adaptive", 64, [500], 32), ("adaptive", 16, [5000], 16)])
def test_ring_rows_fit_every_window(window, max_window, totals, want):
    """One-shot calls size the GSM rings to the largest window they can use; the filter
    then gives what it gives with the full max_window ring (prefill and decode)."""
    from gsm_jax.config import GSMConfig
    from gsm_jax.gsm_runtime import ring_rows

    cfg = GSMConfig(window_size=window, max_window=max_window, target_layers="all")
    w = ring_rows(cfg, totals)
    assert w == want
    t = max(totals)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, t, 8)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    win = jnp.asarray([0 if window == "adaptive" else window], jnp.int32)
    s, lo = jnp.asarray([0.3], jnp.float32), jnp.int32(1)
    full = smooth_prefill(x, pos, win, s, lo, max_window=max_window, precision="f32")
    fit = smooth_prefill(x, pos, win, s, lo, max_window=w, precision="f32")
    # equal to f32 rounding: the prefill's block size follows max_window
    np.testing.assert_allclose(np.asarray(fit), np.asarray(full), rtol=1e-6, atol=1e-6)
    rings = [ring_from_prefill(x[:, :-1], pos[:, :-1], m) for m in (max_window, w)]
    outs = [smooth_decode(x[:, -1], r, jnp.asarray([t - 1], jnp.int32), win, s, lo,
                          precision="f32")[0] for r in rings]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(full[:, -1]), rtol=1e-5,
                               atol=1e-5)
