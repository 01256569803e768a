#!/usr/bin/env bash
# Fetch the installed vLLM release's own tests (tests/ of its sdist) into
# .cache/vllm-<version>-tests/, once. Prints the folder. The release is the
# one installed in $KVGATE_VENV (default .venv): 0.33.0 unless the matrix
# (scripts/vllm-matrix.sh) points it at another release's venv. The sdist comes through pip by name; reading its
# metadata runs its setup.py, which needs torch and the tools pinned in
# requirements/sdist-tools.txt, and a version override (it would otherwise
# append a device suffix and pip would reject the file).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGATE_VENV:-.venv}"
version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
dest=".cache/vllm-$version-tests"
if [ ! -f "$dest/tests/v1/core/test_prefix_caching.py" ]; then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install -r requirements/sdist-tools.txt
  work="$(mktemp -d)"
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$version" \
    "$venv/bin/python" -m pip --disable-pip-version-check -q download \
    --no-deps --no-binary :all: --no-build-isolation "vllm==$version" -d "$work" >&2
  mkdir -p "$dest"
  # Only tests/: the sdist's vllm/ sources would shadow the installed build.
  tar -xzf "$work/vllm-$version.tar.gz" -C "$dest" --strip-components=1 "vllm-$version/tests"
  rm -rf "$work"
fi
echo "$dest"
