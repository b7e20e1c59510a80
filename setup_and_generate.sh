#!/usr/bin/env bash
# Set-up + main job: install what generation needs into .venv (or reuse it; no test extra, no
# torch: run_tests.sh adds those), then generate with the embedded default model
# (SmolLM2-135M-Instruct), printing the text and tokens/s.
# Extra arguments go to `gsm-jax generate` (e.g. --chat "Hello").
# GSM_JAX_EXTRAS=test ./setup_and_generate.sh installs the test extra as well.
export GSM_JAX_EXTRAS="${GSM_JAX_EXTRAS-}"
source "$(dirname "$0")/scripts/env.sh"
if [ "$#" -eq 0 ]; then
  set -- "The capital of France is" "def fib(n):" --max-new-tokens 64
fi
exec gsm-jax generate --model smollm2-135m "$@"
