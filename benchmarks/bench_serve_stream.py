"""One stream through the server at its default flags vs `gsm_jax.generate` (issue 24, 4).

    python benchmarks/bench_serve_stream.py --out reports/data/serve_stream
    python benchmarks/bench_serve_stream.py --quick --out /tmp/serve_stream   # smoke run

What a user compares: `gsm-jax serve --model smollm2-135m` started with no other flag, one
client streaming one completion (greedy, `ignore_eos`, `--new-tokens` tokens) of a
WikiText-2 prompt of `--prompt-tokens` tokens, against the same prompt through the
library's own generation loop in this process (`gsm_jax.generate_tokens`, the token-level
form of `gsm_jax.generate`: the same compiled prefill + `while_loop`, EOS off so both
produce the same number of tokens).

Per-stream decode rate:
- server: (tokens - 1) / (last token's arrival - first token's arrival), from the SSE
  stream as the client sees it (the request's own decode, without its TTFT);
- generate: (N - 1) / (time of an N-token call - time of a 1-token call), the two calls
  run next to each other in every round (the prefill cancels), as
  `common.measure_decode` does.

With `--sync-peer` (default on) a second server runs the same flags plus
`--no-async-scheduling` (the engine reads each decode step back before dispatching the
next), measured in the same rounds: what async scheduling (the default) gains.

Rounds rotate the order of the sides, `--repeats` of them, after one untimed round
that compiles everything and a wait (at most `--settle-s`) for the load average to fall
below 1. Reported: the median rate of each, their ratio (target >= 0.9), TTFT of the
stream, and the 1-minute load average before and after (above 1.5: marked not
comparable). Both sides run on the whole machine, as a user runs them; nothing is pinned.

Outputs in --out: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

TARGET = 0.9


def wikitext_prompt(tokenizer, n_tokens: int) -> list[int]:
    """The first `n_tokens` tokens of the packaged WikiText-2 text's first long paragraph."""
    from gsm_jax.workflow.data import default_wikitext_path

    text = Path(default_wikitext_path()).read_text(encoding="utf-8")
    para = next(p for p in text.split("\n") if len(p.split()) > 2 * n_tokens)
    ids = tokenizer.encode(para.strip())
    if len(ids) < n_tokens:
        raise SystemExit(f"no WikiText-2 paragraph has {n_tokens} tokens")
    return ids[:n_tokens]


def stream_once(url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion of token-id `prompt`; arrival times of its text chunks."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, tokens = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if tokens != new_tokens or len(arrivals) < 2:
        raise SystemExit(f"the stream gave {tokens} tokens in {len(arrivals)} chunks, "
                         f"wanted {new_tokens}")
    span = arrivals[-1] - arrivals[0]
    # chunks may carry several tokens: the first chunk's tokens are not in the span
    first_chunk_tokens = tokens - (len(arrivals) - 1)
    return {"ttft_s": arrivals[0] - t0, "e2e_s": arrivals[-1] - t0,
            "decode_tok_s": (tokens - first_chunk_tokens) / span, "chunks": len(arrivals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs/serve_stream")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--settle-s", type=float, default=180.0,
                    help="before timing, wait at most this long for the 1-minute load "
                         "average to fall below 1 (start-up compiles raise it)")
    ap.add_argument("--sync-peer", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure a server started with --no-async-scheduling")
    ap.add_argument("--server-args", default="",
                    help="extra flags for both servers, e.g. '--max-len 8192' (issue 42: "
                    "one stream at --max-len 8192 >= 0.9x generate)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 16 new tokens, 2 repeats (not a measurement)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.repeats, args.settle_s = 16, 2, 0.0
    if args.new_tokens < 2 or args.prompt_tokens < 1 or args.repeats < 1:
        raise SystemExit("--new-tokens must be >= 2, --prompt-tokens and --repeats >= 1")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()

    import jax

    import gsm_jax
    from gsm_jax.serving.launch import ServerProcess

    params = gsm_jax.load(args.model)
    prompt = wikitext_prompt(params.tokenizer, args.prompt_tokens)
    n = args.new_tokens

    def gen(k: int):
        return gsm_jax.generate_tokens(params, [prompt], max_new_tokens=k, eos_ids=[])

    extra = args.server_args.split()
    server = ServerProcess(["--model", args.model, "--log-level", "warning", *extra],
                           log_path=out_dir / "server.log")
    sync = (ServerProcess(["--model", args.model, "--log-level", "warning",
                           "--no-async-scheduling", *extra],
                          log_path=out_dir / "server_sync.log")
            if args.sync_peer else None)
    print(f"[serve-stream] starting gsm-jax serve --model {args.model} "
          f"{' '.join(extra) or '(default flags)'}", flush=True)
    server.start()
    try:
        if sync is not None:
            print("[serve-stream] starting the peer: the same with --no-async-scheduling",
                  flush=True)
            sync.start()
        # a warm-up round (compiles generate's programs), then quiet before timing: the
        # server's start-up compiles raise the load average for a minute after
        stream_once(server.url, args.model, prompt, n)
        if sync is not None:
            stream_once(sync.url, args.model, prompt, n)
        jax.block_until_ready((gen(1), gen(n)))
        common.settle(args.settle_s)
        served, generated, ttft, served_sync = [], [], [], []
        sides = ["server", "generate"] + (["sync"] if sync is not None else [])
        load_before = common.load_average()
        for r in range(1, args.repeats + 1):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for side in order:
                if side == "server":
                    s = stream_once(server.url, args.model, prompt, n)
                    served.append(s["decode_tok_s"])
                    ttft.append(s["ttft_s"])
                elif side == "sync":
                    served_sync.append(
                        stream_once(sync.url, args.model, prompt, n)["decode_tok_s"])
                else:
                    t = time.perf_counter()
                    jax.block_until_ready(gen(1))
                    t1 = time.perf_counter() - t
                    t = time.perf_counter()
                    jax.block_until_ready(gen(n))
                    tn = time.perf_counter() - t
                    generated.append((n - 1) / (tn - t1) if tn > t1 else float("nan"))
            print(f"[serve-stream] round {r}/{args.repeats}: server {served[-1]:.1f} "
                  f"tok/s, generate {generated[-1]:.1f} tok/s"
                  + (f", server without async scheduling {served_sync[-1]:.1f} tok/s"
                     if served_sync else ""), flush=True)
        load_after = common.load_average()
    finally:
        server.stop()
        if sync is not None:
            sync.stop()
    med_s, med_g = statistics.median(served), statistics.median(generated)
    comparable = max((load_before or [0])[0], (load_after or [0])[0]) <= 1.5
    result = {
        "machine": info, "args": vars(args), "startup_s": server.startup_s,
        "server_command": " ".join(["gsm-jax serve --model", args.model, *extra]),
        "prompt_tokens": len(prompt), "new_tokens": n,
        "server_decode_tok_s": common.summarize(served),
        "generate_decode_tok_s": common.summarize(generated),
        "server_ttft_s": common.summarize(ttft),
        "ratio": med_s / med_g, "target": TARGET,
        "load_average_before": load_before, "load_average_after": load_after,
        "comparable": comparable,
    }
    if served_sync:
        med_y = statistics.median(served_sync)
        result["sync_server_command"] = f"{result['server_command']} --no-async-scheduling"
        result["sync_server_decode_tok_s"] = common.summarize(served_sync)
        result["sync_ratio"] = med_y / med_g
        result["async_gain"] = med_s / med_y
    common.write_json(out_dir / "results.json", result)
    verdict = "met" if result["ratio"] >= TARGET else "not met"
    md = ["# One stream through `gsm-jax serve` (default flags) vs `gsm_jax.generate`\n",
          f"Model {args.model}; prompt {len(prompt)} tokens (WikiText-2), {n} new tokens, "
          f"greedy, EOS ignored; {args.repeats} interleaved rounds after one untimed. "
          f"Machine: {info.get('cpu_model', '?')}. Load average {load_before} -> {load_after}"
          f"{'' if comparable else ' (above 1.5: not comparable)'}.\n",
          common.markdown_table(
              ["side", "decode tok/s (median)", "min", "max"],
              [["server, one SSE stream", med_s, min(served), max(served)],
               ["generate_tokens", med_g, min(generated), max(generated)]]
              + ([["server --no-async-scheduling", result["sync_server_decode_tok_s"]["median"],
                   min(served_sync), max(served_sync)]] if served_sync else [])),
          f"\nServer / generate: **{result['ratio']:.3f}x** (target >= {TARGET}: {verdict}). "
          f"Stream TTFT median {statistics.median(ttft) * 1e3:.0f} ms.\n"]
    if served_sync:
        md.append(f"Without async scheduling the server ran at {result['sync_ratio']:.3f}x "
                  f"generate; async scheduling gains {result['async_gain']:.3f}x.\n")
    (out_dir / "results.md").write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        bars = [("server (1 stream)", served, "#4c72b0"), ("generate", generated, "#55a868")]
        if served_sync:
            bars.append(("server, no async", served_sync, "#8c8c8c"))
        ax.bar([b[0] for b in bars], [statistics.median(b[1]) for b in bars],
               color=[b[2] for b in bars])
        for i, vals in enumerate(b[1] for b in bars):
            ax.scatter([i] * len(vals), vals, color="k", s=8, zorder=3)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{args.model}: server/generate {result['ratio']:.2f}x "
                     f"(target >= {TARGET})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "results.png", dpi=120)
    except ImportError:
        pass
    print("\n".join(md))


if __name__ == "__main__":
    main()
