"""benchmarks/bench_cpu_gemm.py: a quick run writes every form's row with its roofline share."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_cpu_gemm  # noqa: E402


def test_quick_run_writes_every_form(tmp_path):
    assert bench_cpu_gemm.main(["--quick", "--rows", "1,2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["roofline"]["gb_s"] > 0
    forms = {(c["form"], c["rows"]) for c in res["cases"]}
    assert ("int8 multiply-reduce [N,K]", 1) in forms
    assert ("int8 multiply-reduce [N,K]", 2) not in forms  # one row only
    assert {("f32", 1), ("f32", 2), ("bf16 -> f32 accumulate", 2),
            ("int8 x int8 -> int32", 2)} <= forms
    from gsm_jax.pallas_kernels import int8_matvec_cpu

    kernel = {("int8 kernel", 1), ("int8 kernel", 2)}
    assert (kernel <= forms) == int8_matvec_cpu.available()  # gsm_jax's own, where it builds
    for c in res["cases"]:
        assert c["ms"] > 0 and c["of_roofline"] > 0
        expected = {"custom call"} if c["form"] == "int8 kernel" else {"YNNPACK fusion", "XLA"}
        assert c["emitter"] in expected, c
        assert c["weight_bytes"] == 576 * 4096 * {"float32": 4, "bfloat16": 2, "int8": 1}[
            c["weight_dtype"]]
    assert (tmp_path / "results.png").stat().st_size > 0
    assert "of roofline" in (tmp_path / "results.md").read_text()


def test_bad_rows_refused(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit):
        bench_cpu_gemm.main(["--rows", "0", "--out", str(tmp_path)])
    assert "--rows" in capsys.readouterr().err
