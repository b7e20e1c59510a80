"""The `gsm-jax` command line: one subcommand per row of `COMMANDS`, which names each
subcommand, its one-line help and the functions that add its arguments and run it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gsm_jax.errors import GSMJaxError


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One ``gsm-jax`` subcommand. ``add_arguments`` and ``run`` are ``"module:function"``
    references, imported when the command line runs (so importing this module stays cheap):
    ``add_arguments(parser)`` adds the subcommand's arguments, ``run(args)`` returns the exit
    code."""

    name: str
    help: str
    add_arguments: str
    run: str

    def resolve(self) -> tuple[Callable[[argparse.ArgumentParser], None],
                               Callable[[argparse.Namespace], int]]:
        return _function(self.add_arguments), _function(self.run)


def _function(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


DESCRIPTION = ("GSM inference-time activation smoothing for LLMs, in JAX. "
               "`gsm-jax COMMAND --help` describes a command.")

_WF = "gsm_jax.workflow.cli"
_SERVING = "gsm_jax.serving.cli"

# Every subcommand, in the order `gsm-jax --help` lists them.
COMMANDS: tuple[Subcommand, ...] = (
    Subcommand("generate", "generate text for prompts, with or without a GSM config",
               "gsm_jax.cli:_add_generate_args", "gsm_jax.cli:_run_generate"),
    Subcommand("profile", "activation statistics per (layer, site) -> profile.json",
               f"{_WF}:add_profile", f"{_WF}:run_profile"),
    Subcommand("calibrate", "search strength, window and protect_first within a quality "
               "budget -> gsm.yaml", f"{_WF}:add_calibrate", f"{_WF}:run_calibrate"),
    Subcommand("eval", "quality of a GSM config against the unsmoothed model",
               f"{_WF}:add_eval", f"{_WF}:run_eval"),
    Subcommand("report", "profile, calibrate, evaluate and benchmark one model -> a report",
               f"{_WF}:add_report", f"{_WF}:run_report"),
    Subcommand("evidence", "measure the source document's claims on models -> a report",
               f"{_WF}:add_evidence", f"{_WF}:run_evidence"),
    Subcommand("bench", "concurrent requests through the engine, GSM on and off",
               "gsm_jax.workflow.bench:add_arguments", "gsm_jax.workflow.bench:run"),
    Subcommand("plan", "per-device memory of a model on a mesh: will it fit?",
               "gsm_jax.planner:add_plan_args", "gsm_jax.planner:run_plan"),
    Subcommand("serve", "the OpenAI-compatible HTTP server, with a live GSM config",
               f"{_SERVING}:add_serve_args", f"{_SERVING}:run_serve"),
    Subcommand("bench-serve", "load test of a running server over HTTP",
               f"{_SERVING}:add_bench_serve_args", f"{_SERVING}:run_bench_serve"),
)

def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompt texts (or use --prompts-file)")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--prompts-file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gsm", type=Path, default=None, help="GSM config file (YAML or JSON)")


def _run_generate(args: argparse.Namespace) -> int:
    import gsm_jax

    prompts = list(args.prompts)
    if args.prompts_file is not None:
        if not args.prompts_file.exists():
            raise gsm_jax.InvalidInputError(f"prompts file {args.prompts_file} does not exist")
        prompts += [ln for ln in args.prompts_file.read_text().splitlines() if ln.strip()]
    if not prompts:
        raise gsm_jax.InvalidInputError("no prompts: give prompt texts or --prompts-file")
    t0 = time.perf_counter()
    params = gsm_jax.load(args.model, dtype=args.dtype, progress=True)
    print(f"[gsm-jax] loaded {params} in {time.perf_counter() - t0:.1f}s", flush=True)
    gsm = None
    if args.gsm is not None:
        gsm = gsm_jax.GSMConfig.from_file(args.gsm)
        print(gsm_jax.describe(gsm, params.config.num_layers), flush=True)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                  chat=args.chat, gsm=gsm)
    print("[gsm-jax] compiling and generating ...", flush=True)
    t1 = time.perf_counter()
    texts, counts = gsm_jax.generate(params, prompts, return_token_counts=True, **kwargs)
    t2 = time.perf_counter()
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"\n>>> {prompt}\n{text}")
    # Time a second, already-compiled run of the same batch: that is the steady-state speed.
    gsm_jax.generate(params, prompts, **kwargs)
    t3 = time.perf_counter()
    n_tokens = sum(counts)
    print(f"\n[gsm-jax] {n_tokens} new tokens (batch {len(prompts)}): first call "
          f"{t2 - t1:.2f}s including compilation; compiled run {t3 - t2:.2f}s = "
          f"{n_tokens / (t3 - t2):.1f} tokens/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gsm-jax", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    runs = {}
    for command in COMMANDS:
        add_arguments, runs[command.name] = command.resolve()
        add_arguments(sub.add_parser(command.name, help=command.help))
    args = parser.parse_args(argv)
    try:
        return runs[args.command](args)
    except GSMJaxError as e:
        print(f"gsm-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
