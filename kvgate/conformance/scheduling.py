"""The scheduler-level contract: a real `Scheduler` driven one engine step at a time.

Where `target.Target` replays manager calls (trace ops), a `SchedulerTarget`
is a whole scheduler owning its manager: requests are added, each engine
step is one `schedule()` and, once the model runner's output is known, one
`update()`. What a step did is reported as a `ScheduledStep`, in the same
terms kvgate's scheduler model reports its own decisions, so the two are
compared step for step; `snapshot()` is the owned manager's strict view.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.conformance.snapshot import Snapshot
from kvgate.conformance.target import Capabilities
from kvgate.conformance.tokens import NO_INPUTS, HashInputs


@dataclass
class ScheduledStep:
    """One `schedule()` call, as the scheduler showed it."""

    # (request, tokens scheduled), in the order the scheduler scheduled them.
    scheduled: list[tuple[str, int]] = field(default_factory=list)
    # Requests preempted in the step, sorted (vLLM reports them as a set).
    preempted: list[str] = field(default_factory=list)
    # Every prefix-cache lookup, (request, hit), admitted or not, in order.
    lookups: list[tuple[str, int]] = field(default_factory=list)
    # (request, hit) of each request admitted from waiting.
    admitted: list[tuple[str, int]] = field(default_factory=list)
    # follow-up -> the attention_cached of the turn it follows, right before
    # the follow-up's lookup (while it was never admitted yet).
    checked: dict[str, int] = field(default_factory=dict)
    # Copies handed to the model runner, [src, dst] block ids.
    copies: list[list[int]] = field(default_factory=list)
    # With a KV connector only (both sides leave them empty without one):
    # each question the Scheduler put to the connector, (request, the local
    # hit it presented, the external tokens answered, asynchronously), and
    # each successful allocation from the waiting queue, (request, local hit
    # taken, external tokens, an asynchronous load's).
    connector_queries: list[tuple[str, int, int, bool]] = field(default_factory=list)
    taken: list[tuple[str, int, int, bool]] = field(default_factory=list)


class SchedulerTarget(Protocol):
    capabilities: Capabilities

    def add_request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        inputs: HashInputs = NO_INPUTS,
    ) -> None:
        """A new request; `follows`: the request whose output it continues;
        `inputs`: what its block hashes cover besides its tokens.

        Raises `target.StepRefused` for a request the engine would not take,
        `config.NotModelled` for hash inputs the target does not model.
        """
        ...

    def schedule(self) -> ScheduledStep: ...

    def update(
        self,
        sampled: Mapping[str, list[int]],
        *,
        loaded: Collection[str] = (),
        failed: Collection[str] = (),
    ) -> list[str]:
        """The model runner's output for the last `schedule()`: the tokens
        each scheduled request sampled (drafts all rejected), and the
        asynchronous KV loads its connector finished (`loaded`) or lost
        (`failed`). Returns the requests that finished, in order."""
        ...

    def script_external(self, name: str, tokens: int, load_async: bool) -> None:
        """With a KV connector: the external store holds the first `tokens`
        tokens of request `name`, loaded asynchronously when `load_async`."""
        ...

    def take_evictions(self) -> list[int]:
        """The residency metrics' eviction events the scheduler's stats
        drained since the last call (`kv_cache_metrics`), each as its number
        of reuse gaps, in order; [] when none were made or drained."""
        ...

    def snapshot(self) -> Snapshot: ...

    def close(self) -> None: ...
