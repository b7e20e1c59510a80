#!/usr/bin/env bash
# DeepSeek-V4-Flash at real width (8 of its 43 layers), FP8/FP4 as stored, on one GPU:
# decode tokens/s and HBM bytes per step against the H200's 4.8 TB/s. One run < 8 min.
#   bash scripts/gpu_check_deepseek.sh                 # on the GPU machine (jax[cuda] installed)
#   bash scripts/gpu_check_deepseek.sh --dry-run       # CPU: the same code at reduced width (CI)
# Extra arguments go to scripts/gpu_check_deepseek.py (--layers, --batches, --out ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
if [[ " $* " != *" --dry-run "* ]]; then
  "$PY" -c "import jax, sys; d = jax.devices()[0]; print('[gpu_check] device:', d.device_kind); sys.exit(d.platform == 'cpu')" \
    || { echo "[gpu_check] no accelerator found (use --dry-run on CPU)" >&2; exit 2; }
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
exec timeout 480 "$PY" "$ROOT/scripts/gpu_check_deepseek.py" "$@"
