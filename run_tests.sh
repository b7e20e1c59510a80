#!/usr/bin/env bash
# The test suite: install into .venv (or reuse it), then run ruff and pytest.
# Extra arguments go to pytest (e.g. -k tokenizer). The 25 slowest tests are listed at the end.
source "$(dirname "$0")/scripts/env.sh"
cd "$ROOT"
ruff check .
GSM_JAX_TEST_TRACE="$(mktemp)"
export GSM_JAX_TEST_TRACE
rc=0
# Two worker processes (pytest-xdist), a whole test file per worker so module fixtures are
# built once: XLA compiles one program on one core, and the suite is mostly compilation.
# Files go out in collection order, slowest first (tests/conftest.py: SLOWEST_FILES_FIRST).
# GSM_JAX_TEST_WORKERS=0 runs everything in this process.
WORKERS="${GSM_JAX_TEST_WORKERS:-2}"
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
python -m pytest -q --durations=25 "${XDIST[@]}" "$@" || rc=$?
if [ "$rc" -ge 128 ]; then  # killed by a signal: name the test that was running
  # (with workers, pytest-xdist itself names the test a crashed worker was running)
  echo "pytest died of signal $((rc - 128)) while running: $(cat "$GSM_JAX_TEST_TRACE")" >&2
fi
rm -f "$GSM_JAX_TEST_TRACE"
exit "$rc"
