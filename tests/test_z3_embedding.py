"""Bounded steps are unbounded steps: the two Z3 encodings agree.

The drift test maps each model step onto the bounded encoding; here those
bounded steps (every field, ghosts as the bounded transition chose them)
are embedded in a finite instance of the unbounded encoding's sorts, and
the op's unbounded transition must relate them (`embedding.py`). With the
drift test, model -> bounded -> unbounded: a proof for every pool size is
about the machine the gate replays.

The default run checks one request life that exercises the hold: a
producer, then a request resuming at its partial tail (a copy-on-write
copy, the source held), its tail moved by a decode, then popped and
released; the allocations and the decode that move blocks, and each other
op once. `KVGATE_FULL_PROOFS=1` checks every step of that run and of drawn
runs (minutes).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import test_z3_drift as drift
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.invariants.z3.embedding import admits_embedded
from kvgate.invariants.z3.hooks import HOOK_NAMES, Hooks
from kvgate.invariants.z3.transitions import ENCODED_OPS, MUTATIONS, Encoding
from kvgate.invariants.z3.unbounded_transitions import UEncoding
from kvgate.model import mutations as model_mutations
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Segment, Step

FULL = os.environ.get("KVGATE_FULL_PROOFS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="set KVGATE_FULL_PROOFS=1 (minutes)")


def test_both_encodings_implement_every_hook_and_op() -> None:
    assert issubclass(Encoding, Hooks) and issubclass(UEncoding, Hooks)
    ops = sorted(name.removeprefix("op_") for name in HOOK_NAMES if name.startswith("op_"))
    assert ops == sorted(ENCODED_OPS)
    for mutation in MUTATIONS:
        assert set(model_mutations.MUTATIONS[mutation].breaks) <= set(HOOK_NAMES), mutation
    for encoding in (Encoding, UEncoding):
        assert not getattr(encoding, "__abstractmethods__", None), encoding


def hold_life(config: Config) -> drift.Run:
    """A producer's life, then a request resuming at its partial tail, a
    decode moving that request's tail, then `pop` and `release`."""
    run = drift.Run(config, in_hypothesis=False, requests=2)
    drift.produce(run, "R0", (Segment("fresh", count=40),), decodes=1)
    run.apply(Step("free", 0, req="R0", how="finish"))
    drift.produce(run, "R1", (Segment("prompt_of", req="R0"), Segment("fresh", count=9)), 1)
    run.apply(Step("pop", 0, req="R1"))
    run.apply(Step("release", 0, req="R1"))
    return run


HOLD_CONFIG = replace(drift.witness_config(retention_interval=0, hold=True), num_blocks=8)


def not_admitted(run: drift.Run, steps: list[drift.AbstractStep]) -> list[str]:
    return [
        f"step {i} ({s.op})"
        for i, s in enumerate(steps)
        if admits_embedded(run.bounds, s.op, s.r, s.pre, s.post) != z3.sat
    ]


def test_a_hold_life_is_a_run_of_the_unbounded_encoding() -> None:
    run = hold_life(HOLD_CONFIG)
    assert {"a copy is pending", "a request holds a block", "a tail moved"} <= run.seen
    steps = run.abstract_steps
    # R1's first allocation (it adopts R0's partial tail: a copy, a hold)
    # and its decode (the tail moves), then one step of every other op.
    resumed = [s for s in steps if s.r == 1 and s.op in ("allocate", "decode1")]
    chosen = [resumed[0], next(s for s in resumed if s.op == "decode1")]
    for op in sorted({s.op for s in steps} - {"allocate", "decode1"}):
        chosen.append(next(s for s in steps if s.op == op))
    assert not not_admitted(run, chosen)


@full_only
def test_every_step_of_a_hold_life_is_unbounded() -> None:
    run = hold_life(HOLD_CONFIG)
    assert not not_admitted(run, run.abstract_steps)


@full_only
@settings(drift.DRIFT, max_examples=10)
@given(config=drift.configs(), data=st.data())
def test_drawn_runs_are_unbounded(config: Config, data: st.DataObject) -> None:
    run = drift.Run(config, in_hypothesis=False, requests=2)
    names = [f"R{i}" for i in range(2)]
    for i, name in enumerate(names):
        prompt: tuple[Segment, ...] = (Segment("fresh", count=data.draw(st.integers(1, 40))),)
        if i and data.draw(st.booleans()):
            prompt = (Segment("prompt_of", req=names[0]), *prompt)
        drift.produce(run, name, prompt, data.draw(st.integers(0, 2)))
        if data.draw(st.booleans()):
            run.apply(
                Step("free", 0, req=name, how=data.draw(st.sampled_from(["finish", "abort"])))
            )
    assert not not_admitted(run, run.abstract_steps)
