"""The exploration machine's scenario rules: ops strung into the situations
that break managers like this one: a producer prefilled to a partial tail; a
follow-up turn that resumes at a parent's partial tail with a burst of other
prefills around its lookup; siblings arriving at a live producer's tail in
one step; a preemption right after a copy-on-write, then re-admission;
re-admission of a popped request's follow-up before the deferred free
completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvgate.explore.rules import (
    BURSTS,
    MAX_LIVE,
    PICK,
    PREFILL_ROUNDS,
    BasicRules,
    Burst,
    Landing,
    new_tokens,
    when,
)
from kvgate.explore.session import fresh, share_prompt
from kvgate.model.mamba import checkpoint_position

Interrupt = Literal["siblings", "preempt"]
InterruptAt = Literal["none", "first chunk", "tail", "done"]


@dataclass(frozen=True)
class Producer:
    """The shape of a producer request a scenario starts with."""

    blocks: int
    jitter: int
    landing: Landing
    decodes: int
    spec: int
    # Where its prefill is interrupted: after its first chunk, at the chunk
    # that stops at the prompt's partial tail (the split always stops
    # there), or ("done", siblings only) at its last chunk; "none": never.
    # There, in the same scheduler step: "siblings", requests sharing its
    # prompt (plus
    # `sibling_extra` new tokens, 0 for a resend of the same prompt) arrive
    # and are admitted in that same scheduler step, as a burst of users
    # with one system prompt is; or "preempt", the producer is preempted
    # (memory pressure mid-prefill), a burst takes the free blocks, and it
    # is admitted again.
    interrupt_at: InterruptAt = "none"
    interrupt: Interrupt = "siblings"
    siblings: int = 1
    sibling_extra: int = 0


PRODUCERS = st.builds(
    Producer,
    blocks=st.integers(0, 3),
    jitter=st.integers(1, 40),
    landing=st.sampled_from(["mid-block", "any", "boundary", "whole blocks"]),
    # Mostly at least one: the first decode moves the partial tail. Some
    # answers run past an attention block (a partial key then gets its
    # block's full key beside it).
    decodes=st.sampled_from([1, 2, 0, 3, 12]),
    spec=st.sampled_from([0, 3, 1]),
    interrupt_at=st.sampled_from(["none", "tail", "done", "first chunk", "none"]),
    interrupt=st.sampled_from(["siblings", "preempt"]),
    siblings=st.integers(1, 2),
    sibling_extra=st.sampled_from([0, 9, 1]),
)


class ScenarioRules(BasicRules):
    """The scenario rules, on the basic rules' helpers."""

    @when(lambda self: self._room())
    @rule(shape=PRODUCERS)
    def produce(self, shape: Producer) -> None:
        self._produce(shape)

    def _produce(self, shape: Producer) -> str | None:
        """A producer: a fresh prompt (by default with its tail inside a
        Mamba block) prefilled to the end, then `decodes` decode steps (the
        first moves its partial tail to a copy block); its name once its
        prompt is computed."""
        name = self._name()
        n = new_tokens(self.session.config, 0, shape.blocks, shape.jitter, shape.landing)
        self._arrive(name, fresh(n), self._hash.fresh(name, n))
        config = self.session.config
        if shape.interrupt_at in ("tail", "first chunk"):
            tail = checkpoint_position(
                n, config.hash_unit, config.block_drop, config.hash_lookahead_tokens
            )
            if self._prefill_until(name, tail if shape.interrupt_at == "tail" else 1):
                self._interrupt(name, shape)
        if not self._prefill(name, 0, PREFILL_ROUNDS):
            return None
        if shape.interrupt_at == "done":
            self._siblings(name, shape.siblings, shape.sibling_extra)
        if shape.decodes:
            self._tick()
            self._decode(name, shape.spec, shape.decodes)
        self._tick()
        return name

    def _interrupt(self, producer: str, shape: Producer) -> None:
        """What happens to a producer in the middle of its prefill (`Producer`)."""
        if shape.interrupt == "siblings":
            self._siblings(producer, shape.siblings, shape.sibling_extra)
            self._tick()
            return
        self._tick()
        self._run("free", req=producer, how="preempt")
        self._tick()
        self._burst("all", 0)

    def _siblings(self, producer: str, count: int, extra: int) -> None:
        """`count` requests sharing `producer`'s prompt (plus `extra`, `extra +
        1`, ... new tokens) arrive and are admitted in the current scheduler
        step (a hit on a state this very step keyed is deferred)."""
        children = []
        for i in range(min(count, MAX_LIVE - self._live())):
            child = self._name()
            prompt = share_prompt(producer, extra + i)
            self._arrive(child, prompt, self._hash.shared(child, producer))
            children.append(child)
        for child in children:
            self._chunk(child, 0)

    @when(lambda self: self._room() and bool(self._computed()))
    @rule(
        which=PICK,
        extra=st.sampled_from([0, 0, 1, 9]),
        burst=st.sampled_from(["none", "some", "all"]),
        n=st.integers(0, 4),
        aligned=st.booleans(),
    )
    def resend(self, which: int, extra: int, burst: Burst, n: int, aligned: bool) -> None:
        """A prompt sent again as it was (a client's retry, parallel samples
        as separate requests), or with a few tokens more, mostly while its
        states are still cached: prefilled to the end and decoded a step.
        With `aligned`, the prompt is a whole number of hash units long
        (an earlier one, or a new templated one produced first): every
        block of it is keyed, so only the lookup's cap (the prompt less its
        last token) keeps one to compute."""
        # A retry follows its original closely: the newest first.
        computed = self._computed()[::-1]
        if aligned:
            unit = self.session.config.hash_unit
            model = self.session.model
            computed = [
                r for r in computed if model.requests[r].request.num_prompt_tokens % unit == 0
            ]
            if not computed and self._live() <= MAX_LIVE - 2:
                made = self._produce(Producer(1, 1, "whole blocks", decodes=1, spec=0))
                computed = [] if made is None else [made]
            if not computed:
                return
        producer = self._pick(computed, which)
        self._burst(burst, n)
        child = self._name()
        self._arrive(child, share_prompt(producer, extra), self._hash.shared(child, producer))
        if self._prefill(child, 0, PREFILL_ROUNDS):
            self._tick()
            self._decode(child, 0, 1)
        self._tick()

    def _computed(self) -> list[str]:
        return self.session.in_phase("decoding", "ended")

    @when(lambda self: self._room())
    @rule(
        # A new producer twice as often as an earlier request.
        parent=st.one_of(PRODUCERS, PRODUCERS, PICK),
        jitter=st.integers(1, 24),
        # Mostly a short turn; sometimes a long one (a pasted document):
        # its prefill after the resume spans several Mamba blocks.
        blocks=st.sampled_from([0, 0, 3]),
        before=BURSTS,
        after=BURSTS,
        after_admission=st.booleans(),
        n=st.integers(0, 4),
        # A resident parent mostly: its state must survive the burst.
        end_parent=st.sampled_from([False, False, True]),
    )
    def follow_up_turn(
        self,
        parent: Producer | int,
        jitter: int,
        blocks: int,
        before: Burst,
        after: Burst,
        after_admission: bool,
        n: int,
        end_parent: bool,
    ) -> None:
        """A follow-up turn that resumes at its parent's partial tail, with
        bursts of other prefills before its lookup and after it (before or
        after its admission). The parent is a new producer (when there is
        room for two) or an earlier computed request, optionally finished
        first."""
        name: str | None = None
        if isinstance(parent, Producer):
            if self._live() <= MAX_LIVE - 2:
                name = self._produce(parent)
        elif self._computed():
            name = self._pick(self._computed(), parent)
        if name is None:
            return
        if end_parent and self.session.requests[name].phase == "decoding":
            self._run("free", req=name, how="finish")
        self._burst(before, n)
        child = self._follow_up(name, blocks, jitter, "any")
        self._run("lookup", req=child)
        if not after_admission:
            self._burst(after, n)
        if self._chunk(child, 0) and after_admission:
            self._burst(after, n)
        self._tick()
        if blocks:
            self._prefill(child, 0, PREFILL_ROUNDS)
            self._tick()

    def _producers(self) -> list[str]:
        return self.session.in_phase("decoding")

    @when(lambda self: self._room() and bool(self._producers()))
    @rule(which=PICK, siblings=st.integers(2, 3), jitter=st.integers(1, 24), burst=BURSTS)
    def siblings_at_tail(self, which: int, siblings: int, jitter: int, burst: Burst) -> None:
        """Siblings at a live producer's tail: follow-ups of one decoding
        request arrive and are admitted in the same scheduler step, after a
        burst, while the producer keeps decoding."""
        producer = self._pick(self._producers(), which)
        children = [
            self._follow_up(producer, 0, jitter + i, "any")
            for i in range(min(siblings, MAX_LIVE - self._live()))
        ]
        self._burst(burst, 2)
        for child in children:
            self._chunk(child, 0)
        if producer not in self.session.allocated_since_drain:
            self._decode(producer, 0, 1)
        self._tick()

    def _resumable(self) -> list[str]:
        """Waiting follow-ups (whose lookup may hit a partial tail)."""
        session = self.session
        return [r for r in session.schedulable("waiting") if session.parent(r) is not None]

    @when(lambda self: bool(self._resumable()))
    @rule(which=PICK, drain_between=st.booleans(), readmit=st.booleans(), burst=BURSTS)
    def preempt_after_cow(
        self, which: int, drain_between: bool, readmit: bool, burst: Burst
    ) -> None:
        """A follow-up admitted at a partial-tail hit (its copy-on-write
        queued) and preempted in the same step, before or after the copy
        runs; then, after a burst, admitted again."""
        req = self._pick(self._resumable(), which)
        if not self._chunk(req, 0):
            return
        if drain_between:
            self._tick()
        self._run("free", req=req, how="preempt")
        self._tick()
        self._burst(burst, 2)
        if readmit:
            self._chunk(req, 0)
            self._tick()

    @when(lambda self: self._room() and bool(self.session.in_phase("running", "decoding")))
    @rule(which=PICK, jitter=st.integers(1, 24), release_first=st.booleans(), burst=BURSTS)
    def readmit_after_pop(self, which: int, jitter: int, release_first: bool, burst: Burst) -> None:
        """A running request is popped (its free deferred) and its follow-up
        is admitted while (or right after) the popped blocks are released."""
        req = self._pick(self.session.in_phase("running", "decoding"), which)
        self._run("pop", req=req)
        if release_first:
            self._run("release", req=req)
        child = self._follow_up(req, 0, jitter, "any")
        self._burst(burst, 2)
        self._chunk(child, 0)
        if not release_first:
            self._run("release", req=req)
        self._tick()
