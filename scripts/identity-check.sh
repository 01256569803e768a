#!/usr/bin/env bash
# "Identical before and after", as a command: record what kvgate prints for
# a fixed set of runs, or rerun them and diff against a recorded baseline.
#
#   scripts/identity-check.sh record DIR     # e.g. from main before a refactor
#   scripts/identity-check.sh check DIR      # after it: exit 0 iff identical
#
# Runs (about 4 min on the 2-core box; KVGATE_IDENTITY_QUICK=1 skips the
# mutation tables and the vLLM runs, about 1 min; KVGATE_IDENTITY_ONLY=REGEX
# runs and compares only the runs whose names match, e.g. `^prove-`):
#   prove.txt / prove-unbounded.txt       `kvgate prove` and `--unbounded`, the clean table
#   prove-<mutation>.txt, prove-unbounded-<mutation>.txt   a mutation's table
#                                         (KVGATE_IDENTITY_MUTATIONS, default
#                                         "hold_off no_admission_extra")
#   gate-model.txt, gate-vllm.txt, gate-vllm-overlay.txt   per-trace verdicts (and
#                                         failure details) of `kvgate gate`
#   workload-model.txt, workload-vllm.txt `kvgate workload --scale 16` counts
# Timings, the output directory and the checkout's path are stripped;
# runs of spaces are folded (a table's column widths follow path lengths).
# Z3's arbitrary picks are not compared: the size of an unbounded
# counterexample's finite model, the indices of the instance a bounded one
# names, unsat cores (see normalize). A cell's verdict, the invariant and op,
# and whether a trace was written are.
#
# Renames: a run's text is compared after mapping the baseline through
# RENAMES below (old -> new, whole words), so a documented rename of a name
# that reaches the output (a Z3 field in a transition's clause name) is not
# a difference. Everything else must match to the letter.
# Gate: a trace in the run but not in the baseline (a corpus addition
# landed meanwhile) is listed, not failed; a baseline trace missing fails.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# old=new, whole words: the Z3 vocabulary's renamed fields (the
# bounded encoding's clause `<op>: next <field>` names a field).
RENAMES=(hsrc=hit_source cowsrc=pending_tail ckpt=checkpoint rsv=reserved grp=block_group
  pend=copy_ends hashit=has_hit tailkey=tail_keyed retire_on=retain_retired)

mode=${1:-}
dir=${2:-}
if [[ ( $mode != record && $mode != check ) || -z $dir ]]; then
  echo "usage: scripts/identity-check.sh record|check DIR" >&2
  exit 2
fi
python=${KVGATE_PYTHON:-${KVGATE_VENV:-.venv}/bin/python}
[[ -x $python ]] || python=${KVGATE_VENV:-.venv}/bin/python
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} VLLM_TARGET_DEVICE=cpu
kvgate() { "$python" -m kvgate "$@"; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [[ $mode == record ]]; then
  mkdir -p "$dir"
  outdir=$dir
else
  outdir=$scratch/now
  mkdir -p "$outdir"
fi

# normalize KIND RAW > text: strip what varies from run to run.
normalize() {
  "$python" - "$1" "$root" "$scratch/out" "$2" <<'EOF'
import re, sys
kind, root, out, raw = sys.argv[1:5]
text = open(raw).read().replace(out, "OUT").replace(root, ".")
lines = []
for line in text.splitlines():
    if kind == "prove":
        # a search's progress lines come as often as the machine's load says,
        # and its announced budget is the run's setting
        if line.strip().startswith("still searching ("):
            continue
        line = re.sub(r", at most \d+s\)", ")", line)
        # table rows end in seconds; the summary names the wall time
        line = re.sub(r"\s+\d+\.\d\d$", "", line)
        line = re.sub(r" in \d+\.\ds \(", " (", line)
        # the size of the finite model Z3 picks for a counterexample to
        # induction varies from run to run (so do unsat cores: `--cores`
        # is not compared)
        line = re.sub(r"a model of \d+ blocks, \d+ requests, \d+ copies", "a model", line)
        # which instance a bounded counterexample names (`one_hold[r0,g1]`) is
        # Z3's pick among the violated ones, and moves with variable names
        # alone: compared without its indices
        line = re.sub(r"\[(?:[rgb]\d+,?)+\]", "[.]", line)
    elif kind == "gate":
        # a trace's wall time, whatever its verdict line says before it
        # (`(N steps, T s)`, `(hold: N steps, T s)`, `(refusal by F, T s)`)
        line = re.sub(r", \d+\.\d+s\)", ")", line)
        # the corpus sizes: traces added meanwhile are listed below, not failed
        line = re.sub(r"^corpora: .*", "corpora:", line)
    elif kind == "workload":
        if re.match(r"(generate|load|replay) unit ", line):
            line = re.sub(r" done in \d+\.\ds", " done", line)
        # the table's last column is the replay's wall time
        line = re.sub(r"\s+\d+\.\ds$", "", line) if re.match(r"\s+\d+\s+(on|off)\s", line) else line
        if line.startswith("wrote "):
            continue
    lines.append(re.sub(r" +", " ", line.rstrip()))
if kind == "prove":
    # rows are printed as their checks finish, several at a time: compared
    # as a set (the title and the column header stay first)
    lines = lines[:2] + sorted(lines[2:])
print("\n".join(lines))
EOF
}

# run NAME KIND CMD...: the command's stdout and exit code, normalized.
run() {
  local name=$1 kind=$2
  shift 2
  [[ $name =~ ${KVGATE_IDENTITY_ONLY:-.} ]] || return 0
  local started=$SECONDS rc=0
  rm -rf "$scratch/out"
  mkdir -p "$scratch/out"
  "$@" >"$scratch/raw" 2>"$scratch/err" || rc=$?
  { normalize "$kind" "$scratch/raw"; echo "exit $rc"; } >"$outdir/$name.txt"
  echo "  $name: exit $rc, $((SECONDS - started)) s" >&2
}

# The two upstream mutations take seconds each; some others' counterexample
# searches take minutes (every mutation's table is asserted by
# tests/test_z3_counterexamples.py and tests/test_z3_unbounded.py).
mutations=${KVGATE_IDENTITY_MUTATIONS:-hold_off no_admission_extra}

echo "identity-check $mode: running into $outdir" >&2
run prove prove kvgate prove --out "$scratch/out"
run prove-unbounded prove kvgate prove --unbounded --out "$scratch/out"
run gate-model gate kvgate gate --target model
run workload-model workload kvgate workload --target model --scale 16 --out "$scratch/out"
if [[ -z ${KVGATE_IDENTITY_QUICK:-} ]]; then
  for m in $mutations; do
    # A generous search budget: whether a counterexample search ends within
    # the default 60 s depends on the machine's load, not on kvgate.
    run "prove-$m" prove kvgate prove --mutation "$m" --search-timeout 900 --out "$scratch/out"
    run "prove-unbounded-$m" prove kvgate prove --unbounded --mutation "$m" \
      --search-timeout 900 --out "$scratch/out"
  done
  run gate-vllm gate kvgate gate --target vllm
  run gate-vllm-overlay gate kvgate gate --target vllm --plugin kvgate.impl.hold_overlay
  run workload-vllm workload kvgate workload --target vllm --plugin kvgate.impl.hold_overlay \
    --scale 16 --out "$scratch/out"
fi
[[ $mode == record ]] && { echo "recorded $(ls "$dir" | wc -l) files in $dir" >&2; exit 0; }

# check: compare each file of this run with the baseline's.
sedargs=()
for pair in "${RENAMES[@]}"; do
  sedargs+=(-e "s/\\b${pair%%=*}\\b/${pair#*=}/g")
done
status=0
for now in "$outdir"/*.txt; do
  name=$(basename "$now")
  base=$dir/$name
  if [[ ! -f $base ]]; then
    echo "SKIP $name: not in the baseline"
    continue
  fi
  expected=$scratch/expected
  if ((${#sedargs[@]})); then sed "${sedargs[@]}" "$base" >"$expected"; else cp "$base" "$expected"; fi
  if [[ $name == gate-* ]]; then
    # traces added since the baseline: listed, not compared
    added=$(comm -13 <(grep -oE '^(PASS|FAIL|ERROR) [^ ]+' "$expected" | cut -d' ' -f2 | sort) \
                     <(grep -oE '^(PASS|FAIL|ERROR) [^ ]+' "$now" | cut -d' ' -f2 | sort) || true)
    if [[ -n $added ]]; then
      echo "NOTE $name: traces not in the baseline (not compared): $(echo $added)"
      "$python" - "$now" $added <<'EOF'
import sys
path, added = sys.argv[1], set(sys.argv[2:])
# A trace's verdict line, and its failure block ("<name>: first divergence
# ..." up to the blank line after it).
keep, verdict, block = [], False, False
for line in open(path).read().splitlines():
    words = line.split(" ")
    if words[0] in ("PASS", "FAIL", "ERROR") and len(words) > 1:
        verdict, block = words[1] in added, False
    elif not line:
        if block:
            block = False
            continue
        verdict = False
    elif not line.startswith(" "):
        verdict = False
        block = any(line.startswith(name + ":") for name in added)
    if not (verdict or block):
        keep.append(line)
open(path, "w").write("\n".join(keep) + "\n")
EOF
      # the summary counts include them
      grep -v -E '^[0-9]+ passed, [0-9]+ failed' "$now" >"$scratch/n" && mv "$scratch/n" "$now"
      grep -v -E '^[0-9]+ passed, [0-9]+ failed' "$expected" >"$scratch/e" && mv "$scratch/e" "$expected"
    fi
  fi
  if diff -u "$expected" "$now" >"$scratch/diff"; then
    echo "SAME $name"
  else
    echo "DIFF $name"
    head -40 "$scratch/diff"
    status=1
  fi
done
for base in "$dir"/*.txt; do
  [[ -f $outdir/$(basename "$base") ]] || [[ -n ${KVGATE_IDENTITY_QUICK:-} ]] ||
    [[ -n ${KVGATE_IDENTITY_ONLY:-} ]] || {
    echo "MISSING $(basename "$base"): in the baseline, not run"
    status=1
  }
done
echo "identity-check: $([[ $status == 0 ]] && echo identical || echo DIFFERENT) (baseline $dir)"
exit $status
