"""The two macros of trace format version 1, expanded here and nowhere else.

`decode {req, steps, spec}` is `steps` times decode1, step, drain: known
from the trace alone, so `expand` unrolls it when a trace is loaded.

`prefill {req, lookahead}` is a lookup, then allocate (tokens auto), step,
drain until the target reports the prompt computed: how many rounds depends
on the target's chunk split, so `prefill_steps` is a generator the replayer
runs while it replays, telling it after each allocate whether the prompt is
done. The macro's `expect.hit` applies to its lookup.
"""

from __future__ import annotations

from collections.abc import Generator
from itertools import count
from operator import attrgetter

from kvgate.vocabulary.ops import Step


def expand(step: Step) -> tuple[Step, ...]:
    """The primitives a written step stands for, as far as known before replay.

    A `decode` is unrolled; a `prefill` stays whole (see `prefill_steps`);
    every other op is itself.
    """
    if step.op != "decode":
        return (step,)
    expanded: list[Step] = []
    for k in range(step.steps):
        expanded += [
            Step("decode1", step.index, 3 * k + 1, "decode", req=step.req, spec=step.spec),
            Step("step", step.index, 3 * k + 2, "decode"),
            Step("drain", step.index, 3 * k + 3, "decode"),
        ]
    return tuple(expanded)


def expand_all(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """Every step's primitives (`expand`), in order: `steps` itself when
    none is a `decode` (a long trace's usual case, then no copy is made)."""
    if "decode" not in map(_OP, steps):
        return steps
    return tuple(p for s in steps for p in expand(s))


_OP = attrgetter("op")


def prefill_steps(prefill: Step) -> Generator[Step, bool | None, None]:
    """A prefill's primitives, in order. After yielding an `allocate`, it
    expects `send(done)`: whether that allocation finished the prompt."""
    yield prefill_lookup(prefill)
    for round_no in count(1):
        allocate, step, drain = prefill_round(prefill, round_no)
        done = yield allocate
        yield step
        yield drain
        if done:
            return


def prefill_lookup(prefill: Step) -> Step:
    """The `lookup` a prefill starts with; the macro's `expect.hit` applies to it."""
    return Step(
        "lookup",
        prefill.index,
        1,
        "prefill",
        req=prefill.req,
        remote_hit=prefill.remote_hit,
        remote_async=prefill.remote_async,
        load_failed=prefill.load_failed,
        expect=dict(prefill.expect),
    )


def prefill_round(prefill: Step, round_no: int) -> tuple[Step, Step, Step]:
    """Round `round_no` (from 1) of a prefill's loop: allocate auto, step, drain."""
    part = 3 * round_no - 1  # part 1 is the lookup
    return (
        Step(
            "allocate",
            prefill.index,
            part,
            "prefill",
            req=prefill.req,
            tokens="auto",
            lookahead=prefill.lookahead,
        ),
        Step("step", prefill.index, part + 1, "prefill"),
        Step("drain", prefill.index, part + 2, "prefill"),
    )
