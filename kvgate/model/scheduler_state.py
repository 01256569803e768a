"""What kvgate's scheduler model keeps, and the records it keeps them in.

`SchedulerState` declares, once, the state the scheduler model's parts act
on (its queues, the engine's step counters, the batches in flight and the
deferred frees) and the calls they make into the scheduling pass; the parts
are the async batches (`async_batches.py`), a KV connector's loads
(`connector_loads.py`) and streaming-input sessions (`sessions.py`), and
`scheduler.py`'s `SchedulerModel` puts them together with the scheduling
pass. The records: a request as the scheduler tracks it (`LiveRequest`), a
batch in flight (`Batch`), what one engine step did (`StepDecisions`), the
writer of the manager calls (`StepWriter`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvgate.model.encoder_cache import EncoderCache, EncoderPlan
from kvgate.model.request import Request
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import ACTIONS, Step
from kvgate.vocabulary.scheduling import DeferredFree, EngineOutcome, RemoteHit
from kvgate.vocabulary.target import StepRefused


class SchedulerStuck(StepRefused):
    """The requests cannot run on this pool (a request never fits): the
    trace's config cannot run it, as vLLM's Scheduler would loop for ever."""

    def __init__(self, message: str) -> None:
        super().__init__("config.num_blocks", message)


# A prefill chunk as the scheduler writes it: (the `allocate`'s `tokens`, the
# tokens the step runs, the speculative padding rows among them).
Chunk = tuple[int | Literal["auto"], int, int]
# No chunk this step because a multi-module MTP drafter's prefill lookahead
# left nothing to run: vLLM's Scheduler passes over the request (a running
# one, or a waiting one, which keeps its place) and goes on to the next.
SKIP: Literal["skip"] = "skip"


def admission_fits(blocks: int, free_blocks: int) -> bool:
    """The Scheduler's full-sequence admission gate (vLLM's
    `scheduler_reserve_full_isl`, on by default): a waiting request is
    admitted only while the blocks its whole sequence needs (the `reserve`
    op's `blocks`) are free.

    The scheduler model checks it before the admitting `allocate`, whatever
    the config's `reserve_full_sequence` (which puts the same gate inside
    that `allocate`, failing it), so its traces carry the gate either way
    and never a refused admission's `allocate`. Exploration leaves it to the
    `allocate` under `reserve_full_sequence`, to reach the manager's own
    refusal (`tests/test_scheduler_model.py` shows both refuse alike)."""
    return blocks <= free_blocks


@dataclass
class LiveRequest:
    """A request as the scheduler tracks it."""

    name: str
    request: Request  # the oracle's request (prompt, output, progress)
    max_tokens: int  # the output it generates before it finishes
    follows: str | None  # the request whose output its prompt continues
    # Its place under the priority policy: (priority, arrival number), the
    # lowest first.
    rank: tuple[int, int] = (0, 0)
    admitted: bool = False  # past its first admission (its hit is the cached tokens)
    # Its last run sampled (a completed prefill or a decode): it decodes next,
    # with drafts, as vLLM's Scheduler runs a request that has them.
    decoding: bool = False
    # With a KV connector: what the external store holds of it (None: nothing).
    remote: RemoteHit | None = None
    # Its asynchronous load is in flight (the Scheduler's WAITING_FOR_REMOTE_KVS),
    # since engine step `load_started`; `reported` once the worker said it
    # finished. It holds blocks while it waits (`holds_blocks`), which puts it
    # in the Scheduler's queue of such requests, scanned before the others.
    loading: bool = False
    load_started: int = 0
    # Its computed tokens as the Scheduler holds them during this step's scan
    # (it advances them only after the scan), and its output then.
    sched_computed: int = 0
    sched_outputs: int = 0
    reported: bool = False
    failed_reported: bool = False  # the worker reported its load failed
    retried_load: bool = False  # a load of it failed; it was looked up again
    holds_blocks: bool = False
    # Its prefill stats as the Scheduler sets them at its first admission
    # (the local and external tokens it was admitted with), then reports
    # with its first output, the prefix cache's estimate then added.
    cached_at_admission: int | None = None
    cache_estimate: int = 0
    stats_reported: bool = False
    # A stop condition ends it with the token it samples next (`stop`).
    stopping: bool = False
    # Async scheduling: the last batch that scheduled it (in flight while
    # the engine has not processed that batch's output), and the non-empty
    # batch's number the Scheduler fences its deferred free with.
    last_batch: int = 0
    last_sched_seq: int = 0
    ended: bool = False  # finished or aborted (an in-flight batch's output skips it)
    # Async scheduling: preempted while a batch that scheduled it was in
    # flight, the output of the batches up to number `stale_until` is
    # stale: delivered when it comes in (its sampled token appended, which
    # may finish it where it waits), or, after a prefix-cache reset's
    # preemption (`drop_stale`), dropped: the reset lets it run again at
    # once, and a late token would land at a position it computes anew.
    stale_until: int = 0
    drop_stale: bool = False
    # A streaming-input session (vLLM's `resumable`): when it stops it keeps
    # its blocks and takes its next input chunk (`chunks`, in arrival order,
    # None for the session's end) or, with none queued, waits for one
    # (`paused`, vLLM's WAITING_FOR_STREAMING_REQ) in the queue of waiting
    # requests that hold blocks.
    resumable: bool = False
    chunks: deque[tuple[list[int], int] | None] = field(default_factory=deque)
    paused: bool = False
    # A scan passed over it (it was loading, paused, over the LoRA adapter
    # limit, or could not run yet), or it paused: vLLM's Scheduler counts
    # it deferred (the prefill cadence reads that) until it is admitted again.
    deferred: bool = False


@dataclass
class StepWriter:
    """Runs each step on the oracle and keeps it with what the oracle saw."""

    oracle: ModelTarget
    steps: list[Step] = field(default_factory=list)

    def run(self, op: str, **fields: Any) -> dict[str, Any]:
        step = Step(op, len(self.steps), **fields)
        result = self.oracle.apply(step)
        # `copies` are block ids: compared with the lockstep model anyway,
        # and only noise in a trace people read.
        keys = [k for k in ACTIONS[op].expect_keys if k != "copies" and k in result]
        self.steps.append(replace(step, expect={k: result[k] for k in keys}))
        return result

    def check(self, query: dict[str, Any]) -> dict[str, Any]:
        values = self.oracle.check_values(query)
        self.steps.append(Step("check", len(self.steps), check=values))
        return values


@dataclass
class StepDecisions(EngineOutcome):
    """What the scheduler model did in one engine step: what vLLM's
    `Scheduler` shows of a step (comparable step for step with the real one;
    running requests are scheduled first, then admissions), what the model
    runner and the finish check then did, and the connector's reports."""

    # Requests ended with an error after their load failed (policy `fail`).
    errored: list[str] = field(default_factory=list)


@dataclass
class Batch:
    """A scheduled batch whose output the engine has not processed yet."""

    scheduled: list[tuple[str, int]]  # (request, tokens) it computes
    sampled: dict[str, list[int]]  # the tokens each request samples in it
    finished: list[LiveRequest]  # the requests it completes
    executed: bool  # it ran tokens (only such batches advance the fences)
    number: int  # its place among the batches scheduled (1 for the first)


class SchedulerState(ABC):
    """The scheduler model's state, as its parts read and change it."""

    config: Config
    spec: int
    writer: StepWriter
    waiting: deque[LiveRequest]
    running: list[LiveRequest]
    # Waiting requests that hold blocks (a KV load in flight or done, a
    # paused session), scanned first.
    holding: deque[LiveRequest]
    aborted_loads: list[LiveRequest]
    engine_step: int
    encoder: EncoderCache
    _encoder_plan: EncoderPlan | None
    _prefilling_at_step_start: set[str]
    _tokens_at_step_start: dict[str, int]
    _ended_since_schedule: bool
    _output_processed: bool
    # Async scheduling: the batches in flight and the deferred frees.
    in_flight: deque[Batch]
    batches_scheduled: int
    batches_processed: int
    defer_block_free: bool
    deferred: deque[DeferredFree]
    sched_seq: int
    processed_seq: int

    @property
    def oracle(self) -> ModelTarget:
        return self.writer.oracle

    def _live(self) -> tuple[LiveRequest, ...]:
        return (*self.running, *self.waiting, *self.holding)

    def has_requests(self) -> bool:
        """vLLM's `has_requests`: unfinished requests, or requests ended since
        the last `schedule()`."""
        return bool(self.waiting or self.running or self.holding) or self._ended_since_schedule

    # -- the scheduling pass, as the parts call it -------------------------

    @abstractmethod
    def _schedule_batch(
        self, decisions: StepDecisions
    ) -> tuple[list[LiveRequest], dict[str, list[int]]]: ...

    @abstractmethod
    def _process_output(
        self,
        decisions: StepDecisions,
        sampled: dict[str, list[int]],
        finished: list[LiveRequest],
        batch: int = 0,
    ) -> None: ...

    @abstractmethod
    def _end(self, live: LiveRequest, how: Literal["finish", "abort"]) -> None: ...

    @abstractmethod
    def _admission_chunk(
        self, live: LiveRequest, hit: int, budget: int
    ) -> Chunk | Literal["skip"] | None: ...

    @abstractmethod
    def _allocate(self, live: LiveRequest, chunk: Chunk, hit: int = 0) -> Callable[[], bool]: ...
