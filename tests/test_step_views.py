"""Strict lockstep a step at a time: each step compares the views of what it
touched (`StepView`), the whole views are compared at intervals and after the
last step, so a difference in a block no step touches is still caught, named
with the window of steps it was caught in."""

from __future__ import annotations

from contextlib import closing
from typing import Any

from configs import needs_vllm

from kvgate.conformance.replay import ReplayResult, replay
from kvgate.conformance.trace import Trace, bundled_corpus, load_trace
from kvgate.model import ModelTarget
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import BlockView, Snapshot, StepView
from kvgate.vocabulary.target import Target, WatchedTarget

TRACE = "shared-prefix-concurrent.yaml"


def _step_view(**changes: Any) -> StepView:
    fields: dict[str, Any] = {
        "blocks": {3: BlockView(1, ("g0/k",)), 4: BlockView(0)},
        "num_free": 10,
        "free_head": (4, 5),
        "free_tail": (8, 9),
        "tables": {"A": ((2, (3, 6)), (1, (7,)))},
        "holds": {},
        "pending_copies": (),
        "popped": {"A": None},
    }
    return StepView(**{**fields, **changes})


def test_a_step_view_names_what_differs_as_the_whole_view_does() -> None:
    base = _step_view()
    assert list(base.differences(_step_view())) == []
    changed = _step_view(blocks={3: BlockView(2, ("g0/k",)), 4: BlockView(0, ("g0/x",))})
    assert [d[0] for d in base.differences(changed)] == ["block 3 ref", "block 4 hashes"]
    assert [d[0] for d in base.differences(_step_view(free_tail=(9, 8)))] == ["free queue"]
    moved = _step_view(tables={"A": ((2, (3, 5)), (1, (7,)))})
    assert [d[0] for d in base.differences(moved)][0].startswith("A block table")
    # A request holding nothing shows as holding nothing, either way.
    assert list(base.differences(_step_view(holds={"A": {}}))) == []
    assert [d[0] for d in base.differences(_step_view(popped={"A": (3,)}))] == ["popped blocks"]


def _trace() -> Trace:
    return load_trace(bundled_corpus() / TRACE)


def test_the_model_shows_the_blocks_each_step_changed() -> None:
    """A step view over the blocks the model reports changed agrees with its
    whole view on every one of them."""
    trace = _trace()
    seen: list[int] = []

    def after(step: Step, target: Target) -> None:
        assert isinstance(target, ModelTarget)
        changed = target.take_changed_blocks()
        view = target.step_view(changed, [step.req] if step.req else [])
        whole: Snapshot = target.snapshot()
        assert view.num_free == len(whole.free_queue)
        assert view.free_head == whole.free_queue[: len(changed) + 1]
        for block_id, block in view.blocks.items():
            assert whole.blocks[block_id] == block
        seen.append(len(changed))

    with closing(WatchedTarget(ModelTarget(trace.config), after)) as target:
        assert replay(trace, target, None, "api").passed
    assert seen[0] == trace.config.num_blocks  # every block, at first
    assert max(seen[1:]) < trace.config.num_blocks


def _planted(plant_after: int, whole_view_every: int) -> tuple[ReplayResult, int, int]:
    """The trace replayed on vLLM, the model in lockstep, one free block's
    key dropped behind the pool's back after the `plant_after`-th op (as a
    fault writing a block directly would), or after the first later op that
    leaves such a block: one that op did not change, deep in the free queue.
    Returns the result, the block and the op it was planted after."""
    from kvgate.impl.vllm_target import VllmTarget

    trace = _trace()
    ops = 0
    planted: list[int] = []

    def after(step: Step, target: Target) -> None:
        nonlocal ops
        ops += 1
        if ops < plant_after or planted:
            return
        assert isinstance(target, VllmTarget)
        pool = target.manager.block_pool
        queue = target._view.free_queue_ids()
        # The blocks changed since the step views last read them (with the
        # whole view every step, nothing reads them: any block will do).
        changed = target._view._changed if whole_view_every > 1 else set()
        # Away from both ends of the queue, which a step view reads.
        inner = queue[len(changed) + 2 : len(queue) - len(changed) - 2]
        block = next(
            (
                pool.blocks[i]
                for i in inner
                if pool.blocks[i].block_hash is not None and i not in changed
            ),
            None,
        )
        if block is not None:  # else at the first later op with one
            block.reset_hash()
            planted.append(block.block_id)
            planted.append(ops)

    with closing(WatchedTarget(VllmTarget(trace.config), after)) as target:
        result = replay(trace, target, ModelTarget, "strict", whole_view_every=whole_view_every)
    assert planted, "no block planted"
    return result, planted[0], planted[1]


def _last_op() -> int:
    trace = _trace()
    ops = 0

    def count(step: Step, target: Target) -> None:
        nonlocal ops
        ops += 1

    with closing(WatchedTarget(ModelTarget(trace.config), count)) as target:
        assert replay(trace, target, None, "api").passed
    return ops


@needs_vllm
def test_a_difference_no_step_touches_is_caught_by_the_whole_view_at_the_end() -> None:
    last = _last_op()
    result, block, ops = _planted(last, whole_view_every=10**6)
    assert ops == last
    failure = result.divergence
    assert failure is not None and failure.level == "strict"
    assert failure.what == f"block {block} hashes"
    assert failure.actual == ()
    # Named with the window of steps it was caught in: here every step.
    assert "whole-view comparison" in failure.note
    assert f"after {ops} steps" in failure.note
    assert "from step 0 (arrive)" in failure.note


@needs_vllm
def test_the_window_a_difference_is_caught_in_is_named() -> None:
    every = 5
    result, block, planted_after = _planted(12, whole_view_every=every)
    failure = result.divergence
    assert failure is not None and failure.level == "strict"
    assert failure.what == f"block {block} hashes"
    # Caught at the end of the window of `every` ops holding the planted one.
    assert f"after {every} steps" in failure.note
    assert failure.note.endswith(f"to {failure.step.where()} (the views agreed before them)")
    caught_after = result.steps_run - sum(1 for f in result.failures if f.level == "expect")
    assert planted_after <= caught_after < planted_after + every


@needs_vllm
def test_every_step_whole_is_the_same_catch_at_the_step_itself() -> None:
    result, block, planted_after = _planted(12, whole_view_every=1)
    failure = result.divergence
    assert failure is not None and failure.what == f"block {block} hashes"
    assert failure.note == ""
    assert result.steps_run == planted_after
