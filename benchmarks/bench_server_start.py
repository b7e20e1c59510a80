"""The server's start-up as a user sees it: `gsm-jax serve` from a cold start to ready (issue 42).

    python benchmarks/bench_server_start.py --out runs/bench_server_start
    python benchmarks/bench_server_start.py --quick --out /tmp/server_start   # smoke run

What a user runs: `gsm-jax serve --model smollm2-135m` (scenario "defaults") and the same
with `--max-len 8192` (scenario "max-len-8192", SmolLM2's whole context), each started
twice in a fresh process:

- **cold**: the persistent compilation cache points to a new, empty folder
  (`GSM_JAX_COMPILATION_CACHE=<tmp>/<scenario>`; JAX's own `JAX_COMPILATION_CACHE_DIR`,
  which would take precedence, is removed from the server's environment);
- **warm**: the same folder again (`--warm-runs` times), as a second start of the same
  command finds it.

Per start, from the moment the process is spawned:

- `ready_s`: seconds until `/health` answers 200 (polled every `--poll-s`, 0.2 s), and
  `http_s` (first answer of any kind), `warming_s` (first "warming" status: the model
  is loaded); every distinct "warming n/N" message /health gave, with its time;
- at ready: `gsm_jax_compilations_total` from /metrics (the XLA programs the process
  built, compiled or loaded from the cache: "programs compiled at start"), the
  engine's own program counts (`/admin/stats`), the server's RSS and the CPU seconds it
  used, the 1-minute load average, and the CPU other processes used meanwhile
  (`/proc/stat` minus the server's own, in cores);
- then a small mixed workload over HTTP (greedy, sampled, n > 1, penalties and
  logit_bias, logprobs / top_logprobs / echo streamed and not, prompts from 1 token to
  `--max-len` - 4 including ones longer than `--prefill-chunk` (chunked prefill),
  concurrent rows, a repeated long prompt (a prefix-cache hit), a GSM config change, a
  canary and a rollback), each part's compilations counted from /metrics, and
  `gsm_jax_compilations_after_ready_total` after it;
- SIGTERM: the exit code and how long the drain took; from the log, the warm-up's
  progress lines, the CLI's "XLA: N programs ready ..., K loaded from the persistent
  cache" summary and the cache folder it names (checked against the one given); the
  log's tail when anything failed.

Goals (issue 42; 2 cores, SmolLM2):

- defaults: warm ready <= 15 s, cold ready <= 90 s;
- `--max-len 8192`: cold and warm each within 1.2x of the defaults';
- programs compiled at start (`gsm_jax_compilations_total` at ready) <= 16, and the
  same at both max-lens;
- zero compilations after ready under the workload.

Each is reported pass / FAIL (or "not measured" when a scenario was left out). A timing
is comparable when the 1-minute load average was <= 1.5 when its process started
(`--settle-s`: wait for it to fall below 1 first) and other processes used <= 0.5 core
meanwhile; otherwise its figures are marked not comparable (the server's own compile
threads load every core, so the load at ready says nothing about the background).

`--quick`: the defaults scenario only, cold + warm, with `--max-batch 2 --max-len 256
--prefill-chunk 64 --warmup-lengths 16` and no settling: a smoke run of this script,
not a measurement. `--server-args "..."` adds flags to every start (a scenario's own
flags come last and win).

Outputs in `--out`: results.json, results.md, results.png (ready seconds per scenario,
cold and warm, with the goals), and each start's server log.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)
from common import (  # noqa: E402
    REPO_ROOT,
    fmt,
    load_average,
    machine_info,
    markdown_table,
    write_json,
    write_markdown,
)

SCENARIOS: dict[str, list[str]] = {"defaults": [], "max-len-8192": ["--max-len", "8192"]}
BASELINE = "defaults"
QUICK_SERVER_ARGS = ["--max-batch", "2", "--max-len", "256", "--prefill-chunk", "64",
                     "--warmup-lengths", "16"]
GOAL_WARM_S = 15.0
GOAL_COLD_S = 90.0
GOAL_RATIO = 1.2  # another max-len against the defaults, cold and warm
GOAL_PROGRAMS = 16
MAX_COMPARABLE_LOAD = 1.5
MAX_OTHERS_CORES = 0.5  # CPU other processes may use during a start (cores, averaged)
TOKEN = "bench-server-start-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
GSM_ON = {"enable": True, "target_layers": "all", "smooth_strength": 0.3, "window_size": 4}
# what the server's environment must not carry: it would choose the cache folder or its
# policy instead of GSM_JAX_COMPILATION_CACHE (gsm_jax/compile_cache.py)
CACHE_ENV_REMOVED = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")

WARM_LINE = re.compile(r"warming (\d+)/(\d+): (.*?) \((\d+) programs, ([0-9.]+) s\)")
READY_LINE = re.compile(r" ready \(.*?warm-up ([0-9.]+) s, (\d+) programs")
XLA_LINE = re.compile(r"XLA: (\d+) programs ready in ([0-9.]+) s; (?:(\d+) of them loaded "
                      r"from the persistent cache \(([^)]*)\)|persistent cache off)")
SAVED_LINE = re.compile(r"programs are saved in (\S+) and loaded")
AFTER_READY_LINE = re.compile(r"compiled (\S+) after ready")


def log(msg: str) -> None:
    print(f"[bench_server_start] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_server_start"))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument("--server-args", default="",
                    help="extra `gsm-jax serve` flags for every start, one string")
    ap.add_argument("--warm-runs", type=int, default=1, help="warm starts per scenario")
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="a start not ready after this long is killed and counted failed")
    ap.add_argument("--poll-s", type=float, default=0.2, help="/health polling interval")
    ap.add_argument("--settle-s", type=float, default=180.0,
                    help="before each start, wait at most this long for the 1-minute load "
                         "average to fall below 1 (the previous start raised it)")
    ap.add_argument("--cache-root", type=Path, default=None,
                    help="where the scenarios' cache folders go (default: a temporary "
                         "folder, removed at the end)")
    ap.add_argument("--no-workload", action="store_true",
                    help="skip the workload after ready (start-up only)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: defaults only, " + " ".join(QUICK_SERVER_ARGS)
                    + ", no settling (not a measurement)")
    args = ap.parse_args(argv)
    args.extra = shlex.split(args.server_args)
    if args.quick:
        args.scenarios = BASELINE
        args.extra = QUICK_SERVER_ARGS + args.extra
        args.settle_s = 0.0
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        ap.error(f"unknown scenario {unknown or names!r}: choose from {', '.join(SCENARIOS)}")
    args.scenario_list = list(dict.fromkeys(names))
    if args.warm_runs < 1 or args.poll_s <= 0 or args.timeout_s <= 0:
        ap.error("--warm-runs must be >= 1, --poll-s and --timeout-s > 0")
    return args


def server_command(model: str, extra: Sequence[str], scenario: str) -> list[str]:
    """`gsm-jax serve` arguments of one start (without --port / --admin-token, which
    `ServerProcess` adds): the model, the extra flags, then the scenario's own."""
    return ["--model", model, *extra, *SCENARIOS[scenario], "--log-level", "info"]


def serve_settings(serve_args: Sequence[str]) -> argparse.Namespace:
    """The flags those arguments give the server, with the CLI's own defaults."""
    from gsm_jax.serving.cli import add_serve_args

    p = argparse.ArgumentParser(add_help=False)
    add_serve_args(p)
    return p.parse_known_args(list(serve_args))[0]


# ----------------------------------------------------------------------------- readings


def metric(text: str, name: str) -> float | None:
    """The sum of a metric's samples in a Prometheus text page (None: absent)."""
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(vals) if vals else None


def parse_log(text: str) -> dict[str, Any]:
    """What the server's log says about its start: the warm-up's progress lines, its
    ready line, the CLI's XLA summary, the cache folder it named, late compilations."""
    warm = [{"done": int(m[1]), "total": int(m[2]), "stage": m[3], "programs": int(m[4]),
             "s": float(m[5])} for m in WARM_LINE.finditer(text)]
    ready, xla = READY_LINE.search(text), XLA_LINE.search(text)
    saved = SAVED_LINE.search(text)
    return {
        "warming_lines": warm,
        "warmup_s": float(ready[1]) if ready else None,
        "warmup_programs": int(ready[2]) if ready else None,
        "xla_programs": int(xla[1]) if xla else None,
        "xla_s": float(xla[2]) if xla else None,
        "cache_hits": (int(xla[3]) if xla[3] else 0) if xla else None,
        "cache_dir_logged": (xla[4] if xla and xla[4] else saved[1] if saved else None),
        "compiled_after_ready": AFTER_READY_LINE.findall(text),
    }


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time all cores have spent busy since boot (/proc/stat)."""
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = f[0] + f[1] + f[2] + sum(f[5:8])  # user nice system, irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mb(pid: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {"rss_mb": None, "peak_rss_mb": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                out["peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def folder_size(path: Path) -> dict[str, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


# ----------------------------------------------------------------------------- workload


def _ids(n: int, vocab: int, salt: int = 0) -> list[int]:
    """n token ids, spread over the vocabulary between its first 100 and last 2 ids
    (where tokenizers put their special tokens)."""
    lo = min(100, vocab // 4)
    return [lo + (7919 * i + 104729 * salt) % (vocab - lo - 2) for i in range(n)]


def workload_parts(http: Any, model: str, settings: argparse.Namespace, vocab: int,
                   chat_template: bool) -> list[tuple[str, Callable[[], None]]]:
    """The parts of the mixed workload, each a callable that raises on a wrong answer.
    Sized by the server's flags: prompts up to max_len - 4, some longer than its
    prefill chunk; the GSM parts only with GSM compiled in."""
    max_len, chunk = int(settings.max_len), settings.prefill_chunk

    def ok(r) -> dict:
        if r.status_code != 200:
            raise RuntimeError(f"{r.request.url.path}: {r.status_code} {r.text[:300]}")
        return r.json()

    def comp(prompt, max_tokens: int, headers=None, **kw) -> dict:
        return ok(http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, **kw},
            headers=headers))

    def chat(content: str, max_tokens: int, **kw) -> None:
        if chat_template:  # a model without a chat template answers 400
            ok(http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, **kw}))

    def stream(path: str, body: dict) -> None:
        if path.endswith("chat/completions") and not chat_template:
            return
        with http.stream("POST", path, json={"model": model, **body, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{path} (stream): {r.status_code} {r.read()[:300]!r}")
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            raise RuntimeError(f"{path} (stream) did not end in [DONE]")

    def at_once(*calls: Callable[[], Any]) -> None:
        with ThreadPoolExecutor(len(calls)) as pool:
            for f in [pool.submit(c) for c in calls]:
                f.result()

    def ids(n: int, salt: int = 0) -> list[int]:
        return _ids(n, vocab, salt)

    room = max_len - 4
    long_n = max(2, min((chunk or 256) + (chunk or 256) // 2 + 7, room))
    long = ids(long_n, 11)

    def greedy():
        comp(ids(1), 4, temperature=0)
        comp("The history of the city begins", 8, temperature=0)
        chat("What is two and two?", 8, temperature=0)
        stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6,
                                   "temperature": 0})

    def sampled():
        comp("Once upon a time", 8, temperature=0.8, top_k=8, top_p=0.9, seed=3)
        comp("Once upon a time", 8, temperature=1.0, seed=4)
        comp("Once upon a time", 8, temperature=0.7, top_p=0.5)
        chat("Tell me a story.", 6, temperature=1.2, top_k=5, seed=9)
        stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 6, "temperature": 0.9, "seed": 2})

    def n_many():
        comp("Count: 1, 2,", 6, n=3, temperature=0.9, seed=1)
        comp([ids(5), ids(9, 1)], 4, n=2, temperature=0)

    def penalties():
        comp("abab abab", 8, frequency_penalty=0.5, temperature=0)
        comp("abab abab", 8, presence_penalty=0.7, temperature=0.8, seed=5)
        comp("abab abab", 8, repetition_penalty=1.3, temperature=0)
        comp("abab abab", 8, logit_bias={str(ids(1, 3)[0]): 5.0}, temperature=0)

    def logprobs():
        chat("Score me.", 6, logprobs=True, top_logprobs=3, temperature=0)
        stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go"}],
                                        "max_tokens": 6, "logprobs": True,
                                        "top_logprobs": 2, "temperature": 0})
        comp("The cat sat on", 6, logprobs=2, echo=True, temperature=0)
        comp(ids(40), 4, logprobs=1, temperature=0.8, seed=2)
        comp(ids(70, 3), 0, logprobs=5, echo=True)  # the prompt alone (lm-eval)
        stream("/v1/completions", {"prompt": "A dog ran", "max_tokens": 5, "logprobs": 3,
                                   "echo": True, "temperature": 0})

    lengths_n = sorted({n for n in (2, 17, 100, (chunk or 0) - 1, chunk or 0,
                                    (chunk or 0) + 1, long_n, room) if 1 <= n <= room})

    def lengths():
        for n in lengths_n:
            comp(ids(n, n), min(3, max_len - n), temperature=0, ignore_eos=True)

    def concurrent():
        at_once(lambda: comp(ids(3), 16, temperature=0, ignore_eos=True),
                lambda: comp(ids(min(90, room), 2), 12, temperature=0.8, seed=3,
                             ignore_eos=True),
                lambda: comp(ids(20, 4), 12, repetition_penalty=1.2, ignore_eos=True),
                lambda: comp(ids(7, 6), 20, temperature=1.0, top_k=3, seed=2,
                             ignore_eos=True))

    def prefix_cache():
        before = metric(http.get("/metrics").text, "gsm_jax:prefix_cache_hits_total") or 0
        comp(long, 4, temperature=0)
        comp(long, 4, temperature=0)  # resumes from the cached chunk boundaries
        stream("/v1/completions", {"prompt": long, "max_tokens": 3, "temperature": 0})
        after = metric(http.get("/metrics").text, "gsm_jax:prefix_cache_hits_total") or 0
        if (settings.enable_prefix_caching and settings.prefix_cache_gb > 0 and chunk
                and long_n > chunk and not after > before):
            raise RuntimeError(f"no prefix-cache hit ({before} -> {after} tokens)")

    def gsm_change():
        ok(http.put("/admin/gsm", json=GSM_ON, headers=ADMIN))
        comp("Smooth me", 6, temperature=0)
        comp(long, 3, temperature=0)
        comp("abab", 5, frequency_penalty=0.3, logprobs=2, temperature=0.7, seed=3)

    def canary():
        ok(http.post("/admin/gsm/rollout", json={"fraction": 0.5}, headers=ADMIN))
        at_once(*(lambda i=i: comp(ids(30, i), 8, headers={"x-request-id": f"canary-{i}"},
                                   temperature=0, ignore_eos=True) for i in range(4)))
        ok(http.post("/admin/gsm/rollback", headers=ADMIN))
        comp("Rolled back", 4, temperature=0)

    parts = [("greedy", greedy), ("sampled", sampled), ("n>1", n_many),
             ("penalties, logit_bias", penalties), ("logprobs / echo", logprobs),
             (f"prompt lengths {lengths_n[0]}..{lengths_n[-1]} (chunked)", lengths),
             ("concurrent rows", concurrent), ("prefix-cache hit", prefix_cache)]
    if not settings.no_gsm:
        parts += [("GSM config change", gsm_change), ("canary and rollback", canary)]
    return parts


def run_workload(url: str, settings: argparse.Namespace) -> dict[str, Any]:
    """The mixed workload through HTTP; per part its seconds, the programs it made the
    server build (`gsm_jax_compilations_total` before and after) and any error."""
    import httpx

    http = httpx.Client(base_url=url, timeout=900)
    try:
        model = http.get("/v1/models").json()["data"][0]["id"]
        info = http.get("/tokenizer_info").json()
        parts = workload_parts(http, model, settings, int(info["vocab_size"]),
                               bool(info.get("chat_template")))

        def total() -> float | None:
            time.sleep(0.2)  # the engine thread's last step of the part
            return metric(http.get("/metrics").text, "gsm_jax_compilations_total")

        out: list[dict[str, Any]] = []
        for what, fn in parts:
            c0, t0 = total(), time.perf_counter()
            err = None
            try:
                fn()
            except Exception as e:  # recorded, the next part still runs
                err = f"{type(e).__name__}: {e}"[:500]
            s = time.perf_counter() - t0
            c1 = total()
            out.append({"part": what, "s": s, "error": err,
                        "compilations": None if c0 is None or c1 is None else c1 - c0})
        page = http.get("/metrics").text
        return {"parts": out, "ok": all(p["error"] is None for p in out),
                "compilations_total_after": metric(page, "gsm_jax_compilations_total"),
                "compilations_after_ready": metric(
                    page, "gsm_jax_compilations_after_ready_total")}
    finally:
        http.close()


# ----------------------------------------------------------------------------- one start


def start_once(args: argparse.Namespace, scenario: str, phase: str, cache: Path,
               run_name: str) -> dict[str, Any]:
    """One start of `gsm-jax serve` against the cache folder `cache`: timed to ready,
    read, loaded with the workload, stopped with SIGTERM."""
    import httpx

    from gsm_jax.serving.launch import ServerProcess

    serve_args = server_command(args.model, args.extra, scenario)
    settings = serve_settings(serve_args)
    log_path = args.out / f"server_{run_name}.log"
    srv = ServerProcess(serve_args, log_path=log_path, admin_token=TOKEN,
                        timeout=args.timeout_s,
                        env={"GSM_JAX_COMPILATION_CACHE": str(cache),
                             "PYTHONPATH": str(REPO_ROOT)})
    removed = {k: srv.env.pop(k) for k in CACHE_ENV_REMOVED if k in srv.env}
    res: dict[str, Any] = {
        "scenario": scenario, "phase": phase, "run": run_name, "cache_dir": str(cache),
        "cache_before": folder_size(cache), "serve_args": serve_args,
        "max_len": settings.max_len, "max_batch": settings.max_batch,
        "prefill_chunk": settings.prefill_chunk, "env_removed": removed,
        "log": str(log_path), "error": None}
    if args.settle_s > 0:
        common.settle(args.settle_s)
    res["load_average_before"] = load_average()
    busy0 = _cpu_busy_s()
    t0 = time.perf_counter()
    srv.start(wait=False)
    pid = srv.proc.pid
    progress: list[dict[str, Any]] = []
    last_msg, shown, last_print = None, "", 0.0
    res.update(http_s=None, warming_s=None, ready_s=None, warming_progress=progress,
               others_cores=None)
    try:
        while True:
            now = time.perf_counter() - t0
            if srv.proc.poll() is not None:
                res["error"] = f"the server exited with {srv.proc.returncode} before ready"
                break
            if now > args.timeout_s:
                res["error"] = f"not ready after {args.timeout_s:.0f} s"
                break
            h = srv.health()
            if h is not None:
                code, body, _ = h
                if res["http_s"] is None:
                    res["http_s"] = now
                status = body.get("status")
                if status == "warming" and res["warming_s"] is None:
                    res["warming_s"] = now
                if code == 200:
                    res["ready_s"] = now
                    break
                msg = body.get("message") or status
                if status == "failed" or body.get("error"):
                    res["error"] = f"/health: {body}"
                    break
                if msg != last_msg:
                    progress.append({"t_s": round(now, 2), "status": status, "message": msg})
                    last_msg = msg
            if shown != last_msg or now - last_print >= 10:
                shown, last_print = last_msg, now
                log(f"{run_name}: {last_msg or 'starting'} ({now:.1f} s)")
            time.sleep(args.poll_s)
        busy1, server_cpu = _cpu_busy_s(), _proc_cpu_s(pid)
        res["load_average_at_ready"] = load_average()
        res.update(_proc_rss_mb(pid))
        res["server_cpu_s"] = server_cpu
        elapsed = time.perf_counter() - t0
        if busy0 is not None and busy1 is not None and server_cpu is not None:
            # the poller's own CPU is counted among "others": a few ms a poll
            res["others_cores"] = max(0.0, (busy1 - busy0 - server_cpu) / elapsed)
        if res["ready_s"] is not None:
            log(f"{run_name}: ready in {res['ready_s']:.1f} s")
            page = httpx.get(f"{srv.url}/metrics", timeout=30).text
            res["compilations_at_ready"] = metric(page, "gsm_jax_compilations_total")
            res["compilations_after_ready_at_ready"] = metric(
                page, "gsm_jax_compilations_after_ready_total")
            try:
                stats = httpx.get(f"{srv.url}/admin/stats", headers=ADMIN, timeout=30)
                res["engine_programs"] = stats.json().get("programs") if (
                    stats.status_code == 200) else None
            except (httpx.HTTPError, ValueError):
                res["engine_programs"] = None
            if not args.no_workload:
                log(f"{run_name}: workload ...")
                t = time.perf_counter()
                res["workload"] = run_workload(srv.url, settings)
                res["workload"]["s"] = time.perf_counter() - t
                res["compilations_after_ready"] = res["workload"]["compilations_after_ready"]
                if not res["workload"]["ok"]:
                    res["error"] = "workload: " + "; ".join(
                        f"{p['part']}: {p['error']}" for p in res["workload"]["parts"]
                        if p["error"])
            else:
                res["compilations_after_ready"] = res["compilations_after_ready_at_ready"]
        res["load_average_after"] = load_average()
    except Exception as e:  # recorded: the next start still runs
        res["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        t = time.perf_counter()
        rc = srv.stop(timeout=120)
        res["rc"] = rc if rc is not None else "killed"
        res["stop_s"] = time.perf_counter() - t
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    res["log_summary"] = parse_log(text)
    logged = res["log_summary"]["cache_dir_logged"]
    res["cache_dir_ok"] = None if logged is None else (
        Path(logged).resolve() == cache.resolve())
    res["cache_after"] = folder_size(cache)
    if rc != 0 and res["error"] is None:
        res["error"] = f"SIGTERM: rc {res['rc']}"
    if res["error"] is not None or res.get("compilations_after_ready"):
        res["log_tail"] = text[-4000:]
    lb = (res["load_average_before"] or [0.0])[0]
    res["comparable"] = lb <= MAX_COMPARABLE_LOAD and (
        res["others_cores"] is None or res["others_cores"] <= MAX_OTHERS_CORES)
    log(f"{run_name}: " + (f"ready {res['ready_s']:.1f} s" if res["ready_s"] is not None
                           else "NOT ready")
        + f", {fmt(res.get('compilations_at_ready'), 0)} programs at ready, "
          f"{fmt(res.get('compilations_after_ready'), 0)} after, rc {res['rc']}"
        + (f", error: {res['error']}" if res["error"] else ""))
    return res


# ----------------------------------------------------------------------------- goals


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize_runs(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per scenario and phase: the median ready_s, the programs at ready, comparability."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        out.setdefault(r["scenario"], {}).setdefault(r["phase"], []).append(r)
    return {sc: {ph: {"ready_s": _median(rs, "ready_s"),
                      "all_ready": all(r.get("ready_s") is not None for r in rs),
                      "programs_at_ready": [r.get("compilations_at_ready") for r in rs],
                      "comparable": all(r.get("comparable") for r in rs), "n": len(rs)}
                 for ph, rs in phases.items()}
            for sc, phases in out.items()}


def check_goals(runs: list[dict]) -> list[dict[str, Any]]:
    """Issue 42's goals, each {goal, value, target, verdict ("pass" / "FAIL" / "not
    measured"), comparable (timings: every run involved was; counts: always)}."""
    s = summarize_runs(runs)
    goals: list[dict[str, Any]] = []

    def add(goal: str, value: Any, target: str, ok: bool | None, comparable: bool = True,
            shown: str | None = None) -> None:
        goals.append({"goal": goal, "value": value, "shown": shown if shown is not None
                      else fmt(value), "target": target,
                      "verdict": "not measured" if ok is None else "pass" if ok else "FAIL",
                      "comparable": comparable})

    def cell(sc: str, ph: str) -> dict[str, Any] | None:
        return s.get(sc, {}).get(ph)

    for ph, limit in (("warm", GOAL_WARM_S), ("cold", GOAL_COLD_S)):
        c = cell(BASELINE, ph)
        if c is None:
            add(f"{BASELINE}: {ph} ready", None, f"<= {limit:.0f} s", None)
        else:
            v = c["ready_s"] if c["all_ready"] else None
            add(f"{BASELINE}: {ph} ready", v, f"<= {limit:.0f} s",
                v is not None and v <= limit, c["comparable"],
                shown=f"{v:.1f} s" if v is not None else "not ready")
    for sc in SCENARIOS:
        if sc == BASELINE:
            continue
        for ph in ("cold", "warm"):
            c, base = cell(sc, ph), cell(BASELINE, ph)
            goal = f"{sc} / {BASELINE}: {ph} ready"
            if c is None or base is None:
                add(goal, None, f"<= {GOAL_RATIO}x", None)
                continue
            ok_runs = c["all_ready"] and base["all_ready"] and base["ready_s"]
            v = c["ready_s"] / base["ready_s"] if ok_runs else None
            add(goal, v, f"<= {GOAL_RATIO}x", v is not None and v <= GOAL_RATIO,
                c["comparable"] and base["comparable"],
                shown=f"{v:.2f}x ({c['ready_s']:.1f} / {base['ready_s']:.1f} s)"
                if v is not None else "not ready")
    counts = {(r["scenario"], r["phase"]): r.get("compilations_at_ready") for r in runs}
    known = [v for v in counts.values() if v is not None]
    if not runs:
        add("programs compiled at start", None, f"<= {GOAL_PROGRAMS}", None)
    else:
        worst = max(known) if known else None
        add("programs compiled at start (gsm_jax_compilations_total at ready, most of any "
            "start)", worst, f"<= {GOAL_PROGRAMS}",
            worst is not None and len(known) == len(counts) and worst <= GOAL_PROGRAMS,
            shown=fmt(worst, 0) if worst is not None else "not read")
    # per phase (cold / warm), the programs at ready of each --max-len
    per_phase: dict[str, dict[int, list]] = {}
    for r in runs:
        per_phase.setdefault(r["phase"], {}).setdefault(r["max_len"], []).append(
            r.get("compilations_at_ready"))
    lens = {ml for d in per_phase.values() for ml in d}
    goal = "programs at start: the same at every --max-len"
    if len(lens) < 2:
        add(goal, None, "equal", None)
    else:
        values = [v for d in per_phase.values() for vs in d.values() for v in vs]
        ok = None not in values and all(
            len({v for vs in d.values() for v in vs}) == 1 for d in per_phase.values())
        shown = "; ".join(f"{ph}: " + ", ".join(
            f"{ml}: {'/'.join(fmt(v, 0) for v in vs)}" for ml, vs in sorted(d.items()))
            for ph, d in per_phase.items())
        add(goal, shown, "equal", ok, shown=shown)
    after = [r.get("compilations_after_ready") for r in runs]
    if not runs:
        add("compilations after ready (workload)", None, "0", None)
    else:
        known_after = [a for a in after if a is not None]
        worst = max(known_after) if known_after else None
        add("compilations after ready under the workload (most of any start)", worst, "0",
            worst is not None and len(known_after) == len(after) and worst == 0,
            shown=fmt(worst, 0) if worst is not None else "not read")
    return goals


# ----------------------------------------------------------------------------- outputs


def write_outputs(out: Path, data: dict[str, Any]) -> None:
    """results.json, results.md and results.png from a result dict (`main`'s)."""
    runs, goals = data["runs"], data["goals"]
    write_json(out / "results.json", data)
    rows = []
    for r in runs:
        wl = r.get("workload") or {}
        lb = r.get("load_average_before") or [None]
        la = r.get("load_average_at_ready") or [None]
        rows.append([
            r["scenario"], r["phase"], r["max_len"],
            fmt(r.get("ready_s"), 1) if r.get("ready_s") is not None else "not ready",
            fmt(r.get("warming_s"), 1),
            fmt(r["ready_s"] - r["warming_s"], 1) if r.get("ready_s") is not None
            and r.get("warming_s") is not None else "—",
            fmt(r.get("compilations_at_ready"), 0),
            fmt((r.get("log_summary") or {}).get("cache_hits"), 0),
            fmt(r.get("compilations_after_ready"), 0),
            "—" if not wl else ("ok" if wl.get("ok") else "ERROR"),
            f"{fmt(lb[0])} / {fmt(la[0])}", fmt(r.get("others_cores")),
            r.get("rc"), "yes" if r.get("comparable") else "NO"])
    table = markdown_table(
        ["scenario", "start", "max_len", "ready s", "model loaded s", "warming s",
         "programs at ready", "cache hits", "after ready", "workload", "load before / at ready",
         "others' cores", "rc", "comparable"], rows)
    gtable = markdown_table(
        ["goal", "value", "target", "verdict", "comparable"],
        [[g["goal"], g["shown"], g["target"], g["verdict"],
          "yes" if g["comparable"] else "NO (load)"] for g in goals])
    prog = []
    for r in runs:
        steps = ", ".join(f"{p['t_s']:.1f} s {p['message']}" for p in
                          r.get("warming_progress") or [])
        prog.append(f"- **{r['run']}**: {steps or '(none seen)'}")
        if r.get("error"):
            prog.append(f"  - error: {r['error']}")
        ls = r.get("log_summary") or {}
        if ls.get("compiled_after_ready"):
            prog.append(f"  - compiled after ready: {', '.join(ls['compiled_after_ready'])}")
        if r.get("cache_dir_ok") is False:
            prog.append(f"  - the log names the cache folder {ls.get('cache_dir_logged')}, "
                        f"not {r['cache_dir']}")
    parts = []
    for r in runs:
        for p in (r.get("workload") or {}).get("parts", []):
            parts.append([r["run"], p["part"], fmt(p["s"], 2), fmt(p["compilations"], 0),
                          p["error"] or ""])
    cfg = data["config"]
    quick = (" **Quick smoke run (--quick): not a measurement.**" if cfg.get("quick")
             else "")
    md = (f"# `gsm-jax serve` start-up: cold and warm ({cfg['model']})\n\n"
          f"Seconds from spawning the process to `/health` 200; cold = an empty "
          f"compilation-cache folder, warm = the same folder again. Extra server flags: "
          f"`{' '.join(cfg['server_args']) or '(none)'}`. Machine: "
          f"{data['machine_before'].get('cpu_model')}, {data['machine_before'].get('cpu_count')}"
          f" cores.{quick}\n\n## Goals (issue 42)\n\n{gtable}\n## Starts\n\n{table}\n"
          f"A start is comparable when the 1-minute load was <= {MAX_COMPARABLE_LOAD} when it "
          f"began and other processes used <= {MAX_OTHERS_CORES} core meanwhile.\n\n"
          f"## Warming progress (/health, polled every {cfg['poll_s']} s)\n\n"
          + "\n".join(prog) + "\n")
    if parts:
        md += ("\n## Workload after ready\n\n"
               + markdown_table(["start", "part", "s", "programs built", "error"], parts))
    write_markdown(out / "results.md", md)
    plot(out / "results.png", runs, cfg.get("quick", False))


def plot(path: Path, runs: list[dict], quick: bool = False) -> Path:
    """Ready seconds per scenario, cold and warm bars, with the goals: the defaults'
    absolute limits as lines, another max-len's 1.2x of the defaults as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize_runs(runs)
    scenarios = [sc for sc in SCENARIOS if sc in s] + [sc for sc in s if sc not in SCENARIOS]
    phases = ("cold", "warm")
    colors = {"cold": "#3b6ea8", "warm": "#e0873a"}
    fig, ax = plt.subplots(figsize=(4.5 + 2.2 * len(scenarios), 4.2))
    width, marked = 0.38, False
    for j, ph in enumerate(phases):
        for i, sc in enumerate(scenarios):
            c = s[sc].get(ph)
            x = i + (j - 0.5) * width
            if c is None:
                continue
            v = c["ready_s"] if c["all_ready"] else None
            ax.bar(x, v or 0.0, width, color=colors[ph], label=ph if i == 0 else None,
                   hatch=None if c["comparable"] else "//", edgecolor="black", linewidth=0.4)
            ax.annotate("not ready" if v is None else f"{v:.1f}", (x, v or 0.0),
                        ha="center", va="bottom", fontsize=8)
            base = s.get(BASELINE, {}).get(ph)
            if sc != BASELINE and base is not None and base["ready_s"]:
                lim = GOAL_RATIO * base["ready_s"]
                ax.hlines(lim, x - width / 2, x + width / 2, colors="black",
                          linestyles=":", linewidth=1.5,
                          label=None if marked else f"goal: {GOAL_RATIO}x {BASELINE}'s")
                marked = True
                ax.annotate(f"{GOAL_RATIO}x", (x + width / 2, lim), fontsize=7, va="bottom")
    ax.axhline(GOAL_COLD_S, color=colors["cold"], linestyle="--", linewidth=1,
               label=f"cold goal {GOAL_COLD_S:.0f} s ({BASELINE})")
    ax.axhline(GOAL_WARM_S, color=colors["warm"], linestyle="--", linewidth=1,
               label=f"warm goal {GOAL_WARM_S:.0f} s ({BASELINE})")
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("seconds to /health 200")
    ax.set_title("gsm-jax serve start-up (hatched: not comparable)"
                 + ("\nquick smoke run, not a measurement" if quick else ""), fontsize=9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info_before = machine_info()
    own_root = args.cache_root is None
    root = Path(tempfile.mkdtemp(prefix="gsm_jax_start_")) if own_root else args.cache_root
    runs: list[dict[str, Any]] = []
    try:
        for sc in args.scenario_list:
            cache = root / sc
            if cache.exists():
                shutil.rmtree(cache)  # cold: an empty folder
            cache.mkdir(parents=True)
            plan = [("cold", f"{sc}_cold")] + [
                ("warm", f"{sc}_warm" + (f"{i + 1}" if args.warm_runs > 1 else ""))
                for i in range(args.warm_runs)]
            for phase, name in plan:
                log(f"{name}: starting `gsm-jax serve "
                    f"{' '.join(server_command(args.model, args.extra, sc))}` "
                    f"(cache {cache}, {folder_size(cache)['files']} files)")
                runs.append(start_once(args, sc, phase, cache, name))
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    data = {"config": {"model": args.model, "scenarios": args.scenario_list,
                       "scenario_args": {sc: SCENARIOS[sc] for sc in args.scenario_list},
                       "server_args": args.extra, "warm_runs": args.warm_runs,
                       "poll_s": args.poll_s, "settle_s": args.settle_s,
                       "timeout_s": args.timeout_s, "workload": not args.no_workload,
                       "quick": args.quick,
                       "goals": {"warm_ready_s": GOAL_WARM_S, "cold_ready_s": GOAL_COLD_S,
                                 "max_len_ratio": GOAL_RATIO,
                                 "programs_at_start": GOAL_PROGRAMS,
                                 "compilations_after_ready": 0},
                       "max_comparable_load": MAX_COMPARABLE_LOAD,
                       "max_others_cores": MAX_OTHERS_CORES},
            "machine_before": info_before, "machine_after": machine_info(),
            "runs": runs, "goals": check_goals(runs)}
    write_outputs(args.out, data)
    print((args.out / "results.md").read_text())
    return 0 if runs and all(r["error"] is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
