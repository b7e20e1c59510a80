"""The results the model report and the evidence share: their types and where they are stored.

`gsm_jax.workflow.report` (one model, ``<out>/gsm_<model>.md``) and
`gsm_jax.workflow.evidence` (the claims, ``<out>/gsm_evidence.md``) read each other's
recorded results: the report quotes evidence claim 3, the evidence's claim 1 reuses the
report's step-time rows. Both import this module (and `gsm_jax.workflow.overhead`, which
measures those rows) and never each other. Nothing here measures or imports JAX.

The types are `TypedDict`s: the JSON files hold exactly these dicts, so a result read
back from disk and a fresh one are the same object, and rendering one gives the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, TypedDict

# ----------------------------------------------------------------------------- types


class OverheadRow(TypedDict):
    """One (config, step) of `gsm_jax.workflow.overhead.measure_overhead` (overhead.json)."""

    config: str  # "GSM off (compiled out)" first, then "GSM on: ..."
    step: str  # "prefill" | "decode"
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    batch: int
    prompt: int


class ClaimRecord(TypedDict, total=False):
    """One claim on one model (``claim_<N>.json``), as `gsm_jax.workflow.evidence` writes it
    (a claim may add its own keys: arms, gsm, rule, ...)."""

    claim: int
    model: str
    verdict: str  # one of `gsm_jax.workflow.evidence.runner.VERDICTS`
    why: str
    numbers: dict[str, Any]
    figure: str
    command: str  # regenerates this claim on this model
    source_command: str  # the command that measured numbers this claim reused
    run_command: str
    measured_at: str
    seconds: float
    load_avg: dict[str, Any]
    machine: dict[str, Any]
    smoke: bool
    sizes: dict[str, Any]


# ----------------------------------------------------------------------------- where


REPORT_DATA = "data"  # <out>/data: the JSON behind <out>/gsm_<model>.md
REPORT_META = "report_meta.json"
OVERHEAD_FILE = "overhead.json"


def model_slug(model: str) -> str:
    """A directory name for a model (a path becomes its last component)."""
    name = Path(str(model).rstrip("/")).name if ("/" in str(model) or os.sep in str(model)) \
        else str(model)
    if name.endswith(".gguf"):
        name = name[:-5]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"


def evidence_dir(out: str | os.PathLike, model: str) -> Path:
    """``<out>/data/evidence/<model slug>``: one ``claim_<N>.json`` per measured claim."""
    return Path(out) / REPORT_DATA / "evidence" / model_slug(model)


def claim_path(out: str | os.PathLike, model: str, n: int) -> Path:
    return evidence_dir(out, model) / f"claim_{n}.json"


def find_claim(out: str | os.PathLike, model: str, n: int) -> ClaimRecord | None:
    """Claim `n` of `gsm-jax evidence` for `model`, if measured: the evidence data sits in
    <reports>/data/evidence/<model>/, with a model report in <reports> or <reports>/<model>."""
    out = Path(out)
    for root in (out, out.parent):
        path = claim_path(root, model, n)
        if path.exists():
            return json.loads(path.read_text())
    return None
