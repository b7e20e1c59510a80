"""Generation behaviour: bad input, EOS/stop, sampling, bucketing of compilations."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import gsm_jax
from gsm_jax import generation
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.params import ModelParams


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "empty"),
        ([""], {}, "prompt 0 is empty"),
        (["ok", ""], {}, "prompt 1 is empty"),
        (["hello"], {"max_new_tokens": 0}, "max_new_tokens"),
        (["hello"], {"temperature": -1.0}, "temperature"),
        (["hello"], {"top_p": 1.5}, "top_p"),
        (["hello"], {"top_k": 0}, "top_k"),
        (["hello"], {"stop": [""]}, "stop"),
        ([3], {}, "not a string"),
    ],
)
def test_bad_text_input(smollm2, prompts, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        gsm_jax.generate(smollm2, prompts, **kwargs)


def test_prompt_longer_than_context(smollm2):
    ids = [5] * (smollm2.config.max_position_embeddings + 1)
    with pytest.raises(InvalidInputError, match="context of 8192"):
        gsm_jax.generate_tokens(smollm2, [ids], max_new_tokens=1)
    with pytest.raises(InvalidInputError, match="context"):
        gsm_jax.forward(smollm2, [ids])


def test_bad_token_input(tiny):
    with pytest.raises(InvalidInputError, match="empty"):
        gsm_jax.generate_tokens(tiny, [])
    with pytest.raises(InvalidInputError, match="prompt 1 is empty"):
        gsm_jax.generate_tokens(tiny, [[1], []])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        gsm_jax.generate_tokens(tiny, [[1, 64]])
    with pytest.raises(InvalidInputError, match="ModelParams"):
        gsm_jax.generate_tokens({"embed": 1}, [[1]])
    with pytest.raises(InvalidInputError, match="lengths"):
        gsm_jax.forward(tiny, np.ones((2, 4), np.int32), lengths=[0, 4])


def test_rows_stop_at_eos_and_max_new(tiny):
    rows = [[1, 2, 4, 5], [7, 8]]
    outs, logits = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=20, eos_ids=[],
                                           return_logits=True)
    assert [len(o) for o in outs] == [20, 20]
    # declare the token greedy decoding picks 5th as EOS: the row must end right there
    eos = int(outs[0][4])
    first = int(np.flatnonzero(outs[0] == eos)[0])
    outs2 = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=20, eos_ids=[eos])
    assert len(outs2[0]) == first + 1 and outs2[0][-1] == eos
    np.testing.assert_array_equal(outs2[0], outs[0][: first + 1])


def test_sampling_is_seeded(tiny):
    rows = [[1, 2, 4, 5], [7, 8]]
    kw = dict(max_new_tokens=24, temperature=1.5, eos_ids=[])
    a = gsm_jax.generate_tokens(tiny, rows, seed=1, **kw)
    b = gsm_jax.generate_tokens(tiny, rows, seed=1, **kw)
    c = gsm_jax.generate_tokens(tiny, rows, seed=2, **kw)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any((x != y).any() for x, y in zip(a, c, strict=True))


def test_top_k_one_is_greedy(tiny):
    rows = [[1, 2, 4, 5]]
    greedy = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=12, eos_ids=[])
    topk1 = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=12, eos_ids=[],
                                    temperature=2.0, top_k=1, seed=3)
    np.testing.assert_array_equal(greedy[0], topk1[0])


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    one = np.ones((1,))
    seen = set()
    # jitted once: called eagerly, its `lax.cond` (new closures each call) was traced and
    # compiled again on every one of the 200 draws (~65 CPU s); the program is the same
    sample = jax.jit(generation.sample_tokens, static_argnames="filtered")
    for s in range(200):
        tok = sample(
            logits, jax.random.key(s), one.astype(np.float32), np.zeros(1, np.int32),
            np.full(1, 0.7, np.float32), filtered=True)
        seen.add(int(tok[0]))
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut


def test_stop_strings_cut_text(smollm2):
    full = gsm_jax.generate(smollm2, ["def fib(n):"], max_new_tokens=24)[0]
    assert "return" in full
    cut = gsm_jax.generate(smollm2, ["def fib(n):"], max_new_tokens=24, stop="return")[0]
    assert cut == full[: full.index("return")]


def test_chat_template_is_applied(smollm2):
    out = gsm_jax.generate(smollm2, "What is the capital of France?", chat=True,
                           max_new_tokens=16)[0]
    assert "Paris" in out


def test_compilations_are_bucketed(tiny):
    """Different prompt lengths, batch sizes and max_new_tokens within a bucket: one compile."""
    # a config no other test uses, so every compile below is counted
    cfg = dataclasses.replace(tiny.config, vocab_size=65)
    tiny = ModelParams(llama.init_weights(cfg, jax.random.key(1)), cfg, None, "tiny65")
    before = generation._generate_loop._cache_size()
    for rows, n in [([[1, 2, 3]], 5), ([[1] * 9, [2] * 3], 9), ([[4] * 15, [5], [6]], 16)]:
        gsm_jax.generate_tokens(tiny, rows, max_new_tokens=n, eos_ids=[])
    # batch buckets 1, 2, 4 -> three shapes; prompt bucket 16 and new-token bucket 16 shared
    assert generation._generate_loop._cache_size() - before == 3
    gsm_jax.generate_tokens(tiny, [[1, 2]], max_new_tokens=3, eos_ids=[], temperature=0.5,
                            seed=9)
    assert generation._generate_loop._cache_size() - before == 3  # temperature is runtime


@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_chunked_prefill_equals_one_prefill(tiny, family):
    """`generate_tokens(prefill_chunk=16)` prefills 40- and 23-token prompts (bucket 64)
    as a scan of 4 `extend` chunks, one row ending mid-chunk and one chunk where it has
    nothing left: the same tokens and logits as one prefill call, GSM on (its windows
    cross chunks). DeepSeek-V4: compression blocks and the window ring cross chunks too.
    Each family's extend itself is the family contract's (tests/test_family_contract.py)."""
    from tiny_models import tiny_dsv4

    p = tiny if family == "llama" else tiny_dsv4()
    rng = np.random.default_rng(5)
    rows = [list(map(int, rng.integers(3, p.config.vocab_size, n))) for n in (40, 23)]
    gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all")
    kw = dict(max_new_tokens=5, gsm=gsm, eos_ids=[], return_logits=True)
    one, one_lg = gsm_jax.generate_tokens(p, rows, prefill_chunk=None, **kw)
    got, got_lg = gsm_jax.generate_tokens(p, rows, prefill_chunk=16, **kw)
    for a, b, x, y in zip(one, got, one_lg, got_lg, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(y, x, rtol=0, atol=2e-5 * np.abs(x).max())
    with pytest.raises(InvalidInputError, match="prefill_chunk must be an integer >= 16"):
        gsm_jax.generate_tokens(p, rows, prefill_chunk=8)
