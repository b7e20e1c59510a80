"""Claims 13 (KV-cache format x GSM) and 14 (continuous batching): verdict rules on
synthetic numbers, and claim 13 run on the tiny Llama against an independent computation
of its quality arms. (Claim 14 drives two real servers: its closing-note run is by hand;
the server's step log it reads is tested in tests/test_server.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gsm_jax.workflow.evidence import kv_claims as kc
from gsm_jax.workflow.evidence import serving_claim as sc


def _diff(mean: float, se: float) -> dict[str, float]:
    return {"mean": mean, "stderr": se, "z": mean / se}


def test_interaction_is_the_paired_double_difference():
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.normal(size=7) for _ in range(4))
    got = kc.interaction(a, b, c, d)
    x = a - b - c + d
    assert got["mean"] == pytest.approx(x.mean())
    assert got["stderr"] == pytest.approx(x.std(ddof=1) / math.sqrt(7))
    assert got["z"] == pytest.approx(x.mean() / (x.std(ddof=1) / math.sqrt(7)))


@pytest.mark.parametrize(("speed", "quality", "verdict"), [
    ((0.05, 0.01), (0.0, 1e-4), "supported"),      # faster together, no extra loss
    ((0.05, 0.01), (1e-3, 1e-4), "refuted"),       # faster together, but loses more
    ((0.0, 0.01), (-1e-3, 1e-4), "supported"),     # less loss together, no speed cost
    ((-0.05, 0.01), (-1e-3, 1e-4), "refuted"),     # less loss, but slower than the product
    ((0.01, 0.01), (0.0, 1e-4), "refuted"),        # within noise: not shown
])
def test_claim13_verdict(speed, quality, verdict):
    got, checks = kc.claim13_verdict({"fp8": {"speed": _diff(*speed),
                                              "quality": _diff(*quality)},
                                      "int8": {"speed": None, "quality": None}})
    assert got == verdict, checks
    assert "int8" not in checks  # a format without both halves does not count either way


def test_claim13_not_testable_without_a_low_precision_cache():
    assert kc.claim13_verdict({"fp8": {"speed": None, "quality": None}})[0] == \
        "not testable here"


def test_load_spread_and_claim14_verdict():
    rng = np.random.default_rng(1)
    steady = rng.normal(10e-3, 0.2e-3, 400)           # CV ~0.02
    bursty = np.concatenate([steady[:360], np.full(40, 30e-3)])
    itl_even = rng.normal(20e-3, 1e-3, 800)
    itl_tail = np.concatenate([itl_even[:760], np.full(40, 90e-3)])
    off = {**sc.load_spread(itl_tail, bursty, resamples=100), "failed": 0}
    on = {**sc.load_spread(itl_even, steady, resamples=100), "failed": 0}
    p50 = np.percentile(itl_tail, 50)
    assert off["itl_p99_over_p50"] == pytest.approx(np.percentile(itl_tail, 99) / p50)
    assert off["step_cv"] == pytest.approx(bursty.std(ddof=1) / bursty.mean())
    assert off["step_cv_se"] > 0 and off["steps_n"] == 400
    assert sc.claim14_verdict(off, on)[0] == "supported"
    assert sc.claim14_verdict(on, off)[0] == "refuted"
    assert sc.claim14_verdict(off, off)[0] == "refuted"  # the same load is not evener
    assert sc.claim14_verdict({**off, "failed": 2}, on)[0] == "not testable here"


def _timed_rounds(monkeypatch, decode_s_of):
    """Run the real `generate_call_rounds` (its shape is checked), then replace its decode
    times by `decode_s_of(name, round)`: whether a tiny model's 23-step decode is longer
    than its 1-token call is a matter of the CI machine's load, so the interaction
    arithmetic and the unresolved branch are tested on known times, not on the clock."""
    from gsm_jax.workflow import overhead

    real = overhead.generate_call_rounds

    def rounds(arms, **kw):
        out = real(arms, **kw)
        assert set(out) == set(arms)
        for name, r in out.items():
            assert len(r["decode_s"]) == kw["repeats"] and all(np.isfinite(r["long_s"]))
            r["decode_s"] = [decode_s_of(name, i) for i in range(kw["repeats"])]
        return out

    monkeypatch.setattr(overhead, "generate_call_rounds", rounds)


_SIZES_13 = {"quality_sequences": 3, "seq_len": 24, "batch_size": 3, "speed_batch": 2,
             "speed_prompt": 16, "speed_new_tokens": 24, "speed_repeats": 3}


def test_run_claim_13_on_the_tiny_llama(tiny_llama, tmp_path, monkeypatch):
    """Six arms; the quality numbers equal KLD(float || arm) computed here through
    `gsm_jax.forward` and `metrics.kl_divergence` (not the claim's jitted evaluator), and
    the interactions equal the double differences of the per-sequence / per-round
    numbers the JSON records."""
    import gsm_jax
    from gsm_jax.workflow.metrics import kl_divergence

    rng = np.random.default_rng(3)
    tokens = rng.integers(4, 64, (3, 24)).astype(np.int32)
    # distinct known decode times per arm and round (0.01 .. 0.05 s)
    secs = {f"{k}/{g}": 0.01 * (1 + i) for i, (k, g) in enumerate(
        (k, g) for k in ("float", "fp8", "int8") for g in ("off", "on"))}
    _timed_rounds(monkeypatch, lambda name, i: secs[name] * (1 + 0.1 * i * (name[-1] == "n")))
    r = kc.run_claim_13(tiny_llama, sizes=_SIZES_13 | {"tokens": tokens}, progress=False,
                        model_dir=tmp_path)
    arms = r["numbers"]["arms"]
    assert set(arms) == {f"{k}/{g}" for k in ("float", "fp8", "int8") for g in ("off", "on")}
    assert arms["float/off"]["mean_kld"] == 0.0
    cfg = kc.gsm_config({})
    ref = np.asarray(gsm_jax.forward(tiny_llama, tokens.tolist()))
    for name, a in arms.items():
        k, g = name.split("/")
        p = tiny_llama if k == "float" else gsm_jax.with_kv_cache_dtype(tiny_llama, k)
        got = np.asarray(gsm_jax.forward(p, tokens.tolist(), gsm=cfg if g == "on" else None))
        # the claim scores the positions that have a next token (the last is dropped).
        # abs: two f32 programs' log-softmax agree to ~1e-7 per entry, so KLDs of ~1e-6
        # (GSM on this tiny model) agree to a few 1e-8, not to rel 1e-3
        want = np.mean([kl_divergence(ref[i], got[i])[:-1].mean() for i in range(3)])
        assert a["mean_kld"] == pytest.approx(want, rel=1e-3, abs=1e-7), name
        if k != "float":
            assert a["mean_kld"] > 0, name  # the rounded cache changes the logits
        # tokens/s per round: batch x (new - 1) decoded tokens over the injected decode time
        want_tok_s = [2 * 23 / (secs[name] * (1 + 0.1 * i * (g == "on"))) for i in range(3)]
        assert a["decode_tok_s_per_round"] == pytest.approx(want_tok_s, rel=1e-9), name
    per_seq = {n: np.asarray(a["per_sequence_kld"]) for n, a in arms.items()}
    for k in ("fp8", "int8"):
        q = r["numbers"]["interactions"][k]["quality"]
        x = per_seq[f"{k}/on"] - per_seq["float/on"] - per_seq[f"{k}/off"]
        assert q["mean"] == pytest.approx(x.mean(), rel=1e-6, abs=1e-12)
        s = r["numbers"]["interactions"][k]["speed"]
        v = {n: np.log(a["decode_tok_s_per_round"]) for n, a in arms.items()}
        y = v[f"{k}/on"] - v["float/on"] - v[f"{k}/off"] + v["float/off"]
        assert s["mean"] == pytest.approx(y.mean(), rel=1e-6)
    assert r["verdict"] in ("supported", "refuted")
    assert r["figures"] and all(p.endswith(".png") for p in r["figures"])


def test_run_claim_13_unresolved_decode_time_is_not_testable(tiny_llama, tmp_path,
                                                             monkeypatch):
    """When one long call was not slower than its short neighbour, no speed interaction is
    computed and the verdict says why, instead of comparing noise."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(4, 64, (3, 24)).astype(np.int32)
    _timed_rounds(monkeypatch, lambda name, i: 0.0 if (name, i) == ("fp8/on", 1) else 0.02)
    r = kc.run_claim_13(tiny_llama, sizes=_SIZES_13 | {"tokens": tokens, "speed_repeats": 2},
                        progress=False, model_dir=None)
    assert all(v["speed"] is None for v in r["numbers"]["interactions"].values())
    assert all(v["quality"] is not None for v in r["numbers"]["interactions"].values())
    assert r["verdict"] == "not testable here"
    assert "decode time not resolved" in r["why"]


def test_a_super_additive_interaction_says_whether_it_is_a_net_gain():
    """Each format alone slower, the two together slower by less than the product: the
    speed interaction counts, and the why says whether the combination beats the float
    cache without GSM (paired per round, beyond 2 standard errors either way)."""
    checks = {"fp8": {"super_additive_speed": True}, "int8": {"super_additive_speed": False},
              "reason": "x"}
    base = np.asarray([100.0, 102.0, 98.0, 101.0, 99.0])

    def rounds(*factors):
        return list(base * np.asarray(factors))

    arms = {"float/off": {"decode_tok_s_per_round": list(base)},
            "fp8/on": {"speed_vs_float_off_median": 0.82,
                       "decode_tok_s_per_round": rounds(.81, .83, .82, .8, .84)},
            "int8/on": {"speed_vs_float_off_median": 1.2, "decode_tok_s_per_round": base}}
    text = kc._net_speed(checks, arms)
    assert "fp8 with GSM runs at 0.820x" in text and "a net loss" in text
    assert "int8" not in text  # its interaction did not count
    assert checks["fp8"]["net_speed_vs_float_off"]["median_ratio"] == 0.82
    arms["fp8/on"]["decode_tok_s_per_round"] = rounds(1.0, 1.01, .99, 1.0, 1.0)
    assert "no net gain beyond the noise" in kc._net_speed(checks, arms)
    arms["fp8/on"]["decode_tok_s_per_round"] = rounds(1.1, 1.12, 1.09, 1.1, 1.11)
    assert "a net gain." in kc._net_speed(checks, arms)


def test_the_table_cell_says_where_both_together_run():
    per = {"fp8": {"speed": {"mean": math.log(1.08), "stderr": 0.01, "z": 7.7}},
           "int8": {"speed": None}}
    arms = {"fp8/on": {"speed_vs_float_off_median": 0.823}}
    assert kc._measurement(per, arms) == "fp8 x GSM speed +8.0% (both 0.82x)"
