"""DeepSeek-V4 / V4.1 chat in the models' own format (gsm_jax.chat_formats), checked against
DeepSeek's own `deepseek-recipe` package (a test dependency): identical prompt strings and
token ids on the research note's worked examples and on generated conversations; and the
server's split of the output at `</think>` through the real app with a tiny DeepSeek-V4.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import deepseek_recipe as recipe  # noqa: E402  (a declared test dependency)
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

import gsm_jax.chat_formats as cf
from gsm_jax.tokenizer import Tokenizer

SPECIALS = [cf.BOS, cf.EOS, "<｜▁pad▁｜>", cf.SYSTEM, cf.USER, cf.ASSISTANT, cf.THINK,
            cf.THINK_END, "｜DSML｜", "<｜latest_reminder｜>", "<｜deepseek_image｜>"]
CORPUS = ("Hello there! What is 2+2? The answer is four. Reasoning Effort: Absolute maximum "
          "with no shortcuts permitted. You MUST be very thorough in your thinking, range 1-100, "
          "the higher the value, the more thorough the reasoning. Beyond maximum — exhaustive. "
          "Now answer briefly. 数学 ünïcödé\n\n  tabs\tand newlines\n") * 4
WORDS = ["Hi", "Hello", "2+2?", "four", " spaced ", "line\nbreak", "\n\n", "数学", "é",
         "</think>", "<think>", "<｜User｜>", "<｜end▁of▁sentence｜>", "x" * 7, "Now answer.",
         "  ", "\t", "42", "Reasoning Effort: 3", "🙂"]


def _write_tokenizer(root: Path, model_type: str) -> Path:
    """A tiny byte-level BPE with the note's special tokens (BOS 0, EOS 1, pad 2)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS], trainer=trainer)
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": cf.BOS, "eos_token": cf.EOS, "pad_token": "<｜▁pad▁｜>",
         "add_bos_token": False, "add_eos_token": False}))
    (root / "config.json").write_text(json.dumps({"model_type": model_type, "eos_token_id": 1,
                                                  "bos_token_id": 0}))
    return root


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def fmt(request, tmp_path_factory):
    """(format, our tokenizer, recipe encoding with the same tokenizer.json)."""
    root = _write_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    ours = Tokenizer.from_hf_dir(root)
    assert ours.chat_format == request.param
    enc = (recipe.DeepseekV4Encoding() if request.param == "deepseek_v4"
           else recipe.DeepseekV41Encoding())
    enc = enc.with_tokenizer(recipe.Tokenizer.from_file(str(root / "tokenizer.json")))
    return request.param, ours, enc


def _recipe_conv(messages, thinking, effort):
    out = []
    for m in messages:
        role, c = m["role"], m["content"]
        if role in ("system", "developer"):
            out.append(recipe.SystemMessage(c))
        elif role == "user":
            out.append(recipe.UserMessage(c))
        else:
            out.append(recipe.AssistantMessage(c, reasoning_content=m.get("reasoning_content")))
    return recipe.Conversation(out, thinking_mode=thinking, reasoning_effort=effort)


def _check(fmt, messages, thinking, effort):
    name, tok, enc = fmt
    conv = _recipe_conv(messages, thinking, effort)
    want = enc.render_conversation(conv).prompt
    got = tok.apply_chat_template(messages, thinking=thinking, reasoning_effort=effort)
    assert got == want, (messages, thinking, effort)
    assert tok.encode_chat(messages, thinking=thinking, reasoning_effort=effort) == \
        enc.encode(conv), (messages, thinking, effort)


WORKED = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello", "reasoning_content": "Greeting."},
          {"role": "user", "content": "2+2?"}]


def test_effort_paragraphs_are_the_releases():
    # sha256 prefixes/suffixes from the research note (476 and 526 characters)
    for text, n, head, tail in ((cf._V4_HIGH, 476, "f7a24f3b", "350f7"),
                                (cf._V4_MAX, 526, "53fb31b8", "55d2c")):
        h = hashlib.sha256(text.encode()).hexdigest()
        assert len(text) == n and h.startswith(head) and h.endswith(tail)


def test_worked_examples_of_the_note(fmt):
    name, tok, _ = fmt
    # the note's §8 strings, literally
    pre = "<｜begin▁of▁sentence｜>" + ("<｜System｜>" if name == "deepseek_v41" else "")
    rest = ("<｜User｜>Hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜><｜User｜>2+2?"
            "<｜Assistant｜>")
    assert tok.apply_chat_template(WORKED, thinking=False) == pre + "S" + rest + "</think>"
    if name == "deepseek_v4":
        assert tok.apply_chat_template(WORKED, reasoning_effort="low") == \
            pre + "S" + rest + "<think>"
        assert tok.apply_chat_template(WORKED) == pre + cf._V4_HIGH + "S" + rest + "<think>"
        assert tok.apply_chat_template(WORKED, reasoning_effort="max") == \
            pre + cf._V4_MAX + "S" + rest + "<think>"
    else:
        line = ("Reasoning Effort: {} (range 1-100, the higher the value, the more thorough "
                "the reasoning)\n\n")
        assert tok.apply_chat_template(WORKED) == pre + line.format(75) + "S" + rest + "<think>"
        assert tok.apply_chat_template(WORKED, reasoning_effort="max") == \
            pre + line.format(100) + "S" + rest + "<think>"
    for thinking in (False, True):
        for effort in (None, "low", "high", "xhigh", "max"):
            _check(fmt, WORKED, thinking, effort)


def _random_conversation(rng: random.Random) -> list[dict]:
    def text():
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))

    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": text()})
    for _ in range(rng.randint(0, 4)):
        msgs.append({"role": "user", "content": text()})
        if rng.random() < 0.2:
            msgs.append({"role": "user", "content": text()})
        if rng.random() < 0.2:
            msgs.append({"role": "system", "content": text()})
        msgs.append({"role": "assistant", "content": text(),
                     "reasoning_content": text() if rng.random() < 0.7 else None})
    msgs.append({"role": "user", "content": text()})
    return msgs


@pytest.mark.parametrize("seed", range(6))
def test_generated_conversations_equal_the_recipe(fmt, seed):
    rng = random.Random(seed)
    for _ in range(25):
        msgs = _random_conversation(rng)
        for thinking in (False, True):
            _check(fmt, msgs, thinking, rng.choice([None, "low", "high", "xhigh", "max"]))


def test_each_effort_level_and_api_names(fmt):
    name, tok, enc = fmt
    msgs = WORKED[1:]  # no system message: V4.1's effort line stands alone
    for effort in ("low", "high", "xhigh", "max"):
        for m in (WORKED, msgs):
            _check(fmt, m, True, effort)
    # the API's names, as the recipe's Chat Completions conversion maps them
    options = recipe.ConversionOptions()
    model = "DeepSeek-V4-Pro" if name == "deepseek_v4" else "DeepSeek-V4.1-Flash"
    for effort in ("minimal", "low", "medium", "high", "xhigh", "max", "ultra", "none"):
        req = recipe.ChatCompletionRequest({"model": model, "messages": WORKED,
                                            "reasoning_effort": effort}).convert(options)
        assert tok.encode_chat(WORKED, reasoning_effort=effort) == \
            enc.encode(req.conversation), effort


def test_numeric_effort_v41(fmt):
    name, tok, enc = fmt
    if name == "deepseek_v4":
        with pytest.raises(cf.ChatFormatError, match="reasoning_effort"):
            tok.apply_chat_template(WORKED, reasoning_effort=30)
        return
    named = {50: "low", 75: "high", 100: "max"}
    for n, level in named.items():
        assert tok.encode_chat(WORKED, reasoning_effort=n) == \
            tok.encode_chat(WORKED, reasoning_effort=level)
        _check(fmt, WORKED, True, level)
    # any other N: the recipe (named levels only) renders the same effort line when it is
    # handed as the first system text in chat mode; only the last token (</think>) differs
    think = tok.backend.token_to_id(cf.THINK)
    for n in (1, 37, 99):
        for msgs in (WORKED, WORKED[1:]):
            line = cf._effort_text("deepseek_v41", n)
            first = msgs[0]["content"] if msgs[0]["role"] == "system" else ""
            sys_msg = [{"role": "system", "content": line + first}]
            as_chat = sys_msg + (msgs[1:] if msgs[0]["role"] == "system" else msgs)
            conv = _recipe_conv(as_chat, False, None)
            want = enc.encode(conv)[:-1] + [think]
            assert tok.encode_chat(msgs, reasoning_effort=n) == want
            assert tok.apply_chat_template(msgs, reasoning_effort=n) == \
                enc.render_conversation(conv).prompt[:-len(cf.THINK_END)] + cf.THINK
    for bad in (0, 101, True, "huge", 2.5):
        with pytest.raises(cf.ChatFormatError, match="reasoning_effort"):
            tok.apply_chat_template(WORKED, reasoning_effort=bad)


def test_eos_is_a_stop_id_and_pickle_keeps_the_format(fmt):
    import pickle

    name, tok, _ = fmt
    assert tok.backend.token_to_id(cf.EOS) in tok.eos_ids
    again = pickle.loads(pickle.dumps(tok))
    assert again.chat_format == name
    assert again.encode_chat(WORKED) == tok.encode_chat(WORKED)


def test_a_vocabulary_without_the_format_tokens_has_no_chat_format(tmp_path):
    from tokenizers import Tokenizer as Raw

    raw = Raw(models.WordLevel(vocab={"<s>": 0, "</s>": 1, "a": 2}, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                                "eos_token": "</s>"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_format is None and tok.eos_ids == (1,)


def test_reasoning_splitter_streams_like_one_shot():
    text = "<think>2 plus 2 is 4.</think>2 + 2 = 4."
    assert cf.ReasoningSplitter(True).feed(text, final=True) == ("2 plus 2 is 4.", "2 + 2 = 4.")
    assert cf.ReasoningSplitter(False).feed(text, final=True) == ("", text)
    assert cf.ReasoningSplitter(True).feed("no end </thi", final=True) == ("no end </thi", "")
    rng = random.Random(0)
    for _ in range(200):
        s = rng.choice([text, text[7:], "a</think>b</think>c", "</think>x", "<thi", "r</th"])
        cuts = sorted(rng.sample(range(len(s) + 1), rng.randint(0, min(5, len(s)))))
        sp, r, c = cf.ReasoningSplitter(True), "", ""
        for a, b in zip([0, *cuts], [*cuts, len(s)], strict=True):
            dr, dc = sp.feed(s[a:b])
            r, c = r + dr, c + dc
        dr, dc = sp.feed("", final=True)
        assert (r + dr, c + dc) == cf.ReasoningSplitter(True).feed(s, final=True), (s, cuts)


# ----------------------------------------------------------------------------- server


def _swap_ids(root: Path, a: str, b_id: int) -> None:
    """Give token `a` the id `b_id` and the token that had it `a`'s id (tokenizer.json)."""
    data = json.loads((root / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a_id = vocab[a]
    b = next(t for t, i in vocab.items() if i == b_id)
    vocab[a], vocab[b] = b_id, a_id
    for t in data["added_tokens"]:
        if t["content"] == a:
            t["id"] = b_id
    (root / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))


def test_server_splits_reasoning_and_stops_at_eos(tmp_path):
    """A tiny random DeepSeek-V4 behind the real app. Its greedy continuation is found first;
    then the tokenizer gives `</think>` the id it emits at step 3 and EOS a later one, so the
    reply is reasoning, `</think>`, answer, EOS: one non-streamed and one streamed request
    split it and stop at EOS."""
    import jax
    from fastapi.testclient import TestClient
    from tiny_models import tiny_dsv4

    import gsm_jax
    from gsm_jax.generation import generate_tokens
    from gsm_jax.models import deepseek_v4 as dv
    from gsm_jax.params import ModelParams
    from gsm_jax.serving.app import GSMServer, HTTPError, ServerOptions, build_app
    from gsm_jax.serving.protocol import ChatRequest

    root = _write_tokenizer(tmp_path / "tok", "deepseek_v4")
    tok = Tokenizer.from_hf_dir(root)
    cfg = dataclasses.replace(tiny_dsv4().config, vocab_size=tok.vocab_size, eos_token_ids=(1,))
    params = ModelParams(dv.init_weights(cfg, jax.random.key(3)), cfg, tok, source="tiny")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    prompt = tok.encode_chat(messages, reasoning_effort="low")
    out = [int(t) for t in generate_tokens(params, [prompt], max_new_tokens=10)[0]]
    # generate(chat=...) renders the same prompt (one user message, no system)
    user_only = tok.encode_chat(messages[1:], reasoning_effort="low")
    assert gsm_jax.generate(params, "Hi", chat={"reasoning_effort": "low"}, max_new_tokens=4) \
        == [tok.decode(generate_tokens(params, [user_only], max_new_tokens=4)[0])]
    n_special = len(SPECIALS)
    k = 3
    assert all(t >= n_special for t in out[:k + 1]), out  # plain text up to the split
    assert out[k] not in out[:k] and out[k] not in prompt, out
    # and EOS the id of a later new token: the reply must end there
    # (not after a cut UTF-8 sequence: the stream holds those back for bytes to come)
    end = next(m for m in range(k + 2, len(out)) if out[m] not in out[:m]
               and not tok.decode(out[k + 1:m]).endswith("\ufffd"))
    _swap_ids(root, cf.THINK_END, out[k])
    _swap_ids(root, cf.EOS, out[end])
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "eos_token_id": out[end]}))
    tok = Tokenizer.from_hf_dir(root)
    assert tok.eos_ids == (out[end],)
    assert tok.encode_chat(messages, reasoning_effort="low") == prompt
    cfg = dataclasses.replace(cfg, eos_token_ids=tok.eos_ids)
    params = dataclasses.replace(params, config=cfg, tokenizer=tok)
    think_end = tok.backend.token_to_id(cf.THINK_END)

    def text(ids):  # `</think>` is written out even though it is a special token
        cuts = [-1, *(i for i, t in enumerate(ids) if t == think_end), len(ids)]
        pairs = zip(cuts, cuts[1:], strict=False)
        return cf.THINK_END.join(tok.decode(ids[a + 1:b]) for a, b in pairs)

    want_reasoning = text(out[:k])
    want_content = text(out[k + 1:end])

    server = GSMServer(ServerOptions(model="tiny-dsv4", max_batch=2, max_len=64,
                                     prefill_chunk=None, compile_gsm=False,
                                     warmup_lengths=(), warmup_sampling=False), params=params)
    body = {"model": "tiny-dsv4", "messages": messages, "max_tokens": 10, "temperature": 0,
            "reasoning_effort": "low"}
    with TestClient(build_app(server, load_in_background=False)) as client:
        assert server.status == "ready", server.error
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want_content,
                                     "reasoning_content": want_reasoning}
        assert choice["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == end + 1  # EOS counted

        reasoning = content = ""
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
        assert (reasoning, content) == (want_reasoning, want_content)

        # thinking off: no split, all content
        for off in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}}):
            r = client.post("/v1/chat/completions", json={**body, **off})
            assert r.json()["choices"][0]["message"]["reasoning_content"] is None
        # invalid efforts: 400 naming the field
        for bad in (30, "huge"):
            r = client.post("/v1/chat/completions", json={**body, "reasoning_effort": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"

    # a model without a reasoning chat format refuses the field
    plain = Tokenizer(tok.backend, bos_token=cf.BOS, eos_token=cf.EOS, chat_template="x")
    other = GSMServer(ServerOptions(model="m"), params=ModelParams(None, cfg, plain, "m"))
    with pytest.raises(HTTPError) as e:
        other._chat_options(ChatRequest.model_validate(
            {"model": "m", "messages": messages, "reasoning_effort": "high"}))
    assert e.value.status == 400 and e.value.param == "reasoning_effort"
