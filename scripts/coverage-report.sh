#!/usr/bin/env bash
# Coverage (line and branch) of the installed vLLM's block_pool.py,
# kv_cache_manager.py, kv_cache_coordinator.py, the MambaManager class and
# the Scheduler's KV paths (the methods of sched/scheduler.py's Scheduler
# that touch the KV-cache manager or a request's computed or cached tokens:
# kvgate/explore/coverage.py's `kv_paths` says which, and the table names
# them), reached by kvgate (the corpus gate at strict level plus the
# differential exploration and the Scheduler-level exploration, ci profile,
# combined), by the Scheduler-level
# gate alone (the scheduler-level corpus at strict level), by the
# Scheduler-level exploration (ci profile), next to vLLM's own manager tests
# and vLLM's own scheduler tests (the lists the fault campaign runs:
# MANAGER_TESTS and SCHEDULER_TESTS in kvgate/mutate/own_suite.py).
#
#   scripts/coverage-report.sh [OUT_DIR]     (default: out/coverage)
#
# KVGATE_VENV names the venv (default .venv; KVGATE_SKIP_SETUP=1 passes on to
# scripts/vllm-own-tests.sh for a venv set up already). KVGATE_OWN_COVERAGE
# names an earlier run's OUT_DIR/.coverage.vllm-tests to reuse instead of
# running vLLM's tests again (about an hour under coverage on 2 busy cores),
# and KVGATE_OWN_SCHEDULER_COVERAGE likewise its .coverage.vllm-scheduler-tests;
# KVGATE_OWN_TESTS=skip leaves both of vLLM's columns out (=fallback runs
# them with plain pytest, not scripts/vllm-own-tests.sh); KVGATE_OWN_COLUMNS
# names which of them to run ("manager scheduler" by default; "scheduler"
# leaves out the manager tests, the long one). vLLM's columns are run once
# per vLLM install and test list and then reused (KVGATE_OWN_COVERAGE_CACHE,
# below); the script says when it reuses one.
# Each column's unreached lines and branch exits go to
# OUT_DIR/missing-<column>.txt (per file and per KV path), and the table per
# KV path to OUT_DIR/kv-paths-by-method.txt, for finding what is still unreached.
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
    $core/sched/scheduler.py
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

echo "== kvgate Scheduler-level gate (strict)" >&2
scheduler_corpus="$("$py" -c 'from kvgate.conformance.trace import bundled_scheduler_corpus as c; print(c())')"
run_covered sched-gate "$py" -m kvgate gate --target vllm --level strict \
  --plugin kvgate.impl.hold_overlay --no-bundled --corpus "$scheduler_corpus"
echo "== kvgate Scheduler-level exploration (ci profile)" >&2
run_covered sched-explore "$py" -m kvgate explore --scope scheduler --target vllm --profile ci \
  --out "$out/sched-explore-traces"

# The kvgate column: everything kvgate runs (the gate, which replays both
# corpora, and both explorations), combined into one data file.
rm -f "$out/.coverage.kvgate" "$out"/.coverage.kvgate.*
for part in gate explore sched-explore; do
  cp "$out/.coverage.$part" "$out/.coverage.kvgate.$part" 2>/dev/null || true
done
"$py" -m coverage combine --rcfile="$(rcfile kvgate)" --data-file="$out/.coverage.kvgate" \
  "$out"/.coverage.kvgate.* >/dev/null 2>&1 || echo "coverage-report: no data for kvgate" >&2

# vLLM's columns depend only on the installed vLLM and the tests listed, not
# on kvgate: each is kept under KVGATE_OWN_COVERAGE_CACHE (default
# .cache/vllm-own-coverage) by vLLM version, install path and test list, and
# reused from there (removing the file runs them again).
vllm_version="$("$py" -c 'from importlib.metadata import version; print(version("vllm"))')"
own_cache="${KVGATE_OWN_COVERAGE_CACHE:-.cache/vllm-own-coverage}"
own_notes=()
own_column() {  # NAME REUSE_FILE TESTS...: a column of vLLM's own tests
  local name="$1" reuse="$2"; shift 2
  local kept
  kept="$own_cache/$vllm_version-$(printf '%s\n' "$core" "$@" | sha256sum | cut -c1-12)/.coverage.$name"
  if [ -n "$reuse" ]; then
    # A data file recorded by an earlier run of this script (OUT_DIR/.coverage.NAME).
    cp "$reuse" "$out/.coverage.$name"
  elif [ -s "$kept" ]; then
    own_notes+=("$name: vLLM's tests not run again; their coverage is reused from ${kept#"$PWD/"}, recorded $(date -u -r "$kept" '+%Y-%m-%d %H:%M UTC')")
    cp "$kept" "$out/.coverage.$name"
  elif [ -f scripts/vllm-own-tests.sh ] && [ "${KVGATE_OWN_TESTS:-}" != fallback ]; then
    run_covered "$name" bash scripts/vllm-own-tests.sh "$@" -q
  fi
  if [ ! -s "$out/.coverage.$name" ]; then
    # No wrapper (or it recorded nothing): fetch the tests and run them here.
    tests="$(realpath "$(bash scripts/fetch-vllm-tests.sh)")"
    run_covered "$name" bash -c "cd '$tests' && '$py' -m pytest -q -p no:cacheprovider $*"
  fi
  if [ -z "$reuse" ] && [ ! -s "$kept" ] && [ -s "$out/.coverage.$name" ]; then
    mkdir -p "$(dirname "$kept")" && cp "$out/.coverage.$name" "$kept"
  fi
}
# vLLM's own manager and scheduler tests: the campaign's one list
# (kvgate/mutate/own_suite.py), a column each.
mapfile -t manager_tests < <("$py" -m kvgate.mutate.own_suite manager)
mapfile -t scheduler_tests < <("$py" -m kvgate.mutate.own_suite scheduler)
[ "${#manager_tests[@]}" -gt 0 ] && [ "${#scheduler_tests[@]}" -gt 0 ] || {
  echo "coverage-report: kvgate.mutate.own_suite did not list vLLM's tests" >&2; exit 1; }
own_columns=" ${KVGATE_OWN_COLUMNS:-manager scheduler} "
[ "${KVGATE_OWN_TESTS:-}" != skip ] || own_columns=" "
columns=(
  "kvgate (gate + explorations ci)=$out/.coverage.kvgate"
  "Scheduler-level gate=$out/.coverage.sched-gate"
  "Scheduler-level explore ci=$out/.coverage.sched-explore"
)
if [[ "$own_columns" == *" manager "* ]]; then
  echo "== vLLM $vllm_version's own manager tests" >&2
  own_column vllm-tests "${KVGATE_OWN_COVERAGE:-}" "${manager_tests[@]}"
  columns+=("vLLM's own manager tests=$out/.coverage.vllm-tests")
fi
if [[ "$own_columns" == *" scheduler "* ]]; then
  echo "== vLLM $vllm_version's own scheduler tests" >&2
  own_column vllm-scheduler-tests "${KVGATE_OWN_SCHEDULER_COVERAGE:-}" "${scheduler_tests[@]}"
  columns+=("vLLM's own scheduler tests=$out/.coverage.vllm-scheduler-tests")
fi

{
  "$py" -m kvgate.explore.coverage --missing "$out" "${columns[@]}"
  [ "${#own_notes[@]}" -eq 0 ] || printf '%s\n' "${own_notes[@]}"
} | tee "$out/coverage.txt"
