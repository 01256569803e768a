"""The fault-injection campaign: the gate against one fault at a time.

The gate here is what `kvgate gate --target vllm` runs, plus what a gate run
can afford to check besides: the campaign's stages (`stages.py`, one class
each), met by each fault in order: the corpus replayed in lockstep with the
model (strict by default) with the snapshot invariants after every step of
the target, the scheduler-level corpus on vLLM's real `Scheduler`, and, for
a fault those miss, a short differential exploration (model against vLLM)
when `kvgate.explore` is installed, the Scheduler-level exploration, then a
short workload on vLLM's real `Scheduler` without prefix caching (Mamba
cache mode `none`) in lockstep with kvgate's scheduler model: the
Scheduler's own code (its split, its admission) is reached by nothing else.

Each run happens in a child process, so a fault never leaks into the parent
or into another fault's run: the baseline first (no fault), then one child
per fault, `jobs` at a time. Children are forked from a parent that has
already imported vLLM, which makes a child cost what its replays cost. A
fault counts as caught only by a trace whose replay passes on the unmutated
build, by an invariant that holds on that trace there, or by an exploration
that passes there: anything the baseline already fails says nothing about
the fault. A target the fault keeps from being built (vLLM's manager or
Scheduler, built unmutated) is no catch either: such a fault's verdict is
"not built".
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

from kvgate.conformance.replay import one_line
from kvgate.conformance.trace import load_corpus
from kvgate.errors import KvgateError
from kvgate.mutate.faults import Fault
from kvgate.mutate.inject import Edit, NotApplicable, apply
from kvgate.mutate.stages import STAGES, Catch, Child, Settings, Stage
from kvgate.output import VllmLogs, installed

# "not built": no stage caught the fault, and some stage's target (vLLM's
# manager or its Scheduler), built unmutated, could not be built with it in
# effect: the fault breaks construction, which says nothing of what the gate
# checks, so it is reported as such, never as a catch.
Verdict = Literal["caught", "missed", "not applicable", "hung", "error", "not built"]


@dataclass(frozen=True)
class GateRun:
    """What one child reports back."""

    fault: str | None  # None for the baseline
    edit: Edit | None
    not_applicable: str
    # Each stage's outcome by stage name, for the stages that ran, in order.
    outcomes: Mapping[str, object] = field(default_factory=dict)
    error: str = ""  # the child itself failed (not the gate)


@dataclass(frozen=True)
class Baseline:
    run: GateRun
    seconds: float


@dataclass(frozen=True)
class FaultResult:
    fault: Fault
    verdict: Verdict
    catch: Catch | None  # the first stage's catch
    seconds: float
    edit: Edit | None = None
    note: str = ""  # not applicable / hung / error: why
    invariants: tuple[str, ...] = ()  # every invariant some usable trace violated
    # Each stage's word on this fault by stage name, in the order the gate
    # runs them: True caught, False ran and missed, None did not run (empty
    # unless the verdict is caught or missed).
    said: Mapping[str, bool | None] = field(default_factory=dict)

    def stages_caught(self) -> dict[str, bool | None]:
        return dict(self.said)

    @property
    def first_stage(self) -> str:
        """The first stage that caught it ("" when none did)."""
        return next((stage for stage, said in self.said.items() if said), "")


@dataclass
class Campaign:
    baseline: Baseline
    results: list[FaultResult] = field(default_factory=list)
    seconds: float = 0.0
    stages: tuple[Stage[Any], ...] = STAGES

    @property
    def applicable(self) -> list[FaultResult]:
        return [r for r in self.results if r.verdict != "not applicable"]

    @property
    def caught(self) -> list[FaultResult]:
        return [r for r in self.results if r.verdict == "caught"]

    def kill_rate(self) -> tuple[int, int]:
        return len(self.caught), len(self.applicable)

    def stage_kill_rate(self, stage: str) -> tuple[int, int] | None:
        """Caught by `stage` alone, over the faults it ran on (None unless it
        ran on every applicable fault)."""
        said = [r.said.get(stage) for r in self.applicable]
        if not said or any(s is None for s in said):
            return None
        return sum(bool(s) for s in said), len(said)


class CampaignError(KvgateError):
    """The campaign cannot say anything (the baseline itself did not run)."""


# ----------------------------------------------------------------- child side


def gate_run(
    fault: Fault | None, settings: Settings, baseline: Baseline | None, progress: Connection | None
) -> GateRun:
    """Apply `fault` (if any) in this process and run the stages that want
    to run, in order: each sees what the ones before it said of the fault.

    Without a `baseline` (the baseline run) every stage switched on runs.
    """
    edit = None
    if fault is not None:
        try:
            edit = apply(fault).edit
        except NotApplicable as reason:
            return GateRun(fault.name, None, str(reason))

    def say(what: str) -> None:
        if progress is not None:
            progress.send(("trace", what))

    before = None if baseline is None else baseline.run.outcomes
    outcomes: dict[str, object] = {}
    earlier: dict[str, bool | None] = {}
    for stage in settings.stages:
        child = Child(settings, fault, before, dict(earlier), say)
        if not stage.wanted(child):
            continue
        outcomes[stage.name] = outcome = stage.run(child)
        if before is not None:
            earlier[stage.name] = stage.judge(outcome, stage.outcome(before)).said
    return GateRun(None if fault is None else fault.name, edit, "", outcomes)


def _child(
    fault: Fault | None, settings: Settings, baseline: Baseline | None, conn: Connection
) -> None:
    # vLLM's lines in this child are counted here and the counts sent back.
    logs = installed() or VllmLogs().install()
    logs.restart_count()
    try:
        with logs.unit("the baseline run" if fault is None else "fault runs"):
            run = gate_run(fault, settings, baseline, conn)
    except BaseException as error:  # reported to the parent, never lost
        name = None if fault is None else fault.name
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
        run = GateRun(name, None, "", error=f"{one_line(error)} (at {where})")
    conn.send(("vllm_logs", logs.counted))
    conn.send(("done", run))
    conn.close()


# ---------------------------------------------------------------- parent side


def _context() -> multiprocessing.context.BaseContext:
    """Fork where the platform has it (children inherit the imported vLLM)."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


@dataclass
class _Running:
    fault: Fault | None
    process: multiprocessing.process.BaseProcess
    conn: Connection
    started: float
    current: str = ""  # the trace it last said it was running


def _start(
    context: multiprocessing.context.BaseContext,
    fault: Fault | None,
    settings: Settings,
    baseline: Baseline | None,
) -> _Running:
    receive, send = context.Pipe(duplex=False)
    process = context.Process(  # type: ignore[attr-defined]
        target=_child, args=(fault, settings, baseline, send), daemon=True
    )
    process.start()
    send.close()  # the child's end: EOF here once the child is gone
    return _Running(fault, process, receive, time.perf_counter())


def _collect(running: list[_Running], timeout: float) -> list[tuple[_Running, GateRun | None, str]]:
    """Wait for any child to finish; (child, its run or None, why not)."""
    finished: list[tuple[_Running, GateRun | None, str]] = []
    while not finished:
        now = time.perf_counter()
        deadline = min(r.started + timeout for r in running)
        ready = multiprocessing.connection.wait(
            [r.conn for r in running], timeout=max(0.0, deadline - now)
        )
        for child in running:
            if child.conn in ready:
                try:
                    kind, payload = child.conn.recv()
                except EOFError:
                    child.process.join()
                    finished.append((child, None, f"child exited ({child.process.exitcode})"))
                    continue
                if kind == "trace":
                    child.current = payload
                elif kind == "vllm_logs":
                    parent_logs = installed()
                    if parent_logs is not None:
                        parent_logs.merge(payload)
                else:
                    child.process.join()
                    finished.append((child, payload, ""))
            elif time.perf_counter() - child.started >= timeout:
                child.process.kill()
                child.process.join()
                where = f" in {child.current}" if child.current else ""
                finished.append((child, None, f"hung{where}: no verdict within {timeout:g}s"))
    for child, _, _ in finished:
        running.remove(child)
        child.conn.close()
    return finished


def warm_up() -> None:
    """Import vLLM in the parent, so forked children start with it loaded."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvgate.impl import _vllm_api

    _vllm_api.load()


def run_baseline(settings: Settings) -> Baseline:
    context = _context()
    started = time.perf_counter()
    [(_, run, why)] = _collect([_start(context, None, settings, None)], settings.timeout)
    if run is None or run.error:
        raise CampaignError(f"the baseline (no fault) did not run: {why or run and run.error}")
    for stage in settings.stages:
        refusal = stage.refuse_baseline(stage.outcome(run.outcomes))
        if refusal:
            raise CampaignError(refusal)
    return Baseline(run, time.perf_counter() - started)


def run_campaign(
    faults: Sequence[Fault],
    settings: Settings,
    jobs: int,
    on_baseline: Callable[[Baseline], None] | None = None,
    on_result: Callable[[FaultResult], None] | None = None,
) -> Campaign:
    """The baseline, then every fault, `jobs` children at a time.

    `on_result` sees results in `faults` order, each as soon as it and every
    earlier one are known (a live table).
    """
    started = time.perf_counter()
    load_corpus(settings.corpus)  # a bad corpus fails here, before any child
    if _context().get_start_method() == "fork" and any(s.uses_vllm for s in settings.stages):
        warm_up()
    baseline = run_baseline(settings)
    if on_baseline is not None:
        on_baseline(baseline)
    campaign = Campaign(baseline, stages=settings.stages)
    context = _context()
    pending = list(faults)
    running: list[_Running] = []
    done: dict[str, FaultResult] = {}
    shown = 0
    while pending or running:
        while pending and len(running) < max(1, jobs):
            running.append(_start(context, pending.pop(0), settings, baseline))
        for child, run, why in _collect(running, settings.timeout):
            assert child.fault is not None
            seconds = time.perf_counter() - child.started
            done[child.fault.name] = judge(
                child.fault, run, why, baseline, seconds, settings.stages
            )
        while shown < len(faults) and faults[shown].name in done:
            result = done[faults[shown].name]
            campaign.results.append(result)
            if on_result is not None:
                on_result(result)
            shown += 1
    campaign.seconds = time.perf_counter() - started
    return campaign


def judge(
    fault: Fault,
    run: GateRun | None,
    why: str,
    baseline: Baseline,
    seconds: float,
    stages: Sequence[Stage[Any]] = STAGES,
) -> FaultResult:
    """The verdict on one fault, from what its child reported: the first
    stage's catch, in the order of `stages`."""
    if run is None:
        verdict: Verdict = "hung" if why.startswith("hung") else "error"
        return FaultResult(fault, verdict, None, seconds, note=why)
    if run.error:
        return FaultResult(fault, "error", None, seconds, run.edit, note=run.error)
    if run.not_applicable:
        return FaultResult(fault, "not applicable", None, seconds, note=run.not_applicable)
    judged = {
        stage.name: stage.judge(stage.outcome(run.outcomes), stage.outcome(baseline.run.outcomes))
        for stage in stages
    }
    catch = next((j.catch for j in judged.values() if j.catch is not None), None)
    # What the fault kept from being built, where the baseline built it.
    not_built = [line for j in judged.values() for line in j.not_built]
    if catch is None and not_built:
        return FaultResult(fault, "not built", None, seconds, run.edit, note=not_built[0])
    if catch is None and fault.equivalent_under:
        # Its only effect is state the strict view leaves out as unobservable.
        return FaultResult(
            fault,
            "not applicable",
            None,
            seconds,
            run.edit,
            note=f"equivalent under the strict view's exclusion {fault.equivalent_under}",
        )
    return FaultResult(
        fault,
        "caught" if catch is not None else "missed",
        catch,
        seconds,
        run.edit,
        invariants=tuple(dict.fromkeys(i for j in judged.values() for i in j.invariants)),
        said={name: j.said for name, j in judged.items()},
    )
