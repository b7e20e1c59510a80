"""Tests of gsm_jax.config: validation, files, masks, rollout, hot reload."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time

import numpy as np
import pytest

from gsm_jax.config import (
    DEFAULT_PROTECT_FIRST,
    PROFILE_SCHEMA,
    SITES,
    ConfigWatcher,
    GSMConfig,
    build_profile,
    describe,
    load_profile,
    resolve_mask,
    rollout_value,
    row_enabled,
    select_high_kurtosis,
    write_profile,
)
from gsm_jax.errors import GSMConfigError, InvalidInputError

# --------------------------------------------------------------------------- defaults


def test_defaults_match_spec_table():
    c = GSMConfig()
    assert c.to_dict() == {
        "enable": True,
        "window_size": 8,
        "smooth_strength": 0.1,
        "max_strength": 0.3,
        "target_layers": "high_kurtosis",
        "sites": ["attn_out", "ffn_mid"],
        "precision": "auto",
        "calibration_samples": 512,
        "max_window": 64,
        "protect_first": DEFAULT_PROTECT_FIRST,
        "short_request_tokens": 0,
        "rollout_fraction": 1.0,
        "profile": None,
        "kurtosis_threshold": None,
    }
    assert DEFAULT_PROTECT_FIRST == 1
    assert SITES == ("attn_out", "ffn_mid")
    hash(c)  # frozen and hashable
    with pytest.raises(AttributeError):
        c.enable = False  # type: ignore[misc]


def test_lists_are_normalised_to_tuples_and_hashable():
    c = GSMConfig(target_layers=[3, 1, 1], sites=["ffn_mid", "attn_out"])
    assert c.target_layers == (1, 3) and c.sites == ("attn_out", "ffn_mid")
    d = GSMConfig(target_layers={"2": ["ffn_mid"], 0: ["attn_out", "ffn_mid"]})
    assert d.target_layers == ((0, ("attn_out", "ffn_mid")), (2, ("ffn_mid",)))
    assert len({c, d, GSMConfig()}) == 3
    assert d.replace(smooth_strength=0.2).target_layers == d.target_layers  # idempotent


# --------------------------------------------------------------------------- validation

BAD = [
    ("smooth_strength", 0.4, "max_strength"),
    ("smooth_strength", -0.1, ">= 0"),
    ("smooth_strength", float("nan"), "finite"),
    ("smooth_strength", True, "number"),
    ("smooth_strength", "0.1", "number"),
    ("max_strength", -0.1, ">= 0"),
    ("max_strength", 1.5, "<= 1"),
    ("window_size", 0, ">= 1"),
    ("window_size", 65, "<= 64"),
    ("window_size", 8.0, "integer"),
    ("window_size", True, "integer"),
    ("window_size", "auto", "adaptive"),
    ("max_window", 0, ">= 1"),
    ("max_window", True, "integer"),
    ("protect_first", -1, ">= 0"),
    ("protect_first", False, "integer"),
    ("short_request_tokens", -5, ">= 0"),
    ("calibration_samples", 0, ">= 1"),
    ("rollout_fraction", 1.5, "<= 1"),
    ("rollout_fraction", -0.01, ">= 0"),
    ("rollout_fraction", True, "number"),
    ("precision", "fp16", "bf16"),
    ("sites", ["attn_out", "mlp"], "mlp"),
    ("sites", "attn_out", "list"),
    ("target_layers", "some", "high_kurtosis"),
    ("target_layers", [0, -1], "-1"),
    ("target_layers", [0, True], "True"),
    ("target_layers", [0, 1.5], "1.5"),
    ("target_layers", {3: ["bogus"]}, "bogus"),
    ("target_layers", {-2: ["attn_out"]}, "-2"),
    ("enable", "yes", "yes"),
    ("enable", 1, "1"),
    ("kurtosis_threshold", "high", "number"),
    ("profile", 3, "3"),
]


@pytest.mark.parametrize(("key", "value", "fragment"), BAD)
def test_each_bad_value_is_refused_naming_key(key, value, fragment):
    with pytest.raises(GSMConfigError) as ei:
        GSMConfig.from_dict({key: value})
    msg = str(ei.value)
    assert key in msg, msg
    assert fragment in msg, msg


def test_strength_guard_message():
    with pytest.raises(GSMConfigError, match=r"smooth_strength=0\.4.*max_strength=0\.3.*0\.4"):
        GSMConfig(smooth_strength=0.4)
    # raising the guard deliberately allows it; the boundary itself is allowed
    assert GSMConfig(smooth_strength=0.4, max_strength=0.5).smooth_strength == 0.4
    assert GSMConfig(smooth_strength=0.3).smooth_strength == 0.3
    assert GSMConfig(smooth_strength=0).smooth_strength == 0.0


def test_window_bounds_follow_max_window():
    assert GSMConfig(window_size=16, max_window=16).window_size == 16
    with pytest.raises(GSMConfigError, match="window_size=17"):
        GSMConfig(window_size=17, max_window=16)
    assert GSMConfig(window_size="adaptive").window_size == "adaptive"
    with pytest.raises(GSMConfigError, match="max_window"):
        GSMConfig(window_size="adaptive", max_window=3)


def test_numpy_scalars_accepted_bools_not():
    c = GSMConfig(window_size=np.int64(4), smooth_strength=np.float32(0.25))
    assert type(c.window_size) is int and type(c.smooth_strength) is float
    with pytest.raises(GSMConfigError, match="window_size"):
        GSMConfig(window_size=np.bool_(True))


def test_unknown_keys_list_valid_keys():
    with pytest.raises(GSMConfigError) as ei:
        GSMConfig.from_dict({"smooth_strenght": 0.1})
    msg = str(ei.value)
    assert "smooth_strenght" in msg and "smooth_strength" in msg and "rollout_fraction" in msg
    with pytest.raises(GSMConfigError, match="bogus"):
        GSMConfig().replace(bogus=1)
    with pytest.raises(GSMConfigError, match="mapping"):
        GSMConfig.from_dict([("enable", True)])  # type: ignore[arg-type]


def test_replace_revalidates():
    c = GSMConfig()
    assert c.replace(smooth_strength=0.2).smooth_strength == 0.2
    assert c.smooth_strength == 0.1
    with pytest.raises(GSMConfigError, match="smooth_strength"):
        c.replace(smooth_strength=0.35)
    with pytest.raises(GSMConfigError, match="window_size"):
        c.replace(max_window=4)  # window 8 no longer fits


def test_gsm_config_wrapper_key_unwrapped():
    c = GSMConfig.from_dict({"gsm_config": {"smooth_strength": 0.2}})
    assert c.smooth_strength == 0.2


# --------------------------------------------------------------------------- files

ROUND_TRIP = [
    GSMConfig(),
    GSMConfig(
        enable=False,
        window_size="adaptive",
        smooth_strength=0.25,
        target_layers={0: ["attn_out"], 5: ["attn_out", "ffn_mid"]},
        sites=["ffn_mid"],
        precision="f32",
        protect_first=0,
        short_request_tokens=32,
        rollout_fraction=0.5,
        profile="p.json",
        kurtosis_threshold=10.0,
    ),
    GSMConfig(target_layers=[0, 2, 7]),
    GSMConfig(target_layers="all"),
    GSMConfig(target_layers=[]),
]


@pytest.mark.parametrize("ext", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("cfg", ROUND_TRIP)
def test_file_round_trip(tmp_path, cfg, ext):
    p = tmp_path / f"gsm{ext}"
    cfg.to_file(p)
    assert GSMConfig.from_file(p) == cfg
    assert GSMConfig.from_dict(cfg.to_dict()) == cfg


def test_yaml_handwritten(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "gsm_config:\n  enable: true\n  window_size: adaptive\n  smooth_strength: 0.2\n"
        "  target_layers:\n    3: [ffn_mid]\n    10: [attn_out, ffn_mid]\n"
    )
    c = GSMConfig.from_file(p)
    assert c.window_size == "adaptive"
    assert c.target_layers == ((3, ("ffn_mid",)), (10, ("attn_out", "ffn_mid")))


def test_file_errors(tmp_path):
    with pytest.raises(GSMConfigError, match="not found"):
        GSMConfig.from_file(tmp_path / "missing.yaml")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("enable: [true\n")
    with pytest.raises(GSMConfigError, match=r"bad\.yaml"):
        GSMConfig.from_file(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{enable: true}")
    with pytest.raises(GSMConfigError, match=r"bad\.json"):
        GSMConfig.from_file(bad_json)
    toml = tmp_path / "c.toml"
    toml.write_text("enable = true")
    with pytest.raises(GSMConfigError, match=r"\.toml"):
        GSMConfig.from_file(toml)
    with pytest.raises(GSMConfigError, match=r"\.txt"):
        GSMConfig().to_file(tmp_path / "c.txt")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(GSMConfigError, match="empty"):
        GSMConfig.from_file(empty)
    invalid = tmp_path / "invalid.json"
    invalid.write_text('{"smooth_strength": 0.5}')
    with pytest.raises(GSMConfigError, match=r"invalid\.json.*smooth_strength"):
        GSMConfig.from_file(invalid)


# --------------------------------------------------------------------------- profiles / masks

# 4 layers x 2 sites = 8 pairs -> top quarter = 2 pairs: (1, ffn_mid) k=50, (3, attn_out) k=40.
KURT = {
    (0, "attn_out"): 1.0,
    (0, "ffn_mid"): 5.0,
    (1, "attn_out"): 2.0,
    (1, "ffn_mid"): 50.0,
    (2, "attn_out"): 0.5,
    (2, "ffn_mid"): 12.0,
    (3, "attn_out"): 40.0,
    (3, "ffn_mid"): 3.0,
}


def _stats():
    return [
        {
            "layer": layer,
            "site": site,
            "max_abs": 10.0 + k,
            "variance": 1.0,
            "excess_kurtosis": k,
            "outlier_share_6sigma": 0.001,
        }
        for (layer, site), k in KURT.items()
    ]


@pytest.fixture
def profile_path(tmp_path):
    p = tmp_path / "profile.json"
    write_profile(p, build_profile("tiny-test", 4, _stats(), calibration_samples=8))
    return p


def test_select_high_kurtosis_top_quarter_and_threshold():
    assert select_high_kurtosis(_stats()) == [(1, "ffn_mid"), (3, "attn_out")]
    assert select_high_kurtosis(_stats(), threshold=10.0) == [
        (1, "ffn_mid"),
        (2, "ffn_mid"),
        (3, "attn_out"),
    ]
    assert select_high_kurtosis(_stats(), fraction=0.5) == [
        (0, "ffn_mid"),
        (1, "ffn_mid"),
        (2, "ffn_mid"),
        (3, "attn_out"),
    ]
    assert select_high_kurtosis([]) == []


def test_select_high_kurtosis_ties_deterministic_and_nan_skipped():
    tied = [{"layer": i // 2, "site": SITES[i % 2], "excess_kurtosis": 7.0} for i in range(8)]
    assert select_high_kurtosis(tied) == [(0, "attn_out"), (0, "ffn_mid")]
    assert select_high_kurtosis(list(reversed(tied))) == [(0, "attn_out"), (0, "ffn_mid")]
    with_nan = _stats()
    with_nan[3]["excess_kurtosis"] = float("nan")  # (1, ffn_mid), was the top
    assert select_high_kurtosis(with_nan) == [(2, "ffn_mid"), (3, "attn_out")]


def test_profile_schema(profile_path):
    prof = load_profile(profile_path)
    raw = json.loads(profile_path.read_text())
    assert raw == prof
    assert prof["schema"] == PROFILE_SCHEMA
    assert prof["num_layers"] == 4 and prof["model"] == "tiny-test"
    assert prof["sites"] == list(SITES)
    assert "m4" in prof["kurtosis_definition"]
    assert prof["high_kurtosis"] == [[1, "ffn_mid"], [3, "attn_out"]]
    assert prof["calibration_samples"] == 8
    assert {"max_abs", "variance", "excess_kurtosis", "outlier_share_6sigma"} <= set(
        prof["stats"][0]
    )


def test_profile_non_finite_written_as_null(tmp_path):
    stats = _stats()
    stats[0]["excess_kurtosis"] = float("nan")
    p = tmp_path / "p.json"
    write_profile(p, build_profile("m", 4, stats))
    assert json.loads(p.read_text())["stats"][0]["excess_kurtosis"] is None


def test_profile_errors(tmp_path, profile_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GSMConfigError, match=r"bad\.json"):
        load_profile(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(GSMConfigError, match="schema"):
        load_profile(wrong)
    with pytest.raises(GSMConfigError, match="not found"):
        load_profile(tmp_path / "nope.json")
    cfg = GSMConfig(profile=str(profile_path))
    with pytest.raises(GSMConfigError, match=r"4 layers.*has 6"):
        resolve_mask(cfg, 6)


def test_mask_all_list_dict():
    m = resolve_mask(GSMConfig(target_layers="all"), 3)
    assert m.shape == (3, 2) and m.dtype == bool and m.all()
    m = resolve_mask(GSMConfig(target_layers=[0, 2]), 3)
    assert m.tolist() == [[True, True], [False, False], [True, True]]
    m = resolve_mask(GSMConfig(target_layers={1: ["ffn_mid"], 2: ["attn_out"]}), 3)
    assert m.tolist() == [[False, False], [False, True], [True, False]]
    # sites restricts every form
    m = resolve_mask(GSMConfig(target_layers=[0, 2], sites=["attn_out"]), 3)
    assert m.tolist() == [[True, False], [False, False], [True, False]]
    assert not resolve_mask(GSMConfig(target_layers=[]), 3).any()


def test_mask_layer_out_of_range():
    with pytest.raises(GSMConfigError, match=r"layer 5.*3 layers"):
        resolve_mask(GSMConfig(target_layers=[0, 5]), 3)
    with pytest.raises(GSMConfigError, match=r"layer 3"):
        resolve_mask(GSMConfig(target_layers={3: ["attn_out"]}), 3)
    with pytest.raises(GSMConfigError, match="num_layers"):
        resolve_mask(GSMConfig(target_layers="all"), 0)


def test_mask_high_kurtosis(profile_path):
    with pytest.raises(GSMConfigError, match="needs a profile"):
        resolve_mask(GSMConfig(), 4)
    m = resolve_mask(GSMConfig(profile=str(profile_path)), 4)
    expected = np.zeros((4, 2), bool)
    expected[1, 1] = expected[3, 0] = True
    assert (m == expected).all()
    m = resolve_mask(GSMConfig(profile=str(profile_path), kurtosis_threshold=10.0), 4)
    expected[2, 1] = True
    assert (m == expected).all()
    m = resolve_mask(GSMConfig(profile=str(profile_path), sites=["ffn_mid"]), 4)
    assert np.argwhere(m).tolist() == [[1, 1]]


def test_describe(profile_path):
    text = describe(GSMConfig(profile=str(profile_path)), 4)
    assert "2 of 8" in text and "high_kurtosis" in text
    lines = text.splitlines()
    assert lines[-5].split() == ["layer", *SITES]
    rows = lines[-4:]
    assert rows[1].split() == ["1", ".", "yes"] and rows[3].split() == ["3", "yes", "."]
    assert "DISABLED" in describe(GSMConfig(enable=False, target_layers="all"), 2)


# --------------------------------------------------------------------------- rollout / bypass


def test_rollout_value_pinned_algorithm():
    # Pins the hash: blake2b-64 of str(id), top 53 bits. Python's hash() would differ per process.
    d = hashlib.blake2b(b"req-42", digest_size=8).digest()
    assert rollout_value("req-42") == (int.from_bytes(d, "big") >> 11) / 2.0**53
    assert rollout_value(7) == rollout_value("7")
    assert all(0.0 <= rollout_value(i) < 1.0 for i in range(1000))
    with pytest.raises(InvalidInputError):
        rollout_value(1.5)  # type: ignore[arg-type]


def test_row_enabled_determinism_and_extremes():
    ids = [f"req-{i}" for i in range(200)]
    toks = [100] * len(ids)
    half = GSMConfig(rollout_fraction=0.5)
    a = row_enabled(half, ids, toks)
    assert a.dtype == bool and a.shape == (200,)
    assert (a == row_enabled(half, ids, toks)).all()
    # per id, not per position: reordering the batch permutes the decisions
    assert (row_enabled(half, ids[::-1], toks) == a[::-1]).all()
    assert not row_enabled(GSMConfig(rollout_fraction=0.0), ids, toks).any()
    assert row_enabled(GSMConfig(rollout_fraction=1.0), ids, toks).all()
    assert row_enabled(GSMConfig(), None, toks).all()
    assert not row_enabled(GSMConfig(enable=False), None, toks).any()
    # raising the fraction never drops an already-selected request
    b = row_enabled(GSMConfig(rollout_fraction=0.7), ids, toks)
    assert (b | ~a).all()


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.5, 0.9])
def test_rollout_share(fraction):
    # n = 10_000 ids; if the hash is uniform the count is Binomial(n, f). Allow 5 sd
    # (sd <= 50 at f = 0.5): a false failure has probability < 6e-7, and the test is
    # deterministic anyway (fixed ids); a biased hash (e.g. off by 0.03) would fail.
    n = 10_000
    got = row_enabled(GSMConfig(rollout_fraction=fraction), list(range(n)), [1] * n).sum()
    sd = math.sqrt(n * fraction * (1 - fraction))
    assert abs(got - n * fraction) <= 5 * sd, (got, n * fraction, sd)


def test_short_request_bypass():
    c = GSMConfig(short_request_tokens=64)
    out = row_enabled(c, ["a", "b", "c", "d"], [10, 63, 64, 500])
    assert out.tolist() == [False, False, True, True]
    assert row_enabled(GSMConfig(), None, [0, 1]).all()  # 0 = bypass off
    with pytest.raises(InvalidInputError, match="request_ids"):
        row_enabled(c, ["a"], [1, 2])
    with pytest.raises(InvalidInputError, match="total_tokens"):
        row_enabled(c, None, [-1])


# --------------------------------------------------------------------------- watcher


def _write(path, data):
    # write + bump mtime so the change is visible even to stat-based tools
    path.write_text(json.dumps(data))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_watcher_reload_refuse_rollback(tmp_path, caplog):
    p = tmp_path / "gsm.json"
    _write(p, {"smooth_strength": 0.1, "target_layers": "all"})
    seen = []
    w = ConfigWatcher(
        p, on_change=lambda new, old: seen.append((old.smooth_strength, new.smooth_strength))
    )
    assert w.config.smooth_strength == 0.1
    assert w.poll() is False  # unchanged

    _write(p, {"smooth_strength": 0.2, "target_layers": "all"})
    assert w.poll() is True and w.config.smooth_strength == 0.2 and w.last_error is None

    with caplog.at_level(logging.WARNING, logger="gsm_jax.config"):
        _write(p, {"smooth_strength": 0.9, "target_layers": "all"})
        assert w.poll() is False
    assert w.config.smooth_strength == 0.2
    assert "smooth_strength" in w.last_error and "smooth_strength" in caplog.text

    p.write_text("{broken")
    assert w.poll() is False and "gsm.json" in w.last_error
    p.unlink()
    assert w.poll() is False and "not found" in w.last_error
    assert w.config.smooth_strength == 0.2

    _write(p, {"smooth_strength": 0.25, "target_layers": "all"})
    assert w.poll() is True and w.config.smooth_strength == 0.25 and w.last_error is None

    assert w.rollback().smooth_strength == 0.2
    assert w.config.smooth_strength == 0.2
    assert w.poll() is False  # file unchanged: the rollback stays in force
    assert w.rollback().smooth_strength == 0.1
    with pytest.raises(GSMConfigError, match="roll back"):
        w.rollback()
    assert seen == [(0.1, 0.2), (0.2, 0.25), (0.25, 0.2), (0.2, 0.1)]


def test_watcher_same_size_edit_detected(tmp_path):
    p = tmp_path / "gsm.yaml"
    p.write_text("smooth_strength: 0.1\ntarget_layers: all\n")
    w = ConfigWatcher(p)
    p.write_text("smooth_strength: 0.2\ntarget_layers: all\n")  # same size, maybe same mtime
    assert w.poll() is True and w.config.smooth_strength == 0.2


def test_watcher_checks_layers_when_given(tmp_path):
    p = tmp_path / "gsm.yaml"
    GSMConfig(target_layers=[0, 1]).to_file(p)
    w = ConfigWatcher(p, num_layers=2)
    GSMConfig(target_layers=[0, 5]).to_file(p)
    assert w.poll() is False and "layer 5" in w.last_error
    with pytest.raises(GSMConfigError, match="needs a profile"):
        GSMConfig().to_file(p)
        ConfigWatcher(p, num_layers=2)


def test_watcher_background_thread(tmp_path):
    p = tmp_path / "gsm.yaml"
    GSMConfig(target_layers="all").to_file(p)
    with ConfigWatcher(p).start(interval=0.01) as w:
        GSMConfig(target_layers="all", smooth_strength=0.3).to_file(p)
        deadline = time.monotonic() + 5.0
        while w.config.smooth_strength != 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.config.smooth_strength == 0.3
    assert w._thread is None
