#!/usr/bin/env bash
# Sets up .venv with the dev extras and the default model, then runs the whole test suite in
# JAXSERVE_TEST_WORKERS processes (default 2; pytest-xdist). Extra arguments go to pytest and win:
# `-n 0` runs in this one process, `-m smoke` or `-m "not slow"` picks a smaller loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
exec .venv/bin/python -m pytest -q --durations=40 -n "${JAXSERVE_TEST_WORKERS:-2}" tests "$@"
