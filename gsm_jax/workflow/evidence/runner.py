"""Run the source document's 14 claims on each model and write one JSON per claim.

    run_evidence(["smollm2-135m", "gemma3-270m"], "reports", sizes=EvidenceSizes())

Each claim is a function ``run_claim(params, *, sizes: dict, progress: bool,
model_dir: Path) -> dict`` named in `CLAIMS` as ``"module:function"`` and imported
by name when it runs, so a claim whose module is not written yet is reported as
"not measured (module missing)" instead of failing the run. ``sizes`` is
`EvidenceSizes` as a dict plus ``smoke`` (tiny sizes: numbers meaningless) and
``evidence_dir`` (where the claim may keep files of its own); ``model_dir`` is
the directory of the model's own report (`find_model_dir`), whose measurements a
claim may reuse instead of repeating them.

A claim returns a JSON-able dict with at least ``claim``, ``model``, ``numbers``
(dict), ``verdict`` (one of `VERDICTS`), ``why`` (one sentence quoting the
numbers) and ``command``; optional ``measurement`` (the short number shown in
the table) and ``statement``. The runner adds the 1-minute load average before
and after (``load_avg``; above `LOAD_LIMIT` it is flagged "not comparable": the
machine is shared, and a timing taken while others run is not a measurement of
this code), the wall time, the machine and the sizes, and writes
``<out>/data/evidence/<model>/claim_<N>.json``. With ``resume`` an existing JSON
is kept. A claim that raises is written as ``claim_<N>.error.json`` (retried on
the next run) and the others still run.

A model may also be ``random:<preset>`` (`random_models`): a random-weight checkpoint of
the target's architecture, written once and loaded like any folder. On a folder whose
provenance says random weights, ``sizes["cost_only"]`` is True, every result records
``weights_kind`` "random", and the quality claims (`random_models.QUALITY_CLAIMS`) are
written as not testable ("random weights: cost only") without running.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gsm_jax.errors import InvalidInputError
from gsm_jax.workflow.evidence import random_models
from gsm_jax.workflow.results import evidence_dir, model_slug

VERDICTS = ("supported", "refuted", "not testable here")
NOT_MEASURED_MISSING = "not measured (module missing)"
LOAD_LIMIT = 1.5  # 1-minute load average above which a measurement is "not comparable"
EVIDENCE_MD = "gsm_evidence.md"
META_FILE = "evidence_meta.json"
_PKG = "gsm_jax.workflow.evidence"


@dataclasses.dataclass(frozen=True)
class ClaimSpec:
    number: int
    statement: str  # what the document says, in short
    where: str  # where the document says it
    target: str  # "module:function" that measures it


CLAIMS: dict[int, ClaimSpec] = {c.number: c for c in (
    ClaimSpec(1, "Smoothing raises GPU (SM) utilisation, so throughput goes up", "§2.2",
              f"{_PKG}.quality_claims:run_claim_1"),
    ClaimSpec(2, "Concentrated values make memory access regular: the L2 cache hit rate "
              "improves markedly", "§2.2", f"{_PKG}.quality_claims:run_claim_2"),
    ClaimSpec(3, "Fewer extremes: less overflow/underflow, low-precision loss more "
              "controllable", "§2.2", f"{_PKG}.lowp_claims:run_claim_3"),
    ClaimSpec(4, "Smooth only the high-kurtosis layers; smoothing low-kurtosis layers only "
              "adds cost", "§3.2 step 3", f"{_PKG}.quality_claims:run_claim_4"),
    ClaimSpec(5, "Window and strength are coupled; tie the window to the sequence length "
              "(length/16, at least 4) so the relative strength stays the same",
              "§3.2 step 2, §4.2", f"{_PKG}.quality_claims:run_claim_5"),
    ClaimSpec(6, "Gains grow with concurrency and with sequence length; P99 (tail) latency "
              "improves more than the mean", "§3.2 step 5, §5.1",
              f"{_PKG}.serving_claim:run_claim_6"),
    ClaimSpec(7, "Short requests should bypass smoothing: gains are limited for single short "
              "requests", "§5.1", f"{_PKG}.serving_claim:run_claim_7"),
    ClaimSpec(8, "Quality loss creeps in gradually, not as a cliff; at strength 0.4 answers "
              "are fluent but wrong (accuracy -8 points)", "§4.1",
              f"{_PKG}.quality_claims:run_claim_8"),
    ClaimSpec(9, "Quantize first, then smooth: quantization amplifies jitter and smoothing "
              "cures it", "§5.2", f"{_PKG}.lowp_claims:run_claim_9"),
    ClaimSpec(10, "Speculative decoding is numerically sensitive: smoothing may disturb "
              "verification", "§5.2", f"{_PKG}.speculative_claim:run_claim"),
    ClaimSpec(11, "Backing off layer by layer locates the culprit layers (a few middle "
              "layers)", "§4.1", f"{_PKG}.quality_claims:run_claim_11"),
    ClaimSpec(12, "Warm-up: the first tokens are smoothed differently and need their own "
              "treatment (here: protect_first)", "§4.4", f"{_PKG}.quality_claims:run_claim_12"),
    ClaimSpec(13, "Smoothing and KV-cache optimisation together gain more than the sum of "
              "each (here: the FP8 / int8 KV cache; V4.1: its released cache formats)",
              "§5.2", f"{_PKG}.kv_claims:run_claim_13"),
    ClaimSpec(14, "Under continuous batching, with requests coming and going, smoothing "
              "evens the load", "§5.2", f"{_PKG}.serving_claim:run_claim_14"),
)}


@dataclasses.dataclass(frozen=True)
class EvidenceSizes:
    """How much data each claim measures on.

    Chosen so that the whole run for one 135M-270M model takes at most about 20
    minutes on a 2-core CPU machine. The budget was worked out in token forwards
    from the SmolLM2-135M report's recorded timings (see docs/performance_notes.md,
    "Evidence sizes: the time budget per token forward"), and Gemma-3-270M counted
    at twice the cost per token (its 262k-word output layer is as large as
    SmolLM2's whole body):

    - one shared quality set of 8 x 256 WikiText-2 tokens (the report's
      calibration set, taken from the end of the file) for claims 4, 8, 12:
      ~2k tokens per configuration; claims 4 and 8 evaluate 11 configurations on it;
    - LAMBADA: the first 100 examples, at the 6 strengths of claim 8 only
      (~60k tokens, the largest item); greedy agreement 8 prompts x 32 tokens;
    - claim 5: the same ~1-2k tokens at each length (8 x 128, 2 x 512, 1 x 2048:
      few sequences at 2048), 4 windows: ~20k tokens;
    - claim 11: 8 held-out sequences of 256 tokens from the middle of the file,
      3 configurations (the search itself is reused from the model report);
    - a profile of 64 x 128 tokens only when the model report has none.

    Altogether ~100k token forwards plus ~15 compiles (the minutes this takes: the
    same notes entry).
    `smoke` is seconds on the tiny random test model (numbers meaningless).
    """

    quality_sequences: int = 8
    seq_len: int = 256
    batch_size: int = 8
    lambada: int = 100
    greedy_prompts: int = 8
    greedy_prompt_len: int = 64
    greedy_tokens: int = 32
    continuations: int = 2  # claim 8: greedy texts printed at the top strength vs 0
    profile_samples: int = 64  # only when the model report has no profile
    profile_seq_len: int = 128
    random_seeds: int = 3  # claim 4
    strength: float = 0.1  # claims 4, 5: the document's starting point
    window: int = 8
    window_lengths: tuple[int, ...] = (128, 512, 2048)  # claim 5
    window_sequences: tuple[int, ...] = (8, 2, 1)
    windows: tuple[int | str, ...] = (4, 8, 16, "adaptive")
    batch_tokens: int = 2048  # claim 5: batch = batch_tokens // length (memory)
    strengths: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4)  # claim 8
    heldout_sequences: int = 8  # claim 11
    backoff_strengths: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3)  # claim 11, no report
    overhead_batch: int = 8  # claim 1, only when the model report has no overhead data
    overhead_prompt: int = 128
    overhead_steps: int = 16
    overhead_reps: int = 3
    decode_batch: int = 8  # claim 2: the compiled decode step's cost analysis
    decode_cache: int = 256

    @classmethod
    def smoke(cls) -> EvidenceSizes:
        """Tiny sizes: the pipeline end to end in seconds on a tiny model."""
        return cls(quality_sequences=2, seq_len=32, batch_size=2, lambada=4, greedy_prompts=2,
                   greedy_prompt_len=8, greedy_tokens=4, continuations=1, profile_samples=4,
                   profile_seq_len=32, random_seeds=2, window_lengths=(32, 64, 128),
                   window_sequences=(2, 1, 1), windows=(4, 8, "adaptive"), batch_tokens=64,
                   heldout_sequences=2, backoff_strengths=(0.1, 0.3), overhead_batch=2,
                   overhead_prompt=16, overhead_steps=2, overhead_reps=1, decode_batch=2,
                   decode_cache=32)

    def check(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 1 and f.name != "lambada":
                raise InvalidInputError(f"evidence size {f.name}={v}: must be >= 1")
        if len(self.window_lengths) != len(self.window_sequences):
            raise InvalidInputError("window_lengths and window_sequences must have equal length")
        if self.lambada < 0:
            raise InvalidInputError(f"evidence size lambada={self.lambada}: must be >= 0")


# ----------------------------------------------------------------------------- names, paths
# (`model_slug`, `evidence_dir`: `gsm_jax.workflow.results`, shared with the model report)


def _report_model(meta_path: Path) -> str | None:
    try:
        return json.loads(meta_path.read_text())["model"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_model_dir(out: str | os.PathLike, model: str) -> Path:
    """The directory of ``model``'s own report (its measurements are in ``<dir>/data``).

    ``<out>/<model>`` if it has a report, else ``<out>`` if the report there
    (``data/report_meta.json``) is of this model, else any ``<out>/*`` whose report
    is; otherwise ``<out>/<model>``, which may not exist (the claims then measure
    what they need themselves).
    """
    out = Path(out)
    slug = model_slug(model)
    own = out / slug
    if (own / "data" / "report_meta.json").exists():
        return own
    if _report_model(out / "data" / "report_meta.json") in (model, slug):
        return out
    if out.is_dir():
        for meta in sorted(out.glob("*/data/report_meta.json")):
            if _report_model(meta) in (model, slug):
                return meta.parent.parent
    return own


def parse_claims(claims: Sequence[int] | str | None) -> list[int]:
    """Claim numbers, checked (None: all)."""
    if claims is None:
        return sorted(CLAIMS)
    if isinstance(claims, str):
        items: list[Any] = [c.strip() for c in claims.split(",") if c.strip()]
    else:
        items = list(claims)
    out = []
    for c in items:
        try:
            n = int(c)
        except (TypeError, ValueError):
            n = None
        if n is None or isinstance(c, bool) or n not in CLAIMS:
            raise InvalidInputError(f"unknown claim {c!r}; the claims are 1..{max(CLAIMS)}")
        out.append(n)
    if not out:
        raise InvalidInputError("no claims given")
    return sorted(dict.fromkeys(out))


def check_models(models: Sequence[str] | str) -> list[str]:
    """Model names, checked before any work starts (a typo must not fail after an hour)."""
    from gsm_jax.loading import REGISTERED_MODELS

    if isinstance(models, str):
        models = [m.strip() for m in models.split(",")]
    models = [m for m in dict.fromkeys(str(m).strip() for m in models) if m]
    if not models:
        raise InvalidInputError("no models given")
    for m in models:
        if random_models.is_random(m):
            random_models.check(m)
            continue
        if m not in REGISTERED_MODELS and not Path(m).exists():
            raise InvalidInputError(
                f"unknown model {m!r}: not a registered name ({', '.join(REGISTERED_MODELS)}), "
                "an existing file or directory, nor a random-weight model ("
                + ", ".join(random_models.PREFIX + p for p in random_models.PRESETS) + ")")
    return models


def resolve_claim(number: int) -> Callable[..., dict] | str:
    """The claim's function, or the reason it is not available (module or function missing)."""
    spec = CLAIMS[number]
    module, func = spec.target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return f"{NOT_MEASURED_MISSING}: {module}"
        return f"not measured (module fails to import: {type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a module being edited must not stop the others
        return f"not measured (module fails to import: {type(e).__name__}: {e})"
    fn = getattr(mod, func, None)
    if fn is None:
        return f"{NOT_MEASURED_MISSING}: {module} has no {func}"
    return fn


def evidence_command(models: Sequence[str], out: str | os.PathLike,
                     claims: Sequence[int] | None = None, *, smoke: bool = False,
                     mesh: Sequence[int] | None = None) -> str:
    cmd = f"gsm-jax evidence --models {','.join(models)} --out {out}"
    if mesh is not None:
        cmd += " --mesh " + "x".join(str(int(a)) for a in mesh)
    if claims is not None and sorted(claims) != sorted(CLAIMS):
        cmd += " --claims " + ",".join(str(c) for c in claims)
    return cmd + (" --smoke" if smoke else "")


# ----------------------------------------------------------------------------- load average


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def load_record(before: float | None, after: float | None) -> dict[str, Any]:
    """The load average around a measurement, flagged when either side is above the limit."""
    worst = max((v for v in (before, after) if v is not None), default=None)
    comparable = worst is None or worst <= LOAD_LIMIT
    return {"before": before, "after": after, "limit": LOAD_LIMIT,
            "comparable": comparable,
            "flag": "comparable" if comparable else
            f"not comparable (1-minute load average {worst:.2f} > {LOAD_LIMIT})"}


# ----------------------------------------------------------------------------- run


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _check_result(res: Any, number: int) -> dict[str, Any]:
    if not isinstance(res, Mapping):
        raise InvalidInputError(f"claim {number} returned {type(res).__name__}, not a dict")
    missing = [k for k in ("numbers", "verdict", "why") if k not in res]
    if missing:
        raise InvalidInputError(f"claim {number}'s result lacks {missing}")
    if res["verdict"] not in VERDICTS:
        raise InvalidInputError(f"claim {number}'s verdict {res['verdict']!r} is not one of "
                                f"{VERDICTS}")
    return dict(res)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def run_evidence(
    models: Sequence[str] | str,
    out: str | os.PathLike = "reports",
    *,
    sizes: EvidenceSizes | None = None,
    resume: bool = False,
    progress: bool = True,
    claims: Sequence[int] | str | None = None,
    smoke: bool | None = None,
    command: str | None = None,
    load: Callable[[str], Any] | None = None,
    mesh: Sequence[int] | None = None,
) -> Path:
    """Measure ``claims`` (default: all 12) on every model, then write ``<out>/gsm_evidence.md``.

    ``load``: model name -> `ModelParams` (default `gsm_jax.load`; tests pass a tiny
    model; with it the names are not checked). ``smoke`` defaults to whether
    ``sizes`` equals `EvidenceSizes.smoke()`. ``mesh``: (data, model) devices: each model
    is loaded sharded over them (`gsm_jax.load(..., mesh=)`, JAX SPMD), and the claims
    that start a server pass it on (``--mesh``). Returns the markdown path.
    """
    from gsm_jax.workflow.evidence.render import render_evidence

    sizes = sizes or EvidenceSizes()
    sizes.check()
    smoke = (sizes == EvidenceSizes.smoke()) if smoke is None else bool(smoke)
    numbers = parse_claims(claims)
    models = check_models(models) if load is None else [str(m) for m in models]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"out {out} exists and is not a directory")
    jax_mesh = None
    if mesh is not None:
        from gsm_jax.sharding import mesh_from_shape

        mesh = tuple(int(a) for a in mesh)
        jax_mesh = mesh_from_shape(mesh)  # refused here, before any model loads
    this_command = command or evidence_command(models, out, numbers, smoke=smoke, mesh=mesh)
    say = (lambda m: print(f"[gsm-jax evidence] {m}", file=sys.stderr, flush=True)) \
        if progress else (lambda m: None)
    own_load = load is None  # random:<preset> names are written to disk and loaded
    if load is None:
        from gsm_jax.loading import load as load_model

        def load(m: str) -> Any:
            return load_model(m, mesh=jax_mesh)

    meta_path = out / "data" / "evidence" / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta_models = list(dict.fromkeys([*meta.get("models", []), *models]))
    runs = list(meta.get("runs", []))
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs.append({"at": now, "command": this_command, "claims": numbers, "smoke": smoke,
                 "resume": resume})
    _write_json(meta_path, {"schema": "gsm-jax/evidence-meta/v1", "models": meta_models,
                            "runs": runs[-20:], "sizes": dataclasses.asdict(sizes),
                            "smoke": smoke})

    from gsm_jax.workflow.calibrate import machine_info

    machine = machine_info()
    for model in models:
        edir = evidence_dir(out, model)
        todo = [n for n in numbers if not (resume and (edir / f"claim_{n}.json").exists())]
        if not todo:
            say(f"{model}: every requested claim already measured (--resume)")
            continue
        fns = {n: resolve_claim(n) for n in todo}
        for n, fn in fns.items():
            if isinstance(fn, str):
                say(f"{model} claim {n}: {fn}")
        runnable = [n for n in todo if callable(fns[n])]
        if not runnable:
            continue
        model_dir = find_model_dir(out, model)
        say(f"{model}: loading (report data from {model_dir / 'data'}"
            f"{'' if (model_dir / 'data').is_dir() else ', absent: claims measure themselves'})")
        source = (str(random_models.materialize(model, progress=progress))
                  if random_models.is_random(model) and own_load else model)
        prov = random_models.provenance(source) if Path(source).is_dir() else None
        cost_only = prov is not None and prov.get("weights") == "random"
        params = load(source)
        size_dict = {**dataclasses.asdict(sizes), "smoke": smoke, "evidence_dir": str(edir),
                     "mesh": None if mesh is None else list(mesh), "cost_only": cost_only}
        for n in runnable:
            if cost_only and n in random_models.QUALITY_CLAIMS:
                _write_json(edir / f"claim_{n}.json", {
                    "claim": n, "model": model, "verdict": "not testable here",
                    "why": f"{random_models.COST_ONLY}: a quality claim says nothing on "
                           "random weights.", "measurement": None, "numbers": {},
                    **_weights_record(params, model, prov), "measured_at": now,
                    "smoke": smoke, "run_command": this_command,
                    "command": evidence_command([model], out, [n], smoke=smoke, mesh=mesh)})
                say(f"{model} claim {n}: not testable ({random_models.COST_ONLY})")
                continue
            say(f"{model} claim {n}: {CLAIMS[n].statement}")
            before, t0 = load_average(), time.perf_counter()
            err_path = edir / f"claim_{n}.error.json"
            try:
                res = _check_result(fns[n](params, sizes=dict(size_dict), progress=progress,
                                           model_dir=model_dir), n)
            except Exception as e:  # noqa: BLE001 - one failing claim must not stop the others
                _write_json(err_path, {"claim": n, "model": model, "at": now,
                                       "error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc(limit=8)})
                say(f"{model} claim {n}: FAILED ({type(e).__name__}: {e}); wrote {err_path}")
                continue
            seconds = time.perf_counter() - t0
            # the command that regenerates this claim on this model (the claim may name
            # the one that measured numbers it reused, as source_command)
            res.setdefault("command", evidence_command([model], out, [n], smoke=smoke,
                                                       mesh=mesh))
            # what was measured: the family and where its weights came from (the answer at
            # the top of the report tells a tiny or random-weight model from a released one)
            res.update(_weights_record(params, model, prov))
            res.update(claim=n, model=model, measured_at=now, seconds=round(seconds, 1),
                       load_avg=load_record(before, load_average()), machine=machine,
                       smoke=smoke, sizes=size_dict, run_command=this_command)
            _write_json(edir / f"claim_{n}.json", res)
            err_path.unlink(missing_ok=True)
            say(f"{model} claim {n}: {res['verdict']} ({seconds:.0f}s) - {res['why']}")
        _release(params)
    path = render_evidence(out)
    say(f"wrote {path}")
    return path


def _weights_record(params: Any, model: str, prov: dict | None) -> dict[str, Any]:
    """What a result was measured on: family, size, where the weights came from and
    whether they are random (`random_models.provenance`)."""
    cfg = getattr(params, "config", None)
    random = prov is not None and prov.get("weights") == "random"
    return {"family": getattr(cfg, "family", None),
            "weights": str(getattr(params, "source", None) or model),
            "weights_kind": "random" if random else "trained", "provenance": prov,
            "num_layers": getattr(cfg, "num_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None)}


def _release(params: Any) -> None:
    """Drop the shared evaluators and compiled programs of a model before the next loads."""
    try:
        from gsm_jax.workflow.evidence import quality_claims

        quality_claims.clear_cache()
    except ImportError:
        pass
    import jax

    del params
    jax.clear_caches()


def errors(out: str | os.PathLike, models: Sequence[str]) -> list[Path]:
    """The claims of ``models`` whose last run failed (``claim_<N>.error.json``)."""
    return sorted(p for m in models for p in evidence_dir(out, m).glob("claim_*.error.json"))
