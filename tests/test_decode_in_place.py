"""A decode step updates its donated caches in place: the compiled program copies no cache
array, at batch 1 too (checked on the program, not by timing).

At batch 1 XLA turns a one-update scatter into a dynamic-update-slice, and on CPU a
dynamic-update-slice of a buffer the same program also reads was done on two to four
copies of the whole buffer: every batch-1 decode step copied the whole KV cache (a mid
Llama's step at 16k tokens took 8.5x as long; `gsm_jax.in_place.scatter_set`,
docs/performance_notes.md). Llama (dense KV, float and int8 with block scales), Gemma 3
(sliding window), DeepSeek-V4 (window ring, each CSA / HCA layer's compressed KV, index
keys and their compressor rings: its `_write_rows` was a one-row `.at[].set` whose select
copied them every step) and DeepSeek-V4.1 (window ring, shared compressed KV and index
keys), tiny random configs whose caches are long enough that no other array has their
shape."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[\d,]*\} copy\(")


def _llama(kv: str | None):
    from gsm_jax.models import llama

    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=4096, kv_cache_dtype=kv)
    return llama, cfg, llama.unstack_layers(llama.init_weights(cfg, jax.random.key(0)))


def _family(name: str):
    """(family module, config, weights), the config's positions raised to the test's cache."""
    if name in ("llama", "llama-int8"):
        return _llama("int8" if name.endswith("int8") else None)
    from test_family_contract import tiny_dsv41, tiny_gemma3
    from tiny_models import tiny_dsv4

    from gsm_jax.families import family_module

    p = {"gemma3": tiny_gemma3, "deepseek-v4": tiny_dsv4, "deepseek-v4.1": tiny_dsv41}[name]()
    cfg = dataclasses.replace(p.config, max_position_embeddings=4096)
    return family_module(cfg.family), cfg, p.weights


def _copied_shapes(fam, cfg, weights, batch: int, context: int) -> tuple[set, set]:
    """(shapes of the cache's arrays, shapes the compiled decode step copies)."""
    cache = fam.init_cache(cfg, batch, context, dtype=jnp.float32)
    cache = cache.replace(lengths=jnp.full((batch,), context // 2, jnp.int32))

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(w, tok, cache):
        logits, cache = fam.decode_step(w, cfg, tok, cache, None)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    text = step.lower(weights, jnp.zeros((batch,), jnp.int32), cache).compile().as_text()
    big = {tuple(x.shape) for x in jax.tree.leaves(cache)
           if getattr(x, "ndim", 0) >= 2 and x.size >= batch * context}
    copied = {tuple(int(d) for d in m.group(2).split(",") if d) for m in COPY.finditer(text)}
    return big, copied


@pytest.mark.parametrize("name", ["llama", "llama-int8", "gemma3", "deepseek-v4",
                                  "deepseek-v4.1"])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_copies_no_cache_array(name, batch):
    fam, cfg, weights = _family(name)
    big, copied = _copied_shapes(fam, cfg, weights, batch, context=1536)
    assert big, "no cache array found"
    assert not big & copied, f"{name} batch {batch}: the step copies cache arrays {big & copied}"


def test_scatter_set_equals_at_set_and_stays_a_scatter():
    """`in_place.scatter_set` writes what ``.at[index].set`` writes (one update and many,
    separated and adjacent index arrays, "drop" dropping an out-of-range slot), and a
    single update compiles to a scatter, not a dynamic-update-slice."""
    from gsm_jax.in_place import scatter_set

    buf = jnp.arange(2 * 3 * 7 * 4, dtype=jnp.float32).reshape(2, 3, 7, 4)
    cases = [  # (index, values shape, mode)
        ((jnp.arange(1), slice(None), jnp.asarray([5])), (1, 3, 4), "promise_in_bounds"),
        ((jnp.arange(2), slice(None), jnp.asarray([5, 2])), (2, 3, 4), "promise_in_bounds"),
        ((jnp.arange(1)[:, None], slice(None), jnp.asarray([[7]])), (1, 1, 3, 4), "drop"),
        ((jnp.arange(2)[:, None], slice(None), jnp.asarray([[1, 7], [3, 0]])), (2, 2, 3, 4),
         "drop"),
        ((jnp.int32(1), jnp.arange(1), jnp.asarray([6])), (1, 4), "promise_in_bounds"),
    ]
    for index, shape, mode in cases:
        values = -jnp.arange(int(jnp.prod(jnp.asarray(shape))), dtype=jnp.float32).reshape(shape)
        got = scatter_set(buf, index, values, mode=mode)
        want = buf.at[index].set(values, mode=mode)
        assert bool(jnp.array_equal(got, want)), (index, mode)
    text = jax.jit(lambda b, v, s: scatter_set(b, (jnp.arange(1), slice(None), s), v,
                                               mode="promise_in_bounds")).lower(
        buf[:1], jnp.ones((1, 3, 4)), jnp.asarray([2])).compile().as_text()
    assert "scatter" in text and "dynamic-update-slice(" not in text
    with pytest.raises(ValueError, match="index array"):
        scatter_set(buf, (slice(None), jnp.arange(1)), buf[:, :1], mode="drop")
