"""How two sides' observations and states are compared: one set of rules for
the replayer and for exploration's lockstep.

- Values are equal when `same` says so: lists equal tuples, but `true` is
  not `1`.
- An op's reported values are compared key by key, the op's own `expect`
  keys first (so the first difference named is what its callers see), the
  rest in name order. `prompt_done` is never compared as a value: it is the
  replayer's signal that a prefill's loop ends, not something a manager's
  caller sees (the replayer checks it where it ends a loop).
- A `holds` value leaves out the requests that hold nothing.
- Snapshots compare through `Snapshot.differences`, first difference first;
  the views of what one step touched through `StepView.differences`.
- One manager-level step in lockstep (`step_difference`): the reported
  values first (level api), then, at level strict, the two views; the gate's
  replay and exploration's lockstep both judge a step by it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from kvgate.vocabulary.ops import ACTIONS
from kvgate.vocabulary.snapshot import Snapshot, StepView

PROMPT_DONE = "prompt_done"


class _NotReported:
    """Stands for a value an observation lacks."""

    def __repr__(self) -> str:
        return "(not reported)"


NOT_REPORTED: Any = _NotReported()

# (what differs, the reference side's value, the compared side's value)
Difference = tuple[str, object, object]


def same(a: object, b: object) -> bool:
    """Equality of observed values: lists equal tuples, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def holding(holds: object) -> object:
    """A holds map without the requests that hold nothing."""
    if not isinstance(holds, Mapping):
        return holds
    return {req: dict(groups) for req, groups in holds.items() if groups}


def same_check(key: str, want: object, got: object) -> bool:
    """Equality of a `check` key's values."""
    if key == "holds":
        want, got = holding(want), holding(got)
    return same(want, got)


def compared_keys(op: str, *observations: Mapping[str, Any]) -> list[str]:
    """The keys either side reported, the op's own first; never `prompt_done`."""
    reported = {k for o in observations for k in o} - {PROMPT_DONE}
    own = [k for k in ACTIONS[op].expect_keys if k in reported]
    return own + sorted(reported - set(own))


def observation_difference(
    op: str, reference: Mapping[str, Any], other: Mapping[str, Any]
) -> Difference | None:
    """The first reported value on which the two sides differ, if any."""
    for key in compared_keys(op, reference, other):
        want, got = reference.get(key, NOT_REPORTED), other.get(key, NOT_REPORTED)
        if not same(want, got):
            return key, want, got
    return None


def snapshot_difference(reference: Snapshot, other: Snapshot) -> Difference | None:
    """The first difference between two strict views, if any."""
    return next(iter(reference.differences(other)), None)


def step_view_difference(reference: StepView, other: StepView) -> Difference | None:
    """The first difference between two sides' views of what one step touched."""
    return next(iter(reference.differences(other)), None)


def step_difference(
    op: str,
    modeled: Mapping[str, Any],
    observed: Mapping[str, Any],
    views: tuple[Callable[[], Snapshot], Callable[[], Snapshot]] | None,
) -> tuple[Literal["api", "strict"], Difference] | None:
    """Where a lockstep target first differs from the model in one
    manager-level step: its reported values (`api`), then, when `views`
    (the model's and the target's, read only if the values agree) are
    given, its whole state (`strict`)."""
    difference = observation_difference(op, modeled, observed)
    if difference is not None:
        return "api", difference
    if views is None:
        return None
    model_view, target_view = views
    difference = snapshot_difference(model_view(), target_view())
    return None if difference is None else ("strict", difference)
