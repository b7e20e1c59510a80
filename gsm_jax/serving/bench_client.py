"""`gsm-jax bench-serve`: a load test of a running server over HTTP (any OpenAI-compatible
server: ours, vLLM, SGLang, llama.cpp's).

    gsm-jax bench-serve --url http://127.0.0.1:8000 --clients 32 --requests 512 --gsm-ab \\
        --admin-token T --out bench_serve/

Every request is a streaming `/v1/completions` call (`ignore_eos`, so each generates
exactly its `max_tokens` and every arm does the same work). Measured on the client,
from SSE chunk arrival times (as `vllm bench serve`): TTFT (send to first text chunk),
ITL (between chunks), TPOT ((e2e - TTFT) / (tokens - 1), tokens from the final usage)
and e2e latency; P50/P90/P95/P99 of each, throughput, and goodput: the requests per
second that met every SLO given (`--slo-ttft-ms`, `--slo-tpot-ms`, `--slo-e2e-ms`).

Loads: closed loop (`--clients N`: each client sends its next request when the last
one is done) or Poisson open loop (`--rate R` requests/s, fixed seed).

`--gsm-ab`: the run is split into the server's GSM arms *by rollout*: with the admin
token, the bench sets `rollout_fraction` 0.5 before the run (request ids are fresh,
so about half land in each arm by their hash) and rolls back after; every response
names its arm (`x-gsm-arm`), and each arm is reported apart, side by side in time.

Writes results.json (every request, the summary, the load average before and after)
and results.png (percentiles per arm).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BenchRequest", "Outcome", "percentiles", "run_bench", "summarize"]

PERCENTILES = (50, 90, 95, 99)


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int
    tag: str = ""


@dataclass
class Outcome:
    index: int
    tag: str
    request_id: str
    ok: bool
    status: int = 0
    error: str = ""
    arm: str = ""
    gsm_version: int = -1
    sent: float = 0.0  # seconds since the start of the run
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else math.nan


def _load() -> float:
    return os.getloadavg()[0]


async def _one(client: Any, model: str, req: BenchRequest, index: int, t0: float,
               timeout: float) -> Outcome:
    rid = f"bench-{uuid.uuid4().hex[:16]}"
    out = Outcome(index, req.tag, rid, ok=False)
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out.sent = start - t0
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout,
                                 headers={"x-request-id": rid}) as r:
            out.status = r.status_code
            out.arm = r.headers.get("x-gsm-arm", "")
            out.gsm_version = int(r.headers.get("x-gsm-version", -1))
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.ok = True
                    break
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                if last is None:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
        out.e2e = time.perf_counter() - start
    except Exception as e:  # a transport error is a failed request, counted
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _run(url: str, model: str, requests: list[BenchRequest], *, clients: int | None,
               rate: float | None, seed: int, timeout: float, progress: bool) -> list[Outcome]:
    import httpx

    n = len(requests)
    outs: list[Outcome | None] = [None] * n
    limits = httpx.Limits(max_connections=max(64, (clients or 0) + 8), max_keepalive_connections=64)
    done = 0

    def report(o: Outcome) -> None:
        nonlocal done
        outs[o.index] = o
        done += 1
        if progress and (done % max(1, n // 10) == 0 or done == n):
            print(f"[bench-serve] {done}/{n} requests done", flush=True)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        if rate is not None:
            rng = random.Random(seed)
            tasks, at = [], 0.0
            for i, req in enumerate(requests):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(_one(client, model, req, i, t0, timeout)))
                tasks[-1].add_done_callback(lambda t: report(t.result()))
                at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        else:
            queue = list(range(n))[::-1]

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    report(await _one(client, model, requests[i], i, t0, timeout))

            await asyncio.gather(*(worker() for _ in range(min(int(clients or 1), n))))
    return outs  # type: ignore[return-value]


def percentiles(values: Sequence[float | None], qs: Sequence[float]
                ) -> dict[str, float | int | None]:
    """{"n", "mean", "p<q>" for each q in qs} of the finite values (None where there are
    none); numpy's default (linear interpolation between closest ranks). The engine's
    benchmark (`gsm_jax.workflow.bench`) reports its latencies with it too."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    out: dict[str, float | int | None] = {"n": int(arr.size)}
    out["mean"] = float(arr.mean()) if arr.size else None
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(arr, q)) if arr.size else None
    return out


def summarize(outs: list[Outcome], wall: float, slo: dict[str, float]) -> dict[str, Any]:
    """Percentiles (seconds), throughput and goodput of one group of outcomes."""
    ok = [o for o in outs if o.ok]

    def meets(o: Outcome) -> bool:
        return ((slo.get("ttft") is None or o.ttft <= slo["ttft"])
                and (slo.get("tpot") is None or not o.tpot > slo["tpot"])
                and (slo.get("e2e") is None or o.e2e <= slo["e2e"]))

    tokens = sum(o.tokens for o in ok)
    return {
        "requests": len(outs), "completed": len(ok), "failed": len(outs) - len(ok),
        "statuses": {str(s): sum(o.status == s for o in outs) for s in {o.status for o in outs}},
        "ttft_s": percentiles([o.ttft for o in ok], PERCENTILES),
        "tpot_s": percentiles([o.tpot for o in ok], PERCENTILES),
        "itl_s": percentiles([x for o in ok for x in o.itl], PERCENTILES),
        "e2e_s": percentiles([o.e2e for o in ok], PERCENTILES),
        "output_tokens": tokens, "output_tok_per_s": tokens / wall if wall > 0 else None,
        "request_per_s": len(ok) / wall if wall > 0 else None,
        "goodput_req_per_s": (sum(meets(o) for o in ok) / wall) if slo and wall > 0 else None,
    }


def _admin(url: str, token: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    import httpx

    r = httpx.request(method, f"{url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {token}"})
    if r.status_code != 200:
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
    return r.json()


def wikitext_requests(n: int, *, short: tuple[int, int] = (16, 64), long: tuple[int, int] = (
        256, 512), long_share: float = 0.25, short_new: int = 16, long_new: int = 64,
        seed: int = 0, source: str | Path | None = None) -> list[BenchRequest]:
    """A fixed request set: prompts are WikiText-2 word spans (about 1.3 tokens a word)."""
    from gsm_jax.data import default_wikitext_path

    words = Path(source or default_wikitext_path()).read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        is_long = rng.random() < long_share
        lo, hi = long if is_long else short
        k = max(1, int(rng.randint(lo, hi) / 1.3))
        start = rng.randrange(0, max(1, len(words) - k))
        out.append(BenchRequest(" ".join(words[start:start + k]),
                                long_new if is_long else short_new, "long" if is_long else "short"))
    return out


def run_bench(url: str, requests: list[BenchRequest], *, model: str | None = None,
              clients: int | None = 16, rate: float | None = None, gsm_ab: bool = False,
              admin_token: str | None = None, slo_ms: dict[str, float] | None = None,
              seed: int = 0, timeout: float = 600.0, progress: bool = True) -> dict[str, Any]:
    """Run the load test; returns the JSON-ready result (see the module docstring)."""
    import httpx

    url = url.rstrip("/")
    if model is None:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    slo = {k: v / 1000.0 for k, v in (slo_ms or {}).items() if v is not None}
    gsm_before = None
    if gsm_ab:
        if not admin_token:
            raise ValueError("--gsm-ab sets the rollout fraction: it needs --admin-token")
        gsm_before = _admin(url, admin_token, "GET", "/admin/gsm")
        if gsm_before["config"] is None:
            raise ValueError("--gsm-ab: the server has no GSM config in force; PUT one first")
        _admin(url, admin_token, "POST", "/admin/gsm/rollout", {"fraction": 0.5})
    load_before = _load()
    t = time.perf_counter()
    try:
        outs = asyncio.run(_run(url, model, requests, clients=clients, rate=rate, seed=seed,
                                timeout=timeout, progress=progress))
    finally:
        if gsm_ab:
            _admin(url, admin_token, "POST", "/admin/gsm/rollback")
    wall = time.perf_counter() - t
    load_after = _load()
    groups = {"all": outs}
    for arm in sorted({o.arm for o in outs if o.arm}):
        groups[f"arm={arm}"] = [o for o in outs if o.arm == arm]
    for tag in sorted({o.tag for o in outs if o.tag}):
        groups[f"tag={tag}"] = [o for o in outs if o.tag == tag]
    return {
        "url": url, "model": model, "clients": clients, "rate": rate, "gsm_ab": gsm_ab,
        "gsm_before": gsm_before, "slo_s": slo, "wall_s": wall,
        "load_before": load_before, "load_after": load_after,
        "comparable": max(load_before, load_after) <= 1.5,
        "summary": {k: summarize(v, wall, slo) for k, v in groups.items()},
        "requests": [{**asdict(o), "tpot": None if math.isnan(o.tpot) else o.tpot}
                     for o in outs],
    }


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Percentile bars of TTFT, ITL, TPOT and e2e per arm (or for all requests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [k for k in result["summary"] if k.startswith("arm=")] or ["all"]
    metrics = ["ttft_s", "itl_s", "tpot_s", "e2e_s"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    width = 0.8 / len(groups)
    for ax, m in zip(axes, metrics, strict=True):
        for gi, g in enumerate(groups):
            s = result["summary"][g][m]
            vals = [(s[f"p{p}"] or 0) * 1000 for p in PERCENTILES]
            ax.bar(np.arange(len(PERCENTILES)) + gi * width, vals, width, label=g)
        ax.set_xticks(np.arange(len(PERCENTILES)) + width * (len(groups) - 1) / 2)
        ax.set_xticklabels([f"P{p}" for p in PERCENTILES])
        ax.set_title(m.replace("_s", "") + " (ms)")
    axes[0].legend()
    load = f"load {result['load_before']:.2f} -> {result['load_after']:.2f}"
    loop = f"{result['clients']} clients" if result["rate"] is None else f"{result['rate']} req/s"
    fig.suptitle(f"gsm-jax bench-serve: {result['model']}, {loop}, {load}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    lines = [f"{'group':14} {'done':>5} {'fail':>4} {'tok/s':>7}  "
             + "  ".join(f"{m + ' P50/P99 ms':>20}" for m in ("TTFT", "ITL", "TPOT", "e2e"))]
    for g, s in result["summary"].items():
        def ms(m: str, p: int, s: dict = s) -> str:
            v = s[m][f"p{p}"]
            return "-" if v is None else f"{v * 1000:.0f}"
        cols = "  ".join(f"{ms(m, 50) + '/' + ms(m, 99):>20}"
                         for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s"))
        tps = s["output_tok_per_s"] or 0.0
        lines.append(f"{g:14} {s['completed']:>5} {s['failed']:>4} {tps:>7.1f}  {cols}")
    return "\n".join(lines)


def http_gsm_on_off(model: str, gsm: Any, requests: list[BenchRequest], *, clients: int,
                    out: str | Path, max_len: int = 1024, progress: bool = False
                    ) -> dict[str, Any]:
    """The same requests through two real servers (`gsm-jax serve` subprocesses): GSM
    compiled out (`--no-gsm`) and GSM on (`--gsm <config file>`, every request in the
    "gsm" arm), each after an unmeasured warm-up pass. Returns {"off", "on"} results
    (without per-request rows) and writes them to `out`/serve_http.json."""
    from gsm_jax.config import GSMConfig
    from gsm_jax.serving.launch import ServerProcess

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = gsm if isinstance(gsm, GSMConfig) else GSMConfig.from_dict(gsm)
    cfg_path = out / "serve_gsm.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=1))
    prompt_buckets = ",".join(str(1 << k) for k in range(4, 10))
    base = ["--model", str(model), "--max-batch", str(clients), "--max-len", str(max_len),
            "--warmup-lengths", prompt_buckets, "--log-level", "warning"]
    results: dict[str, Any] = {}
    for arm, extra in (("off", ["--no-gsm"]), ("on", ["--gsm", str(cfg_path)])):
        with ServerProcess(base + extra, log_path=out / f"server_{arm}.log") as srv:
            run_bench(srv.url, requests, clients=clients, progress=False)  # warm-up pass
            r = run_bench(srv.url, requests, clients=clients, progress=progress)
            r.pop("requests", None)
            r["startup_s"] = srv.startup_s
            results[arm] = r
    (out / "serve_http.json").write_text(json.dumps(results, indent=1))
    return results


def on_off_table(results: dict[str, Any]) -> str:
    """Markdown: tokens/s and P50/P99 latencies, GSM off vs on, through HTTP."""
    head = ("| server | output tok/s | TTFT P50 / P99 ms | ITL P50 / P99 ms | "
            "e2e P50 / P99 ms | failed | load before / after |")
    lines = [head, "|" + "---|" * 7]
    for arm in ("off", "on"):
        r = results[arm]
        s = r["summary"]["all"]

        def ms(m: str, s: dict = s) -> str:
            a, b = s[m]["p50"], s[m]["p99"]
            return "-" if a is None else f"{a * 1000:.0f} / {b * 1000:.0f}"

        name = "GSM compiled out" if arm == "off" else "GSM on (every request)"
        lines.append(f"| {name} | {s['output_tok_per_s']:.1f} | {ms('ttft_s')} | "
                     f"{ms('itl_s')} | {ms('e2e_s')} | {s['failed']} | "
                     f"{r['load_before']:.2f} / {r['load_after']:.2f} |")
    if any(not results[arm]["comparable"] for arm in ("off", "on")):
        lines += ["", "A load average above 1.5 was seen around a run: the two rows are not "
                  "comparable (the serving benchmark `benchmarks/bench_serve.py --threads 1` "
                  "is the measurement to quote)."]
    return "\n".join(lines)


def pooled_summary(results: list[dict[str, Any]], slo: dict[str, float] | None = None
                   ) -> dict[str, Any]:
    """One summary over several runs of the same requests (their per-request rows pooled,
    their wall times summed): percentiles over every request of every run."""
    names = {f.name for f in Outcome.__dataclass_fields__.values()}
    outs = [Outcome(**{k: v for k, v in row.items() if k in names})
            for r in results for row in r["requests"]]
    for o in outs:
        o.ttft = math.nan if o.ttft is None else o.ttft
        o.e2e = math.nan if o.e2e is None else o.e2e
    return summarize(outs, sum(r["wall_s"] for r in results), slo or {})
