"""The fault-injection campaign: exact one-line faults, verdicts, a fast subset on vLLM.

The full campaign (every fault against the whole corpus) is `kvgate mutate`;
here a handful of faults from different areas run against the few traces
that catch them, so the default test run stays short.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

from kvgate import cli
from kvgate.conformance.trace import bundled_corpus
from kvgate.mutate import own_suite
from kvgate.mutate.campaign import Baseline, GateRun, gate_run, judge, run_campaign
from kvgate.mutate.faults import (
    BY_NAME,
    FAULT_ENV,
    FAULTS,
    NOT_APPLICABLE_EXIT,
    REPORT_ENV,
    Fault,
    Port,
    select,
)
from kvgate.mutate.inject import NotApplicable, apply, at_site, find_edit, injected, locate
from kvgate.mutate.own_suite import SuiteRun, judge_suite
from kvgate.mutate.stages import (
    EXPLORATION,
    MANAGER_GATE,
    SCHEDULER_EXPLORATION,
    SCHEDULER_GATE,
    STAGES,
    WORKLOAD,
    Catch,
    Child,
    ExploreOutcome,
    Judgement,
    SchedulerOutcome,
    Settings,
    Stage,
    TraceOutcome,
    explore_stage,
    scheduler_stage,
)

# A fast subset: one fault per area, each with the trace that catches it.
FAST = {
    "free-order-not-reversed": "abort-mid-prefill",
    "cow-forgets-extra-ref": "attention-block-coarser-than-unit",
    "admission-off-by-one": "admission-exact-fit",
    "pop-keeps-partial-hit": "preempt-after-partial-tail",
    "mamba-pop-keeps-allocated": "preempt-after-partial-tail",
    "connector-async-load-cached-early": "gdn-triton-connector-async-load.hold-off",
    # A block completed by output hashed without the image inside it.
    "hasher-mm-window-swapped": "image-placeholder-boundaries",
    # vLLM accepting a config it should refuse: a refusal trace fails.
    "retention-interval-any-multiple": "refuse-retention-not-a-multiple",
    "retention-interval-negative": "refuse-retention-negative",
}


def fake(anchor: str, qualname: str = "BlockPool.free_blocks", **changes: Any) -> Fault:
    base = BY_NAME["free-unhashed-to-tail"]
    return replace(base, name="fake", anchor=anchor, qualname=qualname, **changes)


# ------------------------------------------------------------ the fault table


def test_faults_are_named_once_and_documented() -> None:
    assert len(FAULTS) >= 15
    assert len(BY_NAME) == len(FAULTS)
    for fault in FAULTS:
        assert fault.anchor != fault.replacement
        assert "\n" not in fault.anchor + fault.replacement
        assert all((fault.what, fault.why, fault.symptom, fault.area)), fault.name
    assert {f.area for f in FAULTS} >= {"block pool", "mamba align", "coordinator", "admission"}


def test_select_keeps_table_order_and_rejects_unknown_names() -> None:
    names = [f.name for f in select(["eagle-drop-skipped", "free-unhashed-to-tail"])]
    assert names == ["free-unhashed-to-tail", "eagle-drop-skipped"]
    with pytest.raises(KeyError, match="no-such-fault"):
        select(["no-such-fault"])


# ------------------------------------------------------------------- applying


@needs_vllm
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_changes_exactly_the_one_anchored_line(fault: Fault) -> None:
    try:
        fault = at_site(fault)  # a release may hold a port of it, or none
    except NotApplicable:
        pytest.skip(f"{fault.name}: not applicable to the installed vLLM")
    edit = find_edit(fault)
    source = Path(edit.filename).read_text(encoding="utf-8").splitlines()
    # The edit names the installed file's own line, and only that line changes.
    assert source[edit.lineno - 1].strip() == edit.before
    # An anchor may keep its indentation, to tell apart lines that differ only
    # by depth; the edit's lines are shown stripped.
    anchor, replacement = fault.anchor.strip(), fault.replacement.strip()
    assert anchor in edit.before
    assert edit.after == edit.before.replace(anchor, replacement)
    owner, attribute, original, function = locate(fault)
    with injected(fault) as applied:
        now = vars(owner)[attribute]
        assert now is not original
        edited = now.__func__ if isinstance(now, (classmethod, staticmethod)) else now
        # Compiled from the edited source, with the file's line numbers.
        assert edited.__code__.co_firstlineno == function.__code__.co_firstlineno
        assert edited.__qualname__ == function.__qualname__
        assert applied.edit == edit
        lines = textwrap.dedent(inspect.getsource(function)).splitlines()
        assert sum(fault.anchor in line for line in lines) == 1
    assert vars(owner)[attribute] is original


@needs_vllm
def test_an_anchor_not_in_the_installed_code_is_not_applicable() -> None:
    with pytest.raises(NotApplicable, match="not found"):
        apply(fake("blocks_to_evict_first.append(block)  # nowhere"))
    with pytest.raises(NotApplicable, match=r"found [2-9] times"):
        apply(fake("blocks_to_evict_"))  # ambiguous: the anchor must be unique
    with pytest.raises(NotApplicable, match="has no"):
        apply(fake("x", qualname="BlockPool.no_such_method"))
    with pytest.raises(NotApplicable, match="not importable"):
        apply(fake("x", module="vllm.no_such_module"))
    with pytest.raises(NotApplicable, match="exactly one line"):
        apply(fake("blocks_to_evict_first.append(block)", replacement="pass\n"))


@needs_vllm
def test_a_port_applies_where_the_own_anchor_moved() -> None:
    real = BY_NAME["free-unhashed-to-tail"]
    port = Port(real.module, real.qualname, real.anchor, real.replacement, "the real line")
    moved = fake("blocks_to_evict_first.append(block)  # moved away", ports=(port,))
    site = at_site(moved)
    assert (site.anchor, site.replacement) == (real.anchor, real.replacement)
    assert find_edit(moved) == find_edit(real)
    with injected(moved) as applied:
        assert applied.edit.before == real.anchor
    # Neither the anchor nor a port: not applicable, every site's reason named.
    gone = fake("nowhere one", ports=(replace(port, anchor="nowhere two"),))
    with pytest.raises(NotApplicable, match="'nowhere one' not found; port: .*'nowhere two'"):
        at_site(gone)


def test_a_miss_of_an_equivalent_fault_is_not_counted() -> None:
    fault = replace(fake("x"), equivalent_under="null-block-kept-aside")
    missed = _run(None, (_outcome("a"),), None)
    result = judge(fault, missed, "", _baseline(), 0.1)
    assert result.verdict == "not applicable" and "null-block-kept-aside" in result.note
    caught = _run(None, (_outcome("a", passed=False),), None)
    assert judge(fault, caught, "", _baseline(), 0.1).verdict == "caught"


@needs_vllm
def test_a_not_applicable_fault_is_never_counted() -> None:
    fault = fake("this text is not in vLLM")
    settings = Settings(corpus=bundled_corpus(), explore_examples=0)
    run = gate_run(fault, settings, None, None)
    assert run.not_applicable and run.outcomes == {} and run.edit is None
    result = judge(fault, run, "", _baseline(), 0.1)
    assert result.verdict == "not applicable" and result.catch is None


# ------------------------------------------------------------------- verdicts


def _outcome(trace: str, passed: bool = True, invariant: str = "") -> TraceOutcome:
    return TraceOutcome(
        trace, passed, "" if passed else "step 3 (free): api: x", invariant, "after step 3", 0.1
    )


# A child's report by what its stages reported: the keywords name the stages.
STAGE_OF = {
    "traces": MANAGER_GATE.name,
    "scheduler_traces": SCHEDULER_GATE.name,
    "exploration": EXPLORATION.name,
    "scheduler_exploration": SCHEDULER_EXPLORATION.name,
    "scheduler": WORKLOAD.name,
}
NAMES = [stage.name for stage in STAGES]


def _run(
    fault: str | None,
    traces: tuple[TraceOutcome, ...],
    exploration: ExploreOutcome | None,
    **others: object,
) -> GateRun:
    """A child's report: the manager-level traces, the exploration (None:
    it did not run), and any other stage's outcome by keyword."""
    return _with(GateRun(fault, None, ""), traces=traces, exploration=exploration, **others)


def _with(run: GateRun, **changes: object) -> GateRun:
    """`run` with some stages' outcomes changed (None: the stage did not run)."""
    outcomes = dict(run.outcomes)
    for key, outcome in changes.items():
        outcomes.pop(STAGE_OF[key], None)
        if outcome is not None:
            outcomes[STAGE_OF[key]] = outcome
    # In the order the stages run, as a child reports them.
    return replace(run, outcomes={n: outcomes[n] for n in NAMES if n in outcomes})


def _baseline(*outcomes: TraceOutcome, exploration: ExploreOutcome | None = None) -> Baseline:
    traces = outcomes or (_outcome("a"), _outcome("held", passed=False))
    return Baseline(_run(None, traces, exploration), 1.0)


def test_only_traces_that_pass_unmutated_can_catch() -> None:
    fault = FAULTS[0]
    baseline = _baseline(_outcome("a"), _outcome("held", passed=False))
    run = _run(fault.name, (_outcome("a"), _outcome("held", passed=False)), None)
    assert judge(fault, run, "", baseline, 1.0).verdict == "missed"
    run = _run(fault.name, (_outcome("a", passed=False),), None)
    result = judge(fault, run, "", baseline, 1.0)
    assert result.verdict == "caught" and result.catch is not None
    assert (result.catch.kind, result.catch.source) == ("trace", "a")


def test_an_invariant_only_catch_names_the_invariant() -> None:
    fault = FAULTS[0]
    baseline = _baseline(_outcome("a"), _outcome("b", invariant="free_queue_exact"))
    # On "b" the invariant already fails unmutated: it cannot catch.
    run = _run(fault.name, (_outcome("b", invariant="free_queue_exact"),), None)
    assert judge(fault, run, "", baseline, 1.0).verdict == "missed"
    run = _run(fault.name, (_outcome("a", invariant="no_leak"),), None)
    result = judge(fault, run, "", baseline, 1.0)
    assert result.catch is not None
    assert (result.catch.kind, result.catch.source) == ("invariant", "no_leak")
    assert result.invariants == ("no_leak",)


def test_exploration_counts_only_when_it_passes_unmutated() -> None:
    fault = FAULTS[0]
    found = ExploreOutcome(True, "divergence api hit", 20, 1.0)
    run = _run(fault.name, (_outcome("a"),), found)
    clean = ExploreOutcome(True, "", 20, 1.0)
    result = judge(fault, run, "", _baseline(_outcome("a"), exploration=clean), 1.0)
    assert result.catch is not None and result.catch.kind == "exploration"
    failing = _baseline(_outcome("a"), exploration=found)
    assert judge(fault, run, "", failing, 1.0).verdict == "missed"


def test_the_real_scheduler_stage_counts_only_when_it_passes_unmutated() -> None:
    fault = FAULTS[0]
    diverged = SchedulerOutcome(True, "engine step 10: scheduled (request, tokens)", 3.0)
    in_lockstep = SchedulerOutcome(True, "", 3.0)
    run = _with(_run(fault.name, (_outcome("a"),), None), scheduler=diverged)
    usable = Baseline(_with(_baseline(_outcome("a")).run, scheduler=in_lockstep), 1.0)
    result = judge(fault, run, "", usable, 1.0)
    assert result.catch is not None and result.catch.kind == "scheduler"
    assert result.catch.detail.startswith("engine step 10")
    assert result.said[MANAGER_GATE.name] is False
    failing = Baseline(_with(usable.run, scheduler=diverged), 1.0)
    assert judge(fault, run, "", failing, 1.0).verdict == "missed"


@needs_vllm
def test_a_mode_none_fault_in_the_scheduler_is_caught_by_its_stage_not_the_corpus() -> None:
    """The Scheduler splitting chunks for Mamba in mode none: no manager-level
    trace reaches the Scheduler's own code, the real-Scheduler stage does."""
    from kvgate.conformance.trace import load_trace
    from kvgate.mutate.stages import _replay_with_invariants

    clean = scheduler_stage()
    assert clean.passed, clean.failure
    trace = load_trace(bundled_corpus() / "mode-none-gdn-triton.yaml")
    with injected(BY_NAME["scheduler-splits-in-mode-none"]):
        assert _replay_with_invariants(trace, "strict").passed
        mutated = scheduler_stage()
    assert mutated.ran and "scheduled (request, tokens)" in mutated.failure, mutated
    assert scheduler_stage().passed  # reverted


def test_exploration_alone_is_counted_beside_the_corpus() -> None:
    """With the exploration run on every fault, each stage's own rate: a
    fault both catch counts for both; one only the corpus catches counts
    against exploration alone."""
    from kvgate.mutate.campaign import Campaign
    from kvgate.mutate.command import summary_lines

    clean = ExploreOutcome(True, "", 20, 1.0)
    found = ExploreOutcome(True, "divergence api hit", 20, 1.0)
    baseline = _baseline(_outcome("a"), exploration=clean)
    both = judge(FAULTS[0], _run("x", (_outcome("a", False),), found), "", baseline, 1.0)
    corpus_only = judge(FAULTS[1], _run("y", (_outcome("a", False),), clean), "", baseline, 1.0)
    explore_only = judge(FAULTS[2], _run("z", (_outcome("a"),), found), "", baseline, 1.0)
    said = [
        (r.said[EXPLORATION.name], r.said[MANAGER_GATE.name])
        for r in (both, corpus_only, explore_only)
    ]
    assert said == [(True, True), (False, True), (True, False)]
    campaign = Campaign(baseline, [both, corpus_only, explore_only])
    assert campaign.stage_kill_rate(MANAGER_GATE.name) == (2, 3)
    assert campaign.stage_kill_rate(EXPLORATION.name) == (2, 3)
    lines = summary_lines(campaign)
    assert any("exploration alone (no corpus) 2/3 (66.7%)" in line for line in lines)
    assert f"not caught by exploration alone: {FAULTS[1].name}" in lines
    # Not run on every fault: no rate claimed.
    skipped = judge(FAULTS[3], _run("w", (_outcome("a", False),), None), "",
                    baseline, 1.0)  # fmt: skip
    assert Campaign(baseline, [both, skipped]).stage_kill_rate(EXPLORATION.name) is None


def test_the_stage_table_counts_each_stage_and_names_the_first_catch() -> None:
    """Per stage: the faults it ran on, caught, and caught first; per fault,
    the first stage that caught it (none for a miss)."""
    from kvgate.mutate.campaign import Campaign
    from kvgate.mutate.command import stage_table

    clean = ExploreOutcome(True, "", 20, 1.0)
    found = ExploreOutcome(True, "divergence api hit", 20, 1.0)
    in_lockstep = SchedulerOutcome(True, "", 1.0)
    diverged = SchedulerOutcome(True, "engine step 3: scheduled differ", 1.0)
    baseline = Baseline(
        _with(_baseline(_outcome("a"), exploration=clean).run, scheduler=in_lockstep), 1.0
    )

    def run(name: str, passed: bool, explore: ExploreOutcome | None,
            workload: SchedulerOutcome | None) -> GateRun:  # fmt: skip
        return _run(name, (_outcome("a", passed),), explore, scheduler=workload)

    by_corpus = judge(FAULTS[0], run("w", False, None, None), "", baseline, 1.0)
    by_exploration = judge(FAULTS[1], run("x", True, found, None), "", baseline, 1.0)
    by_workload = judge(FAULTS[2], run("y", True, clean, diverged), "", baseline, 1.0)
    by_none = judge(FAULTS[3], run("z", True, clean, in_lockstep), "", baseline, 1.0)
    assert [r.first_stage for r in (by_corpus, by_exploration, by_workload, by_none)] == [
        NAMES[0],
        NAMES[2],
        NAMES[4],
        "",
    ]
    lines = stage_table(Campaign(baseline, [by_corpus, by_exploration, by_workload, by_none]))
    rows = {line.split("  ")[1].strip(): line.split()[-3:] for line in lines[2:7]}
    # The corpus ran on all four; no scheduler-level trace counts here; the
    # exploration ran on the three the corpus missed; the Scheduler-level
    # exploration did not run here; the workload ran on the two both missed.
    assert rows == {
        NAMES[0]: ["4", "1", "1"],
        NAMES[1]: ["0", "0", "0"],
        NAMES[2]: ["3", "1", "1"],
        NAMES[3]: ["0", "0", "0"],
        NAMES[4]: ["2", "1", "1"],
    }
    assert lines[7].split()[-1] == "1"  # caught by no stage
    assert f"  {FAULTS[3].name:<38} {FAULTS[3].area:<12} none" in lines
    assert f"  {FAULTS[2].name:<38} {FAULTS[2].area:<12} {NAMES[4]}" in lines
    # A scheduler-level trace that passes unmutated and diverges with the
    # fault catches it, after the manager-level corpus and before the rest.
    passes, diverges = _outcome("s"), _outcome("s", False)
    with_traces = Baseline(_with(baseline.run, scheduler_traces=(passes,)), 1.0)
    caught = judge(
        FAULTS[4], _with(run("v", True, None, None), scheduler_traces=(diverges,)), "",
        with_traces, 1.0,
    )  # fmt: skip
    assert caught.catch is not None and caught.catch.kind == "scheduler trace"
    assert caught.first_stage == NAMES[1]
    # The Scheduler-level exploration, clean unmutated, finding a divergence
    # with the fault: its own row says so, after the manager-level exploration;
    # not counted where it failed unmutated.
    with_found = _with(run("u", True, clean, None), scheduler_exploration=found)
    by_engine_steps, uncounted = (
        judge(FAULTS[5], with_found, "", Baseline(_with(base, scheduler_exploration=x), 1.0), 1.0)
        for base in (baseline.run,)
        for x in (clean, found)  # unmutated: clean, or failing already
    )  # fmt: skip
    assert by_engine_steps.catch is not None
    assert by_engine_steps.catch.kind == "scheduler exploration"
    assert by_engine_steps.first_stage == NAMES[3]
    assert by_engine_steps.said.get(NAMES[3]) is True
    # A fault an earlier stage caught first still shows the later catch.
    counting = Baseline(_with(baseline.run, scheduler_exploration=clean), 1.0)
    caught_early = _with(with_found, traces=(_outcome("a", False),))
    both = judge(FAULTS[6], caught_early, "", counting, 1.0)
    assert both.first_stage == NAMES[0]
    assert (
        f"  {FAULTS[6].name:<38} {FAULTS[6].area:<12} {NAMES[0]} (also: {NAMES[3]})"
        in stage_table(Campaign(baseline, [both]))
    )
    assert uncounted.said.get(NAMES[3]) is None and uncounted.verdict == "missed"


def toy_total(values: Sequence[int]) -> int:
    """What the toy stage below checks; the toy faults edit its one line."""
    total = 0
    for value in values:
        total += value
    return total


class ToySum(Stage[int]):
    """A stage added as one class and nothing else: it sums a list in the
    fault's child, and a sum other than the baseline's catches the fault."""

    name = "toy sum check"
    uses_vllm = False
    caught_only = "caught by the toy sum only"

    def wanted(self, child: Child) -> bool:
        return True

    def run(self, child: Child) -> int:
        child.progress("(toy sum)")
        return toy_total([1, 2, 3])

    def judge(self, outcome: int | None, baseline: int | None) -> Judgement:
        if outcome is None or baseline is None:
            return Judgement(None)
        if outcome == baseline:
            return Judgement(False)
        return Judgement(True, Catch("toy", "sum", f"{outcome} instead of {baseline}"))

    def headline(self, settings: Settings) -> str:
        return "a toy sum"

    def describe(self, baseline: int | None) -> list[str]:
        return [f"the toy sum is {baseline}"]


def test_a_stage_added_as_one_class_runs_and_shows_in_the_per_stage_table(
    tmp_path: Path,
) -> None:
    """A campaign of the toy stage alone (no vLLM): its faults applied in
    child processes, judged against the baseline, each reported in its row,
    the summary and the per-stage table; beside the five stages, its row
    comes last."""
    from kvgate.mutate.campaign import Campaign
    from kvgate.mutate.command import gate_campaign, stage_table

    def toy(name: str, replacement: str) -> Fault:
        return replace(
            fake("total += value", qualname="toy_total", module=__name__, ports=()),
            name=name,
            area="toy",
            replacement=replacement,
        )

    subtracts, same = (
        toy("toy-sum-subtracts", "total -= value"),
        toy("toy-sum-same", "total += +value"),
    )
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(bundled_corpus() / "abort-mid-prefill.yaml", corpus)
    settings = Settings(corpus=corpus, timeout=60.0, stages=(ToySum(),))
    out = io.StringIO()
    campaign = gate_campaign(out, [subtracts, same], settings, 1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "kvgate mutate: 2 faults, gate = a toy sum; 1 job(s)"
    assert lines[1].endswith("s): the toy sum is 6")
    rows = {line.split()[0]: line.split(maxsplit=4)[2:] for line in lines[3:6] if line}
    assert rows["toy-sum-subtracts"][0] == "caught"
    assert rows["toy-sum-subtracts"][2].endswith("toy sum: -6 instead of 6")
    assert rows["toy-sum-same"][0] == "missed"
    assert "caught by the toy sum only: toy-sum-subtracts" in lines
    [row] = [line.split() for line in lines if line.startswith("  toy sum check ")]
    assert row[-3:] == ["2", "1", "1"]  # ran on, caught, caught first
    assert f"  {'toy-sum-subtracts':<38} {'toy':<12} toy sum check" in lines
    assert f"  {'toy-sum-same':<38} {'toy':<12} none" in lines
    assert [r.said for r in campaign.results] == [{"toy sum check": True}, {"toy sum check": False}]
    # Beside the five stages: the table gains its row, after theirs.
    stages = (*STAGES, ToySum())
    baseline = Baseline(
        GateRun(None, None, "", {MANAGER_GATE.name: (_outcome("a"),), ToySum.name: 6}), 1.0
    )
    caught = judge(
        subtracts,
        GateRun("t", None, "", {MANAGER_GATE.name: (_outcome("a"),), ToySum.name: -6}),
        "",
        baseline,
        1.0,
        stages,
    )
    assert caught.verdict == "caught" and caught.first_stage == ToySum.name
    table = stage_table(Campaign(baseline, [caught], stages=stages))
    assert [line.split("  ")[1].strip() for line in table[2:8]] == [*NAMES, ToySum.name]
    assert table[7].split()[-3:] == ["1", "1", "1"]


def test_the_baseline_says_whether_the_scheduler_level_exploration_counts() -> None:
    from kvgate.mutate.command import describe_baseline

    def line(found: ExploreOutcome | None) -> str:
        run = _with(_baseline().run, scheduler_exploration=found)
        [said] = [x for x in describe_baseline(Baseline(run, 1.0)) if "Scheduler-level" in x]
        return said

    assert line(None) == "  Scheduler-level exploration: off"
    clean = ExploreOutcome(True, "", 40, 2.5)
    assert line(clean) == (
        "  Scheduler-level exploration: 40 examples in lockstep unmutated (2.5s)"
    )
    failing = ExploreOutcome(True, "divergence: step 3", 40, 2.5)
    assert "fails unmutated, left out (divergence: step 3)" in line(failing)


@needs_vllm
def test_the_scheduler_level_exploration_stage_catches_a_scheduler_fault() -> None:
    """The stage as a fault's child runs it: the fault in effect, vLLM's
    real Scheduler explored in lockstep; it finds the planted divergence."""
    from kvgate.mutate.stages import SCHEDULER_EXPLORE_EXAMPLES, scheduler_explore_stage

    with injected(BY_NAME["sched-split-aligns-last-chunk"]):
        outcome = scheduler_explore_stage(SCHEDULER_EXPLORE_EXAMPLES)
    assert outcome.ran and outcome.failure.startswith("divergence: ")
    assert "vLLM's Scheduler" in outcome.failure


@needs_vllm
def test_the_scheduler_level_corpus_catches_a_scheduler_fault_the_manager_corpus_cannot() -> None:
    """Preempting the oldest running request instead of the newest: a trace
    of preemption under pressure passes on stock vLLM and diverges with it."""
    from kvgate.mutate.stages import _replay_on_scheduler, _scheduler_corpus

    [trace] = [
        t
        for t in _scheduler_corpus(bundled_corpus())
        if t.name == "sched-preempt-under-pressure-and-resume"
    ]
    stock = _replay_on_scheduler(trace, "strict")
    assert stock.passed, stock.failure
    with injected(BY_NAME["sched-preempts-oldest"]):
        mutated = _replay_on_scheduler(trace, "strict")
    assert not mutated.passed and mutated.failure


def test_a_target_the_fault_keeps_from_being_built_is_not_a_catch() -> None:
    """A fault under which a stage's target is not built (built unmutated) is
    reported as "not built", never as caught; another stage's catch stands."""
    fault = FAULTS[0]
    in_lockstep = SchedulerOutcome(True, "", 1.0)
    unbuilt = SchedulerOutcome(True, "Scheduler not built: x", 1.0, built=False)
    passes = _outcome("s")
    refused = replace(_outcome("s", False), failure="config refused", built=False)
    baseline = Baseline(
        _with(_baseline(_outcome("a")).run, scheduler=in_lockstep, scheduler_traces=(passes,)),
        1.0,
    )
    runs = {
        "real-Scheduler stage": _run(fault.name, (_outcome("a"),), None,
                                        scheduler=unbuilt),
        "scheduler-level trace": _run(fault.name, (_outcome("a"),), None,
                                         scheduler_traces=(refused,)),
        "manager-level trace": _run(
            fault.name,
            (replace(_outcome("a", False), failure="target not built: y", built=False),), None,
        ),
    }  # fmt: skip
    for stage, run in runs.items():
        result = judge(fault, run, "", baseline, 1.0)
        assert (result.verdict, result.catch) == ("not built", None), stage
        assert "not built" in result.note or "config refused" in result.note, stage
    # Caught by a trace that was built, beside one that was not: caught.
    both = _with(runs["manager-level trace"], traces=(
        replace(_outcome("a", False), failure="target not built: y", built=False),
        _outcome("b", False),
    ))  # fmt: skip
    with_b = Baseline(_with(baseline.run, traces=(_outcome("a"), _outcome("b"))), 1.0)
    assert judge(fault, both, "", with_b, 1.0).verdict == "caught"


@needs_vllm
def test_a_fault_that_breaks_the_schedulers_construction_is_reported_not_built() -> None:
    """A fault raising in `Scheduler.__init__`: the real-Scheduler stage and a
    scheduler-level trace both say not built, and the verdict says so."""
    from kvgate.mutate.stages import _replay_on_scheduler, _scheduler_corpus

    broken = replace(
        BY_NAME["sched-preempts-oldest"],
        name="scheduler-construction-broken",
        qualname="Scheduler.__init__",
        anchor="self.max_num_running_reqs = self.scheduler_config.max_num_seqs",
        replacement='raise ValueError("construction broken on purpose")',
    )
    [trace] = [
        t for t in _scheduler_corpus(bundled_corpus()) if t.name == "sched-abort-mid-prefill"
    ]
    stock_trace, stock_stage = _replay_on_scheduler(trace, "strict"), scheduler_stage()
    assert stock_trace.passed and stock_stage.passed and stock_stage.built
    with injected(broken):
        mutated_trace, mutated_stage = _replay_on_scheduler(trace, "strict"), scheduler_stage()
    assert not mutated_trace.built and "broken on purpose" in mutated_trace.failure
    assert not mutated_stage.built and "broken on purpose" in mutated_stage.failure
    baseline = Baseline(
        _run(None, (_outcome("a"),), None, scheduler=stock_stage,
                scheduler_traces=(stock_trace,)),
        1.0,
    )  # fmt: skip
    run = _run(broken.name, (_outcome("a"),), None, scheduler=mutated_stage,
                  scheduler_traces=(mutated_trace,))  # fmt: skip
    result = judge(broken, run, "", baseline, 1.0)
    assert result.verdict == "not built" and result.catch is None
    assert "broken on purpose" in result.note


def test_a_hung_or_dead_child_is_not_a_catch() -> None:
    fault = FAULTS[0]
    assert judge(fault, None, "hung in x: no verdict", _baseline(), 5.0).verdict == "hung"
    assert judge(fault, None, "child exited (-9)", _baseline(), 5.0).verdict == "error"


def test_own_suite_verdicts() -> None:
    fault = FAULTS[0]
    failed = {"fault": fault.name, "failed": [{"test": "t.py::x", "when": "call", "message": "E"}]}
    assert judge_suite(fault, SuiteRun(1, failed, 1.0, "")).verdict == "caught"
    clean = {"fault": fault.name, "failed": []}
    assert judge_suite(fault, SuiteRun(0, clean, 1.0, "")).verdict == "missed"
    unapplied = {"fault": fault.name, "not_applicable": "anchor not found", "failed": []}
    assert judge_suite(fault, SuiteRun(NOT_APPLICABLE_EXIT, unapplied, 1.0, "")).verdict == (
        "not applicable"
    )
    # A session that never applied the fault proves nothing.
    assert judge_suite(fault, SuiteRun(0, {}, 1.0, "")).verdict == "error"
    assert judge_suite(fault, SuiteRun(-1, clean, 1.0, "")).verdict == "hung"


def test_one_list_of_vllms_own_tests_feeds_campaign_and_coverage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The coverage script reads the campaign's lists instead of naming files.
    script = (Path(__file__).parent.parent / "scripts" / "coverage-report.sh").read_text()
    assert "tests/v1/core/test_" not in script and "kvgate.mutate.own_suite scheduler" in script
    assert own_suite.main(["scheduler"]) == 0
    assert capsys.readouterr().out.split() == list(own_suite.SCHEDULER_TESTS)
    assert set(own_suite.SELECTION) == {*own_suite.MANAGER_TESTS, *own_suite.SCHEDULER_TESTS}
    assert own_suite.main(["everything"]) == 2
    assert "usage:" in capsys.readouterr().err


# ------------------------------------------------------- on the real vLLM


@needs_vllm
def test_a_target_that_raises_is_a_divergence_at_that_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = bundled_corpus() / "admission-exact-fit.yaml"
    assert cli.main(["replay", str(trace), "--target", "vllm"]) == 0
    capsys.readouterr()
    with injected(BY_NAME["admission-off-by-one"]):
        code = cli.main(["replay", str(trace), "--target", "vllm"])
    out, err = capsys.readouterr()
    assert code == 1 and err == ""
    assert "first divergence at step 5 (allocate), level api" in out
    assert "actual:   ValueError: Cannot get 4 free blocks from the pool" in out
    assert "note:     raised by the target" in out
    assert "Traceback" not in out
    assert out.rstrip().endswith("0 passed, 1 failed")


@needs_vllm
def test_fast_subset_is_caught_by_the_expected_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for trace in sorted(set(FAST.values())):
        shutil.copy(bundled_corpus() / f"{trace}.yaml", corpus)
    junit = tmp_path / "mutate.xml"
    # In this process: the campaign forks its children from it (vLLM loaded once).
    code = cli.main(
        ["mutate", "--faults", *FAST, "--corpus", str(corpus), "--explore", "0"]
        + ["--scheduler-explore", "0"]
        + ["--junit-xml", str(junit)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows: dict[str, str] = {}
    for line in out.splitlines():
        if line.split():
            # A fault's verdict row comes first; the per-stage table names it again.
            rows.setdefault(line.split()[0], line)
    for fault, trace in FAST.items():
        assert " caught " in rows[fault] and f"trace {trace}" in rows[fault], rows[fault]
    assert f"kill rate: {len(FAST)}/{len(FAST)} applicable faults caught (100.0%)" in out
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "kvgate-mutate.gate"
    assert (suite.get("tests"), suite.get("failures")) == (str(len(FAST)), "0")


@needs_vllm
def test_quiet_prints_only_the_faults_not_caught_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fault, trace = next(iter(FAST.items()))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(bundled_corpus() / f"{trace}.yaml", corpus)
    argv = ["mutate", "--faults", fault, "--corpus", str(corpus), "--explore", "0"]
    assert cli.main([*argv, "--scheduler-explore", "0", "-q"]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("kvgate mutate:")
    assert not any(line.startswith("baseline (no fault") for line in out.splitlines())
    assert not any(line.startswith(fault) for line in out.splitlines())
    assert "kill rate: 1/1 applicable faults caught (100.0%)" in out


@needs_vllm
def test_a_fault_that_hangs_the_gate_is_hung_not_caught(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(bundled_corpus() / "abort-mid-prefill.yaml", corpus)
    looping = replace(
        BY_NAME["free-unhashed-to-tail"],
        name="free-count-loops",
        qualname="BlockPool.get_num_free_blocks",
        anchor="return self.free_block_queue.num_free_blocks",
        replacement="while True: pass",
    )
    settings = Settings(
        corpus=corpus,
        explore_examples=0,
        timeout=5.0,
        scheduler_stage=False,
        scheduler_explore_examples=0,
    )
    campaign = run_campaign([looping], settings, jobs=1)
    [result] = campaign.results
    assert result.verdict == "hung" and result.catch is None
    assert "abort-mid-prefill" in result.note and campaign.kill_rate() == (0, 1)


POOL_ORDER_TEST = """\
from vllm.v1.core.block_pool import BlockPool


def test_freed_unhashed_blocks_are_reused_first():
    pool = BlockPool(8, True, 16)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool.get_new_blocks(1)[0] is blocks[0]
"""


@needs_vllm
def test_the_pytest_plugin_runs_a_session_with_the_fault_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.free_blocks
    test_file = tmp_path / "test_pool_order.py"
    test_file.write_text(POOL_ORDER_TEST, encoding="utf-8")
    report_path = tmp_path / "report.json"
    monkeypatch.setenv(REPORT_ENV, str(report_path))

    def session() -> tuple[int, dict[str, Any]]:
        # A session inside this process (vLLM is loaded once), as the
        # campaign's own sessions run it: plugin first, fault at configure.
        args = ["-q", "-p", "kvgate.mutate.pytest_plugin", "-p", "no:cacheprovider"]
        code = pytest.main([*args, "--capture=no", f"--rootdir={tmp_path}", str(test_file)])
        return int(code), json.loads(report_path.read_text(encoding="utf-8"))

    monkeypatch.delenv(FAULT_ENV, raising=False)
    code, report = session()
    assert code == 0 and report == {"fault": None, "failed": []}
    monkeypatch.setenv(FAULT_ENV, "free-unhashed-to-tail")
    code, report = session()
    assert code == 1
    assert report["edit"]["after"] == "blocks_to_evict_last.append(block)"
    failed = report["failed"]
    assert len(failed) == 1
    assert failed[0]["test"].endswith("test_freed_unhashed_blocks_are_reused_first")
    # The session reverted its fault when it ended.
    assert BlockPool.free_blocks is original


@needs_vllm
def test_the_exploration_stage_runs_every_family_against_vllm() -> None:
    # One example per deployment family, seeded: every family's config is
    # one vLLM builds, and the unmutated build passes.
    from kvgate.explore.differential import FAMILIES

    outcome = explore_stage(len(FAMILIES), seed=0)
    assert outcome.ran and outcome.failure == "", outcome.failure


def test_a_bad_exploration_seed_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mutate", "--explore-seed", "-1"]) == 2
    # The old spelling still works, with a notice naming the new one.
    err = capsys.readouterr().err
    assert err.startswith("kvgate: deprecated: --explore-seed is now spelled --seed")
    assert err.splitlines()[1].startswith("kvgate: error: --seed")
    assert cli.main(["mutate", "--seed", "-1"]) == 2
    assert capsys.readouterr().err.startswith("kvgate: error: --seed")


def test_areas_select_the_faults_of_those_areas(capsys: pytest.CaptureFixture[str]) -> None:
    """`--areas` runs the faults of the areas named, in table order; with
    `--faults` also the named ones."""
    from kvgate import cli
    from kvgate.mutate.faults import FAULTS

    def listed(*argv: str) -> list[str]:
        assert cli.main(["mutate", *argv, "--list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        return [line.split()[0] for line in lines if " [" in line and not line.startswith(" ")]

    drafts = [f.name for f in FAULTS if f.area in ("draft frees", "draft hits")]
    assert len(drafts) >= 2
    assert listed("--areas", "draft frees", "draft hits") == drafts
    extra = next(f.name for f in FAULTS if f.area == "block pool")
    assert listed("--areas", "draft hits", "--faults", extra) == [
        f.name for f in FAULTS if f.name == extra or f.area == "draft hits"
    ]
