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
   blocks), the first chunk; the first that does not fit ends admission;
3. `step` and `drain`, then `free finish` of requests that generated their
   output; a follow-up arrives after its tool latency.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvgate.conformance.config import Config
from kvgate.conformance.driver import chunk_offer
from kvgate.conformance.ops import ACTIONS, Segment, Step
from kvgate.conformance.scheduling import ScheduledStep
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
        self.num_eligible = len(self.waiting) + len(self.running)
        index = 0
        while index < len(self.running) and budget > 0:
            live = self.running[index]
            request = live.request
            outputs = len(request.output)
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
                    break
                ok = run()
            if not ok:
                break
            budget -= cost
            scheduled = True
            index += 1
            decisions.scheduled.append((live.name, cost))
            live.decoding = len(request.output) > outputs  # it sampled
            if len(request.output) >= live.target_output:
                finished.append(live)
        if preempted:
            return scheduled, finished  # vLLM admits nothing in a step that preempted
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            live = self.waiting[0]
            outputs = len(live.request.output)
            if not live.admitted and live.follows is not None:
                cached = self.writer.check({"attention_cached": {live.follows: 0}})
                decisions.checked[live.name] = int(cached["attention_cached"][live.follows])
            hit = self.writer.run("lookup", req=live.name)["hit"]
            decisions.lookups.append((live.name, hit))
            need = self.writer.run("reserve", req=live.name)["blocks"]
            if need > self.writer.oracle.num_free_blocks():
                break
            chunk = self._chunk(live.request, hit, budget)
            if chunk is None or not self._allocate(live, chunk, hit)():
                break
            self.waiting.popleft()
            self.running.append(live)
            live.admitted = True
            budget -= chunk[1]
            scheduled = True
            decisions.scheduled.append((live.name, chunk[1]))
            decisions.admitted.append((live.name, hit))
            live.decoding = len(live.request.output) > outputs  # it sampled
            if len(live.request.output) >= live.target_output:
                finished.append(live)
        return scheduled, finished

    def _chunk(
        self, request: Request, hit: int, budget: int
    ) -> tuple[int | Literal["auto"], int] | None:
        """The next prefill chunk within `budget`: (as written, tokens), or None
        when the split leaves nothing to run this step."""
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
        return ("auto" if auto else tokens), tokens

    def _allocate(
        self, live: _Live, chunk: tuple[int | Literal["auto"], int], hit: int = 0
    ) -> Callable[[], bool]:
        written, tokens = chunk
        request = live.request
        # The chunk that computes every token samples the step's output token.
        sample = int(request.num_computed_tokens + hit + tokens >= request.num_tokens)

        def run() -> bool:
            result = self.writer.run(
                "allocate", req=live.name, tokens=written, lookahead=self.spec, sample=sample
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


class StepObserver(Protocol):
    """Sees each turn arrive and each engine step's decisions, in order."""

    def arrived(self, name: str, tokens: list[int], max_tokens: int, follows: str | None) -> None:
        """A turn arrived: its prompt's token ids, its output length, the turn
        it follows."""

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
            if not scheduler.running and not scheduler.waiting:
                now = max(now, arrivals[0][0])  # an idle engine waits for the next arrival
            while arrivals and arrivals[0][0] <= now:
                _, index, turn = heapq.heappop(arrivals)
                live = _arrive(writer, by_index[index], turn, self.system_prompt > 0)
                scheduler.waiting.append(live)
                if self.observer is not None:
                    self.observer.arrived(
                        live.name,
                        list(live.request.all_token_ids),
                        live.target_output,
                        live.follows,
                    )
            decisions = StepDecisions()
            outputs = {live.name: len(live.request.output) for live in scheduler.running}
            outputs.update((live.name, len(live.request.output)) for live in scheduler.waiting)
            scheduled, finished = scheduler.schedule(decisions)
            writer.run("step")
            decisions.copies = writer.run("drain")["copies"]
            for name, _ in decisions.scheduled:
                request = writer.oracle.requests[name].request
                decisions.sampled[name] = list(request.output[outputs[name] :])
            for live in finished:
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
            idle = 0 if scheduled else idle + 1
            if idle > MAX_IDLE_STEPS:
                stuck = scheduler.waiting[0].name if scheduler.waiting else "?"
                raise WorkloadStuck(
                    f"{stuck} cannot be admitted on a pool of {self.config.num_blocks} blocks "
                    "with nothing running: the pool is too small for the plan"
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
    writer.run("arrive", req=name, prompt=prompt)
    request = writer.oracle.requests[name].request
    return _Live(name, session, turn, request)
