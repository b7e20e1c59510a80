"""`gsm-jax profile | calibrate | eval | report | evidence`: the GSM workflow on the command line.

    gsm-jax profile   --model smollm2-135m --out prof/
    gsm-jax calibrate --model smollm2-135m --profile prof/profile.json --out cal/
    gsm-jax eval      --model smollm2-135m --gsm cal/gsm.yaml
    gsm-jax report    --model smollm2-135m --out reports/
    gsm-jax evidence  --models smollm2-135m,gemma3-270m --out reports [--resume] [--claims 1,4]

``--data`` defaults to the WikiText-2 raw test split and ``--lambada`` to the LAMBADA
examples shipped with the package (`gsm_jax.workflow.data`); ``--data FILE`` /
``--lambada FILE`` take your own (``--lambada none`` skips the task metric). A ``.npy``
file of token ids [N, T] is accepted as ``--data`` (for models without a tokenizer).
Every file option is checked before the model loads. Listed in `gsm_jax.cli.COMMANDS`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from gsm_jax.errors import InvalidInputError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and compute dtype")
    p.add_argument("--keep-quantized", action="store_true",
                   help="a block-quantized (FP8 / FP4) DeepSeek checkpoint keeps its "
                        "low-precision weights as stored, the rest in --dtype (default: "
                        "dequantized to --dtype at load)")
    p.add_argument("--data", default=None,
                   help="UTF-8 text file (.gz too) or .npy token ids [N, T] (unset: the "
                        "WikiText-2 raw test split shipped with the package)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # INT8 (gsm_jax.quant): --quantize {none,w8a16,w8a8}, applied right after loading
    from gsm_jax.quant import add_quantize_argument

    add_quantize_argument(p)


def _lambada_args(p: argparse.ArgumentParser, samples_default: int | None) -> None:
    p.add_argument("--lambada", default="default",
                   help="LAMBADA jsonl, one {\"text\": ...} per line; 'default' = the 2000 "
                        "examples shipped with the package, 'none' skips the task")
    p.add_argument("--lambada-samples", type=int, default=samples_default,
                   help="first N LAMBADA examples" + (" (unset: all)" if samples_default is None
                                                      else ""))
    p.add_argument("--greedy-prompts", type=int, default=8,
                   help="prompts of the greedy-agreement check (smoothed vs unsmoothed)")
    p.add_argument("--greedy-prompt-len", type=int, default=64,
                   help="tokens per greedy-check prompt")
    p.add_argument("--greedy-tokens", type=int, default=64,
                   help="tokens generated per greedy-check prompt")


def _lambada(value: str):
    from gsm_jax.workflow.evaluate import DEFAULT

    if value == "default":
        return DEFAULT
    if value.lower() == "none":
        return None
    return value


def check_files(args: argparse.Namespace) -> None:
    """Every file option of a workflow command names a readable, non-empty file (or one of
    its special values): checked before the model loads, the error names the option."""
    from gsm_jax.workflow.data import check_file_option

    check_file_option("--data", getattr(args, "data", None))
    check_file_option("--lambada", getattr(args, "lambada", None), special=("default", "none"))
    for option in ("profile", "base_config"):
        check_file_option("--" + option.replace("_", "-"), getattr(args, option, None))
    gsm = getattr(args, "gsm", None)
    check_file_option("--gsm", gsm, special=("none",))
    out = getattr(args, "out", None)
    if out is not None and Path(out).exists() and not Path(out).is_dir() \
            and getattr(args, "command", None) != "eval":
        raise InvalidInputError(f"--out {out}: exists and is not a directory")


def _load(args: argparse.Namespace):
    # INT8 (gsm_jax.quant): GSM then smooths before the per-token activation quantization;
    # the options are checked before the model loads
    import gsm_jax
    from gsm_jax.quant import apply_quantize_option, quantize_option_kwargs

    quant_kwargs = quantize_option_kwargs(args)
    t0 = time.perf_counter()
    params = gsm_jax.load(args.model, dtype=args.dtype,
                          keep_quantized=args.keep_quantized or None, progress=not args.quiet)
    print(f"[gsm-jax] loaded {params} in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
          flush=True)
    params = apply_quantize_option(params, getattr(args, "quantize", "none"), **quant_kwargs)
    return params


def _csv(kind):
    def parse(text: str):
        out = []
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                out.append(kind(item))
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"bad value {item!r}: {e}") from e
        return tuple(out)

    return parse


def _window(item: str):
    return item if item == "adaptive" else int(item)


# ----------------------------------------------------------------------------- profile


def add_profile(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument("--samples", type=int, default=512,
                   help="calibration_samples: sequences to stream")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="high_kurtosis = this top fraction of (layer, site) pairs")
    p.add_argument("--threshold", type=float, default=None,
                   help="high_kurtosis = pairs with excess kurtosis >= this (overrides fraction)")
    p.add_argument("--sigma-mode", choices=["running", "two_pass"], default="running",
                   help="sigma for the 6-sigma share: running (one pass) or two_pass (exact)")
    p.add_argument("--top-channels", type=int, default=8,
                   help="channels with the largest |activation| kept per (layer, site)")
    p.add_argument("--out", type=Path, required=True, help="output directory")


def run_profile(args: argparse.Namespace) -> int:
    from gsm_jax.workflow.profile import profile

    check_files(args)
    params = _load(args)
    prof = profile(params, data=args.data, calibration_samples=args.samples,
                   seq_len=args.seq_len, batch_size=args.batch_size, fraction=args.fraction,
                   threshold=args.threshold, top_channels=args.top_channels,
                   sigma_mode=args.sigma_mode, progress=not args.quiet)
    path = prof.save(args.out)
    print(prof.summary())
    print(f"[gsm-jax] wrote {path} and {path.parent / 'profile_heatmap.png'}")
    return 0


# ----------------------------------------------------------------------------- calibrate


def add_calibrate(p: argparse.ArgumentParser) -> None:
    from gsm_jax.workflow.calibrate import (
        DEFAULT_PROTECT_FIRST_VALUES,
        DEFAULT_STRENGTHS,
        DEFAULT_WINDOWS,
    )

    _model_args(p)
    _lambada_args(p, 200)
    p.add_argument("--profile", type=Path, default=None,
                   help="profile.json of `gsm-jax profile` (needed for "
                        "target_layers=high_kurtosis, the default)")
    p.add_argument("--base-config", type=Path, default=None,
                   help="GSM config file with the other settings (precision, sites, "
                        "max_strength, target_layers, ...; unset: GSMConfig's defaults)")
    p.add_argument("--sequences", type=int, default=16, help="quality-set sequences")
    p.add_argument("--strengths", type=_csv(float),
                   default=DEFAULT_STRENGTHS, help="comma-separated strength grid")
    p.add_argument("--windows", type=_csv(_window), default=DEFAULT_WINDOWS,
                   help="comma-separated windows (integers or 'adaptive')")
    p.add_argument("--protect-first", type=_csv(int), default=DEFAULT_PROTECT_FIRST_VALUES,
                   help="comma-separated protect_first values to compare (leading tokens "
                        "left unsmoothed)")
    p.add_argument("--max-kld", type=float, default=0.01, help="budget: mean KLD <=")
    p.add_argument("--min-top1", type=float, default=97.0, help="budget: same top-1 %% >=")
    p.add_argument("--max-acc-drop", type=float, default=1.0,
                   help="budget: LAMBADA accuracy drop <= (points)")
    p.add_argument("--no-curves", action="store_true",
                   help="stop the strength walk at the first break (no full cost curve)")
    p.add_argument("--no-backoff", action="store_true", help="skip the layer back-off")
    p.add_argument("--out", type=Path, required=True, help="output directory")


def run_calibrate(args: argparse.Namespace) -> int:
    from gsm_jax.workflow.calibrate import (
        BudgetNotMetError,
        CalibrationSpec,
        run_calibration,
    )
    from gsm_jax.workflow.metrics import Budget

    check_files(args)
    budget = Budget(max_mean_kld=args.max_kld, min_same_top1_pct=args.min_top1,
                    max_accuracy_drop_points=args.max_acc_drop)
    params = _load(args)
    try:
        res = run_calibration(params, CalibrationSpec(
            profile=args.profile, base_config=args.base_config, data=args.data,
            lambada=_lambada(args.lambada), budget=budget, strengths=args.strengths,
            windows=args.windows, protect_first_values=args.protect_first,
            num_sequences=args.sequences, seq_len=args.seq_len, batch_size=args.batch_size,
            lambada_samples=args.lambada_samples, greedy_prompts=args.greedy_prompts,
            greedy_tokens=args.greedy_tokens, greedy_prompt_len=args.greedy_prompt_len,
            curves=not args.no_curves, backoff=not args.no_backoff, progress=not args.quiet))
    except BudgetNotMetError as e:
        path = e.result.save(args.out)
        print(e.result.summary())
        print(f"gsm-jax calibrate: {e}\n[gsm-jax] wrote {path} and "
              f"{args.out / 'gsm.best_found.yaml'} (no gsm.yaml: the budget was not met)",
              file=sys.stderr)
        return 3
    path = res.save(args.out)
    print(res.summary())
    print(f"[gsm-jax] wrote {args.out / 'gsm.yaml'}, {path} and the figures in {args.out}")
    return 0


# ----------------------------------------------------------------------------- eval


def add_eval(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    _lambada_args(p, None)
    p.add_argument("--gsm", required=True,
                   help="GSM config file (YAML/JSON); 'none' reports the unsmoothed model")
    p.add_argument("--sequences", type=int, default=32, help="quality-set sequences")
    p.add_argument("--out", type=Path, default=None,
                   help="write the result JSON to this file (unset: print only)")


def run_eval(args: argparse.Namespace) -> int:
    import gsm_jax
    from gsm_jax.workflow.evaluate import evaluate

    check_files(args)
    # the config is read (and validated) before the model loads
    gsm = None if args.gsm.lower() == "none" else gsm_jax.GSMConfig.from_file(args.gsm)
    params = _load(args)
    if gsm is not None:
        print(gsm_jax.describe(gsm, params.config.num_layers), file=sys.stderr)
    res = evaluate(params, gsm, data=args.data, lambada=_lambada(args.lambada),
                   num_sequences=args.sequences, seq_len=args.seq_len,
                   batch_size=args.batch_size, lambada_samples=args.lambada_samples,
                   greedy_prompts=args.greedy_prompts, greedy_tokens=args.greedy_tokens,
                   greedy_prompt_len=args.greedy_prompt_len, progress=not args.quiet)
    print(res.summary())
    if args.out is not None:
        print(f"[gsm-jax] wrote {res.save(args.out)}")
    return 0


# ----------------------------------------------------------------------------- report


def add_report(p: argparse.ArgumentParser) -> None:
    from gsm_jax.workflow.report import ReportSizes

    d = ReportSizes()
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--out", type=Path, default=Path("reports"),
                   help="report folder (the markdown, figures and data/)")
    p.add_argument("--data", default=None,
                   help="UTF-8 text file (unset: the WikiText-2 raw test split shipped with "
                        "the package)")
    p.add_argument("--lambada", default="default",
                   help="LAMBADA jsonl; 'default' = the examples shipped with the package, "
                        "'none' skips the task")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes: check the pipeline in minutes (numbers meaningless)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the measurements already in <out>/data; measure what is missing")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite the markdown from <out>/data of an earlier run (no measuring)")
    for name, kind in (("profile_samples", int), ("profile_seq_len", int),
                       ("cal_sequences", int), ("cal_lambada", int), ("final_sequences", int),
                       ("final_lambada", int), ("seq_len", int), ("batch_size", int),
                       ("greedy_prompts", int), ("greedy_tokens", int), ("overhead_reps", int),
                       ("overhead_steps", int), ("bench_requests", int),
                       ("bench_clients", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"ReportSizes.{name} (unset: {getattr(d, name)}, or the smoke "
                            "size with --smoke)")
    p.add_argument("--strengths", type=_csv(float), default=None,
                   help="comma-separated strength grid of the calibration search (unset: "
                        "the calibrate default)")
    p.add_argument("--windows", type=_csv(_window), default=None,
                   help="comma-separated windows of the search (unset: the calibrate default)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_report(args: argparse.Namespace) -> int:
    import dataclasses

    from gsm_jax.workflow.report import ReportSizes, render_report, run_report

    if args.render_only:
        print(f"[gsm-jax] wrote {render_report(args.out)}")
        return 0
    sizes = ReportSizes.smoke() if args.smoke else ReportSizes()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(sizes)
               if getattr(args, f.name, None) is not None}
    sizes = dataclasses.replace(sizes, **changes)
    check_files(args)
    command = "gsm-jax " + " ".join(shlex.quote(a) for a in sys.argv[1:]) \
        if sys.argv and sys.argv[0].endswith("gsm-jax") else None
    path = run_report(model=args.model, out=args.out, data=args.data,
                      lambada=_lambada(args.lambada), sizes=sizes, command=command,
                      resume=args.resume, progress=not args.quiet)
    print(f"[gsm-jax] wrote {path}")
    return 0


# ----------------------------------------------------------------------------- evidence


def add_evidence(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2-135m,gemma3-270m",
                   help="comma-separated models")
    p.add_argument("--out", type=Path, default=Path("reports"),
                   help="folder of gsm_evidence.md and data/evidence/")
    p.add_argument("--claims", default=None, help="comma-separated claim numbers (default all)")
    p.add_argument("--mesh", default=None,
                   help="DATAxMODEL devices, e.g. 1x8: each model loaded sharded over them "
                   "(what a checkpoint too large for one device needs)")
    p.add_argument("--resume", action="store_true", help="keep claims already measured")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (numbers meaningless)")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite <out>/gsm_evidence.md from the JSON (no measuring)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_evidence(args: argparse.Namespace) -> int:
    from gsm_jax.workflow.evidence.render import render_evidence
    from gsm_jax.workflow.evidence.runner import (
        EvidenceSizes,
        check_models,
        errors,
        parse_claims,
        run_evidence,
    )

    if args.render_only:
        print(f"[gsm-jax] wrote {render_evidence(args.out)}")
        return 0
    from gsm_jax.sharding import parse_mesh_spec

    models, claims = check_models(args.models), parse_claims(args.claims)
    mesh = parse_mesh_spec(args.mesh) if args.mesh else None
    sizes = EvidenceSizes.smoke() if args.smoke else EvidenceSizes()
    path = run_evidence(models, args.out, sizes=sizes, resume=args.resume, claims=claims,
                        smoke=args.smoke, progress=not args.quiet, mesh=mesh)
    print(f"[gsm-jax] wrote {path}")
    failed = errors(args.out, models)
    for f in failed:
        print(f"gsm-jax evidence: a claim failed, see {f}", file=sys.stderr)
    return 1 if failed else 0
