"""Streaming-input sessions in scheduler-level traces: the reader's refusals,
the bundled session traces on the model and on vLLM's `Scheduler`, and
drifts on either side that must diverge."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from configs import SMALL_SCHEDULER_TRACE_HEAD, needs_vllm
from scheduler_runs import read_error
from test_scheduler_traces import engine as entry

from kvgate.conformance.replay import ReplayResult, TraceRunError
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    bundled_scheduler_corpus,
    load_corpus,
    parse_trace,
)
from kvgate.model.request import Request
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import LiveRequest

SESSIONS = [t for t in load_corpus(bundled_scheduler_corpus()) if t.has_sessions]

VALID = (
    SMALL_SCHEDULER_TRACE_HEAD.format(name="session")
    + """\
  - {op: arrive, req: A, prompt: [{fresh: 40}], max_tokens: 2, resumable: true}
  - {op: arrive, req: B, prompt: [{fresh: 8}], max_tokens: 1}
  - {op: step, steps: 4}
  - {op: chunk, req: A, prompt: [{fresh: 8}], max_tokens: 2}
  - {op: step, steps: 4}
  - {op: chunk, req: A, end: true}
"""
)


def by_name(name: str) -> Trace:
    [trace] = [t for t in SESSIONS if t.name == name]
    return trace


def edited(edit: Callable[[dict[str, Any]], None]) -> str:
    doc = yaml.safe_load(VALID)
    edit(doc)
    return str(yaml.safe_dump(doc, sort_keys=False))


def config(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["config"].update(fields)

    return edit


def then(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for one in edits:
            one(doc)

    return edit


# (an edit of the valid trace, the engine entry it names, the field)
REFUSED: dict[str, tuple[Callable[[dict[str, Any]], None], int, str]] = {
    "chunk for an unknown request": (entry(3, req="Z"), 3, "req"),
    "chunk for a request that is no session": (entry(3, req="B"), 3, "req"),
    "chunk after the session's end": (
        then(
            entry(3, end=True, prompt=None, max_tokens=None),
            entry(5, end=None, prompt=[{"fresh": 8}], max_tokens=1),
        ),
        5,
        "req",
    ),
    "chunk without max_tokens": (entry(3, max_tokens=None), 3, "max_tokens"),
    "chunk copying a request": (entry(3, prompt=[{"all_of": "B"}]), 3, "prompt[0]"),
    "end carrying a chunk": (entry(5, max_tokens=2), 5, "max_tokens"),
    "end not a flag": (entry(5, end="yes"), 5, "end"),
    "resumable not a flag": (entry(0, resumable=1), 0, "resumable"),
    "session past max_model_len": (entry(3, max_tokens=470), 3, "max_tokens"),
    "session under async scheduling": (config(async_scheduling=True), 0, "resumable"),
    "session with a KV connector": (config(kv_connector=True), 0, "resumable"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_bad_session_entry_is_one_error_naming_step_and_field(case: str) -> None:
    edit, index, field = REFUSED[case]
    error = read_error(edited(edit))
    assert (error.step_index, error.field) == (index, field), str(error)


def test_the_session_entries_read_and_write_back() -> None:
    from kvgate.conformance.writer import engine_step_dicts

    trace = parse_trace(VALID, "t.yaml")
    written = engine_step_dicts(trace.engine)
    assert written[0]["resumable"] is True
    assert written[3] == {"op": "chunk", "req": "A", "prompt": [{"fresh": 8}], "max_tokens": 2}
    assert written[-1] == {"op": "chunk", "req": "A", "end": True}


def test_a_session_drops_its_last_sampled_token_and_keeps_the_rest_as_prompt() -> None:
    request = Request("A", list(range(20)), hash_unit=8)
    request.num_computed_tokens = 22
    request.append_output([100, 101, 102])  # 102 sampled last, never computed
    keys = list(request.keys)
    request.continue_session([7, 8, 9])
    assert request.all_token_ids == [*range(20), 100, 101, 7, 8, 9]
    assert request.prompt == request.all_token_ids and request.output == []
    # The keys of the blocks before the dropped token stay; the rest are new.
    assert request.keys[:2] == keys[:2] and len(request.keys) == 3


def test_the_corpus_has_the_session_shapes() -> None:
    names = {t.name for t in SESSIONS}
    assert {
        "sched-session-next-chunk-while-waiting",
        "sched-session-chunk-queued-while-running",
        "sched-mamba2-session-under-pressure.hold-on",
        "sched-mamba2-session-under-pressure.hold-off",
        "sched-session-lookahead-hashes-after-a-chunk",
    } <= names


def test_with_the_hold_a_preempted_session_is_admitted_again_past_its_prefix() -> None:
    """S's admission after its preemption: with the hold its prompt's cached
    prefix leaves 8 tokens to run, without it the whole first chunk again."""
    readmitted = {}
    for arm in ("hold-on", "hold-off"):
        trace = by_name(f"sched-mamba2-session-under-pressure.{arm}")
        after = [e for e in trace.engine if e.expect.get("finished") == ["X"]][0]
        [admission] = [e for e in trace.engine if e.index == after.index + 1]
        readmitted[arm] = admission.expect["scheduled"][0]
    assert readmitted == {"hold-on": ("S", 8), "hold-off": ("S", 64)}


def run(trace: Trace, real: Any = None) -> ReplayResult:
    return replay_scheduler(trace, SchedulerModel, real, "strict")


def _finish_at_stop(self: SchedulerModel, live: LiveRequest) -> bool:
    """The drift: a session's stop taken for its end (its blocks freed)."""
    return False


def test_a_model_that_frees_a_session_at_its_stop_refuses_its_next_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = by_name("sched-session-next-chunk-while-waiting")
    assert run(trace).passed
    monkeypatch.setattr(SchedulerModel, "_stop_session", _finish_at_stop)
    with pytest.raises(TraceError, match="no streaming-input session still open"):
        run(trace)


def vllm_scheduler(trace: Trace) -> Any:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert trace.scheduler is not None
    return VllmScheduler(
        trace.config, spec_tokens=trace.scheduler.spec, max_num_seqs=trace.scheduler.max_num_seqs
    )


def run_vllm(trace: Trace) -> ReplayResult:
    real = vllm_scheduler(trace)
    try:
        return run(trace, real)
    finally:
        real.close()


@needs_vllm
def test_a_model_that_frees_a_session_at_its_stop_diverges_from_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = by_name("sched-session-chunk-queued-while-running")
    monkeypatch.setattr(SchedulerModel, "_stop_session", _finish_at_stop)
    result = run_vllm(trace)
    divergence = result.divergence
    assert divergence is not None
    stop = next(e for e in trace.engine if e.expect.get("finished") == [])
    # vLLM keeps the session (the trace's `finished: []` holds); the model's
    # finish differs from it.
    assert (divergence.step.index, divergence.level) == (stop.index, "api")
    assert divergence.what.endswith("finished"), divergence.what


@needs_vllm
def test_a_model_that_keeps_the_last_sampled_token_diverges_from_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model folding the session's last sampled token into its prompt
    (vLLM drops it): the resumed chunk is one token longer than vLLM's."""
    original = Request.continue_session

    def keep_last(self: Request, tokens: list[int]) -> None:
        original(self, [0, *tokens])

    monkeypatch.setattr(Request, "continue_session", keep_last)
    trace = by_name("sched-session-next-chunk-while-waiting")
    divergence = run_vllm(trace).divergence
    assert divergence is not None
    assert divergence.level in ("api", "strict")
    chunk = next(e for e in trace.engine if e.op == "chunk")
    assert divergence.step.index >= chunk.index


@needs_vllm
def test_a_model_that_keeps_a_sessions_stale_hashes_at_its_lookup_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With lookahead hashes, the model looking a preempted session up with
    the keys it kept over its chunk (vLLM derives them again first): its
    admission takes another hit than vLLM's."""
    trace = by_name("sched-session-lookahead-hashes-after-a-chunk")
    assert run_vllm(trace).passed
    monkeypatch.setattr(Request, "rehash", lambda self: None)
    divergence = run_vllm(trace).divergence
    assert divergence is not None and divergence.level == "api"
    assert divergence.what.endswith("scheduled (request, tokens)"), divergence.what


@needs_vllm
def test_a_scheduler_that_frees_a_paused_sessions_slot_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler not counting paused sessions against max_num_seqs:
    C is admitted beside B while A waits for input."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._handle_stopped_request

    def uncounted(self: Any, request: Any) -> bool:
        finished: bool = original(self, request)
        self.num_waiting_for_streaming_input = 0
        return finished

    monkeypatch.setattr(Scheduler, "_handle_stopped_request", uncounted)
    trace = by_name("sched-session-next-chunk-while-waiting")
    divergence = run_vllm(trace).divergence
    assert divergence is not None
    first_b = next(e for e in trace.engine if e.expect.get("scheduled") == [("B", 32)])
    assert (divergence.step.index, divergence.what) == (first_b.index, "scheduled")


@needs_vllm
def test_a_session_trace_is_not_applicable_to_a_build_without_sessions() -> None:
    from kvgate.targets import run_scheduler_trace

    trace = by_name("sched-session-next-chunk-while-waiting")

    def without_sessions(*_: Any) -> Any:
        real = vllm_scheduler(trace)
        real.streaming_input = False
        return real

    outcome = run_scheduler_trace(trace, SchedulerModel, without_sessions, "strict")
    assert isinstance(outcome, TraceRunError) and outcome.config_refused
    assert "resumable" in outcome.message and "streaming-input" in outcome.message


@needs_vllm
def test_a_recorded_session_is_resumable_and_the_recording_ends_at_its_next_chunk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's Scheduler serves session A (its first chunk's output, then it
    waits) with the recorder on; the next chunk, which a recording cannot
    say yet, cuts it there, and the recording up to it replays."""
    from kvgate import cli
    from kvgate.impl import recorder

    trace = by_name("sched-session-next-chunk-while-waiting")
    recordings = tmp_path / "recordings"
    recorder.install(recordings)
    try:
        real = vllm_scheduler(trace)
        real.add_request("A", list(range(1000, 1100)), 3, None, resumable=True)
        for _ in range(5):
            scheduled = real.schedule().scheduled
            requests = real.scheduler.requests
            done = [
                n for n, _ in scheduled if requests[n].num_computed_tokens >= requests[n].num_tokens
            ]
            real.update({name: [5] for name in done})
        assert "A" not in {r.request_id for r in real.scheduler.running}  # it waits
        real.add_chunk("A", list(range(2000, 2040)), 2)
        real.close()
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    text = path.read_text()
    assert "resumable: true" in text
    assert "next input chunk" in caplog.text  # why the recording ended there
    for target in ("model", "vllm"):
        assert cli.main(["replay", str(path), "--target", target]) == 0
    # Recorded as a plain request, A finishes at its stop on the model while
    # vLLM's Scheduler keeps it.
    plain = tmp_path / "plain.yaml"
    plain.write_text(text.replace(", resumable: true", ""))
    assert cli.main(["replay", str(plain), "--target", "vllm"]) == 1
