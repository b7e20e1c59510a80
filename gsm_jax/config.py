"""GSM configuration, layer/site resolution, runtime arrays and hot reload.

`GSMConfig` is the document's ``gsm_config`` (spec §5), validated on creation.
Everything numeric reaches the jitted step through `GSMRuntime`, a pytree of
arrays, so a new config never recompiles (only ``max_window`` is static).

Profile JSON (schema ``gsm-jax/profile/v1``), written by ``gsm-jax profile``
(see `build_profile`) and read by ``target_layers="high_kurtosis"``::

    {
      "schema": "gsm-jax/profile/v1",
      "model": "<name or path>",
      "num_layers": 32,
      "sites": ["attn_out", "ffn_mid"],            # sites that were profiled
      "kurtosis_definition": "<KURTOSIS_DEFINITION>",
      "calibration_samples": 512,                  # optional
      "selection": {"fraction": 0.25, "threshold": null},   # optional
      "stats": [                                   # one per profiled (layer, site)
        {"layer": 0, "site": "attn_out", "max_abs": 12.5, "variance": 0.8,
         "excess_kurtosis": 41.2, "outlier_share_6sigma": 0.0012, ...},
        ...
      ],
      "high_kurtosis": [[3, "ffn_mid"], [7, "attn_out"], ...]
    }

Extra keys (top level or per stat) are allowed and ignored. Non-finite numbers
are written as ``null``; a stat whose ``excess_kurtosis`` is null is never
selected.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import numbers
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import struct

from gsm_jax.errors import GSMConfigError, InvalidInputError

log = logging.getLogger(__name__)

SITES: tuple[str, ...] = ("attn_out", "ffn_mid")
# filter arithmetic; "auto": f32 on CPU (XLA:CPU's bf16 filter measured slower: a
# SmolLM2 batch-16 generate +17% with GSM in bf16 vs +6.6% in f32), bf16 on GPU / TPU
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

PROFILE_SCHEMA = "gsm-jax/profile/v1"
KURTOSIS_DEFINITION = (
    "excess kurtosis = m4 / m2**2 - 3, with m2 and m4 the central moments over all "
    "elements (every token and channel of every calibration sequence) of one (layer, site)"
)
DEFAULT_HIGH_KURTOSIS_FRACTION = 0.25

# target_layers, normalised: a keyword, a sorted tuple of layers, or sorted
# ((layer, (sites...)), ...) pairs for the {layer: [sites]} form.
TargetLayers = str | tuple[int, ...] | tuple[tuple[int, tuple[str, ...]], ...]


# --------------------------------------------------------------------------- helpers


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)


def _int(key: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v):
        raise GSMConfigError(f"{key}={v!r}: must be an integer, got {type(v).__name__}")
    v = int(v)
    if lo is not None and v < lo:
        raise GSMConfigError(f"{key}={v!r}: must be >= {lo}")
    if hi is not None and v > hi:
        raise GSMConfigError(f"{key}={v!r}: must be <= {hi}")
    return v


def _real(key: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
    if not _is_real(v):
        raise GSMConfigError(f"{key}={v!r}: must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise GSMConfigError(f"{key}={v!r}: must be finite")
    if lo is not None and v < lo:
        raise GSMConfigError(f"{key}={v!r}: must be >= {lo}")
    if hi is not None and v > hi:
        raise GSMConfigError(f"{key}={v!r}: must be <= {hi}")
    return v


def _site(key: str, s: Any) -> str:
    if s not in SITES or not isinstance(s, str):
        raise GSMConfigError(f"{key}: unknown site {s!r}; valid sites: {', '.join(SITES)}")
    return s


def _sites(key: str, v: Any) -> tuple[str, ...]:
    """A list of sites -> deduplicated tuple in `SITES` order."""
    if isinstance(v, str | bytes) or not isinstance(v, Iterable):
        raise GSMConfigError(f"{key}={v!r}: must be a list of sites from {list(SITES)}")
    given = {_site(key, s) for s in v}
    return tuple(s for s in SITES if s in given)


def _layer_key(key: str, k: Any) -> int:
    # JSON object keys are strings: accept "3" as layer 3 in the {layer: [sites]} form.
    if isinstance(k, str) and k.strip().isdigit():
        k = int(k)
    return _int(key, k, lo=0)


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
            pairs[layer] = _sites(f"{key}[{layer}]", sites)
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
    return tuple(sorted({_int(f"{key} entry", i, lo=0) for i in items}))


def _is_pairs(tl: TargetLayers) -> bool:
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

        max_window = _int("max_window", self.max_window, lo=1)
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
            put("window_size", _int("window_size", self.window_size, lo=1, hi=max_window))

        max_strength = _real("max_strength", self.max_strength, lo=0.0, hi=STRENGTH_CEILING)
        put("max_strength", max_strength)
        strength = _real("smooth_strength", self.smooth_strength, lo=0.0)
        if strength > max_strength:
            raise GSMConfigError(
                f"smooth_strength={strength!r} is above max_strength={max_strength!r}: refused "
                f"by the guard (the source document saw answers go wrong at "
                f"{STRENGTH_SEEN_BREAKING}); lower smooth_strength, or raise max_strength "
                "deliberately"
            )
        put("smooth_strength", strength)

        put("target_layers", _target_layers(self.target_layers))
        put("sites", _sites("sites", self.sites))
        if self.precision not in PRECISIONS or not isinstance(self.precision, str):
            raise GSMConfigError(
                f"precision={self.precision!r}: must be one of {', '.join(PRECISIONS)}"
            )
        put("calibration_samples", _int("calibration_samples", self.calibration_samples, lo=1))
        put("protect_first", _int("protect_first", self.protect_first, lo=0))
        put("short_request_tokens", _int("short_request_tokens", self.short_request_tokens, lo=0))
        put("rollout_fraction", _real("rollout_fraction", self.rollout_fraction, 0.0, 1.0))
        if self.profile is not None:
            if not isinstance(self.profile, str | os.PathLike):
                raise GSMConfigError(f"profile={self.profile!r}: must be a file path or null")
            put("profile", os.fspath(self.profile))
        if self.kurtosis_threshold is not None:
            put("kurtosis_threshold", _real("kurtosis_threshold", self.kurtosis_threshold))

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
        if _is_pairs(tl):
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
        _atomic_write(path, text)

    def replace(self, **changes: Any) -> GSMConfig:
        """A copy with ``changes`` applied, validated again."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)

    # ---- runtime

    def runtime(self, num_layers: int) -> GSMRuntime:
        """The runtime arrays for a model with ``num_layers`` layers."""
        mask = resolve_mask(self, num_layers)
        s = self.smooth_strength if self.enable else 0.0
        strength = np.where(mask, np.float32(s), np.float32(0.0)).astype(np.float32)
        window = 0 if self.window_size == ADAPTIVE else int(self.window_size)
        return GSMRuntime(
            strength=jnp.asarray(strength),
            window=jnp.asarray(window, jnp.int32),
            protect_first=jnp.asarray(self.protect_first, jnp.int32),
        )


def _format_of(path: Path) -> str:
    ext = path.suffix.lower()
    if ext == ".json":
        return "json"
    if ext in (".yaml", ".yml"):
        return "yaml"
    raise GSMConfigError(
        f"{path}: unknown config file extension {path.suffix!r}; use .yaml, .yml or .json"
    )


def _parse(path: Path, raw: bytes) -> Any:
    fmt = _format_of(path)
    if not raw.strip():
        raise GSMConfigError(f"{path}: config file is empty")
    try:
        text = raw.decode("utf-8")
        return json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise GSMConfigError(f"cannot parse config file {path} as {fmt.upper()}: {e}") from e


def _read_bytes(path: Path, what: str = "config file") -> bytes:
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
    return _parse(path, _read_bytes(path))


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- profiles


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _kurtosis(stat: Mapping[str, Any]) -> float | None:
    k = stat.get("excess_kurtosis")
    if k is None or not _is_real(k) or math.isnan(float(k)):
        return None
    return float(k)


def select_high_kurtosis(
    stats: Sequence[Mapping[str, Any]],
    fraction: float = DEFAULT_HIGH_KURTOSIS_FRACTION,
    threshold: float | None = None,
) -> list[tuple[int, str]]:
    """The high-kurtosis (layer, site) pairs of profile ``stats``.

    With ``threshold``: every pair with ``excess_kurtosis >= threshold``. Otherwise
    the top ``ceil(fraction * len(stats))`` pairs by excess kurtosis; ties go to the
    lower layer, then the earlier site in `SITES`. Pairs without a finite kurtosis
    (null/NaN) are never chosen. Returned sorted by (layer, site order).
    """
    fraction = _real("fraction", fraction, 0.0, 1.0)
    scored = []
    for st in stats:
        layer = _int("stats.layer", st.get("layer"), lo=0)
        site = _site("stats.site", st.get("site"))
        scored.append((_kurtosis(st), layer, site))
    valid = [(k, layer, site) for k, layer, site in scored if k is not None]
    if threshold is not None:
        threshold = _real("kurtosis_threshold", threshold)
        chosen = [(layer, site) for k, layer, site in valid if k >= threshold]
    else:
        n = min(len(valid), math.ceil(fraction * len(scored) - 1e-9))
        valid.sort(key=lambda t: (-t[0], t[1], SITES.index(t[2])))
        chosen = [(layer, site) for _, layer, site in valid[:n]]
    return sorted(set(chosen), key=lambda p: (p[0], SITES.index(p[1])))


def build_profile(
    model: str,
    num_layers: int,
    stats: Sequence[Mapping[str, Any]],
    *,
    sites: Sequence[str] = SITES,
    fraction: float = DEFAULT_HIGH_KURTOSIS_FRACTION,
    threshold: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Assemble a profile dict (schema v1); the profiler calls this, then `write_profile`."""
    num_layers = _int("num_layers", num_layers, lo=1)
    clean = [{k: _finite_or_none(v) for k, v in st.items()} for st in stats]
    prof: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "model": str(model),
        "num_layers": num_layers,
        "sites": list(_sites("sites", sites)),
        "kurtosis_definition": KURTOSIS_DEFINITION,
        **extra,
        "selection": {"fraction": fraction, "threshold": threshold},
        "stats": clean,
        "high_kurtosis": [
            [layer, site] for layer, site in select_high_kurtosis(clean, fraction, threshold)
        ],
    }
    return _validate_profile(prof, "profile")


def write_profile(path: str | os.PathLike, profile: Mapping[str, Any]) -> None:
    """Write a profile as strict JSON (non-finite numbers become null)."""
    prof = dict(profile)
    prof["stats"] = [{k: _finite_or_none(v) for k, v in st.items()} for st in prof["stats"]]
    _validate_profile(prof, str(path))
    _atomic_write(Path(path), json.dumps(prof, indent=2, allow_nan=False) + "\n")


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a profile JSON; `GSMConfigError` names the file and the problem."""
    path = Path(path)
    raw = _read_bytes(path, "profile")
    try:
        prof = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GSMConfigError(f"cannot parse profile {path} as JSON: {e}") from e
    return _validate_profile(prof, str(path))


def _validate_profile(prof: Any, where: str) -> dict[str, Any]:
    def bad(msg: str) -> GSMConfigError:
        return GSMConfigError(f"profile {where}: {msg}")

    if not isinstance(prof, dict):
        raise bad("must be a JSON object")
    if prof.get("schema") != PROFILE_SCHEMA:
        raise bad(f"schema={prof.get('schema')!r}, expected {PROFILE_SCHEMA!r}")
    for key in ("model", "num_layers", "sites", "stats", "high_kurtosis"):
        if key not in prof:
            raise bad(f"missing key {key!r}")
    try:
        n = _int("num_layers", prof["num_layers"], lo=1)
        _sites("sites", prof["sites"])
        if not isinstance(prof["stats"], list):
            raise GSMConfigError(f"stats: must be a list, got {type(prof['stats']).__name__}")
        for st in prof["stats"]:
            if not isinstance(st, dict):
                raise GSMConfigError(f"stats entry {st!r}: must be an object")
            _site("stats.site", st.get("site"))
            _int("stats.layer", st.get("layer"), lo=0, hi=n - 1)
        pairs = prof["high_kurtosis"]
        if not isinstance(pairs, list):
            raise GSMConfigError("high_kurtosis: must be a list of [layer, site] pairs")
        for p in pairs:
            if not (isinstance(p, list | tuple) and len(p) == 2):
                raise GSMConfigError(f"high_kurtosis entry {p!r}: must be [layer, site]")
            _int("high_kurtosis layer", p[0], lo=0, hi=n - 1)
            _site("high_kurtosis site", p[1])
    except GSMConfigError as e:
        raise bad(str(e)) from e
    return prof


# --------------------------------------------------------------------------- masks


def _check_num_layers(num_layers: Any) -> int:
    if not _is_int(num_layers) or num_layers < 1:
        raise GSMConfigError(f"num_layers={num_layers!r}: must be an integer >= 1")
    return int(num_layers)


def _check_layer(layer: int, num_layers: int, source: str) -> None:
    if layer >= num_layers:
        raise GSMConfigError(
            f"{source} names layer {layer}, but the model has {num_layers} layers "
            f"(0..{num_layers - 1})"
        )


def high_kurtosis_pairs(cfg: GSMConfig, num_layers: int) -> list[tuple[int, str]]:
    """The (layer, site) pairs that ``target_layers="high_kurtosis"`` selects from the profile."""
    if cfg.profile is None:
        raise GSMConfigError(
            "target_layers='high_kurtosis' needs a profile; run `gsm-jax profile` or "
            "pass profile=..."
        )
    prof = load_profile(cfg.profile)
    if prof["num_layers"] != num_layers:
        raise GSMConfigError(
            f"profile {cfg.profile} was made for a model with {prof['num_layers']} layers "
            f"(model {prof['model']!r}), but this model has {num_layers}; profile this model"
        )
    if cfg.kurtosis_threshold is not None:
        return select_high_kurtosis(prof["stats"], threshold=cfg.kurtosis_threshold)
    return [(int(layer), str(site)) for layer, site in prof["high_kurtosis"]]


def resolve_mask(cfg: GSMConfig, num_layers: int) -> np.ndarray:
    """bool[num_layers, len(SITES)]: which (layer, site) pairs are targeted.

    The result is the target (``target_layers``) restricted to ``cfg.sites``; it
    ignores ``enable`` (`GSMConfig.runtime` applies that).
    """
    num_layers = _check_num_layers(num_layers)
    mask = np.zeros((num_layers, len(SITES)), dtype=bool)
    tl = cfg.target_layers
    if tl == "all":
        mask[:] = True
    elif tl == "high_kurtosis":
        for layer, site in high_kurtosis_pairs(cfg, num_layers):
            _check_layer(layer, num_layers, f"profile {cfg.profile}")
            mask[layer, SITES.index(site)] = True
    elif _is_pairs(tl):
        for layer, sites in tl:
            _check_layer(layer, num_layers, "target_layers")
            for site in sites:
                mask[layer, SITES.index(site)] = True
    else:
        for layer in tl:
            _check_layer(layer, num_layers, "target_layers")
            mask[layer, :] = True
    allowed = np.array([s in cfg.sites for s in SITES], dtype=bool)
    return mask & allowed[None, :]


def describe(cfg: GSMConfig, num_layers: int) -> str:
    """A human-readable summary and per-layer table of the smoothed sites."""
    mask = resolve_mask(cfg, num_layers)
    window = (
        f"adaptive (clamp((p+1)//{ADAPTIVE_DIVISOR}, {ADAPTIVE_MIN_WINDOW}, {cfg.max_window}))"
        if cfg.window_size == ADAPTIVE
        else f"{cfg.window_size}"
    )
    target = cfg.target_layers
    if target == "high_kurtosis":
        how = (
            f"excess_kurtosis >= {cfg.kurtosis_threshold}"
            if cfg.kurtosis_threshold is not None
            else "stored selection"
        )
        target_s = f"high_kurtosis from {cfg.profile} ({how})"
    elif isinstance(target, str):
        target_s = target
    else:
        target_s = "explicit " + json.dumps(cfg.to_dict()["target_layers"])
    lines = [
        f"GSM {'enabled' if cfg.enable else 'DISABLED (nothing is smoothed)'}: "
        f"strength {cfg.smooth_strength} (guard {cfg.max_strength}), window {window}, "
        f"max_window {cfg.max_window}, protect_first {cfg.protect_first}, "
        f"precision {cfg.precision}",
        f"rollout {cfg.rollout_fraction * 100:g}% of requests; short-request bypass "
        + (f"below {cfg.short_request_tokens} tokens" if cfg.short_request_tokens else "off"),
        f"target_layers: {target_s}; sites allowed: {', '.join(cfg.sites) or 'none'}",
        f"{int(mask.sum())} of {mask.size} (layer, site) pairs smoothed",
    ]
    width = max(len(s) for s in SITES)
    lines.append(("layer  " + "  ".join(s.ljust(width) for s in SITES)).rstrip())
    for layer in range(num_layers):
        cells = [("yes" if mask[layer, j] else ".").ljust(width) for j in range(len(SITES))]
        lines.append(f"{layer:5d}  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- runtime


@struct.dataclass
class GSMRuntime:
    """The jitted step's GSM inputs: a pytree of arrays (same shapes for every config).

    ``strength``: f32[num_layers, len(SITES)], ``smooth_strength`` where targeted
    and enabled, else 0. ``window``: int32 scalar, 0 means adaptive.
    ``protect_first``: int32 scalar.
    """

    strength: jax.Array
    window: jax.Array
    protect_first: jax.Array

    @classmethod
    def disabled(cls, num_layers: int) -> GSMRuntime:
        """All zeros: no layer smoothed."""
        num_layers = _check_num_layers(num_layers)
        return cls(
            strength=jnp.zeros((num_layers, len(SITES)), jnp.float32),
            window=jnp.zeros((), jnp.int32),
            protect_first=jnp.zeros((), jnp.int32),
        )

    @property
    def num_layers(self) -> int:
        return int(self.strength.shape[0])


def rollout_value(request_id: str | int) -> float:
    """Stable u in [0, 1) for a request id: top 53 bits of blake2b(str(id)).

    The same in every process and Python version (no ``hash()`` salt); ``3`` and
    ``"3"`` are the same id.
    """
    if isinstance(request_id, bool) or not isinstance(request_id, str | numbers.Integral):
        raise InvalidInputError(f"request id {request_id!r}: must be a str or int")
    digest = hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


def row_enabled(
    cfg: GSMConfig,
    request_ids: Sequence[str | int] | None,
    total_tokens: Sequence[int],
) -> np.ndarray:
    """bool[B]: which batch rows are smoothed.

    A row is smoothed iff ``cfg.enable``, its ``total_tokens`` (prompt + new tokens)
    is not below ``short_request_tokens``, and ``rollout_value(id) < rollout_fraction``.
    Raising the fraction never drops a request that was already selected. With
    ``request_ids=None`` the row index stands in for the id: every row is selected
    when ``rollout_fraction == 1`` (and none at 0), but in between the choice is
    per batch position, not per request, so pass real ids for a gradual release.
    """
    tokens = [_int_input("total_tokens", t) for t in total_tokens]
    b = len(tokens)
    if request_ids is not None and len(request_ids) != b:
        raise InvalidInputError(
            f"request_ids has {len(request_ids)} entries but total_tokens has {b}"
        )
    out = np.full(b, cfg.enable, dtype=bool)
    if cfg.short_request_tokens > 0:
        out &= np.asarray(tokens, dtype=np.int64).reshape(b) >= cfg.short_request_tokens
    if cfg.rollout_fraction < 1.0:
        ids: Sequence[str | int] = request_ids if request_ids is not None else range(b)
        out &= np.array([rollout_value(i) < cfg.rollout_fraction for i in ids], dtype=bool)
    return out


def _int_input(name: str, v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise InvalidInputError(f"{name} entry {v!r}: must be an integer >= 0")
    return int(v)


# --------------------------------------------------------------------------- hot reload


class ConfigWatcher:
    """Keeps the last good `GSMConfig` from a file that may change while running.

    `poll` re-reads the file and compares its content hash (a stat alone misses
    same-size edits within one timestamp tick). An invalid, empty or missing file
    is refused: the reason is logged and kept in ``last_error``, and the last good
    config stays. If ``num_layers`` is given, a config is also refused when its
    layers or profile do not resolve for that model. ``on_change(new, old)`` runs
    after every change (reload or rollback). Thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        on_change: Callable[[GSMConfig, GSMConfig], None] | None = None,
        num_layers: int | None = None,
        history: int = 16,
    ) -> None:
        self.path = Path(path)
        self.on_change = on_change
        self.num_layers = None if num_layers is None else _check_num_layers(num_layers)
        self._lock = threading.RLock()
        self._history: list[GSMConfig] = []
        self._max_history = max(1, int(history))
        self.last_error: str | None = None
        raw = _read_bytes(self.path)
        self._config = self._load(raw)  # a bad file at start is an error: no good config yet
        self._seen = hashlib.blake2b(raw).digest()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def config(self) -> GSMConfig:
        """The config in force."""
        with self._lock:
            return self._config

    def _load(self, raw: bytes) -> GSMConfig:
        data = _parse(self.path, raw)
        try:
            cfg = GSMConfig.from_dict(data)
            if self.num_layers is not None:
                resolve_mask(cfg, self.num_layers)
        except GSMConfigError as e:
            raise GSMConfigError(f"{self.path}: {e}") from e
        return cfg

    def _set(self, new: GSMConfig, *, push: bool) -> None:
        old = self._config
        if push:
            self._history.append(old)
            del self._history[: -self._max_history]
        self._config = new
        if self.on_change is not None:
            try:
                self.on_change(new, old)
            except Exception:
                log.exception("GSM config on_change callback failed")

    def poll(self) -> bool:
        """Reload if the file changed; True iff a new valid config took effect."""
        with self._lock:
            try:
                raw = _read_bytes(self.path)
            except GSMConfigError as e:
                self._refuse(str(e))
                self._seen = None
                return False
            digest = hashlib.blake2b(raw).digest()
            if digest == self._seen:
                return False
            self._seen = digest
            try:
                cfg = self._load(raw)
            except GSMConfigError as e:
                self._refuse(str(e))
                return False
            self.last_error = None
            if cfg == self._config:
                return False
            log.info("GSM config reloaded from %s", self.path)
            self._set(cfg, push=True)
            return True

    def _refuse(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("refused GSM config: %s; keeping the last good config", msg)
        self.last_error = msg

    def rollback(self) -> GSMConfig:
        """Restore the previous good config (until the file changes again) and return it."""
        with self._lock:
            if not self._history:
                raise GSMConfigError(f"{self.path}: no previous GSM config to roll back to")
            prev = self._history.pop()
            log.info("GSM config rolled back")
            self._set(prev, push=False)
            return prev

    def start(self, interval: float = 1.0) -> ConfigWatcher:
        """Poll every ``interval`` seconds in a daemon thread (no-op if running)."""
        interval = _real("interval", interval, lo=0.001)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="gsm-config-watcher", daemon=True
            )
            self._thread.start()
        return self

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.poll()
            except Exception:  # never let the watcher thread die
                log.exception("GSM config watcher poll failed")

    def stop(self) -> None:
        """Stop the background thread, if any, and wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def __enter__(self) -> ConfigWatcher:
        """Start polling (interval 1 s unless `start` was called already)."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
