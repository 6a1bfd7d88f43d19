#!/usr/bin/env bash
# Sets up .venv (pinned) and runs the main job on the embedded defaults: the whole optimization
# graph for the shipped SmolLM2 model, tuned to a slice of the Azure conversation trace in traces/,
# ending with the chosen variant hot-swapped into a server on loopback. Prints the baseline
# configuration against the chosen variant.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
TRACE=${POLYINF_TRACE:-traces/AzureLLMInferenceTrace_conv.csv}
exec .venv/bin/polyinf optimize --model smollm2 --trace "$TRACE" "$@"
