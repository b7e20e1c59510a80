"""The serving engine against its --max-len: a decode step, one stream vs `generate` (issue 42).

    python benchmarks/bench_engine_max_len.py --out runs/engine_max_len --threads 1
    python benchmarks/bench_engine_max_len.py --quick --out /tmp/engine_max_len   # smoke run

SmolLM2 (`--model`), greedy, EOS ignored, in this process. Issue 42's two figures of
"decode cost follows the tokens held, not the allocated cache":

1. **Step at 64 tokens held.** One `gsm_jax.serving.Engine` per (batch, max_len):
   batch 1 and 8 (`--batches`), max_len 256 / 2048 / 8192 (`--max-lens`), GSM compiled
   out, `prefill_chunk` 64, async scheduling off (each `step()` reads its own tokens
   back, so the time of one call is the cost of one step; with it on, a step's device
   work would spill into the next engine's timed call). Every row gets a 64-token
   prompt; after the prefill and two untimed steps, one timed sample is one
   `Engine.step()` (a decode step of every row: the program, the pick and the host
   bookkeeping). The engines of one batch size are stepped in turn, round after round,
   the order reversed every other round (interleaved: the same background load for
   all); the rows hold 64 + a few tokens throughout (`--repeats` <= 50 keeps them under
   128, one attention block). Reported: the median step time per engine and its ratio
   to the same batch at the smallest max_len. **Goal: <= 1.15x at 8192 against 256.**
   The context length is run-time data in the new engine (attention loops over cache
   blocks up to the rows' length), so max_len only sizes the cache.
2. **One stream at `--stream-max-len` 8192.** One engine at the server's defaults
   (`gsm-jax serve`'s: max_batch 16, prefill_chunk 128, GSM compiled in at zero
   strength with a 16-row ring, prefix caching on, async scheduling on) and max_len
   8192, warmed up as the server warms it (`Engine.warmup`), serves one request of
   `--stream-prompt` (64) tokens + `--stream-new` (128) new tokens through
   `Engine.run([request])`, against `gsm_jax.generate_tokens` on the same prompt (the
   token-level `gsm_jax.generate`), both run once untimed first. `--stream-repeats`
   interleaved rounds (engine, generate N, generate 1; the order rotated). Reported,
   medians: tokens/s of the whole request (N / wall time, prefill included), and the
   decode rate alone (engine: (N - 1) / (last token - first token) from the request's
   token times; generate: (N - 1) / (N-token call - 1-token call), the two calls
   neighbours in each round, as `common.measure_decode` does), engine / generate for
   each. **Goal: >= 0.9x** (both are given a verdict).

The load average is recorded before and after each timed block; above 1.5 the figures
are marked not comparable. `--threads 1` pins the process to one core (before XLA
starts). `--quick`: batch 1, max_len 256 and 2048, 3 repeats; the stream at max_len 2048,
max_batch 2, 16 new tokens, 2 rounds: a smoke run of the script, not a measurement.

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before XLA sizes its pool

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    load_average,
    machine_info,
    markdown_table,
    summarize,
    write_json,
    write_markdown,
)

HELD = 64  # tokens each row holds when the step timing starts
STEP_TARGET = 1.15  # step at the largest max_len / step at the smallest, same batch
STREAM_TARGET = 0.9  # one stream through the engine / generate_tokens, tokens/s
MAX_COMPARABLE_LOAD = 1.5
STEP_CHUNK = 64  # prefill_chunk of the step engines: the 64-token prompt in one chunk
# the server's engine (gsm_jax/serving/cli.py and app.py defaults)
SERVER = {"max_batch": 16, "prefill_chunk": 128, "gsm_ring": 16,
          "prefix_cache_bytes": 10**9, "warmup_lengths": (16,)}


def _comparable(before, after) -> bool:
    return max((before or [0])[0], (after or [0])[0]) <= MAX_COMPARABLE_LOAD


# ----------------------------------------------------------------------------- 1. step


def _engine(params, batch: int, max_len: int, new_tokens: int):
    """An engine whose `batch` rows hold HELD tokens and decode at every step."""
    from gsm_jax.serving.engine import Engine, Request

    eng = Engine(params, max_batch=batch, max_len=max_len, eos_ids=[],
                 prefill_chunk=STEP_CHUNK, async_scheduling=False)
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
    new_tokens = repeats + batch + 8
    engines = {n: _engine(params, batch, n, new_tokens) for n in max_lens}
    held_start = {n: _held(e) for n, e in engines.items()}
    names = list(engines)
    times: dict = {n: [] for n in names}
    load_before = load_average()
    for r in range(repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            eng = engines[n]
            t = time.perf_counter()
            eng.step()  # blocks: the tokens reach the host (async scheduling off)
            times[n].append(time.perf_counter() - t)
    load_after = load_average()
    held_end = max(_held(e) for e in engines.values())
    for eng in engines.values():
        assert eng.num_active == batch, "a row finished during the timing"
    del engines
    return {"times": times, "held_at_start": held_start, "held_at_end": held_end,
            "load_average_before": load_before, "load_average_after": load_after}


def step_figure(params, batches: list[int], max_lens: list[int], repeats: int) -> dict:
    from gsm_jax.models import common as mc

    block = getattr(mc, "ATTN_BLOCK", None)
    base_len, top_len = max_lens[0], max_lens[-1]
    out: dict = {"held_tokens": HELD, "repeats": repeats, "attention_block": block,
                 "target": f"step at max_len {top_len} / at {base_len} <= {STEP_TARGET}",
                 "batches": {}}
    for batch in batches:
        print(f"[bench] step: batch {batch}, max_len {max_lens} ...", file=sys.stderr,
              flush=True)
        res = run_batch(params, batch, max_lens, repeats)
        base = float(np.median(res["times"][base_len]))
        cases = {}
        for n, t in res["times"].items():
            med = float(np.median(t))
            verdict = None
            if n == top_len and n > base_len:
                verdict = "pass" if med / base <= STEP_TARGET else "FAIL"
            cases[str(n)] = {"max_len": n, "step_s": summarize(t), "median_step_s": med,
                             "ratio": med / base, "verdict": verdict,
                             "blocks_read": None if block is None
                             else -(-res["held_at_end"] // block)}
        out["batches"][str(batch)] = {
            "cases": cases, "held_at_start": res["held_at_start"],
            "held_at_end": res["held_at_end"],
            "load_average_before": res["load_average_before"],
            "load_average_after": res["load_average_after"],
            "comparable": _comparable(res["load_average_before"], res["load_average_after"])}
    return out


# ----------------------------------------------------------------------------- 2. stream


def stream_figure(params, *, max_len: int, max_batch: int, prompt_len: int, new_tokens: int,
                  repeats: int, gsm: bool) -> dict:
    import gsm_jax
    from gsm_jax.serving.engine import Engine, Request

    chunk = min(SERVER["prefill_chunk"], 1 << (max_len.bit_length() - 1))
    eng = Engine(params, max_batch=max_batch, max_len=max_len, eos_ids=[],
                 compile_gsm=gsm, gsm_ring=SERVER["gsm_ring"] if gsm else None,
                 prefill_chunk=chunk, prefix_cache_bytes=SERVER["prefix_cache_bytes"])
    print(f"[bench] stream: warming the engine (max_batch {max_batch}, max_len {max_len}, "
          f"GSM {'compiled in' if gsm else 'out'}) ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    warm = eng.warmup(SERVER["warmup_lengths"], sample=True)
    warmup_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, params.config.vocab_size, prompt_len).tolist()

    def engine():
        return eng.run([Request(prompt, new_tokens, request_id="stream", ignore_eos=True)])[0]

    def generate(n: int):
        return gsm_jax.generate_tokens(params, [prompt], max_new_tokens=n, eos_ids=[])[0]

    fns = {"engine": engine, "generate": lambda: generate(new_tokens),
           "generate|1": lambda: generate(1)}
    first = {k: fn() for k, fn in fns.items()}  # untimed: compiled, warm
    same = [int(x) for x in first["engine"].tokens] == [int(x) for x in first["generate"]]
    times: dict = {k: [] for k in fns}
    engine_decode: list[float] = []
    names = list(fns)
    load_before = load_average()
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:  # rotated order
            t = time.perf_counter()
            got = fns[k]()
            times[k].append(time.perf_counter() - t)
            if k == "engine":
                assert got.n_tokens == new_tokens, got.n_tokens
                span = got.token_times[-1] - got.token_times[0]
                engine_decode.append((new_tokens - 1) / span if span > 0 else float("nan"))
    load_after = load_average()
    eng_s = np.asarray(times["engine"])
    gen_s, gen1_s = np.asarray(times["generate"]), np.asarray(times["generate|1"])
    engine_tok_s = new_tokens / float(np.median(eng_s))
    generate_tok_s = new_tokens / float(np.median(gen_s))
    gen_decode = float(np.median(gen_s - gen1_s))
    generate_decode_tok_s = (new_tokens - 1) / gen_decode if gen_decode > 0 else None
    engine_decode_tok_s = float(np.nanmedian(engine_decode))
    whole = engine_tok_s / generate_tok_s
    decode = (engine_decode_tok_s / generate_decode_tok_s if generate_decode_tok_s
              else None)
    return {
        "engine": {"max_len": max_len, "max_batch": max_batch, "prefill_chunk": chunk,
                   "gsm_compiled": gsm, "prefix_cache_bytes": SERVER["prefix_cache_bytes"],
                   "async_scheduling": True, "warmup_s": warmup_s,
                   "programs": warm.get("programs") if isinstance(warm, dict) else None},
        "prompt_tokens": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "same_tokens": same,
        "engine_s": summarize(eng_s.tolist()), "generate_s": summarize(gen_s.tolist()),
        "generate_1_token_s": summarize(gen1_s.tolist()),
        "engine_decode_tok_s_runs": engine_decode,
        "engine_tok_s": engine_tok_s, "generate_tok_s": generate_tok_s,
        "engine_decode_tok_s": engine_decode_tok_s,
        "generate_decode_tok_s": generate_decode_tok_s,
        "ratio_whole": whole, "ratio_decode": decode,
        "verdict_whole": "pass" if whole >= STREAM_TARGET else "FAIL",
        "verdict_decode": None if decode is None
        else "pass" if decode >= STREAM_TARGET else "FAIL",
        "target": f"engine / generate >= {STREAM_TARGET}",
        "load_average_before": load_before, "load_average_after": load_after,
        "comparable": _comparable(load_before, load_after)}


# ----------------------------------------------------------------------------- outputs


def write_outputs(out: Path, data: dict) -> None:
    write_json(out / "results.json", data)
    cfg, step, stream = data["config"], data.get("step"), data.get("stream")
    parts = [f"# Engine against max_len ({cfg['model']}, threads {cfg['threads'] or 'all'})\n"]
    if cfg["quick"]:
        parts.append("**Quick smoke run (--quick): not a measurement.**\n")
    rows = []
    if step:
        for batch, b in step["batches"].items():
            for c in b["cases"].values():
                rows.append([batch, c["max_len"], c["blocks_read"],
                             f"{c['median_step_s'] * 1e3:.2f}", f"{c['ratio']:.2f}x",
                             c["verdict"] or "",
                             f"{b['load_average_before'][0] if b['load_average_before'] else '—'}"
                             f" / {b['load_average_after'][0] if b['load_average_after'] else '—'}",
                             "yes" if b["comparable"] else "NO (load > 1.5)"])
        parts.append(
            f"## 1. Decode step, rows holding {HELD} tokens\n\nMedians of {step['repeats']} "
            f"interleaved `Engine.step()` calls per engine (async scheduling off, GSM "
            f"compiled out); ratio to the same batch at max_len {cfg['max_lens'][0]}; "
            f"goal: {step['target']}.\n\n"
            + markdown_table(["batch", "max_len", "attention blocks read", "median step ms",
                              f"vs max_len {cfg['max_lens'][0]}",
                              f"goal <= {STEP_TARGET}x", "load before / after",
                              "comparable"], rows))
    if stream:
        e = stream["engine"]
        srows = [
            ["whole request (N / wall, prefill included)", f"{stream['engine_tok_s']:.1f}",
             f"{stream['generate_tok_s']:.1f}", f"{stream['ratio_whole']:.3f}x",
             stream["verdict_whole"]],
            ["decode alone ((N - 1) / decode time)", f"{stream['engine_decode_tok_s']:.1f}",
             "—" if stream["generate_decode_tok_s"] is None
             else f"{stream['generate_decode_tok_s']:.1f}",
             "—" if stream["ratio_decode"] is None else f"{stream['ratio_decode']:.3f}x",
             stream["verdict_decode"] or "—"]]
        lb, la = stream["load_average_before"], stream["load_average_after"]
        parts.append(
            f"## 2. One stream at max_len {e['max_len']}: engine against generate\n\n"
            f"One request of {stream['prompt_tokens']} prompt + {stream['new_tokens']} new "
            f"tokens; engine at the server's defaults (max_batch {e['max_batch']}, "
            f"prefill_chunk {e['prefill_chunk']}, GSM "
            f"{'compiled in at zero strength' if e['gsm_compiled'] else 'compiled out'}, "
            f"prefix caching, async scheduling; warm-up {e['warmup_s']:.1f} s, "
            f"{e['programs']} programs) against `gsm_jax.generate_tokens`; medians of "
            f"{stream['repeats']} interleaved rounds; same tokens: {stream['same_tokens']}; "
            f"load {lb[0] if lb else '—'} -> {la[0] if la else '—'}"
            f"{'' if stream['comparable'] else ' (above 1.5: NOT comparable)'}.\n\n"
            + markdown_table(["rate", "engine tok/s", "generate tok/s", "engine / generate",
                              f"goal >= {STREAM_TARGET}x"], srows))
    parts.append(f"Machine: {data['machine_before'].get('cpu_model')}, load average before "
                 f"{data['machine_before'].get('load_average_1_5_15')}, after "
                 f"{data['machine_after'].get('load_average_1_5_15')}.\n")
    write_markdown(out / "results.md", "\n".join(parts))
    plot(out / "results.png", data)


def plot(path: Path, data: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step, stream = data.get("step"), data.get("stream")
    panels = [p for p in (step, stream) if p]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 4.0))
    axes = np.atleast_1d(axes)
    i = 0
    if step:
        ax = axes[i]
        i += 1
        lens = data["config"]["max_lens"]
        batches = list(step["batches"])
        w = 0.8 / len(lens)
        for j, n in enumerate(lens):
            ys = [step["batches"][b]["cases"][str(n)]["median_step_s"] * 1e3 for b in batches]
            xs = [k + (j - (len(lens) - 1) / 2) * w for k in range(len(batches))]
            bars = ax.bar(xs, ys, w, label=f"max_len {n}")
            for bar, y in zip(bars, ys, strict=True):
                ax.annotate(f"{y:.1f}", (bar.get_x() + bar.get_width() / 2, y),
                            ha="center", va="bottom", fontsize=7)
        for k, b in enumerate(batches):  # the goal: 1.15x the smallest max_len's step
            base = step["batches"][b]["cases"][str(lens[0])]["median_step_s"] * 1e3
            ax.hlines(STEP_TARGET * base, k - 0.4, k + 0.4, colors="black", linestyles=":",
                      label=f"goal {STEP_TARGET}x max_len {lens[0]}" if k == 0 else None)
        ax.set_xticks(range(len(batches)))
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_ylabel("ms per decode step (lower is better)")
        ax.set_title(f"Decode step, rows holding {HELD} tokens", fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if stream:
        ax = axes[i]
        groups = ["whole request", "decode alone"]
        eng = [stream["engine_tok_s"], stream["engine_decode_tok_s"]]
        gen = [stream["generate_tok_s"], stream["generate_decode_tok_s"] or 0.0]
        xs = np.arange(2)
        for off, ys, label in ((-0.2, eng, f"engine, max_len {stream['engine']['max_len']}"),
                               (0.2, gen, "generate_tokens")):
            bars = ax.bar(xs + off, ys, 0.4, label=label)
            for bar, y in zip(bars, ys, strict=True):
                ax.annotate(f"{y:.1f}", (bar.get_x() + bar.get_width() / 2, y),
                            ha="center", va="bottom", fontsize=7)
        for k, g in enumerate(gen):
            if g:
                ax.hlines(STREAM_TARGET * g, k - 0.4, k + 0.4, colors="black",
                          linestyles=":", label=f"goal {STREAM_TARGET}x generate"
                          if k == 0 else None)
        ax.set_xticks(xs)
        ax.set_xticklabels(groups)
        ax.set_ylabel("tokens/s (higher is better)")
        ax.set_title(f"One stream: {stream['prompt_tokens']} + {stream['new_tokens']} tokens",
                     fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if data["config"]["quick"]:
        fig.suptitle("quick smoke run: not a measurement", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/engine_max_len"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-lens", default="256,2048,8192")
    ap.add_argument("--repeats", type=int, default=30, help="timed steps per engine")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="the second figure: one stream through the engine vs generate")
    ap.add_argument("--stream-max-len", type=int, default=8192)
    ap.add_argument("--stream-max-batch", type=int, default=SERVER["max_batch"])
    ap.add_argument("--stream-prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--stream-new", type=int, default=128, help="new tokens")
    ap.add_argument("--stream-repeats", type=int, default=6)
    ap.add_argument("--stream-gsm", action=argparse.BooleanOptionalAction, default=True,
                    help="GSM compiled in at zero strength, as the server by default")
    ap.add_argument("--threads", type=int, choices=(1,), default=None,
                    help="1: pin to one core (read before jax starts)")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1, max_len 256 and 2048, 3 repeats; the stream at max_len "
                         "2048, max_batch 2, 16 new tokens, 2 rounds: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.max_lens, args.repeats = "1", "256,2048", 3
        args.stream_max_len, args.stream_max_batch = 2048, 2
        args.stream_new, args.stream_repeats = 16, 2
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
        args.max_len_list = sorted(int(n) for n in args.max_lens.split(","))
    except ValueError as e:
        ap.error(f"--batches and --max-lens take comma lists of integers ({e})")
    if not 1 <= args.repeats <= 50:
        ap.error(f"--repeats must be in [1, 50] (rows stay under 128 tokens), got "
                 f"{args.repeats}")
    need = HELD + args.repeats + max(args.batch_list) + 8  # a row's prompt + new tokens
    if min(args.max_len_list) < need or min(args.batch_list) < 1:
        ap.error(f"every --max-lens must be >= {need} (a row's {HELD} prompt tokens and its "
                 "steps), every --batches >= 1")
    if args.stream_new < 2 or args.stream_repeats < 1 or args.stream_prompt < 1 or (
            args.stream_prompt + args.stream_new > args.stream_max_len):
        ap.error("--stream-new must be >= 2, --stream-repeats and --stream-prompt >= 1, "
                 "and prompt + new <= --stream-max-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import gsm_jax

    args.out.mkdir(parents=True, exist_ok=True)
    info_before = machine_info()
    params = gsm_jax.load(args.model, progress=True)
    data: dict = {"config": {"model": args.model, "batches": args.batch_list,
                             "max_lens": args.max_len_list, "held_tokens": HELD,
                             "repeats": args.repeats, "threads": args.threads,
                             "quick": args.quick, "step_target": STEP_TARGET,
                             "stream_target": STREAM_TARGET},
                  "machine_before": info_before}
    data["step"] = step_figure(params, args.batch_list, args.max_len_list, args.repeats)
    if args.stream:
        data["stream"] = stream_figure(
            params, max_len=args.stream_max_len, max_batch=args.stream_max_batch,
            prompt_len=args.stream_prompt, new_tokens=args.stream_new,
            repeats=args.stream_repeats, gsm=args.stream_gsm)
    data["machine_after"] = machine_info()
    write_outputs(args.out, data)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
