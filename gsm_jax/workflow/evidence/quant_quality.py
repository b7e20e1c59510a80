"""Quality of INT8 variants against the fp32 model: GSM_SPEC.md section 7, question 3.

"Does GSM lower the quality loss of INT8 W8A8 ('quantize, then smooth'), compared
with W8A8 alone and with channel-axis SmoothQuant?" Every variant is compared with
the *fp32* model on the same tokens (the workflow's evaluator compares a GSM config
with the same params without GSM; here the reference is another model):

- `ReferenceKLD`: the fp32 log-probabilities of a token set, kept on the device;
  `(params, gsm)` -> mean KLD / same-top-1 against them (for the searches);
- `search_smoothquant_alphas`: SmoothQuant's alpha per linear kind (qkv, o,
  gate_up, down) by coordinate descent on a calibration set;
- `calibrate_gsm_vs_reference`: the GSM config that minimises the quantized model's
  KLD against fp32 on the calibration set: screen every (layer, site) pair alone,
  combine the helpful ones greedily, then sweep strength and window (when no single
  pair survives, the screen-helpful pairs together and all pairs are tried at every
  strength of the grid first). When nothing helps, the answer is "smooth nothing"
  (`None`), and the table says so;
- `quality_table`: the table (mean KLD, same-top-1, perplexity, LAMBADA accuracy)
  for the variants, on evaluation sets disjoint from the calibration set.

Metrics are `gsm_jax.workflow.metrics` (KLD direction KL(fp32 || variant), llama.cpp's).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.gsm.schema import GSMConfig
from gsm_jax.gsm_runtime import gsm_inputs_for_batch
from gsm_jax.models.gsm_sites import SITES
from gsm_jax.params import ModelParams
from gsm_jax.quant import (
    SMOOTHQUANT_LINEARS,
    apply_smoothquant,
    quantize,
    smoothquant_scales,
    stacked_weights,
)
from gsm_jax.workflow import metrics

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
STRENGTH_GRID = (0.02, 0.05, 0.1, 0.2, 0.3)
WINDOW_GRID = (4, 8, 16)


@functools.partial(jax.jit, static_argnames=("config",))
def _logprobs(weights, tokens, gsm, *, config):
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits = family_module(config.family).forward(weights, config, tokens, lengths, gsm)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@functools.partial(jax.jit, static_argnames=("config",))
def _stats(weights, tokens, gsm, base_lp, *, config):
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits = family_module(config.family).forward(weights, config, tokens, lengths, gsm)
    return metrics.token_stats(base_lp, logits, jnp.roll(tokens, -1, axis=1))


def _gsm_inputs(cfg: GSMConfig | None, num_layers: int, batch: int, seq_len: int):
    return None if cfg is None else gsm_inputs_for_batch(cfg, num_layers, batch,
                                                         [seq_len] * batch)


class ReferenceKLD:
    """fp32 reference log-probs of `tokens` [N, T] (kept), compared with any variant."""

    def __init__(self, ref: ModelParams, tokens: np.ndarray, batch_size: int = 4) -> None:
        self.ref = ref
        self.tokens = np.asarray(tokens, np.int32)
        self.batch_size = batch_size
        self.batches = [self.tokens[i: i + batch_size]
                        for i in range(0, len(self.tokens), batch_size)]
        self.base = [_logprobs(ref.weights, jnp.asarray(b), None, config=ref.config)
                     for b in self.batches]
        self.evaluations = 0

    def stats(self, params: ModelParams, gsm: GSMConfig | None = None) -> dict[str, np.ndarray]:
        acc: dict[str, list[np.ndarray]] = {}
        for rows, lp in zip(self.batches, self.base, strict=True):
            g = _gsm_inputs(gsm, params.config.num_layers, rows.shape[0], rows.shape[1])
            st = _stats(params.weights, jnp.asarray(rows), g, lp, config=params.config)
            for k, v in st.items():
                acc.setdefault(k, []).append(np.asarray(v)[:, :-1])
        self.evaluations += 1
        return {k: np.concatenate(v) for k, v in acc.items()}

    def __call__(self, params: ModelParams, gsm: GSMConfig | None = None) -> float:
        """Mean KLD(fp32 || variant) over every token with a next token."""
        return float(np.mean(self.stats(params, gsm)["kld"]))


# ----------------------------------------------------------------------------- SmoothQuant


def search_smoothquant_alphas(ref: ModelParams, act_absmax: dict, kld: ReferenceKLD, *,
                              start: float = 0.5, grid: Sequence[float] = ALPHA_GRID,
                              hadamard_down: int = 0, log: Callable[[str], None] = print
                              ) -> tuple[dict[str, float], list[dict]]:
    """Coordinate descent of alpha per linear kind (down first: it carries the outliers),
    minimising the W8A8 model's KLD against fp32 on the calibration tokens."""
    def build(alphas):
        scales = {}
        for name in SMOOTHQUANT_LINEARS:
            s = smoothquant_scales(ref, act_absmax, alphas[name])
            scales[name] = s[name]
            if name == "o":
                scales["v"] = s["v"]
        return quantize(apply_smoothquant(ref, scales), "w8a8", hadamard_down=hadamard_down)

    alphas = {name: start for name in SMOOTHQUANT_LINEARS}
    best = kld(build(alphas))
    trials = [{"alphas": dict(alphas), "kld": best}]
    log(f"  SmoothQuant alpha {start} everywhere: calibration KLD {best:.5f}")
    for name in ("down", "qkv", "gate_up", "o"):
        for a in grid:
            if a == alphas[name]:
                continue
            trial = {**alphas, name: a}
            k = kld(build(trial))
            trials.append({"alphas": dict(trial), "kld": k})
            if k < best:
                best, alphas = k, trial
        log(f"  alpha[{name}] = {alphas[name]} (calibration KLD {best:.5f})")
    return alphas, trials


@jax.jit
def _w8a8_relative_error(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """Per layer: ||Q(x / s) Q(s w) - x w||^2 / ||x w||^2 for x [L, N, in], w [L, in, out],
    s [L, in], with per-token int8 activations and per-output-channel int8 weights
    (the W8A8 arithmetic of `linear`, in float: int8 products are exact in f32)."""
    from gsm_jax.pallas_kernels.quant_reference import (
        dequantize_rows,
        dequantize_weight,
        quantize_rows,
        quantize_weight,
    )

    x_q = dequantize_rows(*quantize_rows(x / s[:, None, :]))
    w_q = dequantize_weight(*quantize_weight(w * s[:, :, None]))
    ref = jnp.einsum("lni,lio->lno", x, w)
    err = jnp.einsum("lni,lio->lno", x_q, w_q) - ref
    return jnp.sum(err * err, axis=(1, 2)) / jnp.maximum(jnp.sum(ref * ref, axis=(1, 2)), 1e-30)


def local_smoothquant_alphas(ref: ModelParams, act_absmax: dict, samples: dict, *,
                             grid: Sequence[float] = ALPHA_GRID,
                             log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """SmoothQuant's alpha per layer *and* linear kind, each minimising that linear's
    own W8A8 output error on calibration inputs (`gsm_jax.quant.activation_samples`).

    The kinds are independent: a scale folded into the previous weights' output
    columns (v for o, up for down) is invisible to their per-output-channel int8
    scales. Returns ({kind: alphas [L]}, {kind: relative errors [L, len(grid)]}).
    """
    w = stacked_weights(ref)[0]["layers"]
    for k in SMOOTHQUANT_LINEARS:
        want = (ref.config.num_layers, w[k].shape[-2])
        got = np.shape(samples.get(k)) if k in samples else None
        if got is None or len(got) != 3 or (got[0], got[2]) != want:
            raise InvalidInputError(
                f"activation samples for {k!r} must be [layers, tokens, in] with layers, in = "
                f"{want} (gsm_jax.quant.activation_samples), got {got}")
    errors = {k: np.zeros((ref.config.num_layers, len(grid))) for k in SMOOTHQUANT_LINEARS}
    for j, a in enumerate(grid):
        scales = smoothquant_scales(ref, act_absmax, a)
        for k in SMOOTHQUANT_LINEARS:
            errors[k][:, j] = np.asarray(_w8a8_relative_error(
                jnp.asarray(samples[k]), jnp.asarray(w[k], jnp.float32),
                jnp.asarray(scales[k])))
    alphas = {k: np.asarray(grid)[np.argmin(e, axis=1)] for k, e in errors.items()}
    for k in SMOOTHQUANT_LINEARS:
        best = errors[k].min(axis=1)
        worst = int(np.argmax(best))
        log(f"  local alpha[{k}]: {np.round(alphas[k], 2).tolist()} (largest output error "
            f"{best[worst]:.2e} at layer {worst})")
    return alphas, errors


def smoothquant_params(ref: ModelParams, act_absmax: dict, alphas: dict[str, Any]
                       ) -> ModelParams:
    """Float params migrated with one alpha per linear kind (a float, or one per layer)."""
    scales = {}
    for name in SMOOTHQUANT_LINEARS:
        s = smoothquant_scales(ref, act_absmax, alphas[name])
        scales[name] = s[name]
        if name == "o":
            scales["v"] = s["v"]
    out = apply_smoothquant(ref, scales)
    # a string: ModelParams.extra must stay hashable after a JSON round trip (gsm_jax.save)
    text = ",".join(f"{k}={np.round(np.asarray(alphas[k], float), 2).tolist()}"
                    for k in SMOOTHQUANT_LINEARS)
    return dataclasses.replace(out, extra={**dict(ref.extra), "smoothquant_alphas": text})


# ----------------------------------------------------------------------------- GSM


def _config(pairs: Sequence[tuple[int, str]], base: GSMConfig, **kw) -> GSMConfig:
    target: dict[int, list[str]] = {}
    for layer, site in pairs:
        target.setdefault(int(layer), []).append(site)
    return GSMConfig(**{**base.to_dict(), "target_layers": target, **kw})


def calibrate_gsm_vs_reference(params: ModelParams, kld: ReferenceKLD, *,
                               base: GSMConfig | None = None, screen_strength: float = 0.1,
                               strengths: Sequence[float] = STRENGTH_GRID,
                               windows: Sequence[int] = WINDOW_GRID, max_candidates: int = 12,
                               screen_kld: ReferenceKLD | None = None,
                               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The GSM config minimising `params`' KLD against the reference (see module doc).

    `screen_kld` (a smaller token set) is used for the per-pair screening, `kld` for
    every decision after it. Returns {"config": GSMConfig | None, "kld": ..., "log": [...]}.
    """
    base = base or GSMConfig(window_size=8, smooth_strength=screen_strength)
    screen = screen_kld or kld
    t0 = time.perf_counter()
    n_layers = params.config.num_layers
    none_screen = screen(params)
    none = kld(params)
    history: list[dict] = [{"step": "no GSM", "kld": none},
                           {"step": "no GSM (screening set)", "kld": none_screen}]
    log(f"  GSM calibration: without GSM KLD {none:.5f} (screen set {none_screen:.5f})")
    scored = []
    for layer in range(n_layers):
        for site in SITES:
            cfg = _config([(layer, site)], base, smooth_strength=screen_strength)
            k = screen(params, cfg)
            scored.append((k - none_screen, layer, site))
            history.append({"step": "screen", "layer": layer, "site": site,
                            "strength": screen_strength, "kld": k})
    scored.sort()
    helpful = [(layer, site) for d, layer, site in scored if d < 0][:max_candidates]
    log(f"  screened {len(scored)} (layer, site) pairs at strength {screen_strength}: "
        f"{sum(d < 0 for d, *_ in scored)} lower the KLD; best single "
        f"{scored[0][1]}/{scored[0][2]} by {-scored[0][0]:.5f}")
    chosen: list[tuple[int, str]] = []
    best = none
    for pair in helpful:
        k = kld(params, _config([*chosen, pair], base, smooth_strength=screen_strength))
        history.append({"step": "combine", "pairs": [*chosen, pair], "kld": k})
        if k < best:
            best, chosen = k, [*chosen, pair]
    strength, window = screen_strength, int(base.window_size)
    if not chosen:
        # No single pair survived at the screening strength: before concluding, try the
        # screen-helpful pairs together, and every pair, at each (weaker) strength.
        groups = [("screen-helpful pairs", helpful)] if helpful else []
        groups.append(("all pairs", [(layer, site) for _, layer, site in scored]))
        for label, pairs in groups:
            for s in sorted(strengths):
                k = kld(params, _config(pairs, base, smooth_strength=s))
                history.append({"step": f"fallback {label}", "strength": s, "kld": k})
                if k < best:
                    best, chosen, strength = k, list(pairs), s
    if not chosen:
        log("  no (layer, site) pair lowers the KLD: the calibrated config smooths nothing")
        return {"config": None, "kld": none, "kld_without_gsm": none,
                "kld_without_gsm_screen": none_screen, "history": history,
                "seconds": time.perf_counter() - t0}

    def sweep(step: str, key: str, values: Sequence[Any], current: Any, **fixed) -> Any:
        """Try config `key` at each value (the others fixed); keep the best; history
        records each trial as {"step": step, step: value, "kld": ...}."""
        nonlocal best
        for v in values:
            if v == current:
                continue
            k = kld(params, _config(chosen, base, **fixed, **{key: v}))
            history.append({"step": step, step: v, "kld": k})
            if k < best:
                best, current = k, v
        return current

    strength = sweep("strength", "smooth_strength", strengths, strength, window_size=window)
    window = sweep("window", "window_size", windows, window, smooth_strength=strength)
    cfg = _config(chosen, base, smooth_strength=strength, window_size=window)
    log(f"  calibrated GSM: {len(chosen)} pairs, strength {strength}, window {window}: "
        f"KLD {best:.5f} (without GSM {none:.5f})")
    return {"config": cfg, "kld": best, "kld_without_gsm": none,
            "kld_without_gsm_screen": none_screen, "history": history,
            "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- table


@dataclasses.dataclass
class Variant:
    name: str
    params: ModelParams
    gsm: GSMConfig | None = None
    note: str = ""


def lambada_accuracy(params: ModelParams, gsm_list: Sequence[GSMConfig | None], *,
                     path: Any = None, samples: int | None = None,
                     batch_size: int = 8) -> list[float]:
    """LAMBADA last-word accuracy (%) of `params` under each GSM config of `gsm_list`
    (None = without GSM), scored by the workflow's evaluator (its rule, its data)."""
    from gsm_jax.workflow.evaluate import DEFAULT, Evaluator

    ev = Evaluator(params, data=np.zeros((1, 3), np.int32), lambada=path or DEFAULT,
                   num_sequences=1, seq_len=3, batch_size=batch_size, lambada_samples=samples,
                   greedy_prompts=0, progress=False)
    out = []
    for cfg in gsm_list:
        if cfg is None:
            out.append(ev.baseline().lambada["accuracy_pct"])
        else:
            out.append(ev.evaluate(cfg, parts=("lambada",)).lambada["accuracy_pct"])
    return out


def quality_table(ref: ModelParams, variants: Sequence[Variant], tokens: np.ndarray, *,
                  batch_size: int = 4, lambada: Any = None, lambada_samples: int | None = 500,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Per variant: quality against `ref` on `tokens` [N, T] (mean KLD and its standard
    error, p99 KLD, same-top-1 %, perplexity and its ratio to fp32) and LAMBADA accuracy
    (None skips it). Streams batch by batch: the fp32 log-probs of a batch are computed
    once and compared with every variant."""
    tokens = np.asarray(tokens, np.int32)
    acc: dict[str, dict[str, list[np.ndarray]]] = {v.name: {} for v in variants}
    t0 = time.perf_counter()
    for i in range(0, len(tokens), batch_size):
        rows = jnp.asarray(tokens[i: i + batch_size])
        base_lp = _logprobs(ref.weights, rows, None, config=ref.config)
        for v in variants:
            g = _gsm_inputs(v.gsm, v.params.config.num_layers, rows.shape[0], rows.shape[1])
            st = _stats(v.params.weights, rows, g, base_lp, config=v.params.config)
            for k, a in st.items():
                acc[v.name].setdefault(k, []).append(np.asarray(a)[:, :-1])
        log(f"  quality: {min(i + batch_size, len(tokens))}/{len(tokens)} sequences "
            f"({time.perf_counter() - t0:.0f} s)")
    rows_out = []
    for v in variants:
        q = metrics.summarize_quality({k: np.concatenate(a) for k, a in acc[v.name].items()})
        rows_out.append({"variant": v.name, "note": v.note, "quality": q,
                         "gsm": None if v.gsm is None else v.gsm.to_dict(),
                         "lambada_accuracy_pct": None})
    if lambada is not False and lambada_samples != 0:
        by_params: dict[int, list[int]] = {}
        for j, v in enumerate(variants):
            by_params.setdefault(id(v.params), []).append(j)
        for idx in by_params.values():
            t1 = time.perf_counter()
            accs = lambada_accuracy(variants[idx[0]].params, [variants[j].gsm for j in idx],
                                    path=lambada, samples=lambada_samples)
            for j, a in zip(idx, accs, strict=True):
                rows_out[j]["lambada_accuracy_pct"] = a
            log(f"  LAMBADA {', '.join(variants[j].name for j in idx)}: "
                f"{', '.join(f'{a:.1f}%' for a in accs)} ({time.perf_counter() - t1:.0f} s)")
    return rows_out


# ----------------------------------------------------------------------------- report


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def report_section(quality: dict | None, speed: dict | None, *,
                   figures: dict[str, str] | None = None) -> str:
    """Markdown for the evidence report's section 7, question 3, from the JSON written by
    `benchmarks/quant_quality.py` (``quality``) and `benchmarks/bench_quant.py`
    (``speed``); either may be None (its part then says it was not run). ``figures``:
    {"quality": path, "speed": path} of their PNGs, relative to the report."""
    figures = figures or {}
    out = []
    if quality is None:
        out.append("_Quality table not run (`python benchmarks/quant_quality.py`)._\n")
    else:
        cfg = quality.get("config", {})
        rows = []
        for r in quality["table"]:
            q = r["quality"]
            rows.append(f"| {r['variant']} | {_fmt(q['mean_kld'], 5)} ± "
                        f"{_fmt(q['mean_kld_stderr'], 5)} | {_fmt(q['same_top1_pct'])} | "
                        f"{_fmt(q['ppl'], 3)} ({_fmt(q['ppl_ratio'], 4)}×) | "
                        f"{_fmt(r.get('lambada_accuracy_pct'), 1)} | {r.get('note', '')} |")
        data = quality.get("data", {})
        out.append(
            f"Quality against fp32 on the same tokens ({data.get('evaluation', '')}; "
            f"LAMBADA: {data.get('lambada', '')}). KLD is KL(fp32 ‖ variant), mean ± standard "
            "error over tokens; calibration data (SmoothQuant statistics and alphas, GSM) "
            f"is disjoint: {data.get('calibration', '')}.\n")
        if figures.get("quality"):
            out.append(f"![INT8 quality]({figures['quality']})\n")
        out.append("| variant | mean KLD vs fp32 | same top-1 % | perplexity (× fp32) | "
                   "LAMBADA acc % | configuration |\n|---|---|---|---|---|---|\n"
                   + "\n".join(rows) + "\n")
        by = {r["variant"]: r["quality"]["mean_kld"] for r in quality["table"]}
        w8a8 = by.get("w8a8")
        gsm = next((v for k, v in by.items() if k.startswith("w8a8+GSM")), None)
        sq = by.get("w8a8+SmoothQuant")
        sq_gsm = next((v for k, v in by.items() if k.startswith("w8a8+SmoothQuant+GSM")), None)
        best_name = min((k for k in by if k.startswith("w8a8")), key=lambda k: by[k],
                        default=None)
        lines = []
        if w8a8 is not None and gsm is not None:
            lines.append(f"GSM (calibrated against fp32) takes W8A8 from {w8a8:.5f} to "
                         f"{gsm:.5f} mean KLD ({(gsm / w8a8 - 1) * 100:+.1f}%).")
        if w8a8 is not None and sq is not None:
            lines.append(f"SmoothQuant takes it to {sq:.5f} ({(sq / w8a8 - 1) * 100:+.1f}%).")
        sq_run = quality.get("smoothquant", {})
        if sq is not None and "calibration_kld" in sq_run:
            ck = sq_run["calibration_kld"]
            lines.append(f"(SmoothQuant's alpha: one per linear kind by coordinate descent on "
                         f"the model's calibration KLD → {ck['per kind']:.5f}; one per layer "
                         f"and kind from each linear's own W8A8 output error → "
                         f"{ck['per layer']:.5f}; the table uses {sq_run['choice']}.)")
        if sq is not None and sq_gsm is not None:
            lines.append(f"GSM on top of SmoothQuant: {sq_gsm:.5f} "
                         f"({(sq_gsm / sq - 1) * 100:+.1f}% against SmoothQuant alone).")
        if best_name is not None:
            verdict = "meets" if by[best_name] <= 0.01 else "misses"
            lines.append(f"Best W8A8 variant: {best_name} ({by[best_name]:.5f}), which "
                         f"{verdict} the 0.01 mean-KLD target.")
        for name, run in quality.get("gsm_calibration", {}).items():
            hist = run.get("history", [])
            screened = [h for h in hist if h.get("step") == "screen"]
            combined = [h for h in hist if h.get("step") == "combine"]
            curve = [h for h in hist if h.get("step") == "fallback all pairs"]
            if curve:
                lines.append(f"On {name}, GSM at every (layer, site) moves the calibration "
                             f"KLD from {run['kld_without_gsm']:.4f} to "
                             + ", ".join(f"{h['kld']:.4f} (strength {h['strength']})"
                                         for h in curve) + ".")
            text = f"GSM calibration on {name}: {len(screened)} (layer, site) pairs screened "
            if "kld_without_gsm_screen" in run:
                helped = [h for h in screened if h["kld"] < run["kld_without_gsm_screen"]]
                text += (f"alone at strength {screened[0]['strength'] if screened else '?'}, "
                         f"{len(helped)} lowered the KLD on the screening set")
            else:
                text += "alone"
            if combined:
                worse = sum(h["kld"] >= run["kld_without_gsm"] for h in combined)
                text += (f"; of the {len(combined)} best, {worse} raised the KLD on the "
                         "larger calibration set when tried")
            text += ("; nothing survived, so the calibrated config smooths nothing."
                     if run.get("config") is None else
                     f"; calibration KLD {run['kld_without_gsm']:.5f} -> {run['kld']:.5f}.")
            lines.append(text)
        out.append(" ".join(lines) + "\n")
        if cfg:
            opts = {"eval_sequences": 32, "lambada_samples": None, "screen_sequences": 4,
                    "local_sequences": 4}
            flags = " ".join(f"--{k.replace('_', '-')} {cfg[k]}" for k, default in opts.items()
                             if k in cfg and (default is None or cfg[k] != default))
            out.append(f"_Command: `python benchmarks/quant_quality.py {flags}`._\n")
    if speed is None:
        out.append("_Speed table not run (`python benchmarks/bench_quant.py`)._\n")
        return "\n".join(out)
    res = speed["results"]
    names = speed["config"]["variants"]
    header = "| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    body = []
    for case, entry in res.items():
        cells = []
        for n in names:
            e = entry.get(n, {})
            cells.append(f"{_fmt(e.get('tokens_per_s'), 1)} "
                         f"({_fmt(e.get('ratio_vs_fp32_median'))}×, min "
                         f"{_fmt(e.get('ratio_vs_fp32_min'))}×)")
        body.append(f"| {case} | " + " | ".join(cells) + " |")
    loads = speed.get("load_average", {})
    m = speed.get("machine_before", {})
    out.append(f"Speed in one run, variants interleaved (tokens/s at the median step; in "
               f"brackets the ratio to fp32 from medians and from minimums). "
               f"{m.get('cpu_count')} CPUs ({m.get('cpu_model')}), load average at the start "
               f"{loads.get('start')}"
               + (": otherwise idle; the minimums are the least disturbed samples.\n"
                  if loads.get("start") and loads["start"][0] < 1.5 else
                  ": the machine was shared, so medians carry noise and the minimums are the "
                  "least disturbed samples.\n"))
    out.append(header + "\n" + "\n".join(body) + "\n")
    if figures.get("speed"):
        out.append(f"![INT8 speed]({figures['speed']})\n")
    sc = speed["config"]
    out.append(f"_Command: `python benchmarks/bench_quant.py --repeats {sc.get('repeats')} "
               f"--prefill-repeats {sc.get('prefill_repeats')} --profile` (decode with "
               f"{sc.get('context')} tokens cached; prefill of {sc.get('prefill_len')} "
               "tokens)._\n")
    explain = speed["config"].get("explain", {})
    out.append("\n".join(f"- **{k}**: {v}" for k, v in explain.items()) + "\n")
    prof = {case: {n: e.get("profile_ms") for n, e in entry.items() if e.get("profile_ms")}
            for case, entry in res.items()}
    if any(prof.values()):
        cats = sorted({c for e in prof.values() for v in e.values() for c in v})
        rows = [f"| {case} | {n} | " + " | ".join(_fmt(v.get(c), 1) for c in cats) + " |"
                for case, e in prof.items() for n, v in e.items()]
        out.append("Where the time goes (ms per call summed over threads, one traced pass; "
                   "approximate):\n\n| case | variant | " + " | ".join(cats) + " |\n|---|---|"
                   + "---|" * len(cats) + "\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


def summary_line(quality: dict | None, speed: dict | None) -> str:
    """One data-driven sentence for the report's summary (see `report_section`)."""
    parts = []
    if quality is not None:
        by = {r["variant"]: r["quality"]["mean_kld"] for r in quality["table"]}
        runs = quality.get("gsm_calibration", {})
        w8a8 = by.get("w8a8")
        gsm = next((v for k, v in by.items() if k.startswith("w8a8+GSM")), None)
        if runs and all(r.get("config") is None for r in runs.values()):
            parts.append("GSM does **not** lower the W8A8 quality loss here: calibrated "
                         "against fp32 (every layer and site, strengths up to the guard), "
                         "the best config smooths nothing")
        elif w8a8 is not None and gsm is not None:
            parts.append(f"calibrated GSM changes W8A8's mean KLD vs fp32 from {w8a8:.4f} "
                         f"to {gsm:.4f}")
        best = min((k for k in by if k.startswith("w8a8")), key=lambda k: by[k],
                   default=None)
        if w8a8 is not None and best is not None:
            parts.append(f"W8A8 alone is at mean KLD {w8a8:.4f} vs fp32; the channel-axis "
                         f"baselines do the work (best W8A8: {best}, {by[best]:.4f}"
                         + (", within the 0.01 target)" if by[best] <= 0.01 else ")"))
    if speed is not None:
        res = speed["results"]
        cells = []
        for case, entry in res.items():
            if not case.startswith("decode"):
                continue
            r = ", ".join(f"{n} {entry[n]['ratio_vs_fp32_median']:.2f}×" for n in entry
                          if n != "fp32" and entry[n].get("ratio_vs_fp32_median"))
            cells.append(f"{case}: {r}")
        if cells:
            parts.append("speed comes from INT8 itself, not from smoothing (vs fp32, "
                         "medians): " + "; ".join(cells))
    return ("; ".join(parts) + ".") if parts else "not measured."
