"""The manager's invariants as predicates over a strict snapshot.

A snapshot is the same shape for every target, so these predicates check the
model and the real vLLM manager alike. Each returns the violations it found,
each naming the block or request that broke it; an empty list means it
holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.conformance.snapshot import Snapshot
from kvgate.conformance.tokens import key_position


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


def references(snapshot: Snapshot) -> Counter[int]:
    """Every reference the bookkeeping knows of, per block id (null excluded):
    table entries, holds, both endpoints of each pending copy, popped blocks."""
    refs: Counter[int] = Counter()
    for per_group in snapshot.tables.values():
        for ids in per_group:
            refs.update(i for i in ids if i != 0)
    for groups in snapshot.holds.values():
        refs.update(block_id for _, block_id in groups.values())
    for _, src, dst in snapshot.pending_copies:
        refs.update((src, dst))
    for ids in snapshot.popped.values():
        refs.update(i for i in ids if i != 0)
    return refs


def ref_accounting(snapshot: Snapshot) -> list[Violation]:
    """Each block's ref count is exactly its references (no leak, no
    dangling use)."""
    refs = references(snapshot)
    return [
        Violation("ref_accounting", f"block {i}: ref {b.ref}, referenced {refs[i]} times")
        for i, b in enumerate(snapshot.blocks)
        if i != 0 and b.ref != refs[i]
    ]


def free_queue_exact(snapshot: Snapshot) -> list[Violation]:
    """A block is in the free queue exactly when its ref count is 0, once."""
    out = []
    counts = Counter(snapshot.free_queue)
    for block_id, n in counts.items():
        if n > 1:
            out.append(Violation("free_queue_exact", f"block {block_id} queued {n} times"))
    if 0 in counts:
        out.append(Violation("free_queue_exact", "the null block is in the free queue"))
    for i, b in enumerate(snapshot.blocks):
        if i == 0:
            continue
        if (b.ref == 0) != (i in counts):
            where = "in" if i in counts else "not in"
            out.append(Violation("free_queue_exact", f"block {i}: ref {b.ref}, {where} the queue"))
    return out


def holds_on_keyed_states(snapshot: Snapshot) -> list[Violation]:
    """A hold pins a block keyed, in its group, at the held position."""
    out = []
    for request, groups in snapshot.holds.items():
        for group, (position, block_id) in groups.items():
            keys = snapshot.blocks[block_id].hashes
            prefix = f"g{group}/"
            if not any(
                k.startswith(prefix) and key_position(k[len(prefix) :]) == position for k in keys
            ):
                out.append(
                    Violation(
                        "holds_on_keyed_states",
                        f"{request} holds block {block_id} in group {group} at {position}, "
                        f"keyed {list(keys) or 'nowhere'}",
                    )
                )
    return out


def clean_when_idle(snapshot: Snapshot) -> list[Violation]:
    """With no live request, no pending copy and nothing popped, every block
    but the null block is free (nothing leaked)."""
    if (
        snapshot.tables
        or snapshot.pending_copies
        or snapshot.popped
        or any(snapshot.holds.values())
    ):
        return []
    busy = [i for i, b in enumerate(snapshot.blocks) if i != 0 and b.ref != 0]
    if busy or len(snapshot.free_queue) != len(snapshot.blocks) - 1:
        return [
            Violation(
                "clean_when_idle",
                f"idle pool: {len(snapshot.free_queue)} of {len(snapshot.blocks) - 1} free, "
                f"blocks still referenced: {busy[:8]}",
            )
        ]
    return []


SNAPSHOT_INVARIANTS: dict[str, Callable[[Snapshot], list[Violation]]] = {
    "ref_accounting": ref_accounting,
    "free_queue_exact": free_queue_exact,
    "holds_on_keyed_states": holds_on_keyed_states,
    "clean_when_idle": clean_when_idle,
}


def check_snapshot(snapshot: Snapshot) -> list[Violation]:
    out: list[Violation] = []
    for predicate in SNAPSHOT_INVARIANTS.values():
        out.extend(predicate(snapshot))
    return out
