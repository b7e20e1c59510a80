"""Hot reload: `ConfigWatcher` keeps the last good `GSMConfig` from a file that may change."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from gsm_jax.errors import GSMConfigError
from gsm_jax.gsm.resolve import check_num_layers, resolve_mask
from gsm_jax.gsm.schema import GSMConfig, check_real, parse_mapping, read_bytes

# The logger keeps the name it had before the split (gsm_jax/config.py), so logging
# set up for "gsm_jax.config" still sees refused and reloaded configs.
log = logging.getLogger("gsm_jax.config")


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
        self.num_layers = None if num_layers is None else check_num_layers(num_layers)
        self._lock = threading.RLock()
        self._history: list[GSMConfig] = []
        self._max_history = max(1, int(history))
        self.last_error: str | None = None
        raw = read_bytes(self.path)
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
        data = parse_mapping(self.path, raw)
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
                raw = read_bytes(self.path)
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
        interval = check_real("interval", interval, lo=0.001)
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
