"""The strict view's abstraction (kvgate.vocabulary.snapshot.EXCLUSIONS),
on its own and through the vLLM adapter's snapshot of the installed vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from configs import EXAMPLE_CONFIG, needs_vllm

from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.snapshot import (
    EXCLUSIONS,
    NULL_BLOCK,
    BlockView,
    Snapshot,
    kept_aside,
    null_view,
)

CONFIG = replace(EXAMPLE_CONFIG, num_blocks=64, hold=False)


def _snapshot(popped: dict[str, tuple[int, ...]], null_ref: int = 0) -> Snapshot:
    return Snapshot(
        free_queue=(2,),
        blocks=(BlockView(null_ref), BlockView(1, ("g0/k",)), BlockView(0)),
        tables={"A": ((1,), (0,))},
        holds={},
        pending_copies=(),
        popped=popped,
    )


def test_every_exclusion_is_explained() -> None:
    names = [e.name for e in EXCLUSIONS]
    assert len(set(names)) == len(names)
    for exclusion in EXCLUSIONS:
        assert exclusion.what and exclusion.why and "vLLM" in exclusion.releases


def test_the_helpers_drop_only_the_null_block() -> None:
    assert null_view(BlockView(-4, ())) == BlockView(0, ())
    # Keys on the null block stay visible: the invariants must see them.
    assert null_view(BlockView(-1, ("g0/x",))) == BlockView(0, ("g0/x",))
    assert kept_aside([3, NULL_BLOCK, NULL_BLOCK, 5, 4]) == (3, 5, 4)
    assert kept_aside([]) == ()


def test_differences_still_see_real_blocks() -> None:
    a = _snapshot({"A": (1,)})
    assert list(a.differences(_snapshot({"A": (1,)}))) == []
    # A popped list with only null entries kept nothing aside.
    assert list(_snapshot({}).differences(_snapshot({"A": ()}))) == []
    assert [d[0] for d in a.differences(_snapshot({"A": (2,)}))] == ["popped blocks"]
    # The snapshot compares the null block's ref when a target forgets the
    # view: the helper is what makes the exclusion, not a blind spot.
    assert [d[0] for d in a.differences(_snapshot({"A": (1,)}, null_ref=-1))] == ["block 0 ref"]


@pytest.fixture
def popped_target() -> Iterator[object]:
    from kvgate.impl.vllm_target import VllmTarget

    target = VllmTarget(CONFIG)
    steps = [
        Step(op="arrive", index=0, req="A", prompt=(Segment("fresh", count=100),)),
        Step(op="lookup", index=1, req="A"),
        Step(op="allocate", index=2, req="A", tokens=64, lookahead=3),
        Step(op="step", index=3),
        Step(op="drain", index=4),
        Step(op="allocate", index=5, req="A", tokens=32, lookahead=3),
        Step(op="pop", index=6, req="A"),
    ]
    for step in steps:
        target.apply(step)
    yield target
    target.close()


@needs_vllm
def test_the_adapter_builds_the_view(popped_target: object) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    assert isinstance(popped_target, VllmTarget)
    target = popped_target
    pool = target.manager.block_pool
    before = target.snapshot()
    assert before.popped["A"] and NULL_BLOCK not in before.popped["A"]
    # What a release that counts the null block's refs, and returns the
    # table's null entries from pop, leaves in its raw state.
    pool.null_block.ref_cnt -= 4
    target.popped["A"][1:1] = [pool.null_block, pool.null_block]
    try:
        after = target.snapshot()
        assert after.blocks[NULL_BLOCK].ref == 0
        assert after == before
        # ... and names what it hid, for the gate's report.
        assert target.exclusions_applied == {"null-block-ref", "null-block-kept-aside"}
        # A real block's count is still in the view.
        real = before.popped["A"][0]
        pool.blocks[real].ref_cnt += 1
        assert [d[0] for d in before.differences(target.snapshot())] == [f"block {real} ref"]
        pool.blocks[real].ref_cnt -= 1
    finally:
        pool.null_block.ref_cnt += 4
        del target.popped["A"][1:3]


def test_the_report_names_each_difference_once() -> None:
    from kvgate.conformance.report import difference_lines

    assert difference_lines({}) == []
    lines = difference_lines({"null-block-ref": ["t1", "t2"], "unknown": ["t3"]})
    assert lines[0].startswith("difference null-block-ref (2 traces, e.g. t1): not compared:")
    assert "0.32.0" in lines[1] and "not a bug" in lines[1]
    assert len(lines) == 3 and lines[2] == ""  # one difference, then a blank line


def test_a_known_difference_explains_only_its_exact_divergence() -> None:
    from pathlib import Path

    from kvgate.conformance.differences import explain
    from kvgate.conformance.replay import Divergence

    def divergence(index: int, actual: tuple[str, ...]) -> Divergence:
        return Divergence(
            trace="abort-mid-prefill",
            path=Path("abort-mid-prefill.yaml"),
            step=Step(op="allocate", index=index, req="B"),
            level="strict",
            what="block 17 hashes",
            expected=("g1/32:k",),
            actual=actual,
        )

    known = explain(divergence(15, ()))
    assert known is not None and known.name == "junction-eagle-peek"
    assert "bug" in known.verdict
    assert explain(divergence(14, ())) is None  # another step
    assert explain(divergence(15, ("g1/64:x",))) is None  # not a missing key


@needs_vllm
def test_a_free_queue_that_loops_back_is_read_to_its_first_repeat(popped_target: object) -> None:
    """A faulty free that queues a block twice links the free list into a
    loop: the view lists the queue up to the first block seen again, once
    more, instead of walking (and allocating) for ever."""
    from kvgate.impl.vllm_target import VllmTarget

    assert isinstance(popped_target, VllmTarget)
    queue = popped_target.manager.block_pool.free_block_queue
    first = queue.fake_free_list_head.next_free_block
    second = first.next_free_block
    third = second.next_free_block
    second.next_free_block = first  # the loop: first -> second -> first
    try:
        ids = popped_target.snapshot().free_queue
    finally:
        second.next_free_block = third
    assert ids == (first.block_id, second.block_id, first.block_id)
