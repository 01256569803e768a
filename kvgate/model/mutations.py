"""Named, deliberate bugs in the model, applied only inside `mutated(name)`.

A proof that no mutation can break proves nothing, so each mutation here
also names the hooks of the Z3 encodings it breaks (`breaks`: both the
bounded `kvgate.invariants.z3.transitions.Encoding` and the unbounded
`unbounded_transitions.UEncoding` write each hook's broken form beside its
clean one):
the proof of the invariant it targets must fail, and the counterexample,
written as a trace, must fail on the mutated model too.

The model's own classes stay clean: a mutation patches one method (a
wrapper where it can be, so the model's code is not copied) for the duration
of the `with` block, and restores it however the block ends. Patches are
process-wide while active: run mutated models one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvgate.model.groups import GroupManager
from kvgate.model.hold import Holds
from kvgate.model.pool import Block, BlockPool
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.ops import Step

Patch = tuple[type, str, Callable[..., Any]]  # (class, method name, replacement)


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug, recorded once: the model's patch and the Z3
    encodings' hooks it breaks."""

    name: str
    doc: str
    patches: Callable[[], list[Patch]]
    # The Z3 encodings' hooks (methods of both encodings, same names) that
    # take their broken form under this mutation.
    breaks: tuple[str, ...]
    # The invariant (kvgate.invariants.catalogue) the bug is meant to break.
    target: str
    # Whether it is upstream vLLM 0.33.0's own behaviour: its counterexample
    # then fails on the installed vLLM the same way.
    upstream: bool = False


def _hold_off() -> list[Patch]:
    init = Holds.__init__

    def __init__(self: Holds, pool: BlockPool, enabled: bool, retain_retired: bool = False) -> None:
        init(self, pool, enabled, retain_retired)
        self.enabled = False  # whatever the switch says: upstream 0.33.0

    return [(Holds, "__init__", __init__)]


def _no_admission_extra() -> list[Patch]:
    def admission_extra(self: Holds, *args: Any, **kwargs: Any) -> int:
        return 0

    return [(Holds, "admission_extra", admission_extra)]


def _abort_keeps_hold() -> list[Patch]:
    op_free = ModelTarget._op_free

    def _op_free(self: ModelTarget, step: Step) -> dict[str, Any]:
        if step.how == "abort" and step.req in self.requests:
            # Forget the holds without releasing their refs.
            self.manager.coordinator.holds.release(step.req)
        return op_free(self, step)

    return [(ModelTarget, "_op_free", _op_free)]


def _cow_copy_unreferenced() -> list[Patch]:
    apply_cow = GroupManager.apply_cow

    def apply_cow_(
        self: GroupManager, request_id: str, index: int, source: Block, copy: Block
    ) -> None:
        apply_cow(self, request_id, index, source, copy)
        self.pool.free_blocks([copy])  # undo the pending copy's ref

    return [(GroupManager, "apply_cow", apply_cow_)]


def _touch_keeps_queued() -> list[Patch]:
    def touch(self: BlockPool, blocks: Any) -> None:
        for block in blocks:
            if not block.is_null:
                block.ref += 1  # a ref-0 block stays in the free queue
                self.changed.add(block.block_id)

    return [(BlockPool, "touch", touch)]


def superseded_holds(holds: Holds) -> dict[tuple[int, str], list[Block]]:
    """The holds `superseded_hold_kept` keeps besides the hold map, by
    (group, request): a second hold has no place in the map, so whoever
    reads holds (the Z3 abstraction) reads these too. Empty otherwise."""
    found: dict[tuple[int, str], list[Block]] = holds.__dict__.setdefault("_superseded", {})
    return found


def _superseded_hold_kept() -> list[Patch]:
    hold, release = Holds.hold, Holds.release

    def hold_(self: Holds, group_id: int, request_id: str, block: Block) -> bool:
        current = self.held(group_id, request_id)
        took = hold(self, group_id, request_id, block)
        if took and current is not None:
            self.pool.touch([current.block])  # the superseded hold keeps its ref
            superseded_holds(self).setdefault((group_id, request_id), []).append(current.block)
        return took

    def release_(self: Holds, request_id: str) -> list[Block]:
        kept = superseded_holds(self)
        extra = [b for key in sorted(kept) if key[1] == request_id for b in kept.pop(key)]
        return release(self, request_id) + extra

    return [(Holds, "hold", hold_), (Holds, "release", release_)]


def _no_follow() -> list[Patch]:
    def follow_moved_keys(
        self: Holds, group_id: int, owner: str, source: Block, copy: Block
    ) -> None:
        return None

    return [(Holds, "follow_moved_keys", follow_moved_keys)]


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation(
            "hold_off",
            "the hold never acts although the switch is on",
            _hold_off,
            ("hold_enabled", "admission_extra"),
            target="no_total_miss",
            upstream=True,
        ),
        Mutation(
            "no_admission_extra",
            "admission forgets the +1 for a partial-tail hit",
            _no_admission_extra,
            ("admission_extra",),
            target="reservation_covers_tail_swap",
            upstream=True,
        ),
        Mutation(
            "abort_keeps_hold",
            "free(abort) forgets the request's holds without releasing them",
            _abort_keeps_hold,
            ("release_holds",),
            target="no_leak",
        ),
        Mutation(
            "cow_copy_unreferenced",
            "apply_cow forgets the pending copy's ref on the private copy",
            _cow_copy_unreferenced,
            ("cow_retain",),
            target="no_leak",
        ),
        Mutation(
            "touch_keeps_queued",
            "touch adopts a ref-0 block without taking it out of the free queue",
            _touch_keeps_queued,
            ("touch",),
            target="free_queue_exact",
        ),
        Mutation(
            "superseded_hold_kept",
            "a newer hold does not release the one it supersedes",
            _superseded_hold_kept,
            ("supersede",),
            target="one_hold",
        ),
        Mutation(
            "no_follow",
            "holds stay on a producer's block when its keys move",
            _no_follow,
            ("follows",),
            target="held_state_keyed",
        ),
    )
}


@contextmanager
def mutated(name: str) -> Iterator[None]:
    """The model with mutation `name` applied, until the block ends."""
    patches = MUTATIONS[name].patches()
    # A method inherited from a base class is patched on the subclass and
    # deleted again afterwards (`_MISSING`), not copied onto it.
    saved = [(owner, attr, owner.__dict__.get(attr, _MISSING)) for owner, attr, _ in patches]
    try:
        for owner, attr, replacement in patches:
            setattr(owner, attr, replacement)
        yield
    finally:
        for owner, attr, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


_MISSING = object()
