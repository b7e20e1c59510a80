"""GSM profiles: build, select the high-kurtosis pairs, write and read.

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
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gsm_jax.errors import GSMConfigError
from gsm_jax.gsm.schema import (
    SITES,
    atomic_write,
    check_int,
    check_real,
    check_site,
    check_sites,
    is_real,
    read_bytes,
)

PROFILE_SCHEMA = "gsm-jax/profile/v1"
KURTOSIS_DEFINITION = (
    "excess kurtosis = m4 / m2**2 - 3, with m2 and m4 the central moments over all "
    "elements (every token and channel of every calibration sequence) of one (layer, site)"
)
DEFAULT_HIGH_KURTOSIS_FRACTION = 0.25


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _kurtosis(stat: Mapping[str, Any]) -> float | None:
    k = stat.get("excess_kurtosis")
    if k is None or not is_real(k) or math.isnan(float(k)):
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
    fraction = check_real("fraction", fraction, 0.0, 1.0)
    scored = []
    for st in stats:
        layer = check_int("stats.layer", st.get("layer"), lo=0)
        site = check_site("stats.site", st.get("site"))
        scored.append((_kurtosis(st), layer, site))
    valid = [(k, layer, site) for k, layer, site in scored if k is not None]
    if threshold is not None:
        threshold = check_real("kurtosis_threshold", threshold)
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
    num_layers = check_int("num_layers", num_layers, lo=1)
    clean = [{k: _finite_or_none(v) for k, v in st.items()} for st in stats]
    prof: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "model": str(model),
        "num_layers": num_layers,
        "sites": list(check_sites("sites", sites)),
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
    atomic_write(Path(path), json.dumps(prof, indent=2, allow_nan=False) + "\n")


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a profile JSON; `GSMConfigError` names the file and the problem."""
    path = Path(path)
    raw = read_bytes(path, "profile")
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
        n = check_int("num_layers", prof["num_layers"], lo=1)
        check_sites("sites", prof["sites"])
        if not isinstance(prof["stats"], list):
            raise GSMConfigError(f"stats: must be a list, got {type(prof['stats']).__name__}")
        for st in prof["stats"]:
            if not isinstance(st, dict):
                raise GSMConfigError(f"stats entry {st!r}: must be an object")
            check_site("stats.site", st.get("site"))
            check_int("stats.layer", st.get("layer"), lo=0, hi=n - 1)
        pairs = prof["high_kurtosis"]
        if not isinstance(pairs, list):
            raise GSMConfigError("high_kurtosis: must be a list of [layer, site] pairs")
        for p in pairs:
            if not (isinstance(p, list | tuple) and len(p) == 2):
                raise GSMConfigError(f"high_kurtosis entry {p!r}: must be [layer, site]")
            check_int("high_kurtosis layer", p[0], lo=0, hi=n - 1)
            check_site("high_kurtosis site", p[1])
    except GSMConfigError as e:
        raise bad(str(e)) from e
    return prof
