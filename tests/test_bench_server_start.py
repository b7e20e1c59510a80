"""benchmarks/bench_server_start.py's pure parts (so the script cannot rot without a
server): its arguments, the server flags each start gets, the readings it parses (the
/metrics page, the server's log), the workload's request sizes against a fake client,
issue 42's goals from fake starts, and the files it writes. No server is started."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_server_start")


def _run(bench, scenario, phase, ready, programs, after=0, *, max_len=None, load=0.4,
         others=0.1, error=None):
    max_len = max_len or (8192 if scenario == "max-len-8192" else 2048)
    return {"scenario": scenario, "phase": phase, "run": f"{scenario}_{phase}",
            "max_len": max_len, "ready_s": ready, "warming_s": None if ready is None else 3.0,
            "http_s": 1.0, "compilations_at_ready": programs,
            "compilations_after_ready": after, "load_average_before": [load, 0.5, 0.5],
            "load_average_at_ready": [1.9, 0.8, 0.6], "others_cores": others,
            "comparable": load <= bench.MAX_COMPARABLE_LOAD
            and others <= bench.MAX_OTHERS_CORES,
            "rc": 0, "error": error, "cache_dir": "/tmp/x",
            "warming_progress": [{"t_s": 3.2, "status": "warming", "message": "warming 1/9"}],
            "log_summary": {"cache_hits": 0 if phase == "cold" else programs,
                            "compiled_after_ready": ["jit(_decode)"] * int(after or 0),
                            "cache_dir_logged": "/tmp/x"},
            "workload": {"ok": error is None, "parts": [
                {"part": "greedy", "s": 0.5, "compilations": after, "error": error}]}}


def _verdicts(goals):
    return [g["verdict"] for g in goals]


def test_arguments_and_server_flags(bench):
    a = bench.parse_args([])
    assert a.scenario_list == ["defaults", "max-len-8192"] and a.extra == []
    assert not a.quick and a.settle_s > 0 and a.warm_runs == 1
    q = bench.parse_args(["--quick", "--server-args", "--no-gsm --seed 3"])
    assert q.scenario_list == ["defaults"] and q.settle_s == 0
    assert q.extra == [*bench.QUICK_SERVER_ARGS, "--no-gsm", "--seed", "3"]
    for bad in (["--scenarios", "huge"], ["--scenarios", ","], ["--warm-runs", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    # the scenario's own flag comes last, so it wins over --server-args
    cmd = bench.server_command("smollm2-135m", ["--max-len", "256"], "max-len-8192")
    assert cmd[:2] == ["--model", "smollm2-135m"] and "--port" not in cmd
    s = bench.serve_settings(cmd)
    assert s.max_len == 8192
    d = bench.serve_settings(bench.server_command("m", [], "defaults"))
    assert (d.max_len, d.prefill_chunk, d.max_batch) == (2048, 128, 16)  # the CLI's defaults
    assert d.enable_prefix_caching and not d.no_gsm
    s = bench.serve_settings(bench.server_command("m", q.extra, "defaults"))
    assert (s.max_len, s.prefill_chunk, s.max_batch, s.no_gsm) == (256, 64, 2, True)


def test_readings_from_metrics_and_log(bench):
    page = ("# HELP gsm_jax_compilations_total x\n# TYPE gsm_jax_compilations_total counter\n"
            'gsm_jax_compilations_total{model_name="m"} 14.0\n'
            'gsm_jax_compilations_after_ready_total{model_name="m"} 0.0\n'
            'gsm_jax:prefix_cache_hits_total{model_name="m"} 512.0\n')
    assert bench.metric(page, "gsm_jax_compilations_total") == 14
    assert bench.metric(page, "gsm_jax_compilations_after_ready_total") == 0
    assert bench.metric(page, "gsm_jax:prefix_cache_hits_total") == 512
    assert bench.metric(page, "gsm_jax_nothing") is None
    text = "\n".join([
        "2025-01-01 10:00:01,000 INFO gsm_jax.serving: gsm-jax serve: m loaded; warming up",
        "[gsm-jax] compiling XLA programs for these shapes (once per shape; programs are "
        "saved in /tmp/c/defaults and loaded from there next time; "
        "GSM_JAX_COMPILATION_CACHE=0 turns that off) ...",
        "2025-01-01 10:00:05,000 INFO gsm_jax.serving: gsm-jax serve: warming 1/3: decode r1 "
        "(1 programs, 4.1 s)",
        "2025-01-01 10:00:09,000 INFO gsm_jax.serving: gsm-jax serve: warming 3/3: extend 512 "
        "(3 programs, 8.0 s)",
        "2025-01-01 10:00:10,000 INFO gsm_jax.serving: gsm-jax serve: m ready (max_batch 16, "
        "max_len 2048; warm-up 9.5 s, 12 programs compiled or loaded from the cache)",
        "2025-01-01 10:00:20,000 WARNING gsm_jax.serving: gsm-jax serve: compiled "
        "jit(_scores) after ready (0.40 s; 1 so far)",
        "[gsm-jax] XLA: 15 programs ready in 20.5 s; 15 of them loaded from the persistent "
        "cache (/tmp/c/defaults)"])
    got = bench.parse_log(text)
    assert [w["done"] for w in got["warming_lines"]] == [1, 3]
    assert got["warming_lines"][1] == {"done": 3, "total": 3, "stage": "extend 512",
                                       "programs": 3, "s": 8.0}
    assert (got["warmup_s"], got["warmup_programs"]) == (9.5, 12)
    assert (got["xla_programs"], got["xla_s"], got["cache_hits"]) == (15, 20.5, 15)
    assert got["cache_dir_logged"] == "/tmp/c/defaults"
    assert got["compiled_after_ready"] == ["jit(_scores)"]
    off = bench.parse_log("[gsm-jax] XLA: 9 programs ready in 3.0 s; persistent cache off")
    assert off["xla_programs"] == 9 and off["cache_dir_logged"] is None
    assert bench.parse_log("")["warmup_s"] is None


class _Resp:
    def __init__(self, body=None, text=""):
        self.status_code, self._body, self.text = 200, body or {}, text

    def json(self):
        return self._body

    def iter_lines(self):
        return iter(["data: {}", "data: [DONE]"])


class _FakeHTTP:
    """Records every request the workload sends; a prefix-cache hit on every call."""

    def __init__(self):
        self.calls, self.hits = [], 0

    def post(self, path, json=None, headers=None):
        self.calls.append((path, json))
        return _Resp({"choices": [{}]})

    def put(self, path, json=None, headers=None):
        self.calls.append((path, json))
        return _Resp()

    def get(self, path):
        self.hits += 64
        return _Resp(text=f'gsm_jax:prefix_cache_hits_total{{model_name="m"}} {self.hits}\n')

    @contextmanager
    def stream(self, method, path, json=None):
        self.calls.append((path, json))
        yield _Resp()


@pytest.mark.parametrize("extra", [[], ["--max-len", "256", "--prefill-chunk", "64",
                                        "--no-gsm"]])
def test_workload_sizes_its_requests_by_the_server_flags(bench, extra):
    settings = bench.serve_settings(bench.server_command("m", extra, "defaults"))
    http = _FakeHTTP()
    parts = bench.workload_parts(http, "m", settings, vocab=49152, chat_template=True)
    names = [n for n, _ in parts]
    assert ("GSM config change" in names) == (not settings.no_gsm)
    for _, fn in parts:
        fn()
    lengths = [len(b["prompt"]) for p, b in http.calls
               if p == "/v1/completions" and isinstance(b["prompt"], list)
               and isinstance(b["prompt"][0], int)]
    assert min(lengths) == 1 and max(lengths) == settings.max_len - 4
    assert any(n > settings.prefill_chunk for n in lengths)  # chunked prefill runs
    for p, b in http.calls:
        if p == "/v1/completions" and isinstance(b["prompt"], list) and isinstance(
                b["prompt"][0], int):
            assert len(b["prompt"]) + b["max_tokens"] <= settings.max_len, b["max_tokens"]
            assert all(100 <= t < 49150 for t in b["prompt"])
    sent = {(p, json.dumps(b, sort_keys=True)) for p, b in http.calls}
    assert len(sent) < len(http.calls)  # the long prompt went twice (a prefix-cache hit)
    assert any(b.get("logprobs") and b.get("echo") for _, b in http.calls if b)
    assert any(b.get("n", 1) > 1 for _, b in http.calls if b)
    # without a chat template the chat parts send nothing (the server would answer 400)
    http2 = _FakeHTTP()
    for _, fn in bench.workload_parts(http2, "m", settings, 300, chat_template=False):
        fn()
    assert http2.calls and not any("chat" in p for p, _ in http2.calls)


def test_goals_pass_fail_and_not_measured(bench):
    good = [_run(bench, "defaults", "cold", 60.0, 14), _run(bench, "defaults", "warm", 10.0, 14),
            _run(bench, "max-len-8192", "cold", 66.0, 14),
            _run(bench, "max-len-8192", "warm", 11.0, 14)]
    goals = bench.check_goals(good)
    assert _verdicts(goals) == ["pass"] * 7, goals
    assert all(g["comparable"] for g in goals)
    assert goals[2]["value"] == pytest.approx(1.1)

    bad = [_run(bench, "defaults", "cold", 100.0, 14, load=2.0),
           _run(bench, "defaults", "warm", 20.0, 14),
           _run(bench, "max-len-8192", "cold", None, None, error="not ready after 900 s"),
           _run(bench, "max-len-8192", "warm", 30.0, 20, after=3)]
    goals = {g["goal"].split(" (")[0]: g for g in bench.check_goals(bad)}
    assert goals["defaults: warm ready"]["verdict"] == "FAIL"
    assert goals["defaults: cold ready"]["verdict"] == "FAIL"
    assert not goals["defaults: cold ready"]["comparable"]  # started at load 2
    assert goals["max-len-8192 / defaults: cold ready"]["shown"] == "not ready"
    assert goals["max-len-8192 / defaults: cold ready"]["verdict"] == "FAIL"
    assert goals["max-len-8192 / defaults: warm ready"]["value"] == pytest.approx(1.5)
    assert goals["programs compiled at start"]["verdict"] == "FAIL"
    assert goals["programs at start: the same at every --max-len"]["verdict"] == "FAIL"
    assert goals["compilations after ready under the workload"]["value"] == 3

    quick = bench.check_goals(good[:2])  # --quick: the defaults only
    assert _verdicts(quick) == ["pass", "pass", "not measured", "not measured", "pass",
                                "not measured", "pass"]
    assert _verdicts(bench.check_goals([]))[:2] == ["not measured", "not measured"]


def test_outputs_from_a_fake_result(bench, tmp_path):
    runs = [_run(bench, "defaults", "cold", 60.0, 14),
            _run(bench, "defaults", "warm", 10.0, 14, load=1.8),
            _run(bench, "max-len-8192", "cold", 100.0, 16, after=2),
            _run(bench, "max-len-8192", "warm", None, None, error="not ready after 900 s")]
    data = {"config": {"model": "smollm2-135m", "server_args": [], "poll_s": 0.2,
                       "quick": True},
            "machine_before": {"cpu_model": "Test CPU", "cpu_count": 2},
            "runs": runs, "goals": bench.check_goals(runs)}
    bench.write_outputs(tmp_path, data)
    back = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in back["runs"]] == [r["run"] for r in runs]
    assert len(back["goals"]) == 7
    md = (tmp_path / "results.md").read_text()
    assert "## Goals (issue 42)" in md and "FAIL" in md and "pass" in md
    assert "not a measurement" in md and "not ready" in md
    assert "NO (load)" in md  # the warm defaults start began at load 1.8
    assert "compiled after ready: jit(_decode), jit(_decode)" in md
    assert "warming 1/9" in md and "## Workload after ready" in md
    png = tmp_path / "results.png"
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_quick_run_against_a_tiny_served_model(bench, tmp_path):
    """The whole script, `--quick` (cold + warm), on a 2-layer random Llama directory: two
    real `gsm-jax serve` starts, the workload over HTTP, SIGTERM, and the files. No
    timing assertion; the counts are issue 42's (nothing compiled after ready, the same
    programs at both starts)."""
    from tiny_models import write_tiny_hf_llama

    model = write_tiny_hf_llama(tmp_path / "tiny", max_positions=512)
    out = tmp_path / "out"
    rc = bench.main(["--quick", "--model", str(model), "--out", str(out),
                     "--cache-root", str(tmp_path / "caches"), "--timeout-s", "300"])
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert [(r["scenario"], r["phase"]) for r in runs] == [("defaults", "cold"),
                                                           ("defaults", "warm")]
    for r in runs:
        assert r["error"] is None, (r["error"], r.get("log_tail"))
        assert r["ready_s"] > 0 and r["rc"] == 0 and r["max_len"] == 256
        assert r["warming_progress"] and r["compilations_at_ready"] > 0
        assert r["workload"]["ok"] and len(r["workload"]["parts"]) >= 8
        assert r["cache_dir_ok"] is not False, r["log_summary"]
    cold, warm = runs
    assert cold["cache_before"]["files"] == 0 < cold["cache_after"]["files"]
    assert warm["cache_before"]["files"] == cold["cache_after"]["files"]
    assert rc == 0
    goals = {g["goal"].split(" (")[0]: g["verdict"] for g in res["goals"]}
    assert goals["compilations after ready under the workload"] == "pass"
    assert (out / "results.png").stat().st_size > 5000
    assert "Quick smoke run" in (out / "results.md").read_text()
