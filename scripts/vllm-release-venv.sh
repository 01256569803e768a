#!/usr/bin/env bash
# Print the path of a venv holding vLLM RELEASE beside the pinned set, made
# when missing, as scripts/vllm-matrix.sh makes its venvs:
#
#   scripts/vllm-release-venv.sh RELEASE
#
# The pinned release is $KVGATE_VENV itself. Any other release gets
# $KVGATE_MATRIX_VENVS/vllm-<release> (default .venvs/): a bare venv holding
# only that vLLM (pip --no-deps) plus a .pth that appends the pinned venv's
# site-packages, so torch and every pinned dependency are shared and the
# release's own vllm package shadows the pinned one. pip's output goes to
# stderr; only the path is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
release="${1:?usage: scripts/vllm-release-venv.sh RELEASE}"
pinned_venv="${KVGATE_VENV:-.venv}"
case "$pinned_venv" in /*) ;; *) pinned_venv="$root/$pinned_venv" ;; esac
venvs="${KVGATE_MATRIX_VENVS:-$root/.venvs}"
pinned="$(grep -o 'vllm==[0-9][0-9.]*' scripts/setup.sh | head -1 | cut -d= -f3)"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
version_of() {
  "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true
}
if [ "$release" = "$pinned" ]; then
  echo "$pinned_venv"
  exit 0
fi
venv="$venvs/vllm-$release"
if [ "$(version_of "$venv")" != "$release" ]; then
  base="$("$pinned_venv/bin/python" -c 'import sys; print(sys._base_executable)')"
  [ -x "$venv/bin/python" ] || "$base" -m venv "$venv" >&2
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps "vllm==$release" >&2
fi
# Appended after the venv's own site-packages: the release's vllm wins.
echo "import site; site.addsitedir('$(site_of "$pinned_venv")')" > "$(site_of "$venv")/zz_kvgate_pinned_set.pth"
[ "$(version_of "$venv")" = "$release" ] || { echo "vllm-release-venv: $venv does not hold vLLM $release" >&2; exit 2; }
echo "$venv"
