#!/usr/bin/env bash
# Sets up .venv with the default model, then starts the OpenAI-compatible server on SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m runtime.serve --model smollm2-135m "$@"
