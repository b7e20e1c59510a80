"""Tokenizer: a thin wrapper around a `tokenizers.Tokenizer` plus the model's chat template.

Two ways to build one:

* `Tokenizer.from_gguf_fields(fields)` rebuilds the tokenizer a GGUF file's `tokenizer.*`
  metadata describes (what `gsm_jax.models.gguf_reader.read_gguf` does): byte-level BPE
  (`gpt2`, SmolLM2) or SentencePiece-style BPE with byte fallback (`llama`, Gemma 3);
* `Tokenizer.from_hf_dir(path)` reads a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`).

End-of-sequence ids (`eos_ids`)
-------------------------------
`eos_ids` holds exactly the ids at which transformers' `generate` would stop for the same model,
so that generation here and there ends at the same place:

* GGUF: `(tokenizer.ggml.eos_token_id,)` only. transformers copies that id into the model config
  and hence the generation config, and nothing else. llama.cpp additionally stops at
  `tokenizer.ggml.eot_token_id`/`eom_token_id` (its "end of generation" set) but transformers
  ignores those, so we do too. For SmolLM2-Instruct the GGUF's EOS already *is* the end-of-turn
  token `<|im_end|>` (id 2), so chat replies stop at the end of the turn.
* Hugging Face directory: the `eos_token_id` of `generation_config.json` if the directory has one
  (it may be a list, e.g. Llama-3-Instruct's `[<|end_of_text|>, <|eom_id|>, <|eot_id|>]`), else
  that of `config.json`, else the tokenizer's own `eos_token`. An end-of-turn token the chat
  template uses is *not* added on top: transformers would not stop there either.

Special tokens and BOS
----------------------
`encode` never uses the backend's post-processor; it prepends BOS (and appends EOS) itself
according to the model's `add_bos`/`add_eos` flags, so both constructors behave the same way.
Special tokens written literally in the text (e.g. `<|im_start|>` in a rendered chat prompt) are
matched whole, as transformers does.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

from gsm_jax.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

__all__ = ["Tokenizer", "byte_level_alphabet"]

# llama.cpp's token types (gguf.TokenType); only these two matter for building the vocabulary.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_SPM_SPACE = "\u2581"  # SentencePiece's visible space

# Gemma's turn format (google/gemma-3 chat template), for a Gemma GGUF that carries no
# `tokenizer.chat_template`: a system message is folded into the first user turn, the
# assistant is called "model". No `bos_token` in it: `encode` prepends BOS itself.
GEMMA_CHAT_TEMPLATE = (
    "{%- set first = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == "
    "'system' else '' -%}"
    "{%- set turns = messages[1:] if first else messages -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (first if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Llama-3's split pattern (GPT-2's is built into `pre_tokenizers.ByteLevel(use_regex=True)`).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` values we can rebuild, grouped by the pre-tokenizer llama.cpp uses.
# - "gpt2": GPT-2's regex only.
# - the "smollm" group: llama.cpp first isolates every single digit (`\p{N}`), then applies
#   GPT-2's regex; this is the same as the `Sequence[Digits(individual_digits=True),
#   ByteLevel(use_regex=True)]` in SmolLM2's / StarCoder's own tokenizer.json.
# - the "llama3" group: the Llama-3 regex, then byte-level mapping without GPT-2's regex.
_PRE_GPT2 = frozenset({"gpt2", "default"})
_PRE_DIGITS_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_PRE_LLAMA3 = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"})


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def _gguf_pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre == pre`."""
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_GPT2:
        # Why not just ByteLevel: digits are split off *before* GPT-2's regex runs, so a run of
        # whitespace in front of a digit stays one piece ("a  1" -> "a", "ĠĠ", "1"), where
        # GPT-2's regex alone would give "a", "Ġ", "Ġ", "1". transformers' GGUF loader has no
        # entry for "smollm" and falls back to the latter; we follow llama.cpp and the model's
        # original tokenizer.json.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = sorted(_PRE_GPT2 | _PRE_DIGITS_GPT2 | _PRE_LLAMA3)
    raise UnsupportedModelError(
        f"{source}: tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
        f"supported: {supported}"
    )


def _token_content(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, Mapping):
        return token.get("content")
    return None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class Tokenizer:
    """A model's tokenizer: text <-> ids, special ids and chat template.

    Compares and hashes by identity (the default object behaviour), so it can sit in a pytree's
    static aux data; it pickles via the backend's JSON serialisation.

    `chat_format` names a chat format built in code (`gsm_jax.chat_formats`: "deepseek_v4",
    "deepseek_v41") that replaces the Jinja template for models that ship none.
    """

    chat_format: str | None = None  # class default: tokenizers pickled before it existed

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        eos_ids: Sequence[int] | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        name: str = "<tokenizer>",
        vocab_size: int | None = None,
        chat_format: str | None = None,
    ) -> None:
        """Wrap `backend`; special tokens are given by their text and must be in its vocabulary."""
        self._backend = backend
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.chat_template = chat_template
        self._vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._bos_id = self._id_of(bos_token)
        eos_id = self._eos_token_id = self._id_of(eos_token)
        if eos_ids is None:
            eos_ids = () if eos_id is None else (eos_id,)
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))  # ordered, deduplicated
        self._pad_id = self._id_of(pad_token)
        if chat_format is not None:
            from gsm_jax import chat_formats

            if chat_format not in chat_formats.FORMATS:
                raise ModelLoadError(f"{name}: unknown chat format {chat_format!r}")
            self.chat_format = chat_format
            for token in chat_formats.special_tokens(chat_format):
                self._id_of(token)  # all in the vocabulary, or a clear error
            # the format ends every assistant turn with its EOS: generation stops there
            fmt_eos = self._id_of(chat_formats.EOS)
            if fmt_eos not in self._eos_ids:
                self._eos_ids = (*self._eos_ids, fmt_eos)
        if self.add_bos and self._bos_id is None:
            raise ModelLoadError(f"{name}: add_bos is set but the tokenizer has no BOS token")

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.name}: special token {token!r} is not in the vocabulary")
        return token_id

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf_fields(
        cls, fields: Mapping[str, Any], *, source: str = "<gguf>"
    ) -> Tokenizer:
        """Build from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        `fields` maps GGUF keys to plain Python values (strings, ints, lists). Byte-level BPE
        (`tokenizer.ggml.model == "gpt2"`) and SentencePiece BPE (`"llama"`) are supported.
        """
        model = fields.get("tokenizer.ggml.model")
        if model == "llama":
            return cls._from_gguf_sentencepiece(fields, source=source)
        if model != "gpt2":
            raise UnsupportedModelError(
                f"{source}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                "supported: byte-level BPE ('gpt2') and SentencePiece BPE ('llama')"
            )
        try:
            tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
            merges_raw: list[str] = list(fields["tokenizer.ggml.merges"])
        except KeyError as exc:
            raise ModelLoadError(f"{source}: GGUF tokenizer metadata lacks {exc.args[0]}") from None
        token_types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(token_types) != len(tokens):
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                f"{len(tokens)} tokens"
            )

        # llama.cpp stores byte-level tokens already spelled in GPT-2's byte alphabet. A token
        # using any other character (a mislabelled raw-text token) is respelled byte by byte,
        # as transformers does, so that the BPE model can still reach it.
        spelling = byte_level_alphabet()
        alphabet = frozenset(spelling.values())

        def spell(token: str) -> str:
            if alphabet.issuperset(token):
                return token
            return "".join(spelling[b] for b in token.encode("utf-8"))

        vocab = {spell(tok): i for i, tok in enumerate(tokens)}
        merges = []
        for merge in merges_raw:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelLoadError(f"{source}: malformed BPE merge {merge!r}")
            merges.append((left, right))

        backend = _BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        pre = fields.get("tokenizer.ggml.pre") or "default"
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre, source)
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>, ...) must be matched whole in text and are skipped when
        # decoding with skip_special_tokens; user-defined ones are matched whole but kept.
        # A "control" token outside the byte alphabet would be a llama.cpp mislabel (see above).
        special = [
            AddedToken(tok, normalized=False, special=True)
            for tok, typ in zip(tokens, token_types, strict=True)
            if typ == _TOKEN_TYPE_CONTROL and alphabet.issuperset(tok)
        ]
        if special:
            backend.add_special_tokens(special)
        user = [
            AddedToken(tok, normalized=False, special=False)
            for tok, typ in zip(tokens, token_types, strict=True)
            if typ == _TOKEN_TYPE_USER_DEFINED and tok in vocab
        ]
        if user:
            backend.add_tokens(user)
        if len(vocab) != len(tokens):
            # Tolerated (transformers does too): the later id of a duplicate wins, the earlier
            # one can still be decoded from but is never produced by encode.
            warnings.warn(
                f"{source}: tokenizer vocabulary has duplicate entries "
                f"({len(vocab)} distinct of {len(tokens)})",
                stacklevel=2,
            )

        def token_at(key: str) -> str | None:
            idx = fields.get(key)
            if idx is None:
                return None
            if not 0 <= int(idx) < len(tokens):
                raise ModelLoadError(f"{source}: {key}={idx} is outside the vocabulary")
            return spell(tokens[int(idx)])

        eos_idx = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            eos_ids=None if eos_idx is None else (int(eos_idx),),  # see the module docstring
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            unk_token=token_at("tokenizer.ggml.unknown_token_id"),
            # A byte-level GGUF without the flag gets no BOS (transformers and llama.cpp agree).
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
            name=source,
            vocab_size=len(tokens),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, fields: Mapping[str, Any], *, source: str) -> Tokenizer:
        """SentencePiece BPE (llama.cpp's "llama" vocabulary: Gemma, Llama 2, ...).

        A GGUF stores the pieces and their scores but no merges. SentencePiece's BPE merges
        the adjacent pair whose joined piece ranks best; with BPE merges listed in that
        rank order (for each piece, every split of it into two vocabulary pieces, longer
        left part first) `tokenizers`' BPE gives the same ids. The rank is the score,
        except for Gemma, whose scores do not follow its merge order: its pieces are
        ranked by their order in the file (transformers' GGUF loader agrees on both).
        Pieces made only of spaces are stored as spaces; spelled with the visible space
        here, as the normalizer writes every space.
        """
        try:
            tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        except KeyError as exc:
            raise ModelLoadError(f"{source}: GGUF tokenizer metadata lacks {exc.args[0]}") from None
        n = len(tokens)
        token_types = list(fields.get("tokenizer.ggml.token_type") or [1] * n)
        scores = list(fields.get("tokenizer.ggml.scores") or [0.0] * n)
        if len(token_types) != n or len(scores) != n:
            raise ModelLoadError(f"{source}: tokenizer.ggml.token_type / scores do not have "
                                 f"one entry per token ({n} tokens)")
        gemma = str(fields.get("general.architecture", "")).startswith("gemma")
        original = tokens
        tokens = [_SPM_SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        rank = (lambda i: i) if gemma else (lambda i: -float(scores[i]))
        merges_ranked = []
        for i, tok in enumerate(tokens):
            for cut in range(1, len(tok)):
                left, right = tok[:cut], tok[cut:]
                if left in vocab and right in vocab:
                    merges_ranked.append((rank(i), -cut, left, right))
        merges_ranked.sort(key=lambda m: (m[0], m[1]))
        unk_idx = fields.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[int(unk_idx)] if unk_idx is not None and 0 <= int(unk_idx) < n else None
        backend = _BackendTokenizer(models.BPE(
            vocab=vocab, merges=[(m[2], m[3]) for m in merges_ranked], dropout=None,
            unk_token=unk, fuse_unk=True, byte_fallback=True))
        space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", not gemma))
        replace = normalizers.Replace(" ", _SPM_SPACE)
        backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace])
                              if space_prefix else replace)
        steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(steps)
        # control tokens are matched whole and skipped by skip_special_tokens; user-defined
        # ones are matched whole and kept, except the respelled runs of spaces, which the
        # merges reach from the normalized text
        special = [AddedToken(tok, normalized=False, special=True)
                   for tok, typ in zip(tokens, token_types, strict=True)
                   if typ == _TOKEN_TYPE_CONTROL]
        if special:
            backend.add_special_tokens(special)
        user = [AddedToken(tok, normalized=False, special=False)
                for tok, orig, typ in zip(tokens, original, token_types, strict=True)
                if typ == _TOKEN_TYPE_USER_DEFINED and tok == orig]
        if user:
            backend.add_tokens(user)

        def token_at(key: str) -> str | None:
            idx = fields.get(key)
            if idx is None:
                return None
            if not 0 <= int(idx) < n:
                raise ModelLoadError(f"{source}: {key}={idx} is outside the vocabulary")
            return tokens[int(idx)]

        eos_idx = fields.get("tokenizer.ggml.eos_token_id")
        template = fields.get("tokenizer.chat_template")
        if template is None and gemma and "<start_of_turn>" in vocab:
            template = GEMMA_CHAT_TEMPLATE
        return cls(
            backend,
            eos_ids=None if eos_idx is None else (int(eos_idx),),
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            unk_token=unk,
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template,
            name=source,
            vocab_size=n,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
        optionally `chat_template.jinja`, `generation_config.json`, `config.json`)."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(f"{root}: no tokenizer.json in this directory")
        try:
            backend = _BackendTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tok_file}: cannot parse tokenizer: {exc}") from exc

        def read_json(name: str) -> dict[str, Any]:
            file = root / name
            if not file.is_file():
                return {}
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{file}: cannot read JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise ModelLoadError(f"{file}: expected a JSON object")
            return data

        cfg = read_json("tokenizer_config.json")
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        pad = _token_content(cfg.get("pad_token"))
        unk = _token_content(cfg.get("unk_token"))

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        # Whether BOS/EOS get added: the explicit flag if the config has one, else whatever the
        # tokenizer.json post-processor does (e.g. Llama-3's TemplateProcessing adds BOS).
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe_full = backend.encode("a", add_special_tokens=True).ids
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        post_bos = bos_id is not None and probe_full[:1] == [bos_id] != probe_plain[:1]
        post_eos = eos_id is not None and probe_full[-1:] == [eos_id] != probe_plain[-1:]
        add_bos = cfg.get("add_bos_token")
        add_eos = cfg.get("add_eos_token")

        # See the module docstring: stop where transformers' generate stops.
        eos_ids = _as_id_tuple(read_json("generation_config.json").get("eos_token_id"))
        model_config = read_json("config.json")
        if not eos_ids:
            eos_ids = _as_id_tuple(model_config.get("eos_token_id"))
        from gsm_jax.chat_formats import chat_format_for, special_tokens

        # the model type's built-in chat format, if the vocabulary has its special tokens (a
        # tiny test tokenizer may not: it then has no chat format, as it has no template)
        chat_format = chat_format_for(model_config.get("model_type"))
        if chat_format and any(backend.token_to_id(t) is None
                               for t in special_tokens(chat_format)):
            chat_format = None
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=pad,
            unk_token=unk,
            eos_ids=eos_ids or None,
            add_bos=post_bos if add_bos is None else bool(add_bos),
            add_eos=post_eos if add_eos is None else bool(add_eos),
            chat_template=template,
            name=str(root),
            chat_format=chat_format,
        )

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> _BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None if the model has none."""
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end generation (see the module docstring for how they are chosen)."""
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        """The model's padding id; the first EOS id if the model declares no pad token."""
        if self._pad_id is not None:
            return self._pad_id
        if self._eos_ids:
            return self._eos_ids[0]
        raise UnsupportedModelError(f"{self.name}: tokenizer has neither a pad nor an EOS token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included."""
        return self._vocab_size

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; prepends BOS if `add_bos` (default: the model's flag)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise UnsupportedModelError(f"{self.name}: tokenizer has no BOS token")
            ids = [self._bos_id, *ids]
        if self.add_eos and self._eos_token_id is not None:
            ids = [*ids, self._eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (list, tuple or 1-D array); special tokens dropped by default."""
        ids = [int(i) for i in ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling)."""
        return self._backend.id_to_token(int(token_id))

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the model's Jinja chat template.

        `messages` is a list of `{"role": ..., "content": ...}` dicts, or a plain string taken as
        one user message. Extra keyword arguments are passed to the template (e.g. `tools`).
        A model with a built-in `chat_format` renders in code instead and takes `thinking`
        (or vLLM's `enable_thinking`) and `reasoning_effort` (see `gsm_jax.chat_formats`).
        """
        if self.chat_format is not None:
            from gsm_jax.chat_formats import prompt_text

            return prompt_text(self._chat_pieces(messages, add_generation_prompt,
                                                 template_kwargs))
        if self.chat_template is None:
            raise UnsupportedModelError(
                f"{self.name}: this model has no chat template; pass plain text prompts instead"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = [dict(m) for m in messages]
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        context = {k: v for k, v in specials.items() if v is not None}
        context.update(template_kwargs)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation, generation header included.

        With a Jinja template: `encode(apply_chat_template(...))`. With a built-in chat format:
        the format's special tokens by id and each run of text between them encoded without
        the added vocabulary (a special-token spelling in a message stays text), no extra BOS.
        """
        if self.chat_format is None:
            return self.encode(self.apply_chat_template(messages, **template_kwargs))
        ids: list[int] = []
        text: list[str] = []

        def flush() -> None:
            if text:
                ids.extend(self._plain_backend.encode("".join(text),
                                                      add_special_tokens=False).ids)
                text.clear()

        for piece in self._chat_pieces(messages, True, template_kwargs):
            if piece.special:
                flush()
                ids.append(self._id_of(piece.text))
            else:
                text.append(piece.text)
        flush()
        return ids

    def _chat_pieces(self, messages: Any, add_generation_prompt: bool,
                     kwargs: Mapping[str, Any]) -> list[Any]:
        from gsm_jax.chat_formats import ChatFormatError, render

        if not add_generation_prompt:
            raise ChatFormatError(f"the {self.chat_format} chat format always ends with the "
                                  "generation header (add_generation_prompt=False)")
        kwargs = dict(kwargs)
        thinking = kwargs.pop("thinking", None)
        enable = kwargs.pop("enable_thinking", None)
        if thinking is None:
            thinking = enable
        elif enable is not None and enable != thinking:
            raise ChatFormatError("thinking and enable_thinking disagree", param="thinking")
        effort = kwargs.pop("reasoning_effort", None)
        if kwargs:
            raise ChatFormatError(f"the {self.chat_format} chat format takes no option "
                                  f"{sorted(kwargs)} (thinking, reasoning_effort)",
                                  param="chat_template_kwargs")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return render(self.chat_format, [dict(m) for m in messages], thinking=thinking,
                      reasoning_effort=effort)

    @cached_property
    def _plain_backend(self) -> _BackendTokenizer:
        # the backend without its added vocabulary: text encodes as text, never as a special
        # token (what the chat formats' reference encoders do between their special tokens)
        state = json.loads(self._backend.to_str())
        state["added_tokens"] = []
        return _BackendTokenizer.from_str(json.dumps(state))

    @cached_property
    def _compiled_template(self) -> Any:
        # The same Jinja set-up as transformers' chat templates (sandboxed; trim/lstrip blocks;
        # loop controls; tojson without HTML escaping; raise_exception; strftime_now), so a
        # template renders to the same string here and there.
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{self.name}: invalid chat template: {exc}") from exc

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_compiled_template", None)  # a Jinja template does not pickle; rebuilt lazily
        state.pop("_plain_backend", None)
        state["_backend"] = self._backend.to_str()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["_backend"] = _BackendTokenizer.from_str(state["_backend"])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, add_bos={self.add_bos})"
        )
