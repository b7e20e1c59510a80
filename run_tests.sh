#!/usr/bin/env bash
# The test suite: install into .venv (or reuse it), then run ruff and pytest.
# Extra arguments go to pytest (e.g. -k tokenizer). The 25 slowest tests are listed at the end.
source "$(dirname "$0")/scripts/env.sh"
cd "$ROOT"
ruff check .
GSM_JAX_TEST_TRACE="$(mktemp)"
export GSM_JAX_TEST_TRACE
rc=0
python -m pytest -q --durations=25 "$@" || rc=$?
if [ "$rc" -ge 128 ]; then  # killed by a signal: name the test that was running
  echo "pytest died of signal $((rc - 128)) while running: $(cat "$GSM_JAX_TEST_TRACE")" >&2
fi
rm -f "$GSM_JAX_TEST_TRACE"
exit "$rc"
