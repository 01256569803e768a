"""The manager's invariants, and the lemmas that make them inductive, by name.

An invariant is what the manager promises; a lemma is a fact about the
abstract state the proofs need (an invariant alone is not always inductive:
a pre-state that satisfies it but that no run reaches could step out of
it). The checker proves `init => P` and `I and step => P'` for every
property P, where I is the conjunction of all of them: the lemmas are proved
exactly like the invariants, so nothing is assumed.

Each property yields named instances (`no_leak[b3]`), so a failed check says
which block, request or group broke it.

Invariants
    no_leak                 every ref is accounted for, exactly: a table
                            entry, a hold, a pending copy's endpoint, or a
                            block `pop` put aside (snapshot twin:
                            `predicates.no_leak`)
    free_queue_exact        a block is in the free queue iff its ref is 0
                            (`predicates.free_queue_exact`)
    one_hold                a request holds at most one block per Mamba group
    held_state_keyed        a held block carries a key (a hold pins a state,
                            not a bare block; `predicates.held_state_keyed`)
    no_total_miss           with the hold on, the state a resident request
                            must resume from (its partial-hit source, or its
                            own moved partial tail) stays keyed and off the
                            free queue, so no allocation can evict it while
                            the request runs (the seed's total miss)
    reservation_covers_tail_swap
                            the blocks a request pins at once outside its
                            table through the hold -- its hold, plus the
                            moved tail's copy taken before the old hold is
                            released (the tail swap) -- never exceed the one
                            copy a step already counts plus the extra block
                            its admission reserved (`lifecycle.ReservationCoversTailSwap`
                            checks the same on concrete runs); without the
                            fork's retention
    clean_when_idle         no resident request, no popped blocks, no
                            pending copy: every block is free at ref 0

Lemmas (the strengthening; each is what some invariant's induction needs)
    counts_nonnegative      copy endpoints and popped counts are >= 0
    phases                  a request's phase is one of the five
    only_residents_own      only a running request has table entries, taken
                            blocks, holds, a pending tail, a checkpoint or a
                            reservation; only a popped one has blocks aside
    lookup_shape            a pending lookup has at most one partial-hit
                            source per group, and it is one of its hits
    taken_blocks            a block a request took from the pool is in that
                            request's table, and no one else took it
    block_groups            a block is used (table, hold, pending tail) only
                            by the group that took it
    pending_tail_shape      a keyed tail awaiting its move is one keyed block
                            the request took itself, keyed this life
    checkpoint_is_hold      with the hold on, a request holds exactly its
                            checkpoint; with it off, nothing but a state
                            the fork's retention kept (no_total_miss
                            rests on it: a checkpoint is pinned by its hold)
    held_outside_table      a request never holds a block of its own table
                            (the fork's retention needs it: a hold is not
                            a pending tail whose keys move away)
    hold_reserved           until the tail moves, a request holds no more
                            than its admission reserved (reservation rests on
                            it: at the swap, the old hold is a reserved one);
                            in a group keeping more partial states, with the
                            hold on, a running request reserved one

Every property is proved with the hold switch (`hold_on`), the fork's
retention (`retain_retired`) and each Mamba group's `more_partial_states`
(prefill checkpoint blocks, the shared-prefix checkpoint) free, so for
every setting at once; those about the hold say "with the hold on"
themselves. `reservation_covers_tail_swap`
and `hold_reserved` are claimed without the fork's retention only: a state
it retains is a pin the admission rule this invariant checks does not count
(the exploration's finding, see README).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import z3

from kvgate.invariants.catalogue import LEMMA_NAMES, Z3_INVARIANT_NAMES
from kvgate.invariants.z3.vocabulary import (
    ABSENT,
    ENDED,
    POPPED,
    RUNNING,
    Bounds,
    State,
    any_of,
    count,
)


class Instance(NamedTuple):
    """One instance of a property: `no_leak[b3]` is block 3's."""

    name: str
    at: dict[str, int]  # its indices: "r" request, "g" group, "b" block
    expr: Any  # the Z3 boolean


def _inst(prop: str, expr: Any, **at: int) -> Instance:
    where = ",".join(f"{k}{v}" for k, v in at.items())
    return Instance(f"{prop}[{where}]" if at else prop, at, expr)


def _per_mamba_slot(
    prop: str, bounds: Bounds, expr: Callable[[int, int, int], Any]
) -> list[Instance]:
    """One instance per request, Mamba group and block: `expr(r, m, b)`."""
    return [
        _inst(prop, expr(r, m, b), r=r, g=m, b=b)
        for r in bounds.request_ids
        for m in bounds.mamba_ids
        for b in bounds.block_ids
    ]


# The one copy a step's own count includes for a pending tail move (upstream
# counts it: `blocks_needed` adds one block for a request with a partial hit).
STEP_COPY = 1


@dataclass(frozen=True)
class Property:
    name: str
    kind: Literal["invariant", "lemma"]
    instances: Callable[[State, Bounds], list[Instance]]

    def holds(self, s: State) -> Any:
        return z3.And([i.expr for i in self.instances(s, s.bounds)])

    def violated(self, s: State, only: Callable[[Instance], bool] | None = None) -> Any:
        """Some instance (of those `only` keeps) is false."""
        return z3.Or(
            [z3.Not(i.expr) for i in self.instances(s, s.bounds) if only is None or only(i)]
        )


def _refs(s: State, bounds: Bounds, b: int) -> Any:
    return (
        count(s.table[r, g, b] for r in bounds.request_ids for g in bounds.group_ids)
        + count(s.hold[r, m, b] for r in bounds.request_ids for m in bounds.mamba_ids)
        + s.copy_ends[b]
        + z3.Sum([s.popped[r, b] for r in bounds.request_ids])
    )


_CHECKS: dict[str, Callable[[State, Bounds], Any]] = {}


def _check(check: Callable[[State, Bounds], Any]) -> Callable[[State, Bounds], Any]:
    """Register a property's check under its function's name, which is its
    name in the catalogue (`kvgate.invariants.catalogue`)."""
    _CHECKS[check.__name__] = check
    return check


@_check
def no_leak(s: State, bounds: Bounds) -> list[Instance]:
    return [_inst("no_leak", s.ref[b] == _refs(s, bounds, b), b=b) for b in bounds.block_ids]


@_check
def free_queue_exact(s: State, bounds: Bounds) -> list[Instance]:
    return [_inst("free_queue_exact", s.free[b] == (s.ref[b] == 0), b=b) for b in bounds.block_ids]


@_check
def one_hold(s: State, bounds: Bounds) -> list[Instance]:
    return [
        _inst("one_hold", count(s.hold[r, m, b] for b in bounds.block_ids) <= 1, r=r, g=m)
        for r in bounds.request_ids
        for m in bounds.mamba_ids
    ]


@_check
def held_state_keyed(s: State, bounds: Bounds) -> list[Instance]:
    return _per_mamba_slot(
        "held_state_keyed", bounds, lambda r, m, b: z3.Implies(s.hold[r, m, b], s.keyed[b])
    )


@_check
def no_total_miss(s: State, bounds: Bounds) -> list[Instance]:
    return _per_mamba_slot(
        "no_total_miss",
        bounds,
        lambda r, m, b: z3.Implies(
            z3.And(s.hold_on, s.phase[r] == RUNNING, s.checkpoint[r, m, b]),
            z3.And(s.ref[b] >= 1, s.keyed[b]),
        ),
    )


@_check
def reservation_covers_tail_swap(s: State, bounds: Bounds) -> list[Instance]:
    # Written for the hold alone: with the fork's retention a retained state
    # is a pin admission does not count (see README, Exploring).
    return [
        _inst(
            "reservation_covers_tail_swap",
            z3.Implies(z3.Not(s.retain_retired), s.peak[r, m] <= STEP_COPY + s.reserved[r, m]),
            r=r,
            g=m,
        )
        for r in bounds.request_ids
        for m in bounds.mamba_ids
    ]


@_check
def clean_when_idle(s: State, bounds: Bounds) -> list[Instance]:
    idle = z3.And(
        *[z3.And(s.phase[r] != RUNNING, s.phase[r] != POPPED) for r in bounds.request_ids],
        *[s.copy_ends[b] == 0 for b in bounds.block_ids],
    )
    clean = z3.And([z3.And(s.ref[b] == 0, s.free[b]) for b in bounds.block_ids])
    return [_inst("clean_when_idle", z3.Implies(idle, clean))]


# -- lemmas ------------------------------------------------------------------------


@_check
def counts_nonnegative(s: State, bounds: Bounds) -> list[Instance]:
    return [
        _inst(
            "counts_nonnegative",
            z3.And(s.copy_ends[b] >= 0, *[s.popped[r, b] >= 0 for r in bounds.request_ids]),
            b=b,
        )
        for b in bounds.block_ids
    ]


@_check
def phases(s: State, bounds: Bounds) -> list[Instance]:
    return [
        _inst("phases", z3.And(s.phase[r] >= ABSENT, s.phase[r] <= ENDED), r=r)
        for r in bounds.request_ids
    ]


@_check
def only_residents_own(s: State, bounds: Bounds) -> list[Instance]:
    """A request that is not running owns no table entry, hold, pending tail,
    checkpoint or reservation; only a popped one has blocks put aside."""
    out = []
    for r in bounds.request_ids:
        running, popped = s.phase[r] == RUNNING, s.phase[r] == POPPED
        owned = [
            z3.Or(s.table[r, g, b], s.own[r, g, b])
            for g in bounds.group_ids
            for b in bounds.block_ids
        ]
        for m in bounds.mamba_ids:
            owned += [s.tailed[r, m], s.reserved[r, m] != 0, s.peak[r, m] != 0]
            for b in bounds.block_ids:
                owned += [s.hold[r, m, b], s.pending_tail[r, m, b], s.checkpoint[r, m, b]]
        aside = [s.popped[r, b] != 0 for b in bounds.block_ids]
        owns = z3.And(
            z3.Implies(z3.Not(running), z3.Not(z3.Or(owned))),
            z3.Implies(z3.Not(popped), z3.Not(z3.Or(aside))),
        )
        out.append(_inst("only_residents_own", owns, r=r))
    return out


@_check
def lookup_shape(s: State, bounds: Bounds) -> list[Instance]:
    """A pending lookup has at most one partial source per group, among its hits."""
    out = []
    for r in bounds.request_ids:
        for g in bounds.group_ids:
            sources = [s.hit_source[r, g, b] for b in bounds.block_ids]
            inside = [z3.Implies(s.hit_source[r, g, b], s.hit[r, g, b]) for b in bounds.block_ids]
            out.append(_inst("lookup_shape", z3.And(count(sources) <= 1, *inside), r=r, g=g))
    return out


@_check
def taken_blocks(s: State, bounds: Bounds) -> list[Instance]:
    """A block one request took from the pool sits in that request's table,
    and no other request (or group) took it: taking needs ref 0."""
    out = []
    for b in bounds.block_ids:
        takers = [(r, g) for r in bounds.request_ids for g in bounds.group_ids]
        inside = [z3.Implies(s.own[r, g, b], s.table[r, g, b]) for r, g in takers]
        one = count(s.own[r, g, b] for r, g in takers) <= 1
        out.append(_inst("taken_blocks", z3.And(one, *inside), b=b))
    return out


@_check
def block_groups(s: State, bounds: Bounds) -> list[Instance]:
    """A block is used by one group: the one that took it."""
    out = []
    for b in bounds.block_ids:
        uses = [
            z3.Implies(s.table[r, g, b], s.block_group[b] == g)
            for r in bounds.request_ids
            for g in bounds.group_ids
        ]
        uses += [
            z3.Implies(z3.Or(s.hold[r, m, b], s.pending_tail[r, m, b]), s.block_group[b] == m)
            for r in bounds.request_ids
            for m in bounds.mamba_ids
        ]
        out.append(_inst("block_groups", z3.And(uses), b=b))
    return out


@_check
def pending_tail_shape(s: State, bounds: Bounds) -> list[Instance]:
    """A tail awaiting its move is one keyed block the request took itself,
    keyed this life."""
    out = []
    for r in bounds.request_ids:
        for m in bounds.mamba_ids:
            tail = [s.pending_tail[r, m, b] for b in bounds.block_ids]
            where = [
                z3.Implies(s.pending_tail[r, m, b], z3.And(s.own[r, m, b], s.keyed[b]))
                for b in bounds.block_ids
            ]
            shape = z3.And(count(tail) <= 1, z3.Implies(z3.Or(tail), s.tailed[r, m]), *where)
            out.append(_inst("pending_tail_shape", shape, r=r, g=m))
    return out


@_check
def checkpoint_is_hold(s: State, bounds: Bounds) -> list[Instance]:
    """With the hold on a request holds exactly its checkpoint; off, nothing
    but a state the fork's retention kept."""
    return _per_mamba_slot(
        "checkpoint_is_hold",
        bounds,
        lambda r, m, b: z3.If(
            s.hold_on,
            s.hold[r, m, b] == s.checkpoint[r, m, b],
            z3.Implies(s.hold[r, m, b], s.retain_retired),
        ),
    )


@_check
def held_outside_table(s: State, bounds: Bounds) -> list[Instance]:
    """A request's hold is never in its own table: it holds a source its
    copy replaced, a moved tail's copy, or a state its table dropped."""
    return _per_mamba_slot(
        "held_outside_table",
        bounds,
        lambda r, m, b: z3.Implies(s.hold[r, m, b], z3.Not(s.table[r, m, b])),
    )


@_check
def hold_reserved(s: State, bounds: Bounds) -> list[Instance]:
    """Until its tail moves, a request's hold is the one admission reserved:
    before the tail is keyed, and while the keyed tail awaits its move."""
    out = []
    for r in bounds.request_ids:
        for m in bounds.mamba_ids:
            held = count(s.hold[r, m, b] for b in bounds.block_ids)
            awaiting = any_of(s.pending_tail[r, m, b] for b in bounds.block_ids)
            reserved = z3.And(
                s.reserved[r, m] >= 0,
                s.reserved[r, m] <= 1,
                s.peak[r, m] >= 0,
                z3.Implies(
                    z3.And(z3.Not(s.retain_retired), z3.Or(z3.Not(s.tailed[r, m]), awaiting)),
                    held <= s.reserved[r, m],
                ),
                # A group keeping more sub-block states reserves its extra
                # block at admission, whatever the hit.
                z3.Implies(
                    z3.And(
                        z3.Not(s.retain_retired),
                        s.hold_on,
                        s.more_partial_states[m],
                        s.phase[r] == RUNNING,
                    ),
                    s.reserved[r, m] == 1,
                ),
            )
            out.append(_inst("hold_reserved", reserved, r=r, g=m))
    return out


INVARIANTS: tuple[Property, ...] = tuple(
    Property(name, "invariant", _CHECKS[name]) for name in Z3_INVARIANT_NAMES
)
LEMMAS: tuple[Property, ...] = tuple(
    Property(name, "lemma", _CHECKS[name]) for name in LEMMA_NAMES if name in _CHECKS
)

PROPERTIES: tuple[Property, ...] = INVARIANTS + LEMMAS
PROPERTY_BY_NAME: dict[str, Property] = {p.name: p for p in PROPERTIES}


def init(s: State) -> Any:
    """A fresh manager: every block free at ref 0, unkeyed; no request yet.
    The hold switch is left free: every proof covers both settings."""
    bounds = s.bounds
    out = []
    for b in bounds.block_ids:
        out += [s.ref[b] == 0, s.free[b], z3.Not(s.keyed[b]), s.copy_ends[b] == 0]
        out.append(z3.Not(s.tail_keyed[b]))
    for r in bounds.request_ids:
        out += [s.phase[r] == ABSENT, z3.Not(s.has_hit[r])]
        for b in bounds.block_ids:
            out.append(s.popped[r, b] == 0)
        for g in bounds.group_ids:
            for b in bounds.block_ids:
                out += [
                    z3.Not(s.table[r, g, b]),
                    z3.Not(s.hit[r, g, b]),
                    z3.Not(s.hit_source[r, g, b]),
                ]
                out.append(z3.Not(s.own[r, g, b]))
        for m in bounds.mamba_ids:
            out += [z3.Not(s.tailed[r, m]), s.reserved[r, m] == 0, s.peak[r, m] == 0]
            for b in bounds.block_ids:
                out += [
                    z3.Not(s.pending_tail[r, m, b]),
                    z3.Not(s.hold[r, m, b]),
                    z3.Not(s.checkpoint[r, m, b]),
                ]
    return z3.And(out)
