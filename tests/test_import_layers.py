"""Imports flow one way, lowest layer first: no module imports from a layer above its own.

The layers, lowest first (`LAYERS` below is the same map, as data):

0 base        gsm_jax.errors; gsm_jax.pallas_kernels.* (the Pallas kernels and their
              pure-JAX references); gsm_jax.data (where the packaged data is).
1 GSM core    gsm_jax.smoothing (the filter); gsm_jax.gsm.* (GSMConfig, profiles, what a
              config selects, hot reload) and gsm_jax.config, its re-export module.
2 models      gsm_jax.models.* (the model families, their sites hooks, weight formats and
              readers); gsm_jax.params (the weights container, used by the models);
              gsm_jax.tokenizer (models/gguf_reader.py builds one from a GGUF file).
3 runtime     gsm_jax.gsm_runtime (a GSM config -> `GSMInputs`, the models' GSM `Sites`
              hook, for one call: it builds a models-layer object, so it sits above them);
              generation, speculative, quant, sharding, planner, collectives, loading,
              families; gsm_jax.serving.* (engine, scheduler, live GSM state, HTTP app,
              metrics, protocol; bench_client and launch, the HTTP load test and the
              server process it drives: the workflow's engine benchmark takes its
              statistics from the load test, not the other way round).
4 workflow    gsm_jax.workflow.* (profile, calibrate, evaluate, bench, data, metrics,
              plots).
5 evidence    gsm_jax.workflow.evidence.*, gsm_jax.workflow.report and what only the report
  / report    and the evidence share: report_sections, results, overhead.
6 CLI/facade  gsm_jax (the package `__init__`: the public API), gsm_jax.cli and every
              *.cli module.

A module imports freely from its own layer and every layer below. Every import counts:
module level, inside functions, under ``if TYPE_CHECKING``. ``import gsm_jax`` (or ``from
gsm_jax import load``) is an import of the facade, layer 6. Not judged: imports by string
(`importlib.import_module`, the CLI's ``"module:function"`` table), and the package
``__init__`` files Python runs on the way to a module (``import gsm_jax.x`` runs
gsm_jax/__init__.py first; that is how packages work, not a dependency the importer chose).

`models/` and `pallas_kernels/` install as gsm_jax.models and gsm_jax.pallas_kernels
(pyproject's package-dir), so their files are read under those names. A module with no
layer fails `test_every_module_has_a_layer`: put a new one where its role says.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Directory -> the package its files install as.
SOURCE_DIRS = {"gsm_jax": "gsm_jax", "models": "gsm_jax.models",
               "pallas_kernels": "gsm_jax.pallas_kernels"}

LAYER_NAMES = ("base", "GSM core", "models", "runtime", "workflow", "evidence/report",
               "CLI/facade")

# Module -> layer. A package entry (one that has submodules) covers its submodules, unless a
# longer entry names them. The root package "gsm_jax" covers only itself (the facade).
LAYERS: dict[str, int] = {
    # 0 base
    "gsm_jax.errors": 0,
    "gsm_jax.compile_cache": 0,  # standard library and jax only
    "gsm_jax.in_place": 0,  # jax only: in-place scatters into donated buffers
    "gsm_jax.data": 0,  # the standard library only: where the packaged data is
    "gsm_jax.pallas_kernels": 0,
    # 1 GSM core
    "gsm_jax.smoothing": 1,
    "gsm_jax.gsm": 1,
    "gsm_jax.config": 1,
    # 2 models
    "gsm_jax.models": 2,
    "gsm_jax.params": 2,
    "gsm_jax.tokenizer": 2,
    "gsm_jax.chat_formats": 2,  # the tokenizer renders DeepSeek chats with it (no jax)
    # 3 runtime
    "gsm_jax.gsm_runtime": 3,
    "gsm_jax.generation": 3,
    "gsm_jax.speculative": 3,
    "gsm_jax.quant": 3,
    "gsm_jax.sharding": 3,
    "gsm_jax.planner": 3,
    "gsm_jax.collectives": 3,
    "gsm_jax.loading": 3,
    "gsm_jax.families": 3,
    "gsm_jax.serving": 3,
    # 4 workflow
    "gsm_jax.workflow": 4,
    # 5 evidence / report
    "gsm_jax.workflow.evidence": 5,
    "gsm_jax.workflow.report": 5,
    "gsm_jax.workflow.report_sections": 5,
    "gsm_jax.workflow.results": 5,
    "gsm_jax.workflow.overhead": 5,
    # 6 CLI / facade
    "gsm_jax": 6,
    "gsm_jax.cli": 6,
    "gsm_jax.workflow.cli": 6,
    "gsm_jax.serving.cli": 6,
}


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file."""
    out = {}
    for directory, package in SOURCE_DIRS.items():
        base = ROOT / directory
        for dirpath, dirnames, filenames in os.walk(base):  # symlinked folders not followed
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = Path(dirpath).relative_to(base).parts
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                parts = [package, *rel] + ([] if name == "__init__.py" else [name[:-3]])
                out[".".join(parts)] = Path(dirpath) / name
    return out


MODULES = _modules()


def layer_of(module: str) -> int | None:
    """The layer of `module`: its own entry, else its closest package's (never the root's)."""
    name = module
    while name:
        if name in LAYERS and (name != "gsm_jax" or module == "gsm_jax"):
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


def _is_package(module: str) -> bool:
    return MODULES.get(module, Path()).name == "__init__.py"


def imports_of(module: str, path: Path) -> list[tuple[int, str, str]]:
    """(line, source text, imported gsm_jax module) for every gsm_jax import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports the submodule pkg.name when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target == "gsm_jax" or target.startswith("gsm_jax."):
                found.append((node.lineno, ast.unparse(node), target))
    return found


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _describe(layer: int) -> str:
    return f"{layer} {LAYER_NAMES[layer]}"


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, ("modules with no layer (add them to LAYERS in "
                         "tests/test_import_layers.py, where their role says):\n  "
                         + "\n  ".join(missing))


def test_the_layer_map_names_real_modules():
    stale = sorted(m for m in LAYERS if m not in MODULES)
    assert not stale, "LAYERS names modules that do not exist:\n  " + "\n  ".join(stale)


def test_no_import_from_a_higher_layer():
    violations = []
    for module, path in sorted(MODULES.items()):
        own = layer_of(module)
        if own is None:
            continue  # test_every_module_has_a_layer reports it
        for line, text, target in imports_of(module, path):
            theirs = layer_of(target)
            if theirs is None:
                violations.append(f"{_where(path)}:{line}: {text}  ({module}: layer "
                                  f"{_describe(own)} -> {target}: not a module of gsm_jax)")
            elif theirs > own:
                violations.append(f"{_where(path)}:{line}: {text}  ({module}: layer "
                                  f"{_describe(own)} -> {target}: layer {_describe(theirs)})")
    assert not violations, (
        f"{len(violations)} imports from a higher layer (importer layer -> imported layer; "
        "lowest first: " + ", ".join(_describe(i) for i in range(len(LAYER_NAMES))) + "):\n  "
        + "\n  ".join(violations))


# ----------------------------------------------------------------------------- the checker


@pytest.mark.parametrize("source, expected", [
    ("import gsm_jax", ["gsm_jax"]),
    ("import numpy, gsm_jax.quant as q", ["gsm_jax.quant"]),
    ("from gsm_jax.workflow import data, metrics", ["gsm_jax.workflow.data",
                                                     "gsm_jax.workflow.metrics"]),
    ("from gsm_jax.workflow.data import load", ["gsm_jax.workflow.data"]),
    ("from gsm_jax import load", ["gsm_jax"]),
    ("def f():\n    from gsm_jax.cli import main", ["gsm_jax.cli"]),
    ("if TYPE_CHECKING:\n    from gsm_jax.workflow import report", ["gsm_jax.workflow.report"]),
    ("from . import runner", ["gsm_jax.workflow.evidence.runner"]),
    ("from ..metrics import Budget", ["gsm_jax.workflow.metrics"]),
])
def test_imports_are_read_at_every_level(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    got = [t for _, _, t in imports_of("gsm_jax.workflow.evidence.claim", path)]
    assert got == expected


def test_layer_lookup():
    assert layer_of("gsm_jax") == 6
    assert layer_of("gsm_jax.models.llama") == 2
    assert layer_of("gsm_jax.serving.engine") == 3
    assert layer_of("gsm_jax.serving.bench_client") == 3  # below the workflow's bench
    assert layer_of("gsm_jax.data") == 0
    assert layer_of("gsm_jax.serving.cli") == 6
    assert layer_of("gsm_jax.workflow.evidence.runner") == 5
    assert layer_of("gsm_jax.not_a_module") is None  # the facade covers only itself


# ----------------------------------------------------------------------------- the CLI


def test_the_cli_lists_its_subcommands():
    """`gsm_jax.cli.COMMANDS` names every subcommand; importing the CLI imports none of them."""
    import subprocess
    import sys

    code = ("import sys, gsm_jax.cli as c; "
            "print(sorted(m for m in sys.modules if m.startswith(('gsm_jax.workflow', "
            "'gsm_jax.serving', 'gsm_jax.planner')))); print([s.name for s in c.COMMANDS])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == str(["generate", "profile", "calibrate", "eval", "report", "evidence",
                          "bench", "plan", "serve", "bench-serve"])
    from gsm_jax.cli import COMMANDS

    for command in COMMANDS:
        add_arguments, run = command.resolve()
        assert callable(add_arguments) and callable(run) and command.help


def test_import_gsm_jax_loads_no_jax_until_a_name_is_used():
    """`import gsm_jax` (the facade) imports jax only when a public name that needs it is
    first used; every name of `__all__` then resolves, `from gsm_jax import ...` included."""
    import subprocess
    import sys

    code = ("import sys, gsm_jax; a = 'jax' in sys.modules; "
            "from gsm_jax import generate; b = 'jax' in sys.modules; "
            "missing = [n for n in gsm_jax.__all__ if getattr(gsm_jax, n, None) is None]; "
            "print(a, b, missing, generate is gsm_jax.generate)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "False True [] True", out
