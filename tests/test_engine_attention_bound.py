"""The serving engine's decode step reads what its rows hold, not the `max_len` it allocated
(issue 24, item 4), checked on the compiled program rather than by timing; and the bounded
reads give the tokens a whole-cache read gives (those of `generate_tokens` run on each
request alone): Llama and Gemma 3 (sliding window), GSM off and on, rows crossing several
bounds, a chunked prefill. DeepSeek-V4's caches have their own sizes: not bounded."""

from __future__ import annotations

import re

import jax
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


def test_decode_program_reads_only_what_rows_hold(llama_params):
    """max_len 8192, one row holding 64 tokens: the compiled decode step's attention works
    on 128 slots (the power of two above 64); the whole-cache program (min_attend=None)
    on 8192. The donated cache itself stays whole."""
    prompt = np.random.default_rng(0).integers(4, 64, 63).tolist()
    programs = {}
    for min_attend in (128, None):
        eng = Engine(llama_params, max_batch=1, max_len=BIG, eos_ids=[], min_attend=min_attend)
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
@pytest.mark.parametrize("gsm", [None, GSM], ids=["gsm_off", "gsm_on"])
def test_bounded_engine_equals_generate_alone(llama_params, family, gsm):
    """Two slots, bounds from 16 up: rows of different lengths share steps, cross 16, 32
    and 64 and reach the whole cache (None at 128); a 40-token prompt is prefilled in
    chunks of 16 (its extends bounded too). Greedy tokens = generate_tokens alone."""
    params = llama_params if family == "llama" else tiny_gemma3()
    rng = np.random.default_rng(3)
    shapes = [(5, 60), (40, 30), (12, 100)]
    reqs = [Request(rng.integers(4, 64, n).tolist(), m, request_id=f"r{i}")
            for i, (n, m) in enumerate(shapes)]
    eng = Engine(params, max_batch=2, max_len=128, gsm=gsm, eos_ids=[], min_attend=16,
                 prefill_chunk=16)
    assert eng.attend_bounds() == [16, 32, 64, None]
    recs = eng.run(reqs)
    for req, rec in zip(reqs, recs, strict=True):
        ref = gsm_jax.generate_tokens(params, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[], gsm=gsm, request_ids=[req.request_id])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(req.request_id))
        assert rec.gsm == (gsm is not None)
