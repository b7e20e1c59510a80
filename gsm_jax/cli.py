"""The `gsm-jax` command line: one subcommand per row of `COMMANDS`, which names each
subcommand, its one-line help and the functions that add its arguments and run it.

Run as a program (``gsm-jax ...``, ``main()`` without arguments), it turns JAX's persistent
compilation cache on before anything compiles (`gsm_jax.compile_cache`: a second identical
command loads its programs instead of compiling them; ``GSM_JAX_COMPILATION_CACHE=0`` turns
it off), prints one line on stderr when a compilation takes a while, and a one-line summary
of compile time at the end. ``main([...])`` called from Python leaves JAX's configuration
alone unless ``compile_cache=True``.
"""

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
               "`gsm-jax COMMAND --help` describes a command and its options.")
EPILOG = ("The workflow (profile, calibrate, eval, report, bench) reads the WikiText-2 and "
          "LAMBADA files shipped with the package unless --data / --lambada name your own. "
          "Compiled programs are cached in ~/.cache/gsm-jax/jax/<cpu> "
          "(GSM_JAX_COMPILATION_CACHE=0: off; =DIR: another folder).")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the default is None or False (an
    unset option: its help says what that means) or the help names the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or not action.option_strings or default is None
                or default is False or default is argparse.SUPPRESS):
            return text
        if isinstance(default, list | tuple):  # as it is typed: 4,8 or (nargs=2) 16 64
            sep = "," if action.nargs is None else " "
            shown = sep.join(str(v) for v in default).replace("%", "%%")
            return f"{text} (default: {shown})"
        return f"{text} (default: %(default)s)"


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
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="new tokens per prompt at most (a row also ends at EOS or a stop)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (unset: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: the smallest set of tokens with this total "
                        "probability (unset: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (the same seed gives the same output)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, cut from the text (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and compute dtype")
    p.add_argument("--keep-quantized", action="store_true",
                   help="a block-quantized (FP8 / FP4) DeepSeek checkpoint keeps its "
                        "low-precision weights as stored, the rest in --dtype (default: "
                        "dequantized to --dtype at load)")
    p.add_argument("--gsm", type=Path, default=None,
                   help="GSM config file (YAML or JSON; unset: no smoothing)")
    from gsm_jax.quant import add_quantize_argument

    add_quantize_argument(p)


def _run_generate(args: argparse.Namespace) -> int:
    import gsm_jax
    from gsm_jax.workflow.data import check_file_option, read_text

    check_file_option("--prompts-file", args.prompts_file)
    check_file_option("--gsm", args.gsm)
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        prompts += [ln for ln in read_text(args.prompts_file).splitlines() if ln.strip()]
    if not prompts:
        raise gsm_jax.InvalidInputError("no prompts: give prompt texts or --prompts-file")
    # a GSM config file and the quantization options are checked before the model loads
    gsm = None if args.gsm is None else gsm_jax.GSMConfig.from_file(args.gsm)
    from gsm_jax.quant import apply_quantize_option, quantize_option_kwargs

    quant_kwargs = quantize_option_kwargs(args)
    t0 = time.perf_counter()
    params = gsm_jax.load(args.model, dtype=args.dtype,
                          keep_quantized=args.keep_quantized or None, progress=True)
    print(f"[gsm-jax] loaded {params} in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.quantize != "none":
        params = apply_quantize_option(params, args.quantize, **quant_kwargs)
        print(f"[gsm-jax] quantized: {args.quantize}"
              + (f", groups of {quant_kwargs['group_size']}" if "group_size" in quant_kwargs
                 else "")
              + (" (LM head too)" if quant_kwargs.get("head") else ""), flush=True)
    if gsm is not None:
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


def build_parser() -> argparse.ArgumentParser:
    """The ``gsm-jax`` parser with every subcommand of `COMMANDS` (their modules imported)."""
    from gsm_jax import __version__

    parser = argparse.ArgumentParser(prog="gsm-jax", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"gsm-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    for command in COMMANDS:
        add_arguments, _ = command.resolve()
        add_arguments(sub.add_parser(command.name, help=command.help,
                                     description=command.help[:1].upper() + command.help[1:]
                                     + ".", formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None, *, compile_cache: bool | None = None) -> int:
    """Run one ``gsm-jax`` command; the exit code. ``compile_cache``: turn JAX's persistent
    compilation cache on first (default: when run as a program, i.e. ``argv`` is None)."""
    parser = build_parser()
    runs = {c.name: c.resolve()[1] for c in COMMANDS}
    args = parser.parse_args(argv)
    if compile_cache if compile_cache is not None else argv is None:
        from gsm_jax import compile_cache as cc

        cc.enable_compilation_cache()
        cc.announce_compilation()
    try:
        return runs[args.command](args)
    except GSMJaxError as e:
        print(f"gsm-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        from gsm_jax import compile_cache as cc

        summary = cc.compilation_summary()
        if summary is not None:
            print(summary, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
