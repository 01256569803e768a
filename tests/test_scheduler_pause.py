"""The engine's pauses at the Scheduler level (`pause`, `resume`): how a
trace reads them, what the scheduler model does under each mode, the
bundled traces on vLLM's real `Scheduler`, and a Scheduler that ignores a
pause, which the lockstep catches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm
from scheduler_runs import Wrapped, recorded, run_vllm, text_of, trace_of

from kvgate import cli, targets
from kvgate.conformance.replay import TraceRunError
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import (
    TraceError,
    load_trace,
)
from kvgate.conformance.writer import dump_engine_trace
from kvgate.model.scheduler import SchedulerModel

KEEP = "sched-pause-keep-reset-resume"
WAIT = "sched-pause-wait-admits-a-loaded-request"


def test_a_pause_mode_other_than_keep_or_wait_is_one_error_naming_it() -> None:
    text = text_of(KEEP).replace("{op: pause, mode: keep}", "{op: pause, mode: abort}")
    with pytest.raises(TraceError) as raised:
        trace_of(KEEP, text)
    message = str(raised.value)
    assert "mode" in message and "keep, wait" in message and "\n" not in message


def test_a_pause_under_async_scheduling_is_refused_by_name() -> None:
    text = text_of(KEEP).replace("  retain_checkpoint: false\n", "  async_scheduling: true\n", 1)
    text = text.replace("max_tokens: 6", "max_tokens: 1")
    with pytest.raises(TraceError, match=r"config\.async_scheduling: a pause"):
        replay_scheduler(trace_of(KEEP, text), SchedulerModel, None, "strict")


@pytest.mark.parametrize("name", [KEEP, WAIT])
def test_the_model_without_pauses_misses_the_traces_expectations(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert replay_scheduler(trace_of(name), SchedulerModel, None, "strict").passed
    monkeypatch.setattr(SchedulerModel, "pause", lambda self, mode: None)
    result = replay_scheduler(trace_of(name), SchedulerModel, None, "strict")
    assert result.divergence is not None
    assert (result.divergence.level, result.divergence.what) == ("expect", "scheduled")


class _IgnoresPauses(Wrapped):
    """vLLM's Scheduler whose engine never sets its pause state."""

    def pause(self, mode: str) -> None:
        return None


@needs_vllm
@pytest.mark.parametrize("name", [KEEP, WAIT])
def test_a_scheduler_that_ignores_the_pause_diverges_in_the_next_step(name: str) -> None:
    trace = trace_of(name)
    assert run_vllm(trace).passed
    result = run_vllm(trace, _IgnoresPauses)
    paused = next(e.index for e in trace.engine if e.op == "pause")
    first_step = next(e.index for e in trace.engine if e.op == "step" and e.index > paused)
    # The step's expectation is missed, and the lockstep stops there.
    lockstep = [d for d in result.failures if d.level == "api"]
    assert lockstep and lockstep[0].step.index == first_step, result.failures


@needs_vllm
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_scheduler_without_pause_states_finds_the_trace_not_applicable(
    streamed: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvgate.impl import vllm_scheduler

    build = vllm_scheduler.VllmScheduler.__init__

    def without(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        self.pause_states = False

    monkeypatch.setattr(vllm_scheduler.VllmScheduler, "__init__", without)
    model, real = targets.scheduler_factories("vllm", None)
    trace = trace_of(KEEP)
    if streamed:  # its entries left in its file, one a line
        path = tmp_path / f"{KEEP}.yaml"
        assert trace.scheduler is not None
        path.write_text(dump_engine_trace(trace.name, trace.config, trace.scheduler, trace.engine))
        trace = stream_trace(path)
        assert trace.stream is not None and not trace.engine
    outcome = targets.run_scheduler_trace(trace, model, real, "strict")
    assert isinstance(outcome, TraceRunError) and outcome.config_refused, outcome
    first = next(e.index for e in trace_of(KEEP).engine if e.op == "pause")
    assert f"step {first}: mode: this vLLM's Scheduler has no pause states" in outcome.message


@needs_vllm
def test_a_recording_keeps_each_pause_and_resume(tmp_path: Path) -> None:
    """vLLM's Scheduler recorded while it runs the weight update's trace
    (the other has a KV connector, which recordings leave out): the
    recording carries the pause's mode and the resume, and replays on the
    model and on vLLM; without its pause it no longer does."""
    trace = trace_of(KEEP)
    path = recorded(trace, tmp_path)
    recording = load_trace(path)
    ops = [(e.op, e.mode) for e in recording.engine if e.op in ("pause", "resume")]
    mode = next(e.mode for e in trace.engine if e.op == "pause")
    assert ops == [("pause", mode), ("resume", "")]
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 0
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(path.read_text().replace(f"{{op: pause, mode: {mode}}}", "{op: resume}"))
    assert drifted.read_text() != path.read_text()
    assert cli.main(["replay", str(drifted), "--target", "model"]) == 1
