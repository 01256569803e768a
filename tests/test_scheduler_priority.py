"""The priority scheduling policy at the Scheduler level: the trace fields,
the bundled priority traces on the model and on vLLM's real `Scheduler`, and
drifts of the model's victim choice, queue order and undone run that the
traces catch."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm
from scheduler_runs import (
    first_failure,
    read_error,
    recorded,
    run_model,
    run_vllm,
    text_of,
    trace_of,
)

from kvgate import cli
from kvgate.conformance.trace import (
    Trace,
    load_trace,
)
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import LiveRequest, StepDecisions
from kvgate.vocabulary.config import NotModelled, UnsupportedConfig

LOWEST_PREEMPTS_ITSELF = "sched-priority-preempts-lowest-running"
VICTIM_SCHEDULED_EARLIER = "sched-priority-victim-scheduled-earlier"
RESET_AND_ABORT = "sched-priority-reset-and-abort"


def preemption_step(trace: Trace) -> int:
    return next(e.index for e in trace.engine if e.expect.get("preempted"))


# -- the trace fields -----------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "step", "field"),
    [
        (
            "scheduling_policy: priority",
            "scheduling_policy: lottery",
            None,
            "config.scheduling_policy",
        ),
        # The fcfs policy ignores priorities: one given there is a mistake.
        ("scheduling_policy: priority", "scheduling_policy: fcfs", 0, "priority"),
        ("priority: 2}", "priority: high}", 0, "priority"),
        ("priority: 2}", "priority: true}", 0, "priority"),
        ("priority: 2}", "priority: 1.5}", 0, "priority"),
    ],
)
def test_a_bad_policy_or_priority_is_one_error_naming_step_and_field(
    old: str, new: str, step: int | None, field: str
) -> None:
    error = read_error(text_of(RESET_AND_ABORT).replace(old, new, 1))
    assert (error.step_index, error.field) == (step, field), str(error)


def test_priorities_read_with_zero_by_default() -> None:
    trace = trace_of(RESET_AND_ABORT)
    assert trace.config.scheduling_policy == "priority"
    priorities = {e.req: e.priority for e in trace.engine if e.op == "arrive"}
    assert priorities == {"A": 2, "B": 2, "C": 1, "D": 0, "E": 1}


@pytest.mark.parametrize(
    "changed",
    [{"kv_connector": True}, {"async_scheduling": True}],
    ids=["kv_connector", "async_scheduling"],
)
def test_the_priority_policy_outside_what_is_modelled_is_refused_by_name(
    changed: dict[str, Any],
) -> None:
    config = replace(trace_of(RESET_AND_ABORT).config, **changed)
    with pytest.raises(NotModelled) as refused:
        SchedulerModel(config, 0, 2)
    assert refused.value.field == "scheduling_policy"


# -- drifts of the model, caught by the traces' own expectations ----------------


def last_running(self: SchedulerModel) -> LiveRequest:
    return self.running[-1]


@pytest.mark.parametrize("name", [LOWEST_PREEMPTS_ITSELF, VICTIM_SCHEDULED_EARLIER])
def test_a_model_that_preempts_the_last_running_request_misses_the_preemption(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First come, first served's victim (H, the last running) instead of
    the lowest priority (L)."""
    monkeypatch.setattr(SchedulerModel, "victim", last_running)
    trace = trace_of(name)
    index, level, what = first_failure(run_model(trace))
    assert (index, level) == (preemption_step(trace), "expect")
    assert what in ("scheduled", "preempted")


def test_a_model_that_puts_preempted_requests_first_misses_the_queue_after_a_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waiting queue kept first come, first served under the priority
    policy: the reset's preempted requests go to its front."""
    monkeypatch.setattr(SchedulerModel, "_order_waiting", lambda self: None)
    trace = trace_of(RESET_AND_ABORT)
    [reset] = [e for e in trace.engine if e.op == "reset"]
    assert first_failure(run_model(trace)) == (reset.index, "expect", "waiting")


def test_a_model_that_keeps_the_victims_sampled_token_misses_its_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The victim scheduled earlier in the step dropped from it, but its run
    not undone: it keeps the token it sampled, so readmitted it recomputes
    one token more than vLLM's Scheduler, which never ran it."""
    dropped = SchedulerModel._unschedule

    def keeps_its_token(
        self: SchedulerModel,
        victim: LiveRequest,
        decisions: StepDecisions,
        finished: list[LiveRequest],
    ) -> int:
        outputs = list(victim.request.output)
        tokens = dropped(self, victim, decisions, finished)
        victim.request.append_output(outputs[len(victim.request.output) :])
        return tokens

    monkeypatch.setattr(SchedulerModel, "_unschedule", keeps_its_token)
    trace = trace_of(VICTIM_SCHEDULED_EARLIER)
    resumed = next(e.index for e in trace.engine if e.expect.get("finished") == ["L"])
    assert first_failure(run_model(trace)) == (resumed, "expect", "scheduled")


# -- on vLLM's real Scheduler ---------------------------------------------------


@needs_vllm
def test_vllms_scheduler_runs_the_priority_policy_and_each_arrivals_priority() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = trace_of(RESET_AND_ABORT)
    real = VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=2)
    try:
        assert real.scheduler.policy.value == "priority"
        real.add_request("A", list(range(1, 41)), 2, None, priority=3)
        real.add_request("B", list(range(41, 81)), 2, None, priority=-1)
        waiting = {r.request_id: r for r in real.scheduler.waiting}
        assert (waiting["A"].priority, waiting["B"].priority) == (3, -1)
        assert waiting["A"].arrival_time < waiting["B"].arrival_time
        assert [r.request_id for r in real.scheduler.waiting] == ["B", "A"]
    finally:
        real.close()


@needs_vllm
def test_a_model_preempting_the_last_running_request_diverges_from_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lockstep names the drift at the preemption step, before any
    expectation: vLLM's Scheduler preempts L, the drifted model H."""
    monkeypatch.setattr(SchedulerModel, "victim", last_running)
    trace = trace_of(LOWEST_PREEMPTS_ITSELF)
    result = run_vllm(trace)
    lockstep = [d for d in result.failures if d.level == "api"]
    assert lockstep and lockstep[0].step.index == preemption_step(trace)
    assert lockstep[0].what.endswith("preempted"), lockstep[0].what


@needs_vllm
def test_a_release_without_scheduling_policies_cannot_run_a_priority_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probed on the installed build's own config class: without a `policy`
    setting the trace is not applicable there (one line naming the field)."""
    from vllm.config import SchedulerConfig

    from kvgate.impl.vllm_scheduler import VllmScheduler

    fields = {k: v for k, v in SchedulerConfig.__dataclass_fields__.items() if k != "policy"}
    monkeypatch.setattr(SchedulerConfig, "__dataclass_fields__", fields)
    trace = trace_of(RESET_AND_ABORT)
    with pytest.raises(UnsupportedConfig) as refused:
        VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=2)
    assert refused.value.field == "scheduling_policy"


@needs_vllm
def test_a_recording_under_the_priority_policy_keeps_each_priority(tmp_path: Path) -> None:
    """vLLM's Scheduler recorded while it runs a priority trace: the recording
    carries the policy and each arrival's priority, and replays on the model
    and on vLLM as the trace did."""
    trace = trace_of(RESET_AND_ABORT)
    path = recorded(trace, tmp_path)
    recording = load_trace(path)
    assert recording.config.scheduling_policy == "priority"
    arrivals = [e.priority for e in recording.engine if e.op == "arrive"]
    assert arrivals == [e.priority for e in trace.engine if e.op == "arrive"]
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 0
    # Recorded without the priorities, the queue after the reset differs.
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(re.sub(r", priority: \d+", "", path.read_text()))
    assert load_trace(drifted).config.scheduling_policy == "priority"
    assert cli.main(["replay", str(drifted), "--target", "model"]) == 1
