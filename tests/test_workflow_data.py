"""Dataset readers of the GSM workflow: WikiText-2 sequences and LAMBADA examples."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gsm_jax.errors import InvalidInputError
from gsm_jax.workflow import data


class ByteTokenizer:
    """A stand-in tokenizer: one token per UTF-8 byte."""

    add_bos = False
    bos_id = None
    eos_ids = (0,)

    def encode(self, text, add_bos=None):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def test_default_paths_are_the_packaged_data():
    root = data.repo_root()
    assert (root / "gsm_jax").is_dir()
    assert data.default_data_dir() == data.packaged_data_dir() == root / "gsm_jax" / "data"
    assert data.default_wikitext_path().name == "wikitext2_test.txt"


@pytest.mark.parametrize("text, context, target, sep", [
    ("I don't care about signs", "I don't care about", "signs", " "),
    ('he said "Nadia', 'he said "', "Nadia", ""),
    ("the army of\n\nPower", "the army of\n\n", "Power", ""),
    ("thought...Tess", "thought...", "Tess", ""),
    ("ends with a word  ", "ends with a", "word", " "),
])
def test_split_last_word(text, context, target, sep):
    ex = data.split_last_word(text)
    assert (ex.context, ex.target, ex.separator) == (context, target, sep)


def test_split_last_word_errors():
    for bad in ["", "   ", "no word at end!", "word"]:
        with pytest.raises(InvalidInputError):
            data.split_last_word(bad)


def test_load_lambada_files(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        data.load_lambada(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InvalidInputError, match="empty"):
        data.load_lambada(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(InvalidInputError, match="no examples"):
        data.load_lambada(blank)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b"}\nnot json\n')
    with pytest.raises(InvalidInputError, match=":2: not valid JSON"):
        data.load_lambada(bad)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"context {i} word{i}"}) + "\n"
                            for i in range(3)))
    exs = data.load_lambada(good)
    assert [e.target for e in exs] == ["word0", "word1", "word2"]
    assert len(data.load_lambada(good, limit=2)) == 2
    with pytest.raises(InvalidInputError, match="3 examples, but 5"):
        data.load_lambada(good, limit=5)


def test_as_lambada_examples():
    assert data.as_lambada_examples(None) is None
    exs = data.as_lambada_examples([("The cat sat on the", "mat"), "a full text here"])
    assert exs[0].target == "mat" and exs[1].target == "here"
    with pytest.raises(InvalidInputError):
        data.as_lambada_examples([])
    with pytest.raises(InvalidInputError, match="single-word"):
        data.as_lambada_examples([("ctx", "two words")])


def test_split_sequences():
    stream = np.arange(100, dtype=np.int32)
    s = data.split_sequences(stream, 10, 3)
    np.testing.assert_array_equal(s[1], np.arange(10, 20))
    e = data.split_sequences(stream, 10, 2, from_end=True)
    np.testing.assert_array_equal(e[-1], np.arange(90, 100))
    assert data.split_sequences(stream, 10).shape == (10, 10)
    b = data.split_sequences(stream, 10, 2, bos_id=7)
    assert (b[:, 0] == 7).all() and b[0, 1] == 1
    with pytest.raises(InvalidInputError, match="only 10 sequences of 10 tokens, but 11"):
        data.split_sequences(stream, 10, 11)
    with pytest.raises(InvalidInputError, match="seq_len"):
        data.split_sequences(stream, 1, 1)


def test_text_file_to_sequences(tmp_path):
    tok = ByteTokenizer()
    f = tmp_path / "t.txt"
    f.write_text("hello world\n\n  \nsecond line\n")
    seqs = data.load_wikitext_sequences(tok, f, seq_len=4, num_sequences=5)
    stream = np.frombuffer(b"hello world\nsecond line", np.uint8)
    np.testing.assert_array_equal(seqs.ravel(), stream[:20])
    with pytest.raises(InvalidInputError, match="but 7 were requested"):
        data.load_wikitext_sequences(tok, f, seq_len=4, num_sequences=7)
    empty = tmp_path / "e.txt"
    empty.write_text("")
    with pytest.raises(InvalidInputError, match="empty"):
        data.load_wikitext_sequences(tok, empty, seq_len=4)
    ws = tmp_path / "w.txt"
    ws.write_text("  \n\n ")
    with pytest.raises(InvalidInputError, match="no text"):
        data.load_wikitext_sequences(tok, ws, seq_len=4)
    with pytest.raises(InvalidInputError, match="does not exist"):
        data.load_wikitext_sequences(tok, tmp_path / "nope.txt", seq_len=4)
    with pytest.raises(InvalidInputError, match="tokenizer"):
        data.load_wikitext_sequences(None, f, seq_len=4)


def test_token_arrays_and_npy(tmp_path):
    arr = np.arange(24, dtype=np.int64).reshape(4, 6)
    out = data.as_token_sequences(arr, None, seq_len=99, num_sequences=2, from_end=True)
    np.testing.assert_array_equal(out, arr[2:])
    assert out.dtype == np.int32
    np.save(tmp_path / "t.npy", arr)
    np.testing.assert_array_equal(
        data.as_token_sequences(str(tmp_path / "t.npy"), None, seq_len=6, num_sequences=None), arr)
    with pytest.raises(InvalidInputError, match="vocabulary"):
        data.as_token_sequences(arr, None, seq_len=6, num_sequences=None, vocab_size=10)
    with pytest.raises(InvalidInputError, match="requested"):
        data.as_token_sequences(arr, None, seq_len=6, num_sequences=5)
    with pytest.raises(InvalidInputError, match="non-empty"):
        data.as_token_sequences(np.zeros((0, 3), int), None, seq_len=6, num_sequences=None)


def test_shared_data_files(shared_data_dir):
    exs = data.load_lambada(shared_data_dir / "lambada_dev.jsonl")
    assert len(exs) == 2000
    assert all(re.fullmatch(r"\w+", e.target) for e in exs)
    assert all(e.context and not e.context.endswith(" ") for e in exs)
    assert sum(e.separator == " " for e in exs) > 1950
    seqs = data.load_wikitext_sequences(ByteTokenizer(), shared_data_dir / "wikitext2_test.txt",
                                        seq_len=512, num_sequences=4)
    assert seqs.shape == (4, 512)
