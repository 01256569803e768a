#!/usr/bin/env bash
# Gate every vLLM release a user may deploy, side by side, on demand (the
# default CI stays on the pinned release).
#
#   scripts/vllm-matrix.sh [RELEASE...]        (default: 0.32.0 0.33.0 0.34.0)
#
# For each release: its own venv (the pinned release uses $KVGATE_VENV, the
# others $KVGATE_MATRIX_VENVS/vllm-<release>, default .venvs/), made cheaply
# by reusing the pinned set: a bare venv holding only that vLLM (pip
# --no-deps) plus a .pth that appends the pinned venv's site-packages, so
# torch and every pinned dependency are shared and the release's own vllm
# package shadows the pinned one. kvgate runs from this checkout
# (PYTHONPATH), never installed into those venvs. Then four runs:
#
#   gate      kvgate gate --target vllm                          (the corpus, strict)
#   overlay   the same with --plugin kvgate.impl.hold_overlay
#   mutate    kvgate mutate --target vllm                        (the fault campaign)
#   own       scripts/vllm-own-tests.sh: the release's own manager tests
#             (fetched per release by scripts/fetch-vllm-tests.sh)
#
# and one table (markdown) at the end; every run's full output is kept in
# $KVGATE_MATRIX_OUT/<release>/<run>.txt (default out/matrix). Environment:
# KVGATE_MATRIX_RUNS="gate overlay mutate own" picks runs; KVGATE_MATRIX_REUSE=1
# reuses a run's output when it finished before (to add the slow `own`
# column later). The own suite takes many minutes per release on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
pinned_venv="${KVGATE_VENV:-.venv}"
case "$pinned_venv" in /*) ;; *) pinned_venv="$root/$pinned_venv" ;; esac
venvs="${KVGATE_MATRIX_VENVS:-$root/.venvs}"
out="${KVGATE_MATRIX_OUT:-$root/out/matrix}"
runs="${KVGATE_MATRIX_RUNS:-gate overlay mutate own}"
releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(0.32.0 0.33.0 0.34.0)

[ "${KVGATE_SKIP_SETUP:-0}" = 1 ] || KVGATE_VENV="$pinned_venv" bash scripts/setup.sh
pinned="$(grep -o 'vllm==[0-9][0-9.]*' scripts/setup.sh | head -1 | cut -d= -f3)"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
version_of() {
  "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true
}

venv_for() {  # RELEASE -> the venv's path, made when missing
  local release="$1"
  if [ "$release" = "$pinned" ]; then
    echo "$pinned_venv"
    return
  fi
  local venv="$venvs/vllm-$release"
  if [ "$(version_of "$venv")" != "$release" ]; then
    local base
    base="$("$pinned_venv/bin/python" -c 'import sys; print(sys._base_executable)')"
    [ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
    "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps "vllm==$release" >&2
  fi
  local pth
  pth="$(site_of "$venv")/zz_kvgate_pinned_set.pth"
  # Appended after the venv's own site-packages: the release's vllm wins.
  echo "import site; site.addsitedir('$(site_of "$pinned_venv")')" > "$pth"
  echo "$venv"
}

summary() {  # RUN FILE -> one table cell
  local run="$1" file="$2"
  [ -s "$file" ] || { echo "not run"; return; }
  case "$run" in
    gate|overlay)
      local line refused
      refused="$(grep -m1 'hold overlay refused' "$file" || true)"
      line="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$file" | tail -1)"
      if [ -n "$refused" ]; then echo "refused: ${refused#*refused: }"; return; fi
      local named known
      named="$(grep -E '^difference ' "$file" | cut -d' ' -f2 | paste -sd, - || true)"
      known="$(grep -oE 'known: +difference [a-z0-9-]+' "$file" | awk '{print $3}' | sort -u | paste -sd, - || true)"
      echo "${line:-no summary (see $file)}${named:+; not compared (unobservable): $named}${known:+; known difference: $known}"
      ;;
    mutate)
      local rate na
      rate="$(grep -m1 '^kill rate' "$file" | sed 's/^kill rate: //; s/; not applicable here:.*//')"
      na="$(grep -m1 '^kill rate' "$file" | grep -o 'not applicable here: .*' | sed 's/not applicable here: //')"
      echo "${rate:-no summary (see $file)}${na:+; not applicable: $na}"
      ;;
    own)
      grep -E '(passed|failed|error)' "$file" | grep -E '^=*\s*[0-9]+ (passed|failed)|in [0-9.]+s' | tail -1 | sed 's/=//g; s/^ *//; s/ *$//'
      ;;
  esac
}

run_one() {  # RELEASE VENV RUN
  local release="$1" venv="$2" run="$3" file="$out/$1/$3.txt"
  if [ "${KVGATE_MATRIX_REUSE:-0}" = 1 ] && grep -q '^exit ' "$file" 2>/dev/null; then
    return
  fi
  mkdir -p "$out/$release"
  echo "== vLLM $release: $run" >&2
  local py="$venv/bin/python" status=0
  case "$run" in
    gate) "$py" -m kvgate gate --target vllm > "$file" 2>&1 || status=$? ;;
    overlay) "$py" -m kvgate gate --target vllm --plugin kvgate.impl.hold_overlay > "$file" 2>&1 || status=$? ;;
    mutate) "$py" -m kvgate mutate --target vllm > "$file" 2>&1 || status=$? ;;
    own) KVGATE_VENV="$venv" KVGATE_SKIP_SETUP=1 bash scripts/vllm-own-tests.sh -q -p no:cacheprovider \
      > "$file" 2>&1 || status=$? ;;
  esac
  echo "exit $status" >> "$file"
}

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
for release in "${releases[@]}"; do
  venv="$(venv_for "$release")"
  [ "$(version_of "$venv")" = "$release" ] || { echo "vllm-matrix: $venv does not hold vLLM $release" >&2; exit 2; }
  for run in $runs; do run_one "$release" "$venv" "$run"; done
done

echo "| vLLM | gate (corpus, strict) | with the hold overlay | fault campaign | vLLM's own manager tests |"
echo "| --- | --- | --- | --- | --- |"
for release in "${releases[@]}"; do
  row="| $release"
  for run in gate overlay mutate own; do row="$row | $(summary "$run" "$out/$release/$run.txt")"; done
  echo "$row |"
done
