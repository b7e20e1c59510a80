"""The same benchmark on two versions of the library, interleaved in one run: before vs after.

    python benchmarks/bench_before_after.py --ref d69c257 --out runs/before_after \\
        --rounds 2 -- benchmarks/bench_generate.py --skip-transformers --threads 1 --repeats 3

The benchmark script and its measuring code are this checkout's; only the library it imports
differs. `--ref` is checked out into a temporary git worktree; both trees are imported from
their sources (PYTHONPATH, with `gsm_jax/models` and `gsm_jax/pallas_kernels` linked to the
root folders as the installed package maps them), so neither side uses the editable install.
Rounds alternate the sides (before, after, after, before, ...) so both see the same
background load; every figure the benchmark writes to its results.json is collected, and
the report gives, per numeric leaf, the median of each side and after / before. The 1-minute
load average is recorded before and after every run (a figure taken above 1.5 is not
comparable).

Outputs in --out: results.json (both sides' raw results and the ratios), results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOAD_LIMIT = 1.5


def _source_tree(src: Path, dst: Path) -> Path:
    """A folder importable as `gsm_jax` from `src` (a checkout): gsm_jax/ with models and
    pallas_kernels inside, as the installed package maps them. Copied, not linked: a snapshot
    taken when the run starts, so edits made to the checkout while it runs are not measured."""
    pkg = dst / "gsm_jax"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(src / "gsm_jax", pkg, ignore=skip)
    for sub in ("models", "pallas_kernels"):
        shutil.copytree(src / sub, pkg / sub, ignore=skip)
    return dst


def _worktree(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref],
                   check=True, capture_output=True)
    return where


def _leaves(x: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(x, dict):
        for k, v in x.items():
            out.update(_leaves(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out.update(_leaves(v, f"{prefix}[{i}]"))
    elif isinstance(x, int | float) and not isinstance(x, bool):
        out[prefix] = float(x)
    return out


def run_side(tree: Path, bench: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    cmd = [sys.executable, str(ROOT / bench[0]), *bench[1:], "--out", str(out)]
    r = subprocess.run(cmd, env=env, cwd=str(ROOT / "benchmarks"), capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise SystemExit(f"benchmark failed in {tree}:\n{r.stderr[-3000:]}")
    res = json.loads((out / "results.json").read_text())
    return {"results": res, "wall_s": time.perf_counter() - t0,
            "load_1m": [load0, os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the 'before' git ref (commit, tag, branch)")
    ap.add_argument("--out", type=Path, default=Path("runs/before_after"))
    ap.add_argument("--rounds", type=int, default=2, help="runs per side (alternated)")
    ap.add_argument("bench", nargs=argparse.REMAINDER,
                    help="-- then the benchmark script (relative to the repo) and its flags")
    args = ap.parse_args(argv)
    bench = [a for a in args.bench if a != "--"]
    if not bench:
        ap.error("give the benchmark after --, e.g. -- benchmarks/bench_gsm_overhead.py")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gsm_before_after_"))
    try:
        wt = _worktree(args.ref, tmp / "checkout")
        trees = {"before": _source_tree(wt, tmp / "before"),
                 "after": _source_tree(ROOT, tmp / "after")}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        order = []
        for r in range(args.rounds):
            order += ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for i, side in enumerate(order):
            print(f"[before_after] run {i + 1}/{len(order)}: {side}", file=sys.stderr,
                  flush=True)
            runs[side].append(run_side(trees[side], bench, tmp / f"run{i}"))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(tmp / "checkout")], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    leaves = {s: [_leaves(x["results"]) for x in v] for s, v in runs.items()}
    keys = sorted(set.intersection(*(set(d) for v in leaves.values() for d in v)))
    table = {}
    for k in keys:
        b = statistics.median(d[k] for d in leaves["before"])
        a = statistics.median(d[k] for d in leaves["after"])
        table[k] = {"before": b, "after": a, "after_over_before": a / b if b else None}
    loads = [x for v in runs.values() for r in v for x in r["load_1m"]]
    res = {"ref": args.ref, "bench": bench, "rounds": args.rounds, "order": order,
           "max_load_1m": max(loads), "comparable": max(loads) <= LOAD_LIMIT,
           "runs": runs, "metrics": table}
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    lines = [f"# before ({args.ref}) vs after: `{' '.join(bench)}`\n",
             f"{args.rounds} runs per side, alternated; max 1-minute load {max(loads):.2f}"
             + ("" if res["comparable"] else " (NOT comparable: above 1.5)") + "\n",
             "| metric | before | after | after / before |", "|---|---|---|---|"]
    for k, v in table.items():
        if "/values[" in k or k.startswith(("prompts/", "settings/", "machine/")):
            continue  # inputs and per-repeat values: in results.json only
        ratio = v["after_over_before"]
        lines.append(f"| {k} | {v['before']:.6g} | {v['after']:.6g} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
