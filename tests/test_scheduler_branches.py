"""Scheduler-level traces of the Scheduler's less travelled branches, each
shown to fail when vLLM's Scheduler (or kvgate's model of it) drifts there."""

from __future__ import annotations

from typing import Any

import pytest
from configs import needs_vllm

from kvgate.conformance.replay import ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, bundled_scheduler_corpus, load_trace
from kvgate.model.scheduler import SchedulerModel


def bundled(name: str) -> Trace:
    return load_trace(bundled_scheduler_corpus() / f"{name}.yaml")


def run_vllm(trace: Trace) -> ReplayResult:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert trace.scheduler is not None
    real = VllmScheduler(
        trace.config,
        spec_tokens=trace.scheduler.spec,
        max_num_seqs=trace.scheduler.max_num_seqs,
    )
    try:
        return replay_scheduler(trace, SchedulerModel, real, "strict")
    finally:
        real.close()


def second_step(trace: Trace) -> int:
    return [e.index for e in trace.engine if e.op == "step"][1]


@needs_vllm
def test_a_split_that_gives_a_running_prefill_a_chunk_ending_mid_block_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's align-mode split handing a running prefill the budget's 26
    tokens when no whole Mamba block fits (instead of nothing): B runs a
    chunk ending inside a block, and the trace fails at that step."""
    from vllm.v1.core.sched.scheduler import Scheduler

    split = Scheduler._mamba_block_aligned_split

    def never_nothing(self: Any, request: Any, num_new_tokens: int, *args: Any) -> int:
        return split(self, request, num_new_tokens, *args) or num_new_tokens

    trace = bundled("sched-running-prefill-split-to-nothing")
    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", never_nothing)
    result = run_vllm(trace)
    divergence = result.divergence
    assert divergence is not None
    assert divergence.step.index == second_step(trace), divergence
    assert divergence.actual == [("X", 224), ("B", 26)], divergence


@needs_vllm
def test_a_scheduler_that_takes_not_yet_for_nothing_external_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler reading the connector's "not yet" as "nothing
    external": it admits B at once with its local hit alone, and the trace
    fails at that step."""
    from kvgate.impl import vllm_connector

    scripted = vllm_connector._Scripted.get_num_new_matched_tokens

    def not_yet_as_nothing(self: Any, request: Any, num_computed_tokens: int) -> Any:
        tokens, load_async = scripted(self, request, num_computed_tokens)
        return (0 if tokens is None else tokens), load_async

    trace = bundled("sched-connector-not-yet")
    assert run_vllm(trace).passed
    monkeypatch.setattr(vllm_connector._Scripted, "get_num_new_matched_tokens", not_yet_as_nothing)
    divergence = run_vllm(trace).divergence
    assert divergence is not None
    first_asked = next(e.index for e in trace.engine if e.op == "step" and e.index > 4)
    assert divergence.step.index == first_asked, divergence
    assert divergence.actual == [("B", 96), ("C", 32)], divergence
