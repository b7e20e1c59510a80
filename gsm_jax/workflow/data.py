"""Dataset readers for the GSM workflow: WikiText-2 token sequences and LAMBADA examples.

The evaluation data ships with the package (``gsm_jax/data/wikitext2_test.txt``, the
WikiText-2 raw test split, and ``gsm_jax/data/lambada_dev.jsonl``, 2000 LAMBADA examples;
source and licences in ``gsm_jax/data/README.md``), found with `importlib.resources`
(`gsm_jax.data.default_data_dir`; the environment variable GSM_JAX_DATA_DIR points the defaults at
another folder). A user's own file works everywhere a path is taken; a name ending in
``.gz`` is read through gzip. Every reader raises `InvalidInputError` naming the file
and the problem for missing, empty or too small data; `check_file_option` does the same
for a command-line option before any model loads.

WikiText-2 -> sequences: the whole file (lines joined with "\\n") is tokenized once
without special tokens and cut into consecutive, non-overlapping chunks of
``seq_len`` tokens (the tail shorter than ``seq_len`` is dropped). If the
tokenizer adds a BOS token, each chunk's first token is replaced by BOS (what
llama.cpp's perplexity tool does). ``from_end=True`` takes the chunks from the
end of the file, so an evaluation set does not overlap the profile's chunks
taken from the start.

LAMBADA -> (context, target): the target is the final maximal run of word
characters (Python regex ``\\w``, Unicode) of the text; the context is the text
before it with trailing spaces removed, so for "... about signs" the context is
"... about" and the model must continue with " signs". For texts whose last
word is glued to punctuation ('... said "Nadia') the context keeps the
punctuation ('... said "'). The word-boundary rule for scoring is in
`gsm_jax.workflow.metrics.first_word`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.data import (  # noqa: F401  (re-exported: where the packaged data lives)
    LAMBADA_FILE,
    WIKITEXT_FILE,
    default_data_dir,
    default_lambada_path,
    default_wikitext_path,
    packaged_data_dir,
)
from gsm_jax.errors import InvalidInputError

_LAST_WORD = re.compile(r"(\w+)\s*$")


def repo_root() -> Path:
    """The directory holding `gsm_jax/` (the repository root in a checkout)."""
    return Path(__file__).resolve().parents[2]




def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents; a name ending in ``.gz`` is decompressed."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise InvalidInputError(f"cannot read {path} as UTF-8 text: {e}") from e


def _check_file(path: str | os.PathLike, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        hint = ("" if os.environ.get("GSM_JAX_DATA_DIR") is None else
                f" (GSM_JAX_DATA_DIR={os.environ['GSM_JAX_DATA_DIR']} is set: unset it to "
                f"use the packaged data)")
        raise InvalidInputError(f"{what} file {path} does not exist{hint}")
    if not path.is_file():
        raise InvalidInputError(f"{what} path {path} is not a file")
    if path.stat().st_size == 0:
        raise InvalidInputError(f"{what} file {path} is empty")
    return path


def check_file_option(option: str, value: str | os.PathLike | None,
                      special: Sequence[str] = ()) -> Path | None:
    """Check a command-line file option before any slow work: ``value`` must name an
    existing, non-empty file unless it is None or one of ``special`` (e.g. "none",
    "random"; compared case-insensitively). The error names the option and the path."""
    if value is None or str(value).lower() in {s.lower() for s in special}:
        return None
    path = Path(value)
    if not path.exists():
        raise InvalidInputError(f"{option} {path}: the file does not exist")
    if not path.is_file():
        raise InvalidInputError(f"{option} {path}: not a file")
    if path.stat().st_size == 0:
        raise InvalidInputError(f"{option} {path}: the file is empty")
    if not os.access(path, os.R_OK):
        raise InvalidInputError(f"{option} {path}: not readable")
    return path


# ----------------------------------------------------------------------------- WikiText-2


@functools.lru_cache(maxsize=4)
def _tokenize_file(path: str, mtime_ns: int, size: int, tokenizer: Any) -> np.ndarray:
    del mtime_ns, size  # cache key only: a changed file is read again
    text = read_text(path)
    lines = [ln.rstrip() for ln in text.splitlines()]
    text = "\n".join(ln for ln in lines if ln.strip())
    if not text.strip():
        raise InvalidInputError(f"text file {path} holds no text (only whitespace)")
    ids = tokenizer.encode(text, add_bos=False)
    return np.asarray(ids, dtype=np.int32)


def wikitext_tokens(tokenizer: Any, path: str | os.PathLike | None = None) -> np.ndarray:
    """The whole text file as one int32 token stream (cached per file and tokenizer)."""
    path = _check_file(path if path is not None else default_wikitext_path(), "text data")
    if tokenizer is None:
        raise InvalidInputError(
            f"reading text data ({path}) needs a tokenizer and this model has none; pass "
            "token ids (an [N, T] array or .npy file) instead"
        )
    st = path.stat()
    return _tokenize_file(str(path.resolve()), st.st_mtime_ns, st.st_size, tokenizer)


def split_sequences(stream: np.ndarray, seq_len: int, num_sequences: int | None = None, *,
                    from_end: bool = False, bos_id: int | None = None,
                    source: str = "token stream") -> np.ndarray:
    """Cut a token stream into [N, seq_len] non-overlapping chunks (see the module doc)."""
    if not isinstance(seq_len, int | np.integer) or seq_len < 2:
        raise InvalidInputError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    available = int(stream.size) // int(seq_len)
    if num_sequences is None:
        num_sequences = available
    if not isinstance(num_sequences, int | np.integer) or num_sequences < 1:
        raise InvalidInputError(f"num_sequences must be an integer >= 1, got {num_sequences!r}")
    if available < num_sequences:
        raise InvalidInputError(
            f"{source} has {stream.size} tokens: only {available} sequences of {seq_len} "
            f"tokens, but {num_sequences} were requested; lower the number of sequences "
            "or the sequence length"
        )
    chunks = stream[: available * seq_len].reshape(available, seq_len)
    out = chunks[available - num_sequences:] if from_end else chunks[:num_sequences]
    out = np.array(out, dtype=np.int32)
    if bos_id is not None:
        out[:, 0] = bos_id
    return out


def load_wikitext_sequences(tokenizer: Any, path: str | os.PathLike | None = None, *,
                            seq_len: int = 256, num_sequences: int | None = None,
                            from_end: bool = False) -> np.ndarray:
    """WikiText-2 (or any UTF-8 text file) as int32 [num_sequences, seq_len] token ids."""
    stream = wikitext_tokens(tokenizer, path)
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    where = path if path is not None else default_wikitext_path()
    return split_sequences(stream, seq_len, num_sequences, from_end=from_end, bos_id=bos,
                           source=f"text file {where}")


def as_token_sequences(data: Any, tokenizer: Any, *, seq_len: int, num_sequences: int | None,
                       from_end: bool = False, vocab_size: int | None = None) -> np.ndarray:
    """Accept a text-file path (tokenized and cut) or ready token ids [N, T] (taken as is;
    an ``.npy`` file holding such an array works too).

    With token ids, ``num_sequences`` (if given) takes the first N rows; rows must
    all have the same length (pass ragged data already padded and cut).
    """
    if isinstance(data, str | os.PathLike) and str(data).endswith(".npy"):
        path = _check_file(data, "token data")
        data = np.load(path)
    if data is None or isinstance(data, str | os.PathLike):
        return load_wikitext_sequences(tokenizer, data, seq_len=seq_len,
                                       num_sequences=num_sequences, from_end=from_end)
    arr = np.asarray(data)
    if arr.ndim != 2 or arr.size == 0:
        raise InvalidInputError(
            f"token data must be a non-empty [num_sequences, length] array, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"token data must hold integer ids, got {arr.dtype}")
    if arr.shape[1] < 2:
        raise InvalidInputError("token sequences need at least 2 tokens each")
    if vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
        raise InvalidInputError(f"token data has ids outside the vocabulary [0, {vocab_size})")
    if num_sequences is not None:
        if arr.shape[0] < num_sequences:
            raise InvalidInputError(
                f"token data has {arr.shape[0]} sequences but {num_sequences} were requested"
            )
        arr = arr[arr.shape[0] - num_sequences:] if from_end else arr[:num_sequences]
    return arr.astype(np.int32)


# ----------------------------------------------------------------------------- LAMBADA


@dataclasses.dataclass(frozen=True)
class LambadaExample:
    """One LAMBADA item: the model sees ``context`` and must produce ``target`` next."""

    context: str
    target: str
    # text between context and target as in the source (usually " ");
    # the context is scored exactly as given, this is informational
    separator: str = " "


def split_last_word(text: str) -> LambadaExample:
    """(context, target) by the rule of the module docstring."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("a LAMBADA text must be a non-empty string")
    m = _LAST_WORD.search(text)
    if m is None:
        raise InvalidInputError(f"LAMBADA text does not end with a word: {text[-60:]!r}")
    before = text[: m.start()]
    context = before.rstrip(" ")
    if not context.strip():
        raise InvalidInputError(f"LAMBADA text has no context before its last word: {text!r}")
    return LambadaExample(context=context, target=m.group(1), separator=before[len(context):])


def load_lambada(path: str | os.PathLike | None = None, *,
                 limit: int | None = None) -> list[LambadaExample]:
    """LAMBADA jsonl (one ``{"text": ...}`` per line) -> examples, in file order.

    ``limit`` takes the first N examples (too few in the file is an error).
    """
    path = _check_file(path if path is not None else default_lambada_path(), "LAMBADA")
    examples = []
    # split at "\n" only: a JSON string may hold U+2028, which str.splitlines splits at
    for n, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"{path}:{n}: not valid JSON ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise InvalidInputError(f'{path}:{n}: expected an object with a "text" string')
        try:
            examples.append(split_last_word(row["text"]))
        except InvalidInputError as e:
            raise InvalidInputError(f"{path}:{n}: {e}") from e
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise InvalidInputError(f"LAMBADA file {path} holds no examples")
    if limit is not None and len(examples) < limit:
        raise InvalidInputError(
            f"LAMBADA file {path} has {len(examples)} examples, but {limit} were requested"
        )
    return examples


def as_lambada_examples(lambada: Any, limit: int | None = None) -> list[LambadaExample] | None:
    """None (skip the task), a jsonl path, or a list of examples / (context, target) pairs."""
    if lambada is None:
        return None
    if isinstance(lambada, str | os.PathLike):
        return load_lambada(lambada, limit=limit)
    if not isinstance(lambada, Sequence) or isinstance(lambada, bytes):
        raise InvalidInputError("lambada must be a jsonl path or a list of (context, target)")
    out = []
    for i, ex in enumerate(lambada):
        if isinstance(ex, LambadaExample):
            out.append(ex)
        elif isinstance(ex, str):
            out.append(split_last_word(ex))
        elif isinstance(ex, Sequence) and len(ex) == 2 and all(isinstance(s, str) for s in ex):
            if not ex[0].strip() or not re.fullmatch(r"\w+", ex[1]):
                raise InvalidInputError(
                    f"lambada example {i}: needs a non-empty context and a single-word target"
                )
            out.append(LambadaExample(ex[0], ex[1]))
        else:
            raise InvalidInputError(f"lambada example {i}: expected (context, target), got {ex!r}")
    if not out:
        raise InvalidInputError("the LAMBADA example list is empty")
    if limit is not None:
        if len(out) < limit:
            raise InvalidInputError(
                f"{len(out)} LAMBADA examples given, but {limit} were requested"
            )
        out = out[:limit]
    return out
