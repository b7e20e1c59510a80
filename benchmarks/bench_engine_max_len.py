"""The serving engine's decode step vs its `--max-len`, rows holding 64 tokens (issue 24, 4).

    python benchmarks/bench_engine_max_len.py --out runs/engine_max_len --threads 1

One `gsm_jax.serving.Engine` per (batch, max_len, reads), SmolLM2 (`--model`), GSM
compiled out, greedy, EOS ignored:

- batch 1 and 8 (`--batches`), max_len 256 / 2048 / 8192 (`--max-lens`);
- reads "bounded": the engine as it ships (each step attends over the power of two
  above its longest row, at least `min_attend` 128); "whole": `min_attend=None`, every
  step reads all max_len slots (the engine before bounded reads), for comparison.

Every row gets a 64-token prompt; after the prefill and two untimed decode steps, one
timed sample is one `Engine.step()` (a decode step of every row: the program, the token
choice and the host bookkeeping). The engines of one batch size are stepped in turn,
round after round, the order reversed every other round (interleaved: the same
background load for all); the rows hold 64 + a few tokens throughout (`--repeats` <= 50
keeps them under 128). Reported: the median step time per engine and its ratio to the
bounded engine at max_len 256; target: <= 1.15 at 8192 (bounded), i.e. the step costs
the same whatever max_len. The load average is recorded before and after each batch
size; above 1.5 the figures are marked not comparable. `--threads 1` pins the process
to one core (before XLA starts). `--quick`: batch 1, max_len 256 and 2048, 3 repeats,
a smoke run of the script, not a measurement.

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before XLA sizes its pool

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    bar_chart,
    load_average,
    machine_info,
    markdown_table,
    write_json,
    write_markdown,
)

import gsm_jax  # noqa: E402
from gsm_jax.serving.engine import Engine, Request  # noqa: E402

HELD = 64  # tokens each row holds when the timing starts
TARGET = 1.15  # step at max_len 8192 / step at 256, bounded reads
MAX_COMPARABLE_LOAD = 1.5
READS = {"bounded": 128, "whole": None}  # min_attend of each side


def _engine(params, batch: int, max_len: int, min_attend: int | None, new_tokens: int):
    """An engine whose `batch` rows hold HELD tokens and decode at every step."""
    eng = Engine(params, max_batch=batch, max_len=max_len, eos_ids=[], min_attend=min_attend,
                 prefill_chunk=None)
    rng = np.random.default_rng(batch)
    vocab = params.config.vocab_size
    for i in range(batch):
        eng.submit(Request(rng.integers(2, vocab, HELD).tolist(), new_tokens,
                           request_id=f"b{batch}-{i}", ignore_eos=True))
    while eng.num_waiting:  # admit every row (each admission step also decodes)
        eng.step()
    for _ in range(2):  # untimed: every program compiled, caches warm
        eng.step()
    return eng


def _held(eng) -> int:
    return max(r.prompt_len + r.n_tokens - 1 for r in eng.slots if r is not None)


def run_batch(params, batch: int, max_lens: list[int], repeats: int) -> dict:
    import time

    new_tokens = repeats + batch + 8
    engines = {(reads, n): _engine(params, batch, n, min_attend, new_tokens)
               for n in max_lens for reads, min_attend in READS.items()}
    bounds = {f"{reads}@{n}": e.attend_bound(_held(e)) for (reads, n), e in engines.items()}
    names = list(engines)
    times: dict = {k: [] for k in names}
    load_before = load_average()
    for r in range(repeats):
        for key in names if r % 2 == 0 else names[::-1]:
            eng = engines[key]
            t = time.perf_counter()
            eng.step()  # blocks: the tokens reach the host
            times[key].append(time.perf_counter() - t)
    load_after = load_average()
    held_end = max(_held(e) for e in engines.values())
    for eng in engines.values():
        assert eng.num_active == batch, "a row finished during the timing"
    del engines
    return {"times": times, "bounds_at_start": bounds, "held_at_end": held_end,
            "load_average_before": load_before, "load_average_after": load_after}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/engine_max_len"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-lens", default="256,2048,8192")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, choices=(1,), default=None,
                    help="1: pin to one core (read before jax starts)")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1, max_len 256 and 2048, 3 repeats: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.max_lens, args.repeats = "1", "256,2048", 3
    batches = [int(b) for b in args.batches.split(",")]
    max_lens = sorted(int(n) for n in args.max_lens.split(","))
    if not 1 <= args.repeats <= 50:
        raise SystemExit(f"--repeats must be in [1, 50] (rows stay under 128 tokens), "
                         f"got {args.repeats}")
    args.out.mkdir(parents=True, exist_ok=True)
    info_before = machine_info()
    params = gsm_jax.load(args.model, progress=True)
    base_len = max_lens[0]
    results, rows = {}, []
    for batch in batches:
        print(f"[bench] batch {batch}, max_len {max_lens} ...", flush=True)
        res = run_batch(params, batch, max_lens, args.repeats)
        comparable = max((res["load_average_before"] or [0])[0],
                         (res["load_average_after"] or [0])[0]) <= MAX_COMPARABLE_LOAD
        base = float(np.median(res["times"][("bounded", base_len)]))
        cases = {}
        for (reads, n), t in res["times"].items():
            med = float(np.median(t))
            ratio = med / base
            cases[f"{reads}@{n}"] = {"reads": reads, "max_len": n, "step_s": t,
                                     "median_step_s": med, f"ratio_vs_bounded_{base_len}": ratio}
            verdict = ""
            if reads == "bounded" and n == max(max_lens) and n > base_len:
                verdict = "pass" if ratio <= TARGET else "FAIL"
            rows.append([batch, n, reads, res["bounds_at_start"][f"{reads}@{n}"] or n,
                         f"{med * 1e3:.2f}", f"{ratio:.2f}x", verdict,
                         "yes" if comparable else "NO (load > 1.5)"])
        results[f"batch {batch}"] = {**{k: v for k, v in res.items() if k != "times"},
                                     "comparable": comparable, "cases": cases}
    data = {"config": {"model": args.model, "batches": batches, "max_lens": max_lens,
                       "held_tokens": HELD, "repeats": args.repeats, "threads": args.threads,
                       "quick": args.quick, "reads": {k: {"min_attend": v}
                                                      for k, v in READS.items()},
                       "target": f"bounded step at max_len {max(max_lens)} / at {base_len} "
                                 f"<= {TARGET}"},
            "machine_before": info_before, "machine_after": machine_info(), "results": results}
    write_json(args.out / "results.json", data)
    headers = ["batch", "max_len", "reads", "slots read", "median step ms",
               f"vs bounded@{base_len}", f"target <= {TARGET}x", "comparable"]
    table = markdown_table(headers, rows)
    write_markdown(args.out / "results.md",
                   f"# Engine decode step vs max_len ({args.model}, rows holding {HELD} "
                   f"tokens, threads {args.threads or 'all'})\n\n"
                   f"Medians of {args.repeats} interleaved `Engine.step()` calls per engine; "
                   f"load average before {info_before.get('load_average_1_5_15')}, after "
                   f"{data['machine_after'].get('load_average_1_5_15')}."
                   f"{' Quick smoke run: not a measurement.' if args.quick else ''}\n\n"
                   f"{table}\n")
    groups = [f"b{r[0]} @{r[1]}" for r in rows if r[2] == "bounded"]
    bar_chart(args.out / "results.png", groups,
              {reads: [float(r[4]) for r in rows if r[2] == reads] for reads in READS},
              title=f"Engine decode step, rows holding {HELD} tokens (ms, lower is better)",
              ylabel="ms")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
