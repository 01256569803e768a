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
from typing import Any, Protocol

from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.ops import STATS_KEYS, Segment
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.target import Capabilities
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs, MmItem


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
    # hit it presented, the external tokens answered (None: "not yet"),
    # asynchronously), and
    # each successful allocation from the waiting queue, (request, local hit
    # taken, external tokens, an asynchronous load's).
    connector_queries: list[tuple[str, int, int | None, bool]] = field(default_factory=list)
    taken: list[tuple[str, int, int, bool]] = field(default_factory=list)
    # Multimodal items the step encodes: request -> the indices of its
    # items (in its `mm`), for requests that encode any.
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)


def step_differences(
    expected: ScheduledStep, actual: ScheduledStep
) -> list[tuple[str, object, object]]:
    """What differs between two sides' `schedule()` of one engine step:
    (what, expected, actual), in the order a report names them."""
    pairs: tuple[tuple[str, object, object], ...] = (
        ("lookups (request, hit)", expected.lookups, actual.lookups),
        ("attention_cached before a follow-up's lookup", expected.checked, actual.checked),
        ("preempted", sorted(expected.preempted), actual.preempted),
        ("scheduled (request, tokens)", expected.scheduled, actual.scheduled),
        ("admitted (request, hit)", expected.admitted, actual.admitted),
        (
            "encoder inputs scheduled (request: items)",
            expected.encoder_inputs,
            actual.encoder_inputs,
        ),
        ("copies", expected.copies, actual.copies),
        (
            "KV connector queries (request, presented, answered, async)",
            expected.connector_queries,
            actual.connector_queries,
        ),
        (
            "waiting-queue allocations (request, local hit, external, async load)",
            expected.taken,
            actual.taken,
        ),
    )
    return [(what, e, a) for what, e, a in pairs if e != a]


# A request's output accounting under async scheduling, as vLLM's Request
# keeps it: (output placeholders: output tokens scheduled whose batch's
# output is not processed yet; tokens in flight: its tokens the batches in
# flight compute; stale tokens: those of them scheduled before a preemption,
# whose output moves no counter).
OutputAccounting = tuple[int, int, int]


@dataclass(frozen=True)
class RemoteHit:
    """What a KV connector's external store holds of a request: its first
    `tokens` tokens, loaded asynchronously when `load_async`; such a load is
    reported finished by the worker `delay` engine steps after the step that
    started it (0: in that step's own output)."""

    tokens: int
    load_async: bool
    delay: int
    # The async load fails (the worker reports `failed_recving`): the
    # Scheduler frees its blocks and looks the request up again.
    fails: bool = False
    # The connector cannot tell yet what it holds: the first `undecided`
    # times the Scheduler asks, it answers "not yet" (None), and the
    # Scheduler passes over the request until a later step.
    undecided: int = 0


# A request's prefill stats as the Scheduler reports them with its first
# output (`EngineCoreOutput.prefill_stats`): (num_cached_tokens, the tokens
# its prefill wrote to the prefix cache, num_cache_creation_tokens).
PrefillStats = tuple[int, int]

# The prefix-cache stats a Scheduler logging stats reports with each update
# (vLLM's `PrefixCacheStats`, drained by `make_stats`): the `stats` op's keys.
PREFIX_CACHE_STATS_KEYS = STATS_KEYS
PrefixCacheStats = dict[str, int | bool]

# The batches vLLM's engine keeps in flight under async scheduling (its
# batch queue: `max_concurrent_batches` with one pipeline stage). An engine
# step schedules a batch while the engine has requests, and processes the
# oldest batch's output only once this many are in flight or nothing more
# was scheduled (`EngineCore.step_with_batch_queue`).
ASYNC_BATCHES = 2

# A deferred free as both sides show it: (the non-empty batch whose
# processed output releases it, the request whose blocks wait, or
# `COW_RETENTION` for copies' endpoints).
DeferredFree = tuple[int, str]
COW_RETENTION = "copy-on-write retention"

# An arrival's fields saying what a KV connector's external store holds of
# the request (`RemoteHit`), in the order they are written.
REMOTE_FIELDS = (
    "remote_hit",
    "remote_async",
    "remote_delay",
    "remote_fails",
    "remote_undecided",
)

# The engine ops of a scheduler-level trace (its `engine` list), each with
# its required and optional fields.
ENGINE_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "arrive": (
        ("req", "prompt", "max_tokens"),
        (
            "cache_salt",
            "lora",
            "mm",
            "follows",
            "resumable",
            "priority",
            "skip_prefix_cache",
            *REMOTE_FIELDS,
        ),
    ),
    # A streaming-input session's next input chunk (its prompt tokens and
    # the output it then generates), or its end (`end: true`).
    "chunk": (("req",), ("prompt", "max_tokens", "end")),
    "step": ((), ("steps", "stop", "accept", "abort")),
    "abort": (("req",), ()),
    "reset": ((), ("running", "connector")),
    # The engine paused (vLLM's `pause_generation`) and resumed.
    "pause": (("mode",), ()),
    "resume": ((), ()),
}
# A pause's modes, as vLLM's engine names them: `keep` schedules nothing
# (the Scheduler's PAUSED_ALL), `wait` lets what is running drain and
# admits only waiting requests that hold KV blocks (PAUSED_NEW).
PAUSE_MODES: tuple[str, ...] = ("keep", "wait")
# What an engine `step` may expect, each optional.
ENGINE_EXPECT_KEYS: tuple[str, ...] = (
    "scheduled",
    "preempted",
    "cached_tokens",
    "finished",
    "encoded",
    "events",
)
# What a prefix-cache `reset` may expect: whether it reset, the waiting queue after.
RESET_EXPECT_KEYS: tuple[str, ...] = ("ok", "waiting")


@dataclass(frozen=True)
class EngineSettings:
    """A scheduler-level trace's engine besides its config: the draft tokens
    the drafter proposes each step (`spec`, vLLM's num_speculative_tokens)
    and the running cap (`max_num_seqs`)."""

    spec: int = 0
    max_num_seqs: int = 16


@dataclass(frozen=True)
class Arrival:
    """A request arriving at the scheduler: its name, its prompt in the
    format's segments, its output length, and what else its `arrive` entry
    may say of it (see `EngineStep`'s fields of the same names)."""

    name: str
    prompt: tuple[Segment, ...]
    max_tokens: int
    follows: str | None = None
    cache_salt: str = ""
    remote: RemoteHit | None = None
    resumable: bool = False
    mm: tuple[MmItem, ...] = ()
    priority: int = 0
    skip_prefix_cache: bool = False
    lora: str = ""


@dataclass(frozen=True)
class EngineStep:
    """One step of a scheduler-level trace: a request arriving (its prompt
    in the format's segments, its output length, its cache salt, the request
    it follows), one engine step (`schedule()`, the model runner's output,
    `update`) with what it expects, a request aborted by its client, or a
    prefix-cache reset between steps."""

    op: str
    index: int
    req: str | None = None
    prompt: tuple[Segment, ...] = ()
    max_tokens: int = 0
    cache_salt: str = ""
    # arrive, under a LoRA config (`config.max_loras`): its adapter's name.
    lora: str = ""
    # arrive: its multimodal items (placeholders in the prompt, each encoded
    # by the encoder before the tokens over it run)
    mm: tuple[MmItem, ...] = ()
    follows: str | None = None
    # arrive, with a KV connector: what its external store holds of the request.
    remote: RemoteHit | None = None
    # arrive, under the priority policy: the request's priority (the lowest
    # value is served first; ties by arrival).
    priority: int = 0
    # arrive: a streaming-input session (vLLM's `resumable`): when it stops
    # it keeps its blocks and waits for its next input chunk.
    resumable: bool = False
    # arrive: the request never reads the prefix cache (vLLM's
    # `skip_reading_prefix_cache`, which prompt logprobs set): no local hit,
    # and a KV connector's answer is dropped.
    skip_prefix_cache: bool = False
    # chunk: the session ends (vLLM's engine sends the request again, not
    # resumable); otherwise `prompt` and `max_tokens` are the next chunk's.
    end: bool = False
    # reset: running requests are preempted first (`reset_running_requests`)
    running: bool = False
    # reset: the KV connector's cache is reset too (`reset_connector`): its
    # store forgets what it held
    connector: bool = False
    # step: requests a stop condition (an end-of-sequence or stop token, a
    # stop string) finishes with the token they sample in this step
    stop: tuple[str, ...] = ()
    # step: requests whose drafts the model runner accepts in this step, each
    # with how many (the first N of the drafts it decodes with)
    accept: dict[str, int] = field(default_factory=dict)
    # step: requests aborted after this step's `schedule()`, before its output
    # is processed (a client gone, or a stop string the server's detokenizer
    # met, while the step ran)
    aborted: tuple[str, ...] = ()
    # pause: its mode (`PAUSE_MODES`)
    mode: str = ""
    expect: dict[str, Any] = field(default_factory=dict)

    def arrival(self) -> Arrival:
        """An `arrive` entry's request, as the scheduler takes it."""
        assert self.op == "arrive" and self.req is not None
        return Arrival(
            self.req,
            self.prompt,
            self.max_tokens,
            self.follows,
            self.cache_salt,
            self.remote,
            self.resumable,
            self.mm,
            self.priority,
            self.skip_prefix_cache,
            self.lora,
        )


@dataclass
class EngineOutcome(ScheduledStep):
    """One engine step of kvgate's scheduler model: its `schedule()` as
    `ScheduledStep`, then the model runner's output and the update."""

    # Output tokens each scheduled request gained this step (the model's ids).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    # Each request whose first output this step carried: its prefill stats.
    prefill_stats: dict[str, PrefillStats] = field(default_factory=dict)
    # Async KV loads the worker reports finished (or failed) in this step's output.
    loaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NextStep:
    """What the next engine step will do (`SchedulerModelRun.preview_next_step`)."""

    drafts: dict[str, int]  # request -> drafts it decodes with in the batch scheduled
    samples: set[str]  # async: the requests sampling in the batch whose output is processed


class SchedulerModelRun(Protocol):
    """What a scheduler-level replay needs of kvgate's scheduler model."""

    @property
    def capabilities(self) -> Capabilities: ...

    def arrive(self, arrival: Arrival) -> Any: ...

    def prompt_tokens(self, name: str) -> tuple[list[int], HashInputs]:
        """An arrived request's prompt token ids and hash inputs."""
        ...

    def chunk(self, name: str, prompt: tuple[Segment, ...], max_tokens: int) -> list[int]:
        """Session `name`'s next input chunk arrives: taken at once if the
        session waits for it, queued if it still runs. The chunk's token ids."""
        ...

    def end_session(self, name: str) -> None:
        """Session `name` ends: at once if it waits for input (its blocks
        freed as an abort's), or when it next stops if it still runs."""
        ...

    def step(self, aborted: tuple[str, ...] = ()) -> EngineOutcome:
        """One engine step; `aborted`: requests aborted after its `schedule()`."""
        ...

    def stop(self, name: str) -> None:
        """Request `name` finishes with the token it samples in the next
        step, before its `max_tokens`: a stop condition the engine met."""
        ...

    def accept(self, name: str, drafts: int) -> None:
        """Request `name`, decoding in the next step, gets the first `drafts`
        of its draft tokens accepted (the model runner samples them, then one
        token of its own); the rest are rejected."""
        ...

    def abort(self, name: str) -> None: ...

    def pause(self, mode: str) -> None:
        """The engine pauses (`mode` one of `PAUSE_MODES`) or, with "",
        resumes."""
        ...

    def reset_prefix_cache(self, running: bool, connector: bool = False) -> tuple[bool, list[str]]:
        """Reset the prefix cache, preempting every running request first
        when `running`, and the KV connector's cache too when `connector`
        (its store then holds nothing): (whether it reset, the waiting
        queue after)."""
        ...

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache stats since the last call (`PREFIX_CACHE_STATS_KEYS`;
        empty when stats are not logged)."""
        ...

    def take_kv_events(self) -> list[KvEvent]:
        """The KV-cache events the Scheduler publishes with the step's update:
        those queued since the last update (with `config.kv_events`; none
        when the step processed no output)."""
        ...

    def take_evictions(self) -> list[int]:
        """The residency metrics' eviction events the model's stats drained
        since the last call, each as its number of reuse gaps, in order (as
        `SchedulerTarget.take_evictions`)."""
        ...

    def kv_cache_usage(self) -> float:
        """The pool's used fraction, the null block left out (the Scheduler's
        `get_kv_cache_usage()`)."""
        ...

    def batches_in_flight(self) -> int:
        """Batches scheduled whose output is not processed yet (async
        scheduling; 0 otherwise)."""
        ...

    def preview_next_step(self) -> NextStep:
        """What the next engine step will do: the drafts each request
        decodes with in the batch it schedules (the requests an `accept` on
        that step may name, and how many drafts at most) and, under async
        scheduling, the requests sampling in the batch whose output it
        processes (those a `stop` on that step may name)."""
        ...

    def deferred_frees(self) -> list[DeferredFree]:
        """Deferred frees not yet released, in order."""
        ...

    def output_accounting(self) -> dict[str, OutputAccounting]:
        """Under async scheduling, each unfinished request's output
        accounting, for those with any (see `OutputAccounting`)."""
        ...

    def snapshot(self) -> Snapshot: ...


class SchedulerTarget(Protocol):
    capabilities: Capabilities
    # The build takes streaming-input sessions (vLLM's resumable requests):
    # a trace with one is not applicable to a build without.
    streaming_input: bool
    # The build's Scheduler has pause states: likewise for a trace that pauses.
    pause_states: bool

    def add_request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        inputs: HashInputs = NO_INPUTS,
        resumable: bool = False,
        priority: int = 0,
        skip_prefix_cache: bool = False,
    ) -> None:
        """A new request; `follows`: the request whose output it continues;
        `inputs`: what its block hashes cover besides its tokens (its
        adapter, under `config.max_loras`, also what the Scheduler admits
        with it); `resumable`: a streaming-input session; `priority`: its
        priority under the priority policy (requests arrive in order).

        Raises `target.StepRefused` for a request the engine would not take
        (an adapter without a LoRA config among them),
        `config.UnsupportedConfig` for inputs this build cannot schedule.
        """
        ...

    def add_chunk(self, name: str, tokens: list[int], max_tokens: int) -> None:
        """Session `name`'s next input chunk, sent as vLLM's engine sends it
        (the same request id again)."""
        ...

    def end_session(self, name: str) -> None:
        """Session `name`'s end, sent as vLLM's engine sends it."""
        ...

    def has_requests(self) -> bool:
        """The engine would schedule (vLLM's `has_requests`: unfinished
        requests, or ones finished since the last `schedule()`)."""
        ...

    def batches_in_flight(self) -> int:
        """Batches `schedule()` returned whose `update()` has not run."""
        ...

    def deferred_frees(self) -> list[DeferredFree]:
        """The Scheduler's deferred frees not yet released, in order."""
        ...

    def output_accounting(self) -> dict[str, OutputAccounting]:
        """Each unfinished request's output accounting, for those with any."""
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
        each scheduled request sampled (its accepted drafts among them), and the
        asynchronous KV loads its connector finished (`loaded`) or lost
        (`failed`). Returns the requests that finished, in order."""
        ...

    def stop(self, name: str) -> None:
        """As `SchedulerModelRun.stop`, called between `schedule()` and the
        `update()` of that step (the Scheduler cannot know it in advance)."""
        ...

    def script_external(self, name: str, tokens: int, load_async: bool, undecided: int = 0) -> None:
        """With a KV connector: the external store holds the first `tokens`
        tokens of request `name`, loaded asynchronously when `load_async`;
        the connector answers "not yet" to the first `undecided` questions
        about it."""
        ...

    def abort(self, name: str) -> None:
        """The client aborts request `name` (between engine steps)."""
        ...

    def pause(self, mode: str) -> None:
        """As `SchedulerModelRun.pause`."""
        ...

    def reset_prefix_cache(self, running: bool, connector: bool = False) -> tuple[bool, list[str]]:
        """As `SchedulerModelRun.reset_prefix_cache`."""
        ...

    def take_prefill_stats(self) -> dict[str, PrefillStats]:
        """Each request whose first output the last `update` carried: its
        prefill stats as the Scheduler reported them."""
        ...

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats the last `update` reported
        (`PREFIX_CACHE_STATS_KEYS`), or None when it reported none (stats not
        logged)."""
        ...

    def take_evictions(self) -> list[int]:
        """The residency metrics' eviction events the scheduler's stats
        drained since the last call (`kv_cache_metrics`), each as its number
        of reuse gaps, in order; [] when none were made or drained."""
        ...

    def take_kv_events(self) -> list[KvEvent]:
        """The KV-cache events of every batch the scheduler published since
        the last call, in order ([] without `config.kv_events`)."""
        ...

    def kv_cache_usage(self) -> float:
        """The scheduler's `get_kv_cache_usage()`, what vLLM's engine reads
        for its load stats."""
        ...

    def snapshot(self) -> Snapshot: ...

    def close(self) -> None: ...
