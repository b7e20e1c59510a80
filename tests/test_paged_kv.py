"""The paged KV cache (`models.common.KVCache.pages`, the serving engine's pool) against
the cache of rows: the same tokens, chunked prefill then decode, through scrambled page
tables, give the same logits, for the Llama family (float and int8 caches) and Gemma 3
(sliding-window layers). Rows that are not active write nothing into pages they do not
hold. The engine's use of it (page reservation, admission) is in tests/test_engine.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsm_jax.errors import InvalidInputError
from gsm_jax.models import common, llama

PAGE = 16


def _model(name: str):
    if name == "gemma3":
        from tiny_models import tiny_gemma3

        from gsm_jax.models import gemma3

        p = tiny_gemma3()
        return gemma3, p.config, p.weights
    kv = "int8" if name == "llama-int8" else None
    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=256, kv_cache_dtype=kv)
    return llama, cfg, llama.init_weights(cfg, jax.random.key(0))


def _scrambled_tables(batch: int, n_logical: int, n_pages: int, seed: int) -> np.ndarray:
    """Each row its own pages of the pool, in a random order (no page shared)."""
    perm = np.random.default_rng(seed).permutation(n_pages)[:batch * n_logical]
    return perm.reshape(batch, n_logical).astype(np.int32)


@pytest.mark.parametrize("name", ["llama", "llama-int8", "gemma3"])
def test_paged_cache_equals_rows(name):
    fam, cfg, w = _model(name)
    batch, max_len = 3, 64
    n_logical = max_len // PAGE
    n_pages = batch * n_logical + 5  # spare pages: never written
    rows = fam.init_cache(cfg, batch, max_len)
    paged = fam.init_cache(cfg, batch, max_len, paged=(n_pages, PAGE))
    assert paged.max_len == max_len and paged.page_size == PAGE
    table = _scrambled_tables(batch, n_logical, n_pages, seed=1)
    paged = paged.replace(pages=jnp.asarray(table))
    rng = np.random.default_rng(0)
    extend = jax.jit(lambda w, t, n, c: fam.extend(w, cfg, t, n, c))
    decode = jax.jit(lambda w, t, c, a: fam.decode_step(w, cfg, t, c, None, a))
    # two chunks of different lengths per row (the second crosses page boundaries)
    for width, n in ((24, [24, 5, 17]), (32, [20, 32, 3])):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
        n = jnp.asarray(n, jnp.int32)
        a, rows = extend(w, tokens, n, rows)
        b, paged = extend(w, tokens, n, paged)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    active = jnp.asarray([True, False, True])
    for _ in range(6):
        tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch,)), jnp.int32)
        a, rows = decode(w, tok, rows, active)
        b, paged = decode(w, tok, paged, active)
        np.testing.assert_allclose(np.asarray(b)[[0, 2]], np.asarray(a)[[0, 2]], rtol=1e-6,
                                   atol=1e-6)
    np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(rows.lengths))
    # what each row holds, read back through its table, is the rows cache's
    held = np.asarray(rows.lengths)
    k_rows, k_pool = np.asarray(rows.k[0]), np.asarray(paged.k[0])
    for r in range(batch):
        for pos in range(held[r]):
            np.testing.assert_array_equal(k_pool[table[r, pos // PAGE], :, pos % PAGE],
                                          k_rows[r, :, pos])
    # the spare pages were never written (inactive row 1 and the padding wrote nothing)
    spare = np.setdiff1d(np.arange(n_pages), table.ravel())
    assert not np.asarray(paged.k[1])[spare].any()


def test_inactive_rows_write_nothing():
    """A free row's table may still name pages another row now holds: a decode step in
    which that row is not active leaves every page as it was."""
    _, cfg, w = _model("llama")
    cache = llama.init_cache(cfg, 2, 32, paged=(4, PAGE))
    # row 1's stale table names row 0's pages
    cache = cache.replace(pages=jnp.asarray([[0, 1], [0, 1]], jnp.int32),
                          lengths=jnp.asarray([3, 7], jnp.int32))
    before = np.asarray(cache.k[0]).copy()
    _, out = llama.decode_step(w, cfg, jnp.asarray([5, 6], jnp.int32), cache, None,
                               jnp.asarray([True, False]))
    after = np.asarray(out.k[0])
    changed = np.argwhere((after != before).any(axis=(1, 3)))  # (page, slot) pairs
    assert [tuple(x) for x in changed] == [(0, 3)]  # row 0's position 3 only


def test_paged_rows_and_errors():
    _, cfg, _ = _model("llama")
    cache = llama.init_cache(cfg, 4, 64, paged=(6, PAGE), gsm_max_window=4)
    part = common.first_rows(cache, 2)
    assert part.pages.shape == (2, 4) and part.k[0].shape[0] == 6
    back = common.put_first_rows(cache, part)
    assert back.pages.shape == (4, 4)
    row = common.take_row(cache, jnp.int32(2))
    assert row.pages.shape == (1, 4) and row.k[0].shape == cache.k[0].shape
    assert row.rings[0].shape[1] == 1
    row = row.replace(pages=jnp.full((1, 4), 5, jnp.int32))
    out = common.put_row(cache, row, jnp.int32(2))
    assert np.asarray(out.pages)[2].tolist() == [5] * 4
    assert np.asarray(out.pages)[1].tolist() == [0] * 4
    with pytest.raises(InvalidInputError, match="multiple of page_size"):
        llama.init_cache(cfg, 2, 40, paged=(4, PAGE))
    with pytest.raises(InvalidInputError, match="paged"):
        common.insert_rows(cache, llama.init_cache(cfg, 1, 64), jnp.asarray([0]))
    assert dataclasses.is_dataclass(cache)
