"""Scheduler-level traces of the Scheduler's less travelled branches, each
shown to fail when vLLM's Scheduler (or kvgate's model of it) drifts there."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from configs import needs_vllm, trace_config, trace_text

from kvgate.conformance.replay import Divergence, ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    bundled_scheduler_corpus,
    load_trace,
    parse_trace,
)
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.scheduling import EngineStep


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


def divergence_on_vllm(trace: Trace) -> Divergence:
    """Where the trace's replay on vLLM's Scheduler first fails (it must)."""
    divergence = run_vllm(trace).divergence
    assert divergence is not None
    return divergence


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
    divergence = divergence_on_vllm(trace)
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
    divergence = divergence_on_vllm(trace)
    first_asked = next(e.index for e in trace.engine if e.op == "step" and e.index > 4)
    assert divergence.step.index == first_asked, divergence
    assert divergence.actual == [("B", 96), ("C", 32)], divergence


@needs_vllm
def test_a_scheduler_that_takes_back_accepted_drafts_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler taking back every draft from a request's computed
    tokens, the accepted ones too (as if all were rejected) while still
    outputting them: the trace fails at the first step after a draft is
    accepted."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = Scheduler.update_from_output

    def every_draft_taken_back(self: Any, scheduler_output: Any, runner_output: Any) -> Any:
        outputs = update(self, scheduler_output, runner_output)
        for name in scheduler_output.scheduled_spec_decode_tokens:
            request = self.requests.get(name)
            index = runner_output.req_id_to_index[name]
            accepted = len(runner_output.sampled_token_ids[index]) - 1
            if request is not None and not request.is_finished():
                request.num_computed_tokens -= accepted
        return outputs

    trace = bundled("sched-mtp-accepted-drafts")
    monkeypatch.setattr(Scheduler, "update_from_output", every_draft_taken_back)
    divergence = divergence_on_vllm(trace)
    first_accepted = next(e.index for e in trace.engine if e.accept)
    assert divergence.step.index == first_accepted + 1, divergence


def test_accepted_drafts_the_step_cannot_take_are_refused_by_name() -> None:
    """Drafts accepted for a request that does not decode in the step, or
    past its max_tokens, are refused in one line naming `accept`."""
    trace = bundled("sched-mtp-accepted-drafts")

    def refusal(engine: list[EngineStep]) -> TraceError:
        with pytest.raises(TraceError) as refused:
            replay_scheduler(replace(trace, engine=tuple(engine)), SchedulerModel, None, "strict")
        assert refused.value.field == "accept"
        return refused.value

    # A prefills in the first step.
    first = next(e for e in trace.engine if e.op == "step")
    refused = refusal([replace(e, accept={"A": 1}) if e is first else e for e in trace.engine])
    assert refused.step_index == first.index and "does not decode" in str(refused)
    # One output token fewer: the last decode's 1 + 3 pass max_tokens.
    arrival = trace.engine[0]
    shorter = [replace(e, max_tokens=12) if e is arrival else e for e in trace.engine]
    last = max(e.index for e in trace.engine if e.accept)
    refused = refusal(shorter)
    assert refused.step_index == last and "past its max_tokens 12" in str(refused)


MANAGER_ACCEPTS = trace_text(
    """\
    - {op: arrive, req: A, prompt: [{fresh: 60}]}
    - {op: prefill, req: A, lookahead: 3}
    """,
    trace_config(64),
    "decode-accepts-drafts",
)


def manager_trace(accepted: list[int]) -> Trace:
    decode = (
        "  - {{op: decode1, req: A, spec: 3, accepted: {}}}\n  - {{op: step}}\n  - {{op: drain}}\n"
    )
    rounds = "".join(decode.format(n) for n in accepted)
    return parse_trace(MANAGER_ACCEPTS + rounds, "decode-accepts-drafts.yaml")


def test_a_decode_accepting_more_drafts_than_it_proposes_is_refused() -> None:
    with pytest.raises(TraceError) as refused:
        manager_trace([4])
    assert (refused.value.step_index, refused.value.field) == (2, "accepted")


@needs_vllm
def test_a_manager_decode_with_accepted_drafts_conforms_on_vllm_at_strict_level() -> None:
    """`decode1 accepted` on vLLM's `KVCacheManager`: computed tokens past the
    accepted drafts, each step's whole strict view as the model's."""
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.model.target import ModelTarget
    from kvgate.targets import run_trace

    result = run_trace(manager_trace([3, 2, 0, 1] * 3), VllmTarget, ModelTarget, "strict", False)
    assert isinstance(result, ReplayResult) and result.passed, result


@needs_vllm
def test_a_scheduler_that_preempts_a_request_in_flight_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler taking every request's blocks as free to return at
    once, a batch in flight or not: it preempts B while B's batch runs, and
    the trace fails at that step."""
    from vllm.v1.core.sched.scheduler import Scheduler

    trace = bundled("sched-async-pressure-waits-for-batch")
    monkeypatch.setattr(Scheduler, "_request_blocks_can_be_freed", lambda self, request: True)
    divergence = divergence_on_vllm(trace)
    waits = next(e.index for e in trace.engine if e.expect.get("scheduled") == [])
    assert divergence.step.index == waits, divergence


@needs_vllm
def test_a_scheduler_that_keeps_the_reset_from_the_connector_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler reporting the connector reset without passing it on:
    the store still holds D's tokens, and D's admission step fails."""
    from vllm.v1.core.sched.scheduler import Scheduler

    trace = bundled("sched-connector-reset-forgets-store")
    monkeypatch.setattr(Scheduler, "reset_connector_cache", lambda self: True)
    divergence = divergence_on_vllm(trace)
    reset = next(e.index for e in trace.engine if e.connector)
    assert divergence.step.index == reset + 1, divergence
    assert divergence.actual == [("D", 24)], divergence


@needs_vllm
def test_a_request_that_loses_its_prefix_cache_skip_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's requests losing the skip that prompt logprobs ask for: B takes
    A's prompt from the prefix cache and the connector's tokens, and B's
    first step fails."""
    from vllm.v1.request import Request

    trace = bundled("sched-connector-skips-cache")
    monkeypatch.setattr(Request, "get_skip_reading_prefix_cache", lambda self: False)
    divergence = divergence_on_vllm(trace)
    b_arrives = next(e.index for e in trace.engine if e.skip_prefix_cache)
    assert divergence.step.index == b_arrives + 1, divergence


RESET_WHILE_LOADING = """\
format: kvgate-trace/1
name: reset-running-while-loading
config:
  num_blocks: 32
  hash_unit: 8
  eagle: false
  retention_interval: 0
  retain_checkpoint: false
  kv_connector: true
  max_num_scheduled_tokens: 512
  max_model_len: 512
  groups:
  - {kind: full_attention, block_size: 8}
  - {kind: mamba_align, block_size: 32}
scheduler: {spec: 0, max_num_seqs: 4}
engine:
  - {op: arrive, req: A, prompt: [{fresh: 40}], max_tokens: 8}
  - {op: step}
  - {op: arrive, req: R, prompt: [{fresh: 40}], max_tokens: 1,
     remote_hit: 40, remote_async: true, remote_delay: 2}
  - {op: step}
"""


@pytest.mark.parametrize(
    ("before", "holder"),
    [
        ("", "R's asynchronous KV load is in flight"),
        ("  - {op: abort, req: R}\n", "aborted R's asynchronous KV load is in flight"),
    ],
    ids=["load in flight", "aborted during its load"],
)
def test_a_reset_preempting_running_requests_while_blocks_are_held_is_refused(
    before: str, holder: str
) -> None:
    """vLLM's Scheduler raises on it (the held blocks keep the cache in use);
    the model refuses the trace in one line naming the reset's `running`."""
    text = RESET_WHILE_LOADING + before + "  - {op: reset, running: true}\n"
    trace = parse_trace(text, "reset.yaml")
    with pytest.raises(TraceError) as refused:
        replay_scheduler(trace, SchedulerModel, None, "strict")
    error = refused.value
    assert (error.step_index, error.field) == (len(trace.engine) - 1, "running"), str(error)
    assert holder in str(error) and "\n" not in str(error)


@needs_vllm
@pytest.mark.parametrize("abort", [False, True], ids=["load in flight", "aborted during its load"])
def test_vllm_raises_on_the_reset_the_model_refuses(abort: bool) -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = parse_trace(
        RESET_WHILE_LOADING + ("  - {op: abort, req: R}\n" if abort else ""), "reset.yaml"
    )
    assert trace.scheduler is not None
    real = VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=4)
    try:
        assert replay_scheduler(trace, SchedulerModel, real, "strict").passed
        with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
            real.reset_prefix_cache(running=True)
    finally:
        real.close()
