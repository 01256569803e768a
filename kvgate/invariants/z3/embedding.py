"""A bounded state embedded in a finite instance of the unbounded encoding.

The drift test (`tests/test_z3_drift.py`) checks that every step the model
takes is a transition of the bounded encoding (`transitions.py`). This
module carries such a bounded step one level further: its pre- and
post-state (every field, ghosts included, as `abstraction.Drift` carries
them) are embedded in a finite instance of the unbounded encoding's sorts
(one `Block` per pool block, one `Req` per request slot, enough `Copy`
identities for the pending copies before and after the step and one spare),
and the op's unbounded transition (`unbounded_transitions.py`) must relate the two.

The embedding fixes every field the two vocabularies share to its bounded
value. What the bounded state only counts, the unbounded one spells out,
and the embedding leaves the choice to the solver within the counts: a
block's `ref` is the number of ref tokens on it, its `copy_ends` the
number of pending copies with an endpoint on it (which copy pairs which two
blocks is not recorded in the bounded state), a request's `popped` count on
a block the number of its table entries and holds `pop` put aside there.
The pre-state's tokens are its holders (the unbounded `no_leak`, which a
bounded state reached by the model satisfies), so the transition's token
edits start from the state the model was in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvgate.invariants.z3.transitions import acts_on_request
from kvgate.invariants.z3.unbounded_properties import no_leak
from kvgate.invariants.z3.unbounded_transitions import UEncoding
from kvgate.invariants.z3.unbounded_vocabulary import (
    BLOCK,
    COPY,
    REQ,
    SORTS,
    UState,
    field_keys,
    finite,
    forall,
)
from kvgate.invariants.z3.vocabulary import Bounds, Values, count

Read = Callable[[str], Any]  # an unbounded field's value by key (`table1`, `free`)


@dataclass(frozen=True)
class Instance:
    """The finite universe a bounded state is embedded in."""

    blocks: dict[int, Any]  # bounded block id -> its `Block` element
    requests: dict[int, Any]  # request slot -> its `Req` element
    copies: list[Any]
    closed: list[Any]  # the constraints that these are all of each sort

    @classmethod
    def of(cls, bounds: Bounds, copies: int) -> Instance:
        blocks, closed_blocks = finite(BLOCK, len(bounds.block_ids), "eb")
        requests, closed_requests = finite(REQ, len(bounds.request_ids), "er")
        copy_ids, closed_copies = finite(COPY, copies, "ec")
        return cls(
            dict(zip(bounds.block_ids, blocks, strict=True)),
            dict(zip(bounds.request_ids, requests, strict=True)),
            copy_ids,
            [closed_blocks, closed_requests, closed_copies],
        )


def embed(read: Read, values: Values, bounds: Bounds, at: Instance) -> list[Any]:
    """Constraints saying the unbounded state `read` is the bounded state
    `values` (every field of `vocabulary.FIELDS`) on the instance `at`."""
    out: list[Any] = []
    blocks, requests, copies = at.blocks, at.requests, at.copies
    for name in ("hold_on", "retain_retired"):
        out.append(read(name) == values[name][()])
    for m, value in values["more_partial_states"].items():
        out.append(read(f"more_partial_states{m}") == value)
    for b, block in blocks.items():
        for name in ("free", "keyed", "tail_keyed", "block_group"):
            out.append(read(name)(block) == values[name][b])
        out.append(z3.Not(read("miscount")(block)))
        tokens = [
            read(f"table_token{g}")(r, block) for g in bounds.group_ids for r in requests.values()
        ]
        tokens += [
            read(f"hold_token{m}")(r, block) for m in bounds.mamba_ids for r in requests.values()
        ]
        tokens += [z3.And(read("source_token")(c), read("source")(c) == block) for c in copies]
        tokens += [
            z3.And(read("destination_token")(c), read("destination")(c) == block) for c in copies
        ]
        out.append(count(tokens) == values["ref"][b])
        ends = [
            z3.And(read("pending")(c), read(end)(c) == block)
            for c in copies
            for end in ("source", "destination")
        ]
        out.append(count(ends) == values["copy_ends"][b])
    for r, req in requests.items():
        out.append(read("phase")(req) == values["phase"][r])
        out.append(read("has_hit")(req) == values["has_hit"][r])
        for m in bounds.mamba_ids:
            for name in ("tailed", "reserved", "peak"):
                out.append(read(f"{name}{m}")(req) == values[name][r, m])
        for b, block in blocks.items():
            for g in bounds.group_ids:
                for name in ("table", "hit", "hit_source", "own"):
                    out.append(read(f"{name}{g}")(req, block) == values[name][r, g, b])
            for m in bounds.mamba_ids:
                for name in ("pending_tail", "hold", "checkpoint"):
                    out.append(read(f"{name}{m}")(req, block) == values[name][r, m, b])
            popped = [read(f"popped_table{g}")(req, block) for g in bounds.group_ids]
            popped += [read(f"popped_hold{m}")(req, block) for m in bounds.mamba_ids]
            out.append(count(popped) == values["popped"][r, b])
    return out


def admits_embedded(
    bounds: Bounds, op: str, r: int | None, pre: Values, post: Values, mutation: str = "clean"
) -> z3.CheckSatResult:
    """Whether the unbounded transition of `op` (acting for request slot
    `r`) relates the embeddings of the bounded states `pre` and `post`:
    `sat` if it does."""
    pending_copies = sum(pre["copy_ends"].values()) // 2 + sum(post["copy_ends"].values()) // 2
    at = Instance.of(bounds, pending_copies + 1)
    s = UState(bounds.groups, "s")
    acting = at.requests[r] if acts_on_request(op) and r is not None else None
    tx = UEncoding(bounds.groups, mutation).build(op, s, acting, "x")
    solver = z3.Solver()
    solver.set("timeout", 60_000)
    solver.add(*at.closed)
    solver.add(no_leak(s))
    solver.add(*embed(lambda key: s[key], pre, bounds, at))
    solver.add(*[clause for _, clause in tx.named()])
    # The next state as functions of its own, each defined once by the
    # transition's next value (a value is a term built per application:
    # applying it at every block and request would build it again each time).
    t = UState(bounds.groups, "t")
    for f, key in field_keys(bounds.groups):
        if f.args:
            sorts = tuple(SORTS[a] for a in f.args)
            solver.add(forall(sorts, lambda *a, key=key: t[key](*a) == tx.next[key](*a)))
        else:
            solver.add(t[key] == tx.next[key])
    solver.add(*embed(lambda key: t[key], post, bounds, at))
    return solver.check()
