"""Shrink a diverging trace to a small one that diverges at the same field.

`Shrinker` reduces either kind of trace, manager-level (`steps`) or
scheduler-level (`engine`), by delta debugging (`ddmin`) in this order:

1. everything after the first divergence is cut (nothing after it counts);
   then the requests that ended earliest are dropped, as many as still
   diverge alike, found by bisection (a request another kept one's prompt
   names stays): a long history's failure usually needs only its last
   few requests, and this finds them in a few replays of ever shorter
   prefixes; then the pool shrunk (`num_blocks`): every step of every
   candidate compares the whole pool at level `strict`, so a small pool
   first makes the rest several times faster;
2. requests: a request is dropped with every step that names it, and with
   every request whose prompt or `follows` names it (their steps could not
   be valid without it);
3. steps, one by one and in chunks;
4. numbers: each `fresh` prompt segment's length, each arrival's
   `max_tokens` and each `decode`'s repeat count, then the pool
   (`num_blocks`), each the smallest that still diverges (by bisection).

The phases repeat while one of them still removes something. A long
history need not be held: `kvgate shrink` finds the first divergence of a
trace written one entry a line (manager steps or engine entries) by a
streamed replay (`without_expectations` applies to a stream too,
`BareStream`), then hands the shrinker only the prefix up to it, and the
whole history's length for its account (`history_steps`). Each
candidate's verdict is remembered by its text's digest, not the text. A
candidate is written with the project's writer and read back through the
trace reader, so a candidate the format refuses (a step on a request that
never arrived) is rejected before it runs; one the target or the model refuses
while it runs gets no verdict and is rejected too. Nothing rejected is
ever reported.

A candidate is kept when its replay's first failure is the original's
(`same_failure`): the same kind of step and the same field, at the same
level. What a replay is and on which target it runs is the caller's
(`Judge`): the shrinker never cares where the trace came from.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvgate.conformance.replay import Divergence, ReplayResult
from kvgate.conformance.trace import Trace, TraceError, parse_trace
from kvgate.conformance.writer import dump_engine_trace, dump_trace
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep

# A candidate's replay on the target: its result, or None when it got no
# verdict (the target or the model refused a step, or the model raised).
Judge = Callable[[Trace], ReplayResult | None]

Item = Step | EngineStep
T = TypeVar("T")

# How often the phases are run again while one of them still shrinks.
MAX_ROUNDS = 3


def failure_field(divergence: Divergence) -> str:
    """A divergence's field without the places that name where it was seen
    (an engine step's number, a block id, a request's block table), which
    a smaller trace changes."""
    what = re.sub(r"^engine step \d+: ", "", divergence.what)
    what = re.sub(r"^block \d+ ", "block ", what)
    return re.sub(r"^.* block table$", "block table", what)


def failure_key(divergence: Divergence) -> tuple[str, str, str]:
    """(step kind, level, field): what a shrunk trace must still fail with."""
    return divergence.step.op, divergence.level, failure_field(divergence)


def same_failure(result: ReplayResult | None, key: tuple[str, str, str]) -> bool:
    return (
        result is not None
        and result.divergence is not None
        and failure_key(result.divergence) == key
    )


def ddmin(items: Sequence[T], passes: Callable[[list[T]], bool]) -> list[T]:
    """Delta debugging by complements: a smallest list (no single chunk of it
    can be removed, down to single items) of `items` that `passes`, which
    `items` itself does."""
    kept = list(items)
    chunks = 2
    while len(kept) >= 2:
        size = -(-len(kept) // chunks)
        for start in range(0, len(kept), size):
            rest = kept[:start] + kept[start + size :]
            if rest and passes(rest):
                kept = rest
                chunks = max(chunks - 1, 2)
                break
        else:
            if chunks >= len(kept):
                break
            chunks = min(2 * chunks, len(kept))
    return kept


@dataclass(frozen=True)
class Shrunk:
    """The smallest candidate found, and how it fails."""

    trace: Trace  # read back from `text`
    text: str
    result: ReplayResult
    steps_before: int
    steps_after: int
    tried: int  # candidates replayed (invalid ones not counted)

    def renamed(self, shrinker: Shrinker, name: str, about: str) -> str:
        """The shrunk trace's text under another name and `about`."""
        return shrinker.text(self.trace.config, _items(self.trace), name, about)

    def account(self, target: str) -> str:
        """`from 514 steps to 4, diverges on vllm at step 3 (free): free queue (strict)`."""
        d = self.result.divergence
        assert d is not None
        return (
            f"from {self.steps_before} steps to {self.steps_after}, diverges on {target} at "
            f"{d.step.where()}: {d.what} ({d.level})"
        )


def step_count(trace: Trace) -> int:
    """A trace's length as the account gives it: written steps, or engine steps."""
    return len(trace.engine) if trace.scheduler_level else len(trace.steps)


def without_expectations(trace: Trace) -> tuple[Item, ...]:
    """The trace's steps with no `expect` values and no `check` steps: what
    a candidate replays, so that it fails only where target and model differ."""
    if trace.scheduler_level:
        return tuple(replace(e, expect={}) for e in trace.engine)
    return tuple(replace(s, expect={}) for s in trace.steps if s.op != "check")


@dataclass(frozen=True)
class BareStream:
    """A streamed trace's steps or engine entries
    (`conformance.stream.StepStream`) as `without_expectations` leaves them,
    read as they replay."""

    stream: Any

    def primitives(self, forget: Callable[[list[str]], None] | None = None) -> Iterator[Step]:
        for step in self.stream.primitives(forget):
            if step.op != "check":
                yield replace(step, expect={})

    def engine(self, forget: Callable[[list[str]], None] | None = None) -> Iterator[EngineStep]:
        for entry in self.stream.engine(forget):
            yield replace(entry, expect={})


def streamed_without_expectations(trace: Trace) -> Trace:
    """A streamed trace replayed as `without_expectations` leaves it."""
    assert trace.stream is not None
    return replace(trace, stream=BareStream(trace.stream))


class Shrinker:
    """Shrinks `trace` (see the module's docstring). `keep_expectations`:
    candidates keep the trace's `expect` and `check` values (a target judged
    by them alone, as the model is); otherwise they carry none."""

    def __init__(
        self,
        trace: Trace,
        judge: Judge,
        keep_expectations: bool = False,
        progress: Callable[[str], None] | None = None,
        history_steps: int | None = None,
    ) -> None:
        # Its head alone (name, about, tags, path): the steps a candidate
        # needs are `items`, so a long trace's are let go once it is cut.
        self.original = replace(trace, steps=(), primitives=(), engine=())
        # The whole history's length, when `trace` is the prefix of it up
        # to its first divergence (the account counts from the history).
        self.history_steps = step_count(trace) if history_steps is None else history_steps
        self.judge = judge
        self.progress = progress
        self.config = trace.config
        self.settings = trace.scheduler or EngineSettings()
        if keep_expectations:
            self.items: tuple[Item, ...] = trace.engine if trace.scheduler_level else trace.steps
        else:
            self.items = without_expectations(trace)
        # Each candidate's verdict, by its text's digest.
        self.results: dict[bytes, ReplayResult | None] = {}
        self.key: tuple[str, str, str] | None = None
        self.best: tuple[Trace, str, ReplayResult] | None = None

    # -- candidates ---------------------------------------------------------

    def text(self, config: Config, items: Iterable[Item], name: str = "", about: str = "") -> str:
        """A candidate's text, named as the original unless `name` is given."""
        name, about = name or self.original.name, about or self.original.about
        if self.original.scheduler_level:
            engine = [i for i in items if isinstance(i, EngineStep)]
            return dump_engine_trace(name, config, self.settings, engine, about, self.original.tags)
        return dump_trace(name, config, [i for i in items if isinstance(i, Step)], about)

    def reference_trace(self) -> Trace:
        """The trace as candidates replay it; `TraceError` if that is no
        trace (nothing but `check` steps, say)."""
        return parse_trace(self.text(self.config, self.items), self.original.path)

    def read(self, text: str) -> Trace | None:
        try:
            return parse_trace(text, self.original.path)
        except TraceError:
            return None

    def run(self, config: Config, items: Sequence[Item]) -> ReplayResult | None:
        """The candidate's replay (None: invalid, or no verdict); kept as the
        best so far when it fails as the original does."""
        text = self.text(config, items)
        digest = hashlib.sha256(text.encode()).digest()
        if digest in self.results:
            return self.results[digest]
        candidate = self.read(text)
        result = None if candidate is None else self.judge(candidate)
        # Remembered without the candidate's steps (the best one is kept below).
        self.results[digest] = None if result is None else replace(result, trace=self.original)
        if candidate is not None and result is not None and result.divergence is not None:
            if self.key is None:  # the reference: what every candidate must keep
                self.key = failure_key(result.divergence)
            if failure_key(result.divergence) == self.key:
                self.best = (candidate, text, result)
                self.config = candidate.config
                self.items = _items(candidate)
        return result

    def passes(self, config: Config, items: Sequence[Item]) -> bool:
        assert self.key is not None
        return same_failure(self.run(config, items), self.key)

    # -- the phases ---------------------------------------------------------

    def reference(self) -> ReplayResult | None:
        """The trace as candidates replay it (None: no verdict); its first
        failure, if any, is what every candidate must keep."""
        return self.run(self.config, self.items)

    def shrink(self) -> Shrunk:
        """The smallest candidate found; `reference` must have found a divergence."""
        assert self.best is not None, "the reference diverged"
        for _ in range(MAX_ROUNDS):
            before = self.best[1]
            self.cut_after_divergence()
            self.drop_ended_requests()
            self.shrink_pool()
            self.drop_requests()
            self.cut_after_divergence()
            self.drop_steps()
            self.cut_after_divergence()
            self.shrink_numbers()
            if self.best[1] == before:
                break
        trace, text, result = self.best
        return Shrunk(
            trace,
            text,
            result,
            self.history_steps,
            step_count(trace),
            sum(1 for r in self.results.values() if r is not None),
        )

    def say(self, phase: str) -> None:
        if self.progress is not None:
            assert self.best is not None
            tried = sum(1 for r in self.results.values() if r is not None)
            self.progress(f"{phase}: {step_count(self.best[0])} steps ({tried} candidates run)")

    def cut_after_divergence(self) -> None:
        """Nothing after the first divergence ever runs."""
        assert self.best is not None
        trace, _, result = self.best
        assert result.divergence is not None
        at = result.divergence.step.index
        if trace.scheduler_level:
            # The engine steps run, the diverging one last; but a missed
            # expectation does not end a replay, so the entries up to its
            # line (an entry that expects is one engine step) end it then.
            end = min(result.steps_run, sum(1 for item in self.items if item.index <= at))
        else:
            end = at + 1
        if end < len(self.items):
            self.passes(self.config, self.items[:end])
        self.say("after the divergence cut")

    def drop_ended_requests(self) -> None:
        """The requests that ended first dropped, as many as still diverge
        alike (by bisection on how many), each a request a kept one's
        prompt names kept (`_ended_first`)."""
        items = self.items
        order = _ended_first(items)
        low, high = 0, len(order)  # dropping `low` passes (none: the best so far)
        while high - low > 1:
            middle = (low + high) // 2
            if self.passes(self.config, _drop_ended(items, order[:middle])):
                low = middle
            else:
                high = middle
        self.say("ended requests dropped")

    def drop_requests(self) -> None:
        names = _requests(self.items)
        if len(names) < 2:
            return

        def keep(kept: list[str]) -> bool:
            return self.passes(self.config, _keep_requests(self.items, set(kept)))

        ddmin(names, keep)
        self.say("requests dropped")

    def drop_steps(self) -> None:
        ddmin(list(self.items), lambda kept: self.passes(self.config, kept))
        self.say("steps dropped")

    def shrink_numbers(self) -> None:
        for slot in _slots(self.items):

            def with_value(value: int, slot: Slot = slot) -> tuple[Config, Sequence[Item]]:
                return self.config, _set(self.items, slot, value)

            smallest = self.bisect(_get(self.items, slot), with_value)
            if smallest is not None:
                self.passes(*with_value(smallest))
        self.shrink_pool()
        self.say("numbers shrunk")

    def shrink_pool(self) -> None:
        """The fewest blocks that still diverge alike."""
        smallest = self.bisect(
            self.config.num_blocks,
            lambda v: (replace(self.config, num_blocks=v), self.items),
        )
        if smallest is not None:
            self.passes(replace(self.config, num_blocks=smallest), self.items)

    def bisect(
        self, value: int, candidate: Callable[[int], tuple[Config, Sequence[Item]]]
    ) -> int | None:
        """The smallest value in 1..`value` found to pass, by bisection
        (`value` passes); None when none below `value` does."""
        low, high = 1, value
        while low < high:
            middle = (low + high) // 2
            if self.passes(*candidate(middle)):
                high = middle
            else:
                low = middle + 1
        return high if high < value else None


# -- what a candidate is made of ---------------------------------------------


def _items(trace: Trace) -> tuple[Item, ...]:
    return trace.engine if trace.scheduler_level else trace.steps


def _requests(items: Sequence[Item]) -> list[str]:
    """The requests that arrive, in order."""
    return [i.req for i in items if i.op == "arrive" and i.req is not None]


def _named(item: Item) -> set[str]:
    """The requests an arrival's prompt or `follows` names."""
    if item.op != "arrive":
        return set()
    names = {s.req for s in item.prompt if s.req is not None}
    if isinstance(item, EngineStep) and item.follows is not None:
        names.add(item.follows)
    return names


def _ended_first(items: Sequence[Item]) -> list[str]:
    """The requests that arrive, by the last item that names them, earliest first."""
    last: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.req is not None:
            last[item.req] = index
        for name in _named(item):
            last[name] = index
    return sorted(_requests(items), key=lambda name: last.get(name, 0))


def _drop_ended(items: Sequence[Item], ended: Sequence[str]) -> list[Item]:
    """`items` without the `ended` requests, but for those a kept request's
    arrival names (transitively: a prompt names only earlier requests)."""
    kept = set(_requests(items)) - set(ended)
    for item in reversed(items):
        if item.op == "arrive" and item.req in kept:
            kept |= _named(item)
    return _keep_requests(items, kept)


def _keep_requests(items: Sequence[Item], kept: set[str]) -> list[Item]:
    """`items` without the requests not `kept`, nor any request whose
    arrival names one of those (transitively)."""
    dropped = set(_requests(items)) - kept
    for item in items:
        if item.op == "arrive" and item.req is not None and _named(item) & dropped:
            dropped.add(item.req)
    return [i for i in items if i.req is None or i.req not in dropped]


# A number a candidate may make smaller: (item index, what, segment index).
Slot = tuple[int, str, int]


def _slots(items: Sequence[Item]) -> list[Slot]:
    slots: list[Slot] = []
    for index, item in enumerate(items):
        if item.op == "arrive":
            slots.extend(
                (index, "fresh", j) for j, s in enumerate(item.prompt) if s.kind == "fresh"
            )
            if isinstance(item, EngineStep):
                slots.append((index, "max_tokens", 0))
        elif item.op == "decode" and isinstance(item, Step):
            slots.append((index, "steps", 0))
    return slots


def _get(items: Sequence[Item], slot: Slot) -> int:
    index, what, segment = slot
    item = items[index]
    if what == "fresh":
        return item.prompt[segment].count
    value: int = getattr(item, what)
    return value


def _set(items: Sequence[Item], slot: Slot, value: int) -> list[Item]:
    index, what, segment = slot
    item = items[index]
    changed: Item
    if what == "fresh":
        prompt = list(item.prompt)
        prompt[segment] = Segment("fresh", count=value)
        changed = replace(item, prompt=tuple(prompt))
    elif isinstance(item, EngineStep):  # an arrival's max_tokens
        changed = replace(item, max_tokens=value)
    else:  # a decode's repeat count
        changed = replace(item, steps=value)
    return [*items[:index], changed, *items[index + 1 :]]
