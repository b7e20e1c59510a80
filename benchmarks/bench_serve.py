"""The server measured as users run it: HTTP + SSE against the in-process engine, GSM on/off.

    python benchmarks/bench_serve.py --out reports/data/serve

One request set (WikiText-2 prompts: a quarter long, 256-512 tokens and 64 new; the
rest 16-64 tokens and 16 new; greedy, `ignore_eos`, so every run does the same work),
served closed loop by `--clients` (16) concurrent clients, three ways in one run:

1. **engine**: `gsm_jax.serving.Engine.run(clients=16)` in this process, no HTTP, GSM
   compiled out: the peer the server's overhead is measured against;
2. **http, GSM off**: `gsm-jax serve --no-gsm` (GSM compiled out) in a subprocess,
   driven by `gsm-jax bench-serve`'s client (httpx, SSE, same process as this script);
3. **http, GSM on**: `gsm-jax serve --gsm <file>` with a config on every layer and both
   sites (every request in the "gsm" arm; the ring buffers sized for its window).

Same engine settings everywhere (max_batch, max_len 1024, prefill_chunk 512); each
server compiles every prompt bucket before serving and gets one unmeasured warm-up
pass of the same requests. Both servers stay up and the measured rounds alternate
between them (`--repeats`, off/on then on/off). Reported: output tokens/s (first send
to last token; mean over repeats) and the ratio http/engine (target >= 0.9),
client-side P50/P90/P95/P99 TTFT, ITL, TPOT and e2e pooled over the repeats, the load
average before and after each run (above 1.5: marked not comparable). `--threads 1`
puts the model (engine or server) on core 0 and the HTTP client on core 1.

Outputs: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO_ROOT, load_average, machine_info, markdown_table, write_json

from gsm_jax.serving.launch import ServerProcess

GSM = {"target_layers": "all", "smooth_strength": 0.1, "window_size": 8}
TOKEN = "bench-serve-token"


def _load1() -> float:
    return (load_average() or [float("nan")])[0]


def server_args(args: argparse.Namespace, *, gsm: bool) -> list[str]:
    warm = ",".join(str(1 << k) for k in range(4, 10))  # 16 .. 512: every prompt bucket
    out = ["--model", args.model, "--max-batch", str(args.clients), "--max-len", "1024",
           "--prefill-chunk", "512", "--warmup-lengths", warm, "--log-level", "warning"]
    if not gsm:
        return out + ["--no-gsm"]
    path = args.out / "server_gsm.json"  # a deployment's config file: rings sized for it
    path.write_text(json.dumps(GSM))
    return out + ["--gsm", str(path)]


def http_runs(args, requests) -> dict[str, list[dict[str, Any]]]:
    """Both servers up (GSM compiled out / on), warmed, then `--repeats` rounds of the same
    requests alternating between them (off, on / on, off, ...)."""

    from gsm_jax.serving import bench_client as bc

    servers = {}
    try:
        for arm in ("off", "on"):
            srv = ServerProcess(server_args(args, gsm=arm == "on"),
                                log_path=args.out / f"server_{arm}.log", admin_token=TOKEN,
                                env={"PYTHONPATH": str(REPO_ROOT)}, cpus=args.model_cpus)
            servers[arm] = srv.start()
            print(f"[bench_serve] server up in {srv.startup_s:.0f} s (GSM {arm})",
                  file=sys.stderr)
            bc.run_bench(srv.url, requests, clients=args.clients, progress=False)  # warm-up
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for rep in range(args.repeats):
            for arm in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                print(f"[bench_serve] repeat {rep + 1}/{args.repeats}: HTTP, GSM {arm}",
                      file=sys.stderr)
                runs[arm].append(bc.run_bench(servers[arm].url, requests,
                                              clients=args.clients, progress=False))
        return runs
    finally:
        for srv in servers.values():
            srv.stop()


def engine_run(args, requests) -> dict[str, Any]:
    import gsm_jax
    from gsm_jax.serving import Engine, Request

    params = gsm_jax.load(args.model)
    tok = params.tokenizer
    reqs = [Request(tok.encode(r.prompt), r.max_tokens, request_id=f"e{i}", ignore_eos=True,
                    tag=r.tag) for i, r in enumerate(requests)]
    eng = Engine(params, max_batch=args.clients, max_len=1024, prefill_chunk=512)
    eng.warmup([1 << k for k in range(4, 10)])
    eng.run(reqs, clients=args.clients)  # warm-up pass
    runs = []
    for _ in range(args.repeats):
        before = _load1()
        t = time.perf_counter()
        recs = eng.run(reqs, clients=args.clients)
        wall = time.perf_counter() - t
        after = _load1()
        tokens = sum(r.n_tokens for r in recs)
        runs.append({"output_tokens": tokens, "wall_s": wall, "output_tok_per_s": tokens / wall,
                     "load_before": before, "load_after": after,
                     "comparable": max(before, after) <= 1.5})
    return {"runs": runs, "output_tok_per_s": float(np.mean([r["output_tok_per_s"]
                                                              for r in runs])),
            "load_before": max(r["load_before"] for r in runs),
            "load_after": max(r["load_after"] for r in runs),
            "comparable": all(r["comparable"] for r in runs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("runs/bench_serve"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="measured rounds per run kind")
    p.add_argument("--threads", type=int, choices=(1,), default=None,
                   help="1: the model (engine or server) on core 0 only, the HTTP client on "
                   "core 1; the run's own load then stays near 1")
    args = p.parse_args()
    args.model_cpus = {0} if args.threads == 1 else None
    if args.threads == 1:
        os.sched_setaffinity(0, {0})  # before JAX starts: the in-process engine's threads
    from gsm_jax.serving import bench_client as bc

    args.out.mkdir(parents=True, exist_ok=True)
    requests = bc.wikitext_requests(args.requests, seed=args.seed)
    print(f"[bench_serve] engine in-process, {args.requests} requests, {args.clients} clients",
          file=sys.stderr)
    engine = engine_run(args, requests)
    print(f"[bench_serve] engine: {engine['output_tok_per_s']:.1f} tok/s", file=sys.stderr)
    if args.threads == 1:
        os.sched_setaffinity(0, {1})  # this (client) thread; the engine's threads keep core 0
    runs = http_runs(args, requests)

    def side(arm: str) -> dict[str, Any]:
        rs = runs[arm]
        return {"summary": {"all": bc.pooled_summary(rs)},
                "runs_tok_per_s": [r["summary"]["all"]["output_tok_per_s"] for r in rs],
                "output_tok_per_s": float(np.mean([r["summary"]["all"]["output_tok_per_s"]
                                                   for r in rs])),
                "load_before": max(r["load_before"] for r in rs),
                "load_after": max(r["load_after"] for r in rs),
                "comparable": all(r["comparable"] for r in rs)}

    off, on = side("off"), side("on")
    s_off, s_on = off["summary"]["all"], on["summary"]["all"]
    result = {
        "machine": machine_info(), "model": args.model, "clients": args.clients,
        "requests": args.requests, "repeats": args.repeats, "cpu_count": os.cpu_count(),
        "gsm_config": GSM, "threads": args.threads, "model_cpus": sorted(args.model_cpus or []),
        "engine": engine, "http_gsm_off": off, "http_gsm_on": on,
        "ratio_http_over_engine": off["output_tok_per_s"] / engine["output_tok_per_s"],
        "ratio_gsm_on_over_off": on["output_tok_per_s"] / off["output_tok_per_s"],
        "target_http_over_engine": 0.9,
        "definitions": "output tok/s: mean over repeats of a run's output tokens / its wall "
                       "time (first send to last token); percentiles pooled over the repeats' "
                       "requests, client-side (SSE chunk arrival)",
    }
    result["comparable"] = all(r["comparable"] for r in (engine, off, on))
    write_json(args.out / "results.json", result)

    def ms(s, m, q):
        v = s[m][f"p{q}"]
        return "-" if v is None else f"{v * 1000:.0f}"

    rows = [["engine (in-process, GSM compiled out)", f"{engine['output_tok_per_s']:.1f}",
             "1.00", "-", "-", "-", f"{engine['load_before']:.2f} / {engine['load_after']:.2f}"]]
    for name, r in (("HTTP, GSM compiled out", off), ("HTTP, GSM on (all layers)", on)):
        s = r["summary"]["all"]
        rows.append([name, f"{r['output_tok_per_s']:.1f}",
                     f"{r['output_tok_per_s'] / engine['output_tok_per_s']:.2f}",
                     f"{ms(s, 'ttft_s', 50)} / {ms(s, 'ttft_s', 99)}",
                     f"{ms(s, 'itl_s', 50)} / {ms(s, 'itl_s', 99)}",
                     f"{ms(s, 'e2e_s', 50)} / {ms(s, 'e2e_s', 99)}",
                     f"{r['load_before']:.2f} / {r['load_after']:.2f}"])
    md = [f"# Serving benchmark: {args.model}, {args.requests} requests, {args.clients} "
          "clients (closed loop)", "",
          markdown_table(["run", "output tok/s", "x engine", "TTFT P50/P99 ms",
                          "ITL P50/P99 ms", "e2e P50/P99 ms", "load before / after"], rows),
          "", f"HTTP / engine: **{result['ratio_http_over_engine']:.2f}x** (target >= 0.9); "
          f"GSM on / off over HTTP: {result['ratio_gsm_on_over_off']:.3f}x.",
          "" if result["comparable"] else "Some run saw a load above 1.5: not comparable."]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    both = {"summary": {"arm=gsm off": s_off, "arm=gsm on": s_on}, "model": args.model,
            "clients": args.clients, "rate": None, "load_before": off["load_before"],
            "load_after": on["load_after"]}
    bc.plot(both, args.out / "results.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
