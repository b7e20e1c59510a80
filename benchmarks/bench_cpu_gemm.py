"""What XLA:CPU's dot does with a decode step's weight, by weight dtype and rows (issue 44).

    python benchmarks/bench_cpu_gemm.py --threads 1 --out reports/data/cpu_gemm
    python benchmarks/bench_cpu_gemm.py --quick --out /tmp/cpu_gemm      # smoke run

One weight of SmolLM2's tied LM head's shape ([576, 49152], `--k`, `--n`), passed as a
run-time argument as a model's weights are (never a compile-time constant: XLA:CPU folds
the converts of constants away), multiplied by `rows` activation rows (1, 2, 4, 16), for
each product form a model could use:

- f32: float32 weight and activations (`x @ w`);
- bf16 -> bf16: bfloat16 weight and activations, bfloat16 result (`x @ w`);
- bf16 -> f32 accumulate: the same operands, `preferred_element_type=float32` (what
  `models.linear` runs from two rows on);
- int8 x int8 -> int32: the product w8a8 and w8a16's digits run (`lax.dot_general` with
  `preferred_element_type=int32`);
- int8 weight converted to f32: the generic w8a16 form (`x @ w.astype(f32)`);
- int8 multiply-reduce, weight [N, K]: `sum(w.astype(f32) * x, axis=-1)` (the fused
  convert a hand-written kernel would do; one row only);
- int8 kernel: gsm_jax's own int8 matrix-vector custom call
  (`pallas_kernels/int8_matvec_cpu.py`, what w8a16 runs on CPU up to 16 rows; x rounded
  to int16 per row), when it builds here.

Each form's median time over `--repeats` calls (forms interleaved, order reversed every
other round) gives the bytes of weight read per second, set against the roofline: the
faster of a `--roofline-mib` float32 array summed in the same run and the fastest weight
read of any form (XLA's one-row float32 product streams faster than its reduce). The compiled
program says which emitter ran the dot (a YNNPACK fusion or XLA's own). The load average
is recorded before and after (above 1.5: not comparable).

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402  (no jax at import)
import common  # noqa: E402
import numpy as np  # noqa: E402

MAX_COMPARABLE_LOAD = 1.5


def forms(jnp, lax):
    """name -> (weight dtype, activation dtype, weight layout, product, one row only)."""
    def dot(pref=None):
        return lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                            preferred_element_type=pref)

    return {
        "f32": (jnp.float32, jnp.float32, "KN", dot(), False),
        "bf16 -> bf16": (jnp.bfloat16, jnp.bfloat16, "KN", dot(), False),
        "bf16 -> f32 accumulate": (jnp.bfloat16, jnp.bfloat16, "KN", dot(jnp.float32), False),
        "int8 x int8 -> int32": (jnp.int8, jnp.int8, "KN", dot(jnp.int32), False),
        "int8 weight converted to f32": (jnp.int8, jnp.float32, "KN",
                                         lambda x, w: x @ w.astype(jnp.float32), False),
        "int8 multiply-reduce [N,K]": (jnp.int8, jnp.float32, "NK",
                                       lambda x, w: jnp.sum(w.astype(jnp.float32) * x,
                                                            axis=-1)[None], True),
        **_kernel_form(jnp),
    }


def _kernel_form(jnp) -> dict:
    from gsm_jax.pallas_kernels import int8_matvec_cpu

    if not int8_matvec_cpu.available():
        print(f"[cpu_gemm] int8 kernel skipped: {int8_matvec_cpu.unavailable_reason()}",
              file=sys.stderr)
        return {}
    return {"int8 kernel": (jnp.int8, jnp.float32, "KN", lambda x, w: int8_matvec_cpu.int8_matvec(
        x, w, jnp.ones((w.shape[1],), jnp.float32)), False)}


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    rng = np.random.default_rng(0)
    k, n = args.k, args.n
    load_before = common.load_average()
    big = jnp.ones((args.roofline_mib * 1024 * 1024 // 4,), jnp.float32)
    read = jax.jit(jnp.sum)
    cases, calls = [], {}
    for name, (wdt, xdt, layout, fn, one_row) in forms(jnp, lax).items():
        shape = (k, n) if layout == "KN" else (n, k)
        if jnp.dtype(wdt) == jnp.int8:
            w = jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8))
        else:
            w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.05, wdt)
        for rows in args.rows:
            if one_row and rows != 1:
                continue
            if jnp.dtype(xdt) == jnp.int8:
                x = jnp.asarray(rng.integers(-127, 128, (rows, k), dtype=np.int8))
            else:
                x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32), xdt)
            f = jax.jit(fn)
            text = f.lower(x, w).compile().as_text()
            emitter = ("custom call" if "gsm_int8_matvec" in text
                       else "YNNPACK fusion" if "__ynn_fusion" in text else "XLA")
            jax.block_until_ready(f(x, w))
            key = f"{name}|{rows}"
            calls[key] = (lambda f=f, x=x, w=w: jax.block_until_ready(f(x, w)))
            cases.append({"form": name, "rows": rows, "weight_dtype": jnp.dtype(wdt).name,
                          "weight_bytes": int(w.size * w.dtype.itemsize), "layout": layout,
                          "emitter": emitter, "key": key})
            print(f"[cpu_gemm] compiled {name}, {rows} rows ({emitter})", file=sys.stderr)
    calls["roofline read"] = lambda: jax.block_until_ready(read(big))
    times = common.interleaved(calls, args.repeats)
    load_after = common.load_average()
    read_s = float(np.median(times["roofline read"]))
    for c in cases:
        t = float(np.median(times[c.pop("key")]))
        c["ms"] = t * 1e3
        c["weight_gb_s"] = c["weight_bytes"] / t / 1e9
    # the roofline: the faster of the summed array and the best weight read of any form
    # (XLA's one-row f32 product streams its weight faster than its own reduce does)
    roofline = max(big.size * 4 / read_s, *(c["weight_gb_s"] * 1e9 for c in cases))
    for c in cases:
        c["of_roofline"] = c["weight_gb_s"] * 1e9 / roofline
    f32_1 = next((c["ms"] for c in cases if c["form"] == "f32" and c["rows"] == 1), None)
    for c in cases:
        c["vs_f32_one_row"] = c["ms"] / f32_1 if f32_1 else None
    worst = max((load_before or [0])[0], (load_after or [0])[0])
    return {"machine": common.machine_info(), "cpu_flags": common.cpu_flags(),
            "threads": args.threads, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "k": k, "n": n, "repeats": args.repeats,
            "roofline": {"mib": args.roofline_mib, "ms": read_s * 1e3,
                         "sum_gb_s": big.size * 4 / read_s / 1e9, "gb_s": roofline / 1e9},
            "load_before": load_before, "load_after": load_after,
            "comparable": worst <= MAX_COMPARABLE_LOAD, "cases": cases}


def render(res: dict) -> str:
    r = res["roofline"]
    head = (f"# XLA:CPU dot by weight dtype and rows ({res['machine'].get('cpu_model', '?')}, "
            f"threads {res['threads']})\n\nWeight [{res['k']}, {res['n']}] as a run-time "
            f"argument; medians of {res['repeats']} interleaved calls. Roofline: a "
            f"{r['mib']} MiB float32 array summed in {r['ms']:.2f} ms ({r['sum_gb_s']:.1f} "
            f"GB/s) or the fastest weight read below, whichever is faster: **{r['gb_s']:.1f} "
            f"GB/s**. "
            f"Load before {res['load_before']}, after {res['load_after']} "
            f"(comparable: {res['comparable']}).\n\n")
    rows = [(c["form"], c["rows"], c["emitter"], c["weight_bytes"] / 2**20, c["ms"],
             c["weight_gb_s"], f"{100 * c['of_roofline']:.0f}%", c["vs_f32_one_row"])
            for c in res["cases"]]
    return head + common.markdown_table(
        ["form", "rows", "dot emitter", "weight MiB", "ms", "weight GB/s", "of roofline",
         "time / f32 one row"], rows)


def plot(res: dict, path: Path) -> None:
    rows = sorted({c["rows"] for c in res["cases"]})
    names = list(dict.fromkeys(c["form"] for c in res["cases"]))
    series = {f"{r} row{'s' if r > 1 else ''}": [
        next((c["ms"] for c in res["cases"] if c["form"] == nm and c["rows"] == r), None)
        for nm in names] for r in rows}
    common.bar_chart(path, [nm.replace(" ", "\n", 2) for nm in names], series,
                     title=f"one [{res['k']}, {res['n']}] weight, ms per product (roofline "
                           f"{res['roofline']['gb_s']:.1f} GB/s)", ylabel="ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_cpu_gemm")
    p.add_argument("--threads", type=int, default=None,
                   help="pin the process to its first N cores (XLA:CPU sizes its thread "
                        "pool from them). Default: all cores")
    p.add_argument("--k", type=int, default=576, help="contracted size (SmolLM2's hidden)")
    p.add_argument("--n", type=int, default=49152, help="output size (SmolLM2's vocabulary)")
    p.add_argument("--rows", default="1,2,4,16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--roofline-mib", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats, args.roofline_mib = 4096, 3, 16
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows {args.rows!r}: a comma list of row counts, e.g. 1,2,4,16")
    if min(args.rows) < 1 or args.repeats < 1 or args.k < 1 or args.n < 1:
        p.error("--rows, --repeats, --k and --n must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    bg.pin_threads(args.threads)  # before jax starts its thread pool
    t0 = time.perf_counter()
    res = run(args)
    out = Path(args.out)
    common.write_json(out / "results.json", res)
    text = render(res)
    common.write_markdown(out / "results.md", text)
    plot(res, out / "results.png")
    print(text)
    print(f"[cpu_gemm] {time.perf_counter() - t0:.0f} s; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
