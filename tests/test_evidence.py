"""The claim-by-claim evidence: verdict rules on synthetic numbers, and a smoke run of
claims 4, 5, 8, 11, 12 plus the markdown on a tiny random Llama (numbers meaningless)."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import pytest

from gsm_jax.cli import main as cli_main
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evidence import quality_claims as qc
from gsm_jax.workflow.evidence import render, runner
from gsm_jax.workflow.evidence.runner import VERDICTS, EvidenceSizes

SMOKE_CLAIMS = (4, 5, 8, 11, 12)
BUDGET = {"max_mean_kld": 0.01, "min_same_top1_pct": 97.0}


# ----------------------------------------------------------------------------- verdict rules


def test_judge_1_throughput():
    assert qc.judge_1(100.0, 90.0, 2.0)[0] == "supported"
    assert qc.judge_1(100.0, 99.0, 2.0)[0] == "refuted"  # inside the noise floor
    assert qc.judge_1(100.0, 108.0, 2.0)[0] == "refuted"


def test_judge_4_selection():
    assert qc.judge_4(0.001, [0.004, 0.005, 0.006], 8)[0] == "supported"
    v, why = qc.judge_4(0.009, [0.004, 0.005, 0.006], 8)
    assert v == "refuted" and "0.009" in why


def test_judge_5_adaptive_window():
    assert qc.judge_5({"4": 1.8, "8": 2.0, "16": 2.5, "adaptive": 1.2})[0] == "supported"
    assert qc.judge_5({"4": 1.1, "8": 2.0, "16": 2.5, "adaptive": 1.2})[0] == "refuted"


def test_judge_8_gradual_and_fluent_wrong():
    s = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4]
    kld = [0.0, 0.002, 0.008, 0.03, 0.07, 0.12]
    top1 = [100.0, 98.5, 97.0, 93.0, 89.0, 85.0]
    acc = [40.0, 40.0, 39.0, 37.0, 35.0, 32.0]
    v, why, parts = qc.judge_8(s, kld, top1, acc, 25.0)
    assert v == "supported" and parts["gradual"] and parts["fluent_wrong"], why
    # a cliff: nothing until 0.3, then most of the loss in the last step
    cliff_top1 = [100.0, 100.0, 99.9, 99.8, 99.5, 60.0]
    v, why, parts = qc.judge_8(s, kld, cliff_top1, acc, 25.0)
    assert v == "refuted" and not parts["gradual"], why
    # not monotone
    assert qc.judge_8(s, [0.0, 0.01, 0.005, 0.03, 0.07, 0.12], top1, acc, 25.0)[0] == "refuted"
    # gradual, but accuracy does not drop at 0.4 (no "fluent but wrong" answers)
    v, _, parts = qc.judge_8(s, kld, top1, [40.0] * 6, 25.0)
    assert v == "refuted" and parts["fluent_wrong"] is False
    # a 1-point drop (one example in a hundred) is noise, not "wrong answers"
    assert qc.judge_8(s, kld, top1, [40.0, 40, 40, 40, 40, 39.0], 25.0)[0] == "refuted"
    # perplexity not finite: not "fluent"
    assert qc.judge_8(s, kld, top1, acc, float("inf"))[0] == "refuted"
    # without LAMBADA only the gradual part is judged
    assert qc.judge_8(s, kld, top1, None, None)[0] == "supported"


def test_judge_11_backoff():
    bad, good = {"mean_kld": 0.02, "same_top1_pct": 95.0}, {"mean_kld": 0.004,
                                                           "same_top1_pct": 98.0}
    worse_ctl = {"mean_kld": 0.015, "same_top1_pct": 96.0}
    assert qc.judge_11(bad, good, worse_ctl, BUDGET)[0] == "supported"
    assert qc.judge_11(bad, good, None, BUDGET)[0] == "supported"
    v, why = qc.judge_11(good, good, worse_ctl, BUDGET)  # break does not reproduce
    assert v == "refuted" and "does not reproduce" in why
    assert qc.judge_11(bad, {"mean_kld": 0.012, "same_top1_pct": 98.0}, worse_ctl,
                       BUDGET)[0] == "refuted"
    better_ctl = {"mean_kld": 0.002, "same_top1_pct": 99.0}
    assert qc.judge_11(bad, good, better_ctl, BUDGET)[0] == "refuted"


def test_judge_12_protect_first():
    assert qc.judge_12(0.07, 0.005, 0.002, 0.0003)[0] == "supported"
    assert qc.judge_12(0.0025, 0.0004, 0.0023, 0.0004)[0] == "refuted"


def test_combined_verdict():
    cv = render.combined_verdict
    assert cv({"a": "supported", "b": "supported"}) == "supported on both"
    assert cv({"a": "refuted", "b": "refuted"}) == "refuted on both"
    assert cv({"a": "supported", "b": "refuted"}).startswith("mixed")
    assert cv({"a": "supported", "b": None}) == "supported on a; not measured on b"
    assert cv({"a": None, "b": None}) == "not measured"
    assert cv({"a": "refuted"}) == "refuted"


def test_load_flag():
    assert runner.load_record(0.4, 1.2)["comparable"]
    rec = runner.load_record(0.4, 2.3)
    assert not rec["comparable"] and "not comparable" in rec["flag"] and "2.30" in rec["flag"]


def test_names_and_errors(tmp_path):
    assert runner.parse_claims("5,1,5") == [1, 5]
    assert runner.parse_claims(None) == list(range(1, 15))  # claims 1-12, KV cache 13, batching 14
    for bad in ("15", "x", "0"):
        with pytest.raises(InvalidInputError, match="unknown claim"):
            runner.parse_claims(bad)
    with pytest.raises(InvalidInputError, match="unknown model 'no-such-model'"):
        runner.check_models("smollm2-135m,no-such-model")
    assert cli_main(["evidence", "--models", "no-such-model", "--out", str(tmp_path)]) == 2
    assert cli_main(["evidence", "--models", "smollm2-135m", "--claims", "99", "--out",
                    str(tmp_path)]) == 2
    assert runner.model_slug("/x/y/gemma-3-270m.gguf") == "gemma-3-270m"


def test_find_model_dir(tmp_path):
    meta = {"model": {"source": "m1"}}
    assert runner.find_model_dir(tmp_path, "m1") == tmp_path / "m1"  # nothing: own dir
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "report_meta.json").write_text(json.dumps(meta))
    assert runner.find_model_dir(tmp_path, "m1") == tmp_path
    assert runner.find_model_dir(tmp_path, "m2") == tmp_path / "m2"  # another model's report
    (tmp_path / "elsewhere" / "data").mkdir(parents=True)
    (tmp_path / "elsewhere" / "data" / "report_meta.json").write_text(
        json.dumps({"model": {"source": "m2"}}))
    assert runner.find_model_dir(tmp_path, "m2") == tmp_path / "elsewhere"


# ----------------------------------------------------------------------------- smoke run


@pytest.fixture(scope="module")
def sensitive_llama():
    """A tiny random Llama with 4 layers and weights x20: smoothing it breaks the budget,
    so the back-off (claim 11) has culprits to find."""
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=256, eos_token_ids=(3,))
    w = jax.tree.map(lambda a: a * 20 if a.ndim > 1 else a,
                     llama.init_weights(cfg, jax.random.key(0)))
    return ModelParams(w, cfg, None, "tiny")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, sensitive_llama):
    out = tmp_path_factory.mktemp("evidence")
    sizes = EvidenceSizes.smoke()
    path = runner.run_evidence(["tiny"], out, sizes=sizes, claims=SMOKE_CLAIMS,
                               load=lambda m: sensitive_llama, progress=False)
    return out, path


def test_smoke_claims_written(smoke_run):
    out, _ = smoke_run
    d = out / "data" / "evidence" / "tiny"
    for n in SMOKE_CLAIMS:
        r = json.loads((d / f"claim_{n}.json").read_text())
        assert r["claim"] == n and r["model"] == "tiny"
        assert r["verdict"] in VERDICTS and r["why"] and isinstance(r["numbers"], dict)
        assert r["command"] == f"gsm-jax evidence --models tiny --out {out} --claims {n} --smoke"
        la = r["load_avg"]
        assert {"before", "after", "comparable", "flag"} <= set(la)
        assert r["smoke"] is True
    r8 = json.loads((d / "claim_8.json").read_text())
    assert [c["strength"] for c in r8["numbers"]["curve"]] == [0.0, 0.05, 0.1, 0.2, 0.3, 0.4]
    assert r8["numbers"]["continuations"]  # greedy outputs at 0.4 vs 0
    r11 = json.loads((d / "claim_11.json").read_text())
    assert r11["numbers"]["culprits"] and "with culprits" in r11["numbers"]["held_out"]
    assert "middle" in r11["numbers"]["data"]["data"] or "seed 1" in \
        r11["numbers"]["data"]["data"]  # held-out data differ from the search set
    r5 = json.loads((d / "claim_5.json").read_text())
    assert set(r5["numbers"]["ratios"]) == {"4", "8", "adaptive"}
    r4 = json.loads((d / "claim_4.json").read_text())
    assert {"high_kurtosis", "random, seed 0", "random, seed 1", "all"} <= set(
        r4["numbers"]["selections"])


def test_smoke_markdown(smoke_run):
    out, path = smoke_run
    md = path.read_text()
    assert path == out / "gsm_evidence.md"
    rows = [ln for ln in md.splitlines() if re.match(r"^\| \d+ \|", ln)]
    assert len(rows) == 14
    for n, row in enumerate(rows, 1):
        assert row.startswith(f"| {n} |")
        if n not in SMOKE_CLAIMS:
            assert "not measured" in row
        else:
            assert any(f"**{v}" in row for v in VERDICTS), row
    assert "Smoke sizes" in md and "## Machine and load" in md
    assert f"gsm-jax evidence --models tiny --out {out} --resume" in md
    for n in (4, 5, 8, 12):
        assert (out / "figures" / "evidence" / f"claim_{n}.png").stat().st_size > 1000
        assert f"figures/evidence/claim_{n}.png" in md


def test_missing_module_and_failing_claim(smoke_run, monkeypatch, sensitive_llama):
    out, _ = smoke_run
    monkeypatch.setitem(runner.CLAIMS, 10, dataclasses.replace(
        runner.CLAIMS[10], target="gsm_jax.workflow.evidence.no_such_module:run_claim"))

    def boom(*a, **k):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(qc, "run_claim_12", boom)
    d = out / "data" / "evidence" / "tiny"
    before = (d / "claim_4.json").stat().st_mtime_ns
    path = runner.run_evidence(["tiny"], out, sizes=EvidenceSizes.smoke(), claims=[4, 10, 12],
                               resume=True, load=lambda m: sensitive_llama, progress=False)
    assert (d / "claim_4.json").stat().st_mtime_ns == before  # resume kept it
    assert not (d / "claim_10.json").exists()
    assert not (d / "claim_12.error.json").exists()  # resume kept the good claim 12 too
    runner.run_evidence(["tiny"], out, sizes=EvidenceSizes.smoke(), claims=[12],
                        load=lambda m: sensitive_llama, progress=False)
    err = json.loads((d / "claim_12.error.json").read_text())
    assert "synthetic failure" in err["error"]
    assert runner.errors(out, ["tiny"]) == [d / "claim_12.error.json"]
    md = path.read_text()
    row10 = next(ln for ln in md.splitlines() if ln.startswith("| 10 |"))
    assert "not measured (module missing)" in row10
    md = render.render_evidence(out).read_text()
    assert "A later run failed: RuntimeError: synthetic failure" in md
    (d / "claim_12.error.json").unlink()


def test_cli_render_only(smoke_run):
    out, path = smoke_run
    path.unlink()
    assert cli_main(["evidence", "--out", str(out), "--render-only"]) == 0
    assert path.exists()


def test_claim8_lambada_cliff_needs_more_than_sampling_noise():
    """A 4-point LAMBADA step is noise on 100 examples (2 s.e. of a difference ~6.9
    points) but a cliff, and a real drop, on 10000 (~1.4)."""
    from gsm_jax.workflow.evidence.quality_claims import judge_8

    s = [0.0, 0.1, 0.2, 0.3]
    kld, top1, acc = [0.0, 0.01, 0.02, 0.03], [100.0, 98.0, 96.0, 94.0], [38.0, 38.0, 38.0, 34.0]
    small = judge_8(s, kld, top1, acc, 50.0, 40.0, 100)
    large = judge_8(s, kld, top1, acc, 50.0, 40.0, 10000)
    assert small[2]["gradual"] and not small[2]["fluent_wrong"] and small[0] == "refuted"
    assert not large[2]["gradual"] and large[2]["fluent_wrong"] and large[0] == "refuted"
    steep = judge_8(s, kld, top1, [38.0, 36.0, 34.0, 30.0], 50.0, 40.0, 10000)
    assert steep[0] == "supported"  # gradual (steepest 1.5x) and an 8-point drop


def test_evidence_mesh_is_checked_before_loading(tmp_path, capsys):
    """A mesh larger than the devices, or not DATAxMODEL, is refused by name before any
    model is loaded or anything is written."""
    for spec, words in (("1x64", "needs 64 devices"), ("8", "DATAxMODEL"),
                        ("0x1", "sizes >= 1")):
        rc = cli_main(["evidence", "--models", "smollm2-135m", "--mesh", spec,
                       "--out", str(tmp_path / "e"), "--claims", "1"])
        err = capsys.readouterr().err
        assert rc != 0 and words in err, (spec, err)
        assert not (tmp_path / "e").exists()
    assert runner.evidence_command(["m"], "o", [1], mesh=(2, 4)) == \
        "gsm-jax evidence --models m --out o --mesh 2x4 --claims 1"


def _result(n: int, verdict: str, *, family: str = "llama", layers: int = 4, hidden: int = 32,
            smoke: bool = False) -> dict:
    return {"claim": n, "verdict": verdict, "why": f"claim {n} why", "measurement": f"m{n}",
            "family": family, "num_layers": layers, "hidden_size": hidden, "smoke": smoke}


def test_answer_section_follows_the_verdicts():
    """The answer is derived from the verdicts present, never written by hand: refuted
    speed and enabling claims -> "no evidence"; a supported one -> "possibly"; smoke only
    -> not answered; the released V4.1 size measured -> no "not measured" caveat."""
    def answer(results):
        return "\n".join(render.answer_section(list(results), results))

    refuted = {m: {1: _result(1, "refuted"), 3: _result(3, "refuted")} for m in ("a", "b")}
    text = answer(refuted)
    assert "No evidence that it does" in text and "claim 1: refuted on both" in text
    assert "was not measured with its released weights" in text
    assert render.TARGET_COMMAND in text
    mixed = {"a": {1: _result(1, "supported"), 3: _result(3, "refuted")}}
    assert "**Possibly: claim 1 (smoothing by itself) is supported" in answer(mixed)
    smoke = {"t": {1: _result(1, "refuted", family="deepseek_v41", smoke=True)}}
    text = answer(smoke)
    assert "Not answered yet" in text and "at smoke sizes" in text and "`t`" in text
    layers, hidden = render._released_target_size()
    released = {"v41": {n: _result(n, "refuted", family="deepseek_v41", layers=layers,
                                   hidden=hidden) for n in (1, 3)}}
    text = answer(released)
    assert "No evidence that it does" in text and "not measured with" not in text
    assert f"deepseek_v41, {layers} layers x {hidden}" in text
