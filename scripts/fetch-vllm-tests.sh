#!/usr/bin/env bash
# Fetch vLLM 0.33.0's own tests (tests/ of its sdist) into .cache/, once.
# Prints the folder. The sdist comes through pip by name; reading its
# metadata runs its setup.py, which needs torch and the tools pinned in
# requirements/sdist-tools.txt, and a version override (it would otherwise
# append a device suffix and pip would reject the file).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGATE_VENV:-.venv}"
dest=".cache/vllm-0.33.0-tests"
if [ ! -f "$dest/tests/v1/core/test_prefix_caching.py" ]; then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install -r requirements/sdist-tools.txt
  work="$(mktemp -d)"
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.33.0 \
    "$venv/bin/python" -m pip --disable-pip-version-check -q download \
    --no-deps --no-binary :all: --no-build-isolation vllm==0.33.0 -d "$work" >&2
  mkdir -p "$dest"
  # Only tests/: the sdist's vllm/ sources would shadow the installed build.
  tar -xzf "$work/vllm-0.33.0.tar.gz" -C "$dest" --strip-components=1 vllm-0.33.0/tests
  rm -rf "$work"
fi
echo "$dest"
