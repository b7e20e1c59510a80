"""GSM_SPEC.md section 7, question 3 on SmolLM2: does GSM lower the W8A8 quality loss?

Variants, each compared with fp32 on the same tokens (KL(fp32 || variant), llama.cpp's
direction): fp32 (itself: KLD 0), w8a16, w8a8, w8a8+GSM (calibrated), w8a8+SmoothQuant,
w8a8+SmoothQuant+GSM (calibrated), and w8a8+SmoothQuant+Hadamard(down).

Data (packaged, gsm_jax/data): calibration = the first `--calib-sequences` x `--seq-len`
tokens of WikiText-2 (SmoothQuant statistics, its alpha search and the GSM calibration);
evaluation = the last `--eval-sequences` x `--seq-len` tokens (disjoint) and the first
`--lambada-samples` LAMBADA dev examples.

GSM calibration (gsm_jax.quant_quality.calibrate_gsm_vs_reference) minimises the
quantized model's KLD against fp32: every (layer, site) pair alone, the helpful ones
combined greedily, then strength and window. If nothing helps, "calibrated GSM" is
no GSM, and the table says so.

    python benchmarks/quant_quality.py --out runs/quant_quality
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    machine_info,
    markdown_table,
    write_json,
    write_markdown,
)

import gsm_jax  # noqa: E402
from gsm_jax.quant import activation_absmax, activation_samples, quantize  # noqa: E402
from gsm_jax.workflow.data import load_wikitext_sequences  # noqa: E402
from gsm_jax.workflow.evidence.quant_quality import (  # noqa: E402
    ALPHA_GRID,
    ReferenceKLD,
    Variant,
    calibrate_gsm_vs_reference,
    local_smoothquant_alphas,
    quality_table,
    search_smoothquant_alphas,
    smoothquant_params,
)


def log(msg: str) -> None:
    print(f"[quant_quality] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/quant_quality"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib-sequences", type=int, default=16)
    ap.add_argument("--search-sequences", type=int, default=8,
                    help="calibration sequences used for the alpha / GSM decisions")
    ap.add_argument("--screen-sequences", type=int, default=4,
                    help="calibration sequences used to screen GSM (layer, site) pairs")
    ap.add_argument("--local-sequences", type=int, default=4,
                    help="calibration sequences whose activations drive the per-layer alphas")
    ap.add_argument("--eval-sequences", type=int, default=32)
    ap.add_argument("--lambada-samples", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--hadamard-block", type=int, default=512)
    ap.add_argument("--skip-gsm", action="store_true", help="leave out the GSM calibration")
    ap.add_argument("--render-only", action="store_true",
                    help="re-render results.md / results.png from OUT/results.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        import json

        print(render(json.loads((args.out / "results.json").read_text()), args.out))
        return 0
    t0 = time.perf_counter()
    info = machine_info()
    p = gsm_jax.load(args.model)
    tok = p.tokenizer
    calib = load_wikitext_sequences(tok, seq_len=args.seq_len,
                                    num_sequences=args.calib_sequences)
    evals = load_wikitext_sequences(tok, seq_len=args.seq_len,
                                    num_sequences=args.eval_sequences, from_end=True)
    search = ReferenceKLD(p, calib[: args.search_sequences], args.batch_size)
    screen = ReferenceKLD(p, calib[: args.screen_sequences], args.batch_size)
    timings: dict[str, float] = {}

    log("SmoothQuant: activation statistics on the calibration set")
    t = time.perf_counter()
    absmax = activation_absmax(p, calib, batch_size=args.batch_size)
    alphas, alpha_trials = search_smoothquant_alphas(p, absmax, search, log=log)
    # per layer: each linear's own W8A8 output error on a few calibration sequences;
    # kept only if it also lowers the whole model's calibration KLD
    local_alphas, local_errors = local_smoothquant_alphas(
        p, absmax, activation_samples(p, calib[: args.local_sequences]), log=log)
    kld_kind = min(t["kld"] for t in alpha_trials)
    kld_local = search(quantize(smoothquant_params(p, absmax, local_alphas), "w8a8"))
    log(f"  calibration KLD: alpha per kind {kld_kind:.5f}, per layer {kld_local:.5f}")
    alpha_choice = "per layer" if kld_local < kld_kind else "per kind"
    if kld_local < kld_kind:
        alphas = local_alphas
    sq = smoothquant_params(p, absmax, alphas)
    timings["smoothquant"] = time.perf_counter() - t

    w8a16, w8a8, w8a8_sq = quantize(p, "w8a16"), quantize(p, "w8a8"), quantize(sq, "w8a8")
    w8a8_sq_had = quantize(sq, "w8a8", hadamard_down=args.hadamard_block)
    gsm_runs = {}
    if not args.skip_gsm:
        for name, params in (("w8a8", w8a8), ("w8a8+SmoothQuant", w8a8_sq)):
            log(f"GSM calibration on {name}")
            t = time.perf_counter()
            gsm_runs[name] = calibrate_gsm_vs_reference(params, search, screen_kld=screen,
                                                        log=log)
            timings[f"gsm calibration {name}"] = time.perf_counter() - t

    def gsm_note(name):
        run = gsm_runs.get(name)
        if run is None:
            return "not run"
        if run["config"] is None:
            return "calibration found no (layer, site) where GSM helps: smooths nothing"
        c = run["config"]
        n_pairs = sum(len(v) for v in c.target_layers.values())
        return (f"{n_pairs} (layer, site) pairs, strength {c.smooth_strength}, window "
                f"{c.window_size}, protect_first {c.protect_first}")

    variants = [
        Variant("fp32", p, None, "reference"),
        Variant("w8a16", w8a16, None, "int8 weights, per-channel scales"),
        Variant("w8a8", w8a8, None, "plus per-token int8 activations"),
    ]
    if "w8a8" in gsm_runs:
        variants.append(Variant("w8a8+GSM (calibrated)", w8a8, gsm_runs["w8a8"]["config"],
                                gsm_note("w8a8")))
    variants.append(Variant("w8a8+SmoothQuant", w8a8_sq, None, _alpha_note(alphas)))
    if "w8a8+SmoothQuant" in gsm_runs:
        variants.append(Variant("w8a8+SmoothQuant+GSM (calibrated)", w8a8_sq,
                                gsm_runs["w8a8+SmoothQuant"]["config"],
                                gsm_note("w8a8+SmoothQuant")))
    variants.append(Variant(f"w8a8+SmoothQuant+Hadamard{args.hadamard_block}(down)",
                            w8a8_sq_had, None, "online block-Hadamard rotation of the down "
                            "projection input (QuaRot-style)"))

    log(f"evaluating {len(variants)} variants on {len(evals)} x {args.seq_len} tokens "
        f"and {args.lambada_samples} LAMBADA examples")
    t = time.perf_counter()
    table = quality_table(p, variants, evals, batch_size=args.batch_size,
                          lambada_samples=args.lambada_samples, log=log)
    timings["evaluation"] = time.perf_counter() - t

    data = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": {"calibration": f"WikiText-2 test, first {args.calib_sequences} x "
                                f"{args.seq_len} tokens",
                 "evaluation": f"WikiText-2 test, last {args.eval_sequences} x "
                               f"{args.seq_len} tokens",
                 "lambada": f"first {args.lambada_samples} of the packaged lambada_dev.jsonl"},
        "smoothquant": {
            "alphas": {k: np.asarray(v).tolist() for k, v in alphas.items()},
            "choice": alpha_choice, "trials": alpha_trials,
            "calibration_kld": {"per kind": kld_kind, "per layer": kld_local},
            "per_layer": {"alphas": {k: v.tolist() for k, v in local_alphas.items()},
                          "grid": list(ALPHA_GRID),
                          "relative_output_error": {k: v.tolist()
                                                    for k, v in local_errors.items()}}},
        "gsm_calibration": {k: {**v, "config": None if v["config"] is None
                                else v["config"].to_dict()} for k, v in gsm_runs.items()},
        "table": table, "timings_s": timings, "machine_before": info,
        "machine_after": machine_info(), "total_seconds": time.perf_counter() - t0,
    }
    write_json(args.out / "results.json", data)
    md = render(data, args.out)
    print(md)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


def _alpha_note(alphas: dict) -> str:
    parts = []
    for k, v in alphas.items():
        v = np.asarray(v, float)
        parts.append(f"{k} {v:.1f}" if v.ndim == 0 else
                     f"{k} {v.min():.1f}–{v.max():.1f} (mean {v.mean():.2f})")
    per_layer = any(np.ndim(v) for v in alphas.values())
    return ("alpha per layer (local W8A8 error): " if per_layer else "alpha per linear: ") + \
        ", ".join(parts)


def quality_chart(table: list[dict], path: Path, title: str) -> None:
    """Horizontal bars of mean KLD vs fp32 (± s.e.), with the 0.01 target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in table][::-1]
    kld = [r["quality"]["mean_kld"] for r in table][::-1]
    err = [r["quality"]["mean_kld_stderr"] for r in table][::-1]
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(names) + 1.4))
    ax.barh(names, kld, xerr=err, color="tab:blue")
    for y, v in enumerate(kld):
        ax.annotate(f"{v:.4f}", (v, y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.axvline(0.01, color="tab:red", ls="--", lw=1, label="target 0.01")
    ax.set_xlabel("mean KLD vs fp32 (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(data: dict, out: Path) -> str:
    cfg, table = data["config"], data["table"]
    headers = ["variant", "mean KLD vs fp32", "± s.e.", "p99 KLD", "same top-1 %",
               "PPL", "PPL / fp32", "LAMBADA acc %", "note"]
    rows = []
    for r in table:
        q = r["quality"]
        rows.append([r["variant"], f"{q['mean_kld']:.5f}", f"{q['mean_kld_stderr']:.5f}",
                     f"{q['p99_kld']:.4f}", f"{q['same_top1_pct']:.2f}", f"{q['ppl']:.3f}",
                     f"{q['ppl_ratio']:.4f}",
                     "—" if r["lambada_accuracy_pct"] is None
                     else f"{r['lambada_accuracy_pct']:.1f}", r["note"]])
    md = markdown_table(headers, rows)
    end = data.get("machine_after", {}).get("load_average_1_5_15")
    write_markdown(out / "results.md",
                   f"# INT8 quality against fp32 ({cfg['model']}), spec §7 question 3\n\n"
                   f"WikiText-2: last {cfg['eval_sequences']} x {cfg['seq_len']} tokens; "
                   f"LAMBADA: first {cfg['lambada_samples']} dev examples. Calibration "
                   f"(SmoothQuant statistics and alphas, GSM): first {cfg['calib_sequences']} "
                   f"x {cfg['seq_len']} WikiText-2 tokens. Load average at the end {end}.\n\n"
                   f"{md}\n")
    quality_chart(table, out / "results.png",
                  f"{cfg['model']}: INT8 quality against fp32 (WikiText-2)")
    return md


if __name__ == "__main__":
    sys.exit(main())
