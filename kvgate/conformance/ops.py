"""The action table: every trace op, its fields and the values a target reports.

This table is the single source for what an op is. The trace parser validates
against it, the replayer dispatches on it, the model implements one method per
primitive op, and the Z3 encoding has one transition per primitive op; tests
check that each of those covers exactly the names listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# A field's type, as the parser checks it.
FieldType = Literal[
    "req",  # a request name (str)
    "prompt",  # a list of prompt segments
    "int",  # an int >= 0
    "int_or_auto",  # an int >= 1, or "auto"
    "int_or_all",  # an int >= 0, or "all"
    "how",  # finish / abort / preempt
]


@dataclass(frozen=True)
class Action:
    """One op of trace format version 1."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    # Keys allowed under `expect`, each also a value the target reports.
    expect_keys: tuple[str, ...] = ()
    # A macro expands into primitive ops; it is never sent to a target.
    macro: bool = False
    # The request must have arrived before this op.
    needs_request: bool = False


FIELD_TYPES: dict[str, FieldType] = {
    "req": "req",
    "prompt": "prompt",
    "tokens": "int_or_auto",
    "lookahead": "int",
    "spec": "int",
    "steps": "int",
    "how": "how",
    "blocks": "int_or_all",
}

# The prefix-cache hit stats a `stats` op reports (vLLM's PrefixCacheStats):
# requests admitted after a lookup, their tokens (queries) and hit tokens, the
# same three for requests admitted again after a preemption, and whether the
# prefix cache was reset since the last `stats`.
STATS_KEYS: tuple[str, ...] = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
    "reset",
)

ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action("arrive", ("req", "prompt")),
        Action("lookup", ("req",), expect_keys=("hit",), needs_request=True),
        Action(
            "reserve",
            ("req",),
            expect_keys=("blocks", "step_blocks"),
            needs_request=True,
        ),
        Action(
            "allocate",
            ("req", "tokens"),
            ("lookahead",),
            expect_keys=("ok", "tokens"),
            needs_request=True,
        ),
        Action("decode1", ("req",), ("spec",), expect_keys=("ok",), needs_request=True),
        Action("step", ()),
        Action("drain", (), expect_keys=("copies",)),
        Action("free", ("req", "how"), needs_request=True),
        Action("pop", ("req",), needs_request=True),
        Action("release", ("req",), needs_request=True),
        Action("evict", ("blocks",)),
        # Additive to version 1: the calls a deployment makes besides
        # scheduling (see docs/trace-format.md, "Cache reset, events, stats").
        Action("reset", (), expect_keys=("ok",)),
        Action("events", (), expect_keys=("events",)),
        Action("stats", (), expect_keys=STATS_KEYS),
        Action("check", ()),
        Action(
            "prefill",
            ("req",),
            ("lookahead",),
            expect_keys=("hit",),
            macro=True,
            needs_request=True,
        ),
        Action(
            "decode",
            ("req", "steps"),
            ("spec",),
            macro=True,
            needs_request=True,
        ),
    )
}

PRIMITIVE_OPS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if not a.macro)

# The type of each `expect` value, as the parser checks it: "int" is an int
# >= 0, "bool" a YAML boolean, "copies" a list of [src, dst] block-id pairs,
# "events" a list of event lines (kvgate.conformance.events).
ExpectType = Literal["int", "bool", "copies", "events"]

EXPECT_TYPES: dict[str, ExpectType] = {
    "hit": "int",
    "blocks": "int",
    "step_blocks": "int",
    "ok": "bool",
    "tokens": "int",
    "copies": "copies",
    "events": "events",
    **{key: "int" for key in STATS_KEYS if key != "reset"},
    "reset": "bool",
}

# Keys of a `check` step.
CHECK_KEYS: tuple[str, ...] = ("pool_clean", "free_blocks", "holds", "ref", "attention_cached")
# `ref: {R: {G: {P: N}}}`: the block keyed in group G at R's prefix position P
# has ref count N (0: it waits in the free queue; null: nothing is keyed there).
# `attention_cached: {R: N}`: the attention group has R's prompt cached from
# its start for N tokens (whole attention blocks). Both are additive to
# version 1, which reserved `ref` for per-block checks.

FREE_HOW: tuple[str, ...] = ("finish", "abort", "preempt")


@dataclass(frozen=True)
class Step:
    """One primitive op, ready to replay.

    `index` is the position of the trace step it came from; `part` numbers the
    primitives a macro expanded into (0 for a primitive written as such), and
    `origin` names that macro, so a report can point at the line a person wrote.
    """

    op: str
    index: int
    part: int = 0
    origin: str | None = None
    req: str | None = None
    prompt: tuple[Segment, ...] = ()
    tokens: int | Literal["auto"] | None = None
    lookahead: int = 0
    spec: int = 0
    how: str | None = None
    blocks: int | Literal["all"] | None = None
    expect: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # the `decode` macro's repeat count; the parser expands it

    def where(self) -> str:
        """`step 6 (prefill: allocate #2)`: a place a person can find."""
        if self.origin is None:
            return f"step {self.index} ({self.op})"
        return f"step {self.index} ({self.origin}: {self.op} #{self.part})"


@dataclass(frozen=True)
class Segment:
    """One prompt segment: `fresh`, `all_of`, `prompt_of` or `tokens`."""

    kind: Literal["fresh", "all_of", "prompt_of", "tokens"]
    count: int = 0
    req: str | None = None
    token_ids: tuple[int, ...] = ()
