"""Helpers shared by the benchmarks: timing, child-process peak memory, machine info, output.

- `Stopwatch` / `time_call`: wall-clock timing (`time.perf_counter`).
- `start_child` / `wait_child`: run a command as a child process and read its own
  peak RSS (`ru_maxrss` from `os.wait4`), so each measured side has its own number.
- `machine_info`: CPU model, core count, load average, library versions, date.
- `write_json`, `markdown_table`, `write_markdown`, `bar_chart`: the result files.
- `summarize`: median / min / max of repeated timings.
"""

from __future__ import annotations

import collections
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# The evaluation data that ships with the package (gsm_jax/data/README.md: sources, licences).
SHARED_DATA_DIR = REPO_ROOT / "gsm_jax" / "data"


# ----------------------------------------------------------------------------- threads


def threads_arg(argv: Sequence[str] | None = None) -> int | None:
    """--threads N from the command line, read before jax is imported (XLA reads its
    flags at start-up, so the benchmarks look at it before argparse runs)."""
    argv = sys.argv if argv is None else argv
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return None


# ----------------------------------------------------------------------------- timing


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = float("nan")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call; `fn` must block until its work is done."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Call each fn once per round, alternating the order between rounds so every fn
    sees the same background load; per-fn wall times (results waited for with
    `jax.block_until_ready`)."""
    import jax

    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - t)
    return times


def short_and_long_calls(params_by_name: dict[str, Any], batch: int, prompt_len: int,
                         new_tokens: int, vocab: int) -> dict[str, Callable[[], Any]]:
    """For each params: a 1-token and a `new_tokens`-token greedy `generate_tokens` call on
    the same random rows, keyed "name|1" and "name|N". Timed as neighbours in each round,
    long minus short is the decode of N - 1 tokens under the same conditions."""
    import numpy as np

    import gsm_jax

    rng = np.random.default_rng(batch)
    rows = [rng.integers(2, vocab, prompt_len).tolist() for _ in range(batch)]
    return {f"{name}|{n}": (lambda p=p, n=n: gsm_jax.generate_tokens(
        p, rows, max_new_tokens=n, eos_ids=[]))
        for name, p in params_by_name.items() for n in (1, new_tokens)}


def measure_decode(params: dict, batch: int, prompt_len: int, new_tokens: int,
                   repeats: int, vocab: int, max_load: float = 1.5) -> dict:
    """Decode speed of each params (a name -> ModelParams dict) through whole greedy
    `generate_tokens` calls: every program compiled first, then `short_and_long_calls`
    timed `interleaved`; the load average before and after, "comparable" when neither is
    above `max_load`. Per name under "variants": decode tokens/s (median of long - short)
    and the call times."""
    import numpy as np

    fns = short_and_long_calls(params, batch, prompt_len, new_tokens, vocab)
    for fn in fns.values():  # compile every program before timing
        fn()
    load_before = load_average()
    times = interleaved(fns, repeats)
    load_after = load_average()
    out = {"load_average_before": load_before, "load_average_after": load_after,
           "comparable": max((load_before or [0])[0], (load_after or [0])[0])
           <= max_load, "variants": {}}
    for name in params:
        short, long = np.asarray(times[f"{name}|1"]), np.asarray(times[f"{name}|{new_tokens}"])
        # the two calls of a round ran next to each other: their difference is the
        # decode of new_tokens - 1 tokens under the same conditions
        decode_s = float(np.median(long - short))
        out["variants"][name] = {
            "call_s": summarize(long.tolist()),
            "prefill_call_s": summarize(short.tolist()),
            "decode_s": summarize((long - short).tolist()),
            "decode_tok_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
            "decode_tok_s_best": batch * (new_tokens - 1) / max(long.min() - short.min(),
                                                                1e-9),
            "generate_tok_s": batch * new_tokens / float(np.median(long)),
        }
    return out



def _category(name: str) -> str:
    n = name.lower()
    if "dynamic-slice" in n or "dynamic_slice" in n:
        return "weight slice copy"
    if n.startswith("dot") or "ynn_fusion" in n or "xnn" in n:
        return "matmul (dot / library fusion)"
    if n.startswith("convert"):
        return "convert"
    if "transpose" in n or n.startswith("copy"):
        return "copy / transpose"
    if n.startswith(("fusion", "loop", "input", "reduce", "multiply", "add", "select",
                     "scatter", "gather", "concatenate", "broadcast", "exponential",
                     "divide", "subtract", "rsqrt", "wrapped", "bitcast", "negate",
                     "compare", "maximum", "minimum", "round", "clamp", "slice", "pad",
                     "iota", "sort", "and", "or", "log", "sine", "cosine", "tanh")):
        return "elementwise / other fusions"
    return "other"


_SKIP = ("ThunkExecutor", "while", "PjitFunction", "Execute", "$")


def _scope_of(hlo_text: str) -> Callable[[str], str]:
    """Event name (an HLO instruction of the compiled program) -> its named scope, with
    per-layer indices and module method names stripped, two levels deep."""
    scopes: dict[str, str] = {}
    for m in re.finditer(r"^\s*%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text, re.M):
        path = re.sub(r"^jit\([^)]*\)/", "", m.group(2))
        path = re.sub(r"(^|/)layer_\d+(?=/)", r"\1", path)
        # the last part names the primitive; the layer loop's "layer" scope and Flax module
        # names (a bare class, or class.method) carry no information once layers merge
        parts = [p for p in path.split("/")[:-1]
                 if p and not re.match(r"^([A-Z]\w*(\.\w+)?|layer|jit\(.*\))$", p)]
        scopes[m.group(1)] = "/".join(parts[:2]) or "(top level)"
    return lambda name: scopes.get(name, "(events not matched to a scope)")


def profile_breakdown(fn: Callable[[], Any], steps: int = 3, *,
                      hlo_text: str | None = None) -> dict[str, float]:
    """ms per call from a jax.profiler trace of `steps` calls of fn, by kind of op; or,
    given the compiled program's text (`jitted.lower(...).compile().as_text()`), by
    `jax.named_scope` (layers merged)."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    key = _category if hlo_text is None else _scope_of(hlo_text)
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(fn())
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return {}
        data = ProfileData.from_file(files[-1])
        totals: dict[str, float] = collections.Counter()
        for plane in data.planes:
            if not plane.name.startswith("/host:CPU") and not plane.name.startswith("/device"):
                continue
            for line in plane.lines:
                if line.name.startswith("python"):
                    continue
                for ev in line.events:
                    if ev.name.startswith(_SKIP):
                        continue
                    totals[key(ev.name)] += ev.duration_ns / 1e6 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """Median (the headline number), min, max and the raw values.

    None and NaN entries (invalid measurements) are kept in "values" and "n" but left out of
    the statistics, which are None when no value is valid.
    """
    raw = [None if v is None or v != v else float(v) for v in values]
    vals = [v for v in raw if v is not None]
    if not vals:
        return {"n": len(raw), "median": None, "min": None, "max": None, "values": raw}
    return {
        "n": len(raw),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "values": raw,
    }


def settle(limit_s: float, below: float = 1.0) -> None:
    """Wait (at most `limit_s` seconds) for the 1-minute load average to fall below `below`,
    so a timed block starts quiet after compiling (XLA's compile threads raise it)."""
    end = time.time() + limit_s
    while time.time() < end and (load_average() or [0])[0] >= below:
        time.sleep(5)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on every platform
        return None


# ----------------------------------------------------------------------------- child processes


@dataclass
class ChildResult:
    returncode: int
    wall_s: float
    peak_rss_mb: float  # ru_maxrss of the child itself (Linux reports KiB)
    user_cpu_s: float
    sys_cpu_s: float
    spawn_time: float  # time.time() just before the child was started
    extra: dict[str, Any] = field(default_factory=dict)


def python_command(*args: str) -> list[str]:
    """The current interpreter (so the venv is used) with `args`."""
    return [sys.executable, *args]


def start_child(cmd: Sequence[str], *, stdin: Any = None, stdout: Any = None,
                env: dict[str, str] | None = None,
                cwd: str | os.PathLike | None = None) -> tuple[subprocess.Popen, float, float]:
    """Start `cmd`; returns (process, time.time() and perf_counter() just before the start)."""
    spawn_time, spawn_perf = time.time(), time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdin=stdin, stdout=stdout, env=env,
                            cwd=cwd, text=True, bufsize=1)
    return proc, spawn_time, spawn_perf


def wait_child(proc: subprocess.Popen, spawn_time: float, spawn_perf: float,
               timeout_s: float | None = None) -> ChildResult:
    """Reap `proc` with `os.wait4` to get ITS resource usage (peak RSS of that child only).

    After `timeout_s` seconds the child is killed (returncode then is negative).
    """
    timer = None
    if timeout_s is not None:
        timer = threading.Timer(timeout_s, proc.kill)
        timer.daemon = True
        timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - spawn_perf
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # so Popen does not try to reap it again
    # Linux: ru_maxrss in KiB; macOS: bytes
    rss_bytes = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return ChildResult(
        returncode=code, wall_s=wall, peak_rss_mb=rss_bytes / 2**20,
        user_cpu_s=usage.ru_utime, sys_cpu_s=usage.ru_stime, spawn_time=spawn_time,
    )


def run_child(cmd: Sequence[str], *, timeout_s: float | None = None,
              env: dict[str, str] | None = None,
              cwd: str | os.PathLike | None = None) -> tuple[ChildResult, str]:
    """Run `cmd` to completion (stderr passes through); returns (usage, its stdout)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out:
        proc, t_wall, t_perf = start_child(cmd, stdout=out, env=env, cwd=cwd)
        result = wait_child(proc, t_wall, t_perf, timeout_s)
        out.seek(0)
        return result, out.read()


# ----------------------------------------------------------------------------- machine info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_info(packages: Iterable[str] = ("jax", "jaxlib", "flax", "torch", "transformers",
                                             "numpy", "gsm-jax")) -> dict[str, Any]:
    """What the numbers were measured on (call at the start of a run)."""
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "memory_gb": None if mem_gb is None else round(mem_gb, 1),
        "load_average_1_5_15": load_average(),
        "versions": {p: _version(p) for p in packages},
        "git_commit": _git_commit(),
    }


# ----------------------------------------------------------------------------- output


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def write_json(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(data), indent=2) + "\n")
    return path


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        if value != value:
            return "—"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                   digits: int = 2) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c, digits) for c in row) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def bar_chart(path: str | os.PathLike, groups: Sequence[str], series: dict[str, Sequence[Any]],
              *, title: str = "", ylabel: str = "", annotate: bool = True) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series (None = missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(len(series), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups) * n / 2, 4.0))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [0.0 if v is None else float(v) for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        if annotate:
            for bar, v in zip(bars, values, strict=True):
                if v is not None:
                    ax.annotate(f"{float(v):.1f}", (bar.get_x() + bar.get_width() / 2,
                                                   bar.get_height()),
                                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- cpu features


def cpu_flags(names: Iterable[str] = ("avx2", "avx512f", "avx512_vnni", "avx_vnni",
                                      "avx512_bf16", "amx_tile", "amx_bf16",
                                      "amx_int8")) -> dict[str, bool | None]:
    """Which of `names` the first CPU's `flags` line in /proc/cpuinfo lists (None each
    when there is no /proc/cpuinfo, e.g. not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {n: None for n in names}
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return {n: n in have for n in names}
