"""Evidence report: one command regenerates ``reports/gsm_smollm2.md`` and its figures.

    gsm-jax report --model smollm2-135m --out reports/

Runs, on the real model and data (sizes below are the defaults of `run_report`):

1. profile: 512 WikiText-2 sequences (from the start of the file) -> profile.json + heat map;
2. calibrate: the one-variable-at-a-time search on a small quality set
   (8 sequences x 256 tokens from the end of the file) and a LAMBADA subset
   (the first 100 examples), with the spec's default budget;
3. a full-size evaluation of the chosen configuration (and, on the quality set
   only, of the default strength and of protect_first 0): 32 sequences x 256
   tokens and the whole LAMBADA dev set (2000 examples), greedy agreement of
   8 x 64-token continuations;
4. step-time overhead of GSM (prefill and decode step, GSM compiled out vs in);
5. the serving benchmark `gsm_jax.workflow.bench`, if present, at small sizes;

then writes the markdown answering spec §7 questions 1, 2 and 4 with the
numbers, the configuration, the command and the machine. Question 3 (INT8)
and anything not measured are left as clearly marked places.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gsm_jax.config import GSMConfig
from gsm_jax.errors import InvalidInputError
from gsm_jax.gsm_runtime import resolved_precision
from gsm_jax.workflow import data as data_mod
from gsm_jax.workflow.calibrate import (
    BudgetNotMetError,
    CalibrationResult,
    CalibrationSpec,
    machine_info,
    run_calibration,
)
from gsm_jax.workflow.evaluate import DEFAULT, Evaluator, jsonable
from gsm_jax.workflow.metrics import Budget
from gsm_jax.workflow.overhead import measure_overhead
from gsm_jax.workflow.profile import Profile, profile
from gsm_jax.workflow.report_sections import (  # noqa: F401 - the report's public names
    BENCH_MARK,
    MODEL_TITLES,
    Q3_MARK,
    ReportInputs,
    ReportSizes,
    check_sizes,
    recommend_protect_first,
    render_markdown,
)
from gsm_jax.workflow.results import REPORT_DATA, REPORT_META, find_claim

REPORT_NAME = "gsm_smollm2.md"  # the default model's; `report_name(model)` in general


def report_name(model: str) -> str:
    """`gsm_<family-ish stem>.md`: gsm_smollm2.md, gsm_gemma3.md, gsm_<file stem>.md."""
    return f"gsm_{Path(str(model)).stem.split('-')[0].lower()}.md"


class _Clock:
    """Wall and CPU seconds per phase (CPU: this process, all threads)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        w0, c0 = time.perf_counter(), self._cpu()
        try:
            return fn()
        finally:
            self.phases[name] = {"wall_s": round(time.perf_counter() - w0, 1),
                                 "cpu_s": round(self._cpu() - c0, 1)}

    def total(self) -> dict[str, float]:
        return {k: round(sum(p[k] for p in self.phases.values()), 1) for k in ("wall_s", "cpu_s")}


# ----------------------------------------------------------------------------- report


def run_report(
    *,
    model: str = "smollm2-135m",
    out: str | os.PathLike = "reports",
    data: Any = None,
    lambada: Any = DEFAULT,
    sizes: ReportSizes | None = None,
    budget: Budget | None = None,
    command: str | None = None,
    resume: bool = False,
    progress: bool = True,
) -> Path:
    """Run every measurement and write ``<out>/gsm_smollm2.md`` plus figures and JSON.

    Returns the markdown path. ``command``: the command line to print in the report
    (the CLI passes its own). ``resume``: reuse every measurement already in
    ``<out>/data`` (profile, calibration, each full-size evaluation, overhead, bench)
    and measure only what is missing; the report says what was added when.
    """
    from gsm_jax.loading import load

    sizes = sizes or ReportSizes()
    check_sizes(sizes)
    budget = budget or Budget()
    out = Path(out)
    fig_dir, data_dir = out / "figures", out / "data"
    fig_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    clock = _Clock()
    say = (lambda m: print(f"[gsm-jax report] {m}", file=sys.stderr, flush=True)) if progress \
        else (lambda m: None)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    started, resumed = now, []
    this_command = command or _command_line(model, out, sizes)
    meta_path = data_dir / "report_meta.json"
    if resume and meta_path.exists():
        prev = json.loads(meta_path.read_text())
        started, resumed = prev["started"], list(prev.get("resumed", []))
        clock.phases = dict(prev.get("timings", {}))
        command = prev.get("command") or this_command
    elif resume and (data_dir / "timings.json").exists():
        clock.phases = json.loads((data_dir / "timings.json").read_text())

    def have(rel: str) -> bool:
        return resume and (data_dir / rel).exists()

    added: list[str] = []
    params = clock.run("load model" if not resume else f"load model ({now})",
                       lambda: load(model))
    say(f"loaded {params}")
    if lambada == DEFAULT:
        lambada = data_mod.default_lambada_path()

    # 1. profile
    prof_path = data_dir / "profile.json"
    if have("profile.json"):
        prof = Profile.load(prof_path)
    else:
        prof = clock.run("profile", lambda: profile(
            params, data=data, calibration_samples=sizes.profile_samples,
            seq_len=sizes.profile_seq_len, batch_size=sizes.batch_size, progress=progress))
        prof_path = prof.save(data_dir)
        os.replace(data_dir / "profile_heatmap.png", fig_dir / "profile_heatmap.png")
        added.append("profile")
    say(prof.summary())

    # 2. calibrate
    cal_dir = data_dir / "calibration"

    def _cal() -> CalibrationResult:
        try:
            return run_calibration(params, CalibrationSpec(
                profile=str(prof_path), data=data, lambada=lambada,
                budget=dataclasses.replace(budget, margin_se=sizes.search_margin_se),
                strengths=sizes.strengths, windows=sizes.windows,
                protect_first_values=sizes.protect_first_values,
                num_sequences=sizes.cal_sequences, seq_len=sizes.seq_len,
                batch_size=sizes.batch_size, lambada_samples=sizes.cal_lambada,
                greedy_prompts=sizes.greedy_prompts, greedy_tokens=sizes.greedy_tokens,
                progress=progress))
        except BudgetNotMetError as e:
            return e.result

    if have("calibration/calibration.json"):
        cal = CalibrationResult.load(cal_dir / "calibration.json")
    else:
        cal = clock.run("calibrate", _cal)
        cal.save(cal_dir)
        for name in ("quality_vs_strength.png", "layer_contributions.png",
                     "protect_first.png"):
            if (cal_dir / name).exists():
                os.replace(cal_dir / name, fig_dir / name)
        added.append("calibration")
    say(cal.summary())

    # 3. full-size evaluation
    evaluator: list[Evaluator] = []

    def ev() -> Evaluator:
        if not evaluator:
            evaluator.append(Evaluator(
                params, data=data, lambada=lambada, num_sequences=sizes.final_sequences,
                seq_len=sizes.seq_len, batch_size=sizes.batch_size,
                lambada_samples=sizes.final_lambada, greedy_prompts=sizes.greedy_prompts,
                greedy_tokens=sizes.greedy_tokens, progress=progress))
        return evaluator[0]

    chosen = cal.config
    final_path = data_dir / "final_eval.json"
    final: dict[str, Any] = json.loads(final_path.read_text()) if have("final_eval.json") \
        else {}
    todo: dict[str, tuple[GSMConfig | None, tuple[str, ...]]] = {"base": (None, ())}
    if chosen is not None:
        todo["chosen"] = (chosen, ("quality", "lambada", "greedy"))
        todo["chosen, protect_first 0"] = (chosen.replace(protect_first=0), ("quality",))
        if resolved_precision(chosen.precision) != "f32":
            todo["chosen, precision f32"] = (chosen.replace(precision="f32"), ("quality",))
        weaker = [s for s in cal.search.get("strengths", []) if s < chosen.smooth_strength]
        if weaker:
            todo[f"chosen, strength {max(weaker)} (one grid step weaker)"] = (
                chosen.replace(smooth_strength=max(weaker)), ("quality",))
        todo["default strength 0.1, window 8, high_kurtosis"] = (
            GSMConfig(profile=str(prof_path)), ("quality",))
    for label, (c, parts) in todo.items():
        if label in final:
            continue
        if c is None:
            final[label] = clock.run("final: base model", lambda: ev().baseline()).to_dict()
        else:
            final[label] = clock.run(f"final: {label}", lambda c=c, parts=parts, label=label:
                                     ev().evaluate(c, parts=parts, label=label)).to_dict()
        added.append(f"final: {label}")
        final_path.write_text(json.dumps(jsonable(final), indent=2, allow_nan=False) + "\n")
    final = {k: final[k] for k in todo if k in final}  # report order

    # 4. overhead
    over_cfgs: dict[str, GSMConfig | None] = {"GSM off (compiled out)": None}
    if chosen is not None:
        over_cfgs["GSM on: chosen config"] = chosen
    over_cfgs["GSM on: all 60 pairs, s=0.1"] = GSMConfig(
        target_layers="all", smooth_strength=0.1)
    over_cfgs = {k.replace("60", str(2 * params.config.num_layers)): v
                 for k, v in over_cfgs.items()}
    if have("overhead.json"):
        overhead = json.loads((data_dir / "overhead.json").read_text())
    else:
        overhead = clock.run("overhead", lambda: measure_overhead(
            params, over_cfgs, batch=sizes.overhead_batch, prompt=sizes.overhead_prompt,
            steps=sizes.overhead_steps, reps=sizes.overhead_reps, progress=progress))
        (data_dir / "overhead.json").write_text(json.dumps(overhead, indent=2) + "\n")
        _overhead_figure(overhead, fig_dir / "overhead.png")
        added.append("overhead")

    # 5. serving benchmark (another module; optional)
    bench_note = None
    if have("bench/results.json"):
        bench_note = None
    elif sizes.bench_requests > 0 and chosen is not None:
        try:
            from gsm_jax.workflow.bench import bench as _bench
        except ImportError as e:
            bench_note = f"gsm_jax.workflow.bench is not available ({e})"
        else:
            def _b():
                return _bench(params, gsm=chosen, clients=sizes.bench_clients,
                              requests=sizes.bench_requests, rate=None, repeats=1,
                              out=data_dir / "bench", progress=progress)
            try:
                clock.run("serving benchmark", _b)
                added.append("serving benchmark")
                png = data_dir / "bench" / "results.png"
                if png.exists():
                    os.replace(png, fig_dir / "bench.png")
            except Exception as e:  # noqa: BLE001 - the report must still be written
                bench_note = f"the serving benchmark failed: {type(e).__name__}: {e}"
    elif sizes.bench_requests <= 0:
        bench_note = "skipped (--bench-requests 0)"
    # 5b. the same through the real server (HTTP + SSE, `gsm-jax serve` subprocesses)
    if (not have("serve_http/serve_http.json") and sizes.bench_requests > 0
            and chosen is not None):
        from gsm_jax.serving.bench_client import http_gsm_on_off, wikitext_requests

        def _serve():
            reqs = wikitext_requests(sizes.bench_requests, seed=0)
            return http_gsm_on_off(params.source, chosen, reqs, clients=sizes.bench_clients,
                                   out=data_dir / "serve_http", progress=progress)
        try:
            clock.run("serving through HTTP", _serve)
            added.append("serving through HTTP")
        except Exception as e:  # noqa: BLE001 - the report must still be written
            bench_note = (bench_note or "") + (
                f" The HTTP serving run failed: {type(e).__name__}: {e}")

    meta = {
        "schema": "gsm-jax/report-meta/v1",
        "model": {"source": params.source, "parameters": params.num_parameters(),
                  "num_layers": int(params.config.num_layers), "file": _model_file(model)},
        "machine": machine_info(),
        "sizes": dataclasses.asdict(sizes),
        "budget": budget.to_dict(),
        "started": started,
        "command": command or this_command,
        "timings": clock.phases,
        "bench_note": bench_note,
        "resumed": resumed + ([{"at": now, "command": this_command, "measured": added}]
                              if resume else []),
    }
    (data_dir / "report_meta.json").write_text(
        json.dumps(jsonable(meta), indent=2, allow_nan=False) + "\n")
    (data_dir / "timings.json").write_text(json.dumps(clock.phases, indent=2) + "\n")
    path = render_report(out)
    say(f"wrote {path}")
    return path


def render_report(out: str | os.PathLike = "reports") -> Path:
    """(Re)write ``<out>/gsm_smollm2.md`` from the JSON a `run_report` left in ``<out>/data``.

    Measures nothing: the numbers are the recorded run's. ``gsm-jax report --render-only``.
    """
    out = Path(out)
    inputs = load_inputs(out)
    path = out / report_name(inputs.model["source"])
    path.write_text(render_markdown(inputs))
    return path


def load_inputs(out: str | os.PathLike = "reports") -> ReportInputs:
    """The typed results of the `run_report` whose JSON is in ``<out>/data``."""
    out = Path(out)
    d = out / REPORT_DATA
    need = [REPORT_META, "profile.json", "calibration/calibration.json",
            "final_eval.json", "overhead.json"]
    missing = [n for n in need if not (d / n).exists()]
    if missing:
        raise InvalidInputError(f"{d} lacks {missing}: run `gsm-jax report` (without "
                                "--render-only) first")
    meta = json.loads((d / REPORT_META).read_text())
    sizes = ReportSizes(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in meta["sizes"].items()
                           if k in {f.name for f in dataclasses.fields(ReportSizes)}})
    bench_text = None
    if (d / "bench" / "results.json").exists():
        from gsm_jax.workflow.bench import BenchResult

        bench_text = BenchResult.load(d / "bench" / "results.json").table()
    serve_json = d / "serve_http" / "serve_http.json"
    int8 = _int8_section(out)
    return ReportInputs(
        model=meta["model"], machine=meta["machine"], prof=Profile.load(d / "profile.json"),
        cal=CalibrationResult.load(d / "calibration" / "calibration.json"),
        final=json.loads((d / "final_eval.json").read_text()),
        overhead=json.loads((d / "overhead.json").read_text()), sizes=sizes,
        budget=Budget(**meta["budget"]), timings=meta["timings"], started=meta["started"],
        command=meta["command"], resumed=meta.get("resumed", []), bench_text=bench_text,
        bench_note=meta.get("bench_note"),
        bench_figure=(out / "figures" / "bench.png").exists(),
        serve_http=json.loads(serve_json.read_text()) if serve_json.exists() else None,
        int8_section=int8, int8_summary=_int8_summary(out) if int8 else None,
        claim3=None if int8 else find_claim(out, meta["model"]["source"], 3))


# ----------------------------------------------------------------------------- INT8 (Q3)
# Filled from the INT8 runs (`benchmarks/quant_quality.py`, `benchmarks/bench_quant.py`),
# whose results.json are copied to <out>/data/quant/{quality,speed}.json and their
# PNGs to <out>/figures/quant_{quality,speed}.png. Text: `gsm_jax.workflow.evidence.quant_quality`.


def _rel(path: Path, root: Path) -> str:
    return os.path.relpath(path, root)


def _int8_data(out: Path) -> tuple[dict | None, dict | None]:
    d = out / "data" / "quant"
    return tuple(json.loads((d / n).read_text()) if (d / n).exists() else None
                 for n in ("quality.json", "speed.json"))


def _int8_section(out: Path) -> str | None:
    from gsm_jax.workflow.evidence.quant_quality import report_section

    quality, speed = _int8_data(out)
    if quality is None and speed is None:
        return None
    figs = {k: _rel(out / "figures" / f"quant_{k}.png", out) for k in ("quality", "speed")
            if (out / "figures" / f"quant_{k}.png").exists()}
    return report_section(quality, speed, figures=figs)


def _int8_summary(out: Path) -> str:
    from gsm_jax.workflow.evidence.quant_quality import summary_line

    return summary_line(*_int8_data(out))


def _model_file(model: str) -> str | None:
    """The file behind a registered model name (e.g. the GGUF and its quantization type)."""
    from gsm_jax.loading import REGISTERED_MODELS

    if model in REGISTERED_MODELS:
        try:
            from gsm_jax.models.gguf_reader import default_gguf_path

            return Path(default_gguf_path(REGISTERED_MODELS[model])).name
        except Exception:  # noqa: BLE001 - provenance only
            return None
    return Path(model).name


def _command_line(model: str, out: Path, sizes: ReportSizes) -> str:
    return f"gsm-jax report --model {shlex.quote(model)} --out {shlex.quote(str(out))}"


def _overhead_figure(rows: Sequence[dict], path: Path) -> None:
    from gsm_jax.workflow.plots import overhead_plot

    names = list(dict.fromkeys(r["config"] for r in rows))
    off = names[0]
    bars = []
    for name in names[1:]:
        for kind in ("prefill", "decode"):
            a = next(r for r in rows if r["config"] == off and r["step"] == kind)
            b = next(r for r in rows if r["config"] == name and r["step"] == kind)
            bars.append({"step": f"{kind}\n{name.replace('GSM on: ', '')}",
                         "off_ms": a["median_ms"], "on_ms": b["median_ms"]})
    overhead_plot(bars, path, title="GSM step-time overhead (median ms per call)")
