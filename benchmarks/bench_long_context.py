"""Decode-step time and cache bytes against context length: DeepSeek-V4 / V4.1 (compressed
attention) beside a full-attention Llama of the same width and depth (issue 25, item 2).

    python benchmarks/bench_long_context.py --out reports/data/long_context

Models (random weights, float32, GSM off, batch 1 by default):

- "v4": `bench_deepseek_v4.py`'s "mid" preset (8 layers: sliding window 128, CSA
  ratio 4 with a top-16 indexer, HCA ratio 32; 768 wide, 8 experts top-2);
- "v41": `bench_deepseek_v41.py`'s "mid" preset without Engram (8 layers: SWA, CSA2
  ratio 2 and ratio 1 with Full / Reuse / Reindex roles, top-64 indexer; 512 wide), float
  caches (`cache_qdq=False`);
- "v41-released": the same with its caches held packed in the release's formats (FP8
  window KV, FP4 compressed KV and index keys: `kv_cache_dtype="released"`, V4.1's
  default), read back where each step reads them;
- "llama": a Llama of v4's width and depth (768, 12 heads, 4 KV heads of 64, 8
  layers; per-layer weights as `gsm_jax.load` gives them).

For each context n (`--contexts`, default 1k, 4k, 16k, 64k tokens) a cache of max_len
n + steps is made whose rows hold n tokens: every cache leaf is random (the cost of a step
does not depend on the values it reads) and `lengths` is n. Then `--steps` jitted
`decode_step` calls (cache donated, greedy token fed back) are timed after two untimed ones,
`--repeats` times, the contexts of one model interleaved round by round (same background
load for all). Reported per model and context: the median ms per step, its ratio to the
step at the smallest context, and the cache's bytes. Target (issue 25): V4 / V4.1 at 64k
<= 1.3x their step at 1k; the Llama shows what full attention costs.

Prefill memory (`--prefill-lengths`, default 1k, 4k, 16k; `--prefill-models`, default
v4): one prompt of n random tokens through `gsm_jax.generate_tokens(..., max_new_tokens=1)`,
the whole call, in a fresh subprocess per (model, n, arm), so each peak resident set is
that call's (Linux's high-water mark is reset once the weights are built). Arms: "chunked"
(generate's default: `extend` over chunks of `gsm_jax.generation.PREFILL_CHUNK` tokens)
and, up to `--one-call-max` tokens (default 4096: beyond it one call needs more memory than
this machine may have), "one call" (`prefill_chunk=None`). Reported: peak RSS, its growth
over the process before the call (weights built), and the call's wall time (first call:
compile included; second call).
Target (issue 25): the mid V4's 16k-token prefill within 8 GB peak RSS.

The load average is recorded before and after each model; above 1.5 the figures are marked
not comparable. `--quick`: contexts 256 and 1024, 2 steps, 1 repeat, a 64-token chunked
prefill; with `--size tiny` the presets' tiny configs (a smoke run of the script, not a
measurement).

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from common import (  # noqa: E402  (no jax at import)
    interleaved,
    load_average,
    machine_info,
    markdown_table,
    settle,
    write_json,
    write_markdown,
)

MAX_COMPARABLE_LOAD = 1.5
TARGET_RATIO = 1.3  # V4 / V4.1 decode step at 64k over the step at 1k
TARGET_PREFILL_RSS = 8e9  # bytes: the mid V4's 16k-token prefill (issue 25)


# ----------------------------------------------------------------------------- models


def build(name: str, size: str = "mid", seed: int = 0):
    """(family module, config, weights) of one model, random weights, float32. `size`:
    "mid" (the measurement) or "tiny" (the presets' tiny configs: checks the script)."""
    import jax

    if name == "v4":
        from bench_deepseek_v4 import PRESETS

        from gsm_jax.models import deepseek_v4 as dv

        hf = dict(PRESETS[size])
        hf.update(model_type="deepseek_v4", num_hidden_layers=len(hf["layer_types"]),
                  max_position_embeddings=1 << 20)
        cfg = dv.DeepseekV4Config.from_hf_config(hf)
        return dv, cfg, dv.init_weights(cfg, jax.random.key(seed))
    if name in ("v41", "v41-released"):
        import dataclasses

        from bench_deepseek_v41 import PRESETS, _harness

        from gsm_jax.models import deepseek_v41 as dv1

        hf = _harness().tiny_config(**PRESETS[size], engram_layer_ids=[])
        cfg = dataclasses.replace(dv1.DeepseekV41Config.from_hf_config(hf),
                                  cache_qdq=name == "v41-released")
        return dv1, cfg, dv1.init_weights(cfg, jax.random.key(seed))
    if name == "llama":
        from gsm_jax.models import llama

        width = dict(mid=dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                              num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64),
                     tiny=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16))[size]
        cfg = llama.LlamaConfig(**width, max_position_embeddings=1 << 20)
        return llama, cfg, llama.unstack_layers(llama.init_weights(cfg, jax.random.key(seed)))
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


MODELS = ("v4", "v41", "v41-released", "llama")


def filled_cache(fam, cfg, batch: int, context: int, steps: int, seed: int):
    """A cache of max_len context + steps whose rows hold `context` tokens (random values;
    a packed cache's bytes random too, its E8M0 scale bytes in 100..129: 2^-27..2^2)."""
    import jax
    import jax.numpy as jnp

    cache = fam.init_cache(cfg, batch, context + steps + 2, dtype=jnp.float32)
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = []
    for k, leaf in zip(keys, leaves, strict=True):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            filled.append((jax.random.normal(k, leaf.shape) * 0.1).astype(leaf.dtype))
        elif hasattr(leaf, "dtype") and leaf.dtype == jnp.uint8:
            filled.append(jax.random.randint(k, leaf.shape, 100, 130).astype(jnp.uint8))
        else:
            filled.append(leaf)
    cache = jax.tree.unflatten(tree, filled)
    return cache.replace(lengths=jnp.full((batch,), context, jnp.int32))


def cache_bytes(cache) -> int:
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(cache)))


# ----------------------------------------------------------------------------- measuring


def measure_model(name: str, size: str, contexts, batch: int, steps: int, repeats: int,
                  seed: int, progress, settle_s: float = 0.0) -> dict:
    import functools

    import jax
    import jax.numpy as jnp

    fam, cfg, weights = build(name, size, seed)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(w, tok, cache):
        logits, cache = fam.decode_step(w, cfg, tok, cache, None)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    state, compile_s, nbytes = {}, {}, {}
    for n in contexts:
        cache = filled_cache(fam, cfg, batch, n, steps * (repeats + 1) + 2, seed)
        nbytes[n] = cache_bytes(cache)
        tok = jnp.zeros((batch,), jnp.int32)
        t0 = time.perf_counter()
        tok, cache = step(weights, tok, cache)
        tok.block_until_ready()
        compile_s[n] = time.perf_counter() - t0
        tok, cache = step(weights, tok, cache)  # untimed second step
        state[n] = (tok, cache)
        progress(f"{name}: context {n}: compiled in {compile_s[n]:.1f} s, "
                 f"cache {nbytes[n] / 2**20:.1f} MiB")
    def run_steps(n: int):
        def fn():
            tok, cache = state[n]
            for _ in range(steps):
                tok, cache = step(weights, tok, cache)
            state[n] = (tok, cache)
            return tok
        return fn

    settle(settle_s)  # compiling the contexts raised the load average
    before = load_average()
    seconds = interleaved({n: run_steps(n) for n in contexts}, repeats)
    times = {n: [t / steps * 1e3 for t in seconds[n]] for n in contexts}
    after = load_average()
    base = float(np.median(times[contexts[0]]))
    rows = {}
    for n in contexts:
        med = float(np.median(times[n]))
        rows[str(n)] = {"step_ms_median": med, "step_ms_all": times[n],
                        "ratio_to_smallest": med / base, "cache_bytes": nbytes[n],
                        "compile_s": compile_s[n]}
    worst = max((before or [0.0])[0], (after or [0.0])[0])
    return {"config": {"family": cfg.family, "num_layers": cfg.num_layers,
                       "hidden_size": cfg.hidden_size},
            "contexts": rows, "load_before": before, "load_after": after,
            "comparable": worst <= MAX_COMPARABLE_LOAD}


def _status_bytes(field: str) -> int | None:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prefill_child(name: str, size: str, length: int, chunk: int | None) -> dict:
    """In a fresh process: peak RSS and wall time of generate_tokens on one prompt. The
    peak is the calls' own: Linux's high-water mark is reset (`/proc/self/clear_refs`)
    once the weights are built (building them on the host peaks higher than a short
    prompt's prefill); elsewhere the process's ru_maxrss, building included."""
    import gc
    import resource

    import gsm_jax
    from gsm_jax.params import ModelParams

    fam, cfg, weights = build(name, size)
    import jax

    jax.block_until_ready(weights)
    gc.collect()
    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        pass
    base = _status_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, length)]
    params = ModelParams(weights, cfg, None, source=f"{name}-{size}")
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        gsm_jax.generate_tokens(params, [ids], max_new_tokens=1, eos_ids=[],
                                prefill_chunk=chunk)
        walls.append(time.perf_counter() - t0)
    peak = (_status_bytes("VmHWM") if reset else None) or \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_bytes": peak, "rss_before_call_bytes": base,
            "call_growth_bytes": peak - base, "peak_is_the_calls": reset,
            "first_call_s": walls[0], "second_call_s": walls[1]}


def measure_prefill(models, size: str, lengths, one_call_max: int, progress) -> dict:
    import json
    import subprocess

    from gsm_jax.generation import PREFILL_CHUNK

    out = {}
    for name in models:
        before = load_average()
        rows = {}
        for n in lengths:
            arms = {"chunked": PREFILL_CHUNK}
            if n <= one_call_max:
                arms["one call"] = None
            for arm, chunk in arms.items():
                cmd = [sys.executable, __file__, "--prefill-child",
                       json.dumps([name, size, n, chunk])]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"prefill child {name} {n} {arm} failed:\n"
                                     f"{r.stderr[-2000:]}")
                rows.setdefault(str(n), {})[arm] = json.loads(r.stdout.strip().splitlines()[-1])
                got = rows[str(n)][arm]
                progress(f"{name}: prefill {n} tokens, {arm}: peak RSS "
                         f"{got['peak_rss_bytes'] / 1e9:.2f} GB, "
                         f"{got['second_call_s']:.1f} s")
        after = load_average()
        worst = max((before or [0.0])[0], (after or [0.0])[0])
        out[name] = {"lengths": rows, "load_before": before, "load_after": after,
                     "comparable": worst <= MAX_COMPARABLE_LOAD}
    return {"chunk": PREFILL_CHUNK, "one_call_max": one_call_max, "models": out}


# ----------------------------------------------------------------------------- report


def prefill_report(pre: dict) -> list[str]:
    """Markdown lines of the prefill-memory table and its verdict."""
    if not pre or not pre.get("models"):
        return []
    head = ["model", "prompt tokens", "arm", "peak RSS GB", "growth in the call GB",
            "first call s (compile)", "second call s"]
    rows, verdicts = [], []
    for name, r in pre["models"].items():
        for n, arms in r["lengths"].items():
            for arm, c in arms.items():
                rows.append([name + ("" if r["comparable"] else " *load*"), n, arm,
                             f"{c['peak_rss_bytes'] / 1e9:.2f}",
                             f"{c['call_growth_bytes'] / 1e9:.2f}",
                             f"{c['first_call_s']:.1f}", f"{c['second_call_s']:.1f}"])
        big = r["lengths"].get("16384", {}).get("chunked")
        if name == "v4" and big:
            ok = big["peak_rss_bytes"] <= TARGET_PREFILL_RSS
            verdicts.append(f"- v4: a 16384-token prefill peaks at "
                            f"{big['peak_rss_bytes'] / 1e9:.2f} GB RSS (target <= "
                            f"{TARGET_PREFILL_RSS / 1e9:.0f} GB): {'met' if ok else 'missed'}")
    return ["## Prefill memory against prompt length", "",
            f"`generate_tokens(max_new_tokens=1)` on one prompt, a fresh process per cell; "
            f"chunked = generate's default (chunks of {pre['chunk']} tokens), one call = "
            f"`prefill_chunk=None` (run up to {pre['one_call_max']} tokens).", "",
            markdown_table(head, rows), "", *verdicts, ""]



def write_report(out: Path, res: dict) -> None:
    contexts = res["options"]["contexts"]
    head = ["model", *[f"{n} tokens: ms/step (x smallest), cache MiB" for n in contexts],
            "load before / after"]
    rows = []
    for name, r in res["models"].items():
        cells = [name + ("" if r["comparable"] else " *load*")]
        for n in contexts:
            c = r["contexts"][str(n)]
            cells.append(f"{c['step_ms_median']:.2f} ({c['ratio_to_smallest']:.2f}x), "
                         f"{c['cache_bytes'] / 2**20:.1f}")
        cells.append(f"{(r['load_before'] or ['?'])[0]} / {(r['load_after'] or ['?'])[0]}")
        rows.append(cells)
    big, small = str(contexts[-1]), str(contexts[0])
    verdicts = []
    for name, r in res["models"].items():
        if name == "llama":
            continue
        ratio = r["contexts"][big]["ratio_to_smallest"]
        verdicts.append(f"- {name}: the step at {big} tokens is {ratio:.2f}x the step at "
                        f"{small} (target <= {TARGET_RATIO}): "
                        f"{'met' if ratio <= TARGET_RATIO else 'missed'}"
                        + ("" if r["comparable"] else " (load above 1.5: not comparable)"))
    if {"v41", "v41-released"} <= set(res["models"]):
        flt, pk = (res["models"][m]["contexts"] for m in ("v41", "v41-released"))
        verdicts.append(
            "- v41-released against v41 (packed caches against float; measured one after "
            "the other in this run): step " + ", ".join(
                f"{pk[str(n)]['step_ms_median'] / flt[str(n)]['step_ms_median']:.2f}x"
                for n in contexts) + f" at {', '.join(str(n) for n in contexts)} tokens; "
            f"cache {pk[big]['cache_bytes'] / flt[big]['cache_bytes']:.2f}x the bytes at "
            f"{big}")
    text = "\n".join([
        "# Decode step against context length",
        "",
        f"`{res['command']}` on {res['machine'].get('cpu_model')} "
        f"({res['machine'].get('cpu_count')} cores), batch {res['options']['batch']}, "
        f"{res['options']['steps']} steps x {res['options']['repeats']} repeats, medians. "
        "Random weights, float32, GSM off; caches hold the context (random values).",
        "",
        markdown_table(head, rows),
        "",
        *verdicts,
        "",
        "*load*: the 1-minute load average passed 1.5 during that model's timing.",
        "",
        *prefill_report(res.get("prefill")),
    ])
    write_markdown(out / "results.md", text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res["models"].items():
        xs = [int(n) for n in r["contexts"]]
        ax.plot(xs, [c["step_ms_median"] for c in r["contexts"].values()], "o-", label=name)
        ax2.plot(xs, [c["cache_bytes"] / 2**20 for c in r["contexts"].values()], "o-",
                 label=name)
    for a, title in ((ax, "decode step (ms, median)"), (ax2, "cache (MiB)")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("tokens in the cache")
        a.set_title(title)
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/long_context")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--size", choices=("mid", "tiny"), default="mid",
                    help="tiny: the presets' tiny configs (checks the script, no figure)")
    ap.add_argument("--contexts", default="1024,4096,16384,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=120.0,
                    help="before each model's timing, wait at most this long for the "
                    "1-minute load average to fall below 1 (compiling raises it)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of the script")
    ap.add_argument("--prefill-lengths", default="1024,4096,16384",
                    help="prompt lengths of the prefill-memory part ('' to skip it)")
    ap.add_argument("--prefill-models", default="v4")
    ap.add_argument("--one-call-max", type=int, default=4096,
                    help="longest prompt also prefilled in one call (prefill_chunk=None)")
    ap.add_argument("--prefill-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prefill_child:
        import json

        name, size, n, chunk = json.loads(args.prefill_child)
        print(json.dumps(prefill_child(name, size, n, chunk)))
        return 0
    if args.quick:
        args.contexts, args.steps, args.repeats = "256,1024", 2, 1
        args.prefill_lengths, args.one_call_max = "64", 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    pre_models = [m.strip() for m in args.prefill_models.split(",") if m.strip()]
    bad = [m for m in models + pre_models if m not in MODELS]
    if bad or not models:
        raise SystemExit(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    try:
        pre_lengths = sorted({int(c) for c in args.prefill_lengths.split(",") if c.strip()})
    except ValueError as e:
        raise SystemExit(f"--prefill-lengths must be integers: {e}") from e
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",")})
    except ValueError as e:
        raise SystemExit(f"--contexts must be integers: {e}") from e
    if not contexts or contexts[0] < 1 or min(args.batch, args.steps, args.repeats) < 1:
        raise SystemExit("--contexts, --batch, --steps and --repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def progress(msg: str) -> None:
        print(f"[long_context] {msg}", file=sys.stderr, flush=True)

    res = {"command": "python benchmarks/bench_long_context.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "machine": machine_info(), "options": {"contexts": contexts, "batch": args.batch,
                                                  "steps": args.steps,
                                                  "repeats": args.repeats,
                                                  "quick": args.quick, "size": args.size,
                                                  "prefill_lengths": pre_lengths,
                                                  "prefill_models": pre_models},
           "models": {}}
    for name in models:
        res["models"][name] = measure_model(name, args.size, contexts, args.batch,
                                            args.steps, args.repeats, args.seed, progress,
                                            0.0 if args.quick else args.settle_s)
        write_json(out / "results.json", res)  # what is done so far survives a stop
    if pre_lengths and pre_models:
        res["prefill"] = measure_prefill(pre_models, args.size, pre_lengths,
                                         args.one_call_max, progress)
        write_json(out / "results.json", res)
    write_report(out, res)
    progress(f"wrote {out / 'results.json'}, results.md, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
