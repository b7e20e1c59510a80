"""`gsm-jax serve` (the OpenAI-compatible server) and `gsm-jax bench-serve` (its load test).

Listed in `gsm_jax.cli.COMMANDS`.
"""

from __future__ import annotations

import argparse
import logging

from gsm_jax.families import KV_CACHE_KINDS
from gsm_jax.serving.engine import PREFILL_CHUNK


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--served-model-name", default=None, help="the name clients use "
                   "(default: --model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights and compute dtype (unset: float32; a block-quantized "
                   "DeepSeek checkpoint keeps its FP8 / FP4 weights as stored)")
    from gsm_jax.quant import add_quantize_argument

    add_quantize_argument(p)  # --quantize, --quantize-head, --quantize-group-size
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-batch", type=int, default=16, help="decode slots")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per slot (prompt + new)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="slots of the paged KV cache, shared by the --max-batch slots (vLLM's "
                   "pool of blocks; SGLang's --max-total-tokens): a request holds "
                   "ceil((prompt + max_tokens) / 128) pages and waits while they are not "
                   "free. Default: every slot's --max-len, capped at 2 GiB of cache (never "
                   "below one --max-len request)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_KINDS),
                   help="the KV cache's format (vLLM's flag of the same name): 'auto' the "
                   "model's own; 'float' the activation dtype; 'int8' / 'fp8' (e4m3, "
                   "Llama-family and Gemma 3 models) one byte per value with a float32 scale "
                   "per token, head and 32 values; 'released' (DeepSeek-V4.1, its default) "
                   "the release's FP8 / FP4 cache roundings")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests before new ones get 503")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="longest prompt prefilled in one step; longer ones go in chunks "
                   f"(default {PREFILL_CHUNK}: wider chunks cost the same per token on CPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="automatic prefix caching (default on, as vLLM's): a prompt that "
                   "starts with the --prefill-chunk blocks of an earlier one resumes from "
                   "the state its prefill reached there (KV, GSM rings); outputs equal "
                   "caching off bit for bit")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="dispatch each decode step before the previous one's tokens are read "
                   "back, so streaming and stop checks overlap the model's work (vLLM's "
                   "--async-scheduling; default on); outputs are the same either way")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0,
                   help="memory the prefix cache may hold, in GB (least recently used "
                   "states are evicted first)")
    p.add_argument("--gsm", default=None, help="GSM config file (YAML/JSON), reloaded on change")
    p.add_argument("--gsm-ring", type=int, default=None,
                   help="rows of the GSM ring buffers (compiled in): default what the --gsm "
                   "config's windows need up to --max-len (8 for window 8), else 16; a live "
                   "config needing more is refused")
    p.add_argument("--no-gsm", action="store_true",
                   help="compile GSM out (no filter code; PUT /admin/gsm is refused)")
    p.add_argument("--admin-token", default=None,
                   help="enables /admin/* behind 'Authorization: Bearer <token>'")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests")
    p.add_argument("--warmup-lengths", default="16",
                   help="prompt lengths of the warm-up requests served (greedy and sampled) "
                   "before ready, after every program is built (comma list; each width's "
                   "first run costs a little, nothing compiles after ready either way)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of requests that give none")
    p.add_argument("--mesh", default=None,
                   help="DATAxMODEL devices, e.g. 1x8: weights sharded by the rules table "
                   "(tensor / expert parallel), one engine over the mesh")
    p.add_argument("--log-level", default="info",
                   help="debug, info, warning or error (the server's and uvicorn's logs)")


def run_serve(args: argparse.Namespace) -> int:
    from gsm_jax.errors import InvalidInputError
    from gsm_jax.serving.app import ServerOptions, serve

    if args.no_gsm and args.gsm:
        raise InvalidInputError("--no-gsm and --gsm exclude each other")
    from gsm_jax.quant import quantize_option_kwargs

    quant = quantize_option_kwargs(args)  # --quantize-head alone etc.: named here
    try:
        warm = tuple(int(x) for x in str(args.warmup_lengths).split(",") if x.strip())
    except ValueError as e:
        raise InvalidInputError(f"--warmup-lengths must be integers: {e}") from e
    if not args.prefix_cache_gb >= 0:
        raise InvalidInputError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    prefix_bytes = int(args.prefix_cache_gb * 1e9) if args.enable_prefix_caching else 0
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < args.max_len:
        raise InvalidInputError(  # before the model loads (the engine says it again)
            f"--kv-cache-tokens {args.kv_cache_tokens} holds less than one request of "
            f"--max-len {args.max_len}")
    from gsm_jax.sharding import parse_mesh_spec

    mesh = parse_mesh_spec(args.mesh) if args.mesh else None
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = ServerOptions(
        model=args.model, dtype=args.dtype, max_batch=args.max_batch, max_len=args.max_len,
        kv_cache_tokens=args.kv_cache_tokens,
        max_queue=args.max_queue, prefill_chunk=args.prefill_chunk, gsm=args.gsm,
        compile_gsm=not args.no_gsm, admin_token=args.admin_token,
        shutdown_timeout=args.shutdown_timeout, warmup_lengths=warm,
        served_model_name=args.served_model_name, seed=args.seed, mesh=mesh,
        gsm_ring=args.gsm_ring,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        prefix_cache_bytes=prefix_bytes, async_scheduling=args.async_scheduling,
        quantize=None if args.quantize == "none" else args.quantize,
        quantize_head=bool(quant.get("head")), quantize_group_size=quant.get("group_size"))
    serve(options, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="default: the server's (GET /v1/models)")
    p.add_argument("--clients", type=int, default=16, help="closed loop: concurrent clients")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second (instead of --clients)")
    p.add_argument("--requests", type=int, default=256, help="requests in the run")
    p.add_argument("--long-share", type=float, default=0.25,
                   help="share of long requests (prompt 256-512, 64 new; short: 16-64, 16)")
    p.add_argument("--short-new", type=int, default=16, help="max_tokens of a short request")
    p.add_argument("--long-new", type=int, default=64, help="max_tokens of a long request")
    p.add_argument("--gsm-ab", action="store_true",
                   help="split the run into the GSM arms by rollout 0.5 (needs --admin-token)")
    p.add_argument("--admin-token", default=None,
                   help="the server's --admin-token (for --gsm-ab)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token objective: the report gives the share met")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="time-per-output-token objective: the report gives the share met")
    p.add_argument("--slo-e2e-ms", type=float, default=None,
                   help="whole-request latency objective: the report gives the share met")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the request mix and the arrivals")
    p.add_argument("--out", default="runs/bench_serve", help="results.json + results.png here")


def run_bench_serve(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from gsm_jax.errors import InvalidInputError
    from gsm_jax.serving import bench_client as bc

    if args.requests < 1:
        raise InvalidInputError(f"--requests must be >= 1, got {args.requests}")
    if args.rate is not None and args.rate <= 0:
        raise InvalidInputError(f"--rate must be > 0, got {args.rate}")
    reqs = bc.wikitext_requests(args.requests, long_share=args.long_share,
                                short_new=args.short_new, long_new=args.long_new, seed=args.seed)
    try:
        result = bc.run_bench(
            args.url, reqs, model=args.model, clients=None if args.rate else args.clients,
            rate=args.rate, gsm_ab=args.gsm_ab, admin_token=args.admin_token, seed=args.seed,
            slo_ms={"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2e": args.slo_e2e_ms})
    except (ValueError, RuntimeError) as e:
        raise InvalidInputError(str(e)) from e
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    bc.plot(result, out / "results.png")
    print(bc.table(result))
    print(f"[bench-serve] load {result['load_before']:.2f} -> {result['load_after']:.2f}"
          f"{'' if result['comparable'] else ' (above 1.5: not comparable)'}; "
          f"wrote {out}/results.json, results.png")
    return 0 if result["summary"]["all"]["failed"] == 0 else 1
