"""Calibrate (step 4): guard, budget, back-off, reproducibility of the chosen config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import tiny_workflow_llama

import gsm_jax
from gsm_jax.workflow.calibrate import (
    BudgetNotMetError,
    CalibrationResult,
    CalibrationSpec,
    calibrate,
    effective_window,
)
from gsm_jax.workflow.evaluate import evaluate
from gsm_jax.workflow.metrics import Budget

# the same tiny model config and shapes as the other workflow tests: compiled once per session
SIZES = dict(num_sequences=6, seq_len=24, batch_size=4, greedy_prompts=2, greedy_prompt_len=8,
             greedy_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    return tiny_workflow_llama()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 96, (8, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def result(tiny, tokens):
    return calibrate(tiny, base_config=gsm_jax.GSMConfig(target_layers="all", max_strength=0.3),
                     data=tokens, lambada=None, strengths=(0.01, 0.03, 0.1, 0.5),
                     windows=(4, 8, "adaptive"), protect_first_values=(0, 1),
                     budget=Budget(max_mean_kld=0.004, min_same_top1_pct=90.0),
                     progress=False, **SIZES)


def test_never_above_max_strength(result):
    assert result.skipped_strengths == [0.5]
    assert all(t["strength"] <= 0.3 for t in result.trials)
    assert all(t["config"]["smooth_strength"] <= t["config"]["max_strength"]
               for t in result.trials)
    assert result.config.smooth_strength <= result.config.max_strength


def test_choice_respects_budget_and_search_order(result):
    budget = Budget(**result.budget)
    final = result.final
    assert budget.violations(final["quality"], final["lambada"]) == []
    strength = [t for t in result.trials if t["stage"] == "strength"]
    # walk up until the first break, the chosen one is the last within budget
    assert [t["within_budget"] for t in strength][:-1] == [True] * (len(strength) - 1)
    c = result.chosen
    within = [t for t in result.trials if t["within_budget"] and t["stage"] in
              ("strength", "window") and t["scope"] == "targets"]
    assert c["smooth_strength"] == max(t["strength"] for t in within)
    windows = {t["window"] for t in result.trials if t["stage"] == "window"}
    assert windows == {4, "adaptive"}
    pf = {(r["strength"], r["protect_first"]) for r in result.protect_first}
    assert {p for _, p in pf} == {0, 1}
    assert "budget" in result.summary() or "chosen" in result.summary()


def test_chosen_config_reproduces_reported_metrics(result, tiny, tokens):
    again = evaluate(tiny, result.config, data=tokens, lambada=None, progress=False, **SIZES)
    for k, v in result.final["quality"].items():
        assert again.quality[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k
    assert again.greedy == result.final["greedy"]


def test_save_and_load(result, tmp_path):
    path = result.save(tmp_path)
    assert gsm_jax.GSMConfig.from_file(tmp_path / "gsm.yaml") == result.config
    data = json.loads(path.read_text())
    assert data["schema"] == "gsm-jax/calibration/v1"
    assert (tmp_path / "quality_vs_strength.png").stat().st_size > 1000
    assert (tmp_path / "protect_first.png").exists()
    back = CalibrationResult.load(path)
    assert back.config == result.config


def test_backoff_finds_culprits_and_unmeetable_budget(tiny, tokens, tmp_path):
    kw = dict(base_config=gsm_jax.GSMConfig(target_layers="all"), data=tokens, lambada=None,
              strengths=(0.01,), windows=(8,), protect_first_values=(1,), curves=False,
              progress=False, **SIZES)
    r = calibrate(tiny, budget=Budget(max_mean_kld=6e-4, min_same_top1_pct=90.0), **kw)
    assert r.culprits, "the smallest strength broke the budget: layers must be backed off"
    assert len(r.contributions) == 3
    removed = {c["layer"] for c in r.culprits}
    assert not removed & set(r.chosen["target_layers"])
    assert r.final["quality"]["mean_kld"] <= 6e-4
    assert r.save(tmp_path / "ok").exists()
    assert (tmp_path / "ok" / "layer_contributions.png").exists()
    with pytest.raises(BudgetNotMetError, match="best found") as err:
        calibrate(tiny, budget=Budget(max_mean_kld=1e-12), **kw)
    res = err.value.result
    assert res.chosen is None and res.best_found is not None
    best = res.best_found["result"]["quality"]["mean_kld"]
    assert best == min(t["result"]["quality"]["mean_kld"] for t in res.trials)
    res.save(tmp_path / "fail")
    assert (tmp_path / "fail" / "gsm.best_found.yaml").exists()
    assert not (tmp_path / "fail" / "gsm.yaml").exists()


def test_effective_window():
    assert effective_window(8, 256) == 8.0
    assert effective_window("adaptive", 64) == 4.0
    assert 4.0 < effective_window("adaptive", 256) < 16.0


def test_spec_and_keywords(monkeypatch):
    """`calibrate(params, spec, **fields)`: keywords override the spec; unknown names fail."""
    from gsm_jax.workflow import calibrate as cal_mod

    seen = {}
    monkeypatch.setattr(cal_mod, "run_calibration", lambda params, spec: seen.update(spec=spec))
    spec = CalibrationSpec(strengths=(0.01,), seq_len=32)
    calibrate("p", spec, seq_len=64, progress=False)
    assert seen["spec"] == CalibrationSpec(strengths=(0.01,), seq_len=64, progress=False)
    calibrate("p", num_sequences=3)
    assert seen["spec"] == CalibrationSpec(num_sequences=3)
    with pytest.raises(TypeError):
        calibrate("p", num_sequence=3)
