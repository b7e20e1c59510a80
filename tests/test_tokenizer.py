"""gsm_jax.tokenizer against transformers' tokenizer for the same GGUF."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from gsm_jax.errors import ModelNotFoundError, UnsupportedModelError
from gsm_jax.tokenizer import Tokenizer, byte_level_alphabet

N_LINES = 50

CHATS = [
    "What is the capital of France?",
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List 3 primes.\n\n1. two\n2. three"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Translate «café» to German — please. 😀"},
    ],
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return smollm2_gguf.tokenizer


@pytest.fixture(scope="module")
def wikitext_lines(shared_data_dir: Path) -> list[str]:
    path = shared_data_dir / "wikitext2_test.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path.read_text(encoding="utf-8").split("\n")


def _digits_reference(hf_tokenizer):
    """transformers' backend tokenizer with SmolLM2's original pre-tokenizer put back."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    ref = Backend.from_str(hf_tokenizer.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return ref


def test_wikitext_ids_and_text_match_transformers(tok, hf_tokenizer, wikitext_lines):
    lines = [line for line in wikitext_lines if line.strip()][:N_LINES]
    assert len(lines) == N_LINES
    for line in lines:
        ids = tok.encode(line)
        assert ids == hf_tokenizer.encode(line), line
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == line  # byte-level BPE round-trips exactly


def test_whole_wikitext_matches_smollm_pre_tokenizer(tok, hf_tokenizer, wikitext_lines):
    """On all of WikiText-2 we equal SmolLM2's own tokenizer.json (digits split first).

    transformers' GGUF loader has no "smollm" pre-tokenizer and uses plain GPT-2 splitting,
    which differs only where whitespace runs precede a digit (one WikiText line).
    """
    ref = _digits_reference(hf_tokenizer)
    for line in wikitext_lines:
        assert tok.encode(line) == ref.encode(line, add_special_tokens=False).ids, line


def test_digit_after_whitespace_run_follows_llama_cpp(tok):
    # llama.cpp's "smollm" pre-tokenizer isolates digits first, so "  " stays one piece.
    pieces = [tok.id_to_token(i) for i in tok.encode("a  1")]
    assert pieces == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_chat_template_matches_transformers(tok, hf_tokenizer, chat, add_generation_prompt):
    ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    # Chat 2 has "\n\n1." (whitespace run before a digit), where transformers' GGUF tokenizer
    # departs from SmolLM2's own; compare ids with the latter.
    ref = _digits_reference(hf_tokenizer)
    assert tok.encode(ours) == ref.encode(theirs, add_special_tokens=False).ids


def test_special_tokens_and_ids(tok, hf_tokenizer):
    assert tok.bos_id == hf_tokenizer.bos_token_id == 1
    # transformers' generate stops at config.eos_token_id only: <|im_end|> for this model.
    assert tok.eos_ids == (hf_tokenizer.eos_token_id,) == (2,)
    assert tok.id_to_token(tok.eos_ids[0]) == "<|im_end|>"
    assert tok.pad_id == hf_tokenizer.pad_token_id == 2
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.add_bos is False

    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2  # matched whole, not spelled out
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("Hi", add_bos=True) == [1, *tok.encode("Hi")]


def test_decode_accepts_arrays(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("Hello world")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "Hello world"


def test_hashable_by_identity_and_picklable(tok):
    assert hash(tok) == hash(tok) and tok == tok
    assert {tok: 1}[tok] == 1
    tok.apply_chat_template("warm the template cache")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone is not tok and clone != tok
    assert clone.encode("Pickled 42 times") == tok.encode("Pickled 42 times")
    assert clone.eos_ids == tok.eos_ids and clone.bos_id == tok.bos_id
    assert clone.apply_chat_template("hi") == tok.apply_chat_template("hi")


def test_from_hf_dir(tok, hf_tokenizer, tmp_path, wikitext_lines):
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.bos_id == tok.bos_id and loaded.eos_ids == tok.eos_ids
    assert loaded.pad_id == tok.pad_id and loaded.vocab_size == tok.vocab_size
    assert loaded.add_bos is False
    # The saved tokenizer.json is transformers' (plain GPT-2 splitting), so compare with it.
    for line in [line for line in wikitext_lines if line.strip()][:10]:
        assert loaded.encode(line) == hf_tokenizer.encode(line)
    for chat in CHATS:
        assert loaded.apply_chat_template(chat) == tok.apply_chat_template(chat)

    # generate() stops at generation_config.json's ids, which may be several.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_hf_dir(tmp_path).eos_ids == (2, 0)


def test_from_hf_dir_missing(tmp_path):
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")


def _tiny_fields(**overrides):
    """GGUF tokenizer metadata of a toy byte-level vocabulary: 256 bytes + 'ab' + <|end|>."""
    tokens = list(byte_level_alphabet().values()) + ["ab", "<|end|>"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    fields.update(overrides)
    return fields


def test_tiny_gguf_tokenizer_without_template():
    tiny = Tokenizer.from_gguf_fields(_tiny_fields(), source="tiny.gguf")
    ab = tiny.backend.token_to_id("ab")
    assert tiny.encode("ab<|end|>") == [ab, tiny.eos_ids[0]]
    assert tiny.bos_id is None and tiny.pad_id == tiny.eos_ids[0]
    assert tiny.decode(tiny.encode("abc é")) == "abc é"
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        tiny.apply_chat_template("hi")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("tokenizer.ggml.model", "bert", "tokenizer model 'bert'"),
        ("tokenizer.ggml.pre", "made-up", "pre-tokenizer 'made-up'"),
    ],
)
def test_unsupported_gguf_tokenizers(key, value, match):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        Tokenizer.from_gguf_fields(_tiny_fields(**{key: value}), source="tiny.gguf")
    assert "tiny.gguf" in str(info.value)


def test_duplicate_gguf_tokens_warn():
    fields = _tiny_fields()
    fields["tokenizer.ggml.tokens"] = [*fields["tokenizer.ggml.tokens"][:-1], "ab"]
    with pytest.warns(UserWarning, match="duplicate"):
        tiny = Tokenizer.from_gguf_fields(fields, source="dup.gguf")
    assert tiny.vocab_size == len(fields["tokenizer.ggml.tokens"])
