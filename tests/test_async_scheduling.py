"""Async scheduling in scheduler-level traces: two batches in flight, the
Scheduler's deferred frees with a KV connector, the output of a batch in
flight when its request was preempted, and drifts the lockstep catches."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

from configs import needs_vllm
from scheduler_runs import (
    Wrapped,
    first_failure,
    run_vllm,
    text_of,
    trace_of,
)

from kvgate.conformance.trace import (
    Trace,
    parse_trace,
)
from kvgate.model.scheduler import SchedulerModel
from kvgate.mutate.faults import BY_NAME
from kvgate.mutate.inject import injected
from kvgate.vocabulary.scheduling import DeferredFree, EngineStep

TRACE = trace_of("sched-async-abort-frees-after-batch")
UNDER_PRESSURE = trace_of("sched-async-deferred-frees-under-pressure")
PREEMPTED_IN_FLIGHT = trace_of("sched-async-preempted-request-finishes-with-its-in-flight-token")
RESET_IN_FLIGHT = trace_of("sched-async-reset-drops-in-flight-output")


def stepped(trace: Trace) -> Iterator[tuple[SchedulerModel, EngineStep, Any]]:
    """kvgate's scheduler model driven through `trace`'s engine entries: after
    each, the model, the entry and, for an engine step, its decisions (None
    for any other entry)."""
    model = SchedulerModel(trace.config, 0, 4)
    for event in trace.engine:
        step = None
        if event.op == "arrive":
            assert event.req is not None
            model.arrive(event.arrival())
        elif event.op == "abort":
            assert event.req is not None
            model.abort(event.req)
        elif event.op == "reset":
            model.reset_prefix_cache(running=True)
        else:
            step = model.step()
        yield model, event, step


def test_an_engine_step_processes_the_batch_before_the_last() -> None:
    for model, event, step in stepped(TRACE):
        if event.op == "abort":
            # A's second chunk is still running: its blocks wait for it.
            assert model.deferred_frees() == [(2, "A")]
        elif event.index == 5:  # the batch A ran in is done: A's blocks are back
            assert step is not None and model.deferred_frees() == []
    # The trace ends with a step: B's last batch processed (nothing left to
    # schedule), its copy's endpoints back; an empty batch is still in flight.
    assert step is not None and step.scheduled == [] and model.deferred_frees() == []
    assert model.batches_in_flight() == 1


DECODES_IN_FLIGHT = trace_of(
    TRACE.name,
    text_of(TRACE.name).replace("[{prompt_of: A}], max_tokens: 1", "[{fresh: 40}], max_tokens: 3"),
)


@needs_vllm
def test_a_request_decodes_past_its_output_in_flight() -> None:
    """B decodes on its output placeholders while the batch before is in
    flight; the placeholder counts are compared per request at each step.
    (The trace's expectations are the original's: only they may miss.)"""
    result = run_vllm(DECODES_IN_FLIGHT)
    assert result.steps_run == len(DECODES_IN_FLIGHT.engine)
    assert all(d.level == "expect" for d in (result.divergence, *result.also) if d)
    with injected(BY_NAME["async-no-placeholder-for-prompt"]):
        result = run_vllm(DECODES_IN_FLIGHT)
    [diverged] = [d for d in (result.divergence, *result.also) if d and d.level != "expect"]
    assert diverged.level == "strict" and "output accounting" in diverged.what
    assert (diverged.expected, diverged.actual) == ({"B": (1, 8, 0)}, {"B": (0, 8, 0)})


@needs_vllm
def test_the_real_scheduler_is_the_one_the_engine_builds_for_async_scheduling() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvgate.impl.vllm_scheduler import VllmScheduler

    real = VllmScheduler(TRACE.config, spec_tokens=0, max_num_seqs=4)
    try:
        assert isinstance(real.scheduler, AsyncScheduler)
        assert real.scheduler.defer_block_free
    finally:
        real.close()


class _FreesHeadFirst(Wrapped):
    """vLLM's Scheduler returning deferred blocks head first (the order it
    popped them in), as if the reversal were dropped."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        scheduler = real.scheduler

        def drain() -> None:
            while scheduler.deferred_frees:
                if scheduler.deferred_frees[0][0] > scheduler.processed_step_seq:
                    break
                _, blocks = scheduler.deferred_frees.popleft()
                scheduler.kv_cache_manager.block_pool.free_blocks(blocks)

        scheduler._drain_deferred_frees = drain


class _ForgetsDeferredFrees(Wrapped):
    """A Scheduler whose deferred-free queue shows nothing."""

    def deferred_frees(self) -> list[DeferredFree]:
        return []


class _OneBatchAtATime(Wrapped):
    """An engine that processes each batch's output in the step that made it."""

    def batches_in_flight(self) -> int:
        return 2 if self.real.batches_in_flight() else 0


@needs_vllm
def test_the_trace_conforms_and_catches_deferred_frees_in_the_wrong_order() -> None:
    assert run_vllm(TRACE).passed
    # A's blocks come back when the batch after its abort is processed.
    assert first_failure(run_vllm(TRACE, _FreesHeadFirst)) == (
        5,
        "strict",
        "engine step 3: free queue",
    )


@needs_vllm
def test_deferred_frees_head_first_change_what_a_later_request_is_scheduled() -> None:
    # Under pool pressure the order A's blocks came back in decides what
    # is evicted before D sends A's prompt: visible at level api too.
    assert run_vllm(UNDER_PRESSURE).passed
    result = run_vllm(UNDER_PRESSURE, _FreesHeadFirst, "api")
    assert result.divergence is not None
    assert (result.divergence.level, result.divergence.what) == ("expect", "scheduled")
    assert first_failure(run_vllm(UNDER_PRESSURE, _FreesHeadFirst))[1:] == (
        "strict",
        "engine step 4: free queue",
    )


@needs_vllm
def test_a_scheduler_whose_deferred_frees_differ_diverges() -> None:
    # The copy of B's last chunk is the one deferred free left after a step.
    index, level, what = first_failure(run_vllm(TRACE, _ForgetsDeferredFrees))
    assert (index, level) == (11, "api") and what.endswith("deferred frees (fence, request)")


@needs_vllm
def test_an_engine_that_keeps_other_batches_in_flight_diverges() -> None:
    index, level, what = first_failure(run_vllm(TRACE, _OneBatchAtATime))
    assert (index, level) == (1, "api") and what.endswith("batches in flight")


def decisions_by_step(trace: Trace) -> list[tuple[int, Any]]:
    """The scheduler model's decisions at each engine step of `trace`."""
    return [(event.index, step) for _, event, step in stepped(trace) if step is not None]


def test_a_request_preempted_with_its_last_chunk_in_flight_finishes_with_that_token() -> None:
    steps = dict(decisions_by_step(PREEMPTED_IN_FLIGHT))
    preempting = steps[6]
    assert preempting.preempted == ["B"] and preempting.finished == ["B"]
    # Its first output reads the cache estimate after its blocks were freed.
    assert preempting.prefill_stats["B"] == (0, 0)
    # It never runs again.
    assert not any(name == "B" for i, s in steps.items() if i > 6 for name, _ in s.scheduled)


def test_a_resets_preemption_drops_the_output_in_flight() -> None:
    steps = dict(decisions_by_step(RESET_IN_FLIGHT))
    # B's token sampled in the batch in flight at the reset is not delivered:
    # B runs its prompt again and finishes with a token sampled anew.
    after_reset = steps[7]
    assert after_reset.finished == [] and after_reset.scheduled == [("A", 32), ("B", 32)]
    assert steps[9].finished == ["B"]


class _PreemptionSetsStaleOutput(Wrapped):
    """vLLM's Scheduler whose preemptions always drop (`drop`) or always
    deliver the output of a batch in flight, a reset's included."""

    def __init__(self, real: Any, drop: bool) -> None:
        super().__init__(real)
        scheduler = real.scheduler
        preempt = scheduler._preempt_request

        def preempting(request: Any, timestamp: float, drop_stale_output: bool = False) -> None:
            preempt(request, timestamp, drop_stale_output=drop)

        scheduler._preempt_request = preempting


@needs_vllm
def test_the_output_of_a_preempted_requests_batch_is_checked_both_ways() -> None:
    assert run_vllm(PREEMPTED_IN_FLIGHT).passed
    assert run_vllm(RESET_IN_FLIGHT).passed
    # Dropped where it is delivered: B is never reported finished there.
    result = run_vllm(PREEMPTED_IN_FLIGHT, functools.partial(_PreemptionSetsStaleOutput, drop=True))
    assert result.divergence is not None
    assert (result.divergence.level, result.divergence.what) == ("expect", "finished")
    # Delivered where a reset drops it: the Scheduler then passes over the
    # reset's victims until that output is in, scheduling nothing after the reset.
    keeps = functools.partial(_PreemptionSetsStaleOutput, drop=False)
    index, level, what = first_failure(run_vllm(RESET_IN_FLIGHT, keeps, "api"))
    assert (index, level, what) == (7, "expect", "scheduled")


BLOCK_BOUNDARY = trace_of("sched-mtp-async-drafts-around-a-mamba-block-boundary")


@needs_vllm
def test_rejected_drafts_kept_in_flight_diverge_at_their_update() -> None:
    """Drafts rejected in a batch must come off the request's placeholders
    and computed tokens at its update: keeping either diverges, the
    placeholders in the per-request output accounting at that very step,
    the computed tokens in what the next step schedules."""
    assert run_vllm(BLOCK_BOUNDARY).passed
    with injected(BY_NAME["async-rejected-kept-as-placeholders"]):
        kept = run_vllm(BLOCK_BOUNDARY)
    diverged = lockstep_divergence(kept)
    assert diverged.level == "strict" and "output accounting" in diverged.what
    with injected(BY_NAME["rejected-drafts-kept-as-computed"]):
        computed = run_vllm(BLOCK_BOUNDARY)
    # Computed tokens kept show in the next batch: one token, not 1 + 3.
    later = lockstep_divergence(computed)
    assert later.step.index == diverged.step.index + 1
    assert later.what.endswith("scheduled (request, tokens)")


def lockstep_divergence(result: Any) -> Any:
    """The replay's divergence from the model (not an expectation missed)."""
    [diverged] = [d for d in (result.divergence, *result.also) if d and d.level != "expect"]
    return diverged


def _with_drafts(trace: Trace) -> Trace:
    """`trace` with an eagle drafter proposing 3 drafts (legacy hashes, the
    eagle block drop), 6 output tokens a request, its expectations dropped
    (the lockstep judges it) and more steps to finish."""
    lines = []
    for line in text_of(trace.name).splitlines():
        line = re.sub(r", expect: \{.*\}\}$", "}", line)
        line = line.replace("max_tokens: 1}", "max_tokens: 6}").replace(
            "max_tokens: 1,", "max_tokens: 6,"
        )
        lines.append(line)
    text = "\n".join(lines) + "\n" + "  - {op: step, steps: 12}\n"
    text = (
        text.replace("eagle: false", "eagle: true")
        .replace(
            "{kind: mamba_align, block_size: 32}",
            "{kind: mamba_align, block_size: 32, speculative_blocks: 3}",
        )
        .replace("spec: 0", "spec: 3")
    )
    return parse_trace(text, trace.path)


@needs_vllm
def test_deferred_frees_with_drafts_in_flight() -> None:
    """With a KV connector, drafts and async scheduling, the deferred frees
    of requests aborted with a batch in flight follow vLLM's; returning them
    head first diverges."""
    trace = _with_drafts(UNDER_PRESSURE)
    assert trace.scheduler is not None and trace.scheduler.spec == 3
    result = run_vllm(trace)
    assert result.passed, result.divergence
    assert result.steps_run == len(trace.engine)
    assert run_vllm(trace, _FreesHeadFirst).divergence is not None
