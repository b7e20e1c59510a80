"""Serving pieces without a model or a socket: live GSM versions and arms, incremental text
with stop strings, the engine loop's queue bound and aborts, the load test's summary."""

from __future__ import annotations

import math

import pytest

import gsm_jax
from gsm_jax.config import rollout_value
from gsm_jax.errors import GSMConfigError
from gsm_jax.serving.app import TextStream
from gsm_jax.serving.bench_client import Outcome, summarize
from gsm_jax.serving.engine import Engine, Request
from gsm_jax.serving.gsm_state import LiveGSM
from gsm_jax.serving.scheduler import Draining, EngineLoop, QueueFull, Ticket

CFG = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.1)


def test_live_gsm_versions_rollout_rollback():
    seen = []
    live = LiveGSM(None, on_change=seen.append)
    assert live.state()["version"] == 1 and live.assign("a", 100) == (live.current, "off")
    with pytest.raises(GSMConfigError, match="PUT"):
        live.rollout(0.5)  # nothing to roll out yet
    with pytest.raises(GSMConfigError, match="oldest"):
        live.rollback()
    v2 = live.put(CFG.to_dict())
    assert v2.number == 2 and live.assign("a", 100)[1] == "gsm"
    with pytest.raises(GSMConfigError, match="max_strength"):
        live.put({**CFG.to_dict(), "smooth_strength": 0.5})
    with pytest.raises(GSMConfigError):
        live.put(["not", "a", "mapping"])
    assert live.current.number == 2  # refused changes leave the version in force
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(GSMConfigError, match="fraction"):
            live.rollout(bad)
    v3 = live.rollout(0.3)
    ids = [f"u{i}" for i in range(400)]
    arms = {i: live.assign(i, 100)[1] for i in ids}
    assert all(arms[i] == ("gsm" if rollout_value(i) < 0.3 else "control") for i in ids)
    assert abs(sum(a == "gsm" for a in arms.values()) / 400 - 0.3) < 0.07  # 3 sigma
    # raising the fraction never moves a request out of the gsm arm
    live.rollout(0.6)
    assert all(live.assign(i, 100)[1] == "gsm" for i in ids if arms[i] == "gsm")
    back = live.rollback()
    assert back.number == v3.number and back.source == "rollback"
    assert live.rollback().number == 2 and live.put(CFG).number == 5  # numbers never reused
    assert [v.number for v in seen] == [2, 3, 4, 3, 2, 5]
    bypass = LiveGSM(CFG.replace(short_request_tokens=64))
    assert bypass.assign("x", 63)[1] == "bypass" and bypass.assign("x", 64)[1] == "gsm"
    assert LiveGSM(CFG.replace(enable=False)).assign("x", 100)[1] == "off"


class CharTokenizer:
    """decode = the characters of the ids; id 0 is EOS; 200 starts a two-id character."""

    def decode(self, ids):
        out, i = [], 0
        ids = list(ids)
        while i < len(ids):
            if ids[i] == 200:
                out.append("é" if i + 1 < len(ids) else "\ufffd")
                i += 2
            else:
                out.append(chr(ids[i]))
                i += 1
        return "".join(out)


def test_text_stream_stops_and_holds_back():
    tok = CharTokenizer()
    s = TextStream(tok, ["END", "xy"], frozenset({0}))
    sent = ""
    for ch in "hello E":
        assert not s.add(ord(ch))
        sent += s.pending(final=False)
    assert sent == "hello"  # " E" may start "END": held back
    assert not s.add(ord("N"))
    assert s.add(ord("D"))  # matched across three tokens
    sent += s.pending(final=True)
    assert sent == "hello " and s.text == "hello "

    t = TextStream(tok, [], frozenset({0}))
    t.add(200)  # the first half of a two-id character: nothing yet
    assert t.pending(final=False) == ""
    t.add(1)  # its second half
    t.add(65)
    t.add(0)  # EOS is not text
    assert t.pending(final=True) == "éA"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def test_engine_loop_bounds_the_queue_and_aborts(tiny):
    eng = Engine(tiny, max_batch=1, max_len=64, eos_ids=[])
    loop = EngineLoop(eng, max_queue=2)  # not started: tickets stay queued
    finished = []
    tickets = [Ticket(Request([5, 6], 8), on_finish=finished.append) for _ in range(3)]
    loop.submit(tickets[0])
    loop.submit(tickets[1])
    with pytest.raises(QueueFull, match="2 waiting"):
        loop.submit(tickets[2])
    loop.abort(tickets[1])  # while it waits in the queue: it never runs
    loop.start()
    try:
        assert tickets[0].finished.wait(60) and tickets[1].finished.wait(60)
        assert tickets[0].record.n_tokens == 8
        assert tickets[1].record.finish_reason == "abort" and tickets[1].record.n_tokens == 0
        assert loop.num_waiting == 0 and loop.num_running == 0
        long = Ticket(Request([5, 6], 40))
        loop.submit(long)
        loop.abort(long)
        assert long.finished.wait(60)
        assert long.record is None or long.record.finish_reason == "abort"
        assert loop.drain(5) and loop.draining
        with pytest.raises(Draining):
            loop.submit(Ticket(Request([5], 2)))
    finally:
        loop.stop()
    assert finished[:2] == [tickets[1], tickets[0]]  # the aborted one ended first


def test_bench_summary_percentiles_and_goodput():
    outs = []
    for i in range(10):
        o = Outcome(i, "short", f"r{i}", ok=i < 9, status=200 if i < 9 else 503)
        o.ttft, o.e2e, o.tokens, o.itl = 0.1 * (i + 1), 1.0 + i, 11, [0.05] * 10
        outs.append(o)
    s = summarize(outs, wall=10.0, slo={"ttft": 0.5})
    assert s["completed"] == 9 and s["failed"] == 1 and s["statuses"] == {"200": 9, "503": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_s"]["n"] == 9
    assert s["goodput_req_per_s"] == pytest.approx(0.5)  # 5 of 9 within 0.5 s, over 10 s
    assert s["output_tok_per_s"] == pytest.approx(9.9)
    assert s["itl_s"]["p99"] == pytest.approx(0.05)
    assert math.isnan(Outcome(0, "", "x", ok=True, tokens=1).tpot)


def test_on_off_table_flags_loaded_runs():
    from gsm_jax.serving.bench_client import on_off_table

    o = Outcome(0, "short", "r0", ok=True, status=200)
    o.ttft, o.e2e, o.tokens, o.itl = 0.2, 1.0, 5, [0.1] * 4
    run = {"summary": {"all": summarize([o], wall=2.0, slo={})}, "load_before": 1.0,
           "load_after": 1.1, "comparable": True}
    table = on_off_table({"off": run, "on": {**run, "load_after": 1.7, "comparable": False}})
    assert "| GSM compiled out | 2.5 | 200 / 200 | 100 / 100 | 1000 / 1000 | 0 |" in table
    assert "not comparable" in table
    assert "not comparable" not in on_off_table({"off": run, "on": run})
