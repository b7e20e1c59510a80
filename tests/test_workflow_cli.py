"""`gsm-jax profile | calibrate | eval` end to end on a tiny saved model."""

from __future__ import annotations

import json

import pytest
from tiny_models import saved_workflow_setup

import gsm_jax
from gsm_jax.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return saved_workflow_setup(tmp_path_factory.mktemp("cli"))


COMMON = ["--batch-size", "4", "--quiet"]
SMALL = ["--lambada", "none", "--greedy-prompts", "2", "--greedy-prompt-len", "8",
         "--greedy-tokens", "6"]


def test_profile_calibrate_eval(setup, capsys):
    root, model, data = setup
    assert main(["profile", "--model", model, "--data", data, "--samples", "5",
                 "--out", str(root / "prof"), "--batch-size", "2", "--quiet"]) == 0
    prof = json.loads((root / "prof" / "profile.json").read_text())
    assert prof["calibration_samples"] == 5 and len(prof["stats"]) == 6
    assert (root / "prof" / "profile_heatmap.png").exists()

    assert main(["calibrate", "--model", model, "--profile", str(root / "prof/profile.json"),
                 "--data", data, "--sequences", "4", "--strengths", "0.01,0.05,0.9",
                 "--windows", "4,8", "--protect-first", "0,1", "--max-kld", "1",
                 "--min-top1", "0", "--out", str(root / "cal"), *SMALL, *COMMON]) == 0
    cfg = gsm_jax.GSMConfig.from_file(root / "cal" / "gsm.yaml")
    assert cfg.smooth_strength == 0.05  # 0.9 is above max_strength 0.3: never tried
    cal = json.loads((root / "cal" / "calibration.json").read_text())
    assert cal["skipped_strengths"] == [0.9]

    assert main(["eval", "--model", model, "--gsm", str(root / "cal/gsm.yaml"), "--data", data,
                 "--sequences", "4", "--out", str(root / "ev.json"), *SMALL, *COMMON]) == 0
    ev = json.loads((root / "ev.json").read_text())
    assert ev["quality"]["mean_kld"] == pytest.approx(cal["final"]["quality"]["mean_kld"])
    assert "mean KLD" in capsys.readouterr().out


def test_cli_errors(setup, capsys, tmp_path):
    root, model, data = setup
    assert main(["eval", "--model", model, "--gsm", "none", "--data",
                 str(tmp_path / "missing.txt"), *SMALL, *COMMON]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["calibrate", "--model", model, "--data", data, "--sequences", "4",
                 "--strengths", "0.01", "--windows", "8", "--protect-first", "1",
                 "--max-kld", "1e-12", "--base-config", str(_all_layers(tmp_path)),
                 "--no-curves", "--out", str(tmp_path / "cal"), *SMALL, *COMMON]) == 3
    assert (tmp_path / "cal" / "gsm.best_found.yaml").exists()
    assert "no configuration met the budget" in capsys.readouterr().err
    assert main(["profile", "--model", model, "--data", data, "--samples", "99",
                 "--out", str(tmp_path / "p"), *COMMON]) == 2
    assert "requested" in capsys.readouterr().err
    # the saved tiny model stores no FP8 / FP4 weights: --keep-quantized is refused, not ignored
    assert main(["eval", "--model", model, "--keep-quantized", "--gsm", "none", "--data", data,
                 *SMALL, *COMMON]) == 2
    assert "no block-quantized" in capsys.readouterr().err


def _all_layers(tmp_path):
    path = tmp_path / "base.yaml"
    gsm_jax.GSMConfig(target_layers="all").to_file(path)
    return path
