"""The server's start-up and issue 42's guarantees around it.

- The compilation counter (`gsm_jax.serving.compile_events`, JAX's own
  backend-compile event): a first call counts 1, the same shapes again 0, a new shape 1,
  a persistent-cache hit 1; `/metrics` exports it as `gsm_jax_compilations_total`.
- While warming up, `/health` is 503 with "warming n/N" and `Retry-After`, every API
  request 503 with `Retry-After`, and the log shows each step; a server shut down while
  warming stops at the warm-up's next stage (in-process, the warm-up faked and gated).
- SIGTERM while warming: `gsm-jax serve` exits 0 within seconds (a subprocess).
- A prompt longer than --max-len: 400 `context_length_exceeded` naming both lengths
  (completions and chat, text and token ids, echo).
- **Issue 42's acceptance test** (`test_issue42_acceptance_no_compilation_after_ready`):
  after ready, a mixed workload compiles nothing.

One in-process server (uvicorn in a thread) over conftest's tiny random Llama with the
character tokenizer of tests/test_server_openai_compat.py serves the last two.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from test_server_openai_compat import _char_tokenizer, _free_port
from tiny_models import write_tiny_hf_llama

from gsm_jax.config import rollout_value
from gsm_jax.params import ModelParams
from gsm_jax.serving import compile_events
from gsm_jax.serving.app import GSMServer, ServerOptions, build_app

NAME = "tiny-chars"
TOKEN = "startup-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_LEN = 256
GSM_ON = {"enable": True, "target_layers": "all", "smooth_strength": 0.3, "window_size": 4}


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text page (0 if absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- (a) the counter


def test_compile_counter_counts_each_program_built_once(tmp_path):
    """One count per executable built: compiled by XLA, or loaded from the persistent
    compilation cache (that is work and a program the process did not have); nothing for
    a jit call whose program is in memory. numpy inputs: no eager op of its own compiles."""
    import jax
    from jax._src import compilation_cache

    compile_events.install()
    compile_events.install()  # idempotent: still one listener

    def built(fn, *args) -> int:
        before = compile_events.count()
        jax.block_until_ready(fn(*args))
        return compile_events.count() - before

    f = jax.jit(lambda x: x * 2.0 + 1.0)
    assert built(f, np.ones(3, np.float32)) == 1
    assert built(f, np.ones(3, np.float32)) == 0
    assert built(f, np.ones(4, np.float32)) == 1
    assert built(f, np.ones(3, np.float32)) == 0
    assert compile_events.recent(1)[0][1] == "jit(<lambda>)"

    # the persistent cache: a program compiled and written, dropped from memory, loaded
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        hits = []
        jax.monitoring.register_event_listener(
            lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
        g = jax.jit(lambda x: x * 3.0 - 7.0)
        assert built(g, np.ones(5, np.float32)) == 1 and not hits  # compiled, written
        assert built(g, np.ones(5, np.float32)) == 0
        jax.clear_caches()
        assert built(g, np.ones(5, np.float32)) == 1 and hits  # loaded from the cache
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()

    # /metrics: the process-wide count, and what came after the server said ready
    from gsm_jax.serving.metrics import ServerMetrics

    m = ServerMetrics("x")
    page = m.render().decode()
    assert _metric(page, "gsm_jax_compilations_total") == compile_events.count()
    assert _metric(page, "gsm_jax_compilations_after_ready_total") == 0
    m.mark_ready()
    assert built(jax.jit(lambda x: x - 1.0), np.ones(2, np.float32)) == 1
    page = m.render().decode()
    assert _metric(page, "gsm_jax_compilations_after_ready_total") == 1
    assert "# TYPE gsm_jax_compilations_total counter" in page


# ----------------------------------------------------------------------------- (b) warming


def _tiny_params(tiny_llama) -> ModelParams:
    return ModelParams(tiny_llama.weights, tiny_llama.config, _char_tokenizer(), NAME)


def test_health_and_requests_503_while_warming(tiny_llama, monkeypatch, caplog):
    """The warm-up is faked (gated stage by stage, as `Engine.warmup` reports them): /health
    is 503 "warming n/N" with Retry-After at every step, an API request 503 with
    Retry-After, /metrics answers, the log has one line per step; then ready (200). A
    second server shut down mid-warm-up stops at the next stage and starts no engine."""
    from starlette.testclient import TestClient

    from gsm_jax.serving.engine import Engine

    gates = [threading.Event() for _ in range(3)]
    statuses = []

    def fake_warmup(self, prompt_lengths=(16,), *, sample=False, progress=None, **kw):
        statuses.append(server.status)
        for i, gate in enumerate(gates):
            assert gate.wait(60), "the test never opened this stage"
            progress(i + 1, len(gates), f"stage {i + 1}")
        return {}

    monkeypatch.setattr(Engine, "warmup", fake_warmup)
    params = _tiny_params(tiny_llama)
    opts = ServerOptions(model=NAME, max_batch=2, max_len=64, prefill_chunk=None,
                         admin_token=TOKEN)
    server = GSMServer(opts, params)
    caplog.set_level(logging.INFO, logger="gsm_jax.serving")
    with TestClient(build_app(server)) as c:
        _wait(lambda: server.status == "warming", 60, "warming")
        r = c.get("/health")
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.json()["status"] == "warming" and "warming 0/" in r.json()["message"]
        for done in (1, 2):
            gates[done - 1].set()
            _wait(lambda d=done: server.warm_progress[0] == d, 30, f"stage {done}")
            r = c.get("/health")
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert f"warming {done}/3" in r.json()["message"], r.json()
            assert r.json()["warmup"] == {"done": done, "total": 3, "stage": f"stage {done}"}
            ready = c.get("/ready")
            assert ready.status_code == 503 and ready.headers["Retry-After"]
        for method, path, body in (
                ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}]}),
                ("POST", "/tokenize", {"prompt": "hi"}),
                ("GET", "/admin/gsm", None)):
            r = c.request(method, path, json=body, headers=ADMIN)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "warming"
            assert "warming 2/3" in r.json()["error"]["message"]
        page = c.get("/metrics")
        assert page.status_code == 200 and "gsm_jax_compilations_total" in page.text
        assert _metric(page.text, "gsm_jax_compilations_after_ready_total") == 0
        gates[2].set()
        _wait(lambda: server.status == "ready", 30, "ready")
        assert c.get("/health").status_code == 200
        assert "Retry-After" not in c.get("/health").headers
    assert statuses == ["warming"]
    lines = [r.getMessage() for r in caplog.records if r.name == "gsm_jax.serving"]
    for done in (1, 2, 3):
        assert any(f"warming {done}/3: stage {done}" in m for m in lines), lines
    assert any(" ready (" in m for m in lines)

    # shut down mid-warm-up: the next stage raises in the loading thread, nothing starts
    for gate in gates:
        gate.clear()
    statuses.clear()
    second = server = GSMServer(opts, params)
    with TestClient(build_app(second)):
        _wait(lambda: second.status == "warming", 60, "warming")
    gates[0].set()  # the warm-up reaches its next stage after the app closed
    second.load_thread.join(30)
    assert not second.load_thread.is_alive() and second.status == "stopped"
    assert second.loop is None


# ----------------------------------------------------------------------------- (c) SIGTERM


def test_sigterm_while_warming_exits_0_at_once(tmp_path):
    """`gsm-jax serve` on a tiny Llama directory (its compilation cache off, so the warm-up
    compiles): once /health says "warming", a request gets 503 with Retry-After; SIGTERM
    then ends the process with rc 0 in seconds, not at the end of the warm-up (the loading
    thread is inside XLA's first compilations: the process exits without it). Sent as soon
    as the warm-up starts, so a warm-up of a few seconds still has it land inside."""
    from gsm_jax.serving.launch import ServerProcess

    model = write_tiny_hf_llama(tmp_path / "tiny", max_positions=512)
    log_path = tmp_path / "serve.log"
    srv = ServerProcess(["--model", str(model), "--max-len", "512", "--max-batch", "4",
                         "--log-level", "info"], log_path=log_path,
                        env={"JAX_PLATFORMS": "cpu", "GSM_JAX_COMPILATION_CACHE": "0"})
    srv.start(wait=False)
    try:
        deadline = time.time() + 120
        while True:
            assert srv.proc.poll() is None, log_path.read_text()[-3000:]
            h = srv.health()
            if h is not None and h[1]["status"] == "warming":
                break
            assert h is None or (h[0] == 503 and h[1]["status"] == "loading"), h
            assert time.time() < deadline, "no warm-up in 120 s"
            time.sleep(0.02)
        code, body, headers = h
        assert code == 503 and "warming" in body["message"] and int(headers["retry-after"])
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        assert r.json()["error"]["code"] == "warming"
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=60)
        took = time.time() - t0
    finally:
        srv.kill()
    text = log_path.read_text()
    assert rc == 0, text[-3000:]
    assert took < 20, (took, text[-3000:])
    assert "while warming: stopping" in text
    assert " ready (" not in text  # it stopped during the warm-up, not after it


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def served(tiny_llama):
    """One server at issue 42's small settings: 4 slots, --max-len 256, --prefill-chunk 32,
    prefix caching on, GSM compiled in (off until a PUT), admin on, the CLI's warm-up."""
    import uvicorn

    server = GSMServer(ServerOptions(model=NAME, max_batch=4, max_len=MAX_LEN,
                                     prefill_chunk=32, admin_token=TOKEN,
                                     warmup_lengths=(16,)),
                       _tiny_params(tiny_llama))
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: server.status not in ("loading", "warming"), 300, "the warm-up")
    assert server.status == "ready", server.error
    _wait(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 30, "/health")
    yield url, server
    uv.should_exit = True
    thread.join(30)


def _ids(n: int, salt: int = 0) -> list[int]:
    """n token ids of the character vocabulary (no special token: ids 4..63)."""
    return [4 + (7 * i + salt) % 60 for i in range(n)]


# ----------------------------------------------------------------------------- (d) max-len


def test_prompt_longer_than_max_len_is_400(served):
    url, _ = served

    def refused(path: str, body: dict, n_prompt: int) -> None:
        r = httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=60)
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["code"] == "context_length_exceeded" and e["param"] == "prompt", e
        assert str(MAX_LEN) in e["message"] and str(n_prompt) in e["message"], e

    comp, chat = "/v1/completions", "/v1/chat/completions"
    for n in (MAX_LEN + 44, MAX_LEN):  # over; exactly max-len: no room for one token
        refused(comp, {"prompt": _ids(n), "max_tokens": 4}, n)
        refused(comp, {"prompt": _ids(n)}, n)  # max_tokens left out (16)
        refused(comp, {"prompt": [_ids(3), _ids(n)], "max_tokens": 1}, n)  # one of two
    refused(comp, {"prompt": _ids(MAX_LEN + 1), "max_tokens": 0, "echo": True,
                   "logprobs": 1}, MAX_LEN + 1)
    text = "ab" * 150  # one token per character
    refused(comp, {"prompt": text, "max_tokens": 3}, 300)
    # chat: without max_tokens the room left was taken as max_tokens, and a negative room
    # was refused as "max_tokens must be >= 1"
    messages = [{"role": "user", "content": text}]
    n_chat = len(_char_tokenizer().encode_chat(messages))
    refused(chat, {"messages": messages}, n_chat)
    refused(chat, {"messages": messages, "max_tokens": 5}, n_chat)
    refused(chat, {"messages": messages, "max_completion_tokens": 5}, n_chat)
    # within the context but asking too much: the max_tokens' fault
    r = httpx.post(f"{url}{comp}", json={"model": NAME, "prompt": _ids(250), "max_tokens": 10},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "250" in r.json()["error"]["message"] and "10" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- (e) issue 42


def _rid(arm: str, tag: str, fraction: float = 0.5) -> str:
    for i in range(1000):
        rid = f"{tag}-{i}"
        if (rollout_value(rid) < fraction) == (arm == "gsm"):
            return rid
    raise AssertionError("no id found")


def test_issue42_acceptance_no_compilation_after_ready(served):
    """ISSUE 42 ACCEPTANCE TEST: zero compilations after ready, counted with JAX's own
    events as /metrics exports them (`gsm_jax_compilations_total`), under a mixed workload:
    greedy and sampled (temperature, top_k, top_p, seed), n > 1, frequency / presence /
    repetition penalties and logit_bias, logprobs / top_logprobs (chat) and logprobs +
    echo (completions), streamed and not, prompts from 1 token to max_len - 1 (chunked
    prefill), concurrent rows, a repeated long prompt (prefix-cache hit), a GSM config
    change (PUT /admin/gsm), a canary (rollout 0.5, both arms at once) and a rollback.
    A failure lists, per part of the workload, the programs that compiled."""
    url, server = served
    http = httpx.Client(base_url=url, timeout=300)

    def ok(r: httpx.Response) -> dict:
        assert r.status_code == 200, r.text
        return r.json()

    def comp(prompt, max_tokens: int, headers=None, **kw) -> dict:
        return ok(http.post("/v1/completions", json={
            "model": NAME, "prompt": prompt, "max_tokens": max_tokens, **kw}, headers=headers))

    def chat(content: str, max_tokens: int, headers=None, **kw) -> dict:
        return ok(http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **kw}, headers=headers))

    def stream(path: str, body: dict, headers=None) -> list[str]:
        body = {"model": NAME, **body, "stream": True}
        with http.stream("POST", path, json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return lines

    def at_once(*calls) -> None:
        with ThreadPoolExecutor(len(calls)) as pool:
            for f in [pool.submit(c) for c in calls]:
                f.result()

    def metrics() -> str:
        return http.get("/metrics").text

    def greedy():
        comp(_ids(1), 4)
        comp("hello there", 8, temperature=0)
        chat("what is 2 and 2?", 8, temperature=0)
        stream("/v1/completions", {"prompt": "abc", "max_tokens": 6, "temperature": 0})

    def sampled():
        comp("once upon", 8, temperature=0.8, top_k=8, top_p=0.9, seed=3)
        comp("once upon", 8, temperature=1.0, seed=4)
        comp("once upon", 8, temperature=0.7, top_p=0.5)  # no seed: the server's
        chat("tell me", 6, temperature=1.2, top_k=5, seed=9)
        stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 6, "temperature": 0.9, "seed": 2})

    def n_many():
        assert len(comp("count: 1, 2,", 6, n=3, temperature=0.9, seed=1)["choices"]) == 3
        assert len(comp([_ids(5), _ids(9, 1)], 4, n=2, temperature=0)["choices"]) == 4
        stream("/v1/completions", {"prompt": "ab", "max_tokens": 4, "n": 2,
                                   "temperature": 0.5, "seed": 6})

    def penalties():
        comp("abab abab", 8, frequency_penalty=0.5, temperature=0)
        comp("abab abab", 8, presence_penalty=0.7, temperature=0.8, seed=5)
        comp("abab abab", 8, repetition_penalty=1.3, temperature=0)
        comp("abab abab", 8, logit_bias={"10": 5.0, "11": -100}, temperature=0)
        chat("again", 6, frequency_penalty=0.2, presence_penalty=0.2, temperature=0.6,
             top_k=10, seed=8, logit_bias={"20": 2.0})

    def logprobs():
        chat("score me", 6, logprobs=True, top_logprobs=3, temperature=0)
        chat("score me", 6, logprobs=True, temperature=0.8, seed=2)
        stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                        "max_tokens": 6, "logprobs": True,
                                        "top_logprobs": 2, "temperature": 0})
        comp("the cat sat", 6, logprobs=2, echo=True, temperature=0)
        comp(_ids(40), 4, logprobs=1, temperature=0)
        comp(_ids(70, 3), 0, logprobs=5, echo=True)  # the prompt alone (lm-eval)
        stream("/v1/completions", {"prompt": "a dog ran", "max_tokens": 5, "logprobs": 3,
                                   "echo": True, "temperature": 0})

    def lengths():
        for n in (2, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 129, 190, 200,
                  230, 250, MAX_LEN - 2, MAX_LEN - 1):
            comp(_ids(n, n), min(3, MAX_LEN - n), temperature=0, ignore_eos=True)
        stream("/v1/completions", {"prompt": _ids(150, 1), "max_tokens": 3,
                                   "temperature": 0.5, "seed": 1})

    def concurrent():
        at_once(lambda: comp(_ids(3), 20, temperature=0, ignore_eos=True),
                lambda: comp(_ids(90, 2), 12, temperature=0.8, seed=3, ignore_eos=True),
                lambda: comp(_ids(20, 4), 16, repetition_penalty=1.2, ignore_eos=True),
                lambda: chat("hi there", 10, temperature=0.7, top_p=0.8, seed=1),
                lambda: comp(_ids(170, 5), 8, temperature=0, ignore_eos=True),
                lambda: comp(_ids(7, 6), 24, temperature=1.0, top_k=3, seed=2,
                             ignore_eos=True))

    long = _ids(200, 11)

    def prefix_cache():
        before = _metric(metrics(), "gsm_jax:prefix_cache_hits_total")
        comp(long, 4, temperature=0)
        comp(long, 4, temperature=0)  # resumes from the cached chunk boundaries
        comp(long[:160] + _ids(30, 5), 4, temperature=0.6, seed=1)
        stream("/v1/completions", {"prompt": long, "max_tokens": 3, "temperature": 0})
        assert _metric(metrics(), "gsm_jax:prefix_cache_hits_total") > before

    def gsm_change():
        ok(http.put("/admin/gsm", json=GSM_ON, headers=ADMIN))
        comp("smooth me", 6, temperature=0)
        comp(_ids(120, 7), 4, temperature=0.7, seed=3)
        comp(long, 3, temperature=0)  # prefix cache under another GSM config
        comp(long, 3, temperature=0)
        chat("smooth", 5, logprobs=True, top_logprobs=2, temperature=0)
        comp("abab", 5, frequency_penalty=0.3, temperature=0)

    def canary():
        ok(http.post("/admin/gsm/rollout", json={"fraction": 0.5}, headers=ADMIN))
        on, off = ({"x-request-id": _rid(a, "canary")} for a in ("gsm", "control"))
        at_once(lambda: comp(_ids(30), 10, headers=on, temperature=0, ignore_eos=True),
                lambda: comp(_ids(30), 10, headers=off, temperature=0, ignore_eos=True),
                lambda: comp(_ids(60, 1), 8, headers=on, temperature=0.9, seed=4,
                             ignore_eos=True),
                lambda: chat("both arms", 6, headers=off, temperature=0))
        comp("score both", 4, headers=on, logprobs=2, echo=True, temperature=0)
        ok(http.post("/admin/gsm/rollback", headers=ADMIN))
        comp("rolled back", 4, temperature=0)

    parts = [("greedy", greedy), ("sampled", sampled), ("n>1", n_many),
             ("penalties and logit_bias", penalties), ("logprobs / echo", logprobs),
             ("prompt lengths 1..max_len-1 (chunked)", lengths), ("concurrent rows", concurrent),
             ("prefix-cache hit", prefix_cache), ("GSM config change", gsm_change),
             ("canary and rollback", canary)]

    def idle() -> None:  # the engine thread finished the part's steps
        _wait(lambda: not server.loop.has_work, 60, "an idle engine")

    start = _metric(metrics(), "gsm_jax_compilations_total")
    compiled: list[tuple[str, list[str]]] = []
    for what, run in parts:
        idle()
        c0 = compile_events.count()
        run()
        idle()
        n = compile_events.count() - c0
        if n:
            names = [name for _, name, _ in compile_events.recent()][-n:] if n <= 256 else []
            compiled.append((what, names))
    end = _metric(metrics(), "gsm_jax_compilations_total")
    http.close()
    report = "\n".join(f"  {what}: {len(names)} ({', '.join(sorted(set(names)))})"
                       for what, names in compiled)
    assert end == start, (f"{end - start:.0f} programs compiled after ready "
                          f"(gsm_jax_compilations_total {start:.0f} -> {end:.0f}):\n{report}")
