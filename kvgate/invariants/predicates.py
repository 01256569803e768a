"""The manager's invariants as predicates over a strict snapshot.

A snapshot is the same shape for every target, so these predicates check the
model and the real vLLM manager alike. Each returns the violations it found,
each naming the block or request that broke it; an empty list means it
holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.model.pool import BlockPool
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.tokens import key_position


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


def no_leak(snapshot: Snapshot) -> list[Violation]:
    """Each block's ref count is exactly its references (no leak, no
    dangling use)."""
    refs = references(snapshot)
    return [
        Violation("no_leak", f"block {i}: ref {b.ref}, referenced {refs[i]} times")
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


def held_state_keyed(snapshot: Snapshot) -> list[Violation]:
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
                        "held_state_keyed",
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
    "no_leak": no_leak,
    "free_queue_exact": free_queue_exact,
    "held_state_keyed": held_state_keyed,
    "clean_when_idle": clean_when_idle,
}


def check_snapshot(snapshot: Snapshot) -> list[Violation]:
    out: list[Violation] = []
    for predicate in SNAPSHOT_INVARIANTS.values():
        out.extend(predicate(snapshot))
    return out


def one_hold(snapshot: Snapshot, mamba_group_ids: Sequence[int]) -> list[Violation]:
    """Holds live only in Mamba groups, and a request holds one block per
    group (the snapshot keeps one per request and group, so a second one
    shows up as a hold on a block the request also holds in another group)."""
    out = []
    allowed = set(mamba_group_ids)
    for request, groups in snapshot.holds.items():
        for group in groups:
            if group not in allowed:
                out.append(
                    Violation(
                        "one_hold",
                        f"{request} holds a block in group {group}, not a Mamba group",
                    )
                )
        ids = Counter(block_id for _, block_id in groups.values())
        for block_id, n in ids.items():
            if n > 1:
                out.append(
                    Violation(
                        "one_hold",
                        f"{request} holds block {block_id} in {n} groups",
                    )
                )
    return out


def hash_map_consistent(pool: BlockPool) -> list[Violation]:
    """The model's hash map and its blocks' keys name each other exactly.

    Every block under a key in `pool.cached` carries that key (primary or
    secondary); every key a block carries lists the block; the null block
    carries none; a block's primary key is set exactly when it covers tokens.
    Model-level: vLLM's map is only seen through the snapshot's names.
    """
    out = []

    def bad(message: str) -> None:
        out.append(Violation("hash_map_consistent", message))

    for key, entry in pool.cached.items():
        if not entry:
            bad(f"key {key[0]}/{key[1]} maps to no block")
        for block_id, block in entry.items():
            if block.block_id != block_id:
                bad(f"key {key[0]}/{key[1]} files block {block.block_id} under id {block_id}")
            elif key not in pool.keys_of(block):
                bad(f"block {block_id} is cached under {key[0]}/{key[1]} but carries {block.hash}")
    for block in pool.blocks:
        if (
            block.hash is None
            and block.hash_tokens is None
            and block.block_id not in pool.secondary
        ):
            continue  # carries no key: nothing to agree on
        keys = pool.keys_of(block)
        if block.is_null and keys:
            bad(f"the null block {block.block_id} carries keys {keys}")
        if (block.hash is None) != (block.hash_tokens is None):
            bad(f"block {block.block_id}: primary key {block.hash}, tokens {block.hash_tokens}")
        if block.hash is None and block.block_id in pool.secondary:
            bad(f"block {block.block_id} has secondary keys but no primary one")
        for key in keys:
            if block.block_id not in pool.cached.get(key, {}):
                bad(f"block {block.block_id} carries {key[0]}/{key[1]}, the map lacks it")
    return out
