"""Self-checks of the DeepSeek-V4.1 reference harness (tests/v41_reference.py): the tiny
config covers every layer role, the tokenizer merges ids, the NeMo model is seeded away from
identity init, logits are finite and padding-invariant, and the released-name state dict
round-trips through NeMo's adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: E402
from v41_reference import (  # noqa: E402
    TINY_ENGRAM_CLASSES,
    nemo_engram_hash,
    nemo_logits,
    nemo_model,
    nemo_streams,
    released_state_dict,
    tiny_config,
    tiny_tokenizer,
)


@pytest.fixture(scope="module")
def model():
    return nemo_model(tiny_config(), tiny_tokenizer(), seed=0)


def test_config_roles():
    t = tiny_config()["text_config"]
    ratios, kv, idx = t["compress_ratios"], t["kv_source_layer_ids"], t["index_source_layer_ids"]
    roles = []
    for i, r in enumerate(ratios):
        if r == 0:
            roles.append("swa")
        elif i in kv:
            roles.append(f"full{r}")
        elif i in idx:
            roles.append(f"reindex{r}")
        else:
            roles.append(f"reuse{r}")
    assert roles == ["swa", "swa", "full2", "reuse2", "reuse2", "full1", "reuse1", "reindex1"]
    assert ratios[t["candidate_source_layer_id"]] == 1
    assert t["engram_layer_ids"] == [1, 5] and t["engram_num_embeddings"] == [384, 552]
    assert tiny_config(num_hidden_layers=4)["text_config"]["num_hidden_layers"] == 4
    assert tiny_config() == tiny_config()


def test_model_seeded_and_finite(model):
    tok = tiny_tokenizer()
    assert len(tok) == 128
    hasher = model.model.engram_hash
    assert int(hasher.token_map.max()) + 1 == TINY_ENGRAM_CLASSES < 128
    params = dict(model.named_parameters())
    assert params["model.layers.0.attn.sinks_param.weight"].abs().min() > 0
    assert (params["model.layers.2.attn.kv_norm.weight"] != 1).all()
    assert (params["model.layers.1.engram.q_weight"] != 1).all()
    assert model.model.layers["0"].ffn.gate.e_score_correction_bias.abs().min() > 0
    assert all(p.dtype == torch.float32 for p in params.values())
    ids = np.random.default_rng(1).integers(0, 128, (2, 12))
    mask = np.ones((2, 12), int)
    mask[1, 7:] = 0
    logits = nemo_logits(model, ids, mask)
    assert logits.shape == (2, 12, 128) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(logits, nemo_logits(model, ids, mask))  # deterministic
    # right padding ignored; with float caches, as torch's padded and unpadded products may
    # differ in the last ulp (CPU-dependent), which moves a value on an FP8 / FP4 cache
    # rounding midpoint a whole step (4e-5 seen on an Intel Xeon)
    padded = nemo_logits(model, ids, mask, cache_qdq=False)
    short = nemo_logits(model, ids[1:, :7], cache_qdq=False)
    np.testing.assert_allclose(padded[1, :7], short[0], atol=1e-5)
    assert nemo_engram_hash(model, ids).shape == (2, 12, 2, 6)
    streams = nemo_streams(model, ids, mask)
    assert len(streams) == 8 and streams[0].shape == (2, 12, 4, 64)
    np.testing.assert_array_equal(streams[0][:, :, 0], streams[0][:, :, 3])  # embed x N
    assert np.abs(streams[1] - streams[2]).max() > 0


def test_released_state_dict_round_trip(model):
    sd = released_state_dict(model)
    assert all(v.dtype == np.float32 for v in sd.values())
    assert sd["layers.1.engram.embed.weight"].shape == (384, 32)
    assert "layers.7.attn.indexer.wq_b.weight" in sd
    assert "layers.7.attn.compressor.wkv.weight" not in sd
    assert "layers.2.attn.compressor.wgate.weight" in sd
    assert "layers.5.attn.compressor.wgate.weight" not in sd
    assert sd["layers.0.ffn.experts.7.w2.weight"].shape == (64, 32)
    native = model.state_dict_adapter.from_hf({k: torch.from_numpy(v) for k, v in sd.items()})
    ours = model.state_dict()
    assert set(native) == set(ours)
    for k, v in native.items():
        np.testing.assert_array_equal(v.float().numpy(), ours[k].float().numpy(), err_msg=k)
