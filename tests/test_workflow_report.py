"""The evidence report end to end on a tiny saved model (numbers meaningless, plumbing real)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

import gsm_jax
from gsm_jax.models import llama
from gsm_jax.params import ModelParams
from gsm_jax.workflow import report


def test_report_end_to_end_and_render_only(tmp_path):
    # the same tiny model config as the other workflow tests
    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=256)
    w = jax.tree.map(lambda a: a * 20 if a.ndim > 1 else a,
                     llama.init_weights(cfg, jax.random.key(7)))
    model = gsm_jax.save(ModelParams(w, cfg, None, "tiny-report"), tmp_path / "model")
    tokens = np.random.default_rng(0).integers(0, 96, (8, 24)).astype(np.int32)
    sizes = dataclasses.replace(report.ReportSizes.smoke(), batch_size=4, cal_sequences=4,
                                final_sequences=4, greedy_prompts=0, profile_samples=4,
                                strengths=(0.01, 0.3), windows=(8,), overhead_steps=2)
    out = tmp_path / "rep"
    path = report.run_report(model=str(model), out=out, data=tokens, lambada=None, sizes=sizes,
                             command="gsm-jax report (test)", progress=False)
    md = path.read_text()
    for needle in ("## Summary", "## Q1", "## Q2", "## Q3", "## Q4", report.Q3_MARK,
                   report.BENCH_MARK, "gsm-jax report (test)", "Recommended default"):
        assert needle in md, needle
    for fig in ("profile_heatmap.png", "quality_vs_strength.png", "protect_first.png",
                "overhead.png"):
        assert (out / "figures" / fig).stat().st_size > 1000, fig
        assert f"figures/{fig}" in md
    for f in ("profile.json", "calibration/calibration.json", "calibration/gsm.yaml",
              "final_eval.json", "overhead.json", "report_meta.json"):
        assert (out / "data" / f).exists(), f
    path.unlink()
    assert report.render_report(out).read_text() == md

    # --resume measures only what is missing
    final_path = out / "data" / "final_eval.json"
    final = json.loads(final_path.read_text())
    assert "chosen" in final
    dropped = final.pop("chosen, protect_first 0")
    final_path.write_text(json.dumps(final))
    report.run_report(model=str(model), out=out, data=tokens, lambada=None, sizes=sizes,
                      command="resume (test)", resume=True, progress=False)
    meta = json.loads((out / "data" / "report_meta.json").read_text())
    assert meta["command"] == "gsm-jax report (test)"
    assert meta["resumed"][-1]["measured"] == ["final: chosen, protect_first 0"]
    again = json.loads(final_path.read_text())["chosen, protect_first 0"]
    assert again["quality"] == dropped["quality"]
    assert "Resumed" in (out / report.report_name("tiny-report")).read_text()


def test_report_names_per_model():
    assert report.report_name("smollm2-135m") == report.REPORT_NAME == "gsm_smollm2.md"
    assert report.report_name("gemma3-270m") == "gsm_gemma3.md"
    assert report.report_name("/x/My-Model.gguf") == "gsm_my.md"


def test_recommend_protect_first():
    rows = [{"strength": 0.1, "window": 8, "protect_first": 0, "mean_kld": 1.0},
            {"strength": 0.1, "window": 8, "protect_first": 1, "mean_kld": 0.10},
            {"strength": 0.1, "window": 8, "protect_first": 2, "mean_kld": 0.095}]
    assert report.recommend_protect_first(rows) == 1
    rows[2]["mean_kld"] = 0.05
    assert report.recommend_protect_first(rows) == 2


def test_report_and_evidence_do_not_import_each_other():
    """The campaign's two renderers share `gsm_jax.workflow.results` (and `overhead`), never
    each other: no module of the evidence imports the report and vice versa."""
    import ast
    from pathlib import Path

    import gsm_jax.workflow as wf

    root = Path(wf.__file__).parent

    def imports(path):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
                mods.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
        return mods

    report_side = ("report.py", "report_sections.py", "results.py", "overhead.py")
    for name in report_side:
        bad = {m for m in imports(root / name) if m.startswith("gsm_jax.workflow.evidence")
               and not m.startswith("gsm_jax.workflow.evidence.quant_quality")}
        assert not bad, (name, bad)
    for path in sorted((root / "evidence").glob("*.py")):
        bad = {m for m in imports(path) if m.startswith(("gsm_jax.workflow.report",))}
        assert not bad, (path.name, bad)


def test_sections_render_typed_inputs():
    """Each section is a function of `ReportInputs` alone; the report is their concatenation."""
    from gsm_jax.workflow import report_sections as rs

    names = [f.__name__ for f in rs.SECTIONS]
    assert names[0] == "_header" and names[-1] == "_reproduce" and len(set(names)) == len(names)
    assert report.ReportInputs is rs.ReportInputs and report.ReportSizes is rs.ReportSizes
