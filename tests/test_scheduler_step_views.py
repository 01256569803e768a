"""Strict lockstep a step at a time at the Scheduler level: each engine entry
compares the blocks either side changed and the requests the model's manager
calls named, the whole views at intervals and after the last entry, so a
difference in a block no engine step touches is still caught, named with the
window of entries it was caught in."""

from __future__ import annotations

from typing import Any

import pytest
from configs import needs_vllm
from scheduler_runs import Wrapped

from kvgate.conformance.replay import ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, load_trace
from kvgate.model.scheduler import SchedulerModel
from kvgate.workload.deployment import Deployment
from kvgate.workload.engine_trace import write_engine_trace
from kvgate.workload.plan import Workload
from kvgate.workload.runner import Arm

# The production workload, small: every token count divided by 64.
SCALE = 64


@pytest.fixture(scope="module")
def workload_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    deployment = Deployment(build="upstream").scaled(SCALE)
    path = write_engine_trace(
        Workload(sessions=4, turns=3), deployment, Arm(64, False), tmp_path_factory.mktemp("w")
    )
    return load_trace(path)


def test_the_workload_replays_on_the_model_as_it_was_scheduled(workload_trace: Trace) -> None:
    trace = workload_trace
    assert trace.scheduler_level and trace.config.num_blocks > 100
    result = replay_scheduler(trace, SchedulerModel, None, "strict")
    assert result.passed, result.divergence
    # Every turn finished and freed its blocks.
    assert sum(e.op == "arrive" for e in trace.engine) == 4 * 3


class _Planting(Wrapped):
    """vLLM's Scheduler with one cached free block's key dropped behind the
    pool's back after its `after`-th engine step (as a fault writing a block
    directly would), or the first later one that leaves such a block: one
    the step did not change, away from both ends of the free queue."""

    def __init__(self, real: Any, after: int, step_views: bool) -> None:
        super().__init__(real)
        self.after = after
        self.step_views = step_views
        self.updates = 0
        self.planted: tuple[int, int] | None = None  # (block, engine step)

    def update(self, *args: Any, **kwargs: Any) -> Any:
        finished = self.real.update(*args, **kwargs)
        self.updates += 1
        if self.updates >= self.after and self.planted is None:
            view = self.real._view
            pool = view._pool
            # The blocks changed since the step views last read them (with
            # the whole views every entry, nothing reads them: any will do).
            changed = view._changed if self.step_views else set()
            queue = view.free_queue_ids()
            inner = queue[len(changed) + 2 : len(queue) - len(changed) - 2]
            # The deepest from the head: the last the pool hands out again.
            for block_id in reversed(inner):
                block = pool.blocks[block_id]
                if block.block_hash is not None and block_id not in changed:
                    block.reset_hash()
                    self.planted = (block_id, self.updates)
                    break
        return finished


def _planted(trace: Trace, after: int, whole_view_every: int) -> tuple[ReplayResult, int, int]:
    """`trace` on vLLM's Scheduler, planted after engine step `after`, the
    model in lockstep: the result, the block and the step planted after."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert trace.scheduler is not None
    real = VllmScheduler(
        trace.config, spec_tokens=trace.scheduler.spec, max_num_seqs=trace.scheduler.max_num_seqs
    )
    planting = _Planting(real, after, step_views=whole_view_every > 1)
    try:
        result = replay_scheduler(
            trace, SchedulerModel, planting, "strict", whole_view_every=whole_view_every
        )
    finally:
        real.close()
    assert planting.planted is not None, "no block planted"
    return result, *planting.planted


def _engine_steps(trace: Trace) -> int:
    return sum(e.op == "step" for e in trace.engine)


@needs_vllm
def test_a_difference_no_step_touches_is_caught_by_the_whole_view_at_the_end(
    workload_trace: Trace,
) -> None:
    last = _engine_steps(workload_trace)
    result, block, after = _planted(workload_trace, last, whole_view_every=10**6)
    assert after == last
    failure = result.divergence
    assert failure is not None and failure.level == "strict", failure
    assert failure.what == f"engine step {last}: block {block} hashes"
    assert failure.actual == ()
    # Named with the window of entries it was caught in: here every one.
    assert "whole-view comparison" in failure.note
    assert f"after {last} engine entries, from engine step 1 at " in failure.note
    assert failure.note.endswith(
        f"to engine step {last} at {failure.step.where()} (the views agreed before them)"
    )


@needs_vllm
def test_the_window_a_difference_is_caught_in_is_named(workload_trace: Trace) -> None:
    every = 7
    result, block, after = _planted(workload_trace, _engine_steps(workload_trace) // 2, every)
    failure = result.divergence
    assert failure is not None and failure.level == "strict", failure
    assert failure.what.endswith(f"block {block} hashes")
    # Caught at the end of the window of `every` engine steps holding the
    # planted one (the workload's only compared entries are engine steps).
    caught = int(failure.what.split(":")[0].removeprefix("engine step "))
    assert caught % every == 0
    assert after <= caught < after + every
    assert f"after {every} engine entries, from engine step {caught - every + 1} at " in (
        failure.note
    )
    assert failure.note.endswith(
        f"to engine step {caught} at {failure.step.where()} (the views agreed before them)"
    )


@needs_vllm
def test_every_entry_whole_is_the_same_catch_at_the_step_itself(workload_trace: Trace) -> None:
    after = _engine_steps(workload_trace) // 2
    result, block, planted_after = _planted(workload_trace, after, whole_view_every=1)
    failure = result.divergence
    assert failure is not None
    assert failure.what == f"engine step {planted_after}: block {block} hashes"
    assert failure.note == ""
    assert result.steps_run == _entries_through(workload_trace, planted_after)


def _entries_through(trace: Trace, engine_step: int) -> int:
    """How many entries the trace runs up to its `engine_step`-th step."""
    steps = 0
    for count, event in enumerate(trace.engine, start=1):
        steps += event.op == "step"
        if steps == engine_step:
            return count
    raise AssertionError(f"no engine step {engine_step}")


def test_a_replay_keeps_none_of_the_model_s_manager_calls(workload_trace: Trace) -> None:
    seen: list[SchedulerModel] = []

    def model(*args: Any) -> SchedulerModel:
        seen.append(SchedulerModel(*args))
        return seen[-1]

    assert replay_scheduler(workload_trace, model, None, "strict").passed
    [built] = seen
    assert built.writer.steps == [] and built.writer.written > len(workload_trace.engine)
