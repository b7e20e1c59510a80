"""JAX's persistent compilation cache for gsm-jax, and one line on stderr while XLA compiles.

Every `gsm-jax` command turns the cache on before its first compilation, so a second
identical call loads its programs from disk instead of compiling them again
(`enable_compilation_cache`). Python code turns it on with the same call
(``gsm_jax.enable_compilation_cache()``); ``import gsm_jax`` alone changes nothing in
JAX's configuration, because the setting is process-wide: it would also cache the
programs of a notebook's other JAX code.

Where: ``$GSM_JAX_COMPILATION_CACHE`` when it names a folder, else
``$XDG_CACHE_HOME/gsm-jax/jax`` (``~/.cache/gsm-jax/jax``). ``GSM_JAX_COMPILATION_CACHE=0``
(or ``off``) turns it off; JAX's own ``JAX_ENABLE_COMPILATION_CACHE=false`` does too. A
cache directory set already (``jax_compilation_cache_dir`` / ``JAX_COMPILATION_CACHE_DIR``)
is left as it is. Every program is written, however quick its compilation
(`MIN_COMPILE_TIME_S`; JAX's default, 1 s, would leave a small model's decode and sampling
programs out, and a second call would compile them again): a
``jax_persistent_cache_min_compile_time_secs`` the user set (config or
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``) stands. The folder is bounded by an LRU
limit (`MAX_SIZE_BYTES` unless ``jax_compilation_cache_max_size`` is set). The cache is
trusted code: do not point it at a folder others can write.

`cached_call` saves a traced program (``jax.export``) in ``<cache>/exported/`` beside the
compiled ones, keyed by the source of gsm_jax, the jax version, the static arguments and
the argument types: `generate` goes through it, so a second process skips tracing too.
`save_executable` / `load_executable` keep whole compiled programs in
``<cache>/executables/`` (keyed as above and by the CPU, devices and ``XLA_FLAGS``): the
serving engine's programs load from there without tracing, lowering or compiling.

`announce_compilation` prints one line on stderr when a compilation has run for
`ANNOUNCE_AFTER_S` seconds (``GSM_JAX_COMPILE_NOTICE_S`` changes it; once per process), so a
long first call is not silent;
`compilation_summary` gives one line of what compiled and what came from the cache.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

ENV = "GSM_JAX_COMPILATION_CACHE"
OFF_VALUES = frozenset({"0", "off", "false", "no", "none", "disable", "disabled"})
MAX_SIZE_BYTES = 4 * 2**30
MIN_COMPILE_TIME_S = 0.0
_JAX_MIN_COMPILE_TIME_DEFAULT = 1.0
ANNOUNCE_AFTER_S = 2.0

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_enabled: Path | None = None
_enable_tried = False


def host_fingerprint() -> str:
    """A short hash of this host's CPU model and instruction-set flags. XLA:CPU compiles for
    the host's features (AVX-512, AMX, ...) and JAX's cache key does not include them, so a
    cache folder shared between different CPUs (a home directory on NFS, a copied
    ``~/.cache``) could hand one machine code it cannot run: each CPU gets its own folder."""
    import hashlib
    import platform

    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gsm-jax/jax/<cpu>``, or ``~/.cache/gsm-jax/jax/<cpu>`` (<cpu>:
    `host_fingerprint`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gsm-jax" / "jax" / host_fingerprint()


def requested_cache_dir() -> Path | None:
    """The folder `enable_compilation_cache` uses: None when ``GSM_JAX_COMPILATION_CACHE``
    turns the cache off, that variable's folder when it names one, else the default."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if value.lower() in ("", "1", "on", "true", "yes"):
        return default_cache_dir()
    return Path(value).expanduser()


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on for this process; the folder in use, or
    None when it stays off (see the module doc for the folder and how to switch it off).

    Idempotent and cheap after the first call. ``directory`` overrides the folder (not the
    switch-off). Programs compiled before the call were not written; the ones after are.
    """
    global _enabled, _enable_tried
    with _lock:
        if _enable_tried:
            return _enabled
        _enable_tried = True
        import jax

        target = requested_cache_dir()
        if target is None or not jax.config.jax_enable_compilation_cache:
            return None
        configured = jax.config.jax_compilation_cache_dir
        if configured:  # the user's own choice stands
            _enabled = Path(configured)
            return _enabled
        target = Path(directory).expanduser() if directory is not None else target
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"[gsm-jax] compilation cache off: cannot create {target} ({e})",
                  file=sys.stderr)
            return None
        jax.config.update("jax_compilation_cache_dir", str(target))
        if jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
        if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
                and jax.config.jax_persistent_cache_min_compile_time_secs
                == _JAX_MIN_COMPILE_TIME_DEFAULT):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
        # JAX decides once per process whether the cache is used, at its first compilation:
        # a process that compiled before this call must decide again.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
        _enabled = target
        return _enabled


def compilation_cache_dir() -> Path | None:
    """The folder `enable_compilation_cache` turned on in this process (None: not on)."""
    return _enabled


class _Announcer:
    """JAX monitoring listeners: a compilation that runs `delay_s` prints one line (once per
    process); counts compilations, their seconds and the persistent-cache hits."""

    def __init__(self, stream: TextIO | None, delay_s: float) -> None:
        self.stream, self.delay_s = stream, delay_s
        self.announced = False
        self.compiles = 0
        self.seconds = 0.0
        self.hits = 0
        self._timers: dict[int, threading.Timer] = {}
        self._lock = threading.Lock()

    def message(self) -> str:
        where = compilation_cache_dir()
        if where is not None:
            tail = (f"programs are saved in {where} and loaded from there next time; "
                    f"{ENV}=0 turns that off")
        else:
            tail = "the persistent compilation cache is off"
        return f"[gsm-jax] compiling XLA programs for these shapes (once per shape; {tail}) ..."

    def _fire(self) -> None:
        with self._lock:
            if self.announced:
                return
            self.announced = True
        stream = self.stream if self.stream is not None else sys.stderr
        print(self.message(), file=stream, flush=True)

    def on_scalar(self, event: str, value: float, **kwargs) -> None:
        if event != _BACKEND_COMPILE or self.announced:
            return
        timer = threading.Timer(self.delay_s, self._fire)
        timer.daemon = True
        with self._lock:
            old = self._timers.pop(threading.get_ident(), None)
            self._timers[threading.get_ident()] = timer
        if old is not None:
            old.cancel()
        timer.start()

    def on_duration(self, event: str, seconds: float, **kwargs) -> None:
        if event != _BACKEND_COMPILE:
            return
        with self._lock:
            timer = self._timers.pop(threading.get_ident(), None)
            self.compiles += 1
            self.seconds += seconds
        if timer is not None:
            timer.cancel()

    def on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT:
            with self._lock:
                self.hits += 1


_announcer: _Announcer | None = None


def announce_compilation(stream: TextIO | None = None, delay_s: float | None = None) -> None:
    """Print one line on ``stream`` (stderr) when a compilation runs ``delay_s`` seconds
    (default: ``$GSM_JAX_COMPILE_NOTICE_S`` or `ANNOUNCE_AFTER_S`; once per process; later
    calls change nothing) and count compilations for `compilation_summary`."""
    global _announcer
    if delay_s is None:
        try:
            delay_s = float(os.environ.get("GSM_JAX_COMPILE_NOTICE_S", ANNOUNCE_AFTER_S))
        except ValueError:
            delay_s = ANNOUNCE_AFTER_S
    with _lock:
        if _announcer is not None:
            return
        from jax import monitoring

        _announcer = a = _Announcer(stream, delay_s)
        monitoring.register_scalar_listener(a.on_scalar)
        monitoring.register_event_duration_secs_listener(a.on_duration)
        monitoring.register_event_listener(a.on_event)


def compilation_summary() -> str | None:
    """One line: programs compiled and loaded from the persistent cache since
    `announce_compilation` (None before it, or when nothing took a second)."""
    a = _announcer
    if a is None or (a.seconds < 1.0 and a.hits == 0):
        return None
    where = compilation_cache_dir()
    cache = (f"{a.hits} of them loaded from the persistent cache ({where})" if where is not None
             else "persistent cache off")
    return (f"[gsm-jax] XLA: {a.compiles} programs ready in {a.seconds:.1f} s; {cache}")


# ----------------------------------------------------------------------------- traced programs
#
# The persistent cache saves XLA's compilation, not the Python tracing and lowering in
# front of it: for SmolLM2's generation loop (30 layers, prefill and decode) those are ~0.9
# of the ~1.7 s a second CLI call still spent making its program ready. `cached_call` keeps
# the traced program too, as a `jax.export` artifact beside the compilation cache: a later
# process deserializes it (milliseconds), and the program it lowers to is the one the
# compilation cache already holds.

EXPORT_SUBDIR = "exported"
_programs: dict[str, Any] = {}  # key -> jitted call of the Exported, or None: call directly
_warned: set[str] = set()


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of the gsm_jax source this process runs (every .py and .cc file of gsm_jax and
    of the gsm_jax.models / gsm_jax.pallas_kernels packages, wherever they are installed) and of
    the jax / jaxlib versions: a saved program is only reused by the code that traced it."""
    import hashlib
    import importlib.util

    import jax
    import jaxlib

    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    for pkg in ("gsm_jax", "gsm_jax.models", "gsm_jax.pallas_kernels"):
        spec = importlib.util.find_spec(pkg)
        for root in (spec.submodule_search_locations or []) if spec else []:
            root = Path(root)
            for f in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
                rel = f.relative_to(root).as_posix()
                if pkg == "gsm_jax" and rel.split("/")[0] in ("models", "pallas_kernels"):
                    continue  # hashed under their own package names
                h.update(f"{pkg}/{rel}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        print(f"[gsm-jax] {message}", file=sys.stderr, flush=True)


def _program_key(name: str, static: dict, treedef: Any, leaves: list, extra: str = ""
                 ) -> str | None:
    """The saved program's name for these static arguments and argument types, or None when
    they cannot be named reliably (an abbreviated repr: large arrays in a static value)."""
    import hashlib

    import jax

    from gsm_jax.pallas_kernels import int8_matvec_cpu

    # a program traced with the CPU int8 kernel differs from one traced without it
    kernels = f" cpu_kernels={int(int8_matvec_cpu.possible())}" \
        if jax.default_backend() == "cpu" else ""
    text = repr(sorted(static.items())) + str(treedef) + extra + kernels
    if "..." in text:
        return None
    avals = [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
             for x in leaves]
    h = hashlib.sha256("\0".join([name, source_fingerprint(), jax.default_backend(), text,
                                  repr(avals)]).encode())
    return f"{name}-{h.hexdigest()[:40]}"


def cached_call(name: str, fn: Callable, args: tuple, static: dict) -> Any:
    """``fn(*args, **static)`` (fn: a jitted function, `static` its static arguments) through
    a saved traced program when the persistent compilation cache is on
    (`enable_compilation_cache`): the first process with these argument types traces and
    exports it to ``<cache>/exported/``, later ones load it instead of tracing. The same
    program either way (tested: equal outputs). Called directly, as before, when the cache
    is off, for arguments placed on more than one device, or when the program cannot be
    exported (said once on stderr)."""
    import jax

    where = compilation_cache_dir()
    leaves, treedef = jax.tree.flatten(args)
    if where is None or any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
                            for x in leaves):
        return fn(*args, **static)
    # PRNG keys travel as their key data (jax.export takes plain arrays), rewrapped inside
    impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
    keyed = [x if impl is None else jax.random.key_data(x)
             for x, impl in zip(leaves, impls, strict=True)]
    key = _program_key(name, static, treedef, keyed, repr([str(i) for i in impls]))
    if key is None:
        return fn(*args, **static)
    call = _programs.get(key, False)
    if call is False:
        call = _programs[key] = _load_or_export(where, key, fn, static, treedef, keyed, impls)
    if call is None:
        return fn(*args, **static)
    return call(*keyed)


def _is_key(x: Any) -> bool:
    import jax

    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def exported_program(name: str, fn: Callable, args: tuple, static: dict) -> Any:
    """The traced program of ``fn(*args, **static)`` as a ``jax.export.Exported`` taking the
    flat leaves of `args` (arrays or ShapeDtypeStructs; no PRNG keys): loaded from
    ``<cache>/exported/`` when a process with the same source, jax and argument types
    saved it, else traced, exported and saved. None when the compilation cache is off,
    for arguments on more than one device, or when it cannot be exported (said once).
    (The serving engine saves its programs' executables whole instead: `save_executable`.)"""
    import jax

    where = compilation_cache_dir()
    leaves, treedef = jax.tree.flatten(args)
    if where is None or any(len(getattr(x, "sharding", None).device_set) > 1
                            for x in leaves if getattr(x, "sharding", None) is not None):
        return None
    key = _program_key(name, static, treedef, leaves)
    if key is None:
        return None
    return _exported(where, key, fn, static, treedef, leaves, [None] * len(leaves))


def _exported(where: Path, key: str, fn: Callable, static: dict, treedef: Any,
              keyed: list, impls: list) -> Any:
    """The saved program `key` (loaded, else traced from `fn` and saved), taking `keyed`
    (the flat arguments, PRNG keys as key data; `impls`: their key impls); None when it
    cannot be exported."""
    import jax

    from gsm_jax.pallas_kernels import int8_matvec_cpu

    path = where / EXPORT_SUBDIR / f"{key}.jaxexport"
    if path.is_file():
        try:
            blob = path.read_bytes()
            int8_matvec_cpu.ensure_registered(blob)  # a call to the kernel: registered first
            return jax.export.deserialize(bytearray(blob))
        except Exception as e:  # a truncated or foreign file: traced again, rewritten
            _warn_once(f"bad {path}", f"ignoring the unreadable saved program {path} ({e})")

    def flat(*values):
        values = [v if impl is None else jax.random.wrap_key_data(v, impl=impl)
                  for v, impl in zip(values, impls, strict=True)]
        return fn(*jax.tree.unflatten(treedef, values), **static)

    flat.__name__ = flat.__qualname__ = f"trace_{key.split('-')[0]}"
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
             for x in keyed]
    try:
        # gsm_jax's own CPU kernel is a custom call jax.export would refuse as unstable;
        # its target is versioned with this source (`source_fingerprint` hashes the .cc)
        exported = jax.export.export(jax.jit(flat), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(int8_matvec_cpu.TARGET)])(*avals)
        blob = exported.serialize()
    except Exception as e:  # e.g. host callbacks, or flatbuffers missing
        _warn_once(f"export {key.split('-')[0]}",
                   f"{key.split('-')[0]}: traced on every run, not saved "
                   f"({type(e).__name__}: {e})")
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except OSError as e:
        _warn_once(f"write {path}", f"could not save {path} ({e})")
    return exported


def _load_or_export(where: Path, key: str, fn: Callable, static: dict, treedef: Any,
                    keyed: list, impls: list) -> Any:
    """The jitted call of the saved program `key` (`_exported`); None when it cannot be
    exported."""
    import jax

    exported = _exported(where, key, fn, static, treedef, keyed, impls)
    if exported is None:
        return None

    def call(*values):
        return exported.call(*values)

    call.__name__ = call.__qualname__ = key.split("-")[0]  # the name in JAX's logs
    return jax.jit(call)


EXECUTABLE_SUBDIR = "executables"


def _machine_text() -> str:
    """What a compiled executable depends on beyond its program: the CPU (`host_fingerprint`:
    a user-given cache folder may be shared between machines), the devices and XLA's flags."""
    import jax

    devices = jax.devices()
    return (f"host {host_fingerprint()} devices {len(devices)} {devices[0].device_kind} "
            f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}")


def executable_path(name: str, args: tuple, static: dict) -> Path | None:
    """Where the compiled executable of ``fn(*args, **static)`` (program `name`, taking the
    flat leaves of `args`: ShapeDtypeStructs or arrays on one device) is saved: beside the
    traced programs, keyed like them (`exported_program`) and by `_machine_text`. None when
    the compilation cache is off or the arguments cannot be keyed."""
    import jax

    where = compilation_cache_dir()
    leaves, treedef = jax.tree.flatten(args)
    if where is None or any(len(getattr(x, "sharding", None).device_set) > 1
                            for x in leaves if getattr(x, "sharding", None) is not None):
        return None
    key = _program_key(name, static, treedef, leaves, _machine_text())
    return None if key is None else where / EXECUTABLE_SUBDIR / f"{key}.jaxexec"


def load_executable(path: Path | None, n_args: int, out_tree: Any) -> Any:
    """The executable `save_executable` wrote at `path` (taking `n_args` flat arguments and
    returning `out_tree`), loaded without tracing, lowering or compiling; None when there is
    none or it cannot be read (said once: it is then built again and rewritten)."""
    if path is None or not path.is_file():
        return None
    import jax
    from jax.experimental import serialize_executable

    from gsm_jax.pallas_kernels import int8_matvec_cpu

    try:
        blob = path.read_bytes()
        int8_matvec_cpu.ensure_registered(blob)  # a call to the kernel: registered first
        in_tree = jax.tree.structure((tuple(range(n_args)), {}))
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception as e:  # truncated, foreign or stale: built again
        _warn_once(f"bad {path}", f"ignoring the unreadable saved executable {path} "
                   f"({type(e).__name__}: {e})")
        return None


def save_executable(path: Path | None, compiled: Any) -> None:
    """Write a compiled executable (`jax.stages.Compiled` of a function of flat arguments) at
    `path` for `load_executable`; a failure is said once and otherwise ignored."""
    if path is None:
        return
    from jax.experimental import serialize_executable

    try:
        blob = serialize_executable.serialize(compiled)[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except Exception as e:  # an executable that cannot be serialized, a read-only folder
        _warn_once(f"save {path.parent}", f"compiled programs are not saved in {path.parent} "
                   f"({type(e).__name__}: {e})")
