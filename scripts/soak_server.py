"""Soak test of `gsm-jax serve`: bounded Poisson load over loopback, with client disconnects,
live GSM changes and shared prefixes; every answer checked against the model run alone.

    python scripts/soak_server.py --minutes 10 --out runs/soak            # its own server
                                                         # (SERVER_ARGS: chunks of 32)
    python scripts/soak_server.py --url http://127.0.0.1:8000 --admin-token T --pid 4242 \\
        --minutes 1 --out runs/soak_short                                 # a running one

Phases (all traffic goes to the server's loopback URL; every loop is bounded in count and
time and stops by itself):

1. **capacity**: a closed loop of `max_batch` clients (the server's slots, from
   `/admin/stats`) for `--capacity-s` seconds: completed requests per second (unless
   `--rate` gives the arrival rate outright);
2. **warm-up**: `--warmup-s` seconds of the soak's own mix at its rate, not checked (every
   program compiled, the prefix cache filled), then the server's RSS is the baseline;
3. **soak**: Poisson arrivals at `--load` (0.8) x capacity for `--minutes`. Each request
   is greedy with `--max-tokens` (8) new tokens, its prompt drawn from a fixed pool: a
   `--prefix-share` (0.3) of them are one of three long shared prefixes (WikiText-2, about
   60 tokens: past `--prefill-chunk` boundaries) plus a short tail of their own, the rest
   plain WikiText-2 spans; a `--disconnect-share` (0.1) are streamed and dropped by the
   client after their first chunk (they ask for 64 tokens, so they are still running then:
   the server must abort them and free the slot). Every
   `--admin-every` (30) seconds the admin API moves the GSM config on, in a cycle: PUT
   config A (strength 0.3, window 8), rollout 0.5, rollback, PUT config B (strength 0.2,
   window 6), rollout 0.5, rollback.

Checks (`result["checks"]`, all must hold; `result["ok"]`):

- no unexpected error: every request not dropped on purpose got HTTP 200 and a whole
  answer (a 503 counts as an error: at 80% of capacity the queue must not fill);
- every completed answer equals its prompt's output run alone at its GSM version: the
  response names its version and arm; the arm "gsm" is that version's config (recorded
  from the admin answers), every other arm unsmoothed; the references are
  `gsm_jax.generate` in this process, one batched call per config (a row's output is its
  output alone: tests/test_gsm_model.py::test_batch_invariance);
- the server's RSS grew by at most `--rss-growth` (5%) from the end of the warm-up to the
  end, net of the prefix cache's own bytes (a store bounded by `--prefix-cache-gb`, which
  the server reports; the raw growth is reported too);
- at the end every slot and queue entry is free (`/admin/stats`: nothing running or
  waiting, KV usage 0); the prefix cache holds no references (its states are copies,
  each evictable at any time), its bytes are reported;
- the disconnected requests were aborted (their `finished_reason="abort"` count grew);
- nothing compiled during the soak (`gsm_jax_compilations_after_ready_total` on /metrics
  did not move: issue 42).

Outputs in `--out`: results.json (every request's record too) and results.png (arrivals
and latencies over time, admin changes marked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

CONFIG_A = {"target_layers": "all", "smooth_strength": 0.3, "window_size": 8}
CONFIG_B = {"target_layers": "all", "smooth_strength": 0.2, "window_size": 6}
ADMIN_CYCLE = (("put", CONFIG_A), ("rollout", 0.5), ("rollback", None),
               ("put", CONFIG_B), ("rollout", 0.5), ("rollback", None))
TOKEN = "soak-admin-token"
DROP_TOKENS = 64  # a dropped stream asks for this many: still running when its client leaves
# the started server's own flags: chunks of 32, so the pool's ~65-token shared prefixes
# cross two chunk boundaries (at the default 512 no prompt of the pool would)
SERVER_ARGS = ("--gsm-ring", "8", "--prefill-chunk", "32", "--max-len", "512")


# ----------------------------------------------------------------------------- prompts

def prompt_pool(n_plain: int = 12, n_tails: int = 4, seed: int = 0) -> dict[str, list[str]]:
    """{"prefix": 3 shared prefixes x n_tails tails, "plain": n_plain spans} of WikiText-2
    (the packaged copy): a fixed pool, so the references are few."""
    from gsm_jax.workflow.data import default_wikitext_path

    words = Path(default_wikitext_path()).read_text(encoding="utf-8").split()
    rng = random.Random(seed)

    def span(k: int) -> str:
        start = rng.randrange(0, len(words) - k)
        return " ".join(words[start:start + k])

    prefixes = [span(45) for _ in range(3)]
    return {"prefix": [f"{p} {span(6)}" for p in prefixes for _ in range(n_tails)],
            "plain": [span(rng.randint(8, 20)) for _ in range(n_plain)]}


def _rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ----------------------------------------------------------------------------- traffic

async def _request(client: Any, model: str, prompt: str, max_tokens: int, *, drop: bool,
                   rid: str, t0: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"rid": rid, "prompt": prompt, "drop": drop,
                           "sent": time.perf_counter() - t0, "status": None, "error": None}
    body = {"model": model, "prompt": prompt, "temperature": 0, "stream": drop,
            "max_tokens": DROP_TOKENS if drop else max_tokens}
    start = time.perf_counter()
    try:
        if drop:  # streamed; the client goes away after the first chunk
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"x-request-id": rid}) as r:
                rec["status"] = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            rec["dropped_after_s"] = time.perf_counter() - start
            return rec
        r = await client.post("/v1/completions", json=body, headers={"x-request-id": rid})
        rec["status"] = r.status_code
        rec["e2e_s"] = time.perf_counter() - start
        if r.status_code != 200:
            rec["error"] = r.text[:300]
            return rec
        data = r.json()
        rec["text"] = data["choices"][0]["text"]
        rec["version"], rec["arm"] = data["gsm"]["version"], data["gsm"]["arm"]
    except Exception as e:  # a transport error is an error, counted
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def _pick(rng: random.Random, pool: dict[str, list[str]], prefix_share: float) -> str:
    return rng.choice(pool["prefix"] if rng.random() < prefix_share else pool["plain"])


async def _closed_loop(url: str, model: str, pool, clients: int, seconds: float,
                       max_tokens: int, prefix_share: float, seed: int) -> float:
    import httpx

    rng = random.Random(seed)
    done = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        t0 = time.perf_counter()

        async def worker(w: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < end:
                rec = await _request(client, model, _pick(rng, pool, prefix_share),
                                     max_tokens, drop=False, rid=f"cap-{w}-{i}", t0=t0)
                i += 1
                if rec["status"] == 200 and rec["error"] is None:
                    done += 1

        await asyncio.gather(*(worker(w) for w in range(clients)))
        wall = time.perf_counter() - t0
    return done / wall


async def _poisson(url: str, model: str, pool, *, rate: float, seconds: float, max_tokens: int,
                   prefix_share: float, disconnect_share: float, seed: int, tag: str,
                   admin: Any = None, progress: bool = False) -> list[dict[str, Any]]:
    """Poisson arrivals for `seconds` (then waits for what is in flight, 300 s at most)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        at, i = 0.0, 0
        next_admin = admin.every if admin is not None else float("inf")
        last_report = 0.0
        while at < seconds:
            now = time.perf_counter() - t0
            if now >= next_admin:
                await admin.step(client, now)
                next_admin += admin.every
                continue
            if now < at:
                await asyncio.sleep(min(at - now, max(0.0, next_admin - now)))
                continue
            drop = rng.random() < disconnect_share
            tasks.append(asyncio.create_task(_request(
                client, model, _pick(rng, pool, prefix_share), max_tokens, drop=drop,
                rid=f"{tag}-{i}", t0=t0)))
            i += 1
            at += rng.expovariate(rate)
            if progress and now - last_report >= 10:
                last_report = now
                print(f"[soak] {tag}: {now:.0f}/{seconds:.0f} s, {i} sent", flush=True)
        done, pending = await asyncio.wait(tasks, timeout=300) if tasks else (set(), set())
        for t in pending:
            t.cancel()
    out = [t.result() for t in tasks if t in done]
    out += [{"rid": "?", "error": "still running 300 s after the last arrival",
             "drop": False, "status": None} for _ in pending]
    return out


class _Admin:
    """The admin cycle; records every version's config from the server's answers."""

    def __init__(self, url: str, token: str, every: float) -> None:
        self.url, self.every = url, float(every)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.versions: dict[int, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._i = 0

    def record(self, state: dict[str, Any]) -> None:
        self.versions[int(state["version"])] = state["config"]

    async def step(self, client: Any, at: float) -> None:
        kind, arg = ADMIN_CYCLE[self._i % len(ADMIN_CYCLE)]
        self._i += 1
        if kind == "put":
            r = await client.put("/admin/gsm", json=arg, headers=self.headers)
        elif kind == "rollout":
            r = await client.post("/admin/gsm/rollout", json={"fraction": arg},
                                  headers=self.headers)
        else:
            r = await client.post("/admin/gsm/rollback", headers=self.headers)
        if r.status_code != 200:
            self.errors.append(f"{kind}: HTTP {r.status_code} {r.text[:200]}")
            return
        self.record(r.json())
        self.events.append({"at_s": round(at, 3), "kind": kind,
                            "version": r.json()["version"]})


# ----------------------------------------------------------------------------- references

def references(params: Any, recs: list[dict[str, Any]], versions: dict[int, Any],
               max_tokens: int, pool: dict[str, list[str]]) -> dict[tuple[str, str], str]:
    """{(config key, prompt): text} of `gsm_jax.generate` (its output for each prompt, which
    is the prompt's output alone), for every (config, prompt) the completed answers need."""
    import gsm_jax

    need: dict[str, tuple[Any, set[str]]] = {}
    for r in recs:
        if r.get("text") is None:
            continue
        cfg = _config_of(r, versions)
        key = json.dumps(cfg, sort_keys=True)
        need.setdefault(key, (cfg, set()))[1].add(r["prompt"])
    out = {}
    for key, (cfg, prompts) in need.items():
        gsm = None if cfg is None else gsm_jax.GSMConfig.from_dict(
            {**cfg, "rollout_fraction": 1.0, "short_request_tokens": 0})
        # one call per config over the whole pool: a row's output does not depend on its
        # neighbours or on the batch's padding (tests/test_gsm_model.py::
        # test_batch_invariance), and every config's call has the same shapes, so the
        # smoothed configs share one compiled program (their numbers are runtime arrays)
        ordered = sorted(set(pool["prefix"]) | set(pool["plain"]))
        assert prompts <= set(ordered)
        texts = gsm_jax.generate(params, ordered, max_new_tokens=max_tokens, gsm=gsm)
        out.update({(key, p): t for p, t in zip(ordered, texts, strict=True)})
    return out


def _config_of(rec: dict[str, Any], versions: dict[int, Any]) -> Any:
    """The config that smoothed this answer's row (None: not smoothed)."""
    if rec["arm"] != "gsm":
        return None
    cfg = versions.get(int(rec["version"]))
    if cfg is None:
        raise KeyError(f"version {rec['version']} was never seen in an admin answer")
    return cfg


# ----------------------------------------------------------------------------- the run

def run_soak(url: str, *, admin_token: str, pid: int | None, params: Any, minutes: float,
             rate: float | None = None, load: float = 0.8, capacity_s: float = 20.0,
             warmup_s: float = 20.0, admin_every: float = 30.0, prefix_share: float = 0.3,
             disconnect_share: float = 0.1, max_tokens: int = 8, rss_growth: float = 0.05,
             seed: int = 0, pool: tuple[int, int] = (12, 4),
             progress: bool = True) -> dict[str, Any]:
    """The phases and checks of the module docstring against the server at `url`; `pool`:
    (plain prompts, tails per shared prefix) of `prompt_pool` (fewer: fewer references)."""
    import httpx

    headers = {"Authorization": f"Bearer {admin_token}"}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    stats0 = httpx.get(f"{url}/admin/stats", headers=headers).json()
    pool = prompt_pool(*pool, seed=seed)
    if rate is None:
        if progress:
            print(f"[soak] capacity: {stats0['max_batch']} clients, {capacity_s:.0f} s",
                  flush=True)
        capacity = asyncio.run(_closed_loop(url, model, pool, stats0["max_batch"], capacity_s,
                                            max_tokens, prefix_share, seed))
        rate = load * capacity
    else:
        capacity = None
    if not rate > 0:
        raise RuntimeError(f"no request completed while measuring capacity ({capacity})")
    if progress:
        print(f"[soak] rate {rate:.2f}/s; warm-up {warmup_s:.0f} s", flush=True)
    asyncio.run(_poisson(url, model, pool, rate=rate, seconds=warmup_s, max_tokens=max_tokens,
                         prefix_share=prefix_share, disconnect_share=disconnect_share,
                         seed=seed + 1, tag="warm"))
    admin = _Admin(url, admin_token, admin_every)
    admin.record(httpx.get(f"{url}/admin/gsm", headers=headers).json())
    m0 = httpx.get(f"{url}/metrics").text
    pc0 = (httpx.get(f"{url}/admin/stats", headers=headers).json().get("prefix_cache")
           or {}).get("bytes", 0)
    rss0 = _rss_bytes(pid)
    t_start = time.time()
    recs = asyncio.run(_poisson(url, model, pool, rate=rate, seconds=minutes * 60,
                                max_tokens=max_tokens, prefix_share=prefix_share,
                                disconnect_share=disconnect_share, seed=seed + 2, tag="soak",
                                admin=admin, progress=progress))
    soak_s = time.time() - t_start
    # the server finishes what the dropped streams left (their aborts) within a few steps
    deadline = time.time() + 60
    while True:
        end = httpx.get(f"{url}/admin/stats", headers=headers).json()
        if (end["running"] == 0 and end["waiting"] == 0) or time.time() > deadline:
            break
        time.sleep(0.5)
    m1 = httpx.get(f"{url}/metrics").text
    rss1 = _rss_bytes(pid)
    pc1 = (end.get("prefix_cache") or {}).get("bytes", 0)
    if progress:
        print(f"[soak] {len(recs)} requests in {soak_s:.0f} s; computing references",
              flush=True)
    kept = [r for r in recs if not r["drop"]]
    errors = [r for r in kept if r["status"] != 200 or r["error"] is not None]
    drop_errors = [r for r in recs if r["drop"] and (r["error"] is not None
                                                    or r["status"] != 200)]
    t_refs = time.time()
    refs = references(params, kept, admin.versions, max_tokens, pool)
    t_refs = time.time() - t_refs
    mismatches = []
    for r in kept:
        if r.get("text") is None:
            continue
        key = (json.dumps(_config_of(r, admin.versions), sort_keys=True), r["prompt"])
        r["reference"] = refs[key]
        if r["text"] != refs[key]:
            mismatches.append(r)
    aborted = _metric_sum(m1, "gsm_jax:request_success_total", finished_reason="abort") - \
        _metric_sum(m0, "gsm_jax:request_success_total", finished_reason="abort")
    dropped = sum(r["drop"] for r in recs)
    growth = None if rss0 is None or rss1 is None else (rss1 - rss0) / rss0
    net = None if growth is None else (rss1 - rss0 - (pc1 - pc0)) / rss0
    compiled = _metric_sum(m1, "gsm_jax_compilations_after_ready_total") - \
        _metric_sum(m0, "gsm_jax_compilations_after_ready_total")
    checks = {
        "no_unexpected_errors": not errors and not drop_errors and not admin.errors,
        "nothing_compiled_during_the_soak": compiled == 0,
        "answers_equal_solo": not mismatches,
        "rss_growth_net_of_prefix_cache": net is None or net <= rss_growth,
        "all_free_at_end": end["running"] == 0 and end["waiting"] == 0
        and end["kv_usage"] == 0,
        "disconnects_aborted": aborted >= dropped,
    }
    arms: dict[str, int] = {}
    for r in kept:
        if r.get("arm"):
            arms[r["arm"]] = arms.get(r["arm"], 0) + 1
    return {
        "ok": all(checks.values()), "checks": checks, "url": url, "model": model,
        "minutes": minutes, "soak_s": soak_s, "capacity_rps": capacity, "rate_rps": rate,
        "load": load, "requests": len(recs), "completed": len(kept) - len(errors),
        "dropped": dropped, "aborted_by_server": aborted, "arms": arms,
        "compilations_during_soak": compiled,
        "versions_seen": sorted({r["version"] for r in kept if r.get("version")}),
        "admin_events": admin.events, "admin_errors": admin.errors,
        "errors": errors[:20], "drop_errors": drop_errors[:20], "mismatches": mismatches[:20],
        "references": len(refs), "references_s": t_refs, "rss_before": rss0, "rss_after": rss1,
        "rss_growth": growth, "rss_growth_net": net, "rss_growth_limit": rss_growth,
        "prefix_cache_bytes_before": pc0, "prefix_cache_bytes_after": pc1,
        "end_stats": end, "records": recs,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r.get("e2e_s") is not None]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for arm, color in (("gsm", "tab:red"), ("control", "tab:blue"), ("off", "tab:gray"),
                       ("bypass", "tab:green")):
        pts = [(r["sent"], r["e2e_s"]) for r in recs if r.get("arm") == arm]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=6, color=color, label=arm)
    for e in result["admin_events"]:
        ax.axvline(e["at_s"], color="k", alpha=0.25, lw=0.8)
        ax.annotate(f"{e['kind']} v{e['version']}", (e["at_s"], ax.get_ylim()[1]),
                    rotation=90, fontsize=6, va="top")
    ok = "all checks hold" if result["ok"] else "FAILED: " + ", ".join(
        k for k, v in result["checks"].items() if not v)
    ax.set_title(f"soak: {result['requests']} requests at {result['rate_rps']:.2f}/s over "
                 f"{result['soak_s']:.0f} s, {ok}", fontsize=9)
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("e2e latency (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--admin-token", default=None, help="that server's --admin-token")
    ap.add_argument("--pid", type=int, default=None, help="that server's process (for RSS)")
    ap.add_argument("--model", default="smollm2-135m", help="the model (reference and, "
                    "without --url, the server's)")
    ap.add_argument("--server-args", default="", help="extra flags of the started server")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=None, help="arrivals/s (default: --load x "
                    "the measured capacity)")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--capacity-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--admin-every", type=float, default=30.0)
    ap.add_argument("--prefix-share", type=float, default=0.3)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rss-growth", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 120:
        raise SystemExit(f"--minutes must be in (0, 120], got {args.minutes}")
    if args.url is not None and not args.admin_token:
        raise SystemExit("--url needs --admin-token (the soak drives /admin/gsm)")
    import gsm_jax

    params = gsm_jax.load(args.model)
    kw = dict(params=params, minutes=args.minutes, rate=args.rate, load=args.load,
              capacity_s=args.capacity_s, warmup_s=args.warmup_s,
              admin_every=args.admin_every, prefix_share=args.prefix_share,
              disconnect_share=args.disconnect_share, max_tokens=args.max_tokens,
              rss_growth=args.rss_growth, seed=args.seed)
    if args.url is not None:
        result = run_soak(args.url, admin_token=args.admin_token, pid=args.pid, **kw)
    else:
        from gsm_jax.serving.launch import ServerProcess

        server_args = ["--model", args.model, "--log-level", "warning", *SERVER_ARGS,
                       *args.server_args.split()]
        with ServerProcess(server_args, admin_token=TOKEN,
                           log_path=args.out / "server.log") as srv:
            result = run_soak(srv.url, admin_token=TOKEN, pid=srv.proc.pid, **kw)
        result["server_args"] = server_args
    result["command"] = "python scripts/soak_server.py " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out / "results.png")
    print(json.dumps({k: result[k] for k in ("ok", "checks", "requests", "completed",
                                             "dropped", "rate_rps", "rss_growth",
                                             "rss_growth_net", "arms")}, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
