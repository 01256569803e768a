"""The unbounded encoding's vocabulary: sorts, fields and a state.

Blocks, requests and pending copies are uninterpreted sorts (`Block`,
`Req`, `Copy`) with no bound on their size; each field of a state is a Z3
function over them (`table1(r, b)`: block `b` is in request `r`'s table of
group 1), or a constant. The counterpart of the bounded encoding's
`vocabulary.py`; the transitions are in `unbounded_transitions.py` (its ref
tokens in `unbounded_tokens.py`), the properties in
`unbounded_properties.py` and their proof in `unbounded_proof.py` (as
`transitions.py`, `properties.py` and `checker.py` for the bounded one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvgate.invariants.z3.vocabulary import GroupIds

BLOCK = z3.DeclareSort("Block")
REQ = z3.DeclareSort("Req")
COPY = z3.DeclareSort("Copy")

Fn = Callable[..., Any]  # a field's value: Z3 terms in, a Z3 term out


@dataclass(frozen=True)
class UField:
    """One field: `per` is "" (once), "group" (one per group) or "mamba"
    (one per Mamba group); `args` the sorts it takes; `range` its values."""

    name: str
    args: tuple[str, ...]
    range: str  # "bool", "int" or "block"
    per: str
    ghost: bool
    doc: str


SORTS = {"block": BLOCK, "req": REQ, "copy": COPY}
REQ_BLOCK = ("req", "block")

UFIELDS: tuple[UField, ...] = (
    UField("hold_on", (), "bool", "", False, "the hold switch; never changes"),
    UField("retain_retired", (), "bool", "", False, "the retained-state retention; never changes"),
    UField("free", ("block",), "bool", "", False, "in the free queue"),
    UField("keyed", ("block",), "bool", "", False, "carries a prefix key"),
    UField("tail_keyed", ("block",), "bool", "", False, "carries a mid-block key"),
    UField("block_group", ("block",), "int", "", True, "the group that last took it"),
    UField("miscount", ("block",), "bool", "", False, "its ref is no longer its holder count"),
    UField("phase", ("req",), "int", "", False, "absent/waiting/running/popped/ended"),
    UField("has_hit", ("req",), "bool", "", False, "a lookup is pending"),
    UField("table", REQ_BLOCK, "bool", "group", False, "in the request's table"),
    UField("hit", REQ_BLOCK, "bool", "group", False, "the pending lookup's blocks"),
    UField("hit_source", REQ_BLOCK, "bool", "group", False, "its partial-hit source"),
    UField("own", REQ_BLOCK, "bool", "group", True, "taken from the pool for the table"),
    UField("popped_table", REQ_BLOCK, "bool", "group", False, "a table entry `pop` put aside"),
    UField("table_token", REQ_BLOCK, "bool", "group", False, "ref token of a table entry"),
    UField("pending_tail", REQ_BLOCK, "bool", "mamba", False, "keyed tail the next chunk moves"),
    UField("hold", REQ_BLOCK, "bool", "mamba", False, "the request holds the block"),
    UField("popped_hold", REQ_BLOCK, "bool", "mamba", False, "a hold `pop` put aside"),
    UField("hold_token", REQ_BLOCK, "bool", "mamba", False, "ref token of a hold"),
    UField("checkpoint", REQ_BLOCK, "bool", "mamba", True, "the state to resume from"),
    UField("tailed", ("req",), "bool", "mamba", True, "the partial tail was keyed"),
    UField("reserved", ("req",), "int", "mamba", True, "extra blocks admission reserved"),
    UField("peak", ("req",), "int", "mamba", True, "most out-of-table pins at once"),
    UField("pending", ("copy",), "bool", "", False, "the copy is pending"),
    UField("source", ("copy",), "block", "", False, "its source block"),
    UField("destination", ("copy",), "block", "", False, "its destination block"),
    UField("source_token", ("copy",), "bool", "", False, "ref token of its source endpoint"),
    UField(
        "destination_token", ("copy",), "bool", "", False, "ref token of its destination endpoint"
    ),
    UField(
        "more_partial_states",
        (),
        "bool",
        "mamba",
        False,
        "the group keys sub-block states besides the prompt's tail; never changes",
    ),
)
UFIELD_BY_NAME = {f.name: f for f in UFIELDS}


def _range_sort(f: UField) -> Any:
    return {"bool": z3.BoolSort(), "int": z3.IntSort(), "block": BLOCK}[f.range]


def field_keys(groups: int) -> list[tuple[UField, str]]:
    """Every (field, key) of a state: per-group fields once per group."""
    out = []
    for f in UFIELDS:
        if f.per == "group":
            out += [(f, f"{f.name}{g}") for g in range(groups)]
        elif f.per == "mamba":
            out += [(f, f"{f.name}{m}") for m in range(1, groups)]
        else:
            out.append((f, f.name))
    return out


class UState(GroupIds):
    """A state's fields by key (`table1`, `free`, ...): Z3 functions (a
    fresh state), or a transition's next values as Python callables."""

    def __init__(self, groups: int, prefix: str, values: dict[str, Any] | None = None) -> None:
        self.groups = groups
        self.prefix = prefix
        if values is not None:
            self.values = dict(values)
            return
        self.values = {}
        for f, key in field_keys(groups):
            name = f"{prefix}.{key}"
            if not f.args:
                self.values[key] = z3.Const(name, _range_sort(f))
            else:
                self.values[key] = z3.Function(name, *[SORTS[a] for a in f.args], _range_sort(f))

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def field(self, name: str, g: int | None = None) -> Any:
        return self.values[name if g is None else f"{name}{g}"]

    def has(self, b: Any) -> Any:
        """Some ref token is on `b` (ref >= 1)."""
        x, c = z3.FreshConst(REQ, "hx"), z3.FreshConst(COPY, "hc")
        on_req = z3.Or(
            *[self.field("table_token", g)(x, b) for g in self.group_ids],
            *[self.field("hold_token", m)(x, b) for m in self.mamba_ids],
        )
        on_copy = z3.Or(
            z3.And(self["source_token"](c), self["source"](c) == b),
            z3.And(self["destination_token"](c), self["destination"](c) == b),
        )
        return z3.Or(z3.Exists([x], on_req), z3.Exists([c], on_copy))


def forall(sorts: tuple[Any, ...], body: Callable[..., Any], prefix: str = "q") -> Any:
    xs = [z3.FreshConst(s, prefix) for s in sorts]
    return z3.ForAll(xs, body(*xs))


def finite(sort: Any, size: int, name: str) -> tuple[list[Any], Any]:
    """A universe of exactly `size` elements for `sort`: the elements, and
    the constraint that they are all (and distinct). Checks over a finite
    instance are decided by instantiating the quantifiers."""
    elements = [z3.Const(f"{name}{i}", sort) for i in range(size)]
    v = z3.FreshConst(sort, name)
    closed = z3.ForAll([v], z3.Or([v == e for e in elements]))
    return elements, z3.And(closed, z3.Distinct(*elements)) if size > 1 else closed


def at_most_one(rel: Fn) -> Any:
    """`rel` holds of at most one block."""
    return forall((BLOCK, BLOCK), lambda b1, b2: z3.Implies(z3.And(rel(b1), rel(b2)), b1 == b2))


def exists(sorts: tuple[Any, ...], body: Callable[..., Any], prefix: str = "q") -> Any:
    xs = [z3.FreshConst(s, prefix) for s in sorts]
    return z3.Exists(xs, body(*xs))
