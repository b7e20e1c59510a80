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

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

import gsm_jax.chat_formats as cf
from gsm_jax.tokenizer import Tokenizer

recipe = pytest.importorskip("deepseek_recipe")

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
