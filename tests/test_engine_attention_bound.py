"""The serving engine's decode step reads what its rows hold, not the `max_len` it allocated
(issue 24, item 4), checked on the compiled program rather than by timing; and the bounded
reads give the tokens the whole-cache engine gives (which tests/test_engine.py checks
against `generate_tokens` run on each request alone): Llama and Gemma 3 (sliding window),
GSM off and on, rows crossing every bound, a chunked prefill. DeepSeek-V4's caches have
their own sizes: not bounded."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gsm_jax
from gsm_jax.errors import InvalidInputError
from gsm_jax.params import ModelParams
from gsm_jax.serving.engine import Engine, Request

BIG = 8192  # max_len of the structural check
SHAPE = re.compile(r"\b(?:f32|bf16|f16|pred|s32)\[([\d,]+)\]")


def _peaked(weights):
    """Matrices x5: peaked logits, so greedy choices are far from ties."""
    return jax.tree.map(lambda a: a * 5 if a.ndim >= 2 else a, weights)


def tiny_llama() -> ModelParams:
    from gsm_jax.models import llama

    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=BIG, eos_token_ids=(3,))
    return ModelParams(_peaked(llama.init_weights(cfg, jax.random.key(0))), cfg, None,
                       "tiny-llama")


def tiny_gemma3() -> ModelParams:
    """A sliding layer (window 5: rows of 5-60 tokens attend past its edge) and a global."""
    from gsm_jax.models import gemma3

    cfg = gemma3.Gemma3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, sliding_layers=(True, False), sliding_window=5,
        query_pre_attn_scalar=12.0, max_position_embeddings=256)
    return ModelParams(_peaked(gemma3.init_weights(cfg, jax.random.key(1))), cfg, None,
                       "tiny-gemma3")


GSM = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.3, window_size=4,
                        protect_first=1, short_request_tokens=0)


@pytest.fixture(scope="module")
def llama_params():
    return tiny_llama()


def _attention_dims(hlo: str) -> list[tuple[int, ...]]:
    """The shapes of every instruction of the compiled program under the layers'
    `attention` named scope (the decode attention's products, softmax and mask)."""
    dims = []
    for line in hlo.splitlines():
        if "/attention/" not in line:
            continue
        body = line.split("metadata=")[0]
        dims += [tuple(int(d) for d in m.split(",")) for m in SHAPE.findall(body)]
    return dims


INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(\S+)\s+([\w\-]+)\(")
COMP = re.compile(r"^\s*(?:ENTRY\s+)?(%\S+)\s*\(.*\{\s*$")
IN_PLACE = {"dynamic-update-slice", "scatter"}  # the step's one-slot writes
FREE = {"parameter", "get-tuple-element", "bitcast", "tuple"}


def _big_ops(hlo: str) -> set[str]:
    """The kinds of the compiled program's instructions whose result has a BIG dimension
    (a fusion by its root's kind), other than parameters, bitcasts and tuples."""
    roots, comp, found = {}, None, []
    for line in hlo.splitlines():
        if m := COMP.match(line):
            comp = m.group(1)
        elif (m := INSTR.match(line)) is not None:
            shape, op = m.groups()
            if line.lstrip().startswith("ROOT") and comp is not None:
                roots[comp] = op
            if op not in FREE and not shape.startswith("(") and BIG in tuple(
                    int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[")[-1])):
                calls = re.search(r"calls=(%[\w.\-]+)", line)
                found.append((op, calls.group(1) if calls else None))
    return {roots.get(c, "?") if op == "fusion" else op for op, c in found}


def test_decode_program_reads_only_what_rows_hold(llama_params):
    """max_len 8192, one row holding 64 tokens: the compiled decode step's attention works
    on 128 slots (the power of two above 64); the whole-cache program (min_attend=None)
    on 8192. The donated cache itself stays whole: with per-layer weights and caches (how
    `gsm_jax.load` gives them), nothing of the bounded program but the one-slot in-place
    writes touches an 8192-slot array (no copy of the cache, no read past the bound)."""
    from gsm_jax.models.common import unstack_layers

    params = dataclasses.replace(llama_params, weights=unstack_layers(llama_params.weights))
    prompt = np.random.default_rng(0).integers(4, 64, 63).tolist()
    programs = {}
    for min_attend in (128, None):
        eng = Engine(params, max_batch=1, max_len=BIG, eos_ids=[], min_attend=min_attend,
                     async_scheduling=False)  # the decode token is read back in `step`
        rec = eng.submit(Request(prompt, 8))
        eng.step()  # prefill (63 tokens) and one decode step: the row holds 64 tokens
        assert rec.prompt_len + rec.n_tokens - 1 == 64
        assert eng._cache.max_len == BIG
        programs[min_attend] = eng.lower_decode().compile().as_text()
        assert eng.attend_bound(64) == (128 if min_attend else None)
    bounded, whole = _attention_dims(programs[128]), _attention_dims(programs[None])
    assert bounded and whole, "no instruction under the attention scope: metadata changed?"
    assert any(BIG in d for d in whole)  # the check sees the 8192 slots when they are read
    assert not any(BIG in d for d in bounded), sorted({d for d in bounded if BIG in d})
    assert any(128 in d for d in bounded)
    assert _big_ops(programs[128]) <= IN_PLACE, _big_ops(programs[128])
    assert not _big_ops(programs[None]) <= IN_PLACE  # the whole-cache reads are seen


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bounded_reads_equal_whole_reads(llama_params, family, n=16):
    """The model's steps on a cache bounded to n slots (`common.bound_reads`) equal them
    on the whole cache (64 slots), at the edge (a row holding n - 1 tokens writes slot
    n - 1, the last one read): decode logits and caches, and a chunk's extend. float32;
    the two sides sum the same nonzero terms over 16 or 64 slots (the rest exp(-1e30)
    = 0), so they agree to a few ulps of the logit scale."""
    from gsm_jax.families import family_module
    from gsm_jax.models import common

    params = llama_params if family == "llama" else tiny_gemma3()
    fam, cfg = family_module(family), params.config
    rng = np.random.default_rng(5)
    lengths = np.array([n - 1, 9], np.int32)
    tokens = rng.integers(4, 64, (2, n)).astype(np.int32)
    cache = fam.init_cache(cfg, 2, 64)
    _, cache = jax.jit(fam.prefill, static_argnums=1)(params.weights, cfg, tokens, lengths,
                                                      cache)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def decode(w, cfg, bound, toks, cache):
        return fam.decode_step(w, cfg, toks, common.bound_reads(cache, bound))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def extend(w, cfg, bound, toks, cache):
        return fam.extend(w, cfg, toks, jnp.asarray([8, 5]), common.bound_reads(cache, bound))

    step = jnp.asarray([7, 11], jnp.int32)
    (la, ca), (lb, cb) = (decode(params.weights, cfg, b, step, cache) for b in (n, None))
    assert ca.attend is None and cb.attend is None
    scale = float(np.abs(np.asarray(lb)).max())
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=0, atol=2e-5 * scale)
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=2e-5 * scale)
    chunk = rng.integers(4, 64, (2, 8)).astype(np.int32)  # positions up to n + 6 < 2n
    (ea, _), (eb, _) = (extend(params.weights, cfg, b, chunk, cache) for b in (2 * n, None))
    np.testing.assert_allclose(np.asarray(ea), np.asarray(eb), rtol=0,
                               atol=2e-5 * float(np.abs(np.asarray(eb)).max()))


def test_attend_bounds_and_refusals(llama_params):
    eng = Engine(llama_params, max_batch=1, max_len=1000, eos_ids=[], min_attend=64)
    assert [eng.attend_bound(n) for n in (0, 63, 64, 200, 511, 512, 999)] == \
        [64, 64, 128, 256, 512, None, None]
    assert eng.attend_bounds() == [64, 128, 256, 512, None]
    for bad in (0, 3, 100, True, 2.0):
        with pytest.raises(InvalidInputError, match="min_attend"):
            Engine(llama_params, max_batch=1, max_len=64, min_attend=bad)
    from tiny_models import tiny_dsv4

    dsv4 = Engine(tiny_dsv4(), max_batch=1, max_len=64, eos_ids=[])
    assert dsv4.attend_bound(10) is None and dsv4.attend_bounds() == [None]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bounded_engine_equals_whole_cache_engine(llama_params, family):
    """Bounds from 16 up (max_len 64: 16, 32, then the whole cache): rows of different
    lengths share steps and cross every bound; a 40-token prompt is prefilled in chunks
    of 16 (its extends bounded too); GSM compiled in, requests smoothed and not in one
    batch. Greedy tokens = the engine reading the whole cache every step (min_attend=None,
    the engine before bounded reads, itself equal to `generate_tokens` alone:
    tests/test_engine.py). Its whole-cache programs are the bounded engine's last bound's,
    so the reference compiles nothing new."""
    params = llama_params if family == "llama" else tiny_gemma3()
    rng = np.random.default_rng(3)
    shapes = [(5, 40, GSM), (40, 20, None), (12, 50, GSM)]
    reqs = [Request(rng.integers(4, 64, n).tolist(), m, request_id=f"r{i}", gsm=g)
            for i, (n, m, g) in enumerate(shapes)]
    recs = {}
    for min_attend in (16, None):
        eng = Engine(params, max_batch=2, max_len=64, compile_gsm=True, eos_ids=[],
                     min_attend=min_attend, prefill_chunk=16)
        assert eng.attend_bounds() == ([16, 32, None] if min_attend else [None])
        recs[min_attend] = eng.run(reqs)
    for req, a, b in zip(reqs, recs[16], recs[None], strict=True):
        assert a.n_tokens == b.n_tokens == req.max_new_tokens
        assert a.gsm == b.gsm == (req.gsm is not None)
        assert a.tokens == b.tokens, req.request_id


# ----------------------------------------------------------------------------- row bounds


def test_decode_program_runs_only_the_rows_in_use(llama_params):
    """max_batch 16, one request in slot 0: the decode step is compiled for one row (logits
    [1, V], no batch-16 array in its attention), the whole-batch engine (bound_rows=False)
    for 16; both
    bounds on slots too. `rows_bound` is the power of ROW_BOUND_FACTOR above the highest
    running slot,
    None at max_batch; refused on a DeepSeek cache (its caches are not cut)."""
    prompt = np.random.default_rng(1).integers(4, 64, 20).tolist()
    vocab = llama_params.config.vocab_size
    for bound_rows, batch in ((True, 1), (False, 16)):  # 16: no other size of the model
        eng = Engine(llama_params, max_batch=16, max_len=256, eos_ids=[],
                     bound_rows=bound_rows)
        eng.submit(Request(prompt, 8))
        eng.step()
        lowered = eng.lower_decode()
        assert lowered.out_info[0].shape == (batch, vocab)
        dims = _attention_dims(lowered.compile().as_text())
        assert dims and any(128 in d for d in dims)  # the slot bound, both ways
        assert any(16 in d for d in dims) == (not bound_rows), dims
    from gsm_jax.serving.engine import ROW_BOUND_FACTOR as F

    eng = Engine(llama_params, max_batch=F**2 + 1, max_len=256, eos_ids=[])
    act = np.zeros(F**2 + 1, bool)
    assert eng.rows_bound(act) == 1
    for slot, want in ((0, 1), (1, F), (F - 1, F), (F, F**2), (F**2 - 1, F**2), (F**2, None)):
        act[:] = False
        act[slot] = True
        assert eng.rows_bound(act) == want, slot
    assert eng.rows_bounds() == [1, F, F**2, None]
    from tiny_models import tiny_dsv4

    dsv4 = Engine(tiny_dsv4(), max_batch=4, max_len=64, eos_ids=[])
    assert dsv4.rows_bound(np.ones(4, bool)) is None and dsv4.rows_bounds() == [None]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_row_bounded_engine_equals_whole_batch_engine(llama_params, family):
    """max_batch 5 (row bounds 1, 2, 4, all at ROW_BOUND_FACTOR 2): requests arrive and
    finish so the running slots go 1 -> 3 -> 5 -> fewer, and a late one takes the lowest
    free slot; GSM on for some rows (their rings cut and put back), a seeded sampled row, a
    penalized row. Every request's tokens equal those of the engine stepping all 5 slots
    every step (bound_rows=False), and after the run the caches agree (lengths exactly;
    the k / v slots the rows hold to float tolerance: a one-row step may sum in another
    order than a five-row one). The GSM rings of running rows feed the smoothed rows'
    tokens; a freed row's ring is junk either way (the whole-batch step keeps computing it
    as an idle row; an admission overwrites it)."""
    from gsm_jax.serving.engine import ROW_BOUND_FACTOR as F

    params = llama_params if family == "llama" else tiny_gemma3()
    rng = np.random.default_rng(7)
    shapes = [(6, 24, GSM, {}), (9, 6, None, {"temperature": 0.8, "seed": 3}),
              (4, 10, GSM, {"frequency_penalty": 0.5}), (7, 12, None, {}), (5, 8, GSM, {}),
              (3, 5, None, {})]
    arrive = [0, 2, 3, 14, 4, 5]  # at engine steps
    prompts = [rng.integers(4, 64, n).tolist() for n, _, _, _ in shapes]
    outs, caches = {}, {}
    for bound_rows in (True, False):
        eng = Engine(params, max_batch=5, max_len=64, compile_gsm=True, eos_ids=[],
                     bound_rows=bound_rows)
        bounds = eng.rows_bounds()
        assert bounds == ([b for b in (1, F, F * F) if b < 5] + [None] if bound_rows
                          else [None])
        recs, seen_rows = [], set()
        for step in range(80):
            for i, at in enumerate(arrive):
                if at == step:
                    _, m, g, kw = shapes[i]
                    recs.append(eng.submit(Request(prompts[i], m, request_id=f"q{i}", gsm=g,
                                                   **kw)))
            if not eng.has_work and step > max(arrive):
                break
            seen_rows.add(eng.rows_bound(np.array([s is not None for s in eng.slots])))
            eng.step()
        assert not eng.has_work
        if bound_rows:
            assert seen_rows == set(bounds), seen_rows  # every bound stepped
        outs[bound_rows] = [list(r.tokens) for r in recs]
        caches[bound_rows] = eng._cache
    assert outs[True] == outs[False]
    a, b = caches[True], caches[False]
    lengths = np.asarray(b.lengths)
    np.testing.assert_array_equal(np.asarray(a.lengths), lengths)
    # the slots each row holds (the whole-batch step also writes junk at an idle row's
    # next slot, which is never read: overwritten by the next admission)
    held = np.arange(64)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(np.where(held[..., None], x, 0),
                                   np.where(held[..., None], y, 0), rtol=0,
                                   atol=1e-4 * max(1.0, float(np.abs(y).max())))

