"""Idle steps (kvgate/model/idle.py): the model that proves most decodes
idle once per window behaves exactly as one that runs every step in full.

Each run below puts the two side by side at level strict: the bundled
manager-level corpus and exploration in lockstep, comparing the whole views
after every step; a workload trace (long decodes over many block
boundaries, the shape the windows are for) in lockstep too; the bundled
Scheduler-level corpus run on each, comparing what the model reported at
every engine entry and its final view.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from kvgate.conformance.replay import replay
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    Trace,
    bundled_corpus,
    bundled_scheduler_corpus,
    load_corpus,
    load_trace,
)
from kvgate.explore.mode import Mode
from kvgate.explore.profiles import PROFILES
from kvgate.explore.runner import explore
from kvgate.model.coordinator import Coordinator
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config


def every_step_in_full(coordinator: Coordinator) -> None:
    """Make `coordinator` skip nothing: no step is taken as idle (so no
    window opens) and every group keys in full, as the model did before
    idle windows."""

    def never(*args: Any) -> bool:
        return False

    coordinator.step_is_idle = never  # type: ignore[method-assign,assignment]
    for manager in coordinator.managers:
        manager.nothing_to_key = never  # type: ignore[method-assign,assignment]


def full_model(config: Config) -> ModelTarget:
    target = ModelTarget(config)
    every_step_in_full(target.manager.coordinator)
    return target


def full_scheduler_model(config: Config, spec: int, max_num_seqs: int) -> SchedulerModel:
    model = SchedulerModel(config, spec, max_num_seqs)
    every_step_in_full(model.oracle.manager.coordinator)
    return model


def replays_alike(trace: Trace, whole_view_every: int = 1) -> int:
    """`trace` on the model with idle windows, in lockstep with the model
    running every step in full (what each step touched compared after it,
    the whole views every `whole_view_every` steps); the steps the first
    took as idle within a window."""
    target = ModelTarget(trace.config)
    coordinator = target.manager.coordinator
    in_window = 0
    in_idle_window = coordinator.in_idle_window

    def counted(*args: Any) -> bool:
        nonlocal in_window
        found = in_idle_window(*args)
        in_window += found
        return found

    coordinator.in_idle_window = counted  # type: ignore[method-assign,assignment]
    result = replay(
        trace,
        target,
        full_model,
        "strict",
        target_is_model=True,
        whole_view_every=whole_view_every,
    )
    assert result.passed, result.divergence
    return in_window


def manager_traces() -> list[Trace]:
    return [
        t
        for t in load_corpus(bundled_corpus())
        if not t.scheduler_level and t.expect_refused is None
    ]


def test_the_bundled_manager_traces_replay_alike() -> None:
    in_window = sum(replays_alike(trace) for trace in manager_traces())
    assert in_window > 50, in_window


def test_a_workload_trace_replays_alike(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvgate.workload.deployment import Deployment
    from kvgate.workload.plan import Workload
    from kvgate.workload.progress import Progress
    from kvgate.workload.runner import Arm, write_traces

    # The production workload's shape, smaller, served with a block of one
    # hash unit: a block fills every 64 tokens of a long decode.
    workload = Workload(
        sessions=3,
        turns=3,
        system_prompt=512,
        final_prompt=(3000, 4000),
        output=(96, 512),
        growth=(256, 512),
    )
    deployment = replace(Deployment(build="upstream"), mamba_block_size=64)
    [path] = write_traces(workload, deployment, [Arm(64, False)], tmp_path, Progress(quiet=True))
    trace = load_trace(path)
    # An 11,326-block pool: the whole views every 100 steps.
    in_window = replays_alike(trace, whole_view_every=100)
    assert in_window > 1000, in_window


def scheduler_run(trace: Trace, factory: Any) -> tuple[bool, list[dict[str, Any]], Any]:
    """`trace` on a scheduler model built by `factory`: whether it passed,
    what the model reported at every engine entry, and its final view."""
    built: list[SchedulerModel] = []
    seen: list[dict[str, Any]] = []

    def make(config: Config, spec: int, max_num_seqs: int) -> SchedulerModel:
        built.append(factory(config, spec, max_num_seqs))
        return built[-1]

    result = replay_scheduler(trace, make, None, "strict", observe=lambda _, got: seen.append(got))
    return result.passed, seen, built[0].snapshot()


def test_the_bundled_scheduler_traces_replay_alike() -> None:
    traces = [t for t in load_corpus(bundled_scheduler_corpus()) if t.expect_refused is None]
    assert len(traces) > 20
    for trace in traces:
        windowed = scheduler_run(trace, SchedulerModel)
        assert windowed[0], trace.name
        assert windowed == scheduler_run(trace, full_scheduler_model), trace.name


@pytest.mark.parametrize("hold", [False, True])
def test_exploration_finds_no_difference(hold: bool) -> None:
    mode = Mode(hold=hold, invariants=(), lockstep=full_model)
    profile = settings(PROFILES["ci"], max_examples=120)
    outcome = explore(mode, profile, seed=0, shrink=False)
    assert outcome.failure is None, outcome.failure
    assert mode.stats.ops["decode1"] > 100
