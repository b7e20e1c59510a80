"""The GSM configuration schema: `GSMConfig` (the document's ``gsm_config``, spec §5),
its constants and validation, and reading / writing config files.

`GSMConfig` is validated on creation and immutable. What a config means for a
model (which (layer, site) pairs, which rows of a batch) is `gsm_jax.gsm.resolve`;
the arrays the jitted step takes are `gsm_jax.gsm_runtime`; profiles are
`gsm_jax.gsm.profile_io`; hot reload is `gsm_jax.gsm.watcher`. The file helpers
at the bottom (``read_bytes``, ``parse_mapping``, ``atomic_write``) are shared by those
modules.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gsm_jax.errors import GSMConfigError

SITES: tuple[str, ...] = ("attn_out", "ffn_mid")
# filter arithmetic; "auto": f32 on CPU (XLA:CPU's bf16 filter measured slower:
# docs/performance_notes.md, "GSM filter precision 'auto'"), bf16 on GPU / TPU
PRECISIONS: tuple[str, ...] = ("auto", "bf16", "f32")
TARGET_KEYWORDS: tuple[str, ...] = ("high_kurtosis", "all")
ADAPTIVE = "adaptive"
ADAPTIVE_MIN_WINDOW = 4  # spec §4: w_p = clamp((p + 1) // 16, 4, max_window)
ADAPTIVE_DIVISOR = 16
# The default is to be decided by measurement (spec §7: "whether protect_first >= 1
# reduces that cost (pick the default from this)"). Change it only here.
DEFAULT_PROTECT_FIRST = 1
# s in [0, 1] interpolates between x_p and the window mean; above 1 it extrapolates.
STRENGTH_CEILING = 1.0
# Strength at which the source document saw answers go wrong.
STRENGTH_SEEN_BREAKING = 0.4

# target_layers, normalised: a keyword, a sorted tuple of layers, or sorted
# ((layer, (sites...)), ...) pairs for the {layer: [sites]} form.
TargetLayers = str | tuple[int, ...] | tuple[tuple[int, tuple[str, ...]], ...]


# --------------------------------------------------------------------------- helpers


def is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)


def is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)


def check_int(key: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v):
        raise GSMConfigError(f"{key}={v!r}: must be an integer, got {type(v).__name__}")
    v = int(v)
    if lo is not None and v < lo:
        raise GSMConfigError(f"{key}={v!r}: must be >= {lo}")
    if hi is not None and v > hi:
        raise GSMConfigError(f"{key}={v!r}: must be <= {hi}")
    return v


def check_real(key: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
    if not is_real(v):
        raise GSMConfigError(f"{key}={v!r}: must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise GSMConfigError(f"{key}={v!r}: must be finite")
    if lo is not None and v < lo:
        raise GSMConfigError(f"{key}={v!r}: must be >= {lo}")
    if hi is not None and v > hi:
        raise GSMConfigError(f"{key}={v!r}: must be <= {hi}")
    return v


def check_site(key: str, s: Any) -> str:
    if s not in SITES or not isinstance(s, str):
        raise GSMConfigError(f"{key}: unknown site {s!r}; valid sites: {', '.join(SITES)}")
    return s


def check_sites(key: str, v: Any) -> tuple[str, ...]:
    """A list of sites -> deduplicated tuple in `SITES` order."""
    if isinstance(v, str | bytes) or not isinstance(v, Iterable):
        raise GSMConfigError(f"{key}={v!r}: must be a list of sites from {list(SITES)}")
    given = {check_site(key, s) for s in v}
    return tuple(s for s in SITES if s in given)


def _layer_key(key: str, k: Any) -> int:
    # JSON object keys are strings: accept "3" as layer 3 in the {layer: [sites]} form.
    if isinstance(k, str) and k.strip().isdigit():
        k = int(k)
    return check_int(key, k, lo=0)


def _target_layers(v: Any) -> TargetLayers:
    key = "target_layers"
    if isinstance(v, str):
        if v not in TARGET_KEYWORDS:
            raise GSMConfigError(
                f"{key}={v!r}: must be 'high_kurtosis', 'all', a list of layer indices "
                "or {layer: [sites]}"
            )
        return v
    if isinstance(v, Mapping):
        pairs = {}
        for k, sites in v.items():
            layer = _layer_key(key, k)
            if layer in pairs:
                raise GSMConfigError(f"{key}: layer {layer} given twice")
            pairs[layer] = check_sites(f"{key}[{layer}]", sites)
        return tuple(sorted(pairs.items()))
    if isinstance(v, bytes) or not isinstance(v, Iterable):
        raise GSMConfigError(
            f"{key}={v!r}: must be 'high_kurtosis', 'all', a list of layer indices "
            "or {layer: [sites]}"
        )
    items = list(v)
    if items and all(isinstance(i, tuple) and len(i) == 2 for i in items):
        # the normalised {layer: [sites]} form (what dataclasses.replace passes back)
        return _target_layers(dict(items))
    return tuple(sorted({check_int(f"{key} entry", i, lo=0) for i in items}))


def is_pairs(tl: TargetLayers) -> bool:
    return isinstance(tl, tuple) and bool(tl) and isinstance(tl[0], tuple)


def _suggest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------- GSMConfig


@dataclasses.dataclass(frozen=True)
class GSMConfig:
    """The GSM configuration (spec §5). Immutable, hashable, validated on creation.

    Lists given for ``sites``/``target_layers`` are stored as tuples. ``profile``
    is the profile JSON that resolves ``target_layers="high_kurtosis"`` (a relative
    path is relative to the working directory); ``kurtosis_threshold``, if set,
    selects the pairs with ``excess_kurtosis >= threshold`` instead of the
    profile's stored top-quarter selection.
    """

    enable: bool = True
    window_size: int | str = 8
    smooth_strength: float = 0.1
    max_strength: float = 0.3
    target_layers: TargetLayers = "high_kurtosis"
    sites: tuple[str, ...] = SITES
    precision: str = "auto"
    calibration_samples: int = 512
    max_window: int = 64
    protect_first: int = DEFAULT_PROTECT_FIRST
    short_request_tokens: int = 0
    rollout_fraction: float = 1.0
    profile: str | None = None
    kurtosis_threshold: float | None = None

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)
        if not isinstance(self.enable, bool | np.bool_):
            raise GSMConfigError(f"enable={self.enable!r}: must be true or false")
        put("enable", bool(self.enable))

        max_window = check_int("max_window", self.max_window, lo=1)
        put("max_window", max_window)
        if self.window_size == ADAPTIVE and isinstance(self.window_size, str):
            if max_window < ADAPTIVE_MIN_WINDOW:
                raise GSMConfigError(
                    f"window_size='adaptive' needs max_window >= {ADAPTIVE_MIN_WINDOW} "
                    f"(the adaptive window is at least {ADAPTIVE_MIN_WINDOW}), "
                    f"got max_window={max_window}"
                )
        elif isinstance(self.window_size, str):
            raise GSMConfigError(
                f"window_size={self.window_size!r}: must be an integer in [1, {max_window}] "
                "or 'adaptive'"
            )
        else:
            put("window_size", check_int("window_size", self.window_size, lo=1, hi=max_window))

        max_strength = check_real("max_strength", self.max_strength, lo=0.0, hi=STRENGTH_CEILING)
        put("max_strength", max_strength)
        strength = check_real("smooth_strength", self.smooth_strength, lo=0.0)
        if strength > max_strength:
            raise GSMConfigError(
                f"smooth_strength={strength!r} is above max_strength={max_strength!r}: refused "
                f"by the guard (the source document saw answers go wrong at "
                f"{STRENGTH_SEEN_BREAKING}); lower smooth_strength, or raise max_strength "
                "deliberately"
            )
        put("smooth_strength", strength)

        put("target_layers", _target_layers(self.target_layers))
        put("sites", check_sites("sites", self.sites))
        if self.precision not in PRECISIONS or not isinstance(self.precision, str):
            raise GSMConfigError(
                f"precision={self.precision!r}: must be one of {', '.join(PRECISIONS)}"
            )
        put("calibration_samples", check_int("calibration_samples", self.calibration_samples, lo=1))
        put("protect_first", check_int("protect_first", self.protect_first, lo=0))
        put("short_request_tokens",
            check_int("short_request_tokens", self.short_request_tokens, lo=0))
        put("rollout_fraction", check_real("rollout_fraction", self.rollout_fraction, 0.0, 1.0))
        if self.profile is not None:
            if not isinstance(self.profile, str | os.PathLike):
                raise GSMConfigError(f"profile={self.profile!r}: must be a file path or null")
            put("profile", os.fspath(self.profile))
        if self.kurtosis_threshold is not None:
            put("kurtosis_threshold", check_real("kurtosis_threshold", self.kurtosis_threshold))

    # ---- construction / serialisation

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        """The valid configuration keys, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _check_keys(cls, names: Iterable[str]) -> None:
        valid = cls.valid_keys()
        unknown = [k for k in names if k not in valid]
        if unknown:
            hints = "".join(_suggest(str(k), valid) for k in unknown[:1])
            raise GSMConfigError(
                f"unknown GSM config key(s) {', '.join(repr(k) for k in unknown)}{hints}; "
                f"valid keys: {', '.join(valid)}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GSMConfig:
        """Build from a mapping; ``{"gsm_config": {...}}`` is unwrapped. Unknown keys refused."""
        if not isinstance(data, Mapping):
            raise GSMConfigError(
                f"a GSM config must be a mapping of keys to values, got {type(data).__name__}"
            )
        if set(data) == {"gsm_config"}:
            return cls.from_dict(data["gsm_config"])
        cls._check_keys(data)
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> GSMConfig:
        """Read a YAML (.yaml/.yml) or JSON (.json) config file."""
        path = Path(path)
        data = _read_mapping(path)
        try:
            return cls.from_dict(data)
        except GSMConfigError as e:
            raise GSMConfigError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python mapping (lists, dicts) that `from_dict` turns back into ``self``."""
        d = {k: getattr(self, k) for k in self.valid_keys()}
        d["sites"] = list(self.sites)
        tl = self.target_layers
        if is_pairs(tl):
            d["target_layers"] = {layer: list(sites) for layer, sites in tl}
        elif isinstance(tl, tuple):
            d["target_layers"] = list(tl)
        return d

    def to_file(self, path: str | os.PathLike) -> None:
        """Write as YAML or JSON (by extension), atomically (safe for a running watcher)."""
        path = Path(path)
        fmt = _format_of(path)
        if fmt == "json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        atomic_write(path, text)

    def replace(self, **changes: Any) -> GSMConfig:
        """A copy with ``changes`` applied, validated again."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- files


def _format_of(path: Path) -> str:
    ext = path.suffix.lower()
    if ext == ".json":
        return "json"
    if ext in (".yaml", ".yml"):
        return "yaml"
    raise GSMConfigError(
        f"{path}: unknown config file extension {path.suffix!r}; use .yaml, .yml or .json"
    )


def parse_mapping(path: Path, raw: bytes) -> Any:
    fmt = _format_of(path)
    if not raw.strip():
        raise GSMConfigError(f"{path}: config file is empty")
    try:
        text = raw.decode("utf-8")
        return json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise GSMConfigError(f"cannot parse config file {path} as {fmt.upper()}: {e}") from e


def read_bytes(path: Path, what: str = "config file") -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise GSMConfigError(f"{what} not found: {path}") from e
    except IsADirectoryError as e:
        raise GSMConfigError(f"{what} {path} is a directory") from e
    except OSError as e:
        raise GSMConfigError(f"cannot read {what} {path}: {e}") from e


def _read_mapping(path: Path) -> Any:
    _format_of(path)
    return parse_mapping(path, read_bytes(path))


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
