"""Verdict on the source document's KV-cache claim (issue 25): claim 13.

Claim 13 (5.2: 和 KV Cache 优化配合：平滑能改善缓存访问模式，两者叠加收益大于各自之和):
smoothing and KV-cache optimisation together gain more than the sum of each. The KV-cache
optimisation measured is the low-precision cache (`gsm_jax.with_kv_cache_dtype`: FP8 e4m3
and int8, a scale per token, head and 32 values), the one vLLM and SGLang serve with
(`--kv-cache-dtype`).
Six arms: {float, FP8, int8 cache} x {GSM compiled out, GSM on}. A family with its own
released cache formats (DeepSeek-V4.1: FP8 window KV, FP4 compressed KV and index keys,
`cache_qdq`) has four: {float, released} x {off, on}. On random weights
(`sizes["cost_only"]`, `random_models`) only the speed side is measured and decides.

- Quality: teacher-forced KLD of each arm against (float cache, GSM off) on the claim's
  WikiText-2 windows, per sequence (the rounded cache applied as the cached decode reads
  it). Interaction per format k, paired per sequence:
  ``I_q = KLD(k, on) - KLD(float, on) - KLD(k, off)`` (KLD(float, off) is 0): below 0, the
  combination loses less than the two losses added.
- Speed: decode tokens/s of whole greedy `generate_tokens` calls (`generate_call_rounds`:
  a 1-token and an N-token call per arm, neighbours in each round, arms rotated between
  rounds). Interaction per format, paired per round, on log speed:
  ``I_s = ln v(k, on) - ln v(float, on) - ln v(k, off) + ln v(float, off)``: above 0, the
  combination is faster than the two speed-ups multiplied.

Verdict (`claim13_verdict`): supported when, for some format, one interaction favours the
combination beyond `SE_MULTIPLE` standard errors and the other does not go against it
beyond them; refuted when no format does; not testable when the family has no
low-precision cache format.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.families import family_module
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evidence.lowp_claims import (
    SE_MULTIPLE,
    Arm,
    beyond_se,
    eval_tokens,
    evaluate_arms,
    figures_dir,
    gsm_config,
    load_avg,
    log_line,
    paired_difference,
)

__all__ = ["FORMATS", "RELEASED_FORMATS", "claim13_verdict", "interaction", "run_claim_13"]

FORMATS = ("fp8", "int8")
# a family with its own cache formats (`cache_qdq`: DeepSeek-V4.1) against its float caches
RELEASED_FORMATS = ("released",)
GSM_ARMS = ("off", "on")
# `--smoke`: a few short calls (the runner's smoke sizes shrink the quality set already)
SMOKE_13 = {"speed_batch": 2, "speed_prompt": 16, "speed_new_tokens": 4, "speed_repeats": 2}


def interaction(combined: np.ndarray, gsm_only: np.ndarray, kv_only: np.ndarray,
                base: np.ndarray | float = 0.0) -> dict[str, float]:
    """Paired interaction ``combined - gsm_only - kv_only + base`` (per sequence or per
    round): its mean, standard error and z (`paired_difference` against zero)."""
    d = (np.asarray(combined, np.float64) - np.asarray(gsm_only, np.float64)
         - np.asarray(kv_only, np.float64) + np.asarray(base, np.float64))
    return paired_difference(d, np.zeros_like(d))


def claim13_verdict(per_format: dict[str, dict[str, Any]], *, cost_only: bool = False
                    ) -> tuple[str, dict[str, Any]]:
    """per_format: {format: {"quality": interaction of KLD or None, "speed": interaction of
    log tokens/s or None}}. A format counts for the claim when the speed interaction is
    above 0 beyond SE_MULTIPLE standard errors while the quality one is not above 0 beyond
    them (the combination is faster than both speed-ups together and loses no extra
    quality), or when the quality interaction is below 0 beyond them while the speed one
    is not below 0 beyond them. `cost_only` (random weights: no quality to speak of):
    the speed interaction alone decides. Returns (verdict, {format: why it counts or
    not})."""
    if cost_only:
        tested = {k: v for k, v in per_format.items() if v.get("speed") is not None}
        if not tested:
            return "not testable here", {"reason": "no low-precision KV cache format measured"}
        reasons = {k: {"super_additive_speed": beyond_se(v["speed"]),
                       "super_additive_quality": None} for k, v in tested.items()}
        ok = any(r["super_additive_speed"] for r in reasons.values())
        return ("supported" if ok else "refuted"), reasons
    tested = {k: v for k, v in per_format.items()
              if v.get("quality") is not None and v.get("speed") is not None}
    if not tested:
        return "not testable here", {"reason": "no low-precision KV cache format measured"}
    reasons: dict[str, Any] = {}
    for k, v in tested.items():
        q, s = v["quality"], v["speed"]
        neg_q = {**q, "z": -q["z"], "mean": -q["mean"]}
        neg_s = {**s, "z": -s["z"], "mean": -s["mean"]}
        faster = beyond_se(s) and not beyond_se(q)
        better = beyond_se(neg_q) and not beyond_se(neg_s)
        reasons[k] = {"super_additive_speed": faster, "super_additive_quality": better}
    ok = any(r["super_additive_speed"] or r["super_additive_quality"] for r in reasons.values())
    return ("supported" if ok else "refuted"), reasons


def _measurement(per_format: dict[str, dict[str, Any]], arms: dict[str, dict[str, Any]]) -> str:
    """The table cell: each format's speed interaction with GSM, and where both together
    run against the float cache without GSM (an interaction above 0 can be a smaller loss)."""
    cells = []
    for k, v in per_format.items():
        if v["speed"] is None:
            continue
        both = arms.get(f"{k}/on", {}).get("speed_vs_float_off_median")
        cells.append(f"{k} x GSM speed {math.expm1(v['speed']['mean']) * 100:+.1f}%"
                     + ("" if both is None else f" (both {both:.2f}x)"))
    return ", ".join(cells)


def _net_speed(checks: dict[str, Any], arms: dict[str, dict[str, Any]]) -> str:
    """For each format whose speed interaction counted: whether both together are faster
    than the float cache without GSM at all (a super-additive interaction can be a
    smaller loss: each alone slower, the two together slower by less than the product).
    Paired per round on log tokens/s, beyond `SE_MULTIPLE` standard errors either way.
    Writes `net_speed_vs_float_off` (the median ratio and the paired difference) into
    its check."""
    out = []
    for k, r in checks.items():
        if not isinstance(r, dict) or not r.get("super_additive_speed"):
            continue
        both, base = arms.get(f"{k}/on"), arms.get("float/off")
        if not both or not base or both.get("speed_vs_float_off_median") is None:
            continue
        d = paired_difference(np.log(np.asarray(both["decode_tok_s_per_round"], float)),
                              np.log(np.asarray(base["decode_tok_s_per_round"], float)))
        ratio = both["speed_vs_float_off_median"]
        r["net_speed_vs_float_off"] = {"median_ratio": ratio, "log_difference": d}
        neg = {**d, "mean": -d["mean"], "z": -d["z"]}
        out.append(f" {k} with GSM runs at {ratio:.3f}x of the float cache without GSM "
                   f"(z {d['z']:+.1f}): "
                   + ("a net gain." if beyond_se(d) else
                      "a net loss: the interaction is a smaller loss, not a gain."
                      if beyond_se(neg) else "no net gain beyond the noise."))
    return "".join(out)


def _finite(x: Any) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def cache_bytes_per_token(params: ModelParams, at: int = 4096) -> float:
    """Bytes one more cached token costs in this model's cache (its family's `init_cache`
    at one row, `at` and 2 `at` tokens, GSM rings left out): what the format saves."""
    fam, cfg = family_module(params.config.family), params.config
    dtype = jax.tree.leaves(params.weights)[0].dtype

    def size(n: int) -> int:
        tree = jax.eval_shape(lambda: fam.init_cache(cfg, 1, n, dtype=dtype))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    return (size(2 * at) - size(at)) / at


def _kv_params(params: ModelParams, kind: str) -> tuple[ModelParams | None, str | None]:
    from gsm_jax.generation import with_kv_cache_dtype

    try:
        return with_kv_cache_dtype(params, kind), None
    except (UnsupportedModelError, InvalidInputError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def run_claim_13(params: ModelParams, *, sizes: dict, progress: bool,
                 model_dir: Path | None) -> dict[str, Any]:
    """Claim 13. sizes: "quality_sequences", "seq_len", "batch_size" (the shared quality
    set), "kv_formats" (`FORMATS`; a family with its own released cache formats, V4.1:
    `RELEASED_FORMATS`, against its caches unrounded), "gsm", "speed_batch" (8),
    "speed_prompt" (128), "speed_new_tokens" (32), "speed_repeats" (5), "cost_only"
    (random weights: the speed side only); `--smoke` shrinks the speed calls."""
    from gsm_jax.workflow.overhead import generate_call_rounds

    sizes = dict(sizes or {})
    if sizes.get("smoke"):
        sizes = {**SMOKE_13, **sizes}
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 13)
    cfg = gsm_config(sizes)
    cost_only = bool(sizes.get("cost_only"))
    formats = tuple(sizes.get("kv_formats") or (
        RELEASED_FORMATS if hasattr(params.config, "cache_qdq") else FORMATS))
    kv: dict[str, ModelParams] = {}
    unavailable: dict[str, str] = {}
    for kind in ("float", *formats):
        p, why = _kv_params(params, kind)
        if p is None:
            unavailable[kind] = why
            log(f"{kind} KV cache unavailable: {why}")
        else:
            kv[kind] = p
    gsm_of = {"off": None, "on": cfg}
    arm_names = [(k, g) for k in kv for g in GSM_ARMS]

    # --- quality: every arm against (float, off); none on random weights
    kld: dict[str, np.ndarray] = {}
    nonfinite: dict[str, int] = {}
    source = None
    if not cost_only:
        tokens, source = eval_tokens(params, sizes, n=int(sizes.get("quality_sequences", 8)),
                                     seq_len=int(sizes.get("seq_len", 256)), from_end=True)
        arms = [Arm(name=f"{k}/{g}", params=kv[k], gsm=gsm_of[g]) for k, g in arm_names
                if (k, g) != ("float", "off")]
        log(f"quality: {len(arms)} arms on {source}")
        res = evaluate_arms(kv["float"], arms, tokens,
                            batch_size=int(sizes.get("batch_size", 8)), log=log)
        kld = {"float/off": np.zeros(len(tokens))} | {a.name: res[a.name]["kld"]
                                                       for a in arms if a.unavailable is None}
        for a in arms:
            if a.unavailable is not None:
                unavailable[a.name] = a.unavailable
        nonfinite = {a.name: res[a.name]["nonfinite_logits"] for a in arms
                     if a.unavailable is None}

    # --- speed: whole generate calls, every arm in each round
    batch = int(sizes.get("speed_batch", 8))
    new = int(sizes.get("speed_new_tokens", 32))
    log(f"speed: {len(arm_names)} arms, batch {batch}, prompt {sizes.get('speed_prompt', 128)}"
        f", {new} new tokens x {sizes.get('speed_repeats', 5)} rounds")
    rounds = generate_call_rounds(
        {f"{k}/{g}": (kv[k], gsm_of[g]) for k, g in arm_names}, batch=batch,
        prompt_len=int(sizes.get("speed_prompt", 128)), new_tokens=new,
        repeats=int(sizes.get("speed_repeats", 5)), progress=progress)
    decode_s = {name: np.asarray(r["decode_s"]) for name, r in rounds.items()}
    resolved = all((d > 0).all() for d in decode_s.values())
    if not resolved:  # the N-token call not longer than the 1-token one: nothing to compare
        log("speed: a long call was not slower than its short neighbour; speed not measured")
    tok_s = {name: batch * (new - 1) / np.where(d > 0, d, np.nan) for name, d in decode_s.items()}

    per_format: dict[str, dict[str, Any]] = {}
    for k in formats:
        q = s = None
        if f"{k}/on" in kld and f"{k}/off" in kld and "float/on" in kld:
            q = interaction(kld[f"{k}/on"], kld["float/on"], kld[f"{k}/off"])
        if f"{k}/on" in tok_s and resolved:
            s = interaction(np.log(tok_s[f"{k}/on"]), np.log(tok_s["float/on"]),
                            np.log(tok_s[f"{k}/off"]), np.log(tok_s["float/off"]))
        per_format[k] = {"quality": q, "speed": s}
    verdict, checks = claim13_verdict(per_format, cost_only=cost_only)

    cache_bytes = {k: cache_bytes_per_token(p) for k, p in kv.items()}
    arms_out = {}
    for k, g in arm_names:
        name = f"{k}/{g}"
        v = tok_s[name]
        ratio = v / tok_s["float/off"]
        arms_out[name] = {
            "kv_cache": k, "gsm": g,
            "mean_kld": float(kld[name].mean()) if name in kld else None,
            "kld_stderr": (float(kld[name].std(ddof=1) / math.sqrt(kld[name].size))
                           if name in kld and kld[name].size > 1 else None),
            "per_sequence_kld": ([float(x) for x in kld[name]] if name in kld else None),
            "nonfinite_logits": nonfinite.get(name, 0),
            "decode_tok_s_median": _finite(np.median(v)),
            "decode_tok_s_per_round": [_finite(x) for x in v],
            "speed_vs_float_off_median": _finite(np.median(ratio)),
            "cache_bytes_per_token": cache_bytes[k],
        }
    if verdict == "not testable here":
        if not resolved:
            checks["reason"] = ("decode time not resolved: an N-token call was not slower "
                                "than its 1-token neighbour (more new tokens needed)")
        why = f"Not measured: {checks['reason']} ({'; '.join(unavailable.values())[:300]})."
    else:
        parts = []
        for k, v in per_format.items():
            if v["speed"] is None or (v["quality"] is None and not cost_only):
                continue
            s, q = v["speed"], v["quality"]
            ratio = {a: arms_out[a]["speed_vs_float_off_median"]
                     for a in (f"{k}/off", "float/on", f"{k}/on")}
            parts.append(
                f"{k}: speed interaction {math.expm1(s['mean']) * 100:+.1f}% "
                f"(z {s['z']:+.1f}; {k} alone {ratio[f'{k}/off']:.3f}x, GSM alone "
                f"{ratio['float/on']:.3f}x, both {ratio[f'{k}/on']:.3f}x)"
                + (f", KLD interaction {q['mean']:+.2e} (z {q['z']:+.1f})" if q else ""))
        why = (("Random weights, cost only: the speed side. " if cost_only else "")
               + "Against the float cache with GSM off: " + "; ".join(parts) + ". "
               + ("Super-additive for " + ", ".join(
                   k for k, r in checks.items() if r["super_additive_speed"]
                   or r["super_additive_quality"]) if verdict == "supported" else
                  "No format gains more together than the two gains combined beyond "
                  f"{SE_MULTIPLE:g} standard errors") + "."
               + _net_speed(checks, arms_out)
               + (" The released arm holds its caches packed in the release's formats "
                  f"(FP8 window KV, FP4 compressed KV and index keys: "
                  f"{cache_bytes['released']:.0f} B per cached token against "
                  f"{cache_bytes['float']:.0f} B float), unpacked where each step reads them."
                  if "released" in per_format and "released" in cache_bytes else ""))
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None and verdict != "not testable here":
        figures.append(str(_figure(arms_out, per_format, params.source,
                                   fig_dir / "claim13_kv_cache_x_gsm.png")))
    return {
        "claim": 13, "model": params.source, "verdict": verdict, "why": why,
        "measurement": (None if verdict == "not testable here" else
                        _measurement(per_format, arms_out)),
        "numbers": {
            "gsm": cfg.to_dict(), "quality_tokens": source,
            "speed": {"batch": batch, "prompt": int(sizes.get("speed_prompt", 128)),
                      "new_tokens": new, "rounds": int(sizes.get("speed_repeats", 5)),
                      "what": "whole greedy generate_tokens calls, decode = N-token call "
                              "minus 1-token call, neighbours in each round"},
            "arms": arms_out, "interactions": per_format, "checks": checks,
            "unavailable": unavailable,
            "definitions": "quality interaction: KLD(k,on) - KLD(float,on) - KLD(k,off), "
                           "paired per sequence (< 0: the combination loses less than the "
                           "sum); speed interaction: ln tok/s(k,on) - ln(float,on) - "
                           "ln(k,off) + ln(float,off), paired per round (> 0: faster than "
                           "the product of both speed-ups)",
        },
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _figure(arms: dict[str, dict[str, Any]], per_format: dict[str, dict[str, Any]],
            model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(a["kv_cache"] for a in arms.values()))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.38
    x = np.arange(len(kinds))
    for i, g in enumerate(GSM_ARMS):
        kl = [arms[f"{k}/{g}"]["mean_kld"] or 0.0 for k in kinds]
        err = [arms[f"{k}/{g}"]["kld_stderr"] or 0.0 for k in kinds]
        axes[0].bar(x + (i - 0.5) * width, kl, width, yerr=err, label=f"GSM {g}")
        sp = [arms[f"{k}/{g}"]["speed_vs_float_off_median"] or 0.0 for k in kinds]
        axes[1].bar(x + (i - 0.5) * width, sp, width, label=f"GSM {g}")
    axes[0].set_ylabel("mean KLD vs float cache, GSM off")
    if all(a["mean_kld"] is None for a in arms.values()):
        axes[0].text(0.5, 0.5, "random weights: cost only\n(quality not measured)",
                     ha="center", va="center", transform=axes[0].transAxes)
    axes[1].set_ylabel("decode tok/s vs float cache, GSM off")
    axes[1].axhline(1.0, color="k", lw=0.6)
    for ax in axes:
        ax.set_xticks(x, [f"{k} cache" for k in kinds])
        ax.legend(fontsize=8)
    notes = "; ".join(f"{k}: speed x {math.expm1(v['speed']['mean']) * 100:+.1f}% "
                      f"(z {v['speed']['z']:+.1f})" for k, v in per_format.items()
                      if v["speed"] is not None)
    fig.suptitle(f"Claim 13 on {model}: KV cache format x GSM (interaction {notes})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
