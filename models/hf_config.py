"""Reading a `config.json` as its own ecosystem writes it: every key is read, listed as not
affecting inference, or refused by name. Nothing is silently ignored.

A family's `from_hf_config` wraps the dict it is given in a `ConfigReader`, reads keys
through it (`get`, `require`, `has`, `sub`), refuses the values it does not implement with
`UnsupportedModelError` naming key, value and the supported values (`refuse`), and ends
with `finish(HARMLESS)`: its table of keys that do not change inference, each with a
one-word reason. Whatever is left -- a key the reader never looked at and the table does
not list -- is reported once, as an `UnknownConfigKeyWarning` naming it: a key a newer
transformers or NeMo release adds may change the math, and the user should know that
gsm_jax did not apply it.

`PRETRAINED_KEYS` are the keys transformers' `PretrainedConfig` writes for every model
(`save_pretrained` / `to_json_string`); family tables extend it. The contract test
(`tests/test_config_keys.py`) saves each family's config with the reference library's own
serializer and checks that every key written is accounted for.

`rope_parameters` (transformers >= 5) and `rope_scaling` (earlier releases, and most
checkpoints on the Hub) are one setting under two names: `rope_settings` reads either,
refuses the two when they disagree, and gives the `rope_theta` inside them precedence
over the top-level key only when the two agree or one is absent.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from gsm_jax.errors import ModelLoadError, UnsupportedModelError


class UnknownConfigKeyWarning(UserWarning):
    """A config key that gsm_jax neither reads nor lists as harmless (it is not applied)."""


# Written by transformers' PretrainedConfig for every model; none changes a forward pass.
PRETRAINED_KEYS: dict[str, str] = {
    "_name_or_path": "metadata",
    "architectures": "metadata",
    "transformers_version": "metadata",
    "model_type": "dispatch",  # read by gsm_jax.load to pick the family
    "dtype": "storage",  # the dtype weights were saved in; gsm_jax.load(dtype=) picks ours
    "torch_dtype": "storage",
    "use_cache": "runtime",
    "output_attentions": "runtime",
    "output_hidden_states": "runtime",
    "return_dict": "runtime",
    "output_router_logits": "training",
    "is_encoder_decoder": "metadata",
    "chunk_size_feed_forward": "training",
    "id2label": "heads",  # sequence-classification labels, no LM head
    "label2id": "heads",
    "num_labels": "heads",
    "problem_type": "training",
    "pad_token_id": "tokenizer",  # padding is masked by lengths here
    "sep_token_id": "tokenizer",
    "decoder_start_token_id": "tokenizer",
    "tokenizer_class": "tokenizer",
    "prefix": "metadata",
    "task_specific_params": "metadata",
    "finetuning_task": "training",
    "tie_encoder_decoder": "metadata",
    "add_cross_attention": "metadata",
    "cross_attention_hidden_size": "metadata",
    "pruned_heads": "training",
    "torchscript": "runtime",
    "initializer_range": "training",
    "attention_dropout": "training",
    "hidden_dropout": "training",
    "embedding_dropout": "training",
    "_attn_implementation_autoset": "runtime",
    "_attn_implementation": "runtime",
    "transformers.js_config": "metadata",
    "quantization_config": "checkpoint",  # read by the checkpoint loader when it matters
    "auto_map": "metadata",
}


def _supported(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) for v in values)


class ConfigReader:
    """A config dict whose reads are recorded, so `finish` can name what nobody read.

    `get` of a key whose value is itself a dict counts the whole dict as read (the caller
    passes it on whole, e.g. to `RopeSpec.from_hf`, which checks its keys); use `sub` to
    read a nested dict key by key."""

    def __init__(self, data: Mapping[str, Any], family: str, path: str = "") -> None:
        if not isinstance(data, Mapping):
            raise UnsupportedModelError(f"{family} config{' ' + path if path else ''}: "
                                        f"expected a JSON object, got {type(data).__name__}")
        self.data = dict(data)
        self.family = family
        self.path = path
        self._read: set[str] = set()
        self._subs: dict[str, ConfigReader] = {}

    # -- reading -----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """Whether `key` is present and not None (counts as a read)."""
        self._read.add(key)
        return self.data.get(key) is not None

    def get(self, key: str, *aliases: str, default: Any = None) -> Any:
        """The first of `key`, `aliases` present and not None, else `default`."""
        for k in (key, *aliases):
            self._read.add(k)
        for k in (key, *aliases):
            if self.data.get(k) is not None:
                return self.data[k]
        return default

    def value(self, key: str, default: Any = None) -> Any:
        """`dict.get` semantics (a present None is returned as None), recorded as a read."""
        self._read.add(key)
        return self.data.get(key, default)

    def require(self, key: str, *aliases: str) -> Any:
        """`get` of a key the config must have (ModelLoadError naming it when absent)."""
        value = self.get(key, *aliases)
        if value is None:
            raise ModelLoadError(f"{self.family} config: missing key {self.name(key)!r}")
        return value

    def sub(self, key: str) -> ConfigReader | None:
        """The nested dict under `key`, read key by key (None when absent)."""
        self._read.add(key)
        value = self.data.get(key)
        if value is None:
            return None
        if key not in self._subs:
            self._subs[key] = ConfigReader(value, self.family, self.name(key))
        return self._subs[key]

    def mark(self, *keys: str) -> None:
        """Count keys as read that the reader handles elsewhere (e.g. the checkpoint loader)."""
        self._read.update(keys)

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    # -- refusing ----------------------------------------------------------------------
    def refuse(self, key: str, value: Any, supported: Iterable[Any] | str,
               why: str = "") -> UnsupportedModelError:
        """The error for a value gsm_jax does not implement: key, value, supported values."""
        sup = supported if isinstance(supported, str) else _supported(supported)
        return UnsupportedModelError(
            f"{self.family} config: {self.name(key)}={value!r} is not supported "
            f"(supported: {sup}){': ' + why if why else ''}")

    def expect(self, key: str, supported: Iterable[Any], *, default: Any = None,
               why: str = "") -> Any:
        """Read `key` (default when absent) and refuse any value outside `supported`."""
        supported = tuple(supported)
        value = self.get(key, default=default)
        if value not in supported:
            raise self.refuse(key, value, supported, why)
        return value

    # -- accounting --------------------------------------------------------------------
    def unaccounted(self, harmless: Mapping[str, str]) -> list[str]:
        """Keys (dotted for nested ones) neither read nor listed in `harmless`."""
        out = [self.name(k) for k in self.data
               if k not in self._read and k not in harmless and k not in self._subs]
        for sub in self._subs.values():
            out += sub.unaccounted(harmless)
        return out

    def finish(self, harmless: Mapping[str, str]) -> list[str]:
        """Warn once, naming every unaccounted key; returns them."""
        unknown = self.unaccounted(harmless)
        if unknown:
            warnings.warn(UnknownConfigKeyWarning(
                f"{self.family} config: gsm_jax does not read {len(unknown)} key(s) and does "
                f"not know them to be harmless, so they are not applied: "
                f"{', '.join(unknown)}. If one changes the model's math, outputs will differ "
                "from the reference library's."), stacklevel=3)
        return unknown


def rope_settings(r: ConfigReader, *, default: Mapping[str, Any] | None = None,
                  merge_theta: bool = True) -> dict[str, Any]:
    """One rotary-settings dict from `rope_parameters` and / or `rope_scaling`.

    transformers 5 (and NeMo AutoModel, built on it) writes `rope_parameters`, with the
    base frequency inside as `rope_theta`; earlier releases and most published checkpoints
    write `rope_scaling` and a top-level `rope_theta`. Either is read; both present and
    different is refused naming both. `type` is read as `rope_type`. The top-level
    `rope_theta`, when present, is put in as `rope_theta` unless the dict has its own; the
    two disagreeing is refused (`merge_theta=False`: neither, for a family whose top-level
    `rope_theta` is another RoPE's). `default` is the reference's value when neither is
    present.
    A flat dict of one RoPE (Gemma 3's per-layer-type form is the family's to read)."""
    params = r.get("rope_parameters")
    scaling = r.get("rope_scaling")

    def norm(p: Mapping[str, Any] | None, key: str) -> dict[str, Any] | None:
        if p is None:
            return None
        if not isinstance(p, Mapping):
            raise UnsupportedModelError(f"{r.family} config: {r.name(key)} must be an object, "
                                        f"got {p!r}")
        p = dict(p)
        if "type" in p:
            t = p.pop("type")
            if p.setdefault("rope_type", t) != t:
                raise UnsupportedModelError(
                    f"{r.family} config: {r.name(key)} has type={t!r} and "
                    f"rope_type={p['rope_type']!r}")
        return p

    params, scaling = norm(params, "rope_parameters"), norm(scaling, "rope_scaling")
    if params is not None and scaling is not None:
        shared = set(params) & set(scaling)
        differ = {k for k in shared if params[k] != scaling[k]}
        if differ:
            raise UnsupportedModelError(
                f"{r.family} config: rope_parameters={params!r} and rope_scaling={scaling!r} "
                f"disagree on {sorted(differ)}; they are one setting under two names")
    out = {**(scaling or {}), **(params or {})}
    if params is None and scaling is None and default is not None:
        out = dict(default)
    top = r.get("rope_theta") if merge_theta else None
    if top is not None:
        inner = out.get("rope_theta")
        if inner is not None and float(inner) != float(top):
            raise UnsupportedModelError(
                f"{r.family} config: rope_theta={top!r} and rope_theta={inner!r} inside "
                f"{'rope_parameters' if params is not None else 'rope_scaling'} disagree")
        out["rope_theta"] = top
    return out
