"""Automatic prefix caching (`gsm_jax/serving/prefix_cache.py`): a prompt that starts with the
chunks of an earlier one resumes from the state the earlier prefill reached there, GSM rings
included, and its output is the engine's with caching off, bit for bit; the keys, the LRU
bound and the refusals.

The model is the engine tests' tiny Llama (weights x5: peaked logits, and GSM at 0.3 visibly
changes the tokens) with a 16-token prefill chunk, so a 40-token prompt has boundaries at 16
and 32; GSM window 5 puts both boundaries mid-window (16 and 32 are not multiples of 5), the
case where a resumed filter must find the previous chunk's last inputs in its ring."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny_models import tiny_dsv4

import gsm_jax
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.models.common import KVCache
from gsm_jax.params import ModelParams
from gsm_jax.serving.engine import Engine, Request
from gsm_jax.serving.prefix_cache import PrefixCache

CHUNK = 16
GSM = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.3, window_size=5,
                        protect_first=1)


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=256, eos_token_ids=(3,))
    weights = llama.init_weights(cfg, jax.random.key(0))
    weights = jax.tree.map(lambda a: a * 5 if a.ndim >= 2 else a, weights)
    return ModelParams(weights, cfg, None, "tiny")


def _shared_prefix_requests(vocab: int, seed: int = 3) -> list[Request]:
    """Six requests over a 37-token shared prefix (boundaries 16 and 32 inside it): two
    identical prompts, three different tails (one ending right after the prefix), and one
    that shares only the first chunk."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(4, vocab, size=37).tolist()
    tail = lambda n: rng.integers(4, vocab, size=n).tolist()  # noqa: E731
    other = prefix[:20] + tail(21)
    prompts = [prefix + tail(9), prefix + tail(9), prefix + tail(30), prefix + [5],
               other, prefix + tail(2)]
    prompts[1] = list(prompts[0])
    return [Request(p, 6, request_id=f"p{i}") for i, p in enumerate(prompts)]


def _serve(params, reqs, gsm, capacity, **kw):
    eng = Engine(params, max_batch=2, max_len=96, gsm=gsm, eos_ids=[], prefill_chunk=CHUNK,
                 prefix_cache_bytes=capacity, **kw)
    # one after another: each request sees the states every earlier one kept (`run`
    # starts a fresh `step_times` each call: the calls of all of them are in `eng.calls`);
    # after each, the running cache (every layer's KV and GSM ring of the row the request
    # held, what the tokens only sample) goes to `eng.states`
    recs, eng.calls, eng.states = [], [], []
    for r in reqs:
        recs.append(eng.run([r])[0])
        eng.calls += [kind for kind, _, _ in eng.step_times]
        eng.states.append([np.asarray(a) for a in jax.tree.leaves(eng._cache)])
    return eng, [np.asarray(r.tokens) for r in recs]


def _assert_same(eng_on, on, eng_off, off):
    """Tokens, and the whole running cache after each request, bit for bit."""
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"request {i}")
        for j, (x, y) in enumerate(zip(eng_on.states[i], eng_off.states[i], strict=True)):
            np.testing.assert_array_equal(x, y, err_msg=f"request {i}, cache leaf {j}")


@pytest.mark.parametrize("gsm", [None, GSM, GSM.replace(window_size="adaptive")],
                         ids=["no_gsm", "gsm_w5", "gsm_adaptive"])
def test_hits_equal_caching_off(tiny, gsm):
    reqs = _shared_prefix_requests(tiny.config.vocab_size)
    eng_off, off = _serve(tiny, reqs, gsm, 0)
    eng_on, on = _serve(tiny, reqs, gsm, 1 << 24)
    assert eng_off.prefix_cache_stats() is None
    _assert_same(eng_on, on, eng_off, off)
    st = eng_on.prefix_cache_stats()
    # p0 cold (keeps 16, 32); p1, p2, p3, p5 resume at 32 (p2 keeps its 48 and 64); p4 at
    # 16 (it shares one chunk) and keeps its own 32
    assert st["hits_tokens"] == 4 * 32 + 16, st
    assert st["queries_tokens"] == sum(len(r.prompt) for r in reqs)
    assert st["entries"] == 5 and st["evictions"] == 0
    assert eng_on.calls.count("restore") == 5 and eng_on.calls.count("prefill") == 1
    assert eng_off.calls.count("prefill") == 6 and "restore" not in eng_off.calls
    if gsm is not None:  # the smoothed run is a different model: caching hides no GSM effect
        plain = _serve(tiny, reqs, None, 0)[1]
        assert any(not np.array_equal(a, b) for a, b in zip(on, plain, strict=True))


def test_gsm_config_and_protect_first_are_part_of_the_key(tiny):
    """A state smoothed by one config is never resumed by a request of another (or by an
    unsmoothed one): each has its own entries, and each output equals caching off."""
    reqs = _shared_prefix_requests(tiny.config.vocab_size)[:2]
    configs = [GSM, GSM.replace(smooth_strength=0.2), GSM.replace(protect_first=0), None]
    eng = Engine(tiny, max_batch=2, max_len=96, gsm=GSM, eos_ids=[], prefill_chunk=CHUNK,
                 prefix_cache_bytes=1 << 24)
    ref = Engine(tiny, max_batch=2, max_len=96, gsm=GSM, eos_ids=[], prefill_chunk=CHUNK)
    for cfg in configs:
        for r in reqs:
            r = Request(r.prompt, r.max_new_tokens, request_id=r.request_id, gsm=cfg)
            got, want = eng.run([r])[0], ref.run([r])[0]
            np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=repr(cfg))
    st = eng.prefix_cache_stats()
    assert st["entries"] == 2 * len(configs), st  # boundaries 16 and 32 per config
    assert st["hits_tokens"] == 32 * len(configs)  # only the second prompt of each config


def _row(pool, pages, slot: int) -> np.ndarray:
    """Row `slot` of a paged layer [K, S, hd], read through its page table."""
    got = np.asarray(pool)[np.asarray(pages)[slot]]  # [pages, K, page, hd]
    return np.concatenate(list(got), axis=1)


def test_snapshot_restore_is_the_block_bit_for_bit(tiny):
    """A kept dense state is one chunk's slots (a quarter of a 64-slot row at 16) and the
    GSM rings after it; restoring it into another slot gives that slot the same first 16
    slots, rings and length, exactly; the kept copy survives the running cache being
    donated to the next calls."""
    eng = Engine(tiny, max_batch=2, max_len=64, gsm=GSM, eos_ids=[], prefill_chunk=CHUNK,
                 prefix_cache_bytes=1 << 24)
    prompt = list(range(4, 4 + 2 * CHUNK + 3))
    eng.run([Request(prompt, 2)])  # slot 0; keeps the blocks of boundaries 16 and 32
    kept = eng._call("snapshot", CHUNK, eng._cache, np.int32(0), np.int32(0))
    assert isinstance(kept, KVCache) and kept.max_len == CHUNK and kept.rings is not None
    assert eng._cache.pages is not None  # the engine's cache is a pool of pages
    per_token = sum(a.nbytes for a in jax.tree.leaves(eng._cache.k + eng._cache.v)) // (
        eng.kv_cache_tokens)
    assert sum(a.nbytes for a in jax.tree.leaves(kept.k + kept.v)) == CHUNK * per_token
    before = [np.asarray(a) for a in jax.tree.leaves(kept)]
    # slot 1 gets the pages slot 0 did not hold (slot 0's table still names its pages)
    held = np.asarray(eng._cache.pages)[0]
    other = np.setdiff1d(np.arange(eng.paged[0]), held)[:held.size].astype(np.int32)
    eng._cache = eng._call("restore", CHUNK, eng._cache, kept, np.int32(1), np.int32(0), other)
    c = eng._cache
    np.testing.assert_array_equal(np.asarray(c.pages)[1], other)
    for a in c.k + c.v:
        np.testing.assert_array_equal(_row(a, c.pages, 1)[:, :CHUNK],
                                      _row(a, c.pages, 0)[:, :CHUNK])
    for r, k in zip(c.rings, kept.rings, strict=True):
        np.testing.assert_array_equal(np.asarray(r)[:, 1], np.asarray(k)[:, 0])
    assert int(c.lengths[1]) == CHUNK
    eng.run([Request(prompt[:5], 2)])  # more calls donate the running cache
    assert all(not a.is_deleted() for a in jax.tree.leaves(kept))
    for a, b in zip(jax.tree.leaves(kept), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_other_families_keep_whole_rows_and_equal_caching_off():
    """DeepSeek-V4 (sliding-window, compressed and index-key caches, compressor state,
    no KVCache): its rows are kept whole, and resumed prompts equal caching off."""
    params = tiny_dsv4()
    reqs = _shared_prefix_requests(params.config.vocab_size)[:3]
    gsm = GSM.replace(window_size=4)
    eng_off, off = _serve(params, reqs, gsm, 0)
    eng_on, on = _serve(params, reqs, gsm, 1 << 26)
    _assert_same(eng_on, on, eng_off, off)
    assert eng_on.prefix_cache_stats()["hits_tokens"] == 2 * 32


def test_lru_within_the_byte_bound():
    cache = PrefixCache(300, block=4)
    rows = lambda n: np.zeros(n, np.uint8)  # noqa: E731  (bytes = n)
    a, b, c = (cache.keys(np.arange(s, s + 9), b"ctx") for s in (0, 100, 200))
    assert [t for t, _ in a] == [4, 8]  # boundaries strictly inside 9 tokens
    assert cache.keys(np.arange(8), b"ctx")[-1][0] == 4  # 8 tokens: the last chunk runs
    assert cache.keys(np.arange(9), b"other")[0][1] != a[0][1]  # the context is in the key
    assert cache.keys(np.arange(9), b"ctx") == a  # deterministic
    assert cache.store(a[0][1], 4, rows(100)) and cache.store(a[1][1], 8, rows(100), start=4)
    assert cache.store(b[0][1], 4, rows(100))
    # not KV blocks (whole rows): the longest boundary alone is the state
    assert [s for s, _ in cache.lookup_chain(a, 9)] == [4]  # a's entries become the newest
    assert cache.store(c[0][1], 4, rows(100))  # evicts b's, the least recently used
    assert cache.lookup_chain(b, 9) == [] and [s for s, _ in cache.lookup_chain(c, 9)] == [0]
    assert not cache.store(c[1][1], 8, rows(301))  # larger than the bound: not kept
    st = cache.stats()
    assert (st["entries"], st["bytes"], st["evictions"]) == (3, 300, 1), st
    assert st["hits_tokens"] == 12 and st["queries_tokens"] == 27


def test_refusals(tiny):
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(InvalidInputError, match="prefix_cache_bytes must be an integer"):
            Engine(tiny, max_len=64, prefix_cache_bytes=bad)
    with pytest.raises(InvalidInputError, match="prefix caching needs chunked prefill"):
        Engine(tiny, max_len=64, prefill_chunk=None, prefix_cache_bytes=1 << 20)
