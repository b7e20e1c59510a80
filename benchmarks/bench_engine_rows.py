"""The serving engine's decode step against the rows it runs (row bounds, issue 24 item 4).

    python benchmarks/bench_engine_rows.py --out reports/data/engine_rows
    python benchmarks/bench_engine_rows.py --quick --out /tmp/engine_rows   # smoke run

Two measurements, SmolLM2 (`--model`), GSM compiled out, greedy, EOS ignored, every row
holding 64 tokens when the timing starts (one timed sample = one `Engine.step()`: the
decode program, the token choice and the host bookkeeping):

1. **cost against batch**: engines of max_batch 1, 2, 4, 8, 16 with every slot running
   (the whole batch every step): how a step's cost grows with the rows it computes. On a
   CPU the weights dominate a small batch's step, so the curve is flat at first; it is
   what `engine.ROW_BOUND_FACTOR` (row bounds 1, 4, 16, ...) is chosen against.
2. **row bounds**: an engine of the server's default max_batch (16, max_len 2048) with k
   running rows in its lowest slots (k = 1, 4), with row bounds (the shipped engine: the
   step runs the first 1 or 4 slots) and without (`bound_rows=False`: all 16 every step).
   Reported: the ratio without / with.

All engines of a measurement are stepped in turn, round after round, the order reversed
every other round (interleaved); `--repeats` <= 50 keeps the rows under 128 tokens. The
load average is recorded before and after each measurement (above 1.5: not comparable).

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)
import numpy as np  # noqa: E402

HELD = 64
MAX_COMPARABLE_LOAD = 1.5


def _engine(params, max_batch: int, rows: int, bound_rows: bool, new_tokens: int,
            max_len: int):
    """An engine of `max_batch` slots whose first `rows` slots hold HELD tokens and decode."""
    from gsm_jax.serving.engine import Engine, Request

    eng = Engine(params, max_batch=max_batch, max_len=max_len, eos_ids=[],
                 prefill_chunk=None, bound_rows=bound_rows)
    rng = np.random.default_rng(rows)
    vocab = params.config.vocab_size
    for i in range(rows):
        eng.submit(Request(rng.integers(2, vocab, HELD).tolist(), new_tokens,
                           request_id=f"r{i}", ignore_eos=True))
    while eng.num_waiting:
        eng.step()
    for _ in range(2):  # untimed: compiled, warm
        eng.step()
    assert [s is not None for s in eng.slots[:rows]] == [True] * rows
    return eng


def interleave(engines: dict, repeats: int) -> dict:
    times = {k: [] for k in engines}
    names = list(engines)
    load_before = common.load_average()
    for r in range(repeats):
        for key in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            engines[key].step()
            times[key].append(time.perf_counter() - t)
    load_after = common.load_average()
    comparable = max((load_before or [0])[0], (load_after or [0])[0]) <= MAX_COMPARABLE_LOAD
    return {"median_step_ms": {str(k): 1e3 * float(np.median(v)) for k, v in times.items()},
            "step_s": {str(k): v for k, v in times.items()},
            "load_average_before": load_before, "load_average_after": load_after,
            "comparable": comparable}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/engine_rows"))
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--rows", default="1,4", help="running rows of the row-bound measurement")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="batches 1,4; rows 1; 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.rows, args.repeats, args.max_batch = "1,4", "1", 3, 4
    if not 1 <= args.repeats <= 50:
        raise SystemExit(f"--repeats must be in [1, 50], got {args.repeats}")
    batches = [int(b) for b in args.batches.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(r >= args.max_batch for r in rows_list):
        raise SystemExit("--rows must be below --max-batch")
    args.out.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    import gsm_jax

    params = gsm_jax.load(args.model)
    new_tokens = args.repeats + 16
    print(f"[bench] cost against batch {batches} ...", flush=True)
    curve = interleave({b: _engine(params, b, b, False, new_tokens, args.max_len)
                        for b in batches}, args.repeats)
    print(f"[bench] row bounds, {rows_list} running rows of {args.max_batch} ...", flush=True)
    bounds = interleave({(k, on): _engine(params, args.max_batch, k, on, new_tokens,
                                          args.max_len)
                         for k in rows_list for on in (True, False)}, args.repeats)
    med = bounds["median_step_ms"]
    ratios = {k: med[str((k, False))] / med[str((k, True))] for k in rows_list}
    data = {"machine": info, "args": vars(args) | {"out": str(args.out)}, "held": HELD,
            "cost_against_batch": curve, "row_bounds": bounds,
            "whole_over_bounded": {str(k): v for k, v in ratios.items()}}
    common.write_json(args.out / "results.json", data)
    base = curve["median_step_ms"][str(batches[0])]
    rows_md = [[b, curve["median_step_ms"][str(b)],
                curve["median_step_ms"][str(b)] / base] for b in batches]
    rows_b = [[k, med[str((k, True))], med[str((k, False))], ratios[k]] for k in rows_list]
    text = (f"# Engine decode step against the rows it runs ({args.model}, rows holding "
            f"{HELD} tokens, max_len {args.max_len})\n\n"
            f"Machine: {info.get('cpu_model')}. Medians of {args.repeats} interleaved "
            f"`Engine.step()` calls.{' Quick smoke run: not a measurement.' if args.quick else ''}"
            f"\n\n## Cost against batch (every slot running; load "
            f"{curve['load_average_before']} -> {curve['load_average_after']}"
            f"{'' if curve['comparable'] else ', above 1.5: not comparable'})\n\n"
            + common.markdown_table(["batch", "median step ms", f"x batch {batches[0]}"],
                                    rows_md)
            + f"\n\n## Row bounds (max_batch {args.max_batch}; load "
            f"{bounds['load_average_before']} -> {bounds['load_average_after']}"
            f"{'' if bounds['comparable'] else ', above 1.5: not comparable'})\n\n"
            + common.markdown_table(["running rows", "bounded ms (shipped)",
                                     "all slots ms", "all / bounded"], rows_b) + "\n")
    (args.out / "results.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
        a.plot(batches, [r[1] for r in rows_md], "o-")
        a.set_xscale("log", base=2)
        a.set_xlabel("rows computed (batch)")
        a.set_ylabel("decode step ms")
        a.set_title("cost against batch", fontsize=9)
        x = np.arange(len(rows_list))
        b.bar(x - 0.2, [r[1] for r in rows_b], 0.4, label="row bound (shipped)")
        b.bar(x + 0.2, [r[2] for r in rows_b], 0.4, label=f"all {args.max_batch} slots")
        b.set_xticks(x, [f"{k} running" for k in rows_list])
        b.set_ylabel("decode step ms")
        b.legend(fontsize=8)
        b.set_title(f"max_batch {args.max_batch}", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.out / "results.png", dpi=120)
    except ImportError:
        pass
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
