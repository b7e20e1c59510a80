"""Step 4 of the GSM workflow: choose strength, window and layers within a quality budget.

One variable at a time (spec §6 step 4):

1. **strength** at window 8: walk up the strength grid (values above
   ``max_strength`` are never tried); the chosen strength is the last one before
   the first that breaks the budget. With ``curves`` the rest of the grid is
   still measured (quality only) to draw the cost curve.
2. **window** at that strength: 4, 8, 12, 16 and "adaptive". Among the windows
   within budget the one that smooths most is kept: the largest effective
   window (the mean of w_p over the evaluated positions; ties: lower mean KLD).
   Smoothing more is what GSM is for; quality is the constraint.
3. **back-off** where the budget broke (the next strength up, or the smallest
   strength if even that fails): each targeted layer is smoothed alone to
   measure its contribution (mean KLD); then layers are removed, largest
   contribution first, until the rest is within budget. The removed layers are
   the culprits. If no strength was within budget with all layers, the backed-off
   configuration is the answer; otherwise it is reported as the alternative.
4. **protect_first** 0 vs 1 (vs 2) at the chosen setting and at the breaking one.

Which checks run where: the KLD and same-top-1 limits are checked on every
trial; LAMBADA accuracy (the task limit) is measured only for trials already
within the KLD/top-1 limits (a trial outside them fails anyway), so a trial
"within budget" passed all three. The chosen configuration is evaluated once
more with every part (quality, LAMBADA, greedy agreement) on the same data;
`gsm_jax.evaluate` with the same sizes reproduces those numbers.

If nothing meets the budget, `BudgetNotMetError` is raised; it carries the
result (``.result``) with the best configuration found (the smallest budget
violation) so nothing falls back silently to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.config import (
    ADAPTIVE,
    ADAPTIVE_DIVISOR,
    ADAPTIVE_MIN_WINDOW,
    SITES,
    GSMConfig,
    resolve_mask,
)
from gsm_jax.errors import GSMConfigError, GSMJaxError, InvalidInputError
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evaluate import DEFAULT, EvalResult, Evaluator, check_params, jsonable
from gsm_jax.workflow.metrics import Budget

DEFAULT_STRENGTHS = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)
DEFAULT_WINDOWS: tuple[int | str, ...] = (4, 8, 12, 16, ADAPTIVE)
DEFAULT_PROTECT_FIRST_VALUES = (0, 1, 2)
START_WINDOW = 8
CONFIG_FILE = "gsm.yaml"
REPORT_FILE = "calibration.json"


class BudgetNotMetError(GSMJaxError):
    """No configuration met the quality budget; ``.result`` holds what was found."""

    def __init__(self, message: str, result: CalibrationResult) -> None:
        super().__init__(message)
        self.result = result


def effective_window(window: int | str, seq_len: int, max_window: int = 64) -> float:
    """Mean window over positions 0..seq_len-1 (adaptive: clamp((p+1)//16, 4, max_window))."""
    if window == ADAPTIVE:
        p = np.arange(seq_len)
        return float(np.clip((p + 1) // ADAPTIVE_DIVISOR, ADAPTIVE_MIN_WINDOW, max_window).mean())
    return float(window)


def machine_info() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend(), "device": str(dev.device_kind)}


@dataclasses.dataclass
class Trial:
    """One evaluated configuration of the search."""

    stage: str  # strength | window | contribution | backoff | protect_first | final
    strength: float
    window: int | str
    protect_first: int
    scope: str  # "targets" (all targeted pairs), "layer N" or "without [..]"
    config: dict
    result: dict | None = None
    violations: list[str] = dataclasses.field(default_factory=list)
    within_budget: bool = False
    lambada_measured: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CalibrationResult:
    """The search, its choice, and the evidence. ``save(dir)`` writes gsm.yaml, JSON, PNGs."""

    model: str
    budget: dict
    sizes: dict
    base_config: dict
    targets: list  # [[layer, site], ...] targeted before back-off
    trials: list[dict]
    baseline: dict
    chosen: dict | None = None  # GSMConfig.to_dict() of the choice
    chosen_reason: str = ""
    final: dict | None = None  # EvalResult dict of the choice, every part
    alternative: dict | None = None  # backed-off config at the breaking strength, if any
    best_found: dict | None = None  # when the budget could not be met
    culprits: list = dataclasses.field(default_factory=list)
    contributions: list = dataclasses.field(default_factory=list)
    protect_first: list = dataclasses.field(default_factory=list)
    skipped_strengths: list = dataclasses.field(default_factory=list)
    search: dict = dataclasses.field(default_factory=dict)
    machine: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    @property
    def config(self) -> GSMConfig | None:
        """The chosen configuration (None if the budget could not be met)."""
        return None if self.chosen is None else GSMConfig.from_dict(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "gsm-jax/calibration/v1", **dataclasses.asdict(self)}

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationResult:
        d = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, out: str | os.PathLike, *, plots: bool = True) -> Path:
        """Write ``gsm.yaml`` (the choice; ``gsm.best_found.yaml`` if the budget was not
        met), ``calibration.json`` and the PNGs into directory ``out``."""
        from gsm_jax.workflow import plots as P

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if self.chosen is not None:
            GSMConfig.from_dict(self.chosen).to_file(out / CONFIG_FILE)
        elif self.best_found is not None:
            GSMConfig.from_dict(self.best_found["config"]).to_file(out / "gsm.best_found.yaml")
        path = out / REPORT_FILE
        path.write_text(json.dumps(jsonable(self.to_dict()), indent=2, allow_nan=False) + "\n")
        if plots:
            P.quality_vs_strength(
                [t for t in self.trials if t["stage"] in ("strength", "window", "curve")],
                out / "quality_vs_strength.png", budget=self.budget,
                title=f"{self.model}: GSM quality cost vs strength "
                      f"({len(self.targets)} targeted (layer, site) pairs)")
            if self.contributions:
                c0 = self.contributions[0]
                P.layer_contributions(
                    self.contributions, out / "layer_contributions.png",
                    culprits=[c["layer"] for c in self.culprits],
                    budget_kld=self.budget["max_mean_kld"],
                    title=f"per-layer contribution at strength {c0['strength']}, window "
                          f"{c0['window']} (red: culprits)")
            if self.protect_first:
                P.protect_first_plot(self.protect_first, out / "protect_first.png")
        return path

    def summary(self) -> str:
        lines = [f"calibration of {self.model}: budget mean KLD <= "
                 f"{self.budget['max_mean_kld']}, same top-1 >= "
                 f"{self.budget['min_same_top1_pct']}%, LAMBADA drop <= "
                 f"{self.budget['max_accuracy_drop_points']} points"]
        for t in self.trials:
            q = (t.get("result") or {}).get("quality") or {}
            la = (t.get("result") or {}).get("lambada")
            lam = (f", LAMBADA drop {la['accuracy_drop_points']:+.2f}" if la else "")
            lines.append(
                f"  {t['stage']:<13} s={t['strength']:<5} w={t['window']!s:<8} "
                f"pf={t['protect_first']} {t['scope']:<16} "
                f"KLD {q.get('mean_kld', float('nan')):.5f}"
                f" top1 {q.get('same_top1_pct', float('nan')):6.2f}%{lam}  "
                + ("ok" if t["within_budget"] else "; ".join(t["violations"])
                   or "KLD/top-1 ok, task not measured"))
        if self.culprits:
            lines.append("  culprits: " + ", ".join(
                f"layer {c['layer']} (alone: KLD {c['mean_kld']:.4f})" for c in self.culprits))
        if self.chosen is not None:
            c = self.chosen
            lines.append(f"chosen: strength {c['smooth_strength']}, window {c['window_size']}, "
                         f"protect_first {c['protect_first']} on "
                         f"{sum(len(v) for v in c['target_layers'].values())} (layer, site) "
                         f"pairs; {self.chosen_reason}")
        else:
            lines.append("budget NOT met; best found: " + json.dumps(
                {k: (self.best_found or {}).get(k) for k in ("strength", "window", "scope",
                                                              "violations")}))
        if self.final:
            lines.append(EvalResult.from_dict(self.final).summary())
        return "\n".join(lines)


def _pairs_to_target(pairs: Sequence[tuple[int, str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for layer, site in sorted(pairs, key=lambda p: (p[0], SITES.index(p[1]))):
        out.setdefault(int(layer), []).append(site)
    return out


@dataclasses.dataclass(frozen=True)
class CalibrationSpec:
    """What `run_calibration` searches, on which data, within which budget.

    ``profile``: profile JSON path or `Profile` (needed when the base config's
    ``target_layers`` is "high_kurtosis", the default). ``base_config``: the other
    GSM settings (precision, sites, max_strength, protect_first, ...).
    ``curve_strengths``: strengths at which the other windows are also measured
    for the quality-vs-strength plot (default: the chosen strength and the next
    grid step). The evaluation sizes (``num_sequences`` ... ``greedy_prompt_len``)
    are those of `Evaluator`; ``max_backoff``: at most this many layers removed.
    """

    profile: Any = None
    base_config: GSMConfig | dict | str | os.PathLike | None = None
    data: Any = None
    lambada: Any = DEFAULT
    budget: Budget | dict | None = None
    strengths: Sequence[float] = DEFAULT_STRENGTHS
    windows: Sequence[int | str] = DEFAULT_WINDOWS
    protect_first_values: Sequence[int] = DEFAULT_PROTECT_FIRST_VALUES
    num_sequences: int = 16
    seq_len: int = 256
    batch_size: int = 8
    lambada_samples: int | None = 200
    greedy_prompts: int = 8
    greedy_tokens: int = 64
    greedy_prompt_len: int = 64
    curves: bool = True
    curve_strengths: Sequence[float] | None = None
    backoff: bool = True
    max_backoff: int | None = None
    progress: bool = True

    def replace(self, **changes: Any) -> CalibrationSpec:
        """A copy with ``changes`` (field names; an unknown name raises TypeError)."""
        return dataclasses.replace(self, **changes)


def calibrate(params: ModelParams, spec: CalibrationSpec | None = None,
              **fields: Any) -> CalibrationResult:
    """Search strength, window and layers within a budget (see the module docstring).

    ``spec``: a `CalibrationSpec`; keyword arguments are its fields (they override
    ``spec``'s, or the defaults without one), so ``calibrate(params, profile=...,
    budget=...)`` keeps working. Returns a `CalibrationResult`; raises
    `BudgetNotMetError` (carrying the result and the best configuration found) if
    nothing fits.
    """
    return run_calibration(params, (spec or CalibrationSpec()).replace(**fields))


def run_calibration(params: ModelParams, spec: CalibrationSpec) -> CalibrationResult:
    """`calibrate` with every setting in ``spec``."""
    profile, base_config, data, lambada = spec.profile, spec.base_config, spec.data, spec.lambada
    budget, strengths, windows = spec.budget, spec.strengths, spec.windows
    protect_first_values, num_sequences = spec.protect_first_values, spec.num_sequences
    seq_len, batch_size, lambada_samples = spec.seq_len, spec.batch_size, spec.lambada_samples
    greedy_prompts, greedy_tokens = spec.greedy_prompts, spec.greedy_tokens
    greedy_prompt_len, curves, curve_strengths = (spec.greedy_prompt_len, spec.curves,
                                                  spec.curve_strengths)
    backoff, max_backoff, progress = spec.backoff, spec.max_backoff, spec.progress
    t_start = time.perf_counter()
    params = check_params(params)
    num_layers = int(params.config.num_layers)
    budget = _as_budget(budget)
    base = _base_config(base_config, profile)
    mask = resolve_mask(base, num_layers)
    targets = [(int(i), SITES[j]) for i, j in zip(*np.nonzero(mask), strict=True)]
    if not targets:
        raise GSMConfigError("the base configuration targets no (layer, site) pair: nothing "
                             "to calibrate")
    grid = sorted({float(s) for s in strengths})
    if not grid or any(s <= 0 for s in grid):
        raise InvalidInputError(f"strengths must be a non-empty list of values > 0, got {grid}")
    skipped = [s for s in grid if s > base.max_strength]
    grid = [s for s in grid if s <= base.max_strength]
    if not grid:
        raise GSMConfigError(f"every strength in {sorted(skipped)} is above max_strength="
                             f"{base.max_strength}; nothing to try")
    wins = list(dict.fromkeys(windows))
    for w in wins:
        base.replace(window_size=w)  # validates (e.g. window > max_window)
    if START_WINDOW not in wins:
        wins.insert(0, START_WINDOW)
    pf_values = sorted({int(v) for v in protect_first_values})

    ev = Evaluator(params, data=data, lambada=lambada, num_sequences=num_sequences,
                   seq_len=seq_len, batch_size=batch_size, lambada_samples=lambada_samples,
                   greedy_prompts=greedy_prompts, greedy_tokens=greedy_tokens,
                   greedy_prompt_len=greedy_prompt_len, progress=progress)
    seq_len_eff = int(ev.sequences.shape[1])
    has_task = ev.lambada_items is not None
    trials: list[Trial] = []

    from tqdm import tqdm

    log = tqdm.write if progress else (lambda *_: None)
    log(f"[calibrate] {len(targets)} targeted (layer, site) pairs; strengths {grid}; windows "
        f"{wins}; budget {budget.to_dict()}")
    baseline = ev.baseline()
    log(baseline.summary())

    def run(stage: str, strength: float, window: int | str, pf: int,
            pairs: Sequence[tuple[int, str]] | None = None, scope: str = "targets",
            task: bool = True) -> Trial:
        cfg = base.replace(smooth_strength=strength, window_size=window, protect_first=pf,
                           target_layers=_pairs_to_target(pairs if pairs is not None
                                                          else targets), profile=None)
        res = ev.evaluate(cfg, parts=("quality",), label=f"{stage} s={strength} w={window}")
        viol = res.violations(budget)
        if not viol and task and has_task:
            res_l = ev.evaluate(cfg, parts=("lambada",), label=f"{stage} s={strength}")
            res.lambada = res_l.lambada
            res.seconds.update(res_l.seconds)
            viol = res.violations(budget)
        tr = Trial(stage=stage, strength=strength, window=window, protect_first=pf, scope=scope,
                   config=cfg.to_dict(), result=res.to_dict(), violations=viol,
                   lambada_measured=res.lambada is not None,
                   within_budget=not viol and (res.lambada is not None or not has_task))
        trials.append(tr)
        q = res.quality
        log(f"[calibrate] {stage:<13} s={strength:<5} w={window!s:<8} pf={pf} {scope:<14} "
            f"KLD {q['mean_kld']:.5f} top1 {q['same_top1_pct']:.2f}%"
            + (f" LAMBADA drop {res.lambada['accuracy_drop_points']:+.2f}" if res.lambada
               else "") + ("  within budget" if tr.within_budget else f"  ({'; '.join(viol)})"
                           if viol else "  within the KLD/top-1 limits (task not measured)"))
        return tr

    pf0 = base.protect_first
    # 1. strength at window 8
    chosen_s: float | None = None
    s_fail: float | None = None
    for s in grid:
        if s_fail is not None and not curves:
            break
        tr = run("strength" if s_fail is None else "curve", s, START_WINDOW, pf0,
                 task=s_fail is None)
        if s_fail is None:
            if tr.within_budget:
                chosen_s = s
            else:
                s_fail = s

    # 2. windows at the chosen strength
    chosen_w: int | str = START_WINDOW
    if chosen_s is not None:
        by_window = {START_WINDOW: next(t for t in trials if t.stage == "strength"
                                        and t.strength == chosen_s)}
        for w in wins:
            if w != START_WINDOW:
                by_window[w] = run("window", chosen_s, w, pf0)
        ok = [w for w, t in by_window.items() if t.within_budget]
        chosen_w = max(ok, key=lambda w: (effective_window(w, seq_len_eff, base.max_window),
                                          -by_window[w].result["quality"]["mean_kld"]))
        if curves:
            extra = list(curve_strengths) if curve_strengths is not None else (
                [s_fail] if s_fail is not None else [])
            for s in sorted({float(x) for x in extra if x <= base.max_strength}):
                for w in wins:
                    if w == START_WINDOW or (s == chosen_s):
                        continue
                    run("curve", s, w, pf0, task=False)

    def find(s: float, w: int | str, pf: int) -> Trial | None:
        return next((t for t in trials if t.stage in ("strength", "window", "curve", "backoff",
                                                       "protect_first")
                     and t.scope == "targets" and t.strength == s and t.window == w
                     and t.protect_first == pf), None)

    # 3. back-off where the budget broke (the first breaking strength, at the chosen window)
    culprits: list[dict] = []
    contrib: list[dict] = []
    alternative: Trial | None = None
    s_break = s_fail
    if s_break is not None and backoff:
        w_b = chosen_w
        full = find(s_break, w_b, pf0)
        if full is None or (not full.violations and not full.within_budget):
            full = run("backoff", s_break, w_b, pf0)  # (re)measure with the task metric
        if not full.within_budget:
            layers = sorted({layer for layer, _ in targets})
            for layer in layers:
                pairs = [p for p in targets if p[0] == layer]
                tr = run("contribution", s_break, w_b, pf0, pairs, scope=f"layer {layer}",
                         task=False)
                contrib.append({"layer": layer, "sites": [s for _, s in pairs],
                                "strength": s_break, "window": w_b,
                                "mean_kld": tr.result["quality"]["mean_kld"],
                                "same_top1_pct": tr.result["quality"]["same_top1_pct"]})
            order = sorted(contrib, key=lambda c: -c["mean_kld"])
            remaining = list(targets)
            limit = len(layers) - 1 if max_backoff is None else min(max_backoff, len(layers) - 1)
            for c in order[:limit]:
                remaining = [p for p in remaining if p[0] != c["layer"]]
                culprits.append(c)
                tr = run("backoff", s_break, w_b, pf0, remaining,
                         scope=f"without {[x['layer'] for x in culprits]}")
                if tr.within_budget:
                    alternative = tr
                    break

    # 4. protect_first at the chosen setting and at the breaking one
    pf_rows: list[dict] = []
    settings = []
    if chosen_s is not None:
        settings.append((chosen_s, chosen_w))
    if s_break is not None:
        settings.append((s_break, chosen_w))
    for s, w in settings:
        for pf in pf_values:
            tr = find(s, w, pf) or run("protect_first", s, w, pf, task=(s == chosen_s))
            q = tr.result["quality"]
            pf_rows.append({"strength": s, "window": w, "protect_first": pf,
                            "mean_kld": q["mean_kld"], "same_top1_pct": q["same_top1_pct"],
                            "p99_kld": q["p99_kld"], "ppl_ratio": q["ppl_ratio"],
                            "lambada_drop_points": (tr.result.get("lambada") or {}).get(
                                "accuracy_drop_points"),
                            "within_budget": tr.within_budget,
                            "status": _status(tr)})

    # choose
    result = CalibrationResult(
        model=params.source, budget=budget.to_dict(), sizes=ev.sizes(),
        base_config=base.to_dict(), targets=[list(p) for p in targets],
        trials=[], baseline=baseline.to_dict(), culprits=culprits, contributions=contrib,
        protect_first=pf_rows, skipped_strengths=skipped,
        search={"strengths": grid, "windows": wins, "protect_first_values": pf_values,
                "start_window": START_WINDOW, "curves": curves,
                "task_metric": "LAMBADA subset, measured only within the KLD/top-1 limits"
                if has_task else "none (no LAMBADA data given)"},
        machine=machine_info(),
    )
    chosen_trial: Trial | None = None
    if chosen_s is not None:
        chosen_trial = next(t for t in trials if t.strength == chosen_s and t.window == chosen_w
                            and t.stage in ("strength", "window") and t.scope == "targets")
        result.chosen_reason = (
            f"largest strength within budget at window {START_WINDOW} "
            f"({'the top of the grid' if s_fail is None else f'{s_fail} broke it'}), then the "
            f"window that smooths most within budget ({chosen_w})")
        if alternative is not None:
            result.alternative = alternative.to_dict()
    elif alternative is not None:
        chosen_trial = alternative
        result.chosen_reason = (
            f"even the smallest strength ({grid[0]}) broke the budget on all targeted layers; "
            f"backing off layers {[c['layer'] for c in culprits]} brought it within budget")
    result.trials = [t.to_dict() for t in trials]
    if chosen_trial is None:
        best = max(trials, key=lambda t: budget.margin(t.result["quality"],
                                                       t.result.get("lambada")))
        result.best_found = best.to_dict()
        result.seconds = time.perf_counter() - t_start
        raise BudgetNotMetError(
            f"no configuration met the budget {budget.to_dict()}; best found: strength "
            f"{best.strength}, window {best.window}, {best.scope} ({'; '.join(best.violations)})"
            ". Loosen the budget, try smaller strengths or fewer layers", result)
    chosen_cfg = GSMConfig.from_dict(chosen_trial.config)
    result.chosen = chosen_cfg.to_dict()
    final = ev.evaluate(chosen_cfg, label="chosen")
    result.final = final.to_dict()
    result.trials.append(Trial(stage="final", strength=chosen_cfg.smooth_strength,
                               window=chosen_cfg.window_size,
                               protect_first=chosen_cfg.protect_first, scope=chosen_trial.scope,
                               config=chosen_cfg.to_dict(), result=final.to_dict(),
                               violations=final.violations(budget),
                               within_budget=not final.violations(budget),
                               lambada_measured=final.lambada is not None).to_dict())
    result.seconds = time.perf_counter() - t_start
    log(final.summary())
    return result


def _status(t: Trial) -> str:
    if t.within_budget:
        return "within budget"
    if t.violations:
        return "; ".join(t.violations)
    return "KLD/top-1 ok, task not measured"


def _as_budget(budget: Any) -> Budget:
    if budget is None:
        return Budget()
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, dict):
        try:
            return Budget(**budget)
        except TypeError as e:
            raise InvalidInputError(f"bad budget {budget!r}: {e}") from e
    raise InvalidInputError(f"budget must be a Budget or a dict, got {type(budget).__name__}")


def _base_config(base_config: Any, profile: Any) -> GSMConfig:
    from gsm_jax.gsm_runtime import as_gsm_config

    cfg = GSMConfig() if base_config is None else as_gsm_config(base_config)
    if profile is not None:
        path = getattr(profile, "path", None) if not isinstance(profile, str | os.PathLike) \
            else profile
        if path is None:
            raise InvalidInputError("the profile must be saved (Profile.save) or given as a path")
        cfg = cfg.replace(profile=os.fspath(path))
    return cfg.replace(window_size=START_WINDOW)
