"""Claims 1, 2, 4, 5, 8, 11 and 12 of the source document, measured (see `runner.CLAIMS`).

Every claim is ``run_claim_<N>(params, *, sizes, progress, model_dir) -> dict`` and
decides its verdict with a pure ``judge_<N>`` function of the numbers (unit-tested
with synthetic numbers). Quality is always measured against the unsmoothed model
on the same tokens with `Evaluator` (mean KLD, same-top-1, perplexity; LAMBADA
last-word accuracy and greedy agreement where asked).

Data (`token_sequences`): WikiText-2 from the packaged data (``gsm_jax/data``), cut like the
workflow does: the quality set from the *end* of the file (the report's
calibration set), the profile from its *start*, and claim 11's held-out set
from the *middle*, so the three never overlap. A model without a tokenizer
(the tiny test model) gets seeded random tokens and no LAMBADA.

Reuse: claims 1, 4, 11 and 12 first look in ``model_dir/data`` (the model's own
report: ``overhead.json``, ``profile.json``, ``calibration/calibration.json``,
``final_eval.json``) and measure only what is missing there.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.config import DEFAULT_PROTECT_FIRST, SITES, GSMConfig, resolve_mask
from gsm_jax.errors import InvalidInputError
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evidence.runner import EvidenceSizes

WHERE_SEEDS = {"end": 0, "middle": 1, "start": 2}
# tokens at the end of WikiText-2 used by evaluation sets (report: 32 x 256): the
# held-out set of claim 11 must end before them
END_RESERVED_TOKENS = 32 * 256
START_RESERVED_TOKENS = 512 * 128  # ... and start after the report's profile (512 x 128)
NOISE_SIGMAS = 2.0  # "beyond noise": more than this many standard errors apart

_EVALUATORS: dict[tuple, Any] = {}
_PROFILES: dict[tuple, tuple[str, str]] = {}


def clear_cache() -> None:
    """Forget the shared evaluators (and their base-model results) and profiles."""
    _EVALUATORS.clear()
    _PROFILES.clear()


# ----------------------------------------------------------------------------- helpers


def _size(sizes: Mapping[str, Any], key: str) -> Any:
    if key in sizes:
        return sizes[key]
    return getattr(EvidenceSizes(), key)


def _say(progress: bool, msg: str) -> None:
    if progress:
        from tqdm import tqdm

        tqdm.write(f"[gsm-jax evidence]   {msg}")


def _result(n: int, params: ModelParams, numbers: dict, verdict: str, why: str, *,
            measurement: str, command: str | None = None, **extra: Any) -> dict[str, Any]:
    """A claim's result. ``command``: the command that measured reused numbers (the
    runner adds the evidence command that regenerates the claim itself)."""
    out = {"claim": n, "model": params.source, "numbers": numbers, "verdict": verdict,
           "why": why, "measurement": measurement, **extra}
    if command:
        out["source_command"] = command
    return out


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(v: float | None, spec: str = ".4g") -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) \
        else format(v, spec)


def token_sequences(params: ModelParams, n: int, seq_len: int, *,
                    where: str = "end") -> tuple[np.ndarray, str]:
    """[n, seq_len] int32 token ids and a description of where they come from."""
    if where not in WHERE_SEEDS:
        raise InvalidInputError(f"where must be one of {list(WHERE_SEEDS)}, got {where!r}")
    tok = params.tokenizer
    cfg = params.config
    if tok is None:
        rng = np.random.default_rng(WHERE_SEEDS[where])
        arr = rng.integers(0, cfg.vocab_size, (n, seq_len)).astype(np.int32)
        return arr, f"synthetic random tokens, seed {WHERE_SEEDS[where]} (the model has no " \
                    "tokenizer)"
    from gsm_jax.workflow import data as data_mod

    stream = data_mod.wikitext_tokens(tok)
    bos = tok.bos_id if getattr(tok, "add_bos", False) else None
    path = data_mod.default_wikitext_path()
    if where == "start":
        return (data_mod.split_sequences(stream, seq_len, n, bos_id=bos, source=str(path)),
                f"WikiText-2 test ({path.name}), the first {n} chunks of {seq_len} tokens")
    if where == "end":
        return (data_mod.split_sequences(stream, seq_len, n, from_end=True, bos_id=bos,
                                         source=str(path)),
                f"WikiText-2 test ({path.name}), the last {n} chunks of {seq_len} tokens")
    start = stream.size // 2
    if start < START_RESERVED_TOKENS or start + n * seq_len > stream.size - END_RESERVED_TOKENS:
        raise InvalidInputError(
            f"{path} is too short for {n} held-out sequences of {seq_len} tokens from its "
            "middle (they would overlap the profile at its start or the evaluation sets at "
            "its end)")
    return (data_mod.split_sequences(stream[start:], seq_len, n, bos_id=bos, source=str(path)),
            f"WikiText-2 test ({path.name}), {n} chunks of {seq_len} tokens from token "
            f"{start} on (the middle: disjoint from the profile at the start and the "
            "evaluation sets at the end)")


def _evaluator(params: ModelParams, sizes: Mapping[str, Any], progress: bool, *,
               n: int | None = None, seq_len: int | None = None, where: str = "end",
               batch_size: int | None = None, task: bool = True):
    """A shared `Evaluator` (its base-model results are computed once for all claims)."""
    from gsm_jax.workflow.evaluate import DEFAULT, Evaluator

    n = n or _size(sizes, "quality_sequences")
    seq_len = seq_len or _size(sizes, "seq_len")
    b = batch_size or min(_size(sizes, "batch_size"), n)
    lam = _size(sizes, "lambada") if task and params.tokenizer is not None else 0
    gp = _size(sizes, "greedy_prompts") if task else 0
    key = (id(params), n, seq_len, where, b, lam, gp, _size(sizes, "greedy_prompt_len"),
           _size(sizes, "greedy_tokens"))
    if key not in _EVALUATORS:
        tokens, source = token_sequences(params, n, seq_len, where=where)
        ev = Evaluator(params, data=tokens, lambada=DEFAULT if lam else None,
                       num_sequences=n, seq_len=seq_len, batch_size=b,
                       lambada_samples=lam or None, greedy_prompts=gp,
                       greedy_prompt_len=_size(sizes, "greedy_prompt_len"),
                       greedy_tokens=_size(sizes, "greedy_tokens"), progress=progress)
        ev.evidence_source = source
        _EVALUATORS[key] = ev
    return _EVALUATORS[key]


def _data_sizes(ev: Any) -> dict[str, Any]:
    return {**ev.sizes(), "data": getattr(ev, "evidence_source", ev.sizes()["data"])}


def _quality(res: Any) -> dict[str, Any]:
    q = res.quality
    return {k: q[k] for k in ("mean_kld", "mean_kld_stderr", "p99_kld", "same_top1_pct",
                              "same_top1_stderr_pct", "ppl", "ppl_base", "ppl_ratio",
                              "n_tokens")}


def _pairs_to_target(pairs: Sequence[tuple[int, str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for layer, site in sorted(pairs, key=lambda p: (p[0], SITES.index(p[1]))):
        out.setdefault(int(layer), []).append(site)
    return out


def _mask_pairs(mask: np.ndarray) -> list[tuple[int, str]]:
    return [(int(i), SITES[j]) for i, j in zip(*np.nonzero(mask), strict=True)]


def profile_path(params: ModelParams, sizes: Mapping[str, Any], progress: bool,
                 model_dir: Path) -> tuple[str, str]:
    """A profile for ``target_layers="high_kurtosis"``: the model report's, else one made
    here (``profile_samples`` sequences from the start of WikiText-2), kept for reuse."""
    from gsm_jax.config import load_profile

    n_layers = int(params.config.num_layers)
    key = (id(params), str(model_dir))
    if key in _PROFILES:
        return _PROFILES[key]
    report = Path(model_dir) / "data" / "profile.json"
    if report.exists():
        prof = load_profile(report)
        if prof["num_layers"] == n_layers:
            _PROFILES[key] = (str(report), f"the model report's profile ({report}, "
                              f"{prof.get('calibration_samples', '?')} sequences)")
            return _PROFILES[key]
    own = Path(sizes.get("evidence_dir") or ".") / "profile" / "profile.json"
    if not own.exists() or load_profile(own)["num_layers"] != n_layers:
        from gsm_jax.workflow.profile import profile

        n, t = _size(sizes, "profile_samples"), _size(sizes, "profile_seq_len")
        _say(progress, f"profiling {n} x {t} tokens (no profile in {report.parent})")
        tokens, _ = token_sequences(params, n, t, where="start")
        prof = profile(params, data=tokens, calibration_samples=n, seq_len=t,
                       batch_size=min(_size(sizes, "batch_size"), n), progress=progress)
        prof.save(own.parent, heatmap=False)
    _PROFILES[key] = (str(own), f"a profile made for this evidence ({own})")
    return _PROFILES[key]


# ----------------------------------------------------------------------------- claim 1


def judge_1(off_ms: float, on_ms: float, noise_ms: float) -> tuple[str, str]:
    """Throughput up iff the GSM-on decode step is faster than off by more than the noise."""
    delta = on_ms - off_ms
    pct = 100 * delta / off_ms if off_ms else float("nan")
    if delta < -noise_ms:
        return "supported", (f"the decode step is {off_ms:.2f} ms with GSM off and {on_ms:.2f} "
                             f"ms on ({pct:+.1f}%), faster by more than the noise floor "
                             f"({noise_ms:.2f} ms)")
    return "refuted", (f"the decode step is {off_ms:.2f} ms with GSM off and {on_ms:.2f} ms "
                       f"on ({pct:+.1f}%): not faster beyond the noise floor ({noise_ms:.2f} "
                       "ms); the filter only adds work")


def _noise(rows: Sequence[Mapping[str, Any]]) -> float:
    """Half the spread of repeated timings (the larger of the two configs')."""
    spread = [(r["max_ms"] - r["min_ms"]) / 2 for r in rows if r.get("reps", 1) > 1]
    return max(spread) if spread else 0.01 * max(r["median_ms"] for r in rows)


def run_claim_1(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "data" / "overhead.json"
    rows = _read_json(path)
    source = f"the model report's {path}"
    command = None
    if not rows:
        from gsm_jax.workflow.overhead import measure_overhead

        _say(progress, "no overhead data in the model report: measuring step times")
        rows = measure_overhead(
            params, {"GSM off (compiled out)": None,
                     "GSM on: all pairs, s=0.1": GSMConfig(target_layers="all")},
            batch=_size(sizes, "overhead_batch"), prompt=_size(sizes, "overhead_prompt"),
            steps=_size(sizes, "overhead_steps"), reps=_size(sizes, "overhead_reps"),
            progress=progress)
        source = "measured here (gsm_jax.workflow.report.measure_overhead)"
    else:
        command = f"gsm-jax report --model {params.source} --out {Path(model_dir)}"
    by = {(r["config"], r["step"]): r for r in rows}
    off_name = next(c for c, _ in by if c.startswith("GSM off"))
    on_names = [c for c, _ in dict.fromkeys(by) if not c.startswith("GSM off")]
    on_name = next((c for c in on_names if "chosen" in c), on_names[0])
    off, on = by[(off_name, "decode")], by[(on_name, "decode")]
    noise = _noise([off, on])
    verdict, why = judge_1(off["median_ms"], on["median_ms"], noise)
    pre_off, pre_on = by.get((off_name, "prefill")), by.get((on_name, "prefill"))
    numbers = {
        "source": source, "rows": rows, "compared": [off_name, on_name],
        "decode_off_ms": off["median_ms"], "decode_on_ms": on["median_ms"],
        "decode_ratio": on["median_ms"] / off["median_ms"], "noise_ms": noise,
        "prefill_off_ms": pre_off and pre_off["median_ms"],
        "prefill_on_ms": pre_on and pre_on["median_ms"],
        "batch": off.get("batch"), "prompt": off.get("prompt"),
        "utilisation": "not measurable here: CPU backend, no GPU SM counters; step time is "
                       "what utilisation would buy",
        "reused_measurement_load": None if command is None else
        "not recorded (measured by the model report's run; this run's load average refers "
        "to reading the file)",
    }
    if pre_off and pre_on:
        why += (f"; prefill {pre_off['median_ms']:.4g} vs {pre_on['median_ms']:.4g} ms "
                f"({100 * (pre_on['median_ms'] / pre_off['median_ms'] - 1):+.1f}%)")
    return _result(1, params, numbers, verdict, why + f" ({on_name}; {source}).",
                   measurement=f"decode step {on['median_ms'] / off['median_ms']:.3f}x of "
                               "GSM off", command=command,
                   source_file=str(path) if command else None)


# ----------------------------------------------------------------------------- claim 2


def perf_counters() -> dict[str, Any]:
    """Whether hardware cache counters can be read on this machine, and what was found."""
    paranoid_path = Path("/proc/sys/kernel/perf_event_paranoid")
    try:
        paranoid: Any = int(paranoid_path.read_text().strip())
    except (OSError, ValueError):
        paranoid = None
    pmus = sorted(p.name for p in Path("/sys/bus/event_source/devices").glob("*")) \
        if Path("/sys/bus/event_source/devices").is_dir() else []
    perf = shutil.which("perf")
    found: dict[str, Any] = {"perf": perf, "perf_event_paranoid": paranoid,
                             "pmus": pmus, "cpu_pmu": "cpu" in pmus}
    if perf:
        try:
            r = subprocess.run([perf, "stat", "-x,", "-e", "cache-references,cache-misses",
                                "--", "true"], capture_output=True, text=True, timeout=20)
            lines = [ln for ln in r.stderr.splitlines() if "cache" in ln]
            found["perf_stat"] = lines or r.stderr.strip().splitlines()[-3:]
            found["counters_readable"] = bool(lines) and not any(
                "<not supported>" in ln or "<not counted>" in ln for ln in lines)
        except (OSError, subprocess.SubprocessError) as e:
            found["perf_stat"] = f"{type(e).__name__}: {e}"
            found["counters_readable"] = False
    else:
        found["counters_readable"] = False
    return found


def decode_cost(params: ModelParams, gsm: GSMConfig | None, *, batch: int,
                cache_len: int) -> dict[str, float]:
    """XLA's cost analysis of the compiled decode step (cache donated, as in generation)."""
    import jax
    import jax.numpy as jnp

    from gsm_jax.families import family_module
    from gsm_jax.gsm_runtime import gsm_inputs_for_batch

    cfg = params.config
    fam = family_module(cfg.family)
    dtype = jax.tree.leaves(params.weights)[0].dtype
    gi = None if gsm is None else gsm_inputs_for_batch(gsm, cfg.num_layers, batch,
                                                       [cache_len] * batch, fit_ring=True)
    cache = fam.init_cache(cfg, batch, cache_len, dtype=dtype,
                           gsm_max_window=None if gi is None else gi.max_window)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(weights, tok, cache, g):
        return fam.decode_step(weights, cfg, tok, cache, g)

    tok = jnp.zeros((batch,), jnp.int32)
    cache_bytes = float(sum(x.nbytes for x in jax.tree.leaves(cache)))
    ca = step.lower(params.weights, tok, cache, gi).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    return {"bytes_accessed": float(ca.get("bytes accessed", float("nan"))),
            "flops": float(ca.get("flops", float("nan"))), "cache_bytes": cache_bytes,
            "weight_bytes": float(sum(x.nbytes for x in jax.tree.leaves(params.weights)))}


def run_claim_2(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                model_dir: Path) -> dict[str, Any]:
    hw = perf_counters()
    b, c = _size(sizes, "decode_batch"), _size(sizes, "decode_cache")
    c = min(c, int(params.config.max_position_embeddings))
    _say(progress, f"compiling the decode step (batch {b}, cache {c}) with GSM off and on")
    off = decode_cost(params, None, batch=b, cache_len=c)
    on = decode_cost(params, GSMConfig(target_layers="all"), batch=b, cache_len=c)
    ratio = on["bytes_accessed"] / off["bytes_accessed"]
    rings = on["cache_bytes"] - off["cache_bytes"]
    numbers = {"hardware_counters": hw, "decode_batch": b, "cache_len": c,
               "bytes_per_step_off": off["bytes_accessed"],
               "bytes_per_step_on": on["bytes_accessed"], "bytes_ratio": ratio,
               "flops_off": off["flops"], "flops_on": on["flops"],
               "gsm_state_bytes": rings, "kv_cache_bytes": off["cache_bytes"],
               "weight_bytes": off["weight_bytes"],
               "proxy": "XLA cost_analysis()['bytes accessed'] of the compiled decode step, a "
                        "static estimate that counts every operand and result of every "
                        "operation (an in-place update of the stacked ring buffers counts as a "
                        "full copy, so it overstates what GSM adds); GSM on = compiled in for "
                        "all (layer, site) pairs (the program is the same for every GSM config: "
                        "strengths are runtime inputs). gsm_state_bytes: the ring buffers GSM "
                        "adds to the cache"}
    found = ("perf is not installed" if not hw["perf"] else
             f"perf stat reports the cache events as unsupported (perf_event_paranoid="
             f"{hw['perf_event_paranoid']}, no 'cpu' PMU among {hw['pmus']})"
             if not hw["counters_readable"] else "hardware counters are readable")
    mb = 1e6
    why = (f"cache hit rates need hardware counters and this VM has none ({found}), and the "
           f"claim is about a GPU's L2; proxy: XLA estimates {on['bytes_accessed'] / mb:.0f} MB "
           f"accessed per decode step with GSM vs {off['bytes_accessed'] / mb:.0f} MB without "
           f"({ratio:.2f}x, an upper bound) and GSM's ring buffers add "
           f"{rings / mb:.1f} MB to the state a step touches (weights "
           f"{off['weight_bytes'] / mb:.0f} MB, KV cache {off['cache_bytes'] / mb:.1f} MB): "
           "smoothing adds traffic; it does not make the weight and KV reads that dominate a "
           "step any more regular.")
    return _result(2, params, numbers, "not testable here", why,
                   measurement=f"bytes/decode step {ratio:.2f}x (XLA estimate), rings "
                               f"+{rings / mb:.1f} MB")


# ----------------------------------------------------------------------------- claim 4


def judge_4(hk_kld: float, random_klds: Sequence[float], n_pairs: int) -> tuple[str, str]:
    """Supported iff high-kurtosis selection costs less (mean KLD, hence per pair: same
    number of pairs) than random selections of the same size, on average."""
    rnd = float(np.mean(random_klds))
    spread = f"{min(random_klds):.4g}-{max(random_klds):.4g}"
    per_hk, per_rnd = hk_kld / n_pairs, rnd / n_pairs
    if hk_kld < rnd:
        return "supported", (f"smoothing the {n_pairs} high-kurtosis pairs costs mean KLD "
                             f"{hk_kld:.4g} ({per_hk:.3g} per pair), less than {n_pairs} random "
                             f"pairs ({rnd:.4g} on average, {spread} over "
                             f"{len(random_klds)} seeds; {per_rnd:.3g} per pair)")
    return "refuted", (f"smoothing the {n_pairs} high-kurtosis pairs costs mean KLD "
                       f"{hk_kld:.4g} ({per_hk:.3g} per pair), not less than {n_pairs} random "
                       f"pairs ({rnd:.4g} on average, {spread} over {len(random_klds)} seeds; "
                       f"{per_rnd:.3g} per pair)")


def _kurtosis_share(stats: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[int, str]]
                    ) -> dict[str, float]:
    k = {(s["layer"], s["site"]): s for s in stats}
    chosen = [k[p] for p in pairs if p in k]
    total = sum(max(s.get("excess_kurtosis") or 0.0, 0.0) for s in stats)
    mine = sum(max(s.get("excess_kurtosis") or 0.0, 0.0) for s in chosen)
    mx = [s["max_abs"] for s in chosen if s.get("max_abs") is not None]
    return {"kurtosis_share": mine / total if total > 0 else float("nan"),
            "mean_max_abs": float(np.mean(mx)) if mx else float("nan")}


def run_claim_4(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                model_dir: Path) -> dict[str, Any]:
    from gsm_jax.config import high_kurtosis_pairs, load_profile

    n_layers = int(params.config.num_layers)
    prof_path, prof_src = profile_path(params, sizes, progress, model_dir)
    stats = load_profile(prof_path)["stats"]
    s, w = _size(sizes, "strength"), _size(sizes, "window")
    hk = high_kurtosis_pairs(GSMConfig(profile=prof_path), n_layers)
    every = _mask_pairs(resolve_mask(GSMConfig(target_layers="all"), n_layers))
    ev = _evaluator(params, sizes, progress)
    rows: dict[str, dict[str, Any]] = {}

    def measure(label: str, pairs: Sequence[tuple[int, str]]) -> None:
        _say(progress, f"claim 4: {label} ({len(pairs)} pairs)")
        cfg = GSMConfig(target_layers=_pairs_to_target(pairs), smooth_strength=s, window_size=w)
        q = _quality(ev.evaluate(cfg, parts=("quality",), label=label))
        rows[label] = {"pairs": [list(p) for p in pairs], "n_pairs": len(pairs), **q,
                       "kld_per_pair": q["mean_kld"] / len(pairs),
                       **_kurtosis_share(stats, pairs)}

    measure("high_kurtosis", hk)
    seeds = _size(sizes, "random_seeds")
    if len(hk) >= len(every):
        verdict, why = "not testable here", (
            f"the high-kurtosis selection is every one of the {len(every)} pairs, so there "
            "is no random selection of the same size to compare with")
    else:
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            pick = sorted(rng.choice(len(every), size=len(hk), replace=False).tolist())
            measure(f"random, seed {seed}", [every[i] for i in pick])
        verdict, why = judge_4(rows["high_kurtosis"]["mean_kld"],
                               [rows[f"random, seed {i}"]["mean_kld"] for i in range(seeds)],
                               len(hk))
    measure("all", every)
    hkr, allr = rows["high_kurtosis"], rows["all"]
    why += (f"; all {len(every)} pairs cost {allr['mean_kld']:.4g} "
            f"({allr['kld_per_pair']:.3g} per pair); the high-kurtosis pairs hold "
            f"{100 * hkr['kurtosis_share']:.0f}% of the profile's excess-kurtosis mass.")
    overhead = _read_json(Path(model_dir) / "data" / "overhead.json") or []
    numbers = {"strength": s, "window": w, "profile": prof_src, "selections": rows,
               "data": _data_sizes(ev),
               "outlier_reduction": "not measured: the profiler's capture sees a site's input, "
                                    "before the filter; the profile's kurtosis share of each "
                                    "selection stands in for how much outlier mass it targets",
               "step_time_by_selection": [r for r in overhead if r.get("step") == "decode"]}
    rnd = [r["mean_kld"] for k, r in rows.items() if k.startswith("random")]
    rnd_s = _fmt(float(np.mean(rnd)), ".3g") if rnd else "n/a"
    return _result(4, params, numbers, verdict, why,
                   measurement=f"KLD high-kurtosis {hkr['mean_kld']:.3g} vs random {rnd_s} "
                               f"({len(hk)} pairs)")


# ----------------------------------------------------------------------------- claim 5


def judge_5(ratios: Mapping[str, float]) -> tuple[str, str]:
    """Supported iff the adaptive window's KLD ratio (max/min over lengths) is smaller than
    every fixed window's."""
    ad = ratios["adaptive"]
    fixed = {k: v for k, v in ratios.items() if k != "adaptive"}
    listed = ", ".join(f"window {k}: {v:.2f}" for k, v in fixed.items())
    if all(ad < v for v in fixed.values()):
        return "supported", (f"the adaptive window keeps mean KLD most constant across "
                             f"sequence lengths (max/min {ad:.2f}; {listed})")
    return "refuted", (f"the adaptive window does not keep mean KLD more constant across "
                       f"sequence lengths than every fixed window (max/min {ad:.2f}; {listed})")


MAX_ROW_LOGITS = 1 << 28  # floats of one row's logits (1 GiB in f32): claim 5's length cap


def run_claim_5(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                model_dir: Path) -> dict[str, Any]:
    from gsm_jax.workflow.calibrate import effective_window

    prof_path, prof_src = profile_path(params, sizes, progress, model_dir)
    s = _size(sizes, "strength")
    ctx = int(params.config.max_position_embeddings)
    windows = list(_size(sizes, "windows"))
    if "adaptive" not in windows:
        windows.append("adaptive")
    per_len: list[dict[str, Any]] = []
    skipped, reduced = [], {}
    # A row's logits are length x vocabulary floats and the evaluator holds several copies
    # (base log-probs, the smoothed pass, KLD temporaries): Gemma 3's 262k vocabulary at
    # 2048 tokens was OOM-killed at 23.6 GB on this 24 GB VM. Longer rows than the cap
    # are measured at the longest power of two under it (recorded).
    cap = max(128, 1 << ((MAX_ROW_LOGITS // int(params.config.vocab_size)).bit_length() - 1))
    for length, n in zip(_size(sizes, "window_lengths"), _size(sizes, "window_sequences"),
                         strict=True):
        if length > cap:
            reduced[str(length)] = cap
            length = cap
        if length > ctx:
            skipped.append(length)
            continue
        b = max(1, min(n, _size(sizes, "batch_tokens") // length))
        ev = _evaluator(params, sizes, progress, n=n, seq_len=length, batch_size=b, task=False)
        row: dict[str, Any] = {"seq_len": length, "sequences": n, "data": _data_sizes(ev),
                               "windows": {}}
        for w in windows:
            _say(progress, f"claim 5: length {length}, window {w}")
            cfg = GSMConfig(profile=prof_path, smooth_strength=s, window_size=w)
            q = _quality(ev.evaluate(cfg, parts=("quality",), label=f"L={length} w={w}"))
            row["windows"][str(w)] = {**q, "effective_window": effective_window(
                w, length, cfg.max_window)}
        per_len.append(row)
        _EVALUATORS.pop(next(k for k, v in _EVALUATORS.items() if v is ev))  # free memory
    if len(per_len) < 2:
        return _result(5, params, {"lengths": per_len, "skipped_lengths": skipped},
                       "not testable here",
                       f"fewer than two of the lengths fit the model's context of {ctx} tokens",
                       measurement="n/a")
    ratios = {}
    for w in windows:
        k = [r["windows"][str(w)]["mean_kld"] for r in per_len]
        ratios[str(w)] = max(k) / min(k) if min(k) > 0 else float("inf")
    verdict, why = judge_5(ratios)
    lens = [r["seq_len"] for r in per_len]
    ad = [r["windows"]["adaptive"] for r in per_len]
    klds = ", ".join(_fmt(a["mean_kld"]) for a in ad)
    eff = ", ".join(format(a["effective_window"], ".1f") for a in ad)
    why += (f"; adaptive mean KLD {klds} at lengths {lens} (effective window {eff}), "
            f"strength {s}. Batch size cannot matter here: windows are per sequence and "
            "causal, padding never enters one.")
    if reduced:
        why += (f" Lengths {list(reduced)} measured at {sorted(set(reduced.values()))} (the "
                f"{params.config.vocab_size}-entry vocabulary's logits at the full length do "
                "not fit this VM's memory).")
    numbers = {"strength": s, "profile": prof_src, "lengths": per_len, "ratios": ratios,
               "skipped_lengths": skipped, "reduced_lengths": reduced}
    return _result(5, params, numbers, verdict, why,
                   measurement=f"KLD max/min over lengths: adaptive {ratios['adaptive']:.2f}, "
                               + ", ".join(f"w{k} {v:.2f}" for k, v in ratios.items()
                                           if k != "adaptive"))


# ----------------------------------------------------------------------------- claim 8

CLIFF_FACTOR = 3.0  # a step whose loss slope is > 3x the average slope is a cliff
MONOTONE_TOL_TOP1 = 0.5  # same-top-1 may rise by this many points (noise) and stay monotone
ACCURACY_DROP_POINTS = 1.0  # a LAMBADA drop must exceed this (the default budget's tolerance)


def _cliff(strengths: Sequence[float], loss: Sequence[float]) -> tuple[bool, float]:
    """Whether one step's slope of ``loss`` exceeds CLIFF_FACTOR x the overall slope."""
    total = (loss[-1] - loss[0]) / (strengths[-1] - strengths[0])
    if total <= 0:
        return False, 0.0
    slopes = [(loss[i + 1] - loss[i]) / (strengths[i + 1] - strengths[i])
              for i in range(len(loss) - 1)]
    worst = max(slopes) / total
    return worst > CLIFF_FACTOR, worst


def judge_8(strengths: Sequence[float], kld: Sequence[float], top1: Sequence[float],
            acc: Sequence[float] | None, ppl_top: float | None,
            ppl_base: float | None = None, lambada_n: int | None = None
            ) -> tuple[str, str, dict]:
    """Two parts, both needed for "supported":

    gradual: mean KLD rises with strength and same-top-1 does not rise (within
    MONOTONE_TOL_TOP1 points), and no step's slope of the same-top-1 loss (nor of
    the LAMBADA accuracy loss) exceeds CLIFF_FACTOR x its average slope;
    fluent but wrong at the top strength: perplexity stays finite while LAMBADA
    accuracy drops by more than ACCURACY_DROP_POINTS (the budget's task tolerance:
    one example in a hundred is noise, not a drop).

    A LAMBADA step counts as a cliff, and the top strength's drop as a drop, only beyond
    2 standard errors of the difference of two accuracies on `lambada_n` examples (100
    examples near 38%: ~6.9 points): on a small set a few examples are noise.
    """
    kld_up = all(b > a for a, b in zip(kld, kld[1:], strict=False))
    top1_down = all(b <= a + MONOTONE_TOL_TOP1 for a, b in zip(top1, top1[1:], strict=False))
    cliff_t, worst_t = _cliff(strengths, [100 - t for t in top1])
    cliff_a, worst_a = (False, 0.0) if acc is None else _cliff(strengths,
                                                               [acc[0] - a for a in acc])
    noise = 0.0  # 2 s.e. of a difference of two LAMBADA accuracies, in points
    if acc is not None and lambada_n:
        p = min(max(acc[0] / 100, 0.01), 0.99)
        noise = 2 * math.sqrt(2 * p * (1 - p) / lambada_n) * 100
        cliff_a = cliff_a and max(a - b for a, b in zip(acc, acc[1:], strict=False)) > noise
    gradual = kld_up and top1_down and not cliff_t and not cliff_a
    parts = {"kld_monotone": kld_up, "top1_monotone": top1_down,
             "steepest_step_vs_average_top1": worst_t, "steepest_step_vs_average_lambada":
             worst_a, "gradual": gradual}
    s_top = strengths[-1]
    g = (f"mean KLD {' < '.join(_fmt(k, '.3g') for k in kld)} and same-top-1 "
         f"{', '.join(f'{t:.1f}' for t in top1)}% over strengths {list(strengths)}"
         f" (steepest step {worst_t:.1f}x the average slope)")
    if acc is None or ppl_top is None:
        parts["fluent_wrong"] = None
        verdict = "supported" if gradual else "refuted"
        return verdict, (f"quality loss is {'gradual' if gradual else 'not gradual'}: {g}; "
                         "the fluent-but-wrong part needs LAMBADA (not measured here)"), parts
    drop = acc[0] - acc[-1]
    fluent_wrong = math.isfinite(ppl_top) and drop > max(ACCURACY_DROP_POINTS, noise)
    parts.update(fluent_wrong=fluent_wrong, lambada_drop_points_top=drop, ppl_top=ppl_top,
                 lambada_noise_points=noise)
    a = (f"at {s_top} perplexity is {_fmt(ppl_top, '.3g')}"
         f"{'' if ppl_base is None else f' vs {ppl_base:.3g} unsmoothed'} "
         f"({'finite' if math.isfinite(ppl_top) else 'not finite'}) and LAMBADA accuracy "
         f"{acc[-1]:.1f}% vs {acc[0]:.1f}% ({acc[-1] - acc[0]:+.1f} points; the document: -8)")
    if gradual and fluent_wrong:
        return "supported", f"quality loss is gradual ({g}); {a}", parts
    which = [x for x, ok in (("the loss is not gradual", gradual),
                             (f"accuracy does not drop by more than "
                              f"{max(ACCURACY_DROP_POINTS, noise):.1f} points (the budget's "
                              "tolerance or 2 s.e. of the LAMBADA difference, whichever is "
                              "larger) at the top strength with perplexity finite",
                              fluent_wrong)) if not ok]
    return "refuted", f"{' and '.join(which)}: {g}; {a}", parts


def _decode(params: ModelParams, ids: Sequence[int]) -> str | list[int]:
    tok = params.tokenizer
    return [int(i) for i in ids] if tok is None else tok.decode([int(i) for i in ids])


def run_claim_8(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                model_dir: Path) -> dict[str, Any]:
    from gsm_jax.generation import generate_tokens

    prof_path, prof_src = profile_path(params, sizes, progress, model_dir)
    strengths = sorted(float(s) for s in _size(sizes, "strengths"))
    top = strengths[-1]
    ev = _evaluator(params, sizes, progress)
    base = ev.baseline()
    has_task = base.lambada is not None
    curve = []
    top_cfg = None
    for s in strengths:
        _say(progress, f"claim 8: strength {s}")
        if s == 0:
            q, lam = _quality(base), base.lambada
            gr = {"prefix_agreement_pct": 100.0, "identical_pct": 100.0} \
                if ev.greedy_prompts else None
        else:
            # the guard is lifted on purpose: the document saw answers go wrong at 0.4
            cfg = GSMConfig(profile=prof_path, smooth_strength=s, max_strength=max(top, 0.3))
            top_cfg = cfg if s == top else top_cfg
            res = ev.evaluate(cfg, label=f"s={s}")
            q, lam, gr = _quality(res), res.lambada, res.greedy
        curve.append({"strength": s, **q,
                      "lambada_accuracy_pct": lam and lam["accuracy_pct"],
                      "lambada_drop_points": lam and lam["accuracy_drop_points"],
                      "greedy_prefix_agreement_pct": gr and gr["prefix_agreement_pct"],
                      "greedy_identical_pct": gr and gr["identical_pct"]})
    texts = []
    k = min(_size(sizes, "continuations"), ev.greedy_prompts)
    if k and top_cfg is not None:
        prompts = ev.sequences[: ev.greedy_prompts, : ev.greedy_prompt_len]
        # the same call as the evaluator's greedy part: its compiled program is reused
        outs = generate_tokens(params, prompts, max_new_tokens=ev.greedy_tokens, eos_ids=[],
                               gsm=top_cfg)
        base_outs = ev.reference(("greedy",))["greedy"]
        for i in range(k):
            texts.append({"prompt_tail": _decode(params, prompts[i][-24:]),
                          "strength_0": _decode(params, base_outs[i]),
                          f"strength_{top}": _decode(params, outs[i])})
    acc = [c["lambada_accuracy_pct"] for c in curve] if has_task else None
    verdict, why, parts = judge_8(strengths, [c["mean_kld"] for c in curve],
                                  [c["same_top1_pct"] for c in curve], acc,
                                  curve[-1]["ppl"], curve[0]["ppl_base"],
                                  _data_sizes(ev).get("lambada_examples"))
    numbers = {"profile": prof_src, "window": 8, "max_strength": max(top, 0.3), "curve": curve,
               "parts": parts, "continuations": texts, "data": _data_sizes(ev)}
    m = f"KLD {_fmt(curve[-1]['mean_kld'], '.3g')}, top-1 {curve[-1]['same_top1_pct']:.1f}%"
    if has_task:
        m += f", LAMBADA {-curve[-1]['lambada_drop_points']:+.1f} pts"
    return _result(8, params, numbers, verdict, why + ".", measurement=f"at {top}: {m}")


def rejudge_8(result: dict) -> dict:
    """Claim 8's verdict again from its recorded curve (after a change of the rule)."""
    curve, n = result["numbers"]["curve"], result["numbers"]["data"].get("lambada_examples")
    acc = [c["lambada_accuracy_pct"] for c in curve] if "lambada_accuracy_pct" in curve[0] \
        else None
    verdict, why, parts = judge_8([c["strength"] for c in curve],
                                  [c["mean_kld"] for c in curve],
                                  [c["same_top1_pct"] for c in curve], acc, curve[-1]["ppl"],
                                  curve[0]["ppl_base"], n)
    return {**result, "verdict": verdict, "why": why + ".",
            "numbers": {**result["numbers"], "parts": parts}}


# ----------------------------------------------------------------------------- claim 11


def judge_11(before: Mapping[str, float], after: Mapping[str, float],
             control: Mapping[str, float] | None, budget: Mapping[str, float]
             ) -> tuple[str, str]:
    """Supported iff, on held-out data, the configuration breaks the budget with the
    culprits and is within it without them, and removing them beats removing as many
    of the least-contributing layers (the control)."""
    def within(q: Mapping[str, float]) -> bool:
        return (q["mean_kld"] <= budget["max_mean_kld"]
                and q["same_top1_pct"] >= budget["min_same_top1_pct"])

    def d(q: Mapping[str, float]) -> str:
        return f"KLD {q['mean_kld']:.4g}, top-1 {q['same_top1_pct']:.1f}%"

    ctl = "" if control is None else f"; removing as many other layers instead: {d(control)}"
    text = (f"held out, with the culprits {d(before)}, without them {d(after)}{ctl} (budget "
            f"KLD <= {budget['max_mean_kld']:g}, top-1 >= {budget['min_same_top1_pct']:g}%)")
    if within(before):
        return "refuted", ("the break found on the search set does not reproduce on held-out "
                           f"data, so there is nothing to recover: {text}")
    specific = control is None or after["mean_kld"] < control["mean_kld"]
    if within(after) and specific:
        return "supported", f"removing the culprits recovers the budget: {text}"
    reason = "does not recover the budget" if not within(after) else \
        "recovers it no better than removing other layers"
    return "refuted", f"removing the culprits {reason}: {text}"


def _calibration(params: ModelParams, sizes: Mapping[str, Any], progress: bool,
                 model_dir: Path) -> tuple[dict | None, str]:
    path = Path(model_dir) / "data" / "calibration" / "calibration.json"
    cal = _read_json(path)
    if cal and cal.get("culprits") and cal.get("targets"):
        return cal, f"the model report's back-off ({path})"
    from gsm_jax.workflow.calibrate import BudgetNotMetError, calibrate

    prof_path, _ = profile_path(params, sizes, progress, model_dir)
    n, t = _size(sizes, "quality_sequences"), _size(sizes, "seq_len")
    tokens, src = token_sequences(params, n, t, where="end")
    _say(progress, "claim 11: no back-off in the model report: searching (quality only)")
    try:
        res = calibrate(params, profile=prof_path, data=tokens, lambada=None,
                        strengths=_size(sizes, "backoff_strengths"), windows=(8,),
                        protect_first_values=(DEFAULT_PROTECT_FIRST,), num_sequences=n,
                        seq_len=t, batch_size=min(_size(sizes, "batch_size"), n),
                        greedy_prompts=0, curves=False, progress=progress)
    except BudgetNotMetError as e:
        res = e.result
    return res.to_dict(), f"a quality-only back-off run here on {src}"


def run_claim_11(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                 model_dir: Path) -> dict[str, Any]:
    cal, cal_src = _calibration(params, sizes, progress, model_dir)
    n_layers = int(params.config.num_layers)
    if not cal or not cal.get("culprits"):
        top = max(_size(sizes, "backoff_strengths"))
        broke = any(t.get("violations") for t in (cal or {}).get("trials", []))
        layers = sorted({int(layer) for layer, _ in (cal or {}).get("targets", [])})
        why = (f"the budget broke, but the targets lie in {len(layers)} layer(s) {layers}: "
               "the back-off keeps at least one layer, so it had nothing to remove" if broke
               else f"the budget never broke up to strength {top} on the search set, so the "
               "back-off had nothing to find")
        return _result(11, params, {"calibration": cal_src, "culprits": [],
                                    "budget_broke": broke, "target_layers": layers},
                       "not testable here", why,
                       measurement="no culprits" if broke else "no break")
    budget = cal["budget"]
    culprits = cal["culprits"]
    s_break, w_break = culprits[0]["strength"], culprits[0]["window"]
    targets = [(int(layer), str(site)) for layer, site in cal["targets"]]
    bad = {int(c["layer"]) for c in culprits}
    contrib = sorted(cal.get("contributions") or [], key=lambda c: c["mean_kld"])
    others = [int(c["layer"]) for c in contrib if int(c["layer"]) not in bad][: len(bad)]
    base_cfg = GSMConfig.from_dict(cal["base_config"]).replace(profile=None)

    def cfg(pairs: Sequence[tuple[int, str]]) -> GSMConfig:
        return base_cfg.replace(smooth_strength=s_break, window_size=w_break,
                                target_layers=_pairs_to_target(pairs),
                                max_strength=max(base_cfg.max_strength, s_break))

    seq_len = int(cal.get("sizes", {}).get("seq_len") or _size(sizes, "seq_len"))
    n = _size(sizes, "heldout_sequences")
    ev = _evaluator(params, sizes, progress, n=n, seq_len=seq_len, where="middle", task=False)
    configs = {"with culprits": targets,
               "without culprits": [p for p in targets if p[0] not in bad]}
    if others:
        configs["without as many least-contributing layers"] = [
            p for p in targets if p[0] not in set(others)]
    held = {}
    for label, pairs in configs.items():
        _say(progress, f"claim 11: held out, {label}")
        held[label] = {"pairs": len(pairs), **_quality(ev.evaluate(cfg(pairs), parts=(
            "quality",), label=label))}
    search = {}
    for t in cal.get("trials", []):
        q = (t.get("result") or {}).get("quality")
        if q and t["strength"] == s_break and t["window"] == w_break:
            if t["scope"] == "targets" and "with culprits" not in search:
                search["with culprits"] = {k: q[k] for k in ("mean_kld", "same_top1_pct")}
            elif t["scope"] == f"without {[c['layer'] for c in culprits]}":
                search["without culprits"] = {k: q[k] for k in ("mean_kld", "same_top1_pct")}
    verdict, why = judge_11(held["with culprits"], held["without culprits"],
                            held.get("without as many least-contributing layers"), budget)
    depth = [round(layer / max(n_layers - 1, 1), 2) for layer in sorted(bad)]
    middle = all(0.25 <= d <= 0.75 for d in depth)
    where = "middle layers, as the document says" if middle else \
        "not the middle layers the document names"
    why += (f". Culprit layers {sorted(bad)} of {n_layers} (relative depth {depth}: {where}); "
            f"strength {s_break}, window {w_break}; from {cal_src}.")
    numbers = {"calibration": cal_src, "strength": s_break, "window": w_break,
               "culprits": sorted(bad), "culprit_relative_depth": depth,
               "control_layers": others, "budget": budget, "held_out": held,
               "search_set": search, "data": _data_sizes(ev)}
    b, a = held["with culprits"], held["without culprits"]
    return _result(11, params, numbers, verdict, why,
                   measurement=f"held-out KLD {b['mean_kld']:.3g} -> {a['mean_kld']:.3g} "
                               f"without layers {sorted(bad)}")


# ----------------------------------------------------------------------------- claim 12


def judge_12(kld0: float, se0: float, kld1: float, se1: float) -> tuple[str, str]:
    """Supported iff protect_first >= 1 lowers mean KLD by more than NOISE_SIGMAS
    standard errors of the difference (errors treated as independent: conservative)."""
    se = math.sqrt((se0 or 0.0) ** 2 + (se1 or 0.0) ** 2)
    factor = kld0 / kld1 if kld1 > 0 else float("inf")
    if kld0 - kld1 > NOISE_SIGMAS * se:
        return "supported", (f"leaving the first token alone lowers mean KLD from {kld0:.4g} "
                             f"(protect_first 0) to {kld1:.4g} ({factor:.1f}x), far beyond the "
                             f"noise (± {se:.2g})")
    return "refuted", (f"protect_first does not lower mean KLD beyond the noise: {kld0:.4g} "
                       f"(protect_first 0) vs {kld1:.4g} (± {se:.2g})")


def run_claim_12(params: ModelParams, *, sizes: Mapping[str, Any], progress: bool,
                 model_dir: Path) -> dict[str, Any]:
    final = _read_json(Path(model_dir) / "data" / "final_eval.json") or {}
    cal = _read_json(Path(model_dir) / "data" / "calibration" / "calibration.json") or {}
    on, off = final.get("chosen"), final.get("chosen, protect_first 0")
    rows = cal.get("protect_first", [])
    if on and off and on.get("quality") and off.get("quality"):
        pf = on["config"]["protect_first"]
        q1, q0 = on["quality"], off["quality"]
        src = (f"the model report's full-size evaluation ({model_dir}/data/final_eval.json: "
               f"chosen config with protect_first {pf} vs 0, {q1['n_tokens']} tokens)")
        cfg = on["config"]
        command = f"gsm-jax report --model {params.source} --out {model_dir}"
    else:
        prof_path, _ = profile_path(params, sizes, progress, model_dir)
        ev = _evaluator(params, sizes, progress)
        c = GSMConfig(profile=prof_path)
        pf = max(1, c.protect_first)
        _say(progress, "claim 12: protect_first 0 vs 1 at the default config")
        q1 = _quality(ev.evaluate(c.replace(protect_first=pf), parts=("quality",)))
        q0 = _quality(ev.evaluate(c.replace(protect_first=0), parts=("quality",)))
        src = f"measured here at the default config on {_data_sizes(ev)['data']}"
        cfg, command = c.to_dict(), None
    verdict, why = judge_12(q0["mean_kld"], q0.get("mean_kld_stderr") or 0.0,
                            q1["mean_kld"], q1.get("mean_kld_stderr") or 0.0)
    why += (f"; same-top-1 {q0['same_top1_pct']:.1f}% vs {q1['same_top1_pct']:.1f}% "
            f"(strength {cfg['smooth_strength']}, window {cfg['window_size']}; {src}).")
    numbers = {"source": src, "config": cfg, "protect_first": pf,
               "pf0": {k: q0.get(k) for k in ("mean_kld", "mean_kld_stderr", "same_top1_pct",
                                               "ppl_ratio")},
               "pf1": {k: q1.get(k) for k in ("mean_kld", "mean_kld_stderr", "same_top1_pct",
                                               "ppl_ratio")},
               "calibration_rows": rows,
               "warm_up": "the window's warm-up is part of the filter's definition (the mean is "
                          "over the tokens available); the first token, where massive "
                          "activations sit, is what protect_first leaves out"}
    return _result(12, params, numbers, verdict, why, command=command,
                   source_file=str(Path(model_dir) / "data" / "final_eval.json")
                   if command else None,
                   measurement=f"KLD pf0 {q0['mean_kld']:.3g} vs pf{pf} {q1['mean_kld']:.3g}")
