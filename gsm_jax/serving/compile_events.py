"""A process-wide count of the XLA programs this process built, from JAX's own events.

JAX records `/jax/core/compile/backend_compile_duration` once per executable it builds:
around `compiler.compile_or_get_cached`, so a program compiled by XLA and one loaded from
the persistent compilation cache both count once (a load is work done, and a program
the server had not built). A jit call that finds its program in memory records nothing;
an eager op at a new shape (its own little jit) counts like any program. Checked in
tests/test_server_startup.py: first call 1, same shapes again 0, a new shape 1, a
persistent-cache hit 1.

`install()` registers the listener once (idempotent, thread-safe); `count()` is the
number of programs since then; `recent()` names the last ones (JAX's `fun_name`, e.g.
"jit(_decode)"); `subscribe(fn)` calls `fn(name, seconds)` after each (on the compiling
thread: keep it short). The server exports the count on /metrics
(`gsm_jax_compilations_total`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["EVENT", "count", "install", "recent", "subscribe"]

EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_installed = False
_count = 0
_recent: deque[tuple[float, str, float]] = deque(maxlen=256)  # (time, name, seconds)
_listeners: list[Callable[[str, float], None]] = []


def _on_duration(event: str, seconds: float, **kwargs: object) -> None:
    global _count
    if event != EVENT:
        return
    name = str(kwargs.get("fun_name", "?"))
    with _lock:
        _count += 1
        _recent.append((time.time(), name, float(seconds)))
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(name, float(seconds))
        except Exception:  # a listener's bug must not break a compilation
            pass


def install() -> None:
    """Start counting (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_duration)
        _installed = True


def count() -> int:
    """Programs built (compiled or loaded from the persistent cache) since `install()`."""
    return _count


def recent(n: int | None = None) -> list[tuple[float, str, float]]:
    """The last `n` (all kept: 256) programs built: (wall time, JAX's name, seconds)."""
    with _lock:
        out = list(_recent)
    return out if n is None else out[-n:] if n > 0 else []


def subscribe(fn: Callable[[str, float], None]) -> Callable[[], None]:
    """Call `fn(name, seconds)` after each program built; returns the unsubscribe call."""
    install()
    with _lock:
        _listeners.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return unsubscribe
