#!/usr/bin/env bash
# The test suite: install into .venv (or reuse it), then run ruff and pytest.
# Extra arguments go to pytest (e.g. -k tokenizer).
source "$(dirname "$0")/scripts/env.sh"
cd "$ROOT"
ruff check .
python -m pytest -q "$@"
