"""Issue 15's claim functions 3, 6, 7 and 9 (gsm_jax/workflow/evidence/lowp_claims.py,
serving_claim.py) at tiny sizes on the tiny random Llama, and every verdict rule driven
to each of its outcomes with synthetic numbers. Claim 6 needs two real servers (minutes
of compilation each), so only its rule is tested here."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsm_jax.config import GSMConfig
from gsm_jax.errors import UnsupportedModelError
from gsm_jax.models import gsm_sites, llama
from gsm_jax.models import linear as linear_mod
from gsm_jax.workflow.evidence import lowp_claims as lc
from gsm_jax.workflow.evidence import serving_claim as sc

TINY = {"sequences": 4, "seq_len": 16, "calib_sequences": 2, "capture_sequences": 1,
        "batch_size": 2}
KEYS = {"claim", "model", "numbers", "verdict", "why", "load_avg"}


def _check_result(r: dict, claim: int) -> None:
    assert KEYS <= set(r)
    assert r["claim"] == claim and r["model"] == "tiny"
    assert r["verdict"] in lc.VERDICTS
    assert set(r["load_avg"]) == {"before", "after", "comparable"}
    json.dumps(r)  # JSON-able as returned


def _originals_restored() -> None:
    """Nothing in a model module was replaced (the tools pass hooks instead)."""
    from gsm_jax.models import sites

    assert sites.linear is linear_mod.linear and "linear" not in vars(llama)
    assert gsm_sites.wants_int8_input is linear_mod.wants_int8_input


# ----------------------------------------------------------------------------- the counter


def test_activation_counts_on_a_hand_made_token():
    # one token, one 128-channel block, absmax 448: e4m3 scale 1, int8 scale 448 / 127
    x = np.full((1, 128), 100.0, np.float32)
    x[0, :7] = [448.0, 440.0, 1e-4, 0.0, 1.0, 2.0, -1.5]
    c = {k: float(v) for k, v in jax.jit(lc.activation_counts)(jnp.asarray(x)).items()}
    assert c["values"] == 128 and c["nonzero"] == 127 and c["nonfinite"] == 0
    assert c["int8_flush"] == 3  # 1e-4, 1.0 and -1.5 are below half a step (1.76)
    assert c["e4m3_flush"] == 1  # 1e-4 < 2**-10, half the smallest e4m3 subnormal
    assert c["e4m3_saturated"] == 2  # 448 and 440 (rounds up to 448)
    assert c["e4m3_clipped"] == 0 and c["raw_over_e4m3_max"] == 0
    assert c["max_abs"] == 448.0


def test_activation_counts_nonfinite_and_raw_overflow():
    x = jnp.asarray([[600.0, 1.0, np.nan, 0.0], [np.inf, 2.0, 3.0, -700.0]], jnp.float32)
    c = lc.activation_counts(x)
    assert int(c["nonfinite"]) == 2
    assert int(c["raw_over_e4m3_max"]) == 2  # 600 and -700; NaN / inf are not counted
    assert int(c["e4m3_clipped"]) == 0  # the scale follows the block: nothing clips
    assert float(c["max_abs"]) == 700.0


def test_capture_records_every_quantized_linear(tiny_llama):
    from gsm_jax.quant import quantize

    q = quantize(tiny_llama, "w8a8")
    tokens = np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32)
    for gsm in (None, GSMConfig(target_layers="all", smooth_strength=0.2)):
        cap = lc.capture(q, tokens, gsm)
        assert cap["calls"] == 4 * tiny_llama.config.num_layers  # qkv, o, gate_up, down x L
        assert set(cap["per_linear"]) == {"qkv", "o", "gate_up", "down"}
        assert cap["per_linear"]["down"]["values"] == 2 * 12 * 48 * 2  # B T d_ff L
        assert cap["nonfinite"] == 0 and cap["nonfinite_logits"] == 0
        assert 0.0 <= cap["flush_share"] <= 1.0 and cap["saturated_share"] == 0.0
    _originals_restored()
    fp8 = lc.capture(quantize(tiny_llama, "fp8"), tokens, None)
    assert fp8["format"] == "e4m3" and fp8["calls"] == 8 and fp8["clipped_share"] == 0.0


def test_order_b_swaps_only_the_sites_feeding_w8a8(tiny_llama):
    from gsm_jax.quant import quantize

    q = quantize(tiny_llama, "w8a8")
    tokens = np.random.default_rng(1).integers(0, 64, (2, 16)).astype(np.int32)
    gsm = GSMConfig(target_layers="all", smooth_strength=0.3)
    g = lc._gsm_inputs(gsm, q, tokens)

    def run(gsm_in):
        fn = lc._make_logits_fn()
        return np.asarray(fn(q.weights, jnp.asarray(tokens), gsm_in, config=q.config))

    a = run(g)
    traced: list[int] = []
    b = run(lc.order_b(g, traced))
    assert len(traced) == 2  # both sites, traced once under the layer scan
    assert np.all(np.isfinite(b)) and not np.allclose(a, b, atol=1e-6)
    _originals_restored()
    # without GSM the swapped site is a pass-through: the plain W8A8 model
    np.testing.assert_array_equal(run(None), run(lc.order_b(None)))


# ----------------------------------------------------------------------------- claims 3 and 9


def test_run_claim_3_tiny(tiny_llama, tmp_path):
    r = lc.run_claim_3(tiny_llama, sizes=TINY, progress=False, model_dir=tmp_path)
    _check_result(r, 3)
    n = r["numbers"]
    assert set(n["kld_vs_float"]) == {"int8", "fp8"}
    for fmt in ("int8", "fp8"):
        for m in ("alone", "gsm", "smoothquant"):
            assert n["kld_vs_float"][fmt][m]["mean_kld"] >= 0.0
        assert n["gsm_effect"][fmt] is not None
    assert "mean_kld" in n["kld_vs_float"]["int8"]["hadamard"]
    assert "fp8" in n["kld_vs_float"]["fp8"]["hadamard"]["unavailable"]
    assert n["overflow"]["occurred"] is False
    assert set(n["activations"]) == {"int8", "fp8"}
    assert n["activations"]["int8"]["alone"]["calls"] == 8
    assert (tmp_path / "figures" / "claim3_lowp_kld.png").stat().st_size > 0
    _originals_restored()


def test_run_claim_3_family_without_quantization(tiny_llama, monkeypatch):
    import gsm_jax.quant as quant

    def refuse(*a, **k):
        raise UnsupportedModelError("quantization of model family 'x' is not implemented")

    monkeypatch.setattr(quant, "quantize", refuse)
    monkeypatch.setattr(quant, "smoothquant", refuse)
    r = lc.run_claim_3(tiny_llama, sizes=TINY, progress=False, model_dir=None)
    _check_result(r, 3)
    assert r["verdict"] == "not testable here"
    assert r["numbers"]["kld_vs_float"]["int8"]["alone"]["unavailable"].startswith(
        lc.UNAVAILABLE)


def test_run_claim_9_tiny(tiny_llama, tmp_path):
    r = lc.run_claim_9(tiny_llama, sizes=TINY, progress=False, model_dir=tmp_path)
    _check_result(r, 9)
    n = r["numbers"]
    assert r["verdict"] in ("supported", "refuted")
    assert n["site_traces_swapped"]["b"] == 2 and n["site_traces_swapped"]["b_requant"] == 2
    for arm in ("w8a8", "a", "b", "b_requant", "float+gsm"):
        assert n["kld_vs_float"][arm]["mean_kld"] >= 0.0
    assert n["kld_vs_float"]["a"]["mean_kld"] != n["kld_vs_float"]["b"]["mean_kld"]
    assert (tmp_path / "figures" / "claim9_order.png").exists()
    _originals_restored()


# ----------------------------------------------------------------------------- claim 7


def test_run_claim_7_quality_half_and_in_process_latency(tiny_llama, tmp_path):
    sizes = {"short_sequences": 6, "long_sequences": 1, "long_len": 48,
             "latency_route": "in_process", "latency_requests": 2, "repeats": 1,
             "new_tokens": 2}
    r = sc.run_claim_7(tiny_llama, sizes=sizes, progress=False, model_dir=tmp_path)
    _check_result(r, 7)
    q = r["numbers"]["quality"]
    assert q["rows"] == 6 and q["gsm_mean_kld"] > 0.0
    assert q["bypass_max_kld"] <= sc.RESTORED  # the bypass gives the unsmoothed logits
    assert q["verdict"] in lc.VERDICTS
    lat = r["numbers"]["latency"]
    assert lat["route"] == "in_process" and set(lat["mean_e2e_ms"]) == {
        "gsm", "bypass", "compiled_out"}
    assert lat["verdict"] in ("supported", "refuted")
    assert (tmp_path / "figures" / "claim7_short_bypass.png").exists()


def test_smoke_shrinks_the_serving_claims_sizes():
    """`--smoke` reaches claims 6 and 7 (whose server sizes are not EvidenceSizes fields):
    small servers and few requests; explicit sizes still win; without smoke nothing
    changes."""
    got = sc.claim_sizes({"smoke": True, "clients": (1, 4)}, sc.SMOKE_6)
    assert got["clients"] == (1, 4) and got["requests_per_cell"] == 2 and got["max_len"] == 128
    assert sc.claim_sizes({"smoke": False, "seed": 3}, sc.SMOKE_6) == {"smoke": False, "seed": 3}
    s7 = sc.claim_sizes({"smoke": True}, sc.SMOKE_7)
    # the bypass threshold must exceed the longest short request (run_claim_7 checks it)
    assert s7["bypass_tokens"] > s7["short_range"][1] + s7["new_tokens"]


def test_run_claim_7_refuses_a_bypass_threshold_that_misses_short_requests(tiny_llama):
    with pytest.raises(ValueError, match="bypass_tokens"):
        sc.run_claim_7(tiny_llama, sizes={"bypass_tokens": 20, "latency_route": "skip"},
                       progress=False, model_dir=None)


# ----------------------------------------------------------------------------- verdict rules


def _diff(mean: float, se: float) -> dict:
    return {"mean": mean, "stderr": se, "z": mean / se}


def test_claim3_rule():
    assert lc.claim3_verdict({"int8": _diff(3e-4, 1e-4), "fp8": _diff(-1e-4, 1e-4)}) == \
        "supported"
    assert lc.claim3_verdict({"int8": _diff(1.5e-4, 1e-4), "fp8": _diff(-1e-4, 1e-4)}) == \
        "refuted"  # 1.5 SE is within the noise
    assert lc.claim3_verdict({"int8": None, "fp8": None}) == "not testable here"


def test_paired_difference():
    d = lc.paired_difference(np.array([2.0, 3.0, 4.0]), np.array([1.0, 1.0, 1.0]))
    assert d["mean"] == pytest.approx(2.0)
    assert d["stderr"] == pytest.approx(np.std([1.0, 2.0, 3.0], ddof=1) / np.sqrt(3))


def test_claim9_rule():
    a = np.array([0.010, 0.012, 0.011, 0.013])
    assert lc.claim9_verdict(a, a - 0.002)[0] == "supported"  # (b) lower everywhere
    assert lc.claim9_verdict(a, a + 0.002)[0] == "refuted"
    assert lc.claim9_verdict(a, a + np.array([1e-4, -1e-4, 1e-4, -1e-4]))[0] == "refuted"
    assert lc.claim9_verdict(a, None) == ("not testable here", None)


def _cells(tp: dict, p99: float, mean: float = 1.0) -> list[dict]:
    return [{"clients": c, "length": length, "failed": 0,
             "ratios": {"throughput": v, "ttft_mean": mean, "ttft_p99": p99,
                        "itl_mean": mean, "itl_p99": p99}}
            for (c, length), v in tp.items()]


def test_claim6_rule():
    rising = {(1, "short"): 0.95, (8, "short"): 1.0, (32, "short"): 1.05,
              (1, "long"): 1.0, (8, "long"): 1.06, (32, "long"): 1.12}
    verdict, checks = sc.claim6_verdict(_cells(rising, p99=0.90))
    assert verdict == "supported" and checks["p99_improves_more_pairs"] == "12/12"
    flat = {k: 0.97 for k in rising}
    verdict, checks = sc.claim6_verdict(_cells(flat, p99=0.90))
    assert verdict == "refuted" and not checks["rises_with_concurrency"]
    verdict, checks = sc.claim6_verdict(_cells(rising, p99=1.0))  # P99 moves like the mean
    assert verdict == "refuted" and not checks["p99_improves_more"]
    assert sc.claim6_verdict(_cells({(1, "short"): 1.0, (1, "long"): 1.0}, 0.9))[0] == \
        "not testable here"
    broken = _cells(rising, p99=0.9)
    broken[0]["failed"] = 1
    assert sc.claim6_verdict(broken)[0] == "not testable here"


def test_claim6_cell_ratios():
    off = {"output_tok_per_s": 100.0, "ttft_mean_s": 0.2, "ttft_p99_s": 0.4,
           "itl_mean_s": 0.02, "itl_p99_s": 0.05}
    on = {"output_tok_per_s": 90.0, "ttft_mean_s": 0.22, "ttft_p99_s": 0.4,
          "itl_mean_s": 0.03, "itl_p99_s": None}
    r = sc.cell_ratios(off, on)
    assert r["throughput"] == pytest.approx(0.9) and r["ttft_mean"] == pytest.approx(1.1)
    assert r["ttft_p99"] == pytest.approx(1.0) and r["itl_p99"] is None
    assert sc._buckets(512) == [16, 32, 64, 128, 256, 512] and sc._buckets(32) == [16, 32]


def test_claim7_rules():
    rng = np.random.default_rng(0)
    cost = 1e-3 + 1e-4 * rng.standard_normal(16)
    assert sc.claim7_quality_half(cost, 0.0) == "supported"
    assert sc.claim7_quality_half(1e-4 * rng.standard_normal(16), 0.0) == "refuted"
    assert sc.claim7_quality_half(cost, 1e-3) == "not testable here"  # bypass not restoring
    slow = list(0.110 + 0.001 * rng.standard_normal(20))
    fast = list(0.100 + 0.001 * rng.standard_normal(20))
    assert sc.claim7_latency_half(slow, fast)[0] == "supported"
    assert sc.claim7_latency_half(fast, slow)[0] == "refuted"
    assert sc.claim7_latency_half([0.1], [0.1])[0] == "not testable here"
    assert sc.claim7_verdict("supported", "refuted") == "supported"
    assert sc.claim7_verdict("refuted", "refuted") == "refuted"
    assert sc.claim7_verdict("refuted", "not testable here") == "refuted"
    assert sc.claim7_verdict("not testable here", "not testable here") == "not testable here"
