"""The continuous-batching engine: same greedy tokens as each request run alone, GSM per slot,
closed/open-loop drivers, timestamps, switching GSM configs without recompiling."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import gsm_jax
from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.models import llama
from gsm_jax.params import ModelParams
from gsm_jax.serving import compile_events
from gsm_jax.serving.engine import Engine, Request

MAX_LEN = 48


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama whose weights are scaled up so its logits are peaked (greedy
    choices are then far from ties) and GSM visibly changes what it generates."""
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=256, eos_token_ids=(3,))
    weights = llama.init_weights(cfg, jax.random.key(0))
    weights = jax.tree.map(lambda a: a * 5 if a.ndim >= 2 else a, weights)
    return ModelParams(weights, cfg, None, "tiny")


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(0)
    lens = [5, 14, 3, 9, 16, 7]  # one prompt bucket (16): one prefill compile
    new = [12, 1, 16, 6, 10, 14]
    return [Request(rng.integers(4, 64, size=n).tolist(), m, request_id=f"r{i}")
            for i, (n, m) in enumerate(zip(lens, new, strict=True))]


# prompt + new >= 17 is smoothed: requests r0, r2, r4, r5 yes, r1, r3 no (bypassed)
GSM = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.3, window_size=4,
                        protect_first=1, short_request_tokens=17)


@pytest.mark.parametrize("gsm", [None, GSM], ids=["no_gsm", "gsm"])
def test_matches_generate_tokens_alone(tiny, requests, gsm):
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=gsm, eos_ids=[])
    # staggered: two at once, one while both slots are busy (it waits), later ones refill
    recs = eng.run(requests, arrival_times=[0.0, 0.0, 0.001, 0.05, 0.3, 0.31])
    assert not eng.has_work
    for req, rec in zip(requests, recs, strict=True):
        ref = gsm_jax.generate_tokens(tiny, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[], gsm=gsm, request_ids=[req.request_id])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(rec.request_id))
        assert rec.finish_reason == "length" and rec.n_tokens == req.max_new_tokens
    if gsm is not None:
        assert [r.gsm for r in recs] == [True, False, True, False, True, True]
    else:
        assert not any(r.gsm for r in recs)
    assert {r.slot for r in recs} == {0, 1}


def test_int8_model_matches_generate_tokens_alone(tiny, requests):
    """A w8a16 model with an int8 head (decode on the CPU int8 kernel where it builds),
    smoothed, over an int8 KV cache: every request's tokens equal generate_tokens alone on
    the same params (the kernel's rows are independent of the batch they share)."""
    from gsm_jax.quant import quantize

    q = gsm_jax.with_kv_cache_dtype(quantize(tiny, "w8a16", head=True), "int8")
    eng = Engine(q, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[])
    recs = eng.run(requests[:4], arrival_times=[0.0, 0.0, 0.001, 0.05])
    for req, rec in zip(requests[:4], recs, strict=True):
        ref = gsm_jax.generate_tokens(q, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[], gsm=GSM, request_ids=[req.request_id])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(rec.request_id))


def test_gsm_changes_tokens_per_slot(tiny, requests):
    """The smoothed requests differ from the unsmoothed engine; the bypassed ones do not."""
    off = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run(requests)
    on = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[]).run(requests)
    for a, b in zip(off, on, strict=True):
        if b.gsm:
            continue
        assert a.tokens == b.tokens
    assert any(a.tokens != b.tokens for a, b in zip(off, on, strict=True) if b.gsm)


def test_eos_finishes_and_frees_slot(tiny, requests):
    req = requests[0]
    free = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run([req])[0]
    eos = free.tokens[3]
    first = free.tokens.index(eos)
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[eos])
    recs = eng.run([req, requests[2]], clients=1)
    assert recs[0].finish_reason == "eos" and recs[0].tokens == free.tokens[: first + 1]
    assert recs[1].n_tokens >= 1 and recs[1].admitted >= recs[0].finish


def test_closed_loop_and_timestamps(tiny, requests):
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[])
    concurrent = []
    recs = eng.run(requests, clients=1,
                   on_finish=lambda r: concurrent.append(eng.num_active + eng.num_waiting))
    assert concurrent == [0] * len(requests)  # one client: nothing else in flight
    starts = sorted(r.arrival for r in recs)
    # the one client sends each request the moment the previous one completes
    assert [r.arrival for r in recs[1:]] == [r.finish for r in recs[:-1]]
    assert all(r.slot == 0 for r in recs)
    for r in recs:
        assert r.arrival <= r.admitted <= r.first_token <= r.finish
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == r.n_tokens
        assert r.e2e >= r.ttft > 0
        assert np.isnan(r.tpot) if r.n_tokens == 1 else r.tpot > 0
        d = r.to_dict(starts[0])
        assert d["e2e_s"] == pytest.approx(r.e2e, abs=1e-5) and d["n_tokens"] == r.n_tokens


def test_set_gsm_does_not_recompile(tiny, requests):
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[])
    eng.warmup([16])
    compile_events.install()
    before = compile_events.count()
    base = eng.run(requests[:2])
    eng.set_gsm(GSM.replace(smooth_strength=0.1, window_size=6, short_request_tokens=0))
    assert eng.mode == "on"
    eng.run(requests[:2])
    eng.set_gsm(None)
    assert eng.mode == "zero"
    zero = eng.run(requests[:2])
    assert compile_events.count() == before, compile_events.recent(3)
    assert not any(r.gsm for r in zero)
    # zero strength = the no-GSM model
    ref = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run(requests[:2])
    assert [r.tokens for r in zero] == [r.tokens for r in ref]
    assert base[0].tokens != zero[0].tokens  # r0 is smoothed under GSM


def test_bad_input(tiny):
    eng = Engine(tiny, max_batch=1, max_len=MAX_LEN, eos_ids=[])
    with pytest.raises(InvalidInputError, match="max_len"):
        eng.submit(Request([5] * 40, 10))
    with pytest.raises(InvalidInputError, match="vocabulary"):
        eng.submit(Request([64], 1))
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        eng.submit(Request([5], 0))
    with pytest.raises(InvalidInputError, match="clients"):
        eng.run([Request([5], 1)], arrival_times=[0.0], clients=2)
    with pytest.raises(GSMConfigError, match="without GSM"):
        eng.set_gsm(GSM)
    with pytest.raises(InvalidInputError, match="ModelParams"):
        Engine({"embed": 1})
    with pytest.raises(InvalidInputError, match="max_len"):
        Engine(tiny, max_len=10_000)


@pytest.mark.parametrize("gsm", [None, GSM.replace(short_request_tokens=0),
                                 GSM.replace(short_request_tokens=0, window_size="adaptive")],
                         ids=["no_gsm", "gsm", "gsm_adaptive"])
def test_chunked_prefill_equals_generate_alone(tiny, gsm):
    """Prompts longer than prefill_chunk go in chunks (the family's `extend`), one per
    step while the other slot decodes; tokens equal one-shot generation, GSM included
    (its windows reach back across the chunk boundaries through the ring)."""
    rng = np.random.default_rng(1)
    reqs = [Request(rng.integers(4, 64, size=n).tolist(), m, request_id=f"c{i}")
            for i, (n, m) in enumerate([(5, 12), (40, 6), (70, 9), (17, 5)])]
    eng = Engine(tiny, max_batch=2, max_len=96, gsm=gsm, eos_ids=[], prefill_chunk=16)
    recs = eng.run(reqs, arrival_times=[0.0, 0.0, 0.01, 0.02])
    for req, rec in zip(reqs, recs, strict=True):
        ref = gsm_jax.generate_tokens(tiny, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[], gsm=gsm, request_ids=[req.request_id])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(rec.request_id))
    kinds = [k for k, _, _ in eng.step_times]
    assert kinds.count("extend") == 2 + 4 + 1  # 40 -> 16+16+8, 70 -> 16*4+6, 17 -> 16+1
    # a decode step ran between the chunks of the 70-token prompt (the other slot went on)
    first = kinds.index("extend")
    assert "decode" in kinds[first: first + 4]


def test_async_scheduling_gives_the_synchronous_outputs(tiny, requests):
    """Async scheduling (a step dispatched before the previous one's tokens are read back)
    changes when tokens reach the host, never which: a mixed workload (EOS, length,
    a stop that aborts from the token callback, greedy and seeded sampling, penalties,
    per-request GSM configs, staggered arrivals, rows joining mid-stream) gives the same
    records with it on and off, and no step is dispatched for a row that reached its
    max_new_tokens."""
    free = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run([requests[0]])[0]
    eos = free.tokens[4]
    g2 = GSM.replace(smooth_strength=0.1, window_size=6, target_layers=[0])
    reqs = [Request(r.prompt, r.max_new_tokens + 4, request_id=r.request_id, gsm=g,
                    temperature=t, seed=7 if t else None, top_k=k,
                    frequency_penalty=f, logit_bias={9: 2.0} if f else None)
            for r, g, t, k, f in zip(requests, [GSM, None, g2, GSM, None, g2],
                                     [0.0, 1.0, 0.0, 0.8, 0.0, 0.0], [0, 8, 0, 0, 0, 0],
                                     [0.0, 0.0, 0.0, 0.0, 0.5, 0.0], strict=True)]
    stop_at = {"r2": 5}  # r2 is ended by its token callback (a stop string's path)

    def go(async_scheduling):
        eng = Engine(tiny, max_batch=3, max_len=MAX_LEN, gsm=GSM, eos_ids=[eos],
                     async_scheduling=async_scheduling)

        def on_token(rec, token):
            if rec.n_tokens == stop_at.get(rec.request_id):
                eng.abort(rec, "stop")
        eng.on_token = on_token
        recs = eng.run(reqs, arrival_times=[0.0, 0.0, 0.0, 0.02, 0.03, 0.2])
        assert not eng.has_work and eng._ahead is None
        assert all(s is None for s in eng.slots)
        return eng, recs

    _, sync = go(False)
    eng, recs = go(True)
    for a, b in zip(sync, recs, strict=True):
        assert (a.tokens, a.finish_reason, a.gsm) == (b.tokens, b.finish_reason, b.gsm), \
            a.request_id
    reasons = {r.finish_reason for r in recs}
    assert reasons == {"eos", "length", "stop"}, reasons
    # a lone request to its length: as many decode steps as tokens after the first
    eng.step_times = []
    one = eng.run([Request(requests[3].prompt, 7, gsm=None, ignore_eos=True)])[0]
    assert one.n_tokens == 7 and [k for k, _, _ in eng.step_times].count("decode") == 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_slot_and_queue(tiny, async_scheduling):
    """An aborted request gets no token after its abort: with async scheduling its
    decode token is still in flight after the first step (one token so far: the
    prefill's), and is dropped when read back."""
    eng = Engine(tiny, max_batch=1, max_len=MAX_LEN, eos_ids=[],
                 async_scheduling=async_scheduling)
    a = eng.submit(Request([5, 6, 7], 30, request_id="a"))
    b = eng.submit(Request([8, 9], 4, request_id="b"))
    c = eng.submit(Request([8, 9], 4, request_id="c"))
    eng.step()
    held = 1 if async_scheduling else 2
    assert a.slot == 0 and a.n_tokens == held and eng.num_waiting == 2
    assert eng.abort(a, "abort") and a.finish_reason == "abort"
    assert eng.abort(c, "abort") and c.admitted != c.admitted  # never admitted (NaN)
    assert not eng.abort(a)  # already finished
    assert eng.num_active == 0 and eng.num_waiting == 1
    while eng.has_work:
        eng.step()
    assert a.n_tokens == held and b.finish_reason == "length" and b.n_tokens == 4
    assert c.n_tokens == 0
    assert eng._ahead is None  # no step outlives its rows
    ref = gsm_jax.generate_tokens(tiny, [[8, 9]], max_new_tokens=4, eos_ids=[])[0]
    np.testing.assert_array_equal(np.asarray(b.tokens), ref)


def test_seeded_sampling_does_not_depend_on_schedule(tiny):
    """A request's k-th token draws from fold_in(key(seed), k): alone or beside others,
    with top-k / top-p or not, a seeded request gets the same tokens."""
    req = Request([5, 6, 7, 8], 10, temperature=1.0, top_k=8, top_p=0.9, seed=1234)
    alone = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run([req])[0].tokens
    others = [Request([9, 10], 12, temperature=0.7, seed=s) for s in (1, 2)]
    eng = Engine(tiny, max_batch=3, max_len=MAX_LEN, eos_ids=[])
    mixed = eng.run([others[0], req, others[1]], arrival_times=[0.0, 0.02, 0.0])
    assert mixed[1].tokens == alone
    other_seed = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[]).run(
        [Request([5, 6, 7, 8], 10, temperature=1.0, top_k=8, top_p=0.9, seed=99)])[0]
    assert other_seed.tokens != alone


def test_warmup_compiles_every_program(tiny):
    """`warmup` compiles the engine's whole, fixed set of programs (one decode per row
    bound, one extend per chunk width, the penalty row, the prefix cache's snapshot and
    restore), however long the cache: the first prompt longer than a chunk (chunks of 16,
    16 and 8; its boundaries kept by the prefix cache) then compiles nothing, and its
    tokens are those of `generate_tokens`."""
    eng = Engine(tiny, max_batch=2, max_len=96, eos_ids=[], prefill_chunk=16,
                 prefix_cache_bytes=1 << 20)
    out = eng.warmup([16])
    assert sorted(map(str, eng.programs.keys())) == sorted(map(str, [
        ("decode", 1), ("decode", None), ("extend", 16), ("penalty_row", None),
        ("snapshot", 16), ("restore", 16)]))
    assert out["programs"] == 6 and len(out["compile_s"]) == 6
    longer = Engine(tiny, max_batch=2, max_len=256, eos_ids=[], prefill_chunk=16,
                    prefix_cache_bytes=1 << 20)
    assert longer.programs.keys() == eng.programs.keys()  # not one more for 256 slots
    compile_events.install()
    before = compile_events.count()
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16 and 8
    rec = eng.run([Request(prompt, 5)])[0]
    assert compile_events.count() == before, compile_events.recent(3)
    ref = gsm_jax.generate_tokens(tiny, [prompt], max_new_tokens=5, eos_ids=[])[0]
    np.testing.assert_array_equal(np.asarray(rec.tokens), ref)


def test_per_request_configs_share_a_batch(tiny, requests):
    """Requests smoothed by different configs (and unsmoothed ones) decode in one batch;
    each gets what it gets alone under its own config, without recompiling."""
    a = GSM.replace(short_request_tokens=0)
    b = a.replace(smooth_strength=0.1, window_size=6, target_layers=[0])
    eng = Engine(tiny, max_batch=3, max_len=MAX_LEN, gsm=a, eos_ids=[])
    eng.warmup([16])
    compile_events.install()
    before = compile_events.count()
    picks = [a, b, None, b, a, None]
    reqs = [Request(r.prompt, r.max_new_tokens, request_id=r.request_id, gsm=g)
            for r, g in zip(requests, picks, strict=True)]
    recs = eng.run(reqs)
    assert compile_events.count() == before, compile_events.recent(3)
    for req, rec, g in zip(requests, recs, picks, strict=True):
        ref = gsm_jax.generate_tokens(tiny, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[], gsm=g, request_ids=[req.request_id])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(req.request_id))
        assert rec.gsm == (g is not None)


def test_protect_first_change_waits_for_smoothed_rows(tiny):
    """protect_first is one value per batch: a request whose config changes it is admitted
    once the smoothed rows of the old value are done (unsmoothed ones do not hold it)."""
    a = GSM.replace(short_request_tokens=0, protect_first=1)
    b = a.replace(protect_first=3)
    eng = Engine(tiny, max_batch=3, max_len=MAX_LEN, gsm=a, eos_ids=[])
    first = eng.submit(Request([5, 6, 7], 6, gsm=a))
    eng.submit(Request([5, 6, 7], 20, gsm=None))
    second = eng.submit(Request([5, 6, 7], 3, gsm=b))
    while eng.has_work:
        eng.step()
    assert second.admitted >= first.finish
    with pytest.raises(GSMConfigError, match="ring"):  # window 4: ring of 8 rows compiled
        eng.submit(Request([5], 2, gsm=a.replace(window_size=16)))
    eng.submit(Request([5], 2, gsm=a.replace(max_window=32)))  # max_window alone is no static


def test_ring_sized_for_the_windows_used(tiny):
    """The ring holds what the config's windows can reach up to max_len (window 4: 8 rows,
    not max_window's 64); adaptive windows clamped by max_window need exactly it."""
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[])
    assert eng.gsm_static[0] == 8 and eng._cache.rings[0].shape[2] == 8
    adaptive = GSM.replace(window_size="adaptive", max_window=64)
    eng.check_gsm(adaptive)  # max_len 48: adaptive windows reach 4, fit 8 rows
    big = Engine(tiny, max_batch=1, max_len=256, gsm=adaptive, eos_ids=[])
    assert big.gsm_static[0] == 16  # 256 // 16
    with pytest.raises(GSMConfigError, match="exactly 8"):
        big.check_gsm(adaptive.replace(max_window=8))
    assert Engine(tiny, max_batch=1, max_len=MAX_LEN, gsm=GSM, gsm_ring=32,
                  eos_ids=[]).gsm_static[0] == 32


def _penalized_reference(params, prompt, n, freq=0.0, pres=0.0, rep=1.0, bias=None):
    """Greedy decoding with the penalties applied to `gsm_jax.forward`'s teacher-forced
    logits in numpy (an independent re-statement of OpenAI's and vLLM's formulas)."""
    tokens: list[int] = []
    v = params.config.vocab_size
    for _ in range(n):
        logits = np.asarray(gsm_jax.forward(params, [list(prompt) + tokens]))[0, -1]
        logits = logits.astype(np.float64)
        for t, b in (bias or {}).items():
            logits[t] += b
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=v)
        hit = np.isin(np.arange(v), prompt) | (counts > 0)
        logits = np.where(hit, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - freq * counts - pres * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens


def test_a_slot_forgets_its_previous_requests_penalties(tiny, requests):
    """The penalty counters live on the device, one row per slot: a plain request admitted
    into the slot a biased request left decodes as plain greedy, even beside a penalized
    row (whose presence turns the penalty step on for the whole batch)."""
    base = requests[2]
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[])
    biased = eng.run([Request(base.prompt, 4, logit_bias={7: 50.0})])[0]
    assert biased.tokens == [7] * 4 and biased.slot == 0
    plain, other = eng.run([Request(base.prompt, 10), Request(base.prompt, 10,
                                                              frequency_penalty=0.5)])
    assert plain.slot == 0
    assert plain.tokens == _penalized_reference(tiny, base.prompt, 10)
    assert other.tokens == _penalized_reference(tiny, base.prompt, 10, freq=0.5)


def test_penalties_and_logit_bias_equal_the_reference(tiny, requests):
    """Rows with different penalties and an unpenalized row share a batch: each equals its
    own numpy reference, the plain row equals plain greedy; a -100 bias bans a token."""
    plain, base = requests[0], requests[2]
    cases = [dict(freq=0.8, pres=0.4), dict(rep=1.6), dict(bias={7: 6.0, 11: -100.0}),
             dict(freq=-0.5, rep=0.7, bias={9: 2.0})]
    reqs = [Request(base.prompt, 10, request_id=f"p{i}", frequency_penalty=c.get("freq", 0.0),
                    presence_penalty=c.get("pres", 0.0),
                    repetition_penalty=c.get("rep", 1.0), logit_bias=c.get("bias"))
            for i, c in enumerate(cases)] + [Request(plain.prompt, 10, request_id="plain")]
    recs = Engine(tiny, max_batch=3, max_len=MAX_LEN, eos_ids=[]).run(reqs)
    unpenalized = _penalized_reference(tiny, base.prompt, 10)
    for rec, c in zip(recs[:4], cases, strict=True):
        want = _penalized_reference(tiny, base.prompt, 10, **c)
        assert rec.tokens == want, (c, rec.tokens, want)
    assert any(rec.tokens != unpenalized for rec in recs[:4])  # the penalties did something
    assert 11 not in recs[2].tokens
    assert recs[4].tokens == gsm_jax.generate_tokens(tiny, [plain.prompt], max_new_tokens=10,
                                                     eos_ids=[])[0].tolist()


@pytest.mark.parametrize("field,value,match", [
    ("frequency_penalty", 2.5, "frequency_penalty"), ("presence_penalty", -3, "presence_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("logit_bias", {64: 1.0}, "token id 64"),
    ("logit_bias", {5: 101.0}, r"logit_bias\[5\]")])
def test_bad_penalties_are_named(tiny, field, value, match):
    eng = Engine(tiny, max_batch=1, max_len=MAX_LEN, eos_ids=[])
    with pytest.raises(InvalidInputError, match=match):
        eng.submit(Request([5, 6], 2, **{field: value}))


def test_running_state_is_made_while_the_programs_build(tiny, requests, monkeypatch):
    """The engine's running state (cache, penalty counters, token feed) is made on a worker
    thread: the constructor returns and the programs build from its shapes while it is
    still being made (a large cache takes seconds to fill); the first read waits for it,
    and the engine then serves exactly as one whose state was ready at once. A failure
    to make it surfaces at that first read, naming the error."""
    import threading

    from gsm_jax.serving import programs

    real = programs.fresh_state
    gate = threading.Event()

    def held(*args):  # the worker thread's call waits; shape tracing does not
        if threading.current_thread().name == "gsm-jax-fresh-state":
            assert gate.wait(60)
        return real(*args)

    monkeypatch.setattr(programs, "fresh_state", held)
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[])
    assert eng._fresh is not None and not eng._fresh.done()
    eng.programs.compile(threads=1)  # every program built, the state still not made
    assert eng.programs.compiled == len(eng.programs) and not eng._fresh.done()
    threading.Timer(0.2, gate.set).start()
    got = eng.run(requests)  # waits for the state
    monkeypatch.setattr(programs, "fresh_state", real)
    want = Engine(tiny, max_batch=2, max_len=MAX_LEN, gsm=GSM, eos_ids=[]).run(requests)
    assert [r.tokens for r in got] == [r.tokens for r in want]

    def broken(*args):
        if threading.current_thread().name == "gsm-jax-fresh-state":
            raise MemoryError("no room for the cache")
        return real(*args)

    monkeypatch.setattr(programs, "fresh_state", broken)
    eng = Engine(tiny, max_batch=2, max_len=MAX_LEN, eos_ids=[])
    with pytest.raises(MemoryError, match="no room for the cache"):
        eng.run(requests[:1])


def test_kv_pool_of_pages_bounds_what_runs(tiny):
    """The KV cache is a pool of pages: with 3 pages of 128 slots and 4 slots, the
    fourth one-page request waits for a page although a slot is free; a two-page
    request waits for two. Every output equals `generate_tokens` alone, and every page
    is free at the end."""
    rng = np.random.default_rng(5)
    shapes = [(20, 30), (9, 40), (60, 12), (5, 25), (150, 10), (7, 8)]
    reqs = [Request(rng.integers(4, 64, size=n).tolist(), m, request_id=f"p{i}")
            for i, (n, m) in enumerate(shapes)]
    eng = Engine(tiny, max_batch=4, max_len=256, eos_ids=[], prefill_chunk=64,
                 kv_cache_tokens=3 * 128)
    assert eng.paged == (3, 128) and eng.kv_cache_tokens == 384
    assert eng._cache.k[0].shape[0] == 3 and eng._cache.pages.shape == (4, 2)
    recs = [eng.submit(r) for r in reqs]
    waited_with_a_free_slot = False
    while eng.has_work:
        eng.step()
        held = sum(len(p) for p in eng._slot_pages)
        assert held + len(eng._free_pages) == 3 and sorted(
            eng._free_pages + [q for p in eng._slot_pages for q in p]) == [0, 1, 2]
        assert eng.kv_usage == pytest.approx(held / 3)
        if eng.waiting and eng.num_active + (eng._prefilling is not None) < eng.max_batch:
            waited_with_a_free_slot = True
    assert waited_with_a_free_slot
    assert eng.kv_usage == 0.0 and not any(eng._slot_pages)
    for req, rec in zip(reqs, recs, strict=True):
        ref = gsm_jax.generate_tokens(tiny, [req.prompt], max_new_tokens=req.max_new_tokens,
                                      eos_ids=[])[0]
        np.testing.assert_array_equal(np.asarray(rec.tokens), ref, err_msg=str(rec.request_id))


def test_kv_pool_size_and_release(tiny):
    """The pool's default holds every slot's max_len (a small model: under 2 GiB); a pool
    smaller than one max_len request is refused by name; an aborted prefill gives its
    pages back."""
    eng = Engine(tiny, max_batch=2, max_len=256, eos_ids=[], prefill_chunk=16)
    assert eng.paged == (4, 128) and eng.kv_cache_tokens == 2 * 256
    for bad in (100, 0, True, 2.5):
        with pytest.raises(InvalidInputError, match="kv_cache_tokens"):
            Engine(tiny, max_batch=2, max_len=256, kv_cache_tokens=bad)
    rec = eng.submit(Request(list(range(4, 60)), 100))  # 156 tokens: 2 pages
    eng.step()  # its first chunk of 16
    assert eng._prefilling is not None and eng.kv_usage == 0.5
    assert eng.abort(rec)
    assert eng.kv_usage == 0.0 and len(eng._free_pages) == 4
