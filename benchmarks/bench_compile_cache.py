"""A second identical `gsm-jax generate` with the persistent compilation cache (issue 24, 2).

    python benchmarks/bench_compile_cache.py --out runs/compile_cache

Runs the command a user runs, `gsm-jax generate --max-new-tokens 32 "<prompt>"` on the
embedded SmolLM2, in fresh processes against one fresh cache folder
(`GSM_JAX_COMPILATION_CACHE=<tmp>`): a first run (cold: everything compiles and is written),
then `--repeats` identical runs (warm: programs load from the cache). Per run it records the
process's wall time, the CLI's "first call ... including compilation" seconds (the
`generate` call that compiles, or loads, its programs), its "compiled run" seconds (the same
call again; the difference is the compile time) and its XLA summary line (programs ready,
seconds, cache hits). A third side, `GSM_JAX_COMPILATION_CACHE=0`, times the same
command with the cache off (what every run cost before). Reported: the warm compile time
over the cold one (target <= 0.2), the same for the first call and the whole process.
The 1-minute load average is recorded around every run (above 1.5: not comparable).

Outputs in --out: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

PROMPT = "The history of the city begins in the early medieval period, when"
FIRST = re.compile(r"first call ([0-9.]+)s including compilation")
RUN = re.compile(r"compiled run ([0-9.]+)s")
XLA = re.compile(r"XLA: (\d+) programs ready in ([0-9.]+) s; (?:(\d+) of them loaded)?")


def run_once(cache: str, new_tokens: int) -> dict:
    env = {**os.environ, "GSM_JAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "gsm_jax.cli", "generate", "--max-new-tokens",
           str(new_tokens), PROMPT]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"gsm-jax generate failed:\n{r.stderr[-3000:]}")
    text = r.stdout + r.stderr
    first, run = FIRST.search(text), RUN.search(text)
    xla = XLA.search(text)
    first_s = float(first.group(1)) if first else None
    run_s = float(run.group(1)) if run else None
    return {"process_s": wall, "first_call_s": first_s, "compiled_run_s": run_s,
            # what the first call spent making its programs ready: the same call again,
            # compiled, took run_s
            "compile_s": first_s - run_s if first_s is not None and run_s is not None
            else None,
            "programs": int(xla.group(1)) if xla else None,
            "xla_s": float(xla.group(2)) if xla else None,
            "cache_hits": int(xla.group(3)) if xla and xla.group(3) else 0,
            "load_1m": [load0, os.getloadavg()[0]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/compile_cache", help="output folder")
    ap.add_argument("--repeats", type=int, default=3, help="warm runs (and cache-off runs)")
    ap.add_argument("--new-tokens", type=int, default=32, help="--max-new-tokens of the command")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()
    with tempfile.TemporaryDirectory(prefix="gsm_jax_bench_cache_") as cache:
        print("[bench] cold run (empty cache) ...", flush=True)
        cold = run_once(cache, args.new_tokens)
        warm, off = [], []
        for i in range(args.repeats):  # interleaved: the same background load for both
            print(f"[bench] warm run {i + 1} / cache off run {i + 1} ...", flush=True)
            warm.append(run_once(cache, args.new_tokens))
            off.append(run_once("0", args.new_tokens))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    summary = {
        "cold_first_call_s": cold["first_call_s"], "cold_process_s": cold["process_s"],
        "warm_first_call_s": med(warm, "first_call_s"), "warm_process_s": med(warm, "process_s"),
        "off_first_call_s": med(off, "first_call_s"), "off_process_s": med(off, "process_s"),
        "cold_compile_s": cold["compile_s"], "warm_compile_s": med(warm, "compile_s"),
        "off_compile_s": med(off, "compile_s"),
    }
    summary["warm_vs_cold_compile"] = summary["warm_compile_s"] / cold["compile_s"]
    summary["target_compile_le_0.2"] = summary["warm_vs_cold_compile"] <= 0.2
    summary["warm_vs_cold_first_call"] = summary["warm_first_call_s"] / cold["first_call_s"]
    summary["warm_vs_cold_process"] = summary["warm_process_s"] / cold["process_s"]
    loads = [x for r in [cold, *warm, *off] for x in r["load_1m"]]
    summary["max_load_1m"] = max(loads)
    summary["comparable"] = max(loads) <= 1.5
    res = {"command": f"gsm-jax generate --max-new-tokens {args.new_tokens} <prompt>",
           "machine": machine, "cold": cold, "warm": warm, "cache_off": off,
           "summary": summary}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    rows = [("cold (empty cache)", cold), *((f"warm {i + 1}", r) for i, r in enumerate(warm)),
            *((f"cache off {i + 1}", r) for i, r in enumerate(off))]
    md = ["| run | process s | first call s (incl. compile) | compiled run s | compile s "
          "| programs | XLA s | cache hits |", "|---|---|---|---|---|---|---|---|"]
    md += [f"| {n} | {r['process_s']:.1f} | {r['first_call_s']} | {r['compiled_run_s']} | "
           f"{r['compile_s']:.2f} | {r['programs']} | {r['xla_s']} | {r['cache_hits']} |"
           for n, r in rows]
    md.append(f"\nwarm / cold compile time (first call minus the compiled run): "
              f"{summary['warm_vs_cold_compile']:.3f} (target <= 0.2); warm / cold first call: "
              f"{summary['warm_vs_cold_first_call']:.3f};"
              f" warm / cold process: {summary['warm_vs_cold_process']:.3f}; max load "
              f"{summary['max_load_1m']:.2f}{'' if summary['comparable'] else ' (NOT comparable)'}")
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [n for n, _ in rows]
    ax.barh(names, [r["process_s"] for _, r in rows], label="whole process", color="#bbb")
    ax.barh(names, [r["first_call_s"] or 0 for _, r in rows],
            label="first generate call", color="#3a7")
    ax.barh(names, [r["compile_s"] or 0 for _, r in rows], height=0.4,
            label="of which compile / cache load", color="#c52")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("gsm-jax generate: persistent compilation cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
