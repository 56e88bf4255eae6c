#!/usr/bin/env bash
# Sets up .venv with the dev extras and the default model, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
exec .venv/bin/python -m pytest -q --durations=40 tests "$@"
