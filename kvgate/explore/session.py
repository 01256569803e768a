"""One exploration run: apply steps, check every invariant, record the trace.

A `Session` is what the state machine drives: each rule hands it
`kvgate.vocabulary.ops.Step`s, which it applies to the model (and, in
differential mode, to a second target in lockstep), records, and checks
after every step. The first violation or divergence raises
`ExploreFailure`, which carries the recorded steps and the witness that
makes the failure visible on replay, so a failing run is a version-1 trace.

The session also enforces the scheduler's discipline the invariants assume:
a request allocates at most once between two drains (one allocation per
scheduler step), decodes only once its prompt is computed, and never acts
after it ended. A step breaking it raises `Unrealistic` (the machine never
generates one; the trace shrinker uses it to reject candidates).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Literal

from kvgate.conformance.compare import (
    NOT_REPORTED,
    same_check,
    step_difference,
)
from kvgate.conformance.writer import dump_trace
from kvgate.driver.op_driver import OpDriver
from kvgate.explore.failure import TraceFailure
from kvgate.invariants.lifecycle import TRACKERS, Event, Finding, Tracker, Witness
from kvgate.invariants.predicates import (
    SNAPSHOT_INVARIANTS,
    Violation,
    hash_map_consistent,
    one_hold,
)
from kvgate.model import ModelTarget
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import ACTIONS, Phase, Segment, Step, next_phase, out_of_phase
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.target import StepRefused
from kvgate.vocabulary.tokens import prefix_keys

# `crash`: the model raised inside a step the machine chose as realistic (a
# pool run dry inside an allocation its admission check passed, say): the
# manager under test would raise there too, so it is a finding with a trace.
FailureKind = Literal["invariant", "divergence", "crash"]

# Every invariant a session can check, by name.
MODEL_INVARIANTS = ("hash_map_consistent", "one_hold")
ALL_INVARIANTS: tuple[str, ...] = (
    *SNAPSHOT_INVARIANTS,
    *MODEL_INVARIANTS,
    *(t.name for t in TRACKERS),
)
# With the hold off this one fails by design (the seed's total miss).
HOLD_ONLY_INVARIANTS = ("no_total_miss",)


class Unrealistic(Exception):
    """A step the scheduler would never issue in this state."""


@dataclass
class RequestState:
    name: str
    parent: str | None
    phase: Phase = "waiting"


class ExploreFailure(TraceFailure):
    """An invariant violation, a divergence or a crash, with the run that led
    to it."""

    def __init__(
        self,
        kind: FailureKind,
        invariant: str,
        message: str,
        config: Config,
        steps: Sequence[Step],
        witness: Witness,
    ) -> None:
        self.kind = kind
        self.invariant = invariant
        self.message = message
        self.config = config
        self.steps = tuple(steps)  # the failing step last
        self.witness = witness
        super().__init__(f"{kind} {invariant}: {message}")

    def __str__(self) -> str:
        # Built on demand: Hypothesis raises many of these while it shrinks.
        return self.summary()

    def summary(self) -> str:
        return (
            f"{self.kind} {self.invariant} after {len(self.steps)} steps: {self.message}\n"
            + self.yaml()
        )

    def trace_steps(self) -> list[Step]:
        """The recorded steps with the witness in, re-indexed from 0."""
        out: list[Step] = []
        for position, step in enumerate(self.steps):
            if position == self.witness.step:
                step = replace(step, expect={**step.expect, **self.witness.expect})
            out.append(replace(step, index=len(out)))
        if self.witness.check:
            out.append(Step("check", len(out), check=dict(self.witness.check)))
        return out

    def name_prefix(self) -> str:
        return f"explore-{self.invariant.replace('_', '-')}"

    def about(self) -> str:
        hold = "on" if self.config.hold else "off"
        return (
            f"Found by kvgate explore (hold {hold}): {self.kind} {self.invariant}: {self.message}"
        )

    def trace_text(self, name: str, about: str | None) -> str:
        return dump_trace(name, self.config, self.trace_steps(), about)


class RefusalDivergence(ExploreFailure):
    """The model and the lockstep target disagree on a drawn config: one
    refuses it and the other accepts it, or they name different fields.
    Saved as a refusal trace (`expect_refused`: the field one side refused
    by, the model's first), which the gate fails on the disagreeing side."""

    def __init__(self, config: Config, model: str, target: str, field: str) -> None:
        message = f"config: model {model}; target {target}"
        super().__init__("divergence", "config_refusal", message, config, (), Witness())
        self.field = field

    def trace_text(self, name: str, about: str | None) -> str:
        return dump_trace(name, self.config, (), about, self.field)


class Session:
    """Steps applied to the model (and a lockstep target), checked, recorded."""

    def __init__(
        self,
        config: Config,
        invariants: Iterable[str] = ALL_INVARIANTS,
        lockstep: Callable[[Config], OpDriver[Any]] | None = None,
        counts: Counter[str] | None = None,
    ) -> None:
        self.config = config
        self.model = ModelTarget(config)
        self.other = lockstep(config) if lockstep is not None else None
        self.invariants = frozenset(invariants)
        unknown = self.invariants - set(ALL_INVARIANTS)
        if unknown:
            raise ValueError(f"unknown invariants: {', '.join(sorted(unknown))}")
        self.trackers: list[Tracker] = [t(self) for t in TRACKERS if t.name in self.invariants]
        self.steps: list[Step] = []
        self.requests: dict[str, RequestState] = {}
        self.allocated_since_drain: set[str] = set()
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self.last = self.model.snapshot()
        self._prefix: dict[tuple[str, int], tuple[int, dict[str, int]]] = {}

    def close(self) -> None:
        self.model.close()
        if self.other is not None:
            self.other.close()

    # -- the World the trackers read ----------------------------------------

    def parent(self, request: str) -> str | None:
        state = self.requests.get(request)
        return state.parent if state is not None else None

    def prefix_names(self, request: str, group: int) -> dict[str, int]:
        model_request = self.model.requests[request].request
        tokens = self.model.all_tokens(model_request)
        cached = self._prefix.get((request, group))
        if cached is None or cached[0] != len(tokens):
            unit = self.config.hash_unit
            names = {
                f"g{group}/{key}": (i + 1) * unit
                for i, key in enumerate(
                    prefix_keys(
                        tokens, unit, self.config.hash_lookahead_tokens, model_request.inputs
                    )
                )
            }
            cached = (len(tokens), names)
            self._prefix[(request, group)] = cached
        return cached[1]

    def attention_cached(self, request: str) -> int:
        return self.model.attention_cached(self.model.requests[request].request)

    # -- queries for the state machine ----------------------------------------

    def in_phase(self, *phases: Phase) -> list[str]:
        return [r.name for r in self.requests.values() if r.phase in phases]

    def schedulable(self, *phases: Phase) -> list[str]:
        """Requests in `phases` that have not allocated since the last drain."""
        return [n for n in self.in_phase(*phases) if n not in self.allocated_since_drain]

    def tokens(self, request: str) -> int:
        return len(self.model.all_tokens(self.model.requests[request].request))

    def free_blocks(self) -> int:
        return self.model.num_free_blocks()

    # -- running a step --------------------------------------------------------

    def run(self, op: str, **fields: Any) -> dict[str, Any]:
        if op == "check":
            return self.run_check(fields["check"])
        step = Step(op, len(self.steps), **fields)
        self.guard(step)
        before = self.last
        try:
            observed = self.model.apply(step)
        except (StepRefused, Unrealistic, ExploreFailure):
            raise
        except Exception as error:
            self.steps.append(step)
            raise self.fail(
                "crash", "raised", f"{step.where()}: {type(error).__name__}: {error}", Witness()
            ) from error
        self.steps.append(step)
        self.counts[op] += 1
        if op == "free":
            self.counts[f"free:{step.how}"] += 1
        if step.load_failed or step.invalid_blocks:
            # A KV load failure: whole (`load_failed`) or of some blocks, by
            # the op its policy puts it on (lookup/allocate: recompute; free: fail).
            kind = "blocks" if step.invalid_blocks else "whole"
            self.counts[f"load_failure:{kind}:{op}"] += 1
        if observed.get("external") or observed.get("loading"):
            # A lookup that takes a connector's tokens, an async load's allocation.
            self.counts[f"{op}:connector"] += 1
        if op == "residency":
            # The residency metrics' eviction events drained (compared in lockstep).
            self.counts["residency:evicted"] += observed.get("evicted", 0)
        after = self.model.snapshot()
        self.last = after
        if self.other is not None:
            self.lockstep(step, observed, after)
        self.advance(step, observed)
        self.check(Event(len(self.steps) - 1, step, observed, before, after))
        return observed

    def run_check(self, query: Mapping[str, Any]) -> dict[str, Any]:
        """A `check` step: recorded with the model's values (so a replay
        compares a target with them), compared with the lockstep target's."""
        values = self.model.check_values(query)
        step = Step("check", len(self.steps), check={k: values[k] for k in query})
        self.steps.append(step)
        self.counts["check"] += 1
        if self.other is not None:
            theirs = self.other.check_values(query)
            for key in query:
                if not same_check(key, values[key], theirs.get(key, NOT_REPORTED)):
                    raise self.fail(
                        "divergence",
                        f"check-{key}",
                        f"{step.where()}: {key}: model {values[key]!r}, target {theirs.get(key)!r}",
                        Witness(),
                    )
        return values

    def guard(self, step: Step) -> None:
        """Refuse a step the scheduler would never issue: its request out of
        the phases the action table says it is issued in, or a second
        allocation in one scheduler step."""
        action = ACTIONS[step.op]
        if step.req is None or not action.valid_in:
            return
        state = self.requests.get(step.req)
        phase: Phase = state.phase if state is not None else "absent"
        # A request whose loaded blocks failed is scheduled again from the
        # block before them, whether or not its prompt had been computed.
        rescheduled = step.op == "allocate" and bool(step.invalid_blocks)
        if phase not in action.realistic_in and not rescheduled:
            raise Unrealistic(out_of_phase(step.op, step.req, phase))
        if step.op in ("allocate", "decode1") and step.req in self.allocated_since_drain:
            raise Unrealistic(f"{step.req} allocates twice in one scheduler step")

    def advance(self, step: Step, observed: Mapping[str, Any]) -> None:
        """The request's phase after the step (`ops.next_phase`)."""
        req = step.req
        if step.op == "drain":
            self.allocated_since_drain.clear()
        if req is None or not ACTIONS[step.op].valid_in:
            return
        if step.op == "arrive":
            first = step.prompt[0] if step.prompt else None
            parent = first.req if first is not None and first.kind == "all_of" else None
            self.requests[req] = RequestState(req, parent, phase="absent")
        state = self.requests[req]
        if step.op in ("allocate", "decode1"):
            self.allocated_since_drain.add(req)
        state.phase = next_phase(step.op, state.phase, step.how, observed)

    # -- checking --------------------------------------------------------------

    def fail(
        self, kind: FailureKind, invariant: str, message: str, witness: Witness
    ) -> ExploreFailure:
        return ExploreFailure(kind, invariant, message, self.config, self.steps, witness)

    def check(self, event: Event) -> None:
        violations: list[Violation] = []
        for name, predicate in SNAPSHOT_INVARIANTS.items():
            if name in self.invariants:
                violations += predicate(event.after)
        if "hash_map_consistent" in self.invariants:
            violations += hash_map_consistent(self.model.pool)
        if "one_hold" in self.invariants:
            violations += one_hold(event.after, self.config.mamba_group_ids)
        if violations:
            first = violations[0]
            raise self.fail(
                "invariant", first.invariant, first.message, snapshot_witness(event.after)
            )
        findings: list[Finding] = []
        for tracker in self.trackers:
            findings += tracker.observe(event)
        if findings:
            found = findings[0]
            raise self.fail(
                "invariant", found.violation.invariant, found.violation.message, found.witness
            )

    def lockstep(self, step: Step, modeled: Mapping[str, Any], after: Snapshot) -> None:
        """Compare the other target with the model: reported values, then snapshots."""
        assert self.other is not None
        try:
            observed = self.other.apply(step)
        except Exception as error:  # the target raised where the model ran
            raise self.fail(
                "divergence",
                "raised",
                f"{step.where()}: {type(error).__name__}: {error}",
                Witness(),
            ) from error
        other = self.other
        found = step_difference(step.op, modeled, observed, (lambda: after, other.snapshot))
        if found is None:
            return
        level, (what, want, got) = found
        if level == "api":
            expect = {what: want} if what in ACTIONS[step.op].expect_keys else {}
            raise self.fail(
                "divergence",
                f"api-{what}",
                f"{step.where()}: {what}: model {want!r}, target {got!r}",
                Witness(step=len(self.steps) - 1, expect=expect),
            )
        raise self.fail(
            "divergence",
            "strict",
            f"{step.where()}: {what}: model {want!r}, target {got!r}",
            Witness(),
        )


def snapshot_witness(snapshot: Snapshot) -> Witness:
    """For a broken snapshot invariant: the free-block count and (when idle)
    the clean pool that the bookkeeping says the target should show."""
    from kvgate.invariants.predicates import references

    refs = references(snapshot)
    free = sum(1 for i in range(1, len(snapshot.blocks)) if refs[i] == 0)
    check: dict[str, Any] = {"free_blocks": free}
    idle = not (snapshot.tables or snapshot.pending_copies or snapshot.popped)
    if idle and not any(snapshot.holds.values()):
        check["pool_clean"] = True
    return Witness(check=check)


def fresh(n: int) -> tuple[Segment, ...]:
    return (Segment("fresh", count=n),)


def follow_up(parent: str, n: int) -> tuple[Segment, ...]:
    return (Segment("all_of", req=parent), Segment("fresh", count=n))


def share_prompt(other: str, n: int) -> tuple[Segment, ...]:
    """`other`'s prompt (not its output), plus `n` new tokens (none: a resend)."""
    if n == 0:
        return (Segment("prompt_of", req=other),)
    return (Segment("prompt_of", req=other), Segment("fresh", count=n))


# -- shrinking a recorded run --------------------------------------------------


# What a recorded step carries into a replay: every op field (connector
# answers, `sample`, `skip_prefix_cache` included), not its place in a trace
# or what a trace file expects of it.
_PLACE_AND_EXPECTATIONS = frozenset(("op", "index", "part", "origin", "expect", "check", "steps"))
REPLAYED_FIELDS = tuple(
    f.name for f in dataclass_fields(Step) if f.name not in _PLACE_AND_EXPECTATIONS
)


def replayed_fields(step: Step) -> dict[str, Any]:
    """`step`'s op fields, as `Session.run` takes them to record it again."""
    return {name: getattr(step, name) for name in REPLAYED_FIELDS}


def reproduce(
    failure: ExploreFailure,
    steps: Sequence[Step],
    session: Callable[[Config], Session],
) -> ExploreFailure | None:
    """Run `steps` in a new session; the failure if the same one recurs."""
    run = session(failure.config)
    try:
        for step in steps:
            if step.op == "check":
                run.run("check", check=step.check)
                continue
            run.run(step.op, **replayed_fields(step))
    except ExploreFailure as again:
        if again.kind == failure.kind and again.invariant == failure.invariant:
            return again
        return None
    except (Unrealistic, StepRefused):
        return None
    finally:
        run.close()
    return None


def shrink(
    failure: ExploreFailure, session: Callable[[Config], Session], rounds: int = 2
) -> ExploreFailure:
    """Drop steps one at a time (last first) while the same failure recurs.

    Hypothesis has already shrunk the rule sequence; this removes what a rule
    recorded that the failure does not need (a lookup before an admission, a
    drain with nothing queued), which Hypothesis cannot split off.
    """
    best = failure
    for _ in range(rounds):
        changed = False
        position = len(best.steps) - 2  # the failing step itself stays
        while position >= 0:
            candidate = [s for i, s in enumerate(best.steps) if i != position]
            again = reproduce(best, candidate, session)
            if again is not None and len(again.steps) < len(best.steps):
                best, changed = again, True
            position = min(position - 1, len(best.steps) - 2)
        if not changed:
            break
    return best
