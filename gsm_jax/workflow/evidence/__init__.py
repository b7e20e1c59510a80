"""Claim-by-claim evidence: the source document's 14 claims, measured on several models.

    gsm-jax evidence --models smollm2-135m,gemma3-270m --out reports

Modules (imported on use; nothing is imported here):

- `runner`: `EvidenceSizes`, the registry `CLAIMS` (claim number -> statement and the
  ``module:function`` that measures it) and `run_evidence`, which writes one JSON per
  claim and model to ``<out>/data/evidence/<model>/claim_<N>.json``.
- `quality_claims`: claims 1, 2, 4, 5, 8, 11 and 12 (quality against the unsmoothed
  model, step time, bytes per decode step, back-off, protect_first).
- `lowp_claims` (claims 3 and 9), `serving_claim` (6, 7 and 14), `speculative_claim` (10),
  `kv_claims` (13):
  written elsewhere; a claim whose module is absent is reported as not measured.
- `random_models`: `random:<preset>` models (a mid-size DeepSeek-V4.1 with random
  weights, written once as a released-layout checkpoint) for the cost claims; their
  results are marked "random weights: cost only" and their quality claims refused.
- `render`: `render_evidence`, the markdown ``<out>/gsm_evidence.md`` and one PNG per
  claim in ``<out>/figures/evidence/`` from those JSONs (measures nothing).
"""
