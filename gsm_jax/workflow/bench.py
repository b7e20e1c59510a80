"""Workflow step 5: benchmark concurrent requests with GSM on and off (GSM_SPEC.md §6).

    gsm-jax bench --model smollm2-135m --gsm cal/gsm.yaml --clients 8 --requests 64 --out bench/

    import gsm_jax
    result = gsm_jax.bench("smollm2-135m", gsm="cal/gsm.yaml", clients=8, requests=64)
    result.save("bench/")            # results.json + results.png
    print(result.table())

What runs. One request set (fixed seed): short requests (prompt 16-64 tokens,
16 new) and long ones (prompt 256-512, 128 new), a quarter long by default,
each prompt a slice of WikiText-2 (the raw test split shipped with the package), or
random token ids with `data="random"`. It goes through the continuous-batching
engine (`gsm_jax.serving.engine`) under two loads:

- closed loop: `clients` clients, each sending its next request the moment its
  previous one completes;
- open loop: Poisson arrivals at `rate` requests/s (fixed seed; the same arrival
  times in every run). `rate="auto"` takes 70% of the request throughput the
  closed loop reached in the first repeat; `rate=None` skips the open loop.

GSM modes, interleaved: each repeat runs every mode on the same requests, in
alternating order (off, on / on, off, ...), so drift of a shared machine falls
on both. "off" is an engine compiled *without* GSM (no filter code, no ring
buffers): the honest baseline. "on" is an engine with GSM compiled in and the
given config. The optional "zero" mode runs the GSM engine at zero strength,
which isolates the cost of the compiled-in filter from its effect.

Measured per request (see `engine.RequestRecord`): end-to-end latency (arrival
to last token), time to first token (arrival to first token: queueing plus
prefill), time per output token ((last - first token) / (n - 1)). Percentiles
pool every repeat's requests of a (loop, mode); numpy's linear interpolation,
so with few requests P99 sits near the maximum (the count n is reported).
Throughput per run: output tokens (and requests) over the run's wall time,
first arrival to last token; reported as the mean over repeats plus each run.
EOS is ignored by default (every request generates exactly its `max_new_tokens`),
so GSM on and off do the same amount of work.

Compilation is excluded: each engine compiles and runs its prefill (one per
prompt bucket) and decode step before the first measured run, and those
seconds are reported apart under "warmup".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.generation import MIN_PROMPT_BUCKET, bucket
from gsm_jax.serving import bench_client
from gsm_jax.serving.engine import Engine, Request, RequestRecord

__all__ = [
    "BenchResult",
    "BenchSpec",
    "bench",
    "run_bench",
    "default_data_path",
    "make_requests",
    "percentiles",
    "poisson_arrivals",
    "summarize_records",
]

SCHEMA = "gsm-jax.bench/1"
PERCENTILES = (50, 95, 99)
METRICS = ("e2e_s", "ttft_s", "tpot_s", "queue_s")
MODES = ("off", "on", "zero")
CLASSES = ("short", "long")
AUTO_RATE_FRACTION = 0.7
MODE_LABELS = {
    "off": "GSM off (no GSM compiled)",
    "on": "GSM on",
    "zero": "GSM compiled, strength 0",
}


# ----------------------------------------------------------------------------- statistics


def percentiles(values: Sequence[float | None], qs: Sequence[float] = PERCENTILES
                ) -> dict[str, float | int | None]:
    """{"n", "mean", "p50", "p95", "p99"} of the finite values (None where there are none):
    the HTTP load test's statistics (`gsm_jax.serving.bench_client.percentiles`)."""
    return bench_client.percentiles(values, qs)


def run_wall(records: Sequence[Mapping[str, Any]], t_start: float = 0.0) -> float:
    """A run's wall time: from its start to its last token (record times relative)."""
    finishes = [r["finish"] for r in records if r.get("finish") is not None]
    return max(finishes) - t_start if finishes else math.nan


def summarize_records(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Summary of the runs of one (loop, mode): per class ("short", "long", "all").

    Each run is {"records": [record dicts, times relative to the run start],
    "wall_s": seconds}. Latency percentiles pool every run's requests;
    throughput is per run (output tokens / wall), as mean, min, max and values.
    """
    out: dict[str, Any] = {"runs": len(runs), "classes": {}}
    for cls in (*CLASSES, "all"):
        recs = [(r, run) for run in runs for r in run["records"]
                if cls == "all" or r.get("tag") == cls]
        if not recs:
            continue
        entry: dict[str, Any] = {"requests": len(recs),
                                 "output_tokens": int(sum(r["n_tokens"] for r, _ in recs))}
        for m in METRICS:
            entry[m] = percentiles([r.get(m) for r, _ in recs])
        per_run_tok, per_run_req = [], []
        for run in runs:
            mine = [r for r in run["records"] if cls == "all" or r.get("tag") == cls]
            wall = run["wall_s"]
            if mine and wall and wall > 0:
                per_run_tok.append(sum(r["n_tokens"] for r in mine) / wall)
                per_run_req.append(len(mine) / wall)
        entry["tokens_per_s"] = _spread(per_run_tok)
        entry["requests_per_s"] = _spread(per_run_req)
        out["classes"][cls] = entry
    return out


def summarize_steps(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Engine call times of the runs of one (loop, mode), pooled: every decode step (all
    slots compute, active or not, so its time barely depends on how many are active) and
    every prefill by prompt bucket. Each run may hold "steps": {"decode": [[active, s]],
    "prefill": [[bucket, s]]}."""
    decode = [s for run in runs for _, s in run.get("steps", {}).get("decode", [])]
    prefill: dict[int, list[float]] = {}
    for run in runs:
        for b, sec in run.get("steps", {}).get("prefill", []):
            prefill.setdefault(int(b), []).append(sec)
    return {"decode_step_s": percentiles(decode),
            "prefill_s_by_bucket": {str(b): percentiles(v) for b, v in sorted(prefill.items())}}


def _spread(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "min": None, "max": None, "values": []}
    return {"mean": float(np.mean(values)), "min": float(min(values)),
            "max": float(max(values)), "values": [float(v) for v in values]}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def compare_modes(summary: Mapping[str, Any], mode: str = "on",
                  baseline: str = "off") -> dict[str, Any]:
    """`mode` / `baseline` ratios of every percentile and throughput, per class."""
    if mode not in summary or baseline not in summary:
        return {}
    out: dict[str, Any] = {}
    for cls, a in summary[mode]["classes"].items():
        b = summary[baseline]["classes"].get(cls)
        if b is None:
            continue
        ratios = {f"{m}_{p}": _ratio(a[m][p], b[m][p])
                  for m in ("e2e_s", "ttft_s", "tpot_s") for p in ("p50", "p95", "p99")}
        ratios["tokens_per_s"] = _ratio(a["tokens_per_s"]["mean"], b["tokens_per_s"]["mean"])
        out[cls] = ratios
    ea, eb = summary[mode].get("engine"), summary[baseline].get("engine")
    if ea and eb:
        out["engine"] = {
            "decode_step_p50": _ratio(ea["decode_step_s"]["p50"], eb["decode_step_s"]["p50"]),
            "prefill_p50_by_bucket": {
                k: _ratio(v["p50"], eb["prefill_s_by_bucket"].get(k, {}).get("p50"))
                for k, v in ea["prefill_s_by_bucket"].items()},
        }
    return out


# ----------------------------------------------------------------------------- requests


def default_data_path() -> Path:
    """The WikiText-2 raw test split shipped with the package
    (`gsm_jax.data.default_wikitext_path`)."""
    from gsm_jax.data import default_wikitext_path

    return default_wikitext_path()


def _text_tokens(tokenizer: Any, path: Path, max_chars: int) -> np.ndarray:
    from gsm_jax.workflow.data import read_text

    if not path.is_file():
        raise InvalidInputError(
            f"prompt text {path} does not exist; pass data=PATH (--data PATH), leave it "
            "unset for the packaged WikiText-2, or data='random' (--data random) for random "
            "token ids"
        )
    text = read_text(path)[:max_chars]
    return np.asarray(tokenizer.encode(text), np.int32)


def make_requests(params: Any, n: int, *, long_fraction: float = 0.25,
                  short_prompt: tuple[int, int] = (16, 64), short_new: int = 16,
                  long_prompt: tuple[int, int] = (256, 512), long_new: int = 128,
                  seed: int = 0, data: str | os.PathLike | None = None) -> list[Request]:
    """`n` requests, round(n * long_fraction) of them long, in a seeded random order.

    Prompt lengths are uniform in the (inclusive) ranges. Prompts are slices of
    WikiText-2 at random offsets (`data`: a text file, default
    `default_data_path()`), or random token ids with `data="random"` (also the
    only choice for a model without a tokenizer).
    """
    if n < 1:
        raise InvalidInputError(f"requests must be >= 1, got {n}")
    if not 0.0 <= long_fraction <= 1.0:
        raise InvalidInputError(f"long_fraction must be in [0, 1], got {long_fraction}")
    for name, (lo, hi) in (("short_prompt", short_prompt), ("long_prompt", long_prompt)):
        if not 1 <= lo <= hi:
            raise InvalidInputError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if short_new < 1 or long_new < 1:
        raise InvalidInputError("short_new and long_new must be >= 1")
    rng = np.random.default_rng(seed)
    n_long = int(round(n * long_fraction))
    tags = np.array(["long"] * n_long + ["short"] * (n - n_long))
    rng.shuffle(tags)
    cfg = params.config
    lengths = [int(rng.integers(*(long_prompt if t == "long" else short_prompt), endpoint=True))
               for t in tags]
    random_ids = data == "random" or params.tokenizer is None
    if not random_ids:
        path = Path(data) if data is not None else default_data_path()
        # ~4 characters per token; room for every prompt at its own offset
        stream = _text_tokens(params.tokenizer, path, max_chars=max(200_000, 8 * sum(lengths)))
        if stream.size < max(lengths) + 1:
            raise InvalidInputError(f"{path} is too short for prompts of {max(lengths)} tokens")
    out = []
    for i, (tag, length) in enumerate(zip(tags, lengths, strict=True)):
        if random_ids:
            prompt = rng.integers(0, cfg.vocab_size, size=length).astype(np.int32)
        else:
            start = int(rng.integers(0, stream.size - length))
            prompt = stream[start: start + length]
        out.append(Request(prompt=prompt, max_new_tokens=long_new if tag == "long" else short_new,
                           request_id=f"req{i:04d}", tag=str(tag)))
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` requests/s, starting at 0."""
    if not rate > 0:
        raise InvalidInputError(f"rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


# ----------------------------------------------------------------------------- machine info


def machine_info() -> dict[str, Any]:
    import jax

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    commit = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "python": sys.version.split()[0],
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "versions": {p: version(p) for p in ("gsm-jax", "jax", "jaxlib", "flax", "numpy")},
        "git_commit": commit,
    }


# ----------------------------------------------------------------------------- result


@dataclass
class BenchResult:
    """What `bench` measured; `save(path)` writes JSON (+ PNG), `to_dict()` the JSON content."""

    config: dict[str, Any]
    machine: dict[str, Any]
    warmup: dict[str, Any]
    requests: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_runs(cls, *, config, machine, warmup, requests, runs) -> BenchResult:
        result = cls(config=config, machine=machine, warmup=warmup, requests=requests, runs=runs)
        result.summarize()
        return result

    def summarize(self) -> None:
        """(Re)compute `summary` and `comparison` from the raw runs."""
        loops = sorted({r["loop"] for r in self.runs}, key=("closed", "open").index)
        self.summary, self.comparison = {}, {}
        for loop in loops:
            by_mode: dict[str, Any] = {}
            for mode in MODES:
                runs = [r for r in self.runs if r["loop"] == loop and r["mode"] == mode]
                if runs:
                    by_mode[mode] = summarize_records(runs)
                    if any("steps" in r for r in runs):
                        by_mode[mode]["engine"] = summarize_steps(runs)
            self.summary[loop] = by_mode
            comp = {f"{m}_vs_off": compare_modes(by_mode, m) for m in ("on", "zero")
                    if m in by_mode}
            comp["token_agreement_on_off"] = _agreement(self.runs, loop)
            self.comparison[loop] = comp

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "config": self.config, "machine": self.machine,
                "warmup": self.warmup, "summary": self.summary, "comparison": self.comparison,
                "requests": self.requests,
                "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in self.runs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BenchResult:
        if d.get("schema") != SCHEMA:
            raise InvalidInputError(f"not a {SCHEMA} result (schema={d.get('schema')!r})")
        return cls(config=dict(d["config"]), machine=dict(d["machine"]),
                   warmup=dict(d["warmup"]), requests=list(d["requests"]),
                   runs=list(d["runs"]), summary=dict(d["summary"]),
                   comparison=dict(d.get("comparison", {})))

    @classmethod
    def load(cls, path: str | os.PathLike) -> BenchResult:
        path = Path(path)
        if path.is_dir():
            path = path / "results.json"
        return cls.from_dict(json.loads(path.read_text()))

    def save(self, path: str | os.PathLike, *, plot: bool = True) -> Path:
        """A directory (or a path not ending in .json) gets results.json + results.png;
        a `.json` path gets that file (and the PNG beside it). Returns the JSON path."""
        path = Path(path)
        if path.suffix == ".json":
            json_path = path
        else:
            json_path = path / "results.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_jsonable(self.to_dict()), indent=1) + "\n")
        os.replace(tmp, json_path)
        if plot:
            self.plot(json_path.with_suffix(".png"))
        return json_path

    # -------------------------------------------------------------- text and picture

    def table(self) -> str:
        """The summary as a text table (ms; tokens/s)."""
        lines = []
        for loop, by_mode in self.summary.items():
            head = (f"{loop} loop: {self.config.get('clients')} clients" if loop == "closed"
                    else f"open loop: Poisson {self.config.get('rate_used', 0):.3g} req/s")
            lines.append(head)
            lines.append(f"  {'class':6} {'mode':5} {'n':>4}  {'e2e P50/P95/P99 ms':>22}  "
                         f"{'TTFT P50/P95/P99 ms':>22}  {'TPOT P50/P95/P99 ms':>20}  "
                         f"{'tok/s':>7}")
            for cls in (*CLASSES, "all"):
                for mode, summ in by_mode.items():
                    c = summ["classes"].get(cls)
                    if c is None:
                        continue

                    def ms(m: str, c=c) -> str:
                        return "/".join("-" if c[m][p] is None else f"{1e3 * c[m][p]:.0f}"
                                        for p in ("p50", "p95", "p99"))

                    tok = c["tokens_per_s"]["mean"]
                    lines.append(f"  {cls:6} {mode:5} {c['e2e_s']['n']:>4}  {ms('e2e_s'):>22}  "
                                 f"{ms('ttft_s'):>22}  {ms('tpot_s'):>20}  "
                                 f"{'-' if tok is None else f'{tok:.1f}':>7}")
            for mode, summ in by_mode.items():
                eng = summ.get("engine")
                if eng and eng["decode_step_s"]["n"]:
                    d = eng["decode_step_s"]
                    pre = ", ".join(f"{b}: {1e3 * v['p50']:.0f}"
                                    for b, v in eng["prefill_s_by_bucket"].items())
                    lines.append(f"  engine {mode:5} decode step P50/P95 {1e3 * d['p50']:.1f}/"
                                 f"{1e3 * d['p95']:.1f} ms ({d['n']} steps); prefill P50 ms by "
                                 f"prompt bucket {{{pre}}}")
            comp = self.comparison.get(loop, {}).get("on_vs_off", {}).get("all")
            if comp:
                def r(k: str, comp=comp) -> str:
                    return "-" if comp[k] is None else f"{comp[k]:.3f}"

                step = self.comparison[loop]["on_vs_off"].get("engine", {}).get(
                    "decode_step_p50")
                lines.append(f"  on/off (all): e2e P50 {r('e2e_s_p50')}, P99 {r('e2e_s_p99')}; "
                             f"TTFT P50 {r('ttft_s_p50')}; TPOT P50 {r('tpot_s_p50')}; "
                             f"tokens/s {r('tokens_per_s')}"
                             + ("" if step is None else f"; decode step P50 {step:.3f}"))
            agree = self.comparison.get(loop, {}).get("token_agreement_on_off")
            if agree is not None:
                lines.append(f"  same output tokens on vs off: {100 * agree:.0f}% of requests")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """Latency percentiles per class (bars per mode) and throughput, one row per loop."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        loops = list(self.summary)
        if not loops:
            return
        metrics = (("e2e_s", "end-to-end latency"), ("ttft_s", "time to first token"),
                   ("tpot_s", "time per output token"))
        fig, axes = plt.subplots(len(loops), 4, figsize=(20, 4.2 * len(loops)), squeeze=False)
        colors = {"off": "#7f7f7f", "on": "#1f77b4", "zero": "#ff7f0e"}
        for row, loop in enumerate(loops):
            by_mode = self.summary[loop]
            modes = list(by_mode)
            title = (f"closed loop, {self.config.get('clients')} clients" if loop == "closed"
                     else f"open loop, {self.config.get('rate_used', 0):.3g} req/s")
            for col, (m, label) in enumerate(metrics):
                ax = axes[row][col]
                groups = [(cls, p) for cls in (*CLASSES, "all") for p in ("p50", "p95", "p99")
                          if cls in by_mode[modes[0]]["classes"]]
                x = np.arange(len(groups))
                width = 0.8 / len(modes)
                for k, mode in enumerate(modes):
                    vals = []
                    for cls, p in groups:
                        c = by_mode[mode]["classes"].get(cls)
                        v = None if c is None else c[m][p]
                        vals.append(np.nan if v is None else 1e3 * v)
                    ax.bar(x + (k - (len(modes) - 1) / 2) * width, vals, width,
                           label=MODE_LABELS[mode], color=colors[mode])
                ax.set_xticks(x, [f"{cls}\n{p.upper()}" for cls, p in groups], fontsize=8)
                ax.set_ylabel("ms")
                ax.set_title(f"{label}\n{title}", fontsize=10)
                ax.grid(axis="y", alpha=0.3)
                if col == 0:
                    ax.legend(fontsize=8)
            ax = axes[row][3]
            for k, mode in enumerate(modes):
                tp = by_mode[mode]["classes"]["all"]["tokens_per_s"]
                ax.bar(k, tp["mean"] or 0.0, 0.6, color=colors[mode], label=MODE_LABELS[mode])
                ax.scatter([k] * len(tp["values"]), tp["values"], color="k", s=12, zorder=3)
            ax.set_xticks(range(len(modes)), modes)
            ax.set_ylabel("output tokens / s")
            ax.set_title(f"throughput (bars: mean, dots: runs)\n{title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        model = self.config.get("model", "")
        fig.suptitle(f"gsm-jax bench: {model}, {self.machine.get('backend', '')} "
                     f"({self.machine.get('date', '')})", fontsize=11)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)

    def __repr__(self) -> str:
        return (f"BenchResult(model={self.config.get('model')!r}, runs={len(self.runs)}, "
                f"loops={list(self.summary)})")


def _agreement(runs: Sequence[Mapping[str, Any]], loop: str) -> float | None:
    """Share of requests whose output tokens are identical under GSM on and off (first
    repeat of `loop` that has both)."""
    by = {(r["repeat"], r["mode"]): r for r in runs if r["loop"] == loop and "outputs" in r}
    for rep in sorted({k[0] for k in by}):
        on, off = by.get((rep, "on")), by.get((rep, "off"))
        if on and off:
            same = [a == b for a, b in zip(on["outputs"], off["outputs"], strict=True)]
            return sum(same) / len(same) if same else None
    return None


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating | float):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    return x


# ----------------------------------------------------------------------------- driver


def _resolve_params(model: Any, dtype: str) -> tuple[Any, str]:
    from gsm_jax.params import ModelParams

    if isinstance(model, ModelParams):
        return model, model.source or type(model.config).__name__
    if isinstance(model, str | os.PathLike):
        from gsm_jax.loading import load

        return load(str(model), dtype=dtype), str(model)
    raise InvalidInputError(
        f"model must be a ModelParams or a model name/path, not {type(model).__name__}"
    )


def _records(records: Sequence[RequestRecord], t_start: float) -> list[dict[str, Any]]:
    return [r.to_dict(t_start, with_tokens=False) for r in records]


@dataclass(frozen=True)
class BenchSpec:
    """What `run_bench` measures (every field has `bench`'s default).

    `gsm`: GSMConfig, dict or config path for "on" (default: `GSMConfig(target_layers="all")`).
    `clients`: closed-loop concurrency. `rate`: open-loop Poisson arrivals/s,
    "auto" (70% of the closed loop's first-repeat request throughput) or None
    (closed loop only). `max_batch`: engine slots (default `clients`).
    `modes`: any of "off" (no GSM compiled), "on", "zero" (GSM compiled at
    strength 0). `out`: a directory to save results.json + results.png into.
    `short_*` / `long_*`: prompt length range and new tokens of each request class.
    `data`: prompt text file or "random". `dtype`: when the model is loaded by name.
    """

    gsm: Any = None
    clients: int = 8
    requests: int = 64
    rate: float | str | None = "auto"
    repeats: int = 2
    out: str | os.PathLike | None = None
    max_batch: int | None = None
    long_fraction: float = 0.25
    short_prompt: tuple[int, int] = (16, 64)
    short_new: int = 16
    long_prompt: tuple[int, int] = (256, 512)
    long_new: int = 128
    modes: Sequence[str] = ("off", "on")
    seed: int = 0
    data: str | os.PathLike | None = None
    ignore_eos: bool = True
    dtype: str = "float32"
    progress: bool = True
    log: Callable[[str], None] | None = None

    def replace(self, **changes: Any) -> BenchSpec:
        """A copy with ``changes`` (field names; an unknown name raises TypeError)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchSpec:
        """The spec of a `gsm-jax bench` command line (see `add_arguments`)."""
        return cls(
            gsm=args.gsm, clients=args.clients, requests=args.requests, rate=args.rate,
            repeats=args.repeats, out=args.out, max_batch=args.max_batch,
            long_fraction=args.long_fraction, short_prompt=tuple(args.short_prompt),
            short_new=args.short_new, long_prompt=tuple(args.long_prompt),
            long_new=args.long_new,
            modes=[m.strip() for m in args.modes.split(",") if m.strip()], seed=args.seed,
            data=args.data, ignore_eos=not args.respect_eos, dtype=args.dtype,
            progress=not args.no_progress)


def bench(model: Any = "smollm2-135m", spec: BenchSpec | None = None,
          **fields: Any) -> BenchResult:
    """Benchmark concurrent requests through the continuous-batching engine, GSM on vs off.

    `model`: a ModelParams or anything `gsm_jax.load` takes. ``spec``: a `BenchSpec`;
    keyword arguments are its fields (they override ``spec``'s, or the defaults
    without one), so ``bench(model, gsm=..., clients=8)`` keeps working.
    See the module docstring for what is measured.
    """
    return run_bench(model, (spec or BenchSpec()).replace(**fields))


def run_bench(model: Any, spec: BenchSpec) -> BenchResult:
    """`bench` with every setting in ``spec``."""
    gsm, clients, requests, rate, repeats = (spec.gsm, spec.clients, spec.requests, spec.rate,
                                             spec.repeats)
    out, max_batch, long_fraction = spec.out, spec.max_batch, spec.long_fraction
    short_prompt, short_new = spec.short_prompt, spec.short_new
    long_prompt, long_new = spec.long_prompt, spec.long_new
    modes, seed, data, ignore_eos = spec.modes, spec.seed, spec.data, spec.ignore_eos
    dtype, progress, log = spec.dtype, spec.progress, spec.log
    from gsm_jax.config import GSMConfig
    from gsm_jax.gsm_runtime import as_gsm_config

    say = log or (lambda msg: print(f"[gsm-jax bench] {msg}", file=sys.stderr, flush=True))
    if int(clients) < 1:
        raise InvalidInputError(f"clients must be >= 1, got {clients}")
    if int(repeats) < 1:
        raise InvalidInputError(f"repeats must be >= 1, got {repeats}")
    modes = list(dict.fromkeys(modes))
    if not modes or any(m not in MODES for m in modes):
        raise InvalidInputError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    if isinstance(rate, str) and rate != "auto":
        raise InvalidInputError(f"rate must be a number > 0, 'auto' or None, got {rate!r}")
    if isinstance(rate, int | float) and not rate > 0:
        raise InvalidInputError(f"rate must be > 0 requests/s, got {rate}")
    gsm_cfg = GSMConfig(target_layers="all") if gsm is None else as_gsm_config(gsm)
    params, model_name = _resolve_params(model, dtype)
    cfg = params.config
    reqs = make_requests(params, int(requests), long_fraction=long_fraction,
                         short_prompt=tuple(short_prompt), short_new=short_new,
                         long_prompt=tuple(long_prompt), long_new=long_new, seed=seed, data=data)
    max_len = max(max(bucket(len(r.prompt), MIN_PROMPT_BUCKET), len(r.prompt) + r.max_new_tokens)
                  for r in reqs)
    if max_len > cfg.max_position_embeddings:
        raise InvalidInputError(f"requests need {max_len} tokens of context; the model has "
                                f"{cfg.max_position_embeddings}")
    slots = int(max_batch) if max_batch is not None else int(clients)
    eos = [] if ignore_eos else None
    say(f"{model_name}: {len(reqs)} requests "
        f"({sum(r.tag == 'short' for r in reqs)} short, {sum(r.tag == 'long' for r in reqs)} "
        f"long), {slots} slots, cache {max_len} tokens, modes {modes}")

    # engines: "off" has no GSM compiled; "on" and "zero" share one GSM engine
    engines: dict[str, Engine] = {}
    if "off" in modes:
        engines["off"] = Engine(params, max_batch=slots, max_len=max_len, eos_ids=eos, seed=seed)
    if "on" in modes or "zero" in modes:
        gsm_engine = Engine(params, max_batch=slots, max_len=max_len, gsm=gsm_cfg, eos_ids=eos,
                            seed=seed)
        for m in ("on", "zero"):
            if m in modes:
                engines[m] = gsm_engine

    def use(mode: str) -> Engine:
        eng = engines[mode]
        if mode == "on":
            eng.set_gsm(gsm_cfg)
        elif mode == "zero":
            eng.set_gsm(None)
        return eng

    warmup: dict[str, Any] = {}
    prompt_lengths = sorted({len(r.prompt) for r in reqs})
    for mode in modes:
        if mode == "zero" and "on" in modes:
            continue  # same engine, same compiled code
        say(f"warm-up (compile) {mode} ...")
        warmup[mode] = use(mode).warmup(prompt_lengths)
        say(f"warm-up {mode}: {warmup[mode]['total_s']:.1f}s")

    loops = ["closed"] + ([] if rate is None else ["open"])
    rate_used = float(rate) if isinstance(rate, int | float) else None
    arrivals = None if rate_used is None else poisson_arrivals(len(reqs), rate_used, seed)
    n_runs = int(repeats) * len(modes) * len(loops)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_runs * len(reqs), desc="bench", unit="req", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(int(repeats)):
            order = modes if rep % 2 == 0 else modes[::-1]
            for loop in loops:
                if loop == "open" and arrivals is None:  # rate="auto": from repeat 0 closed
                    closed = [r for r in runs if r["loop"] == "closed" and r["repeat"] == 0]
                    rate_used = AUTO_RATE_FRACTION * float(np.mean(
                        [len(r["records"]) / r["wall_s"] for r in closed]))
                    arrivals = poisson_arrivals(len(reqs), rate_used, seed)
                    say(f"open-loop rate (auto): {rate_used:.3g} requests/s")
                for mode in order:
                    eng = use(mode)
                    if bar is not None:
                        bar.set_postfix_str(f"repeat {rep} {loop} {mode}")
                    on_finish = (lambda _r: bar.update(1)) if bar is not None else None
                    # t_start: the engine's run start (closed loop: the first sends;
                    # open loop: arrival i lands at start + arrivals[i])
                    if loop == "closed":
                        recs = eng.run(reqs, clients=int(clients), on_finish=on_finish)
                        t_start = min(r.arrival for r in recs)
                    else:
                        recs = eng.run(reqs, arrival_times=arrivals, on_finish=on_finish)
                        t_start = min(r.arrival for r in recs) - min(arrivals)
                    records = _records(recs, t_start)
                    steps = {"decode": [], "prefill": []}
                    for kind, size, sec in eng.step_times:
                        steps[kind].append([size, round(sec, 6)])
                    runs.append({
                        "loop": loop, "mode": mode, "repeat": rep,
                        "wall_s": run_wall(records), "records": records, "steps": steps,
                        "outputs": [list(r.tokens) for r in recs],
                    })
    finally:
        if bar is not None:
            bar.close()

    config = {
        "model": model_name, "params": repr(params), "dtype": str(params.dtype),
        "gsm": gsm_cfg.to_dict(), "gsm_default_used": gsm is None,
        "clients": int(clients), "requests": len(reqs), "repeats": int(repeats),
        "rate": rate, "rate_used": rate_used, "auto_rate_fraction": AUTO_RATE_FRACTION,
        "loops": loops, "modes": modes, "mode_labels": {m: MODE_LABELS[m] for m in modes},
        "max_batch": slots, "max_len": max_len, "long_fraction": long_fraction,
        "short": {"prompt": list(short_prompt), "new": short_new},
        "long": {"prompt": list(long_prompt), "new": long_new},
        "seed": seed, "data": "random" if (data == "random" or params.tokenizer is None)
        else str(data if data is not None else default_data_path()),
        "ignore_eos": ignore_eos, "percentiles": "numpy linear interpolation, pooled repeats",
        "scheduler": "FCFS, per-request prefill before each decode step, fixed slots",
    }
    requests_info = [{"index": i, "request_id": r.request_id, "tag": r.tag,
                      "prompt_len": len(r.prompt), "max_new_tokens": r.max_new_tokens,
                      "arrival_open_s": None if arrivals is None else arrivals[i]}
                     for i, r in enumerate(reqs)]
    result = BenchResult.from_runs(config=config, machine=machine_info(), warmup=warmup,
                                   requests=requests_info, runs=runs)
    if out is not None:
        path = result.save(out)
        say(f"wrote {path} and {path.with_suffix('.png')}")
    return result


# ----------------------------------------------------------------------------- CLI


def _rate_arg(v: str) -> float | str | None:
    if v.lower() in ("none", "off", "0"):
        return None
    if v.lower() == "auto":
        return "auto"
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate: a number, 'auto' or 'none', not {v!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file, HF directory or gsm_jax.save directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and compute dtype")
    p.add_argument("--gsm", type=Path, default=None,
                   help="GSM config file for 'on' (unset: all layers, default strength)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--requests", type=int, default=64, help="requests per run")
    p.add_argument("--rate", type=_rate_arg, default="auto",
                   help="open-loop Poisson rate (req/s), 'auto' (70%% of closed-loop "
                        "throughput) or 'none' (closed loop only)")
    p.add_argument("--repeats", type=int, default=2, help="runs per (loop, mode), interleaved")
    p.add_argument("--max-batch", type=int, default=None,
                   help="engine slots (unset: --clients)")
    p.add_argument("--long-fraction", type=float, default=0.25,
                   help="share of long requests")
    p.add_argument("--short-prompt", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"),
                   help="prompt length range (tokens) of a short request")
    p.add_argument("--short-new", type=int, default=16, help="new tokens of a short request")
    p.add_argument("--long-prompt", type=int, nargs=2, default=(256, 512), metavar=("LO", "HI"),
                   help="prompt length range (tokens) of a long request")
    p.add_argument("--long-new", type=int, default=128, help="new tokens of a long request")
    p.add_argument("--modes", default="off,on",
                   help="comma list of off (no GSM compiled), on, zero (GSM compiled, strength 0)")
    p.add_argument("--data", default=None,
                   help="prompt text file, or 'random' for random token ids (unset: the "
                        "WikiText-2 raw test split shipped with the package)")
    p.add_argument("--respect-eos", action="store_true",
                   help="stop requests at EOS (default: ignore EOS, fixed output lengths)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the request set and the arrival times")
    p.add_argument("--out", type=Path, default=Path("bench"),
                   help="directory for results.json and results.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from gsm_jax.workflow.data import check_file_option

    # files first: a typo fails here, not after the model load and the warm-up compiles
    check_file_option("--data", args.data, special=("random",))
    check_file_option("--gsm", args.gsm)
    if args.out.exists() and not args.out.is_dir():
        raise InvalidInputError(f"--out {args.out}: exists and is not a directory")
    result = bench(args.model, BenchSpec.from_args(args))
    print(result.table())
    for mode, w in result.warmup.items():
        print(f"warm-up (compile, excluded) {mode}: {w['total_s']:.1f}s")
    return 0

