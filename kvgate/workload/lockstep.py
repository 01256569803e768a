"""The workload on vLLM's real `Scheduler`, in lockstep with kvgate's scheduler model.

`run_on_scheduler` plays one arm's sessions through `generator.SessionRun`
(kvgate's scheduler model over the model, writing the arm's trace as
usual) and, beside it, through a `SchedulerTarget` (vLLM's own `Scheduler`
owning a real `KVCacheManager`): every turn is added to both when it
arrives; after each engine step of the model the real scheduler runs one
`schedule()` and one `update()` with the tokens the model sampled, and the
two are compared:

- api level: which requests ran with how many tokens (in order), who was
  preempted, every lookup's hit, each admission's hit, the attention check
  before a follow-up's lookup, the copies, which requests finished; with a
  KV connector also each question put to the connector and each allocation
  from the waiting queue (local hit, external tokens, async), the real
  connector scripted with each request's drawn hit and the loads reported
  to the real Scheduler when the model's worker reports them;
- strict level: also the owned manager's whole snapshot after the step.

The first difference (or an exception inside vLLM) ends the arm as a
divergence at that engine step, named by its last trace step. A request the
engine would not take is bad input: a `TraceError` naming the step and the
reason. The table's counts come from the real scheduler's own observations
(admitted hits, the attention checks), classified by `measure.count_seen`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.conformance.replay import Divergence, Level, ReplayResult, one_line
from kvgate.conformance.trace import TraceError, load_trace
from kvgate.conformance.writer import save_trace
from kvgate.errors import InputError
from kvgate.model.scheduler import StepDecisions
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.scheduling import (
    RemoteHit,
    ScheduledStep,
    SchedulerTarget,
    step_differences,
)
from kvgate.vocabulary.target import StepRefused
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs
from kvgate.workload.deployment import Deployment, Serving
from kvgate.workload.generator import SessionRun
from kvgate.workload.measure import ArmCounts, Seen, count_seen
from kvgate.workload.plan import Session, Workload, make_plan
from kvgate.workload.progress import Progress
from kvgate.workload.runner import (
    Arm,
    ArmResult,
    about,
    lacking_capability,
    trace_name,
    write_traces,
)

NOTE = "vLLM's Scheduler vs kvgate's scheduler model, in lockstep"


class _WorkloadDiverged(Exception):
    def __init__(self, step: Step, level: str, what: str, expected: object, actual: object) -> None:
        super().__init__(what)
        self.step = step
        self.level = level
        self.what = what
        self.expected = expected
        self.actual = actual


class _Refused(Exception):
    def __init__(self, step_index: int, refusal: StepRefused, who: str) -> None:
        super().__init__(refusal.message)
        self.step_index = step_index
        self.refusal = refusal
        self.who = who


@dataclass
class _Lockstep:
    """The observer that drives the real scheduler beside the model's."""

    real: SchedulerTarget
    run: SessionRun
    level: Level
    engine_steps: int = 0
    evictions_compared: int = 0
    seen: dict[str, Seen] = field(default_factory=dict)
    _checked: dict[str, int] = field(default_factory=dict)

    def arrived(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        remote: RemoteHit | None = None,
        inputs: HashInputs = NO_INPUTS,
    ) -> None:
        self.seen[name] = Seen(prompt_tokens=len(tokens), follows=follows)
        step = self.run.writer.steps[-1]
        try:
            if remote is not None:
                self.real.script_external(name, remote.tokens, remote.load_async)
            self.real.add_request(name, tokens, max_tokens, follows, inputs)
        except StepRefused as refusal:
            raise _Refused(step.index, refusal, "vLLM's Scheduler") from None
        except UnsupportedConfig as error:  # hash inputs the target does not model
            unmodelled = StepRefused(error.field, error.message)
            raise _Refused(step.index, unmodelled, "vLLM's Scheduler") from None
        except Exception as error:
            raise _WorkloadDiverged(
                step, "api", "exception", "no exception", one_line(error)
            ) from error

    def stepped(self, decisions: StepDecisions, last: Step) -> None:
        self.engine_steps += 1
        try:
            real = self.real.schedule()
        except Exception as error:
            raise _WorkloadDiverged(
                last, "api", "schedule() raised", "no exception", one_line(error)
            ) from error
        self._compare(decisions, real, last)
        try:
            finished = self.real.update(
                decisions.sampled, loaded=decisions.loaded, failed=decisions.failed
            )
        except Exception as error:
            raise _WorkloadDiverged(
                last, "api", "update_from_output() raised", "no exception", one_line(error)
            ) from error
        if finished != decisions.finished:
            raise _WorkloadDiverged(last, "api", "finished", decisions.finished, finished)
        # The residency metrics the real update's stats drained, against
        # the model's (the oracle's own collector; none without the metrics).
        drained = self.run.oracle.stats_evictions() or []
        modelled = [e.reuse_gaps for e in drained]
        evictions = self.real.take_evictions()
        if evictions != modelled:
            raise _WorkloadDiverged(
                last, "api", "residency eviction events (reuse gaps each)", modelled, evictions
            )
        self.evictions_compared += len(evictions)
        self._record(real)
        if self.level == "strict":
            model_view = self.run.oracle.snapshot()
            real_view = self.real.snapshot()
            for what, expected, actual in model_view.differences(real_view):
                raise _WorkloadDiverged(last, "strict", what, expected, actual)

    def _compare(self, model: StepDecisions, real: ScheduledStep, last: Step) -> None:
        for what, expected, actual in step_differences(model, real):
            raise _WorkloadDiverged(last, "api", what, expected, actual)

    def _record(self, real: ScheduledStep) -> None:
        self._checked.update(real.checked)
        for name, hit in real.admitted:
            seen = self.seen[name]
            seen.last_hit = hit
            if seen.admitted_hit is None:
                seen.admitted_hit = hit
                seen.admitted_previous_cached = self._checked.get(name)


@dataclass(frozen=True)
class SchedulerArm:
    """One arm run on the real scheduler: its trace, counts and verdict."""

    path: Path
    counts: ArmCounts
    replay: ReplayResult
    engine_steps: int
    # Residency metrics' eviction events compared (`kv_cache_metrics`).
    evictions_compared: int = 0


def run_on_scheduler(
    config: Config,
    sessions: Sequence[Session],
    serving: Serving,
    *,
    real: SchedulerTarget,
    name: str,
    out: Path,
    about: str,
    level: Level,
    progress: Callable[[int, int], None] | None = None,
) -> SchedulerArm:
    """Run the arm on `real` beside the model; save the trace the model wrote.

    Raises `TraceError` when the real scheduler refuses a request (bad input).
    """
    started = time.perf_counter()
    run = SessionRun(config, sessions, serving, progress=progress)
    lockstep = _Lockstep(real, run, level)
    run.observer = lockstep
    diverged: _WorkloadDiverged | None = None
    refused: _Refused | None = None
    try:
        run.run()
    except _WorkloadDiverged as error:
        diverged = error
    except _Refused as error:
        refused = error
    except StepRefused as refusal:
        # The model refuses the step being written (e.g. a prompt longer than
        # max_model_len): the plan does not fit the config.
        refused = _Refused(len(run.writer.steps), refusal, "kvgate's model")
    seconds = time.perf_counter() - started
    path = save_trace(out, name, config, run.writer.steps, about)
    if refused is not None:
        raise TraceError(
            path,
            refused.step_index,
            refused.refusal.field,
            f"{refused.who} refuses it: {refused.refusal.message}",
        )
    trace = load_trace(path)
    divergence = None
    if diverged is not None:
        divergence = Divergence(
            trace=trace.name,
            path=path,
            step=diverged.step,
            level="api" if diverged.level == "api" else "strict",
            what=f"engine step {lockstep.engine_steps}: {diverged.what}",
            expected=diverged.expected,
            actual=diverged.actual,
            note=NOTE,
        )
    result = ReplayResult(
        trace=trace,
        level=level,
        capabilities=real.capabilities,
        steps_run=len(run.writer.steps),
        seconds=seconds,
        divergence=divergence,
        notes=(NOTE,),
    )
    return SchedulerArm(
        path,
        count_seen(lockstep.seen, config),
        result,
        lockstep.engine_steps,
        lockstep.evictions_compared,
    )


# Builds the real scheduler for a config: (config, spec_tokens=, max_num_seqs=).
SchedulerFactory = Callable[..., SchedulerTarget]


def scheduler_arm(
    workload: Workload,
    deployment: Deployment,
    arm: Arm,
    factory: SchedulerFactory,
    out: Path,
    level: Level,
    progress: Progress,
) -> ArmResult:
    """One workload arm on the real scheduler (see `run_on_scheduler`)."""
    sessions = make_plan(workload, deployment.scale)
    config = deployment.config(arm.unit, arm.hold, workload.sessions)
    progress.start(f"build vLLM's Scheduler for {arm.label}", 1)
    try:
        real = factory(
            config, spec_tokens=deployment.spec_tokens, max_num_seqs=deployment.max_num_seqs
        )
    except UnsupportedConfig as error:
        raise InputError(
            f"{arm.label}: vLLM's Scheduler cannot run config.{error.field}: {error.message}"
        ) from None
    progress.finish()
    lacking = lacking_capability(config, real.capabilities)
    if lacking:
        real.close()
        [path] = write_traces(workload, deployment, [arm], out, progress)
        skipped = f"{real.capabilities.implementation} {lacking}"
        return ArmResult(arm, load_trace(path), skipped=skipped)
    turns = sum(len(s.turns) for s in sessions)
    progress.start(f"lockstep {arm.label}", turns)
    try:
        result = run_on_scheduler(
            config,
            sessions,
            deployment.serving(workload.system_prompt, workload.seed),
            real=real,
            name=trace_name(workload, deployment, arm),
            out=out,
            about=about(workload, deployment, arm),
            level=level,
            progress=lambda done, _total: progress.set(done),
        )
    finally:
        real.close()
    progress.finish(
        f"{result.engine_steps} engine steps, " + ("ok" if result.replay.passed else "DIVERGED")
    )
    return ArmResult(arm, result.replay.trace, result.counts, result.replay)
