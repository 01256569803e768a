"""LoRA adapters at the Scheduler level: the trace fields (`config.max_loras`,
an arrival's `lora`), the adapter limit in kvgate's scheduler model, the
bundled trace on the model and on vLLM's real `Scheduler`, a drift of the
limit that the trace catches, and the recorder."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

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
    TraceError,
    load_trace,
    parse_trace,
)
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import LiveRequest
from kvgate.vocabulary.config import UnsupportedConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import Arrival
from kvgate.vocabulary.tokens import HashInputs, lora_adapter_id

LIMIT = "sched-lora-limit-holds-a-third-adapter"


def passed_over_step(trace: Trace) -> int:
    """The step where C waits while D, behind it, is admitted."""
    return next(e.index for e in trace.engine if "D" in e.expect.get("cached_tokens", {}))


# -- the trace fields -----------------------------------------------------------


def test_adapters_and_the_limit_are_read() -> None:
    trace = trace_of(LIMIT)
    assert trace.config.max_loras == 2
    adapters = {e.req: e.lora for e in trace.engine if e.op == "arrive"}
    assert adapters == {"A": "a", "B": "b", "C": "c", "D": "a"}


@pytest.mark.parametrize(
    ("old", "new", "step", "field"),
    [
        # An engine without a LoRA config refuses a request with an adapter.
        ("  max_loras: 2\n", "", 0, "lora"),
        ("  max_loras: 2\n", "  max_loras: 0\n", 0, "lora"),
        ("  max_loras: 2\n", "  max_loras: -1\n", None, "config.max_loras"),
        ("lora: a}", "lora: [a]}", 0, "lora"),
        ("lora: a}", "lora: two words}", 0, "lora"),
    ],
)
def test_an_adapter_without_a_lora_config_or_a_bad_one_is_one_error(
    old: str, new: str, step: int | None, field: str
) -> None:
    error = read_error(text_of(LIMIT).replace(old, new, 1))
    assert (error.step_index, error.field) == (step, field), str(error)


# -- the model's rule -----------------------------------------------------------


def fresh(tokens: int) -> tuple[Segment, ...]:
    return (Segment("fresh", count=tokens),)


def test_the_model_passes_over_a_new_adapter_at_the_limit_and_admits_a_running_one() -> None:
    """max_loras 1: with adapter a running, B (adapter b) keeps its place at
    the head while C (adapter a) and D (no adapter) behind it are admitted;
    once A and C have finished, B is admitted."""
    config = trace_of(LIMIT).config
    model = SchedulerModel(replace(config, max_loras=1), 0, 8)
    model.arrive(Arrival("A", fresh(40), 2, lora="a"))
    assert model.step().scheduled == [("A", 40)]
    model.arrive(Arrival("B", fresh(40), 1, lora="b"))
    model.arrive(Arrival("C", fresh(40), 1, lora="a"))
    model.arrive(Arrival("D", fresh(40), 1))
    decisions = model.step()
    assert decisions.scheduled == [("A", 1), ("C", 40), ("D", 40)]
    assert [live.name for live in model.waiting] == ["B"]
    assert model.step().scheduled == [("B", 40)]


def test_the_adapters_admitted_in_a_scan_count_against_the_limit() -> None:
    config = trace_of(LIMIT).config
    model = SchedulerModel(config, 0, 8)
    for name, lora in (("A", "a"), ("B", "b"), ("C", "c"), ("D", "b")):
        model.arrive(Arrival(name, fresh(40), 2, lora=lora))
    assert model.step().scheduled == [("A", 40), ("B", 40), ("D", 40)]
    assert [live.name for live in model.waiting] == ["C"]


def over_no_limit(self: SchedulerModel, live: LiveRequest, adapters: set[str]) -> bool:
    return False


def test_a_model_without_the_limit_misses_the_waiting_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter limit ignored: C is admitted in the first step beside A
    and B, which the trace's first expectation names."""
    monkeypatch.setattr(SchedulerModel, "_over_lora_limit", over_no_limit)
    trace = trace_of(LIMIT)
    first_step = next(e.index for e in trace.engine if e.op == "step")
    assert first_failure(run_model(trace)) == (first_step, "expect", "scheduled")


def test_a_model_that_forgets_the_adapters_running_misses_the_admission_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the adapters admitted in the scan counted (the running ones
    forgotten): C is admitted at the next step, ahead of D."""
    monkeypatch.setattr(SchedulerModel, "_running_adapters", lambda self: set())
    trace = trace_of(LIMIT)
    assert first_failure(run_model(trace)) == (passed_over_step(trace), "expect", "scheduled")


# -- on vLLM's real Scheduler ---------------------------------------------------


@needs_vllm
def test_vllms_scheduler_is_built_with_the_limit_and_each_adapter() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = trace_of(LIMIT)
    real = VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=8)
    try:
        assert real.scheduler.lora_config.max_loras == 2
        real.add_request("A", list(range(1, 41)), 2, None, HashInputs(lora="a"))
        [request] = list(real.scheduler.waiting)
        assert request.lora_request.lora_name == "a"
        assert request.lora_request.lora_int_id == lora_adapter_id("a")
    finally:
        real.close()


@needs_vllm
def test_a_model_without_the_limit_diverges_from_vllm_at_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lockstep names the drift before any expectation: the drifted
    model looks C up in the first step, vLLM's Scheduler passes over it."""
    monkeypatch.setattr(SchedulerModel, "_over_lora_limit", over_no_limit)
    trace = trace_of(LIMIT)
    result = run_vllm(trace)
    lockstep = [d for d in result.failures if d.level == "api"]
    first_step = next(e.index for e in trace.engine if e.op == "step")
    assert lockstep and lockstep[0].step.index == first_step, lockstep[0].what


LOADED = "sched-lora-limit-holds-a-loaded-request"


@needs_vllm
def test_a_load_held_back_by_the_limit_is_completed_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B's reported load is completed (its block keyed) before the limit
    holds B back: a model that leaves the load for B's admission differs
    from vLLM's Scheduler block by block."""
    assert run_vllm(trace_of(LOADED)).passed
    complete = SchedulerModel._complete_load

    def when_admitted(self: SchedulerModel, live: LiveRequest) -> None:
        # B's load left for its admission, after A has finished.
        if live.name != "B" or not self.running:
            complete(self, live)

    monkeypatch.setattr(SchedulerModel, "_complete_load", when_admitted)
    index, level, what = first_failure(run_vllm(trace_of(LOADED)))
    assert (level, what) == ("strict", "engine step 2: block 3 hashes"), (index, level, what)


def test_a_failed_load_held_back_by_the_limit_is_refused_by_name() -> None:
    load = "remote_hit: 8, remote_async: true"
    text = text_of(LOADED).replace(f"{load}}}", f"{load}, remote_fails: true}}")
    with pytest.raises(TraceError, match=r"lora: B's failed asynchronous KV load"):
        run_model(parse_trace(text, f"{LOADED}.yaml"))


@needs_vllm
def test_a_lora_config_vllm_refuses_is_one_line_naming_max_loras(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm.config

    from kvgate.impl.vllm_scheduler import VllmScheduler

    def refused(**settings: object) -> None:
        raise ValueError("LoRA is not supported on this platform")

    monkeypatch.setattr(vllm.config, "LoRAConfig", refused)
    with pytest.raises(UnsupportedConfig) as raised:
        VllmScheduler(trace_of(LIMIT).config, spec_tokens=0, max_num_seqs=8)
    assert raised.value.field == "max_loras"
    assert "\n" not in raised.value.message


# -- the recorder ---------------------------------------------------------------


@needs_vllm
def test_a_recording_keeps_the_limit_and_each_adapter(tmp_path: Path) -> None:
    """vLLM's Scheduler recorded while it runs the LoRA trace: the recording
    carries max_loras and each arrival's adapter (a hash of its name, one per
    adapter), and replays on the model and on vLLM as the trace did."""
    path = recorded(trace_of(LIMIT), tmp_path)
    recording = load_trace(path)
    assert recording.config.max_loras == 2
    adapters = [e.lora for e in recording.engine if e.op == "arrive"]
    assert all(re.fullmatch(r"lora-[0-9a-f]{16}", a) for a in adapters), adapters
    assert adapters[0] == adapters[3] and len(set(adapters)) == 3
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 0
    # Recorded without the adapters' limit, C is admitted at once.
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(path.read_text().replace("max_loras: 2", "max_loras: 3"))
    assert cli.main(["replay", str(drifted), "--target", "model"]) == 1


def test_an_adapter_name_with_two_ids_or_two_names_with_one_id_stop_the_recording() -> None:
    """A replay gives each adapter name one id and one path: a recording
    whose adapters do not map one to one cannot say them."""
    from kvgate.impl.recorder import NotExpressible, _Recording

    def adapter(name: str, lora_id: int, path: str = "/p") -> SimpleNamespace:
        return SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=path)

    recording = SimpleNamespace(adapters={})
    assert _Recording.adapter(recording, None) == ""  # type: ignore[arg-type]
    first = _Recording.adapter(recording, adapter("a", 1))  # type: ignore[arg-type]
    assert first == _Recording.adapter(recording, adapter("a", 1))  # type: ignore[arg-type]
    assert first != _Recording.adapter(recording, adapter("b", 2))  # type: ignore[arg-type]
    for other in (adapter("a", 3), adapter("a", 1, "/q"), adapter("c", 2)):
        with pytest.raises(NotExpressible):
            _Recording.adapter(recording, other)  # type: ignore[arg-type]
