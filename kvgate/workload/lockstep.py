"""The workload on vLLM's real `Scheduler`, in lockstep with kvgate's scheduler model.

`run_on_scheduler` plays one arm's sessions through `generator.SessionRun`
(kvgate's scheduler model over the model, writing the arm's trace as
usual) and, beside it, through a `SchedulerTarget` (vLLM's own `Scheduler`
owning a real `KVCacheManager`): every turn is added to both when it
arrives; each engine step the model took is handed to the gate's
scheduler-level lockstep (`conformance.scheduler_replay.EngineLockstep`),
which runs it on the real scheduler as vLLM's engine core would and
compares everything a scheduler-level replay compares (what ran, who was
preempted, lookups, admissions, copies, connector questions, finished
requests, prefill stats, prefix-cache stats, KV-cache events, usage, the
residency metrics' evictions, async batches and deferred frees; at level
strict the owned manager's whole snapshot). With a KV connector the real
connector is scripted with each request's drawn hit.

The first difference (or an exception inside vLLM) ends the arm as a
divergence at that engine step, named by its last trace step. A request the
engine would not take is bad input: a `TraceError` naming the step and the
reason. The table's counts come from the real scheduler's own observations
(admitted hits, the attention checks), classified by `measure.count_seen`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgate.conformance.replay import Diverged, Divergence, Level, ReplayResult
from kvgate.conformance.scheduler_replay import EngineLockstep
from kvgate.conformance.trace import TraceError, load_trace
from kvgate.conformance.writer import save_trace
from kvgate.errors import InputError
from kvgate.model.scheduler_state import StepDecisions
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.scheduling import EngineStep, RemoteHit, SchedulerTarget
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


@dataclass
class _Lockstep:
    """The observer that hands the real scheduler each arrival and engine
    step of the model's sessions, through the gate's scheduler-level
    lockstep (`EngineLockstep`): the workload is compared on everything a
    scheduler-level replay compares."""

    lockstep: EngineLockstep
    run: SessionRun
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
        self.lockstep.add_to_real(step, name, tokens, inputs, max_tokens, follows, remote)

    def stepped(self, decisions: StepDecisions, last: Step) -> None:
        self.lockstep.engine_steps += 1
        observed = self.lockstep.judge_step(EngineStep("step", last.index), last, decisions)
        self._checked.update(observed.checked)
        for name, hit in observed.admitted:
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
    path = out / f"{name}.yaml"  # where `save_trace` writes the arm's trace
    lockstep = EngineLockstep(name, path, config, run.scheduler, real, level)
    observer = _Lockstep(lockstep, run)
    run.observer = observer
    divergence: Divergence | None = None
    refused: TraceError | None = None
    try:
        run.run()
        lockstep.whole_views_agree()
    except Diverged as diverged:
        divergence = replace(diverged.divergence, note=NOTE)
    except TraceError as error:
        refused = error
    except StepRefused as refusal:
        # The model refuses the step being written (e.g. a prompt longer than
        # max_model_len): the plan does not fit the config.
        refused = TraceError(
            path,
            len(run.writer.steps),
            refusal.field,
            f"kvgate's model refuses it: {refusal.message}",
        )
    seconds = time.perf_counter() - started
    saved = save_trace(out, name, config, run.writer.steps, about)
    assert saved == path, (saved, path)
    if refused is not None:
        raise refused
    trace = load_trace(path)
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
        count_seen(observer.seen, config),
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
