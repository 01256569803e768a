"""The strict-level view of a manager, the same shape for every target.

A `Snapshot` is an abstraction, not a dump: it holds the state a manager
maintains *and* a user of it can observe (through what later calls return:
hits, admission counts, copies, which block a request gets next), read
through the same names for every target. Raw state that no call ever reads
back is left out, each exclusion named in `EXCLUSIONS` with the reason and
the releases whose raw state differs there; a target's `snapshot()` builds
its view with the helpers below (`null_view`, `kept_aside`), so one rule
applies to every target. docs/trace-format.md ("The strict view") lists the
same exclusions for trace authors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

# Block 0 of every pool: the null block, a placeholder in block tables for
# positions a request holds no state at. It is never queued, never hashed,
# never handed out.
NULL_BLOCK = 0


class BlockView(NamedTuple):
    """One block as the strict view shows it (a tuple, so a whole pool's
    views compare at C speed)."""

    ref: int
    # Hash keys as `g<group>/<prefix key>`: the primary first, then the
    # secondary ones in sorted order.
    hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exclusion:
    """Raw manager state the strict view leaves out, and why that is sound."""

    name: str
    what: str  # the raw state left out
    why: str  # why no caller can observe it
    releases: str  # whose raw state differs there (what makes it needed)


EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(
        name="null-block-ref",
        what="the null block's ref count (the view shows 0)",
        why="the null block is never queued, evicted or handed out, and no manager path "
        "reads its count: freeing it changes nothing a caller can see",
        releases="vLLM 0.32.0 decrements it on every free of a table holding it (it goes "
        "negative); 0.33.0 and 0.34.0 skip the null block in free_blocks",
    ),
    Exclusion(
        name="null-block-kept-aside",
        what="null-block entries in the list pop_blocks_for_free returns (the view keeps "
        "the real blocks, in order)",
        why="the caller only hands the list back to free_blocks, where a null entry is a "
        "no-op (see null-block-ref); the real blocks and their release order are kept",
        releases="vLLM 0.32.0 returns a table's leading null blocks too; 0.33.0 and "
        "0.34.0 trim them",
    ),
)


def null_view(view: BlockView) -> BlockView:
    """The null block as the view shows it (`null-block-ref`): its keys (it
    must carry none; the invariants check that) without its ref count."""
    return view if view.ref == 0 else BlockView(0, view.hashes)


def kept_aside(ids: Iterable[int]) -> tuple[int, ...]:
    """A popped list as the view shows it (`null-block-kept-aside`)."""
    return tuple(i for i in ids if i != NULL_BLOCK)


@dataclass(frozen=True)
class Snapshot:
    """Everything strict comparison reads after a step.

    Block ids are compared as they are: a faithful model hands out the same
    ids as the real pool. Requests whose tables are empty in every group are
    left out (an empty table is bookkeeping, not state). Built through
    `null_view` and `kept_aside` (see `EXCLUSIONS`).
    """

    free_queue: tuple[int, ...]
    blocks: tuple[BlockView, ...]  # index = block id; 0 is the null block
    tables: Mapping[str, tuple[tuple[int, ...], ...]]  # req -> per group ids
    holds: Mapping[str, Mapping[int, tuple[int, int]]]  # req -> group -> (pos, id)
    pending_copies: tuple[tuple[int, int, int], ...]  # (group, src id, dst id)
    popped: Mapping[str, tuple[int, ...]]  # req -> non-null ids kept aside by `pop`

    def differences(self, other: Snapshot) -> Iterator[tuple[str, object, object]]:
        """(what, this side's value, the other's), first difference first."""
        if self.free_queue != other.free_queue:
            yield "free queue", self.free_queue, other.free_queue
        blocks = () if self.blocks == other.blocks else zip(self.blocks, other.blocks, strict=False)
        for i, (a, b) in enumerate(blocks):
            if a == b:
                continue
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
        if _plain_popped(self.popped) != _plain_popped(other.popped):
            yield "popped blocks", dict(self.popped), dict(other.popped)


def _plain(
    holds: Mapping[str, Mapping[int, tuple[int, int]]],
) -> dict[str, dict[int, tuple[int, int]]]:
    return {r: dict(g) for r, g in holds.items() if g}


def _plain_popped(popped: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    # A request whose popped list held only null blocks kept nothing aside.
    return {r: ids for r, ids in popped.items() if ids}


# How many block table entries, from each table's end, a step's view reads
# beyond the blocks the step changed: a step appends to a table's end, and
# what it changes elsewhere in a table shows as a changed block's ref count.
TABLE_TAIL = 4


@dataclass(frozen=True)
class StepView:
    """The strict view restricted to what one step touched.

    A step changes a few blocks of a large pool: this view reads those
    blocks (`blocks`, by id), the ends of the free queue as long as the
    changed blocks could reach (`free_head`, `free_tail`: a freed block
    joins the queue at one end) and its length, the touched requests' block
    tables (each group's length and last entries) and popped lists, and the
    holds and pending copies whole (a few entries per request). Built through
    `null_view` and `kept_aside`, as `Snapshot` is. A state the step left
    alone is compared by the whole view, which a lockstep reads at intervals
    (see `kvgate.conformance.replay`).
    """

    blocks: Mapping[int, BlockView]
    num_free: int
    free_head: tuple[int, ...]
    free_tail: tuple[int, ...]
    # req -> per group (table length, its last entries); None: no table.
    tables: Mapping[str, tuple[tuple[int, tuple[int, ...]], ...] | None]
    holds: Mapping[str, Mapping[int, tuple[int, int]]]
    pending_copies: tuple[tuple[int, int, int], ...]
    popped: Mapping[str, tuple[int, ...] | None]

    def differences(self, other: StepView) -> Iterator[tuple[str, object, object]]:
        """(what, this side's value, the other's), named as `Snapshot.differences`
        names them, in its order."""
        if (self.num_free, self.free_head, self.free_tail) != (
            other.num_free,
            other.free_head,
            other.free_tail,
        ):
            yield (
                "free queue",
                _queue_ends(self.num_free, self.free_head, self.free_tail),
                _queue_ends(other.num_free, other.free_head, other.free_tail),
            )
        for i in sorted(self.blocks.keys() | other.blocks.keys()):
            a, b = self.blocks.get(i), other.blocks.get(i)
            if a is None or b is None:
                yield "pool size", f"block {i}", "no such block"
                continue
            if a.ref != b.ref:
                yield f"block {i} ref", a.ref, b.ref
            if a.hashes != b.hashes:
                yield f"block {i} hashes", a.hashes, b.hashes
        for req in sorted(self.tables.keys() | other.tables.keys()):
            a_t, b_t = self.tables.get(req), other.tables.get(req)
            if a_t != b_t:
                yield f"{req} block table (length and last entries per group)", a_t, b_t
        if _plain(self.holds) != _plain(other.holds):
            yield "holds", _plain(self.holds), _plain(other.holds)
        if self.pending_copies != other.pending_copies:
            yield "pending copies", self.pending_copies, other.pending_copies
        for req in sorted(self.popped.keys() | other.popped.keys()):
            a_p, b_p = self.popped.get(req) or None, other.popped.get(req) or None
            if a_p != b_p:
                yield "popped blocks", {req: a_p}, {req: b_p}


def tail_length(changed: int) -> int:
    """How many of each table's last entries a `StepView` reads, for a step
    that changed `changed` blocks."""
    return TABLE_TAIL + changed


def table_ends(
    per_group: Iterable[tuple[int, tuple[int, ...]]],
) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """A request's tables as a `StepView` shows them, from each group's
    (length, last `tail_length` entries); None when every table is empty."""
    ends = tuple(per_group)
    for n, _ in ends:
        if n:
            return ends
    return None


def _queue_ends(num_free: int, head: tuple[int, ...], tail: tuple[int, ...]) -> str:
    return f"{num_free} free; head {list(head)}; tail {list(tail)}"
