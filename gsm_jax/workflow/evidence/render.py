"""Write ``<out>/gsm_evidence.md`` and its figures from the JSONs `run_evidence` left.

Measures nothing: ``<out>/data/evidence/<model>/claim_<N>.json`` are read as they
are, one table row per claim of `runner.CLAIMS`, one column per model (number and
verdict) and a verdict across models ("supported on both", "refuted on both",
"mixed: ..."). A claim without JSON reads "not measured" (with the reason: its
module is missing, or its last run failed). Figures, one per claim where a
picture reads faster, go to ``<out>/figures/evidence/claim_<N>.png``; a claim's
JSON may also name figures of its own (``figures``: paths relative to ``out``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.workflow.evidence.random_models import COST_ONLY, QUALITY_CLAIMS
from gsm_jax.workflow.evidence.runner import (
    CLAIMS,
    EVIDENCE_MD,
    META_FILE,
    VERDICTS,
    evidence_command,
    find_model_dir,
    load_average,
    model_slug,
    resolve_claim,
)

Results = dict[str, dict[int, dict[str, Any]]]  # model -> claim -> result


def _read(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(out: str | os.PathLike) -> tuple[list[str], Results, Results, dict]:
    """(models, results, errors, meta) from ``<out>/data/evidence``."""
    root = Path(out) / "data" / "evidence"
    meta = _read(root / META_FILE) or {}
    models = [m for m in meta.get("models", []) if (root / model_slug(m)).is_dir()]
    known = {model_slug(m) for m in models}
    if root.is_dir():
        models += sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in known)
    results: Results = {}
    errors: Results = {}
    for m in models:
        d = root / model_slug(m)
        results[m], errors[m] = {}, {}
        for n in CLAIMS:
            r = _read(d / f"claim_{n}.json")
            if isinstance(r, dict) and r.get("verdict") in VERDICTS:
                results[m][n] = r
            e = _read(d / f"claim_{n}.error.json")
            if isinstance(e, dict):
                errors[m][n] = e
    return models, results, errors, meta


def combined_verdict(verdicts: Mapping[str, str | None]) -> str:
    """One verdict across models (None: that model has no result for the claim)."""
    measured = {m: v for m, v in verdicts.items() if v in VERDICTS}
    if not measured:
        return "not measured"
    everyone = "both" if len(verdicts) == 2 else "all"
    values = set(measured.values())
    if len(verdicts) == 1:
        return next(iter(values))
    if len(values) == 1 and len(measured) == len(verdicts):
        v = next(iter(values))
        return f"{v} on {everyone}"
    parts = []
    for v in VERDICTS:
        ms = [m for m, x in measured.items() if x == v]
        if ms:
            parts.append(f"{v} on {', '.join(ms)}")
    missing = [m for m in verdicts if m not in measured]
    if missing:
        parts.append(f"not measured on {', '.join(missing)}")
    if len(values) == 1:
        return "; ".join(parts)
    return "mixed: " + "; ".join(parts)


def _cell_missing(n: int, err: dict | None) -> str:
    if err is not None:
        return f"not measured (error: {str(err.get('error', '?'))[:120]})"
    try:
        fn = resolve_claim(n)
    except Exception as e:  # noqa: BLE001 - a broken module is reported, not raised
        return f"not measured (module fails to import: {type(e).__name__})"
    return fn if isinstance(fn, str) else "not measured yet"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# Claims whose verdict rests on a timing measured by the evidence run itself; the others
# are deterministic quality numbers (or an XLA estimate), which the load cannot change.
TIMED_CLAIMS = frozenset({6, 7, 10, 13, 14})


def _load_note(r: Mapping[str, Any]) -> str:
    la = r.get("load_avg") or {}
    if la.get("comparable", True) or r.get("claim") not in TIMED_CLAIMS:
        return ""
    worst = max((v for v in (la.get("before"), la.get("after")) if v is not None), default=0)
    return f" (⚠ load {worst:.1f}: not comparable)"


def _is_random(r: Mapping[str, Any]) -> bool:
    return r.get("weights_kind") == "random"


def _refused_as_random(r: Mapping[str, Any]) -> bool:
    """A quality claim the runner did not run on random weights (`random_models`)."""
    return _is_random(r) and r.get("claim") in QUALITY_CLAIMS


def model_label(model: str, results: Mapping[int, Mapping[str, Any]]) -> str:
    """A column's name: the model, marked when its weights are random."""
    return (f"{model} ({COST_ONLY})" if any(_is_random(r) for r in results.values())
            else model)


def _headline(r: Mapping[str, Any]) -> str:
    """The table's number: the claim's ``measurement``, else the start of its ``why``."""
    m = r.get("measurement")
    if m:
        return str(m)
    why = str(r.get("why", "")).split(";")[0].split(". ")[0]
    return _short(why, 110) or _numbers_line(r.get("numbers") or {})


# ----------------------------------------------------------------------------- figures


def pyplot():
    from gsm_jax.workflow.plots import pyplot as plt

    return plt()


def save_figure(fig: Any, path: Path) -> Path:
    from gsm_jax.workflow.plots import save_figure as save

    return save(fig, path)


def _bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[float]],
          ylabel: str, log: bool = False) -> None:
    x = np.arange(len(groups))
    k = max(len(series), 1)
    width = 0.8 / k
    for i, (label, vals) in enumerate(series.items()):
        ax.bar(x + (i - (k - 1) / 2) * width, [np.nan if v is None else v for v in vals],
               width, label=label)
    ax.set_xticks(x, groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def _fig_1(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    models = list(res)
    for ax, step in zip(axes, ("decode", "prefill"), strict=True):
        _bars(ax, models, {
            "GSM off": [res[m]["numbers"].get(f"{step}_off_ms") for m in models],
            "GSM on": [res[m]["numbers"].get(f"{step}_on_ms") for m in models]},
            f"{step} step, median ms")
        ax.set_title(f"{step} step time (lower is faster)", fontsize=9)
    return save_figure(fig, path)


def _fig_2(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    models = list(res)
    _bars(ax, models, {
        "GSM off": [res[m]["numbers"]["bytes_per_step_off"] / 1e6 for m in models],
        "GSM on": [res[m]["numbers"]["bytes_per_step_on"] / 1e6 for m in models]},
        "MB accessed per decode step (XLA)")
    ax.set_title("proxy for memory traffic: bytes per decode step", fontsize=9)
    return save_figure(fig, path)


def _fig_4(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    groups = ["high_kurtosis", "random (mean)", "all"]
    for ax, key, label in ((axes[0], "mean_kld", "mean KLD vs unsmoothed (log)"),
                           (axes[1], "kld_per_pair", "mean KLD per smoothed pair (log)")):
        series: dict[str, list[float | None]] = {}
        for m, r in res.items():
            sel = r["numbers"]["selections"]
            rnd = [v[key] for k, v in sel.items() if k.startswith("random")]
            series[m] = [sel.get("high_kurtosis", {}).get(key),
                         float(np.mean(rnd)) if rnd else None, sel.get("all", {}).get(key)]
        _bars(ax, groups, series, label, log=True)
    fig.suptitle("which (layer, site) pairs to smooth: quality cost at strength 0.1, window 8",
                 fontsize=9)
    return save_figure(fig, path)


def _fig_5(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    models = list(res)
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8),
                             constrained_layout=True, squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        rows = res[m]["numbers"]["lengths"]
        lens = [r["seq_len"] for r in rows]
        for w in rows[0]["windows"]:
            ax.plot(lens, [r["windows"][w]["mean_kld"] for r in rows],
                    "-o" if w != "adaptive" else "-s", ms=4, lw=2.2 if w == "adaptive" else 1.2,
                    label=f"window {w}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("mean KLD (log)")
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _fig_8(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    for m, r in res.items():
        c = r["numbers"]["curve"]
        s = [x["strength"] for x in c]
        axes[0].plot(s[1:], [x["mean_kld"] for x in c][1:], "-o", ms=4, label=m)
        axes[1].plot(s, [x["same_top1_pct"] for x in c], "-o", ms=4, label=m)
        acc = [x.get("lambada_accuracy_pct") for x in c]
        if all(a is not None for a in acc):
            axes[2].plot(s, acc, "-o", ms=4, label=m)
    for ax, lab in zip(axes, ("mean KLD (log)", "same top-1 token (%)",
                              "LAMBADA accuracy (%)"), strict=True):
        ax.set_xlabel("smooth_strength (guard lifted to 0.4)")
        ax.set_ylabel(lab)
        ax.axvline(0.3, color="k", ls=":", lw=1)
        ax.grid(alpha=0.3)
        if ax.lines[1:]:  # more than the guard line
            ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    if not axes[2].lines:
        axes[2].text(0.5, 0.5, "LAMBADA not measured\n(no tokenizer)", ha="center",
                     va="center", transform=axes[2].transAxes)
    return save_figure(fig, path)


def _fig_11(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    models = [m for m in res if res[m]["numbers"].get("held_out")]
    if not models:
        raise ValueError("no held-out numbers")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    labels = ["with culprits", "without culprits", "without as many least-contributing layers"]
    groups = ["with", "without culprits", "without others (control)"]
    budget = res[models[0]]["numbers"]["budget"]
    for ax, key, ylabel, limit, log in (
            (axes[0], "mean_kld", "held-out mean KLD (log)", budget["max_mean_kld"], True),
            (axes[1], "same_top1_pct", "held-out same top-1 (%)", budget["min_same_top1_pct"],
             False)):
        _bars(ax, groups, {m: [res[m]["numbers"]["held_out"].get(k, {}).get(key)
                               for k in labels] for m in models}, ylabel, log=log)
        ax.axhline(limit, color="k", ls="--", lw=1)
    vals = [v.get("same_top1_pct") for m in models
            for v in res[m]["numbers"]["held_out"].values()]
    lo = min([v for v in vals if v is not None] + [budget["min_same_top1_pct"]])
    axes[1].set_ylim(max(0.0, lo - 3), 100)
    fig.suptitle("back-off on held-out data (dashed: budget)", fontsize=9)
    return save_figure(fig, path)


def _fig_12(res: Mapping[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    models = list(res)
    _bars(ax, models, {
        "protect_first 0": [res[m]["numbers"]["pf0"]["mean_kld"] for m in models],
        "protect_first >= 1": [res[m]["numbers"]["pf1"]["mean_kld"] for m in models]},
        "mean KLD (log)", log=True)
    ax.set_title("averaging the first token into its neighbours", fontsize=9)
    return save_figure(fig, path)


FIGURES: dict[int, Callable[[Mapping[str, dict], Path], Path]] = {
    1: _fig_1, 2: _fig_2, 4: _fig_4, 5: _fig_5, 8: _fig_8, 11: _fig_11, 12: _fig_12}


def _figures(out: Path, models: Sequence[str], results: Results) -> dict[int, list[str]]:
    figs: dict[int, list[str]] = {}
    for n in CLAIMS:
        have = {m: results[m][n] for m in models if n in results[m]
                and not _refused_as_random(results[m][n])}
        if not have:
            continue
        own = [_relative(f, out) for r in have.values() for f in (r.get("figures") or [])
               if (out / f).exists()]
        figs[n] = list(dict.fromkeys(own))
        if n in FIGURES:
            path = out / "figures" / "evidence" / f"claim_{n}.png"
            try:
                FIGURES[n](have, path)
                figs[n].insert(0, path.relative_to(out).as_posix())
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
                pass  # a result without the numbers a figure needs: the table still stands
    return figs


# ----------------------------------------------------------------------------- the answer

TARGET = "DeepSeek-V4.1-Flash"  # the model the source document's question is about
TARGET_FAMILY = "deepseek_v41"
TARGET_COMMAND = ("gsm-jax evidence --models /models/DeepSeek-V4.1-Flash --mesh 1x8 "
                  "--out reports/deepseek-v4.1-flash")
# claims whose verdicts decide "faster": smoothing itself, what it could enable (lower
# precision), and load (concurrency, tail latency)
SPEED_CLAIMS = {1: "smoothing by itself", 3: "what it could enable: lower precision with "
                "less loss", 9: "quantize first, then smooth (the document's order)",
                6: "under concurrency", 13: "with a low-precision KV cache",
                14: "under continuous batching"}
# what a CPU without the released weights cannot settle, by claim
ONLY_ON_GPU = ("the quality claims on V4.1's own activations (3, 4, 8, 9, 11, 12: its "
               "outliers, FP8 / FP4 weights and mHC streams are not a small dense model's) "
               "and the speed claims on the hardware they are about (1, 2, 6, 13, 14: SM "
               "utilisation, L2 hit rate, batching and KV-cache bandwidth on GPUs)")


def _released_target_size() -> tuple[int, int] | None:
    """(layers, hidden) of the released target, from the shipped config."""
    from gsm_jax.planner import KNOWN_CONFIGS

    try:
        cfg = json.loads(KNOWN_CONFIGS["deepseek-v4.1-flash"].read_text())
    except (OSError, ValueError, KeyError):
        return None
    text = cfg.get("text_config", cfg)
    return int(text["num_hidden_layers"]), int(text["hidden_size"])


def _model_kind(results: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """What one model's results were measured on: family, size, smoke or not."""
    rs = list(results.values())
    fam = next((r.get("family") for r in rs if r.get("family")), None)
    layers = next((r.get("num_layers") for r in rs if r.get("num_layers")), None)
    hidden = next((r.get("hidden_size") for r in rs if r.get("hidden_size")), None)
    smoke = any(r.get("smoke") for r in rs)
    released = fam == TARGET_FAMILY and (layers, hidden) == _released_target_size()
    rand = any(_is_random(r) for r in rs)
    return {"family": fam, "layers": layers, "hidden": hidden, "smoke": smoke,
            "random": rand, "target": fam == TARGET_FAMILY,
            "released_target": released and not smoke and not rand}


def answer_section(models: Sequence[str], results: Results) -> list[str]:
    """The report's first section: "does GSM make DeepSeek-V4.1-Flash faster?", answered
    from the verdicts present (which claims, on which models and weights), what only the
    released weights on GPUs can settle, and the command that settles it there."""
    kinds = {m: _model_kind(results[m]) for m in models}
    # trained weights, beyond smoke sizes: the models the verdicts rest on
    real = [m for m in models if not kinds[m]["smoke"] and not kinds[m]["random"]]
    # the target's architecture with random weights: its cost claims, reported apart
    cost_runs = [m for m in models if kinds[m]["random"] and not kinds[m]["smoke"]
                 and kinds[m]["target"]]
    target_runs = [m for m in models if kinds[m]["target"]]
    released = [m for m in target_runs if kinds[m]["released_target"]]
    lines = [f"## The answer: does GSM make {TARGET} faster?", ""]

    def verdict(n: int, among: Sequence[str]) -> str:
        return combined_verdict({m: (results[m].get(n) or {}).get("verdict") for m in among})

    def detail(n: int, among: Sequence[str]) -> str:
        parts = [f"{m}: {_headline(results[m][n])}" for m in among if n in results[m]]
        return "; ".join(_short(p, 160) for p in parts)

    basis = released or real
    v1, v3 = verdict(1, basis), verdict(3, basis)
    if not basis and cost_runs:
        bottom = ("Not answered yet: only random weights were measured, which speak to cost "
                  "alone (below); the quality side needs trained weights. Run the command "
                  "below.")
    elif not basis:
        bottom = ("Not answered yet: no claim has been measured beyond smoke sizes. Run the "
                  "command below.")
    elif v1.startswith("refuted") and v3.startswith("refuted"):
        bottom = ("No evidence that it does. On every model measured, smoothing by itself "
                  "makes the decode step slower (claim 1: " + v1 + "), and it makes "
                  "low-precision arithmetic lose more, not less (claim 3: " + v3 + "): the "
                  "only route by which it could buy speed is closed there.")
    elif v1.startswith("supported") or v3.startswith("supported"):
        bottom = (f"Possibly: claim 1 (smoothing by itself) is {v1}, claim 3 (lower "
                  f"precision with less loss) is {v3}; read the rows below before relying "
                  "on it.")
    else:
        bottom = f"Not settled: claim 1 is {v1}, claim 3 is {v3}."
    if basis and not released:
        bottom += (f" {TARGET} itself was not measured with its released weights (510 GB: "
                   "eight GPUs of 80 GB or more), so for it this is an inference from the "
                   "models below, not a measurement.")
        v1_arch = verdict(1, cost_runs) if cost_runs else None
        if v1_arch and v1_arch.startswith("refuted"):
            bottom += (" Its own architecture, measured with random weights (cost only), "
                       "agrees on cost: smoothing makes its decode step slower too.")
        elif v1_arch and v1_arch.startswith("supported"):
            bottom += (" Its own architecture, measured with random weights (cost only), "
                       "differs on cost: there smoothing made the decode step faster; see "
                       "claim 1.")
    lines += [f"**{bottom}**", ""]
    if basis:
        desc = []
        for m in basis:
            k = kinds[m]
            size = (f", {k['layers']} layers x {k['hidden']}" if k["layers"] and k["hidden"]
                    else "")
            # results written before the runner recorded the family name only the model
            desc.append(f"`{m}` ({k['family']}{size})" if k["family"] else f"`{m}`")
        measured = sorted({n for m in basis for n in results[m]})
        lines.append(f"- **Measured**: claims {', '.join(map(str, measured))} on "
                     f"{', '.join(desc)}, each against the unsmoothed model on the same "
                     "tokens.")
        for n, what in SPEED_CLAIMS.items():
            lines.append(f"- **Claim {n}, {what}**: {verdict(n, basis)}"
                         + (f" ({_md(detail(n, basis))})" if detail(n, basis) else "") + ".")
    if cost_runs:
        desc = ", ".join(f"`{m}` ({kinds[m]['family']}, {kinds[m]['layers']} layers x "
                         f"{kinds[m]['hidden']})" for m in cost_runs)
        parts = []
        for n in sorted({n for m in cost_runs for n in results[m]} - QUALITY_CLAIMS):
            if detail(n, cost_runs):
                parts.append(f"claim {n} {verdict(n, cost_runs)} ({detail(n, cost_runs)})")
        lines.append(f"- **{TARGET}'s architecture, {COST_ONLY}**: {desc}; "
                     + (_md("; ".join(parts)) if parts else "no cost claim measured yet")
                     + ". Its quality claims are not measured: random weights answer them "
                       "with noise.")
    if target_runs and not released:
        smoke = [m for m in target_runs if kinds[m]["smoke"]]
        lines.append(f"- **{TARGET}'s code path**: the same command ran end to end on "
                     f"{', '.join(f'`{m}`' for m in target_runs)} (a small V4.1 "
                     + ("at smoke sizes: it checks the pipeline, its numbers mean nothing"
                        if smoke else "configuration with random weights: not the released "
                        "ones" if all(kinds[m]["random"] for m in target_runs) else
                        "configuration: not the released weights") + ").")
    lines.append(f"- **What only the released weights on GPUs can settle**: {ONLY_ON_GPU}.")
    lines.append(f"- **The command that settles it there** (the same pipeline, the checkpoint "
                 f"as released, sharded over 8 devices): `{TARGET_COMMAND}`; CI runs it on "
                 "a tiny V4.1 checkpoint "
                 "(`tests/test_deepseek_v41_workflow.py::test_evidence_end_to_end`).")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------- markdown


def render_evidence(out: str | os.PathLike = "reports") -> Path:
    """(Re)write ``<out>/gsm_evidence.md`` and the figures; returns the markdown path."""
    out = Path(out)
    models, results, errors, meta = collect(out)
    figs = _figures(out, models, results)
    machine = next((r["machine"] for m in models for r in results[m].values()
                    if r.get("machine")), None)
    if machine is None:
        from gsm_jax.workflow.calibrate import machine_info

        machine = machine_info()
    smoke = any(r.get("smoke") for m in models for r in results[m].values())
    lines: list[str] = []
    w = lines.append
    w("# GSM: the source document's claims, measured")
    w("")
    w(f"The source document (`seed/000_406f5aba74b0aa2e.txt`) makes {len(CLAIMS)} claims about "
      "smoothing activations at inference time. Each is measured here on "
      + (", ".join(f"`{m}`" for m in models) if models else "no model yet")
      + ", against the unsmoothed model on the same tokens, and given a verdict by a rule "
      "stated with its numbers (`gsm_jax/workflow/evidence/`). *Not testable here* means "
      "the machine cannot measure it (the reason is given), never that it was skipped.")
    w("")
    if smoke:
        w("> **Smoke sizes**: some results below were measured with `--smoke` (tiny data); "
          "their numbers check the pipeline and mean nothing.")
        w("")
    lines.extend(answer_section(models, results))
    w("## The claims")
    w("")
    head = ["#", "claim (document)", *(model_label(m, results[m]) for m in models),
            "across models", "command"]
    random_cols = {m for m in models if any(_is_random(r) for r in results[m].values())}
    w("| " + " | ".join(head) + " |")
    w("|" + "---|" * len(head))
    all_cmd_models = models or ["smollm2-135m"]
    # the mesh the results were measured on (`--mesh`), so the commands shown repeat it
    mesh = next((r["sizes"]["mesh"] for m in models for r in results[m].values()
                 if (r.get("sizes") or {}).get("mesh")), None)
    for n, spec in CLAIMS.items():
        cells = [str(n), _md(f"{spec.statement} ({spec.where})")]
        verdicts: dict[str, str | None] = {}
        for m in models:
            r = results[m].get(n)
            if r is None and m in random_cols and n in QUALITY_CLAIMS:
                cells.append(f"– ({COST_ONLY})")
                verdicts[m] = None
            elif r is None:
                cells.append(_md(_cell_missing(n, errors[m].get(n))))
                verdicts[m] = None
            else:
                cells.append(_md(f"{_headline(r)}: **{r['verdict']}**{_load_note(r)}"))
                verdicts[m] = r["verdict"]
        # a quality claim is neither judged nor rerun on random weights
        judged = {m: v for m, v in verdicts.items()
                  if not (m in random_cols and n in QUALITY_CLAIMS)}
        cells.append(f"**{_md(combined_verdict(judged))}**" if judged else "–")
        cmd_models = [m for m in all_cmd_models
                      if not (m in random_cols and n in QUALITY_CLAIMS)] or all_cmd_models
        cells.append(f"`{evidence_command(cmd_models, out, [n], mesh=mesh)}`")
        w("| " + " | ".join(cells) + " |")
    w("")
    w("## Claim by claim")
    for n, spec in CLAIMS.items():
        w("")
        w(f"### {n}. {spec.statement}")
        w("")
        w(f"*Document {spec.where}.* Measured by `{spec.target}`.")
        w("")
        for m in models:
            r = results[m].get(n)
            if r is None and m in random_cols and n in QUALITY_CLAIMS:
                w(f"- **{m}**: not measured ({COST_ONLY}).")
                continue
            if r is None:
                w(f"- **{m}**: {_cell_missing(n, errors[m].get(n))}.")
                continue
            la = r.get("load_avg") or {}
            extra = [f"{r.get('seconds', '?')} s",
                     f"load {la.get('before')} → {la.get('after')}: {la.get('flag', '?')}"]
            if r.get("smoke"):
                extra.append("smoke sizes")
            w(f"- **{m}: {r['verdict']}.** {r['why']} ({'; '.join(extra)})")
            if r.get("source_command"):
                src = f"`{r['source_file']}`, " if r.get("source_file") else ""
                w(f"  Reused numbers: {src}written by `{r['source_command']}`.")
            if errors[m].get(n):
                w(f"  A later run failed: {errors[m][n].get('error')}.")
            texts = (r.get("numbers") or {}).get("continuations")
            if texts:
                for t in texts:
                    keys = [k for k in t if k.startswith("strength_")]
                    w(f"  - prompt …{_md(_short(t.get('prompt_tail')))}")
                    for k in keys:
                        w(f"    - {k.replace('_', ' ')}: {_md(_short(t[k]))}")
        for f in figs.get(n, []):
            w("")
            w(f"![claim {n}]({f})")
    w("")
    lines.extend(search_size_section(out, models))
    w("## Machine and load")
    w("")
    w(f"{machine.get('cpu')} ({machine.get('cpu_count')} cores), {machine.get('platform')}, "
      f"jax {machine.get('jax')} on {machine.get('backend')}. The machine is shared: every "
      "measurement records the 1-minute load average before and after, and one above 1.5 is "
      "flagged *not comparable* where it matters: for the timings of claims 6, 7 and 10 "
      "(claim 1 reuses the model report's timings, whose own load is in that report); quality "
      "numbers are deterministic.")
    w("")
    rows = [(m, n, r["load_avg"]) for m in models for n, r in results[m].items()
            if r.get("load_avg")]
    flagged = [f"{m} claim {n} ({la['flag']})" for m, n, la in rows
               if not la["comparable"] and n in TIMED_CLAIMS]
    w(f"Load average at rendering: {load_average()}. "
      + (f"Flagged not comparable: {'; '.join(flagged)}." if flagged
         else "No measurement was taken above the limit."))
    w("")
    w("## Commands")
    w("")
    w("Everything above (measure what is missing, then render):")
    w("")
    w("```")
    w(evidence_command(all_cmd_models, out, mesh=mesh) + " --resume")
    w("```")
    w("")
    w("From scratch: the same without `--resume`. Rewrite this file from the JSON only: "
      f"`gsm-jax evidence --out {out} --render-only`. Data: "
      f"`{out}/data/evidence/<model>/claim_<N>.json`.")
    runs = meta.get("runs") or []
    if runs:
        w("")
        w("Runs that produced the data:")
        w("")
        for run in runs:
            w(f"- {run.get('at')}: `{run.get('command')}`")
    w("")
    path = out / EVIDENCE_MD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _q(r: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return None if r is None else (r.get("result") or r).get("quality")


def search_size_section(out: Path, models: Sequence[str]) -> list[str]:
    """How the calibration search was sized, per model, from its report's JSON: the
    search set, the margin it judged with, the chosen config in the search and on the
    full-size set; where the search ran without a margin, which config the 2-s.e. rule
    picks from the same recorded trials and how that config fares at full size."""
    lines = ["## Calibration search size", "",
             "A search on a small quality set overfits its noise: the config it keeps may "
             "fall outside the budget on a larger set. The report's search therefore accepts "
             "a configuration only `margin_se` = 2 of its own standard errors inside the KLD "
             "and same-top-1 limits (`Budget.margin_se`, `ReportSizes.search_margin_se`): for "
             "one limit that is a one-sided ~97.7% bound that the larger set agrees. The size "
             "itself (8 x 256 tokens, 2040 scored) sets the standard error (~0.36 points of "
             "top-1 near 97%), hence how much strength the margin costs.", ""]
    rows = []
    for m in models:
        d = find_model_dir(out, m) / "data"
        cal, final = _read(d / "calibration" / "calibration.json"), _read(d / "final_eval.json")
        if not cal or not final:
            rows.append([m, "no report data", "", "", "", ""])
            continue
        budget = cal.get("budget", {})
        margin = float(budget.get("margin_se", 0.0))
        tokens = (cal.get("sizes") or {}).get("quality_tokens_scored", "?")
        chosen_trial = next((t for t in cal.get("trials", []) if t.get("stage") == "final"),
                            None)
        cq, fq = _q(chosen_trial), _q(final.get("chosen"))
        kld_max = float(budget.get("max_mean_kld", 0.01))
        top_min = float(budget.get("min_same_top1_pct", 97.0))

        def fmt(q):
            if not q:
                return "–"
            return (f"KLD {q['mean_kld']:.4f} ± {q.get('mean_kld_stderr', 0):.4f}, top-1 "
                    f"{q['same_top1_pct']:.2f}% ± {q.get('same_top1_stderr_pct', 0):.2f}")

        def holds(q, kld_max=kld_max, top_min=top_min):
            return bool(q) and q["mean_kld"] <= kld_max and q["same_top1_pct"] >= top_min

        ch = cal.get("chosen") or {}
        rows.append([m, f"{tokens} tokens, margin {margin:g} s.e.",
                     f"s={ch.get('smooth_strength')} w={ch.get('window_size')}", fmt(cq),
                     fmt(fq), "yes" if holds(fq) else "**no**"])
        if margin == 0.0:  # the counterfactual on the same recorded trials
            ok = [t for t in cal.get("trials", []) if t.get("scope") == "targets" and _q(t)
                  and t.get("within_budget") and _q(t)["mean_kld"] + 2 * _q(t).get(
                      "mean_kld_stderr", 0) <= kld_max and _q(t)["same_top1_pct"] - 2 * _q(
                      t).get("same_top1_stderr_pct", 0) >= top_min]
            if ok:
                best = max(ok, key=lambda t: (t["strength"], str(t["window"])))
                weaker = next((v for k, v in final.items() if "one grid step weaker" in k
                               and f"strength {best['strength']}" in k), None)
                rows.append([f"{m} (same trials, 2 s.e.)", f"{tokens} tokens, margin 2 s.e.",
                             f"s={best['strength']} w={best['window']}", fmt(_q(best)),
                             fmt(_q(weaker)), "–" if weaker is None else
                             ("yes" if holds(_q(weaker)) else "**no**")])
    lines += ["| model | search set | chosen | in the search | full-size evaluation | "
              "holds at full size |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows]
    lines.append("")
    return lines


def _relative(f: str, out: Path) -> str:
    """A figure path as the markdown (in ``out``) links it."""
    p = Path(f)
    return Path(os.path.relpath(p, out)).as_posix() if p.is_absolute() else p.as_posix()


def _short(text: Any, n: int = 220) -> str:
    s = " ".join(str(text).split()) if not isinstance(text, list) else str(text)
    return s if len(s) <= n else s[: n - 1] + "…"


def _numbers_line(numbers: Mapping[str, Any], k: int = 3) -> str:
    items = [(key, v) for key, v in numbers.items()
             if isinstance(v, int | float) and not isinstance(v, bool)]
    return ", ".join(f"{key} {v:.4g}" if isinstance(v, float) and math.isfinite(v)
                     else f"{key} {v}" for key, v in items[:k]) or "see below"
