"""The invariants for every pool size, as quantified formulas, and `uinit`.

The invariants keep the names of the bounded encoding's (`properties.py`);
what each says is the same, read over the holder sets of `unbounded_transitions.py`:

    no_leak            every ref token is a holder's and every holder has
                       its token, exactly (ref = |holders|: a table entry or
                       one `pop` put aside, a hold or one put aside, a
                       pending copy's endpoint); no block is miscounted
    free_queue_exact   in the free queue iff no token (ref 0)
    one_hold           at most one held block per request and Mamba group
    held_state_keyed   a held block carries a key
    no_total_miss      with the hold on, a running request's checkpoint
                       is keyed and referenced
    reservation_covers_tail_swap
                       peak pins <= the step's copy + admission's extra
    clean_when_idle    no running or popped request and no pending copy:
                       every block free, with no token

The lemmas are the bounded ones, quantified (`counts_nonnegative` has no
counterpart: holder sets have no negative counts), plus `copy_shape` (a
pending copy's endpoints are two blocks), which the copies' identities need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import z3

from kvgate.invariants.catalogue import LEMMA_NAMES, Z3_INVARIANT_NAMES
from kvgate.invariants.z3.properties import STEP_COPY
from kvgate.invariants.z3.unbounded_vocabulary import (
    BLOCK,
    COPY,
    REQ,
    UState,
    at_most_one,
    exists,
    forall,
)
from kvgate.invariants.z3.vocabulary import ABSENT, ENDED, POPPED, RUNNING


@dataclass(frozen=True)
class UProperty:
    name: str
    kind: Literal["invariant", "lemma"]
    holds: Callable[[UState], Any]


def _iff(a: Any, b: Any) -> Any:
    return a == b


def _tokens_are_holders(s: UState, ids: range, token: str, held: str, popped: str) -> list[Any]:
    """Per group in `ids`: a request's ref token is on a block exactly when
    the block is in its `held` table or in what `pop` put aside of it."""
    return [
        forall(
            (REQ, BLOCK),
            lambda r, b, g=g: _iff(
                s.field(token, g)(r, b),
                z3.Or(s.field(held, g)(r, b), s.field(popped, g)(r, b)),
            ),
        )
        for g in ids
    ]


_CHECKS: dict[str, Callable[[UState], Any]] = {}


def _check(check: Callable[[UState], Any]) -> Callable[[UState], Any]:
    """Register a property's check under its function's name, which is its
    name in the catalogue (`kvgate.invariants.catalogue`)."""
    _CHECKS[check.__name__] = check
    return check


@_check
def no_leak(s: UState) -> Any:
    parts = [forall((BLOCK,), lambda b: z3.Not(s["miscount"](b)))]
    parts += _tokens_are_holders(s, s.group_ids, "table_token", "table", "popped_table")
    parts += _tokens_are_holders(s, s.mamba_ids, "hold_token", "hold", "popped_hold")
    parts.append(
        forall(
            (COPY,),
            lambda c: z3.And(
                _iff(s["source_token"](c), s["pending"](c)),
                _iff(s["destination_token"](c), s["pending"](c)),
            ),
        )
    )
    return z3.And(parts)


@_check
def free_queue_exact(s: UState) -> Any:
    return forall((BLOCK,), lambda b: _iff(s["free"](b), z3.Not(s.has(b))))


@_check
def one_hold(s: UState) -> Any:
    return z3.And(
        [
            forall((REQ,), lambda r, m=m: at_most_one(lambda b: s.field("hold", m)(r, b)))
            for m in s.mamba_ids
        ]
    )


@_check
def held_state_keyed(s: UState) -> Any:
    return z3.And(
        [
            forall(
                (REQ, BLOCK), lambda r, b, m=m: z3.Implies(s.field("hold", m)(r, b), s["keyed"](b))
            )
            for m in s.mamba_ids
        ]
    )


@_check
def no_total_miss(s: UState) -> Any:
    def each(r: Any, b: Any, m: int) -> Any:
        resumes = z3.And(s["hold_on"], s["phase"](r) == RUNNING, s.field("checkpoint", m)(r, b))
        return z3.Implies(resumes, z3.And(s.has(b), s["keyed"](b)))

    return z3.And([forall((REQ, BLOCK), lambda r, b, m=m: each(r, b, m)) for m in s.mamba_ids])


@_check
def reservation_covers_tail_swap(s: UState) -> Any:
    return z3.And(
        [
            forall(
                (REQ,),
                lambda r, m=m: z3.Implies(
                    z3.Not(s["retain_retired"]),
                    s.field("peak", m)(r) <= STEP_COPY + s.field("reserved", m)(r),
                ),
            )
            for m in s.mamba_ids
        ]
    )


@_check
def clean_when_idle(s: UState) -> Any:
    idle = z3.And(
        forall((REQ,), lambda r: z3.And(s["phase"](r) != RUNNING, s["phase"](r) != POPPED)),
        forall((COPY,), lambda c: z3.Not(s["pending"](c))),
    )
    clean = forall((BLOCK,), lambda b: z3.And(z3.Not(s.has(b)), s["free"](b)))
    return z3.Implies(idle, clean)


# -- lemmas ------------------------------------------------------------------------


@_check
def phases(s: UState) -> Any:
    return forall((REQ,), lambda r: z3.And(s["phase"](r) >= ABSENT, s["phase"](r) <= ENDED))


@_check
def only_residents_own(s: UState) -> Any:
    def each(r: Any, b: Any) -> Any:
        running, popped = s["phase"](r) == RUNNING, s["phase"](r) == POPPED
        owned = [z3.Or(s.field("table", g)(r, b), s.field("own", g)(r, b)) for g in s.group_ids]
        for m in s.mamba_ids:
            owned += [
                s.field("tailed", m)(r),
                s.field("reserved", m)(r) != 0,
                s.field("peak", m)(r) != 0,
            ]
            owned += [s.field(k, m)(r, b) for k in ("hold", "pending_tail", "checkpoint")]
        aside = [s.field("popped_table", g)(r, b) for g in s.group_ids]
        aside += [s.field("popped_hold", m)(r, b) for m in s.mamba_ids]
        return z3.And(
            z3.Implies(z3.Not(running), z3.Not(z3.Or(owned))),
            z3.Implies(z3.Not(popped), z3.Not(z3.Or(aside))),
        )

    return forall((REQ, BLOCK), each)


@_check
def lookup_shape(s: UState) -> Any:
    parts = []
    for g in s.group_ids:
        parts.append(
            forall((REQ,), lambda r, g=g: at_most_one(lambda b: s.field("hit_source", g)(r, b)))
        )
        parts.append(
            forall(
                (REQ, BLOCK),
                lambda r, b, g=g: z3.Implies(
                    s.field("hit_source", g)(r, b), s.field("hit", g)(r, b)
                ),
            )
        )
    return z3.And(parts)


@_check
def taken_blocks(s: UState) -> Any:
    parts = []
    for g in s.group_ids:
        own = s.field("own", g)
        parts.append(
            forall(
                (REQ, BLOCK),
                lambda r, b, g=g, own=own: z3.Implies(own(r, b), s.field("table", g)(r, b)),
            )
        )
        for h in s.group_ids:
            other = s.field("own", h)

            def one(
                r1: Any, r2: Any, b: Any, own: Any = own, other: Any = other, g: int = g, h: int = h
            ) -> Any:
                same = (r1 == r2) if g == h else z3.BoolVal(False)
                return z3.Implies(z3.And(own(r1, b), other(r2, b)), same)

            parts.append(forall((REQ, REQ, BLOCK), one))
    return z3.And(parts)


@_check
def block_groups(s: UState) -> Any:
    def each(r: Any, b: Any) -> Any:
        block_group = s["block_group"](b)
        uses = [z3.Implies(s.field("table", g)(r, b), block_group == g) for g in s.group_ids]
        uses += [
            z3.Implies(
                z3.Or(s.field("hold", m)(r, b), s.field("pending_tail", m)(r, b)), block_group == m
            )
            for m in s.mamba_ids
        ]
        return z3.And(uses)

    return forall((REQ, BLOCK), each)


@_check
def pending_tail_shape(s: UState) -> Any:
    parts = []
    for m in s.mamba_ids:
        pending_tail = s.field("pending_tail", m)
        parts.append(
            forall(
                (REQ,),
                lambda r, pending_tail=pending_tail: at_most_one(lambda b: pending_tail(r, b)),
            )
        )
        parts.append(
            forall(
                (REQ, BLOCK),
                lambda r, b, m=m, pending_tail=pending_tail: z3.Implies(
                    pending_tail(r, b),
                    z3.And(s.field("own", m)(r, b), s["keyed"](b), s.field("tailed", m)(r)),
                ),
            )
        )
    return z3.And(parts)


@_check
def checkpoint_is_hold(s: UState) -> Any:
    def each(r: Any, b: Any, m: int) -> Any:
        hold, checkpoint = s.field("hold", m)(r, b), s.field("checkpoint", m)(r, b)
        return z3.If(s["hold_on"], hold == checkpoint, z3.Implies(hold, s["retain_retired"]))

    return z3.And([forall((REQ, BLOCK), lambda r, b, m=m: each(r, b, m)) for m in s.mamba_ids])


@_check
def hold_reserved(s: UState) -> Any:
    def each(r: Any, m: int) -> Any:
        reserved, peak = s.field("reserved", m)(r), s.field("peak", m)(r)
        held = exists((BLOCK,), lambda b: s.field("hold", m)(r, b))
        awaiting = exists((BLOCK,), lambda b: s.field("pending_tail", m)(r, b))
        return z3.And(
            reserved >= 0,
            reserved <= 1,
            peak >= 0,
            z3.Implies(
                z3.And(
                    z3.Not(s["retain_retired"]),
                    z3.Or(z3.Not(s.field("tailed", m)(r)), awaiting),
                    held,
                ),
                reserved >= 1,
            ),
            # A group keeping more sub-block states reserves its extra block
            # at admission, whatever the hit.
            z3.Implies(
                z3.And(
                    z3.Not(s["retain_retired"]),
                    s["hold_on"],
                    s.field("more_partial_states", m),
                    s["phase"](r) == RUNNING,
                ),
                reserved == 1,
            ),
        )

    return z3.And([forall((REQ,), lambda r, m=m: each(r, m)) for m in s.mamba_ids])


@_check
def held_outside_table(s: UState) -> Any:
    def each(r: Any, b: Any) -> Any:
        return z3.And(
            [
                z3.Implies(s.field("hold", m)(r, b), z3.Not(s.field("table", m)(r, b)))
                for m in s.mamba_ids
            ]
        )

    return forall((REQ, BLOCK), each)


@_check
def copy_shape(s: UState) -> Any:
    """A pending copy's endpoints are two blocks (its destination was free
    when taken, its source was not)."""

    def each(c: Any) -> Any:
        return z3.Implies(s["pending"](c), s["source"](c) != s["destination"](c))

    return forall((COPY,), each)


UINVARIANTS: tuple[UProperty, ...] = tuple(
    UProperty(name, "invariant", _CHECKS[name]) for name in Z3_INVARIANT_NAMES
)
ULEMMAS: tuple[UProperty, ...] = tuple(
    UProperty(name, "lemma", _CHECKS[name]) for name in LEMMA_NAMES if name in _CHECKS
)
UPROPERTIES: tuple[UProperty, ...] = UINVARIANTS + ULEMMAS
UPROPERTY_BY_NAME = {p.name: p for p in UPROPERTIES}


def uinit(s: UState) -> Any:
    """A fresh manager: every block free, unkeyed, no token; no request; no copy."""
    out = [
        forall(
            (BLOCK,),
            lambda b: z3.And(
                s["free"](b),
                z3.Not(s["keyed"](b)),
                z3.Not(s["tail_keyed"](b)),
                z3.Not(s["miscount"](b)),
            ),
        ),
        forall(
            (COPY,),
            lambda c: z3.And(
                z3.Not(s["pending"](c)),
                z3.Not(s["source_token"](c)),
                z3.Not(s["destination_token"](c)),
            ),
        ),
    ]

    def req(r: Any, b: Any) -> Any:
        parts = [s["phase"](r) == ABSENT, z3.Not(s["has_hit"](r))]
        for g in s.group_ids:
            parts += [
                z3.Not(s.field(k, g)(r, b))
                for k in ("table", "hit", "hit_source", "own", "popped_table", "table_token")
            ]
        for m in s.mamba_ids:
            parts += [
                z3.Not(s.field(k, m)(r, b))
                for k in ("pending_tail", "hold", "popped_hold", "hold_token", "checkpoint")
            ]
            parts += [
                z3.Not(s.field("tailed", m)(r)),
                s.field("reserved", m)(r) == 0,
                s.field("peak", m)(r) == 0,
            ]
        return z3.And(parts)

    out.append(forall((REQ, BLOCK), req))
    return z3.And(out)
