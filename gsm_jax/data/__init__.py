"""The data that ships with the package, and where it is.

``gsm_jax/data/`` holds the evaluation data (``wikitext2_test.txt``, the WikiText-2 raw
test split; ``lambada_dev.jsonl``, 2000 LAMBADA examples) and the DeepSeek configs the
planner knows; sources and licences in ``README.md`` beside this file. Found with
`importlib.resources` (`packaged_data_dir`); the environment variable GSM_JAX_DATA_DIR
points the defaults at another folder (`default_data_dir`). The standard library only:
the workflow's readers (`gsm_jax.workflow.data`) and the serving load test
(`gsm_jax.serving.bench_client`) both find their text here.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.resources
import os
from pathlib import Path

WIKITEXT_FILE = "wikitext2_test.txt"
LAMBADA_FILE = "lambada_dev.jsonl"

_RESOURCE_FILES = contextlib.ExitStack()
atexit.register(_RESOURCE_FILES.close)


@functools.lru_cache(maxsize=1)
def packaged_data_dir() -> Path:
    """The folder of the package data (``gsm_jax/data``), as a real path.

    Found with `importlib.resources`, so it works from a checkout, an editable install and
    a wheel; a package imported from a zip file gets a temporary copy (kept until exit).
    """
    resource = importlib.resources.files("gsm_jax").joinpath("data")
    return Path(_RESOURCE_FILES.enter_context(importlib.resources.as_file(resource)))


def default_data_dir() -> Path:
    """The packaged data (`packaged_data_dir`), or the folder the environment variable
    GSM_JAX_DATA_DIR names (it must hold files named like the packaged ones)."""
    env = os.environ.get("GSM_JAX_DATA_DIR")
    if env:
        return Path(env)
    return packaged_data_dir()


def default_wikitext_path() -> Path:
    """The WikiText-2 raw test split the workflow uses by default."""
    return default_data_dir() / WIKITEXT_FILE


def default_lambada_path() -> Path:
    """The LAMBADA examples (jsonl) the workflow uses by default."""
    return default_data_dir() / LAMBADA_FILE
