"""The workload written as a scheduler-level trace: its arrivals and engine steps.

`engine_trace` plays one arm's sessions through the scheduler model
(`generator.SessionRun`) and writes what a real engine would be handed:
each turn's `arrive` at the engine step it arrived before, and one `step`
entry per engine step, expecting nothing (the lockstep compares the two
sides each step). Replayed on kvgate's scheduler model it schedules the
same steps the workload took; on vLLM's `Scheduler` in lockstep it is the
workload at the Scheduler level, as a file `kvgate replay` reads (and
`--stream` reads entry by entry).

The shared system prompt is held, in the workload, by a request the
scheduler never runs; a scheduler-level trace has no such request, so each
first turn's prompt carries the system prompt's token ids themselves.
`days` repeats the plan that many times, day d's requests named
`d<d>-<name>` and each day arriving once the one before has finished: a
history as long as `days` workloads over the same pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.conformance.writer import engine_step_dicts, engine_trace_head, recording_entry
from kvgate.model.scheduler_state import StepDecisions
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep, RemoteHit
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs
from kvgate.workload.deployment import Deployment
from kvgate.workload.generator import SYSTEM, SessionRun
from kvgate.workload.plan import Workload, make_plan
from kvgate.workload.runner import Arm, about, trace_name


@dataclass
class _Entries:
    """The observer that turns the run's arrivals and steps into engine entries."""

    run: SessionRun
    prefix: str
    entries: list[EngineStep] = field(default_factory=list)

    def name(self, request: str) -> str:
        return self.prefix + request

    def arrived(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        remote: RemoteHit | None = None,
        inputs: HashInputs = NO_INPUTS,
    ) -> None:
        written = self.run.writer.steps[-1]
        assert written.op == "arrive" and written.req == name, written
        self.entries.append(
            EngineStep(
                "arrive",
                len(self.entries),
                req=self.name(name),
                prompt=tuple(self.segment(s) for s in written.prompt),
                max_tokens=max_tokens,
                cache_salt=written.cache_salt,
                follows=None if follows is None else self.name(follows),
                remote=remote,
            )
        )

    def segment(self, segment: Segment) -> Segment:
        if segment.req == SYSTEM:
            system = self.run.oracle.requests[SYSTEM].request
            return Segment("tokens", token_ids=tuple(system.prompt))
        if segment.req is not None:
            return Segment(segment.kind, segment.count, self.name(segment.req))
        return segment

    def stepped(self, decisions: StepDecisions, last: Step) -> None:
        self.entries.append(EngineStep("step", len(self.entries)))


def engine_entries(
    workload: Workload, deployment: Deployment, arm: Arm, days: int = 1
) -> Iterator[list[EngineStep]]:
    """Each day's engine entries, in order (see the module's docstring)."""
    sessions = make_plan(workload, deployment.scale)
    config = deployment.config(arm.unit, arm.hold, workload.sessions)
    for day in range(days):
        serving = deployment.serving(workload.system_prompt, workload.seed)
        run = SessionRun(config, sessions, serving)
        observer = _Entries(run, f"d{day}-" if day else "")
        run.observer = observer
        run.run()
        yield observer.entries


def write_engine_trace(
    workload: Workload,
    deployment: Deployment,
    arm: Arm,
    out: Path,
    days: int = 1,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """The arm's scheduler-level trace, `days` long, written to `out` one
    entry a line (the form `kvgate replay --stream` reads entry by entry)."""
    config = deployment.config(arm.unit, arm.hold, workload.sessions)
    settings = EngineSettings(deployment.spec_tokens, deployment.max_num_seqs)
    name = trace_name(workload, deployment, arm) + ".engine" + (f".x{days}" if days > 1 else "")
    head = engine_trace_head(name, config, settings, about(workload, deployment, arm))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.yaml"
    with path.open("w", encoding="utf-8") as file:
        file.write(head)
        for day, entries in enumerate(engine_entries(workload, deployment, arm, days)):
            for entry in engine_step_dicts(entries):
                file.write(recording_entry(entry))
            if progress is not None:
                progress(day + 1)
    return path
