"""Each trace's verdict by cause, and what a build's missing capability costs.

A replay says whether a target conformed; an operator needs to know why it
did not. Every outcome is sorted into one cause:

- conforms: the trace passed;
- diverges: the target differs from the lockstep model, or misses one of
  the trace's own expectations for a reason other than a missing capability
  (the deploy blocker);
- lacks a capability: the trace's config asks for a capability the build
  does not offer (`CAPABILITIES`), the lockstep model without it agreed
  with the target at every step, and only the trace's own expectations
  missed: the build does what it was built to do, without that capability;
- not applicable: the target refuses the trace's config (a refusal trace,
  which expects exactly that, keeps its own pass or fail);
- error: the trace asked for something it may not, or kvgate's own model
  raised (a bug in kvgate).

Whether a missing capability fails the gate is the user's policy
(`--require`); `DEFAULT_REQUIRED` is the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvgate.conformance.replay import Divergence, Outcome, ReplayResult, TraceRunError
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.target import Capabilities


class Verdict(Enum):
    CONFORMS = "conforms"
    DIVERGES = "diverges"
    LACKS = "lacks a capability"
    NOT_APPLICABLE = "not applicable"
    ERROR = "error"
    BUG = "kvgate bug"


@dataclass(frozen=True)
class Capability:
    """A capability a trace may ask for and a build may lack."""

    name: str  # as `--require` spells it
    what: str  # what it is, for the summary
    asked: Callable[[Config], bool]
    offered: Callable[[Capabilities], bool]
    remedy: str


CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        name="hold",
        what="the partial-tail hold",
        asked=lambda config: config.hold,
        offered=lambda capabilities: capabilities.hold,
        remedy="serve with kvgate's hold overlay: install kvgate in the serving environment "
        "and start vllm serve with VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1 (gate that with "
        "--plugin entry-points), or a vLLM build carrying the hold",
    ),
    Capability(
        name="retention",
        what="the retained-state retention (a request keeps the newest Mamba state "
        "leaving its table)",
        asked=lambda config: config.retain_retired,
        offered=lambda capabilities: capabilities.retain_retired,
        remedy="a vLLM build with that retention, or --plugin kvgate.impl.hold_overlay",
    ),
)
CAPABILITY_NAMES: tuple[str, ...] = tuple(c.name for c in CAPABILITIES)
# `--require none`: gate the build's own semantics, whatever it lacks.
REQUIRE_NONE = "none"
# A build without the hold misses a follow-up turn's cached prefix entirely
# once a burst of other requests evicted it: the multi-turn agent load's
# production bug. Gating for that load is the default.
DEFAULT_REQUIRED: tuple[str, ...] = ("hold",)
# The `expect` keys whose value is a lookup's hit in tokens.
HIT_KEYS = ("hit", "local_hit")
# A Scheduler-level step's `expect` key holding each request's cached tokens.
ENGINE_HIT_KEY = "cached_tokens"


def lacking(result: ReplayResult) -> tuple[Capability, ...]:
    """The capabilities `result`'s trace asks for that its target lacks."""
    return tuple(
        c
        for c in CAPABILITIES
        if c.asked(result.trace.config) and not c.offered(result.capabilities)
    )


def verdict(outcome: Outcome) -> Verdict:
    if isinstance(outcome, TraceRunError):
        if outcome.bug:
            return Verdict.BUG
        return Verdict.NOT_APPLICABLE if outcome.config_refused else Verdict.ERROR
    if outcome.passed:
        return Verdict.CONFORMS
    only_expectations = all(d.level == "expect" for d in outcome.failures)
    if only_expectations and outcome.trace.expect_refused is None and lacking(outcome):
        return Verdict.LACKS
    return Verdict.DIVERGES


def resolve_required(names: Iterable[str] | None) -> tuple[str, ...]:
    """`--require` as given (each value may list several, comma-separated)
    to the capability names required; None is the default."""
    if names is None:
        return DEFAULT_REQUIRED
    required: list[str] = []
    for value in names:
        for name in (part.strip() for part in value.split(",")):
            if name == REQUIRE_NONE:
                continue
            if name not in CAPABILITY_NAMES:
                raise ValueError(
                    f"unknown capability {name!r} "
                    f"(choose from {', '.join((*CAPABILITY_NAMES, REQUIRE_NONE))})"
                )
            if name not in required:
                required.append(name)
    return tuple(required)


def fails_requirement(outcome: Outcome, required: Sequence[str]) -> bool:
    """A trace that lacks a capability the user requires."""
    if not isinstance(outcome, ReplayResult) or verdict(outcome) is not Verdict.LACKS:
        return False
    return any(c.name in required for c in lacking(outcome))


@dataclass(frozen=True)
class Cost:
    """What the traces lacking a capability show it costs: the lookups that
    found less of the prompt cached than the trace expects."""

    traces: int
    short_lookups: int
    total_misses: int  # of those, lookups that found nothing at all
    tokens: int  # cached tokens not found, to be computed again

    def text(self) -> str:
        if not self.short_lookups:
            return "no lookup found less than expected (held states and refs differ)"
        if self.short_lookups == self.total_misses:
            found = f"{self.short_lookups} lookups miss their cached prefix entirely"
        else:
            found = (
                f"{self.short_lookups} lookups find less cached than expected, "
                f"{self.total_misses} of them nothing"
            )
        return f"{found} ({self.tokens} cached tokens to compute again)"


def cost(results: Iterable[ReplayResult]) -> Cost:
    """The lookups that came short in `results`' missed expectations (one per
    step and request: its largest shortfall over the hit keys)."""
    traces = short = total = tokens = 0
    for result in results:
        traces += 1
        shortfall: dict[tuple[int, str, str], tuple[int, int]] = {}
        for failure in result.failures:
            for request, missed in _hit_shortfalls(failure, result.cached_tokens):
                where = (failure.step.index, failure.step.where(), request)
                if missed[0] > shortfall.get(where, (0, 0))[0]:
                    shortfall[where] = missed
        for tokens_short, found in shortfall.values():
            short += 1
            total += found == 0
            tokens += tokens_short
    return Cost(traces, short, total, tokens)


def _hit_shortfalls(
    failure: Divergence, reported: Mapping[str, int]
) -> list[tuple[str, tuple[int, int]]]:
    """(request, (tokens short, tokens found)) of each lookup the trace
    expected more of: a manager-level lookup's hit, or a request's cached
    tokens at a Scheduler-level step ("" names a manager-level lookup's
    request: its step says which). A request the target reported at another
    step than the trace expects is judged by what it `reported` then."""
    if failure.level != "expect":
        return []
    expected, actual = failure.expected, failure.actual
    if failure.what in HIT_KEYS:
        missed = _shortfall(expected, actual)
        return [] if missed is None else [("", missed)]
    if failure.what == ENGINE_HIT_KEY and isinstance(expected, dict) and isinstance(actual, dict):
        found = (
            (str(r), _shortfall(want, _reported(actual.get(r), reported.get(str(r)))))
            for r, want in expected.items()
        )
        return [(r, missed) for r, missed in found if missed is not None]
    return []


def _reported(at_step: object, first: int | None) -> object:
    return at_step if isinstance(at_step, int) else first


def _shortfall(expected: object, actual: object) -> tuple[int, int] | None:
    if not isinstance(expected, int) or not isinstance(actual, int) or actual >= expected:
        return None
    return expected - actual, actual
