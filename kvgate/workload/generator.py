"""Turn a session plan into a fixed trace, with the model as the oracle.

`generate` plays vLLM's scheduler over the model (`ModelTarget`) one step
at a time, as `Scheduler.schedule()` does it:

1. running requests in admission order, within the step's token budget: a
   decoding request runs `decode1` (1 + K tokens, fewer drafts when the
   budget left is short, the full lookahead kept), a prefilling one the next
   chunk of its prompt, cut by the align-mode split (`allocate auto` when
   the budget left does not bind, else the split's count written out, so a
   trace never depends on a target's budget arithmetic). When an allocation
   fails, the last running request is preempted (`free preempt`, back to the
   front of the waiting queue), down to the failing request itself;
2. if nothing was preempted, waiting requests in order: `lookup`, `reserve`
   (the full-sequence admission gate: admitted only if the pool has the
   blocks), the first chunk; the first that does not fit ends admission.
   A first chunk of one token is padded to a speculative step (`allocate
   pad`) where the Scheduler pads it;
3. `step` and `drain`, then `free finish` of requests that generated their
   output; a follow-up arrives after its tool latency.

With a KV connector (`Serving.connector_seed`), each request's external hit
is drawn (`draw_remote`) and every lookup carries it; an async load's
allocation (with the blocks the Scheduler keeps for in-flight prefills,
`allocate reserved`) puts the request in a queue of waiting requests that
hold blocks, scanned first; the worker reports the load done (or failed)
some steps later, and the scan then completes it (`allocate`, or `allocate
complete_only` when nothing runs) or, failed, looks it up again (`lookup
load_failed`); under load-failure policy `fail` (config
`kv_load_failure_policy`) a failed load ends its request instead (`free
abort load_failed`, after the step's finishes), one failure reported a step.

A chunk that computes every token of its request samples the step's output
token (`allocate sample 1`), as vLLM's `Scheduler` appends it after the step;
the model's drafts are all rejected (one token per decode step).

`SessionRun` is that loop, one engine step at a time; each step's decisions
(`StepDecisions`: what ran with how many tokens, preemptions, lookups and
admissions, copies, sampled tokens, finishes) go to an optional
`StepObserver`, which is how the scheduler-level lockstep
(`workload.lockstep`) drives vLLM's real `Scheduler` beside it.

The generator branches on the model's answers (hits, `ok`, reservation
counts) while it writes, so the trace is one fixed step list: every
observation is written into the step's `expect`, and a replay on any target
either reproduces it step for step or reports where it diverged. Before
each first admission of a follow-up a `check attention_cached` of the
previous turn records whether its whole attention prefix is still cached.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvgate.conformance.config import Config
from kvgate.conformance.driver import chunk_offer
from kvgate.conformance.ops import ACTIONS, Segment, Step
from kvgate.conformance.scheduling import ScheduledStep
from kvgate.conformance.tokens import NO_INPUTS, HashInputs
from kvgate.model import ModelTarget
from kvgate.model.request import Request
from kvgate.model.split import chunk_tokens
from kvgate.workload.deployment import Serving
from kvgate.workload.plan import Session

SYSTEM = "system"  # the request holding the shared system prompt (never scheduled)
# Generation gives up when this many steps in a row schedule nothing.
MAX_IDLE_STEPS = 3


class WorkloadStuck(RuntimeError):
    """The plan cannot run on this pool (a request never fits)."""


# A prefill chunk as the generator writes it: (the `allocate`'s `tokens`, the
# tokens the step runs, the speculative padding rows among them).
_Chunk = tuple[int | Literal["auto"], int, int]


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


def draw_remote(rng: random.Random, num_tokens: int, previous: int) -> RemoteHit | None:
    """A request's external hit, drawn: none, the turn before's whole
    sequence (`previous` tokens: what an offloading store keeps of the
    session), the whole prompt (less the token a sync load leaves to
    compute), or a prefix of any length; sync or async, an async load
    failing one time in five (its retry then loads)."""
    if rng.random() < 0.35:
        return None
    load_async = rng.random() < 0.5
    whole = num_tokens if load_async else num_tokens - 1
    kind = rng.choice(("previous", "whole", "part"))
    if kind == "previous" and previous:
        tokens = min(previous, whole)
    elif kind == "part":
        tokens = rng.randint(1, max(1, whole))
    else:
        tokens = whole
    delay = rng.choice((0, 0, 1, 2))
    return RemoteHit(max(0, tokens), load_async, delay, load_async and rng.random() < 0.2)


@dataclass
class _Live:
    """A turn as the scheduler tracks it."""

    name: str
    session: Session
    turn: int
    request: Request  # the oracle's request (prompt, output, progress)
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
    # (it advances them only after the scan).
    sched_computed: int = 0
    reported: bool = False
    failed_reported: bool = False  # the worker reported its load failed
    retried_load: bool = False  # a load of it failed; it was looked up again
    holds_blocks: bool = False

    @property
    def target_output(self) -> int:
        return self.session.turns[self.turn].output

    @property
    def follows(self) -> str | None:
        return self.session.request(self.turn - 1) if self.turn else None


@dataclass
class _Writer:
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
class _Scheduler:
    config: Config
    spec: int
    max_num_seqs: int
    writer: _Writer
    waiting: deque[_Live] = field(default_factory=deque)
    running: list[_Live] = field(default_factory=list)
    num_eligible: int = 0  # waiting + running when this step began
    _running_scheduled: bool = False
    _prefill_scheduled: bool = False
    # With a KV connector: waiting requests that hold blocks (an async load in
    # flight, or done but not yet admitted), which vLLM's Scheduler keeps in a
    # queue of their own (`kv_holding_waiting`) and scans first.
    holding: deque[_Live] = field(default_factory=deque)
    engine_step: int = 0

    def schedule(self, decisions: StepDecisions) -> tuple[bool, list[_Live]]:
        """One scheduler step's allocations, recorded in `decisions`;
        (anything scheduled, finished)."""
        budget = self.config.max_num_scheduled_tokens
        scheduled = False
        finished: list[_Live] = []
        preempted = False
        # What vLLM's Scheduler counts, once per step, to decide whether
        # `long_prefill_token_threshold` applies: its own queues. The oracle's
        # live requests also hold the system prompt's holder, never scheduled.
        self.num_eligible = len(self.waiting) + len(self.holding) + len(self.running)
        for live in (*self.running, *self.holding):
            # A load reported failed has nothing computed for the Scheduler.
            failed = live.failed_reported
            live.sched_computed = 0 if failed else live.request.num_computed_tokens
        index = 0
        # Whether a running request ran a prefill chunk this step (vLLM's
        # `prefill_scheduled`, which the waiting scan's padding reads).
        prefill_scheduled = False
        while index < len(self.running) and budget > 0:
            live = self.running[index]
            request = live.request
            outputs = len(request.output)
            prefilling = not live.decoding
            if live.decoding:
                # vLLM schedules what the budget leaves of 1 + K: fewer drafts.
                drafts = min(self.spec, budget - 1)
                cost = 1 + drafts
                run = self._decode(live, drafts)
            else:
                chunk = self._chunk(request, 0, budget)
                if chunk is None:
                    index += 1
                    continue
                cost = chunk[1]
                run = self._allocate(live, chunk)
            ok = run()
            while not ok:
                # vLLM's FCFS policy preempts the last running request, the
                # failing one included, and retries.
                victim = self.running.pop()
                self.writer.run("free", req=victim.name, how="preempt")
                self.waiting.appendleft(victim)
                victim.decoding = False
                decisions.preempted.append(victim.name)
                preempted = True
                if victim is live:
                    if not self.running and not self.holding:
                        # Alone, it outgrew the whole pool: re-admitted (its
                        # prompt fits), it reaches the same point again, for
                        # ever (vLLM's Scheduler loops the same way).
                        raise WorkloadStuck(
                            f"{live.name} cannot run on a pool of {self.config.num_blocks} "
                            "blocks: alone, its sequence outgrows the pool and it preempts itself"
                        )
                    break
                ok = run()
            if not ok:
                break
            budget -= cost
            scheduled = True
            index += 1
            decisions.scheduled.append((live.name, cost))
            prefill_scheduled |= prefilling
            live.decoding = len(request.output) > outputs  # it sampled
            if len(request.output) >= live.target_output:
                finished.append(live)
        if preempted:
            return scheduled, finished  # vLLM admits nothing in a step that preempted
        # Requests the scan passed over that hold blocks: back at the head of
        # their queue after the scan, in scan order.
        skipped: list[_Live] = []
        # Whether the running loop scheduled anything (the padding reads it).
        self._running_scheduled = bool(decisions.scheduled)
        self._prefill_scheduled = prefill_scheduled
        while budget > 0 and len(self.running) < self.max_num_seqs:
            queue = self.holding if self.holding else self.waiting
            if not queue:
                break
            live = queue[0]
            if live.loading and not live.reported:
                skipped.append(queue.popleft())  # its KV is not here yet
                continue
            outputs = len(live.request.output)
            # The scan reaching a failed load frees its blocks and looks it up
            # again right away (`lookup load_failed`), asking the connector
            # again: its retry loads.
            load_failed = live.failed_reported
            if load_failed:
                live.loading = live.holds_blocks = live.failed_reported = False
                live.retried_load = True
                if live.remote is not None:
                    live.remote = replace(live.remote, fails=False)
            if live.holds_blocks:
                admitted = self._admit_loaded(live, budget)
                if admitted is None:
                    break
                hit, cost = 0, admitted
                decisions.taken.append((live.name, 0, 0, False))
            else:
                if not live.admitted and live.follows is not None:
                    cached = self.writer.check({"attention_cached": {live.follows: 0}})
                    decisions.checked[live.name] = int(cached["attention_cached"][live.follows])
                hit, external, load_async = self._lookup(live, decisions, load_failed)
                need = self.writer.run("reserve", req=live.name)["blocks"]
                if need > self.writer.oracle.num_free_blocks():
                    break
                reserved = self._reserved_blocks(skipped) if load_async else 0
                live.sched_computed = live.request.num_computed_tokens + hit + external
                if load_async:
                    # The load's blocks, nothing to compute: it waits for its KV,
                    # keeping the in-flight prefills' blocks free.
                    fields = {"reserved": reserved} if reserved else {}
                    result = self.writer.run("allocate", req=live.name, tokens="auto", **fields)
                    if not result["ok"]:
                        break
                    decisions.taken.append((live.name, hit, external, True))
                    live.loading, live.reported, live.holds_blocks = True, False, True
                    live.load_started = self.engine_step
                    skipped.append(queue.popleft())
                    continue
                chunk = self._admission_chunk(live, hit + external, budget)
                if chunk is None or not self._allocate(live, chunk, hit + external)():
                    break
                if self.config.kv_connector:
                    decisions.taken.append((live.name, hit, external, False))
                cost = chunk[1]
            queue.popleft()
            self.running.append(live)
            live.admitted = True
            live.holds_blocks = False
            budget -= cost
            scheduled = True
            decisions.scheduled.append((live.name, cost))
            decisions.admitted.append((live.name, hit))
            live.decoding = len(live.request.output) > outputs  # it sampled
            if len(live.request.output) >= live.target_output:
                finished.append(live)
        self.holding.extendleft(reversed(skipped))
        return scheduled, finished

    def _lookup(
        self, live: _Live, decisions: StepDecisions, load_failed: bool = False
    ) -> tuple[int, int, bool]:
        """The admission's lookup: (local hit taken, external tokens, loaded
        asynchronously). With a KV connector the lookup carries what the
        external store holds (and whether the request's load just failed),
        and the question the Scheduler then puts to the connector is
        recorded."""
        if not self.config.kv_connector:
            hit = int(self.writer.run("lookup", req=live.name)["hit"])
            decisions.lookups.append((live.name, hit))
            return hit, 0, False
        remote = live.remote or RemoteHit(0, False, 0)
        failed = {"load_failed": True} if load_failed else {}
        result = self.writer.run(
            "lookup",
            req=live.name,
            remote_hit=remote.tokens,
            remote_async=remote.load_async,
            **failed,
        )
        local = int(result["local_hit"])
        decisions.lookups.append((live.name, local))
        presented = local - local % self.config.scheduler_block_size
        answered = max(0, remote.tokens - presented)
        decisions.connector_queries.append(
            (live.name, presented, answered, remote.load_async and answered > 0)
        )
        external = int(result["external"])
        return int(result["hit"]), external, remote.load_async and external > 0

    def _admit_loaded(self, live: _Live, budget: int) -> int | None:
        """Admit a request that holds blocks, without a lookup. When the scan
        first reaches it after the worker reported its load, the Scheduler
        completes the load (its blocks keyed; a load of every token leaves the
        last to compute) whatever follows: the `allocate` completes it, or,
        when nothing runs this step, an `allocate complete_only` does only
        that. The tokens run, or None when nothing runs (the scan stops; the
        request stays waiting with its blocks)."""
        request = live.request
        completing = live.loading
        # Where the chunk starts once the load is complete.
        back = -1 if completing and request.num_computed_tokens >= request.num_tokens else 0
        live.loading = False
        live.sched_computed = request.num_computed_tokens + back
        chunk = self._admission_chunk(live, back, budget)
        if chunk is None:
            if completing:
                self.writer.run("allocate", req=live.name, tokens="auto", complete_only=True)
            return None
        if not self._allocate(live, chunk, back)():
            return None
        return chunk[1]

    def _reserved_blocks(self, skipped: list[_Live]) -> int:
        """The free blocks vLLM's Scheduler keeps when it admits an async KV
        load: what each in-flight prefill (a running request still in its
        prompt, or a waiting one holding blocks) needs to finish, from the
        computed tokens the Scheduler holds for it, plus a speculative step's
        attention blocks."""
        slots = 2 * self.spec + 1 if self.spec else 0  # 1 + K drafts + K lookahead
        manager = self.writer.oracle.manager
        # Waiting requests holding blocks, the ones this scan passed over too.
        holding = [*skipped, *self.holding]
        inflight = [live for live in self.running if not live.decoding] + holding
        reserved = sum(
            manager.blocks_to_finish(live.request, live.sched_computed, slots) for live in inflight
        )
        return reserved + sum(
            -(-slots // group.block_size)
            for group in self.config.groups
            if group.kind != "mamba_align"
        )

    def _admission_chunk(self, live: _Live, hit: int, budget: int) -> _Chunk | None:
        """The chunk of a request admitted from the waiting queue, `hit`
        tokens past its computed ones. With drafts, vLLM's Scheduler pads a
        chunk of one token to a whole speculative step (1 + K rows, the K
        placeholder drafts rejected) unless a running request ran a prefill
        chunk this step, or it is a first admission with nothing computed
        and no running request scheduled, or the rows would pass
        max_model_len; it admits nothing more when the budget cannot take
        the padded step, and drops the padding when the align-mode split
        cuts it. None: nothing to run (the scan stops)."""
        request = live.request
        computed = request.num_computed_tokens + hit
        padded = 1 + self.spec
        if (
            self.spec
            and request.num_tokens - computed == 1
            and not self._prefill_scheduled
            and (self._running_scheduled or computed > 0)
            and computed + padded + 1 <= self.config.max_model_len
        ):
            if padded > budget:
                return None
            offered = chunk_offer(self.config, padded, budget, self.num_eligible)
            if chunk_tokens(self.config, request, offered, hit) == padded:
                return "auto", padded, self.spec
        return self._chunk(request, hit, budget)

    def reported_loads(self) -> tuple[list[str], list[str]]:
        """The async loads the worker reports in this engine step's output,
        each `delay` steps after the step that started it: (finished,
        failed)."""
        loaded: list[str] = []
        failed: list[str] = []
        # Under `fail` vLLM's Scheduler frees each failed request's blocks in
        # the order of the worker's set of finished receives, which no model
        # can know: the worker reports one failure a step (a later one waits).
        one_failure = self.config.kv_load_failure_policy == "fail"
        for live in self.holding:
            remote = live.remote
            if (
                live.loading
                and not live.reported
                and remote is not None
                and self.engine_step - live.load_started >= remote.delay
                and not (remote.fails and one_failure and failed)
            ):
                live.reported = True
                live.failed_reported = remote.fails
                (failed if remote.fails else loaded).append(live.name)
        return loaded, failed

    def _chunk(self, request: Request, hit: int, budget: int) -> _Chunk | None:
        """The next prefill chunk within `budget`: (as written, tokens run,
        padding rows), or None when the split leaves nothing to run this step."""
        remaining = request.num_tokens - request.num_computed_tokens - hit
        offered = chunk_offer(self.config, remaining, budget, self.num_eligible)
        tokens = chunk_tokens(self.config, request, offered, hit)
        if tokens <= 0:
            return None
        # `auto` is the replayer's chunk: the full budget, the threshold by the
        # trace's live requests. Written only when it is this chunk.
        most = self.config.max_num_scheduled_tokens
        full = chunk_offer(self.config, remaining, most, self.num_eligible)
        replayed = chunk_offer(self.config, remaining, most, self.writer.oracle.num_live())
        auto = offered == full and chunk_tokens(self.config, request, replayed, hit) == tokens
        return ("auto" if auto else tokens), tokens, 0

    def _allocate(self, live: _Live, chunk: _Chunk, hit: int = 0) -> Callable[[], bool]:
        written, tokens, pad = chunk
        request = live.request
        # The chunk that computes every token samples the step's output token.
        sample = int(request.num_computed_tokens + hit + tokens - pad >= request.num_tokens)
        # Written only when padded: a trace without padding reads as before.
        padding = {"pad": pad} if pad else {}

        def run() -> bool:
            result = self.writer.run(
                "allocate",
                req=live.name,
                tokens=written,
                lookahead=self.spec,
                sample=sample,
                **padding,
            )
            return bool(result["ok"])

        return run

    def _decode(self, live: _Live, drafts: int) -> Callable[[], bool]:
        # Written only when the budget cut the drafts short.
        lookahead = self.spec if drafts < self.spec else 0

        def run() -> bool:
            result = self.writer.run("decode1", req=live.name, spec=drafts, lookahead=lookahead)
            return bool(result["ok"])

        return run


@dataclass
class StepDecisions(ScheduledStep):
    """What the scheduler model did in one engine step: what vLLM's
    `Scheduler` shows of a step (comparable step for step with the real one;
    running requests are scheduled first, then admissions), and what the
    model runner and the finish check then did."""

    # Output tokens each scheduled request gained this step (the model's ids).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    # Async KV loads the worker reports finished (or failed) in this step's output.
    loaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class StepObserver(Protocol):
    """Sees each turn arrive and each engine step's decisions, in order."""

    def arrived(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        remote: RemoteHit | None = None,
        inputs: HashInputs = NO_INPUTS,
    ) -> None:
        """A turn arrived: its prompt's token ids, its output length, the turn
        it follows, (with a KV connector) what the external store holds of
        it, and its hash inputs (its tenant's salt)."""

    def stepped(self, decisions: StepDecisions, last: Step) -> None:
        """An engine step ended (finishes freed); `last` is its last trace step."""


class SessionRun:
    """The scheduler model over the model, one engine step at a time."""

    def __init__(
        self,
        config: Config,
        sessions: Sequence[Session],
        serving: Serving,
        *,
        observer: StepObserver | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.sessions = sessions
        self.system_prompt = serving.system_prompt
        self.observer = observer
        self.progress = progress
        self.writer = _Writer(ModelTarget(config))
        self.scheduler = _Scheduler(config, serving.spec, serving.max_num_seqs, self.writer)
        # External hits are drawn from a stream of their own, so a run
        # without a connector draws exactly as before.
        self.remote_draws = (
            None
            if serving.connector_seed is None
            else random.Random(f"kvgate-connector-{serving.connector_seed}")
        )

    @property
    def oracle(self) -> ModelTarget:
        return self.writer.oracle

    def run(self) -> list[Step]:
        """Every turn to its end; the trace's steps."""
        writer, scheduler, sessions = self.writer, self.scheduler, self.sessions
        total = sum(len(s.turns) for s in sessions)
        if self.system_prompt > 0:
            writer.run("arrive", req=SYSTEM, prompt=(Segment("fresh", count=self.system_prompt),))
        # (arrival step, session, turn): ties arrive in session order.
        arrivals = [(s.turns[0].delay, s.index, 0) for s in sessions]
        heapq.heapify(arrivals)
        by_index = {s.index: s for s in sessions}
        now = done = idle = 0
        while done < total:
            if not scheduler.running and not scheduler.waiting and not scheduler.holding:
                now = max(now, arrivals[0][0])  # an idle engine waits for the next arrival
            while arrivals and arrivals[0][0] <= now:
                _, index, turn = heapq.heappop(arrivals)
                live = _arrive(writer, by_index[index], turn, self.system_prompt > 0)
                scheduler.waiting.append(live)
                if self.remote_draws is not None:
                    previous = (
                        len(writer.oracle.requests[live.follows].request.all_token_ids)
                        if live.follows is not None
                        else 0
                    )
                    live.remote = draw_remote(
                        self.remote_draws, len(live.request.all_token_ids), previous
                    )
                if self.observer is not None:
                    self.observer.arrived(
                        live.name,
                        list(live.request.all_token_ids),
                        live.target_output,
                        live.follows,
                        live.remote,
                        live.request.inputs,
                    )
            decisions = StepDecisions()
            outputs = {live.name: len(live.request.output) for live in scheduler.running}
            outputs.update(
                (live.name, len(live.request.output))
                for live in (*scheduler.waiting, *scheduler.holding)
            )
            scheduled, finished = scheduler.schedule(decisions)
            decisions.loaded, decisions.failed = scheduler.reported_loads()
            writer.run("step")
            decisions.copies = writer.run("drain")["copies"]
            for name, _ in decisions.scheduled:
                request = writer.oracle.requests[name].request
                decisions.sampled[name] = list(request.output[outputs[name] :])
            # Under `fail`, a failed load ends its request with an error once
            # the step's finishes are freed (vLLM frees its blocks with the
            # worker's report); the session's next turn still arrives.
            errored = [
                live
                for live in scheduler.holding
                if live.failed_reported and self.config.kv_load_failure_policy == "fail"
            ]
            for live in errored:
                scheduler.holding.remove(live)
            for live in [*finished, *errored]:
                if any(live is e for e in errored):
                    writer.run("free", req=live.name, how="abort", load_failed=True)
                else:
                    writer.run("free", req=live.name, how="finish")
                    scheduler.running.remove(live)
                    decisions.finished.append(live.name)
                done += 1
                if self.progress is not None:
                    self.progress(done, total)
                if live.turn + 1 < len(live.session.turns):
                    delay = live.session.turns[live.turn + 1].delay
                    heapq.heappush(arrivals, (now + delay, live.session.index, live.turn + 1))
            if self.observer is not None:
                self.observer.stepped(decisions, writer.steps[-1])
            scheduler.engine_step += 1
            # A load in flight is progress even when nothing is scheduled.
            loading = any(live.loading for live in scheduler.holding)
            idle = 0 if scheduled or loading else idle + 1
            if idle > MAX_IDLE_STEPS:
                head = (*scheduler.holding, *scheduler.waiting)
                stuck = head[0].name if head else "?"
                why = "the pool is too small for the plan"
                if head and head[0].retried_load:
                    # vLLM 0.33.0 keeps a failed load among its in-flight
                    # prefills, so the retry reserves its own blocks.
                    why = (
                        "its async load failed and vLLM's Scheduler reserves blocks for it "
                        "against its own retry (vLLM 0.33.0; see README)"
                    )
                raise WorkloadStuck(
                    f"{stuck} cannot be admitted on a pool of {self.config.num_blocks} blocks "
                    f"with nothing running: {why}"
                )
            now += 1
        # Every turn is finished: the pool must hold no reference at all.
        writer.check({"pool_clean": True, "free_blocks": 0})
        return writer.steps


def generate(
    config: Config,
    sessions: Sequence[Session],
    serving: Serving,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> list[Step]:
    """The fixed step list of `sessions` on `config`, as the model runs it.

    `progress(turns finished, turns)` is called as turns finish.
    """
    return SessionRun(config, sessions, serving, progress=progress).run()


def _arrive(writer: _Writer, session: Session, turn: int, system: bool) -> _Live:
    name = session.request(turn)
    fresh = Segment("fresh", count=session.turns[turn].fresh)
    if turn:
        prompt: tuple[Segment, ...] = (Segment("all_of", req=session.request(turn - 1)), fresh)
    elif system:
        prompt = (Segment("prompt_of", req=SYSTEM), fresh)
    else:
        prompt = (fresh,)
    writer.run("arrive", req=name, prompt=prompt, cache_salt=session.cache_salt)
    request = writer.oracle.requests[name].request
    return _Live(name, session, turn, request)
