"""The research notebook runs end to end (so it cannot rot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "gsm_walkthrough.ipynb"


def test_walkthrough_notebook_executes(smollm2_gguf_path, shared_data_dir, tmp_path,
                                       monkeypatch):
    # The kernel is a separate process: JAX's own environment variables give it the
    # session's persistent compilation cache (tests/conftest.py `pytest_configure`), so the
    # SmolLM2 programs it compiles and the ones the suite's processes compile are each
    # compiled once (the cache key holds the program, its options and the XLA flags).
    folder = os.environ.get("GSM_JAX_TEST_XLA_CACHE_DIR")
    if folder:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", folder)
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", str(6 * 2**30))
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # heat map, quality vs strength, protect_first
    text = "".join(o.get("text", "") for o in outputs)
    assert "calibration of smollm2-135m" in text and "mean KLD" in text
