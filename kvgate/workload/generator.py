"""Turn a session plan into a fixed trace, with the model as the oracle.

`SessionRun` plays the plan's turns through kvgate's scheduler model
(`model.scheduler.SchedulerModel`, which writes each manager call as a trace
step on the model) one engine step at a time: each turn arrives when its
session's previous turn finished and its tool latency passed; a follow-up's
prompt is the previous turn's whole sequence and its fresh tokens; the
first turn's starts with the shared system prompt (held by a request never
scheduled).

With a KV connector (`Serving.connector_seed`), each request's external hit
is drawn (`draw_remote`) when it arrives, and every lookup carries it.

Each engine step's decisions (`StepDecisions`: what ran with how many
tokens, preemptions, lookups and admissions, copies, sampled tokens,
finishes) go to an optional `StepObserver`, which is how the
scheduler-level lockstep (`workload.lockstep`) drives vLLM's real
`Scheduler` beside it.

The scheduler branches on the model's answers (hits, `ok`, reservation
counts) while it writes, so the trace is one fixed step list: every
observation is written into the step's `expect`, and a replay on any target
either reproduces it step for step or reports where it diverged. Before
each first admission of a follow-up a `check attention_cached` of the
previous turn records whether its whole attention prefix is still cached.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from kvgate.model import ModelTarget
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import LiveRequest, SchedulerStuck, StepDecisions, StepWriter
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.scheduling import Arrival, RemoteHit
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs
from kvgate.workload.deployment import Serving
from kvgate.workload.plan import Session

__all__ = ["SessionRun", "StepObserver", "WorkloadStuck", "draw_remote", "generate"]

SYSTEM = "system"  # the request holding the shared system prompt (never scheduled)
# Generation gives up when this many steps in a row schedule nothing.
MAX_IDLE_STEPS = 3
# The plan cannot run on this pool (a request never fits).
WorkloadStuck = SchedulerStuck


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
    """The plan's turns through the scheduler model, one engine step at a time."""

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
        self.scheduler = SchedulerModel(config, serving.spec, serving.max_num_seqs)
        # Each turn's session and index in it, by request name.
        self._turns: dict[str, tuple[Session, int]] = {}
        # External hits are drawn from a stream of their own, so a run
        # without a connector draws exactly as before.
        self.remote_draws = (
            None
            if serving.connector_seed is None
            else random.Random(f"kvgate-connector-{serving.connector_seed}")
        )

    @property
    def writer(self) -> StepWriter:
        return self.scheduler.writer

    @property
    def oracle(self) -> ModelTarget:
        return self.scheduler.oracle

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
                live = self._arrive(by_index[index], turn)
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
                        live.max_tokens,
                        live.follows,
                        live.remote,
                        live.request.inputs,
                    )
            decisions = scheduler.step()
            # The session's next turn still arrives after an errored one.
            for name in (*decisions.finished, *decisions.errored):
                done += 1
                if self.progress is not None:
                    self.progress(done, total)
                session, turn = self._turns[name]
                if turn + 1 < len(session.turns):
                    delay = session.turns[turn + 1].delay
                    heapq.heappush(arrivals, (now + delay, session.index, turn + 1))
            if self.observer is not None:
                self.observer.stepped(decisions, writer.steps[-1])
            idle = 0 if decisions.scheduled or scheduler.loading() else idle + 1
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

    def _arrive(self, session: Session, turn: int) -> LiveRequest:
        name = session.request(turn)
        fresh = Segment("fresh", count=session.turns[turn].fresh)
        follows = session.request(turn - 1) if turn else None
        if follows is not None:
            prompt: tuple[Segment, ...] = (Segment("all_of", req=follows), fresh)
        elif self.system_prompt > 0:
            prompt = (Segment("prompt_of", req=SYSTEM), fresh)
        else:
            prompt = (fresh,)
        self._turns[name] = (session, turn)
        output = session.turns[turn].output
        return self.scheduler.arrive(Arrival(name, prompt, output, follows, session.cache_salt))


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
