"""Claim 10: "GSM interferes with speculative decoding", measured.

Greedy draft-and-verify with a self-draft (`gsm_jax.speculative`: the model's first
`draft_layers` layers + its own final norm and LM head draft, the full model
verifies) on WikiText-2 prompts, in four arms: GSM off, on the verifier only, on
the draft only, on both. Per arm: the acceptance rate (per prompt, with its standard
error across prompts), tokens/s, and whether the output equals plain greedy decoding
of the verifier (with the verifier's GSM) - speculative decoding is exact by
construction, so a mismatch is a bug, not a result. The peer is plain greedy decoding
of the full model (`generate_tokens`).

Verdict (one of the evidence runner's VERDICTS): "supported" if some GSM arm's
acceptance rate is below the off arm's by more than `z` (default 2) standard errors
of the per-prompt (paired) differences, "refuted" if every GSM arm is within that,
"not testable here" when the off arm's own acceptance is too low (< `min_acceptance`)
for a drop to show, with fewer than 2 prompts, or when an arm is not exact (then the
rates measure a bug; the numbers are kept to debug it).

Called by `gsm_jax.workflow.evidence.runner` as `run_claim(params, sizes=...,
progress=..., model_dir=...)`; `sizes` may hold this claim's keys (`DEFAULT_SIZES`,
"draft_layers", "gsm"), else the defaults apply (tiny ones with "smoke"), and the
runner's "strength" / "window" set the default GSM config. The chart goes to
`out_dir`, else to sizes["evidence_dir"] when given.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.config import GSMConfig
from gsm_jax.errors import InvalidInputError
from gsm_jax.generation import generate_tokens
from gsm_jax.gsm_runtime import as_gsm_config
from gsm_jax.speculative import speculative_generate, verify_mode

ARMS = {"off": (False, False), "gsm_verifier": (True, False), "gsm_draft": (False, True),
        "gsm_both": (True, True)}
DEFAULT_SIZES = {"prompts": 4, "prompt_len": 64, "new_tokens": 48, "draft_len": 4,
                 "z": 2.0, "min_acceptance": 0.1}
SMOKE_SIZES = {"prompts": 2, "prompt_len": 16, "new_tokens": 8}  # seconds; numbers meaningless
NOT_TESTABLE = "not testable here"


def default_gsm(strength: float = 0.1, window: int = 8) -> GSMConfig:
    return GSMConfig(target_layers="all", smooth_strength=strength, window_size=window)


def _prompts(params: Any, sizes: dict) -> np.ndarray:
    """[N, T] prompt ids: sizes["token_ids"] when given (models without a tokenizer),
    else the first N WikiText-2 sequences of prompt_len tokens."""
    if sizes.get("token_ids") is not None:
        ids = np.asarray(sizes["token_ids"], np.int32)
        if ids.ndim != 2 or ids.shape[0] < 1:
            raise InvalidInputError(f"sizes['token_ids'] must be [N, T], got {ids.shape}")
        return ids[: sizes["prompts"], : sizes["prompt_len"]]
    if params.tokenizer is None:
        raise InvalidInputError("the model has no tokenizer: pass sizes['token_ids'] [N, T]")
    from gsm_jax.workflow.data import load_wikitext_sequences

    return load_wikitext_sequences(params.tokenizer, num_sequences=sizes["prompts"],
                                   seq_len=sizes["prompt_len"])


def _stderr(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[claim 10] {msg}", flush=True)


def _plain_greedy(params: Any, prompts: np.ndarray, new: int, gsm: Any) -> tuple[list, float]:
    """Plain greedy outputs per prompt and tokens/s (after one compiling call)."""
    generate_tokens(params, [prompts[0]], max_new_tokens=new, gsm=gsm)
    outs, wall = [], 0.0
    for row in prompts:
        t = time.perf_counter()
        outs.append(generate_tokens(params, [row], max_new_tokens=new, gsm=gsm)[0])
        wall += time.perf_counter() - t
    return outs, sum(len(o) for o in outs) / wall


def run_claim(params: Any, *, sizes: dict | None = None, progress: bool = False,
              model_dir: str | os.PathLike | None = None,
              out_dir: str | os.PathLike | None = None) -> dict:
    """Measure the four arms; returns a JSON-able dict (see the module docstring).
    `model_dir` (the runner's model report) is not used: nothing there is reusable."""
    cfg = params.config
    given = dict(sizes or {})
    sizes = {**DEFAULT_SIZES, **(SMOKE_SIZES if given.get("smoke") else {}),
             # all but the last layer: an early exit through the model's own final norm and
             # LM head is a weak draft (SmolLM2: acceptance 0.01 at 10 of 30 layers, 0.09
             # at 26, 0.16 at 29), and the claim needs acceptances well above zero to move
             "draft_layers": max(1, cfg.num_layers - 1), **given}
    gsm = as_gsm_config(sizes.get("gsm") or default_gsm(float(sizes.get("strength", 0.1)),
                                                        sizes.get("window", 8)))
    new, k, n_draft = int(sizes["new_tokens"]), int(sizes["draft_layers"]), int(
        sizes["draft_len"])
    prompts = _prompts(params, sizes)
    _say(progress, f"{len(prompts)} prompts x {prompts.shape[1]} tokens, {new} new, "
                   f"draft = first {k} of {cfg.num_layers} layers, draft_len {n_draft}, "
                   f"verify: {verify_mode(cfg.family)}")

    refs, peer = {}, {}
    for on in (False, True):
        refs[on], peer[on] = _plain_greedy(params, prompts, new, gsm if on else None)
        _say(progress, f"plain greedy, GSM {'on' if on else 'off'}: {peer[on]:.1f} tok/s")

    arms: dict[str, dict] = {}
    for name, (on_v, on_d) in ARMS.items():
        kw = dict(max_new_tokens=new, draft_layers=k, draft_len=n_draft,
                  gsm_verifier=gsm if on_v else None, gsm_draft=gsm if on_d else None)
        speculative_generate(params, prompts[0], **kw)  # compile
        rates, exact, n_tok, wall, per_round = [], True, 0, 0.0, []
        for i, row in enumerate(prompts):
            res = speculative_generate(params, row, **kw)
            rates.append(res.acceptance_rate)
            exact &= bool(np.array_equal(res.tokens, refs[on_v][i]))
            n_tok, wall = n_tok + len(res.tokens), wall + res.wall_s
            per_round.append(res.tokens_per_round)
        rates_arr = np.asarray(rates)
        arms[name] = {
            "gsm_verifier": on_v, "gsm_draft": on_d,
            "acceptance_rate": float(rates_arr.mean()),
            "acceptance_se": _stderr(rates_arr),
            "per_prompt_acceptance": [float(r) for r in rates],
            "tokens_per_round": float(np.mean(per_round)),
            "tok_s": n_tok / wall,
            "speedup_vs_peer": n_tok / wall / peer[False],
            "exact": exact,
        }
        _say(progress, f"{name}: acceptance {rates_arr.mean():.3f} +- {_stderr(rates_arr):.3f}, "
                       f"{n_tok / wall:.1f} tok/s, exact={exact}")

    off = np.asarray(arms["off"]["per_prompt_acceptance"])
    for name in list(ARMS)[1:]:
        diff = off - np.asarray(arms[name]["per_prompt_acceptance"])
        arms[name]["drop_vs_off"] = float(diff.mean())
        arms[name]["drop_se"] = _stderr(diff)
    verdict, why = _verdict(arms, len(prompts), float(sizes["z"]),
                            float(sizes["min_acceptance"]))
    numbers = {"peer_tok_s": peer[False], **{
        f"{key}_{name}": arms[name][key] for name in ARMS
        for key in ("acceptance_rate", "acceptance_se", "tok_s", "exact")}}
    result = {
        "claim": 10,
        "statement": "GSM interferes with speculative decoding",
        "model": params.source or type(cfg).__name__,
        "num_layers": cfg.num_layers,
        "draft_layers": k,
        "draft_len": n_draft,
        "prompts": int(len(prompts)),
        "prompt_len": int(prompts.shape[1]),
        "new_tokens": new,
        "verify_mode": verify_mode(cfg.family),
        "gsm": gsm.to_dict(),
        "numbers": numbers,
        "measurement": "acceptance " + " / ".join(
            f"{n} {a['acceptance_rate']:.3f}" for n, a in arms.items()),
        "arms": arms,
        "peer_tok_s": peer[False],
        "peer_gsm_tok_s": peer[True],
        "rule": (f"supported if a GSM arm's mean acceptance is below off by more than "
                 f"{sizes['z']} standard errors of the per-prompt differences; refuted if "
                 f"every GSM arm is within that; not testable here if off's acceptance < "
                 f"{sizes['min_acceptance']}, fewer than 2 prompts or an arm not exact"),
        "verdict": verdict,
        "why": why,
    }
    out_dir = out_dir if out_dir is not None else sizes.get("evidence_dir")
    if out_dir is not None:
        result["figure"] = str(acceptance_chart(result, Path(out_dir) / "claim10_speculative.png"))
    return result


def _verdict(arms: dict, n_prompts: int, z: float, min_acceptance: float) -> tuple[str, str]:
    broken = [n for n, a in arms.items() if not a["exact"]]
    if broken:
        return NOT_TESTABLE, (f"arm(s) {', '.join(broken)} did not reproduce plain greedy "
                           "decoding, so their acceptance rates measure a bug")
    off = arms["off"]["acceptance_rate"]
    if n_prompts < 2:
        return NOT_TESTABLE, "one prompt gives no spread to compare a drop against"
    if off < min_acceptance:
        return NOT_TESTABLE, (f"the early-exit draft agrees with the full model on only "
                                f"{off:.1%} of proposals even without GSM, too few for a drop "
                                "to be measured")
    drops = {n: (a["drop_vs_off"], a["drop_se"]) for n, a in arms.items() if n != "off"}
    worse = {n: d for n, (d, se) in drops.items() if d > 0 and d > z * se}
    if worse:
        n = max(worse, key=worse.get)
        return "supported", (f"with {n} the acceptance rate falls from {off:.3f} to "
                             f"{arms[n]['acceptance_rate']:.3f} (drop {drops[n][0]:.3f} > "
                             f"{z:g} x se {drops[n][1]:.3f})")
    n = max(drops, key=lambda a: drops[a][0])
    return "refuted", (f"every GSM arm's acceptance rate is within {z:g} standard errors of "
                       f"off ({off:.3f}); the largest drop is {drops[n][0]:.3f} ({n}, se "
                       f"{drops[n][1]:.3f})")


def acceptance_chart(result: dict, path: str | os.PathLike) -> Path:
    """Bar chart of the acceptance rate per arm, error bars = standard error across prompts."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    rates = [result["arms"][n]["acceptance_rate"] for n in names]
    errs = [result["arms"][n]["acceptance_se"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar(names, rates, yerr=errs, capsize=5,
                  color=["#888888", "#3b75af", "#ef8636", "#519e3e"][: len(names)])
    for bar, n, err in zip(bars, names, errs, strict=True):  # tok/s above the error bar
        ax.annotate(f"{result['arms'][n]['tok_s']:.1f} tok/s",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height() + err),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                    textcoords="offset points")
    ax.set_ylim(0, max(1.0, max(r + e for r, e in zip(rates, errs, strict=True)) * 1.1))
    ax.set_ylabel("draft acceptance rate")
    ax.set_title(f"Claim 10 ({result['model']}): draft = first {result['draft_layers']} of "
                 f"{result['num_layers']} layers, K={result['draft_len']}\n"
                 f"verdict: {result['verdict']}; plain greedy {result['peer_tok_s']:.1f} tok/s",
                 fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
