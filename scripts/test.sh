#!/usr/bin/env bash
# Set up (if needed) and run kvgate's default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_TARGET_DEVICE=cpu
exec "${KVGATE_VENV:-.venv}/bin/python" -m pytest "$@"
