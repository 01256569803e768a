"""The abstract state of the hybrid KV-cache manager, as Z3 variables.

This is the vocabulary every other module of `kvgate.invariants.z3` speaks:
the transitions (`transitions.py`) relate two states, the properties
(`properties.py`) constrain one, the checker unrolls them, and the drift test
(`abstraction.py`) maps a concrete model state onto the same fields.

A configuration is bounded (`Bounds`): `blocks` pool blocks (block 0 is the
null block and is left out: never queued, its ref count not kept),
`requests` requests, `groups` KV-cache groups of which group 0 is the one
full-attention group and groups 1.. are align-mode Mamba groups. Each field
below is one Z3 variable per index, unrolled over those finite sorts (no
quantifiers), so every check is quantifier-free linear integer arithmetic.

What is kept, and what is abstracted away:

- Blocks keep their ref count, free-queue *membership* (the queue's order,
  which decides which cached state is evicted first, is abstracted away: any
  free block may be the one an allocation or eviction takes), and whether
  they carry a prefix key (`keyed`), and whether one of its keys ends inside
  a block (`tail_keyed`: a prompt's partial tail, or with
  `more_partial_states` an exported prefill checkpoint or a shared-prefix
  junction; a Mamba hit on it is a partial hit). Which key, and at which
  token position, is abstracted away.
- Configuration switches, fixed for a run and free in every proof: the hold
  (`hold_on`), the fork's retention (`retain_retired`), and per Mamba group
  whether it keys sub-block states besides the prompt's tail
  (`more_partial_states`: prefill checkpoint blocks or the shared-prefix
  checkpoint, with a hash unit finer than its block).
- Requests keep a phase, their block tables as sets per group (null entries
  and table positions dropped), their pending lookup (the hit blocks, and
  which one is a partial-hit source), their pending tail move in each Mamba
  group, their hold, and the blocks `pop` put aside. Tokens, prompt lengths
  and computed positions are abstracted away: how many blocks an allocation
  takes, which table blocks it frees behind the running state, and which
  ones its caching keys are free choices of each transition.
- Pending copies are kept as a count of copy endpoints per block.

Ghost fields (no counterpart in the manager; the transitions maintain them
so invariants can speak about history):

- `block_group`: the group that last took the block from the pool. Keys
  live in that group: a block is keyed, held and hit only as a block of its
  group.
- `own`: the request took the block from the pool itself (a new block or
  its copy-on-write copy) and keeps it in its table. A prompt's partial tail
  is keyed on such a block, never on one adopted from a hit.
- `checkpoint`: the state a request must be able to resume from: the
  partial-hit source it copied from, or its own partial tail after the move
  to a copy block; it follows moved keys. Kept whatever the hold switch says: it is
  the specification the hold implements.
- `tailed`: the request has keyed its prompt's partial tail in this life
  (at most once: a prefill reaches its tail position once; a group that
  keeps more partial states may key a junction's before it).
- `reserved`: the extra block its admission reserved in that Mamba group.
- `peak`: the most blocks it has pinned at once outside its table through
  its hold and its moved tail's copy (see `properties.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any, Literal, NamedTuple

import z3

from kvgate.errors import KvgateError
from kvgate.vocabulary.ops import ACTIONS, FREE_HOW, PHASES, Phase, next_phase

# Request phases: the action table's, with `decoding` folded into `running`
# (the encoding does not track whether a prompt is computed).
PHASE_NAMES: tuple[Phase, ...] = tuple(p for p in PHASES if p != "decoding")
ABSENT, WAITING, RUNNING, POPPED, ENDED = range(len(PHASE_NAMES))
PHASE_NUMBER: dict[Phase, int] = {
    p: PHASE_NAMES.index("running" if p == "decoding" else p) for p in PHASES
}


def valid_phases(op: str) -> tuple[int, ...]:
    """The phases (numbers) the action table accepts `op` in: its `valid_in`."""
    return tuple(sorted({PHASE_NUMBER[p] for p in ACTIONS[op].valid_in}))


def phase_guard(phase: Any, op: str) -> Any:
    """`phase` (a request's Z3 phase) is one `op` is valid in: both
    encodings' guards, so neither restates the action table's lifecycle."""
    return z3.Or([phase == n for n in valid_phases(op)])


def phase_after(op: str, how: str | None = None) -> int:
    """The phase `op` leaves its request in when it succeeds: the action
    table's `next_phase` (with `how` for `free`), which for every op is the
    same from each phase the op is valid in once `decoding` is folded."""
    after = {PHASE_NUMBER[next_phase(op, p, how)] for p in ACTIONS[op].valid_in}
    if len(after) != 1:
        raise ValueError(f"{op}: the phase after it depends on the phase before")
    return after.pop()


# `free`'s `how`, numbered in the action table's order.
HOW: dict[str, int] = {how: i for i, how in enumerate(FREE_HOW)}
FINISH, ABORT, PREEMPT = HOW["finish"], HOW["abort"], HOW["preempt"]

ATTENTION = 0  # the full-attention group's id; Mamba groups follow

Axis = Literal["block", "request", "group", "mamba"]
Sort = Literal["int", "bool"]
Key = Any  # () for a scalar, an int for one axis, a tuple for several
Values = dict[str, dict[Key, int | bool]]  # a concrete state in this vocabulary


class BadBounds(KvgateError, ValueError):
    """Bounds outside what the encoding covers (one line, names the field)."""


class GroupIds:
    """The group ids of an encoding with `groups` groups: the attention
    group first, the Mamba groups after it."""

    groups: int

    @property
    def group_ids(self) -> range:
        return range(self.groups)

    @property
    def mamba_ids(self) -> range:
        return range(ATTENTION + 1, self.groups)


@dataclass(frozen=True)
class Bounds(GroupIds):
    blocks: int = 8
    requests: int = 3
    groups: int = 3

    def __post_init__(self) -> None:
        if self.blocks < 2:
            raise BadBounds("--blocks must be at least 2 (block 0 is the null block)")
        if self.requests < 1:
            raise BadBounds("--requests must be at least 1")
        if self.groups < 2:
            raise BadBounds("--groups must be at least 2 (one attention group, one Mamba group)")

    @property
    def block_ids(self) -> range:
        return range(1, self.blocks)

    @property
    def request_ids(self) -> range:
        return range(self.requests)

    def axis(self, axis: Axis) -> range:
        return {
            "block": self.block_ids,
            "request": self.request_ids,
            "group": self.group_ids,
            "mamba": self.mamba_ids,
        }[axis]

    def keys(self, axes: tuple[Axis, ...]) -> list[Key]:
        if not axes:
            return [()]
        if len(axes) == 1:
            return list(self.axis(axes[0]))
        return list(product(*(self.axis(a) for a in axes)))

    def __str__(self) -> str:
        return f"{self.blocks} blocks, {self.requests} requests, {self.groups} groups"


class Field(NamedTuple):
    """One state variable: a Z3 function (or constant) of its axes."""

    name: str
    sort: Sort
    axes: tuple[Axis, ...]
    ghost: bool
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("hold_on", "bool", (), False, "the hold switch (config.hold); never changes"),
    Field(
        "retain_retired",
        "bool",
        (),
        False,
        "the retained-state retention (retain_retired); never changes",
    ),
    Field("ref", "int", ("block",), False, "the block's ref count"),
    Field("free", "bool", ("block",), False, "the block is in the free queue"),
    Field("keyed", "bool", ("block",), False, "the block carries a prefix key"),
    Field("copy_ends", "int", ("block",), False, "pending-copy endpoints on the block"),
    Field("tail_keyed", "bool", ("block",), False, "it carries a mid-block (partial-tail) key"),
    Field("phase", "int", ("request",), False, "absent/waiting/running/popped/ended"),
    Field("has_hit", "bool", ("request",), False, "a lookup is pending for the next allocate"),
    Field("table", "bool", ("request", "group", "block"), False, "the block is in the table"),
    Field("hit", "bool", ("request", "group", "block"), False, "the pending lookup's blocks"),
    Field("hit_source", "bool", ("request", "group", "block"), False, "its partial-hit source"),
    Field(
        "pending_tail",
        "bool",
        ("request", "mamba", "block"),
        False,
        "keyed tail the next chunk moves",
    ),
    Field("hold", "bool", ("request", "mamba", "block"), False, "the request holds the block"),
    Field("popped", "int", ("request", "block"), False, "times `pop` put the block aside"),
    Field("block_group", "int", ("block",), True, "the group that took it (observed when in use)"),
    Field("own", "bool", ("request", "group", "block"), True, "taken from the pool for the table"),
    Field("checkpoint", "bool", ("request", "mamba", "block"), True, "the state to resume from"),
    Field("tailed", "bool", ("request", "mamba"), True, "the partial tail was keyed"),
    Field("reserved", "int", ("request", "mamba"), True, "extra blocks admission reserved"),
    Field("peak", "int", ("request", "mamba"), True, "most out-of-table pins at once"),
    Field(
        "more_partial_states",
        "bool",
        ("mamba",),
        False,
        "the group keys sub-block states besides the prompt's tail; never changes",
    ),
)
FIELD_BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}


class State:
    """One state: a Z3 variable per field and index, named `<prefix>.<field>[index]`."""

    hold_on: Any
    retain_retired: Any
    ref: dict[int, Any]
    free: dict[int, Any]
    keyed: dict[int, Any]
    copy_ends: dict[int, Any]
    tail_keyed: dict[int, Any]
    phase: dict[int, Any]
    has_hit: dict[int, Any]
    table: dict[tuple[int, int, int], Any]
    hit: dict[tuple[int, int, int], Any]
    hit_source: dict[tuple[int, int, int], Any]
    pending_tail: dict[tuple[int, int, int], Any]
    hold: dict[tuple[int, int, int], Any]
    popped: dict[tuple[int, int], Any]
    block_group: dict[int, Any]
    own: dict[tuple[int, int, int], Any]
    checkpoint: dict[tuple[int, int, int], Any]
    tailed: dict[tuple[int, int], Any]
    reserved: dict[tuple[int, int], Any]
    peak: dict[tuple[int, int], Any]
    more_partial_states: dict[int, Any]

    def __init__(
        self, bounds: Bounds, prefix: str, values: Mapping[str, Mapping[Key, Any]] | None = None
    ) -> None:
        """Fresh variables, or (with `values`) the given Z3 expressions: a
        transition's next state, evaluated without naming it."""
        self.bounds = bounds
        self.prefix = prefix
        self._literals: dict[tuple[str, Key, int | bool], Any] = {}
        for f in FIELDS:
            if values is not None:
                by_key = dict(values[f.name])
            else:
                make = z3.Int if f.sort == "int" else z3.Bool
                by_key = {k: make(f"{prefix}.{f.name}{_suffix(k)}") for k in bounds.keys(f.axes)}
            setattr(self, f.name, by_key[()] if not f.axes else by_key)

    def field(self, name: str) -> dict[Key, Any]:
        """A field's variables by index (a scalar field as `{(): var}`)."""
        value = getattr(self, name)
        return {(): value} if not FIELD_BY_NAME[name].axes else dict(value)

    def items(self) -> Iterator[tuple[str, Key, Any]]:
        for f in FIELDS:
            for key, var in self.field(f.name).items():
                yield f.name, key, var

    def equals(self, values: Mapping[str, Mapping[Key, int | bool]]) -> list[Any]:
        """Constraints fixing the fields present in `values`."""
        out = []
        for name, by_key in values.items():
            variables = self.field(name)
            for key, value in by_key.items():
                out.append(variables[key] == value)
        return out

    def literals(self, values: Mapping[str, Mapping[Key, int | bool]]) -> list[Any]:
        """`equals` as reusable literals (built once per variable and value),
        for checks that fix a state again and again as assumptions."""
        out = []
        for name, by_key in values.items():
            variables = self.field(name)
            for key, value in by_key.items():
                lit = self._literals.get((name, key, value))
                if lit is None:
                    var = variables[key]
                    lit = (
                        (var if value else z3.Not(var)) if isinstance(value, bool) else var == value
                    )
                    self._literals[name, key, value] = lit
                out.append(lit)
        return out

    def evaluate(self, model: Any, names: Iterable[str] | None = None) -> Values:
        """This state's values in a Z3 model (unconstrained ones at their
        default), for every field or those in `names`."""
        out: Values = {}
        wanted = None if names is None else set(names)
        for name, key, var in self.items():
            if wanted is not None and name not in wanted:
                continue
            value = model.eval(var, model_completion=True)
            out.setdefault(name, {})[key] = (
                z3.is_true(value) if z3.is_bool(value) else value.as_long()
            )
        return out


def _suffix(key: Key) -> str:
    if key == ():
        return ""
    if isinstance(key, int):
        return f"[{key}]"
    return "[" + ",".join(str(k) for k in key) + "]"


def count(exprs: Any) -> Any:
    """How many of these Z3 booleans hold."""
    terms = [z3.If(e, 1, 0) for e in exprs]
    return z3.Sum(terms) if terms else z3.IntVal(0)


def any_of(exprs: Any) -> Any:
    items = list(exprs)
    return z3.Or(items) if items else z3.BoolVal(False)
