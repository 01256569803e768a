"""Write a workload's traces, one per unit x hold arm, and replay them.

Every arm runs the same session plan; its trace is generated on the model
(the oracle) with that arm's config, written as a version-1 trace, read back
through the trace reader and replayed on the target: the numbers a table
shows come from the file anyone can replay with `kvgate replay`. Against a
target other than the model, the model runs in lockstep (the replayer's
usual comparison), so a disagreement is a reported divergence, not a
silently different count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from kvgate.conformance.replay import Level, ReplayResult, TargetFactory, replay
from kvgate.conformance.trace import Trace, TraceError, load_trace
from kvgate.conformance.writer import save_trace
from kvgate.driver.op_driver import OpDriver
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.target import Capabilities, Target
from kvgate.workload.deployment import Deployment
from kvgate.workload.generator import generate
from kvgate.workload.measure import ArmCounts, Recorder, count
from kvgate.workload.plan import Workload, make_plan
from kvgate.workload.progress import Progress


@dataclass(frozen=True)
class Arm:
    """One arm of the workload: a hash unit and a hold setting."""

    unit: int  # the hash unit (= attention block), scaled
    hold: bool

    @property
    def label(self) -> str:
        return f"unit {self.unit} hold {'on' if self.hold else 'off'}"


@dataclass(frozen=True)
class ArmResult:
    """An arm's trace and, when it was replayed, its counts and replay."""

    arm: Arm
    trace: Trace
    # None when the arm was not replayed (see `skipped`).
    counts: ArmCounts | None = None
    replay: ReplayResult | None = None
    skipped: str = ""


def trace_name(workload: Workload, deployment: Deployment, arm: Arm) -> str:
    scale = f"-div{deployment.scale}" if deployment.scale > 1 else ""
    hold = "on" if arm.hold else "off"
    return (
        f"workload-{workload.sessions}x{workload.turns}-seed{workload.seed}{scale}"
        f"-u{arm.unit}.{deployment.build}"
        + (".kv-connector" if deployment.kv_connector else "")
        + deployment.connector_tags()
        + f".hold-{hold}"
    )


def about(workload: Workload, deployment: Deployment, arm: Arm) -> str:
    """The `about` text of an arm's trace."""
    return (
        f"kvgate workload: {workload.sessions} agent sessions x {workload.turns} turns "
        f"(seed {workload.seed}), {arm.label}; generated with the model as oracle; "
        + "; ".join(deployment.describe((arm.unit,), workload.sessions))
    )


def write_traces(
    workload: Workload,
    deployment: Deployment,
    arms: Sequence[Arm],
    out: Path,
    progress: Progress,
) -> list[Path]:
    """Generate and save one trace per arm; returns their paths, in arm order."""
    sessions = make_plan(workload, deployment.scale)
    paths = []
    for arm in arms:
        config = deployment.config(arm.unit, arm.hold, workload.sessions)
        progress.start(f"generate {arm.label}", sum(len(s.turns) for s in sessions))
        steps = generate(
            config,
            sessions,
            deployment.serving(workload.system_prompt, workload.seed),
            progress=lambda done, _total: progress.set(done),
        )
        name = trace_name(workload, deployment, arm)
        paths.append(save_trace(out, name, config, steps, about(workload, deployment, arm)))
        progress.finish(f"{len(steps)} steps")
    return paths


def replay_arm(
    path: Path,
    arm: Arm,
    target: TargetFactory,
    model: TargetFactory | None,
    level: Level,
    progress: Progress,
) -> ArmResult:
    """Replay one arm's trace file on a fresh target built by `target`."""
    progress.start(f"load {arm.label}", 1)
    trace = load_trace(path)
    progress.finish()
    built = target(trace.config)
    lacking = lacking_capability(trace.config, built.capabilities)
    if lacking:
        built.close()
        return ArmResult(arm, trace, skipped=f"{built.capabilities.implementation} {lacking}")
    if not isinstance(built, OpDriver):
        built.close()
        raise TraceError(path, None, "target", "the workload counts need an OpDriver target")
    recorder = Recorder(built, on_step=progress.advance)
    progress.start(f"replay {arm.label}", len(trace.primitives))
    try:
        result = replay(trace, recorder, model, level)
    finally:
        recorder.close()
    progress.finish("ok" if result.passed else "DIVERGED")
    return ArmResult(arm, trace, count(recorder, trace.config), result)


def lacking_capability(config: Config, capabilities: Capabilities) -> str:
    """What the arm's config needs that the target lacks ("" when nothing)."""
    if config.hold and not capabilities.hold:
        if not config.prefix_caching:
            return "holds nothing without prefix caching (the hold-off arm is the same run)"
        return "has no hold (pass --overlay)"
    if config.retain_retired and not capabilities.retain_retired:
        return "keeps no retired state (pass --overlay, or --build upstream)"
    return ""


def factories(
    target_factory: Callable[[str], TargetFactory],
    target: str,
    plugin: str | None,
    lockstep: str,
) -> tuple[TargetFactory, TargetFactory | None]:
    """The target's factory (with its plugin) and the lockstep model's, if any."""
    factory = target_factory(target)
    if plugin is not None:
        # VllmTarget(config, plugin=...): the one target that loads plugins.
        factory = functools.partial(cast(Callable[..., Target], factory), plugin=plugin)
    return factory, (None if target == lockstep else target_factory(lockstep))
