"""GSM step-time overhead on SmolLM2: GSM on (all layers, both sites, window 8) vs off.

Measured in one run, interleaved (on, off, on, off, ...) so machine noise hits both:
- what a user runs: the whole `gsm_jax.generate_tokens` call (prefill + 64 greedy
  tokens) at batch 1 and 16, GSM on vs off, and GSM compiled in at strength 0;
- the jitted decode step at batch 1 and 16 (donated cache, 128 tokens already cached),
  with rings of `max_window` rows and with rings sized as the serving engine sizes them
  (`ring_rows` at its max_len: 8 rows for window 8);
- the jitted prefill of 512-token prompts (batch 1);
- the filter alone on CPU: the fused XLA path vs the pure-jnp reference, prefill
  [1, 512, 1536] and decode [16, 1536] with a 64-row ring.
"Off" is the model compiled without GSM (gsm=None), the honest baseline.

    python benchmarks/bench_gsm_overhead.py --out runs/gsm_overhead --threads 1

The load average is recorded before and after every case; a case above 1.5 is marked
not comparable. `--threads 1` pins the process to one core (the load then stays ~1).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before XLA sizes its pool

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    bar_chart,
    interleaved,
    machine_info,
    markdown_table,
    write_json,
    write_markdown,
)

import gsm_jax  # noqa: E402
from gsm_jax.families import family_module  # noqa: E402
from gsm_jax.gsm_runtime import gsm_inputs_for_batch  # noqa: E402
from gsm_jax.pallas_kernels.reference import (  # noqa: E402
    smooth_decode_reference,
    smooth_prefill_reference,
)
from gsm_jax.smoothing import ring_from_prefill, smooth_decode, smooth_prefill  # noqa: E402


def _decode_case(params, batch: int, gsm_cfg, repeats: int, context: int = 128,
                 engine_ring: bool = False):
    """engine_ring: rings sized as the serving engine sizes them (`ring_rows` of the
    config at its max_len: 8 rows for window 8); else `max_window` rows (64)."""
    cfg = params.config
    fam = family_module(cfg.family)
    step = jax.jit(functools.partial(fam.decode_step, cfg=cfg), donate_argnames=("cache",))
    max_len = 256
    gsm = gsm_inputs_for_batch(gsm_cfg, cfg.num_layers, batch, [max_len] * batch,
                               fit_ring=engine_ring)
    caches = {}
    for name, g in (("on", gsm), ("off", None)):
        cache = fam.init_cache(cfg, batch, max_len, dtype=jnp.float32,
                               gsm_max_window=None if g is None else g.max_window)
        caches[name] = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.full((batch,), 42, jnp.int32)
    state = dict(caches)

    def run(name, g):
        def call():
            logits, state[name] = step(params.weights, tokens=tokens, cache=state[name], sites=g)
            # keep the cache length fixed so every call does the same work
            state[name] = state[name].replace(lengths=jnp.full((batch,), context, jnp.int32))
            return logits
        return call

    fns = {"on": run("on", gsm), "off": run("off", None)}
    for f in fns.values():  # compile + warm up
        f()
        f()
    return interleaved(fns, repeats)


def _generate_case(params, batch: int, gsm_cfg, repeats: int, new_tokens: int = 64,
                   prompt_len: int = 32):
    """The whole generate_tokens call: GSM on, GSM off (compiled out), GSM at strength 0."""
    rng = np.random.RandomState(batch)
    rows = [rng.randint(10, params.config.vocab_size - 10, prompt_len).tolist()
            for _ in range(batch)]

    def call(g):
        return lambda: gsm_jax.generate_tokens(params, rows, max_new_tokens=new_tokens,
                                               gsm=g, eos_ids=[-1])

    fns = {"on": call(gsm_cfg), "off": call(None),
           "strength 0": call(gsm_cfg.replace(smooth_strength=0.0))}
    for f in fns.values():
        f()
    return interleaved(fns, repeats)


def _prefill_case(params, gsm_cfg, repeats: int, length: int = 512, batch: int = 1):
    cfg = params.config
    fam = family_module(cfg.family)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(10, cfg.vocab_size - 10, (batch, length)), jnp.int32)
    lengths = jnp.full((batch,), length, jnp.int32)
    gsm = gsm_inputs_for_batch(gsm_cfg, cfg.num_layers, batch, [length] * batch)

    @functools.partial(jax.jit, static_argnames=("with_gsm",))
    def prefill(weights, g, with_gsm):
        cache = fam.init_cache(cfg, batch, length, dtype=jnp.float32,
                               gsm_max_window=g.max_window if with_gsm else None)
        return fam.prefill(weights, cfg, tokens, lengths, cache, g if with_gsm else None)[0]

    fns = {"on": lambda: prefill(params.weights, gsm, True),
           "off": lambda: prefill(params.weights, gsm, False)}
    for f in fns.values():
        f()
    return interleaved(fns, repeats)


def _kernel_cases(repeats: int) -> dict[str, dict[str, list[float]]]:
    rng = np.random.RandomState(0)
    out = {}
    x = jnp.asarray(rng.randn(1, 512, 1536), jnp.float32)
    pos = jnp.arange(512, dtype=jnp.int32)[None]
    win, s, lo = jnp.array([8], jnp.int32), jnp.array([0.1], jnp.float32), jnp.int32(1)
    fast = jax.jit(functools.partial(smooth_prefill, max_window=64, precision="f32", impl="xla"))
    ref = jax.jit(functools.partial(smooth_prefill_reference, max_window=64, precision="f32"))
    fns = {"xla": lambda: fast(x, pos, win, s, lo), "reference": lambda: ref(x, pos, win, s, lo)}
    for f in fns.values():
        f()
    out["prefill [1,512,1536] w8"] = interleaved(fns, repeats)

    b = 16
    xs = jnp.asarray(rng.randn(b, 200, 1536), jnp.float32)
    ring = ring_from_prefill(xs, jnp.tile(jnp.arange(200, dtype=jnp.int32), (b, 1)), 64)
    x1 = jnp.asarray(rng.randn(b, 1536), jnp.float32)
    p1 = jnp.full((b,), 200, jnp.int32)
    wb, sb = jnp.full((b,), 8, jnp.int32), jnp.full((b,), 0.1, jnp.float32)
    fast_d = jax.jit(functools.partial(smooth_decode, precision="f32", impl="xla"))
    ref_d = jax.jit(functools.partial(smooth_decode_reference, precision="f32"))
    fns = {"xla": lambda: fast_d(x1, ring, p1, wb, sb, lo)[0],
           "reference": lambda: ref_d(x1, ring, p1, wb, sb, lo)[0]}
    for f in fns.values():
        f()
    out["decode [16,1536] ring 64, w8"] = interleaved(fns, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/gsm_overhead"))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--threads", type=int, choices=(1,), default=None,
                    help="1: pin to one core (read before jax starts)")
    ap.add_argument("--max-window", type=int, default=64)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info_before = machine_info()
    params = gsm_jax.load(args.model, progress=True)
    gsm_cfg = gsm_jax.GSMConfig(target_layers="all", window_size=8, smooth_strength=0.1,
                                precision=args.precision, max_window=args.max_window)
    rows, results = [], {}
    gen_repeats = max(args.repeats // 3, 5)
    cases = [("generate_tokens, batch 1, 64 tokens",
              lambda: _generate_case(params, 1, gsm_cfg, gen_repeats)),
             ("generate_tokens, batch 16, 64 tokens",
              lambda: _generate_case(params, 16, gsm_cfg, gen_repeats)),
             ("decode step, ring of max_window rows, batch 1",
              lambda: _decode_case(params, 1, gsm_cfg, args.repeats)),
             ("decode step, ring of max_window rows, batch 16",
              lambda: _decode_case(params, 16, gsm_cfg, args.repeats)),
             ("engine decode step (ring sized for the window), batch 1",
              lambda: _decode_case(params, 1, gsm_cfg, args.repeats, engine_ring=True)),
             ("engine decode step (ring sized for the window), batch 16",
              lambda: _decode_case(params, 16, gsm_cfg, args.repeats, engine_ring=True)),
             ("prefill 512 tokens, batch 1",
              lambda: _prefill_case(params, gsm_cfg, max(args.repeats // 3, 5)))]
    for name, fn in cases:
        print(f"[bench] {name} ...", flush=True)
        load_before = common.load_average()
        t = fn()
        load_after = common.load_average()
        comparable = max((load_before or [0])[0], (load_after or [0])[0]) <= 1.5
        on, off = float(np.median(t["on"])), float(np.median(t["off"]))
        zero = float(np.median(t["strength 0"])) if "strength 0" in t else None
        results[name] = {"on_s": t["on"], "off_s": t["off"], "median_on_s": on,
                         "median_off_s": off, "overhead": on / off - 1.0,
                         "strength0_s": t.get("strength 0"), "median_strength0_s": zero,
                         "overhead_strength0": None if zero is None else zero / off - 1.0,
                         "load_average_before": load_before, "load_average_after": load_after,
                         "comparable": comparable}
        rows.append([name, f"{off * 1e3:.2f}", f"{on * 1e3:.2f}", f"{(on / off - 1) * 100:+.1f}%",
                     "" if zero is None else f"{(zero / off - 1) * 100:+.1f}%",
                     "≤ +3%", "pass" if on / off - 1 <= 0.03 else "FAIL",
                     f"{(load_before or ['?'])[0]} / {(load_after or ['?'])[0]}",
                     "yes" if comparable else "NO (load > 1.5)"])
    print("[bench] filter alone (XLA path vs jnp reference) ...", flush=True)
    krows = []
    for name, t in _kernel_cases(args.repeats).items():
        fast, ref = float(np.median(t["xla"])), float(np.median(t["reference"]))
        results[f"filter {name}"] = {"xla_s": t["xla"], "reference_s": t["reference"],
                                     "median_xla_s": fast, "median_reference_s": ref,
                                     "speedup": ref / fast}
        krows.append([name, f"{ref * 1e3:.3f}", f"{fast * 1e3:.3f}", f"{ref / fast:.2f}×"])
    data = {"config": {"model": args.model, "gsm": gsm_cfg.to_dict(), "repeats": args.repeats,
                       "baseline": "model compiled without GSM (gsm=None)"},
            "machine_before": info_before, "machine_after": machine_info(), "results": results}
    write_json(args.out / "results.json", data)
    table = markdown_table(["case", "off ms", "on ms", "overhead", "strength 0 overhead",
                            "target", "verdict", "load before / after", "comparable"], rows)
    ktable = markdown_table(["filter case", "jnp reference ms", "XLA path ms", "speedup"], krows)
    write_markdown(args.out / "results.md",
                   f"# GSM overhead ({args.model}, precision {args.precision}, "
                   f"max_window {args.max_window}, threads {args.threads or 'all'})\n\n"
                   f"Medians of {args.repeats} interleaved runs; load average before "
                   f"{info_before.get('load_average_1_5_15')}, after "
                   f"{data['machine_after'].get('load_average_1_5_15')}.\n\n{table}\n\n{ktable}\n")
    bar_chart(args.out / "results.png", [r[0] for r in rows],
              {"GSM off": [float(r[1]) for r in rows], "GSM on": [float(r[2]) for r in rows]},
              title="GSM step time (ms, lower is better)", ylabel="ms")
    print(table)
    print(ktable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
