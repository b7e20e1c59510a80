"""GSM as a live, versioned object of a running server.

Every change (a PUT of a new config, a rollout fraction, a file reload) makes a new
version with the next number; rollback returns to the version before the one in
force (its number comes back: responses say which config served them, and a
number never names two configs). Each request is assigned, once, a version and
an *arm*:

- "gsm": smoothed by the version's config;
- "control": left out by the rollout, `rollout_value(request id) >= fraction`
  (a stable blake2b hash: a client's retries, which carry the same id, land in
  the same arm, and raising the fraction never moves a request out of "gsm");
- "bypass": shorter than the config's `short_request_tokens`;
- "off": the version has no config, or `enable: false`.

Validation is the library's: `GSMConfig` (types, ranges, the strength guard),
the model's layers and profile, and the engine's compiled statics
(`max_window`, `precision`); a refused change leaves the version in force.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gsm_jax.config import GSMConfig, rollout_value
from gsm_jax.errors import GSMConfigError

__all__ = ["ARMS", "GSMVersion", "LiveGSM"]

ARMS = ("gsm", "control", "bypass", "off")


@dataclass(frozen=True)
class GSMVersion:
    number: int
    config: GSMConfig | None
    source: str  # "start" | "put" | "rollout" | "file" | "rollback"
    created: float  # time.time()

    @property
    def rollout_fraction(self) -> float:
        return 0.0 if self.config is None else self.config.rollout_fraction

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.number,
                "config": None if self.config is None else self.config.to_dict(),
                "rollout_fraction": self.rollout_fraction, "source": self.source,
                "created": round(self.created, 3)}


class LiveGSM:
    """The versions of a server's GSM config. Thread-safe.

    `check(config) -> config` is the engine's validation (layers, profile, statics).
    `on_change(version)` runs after every change.
    """

    def __init__(self, initial: GSMConfig | None, *,
                 check: Callable[[GSMConfig], GSMConfig] | None = None,
                 on_change: Callable[[GSMVersion], None] | None = None,
                 history: int = 64) -> None:
        self._check = check or (lambda c: c)
        self._lock = threading.Lock()
        self._next = 1
        self._history: list[GSMVersion] = []  # in force last
        self._max_history = max(2, int(history))
        self.on_change = on_change
        cfg = None if initial is None else self._check(initial)
        self._push(cfg, "start")

    # ---------------------------------------------------------------- state

    @property
    def current(self) -> GSMVersion:
        with self._lock:
            return self._history[-1]

    def state(self) -> dict[str, Any]:
        """`{"version", "config", "rollout_fraction", "source", "created", "history"}`."""
        with self._lock:
            out = self._history[-1].to_dict()
            out["history"] = [v.number for v in self._history]
            return out

    # ---------------------------------------------------------------- changes

    def _push(self, cfg: GSMConfig | None, source: str) -> GSMVersion:
        v = GSMVersion(self._next, cfg, source, time.time())
        self._next += 1
        self._history.append(v)
        del self._history[: -self._max_history]
        return v

    def _changed(self, v: GSMVersion) -> GSMVersion:
        if self.on_change is not None:
            self.on_change(v)
        return v

    def put(self, data: Mapping[str, Any] | GSMConfig, *, source: str = "put") -> GSMVersion:
        """A new version from a config (a mapping is validated as `GSMConfig.from_dict`)."""
        if isinstance(data, GSMConfig):
            cfg = data
        elif isinstance(data, Mapping):
            cfg = GSMConfig.from_dict(data)
        else:
            raise GSMConfigError(f"a GSM config must be a JSON object, got "
                                 f"{type(data).__name__}")
        cfg = self._check(cfg)
        with self._lock:
            v = self._push(cfg, source)
        return self._changed(v)

    def rollout(self, fraction: Any) -> GSMVersion:
        """A new version: the config in force with `rollout_fraction = fraction`."""
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
                or not 0.0 <= float(fraction) <= 1.0:
            raise GSMConfigError(f"fraction={fraction!r}: must be a number in [0, 1]")
        with self._lock:
            cfg = self._history[-1].config
            if cfg is None:
                raise GSMConfigError("no GSM config is in force: PUT /admin/gsm one first")
            v = self._push(cfg.replace(rollout_fraction=float(fraction)), "rollout")
        return self._changed(v)

    def rollback(self) -> GSMVersion:
        """Back to the version before the one in force (which is dropped)."""
        with self._lock:
            if len(self._history) < 2:
                raise GSMConfigError(f"nothing to roll back to: version "
                                     f"{self._history[-1].number} is the oldest kept")
            self._history.pop()
            old = self._history[-1]
            v = GSMVersion(old.number, old.config, "rollback", time.time())
            self._history[-1] = v
        return self._changed(v)

    # ---------------------------------------------------------------- requests

    def assign(self, request_id: str | int, total_tokens: int) -> tuple[GSMVersion, str]:
        """(version, arm) for one request: see the module docstring."""
        v = self.current
        cfg = v.config
        if cfg is None or not cfg.enable:
            return v, "off"
        if cfg.short_request_tokens > 0 and total_tokens < cfg.short_request_tokens:
            return v, "bypass"
        if cfg.rollout_fraction < 1.0 and rollout_value(request_id) >= cfg.rollout_fraction:
            return v, "control"
        return v, "gsm"
