#!/usr/bin/env bash
# Set up (if needed) and gate the installed vLLM on the bundled corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_TARGET_DEVICE=cpu
exec "${KVGATE_VENV:-.venv}/bin/kvgate" gate --target vllm "$@"
