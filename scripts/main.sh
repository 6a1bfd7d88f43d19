#!/usr/bin/env bash
# Sets up .venv (pinned) and runs the main job on the embedded defaults:
# the shipped SmolLM2 model answers a question and the engine reports tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
exec .venv/bin/polyinf generate --model smollm2 --chat --prompt "What is the capital of France?" "$@"
