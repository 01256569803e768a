"""The action table: every trace op, its fields and the values a target reports.

This table is the single source for what an op is. The trace parser validates
against it, the op driver (`driver/op_driver.py`, which both the model and the vLLM
targets run) has one handler per primitive op, and each Z3 encoding has one
transition per primitive op; tests check that each of those covers exactly
the names listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs, MmItem

# A request's life, the same in every layer (the trace validator, the driver,
# exploration's guards, the Z3 phases, the drift test's generator; the
# workload's traces are read back through the validator). `absent` until it
# arrives; `waiting` until an allocation gives it blocks, and again after a
# preemption; `running` while its prompt is computed, `decoding` once it is;
# `popped` between a deferred free and its `release`; `ended` after finish,
# abort or release.
Phase = Literal["absent", "waiting", "running", "decoding", "popped", "ended"]
PHASES: tuple[Phase, ...] = ("absent", "waiting", "running", "decoding", "popped", "ended")
LIVE: frozenset[Phase] = frozenset({"waiting", "running", "decoding"})

# A field's type, as the parser checks it.
FieldType = Literal[
    "req",  # a request name (str)
    "prompt",  # a list of prompt segments
    "int",  # an int >= 0
    "int_or_auto",  # an int >= 1, or "auto"
    "int_or_all",  # an int >= 0, or "all"
    "how",  # finish / abort / preempt
    "bool",  # true / false
    "text",  # a non-empty one-line string
    "mm",  # a list of multimodal placeholders {offset, length, id}
    "indices",  # a non-empty, increasing list of ints >= 0
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
    # The phases of its request the format accepts the op in (empty: the op
    # names no request); the validator and the driver refuse it elsewhere.
    valid_in: frozenset[Phase] = frozenset()
    # The phases a scheduler issues it in (exploration draws only those);
    # None: wherever it is valid.
    issued_in: frozenset[Phase] | None = None

    @property
    def needs_request(self) -> bool:
        """The request must have arrived before this op."""
        return bool(self.valid_in) and "absent" not in self.valid_in

    @property
    def realistic_in(self) -> frozenset[Phase]:
        return self.valid_in if self.issued_in is None else self.issued_in


FIELD_TYPES: dict[str, FieldType] = {
    "req": "req",
    "prompt": "prompt",
    "tokens": "int_or_auto",
    "lookahead": "int",
    "spec": "int",
    "accepted": "int",
    "sample": "int",
    "steps": "int",
    "how": "how",
    "blocks": "int_or_all",
    "skip_prefix_cache": "bool",
    # arrive (additive), the request's inputs that enter its block hashes as
    # in vLLM: its cache salt, LoRA adapter (by name) and multimodal items.
    "cache_salt": "text",
    "lora": "text",
    "mm": "mm",
    # lookup / prefill with a KV connector (config `kv_connector`): the prefix
    # the connector has the KV of, and whether it loads it asynchronously.
    "remote_hit": "int",
    "remote_async": "bool",
    # lookup: the request's async load failed (policy recompute: the
    # scheduler frees its blocks and looks it up again); free (additive,
    # policy fail): the scheduler ends the request because its load failed
    "load_failed": "bool",
    # allocate (additive), what vLLM's Scheduler decides around the call: the
    # speculative rows it padded a one-token admission chunk with; the free
    # blocks an async load's allocation must leave (`reserved_blocks`); and
    # a scan that completed a reported load with nothing to run this step.
    "pad": "int",
    "reserved": "int",
    "complete_only": "bool",
    # allocate (policy recompute) / free (policy fail), additive: the blocks
    # of the request's KV load the worker reported invalid
    # (`invalid_block_ids`), as indices into its block table
    "invalid_blocks": "indices",
    # allocate / pop (additive), under async scheduling: the request's
    # tokens a batch still in flight computes, which the release of skipped
    # blocks (the allocation's, a KV connector's at the end) does not count
    # yet (vLLM's `num_in_flight_tokens`).
    "in_flight": "int",
    # drain (additive), with a KV connector under async scheduling: keep the
    # copies' retained endpoints aside until a batch in flight is done
    # (`keep_retained`), and free the oldest set kept aside, first
    # (`release_retained`).
    "keep_retained": "bool",
    "release_retained": "bool",
    # allocate / decode1 (additive), with drafts: the re-cache vLLM's
    # Scheduler runs once the step's output is in (`update_from_output`)
    # waits for the step's `drain` instead of running in the op, so that
    # requests looked up later in the same step do not see it.
    "defer_recache": "bool",
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

# What a `residency` op reports a trace may expect (kvgate.vocabulary.
# residency): the eviction events drained, and how many carry 0..3 reuse gaps.
RESIDENCY_KEYS: tuple[str, ...] = ("evicted", "reuse_gaps")

# A lookup's fields for a KV connector, and what a lookup reports: `hit` and
# `junction` (as the scheduler takes them), and with a connector (additive)
# `local_hit`, the local lookup's own hit before the connector branch, and
# `external`, the connector's tokens the scheduler takes.
CONNECTOR_FIELDS: tuple[str, ...] = ("remote_hit", "remote_async", "load_failed")
LOOKUP_KEYS: tuple[str, ...] = ("hit", "junction", "local_hit", "external")

# An arrival's hash inputs (`tokens.HashInputs`).
HASH_INPUT_FIELDS: tuple[str, ...] = ("cache_salt", "lora", "mm")

ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action(
            "arrive",
            ("req", "prompt"),
            ("skip_prefix_cache", *HASH_INPUT_FIELDS),
            valid_in=frozenset({"absent"}),
        ),
        Action(
            "lookup",
            ("req",),
            CONNECTOR_FIELDS,
            expect_keys=LOOKUP_KEYS,
            valid_in=LIVE,
        ),
        Action("reserve", ("req",), expect_keys=("blocks", "step_blocks"), valid_in=LIVE),
        Action(
            "allocate",
            ("req", "tokens"),
            (
                "lookahead",
                "sample",
                "pad",
                "reserved",
                "complete_only",
                "invalid_blocks",
                "in_flight",
                "defer_recache",
            ),
            expect_keys=("ok", "tokens"),
            valid_in=LIVE,
            issued_in=frozenset({"waiting", "running"}),
        ),
        Action(
            "decode1",
            ("req",),
            ("spec", "lookahead", "accepted", "defer_recache"),
            expect_keys=("ok",),
            valid_in=LIVE,
            issued_in=frozenset({"decoding"}),
        ),
        Action("step", ()),
        Action("drain", (), ("keep_retained", "release_retained"), expect_keys=("copies",)),
        Action("free", ("req", "how"), ("load_failed", "invalid_blocks"), valid_in=LIVE),
        Action("pop", ("req",), ("in_flight",), valid_in=LIVE),
        Action("release", ("req",), valid_in=frozenset({"popped"})),
        Action("evict", ("blocks",)),
        # Additive to version 1: the calls a deployment makes besides
        # scheduling (see docs/trace-format.md, "Cache reset, events, stats").
        Action("reset", (), expect_keys=("ok",)),
        Action("events", (), expect_keys=("events",)),
        Action("stats", (), expect_keys=STATS_KEYS),
        Action("residency", (), expect_keys=RESIDENCY_KEYS),
        Action("check", ()),
        Action(
            "prefill",
            ("req",),
            ("lookahead", *CONNECTOR_FIELDS),
            expect_keys=LOOKUP_KEYS,
            macro=True,
            valid_in=LIVE,
        ),
        Action("decode", ("req", "steps"), ("spec",), macro=True, valid_in=LIVE),
    )
}

PRIMITIVE_OPS: tuple[str, ...] = tuple(n for n, a in ACTIONS.items() if not a.macro)


def out_of_phase(op: str, req: str, phase: Phase, since: str = "") -> str:
    """Why `op` cannot act on `req` in `phase` (`since`: when it got there)."""
    when = f" ({since})" if since else ""
    if op == "arrive":
        return f"request {req!r} has already arrived"
    if phase == "absent":
        return f"request {req!r} is used before `arrive`"
    if op == "release":
        return f"`release` of {req!r} without a prior `pop`"
    if phase == "popped":
        return f"request {req!r} was popped{when}; only `release` may follow"
    if phase == "ended":
        return f"request {req!r} has ended{when}"
    if op == "decode1":
        return f"`decode1` of {req!r} before its prompt is computed"
    return f"`{op}` of {req!r}, whose prompt is computed"


def next_phase(
    op: str, phase: Phase, how: str | None = None, observed: Mapping[str, Any] | None = None
) -> Phase:
    """The request's phase after `op` (with `how` for `free`). `observed` is
    what the op reported; without it (the validator, before anything runs) an
    allocation is taken to succeed and leave the prompt unfinished."""
    if op == "arrive":
        return "waiting"
    if op in ("allocate", "decode1"):
        if observed is not None and observed.get("ok") is not True:
            return phase
        finished = op == "decode1" or (observed is not None and observed.get("prompt_done") is True)
        return "decoding" if finished else "running"
    if op == "free":
        return "waiting" if how == "preempt" else "ended"
    if op == "pop":
        return "popped"
    if op == "release":
        return "ended"
    return phase


# The type of each `expect` value, as the parser checks it: "int" is an int
# >= 0, "bool" a YAML boolean, "copies" a list of [src, dst] block-id pairs,
# "events" a list of event lines (kvgate.vocabulary.events), "counts" a list
# of ints >= 0.
ExpectType = Literal["int", "bool", "copies", "events", "counts"]

EXPECT_TYPES: dict[str, ExpectType] = {
    "hit": "int",
    "junction": "int",
    "local_hit": "int",
    "external": "int",
    "blocks": "int",
    "step_blocks": "int",
    "ok": "bool",
    "tokens": "int",
    "copies": "copies",
    "events": "events",
    **{key: "int" for key in STATS_KEYS if key != "reset"},
    "reset": "bool",
    "evicted": "int",
    "reuse_gaps": "counts",
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
    # decode1: the first `accepted` of its `spec` drafts the model runner
    # accepts (it samples them, then one token of its own).
    accepted: int = 0
    sample: int = 0  # allocate: output tokens sampled when the chunk computes every token
    how: str | None = None
    blocks: int | Literal["all"] | None = None
    # arrive: the request never reads the prefix cache (prompt logprobs, pooling)
    skip_prefix_cache: bool = False
    # arrive: the inputs besides its tokens that enter its block hashes
    cache_salt: str = ""
    lora: str = ""
    mm: tuple[MmItem, ...] = ()
    # lookup (and prefill): the KV connector has the request's first
    # `remote_hit` tokens, loaded asynchronously with `remote_async`
    remote_hit: int = 0
    remote_async: bool = False
    # lookup: the request's async KV load failed as a whole (`failed_recving`,
    # policy recompute); free: the scheduler fails the request for it (policy
    # fail)
    load_failed: bool = False
    # allocate: `pad` speculative rows on a one-token chunk; `reserved` free
    # blocks an async load's allocation leaves; `complete_only`: only complete
    # the request's reported KV load
    pad: int = 0
    reserved: int = 0
    complete_only: bool = False
    # allocate (policy recompute) / free (policy fail): indices into the
    # request's block table of the blocks its KV load failed to fill
    # (`invalid_block_ids`; one KV-cache group only)
    invalid_blocks: tuple[int, ...] = ()
    # allocate / pop: the request's tokens a batch in flight computes (async scheduling)
    in_flight: int = 0
    # drain: keep the copies' retained endpoints aside; free the oldest kept set first
    keep_retained: bool = False
    release_retained: bool = False
    # allocate / decode1: the output's re-cache waits for the step's drain
    defer_recache: bool = False
    expect: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # the `decode` macro's repeat count; the parser expands it

    @property
    def hash_inputs(self) -> HashInputs:
        """An arrival's hash inputs (none for other ops)."""
        if not (self.cache_salt or self.lora or self.mm):
            return NO_INPUTS
        return HashInputs(self.cache_salt, self.lora, self.mm)

    def where(self) -> str:
        """`step 6 (prefill: allocate #2)`: a place a person can find."""
        if self.index < 0:
            return "config"
        if self.origin is None:
            return f"step {self.index} ({self.op})"
        return f"step {self.index} ({self.origin}: {self.op} #{self.part})"


def step_state(op: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """What the steps `read_step` builds from one line of a trace share: its
    op and `values` (read and checked fields of `Step`), and a place for
    each field a step has of its own (`index`, `expect`, `check`)."""
    assert not values.keys() & _PER_STEP, "a field made per step is not a line's value"
    return {**values, "op": op, "index": -1, "expect": None, "check": None}


def read_step(state: dict[str, Any], index: int, expect: dict[str, Any]) -> Step:
    """The step `Step(op, index, **values, expect=expect)` builds, for a
    trace's reader, at a fraction of the cost (`state` is `step_state(op,
    values)`): a step sets only the few fields it has, the others read the
    class's defaults, and it is as frozen as any step. (The frozen
    constructor sets each of some thirty fields through `object.__setattr__`;
    a long trace's steps took a quarter of its reading to build that way.)"""
    step: Step = object.__new__(Step)
    own = state.copy()
    own["index"] = index
    own["expect"] = expect
    own["check"] = {}
    object.__setattr__(step, "__dict__", own)
    return step


# The fields whose default is made per step (no class default to fall back
# on): `read_step` makes each of them.
_PER_STEP = frozenset(f.name for f in fields(Step) if f.default_factory is not MISSING)
assert {"expect", "check"} == _PER_STEP, "read_step makes each field made per step"

# Where a refusal trace's verdict is reached: its config, before any step.
CONFIG_STEP = Step("config", index=-1)


@dataclass(frozen=True)
class Segment:
    """One prompt segment: `fresh`, `all_of`, `prompt_of` or `tokens`."""

    kind: Literal["fresh", "all_of", "prompt_of", "tokens"]
    count: int = 0
    req: str | None = None
    token_ids: tuple[int, ...] = ()
