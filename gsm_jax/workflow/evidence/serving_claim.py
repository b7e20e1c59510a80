"""Verdicts on the source document's serving claims (issues 15, 25): claims 6, 7 and 14.

- Claim 6 (5.1: 高并发场景收益明显 ... 长序列场景收益明显;
  3.2: 平滑对尾延迟的改善往往比平均延迟更明显): GSM's gains grow with concurrency and
  with sequence length, and P99 improves more than the mean. Two real servers
  (`gsm-jax serve`, GSM compiled out vs GSM on every request), driven over HTTP by
  `gsm_jax.serving.bench_client` at each (clients, prompt length) cell.
- Claim 7 (4.4: 对短请求单独配置一套参数或者干脆对短请求关闭平滑): short requests should bypass
  smoothing. Quality: the KLD that GSM costs short requests against the unsmoothed model,
  and what the bypass leaves; latency: short requests through one server with GSM on and
  the bypass (`short_request_tokens`) switched on and off live (`PUT /admin/gsm`), or
  in-process with `gsm_jax.generate_tokens` (sizes["latency_route"]).
- Claim 14 (5.2: 和连续批处理配合：连续批处理下请求动态进出，平滑能让负载更均匀): under continuous
  batching, with requests coming and going, smoothing evens the load. The same two servers
  under Poisson arrivals of a short / long request mix (open loop): throughput, the spread
  of inter-token latency (P99 / P50, client side) and of the engine's decode-step time
  (coefficient of variation, from the server's `/admin/steps`), GSM on vs off.

Pinning (as `benchmarks/bench_serve.py --threads 1`): on a machine with >= 2 cores the
servers run on core 0 and the load client (this thread) on core 1, its affinity restored
after. "comparable" in each result is the load average rule (both ends <= 1.5).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.config import GSMConfig
from gsm_jax.params import ModelParams
from gsm_jax.workflow.evidence.lowp_claims import (
    SE_MULTIPLE,
    eval_tokens,
    figures_dir,
    gsm_config,
    load_avg,
    log_line,
)

__all__ = ["claim14_verdict", "claim6_verdict", "claim7_latency_half", "claim7_quality_half",
           "claim7_verdict", "load_spread", "run_claim_14", "run_claim_6", "run_claim_7",
           "welch"]

LENGTHS = {"short": (16, 64), "long": (256, 512)}
MARGIN = 0.02  # a ratio must move by more than 2% to count as rising / improving


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _client_core(pin: bool) -> Iterator[set[int] | None]:
    """Yield the cores for the server (None: unpinned) and keep this thread on the other
    core meanwhile (`sched_setaffinity(0)` is this thread only)."""
    if not pin or not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        yield None
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {1})
    try:
        yield {0}
    finally:
        os.sched_setaffinity(0, before)


# `--smoke`: the servers' sizes shrink too (the runner's EvidenceSizes has none of these
# keys), so a smoke run starts small servers and sends a few short requests; keys given
# explicitly win. Without this a smoke run of claim 6 warmed two servers up to 512-token
# prompts (minutes per server for a V4.1 on 2 cores) and sent 3 x 2 x 32 x 32 tokens.
SMOKE_6 = {"clients": (1, 2), "requests_per_cell": 2, "new_tokens": 4, "short": (8, 16),
           "long": (24, 32), "max_len": 128}
SMOKE_7 = {"short_range": (8, 16), "short_sequences": 4, "long_sequences": 2, "long_len": 64,
           "bypass_tokens": 32, "latency_clients": 2, "latency_requests": 4, "new_tokens": 4,
           "repeats": 1}


def claim_sizes(sizes: dict | None, smoke_defaults: dict) -> dict:
    """The claim's sizes: with ``smoke`` set, `smoke_defaults` under the keys given."""
    sizes = dict(sizes or {})
    return {**smoke_defaults, **sizes} if sizes.get("smoke") else sizes


def _out_dir(model_dir: Path | None, name: str) -> Path:
    if model_dir is None:
        return Path(tempfile.mkdtemp(prefix=f"gsm_{name}_"))
    d = Path(model_dir) / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def _server_base(model: str, *, max_batch: int, max_len: int, warm: Sequence[int],
                 mesh: Sequence[int] | None = None) -> list[str]:
    """The server's flags; `mesh` (data, model): the evidence run's --mesh, passed on."""
    mesh_flag = [] if not mesh else ["--mesh", "x".join(str(int(a)) for a in mesh)]
    return ["--model", str(model), "--max-batch", str(max_batch), "--max-len", str(max_len),
            "--prefill-chunk", "512", "--warmup-lengths", ",".join(str(w) for w in warm),
            "--log-level", "warning", *mesh_flag]


def _buckets(hi: int) -> list[int]:
    """Every prompt bucket (powers of two from 16) up to the one holding `hi` tokens."""
    out, b = [], 16
    while b < 2 * max(hi, 16) and b <= 512:
        out.append(b)
        b *= 2
    return out


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """mean(a) - mean(b), its (Welch) standard error and their ratio z."""
    a = np.asarray([x for x in a if x is not None and np.isfinite(x)], np.float64)
    b = np.asarray([x for x in b if x is not None and np.isfinite(x)], np.float64)
    if a.size < 2 or b.size < 2:
        return {"mean": float("nan"), "stderr": float("nan"), "z": float("nan"),
                "n_a": int(a.size), "n_b": int(b.size)}
    d = float(a.mean() - b.mean())
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    z = d / se if se > 0 else (math.inf if d > 0 else -math.inf if d < 0 else 0.0)
    return {"mean": d, "stderr": se, "z": z, "n_a": int(a.size), "n_b": int(b.size)}


def _cell_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput (mean over runs) and pooled latency statistics of one cell on one server."""
    from gsm_jax.serving import bench_client as bc

    s = bc.pooled_summary(runs)
    return {"output_tok_per_s": float(np.mean([r["summary"]["all"]["output_tok_per_s"] or 0.0
                                               for r in runs])),
            "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p99_s": s["ttft_s"]["p99"],
            "itl_mean_s": s["itl_s"]["mean"], "itl_p99_s": s["itl_s"]["p99"],
            "e2e_mean_s": s["e2e_s"]["mean"], "e2e_p99_s": s["e2e_s"]["p99"],
            "completed": s["completed"], "failed": s["failed"],
            "load_before": max(r["load_before"] for r in runs),
            "load_after": max(r["load_after"] for r in runs),
            "comparable": all(r["comparable"] for r in runs)}


def _ratio(on: float | None, off: float | None) -> float | None:
    return None if not on or not off else float(on / off)


# ----------------------------------------------------------------------------- claim 6

RATIO_KEYS = ("throughput", "ttft_mean", "ttft_p99", "itl_mean", "itl_p99")


def cell_ratios(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float | None]:
    """GSM on / off per metric: throughput above 1 and latencies below 1 favour GSM."""
    return {"throughput": _ratio(on["output_tok_per_s"], off["output_tok_per_s"]),
            **{k: _ratio(on[f"{k}_s"], off[f"{k}_s"]) for k in RATIO_KEYS[1:]}}


def claim6_verdict(cells: list[dict[str, Any]], margin: float = MARGIN
                   ) -> tuple[str, dict[str, Any]]:
    """cells: [{"clients", "length" ("short" | "long"), "ratios": `cell_ratios`, "failed"}].

    Supported only if all three hold: (1) for every length the throughput ratio at the
    most clients exceeds the one at the fewest by > margin; (2) for every client count the
    long-prompt ratio exceeds the short one by > margin; (3) in more than half of the
    (cell, TTFT / ITL) pairs the P99 ratio is below the mean ratio by > margin (P99
    improves more). Not testable with failed requests, a missing ratio or < 2 client
    counts / lengths."""
    by = {(c["clients"], c["length"]): c for c in cells}
    clients = sorted({c["clients"] for c in cells})
    lengths = [x for x in ("short", "long") if any(c["length"] == x for c in cells)]
    if len(clients) < 2 or len(lengths) < 2 or len(by) < len(clients) * len(lengths):
        return "not testable here", {"reason": "needs >= 2 client counts x both lengths"}
    if any(c.get("failed") for c in cells) or any(
            v is None for c in cells for v in c["ratios"].values()):
        return "not testable here", {"reason": "failed requests or a missing measurement"}
    tp = {k: c["ratios"]["throughput"] for k, c in by.items()}
    conc = {length: tp[(clients[-1], length)] - tp[(clients[0], length)] for length in lengths}
    leng = {c: tp[(c, "long")] - tp[(c, "short")] for c in clients}
    pairs = [(c["ratios"][f"{m}_p99"], c["ratios"][f"{m}_mean"])
             for c in cells for m in ("ttft", "itl")]
    p99_more = sum(p < mean - margin for p, mean in pairs)
    checks = {
        "rises_with_concurrency": all(v > margin for v in conc.values()),
        "throughput_ratio_change_with_concurrency": conc,
        "rises_with_length": all(v > margin for v in leng.values()),
        "throughput_ratio_change_with_length": {str(k): v for k, v in leng.items()},
        "p99_improves_more": p99_more > len(pairs) / 2,
        "p99_improves_more_pairs": f"{p99_more}/{len(pairs)}",
        "margin": margin,
    }
    ok = (checks["rises_with_concurrency"] and checks["rises_with_length"]
          and checks["p99_improves_more"])
    return ("supported" if ok else "refuted"), checks


def run_claim_6(params: ModelParams, *, sizes: dict, progress: bool,
                model_dir: Path | None) -> dict[str, Any]:
    """Claim 6. sizes: "model" (default params.source), "clients" ((1, 8, 32)),
    "requests_per_cell" (16), "new_tokens" (32, the same for both lengths so that only the
    prompt length differs), "repeats" (1), "short" ((16, 64)), "long" ((256, 512)),
    "max_len" (1024), "gsm", "pin" (True), "seed" (0)."""
    from gsm_jax.serving import bench_client as bc
    from gsm_jax.serving.launch import ServerProcess

    sizes = claim_sizes(sizes, SMOKE_6)
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 6)
    model = str(sizes.get("model") or params.source)
    clients = tuple(int(c) for c in sizes.get("clients", (1, 8, 32)))
    n = int(sizes.get("requests_per_cell", 16))
    new = int(sizes.get("new_tokens", 32))
    repeats = int(sizes.get("repeats", 1))
    lengths = {k: tuple(sizes.get(k, v)) for k, v in LENGTHS.items()}
    cfg = gsm_config(sizes)
    out = _out_dir(model_dir, "claim6")
    (out / "gsm.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    # a cell of c clients sends max(n, c) requests, so that c requests are in flight at once
    reqs = {name: bc.wikitext_requests(max(n, *clients), short=rng, long=rng, long_share=0.0,
                                       short_new=new,
                                       long_new=new, seed=int(sizes.get("seed", 0)) + i)
            for i, (name, rng) in enumerate(lengths.items())}
    base = _server_base(model, max_batch=max(clients),
                        max_len=int(sizes.get("max_len", 1024)),
                        warm=_buckets(max(hi for _, hi in lengths.values())),
                        mesh=sizes.get("mesh"))
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    servers: dict[str, ServerProcess] = {}
    error = None
    with _client_core(bool(sizes.get("pin", True))) as cores:
        try:
            for arm, extra in (("off", ["--no-gsm"]), ("on", ["--gsm", str(out / "gsm.json")])):
                servers[arm] = ServerProcess(base + extra, log_path=out / f"server_{arm}.log",
                                             cpus=cores).start()
                log(f"server GSM {arm} up in {servers[arm].startup_s:.0f} s")
            # unmeasured warm-up once both are up (the second server's compilation would
            # otherwise run between the first one's warm-up and its first cell)
            warm = [r for rs in reqs.values() for r in rs[:4]]
            for srv in servers.values():
                for c in clients:
                    bc.run_bench(srv.url, warm, clients=c, progress=False)
            k = 0
            for length in lengths:
                for c in clients:
                    for _ in range(repeats):
                        for arm in (("off", "on") if k % 2 == 0 else ("on", "off")):
                            r = bc.run_bench(servers[arm].url, reqs[length][:max(n, c)],
                                             clients=c, progress=False)
                            runs.setdefault((c, length, arm), []).append(r)
                        k += 1
                    last = {a: runs[(c, length, a)][-1]["summary"]["all"]["output_tok_per_s"]
                            for a in ("off", "on")}
                    log(f"{length} prompts, {c} clients: off {last['off']:.1f} / on "
                        f"{last['on']:.1f} tok/s")
        except (RuntimeError, OSError) as e:
            error = f"{type(e).__name__}: {e}"[:600]
        finally:
            for srv in servers.values():
                srv.stop()
    cells = []
    for length in lengths:
        for c in clients:
            if (c, length, "off") not in runs or (c, length, "on") not in runs:
                continue
            off = _cell_metrics(runs[(c, length, "off")])
            on = _cell_metrics(runs[(c, length, "on")])
            cells.append({"clients": c, "length": length, "off": off, "on": on,
                          "ratios": cell_ratios(off, on), "failed": off["failed"] + on["failed"],
                          "comparable": off["comparable"] and on["comparable"]})
    verdict, checks = claim6_verdict(cells)
    if error is not None:
        verdict, checks = "not testable here", {"reason": error}
    if verdict == "not testable here":
        why = f"Not measured: {checks['reason']}."
    else:
        def tp(c: int, length: str) -> float:
            return next(x["ratios"]["throughput"] for x in cells
                        if x["clients"] == c and x["length"] == length)

        why = ("GSM on / off output tok/s: " + "; ".join(
            f"{length} " + ", ".join(f"{c} clients {tp(c, length):.3f}" for c in clients)
            for length in lengths)
            + f"; rises with concurrency: {checks['rises_with_concurrency']}, with length: "
            f"{checks['rises_with_length']}; P99 improves more than the mean in "
            f"{checks['p99_improves_more_pairs']} (cell, TTFT/ITL) pairs.")
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None and cells:
        figures.append(str(_claim6_figure(cells, model, fig_dir / "claim6_serving_ratios.png")))
    return {
        "claim": 6, "model": params.source, "verdict": verdict, "why": why,
        "numbers": {"server_model": model, "clients": list(clients), "requests_per_cell": n,
                    "new_tokens": new, "repeats": repeats,
                    "prompt_tokens": {k: list(v) for k, v in lengths.items()},
                    "gsm": cfg.to_dict(), "cells": cells, "checks": checks,
                    "servers": {"off": "gsm-jax serve --no-gsm (GSM compiled out)",
                                "on": "gsm-jax serve --gsm <file> (every request smoothed)"},
                    "pinned": bool(sizes.get("pin", True)) and (os.cpu_count() or 1) >= 2,
                    "definitions": "ratios are GSM on / off: output tok/s (> 1: GSM faster; "
                                   "mean over repeats of output tokens / wall time), TTFT and "
                                   "ITL mean and P99 (< 1: GSM better; pooled over repeats, "
                                   "client-side SSE arrival times)",
                    "all_cells_comparable": all(c["comparable"] for c in cells)},
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _claim6_figure(cells: list[dict[str, Any]], model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{c['length']}\n{c['clients']} cl." for c in cells]
    x = np.arange(len(cells))
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(13, 4.2))
    a0.bar(x, [c["ratios"]["throughput"] or 0 for c in cells], color="#2ca02c")
    a0.set_title("output tok/s, GSM on / off (> 1: GSM faster)")
    width = 0.2
    for j, k in enumerate(RATIO_KEYS[1:]):
        a1.bar(x + (j - 1.5) * width, [c["ratios"][k] or 0 for c in cells], width,
               label=k.replace("_", " ").replace("p99", "P99"))
    a1.set_title("latency, GSM on / off (< 1: GSM better): mean vs P99")
    a1.legend(fontsize=8)
    for ax in (a0, a1):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x)
        ax.set_xticklabels(names, fontsize=8)
    fig.suptitle(f"Claim 6: GSM gains per (prompt length, concurrency), {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- claim 7

RESTORED = 1e-6  # the bypass must give the unsmoothed logits: KLD at most this


def claim7_quality_half(gsm_kld: Sequence[float], bypass_max_kld: float) -> str:
    """Supported if GSM's mean KLD on short requests is above 0 by > SE_MULTIPLE standard
    errors (over sequences) while the bypass restores the unsmoothed output; in float GSM
    can only cost quality against the unsmoothed model, so any measurable cost is a cost
    the bypass saves. Not testable if the bypass does not restore the output."""
    if not bypass_max_kld <= RESTORED:
        return "not testable here"
    x = np.asarray(gsm_kld, np.float64)
    se = x.std(ddof=1) / math.sqrt(x.size) if x.size > 1 else float("nan")
    return "supported" if x.mean() > SE_MULTIPLE * se and x.mean() > 0 else "refuted"


def claim7_latency_half(gsm_latency: Sequence[float], bypass_latency: Sequence[float]
                        ) -> tuple[str, dict[str, float]]:
    """Supported if short requests' mean latency with GSM exceeds the bypassed one by
    > SE_MULTIPLE (Welch) standard errors."""
    d = welch(gsm_latency, bypass_latency)
    if not np.isfinite(d["mean"]):
        return "not testable here", d
    return ("supported" if d["z"] > SE_MULTIPLE else "refuted"), d


def claim7_verdict(quality: str, latency: str) -> str:
    """The bypass has no downside in either dimension (it restores the unsmoothed model and
    runs the same program), so the claim is supported if either half shows a measurable
    benefit, refuted if a half was measured and none shows one."""
    halves = (quality, latency)
    if "supported" in halves:
        return "supported"
    return "refuted" if "refuted" in halves else "not testable here"


def _short_rows(params: ModelParams, sizes: dict) -> tuple[list[np.ndarray], str]:
    lo, hi = (int(v) for v in sizes.get("short_range", (16, 32)))
    n = int(sizes.get("short_sequences", 32))
    tokens, data = eval_tokens(params, sizes, n=n, seq_len=hi, from_end=True)
    rng = np.random.default_rng(int(sizes.get("seed", 0)))
    lens = rng.integers(lo, hi + 1, len(tokens))
    return [tokens[i, :k] for i, k in enumerate(lens)], f"{data}, cut to {lo}-{hi} tokens"


def _kld_rows(params: ModelParams, rows: list[np.ndarray], gsm: Any, batch: int
              ) -> list[np.ndarray]:
    """Per row: KLD(unsmoothed || gsm) per real position, float64 (`metrics.kl_divergence`)."""
    from gsm_jax.generation import forward
    from gsm_jax.workflow import metrics

    out = []
    for i in range(0, len(rows), batch):
        chunk = rows[i: i + batch]
        base = np.asarray(forward(params, chunk, gsm=None))
        other = np.asarray(forward(params, chunk, gsm=gsm))
        for j, r in enumerate(chunk):
            out.append(metrics.kl_divergence(base[j, : r.size], other[j, : r.size]))
    return out


def _latency_server(model: str, cfg: GSMConfig, bypass_tokens: int, sizes: dict,
                    out: Path, log: Any) -> dict[str, Any]:
    """Short requests through one server with GSM on; the bypass switched live."""
    import httpx

    from gsm_jax.serving import bench_client as bc
    from gsm_jax.serving.launch import ServerProcess

    lo, hi = (int(v) for v in sizes.get("short_range", (16, 32)))
    new = int(sizes.get("new_tokens", 16))
    clients = int(sizes.get("latency_clients", 4))
    repeats = int(sizes.get("repeats", 3))
    reqs = bc.wikitext_requests(int(sizes.get("latency_requests", 16)), short=(lo, hi),
                                long_share=0.0, short_new=new, seed=int(sizes.get("seed", 0)))
    arms = {"gsm": cfg.replace(short_request_tokens=0),
            "bypass": cfg.replace(short_request_tokens=bypass_tokens)}
    (out / "gsm.json").write_text(json.dumps(arms["gsm"].to_dict(), indent=1))
    token = secrets.token_hex(8)
    args = _server_base(model, max_batch=clients, max_len=max(256, bypass_tokens + 64),
                        warm=_buckets(hi), mesh=sizes.get("mesh")) + [
        "--gsm", str(out / "gsm.json")]
    e2e: dict[str, list[float]] = {a: [] for a in arms}
    ttft: dict[str, list[float]] = {a: [] for a in arms}
    seen: dict[str, dict[str, int]] = {a: {} for a in arms}
    loads = []
    with _client_core(bool(sizes.get("pin", True))) as cores, \
            ServerProcess(args, log_path=out / "server.log", admin_token=token,
                          cpus=cores) as srv:
        log(f"server up in {srv.startup_s:.0f} s")

        def put(arm: str) -> None:
            r = httpx.put(f"{srv.url}/admin/gsm", json=arms[arm].to_dict(), timeout=60,
                          headers=srv.admin_headers)
            r.raise_for_status()

        for arm in arms:  # unmeasured warm-up of each arm
            put(arm)
            bc.run_bench(srv.url, reqs, clients=clients, progress=False)
        for rep in range(repeats):
            for arm in (("gsm", "bypass") if rep % 2 == 0 else ("bypass", "gsm")):
                put(arm)
                r = bc.run_bench(srv.url, reqs, clients=clients, progress=False)
                loads += [r["load_before"], r["load_after"]]
                for row in r["requests"]:
                    seen[arm][row["arm"]] = seen[arm].get(row["arm"], 0) + 1
                    if row["ok"]:
                        e2e[arm].append(row["e2e"])
                        ttft[arm].append(row["ttft"])
                log(f"repeat {rep + 1}/{repeats} {arm}: mean e2e "
                    f"{np.mean(e2e[arm][-len(reqs):]) * 1000:.0f} ms")
    return {"route": "server", "clients": clients, "requests": len(reqs), "repeats": repeats,
            "new_tokens": new, "e2e_s": e2e, "ttft_s": ttft, "arms_seen": seen,
            "max_load": max(loads) if loads else None}


def _latency_in_process(params: ModelParams, rows: list[np.ndarray], cfg: GSMConfig,
                        bypass_tokens: int, sizes: dict, log: Any) -> dict[str, Any]:
    """Each short prompt alone through `gsm_jax.generate_tokens` (EOS ignored), per arm."""
    from gsm_jax.generation import generate_tokens

    new = int(sizes.get("new_tokens", 16))
    repeats = int(sizes.get("repeats", 3))
    rows = rows[: int(sizes.get("latency_requests", 16))]
    arms = {"gsm": cfg.replace(short_request_tokens=0),
            "bypass": cfg.replace(short_request_tokens=bypass_tokens), "compiled_out": None}
    times: dict[str, list[float]] = {a: [] for a in arms}

    def one(arm: str, r: np.ndarray) -> float:
        t = time.perf_counter()
        generate_tokens(params, [r], max_new_tokens=new, gsm=arms[arm], eos_ids=[])
        return time.perf_counter() - t

    for arm in arms:  # compile every prompt bucket of every arm first
        for r in rows:
            one(arm, r)
    for rep in range(repeats):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
        for arm in order:
            times[arm] += [one(arm, r) for r in rows]
        log(f"repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{a} {np.mean(times[a]) * 1000:.1f} ms" for a in arms))
    return {"route": "in_process", "requests": len(rows), "repeats": repeats,
            "new_tokens": new, "e2e_s": times}


def run_claim_7(params: ModelParams, *, sizes: dict, progress: bool,
                model_dir: Path | None) -> dict[str, Any]:
    """Claim 7. sizes: "short_sequences" (32), "short_range" ((16, 32)), "long_sequences"
    (4) x "long_len" (256) for the per-token context, "bypass_tokens" (128), "gsm",
    "batch_size" (8), "latency_route" ("server" | "in_process" | "skip"), "model",
    "latency_clients" (4), "latency_requests" (16), "new_tokens" (16), "repeats" (3)."""
    sizes = claim_sizes(sizes, SMOKE_7)
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 7)
    cfg = gsm_config(sizes).replace(short_request_tokens=0)
    lo, hi = (int(v) for v in sizes.get("short_range", (16, 32)))
    bypass_tokens = int(sizes.get("bypass_tokens", 128))
    if bypass_tokens <= hi + int(sizes.get("new_tokens", 16)):
        raise ValueError(f"bypass_tokens={bypass_tokens} must exceed the longest short request")
    bypass = cfg.replace(short_request_tokens=bypass_tokens)
    batch = int(sizes.get("batch_size", 8))

    # quality half
    rows, data = _short_rows(params, sizes)
    log(f"quality: {len(rows)} short rows ({data})")
    k_gsm = _kld_rows(params, rows, cfg, batch)
    k_byp = _kld_rows(params, rows, bypass, batch)
    per_seq = np.asarray([k.mean() for k in k_gsm])
    tok_gsm = np.concatenate(k_gsm)
    byp_max = float(max(np.abs(k).max() for k in k_byp))
    long_t, long_data = eval_tokens(params, sizes, n=int(sizes.get("long_sequences", 4)),
                                    seq_len=int(sizes.get("long_len", 256)), from_end=False)
    k_long = np.stack(_kld_rows(params, list(long_t), cfg, max(1, batch // 4)))
    quality = claim7_quality_half(per_seq, byp_max)
    q_nums = {"data": data, "rows": len(rows), "gsm_mean_kld": float(tok_gsm.mean()),
              "gsm_mean_kld_stderr_over_sequences":
                  float(per_seq.std(ddof=1) / math.sqrt(per_seq.size)) if per_seq.size > 1
                  else None,
              "gsm_p99_kld": float(np.percentile(tok_gsm, 99)),
              "bypass_max_kld": byp_max,
              "long_context": {"data": long_data,
                               "gsm_mean_kld_all_positions": float(k_long.mean()),
                               f"gsm_mean_kld_first_{hi}_positions":
                                   float(k_long[:, :hi].mean())},
              "verdict": quality}
    log(f"quality: GSM mean KLD {tok_gsm.mean():.3g} on short rows, bypass max {byp_max:.2g}")

    # latency half
    route = str(sizes.get("latency_route", "server"))
    lat: dict[str, Any] = {"route": route}
    latency = "not testable here"
    if route == "server":
        try:
            lat = _latency_server(str(sizes.get("model") or params.source), cfg, bypass_tokens,
                                  sizes, _out_dir(model_dir, "claim7"), log)
        except (RuntimeError, OSError) as e:
            lat["error"] = f"{type(e).__name__}: {e}"[:600]
    elif route == "in_process":
        lat = _latency_in_process(params, rows, cfg, bypass_tokens, sizes, log)
    mixed = {a: seen for a, seen in lat.get("arms_seen", {}).items() if set(seen) != {a}}
    if mixed:  # the server put requests in another arm than the one measured
        lat["error"] = f"requests landed in other arms than intended: {mixed}"
        lat.pop("e2e_s", None)
    if "e2e_s" in lat:
        latency, diff = claim7_latency_half(lat["e2e_s"]["gsm"], lat["e2e_s"]["bypass"])
        lat["gsm_minus_bypass_e2e"] = diff
        lat["mean_e2e_ms"] = {a: float(np.mean(v)) * 1000 if v else None
                              for a, v in lat["e2e_s"].items()}
        if "ttft_s" in lat:
            lat["gsm_minus_bypass_ttft"] = welch(lat["ttft_s"]["gsm"], lat["ttft_s"]["bypass"])
    lat["verdict"] = latency
    verdict = claim7_verdict(quality, latency)

    why = (f"Short {lo}-{hi}-token requests: GSM costs mean KLD {tok_gsm.mean():.3g} "
           f"± {q_nums['gsm_mean_kld_stderr_over_sequences'] or float('nan'):.2g} vs "
           f"unsmoothed ({k_long.shape[1]}-token rows: {k_long.mean():.3g} per token), the bypass "
           f"leaves "
           f"{byp_max:.2g} (quality half {quality})")
    if "gsm_minus_bypass_e2e" in lat:
        d = lat["gsm_minus_bypass_e2e"]
        why += (f"; latency ({lat['route']}): mean e2e GSM {lat['mean_e2e_ms']['gsm']:.1f} ms "
                f"vs bypass {lat['mean_e2e_ms']['bypass']:.1f} ms (Δ {d['mean'] * 1000:+.2f} "
                f"± {d['stderr'] * 1000:.2f} ms; latency half {latency})")
    else:
        why += f"; latency not measured ({lat.get('error', route)})"
    why += "."
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None:
        figures.append(str(_claim7_figure(q_nums, lat, params.source,
                                          fig_dir / "claim7_short_bypass.png")))
    for key in ("e2e_s", "ttft_s"):  # the raw samples stay in the figure, not the JSON
        lat.pop(key, None)
    return {
        "claim": 7, "model": params.source, "verdict": verdict, "why": why,
        "numbers": {"gsm": cfg.to_dict(), "bypass_tokens": bypass_tokens, "quality": q_nums,
                    "latency": lat,
                    "note": "A bypassed request runs the same compiled program with its row's "
                            "strength zeroed (engine `row_enabled`): the bypass cannot remove "
                            "the filter's work, only its effect."},
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _claim7_figure(q: dict[str, Any], lat: dict[str, Any], model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4))
    se = q["gsm_mean_kld_stderr_over_sequences"] or 0.0
    a0.bar([0, 1], [q["gsm_mean_kld"], q["bypass_max_kld"]], yerr=[se, 0], capsize=4,
           color=["#1f77b4", "#999999"])
    a0.set_xticks([0, 1])
    a0.set_xticklabels(["GSM", "bypass (max)"])
    a0.set_title("short requests: KLD vs unsmoothed")
    if "e2e_s" in lat:
        arms = list(lat["e2e_s"])
        means = [np.mean(lat["e2e_s"][a]) * 1000 for a in arms]
        errs = [np.std(lat["e2e_s"][a], ddof=1) / math.sqrt(len(lat["e2e_s"][a])) * 1000
                if len(lat["e2e_s"][a]) > 1 else 0 for a in arms]
        a1.bar(range(len(arms)), means, yerr=errs, capsize=4)
        a1.set_xticks(range(len(arms)))
        a1.set_xticklabels(arms)
        a1.set_title(f"short-request e2e latency, ms ({lat['route']})")
    else:
        a1.text(0.5, 0.5, "latency not measured", ha="center", transform=a1.transAxes)
    fig.suptitle(f"Claim 7: short-request bypass, {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- claim 14

SMOKE_14 = {"requests": 6, "rate": 4.0, "repeats": 1, "short": (8, 16), "long": (24, 32),
            "short_new": 4, "long_new": 8, "max_len": 128, "max_batch": 4, "bootstrap": 50}
RATE_SHARE = 0.7  # rate "auto": this share of the request rate a closed-loop probe reached


def load_spread(itl: Sequence[float], steps: Sequence[float], *, resamples: int = 200,
                seed: int = 0) -> dict[str, Any]:
    """How even the load was: inter-token latency P99 / P50 and decode-step time
    coefficient of variation (std / mean), each with a bootstrap standard error
    (`resamples` draws with replacement, fixed seed)."""
    itl_a = np.asarray([x for x in itl if x is not None and np.isfinite(x)], np.float64)
    st_a = np.asarray([x for x in steps if x is not None and np.isfinite(x)], np.float64)
    rng = np.random.default_rng(seed)

    def ratio(x: np.ndarray) -> float:
        p50 = np.percentile(x, 50)
        return float(np.percentile(x, 99) / p50) if p50 > 0 else math.nan

    def cv(x: np.ndarray) -> float:
        return float(x.std(ddof=1) / x.mean()) if x.size > 1 and x.mean() > 0 else math.nan

    def boot(x: np.ndarray, f) -> float:
        if x.size < 3:
            return math.nan
        return float(np.std([f(rng.choice(x, x.size)) for _ in range(resamples)], ddof=1))

    return {"itl_p99_over_p50": ratio(itl_a) if itl_a.size else math.nan,
            "itl_p99_over_p50_se": boot(itl_a, ratio), "itl_n": int(itl_a.size),
            "step_cv": cv(st_a), "step_cv_se": boot(st_a, cv), "steps_n": int(st_a.size),
            "step_mean_s": float(st_a.mean()) if st_a.size else math.nan,
            "step_p99_over_p50": ratio(st_a) if st_a.size else math.nan}


def claim14_verdict(off: dict[str, Any], on: dict[str, Any], margin: float = MARGIN
                    ) -> tuple[str, dict[str, Any]]:
    """off / on: `load_spread` plus "failed". Supported when GSM on lowers both spreads (ITL
    P99 / P50 and decode-step CV) by more than `margin` relative and beyond SE_MULTIPLE
    bootstrap standard errors of the difference; refuted otherwise; not testable with
    failed requests or a spread that could not be measured."""
    if off.get("failed") or on.get("failed"):
        return "not testable here", {"reason": "failed requests"}
    checks: dict[str, Any] = {"margin": margin}
    ok = True
    for key in ("itl_p99_over_p50", "step_cv"):
        a, b = off[key], on[key]
        se = math.hypot(off[f"{key}_se"], on[f"{key}_se"])
        if not (np.isfinite(a) and np.isfinite(b) and a > 0):
            return "not testable here", {"reason": f"{key} not measured (too few samples)"}
        z = (a - b) / se if se > 0 else (math.inf if a > b else -math.inf if a < b else 0.0)
        evener = bool(b < a * (1 - margin) and z > SE_MULTIPLE)
        checks[key] = {"off": a, "on": b, "ratio_on_off": b / a, "z_off_minus_on": z,
                       "evener_with_gsm": evener}
        ok = ok and evener
    return ("supported" if ok else "refuted"), checks


def _decode_steps(url: str, token: str) -> list[float]:
    import httpx

    r = httpx.get(f"{url}/admin/steps", headers={"Authorization": f"Bearer {token}"},
                  timeout=60)
    r.raise_for_status()
    return [float(t) for kind, _, t in r.json()["steps"] if kind == "decode"]


def _clear_steps(url: str, token: str) -> None:
    import httpx

    httpx.delete(f"{url}/admin/steps", headers={"Authorization": f"Bearer {token}"},
                 timeout=60).raise_for_status()


def run_claim_14(params: ModelParams, *, sizes: dict, progress: bool,
                 model_dir: Path | None) -> dict[str, Any]:
    """Claim 14. sizes: "model" (default params.source), "requests" (48 per run), "rate"
    (requests/s, or "auto": `RATE_SHARE` of what a closed loop of max_batch clients reached
    on the GSM-off server), "repeats" (2, arms alternating), "short" ((16, 64)) / "long"
    ((256, 512)) prompt tokens, "long_share" (0.25), "short_new" (16) / "long_new" (64)
    tokens, "max_batch" (8), "max_len" (1024), "gsm", "pin" (True), "seed" (0),
    "bootstrap" (200)."""
    from gsm_jax.serving import bench_client as bc
    from gsm_jax.serving.launch import ServerProcess

    sizes = claim_sizes(sizes, SMOKE_14)
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 14)
    model = str(sizes.get("model") or params.source)
    n = int(sizes.get("requests", 48))
    repeats = int(sizes.get("repeats", 2))
    max_batch = int(sizes.get("max_batch", 8))
    short, long = tuple(sizes.get("short", (16, 64))), tuple(sizes.get("long", (256, 512)))
    cfg = gsm_config(sizes)
    out = _out_dir(model_dir, "claim14")
    (out / "gsm.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    reqs = bc.wikitext_requests(n, short=short, long=long,
                                long_share=float(sizes.get("long_share", 0.25)),
                                short_new=int(sizes.get("short_new", 16)),
                                long_new=int(sizes.get("long_new", 64)),
                                seed=int(sizes.get("seed", 0)))
    token = secrets.token_hex(8)
    base = _server_base(model, max_batch=max_batch, max_len=int(sizes.get("max_len", 1024)),
                        warm=_buckets(long[1]), mesh=sizes.get("mesh"))
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    steps: dict[str, list[float]] = {"off": [], "on": []}
    servers: dict[str, ServerProcess] = {}
    rate = sizes.get("rate", "auto")
    probe = None
    error = None
    with _client_core(bool(sizes.get("pin", True))) as cores:
        try:
            for arm, extra in (("off", ["--no-gsm"]), ("on", ["--gsm", str(out / "gsm.json")])):
                servers[arm] = ServerProcess(base + extra, log_path=out / f"server_{arm}.log",
                                             admin_token=token, cpus=cores).start()
                log(f"server GSM {arm} up in {servers[arm].startup_s:.0f} s")
            for srv in servers.values():  # unmeasured warm-up
                bc.run_bench(srv.url, reqs[:4], clients=min(4, max_batch), progress=False)
            if rate in (None, "auto"):
                probe = bc.run_bench(servers["off"].url, reqs, clients=max_batch,
                                     progress=False)
                rate = RATE_SHARE * probe["summary"]["all"]["request_per_s"]
                log(f"closed loop of {max_batch} clients: {rate / RATE_SHARE:.2f} req/s; "
                    f"Poisson rate {rate:.2f} req/s")
            rate = float(rate)
            for k in range(repeats):
                for arm in (("off", "on") if k % 2 == 0 else ("on", "off")):
                    srv = servers[arm]
                    _clear_steps(srv.url, token)
                    r = bc.run_bench(srv.url, reqs, clients=None, rate=rate, seed=k,
                                     progress=False)
                    runs[arm].append(r)
                    steps[arm] += _decode_steps(srv.url, token)
                    log(f"run {k + 1}/{repeats} GSM {arm}: "
                        f"{r['summary']['all']['output_tok_per_s']:.1f} tok/s")
        except (RuntimeError, OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"[:600]
        finally:
            for srv in servers.values():
                srv.stop()
    arms: dict[str, dict[str, Any]] = {}
    for arm in ("off", "on"):
        if not runs[arm]:
            continue
        pooled = bc.pooled_summary(runs[arm])
        itl = [x for r in runs[arm] for row in r["requests"] if row["ok"] for x in row["itl"]]
        arms[arm] = {
            **load_spread(itl, steps[arm], resamples=int(sizes.get("bootstrap", 200))),
            "output_tok_per_s": float(np.mean([r["summary"]["all"]["output_tok_per_s"] or 0.0
                                               for r in runs[arm]])),
            "output_tok_per_s_runs": [r["summary"]["all"]["output_tok_per_s"]
                                      for r in runs[arm]],
            "itl_s": pooled["itl_s"], "ttft_s": pooled["ttft_s"],
            "completed": pooled["completed"], "failed": pooled["failed"],
            "comparable": all(r["comparable"] for r in runs[arm])}
    if error is not None or len(arms) < 2:
        verdict, checks = "not testable here", {"reason": error or "a server did not run"}
    else:
        verdict, checks = claim14_verdict(arms["off"], arms["on"])
    if verdict == "not testable here":
        why = f"Not measured: {checks['reason']}."
    else:
        tp = arms["on"]["output_tok_per_s"] / arms["off"]["output_tok_per_s"]
        itl_off, itl_on = (arms[a]["itl_p99_over_p50"] for a in ("off", "on"))
        why = (f"Poisson arrivals at {rate:.2f} req/s, GSM on / off: throughput {tp:.3f}x; "
               f"ITL P99/P50 {itl_off:.2f} -> {itl_on:.2f} "
               f"(z {checks['itl_p99_over_p50']['z_off_minus_on']:+.1f}); "
               f"decode-step CV {arms['off']['step_cv']:.3f} -> {arms['on']['step_cv']:.3f} "
               f"(z {checks['step_cv']['z_off_minus_on']:+.1f}); "
               + ("both spreads lower with GSM." if verdict == "supported" else
                  "the load is not evener with GSM beyond the noise."))
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None and len(arms) == 2:
        figures.append(str(_claim14_figure(arms, runs, steps, model,
                                           fig_dir / "claim14_continuous_batching.png")))
    return {
        "claim": 14, "model": params.source, "verdict": verdict, "why": why,
        "measurement": (None if verdict == "not testable here" else
                        f"ITL P99/P50 x{itl_on / itl_off:.3f}, step CV "
                        f"x{arms['on']['step_cv'] / arms['off']['step_cv']:.3f}"),
        "numbers": {"server_model": model, "requests_per_run": n, "repeats": repeats,
                    "rate_req_per_s": None if not isinstance(rate, float) else rate,
                    "rate_rule": (f"{RATE_SHARE} x the closed-loop request rate"
                                  if probe is not None else "given"),
                    "prompt_tokens": {"short": list(short), "long": list(long)},
                    "max_batch": max_batch, "gsm": cfg.to_dict(), "arms": arms,
                    "checks": checks,
                    "definitions": "ITL: client-side gaps between SSE chunks, pooled over "
                                   "runs; step CV: std / mean of the engine's decode-step "
                                   "times (server's /admin/steps); SE: bootstrap"},
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _claim14_figure(arms: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
                    steps: dict[str, list[float]], model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm in ("off", "on"):
        itl = np.sort([x * 1000 for r in runs[arm] for row in r["requests"] if row["ok"]
                       for x in row["itl"]])
        if itl.size:
            a0.plot(itl, np.linspace(0, 1, itl.size), label=f"GSM {arm} "
                    f"(P99/P50 {arms[arm]['itl_p99_over_p50']:.2f})")
        st = np.sort(np.asarray(steps[arm]) * 1000)
        if st.size:
            a1.plot(st, np.linspace(0, 1, st.size), label=f"GSM {arm} "
                    f"(CV {arms[arm]['step_cv']:.3f})")
    a0.set_xlabel("inter-token latency, ms (client)")
    a1.set_xlabel("decode step, ms (engine)")
    for ax in (a0, a1):
        ax.set_ylabel("fraction")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"Claim 14 on {model}: continuous batching under Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
