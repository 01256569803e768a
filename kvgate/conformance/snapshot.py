"""The strict-level view of a manager, the same shape for every target."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockView:
    ref: int
    # Hash keys as `g<group>/<prefix key>`: the primary first, then the
    # secondary ones in sorted order.
    hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """Everything strict comparison reads after a step.

    Block ids are compared as they are: a faithful model hands out the same
    ids as the real pool. Requests whose tables are empty in every group are
    left out (an empty table is bookkeeping, not state).
    """

    free_queue: tuple[int, ...]
    blocks: tuple[BlockView, ...]  # index = block id; 0 is the null block
    tables: Mapping[str, tuple[tuple[int, ...], ...]]  # req -> per group ids
    holds: Mapping[str, Mapping[int, tuple[int, int]]]  # req -> group -> (pos, id)
    pending_copies: tuple[tuple[int, int, int], ...]  # (group, src id, dst id)
    popped: Mapping[str, tuple[int, ...]]  # req -> ids kept aside by `pop`

    def differences(self, other: Snapshot) -> Iterator[tuple[str, object, object]]:
        """(what, this side's value, the other's), first difference first."""
        if self.free_queue != other.free_queue:
            yield "free queue", self.free_queue, other.free_queue
        for i, (a, b) in enumerate(zip(self.blocks, other.blocks, strict=False)):
            if a.ref != b.ref:
                yield f"block {i} ref", a.ref, b.ref
            if a.hashes != b.hashes:
                yield f"block {i} hashes", a.hashes, b.hashes
        if len(self.blocks) != len(other.blocks):
            yield "pool size", len(self.blocks), len(other.blocks)
        for req in sorted(set(self.tables) | set(other.tables)):
            a_t, b_t = self.tables.get(req), other.tables.get(req)
            if a_t != b_t:
                yield f"{req} block table", a_t, b_t
        if _plain(self.holds) != _plain(other.holds):
            yield "holds", _plain(self.holds), _plain(other.holds)
        if self.pending_copies != other.pending_copies:
            yield "pending copies", self.pending_copies, other.pending_copies
        if dict(self.popped) != dict(other.popped):
            yield "popped blocks", dict(self.popped), dict(other.popped)


def _plain(
    holds: Mapping[str, Mapping[int, tuple[int, int]]],
) -> dict[str, dict[int, tuple[int, int]]]:
    return {r: dict(g) for r, g in holds.items() if g}
