"""What kvgate's scheduler model keeps, and the records it keeps them in.

`SchedulerState` declares, once, the state the scheduler model's parts act
on (its queues, the engine's step counters, the batches in flight and the
deferred frees) and the calls they make into the scheduling pass; the parts
are the async batches (`async_batches.py`), a KV connector's loads
(`connector_loads.py`) and streaming-input sessions (`sessions.py`), and
`scheduler.py`'s `SchedulerModel` puts them together with the scheduling
pass. The records: a request as the scheduler tracks it (`LiveRequest`, its
lifecycle one `RequestStatus`), a batch in flight (`Batch`), what one engine
step did (`StepDecisions`), the writer of the manager calls (`StepWriter`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum, auto
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


class RequestStatus(Enum):
    """Where a request is in its life, named as vLLM's `RequestStatus` names
    it. The model reaches these of vLLM's statuses; it never waits for a
    structured-output grammar, nor ends a request as ignored or for
    repetition."""

    WAITING = auto()
    # Its asynchronous KV load is in flight, or reported and not yet
    # completed by the scan; it holds the load's blocks.
    WAITING_FOR_REMOTE_KVS = auto()
    # A streaming-input session between chunks: it keeps its blocks.
    WAITING_FOR_STREAMING_REQ = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    FINISHED_STOPPED = auto()  # a stop condition met
    FINISHED_LENGTH_CAPPED = auto()  # its output generated (`max_tokens`)
    FINISHED_ABORTED = auto()  # the client aborted it
    FINISHED_ERROR = auto()  # its load failed, under load-failure policy `fail`


FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass
class LiveRequest:
    """A request as the scheduler tracks it.

    Its lifecycle is `status`, set only by the transition methods below,
    each at the one point of the scheduler model where vLLM's Scheduler
    makes that transition; the other fields are facts about it, not
    states."""

    name: str
    request: Request  # the oracle's request (prompt, output, progress)
    max_tokens: int  # the output it generates before it finishes
    follows: str | None  # the request whose output its prompt continues
    # Its place under the priority policy: (priority, arrival number), the
    # lowest first.
    rank: tuple[int, int] = (0, 0)
    status: RequestStatus = RequestStatus.WAITING
    ever_admitted: bool = False  # past its first admission (its hit is the cached tokens)
    # Its last run sampled (a completed prefill or a decode): it decodes next,
    # with drafts, as vLLM's Scheduler runs a request that has them.
    decoding: bool = False
    # With a KV connector: what the external store holds of it (None: nothing).
    remote: RemoteHit | None = None
    # Its asynchronous load (status WAITING_FOR_REMOTE_KVS) started at engine
    # step `load_started`; `load_reported` once the worker said it finished,
    # `load_failed` when it said the load failed. Waiting, it holds blocks
    # (`holds_blocks`), which puts it in the Scheduler's queue of such
    # requests, scanned before the others.
    load_started: int = 0
    # Its computed tokens as the Scheduler holds them during this step's scan
    # (it advances them only after the scan), and its output then.
    sched_computed: int = 0
    sched_outputs: int = 0
    load_reported: bool = False
    load_failed: bool = False
    retried_load: bool = False  # a load of it failed; it was looked up again
    holds_blocks: bool = False
    # Its prefill stats as the Scheduler sets them at its first admission
    # (the local and external tokens it was admitted with), then reports
    # with its first output, the prefix cache's estimate then added.
    cached_at_admission: int | None = None
    cache_estimate: int = 0
    prefill_stats_reported: bool = False
    # A stop condition ends it with the token it samples next (`stop`).
    stops_at_next_token: bool = False
    # Async scheduling: the last batch that scheduled it (in flight while
    # the engine has not processed that batch's output), and the non-empty
    # batch's number the Scheduler fences its deferred free with.
    last_batch: int = 0
    last_sched_seq: int = 0
    # Async scheduling: preempted while a batch that scheduled it was in
    # flight, the output of the batches up to number `stale_until` is
    # stale: delivered when it comes in (its sampled token appended, which
    # may finish it where it waits), or, after a prefix-cache reset's
    # preemption (`drop_stale_output`), dropped: the reset lets it run again
    # at once, and a late token would land at a position it computes anew.
    stale_until: int = 0
    drop_stale_output: bool = False
    # Async scheduling's output placeholders (vLLM's `num_output_placeholders`):
    # output tokens (the sampled one and the drafts) scheduled in batches
    # whose output is not processed yet; and the placeholder drafts its next
    # decode schedules (vLLM's `spec_token_ids` of -1s, set after a schedule
    # that was not a prefill chunk, cleared when a schedule takes them).
    placeholders: int = 0
    placeholder_drafts: int = 0
    # A streaming-input session (vLLM's `resumable`): when it stops it keeps
    # its blocks and takes its next input chunk (`chunks`, in arrival order,
    # None for the session's end) or, with none queued, waits for one
    # (WAITING_FOR_STREAMING_REQ) in the queue of waiting requests that hold
    # blocks.
    resumable: bool = False
    chunks: deque[tuple[list[int], int] | None] = field(default_factory=deque)
    # A scan passed over it (it was loading, paused, over the LoRA adapter
    # limit, or could not run yet), or it paused: vLLM's Scheduler counts
    # it deferred (the prefill cadence reads that) until it is admitted again.
    counted_deferred: bool = False

    # -- questions about its status ---------------------------------------

    @property
    def is_finished(self) -> bool:
        """Finished or aborted (an in-flight batch's output skips it)."""
        return self.status in FINISHED

    @property
    def waiting_for_remote_kvs(self) -> bool:
        return self.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    @property
    def load_in_flight(self) -> bool:
        """It waits for its asynchronous KV load, which the worker has not
        reported yet (an aborted request's load is in the scheduler's
        `aborted_loads` until reported)."""
        return self.waiting_for_remote_kvs and not self.load_reported

    @property
    def waiting_for_streaming_req(self) -> bool:
        """A paused streaming-input session: it waits for its next chunk."""
        return self.status is RequestStatus.WAITING_FOR_STREAMING_REQ

    # -- its transitions, one method each ---------------------------------

    def admit(self) -> None:
        """Admitted from a waiting queue: it runs."""
        self.status = RequestStatus.RUNNING

    def preempt(self) -> None:
        """Preempted: back in the waiting queue, its blocks freed."""
        self.status = RequestStatus.PREEMPTED

    def wait_for_remote_kvs(self) -> None:
        """Its asynchronous KV load started: it waits for it, holding the
        load's blocks."""
        self.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def end_remote_wait(self) -> None:
        """The scan took its reported load (completed or failed): it waits
        as before the load, preempted if it ever was (as vLLM's Scheduler
        promotes it)."""
        self.status = (
            RequestStatus.PREEMPTED if self.request.num_preemptions else RequestStatus.WAITING
        )

    def wait_for_streaming_req(self) -> None:
        """A session stopped with no chunk queued: it waits for one."""
        self.status = RequestStatus.WAITING_FOR_STREAMING_REQ

    def take_streaming_req(self) -> None:
        """A session took its next input chunk: it waits to run it."""
        self.status = RequestStatus.WAITING

    def finish(self, how: Literal["finish", "abort", "error"]) -> None:
        """It ends: its output generated or a stop condition met
        (`finish`), aborted by the client, or its load failed under policy
        `fail` (`error`)."""
        if how == "abort":
            self.status = RequestStatus.FINISHED_ABORTED
        elif how == "error":
            self.status = RequestStatus.FINISHED_ERROR
        elif self.stops_at_next_token:
            self.status = RequestStatus.FINISHED_STOPPED
        else:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED


@dataclass
class StepWriter:
    """Runs each step on the oracle and keeps it with what the oracle saw.

    `keep` off (a replay, which writes no trace): the steps are counted,
    not kept, so a long history holds nothing per step. Either way the
    requests the steps named are noted until taken (`take_touched`): what
    a strict lockstep compares after each engine step."""

    oracle: ModelTarget
    steps: list[Step] = field(default_factory=list)
    keep: bool = True
    written: int = 0
    touched: set[str] = field(default_factory=set)

    def run(self, op: str, **fields: Any) -> dict[str, Any]:
        step = Step(op, self.written, **fields)
        result = self.oracle.apply(step)
        self.written += 1
        if step.req is not None:
            self.touched.add(step.req)
        if self.keep:
            # `copies` are block ids: compared with the lockstep model anyway,
            # and only noise in a trace people read.
            keys = [k for k in ACTIONS[op].expect_keys if k != "copies" and k in result]
            self.steps.append(replace(step, expect={k: result[k] for k in keys}))
        return result

    def check(self, query: dict[str, Any]) -> dict[str, Any]:
        values = self.oracle.check_values(query)
        if self.keep:
            self.steps.append(Step("check", self.written, check=values))
        self.written += 1
        return values

    def take_touched(self) -> set[str]:
        """The requests the steps named since the last call."""
        touched, self.touched = self.touched, set()
        return touched


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
    executed: bool  # it ran tokens (only such batches advance the fences)
    number: int  # its place among the batches scheduled (1 for the first)
    # Async scheduling: the requests whose output it samples (not a prefill
    # chunk), the drafts each was scheduled with, and how many of those the
    # model runner accepts (the trace's `accept` on the step that scheduled it).
    samples: set[str] = field(default_factory=set)
    drafts: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)


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
