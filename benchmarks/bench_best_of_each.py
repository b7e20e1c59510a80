"""Best of each side: greedy decode speed and quality of every precision setting of gsm_jax,
transformers (and llama.cpp when llama-cpp-python is installed), side by side, in one run.

    python benchmarks/bench_best_of_each.py --threads 1 --repeats 3 --out reports/data/best_of_each

For one model (default SmolLM2-135M, every side loading the same GGUF), each setting gets:

- speed: decode tokens/s of greedy `generate` at each batch size (default 1 and 16),
  `--new-tokens` tokens per row, EOS disabled; decode tok/s = batch * (new_tokens - 1) /
  (t_generate - t_ttft), median over `--repeats` (bench_generate's definition and worker
  machinery: one long-lived worker process per side, the timed calls of every setting of
  every side interleaved round by round, the order reversed every other round, the
  1-minute load average read before and after each timed call);
- quality: the mean over tokens of KL(fp32 || setting) of the next-token distributions,
  teacher-forced on the last `--kld-windows` x `--kld-tokens` WikiText-2 tokens, each side
  against its own fp32 (llama.cpp, which has no fp32 of its own here, against gsm_jax's);
- within budget: mean KLD <= 0.005 (`--kld-budget`). The best of a side at a batch size is
  its fastest setting within the budget.

Settings (`--settings`, comma list of names, or a side name for all of its settings):

- gsm_jax:fp32, gsm_jax:bf16 (`gsm_jax.load(..., dtype=...)`), gsm_jax:w8a16, gsm_jax:w8a8
  (`gsm_jax.quant.quantize`), gsm_jax:w8a16+head (`quantize(..., 'w8a16', head=True)`),
  gsm_jax:w8a16g32, gsm_jax:w8a16g32+head (`quantize(..., 'w8a16', group_size=32)`),
  gsm_jax:w8a8+smoothquant (`gsm_jax.workflow.evidence.quant_quality`:
  activation statistics on the first WikiText-2 tokens, disjoint from the KLD windows,
  per-layer alphas from `local_smoothquant_alphas`, or `--sq-alphas search|best`);
- transformers:fp32, transformers:bf16 (`model.to(torch.bfloat16)`),
  transformers:int8-dynamic (`torch.ao.quantization.quantize_dynamic`; an error is recorded
  as the setting's status);
- llama_cpp:gguf (the GGUF as stored, batch 1 only), run only if llama-cpp-python imports.

Also recorded: a sanity row (gsm_jax fp32 vs transformers fp32 KLD, ~1e-6 expected), the
CPU's bf16 / int8 feature flags and what XLA:CPU compiles a bf16 decode step into.

Outputs in `--out`: results.json, results.md, results.png. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402  (no jax / torch at import)
from common import (  # noqa: E402
    SHARED_DATA_DIR,
    bar_chart,
    cpu_flags,
    load_average,
    machine_info,
    markdown_table,
    python_command,
    start_child,
    write_json,
    write_markdown,
)

KLD_BUDGET = 0.005
SIDES = ("gsm_jax", "transformers", "llama_cpp")
SETTINGS: dict[str, str] = {
    "gsm_jax:fp32": "gsm_jax.load(..., dtype='float32'): the GGUF's weights as f32",
    "gsm_jax:bf16": "gsm_jax.load(..., dtype='bfloat16'): bf16 weights and KV cache",
    "gsm_jax:w8a16": "gsm_jax.quant.quantize(fp32, 'w8a16'): int8 weights, f32 activations "
                     "(decode on CPU: the int8 matrix-vector kernel, int16 activations)",
    "gsm_jax:w8a16+head": "gsm_jax.quant.quantize(fp32, 'w8a16', head=True): w8a16 with the "
                          "LM head int8 too (one scale per vocabulary entry)",
    "gsm_jax:w8a16g32": "gsm_jax.quant.quantize(fp32, 'w8a16', group_size=32): int8 weights "
                        "with a float16 scale and offset per 32 input channels and output "
                        "channel",
    "gsm_jax:w8a16g32+head": "gsm_jax.quant.quantize(fp32, 'w8a16', group_size=32, "
                             "head=True): the same with the LM head grouped too",
    "gsm_jax:w8a8": "gsm_jax.quant.quantize(fp32, 'w8a8'): int8 weights, per-token int8 "
                    "activations",
    "gsm_jax:w8a8+smoothquant": "gsm_jax.quant_quality.smoothquant_params (alphas below), "
                                "then quantize(..., 'w8a8')",
    "transformers:fp32": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
                         "dtype=torch.float32)",
    "transformers:bf16": "a copy of the fp32 model, .to(torch.bfloat16)",
    "transformers:int8-dynamic": "torch.ao.quantization.quantize_dynamic(fp32, {nn.Linear}, "
                                 "dtype=torch.qint8): int8 weights, activations quantized "
                                 "with one scale per tensor per call (teacher-forced, that is "
                                 "every token of the forward: harsher than decode at batch 1, "
                                 "one token per call); which modules it replaced: note",
    "llama_cpp:gguf": "llama-cpp-python on the same GGUF, weights as stored; batch 1 only "
                      "(its Llama API runs one sequence)",
}
# each side's KLD reference (llama.cpp has no fp32 of this file: gsm_jax's stands in)
REFERENCE = {"gsm_jax": "gsm_jax:fp32", "transformers": "transformers:fp32",
             "llama_cpp": "gsm_jax:fp32"}
LLAMA_CPP_MISSING = "llama-cpp-python not installed (optional extra)"
DEFAULT_DATA = SHARED_DATA_DIR / "wikitext2_test.txt"
TINY = {"batch_sizes": "1", "new_tokens": 4, "repeats": 1, "kld_windows": 1, "kld_tokens": 32,
        "kld_batch": 1, "prompt_tokens": 8, "sq_seq_len": 32, "sq_calib_sequences": 2,
        "sq_local_sequences": 1, "sq_search_sequences": 1}

log = bg.log


def side_of(name: str) -> str:
    return name.split(":", 1)[0]


def short_of(name: str) -> str:
    return name.split(":", 1)[1]


def parse_settings(text: str | None) -> list[str]:
    """Setting names from a comma list (a side name stands for all of its settings), in
    SETTINGS order; ValueError naming the valid ones for anything unknown."""
    if not text:
        return list(SETTINGS)
    wanted, unknown = set(), []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok in SETTINGS:
            wanted.add(tok)
        elif tok in SIDES:
            wanted |= {n for n in SETTINGS if side_of(n) == tok}
        else:
            unknown.append(tok)
    if unknown or not wanted:
        raise ValueError(f"unknown setting(s) {', '.join(map(repr, unknown)) or '(none given)'}"
                         f"; valid settings: {', '.join(SETTINGS)} (or a side: "
                         f"{', '.join(SIDES)})")
    return [n for n in SETTINGS if n in wanted]


def kld_summary(kld: np.ndarray, same_top1: np.ndarray) -> dict[str, Any]:
    """Per-token KL(reference || setting) values -> the recorded statistics."""
    k = np.asarray(kld, np.float64).ravel()
    return {"mean_kld": float(k.mean()), "p99_kld": float(np.percentile(k, 99)),
            "max_kld": float(k.max()), "mean_kld_stderr": float(k.std() / np.sqrt(k.size)),
            "same_top1_pct": float(100.0 * np.mean(same_top1)), "tokens": int(k.size)}


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else str(text)


# ----------------------------------------------------------------------------- bf16 on XLA:CPU

_HLO_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_HLO_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (dot|convert)\(([^)]*)\)")


def hlo_dtype_summary(hlo_text: str, min_elements: int = 65536) -> dict[str, Any]:
    """From a compiled program's text (`.lower(...).compile().as_text()`): dots by operand
    dtypes, and bf16 -> f32 converts, those of at least `min_elements` elements (weight
    matrices, for a decode step) counted apart."""
    types = {m.group(1): m.group(2) for m in map(_HLO_DEF.match, hlo_text.splitlines()) if m}
    dots: Counter = Counter()
    converts = big = 0
    for line in hlo_text.splitlines():
        m = _HLO_OP.match(line)
        if not m:
            continue
        operands = [o.strip().lstrip("%") for o in m.group(5).split(",") if o.strip()]
        in_types = [types.get(o, "?") for o in operands]
        if m.group(4) == "dot":
            dots[f"{'x'.join(in_types)}->{m.group(2)}"] += 1
        elif m.group(2) == "f32" and in_types == ["bf16"]:
            converts += 1
            size = int(np.prod([int(d) for d in m.group(3).split(",") if d] or [1]))
            big += size >= min_elements
    bf16_in = {k: "bf16" in k.split("->")[0] for k in dots}
    return {"dots_by_operand_dtypes": dict(dots),
            "dots_with_bf16_operands": sum(v for k, v in dots.items() if bf16_in[k]),
            "dots_with_f32_operands_only": sum(v for k, v in dots.items() if not bf16_in[k]),
            "bf16_to_f32_converts": converts,
            f"bf16_to_f32_converts_of_at_least_{min_elements}_elements": big,
            "large_convert_threshold_elements": min_elements}


def bf16_sentence(summary: dict[str, Any] | None, flags: dict[str, Any]) -> str:
    have = ", ".join(f"{k} {'yes' if v else 'no' if v is not None else '?'}"
                     for k, v in flags.items() if "bf16" in k or k == "amx_tile")
    if not summary or "error" in summary:
        why = (summary or {}).get("error", "gsm_jax:bf16 was not among the settings")
        return f"This CPU: {have}. The bf16 decode step was not compiled ({why})."
    n = summary["large_convert_threshold_elements"]
    big = summary[f"bf16_to_f32_converts_of_at_least_{n}_elements"]
    return (f"This CPU: {have}. XLA:CPU (jax {summary.get('jax')}) compiles gsm_jax's bf16 "
            f"decode step (batch 1) with {summary['dots_with_bf16_operands']} dots on bf16 "
            f"operands and {summary['dots_with_f32_operands_only']} on f32 operands, after "
            f"{big} weight-sized (>= {n} elements) bf16->f32 converts: "
            + ("the bf16 weights are widened to f32 before their matmuls, which then run in "
               "f32 (bf16 halves the bytes stored, not the matmul work)."
               if big and summary["dots_with_f32_operands_only"] >= big else
               "the matmuls take bf16 operands directly."))


# ----------------------------------------------------------------------------- worker sides


class JaxSettings(bg.GsmJaxSide):
    """gsm_jax's settings in one process; fp32 is always loaded (the KLD reference)."""

    def __init__(self, model: str, threads: int | None) -> None:
        super().__init__(model)
        self.variants: dict[str, Any] = {}
        self.selected: list[str] = []

    def cmd_setup(self, settings: list[str], sq: dict[str, Any], data: str) -> dict[str, Any]:
        info = self.load()  # gsm_jax.load(model): float32 weights (its default for a GGUF)
        self.fp32 = self.params
        self.variants = {"fp32": self.fp32}
        self.selected = [short_of(s) for s in settings]
        status: dict[str, Any] = {"gsm_jax:fp32": {"status": "ok", "build_s": info["load_s"]}}
        for short in self.selected:
            if short == "fp32":
                continue
            t = time.perf_counter()
            try:
                self.variants[short], note = self._build(short, sq, data)
                status[f"gsm_jax:{short}"] = {"status": "ok", "note": note,
                                              "build_s": time.perf_counter() - t}
            except Exception as exc:  # recorded as the setting's status
                log(traceback.format_exc())
                status[f"gsm_jax:{short}"] = {"status": "error",
                                              "error": f"{type(exc).__name__}: {exc}"}
            log(f"[gsm_jax] {short}: {status[f'gsm_jax:{short}']['status']} "
                f"({time.perf_counter() - t:.1f}s)")
        return {"info": info, "status": status}

    def _build(self, short: str, sq: dict[str, Any], data: str) -> tuple[Any, Any]:
        import gsm_jax
        from gsm_jax.quant import quantize

        if short == "bf16":
            return gsm_jax.load(bg.resolve_model(self.model)["gsm_jax"], dtype="bfloat16"), None
        if short in ("w8a16", "w8a8"):
            return quantize(self.fp32, short), None
        if short == "w8a16+head":
            return quantize(self.fp32, "w8a16", head=True), None
        if short in ("w8a16g32", "w8a16g32+head"):
            return quantize(self.fp32, "w8a16", group_size=32, head=short.endswith("+head")), None
        if short == "w8a8+smoothquant":
            return self._smoothquant(sq, data)
        raise ValueError(f"unknown gsm_jax setting {short!r}")

    def _smoothquant(self, sq: dict[str, Any], data: str) -> tuple[Any, dict[str, Any]]:
        """As benchmarks/quant_quality.py builds it: activation absmax on the calibration
        tokens, per-layer alphas from each linear's own W8A8 error ("local"), the per-kind
        coordinate descent on the calibration KLD ("search"), or the better of the two."""
        from gsm_jax.quant import activation_absmax, activation_samples, quantize
        from gsm_jax.workflow.data import load_wikitext_sequences
        from gsm_jax.workflow.evidence.quant_quality import (
            ReferenceKLD,
            local_smoothquant_alphas,
            search_smoothquant_alphas,
            smoothquant_params,
        )

        p, mode = self.fp32, sq["alphas"]
        calib = load_wikitext_sequences(p.tokenizer, data, seq_len=sq["seq_len"],
                                        num_sequences=sq["calib_sequences"])
        absmax = activation_absmax(p, calib, batch_size=sq["batch_size"])
        note: dict[str, Any] = {"calibration": f"first {sq['calib_sequences']} x "
                                               f"{sq['seq_len']} tokens of {data}",
                                "alpha_mode": mode}
        local = kind = None
        if mode in ("local", "best"):
            samples = activation_samples(p, calib[: sq["local_sequences"]])
            local, _ = local_smoothquant_alphas(p, absmax, samples, log=log)
        if mode in ("search", "best"):
            search = ReferenceKLD(p, calib[: sq["search_sequences"]], sq["batch_size"])
            kind, trials = search_smoothquant_alphas(p, absmax, search, log=log)
            note["calibration_kld_per_kind"] = min(t["kld"] for t in trials)
            if local is not None:
                note["calibration_kld_per_layer"] = search(
                    quantize(smoothquant_params(p, absmax, local), "w8a8"))
        if mode == "best":
            use_local = note["calibration_kld_per_layer"] < note["calibration_kld_per_kind"]
            note["choice"] = "per layer" if use_local else "per kind"
            alphas = local if use_local else kind
        else:
            alphas = local if mode == "local" else kind
        note["alphas"] = {k: np.asarray(v, float).round(2).tolist() for k, v in alphas.items()}
        return quantize(smoothquant_params(p, absmax, alphas), "w8a8"), note

    def cmd_encode(self, texts: list[str]) -> dict[str, Any]:
        return {"rows": self.encode(texts)}

    def cmd_windows(self, data: str, windows: int, tokens: int) -> dict[str, Any]:
        from gsm_jax.workflow.data import load_wikitext_sequences

        rows = load_wikitext_sequences(self.fp32.tokenizer, data, seq_len=tokens,
                                       num_sequences=windows, from_end=True)
        return {"windows": rows.tolist()}

    def cmd_kld(self, windows: list[list[int]], batch_size: int, ref_dir: str) -> dict[str, Any]:
        """ReferenceKLD (the library's) of every selected setting against fp32; the fp32
        log-probs are also written to ref_dir for the other sides' comparisons."""
        from gsm_jax.workflow.evidence.quant_quality import ReferenceKLD

        t = time.perf_counter()
        ref = ReferenceKLD(self.fp32, np.asarray(windows, np.int32), batch_size)
        for i, lp in enumerate(ref.base):
            np.save(Path(ref_dir) / f"gsm_jax_fp32_{i}.npy", np.asarray(lp, np.float32))
        log(f"[gsm_jax] fp32 reference log-probs ({time.perf_counter() - t:.1f}s)")
        out = {}
        for short in self.selected:
            if short not in self.variants:
                continue
            t = time.perf_counter()
            st = ref.stats(self.variants[short])
            out[f"gsm_jax:{short}"] = {**kld_summary(st["kld"], st["same_top1"]),
                                       "seconds": time.perf_counter() - t}
            log(f"[gsm_jax] KLD {short}: {out[f'gsm_jax:{short}']['mean_kld']:.6f} "
                f"({time.perf_counter() - t:.1f}s)")
        return {"kld": out}

    def cmd_bf16_hlo(self, cache_len: int) -> dict[str, Any]:
        """The compiled text of one bf16 decode step (batch 1), summarised by dtypes."""
        import jax
        import jax.numpy as jnp

        from gsm_jax.families import family_module

        if "bf16" not in self.variants:
            return {"summary": {"error": "gsm_jax:bf16 did not load"}}
        p = self.variants["bf16"]
        fam = family_module(p.config.family)
        step = jax.jit(functools.partial(fam.decode_step, cfg=p.config))
        cache = fam.init_cache(p.config, 1, cache_len, dtype=jnp.bfloat16)
        text = step.lower(p.weights, tokens=jnp.zeros((1,), jnp.int32),
                          cache=cache).compile().as_text()
        return {"summary": {**hlo_dtype_summary(text), "jax": jax.__version__,
                            "program": "jax.jit(decode_step) of gsm_jax:bf16, batch 1, "
                                       f"cache {cache_len}"}}

    def generate_with(self, short: str, rows: list[list[int]], new_tokens: int) -> list:
        self.params = self.variants[short]
        try:
            return self.generate(rows, new_tokens)
        finally:
            self.params = self.fp32


class TorchSettings(bg.TransformersSide):
    """transformers' settings in one process; fp32 is always loaded (the KLD reference)."""

    def __init__(self, model: str, threads: int | None) -> None:
        super().__init__(model)
        self.variants: dict[str, Any] = {}
        self.selected: list[str] = []

    def cmd_setup(self, settings: list[str], **_: Any) -> dict[str, Any]:
        info = self.load()
        torch = self.torch
        self.fp32 = self.hf
        self.variants = {"fp32": self.fp32}
        self.selected = [short_of(s) for s in settings]
        status: dict[str, Any] = {"transformers:fp32": {"status": "ok",
                                                        "build_s": info["load_s"]}}
        for short in self.selected:
            if short == "fp32":
                continue
            t = time.perf_counter()
            note = None
            try:
                if short == "bf16":
                    model = copy.deepcopy(self.fp32).to(torch.bfloat16).eval()
                elif short == "int8-dynamic":
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        model = torch.ao.quantization.quantize_dynamic(
                            self.fp32, {torch.nn.Linear}, dtype=torch.qint8).eval()
                    msgs = sorted({str(w.message).splitlines()[0].strip() for w in caught})
                    kinds = Counter(m._get_name() for m in model.modules()
                                    if isinstance(m, torch.nn.Linear)
                                    or m._get_name() == "DynamicQuantizedLinear")
                    head = getattr(model, "lm_head", None)
                    note = {"modules": dict(kinds), "warnings": msgs,
                            "lm_head": None if head is None else head._get_name()}
                    with torch.inference_mode():  # fails here if the kernels are gone
                        model(torch.tensor([[1, 2, 3]]))
                else:
                    raise ValueError(f"unknown transformers setting {short!r}")
                self.variants[short] = model
                status[f"transformers:{short}"] = {"status": "ok", "note": note,
                                                   "build_s": time.perf_counter() - t}
            except Exception as exc:  # recorded as the setting's status
                log(traceback.format_exc())
                status[f"transformers:{short}"] = {"status": "error", "note": note,
                                                   "error": f"{type(exc).__name__}: {exc}"}
            log(f"[transformers] {short}: {status[f'transformers:{short}']['status']} "
                f"({time.perf_counter() - t:.1f}s)")
        return {"info": info, "status": status}

    def cmd_kld(self, windows: list[list[int]], batch_size: int, ref_dir: str) -> dict[str, Any]:
        """KL(fp32 || setting) per token (float32 log-softmax, as gsm_jax's metrics), and
        KL(gsm_jax fp32 || transformers fp32) from gsm_jax's saved log-probs (the sanity
        row, in float64)."""
        torch = self.torch

        def stats(lp, lq):
            kld = (lp.exp() * (lp - lq)).sum(-1)[:, :-1]
            same = (lp.argmax(-1) == lq.argmax(-1))[:, :-1]
            return kld.double().numpy(), same.numpy()

        names = [s for s in self.selected if s in self.variants]
        acc: dict[str, list] = {n: [] for n in [*names, "sanity"]}
        seconds = dict.fromkeys(names, 0.0)
        with torch.inference_mode():
            for i in range(0, len(windows), batch_size):
                ids = torch.tensor(windows[i: i + batch_size], dtype=torch.long)
                logits = self.fp32(ids).logits
                ref = logits.float().log_softmax(-1)
                jax_file = Path(ref_dir) / f"gsm_jax_fp32_{i // batch_size}.npy"
                if jax_file.exists():  # in float64, both renormalised: at ~1e-6 the f32
                    # log-softmax's own rounding (~1e-6 per token) would dominate
                    jax_lp = torch.from_numpy(np.load(jax_file)).double().log_softmax(-1)
                    acc["sanity"].append(stats(jax_lp, logits.double().log_softmax(-1)))
                for short in names:
                    t = time.perf_counter()
                    lq = self.variants[short](ids).logits.float().log_softmax(-1)
                    acc[short].append(stats(ref, lq))
                    seconds[short] += time.perf_counter() - t
        out = {}
        for name, parts in acc.items():
            if parts:
                key = name if name == "sanity" else f"transformers:{name}"
                out[key] = kld_summary(np.concatenate([k for k, _ in parts]),
                                       np.concatenate([s for _, s in parts]))
                if name != "sanity":
                    out[key]["seconds"] = seconds[name]
                log(f"[transformers] KLD {name}: {out[key]['mean_kld']:.6f}")
        return {"kld": {k: v for k, v in out.items() if k != "sanity"},
                "sanity": out.get("sanity")}

    def generate_with(self, short: str, rows: list[list[int]], new_tokens: int) -> list:
        self.hf = self.variants[short]
        try:
            return self.generate(rows, new_tokens)
        finally:
            self.hf = self.fp32


class LlamaCppSettings:
    """llama-cpp-python on the GGUF as stored: greedy by argmax of its logits."""

    def __init__(self, model: str, threads: int | None) -> None:
        self.model = model

    def cmd_setup(self, settings: list[str], n_ctx: int, **_: Any) -> dict[str, Any]:
        t = time.perf_counter()
        import llama_cpp

        path = bg.resolve_model(self.model)["path"]
        if not str(path).lower().endswith(".gguf"):
            raise ValueError(f"llama.cpp needs a .gguf file, not {path}")
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                                   n_threads=threads, n_threads_batch=threads,
                                   logits_all=True, verbose=False)
        return {"info": {"llama_cpp_version": getattr(llama_cpp, "__version__", None),
                         "n_threads": threads, "n_ctx": n_ctx, "model_path": str(path)},
                "status": {"llama_cpp:gguf": {"status": "ok",
                                              "build_s": time.perf_counter() - t}}}

    def _eval(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval([int(i) for i in ids])

    def cmd_kld(self, windows: list[list[int]], batch_size: int, ref_dir: str) -> dict[str, Any]:
        kld, same = [], []
        t = time.perf_counter()
        for j, row in enumerate(windows):
            lp = np.load(Path(ref_dir) / f"gsm_jax_fp32_{j // batch_size}.npy")[j % batch_size]
            self._eval(row)
            lq = np.asarray(self.llm.scores[: len(row)], np.float64)
            lq = lq - lq.max(-1, keepdims=True)
            lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
            lp = lp.astype(np.float64)
            kld.append((np.exp(lp) * (lp - lq)).sum(-1)[:-1])
            same.append((lp.argmax(-1) == lq.argmax(-1))[:-1])
        out = {**kld_summary(np.concatenate(kld), np.concatenate(same)),
               "seconds": time.perf_counter() - t}
        log(f"[llama_cpp] KLD gguf vs gsm_jax fp32: {out['mean_kld']:.6f}")
        return {"kld": {"llama_cpp:gguf": out}}

    def generate_with(self, short: str, rows: list[list[int]], new_tokens: int) -> list:
        if len(rows) != 1:
            raise ValueError("llama-cpp-python's Llama runs one sequence: batch 1 only")
        self._eval(rows[0])
        out: list[int] = []
        for _ in range(new_tokens):
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            if len(out) < new_tokens:
                self.llm.eval([out[-1]])
        return [out]


WORKER_SIDES = {"gsm_jax": JaxSettings, "transformers": TorchSettings,
                "llama_cpp": LlamaCppSettings}


def worker_main(side_name: str, model: str, threads: int | None) -> int:
    """Serve JSON commands, one per stdin line; one JSON reply per line on the real stdout
    (bench_generate's protocol; `generate` timed here, around the call only)."""
    bg.pin_threads(threads)  # before jax / torch start their thread pools
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (libraries, warnings) goes to stderr
    sys.stdout = sys.stderr
    side = WORKER_SIDES[side_name](model, threads)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "exit":
            break
        try:
            if cmd == "generate":
                clock = getattr(side, "compile_clock", None)
                c0 = clock.total if clock else 0.0
                t0 = time.perf_counter()
                tokens = side.generate_with(short_of(msg["setting"]), msg["rows"],
                                            msg["new_tokens"])
                res = {"seconds": time.perf_counter() - t0,
                       "compile_s": (clock.total - c0) if clock else None,
                       "lengths": [len(t) for t in tokens]}
            else:
                res = getattr(side, f"cmd_{cmd}")(**msg)
        except Exception:  # the parent decides
            res = {"error": traceback.format_exc()}
        reply.write(json.dumps(res) + "\n")
    return 0


class Worker(bg.Worker):
    """bench_generate's worker handle, started on this script."""

    def __init__(self, side: str, model: str, threads: int | None = None) -> None:
        self.side = side
        cmd = python_command(str(Path(__file__).resolve()), "--worker", side, "--model", model,
                             *(["--threads", str(threads)] if threads else []))
        self.proc, self.spawn_time, self.spawn_perf = start_child(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


# ----------------------------------------------------------------------------- the run


def new_record(name: str) -> dict[str, Any]:
    side = side_of(name)
    return {"side": side, "name": name, "setting": short_of(name),
            "description": SETTINGS[name], "status": "ok", "error": None, "note": None,
            "build_s": None, "kld_reference": REFERENCE[side], "kld": None, "kld_stats": None,
            "within_budget": None, "decode_tok_s": {}, "speed": {}, "comparable": None,
            "load_1m_before": {}, "load_1m_after": {}, "best_at_batch": []}


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_run = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    n_new = int(args.new_tokens)
    selected = args.settings_list

    def progress(msg: str) -> None:
        log(f"[best_of_each {time.perf_counter() - t_run:6.1f}s | load {load_average()}] {msg}")

    machine = machine_info()
    flags = cpu_flags()
    progress(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores; cpu flags "
             f"{', '.join(k for k, v in flags.items() if v)}; settings: {', '.join(selected)}")
    model = bg.resolve_model(args.model)
    records = {n: new_record(n) for n in selected}
    texts, prompt_source = bg.candidate_texts(Path(args.data))
    sq = {"alphas": args.sq_alphas, "seq_len": args.sq_seq_len,
          "calib_sequences": args.sq_calib_sequences,
          "local_sequences": args.sq_local_sequences,
          "search_sequences": args.sq_search_sequences, "batch_size": args.kld_batch}

    def fail_side(side: str, exc: BaseException) -> None:
        log(str(exc))
        for rec in records.values():
            if rec["side"] == side and rec["status"] == "ok":
                rec["status"], rec["error"] = "error", last_line(str(exc))

    workers: dict[str, Worker] = {}
    infos: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    sanity = hlo = None
    times: dict[str, dict[int, dict[str, list]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="best_of_each_") as ref_dir:
            # 1. gsm_jax: always (its tokenizer cuts the prompts and the KLD windows; its
            #    fp32 is the reference of the sanity row and of llama.cpp)
            progress("gsm_jax worker: loading the settings")
            w = workers["gsm_jax"] = Worker("gsm_jax", args.model, args.threads)
            got = w.call("setup", settings=[n for n in selected if side_of(n) == "gsm_jax"],
                         sq=sq, data=str(args.data))
            infos["gsm_jax"] = got["info"]
            windows = w.call("windows", data=str(args.data), windows=args.kld_windows,
                             tokens=args.kld_tokens)["windows"]
            rows, prompt_texts = bg.build_prompts(w, texts, max(batch_sizes),
                                                  args.prompt_tokens)
            side_status = {"gsm_jax": got["status"]}
            progress(f"gsm_jax: KLD on {len(windows)} x {len(windows[0])} tokens")
            klds = {"gsm_jax": w.call("kld", windows=windows, batch_size=args.kld_batch,
                                      ref_dir=ref_dir)["kld"]}
            if "gsm_jax:bf16" in selected:
                progress("gsm_jax: compiling one bf16 decode step for its HLO")
                try:
                    hlo = w.call("bf16_hlo", cache_len=args.prompt_tokens + n_new)["summary"]
                except RuntimeError as exc:
                    hlo = {"error": last_line(str(exc))}

            # 2. transformers, 3. llama.cpp (each only if one of its settings is asked for)
            for side in ("transformers", "llama_cpp"):
                names = [n for n in selected if side_of(n) == side]
                if not names:
                    continue
                if side == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
                    for n in names:
                        records[n]["status"], records[n]["error"] = "skipped", LLAMA_CPP_MISSING
                    progress(f"llama_cpp: skipped, {LLAMA_CPP_MISSING}")
                    continue
                progress(f"{side} worker: loading the settings")
                try:
                    w = workers[side] = Worker(side, args.model, args.threads)
                    got = w.call("setup", settings=names, sq=sq, data=str(args.data),
                                 n_ctx=max(args.kld_tokens, args.prompt_tokens + n_new) + 8)
                    infos[side], side_status[side] = got["info"], got["status"]
                    progress(f"{side}: KLD on {len(windows)} x {len(windows[0])} tokens")
                    got = w.call("kld", windows=windows, batch_size=args.kld_batch,
                                 ref_dir=ref_dir)
                    klds[side] = got["kld"]
                    if side == "transformers":
                        sanity = got.get("sanity")
                except RuntimeError as exc:
                    fail_side(side, exc)

        for side, status in side_status.items():
            for name, st in status.items():
                if name not in records:
                    continue  # fp32 loaded as the reference only
                rec = records[name]
                rec.update({k: st.get(k) for k in ("status", "error", "note", "build_s")})
                ks = klds.get(side, {}).get(name)
                if ks is not None:
                    rec["kld_stats"], rec["kld"] = ks, ks["mean_kld"]
                    rec["within_budget"] = ks["mean_kld"] <= args.kld_budget

        # 4. speed: warm-up (compiles), then the timed calls of every setting interleaved
        def runs_at(name: str, b: int) -> bool:
            return records[name]["status"] == "ok" and not (side_of(name) == "llama_cpp"
                                                            and b > 1)

        def mark_error(name: str, exc: BaseException) -> None:
            log(str(exc))
            records[name]["status"], records[name]["error"] = "error", last_line(str(exc))

        warm: dict[str, dict[str, float]] = {n: {} for n in selected}
        for b in batch_sizes:
            for name in [n for n in selected if runs_at(n, b)]:
                w = workers[side_of(name)]
                n_warm = n_new if side_of(name) != "transformers" else min(n_new, 16)
                progress(f"warm-up {name} batch {b} ({n_warm} tokens + 1-token TTFT run)")
                try:
                    g = w.call("generate", setting=name, rows=rows[:b], new_tokens=n_warm)
                    t1 = w.call("generate", setting=name, rows=rows[:b], new_tokens=1)
                except RuntimeError as exc:
                    mark_error(name, exc)
                    continue
                warm[name][f"b{b}_generate_s"] = g["seconds"]
                warm[name][f"b{b}_ttft_s"] = t1["seconds"]
                if g["compile_s"] is not None:
                    warm[name][f"b{b}_compile_s"] = g["compile_s"] + t1["compile_s"]

        times = {n: {b: {"generate_s": [], "ttft_s": [], "load_1m": [], "load_1m_before": [],
                         "compile_s": []} for b in batch_sizes} for n in selected}
        for b in batch_sizes:
            for r in range(args.repeats):
                names = [n for n in selected if runs_at(n, b)]
                for name in names if r % 2 == 0 else names[::-1]:
                    w = workers[side_of(name)]
                    load_before = (load_average() or [None])[0]
                    try:
                        t1 = w.call("generate", setting=name, rows=rows[:b], new_tokens=1)
                        g = w.call("generate", setting=name, rows=rows[:b], new_tokens=n_new)
                        if any(n != n_new for n in g["lengths"]):
                            raise RuntimeError(f"generated {g['lengths']} tokens, not {n_new} "
                                               "per row")
                    except RuntimeError as exc:
                        mark_error(name, exc)
                        continue
                    rec = times[name][b]
                    rec["generate_s"].append(g["seconds"])
                    rec["ttft_s"].append(t1["seconds"])
                    rec["load_1m"].append((load_average() or [None])[0])
                    rec["load_1m_before"].append(load_before)
                    rec["compile_s"].append((g["compile_s"] or 0.0) + (t1["compile_s"] or 0.0))
                    dt = g["seconds"] - t1["seconds"]
                    progress(f"{name:26s} batch {b:3d} repeat {r + 1}/{args.repeats}: "
                             f"generate {g['seconds']:.2f}s, TTFT {t1['seconds'] * 1e3:.0f}ms, "
                             "decode " + (f"{b * (n_new - 1) / dt:.1f} tok/s" if dt > 0 else
                                          "— (TTFT >= generate)"))
    finally:
        for side, w in workers.items():
            try:
                usage[side] = w.close()
                progress(f"{side} worker exited ({usage[side].returncode}), "
                         f"peak RSS {usage[side].peak_rss_mb:.0f} MB")
            except Exception as exc:  # a worker that is already gone
                log(f"closing the {side} worker: {exc}")

    # 5. per-setting speed, best of each side, ratios
    for name, rec in records.items():
        rec["warmup"] = warm.get(name, {})
        oks = []
        for b in batch_sizes:
            t = times.get(name, {}).get(b)
            if not t or not t["generate_s"]:
                rec["decode_tok_s"][str(b)] = None
                if side_of(name) == "llama_cpp" and b > 1 and rec["status"] == "ok":
                    rec["speed"][str(b)] = {"note": "not run: llama-cpp-python's Llama runs "
                                                    "one sequence"}
                continue
            st = bg.side_stats(t, b, n_new)
            st["timed_calls_compile_s"] = sum(t["compile_s"])
            rec["speed"][str(b)] = st
            rec["decode_tok_s"][str(b)] = bg.median_of(st, "decode_tok_s")
            rec["load_1m_before"][str(b)] = st["load_average_1m_before"]
            rec["load_1m_after"][str(b)] = st["load_average_1m"]
            oks.append(st["comparable"])
        rec["comparable"] = all(oks) if oks else None
        if side_of(name) in usage:
            rec["worker_peak_rss_mb"] = usage[side_of(name)].peak_rss_mb

    best: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        for b in batch_sizes:
            cands = [r for r in records.values() if r["side"] == side and r["status"] == "ok"
                     and r["within_budget"] and r["decode_tok_s"].get(str(b))]
            if cands:
                top = max(cands, key=lambda r: r["decode_tok_s"][str(b)])
                top["best_at_batch"].append(b)
                best.setdefault(side, {})[str(b)] = {"setting": top["name"],
                                                     "decode_tok_s": top["decode_tok_s"][str(b)],
                                                     "kld": top["kld"]}
    ratios = {}
    for b in batch_sizes:
        j, t = best.get("gsm_jax", {}).get(str(b)), best.get("transformers", {}).get(str(b))
        ratios[str(b)] = {"gsm_jax": j and j["setting"], "transformers": t and t["setting"],
                          "ratio": j["decode_tok_s"] / t["decode_tok_s"] if j and t else None}

    load_after = load_average()
    seen = [x for x in [(machine["load_average_1_5_15"] or [None])[0], (load_after or [None])[0]]
            if x is not None]
    seen += [x for r in records.values() for d in (r["load_1m_before"], r["load_1m_after"])
             for v in d.values() for x in v if x is not None]
    results: dict[str, Any] = {
        "benchmark": "bench_best_of_each",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine,
        "cpu_flags": flags,
        "bf16_on_xla_cpu": {"summary": hlo, "sentence": bf16_sentence(hlo, flags)},
        "load_average_before": machine["load_average_1_5_15"],
        "load_average_after": load_after,
        "options": {
            "model": args.model, "model_path": model["path"], "settings": selected,
            "batch_sizes": batch_sizes, "new_tokens": n_new, "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats, "threads": args.threads, "kld_windows": args.kld_windows,
            "kld_tokens": args.kld_tokens, "kld_batch": args.kld_batch,
            "kld_budget": args.kld_budget, "data": str(args.data),
            "prompt_source": prompt_source, "smoothquant": sq, "tiny": args.tiny,
        },
        "definitions": {
            "decode_tok_s": "batch * (new_tokens - 1) / (t_generate - t_ttft), per repeat; "
                            "median reported (bench_generate's definition)",
            "kld": "mean over tokens of KL(reference || setting) of the next-token "
                   "distributions (float32 log-softmax), teacher-forced on the last "
                   "kld_windows x kld_tokens WikiText-2 tokens, every position with a next "
                   "token; reference = the side's own fp32 (llama.cpp: gsm_jax's fp32)",
            "within_budget": f"mean KLD <= {args.kld_budget}",
            "best": "per side and batch size: the fastest setting (median decode tok/s) "
                    "within the budget",
            "ratio": "gsm_jax best decode tok/s / transformers best decode tok/s, per batch",
            "comparable": f"every timed call of the setting began and ended with a 1-minute "
                          f"load average <= {bg.MAX_COMPARABLE_LOAD}",
            "eos": "disabled on every side (exactly new_tokens per row)",
            "threads": "each side's worker pinned to the first --threads cores "
                       "(sched_setaffinity, before jax / torch start); torch and llama.cpp "
                       "get that many threads. Without --threads: all cores",
        },
        "workers": {s: {"info": infos.get(s, {}).get("info"),
                        "load_s": infos.get(s, {}).get("load_s"),
                        "peak_rss_mb": usage[s].peak_rss_mb if s in usage else None}
                    for s in workers},
        "settings": list(records.values()),
        "sanity": {"gsm_jax_fp32_vs_transformers_fp32": sanity,
                   "expected": "~0 (at most ~1e-6): the same weights in two "
                               "implementations"},
        "best": best,
        "ratio_best": ratios,
        "prompts": {"rows": rows, "texts_head": [t[:120] for t in prompt_texts]},
        "contention": {"max_load_1m": max(seen) if seen else None,
                       "contended": bool(seen) and max(seen) > bg.MAX_COMPARABLE_LOAD,
                       "limit": bg.MAX_COMPARABLE_LOAD},
        "wall_s": time.perf_counter() - t_run,
    }
    write_json(out_dir / "results.json", results)
    write_markdown(out_dir / "results.md", render_markdown(results))
    plot(results, out_dir / "results.png")
    progress(f"wrote {out_dir}/results.json, results.md, results.png")
    return results


# ----------------------------------------------------------------------------- rendering


def _fmt_kld(v: float | None) -> str | None:
    if v is None:
        return None
    return "0" if v == 0 else f"{v:.1e}" if abs(v) < 1e-3 else f"{v:.4f}"


def render_markdown(res: dict[str, Any]) -> str:
    o, m = res["options"], res["machine"]
    bs = [str(b) for b in o["batch_sizes"]]
    rows = []
    for r in res["settings"]:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        rows.append([r["side"], r["setting"], status,
                     *[r["decode_tok_s"].get(b) for b in bs], _fmt_kld(r["kld"]),
                     None if r["within_budget"] is None else
                     ("yes" if r["within_budget"] else "no"),
                     ("★ " + ", ".join(f"b{b}" for b in r["best_at_batch"]))
                     if r["best_at_batch"] else None,
                     None if r["comparable"] is None else
                     ("yes" if r["comparable"] else "NO (load > 1.5)")])
    out = [
        "# Best of each side: speed and quality per setting\n\n",
        f"{m['date']} · {m['cpu_model']} · {m['cpu_count']} cores · load avg before "
        f"{res['load_average_before']} / after {res['load_average_after']} · model "
        f"`{o['model']}` (`{Path(o['model_path']).name}`) · prompts {o['prompt_tokens']} tokens · "
        f"{o['new_tokens']} new tokens greedy · median of {o['repeats']} repeats · threads per "
        f"side {o['threads'] or 'all cores'} · KLD on {o['kld_windows']} x {o['kld_tokens']} "
        f"WikiText-2 tokens · jax {m['versions'].get('jax')}, torch "
        f"{m['versions'].get('torch')}, transformers {m['versions'].get('transformers')}\n",
        (f"\n**Not comparable: the 1-minute load average reached "
         f"{res['contention']['max_load_1m']} (limit {res['contention']['limit']}).**\n\n"
         if res["contention"]["contended"] else "\n"),
        markdown_table(["side", "setting", "status", *[f"tok/s b{b}" for b in bs],
                        "mean KLD vs own fp32", f"within {o['kld_budget']:g}", "best of side",
                        "comparable"], rows, digits=1),
        "\n## Best of each side (fastest within the KLD budget)\n\n",
        markdown_table(
            ["batch", "gsm_jax best", "tok/s", "transformers best", "tok/s",
             "ratio gsm_jax / transformers"],
            [[int(b), (res["best"].get("gsm_jax", {}).get(b) or {}).get("setting"),
              (res["best"].get("gsm_jax", {}).get(b) or {}).get("decode_tok_s"),
              (res["best"].get("transformers", {}).get(b) or {}).get("setting"),
              (res["best"].get("transformers", {}).get(b) or {}).get("decode_tok_s"),
              None if res["ratio_best"][b]["ratio"] is None
              else f"{res['ratio_best'][b]['ratio']:.2f}×"] for b in bs], digits=1),
    ]
    s = res["sanity"]["gsm_jax_fp32_vs_transformers_fp32"]
    out.append("\n## Notes\n\n")
    if s:
        out.append(f"- Sanity: KLD(gsm_jax fp32 || transformers fp32) = {s['mean_kld']:.2e} "
                   f"(max {s['max_kld']:.2e}, same top-1 {s['same_top1_pct']:.2f}%; "
                   f"{res['sanity']['expected']}).\n")
    out.append(f"- bf16 on XLA:CPU: {res['bf16_on_xla_cpu']['sentence']}\n")
    if "Q4" in Path(o["model_path"]).name or "Q8" in Path(o["model_path"]).name:
        out.append("- The GGUF stores quantized weights: \"fp32\" on each side is those "
                   "weights dequantized to f32, and the KLDs measure each setting's loss on "
                   "top of that.\n")
    for r in res["settings"]:
        note = r.get("note")
        if note:
            out.append(f"- {r['name']}: {json.dumps(note) if not isinstance(note, str) else note}"
                       "\n")
    out.append("\n## Settings\n\n")
    out += [f"- **{r['name']}**: {r['description']}\n" for r in res["settings"]]
    out.append(f"\nRun wall time {res['wall_s']:.0f} s.\n")
    return "".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    shown = [r for r in res["settings"] if any(v for v in r["decode_tok_s"].values())
             or r["kld"] is not None]
    groups = []
    for r in shown:
        kld = "KLD —" if r["kld"] is None else f"KLD {_fmt_kld(r['kld'])}"
        mark = "" if r["within_budget"] is None else (" ✓" if r["within_budget"] else " ✗")
        star = " ★" if r["best_at_batch"] else ""
        groups.append(f"{r['side']}\n{r['setting']}{star}\n{kld}{mark}")
    series = {f"batch {b}": [r["decode_tok_s"].get(str(b)) for r in shown]
              for b in res["options"]["batch_sizes"]}
    m, o = res["machine"], res["options"]
    bar_chart(path, groups, series, ylabel="decode tokens/s (median)",
              title=f"{o['model']} greedy, {o['new_tokens']} new tokens, threads "
                    f"{o['threads'] or 'all'}, {m['cpu_count']}-core {m['cpu_model']}\n"
                    f"✓ KLD ≤ {o['kld_budget']:g} vs own fp32 · ★ best of side")


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_best_of_each", help="output directory")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name or .gguf file (every side loads the same file)")
    p.add_argument("--settings", default=None,
                   help=f"comma list (default: all): {', '.join(SETTINGS)}; a side name "
                        "selects all of its settings")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated (default 1,16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32,
                   help="every prompt is cut to exactly this many tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per batch and setting")
    p.add_argument("--threads", type=int, default=None,
                   help="cores per side (every worker pinned to the same first N cores; torch "
                        "and llama.cpp get N threads). Default: all cores. 1 keeps the load "
                        "average near 1 (the 1.5 comparability limit)")
    p.add_argument("--kld-windows", type=int, default=8, help="WikiText-2 windows for the KLD")
    p.add_argument("--kld-tokens", type=int, default=256, help="tokens per KLD window")
    p.add_argument("--kld-batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--kld-budget", type=float, default=KLD_BUDGET,
                   help="a setting is within budget at mean KLD <= this (default 0.005)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="WikiText-2 test text (prompts, KLD windows, SmoothQuant calibration)")
    p.add_argument("--sq-alphas", choices=("local", "search", "best"), default="local",
                   help="SmoothQuant alphas: per layer from each linear's own W8A8 error "
                        "(local, cheap), per kind by calibration-KLD search (search, ~25 "
                        "forward passes), or the better of both (best)")
    p.add_argument("--sq-seq-len", type=int, default=256)
    p.add_argument("--sq-calib-sequences", type=int, default=16,
                   help="first WikiText-2 sequences for SmoothQuant's activation statistics")
    p.add_argument("--sq-local-sequences", type=int, default=4)
    p.add_argument("--sq-search-sequences", type=int, default=8)
    p.add_argument("--tiny", action="store_true",
                   help="small defaults for a smoke test: " + ", ".join(
                       f"{k.replace('_', '-')} {v}" for k, v in TINY.items()))
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    pre, _ = p.parse_known_args(argv)
    if pre.tiny:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    if args.worker:
        return args
    try:
        args.settings_list = parse_settings(args.settings)
    except ValueError as exc:
        p.error(str(exc))
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode excludes the first token)")
    for opt in ("repeats", "kld_windows", "kld_batch", "prompt_tokens"):
        if getattr(args, opt) < 1:
            p.error(f"--{opt.replace('_', '-')} must be >= 1")
    if args.kld_tokens < 2:
        p.error("--kld-tokens must be >= 2")
    if not args.data.is_file():
        p.error(f"--data {args.data}: no such file (WikiText-2 test text)")
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
