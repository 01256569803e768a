"""kvgate's scheduler model (`model/scheduler.py`) on its own: its one
admission gate, and why exploration applies it differently."""

from __future__ import annotations

import dataclasses

import pytest
from configs import EXAMPLE_CONFIG

from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import admission_fits
from kvgate.vocabulary.config import GroupConfig
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.scheduling import Arrival

# A's first chunk leaves room for B's first chunk, not for B's whole prompt.
CONFIG = dataclasses.replace(
    EXAMPLE_CONFIG,
    num_blocks=40,
    max_num_scheduled_tokens=64,
    hold=False,
    groups=(
        GroupConfig(kind="full_attention", block_size=8),
        GroupConfig(kind="mamba_align", block_size=32, speculative_blocks=2),
    ),
)


@pytest.mark.parametrize("gate_in_allocation", [False, True])
def test_the_admission_gate_refuses_what_the_allocation_would(gate_in_allocation: bool) -> None:
    """The scheduler model checks the full-sequence gate before admitting,
    so its traces never hold a refused admission's `allocate`, and carry the
    gate even on a config that leaves it out of `allocate` (vLLM's Scheduler
    has it on by default). Exploration instead lets the `allocate` refuse
    under `reserve_full_sequence`, to reach the manager's own refusal: that
    is the same decision, which this test shows; without the setting the
    `allocate` alone would admit (the chunk fits), so only the check gates."""
    config = dataclasses.replace(CONFIG, reserve_full_sequence=gate_in_allocation)
    model = SchedulerModel(config, spec=2, max_num_seqs=4)
    model.arrive(Arrival("A", (Segment("fresh", count=100),), max_tokens=20))
    while "A" not in model.step().sampled or not model.running[0].decoding:
        pass
    model.arrive(Arrival("B", (Segment("prompt_of", req="A"), Segment("fresh", count=150)), 4))
    decisions = model.step()
    assert [name for name, _ in decisions.scheduled] == ["A"]
    reserve = [s for s in model.writer.steps if s.op == "reserve"][-1]
    assert reserve.req == "B"
    need = reserve.expect["blocks"]
    free = model.oracle.num_free_blocks()
    assert not admission_fits(need, free)
    # No allocate of B was written: the check refused it first.
    assert not [s for s in model.writer.steps if s.op == "allocate" and s.req == "B"]
    model.writer.run("lookup", req="B")
    result = model.oracle.apply(Step("allocate", 0, req="B", tokens="auto", lookahead=2))
    assert result["ok"] is not gate_in_allocation
