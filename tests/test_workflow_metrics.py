"""Quality metrics of the GSM workflow against direct computations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsm_jax.errors import InvalidInputError
from gsm_jax.workflow import metrics
from gsm_jax.workflow.metrics import Budget


def _stats(base_logits, logits, targets):
    lp = jax.nn.log_softmax(jnp.asarray(base_logits, jnp.float32), axis=-1)
    out = jax.jit(metrics.token_stats)(lp, jnp.asarray(logits, jnp.float32),
                                       jnp.asarray(targets))
    return {k: np.asarray(v) for k, v in out.items()}


def test_kld_of_identical_distributions_is_zero():
    logits = np.random.default_rng(0).normal(size=(3, 5, 17)) * 4
    st = _stats(logits, logits, np.zeros((3, 5), int))
    assert np.all(st["kld"] == 0.0)
    assert st["same_top1"].all()
    np.testing.assert_array_equal(st["p"], st["p_base"])
    np.testing.assert_allclose(metrics.kl_divergence(logits, logits), 0.0, atol=1e-12)


def test_kld_hand_checked():
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    p = np.log([[0.5, 0.5]])
    q = np.log([[0.25, 0.75]])
    want = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    st = _stats(p, q, np.array([1]))
    assert st["kld"][0] == pytest.approx(want, rel=1e-6)
    assert metrics.kl_divergence(p, q)[0] == pytest.approx(want, rel=1e-12)
    assert not st["same_top1"][0]  # argmax P is 0 (tie, first), argmax Q is 1
    assert st["p_base"][0] == pytest.approx(0.5)
    assert st["p"][0] == pytest.approx(0.75)
    assert st["nll"][0] == pytest.approx(-math.log(0.75), rel=1e-6)


def test_kld_matches_float64_reference():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 6, 50)) * 3
    b = a + rng.normal(size=a.shape) * 0.3
    st = _stats(a, b, rng.integers(0, 50, (4, 6)))
    np.testing.assert_allclose(st["kld"], metrics.kl_divergence(a, b), rtol=2e-4, atol=1e-6)
    np.testing.assert_array_equal(st["same_top1"], a.argmax(-1) == b.argmax(-1))


def test_perplexity_is_exp_mean_nll():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 9, 11))
    targets = rng.integers(0, 11, (2, 9))
    st = _stats(logits, logits * 1.3, targets)
    # independent: softmax probabilities by hand
    q = np.exp(logits * 1.3) / np.exp(logits * 1.3).sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(q, targets[..., None], -1)[..., 0])
    assert metrics.perplexity(st["nll"]) == pytest.approx(float(np.exp(nll.mean())), rel=1e-5)
    s = metrics.summarize_quality(st)
    assert s["ppl"] == pytest.approx(float(np.exp(nll.mean())), rel=1e-5)
    assert s["ppl_ratio"] == pytest.approx(s["ppl"] / s["ppl_base"])
    assert s["ln_ppl_ratio"] == pytest.approx(math.log(s["ppl_ratio"]), rel=1e-6)
    with pytest.raises(InvalidInputError):
        metrics.perplexity([])


def test_summary_statistics_hand_checked():
    st = {"kld": np.array([0.0, 0.1, 0.2, 0.3]), "same_top1": np.array([1, 1, 1, 0], bool),
          "p_base": np.array([0.5, 0.5, 0.2, 0.1]), "p": np.array([0.6, 0.4, 0.2, 0.1]),
          "nll_base": np.array([1.0, 1.0, 1.0, 1.0]), "nll": np.array([1.0, 2.0, 1.0, 0.0])}
    s = metrics.summarize_quality(st)
    assert s["n_tokens"] == 4
    assert s["mean_kld"] == pytest.approx(0.15)
    assert s["same_top1_pct"] == pytest.approx(75.0)
    assert s["rms_dp_pct"] == pytest.approx(100 * math.sqrt((0.01 + 0.01) / 4))
    assert s["mean_dp_pct"] == pytest.approx(0.0, abs=1e-12)
    assert s["ppl_base"] == pytest.approx(math.e)
    assert s["ppl"] == pytest.approx(math.e)
    assert s["p99_kld"] == pytest.approx(np.percentile([0, 0.1, 0.2, 0.3], 99))
    assert s["max_kld"] == pytest.approx(0.3)
    with pytest.raises(InvalidInputError, match="at least 2"):
        metrics.summarize_quality({k: v[:1] for k, v in st.items()})


@pytest.mark.parametrize("text, word, complete", [
    (" signs", "signs", False),
    (" signs.", "signs", True),
    ("\n\nsigns and", "signs", True),
    (" signs'", "signs", True),
    (' "Nadia', "", True),
    ("", "", False),
    ("   ", "", False),
    ("Café au", "Café", True),
])
def test_first_word_rule(text, word, complete):
    assert metrics.first_word(text) == (word, complete)


@pytest.mark.parametrize("text, target, ended, verdict", [
    (" signs.", "signs", False, True),
    (" signs", "signs", False, None),  # could still grow into "signsets"
    (" signs", "signs", True, True),
    (" sign", "signs", False, None),
    (" sign.", "signs", False, False),
    (" house", "signs", False, False),
    (" signsets", "signs", False, False),
    (" ", "signs", False, None),
    (" \ufffd", "signs", False, None),
    ('"', "Nadia", False, False),
    (" Signs,", "signs", False, False),  # case-sensitive
])
def test_lambada_decision(text, target, ended, verdict):
    assert metrics.lambada_decision(text, target, ended) is verdict


def test_lambada_summary():
    s = metrics.summarize_lambada([True, True, False, False], [True, False, True, False])
    assert s["accuracy_base_pct"] == 50.0 and s["accuracy_pct"] == 50.0
    assert s["accuracy_drop_points"] == 0.0 and s["lost"] == 1 and s["gained"] == 1
    with pytest.raises(InvalidInputError):
        metrics.summarize_lambada([], [])


def test_greedy_agreement():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[1, 2, 9, 4], [5, 6, 7, 8]]
    g = metrics.greedy_agreement(a, b)
    assert g["prefix_agreement_pct"] == pytest.approx(100 * (0.5 + 1.0) / 2)
    assert g["identical_pct"] == 50.0
    assert g["token_match_pct"] == pytest.approx(100 * (0.75 + 1.0) / 2)
    assert metrics.common_prefix([1, 2], [1, 2, 3]) == 2


def test_budget():
    b = Budget()
    assert (b.max_mean_kld, b.min_same_top1_pct, b.max_accuracy_drop_points) == (0.01, 97.0, 1.0)
    ok_q = {"mean_kld": 0.005, "same_top1_pct": 98.0}
    assert b.violations(ok_q, {"accuracy_drop_points": 1.0}) == []
    v = b.violations({"mean_kld": 0.02, "same_top1_pct": 96.0}, {"accuracy_drop_points": 1.5})
    assert len(v) == 3
    assert b.margin(ok_q, None) > 0 > b.margin({"mean_kld": 0.02, "same_top1_pct": 98}, None)
    # a search margin: the result must stay 2 of its own standard errors inside the limits
    near = {"mean_kld": 0.009, "mean_kld_stderr": 0.0006, "same_top1_pct": 97.5,
            "same_top1_stderr_pct": 0.36}
    assert b.violations(near, None) == []
    strict = Budget(margin_se=2.0)
    v = strict.violations(near, None)
    assert len(v) == 2 and "2 s.e." in v[0] and "96.78" in v[1]
    assert strict.violations({"mean_kld": 0.001, "same_top1_pct": 99.0}, None) == []
    with pytest.raises(InvalidInputError):
        Budget(margin_se=-1)
    with pytest.raises(InvalidInputError):
        Budget(max_mean_kld=float("nan"))
    with pytest.raises(InvalidInputError):
        Budget(min_same_top1_pct=120)
