"""The fault campaign's stages, one class each, in the order of `STAGES`.

A stage says when it runs on a fault (`wanted`: given the settings, the
fault, what the baseline said and what the stages before it caught), how it
runs in the fault's child process (`run`), what it needs from the baseline
and what counts as caught (`judge`: anything the unmutated build already
fails says nothing about a fault), and the `Catch` a fault's row shows. It
also says what `kvgate mutate` prints for it: its part of the first line
(`headline`), its lines about the baseline (`describe`), and its row in the
per-stage table (`name`).

The stages, in the order each fault meets them: the corpus replayed with
the snapshot invariants and the scheduler-level corpus on vLLM's real
Scheduler (both what `kvgate gate` runs), the differential exploration, the
Scheduler-level exploration (engine steps on vLLM's real Scheduler), and a
workload on vLLM's real Scheduler without prefix caching. The campaign
(`campaign.py`) runs the table in each child and judges it in the parent;
adding a stage is one class added to the table (`Settings.stages`).
"""

from __future__ import annotations

import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

from kvgate.conformance.refusal import judge_refusal
from kvgate.conformance.replay import Level, ReplayResult, one_line, replay
from kvgate.conformance.report import divergence_summary
from kvgate.conformance.trace import Trace, load_corpus
from kvgate.invariants.predicates import check_snapshot
from kvgate.mutate.faults import Fault
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Target, WatchedTarget

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
# How much of a failure a line about the baseline shows.
DETAIL_WIDTH = 96


# ------------------------------------------------------------------ records


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
class Catch:
    kind: str  # what caught it: "trace", "invariant", "exploration", ... (a row shows it)
    source: str  # the trace, the invariant, or the stage
    detail: str
    more: int = 0  # how many more of the stage's sources caught it too


@dataclass(frozen=True)
class Judgement:
    """A stage's word on one fault, judged against the baseline."""

    # True caught, False ran and missed, None did not run (or does not count).
    said: bool | None
    catch: Catch | None = None  # set exactly when `said` is True
    # What the fault kept from being built where the baseline built it, one
    # line each: a "not built" verdict when no stage catches the fault.
    not_built: tuple[str, ...] = ()
    invariants: tuple[str, ...] = ()  # every invariant a counted trace violated


@dataclass(frozen=True)
class Child:
    """What a stage sees in the child process it runs in."""

    settings: Settings
    fault: Fault | None  # None in the baseline run
    # The baseline's outcomes by stage name; None in the baseline run itself,
    # where every stage the settings switch on runs.
    baseline: Mapping[str, object] | None
    # What the stages before this one said of the fault (empty in the baseline run).
    earlier: Mapping[str, bool | None]
    # Names what the child runs now, so a hung child's note says where it hung.
    progress: Callable[[str], None]

    def missed_so_far(self) -> bool:
        """No stage before this one caught the fault."""
        return not any(self.earlier.values())


OutcomeT = TypeVar("OutcomeT")


class Stage(ABC, Generic[OutcomeT]):
    """One stage of the campaign; `OutcomeT` is what its run reports back
    (pickled from the child to the parent)."""

    name: str  # its row in the per-stage table
    # Whether it drives vLLM (the parent imports vLLM once before forking).
    uses_vllm: bool = True
    # The summary line naming the faults only this stage caught ("" for none).
    caught_only: str = ""

    @abstractmethod
    def wanted(self, child: Child) -> bool:
        """Whether it runs in this child (every stage switched on runs in
        the baseline's)."""

    @abstractmethod
    def run(self, child: Child) -> OutcomeT:
        """Run it, the fault (if any) in effect in this process."""

    @abstractmethod
    def judge(self, outcome: OutcomeT | None, baseline: OutcomeT | None) -> Judgement:
        """What it says of the fault, from its outcome with the fault and
        the baseline's (None: it did not run there)."""

    def outcome(self, outcomes: Mapping[str, object] | None) -> OutcomeT | None:
        """Its own outcome among a run's (None: it did not run)."""
        return None if outcomes is None else cast("OutcomeT | None", outcomes.get(self.name))

    def headline(self, settings: Settings) -> str:
        """What the command's first line says it adds to the gate ("" for nothing)."""
        return ""

    def describe(self, baseline: OutcomeT | None) -> list[str]:
        """Its lines about the baseline run."""
        return []

    def refuse_baseline(self, baseline: OutcomeT | None) -> str:
        """Why, after this baseline, no stage can catch anything ("" if some can)."""
        return ""


# ------------------------------------------------------------------- stages


class ManagerGate(Stage[tuple[TraceOutcome, ...]]):
    """The manager-level corpus on vLLM, in lockstep with the model, with
    the snapshot invariants after every step. A trace counts only if it
    passes unmutated; an invariant only on a trace where it held unmutated."""

    name = "manager-level gate"

    def wanted(self, child: Child) -> bool:
        return True

    def run(self, child: Child) -> tuple[TraceOutcome, ...]:
        traces = load_corpus(child.settings.corpus)
        if child.baseline is not None:
            passing = self.passing(self.outcome(child.baseline))
            traces = [t for t in traces if t.name in passing]
        outcomes = []
        for trace in traces:
            child.progress(trace.name)
            outcomes.append(_replay_with_invariants(trace, child.settings.level))
        return tuple(outcomes)

    @staticmethod
    def passing(baseline: tuple[TraceOutcome, ...] | None) -> frozenset[str]:
        """Traces that pass on the unmutated build: the only ones that count."""
        return frozenset(t.trace for t in baseline or () if t.passed)

    @staticmethod
    def invariant_clean(baseline: tuple[TraceOutcome, ...] | None) -> frozenset[str]:
        """Passing traces on which every invariant held after every step."""
        return frozenset(t.trace for t in baseline or () if t.passed and not t.invariant)

    def judge(
        self, outcome: tuple[TraceOutcome, ...] | None, baseline: tuple[TraceOutcome, ...] | None
    ) -> Judgement:
        traces = outcome or ()
        passing, clean = self.passing(baseline), self.invariant_clean(baseline)
        built = [t for t in traces if t.built]
        diverged = [t for t in built if not t.passed and t.trace in passing]
        violated = [t for t in built if t.invariant and t.trace in clean]
        catch = None
        if diverged:
            catch = Catch("trace", diverged[0].trace, diverged[0].failure, len(diverged) - 1)
        elif violated:
            first = violated[0]
            catch = Catch("invariant", first.invariant, f"{first.trace}: {first.violation}")
        return Judgement(
            bool(diverged or violated),
            catch,
            tuple(f"{t.trace}: {t.failure}" for t in traces if t.trace in passing and not t.built),
            tuple(dict.fromkeys(t.invariant for t in violated)),
        )

    def headline(self, settings: Settings) -> str:
        return f"corpus {settings.corpus} ({settings.level}) + snapshot invariants"

    def describe(self, baseline: tuple[TraceOutcome, ...] | None) -> list[str]:
        traces = baseline or ()
        failing = [t.trace for t in traces if not t.passed]
        lines = [
            f"{len(self.passing(traces))} of {len(traces)} traces pass and count"
            + (f"; {len(failing)} fail unmutated and are left out" if failing else ""),
            f"  invariants hold after every step of {len(self.invariant_clean(traces))} of those",
        ]
        if failing:
            lines.append(f"  left out: {', '.join(failing)}")
        return lines

    def refuse_baseline(self, baseline: tuple[TraceOutcome, ...] | None) -> str:
        if not self.passing(baseline):
            return "no trace passes on the unmutated build: nothing can catch a fault"
        return ""


class SchedulerGate(Stage[tuple[TraceOutcome, ...]]):
    """The scheduler-level corpus (the corpus's `scheduler/` folder) on
    vLLM's real Scheduler in lockstep with kvgate's scheduler model, as
    `kvgate gate` replays it. A trace counts only if it passes unmutated."""

    name = "Scheduler-level gate"

    def wanted(self, child: Child) -> bool:
        return True

    def run(self, child: Child) -> tuple[TraceOutcome, ...]:
        passing = self.passing(self.outcome(child.baseline))
        outcomes = []
        for trace in _scheduler_corpus(child.settings.corpus):
            if child.baseline is not None and trace.name not in passing:
                continue
            child.progress(trace.name)
            outcomes.append(_replay_on_scheduler(trace, child.settings.level))
        return tuple(outcomes)

    @staticmethod
    def passing(baseline: tuple[TraceOutcome, ...] | None) -> frozenset[str]:
        """Scheduler-level traces that pass on the unmutated build."""
        return frozenset(t.trace for t in baseline or () if t.passed)

    def judge(
        self, outcome: tuple[TraceOutcome, ...] | None, baseline: tuple[TraceOutcome, ...] | None
    ) -> Judgement:
        passing = self.passing(baseline)
        counted = [t for t in outcome or () if t.trace in passing]
        diverged = [t for t in counted if t.built and not t.passed]
        catch = (
            Catch("scheduler trace", diverged[0].trace, diverged[0].failure) if diverged else None
        )
        return Judgement(
            bool(diverged) if counted else None,
            catch,
            tuple(f"{t.trace}: {t.failure}" for t in counted if not t.built),
        )

    def describe(self, baseline: tuple[TraceOutcome, ...] | None) -> list[str]:
        if not baseline:
            return []
        return [
            f"  scheduler-level traces on the real Scheduler: {len(self.passing(baseline))} "
            f"of {len(baseline)} pass and count"
        ]


class OneRunOutcome(Protocol):
    """What a stage that runs once per fault reports: whether it ran, and
    the one line it found ("" for nothing)."""

    @property
    def ran(self) -> bool: ...

    @property
    def failure(self) -> str: ...

    @property
    def passed(self) -> bool: ...


OneRunT = TypeVar("OneRunT", bound=OneRunOutcome)


class _OneRun(Stage[OneRunT]):
    """A stage that runs once per fault (an exploration, a workload) and
    counts only if it passed on the unmutated build: whatever it finds with
    the fault then catches it."""

    title: str  # how its line about the baseline names it
    kind: str  # its catch's kind and source
    source: str

    def usable(self, baseline: OneRunT | None) -> bool:
        return baseline is not None and baseline.passed

    def usable_in(self, child: Child) -> bool:
        return self.usable(self.outcome(child.baseline))

    def judge(self, outcome: OneRunT | None, baseline: OneRunT | None) -> Judgement:
        if outcome is None or not outcome.ran or not self.usable(baseline):
            return Judgement(None)
        if not outcome.failure:
            return Judgement(False)
        return Judgement(True, Catch(self.kind, self.source, outcome.failure))


class _Explore(_OneRun[ExploreOutcome]):
    """An exploration stage: runs when it has examples to run, and on a fault
    the stages before it miss (every fault with `--explore-every-fault`)."""

    passes: str  # what its baseline line says of the examples unmutated

    @abstractmethod
    def examples(self, settings: Settings) -> int: ...

    @abstractmethod
    def explore(self, settings: Settings) -> ExploreOutcome: ...

    def own_fault(self, child: Child) -> bool:
        """Whether `child`'s fault is one this stage runs on whatever else caught it."""
        return False

    def wanted(self, child: Child) -> bool:
        settings = child.settings
        if self.examples(settings) <= 0:
            return False
        if child.baseline is None:
            return True
        return self.usable_in(child) and (
            settings.explore_every_fault or self.own_fault(child) or child.missed_so_far()
        )

    def run(self, child: Child) -> ExploreOutcome:
        child.progress(f"({self.title})")
        return self.explore(child.settings)

    def describe(self, baseline: ExploreOutcome | None) -> list[str]:
        examples = baseline.examples if baseline else 0
        return [baseline_line(self.title, baseline, f"{examples} examples {self.passes}")]


class Exploration(_Explore):
    """A short differential exploration (model against vLLM) for a fault the
    gate's corpus misses, or for every fault with `--explore-every-fault`."""

    name = "exploration"
    title = "exploration"
    kind = "exploration"
    source = "exploration"
    caught_only = "caught by exploration only"
    passes = "pass unmutated"

    def examples(self, settings: Settings) -> int:
        return settings.explore_examples

    def explore(self, settings: Settings) -> ExploreOutcome:
        return explore_stage(settings.explore_examples, settings.explore_seed)

    def headline(self, settings: Settings) -> str:
        if not settings.explore_examples:
            return ""
        seed = settings.explore_seed
        return f"exploration ({settings.explore_examples} examples, " + (
            "derandomized)" if seed is None else f"seed {seed})"
        )


class SchedulerExploration(_Explore):
    """The Scheduler-level exploration (engine steps on vLLM's real
    Scheduler) for every fault in the Scheduler's own code and any other the
    stages before it miss (every fault with `--explore-every-fault`)."""

    name = "Scheduler-level exploration"
    title = "Scheduler-level exploration"
    kind = "scheduler exploration"
    source = "Scheduler-level exploration"
    caught_only = "caught by the Scheduler-level exploration only"
    passes = "in lockstep unmutated"

    def examples(self, settings: Settings) -> int:
        return settings.scheduler_explore_examples

    def explore(self, settings: Settings) -> ExploreOutcome:
        return scheduler_explore_stage(settings.scheduler_explore_examples, settings.explore_seed)

    def own_fault(self, child: Child) -> bool:
        return child.fault is not None and child.fault.area == "scheduler"

    def headline(self, settings: Settings) -> str:
        examples = settings.scheduler_explore_examples
        return f"Scheduler-level exploration ({examples} examples)" if examples else ""


class RealSchedulerWorkload(_OneRun[SchedulerOutcome]):
    """A short workload on vLLM's real Scheduler without prefix caching, in
    lockstep with kvgate's scheduler model, for a fault every stage before
    it missed: the Scheduler's own code (its split, its admission) in Mamba
    cache mode none is reached by nothing else."""

    name = "real-Scheduler workload"
    title = "real Scheduler (prefix caching off)"
    kind = "scheduler"
    source = "real Scheduler, prefix caching off"
    caught_only = "caught by the real Scheduler only"

    def wanted(self, child: Child) -> bool:
        if not child.settings.scheduler_stage:
            return False
        return child.baseline is None or (self.usable_in(child) and child.missed_so_far())

    def run(self, child: Child) -> SchedulerOutcome:
        child.progress(f"({self.source})")
        return scheduler_stage()

    def judge(
        self, outcome: SchedulerOutcome | None, baseline: SchedulerOutcome | None
    ) -> Judgement:
        if outcome is not None and outcome.ran and self.usable(baseline) and not outcome.built:
            # The fault kept vLLM's Scheduler from being built: no lockstep ran.
            return Judgement(None, not_built=(f"{self.source}: {outcome.failure}",))
        return super().judge(outcome, baseline)

    def headline(self, settings: Settings) -> str:
        return "the real Scheduler without prefix caching" if settings.scheduler_stage else ""

    def describe(self, baseline: SchedulerOutcome | None) -> list[str]:
        return [baseline_line(self.title, baseline, "in lockstep unmutated")]


STAGES: tuple[Stage[Any], ...] = (
    ManagerGate(),
    SchedulerGate(),
    Exploration(),
    SchedulerExploration(),
    RealSchedulerWorkload(),
)
MANAGER_GATE, SCHEDULER_GATE, EXPLORATION, SCHEDULER_EXPLORATION, WORKLOAD = STAGES


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
    # The stages each fault meets, in order.
    stages: tuple[Stage[Any], ...] = STAGES


def baseline_line(
    title: str, outcome: ExploreOutcome | SchedulerOutcome | None, passed: str
) -> str:
    """A one-run stage's line about the baseline: off, not run (why),
    failing unmutated (so left out), or passing (`passed` says how) in so
    many seconds."""
    if outcome is None:
        return f"  {title}: off"
    if not outcome.ran:
        return f"  {title}: not run ({outcome.note})"
    if outcome.failure:
        return f"  {title}: fails unmutated, left out ({outcome.failure[:DETAIL_WIDTH]})"
    return f"  {title}: {passed} ({outcome.seconds:.1f}s)"


# ------------------------------------------------------- running the stages


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

        from kvgate.explore.mode import SchedulerMode
        from kvgate.explore.profiles import profile
        from kvgate.explore.scheduler_runner import explore_scheduler
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
