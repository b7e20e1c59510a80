"""`gsm-jax serve` (the OpenAI-compatible server) and `gsm-jax bench-serve` (its load test).

Registered in `gsm_jax.cli.SUBCOMMANDS` on import.
"""

from __future__ import annotations

import argparse
import logging

from gsm_jax.cli import SUBCOMMANDS


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--served-model-name", default=None, help="the name clients use "
                   "(default: --model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16, help="decode slots")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per slot (prompt + new)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests before new ones get 503")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="longest prompt prefilled in one step; longer ones go in chunks")
    p.add_argument("--gsm", default=None, help="GSM config file (YAML/JSON), reloaded on change")
    p.add_argument("--no-gsm", action="store_true",
                   help="compile GSM out (no filter code; PUT /admin/gsm is refused)")
    p.add_argument("--admin-token", default=None,
                   help="enables /admin/* behind 'Authorization: Bearer <token>'")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests")
    p.add_argument("--warmup-lengths", default="16",
                   help="prompt lengths whose prefill compiles before serving (comma list)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info")


def _run_serve(args: argparse.Namespace) -> int:
    from gsm_jax.errors import InvalidInputError
    from gsm_jax.serving.app import ServerOptions, serve

    if args.no_gsm and args.gsm:
        raise InvalidInputError("--no-gsm and --gsm exclude each other")
    try:
        warm = tuple(int(x) for x in str(args.warmup_lengths).split(",") if x.strip())
    except ValueError as e:
        raise InvalidInputError(f"--warmup-lengths must be integers: {e}") from e
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = ServerOptions(
        model=args.model, dtype=args.dtype, max_batch=args.max_batch, max_len=args.max_len,
        max_queue=args.max_queue, prefill_chunk=args.prefill_chunk, gsm=args.gsm,
        compile_gsm=not args.no_gsm, admin_token=args.admin_token,
        shutdown_timeout=args.shutdown_timeout, warmup_lengths=warm,
        served_model_name=args.served_model_name, seed=args.seed)
    serve(options, host=args.host, port=args.port, log_level=args.log_level)
    return 0


SUBCOMMANDS["serve"] = (_add_serve_args, _run_serve)
