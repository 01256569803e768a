#!/usr/bin/env bash
# Set up (if needed) and run kvgate's default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_TARGET_DEVICE=cpu
# Test files spread over KVGATE_TEST_JOBS processes (default: one a core, at
# most 4, as each imports vLLM), each file whole in one process so that its
# module fixtures run once; KVGATE_TEST_JOBS=0 runs them all in this one.
cores="$(nproc 2>/dev/null || echo 2)"
jobs="${KVGATE_TEST_JOBS:-$((cores < 4 ? cores : 4))}"
exec "${KVGATE_VENV:-.venv}/bin/python" -m pytest -n "$jobs" --dist loadfile "$@"
