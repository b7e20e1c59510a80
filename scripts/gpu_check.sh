#!/usr/bin/env bash
# The Llama path on one GPU: Pallas filter kernels vs references, a random ~1B Llama in bf16
# at batch 1/16/64 (tokens/s, HBM bytes per step vs 4.8 TB/s), w8a16 / w8a8 vs bf16, GSM
# overhead; JSON out. One run < 8 min.
#   bash scripts/gpu_check.sh --out runs/gpu_check   # on the GPU machine (jax[cuda])
#   bash scripts/gpu_check.sh --dry-run              # CPU: same code, tiny sizes (CI)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_check_run gpu_check.py "$@"
