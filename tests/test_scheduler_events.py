"""KV-cache events, KV-cache usage and stats logging off in scheduler-level
traces: what the reader accepts, that the bundled traces make their point,
and that a wrong event, a wrong usage or stats made with logging off diverge
at the step where they happen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from configs import SMALL_SCHEDULER_TRACE_HEAD, needs_vllm
from scheduler_runs import Wrapped, first_failure, run_model, run_vllm, trace_of

from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    parse_trace,
)
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.events import KvEvent

EVENTS_TRACE = trace_of("sched-kv-events-store-evict-clear")
STATS_OFF_TRACE = trace_of("sched-stats-off-next-turn-after-preempted")


def engine_step_with(trace: Trace, wanted: Callable[[list[str]], bool]) -> int:
    """The index of the first engine step whose `events` expectation `wanted` accepts."""
    return next(
        e.index for e in trace.engine if e.op == "step" and wanted(e.expect.get("events", []))
    )


# -- the reader ---------------------------------------------------------------


def small_trace(config_lines: str, expect: str) -> str:
    head = SMALL_SCHEDULER_TRACE_HEAD.format(name="small").replace(
        "scheduler:", config_lines + "scheduler:"
    )
    return head + (
        "  - {op: arrive, req: A, prompt: [{fresh: 40}], max_tokens: 2}\n"
        f"  - {{op: step, expect: {expect}}}\n"
    )


def test_an_events_expectation_reads_as_event_lines() -> None:
    trace = parse_trace(
        small_trace("  kv_events: true\n", '{events: ["stored g0 0-32/8: 8 16 24 32"]}')
    )
    assert trace.engine[1].expect == {"events": ["stored g0 0-32/8: 8 16 24 32"]}


@pytest.mark.parametrize(
    ("config_lines", "expect", "message"),
    [
        ("", "{events: []}", "needs config.kv_events"),
        ("  kv_events: true\n", "{events: stored}", "must be a list of event lines"),
        ("  kv_events: true\n", "{events: [1]}", "must be a list of event lines"),
    ],
)
def test_a_bad_events_expectation_is_one_error_naming_the_step(
    config_lines: str, expect: str, message: str
) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(small_trace(config_lines, expect))
    assert error.value.step_index == 1 and error.value.field == "expect.events"
    assert message in str(error.value)


# -- the bundled traces on the model --------------------------------------------


def test_the_events_trace_shows_stores_evictions_and_the_reset() -> None:
    steps = [e for e in EVENTS_TRACE.engine if e.op == "step"]
    assert all("events" in e.expect for e in steps)  # every step states them
    published = [line for e in steps for line in e.expect["events"]]
    assert any(line.startswith("stored g0") for line in published)
    assert any(line.startswith("stored g1") for line in published)
    assert any(line.startswith("removed") for line in published)
    # The reset's clear comes with the next step's update, before its stores.
    cleared = engine_step_with(EVENTS_TRACE, lambda lines: "cleared" in lines)
    after_reset = next(e for e in steps if e.index == cleared)
    assert after_reset.expect["events"][0] == "cleared"
    assert run_model(EVENTS_TRACE).passed


def test_the_stats_off_trace_runs_without_stats_and_checks_cached_tokens() -> None:
    assert STATS_OFF_TRACE.config.disable_log_stats
    model = SchedulerModel(STATS_OFF_TRACE.config, 0, 4)
    assert model.take_prefix_cache_stats() == {}
    assert any(e.expect.get("cached_tokens") for e in STATS_OFF_TRACE.engine)
    assert run_model(STATS_OFF_TRACE).passed


class _OneEventFewer(SchedulerModel):
    """The scheduler model publishing every non-empty batch but its last event."""

    def take_kv_events(self) -> list[KvEvent]:
        return super().take_kv_events()[:-1]


def test_a_model_publishing_one_event_fewer_misses_the_expectation() -> None:
    result = replay_scheduler(EVENTS_TRACE, _OneEventFewer, None, "strict")
    first = engine_step_with(EVENTS_TRACE, bool)
    assert first_failure(result) == (first, "expect", "events")


# -- on vLLM's real Scheduler -------------------------------------------------------


@needs_vllm
def test_vllms_scheduler_is_built_publishing_events_and_without_stats() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    events = VllmScheduler(EVENTS_TRACE.config, spec_tokens=0, max_num_seqs=4)
    stats_off = VllmScheduler(STATS_OFF_TRACE.config, spec_tokens=0, max_num_seqs=4)
    try:
        assert events.scheduler.enable_kv_cache_events
        assert events.scheduler.kv_cache_manager.enable_kv_cache_events
        assert stats_off.scheduler.log_stats is False
        assert not stats_off.scheduler.enable_kv_cache_events
        assert stats_off.take_kv_events() == []
    finally:
        events.close()
        stats_off.close()


@needs_vllm
def test_the_events_and_stats_off_traces_conform_on_vllm() -> None:
    assert run_vllm(EVENTS_TRACE).passed
    assert run_vllm(STATS_OFF_TRACE).passed


@needs_vllm
def test_a_model_publishing_one_event_fewer_diverges_from_vllm() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    real = VllmScheduler(EVENTS_TRACE.config, spec_tokens=0, max_num_seqs=4)
    try:
        result = replay_scheduler(EVENTS_TRACE, _OneEventFewer, real, "strict")
    finally:
        real.close()
    first = engine_step_with(EVENTS_TRACE, bool)
    index, level, what = first_failure(result)
    assert (index, level) == (first, "api")
    assert what == "engine step 1: KV-cache events published", what  # counted from 1


class _NoClear(Wrapped):
    """vLLM's Scheduler, its published batches without the reset's clear."""

    def take_kv_events(self) -> list[KvEvent]:
        return [e for e in self.real.take_kv_events() if e.kind != "cleared"]


@needs_vllm
def test_a_scheduler_that_publishes_no_clear_diverges_at_the_step_after_the_reset() -> None:
    result = run_vllm(EVENTS_TRACE, _NoClear)
    cleared = engine_step_with(EVENTS_TRACE, lambda lines: "cleared" in lines)
    assert first_failure(result) == (cleared, "expect", "events")
    # The lockstep with the model names it at the same step.
    [lockstep] = [d for d in result.also if d.level == "api"]
    assert lockstep.step.index == cleared
    assert lockstep.what.endswith("KV-cache events published")
    expected = lockstep.expected
    assert isinstance(expected, list) and expected[0] == "cleared"


class _UsageOneBlockHigh(Wrapped):
    """vLLM's Scheduler, reporting one block more in use than it has."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.blocks: int = real.config.num_blocks - 1  # the null block left out

    def kv_cache_usage(self) -> float:
        usage = float(self.real.kv_cache_usage())
        return usage + 1 / self.blocks


@needs_vllm
def test_a_scheduler_reporting_a_wrong_usage_diverges_at_the_first_step() -> None:
    result = run_vllm(STATS_OFF_TRACE, _UsageOneBlockHigh)
    first = next(e.index for e in STATS_OFF_TRACE.engine if e.op == "step")
    index, level, what = first_failure(result)
    assert (index, level) == (first, "api") and what.endswith("KV-cache usage"), what


class _StatsAnyway(Wrapped):
    """vLLM's Scheduler, reporting prefix-cache stats with stats logging off."""

    def take_prefix_cache_stats(self) -> dict[str, int | bool] | None:
        assert self.real.take_prefix_cache_stats() is None  # logging off: none made
        return {"requests": 0, "queries": 0, "hits": 0}


@needs_vllm
def test_a_scheduler_making_stats_with_logging_off_diverges() -> None:
    result = run_vllm(STATS_OFF_TRACE, _StatsAnyway)
    first = next(e.index for e in STATS_OFF_TRACE.engine if e.op == "step")
    index, level, what = first_failure(result)
    assert (index, level) == (first, "api")
    assert what.endswith("stats made with stats logging off"), what
