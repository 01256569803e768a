"""Every invariant kvgate checks, by its one name.

The same name is used by the snapshot predicates (`predicates.py`), the
life-of-a-request trackers (`lifecycle.py`), the Z3 encoding
(`z3/properties.py`), exploration failures, reports and the docs. A layer may
check only some of them (a snapshot cannot see a request's history; Z3 has
no hash map), but never under another name: `tests/test_invariant_names.py`
checks that every layer's names are in this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invariant:
    name: str
    meaning: str
    # Where it is checked: "snapshot", "model", "lifecycle", "z3".
    checked_by: tuple[str, ...]


CATALOGUE: tuple[Invariant, ...] = (
    Invariant(
        "no_leak",
        "each block's ref count is exactly its references: table entries, holds, "
        "both endpoints of pending copies, popped blocks",
        ("snapshot", "z3"),
    ),
    Invariant(
        "free_queue_exact",
        "a block is in the free queue exactly when its ref count is 0, once",
        ("snapshot", "z3"),
    ),
    Invariant(
        "one_hold",
        "a request holds at most one block per Mamba group, and only in Mamba groups",
        ("model", "z3"),
    ),
    Invariant(
        "held_state_keyed",
        "a hold pins a block keyed, in its group, at the held position",
        ("snapshot", "z3"),
    ),
    Invariant(
        "no_total_miss",
        "with the hold on, a follow-up resumes at least at the sub-block state its parent "
        "pinned (the partial-hit source it copied from, or its own partial tail moved into "
        "a copy block) while the attention prefix is still cached; a pin ends where the "
        "hold lets go by design (preemption, a newer held state superseding it)",
        ("lifecycle", "z3"),
    ),
    Invariant(
        "reservation_covers_tail_swap",
        "the blocks a request alone pins outside its table at the tail swap never "
        "exceed the step's copy plus what admission reserved for it",
        ("lifecycle", "z3"),
    ),
    Invariant(
        "clean_when_idle",
        "with no live request, pending copy or popped block, every block but the null "
        "block is free",
        ("snapshot", "z3"),
    ),
    Invariant(
        "hash_map_consistent",
        "the model's hash map and its blocks' keys name each other exactly",
        ("model",),
    ),
)

NAMES: frozenset[str] = frozenset(i.name for i in CATALOGUE)


@dataclass(frozen=True)
class Lemma:
    name: str
    meaning: str


# The strengthening the Z3 proofs need besides the invariants (an invariant is
# inductive only together with these); both encodings prove each of them.
LEMMAS: tuple[Lemma, ...] = (
    Lemma("counts_nonnegative", "copy endpoints and popped counts are never negative"),
    Lemma("phases", "a request's phase is one of the action table's five"),
    Lemma("only_residents_own", "only a running request owns blocks; only a popped one sets aside"),
    Lemma("lookup_shape", "a pending lookup has one partial source per group, among its hits"),
    Lemma("taken_blocks", "a block taken by a request is in that request's table, one taker"),
    Lemma("block_groups", "a block is used only by the group that last took it"),
    Lemma("pending_tail_shape", "an awaited tail move is one keyed block of the request's own"),
    Lemma("checkpoint_is_hold", "with the hold on the held block is the checkpoint; off, none"),
    Lemma("hold_reserved", "before the tail moves, a request's holds stay within its reserve"),
    Lemma("held_outside_table", "a request's held block is not in its own table"),
    Lemma("copy_shape", "a pending copy's source and destination differ"),
)
LEMMA_NAMES: tuple[str, ...] = tuple(lemma.name for lemma in LEMMAS)
# The invariants the Z3 encodings prove, in the catalogue's order (their tables').
Z3_INVARIANT_NAMES: tuple[str, ...] = tuple(i.name for i in CATALOGUE if "z3" in i.checked_by)


def by_name(name: str) -> Invariant:
    for invariant in CATALOGUE:
        if invariant.name == name:
            return invariant
    raise KeyError(name)
