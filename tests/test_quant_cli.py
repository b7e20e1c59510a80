"""`gsm-jax profile | calibrate | eval --quantize ...` on a tiny saved model."""

from __future__ import annotations

import json

import pytest
from tiny_models import saved_workflow_setup

from gsm_jax.cli import main

SMALL = ["--lambada", "none", "--greedy-prompts", "2", "--greedy-prompt-len", "8",
         "--greedy-tokens", "6", "--batch-size", "4", "--quiet"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return saved_workflow_setup(tmp_path_factory.mktemp("qcli"))


def test_eval_profile_calibrate_with_quantize(setup, capsys):
    root, model, data = setup
    (root / "gsm.yaml").write_text("target_layers: all\nsmooth_strength: 0.1\nwindow_size: 4\n")
    outs = {}
    for scheme in ("none", "w8a8"):
        out = root / f"ev_{scheme}.json"
        assert main(["eval", "--model", model, "--gsm", str(root / "gsm.yaml"), "--data", data,
                     "--sequences", "4", "--quantize", scheme, "--out", str(out), *SMALL]) == 0
        outs[scheme] = json.loads(out.read_text())
    # GSM against the same params without GSM: float and W8A8 give different numbers
    assert outs["w8a8"]["quality"]["mean_kld"] != outs["none"]["quality"]["mean_kld"]
    assert main(["profile", "--model", model, "--data", data, "--samples", "4", "--quantize",
                 "w8a16", "--out", str(root / "prof"), "--batch-size", "2", "--quiet"]) == 0
    assert (root / "prof" / "profile.json").exists()
    assert main(["calibrate", "--model", model, "--profile", str(root / "prof/profile.json"),
                 "--data", data, "--sequences", "4",
                 "--strengths", "0.01,0.05", "--windows", "4", "--protect-first", "1",
                 "--max-kld", "1", "--min-top1", "0", "--quantize", "w8a8",
                 "--out", str(root / "cal"), *SMALL]) == 0
    assert (root / "cal" / "gsm.yaml").exists()
    with pytest.raises(SystemExit):
        main(["eval", "--model", model, "--quantize", "int4"])
    capsys.readouterr()


def test_quantize_head_alone_is_refused_before_load(setup, capsys):
    """--quantize-head without --quantize is named before any model loads (the model path
    does not exist and is never mentioned). The run itself: test_llama_configs.py,
    test_cli_generate_quantized_with_int8_head."""
    root, _, _ = setup
    for cmd in (["generate", "hi"], ["profile", "--out", str(root / "prof_refused")]):
        assert main([cmd[0], "--model", str(root / "no-such-model"), "--quantize-head",
                     *cmd[1:]]) == 2
        err = capsys.readouterr().err
        assert "--quantize-head needs --quantize" in err and "no-such-model" not in err
    # --quantize-group-size: only with w8a16, even, 2 to 512; named before the load too
    for flags, said in ((["--quantize-group-size", "32"], "needs --quantize w8a16"),
                        (["--quantize", "w8a8", "--quantize-group-size", "32"],
                         "needs --quantize w8a16"),
                        (["--quantize", "w8a16", "--quantize-group-size", "33"],
                         "must be an even integer"),
                        (["--quantize", "w8a16", "--quantize-group-size", "1024"],
                         "must be an even integer")):
        assert main(["generate", "--model", str(root / "no-such-model"), *flags, "hi"]) == 2
        err = capsys.readouterr().err
        assert said in err and "no-such-model" not in err
