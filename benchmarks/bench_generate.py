"""Greedy decode throughput of `gsm_jax.generate_tokens` vs transformers' `generate`.

    python benchmarks/bench_generate.py --out runs/bench_generate

In one run, on one machine and one model (fp32, both sides from the same GGUF):

- decode tokens/s and end-to-end tokens/s at each batch size (default 1 and 16), for
  exactly `--new-tokens` greedy tokens per row (EOS never stops a row on either side);
- time to first token (TTFT: a max_new_tokens=1 run of the same batch);
- gsm_jax cold start in a fresh `python -c` process: imports + load + compile + first token;
- the peak RSS of each side, each in its own worker process (`ru_maxrss` via `os.wait4`);
- how many greedy rows of gsm_jax equal transformers' (a correctness sanity check).

Definitions (also written into results.json):

    decode tok/s = batch * (new_tokens - 1) / (t_generate - t_ttft)
    e2e tok/s    = batch * new_tokens / t_generate

with t_generate the wall time of one `generate` call of `new_tokens` tokens and t_ttft
that of a 1-token call on the same batch, both timed inside the side's worker process
in the same repeat. The numbers reported are medians over `--repeats`.

The two sides run in two long-lived worker processes (this script with `--worker`)
driven over stdin/stdout; their timed repeats are interleaved so both see the same
background load. Every prompt has exactly `--prompt-tokens` tokens (from the gsm_jax
tokenizer, WikiText-2 lines), so no side needs padding.

Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import time

_T_MODULE_START = time.time()  # a worker's "interpreter is up" mark (before heavy imports)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from common import (  # noqa: E402
    SHARED_DATA_DIR,
    ChildResult,
    bar_chart,
    load_average,
    machine_info,
    markdown_table,
    python_command,
    run_child,
    start_child,
    summarize,
    wait_child,
    write_json,
    write_markdown,
)

DEFAULT_PROMPT_SOURCE = SHARED_DATA_DIR / "wikitext2_test.txt"
SIDES = ("gsm_jax", "transformers")
# speedup targets (gsm_jax decode tok/s / transformers decode tok/s) and the cold-start limit
RATIO_TARGETS = {1: 1.5, 16: 1.3}
MAX_COMPARABLE_LOAD = 1.5  # 1-minute load average; above it a figure is not comparable
COLD_START_TARGET_S = 20.0
FALLBACK_PROMPTS = [
    "The history of the city begins in the early medieval period, when a small settlement "
    "grew up around the crossing of the river and the market that served the farms nearby.",
    "In the second half of the season the team changed its coach, and the new tactics led to "
    "a run of eleven matches without a defeat before the final game of the year.",
    "The species is found in the forests of the eastern mountains, where it feeds mainly on "
    "insects and small fruit and nests in the hollows of old trees.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model sources


def resolve_model(model: str) -> dict[str, Any]:
    """How each side loads `model`: a registered gsm_jax name, a .gguf file, or an HF directory.

    Returns {"gsm_jax": source for gsm_jax.load, "hf_dir", "hf_gguf_file" (or None)}.
    Importing `gsm_jax.loading` is light (no jax compile), but keep it out of the parent
    process anyway: the GGUF path is looked up the way the loader does.
    """
    from gsm_jax.loading import REGISTERED_MODELS

    if model in REGISTERED_MODELS:
        from gsm_jax.models.gguf_reader import default_gguf_path

        path = default_gguf_path(REGISTERED_MODELS[model])
        directory, name = os.path.split(path)
        return {"gsm_jax": model, "hf_dir": directory, "hf_gguf_file": name, "path": path}
    p = Path(model)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return {"gsm_jax": str(p), "hf_dir": str(p.parent), "hf_gguf_file": p.name,
                "path": str(p)}
    if p.is_dir():
        return {"gsm_jax": str(p), "hf_dir": str(p), "hf_gguf_file": None, "path": str(p)}
    raise SystemExit(f"--model {model!r}: not a registered name, a .gguf file or a directory")


# ----------------------------------------------------------------------------- worker side

# JAX's own compile-time events (trace + lower to MLIR + XLA compile), summed per call
JAX_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """Seconds JAX reported spending on compilation since this process registered it."""

    def __init__(self) -> None:
        import jax.monitoring

        self.total = 0.0
        self.count = 0

        def listener(event: str, duration: float, **_: Any) -> None:
            if event in JAX_COMPILE_EVENTS:
                self.total += duration
                self.count += event == JAX_COMPILE_EVENTS[-1]

        jax.monitoring.register_event_duration_secs_listener(listener)



class GsmJaxSide:
    """gsm_jax in this process: jax defaults, greedy, eos_ids=[-1] (no id is -1: no early stop)."""

    name = "gsm_jax"

    def __init__(self, model: str) -> None:
        self.model = model

    def load(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        import jax

        import gsm_jax

        t1 = time.perf_counter()
        self.compile_clock = CompileClock()
        self.gsm_jax = gsm_jax
        self.params = gsm_jax.load(resolve_model(self.model)["gsm_jax"])
        jax.block_until_ready(self.params.weights)
        t2 = time.perf_counter()
        tok = self.params.tokenizer
        return {
            "import_s": t1 - t0, "load_s": t2 - t1,
            "eos_ids": list(tok.eos_ids) if tok is not None else list(
                self.params.config.eos_token_ids),
            "info": {
                "jax_backend": jax.default_backend(),
                "jax_devices": [str(d) for d in jax.devices()],
                "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
                "dtype": str(self.params.dtype),
                "num_parameters": self.params.num_parameters(),
                "config": repr(self.params.config),
            },
        }

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(self.params.tokenizer.encode(t)) for t in texts]

    def generate(self, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        out = self.gsm_jax.generate_tokens(self.params, rows, max_new_tokens=new_tokens,
                                           eos_ids=[-1])
        return [o.tolist() for o in out]


class TransformersSide:
    """transformers' generate, fp32, greedy, torch threads = core count, EOS disabled."""

    name = "transformers"

    def __init__(self, model: str) -> None:
        self.model = model

    def load(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        import torch
        import transformers

        t1 = time.perf_counter()
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count() or 1)
        self.torch = torch
        src = resolve_model(self.model)
        kwargs = {"gguf_file": src["hf_gguf_file"]} if src["hf_gguf_file"] else {}
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            src["hf_dir"], dtype=torch.float32, **kwargs).eval()
        t2 = time.perf_counter()
        gc = self.hf.generation_config
        eos = gc.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.pad_id = gc.pad_token_id if gc.pad_token_id is not None else (
            eos_ids[0] if eos_ids else 0)
        return {
            "import_s": t1 - t0, "load_s": t2 - t1, "eos_ids": eos_ids,
            "info": {
                "torch_num_threads": torch.get_num_threads(),
                "torch_num_interop_threads": torch.get_num_interop_threads(),
                "torch_threads_set_to": "the cores this worker may run on",
                "dtype": str(next(self.hf.parameters()).dtype),
                "model_class": type(self.hf).__name__,
                "generate_kwargs": "do_sample=False, num_beams=1, eos_token_id=None, "
                                   "min_new_tokens=max_new_tokens=new_tokens, default cache",
            },
        }

    def generate(self, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(rows, dtype=torch.long)
        with torch.inference_mode():
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                eos_token_id=None, pad_token_id=self.pad_id,
            )
        return out[:, ids.shape[1]:].tolist()


def pin_threads(threads: int | None) -> None:
    """Pin this process (before jax / torch start their pools) to its first `threads`
    cores: XLA:CPU sizes its pool from the affinity mask and ignores the Eigen flags;
    torch gets the same count with set_num_threads."""
    if threads and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))[:threads]
        os.sched_setaffinity(0, set(cores))


def worker_main(side_name: str, model: str, threads: int | None = None) -> int:
    """Serve JSON commands, one per stdin line; one JSON reply per line on the real stdout."""
    pin_threads(threads)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (libraries, warnings) goes to stderr
    sys.stdout = sys.stderr
    side = {"gsm_jax": GsmJaxSide, "transformers": TransformersSide}[side_name](model)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "exit":
                break
            if cmd == "load":
                res = side.load()
                res["module_start_time"] = _T_MODULE_START
                res["done_time"] = time.time()
            elif cmd == "encode":
                res = {"rows": side.encode(msg["texts"])}
            elif cmd == "generate":
                clock = getattr(side, "compile_clock", None)
                c0 = clock.total if clock else 0.0
                t0 = time.perf_counter()
                tokens = side.generate(msg["rows"], msg["new_tokens"])
                seconds = time.perf_counter() - t0
                res = {"seconds": seconds, "done_time": time.time(),
                       "compile_s": (clock.total - c0) if clock else None,
                       "lengths": [len(t) for t in tokens],
                       "tokens": tokens if msg.get("return_tokens") else None}
            else:
                res = {"error": f"unknown command {cmd!r}"}
        except Exception:
            res = {"error": traceback.format_exc()}
        reply.write(json.dumps(res) + "\n")
    return 0


class Worker:
    """The parent's handle on one side's worker process."""

    def __init__(self, side: str, model: str, threads: int | None = None) -> None:
        self.side = side
        cmd = python_command(str(Path(__file__).resolve()), "--worker", side, "--model", model,
                             *(["--threads", str(threads)] if threads else []))
        self.proc, self.spawn_time, self.spawn_perf = start_child(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def call(self, cmd: str, **kwargs: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.side} worker exited during {cmd!r}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"{self.side} worker failed on {cmd!r}:\n{res['error']}")
        return res

    def close(self, timeout_s: float = 120.0) -> ChildResult:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        result = wait_child(self.proc, self.spawn_time, self.spawn_perf, timeout_s)
        self.proc.stdout.close()
        return result


# ----------------------------------------------------------------------------- cold start

COLD_START_CODE = r"""
import time
t_start = time.time()
import json, sys
import gsm_jax
t_import = time.time()
import jax, jax.monitoring
compile_s = [0.0]
events = set(sys.argv[4].split(","))
def on_event(event, duration, **kwargs):
    if event in events:
        compile_s[0] += duration
jax.monitoring.register_event_duration_secs_listener(on_event)
params = gsm_jax.load(sys.argv[1])
jax.block_until_ready(params.weights)
t_load = time.time()
ids = params.tokenizer.encode(sys.argv[2])[: int(sys.argv[3])]
out = gsm_jax.generate_tokens(params, [ids], max_new_tokens=1, eos_ids=[-1])
t_first = time.time()
assert len(out[0]) == 1
print(json.dumps({"t_start": t_start, "t_import": t_import, "t_load": t_load,
                  "t_first": t_first, "compile_s": compile_s[0]}))
"""


def measure_cold_start(model_source: str, text: str, prompt_tokens: int) -> dict[str, Any]:
    """gsm_jax cold start in a fresh interpreter: spawn -> imports -> load -> first token."""
    usage, out = run_child(
        python_command("-c", COLD_START_CODE, model_source, text, str(prompt_tokens),
                       ",".join(JAX_COMPILE_EVENTS)),
        timeout_s=600)
    if usage.returncode != 0:
        raise RuntimeError(f"cold-start process failed (exit {usage.returncode})")
    t = json.loads(out.strip().splitlines()[-1])
    return {
        "total_s": t["t_first"] - usage.spawn_time,  # process start -> first token
        "interpreter_start_s": t["t_start"] - usage.spawn_time,
        "import_s": t["t_import"] - t["t_start"],
        "load_s": t["t_load"] - t["t_import"],
        "compile_and_first_token_s": t["t_first"] - t["t_load"],
        "compile_s": t["compile_s"],  # JAX's compile events (trace + lower + XLA compile)
        "process_wall_s": usage.wall_s,  # including interpreter teardown
        "peak_rss_mb": usage.peak_rss_mb,
    }


# ----------------------------------------------------------------------------- prompts


def candidate_texts(source: Path | None) -> tuple[list[str], str]:
    """Prompt texts: WikiText lines (headings and short lines skipped), else built-ins."""
    if source is not None and source.is_file():
        lines = []
        for line in source.read_text(encoding="utf-8").splitlines():
            s = line.strip()
            if len(s) >= 200 and not s.startswith("="):
                lines.append(s)
        if lines:
            return lines, str(source)
    log(f"[bench] prompt source {source} not found or empty: using built-in prompts")
    return list(FALLBACK_PROMPTS), "built-in"


def build_prompts(worker: Worker, texts: list[str], count: int,
                  prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """`count` rows of exactly `prompt_tokens` token ids (gsm_jax tokenizer) + their texts."""
    rows, used = [], []
    for start in range(0, len(texts), 64):
        chunk = texts[start:start + 64]
        for text, ids in zip(chunk, worker.call("encode", texts=chunk)["rows"], strict=True):
            if len(ids) >= prompt_tokens:
                rows.append(ids[:prompt_tokens])
                used.append(text)
            if len(rows) == count:
                return rows, used
    if not rows:
        raise SystemExit(f"no prompt text has {prompt_tokens} tokens; lower --prompt-tokens")
    while len(rows) < count:  # few long texts: reuse them
        rows.append(rows[len(rows) % len(used)])
        used.append(used[len(used) % len(used)])
    return rows, used


# ----------------------------------------------------------------------------- analysis


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Identical rows, and the length of the common prefix of each row pair."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        for p, q in zip(x, y, strict=False):
            if p != q:
                break
            n += 1
        prefixes.append(n)
    same = sum(1 for x, y in zip(a, b, strict=True) if x == y)
    return {
        "rows": len(a), "identical_rows": same,
        "matching_prefix_tokens": prefixes,
        "mean_matching_prefix_tokens": sum(prefixes) / max(len(prefixes), 1),
    }


def side_stats(times: dict[str, list[float]], batch: int, new_tokens: int) -> dict[str, Any]:
    gen, ttft = times["generate_s"], times["ttft_s"]
    decode = [batch * (new_tokens - 1) / (g - t) if g > t else None
              for g, t in zip(gen, ttft, strict=True)]
    e2e = [batch * new_tokens / g for g in gen]
    return {
        "generate_s": summarize(gen), "ttft_s": summarize(ttft),
        "decode_tok_s": summarize(decode), "e2e_tok_s": summarize(e2e),
        "load_average_1m": times["load_1m"],
        "load_average_1m_before": times["load_1m_before"],
        "comparable": all(x is not None and x <= MAX_COMPARABLE_LOAD
                          for x in times["load_1m"] + times["load_1m_before"]),
    }


def median_of(stats: dict[str, Any], key: str) -> float | None:
    s = stats.get(key) or {}
    return s.get("median")


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_run = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    n_new = int(args.new_tokens)
    sides = ["gsm_jax"] if args.skip_transformers else list(SIDES)

    def progress(msg: str) -> None:
        log(f"[bench {time.perf_counter() - t_run:6.1f}s | load {load_average()}] {msg}")

    machine = machine_info()
    progress(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores")
    model = resolve_model(args.model)
    texts, prompt_source = candidate_texts(Path(args.prompt_source) if args.prompt_source
                                           else None)

    # 1. gsm_jax cold start, fresh processes, before anything else of ours runs
    cold = []
    for i in range(args.cold_repeats):
        progress(f"cold start {i + 1}/{args.cold_repeats} (fresh python -c: import, load, "
                 "compile, first token)")
        c = measure_cold_start(model["gsm_jax"], texts[0], args.prompt_tokens)
        progress(f"  cold start {c['total_s']:.1f}s (import {c['import_s']:.1f}, "
                 f"load {c['load_s']:.1f}, compile+first {c['compile_and_first_token_s']:.1f})")
        cold.append(c)

    # 2. workers: load, in-process cold start (first 1-token generate), one at a time
    workers: dict[str, Worker] = {}
    loads: dict[str, Any] = {}
    rows: list[list[int]] = []
    prompt_texts: list[str] = []
    try:
        for side in sides:
            progress(f"starting the {side} worker and loading {args.model}")
            w = workers[side] = Worker(side, args.model, args.threads)
            info = w.call("load")
            if side == "gsm_jax":
                rows, prompt_texts = build_prompts(w, texts, max(batch_sizes),
                                                   args.prompt_tokens)
            first = w.call("generate", rows=rows[:1], new_tokens=1)
            info["interpreter_start_s"] = info["module_start_time"] - w.spawn_time
            info["first_token_s"] = first["seconds"]
            info["first_token_compile_s"] = first["compile_s"]
            info["spawn_to_first_token_s"] = first["done_time"] - w.spawn_time
            loads[side] = info
            progress(f"  {side}: import {info['import_s']:.1f}s, load {info['load_s']:.1f}s, "
                     f"first token {first['seconds']:.1f}s")

        # 3. warm-up: gsm_jax compiles one program per (batch, new-token bucket)
        warmup: dict[str, dict[str, float]] = {s: {} for s in sides}
        for b in batch_sizes:
            for side in sides:
                n_warm = n_new if side == "gsm_jax" else min(n_new, 16)
                progress(f"warm-up {side} batch {b} ({n_warm} tokens + 1-token TTFT run)")
                g = workers[side].call("generate", rows=rows[:b], new_tokens=n_warm)
                t1 = workers[side].call("generate", rows=rows[:b], new_tokens=1)
                warmup[side][f"b{b}_generate_s"] = g["seconds"]
                warmup[side][f"b{b}_ttft_s"] = t1["seconds"]
                if g["compile_s"] is not None:
                    warmup[side][f"b{b}_compile_s"] = g["compile_s"] + t1["compile_s"]

        # 4. timed repeats, the sides interleaved (alternating who goes first)
        times = {s: {b: {"generate_s": [], "ttft_s": [], "load_1m": [], "load_1m_before": [],
                         "compile_s": []}
                     for b in batch_sizes} for s in sides}
        tokens: dict[str, dict[int, list[list[int]]]] = {s: {} for s in sides}
        for b in batch_sizes:
            for r in range(args.repeats):
                order = sides if r % 2 == 0 else sides[::-1]
                for side in order:
                    w = workers[side]
                    load_before = (load_average() or [None])[0]
                    t1 = w.call("generate", rows=rows[:b], new_tokens=1)
                    g = w.call("generate", rows=rows[:b], new_tokens=n_new,
                               return_tokens=(r == args.repeats - 1))
                    if any(n != n_new for n in g["lengths"]):
                        raise RuntimeError(f"{side} generated {g['lengths']} tokens, "
                                           f"not {n_new} per row")
                    rec = times[side][b]
                    rec["generate_s"].append(g["seconds"])
                    rec["ttft_s"].append(t1["seconds"])
                    rec["load_1m"].append((load_average() or [None])[0])
                    rec["load_1m_before"].append(load_before)
                    rec["compile_s"].append((g["compile_s"] or 0.0) + (t1["compile_s"] or 0.0))
                    if g["tokens"] is not None:
                        tokens[side][b] = g["tokens"]
                    dec = b * (n_new - 1) / max(g["seconds"] - t1["seconds"], 1e-9)
                    progress(f"{side:12s} batch {b:3d} repeat {r + 1}/{args.repeats}: "
                             f"generate {g['seconds']:.2f}s, TTFT {t1['seconds'] * 1e3:.0f}ms, "
                             f"decode {dec:.1f} tok/s")
    finally:
        usage = {}
        for side, w in workers.items():
            usage[side] = w.close()
            progress(f"{side} worker exited ({usage[side].returncode}), "
                     f"peak RSS {usage[side].peak_rss_mb:.0f} MB")

    # 5. results
    load_after = load_average()
    results: dict[str, Any] = {
        "benchmark": "bench_generate",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine,
        "load_average_before": machine["load_average_1_5_15"],
        "load_average_after": load_after,
        "settings": {
            "model": args.model, "model_path": model["path"], "dtype": "float32",
            "batch_sizes": batch_sizes, "new_tokens": n_new, "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats, "cold_repeats": args.cold_repeats,
            "prompt_source": prompt_source, "greedy": True,
            "eos": "disabled on both sides: gsm_jax eos_ids=[-1]; transformers eos_token_id="
                   "None, min_new_tokens=max_new_tokens",
            "torch_threads": loads.get("transformers", {}).get("info", {}).get(
                "torch_num_threads"),
            "threads": args.threads,
            "torch_threads_policy": "torch.set_num_threads(cores of the worker's affinity)",
            "jax_threads_policy": ("worker pinned to the first --threads cores "
                                   "(sched_setaffinity)" if args.threads else
                                   "jax/XLA defaults (all cores)"),
        },
        "definitions": {
            "decode_tok_s": "batch * (new_tokens - 1) / (t_generate - t_ttft), per repeat; "
                            "median reported",
            "e2e_tok_s": "batch * new_tokens / t_generate",
            "ttft_s": "wall time of a max_new_tokens=1 generate on the same batch",
            "t_generate": "wall time of one generate call inside the side's worker process",
            "compile_s": "JAX's compile events (jaxpr trace + MLIR lowering + XLA backend "
                         "compile) during the warm-up calls of that batch size (gsm_jax)",
            "timed_calls_compile_s": "the same during the timed calls: should be 0 (no "
                                     "recompilation inside the measurement)",
            "cold_start_s": "fresh `python -c`: process spawn -> imports -> gsm_jax.load -> "
                            "first token of a 1-token generate (batch 1) returned",
            "peak_rss_mb": "ru_maxrss of the side's worker process (load + every batch)",
            "ratio": "gsm_jax median decode tok/s / transformers median decode tok/s",
        },
        "prompts": {"rows": rows, "texts_head": [t[:120] for t in prompt_texts]},
        "cold_start": {
            "gsm_jax": {
                "runs": cold,
                "total_s": summarize([c["total_s"] for c in cold]),
                "target_s": COLD_START_TARGET_S,
                # the median of the cold-start runs decides
                "pass": bool(cold) and summarize([c["total_s"] for c in cold])["median"]
                <= COLD_START_TARGET_S,
            },
        },
        "workers": {},
        "batches": {},
        "wall_s": None,
    }
    for side in sides:
        info = loads[side]
        results["workers"][side] = {
            "peak_rss_mb": usage[side].peak_rss_mb,
            "cpu_user_s": usage[side].user_cpu_s, "cpu_sys_s": usage[side].sys_cpu_s,
            "worker_wall_s": usage[side].wall_s,
            "interpreter_start_s": info["interpreter_start_s"],
            "import_s": info["import_s"], "load_s": info["load_s"],
            "first_token_s": info["first_token_s"],
            "first_token_compile_s": info.get("first_token_compile_s"),
            "spawn_to_first_token_s": info["spawn_to_first_token_s"],
            "eos_ids": info["eos_ids"], "info": info["info"],
            "warmup": warmup[side],
        }
    for b in batch_sizes:
        entry: dict[str, Any] = {}
        for side in sides:
            st = side_stats(times[side][b], b, n_new)
            if side == "gsm_jax":
                st["compile_s"] = warmup[side].get(f"b{b}_compile_s")
                st["timed_calls_compile_s"] = sum(times[side][b]["compile_s"])
            entry[side] = st
        if "transformers" in sides:
            j = median_of(entry["gsm_jax"], "decode_tok_s")
            t = median_of(entry["transformers"], "decode_tok_s")
            je = median_of(entry["gsm_jax"], "e2e_tok_s")
            te = median_of(entry["transformers"], "e2e_tok_s")
            entry["ratio_decode"] = j / t if j and t else None
            entry["ratio_e2e"] = je / te if je and te else None
            entry["target_ratio"] = RATIO_TARGETS.get(b)
            entry["pass"] = (None if entry["target_ratio"] is None or entry["ratio_decode"] is None
                             else entry["ratio_decode"] >= entry["target_ratio"])
            entry["greedy_match"] = compare_tokens(tokens["gsm_jax"][b], tokens["transformers"][b])
            entry["eos_in_output"] = {
                s: sum(int(tok in loads[s]["eos_ids"]) for row in tokens[s][b] for tok in row)
                for s in sides
            }
        results["batches"][str(b)] = entry
    # gsm_jax batch invariance: row 0 of every batch size should be the same greedy continuation
    firsts = {b: tokens["gsm_jax"][b][0] for b in batch_sizes}
    results["gsm_jax_row0_same_across_batch_sizes"] = len({tuple(v) for v in firsts.values()}) == 1
    results["wall_s"] = time.perf_counter() - t_run
    # other processes on the machine: 1-minute load averages seen before, during and after
    seen = [x for x in [(machine["load_average_1_5_15"] or [None])[0],
                        (load_after or [None])[0]] if x is not None]
    seen += [x for s_ in sides for b in batch_sizes for x in times[s_][b]["load_1m"]
             if x is not None]
    cores = machine["cpu_count"] or 1
    results["contention"] = {
        "max_load_1m": max(seen) if seen else None, "cores": cores,
        "contended": bool(seen) and max(seen) > MAX_COMPARABLE_LOAD,
        "limit": MAX_COMPARABLE_LOAD,
        "note": "figures taken while the 1-minute load average was above 1.5 are not "
                "comparable. This run alone keeps the load near its thread count (one side "
                "computes at a time): --threads 1 stays under the limit, all cores do not "
                "(the run's own load, recorded, not other processes). torch's OpenMP threads "
                "slow down more than XLA's under contention (a 4x ratio error once)",
    }

    write_json(out_dir / "results.json", results)
    write_markdown(out_dir / "results.md", render_markdown(results))
    plot(results, out_dir / "results.png")
    progress(f"wrote {out_dir}/results.json, results.md, results.png")
    return results


# ----------------------------------------------------------------------------- rendering


def render_markdown(res: dict[str, Any]) -> str:
    s, m = res["settings"], res["machine"]
    has_tf = "transformers" in res["workers"]
    rows = []
    for b, entry in res["batches"].items():
        for side in ("gsm_jax", "transformers"):
            if side not in entry:
                continue
            st = entry[side]
            is_jax = side == "gsm_jax"
            ratio = entry.get("ratio_decode") if is_jax else (1.0 if has_tf else None)
            target = entry.get("target_ratio") if is_jax else None
            passed = entry.get("pass") if is_jax else None
            loads = [x for x in st.get("load_average_1m_before", []) + st["load_average_1m"]
                     if x is not None]
            rows.append([
                side, int(b), median_of(st, "decode_tok_s"), median_of(st, "e2e_tok_s"),
                (median_of(st, "ttft_s") or 0.0) * 1e3, ratio,
                None if target is None else f"≥ {target:g}×",
                None if passed is None else ("PASS" if passed else "FAIL"),
                f"{max(loads):.2f}" if loads else None,
                "yes" if st.get("comparable") else "NO (load > 1.5)",
            ])
    out = [
        "# bench_generate: greedy decode, gsm_jax vs transformers\n",
        f"{res['machine']['date']} · {m['cpu_model']} · {m['cpu_count']} cores · "
        f"load avg before {res['load_average_before']} / after {res['load_average_after']} · "
        f"model `{s['model']}` fp32 · prompts {s['prompt_tokens']} tokens · "
        f"{s['new_tokens']} new tokens · median of {s['repeats']} repeats · "
        f"threads per side {s.get('threads') or 'all cores'} (torch {s['torch_threads']}) · "
        f"jax {m['versions'].get('jax')}, "
        f"torch {m['versions'].get('torch')}, transformers {m['versions'].get('transformers')}\n",
        (f"\n**Not comparable: the 1-minute load average reached "
         f"{res['contention']['max_load_1m']} on {res['contention']['cores']} cores (limit "
         f"{MAX_COMPARABLE_LOAD}); rerun with --threads 1 on an idle machine.**\n\n"
         if res.get("contention", {}).get("contended") else "\n"),
        markdown_table(
            ["side", "batch", "decode tok/s", "e2e tok/s", "TTFT ms",
             "ratio vs transformers (decode)", "target", "pass/fail", "max load 1m",
             "comparable"],
            rows, digits=1,
        ),
    ]
    cs = res["cold_start"]["gsm_jax"]
    if cs["runs"]:
        c = cs["runs"][0] if len(cs["runs"]) == 1 else min(cs["runs"],
                                                           key=lambda r: r["total_s"])
        out.append("\n## Cold start (gsm_jax, fresh process, batch 1, 1 token)\n\n")
        out.append(markdown_table(
            ["total s (median)", "interpreter s", "import s", "load s",
             "compile + first token s", "of which compile s", "peak RSS MB", "target",
             "pass/fail"],
            [[cs["total_s"]["median"], c["interpreter_start_s"], c["import_s"], c["load_s"],
              c["compile_and_first_token_s"], c["compile_s"], c["peak_rss_mb"],
              f"≤ {cs['target_s']:g} s",
              "PASS" if cs["pass"] else "FAIL"]],
        ))
    out.append("\n## Workers (each side in its own process)\n\n")
    wrows = []
    for side, w in res["workers"].items():
        compiles = [res["batches"][b][side].get("compile_s") for b in res["batches"]]
        wrows.append([side, w["peak_rss_mb"], w["import_s"], w["load_s"], w["first_token_s"],
                      w["spawn_to_first_token_s"],
                      ", ".join(f"b{b}: {c:.1f}" for b, c in zip(res["batches"], compiles,
                                                                strict=True) if c is not None)
                      or None])
    out.append(markdown_table(
        ["side", "peak RSS MB", "import s", "load s", "first token s",
         "spawn → first token s", "compile s (warm-up)"], wrows))
    if has_tf:
        out.append("\n## Greedy agreement (last timed repeat)\n\n")
        grows = []
        for b, entry in res["batches"].items():
            g = entry["greedy_match"]
            grows.append([int(b), f"{g['identical_rows']}/{g['rows']}",
                          g["mean_matching_prefix_tokens"], min(g["matching_prefix_tokens"]),
                          entry["eos_in_output"]["gsm_jax"],
                          entry["eos_in_output"]["transformers"]])
        out.append(markdown_table(
            ["batch", "identical rows", "mean matching prefix (tokens)", "min prefix",
             "EOS ids emitted (gsm_jax)", "EOS ids emitted (transformers)"], grows, digits=1))
    out.append(f"\ngsm_jax row 0 identical across batch sizes: "
               f"{res['gsm_jax_row0_same_across_batch_sizes']}. Run wall time "
               f"{res['wall_s']:.0f} s.\n")
    return "".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    groups = [f"batch {b}" for b in res["batches"]]
    series = {}
    for side in ("gsm_jax", "transformers"):
        if side in res["workers"]:
            series[side] = [median_of(res["batches"][b][side], "decode_tok_s")
                            for b in res["batches"]]
    m, s = res["machine"], res["settings"]
    bar_chart(path, groups, series, ylabel="decode tokens/s (median)",
              title=f"{s['model']} fp32 greedy, {s['new_tokens']} new tokens — "
                    f"{m['cpu_count']}-core {m['cpu_model']}")


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_generate", help="output directory")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file or Hugging Face directory")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated (default 1,16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32,
                   help="every prompt is cut to exactly this many tokens")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per batch and side")
    p.add_argument("--cold-repeats", type=int, default=1, help="gsm_jax cold-start processes")
    p.add_argument("--prompt-source", default=str(DEFAULT_PROMPT_SOURCE),
                   help="text file, one prompt candidate per line (default: WikiText-2 test)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="cores per side (both pinned to the same first N cores; torch gets N "
                        "threads). Default: all cores. With 1 the run keeps the load average "
                        "near 1, so the 1.5 comparability limit can hold")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode excludes the first token)")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.model, args.threads)
    res = run(args)
    print(render_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
