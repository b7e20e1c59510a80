"""Attention reads what the rows hold, not the `max_len` allocated, with the length as
run-time data (issue 42): `cache_attention` against a float64 reference, a row's result
independent of the other rows' lengths bit for bit, one decode program per row bound for
every max_len (checked on the compiled program, not by timing), the same tokens at two
cache sizes; and the row bounds (a step runs the first 1, 2, 4, ... slots)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gsm_jax
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


def _attention_dims(hlo: str, results: bool = False) -> list[tuple[int, ...]]:
    """The shapes of every instruction of the compiled program under the layers'
    `attention` named scope (the decode attention's products, softmax and mask), operands
    included (`results`: the instructions' own shapes only: a block read's operand is the
    whole cache)."""
    dims = []
    for line in hlo.splitlines():
        if "/attention/" not in line:
            continue
        body = line.split("metadata=")[0]
        if results:
            body = body.split("=", 1)[-1].split("(", 1)[0]
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


def _exact_attention(q, k, v, positions, window=None, scale=None):
    """The plain reference: per row and query, softmax over the slots <= its position
    (and within `window` of it), in float64. q [B, T, H, hd]; k, v [B, K, S, hd]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, hd = q.shape
    kh, s = k.shape[1], k.shape[2]
    out = np.zeros((b, t, h, hd))
    for i in range(b):
        for j in range(t):
            p = positions[i, j]
            if p < 0:
                continue
            seen = np.arange(s) <= p
            if window is not None:
                seen &= p - np.arange(s) < window
            for head in range(h):
                kv = head // (h // kh)
                sc = (k[i, kv] @ q[i, j, head]) * (hd**-0.5 if scale is None else scale)
                sc = np.where(seen, sc, -np.inf)
                w = np.exp(sc - sc.max())
                out[i, j, head] = (w / w.sum()) @ v[i, kv]
    return out.reshape(b, t, h * hd)


@pytest.mark.parametrize("s, block", [(64, 16), (100, 32), (40, 128)],
                         ids=["blocks_fit", "last_block_overlaps", "one_block"])
@pytest.mark.parametrize("kind", ["float", "int8"])
def test_cache_attention_equals_exact_softmax(s, block, kind):
    """`cache_attention` (blocks up to the longest row, online softmax) against a float64
    loop: rows of different lengths (one inside the first block, one crossing blocks, one
    at the last slot), padding queries, a chunk of queries (extend) and one (decode), a
    sliding window, an int8 cache (its dequantized values are the reference's). float32
    sums of <= 100 terms of magnitude <= 1: 2e-6 relative."""
    from gsm_jax.models import common

    rng = np.random.default_rng(s + block)
    b, h, kh, hd = 3, 4, 2, 32
    k = rng.standard_normal((b, kh, s, hd)).astype(np.float32)
    v = rng.standard_normal((b, kh, s, hd)).astype(np.float32)
    piece = (k, v)
    if kind == "int8":
        (kq, ks), (vq, vs) = (common.kv_quantize(jnp.asarray(a), "int8") for a in (k, v))
        piece = (kq, vq, ks, vs)
        k = np.asarray(common.kv_dequantize(kq, ks, jnp.float32))
        v = np.asarray(common.kv_dequantize(vq, vs, jnp.float32))
    for t, positions in ((1, np.array([[3], [block + 5], [s - 1]])),
                         (4, np.array([[0, 1, 2, -1], [block - 2, block - 1, block, block + 1],
                                       [s - 4, s - 3, s - 2, s - 1]]))):
        positions = np.where(positions >= 0, np.minimum(positions, s - 1), -1)  # in the cache
        q = rng.standard_normal((b, t, h, hd)).astype(np.float32)
        for window in (None, 7):
            narrow = None if window is None else (
                lambda mask, slots, pos=positions, w=window:
                mask & (pos[:, :, None] - slots[None, None, :] < w))
            got = common.cache_attention(jnp.asarray(q), tuple(map(jnp.asarray, piece)),
                                         jnp.asarray(positions), narrow, block=block)
            want = _exact_attention(q, k, v, positions, window)
            real = (positions >= 0)[..., None]
            np.testing.assert_allclose(np.where(real, np.asarray(got), 0),
                                       np.where(real, want, 0), rtol=2e-6, atol=2e-6)


def test_other_rows_lengths_do_not_change_a_row_bit_for_bit():
    """The trip count is the longest row's; the blocks past a row's length are fully
    masked and leave its numbers exactly as they were: row 0's output is the same bits
    whether row 1 holds 3 slots or 200 (and whatever the cache holds past row 0's
    length)."""
    from gsm_jax.models import common

    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((2, 2, 256, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, 256, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    outs = [np.asarray(common.cache_attention(q, (k, v), jnp.asarray([[40], [other]])))[0]
            for other in (3, 200, 255)]
    junk = (k.at[0, :, 41:].set(1e3), v.at[0, :, 41:].set(-7.0))
    outs.append(np.asarray(common.cache_attention(q, junk, jnp.asarray([[40], [255]])))[0])
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_one_decode_program_for_every_max_len(llama_params):
    """max_len 8192, one row holding 64 tokens: the engine's one decode program per row
    bound loops over cache blocks (a `while` whose trip count is run-time data), and with
    per-layer weights and caches (how `gsm_jax.load` gives them) nothing of it but the
    one-slot in-place writes makes an 8192-slot array (no copy of the cache; the reads
    are 128-slot blocks). The same engine at max_len 1024 plans the same programs."""
    from gsm_jax.models.common import unstack_layers

    params = dataclasses.replace(llama_params, weights=unstack_layers(llama_params.weights))
    prompt = np.random.default_rng(0).integers(4, 64, 63).tolist()
    eng = Engine(params, max_batch=1, max_len=BIG, eos_ids=[],
                 async_scheduling=False)  # the decode token is read back in `step`
    rec = eng.submit(Request(prompt, 8))
    eng.step()  # prefill (63 tokens) and one decode step: the row holds 64 tokens
    assert rec.prompt_len + rec.n_tokens - 1 == 64
    assert eng._cache.max_len == BIG
    hlo = eng.lower_decode().compile().as_text()
    dims = _attention_dims(hlo, results=True)
    assert dims, "no instruction under the attention scope: metadata changed?"
    assert any(128 in d for d in dims) and not any(BIG in d for d in dims), sorted(set(dims))
    assert " while(" in hlo or "while(" in hlo
    assert _big_ops(hlo) <= IN_PLACE, _big_ops(hlo)
    small = Engine(params, max_batch=1, max_len=1024, eos_ids=[])  # >= a chunk (512)
    assert small.programs.keys() == eng.programs.keys()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_engine_tokens_do_not_depend_on_max_len(llama_params, family):
    """Rows of different lengths share steps and cross cache blocks (128 slots, and a
    200-token cache's last block overlaps the one before); a 40-token prompt is prefilled
    in chunks of 16; GSM compiled in, requests smoothed and not in one batch; Gemma's
    sliding window (5) inside and across blocks. Greedy tokens at max_len 200 = at 256
    (the engine itself equals `generate_tokens` alone: tests/test_engine.py)."""
    params = llama_params if family == "llama" else tiny_gemma3()
    rng = np.random.default_rng(3)
    shapes = [(5, 130, GSM), (40, 20, None), (12, 140, GSM)]
    reqs = [Request(rng.integers(4, 64, n).tolist(), m, request_id=f"r{i}", gsm=g)
            for i, (n, m, g) in enumerate(shapes)]
    recs = {}
    for max_len in (200, 256):
        eng = Engine(params, max_batch=2, max_len=max_len, compile_gsm=True, eos_ids=[],
                     prefill_chunk=16)
        recs[max_len] = eng.run(reqs)
    for req, a, b in zip(reqs, recs[200], recs[256], strict=True):
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
    for bound_rows, batch in ((True, 1), (False, 16)):  # 16: no other size of the model
        eng = Engine(llama_params, max_batch=16, max_len=256, eos_ids=[],
                     bound_rows=bound_rows)
        eng.submit(Request(prompt, 8))
        eng.step()
        lowered = eng.lower_decode()
        assert lowered.out_info[0].shape == (16,)  # the picks, padded: the next feed
        assert lowered.out_info[1][0].shape == (batch,)  # a log-probability per row run
        dims = _attention_dims(lowered.compile().as_text(), results=True)
        assert dims and any(128 in d for d in dims)  # the cache blocks, both ways
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

