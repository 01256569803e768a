"""Ref tokens of the unbounded encoding: which holder a pool call acts for.

The unbounded encoding (`unbounded_transitions.py`) counts a block's refs as
the set of its holders' tokens, one token field per kind of holder (a
request's table entry or hold in a group, a pending copy's endpoint). A pool
call adds or removes the tokens of the holders it acts for; an `Edit` names
those tokens, and says where they lie and when one of them is already there
(for an add) or missing (for a removal), which the pool's micro-steps turn
into a miscount.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvgate.invariants.z3.unbounded_vocabulary import COPY, REQ, Fn, exists


@dataclass(frozen=True)
class Edit:
    """Adding or removing the tokens of some holders of one token field.

    `cond(*holder, b)` (request tokens) or `cond(c)` (copy tokens) says
    which tokens; `on(b)` whether any of them lies on block `b`; `clash(b)`
    whether one of them is already there (for an add) or missing (for a
    removal), given the field's current value `tok`."""

    key: str
    cond: Fn
    on: Fn
    clash: Callable[[Fn, Any, bool], Any]


def req_edit(key: str, r: Any, blocks: Fn) -> Edit:
    """Request `r`'s tokens on `blocks`."""

    def clash(tok: Fn, b: Any, adding: bool) -> Any:
        return z3.And(blocks(b), tok(r, b) if adding else z3.Not(tok(r, b)))

    return Edit(key, lambda x, b: z3.And(x == r, blocks(b)), blocks, clash)


def holders_edit(key: str, holders: Fn, block: Any) -> Edit:
    """The tokens of every request in `holders` on one block."""

    def on(b: Any) -> Any:
        return z3.And(b == block, exists((REQ,), holders))

    def clash(tok: Fn, b: Any, adding: bool) -> Any:
        def hit(q: Any) -> Any:
            return z3.And(holders(q), tok(q, b) if adding else z3.Not(tok(q, b)))

        return z3.And(b == block, exists((REQ,), hit))

    return Edit(key, lambda x, b: z3.And(holders(x), b == block), on, clash)


def copy_edit(key: str, which: Fn, end: Fn) -> Edit:
    """The `key` endpoint tokens (`source_token`/`destination_token`) of the
    copies `which`;
    `end(c)` is the endpoint's block."""

    def on(b: Any) -> Any:
        return exists((COPY,), lambda c: z3.And(which(c), end(c) == b))

    def clash(tok: Fn, b: Any, adding: bool) -> Any:
        def hit(c: Any) -> Any:
            return z3.And(which(c), end(c) == b, tok(c) if adding else z3.Not(tok(c)))

        return exists((COPY,), hit)

    return Edit(key, which, on, clash)


def one_copy(key: str, copy: Any, when: Any, block: Any) -> Edit:
    """One copy's endpoint token, on `block`, if `when`."""

    def clash(tok: Fn, b: Any, adding: bool) -> Any:
        return z3.And(when, b == block, tok(copy) if adding else z3.Not(tok(copy)))

    return Edit(key, lambda c: z3.And(when, c == copy), lambda b: z3.And(when, b == block), clash)
