#!/usr/bin/env bash
# DeepSeek-V4-Flash (8 of its 43 layers) or V4.1-Flash (--model v4.1: 6 layers, every kind)
# at real width, FP8/FP4 as stored, on one GPU:
# decode tokens/s and HBM bytes per step against the H200's 4.8 TB/s. One run < 8 min.
#   bash scripts/gpu_check_deepseek.sh --out runs/gpu_dsv4   # on the GPU machine (jax[cuda])
#   bash scripts/gpu_check_deepseek.sh --dry-run             # CPU: same code, reduced width (CI)
# Arguments go to scripts/gpu_check_deepseek.py (--layers, --batches, --out ...).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_check_run gpu_check_deepseek.py "$@"
