"""The `gsm-jax` command line. Subcommands register themselves in `SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gsm_jax.errors import GSMJaxError

SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {}


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


SUBCOMMANDS["generate"] = (_add_generate_args, _run_generate)


def _load_optional_subcommands() -> None:
    # The workflow tools add their subcommands on import; absent modules are skipped.
    import importlib

    for mod in ("gsm_jax.workflow.cli", "gsm_jax.workflow.bench", "gsm_jax.planner",
                "gsm_jax.serving.cli"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name is None or not mod.startswith(e.name):
                raise


def main(argv: list[str] | None = None) -> int:
    _load_optional_subcommands()
    parser = argparse.ArgumentParser(prog="gsm-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name))
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command][1](args)
    except GSMJaxError as e:
        print(f"gsm-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
