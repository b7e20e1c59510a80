"""DeepSeek-V4.1 against NeMo on NeMo-saved configs: the table in issue 41's closing note.

For each parity config of the tests (tests/test_deepseek_v41.py: PARITY and TIES), a
released-layout checkpoint is written from NeMo's own weights with the config NeMo's
`save_pretrained` writes, loaded by gsm_jax (FP8 / FP4 kept), and compared with NeMo
(max |logit difference| / max |logit|, top-1 agreement, 2 x 48 tokens): with float caches,
with the released cache roundings, and as the pre-fix reader ran it (no YaRN on the
compressed layers: `yarn_factor=1.0`). NeMo's top-k is made deterministic the way JAX's
is (`stable_topk`), which also counts the boundary ties it meets. Needs the test extra
(torch, NeMo AutoModel): `python scripts/v41_parity_table.py`.
"""
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import v41_reference as ref  # noqa: E402  (the test helper that drives NeMo)

import gsm_jax  # noqa: E402
from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint  # noqa: E402

# name -> (text-config overrides, NeMo seed): tests/test_deepseek_v41.py's PARITY and TIES
CASES = {
    "keeps_all": (dict(index_topk=64, candidate_topk_blocks=16), 0),
    "must_choose": (dict(index_n_heads=8), 1),
    "ties_top3": (dict(index_topk=3, candidate_topk_blocks=2, candidate_block_size=4), 2),
    "ties_top4_two_candidates": (dict(index_topk=4, candidate_topk_blocks=1,
                                      candidate_block_size=2), 3),
    "ties_top5_four_candidates": (dict(index_topk=5, candidate_topk_blocks=2,
                                       candidate_block_size=2), 5),
}


def rel(out, want) -> float:
    return float(np.abs(np.asarray(out) - want).max() / np.abs(want).max())


def top1(out, want) -> float:
    return float(np.mean(np.asarray(out).argmax(-1) == want.argmax(-1)))


def main() -> None:
    ids = np.random.default_rng(7).integers(3, 128, size=(2, 48))
    for name, (overrides, seed) in CASES.items():
        model = ref.nemo_model(ref.tiny_config(engram_layer_ids=[1, 5], **overrides), seed=seed)
        path = write_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", ref.saved_config(model),
                                ref.released_state_dict(model), ref.tiny_tokenizer_json())
        nemo = ref.nemo_from_checkpoint(model, path)
        params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
        float_caches = dataclasses.replace(
            params, config=dataclasses.replace(params.config, cache_qdq=False))
        no_yarn = dataclasses.replace(  # what the reader before issue 41 built
            float_caches, config=dataclasses.replace(float_caches.config, yarn_factor=1.0))
        with ref.stable_topk() as ties:
            want = ref.nemo_logits(nemo, ids, cache_qdq=False)
        with ref.stable_topk() as ties_q:
            want_q = ref.nemo_logits(nemo, ids)
        got = gsm_jax.forward(float_caches, ids)
        got_q = gsm_jax.forward(params, ids)
        old = gsm_jax.forward(no_yarn, ids)
        print(f"{name}: float caches {rel(got, want):.2e} (top-1 {top1(got, want):.3f}); "
              f"released caches {rel(got_q, want_q):.2e} (top-1 {top1(got_q, want_q):.3f}); "
              f"old reader, no YaRN {rel(old, want):.2e} (top-1 {top1(old, want):.3f}); "
              f"boundary ties {ties.boundary_ties} / {ties_q.boundary_ties}", flush=True)


if __name__ == "__main__":
    main()
