#!/usr/bin/env bash
# Coverage (line and branch) of vLLM 0.33.0's block_pool.py,
# kv_cache_manager.py, kv_cache_coordinator.py and the MambaManager class,
# reached by kvgate (the corpus gate at strict level plus the differential
# exploration, ci profile, combined) next to vLLM's own manager tests
# (tests/v1/core/prefix_cache/ and test_prefix_caching.py).
#
#   scripts/coverage-report.sh [OUT_DIR]     (default: out/coverage)
#
# KVGATE_VENV names the venv (default .venv; KVGATE_SKIP_SETUP=1 passes on to
# scripts/vllm-own-tests.sh for a venv set up already). KVGATE_OWN_COVERAGE
# names an earlier run's OUT_DIR/.coverage.vllm-tests to reuse instead of
# running vLLM's tests again (about an hour under coverage on 2 busy cores);
# KVGATE_OWN_TESTS=skip leaves that column out.
# Each column's unreached lines and branch exits go to
# OUT_DIR/missing-<column>.txt, for finding what is still unreached.
#
# vLLM's own tests run through scripts/vllm-own-tests.sh when it exists
# (it installs their extra test deps); otherwise they are fetched with
# scripts/fetch-vllm-tests.sh and run here with pytest. Either way every
# Python process started gets coverage through a sitecustomize on
# PYTHONPATH (coverage's subprocess support), so the wrapper's own way of
# calling pytest needs no change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGATE_VENV:-.venv}"
py="$(cd "$venv/bin" && pwd)/python"
out="$(realpath -m "${1:-out/coverage}")"
mkdir -p "$out"
export VLLM_TARGET_DEVICE=cpu
core="$("$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "core")')"

# One rc file per column: branch coverage of the four files, parallel data
# files (subprocesses) combined afterwards.
rcfile() {
  cat > "$out/$1.rc" <<RC
[run]
branch = True
parallel = True
data_file = $out/.coverage.$1
include =
    $core/block_pool.py
    $core/kv_cache_manager.py
    $core/kv_cache_coordinator.py
    $core/single_type_kv_cache_manager.py
RC
  echo "$out/$1.rc"
}
hook="$out/hook"
mkdir -p "$hook"
printf 'import coverage\ncoverage.process_startup()\n' > "$hook/sitecustomize.py"

run_covered() {  # NAME COMMAND...: run COMMAND with coverage in every process
  local name="$1"; shift
  local rc; rc="$(rcfile "$name")"
  rm -f "$out/.coverage.$name" "$out/.coverage.$name".*
  COVERAGE_PROCESS_START="$rc" PYTHONPATH="$hook${PYTHONPATH:+:$PYTHONPATH}" "$@" || {
    echo "coverage-report: '$*' exited $? (figures cover what ran)" >&2; }
  "$py" -m coverage combine --rcfile="$rc" --data-file="$out/.coverage.$name" \
    "$out"/.coverage."$name".* >/dev/null 2>&1 || echo "coverage-report: no data for $name" >&2
}

echo "== kvgate corpus gate (strict)" >&2
run_covered gate "$py" -m kvgate gate --target vllm --level strict
echo "== kvgate differential exploration (ci profile)" >&2
run_covered explore "$py" -m kvgate explore --target vllm --hold off --profile ci \
  --out "$out/explore-traces"
# The kvgate column: both runs, combined into one data file.
rm -f "$out/.coverage.kvgate"
cp "$out/.coverage.gate" "$out/.coverage.kvgate.gate" 2>/dev/null || true
cp "$out/.coverage.explore" "$out/.coverage.kvgate.explore" 2>/dev/null || true
"$py" -m coverage combine --rcfile="$(rcfile kvgate)" --data-file="$out/.coverage.kvgate" \
  "$out"/.coverage.kvgate.* >/dev/null 2>&1 || echo "coverage-report: no data for kvgate" >&2

echo "== vLLM 0.33.0's own tests" >&2
own_tests=(tests/v1/core/prefix_cache tests/v1/core/test_prefix_caching.py)
if [ "${KVGATE_OWN_TESTS:-}" = skip ]; then
  :
elif [ -n "${KVGATE_OWN_COVERAGE:-}" ]; then
  # Their column does not change with kvgate: reuse a data file recorded by
  # an earlier run of this script (its OUT_DIR/.coverage.vllm-tests).
  cp "$KVGATE_OWN_COVERAGE" "$out/.coverage.vllm-tests"
elif [ -f scripts/vllm-own-tests.sh ] && [ "${KVGATE_OWN_TESTS:-}" != fallback ]; then
  run_covered vllm-tests bash scripts/vllm-own-tests.sh "${own_tests[@]}" -q
fi
if [ "${KVGATE_OWN_TESTS:-}" != skip ] && [ ! -s "$out/.coverage.vllm-tests" ]; then
  # No wrapper (or it recorded nothing): fetch the tests and run them here.
  tests="$(realpath "$(bash scripts/fetch-vllm-tests.sh)")"
  run_covered vllm-tests bash -c "cd '$tests' && '$py' -m pytest -q -p no:cacheprovider \
    ${own_tests[*]}"
fi

columns=("kvgate (gate + explore ci)=$out/.coverage.kvgate")
[ "${KVGATE_OWN_TESTS:-}" = skip ] || columns+=("vLLM's own manager tests=$out/.coverage.vllm-tests")
"$py" -m kvgate.explore.coverage --missing "$out" "${columns[@]}" | tee "$out/coverage.txt"
