"""Async scheduling in kvgate's scheduler model: the engine's batch queue.

vLLM's engine schedules the next batch while the last one runs, so up to
`ASYNC_BATCHES` batches are in flight: a batch's output is processed a step
after it was scheduled, a request preempted meanwhile gets that output late
(stale) or not at all (after a prefix-cache reset), and with a KV connector
the blocks of a request that ended wait (a deferred free) until every batch
that may still write them is done."""

from __future__ import annotations

from kvgate.model.output_placeholders import OutputPlaceholders
from kvgate.model.scheduler_state import (
    Batch,
    LiveRequest,
    StepDecisions,
)
from kvgate.vocabulary.scheduling import ASYNC_BATCHES, COW_RETENTION, DeferredFree
from kvgate.vocabulary.target import StepRefused


class AsyncNotModelled(StepRefused):
    """Under async scheduling, a path the scheduler model does not cover
    (vLLM runs it): the trace cannot be replayed."""

    def __init__(self, message: str) -> None:
        super().__init__("config.async_scheduling", message)


class AsyncBatches(OutputPlaceholders):
    """The engine's steps with batches in flight, and what they defer; each
    batch's output settled on the output placeholders (`OutputPlaceholders`)."""

    def _async_step(self) -> StepDecisions:
        """One step of vLLM's engine with a batch queue: while it has
        requests it schedules a batch (even an empty one); it then returns
        at once unless `ASYNC_BATCHES` batches are in flight or nothing is
        left to schedule, else it processes the oldest batch's output."""
        decisions = StepDecisions()
        self._output_processed = False
        if self.has_requests():
            self._start_batch()
            # Nothing is sampled at the schedule under async scheduling: the
            # output comes with the batch's update (`_settle`).
            self._schedule_batch(decisions)
            samples, drafts, accepted = self._take_batch()
            self._ended_since_schedule = False
            executed = bool(decisions.scheduled)
            self.batches_scheduled += 1
            if executed and self.defer_block_free:
                self.sched_seq += 1
            for live in self._live():
                if any(name == live.name for name, _ in decisions.scheduled):
                    live.last_batch = self.batches_scheduled
                    live.last_sched_seq = self.sched_seq
            self.in_flight.append(
                Batch(
                    decisions.scheduled,
                    executed,
                    self.batches_scheduled,
                    samples,
                    drafts,
                    accepted,
                )
            )
            if len(self.in_flight) < ASYNC_BATCHES and (executed or self.has_requests()):
                self._no_output_processed()
                return decisions
        elif not self.in_flight:
            self._no_output_processed()
            return decisions
        batch = self.in_flight.popleft()
        self.batches_processed += 1
        self._output_processed = True
        if batch.executed and self.defer_block_free:
            # Every write of the batches up to this one is done: deferred
            # frees fenced by them go back to the pool, in order.
            self.processed_seq += 1
            while self.deferred and self.deferred[0][0] <= self.processed_seq:
                _, name = self.deferred.popleft()
                if name == COW_RETENTION:
                    self.writer.run("drain", release_retained=True)
                else:
                    self.writer.run("release", req=name)
        self._settle(decisions, batch)
        self.engine_step += 1
        return decisions

    def _no_output_processed(self) -> None:
        """The step ends without processing an output: a stop condition it
        names has no output to meet."""
        stopping = next((live.name for live in self._live() if live.stops_at_next_token), None)
        if stopping is not None:
            raise AsyncNotModelled(
                f"{stopping}'s stop: this engine step processes no batch's output (under async "
                "scheduling a stop applies to the output the step processes)"
            )
        self.engine_step += 1

    def batches_in_flight(self) -> int:
        return len(self.in_flight)

    def decode_drafts(self) -> dict[str, int]:
        if not self.in_flight:  # none under synchronous scheduling
            return {}
        batch = self.in_flight[-1]
        return {name: n for name, n in batch.drafts.items() if name in batch.samples}

    def deferred_frees(self) -> list[DeferredFree]:
        """The deferred frees not yet released: (fence, request), in order."""
        return list(self.deferred)

    def _free_deferred(self, live: LiveRequest) -> bool:
        """Freeing `live`'s blocks now would be deferred: a batch that may
        still write them is in flight (with a KV connector under async
        scheduling)."""
        return self.defer_block_free and live.last_sched_seq > self.processed_seq

    def _in_flight_field(self, live: LiveRequest) -> dict[str, int]:
        """An op's `in_flight`: the request's tokens the batches in flight
        compute (written only when some)."""
        tokens = self._in_flight_tokens(live)
        return {"in_flight": tokens} if tokens else {}

    def _stale(self, live: LiveRequest) -> bool:
        """The output of a batch in flight when `live` was preempted is
        still to come. (vLLM's Scheduler passes over such a request in its
        waiting scan until a delivered output is in; with two batches in
        flight the engine processes the victim's batch in the very step
        that preempted it, before the next scan, so no scan meets one.)"""
        return live.stale_until > self.batches_processed

    def _refuse_preempting_in_flight(self, live: LiveRequest) -> None:
        # Without a KV connector the blocks are freed at once and the
        # batch's output turns stale; with one, vLLM defers the free, which
        # a reset's preemption (the only one reaching here) does not model.
        if self.defer_block_free and self._in_flight(live):
            raise AsyncNotModelled(
                f"preempting {live.name} while a batch that scheduled it is in flight "
                "is not modelled"
            )

    def _in_flight(self, live: LiveRequest) -> bool:
        """A batch that scheduled `live` is still in flight."""
        return live.last_batch > self.batches_processed
