#!/usr/bin/env bash
# Sets up .venv (pip runs only when pyproject.toml changed), then starts the OpenAI-compatible
# server: `jaxserve serve` with every flag passed through (default model smollm2-135m, unless
# --model or --plan says otherwise). Model, plan and port are checked before anything compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# A mistyped flag is reported against this script, the command the user typed.
JAXSERVE_PROG="runtime.serve=$0" exec .venv/bin/python -m runtime.tools.cli serve "$@"
