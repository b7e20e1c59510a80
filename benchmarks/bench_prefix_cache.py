"""Time to first token with a cached 1k-token prefix vs cold, through the server at its
default flags (issue 24: target <= 0.3x).

    python benchmarks/bench_prefix_cache.py --out reports/data/prefix_cache
    python benchmarks/bench_prefix_cache.py --quick --out /tmp/prefix_quick   # smoke run

One `gsm-jax serve --model smollm2-135m` with nothing but `--admin-token` (defaults:
16 slots, max_len 2048, prefill chunk 512, prefix caching on within 1 GB, GSM compiled in
at zero strength), driven over loopback HTTP by this process. Each round takes a fresh
`--prefix`-token stretch of WikiText-2 (token ids, so the lengths are exact) and sends,
one after the other:

- **cold**: prefix + suffix A (`--suffix` tokens): nothing of it is cached, so the server
  prefills every chunk (512 + 512 + the rest) and keeps the states at 512 and 1024;
- **cached**: prefix + suffix B (another `--suffix` tokens): the server resumes at
  1024 and prefills only the suffix.

A request asks for one greedy token (`max_tokens` 1, non-streaming), so its client-side
latency is its time to first token: queueing (none: one request at a time), prefill,
the first pick and HTTP. One unmeasured warm-up round first (it compiles the extend
programs of these lengths). Reported: the median TTFT of each side over `--rounds`
rounds, the ratio cached / cold (target <= 0.3), whether the cached requests' tokens
are the model's (the first two checked against `gsm_jax.generate_tokens` on the same
prompt), the hit counters of `/metrics`, and the load average before and after (above
1.5: not comparable).

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bar_chart,
    load_average,
    machine_info,
    markdown_table,
    write_json,
    write_markdown,
)

TARGET = 0.3
MAX_COMPARABLE_LOAD = 1.5
TOKEN = "bench-prefix-token"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _ttft(url: str, model: str, ids: list[int]) -> tuple[float, str]:
    import httpx

    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}
    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return dt, r.json()["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/prefix_cache"))
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix, tokens")
    ap.add_argument("--suffix", type=int, default=64, help="each request's own tail, tokens")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--server-args", default="",
                   help="extra `gsm-jax serve` flags (default: none, the defaults)")
    ap.add_argument("--quick", action="store_true",
                    help="a 96-token prefix, --prefill-chunk 32, 2 rounds: a smoke run")
    args = ap.parse_args(argv)
    extra = args.server_args.split()
    if args.quick:
        args.prefix, args.suffix, args.rounds = 96, 8, 2
        extra += ["--prefill-chunk", "32", "--max-len", "256", "--max-batch", "2",
                  "--warmup-lengths", "16"]
    if args.prefix < 1 or args.suffix < 1 or args.rounds < 1:
        raise SystemExit("--prefix, --suffix and --rounds must be >= 1")
    import httpx

    import gsm_jax
    from gsm_jax.serving.launch import ServerProcess
    from gsm_jax.workflow.data import wikitext_tokens

    params = gsm_jax.load(args.model)
    stream = wikitext_tokens(params.tokenizer)
    need = (args.rounds + 1) * (args.prefix + 2 * args.suffix)
    if stream.size < need:
        raise SystemExit(f"WikiText-2 has {stream.size} tokens; this run needs {need}")
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine_info()

    def prompts(r: int) -> tuple[list[int], list[int]]:
        at = r * (args.prefix + 2 * args.suffix)
        prefix = stream[at: at + args.prefix].tolist()
        a = stream[at + args.prefix: at + args.prefix + args.suffix].tolist()
        b = stream[at + args.prefix + args.suffix: at + args.prefix + 2 * args.suffix].tolist()
        return prefix + a, prefix + b

    server_args = ["--model", args.model, "--log-level", "warning", *extra]
    with ServerProcess(server_args, admin_token=TOKEN,
                       log_path=args.out / "server.log") as srv:
        print(f"[bench] server up in {srv.startup_s:.0f} s; warm-up round", flush=True)
        for ids in prompts(args.rounds):  # the last stretch: unmeasured
            _ttft(srv.url, args.model, ids)
        m0 = httpx.get(f"{srv.url}/metrics").text
        load_before = load_average()
        cold, cached, checks = [], [], []
        for r in range(args.rounds):
            a, b = prompts(r)
            t_cold, _ = _ttft(srv.url, args.model, a)
            t_hit, text = _ttft(srv.url, args.model, b)
            cold.append(t_cold)
            cached.append(t_hit)
            checks.append((b, text))
            print(f"[bench] round {r + 1}/{args.rounds}: cold {t_cold * 1e3:.0f} ms, "
                  f"cached {t_hit * 1e3:.0f} ms", flush=True)
        load_after = load_average()
        m1 = httpx.get(f"{srv.url}/metrics").text
        stats = httpx.get(f"{srv.url}/admin/stats", headers=srv.admin_headers).json()
    hits = _metric(m1, "gsm_jax:prefix_cache_hits_total") - _metric(
        m0, "gsm_jax:prefix_cache_hits_total")
    queries = _metric(m1, "gsm_jax:prefix_cache_queries_total") - _metric(
        m0, "gsm_jax:prefix_cache_queries_total")
    # the cached answers are the model's: generate on the same prompt (caching plays no part)
    equal = [params.tokenizer.decode(gsm_jax.generate_tokens(
        params, [ids], max_new_tokens=1, eos_ids=[])[0].tolist()) == text
        for ids, text in checks[:2]]
    med_cold, med_hit = statistics.median(cold), statistics.median(cached)
    ratio = med_hit / med_cold
    load = max((load_before or [0])[0], (load_after or [0])[0])
    comparable = load <= MAX_COMPARABLE_LOAD
    result = {
        "what": "TTFT (one-token completion, client side) of prefix + suffix with the prefix "
                "cached vs cold, gsm-jax serve at its default flags",
        "model": args.model, "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
        "rounds": args.rounds, "server_args": server_args, "cold_s": cold, "cached_s": cached,
        "median_cold_s": med_cold, "median_cached_s": med_hit, "ratio_cached_vs_cold": ratio,
        "target": TARGET, "met": ratio <= TARGET, "hit_tokens": hits, "query_tokens": queries,
        "expected_hit_tokens": args.rounds * ((args.prefix + args.suffix - 1)
                                              // stats["prefix_cache"]["block_tokens"])
        * stats["prefix_cache"]["block_tokens"],
        "server_prefix_cache": stats["prefix_cache"], "answers_equal_generate": equal,
        "load_average_before": load_before, "load_average_after": load_after,
        "comparable": comparable, "quick": args.quick, "machine": info,
        "command": "python benchmarks/bench_prefix_cache.py " + " ".join(argv or sys.argv[1:]),
    }
    write_json(args.out / "results.json", result)
    flag = "" if comparable else f" (load {load:.2f} > 1.5: not comparable)"
    table = markdown_table(
        ["side", "median TTFT (ms)", "min", "max"],
        [["cold", f"{med_cold * 1e3:.1f}", f"{min(cold) * 1e3:.1f}", f"{max(cold) * 1e3:.1f}"],
         ["cached prefix", f"{med_hit * 1e3:.1f}", f"{min(cached) * 1e3:.1f}",
          f"{max(cached) * 1e3:.1f}"]])
    write_markdown(args.out / "results.md", "\n".join([
        f"# Prefix cache: TTFT with a cached {args.prefix}-token prefix vs cold", "",
        f"`{result['command']}`; server `gsm-jax serve {' '.join(server_args)}`; "
        f"{args.rounds} rounds, suffix {args.suffix} tokens.", "", table, "",
        f"**cached / cold = {ratio:.3f}** (target <= {TARGET}: "
        f"{'met' if ratio <= TARGET else 'not met'}){flag}; load "
        f"{(load_before or [0])[0]:.2f} -> {(load_after or [0])[0]:.2f}.",
        f"Prefix-cache hits {hits:.0f} of {queries:.0f} queried prompt tokens "
        f"(expected {result['expected_hit_tokens']}); answers equal generate: {equal}.", ""]))
    bar_chart(args.out / "results.png", ["median TTFT"],
              {"cold": [med_cold * 1e3], "cached prefix": [med_hit * 1e3]},
              title=f"{args.model}: {args.prefix}-token prefix cached vs cold "
                    f"(ratio {ratio:.2f}, target <= {TARGET}){flag}", ylabel="ms")
    print(f"[bench] cached / cold = {ratio:.3f} (target <= {TARGET}){flag}; hits {hits:.0f} "
          f"tokens; wrote {args.out}/results.json, results.md, results.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
