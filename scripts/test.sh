#!/usr/bin/env bash
# Sets up .venv with the dev extras and the default model, then runs the whole test suite in
# JAXSERVE_TEST_WORKERS processes (default 2; pytest-xdist). Extra arguments go to pytest and win:
# `-n 0` runs in this one process, `-m smoke` or `-m "not slow"` picks a smaller loop.
# --dist loadscope: a module's (or class's) tests run in one process, so its fixtures (an engine, HF's
# outputs) are built once, not once per process: a cold run of six fixture-heavy modules took 341 s
# against 410 s with --dist load (2026-12-07). `--dist load` overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
exec .venv/bin/python -m pytest -q --durations=40 -n "${JAXSERVE_TEST_WORKERS:-2}" --dist loadscope tests "$@"
