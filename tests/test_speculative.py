"""Greedy speculative decoding with a self-draft (`gsm_jax.speculative`): the output is
plain greedy decoding of the verifier, with and without GSM on either model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_dsv4, tiny_workflow_llama

import gsm_jax
from gsm_jax import speculative
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.speculative import speculative_generate

# window 8 = ring 8: a rejected suffix of two tokens already overwrites ring slots that the
# next positions read (see speculative._rollback), so a wrong rollback shows in the output
GSM = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.3, window_size=8)
ARMS = {"off": (None, None), "verifier": (GSM, None), "draft": (None, GSM), "both": (GSM, GSM)}
NEW = 40


@pytest.fixture(scope="module")
def tiny():
    """3 layers, weights x20 (GSM visibly changes the logits), no EOS."""
    return tiny_workflow_llama()


@pytest.fixture(scope="module")
def prompt():
    return [int(t) for t in np.random.default_rng(0).integers(0, 96, 20)]


@pytest.fixture(scope="module")
def greedy(tiny, prompt):
    """Plain greedy decoding of the full model, without and with GSM."""
    return {gsm is None: gsm_jax.generate_tokens(tiny, [prompt], max_new_tokens=NEW, gsm=gsm)[0]
            for gsm in (None, GSM)}


def _check_counts(res, draft_len: int) -> None:
    assert 0.0 <= res.acceptance_rate <= 1.0
    assert res.drafted == res.rounds * draft_len
    assert res.accepted == sum(res.accepted_per_round)
    assert all(0 <= m <= draft_len for m in res.accepted_per_round)


def test_gsm_changes_greedy_output(greedy):
    """Otherwise the GSM arms below would not test the rings' rollback."""
    assert not np.array_equal(greedy[True], greedy[False])


@pytest.mark.parametrize("arm, draft_layers, layout",
                         [(arm, 1, "stacked") for arm in ARMS] + [("both", 2, "per_layer")])
def test_equals_plain_greedy(tiny, prompt, greedy, arm, draft_layers, layout):
    """`layout`: the tiny model's stacked [L, ...] weights, or the per-layer tuple that
    `gsm_jax.load` gives (the draft is then a cut of the tuple), against that layout's own
    plain greedy tokens. (Stacked with more than one draft layer: the SmolLM2 test below,
    8 of 30.)"""
    gsm_v, gsm_d = ARMS[arm]
    want = greedy[gsm_v is None]
    if layout == "per_layer":
        tiny = dataclasses.replace(tiny, weights=llama.unstack_layers(tiny.weights))
        assert llama.is_per_layer(tiny.weights)
        want = gsm_jax.generate_tokens(tiny, [prompt], max_new_tokens=NEW, gsm=gsm_v)[0]
    res = speculative_generate(tiny, prompt, max_new_tokens=NEW, draft_layers=draft_layers,
                               draft_len=4, gsm_verifier=gsm_v, gsm_draft=gsm_d)
    np.testing.assert_array_equal(res.tokens, want)
    _check_counts(res, 4)
    # partial rejections happened, so the rollback was exercised
    assert any(m < 4 for m in res.accepted_per_round)


def test_int8_model_equals_its_plain_greedy(tiny, prompt):
    """w8a16 with an int8 head (on CPU the int8 kernel: a verify step's 5 rows and a decode
    step's one row are each computed alone), GSM on both: the tokens of plain greedy."""
    from gsm_jax.quant import quantize

    q = quantize(tiny, "w8a16", head=True)
    want = gsm_jax.generate_tokens(q, [prompt], max_new_tokens=NEW, gsm=GSM)[0]
    res = speculative_generate(q, prompt, max_new_tokens=NEW, draft_layers=1, draft_len=4,
                               gsm_verifier=GSM, gsm_draft=GSM)
    np.testing.assert_array_equal(res.tokens, want)
    assert any(m < 4 for m in res.accepted_per_round)


@pytest.mark.parametrize("gsm, draft_len", [(None, 1), (None, 5), (GSM, 4)])
def test_full_model_draft_accepts_everything(tiny, prompt, greedy, gsm, draft_len):
    """The draft is the verifier itself: every proposal must be accepted, each round
    yields draft_len + 1 tokens."""
    res = speculative_generate(tiny, prompt, max_new_tokens=NEW, draft_layers=3,
                               draft_len=draft_len, gsm_verifier=gsm, gsm_draft=gsm)
    np.testing.assert_array_equal(res.tokens, greedy[gsm is None])
    assert res.acceptance_rate == 1.0
    assert res.accepted_per_round == (draft_len,) * res.rounds
    # the first token comes from the prefill; the rounds yield the rest
    assert res.rounds == -(-(NEW - 1) // (draft_len + 1))


def test_stops_at_eos_like_greedy(tiny, prompt, greedy):
    ref = greedy[True]
    eos = int(ref[7])
    stop = int(np.flatnonzero(ref == eos)[0])
    expected = gsm_jax.generate_tokens(tiny, [prompt], max_new_tokens=NEW, eos_ids=[eos])[0]
    np.testing.assert_array_equal(expected, ref[: stop + 1])
    res = speculative_generate(tiny, prompt, max_new_tokens=NEW, draft_layers=1,
                               eos_ids=[eos])
    np.testing.assert_array_equal(res.tokens, expected)


def test_short_outputs(tiny, prompt, greedy):
    for n in (1, 2, 5):
        res = speculative_generate(tiny, prompt, max_new_tokens=n, draft_layers=1)
        np.testing.assert_array_equal(res.tokens, greedy[True][:n])
    assert speculative_generate(tiny, prompt, max_new_tokens=1, draft_layers=1).rounds == 0


def test_deepseek_v4_family():
    """Family-generic: DeepSeek-V4 (verified by one chunked `extend`, as every family now;
    its compressed caches are re-run on rollback)."""
    p = tiny_dsv4()
    assert speculative.verify_mode("deepseek_v4") == "chunked"
    ids = [int(t) for t in np.random.default_rng(0).integers(4, 96, 13)]
    ref = gsm_jax.generate_tokens(p, [ids], max_new_tokens=20, gsm=GSM, eos_ids=[])[0]
    res = speculative_generate(p, ids, max_new_tokens=20, draft_layers=1, gsm_verifier=GSM,
                               gsm_draft=GSM, eos_ids=[])
    np.testing.assert_array_equal(res.tokens, ref)
    assert any(m < 4 for m in res.accepted_per_round)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"draft_layers": 0}, r"draft_layers must be in \[1, 3\], got 0"),
        ({"draft_layers": 4}, r"draft_layers must be in \[1, 3\], got 4"),
        ({"draft_layers": 1.5}, "draft_layers must be an integer"),
        ({"draft_len": 0}, "draft_len must be >= 1, got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 300}, "context of 256"),
    ],
)
def test_bad_arguments(tiny, prompt, kwargs, match):
    args = {"max_new_tokens": 4, "draft_layers": 1, **kwargs}
    with pytest.raises(InvalidInputError, match=match):
        speculative_generate(tiny, prompt, **args)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([], "the prompt is empty"),
        (np.zeros((0,), np.int32), "empty"),
        ([[1, 2], [3, 4]], "one prompt at a time, got 2"),
        ([1, 96], "outside the vocabulary"),
        ("hello", "token ids"),
    ],
)
def test_bad_prompt(tiny, ids, match):
    with pytest.raises(InvalidInputError, match=match):
        speculative_generate(tiny, ids, max_new_tokens=4, draft_layers=1)


def test_not_model_params():
    with pytest.raises(InvalidInputError, match="ModelParams"):
        speculative_generate({"embed": 1}, [1], max_new_tokens=4, draft_layers=1)


@pytest.fixture
def fresh_programs():
    """The test swaps code that jitted programs were traced from: trace afresh, and
    leave no program traced from the swapped code behind."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_rewinding_lengths_with_rings_breaks_exactness(tiny, prompt, greedy, monkeypatch,
                                                        fresh_programs):
    """The negative control for `_rollback`: forgetting rejected tokens by moving the
    cache length back leaves their inputs in the GSM rings, and the output drifts."""
    monkeypatch.setattr(speculative, "_can_rewind", lambda cache: True)
    res = speculative_generate(tiny, prompt, max_new_tokens=NEW, draft_layers=1,
                               gsm_verifier=GSM)
    assert not np.array_equal(res.tokens, greedy[False])


def test_chunked_verify_path(tiny, prompt, greedy, monkeypatch, fresh_programs):
    """With a family `extend(..., all_logits=True)` (stood in for here by one-token
    `extend` calls; the rollback re-runs use the real chunked `extend`), the verify
    and rollback go through extend and the output is still exact."""
    real = llama.extend

    def extend(weights, cfg, tokens, n_new, cache, gsm=None, all_logits=False):
        if not all_logits:
            return real(weights, cfg, tokens, n_new, cache, gsm)
        logits = []
        for i in range(tokens.shape[1]):
            last, cache = real(weights, cfg, tokens[:, i:i + 1],
                               (i < n_new).astype(jnp.int32), cache, gsm)
            logits.append(last)
        return jnp.stack(logits, axis=1), cache

    monkeypatch.setattr(llama, "extend", extend)
    assert speculative.verify_mode("llama") == "chunked"
    for gsm_v, gsm_d in (ARMS["off"], ARMS["both"]):
        res = speculative_generate(tiny, prompt, max_new_tokens=NEW, draft_layers=1,
                                   gsm_verifier=gsm_v, gsm_draft=gsm_d)
        np.testing.assert_array_equal(res.tokens, greedy[gsm_v is None])
        assert any(m < 4 for m in res.accepted_per_round)


def test_smollm2_equals_plain_greedy(smollm2):
    """The real model, 24 new tokens, the first 8 of 30 layers drafting, GSM on in both
    models (its rings rolled back on every rejection). GSM off, and one-sided GSM, are
    covered on the tiny models above at a fraction of the compile time: one arm here.
    Stacked layers (lax.scan: one compiled layer body; 30 unrolled layers made every
    program here minutes of compilation); the per-layer layout `load` gives is the
    tiny model's per-layer arm of test_equals_plain_greedy (its draft is a tuple cut)."""
    smollm2 = dataclasses.replace(smollm2, weights=llama.stack_layers(smollm2.weights))
    ids = smollm2.tokenizer.encode("The history of the Roman Empire begins with")
    gsm = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.1, window_size=8)
    ref = gsm_jax.generate_tokens(smollm2, [ids], max_new_tokens=24, gsm=gsm)[0]
    res = speculative_generate(smollm2, ids, max_new_tokens=24, draft_layers=8,
                               gsm_verifier=gsm, gsm_draft=gsm)
    np.testing.assert_array_equal(res.tokens, ref)
    _check_counts(res, 4)
    print("SmolLM2 acceptance rate (draft_layers=8, draft_len=4, GSM on):",
          res.acceptance_rate)


# ----------------------------------------------------------------------------- claim 10


def _arm(rates, exact=True, off=None):
    rates = np.asarray(rates, float)
    arm = {"acceptance_rate": float(rates.mean()), "per_prompt_acceptance": list(rates),
           "exact": exact}
    if off is not None:
        d = np.asarray(off) - rates
        arm |= {"drop_vs_off": float(d.mean()), "drop_se": float(d.std(ddof=1) / 2)}
    return arm


@pytest.mark.parametrize(
    "gsm_rates, off_rates, exact, verdict",
    [
        ([0.3, 0.32, 0.28, 0.3], [0.5, 0.52, 0.49, 0.51], True, "supported"),
        ([0.49, 0.53, 0.5, 0.5], [0.5, 0.52, 0.49, 0.51], True, "refuted"),
        ([0.01, 0.0, 0.02, 0.0], [0.02, 0.01, 0.0, 0.03], True, "not testable here"),
        ([0.3, 0.32, 0.28, 0.3], [0.5, 0.52, 0.49, 0.51], False, "not testable here"),
    ],
)
def test_claim_verdict_rule(gsm_rates, off_rates, exact, verdict):
    from gsm_jax.workflow.evidence.speculative_claim import _verdict

    arms = {"off": _arm(off_rates), "gsm_verifier": _arm(gsm_rates, exact, off_rates),
            "gsm_draft": _arm(off_rates, True, off_rates)}
    got, why = _verdict(arms, 4, 2.0, 0.1)
    assert got == verdict and why


def test_run_claim_tiny(tiny, tmp_path):
    import json

    from gsm_jax.workflow.evidence.speculative_claim import ARMS, run_claim

    ids = np.random.default_rng(3).integers(0, 96, (2, 16))
    # as the evidence runner calls it: its sizes (smoke), evidence_dir and model_dir
    out = run_claim(tiny, sizes={"token_ids": ids, "smoke": True, "new_tokens": 12,
                                 "gsm": GSM.to_dict(), "evidence_dir": str(tmp_path)},
                    progress=False, model_dir=tmp_path / "absent")
    json.dumps(out)
    # the default draft is all but the last layer
    assert out["claim"] == 10 and out["draft_layers"] == 2 and set(out["arms"]) == set(ARMS)
    assert all(a["exact"] for a in out["arms"].values())
    assert all(0.0 <= a["acceptance_rate"] <= 1.0 for a in out["arms"].values())
    assert out["verdict"] in ("supported", "refuted", "not testable here") and out["why"]
    assert out["numbers"]["exact_gsm_both"] is True and out["prompt_len"] == 16
    assert out["peer_tok_s"] > 0 and (tmp_path / "claim10_speculative.png").stat().st_size > 0
