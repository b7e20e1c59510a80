"""`gsm_jax.workflow.evaluate`: quality against direct computations; LAMBADA vs greedy."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_workflow_llama

import gsm_jax
from gsm_jax.errors import InvalidInputError
from gsm_jax.workflow import metrics
from gsm_jax.workflow.evaluate import EvalResult, Evaluator, evaluate

# the same tiny model config and shapes as the other workflow tests: compiled once per session
GREEDY = dict(batch_size=4, greedy_prompts=2, greedy_prompt_len=8, greedy_tokens=6,
              progress=False)


@pytest.fixture(scope="module")
def tiny():
    return tiny_workflow_llama()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 96, (8, 24)).astype(np.int32)


def test_baseline_and_zero_strength_have_zero_cost(tiny, tokens):
    ev = Evaluator(tiny, data=tokens, lambada=None, num_sequences=6, **GREEDY)
    base = ev.evaluate(None)
    assert base.quality["mean_kld"] == 0 and base.quality["ppl_ratio"] == 1.0
    r = ev.evaluate(gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.0))
    assert r.quality["mean_kld"] == 0.0
    assert r.quality["same_top1_pct"] == 100.0
    assert r.greedy["identical_pct"] == 100.0
    assert r.quality["n_tokens"] == 6 * 23


def test_quality_matches_direct_computation(tiny, tokens):
    cfg = gsm_jax.GSMConfig(target_layers=[0, 2], smooth_strength=0.3, window_size=4,
                            precision="f32")
    res = evaluate(tiny, cfg, data=tokens, lambada=None, num_sequences=5, batch_size=4,
                   greedy_prompts=0, progress=False)
    rows = tokens[-5:]  # evaluation sequences come from the end
    base = np.asarray(gsm_jax.forward(tiny, rows), np.float64)[:, :-1]
    gsm = np.asarray(gsm_jax.forward(tiny, rows, gsm=cfg), np.float64)[:, :-1]
    kld = metrics.kl_divergence(base, gsm)
    assert kld.mean() > 1e-4  # the config does something
    q = res.quality
    assert q["mean_kld"] == pytest.approx(kld.mean(), rel=1e-3, abs=1e-7)
    assert q["same_top1_pct"] == pytest.approx(100 * np.mean(base.argmax(-1) == gsm.argmax(-1)))
    tgt = rows[:, 1:]
    lq = gsm - np.logaddexp.reduce(gsm, axis=-1, keepdims=True)
    nll = -np.take_along_axis(lq, tgt[..., None], -1)[..., 0]
    assert q["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-4)
    assert res.smoothed_pairs == 4
    assert res.sizes["quality_sequences"] == 5


def test_eval_result_round_trip(tiny, tokens, tmp_path):
    res = evaluate(tiny, {"target_layers": "all", "smooth_strength": 0.1}, data=tokens,
                   lambada=None, num_sequences=4, **GREEDY)
    path = res.save(tmp_path / "out")
    assert path.name == "eval.json"
    back = EvalResult.load(path)
    assert back.quality == pytest.approx(res.quality)
    assert back.gsm_config == gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.1)
    assert "mean KLD" in back.summary()


def test_bad_arguments(tiny, tokens):
    with pytest.raises(InvalidInputError, match="ModelParams"):
        Evaluator("not params", data=tokens)
    with pytest.raises(InvalidInputError, match="requested"):
        Evaluator(tiny, data=tokens, lambada=None, num_sequences=99)
    ev = Evaluator(tiny, data=tokens, lambada=None, num_sequences=2, greedy_prompts=0,
                   batch_size=4, progress=False)
    with pytest.raises(InvalidInputError, match="unknown evaluation part"):
        ev.evaluate(gsm_jax.GSMConfig(target_layers="all"), parts=("nope",))


def _direct_greedy_word(params, context_ids, target, gsm, n=12):
    """Greedy by hand: append the argmax of a full forward pass until the word is decided."""
    ids = list(context_ids)
    out = []
    for _ in range(n):
        logits = np.asarray(gsm_jax.forward(params, [ids], gsm=gsm))[0, -1]
        t = int(logits.argmax())
        if t in params.tokenizer.eos_ids:
            break
        out.append(t)
        ids.append(t)
        if metrics.lambada_decision(params.tokenizer.decode(out), target, False) is not None:
            break
    return params.tokenizer.decode(out)


def test_lambada_scoring_equals_direct_greedy(smollm2, shared_data_dir):
    ev = Evaluator(smollm2, data=np.zeros((1, 16), np.int32), num_sequences=1, batch_size=4,
                   lambada=shared_data_dir / "lambada_dev.jsonl", lambada_samples=3,
                   greedy_prompts=0, progress=False)
    cfg = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.05)
    for gsm in (None, cfg):
        correct, words = ev._lambada(gsm, "test")
        for item, ok, word in zip(ev.lambada_items, correct, words, strict=True):
            text = _direct_greedy_word(smollm2, item.ctx, item.target, gsm)
            direct_word = metrics.first_word(text)[0]
            assert word == direct_word, (item.target, text)
            assert ok == (direct_word == item.target)
    assert any(ev.reference()["lambada_correct"])  # the model gets some right
