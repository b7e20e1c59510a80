"""KV cache in int8 / FP8 against the float cache: quality and decode speed, one run.

    python benchmarks/bench_kv_cache.py --out reports/data/kv_cache          # both models
    python benchmarks/bench_kv_cache.py --models smollm2-135m --windows 4 --batches 1 \
        --repeats 1 --out /tmp/kv                                           # smoke run

Quality: teacher-forced logits of WikiText-2 windows (the packaged test split) with the
rounded cache (`gsm_jax.with_kv_cache_dtype`: every key and value a query sees is rounded,
as the cached decode reads them) against the float cache: mean KL(float || rounded) per
token, its standard error over windows, top-1 agreement. Budget: mean KLD <= 0.005.

Speed: the whole `generate_tokens` call, greedy, random prompts of --prompt-len tokens; a
1-token and an N-token call timed as neighbours in each round (arms interleaved,
alternating order), decode = (long - short) / (N - 1) steps; each arm as a ratio against the
float cache measured in the same rounds. The load average is recorded before and after;
a figure taken above 1.5 is marked not comparable.

Writes results.json, results.md and results.png (KLD per model and format against the
budget; decode tokens/s ratio against float per batch) under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

KLD_BUDGET = 0.005
MAX_COMPARABLE_LOAD = 1.5


def quality(params, kinds, windows: int, window_len: int, batch: int = 4) -> dict:
    import gsm_jax
    from gsm_jax.workflow.data import default_wikitext_path
    from gsm_jax.workflow.metrics import kl_divergence

    ids = params.tokenizer.encode(default_wikitext_path().read_text()[:400_000])
    n = min(windows, len(ids) // window_len)
    rows = [ids[i * window_len:(i + 1) * window_len] for i in range(n)]
    out = {k: {"kld": [], "top1": []} for k in kinds}
    for s in range(0, n, batch):
        chunk = rows[s:s + batch]
        ref = np.asarray(gsm_jax.forward(params, chunk))
        for k in kinds:
            got = np.asarray(gsm_jax.forward(gsm_jax.with_kv_cache_dtype(params, k), chunk))
            for r in range(len(chunk)):
                out[k]["kld"].append(float(kl_divergence(ref[r], got[r]).mean()))
                out[k]["top1"].append(float((ref[r].argmax(-1) == got[r].argmax(-1)).mean()))
        print(f"[bench_kv_cache] quality: {s + len(chunk)}/{n} windows", file=sys.stderr,
              flush=True)
    res = {}
    for k, v in out.items():
        kld = np.asarray(v["kld"])
        res[k] = {"mean_kld": float(kld.mean()),
                  "kld_stderr": float(kld.std(ddof=1) / np.sqrt(kld.size)) if kld.size > 1
                  else None,
                  "same_top1_pct": 100 * float(np.mean(v["top1"])),
                  "within_budget": bool(kld.mean() <= KLD_BUDGET), "windows": int(kld.size)}
    return res


def speed(params, kinds, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import gsm_jax

    arms = {"float": params} | {k: gsm_jax.with_kv_cache_dtype(params, k) for k in kinds}
    out = common.measure_decode(arms, batch, prompt_len, new_tokens, repeats,
                                params.config.vocab_size, max_load=MAX_COMPARABLE_LOAD)
    out["arms"] = out.pop("variants")
    f = out["arms"]["float"]["decode_tok_s"]
    for a in out["arms"].values():
        a["ratio_vs_float"] = a["decode_tok_s"] / f if f and a["decode_tok_s"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--kinds", default="int8,fp8")
    ap.add_argument("--windows", type=int, default=32, help="WikiText-2 windows scored")
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench_kv_cache")
    ap.add_argument("--render-only", action="store_true",
                    help="re-render results.md / .png from --out's results.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render_only:
        render(out, json.loads((out / "results.json").read_text()))
        return 0
    import gsm_jax
    from gsm_jax.models.common import KV_CACHE_DTYPES

    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KV_CACHE_DTYPES):
        raise SystemExit(f"--kinds: a comma list of {sorted(KV_CACHE_DTYPES)} (the float "
                         f"cache is always measured); got {args.kinds!r}")
    batches = [int(b) for b in args.batches.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": common.machine_info(), "args": vars(args), "kld_budget": KLD_BUDGET,
              "models": {}}
    for name in args.models.split(","):
        print(f"[bench_kv_cache] {name}: loading", file=sys.stderr, flush=True)
        params = gsm_jax.load(name, dtype="float32")
        r = {"quality": quality(params, kinds, args.windows, args.window_len), "speed": {}}
        for b in batches:
            print(f"[bench_kv_cache] {name}: decode speed, batch {b}", file=sys.stderr,
                  flush=True)
            r["speed"][str(b)] = speed(params, kinds, b, args.prompt_len, args.new_tokens,
                                       args.repeats)
        result["models"][name] = r
        common.write_json(out / "results.json", result)
    render(out, result)
    print((out / "results.md").read_text())
    return 0


def render(out: Path, r: dict) -> None:
    a = r["args"]
    lines = ["# KV cache in int8 / FP8 against the float cache\n",
             f"`python benchmarks/bench_kv_cache.py --models {a['models']} --kinds {a['kinds']}"
             f" --windows {a['windows']} --batches {a['batches']} --out {a['out']}`; "
             f"{r['machine'].get('cpu_model', '')}. Quality: {a['windows']} WikiText-2 windows of "
             f"{a['window_len']} tokens, mean KL(float || rounded) per token (budget "
             f"{r['kld_budget']}). Speed: whole `generate_tokens` calls, decode of "
             f"{a['new_tokens'] - 1} tokens after a {a['prompt_len']}-token prompt, median "
             f"of {a['repeats']} interleaved rounds, float32 weights.\n",
             "| model | cache | mean KLD | ± s.e. | same top-1 | within budget | "
             + " | ".join(f"decode tok/s b{b} (x float)" for b in a["batches"].split(","))
             + " |",
             "|---|---|---|---|---|---|" + "---|" * len(a["batches"].split(","))]
    for model, m in r["models"].items():
        for arm in ["float", *m["quality"]]:
            q = m["quality"].get(arm)
            cells = ["0", "", "100%", "yes"] if q is None else [
                f"{q['mean_kld']:.2e}", f"{q['kld_stderr']:.1e}" if q["kld_stderr"] else "",
                f"{q['same_top1_pct']:.2f}%", "yes" if q["within_budget"] else "**no**"]
            for s in m["speed"].values():
                x = s["arms"][arm]
                t = x["decode_tok_s"]
                cells.append("n/a" if t is None else f"{t:.1f} ({x['ratio_vs_float']:.2f}x)"
                             + ("" if s["comparable"] else " *load*"))
            lines.append(f"| {model} | {arm} | " + " | ".join(cells) + " |")
    loads = [f"{m}: b{b} {s['load_average_before']} -> {s['load_average_after']}"
             for m, x in r["models"].items() for b, s in x["speed"].items()]
    lines.append("\nLoad average (1, 5, 15 min) before -> after each speed block: "
                 + "; ".join(loads) + ". *load*: above 1.5, not comparable.")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _figure(out / "results.png", r)


def _figure(path: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(r["models"])
    kinds = [k for k in r["args"]["kinds"].split(",") if k]
    batches = r["args"]["batches"].split(",")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(kinds), 1)
    for i, k in enumerate(kinds):
        vals = [r["models"][m]["quality"][k]["mean_kld"] for m in models]
        errs = [r["models"][m]["quality"][k]["kld_stderr"] or 0 for m in models]
        ax1.bar(np.arange(len(models)) + i * width, vals, width, yerr=errs, label=k)
    ax1.axhline(r["kld_budget"], color="k", ls="--", lw=1, label="budget")
    ax1.set_xticks(np.arange(len(models)) + width * (len(kinds) - 1) / 2, models)
    ax1.set_ylabel("mean KLD vs float cache")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title("quality (WikiText-2)")
    arms = ["float", *kinds]
    labels = [f"{m}\nb{b}" for m in models for b in batches]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        vals = [r["models"][m]["speed"][b]["arms"][arm]["ratio_vs_float"] or 0
                for m in models for b in batches]
        ax2.bar(np.arange(len(labels)) + i * width, vals, width, label=arm)
    ax2.axhline(1.0, color="k", lw=1)
    ax2.set_xticks(np.arange(len(labels)) + width * (len(arms) - 1) / 2, labels)
    ax2.set_ylabel("decode tokens/s, x float cache")
    ax2.legend()
    ax2.set_title("speed (whole generate call)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
