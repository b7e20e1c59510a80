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
import functools
import json
import os
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.config import GSMConfig
from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.gsm_runtime import gsm_inputs_for_batch, resolved_precision
from gsm_jax.workflow import data as data_mod
from gsm_jax.workflow.calibrate import (
    DEFAULT_PROTECT_FIRST_VALUES,
    DEFAULT_STRENGTHS,
    DEFAULT_WINDOWS,
    BudgetNotMetError,
    CalibrationResult,
    calibrate,
    machine_info,
)
from gsm_jax.workflow.evaluate import DEFAULT, Evaluator, _jsonable
from gsm_jax.workflow.metrics import Budget
from gsm_jax.workflow.profile import Profile, profile

REPORT_NAME = "gsm_smollm2.md"  # the default model's; `report_name(model)` in general
# Display names of the registered models (the report's title)
MODEL_TITLES = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}


def report_name(model: str) -> str:
    """`gsm_<family-ish stem>.md`: gsm_smollm2.md, gsm_gemma3.md, gsm_<file stem>.md."""
    return f"gsm_{Path(str(model)).stem.split('-')[0].lower()}.md"
Q3_MARK = "<!-- GSM-REPORT: Q3 INT8 (filled by the quantization issue) -->"
BENCH_MARK = "<!-- GSM-REPORT: serving benchmark (gsm_jax.bench) -->"


@dataclasses.dataclass
class ReportSizes:
    profile_samples: int = 512
    profile_seq_len: int = 128
    cal_sequences: int = 8
    cal_lambada: int | None = 100
    final_sequences: int = 32
    final_lambada: int | None = None  # None: the whole LAMBADA dev set
    seq_len: int = 256
    batch_size: int = 8
    greedy_prompts: int = 8
    greedy_tokens: int = 64
    strengths: tuple[float, ...] = DEFAULT_STRENGTHS
    windows: tuple[int | str, ...] = DEFAULT_WINDOWS
    protect_first_values: tuple[int, ...] = DEFAULT_PROTECT_FIRST_VALUES
    overhead_batch: int = 8
    overhead_prompt: int = 128
    overhead_steps: int = 32
    overhead_reps: int = 3
    bench_requests: int = 8
    bench_clients: int = 4
    # The search accepts a config only this many standard errors inside the KLD / top-1
    # limits (`Budget.margin_se`): on SmolLM2 the search set's 2040 tokens put the
    # same-top-1 standard error at ~0.36 points, and the config chosen without a margin
    # (97.21% in the search) fell to 96.90% on the full-size set; 2 s.e. would have
    # chosen strength 0.01, which holds there (98.46%).
    search_margin_se: float = 2.0

    @classmethod
    def smoke(cls) -> ReportSizes:
        """Tiny sizes: checks the pipeline end to end in a few minutes (numbers meaningless)."""
        return cls(profile_samples=8, profile_seq_len=64, cal_sequences=2, cal_lambada=8,
                   final_sequences=2, final_lambada=8, seq_len=64, batch_size=2,
                   greedy_prompts=2, greedy_tokens=8, strengths=(0.02, 0.1),
                   windows=(4, 8), protect_first_values=(0, 1), overhead_batch=2,
                   overhead_prompt=32, overhead_steps=4, overhead_reps=1, bench_requests=0)


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


# ----------------------------------------------------------------------------- overhead


def measure_overhead(params: Any, configs: dict[str, GSMConfig | None], *, batch: int = 8,
                     prompt: int = 256, steps: int = 32, reps: int = 3,
                     progress: bool = True) -> list[dict[str, Any]]:
    """Prefill and decode-step time per config (None = GSM compiled out), interleaved.

    Prefill: one jitted `prefill` of ``batch`` rows x ``prompt`` tokens. Decode:
    ``steps`` jitted `decode_step` calls (cache donated) from that prefill. Each
    repetition runs every config once, in rotating order, so drift of a shared
    machine falls on all; the median over repetitions is reported (ms per call).
    """
    cfg = params.config
    fam = family_module(cfg.family)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    cache_len = prompt + steps
    dtype = jax.tree.leaves(params.weights)[0].dtype

    @functools.partial(jax.jit, static_argnames=("max_window",))
    def prefill(weights, tokens, lengths, gsm, *, max_window):
        cache = fam.init_cache(cfg, batch, cache_len, dtype=dtype, gsm_max_window=max_window)
        return fam.prefill(weights, cfg, tokens, lengths, cache, gsm)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(weights, tok, cache, gsm):
        logits, cache = fam.decode_step(weights, cfg, tok, cache, gsm)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    gsm_in = {name: None if c is None else gsm_inputs_for_batch(
        c, cfg.num_layers, batch, [prompt + steps] * batch) for name, c in configs.items()}
    mw = {name: None if c is None else c.max_window for name, c in configs.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in configs}

    def once(name: str, record: bool) -> None:
        g = gsm_in[name]
        t0 = time.perf_counter()
        logits, cache = prefill(params.weights, tokens, lengths, g, max_window=mw[name])
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready(tok)
        t2 = time.perf_counter()
        for _ in range(steps):
            tok, cache = step(params.weights, tok, cache, g)
        jax.block_until_ready(tok)
        t3 = time.perf_counter()
        if record:
            times[name]["prefill"].append(t1 - t0)
            times[name]["decode"].append((t3 - t2) / steps)

    from tqdm import tqdm

    names = list(configs)
    for name in tqdm(names, desc="overhead: compile", disable=not progress, leave=False):
        once(name, record=False)
    for r in tqdm(range(reps), desc="overhead", disable=not progress, leave=False):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            once(name, record=True)
    rows = []
    for name in names:
        for kind in ("prefill", "decode"):
            v = np.asarray(times[name][kind]) * 1e3
            rows.append({"config": name, "step": kind, "median_ms": float(np.median(v)),
                         "min_ms": float(v.min()), "max_ms": float(v.max()), "reps": int(v.size),
                         "batch": batch, "prompt": prompt})
    return rows


# ----------------------------------------------------------------------------- markdown helpers


def _f(v: Any, fmt: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "–"
    return format(v, fmt)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _cfg_line(c: dict) -> str:
    tl = c["target_layers"]
    if isinstance(tl, dict):
        pairs = sum(len(v) for v in tl.values())
        layers = ", ".join(f"{k}:{'+'.join(v)}" for k, v in tl.items())
        target = f"{pairs} pairs ({layers})"
    else:
        target = str(tl)
    return (f"strength {c['smooth_strength']}, window {c['window_size']}, protect_first "
            f"{c['protect_first']}, precision {c['precision']}, target {target}")


def _trial_rows(trials: Sequence[dict], stages: Sequence[str]) -> list[list[str]]:
    rows = []
    for t in trials:
        if t["stage"] not in stages or t["scope"] != "targets":
            continue
        q = t["result"]["quality"]
        la = t["result"].get("lambada")
        rows.append([t["stage"], t["strength"], t["window"], t["protect_first"],
                     _f(q["mean_kld"], ".5f"), _f(q["p99_kld"], ".4f"),
                     _f(q["same_top1_pct"], ".2f"), _f(q["rms_dp_pct"], ".3f"),
                     _f(q["ppl_ratio"], ".4f"),
                     "–" if la is None else _f(la["accuracy_drop_points"], "+.2f"),
                     "yes" if t["within_budget"] else
                     ("no" if t["violations"] else "KLD/top-1 ok, task not measured")])
    return rows


def _rel(path: Path, root: Path) -> str:
    return os.path.relpath(path, root)


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
    import gsm_jax

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
                       lambda: gsm_jax.load(model))
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
            return calibrate(
                params, profile=str(prof_path), data=data, lambada=lambada,
                budget=dataclasses.replace(budget, margin_se=sizes.search_margin_se),
                strengths=sizes.strengths, windows=sizes.windows,
                protect_first_values=sizes.protect_first_values,
                num_sequences=sizes.cal_sequences, seq_len=sizes.seq_len,
                batch_size=sizes.batch_size, lambada_samples=sizes.cal_lambada,
                greedy_prompts=sizes.greedy_prompts, greedy_tokens=sizes.greedy_tokens,
                progress=progress)
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
        final_path.write_text(json.dumps(_jsonable(final), indent=2, allow_nan=False) + "\n")
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
        json.dumps(_jsonable(meta), indent=2, allow_nan=False) + "\n")
    (data_dir / "timings.json").write_text(json.dumps(clock.phases, indent=2) + "\n")
    path = render_report(out)
    say(f"wrote {path}")
    return path


def render_report(out: str | os.PathLike = "reports") -> Path:
    """(Re)write ``<out>/gsm_smollm2.md`` from the JSON a `run_report` left in ``<out>/data``.

    Measures nothing: the numbers are the recorded run's. ``gsm-jax report --render-only``.
    """
    out = Path(out)
    d = out / "data"
    need = ["report_meta.json", "profile.json", "calibration/calibration.json",
            "final_eval.json", "overhead.json"]
    missing = [n for n in need if not (d / n).exists()]
    if missing:
        raise InvalidInputError(f"{d} lacks {missing}: run `gsm-jax report` (without "
                                "--render-only) first")
    meta = json.loads((d / "report_meta.json").read_text())
    sizes = ReportSizes(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in meta["sizes"].items()
                           if k in {f.name for f in dataclasses.fields(ReportSizes)}})
    clock = _Clock()
    clock.phases = meta["timings"]
    bench_text = None
    if (d / "bench" / "results.json").exists():
        from gsm_jax.workflow.bench import BenchResult

        bench_text = BenchResult.load(d / "bench" / "results.json").table()
    md = _markdown(
        out=out, model=meta["model"], machine=meta["machine"], prof=Profile.load(
            d / "profile.json"), cal=CalibrationResult.load(d / "calibration" /
                                                          "calibration.json"),
        final=json.loads((d / "final_eval.json").read_text()),
        overhead=json.loads((d / "overhead.json").read_text()), bench_text=bench_text,
        bench_note=meta.get("bench_note"), sizes=sizes, budget=Budget(**meta["budget"]),
        clock=clock, started=meta["started"], command=meta["command"],
        resumed=meta.get("resumed", []))
    path = out / report_name(meta["model"]["source"])
    path.write_text(md)
    return path


# ----------------------------------------------------------------------------- INT8 (Q3)
# Filled from the INT8 runs (`benchmarks/quant_quality.py`, `benchmarks/bench_quant.py`),
# whose results.json are copied to <out>/data/quant/{quality,speed}.json and their
# PNGs to <out>/figures/quant_{quality,speed}.png. Text: `gsm_jax.quant_quality`.


def _int8_data(out: Path) -> tuple[dict | None, dict | None]:
    d = out / "data" / "quant"
    return tuple(json.loads((d / n).read_text()) if (d / n).exists() else None
                 for n in ("quality.json", "speed.json"))


def _int8_section(out: Path) -> str | None:
    from gsm_jax.quant_quality import report_section

    quality, speed = _int8_data(out)
    if quality is None and speed is None:
        return None
    figs = {k: _rel(out / "figures" / f"quant_{k}.png", out) for k in ("quality", "speed")
            if (out / "figures" / f"quant_{k}.png").exists()}
    return report_section(quality, speed, figures=figs)


def _evidence_claim(out: Path, model: str, n: int) -> dict | None:
    """Claim `n` of `gsm-jax evidence` for `model`, if measured: the evidence data sits in
    <reports>/data/evidence/<model>/, with this report in <reports> or <reports>/<model>."""
    from gsm_jax.workflow.evidence.runner import model_slug

    for root in (out, out.parent):
        path = root / "data" / "evidence" / model_slug(model) / f"claim_{n}.json"
        if path.exists():
            return json.loads(path.read_text())
    return None


def _int8_summary(out: Path) -> str:
    from gsm_jax.quant_quality import summary_line

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


def _markdown(*, out: Path, model: dict, machine: dict, prof: Profile, cal: CalibrationResult,
              final: dict, overhead: list, bench_text: str | None, bench_note: str | None,
              sizes: ReportSizes, budget: Budget, clock: _Clock, started: str,
              command: str, resumed: Sequence[dict] = ()) -> str:
    mach = machine
    tot = clock.total()
    figs = out / "figures"
    L = model["num_layers"]
    base = final["base"]
    chosen_r = final.get("chosen")
    trials = cal.trials
    by = {(t["strength"], t["window"], t["protect_first"]): t for t in trials
          if t["scope"] == "targets" and t["stage"] in ("strength", "curve", "window",
                                                         "protect_first", "backoff")}
    default_t = by.get((0.1, 8, 1))
    dq = (default_t or {}).get("result", {}).get("quality") if default_t else None
    lines: list[str] = []
    w = lines.append
    w(f"# GSM on {MODEL_TITLES.get(model['source'], model['source'])}: evidence report")
    w("")
    w(f"Generated {started} by `{command}` ({tot['wall_s'] / 60:.0f} min wall, "
      f"{tot['cpu_s'] / 60:.0f} min CPU) on {mach['cpu']} ({mach['cpu_count']} cores, shared), "
      f"JAX {mach['jax']} on {mach['backend']}. Model `{model['source']}` "
      f"({model['parameters'] / 1e6:.1f}M parameters, {L} layers; "
      + (f"file `{model['file']}`, " if model.get("file") else "")
      + "weights dequantized to float32). Every number below comes from that run; the "
      "JSON behind it is in `data/`."
      + "".join(f" Resumed {r['at']} by `{r.get('command', '--resume')}` to measure only "
                f"what was missing: {', '.join(r['measured']) or 'nothing'}."
                for r in resumed))
    w("")
    # ---- summary
    w("## Summary: what GSM does and does not buy")
    w("")
    sp = []
    if dq:
        over = budget.violations(dq, None)
        head = ("Quality costs more than the budget at the document's strength." if over
                else "The document's strength fits the KLD/top-1 budget.")
        sp.append(f"- **{head}** At "
                  f"strength 0.1, window 8, on the {len(cal.targets)} high-kurtosis (layer, "
                  f"site) pairs, mean KLD against the unsmoothed model is "
                  f"{dq['mean_kld']:.4f} (budget {budget.max_mean_kld}), the top-1 token "
                  f"changes at {100 - dq['same_top1_pct']:.1f}% of positions (budget ≤ "
                  f"{100 - budget.min_same_top1_pct:g}%) and perplexity rises by "
                  f"{100 * (dq['ppl_ratio'] - 1):+.1f}%.")
    if cal.chosen is not None and chosen_r is not None:
        cq, cl = chosen_r["quality"], chosen_r.get("lambada")
        sp.append(f"- **Within the default budget** (mean KLD ≤ {budget.max_mean_kld}, same "
                  f"top-1 ≥ {budget.min_same_top1_pct:g}%, LAMBADA drop ≤ "
                  f"{budget.max_accuracy_drop_points:g} point) the calibration keeps "
                  f"{_cfg_line(cal.chosen)}. On the full-size evaluation it costs mean KLD "
                  f"{cq['mean_kld']:.4f}, same top-1 {cq['same_top1_pct']:.2f}%, perplexity "
                  f"×{cq['ppl_ratio']:.4f}"
                  + (f", LAMBADA {cl['accuracy_pct']:.2f}% vs {cl['accuracy_base_pct']:.2f}% "
                     f"({cl['n_examples']} examples)" if cl else "") + "; "
                  + ("within the budget on these larger sets too."
                     if not budget.violations(cq, cl) else
                     "on these larger sets it is outside the budget ("
                     + "; ".join(budget.violations(cq, cl)) + "): the search set was small "
                     "and the margin is thin."))
        weak = next(((k, v) for k, v in final.items() if "one grid step weaker" in k), None)
        if weak is not None and budget.violations(cq, cl):
            wq = weak[1]["quality"]
            ok = not budget.violations(wq, None)
            sp.append(f"- **{'One' if ok else 'Even one'} grid step weaker** "
                      f"({weak[0].split(', ')[1].split(' (')[0]}) the full-size quality set "
                      f"gives mean KLD {wq['mean_kld']:.4f}, same top-1 "
                      f"{wq['same_top1_pct']:.2f}%, perplexity ×{wq['ppl_ratio']:.4f}: "
                      + ("within the KLD/top-1 limits (LAMBADA not re-measured at full size)."
                         if ok else "still outside the KLD/top-1 limits."))
        f32 = final.get("chosen, precision f32")
        if f32 is not None:
            k32 = f32["quality"]["mean_kld"]
            share = 1 - k32 / cq["mean_kld"] if cq["mean_kld"] > 0 else 0.0
            head = ("Part of that cost is the filter's bf16 arithmetic." if share > 0.2 else
                    "The filter's bf16 arithmetic adds little to that cost.")
            sp.append(f"- **{head}** The same configuration with precision f32 costs mean KLD "
                      f"{k32:.5f} against {cq['mean_kld']:.5f} in bf16 ({-100 * share:+.0f}%; "
                      f"same top-1 {f32['quality']['same_top1_pct']:.2f}%): with bf16 every "
                      "smoothed activation is also rounded to bf16's 8-bit mantissa.")
    else:
        sp.append("- **No configuration met the budget**; the best one found is reported in "
                  "the calibration section. Nothing falls back to a default.")
    pf = [r for r in cal.protect_first]
    if pf:
        s0 = pf[-1]["strength"]
        r0 = next((r for r in pf if r["strength"] == s0 and r["protect_first"] == 0), None)
        r1 = next((r for r in pf if r["strength"] == s0 and r["protect_first"] == 1), None)
        if r0 and r1 and r1["mean_kld"] > 0:
            ratio = r0["mean_kld"] / r1["mean_kld"]
            head = "protect_first matters." if ratio > 1.5 else "protect_first changes little."
            sp.append(f"- **{head}** Letting the first token be smoothed "
                      f"(protect_first 0) multiplies mean KLD by {ratio:.1f}× at strength {s0} "
                      f"({r0['mean_kld']:.4f} vs {r1['mean_kld']:.4f} with protect_first 1). "
                      + _first_token_sentence(prof))
    ov = {(r["config"], r["step"]): r["median_ms"] for r in overhead}
    names = list(dict.fromkeys(r["config"] for r in overhead))
    if len(names) > 1:
        off = names[0]
        parts = []
        for name in names[1:]:
            pre = 100 * (ov[(name, "prefill")] / ov[(off, "prefill")] - 1)
            dec = 100 * (ov[(name, "decode")] / ov[(off, "decode")] - 1)
            parts.append(f"{name.replace('GSM on: ', '')}: prefill {pre:+.1f}%, "
                         f"decode step {dec:+.1f}%")
        noise = max(100 * (r["max_ms"] - r["min_ms"]) / r["median_ms"] for r in overhead
                    if r["config"] == off)
        sp.append("- **Speed: GSM alone only adds work.** Step time with GSM on vs compiled "
                  "out (median of interleaved repetitions on this shared CPU, where the "
                  f"GSM-off times alone spread by up to {noise:.0f}% between repetitions): "
                  + "; ".join(parts) + ". A dense fp32 step does the same arithmetic whatever "
                  "the activation values, so smoothing cannot make it faster; a negative "
                  "difference here is noise, not a gain.")
    if _int8_section(out):  # INT8 runs recorded: their own summary line
        sp.append("- **INT8 (question 3 below)**: " + _int8_summary(out))
    else:
        sp.append("- **Low precision is not part of this report**: the one credible route to "
                  "speed is lower precision (INT8/FP8) made safe by smoothing. This model's "
                  "INT8 W8A8 and FP8 runs, GSM against SmoothQuant and Hadamard, are claim 3 "
                  "of the cross-model evidence (`gsm-jax evidence`, `reports/gsm_evidence.md`)"
                  "; without them GSM is a quality cost with no measured benefit here.")
    lines += sp
    w("")
    # ---- setup
    w("## Setup")
    w("")
    tot_cal = len([t for t in trials if t["stage"] != "final"])
    w(_table(["what", "size"], [
        ["profile", f"{prof.data['calibration_samples']} WikiText-2 sequences × "
                    f"{prof.data['seq_len']} tokens (from the start of the file), "
                    f"{prof.data['tokens']} tokens"],
        ["calibration search", f"quality set {cal.sizes['quality_sequences']} × "
                               f"{cal.sizes['seq_len']} tokens (from the end of the file, "
                               f"{cal.sizes['quality_tokens_scored']} scored tokens); LAMBADA: "
                               f"first {cal.sizes['lambada_examples']} examples; {tot_cal} "
                               "configurations"],
        ["search margin", (f"a configuration is accepted in the search only "
                           f"{cal.budget['margin_se']:g} standard errors inside the KLD and "
                           "top-1 limits (its own s.e. on the search set), so that it holds "
                           "on the full-size set" if cal.budget.get("margin_se") else
                           "none (the search judged configurations at the budget itself)")],
        ["full-size evaluation", f"quality set {base['sizes']['quality_sequences']} × "
                                 f"{base['sizes']['seq_len']} tokens "
                                 f"({base['sizes']['quality_tokens_scored']} scored); LAMBADA "
                                 f"{base['sizes']['lambada_examples']} examples; greedy "
                                 f"{base['sizes']['greedy_prompts']} × "
                                 f"{base['sizes']['greedy_tokens']} tokens"],
        ["budget", f"mean KLD ≤ {budget.max_mean_kld}, same top-1 ≥ "
                   f"{budget.min_same_top1_pct:g}%, LAMBADA accuracy drop ≤ "
                   f"{budget.max_accuracy_drop_points:g} point"],
        ["strength grid", ", ".join(str(s) for s in cal.search["strengths"])
         + (f" (skipped above max_strength: {cal.skipped_strengths})"
            if cal.skipped_strengths else "")],
        ["windows", ", ".join(str(x) for x in cal.search["windows"])],
        ["GSM arithmetic", f"precision {cal.base_config['precision']}, max_window "
                           f"{cal.base_config['max_window']}"],
    ]))
    w("")
    w("Base model on the full-size sets: perplexity "
      f"{base['quality']['ppl_base']:.3f} on {base['quality']['n_tokens']} WikiText-2 tokens"
      + (f", LAMBADA accuracy {base['lambada']['accuracy_base_pct']:.2f}% "
         f"({base['lambada']['n_examples']} examples)" if base.get("lambada") else "") + ".")
    w("")
    w("Metrics (all against the unsmoothed model on the same tokens): mean and 99th-percentile "
      "KL(base ‖ GSM) of the next-token distribution, same top-1 token %, RMS Δp (change of "
      "the probability of the real next token, percentage points) and perplexity ratio, as "
      "llama.cpp's perplexity tool; LAMBADA last-word accuracy (greedy; the word is the run "
      "of word characters after leading whitespace, exact match, see "
      "`gsm_jax/workflow/metrics.py`); greedy agreement = share of 64-token continuation "
      "before the first differing token.")
    w("")
    # ---- profile
    w("## Step 1: activation profile")
    w("")
    w(f"![profile heat map]({_rel(figs / 'profile_heatmap.png', out)})")
    w("")
    top = sorted(prof.stats, key=lambda s: -(s["excess_kurtosis"] or -1e300))[:10]
    w(_table(["layer", "site", "excess kurtosis", "max abs", "max abs, first token",
              "max abs, other tokens", "6σ share", "top channels"],
             [[s["layer"], s["site"], _f(s["excess_kurtosis"], ".0f"), _f(s["max_abs"], ".1f"),
               _f(s["max_abs_first_token"], ".1f"), _f(s["max_abs_other_tokens"], ".1f"),
               _f(s["outlier_share_6sigma"], ".2e"),
               ", ".join(str(c["channel"]) for c in s["top_channels"][:3])] for s in top]))
    w("")
    hk = prof.high_kurtosis
    n_ffn = sum(1 for _, s in hk if s == "ffn_mid")
    w(f"`high_kurtosis` (top quarter by excess kurtosis) = {len(hk)} pairs, {n_ffn} of them "
      f"`ffn_mid`: " + ", ".join(f"{layer}:{site}" for layer, site in hk) + ". Kurtosis is "
      f"{prof.data['kurtosis_definition']}. 6σ share: "
      f"{prof.data['statistics']['outlier_share_6sigma']}.")
    w("")
    # ---- Q1
    w("## Q1: quality cost per strength and window")
    w("")
    w(f"![quality vs strength]({_rel(figs / 'quality_vs_strength.png', out)})")
    w("")
    w(f"Calibration quality set ({cal.sizes['quality_tokens_scored']} tokens; LAMBADA drop on "
      f"the first {cal.sizes['lambada_examples']} examples, measured only where the KLD and "
      "top-1 limits hold), all high-kurtosis pairs smoothed:")
    w("")
    head = ["stage", "strength", "window", "protect_first", "mean KLD", "p99 KLD", "same top-1 %",
            "RMS Δp %", "PPL ratio", "LAMBADA drop", "within budget"]
    rows = _trial_rows(trials, ("strength", "curve", "window"))
    rows.sort(key=lambda r: (isinstance(r[2], str), r[2] if isinstance(r[2], int) else 0,
                             float(r[1])))
    w(_table(head, rows))
    w("")
    # ---- calibration
    w("## Step 4: calibration")
    w("")
    if cal.chosen is not None:
        w(f"**Chosen:** {_cfg_line(cal.chosen)}. Why: {cal.chosen_reason}.")
        w("")
        w("```yaml")
        import yaml

        w(yaml.safe_dump(cal.chosen, sort_keys=False).rstrip())
        w("```")
    else:
        bf = cal.best_found or {}
        w(f"**Budget not met.** Best found: strength {bf.get('strength')}, window "
          f"{bf.get('window')}, {bf.get('scope')} ({'; '.join(bf.get('violations', []))}).")
    w("")
    if cal.contributions:
        c0 = cal.contributions[0]
        w(f"Back-off at strength {c0['strength']}, window {c0['window']} (where the budget "
          "broke): each layer's targeted sites smoothed alone; layers removed largest first "
          "until the rest fit. Culprits: " + (", ".join(
              f"layer {c['layer']} (alone: KLD {c['mean_kld']:.4f})" for c in cal.culprits)
              or "none") + ".")
        w("")
        w(f"![per-layer contribution]({_rel(figs / 'layer_contributions.png', out)})")
        w("")
        bo = [t for t in trials if t["stage"] == "backoff"]
        if bo:
            w(_table(["scope", "mean KLD", "same top-1 %", "LAMBADA drop", "within budget"],
                     [[t["scope"], _f(t["result"]["quality"]["mean_kld"], ".5f"),
                       _f(t["result"]["quality"]["same_top1_pct"], ".2f"),
                       _f((t["result"].get("lambada") or {}).get("accuracy_drop_points"),
                          "+.2f"), "yes" if t["within_budget"] else "no"] for t in bo]))
            w("")
        if cal.alternative:
            w(f"Alternative within budget: {_cfg_line(cal.alternative['config'])} (the "
              "breaking strength without the culprits).")
            w("")
    if chosen_r is not None:
        w("Full-size evaluation of the chosen configuration:")
        w("")
        rows = []
        for label, r in final.items():
            q = r.get("quality") or {}
            la = r.get("lambada") or {}
            g = r.get("greedy") or {}
            rows.append([label, _f(q.get("mean_kld"), ".5f"), _f(q.get("p99_kld"), ".4f"),
                         _f(q.get("same_top1_pct"), ".2f"), _f(q.get("rms_dp_pct"), ".3f"),
                         _f(q.get("ppl"), ".3f"), _f(q.get("ppl_ratio"), ".4f"),
                         _f(la.get("accuracy_pct"), ".2f"),
                         _f(la.get("accuracy_drop_points"), "+.2f"),
                         _f(g.get("prefix_agreement_pct"), ".1f"),
                         _f(g.get("identical_pct"), ".1f")])
        w(_table(["config", "mean KLD", "p99 KLD", "same top-1 %", "RMS Δp %", "PPL",
                  "PPL ratio", "LAMBADA %", "drop (points)", "greedy prefix agree %",
                  "identical %"], rows))
        w("")
    # ---- Q2
    w("## Q2: does protect_first ≥ 1 reduce the cost?")
    w("")
    if cal.protect_first:
        w(f"![protect_first]({_rel(figs / 'protect_first.png', out)})")
        w("")
        w(_table(["strength", "window", "protect_first", "mean KLD", "p99 KLD", "same top-1 %",
                  "PPL ratio", "LAMBADA drop", "budget"],
                 [[r["strength"], r["window"], r["protect_first"], _f(r["mean_kld"], ".5f"),
                   _f(r["p99_kld"], ".4f"), _f(r["same_top1_pct"], ".2f"),
                   _f(r["ppl_ratio"], ".4f"), _f(r["lambada_drop_points"], "+.2f"),
                   r.get("status", "yes" if r["within_budget"] else "no")]
                  for r in cal.protect_first]))
        w("")
        w(_protect_first_text(cal.protect_first))
    else:
        w("Not measured.")
    w("")
    # ---- Q3
    w("## Q3: does GSM lower the quality loss of INT8 W8A8?")
    w("")
    w(Q3_MARK)
    int8 = _int8_section(out)  # INT8 runs, if recorded (see _int8_section)
    if int8:
        w(int8)
    elif (claim3 := _evidence_claim(out, model["source"], 3)) is not None:
        w(f"Not measured by this report's own runs; the cross-model evidence measured it "
          f"(claim 3, `{claim3.get('command', 'gsm-jax evidence')}`, "
          f"`reports/gsm_evidence.md`): **{claim3['verdict']}**. {claim3['why']}")
    else:
        w("**Not measured in this report.** W8A8 and FP8 alone vs + GSM vs SmoothQuant vs "
          "Hadamard are claim 3 of `gsm-jax evidence` (`reports/gsm_evidence.md`), not run "
          "for this model yet.")
    w("")
    # ---- Q4
    w("## Q4: step-time overhead and end-to-end speed")
    w("")
    w(f"![overhead]({_rel(figs / 'overhead.png', out)})")
    w("")
    b0 = overhead[0]
    w(f"Jitted `prefill` ({b0['batch']} rows × {b0['prompt']} tokens) and `decode_step` "
      f"(batch {b0['batch']}, {sizes.overhead_steps} steps after that prefill, cache donated); "
      f"{b0['reps']} interleaved repetitions after compilation; median (min–max) ms per call. "
      "\"GSM off\" is the model compiled without GSM (no filter, no ring buffers).")
    w("")
    rows = []
    for r in overhead:
        ref = ov[(names[0], r["step"])]
        rows.append([r["config"], r["step"], f"{r['median_ms']:.1f} ({r['min_ms']:.1f}–"
                     f"{r['max_ms']:.1f})", f"{100 * (r['median_ms'] / ref - 1):+.1f}%"])
    w(_table(["config", "step", "ms per call", "vs off"], rows))
    w("")
    w("W8A8 ± GSM against the full-precision baseline: " + (
        "see the speed table in Q3." if int8 else
        "not measured for this model (its INT8 quality is claim 3 of the evidence)."))
    w("")
    w("### Serving benchmark")
    w("")
    w(BENCH_MARK)
    if bench_text:
        w(f"`gsm_jax.workflow.bench` through the continuous-batching engine, closed loop, "
          f"{sizes.bench_clients} clients, {sizes.bench_requests} requests (a quarter long), "
          "one repeat, GSM on (chosen config) vs off, interleaved:")
        w("")
        w("```")
        w(bench_text)
        w("```")
        if (figs / "bench.png").exists():
            w("")
            w(f"![serving benchmark]({_rel(figs / 'bench.png', out)})")
    else:
        w(f"**Not measured here** ({bench_note}). Run `gsm-jax bench --model {model['source']} "
          "--gsm <chosen gsm.yaml>` and put its table here.")
    w("")
    serve_json = out / "data" / "serve_http" / "serve_http.json"
    if serve_json.exists():
        from gsm_jax.serving.bench_client import on_off_table

        w("Through the real server (`gsm-jax serve` subprocesses, one with GSM compiled out "
          "and one with the chosen config on every request; `gsm-jax bench-serve`'s client, "
          f"closed loop, {sizes.bench_clients} clients, {sizes.bench_requests} requests, "
          "streaming, `ignore_eos`; client-side times from SSE chunks; one warm-up pass "
          "first):")
        w("")
        w(on_off_table(json.loads(serve_json.read_text())))
        w("")
    # ---- honest conclusion
    w("## What GSM does and does not buy (plain words)")
    w("")
    w("- It does **not** make this model faster: on a dense fp32 model every matrix product "
      "costs the same whatever the activations; the filter is extra work (see Q4).")
    w("- It does **not** improve quality: every strength > 0 moves the output distribution "
      "away from the model's own; the budget only bounds how far."
      + (" The document's strength 0.1 on the high-kurtosis layers already breaks the default "
         "budget on this model; what fits is a much weaker filter."
         if dq and budget.violations(dq, None) else ""))
    w("- It **does** need `protect_first ≥ 1` (see Q2). " + _first_token_sentence(prof))
    w("- Whether the small strengths that fit the budget still tame outliers enough to make "
      "INT8 safer is the open question (Q3); that, not fp32 speed, is the only route to a "
      "benefit.")
    w("")
    # ---- reproduce
    w("## Reproduce")
    w("")
    w("```bash")
    w(command)
    w("# the same steps one by one:")
    w(f"gsm-jax profile --model {model['source']} --data ../shared/data/wikitext2_test.txt "
      f"--samples {sizes.profile_samples} --seq-len {sizes.profile_seq_len} --out prof/")
    w(f"gsm-jax calibrate --model {model['source']} --profile prof/profile.json "
      f"--data ../shared/data/wikitext2_test.txt --lambada ../shared/data/lambada_dev.jsonl "
      f"--sequences {sizes.cal_sequences} --lambada-samples {sizes.cal_lambada} --out cal/")
    w(f"gsm-jax eval --model {model['source']} --gsm cal/gsm.yaml "
      f"--data ../shared/data/wikitext2_test.txt --lambada ../shared/data/lambada_dev.jsonl "
      f"--sequences {sizes.final_sequences}")
    w("```")
    w("")
    w("Time per phase (this run):")
    w("")
    w(_table(["phase", "wall s", "CPU s"], [[k, v["wall_s"], v["cpu_s"]]
                                            for k, v in clock.phases.items()]))
    w("")
    w(f"Machine: {mach['platform']}, Python {mach['python']}, {mach['cpu']}, "
      f"{mach['cpu_count']} cores shared with other jobs (so wall times are noisy; the "
      "overhead comparison is interleaved for that reason).")
    w("")
    return "\n".join(lines)


def _first_token_sentence(prof: Profile) -> str:
    """How often the largest |x| of a high-kurtosis pair sits on the sequence's first token."""
    hk = set(prof.high_kurtosis)
    rows = [st for st in prof.stats if (st["layer"], st["site"]) in hk
            and st.get("max_abs_first_token") is not None]
    if not rows:
        return ""
    first = sum(st["max_abs_first_token"] >= st["max_abs_other_tokens"] for st in rows)
    ratio = np.median([st["max_abs_first_token"] / st["max_abs_other_tokens"] for st in rows
                       if st["max_abs_other_tokens"]])
    fact = (f"in {first} of the {len(rows)} high-kurtosis pairs the largest |x| sits on a "
            f"sequence's first token, and the median ratio of first-token to other-token "
            f"max |x| is {ratio:.2f}")
    if first > len(rows) / 2:
        return (f"The profile points the same way: {fact}; a token-axis window smears the "
                "first token into its neighbours, which protect_first prevents.")
    return (f"The profile's max |x| does not single the first token out ({fact}), so the "
            "single largest values do not explain it; what is measured is the cost of "
            "averaging the first token into its neighbours, which protect_first prevents.")


def recommend_protect_first(rows: Sequence[dict], tolerance: float = 0.1) -> int | None:
    """The smallest protect_first whose mean KLD is within ``tolerance`` (relative) of the
    best one at every measured setting (protecting fewer tokens changes the model less)."""
    settings = sorted({(r["strength"], str(r["window"])) for r in rows})
    values = sorted({int(r["protect_first"]) for r in rows})
    for v in values:
        ok = True
        for s, w in settings:
            at = [r for r in rows if (r["strength"], str(r["window"])) == (s, w)]
            best = min(r["mean_kld"] for r in at)
            mine = next((r["mean_kld"] for r in at if r["protect_first"] == v), None)
            if mine is None or mine > best * (1 + tolerance) + 1e-12:
                ok = False
        if ok:
            return v
    return None


def _protect_first_text(rows: Sequence[dict]) -> str:
    rec = recommend_protect_first(rows)
    parts = []
    for s, w in sorted({(r["strength"], str(r["window"])) for r in rows}):
        at = {r["protect_first"]: r["mean_kld"] for r in rows
              if (r["strength"], str(r["window"])) == (s, w)}
        if 1 in at and at[1] > 0:
            ratios = ", ".join(f"protect_first {k}: ×{v / at[1]:.2f}" for k, v in sorted(at.items())
                               if k != 1)
            parts.append(f"at strength {s}, window {w}, mean KLD relative to protect_first 1: "
                         f"{ratios}")
    text = "; ".join(parts) + "." if parts else ""
    if rec is None:
        return text + " No protect_first value is best at every setting."
    return (text + f" **Recommended default: protect_first = {rec}** (the smallest value "
            "within 10% of the lowest mean KLD at every measured setting).")


def check_sizes(sizes: ReportSizes) -> None:
    """Refuse sizes that cannot produce the report's statistics."""
    for f in dataclasses.fields(sizes):
        v = getattr(sizes, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise InvalidInputError(f"report size {f.name}={v}: must be >= 0")
    for name in ("profile_samples", "cal_sequences", "final_sequences", "seq_len",
                 "batch_size", "overhead_batch", "overhead_prompt", "overhead_steps",
                 "overhead_reps"):
        if getattr(sizes, name) < 1:
            raise InvalidInputError(f"report size {name} must be >= 1")
