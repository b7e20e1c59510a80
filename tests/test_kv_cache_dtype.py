"""KV cache in int8 / FP8 (`kv_cache_dtype`) for the Llama family and Gemma 3.

The rounding (`models.common.kv_quantize`) is checked bit for bit against a plain numpy
version of the documented rule (ml_dtypes' e4m3fn cast, numpy's round-half-even). The
model paths are checked on tiny random models against the teacher-forced forward with
the same rounding applied (every key and value a query sees is rounded, in every mode), so
prefill + decode, chunked extend and `cache_insert` must equal it to float tolerance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_family_contract import tiny_gemma3
from tiny_models import tiny_dsv4, tiny_gsm_llama

import gsm_jax
from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.families import family_module
from gsm_jax.models.common import kv_block, kv_dequantize, kv_quantize

KINDS = ["int8", "fp8"]


def _numpy_rule(x: np.ndarray, kind: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """One scale per `block` consecutive values of the last axis."""
    x = x.astype(np.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(axis=-1)
    qmax = np.float32(127.0 if kind == "int8" else 448.0)
    scale = np.where(amax > 0, amax * np.float32(1.0 / qmax), np.float32(1.0)).astype(np.float32)
    y = np.clip(xb / scale[..., None], -qmax, qmax).reshape(x.shape)
    if kind == "int8":
        return np.round(y).astype(np.int8), scale
    return y.astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,block", [(16, 16), (96, 32), (24, 8)])
def test_rounding_is_the_documented_rule_bit_for_bit(kind, head_dim, block):
    """Scales per 32 values (a whole head when it is smaller; gcd(head_dim, 32) otherwise)."""
    assert kv_block(head_dim) == block
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 2, head_dim)) * rng.uniform(0.01, 30, (3, 5, 2, 1)))
    x = x.astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero head vector: scale 1, stored zeros
    x[1, 2, 1, 3] = 1e4  # one outlier: the rest of its block loses precision, not range
    q, s = jax.jit(kv_quantize, static_argnums=1)(jnp.asarray(x), kind)
    want_q, want_s = _numpy_rule(x, kind, block)
    assert s.shape == x.shape[:-1] + (head_dim // block,)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    back = np.asarray(kv_dequantize(q, s, jnp.float32))
    assert np.all(back[0, 0, 0] == 0)
    # error bound per value: half a step (int8: s / 2), or e4m3's half ulp (2^-4 relative)
    # plus the subnormal step at the bottom of its range
    err = np.abs(back - x)
    sv = np.repeat(np.asarray(s), block, axis=-1)  # each value's own scale
    bound = sv / 2 if kind == "int8" else np.abs(x) * 2.0**-4 + sv * 2.0**-10
    assert np.all(err <= bound * (1 + 1e-6)), float((err - bound).max())


FAMILIES = {"llama": tiny_gsm_llama, "gemma3": tiny_gemma3}


def _with(p, kind):
    return gsm_jax.with_kv_cache_dtype(p, kind)


def _rows(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, vocab, (len(lengths), max(lengths))).astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", KINDS)
def test_cached_paths_equal_the_forward_with_the_same_rounding(family, kind):
    """Prefill + decode (ragged rows, GSM on), chunked extend, and a row joined by
    `cache_insert`: each equals the rounded teacher-forced forward."""
    p = _with(FAMILIES[family](), kind)
    cfg, w = p.config, p.weights
    fam = family_module(cfg.family)
    fwd = jax.jit(fam.forward, static_argnums=1)
    prefill = jax.jit(fam.prefill, static_argnums=1)
    decode = jax.jit(fam.decode_step, static_argnums=1)
    extend = jax.jit(fam.extend, static_argnums=1, static_argnames="all_logits")
    lengths = [18, 11]
    toks, lens = _rows(cfg.vocab_size, lengths, seed=1)
    gcfg = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all")
    from gsm_jax.gsm_runtime import gsm_inputs_for_batch

    # rings sized as generate sizes them (8 rows for a window of 4: one decode bucket)
    gsm = gsm_inputs_for_batch(gcfg, cfg.num_layers, 2, lengths, fit_ring=True)
    full = np.asarray(fwd(w, cfg, toks, lens, gsm))
    scale = np.abs(full).max()
    # the rounding is live: the float cache's forward differs, by little
    float_cfg = dataclasses.replace(cfg, kv_cache_dtype=None)
    plain = np.asarray(fwd(w, float_cfg, toks, lens, gsm))
    assert 0 < np.abs(plain - full).max() < 0.1 * scale

    def close(a, b):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2e-5 * scale)

    cache = fam.init_cache(cfg, 2, 24, gsm_max_window=gsm.max_window)
    assert cache.k[0].dtype == (jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
    hd = cache.k[0].shape[3]
    assert cache.k_scale[0].shape == cache.k[0].shape[:3] + (hd // kv_block(hd),)
    p0 = 6
    logits, cache = prefill(w, cfg, toks[:, :p0], jnp.asarray([p0, p0]), cache, gsm)
    close(logits, full[:, p0 - 1])
    for i in range(p0, max(lengths)):
        active = jnp.asarray([i < n for n in lengths])
        logits, cache = decode(w, cfg, toks[:, i], cache, gsm, active)
        for r, n in enumerate(lengths):
            if i < n:
                close(logits[r], full[r, i])
    # chunked extend (chunks of 5: they end past row 1's last token) = one prefill
    ext = fam.init_cache(cfg, 2, 24, gsm_max_window=gsm.max_window)
    last = [None, None]
    for s in range(0, max(lengths), 5):
        n_new = jnp.asarray([min(5, max(n - s, 0)) for n in lengths], jnp.int32)
        piece = jnp.pad(toks[:, s:s + 5], ((0, 0), (0, 5 - toks[:, s:s + 5].shape[1])))
        lg, ext = extend(w, cfg, piece, n_new, ext, gsm)
        for r in range(2):
            if int(n_new[r]) > 0:
                last[r] = lg[r]
    for r, n in enumerate(lengths):
        close(last[r], full[r, n - 1])
    np.testing.assert_array_equal(np.asarray(ext.lengths), lengths)
    # a row prefilled alone joins the batch with its scales
    alone = fam.init_cache(cfg, 1, 24, gsm_max_window=gsm.max_window)
    gsm1 = gsm_inputs_for_batch(gcfg, cfg.num_layers, 1, [7], fit_ring=True)
    _, alone = prefill(w, cfg, toks[1:2, :7], jnp.asarray([7]), alone, gsm1)
    joined = jax.jit(fam.cache_insert)(cache, alone, jnp.asarray([1]))
    nxt = jnp.asarray([4, 9], jnp.int32)
    batch_logits, _ = decode(w, cfg, nxt, joined, gsm)
    solo_logits, _ = decode(w, cfg, nxt[1:2], alone, gsm1)
    close(batch_logits[1], np.asarray(solo_logits[0]))


def test_generate_and_the_cache_bytes():
    """`generate_tokens(kv_cache_dtype=...)` runs the rounded model (its greedy tokens
    equal those of the params made by `with_kv_cache_dtype`), and the planner counts the
    cache at 1 byte per value plus one float32 scale per token and head."""
    p = tiny_gsm_llama()
    prompt = [[5, 6, 7, 8, 9, 10]]
    a = gsm_jax.generate_tokens(p, prompt, max_new_tokens=5, kv_cache_dtype="fp8")
    b = gsm_jax.generate_tokens(_with(p, "fp8"), prompt, max_new_tokens=5)
    np.testing.assert_array_equal(a[0], b[0])
    cfg = p.config
    lines = gsm_jax.plan(_with(p, "int8").config, batch=2, context=256).lines
    float_lines = gsm_jax.plan(cfg, batch=2, context=256).lines
    values = 2 * cfg.num_layers * 2 * cfg.num_kv_heads * 256 * cfg.head_dim
    assert lines["cache: K/V"] == values  # int8: one byte per value
    assert lines["cache: K/V scales"] == values // kv_block(cfg.head_dim) * 4  # f32 per block
    assert float_lines["cache: K/V"] == values * 2  # the planner's default: bfloat16


def test_bad_choices_are_named():
    with pytest.raises(InvalidInputError, match="kv_cache_dtype must be one of .*'int4'"):
        gsm_jax.with_kv_cache_dtype(tiny_gsm_llama(), "int4")
    with pytest.raises(InvalidInputError, match="kv_cache_dtype"):
        dataclasses.replace(tiny_gsm_llama().config, kv_cache_dtype="bf8")
    with pytest.raises(UnsupportedModelError, match="deepseek_v4 family keeps its KV cache"):
        gsm_jax.generate_tokens(tiny_dsv4(), [[1, 2, 3]], kv_cache_dtype="fp8")
    p = tiny_gsm_llama()
    assert gsm_jax.with_kv_cache_dtype(p, "auto") is p
