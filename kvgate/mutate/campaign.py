"""The fault-injection campaign: the gate against one fault at a time.

The gate here is what `kvgate gate --target vllm` runs, plus what a gate run
can afford to check besides: the corpus replayed in lockstep with the model
(strict by default), the snapshot invariants after every step of the target
(`kvgate.invariants.predicates.check_snapshot`), and, for a fault the corpus
misses, a short differential exploration (model against vLLM) when
`kvgate.explore` is installed, then, for one both miss, a short workload on
vLLM's real `Scheduler` without prefix caching (Mamba cache mode `none`) in
lockstep with kvgate's scheduler model: the Scheduler's own code (its
split, its admission) is reached by nothing else.

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
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Literal, cast

from kvgate.conformance.refusal import judge_refusal
from kvgate.conformance.replay import Level, ReplayResult, one_line, replay
from kvgate.conformance.report import divergence_summary
from kvgate.conformance.trace import Trace, load_corpus
from kvgate.errors import KvgateError
from kvgate.invariants.predicates import check_snapshot
from kvgate.mutate.faults import Fault
from kvgate.mutate.inject import Edit, NotApplicable, apply
from kvgate.output import VllmLogs, installed
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Target, WatchedTarget

# "not built": no stage caught the fault, and some stage's target (vLLM's
# manager or its Scheduler), built unmutated, could not be built with it in
# effect: the fault breaks construction, which says nothing of what the gate
# checks, so it is reported as such, never as a catch.
Verdict = Literal["caught", "missed", "not applicable", "hung", "error", "not built"]

# The campaign's stages, in the order each fault meets them: the corpus
# replayed with the snapshot invariants and the scheduler-level corpus on
# vLLM's real Scheduler (both what `kvgate gate` runs), the differential
# exploration, the Scheduler-level exploration (engine steps on vLLM's real
# Scheduler), the workload on vLLM's real Scheduler.
STAGES = (
    "manager-level gate",
    "Scheduler-level gate",
    "exploration",
    "Scheduler-level exploration",
    "real-Scheduler workload",
)

# The exploration's budget per fault (`--explore`): examples, split evenly
# between the deployment families of `explore.differential.FAMILIES` (50
# each), each of `EXPLORE_STEPS` rules: about 20 s of CPU per fault on this
# machine when nothing is found (it runs only where the corpus misses, or
# with `--explore-every-fault`). 50 per family gives every family at least
# as many examples in its configuration as the four families of 75 gave it
# when swarm drawing chose it (a quarter of eagle's examples for lookahead
# hashes, and pure Mamba or caching off took 4 in 10 of the rest). The
# rarest catch measured, `unitary-lookup-ignores-cap`, shows only where a
# block-aligned prompt's end state is retained: about one example in 22 of
# the dense pure-Mamba family, one in 77 of the other
# (benchmarks/explore_fault_reach.py), so the two miss it together about
# one run in 20; one family of 50 missed it one run in two.
EXPLORE_EXAMPLES = 450
# Rules per example: long enough for a state one rule leaves (a block with
# two keys, a stale record) to meet what another rule does later (a burst,
# a re-admission).
EXPLORE_STEPS = 50
# The Scheduler-level exploration's budget per fault: its ci profile's
# examples (derandomized, not shrunk), a few seconds in a child. It runs on
# every fault in the Scheduler's own code (area `scheduler`), so each of
# their rows says whether it caught them, and on any other fault the stages
# before it missed.
SCHEDULER_EXPLORE_EXAMPLES = 40


@dataclass(frozen=True)
class Settings:
    """What the gate runs against each fault."""

    corpus: Path
    level: Level = "strict"
    # Examples of the differential exploration for a fault the corpus
    # misses; 0 switches the stage off.
    explore_examples: int = EXPLORE_EXAMPLES
    # Run the exploration against every fault, not only those the corpus
    # misses, so its kill rate alone (no corpus) stands next to the corpus's.
    explore_every_fault: bool = False
    # None: the exploration is derandomized (the same examples every run);
    # a seed: random examples from it (family k seeded `seed + k`), the same
    # for the baseline and every fault, another set for another seed.
    explore_seed: int | None = None
    timeout: float = 300.0  # seconds one child may take before it counts as hung
    # The real-Scheduler stage for a fault the corpus and the exploration miss.
    scheduler_stage: bool = True
    # Examples of the Scheduler-level exploration; 0 switches the stage off.
    scheduler_explore_examples: int = SCHEDULER_EXPLORE_EXAMPLES


@dataclass(frozen=True)
class TraceOutcome:
    trace: str
    passed: bool
    failure: str  # the first divergence in one line ("" when passed)
    invariant: str  # the first invariant violated after some step ("" if none)
    violation: str  # where and how it was violated, one line
    seconds: float
    # False: the target was not built for this trace (`failure` says why),
    # so the trace neither passed nor diverged.
    built: bool = True


@dataclass(frozen=True)
class ExploreOutcome:
    ran: bool
    failure: str  # one line ("" when nothing was found)
    examples: int
    seconds: float
    note: str = ""  # why it did not run

    @property
    def passed(self) -> bool:
        return self.ran and not self.failure


@dataclass(frozen=True)
class SchedulerOutcome:
    ran: bool
    failure: str  # one line ("" when in lockstep)
    seconds: float
    note: str = ""  # why it did not run
    # False: vLLM's Scheduler was not built (`failure` says why): no lockstep ran.
    built: bool = True

    @property
    def passed(self) -> bool:
        return self.ran and not self.failure


@dataclass(frozen=True)
class GateRun:
    """What one child reports back."""

    fault: str | None  # None for the baseline
    edit: Edit | None
    not_applicable: str
    traces: tuple[TraceOutcome, ...]
    exploration: ExploreOutcome | None
    error: str = ""  # the child itself failed (not the gate)
    scheduler: SchedulerOutcome | None = None
    # The scheduler-level corpus, on vLLM's real Scheduler in lockstep.
    scheduler_traces: tuple[TraceOutcome, ...] = ()
    # The Scheduler-level exploration (None: it did not run).
    scheduler_exploration: ExploreOutcome | None = None


@dataclass(frozen=True)
class Baseline:
    run: GateRun
    seconds: float

    @property
    def passing(self) -> frozenset[str]:
        """Traces that pass on the unmutated build: the only ones that count."""
        return frozenset(t.trace for t in self.run.traces if t.passed)

    @property
    def scheduler_passing(self) -> frozenset[str]:
        """Scheduler-level traces that pass on the unmutated build."""
        return frozenset(t.trace for t in self.run.scheduler_traces if t.passed)

    @property
    def invariant_clean(self) -> frozenset[str]:
        """Passing traces on which every invariant held after every step."""
        return frozenset(t.trace for t in self.run.traces if t.passed and not t.invariant)

    @property
    def exploration_usable(self) -> bool:
        return self.run.exploration is not None and self.run.exploration.passed

    @property
    def scheduler_usable(self) -> bool:
        return self.run.scheduler is not None and self.run.scheduler.passed

    @property
    def scheduler_exploration_usable(self) -> bool:
        found = self.run.scheduler_exploration
        return found is not None and found.passed


@dataclass(frozen=True)
class Catch:
    stage: Literal[
        "trace", "invariant", "scheduler trace", "exploration", "scheduler exploration", "scheduler"
    ]
    source: str  # the trace, invariant or "exploration"
    detail: str


@dataclass(frozen=True)
class FaultResult:
    fault: Fault
    verdict: Verdict
    catch: Catch | None
    seconds: float
    edit: Edit | None = None
    note: str = ""  # not applicable / hung / error: why
    catching_traces: int = 0
    invariants: tuple[str, ...] = ()  # every invariant some usable trace violated
    # What the exploration alone said (None: it did not run on this fault).
    explored: bool | None = None
    corpus_caught: bool = False  # a trace or an invariant on one caught it
    # What the real-Scheduler workload said (None: it did not run on this fault).
    workload: bool | None = None
    # What the scheduler-level corpus said (None: none of it counts here).
    scheduler_gate: bool | None = None
    # What the Scheduler-level exploration said (None: it did not run on this fault).
    scheduler_explored: bool | None = None

    def stages_caught(self) -> dict[str, bool | None]:
        """Each stage's word on this fault, in the order the gate runs them:
        True caught, False ran and missed, None did not run."""
        ran = self.verdict in ("caught", "missed")
        return {
            STAGES[0]: self.corpus_caught if ran else None,
            STAGES[1]: self.scheduler_gate,
            STAGES[2]: self.explored,
            STAGES[3]: self.scheduler_explored,
            STAGES[4]: self.workload,
        }

    @property
    def first_stage(self) -> str:
        """The first stage that caught it ("" when none did)."""
        return next((stage for stage, said in self.stages_caught().items() if said), "")


@dataclass
class Campaign:
    baseline: Baseline
    results: list[FaultResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def applicable(self) -> list[FaultResult]:
        return [r for r in self.results if r.verdict != "not applicable"]

    @property
    def caught(self) -> list[FaultResult]:
        return [r for r in self.results if r.verdict == "caught"]

    def kill_rate(self) -> tuple[int, int]:
        return len(self.caught), len(self.applicable)

    def corpus_kill_rate(self) -> tuple[int, int]:
        """Caught by the corpus (a trace, or an invariant on one) alone."""
        return sum(r.corpus_caught for r in self.applicable), len(self.applicable)

    def exploration_kill_rate(self) -> tuple[int, int] | None:
        """Caught by the exploration alone, over the faults it ran on (None
        unless it ran on every applicable fault)."""
        ran = [r for r in self.applicable if r.explored is not None]
        if not ran or len(ran) != len(self.applicable):
            return None
        return sum(bool(r.explored) for r in ran), len(ran)


class CampaignError(KvgateError):
    """The campaign cannot say anything (the baseline itself did not run)."""


# ----------------------------------------------------------------- child side


def gate_run(
    fault: Fault | None, settings: Settings, baseline: Baseline | None, progress: Connection | None
) -> GateRun:
    """Apply `fault` (if any) in this process and run the gate's stages.

    With a `baseline`, only traces that pass on the unmutated build are
    replayed, and exploration runs only if none of them caught the fault.
    """
    edit = None
    if fault is not None:
        try:
            edit = apply(fault).edit
        except NotApplicable as reason:
            return GateRun(fault.name, None, str(reason), (), None)
    traces = load_corpus(settings.corpus)
    if baseline is not None:
        traces = [t for t in traces if t.name in baseline.passing]
    outcomes = []
    for trace in traces:
        if progress is not None:
            progress.send(("trace", trace.name))
        outcomes.append(_replay_with_invariants(trace, settings.level))
    scheduler_traces = []
    for trace in _scheduler_corpus(settings.corpus):
        if baseline is not None and trace.name not in baseline.scheduler_passing:
            continue
        if progress is not None:
            progress.send(("trace", trace.name))
        scheduler_traces.append(_replay_on_scheduler(trace, settings.level))
    exploration = None
    caught = baseline is not None and (
        any(_counts(o, baseline) for o in outcomes)
        or any(o.built and not o.passed for o in scheduler_traces)
    )
    explore_wanted = settings.explore_examples > 0 and (
        baseline is None
        or (baseline.exploration_usable and (settings.explore_every_fault or not caught))
    )
    if explore_wanted:
        if progress is not None:
            progress.send(("trace", "(exploration)"))
        exploration = explore_stage(settings.explore_examples, settings.explore_seed)
    explored = exploration is not None and bool(exploration.failure)
    scheduler_exploration = None
    in_scheduler = fault is not None and fault.area == "scheduler"
    if settings.scheduler_explore_examples > 0 and (
        baseline is None
        or (
            baseline.scheduler_exploration_usable
            and (settings.explore_every_fault or in_scheduler or not (caught or explored))
        )
    ):
        if progress is not None:
            progress.send(("trace", "(Scheduler-level exploration)"))
        scheduler_exploration = scheduler_explore_stage(
            settings.scheduler_explore_examples, settings.explore_seed
        )
    explored = explored or (
        scheduler_exploration is not None and bool(scheduler_exploration.failure)
    )
    scheduler = None
    if settings.scheduler_stage and (
        baseline is None or (baseline.scheduler_usable and not caught and not explored)
    ):
        if progress is not None:
            progress.send(("trace", "(real Scheduler, prefix caching off)"))
        scheduler = scheduler_stage()
    return GateRun(
        None if fault is None else fault.name,
        edit,
        "",
        tuple(outcomes),
        exploration,
        scheduler=scheduler,
        scheduler_traces=tuple(scheduler_traces),
        scheduler_exploration=scheduler_exploration,
    )


def _scheduler_corpus(corpus: Path) -> list[Trace]:
    """The scheduler-level traces beside `corpus` (its `scheduler/` folder)."""
    folder = corpus / "scheduler"
    if not folder.is_dir():
        return []
    return [t for t in load_corpus(folder) if t.scheduler is not None]


def _replay_on_scheduler(trace: Trace, level: Level) -> TraceOutcome:
    """One scheduler-level trace on vLLM's real Scheduler in lockstep with
    kvgate's scheduler model, as `kvgate gate` replays it."""
    from kvgate.targets import run_scheduler_trace, scheduler_factories

    model, real = scheduler_factories("vllm", None)
    outcome = run_scheduler_trace(trace, model, real, level)
    if isinstance(outcome, ReplayResult):
        failure = "" if outcome.divergence is None else divergence_summary(outcome.divergence)
        return TraceOutcome(trace.name, outcome.passed, failure, "", "", outcome.seconds)
    # A config refused here is a Scheduler vLLM would not build.
    return TraceOutcome(
        trace.name,
        False,
        outcome.message,
        "",
        "",
        outcome.seconds,
        built=not outcome.config_refused,
    )


def _counts(outcome: TraceOutcome, baseline: Baseline) -> bool:
    if not outcome.built:
        return False
    return (not outcome.passed and outcome.trace in baseline.passing) or bool(
        outcome.invariant and outcome.trace in baseline.invariant_clean
    )


def _replay_with_invariants(trace: Trace, level: Level) -> TraceOutcome:
    """One trace on vLLM in lockstep with the model; invariants after each step.

    A violation is recorded, not raised: the replay's own verdict stays what
    `kvgate gate` would say, and an invariant-only catch stays visible.
    """
    from kvgate.targets import LOCKSTEP_MODEL, target_factory

    violated: list[tuple[str, str]] = []

    def after_step(step: Step, target: Target) -> None:
        if violated:
            return
        found = check_snapshot(target.snapshot())
        if found:
            violated.append((found[0].invariant, f"after {step.where()}: {found[0].message}"))

    started = time.perf_counter()
    if trace.expect_refused is not None:
        # A refusal trace: vLLM must still refuse its config, as the model does.
        verdict = judge_refusal(trace, target_factory("vllm"), level)
        failure = "" if verdict.divergence is None else divergence_summary(verdict.divergence)
        return TraceOutcome(
            trace.name, verdict.passed, failure, "", "", time.perf_counter() - started
        )
    try:
        inner = target_factory("vllm")(trace.config)
    except Exception as error:
        failure = f"target not built: {one_line(error)}"
        return TraceOutcome(trace.name, False, failure, "", "", 0.0, built=False)
    with closing(WatchedTarget(inner, after_step)) as target:
        result = replay(trace, target, target_factory(LOCKSTEP_MODEL), level)
    invariant, violation = violated[0] if violated else ("", "")
    failure = "" if result.divergence is None else divergence_summary(result.divergence)
    return TraceOutcome(
        trace.name,
        result.passed,
        failure,
        invariant,
        violation,
        time.perf_counter() - started,
    )


def explore_stage(examples: int, seed: int | None = None) -> ExploreOutcome:
    """A short differential exploration (model against the vLLM in this
    process), derandomized (or seeded with `seed`) so the baseline and every
    fault see the same examples until they differ. Not shrunk: the campaign
    only needs to know.
    """
    started = time.perf_counter()
    try:
        from hypothesis import Phase

        from kvgate.explore.differential import FAMILIES, differential_mode
        from kvgate.explore.profiles import profile
        from kvgate.explore.runner import run_once
    except ImportError as missing:
        return ExploreOutcome(False, "", 0, 0.0, f"kvgate.explore not available ({missing})")
    failure = None
    for position, stratum in enumerate(FAMILIES):
        # The budget split evenly (the first strata take the remainder).
        share = examples // len(FAMILIES) + (position < examples % len(FAMILIES))
        if failure is not None or share == 0:
            continue
        settings = profile(
            "dev",
            max_examples=share,
            stateful_step_count=EXPLORE_STEPS,
            derandomize=seed is None,
            phases=(Phase.explicit, Phase.generate),
        )
        mode = differential_mode()
        mode.stratum = stratum
        try:
            failure = run_once(mode, settings, None if seed is None else seed + position)
        except Exception as error:  # a divergence the machine did not wrap
            return ExploreOutcome(True, one_line(error), examples, time.perf_counter() - started)
    found = "" if failure is None else " ".join(str(failure).splitlines()[0].split())
    return ExploreOutcome(True, found, examples, time.perf_counter() - started)


def scheduler_explore_stage(examples: int, seed: int | None = None) -> ExploreOutcome:
    """The Scheduler-level exploration (`kvgate explore --scope scheduler`'s
    ci profile, `examples` of them) against the vLLM in this process, hold
    off, derandomized (or seeded with `seed`), not shrunk."""
    started = time.perf_counter()
    try:
        from hypothesis import Phase

        from kvgate.explore.profiles import profile
        from kvgate.explore.scheduler_machine import SchedulerMode, explore_scheduler
    except ImportError as missing:
        return ExploreOutcome(False, "", 0, 0.0, f"kvgate.explore not available ({missing})")
    settings = profile(
        "ci",
        "scheduler",
        max_examples=examples,
        derandomize=seed is None,
        phases=(Phase.explicit, Phase.generate),
    )
    try:
        outcome = explore_scheduler(SchedulerMode(), settings, seed=seed)
    except Exception as error:  # a failure the machine did not wrap
        return ExploreOutcome(True, one_line(error), examples, time.perf_counter() - started)
    failure = outcome.failure
    found = "" if failure is None else f"{failure.kind}: {failure.message}"
    return ExploreOutcome(True, found, examples, time.perf_counter() - started)


# The real-Scheduler stage's workload: every token count / 32, 4 sessions x 3
# turns, without prefix caching at the align deployment's Mamba block (4096
# tokens, finer than max_model_len), where mode none's split, counts and
# frees differ from align mode's. About 3 s in a child.
SCHEDULER_SCALE = 32
SCHEDULER_SESSIONS = (4, 3)


def scheduler_stage() -> SchedulerOutcome:
    """vLLM's real `Scheduler` (in this process, the fault in effect) run
    without prefix caching beside kvgate's scheduler model, strict level."""
    started = time.perf_counter()
    try:
        from kvgate.targets import target_factory
        from kvgate.workload.deployment import Deployment
        from kvgate.workload.lockstep import SchedulerFactory, run_on_scheduler
        from kvgate.workload.plan import Workload, make_plan
    except ImportError as missing:
        return SchedulerOutcome(False, "", 0.0, f"kvgate.workload not available ({missing})")
    deployment = Deployment(build="upstream", prefix_caching=False).scaled(SCHEDULER_SCALE)
    sessions, turns = SCHEDULER_SESSIONS
    workload = Workload(sessions=sessions, turns=turns)
    config = deployment.config(64 // SCHEDULER_SCALE, False, sessions)
    block = deployment.tokens(deployment.mamba_block_size)
    attention, mamba = config.groups
    config = replace(
        config, groups=(attention, replace(mamba, block_size=block)), scheduler_block_size=block
    )
    try:
        factory = cast(SchedulerFactory, target_factory("vllm-scheduler"))
        # A Mamba block the engine would not resolve without prefix caching
        # (the Scheduler accepts it): run as given, on purpose.
        real = factory(
            config,
            spec_tokens=deployment.spec_tokens,
            max_num_seqs=deployment.max_num_seqs,
            engine_sizes=False,
        )
    except Exception as error:
        return SchedulerOutcome(
            True,
            f"Scheduler not built: {one_line(error)}",
            time.perf_counter() - started,
            built=False,
        )
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-mutate-") as out:
            result = run_on_scheduler(
                config,
                make_plan(workload, SCHEDULER_SCALE),
                deployment.serving(workload.system_prompt),
                real=real,
                name="mode-none-scheduler",
                out=Path(out),
                about="fault campaign: the real Scheduler without prefix caching",
                level="strict",
            )
    except Exception as error:  # a request refused, or the trace unwritable
        return SchedulerOutcome(True, one_line(error), time.perf_counter() - started)
    finally:
        real.close()
    divergence = result.replay.divergence
    failure = "" if divergence is None else divergence_summary(divergence)
    return SchedulerOutcome(True, failure, time.perf_counter() - started)


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
        run = GateRun(name, None, "", (), None, error=f"{one_line(error)} (at {where})")
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
    if not any(t.passed for t in run.traces):
        raise CampaignError("no trace passes on the unmutated build: nothing can catch a fault")
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
    if _context().get_start_method() == "fork":
        warm_up()
    baseline = run_baseline(settings)
    if on_baseline is not None:
        on_baseline(baseline)
    campaign = Campaign(baseline)
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
            done[child.fault.name] = judge(child.fault, run, why, baseline, seconds)
        while shown < len(faults) and faults[shown].name in done:
            result = done[faults[shown].name]
            campaign.results.append(result)
            if on_result is not None:
                on_result(result)
            shown += 1
    campaign.seconds = time.perf_counter() - started
    return campaign


def judge(
    fault: Fault, run: GateRun | None, why: str, baseline: Baseline, seconds: float
) -> FaultResult:
    """The verdict on one fault, from what its child reported."""
    if run is None:
        verdict: Verdict = "hung" if why.startswith("hung") else "error"
        return FaultResult(fault, verdict, None, seconds, note=why)
    if run.error:
        return FaultResult(fault, "error", None, seconds, run.edit, note=run.error)
    if run.not_applicable:
        return FaultResult(fault, "not applicable", None, seconds, note=run.not_applicable)
    built = [t for t in run.traces if t.built]
    diverged = [t for t in built if not t.passed and t.trace in baseline.passing]
    violated = [t for t in built if t.invariant and t.trace in baseline.invariant_clean]
    invariants = tuple(dict.fromkeys(t.invariant for t in violated))
    counted = [t for t in run.scheduler_traces if t.trace in baseline.scheduler_passing]
    scheduler_diverged = [t for t in counted if t.built and not t.passed]
    # What the fault kept from being built, where the baseline built it.
    not_built = [
        f"{t.trace}: {t.failure}"
        for t in (*(t for t in run.traces if t.trace in baseline.passing), *counted)
        if not t.built
    ]
    catch = None
    if diverged:
        first = diverged[0]
        catch = Catch("trace", first.trace, first.failure)
    elif violated:
        first = violated[0]
        catch = Catch("invariant", first.invariant, f"{first.trace}: {first.violation}")
    elif scheduler_diverged:
        first = scheduler_diverged[0]
        catch = Catch("scheduler trace", first.trace, first.failure)
    explored = None
    if run.exploration is not None and run.exploration.ran and baseline.exploration_usable:
        explored = bool(run.exploration.failure)
    if catch is None and explored:
        assert run.exploration is not None
        catch = Catch("exploration", "exploration", run.exploration.failure)
    scheduler_explored = None
    found = run.scheduler_exploration
    if found is not None and found.ran and baseline.scheduler_exploration_usable:
        scheduler_explored = bool(found.failure)
    if catch is None and scheduler_explored:
        assert found is not None
        catch = Catch("scheduler exploration", "Scheduler-level exploration", found.failure)
    scheduler = run.scheduler
    workload = None
    if scheduler is not None and scheduler.ran and baseline.scheduler_usable:
        if scheduler.built:
            workload = bool(scheduler.failure)
        else:
            not_built.append(f"real Scheduler, prefix caching off: {scheduler.failure}")
    if catch is None and workload:
        assert scheduler is not None
        catch = Catch("scheduler", "real Scheduler, prefix caching off", scheduler.failure)
    if catch is None and not_built:
        return FaultResult(
            fault,
            "not built",
            None,
            seconds,
            run.edit,
            note=not_built[0],
        )
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
        catching_traces=len(diverged),
        invariants=invariants,
        explored=explored,
        corpus_caught=bool(diverged or violated),
        workload=workload,
        scheduler_gate=bool(scheduler_diverged) if counted else None,
        scheduler_explored=scheduler_explored,
    )
