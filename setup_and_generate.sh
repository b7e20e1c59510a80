#!/usr/bin/env bash
# Set-up + main job: install everything into .venv (or reuse it), then generate with the
# embedded default model (SmolLM2-135M-Instruct), printing the text and tokens/s.
# Extra arguments go to `gsm-jax generate` (e.g. --chat "Hello").
source "$(dirname "$0")/scripts/env.sh"
if [ "$#" -eq 0 ]; then
  set -- "The capital of France is" "def fib(n):" --max-new-tokens 64
fi
exec gsm-jax generate --model smollm2-135m "$@"
