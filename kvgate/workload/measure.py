"""Replay a workload trace on a target and count its follow-ups' misses.

Everything counted comes from what the replayed target itself reported:
`Recorder` wraps the target (the replayer is unchanged) and keeps, per
request, what its first admission saw:

- the admitted hit: the last `lookup` before the request's first successful
  `allocate` (what vLLM reports as the request's cached tokens);
- for a follow-up (a prompt that starts with `{all_of: P}`), the
  `attention_cached` of P checked right before that lookup.

A follow-up is a total miss when its admitted hit is 0 while the attention
group still has P's whole prompt cached (every whole attention block of it):
the Mamba state was lost, not the prefix. It is attributed to how P itself
resumed: after a partial-tail resume when P's admitted hit ends inside a
Mamba block, else after a block-aligned one (a cold first turn included).
It also records whether P's own tail state (the state its follow-up would
resume at) sits on a Mamba block boundary: such a tail is keyed as a whole
block, which the partial-tail hold does not cover.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.driver.op_driver import OpDriver
from kvgate.model.mamba import checkpoint_position
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import Snapshot


@dataclass
class Seen:
    """What one request's admissions showed."""

    prompt_tokens: int
    follows: str | None
    last_hit: int = 0
    admitted_hit: int | None = None
    # attention_cached of the previous turn at the last check before a lookup
    previous_cached: int | None = None
    admitted_previous_cached: int | None = None


class Recorder:
    """A target that records admissions while it passes every call through."""

    def __init__(self, inner: OpDriver[Any], on_step: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.on_step = on_step
        self.seen: dict[str, Seen] = {}
        self._checked: dict[str, int] = {}  # req -> attention_cached, last check

    def apply(self, step: Step) -> dict[str, Any]:
        result = self.inner.apply(step)
        if self.on_step is not None:
            self.on_step()
        req = step.req
        if step.op == "arrive" and req is not None:
            first = step.prompt[0]
            request = self.inner.requests[req].request
            self.seen[req] = Seen(
                prompt_tokens=len(self.inner.prompt_tokens(request)),
                follows=first.req if first.kind == "all_of" else None,
            )
        elif step.op == "lookup" and req is not None:
            seen = self.seen[req]
            seen.last_hit = int(result["hit"])
            seen.previous_cached = (
                self._checked.pop(seen.follows, None) if seen.follows is not None else None
            )
        elif step.op == "allocate" and req is not None and result.get("ok") is True:
            seen = self.seen[req]
            if seen.admitted_hit is None:
                seen.admitted_hit = seen.last_hit
                seen.admitted_previous_cached = seen.previous_cached
        return result

    def check_values(self, query: Mapping[str, Any]) -> dict[str, Any]:
        values = self.inner.check_values(query)
        self._checked.update(values.get("attention_cached", {}))
        if self.on_step is not None:
            self.on_step()
        return values

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class FollowUp:
    name: str
    follows: str
    prompt_tokens: int
    hit: int
    previous_hit: int  # how the previous turn itself resumed
    previous_whole: bool  # the previous prompt's whole attention prefix was cached
    partial_resume: bool  # the previous turn resumed inside a Mamba block
    aligned_tail: bool  # the previous turn's own tail state sits on a block boundary

    @property
    def total_miss(self) -> bool:
        return self.hit == 0 and self.previous_whole

    @property
    def cached_fraction(self) -> float:
        return self.hit / self.prompt_tokens


@dataclass(frozen=True)
class ArmCounts:
    """One arm's table row."""

    follow_ups: tuple[FollowUp, ...] = field(default_factory=tuple)

    @property
    def total_misses(self) -> int:
        return sum(f.total_miss for f in self.follow_ups)

    @property
    def after_partial(self) -> int:
        return sum(f.total_miss and f.partial_resume for f in self.follow_ups)

    @property
    def after_aligned(self) -> int:
        return sum(f.total_miss and not f.partial_resume for f in self.follow_ups)

    @property
    def aligned_tail(self) -> int:
        """Total misses whose previous turn's tail state is a whole-block key."""
        return sum(f.total_miss and f.aligned_tail for f in self.follow_ups)

    @property
    def prefix_evicted(self) -> int:
        """Hit 0 with the previous prompt's attention prefix gone too (plain eviction)."""
        return sum(f.hit == 0 and not f.previous_whole for f in self.follow_ups)

    @property
    def mean_cached_fraction(self) -> float:
        if not self.follow_ups:
            return 0.0
        return sum(f.cached_fraction for f in self.follow_ups) / len(self.follow_ups)


def count(recorder: Recorder, config: Config) -> ArmCounts:
    """The follow-ups the replay admitted, classified (see the module doc)."""
    return count_seen(recorder.seen, config)


def count_seen(seen_by_request: Mapping[str, Seen], config: Config) -> ArmCounts:
    """The admitted follow-ups among `seen_by_request`, classified."""
    attention = next(g.block_size for g in config.groups if g.kind == "full_attention")
    mamba = config.scheduler_block_size
    follow_ups = []
    for name, seen in seen_by_request.items():
        if seen.follows is None or seen.admitted_hit is None:
            continue
        previous = seen_by_request[seen.follows]
        if previous.admitted_hit is None or seen.admitted_previous_cached is None:
            continue
        whole = previous.prompt_tokens // attention * attention
        tail = checkpoint_position(previous.prompt_tokens, config.hash_unit, config.eagle)
        follow_ups.append(
            FollowUp(
                name=name,
                follows=seen.follows,
                prompt_tokens=seen.prompt_tokens,
                hit=seen.admitted_hit,
                previous_hit=previous.admitted_hit,
                previous_whole=seen.admitted_previous_cached >= whole,
                partial_resume=previous.admitted_hit % mamba != 0,
                aligned_tail=tail % mamba == 0,
            )
        )
    return ArmCounts(tuple(follow_ups))
