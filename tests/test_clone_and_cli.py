"""A newcomer's first hour: the package works from a fresh clone (its evaluation data ships
inside it), a second identical command loads its programs from the persistent compilation
cache, and the command line explains itself (help, defaults, --version, units, bad files
refused before a model loads).

The clone test builds the clone's wheel, installs it into a folder of its own and runs the
README's workflow commands from there (a tiny random Llama with a byte-level tokenizer, tiny
sizes), in a folder with no ``../shared`` next to it, so every default file must come from
the installed package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_hf_llama

from gsm_jax.cli import COMMANDS, build_parser, main
from gsm_jax.errors import InvalidInputError
from gsm_jax.planner import parse_bytes
from gsm_jax.workflow import data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """(installed site folder, tiny model dir, a work folder, base environment): the repo's
    HEAD cloned, built and installed with pip (no dependencies: they come from this venv)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    base = tmp_path_factory.mktemp("newcomer")
    src, site = base / "clone", base / "site"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
    _python(["-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
             "--target", str(site), str(src)], cwd=base, env=dict(os.environ))
    shutil.rmtree(src)  # only the installed package remains: no repository, no ../shared
    model = write_tiny_hf_llama(base / "tiny-model", max_positions=512)
    work = base / "work"
    work.mkdir()
    assert not (work.parent / "shared").exists() and not (base.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items()
           if k not in ("GSM_JAX_DATA_DIR", "PYTHONPATH", "XLA_FLAGS")}
    env |= {"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    return site, model, work, env


def _python(args: list[str], *, cwd: Path, env: dict, timeout: float = 600):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


# The README's workflow, at tiny sizes, with every data file left to its default.
WORKFLOW = r'''
import json, sys
import gsm_jax
from gsm_jax.cli import main
from gsm_jax.workflow import data

site, model = sys.argv[1], sys.argv[2]
assert gsm_jax.__file__.startswith(site), gsm_jax.__file__
assert str(data.default_wikitext_path()).startswith(site), data.default_wikitext_path()
assert str(data.default_lambada_path()).startswith(site), data.default_lambada_path()
tiny = ["--seq-len", "32", "--batch-size", "2", "--quiet"]
# no greedy-generation checks, LAMBADA (a generation per example) only in eval, bench with
# the GSM engine only: each would compile more programs, not read other data
greedy = ["--greedy-prompts", "0"]
steps = [
    ["profile", "--model", model, "--samples", "4", "--out", "prof", *tiny],
    ["calibrate", "--model", model, "--profile", "prof/profile.json", "--sequences", "2",
     "--lambada", "none", "--strengths", "0.05", "--windows", "4", "--protect-first",
     "1", "--max-kld", "100", "--min-top1", "0", "--max-acc-drop", "100", "--no-curves",
     "--no-backoff", "--out", "cal", *greedy, *tiny],
    ["eval", "--model", model, "--gsm", "cal/gsm.yaml", "--sequences", "2",
     "--lambada-samples", "2", "--out", "eval.json", *greedy, *tiny],
    ["bench", "--model", model, "--gsm", "cal/gsm.yaml", "--clients", "2", "--requests", "2",
     "--repeats", "1", "--rate", "none", "--long-fraction", "0", "--short-prompt", "8", "12",
     "--short-new", "3", "--modes", "on", "--out", "bench", "--no-progress"],
]
for argv in steps:
    rc = main(argv)
    assert rc == 0, (argv, rc)
print("WORKFLOW OK")
'''


@pytest.mark.heavy  # ~35 s idle: four commands' compilations in a subprocess
def test_readme_workflow_from_a_fresh_clone(clone):
    site, model, work, env = clone
    env = env | {"GSM_JAX_COMPILATION_CACHE": "0"}
    proc = _python(["-c", WORKFLOW, str(site), str(model)], cwd=work, env=env)
    assert "WORKFLOW OK" in proc.stdout
    packaged = site / "gsm_jax" / "data"
    prof = json.loads((work / "prof" / "profile.json").read_text())
    assert prof["data"] == str(packaged / "wikitext2_test.txt")
    assert prof["calibration_samples"] == 4 and len(prof["stats"]) == 2 * 2
    assert (work / "cal" / "gsm.yaml").is_file()
    ev = json.loads((work / "eval.json").read_text())
    text = json.dumps(ev)
    assert str(packaged / "lambada_dev.jsonl") in text and str(packaged / "wikitext2_test.txt") \
        in text
    assert (work / "bench" / "results.json").is_file()


def test_second_identical_command_loads_from_the_compilation_cache(clone, tmp_path):
    site, model, work, env = clone
    cache = tmp_path / "jax-cache"
    # no threshold set: the tiny model's programs compile in well under JAX's default 1 s,
    # and gsm-jax writes them all (compile_cache.MIN_COMPILE_TIME_S)
    env = {k: v for k, v in env.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    env = env | {"GSM_JAX_COMPILATION_CACHE": str(cache), "JAX_LOG_COMPILES": "1"}
    argv = ["-m", "gsm_jax.cli", "generate", "--model", str(model), "Hello there",
            "--max-new-tokens", "4"]
    first = _python(argv, cwd=work, env=env | {"GSM_JAX_COMPILE_NOTICE_S": "0"})
    files = {p.name for p in cache.iterdir()}
    assert files, "the first call wrote nothing to the persistent cache"
    assert "Persistent compilation cache hit" not in first.stderr
    notice = [ln for ln in first.stderr.splitlines() if "compiling XLA programs" in ln]
    assert len(notice) == 1 and str(cache) in notice[0], first.stderr[-2000:]
    # the traced generation loop is saved too (compile_cache.cached_call) ...
    assert (cache / "exported").is_dir(), first.stderr[-3000:]
    assert [p.name.split("-")[0] for p in (cache / "exported").iterdir()] == ["generate_loop"]
    assert "Finished tracing trace_generate_loop" in first.stderr
    second = _python(argv, cwd=work, env=env)
    # ... and loaded: the second process does not trace the model
    assert "Finished tracing trace_generate_loop" not in second.stderr, second.stderr[-2000:]
    hits = re.findall(r"Persistent compilation cache hit for '([^']+)'", second.stderr)
    assert hits, second.stderr[-3000:]
    assert {p.name for p in cache.iterdir()} == files  # nothing new was written
    m = re.search(r"XLA: (\d+) programs ready in [0-9.]+ s; (\d+) of them loaded from the "
                  r"persistent cache", second.stderr)
    assert m and int(m.group(2)) == len(hits) >= 1, second.stderr[-2000:]
    assert int(m.group(1)) == int(m.group(2)), second.stderr[-2000:]  # every one of them
    def text(out: str) -> str:  # the generated continuation
        return out[out.index(">>> "):out.rindex("[gsm-jax] ")]

    assert text(first.stdout) == text(second.stdout)


def test_compilation_cache_setting(monkeypatch, tmp_path):
    from gsm_jax import compile_cache as cc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv(cc.ENV, off)
        assert cc.requested_cache_dir() is None
    for on in ("", "1", "on"):
        monkeypatch.setenv(cc.ENV, on)
        assert cc.requested_cache_dir() == tmp_path / "gsm-jax" / "jax" / cc.host_fingerprint()
    monkeypatch.setenv(cc.ENV, str(tmp_path / "elsewhere"))
    assert cc.requested_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(cc.ENV)
    want = tmp_path / "gsm-jax" / "jax" / cc.host_fingerprint()  # one folder per CPU
    assert cc.requested_cache_dir() == cc.default_cache_dir() == want


# ----------------------------------------------------------------------------- CLI text


def test_top_level_help_lists_every_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "SUBCOMMANDS" not in out and "register" not in out
    flat = " ".join(out.split())
    for command in COMMANDS:  # the name, then its one-line help
        assert f" {command.name} {command.help}" in flat, (command.name, out)


def test_version(capsys):
    import importlib.metadata

    import gsm_jax

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gsm-jax {gsm_jax.__version__}"
    assert gsm_jax.__version__ == importlib.metadata.version("gsm-jax")


OWN_COMMANDS = ("generate", "profile", "calibrate", "eval", "report", "evidence", "bench",
                "serve", "bench-serve", "plan")


@pytest.mark.parametrize("name", OWN_COMMANDS)
def test_every_option_has_help_and_its_default(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    formatter = sub.formatter_class(prog=sub.prog)
    for action in sub._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action) % {"default": action.default}
        if action.default not in (None, False):
            assert "default" in shown, f"{name} {action.option_strings[0]}: {shown}"
    text = sub.format_help()
    assert "../shared" not in text


@pytest.mark.parametrize("text, expected", [
    ("141", 141e9), ("141GB", 141e9), ("141 gb", 141e9), ("80GiB", 80 * 2**30),
    ("80gi", 80 * 2**30), ("1.5TB", 1.5e12), ("512MiB", 512 * 2**20), ("80e9B", 80e9),
    (141e9, 141e9), (2**30, 2**30),
])
def test_device_memory_units(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize("text", ["banana", "141XB", "-5", "0", "141B", "80e9", "GB", "",
                                  "1e400GB", 12, True])
def test_device_memory_nonsense_refused(text):
    with pytest.raises(InvalidInputError, match="device memory"):
        parse_bytes(text)


def test_plan_cli_units_and_explanation(tmp_path, capsys):
    cfg = write_tiny_hf_llama(tmp_path / "m", max_positions=512) / "config.json"
    assert main(["plan", "--model", str(cfg), "--context", "256", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "of 141.00 GB: fits" in out and "activations (estimate)" in out
    assert "--compile" in out  # says where the estimate stops and the compiled figure starts
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(cfg), "--device-memory", "141 apples"])
    assert e.value.code == 2
    assert "--device-memory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("argv, option", [
    (["profile", "--data", "{missing}", "--out", "{tmp}/p"], "--data"),
    (["calibrate", "--lambada", "{missing}", "--out", "{tmp}/c"], "--lambada"),
    (["calibrate", "--profile", "{missing}", "--out", "{tmp}/c"], "--profile"),
    (["eval", "--gsm", "{missing}"], "--gsm"),
    (["eval", "--gsm", "none", "--data", "{empty}"], "--data"),
    (["report", "--data", "{tmp}", "--out", "{tmp}/r"], "--data"),
    (["bench", "--data", "{missing}", "--out", "{tmp}/b"], "--data"),
    (["generate", "hi", "--gsm", "{missing}"], "--gsm"),
    (["generate", "--prompts-file", "{missing}"], "--prompts-file"),
])
def test_bad_file_arguments_fail_before_the_model_loads(argv, option, tmp_path, capsys,
                                                        monkeypatch):
    import gsm_jax

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the file options were checked")

    monkeypatch.setattr(gsm_jax, "load", no_load)
    (tmp_path / "empty.txt").write_text("")
    fill = {"missing": str(tmp_path / "missing.txt"), "empty": str(tmp_path / "empty.txt"),
            "tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    model = ["--models"] if argv[0] == "evidence" else ["--model"]
    assert main([argv[0], *model, str(tmp_path / "no-model"), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"error: {option} " in err, err


def test_packaged_data_is_complete():
    d = data.packaged_data_dir()
    assert data.default_data_dir() == d or os.environ.get("GSM_JAX_DATA_DIR")
    assert d.parent.name == "gsm_jax" and (d / "README.md").is_file()
    exs = data.load_lambada(d / data.LAMBADA_FILE)
    assert len(exs) == 2000 and exs[0].target == "signs"
    text = data.read_text(d / data.WIKITEXT_FILE)
    assert len(text) > 1_200_000 and "Robert Boulter" in text[:2000]
    notes = (d / "README.md").read_text()
    assert "CC BY-SA 3.0" in notes and "CC BY 4.0" in notes


def test_gzip_and_own_files_read_alike(tmp_path):
    import gzip

    rows = [{"text": "the cat sat on the mat"}, {"text": "he said \u2028 hello world"}]
    plain = tmp_path / "l.jsonl"
    plain.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    packed = tmp_path / "l.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(plain.read_text())
    assert data.load_lambada(plain) == data.load_lambada(packed)
    assert [e.target for e in data.load_lambada(packed)] == ["mat", "world"]
    with pytest.raises(InvalidInputError, match="--lambada .*does not exist"):
        data.check_file_option("--lambada", tmp_path / "nope.jsonl")
