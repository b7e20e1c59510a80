"""What vLLM users send to the server: log-probabilities (`echo` + `logprobs` on
completions, `logprobs` / `top_logprobs` on chat, streamed per chunk), `/v1/models/{id}`,
`chatcmpl-` ids, and a 400 naming every field the server does not implement.

The reference for every log-probability is the log-softmax of `gsm_jax.forward(...)`
(computed on the host in f64) over prompt + output with the server's GSM config and
the request's id (so the same rollout decides whether the row is smoothed), to 1e-4.
The engine is another path (prefill + decode steps): greedy outputs must be the
reference's argmax, which ties what the server reports to what it generated.

One in-process server (uvicorn on a loopback port, in a thread) over conftest's tiny
random Llama with a character tokenizer; GSM is rolled out to half of the request ids,
so a request's `x-request-id` picks its arm.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

import gsm_jax
from gsm_jax.config import rollout_value
from gsm_jax.params import ModelParams
from gsm_jax.serving.app import GSMServer, ServerOptions, build_app

NAME = "tiny-chars"
SPECIALS = ["<unk>", "<s>", "<pad>", "</s>"]  # </s> = 3, the tiny Llama's EOS
CHARS = list(" \nabcdefghijklmnopqrstuvwxyz0123456789.,:?!'ABCDEFGHIJKLMNOP")
GSM = {"enable": True, "target_layers": "all", "smooth_strength": 0.3, "window_size": 4,
       "rollout_fraction": 0.5}
MAX_LEN = 64
_VOCAB = {t: i for i, t in enumerate(SPECIALS + CHARS)}
TOL = 1e-4  # f32 log-softmax of the same weights through two compiled programs


def _char_tokenizer():
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from gsm_jax.tokenizer import Tokenizer

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    assert len(vocab) == 64
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    template = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}a:{% endif %}")
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                     unk_token="<unk>", chat_template=template, name="chars")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    import uvicorn

    params = ModelParams(tiny_llama.weights, tiny_llama.config, _char_tokenizer(), NAME)
    gsm_file = tmp_path_factory.mktemp("compat") / "gsm.json"
    gsm_file.write_text(json.dumps(GSM))
    server = GSMServer(ServerOptions(model=NAME, max_batch=4, max_len=MAX_LEN,
                                     prefill_chunk=None, gsm=str(gsm_file),
                                     warmup_lengths=(32,), warmup_sampling=False), params)
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert server.status != "failed", server.error
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not become healthy in 120 s"
        time.sleep(0.1)
    yield url, params
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def params(served):
    return served[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _rid(arm: str, tag: str) -> str:
    """A request id the rollout puts in `arm` ("gsm" or "control")."""
    for i in range(1000):
        rid = f"{tag}-{i}"
        if (rollout_value(rid) < GSM["rollout_fraction"]) == (arm == "gsm"):
            return rid
    raise AssertionError("no id found")


def _ref(params, ids: list[int], rid: str) -> np.ndarray:
    """log p [len(ids), V] by the reference: the log-softmax (jax.nn.log_softmax's, in f64
    on the host: no program per length) of gsm_jax.forward with the server's GSM config
    and this request's id (its rollout decides the row, as on the server)."""
    cfg = gsm_jax.GSMConfig(**GSM)
    logits = np.asarray(gsm_jax.forward(params, [ids], gsm=cfg, request_ids=[rid])[0],
                        np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _ids(token_strings: list[str]) -> list[int]:
    """Token ids of the server's token strings (the character vocabulary is one-to-one)."""
    return [_VOCAB[s] for s in token_strings]


def _check_completion_logprobs(lp, ids: list[int], ref: np.ndarray, k: int,
                               first: int) -> None:
    """`lp` (OpenAI completions format) scores ids[first:] as `ref` does."""
    n = len(ids) - first
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for j in range(n):
        pos = first + j
        if pos == 0:  # nothing before the first prompt token
            assert lp.token_logprobs[j] is None and lp.top_logprobs[j] is None
            continue
        row = ref[pos - 1]
        assert lp.token_logprobs[j] == pytest.approx(row[ids[pos]], abs=TOL)
        top = lp.top_logprobs[j]  # the chosen token and the k most likely
        assert lp.tokens[j] in top and len(top) in (k, k + 1)
        assert {_VOCAB[s] for s in top} >= {int(i) for i in np.argsort(-row)[:k]}
        for s, v in top.items():
            assert v == pytest.approx(row[_VOCAB[s]], abs=TOL)


# ----------------------------------------------------------------------------- echo


@pytest.mark.parametrize("arm", ["control", "gsm"])
def test_echo_scores_the_prompt_like_forward(client, params, arm):
    """What lm-evaluation-harness's `local-completions` sends: token-id prompts, echo,
    logprobs, max_tokens 0 (the prompt alone) or 1; GSM off (control) and on."""
    rid = _rid(arm, "echo")
    prompts = [params.tokenizer.encode("the quick brown fox jumps over"),
               params.tokenizer.encode("a lazy dog, 42 times!")]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=0, echo=True,
                                    logprobs=5, temperature=0,
                                    extra_headers={"x-request-id": rid})
    assert out.model_extra["gsm"]["arm"] == arm
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 0
    for ids, choice in zip(prompts, out.choices, strict=True):
        assert choice.text == params.tokenizer.decode(ids) and choice.finish_reason == "length"
        _check_completion_logprobs(choice.logprobs, ids, _ref(params, ids, rid), 5, 0)

    one = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=1, echo=True,
                                    logprobs=1, temperature=0,
                                    extra_headers={"x-request-id": rid})
    lp = one.choices[0].logprobs
    seq = prompts[0] + _ids(lp.tokens[len(prompts[0]):])
    assert len(seq) == len(prompts[0]) + 1
    ref = _ref(params, seq, rid)
    _check_completion_logprobs(lp, seq, ref, 1, 0)
    assert seq[-1] == int(np.argmax(ref[-2]))  # the engine's greedy token is forward's argmax
    if arm == "gsm":  # the check can tell GSM on from off
        assert np.abs(ref - _ref(params, seq, _rid("control", "echo"))).max() > 1e-3


# ----------------------------------------------------------------------------- generated


def test_generated_tokens_logprobs_greedy_sampled_chat(client, params):
    rid = _rid("gsm", "gen")
    prompt = "hello there, how are"
    ids = params.tokenizer.encode(prompt)
    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, logprobs=3,
                                       temperature=0, extra_headers={"x-request-id": rid})
    assert greedy.model_extra["gsm"]["arm"] == "gsm"
    lp = lp_greedy = greedy.choices[0].logprobs
    seq = ids + _ids(lp.tokens)
    assert len(lp.tokens) == greedy.usage.completion_tokens >= 1
    ref = _ref(params, seq, rid)
    _check_completion_logprobs(lp, seq, ref, 3, len(ids))
    assert seq[len(ids):] == [int(t) for t in ref[len(ids) - 1:-1].argmax(-1)]

    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, logprobs=2,
                                        temperature=1.0, seed=7,
                                        extra_headers={"x-request-id": rid})
    lp = sampled.choices[0].logprobs
    seq = ids + _ids(lp.tokens)
    _check_completion_logprobs(lp, seq, _ref(params, seq, rid), 2, len(ids))

    chat_rid = _rid("control", "chat")
    messages = [{"role": "user", "content": "what is two plus two?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_headers={"x-request-id": chat_rid})
    assert chat.id.startswith("chatcmpl-")
    content = chat.choices[0].logprobs.content
    chat_ids = params.tokenizer.encode_chat(messages)
    seq = chat_ids + _ids([c.token for c in content])
    ref = _ref(params, seq, chat_rid)
    for j, c in enumerate(content):
        row = ref[len(chat_ids) + j - 1]
        assert c.logprob == pytest.approx(row[seq[len(chat_ids) + j]], abs=TOL)
        assert c.bytes == list(c.token.encode())
        assert [_VOCAB[t.token] for t in c.top_logprobs] == list(np.argsort(-row)[:2])
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs],
                                   np.sort(row)[::-1][:2], atol=TOL)
    assert seq[len(chat_ids):] == [int(t) for t in ref[len(chat_ids) - 1:-1].argmax(-1)]

    # streamed: every token's entry exactly once across the chunks, equal to the above
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_headers={"x-request-id": chat_rid}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [c.logprob for c in content],
                               atol=1e-6)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content

    echo_chunks = list(client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, echo=True, logprobs=1, temperature=0,
        stream=True, extra_headers={"x-request-id": rid}))
    parts = [ch.choices[0].logprobs for ch in echo_chunks if ch.choices[0].logprobs]
    merged = SimpleNamespace(**{key: [x for p in parts for x in getattr(p, key)] for key in
                                ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
    seq = _ids(merged.tokens)
    n_out = len(seq) - len(ids)
    assert seq[:len(ids)] == ids and 1 <= n_out <= 6
    assert seq[len(ids):] == _ids(lp_greedy.tokens)[:n_out]  # the greedy tokens above
    _check_completion_logprobs(merged, seq, _ref(params, seq, rid), 1, 0)
    assert "".join(ch.choices[0].text for ch in echo_chunks).startswith(prompt)

    # a plain stream of two choices (no log-probabilities): each choice's text is the above
    plain = list(client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, n=2, temperature=0, stream=True,
        extra_headers={"x-request-id": rid}))
    for i in range(2):
        assert "".join(ch.choices[0].text for ch in plain if ch.choices[0].index == i) \
            == greedy.choices[0].text
    assert all(ch.choices[0].logprobs is None for ch in plain)


# ----------------------------------------------------------------------------- models, ids


def test_models_by_id_and_response_ids(client, url):
    assert client.models.retrieve(NAME).id == NAME
    r = httpx.get(f"{url}/v1/models/not-this-one", timeout=30)
    assert r.status_code == 404 and "'not-this-one'" in r.json()["error"]["message"]
    out = client.completions.create(model=NAME, prompt="abcdefghijklmnopqrs", max_tokens=2,
                                    temperature=0)
    assert out.id.startswith("cmpl-") and out.choices[0].logprobs is None
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"x-request-id": "abc"},
                   json={"model": NAME, "max_tokens": 2,
                         "messages": [{"role": "user", "content": [
                             {"type": "text", "text": "tell me"},
                             {"type": "text", "text": "a story"}]}]})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc", r.text
    assert r.headers["x-request-id"] == "abc"


def test_tokenizer_endpoints(url, params):
    """vLLM's /tokenize (prompt, with or without BOS; chat messages as the chat endpoint
    renders them), /detokenize and /tokenizer_info (what lm-evaluation-harness's
    local-completions probes for); bad bodies are 400 naming the problem, another model 404."""
    tok = params.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello there"}, timeout=30)
    assert r.status_code == 200 and r.json() == {
        "count": len(tok.encode("hello there")), "max_model_len": MAX_LEN,
        "tokens": tok.encode("hello there")}
    r = httpx.post(f"{url}/tokenize", json={"model": NAME, "prompt": "hello",
                                           "add_special_tokens": False}, timeout=30)
    assert r.json()["tokens"] == tok.encode("hello", add_bos=False)
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30)
    assert r.json()["tokens"] == tok.encode_chat(msgs)  # what /v1/chat/completions sends
    ids = tok.encode("a lazy dog")
    r = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200 and r.json() == {
        "prompt": tok.decode(ids, skip_special_tokens=False)}
    info = httpx.get(f"{url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == MAX_LEN
    for path, body, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "colour": "red"}, "colour"),
            ("/detokenize", {"tokens": [1, 10_000]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "a"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------------------- refusals


REFUSED = [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content[1].type"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
    # penalties and logit_bias are implemented: out of range or not a token id, a 400
    ("completion", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("completion", {"presence_penalty": -2.2}, "presence_penalty"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"64": 1}}, "logit_bias"),  # the tiny vocabulary is 64
    ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completion", {"min_p": 0.1}, "min_p"),
    ("completion", {"best_of": 3}, "best_of"),
    ("completion", {"suffix": "end"}, "suffix"),
    ("completion", {"min_tokens": 4}, "min_tokens"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
]


def test_logit_bias_and_penalties_through_the_server(client):
    """A +100 bias makes greedy pick that token every step; a -100 bias on the token greedy
    picked first makes it pick another one; penalties pass through (the engine's tests
    check their values against a reference)."""
    ask = dict(model=NAME, prompt="hello there", max_tokens=4, temperature=0)
    forced = client.completions.create(**ask, logit_bias={str(_VOCAB["z"]): 100})
    assert forced.choices[0].text == "zzzz"
    plain = client.completions.create(**ask).choices[0].text
    banned = client.completions.create(
        **ask, logit_bias={str(_VOCAB[plain[0]]): -100}).choices[0].text
    assert plain[0] not in banned
    penalized = client.completions.create(**ask, frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert len(penalized.choices[0].text) == 4


def test_unsupported_fields_are_refused_by_name(url):
    base = {"chat": {"model": NAME,
                     "messages": [{"role": "user", "content": "say hi to everyone"}],
                     "max_tokens": 2},
            "completion": {"model": NAME, "prompt": "hi", "max_tokens": 2}}
    path = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
    for kind, extra, field in REFUSED:
        r = httpx.post(url + path[kind], json={**base[kind], **extra}, timeout=30)
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field.split("[")[0] in err["message"], (field, err)
    # their neutral values change nothing: accepted
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "repetition_penalty": 1.0, "tools": [], "response_format": {"type": "text"}}
    r = httpx.post(url + path["chat"], json={**base["chat"], **neutral, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers, r.text
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'gsm_jax:unsupported_field_refusals_total{field="tools"' in metrics
