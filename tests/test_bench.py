"""Benchmark (workflow step 5): statistics and schema on synthetic latencies, request mix,
arrivals, the CLI, and one tiny real run (random Llama, both loops, GSM on and off)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gsm_jax import cli
from gsm_jax.errors import InvalidInputError
from gsm_jax.params import ModelParams
from gsm_jax.workflow import bench as bench_mod
from gsm_jax.workflow.bench import (
    BenchResult,
    compare_modes,
    make_requests,
    percentiles,
    poisson_arrivals,
    summarize_records,
)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


# ----------------------------------------------------------------------------- synthetic


def _record(tag: str, e2e: float, ttft: float, n: int, finish: float) -> dict:
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return {"tag": tag, "e2e_s": e2e, "ttft_s": ttft, "tpot_s": tpot, "queue_s": 0.0,
            "n_tokens": n, "finish": finish}


def _synthetic_runs(scale: float = 1.0) -> list[dict]:
    runs = []
    for rep in range(2):
        recs = [_record("short", scale * (0.1 + 0.01 * i), scale * 0.02, 16, 1.0 + 0.1 * i)
                for i in range(10)]
        recs += [_record("long", scale * (1.0 + 0.1 * i), scale * 0.2, 128, 2.0 + rep)
                 for i in range(5)]
        runs.append({"loop": "closed", "repeat": rep, "records": recs,
                     "wall_s": max(r["finish"] for r in recs)})
    return runs


def test_percentiles_on_synthetic_latencies():
    p = percentiles(list(range(1, 101)))
    assert p["n"] == 100 and p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    p = percentiles([3.0, None, math.nan, 1.0, 2.0])  # missing values are left out
    assert p["n"] == 3 and p["p50"] == 2.0 and p["p99"] == pytest.approx(2.98)
    empty = percentiles([])
    assert empty == {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None}


def test_summarize_records_per_class_and_runs():
    runs = _synthetic_runs()
    s = summarize_records(runs)
    assert s["runs"] == 2 and set(s["classes"]) == {"short", "long", "all"}
    short, long_, all_ = (s["classes"][c] for c in ("short", "long", "all"))
    assert (short["requests"], long_["requests"], all_["requests"]) == (20, 10, 30)
    assert short["output_tokens"] == 320 and long_["output_tokens"] == 1280
    # pooled over both repeats (identical latencies): P50 of 0.10..0.19 twice
    assert short["e2e_s"]["p50"] == pytest.approx(np.percentile(
        [0.1 + 0.01 * i for i in range(10)] * 2, 50))
    assert long_["ttft_s"]["p99"] == pytest.approx(0.2)
    assert short["tpot_s"]["p50"] == pytest.approx(np.percentile(
        [(0.1 + 0.01 * i - 0.02) / 15 for i in range(10)], 50))
    # throughput per run: tokens / that run's wall time (2 s, then 3 s)
    assert all_["tokens_per_s"]["values"] == pytest.approx([800 / 2.0, 800 / 3.0])
    assert all_["tokens_per_s"]["mean"] == pytest.approx((800 / 2 + 800 / 3) / 2)
    assert long_["requests_per_s"]["values"] == pytest.approx([5 / 2.0, 5 / 3.0])


def test_compare_modes_ratios():
    summary = {"off": summarize_records(_synthetic_runs(1.0)),
               "on": summarize_records(_synthetic_runs(1.5))}
    comp = compare_modes(summary)
    for cls in ("short", "long", "all"):
        for key in ("e2e_s_p50", "e2e_s_p99", "ttft_s_p95", "tpot_s_p50"):
            assert comp[cls][key] == pytest.approx(1.5)
        assert comp[cls]["tokens_per_s"] == pytest.approx(1.0)  # same synthetic wall times
    assert compare_modes({"on": summary["on"]}) == {}


def _synthetic_result() -> BenchResult:
    runs = []
    for loop in ("closed", "open"):
        for mode, scale in (("off", 1.0), ("on", 1.2)):
            for run in _synthetic_runs(scale):
                steps = {"decode": [[2, 0.05 * scale]] * 10,
                         "prefill": [[16, 0.1 * scale], [512, 1.0 * scale]]}
                run = dict(run, loop=loop, mode=mode, steps=steps,
                           outputs=[[1, 2]] * len(run["records"]))
                runs.append(run)
    return BenchResult.from_runs(
        config={"model": "synthetic", "clients": 4, "rate_used": 2.0},
        machine={"backend": "cpu", "date": "today"}, warmup={"off": {"total_s": 1.0}},
        requests=[{"index": i} for i in range(15)], runs=runs,
    )


def test_result_schema_save_and_load(tmp_path):
    result = _synthetic_result()
    d = result.to_dict()
    assert d["schema"] == "gsm-jax.bench/1"
    assert set(d) == {"schema", "config", "machine", "warmup", "summary", "comparison",
                      "requests", "runs"}
    assert set(d["summary"]) == {"closed", "open"}
    assert set(d["summary"]["closed"]) == {"off", "on"}
    entry = d["summary"]["open"]["on"]["classes"]["long"]
    assert set(entry) == {"requests", "output_tokens", "e2e_s", "ttft_s", "tpot_s", "queue_s",
                          "tokens_per_s", "requests_per_s"}
    assert set(entry["e2e_s"]) == {"n", "mean", "p50", "p95", "p99"}
    comp = d["comparison"]["closed"]
    assert comp["on_vs_off"]["all"]["e2e_s_p50"] == pytest.approx(1.2)
    assert comp["token_agreement_on_off"] == 1.0
    engine = d["summary"]["closed"]["on"]["engine"]
    assert engine["decode_step_s"]["n"] == 20 and engine["decode_step_s"]["p50"] == 0.06
    assert set(engine["prefill_s_by_bucket"]) == {"16", "512"}
    assert comp["on_vs_off"]["engine"]["decode_step_p50"] == pytest.approx(1.2)
    assert comp["on_vs_off"]["engine"]["prefill_p50_by_bucket"] == pytest.approx(
        {"16": 1.2, "512": 1.2})
    assert all("outputs" not in r for r in d["runs"])  # raw tokens stay out of the JSON

    path = result.save(tmp_path / "out")
    assert path == tmp_path / "out" / "results.json"
    assert (tmp_path / "out" / "results.png").stat().st_size > 10_000
    loaded = json.loads(path.read_text())  # strict JSON (NaN would be invalid)
    assert loaded["summary"]["closed"]["on"]["classes"]["all"]["e2e_s"]["n"] == 30
    again = BenchResult.load(tmp_path / "out")
    assert again.summary == loaded["summary"] and again.comparison == loaded["comparison"]
    single = result.save(tmp_path / "one.json", plot=False)
    assert single.exists() and not (tmp_path / "one.png").exists()
    table = result.table()
    assert "closed loop: 4 clients" in table and "open loop: Poisson 2 req/s" in table
    assert "on/off (all): e2e P50 1.200" in table and "decode step P50 1.200" in table
    assert "engine on    decode step P50/P95 60.0/60.0 ms (20 steps)" in table
    with pytest.raises(InvalidInputError, match="schema"):
        BenchResult.from_dict({"schema": "other"})


# ----------------------------------------------------------------------------- requests


def test_poisson_arrivals_seeded():
    a = poisson_arrivals(2000, rate=4.0, seed=3)
    assert a == poisson_arrivals(2000, rate=4.0, seed=3)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(InvalidInputError, match="rate"):
        poisson_arrivals(3, 0.0)


class _FakeTokenizer:
    eos_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 60 + 1 for c in text]


def test_make_requests_mix(tiny, tmp_path):
    reqs = make_requests(tiny, 20, long_fraction=0.25, short_prompt=(4, 8), short_new=3,
                         long_prompt=(20, 30), long_new=9, seed=1)
    tags = [r.tag for r in reqs]
    assert tags.count("long") == 5 and tags.count("short") == 15
    for r in reqs:
        lo, hi, new = (20, 30, 9) if r.tag == "long" else (4, 8, 3)
        assert lo <= len(r.prompt) <= hi and r.max_new_tokens == new
        assert 0 <= min(r.prompt) and max(r.prompt) < tiny.config.vocab_size
    again = make_requests(tiny, 20, long_fraction=0.25, short_prompt=(4, 8), short_new=3,
                          long_prompt=(20, 30), long_new=9, seed=1)
    assert [list(r.prompt) for r in again] == [list(r.prompt) for r in reqs]

    text_model = ModelParams(tiny.weights, tiny.config, _FakeTokenizer(), "tiny")
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    reqs = make_requests(text_model, 4, short_prompt=(5, 9), data=data)
    stream = _FakeTokenizer().encode(data.read_text())
    for r in reqs:  # each prompt is a slice of the tokenized text
        s = list(r.prompt)
        assert any(stream[i: i + len(s)] == s for i in range(len(stream) - len(s) + 1))
    with pytest.raises(InvalidInputError, match="missing.txt does not exist.*--data"):
        make_requests(text_model, 2, data=tmp_path / "missing.txt")
    with pytest.raises(InvalidInputError, match="long_fraction"):
        make_requests(tiny, 2, long_fraction=2.0)


def test_cli_maps_arguments(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_bench(model, spec=None, **kwargs):  # the CLI passes a BenchSpec
        fields = {} if spec is None else {f: getattr(spec, f) for f in spec.__dataclass_fields__}
        seen.update(fields, **kwargs, model=model)
        return _synthetic_result()

    monkeypatch.setattr(bench_mod, "bench", fake_bench)
    rc = cli.main(["bench", "--model", "m", "--clients", "3", "--requests", "7", "--rate",
                   "none", "--modes", "off,on,zero", "--out", str(tmp_path), "--no-progress",
                   "--short-prompt", "8", "12"])
    assert rc == 0
    assert seen["model"] == "m" and seen["clients"] == 3 and seen["requests"] == 7
    assert seen["rate"] is None and seen["modes"] == ["off", "on", "zero"]
    assert seen["short_prompt"] == (8, 12) and seen["ignore_eos"] and not seen["progress"]
    assert "closed loop: 4 clients" in capsys.readouterr().out
    cli.main(["bench", "--rate", "2.5", "--no-progress"])
    assert seen["rate"] == 2.5 and seen["model"] == "smollm2-135m"


def test_spec_and_keywords(monkeypatch):
    """`bench(model, spec, **fields)`: keywords override the spec; unknown names fail."""
    seen = {}
    monkeypatch.setattr(bench_mod, "run_bench", lambda model, spec: seen.update(spec=spec))
    spec = bench_mod.BenchSpec(clients=3, modes=("off",))
    bench_mod.bench("m", spec, requests=5)
    assert seen["spec"] == bench_mod.BenchSpec(clients=3, requests=5, modes=("off",))
    bench_mod.bench("m", clients=2)
    assert seen["spec"] == bench_mod.BenchSpec(clients=2)
    with pytest.raises(TypeError):
        bench_mod.bench("m", cliens=2)


def test_bad_arguments(tiny):
    with pytest.raises(InvalidInputError, match="modes"):
        bench_mod.bench(tiny, modes=("fast",))
    with pytest.raises(InvalidInputError, match="rate"):
        bench_mod.bench(tiny, rate="often")
    with pytest.raises(InvalidInputError, match="clients"):
        bench_mod.bench(tiny, clients=0)


# ----------------------------------------------------------------------------- real run


def test_tiny_real_run(tiny, tmp_path):
    """Both loops, GSM off (no GSM compiled) and on, one repeat, random-token requests."""
    result = bench_mod.bench(
        tiny, gsm={"target_layers": "all", "smooth_strength": 0.2}, clients=2, requests=4,
        rate=40.0, repeats=1, out=tmp_path, long_fraction=0.25, short_prompt=(4, 10),
        short_new=3, long_prompt=(12, 16), long_new=6, progress=False, log=lambda _m: None,
    )
    d = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.png").exists()
    assert d["config"]["max_len"] == max(max(16, q["prompt_len"] + q["max_new_tokens"])
                                         for q in d["requests"])
    assert d["config"]["data"] == "random"
    assert set(d["warmup"]) == {"off", "on"} and d["warmup"]["on"]["total_s"] > 0
    assert [(r["loop"], r["mode"]) for r in d["runs"]] == [
        ("closed", "off"), ("closed", "on"), ("open", "off"), ("open", "on")]
    for run in d["runs"]:
        assert run["wall_s"] > 0 and len(run["records"]) == 4
        for rec in run["records"]:
            assert rec["n_tokens"] == rec["max_new_tokens"] and rec["finish_reason"] == "length"
            assert 0 <= rec["arrival"] <= rec["admitted"] <= rec["first_token"] <= rec["finish"]
            assert rec["gsm"] == (run["mode"] == "on")
    open_off = next(r for r in d["runs"] if r["loop"] == "open" and r["mode"] == "off")
    arrivals = [r["arrival"] for r in open_off["records"]]
    assert arrivals == pytest.approx([q["arrival_open_s"] for q in d["requests"]], abs=1e-4)
    for loop in ("closed", "open"):
        for mode in ("off", "on"):
            c = d["summary"][loop][mode]["classes"]
            assert c["short"]["requests"] == 3 and c["long"]["requests"] == 1
            assert c["all"]["output_tokens"] == 3 * 3 + 6 and c["all"]["tokens_per_s"]["mean"] > 0
    assert result.table().count("on/off (all)") == 2
    for run in d["runs"]:  # one prefill per request, decode steps with 1..2 active slots
        assert len(run["steps"]["prefill"]) == 4
        assert {n for n, _ in run["steps"]["decode"]} <= {1, 2}
    engine = d["summary"]["closed"]["on"]["engine"]
    # prompts of 4..16 tokens in an 18-slot cache: every chunk is one width, the whole cache
    assert engine["decode_step_s"]["n"] > 0
    assert set(engine["prefill_s_by_bucket"]) == {str(d["config"]["max_len"])}
