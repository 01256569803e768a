"""`kvgate mutate`: how many real bugs the gate catches.

    kvgate mutate [--target vllm] [--faults NAME...] [--suite gate|vllm-own|both]
                  [--corpus DIR] [--level api|strict] [--explore N] [--explore-every-fault]
                  [--seed N] [--jobs N]
                  [--timeout SECONDS] [--tests-dir DIR] [--junit-xml PATH] [--list]

`--suite gate` (the default) injects each fault of `faults.FAULTS` into the
installed vLLM, one per child process, and runs the gate against it: the
corpus at strict level, the snapshot invariants after every step, and a
short differential exploration for a fault the corpus misses. It prints a
row per fault (caught or missed, by which trace or invariant, seconds) and
the kill rate. `--suite vllm-own` runs the same faults against vLLM 0.33.0's
own manager and scheduler tests instead; `both` runs the two and puts the rates side by
side.

Exit codes: 0 the gate caught every applicable fault (vLLM's own suite is
for comparison and never fails the command); 1 the gate missed one (or hung,
or a run failed); 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvgate import options
from kvgate.conformance.replay import LEVELS
from kvgate.conformance.trace import bundled_corpus
from kvgate.errors import InputError
from kvgate.mutate.campaign import Baseline, Campaign, FaultResult, run_campaign
from kvgate.mutate.faults import AREAS, BY_NAME, FAULTS, Fault, select
from kvgate.mutate.own_suite import (
    SELECTION_ROOT,
    Suite,
    SuiteResult,
    SuiteRun,
    run_suite_campaign,
)
from kvgate.mutate.stages import (
    DETAIL_WIDTH,
    EXPLORATION,
    EXPLORE_EXAMPLES,
    MANAGER_GATE,
    SCHEDULER_EXPLORE_EXAMPLES,
    STAGES,
    Settings,
    Stage,
)

SUITES = ("gate", "vllm-own", "both")
# Where `scripts/fetch-vllm-tests.sh` puts vLLM's own tests, from a checkout's root.
DEFAULT_TESTS_DIR = Path(".cache/vllm-0.33.0-tests")
# The flags' ranges: no more children than a box has use for, an exploration
# per fault that ends, a timeout of at most a day.
MAX_JOBS = 64
MAX_EXPLORE = 100_000
MAX_TIMEOUT = 86_400.0


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "mutate",
        help="inject realistic faults into vLLM's KV-cache manager and Scheduler; "
        "count what is caught",
    )
    cmd.add_argument("--target", default="vllm", choices=("vllm",))
    cmd.add_argument(
        "--faults",
        nargs="+",
        metavar="NAME",
        type=options.name_argument(list(BY_NAME), "--faults"),
        help="default: every fault (--list names them)",
    )
    cmd.add_argument(
        "--areas",
        nargs="+",
        metavar="AREA",
        choices=AREAS,
        help="the faults of these areas (with --faults: and the named ones)",
    )
    cmd.add_argument("--suite", default="gate", choices=SUITES)
    cmd.add_argument("--corpus", type=Path, metavar="DIR", help="default: the bundled corpus")
    options.add_level(cmd, LEVELS, "strict")
    cmd.add_argument(
        "--explore",
        type=int,
        default=EXPLORE_EXAMPLES,
        metavar="N",
        help="examples of differential exploration for a fault the corpus misses (0: off)",
    )
    cmd.add_argument(
        "--scheduler-explore",
        type=int,
        default=SCHEDULER_EXPLORE_EXAMPLES,
        metavar="N",
        help="examples of the Scheduler-level exploration (engine steps on vLLM's real "
        "Scheduler) for every fault in the Scheduler's code and any other the stages before "
        "it miss (0: off)",
    )
    cmd.add_argument(
        "--explore-every-fault",
        action="store_true",
        help="run the exploration against every fault too, and report its kill rate alone "
        "(no corpus) next to the corpus's",
    )
    options.add_seed(
        cmd,
        None,
        "random exploration examples from seed N (default: derandomized, the same "
        "examples every run)",
    )
    options.add_deprecated_flag(cmd, "--explore-seed", "--seed", dest="seed", type=int)
    cmd.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="faults run at once"
    )
    cmd.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="per fault before it counts as hung (default: 300 for the gate, "
        "3600 for vLLM's own tests)",
    )
    cmd.add_argument(
        "--tests-dir",
        type=Path,
        metavar="DIR",
        help=f"vLLM's own tests (holding tests/), default {DEFAULT_TESTS_DIR}",
    )
    cmd.add_argument(
        "--junit-xml", type=Path, metavar="PATH", help="also write a JUnit XML report there"
    )
    cmd.add_argument("--list", action="store_true", help="describe the faults and exit")
    cmd.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        faults = select(args.faults)
    except KeyError as error:
        raise InputError(f"--faults: {error.args[0]}") from None
    if args.areas:
        # With --faults too: the named faults and those of the areas.
        named = set(args.faults or ())
        faults = [f for f in FAULTS if f.name in named or f.area in args.areas]
    if args.list:
        write_fault_list(sys.stdout, faults)
        return 0
    if not 1 <= args.jobs <= MAX_JOBS:
        raise InputError(f"--jobs: must be between 1 and {MAX_JOBS}")
    if not 0 <= args.explore <= MAX_EXPLORE:
        raise InputError(f"--explore: must be between 0 and {MAX_EXPLORE:,}")
    if not 0 <= args.scheduler_explore <= MAX_EXPLORE:
        raise InputError(f"--scheduler-explore: must be between 0 and {MAX_EXPLORE:,}")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise InputError(f"--seed: {args.seed} is outside 0..2**32-1")
    if args.timeout is not None and not 0 < args.timeout <= MAX_TIMEOUT:
        # `not 0 < t` also refuses nan.
        raise InputError(f"--timeout: must be more than 0 and at most {MAX_TIMEOUT:g} seconds")
    if importlib.util.find_spec("vllm") is None:
        raise InputError("--target vllm: vLLM is not installed here")
    out = sys.stdout
    campaign = None
    suite_results: list[SuiteResult] | None = None
    if args.suite in ("gate", "both"):
        settings = Settings(
            corpus=args.corpus or bundled_corpus(),
            level=args.level,
            explore_examples=args.explore,
            explore_every_fault=args.explore_every_fault,
            scheduler_explore_examples=args.scheduler_explore,
            explore_seed=args.seed,
            timeout=args.timeout or 300.0,
        )
        campaign = gate_campaign(out, faults, settings, args.jobs, options.quiet(args))
    if args.suite in ("vllm-own", "both"):
        suite_results = own_campaign(out, faults, args)
    if campaign is not None and suite_results is not None:
        write_side_by_side(out, campaign, suite_results)
    if args.junit_xml is not None:
        try:
            write_junit(args.junit_xml, campaign, suite_results)
        except OSError as error:
            raise InputError(
                f"--junit-xml: cannot write {args.junit_xml}: {error.strerror}"
            ) from None
    if campaign is None:
        return 0
    return 0 if all(r.verdict in ("caught", "not applicable") for r in campaign.results) else 1


# ------------------------------------------------------------------ the gate


def gate_campaign(
    out: TextIO, faults: Sequence[Fault], settings: Settings, jobs: int, quiet: bool = False
) -> Campaign:
    """The campaign against the gate, a row per fault as it ends; `quiet`
    (`-q`): only the faults not caught (under the table's header) and the
    summary."""
    headed = [False]

    def header() -> None:
        if not headed[0]:
            headed[0] = True
            _line(out, row_header())

    def baseline_lines(baseline: Baseline) -> None:
        if quiet:
            return
        for line in describe_baseline(baseline, settings.stages):
            _line(out, line)
        _line(out, "")
        header()

    def result_line(result: Any) -> None:
        if quiet and result.verdict in ("caught", "not applicable"):
            return
        header()
        _line(out, result_row(result))

    if not quiet:
        gate = " + ".join(h for h in (s.headline(settings) for s in settings.stages) if h)
        _line(out, f"kvgate mutate: {len(faults)} faults, gate = {gate}; {jobs} job(s)")
    # A CampaignError (a KvgateError) reaches the command line as one line, exit 2.
    campaign = run_campaign(
        faults,
        settings,
        jobs,
        on_baseline=baseline_lines,
        on_result=result_line,
    )
    for line in summary_lines(campaign):
        _line(out, line)
    return campaign


def describe_baseline(baseline: Baseline, stages: Sequence[Stage[Any]] = STAGES) -> list[str]:
    """Each stage's lines about the baseline run, the first continuing the
    baseline's own line."""
    lines = [line for s in stages for line in s.describe(s.outcome(baseline.run.outcomes))]
    head = f"baseline (no fault, {baseline.seconds:.1f}s)"
    return [f"{head}: {lines[0]}", *lines[1:]] if lines else [head]


def row_header() -> str:
    return f"{'fault':<38} {'area':<12} {'verdict':<14} {'secs':>6}  caught by"


def result_row(result: FaultResult) -> str:
    if result.catch is not None:
        catch = result.catch
        more = f" (+{catch.more} more)" if catch.more else ""
        by = f"{catch.kind} {catch.source}{more}: {catch.detail}"
    else:
        by = result.note or "-"
    return (
        f"{result.fault.name:<38} {result.fault.area:<12} {result.verdict:<14} "
        f"{result.seconds:6.1f}  {_cut(by)}"
    )


def summary_lines(campaign: Campaign) -> list[str]:
    caught, applicable = campaign.kill_rate()
    rate = f"{100.0 * caught / applicable:.1f}%" if applicable else "-"
    not_applicable = [r.fault.name for r in campaign.results if r.verdict == "not applicable"]
    uncaught = [r for r in campaign.applicable if r.verdict != "caught"]
    only_invariant = [r for r in campaign.caught if r.catch and r.catch.kind == "invariant"]
    fired: Counter[str] = Counter(i for r in campaign.caught for i in r.invariants)
    lines = [
        "",
        f"kill rate: {caught}/{applicable} applicable faults caught ({rate})"
        + (f"; not applicable here: {', '.join(not_applicable)}" if not_applicable else ""),
        "not caught: "
        + (", ".join(f"{r.fault.name} ({r.verdict})" for r in uncaught) if uncaught else "none"),
        "caught by an invariant only: "
        + (
            ", ".join(f"{r.fault.name} ({r.catch.source})" for r in only_invariant if r.catch)
            if only_invariant
            else "none"
        ),
        "invariants that also fired: "
        + (", ".join(f"{name} ({n} faults)" for name, n in fired.most_common()) or "none"),
    ]
    for stage in campaign.stages:
        alone = [r.fault.name for r in campaign.caught if r.first_stage == stage.name]
        if stage.caught_only and alone:
            lines.append(f"{stage.caught_only}: {', '.join(alone)}")
    # With --explore-every-fault: the exploration's rate alone beside the corpus's.
    explored = campaign.stage_kill_rate(EXPLORATION.name)
    corpus = campaign.stage_kill_rate(MANAGER_GATE.name)
    if explored is not None and corpus is not None:
        lines.append(
            f"by stage alone: corpus (traces + invariants) {corpus[0]}/{corpus[1]} "
            f"({_pct(*corpus)}); exploration alone (no corpus) "
            f"{explored[0]}/{explored[1]} ({_pct(*explored)})"
        )
        missed = [
            r.fault.name for r in campaign.applicable if r.said.get(EXPLORATION.name) is False
        ]
        lines.append("not caught by exploration alone: " + (", ".join(missed) or "none"))
    lines.extend(stage_table(campaign))
    per_fault = [r.seconds for r in campaign.results]
    mean = sum(per_fault) / len(per_fault) if per_fault else 0.0
    lines.append(
        f"time: {campaign.seconds:.1f}s in all, baseline {campaign.baseline.seconds:.1f}s, "
        f"{mean:.1f}s per fault on average"
    )
    return lines


def stage_table(campaign: Campaign) -> list[str]:
    """How many faults each stage ran on and caught, how many it was the
    first to catch, and each fault's area and first catching stage. A later stage
    runs only on what the earlier ones missed (unless --explore-every-fault),
    so 'caught' counts what it saw."""
    judged = [r for r in campaign.results if r.verdict in ("caught", "missed")]
    names = [s.name for s in campaign.stages]
    width = max(len(s) for s in names) + 2
    lines = ["", f"{'per stage':<{width}} {'ran on':>7} {'caught':>7} {'first':>7}"]
    for stage in names:
        said = [r.said.get(stage) for r in judged]
        ran = sum(s is not None for s in said)
        caught = sum(bool(s) for s in said)
        first = sum(r.first_stage == stage for r in judged)
        lines.append(f"  {stage:<{width - 2}} {ran:>7} {caught:>7} {first:>7}")
    missed = sum(not r.first_stage for r in judged)
    lines.append(f"  {'caught by no stage':<{width - 2}} {'':>7} {'':>7} {missed:>7}")
    lines.append(
        "first stage to catch each fault, by the fault's area "
        "(and the later stages that caught it too):"
    )
    for result in judged:
        also = [
            stage for stage, said in result.said.items() if said and stage != result.first_stage
        ]
        more = f" (also: {', '.join(also)})" if also else ""
        lines.append(
            f"  {result.fault.name:<38} {result.fault.area:<12} "
            f"{result.first_stage or 'none'}{more}"
        )
    return lines


# ------------------------------------------------------- vLLM's own tests


def own_campaign(
    out: TextIO, faults: Sequence[Fault], args: argparse.Namespace
) -> list[SuiteResult]:
    root = _checkout_root()
    tests_dir = args.tests_dir or (root / DEFAULT_TESTS_DIR if root else DEFAULT_TESTS_DIR)
    if not (tests_dir / "tests" / "v1" / "core").is_dir():
        raise InputError(
            f"--tests-dir: no vLLM tests in {tests_dir} (run scripts/fetch-vllm-tests.sh)"
        )
    suite = Suite.locate(tests_dir, root, args.timeout or 3600.0)
    _line(out, "")
    _line(out, f"vLLM's own tests: {' '.join(suite.runner[:4])} ... in {tests_dir}")

    def baseline_lines(run: SuiteRun) -> None:
        bad = [f["test"] for f in run.failed]
        _line(
            out,
            f"baseline (no fault, {run.seconds:.0f}s): exit {run.exit_code}"
            + (f", {len(bad)} tests fail unmutated and are deselected" if bad else ""),
        )
        for test in bad:
            _line(out, f"  deselected: {test}")
        _line(out, "")
        header = f"{'fault':<38} {'verdict':<14} {'secs':>6}"
        _line(out, f"{header}  first failing test (under {SELECTION_ROOT})")

    _, results = run_suite_campaign(
        faults,
        suite,
        args.jobs,
        on_baseline=baseline_lines,
        on_result=lambda r: _line(
            out,
            f"{r.fault.name:<38} {r.verdict:<14} {r.seconds:6.0f}  "
            + _cut(r.by.removeprefix(SELECTION_ROOT) or "-"),
        ),
    )
    applicable = [r for r in results if r.verdict != "not applicable"]
    caught = [r for r in applicable if r.verdict == "caught"]
    rate = f"{100.0 * len(caught) / len(applicable):.1f}%" if applicable else "-"
    _line(out, "")
    _line(out, f"vLLM's own tests kill rate: {len(caught)}/{len(applicable)} ({rate})")
    missed = [r.fault.name for r in applicable if r.verdict != "caught"]
    _line(out, "not caught: " + (", ".join(missed) if missed else "none"))
    return results


def write_side_by_side(out: TextIO, campaign: Campaign, suite: Sequence[SuiteResult]) -> None:
    own = {r.fault.name: r for r in suite}
    _line(out, "")
    _line(out, f"{'fault':<38} {'kvgate gate':<14} vLLM's own tests")
    for result in campaign.results:
        other = own.get(result.fault.name)
        _line(
            out, f"{result.fault.name:<38} {result.verdict:<14} {other.verdict if other else '-'}"
        )
    gate_caught, gate_applicable = campaign.kill_rate()
    own_applicable = [r for r in suite if r.verdict != "not applicable"]
    own_caught = sum(r.verdict == "caught" for r in own_applicable)
    _line(
        out,
        f"{'kill rate':<38} {f'{gate_caught}/{gate_applicable}':<14} "
        f"{own_caught}/{len(own_applicable)}",
    )


# ---------------------------------------------------------------- helpers


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def write_fault_list(out: TextIO, faults: Sequence[Fault]) -> None:
    for fault in faults:
        _line(out, f"{fault.name} [{fault.area}] {fault.module}:{fault.qualname}")
        _line(out, f"  edit:    {fault.anchor}  ->  {fault.replacement}")
        for port in fault.ports:
            _line(out, f"  port:    {port.module}:{port.qualname} ({port.where})")
            _line(out, f"           {port.anchor}  ->  {port.replacement}")
        if fault.equivalent_under:
            _line(out, f"  equivalent under the strict view's {fault.equivalent_under}")
        _line(out, f"  what:    {fault.what}")
        _line(out, f"  why:     {fault.why}")
        _line(out, f"  symptom: {fault.symptom}")
    _line(out, f"{len(faults)} faults")


def write_junit(path: Path, campaign: Campaign | None, suite: Sequence[SuiteResult] | None) -> None:
    """One testcase per fault and suite: a miss fails, not applicable skips."""
    root = ET.Element("testsuites")
    if campaign is not None:
        cases = [
            (
                r.fault.name,
                r.verdict,
                r.seconds,
                f"{r.catch.kind} {r.catch.source}: {r.catch.detail}" if r.catch else r.note,
            )
            for r in campaign.results
        ]
        _junit_suite(root, "kvgate-mutate.gate", cases)
    if suite is not None:
        _junit_suite(
            root,
            "kvgate-mutate.vllm-own-tests",
            [
                (r.fault.name, r.verdict, r.seconds, f"{r.by}: {r.message}" if r.message else r.by)
                for r in suite
            ],
        )
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _junit_suite(root: ET.Element, name: str, cases: Sequence[tuple[str, str, float, str]]) -> None:
    failures = sum(v in ("missed", "hung") for _, v, _, _ in cases)
    errors = sum(v == "error" for _, v, _, _ in cases)
    skipped = sum(v == "not applicable" for _, v, _, _ in cases)
    element = ET.SubElement(
        root,
        "testsuite",
        name=name,
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        skipped=str(skipped),
        time=f"{sum(s for _, _, s, _ in cases):.3f}",
    )
    for fault, verdict, seconds, detail in cases:
        case = ET.SubElement(element, "testcase", classname=name, name=fault, time=f"{seconds:.3f}")
        if verdict == "caught":
            ET.SubElement(case, "system-out").text = f"caught by {detail}"
        elif verdict == "not applicable":
            ET.SubElement(case, "skipped", message=f"not applicable: {detail}")
        elif verdict == "error":
            ET.SubElement(case, "error", message=detail or "the run failed")
        else:
            ET.SubElement(case, "failure", message=f"{verdict}: {detail}" if detail else verdict)


def _checkout_root() -> Path | None:
    """The source checkout kvgate runs from, if it runs from one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir() else None


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_WIDTH else text[: DETAIL_WIDTH - 3] + "..."


def _line(out: TextIO, text: str) -> None:
    print(text, file=out, flush=True)
